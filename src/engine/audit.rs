//! Audit events from the engine's side (spec audit.md): the record a
//! mutation carries into its transaction, the event of a call that changed
//! nothing (its own transaction, never failing the call), the folding of
//! anonymous denials, and retention. The chain itself is `crate::audit`;
//! its rows are appended by `transition::Change::audit`.

use crate::locks::Held;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::audit_events::append;
pub use super::audit_events::system_draft;
pub use super::audit_events::{EVENTS_WRITTEN, WRITE_FAILURES};
use super::transition::Change;
use super::Engine;
use crate::audit::{AuditResult, Draft, Event};
use crate::model::{format_build_id, now_millis, BuildId};
use crate::store::{AuditLookup, StoreResult, Tx};

/// Events removed by retention per transaction at most.
pub const PRUNE_BATCH: usize = 10_000;

/// Stores the caller's record of a mutation's outcome (its idempotent
/// answer) in the mutation's own transaction; it may run again when the
/// job is re-run alone (see `Store::write`).
pub type Recorder<O> = Box<dyn Fn(&Tx, &O) -> StoreResult<()> + Send + Sync>;

/// What a mutation stores with its change: its audit event (completed with
/// the build the outcome names) and, with an `Idempotency-Key`, its answer.
pub struct Record<O> {
    pub audit: Draft,
    pub reply: Option<Recorder<O>>,
}

/// The build an outcome names, for its audit event.
pub trait Audited {
    fn audited_build(&self) -> Option<BuildId>;
}

impl<O: Audited> Record<O> {
    /// A record without an answer to store (engine-side callers, tests).
    pub fn audit_only(audit: Draft) -> Self {
        Record { audit, reply: None }
    }

    /// Writes the event (through the change) and the answer in the
    /// change's transaction.
    pub fn store(&self, change: &Change, outcome: &O) -> StoreResult<()> {
        let mut audit = self.audit.clone();
        audit.build = outcome.audited_build().map(format_build_id);
        change.audit(&audit)?;
        if let Some(reply) = &self.reply {
            reply(change.tx(), outcome)?;
        }
        Ok(())
    }
}

/// The last events of a deployment, denied calls left out (the read's
/// `audit` field).
pub fn of_deployment(rx: &impl AuditLookup, id: &str) -> StoreResult<Vec<Event>> {
    rx.audit_of_deployment(id, None, crate::audit::DEPLOYMENT_READ_EVENTS)
}

/// Anonymous denials in the current interval (audit.md): the first is
/// recorded, the rest counted into one `denied_anonymous` event. An agent
/// token's refused or invalid reports fold the same way, per token, into
/// `node_report_refused` events.
#[derive(Default)]
pub struct Denials {
    state: Mutex<DenialWindow>,
    /// Keyed by agent token. Only a live agent token's report gets this
    /// far (a revoked or unknown one is refused before its body is read),
    /// so `--max-agents` bounds it; an entry goes when its interval has
    /// ended.
    reports: Mutex<HashMap<String, ReportWindow>>,
}

/// One agent token's refused reports in the current interval.
struct ReportWindow {
    started: Instant,
    folded: u64,
    /// The latest refusal: the folded event names its node and reason.
    latest: Draft,
}

impl ReportWindow {
    /// The folded count as one event.
    fn folded_event(&self) -> Option<Draft> {
        (self.folded > 0).then(|| {
            let mut d = self.latest.clone();
            d.at = now_millis();
            d.request_id = uuid::Uuid::now_v7().simple().to_string();
            d.count = self.folded;
            d
        })
    }
}

#[derive(Default)]
struct DenialWindow {
    started: Option<Instant>,
    folded: u64,
}

impl Engine {
    /// Writes the event of a call that changed nothing, in its own
    /// transaction. A failure is logged and counted, never returned: the
    /// caller's answer does not depend on it (FR-010).
    pub async fn audit_alone(&self, draft: Draft) {
        let written = self
            .store
            .write(move |tx| {
                if crate::failpoints::hit("audit.alone", draft.action) {
                    return Err(crate::store::StoreError::injected("audit.alone"));
                }
                append(tx, &draft)
            })
            .await;
        if let Err(e) = written {
            WRITE_FAILURES.fetch_add(1, Ordering::Relaxed);
            tracing::error!(error = %e, "cannot write the audit event of a refused call");
        }
    }

