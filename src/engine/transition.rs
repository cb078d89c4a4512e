//! The one place that changes the state of a build or a deployment.
//!
//! Every status change of a build (queued, running, and the final one) and
//! every change of a deployment record goes through a `Change`, inside the
//! store transaction of the request or the runner that causes it. A change:
//!
//! - refuses an illegal step (anything out of a final status, running ->
//!   queued, ...): an assertion in debug builds, an error in release, so a
//!   bug aborts the transaction instead of storing nonsense;
//! - bumps the deployment's `revision` and `updated_at` (the `ETag`);
//! - writes the build's `status` event and the deployment channel's
//!   `build` and `deployment` events in the same transaction (published
//!   after the commit by `events`);
//! - stores both records itself, last, so no caller can forget one or store
//!   it before its events are numbered;
//! - keeps the builds-by-status counts of `/metrics` in the same transaction.
//!
//! Callers check the domain rules first (a refusal writes nothing) and set
//! what is theirs to set (the configuration of a submit, a build's log
//! counters); the lifecycle bookkeeping (pending counters, `running`,
//! `last_finished`, `deployed`, a destroy's callback) is done here. This is
//! the hook where later changes (audit events, SBOMs) join the transaction.

use std::sync::Arc;

use serde_json::{json, Value};

use super::outcome::{End, NodeOutcome};
use super::sboms;
use crate::events::{self, Hub, SEQ_BLOCK};
use crate::model::*;
use crate::store::{Lookup, StoreError, StoreResult, Tx};

/// A build status change that the lifecycle does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Illegal {
    pub from: Option<BuildStatus>,
    pub to: BuildStatus,
}

/// lifecycle.md: a build is created queued; a queued build starts or is
/// cancelled; a running build ends succeeded, failed or cancelled. A final
/// status is final.
pub fn check(from: Option<BuildStatus>, to: BuildStatus) -> Result<(), Illegal> {
    use BuildStatus::*;
    let legal = matches!(
        (from, to),
        (None, Queued)
            | (Some(Queued), Running | Cancelled)
            | (Some(Running), Succeeded | Failed | Cancelled)
    );
    if legal {
        Ok(())
    } else {
        Err(Illegal { from, to })
    }
}

/// Asserts in debug builds; aborts the transaction in release builds.
fn guard(from: Option<BuildStatus>, to: BuildStatus) -> StoreResult<()> {
    check(from, to).map_err(|illegal| {
        debug_assert!(false, "illegal build status change: {illegal:?}");
        StoreError::other(format!("illegal build status change: {illegal:?}"))
    })
}

/// A build just queued, and the deployment's summary after it as JSON
/// (`Change::enqueue_summarized`).
pub struct Queued {
    pub build: BuildRecord,
    /// Byte for byte the data of the deployment's `deployment` event.
    pub deployment_json: String,
}

/// A new build before it is queued.
pub struct NewBuild {
    pub kind: BuildKind,
    pub trigger: Trigger,
    pub suspended: bool,
    pub method: String,
    pub snapshot: Snapshot,
    /// The build a rollback returns to.
    pub rollback_of: Option<BuildId>,
}

/// One transaction's changes of state, all at the same instant.
pub struct Change<'t, 'a> {
    tx: &'t Tx<'t, 'a>,
    hub: &'t Arc<Hub>,
    now: Millis,
}

impl<'t, 'a> Change<'t, 'a> {
    pub fn new(tx: &'t Tx<'t, 'a>, hub: &'t Arc<Hub>) -> Self {
        Change {
            tx,
            hub,
            now: now_millis(),
        }
    }

    pub fn now(&self) -> Millis {
        self.now
    }

