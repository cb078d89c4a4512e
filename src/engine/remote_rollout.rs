//! Rollouts on remote workers (workers.md "Rollouts on workers"): berth
//! orchestrates, the worker executes. The worker that claimed a rollout
//! build runs `deploy` and reports it as call 1
//! (`POST /internal/v1/attempts/{attempt}/calls/1`); when it exited 0 with
//! a valid result, berth stores the plan with that result (`plan_tx`) and
//! runs the same runner as for the embedded worker, over `RemoteIo`: each
//! call it decides is handed out as `next_call` in the answers to the
//! worker's renews and reports, run there, reported with its seq, and the
//! runner goes on. The worker sends its outcome once an answer says
//! `done`; the verdict then reads the rollout's end (`attempts::settle`).
//!
//! Why it exists apart from `rollouts`: the runner and its state machine
//! are one; only how a call reaches a deployer differs. What stays in
//! memory here is the one call waiting for the worker; everything a
//! restart needs (the plan, each step) is the rollout's record, so a berth
//! that restarts runs the rollout on from it, as it does a local one.
//!
//! A worker lost while no call of it runs, or while one runs, fails the
//! build `lost_attempt` (the hand-over to another claim is not built yet).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::{oneshot, watch};

use super::health::{CallEnd, HealthAnswer, HealthIo};
use super::outcome::{Halt, NodeOutcome};
use super::remote_log::Amid;
use super::rollouts::{RolloutIo, Run};
use super::runner::Ended;
use super::Engine;
use crate::events::BuildEvent;
use crate::locks::Held;
use crate::model::*;
use crate::store::{Lookup, StoreResult, Tx};

/// A rollout build's first call: its `deploy`, named by the claim.
pub const FIRST_CALL: u64 = 1;
/// Past a call's own limit, how long berth waits for the worker's report
/// (its output and report cross the network).
const CALL_SLACK: Duration = Duration::from_secs(30);
/// How often a call in flight looks whether its attempt is still active.
const LOST_POLL: Duration = Duration::from_secs(1);

/// The calls of the rollouts running on remote workers: per build, the
/// one waiting for its worker, and the runner's halt.
#[derive(Default)]
pub struct RemoteRollouts {
    slots: Mutex<HashMap<BuildId, Slot>>,
    /// Rung when a call is handed out or a runner is halted: renews that
    /// hold for a call look again.
    handed: tokio::sync::Notify,
}

struct Slot {
    /// The seq the next call gets. Seqs rise for as long as the attempt
    /// lives, across restarts of berth too: a runner starts its count at
    /// berth's clock in milliseconds, so a worker never mistakes a new call
    /// for one it ran.
    next_seq: u64,
    pending: Option<Pending>,
    halt: watch::Sender<Halt>,
}

struct Pending {
    seq: u64,
    verb: &'static str,
    request: Value,
    reply: oneshot::Sender<CallEnd>,
    /// The attempt (its fence) whose renew answer carried it, and when:
    /// from then the call runs there, and its limit counts.
    delivered: Option<(u64, tokio::time::Instant)>,
}

impl RemoteRollouts {
    /// A runner's slot (made fresh), and the receiver of its halts.
    fn open(&self, build: BuildId) -> watch::Receiver<Halt> {
        let (halt, halted) = watch::channel(Halt::No);
        let start = u64::try_from(now_millis()).unwrap_or(0).max(FIRST_CALL + 1);
        self.slots.held().insert(
            build,
            Slot {
                next_seq: start,
                pending: None,
                halt,
            },
        );
        halted
    }

    /// The call `build`'s worker runs next, as answers carry it:
    /// `{"seq", "verb", "request"}`, or null.
    pub fn next_call(&self, build: BuildId) -> Value {
        match self
            .slots
            .held()
            .get(&build)
            .and_then(|s| s.pending.as_ref())
        {
            Some(p) => json!({"seq": p.seq, "verb": p.verb, "request": p.request}),
            None => Value::Null,
        }
    }

    fn hand_out(
        &self,
        build: BuildId,
        verb: &'static str,
        request: Value,
        reply: oneshot::Sender<CallEnd>,
    ) -> Option<u64> {
        let mut slots = self.slots.held();
        let slot = slots.get_mut(&build)?;
        let seq = slot.next_seq;
        slot.next_seq += 1;
        slot.pending = Some(Pending {
            seq,
            verb,
            request,
            reply,
            delivered: None,
        });
        drop(slots);
        self.handed.notify_waiters();
        Some(seq)
    }

    /// Call `seq` reached the worker of attempt `fence` (a renew answer
    /// carrying it was given).
    pub fn delivered(&self, build: BuildId, seq: u64, fence: u64) {
        if let Some(p) = self
            .slots
            .held()
            .get_mut(&build)
            .and_then(|s| s.pending.as_mut())
        {
            if p.seq == seq && p.delivered.is_none() {
                p.delivered = Some((fence, tokio::time::Instant::now()));
            }
        }
    }

