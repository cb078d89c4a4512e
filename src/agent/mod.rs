//! `berth agent`: the pull agent of one node (agents.md).
//!
//! Why it exists: berth reaches a node over SSH only when it can; a node
//! behind NAT, on a home connection or asleep half the day cannot be
//! reached, only reach out. The agent watches its node's desired-state
//! document (an event stream, or a long poll through proxies that buffer
//! streams), keeps the highest fence it has seen in its own state file
//! (synced before it acts on a document carrying it, so a replayed older
//! document is refused across its restarts), and reports what the node
//! runs: at start, on every change, and every `--report-interval`.
//! berth never connects to it.
//!
//! The agent's node is its state dir: a file artifact runs as
//! `<state-dir>/current` and boots as `<state-dir>/booted`, and a report
//! names their digests as they are when it is made, so a hand edit shows
//! at the next report.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::settings::AgentArgs;
use crate::worker::Api;

mod activate;
mod keep;
mod nix;
mod watch_desired;

/// Exit codes (agents.md "Running an agent").
pub const EXIT_STOPPED: i32 = 0;
pub const EXIT_STATE: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_REFUSED: i32 = 3;
/// One call's time limit.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest wait between tries to reach berth.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A health check's time limit.
const CHECK_TIMEOUT: Duration = Duration::from_secs(30);
/// The state file's layout.
const STATE_VERSION: u32 = 1;
/// The longest file artifact the agent digests for a report.
const MAX_DIGESTED_BYTES: u64 = 4 << 30;

/// Runs the agent until SIGTERM/SIGINT; returns its exit code.
pub fn run(args: AgentArgs) -> i32 {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("berth agent: cannot start: {e}");
            return EXIT_STATE;
        }
    };
    if let Err(e) = rustls::crypto::ring::default_provider().install_default() {
        // Another provider is installed already: it serves as well.
        tracing::debug!(?e, "a TLS provider was installed before the agent's");
    }
    if let Err(why) = crate::serve::init_tracing() {
        eprintln!("berth agent: {why}");
        return EXIT_USAGE;
    }
    runtime.block_on(async move {
        match Agent::start(args) {
            Ok(agent) => agent.serve().await,
            Err((code, why)) => {
                eprintln!("berth agent: {why}");
                code
            }
        }
    })
}

/// What the agent keeps across its restarts (`state.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct AgentState {
    version: u32,
    node: String,
    /// The highest fence it has seen: a document below it is refused.
    highest_fence: u64,
    /// The generation of the last document it acted on.
    generation: u64,
    /// The highest fence it claimed: an activation must be above it.
    highest_claimed: u64,
    /// The activation it holds, unconfirmed (reverted at a start).
    attempt: Option<activate::Held>,
    /// The artifacts it confirmed last (digests or store paths), newest
    /// last, at most `--keep`: what it keeps besides running and booted.
    #[serde(default)]
    confirmed: Vec<String>,
}

struct Agent {
    api: Api,
    args: AgentArgs,
    deployment: String,
    node: String,
    incarnation: String,
    state: AgentState,
    started: Instant,
    /// The last error it reports (`fence_regressed`, ...).
    last_error: Option<(String, String)>,
    /// The activation it holds, with its timers.
    held: Option<(activate::Held, activate::Live)>,
    /// A confirm changed the agent's own unit (`--unit`): it exits so
    /// systemd starts the new one.
    unit_changed: bool,
}

impl Agent {
    fn start(args: AgentArgs) -> Result<Agent, (i32, String)> {
        let usage = |why: String| (EXIT_USAGE, why);
        let (deployment, node) = args
            .node
            .split_once('/')
            .filter(|(d, n)| !d.is_empty() && crate::engine::verdict::valid_node_name(n))
            .map(|(d, n)| (d.to_string(), n.to_string()))
            .ok_or_else(|| usage("--node must be DEPLOYMENT/NODE, the node a DNS label".into()))?;
        check_url(&args.url, args.allow_http).map_err(usage)?;
        let token = read_token(&args.token_file).map_err(|why| (EXIT_STATE, why))?;
        prepare_state_dir(&args.state_dir).map_err(|why| (EXIT_STATE, why))?;
        let state = load_state(&args.state_dir, &args.node).map_err(|why| (EXIT_STATE, why))?;
        let api =
            Api::new(&args.url, token, args.ca_file.as_deref()).map_err(|why| (EXIT_STATE, why))?;
        Ok(Agent {
            api,
            incarnation: crate::worker::new_incarnation().map_err(|why| (EXIT_STATE, why))?,
            deployment,
            node,
            state,
            started: Instant::now(),
            last_error: None,
            held: None,
            unit_changed: false,
            args,
        })
    }

