//! redb's file with its syncs made behind the writer: a checkpoint's
//! durable commit returns once redb has written its pages, and a thread of
//! its own (`berth-redb-sync`) makes them durable while the writer runs the
//! next batch.
//!
//! Why it exists: a checkpoint held the writer for redb's fdatasync of the
//! pages it wrote (about 1.6 ms of a 3.8 ms checkpoint at 32 connections),
//! and every write queued behind it; a submit that met one waited it out.
//! The redo log already holds every row the checkpoint commits, so the
//! checkpoint does not need to be durable when it returns, only before the
//! log is written over (`redo::RedoLog::checkpointed`).
//!
//! What keeps it as safe as redb's own sync (a cut may come anywhere):
//! - Order. Every write and resize after a sync was asked waits here until
//!   that sync has returned (`SyncBehind::write`), so nothing of the next
//!   commit (which may reuse pages the last durable one still needs, since
//!   redb takes the commit as durable) reaches the file before the commit
//!   it follows is durable. Up to that point a cut finds what a cut during
//!   redb's own fdatasync finds: the commit's pages written in any order,
//!   which redb's checksums and its secondary header slot already survive.
//! - The log. A checkpoint's records are written over only after its sync
//!   returned (`RedbSyncs::state`); until then a cut leaves them for the
//!   replay, which skips those redb holds (the generation in `meta`).
//! - Failure. A sync that fails latches, with its kind: every later write,
//!   resize or sync fails (a full disk as a full disk), so the writer's
//!   next checkpoint (or a batch that must grow the file) fails and the
//!   store is reopened from the log, as after any failed checkpoint.
//! - The ends. A start waits for its own commits (`Store::open_shared`:
//!   the replay's, a migration's) before it writes anything in their
//!   layout; `close` (redb's last call, when the store is dropped) waits
//!   for the sync of redb's clean-shutdown header, so a stopped store is
//!   durable when `Store::close` returns.
//!
//! Only a store held alone (`Sharing::Exclusive`) is opened so: there the
//! redo log exists, and no other process reads the file between a commit
//! and its sync.
//!
//! Tried, not kept: the page writes behind the writer as well (kept in
//! memory, read from there until written). The writer's system CPU per
//! submit halved at 32 connections, but a checkpoint held it just as long
//! (2.2 ms against 2.2 ms at 32 connections, 0.8-1.2 ms against 0.8 ms at
//! one): what is left is redb's own commit work, checksums and page
//! bookkeeping, and the `pwrite`s were a small part of it. It was not
//! worth a second copy of the file's newest pages to keep coherent.

use std::ops::Bound;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use redb::backends::FileBackend;
use redb::{BackendError, StorageBackend};

use super::{StoreError, StoreResult};

/// The syncs asked of one open file, and how far they have come.
#[derive(Debug, Default)]
pub(super) struct RedbSyncs {
    state: Mutex<Progress>,
    changed: Condvar,
}

/// `RedbSyncs`' counts, under its lock.
#[derive(Debug, Default)]
struct Progress {
    /// Syncs asked for so far (redb's `sync_data` calls).
    asked: u64,
    /// The `asked` count the last sync that returned covered.
    done: u64,
    /// Why a sync failed; once set, every later call fails.
    failed: Option<Failure>,
    /// The file is closing: the thread ends once it has synced what was
    /// asked.
    closing: bool,
}

/// How far a checkpoint's sync has come (`RedbSyncs::state`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Synced {
    /// Its pages are durable.
    Durable,
    /// Its sync has not returned yet.
    Pending,
    /// A sync failed: its pages may not be on the disk.
    Failed(Failure),
}

/// A failed sync, kept with its kind, so a full disk met behind the
/// writer is still told as one (`StoreErrorKind::DiskFull`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Failure {
    kind: std::io::ErrorKind,
    why: String,
}

impl Failure {
    pub(super) fn of(e: &std::io::Error) -> Failure {
        Failure {
            kind: e.kind(),
            why: e.to_string(),
        }
    }

    /// The error every later call returns.
    fn io_error(&self) -> std::io::Error {
        std::io::Error::new(
            self.kind,
            format!("an earlier sync of the store file failed: {}", self.why),
        )
    }
}

