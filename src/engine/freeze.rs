//! Freezes (rollouts.md "Freeze"): stop the line, with the reason in words.
//! One global freeze and one per deployment; while one is active, submits,
//! suspend, resume and `rollout_resume` are refused (`frozen`, the
//! freeze's own words in the message), automatic updates are not due, a
//! queued deploy that is no rollback does not start, and a rollout's next
//! wave waits. The way back (a rollback, an abort, a cancel) and a delete
//! are never refused.
//!
//! Why it exists as one module: every place that must respect a freeze
//! asks `holding` the same question at the same instant, so a window that
//! opens or closes changes them all at once.

use std::sync::Arc;

use serde_json::{json, Value};
use time::OffsetDateTime;

use super::audit::{Audited, Record};
use super::refusal::{Missing, Refusal};
use super::transition::Change;
use super::Engine;
use crate::model::*;
use crate::store::{Lookup, StoreResult, Tx};

/// How far ahead `until` may be (rollouts.md `MAX_FREEZE_AHEAD_DAYS`).
pub const MAX_FREEZE_AHEAD_DAYS: i64 = 366;

/// Whose freeze: the global one or one deployment's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    Global,
    Deployment(String),
}

impl Scope {
    /// Its key in the store.
    pub fn key(&self) -> &str {
        match self {
            Scope::Global => GLOBAL_FREEZE,
            Scope::Deployment(id) => id,
        }
    }

    pub fn word(&self) -> &'static str {
        match self {
            Scope::Global => "global",
            Scope::Deployment(_) => "deployment",
        }
    }

    fn deployment(&self) -> Option<&str> {
        match self {
            Scope::Global => None,
            Scope::Deployment(id) => Some(id),
        }
    }
}

fn at(ms: Millis) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(OffsetDateTime::UNIX_EPOCH)
}

fn millis(t: OffsetDateTime) -> Millis {
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX)
}

/// A freeze's window, resolved under its rules.
fn resolve(w: &FreezeWindow) -> Result<crate::window::Window, crate::window::InvalidPolicy> {
    crate::window::Window::for_freeze(
        w.frequency,
        w.day,
        &w.start,
        w.duration_minutes,
        &w.time_zone,
    )
}

/// A stored window, resolved (`None` when the stored one no longer
/// resolves, which a set never stores).
fn window_of(w: &FreezeWindow) -> Option<crate::window::Window> {
    resolve(w).ok()
}

/// Whether `f` is active at `now`: before its `until`, and inside its
/// window when it has one.
pub fn is_active(f: &FreezeRecord, now: Millis) -> bool {
    if f.until.is_some_and(|u| now >= u) {
        return false;
    }
    match &f.window {
        None => true,
        Some(w) => window_of(w).is_some_and(|w| w.is_open(at(now))),
    }
}

/// When `active` next changes (`None`: never).
pub fn next_change(f: &FreezeRecord, now: Millis) -> Option<Millis> {
    let edge = match &f.window {
        None => None,
        Some(w) => match window_of(w).map(|w| w.state(at(now))) {
            Some(crate::window::WindowState::Open { closes, .. }) => Some(millis(closes)),
            Some(crate::window::WindowState::Closed { next }) => next.map(millis),
            None => None,
        },
    };
    match (edge, f.until) {
        (Some(e), Some(u)) => Some(e.min(u)),
        (e, u) => e.or(u),
    }
}

/// The freeze that holds `deployment` now: its own when both are active.
pub fn holding(
    rx: &impl Lookup,
    deployment: &str,
    now: Millis,
) -> StoreResult<Option<(Scope, FreezeRecord)>> {
    if let Some(own) = rx.freeze(deployment)?.filter(|f| is_active(f, now)) {
        return Ok(Some((Scope::Deployment(deployment.to_string()), own)));
    }
    Ok(rx
        .freeze(GLOBAL_FREEZE)?
        .filter(|f| is_active(f, now))
        .map(|f| (Scope::Global, f)))
}

/// The refusal a freeze gives (409 `conflict` `frozen`).
pub fn refusal(scope: &Scope, f: &FreezeRecord) -> Refusal {
    Refusal::Frozen {
        scope: scope.word(),
        reason: f.reason.clone(),
    }
}

/// The refusal of an action the `actions` list shows disabled: a freeze's
/// says whose freeze and quotes its reason, the others give their code.
pub fn action_refusal(
    reason: super::refusal::ActionReason,
    held: &Option<(Scope, FreezeRecord)>,
) -> Refusal {
    match (reason, held) {
        (super::refusal::ActionReason::Frozen, Some((scope, f))) => refusal(scope, f),
        (reason, _) => Refusal::ActionRefused(reason),
    }
}