    pub fn tx(&self) -> &'t Tx<'t, 'a> {
        self.tx
    }

    /// Appends the audit event of this change to the chain, in this
    /// transaction: the change and its event commit together or not at all.
    pub fn audit(&self, draft: &crate::audit::Draft) -> StoreResult<()> {
        super::audit_events::append(self.tx, draft)
    }

    /// Queues a new build of `d`: counted as pending, the deployment's last
    /// build. Stores the build, its snapshot and the deployment.
    pub fn enqueue(&self, d: &mut DeploymentRecord, new: NewBuild) -> StoreResult<BuildRecord> {
        self.enqueue_summarized(d, new).map(|queued| queued.build)
    }

    /// As `enqueue`, with the deployment's summary after it as JSON (what
    /// its `deployment` event carries): a submit answers with it.
    pub fn enqueue_summarized(
        &self,
        d: &mut DeploymentRecord,
        new: NewBuild,
    ) -> StoreResult<Queued> {
        guard(None, BuildStatus::Queued)?;
        self.tx.shift_build_count(None, Some(BuildStatus::Queued))?;
        let mut b = BuildRecord {
            suspended: new.suspended,
            rollback_of: new.rollback_of,
            ..BuildRecord::queued(
                new_build_id(),
                d.id.clone(),
                new.kind,
                new.trigger,
                new.method,
                self.now,
            )
        };
        match b.kind {
            BuildKind::Deploy => d.pending_deploys += 1,
            BuildKind::Destroy => d.pending_destroys += 1,
        }
        d.last_build = Some(b.id);
        self.tx.put_build_snapshots(
            b.id,
            &BuildSnapshots {
                snapshot: new.snapshot,
                previous: None,
            },
        )?;
        let deployment_json = self.store_both(d, &mut b)?;
        Ok(Queued {
            build: b,
            deployment_json,
        })
    }

    /// Queued -> running: the deployment's running build; log seqs are
    /// reserved ahead from here. Records what the deployment ran before,
    /// for the deployer, in the build's snapshots, and returns them.
    pub fn start(
        &self,
        d: &mut DeploymentRecord,
        b: &mut BuildRecord,
    ) -> StoreResult<BuildSnapshots> {
        guard(Some(b.status), BuildStatus::Running)?;
        self.tx
            .shift_build_count(Some(b.status), Some(BuildStatus::Running))?;
        debug_assert!(d.running.is_none(), "a deployment runs two builds at once");
        let mut snaps = self
            .tx
            .build_snapshots(b.id)?
            .ok_or_else(|| StoreError::corrupt("a build without its snapshots"))?;
        snaps.previous = d.deployed.as_ref().map(|x| x.snapshot.clone());
        self.tx.put_build_snapshots(b.id, &snaps)?;
        b.status = BuildStatus::Running;
        b.started_at = Some(self.now);
        d.running = Some(b.id);
        // The status event takes the next seq; log lines follow it.
        self.store_both_with(d, b, |b| {
            b.log_first_seq = b.event_seq + 1;
            b.seq_reserved = b.event_seq + SEQ_BLOCK;
        })?;
        Ok(snaps)
    }

    /// Queued or running -> a final status. The deployment no longer counts
    /// the build as pending; a build that ran is its last finished one; a
    /// successful deploy becomes what is deployed, a
    /// successful destroy clears it (and the suspended flag). A destroy's
    /// callback is armed when it succeeded and dropped otherwise.
    /// `d` is `None` only for a build whose deployment record is gone.
    pub fn finish(
        &self,
        d: Option<&mut DeploymentRecord>,
        b: &mut BuildRecord,
        end: End,
        nodes: &[NodeOutcome],
    ) -> StoreResult<()> {
        guard(Some(b.status), end.status)?;
        self.tx
            .shift_build_count(Some(b.status), Some(end.status))?;
        // lifecycle.md: a build cancelled while queued never ran, and the
        // deployment's state ignores it.
        let ran = b.status == BuildStatus::Running;
        let status = end.status;
        b.status = status;
        b.finished_at = Some(self.now);
        b.failure = end.failure;
        b.exit_code = end.exit_code;
        let mut d_after = d;
        match d_after.as_deref_mut() {
            Some(d) => {
                let counter = match b.kind {
                    BuildKind::Deploy => &mut d.pending_deploys,
                    BuildKind::Destroy => &mut d.pending_destroys,
                };
                debug_assert!(*counter > 0, "pending counter underflow");
                *counter = counter.saturating_sub(1);
                if d.running == Some(b.id) {
                    d.running = None;
                }
                if ran {
                    d.last_finished = Some(LastFinished {
                        build_id: b.id,
                        kind: b.kind,
                        status,
                    });
                }
                self.settle_deployed(d, b, nodes)?;
                self.store_both(d, b)?;
            }
            None => {
                events::build_status(self.tx, self.hub, b, self.now)?;
                self.notify_build(b)?;
                self.tx.put_build(b)?;
            }
        }
        if b.trigger == Trigger::AutomaticUpdate {
            self.update_try_result(b)?;
        }
        if let Some(d) = d_after.as_mut() {
            self.roll_back_if_broken(d, b, ran)?;
            self.release_hold_on_deployed(d)?;
        }
        if b.kind == BuildKind::Destroy {
            match (status, self.tx.callback(b.id)?) {
                (BuildStatus::Succeeded, Some(mut c)) => {
                    c.armed = true;
                    c.next_at = self.now;
                    c.first_at = self.now;
                    self.tx.put_callback(b.id, &c)?;
                }
                (_, Some(_)) => self.tx.remove_callback(b.id)?,
                (_, None) => {}
            }
        }
        Ok(())
    }

    /// What a finished build leaves deployed: a successful deploy becomes
    /// what is deployed (its SBOMs with it); a successful destroy clears
    /// it, and the suspended flag, and reports `deployment.destroyed`.
    fn settle_deployed(
        &self,
        d: &mut DeploymentRecord,
        b: &BuildRecord,
        nodes: &[NodeOutcome],
    ) -> StoreResult<()> {
        match (b.kind, b.status) {
            (BuildKind::Deploy, BuildStatus::Succeeded) => {
                sboms::apply(self.tx, self.hub, d, b.id, nodes, self.now)?;
                let snapshot = self
                    .tx
                    .build_snapshots(b.id)?
                    .ok_or_else(|| StoreError::corrupt("a build without its snapshots"))?
                    .snapshot;
                d.deployed = Some(Deployed {
                    build_id: b.id,
                    snapshot,
                    method: b.method.clone(),
                    finished_at: self.now,
                    nodes: nodes
                        .iter()
                        .map(|n| (n.name.clone(), n.fingerprint.clone()))
                        .collect(),
                });
            }
            (BuildKind::Destroy, BuildStatus::Succeeded) => {
                sboms::clear(self.tx, self.hub, d, self.now)?;
                d.deployed = None;
                d.suspended = false;
                super::outbox::outbox(
                    self.tx,
                    self.hub,
                    "deployment.destroyed",
                    Some(&d.id),
                    None,
                    || {
                        Ok(
                            serde_json::json!({"deployment": d.id, "build_id": format_build_id(b.id)}),
                        )
                    },
                    self.now,
                )?;
            }
            // A failed or cancelled build changes nothing deployed;
            // `finish` is never given a build that did not end.
            (
                BuildKind::Deploy | BuildKind::Destroy,
                BuildStatus::Failed
                | BuildStatus::Cancelled
                | BuildStatus::Queued
                | BuildStatus::Running,
            ) => {}
        }
        Ok(())
    }

    /// lifecycle.md "Automatic rollback": a deploy that broke what was
    /// deployed (its health step failed, or the deployer failed after it
    /// started) queues, in this transaction, a rollback to the deployed
    /// build, audited as `automatic_rollback` with the failed build, and
    /// holds the failed source back from automatic updates. Never after a
    /// cancel, a timeout, an interruption, a destroy or a rollback (no
    /// loops), nor when another deploy is already queued behind it (that
    /// one supersedes the failed build).
    fn roll_back_if_broken(
        &self,
        d: &mut DeploymentRecord,
        failed: &BuildRecord,
        ran: bool,
    ) -> StoreResult<()> {
        let Some(reason) = failed.failure.as_ref().map(|f| f.reason) else {
            return Ok(());
        };
        let broke = breaks_what_was_deployed(reason, ran);
        let is_rollback =
            failed.rollback_of.is_some() || failed.trigger == Trigger::AutomaticRollback;
        if !broke
            || failed.kind != BuildKind::Deploy
            || failed.status != BuildStatus::Failed
            || is_rollback
            || !d.auto_rollback
            || d.has_pending_build()
        {
            return Ok(());
        }
        let Some(target) = d.deployed.as_ref().map(|x| x.build_id) else {
            return Ok(());
        };
        let failed_source = self
            .tx
            .build_snapshots(failed.id)?
            .map(|s| s.snapshot.source);
        let Some(new) = rollback_build(self.tx, d, target, Trigger::AutomaticRollback)? else {
            // The deployed build is always retained (retention keeps it).
            return Err(StoreError::corrupt(
                "the deployed build is not a succeeded deploy",
            ));
        };
        let rollback = self.enqueue(d, new)?;
        debug_assert_eq!(rollback.rollback_of, Some(target));
        if let Some(from) = failed_source.filter(|s| *s != d.snapshot.source) {
            hold_back(self, d, from, rollback.id, reason.as_str())?;
        }
        super::outbox::outbox(
            self.tx,
            self.hub,
            "deployment.rollback_queued",
            Some(&d.id),
            None,
            || {
                Ok(serde_json::json!({
                    "deployment": d.id,
                    "failed_build": format_build_id(failed.id),
                    "rollback_build": format_build_id(rollback.id),
                    "target_build": format_build_id(target),
                }))
            },
            self.now,
        )?;
        let mut draft = super::audit_events::system_draft(
            "automatic_rollback",
            Some(d.id.clone()),
            crate::audit::AuditResult::Ok,
        );
        draft.at = self.now;
        draft.build = Some(format_build_id(failed.id));
        draft.reason = Some(reason.as_str().to_string());
        self.audit(&draft)
    }

    /// A held-back source that is what is deployed (a rollback away from it
    /// did not succeed) holds nothing back any more: the hold is for a
    /// source the deployment left, never for the one it runs.
    fn release_hold_on_deployed(&self, d: &DeploymentRecord) -> StoreResult<()> {
        let Some(deployed) = &d.deployed else {
            return Ok(());
        };
        let Some(mut last) = self.tx.update_try(&d.id)? else {
            return Ok(());
        };
        if last.result == TryResult::RolledBack
            && last.blocks
            && last.source == deployed.snapshot.source
            && !d.has_pending_build()
        {
            last.blocks = false;
            self.tx.put_update_try(&d.id, &last)?;
        }
        Ok(())
    }

    /// A change of the deployment record alone (its update policy): a new
    /// revision, its `deployment` event, the record stored.
    pub fn update(&self, d: &mut DeploymentRecord) -> StoreResult<()> {
        self.bump(d);
        events::deployment_changed(self.tx, self.hub, d, None, self.now)?;
        self.tx.put_deployment(d)
    }

    /// A visible change of a build's rollout (rollouts.md "States"): the
    /// deployment channel's `rollout` event with `summary`, a new revision
    /// and its `deployment` event, the record stored.
    pub fn rollout_changed(
        &self,
        d: &mut DeploymentRecord,
        summary: String,
        webhook: Option<&'static str>,
    ) -> StoreResult<()> {
        if let Some(event_type) = webhook {
            let data = || {
                serde_json::from_str(&summary)
                    .map_err(|e| StoreError::other(format!("a rollout summary as JSON: {e}")))
            };
            super::outbox::outbox(
                self.tx,
                self.hub,
                event_type,
                Some(&d.id),
                None,
                data,
                self.now,
            )?;
        }
        events::deployment_event(self.tx, self.hub, d, "rollout", summary, self.now)?;
        self.update(d)
    }

    /// The `node` event of `n`'s deployment (the caller stores the record
    /// it returns); `None` for a node of a deployment that does not exist.
    fn node_event(&self, n: &NodeRecord, entry: &Value) -> StoreResult<Option<DeploymentRecord>> {
        let Some(mut d) = self.tx.deployment(&n.deployment)? else {
            return Ok(None);
        };
        let data = entry.to_string();
        events::deployment_event(self.tx, self.hub, &mut d, "node", data, self.now)?;
        Ok(Some(d))
    }

    /// A bound node's entry changed by a report (agents.md "Desired vs
    /// actual"): the deployment channel's `node` event, and when a drift
    /// began, `node.drifted` (event and webhook). No revision: a node is
    /// not the deployment's configuration. Nothing for a node of a
    /// deployment that does not exist (yet).
    pub fn node_changed(
        &self,
        n: &NodeRecord,
        entry: &Value,
        drift_began: bool,
    ) -> StoreResult<()> {
        let Some(mut d) = self.node_event(n, entry)? else {
            return Ok(());
        };
        if let (true, Some(drift)) = (drift_began, &n.drift) {
            let data = json!({
                "deployment": n.deployment,
                "node": n.node,
                "desired": entry["desired"]["artifact"],
                "running": entry["actual"]["running"],
                "booted": entry["actual"]["booted"],
                "since": format_time(drift.since),
            });
            let text = data.to_string();
            super::outbox::outbox(
                self.tx,
                self.hub,
                "node.drifted",
                Some(&n.deployment),
                None,
                || Ok(data),
                self.now,
            )?;
            events::deployment_event(self.tx, self.hub, &mut d, "node.drifted", text, self.now)?;
        }
        self.tx.put_deployment(&d)
    }

    /// A node's document changed in a transaction that holds its
    /// deployment `d` (a deploy's end; the caller stores `d`): its `node`
    /// event, and the desired-state reads wake after the commit.
    pub fn node_changed_in(&self, d: &mut DeploymentRecord, entry: Value) -> StoreResult<()> {
        events::deployment_event(self.tx, self.hub, d, "node", entry.to_string(), self.now)?;
        let hub = self.hub.clone();
        self.tx
            .after_commit(move || hub.documents.send_modify(|n| *n += 1));
        Ok(())
    }

    /// A report raised a node's fence: its document changed, so the
    /// desired-state reads wake after the commit.
    /// Audited as `node_fence_raised` by the agent's token.
    pub fn node_fence_raised(&self, n: &NodeRecord, token: &str) -> StoreResult<()> {
        tracing::warn!(deployment = %n.deployment, node = %n.node, fence = n.fence, "an agent reported a fence above its node's; the node's fence was raised to it");
        let hub = self.hub.clone();
        self.tx
            .after_commit(move || hub.documents.send_modify(|n| *n += 1));
        let mut draft = super::audit_events::system_draft(
            "node_fence_raised",
            Some(n.deployment.clone()),
            crate::audit::AuditResult::Ok,
        );
        draft.actor = Some(crate::audit::Actor::agent(token));
        draft.node = Some(n.node.clone());
        self.audit(&draft)
    }

    /// A node's agent went silent for three of its intervals: a `node`
    /// event and the `node.unreachable` webhook.
    pub fn node_unreachable(
        &self,
        n: &NodeRecord,
        entry: Value,
        last_seen: Option<Millis>,
    ) -> StoreResult<()> {
        let Some(d) = self.node_event(n, &entry)? else {
            return Ok(());
        };
        let data = json!({
            "deployment": n.deployment,
            "node": n.node,
            "last_seen_at": last_seen.map(format_time),
        });
        super::outbox::outbox(
            self.tx,
            self.hub,
            "node.unreachable",
            Some(&n.deployment),
            None,
            || Ok(data),
            self.now,
        )?;
        self.tx.put_deployment(&d)
    }

    /// Sets the update policy; returns whether it changed. A new policy
    /// allows a new automatic try of the default source already tried. The
    /// caller stores `d` (with `update`, or with the build it queues).
    pub fn set_policy(&self, d: &mut DeploymentRecord, policy: UpdatePolicy) -> StoreResult<bool> {
        if d.update_policy == policy {
            return Ok(false);
        }
        d.update_policy = policy;
        if let Some(mut last) = self.tx.update_try(&d.id)? {
            if last.blocks {
                last.blocks = false;
                self.tx.put_update_try(&d.id, &last)?;
            }
        }
        Ok(true)
    }

    /// An automatic update's try learns how its build ended.
    fn update_try_result(&self, b: &BuildRecord) -> StoreResult<()> {
        let Some(mut last) = self.tx.update_try(&b.deployment)? else {
            return Ok(());
        };
        if last.build_id != Some(b.id) {
            return Ok(());
        }
        last.result = if b.status == BuildStatus::Succeeded {
            TryResult::Succeeded
        } else {
            TryResult::Failed
        };
        last.reason = b.failure.as_ref().map(|f| f.reason.to_string());
        self.tx.put_update_try(&b.deployment, &last)
    }

    /// The build's status event, then the deployment's events and revision,
    /// then both records.
    fn store_both(&self, d: &mut DeploymentRecord, b: &mut BuildRecord) -> StoreResult<String> {
        self.store_both_with(d, b, |_| {})
    }

    /// As `store_both`; `after_event` sets what depends on the status
    /// event's seq before the build is stored. Returns the deployment's
    /// summary as its `deployment` event carries it.
    fn store_both_with(
        &self,
        d: &mut DeploymentRecord,
        b: &mut BuildRecord,
        after_event: impl FnOnce(&mut BuildRecord),
    ) -> StoreResult<String> {
        debug_assert_eq!(
            d.id, b.deployment,
            "a build changed with another deployment"
        );
        let summary = events::build_status(self.tx, self.hub, b, self.now)?;
        self.notify_build(b)?;
        after_event(b);
        // The deployment channel's `build` event carries the status event's
        // text: `after_event` sets log seqs, never what a summary shows.
        debug_assert_eq!(
            serde_json::to_string(&b.summary()).ok().as_deref(),
            Some(summary.as_str()),
            "after_event changed what the status event showed"
        );
        self.bump(d);
        let deployment_json =
            events::deployment_changed(self.tx, self.hub, d, Some((b, summary)), self.now)?;
        self.tx.put_build(b)?;
        self.tx.put_deployment(d)?;
        Ok(deployment_json)
    }

    /// The webhook deliveries of a build's status change (notifications.md
    /// "Event types"), in this transaction: the outbox.
    fn notify_build(&self, b: &BuildRecord) -> StoreResult<()> {
        let event_type = match b.status {
            BuildStatus::Queued => "build.queued",
            BuildStatus::Running => "build.started",
            BuildStatus::Succeeded => "build.succeeded",
            BuildStatus::Failed => "build.failed",
            BuildStatus::Cancelled => "build.cancelled",
        };
        let data = || {
            serde_json::to_value(b.summary())
                .map_err(|e| StoreError::other(format!("a build summary as JSON: {e}")))
        };
        super::outbox::outbox(
            self.tx,
            self.hub,
            event_type,
            Some(&b.deployment),
            None,
            data,
            self.now,
        )
    }

    fn bump(&self, d: &mut DeploymentRecord) {
        d.revision += 1;
        d.updated_at = self.now.max(d.updated_at);
    }
}

