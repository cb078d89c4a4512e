//! The build queue and one build's run: who runs next, the deployer process,
//! the log, and the final transaction.
//!
//! Queue rules (spec lifecycle.md "Queue"): builds of one deployment run one
//! at a time, oldest first; at most `--build-slots` run at once; the oldest
//! waiting build of any deployment that has nothing running goes next, so
//! no deployment can starve another.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;
use tokio::sync::{mpsc, watch};

use super::runner::{self, Ended, Invocation, OpenError};
use super::{lock, release_pending, Engine};
use crate::events::{self, Channel, Frame, SEQ_BLOCK};
use crate::model::*;
use crate::store::StoreErrorKind;

/// A log chunk is committed at least this often while lines arrive.
pub const LOG_FLUSH_INTERVAL: Duration = Duration::from_millis(100);
/// ... or when this many uncompressed bytes are waiting.
pub const LOG_CHUNK_BYTES: usize = 1024 * 1024;
/// zstd level for log chunks (fast, ratio ~5 on build logs).
const LOG_ZSTD_LEVEL: i32 = 3;
/// Batches (one per read, at most 64 KiB each) buffered between the pipe
/// readers and the log writer: at most 4 MiB; past it the deployer waits.
const LINE_QUEUE: usize = 64;
/// Largest SBOM file read from a deployer (sbom.md).
pub const MAX_SBOM_BYTES: u64 = 64 * 1024 * 1024;
/// Pauses between attempts of a build's final commit (a full disk).
const FINAL_COMMIT_FIRST_PAUSE: Duration = Duration::from_millis(100);
const FINAL_COMMIT_MAX_PAUSE: Duration = Duration::from_secs(30);
/// How often the queue looks again even without a wake-up.
const QUEUE_POLL: Duration = Duration::from_secs(1);

impl Engine {
    /// Runs forever: starts queued builds whenever a slot is free.
    pub async fn run_queue(self: Arc<Self>) {
        loop {
            if let Err(e) = self.dispatch() {
                tracing::error!(error = %e, "queue dispatch failed");
            }
            let _ = tokio::time::timeout(QUEUE_POLL, self.wake.notified()).await;
        }
    }

    fn dispatch(self: &Arc<Self>) -> Result<(), crate::store::StoreError> {
        if self.stopping.load(Ordering::SeqCst) {
            return Ok(());
        }
        // Every slot busy: nothing to start, and no need to read the queue.
        if lock(&self.sched).running.len() >= usize::from(self.settings.build_slots) {
            return Ok(());
        }
        let queued = self.store.read()?.queued()?;
        let mut sched = lock(&self.sched);
        let slots = usize::from(self.settings.build_slots);
        for (build_id, deployment) in queued {
            if sched.running.len() >= slots {
                break;
            }
            let busy = sched.running.contains_key(&build_id)
                || sched.running.values().any(|d| *d == deployment)
                || sched.blocked.contains(&deployment);
            if busy {
                continue;
            }
            sched.running.insert(build_id, deployment);
            let engine = self.clone();
            tokio::spawn(async move { engine.run_build(build_id).await });
        }
        assert!(
            sched.running.len() <= slots,
            "more builds hold a slot than --build-slots"
        );
        Ok(())
    }

    fn release_slot(&self, build_id: BuildId) {
        lock(&self.sched).running.remove(&build_id);
        lock(&self.cancels).remove(&build_id);
        self.wake_queue();
    }

    pub(super) fn block_deployment(&self, deployment: &str) {
        lock(&self.sched).blocked.insert(deployment.to_string());
    }

    pub(super) fn unblock_deployment(&self, deployment: &str) {
        lock(&self.sched).blocked.remove(deployment);
        self.wake_queue();
    }

