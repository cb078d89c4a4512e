//! What happens at start, before `/readyz` turns ready (spec storage.md
//! "Restart"): every build still `running` failed with
//! `interrupted_by_restart`, except one on a remote worker (its lease
//! starts again) and a rollout whose plan is stored (it goes on,
//! `resume`); a deployer that outlived a crashed berth is
//! stopped, and its deployment starts nothing until it has exited (the next
//! build would share its work dir). Queued builds stay queued. A write
//! that fails for a reason that may pass (a full disk) is retried, with
//! reads served meanwhile and `/readyz` not ready, until it lands.

use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;

use super::outcome::End;
use super::transition::Change;
use super::{runner, Engine};
use crate::events::Hub;
use crate::model::*;
use crate::store::Lookup;
use crate::store::{StoreResult, Tx};

/// How often an orphaned process group is checked while it is stopping.
const ORPHAN_POLL: Duration = Duration::from_millis(100);
/// The longest pause between attempts of a recovery write that failed
/// for a reason that may pass (a full disk).
const RETRY_MAX_PAUSE: Duration = Duration::from_secs(5);

/// Why this start finds builds `running`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// This berth (or this replica, on its data dir) ran them.
    Restart,
    /// Another replica led the cluster and ran them (docs/cluster.md):
    /// their attempts are lost, as a remote worker's whose lease passed.
    Takeover,
}

impl Engine {
    pub async fn recover(self: &Arc<Self>, start: Start) -> Result<(), crate::store::StoreError> {
        // What calls of the last run left; the root keeps the mode serve
        // gave it (0711 with --deployer-user).
        let scratch = self.settings.scratch_root();
        if let Err(e) = crate::durable::empty_dir(&scratch) {
            tracing::warn!(dir = %scratch.display(), error = %e, "cannot remove what the last run's deployer calls left");
        }
        let running = self.store.read()?.running()?;
        let ttl = self.lease_ttl_ms();
        // An agent's open activation goes on too: its lease starts again.
        self.store
            .write(move |tx| super::activations::restart_leases_tx(tx, ttl))
            .await?;
        for (build_id, deployment) in running {
            // A build on a remote worker goes on: its lease starts again
            // now (berth's down time never counts against a worker).
            let remote = self
                .write_until_landed(
                    build_id,
                    "giving a remote build's attempt a fresh lease (not ready until it lands)",
                    RETRY_MAX_PAUSE,
                    move |tx| renew_remote_tx(tx, build_id, ttl),
                )
                .await?;
            if remote {
                tracing::info!(build = %format_build_id(build_id), %deployment, "a build on a remote worker goes on after the restart");
                if self.rollout_goes_on(build_id) {
                    self.start_remote_rollout(build_id);
                }
                continue;
            }
            let incarnation = self.incarnation.clone();
            let resumed = self
                .write_until_landed(
                    build_id,
                    "letting a rollout go on (not ready until it lands)",
                    RETRY_MAX_PAUSE,
                    move |tx| super::resume::resume_tx(tx, build_id, &incarnation),
                )
                .await?;
            let orphan = match resumed {
                Some(job) => {
                    tracing::info!(build = %format_build_id(build_id), %deployment, "a rollout goes on after the restart");
                    job
                }
                None => {
                    let hub = self.hub.clone();
                    let job = self
                        .write_until_landed(
                            build_id,
                            "marking an interrupted build failed (not ready until it lands)",
                            RETRY_MAX_PAUSE,
                            move |tx| recover_tx(tx, &hub, build_id, start),
                        )
                        .await?;
                    say_ended(start, build_id, &deployment);
                    job
                }
            };
            if let Some(job) = orphan.filter(|job| self.may_be_ours(job)) {
                tracing::warn!(pid = job.pid, %deployment, "stopping the deployer that outlived the last run");
                self.block_deployment(&deployment);
                let (engine, blocked) = (self.clone(), deployment.clone());
                tokio::spawn(async move {
                    stop_orphan(job, engine.settings.cancel_grace).await;
                    engine.unblock_deployment(&blocked);
                });
            }
            if resumed.is_some() {
                self.resume_rollout(build_id, deployment);
            }
        }
        Ok(())
    }
}

impl Engine {
    /// Whether a process record left by the last run names a process of
    /// this machine's that may still run. With replicas a record may name
    /// another machine's: only the very process (pid and start time) is
    /// stopped then, never a group that merely has its number.
    fn may_be_ours(&self, job: &Job) -> bool {
        match self.settings.is_cluster() {
            true => runner::same_process(job),
            false => runner::group_may_be_ours(job),
        }
    }
}

/// The server log's line for a build recovery ended.
fn say_ended(start: Start, build_id: BuildId, deployment: &str) {
    let build = format_build_id(build_id);
    match start {
        Start::Restart => {
            tracing::warn!(%build, deployment, "build interrupted by restart: marked failed")
        }
        Start::Takeover => {
            tracing::warn!(%build, deployment, "a build of the replica that led before: marked failed, lost_attempt")
        }
    }
}

/// A running build's remote attempt gets a lease of now + `--lease-ttl`;
/// `false` when the build runs on no remote attempt (the embedded worker's
/// builds end with the berth that ran them).
pub fn renew_remote_tx(tx: &Tx, build_id: BuildId, ttl_ms: u64) -> StoreResult<bool> {
    let Some(mut a) = tx.last_attempt(build_id)? else {
        return Ok(false);
    };
    if a.worker == crate::authority::LOCAL_WORKER || a.state != AttemptState::Active {
        return Ok(false);
    }
    crate::authority::restart(&mut a, now_millis(), ttl_ms);
    tx.put_attempt(&a)?;
    Ok(true)
}

/// A build found `running` at start failed with `interrupted_by_restart`
/// (`lost_attempt` after a takeover);
/// returns its job, to stop the deployer if it outlived berth.
pub fn recover_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    build_id: BuildId,
    start: Start,
) -> StoreResult<Option<Job>> {
    if crate::failpoints::hit("recover.job", &format_build_id(build_id)) {
        return Err(crate::store::StoreError::injected_disk_full("recover.job"));
    }
    let Some(mut b) = tx.build(build_id)? else {
        return Ok(None);
    };
    // Lines up to the reservation may have been sent live.
    b.event_seq = b.event_seq.max(b.seq_reserved);
    let mut d = tx.deployment(&b.deployment)?;
    // The old incarnation's attempt ends with it, and a rollout's stored
    // result with the build.
    let (attempt, reason, why) = match start {
        Start::Restart => (
            AttemptState::Interrupted,
            FailureReason::InterruptedByRestart,
            "berth stopped while this build ran",
        ),
        Start::Takeover => (
            AttemptState::Lost,
            FailureReason::LostAttempt,
            "the replica that ran this build stopped leading the cluster",
        ),
    };
    super::build::end_attempt(tx, build_id, attempt)?;
    tx.put_rollout_result::<()>(build_id, None)?;
    Change::new(tx, hub).finish(d.as_mut(), &mut b, End::failed(reason, why), &[])?;
    Ok(b.job)
}

/// SIGTERM to the orphan's group, SIGKILL after `grace`, and wait until the
/// group is gone.
pub async fn stop_orphan(job: Job, grace: Duration) {
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
