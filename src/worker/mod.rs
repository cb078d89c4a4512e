//! `berth worker`: runs builds for a berth on another machine (workers.md).
//!
//! Why it exists: the machine that runs berth is often too small to build
//! what it deploys. A worker polls berth's queue, claims a build (an
//! attempt with a fence and a lease), runs the deployer exactly as berth
//! runs it (`engine::runner`: the same gate, process group, environment
//! and line splitting), streams its lines in numbered batches, renews its
//! lease, and reports the outcome. It never decides a build's state:
//! berth does, and refuses whatever the worker sends without authority.
//!
//! The worker fences itself: an attempt's deadline is when it *sent* its
//! last successful claim or renew plus the lease, on its own monotonic
//! clock; past it, or when berth says its authority is stale, it stops
//! the deployer, sends nothing more for that attempt, and keeps its work
//! dir under `lost/`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::authority;
use crate::engine::deployer::OneCall;
use crate::engine::health::{
    health_step, CallEnd, HealthAnswer, HealthEnd, HealthIo, HealthLimits,
};
use crate::engine::outcome::Halt as HealthHalt;
use crate::engine::runner::{self, CallDirs, DeployerCommand, Ended, Invocation};
use crate::model::Job;
use crate::settings::WorkerArgs;

mod files;
mod rollout;
use files::Carried;

/// Exit codes (workers.md "`berth worker`").
pub const EXIT_STOPPED: i32 = 0;
pub const EXIT_WORK_DIR: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_REFUSED: i32 = 3;
/// The longest pause between tries to reach berth.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A batch goes at most this long after its first unsent item.
const BATCH_DELAY: Duration = Duration::from_millis(100);
/// Items, and bytes of lines, in one progress batch at most.
const BATCH_ITEMS: usize = authority::MAX_BATCH_ITEMS;
const BATCH_BYTES: usize = 512 * 1024;
/// Items held unsent at most (a few batches); past it the deployer's
/// output waits in its pipe.
const MAX_PENDING: usize = 4 * BATCH_ITEMS;
/// One call's time limit (a poll's is its wait plus this).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest answer the worker reads (a claim carries a configuration
/// of at most berth's `--max-body`, 1 MiB by default).
const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;
/// A queue poll's wait.
const POLL_WAIT_S: u64 = 25;
/// Lost attempts' work dirs kept under `lost/`.
const KEEP_LOST: usize = 10;

/// Runs the worker until SIGTERM/SIGINT; returns its exit code.
pub fn run(args: WorkerArgs) -> i32 {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("berth worker: cannot start: {e}");
            return EXIT_WORK_DIR;
        }
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    if let Err(why) = crate::serve::init_tracing() {
        eprintln!("berth worker: {why}");
        return EXIT_USAGE;
    }
    runtime.block_on(async move {
        match Worker::start(args).await {
            Ok(worker) => worker.serve().await,
            Err((code, why)) => {
                eprintln!("berth worker: {why}");
                code
            }
        }
    })
}

/// What an attempt's task reports when it ends.
#[derive(Debug, Clone, Copy)]
enum AttemptEnd {
    Done,
    /// berth refused the worker's token: the worker stops.
    TokenRefused,
}

struct Worker {
    api: Api,
    args: WorkerArgs,
    deployer: DeployerCommand,
    incarnation: String,
    /// Held for the worker's life: a second worker on the dir fails.
    _lock: nix::fcntl::Flock<std::fs::File>,
}

impl Worker {
    async fn start(args: WorkerArgs) -> Result<Worker, (i32, String)> {
        let usage = |why: String| (EXIT_USAGE, why);
        let url = reqwest::Url::parse(&args.url).map_err(|e| usage(format!("--url: {e}")))?;
        let loopback = url.host_str().is_some_and(|h| {
            h == "localhost"
                || h.parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
                || h.trim_matches(['[', ']'])
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        });
        if url.scheme() != "https" && !loopback && !args.allow_http {
            return Err(usage(
                "--url must be https unless berth is on loopback or --allow-http is given".into(),
            ));
        }
        let token = std::fs::read_to_string(&args.token_file)
            .map_err(|e| {
                (
                    EXIT_WORK_DIR,
                    format!(
                        "cannot read --token-file {}: {e}",
                        args.token_file.display()
                    ),
                )
            })?
            .trim()
            .to_string();
        let deployer =
            DeployerCommand::from_setting(args.deployer.as_deref(), args.deployer_user.as_deref())
                .map_err(usage)?;
        let mut args = args;
        let lock = lock_work_dir(&args.work_dir).map_err(|why| (EXIT_WORK_DIR, why))?;
        // The deployer runs in its work dir: every path it is given is absolute.
        args.work_dir = std::fs::canonicalize(&args.work_dir).map_err(|e| {
            (
                EXIT_WORK_DIR,
                format!("cannot resolve {}: {e}", args.work_dir.display()),
            )
        })?;
        stop_orphans(&args.work_dir.join("jobs")).await;
        let api = Api::new(&args.url, token, args.ca_file.as_deref())
            .map_err(|why| (EXIT_WORK_DIR, why))?;
        Ok(Worker {
            api,
            deployer,
            incarnation: new_incarnation().map_err(|why| (EXIT_WORK_DIR, why))?,
            args,
            _lock: lock,
        })
    }