    async fn run_build(self: Arc<Self>, build_id: BuildId) {
        let (cancel_tx, cancel_rx) = watch::channel(false);
        lock(&self.cancels).insert(build_id, cancel_tx);
        let hub = self.hub.clone();
        let started = self
            .store
            .write(move |tx| {
                let Some(mut b) = tx.build(build_id)? else {
                    return Ok(None);
                };
                if b.status != BuildStatus::Queued {
                    return Ok(None);
                }
                let Some(mut d) = tx.deployment(&b.deployment)? else {
                    return Ok(None);
                };
                let now = now_millis();
                b.status = BuildStatus::Running;
                b.started_at = Some(now);
                let mut snaps = super::build_snapshots(tx, build_id)?;
                snaps.previous = d.deployed.as_ref().map(|x| x.snapshot.clone());
                tx.put_build_snapshots(build_id, &snaps)?;
                events::build_status(tx, &hub, &mut b, now)?;
                b.log_first_seq = b.event_seq + 1;
                b.seq_reserved = b.event_seq + SEQ_BLOCK;
                d.running = Some(build_id);
                d.revision += 1;
                d.updated_at = now;
                events::deployment_changed(tx, &hub, &mut d, Some(&b), now)?;
                tx.put_build(&b)?;
                tx.put_deployment(&d)?;
                Ok(Some((b, snaps)))
            })
            .await;
        let (build, snaps) = match started {
            Ok(Some(started)) => started,
            Ok(None) => return self.release_slot(build_id),
            Err(e) => {
                tracing::error!(error = %e, "cannot mark a build running");
                tokio::time::sleep(QUEUE_POLL).await;
                return self.release_slot(build_id);
            }
        };
        let outcome = self.execute(&build, &snaps, cancel_rx).await;
        self.finish(build, outcome).await;
        self.release_slot(build_id);
    }

