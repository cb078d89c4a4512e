//! Update policies and automatic updates (spec lifecycle.md "Update
//! policies"): who applies a new revision of the default source.
//!
//! Every `--update-interval` a pass looks for due deployments (`due`, a pure
//! function of the records, the default source and the instant: the clock
//! is injected) and submits each one's stored configuration again against
//! the default source (trigger `automatic_update`). The try is recorded in
//! the build's own transaction (`UPDATE_TRIES`), so a restart never tries the
//! same default source twice under one policy; a refused try is recorded in
//! its own transaction. `transition::Change::finish` writes the try's result
//! when its build ends.

use std::sync::Arc;

use time::OffsetDateTime;

use super::audit::{system_draft, Audited, Record};
use super::refusal::{Missing, Refusal};
use super::requests::{Mode, SubmitInput};
use super::transition::{Change, NewBuild};
use super::Engine;
use crate::audit::AuditResult;
use crate::events::Hub;
use crate::model::*;
use crate::store::{Lookup, StoreError, StoreResult, Tx};
use crate::window::Window;

/// Deployments read per page of a pass.
const PASS_PAGE: usize = 1000;

/// PURE: whether berth should try an automatic update of `d` now.
/// `default`: the self-pinned default source (none: never).
pub fn due(
    d: &DeploymentRecord,
    last_try: Option<&UpdateTry>,
    default: Option<&Source>,
    now: OffsetDateTime,
) -> bool {
    let Some(default) = default else {
        return false;
    };
    let Some(deployed) = &d.deployed else {
        return false;
    };
    let ready = d.state() == DeploymentState::Active
        && !d.suspended
        && !d.has_pending_build()
        && deployed.snapshot.source != *default;
    let tried = last_try.is_some_and(|t| t.blocks && t.source == *default);
    if !ready || tried {
        return false;
    }
    match &d.update_policy {
        UpdatePolicy::Manual => false,
        UpdatePolicy::Automatic => true,
        window @ UpdatePolicy::Window { .. } => match Window::from_policy(window) {
            Ok(Some(w)) => w.is_open(now),
            // Stored policies were checked when set; one that no longer
            // checks (a zone removed from the database) never opens.
            _ => false,
        },
    }
}

/// A policy that was stored, with what a read of the deployment shows.
#[derive(Debug)]
pub struct PolicySet {
    pub deployment: DeploymentRecord,
    pub last_build: Option<BuildRecord>,
    pub last_try: Option<UpdateTry>,
    /// The deployment's last audit events, this change's included.
    pub audit: Vec<crate::audit::Event>,
    /// What a rollback without a target would return to.
    pub rollback_target: Option<BuildId>,
    /// The running build's rollout (the actions list's reasons).
    pub rollout: Option<RolloutRecord>,
    /// A freeze holds the deployment (the actions list's reasons).
    pub frozen: bool,
}

impl Audited for PolicySet {
    fn audited_build(&self) -> Option<BuildId> {
        None
    }
}

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    pub checked: usize,
    pub started: usize,
    pub refused: usize,
}

impl Engine {
    /// The self-pinned default source, if `--default-source` was given.
    pub fn self_pin(&self) -> Option<&Source> {
        self.has_self_pin.then_some(&self.default_source)
    }

    /// `PUT /v1/deployments/{id}/update-policy`.
    pub async fn set_update_policy(
        self: &Arc<Self>,
        id: &str,
        policy: UpdatePolicy,
        if_match: Option<u64>,
        record: Record<PolicySet>,
    ) -> Result<PolicySet, Refusal> {
        let hub = self.hub.clone();
        let id = id.to_string();
        let set = self
            .store
            .write(move |tx| set_policy_tx(tx, &hub, &id, policy.clone(), if_match, &record))
            .await??;
        // A new policy may make an update due at once.
        self.updates_wake.notify_one();
        Ok(set)
    }

