//! Builds on remote workers (workers.md): the claim, renew, progress and
//! outcome of an attempt, the loss of one whose lease passed or whose
//! token was revoked, and the lease sweep.
//!
//! Each call is one write job that loads the attempt, asks
//! `crate::authority` (replay, then the authority check), and only then
//! writes; a refused call writes nothing but the loss it discovers (an
//! expired lease is lost now) and the audit event of an attempt's first
//! refusal. Log lines and health answers of a progress batch are stored
//! in its transaction and published after the commit, with the next ids
//! of the build channel, so a line a worker sends without authority never
//! reaches the log or a stream.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::build::CheckedResult;
use super::build::{deployer_request, finish_tx, Finished};
use super::health::HealthEnd;
use super::log_pipe::LogBuffer;
use super::outcome::{End, Halt};
use super::refusal::{Missing, Refusal};
use super::remote_log::{append_amid, Amid};
use super::runner::Ended;
use super::staging::{PreparedFiles, Uploads};
use super::transition::Change;
use super::verdict::{parse_result, RunOutcome};

use super::work_state::NewWorkState;
use super::Engine;
use crate::audit::{Actor, AuditResult, Draft};
use crate::authority::{self, Call, ClaimScene, Replay, Stale};
use crate::events::{BuildEvent, Hub};
use crate::model::*;
use crate::settings::Settings;
use crate::store::{Lookup, StoreResult, Tx};

/// Attempts lost since start (`berth_attempts_lost_total`), counted after
/// the commit that lost them.
pub static ATTEMPTS_LOST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Internal calls refused for stale authority since start, by reason
/// (`stale_authority`, `lease_expired`).
pub static REFUSED_STALE: [std::sync::atomic::AtomicU64; 2] = [
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
];

/// How often the lease sweep looks for attempts whose lease passed.
const LEASE_SWEEP: Duration = Duration::from_secs(1);

/// A worker token's holder, as its call authenticated it.
#[derive(Debug, Clone)]
pub struct WorkerCaller {
    pub name: String,
    /// The labels its token allows (empty: any).
    pub token_labels: Vec<String>,
}

impl WorkerCaller {
    fn actor(&self) -> Actor {
        Actor {
            issuer: Some("berth:worker".into()),
            subject: self.name.clone(),
        }
    }
}

/// A claim as the worker sent it.
#[derive(Debug, Clone)]
pub struct ClaimCall {
    pub operation_id: String,
    pub incarnation: String,
    pub labels: Vec<String>,
    /// SHA-256 of the body (its replays compare it).
    pub digest: String,
}

/// The authority every later call carries.
#[derive(Debug, Clone)]
pub struct AuthorityCall {
    pub operation_id: String,
    pub fence: u64,
    pub incarnation: String,
    pub digest: String,
}

impl AuthorityCall {
    fn call(&self) -> Call<'_> {
        Call {
            operation_id: &self.operation_id,
            fence: self.fence,
            incarnation: &self.incarnation,
        }
    }
}

/// One item of a progress batch.
#[derive(Debug, Clone)]
pub enum ProgressItem {
    Log(String),
    /// A health answer (lifecycle.md), stored as a `health` event and its
    /// log line.
    Health {
        node: String,
        healthy: bool,
        reason: Option<String>,
        attempt: u32,
    },
}

/// How the worker's run ended (workers.md "Outcome").
#[derive(Debug, Clone)]
pub enum RemoteEnd {
    Exit(i32),
    Signal(i32),
    StatusUnknown,
    Timeout,
    Cancelled,
    Shutdown,
    NotRun {
        reason: FailureReason,
        detail: String,
    },
}

/// An outcome as the worker sent it.
#[derive(Debug, Clone)]
pub struct RemoteOutcome {
    pub progress_through: u64,
    pub ended: RemoteEnd,
    /// The result file's JSON text, or why there is none.
    pub result: Result<String, String>,
    pub health: Option<HealthEnd>,
    /// The result's SBOM and artifact paths -> the digests of the staged
    /// files.
    pub files: std::collections::BTreeMap<String, String>,
    /// The digest of the work dir's archive at the end (`None`: empty).
    pub work_state: Option<String>,
    /// Why the worker could not archive its work dir.
    pub work_state_problem: Option<String>,
}

impl RemoteOutcome {
    /// What the outcome names besides its JSON, for `prepare_files` (taken
    /// out: the write job needs only the rest).
    fn take_uploads(&mut self) -> Uploads {
        Uploads {
            artifact_paths: super::staging::artifact_paths(&self.result),
            files: std::mem::take(&mut self.files),
            work_state: self.work_state.take(),
            work_state_problem: self.work_state_problem.take(),
        }
    }
}

/// An internal call's answer: its JSON text, and whether it is the replay
/// of an earlier call's.
#[derive(Debug, Clone)]
pub struct Answered {
    pub body: String,
    pub replayed: bool,
}

impl Answered {
    fn new(body: String) -> Answered {
        Answered {
            body,
            replayed: false,
        }
    }
}

/// How long a renew of an idle rollout's worker waits for its next call
/// at most (and a quarter of `--lease-ttl`).
const IDLE_HOLD: Duration = Duration::from_secs(5);

impl Engine {
    pub(super) fn lease_ttl_ms(&self) -> u64 {
        u64::try_from(self.settings.lease_ttl.as_millis()).unwrap_or(authority::LEASE_TTL_MAX_MS)
    }