    /// Runs the deployer and captures the log; returns how it ended.
    async fn execute(
        self: &Arc<Self>,
        build: &BuildRecord,
        snaps: &BuildSnapshots,
        cancel: watch::Receiver<bool>,
    ) -> Outcome {
        let id_text = format_build_id(build.id);
        let work_dir = self.settings.work_dir(&build.deployment);
        let root = self.settings.scratch_root().join(&id_text);
        let scratch_dir = root.join("scratch");
        let _ = std::fs::remove_dir_all(&root);
        if let Err(e) =
            std::fs::create_dir_all(&scratch_dir).and_then(|_| std::fs::create_dir_all(&work_dir))
        {
            return Outcome::failed(
                &root,
                "spawn_failed",
                format!("cannot create the build's directories: {e}"),
                LogBuffer::new(0, build.log_first_seq, build.seq_reserved),
            );
        }
        let verb = match build.kind {
            BuildKind::Deploy => "deploy",
            BuildKind::Destroy => "destroy",
        };
        let configuration: serde_json::Value =
            serde_json::from_str(&snaps.snapshot.configuration).unwrap_or_default();
        let previous = snaps.previous.as_ref().map(|p| {
            json!({"configuration": serde_json::from_str::<serde_json::Value>(&p.configuration).unwrap_or_default(), "source": p.source})
        });
        let request = json!({
            "deployment": build.deployment,
            "build": id_text,
            "method": build.method,
            "configuration": configuration,
            "source": snaps.snapshot.source,
            "suspended": build.suspended,
            "previous": previous,
        });
        let inv = Invocation {
            verb,
            request: request.to_string().into_bytes(),
            work_dir,
            scratch_dir,
            result_path: root.join("result.json"),
        };
        let mut log = LogBuffer::new(
            self.settings.max_log_bytes,
            build.log_first_seq,
            build.seq_reserved,
        );
        let spawned = match runner::spawn(&self.deployer, &inv) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, program = %self.deployer.program.display(), "cannot start the deployer");
                log.push(&format!("[berth] cannot start the deployer: {e}"));
                return Outcome::failed(
                    &root,
                    "spawn_failed",
                    "the deployer could not be started".into(),
                    log,
                );
            }
        };
        let job = spawned.job;
        let build_id = build.id;
        let _ = self
            .store
            .write(move |tx| {
                if let Some(mut b) = tx.build(build_id)? {
                    b.job = Some(job);
                    tx.put_build(&b)?;
                }
                Ok(())
            })
            .await;
        let (lines_tx, mut lines_rx) = mpsc::channel::<Vec<String>>(LINE_QUEUE);
        let timeout =
            (!self.settings.build_timeout.is_zero()).then_some(self.settings.build_timeout);
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut cancel = cancel;
        let grace = self.settings.cancel_grace;
        // Forward the user's cancel into the runner; a log failure stops it too.
        let waiter = {
            let stop_rx = stop_rx.clone();
            tokio::spawn(
                async move { runner::wait(spawned, timeout, grace, stop_rx, lines_tx).await },
            )
        };
        let forward_stop = stop_tx.clone();
        let forward = tokio::spawn(async move {
            while cancel.changed().await.is_ok() {
                if *cancel.borrow() {
                    let _ = forward_stop.send(true);
                    return;
                }
            }
        });
        let mut pipe = LogPipe::new(self, build_id, log, stop_tx.clone());
        let mut ticker = tokio::time::interval(LOG_FLUSH_INTERVAL);
        loop {
            tokio::select! {
                line = lines_rx.recv() => match line {
                    Some(batch) => pipe.lines(batch).await,
                    None => break,
                },
                Some(result) = pipe.done_rx.recv() => pipe.flush_done(result),
                _ = ticker.tick() => {
                    if !pipe.log.pending.is_empty() && !pipe.in_flight {
                        pipe.start_flush();
                    }
                }
            }
        }
        pipe.wait_in_flight().await;
        let (log, disk_failure) = (pipe.log, pipe.disk_failure);
        forward.abort();
        let ended = waiter.await.unwrap_or(Ended::Exit(-1));
        let user_cancelled = ended == Ended::Cancelled && disk_failure.is_none();
        let mut outcome = Outcome {
            root,
            ended,
            result: None,
            log,
            disk_failure,
            user_cancelled,
            not_started: None,
        };
        if ended == Ended::Exit(0) {
            outcome.result = Some(read_deploy_result(&outcome.root, build.kind));
        }
        outcome
    }

    /// The final transaction: status, last log chunk, the deployment's
    /// deployed snapshot and pending counters, the destroy callback.
    async fn finish(self: &Arc<Self>, build: BuildRecord, mut outcome: Outcome) {
        let (status, failure, exit_code) = outcome.verdict(self.settings.build_timeout);
        let nodes = match &outcome.result {
            Some(Ok(nodes)) => nodes.clone(),
            _ => vec![],
        };
        // berth's own closing lines go out with the final commit.
        let mut late_frames = Vec::new();
        for (node, sbom) in &nodes {
            if let Err(reason) = sbom {
                let line = format!("[berth] node {node}: SBOM unavailable: {reason}");
                if let Some(seq) = outcome.log.push(&line) {
                    late_frames.push(Frame::new(seq, "log", line, false));
                }
            }
        }
        if outcome.log.dropped_lines > 0 {
            let line = format!(
                "[berth] {} line(s), {} byte(s) not stored: the log reached --max-log-bytes",
                outcome.log.dropped_lines, outcome.log.dropped_bytes
            );
            let seq = outcome.log.force_push(&line);
            late_frames.push(Frame::new(seq, "log", line, false));
        }
        let last_chunk = outcome.log.take_chunk().map(Chunk::compress);
        let last_seq_used = outcome.log.next_seq.saturating_sub(1);
        let hub = self.hub.clone();
        self.metrics
            .log_bytes
            .fetch_add(outcome.log.stored_bytes, Ordering::Relaxed);
        let build_id = build.id;
        let kind = build.kind;
        // The final commit is retried until it lands (a full disk that
        // recovers): a build must not stay `running` without a job.
        let last_chunk = Arc::new(last_chunk);
        let late_frames = Arc::new(late_frames);
        let mut pause = FINAL_COMMIT_FIRST_PAUSE;
        let result = loop {
            let (last_chunk, late_frames, failure, hub) = (
                last_chunk.clone(),
                late_frames.clone(),
                failure.clone(),
                hub.clone(),
            );
            let attempt = self
                .store
                .write(move |tx| {
                    let Some(mut b) = tx.build(build_id)? else {
                        return Ok(());
                    };
                    let now = now_millis();
                    if let Some(chunk) = last_chunk.as_ref() {
                        chunk.store(tx, &mut b)?;
                    }
                    // Ids sent live are never reused, even for lines a failed
                    // disk could not keep.
                    b.event_seq = b.event_seq.max(last_seq_used);
                    let publish = hub.clone();
                    tx.after_commit(move || {
                        let channel = Channel::Build(build_id);
                        for frame in late_frames.iter() {
                            publish.publish(&channel, frame.clone());
                        }
                        publish.committed(build_id, last_seq_used);
                    });
                    b.status = status;
                    b.finished_at = Some(now);
                    b.failure = failure;
                    b.exit_code = exit_code;
                    events::build_status(tx, &hub, &mut b, now)?;
                    tx.put_build(&b)?;
                    if let Some(mut d) = tx.deployment(&b.deployment)? {
                        release_pending(&mut d, b.kind);
                        if d.running == Some(build_id) {
                            d.running = None;
                        }
                        d.last_finished = Some(LastFinished {
                            build_id,
                            kind: b.kind,
                            status,
                        });
                        let succeeded = status == BuildStatus::Succeeded;
                        match (b.kind, succeeded) {
                            (BuildKind::Deploy, true) => {
                                d.deployed = Some(Deployed {
                                    build_id,
                                    snapshot: super::build_snapshots(tx, build_id)?.snapshot,
                                    method: b.method.clone(),
                                    finished_at: now,
                                });
                            }
                            (BuildKind::Destroy, true) => {
                                d.deployed = None;
                                d.suspended = false;
                            }
                            _ => {}
                        }
                        d.revision += 1;
                        d.updated_at = now;
                        events::deployment_changed(tx, &hub, &mut d, Some(&b), now)?;
                        tx.put_deployment(&d)?;
                    }
                    if b.kind == BuildKind::Destroy {
                        match (status == BuildStatus::Succeeded, tx.callback(build_id)?) {
                            (true, Some(mut c)) => {
                                c.armed = true;
                                c.next_at = now;
                                c.first_at = now;
                                tx.put_callback(build_id, &c)?;
                            }
                            (false, Some(_)) => tx.remove_callback(build_id)?,
                            _ => {}
                        }
                    }
                    Ok(())
                })
                .await;
            match attempt {
                Err(e) if e.is_transient() && !self.stopping.load(Ordering::SeqCst) => {
                    tracing::warn!(error = %e, build = %format_build_id(build_id), "final commit of a build failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(FINAL_COMMIT_MAX_PAUSE);
                }
                other => break other,
            }
        };
        if let Err(e) = result {
            // The build stays `running` in the store; the next start's
            // recovery fails it with `interrupted_by_restart`.
            tracing::error!(error = %e, build = %format_build_id(build_id), "cannot store the final status of a build");
        }
        let _ = std::fs::remove_dir_all(&outcome.root);
        if kind == BuildKind::Destroy && status == BuildStatus::Succeeded {
            let _ = std::fs::remove_dir_all(self.settings.work_dir(&build.deployment));
            self.callbacks_wake.notify_one();
        }
    }
}