    fn node_path(&self) -> String {
        format!("/internal/v1/nodes/{}/{}", self.deployment, self.node)
    }

    /// Watches, reports, activates; until a signal (0) or a refused token
    /// (3). An unconfirmed activation is reverted before it exits.
    async fn serve(mut self) -> i32 {
        if self.state.attempt.is_some() {
            tracing::info!(
                "an unconfirmed activation from the last run: its authority died with it"
            );
            self.revert().await;
        }
        self.tidy().await;
        let mut stop = crate::worker::stop_signal();
        let (docs_tx, mut docs) = mpsc::channel::<Value>(4);
        let (refused_tx, refused) = watch::channel(false);
        let (reconnected_tx, reconnected) = watch::channel(0u64);
        let watcher = watch_desired::Watcher {
            api: self.api.clone(),
            path: format!("{}/desired", self.node_path()),
            transport: self.args.transport.clone(),
            docs: docs_tx,
            refused: refused_tx,
            reconnected: reconnected_tx,
            lost: std::sync::atomic::AtomicBool::new(false),
        };
        let watching = tokio::spawn(watcher.run(self.state.generation));
        tracing::info!(incarnation = %self.incarnation, node = %self.args.node, "berth agent started");
        let mut signals = Signals {
            refused,
            reconnected,
            stop: &mut stop,
        };
        let stopped = self.run(&mut docs, &mut signals).await;
        watching.abort();
        if self.held.is_some() {
            self.revert().await;
        }
        match stopped {
            Ok(code) => code,
            Err(why) => {
                eprintln!("berth agent: {why}");
                EXIT_STATE
            }
        }
    }

    /// The main loop: the exit code, or why the state file failed.
    async fn run(
        &mut self,
        docs: &mut mpsc::Receiver<Value>,
        signals: &mut Signals<'_>,
    ) -> Result<i32, String> {
        let mut failures: u32 = 0;
        let mut next_report = Instant::now();
        let far = || Instant::now() + Duration::from_secs(3600);
        loop {
            let (renew_at, health_at, revert_at) = match &self.held {
                Some((_, live)) => (live.next_renew, live.next_health, live.revert_at()),
                None => (far(), far(), far()),
            };
            tokio::select! {
                _ = tokio::time::sleep_until(next_report) => {}
                Some(doc) = docs.recv() => {
                    self.take(&doc)?;
                    if let Err(ReportFailure::Refused) = self.act(&doc).await {
                        return Ok(self.refused_code());
                    }
                    if self.unit_changed {
                        tracing::info!("the confirmed toplevel changed this agent's unit; exiting so systemd starts the new one");
                        return Ok(EXIT_STOPPED);
                    }
                }
                _ = tokio::time::sleep_until(renew_at) => {
                    if !self.renew().await {
                        self.revert().await;
                    }
                    continue;
                }
                _ = tokio::time::sleep_until(health_at) => {
                    if !self.health_step().await {
                        self.revert().await;
                    }
                    continue;
                }
                _ = tokio::time::sleep_until(revert_at) => {
                    tracing::warn!("no renew accepted within the revert window; going back");
                    let held = self.held.as_ref().map(|(h, _)| h.clone());
                    self.revert().await;
                    if let Some(held) = held {
                        self.outcome(&held, Some(("reverted", "no renew was accepted within the revert window"))).await;
                    }
                }
                // A watch answering again after a failure: report now.
                Ok(()) = signals.reconnected.changed() => {}
                _ = signals.refused.changed() => return Ok(self.refused_code()),
                _ = signals.stop.changed() => {
                    tracing::info!("berth agent stopped");
                    return Ok(EXIT_STOPPED);
                }
            }
            match self.report().await {
                Ok(()) => {
                    failures = 0;
                    next_report = Instant::now() + jittered(self.args.report_interval);
                }
                Err(ReportFailure::Refused) => return Ok(self.refused_code()),
                Err(ReportFailure::Again(wait)) => {
                    failures = failures.saturating_add(1);
                    next_report = Instant::now() + wait.unwrap_or_else(|| backoff(failures));
                }
            }
        }
    }

