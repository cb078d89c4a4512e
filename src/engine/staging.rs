//! What a worker uploads before its outcome (workers.md "Blobs"): its SBOM
//! files and its work state archive, staged per attempt as files under
//! `<data-dir>/staging/<attempt id>/`, each named by its digest.
//!
//! Why it exists: an outcome names its files by digest and must commit
//! in one transaction, while the files may be far larger than a request
//! body. So they arrive first, one `PUT` each, bounded per blob and per
//! attempt (`--max-attempt-upload`); the outcome reads, checks and
//! compresses what it names before its write job, and the transaction
//! stores only what the authority check lets through. A refused call
//! never reads a staged file into the store. Staged files of an attempt
//! go when its outcome is accepted, and otherwise within
//! `STAGING_SWEEP_EVERY` of its end (or at the next start).
//!
//! Uploads (`Upload`) arrive under `<data-dir>/staging/incoming/` first
//! and are removed when dropped unless staged: a caller that gives up
//! halfway leaves nothing behind.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::outcome::PreparedSbom;
use super::refusal::{Missing, Refusal};
use super::verdict::ArtifactRead;
use super::work_state::{prepare, NewWorkState};
use super::Engine;
use crate::authority;
use crate::model::{now_millis, AttemptRecord, AttemptState, BuildId, WorkStateRef};
use crate::store::Lookup;

/// How often staged files of attempts that ended are looked for.
pub const STAGING_SWEEP_EVERY: Duration = Duration::from_secs(60);

/// The smallest per-blob limit: an SBOM file or a work state of up to
/// `--max-work-state`, whichever is larger.
pub const MIN_BLOB_BYTES: u64 = 64 << 20;

/// The directory under the staging root where uploads arrive.
const INCOMING: &str = "incoming";

/// A request body received into a file, with its SHA-256. The file is
/// removed when this is dropped, unless it was moved into place.
pub struct Upload {
    pub path: PathBuf,
    /// `sha256:<64 hex>`.
    pub digest: String,
    pub len: u64,
}

impl Drop for Upload {
    fn drop(&mut self) {
        match std::fs::remove_file(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(error = %e, file = %self.path.display(), "cannot remove an upload's file")
            }
        }
    }
}

/// The authority a blob upload or a work state download carries in its
/// headers (`Berth-Fence`, `Berth-Worker-Incarnation`).
pub struct AttemptAuthority {
    pub fence: u64,
    pub incarnation: String,
}

/// What an outcome names besides its JSON, as the worker sent it.
pub struct Uploads {
    /// The result's SBOM and artifact paths -> the staged files' digests.
    pub files: BTreeMap<String, String>,
    /// Which of those paths are file artifacts (the rest are SBOMs).
    pub artifact_paths: BTreeSet<String>,
    /// The digest of the work dir's archive at the end (`None`: empty).
    pub work_state: Option<String>,
    /// Why the worker could not archive its work dir.
    pub work_state_problem: Option<String>,
}

/// What an outcome names besides its JSON, read and checked.
pub struct PreparedFiles {
    /// Each SBOM path of the result the worker uploaded, prepared (or why
    /// it cannot be used).
    pub sboms: BTreeMap<String, Result<PreparedSbom, String>>,
    /// Each file artifact path of the result the worker uploaded, read
    /// (its digest, size and zstd bytes), or why it cannot be used.
    pub artifacts: BTreeMap<String, Result<ArtifactRead, String>>,
    pub work_state: NewWorkState,
    /// Why the work state at the end cannot be stored.
    pub work_state_problem: Option<String>,
}

impl PreparedFiles {
    /// A file artifact a result names, as the worker uploaded it (a path
    /// it did not upload is a missing file, as on the embedded worker).
    pub(super) fn artifact(&self, path: &str) -> Result<Option<ArtifactRead>, String> {
        match self.artifacts.get(path) {
            Some(read) => read.clone().map(Some),
            None => Err(format!(
                "the artifact file {path} was not uploaded by the worker"
            )),
        }
    }
}

impl Engine {
    /// `<data-dir>/staging`.
    pub fn staging_root(&self) -> PathBuf {
        self.settings.data_dir.join("staging")
    }

    /// Where uploads arrive before they are staged.
    pub fn incoming_dir(&self) -> PathBuf {
        self.staging_root().join(INCOMING)
    }

    fn staged_dir(&self, attempt: (BuildId, u64)) -> PathBuf {
        self.staging_root()
            .join(authority::attempt_id(attempt.0, attempt.1))
    }