/// The path of a running build's output: each line gets its seq, goes to
/// live subscribers (held a few ms and sent together when many watch), and
/// is committed in zstd chunks. A chunk's commit runs beside the line path,
/// so a slow fsync never holds a live line back; ids are reserved in the
/// store well ahead of use, so that wait is rare too.
struct LogPipe {
    store: crate::store::Store,
    hub: Arc<events::Hub>,
    build_id: BuildId,
    log: LogBuffer,
    /// Lines of the current read, not yet published.
    held: Vec<Arc<Frame>>,
    in_flight: bool,
    done_tx: mpsc::Sender<Result<u64, crate::store::StoreError>>,
    done_rx: mpsc::Receiver<Result<u64, crate::store::StoreError>>,
    disk_failure: Option<String>,
    stop: watch::Sender<bool>,
}

impl LogPipe {
    fn new(
        engine: &Engine,
        build_id: BuildId,
        log: LogBuffer,
        stop: watch::Sender<bool>,
    ) -> LogPipe {
        let (done_tx, done_rx) = mpsc::channel(1);
        LogPipe {
            store: engine.store.clone(),
            hub: engine.hub.clone(),
            build_id,
            log,
            held: Vec::new(),
            in_flight: false,
            done_tx,
            done_rx,
            disk_failure: None,
            stop,
        }
    }

    /// The lines of one read, published together as one batch. (A client
    /// that falls behind drains several batches per write by itself; holding
    /// lines back on a timer was measured to add latency and save nothing.)
    async fn lines(&mut self, batch: Vec<String>) {
        for line in batch {
            self.line(line).await;
        }
        self.publish_held();
    }

    async fn line(&mut self, line: String) {
        if self.disk_failure.is_some() {
            // Lines are still read (so the deployer is not blocked) and counted.
            self.log.push(&line);
            self.log.discard_pending();
            return;
        }
        // Never send an id that is not reserved in the store.
        if self.log.next_seq > self.log.reserved {
            self.publish_held();
            self.wait_in_flight().await;
            self.start_flush();
            self.wait_in_flight().await;
        }
        if let Some(seq) = self.log.push(&line) {
            self.held.push(Frame::new(seq, "log", line, false));
        }
        if self.log.pending.len() >= LOG_CHUNK_BYTES {
            self.publish_held();
            // At most one commit in flight: a disk slower than the deployer
            // slows the deployer (its pipe fills), never loses a line.
            self.wait_in_flight().await;
            self.start_flush();
        }
    }

