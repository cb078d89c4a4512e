//! A deployment's work state (workers.md "The work state"): its
//! `BERTH_WORK_DIR` between builds, stored so that any worker can take its
//! next build.
//!
//! Why it exists: a work dir used to live on berth's machine only. Once a
//! deployment's build is claimed by a remote worker, the stored archive is
//! the truth: the claim hands it out, each accepted outcome (and each
//! build of the embedded worker) stores the new one in its transaction,
//! and the embedded worker unpacks it before a build of that deployment.
//! Until that first remote claim nothing is archived, so `berth serve`
//! alone works as it always did.
//!
//! Archives are kept once per digest (`WorkStateBlob`, counted by the
//! deployments' lists naming them), `--keep-work-states` per deployment;
//! a destroy that succeeds forgets them. The archive's own rules are
//! `crate::archive`.

use std::sync::Arc;

use super::audit::{Audited, Record};
use super::refusal::{Conflict, Missing, Refusal};
use super::transition::Change;
use super::Engine;
use crate::archive;
use crate::model::{
    BuildId, BuildRecord, Failure, FailureReason, Millis, WorkStateRef, WorkStates,
};
use crate::store::{Lookup, StoreResult, Tx};

/// A checked archive, compressed, ready for a transaction to store.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub digest: String,
    pub size: u64,
    pub compressed: Arc<Vec<u8>>,
}

/// Checks an archive (its size and entries) and compresses it. The error
/// says what is wrong with it.
pub fn prepare(tar: &[u8], max_bytes: u64) -> Result<Prepared, String> {
    if tar.len() as u64 > max_bytes {
        return Err(format!(
            "the archive is larger than --max-work-state ({max_bytes} bytes)"
        ));
    }
    archive::check(tar)?;
    let compressed = crate::store::compress::compress(tar).map_err(|e| e.to_string())?;
    Ok(Prepared {
        digest: archive::digest(tar),
        size: tar.len() as u64,
        compressed: Arc::new(compressed),
    })
}

/// What a build's end does to its deployment's work state.
#[derive(Debug, Clone)]
pub enum NewWorkState {
    /// Nothing: the deployment's work dir is still on berth's machine, the
    /// build left the state as it found it, or it could not be read.
    Unchanged,
    /// The work dir ended empty.
    Empty,
    Archive(Prepared),
}

/// Where a build of the embedded worker starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    /// Berth's own work dir, as before any remote claim.
    Local,
    /// The stored state unpacked (its digest; `None`: empty).
    Stored(Option<String>),
}

/// The stored part of a new work state: `build` left it at `now`.
fn stored_ref(p: &Prepared, build: Option<BuildId>, now: Millis) -> WorkStateRef {
    WorkStateRef {
        digest: p.digest.clone(),
        size: p.size,
        build,
        stored_at: now,
    }
}

/// Makes `new` the deployment's current work state in this transaction
/// (creating its row: from here on the stored state is the truth). The
/// replaced one is kept among the previous ones, at most `keep` in all;
/// each list entry holds one reference to its archive.
pub fn keep_tx(
    tx: &Tx,
    deployment: &str,
    new: &NewWorkState,
    build: Option<BuildId>,
    keep: u32,
    now: Millis,
) -> StoreResult<()> {
    let stored = tx.work_states(deployment)?;
    let exists = stored.is_some();
    let mut w = stored.unwrap_or_default();
    let next = match new {
        NewWorkState::Unchanged => return Ok(()),
        NewWorkState::Empty => None,
        NewWorkState::Archive(p) => Some(p),
    };
    let current = w.current.as_ref().map(|c| c.digest.as_str());
    if current == next.map(|p| p.digest.as_str()) {
        return if exists {
            Ok(())
        } else {
            tx.put_work_states(deployment, &w)
        };
    }
    let old = w.current.take();
    w.current = match next {
        None => None,
        Some(p) => match w.previous.iter().position(|r| r.digest == p.digest) {
            // An older state again: its entry (and reference) moves up.
            Some(i) => {
                w.previous.remove(i);
                Some(stored_ref(p, build, now))
            }
            None => {
                tx.ref_work_state(&p.digest, p.size, || Ok(p.compressed.clone()))?;
                Some(stored_ref(p, build, now))
            }
        },
    };
    if let Some(old) = old {
        w.previous.insert(0, old);
    }
    let keep_previous = usize::try_from(keep.saturating_sub(1)).unwrap_or(0);
    while w.previous.len() > keep_previous {
        if let Some(dropped) = w.previous.pop() {
            tx.unref_work_state(&dropped.digest)?;
        }
    }
    debug_assert!(
        {
            let mut digests: Vec<&str> = w.all().map(|r| r.digest.as_str()).collect();
            let n = digests.len();
            digests.sort_unstable();
            digests.dedup();
            digests.len() == n
        },
        "a digest twice in one deployment's work states"
    );
    tx.put_work_states(deployment, &w)
}

