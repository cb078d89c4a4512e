//! One build's run: marked running, the deployer process with its log
//! captured (`log_pipe`), its verdict (`verdict`), and the final transaction.
//! The two transactions are plain functions (`start_tx`, `finish_tx`) that
//! change state only through `transition`.

use crate::locks::Held;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::sync::{mpsc, watch};

use super::health::HealthEnd;
use super::log_pipe::{Chunk, LogBuffer, LogPipe, LINE_QUEUE, LOG_FLUSH_INTERVAL};
use super::outcome::{End, Halt, NodeOutcome, SbomOutcome};
use super::queue::QUEUE_POLL;
use super::rollouts::Verbs;
use super::runner::{self, CallDirs, Ended, Invocation};
use super::transition::Change;
use super::verdict::{read_deploy_result, RunOutcome};
use super::work_state::NewWorkState;
use super::Engine;
use crate::events::{Channel, Frame, Hub};
use crate::model::*;
use crate::store::Lookup;
use crate::store::{StoreResult, Tx, Urgency};

/// The longest pause between attempts of a build's final commit (a full
/// disk).
const FINAL_COMMIT_MAX_PAUSE: Duration = Duration::from_secs(30);

impl Engine {
    pub(super) async fn run_build(self: Arc<Self>, build_id: BuildId) {
        if !self.fits_the_embedded_worker(build_id).await {
            return self.release_slot(build_id);
        }
        let (cancel_tx, cancel_rx) = watch::channel(Halt::No);
        self.cancels.held().insert(build_id, cancel_tx);
        let (hub, incarnation) = (self.hub.clone(), self.incarnation.clone());
        let started = self
            .store
            .write(move |tx| start_tx(tx, &hub, build_id, &incarnation))
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
        let (outcome, work_state) = match self.restore_work_state(&build).await {
            Ok(start) => {
                let mut outcome = self.execute(&build, &snaps, cancel_rx).await;
                let (work_state, problem) =
                    self.collect_work_state(&build.deployment, &start).await;
                outcome.work_state_problem = problem;
                (outcome, work_state)
            }
            Err(failure) => {
                let root = self.settings.scratch_root().join(format_build_id(build.id));
                let log = LogBuffer::new(0, build.log_first_seq, build.seq_reserved);
                (
                    RunOutcome::failed(&root, failure, log),
                    NewWorkState::Unchanged,
                )
            }
        };
        self.conclude(build, outcome, work_state).await;
    }

    /// The end of a run on the embedded worker: the final commit, then its
    /// slot comes free. A rollout halted by a shutdown is not ended: its
    /// build stays `running` and goes on after the next start
    /// (rollouts.md "With the rest of berth").
    pub(super) async fn conclude(
        self: &Arc<Self>,
        build: BuildRecord,
        outcome: RunOutcome,
        work_state: NewWorkState,
    ) {
        let build_id = build.id;
        if outcome.halted == Halt::Shutdown && self.rollout_goes_on(build_id) {
            tracing::info!(build = %format_build_id(build_id), "the rollout stays running; it goes on after the next start");
            // The deploy's result and SBOMs are stored with the plan.
            if let Err(e) = std::fs::remove_dir_all(&outcome.root) {
                tracing::warn!(error = %e, dir = %outcome.root.display(), "cannot remove a build's call dir; the next start empties it");
            }
            return self.release_slot(build_id);
        }
        if self.finish(build, outcome, work_state).await {
            self.release_slot(build_id);
        }
        // Otherwise the build is still `running` in the store: its slot
        // stays taken, so nothing of its deployment starts on top of it,
        // until a restart's recovery fails it.
    }

    /// Whether the embedded worker offers every label the build requires,
    /// its source described now (the queue judged it by what was known).
    async fn fits_the_embedded_worker(&self, build_id: BuildId) -> bool {
        let snaps = match self
            .store
            .read()
            .and_then(|rx| rx.build_snapshots(build_id))
        {
            Ok(Some(snaps)) => snaps,
            // Gone: the start's own job finds it not queued.
            Ok(None) => return true,
            Err(e) => {
                tracing::warn!(error = %e, build = %format_build_id(build_id), "cannot read a queued build's snapshots; it waits for the next pass");
                return false;
            }
        };
        if let Err(e) = self.describe(&snaps.snapshot.source).await {
            tracing::warn!(error = %e.describe(), "cannot describe a queued build's source; its labels are the flag's");
        }
        let required = self
            .required_labels(&snaps.snapshot.source.digest)
            .unwrap_or_else(|| self.settings.build_labels.0.clone());
        required
            .iter()
            .all(|l| self.settings.local_labels.0.contains(l))
    }

