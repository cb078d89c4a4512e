//! The writer thread and the file handle it shares with readers.
//!
//! One thread group-commits: every write job queued while the previous
//! commit was in flight runs in the next single transaction, which commits
//! (fsync) once. After an I/O error redb refuses every call until the file is
//! reopened, so the thread drops the handle and reopens it; while it cannot
//! open the file for writing (a full disk), reads go through a read-only
//! handle. A commit that fails with an I/O error (ENOSPC included) answers
//! its batch with that error (503 `disk_full`); a read that meets a reopen
//! in progress waits for it (up to `READ_WAIT_ATTEMPTS`, through
//! `block_in_place` on a runtime worker). A build's final commit is retried
//! with backoff by its caller, so no build stays `running` once the disk
//! recovers (tests/integration/disk.rs, on a small tmpfs).

use std::path::Path;
use std::sync::Arc;

use redb::{Database, WriteTransaction};
use tokio::sync::mpsc;

use super::{StoreError, StoreResult, MAX_JOBS_PER_COMMIT};

/// Work to run after the transaction that queued it is durable (publishing
/// events to live subscribers), in commit order.
pub type Hook = Box<dyn FnOnce() + Send>;
/// A job's body in a transaction: the error it failed with (the batch then
/// aborts) and its after-commit hooks.
pub(super) type RunJob = dyn FnMut(&WriteTransaction) -> (Option<StoreError>, Vec<Hook>) + Send;

/// One write job. `run` executes its body in a transaction and keeps the
/// result; it may run twice: when its batch fails because of another job
/// (or a commit error), it runs again alone. `finish` answers the caller:
/// with the kept result, or with the error that kept it from landing.
pub(super) struct WriteJob {
    pub(super) run: Box<RunJob>,
    pub(super) finish: Box<dyn FnOnce(Option<StoreError>) + Send>,
}

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
    /// How the file is shared with other processes (kept for reopens).
    pub(super) sharing: super::Sharing,
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
            match open_database(&self.path, self.sharing) {
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
            .set_concurrency_mode(self.sharing.mode())
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

pub(super) fn open_database(path: &Path, sharing: super::Sharing) -> StoreResult<Database> {
    Ok(Database::builder()
        .set_concurrency_mode(sharing.mode())
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
        let Some(db) = handle(&shared, &batch) else {
            let e = closed_or_reopening(&shared);
            batch
                .into_iter()
                .for_each(|job| (job.finish)(Some(e.clone())));
            continue;
        };
        let txn = match db.begin_write() {
            Ok(t) => t,
            Err(e) => {
                let err = StoreError::from(e);
                tracing::error!(error = %err, "store write transaction could not start");
                batch
                    .into_iter()
                    .for_each(|job| (job.finish)(Some(err.clone())));
                if err.is_transient() {
                    drop(db);
                    shared.reopen();
                }
                continue;
            }
        };
        let mut failed = Vec::with_capacity(batch.len());
        let mut hooks = Vec::new();
        for job in batch.iter_mut() {
            let (failure, job_hooks) = (job.run)(&txn);
            failed.push(failure);
            hooks.extend(job_hooks);
        }
        let job_failed = failed.iter().any(Option::is_some);
        let commit_error = if job_failed {
            // A job failed part-way: nothing of this batch may land.
            let _ = txn.abort();
            None
        } else {
            txn.commit().err().map(StoreError::from)
        };
        if !job_failed && commit_error.is_none() {
            hooks.into_iter().for_each(|hook| hook());
            batch.into_iter().for_each(|job| (job.finish)(None));
            continue;
        }
        drop(hooks);
        if let Some(e) = &commit_error {
            tracing::error!(error = %e, jobs = batch.len(), "store commit failed");
        } else {
            let failed_jobs = failed.iter().filter(|f| f.is_some()).count();
            tracing::warn!(
                jobs = batch.len(),
                failed_jobs,
                "a write job failed; the rest of its batch runs again, each alone"
            );
        }
        let mut db = Some(db);
        if commit_error.as_ref().is_some_and(StoreError::is_transient) {
            drop(db.take());
            shared.reopen();
            db = shared.current();
        }
        // The batch did not land. A job that failed by itself gets its own
        // error; every other job runs again, alone, so one job's error (or
        // one too large for the disk) never fails its batch-mates.
        for (job, failure) in batch.into_iter().zip(failed) {
            match (failure, &db, &commit_error) {
                (Some(e), _, _) => (job.finish)(Some(e)),
                (None, _, Some(e)) if !e.is_transient() && !job_failed => {
                    (job.finish)(Some(e.clone()))
                }
                (None, Some(db), _) => {
                    if let Some(poisoned) = run_alone(db, job) {
                        if poisoned {
                            shared.reopen();
                        }
                    }
                }
                (None, None, _) => (job.finish)(Some(closed_or_reopening(&shared))),
            }
        }
    }
}

/// The handle to write with, reopening it when an I/O error dropped it.
fn handle(shared: &Shared, batch: &[WriteJob]) -> Option<Arc<Database>> {
    debug_assert!(!batch.is_empty());
    if let Some(db) = shared.current() {
        return Some(db);
    }
    if shared.closed.load(std::sync::atomic::Ordering::SeqCst) {
        return None;
    }
    shared.reopen();
    shared.current()
}

fn closed_or_reopening(shared: &Shared) -> StoreError {
    if shared.closed.load(std::sync::atomic::Ordering::SeqCst) {
        StoreError::closed()
    } else {
        StoreError::reopening()
    }
}

/// Runs one job in its own transaction. Returns `Some(true)` when the
/// handle must be reopened (an I/O error), `Some(false)` on another
/// failure, `None` when it committed.
fn run_alone(db: &Database, mut job: WriteJob) -> Option<bool> {
    let txn = match db.begin_write() {
        Ok(t) => t,
        Err(e) => {
            let err = StoreError::from(e);
            let transient = err.is_transient();
            (job.finish)(Some(err));
            return Some(transient);
        }
    };
    let (failure, hooks) = (job.run)(&txn);
    if let Some(e) = failure {
        let _ = txn.abort();
        (job.finish)(Some(e));
        return Some(false);
    }
    match txn.commit() {
        Ok(()) => {
            hooks.into_iter().for_each(|hook| hook());
            (job.finish)(None);
            None
        }
        Err(e) => {
            let err = StoreError::from(e);
            tracing::error!(error = %err, "store commit of a re-run job failed");
            let transient = err.is_transient();
            (job.finish)(Some(err));
            Some(transient)
        }
    }
}
