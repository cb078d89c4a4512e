//! The webhook outbox (notifications.md "Delivery"): the one function that
//! queues deliveries, in the transaction of the change they report. Why
//! it is a module of its own: `transition` calls it for every change it
//! reports, and the sender (`webhooks`) builds on `transition`; a leaf
//! here keeps the two from importing each other.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::events::Hub;
use crate::model::*;
use crate::store::{DeliveryRecord, DeliveryStatus, Lookup, StoreResult, Tx};

/// Every event type a subscription may name (`"*"`: all of them).
pub const EVENT_TYPES: [&str; 17] = [
    "build.queued",
    "build.started",
    "build.succeeded",
    "build.failed",
    "build.cancelled",
    "build.lost",
    "deployment.rollback_queued",
    "deployment.destroyed",
    "rollout.paused",
    "rollout.resumed",
    "rollout.aborted",
    "rollout.finished",
    "freeze.set",
    "freeze.lifted",
    "node.drifted",
    "node.unreachable",
    "ping",
];
/// Queues `event_type` for every subscription that wants it, in `tx` (the
/// transaction of the change it reports). `deployment` filters by the
/// subscriptions' `deployments` (`None`: only those with none); `only`
/// names one subscription (a ping).
/// `data` is built only when some subscription wants the event: every
/// build's change of status passes here, on the store's writer thread,
/// and most stores have no subscription at all.
pub fn outbox(
    tx: &Tx,
    hub: &Arc<Hub>,
    event_type: &str,
    deployment: Option<&str>,
    only: Option<u128>,
    data: impl FnOnce() -> StoreResult<Value>,
    now: Millis,
) -> StoreResult<()> {
    debug_assert!(EVENT_TYPES.contains(&event_type), "{event_type}");
    let wanting: Vec<u128> = tx
        .webhooks()?
        .into_iter()
        .filter(|(id, w)| match only {
            Some(o) => o == *id,
            None => w.events.iter().any(|e| e == "*" || e == event_type),
        })
        .filter(|(_, w)| match (&w.deployments, deployment, only) {
            (Some(list), Some(dep), _) => list.iter().any(|d| d == dep),
            // An event of no deployment (the global freeze's) reaches only
            // subscriptions to every deployment; a ping, the one it names.
            (Some(_), None, None) => false,
            (Some(_), None, Some(_)) | (None, _, _) => true,
        })
        .map(|(id, _)| id)
        .collect();
    if wanting.is_empty() {
        return Ok(());
    }
    let body =
        json!({"type": event_type, "timestamp": format_time(now), "data": data()?}).to_string();
    for id in wanting {
        let delivery = uuid::Uuid::now_v7();
        tx.put_delivery(
            id,
            delivery.as_u128(),
            &DeliveryRecord {
                event_type: event_type.to_string(),
                message_id: format!("msg_{}", delivery.simple()),
                body: body.clone(),
                created_at: now,
                status: DeliveryStatus::Pending,
                attempts: 0,
                last_attempt_at: None,
                last_status_code: None,
                last_error: None,
                next_attempt_at: Some(now),
            },
        )?;
    }
    let hub = hub.clone();
    tx.after_commit(move || hub.outbox.notify_one());
    Ok(())
}
