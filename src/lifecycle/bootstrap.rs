//! Everything that happens before the daemon accepts anything, in the order it must happen.
//!
//! The first part runs on the main thread before the async runtime exists: inherited descriptors
//! are marked close-on-exec before any thread could start a tool, the state directory is locked,
//! and the sockets systemd passed (taken before the config was read) are used, or the configured
//! ones bound. So every startup problem exits with its own sysexits status and one line that
//! says what is wrong, before anything is accepted (a config error under socket activation is
//! held instead: `standby.rs`). The second part opens the store and cleans up after the previous
//! run: turns it left running are marked crashed, processes its tools left behind are killed;
//! while either waits, `standby.rs` answers 503.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::standby::Standby;
use crate::agent::model::Model;
use crate::agent::sandbox::ToolUnits;
use crate::config::{self, Config, ConfigSource, LocatedFinding};
use crate::exit::Failure;
use crate::ingress::{self, ListenError, Listeners};
use crate::store::{self, DaemonLock, Store, StoreError};

/// The first pause of the waits before READY; each next one doubles, up to `LAST_RETRY`.
const FIRST_RETRY: Duration = Duration::from_millis(250);
const LAST_RETRY: Duration = Duration::from_secs(5);

/// What the main thread prepared: the checked config, the lock on the state directory (held
/// until the process ends), the listening sockets and the async runtime.
pub(super) struct Bootstrap {
    pub config: Config,
    pub lock: DaemonLock,
    pub listeners: Listeners,
    pub runtime: tokio::runtime::Runtime,
}

impl Bootstrap {
    /// Call before any thread exists.
    pub(super) fn prepare(
        source: &ConfigSource,
        loaded: config::Loaded,
        inherited: Option<Listeners>,
    ) -> Result<Bootstrap, Failure> {
        for finding in &loaded.warnings {
            tracing::warn!("{}", LocatedFinding { source, finding });
        }
        let config = loaded.config;
        if *source == ConfigSource::Embedded {
            tracing::warn!(
                "no config file at {}; running on the embedded quickstart defaults (state in {})",
                config::DEFAULT_CONFIG_PATH,
                config.state_dir.display()
            );
        }
        raise_open_file_limit();
        report_sandbox(&config);
        for finding in config::loosened(&config, source, config::Writer::ThisProcess) {
            tracing::warn!("{finding}");
        }
        // Before any thread exists: nothing inherited from the parent reaches a tool.
        let marked = crate::sys::keep_inherited_descriptors_from_children();
        if marked > 0 {
            tracing::debug!(count = marked, "inherited descriptors marked close-on-exec");
        }
        // Tool units run as the service's user: non-dumpable, this process's /proc entries
        // (its environment, memory, descriptors, and its root, through which its view of the
        // state and credentials could be walked) belong to root, out of their reach. It also
        // means no core dump.
        if let Err(err) = nix::sys::prctl::set_dumpable(false) {
            tracing::warn!(error = %err, "cannot make the daemon non-dumpable");
        }
        refuse_root_on_a_users_state(&config.state_dir)?;
        store::ensure_state_dir(&config.state_dir).map_err(Failure::state)?;
        let lock = DaemonLock::acquire(&config.state_dir).map_err(Failure::state)?;
        let listeners = ingress::take_listeners(&config, inherited).map_err(|err| match err {
            ListenError::Bind { .. } => Failure::unavailable(err),
            ListenError::Activation(_) | ListenError::UnsignedOffLoopback { .. } => {
                Failure::config(err)
            }
        })?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("agentgate")
            .build()
            .map_err(|err| Failure::runtime(format!("cannot start the async runtime: {err}")))?;
        Ok(Bootstrap {
            config,
            lock,
            listeners,
            runtime,
        })
    }
}

/// Opens the configured store. A database server that cannot be reached yet is waited for
/// (the sockets stay with systemd meanwhile, so clients wait rather than being refused); a
/// store that cannot work (bad settings, unusable state directory) is a failure at once.
pub(super) async fn open_store(config: &Config, standby: &mut Standby) -> Result<Store, Failure> {
    retry_while(
        standby,
        StoreError::is_transient,
        "cannot open the PostgreSQL store yet",
        "waiting for PostgreSQL",
        || Store::open(&config.store, &config.state_dir),
    )
    .await
    .map_err(Failure::from)
}

/// The configured model; `record` appends every reply to a cassette file.
pub(super) fn open_model(config: &Config, record: Option<&Path>) -> Result<Arc<Model>, Failure> {
    let model = Model::new(&config.model, record).map_err(Failure::config)?;
    if model.is_replay() {
        tracing::warn!(
            "the model is a replay of recorded replies (backend = \"replay\"), not a live model"
        );
    }
    Ok(Arc::new(model))
}

