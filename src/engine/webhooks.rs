//! Webhooks (notifications.md): subscriptions, the outbox, and the sender.
//!
//! Why it exists: a self-hoster wants to hear that a deploy failed or was
//! rolled back without keeping a stream open. The promise peers do not make
//! is the one this module keeps: a delivery row is written **in the
//! transaction of the change it reports** (`engine::outbox`, called from
//! `transition` for every change it reports, and here for the test
//! route's ping), so a kill -9 at any instant neither loses a delivery for a
//! committed change nor sends one for a change that did not commit.
//!
//! The sender takes the oldest due delivery of each subscription in turn
//! (the `webhook_queue` index keeps each subscription's pending rows
//! together, so a dead receiver's backlog, however long, hides no other
//! subscription's), at most `--webhook-concurrency` attempts in flight
//! and at most one per subscription (a receiver that never answers holds
//! one slot for `--webhook-timeout`, never another subscription's). The
//! origin is checked against `--webhook-origin` at every attempt. Each attempt is
//! signed per the Standard Webhooks specification (the `standardwebhooks`
//! crate); its result and the next attempt are written back, so retries
//! survive restarts. Redirects are not followed; a receiver's body is read
//! up to `MAX_ANSWER_BYTES` and then dropped, never stored or logged.

use crate::locks::Held;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;

use super::outbox::outbox;
use super::Engine;
use crate::events::Hub;
use crate::model::*;
use crate::store::{DeliveryRecord, DeliveryStatus, Lookup, StoreResult, Tx, WebhookRecord};

/// A receiver's answer is read up to this many bytes, then dropped.
const MAX_ANSWER_BYTES: usize = 1024;
/// Finished deliveries read per step of the retention sweep.
const PRUNE_PAGE: usize = 256;
/// The sender looks at least this often (a wake-up comes after every
/// commit that queued deliveries; this covers retries falling due).
const LOOK_EVERY: Duration = Duration::from_millis(500);
/// Delivered and failed rows are kept this long (notifications.md).
const KEEP_FINISHED: Millis = 7 * 24 * 3600 * 1000;
/// How often finished rows older than that are removed.
const PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// The metric slots of `Metrics::webhooks`.
pub const DELIVERED: usize = 0;
pub const RETRIED: usize = 1;
pub const FAILED: usize = 2;

/// A new secret, or the refusal of a call that needed one (logged).
fn secret_or_refusal() -> Result<String, super::refusal::Refusal> {
    new_secret().map_err(|e| {
        tracing::error!(error = %e, "cannot make a webhook secret");
        super::refusal::Refusal::Internal
    })
}

/// A new subscription's secret: `whsec_` and the base64 of 32 random bytes.
pub fn new_secret() -> Result<String, String> {
    use base64::Engine as _;
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness for a webhook secret: {e}"))?;
    Ok(format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    ))
}

