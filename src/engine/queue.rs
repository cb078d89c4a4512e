//! The build queue: who runs next (spec lifecycle.md "Queue").
//!
//! Builds of one deployment run one at a time, oldest first; at most
//! `--build-slots` run at once; the oldest waiting build of any deployment
//! that has nothing running goes next, so no deployment can starve another.
//! A deployment whose orphaned deployer (from before a restart) is still
//! being stopped starts nothing until it has exited, nor one whose build
//! on a worker was just lost (`held_after_loss`), on any worker.

use crate::locks::Held;
use crate::store::{Lookup, StoreResult};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::Engine;
use crate::model::*;

/// How often the queue looks again even without a wake-up.
pub(super) const QUEUE_POLL: Duration = Duration::from_secs(1);

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
        if self.sched.held().running.len() >= usize::from(self.settings.build_slots) {
            return Ok(());
        }
        if !self.settings.local_worker {
            return Ok(());
        }
        // What this engine is starting already, and its slots left.
        let (free, taken) = {
            let sched = self.sched.held();
            let free = usize::from(self.settings.build_slots).saturating_sub(sched.running.len());
            let taken: std::collections::HashSet<String> = sched
                .running
                .values()
                .chain(sched.blocked.iter())
                .cloned()
                .collect();
            (free, taken)
        };
        let candidates = self.startable(free, taken)?;
        let mut sched = self.sched.held();
        let slots = usize::from(self.settings.build_slots);
        for (build_id, deployment) in candidates {
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

    /// The queued builds the embedded worker may start, oldest first: not
    /// of a deployment with a build running anywhere (a remote worker's
    /// too: FR-009) or held after a lost attempt (its worker is stopping
    /// the deployer), and requiring only labels it offers (workers.md
    /// "Which builds go where"; a source not described in this process yet
    /// by `--build-labels`, and `run_build` checks again).
    /// `taken`: the deployments this engine is starting or stopping a
    /// deployer of. It stops at `want` (the free slots): a long queue costs
    /// a dispatch a scan of its ids, not a read of each build.
    fn startable(
        &self,
        want: usize,
        taken: std::collections::HashSet<String>,
    ) -> Result<Vec<(BuildId, String)>, crate::store::StoreError> {
        let rx = self.store.read()?;
        let mut busy = taken;
        busy.extend(rx.running()?.into_iter().map(|(_, d)| d));
        let grace = i64::try_from(self.settings.cancel_grace.as_millis()).unwrap_or(i64::MAX);
        let mut out = Vec::new();
        for (build, deployment) in rx.queued()? {
            if out.len() >= want {
                break;
            }
            if busy.contains(&deployment) {
                continue;
            }
            if let Some(d) = rx.deployment(&deployment)? {
                if held_after_loss(&rx, &d, now_millis(), grace)? {
                    busy.insert(deployment);
                    continue;
                }
            }
            if let Some(b) = rx.build(build)? {
                if frozen_out(&rx, &b, now_millis())? {
                    busy.insert(deployment);
                    continue;
                }
            }
            let required = match rx.build_snapshots(build)? {
                Some(s) => self.required_labels(&s.snapshot.source.digest),
                None => None,
            }
            .unwrap_or_else(|| self.settings.build_labels.0.clone());
            if required
                .iter()
                .all(|l| self.settings.local_labels.0.contains(l))
            {
                out.push((build, deployment.clone()));
            }
            // Only the oldest queued build of a deployment may start.
            busy.insert(deployment);
        }
        Ok(out)
    }

    pub(super) fn release_slot(&self, build_id: BuildId) {
        self.sched.held().running.remove(&build_id);
        self.cancels.held().remove(&build_id);
        self.wake_queue();
    }

    /// Deployments whose orphaned deployer is still being stopped.
    pub(super) fn blocked_deployments(&self) -> std::collections::HashSet<String> {
        self.sched.held().blocked.clone()
    }

    pub(super) fn block_deployment(&self, deployment: &str) {
        self.sched.held().blocked.insert(deployment.to_string());
    }

    pub(super) fn unblock_deployment(&self, deployment: &str) {
        self.sched.held().blocked.remove(deployment);
        self.wake_queue();
    }
}

/// Whether `d` waits after a lost attempt (workers.md "Which builds go
/// where"): its last build ended `lost_attempt` less than `--cancel-grace`
/// (`grace_ms`) ago, the time a self-fenced worker takes to stop its
/// deployer.
/// Whether a freeze keeps the queued build `b` from starting (rollouts.md
/// "Freeze"): a deploy that is no rollback waits while one holds its
/// deployment (and the builds behind it wait too); a destroy and a
/// rollback go.
pub fn frozen_out(rx: &impl Lookup, b: &BuildRecord, now: Millis) -> StoreResult<bool> {
    let way_back = match &b.trigger {
        Trigger::AutomaticRollback => true,
        Trigger::Action(name) => name == "rollback",
        Trigger::Submit | Trigger::Delete | Trigger::AutomaticUpdate => false,
    };
    if b.kind == BuildKind::Destroy || way_back {
        return Ok(false);
    }
    Ok(super::freeze::holding(rx, &b.deployment, now)?.is_some())
}

pub fn held_after_loss(
    rx: &impl Lookup,
    d: &DeploymentRecord,
    now: Millis,
    grace_ms: i64,
) -> StoreResult<bool> {
    let Some(last) = &d.last_finished else {
        return Ok(false);
    };
    let lost = rx
        .last_attempt(last.build_id)?
        .is_some_and(|a| a.state == AttemptState::Lost);
    if !lost {
        return Ok(false);
    }
    let ended = rx.build(last.build_id)?.and_then(|b| b.finished_at);
    Ok(ended.is_some_and(|at| now < at.saturating_add(grace_ms)))
}