    /// Where call `seq` runs, once delivered.
    fn delivery(&self, build: BuildId, seq: u64) -> Option<(u64, tokio::time::Instant)> {
        let slots = self.slots.held();
        let p = slots.get(&build)?.pending.as_ref()?;
        (p.seq == seq).then_some(p.delivered).flatten()
    }

    /// The reply of call `seq`, when it is the one waiting.
    pub(super) fn take_reply(&self, build: BuildId, seq: u64) -> Option<oneshot::Sender<CallEnd>> {
        let mut slots = self.slots.held();
        let slot = slots.get_mut(&build)?;
        match &slot.pending {
            Some(p) if p.seq == seq => slot.pending.take().map(|p| p.reply),
            Some(_) | None => None,
        }
    }

    fn withdraw(&self, build: BuildId, seq: u64) {
        if let Some(slot) = self.slots.held().get_mut(&build) {
            if slot.pending.as_ref().is_some_and(|p| p.seq == seq) {
                slot.pending = None;
            }
        }
    }

    /// Tells `build`'s runner who stopped it (a cancel).
    pub fn halt(&self, build: BuildId, halt: Halt) {
        if let Some(slot) = self.slots.held().get(&build) {
            slot.halt.send_replace(halt);
        }
        self.handed.notify_waiters();
    }

    /// Whether a runner of `build` is here (its renews may hold).
    pub fn runs(&self, build: BuildId) -> bool {
        self.slots.held().contains_key(&build)
    }

    /// A future that completes at the next hand-out or halt (enable it
    /// before looking, so none falls between).
    pub fn handed(&self) -> tokio::sync::futures::Notified<'_> {
        self.handed.notified()
    }

    /// Forgets `build` (its outcome is stored, or its runner ended).
    pub fn forget(&self, build: BuildId) {
        self.slots.held().remove(&build);
    }
}

/// Whether a worker may send its outcome: the build has no rollout, or its
/// rollout is finished.
pub fn rollout_done(tx: &impl Lookup, build: BuildId) -> StoreResult<bool> {
    Ok(tx
        .rollout(build)?
        .is_none_or(|r| r.rollout.state == crate::model::RolloutState::Finished))
}

impl Engine {
    /// Runs the rollout of `build`, claimed by a remote worker, from where
    /// its record is: after its deploy was reported, or after a restart.
    pub(super) fn start_remote_rollout(self: &Arc<Self>, build: BuildId) {
        let halt = self.remote_rollouts.open(build);
        let engine = self.clone();
        tokio::spawn(async move {
            let end = engine.run_remote_rollout(build, halt).await;
            tracing::info!(build = %format_build_id(build), end = ?end, "a remote rollout's runner ended");
            if end != Some(super::health::HealthEnd::Halted(Halt::Shutdown)) {
                // Nothing more to hand out. The worker holding the build
                // sends its outcome; when none does, berth ends it here.
                engine.remote_rollouts.withdraw_all(build);
                engine.end_remote_rollout(build, None).await;
                // Ended here (no worker will send an outcome that forgets
                // it): its slot goes now.
                let ended = engine
                    .store
                    .read()
                    .and_then(|rx| rx.build(build))
                    .is_ok_and(|b| b.is_none_or(|b| b.status.is_finished()));
                if ended {
                    engine.remote_rollouts.forget(build);
                }
            }
        });
    }

    async fn run_remote_rollout(
        self: &Arc<Self>,
        build: BuildId,
        halt: watch::Receiver<Halt>,
    ) -> Option<super::health::HealthEnd> {
        let loaded = self
            .store
            .read()
            .and_then(|rx| Ok((rx.build(build)?, rx.build_snapshots(build)?)));
        let (b, snaps) = match loaded {
            Ok((Some(b), Some(s))) => (b, s),
            Ok(_) => return None,
            Err(e) => {
                tracing::error!(error = %e, build = %format_build_id(build), "cannot read a remote rollout's build");
                return None;
            }
        };
        let request = super::build::deployer_request(&b, &snaps).ok()?;
        let Some(verbs) = self.rollout_verbs(&snaps).await else {
            tracing::error!(build = %format_build_id(build), "a remote rollout's source no longer lists activate; it fails");
            self.rollout_apply(
                build,
                super::rollouts::Noted::bare(crate::rollout::Event::Failed),
            )
            .await
            .ok();
            return None;
        };
        let mut io = RemoteIo {
            engine: self.clone(),
            build,
            halt,
        };
        Some(
            Run::new(self, build, &request, verbs)
                .run_to_end(&mut io)
                .await,
        )
    }