    /// The largest blob (`max(64 MiB, --max-work-state,
    /// --max-artifact-bytes)`).
    pub fn max_blob_bytes(&self) -> u64 {
        max_blob_bytes(&self.settings)
    }

    /// The authority check of a call that writes nothing (a blob, the work
    /// state download), in `authority::judge`'s order; a lease found passed
    /// is left to the sweep, which loses it within a second.
    fn judge_reading(
        &self,
        worker: &str,
        attempt: (BuildId, u64),
        who: &AttemptAuthority,
    ) -> Result<AttemptRecord, Refusal> {
        let rx = self.store.read()?;
        let a = rx
            .attempt(attempt.0, attempt.1)?
            .filter(|a| a.worker == worker)
            .ok_or(Refusal::NotFound(Missing::Attempt))?;
        let call = authority::Call {
            operation_id: "",
            fence: who.fence,
            incarnation: &who.incarnation,
        };
        authority::judge(&a, &call, now_millis()).map_err(Refusal::Stale)?;
        Ok(a)
    }

    /// `PUT /internal/v1/attempts/{attempt}/blobs/{digest}` (the API
    /// checked that `digest` is the upload's): `true` when stored now,
    /// `false` when it was staged already.
    pub async fn stage_blob(
        &self,
        worker: &str,
        attempt: (BuildId, u64),
        who: &AttemptAuthority,
        digest: &str,
        upload: &Upload,
    ) -> Result<bool, Refusal> {
        self.judge_reading(worker, attempt, who)?;
        debug_assert_eq!(
            upload.digest, digest,
            "an upload staged under another digest"
        );
        let dir = self.staged_dir(attempt);
        let target = dir.join(staged_name(digest));
        if target.exists() {
            return Ok(false);
        }
        let max = self.settings.max_attempt_upload;
        let staged = staged_bytes(&dir)
            .map_err(|e| Refusal::Store(crate::store::StoreError::other(format!("{e}"))))?;
        if staged.saturating_add(upload.len) > max {
            return Err(Refusal::TooLarge(format!(
                "this attempt's uploads would pass --max-attempt-upload ({max} bytes)"
            )));
        }
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::rename(&upload.path, &target))
            .map_err(|e| {
                Refusal::Store(crate::store::StoreError::other(format!(
                    "cannot stage an upload: {e}"
                )))
            })?;
        Ok(true)
    }

    /// `GET /internal/v1/attempts/{attempt}/work-state`: the work state the
    /// attempt started from (nothing changes it while the build runs).
    pub fn attempt_work_state(
        &self,
        worker: &str,
        attempt: (BuildId, u64),
        who: &AttemptAuthority,
    ) -> Result<(WorkStateRef, Vec<u8>), Refusal> {
        let a = self.judge_reading(worker, attempt, who)?;
        self.work_state(&a.deployment, None)
    }

    /// Reads and checks what an outcome names, before its write job: the
    /// SBOM files and file artifacts, and the work state at the end.
    pub(super) async fn prepare_files(
        &self,
        attempt: (BuildId, u64),
        deployment: &str,
        uploads: Uploads,
    ) -> Result<PreparedFiles, Refusal> {
        let Uploads {
            files,
            artifact_paths,
            work_state,
            work_state_problem: problem,
        } = uploads;
        let artifact_limit = self.settings.max_artifact_bytes;
        let current = self
            .store
            .read()?
            .work_states(deployment)?
            .and_then(|w| w.current)
            .map(|c| c.digest);
        let (dir, store) = (self.staged_dir(attempt), self.store.clone());
        let max = self.settings.max_work_state;
        let prepared = tokio::task::spawn_blocking(move || {
            let (mut sboms, mut artifacts) = (BTreeMap::new(), BTreeMap::new());
            for (path, digest) in files {
                if artifact_paths.contains(&path) {
                    let read = read_artifact(&dir, &digest, artifact_limit);
                    artifacts.insert(path, read);
                } else {
                    let read = read_staged(&dir, &digest, crate::sbom::MAX_SBOM_BYTES)
                        .and_then(|bytes| super::verdict::prepare_sbom(&bytes, &store));
                    sboms.insert(path, read);
                }
            }
            let (work_state, work_state_problem) = match (problem, work_state) {
                (Some(p), _) => (NewWorkState::Unchanged, Some(format!("the worker: {p}"))),
                (None, None) => (NewWorkState::Empty, None),
                (None, Some(d)) if Some(&d) == current.as_ref() => (NewWorkState::Unchanged, None),
                (None, Some(d)) => {
                    match read_staged(&dir, &d, max).and_then(|tar| prepare(&tar, max)) {
                        Ok(p) => (NewWorkState::Archive(p), None),
                        Err(why) => (NewWorkState::Unchanged, Some(why)),
                    }
                }
            };
            PreparedFiles {
                sboms,
                artifacts,
                work_state,
                work_state_problem,
            }
        })
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "preparing an outcome's files failed");
            Refusal::Internal
        })?;
        Ok(prepared)
    }

    /// Removes an attempt's staged files (its outcome was accepted).
    pub(super) fn drop_staged(&self, attempt: (BuildId, u64)) {
        remove_dir(&self.staged_dir(attempt));
    }

    /// Removes the staged files of every attempt that is not active, and
    /// uploads left by a berth that stopped; at start, then every
    /// `STAGING_SWEEP_EVERY`.
    pub async fn sweep_staging(self: Arc<Self>) {
        loop {
            if let Err(e) = self.sweep_staging_once() {
                tracing::warn!(error = %e, "cannot sweep the staged uploads; it tries again");
            }
            tokio::time::sleep(STAGING_SWEEP_EVERY).await;
        }
    }

    fn sweep_staging_once(&self) -> Result<(), String> {
        let root = self.staging_root();
        let listing = match std::fs::read_dir(&root) {
            Ok(listing) => listing,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(format!("{}: {e}", root.display())),
        };
        let rx = self.store.read().map_err(|e| e.to_string())?;
        for entry in listing {
            let entry = entry.map_err(|e| e.to_string())?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let active = match authority::parse_attempt_id(&name) {
                Some((build, fence)) => rx
                    .attempt(build, fence)
                    .map_err(|e| e.to_string())?
                    .is_some_and(|a| a.state == AttemptState::Active),
                // `incoming/` holds uploads in flight: kept.
                None => name == INCOMING,
            };
            if !active {
                remove_dir(&entry.path());
            }
        }
        Ok(())
    }
}

