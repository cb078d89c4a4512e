//! The store: the only code that touches redb.
//!
//! Writes go through one writer thread that group-commits: every write job
//! queued while the previous commit was in flight runs in the next single
//! transaction, which commits (fsync) once. Concurrent requests so share the
//! cost of an fsync, and each job still sees the writes of the jobs before it.
//! A lone job on an idle store (a redo log, nothing queued, nothing in
//! flight) runs the same procedure on its caller's thread instead, under
//! the same lock (`Store::run_here_if_idle`): two thread hand-overs fewer.
//! A job must check before it writes: a job that returns a domain refusal
//! must not have written anything. A storage error aborts the whole batch;
//! the batch's other jobs then run again, each alone.
//!
//! Reads use redb read transactions on the caller's thread (MVCC snapshots).
//!
//! # The store's operations
//!
//! What the engine (and, through the engine, the HTTP layer) may do with
//! the store, and so what a second engine behind it (cluster mode's
//! PostgreSQL) must offer; everything else here is the redb side's own:
//!
//! - `Store::write(job)` / `write_with(urgency, job)`: runs `job` over
//!   typed tables (`Tx`: one method per row kind) in one transaction with
//!   other jobs of its batch, and answers once that transaction is
//!   durable. A job checks before it writes (a refusal writes nothing)
//!   and may run twice (alone, when its batch failed for another job).
//! - `Tx::after_commit(hook)`: work (publishing events) run after the
//!   transaction is durable, in commit order.
//! - `Store::read()` -> `Rx`, and `Lookup` on it: reads at one instant,
//!   seeing every write answered before; `Store::reader()`, a handle that
//!   can only read (what the layers above hold).
//! - `Store::close()`: the last durable commit at shutdown.
//!
//! The redo log, its checkpoints, the overlay, the snapshot socket and
//! the layout migrations are the redb side's and private to it.

mod audit;
mod blocks;
mod codec;
pub mod compress;
pub mod dump;
mod error;
mod layout;
pub mod location;
mod logged;
pub mod logs;
mod lookup;
mod records;
pub mod redo;
mod rx;
mod snapshot;
pub mod tables;
mod tx;
pub mod upstream;
mod view;
mod writer;

use crate::locks::{Held, HeldRw};
pub use audit::{AuditLookup, Pruned, ReadOnlyStore, StoredNodes};
pub use error::{StoreError, StoreErrorKind, StoreResult};
pub use lookup::Lookup;
pub use records::{
    ChunkPlace, DeliveryRecord, DeliveryStatus, IdempotencyIdentity, IdempotencyRecord,
    PendingCallback, Principal, StoredEvent, WebhookRecord,
};
pub use redo::Urgency;
pub use rx::Rx;
pub use snapshot::Scope as SnapshotScope;
pub use tx::Tx;
pub use writer::Hook;
use writer::{
    open_and_replay, pause_for_reopen, writer_loop, Place, Shared, WriteJob, READ_WAIT_ATTEMPTS,
};

use std::path::Path;
use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable, WriteTransaction};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use tables::*;

/// How long `close` waits for the last holder of the handle.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

pub use layout::LAYOUT_VERSION;
/// The exit code of a replica whose file may no longer match the store's
/// database (a commit's answer lost, a local write failed after the
/// database's commit): its next start loads the store again.
pub const EXIT_STORE_IN_DOUBT: i32 = 75;
/// Write jobs waiting for the writer thread before `write` waits for room.
const WRITE_QUEUE_DEPTH: usize = 4096;
/// Jobs folded into one transaction at most, to bound commit latency.
pub(crate) const MAX_JOBS_PER_COMMIT: usize = 256;

/// How the store file is shared with other processes while berth holds it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sharing {
    /// `berth audit verify`, `push-head` and `export` may read the live
    /// file from their own processes (redb's `SingleWriter`). redb then
    /// commits in two phases: two fdatasyncs per commit. `berth serve
    /// --shared-store`; the default of `Store::open` (tests, tools).
    #[default]
    LiveReaders,
    /// This process alone (redb's `ExclusiveWriter`, a whole-file lock):
    /// a commit is an append to the redo log and one fdatasync (`redo`),
    /// with a checkpoint at most `checkpoint_every` apart; the readers
    /// above read a snapshot this process copies for them (`snapshot`).
    /// `berth serve`'s default.
    Exclusive {
        checkpoint_every: std::time::Duration,
    },
}

/// The memory redb may hold of the store file's pages: the pages it read
/// (its cache) and those written since the last checkpoint (its write
/// buffer, at most half of it; pages past that are written to the file at
/// once, to free space the checkpoint's commit then covers).
/// `berth serve --cache-size`.
///
/// Why bounded: redb's own default is 1 GiB, and it keeps every page read
/// or written until it holds that much, so berth's memory followed its
/// store file. The hot pages (the B-trees' upper levels, the latest
/// leaves) are a few MiB (`benches/submit.rs` compares sizes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheSize(usize);

impl CacheSize {
    pub const DEFAULT: CacheSize = CacheSize(64 << 20);
    /// Below this, every page a write touches goes to the file at once.
    pub const MIN_BYTES: u64 = 1 << 20;
    /// More than any machine berth is for; refuses a unit or zeros typed
    /// by mistake rather than letting the cache take the machine.
    pub const MAX_BYTES: u64 = 64 << 30;

    /// `bytes`, within `MIN_BYTES..=MAX_BYTES`.
    pub fn of_bytes(bytes: u64) -> Option<CacheSize> {
        if !(Self::MIN_BYTES..=Self::MAX_BYTES).contains(&bytes) {
            return None;
        }
        usize::try_from(bytes).ok().map(CacheSize)
    }

    pub fn bytes(self) -> usize {
        self.0
    }
}

/// A redb builder for berth's store file: `mode`, and a page cache bounded
/// by `cache`. Every open of the store file goes through here, so none
/// gets redb's own default of 1 GiB (`CacheSize`).
///
/// It also says when redb repairs the file the slow way: after a crash
/// whose last commit saved no allocator state (`--shared-store`, or a
/// store last written by a berth before quick repair), redb
/// reads the whole file to rebuild it, and a large store takes a while.
pub(crate) fn redb_builder(mode: redb::ConcurrencyMode, cache: CacheSize) -> redb::Builder {
    let mut builder = redb::Database::builder();
    builder.set_concurrency_mode(mode);
    builder.set_cache_size(cache.bytes());
    let told = std::sync::atomic::AtomicBool::new(false);
    builder.set_repair_callback(move |_| {
        if !told.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!("{FULL_REPAIR_WARNING}");
        }
    });
    builder
}

/// What berth logs when redb repairs the store file by reading all of it
/// (`redb_builder`).
pub const FULL_REPAIR_WARNING: &str = "the store file was not closed cleanly and holds no \
    saved allocator state: reading all of it to repair it (a large store takes a while)";

impl Sharing {
    pub(crate) fn mode(self) -> redb::ConcurrencyMode {
        match self {
            Sharing::LiveReaders => redb::ConcurrencyMode::SingleWriter,
            Sharing::Exclusive { .. } => redb::ConcurrencyMode::ExclusiveWriter,
        }
    }
}

/// A handle on the store that only reads: what the layers above the
/// engine hold (a stream's replay, a log or SBOM read on the blocking
/// pool), so no write reaches the store but through the engine.
#[derive(Clone)]
pub struct Reader(Store);

impl Reader {
    /// A reader at one instant (`Store::read`).
    pub fn read(&self) -> StoreResult<Rx> {
        self.0.read()
    }
}