    /// Runs the deployer and captures the log; returns how it ended. Each
    /// step is its own function; the loop that moves log lines to the
    /// store while the deployer runs stays here, where every source it
    /// waits on is visible.
    async fn execute(
        self: &Arc<Self>,
        build: &BuildRecord,
        snaps: &BuildSnapshots,
        cancel: watch::Receiver<Halt>,
    ) -> RunOutcome {
        let (inv, root, request) = match self.prepare_call(build, snaps) {
            Ok(call) => call,
            Err(outcome) => return *outcome,
        };
        let mut log = LogBuffer::new(
            self.settings.max_log_bytes,
            build.log_first_seq,
            build.seq_reserved,
        );
        let spawned = match self.spawn_and_record(build.id, &inv, &mut log).await {
            Ok(spawned) => spawned,
            Err(failure) => return RunOutcome::failed(&root, failure, log),
        };
        // The runner waits on the deployer and sends its lines; a cancel, a
        // shutdown or a log that cannot be stored stops it (`stop_tx`).
        let (lines_tx, mut lines_rx) = mpsc::channel::<runner::Lines>(LINE_QUEUE);
        let timeout =
            (!self.settings.build_timeout.is_zero()).then_some(self.settings.build_timeout);
        let (stop_tx, stop_rx) = watch::channel(false);
        let grace = self.settings.cancel_grace;
        let pgid = spawned.job.pid;
        let waiter = tokio::spawn(runner::wait(spawned, timeout, grace, stop_rx, lines_tx));
        let halt = cancel.clone();
        let forward = tokio::spawn(forward_halt(cancel, stop_tx.clone()));
        // Pump the log: each read's lines go out live and into chunks that
        // commit while the next ones fill.
        let mut pipe = LogPipe::new(self, build.id, log, stop_tx);
        let mut ticker = tokio::time::interval(LOG_FLUSH_INTERVAL);
        loop {
            tokio::select! {
                line = lines_rx.recv() => match line {
                    Some(batch) => pipe.lines(batch).await,
                    None => break,
                },
                Some(result) = pipe.done_rx.recv() => pipe.flush_done(result),
                _ = ticker.tick() => {
                    if !pipe.log.pending.is_empty() && pipe.in_flight == 0 {
                        pipe.start_flush();
                    }
                }
            }
        }
        pipe.wait_all().await;
        let ended = waiter.await;
        forward.abort();
        let halted = *halt.borrow();
        let (ended, result) = self.collect_run(build, &root, ended, pgid).await;
        // The health step or the rollout: a deploy that exited 0 with a
        // valid result.
        let health = self
            .after_a_good_deploy(build, snaps, &request, (&ended, &result), &mut pipe, &halt)
            .await;
        let halted = match (&ended, &health) {
            (_, Some(HealthEnd::Halted(h))) => *h,
            (Ok(Ended::Cancelled), _) => halted,
            (Ok(_) | Err(_), _) => Halt::No,
        };
        RunOutcome {
            root,
            ended,
            result,
            health,
            log: pipe.log,
            disk_failure: pipe.disk_failure,
            halted,
            work_state_problem: None,
        }
    }

