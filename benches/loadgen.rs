//! A small HTTP/1.1 load generator for the benchmarks in `bench/`.
//!
//! Open loop at a fixed rate (`--rate N`): request `i` is due at `start + i/N`, and its latency is
//! measured from when it was due, so a stalled server shows up in the percentiles instead of
//! silently slowing the generator (no coordinated omission). `--rate 0` runs closed loop: every
//! connection sends its next request as soon as the last one is answered.
//!
//! Usage: cargo bench --bench loadgen -- --addr 127.0.0.1:8787 --path /hooks/x --body FILE
//!        [--header 'name: value']... [--rate 1000] [--connections 64] [--seconds 30]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Options {
    addr: String,
    path: String,
    body: Vec<u8>,
    headers: Vec<String>,
    rate: u64,
    connections: usize,
    seconds: u64,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        addr: "127.0.0.1:8787".into(),
        path: "/".into(),
        body: b"{}".to_vec(),
        headers: Vec::new(),
        rate: 0,
        connections: 64,
        seconds: 30,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--addr" => options.addr = value()?,
            "--path" => options.path = value()?,
            "--body" => {
                let path = value()?;
                options.body = std::fs::read(&path).map_err(|e| format!("{path}: {e}"))?;
            }
            "--header" => options.headers.push(value()?),
            "--rate" => options.rate = value()?.parse().map_err(|_| "--rate: a number")?,
            "--connections" => {
                options.connections = value()?.parse().map_err(|_| "--connections: a number")?;
            }
            "--seconds" => options.seconds = value()?.parse().map_err(|_| "--seconds: a number")?,
            "--bench" => {} // cargo bench passes this
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(options)
}

struct Shared {
    request: Vec<u8>,
    next: AtomicU64,
    start: Instant,
    end: Instant,
    rate: u64,
}

#[derive(Default)]
struct Tally {
    latencies_us: Vec<u64>,
    statuses: BTreeMap<u16, u64>,
    errors: u64,
}

async fn read_response(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> std::io::Result<u16> {
    buffer.clear();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buffer[..end]).to_ascii_lowercase();
            let status = head
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buffer.len() < end + 4 + length {
                let n = stream.read(&mut chunk).await?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                buffer.extend_from_slice(&chunk[..n]);
            }
            return Ok(status);
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buffer.extend_from_slice(&chunk[..n]);
    }
}

async fn worker(addr: String, shared: Arc<Shared>) -> Tally {
    let mut tally = Tally::default();
    let mut stream: Option<TcpStream> = None;
    let mut buffer = Vec::with_capacity(8192);
    loop {
        let due = if let Some(nanos_apart) = 1_000_000_000u64.checked_div(shared.rate) {
            let index = shared.next.fetch_add(1, Ordering::Relaxed);
            let due = shared.start + Duration::from_nanos(index * nanos_apart);
            if due >= shared.end {
                break;
            }
            if Instant::now() >= due {
                // Every connection was busy past the due time: that wait is the server's latency.
                due
            } else {
                // The timer wakes up to a millisecond late; that lateness is the generator's own.
                tokio::time::sleep_until(due.into()).await;
                Instant::now()
            }
        } else {
            let now = Instant::now();
            if now >= shared.end {
                break;
            }
            now
        };
        if stream.is_none() {
            if let Ok(s) = TcpStream::connect(&addr).await {
                let _ = s.set_nodelay(true);
                stream = Some(s);
            } else {
                tally.errors += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        }
        let Some(connection) = stream.as_mut() else {
            continue;
        };
        let outcome = match connection.write_all(&shared.request).await {
            Ok(()) => read_response(connection, &mut buffer).await,
            Err(err) => Err(err),
        };
        if let Ok(status) = outcome {
            tally.latencies_us.push(due.elapsed().as_micros() as u64);
            *tally.statuses.entry(status).or_default() += 1;
        } else {
            tally.errors += 1;
            stream = None;
        }
    }
    tally
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)] as f64 / 1000.0
}

fn main() -> Result<(), String> {
    let options = parse_options()?;
    let mut request = format!(
        "POST {} HTTP/1.1\r\nhost: {}\r\ncontent-length: {}\r\ncontent-type: application/json\r\n",
        options.path,
        options.addr,
        options.body.len()
    );
    for header in &options.headers {
        request.push_str(header);
        request.push_str("\r\n");
    }
    request.push_str("\r\n");
    let mut request = request.into_bytes();
    request.extend_from_slice(&options.body);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let shared = Arc::new(Shared {
        request,
        next: AtomicU64::new(0),
        start: started,
        end: started + Duration::from_secs(options.seconds),
        rate: options.rate,
    });
    let tallies = runtime.block_on(async {
        let workers: Vec<_> = (0..options.connections)
            .map(|_| tokio::spawn(worker(options.addr.clone(), shared.clone())))
            .collect();
        let mut tallies = Vec::new();
        for worker in workers {
            if let Ok(tally) = worker.await {
                tallies.push(tally);
            }
        }
        tallies
    });
    let elapsed = started.elapsed().as_secs_f64();
    let mut latencies: Vec<u64> = tallies
        .iter()
        .flat_map(|t| t.latencies_us.clone())
        .collect();
    latencies.sort_unstable();
    let mut statuses: BTreeMap<u16, u64> = BTreeMap::new();
    for tally in &tallies {
        for (status, count) in &tally.statuses {
            *statuses.entry(*status).or_default() += count;
        }
    }
    let errors: u64 = tallies.iter().map(|t| t.errors).sum();
    let statuses_json: Vec<String> = statuses
        .iter()
        .map(|(s, c)| format!("\"{s}\":{c}"))
        .collect();
    println!(
        "{{\"requests\":{},\"per_second\":{:.0},\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"p999_ms\":{:.3},\"max_ms\":{:.3},\"statuses\":{{{}}},\"errors\":{}}}",
        latencies.len(),
        latencies.len() as f64 / elapsed,
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99),
        percentile(&latencies, 0.999),
        latencies.last().copied().unwrap_or(0) as f64 / 1000.0,
        statuses_json.join(","),
        errors
    );
    Ok(())
}