#[derive(Clone)]
pub struct Store {
    shared: Arc<Shared>,
    writer: mpsc::Sender<WriteJob>,
    /// The thread answering snapshot requests (a store held alone); it
    /// stops when the last clone is dropped, or at `close`.
    snapshots: Arc<std::sync::Mutex<Option<snapshot::SnapshotServer>>>,
}

impl Store {
    /// Opens (or creates) the store, readable live by other processes, and
    /// starts its writer thread.
    pub fn open(path: &Path) -> StoreResult<Store> {
        Store::open_shared(path, Sharing::LiveReaders)
    }

    /// As `open`, sharing the file as `sharing` says.
    pub fn open_shared(path: &Path, sharing: Sharing) -> StoreResult<Store> {
        Store::open_with_cache(path, sharing, CacheSize::DEFAULT)
    }

    /// As `open_shared`, with redb holding at most `cache` of the file's
    /// pages in memory.
    pub fn open_with_cache(path: &Path, sharing: Sharing, cache: CacheSize) -> StoreResult<Store> {
        Store::open_behind(path, sharing, cache, None)
    }

    /// As `open_with_cache`, each batch committed to the store's database
    /// first when `upstream` is given, with the lease that says how long
    /// this replica surely leads (cluster mode, `upstream.rs`).
    pub fn open_behind(
        path: &Path,
        sharing: Sharing,
        cache: CacheSize,
        upstream: Option<(upstream::Upstream, Arc<upstream::Freshness>)>,
    ) -> StoreResult<Store> {
        let (db, resume) = open_replayed(path, sharing, cache)?;
        init_schema(&db)?;
        let redo = match sharing {
            // redb commits non-durably only when no other process may
            // read the file (`redo.rs`).
            Sharing::Exclusive { checkpoint_every } => {
                Some(std::sync::Mutex::new(redo::RedoLog::open(
                    &redo::path_of(path),
                    resume,
                    LAYOUT_VERSION,
                    checkpoint_every,
                )?))
            }
            Sharing::LiveReaders => None,
        };
        let shared = Arc::new(Shared {
            path: path.to_path_buf(),
            db: std::sync::RwLock::new(Some(Arc::new(db))),
            read_only: std::sync::RwLock::new(None),
            closed: std::sync::atomic::AtomicBool::new(false),
            sharing,
            cache,
            redo,
            lease: upstream.as_ref().map(|(_, lease)| lease.clone()),
            upstream: upstream.map(|(up, _)| std::sync::Mutex::new(up)),
            turn: std::sync::Mutex::new(writer::Turn::new()),
            lone_batches_in_a_row: std::sync::atomic::AtomicU32::new(writer::QUIET_BATCHES),
        });
        // Readers in other processes cannot open a file held alone: they
        // ask for a snapshot (`snapshot.rs`), read from the live handle.
        let snapshots = match sharing {
            Sharing::Exclusive { .. } => {
                let weak = Arc::downgrade(&shared);
                snapshot::serve(
                    move || {
                        let shared = weak.upgrade().ok_or_else(StoreError::closed)?;
                        let db = shared.current().ok_or_else(StoreError::reopening)?;
                        shared.begin_read(&db)
                    },
                    path,
                )
            }
            Sharing::LiveReaders => None,
        };
        let (tx, rx) = mpsc::channel::<WriteJob>(WRITE_QUEUE_DEPTH);
        let writer_shared = shared.clone();
        std::thread::Builder::new()
            .name("berth-store-writer".into())
            .spawn(move || writer_loop(writer_shared, rx))
            .map_err(|e| StoreError {
                kind: StoreErrorKind::Other,
                detail: e.to_string(),
            })?;
        Ok(Store {
            shared,
            writer: tx,
            snapshots: Arc::new(std::sync::Mutex::new(snapshots)),
        })
    }