impl RedbSyncs {
    fn progress(&self) -> MutexGuard<'_, Progress> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The ticket of every sync asked so far: `state` says whether they
    /// have all returned.
    pub(super) fn ticket(&self) -> u64 {
        self.progress().asked
    }

    pub(super) fn state(&self, ticket: u64) -> Synced {
        let progress = self.progress();
        Self::of(&progress, ticket)
    }

    fn of(progress: &Progress, ticket: u64) -> Synced {
        match (&progress.failed, progress.done >= ticket) {
            (Some(failure), _) => Synced::Failed(failure.clone()),
            (None, true) => Synced::Durable,
            (None, false) => Synced::Pending,
        }
    }

    /// Waits until the syncs of `ticket` have returned.
    pub(super) fn wait(&self, ticket: u64) -> StoreResult<()> {
        let mut progress = self.progress();
        loop {
            match Self::of(&progress, ticket) {
                Synced::Durable => return Ok(()),
                Synced::Failed(failure) => return Err(StoreError::from(failure.io_error())),
                Synced::Pending => {
                    progress = self
                        .changed
                        .wait(progress)
                        .unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }

    /// Waits for every sync asked so far.
    pub(super) fn wait_all(&self) -> StoreResult<()> {
        self.wait(self.ticket())
    }

    /// As redb's `sync_data` asks one, without a thread to make it: a
    /// test then says when it has returned (`done_for_tests`).
    #[cfg(test)]
    pub(super) fn ask_for_tests(&self) -> u64 {
        let mut progress = self.progress();
        progress.asked += 1;
        progress.asked
    }

    #[cfg(test)]
    pub(super) fn done_for_tests(&self, ticket: u64) {
        self.progress().done = ticket;
        self.changed.notify_all();
    }
}

/// redb's storage: its own file backend, with `sync_data` handed to the
/// `berth-redb-sync` thread and every write ordered behind it.
#[derive(Debug)]
pub(super) struct SyncBehind {
    file: FileBackend,
    syncs: Arc<RedbSyncs>,
}

impl SyncBehind {
    /// Opens (or creates) `path` with its syncs behind, and starts its
    /// thread, which syncs through a second handle on the file (a sync
    /// through either makes the file's written bytes durable).
    pub(super) fn open(path: &std::path::Path) -> StoreResult<(SyncBehind, Arc<RedbSyncs>)> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let handle = file.try_clone()?;
        let syncs = Arc::new(RedbSyncs::default());
        let for_thread = syncs.clone();
        std::thread::Builder::new()
            .name("berth-redb-sync".into())
            .spawn(move || sync_loop(&handle, &for_thread))?;
        let file = FileBackend::new(file)?;
        Ok((
            SyncBehind {
                file,
                syncs: syncs.clone(),
            },
            syncs,
        ))
    }

    /// Waits until every sync asked so far has returned: nothing is
    /// written to the file before the commit it follows is durable.
    fn in_order(&self) -> std::io::Result<()> {
        let ticket = self.syncs.ticket();
        self.syncs
            .wait(ticket)
            .map_err(|e| std::io::Error::other(e.detail))
    }
}

/// The sync thread: one fdatasync covers every sync asked before it began.
fn sync_loop(file: &std::fs::File, syncs: &RedbSyncs) {
    let mut progress = syncs.progress();
    loop {
        if progress.failed.is_some() || (progress.closing && progress.asked == progress.done) {
            return;
        }
        if progress.asked == progress.done {
            progress = syncs
                .changed
                .wait(progress)
                .unwrap_or_else(|p| p.into_inner());
            continue;
        }
        let covers = progress.asked;
        drop(progress);
        // `redb.sync=sleep(ms)` holds each sync back (a slow disk: the
        // power-loss trials cut while a checkpoint is not durable yet);
        // `redb.sync=return(8)` fails the process's 8th.
        let synced = match crate::failpoints::hit("redb.sync", &sync_number().to_string()) {
            true => Err(std::io::Error::other("injected by the redb.sync failpoint")),
            false => file.sync_data(),
        };
        progress = syncs.progress();
        match synced {
            Ok(()) => progress.done = covers,
            Err(e) => progress.failed = Some(Failure::of(&e)),
        }
        syncs.changed.notify_all();
    }
}

/// This sync's number in the process (1 for the first), the subject of
/// the `redb.sync` failpoint.
fn sync_number() -> u64 {
    static SYNCS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    SYNCS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
}

impl Drop for SyncBehind {
    fn drop(&mut self) {
        // The thread ends once what was asked is synced.
        self.syncs.progress().closing = true;
        self.syncs.changed.notify_all();
    }
}

impl StorageBackend for SyncBehind {
    fn len(&self) -> std::io::Result<u64> {
        self.file.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.file.read(offset, out)
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.in_order()?;
        self.file.set_len(len)
    }

    fn sync_data(&self) -> std::io::Result<()> {
        let mut progress = self.syncs.progress();
        if let Some(failure) = &progress.failed {
            return Err(failure.io_error());
        }
        progress.asked += 1;
        drop(progress);
        self.syncs.changed.notify_all();
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.in_order()?;
        self.file.write(offset, data)
    }

    fn close(&self) -> std::io::Result<()> {
        // redb's last call: its clean-shutdown header is synced before the
        // file is let go.
        let waited = self.in_order();
        let closed = self.file.close();
        waited.and(closed)
    }

    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.file.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.file.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.lock_range(start, end)
    }

    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.unlock_range(start, end)
    }

    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.file.query_lock_range(start, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new, empty directory for one test.
    fn fresh(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("berth-behind-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_write_after_a_sync_waits_for_it_and_a_ticket_says_when_it_is_durable() {
        let dir = fresh("order");
        let (file, syncs) = SyncBehind::open(&dir.join("f")).unwrap();
        file.set_len(8192).unwrap();
        file.write(0, &[1u8; 4096]).unwrap();
        assert_eq!(
            syncs.state(syncs.ticket()),
            Synced::Durable,
            "nothing asked yet"
        );
        file.sync_data().unwrap();
        let ticket = syncs.ticket();
        assert_eq!(ticket, 1);
        // A write after the sync was asked returns only once it has.
        file.write(4096, &[2u8; 4096]).unwrap();
        assert_eq!(syncs.state(ticket), Synced::Durable);
        syncs.wait_all().unwrap();
        let mut back = [0u8; 4096];
        file.read(4096, &mut back).unwrap();
        assert_eq!(back, [2u8; 4096]);
        file.sync_data().unwrap();
        file.close().unwrap();
        assert_eq!(syncs.state(syncs.ticket()), Synced::Durable, "close waits");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failed_sync_latches_and_fails_every_later_write() {
        let syncs = RedbSyncs::default();
        syncs.progress().asked = 2;
        syncs.progress().failed = Some(Failure::of(&std::io::Error::from_raw_os_error(5)));
        assert!(matches!(syncs.state(1), Synced::Failed(_)));
        let e = syncs.wait(2).unwrap_err();
        assert!(e.detail.contains("Input/output error"), "{}", e.detail);
        assert_eq!(e.kind, super::super::StoreErrorKind::Io);
        // A full disk met behind the writer is told as one.
        syncs.progress().failed = Some(Failure::of(&std::io::Error::from_raw_os_error(28)));
        assert_eq!(
            syncs.wait(2).unwrap_err().kind,
            super::super::StoreErrorKind::DiskFull
        );
    }

    #[test]
    fn redb_commits_and_reopens_through_it() {
        let dir = fresh("redb");
        let path = dir.join("db.redb");
        const T: redb::TableDefinition<u64, u64> = redb::TableDefinition::new("t");
        {
            let (backend, syncs) = SyncBehind::open(&path).unwrap();
            let db = redb::Database::builder()
                .create_with_backend(backend)
                .unwrap();
            for i in 0..20u64 {
                let txn = db.begin_write().unwrap();
                txn.open_table(T).unwrap().insert(i, i * 2).unwrap();
                txn.commit().unwrap();
                assert!(syncs.ticket() > 0);
            }
            drop(db);
            assert_eq!(syncs.state(syncs.ticket()), Synced::Durable);
        }
        let db = redb::Database::create(&path).unwrap();
        use redb::{ReadableDatabase, ReadableTableMetadata};
        let n = db
            .begin_read()
            .unwrap()
            .open_table(T)
            .unwrap()
            .len()
            .unwrap();
        assert_eq!(n, 20);
        drop(db);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
