//! redb's file with its writes and syncs made behind the writer: a
//! checkpoint's durable commit returns once redb has handed over its pages
//! (kept here, in memory, `Progress::pending`), and a thread of its own
//! (`berth-redb-sync`) writes them to the file and makes them durable
//! while the writer runs the next batch.
//!
//! Why it exists: a checkpoint held the writer for redb's fdatasync of the
//! pages it wrote (about 1.6 ms of a 3.8 ms checkpoint at 32 connections)
//! and for the writes themselves (one `pwrite` per page, most of the
//! rest), and every write queued behind it; a submit that met one waited
//! it out.
//! The redo log already holds every row the checkpoint commits, so the
//! checkpoint does not need to be durable when it returns, only before the
//! log is written over (`redo::RedoLog::checkpointed`).
//!
//! What keeps it as safe as redb's own sync (a cut may come anywhere):
//! - Reads. A page handed over and not yet written is read from here
//!   (`SyncBehind::read` lays it over what the file holds), so every read
//!   sees every write before it, as a file would.
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
//! - Failure. A sync that fails latches: every later write, resize or sync
//!   fails, so the writer's next checkpoint fails and the store is reopened
//!   from the log, as after any failed checkpoint.
//! - The end. `close` (redb's last call, when the store is dropped) waits
//!   for the sync of redb's clean-shutdown header, so a stopped store is
//!   durable when `Store::close` returns.
//!
//! Only a store held alone (`Sharing::Exclusive`) is opened so: there the
//! redo log exists, and no other process reads the file between a commit
//! and its sync.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::os::unix::fs::FileExt;
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

/// How far the syncs asked of one file have come, and the writes kept
/// for the next one.
#[derive(Debug, Default)]
struct Progress {
    /// Syncs asked for so far (redb's `sync_data` calls).
    asked: u64,
    /// The `asked` count the last sync that returned covered.
    done: u64,
    /// Why a sync (or a write it made) failed; once set, every later call
    /// fails.
    failed: Option<Failure>,
    /// The file is closing: the thread ends once it has synced what was
    /// asked.
    closing: bool,
    /// Writes handed over and not yet on the file, by offset: filled by
    /// redb between two syncs (no sync is in flight meanwhile: a write
    /// waits for the last one), written and synced by the thread, and
    /// cleared when that sync returns. They never overlap one another.
    pending: BTreeMap<u64, Arc<[u8]>>,
    /// Their bytes, at most `MAX_PENDING_BYTES`.
    pending_bytes: usize,
    /// The longest of them, so a read finds those that overlap it.
    longest: u64,
}

/// Bytes of writes kept in memory between two syncs, at most; past it a
/// write goes to the file at once (behind the ones kept). A checkpoint
/// hands over the pages it dirtied, about 4 MiB at 32 connections (50 ms
/// of ~2.8 pages a submit); this leaves room for a much larger one and
/// bounds what a huge one (an import's) holds in memory.
const MAX_PENDING_BYTES: usize = 64 << 20;

/// How a write meets those already kept.
#[derive(Debug, PartialEq, Eq)]
enum Meets {
    /// It overlaps none, or replaces one of the same place and length.
    Fits,
    /// It overlaps one partly: the kept ones are written first.
    Overlaps,
}

impl Progress {
    /// The kept writes that overlap `offset..end`.
    fn overlapping(&self, offset: u64, end: u64) -> impl Iterator<Item = (&u64, &Arc<[u8]>)> {
        let from = offset.saturating_sub(self.longest);
        self.pending
            .range(from..end)
            .filter(move |(start, bytes)| **start + bytes.len() as u64 > offset)
    }

    fn meets(&self, offset: u64, len: usize) -> Meets {
        let end = offset + len as u64;
        match self
            .overlapping(offset, end)
            .all(|(start, bytes)| *start == offset && bytes.len() == len)
        {
            true => Meets::Fits,
            false => Meets::Overlaps,
        }
    }

    /// Writes every kept write to `file`, in the order of their places.
    fn write_out(&mut self, file: &std::fs::File) -> std::io::Result<()> {
        for (start, bytes) in &self.pending {
            file.write_all_at(bytes, *start)?;
        }
        self.forget_written();
        Ok(())
    }