/// Cleans up after the previous run, before any turn, tool or MCP server starts: turns found
/// running were cut off by a crash and resume as crashed; processes its tools left behind are
/// killed.
///
/// Marking the crashed turns is a write. While the state cannot be written (a full disk, failing
/// fsync, a database server that went away) it is tried again, with `STATUS=` saying why, rather
/// than exiting: a disk that fills up and is freed again must not turn into a restart loop. The
/// sockets stay with systemd meanwhile, and its start timeout bounds the wait.
pub(super) async fn recover_previous_run(
    store: &Store,
    state_dir: &Path,
    standby: &mut Standby,
) -> Result<(), Failure> {
    let crashed = retry_while(
        standby,
        StoreError::is_write_refused,
        "cannot mark the turns the last run left running; waiting for the state to be writable",
        "waiting for the state to be writable",
        || store.mark_crashed_turns(),
    )
    .await
    .map_err(|err| Failure::state(format!("cannot mark crashed turns: {err}")))?;
    if crashed > 0 {
        tracing::warn!(
            count = crashed,
            "turns were running when agentgate last stopped; they are resumed as crashed"
        );
    }
    let leftovers = crate::agent::process::claim_and_reap_leftovers(state_dir);
    if leftovers > 0 {
        tracing::warn!(
            count = leftovers,
            "killed processes that tools of the previous run left behind"
        );
    }
    Ok(())
}

/// Runs `attempt` until it returns anything but an error that `may_clear`. Each such failure
/// is logged as `warning` and, after `status`, shown in `STATUS=` and answered with 503 by
/// `standby`; the next try follows after a pause of 250 ms, doubling up to 5 s.
async fn retry_while<T, F>(
    standby: &mut Standby,
    may_clear: fn(&StoreError) -> bool,
    warning: &str,
    status: &str,
    mut attempt: impl FnMut() -> F,
) -> Result<T, StoreError>
where
    F: Future<Output = Result<T, StoreError>>,
{
    let mut delay = FIRST_RETRY;
    loop {
        match attempt().await {
            Err(err) if may_clear(&err) => {
                tracing::warn!(error = %err, retry_in = ?delay, "{warning}");
                standby.waiting(&format!("not serving yet: {status}: {err}"));
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(LAST_RETRY);
            }
            other => return other,
        }
    }
}

/// A daemon run as root on a state directory that belongs to another user (the service's) would
/// leave files there that the service can no longer open: its next start would exit 73. So it
/// does not start, and says how to run it instead.
fn refuse_root_on_a_users_state(state_dir: &Path) -> Result<(), Failure> {
    use std::os::unix::fs::MetadataExt;
    let Some(metadata) = store::StateDir::new(state_dir).owner_other_than_root() else {
        return Ok(());
    };
    let owner = crate::operator::user_name(metadata.uid());
    Err(Failure::state(format!(
        "refusing to serve as root: the state directory {} belongs to {owner}, and files created \
         as root there would lock that user out; run `systemctl start agentgate`, or \
         `runuser -u {owner} -- agentgate serve`",
        state_dir.display()
    )))
}

/// Probes the tool sandbox (before any thread: the probe waits for a process) and says what it
/// found; without one, every strict child of the config is named, since none of them will run.
/// Under the packaged units, each `writable` path a tool unit cannot write is a warning now,
/// rather than a failed call later.
fn report_sandbox(config: &Config) {
    match crate::agent::sandbox::availability() {
        crate::agent::sandbox::Availability::Ready { version, units, .. } => match units {
            ToolUnits::Ready(sockets) => tracing::info!(sandbox = "bubblewrap", version = %version,
                    units = %sockets.strict.display(), "tool sandbox ready; each call runs in a unit of its own"),
            ToolUnits::NotConfigured => {
                tracing::info!(sandbox = "bubblewrap", version = %version, "tool sandbox ready");
            }
        },
        crate::agent::sandbox::Availability::Unavailable(reason) => {
            let strict: Vec<String> = config::strict_children(config)
                .into_iter()
                .map(|child| child.key)
                .collect();
            if !strict.is_empty() {
                tracing::error!(reason = %reason, children = %strict.join(", "),
                    "no tool sandbox: these run only sandboxed and will fail until one can be set up");
            }
        }
    }
    for warning in crate::agent::sandbox::check_writable(config) {
        tracing::warn!("{warning}");
    }
}

/// Raises the soft limit on open files to the hard limit: connections, the store and tool pipes
/// all take descriptors, and the soft default (1,024) is far below `server.max_connections`.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(err) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(soft, hard, error = %err, "cannot raise the open-file limit");
            }
        }
        Ok(_) => {}
        Err(err) => tracing::warn!(error = %err, "cannot read the open-file limit"),
    }
}