/// A rollback of `d` to `target`: the target's snapshot becomes the
/// deployment's configuration and source, and the new build's. `None` when
/// `target` is not a retained succeeded deploy build of `d`.
pub fn rollback_build(
    tx: &Tx,
    d: &mut DeploymentRecord,
    target: BuildId,
    trigger: Trigger,
) -> StoreResult<Option<NewBuild>> {
    if !tx.is_rollback_target(d, target)? {
        return Ok(None);
    }
    let Some(b) = tx.build(target)? else {
        return Ok(None);
    };
    let Some(snaps) = tx.build_snapshots(target)? else {
        return Ok(None);
    };
    let snapshot = snaps.snapshot;
    let configuration: serde_json::Value = serde_json::from_str(&snapshot.configuration)
        .map_err(|_| StoreError::damaged_snapshot(DamagedSnapshot))?;
    d.domain = crate::derive::shape(&configuration)
        .map_err(|_| StoreError::corrupt("a stored configuration no longer has its shape"))?
        .domain
        .map(str::to_string);
    d.snapshot = snapshot.clone();
    d.method = b.method.clone();
    Ok(Some(NewBuild {
        kind: BuildKind::Deploy,
        trigger,
        suspended: d.suspended,
        method: b.method,
        snapshot,
        rollback_of: Some(target),
    }))
}

