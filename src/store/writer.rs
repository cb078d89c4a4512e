//! The writer thread and the file handle it shares with readers.
//!
//! One thread group-commits: every write job queued while the previous
//! commit was in flight runs in the next single transaction, which commits
//! (fsync) once. After an I/O error redb refuses every call until the file is
//! reopened, so the thread drops the handle and reopens it; while it cannot
//! open the file for writing (a full disk), reads go through a read-only
//! handle.

use std::path::Path;
use std::sync::Arc;

use redb::{Database, WriteTransaction};
use tokio::sync::mpsc;

use super::{StoreError, StoreResult, MAX_JOBS_PER_COMMIT};

pub(super) type Completion = Box<dyn FnOnce(Option<StoreError>) + Send>;
/// Work to run after the transaction that queued it is durable (publishing
/// events to live subscribers), in commit order.
pub type Hook = Box<dyn FnOnce() + Send>;
/// Runs one job; returns its completion, the store error it failed with (if
/// any: the batch then aborts), and its after-commit hooks.
pub(super) type WriteJob = Box<
    dyn FnOnce(Result<&WriteTransaction, StoreError>) -> (Completion, Option<StoreError>, Vec<Hook>)
        + Send,
>;

/// The open database, swapped for a fresh handle after an I/O error: redb
/// refuses every call after one ("close and re-open the database"), and a
/// full disk must not need a restart of berth.
pub(super) struct Shared {
    pub(super) path: std::path::PathBuf,
    pub(super) db: std::sync::RwLock<Option<Arc<Database>>>,
    /// While the file cannot be opened for writing (a full disk), reads go
    /// through a read-only handle.
    pub(super) read_only: std::sync::RwLock<Option<Arc<redb::ReadOnlyDatabase>>>,
    /// Set by `Store::close`: no write reopens the file after it.
    pub(super) closed: std::sync::atomic::AtomicBool,
}

impl Shared {
    pub(super) fn current(&self) -> Option<Arc<Database>> {
        self.db.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Drops the poisoned handle and opens the file again; retries while
    /// old read transactions still hold the file. Leaves `None` when it
    /// cannot open yet (the next write tries again).
    pub(super) fn reopen(&self) {
        let old = self.db.write().unwrap_or_else(|p| p.into_inner()).take();
        drop(old);
        // The read-only handle (if any) would keep the writer out.
        let old_ro = self
            .read_only
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        drop(old_ro);
        for _ in 0..REOPEN_ATTEMPTS {
            match open_database(&self.path) {
                Ok(db) => {
                    tracing::warn!(path = %self.path.display(), "store reopened after an I/O error");
                    *self.db.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(db));
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "store reopen: not yet");
                    std::thread::sleep(REOPEN_PAUSE);
                }
            }
        }
        match Database::builder()
            .set_concurrency_mode(redb::ConcurrencyMode::SingleWriter)
            .open_read_only(&self.path)
        {
            Ok(ro) => {
                *self.read_only.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(ro));
                tracing::error!(path = %self.path.display(), "cannot reopen the store for writing yet (disk full?); serving reads only");
            }
            Err(e) => {
                tracing::error!(path = %self.path.display(), error = %e, "cannot reopen the store yet; answering 503 until it can")
            }
        }
    }
}

/// How often, and how far apart, a reopen is tried in one go.
const REOPEN_ATTEMPTS: usize = 10;
/// How long a read waits for a reopen in progress (x `REOPEN_PAUSE`).
pub(super) const READ_WAIT_ATTEMPTS: usize = 100;
const REOPEN_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);

/// Waits `REOPEN_PAUSE` for a reopen in progress. On a runtime worker the
/// worker first hands its other tasks on (`block_in_place`), so a read that
/// waits never stalls unrelated requests; elsewhere it simply sleeps.
pub(super) fn pause_for_reopen() {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(|| std::thread::sleep(REOPEN_PAUSE))
        }
        _ => std::thread::sleep(REOPEN_PAUSE),
    }
}

pub(super) fn open_database(path: &Path) -> StoreResult<Database> {
    Ok(Database::builder()
        .set_concurrency_mode(redb::ConcurrencyMode::SingleWriter)
        .create(path)?)
}

pub(super) fn writer_loop(shared: Arc<Shared>, mut rx: mpsc::Receiver<WriteJob>) {
    while let Some(first) = rx.blocking_recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_JOBS_PER_COMMIT {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let db = match shared.current() {
            Some(db) => db,
            None if shared.closed.load(std::sync::atomic::Ordering::SeqCst) => {
                for job in batch {
                    let (completion, _, _) = job(Err(StoreError::closed()));
                    completion(None);
                }
                continue;
            }
            None => {
                shared.reopen();
                match shared.current() {
                    Some(db) => db,
                    None => {
                        for job in batch {
                            let (completion, _, _) = job(Err(StoreError::reopening()));
                            completion(None);
                        }
                        continue;
                    }
                }
            }
        };
        let txn = match db.begin_write() {
            Ok(t) => t,
            Err(e) => {
                let err = StoreError::from(e);
                tracing::error!(error = %err, "store write transaction could not start");
                for job in batch {
                    let (completion, _, _) = job(Err(err.clone()));
                    completion(None);
                }
                if err.is_transient() {
                    drop(db);
                    shared.reopen();
                }
                continue;
            }
        };
        let mut completions = Vec::with_capacity(batch.len());
        let mut hooks = Vec::new();
        let mut failure: Option<StoreError> = None;
        for job in batch {
            let (completion, failed, job_hooks) = job(Ok(&txn));
            if failure.is_none() {
                failure = failed;
            }
            completions.push(completion);
            hooks.extend(job_hooks);
        }
        let commit_error = match failure {
            Some(f) => {
                // A job failed part-way: nothing of this batch may land.
                let _ = txn.abort();
                Some(f)
            }
            None => txn.commit().err().map(StoreError::from),
        };
        match &commit_error {
            Some(e) => tracing::error!(error = %e, "store commit failed"),
            None => hooks.into_iter().for_each(|hook| hook()),
        }
        let poisoned = commit_error.as_ref().is_some_and(StoreError::is_transient);
        for completion in completions {
            completion(commit_error.clone());
        }
        if poisoned {
            drop(db);
            shared.reopen();
        }
    }
}