    /// The health step, or the rollout, of a deploy that exited 0 with a
    /// valid result; `None` for anything else.
    async fn after_a_good_deploy(
        self: &Arc<Self>,
        build: &BuildRecord,
        snaps: &BuildSnapshots,
        request: &serde_json::Value,
        (ended, result): (&Result<Ended, Failure>, &Option<CheckedResult>),
        pipe: &mut LogPipe,
        halt: &watch::Receiver<Halt>,
    ) -> Option<HealthEnd> {
        let (Ok(Ended::Exit(0)), Some(Ok(nodes))) = (ended, result) else {
            return None;
        };
        let after = match build.kind {
            BuildKind::Deploy => self.after_deploy(snaps).await,
            BuildKind::Destroy => AfterDeploy::Nothing,
        };
        let changed = nodes
            .iter()
            .filter(|n| n.changed)
            .map(|n| n.name.clone())
            .collect();
        let mut cancel = halt.clone();
        let end = match after {
            AfterDeploy::Nothing => None,
            AfterDeploy::HealthStep => Some(
                self.health_step(build, request, changed, pipe, &mut cancel)
                    .await,
            ),
            AfterDeploy::Rollout(verbs) => Some(
                self.rollout_step(build, request, nodes, verbs, pipe, &mut cancel)
                    .await,
            ),
        };
        pipe.wait_all().await;
        end
    }

    /// What follows a deploy that exited 0 with a valid result: a rollout
    /// when its deployer lists `activate`, else the health step when it
    /// lists `check` and `confirm`. A source whose describe cannot be read
    /// now has neither, and the log of berth says so.
    async fn after_deploy(&self, snaps: &BuildSnapshots) -> AfterDeploy {
        match self.describe(&snaps.snapshot.source).await {
            Ok(described) if described.activates() => AfterDeploy::Rollout(Verbs {
                check: described.verbs.iter().any(|v| v == "check"),
                confirm: described.verbs.iter().any(|v| v == "confirm"),
            }),
            Ok(described) if described.checks_health() => AfterDeploy::HealthStep,
            Ok(_) => AfterDeploy::Nothing,
            Err(e) => {
                tracing::error!(digest = %snaps.snapshot.source.digest, error = %e.describe(), "cannot read a describe after a deploy; the build has no health step");
                AfterDeploy::Nothing
            }
        }
    }

    /// The verbs of a rollout's source, `None` when it no longer lists
    /// `activate` (or cannot be described now).
    pub(super) async fn rollout_verbs(&self, snaps: &BuildSnapshots) -> Option<Verbs> {
        match self.after_deploy(snaps).await {
            AfterDeploy::Rollout(verbs) => Some(verbs),
            AfterDeploy::HealthStep | AfterDeploy::Nothing => None,
        }
    }

    /// Whether the build's source has a health step: its deployer lists
    /// `check` and `confirm` (with `--health-timeout 0` the step only
    /// confirms). A source whose describe cannot be read now (it was read
    /// at submit) has none, and the log of berth says so.
    pub(super) async fn checks_health(&self, snaps: &BuildSnapshots) -> bool {
        match self.describe(&snaps.snapshot.source).await {
            Ok(described) => described.checks_health(),
            Err(e) => {
                tracing::error!(digest = %snaps.snapshot.source.digest, error = %e.describe(), "cannot read a describe for the health step; the build has none");
                false
            }
        }
    }

    /// The deployer's request and directories. `Err` is the outcome of a
    /// build that cannot run: its directories cannot be made, or its
    /// stored snapshot is damaged.
    fn prepare_call(
        &self,
        build: &BuildRecord,
        snaps: &BuildSnapshots,
    ) -> Result<(Invocation, std::path::PathBuf, serde_json::Value), Box<RunOutcome>> {
        let id_text = format_build_id(build.id);
        let work_dir = self.settings.work_dir(&build.deployment);
        let root = self.settings.scratch_root().join(&id_text);
        let not_run = |detail: String| {
            Box::new(RunOutcome::failed(
                &root,
                Failure::new(FailureReason::SpawnFailed, detail),
                LogBuffer::new(0, build.log_first_seq, build.seq_reserved),
            ))
        };
        let dirs = CallDirs::create(root.clone())
            .and_then(|dirs| crate::durable::create_dir_all(&work_dir, 0o777).map(|_| dirs))
            .map_err(|e| not_run(format!("cannot create the build's directories: {e}")))?;
        let verb = match build.kind {
            BuildKind::Deploy => "deploy",
            BuildKind::Destroy => "destroy",
        };
        let request = deployer_request(build, snaps).map_err(|e| {
            tracing::error!(error = %e, build = %id_text, "a stored configuration snapshot is not JSON");
            not_run(
                "the build's stored configuration is damaged; submit the configuration again"
                    .into(),
            )
        })?;
        let inv = Invocation {
            verb,
            request: request.to_string().into_bytes(),

            work_dir,
            scratch_dir: dirs.scratch,
            result_path: dirs.result_path,
        };
        Ok((inv, root, request))
    }

