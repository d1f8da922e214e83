//! Continuous webhook load from client threads, for tests that restart or upgrade under load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::try_request;

/// What a load run saw.
pub struct LoadResult {
    pub accepted: u64,
    pub failures: Vec<String>,
    /// The longest single request: the gap a client saw.
    pub worst: Duration,
}

/// Clients that POST continuously until stopped; counts successes and collects failures.
pub struct Load {
    stop: Arc<AtomicBool>,
    accepted: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    worst: Arc<Mutex<Duration>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    pub fn start(addr: std::net::SocketAddr, clients: usize) -> Load {
        Load::paced(addr, clients, None)
    }

    /// Like `start`, with the clients together aiming at `per_second` requests (each paces
    /// itself; a client that falls behind sends at once until it has caught up).
    pub fn at_rate(addr: std::net::SocketAddr, clients: usize, per_second: u32) -> Load {
        Load::paced(addr, clients, Some(per_second))
    }

    fn paced(addr: std::net::SocketAddr, clients: usize, per_second: Option<u32>) -> Load {
        let interval =
            per_second.map(|rate| Duration::from_secs_f64(clients as f64 / f64::from(rate.max(1))));
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let worst = Arc::new(Mutex::new(Duration::ZERO));
        let threads = (0..clients)
            .map(|client| {
                let (stop, accepted, failures, worst) = (
                    stop.clone(),
                    accepted.clone(),
                    failures.clone(),
                    worst.clone(),
                );
                std::thread::spawn(move || {
                    let mut n = 0;
                    let begun = Instant::now();
                    while !stop.load(Ordering::Relaxed) {
                        if let Some(interval) = interval {
                            let due = begun + interval * n;
                            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                                std::thread::sleep(wait);
                            }
                        }
                        let body = format!(r#"{{"session":"load-{client}-{n}"}}"#);
                        let started = Instant::now();
                        match try_request(
                            addr,
                            "POST",
                            "/hook",
                            &[("content-type", "application/json")],
                            body.as_bytes(),
                        ) {
                            Ok(r) if r.status == 202 => {
                                accepted.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(r) => failures
                                .lock()
                                .expect("lock")
                                .push(format!("status {}", r.status)),
                            Err(err) => failures.lock().expect("lock").push(err.to_string()),
                        }
                        if let Ok(mut worst) = worst.lock() {
                            *worst = (*worst).max(started.elapsed());
                        }
                        n += 1;
                    }
                })
            })
            .collect();
        Load {
            stop,
            accepted,
            failures,
            worst,
            threads,
        }
    }

    /// Waits until `more` requests past those accepted so far were accepted: the load is
    /// flowing (up to 30 s).
    pub fn wait_accepted(&self, more: u64) {
        let target = self.accepted.load(Ordering::Relaxed) + more;
        super::wait_until(
            &format!("{more} more accepted requests"),
            Duration::from_secs(30),
            || self.accepted.load(Ordering::Relaxed) >= target,
        );
    }

    /// Stops the clients and reports.
    pub fn finish(self) -> LoadResult {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads {
            let _ = thread.join();
        }
        LoadResult {
            accepted: self.accepted.load(Ordering::Relaxed),
            failures: self.failures.lock().map(|f| f.clone()).unwrap_or_default(),
            worst: self.worst.lock().map(|w| *w).unwrap_or_default(),
        }
    }
}