    /// Polls, claims, runs; until a signal (0) or a refused token (3).
    async fn serve(self) -> i32 {
        let me = Arc::new(self);
        let mut stop = stop_signal();
        let (ended_tx, mut ended_rx) = mpsc::channel::<(String, AttemptEnd)>(64);
        let mut running: HashMap<String, watch::Sender<Halt>> = HashMap::new();
        let mut backoff = Duration::from_millis(100);
        let labels = me.args.labels.0.join(",");
        tracing::info!(incarnation = %me.incarnation, "berth worker started");
        loop {
            let free = usize::from(me.args.slots).saturating_sub(running.len());
            let path = format!(
                "/internal/v1/queue?worker_incarnation={}&labels={labels}&free_slots={free}&wait={POLL_WAIT_S}",
                me.incarnation
            );
            let poll = me.api.call::<Value>(
                reqwest::Method::GET,
                &path,
                None,
                CALL_TIMEOUT + Duration::from_secs(POLL_WAIT_S),
            );
            let answer = tokio::select! {
                answer = poll => answer,
                Some((attempt, end)) = ended_rx.recv() => {
                    running.remove(&attempt);
                    if let AttemptEnd::TokenRefused = end {
                        return me.refused(&mut running, &mut ended_rx).await;
                    }
                    continue;
                }
                _ = stop.changed() => return me.shut_down(running, ended_rx).await,
            };
            let body = match answer {
                Ok((200, body)) => body,
                Ok((401 | 403, _)) => return me.refused(&mut running, &mut ended_rx).await,
                Ok((status, body)) => {
                    tracing::warn!(status, %body, "berth refused a queue poll; trying again");
                    backoff = pause(backoff).await;
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot reach berth; trying again");
                    backoff = pause(backoff).await;
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            for c in body["cancel"].as_array().into_iter().flatten() {
                if let Some(halt) = c["attempt_id"].as_str().and_then(|a| running.get(a)) {
                    let _ = halt.send(Halt::Cancel);
                }
            }
            for b in body["builds"].as_array().into_iter().flatten() {
                if running.len() >= usize::from(me.args.slots) {
                    break;
                }
                let Some(build) = b["build"].as_str() else {
                    continue;
                };
                if let Some((attempt, halt)) = me.claim_and_run(build, ended_tx.clone()).await {
                    running.insert(attempt, halt);
                }
            }
        }
    }

    /// Claims `build`; on a win, runs it in a task of its own and returns
    /// its attempt id and its halt switch.
    async fn claim_and_run(
        self: &Arc<Self>,
        build: &str,
        ended: mpsc::Sender<(String, AttemptEnd)>,
    ) -> Option<(String, watch::Sender<Halt>)> {
        let body = json!({
            "operation_id": new_operation_id(),
            "worker_incarnation": self.incarnation,
            "labels": self.args.labels.0,
        });
        let sent = Instant::now();
        let path = format!("/internal/v1/builds/{build}/claim");
        let answer = self
            .api
            .resend(reqwest::Method::POST, &path, &body, sent + CALL_TIMEOUT * 2)
            .await;
        let claim = match answer {
            Ok((200, claim)) => claim,
            Ok((status, body)) => {
                tracing::info!(status, reason = %body["reason"], %build, "claim not won");
                return None;
            }
            Err(e) => {
                tracing::warn!(error = %e, %build, "claim unanswered");
                return None;
            }
        };
        let Some(attempt) = Attempt::from_claim(&claim, sent) else {
            // Its lease ends on berth's side; nothing runs here.
            tracing::error!(%build, "a claim answer this worker cannot read; the build will be lost a lease later");
            return None;
        };
        let id = attempt.id.clone();
        let (halt_tx, halt_rx) = watch::channel(Halt::No);
        let me = self.clone();
        tokio::spawn(async move {
            let end = me.run_attempt(attempt, claim, halt_rx).await;
            let _ = ended.send((end.0, end.1)).await;
        });
        Some((id, halt_tx))
    }

    /// Stops every running attempt (their deployers first) and exits 3.
    async fn refused(
        &self,
        running: &mut HashMap<String, watch::Sender<Halt>>,
        ended: &mut mpsc::Receiver<(String, AttemptEnd)>,
    ) -> i32 {
        eprintln!("berth worker: berth refused this worker's token (revoked or unknown); stopping");
        for halt in running.values() {
            let _ = halt.send(Halt::Fenced);
        }
        while !running.is_empty() {
            match ended.recv().await {
                Some((attempt, _)) => {
                    running.remove(&attempt);
                }
                None => break,
            }
        }
        EXIT_REFUSED
    }

    /// A signal: no new claims; running attempts get `--shutdown-grace`,
    /// then end as a cancel does (`shutdown`).
    async fn shut_down(
        &self,
        mut running: HashMap<String, watch::Sender<Halt>>,
        mut ended: mpsc::Receiver<(String, AttemptEnd)>,
    ) -> i32 {
        tracing::info!(running = running.len(), "stopping: no new claims");
        let deadline = Instant::now() + self.args.shutdown_grace;
        while !running.is_empty() {
            tokio::select! {
                Some((attempt, _)) = ended.recv() => { running.remove(&attempt); }
                _ = tokio::time::sleep_until(deadline) => {
                    for halt in running.values() {
                        let _ = halt.send(Halt::Shutdown);
                    }
                    while !running.is_empty() {
                        match ended.recv().await {
                            Some((attempt, _)) => { running.remove(&attempt); }
                            None => break,
                        }
                    }
                }
            }
        }
        EXIT_STOPPED
    }
}

/// Why an attempt's deployer is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Halt {
    No,
    Cancel,
    Shutdown,
    /// Its authority is gone (deadline, refusal, revoked token): nothing
    /// more is sent for it.
    Fenced,
}

/// One attempt as its claim gave it.
struct Attempt {
    id: String,
    fence: u64,
    ttl: Duration,
    /// When its authority ends on this machine's clock.
    deadline: Instant,
    build_timeout: Option<Duration>,
    cancel_grace: Duration,
    deployment: String,
    verb: &'static str,
    /// The digest of the work state the claim hands out (`None`: empty).
    work_state: Option<String>,
    max_work_state: u64,
    /// The largest file artifact berth takes (`--max-artifact-bytes`).
    max_artifact_bytes: u64,
    /// A rollout build: berth hands out its calls after the deploy.
    rollout: bool,
}

impl Attempt {
    fn from_claim(claim: &Value, sent: Instant) -> Option<Attempt> {
        let ms = |v: &Value| v.as_u64().map(Duration::from_millis);
        let id = claim["authority"]["attempt_id"].as_str()?.to_string();
        let ttl = ms(&claim["lease_ttl_ms"])?;
        let verb = match claim["verb"].as_str()? {
            "deploy" => "deploy",
            "destroy" => "destroy",
            _ => return None,
        };
        let timeout = ms(&claim["limits"]["build_timeout_ms"])?;
        let deployment = claim["build"]["deployment"].as_str()?;
        if !crate::model::is_valid_deployment_id(deployment) || !authority::is_authority_id(&id) {
            return None;
        }
        Some(Attempt {
            id,
            fence: claim["authority"]["fence"].as_u64()?,
            ttl,
            deadline: sent + ttl,
            build_timeout: (!timeout.is_zero()).then_some(timeout),
            cancel_grace: ms(&claim["limits"]["cancel_grace_ms"])?,
            deployment: deployment.to_string(),
            verb,
            work_state: match &claim["work_state"] {
                Value::Null => None,
                w => Some(
                    w["digest"]
                        .as_str()
                        .filter(|d| crate::archive::is_digest(d))?
                        .to_string(),
                ),
            },
            max_work_state: claim["limits"]["max_work_state"].as_u64()?,
            max_artifact_bytes: claim["limits"]["max_artifact_bytes"].as_u64()?,
            rollout: claim["rollout"].as_bool().unwrap_or(false),
        })
    }
}

impl Worker {
    /// Runs one attempt to its outcome (or its loss).
    async fn run_attempt(
        self: Arc<Self>,
        mut a: Attempt,
        claim: Value,
        halt: watch::Receiver<Halt>,
    ) -> (String, AttemptEnd) {
        let id = a.id.clone();
        let work_dir = self.args.work_dir.join("work").join(&a.deployment);
        let root = self.args.work_dir.join("scratch").join(&id);
        let job_file = self.args.work_dir.join("jobs").join(format!("{id}.json"));
        if a.rollout && claim["deployed"].as_bool() == Some(true) {
            let end = self.clone().take_over(a, halt, &work_dir, &root).await;
            remove_dir(&root);
            return (id, end);
        }
        let started = match self.restore(&a, &work_dir).await {
            Ok(()) => self.start_deployer(&a, &claim, &work_dir, &root, &job_file),
            Err(detail) => Err(
                json!({"kind": "not_run", "reason": "work_state_unavailable", "detail": detail}),
            ),
        };
        let spawned = match started {
            Ok(spawned) => spawned,
            Err(ended) => {
                let carried = Carried::untouched(&a);
                let end = self
                    .send_outcome(&mut a, 0, ended, None, Value::Null, carried)
                    .await;
                return (id, end);
            }
        };
        let (lines_tx, lines_rx) = mpsc::channel::<runner::Lines>(64);
        let (stop_tx, stop_rx) = watch::channel(false);
        let (timeout, grace) = (a.build_timeout, a.cancel_grace);
        let waiter = tokio::spawn(runner::wait(spawned, timeout, grace, stop_rx, lines_tx));
        let (renewed_tx, renewed) = watch::channel(a.deadline);
        let (fence_tx, fenced) = watch::channel(None::<AttemptEnd>);
        let renewer = tokio::spawn(self.clone().renew_loop(
            a.id.clone(),
            a.fence,
            a.ttl,
            renewed_tx,
            fence_tx,
        ));
        let mut run = Run {
            courier: Courier::default(),
            lines: lines_rx,
            stop: stop_tx,
            renewed,
            fenced,
            halt,
            halted: Halt::No,
        };
        let gone = self.pump(&mut a, &mut run).await;
        let ended = waiter.await;
        remove_file(&job_file);
        let end = match gone {
            Some(end) => {
                keep_lost(&self.args.work_dir, &work_dir, &id);
                end
            }
            None => {
                self.conclude(&mut a, &claim, &mut run, ended, &work_dir, &root)
                    .await
            }
        };
        renewer.abort();
        remove_dir(&root);
        (id, end)
    }