/// What one attempt came to.
enum Attempt {
    Delivered(u16),
    Refused(u16),
    Error(&'static str),
    /// Not sent: the subscription's origin is not in `--webhook-origin`
    /// now. Final: no retry would find it listed.
    NotAllowed,
}

impl Engine {
    /// The sender: runs for the life of the process.
    pub async fn run_webhooks(self: Arc<Self>) {
        let client = match reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(self.settings.webhook_timeout)
            .user_agent(concat!("berth/", env!("CARGO_PKG_VERSION")))
            .build()
        {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "cannot build the HTTP client; webhooks are not sent");
                return;
            }
        };
        let slots = Arc::new(tokio::sync::Semaphore::new(
            self.settings.webhook_concurrency as usize,
        ));
        // Subscriptions with an attempt in flight (one each, for fairness).
        let busy: Arc<Mutex<HashSet<u128>>> = Arc::default();
        // The subscription the last slot went to: the next look starts
        // after it, so every subscription's turn comes.
        let mut turn = 0u128;
        // Retention runs at start, then every `PRUNE_EVERY`.
        let mut last_prune: Option<tokio::time::Instant> = None;
        loop {
            if let Err(e) = self.send_due(&client, &slots, &busy, &mut turn).await {
                tracing::error!(error = %e, "webhook sender");
            }
            if last_prune.is_none_or(|at| at.elapsed() >= PRUNE_EVERY) {
                last_prune = Some(tokio::time::Instant::now());
                if let Err(e) = self.prune_deliveries().await {
                    tracing::error!(error = %e, "webhook delivery retention");
                }
            }
            let _ = tokio::time::timeout(LOOK_EVERY, self.hub.outbox.notified()).await;
        }
    }

    async fn send_due(
        self: &Arc<Self>,
        client: &reqwest::Client,
        slots: &Arc<tokio::sync::Semaphore>,
        busy: &Arc<Mutex<HashSet<u128>>>,
        turn: &mut u128,
    ) -> StoreResult<()> {
        let now = now_millis();
        let due = self.store.read()?.due_deliveries(now, *turn)?;
        for (webhook, delivery) in due {
            if !busy.held().insert(webhook) {
                continue;
            }
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                busy.held().remove(&webhook);
                break;
            };
            *turn = webhook;
            let (engine, client, busy) = (self.clone(), client.clone(), busy.clone());
            tokio::spawn(async move {
                if let Err(e) = engine.attempt(&client, webhook, delivery).await {
                    tracing::error!(error = %e, "a webhook attempt could not be recorded");
                }
                busy.held().remove(&webhook);
                drop(permit);
                // Its subscription's next delivery may be due now.
                engine.hub.outbox.notify_one();
            });
        }
        Ok(())
    }

    async fn attempt(&self, client: &reqwest::Client, webhook: u128, id: u128) -> StoreResult<()> {
        let (subscription, delivery) = {
            let rx = self.store.read()?;
            match (rx.webhook(webhook)?, rx.delivery(webhook, id)?) {
                (Some(w), Some(d)) if d.status == DeliveryStatus::Pending => (w, d),
                // Deleted meanwhile, or already done.
                _ => return Ok(()),
            }
        };
        // The origin is checked against the list berth runs with now: a
        // list narrowed since the subscription was made sends it nothing.
        let result =
            if crate::engine::origin_allowed(&subscription.url, &self.settings.webhook_origin) {
                send(client, &subscription, &delivery).await
            } else {
                Attempt::NotAllowed
            };
        let schedule = self.settings.webhook_retry_schedule.clone();
        let (status, code) = self
            .store
            .write(move |tx| {
                let Some(mut d) = tx.delivery(webhook, id)? else {
                    return Ok((None, None));
                };
                if d.status != DeliveryStatus::Pending {
                    return Ok((None, None));
                }
                let now = now_millis();
                d.attempts += 1;
                d.last_attempt_at = Some(now);
                let (status, code, error) = match result {
                    Attempt::Delivered(code) => (DeliveryStatus::Delivered, Some(code), None),
                    Attempt::Refused(code) => (DeliveryStatus::Pending, Some(code), Some("status")),
                    Attempt::Error(e) => (DeliveryStatus::Pending, None, Some(e)),
                    Attempt::NotAllowed => {
                        (DeliveryStatus::Failed, None, Some("origin_not_allowed"))
                    }
                };
                d.last_status_code = code;
                d.last_error = error.map(str::to_string);
                d.status = status;
                d.next_attempt_at = None;
                if status == DeliveryStatus::Pending {
                    // The i-th retry waits the schedule's i-th step; after
                    // the last, the delivery has failed.
                    match schedule.get(d.attempts as usize - 1) {
                        Some(wait) => d.next_attempt_at = Some(now + wait.as_millis() as Millis),
                        None => d.status = DeliveryStatus::Failed,
                    }
                }
                tx.put_delivery(webhook, id, &d)?;
                Ok((Some(d.status), code))
            })
            .await?;
        let slot = match status {
            Some(DeliveryStatus::Delivered) => DELIVERED,
            Some(DeliveryStatus::Pending) => RETRIED,
            Some(DeliveryStatus::Failed) => FAILED,
            None => return Ok(()),
        };
        self.metrics.webhooks[slot].fetch_add(1, Ordering::Relaxed);
        if slot == FAILED {
            tracing::warn!(webhook = %uuid::Uuid::from_u128(webhook), ?code, "a webhook delivery failed after its last retry");
        }
        Ok(())
    }

    /// Removes delivered and failed rows older than `KEEP_FINISHED`.
    async fn prune_deliveries(&self) -> StoreResult<()> {
        let cutoff = now_millis() - KEEP_FINISHED;
        self.store
            .write(move |tx| {
                for (webhook, _) in tx.webhooks()? {
                    let mut before = None;
                    loop {
                        let page = tx.deliveries(webhook, before, PRUNE_PAGE)?;
                        let Some((last, _)) = page.last() else { break };
                        before = Some(*last);
                        for (id, d) in &page {
                            let finished = d.status != DeliveryStatus::Pending;
                            if finished && d.last_attempt_at.unwrap_or(d.created_at) < cutoff {
                                tx.remove_delivery(webhook, *id)?;
                            }
                        }
                        if page.len() < PRUNE_PAGE {
                            break;
                        }
                    }
                }
                Ok(())
            })
            .await
    }
}