    /// Starts the deployer behind its gate, commits its process record,
    /// then opens the gate: recovery never misses an orphan, because the
    /// deployer can do nothing before its record is durable. On `Err` the
    /// deployer did not run (a process that was started is killed and
    /// reaped) and the log says why.
    async fn spawn_and_record(
        self: &Arc<Self>,
        build_id: BuildId,
        inv: &Invocation,
        log: &mut LogBuffer,
    ) -> Result<runner::Spawned, Failure> {
        let mut spawned = runner::spawn(&self.deployer, inv).map_err(|e| {
            tracing::error!(error = %e, program = %self.deployer.program.display(), "cannot start the deployer");
            log.push(&format!("[berth] cannot start the deployer: {e}"));
            Failure::new(
                FailureReason::SpawnFailed,
                "the deployer could not be started",
            )
        })?;
        let job = spawned.job;
        let recorded = self
            .store
            .write(move |tx| {
                let Some(mut b) = tx.build(build_id)? else {
                    return Err(crate::store::StoreError::corrupt(
                        "a running build without its record",
                    ));
                };
                b.job = Some(job);
                tx.put_build(&b)
            })
            .await;
        match recorded {
            Ok(()) => {
                spawned.start();
                Ok(spawned)
            }
            Err(e) => {
                let why = format!("cannot store the build's process record: {e}");
                tracing::error!(build = %format_build_id(build_id), error = %why, "the deployer is not run");
                spawned.abandon();
                runner::signal_group(job.pid, nix::sys::signal::Signal::SIGKILL);
                let (lines_tx, _) = mpsc::channel(1);
                let (_, never) = watch::channel(false);
                let _ = runner::wait(spawned, None, Duration::ZERO, never, lines_tx).await;
                log.push(
                    "[berth] the build's process record could not be stored; the deployer was not run",
                );
                Err(Failure::new(FailureReason::JobRecordFailed, why))
            }
        }
    }

    /// How the run ended, with a deploy's result read and checked. A runner
    /// task that ended without an answer (a panic) is a failure of berth's
    /// own (`internal`), never an exit code.
    async fn collect_run(
        &self,
        build: &BuildRecord,
        root: &std::path::Path,
        ended: Result<Ended, tokio::task::JoinError>,
        pgid: i32,
    ) -> (
        Result<Ended, Failure>,
        Option<Result<Vec<super::outcome::NodeOutcome>, String>>,
    ) {
        let internal = |what: &str, e: tokio::task::JoinError| {
            tracing::error!(error = %e, build = %format_build_id(build.id), "{what}");
            Failure::new(
                FailureReason::Internal,
                "berth failed while running this build (an internal error); see its log",
            )
        };
        let ended = ended.map_err(|e| {
            // The runner kills the group when it ends; a runner that died
            // did not, so it is done here.
            runner::signal_group(pgid, nix::sys::signal::Signal::SIGKILL);
            internal("the task waiting on a deployer failed", e)
        });
        if ended.as_ref().ok() != Some(&Ended::Exit(0)) {
            return (ended, None);
        }
        // SBOMs may be large: read, check, split and compress them on the
        // blocking pool.
        let (root, kind, store) = (root.to_path_buf(), build.kind, self.store.clone());
        let limit = self.settings.max_artifact_bytes;
        match tokio::task::spawn_blocking(move || read_deploy_result(&root, kind, &store, limit))
            .await
        {
            Ok(result) => (ended, Some(result)),
            Err(e) => (Err(internal("reading a deploy result failed", e)), None),
        }
    }