    /// Runs forever: a pass every `--update-interval` (and when a policy
    /// changes).
    pub async fn run_updates(self: Arc<Self>) {
        loop {
            let _ =
                tokio::time::timeout(self.settings.update_interval, self.updates_wake.notified())
                    .await;
            if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            if !self.ready.load(std::sync::atomic::Ordering::SeqCst) {
                continue;
            }
            if let Err(e) = self.expire_freezes().await {
                tracing::error!(error = %e, "cannot remove an expired freeze; it is tried again next pass");
            }
            match self.update_pass(OffsetDateTime::now_utc()).await {
                Ok(pass) if pass.started + pass.refused > 0 => {
                    tracing::info!(
                        checked = pass.checked,
                        started = pass.started,
                        refused = pass.refused,
                        "automatic update pass"
                    )
                }
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e, "automatic update pass failed"),
            }
            self.metrics
                .update_passes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// One pass at `now`: every due deployment gets its try.
    pub async fn update_pass(self: &Arc<Self>, now: OffsetDateTime) -> Result<Pass, StoreError> {
        let mut pass = Pass::default();
        let Some(default) = self.self_pin().cloned() else {
            return Ok(pass);
        };
        let mut after: Option<String> = None;
        loop {
            let (page, due_ids) = {
                let rx = self.store.read()?;
                let page = rx.deployments_after(after.as_deref(), PASS_PAGE)?;
                let mut due_ids = Vec::new();
                let now_ms = millis_of(now);
                for d in &page {
                    // A freeze makes an update not due: no try is recorded.
                    if due(d, rx.update_try(&d.id)?.as_ref(), Some(&default), now)
                        && super::freeze::holding(&rx, &d.id, now_ms)?.is_none()
                    {
                        due_ids.push(d.id.clone());
                    }
                }
                (page, due_ids)
            };
            pass.checked += page.len();
            for id in due_ids {
                match self.try_update(&id, &default, now).await {
                    Ok(true) => pass.started += 1,
                    Ok(false) => {}
                    Err(Refusal::Store(e)) => return Err(e),
                    Err(refusal) => {
                        pass.refused += 1;
                        tracing::warn!(deployment = %id, reason = %refusal.describe(), "automatic update refused");
                        self.record_refused(&id, &default, &refusal).await?;
                    }
                }
            }
            match page.last() {
                Some(last) if page.len() == PASS_PAGE => after = Some(last.id.clone()),
                _ => return Ok(pass),
            }
        }
    }

    /// Validates the stored configuration against the default source and
    /// queues the update; `Ok(false)` when it was no longer due.
    async fn try_update(
        self: &Arc<Self>,
        id: &str,
        default: &Source,
        now: OffsetDateTime,
    ) -> Result<bool, Refusal> {
        let d = self
            .store
            .read()?
            .deployment(id)?
            .ok_or(Refusal::NotFound(Missing::Deployment))?;
        let configuration: serde_json::Value = serde_json::from_str(&d.snapshot.configuration)
            .map_err(|_| StoreError::corrupt("a stored configuration is not JSON"))?;
        let input = SubmitInput {
            configuration_text: d.snapshot.configuration.clone(),
            configuration,
            source: None,
            mode: Mode::Replace,
            keep_deployed_revision: false,
            update_policy: None,
            auto_rollback: None,
            rollout: None,
        };
        let v = self.validate(id, &input, Some(&d), false, false).await?;
        let hub = self.hub.clone();
        let (id, default, expected) = (id.to_string(), default.clone(), v.source.clone());
        debug_assert_eq!(
            expected, default,
            "an update validated against another source"
        );
        let started = self
            .store
            .write(move |tx| {
                automatic_update_tx(
                    tx,
                    &hub,
                    &id,
                    &default,
                    v.method.clone(),
                    v.domain.clone(),
                    now,
                )
            })
            .await?;
        if started {
            self.wake_queue();
        }
        Ok(started)
    }

    async fn record_refused(
        &self,
        id: &str,
        default: &Source,
        refusal: &Refusal,
    ) -> Result<(), StoreError> {
        let reason = refusal_code(refusal);
        let (id, default) = (id.to_string(), default.clone());
        self.store
            .write(move |tx| {
                let mut audit =
                    system_draft("automatic_update", Some(id.clone()), AuditResult::Refused);
                audit.reason = Some(reason.to_string());
                super::audit_events::append(tx, &audit)?;
                tx.put_update_try(
                    &id,
                    &UpdateTry {
                        at: now_millis(),
                        source: default.clone(),
                        build_id: None,
                        result: TryResult::Refused,
                        reason: Some(reason.to_string()),
                        blocks: true,
                    },
                )
            })
            .await
    }
}

/// An instant as milliseconds since the epoch.
fn millis_of(t: OffsetDateTime) -> Millis {
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX)
}

