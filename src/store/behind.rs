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
//! - Order. Nothing written after a sync was asked reaches the file before
//!   that sync has returned, so nothing of the next commit (which may
//!   reuse pages the last durable one still needs, since redb takes the
//!   commit as durable) reaches the file before the commit it follows is
//!   durable. Up to that point a cut finds what a cut during redb's own
//!   fdatasync finds: the commit's pages written in any order, which
//!   redb's checksums and its secondary header slot already survive. A
//!   small write (`MAX_BYTES_BEHIND`) is queued behind the sync
//!   (`WriteBehind`): the sync thread makes it once that sync has returned
//!   and before the next sync, and reads see it meanwhile; a larger write,
//!   or a resize, waits here for every sync and queued write instead.
//!   The queue is what lets a checkpoint commit in two phases without
//!   waiting for its first sync: a quick-repair commit (below) writes its
//!   pages, asks a sync, then writes the header that makes them the
//!   primary, and that header must not reach the file before the pages
//!   are durable.
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
//! Quick repair. Every durable commit of a store held alone is a
//! quick-repair commit (`WriteTransaction::set_quick_repair`): redb saves
//! its allocator state in the commit and commits in two phases, so a
//! start after a crash loads that state instead of reading the whole file
//! to rebuild it and check every checksum (~0.6 s for a 350 MB store on
//! the development machine, and growing with the store; ~0.1 s with it:
//! docs/performance-history.md, fourteenth session).
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

use crate::locks::Held;
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
    /// Writes made while a sync was pending, oldest first: each reaches
    /// the file after the sync it follows has returned, and before the
    /// next sync.
    behind: std::collections::VecDeque<WriteBehind>,
    /// The bytes `behind` holds, at most `MAX_BYTES_BEHIND`.
    behind_bytes: usize,
}

/// A write queued behind a sync that had not returned (`Progress::behind`).
#[derive(Debug)]
struct WriteBehind {
    /// The `asked` count when it was made: the file gets it once `done`
    /// reaches this.
    after: u64,
    offset: u64,
    data: Vec<u8>,
}

/// The most bytes queued behind pending syncs; a write past it waits for
/// them instead. What is queued is a commit's header (redb writes a few
/// hundred bytes at offset 0 between the two syncs of a two-phase
/// commit), so this bounds the copy for the rare larger write, which then
/// costs the writer a wait as every write did before the queue.
const MAX_BYTES_BEHIND: usize = 64 * 1024;

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
        self.state.held()
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
        self.wait_until(|progress| progress.done >= ticket)
            .map_err(|failure| StoreError::from(failure.io_error()))
    }

    /// Waits until `ready` holds of the counts, or a sync has failed.
    fn wait_until(&self, ready: impl Fn(&Progress) -> bool) -> Result<(), Failure> {
        let mut progress = self.progress();
        loop {
            if let Some(failure) = &progress.failed {
                return Err(failure.clone());
            }
            if ready(&progress) {
                return Ok(());
            }
            progress = self
                .changed
                .wait(progress)
                .unwrap_or_else(|p| p.into_inner());
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
        let (behind, syncs, handle) = Self::open_without_thread(path)?;
        let for_thread = syncs.clone();
        std::thread::Builder::new()
            .name("berth-redb-sync".into())
            .spawn(move || sync_loop(&handle, &for_thread))?;
        Ok((behind, syncs))
    }

    /// The file, its syncs, and the second handle the sync thread syncs
    /// through (a test starts that thread when it chooses).
    fn open_without_thread(
        path: &std::path::Path,
    ) -> std::io::Result<(SyncBehind, Arc<RedbSyncs>, std::fs::File)> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let handle = file.try_clone()?;
        let syncs = Arc::new(RedbSyncs::default());
        let file = FileBackend::new(file).map_err(std::io::Error::other)?;
        Ok((
            SyncBehind {
                file,
                syncs: syncs.clone(),
            },
            syncs,
            handle,
        ))
    }

    /// Waits until every sync asked so far has returned and every write
    /// queued behind one is in the file: nothing is written to the file
    /// before the commit it follows is durable.
    fn in_order(&self) -> std::io::Result<()> {
        let ticket = self.syncs.ticket();
        self.syncs
            .wait_until(|progress| progress.done >= ticket && progress.behind.is_empty())
            .map_err(|failure| failure.io_error())
    }
}

/// Copies into `out` (the file's bytes from `offset`) what the queued
/// writes put there, in the order they were made.
fn overlay_behind(behind: &std::collections::VecDeque<WriteBehind>, offset: u64, out: &mut [u8]) {
    let end = offset + out.len() as u64;
    for write in behind {
        let write_end = write.offset + write.data.len() as u64;
        let (from, to) = (write.offset.max(offset), write_end.min(end));
        if from < to {
            let source = &write.data[(from - write.offset) as usize..(to - write.offset) as usize];
            out[(from - offset) as usize..(to - offset) as usize].copy_from_slice(source);
        }
    }
}