    fn publish_held(&mut self) {
        self.hub
            .publish_lines(self.build_id, std::mem::take(&mut self.held));
    }

    /// Starts committing the waiting lines (and a reservation ahead).
    fn start_flush(&mut self) {
        debug_assert!(!self.in_flight, "two chunk commits in flight");
        let chunk = self.log.take_chunk();
        let reserve = self.log.next_seq.saturating_sub(1) + SEQ_BLOCK;
        let (store, hub, build_id, done) = (
            self.store.clone(),
            self.hub.clone(),
            self.build_id,
            self.done_tx.clone(),
        );
        self.in_flight = true;
        tokio::spawn(async move {
            // zstd runs on the blocking pool, off the line path.
            let chunk = match chunk {
                Some(c) => tokio::task::spawn_blocking(move || c.compress()).await.ok(),
                None => None,
            };
            let result = store
                .write(move |tx| {
                    let Some(mut b) = tx.build(build_id)? else {
                        return Ok(reserve);
                    };
                    if let Some(chunk) = &chunk {
                        chunk.store(tx, &mut b)?;
                        b.event_seq = chunk.last_seq;
                        let last = chunk.last_seq;
                        tx.after_commit(move || hub.committed(build_id, last));
                    }
                    b.seq_reserved = b.seq_reserved.max(reserve);
                    tx.put_build(&b)?;
                    Ok(reserve)
                })
                .await;
            let _ = done.send(result).await;
        });
    }

    fn flush_done(&mut self, result: Result<u64, crate::store::StoreError>) {
        self.in_flight = false;
        match result {
            Ok(reserve) => self.log.reserved = self.log.reserved.max(reserve),
            Err(e) => {
                let reason = if e.kind == StoreErrorKind::DiskFull {
                    "disk_full"
                } else {
                    "log_write_failed"
                };
                tracing::error!(error = %e, build = %format_build_id(self.build_id), "cannot store the build log; stopping the build");
                self.disk_failure = Some(reason.to_string());
                self.log.discard_pending();
                let _ = self.stop.send(true);
            }
        }
    }

    async fn wait_in_flight(&mut self) {
        if self.in_flight {
            if let Some(result) = self.done_rx.recv().await {
                self.flush_done(result);
            }
        }
    }
}

type NodeResults = Vec<(String, Result<(), String>)>;

/// How a build's deployer run ended, before it is stored.
struct Outcome {
    root: std::path::PathBuf,
    ended: Ended,
    /// For exit 0: the checked result (nodes and their SBOM verdicts).
    result: Option<Result<NodeResults, String>>,
    log: LogBuffer,
    disk_failure: Option<String>,
    user_cancelled: bool,
    /// Why the deployer could not even be started.
    not_started: Option<Failure>,
}

impl Outcome {
    /// The deployer never ran (its directories or its process could not be made).
    fn failed(root: &std::path::Path, reason: &str, detail: String, log: LogBuffer) -> Outcome {
        Outcome {
            root: root.to_path_buf(),
            ended: Ended::Exit(-1),
            result: None,
            log,
            disk_failure: None,
            user_cancelled: false,
            not_started: Some(Failure {
                reason: reason.into(),
                detail,
            }),
        }
    }