    /// The deployer behind its gate, its process recorded in `jobs/` before
    /// the gate opens; `Err` is the `not_run` end to report.
    fn start_deployer(
        &self,
        a: &Attempt,
        claim: &Value,
        work_dir: &Path,
        root: &Path,
        job_file: &Path,
    ) -> Result<runner::Spawned, Value> {
        let not_run =
            |detail: String| json!({"kind": "not_run", "reason": "spawn_failed", "detail": detail});
        let dirs = CallDirs::create(root.to_path_buf())
            .and_then(|dirs| std::fs::create_dir_all(work_dir).map(|_| dirs))
            .map_err(|e| not_run(format!("cannot create the build's directories: {e}")))?;
        let inv = Invocation {
            verb: a.verb,
            request: claim["request"].to_string().into_bytes(),
            work_dir: work_dir.to_path_buf(),
            scratch_dir: dirs.scratch,
            result_path: dirs.result_path,
        };
        let mut spawned = runner::spawn(&self.deployer, &inv)
            .map_err(|e| not_run(format!("the deployer could not be started: {e}")))?;
        if let Err(e) = record_job(job_file, spawned.job, a.cancel_grace) {
            spawned.abandon();
            runner::signal_group(spawned.job.pid, nix::sys::signal::Signal::SIGKILL);
            return Err(not_run(format!(
                "cannot record the deployer's process: {e}"
            )));
        }
        spawned.start();
        Ok(spawned)
    }