/// The reason code a refused try shows.
fn refusal_code(r: &Refusal) -> &'static str {
    match r {
        Refusal::InvalidConfiguration { .. } => "invalid_configuration",
        Refusal::EvalUnavailable { reason, .. } => reason.code(),
        Refusal::Conflict(c) => c.code(),
        Refusal::QueueFull(_) => "queue_full",
        Refusal::InvalidSource(_) => "invalid_source",
        Refusal::NotFound(_) => "not_found",
        Refusal::ActionRefused(reason) => reason.code(),
        Refusal::PreconditionFailed => "precondition_failed",
        // A worker's refusals: an update never meets one.
        Refusal::Claim(c) => c.reason(),
        Refusal::Stale(s) => s.reason(),
        Refusal::IdempotencyConflict => "idempotency_conflict",
        Refusal::ProgressGap { .. } => "progress_gap",
        Refusal::TooLarge(_) => "payload_too_large",
        Refusal::Frozen { .. } => "frozen",
        Refusal::Store(_) | Refusal::Internal => "internal",
    }
}

/// The policy's write job: `If-Match`, then the change (a new policy allows
/// a new try).
pub fn set_policy_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    id: &str,
    policy: UpdatePolicy,
    if_match: Option<u64>,
    record: &Record<PolicySet>,
) -> StoreResult<Result<PolicySet, Refusal>> {
    let Some(mut d) = tx.deployment(id)? else {
        return Ok(Err(Refusal::NotFound(Missing::Deployment)));
    };
    if if_match.is_some_and(|r| r != d.revision) {
        return Ok(Err(Refusal::PreconditionFailed));
    }
    let change = Change::new(tx, hub);
    if change.set_policy(&mut d, policy)? {
        change.update(&mut d)?;
    }
    // The event first, so the answer (rendered here, stored for a replay)
    // shows it.
    change.audit(&record.audit)?;
    let set = PolicySet {
        last_build: d.last_build.map(|b| tx.build(b)).transpose()?.flatten(),
        last_try: tx.update_try(id)?,
        audit: super::audit::of_deployment(tx, id)?,
        rollback_target: tx.rollback_target(&d)?,
        rollout: d.running.map(|b| tx.rollout(b)).transpose()?.flatten(),
        frozen: super::freeze::holding(tx, id, now_millis())?.is_some(),
        deployment: d,
    };
    if let Some(reply) = &record.reply {
        reply(tx, &set)?;
    }
    Ok(Ok(set))
}

/// The automatic update's write job: still due (nothing changed since the
/// pass read it), then the build and the try, together.
pub fn automatic_update_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    id: &str,
    default: &Source,
    method: String,
    domain: Option<String>,
    now: OffsetDateTime,
) -> StoreResult<bool> {
    let Some(mut d) = tx.deployment(id)? else {
        return Ok(false);
    };
    if !due(&d, tx.update_try(id)?.as_ref(), Some(default), now)
        || super::freeze::holding(tx, id, millis_of(now))?.is_some()
    {
        return Ok(false);
    }
    let snapshot = Snapshot {
        configuration: d.snapshot.configuration.clone(),
        source: default.clone(),
    };
    tx.put_source(default)?;
    d.snapshot = snapshot.clone();
    d.method = method.clone();
    d.domain = domain;
    let change = Change::new(tx, hub);
    let build = change.enqueue(
        &mut d,
        NewBuild {
            kind: BuildKind::Deploy,
            trigger: Trigger::AutomaticUpdate,
            suspended: false,
            method,
            snapshot,
            rollback_of: None,
        },
    )?;
    let mut audit = system_draft("automatic_update", Some(id.to_string()), AuditResult::Ok);
    audit.build = Some(format_build_id(build.id));
    change.audit(&audit)?;
    tx.put_update_try(
        id,
        &UpdateTry {
            at: change.now(),
            source: default.clone(),
            build_id: Some(build.id),
            result: TryResult::Queued,
            reason: None,
            blocks: true,
        },
    )?;
    Ok(true)
}

#[cfg(test)]
mod tests;