/// One signed POST of the delivery's body.
async fn send(client: &reqwest::Client, w: &WebhookRecord, d: &DeliveryRecord) -> Attempt {
    let Ok(signer) = standardwebhooks::Webhook::new(&w.secret) else {
        return Attempt::Error("secret");
    };
    let timestamp = time::OffsetDateTime::now_utc();
    let Ok(signature) = signer.sign(&d.message_id, timestamp.unix_timestamp(), d.body.as_bytes())
    else {
        return Attempt::Error("secret");
    };
    let sent = client
        .post(&w.url)
        .header("content-type", "application/json")
        .header("webhook-id", &d.message_id)
        .header("webhook-timestamp", timestamp.unix_timestamp().to_string())
        .header("webhook-signature", signature)
        .body(d.body.clone())
        .send()
        .await;
    let mut response = match sent {
        Ok(r) => r,
        Err(e) if e.is_timeout() => return Attempt::Error("timeout"),
        Err(e) if e.is_connect() => return Attempt::Error("connect"),
        Err(_) => return Attempt::Error("connect"),
    };
    let status = response.status();
    // A little of the answer is read (so the connection can be reused),
    // never kept.
    let mut read = 0usize;
    while read < MAX_ANSWER_BYTES {
        match response.chunk().await {
            Ok(Some(c)) => read += c.len(),
            Ok(None) | Err(_) => break,
        }
    }
    if status.is_success() {
        Attempt::Delivered(status.as_u16())
    } else if status.is_redirection() {
        Attempt::Error("redirect")
    } else {
        Attempt::Refused(status.as_u16())
    }
}

/// A subscription as its routes show it (never its secret, except in the
/// answers that make one).
#[derive(Debug, Clone)]
pub struct Subscription {
    pub id: u128,
    pub record: WebhookRecord,
}

impl super::audit::Audited for Subscription {
    fn audited_build(&self) -> Option<BuildId> {
        None
    }
}

/// What a new subscription asks for, checked by the API.
pub struct NewSubscription {
    pub url: String,
    pub events: Vec<String>,
    pub deployments: Option<Vec<String>>,
    pub description: Option<String>,
}

use super::audit::Record;
use super::refusal::{Conflict, Missing, Refusal};
use super::transition::Change;

impl Engine {
    /// `POST /v1/webhooks`: at most `--max-webhooks`.
    pub async fn create_webhook(
        self: &Arc<Self>,
        new: NewSubscription,
        record: Record<Subscription>,
    ) -> Result<Subscription, Refusal> {
        let secret = secret_or_refusal()?;
        let max = self.settings.max_webhooks as usize;
        let hub = self.hub.clone();
        self.store
            .write(move |tx| {
                if tx.webhooks()?.len() >= max {
                    return Ok(Err(Refusal::Conflict(Conflict::TooManyWebhooks)));
                }
                let change = Change::new(tx, &hub);
                let made = Subscription {
                    id: uuid::Uuid::now_v7().as_u128(),
                    record: WebhookRecord {
                        url: new.url.clone(),
                        events: new.events.clone(),
                        deployments: new.deployments.clone(),
                        description: new.description.clone(),
                        secret: secret.clone(),
                        created_at: change.now(),
                    },
                };
                tx.put_webhook(made.id, &made.record)?;
                record.store(&change, &made)?;
                Ok(Ok(made))
            })
            .await?
    }

    /// One write job on an existing subscription: `change` does the
    /// route's part (and may change the record), then the answer and the
    /// audit event are stored with it. A missing one is refused.
    async fn on_webhook(
        self: &Arc<Self>,
        id: u128,
        record: Record<Subscription>,
        change: impl Fn(&Tx, &Arc<Hub>, &mut WebhookRecord, Millis) -> StoreResult<()> + Send + 'static,
    ) -> Result<Subscription, Refusal> {
        let hub = self.hub.clone();
        self.store
            .write(move |tx| {
                let Some(mut w) = tx.webhook(id)? else {
                    return Ok(Err(Refusal::NotFound(Missing::Webhook)));
                };
                let at = Change::new(tx, &hub);
                change(tx, &hub, &mut w, at.now())?;
                let done = Subscription { id, record: w };
                record.store(&at, &done)?;
                Ok(Ok(done))
            })
            .await?
    }

    /// `DELETE /v1/webhooks/{webhook}`: its pending deliveries go with it.
    pub async fn delete_webhook(
        self: &Arc<Self>,
        id: u128,
        record: Record<Subscription>,
    ) -> Result<Subscription, Refusal> {
        self.on_webhook(id, record, move |tx, _, _, _| tx.remove_webhook(id))
            .await
    }

    /// `POST /v1/webhooks/{webhook}/rotate-secret`: attempts from now on
    /// are signed with the new secret.
    pub async fn rotate_webhook_secret(
        self: &Arc<Self>,
        id: u128,
        record: Record<Subscription>,
    ) -> Result<Subscription, Refusal> {
        let secret = secret_or_refusal()?;
        self.on_webhook(id, record, move |tx, _, w, _| {
            w.secret = secret.clone();
            tx.put_webhook(id, w)
        })
        .await
    }

    /// `POST /v1/webhooks/{webhook}/test`: one `ping` delivery.
    pub async fn ping_webhook(
        self: &Arc<Self>,
        id: u128,
        record: Record<Subscription>,
    ) -> Result<Subscription, Refusal> {
        self.on_webhook(id, record, move |tx, hub, _, now| {
            let data = || Ok(json!({"webhook": uuid::Uuid::from_u128(id).to_string()}));
            outbox(tx, hub, "ping", None, Some(id), data, now)
        })
        .await
    }
}