    /// `POST /internal/v1/builds/{build}/claim`.
    pub async fn claim(
        self: &Arc<Self>,
        worker: WorkerCaller,
        build: BuildId,
        call: ClaimCall,
    ) -> Result<Answered, Refusal> {
        // Whether the source has a health step comes from its describe,
        // which may run the deployer: read before the write job.
        let snaps = self.store.read()?.build_snapshots(build)?;
        let health = match &snaps {
            Some(s) => self.checks_health(s).await,
            None => false,
        };
        // Described just above: a deploy whose deployer lists `activate`
        // is a rollout, its calls handed out one at a time.
        let rolls_out = self.rolls_out(build)?;
        // Described just above (or never describable: then the flag's).
        let required = snaps
            .as_ref()
            .and_then(|s| self.required_labels(&s.snapshot.source.digest))
            .unwrap_or_else(|| self.settings.build_labels.0.clone());
        let blocked: HashSet<String> = self.blocked_deployments();
        let first_work_state = match &snaps {
            Some(_) => self.first_work_state(build).await?,
            None => NewWorkState::Unchanged,
        };
        let (hub, settings) = (self.hub.clone(), self.settings.clone());
        let scene = ClaimContext {
            settings,
            health,
            required,
            blocked,
            first_work_state,
            rolls_out,
        };
        self.store
            .write(move |tx| claim_tx(tx, &hub, &scene, &worker, build, &call))
            .await?
    }

    /// The work state a deployment's first remote claim stores: berth's own
    /// work dir, archived (`Unchanged` once one is stored). A work dir that
    /// cannot be archived keeps the build from remote workers: the claim is
    /// refused `not_claimable` and berth's log says why.
    async fn first_work_state(&self, build: BuildId) -> Result<NewWorkState, Refusal> {
        let rx = self.store.read()?;
        let Some(b) = rx.build(build)? else {
            return Ok(NewWorkState::Unchanged);
        };
        if rx.work_states(&b.deployment)?.is_some() {
            return Ok(NewWorkState::Unchanged);
        }
        drop(rx);
        match self.archive_local_work_dir(&b.deployment).await {
            Ok(Some(prepared)) => Ok(NewWorkState::Archive(prepared)),
            Ok(None) => Ok(NewWorkState::Empty),
            Err(why) => {
                tracing::warn!(deployment = %b.deployment, error = %why, "a remote worker cannot take this deployment's builds: its work dir cannot be archived");
                Err(Refusal::Claim(authority::ClaimRefusal::NotClaimable))
            }
        }
    }

    /// Whether `build` is a deploy that rolls out: its source lists
    /// `activate` (as described in this process; the claim described it).
    fn rolls_out(&self, build: BuildId) -> Result<bool, Refusal> {
        let rx = self.store.read()?;
        let Some(b) = rx.build(build)? else {
            return Ok(false);
        };
        let Some(snaps) = rx.build_snapshots(build)? else {
            return Ok(false);
        };
        Ok(b.kind == BuildKind::Deploy && self.lists_activate(&snaps.snapshot.source.digest))
    }

    /// `POST /internal/v1/attempts/{attempt}/renew`. A rollout's worker
    /// also learns its next call here (`next_call`, `done`).
    pub async fn renew(
        self: &Arc<Self>,
        worker: WorkerCaller,
        attempt: (BuildId, u64),
        call: AuthorityCall,
    ) -> Result<Answered, Refusal> {
        let (hub, ttl) = (self.hub.clone(), self.lease_ttl_ms());
        let next_call = self.remote_rollouts.next_call(attempt.0);
        let handed = next_call["seq"].as_u64();
        let answered = self
            .store
            .write(move |tx| {
                authorized(tx, &hub, &worker, attempt, "renew", &call, |tx, a, now| {
                    authority::renew(a, now, ttl);
                    a.accepted_calls += 1;
                    Ok(Ok(json!({
                        "lease_expires_at": a.lease_expires_at.map(format_time),
                        "lease_ttl_ms": ttl,
                        "cancel": a.cancel_requested_at.is_some(),
                        "next_call": next_call,
                        "done": super::remote_rollout::rollout_done(tx, a.build)?,
                    })
                    .to_string()))
                })
            })
            .await?;
        let answer = match answered {
            Ok(answer) if !answer.replayed => answer,
            other => return other,
        };
        match handed {
            Some(seq) => {
                self.remote_rollouts.delivered(attempt.0, seq, attempt.1);
                Ok(answer)
            }
            None => Ok(self.hold_for_a_call(attempt, answer).await),
        }
    }

    /// A renew of a rollout's worker that has no call to run waits (at
    /// most `IDLE_HOLD`, a quarter of the lease) for the runner's next
    /// call and carries it: a call reaches an idle worker at once, and an
    /// idle rollout costs a renew every few seconds, not a poll. The
    /// answer kept for a replay is the one without it.
    async fn hold_for_a_call(&self, attempt: (BuildId, u64), answer: Answered) -> Answered {
        let rollouts = &self.remote_rollouts;
        if !rollouts.runs(attempt.0) {
            return answer;
        }
        let hold = IDLE_HOLD.min(self.settings.lease_ttl / 4);
        let handed = rollouts.handed();
        tokio::pin!(handed);
        handed.as_mut().enable();
        let next_call = rollouts.next_call(attempt.0);
        if next_call.is_null() {
            tokio::select! {
                _ = handed => {}
                _ = tokio::time::sleep(hold) => {}
            }
        }
        let next_call = rollouts.next_call(attempt.0);
        let Some(seq) = next_call["seq"].as_u64() else {
            return answer;
        };
        let Ok(mut body) = serde_json::from_str::<Value>(&answer.body) else {
            return answer;
        };
        body["next_call"] = next_call;
        rollouts.delivered(attempt.0, seq, attempt.1);
        Answered::new(body.to_string())
    }