    /// The final transaction: status, last log chunk, the deployment's
    /// deployed snapshot and pending counters, the destroy callback. Returns
    /// whether the final status is stored.
    async fn finish(
        self: &Arc<Self>,
        build: BuildRecord,
        mut outcome: RunOutcome,
        work_state: NewWorkState,
    ) -> bool {
        let end = outcome.verdict(self.settings.build_timeout);
        let nodes = match outcome.result.take() {
            Some(Ok(nodes)) => nodes,
            _ => vec![],
        };
        let (late_frames, last_chunk) = self.close_log(build.id, &nodes, &mut outcome);
        let (build_id, kind, status) = (build.id, build.kind, end.status);
        let finished = Arc::new(Finished {
            end,
            nodes,
            last_chunk,
            late_frames,
            last_seq_used: outcome.log.next_seq.saturating_sub(1),
            log_gaps: outcome.log.gaps.clone(),
            work_state,
            keep_work_states: self.settings.keep_work_states,
        });
        if kind == BuildKind::Destroy && status == BuildStatus::Succeeded {
            self.remove_destroyed_work_dir(&build);
        }
        let (stored, as_judged) = self.store_final(build_id, finished).await;
        if let Err(e) = std::fs::remove_dir_all(&outcome.root) {
            tracing::warn!(error = %e, dir = %outcome.root.display(), "cannot remove a finished build's scratch dir");
        }
        if as_judged && kind == BuildKind::Destroy && status == BuildStatus::Succeeded {
            self.callbacks_wake.notify_one();
        }
        stored
    }