    fn refused_code(&self) -> i32 {
        eprintln!("berth agent: berth refused the token (revoked, or not this node's)");
        EXIT_REFUSED
    }

    /// What a document asks of the node: a new activation, a confirm, or
    /// (a higher fence, or steady for the one held) going back.
    async fn act(&mut self, doc: &Value) -> Result<(), ReportFailure> {
        let fence = doc["fence"].as_u64().unwrap_or(0);
        if fence < self.state.highest_fence {
            return Ok(());
        }
        let phase = doc["phase"].as_str().unwrap_or("steady");
        let held_fence = self.held.as_ref().map(|(h, _)| h.fence);
        if let Some(held) = held_fence {
            if fence > held || phase == "steady" {
                tracing::info!(fence, "berth ended the activation; going back");
                let h = self.held.as_ref().map(|(h, _)| h.clone());
                self.revert().await;
                if let Some(h) = h {
                    self.outcome(&h, Some(("reverted", "berth ended the activation")))
                        .await;
                }
            } else if phase == "confirm" && fence == held {
                self.confirm().await;
                return Ok(());
            }
        }
        if phase == "activate" && self.held.is_none() {
            return self.activate(doc).await;
        }
        Ok(())
    }

    fn save(&self) -> Result<(), String> {
        save_state(&self.args.state_dir, &self.state)
    }

    /// A document arrived: its fence is kept (synced) before anything is
    /// done with it; a lower one is refused.
    fn take(&mut self, doc: &Value) -> Result<(), String> {
        let fence = doc["fence"].as_u64().unwrap_or(0);
        let generation = doc["generation"].as_u64().unwrap_or(0);
        if fence < self.state.highest_fence {
            self.last_error = Some((
                "fence_regressed".into(),
                format!(
                    "a document with fence {fence}, below the {} this agent has seen",
                    self.state.highest_fence
                ),
            ));
            return Ok(());
        }
        self.state.highest_fence = fence;
        self.state.generation = generation;
        self.save()
    }

    /// One report of what the node runs now.
    async fn report(&mut self) -> Result<(), ReportFailure> {
        let dir = self.args.state_dir.clone();
        let (system, profile) = (
            self.args.current_system.clone(),
            self.args.system_profile.clone(),
        );
        let (running, booted) = tokio::task::spawn_blocking(move || {
            // A node runs files (its `current`) or a NixOS toplevel.
            match dir.join("current").exists() {
                true => (
                    file_artifact(&dir.join("current")),
                    file_artifact(&dir.join("booted")),
                ),
                false => (store_path_artifact(&system), store_path_artifact(&profile)),
            }
        })
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "reading the node's files failed");
            ReportFailure::Again(None)
        })?;
        let health = self.health().await;
        let body = json!({
            "operation_id": crate::worker::new_operation_id(),
            "fence": self.state.highest_fence,
            "worker_incarnation": self.incarnation,
            "generation": self.state.generation,
            "running": running,
            "booted": booted,
            "health": health,
            "last_error": self.last_error.as_ref().map(|(code, message)| json!({"code": code, "message": message})),
            "agent_version": env!("CARGO_PKG_VERSION"),
            "uptime_s": self.started.elapsed().as_secs(),
            "report_interval_ms": u64::try_from(self.args.report_interval.as_millis()).unwrap_or(u64::MAX),
        });
        let path = format!("{}/report", self.node_path());
        match self
            .api
            .call(reqwest::Method::POST, &path, Some(&body), CALL_TIMEOUT)
            .await
        {
            Ok((200, _)) => Ok(()),
            Ok((401 | 403, _)) => Err(ReportFailure::Refused),
            Ok((503, answer)) if answer["reason"] == json!("report_rate") => {
                Err(ReportFailure::Again(Some(Duration::from_secs(1))))
            }
            Ok((status, answer)) => {
                tracing::warn!(status, %answer, "berth refused a report");
                Err(ReportFailure::Again(None))
            }
            Err(why) => {
                tracing::warn!(%why, "cannot reach berth to report");
                Err(ReportFailure::Again(None))
            }
        }
    }

    /// The node's health: on a systemd node that runs a toplevel, the
    /// system's state first; then `--check-command`'s verdict (healthy
    /// without one).
    async fn health(&self) -> Value {
        let runs_files = self.args.state_dir.join("current").exists();
        if !runs_files && Path::new(SYSTEMD_BOOTED).is_dir() {
            if let Some(reason) = system_unhealthy().await {
                return json!({"healthy": false, "reason": reason});
            }
        }
        let Some(cmd) = &self.args.check_command else {
            return json!({"healthy": true, "reason": null});
        };
        let run = tokio::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(cmd)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        match tokio::time::timeout(CHECK_TIMEOUT, run).await {
            Ok(Ok(out)) if out.status.success() => json!({"healthy": true, "reason": null}),
            Ok(Ok(out)) => {
                let text = String::from_utf8_lossy(if out.stdout.is_empty() {
                    &out.stderr
                } else {
                    &out.stdout
                })
                .to_string();
                let last = text.lines().last().unwrap_or("the check command failed");
                json!({"healthy": false, "reason": last.chars().take(crate::nodes::MAX_REASON_CHARS).collect::<String>()})
            }
            Ok(Err(e)) => {
                json!({"healthy": false, "reason": format!("the check command could not run: {e}")})
            }
            Err(_) => json!({"healthy": false, "reason": "the check command ran past 30 s"}),
        }
    }
}