/// A freeze as the API shows it.
pub fn view(scope: &Scope, f: &FreezeRecord, now: Millis) -> Value {
    json!({
        "scope": scope.word(),
        "deployment": scope.deployment(),
        "reason": f.reason,
        "until": f.until.map(format_time),
        "window": f.window,
        "active": is_active(f, now),
        "next_change_at": next_change(f, now).map(format_time),
        "set_at": format_time(f.set_at),
        "set_by": f.set_by.as_deref().and_then(|a| serde_json::from_str::<Value>(a).ok()),
    })
}

/// The deployment read's `frozen`: the freeze that holds it now.
pub fn frozen_view(held: &Option<(Scope, FreezeRecord)>, now: Millis) -> Value {
    match held {
        None => Value::Null,
        Some((scope, f)) => json!({
            "scope": scope.word(),
            "reason": f.reason,
            "until": f.until.map(format_time),
            "next_change_at": next_change(f, now).map(format_time),
        }),
    }
}

/// A freeze set or lifted: its view after the change (null: lifted) and
/// the global `ETag` (or the deployment's revision) after it.
#[derive(Debug, Clone)]
pub struct FreezeChanged {
    pub freeze: Value,
    pub etag: u64,
}

impl Audited for FreezeChanged {
    fn audited_build(&self) -> Option<BuildId> {
        None
    }
}

/// Checks a freeze body's `until` (after now, at most a year ahead) and
/// `window`; the error names the field and its code.
pub fn check_until(until: Option<Millis>, now: Millis) -> Result<(), (&'static str, &'static str)> {
    match until {
        Some(u) if u <= now => Err(("/until", "range")),
        Some(u) if u - now > MAX_FREEZE_AHEAD_DAYS * 24 * 3600 * 1000 => Err(("/until", "range")),
        Some(_) | None => Ok(()),
    }
}

/// Checks a freeze's window against its rules.
pub fn check_window(w: &FreezeWindow) -> Result<(), crate::window::InvalidPolicy> {
    resolve(w).map(drop)
}

impl Engine {
    /// `PUT /v1/freeze` or `/v1/deployments/{id}/freeze`: sets or replaces
    /// the freeze, under `If-Match` (the global `ETag`, or the deployment's
    /// revision), audited `freeze_set`, webhook `freeze.set`.
    pub async fn set_freeze(
        self: &Arc<Self>,
        scope: Scope,
        freeze: FreezeRecord,
        if_match: Option<u64>,
        record: Record<FreezeChanged>,
    ) -> Result<FreezeChanged, Refusal> {
        self.change_freeze(scope, Some(freeze), if_match, record)
            .await
    }

    /// `DELETE` of a freeze: `404 not_frozen` when none is set.
    pub async fn lift_freeze(
        self: &Arc<Self>,
        scope: Scope,
        if_match: Option<u64>,
        record: Record<FreezeChanged>,
    ) -> Result<FreezeChanged, Refusal> {
        self.change_freeze(scope, None, if_match, record).await
    }

    async fn change_freeze(
        self: &Arc<Self>,
        scope: Scope,
        freeze: Option<FreezeRecord>,
        if_match: Option<u64>,
        mut record: Record<FreezeChanged>,
    ) -> Result<FreezeChanged, Refusal> {
        record.audit.deployment = scope.deployment().map(str::to_string);
        let hub = self.hub.clone();
        let changed = self
            .store
            .write(move |tx| change_freeze_tx(tx, &hub, &scope, freeze.as_ref(), if_match, &record))
            .await??;
        // A lift may let a held rollout and the queue go on.
        self.wake_rollouts();
        self.wake_queue();
        Ok(changed)
    }

    /// Deletes each freeze whose `until` passed (audited `freeze_expire`,
    /// webhook `freeze.lifted` by `expiry`); run by the update loop.
    pub async fn expire_freezes(self: &Arc<Self>) -> StoreResult<()> {
        let now = now_millis();
        let due: Vec<String> = self
            .store
            .read()?
            .freezes()?
            .into_iter()
            .filter(|(_, f)| f.until.is_some_and(|u| now >= u))
            .map(|(key, _)| key)
            .collect();
        if due.is_empty() {
            return Ok(());
        }
        let hub = self.hub.clone();
        self.store
            .write(move |tx| {
                for key in &due {
                    let Some(f) = tx.freeze(key)? else { continue };
                    let scope = if key == GLOBAL_FREEZE {
                        Scope::Global
                    } else {
                        Scope::Deployment(key.clone())
                    };
                    lift_tx(tx, &hub, &scope, &f, "expiry")?;
                    let mut draft = super::audit::system_draft(
                        "freeze_expire",
                        scope.deployment().map(str::to_string),
                        crate::audit::AuditResult::Ok,
                    );
                    draft.reason = None;
                    Change::new(tx, &hub).audit(&draft)?;
                }
                Ok(())
            })
            .await?;
        self.wake_rollouts();
        self.wake_queue();
        Ok(())
    }
}

