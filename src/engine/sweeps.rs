//! Background sweeps that keep the store bounded: expired idempotency
//! records (24 h) and old deployment-channel events (events.md: keep at
//! least the last 10,000 events or 7 days per deployment, whichever is more).

use std::sync::Arc;
use std::time::Duration;

use super::Engine;
use crate::model::now_millis;

/// How often the sweeps run.
const SWEEP_EVERY: Duration = Duration::from_secs(600);
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
            tokio::time::sleep(SWEEP_EVERY).await;
        }
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