    fn forget_written(&mut self) {
        self.pending.clear();
        self.pending_bytes = 0;
        self.longest = 0;
    }
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

/// A failed sync or write of the thread, kept with its kind, so a full
/// disk met behind the writer is still told as one (`StoreErrorKind::DiskFull`).
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
            format!(
                "an earlier write or sync of the store file failed: {}",
                self.why
            ),
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
            (Some(why), _) => Synced::Failed(why.clone()),
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
    /// A second handle on the file, for writes made here rather than
    /// through redb's backend (the kept ones, when they must go at once).
    handle: std::fs::File,
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
        let for_thread_file = file.try_clone()?;
        let handle = file.try_clone()?;
        let syncs = Arc::new(RedbSyncs::default());
        let for_thread = syncs.clone();
        std::thread::Builder::new()
            .name("berth-redb-sync".into())
            .spawn(move || sync_loop(&for_thread_file, &for_thread))?;
        let file = FileBackend::new(file)?;
        Ok((
            SyncBehind {
                file,
                handle,
                syncs: syncs.clone(),
            },
            syncs,
        ))
    }

    /// Waits until every sync asked so far has returned (nothing is
    /// written to the file before the commit it follows is durable), and
    /// holds the progress from there.
    fn in_order(&self) -> std::io::Result<MutexGuard<'_, Progress>> {
        let mut progress = self.syncs.progress();
        loop {
            match RedbSyncs::of(&progress, progress.asked) {
                Synced::Durable => return Ok(progress),
                Synced::Failed(failure) => return Err(failure.io_error()),
                Synced::Pending => {
                    progress = self
                        .syncs
                        .changed
                        .wait(progress)
                        .unwrap_or_else(|p| p.into_inner());
                }
            }
        }
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
        // No write is kept meanwhile (a write waits for this sync), so
        // these are all there are until it returns.
        let batch: Vec<(u64, Arc<[u8]>)> = progress
            .pending
            .iter()
            .map(|(start, bytes)| (*start, bytes.clone()))
            .collect();
        drop(progress);
        let written = batch
            .iter()
            .try_for_each(|(start, bytes)| file.write_all_at(bytes, *start));
        // `redb.sync=sleep(ms)` holds each sync back (a slow disk: the
        // power-loss trials cut while a checkpoint is not durable yet);
        // `redb.sync=return(8)` fails the process's 8th.
        let synced = written.and_then(|()| {
            match crate::failpoints::hit("redb.sync", &sync_number().to_string()) {
                true => Err(std::io::Error::other("injected by the redb.sync failpoint")),
                false => file.sync_data(),
            }
        });
        let mut now = syncs.progress();
        match synced {
            Ok(()) => {
                now.forget_written();
                now.done = covers;
            }
            Err(e) => now.failed = Some(Failure::of(&e)),
        }
        syncs.changed.notify_all();
        drop(now);
        // The pages' last references: freed here, not under the lock
        // readers take.
        drop(batch);
        progress = syncs.progress();
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
        let end = offset + out.len() as u64;
        // Taken before the file is read: one written and forgotten
        // meanwhile is in the file by then, and laid over it the same.
        let kept: Vec<(u64, Arc<[u8]>)> = {
            let progress = self.syncs.progress();
            progress
                .overlapping(offset, end)
                .map(|(start, bytes)| (*start, bytes.clone()))
                .collect()
        };
        self.file.read(offset, out)?;
        for (start, bytes) in kept {
            let from = start.max(offset);
            let to = (start + bytes.len() as u64).min(end);
            out[(from - offset) as usize..(to - offset) as usize]
                .copy_from_slice(&bytes[(from - start) as usize..(to - start) as usize]);
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        // The kept writes go first: a shorter file must not grow again
        // when they land, and a longer one takes them as it is.
        let mut progress = self.in_order()?;
        progress.write_out(&self.handle)?;
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
        let mut progress = self.in_order()?;
        let keep = progress.pending_bytes + data.len() <= MAX_PENDING_BYTES;
        match (keep, progress.meets(offset, data.len())) {
            (true, Meets::Fits) => {
                let replaced = progress.pending.insert(offset, Arc::from(data));
                progress.pending_bytes += data.len();
                progress.pending_bytes -= replaced.map_or(0, |r| r.len());
                progress.longest = progress.longest.max(data.len() as u64);
                Ok(())
            }
            // Rare: the kept writes land first, then this one, in order.
            (false, _) | (true, Meets::Overlaps) => {
                progress.write_out(&self.handle)?;
                self.handle.write_all_at(data, offset)
            }
        }
    }

    fn close(&self) -> std::io::Result<()> {
        // redb's last call: its clean-shutdown header is synced before the
        // file is let go (and anything kept since, which there should not
        // be, is written and synced too).
        let kept = self.in_order().and_then(|mut progress| {
            if progress.pending.is_empty() {
                return Ok(());
            }
            progress.write_out(&self.handle)?;
            self.handle.sync_data()
        });
        let closed = self.file.close();
        kept.and(closed)
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

    /// A write kept in memory is read back before it reaches the file,
    /// laid over the file's bytes where it overlaps a read partly; one
    /// that overlaps a kept one partly sends the kept ones first; a sync
    /// writes them all.
    #[test]
    fn kept_writes_are_read_back_and_land_with_the_sync() {
        let dir = fresh("kept");
        let path = dir.join("f");
        let (file, syncs) = SyncBehind::open(&path).unwrap();
        file.set_len(4 * 4096).unwrap();
        file.write(4096, &[7u8; 4096]).unwrap();
        assert_eq!(std::fs::read(&path).unwrap()[4096], 0, "kept, not written");
        let mut back = [0u8; 8192];
        file.read(2048, &mut back).unwrap();
        assert!(back[..2048].iter().all(|b| *b == 0));
        assert!(back[2048..6144].iter().all(|b| *b == 7));
        assert!(back[6144..].iter().all(|b| *b == 0));
        // Replaced in place, then one that overlaps it partly.
        file.write(4096, &[8u8; 4096]).unwrap();
        file.write(6144, &[9u8; 4096]).unwrap();
        let on_file = std::fs::read(&path).unwrap();
        assert_eq!((on_file[4096], on_file[6144], on_file[8192]), (8, 9, 9));
        file.write(12288, &[5u8; 4096]).unwrap();
        file.sync_data().unwrap();
        syncs.wait_all().unwrap();
        let on_file = std::fs::read(&path).unwrap();
        assert_eq!(on_file[12288], 5, "the sync wrote what was kept");
        assert!(syncs.progress().pending.is_empty());
        file.close().unwrap();
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