    /// Moves the deployer's lines to berth while it runs, and stops it on a
    /// cancel, a shutdown or the end of the authority. Returns how the
    /// authority ended, when it did (nothing more is sent then).
    async fn pump(&self, a: &mut Attempt, run: &mut Run) -> Option<AttemptEnd> {
        let c = &mut run.courier;
        loop {
            // A full batch goes at once; else 100 ms after its first item.
            let due = if c.pending.len() >= BATCH_ITEMS {
                Some(Instant::now())
            } else {
                c.first_unsent.map(|t| t + BATCH_DELAY)
            };
            let mut gone = None;
            tokio::select! {
                // Past MAX_PENDING the deployer's output waits unread
                // (nothing is dropped) until a batch is answered.
                batch = run.lines.recv(), if c.pending.len() < MAX_PENDING => match batch {
                    Some(lines) => c.lines(&lines),
                    None => return None,
                },
                _ = sleep_until_some(due) => {
                    match self.send_progress(a, &mut c.pending, &mut c.sent_through).await {
                        Ok(true) if run.halted == Halt::No => run.halted = Halt::Cancel,
                        Ok(_) => {}
                        Err(end) => gone = Some(end),
                    }
                    c.first_unsent = (!c.pending.is_empty()).then(Instant::now);
                }
                _ = run.renewed.changed() => a.deadline = *run.renewed.borrow(),
                _ = run.fenced.changed() => gone = *run.fenced.borrow(),
                _ = run.halt.changed() => {
                    let h = *run.halt.borrow();
                    if h == Halt::Fenced {
                        gone = Some(AttemptEnd::Done);
                    }
                    if run.halted == Halt::No {
                        run.halted = h;
                    }
                }
                _ = tokio::time::sleep_until(a.deadline) => {
                    tracing::warn!(attempt = %a.id, "the lease passed without a renew: stopping the deployer (self-fence)");
                    gone = Some(AttemptEnd::Done);
                }
            }
            if gone.is_some() || run.halted != Halt::No {
                let _ = run.stop.send(true);
            }
            if gone.is_some() {
                return gone;
            }
        }
    }