    /// `POST /internal/v1/attempts/{attempt}/calls/{seq}`: the end of one
    /// call of a rollout build. Call 1, its `deploy`, starts the rollout
    /// when it exited 0 with a valid result (the plan, the result and the
    /// work state stored in the call's transaction); a later call's end
    /// goes to the runner waiting for it. A report of a call berth no
    /// longer waits for (berth restarted meanwhile) is taken and changes
    /// nothing: the runner asks again.
    pub async fn call_report(
        self: &Arc<Self>,
        worker: WorkerCaller,
        attempt: (BuildId, u64),
        call: AuthorityCall,
        seq: u64,
        mut report: RemoteOutcome,
    ) -> Result<Answered, Refusal> {
        let build = attempt.0;
        let files = if seq == super::remote_rollout::FIRST_CALL {
            let deployment = self
                .store
                .read()?
                .attempt(build, attempt.1)?
                .filter(|a| a.worker == worker.name)
                .map(|a| a.deployment);
            match deployment {
                Some(d) => Some(Arc::new(
                    self.prepare_files(attempt, &d, report.take_uploads())
                        .await?,
                )),
                None => None,
            }
        } else {
            None
        };
        let (hub, settings) = (self.hub.clone(), self.settings.clone());
        let report = Arc::new(report);
        let in_job = report.clone();
        let answered = self
            .store
            .write(move |tx| {
                authorized(tx, &hub, &worker, attempt, "call", &call, |tx, a, now| {
                    if in_job.progress_through != a.applied_through {
                        return Ok(Err(Refusal::ProgressGap {
                            applied_through: a.applied_through,
                        }));
                    }
                    if let Some(files) = &files {
                        deploy_reported_tx(tx, &hub, &settings, a.build, &in_job, files, now)?;
                    }
                    a.accepted_calls += 1;
                    Ok(Ok(json!({
                        "next_call": Value::Null,
                        "done": super::remote_rollout::rollout_done(tx, a.build)?,
                    })
                    .to_string()))
                })
            })
            .await?;
        let Ok(answer) = &answered else {
            return answered;
        };
        if answer.replayed {
            return answered;
        }
        if seq == super::remote_rollout::FIRST_CALL {
            self.drop_staged(attempt);
            let started = self.store.read()?.rollout(build)?.is_some();
            if started {
                self.start_remote_rollout(build);
            }
        } else if let Some(reply) = self.remote_rollouts.take_reply(build, seq) {
            let end = call_end(&report.ended, &report.result);
            if reply.send(end).is_err() {
                tracing::warn!(build = %format_build_id(build), seq, "a rollout's call was reported after its runner stopped waiting");
            }
        }
        answered
    }

    /// `POST /internal/v1/attempts/{attempt}/progress`.
    pub async fn progress(
        self: &Arc<Self>,
        worker: WorkerCaller,
        attempt: (BuildId, u64),
        call: AuthorityCall,
        items: Vec<(u64, ProgressItem)>,
    ) -> Result<Answered, Refusal> {
        let (hub, max_log) = (self.hub.clone(), self.settings.max_log_bytes);
        self.store
            .write(move |tx| {
                authorized(
                    tx,
                    &hub,
                    &worker,
                    attempt,
                    "progress",
                    &call,
                    |tx, a, now| {
                        let seqs: Vec<u64> = items.iter().map(|(seq, _)| *seq).collect();
                        let fresh = match authority::new_items(a.applied_through, &seqs) {
                            Ok(range) => &items[range],
                            Err(applied_through) => {
                                return Ok(Err(Refusal::ProgressGap { applied_through }))
                            }
                        };
                        let Some(mut b) = tx.build(a.build)? else {
                            return Ok(Err(Refusal::NotFound(Missing::Build)));
                        };
                        append(
                            tx,
                            &hub,
                            &mut b,
                            a,
                            max_log,
                            fresh.iter().map(|(_, i)| i),
                            now,
                        )?;
                        tx.put_build(&b)?;
                        a.applied_through =
                            a.applied_through.max(seqs.last().copied().unwrap_or(0));
                        a.accepted_calls += 1;
                        Ok(Ok(json!({
                            "applied_through": a.applied_through,
                            "cancel": a.cancel_requested_at.is_some(),
                        })
                        .to_string()))
                    },
                )
            })
            .await?
    }

    /// `POST /internal/v1/attempts/{attempt}/outcome`: the verdict of a
    /// local build, from what the worker reports, in one transaction.
    pub async fn outcome(
        self: &Arc<Self>,
        worker: WorkerCaller,
        attempt: (BuildId, u64),
        call: AuthorityCall,
        mut outcome: RemoteOutcome,
    ) -> Result<Answered, Refusal> {
        // The files are read and checked before the write job, which stores
        // them only if the call has authority. An unknown attempt is the
        // job's to refuse.
        let deployment = self
            .store
            .read()?
            .attempt(attempt.0, attempt.1)?
            .filter(|a| a.worker == worker.name)
            .map(|a| a.deployment);
        let files = match deployment {
            Some(d) => Some(Arc::new(
                self.prepare_files(attempt, &d, outcome.take_uploads())
                    .await?,
            )),
            None => None,
        };
        let rolls_out = self.rolls_out(attempt.0)?;
        let (hub, settings) = (self.hub.clone(), self.settings.clone());
        let answered = self
            .store
            .write(move |tx| {
                authorized(
                    tx,
                    &hub,
                    &worker,
                    attempt,
                    "outcome",
                    &call,
                    |tx, a, now| {
                        if outcome.progress_through != a.applied_through {
                            return Ok(Err(Refusal::ProgressGap {
                                applied_through: a.applied_through,
                            }));
                        }
                        let Some(files) = &files else {
                            return Ok(Err(Refusal::NotFound(Missing::Attempt)));
                        };
                        let reported = (&outcome, files.as_ref(), rolls_out);
                        let summary = settle(tx, &hub, &settings, a, &worker, reported, now)?;
                        Ok(Ok(summary))
                    },
                )
            })
            .await?;
        if answered.is_ok() {
            self.drop_staged(attempt);
            self.remote_rollouts.forget(attempt.0);
        }
        // The deployment's next build may go now.
        self.wake_queue();
        answered
    }