    fn verdict(&self, timeout: Duration) -> (BuildStatus, Option<Failure>, Option<i32>) {
        let fail = |reason: &str, detail: String| {
            Some(Failure {
                reason: reason.into(),
                detail,
            })
        };
        if let Some(f) = &self.not_started {
            return (BuildStatus::Failed, Some(f.clone()), None);
        }
        if let Some(reason) = &self.disk_failure {
            return (
                BuildStatus::Failed,
                fail(reason, "the build log could not be stored".into()),
                None,
            );
        }
        match self.ended {
            Ended::Cancelled if self.user_cancelled => (
                BuildStatus::Cancelled,
                fail("cancelled", "cancelled while running".into()),
                None,
            ),
            Ended::Cancelled => (
                BuildStatus::Failed,
                fail("cancelled", "stopped".into()),
                None,
            ),
            Ended::Timeout => (
                BuildStatus::Failed,
                fail(
                    "timeout",
                    format!("the build ran longer than {}s", timeout.as_secs()),
                ),
                None,
            ),
            Ended::Signal(sig) => (
                BuildStatus::Failed,
                fail(
                    "exit_status",
                    format!("the deployer was killed by signal {sig}"),
                ),
                None,
            ),
            Ended::Exit(0) => match &self.result {
                Some(Ok(_)) => (BuildStatus::Succeeded, None, Some(0)),
                Some(Err(e)) => (
                    BuildStatus::Failed,
                    fail("deployer_protocol", e.clone()),
                    Some(0),
                ),
                None => (
                    BuildStatus::Failed,
                    fail("deployer_protocol", "no result was read".into()),
                    Some(0),
                ),
            },
            Ended::Exit(-1) => (
                BuildStatus::Failed,
                fail("exit_status", "the deployer ended abnormally".into()),
                None,
            ),
            Ended::Exit(code) => (
                BuildStatus::Failed,
                fail(
                    "exit_status",
                    format!("the deployer exited with status {code}"),
                ),
                Some(code),
            ),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeployResultNode {
    name: String,
    changed: bool,
    #[serde(default)]
    sbom: Option<SbomRef>,
}

#[derive(Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
enum SbomRef {
    Ready { path: String },
    Unavailable { reason: String },
}

/// Checks a deploy or destroy result against the protocol and the SBOM
/// files it names (each file: beneath the scratch dir, regular, limited,
/// CycloneDX JSON). A bad SBOM makes only that node's SBOM unavailable.
fn read_deploy_result(root: &std::path::Path, kind: BuildKind) -> Result<NodeResults, String> {
    let bytes = match runner::read_result(&root.join("result.json")) {
        Ok(Some(b)) => b,
        Ok(None) => return Err("the deployer wrote no result".into()),
        Err(e) => return Err(format!("result file: {e}")),
    };
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|_| "the result is not JSON".to_string())?;
    if kind == BuildKind::Destroy {
        return if value.is_object() {
            Ok(vec![])
        } else {
            Err("a destroy result must be an object".into())
        };
    }
    #[derive(Deserialize)]
    struct DeployResult {
        nodes: Vec<DeployResultNode>,
    }
    let parsed: DeployResult = serde_json::from_value(value)
        .map_err(|_| "the deploy result does not match the protocol (nodes)".to_string())?;
    let scratch = root.join("scratch");
    let mut out = Vec::with_capacity(parsed.nodes.len());
    let mut names = std::collections::HashSet::new();
    for node in parsed.nodes {
        if !names.insert(node.name.clone()) {
            return Err("the deploy result names a node twice".into());
        }
        let verdict = match (&node.sbom, node.changed) {
            (Some(SbomRef::Ready { path }), _) => check_sbom(&scratch, path),
            (Some(SbomRef::Unavailable { reason }), _) => Err(reason.chars().take(2000).collect()),
            (None, false) => Ok(()),
            (None, true) => Err("the deployer gave no SBOM".into()),
        };
        out.push((node.name, verdict));
    }
    Ok(out)
}

fn check_sbom(scratch: &std::path::Path, rel: &str) -> Result<(), String> {
    let bytes = runner::open_beneath(scratch, rel, MAX_SBOM_BYTES).map_err(|e| match e {
        OpenError::Missing => "the SBOM file is missing".to_string(),
        OpenError::Refused(why) => why,
    })?;
    let doc: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|_| "the SBOM is not JSON".to_string())?;
    if doc.get("bomFormat").and_then(|v| v.as_str()) != Some("CycloneDX") {
        return Err("the SBOM is not CycloneDX".into());
    }
    if bytes.windows(6).any(|w| w == b"\\u0000") {
        return Err("the SBOM contains U+0000".into());
    }
    Ok(())
}

/// Lines waiting to be committed, their seqs, and the counts behind
/// `--max-log-bytes`.
pub struct LogBuffer {
    pending: Vec<u8>,
    pending_lines: u64,
    pending_first_seq: u64,
    /// The seq the next stored line gets.
    pub next_seq: u64,
    /// The seq of the build's first line (line index 0).
    first_seq: u64,
    /// Seqs up to this are reserved in the store.
    pub reserved: u64,
    next_chunk: u32,
    stored_bytes: u64,
    max_bytes: u64,
    dropped_lines: u64,
    dropped_bytes: u64,
}

/// Lines cut for one commit; `compressed` holds the raw text until
/// `compress` runs (off the line path).
pub struct Chunk {
    number: u32,
    /// Index of the chunk's first line in the build's log.
    first_line: u64,
    last_seq: u64,
    compressed: Vec<u8>,
    bytes: u64,
    lines: u64,
}

impl LogBuffer {
    pub fn new(max_bytes: u64, first_seq: u64, reserved: u64) -> Self {
        LogBuffer {
            pending: Vec::new(),
            pending_lines: 0,
            pending_first_seq: first_seq,
            next_seq: first_seq,
            first_seq,
            reserved,
            next_chunk: 0,
            stored_bytes: 0,
            max_bytes,
            dropped_lines: 0,
            dropped_bytes: 0,
        }
    }