/// The largest blob a worker may upload: an SBOM, the work state, a file
/// artifact.
pub fn max_blob_bytes(settings: &crate::settings::Settings) -> u64 {
    settings
        .max_work_state
        .max(MIN_BLOB_BYTES)
        .max(settings.max_artifact_bytes)
}

/// The paths of the file artifacts a deploy result names: the uploads
/// read as artifacts rather than SBOMs.
pub fn artifact_paths(result: &Result<String, String>) -> BTreeSet<String> {
    let Ok(text) = result else {
        return BTreeSet::new();
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(text) else {
        return BTreeSet::new();
    };
    super::verdict::node_paths(&v, "artifact", ("kind", "file"))
        .into_iter()
        .collect()
}

/// A staged file artifact, checked against the digest it was staged
/// under, as the store keeps it.
fn read_artifact(dir: &Path, digest: &str, max: u64) -> Result<ArtifactRead, String> {
    let bytes = read_staged(dir, digest, max)?;
    let compressed = crate::store::compress::compress(&bytes).map_err(|e| e.to_string())?;
    Ok((
        digest.to_string(),
        bytes.len() as u64,
        std::sync::Arc::new(compressed),
    ))
}

/// A staged file's name: its digest's hex.
fn staged_name(digest: &str) -> String {
    digest.trim_start_matches("sha256:").to_string()
}

fn read_staged(dir: &Path, digest: &str, max: u64) -> Result<Vec<u8>, String> {
    if !crate::archive::is_digest(digest) {
        return Err(format!("{digest:?} is not a sha256 digest"));
    }
    let path = dir.join(staged_name(digest));
    let len = match std::fs::metadata(&path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err("the file was not uploaded by the worker".into())
        }
        Err(e) => return Err(format!("the uploaded file cannot be read: {e}")),
    };
    if len > max {
        return Err(format!("the uploaded file is larger than {max} bytes"));
    }
    std::fs::read(&path).map_err(|e| format!("the uploaded file cannot be read: {e}"))
}

fn staged_bytes(dir: &Path) -> std::io::Result<u64> {
    let listing = match std::fs::read_dir(dir) {
        Ok(listing) => listing,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut total = 0u64;
    for entry in listing {
        total = total.saturating_add(entry?.metadata()?.len());
    }
    Ok(total)
}

fn remove_dir(dir: &Path) {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(error = %e, dir = %dir.display(), "cannot remove staged uploads")
        }
    }
}