    /// After the deployer: the rest of its lines, the health step, the
    /// outcome.
    async fn conclude(
        &self,
        a: &mut Attempt,
        claim: &Value,
        run: &mut Run,
        ended: Result<Ended, tokio::task::JoinError>,
        work_dir: &Path,
        root: &Path,
    ) -> AttemptEnd {
        let c = &mut run.courier;
        while !c.pending.is_empty() {
            if let Err(end) = self
                .send_progress(a, &mut c.pending, &mut c.sent_through)
                .await
            {
                return end;
            }
        }
        let mut health = Value::Null;
        if let (Ok(Ended::Exit(0)), Some(limits)) = (&ended, health_limits(claim)) {
            if let Some(changed) = changed_nodes(root) {
                let mut io = WorkerHealth {
                    worker: self,
                    attempt: a,
                    work_dir: work_dir.to_path_buf(),
                    courier: c,
                    halt: run.halt.clone(),
                    renewed: &mut run.renewed,
                    gone: None,
                };
                let end = health_step(&mut io, limits, &claim["request"], changed).await;
                if let Some(end) = io.gone.take() {
                    keep_lost(&self.args.work_dir, work_dir, &a.id);
                    return end;
                }
                health = health_json(&end);
            }
        }
        let deployed = matches!(ended, Ok(Ended::Exit(0)));
        let ended = match ended {
            Ok(ended) => rollout::ended_json(&ended, run.halted),
            Err(_) => json!({"kind": "status_unknown"}),
        };
        let through = c.sent_through;
        let result = runner::read_result(root)
            .ok()
            .flatten()
            .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
            .unwrap_or(Value::Null);
        let carried = self.carry(a, root, work_dir, &result).await;
        if a.rollout && deployed && run.halted == Halt::No {
            return self.follow_rollout(a, run, work_dir, root, carried).await;
        }
        self.send_outcome(a, through, ended, Some(root), health, carried)
            .await
    }

    /// Renews every ttl/3 (retrying each second); reports each new deadline,
    /// and the end of the authority when berth refuses it.
    async fn renew_loop(
        self: Arc<Self>,
        attempt: String,
        fence: u64,
        ttl: Duration,
        renewed: watch::Sender<Instant>,
        fenced: watch::Sender<Option<AttemptEnd>>,
    ) {
        let path = format!("/internal/v1/attempts/{attempt}/renew");
        loop {
            tokio::time::sleep(ttl / 3).await;
            let body = json!({"operation_id": new_operation_id(), "fence": fence, "worker_incarnation": self.incarnation});
            loop {
                let sent = Instant::now();
                match self
                    .api
                    .call(reqwest::Method::POST, &path, Some(&body), CALL_TIMEOUT)
                    .await
                {
                    Ok((200, answer)) => {
                        let ttl = answer["lease_ttl_ms"]
                            .as_u64()
                            .map_or(ttl, Duration::from_millis);
                        let _ = renewed.send(sent + ttl);
                        break;
                    }
                    Ok((401 | 403, _)) => {
                        let _ = fenced.send(Some(AttemptEnd::TokenRefused));
                        return;
                    }
                    Ok((404 | 409, _)) => {
                        let _ = fenced.send(Some(AttemptEnd::Done));
                        return;
                    }
                    Ok(_) | Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
                }
            }
        }
    }

    /// Sends the pending items (at most a batch), resending an unanswered
    /// batch with the same `operation_id`. `Ok(cancel)`, or the end of the
    /// attempt's authority.
    async fn send_progress(
        &self,
        a: &mut Attempt,
        pending: &mut Vec<Item>,
        sent_through: &mut u64,
    ) -> Result<bool, AttemptEnd> {
        let mut bytes = 0;
        let take = pending
            .iter()
            .take_while(|i| {
                bytes += i.size();
                bytes <= BATCH_BYTES
            })
            .count()
            .clamp(1.min(pending.len()), BATCH_ITEMS);
        let last = pending[..take].last().map_or(*sent_through, Item::seq);
        let operation_id = new_operation_id();
        let body = ProgressBody {
            operation_id: &operation_id,
            fence: a.fence,
            worker_incarnation: &self.incarnation,
            items: &pending[..take],
        };
        let path = format!("/internal/v1/attempts/{}/progress", a.id);
        let sent = self
            .api
            .resend(reqwest::Method::POST, &path, &body, a.deadline)
            .await;
        let answer = accepted(sent, "progress", &a.id)?;
        pending.drain(..take);
        *sent_through = answer["applied_through"].as_u64().unwrap_or(last);
        Ok(answer["cancel"].as_bool().unwrap_or(false))
    }