    /// Adds a line and returns its seq, or counts it as dropped (no seq)
    /// past `--max-log-bytes`.
    pub fn push(&mut self, line: &str) -> Option<u64> {
        let size = line.len() as u64 + 1;
        if self.dropped_lines > 0 || self.stored_bytes + size > self.max_bytes {
            self.dropped_lines += 1;
            self.dropped_bytes += size;
            return None;
        }
        Some(self.force_push(line))
    }

    fn force_push(&mut self, line: &str) -> u64 {
        if self.pending_lines == 0 {
            self.pending_first_seq = self.next_seq;
        }
        self.pending.extend_from_slice(line.as_bytes());
        self.pending.push(b'\n');
        self.pending_lines += 1;
        self.stored_bytes += line.len() as u64 + 1;
        self.next_seq += 1;
        self.next_seq - 1
    }

    /// Forgets lines that cannot be stored (their seqs stay used).
    fn discard_pending(&mut self) {
        self.pending.clear();
        self.pending_lines = 0;
    }

    fn take_chunk(&mut self) -> Option<Chunk> {
        if self.pending.is_empty() {
            return None;
        }
        let raw = std::mem::take(&mut self.pending);
        let chunk = Chunk {
            number: self.next_chunk,
            first_line: self.pending_first_seq - self.first_seq,
            last_seq: self.pending_first_seq + self.pending_lines - 1,
            bytes: raw.len() as u64,
            compressed: raw,
            lines: self.pending_lines,
        };
        self.next_chunk += 1;
        self.pending_lines = 0;
        Some(chunk)
    }
}

impl Chunk {
    /// Writes the chunk and counts it in the build record (the caller stores
    /// the record).
    fn store(&self, tx: &crate::store::Tx, b: &mut BuildRecord) -> crate::store::StoreResult<()> {
        tx.put_log_chunk(b.id, self.number, self.first_line, &self.compressed)?;
        b.log_bytes += self.bytes;
        b.log_lines += self.lines;
        b.log_chunks = self.number + 1;
        Ok(())
    }

    fn compress(mut self) -> Chunk {
        if let Ok(c) = zstd::bulk::compress(&self.compressed, LOG_ZSTD_LEVEL) {
            self.compressed = c;
        }
        self
    }
}

/// Decompresses one stored chunk (its header already removed).
pub fn decompress_chunk(compressed: &[u8]) -> Vec<u8> {
    match zstd::stream::decode_all(compressed) {
        Ok(bytes) => bytes,
        Err(e) => {
            tracing::error!(error = %e, "a stored log chunk does not decompress");
            Vec::new()
        }
    }
}

/// Decompresses a build's stored chunks into its log text.
pub fn decompress_chunks(chunks: &[(u64, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (_, c) in chunks {
        out.extend_from_slice(&decompress_chunk(c));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_cap_counts_dropped_lines() {
        let mut log = LogBuffer::new(10, 3, 100);
        assert_eq!(log.push("12345"), Some(3)); // 6 bytes
        assert_eq!(log.push("1234"), None); // 5 bytes: over
        assert_eq!(log.push("1"), None); // dropped too, once dropping started
        assert_eq!((log.dropped_lines, log.dropped_bytes), (2, 7));
        let chunk = log.take_chunk().unwrap().compress();
        assert_eq!((chunk.first_line, chunk.last_seq), (0, 3));
        assert_eq!(decompress_chunks(&[(0, chunk.compressed)]), b"12345\n");
        assert!(log.take_chunk().is_none());
        assert_eq!(log.force_push("notice"), 4);
        assert_eq!(log.take_chunk().unwrap().first_line, 1);
    }
}