/// Holds `from` back from automatic updates under the current policy
/// (lifecycle.md "Rollback"): it counts as a try of that source, so the
/// update loop does not apply it again until the default source or the
/// policy changes.
pub fn hold_back(
    change: &Change,
    d: &DeploymentRecord,
    from: Source,
    build: BuildId,
    why: &str,
) -> StoreResult<()> {
    change.tx().put_update_try(
        &d.id,
        &UpdateTry {
            at: change.now(),
            source: from,
            build_id: Some(build),
            result: TryResult::RolledBack,
            reason: Some(why.to_string()),
            blocks: true,
        },
    )
}

/// Whether a failure of `reason` broke what was deployed (lifecycle.md
/// "Automatic rollback"): a failed health step, or the deployer failing
/// after it started (`ran`). Every reason decided here.
fn breaks_what_was_deployed(reason: FailureReason, ran: bool) -> bool {
    match reason {
        FailureReason::HealthCheckFailed => true,
        FailureReason::ExitStatus => ran,
        FailureReason::SpawnFailed
        | FailureReason::JobRecordFailed
        | FailureReason::DeployerProtocol
        | FailureReason::Timeout
        | FailureReason::Cancelled
        | FailureReason::InterruptedByShutdown
        | FailureReason::InterruptedByRestart
        | FailureReason::DiskFull
        | FailureReason::LogWriteFailed
        | FailureReason::FinalCommitFailed
        | FailureReason::Internal
        // A lost attempt is never followed by a rollback (workers.md).
        | FailureReason::LostAttempt
        | FailureReason::WorkStateUnavailable
        | FailureReason::WorkStateInvalid
        // An aborted rollout put its nodes back already (rollouts.md).
        | FailureReason::RolloutAborted => false,
    }
}

#[cfg(test)]
mod tests;