/// Exists when the node was booted with systemd (`sd_booted(3)`).
const SYSTEMD_BOOTED: &str = "/run/systemd/system";

/// `systemctl is-system-running`: `None` when `running`, else the state
/// and the failed units (agents.md "Artifacts").
async fn system_unhealthy() -> Option<String> {
    let systemctl = |args: &[&str]| {
        let mut c = tokio::process::Command::new("systemctl");
        c.args(args)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        tokio::time::timeout(CHECK_TIMEOUT, c.output())
    };
    let state = match systemctl(&["is-system-running"]).await {
        Ok(Ok(out)) => String::from_utf8_lossy(&out.stdout).trim().to_string(),
        Ok(Err(e)) => return Some(format!("systemctl could not run: {e}")),
        Err(_) => return Some("systemctl is-system-running ran past 30 s".into()),
    };
    if state == "running" {
        return None;
    }
    let failed = match systemctl(&["list-units", "--failed", "--plain", "--no-legend"]).await {
        Ok(Ok(out)) => String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .collect::<Vec<_>>()
            .join(", "),
        Ok(Err(_)) | Err(_) => String::new(),
    };
    let reason = match failed.is_empty() {
        true => format!("the system is {state}"),
        false => format!("the system is {state}; failed: {failed}"),
    };
    Some(
        reason
            .chars()
            .take(crate::nodes::MAX_REASON_CHARS)
            .collect(),
    )
}

/// What the main loop hears besides documents: the token refused, a
/// watch answering again after a failure, a stop signal.
struct Signals<'a> {
    refused: watch::Receiver<bool>,
    reconnected: watch::Receiver<u64>,
    stop: &'a mut watch::Receiver<()>,
}

/// Why a report did not land.
enum ReportFailure {
    /// berth refused the token: the agent stops.
    Refused,
    /// Try again after this (or the backoff).
    Again(Option<Duration>),
}

/// The n-th failure in a row waits a random time in [0, min(30 s, 2^n s)],
/// so many agents spread over a restart of berth.
fn backoff(n: u32) -> Duration {
    let ceiling = Duration::from_secs(1u64 << n.min(5)).min(MAX_BACKOFF);
    ceiling.mul_f64(random_fraction())
}

/// A report interval drawn from 90-110% of it.
fn jittered(interval: Duration) -> Duration {
    interval.mul_f64(0.9 + 0.2 * random_fraction())
}

