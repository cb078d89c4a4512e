//! Appending an audit event inside a transaction, and what follows its
//! commit (the `audit=true` log line, the count of /metrics). A leaf of the
//! engine: `transition` (an event with its change) and `audit` (an event on
//! its own) both call it, and it calls neither.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::audit::{AuditResult, Draft, Event};
use crate::model::now_millis;
use crate::store::{StoreResult, Tx};

/// Events written since start (`berth_audit_events_total`).
pub static EVENTS_WRITTEN: AtomicU64 = AtomicU64::new(0);
/// Events of refused, denied or invalid calls that could not be written
/// (`berth_audit_write_failures_total`): the call was still answered.
pub static WRITE_FAILURES: AtomicU64 = AtomicU64::new(0);
/// Appends `draft` in `tx`; its log line and count follow the commit.
pub fn append(tx: &Tx, draft: &Draft) -> StoreResult<()> {
    let sealed = tx.append_audit(draft)?;
    let event = sealed.event;
    tx.after_commit(move || {
        EVENTS_WRITTEN.fetch_add(1, Ordering::Relaxed);
        log_line(&event);
    });
    Ok(())
}

/// The event as one structured log line, `audit=true`, for a log shipper
/// to route to an audit tenant.
fn log_line(e: &Event) {
    let actor = e.actor.as_ref();
    tracing::info!(
        audit = true,
        seq = e.seq,
        action = %e.action,
        result = e.result.as_str(),
        reason = e.reason.as_deref().unwrap_or(""),
        actor_subject = actor.map(|a| a.subject.as_str()).unwrap_or(""),
        actor_issuer = actor.and_then(|a| a.issuer.as_deref()).unwrap_or(""),
        trusted_backend = e.trusted_backend,
        deployment = e.deployment.as_deref().unwrap_or(""),
        build = e.build.as_deref().unwrap_or(""),
        request_id = %e.request_id,
        count = e.count,
        hash = e.hash.as_deref().unwrap_or(""),
        "audit event"
    );
}

/// The event of berth acting by itself (an automatic update, retention).
pub fn system_draft(
    action: &'static str,
    deployment: Option<String>,
    result: AuditResult,
) -> Draft {
    Draft {
        at: now_millis(),
        actor: None,
        trusted_backend: false,
        action,
        deployment,
        build: None,
        node: None,
        request_id: uuid::Uuid::now_v7().simple().to_string(),
        result,
        reason: None,
        count: 1,
    }
}