    /// The outcome, resent until answered or the deadline passes.
    async fn send_outcome(
        &self,
        a: &mut Attempt,
        through: u64,
        ended: Value,
        root: Option<&Path>,
        health: Value,
        carried: Carried,
    ) -> AttemptEnd {
        let (result, problem) = rollout::result_json(root.map_or(Ok(None), runner::read_result));
        let body = json!({
            "operation_id": new_operation_id(), "fence": a.fence, "worker_incarnation": self.incarnation,
            "progress_through": through, "ended": ended, "result": result, "result_problem": problem,
            "health": health, "files": carried.files, "work_state": carried.work_state,
            "work_state_problem": carried.work_state_problem,
        });
        let path = format!("/internal/v1/attempts/{}/outcome", a.id);
        let sent = self
            .api
            .resend(reqwest::Method::POST, &path, &body, a.deadline)
            .await;
        match accepted(sent, "the outcome", &a.id) {
            Ok(_) => AttemptEnd::Done,
            Err(end) => end,
        }
    }
}

/// What a resent call of an attempt came to: berth's answer when it took
/// the call; else the end of the attempt's authority (its token refused,
/// or the call refused or unanswered past the lease), logged as `what`.
fn accepted(
    sent: Result<(u16, Value), String>,
    what: &str,
    attempt: &str,
) -> Result<Value, AttemptEnd> {
    match sent {
        Ok((200, answer)) => Ok(answer),
        Ok((401 | 403, _)) => Err(AttemptEnd::TokenRefused),
        Ok((status, answer)) => {
            tracing::warn!(status, reason = %answer["reason"], attempt, "{what} refused: the attempt is over");
            Err(AttemptEnd::Done)
        }
        Err(e) => {
            tracing::warn!(error = %e, attempt, "{what} unanswered past the lease: the attempt is over");
            Err(AttemptEnd::Done)
        }
    }
}

/// An attempt's progress items: numbered from 1, held until a batch
/// carrying them is answered.
#[derive(Default)]
struct Courier {
    pending: Vec<Item>,
    /// The highest seq berth applied.
    sent_through: u64,
    /// The seq the next item gets (0 until the first: `next`).
    next_seq: u64,
    /// When the oldest unsent item arrived.
    first_unsent: Option<Instant>,
}

impl Courier {
    fn next(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    fn lines(&mut self, lines: &runner::Lines) {
        for line in lines.iter() {
            let seq = self.next();
            self.pending.push(Item::Log {
                seq,
                log: line.to_string(),
            });
        }
        self.first_unsent.get_or_insert_with(Instant::now);
    }
}

/// A running attempt's signals: its lines, the deployer's stop switch,
/// the renewer's deadlines and refusals, the worker's halt.
struct Run {
    courier: Courier,
    lines: mpsc::Receiver<runner::Lines>,
    stop: watch::Sender<bool>,
    renewed: watch::Receiver<Instant>,
    fenced: watch::Receiver<Option<AttemptEnd>>,
    halt: watch::Receiver<Halt>,
    /// Who stopped the deployer, first.
    halted: Halt,
}

/// The health step's limits from a claim (`null`: the source has none).
fn health_limits(claim: &Value) -> Option<HealthLimits> {
    let h = &claim["health"];
    Some(HealthLimits {
        interval: Duration::from_millis(h["interval_ms"].as_u64()?),
        timeout: Duration::from_millis(h["timeout_ms"].as_u64()?),
    })
}

/// The nodes a deploy's result says it changed; `None` when the result is
/// not one (berth judges it; there is nothing to check).
fn changed_nodes(root: &Path) -> Option<Vec<String>> {
    let bytes = runner::read_result(root).ok()??;
    let result: Value = serde_json::from_slice(&bytes).ok()?;
    let nodes = result["nodes"].as_array()?;
    Some(
        nodes
            .iter()
            .filter(|n| n["changed"].as_bool() == Some(true))
            .filter_map(|n| n["name"].as_str().map(str::to_string))
            .collect(),
    )
}

fn health_json(end: &HealthEnd) -> Value {
    match end {
        HealthEnd::Confirmed => json!({"end": "confirmed"}),
        HealthEnd::Failed(detail) => json!({"end": "failed", "detail": detail}),
        // A worker runs no rollout of its own (berth orchestrates them).
        HealthEnd::Aborted(_, detail) => json!({"end": "failed", "detail": detail}),
        HealthEnd::Halted(HealthHalt::Cancel | HealthHalt::No) => {
            json!({"end": "halted", "by": "cancel"})
        }
        HealthEnd::Halted(HealthHalt::Shutdown) => json!({"end": "halted", "by": "shutdown"}),
    }
}

/// A worker's side of the health step: the deployer here, the lines and
/// answers as progress items sent at once, the attempt's halt switch.
struct WorkerHealth<'a> {
    worker: &'a Worker,
    attempt: &'a mut Attempt,
    work_dir: PathBuf,
    courier: &'a mut Courier,
    halt: watch::Receiver<Halt>,
    renewed: &'a mut watch::Receiver<Instant>,
    /// Set when the attempt's authority ended during the step.
    gone: Option<AttemptEnd>,
}

impl WorkerHealth<'_> {
    /// Sends what is pending (with the renewer's latest deadline).
    async fn flush(&mut self) {
        if let Ok(true) = self.renewed.has_changed() {
            self.attempt.deadline = *self.renewed.borrow_and_update();
        }
        let c = &mut *self.courier;
        while self.gone.is_none() && !c.pending.is_empty() {
            if let Err(end) = self
                .worker
                .send_progress(self.attempt, &mut c.pending, &mut c.sent_through)
                .await
            {
                self.gone = Some(end);
            }
        }
    }
}

