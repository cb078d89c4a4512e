//! A rollout that goes on after a restart (rollouts.md "With the rest of
//! berth", storage.md "Restart"): a build whose plan is stored is not
//! failed at start; it gets a new attempt of this berth and its runner
//! starts again from what the rollout's record says.
//!
//! Why it exists apart from `recovery`: recovery decides at start, in one
//! transaction per build, which builds end; this module is what runs on
//! afterwards. Why the log needs a hole: the run before the restart may
//! have sent lines live up to `seq_reserved` that never committed, and an
//! id once sent is never reused, so the next line's seq starts above it
//! (`BuildRecord::log_holes` keeps each line's seq computable).

use std::sync::Arc;

use crate::locks::Held;
use std::time::Duration;

use tokio::sync::watch;

use super::log_pipe::{LogBuffer, LogPipe};
use super::outcome::{Halt, NodeOutcome};
use super::runner::Ended;
use super::verdict::RunOutcome;
use super::work_state::NewWorkState;
use super::Engine;
use crate::model::*;
use crate::store::{Lookup, StoreResult, Tx};

/// How often a resumed rollout looks whether its deployment's orphaned
/// call (from before the restart) has been stopped.
const ORPHAN_WAIT: Duration = Duration::from_millis(100);

impl Engine {
    /// Whether `build`'s rollout is stored and not finished: its build
    /// goes on after a restart or a shutdown.
    pub(super) fn rollout_goes_on(&self, build: BuildId) -> bool {
        match self.store.read().and_then(|rx| rx.rollout(build)) {
            Ok(Some(r)) => r.rollout.state != crate::model::RolloutState::Finished,
            Ok(None) => false,
            Err(e) => {
                tracing::error!(error = %e, build = %format_build_id(build), "cannot read a rollout's record; its build ends now");
                false
            }
        }
    }

    /// Takes a slot for a rollout that goes on after the restart and runs
    /// it (once its deployment's orphaned call, if any, has been stopped).
    pub(super) fn resume_rollout(self: &Arc<Self>, build_id: BuildId, deployment: String) {
        self.sched
            .held()
            .running
            .insert(build_id, deployment.clone());
        let engine = self.clone();
        tokio::spawn(async move {
            while engine.blocked_deployments().contains(&deployment) {
                tokio::time::sleep(ORPHAN_WAIT).await;
            }
            engine.run_resumed(build_id).await;
        });
    }

    async fn run_resumed(self: Arc<Self>, build_id: BuildId) {
        let (cancel_tx, mut cancel) = watch::channel(Halt::No);
        self.cancels.held().insert(build_id, cancel_tx);
        let loaded = self.store.read().and_then(|rx| {
            Ok((
                rx.build(build_id)?,
                rx.build_snapshots(build_id)?,
                rx.rollout_result::<Vec<NodeOutcome>>(build_id)?,
            ))
        });
        let (build, snaps, nodes) = match loaded {
            Ok((Some(b), Some(s), Some(n))) => (b, s, n),
            Ok(_) => {
                tracing::error!(build = %format_build_id(build_id), "a resumed rollout's build, snapshots or result is gone");
                return self.release_slot(build_id);
            }
            Err(e) => {
                tracing::error!(error = %e, build = %format_build_id(build_id), "cannot read a resumed rollout's build; the next start tries again");
                return self.release_slot(build_id);
            }
        };
        let root = self.settings.scratch_root().join(format_build_id(build_id));
        let log = LogBuffer::after_restart(&build, self.settings.max_log_bytes);
        let (stop_tx, _) = watch::channel(false);
        let mut pipe = LogPipe::new(&self, build_id, log, stop_tx);
        let health = match (
            super::build::deployer_request(&build, &snaps),
            self.rollout_verbs(&snaps).await,
        ) {
            (Ok(request), Some(verbs)) => {
                self.log_lines(
                    &mut pipe,
                    &["[berth] berth restarted: the rollout goes on where it was".to_string()],
                )
                .await;
                self.run_rollout(&build, &request, verbs, &mut pipe, &mut cancel)
                    .await
            }
            (Err(_), _) | (_, None) => super::health::HealthEnd::Aborted(
                FailureReason::InterruptedByRestart,
                "berth restarted and the rollout's source or configuration cannot be read again"
                    .into(),
            ),
        };
        pipe.wait_all().await;
        let halted = match &health {
            super::health::HealthEnd::Halted(h) => *h,
            _ => Halt::No,
        };
        let outcome = RunOutcome {
            root,
            ended: Ok(Ended::Exit(0)),
            result: Some(Ok(nodes)),
            health: Some(health),
            log: pipe.log,
            disk_failure: pipe.disk_failure,
            halted,
            work_state_problem: None,
        };
        // The work dir after a rollout is what the deploy left: a work
        // state, if the deployment keeps one, stays as stored.
        self.conclude(build, outcome, NewWorkState::Unchanged).await;
    }
}

/// At start, a running build of this berth's embedded worker whose rollout
/// is stored and not finished goes on: its old attempt ends `interrupted`,
/// a new one of `incarnation` begins, and the seqs its last run may have
/// sent are skipped (a log hole). Returns the job to stop if it outlived
/// berth, or `None` when the build cannot go on (no rollout, a rollout
/// already finished, no stored result, too many restarts): recovery then
/// fails it.
pub fn resume_tx(
    tx: &Tx,
    build_id: BuildId,
    incarnation: &str,
) -> StoreResult<Option<Option<Job>>> {
    let Some(mut b) = tx.build(build_id)? else {
        return Ok(None);
    };
    let goes_on = b.kind == BuildKind::Deploy
        && tx
            .rollout(build_id)?
            .is_some_and(|r| r.rollout.state != crate::model::RolloutState::Finished)
        && tx.rollout_result::<Vec<NodeOutcome>>(build_id)?.is_some()
        && b.log_holes.len() < MAX_LOG_HOLES;
    if !goes_on {
        return Ok(None);
    }
    // The next line's seq: above every id the last run may have sent.
    let next = b.event_seq.max(b.seq_reserved) + 1;
    let computed = b.line_seq(b.log_lines);
    if computed > next {
        tracing::error!(build = %format_build_id(build_id), "a running build's log ids do not add up; it is failed instead of resumed");
        return Ok(None);
    }
    if next > computed {
        b.log_holes.push(LogHole {
            line: b.log_lines,
            seqs: next - computed,
        });
    }
    b.event_seq = next - 1;
    b.seq_reserved = b.seq_reserved.max(next - 1);
    debug_assert_eq!(b.line_seq(b.log_lines), b.event_seq + 1);
    super::build::end_attempt(tx, build_id, AttemptState::Interrupted)?;
    super::build::begin_local_attempt(tx, &b, incarnation, now_millis())?;
    let job = b.job;
    tx.put_build(&b)?;
    Ok(Some(job))
}