    /// berth's own closing lines (SBOMs not made, lines over
    /// `--max-log-bytes`) as late frames, and the last log chunk,
    /// compressed; both go out with the final commit.
    fn close_log(
        &self,
        build: BuildId,
        nodes: &[NodeOutcome],
        outcome: &mut RunOutcome,
    ) -> (Vec<Arc<Frame>>, Option<Chunk>) {
        let mut late_frames = Vec::new();
        for node in nodes {
            if let SbomOutcome::Unavailable(reason) = &node.sbom {
                let line = format!("[berth] node {}: SBOM unavailable: {reason}", node.name);
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
        let last_chunk = match outcome.log.take_chunk().map(Chunk::compress).transpose() {
            Ok(chunk) => chunk,
            Err(e) => {
                // In-memory zstd does not fail; if it ever did, the lines
                // were sent live but are not kept, and the log says so.
                tracing::error!(error = %e, build = %format_build_id(build), "cannot compress the last log chunk; its lines are not stored");
                None
            }
        };
        self.metrics
            .log_bytes
            .fetch_add(outcome.log.stored_bytes, Ordering::Relaxed);
        (late_frames, last_chunk)
    }

    /// A destroy whose deployer succeeded has nothing left behind its work
    /// dir: it goes before the commit that says so, so a reader who sees
    /// `succeeded` (or the deployment `idle`) never finds it still there.
    /// Were that commit to fail, the dir is gone all the same, which is
    /// true to what the deployer did; a destroy run again finds nothing.
    fn remove_destroyed_work_dir(&self, build: &BuildRecord) {
        let work_dir = self.settings.work_dir(&build.deployment);
        match std::fs::remove_dir_all(&work_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(error = %e, dir = %work_dir.display(), build = %format_build_id(build.id), "cannot remove the work dir of a destroyed deployment; remove it by hand")
            }
        }
    }

    /// The final commit, retried until it lands (a full disk that
    /// recovers): a build must not stay `running` without a job. Returns
    /// (stored at all, stored with the verdict as judged).
    async fn store_final(&self, build_id: BuildId, finished: Arc<Finished>) -> (bool, bool) {
        let result = {
            let (finished, hub) = (finished.clone(), self.hub.clone());
            self.write_until_landed(
                build_id,
                "the final commit of a build",
                FINAL_COMMIT_MAX_PAUSE,
                move |tx| finish_tx(tx, &hub, build_id, &finished),
            )
            .await
        };
        let Err(e) = result else {
            return (true, true);
        };
        // What failed may be this build's own records (its chunk, its
        // SBOMs): store the bare final status instead, failed.
        tracing::error!(error = %e, build = %format_build_id(build_id), "cannot store the final status of a build; storing it as failed without its last log lines and SBOMs");
        let bare = Arc::new(Finished {
            end: End::failed(
                FailureReason::FinalCommitFailed,
                "the build's last log lines and results could not be stored",
            ),
            nodes: vec![],
            last_chunk: None,
            late_frames: vec![],
            last_seq_used: finished.last_seq_used,
            log_gaps: finished.log_gaps.clone(),
            work_state: NewWorkState::Unchanged,
            keep_work_states: self.settings.keep_work_states,
        });
        let hub = self.hub.clone();
        let bare_commit = self
            .store
            .write_with(Urgency::Must, move |tx| {
                finish_tx(tx, &hub, build_id, &bare)
            })
            .await;
        match bare_commit {
            Ok(()) => (true, false),
            Err(e) => {
                tracing::error!(error = %e, build = %format_build_id(build_id), "cannot store any final status of a build; it stays running until recovery, and its slot stays taken");
                (false, false)
            }
        }
    }
}

/// What the deployer reads on stdin for a build (deployer.md), the same
/// for the embedded worker and a remote one. The snapshots were validated
/// JSON when stored; text that no longer parses is a damaged store, and
/// the deployer must never be handed `null` in place of a configuration.
pub fn deployer_request(
    build: &BuildRecord,
    snaps: &BuildSnapshots,
) -> Result<serde_json::Value, serde_json::Error> {
    let configuration = serde_json::from_str::<serde_json::Value>(&snaps.snapshot.configuration)?;
    let previous = match &snaps.previous {
        Some(p) => Some(json!({
            "configuration": serde_json::from_str::<serde_json::Value>(&p.configuration)?,
            "source": p.source,
        })),
        None => None,
    };
    Ok(json!({
        "deployment": build.deployment,
        "build": format_build_id(build.id),
        "method": build.method,
        "configuration": configuration,
        "source": snaps.snapshot.source,
        "suspended": build.suspended,
        "previous": previous,
    }))
}

/// Forwards a cancel or a shutdown to the runner for as long as the
/// deployer lives, whatever its pipes do (one that closed its stdout and
/// stderr is still stopped).
async fn forward_halt(mut cancel: watch::Receiver<Halt>, stop: watch::Sender<bool>) {
    while cancel.changed().await.is_ok() {
        if *cancel.borrow() != Halt::No {
            let _ = stop.send(true);
            return;
        }
    }
}

/// The start's write job: a build still queued becomes running, claimed
/// by the embedded worker (`incarnation`) as an attempt without a lease;
/// `None` when it is not queued any more (cancelled, or claimed by a
/// worker, meanwhile) or has no deployment.
pub fn start_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    build_id: BuildId,
    incarnation: &str,
) -> StoreResult<Option<(BuildRecord, BuildSnapshots)>> {
    let Some(mut b) = tx.build(build_id)? else {
        return Ok(None);
    };
    if b.status != BuildStatus::Queued {
        return Ok(None);
    }
    let Some(mut d) = tx.deployment(&b.deployment)? else {
        return Ok(None);
    };
    // A worker claimed another build of the deployment meanwhile.
    if d.running.is_some() {
        return Ok(None);
    }
    let change = Change::new(tx, hub);
    let snaps = change.start(&mut d, &mut b)?;
    begin_local_attempt(tx, &b, incarnation, change.now())?;
    Ok(Some((b, snaps)))
}

/// A new attempt of the embedded worker (`incarnation`) on `b`, without a
/// lease, its fence above the last one's.
pub fn begin_local_attempt(
    tx: &Tx,
    b: &BuildRecord,
    incarnation: &str,
    now: Millis,
) -> StoreResult<()> {
    let last_fence = tx.last_attempt(b.id)?.map_or(0, |a| a.fence);
    tx.put_attempt(&crate::authority::new_attempt(
        b.id,
        &b.deployment,
        crate::authority::LOCAL_WORKER,
        incarnation,
        last_fence,
        now,
        None,
    ))
}

/// A deploy's result, read and checked: its nodes, or why it breaks the
/// protocol.
pub(super) type CheckedResult = Result<Vec<super::outcome::NodeOutcome>, String>;

/// What follows a deploy that exited 0 with a valid result.
enum AfterDeploy {
    Nothing,
    HealthStep,
    Rollout(Verbs),
}