    /// Loses every active attempt of a revoked token at once (in the
    /// revocation's transaction).
    pub(super) fn lose_attempts_of(tx: &Tx, hub: &Arc<Hub>, worker: &str) -> StoreResult<()> {
        for (build, _) in tx.running_builds()? {
            if let Some(mut a) = tx.last_attempt(build)? {
                if a.worker == worker && a.state == AttemptState::Active {
                    lose_tx(tx, hub, &mut a, LossCause::TokenRevoked, now_millis())?;
                }
            }
        }
        Ok(())
    }

    /// Runs forever: within `LEASE_SWEEP` of a lease's expiry, its attempt
    /// is lost (workers.md "Loss"). It reads first and writes only when an
    /// attempt is due: an idle berth writes nothing.
    pub async fn run_leases(self: Arc<Self>) {
        let ttl = i64::try_from(self.lease_ttl_ms()).unwrap_or(i64::MAX);
        let grace = i64::try_from(self.settings.cancel_grace.as_millis())
            .unwrap_or(i64::MAX)
            .saturating_add(ttl);
        loop {
            tokio::time::sleep(LEASE_SWEEP).await;
            let due = move |a: &AttemptRecord, now: Millis| {
                a.state == AttemptState::Active
                    && (authority::lease_passed(a, now) || cancel_overdue(a, now, grace))
            };
            match self.any_attempt(|a| due(a, now_millis())) {
                Ok(false) => continue,
                Ok(true) => {}
                Err(e) => {
                    tracing::error!(error = %e, "the lease sweep cannot read the store; it tries again");
                    continue;
                }
            }
            let hub = self.hub.clone();
            let swept = self
                .store
                .write(move |tx| {
                    let now = now_millis();
                    for (build, _) in tx.running_builds()? {
                        if let Some(mut a) = tx.last_attempt(build)?.filter(|a| due(a, now)) {
                            lose_tx(tx, &hub, &mut a, LossCause::LeaseExpired, now)?;
                        }
                    }
                    Ok(())
                })
                .await;
            match swept {
                Ok(()) => self.wake_queue(),
                Err(e) => {
                    tracing::error!(error = %e, "the lease sweep could not store a loss; it tries again")
                }
            }
        }
    }

