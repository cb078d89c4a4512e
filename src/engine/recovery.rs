//! What happens at start, before `/readyz` turns ready (spec storage.md
//! "Restart"): every build still `running` failed with
//! `interrupted_by_restart`; a deployer that outlived a crashed berth is
//! stopped, and its deployment starts nothing until it has exited (the next
//! build would share its work dir). Queued builds stay queued.

use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;

use super::{release_pending, runner, Engine};
use crate::events;
use crate::model::*;

/// How often an orphaned process group is checked while it is stopping.
const ORPHAN_POLL: Duration = Duration::from_millis(100);

impl Engine {
    pub async fn recover(self: &Arc<Self>) -> Result<(), crate::store::StoreError> {
        let _ = std::fs::remove_dir_all(self.settings.scratch_root());
        let running = self.store.read()?.running()?;
        for (build_id, deployment) in running {
            let hub = self.hub.clone();
            let orphan = self
                .store
                .write(move |tx| {
                    let Some(mut b) = tx.build(build_id)? else {
                        return Ok(None);
                    };
                    let now = now_millis();
                    b.status = BuildStatus::Failed;
                    b.finished_at = Some(now);
                    b.failure = Some(Failure {
                        reason: "interrupted_by_restart".into(),
                        detail: "berth stopped while this build ran".into(),
                    });
                    // Lines up to the reservation may have been sent live.
                    b.event_seq = b.event_seq.max(b.seq_reserved);
                    events::build_status(tx, &hub, &mut b, now)?;
                    tx.put_build(&b)?;
                    if let Some(mut d) = tx.deployment(&b.deployment)? {
                        release_pending(&mut d, b.kind);
                        d.running = None;
                        d.last_finished = Some(LastFinished {
                            build_id,
                            kind: b.kind,
                            status: BuildStatus::Failed,
                        });
                        d.revision += 1;
                        d.updated_at = now;
                        events::deployment_changed(tx, &hub, &mut d, Some(&b), now)?;
                        tx.put_deployment(&d)?;
                    }
                    if b.kind == BuildKind::Destroy {
                        tx.remove_callback(build_id)?;
                    }
                    Ok(b.job)
                })
                .await?;
            tracing::warn!(build = %format_build_id(build_id), %deployment, "build interrupted by restart: marked failed");
            if let Some(job) = orphan.filter(runner::is_same_process) {
                tracing::warn!(pid = job.pid, %deployment, "stopping the deployer that outlived the last run");
                self.block_deployment(&deployment);
                let engine = self.clone();
                tokio::spawn(async move {
                    stop_orphan(job, engine.settings.cancel_grace).await;
                    engine.unblock_deployment(&deployment);
                });
            }
        }
        Ok(())
    }
}

/// SIGTERM to the orphan's group, SIGKILL after `grace`, and wait until the
/// group is gone.
async fn stop_orphan(job: Job, grace: Duration) {
    runner::signal_group(job.pid, Signal::SIGTERM);
    let deadline = tokio::time::Instant::now() + grace;
    while runner::group_alive(job.pid) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(ORPHAN_POLL).await;
    }
    runner::signal_group(job.pid, Signal::SIGKILL);
    while runner::group_alive(job.pid) {
        tokio::time::sleep(ORPHAN_POLL).await;
    }
}