/// What the sync thread does next, from its counts alone (`next_step`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// A sync failed, or the file is closing with nothing left to do.
    End,
    /// Nothing asked, nothing queued.
    Wait,
    /// The oldest queued write: the sync it follows has returned.
    Write,
    /// One fdatasync for every sync asked up to `covers`, which stops at
    /// the first queued write (it must reach the file between the sync it
    /// follows and the next).
    Sync { covers: u64 },
}

fn next_step(progress: &Progress) -> Next {
    if progress.failed.is_some() {
        return Next::End;
    }
    if let Some(write) = progress.behind.front() {
        if write.after <= progress.done {
            return Next::Write;
        }
    }
    if progress.asked == progress.done {
        return match progress.closing {
            true => Next::End,
            false => Next::Wait,
        };
    }
    let covers = progress
        .behind
        .front()
        .map_or(progress.asked, |write| write.after);
    debug_assert!(covers > progress.done && covers <= progress.asked);
    Next::Sync { covers }
}

/// The sync thread: one fdatasync covers every sync asked before it
/// began, up to the first write queued behind one of them; a queued write
/// goes to the file once the sync it follows has returned.
fn sync_loop(file: &std::fs::File, syncs: &RedbSyncs) {
    use std::os::unix::fs::FileExt as _;
    let mut progress = syncs.progress();
    loop {
        let covers = match next_step(&progress) {
            Next::End => return,
            Next::Wait => {
                progress = syncs
                    .changed
                    .wait(progress)
                    .unwrap_or_else(|p| p.into_inner());
                continue;
            }
            Next::Write => {
                // Under the lock, so a read finds the write either in the
                // file or in the queue.
                if let Some(write) = progress.behind.pop_front() {
                    progress.behind_bytes -= write.data.len();
                    if let Err(e) = file.write_all_at(&write.data, write.offset) {
                        progress.failed = Some(Failure::of(&e));
                    }
                }
                syncs.changed.notify_all();
                continue;
            }
            Next::Sync { covers } => covers,
        };
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
        let progress = self.syncs.progress();
        if progress.behind.is_empty() {
            // Only redb's writer queues writes, and a read of bytes it is
            // writing at that moment is no read redb makes.
            drop(progress);
            return self.file.read(offset, out);
        }
        // Under the lock: the sync thread moves a write from the queue to
        // the file under it too.
        self.file.read(offset, out)?;
        overlay_behind(&progress.behind, offset, out);
        Ok(())
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
        let mut progress = self.syncs.progress();
        if let Some(failure) = &progress.failed {
            return Err(failure.io_error());
        }
        if progress.done == progress.asked && progress.behind.is_empty() {
            drop(progress);
            return self.file.write(offset, data);
        }
        if progress.behind_bytes + data.len() <= MAX_BYTES_BEHIND {
            let after = progress.asked;
            progress.behind_bytes += data.len();
            progress.behind.push_back(WriteBehind {
                after,
                offset,
                data: data.to_vec(),
            });
            return Ok(());
        }
        drop(progress);
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

    /// The rows of `table` in `db`.
    fn rows_of(db: &redb::Database, table: redb::TableDefinition<u64, u64>) -> u64 {
        use redb::{ReadableDatabase, ReadableTableMetadata};
        db.begin_read()
            .unwrap()
            .open_table(table)
            .unwrap()
            .len()
            .unwrap()
    }

    /// A new, empty directory for one test.
    fn fresh(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("berth-behind-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_write_behind_a_pending_sync_reads_back_at_once_and_reaches_the_file_after_that_sync() {
        let dir = fresh("order");
        let path = dir.join("f");
        let (file, syncs, handle) = SyncBehind::open_without_thread(&path).unwrap();
        file.set_len(8192).unwrap();
        // Nothing asked: straight to the file.
        file.write(0, &[1u8; 4096]).unwrap();
        assert_eq!(std::fs::read(&path).unwrap()[..4096], [1u8; 4096]);
        assert_eq!(
            syncs.state(syncs.ticket()),
            Synced::Durable,
            "nothing asked yet"
        );
        // A sync asked, and no thread to make it yet: the next write
        // returns at once, queued behind it.
        file.sync_data().unwrap();
        let first = syncs.ticket();
        assert_eq!(first, 1);
        file.write(100, &[2u8; 50]).unwrap();
        assert_eq!(syncs.state(first), Synced::Pending);
        assert_eq!(
            std::fs::read(&path).unwrap()[100],
            1,
            "a write reached the file before the sync it follows"
        );
        // A read sees it, over the file's bytes around it.
        let mut back = [0u8; 200];
        file.read(0, &mut back).unwrap();
        assert_eq!(back[..100], [1u8; 100]);
        assert_eq!(back[100..150], [2u8; 50]);
        assert_eq!(back[150..], [1u8; 50]);
        // The commit's second sync covers it once the thread has run.
        file.sync_data().unwrap();
        let second = syncs.ticket();
        let for_thread = syncs.clone();
        let thread = std::thread::spawn(move || sync_loop(&handle, &for_thread));
        syncs.wait(second).unwrap();
        assert_eq!(std::fs::read(&path).unwrap()[100..150], [2u8; 50]);
        // Past the queue's bound a write waits for the syncs instead.
        file.set_len((2 * MAX_BYTES_BEHIND) as u64).unwrap();
        file.sync_data().unwrap();
        file.write(0, &vec![3u8; MAX_BYTES_BEHIND + 1]).unwrap();
        assert_eq!(syncs.state(syncs.ticket()), Synced::Durable);
        assert_eq!(std::fs::read(&path).unwrap()[MAX_BYTES_BEHIND], 3);
        file.sync_data().unwrap();
        file.close().unwrap();
        assert_eq!(syncs.state(syncs.ticket()), Synced::Durable, "close waits");
        drop(file);
        thread.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The thread's order, from its counts: a queued write goes between
    /// the sync it follows and the next, never into one fdatasync with
    /// both.
    #[test]
    fn the_sync_thread_syncs_up_to_a_queued_write_then_writes_it_then_syncs_the_rest() {
        let queued = |after: u64| WriteBehind {
            after,
            offset: 0,
            data: vec![0; 8],
        };
        let mut p = Progress::default();
        assert_eq!(next_step(&p), Next::Wait);
        p.asked = 2;
        p.behind.push_back(queued(1));
        assert_eq!(next_step(&p), Next::Sync { covers: 1 });
        p.done = 1;
        assert_eq!(next_step(&p), Next::Write);
        p.behind.clear();
        assert_eq!(next_step(&p), Next::Sync { covers: 2 });
        p.done = 2;
        assert_eq!(next_step(&p), Next::Wait);
        // A write queued with no sync asked after it still goes out.
        p.behind.push_back(queued(2));
        assert_eq!(next_step(&p), Next::Write);
        p.behind.clear();
        p.closing = true;
        assert_eq!(next_step(&p), Next::End);
        p.closing = false;
        p.asked = 3;
        p.failed = Some(Failure::of(&std::io::Error::from_raw_os_error(5)));
        assert_eq!(next_step(&p), Next::End, "a failed sync ends the thread");
    }

    /// What quick repair buys through this backend: a copy of the file
    /// taken when a commit is durable (as a power cut would leave it)
    /// opens without redb reading the whole file to repair it. Without
    /// quick repair the same copy needs that repair (the control).
    #[test]
    fn a_crash_image_of_quick_repair_commits_opens_without_a_full_repair() {
        const T: redb::TableDefinition<u64, u64> = redb::TableDefinition::new("t");
        for quick in [true, false] {
            let dir = fresh(&format!("quick-{quick}"));
            let path = dir.join("db.redb");
            let image = dir.join("image.redb");
            let (backend, syncs) = SyncBehind::open(&path).unwrap();
            let db = redb::Database::builder()
                .create_with_backend(backend)
                .unwrap();
            for i in 0..20u64 {
                let mut txn = db.begin_write().unwrap();
                txn.set_quick_repair(quick);
                txn.open_table(T).unwrap().insert(i, i * 2).unwrap();
                txn.commit().unwrap();
            }
            syncs.wait_all().unwrap();
            // The live file's bytes, as a cut now would leave them.
            std::fs::copy(&path, &image).unwrap();
            drop(db);
            let repaired = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let seen = repaired.clone();
            let mut builder = redb::Database::builder();
            builder.set_repair_callback(move |_| {
                seen.store(true, std::sync::atomic::Ordering::Relaxed)
            });
            let reopened = builder.open(&image).unwrap();
            assert_eq!(
                rows_of(&reopened, T),
                20,
                "a durable commit is missing from the image"
            );
            assert_eq!(
                repaired.load(std::sync::atomic::Ordering::Relaxed),
                !quick,
                "quick repair {quick}: a full repair ran (true) or not (false)"
            );
            drop(reopened);
            let _ = std::fs::remove_dir_all(&dir);
        }
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
        assert_eq!(rows_of(&db, T), 20);
        drop(db);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
