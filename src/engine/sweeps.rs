//! Background sweeps that keep the store bounded: expired idempotency
//! records (24 h), old deployment-channel events (events.md: keep at least
//! the last 10,000 events or 7 days per deployment, whichever is more), and
//! old builds (storage.md: beyond the newest `--keep-builds` and older than
//! `--keep-build-days`, never the last successful deploy nor anything queued
//! or running), with their logs and events; audit events older than
//! `--audit-retention-days` (engine/audit.rs).

use std::sync::Arc;

use super::Engine;
use crate::model::{now_millis, BuildId, BuildKind, BuildRecord, BuildStatus};
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
            let keep_targets = self.settings.keep_rollback_targets as usize;
            removed += self
                .store
                .write(move |tx| {
                    let builds = tx.build_ages(&id)?;
                    let protected = protected_builds(
                        tx.deployment(&id)?
                            .and_then(|d| d.deployed)
                            .map(|d| d.build_id),
                        &builds,
                        keep_targets,
                    );
                    let mut n = 0;
                    for b in builds.iter().skip(keep) {
                        if b.created_at >= before
                            || !b.status.is_finished()
                            || protected.contains(&b.id)
                        {
                            continue;
                        }
                        tx.delete_build(&id, b.id)?;
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

/// The builds retention never removes (storage.md, lifecycle.md
/// "Rollback"): the deployed one, the newest `keep_targets` succeeded
/// deploys (rollback targets), and the target of any rollback not finished.
/// `builds` newest first.
pub fn protected_builds(
    deployed: Option<BuildId>,
    builds: &[BuildRecord],
    keep_targets: usize,
) -> Vec<BuildId> {
    let mut keep: Vec<BuildId> = deployed.into_iter().collect();
    keep.extend(
        builds
            .iter()
            .filter(|b| b.kind == BuildKind::Deploy && b.status == BuildStatus::Succeeded)
            .take(keep_targets)
            .map(|b| b.id),
    );
    keep.extend(
        builds
            .iter()
            .filter(|b| !b.status.is_finished())
            .filter_map(|b| b.rollback_of),
    );
    keep
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Trigger;

    #[test]
    fn retention_keeps_the_deployed_build_the_rollback_targets_and_a_queued_rollbacks_target() {
        let build = |id: u128, status: BuildStatus, rollback_of: Option<u128>| BuildRecord {
            status,
            rollback_of,
            ..BuildRecord::queued(
                id,
                "d".into(),
                BuildKind::Deploy,
                Trigger::Submit,
                "m".into(),
                0,
            )
        };
        use BuildStatus::*;
        // Newest first: a queued rollback to 1, then successes and failures.
        let builds = [
            build(9, Queued, Some(1)),
            build(8, Failed, None),
            build(7, Succeeded, None),
            build(6, Succeeded, None),
            build(5, Failed, None),
            build(4, Succeeded, None),
            build(1, Succeeded, None),
        ];
        let mut kept = protected_builds(Some(7), &builds, 2);
        kept.sort();
        kept.dedup();
        assert_eq!(kept, vec![1, 6, 7]);
    }
}
