//! Background sweeps that keep the store bounded: expired idempotency
//! records (24 h), old deployment-channel events (events.md: keep at least
//! the last 10,000 events or 7 days per deployment, whichever is more), and
//! old builds (storage.md: beyond the newest `--keep-builds` and older than
//! `--keep-build-days`, never the last successful deploy nor anything queued
//! or running), with their logs and events; audit events older than
//! `--audit-retention-days` (engine/audit.rs).

use std::sync::Arc;

use super::Engine;
use crate::model::now_millis;
use crate::store::Lookup;

/// Builds removed per transaction at most.
const BUILDS_PER_TXN: usize = 1000;
/// Idempotency records removed per transaction at most.
const SWEEP_BATCH: usize = 10_000;
/// Deployment-channel events always kept, newest first...
pub const EVENTS_KEEP_COUNT: u64 = 10_000;
/// ...and events younger than this are kept too.
pub const EVENTS_KEEP_MILLIS: i64 = 7 * 24 * 3600 * 1000;

impl Engine {
    pub async fn run_sweeps(self: Arc<Self>) {
        loop {
            match self
                .store
                .write(|tx| tx.sweep_idempotency(now_millis(), SWEEP_BATCH))
                .await
            {
                Ok(n) if n > 0 => {
                    tracing::info!(removed = n, "expired idempotency records removed")
                }
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e, "idempotency sweep"),
            }
            if let Err(e) = self.sweep_events().await {
                tracing::error!(error = %e, "event sweep");
            }
            match self.prune_audit().await {
                Ok(n) if n > 0 => {
                    tracing::info!(removed = n, "old audit events removed (anchor moved)")
                }
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e, "audit retention"),
            }
            match self.sweep_builds().await {
                Ok(n) if n > 0 => tracing::info!(removed = n, "old builds removed with their logs"),
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e, "build sweep"),
            }
            tokio::time::sleep(self.settings.sweep_interval).await;
        }
    }

    async fn sweep_builds(&self) -> Result<usize, crate::store::StoreError> {
        let keep = self.settings.keep_builds as usize;
        let before = now_millis() - i64::from(self.settings.keep_build_days) * 24 * 3600 * 1000;
        let mut removed = 0;
        for id in self.store.read()?.deployment_ids()? {
            // Most deployments have fewer builds than are kept: no write.
            if self.store.read()?.build_count(&id)? <= keep {
                continue;
            }
            removed += self
                .store
                .write(move |tx| {
                    let protected = tx
                        .deployment(&id)?
                        .and_then(|d| d.deployed)
                        .map(|d| d.build_id);
                    let mut n = 0;
                    for (build, created_at, status) in tx.build_ages(&id)?.into_iter().skip(keep) {
                        if created_at >= before || !status.is_finished() || Some(build) == protected
                        {
                            continue;
                        }
                        tx.delete_build(&id, build)?;
                        n += 1;
                        if n >= BUILDS_PER_TXN {
                            break;
                        }
                    }
                    Ok(n)
                })
                .await?;
        }
        Ok(removed)
    }

    async fn sweep_events(&self) -> Result<(), crate::store::StoreError> {
        let ids = self.store.read()?.deployment_ids()?;
        for id in ids {
            let Some(d) = self.store.read()?.deployment(&id)? else {
                continue;
            };
            if d.event_seq <= EVENTS_KEEP_COUNT {
                continue;
            }
            let below = d.event_seq - EVENTS_KEEP_COUNT + 1;
            let before = now_millis() - EVENTS_KEEP_MILLIS;
            let removed = self
                .store
                .write(move |tx| tx.prune_deployment_events(&id, below, before))
                .await?;
            if removed > 0 {
                tracing::info!(deployment = %d.id, removed, "old deployment events removed");
            }
        }
        Ok(())
    }
}