impl HealthIo for WorkerHealth<'_> {
    async fn call(&mut self, verb: &'static str, request: &Value, limit: Duration) -> CallEnd {
        let call = OneCall {
            verb,
            request: request.to_string().into_bytes(),
            work_dir: Some(self.work_dir.clone()),
            timeout: limit,
            grace: self.attempt.cancel_grace.min(Duration::from_secs(5)),
        };
        let scratch = self.worker.args.work_dir.join("scratch");
        call.run(&self.worker.deployer, &scratch, None)
            .await
            .map_err(|e| format!("{e:?}"))
    }

    async fn lines(&mut self, lines: &[String]) {
        for line in lines.iter().take(50) {
            let seq = self.courier.next();
            self.courier.pending.push(Item::Log {
                seq,
                log: line.clone(),
            });
        }
        self.flush().await;
    }

    async fn answer(&mut self, attempt: u32, a: &HealthAnswer) {
        let seq = self.courier.next();
        let health =
            json!({"node": a.node, "healthy": a.healthy, "reason": a.reason, "attempt": attempt});
        self.courier.pending.push(Item::Health { seq, health });
        self.flush().await;
    }

    fn halted(&self) -> HealthHalt {
        if self.gone.is_some() {
            return HealthHalt::Cancel;
        }
        match *self.halt.borrow() {
            Halt::No => HealthHalt::No,
            Halt::Cancel | Halt::Fenced => HealthHalt::Cancel,
            Halt::Shutdown => HealthHalt::Shutdown,
        }
    }

    async fn halt_changed(&mut self) {
        if self.halt.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// A progress batch as sent: its items borrowed, not copied.
#[derive(serde::Serialize)]
struct ProgressBody<'a> {
    operation_id: &'a str,
    fence: u64,
    worker_incarnation: &'a str,
    items: &'a [Item],
}

/// One progress item (workers.md "Progress"), serialized as sent.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum Item {
    Log { seq: u64, log: String },
    Health { seq: u64, health: Value },
}

impl Item {
    fn seq(&self) -> u64 {
        match self {
            Item::Log { seq, .. } | Item::Health { seq, .. } => *seq,
        }
    }

    /// About its bytes in a batch.
    fn size(&self) -> usize {
        match self {
            Item::Log { log, .. } => log.len() + 32,
            Item::Health { .. } => 256,
        }
    }
}

/// The certificates of `--ca-file` (PEM, at least one).
fn read_ca_file(path: &Path) -> Result<Vec<reqwest::Certificate>, String> {
    let pem = std::fs::read(path)
        .map_err(|e| format!("cannot read --ca-file {}: {e}", path.display()))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem)
        .map_err(|e| format!("--ca-file {} is not PEM certificates: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "--ca-file {} holds no certificate (PEM, BEGIN CERTIFICATE)",
            path.display()
        ));
    }
    Ok(certs)
}

/// berth's HTTP API as the worker calls it.
#[derive(Clone)]
pub(crate) struct Api {
    pub(crate) http: reqwest::Client,
    pub(crate) base: String,
    pub(crate) token: String,
}

impl Api {
    /// `ca_file`: PEM certificates trusted besides the system's roots
    /// (`--ca-file`).
    pub(crate) fn new(url: &str, token: String, ca_file: Option<&Path>) -> Result<Api, String> {
        let mut builder = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(10));
        if let Some(path) = ca_file {
            builder = builder.tls_certs_merge(read_ca_file(path)?);
        }
        let http = builder
            .build()
            .map_err(|e| format!("cannot make an HTTP client: {e}"))?;
        Ok(Api {
            http,
            base: url.trim_end_matches('/').to_string(),
            token,
        })
    }

    /// One call: its status and JSON body (null when it has none).
    pub(crate) async fn call<B: serde::Serialize + ?Sized>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&B>,
        limit: Duration,
    ) -> Result<(u16, Value), String> {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .timeout(limit);
        if let Some(body) = body {
            req = req.json(body);
        }
        let mut resp = req.send().await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        // An answer is read up to MAX_ANSWER_BYTES: whatever stands at the
        // URL cannot make the worker hold more.
        let mut bytes = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
            if bytes.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(format!("an answer longer than {MAX_ANSWER_BYTES} bytes"));
            }
            bytes.extend_from_slice(&chunk);
        }
        match serde_json::from_slice(&bytes) {
            Ok(answer) => Ok((status, answer)),
            // A success must be berth's JSON; a refusal from something in
            // between (a proxy's page) is judged by its status alone.
            Err(e) if (200..300).contains(&status) => {
                Err(format!("an answer that is not JSON: {e}"))
            }
            Err(_) => Ok((status, Value::Null)),
        }
    }

    /// A GET of raw bytes at `path` (an artifact), at most `max`.
    pub(crate) async fn get_bytes(&self, path: &str, max: usize) -> Result<Vec<u8>, String> {
        let mut resp = self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .timeout(Duration::from_secs(600))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("berth answered {}", resp.status()));
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
            if bytes.len() + chunk.len() > max {
                return Err(format!("an artifact longer than {max} bytes"));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    }

    /// A call resent (same body, so the same `operation_id`) while it gets
    /// no answer or a 5xx, until `deadline`.
    pub(crate) async fn resend<B: serde::Serialize + ?Sized>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: &B,
        deadline: Instant,
    ) -> Result<(u16, Value), String> {
        let mut pause = Duration::from_millis(100);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("no answer before the deadline".into());
            }
            match self
                .call(method.clone(), path, Some(body), left.min(CALL_TIMEOUT))
                .await
            {
                Ok((status, answer)) if status < 500 => return Ok((status, answer)),
                Ok(_) | Err(_) => {
                    tokio::time::sleep(
                        pause.min(deadline.saturating_duration_since(Instant::now())),
                    )
                    .await;
                    pause = (pause * 2).min(MAX_BACKOFF);
                }
            }
        }
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn pause(backoff: Duration) -> Duration {
    tokio::time::sleep(backoff).await;
    (backoff * 2).min(MAX_BACKOFF)
}