/// Forgets every work state of a deployment (a destroy that succeeded).
pub fn forget_tx(tx: &Tx, deployment: &str) -> StoreResult<()> {
    let Some(w) = tx.work_states(deployment)? else {
        return Ok(());
    };
    for r in w.all() {
        tx.unref_work_state(&r.digest)?;
    }
    tx.remove_work_states(deployment)
}

/// The `If-Match` of a work state `PUT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expected {
    /// `"none"`: the deployment has no current work state.
    Nothing,
    Digest(String),
}

impl Audited for WorkStateRef {
    fn audited_build(&self) -> Option<BuildId> {
        self.build
    }
}

impl Engine {
    /// `PUT /v1/deployments/{id}/work-state`: makes a checked archive the
    /// deployment's current work state (a repair from a worker's `lost/`).
    pub async fn put_work_state(
        self: &Arc<Self>,
        deployment: String,
        expected: Expected,
        prepared: Prepared,
        mut record: Record<WorkStateRef>,
    ) -> Result<WorkStateRef, Refusal> {
        record.audit.deployment = Some(deployment.clone());
        let (hub, keep) = (self.hub.clone(), self.settings.keep_work_states);
        let new = NewWorkState::Archive(prepared);
        self.store
            .write(move |tx| {
                let Some(d) = tx.deployment(&deployment)? else {
                    return Ok(Err(Refusal::NotFound(Missing::Deployment)));
                };
                if d.running.is_some() {
                    return Ok(Err(Refusal::Conflict(Conflict::BuildRunning)));
                }
                let current = tx.work_states(&deployment)?.and_then(|w| w.current);
                let matches = match (&expected, &current) {
                    (Expected::Nothing, None) => true,
                    (Expected::Digest(d), Some(c)) => *d == c.digest,
                    (Expected::Nothing, Some(_)) | (Expected::Digest(_), None) => false,
                };
                if !matches {
                    return Ok(Err(Refusal::PreconditionFailed));
                }
                let change = Change::new(tx, &hub);
                keep_tx(tx, &deployment, &new, None, keep, change.now())?;
                let Some(stored) = tx.work_states(&deployment)?.and_then(|w| w.current) else {
                    return Err(crate::store::StoreError::corrupt(
                        "a work state just stored is not current",
                    ));
                };
                record.store(&change, &stored)?;
                Ok(Ok(stored))
            })
            .await?
    }

    /// The first work state of a deployment whose build a remote worker
    /// claims: berth's own work dir, archived (`None`: it is empty). Only
    /// asked while the deployment has no stored work state.
    pub(super) async fn archive_local_work_dir(
        &self,
        deployment: &str,
    ) -> Result<Option<Prepared>, String> {
        let dir = self.settings.work_dir(deployment);
        let max = self.settings.max_work_state;
        let packed = tokio::task::spawn_blocking(move || {
            let packed = archive::pack(&dir, max).map_err(|p| match p {
                archive::PackProblem::TooLarge => {
                    format!("berth's work dir of it is larger than --max-work-state ({max} bytes)")
                }
                archive::PackProblem::Unreadable(why) => {
                    format!("berth's work dir of it cannot be read: {why}")
                }
            })?;
            packed.map(|p| prepare(&p.tar, max)).transpose()
        })
        .await
        .map_err(|e| format!("archiving the work dir failed: {e}"))??;
        Ok(packed)
    }