    /// Whether a running build's newest attempt satisfies `test`.
    fn any_attempt(&self, test: impl Fn(&AttemptRecord) -> bool) -> StoreResult<bool> {
        let rx = self.store.read()?;
        for (build, _) in rx.running()? {
            if rx.last_attempt(build)?.is_some_and(|a| test(&a)) {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// A cancel the worker has not answered within `--cancel-grace` +
/// `--lease-ttl` (ms in `grace`): the build ends `cancelled` without it.
fn cancel_overdue(a: &AttemptRecord, now: Millis, grace: i64) -> bool {
    a.lease_expires_at.is_some()
        && a.cancel_requested_at
            .is_some_and(|at| now >= at.saturating_add(grace))
}

/// What a claim's write job needs besides the call.
struct ClaimContext {
    settings: Arc<Settings>,
    /// Whether the build's source has a health step.
    health: bool,
    /// The labels the build requires.
    required: Vec<String>,
    /// Deployments whose orphaned deployer is still being stopped.
    blocked: HashSet<String>,
    /// The deployment's first stored work state, when it has none yet.
    first_work_state: NewWorkState,
    /// A deploy that rolls out (its deployer lists `activate`).
    rolls_out: bool,
}

/// The claim's write job (workers.md "Claim").
fn claim_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    ctx: &ClaimContext,
    worker: &WorkerCaller,
    build_id: BuildId,
    call: &ClaimCall,
) -> StoreResult<Result<Answered, Refusal>> {
    let Some(mut b) = tx.build(build_id)? else {
        return Ok(Err(Refusal::NotFound(Missing::Build)));
    };
    let last = tx.last_attempt(build_id)?;
    if let Some(last) = last.as_ref().filter(|a| a.worker == worker.name) {
        if let Some(earlier) = replayed(last, "claim", &call.operation_id, &call.digest) {
            return Ok(earlier);
        }
    }
    let mut d = tx.deployment(&b.deployment)?;
    let handed_over = super::remote_rollout::awaits_claim(tx, &b)?;
    let claimable = claimable(tx, ctx, &b, d.as_ref(), handed_over)?;
    let held = held_by(tx, &worker.name)?;
    let scene = ClaimScene {
        status: b.status,
        claimable,
        required: &ctx.required,
        offered: &call.labels,
        held,
        handed_over,
    };
    let change = Change::new(tx, hub);
    if let Some(refusal) = authority::claim_refusal(&scene) {
        return refuse_claim(&change, worker, &b, refusal);
    }
    let Some(d) = d.as_mut() else {
        return Ok(Err(Refusal::Claim(authority::ClaimRefusal::NotClaimable)));
    };
    let now = change.now();
    let ttl =
        u64::try_from(ctx.settings.lease_ttl.as_millis()).unwrap_or(authority::LEASE_TTL_MAX_MS);
    let last_fence = last.as_ref().map_or(0, |a| a.fence);
    let (who, incarnation) = (worker.name.as_str(), call.incarnation.as_str());
    let mut a = authority::new_attempt(
        build_id,
        &b.deployment,
        who,
        incarnation,
        last_fence,
        now,
        Some(ttl),
    );
    let snaps = match handed_over {
        true => tx
            .build_snapshots(build_id)?
            .ok_or_else(|| crate::store::StoreError::corrupt("a build without its snapshots"))?,
        false => change.start(d, &mut b)?,
    };
    let work_state = handed_work_state(tx, ctx, &b.deployment, now)?;
    let claimed = attempt_event("claimed", &a);
    let line = claimed_line(
        &worker.name,
        authority::attempt_id(build_id, a.fence),
        handed_over,
    );
    let items = [Amid::Event(BuildEvent::Attempt, claimed), Amid::Line(line)];
    append_amid(tx, hub, &mut b, &mut a, u64::MAX, &items, now)?;
    tx.put_build(&b)?;
    change.audit(&worker_draft("attempt_claim", worker, &b, AuditResult::Ok))?;
    let answer = claim_answer(
        &ctx.settings,
        &b,
        &snaps,
        &a,
        (ctx, handed_over),
        work_state,
    )?;
    let (operation, digest) = (call.operation_id.as_str(), call.digest.as_str());
    authority::keep_reply(&mut a, "claim", operation, digest, answer.clone());
    tx.put_attempt(&a)?;
    Ok(Ok(Answered::new(answer)))
}

/// Whether `b` may be claimed now: a rollout handed over, or the oldest
/// queued build of a deployment with nothing running, not held after a
/// loss, not frozen out; never while its deployment's orphan is stopped.
fn claimable(
    tx: &Tx,
    ctx: &ClaimContext,
    b: &BuildRecord,
    d: Option<&DeploymentRecord>,
    handed_over: bool,
) -> StoreResult<bool> {
    if ctx.blocked.contains(&b.deployment) {
        return Ok(false);
    }
    if handed_over {
        return Ok(true);
    }
    let grace = i64::try_from(ctx.settings.cancel_grace.as_millis()).unwrap_or(i64::MAX);
    let Some(d) = d else {
        return Ok(false);
    };
    Ok(d.running.is_none()
        && !super::queue::held_after_loss(tx, d, now_millis(), grace)?
        && !super::queue::frozen_out(tx, b, now_millis())?
        && !tx.queued_before(&b.deployment, b.id)?)
}

/// A lost claim: audited with its reason, nothing else written.
fn refuse_claim(
    change: &Change,
    worker: &WorkerCaller,
    b: &BuildRecord,
    refusal: authority::ClaimRefusal,
) -> StoreResult<Result<Answered, Refusal>> {
    let mut draft = worker_draft("attempt_claim", worker, b, AuditResult::Refused);
    draft.reason = Some(refusal.reason().into());
    change.audit(&draft)?;
    Ok(Err(Refusal::Claim(refusal)))
}

/// berth's line for a won claim.
fn claimed_line(worker: &str, attempt: String, handed_over: bool) -> String {
    match handed_over {
        true => format!("[berth] the rollout goes on on worker {worker} (attempt {attempt})"),
        false => format!("[berth] running on worker {worker} (attempt {attempt})"),
    }
}

/// The work state a claim hands out; the deployment's first remote claim
/// stores berth's own work dir as its first (from then on the stored work
/// state is the truth).
fn handed_work_state(
    tx: &Tx,
    ctx: &ClaimContext,
    deployment: &str,
    now: Millis,
) -> StoreResult<Option<WorkStateRef>> {
    if tx.work_states(deployment)?.is_none() {
        let first = match &ctx.first_work_state {
            NewWorkState::Unchanged => &NewWorkState::Empty,
            first => first,
        };
        let keep = ctx.settings.keep_work_states;
        super::work_state::keep_tx(tx, deployment, first, None, keep, now)?;
    }
    Ok(tx.work_states(deployment)?.and_then(|w| w.current))
}

/// Authoritative attempts `worker` holds now.
fn held_by(tx: &Tx, worker: &str) -> StoreResult<usize> {
    let mut held = 0;
    for (build, _) in tx.running_builds()? {
        if let Some(a) = tx.last_attempt(build)? {
            if a.worker == worker && a.state == AttemptState::Active {
                held += 1;
            }
        }
    }
    Ok(held)
}

/// The claim answer (workers.md "Claim").
fn claim_answer(
    settings: &Settings,
    b: &BuildRecord,
    snaps: &BuildSnapshots,
    a: &AttemptRecord,
    (ctx, deployed): (&ClaimContext, bool),
    work_state: Option<WorkStateRef>,
) -> StoreResult<String> {
    // A rollout's gates and confirm are berth's calls, not a health step.
    let health = ctx.health && !ctx.rolls_out;
    let request = deployer_request(b, snaps).map_err(|e| {
        crate::store::StoreError::corrupt(format!("a stored configuration snapshot: {e}"))
    })?;
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let health = health.then(|| {
        json!({
            "interval_ms": ms(settings.health_interval),
            "timeout_ms": ms(settings.health_timeout),
        })
    });
    let verb = match b.kind {
        BuildKind::Deploy => "deploy",
        BuildKind::Destroy => "destroy",
    };
    Ok(json!({
        "authority": authority_json(a),
        "lease_ttl_ms": ms(settings.lease_ttl),
        "build": {"id": format_build_id(b.id), "deployment": b.deployment, "kind": verb},
        "verb": verb,
        "request": request,
        "health": health,
        "rollout": ctx.rolls_out,
        // A rollout handed over: its deploy ran; its calls follow.
        "deployed": deployed,
        "work_state": work_state.map(|w| json!({"digest": w.digest, "size": w.size})),
        "limits": {
            "build_timeout_ms": ms(settings.build_timeout),
            "cancel_grace_ms": ms(settings.cancel_grace),
            "max_work_state": settings.max_work_state,
            "max_artifact_bytes": settings.max_artifact_bytes,
            "max_batch_items": authority::MAX_BATCH_ITEMS,
            "max_body": settings.max_body,
        },
    })
    .to_string())
}

fn authority_json(a: &AttemptRecord) -> serde_json::Value {
    json!({
        "attempt_id": authority::attempt_id(a.build, a.fence),
        "fence": a.fence,
        "worker_incarnation": a.incarnation,
        "lease_expires_at": a.lease_expires_at.map(format_time),
    })
}

/// The data of an `attempt` event.
fn attempt_event(change: &str, a: &AttemptRecord) -> String {
    json!({
        "change": change,
        "attempt_id": authority::attempt_id(a.build, a.fence),
        "worker": a.worker,
        "worker_incarnation": a.incarnation,
        "fence": a.fence,
        "lease_expires_at": a.lease_expires_at.map(format_time),
    })
    .to_string()
}

/// An audit draft of a worker's call about build `b`.
fn worker_draft(
    action: &'static str,
    worker: &WorkerCaller,
    b: &BuildRecord,
    result: AuditResult,
) -> Draft {
    let mut draft = crate::engine::audit::system_draft(action, Some(b.deployment.clone()), result);
    draft.actor = Some(worker.actor());
    draft.build = Some(format_build_id(b.id));
    draft
}

/// The frame of every call after the claim: the attempt, whose it is,
/// the replay, the authority; then `run`, whose answer is kept for
/// replays. `run` checks before it writes: its refusal changes nothing.
fn authorized(
    tx: &Tx,
    hub: &Arc<Hub>,
    worker: &WorkerCaller,
    (build, fence): (BuildId, u64),
    route: &'static str,
    call: &AuthorityCall,
    run: impl FnOnce(&Tx, &mut AttemptRecord, Millis) -> StoreResult<Result<String, Refusal>>,
) -> StoreResult<Result<Answered, Refusal>> {
    let Some(mut a) = tx
        .attempt(build, fence)?
        .filter(|a| a.worker == worker.name)
    else {
        return Ok(Err(Refusal::NotFound(Missing::Attempt)));
    };
    if let Some(earlier) = replayed(&a, route, &call.operation_id, &call.digest) {
        return Ok(earlier);
    }
    let now = now_millis();
    if let Err(stale) = authority::judge(&a, &call.call(), now) {
        refuse(tx, hub, &mut a, worker, stale, now)?;
        let slot = match stale {
            Stale::Authority => 0,
            Stale::LeaseExpired => 1,
        };
        tx.after_commit(move || {
            REFUSED_STALE[slot].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        return Ok(Err(Refusal::Stale(stale)));
    }
    let answer = match run(tx, &mut a, now)? {
        Ok(answer) => answer,
        Err(refusal) => return Ok(Err(refusal)),
    };
    authority::keep_reply(
        &mut a,
        route,
        &call.operation_id,
        &call.digest,
        answer.clone(),
    );
    tx.put_attempt(&a)?;
    Ok(Ok(Answered::new(answer)))
}

/// The answer to a call `a` has answered before (the same body), or the
/// refusal of its `operation_id` used with another body; `None` for a new
/// call.
fn replayed(
    a: &AttemptRecord,
    route: &str,
    operation_id: &str,
    digest: &str,
) -> Option<Result<Answered, Refusal>> {
    match authority::replay(a, route, operation_id, digest) {
        Replay::Same(answer) => Some(Ok(Answered {
            body: answer.to_string(),
            replayed: true,
        })),
        Replay::Conflict => Some(Err(Refusal::IdempotencyConflict)),
        Replay::New => None,
    }
}

/// A refused call: an active attempt whose lease passed is lost now (the
/// sweep would have); the attempt's first refusal is audited. Nothing
/// else is written.
fn refuse(
    tx: &Tx,
    hub: &Arc<Hub>,
    a: &mut AttemptRecord,
    worker: &WorkerCaller,
    stale: Stale,
    now: Millis,
) -> StoreResult<()> {
    if stale == Stale::LeaseExpired && a.state == AttemptState::Active {
        lose_tx(tx, hub, a, LossCause::LeaseExpired, now)?;
    }
    if a.refusal_audited {
        return Ok(());
    }
    a.refusal_audited = true;
    tx.put_attempt(a)?;
    let Some(b) = tx.build(a.build)? else {
        return Ok(());
    };
    let mut draft = worker_draft("attempt_refused", worker, &b, AuditResult::Refused);
    draft.reason = Some(stale.reason().into());
    Change::new(tx, hub).audit(&draft)
}

/// A worker's end as a local run's, with who stopped it.
fn local_end(ended: &RemoteEnd) -> (Result<Ended, Failure>, Halt) {
    match ended {
        RemoteEnd::Exit(code) => (Ok(Ended::Exit(*code)), Halt::No),
        RemoteEnd::Signal(sig) => (Ok(Ended::Signal(*sig)), Halt::No),
        RemoteEnd::StatusUnknown => (Ok(Ended::StatusUnknown), Halt::No),
        RemoteEnd::Timeout => (Ok(Ended::Timeout), Halt::No),
        RemoteEnd::Cancelled => (Ok(Ended::Cancelled), Halt::Cancel),
        RemoteEnd::Shutdown => (Ok(Ended::Cancelled), Halt::Shutdown),
        RemoteEnd::NotRun { reason, detail } => {
            (Err(Failure::new(*reason, detail.clone())), Halt::No)
        }
    }
}

/// How a reported call ended, as the runner reads a local call's end.
fn call_end(ended: &RemoteEnd, result: &Result<String, String>) -> super::health::CallEnd {
    let ended = match ended {
        RemoteEnd::Exit(code) => Ended::Exit(*code),
        RemoteEnd::Signal(sig) => Ended::Signal(*sig),
        RemoteEnd::StatusUnknown => Ended::StatusUnknown,
        RemoteEnd::Timeout => Ended::Timeout,
        RemoteEnd::Cancelled | RemoteEnd::Shutdown => Ended::Cancelled,
        RemoteEnd::NotRun { detail, .. } => return Err(detail.clone()),
    };
    let result = match result {
        Ok(text) => Ok(Some(text.clone().into_bytes())),
        Err(problem) if problem == "missing" => Ok(None),
        Err(problem) => Err(problem.clone()),
    };
    Ok((ended, result, Vec::new()))
}

/// The nodes and the health end a remote rollout build's verdict reads:
/// the rollout's when its plan is stored; a deploy that changed more nodes
/// than a rollout takes fails `deployer_protocol`, as on the embedded
/// worker.
fn rollout_verdict(
    tx: &Tx,
    hub: &Arc<Hub>,
    build: BuildId,
    result: Option<CheckedResult>,
    halted: Halt,
    reported: &Option<HealthEnd>,
) -> StoreResult<(Option<CheckedResult>, Option<HealthEnd>)> {
    if let Some((nodes, end)) = super::remote_rollout::settled_view(tx, hub, build, halted)? {
        return Ok((Some(Ok(nodes)), Some(end)));
    }
    let changed = match &result {
        Some(Ok(nodes)) => nodes.iter().filter(|n| n.changed).count(),
        Some(Err(_)) | None => 0,
    };
    if changed > crate::rollout::MAX_ROLLOUT_NODES {
        let why = format!(
            "the deploy changed {changed} nodes; a rollout takes at most {}",
            crate::rollout::MAX_ROLLOUT_NODES
        );
        return Ok((
            result,
            Some(HealthEnd::Aborted(FailureReason::DeployerProtocol, why)),
        ));
    }
    Ok((result, reported.clone()))
}

/// A rollout build's `deploy` reported (call 1): when it exited 0 with a
/// valid result, its rollout is planned and stored with that result and
/// the work state it left (what a later call starts from); otherwise
/// nothing, and the worker's outcome judges the deploy as any other.
fn deploy_reported_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    settings: &Settings,
    build: BuildId,
    report: &RemoteOutcome,
    files: &PreparedFiles,
    now: Millis,
) -> StoreResult<()> {
    let Some(b) = tx.build(build)? else {
        return Ok(());
    };
    let deployed = matches!(report.ended, RemoteEnd::Exit(0)) && files.work_state_problem.is_none();
    if tx.rollout(build)?.is_some() || !deployed {
        return Ok(());
    }
    let Ok(text) = &report.result else {
        return Ok(());
    };
    let nodes = parse_result(
        text.as_bytes(),
        b.kind,
        |path| match files.sboms.get(path) {
            Some(prepared) => prepared.clone(),
            None => Err("the SBOM file was not uploaded by the worker".to_string()),
        },
        &|path| files.artifact(path),
    );
    let Ok(nodes) = nodes else {
        return Ok(());
    };
    let changed: Vec<String> = nodes
        .iter()
        .filter(|n| n.changed)
        .map(|n| n.name.clone())
        .collect();
    if changed.len() > crate::rollout::MAX_ROLLOUT_NODES {
        return Ok(());
    }
    super::work_state::keep_tx(
        tx,
        &b.deployment,
        &files.work_state,
        Some(build),
        settings.keep_work_states,
        now,
    )?;
    match super::rollouts::plan_tx(tx, hub, &b, &changed, &nodes)? {
        Ok(()) => Ok(()),
        // A result the plan refuses (a bound node without an artifact) is
        // stored as any other result that is not a plan: the verdict says
        // why.
        Err(why) => {
            tracing::warn!(build = %format_build_id(build), %why, "a remote rollout's plan was refused");
            Ok(())
        }
    }
}

/// Appends a progress batch's items to a running build's log.
fn append<'i>(
    tx: &Tx,
    hub: &Arc<Hub>,
    b: &mut BuildRecord,
    a: &mut AttemptRecord,
    max_log: u64,
    items: impl Iterator<Item = &'i ProgressItem>,
    now: Millis,
) -> StoreResult<()> {
    let mut amid = Vec::new();
    for item in items {
        match item {
            ProgressItem::Log(line) => amid.push(Amid::Line(line.clone())),
            ProgressItem::Health {
                node,
                healthy,
                reason,
                attempt,
            } => {
                let data =
                    json!({"node": node, "healthy": healthy, "reason": reason, "attempt": attempt});
                amid.push(Amid::Event(BuildEvent::Health, data.to_string()));
                let answer = super::health::HealthAnswer {
                    node: node.clone(),
                    healthy: *healthy,
                    reason: reason.clone(),
                };
                amid.push(Amid::Line(super::health::answer_line(*attempt, &answer)));
            }
        }
    }
    append_amid(tx, hub, b, a, max_log, &amid, now)
}

/// The loss of an attempt (workers.md "Loss"), in one transaction: the
/// attempt lost, its line and `attempt` event, the build failed
/// `lost_attempt` (or `cancelled`, when a cancel was asked), the webhooks
/// and the audit event. Never followed by a rollback.
fn lose_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    a: &mut AttemptRecord,
    cause: LossCause,
    now: Millis,
) -> StoreResult<()> {
    authority::lose(a, cause);
    tx.after_commit(|| {
        ATTEMPTS_LOST.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    });
    let Some(mut b) = tx.build(a.build)? else {
        return tx.put_attempt(a);
    };
    let why = match cause {
        LossCause::LeaseExpired => "its lease passed",
        LossCause::TokenRevoked => "its token was revoked",
    };
    let detail = format!(
        "worker {} lost attempt {} ({why}; last renewed {})",
        a.worker,
        authority::attempt_id(a.build, a.fence),
        format_time(a.last_renewed_at)
    );
    let items = [
        Amid::Line(format!("[berth] lost: {detail}")),
        Amid::Event(BuildEvent::Attempt, attempt_event("lost", a)),
    ];
    append_amid(tx, hub, &mut b, a, u64::MAX, &items, now)?;
    tx.put_build(&b)?;
    tx.put_attempt(a)?;
    let cancelled = a.cancel_requested_at.is_some();
    // A rollout waits for the next claim (its runner fails it instead
    // when the worker was lost during a call).
    let handed_over = !cancelled && super::remote_rollout::awaits_claim(tx, &b)?;
    if handed_over {
        let line = "[berth] the rollout waits for the next worker to claim it".to_string();
        append_amid(tx, hub, &mut b, a, u64::MAX, &[Amid::Line(line)], now)?;
        tx.put_build(&b)?;
        tx.put_attempt(a)?;
    } else {
        end_lost_tx(tx, hub, &b, cancelled, &detail, now)?;
    }
    let mut draft = crate::engine::audit::system_draft(
        "attempt_lost",
        Some(b.deployment.clone()),
        AuditResult::Ok,
    );
    draft.build = Some(format_build_id(b.id));
    draft.reason = Some(why.replace(' ', "_"));
    draft.count = a.accepted_calls;
    Change::new(tx, hub).audit(&draft)
}

/// A lost attempt's build ends: `lost_attempt` (or `cancelled`, when a
/// cancel was asked), its rollout with it, the `build.lost` webhook.
fn end_lost_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    b: &BuildRecord,
    cancelled: bool,
    detail: &str,
    now: Millis,
) -> StoreResult<()> {
    let end = if cancelled {
        End::cancelled("cancelled; the worker stopped answering")
    } else {
        End::failed(FailureReason::LostAttempt, detail)
    };
    // A rollout on the lost worker ends with its build (its runner sees
    // the record finished and stops).
    let halted = if cancelled { Halt::Cancel } else { Halt::No };
    super::remote_rollout::settled_view(tx, hub, b.id, halted)?;
    // A lost attempt stores no work state.
    let finished = Arc::new(Finished::committed(
        b,
        end,
        vec![],
        NewWorkState::Unchanged,
        1,
    ));
    finish_tx(tx, hub, b.id, &finished)?;
    if !cancelled {
        let summary = tx.build(b.id)?.map(|b| b.summary());
        super::outbox::outbox(
            tx,
            hub,
            "build.lost",
            Some(&b.deployment),
            None,
            || {
                serde_json::to_value(summary).map_err(|e| {
                    crate::store::StoreError::other(format!("a build summary as JSON: {e}"))
                })
            },
            now,
        )?;
    }
    Ok(())
}

/// berth's own closing lines of an accepted outcome: a node's missing
/// SBOM, the lines past `--max-log-bytes`.
fn closing_lines(
    result: &Option<Result<Vec<super::outcome::NodeOutcome>, String>>,
    a: &AttemptRecord,
) -> Vec<Amid> {
    let mut closing = Vec::new();
    for node in result.iter().flatten().flatten() {
        if let super::outcome::SbomOutcome::Unavailable(reason) = &node.sbom {
            closing.push(Amid::Line(format!(
                "[berth] node {}: SBOM unavailable: {reason}",
                node.name
            )));
        }
    }
    if a.dropped_lines > 0 {
        closing.push(Amid::Line(format!(
            "[berth] {} line(s), {} byte(s) not stored: the log reached --max-log-bytes",
            a.dropped_lines, a.dropped_bytes
        )));
    }
    closing
}

/// The accepted outcome: the verdict as a local build's, stored with the
/// build's final status in this transaction; returns the final summary.
fn settle(
    tx: &Tx,
    hub: &Arc<Hub>,
    settings: &Settings,
    a: &mut AttemptRecord,
    worker: &WorkerCaller,
    (outcome, files, rolls_out): (&RemoteOutcome, &PreparedFiles, bool),
    now: Millis,
) -> StoreResult<String> {
    let Some(mut b) = tx.build(a.build)? else {
        return Err(crate::store::StoreError::corrupt(
            "an attempt without its build",
        ));
    };
    let (ended, halted) = local_end(&outcome.ended);
    // A path the outcome's `files` does not name is a missing file.
    let result = match (&ended, &outcome.result) {
        (Ok(Ended::Exit(0)), Ok(text)) => Some(parse_result(
            text.as_bytes(),
            b.kind,
            |path| match files.sboms.get(path) {
                Some(prepared) => prepared.clone(),
                None => Err("the SBOM file was not uploaded by the worker".to_string()),
            },
            &|path| files.artifact(path),
        )),
        (Ok(Ended::Exit(0)), Err(problem)) => Some(Err(format!("the result file: {problem}"))),
        _ => None,
    };
    // A rollout's nodes are those stored with its plan, its end the
    // rollout's (workers.md "Rollouts on workers").
    let (result, health) = if rolls_out && b.kind == BuildKind::Deploy {
        rollout_verdict(tx, hub, b.id, result, halted, &outcome.health)?
    } else {
        (result, outcome.health.clone())
    };
    let closing = closing_lines(&result, a);
    append_amid(tx, hub, &mut b, a, u64::MAX, &closing, now)?;
    tx.put_build(&b)?;
    let judged = RunOutcome {
        root: std::path::PathBuf::new(),
        ended,
        result,
        health,
        log: LogBuffer::new(0, 0, 0),
        disk_failure: None,
        halted,
        work_state_problem: files.work_state_problem.clone(),
    };
    let end = judged.verdict(settings.build_timeout);
    let nodes = match judged.result {
        Some(Ok(nodes)) => nodes,
        Some(Err(_)) | None => vec![],
    };
    a.state = AttemptState::Ended;
    let finished = Arc::new(Finished::committed(
        &b,
        end,
        nodes,
        files.work_state.clone(),
        settings.keep_work_states,
    ));
    finish_tx(tx, hub, b.id, &finished)?;
    let Some(done) = tx.build(b.id)? else {
        return Err(crate::store::StoreError::corrupt(
            "a finished build without its record",
        ));
    };
    let mut draft = worker_draft("attempt_outcome", worker, &done, AuditResult::Ok);
    draft.count = a.accepted_calls;
    Change::new(tx, hub).audit(&draft)?;
    serde_json::to_string(&done.summary())
        .map_err(|e| crate::store::StoreError::other(format!("a build summary as JSON: {e}")))
}