/// SIGTERM or SIGINT.
pub(crate) fn stop_signal() -> watch::Receiver<()> {
    let (tx, rx) = watch::channel(());
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!("cannot listen for SIGTERM/SIGINT");
            return;
        };
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        let _ = tx.send(());
    });
    rx
}

/// At least 128 random bits, drawn at each start.
pub(crate) fn new_incarnation() -> Result<String, String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness for the incarnation: {e}"))?;
    Ok(format!("inc-{}", crate::hex::encode(&bytes)))
}

pub(crate) fn new_operation_id() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}

/// Makes the work dir (0700) and takes its lock; a second worker on it is
/// refused.
fn lock_work_dir(dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, String> {
    use std::os::unix::fs::PermissionsExt;
    for sub in ["", "work", "scratch", "jobs", "lost"] {
        std::fs::create_dir_all(dir.join(sub))
            .map_err(|e| format!("cannot create {}: {e}", dir.join(sub).display()))?;
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("cannot make {} private: {e}", dir.display()))?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("lock"))
        .map_err(|e| format!("cannot open the lock of {}: {e}", dir.display()))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|(_, e)| format!("{} is in use by another worker ({e})", dir.display()))
}

/// The deployer's process and its cancel grace, written before its gate
/// opens: a worker started after a crash stops it.
fn record_job(file: &Path, job: Job, grace: Duration) -> std::io::Result<()> {
    let text = json!({"pid": job.pid, "start_ticks": job.start_ticks, "cancel_grace_ms": grace.as_millis() as u64});
    crate::durable::replace(file, text.to_string().as_bytes(), 0o600)
}

/// Stops each deployer an earlier run of this worker left (SIGTERM, its
/// grace, SIGKILL) before the first call.
async fn stop_orphans(jobs: &Path) {
    let Ok(entries) = std::fs::read_dir(jobs) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let job = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .and_then(|v| {
                let job = Job {
                    pid: i32::try_from(v["pid"].as_i64()?).ok()?,
                    start_ticks: v["start_ticks"].as_u64()?,
                };
                Some((job, Duration::from_millis(v["cancel_grace_ms"].as_u64()?)))
            });
        if let Some((job, grace)) = job.filter(|(job, _)| runner::group_may_be_ours(job)) {
            tracing::warn!(
                pid = job.pid,
                "stopping the deployer an earlier run of this worker left"
            );
            crate::engine::recovery::stop_orphan(job, grace).await;
        }
        remove_file(&path);
    }
}

/// Keeps a lost attempt's work dir as `lost/<attempt>/` (the newest
/// `KEEP_LOST`): the next build of the deployment starts from what berth
/// stored, and an operator may repair from this one.
fn keep_lost(work_root: &Path, work_dir: &Path, attempt: &str) {
    let lost = work_root.join("lost");
    if let Err(e) = std::fs::rename(work_dir, lost.join(attempt)) {
        tracing::warn!(error = %e, "cannot keep a lost attempt's work dir");
    }
    let Ok(entries) = std::fs::read_dir(&lost) else {
        return;
    };
    let mut kept: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    kept.sort();
    while kept.len() > KEEP_LOST {
        let (_, oldest) = kept.remove(0);
        remove_dir(&oldest);
    }
}

fn remove_file(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(error = %e, path = %path.display(), "cannot remove a file");
        }
    }
}

fn remove_dir(path: &Path) {
    if let Err(e) = std::fs::remove_dir_all(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(error = %e, path = %path.display(), "cannot remove a directory");
        }
    }
}