fn random_fraction() -> f64 {
    let mut b = [0u8; 4];
    match getrandom::fill(&mut b) {
        Ok(()) => f64::from(u32::from_le_bytes(b)) / f64::from(u32::MAX),
        // No randomness: no spread, still correct.
        Err(_) => 0.5,
    }
}

/// A toplevel as a report names it: where `link` leads in the store
/// (links followed); null when it leads nowhere there.
fn store_path_artifact(link: &Path) -> Value {
    match std::fs::canonicalize(link) {
        Ok(path) if path.starts_with("/nix/store/") => {
            json!({"kind": "nix-store-path", "path": path.to_string_lossy()})
        }
        Ok(_) | Err(_) => Value::Null,
    }
}

/// Runs `command` (stdin closed, killed if the agent drops it); `Err`
/// says `what` failed, with the last line it wrote to stderr.
async fn run_command(mut command: tokio::process::Command, what: &str) -> Result<(), String> {
    let out = command
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| format!("{what} could not run: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    Err(match text.lines().last() {
        Some(line) => format!("{what} failed: {line}"),
        None => format!("{what} failed ({})", out.status),
    })
}

/// `sha256:<hex>` of `bytes`.
fn digest_of(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    format!("sha256:{}", crate::hex::encode(&Sha256::digest(bytes)))
}

/// A file artifact as a report names it: its digest and size; null when
/// there is no such file.
fn file_artifact(path: &Path) -> Value {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let Ok(file) = std::fs::File::open(path) else {
        return Value::Null;
    };
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    let mut reader = std::io::BufReader::new(file.take(MAX_DIGESTED_BYTES));
    let mut buf = [0u8; 64 * 1024];
    loop {
        match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                hasher.update(&buf[..n]);
                size += n as u64;
            }
            Err(e) => {
                tracing::warn!(error = %e, path = %path.display(), "cannot read a node's file");
                return Value::Null;
            }
        }
    }
    json!({"kind": "file", "digest": format!("sha256:{}", crate::hex::encode(&hasher.finalize())), "size": size})
}

fn check_url(url: &str, allow_http: bool) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("--url: {e}"))?;
    let loopback = parsed.host_str().is_some_and(|h| {
        let h = h.trim_matches(['[', ']']);
        h == "localhost"
            || h.parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    });
    if parsed.scheme() != "https" && !loopback && !allow_http {
        return Err(
            "--url must be https unless berth is on loopback or --allow-http is given".into(),
        );
    }
    Ok(())
}

/// The token, refused when group or others may read its file.
fn read_token(path: &Path) -> Result<String, String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path)
        .map_err(|e| format!("cannot read --token-file {}: {e}", path.display()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(format!(
            "--token-file {} may be read by group or others; chmod 600 it",
            path.display()
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read --token-file {}: {e}", path.display()))?;
    Ok(text.trim().to_string())
}

fn prepare_state_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    crate::durable::create_dir_all(dir, 0o700)
        .and_then(|_| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)))
        .map_err(|e| format!("cannot make the state dir {}: {e}", dir.display()))
}

fn state_path(dir: &Path) -> PathBuf {
    dir.join("state.json")
}

/// The state file, or a fresh state for a new node; a file for another
/// node or of another layout is refused.
fn load_state(dir: &Path, node: &str) -> Result<AgentState, String> {
    let path = state_path(dir);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(AgentState {
                version: STATE_VERSION,
                node: node.to_string(),
                highest_fence: 0,
                generation: 0,
                highest_claimed: 0,
                attempt: None,
                confirmed: Vec::new(),
            })
        }
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let state: AgentState = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not an agent's state file: {e}", path.display()))?;
    if state.version != STATE_VERSION || state.node != node {
        return Err(format!(
            "{} belongs to node {} (layout {}); give this node a state dir of its own",
            path.display(),
            state.node,
            state.version
        ));
    }
    Ok(state)
}

/// Writes the state file whole (temporary file, sync, rename, sync).
fn save_state(dir: &Path, state: &AgentState) -> Result<(), String> {
    let bytes = serde_json::to_vec_pretty(state).map_err(|e| e.to_string())?;
    crate::durable::replace(&state_path(dir), &bytes, 0o600)
        .map_err(|e| format!("cannot write {}: {e}", state_path(dir).display()))
}