/// The freeze change's write job.
fn change_freeze_tx(
    tx: &Tx,
    hub: &Arc<crate::events::Hub>,
    scope: &Scope,
    freeze: Option<&FreezeRecord>,
    if_match: Option<u64>,
    record: &Record<FreezeChanged>,
) -> StoreResult<Result<FreezeChanged, Refusal>> {
    let current_tag = match scope {
        Scope::Global => tx.freeze_etag()?,
        Scope::Deployment(id) => match tx.deployment(id)? {
            Some(d) => d.revision,
            None => return Ok(Err(Refusal::NotFound(Missing::Deployment))),
        },
    };
    if if_match.is_some_and(|m| m != current_tag) {
        return Ok(Err(Refusal::PreconditionFailed));
    }
    let existing = tx.freeze(scope.key())?;
    let change = Change::new(tx, hub);
    let view = match (freeze, existing) {
        (None, None) => return Ok(Err(Refusal::NotFound(Missing::Freeze))),
        (None, Some(f)) => {
            lift_tx(tx, hub, scope, &f, "action")?;
            Value::Null
        }
        (Some(f), _) => {
            tx.put_freeze(scope.key(), Some(f))?;
            let shown = view(scope, f, change.now());
            let data = || Ok(shown.clone());
            super::outbox::outbox(
                tx,
                hub,
                "freeze.set",
                scope.deployment(),
                None,
                data,
                change.now(),
            )?;
            shown
        }
    };
    let etag = bump(tx, hub, scope)?;
    let changed = FreezeChanged { freeze: view, etag };
    record.store(&change, &changed)?;
    Ok(Ok(changed))
}

/// Removes a freeze with its `freeze.lifted` webhook.
fn lift_tx(
    tx: &Tx,
    hub: &Arc<crate::events::Hub>,
    scope: &Scope,
    f: &FreezeRecord,
    by: &str,
) -> StoreResult<()> {
    tx.put_freeze(scope.key(), None)?;
    let data = json!({"scope": scope.word(), "deployment": scope.deployment(), "reason": f.reason, "by": by});
    super::outbox::outbox(
        tx,
        hub,
        "freeze.lifted",
        scope.deployment(),
        None,
        || Ok(data),
        now_millis(),
    )
}

/// The global `ETag` raised, or the deployment's revision with its
/// `deployment` event.
fn bump(tx: &Tx, hub: &Arc<crate::events::Hub>, scope: &Scope) -> StoreResult<u64> {
    match scope {
        Scope::Global => tx.bump_freeze_etag(),
        Scope::Deployment(id) => {
            let Some(mut d) = tx.deployment(id)? else {
                return Ok(0);
            };
            Change::new(tx, hub).update(&mut d)?;
            Ok(d.revision)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(text: &str) -> Millis {
        parse_time(text).expect("a time")
    }

    fn weekend(time_zone: &str) -> FreezeRecord {
        FreezeRecord {
            reason: "weekend".into(),
            until: None,
            // Friday 18:00 local, for 62 hours: to Monday 08:00.
            window: Some(FreezeWindow {
                frequency: Frequency::Weekly,
                day: Some(5),
                start: "18:00".into(),
                duration_minutes: 62 * 60,
                time_zone: time_zone.into(),
            }),
            set_at: 0,
            set_by: None,
        }
    }

    #[test]
    fn a_weekend_window_counts_days_after_it_opened_and_says_when_it_changes() {
        let f = weekend("Europe/Amsterdam");
        // Friday 2026-10-23 17:59 CEST is before; Sunday noon is inside.
        assert!(!is_active(&f, ms("2026-10-23T15:59:00Z")));
        assert!(is_active(&f, ms("2026-10-25T11:00:00Z")));
        // The clocks went back that Sunday at 03:00 CEST: 62 real hours from
        // Friday 16:00Z end Monday 06:00Z (07:00 CET).
        assert!(is_active(&f, ms("2026-10-26T05:59:00Z")));
        assert!(!is_active(&f, ms("2026-10-26T06:00:00Z")));
        assert_eq!(
            next_change(&f, ms("2026-10-25T11:00:00Z")),
            Some(ms("2026-10-26T06:00:00Z"))
        );
        assert_eq!(
            next_change(&f, ms("2026-10-23T12:00:00Z")),
            Some(ms("2026-10-23T16:00:00Z"))
        );
    }

    #[test]
    fn until_ends_a_freeze_and_bounds_its_next_change() {
        let mut f = weekend("UTC");
        f.window = None;
        f.until = Some(ms("2026-12-24T00:00:00Z"));
        assert!(is_active(&f, ms("2026-12-23T23:59:59Z")));
        assert!(!is_active(&f, ms("2026-12-24T00:00:00Z")));
        assert_eq!(
            next_change(&f, ms("2026-12-01T00:00:00Z")),
            Some(ms("2026-12-24T00:00:00Z"))
        );
        let now = ms("2026-12-01T00:00:00Z");
        assert!(check_until(Some(now - 1), now).is_err());
        assert!(check_until(Some(now + 367 * 24 * 3600 * 1000), now).is_err());
        assert!(check_until(Some(now + 1000), now).is_ok());
    }
}