/// What the final transaction of a build stores.
pub struct Finished {
    pub end: End,
    /// A deploy's nodes with their SBOMs (empty otherwise).
    pub nodes: Vec<NodeOutcome>,
    /// The lines not yet committed, compressed.
    pub last_chunk: Option<Chunk>,
    /// berth's own closing lines (published after the commit).
    pub late_frames: Vec<Arc<Frame>>,
    /// The highest log seq handed out: never reused.
    pub last_seq_used: u64,
    /// Every seq amid the log's lines that went to another event.
    pub log_gaps: Vec<u64>,
    /// The deployment's work state after the build (stored whatever the
    /// verdict; a destroy that succeeds forgets them all).
    pub work_state: NewWorkState,
    /// `--keep-work-states`.
    pub keep_work_states: u32,
}

impl Finished {
    /// The final commit of a build whose every line is committed already
    /// (a remote one): no last chunk, no closing lines of berth's.
    pub fn committed(
        b: &BuildRecord,
        end: End,
        nodes: Vec<NodeOutcome>,
        work_state: NewWorkState,
        keep_work_states: u32,
    ) -> Finished {
        Finished {
            end,
            nodes,
            last_chunk: None,
            late_frames: vec![],
            last_seq_used: b.event_seq,
            log_gaps: b.log_gaps.clone(),
            work_state,
            keep_work_states,
        }
    }
}

/// The final write job: the last log chunk, then the final status through
/// `transition`.
pub fn finish_tx(tx: &Tx, hub: &Arc<Hub>, build_id: BuildId, f: &Arc<Finished>) -> StoreResult<()> {
    if crate::failpoints::hit("build.final_commit", &format_build_id(build_id)) {
        return Err(crate::store::StoreError::injected("build.final_commit"));
    }
    let Some(mut b) = tx.build(build_id)? else {
        return Ok(());
    };
    if let Some(chunk) = &f.last_chunk {
        chunk.store(tx, &mut b)?;
    }
    // Ids sent live are never reused, even for lines a failed disk could
    // not keep.
    b.event_seq = b.event_seq.max(f.last_seq_used);
    if b.log_gaps.len() < f.log_gaps.len() {
        b.log_gaps = f.log_gaps.clone();
    }
    let (publish, late, last_seq_used) = (hub.clone(), f.clone(), f.last_seq_used);
    tx.after_commit(move || {
        let channel = Channel::Build(build_id);
        for frame in &late.late_frames {
            publish.publish(&channel, frame.clone());
        }
        publish.committed(build_id, last_seq_used);
    });
    let mut d = tx.deployment(&b.deployment)?;
    end_attempt(tx, build_id, AttemptState::Ended)?;
    tx.put_rollout_result::<()>(build_id, None)?;
    if b.kind == BuildKind::Destroy && f.end.status == BuildStatus::Succeeded {
        super::work_state::forget_tx(tx, &b.deployment)?;
    } else {
        super::work_state::keep_tx(
            tx,
            &b.deployment,
            &f.work_state,
            Some(build_id),
            f.keep_work_states,
            now_millis(),
        )?;
    }
    Change::new(tx, hub).finish(d.as_mut(), &mut b, f.end.clone(), &f.nodes)?;
    let Some(d) = d.as_mut() else {
        return Ok(());
    };
    super::activations::build_ended_tx(tx, hub, d, &b)?;
    match b.status {
        BuildStatus::Succeeded => super::nodes::deployed_tx(tx, hub, d, &b, &f.nodes),
        BuildStatus::Queued
        | BuildStatus::Running
        | BuildStatus::Failed
        | BuildStatus::Cancelled => Ok(()),
    }
}

/// A build's active attempt ends with it (`Ended`), or with the berth that
/// ran it (`Interrupted`); a lost one stays lost.
pub fn end_attempt(tx: &Tx, build_id: BuildId, state: AttemptState) -> StoreResult<()> {
    if let Some(mut a) = tx.last_attempt(build_id)? {
        if a.state == AttemptState::Active {
            a.state = state;
            tx.put_attempt(&a)?;
        }
    }
    Ok(())
}