    /// Runs `job` inside the next group commit and returns its value once the
    /// commit is durable. The job must not write when it returns a refusal.
    /// It may run twice (a second time alone, when its batch failed because
    /// of another job), so it captures what it needs by clone or reference.
    pub async fn write<T, F>(&self, job: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnMut(&Tx) -> StoreResult<T> + Send + 'static,
    {
        self.write_with(Urgency::May, job).await
    }

    /// As `write`, for a commit that must land for nothing to stay stuck
    /// (a build's final commit, a restart's recovery): on a full disk it may
    /// take the redo log's reserve (`redo::RESERVED_BYTES`).
    pub async fn write_with<T, F>(&self, urgency: Urgency, mut job: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnMut(&Tx) -> StoreResult<T> + Send + 'static,
    {
        let (done_tx, done_rx) = oneshot::channel::<StoreResult<T>>();
        let kept: Arc<std::sync::Mutex<Option<StoreResult<T>>>> = Arc::default();
        let keep = kept.clone();
        let run = Box::new(move |tx: &Tx| {
            let result = job(tx);
            let failure = result.as_ref().err().cloned();
            *keep.held() = Some(result);
            failure
        });
        let finish = Box::new(move |error: Option<StoreError>| {
            let outcome = match error {
                Some(e) => Err(e),
                None => kept.held().take().unwrap_or_else(|| {
                    Err(StoreError::other("a write job finished without running"))
                }),
            };
            let _ = done_tx.send(outcome);
        });
        let job = WriteJob {
            run,
            urgency,
            finish,
        };
        if let Some(job) = self.run_here_if_idle(job) {
            self.writer
                .send(job)
                .await
                .map_err(|_| StoreError::closed())?;
        }
        done_rx.await.map_err(|_| StoreError::closed())?
    }

    /// Runs `job` as a batch of its own on this thread when the store is
    /// idle: a redo log, nothing queued for the writer thread, a healthy
    /// handle, no batch running, and the last batches lone jobs too
    /// (`Shared::lone_batches_in_a_row`). Gives it back otherwise, for the
    /// write queue.
    ///
    /// Why: a lone submit handed to the writer thread and answered back
    /// is two thread hand-overs, which cost about as much as the work
    /// between them (`benches/submit.rs` at one connection). The batch is
    /// the writer's own procedure (`writer::run_batch`) under the same
    /// lock, so commit order, the log's record and the hooks are as they
    /// would be there. A job that finds a checkpoint due goes to the
    /// writer thread, which makes it right after that job's batch.
    fn run_here_if_idle(&self, job: WriteJob) -> Option<WriteJob> {
        // A batch for the store's database blocks on its own runtime,
        // which a caller's async worker must not do: the writer runs it.
        let quiet = self.shared.redo.is_some()
            && self.shared.upstream.is_none()
            && self
                .shared
                .lone_batches_in_a_row
                .load(std::sync::atomic::Ordering::Relaxed)
                >= writer::QUIET_BATCHES
            && self.writer.capacity() == self.writer.max_capacity();
        if !quiet {
            return Some(job);
        }
        let mut turn = match self.shared.turn.try_lock() {
            Ok(turn) => turn,
            Err(std::sync::TryLockError::WouldBlock) => return Some(job),
            // A batch panicked outside its jobs while holding it; the
            // state is whole (its fields are replaced, never half-set).
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        };
        let idle = self.shared.current().is_some()
            // The checkpoint is made right after the batch that finds it
            // due, on the writer thread, while its answer travels.
            && self
                .shared
                .redo_log()
                .is_some_and(|log| !turn.checkpoint_due(&log));
        if !idle {
            return Some(job);
        }
        writer::run_batch(
            &self.shared,
            &mut turn,
            vec![job],
            Place::Caller(&self.writer),
        );
        None
    }

    /// A handle that can only read.
    pub fn reader(&self) -> Reader {
        Reader(self.clone())
    }

    /// Writes every row to the store's database, replacing what it held:
    /// a new cluster's first start, an import, a layout migrated at open
    /// (`upstream.rs`). Nothing to do for a store without one.
    pub fn upload_all(&self) -> StoreResult<()> {
        let Some(upstream) = &self.shared.upstream else {
            return Ok(());
        };
        let rx = self.read()?;
        upstream.held().replace_all(&rx)
    }

    /// With a store in PostgreSQL: how long this replica surely leads,
    /// which its lease keeper extends (`upstream::Freshness`).
    pub fn lease(&self) -> Option<Arc<upstream::Freshness>> {
        self.shared.lease.clone()
    }

    /// Writes every row to `upstream` (which holds a lease), replacing
    /// what it held: `berth import --store`.
    pub fn upload_all_to(&self, upstream: &mut upstream::Upstream) -> StoreResult<()> {
        let rx = self.read()?;
        upstream.replace_all(&rx)
    }

    pub fn read(&self) -> StoreResult<Rx> {
        if self.shared.lease.as_ref().is_some_and(|l| !l.holds()) {
            return Err(StoreError::unreachable(
                "this replica cannot confirm it still leads (the store's database is unreachable); nothing was read",
            ));
        }
        // A reopen after an I/O error takes some milliseconds: a read waits
        // for it rather than failing.
        for _ in 0..READ_WAIT_ATTEMPTS {
            if let Some(db) = self.shared.current() {
                return self.shared.begin_read(&db);
            }
            let ro = self.shared.read_only.read_held().clone();
            if let Some(ro) = ro {
                return Ok(Rx {
                    txn: ro.begin_read()?,
                });
            }
            pause_for_reopen();
        }
        Err(StoreError::reopening())
    }

    /// Closes the file cleanly at shutdown, so a reader (`berth audit
    /// verify`) can open it afterwards without a repair. Waits up to
    /// `CLOSE_WAIT` for a commit or read still holding the handle; every
    /// write after this fails with a closed-store error.
    pub fn close(&self) -> StoreResult<()> {
        // No batch starts from here on (the writer checks under the log's
        // lock, which the checkpoint below takes): one after the last
        // checkpoint would leave rows only the log holds, and a write
        // transaction that keeps redb from closing the file, so the next
        // export or import would find a store that was not stopped cleanly.
        self.shared
            .closed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // Everything the redo log holds goes into the file, so a reader
        // after the stop sees all of it and the next start replays nothing.
        if let Err(e) = self.shared.checkpoint() {
            tracing::error!(error = %e, "the last checkpoint failed; the next start applies the redo log");
        }
        // The lease goes to a standby at once (the writer takes no batch
        // any more, so the fence is not needed).
        if let (Some(lease), Some(upstream)) = (&self.shared.lease, &self.shared.upstream) {
            lease.end();
            // Its connection blocks on a runtime of its own, which an
            // async worker (the caller, at shutdown) must not do.
            let released = std::thread::scope(|s| s.spawn(|| upstream.held().release()).join());
            match released {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot give the lease up; a standby takes over once it passes")
                }
                Err(_) => tracing::error!(
                    "giving the lease up panicked; a standby takes over once it passes"
                ),
            }
        }
        // Readers open the file itself from here on.
        drop(self.snapshots.held().take());
        let mut db = self.shared.db.write_held().take();
        let deadline = std::time::Instant::now() + CLOSE_WAIT;
        while let Some(handle) = db {
            match Arc::try_unwrap(handle) {
                Ok(database) => return database.close().map_err(StoreError::from),
                Err(shared) if std::time::Instant::now() < deadline => {
                    db = Some(shared);
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(_) => return Err(StoreError::other("the store is still in use at shutdown")),
            }
        }
        Ok(())
    }

    /// Bytes the store file takes on disk.
    pub fn file_size(path: &Path) -> u64 {
        std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
    }
}

/// Opens the file with its redo log applied. Whatever mode wrote a redo
/// log last, its acknowledged rows go into the file before anything reads
/// it: durably where the disk allows; on a full one a store held alone
/// keeps them in the log until a checkpoint can write them (redb refuses
/// every call after a failed commit: the file is opened again).
fn open_replayed(
    path: &Path,
    sharing: Sharing,
    cache: CacheSize,
) -> StoreResult<(Database, redo::Resume)> {
    match open_and_replay(path, sharing, cache, redo::Replay::Checkpoint) {
        Ok(opened) => Ok(opened),
        Err(e)
            if e.kind == StoreErrorKind::DiskFull
                && matches!(sharing, Sharing::Exclusive { .. }) =>
        {
            tracing::warn!(error = %e, "cannot checkpoint the redo log at open (disk full); it stays the store's truth until a checkpoint can");
            open_and_replay(path, sharing, cache, redo::Replay::KeepLog)
        }
        Err(e) => Err(e),
    }
}

fn init_schema(db: &Database) -> StoreResult<()> {
    layout::open_layout(db)
}

/// The seq a `DEPLOYMENT_ROWS` key's number holds (an event's or an audit
/// event's: u64, stored widened).
fn row_seq(number: u128) -> StoreResult<u64> {
    u64::try_from(number).map_err(|_| StoreError::corrupt("a deployment row's seq is not a u64"))
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> StoreResult<T> {
    codec::decode(bytes).map_err(StoreError::corrupt)
}

/// Stores `value` under `key` in `table`.
fn put_record<'k, 'txn, K: redb::Key + 'static, T: Serialize>(
    mut table: logged::Logged<'_, 'txn, K, &'static [u8]>,
    key: impl std::borrow::Borrow<K::SelfType<'k>>,
    value: &T,
) -> StoreResult<()>
where
    logged::Open<'txn>: logged::Keep<'txn, K, &'static [u8]>,
{
    codec::with_encoded(value, |bytes| table.insert(key, bytes))?;
    Ok(())
}

/// `meta` key of the builds-by-status counts (5 x u64 LE, by `BuildStatus`).
const BUILD_COUNTS_KEY: &str = "build_counts";
/// The `meta` key of the global freeze's `ETag` counter (u64 LE).
const FREEZE_ETAG_KEY: &str = "freeze_etag";

fn encode_counts(counts: &[u64; 5]) -> Vec<u8> {
    counts.iter().flat_map(|c| c.to_le_bytes()).collect()
}

fn decode_counts(bytes: &[u8]) -> StoreResult<[u64; 5]> {
    if bytes.len() != 40 {
        return Err(StoreError::corrupt("meta.build_counts is not 5 counts"));
    }
    let mut counts = [0u64; 5];
    for (i, c) in bytes.chunks_exact(8).enumerate() {
        counts[i] = u64::from_le_bytes(c.try_into().map_err(|_| StoreError::corrupt("a count"))?);
    }
    Ok(counts)
}

/// Every build by status: a full scan (the layout migration to version 4).
fn count_builds(txn: &WriteTransaction) -> StoreResult<[u64; 5]> {
    let t = txn.open_table(BUILDS)?;
    let mut counts = [0u64; 5];
    for entry in t.iter()? {
        let (_, v) = entry?;
        let b: crate::model::BuildRecord = decode(v.value())?;
        counts[b.status as usize] += 1;
    }
    Ok(counts)
}

/// A log chunk row: the index of its first line (u64 LE), then the
/// compressed text.
fn split_chunk_row(row: &[u8]) -> StoreResult<(u64, &[u8])> {
    let (head, compressed) = row
        .split_at_checked(8)
        .ok_or_else(|| StoreError::corrupt("a log chunk without its header"))?;
    let first_line = u64::from_le_bytes(
        head.try_into()
            .map_err(|_| StoreError::corrupt("a log chunk header"))?,
    );
    Ok((first_line, compressed))
}

/// A component row: its reference count (u32 LE: four bytes, not eight,
/// on each of hundreds of thousands of small rows), then its compressed text.
fn split_component_row(row: &[u8]) -> StoreResult<(u32, &[u8])> {
    let (count, text) = row
        .split_at_checked(4)
        .ok_or_else(|| StoreError::corrupt("a component row without its count"))?;
    let count = u32::from_le_bytes(
        count
            .try_into()
            .map_err(|_| StoreError::corrupt("a component row's count"))?,
    );
    Ok((count, text))
}

fn component_row(count: u32, text: &[u8]) -> Vec<u8> {
    let mut row = Vec::with_capacity(4 + text.len());
    row.extend_from_slice(&count.to_le_bytes());
    row.extend_from_slice(text);
    row
}

/// The record stored under `key` in `table`, decoded.
fn get_record<'k, K: redb::Key + 'static, T: serde::de::DeserializeOwned>(
    table: &impl ReadableTable<K, &'static [u8]>,
    key: impl std::borrow::Borrow<K::SelfType<'k>>,
) -> StoreResult<Option<T>> {
    table.get(key)?.map(|v| decode(v.value())).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Source;

    /// A store held alone (with its redo log) in a new directory of its
    /// own, with a `copy/` directory beside the store for a copy of it.
    fn logged_store(
        tag: &str,
        checkpoint_every: std::time::Duration,
    ) -> (Store, std::path::PathBuf) {
        logged_store_with(tag, checkpoint_every, CacheSize::DEFAULT)
    }

    /// `logged_store` with redb holding at most `cache` of the file.
    fn logged_store_with(
        tag: &str,
        checkpoint_every: std::time::Duration,
        cache: CacheSize,
    ) -> (Store, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("berth-store-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("copy")).unwrap();
        (open_logged(&dir, checkpoint_every, cache), dir)
    }

    /// The store at `dir/berth.redb`, held alone with a redo log.
    fn open_logged(
        dir: &std::path::Path,
        checkpoint_every: std::time::Duration,
        cache: CacheSize,
    ) -> Store {
        let sharing = Sharing::Exclusive { checkpoint_every };
        Store::open_with_cache(&dir.join("berth.redb"), sharing, cache).unwrap()
    }

    /// A copy of the store at `dir/berth.redb` and its redo log, as a
    /// crash would leave them, in `dir/to`, opened (so its log replayed).
    fn replayed_copy(dir: &std::path::Path, to: &str) -> Store {
        let (path, copy) = (dir.join("berth.redb"), dir.join(to));
        std::fs::create_dir_all(&copy).unwrap();
        std::fs::copy(&path, copy.join("berth.redb")).unwrap();
        std::fs::copy(redo::path_of(&path), copy.join("berth.redo")).unwrap();
        Store::open(&copy.join("berth.redb")).unwrap()
    }

    fn temp_store(tag: &str) -> (Store, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("berth-store-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        (Store::open(&dir.join("berth.redb")).unwrap(), dir)
    }

    /// One batch's jobs share a `Tx` whose tables stay open between them:
    /// a table taken again sees what the batch wrote to it, a read through
    /// `Lookup` closes the kept one first (redb opens a table once at a
    /// time) and sees the same rows, emptying a table closes it too, and
    /// everything the batch wrote commits, in the redo ops as well.
    #[test]
    fn a_batch_keeps_its_tables_open_between_jobs_and_commits_what_they_wrote() {
        use redb::ReadableTableMetadata;
        let dir = std::env::temp_dir().join(format!("berth-store-{}-kept", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let db = redb::Database::create(dir.join("kept.redb")).unwrap();
        let source = |n: u32| Source {
            url: format!("https://example.org/{n}"),
            rev: "main".into(),
            digest: format!("sha256:{n:064}"),
        };
        let txn = db.begin_write().unwrap();
        let tx = Tx::new(&txn, Some(super::redo::Ops::default()));
        tx.put_source(&source(1)).unwrap();
        tx.put_source(&source(2)).unwrap();
        assert_eq!(tx.source(&source(1).digest).unwrap(), Some(source(1)));
        tx.put_source(&source(3)).unwrap();
        {
            // Two tables in use at once, one of them taken from the batch.
            let sources = tx.table(SOURCES).unwrap();
            let describe = tx.table(DESCRIBE_CACHE).unwrap();
            assert_eq!(sources.len().unwrap(), 3);
            assert_eq!(describe.len().unwrap(), 0);
            // The same table twice at once is refused, as redb refuses it.
            assert!(tx.table(SOURCES).is_err());
        }
        tx.put_describe("digest", "{}").unwrap();
        tx.clear(DESCRIBE_CACHE).unwrap();
        tx.put_describe("again", "{}").unwrap();
        let (hooks, ops) = tx.finish();
        assert!(hooks.is_empty());
        let ops = ops.expect("a logged Tx gives its ops back").into_bytes();
        assert!(!ops.is_empty(), "the batch's rows are in its redo ops");
        txn.commit().unwrap();
        let read = redb::ReadableDatabase::begin_read(&db).unwrap();
        let rx = Rx { txn: read };
        for n in 1..=3 {
            assert_eq!(rx.source(&source(n).digest).unwrap(), Some(source(n)));
        }
        let describe = rx.txn.open_table(DESCRIBE_CACHE).unwrap();
        assert_eq!(describe.len().unwrap(), 1);
        assert!(describe.get("again").unwrap().is_some());
        drop((describe, rx, db));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The rows a write job changes all reach the redo log: a copy of the
    /// file as it is on disk (the last checkpoint) plus the log, opened
    /// again, holds every row of the live store, byte for byte, the
    /// generation mark aside.
    #[tokio::test]
    async fn a_replay_of_the_redo_log_rebuilds_every_row_exactly() {
        let (store, dir) = logged_store("redo", std::time::Duration::from_secs(60));
        let path = dir.join("berth.redb");
        let event = |at| StoredEvent {
            event: "deployment".into(),
            data: "{}".into(),
            at,
        };
        store
            .write(move |tx| {
                for seq in 1..=20u64 {
                    tx.put_deployment_event("a", seq, &event(seq as i64))?;
                }
                tx.put_describe("digest", "{\"methods\":[]}")?;
                let hash = [7u8; 32];
                tx.ref_component(&hash, || Ok(vec![1, 2, 3]))?;
                tx.ref_component(&hash, || Ok(vec![1, 2, 3]))?;
                tx.unref_component(&hash)
            })
            .await
            .unwrap();
        // Removals of all three kinds: remove, `retain_in`, a whole table.
        store
            .write(|tx| {
                tx.prune_deployment_events("a", 10, 100)?;
                tx.delete_build("a", 42)?;
                tx.put_describe("later", "{}")
            })
            .await
            .unwrap();
        store.write(|tx| tx.clear_all()).await.unwrap();
        store
            .write(move |tx| tx.put_deployment_event("b", 1, &event(5)))
            .await
            .unwrap();
        assert!(redo::records_in(&redo::path_of(&path)) >= 4);
        let replayed = replayed_copy(&dir, "copy");
        let (live, again) = (store.read().unwrap(), replayed.read().unwrap());
        for table in tables::Table::ALL {
            let mut a = redo::raw_rows(&live, table).unwrap();
            let mut b = redo::raw_rows(&again, table).unwrap();
            if table == tables::Table::Meta {
                a.retain(|(k, _)| k != redo::GENERATION_KEY.as_bytes());
                b.retain(|(k, _)| k != redo::GENERATION_KEY.as_bytes());
            }
            assert_eq!(a, b, "table {} differs after the replay", table.name());
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Readers racing checkpoints (every millisecond) see every write
    /// acknowledged before they began, and a build's rows together: a
    /// batch is answered after redb's commit, and a checkpoint changes no
    /// row a reader sees.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readers_racing_checkpoints_miss_no_acknowledged_write() {
        let (store, dir) = logged_store("race", std::time::Duration::from_millis(1));
        let acked = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (store, acked, done) = (store.clone(), acked.clone(), done.clone());
            std::thread::spawn(move || {
                let mut reads = 0u64;
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    let before = acked.load(std::sync::atomic::Ordering::SeqCst);
                    let rx = store.read().unwrap();
                    let seen = rx.deployment_events_after("race", 0, usize::MAX).unwrap();
                    // Every acknowledged event, once each, in order, and
                    // the count row written with each of them agrees.
                    assert!(seen.len() as u64 >= before, "{} < {before}", seen.len());
                    assert!(seen
                        .iter()
                        .enumerate()
                        .all(|(i, (seq, _))| *seq == i as u64 + 1));
                    let count = rx.describe("count").unwrap().unwrap_or_else(|| "0".into());
                    assert_eq!(count, seen.len().to_string(), "a reader saw half a write");
                    reads += 1;
                }
                reads
            })
        };
        let event = |at| StoredEvent {
            event: "deployment".into(),
            data: "{}".into(),
            at,
        };
        for seq in 1..=600u64 {
            store
                .write(move |tx| {
                    tx.put_deployment_event("race", seq, &event(seq as i64))?;
                    tx.put_describe("count", &seq.to_string())
                })
                .await
                .unwrap();
            acked.store(seq, std::sync::atomic::Ordering::SeqCst);
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        let reads = reader.join().unwrap();
        assert!(reads > 0);
        assert_eq!(
            store
                .read()
                .unwrap()
                .deployment_events_after("race", 0, usize::MAX)
                .unwrap()
                .len(),
            600
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn the_idempotency_sweep_uses_its_index_and_spares_a_reused_key() {
        let (store, dir) = temp_store("idem-sweep");
        let record = |expires_at| IdempotencyRecord {
            fingerprint: vec![1],
            status: 202,
            content_type: "application/json".into(),
            body: b"{}".to_vec(),
            headers: vec![],
            expires_at,
            identity: IdempotencyIdentity {
                principal: Principal::Service,
                subject: None,
                issuer: None,
                route: "/r".into(),
                key: "k".into(),
            },
        };
        store
            .write(move |tx| {
                for i in 0..10 {
                    tx.put_idempotency(&format!("old-{i}"), &record(1_000 + i))?;
                }
                tx.put_idempotency("fresh", &record(50_000))?;
                // Expired once, then written again with a later expiry.
                tx.put_idempotency("reused", &record(1_000))?;
                tx.put_idempotency("reused", &record(60_000))
            })
            .await
            .unwrap();
        let first = store
            .write(|tx| tx.sweep_idempotency(10_000, 4))
            .await
            .unwrap();
        assert!(first <= 4, "bounded batches: {first}");
        let rest = store
            .write(|tx| tx.sweep_idempotency(10_000, 100))
            .await
            .unwrap();
        assert_eq!(first + rest, 10, "exactly the expired records");
        let rx = store.read().unwrap();
        assert!(rx.idempotency("fresh").unwrap().is_some());
        assert_eq!(
            rx.idempotency("reused").unwrap().unwrap().expires_at,
            60_000
        );
        assert!(rx.idempotency("old-3").unwrap().is_none());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn prune_keeps_recent_and_newest_events() {
        let (store, dir) = temp_store("prune");
        store
            .write(|tx| {
                for seq in 1..=10u64 {
                    // seq 1-5 are old, 6-10 recent.
                    let at = if seq <= 5 { 1_000 } else { 9_000 };
                    tx.put_deployment_event(
                        "a",
                        seq,
                        &StoredEvent {
                            event: "deployment".into(),
                            data: "{}".into(),
                            at,
                        },
                    )?;
                }
                tx.put_deployment_event(
                    "b",
                    1,
                    &StoredEvent {
                        event: "deployment".into(),
                        data: "{}".into(),
                        at: 1,
                    },
                )
            })
            .await
            .unwrap();
        // Below seq 4 and older than 5,000: seqs 1-3 go; 4-5 are kept (count).
        let removed = store
            .write(|tx| tx.prune_deployment_events("a", 4, 5_000))
            .await
            .unwrap();
        assert_eq!(removed, 3);
        let rx = store.read().unwrap();
        assert_eq!(rx.first_deployment_event("a").unwrap(), Some(4));
        assert_eq!(rx.deployment_events_after("a", 0, 100).unwrap().len(), 7);
        assert_eq!(
            rx.first_deployment_event("b").unwrap(),
            Some(1),
            "another deployment is untouched"
        );
        // Recent events are never pruned, whatever their seq.
        let removed = store
            .write(|tx| tx.prune_deployment_events("a", 100, 5_000))
            .await
            .unwrap();
        assert_eq!(removed, 2);
        assert_eq!(
            store.read().unwrap().first_deployment_event("a").unwrap(),
            Some(6)
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    /// With a redo log a failed batch aborts its own transaction only: the
    /// batches acknowledged before it since the last checkpoint stay for
    /// readers, the next job's own reads and a restart's replay, and the
    /// failed batch's row goes to none of them.
    #[tokio::test]
    async fn a_failed_batch_after_acknowledged_ones_keeps_them_for_readers_jobs_and_a_restart() {
        let (store, dir) = logged_store("restore", std::time::Duration::from_secs(60));
        let source = |n: u32| Source {
            url: format!("https://example.org/{n}"),
            rev: "r".into(),
            digest: format!("d{n}"),
        };
        for n in 1..=3 {
            store
                .write(move |tx| tx.put_source(&source(n)))
                .await
                .unwrap();
        }
        let failed = store
            .write(move |tx| -> StoreResult<()> {
                tx.put_source(&source(9))?;
                Err(StoreError::corrupt("simulated failure after a write"))
            })
            .await;
        assert!(failed.is_err());
        let in_job = store
            .write(move |tx| {
                let kept: Vec<bool> = (1..=3)
                    .map(|n| tx.source(&source(n).digest).map(|s| s.is_some()))
                    .collect::<StoreResult<_>>()?;
                Ok((kept, tx.source("d9")?.is_some()))
            })
            .await
            .unwrap();
        assert_eq!(in_job, (vec![true; 3], false), "what the next job read");
        let check = |rx: &Rx| {
            for n in 1..=3 {
                assert_eq!(rx.source(&source(n).digest).unwrap(), Some(source(n)));
            }
            assert_eq!(rx.source("d9").unwrap(), None);
        };
        check(&store.read().unwrap());
        // Nothing was checkpointed (60 s): the copy holds them only in its
        // redo log, and its open replays them.
        let replayed = replayed_copy(&dir, "copy");
        check(&replayed.read().unwrap());
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Sources `first..first + count` written by as many concurrent
    /// writes, each a task of its own (so, on a runtime of two workers,
    /// most queue behind one another and share batches, rather than
    /// each run alone where it was submitted: `run_here_if_idle`), each
    /// with a hook that records it ran; what each write returned.
    async fn concurrent_sources(
        store: &Store,
        first: u32,
        count: u32,
        hooked: &Arc<std::sync::Mutex<Vec<u32>>>,
    ) -> Vec<(u32, StoreResult<()>)> {
        let writes = (first..first + count).map(|n| {
            let hooked = hooked.clone();
            let store = store.clone();
            tokio::spawn(async move {
                let written = store
                    .write(move |tx| {
                        let hooked = hooked.clone();
                        tx.after_commit(move || hooked.lock().unwrap().push(n));
                        tx.put_source(&numbered_source(n))
                    })
                    .await;
                (n, written)
            })
        });
        futures_util::future::join_all(writes)
            .await
            .into_iter()
            .map(|joined| joined.expect("a write task panicked"))
            .collect()
    }

    fn numbered_source(n: u32) -> Source {
        Source {
            url: format!("https://example.org/{n}"),
            rev: "r".into(),
            digest: format!("source-{n}"),
        }
    }

    /// Every write that was answered Ok is read back, and none refused.
    #[cfg(feature = "failpoints")]
    fn check_sources(rx: &Rx, writes: &[(u32, StoreResult<()>)]) {
        for (n, w) in writes {
            let found = rx.source(&format!("source-{n}")).unwrap();
            assert_eq!(found.is_some(), w.is_ok(), "source {n}: {w:?}");
        }
    }

    /// Writes that queue behind one another share batches: every one is
    /// answered, its hook runs once, and readers, the next write job, a
    /// checkpoint and a copy's replay of the log all find it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_writes_are_all_answered_read_and_replayed() {
        let (store, dir) = logged_store("behind", std::time::Duration::from_secs(60));
        let hooked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let written = concurrent_sources(&store, 0, 200, &hooked).await;
        assert!(written.iter().all(|(_, w)| w.is_ok()), "{written:?}");
        let mut hooks = hooked.lock().unwrap().clone();
        hooks.sort_unstable();
        assert_eq!(hooks, (0..200).collect::<Vec<_>>(), "each hook once");
        let rx = store.read().unwrap();
        for n in 0..200 {
            assert_eq!(
                rx.source(&format!("source-{n}")).unwrap(),
                Some(numbered_source(n))
            );
        }
        let seen_by_a_job = store
            .write(|tx| {
                (0..200).try_fold(0, |found, n| {
                    Ok(found + usize::from(tx.source(&format!("source-{n}"))?.is_some()))
                })
            })
            .await
            .unwrap();
        assert_eq!(seen_by_a_job, 200);
        // Not checkpointed (60 s): a copy holds them in its log only.
        let replayed = replayed_copy(&dir, "copy");
        let rx = replayed.read().unwrap();
        for n in 0..200 {
            assert_eq!(
                rx.source(&format!("source-{n}")).unwrap(),
                Some(numbered_source(n))
            );
        }
        drop(rx);
        drop(replayed);
        store.shared.checkpoint().unwrap();
        let rx = store.read().unwrap();
        assert_eq!(rx.source("source-199").unwrap(), Some(numbered_source(199)));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A batch whose redb commit is refused after its append (the
    /// `redo.commit` failpoint: its record is taken back out of the log),
    /// or whose append is refused (`redo.append`), is refused with its
    /// batch-mates (its error is not one that may pass); either way
    /// nothing refused reaches a reader, a later job, a replay or a
    /// checkpoint, everything answered does, hooks run for exactly the
    /// answered writes, and the next writes land.
    #[cfg(feature = "failpoints")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_batch_lands_nowhere_and_the_answered_ones_everywhere() {
        for place in ["redo.commit", "redo.append"] {
            let (store, dir) = logged_store(place, std::time::Duration::from_secs(60));
            let hooked = Arc::new(std::sync::Mutex::new(Vec::new()));
            // Only the rows of source 1050 hold this (digest "source-1050").
            fail::cfg(place, "return(source-1050)").unwrap();
            let written = concurrent_sources(&store, 1000, 100, &hooked).await;
            fail::remove(place);
            let refused: Vec<u32> = written
                .iter()
                .filter(|(_, w)| w.is_err())
                .map(|(n, _)| *n)
                .collect();
            assert!(refused.contains(&1050), "{place}: {written:?}");
            let answered: Vec<u32> = written
                .iter()
                .filter(|(_, w)| w.is_ok())
                .map(|(n, _)| *n)
                .collect();
            let mut hooks = hooked.lock().unwrap().clone();
            hooks.sort_unstable();
            assert_eq!(
                hooks, answered,
                "{place}: hooks ran for exactly the answered writes"
            );
            let copy_and_check = |writes: &[(u32, StoreResult<()>)], to: &str| {
                check_sources(&replayed_copy(&dir, to).read().unwrap(), writes);
            };
            // Right away, while the refused records are the log's last:
            // voided, a replay stops before them.
            copy_and_check(&written, "copy/refused");
            let later = concurrent_sources(&store, 2000, 20, &hooked).await;
            assert!(later.iter().all(|(_, w)| w.is_ok()), "{place}: {later:?}");
            let all: Vec<_> = written.into_iter().chain(later).collect();
            check_sources(&store.read().unwrap(), &all);
            copy_and_check(&all, "copy/later");
            store.shared.checkpoint().unwrap();
            check_sources(&store.read().unwrap(), &all);
            drop(store);
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// A lone write on an idle store runs where it was submitted, not on
    /// the writer thread, unless a checkpoint is due: then it goes to the
    /// writer thread, which makes the checkpoint after it. What each
    /// wrote is read back, by a reader and by a replay of the log.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lone_write_runs_where_it_was_submitted_unless_a_checkpoint_is_due() {
        // Long enough that no checkpoint falls due between the writes
        // that should find none (an idle store's is due at 0.4 of it).
        let every = std::time::Duration::from_millis(1000);
        let (store, dir) = logged_store("lone", every);
        let thread_of_write = |n: u32| {
            move |tx: &Tx| {
                tx.put_source(&numbered_source(n))?;
                Ok(std::thread::current().name().map(str::to_owned))
            }
        };
        let writer = Some("berth-store-writer");
        let generation = |store: &Store| store.shared.redo_log().map(|log| log.generation);
        let before = generation(&store);
        let ran_on = store.write(thread_of_write(1)).await.unwrap();
        assert_ne!(ran_on.as_deref(), writer, "a lone write on an idle store");
        // Due, by time: the next write goes to the writer thread.
        std::thread::sleep(every);
        let ran_on = store.write(thread_of_write(2)).await.unwrap();
        assert_eq!(
            ran_on.as_deref(),
            writer,
            "a write that finds a checkpoint due"
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while generation(&store) == before && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        assert_ne!(generation(&store), before, "no checkpoint was made");
        // The writer thread holds the turn a little past the checkpoint's
        // generation: idle again once it lets go.
        while store.shared.turn.try_lock().is_err() && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let ran_on = store.write(thread_of_write(3)).await.unwrap();
        assert_ne!(
            ran_on.as_deref(),
            writer,
            "a lone write after the checkpoint"
        );
        let rx = store.read().unwrap();
        let replayed = replayed_copy(&dir, "copy");
        for n in 1..=3 {
            let source = Some(numbered_source(n));
            assert_eq!(rx.source(&format!("source-{n}")).unwrap(), source);
            let copy = replayed.read().unwrap();
            assert_eq!(copy.source(&format!("source-{n}")).unwrap(), source);
        }
        drop((rx, replayed, store));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// With the smallest cache redb holds little of the file: the pages a
    /// generation dirties past half of it are written to the file before
    /// the checkpoint that commits them. Every acknowledged row is still
    /// read live, from a crash's copy (whose file holds those pages of a
    /// transaction that never committed) and after a clean stop.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_with_the_smallest_cache_keeps_every_row_through_a_crash_and_a_stop() {
        let every = std::time::Duration::from_secs(60);
        let smallest = CacheSize::of_bytes(CacheSize::MIN_BYTES).unwrap();
        let (store, dir) = logged_store_with("cache", every, smallest);
        let path = dir.join("berth.redb");
        let generation = |store: &Store| store.shared.redo_log().map(|log| log.generation);
        let before = (generation(&store), std::fs::read(&path).unwrap());
        // Rows of ~2 KiB, 4 MiB in all: four times the cache.
        let bulky = |n: u32| Source {
            url: format!("https://example.org/{n}/{}", "x".repeat(2048)),
            ..numbered_source(n)
        };
        const ROWS: u32 = 2000;
        for n in 0..ROWS {
            store
                .write(move |tx| tx.put_source(&bulky(n)))
                .await
                .unwrap();
        }
        assert_eq!(generation(&store), before.0, "a checkpoint came between");
        // The file grows (zeros) as redb allocates; written pages show as
        // changed bytes where it was, or as bytes other than zeros past it.
        let after = std::fs::read(&path).unwrap();
        let (was, grown) = after.split_at(before.1.len().min(after.len()));
        assert!(
            was != before.1.as_slice() || grown.iter().any(|b| *b != 0),
            "no page reached the file before the checkpoint: the cache was not bounded"
        );
        let check = |store: &Store, what: &str| {
            let rx = store.read().unwrap();
            for n in 0..ROWS {
                let found = rx.source(&format!("source-{n}")).unwrap();
                assert_eq!(found, Some(bulky(n)), "{what}: source {n}");
            }
        };
        check(&store, "live");
        let crashed = replayed_copy(&dir, "copy");
        check(&crashed, "replayed after a crash");
        drop(crashed);
        store.close().unwrap();
        drop(store);
        let reopened = open_logged(&dir, every, smallest);
        check(&reopened, "after a stop");
        drop(reopened);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A write job that panics is refused with an error, wherever its
    /// batch runs, and takes nothing with it: every write acknowledged
    /// before it since the last checkpoint is still read, checkpointed
    /// and replayed, and the store goes on taking writes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_job_that_panics_is_refused_and_takes_no_acknowledged_write_with_it() {
        let (store, dir) = logged_store("job-panic", std::time::Duration::from_secs(60));
        store
            .write(|tx| tx.put_source(&numbered_source(1)))
            .await
            .unwrap();
        let hooked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let burst = concurrent_sources(&store, 100, 30, &hooked);
        let panicking = |tx: &Tx| -> StoreResult<()> {
            tx.put_source(&numbered_source(2))?;
            panic!("a write job that panics (expected by this test)")
        };
        let (burst, lone) = tokio::join!(burst, store.write(panicking));
        assert!(burst.iter().all(|(_, w)| w.is_ok()), "{burst:?}");
        assert!(lone.is_err(), "a panicking job was answered Ok");
        let panicked_alone = store.write(panicking).await;
        assert!(panicked_alone.is_err(), "a panicking job was answered Ok");
        store
            .write(|tx| tx.put_source(&numbered_source(3)))
            .await
            .unwrap();
        let check = |rx: &Rx| {
            for n in [1, 3].into_iter().chain(100..130) {
                assert_eq!(
                    rx.source(&format!("source-{n}")).unwrap(),
                    Some(numbered_source(n)),
                    "{n}"
                );
            }
            assert_eq!(rx.source("source-2").unwrap(), None, "a panicked job's row");
        };
        check(&store.read().unwrap());
        check(&replayed_copy(&dir, "copy/before").read().unwrap());
        store.shared.checkpoint().unwrap();
        check(&store.read().unwrap());
        check(&replayed_copy(&dir, "copy/after").read().unwrap());
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A hook that panics, where a lone write was submitted or on the
    /// writer thread (a burst), is logged and skipped: its write is
    /// answered and kept, the hooks after it run, and the store goes on
    /// taking writes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_hook_never_stops_the_writer() {
        let (store, dir) = logged_store("hook-panic", std::time::Duration::from_secs(60));
        let hooked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let panicking = |n: u32| {
            let hooked = hooked.clone();
            move |tx: &Tx| {
                tx.after_commit(|| panic!("a hook that panics (expected by this test)"));
                let hooked = hooked.clone();
                tx.after_commit(move || hooked.lock().unwrap().push(n));
                tx.put_source(&numbered_source(n))
            }
        };
        // Alone: synced and answered where it was submitted.
        store.write(panicking(4000)).await.unwrap();
        // In a burst: batches on the writer thread, a panicking one among them.
        let burst = concurrent_sources(&store, 4001, 50, &hooked);
        let (burst, panicked) = tokio::join!(burst, store.write(panicking(4051)));
        panicked.unwrap();
        assert!(burst.iter().all(|(_, w)| w.is_ok()), "{burst:?}");
        let later = concurrent_sources(&store, 4100, 20, &hooked).await;
        assert!(later.iter().all(|(_, w)| w.is_ok()), "{later:?}");
        store
            .write(|tx| tx.put_source(&numbered_source(4200)))
            .await
            .unwrap();
        let rx = store.read().unwrap();
        for n in [4000, 4025, 4051, 4110, 4200] {
            assert_eq!(
                rx.source(&format!("source-{n}")).unwrap(),
                Some(numbered_source(n))
            );
        }
        let hooks = hooked.lock().unwrap().clone();
        assert!(
            hooks.contains(&4000) && hooks.contains(&4051),
            "the hooks after a panicking one ran"
        );
        drop(rx);
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn a_failed_job_aborts_its_batch_and_hooks_run_only_after_commit() {
        let (store, dir) = temp_store("hooks");
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ran.clone();
        store
            .write(move |tx| {
                let flag = flag.clone();
                tx.after_commit(move || flag.store(true, std::sync::atomic::Ordering::SeqCst));
                tx.put_source(&Source {
                    url: "u".into(),
                    rev: "r".into(),
                    digest: "d".into(),
                })
            })
            .await
            .unwrap();
        assert!(ran.load(std::sync::atomic::Ordering::SeqCst));
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ran.clone();
        let r = store
            .write(move |tx| -> StoreResult<()> {
                let flag = flag.clone();
                tx.after_commit(move || flag.store(true, std::sync::atomic::Ordering::SeqCst));
                tx.put_source(&Source {
                    url: "u2".into(),
                    rev: "r".into(),
                    digest: "d2".into(),
                })?;
                Err(StoreError::corrupt("simulated failure after a write"))
            })
            .await;
        assert!(r.is_err());
        assert!(
            !ran.load(std::sync::atomic::Ordering::SeqCst),
            "a hook ran for an aborted transaction"
        );
        assert!(
            store.read().unwrap().source("d2").unwrap().is_none(),
            "an aborted batch left a write behind"
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    /// One job's error fails that job only: its batch-mates, which ran in
    /// the same aborted transaction, run again alone and commit, each
    /// with its hooks run once.
    // Multi-threaded: the test waits on a std channel for the writer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_job_does_not_fail_its_batch_mates() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (store, dir) = temp_store("batch-mates");
        // Hold the writer until the next jobs are all queued, so they
        // share one batch.
        let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let holding = store.clone();
        let holder = tokio::spawn(async move {
            holding
                .write(move |_| {
                    let _ = started_tx.send(());
                    let _ = release_rx.recv();
                    Ok(())
                })
                .await
        });
        started_rx.recv().unwrap();
        let hooks = Arc::new(AtomicUsize::new(0));
        let runs: Arc<[AtomicUsize; 6]> = Arc::new(Default::default());
        let mut jobs = tokio::task::JoinSet::new();
        for n in 0..6u32 {
            let (queued, hooks, runs) = (store.clone(), hooks.clone(), runs.clone());
            jobs.spawn(async move {
                let r = queued
                    .write(move |tx| -> StoreResult<()> {
                        runs[n as usize].fetch_add(1, Ordering::SeqCst);
                        tx.put_source(&Source {
                            url: format!("u{n}"),
                            rev: "r".into(),
                            digest: format!("d{n}"),
                        })?;
                        let hooks = hooks.clone();
                        tx.after_commit(move || {
                            hooks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        });
                        if n == 3 {
                            return Err(StoreError::corrupt("job 3 fails after a write"));
                        }
                        Ok(())
                    })
                    .await;
                (n, r.is_ok())
            });
            // Each job in the queue before the next, so they queue in order.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while store.writer.max_capacity() - store.writer.capacity() < n as usize + 1 {
                assert!(std::time::Instant::now() < deadline, "job {n} never queued");
                tokio::task::yield_now().await;
            }
        }
        release_tx.send(()).unwrap();
        holder.await.unwrap().unwrap();
        let mut results = Vec::new();
        while let Some(r) = jobs.join_next().await {
            results.push(r.unwrap());
        }
        results.sort();
        let ok: Vec<bool> = results.iter().map(|(_, ok)| *ok).collect();
        assert_eq!(ok, [true, true, true, false, true, true]);
        let rx = store.read().unwrap();
        for n in 0..6 {
            assert_eq!(
                rx.source(&format!("d{n}")).unwrap().is_some(),
                n != 3,
                "job {n}"
            );
        }
        assert_eq!(
            hooks.load(Ordering::SeqCst),
            5,
            "each committed job's hooks ran once"
        );
        // They shared one batch: the three before the failing job ran in
        // it and again alone; the failing one ran once; the two after it
        // ran alone only (a batch stops at its first failure).
        let runs: Vec<usize> = runs.iter().map(|r| r.load(Ordering::SeqCst)).collect();
        assert_eq!(
            runs,
            [2, 2, 2, 1, 1, 1],
            "the six jobs did not share a batch"
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A stop with writes still coming in (a webhook sweep, a build's
    /// last event) leaves every acknowledged row in the file and nothing
    /// in the redo log: an export or import right after a clean stop
    /// must not be told the store was not stopped cleanly.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_close_racing_writes_leaves_nothing_in_the_redo_log() {
        for round in 0..20u32 {
            let (store, dir) = logged_store(
                &format!("close-race-{round}"),
                std::time::Duration::from_secs(60),
            );
            let path = dir.join("berth.redb");
            let writers: Vec<_> = (0..4u64)
                .map(|w| {
                    let store = store.clone();
                    tokio::spawn(async move {
                        let mut acked = Vec::new();
                        for i in 0..10_000u64 {
                            let key = format!("w{w}-{i}");
                            let k = key.clone();
                            match store.write(move |tx| tx.put_describe(&k, "{}")).await {
                                Ok(()) => acked.push(key),
                                Err(_) => break,
                            }
                        }
                        acked
                    })
                })
                .collect();
            tokio::time::sleep(std::time::Duration::from_millis(5 + u64::from(round % 7))).await;
            let closing = store.clone();
            tokio::task::spawn_blocking(move || closing.close())
                .await
                .unwrap()
                .unwrap();
            let mut acked = Vec::new();
            for w in writers {
                acked.extend(w.await.unwrap());
            }
            drop(store);
            assert!(
                !redo::unapplied(&path).unwrap(),
                "round {round}: a clean close left rows in the redo log ({} acknowledged)",
                acked.len()
            );
            let reopened = Store::open(&path).unwrap();
            let rx = reopened.read().unwrap();
            for key in &acked {
                assert!(
                    rx.describe(key).unwrap().is_some(),
                    "round {round}: {key} lost"
                );
            }
            drop(rx);
            drop(reopened);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    /// One step of the read path's model test.
    #[cfg(feature = "failpoints")]
    #[derive(Debug, Clone)]
    enum Step {
        /// Sets (`Some`) or removes (`None`) keys in one write.
        Write(Vec<(u8, Option<u8>)>),
        /// The same, refused at its append (a full disk, say), or by redb
        /// after it (`redo.commit`).
        Refused(&'static str, Vec<(u8, Option<u8>)>),
        Checkpoint,
        /// The handle dropped and the file opened again, as after an I/O error.
        Reopen,
    }

    #[cfg(feature = "failpoints")]
    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        let ops = proptest::collection::vec((0u8..12, proptest::option::of(any::<u8>())), 1..6);
        prop_oneof![
            6 => ops.clone().prop_map(Step::Write),
            2 => (prop_oneof![Just("redo.append"), Just("redo.commit")], ops)
                .prop_map(|(place, ops)| Step::Refused(place, ops)),
            1 => Just(Step::Checkpoint),
            1 => Just(Step::Reopen),
        ]
    }

    /// The rows a store holds of the model's keys.
    #[cfg(feature = "failpoints")]
    fn model_rows(store: &Store) -> std::collections::BTreeMap<String, Vec<u8>> {
        let rx = store.read().unwrap();
        let meta = rx.rows(META).unwrap();
        let mut out = std::collections::BTreeMap::new();
        for row in meta.range("model-".."model.").unwrap() {
            let (k, v) = row.unwrap();
            out.insert(k.value().to_string(), v.value().to_vec());
        }
        out
    }

    /// The read path against a model: through random writes, refused
    /// appends, checkpoints and reopens, a reader finds exactly what the
    /// answered writes left, and so does a replay of a copy of the files
    /// as a crash leaves them.
    #[cfg(feature = "failpoints")]
    #[test]
    fn the_store_reads_as_a_model_through_writes_refusals_checkpoints_and_reopens() {
        use proptest::prelude::*;
        let config = ProptestConfig {
            cases: 12,
            ..ProptestConfig::default()
        };
        proptest!(config, |(steps in proptest::collection::vec(step(), 1..30))| {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let (store, dir) = logged_store("model", std::time::Duration::from_secs(60));
                let mut model = std::collections::BTreeMap::new();
                for step in &steps {
                    let write = |ops: Vec<(u8, Option<u8>)>, marker: bool| {
                        store.write(move |tx| {
                            let mut meta = tx.table(META)?;
                            if marker {
                                meta.insert("model-refused-marker", b"x".as_slice())?;
                            }
                            for (k, v) in &ops {
                                let key = format!("model-{k:02}");
                                match v {
                                    Some(v) => meta.insert(key.as_str(), [*v].as_slice())?,
                                    None => meta.remove(key.as_str())?,
                                };
                            }
                            Ok(())
                        })
                    };
                    match step.clone() {
                        Step::Write(ops) => {
                            write(ops.clone(), false).await.unwrap();
                            for (k, v) in ops {
                                let key = format!("model-{k:02}");
                                match v {
                                    Some(v) => model.insert(key, vec![v]),
                                    None => model.remove(&key),
                                };
                            }
                        }
                        Step::Refused(place, ops) => {
                            fail::cfg(place, "return(model-refused-marker)").unwrap();
                            let refused = write(ops, true).await;
                            fail::remove(place);
                            assert!(refused.is_err(), "a refused append was answered");
                        }
                        Step::Checkpoint => store.shared.checkpoint().unwrap(),
                        Step::Reopen => store.shared.reopen(),
                    }
                    assert_eq!(model_rows(&store), model, "after {step:?}");
                }
                assert_eq!(model_rows(&replayed_copy(&dir, "copy/model")), model, "a replay");
                drop(store);
                let _ = std::fs::remove_dir_all(dir);
            });
        });
    }
}