    /// An anonymous denial: recorded when it opens an interval, else
    /// counted. The interval's count is written when the next one opens
    /// (or by `flush_denials`).
    pub async fn audit_anonymous_denial(&self, draft: Draft) {
        let interval = self.settings.audit_denial_interval;
        let (record, folded) = {
            let mut w = self.denials.state.held();
            let now = Instant::now();
            match w.started {
                Some(t) if now.duration_since(t) < interval => {
                    w.folded += 1;
                    (false, 0)
                }
                _ => {
                    w.started = Some(now);
                    (true, std::mem::take(&mut w.folded))
                }
            }
        };
        if folded > 0 {
            self.audit_alone(folded_event(folded)).await;
        }
        if record {
            self.audit_alone(draft).await;
        }
    }

    /// An agent token's refused or invalid report (`node_report_refused`):
    /// recorded when it opens the token's interval, else counted; the
    /// count is written when the next interval opens (or by
    /// `flush_denials`).
    pub async fn audit_report_refused(&self, token: &str, draft: Draft) {
        let interval = self.settings.audit_denial_interval;
        let now = Instant::now();
        let (record, folded) = {
            let mut reports = self.denials.reports.held();
            match reports.get_mut(token) {
                Some(w) if now.duration_since(w.started) < interval => {
                    w.folded += 1;
                    w.latest = draft.clone();
                    (false, None)
                }
                Some(w) => {
                    let folded = w.folded_event();
                    (w.started, w.folded, w.latest) = (now, 0, draft.clone());
                    (true, folded)
                }
                None => {
                    let w = ReportWindow {
                        started: now,
                        folded: 0,
                        latest: draft.clone(),
                    };
                    reports.insert(token.to_string(), w);
                    (true, None)
                }
            }
        };
        if let Some(folded) = folded {
            self.audit_alone(folded).await;
        }
        if record {
            self.audit_alone(draft).await;
        }
    }

    /// Writes the count of an interval that has ended with no denial since.
    pub async fn flush_denials(&self) {
        let interval = self.settings.audit_denial_interval;
        let ended: Vec<Draft> = {
            let mut reports = self.denials.reports.held();
            let mut ended = Vec::new();
            reports.retain(|_, w| {
                let open = w.started.elapsed() < interval;
                if !open {
                    ended.extend(w.folded_event());
                }
                open
            });
            ended
        };
        for draft in ended {
            self.audit_alone(draft).await;
        }
        let folded = {
            let mut w = self.denials.state.held();
            match w.started {
                Some(t) if t.elapsed() >= self.settings.audit_denial_interval && w.folded > 0 => {
                    w.started = None;
                    std::mem::take(&mut w.folded)
                }
                _ => 0,
            }
        };
        if folded > 0 {
            self.audit_alone(folded_event(folded)).await;
        }
    }

    /// Folds anonymous denials on time even when no new one arrives.
    pub async fn run_denial_flush(self: Arc<Self>) {
        let every = self
            .settings
            .audit_denial_interval
            .max(Duration::from_millis(100));
        loop {
            tokio::time::sleep(every).await;
            self.flush_denials().await;
        }
    }

    /// Removes events older than `--audit-retention-days`, a batch per
    /// transaction, each removal audited in its own transaction.
    pub async fn prune_audit(&self) -> StoreResult<u64> {
        let days = self.settings.audit_retention_days;
        if days == 0 {
            return Ok(0);
        }
        let cutoff = now_millis() - i64::from(days) * 24 * 3600 * 1000;
        let mut total = 0;
        loop {
            let pruned = self
                .store
                .write(move |tx| {
                    let Some(p) = tx.prune_audit(cutoff, PRUNE_BATCH)? else {
                        return Ok(None);
                    };
                    let mut draft = system_draft("audit_prune", None, AuditResult::Ok);
                    draft.count = p.removed;
                    append(tx, &draft)?;
                    Ok(Some(p))
                })
                .await?;
            match pruned {
                Some(p) => {
                    total += p.removed;
                    if (p.removed as usize) < PRUNE_BATCH {
                        return Ok(total);
                    }
                }
                None => return Ok(total),
            }
        }
    }
}

fn folded_event(count: u64) -> Draft {
    let mut d = system_draft("denied_anonymous", None, AuditResult::Denied);
    d.reason = Some("unauthenticated".into());
    d.count = count;
    d
}