    /// Whether attempt `fence` of `build` is active.
    fn attempt_active(&self, build: BuildId, fence: u64) -> bool {
        match self.store.read().and_then(|rx| rx.attempt(build, fence)) {
            Ok(Some(a)) => a.state == AttemptState::Active,
            Ok(None) => false,
            // Unknown for now: the call's own limit still bounds the wait.
            Err(_) => true,
        }
    }

    /// Ends a remote rollout's build here, when no worker will send its
    /// outcome: `lost` (a worker lost during a call, or a call never
    /// reported) fails it `lost_attempt`; else (the rollout ended while no
    /// worker held the build) its verdict is the rollout's. Nothing when
    /// the build ended meanwhile or a worker holds it.
    async fn end_remote_rollout(&self, build: BuildId, lost: Option<String>) {
        let (hub, timeout) = (self.hub.clone(), self.settings.build_timeout);
        let ended = self
            .store
            .write(move |tx| end_unheld_tx(tx, &hub, build, lost.as_deref(), timeout))
            .await;
        if let Err(e) = ended {
            tracing::error!(error = %e, build = %format_build_id(build), "cannot end a remote rollout's build; the lease sweep or a restart ends it");
        }
    }

    /// berth's own lines and events in a remote build's log, each with the
    /// next id of its channel (between the worker's progress batches).
    async fn append_to_remote(&self, build: BuildId, items: Vec<Amid>) {
        let (hub, max_log) = (self.hub.clone(), self.settings.max_log_bytes);
        let written = self
            .store
            .write(move |tx| append_tx(tx, &hub, build, max_log, &items))
            .await;
        if let Err(e) = written {
            tracing::error!(error = %e, build = %format_build_id(build), "cannot store berth's lines in a remote rollout's log");
        }
    }
}

impl RemoteRollouts {
    /// Withdraws the call waiting, if any (the runner ended).
    fn withdraw_all(&self, build: BuildId) {
        if let Some(slot) = self.slots.held().get_mut(&build) {
            slot.pending = None;
        }
    }
}

fn append_tx(
    tx: &Tx,
    hub: &Arc<crate::events::Hub>,
    build: BuildId,
    max_log: u64,
    items: &[Amid],
) -> StoreResult<()> {
    let Some(mut b) = tx.build(build)? else {
        return Ok(());
    };
    let Some(mut a) = tx.last_attempt(build)? else {
        return Ok(());
    };
    // A line after the end (a late one of a runner that was stopped) is
    // not stored: the log of a finished build is closed.
    if b.status != BuildStatus::Running {
        return Ok(());
    }
    super::remote_log::append_amid(tx, hub, &mut b, &mut a, max_log, items, now_millis())?;
    tx.put_build(&b)?;
    tx.put_attempt(&a)
}

/// A remote rollout's side of the runner: its calls handed to the worker,
/// its lines and events into the build's log by write jobs.
struct RemoteIo {
    engine: Arc<Engine>,
    build: BuildId,
    halt: watch::Receiver<Halt>,
}

impl HealthIo for RemoteIo {
    async fn call(&mut self, verb: &'static str, request: &Value, limit: Duration) -> CallEnd {
        let (reply, mut answered) = oneshot::channel();
        let rollouts = &self.engine.remote_rollouts;
        let Some(seq) = rollouts.hand_out(self.build, verb, request.clone(), reply) else {
            return Err("the rollout's runner has no slot".into());
        };
        // Until a worker holds the build, the call waits for a claim; from
        // its delivery it has `limit` (and the way back) to be reported.
        loop {
            tokio::select! {
                got = &mut answered => {
                    return got.unwrap_or_else(|_| Err("the worker running the call was lost".into()));
                }
                _ = tokio::time::sleep(LOST_POLL) => {}
            }
            let Some((fence, at)) = rollouts.delivery(self.build, seq) else {
                continue;
            };
            let lost = !self.engine.attempt_active(self.build, fence);
            if lost || at.elapsed() > limit + CALL_SLACK {
                rollouts.withdraw(self.build, seq);
                let why = match lost {
                    true => format!("the worker was lost during the {verb} call"),
                    false => format!("the worker did not report the {verb} call in time"),
                };
                self.engine
                    .end_remote_rollout(self.build, Some(why.clone()))
                    .await;
                return Err(why);
            }
        }
    }

    async fn lines(&mut self, lines: &[String]) {
        let items = lines.iter().map(|l| Amid::Line(l.clone())).collect();
        self.engine.append_to_remote(self.build, items).await;
    }

    async fn answer(&mut self, attempt: u32, a: &HealthAnswer) {
        let data =
            json!({"node": a.node, "healthy": a.healthy, "reason": a.reason, "attempt": attempt});
        let items = vec![
            Amid::Event(BuildEvent::Health, data.to_string()),
            Amid::Line(super::health::answer_line(attempt, a)),
        ];
        self.engine.append_to_remote(self.build, items).await;
    }