    /// Before a build of the embedded worker: a deployment with a stored
    /// work state gets it unpacked into its work dir (`Err`: the build
    /// fails `work_state_unavailable`).
    pub(super) async fn restore_work_state(&self, build: &BuildRecord) -> Result<Start, Failure> {
        let unavailable = |why: String| Failure::new(FailureReason::WorkStateUnavailable, why);
        let rx = self
            .store
            .read()
            .map_err(|e| unavailable(format!("the stored work state cannot be read: {e}")))?;
        let Some(w) = rx
            .work_states(&build.deployment)
            .map_err(|e| unavailable(format!("the stored work state cannot be read: {e}")))?
        else {
            return Ok(Start::Local);
        };
        let tar = match &w.current {
            None => None,
            Some(c) => Some(
                rx.work_state_archive(&c.digest)
                    .map_err(|e| unavailable(format!("the stored work state cannot be read: {e}")))?
                    .ok_or_else(|| unavailable("the stored work state is missing".into()))?,
            ),
        };
        drop(rx);
        let dir = self.settings.work_dir(&build.deployment);
        archive::restore(tar, dir, self.deployer.run_as)
            .await
            .map_err(unavailable)?;
        Ok(Start::Stored(w.current.map(|c| c.digest)))
    }

    /// After a build of the embedded worker that started from a stored
    /// work state: its work dir, archived, and a problem with it (a
    /// would-be success then fails `work_state_invalid`).
    pub(super) async fn collect_work_state(
        &self,
        deployment: &str,
        start: &Start,
    ) -> (NewWorkState, Option<String>) {
        let Start::Stored(started_from) = start else {
            return (NewWorkState::Unchanged, None);
        };
        let (dir, max) = (
            self.settings.work_dir(deployment),
            self.settings.max_work_state,
        );
        let started_from = started_from.clone();
        let judged = tokio::task::spawn_blocking(move || match archive::pack(&dir, max) {
            Ok(None) => Ok(NewWorkState::Empty),
            Ok(Some(p)) if Some(&p.digest) == started_from.as_ref() => Ok(NewWorkState::Unchanged),
            Ok(Some(p)) => prepare(&p.tar, max).map(NewWorkState::Archive),
            Err(archive::PackProblem::TooLarge) => Err(format!(
                "the work dir is larger than --max-work-state ({max} bytes)"
            )),
            Err(archive::PackProblem::Unreadable(why)) => {
                Err(format!("the work dir cannot be archived: {why}"))
            }
        })
        .await;
        match judged {
            Ok(Ok(new)) => (new, None),
            Ok(Err(why)) => (NewWorkState::Unchanged, Some(why)),
            Err(e) => (
                NewWorkState::Unchanged,
                Some(format!("archiving the work dir failed: {e}")),
            ),
        }
    }

    /// A kept work state of a deployment (`digest`, or the current one)
    /// with its archive.
    pub fn work_state(
        &self,
        deployment: &str,
        digest: Option<&str>,
    ) -> Result<(WorkStateRef, Vec<u8>), Refusal> {
        let rx = self.store.read()?;
        let w = rx
            .work_states(deployment)?
            .ok_or(Refusal::NotFound(Missing::WorkState))?;
        let found = match digest {
            None => w.current.clone(),
            Some(d) => w.all().find(|r| r.digest == d).cloned(),
        };
        let found = found.ok_or(Refusal::NotFound(Missing::WorkState))?;
        let tar = rx
            .work_state_archive(&found.digest)?
            .ok_or(Refusal::NotFound(Missing::WorkState))?;
        Ok((found, tar))
    }

    /// A deployment's work states for its read (`None` before its first
    /// remote claim).
    pub fn work_states(&self, deployment: &str) -> Result<Option<WorkStates>, Refusal> {
        Ok(self.store.read()?.work_states(deployment)?)
    }
}