    fn halted(&self) -> Halt {
        *self.halt.borrow()
    }

    async fn halt_changed(&mut self) {
        if self.halt.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl RolloutIo for RemoteIo {
    async fn event(&mut self, kind: BuildEvent, data: String) {
        self.engine
            .append_to_remote(self.build, vec![Amid::Event(kind, data)])
            .await;
    }
}

/// The verdict's view of a remote rollout build at its outcome: its
/// nodes (stored with the plan) and how the rollout ended. A rollout not
/// finished when the worker ended (a cancel, a stop) ends here, as the
/// worker's end says.
pub fn settled_view(
    tx: &Tx,
    hub: &Arc<crate::events::Hub>,
    build: BuildId,
    halted: Halt,
) -> StoreResult<Option<(Vec<NodeOutcome>, super::health::HealthEnd)>> {
    let Some(mut r) = tx.rollout(build)? else {
        return Ok(None);
    };
    let nodes: Vec<NodeOutcome> = tx.rollout_result(build)?.unwrap_or_default();
    let end = match r.rollout.result {
        Some(outcome) => super::rollouts::end_of(outcome, &r, None),
        None => {
            let event = match halted {
                Halt::Cancel => crate::rollout::Event::Cancelled,
                Halt::No | Halt::Shutdown => crate::rollout::Event::Failed,
            };
            if let Ok(after) = r.rollout.apply(&event, now_millis(), false) {
                r.rollout = after;
                r.updated_at = now_millis();
                tx.put_rollout(&r)?;
                if let Some(mut d) = tx.deployment(&r.deployment)? {
                    let change = super::transition::Change::new(tx, hub);
                    change.rollout_changed(
                        &mut d,
                        super::rollouts::summary(&r).to_string(),
                        Some("rollout.finished"),
                    )?;
                }
            }
            match halted {
                Halt::No => super::health::HealthEnd::Failed(
                    "the worker ended before the rollout did".into(),
                ),
                halted => super::health::HealthEnd::Halted(halted),
            }
        }
    };
    Ok(Some((nodes, end)))
}

/// Whether `b` is a running rollout build on a remote worker whose last
/// attempt is over (lost between calls): it goes on with the next claim.
pub fn awaits_claim(tx: &impl Lookup, b: &BuildRecord) -> StoreResult<bool> {
    if b.status != BuildStatus::Running || b.kind != BuildKind::Deploy {
        return Ok(false);
    }
    let Some(a) = tx.last_attempt(b.id)? else {
        return Ok(false);
    };
    if a.worker == crate::authority::LOCAL_WORKER || a.state == AttemptState::Active {
        return Ok(false);
    }
    Ok(tx
        .rollout(b.id)?
        .is_some_and(|r| r.rollout.state != crate::model::RolloutState::Finished))
}

/// The write job of `Engine::end_remote_rollout`.
fn end_unheld_tx(
    tx: &Tx,
    hub: &Arc<crate::events::Hub>,
    build: BuildId,
    lost: Option<&str>,
    timeout: Duration,
) -> StoreResult<()> {
    let Some(b) = tx.build(build)? else {
        return Ok(());
    };
    let held = tx
        .last_attempt(build)?
        .is_some_and(|a| a.state == AttemptState::Active);
    if b.status != BuildStatus::Running || (held && lost.is_none()) {
        return Ok(());
    }
    let halted = match tx.last_attempt(build)?.and_then(|a| a.cancel_requested_at) {
        Some(_) => Halt::Cancel,
        None => Halt::No,
    };
    let Some((nodes, health)) = settled_view(tx, hub, build, halted)? else {
        return Ok(());
    };
    super::build::end_attempt(tx, build, AttemptState::Interrupted)?;
    let end = match lost {
        Some(why) => super::outcome::End::failed(FailureReason::LostAttempt, why),
        None => super::verdict::RunOutcome {
            root: std::path::PathBuf::new(),
            ended: Ok(Ended::Exit(0)),
            result: Some(Ok(nodes.clone())),
            health: Some(health),
            log: super::log_pipe::LogBuffer::new(0, 0, 0),
            disk_failure: None,
            halted,
            work_state_problem: None,
        }
        .verdict(timeout),
    };
    // As the embedded worker's final commit: the deploy's nodes with any
    // verdict but a loss.
    let nodes = if lost.is_some() { vec![] } else { nodes };
    let unchanged = super::work_state::NewWorkState::Unchanged;
    let finished = Arc::new(super::build::Finished::committed(
        &b, end, nodes, unchanged, 1,
    ));
    super::build::finish_tx(tx, hub, build, &finished)
}
