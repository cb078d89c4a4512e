//! The writer thread and the file handle it shares with readers.
//!
//! One thread group-commits: every write job queued while the previous
//! commit was in flight runs in the next single transaction, which commits
//! (fsync) once. A batch is run by `run_batch`, under `Shared::turn`:
//! by this thread, or, for a lone job on an idle store, by the thread that
//! submitted it (`Store::run_here_if_idle`), which never checkpoints: a
//! checkpoint is made here, after the batch that finds it due (`Place`).
//!
//! After an I/O error redb refuses every call until the file is
//! reopened, so the thread drops the handle and reopens it; while it cannot
//! open the file for writing (a full disk), reads go through a read-only
//! handle. A commit that fails with an I/O error (ENOSPC included) answers
//! its batch with that error (503 `disk_full`); a read that meets a reopen
//! in progress waits for it (up to `READ_WAIT_ATTEMPTS`, through
//! `block_in_place` on a runtime worker). A build's final commit is retried
//! with backoff by its caller, so no build stays `running` once the disk
//! recovers (tests/integration/disk.rs, on a small tmpfs).
//!
//! With a redo log the batches between two checkpoints share one write
//! transaction (`RedoLog::pending`): a batch's commit is its rows' append
//! and sync, then their publication to readers (`overlay.rs`), and only
//! the checkpoint commits redb, durably (redb writes its pages here; their
//! sync runs on a thread of its own, `behind.rs`, while this one goes
//! on). A batch that fails part-way, or
//! whose append is refused, cannot be aborted alone: the transaction is
//! aborted whole and a new one is given the overlay's rows again
//! (`restore`), which are exactly the rows acknowledged since the last
//! checkpoint. The tables the batches open stay open with it
//! (`logged::Pending`) until it commits or aborts. (Measured against one
//! non-durable redb commit per batch:
//! the writer's user CPU per submit fell by about a third at one
//! connection, and not measurably at 32; docs/performance-history.md,
//! "One transaction per checkpoint".)
//!
//! Under load a batch's sync is not waited out here: its record is
//! written and the batch handed to the log's syncer thread (`syncer.rs`),
//! which syncs, publishes and answers while this thread runs the next
//! batch; the writer settles with it before a checkpoint, an abort or a
//! reopen.
//!
//! With a redo log, a log that refuses an append (a full disk) aborts the
//! batch and leaves the handle whole (`Refused::handle_lost` is false), so
//! nothing is reopened; a checkpoint that fails loses the handle, which is
//! reopened at once (the reopen writes nothing to the store file:
//! `redo::Replay::KeepLog`), and the next checkpoint waits
//! `CHECKPOINT_RETRY_MIN`, doubling to `CHECKPOINT_RETRY_MAX`.

use crate::locks::{Held, HeldRw};
use std::path::Path;
use std::sync::Arc;

use redb::{Database, Durability, ReadableDatabase, WriteTransaction};
use tokio::sync::mpsc;

use super::behind::{RedbSyncs, SyncBehind};
use super::logged::Pending;
use super::overlay::Overlay;
use super::redo::{self, RedoLog};
use super::syncer::{self, Syncer};
use super::{StoreError, StoreResult, Tx, MAX_JOBS_PER_COMMIT};

/// Work to run after the transaction that queued it is durable (publishing
/// events to live subscribers), in commit order.
pub type Hook = Box<dyn FnOnce() + Send>;
/// A job's body: runs in the batch's transaction (its hooks and redo ops
/// go into the batch's `Tx`); the error it failed with, if any (the batch
/// then aborts).
pub(super) type RunJob = dyn FnMut(&Tx<'_, '_>) -> Option<StoreError> + Send;

/// One write job. `run` executes its body in a transaction and keeps the
/// result; it may run twice: when its batch fails because of another job
/// (or a commit error), it runs again alone. `finish` answers the caller:
/// with the kept result, or with the error that kept it from landing.
pub(super) struct WriteJob {
    pub(super) run: Box<RunJob>,
    /// How much of the redo log's room it may take (`redo::Urgency`).
    pub(super) urgency: redo::Urgency,
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
    /// The memory redb may hold of the file's pages (kept for reopens).
    pub(super) cache: super::CacheSize,
    /// The redo log, when berth holds the file alone (`redo.rs`). Locked
    /// before any write transaction begins, by every user, so the two
    /// locks are always taken in one order.
    pub(super) redo: Option<std::sync::Mutex<RedoLog>>,
    /// The rows logged since the last checkpoint, for readers (empty
    /// without a redo log); shared with the log's syncer thread.
    pub(super) overlay: Arc<Overlay>,
    /// The thread that syncs the redo log behind the writer (`syncer.rs`);
    /// with a redo log only. Its batches are handed over under the log's
    /// lock.
    pub(super) syncer: Option<Syncer>,
    /// Where retired overlay generations are dropped (`retire`); the
    /// thread ends when this is dropped with the store.
    pub(super) sweeper:
        std::sync::Mutex<Option<std::sync::mpsc::Sender<Arc<super::overlay::Generation>>>>,
    /// The writer's state between batches, held by whoever runs one.
    pub(super) turn: std::sync::Mutex<Turn>,
    /// How many batches in a row were one job with none queued behind it
    /// when they ended (counting stops at `QUIET_BATCHES`): the store is
    /// idle, not between two batches of a load. `Store::run_here_if_idle`
    /// runs a job where it was submitted only after `QUIET_BATCHES` of
    /// them; under load this one load of a counter is all it costs a
    /// write (the syncer's lock it asks next is the writer's and the
    /// syncer's, taken at every hand-over).
    pub(super) lone_batches_in_a_row: std::sync::atomic::AtomicU32,
}

/// Lone batches in a row after which the store counts as idle
/// (`Shared::lone_batches_in_a_row`). Why more than one: at 32
/// connections a batch of one now and then falls between two waves of
/// submits, and the first of the next wave, run on its worker, held that
/// worker (and the wave queued behind it) for its sync; with one lone
/// batch as the mark ~3% of submits at 32 connections ran so. At one
/// connection every batch is lone, so the mark is passed at once.
pub(super) const QUIET_BATCHES: u32 = 3;

impl Shared {
    pub(super) fn redo_log(&self) -> Option<std::sync::MutexGuard<'_, RedoLog>> {
        self.redo.as_ref().map(|m| m.held())
    }

    /// Makes every commit so far durable with one `Immediate` commit that
    /// records the log's generation, then starts the log again. The only
    /// way berth commits durably while it keeps a redo log.
    pub(super) fn checkpoint(&self) -> StoreResult<()> {
        let Some(mut log) = self.redo_log() else {
            return Ok(());
        };
        let Some(db) = self.current() else {
            return Err(StoreError::reopening());
        };
        checkpoint_with(self, &db, &mut log)?;
        log.settle_checkpoint()
    }

    /// Drops an overlay generation a checkpoint retired on a thread of
    /// its own (`berth-store-sweep`, started with the first): freeing a
    /// checkpoint's rows took ~4% of the writer thread at 32 connections.
    /// Where that thread cannot start, it is dropped here. The channel
    /// needs no bound: one generation comes per checkpoint, and freeing
    /// one takes a fraction of the interval.
    pub(super) fn retire(&self, old: Arc<super::overlay::Generation>) {
        let mut sweeper = self.sweeper.held();
        if sweeper.is_none() {
            let (send, receive) = std::sync::mpsc::channel::<Arc<super::overlay::Generation>>();
            let spawned = std::thread::Builder::new()
                .name("berth-store-sweep".into())
                .spawn(move || receive.into_iter().for_each(drop));
            match spawned {
                Ok(_) => *sweeper = Some(send),
                Err(e) => tracing::debug!(error = %e, "no sweeper thread; the writer frees"),
            }
        }
        match sweeper.as_ref() {
            Some(send) => {
                if let Err(std::sync::mpsc::SendError(old)) = send.send(old) {
                    drop(old);
                }
            }
            None => drop(old),
        }
    }

    /// A reader: redb's read transaction and, with a redo log, what it
    /// sees of the overlay, taken together.
    pub(super) fn begin_read(&self, db: &Database) -> StoreResult<super::Rx> {
        if self.redo.is_none() {
            return Ok(super::Rx {
                txn: db.begin_read()?,
                seen: None,
            });
        }
        let (txn, seen) = self.overlay.begin(|| db.begin_read())?;
        Ok(super::Rx {
            txn,
            seen: Some(seen),
        })
    }

    pub(super) fn current(&self) -> Option<Arc<Database>> {
        self.db.read_held().clone()
    }

    /// Drops the poisoned handle and opens the file again; retries while
    /// old read transactions still hold the file. Leaves `None` when it
    /// cannot open yet (the next write tries again).
    pub(super) fn reopen(&self) {
        // The rows of an open write transaction are all in the log, which
        // the reopen applies again: once the syncer has answered (or
        // voided) every record handed to it.
        if let Some(mut log) = self.redo_log() {
            if let Some(failure) = self.syncer.as_ref().and_then(Syncer::settle) {
                rewind(&mut log, &failure);
            }
            drop(log.pending.take());
        }
        let old = self.db.write_held().take();
        drop(old);
        // The read-only handle (if any) would keep the writer out.
        let old_ro = self.read_only.write_held().take();
        drop(old_ro);
        for _ in 0..REOPEN_ATTEMPTS {
            // The commits redb held only in memory went with the old
            // handle; the log has every acknowledged one. They are applied
            // again non-durably and the log goes on behind them: a reopen
            // writes nothing to the store file, so it succeeds on the full
            // disk that perhaps made the handle fail (the next checkpoint
            // that succeeds makes them durable).
            let reopened = open_database_with_syncs(&self.path, self.sharing, self.cache).and_then(
                |(db, syncs)| {
                    if let Some(mut log) = self.redo_log() {
                        log.redb_syncs = syncs;
                        let at = super::redo::replay(
                            &db,
                            &self.path,
                            super::LAYOUT_VERSION,
                            super::redo::Replay::KeepLog,
                        )?;
                        log.resume(at);
                    }
                    Ok(db)
                },
            );
            match reopened {
                Ok(db) => {
                    tracing::warn!(path = %self.path.display(), "store reopened after an I/O error");
                    *self.db.write_held() = Some(Arc::new(db));
                    // redb's commits now hold every row the overlay did.
                    self.retire(self.overlay.restart());
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "store reopen: not yet");
                    std::thread::sleep(REOPEN_PAUSE);
                }
            }
        }
        if self.redo.is_some() {
            // A read-only handle would miss what only the log holds: reads
            // wait (503) rather than answer from an older state.
            tracing::error!(path = %self.path.display(), "cannot reopen the store yet; answering 503 until it can");
            return;
        }
        match super::redb_builder(self.sharing.mode(), self.cache).open_read_only(&self.path) {
            Ok(ro) => {
                *self.read_only.write_held() = Some(Arc::new(ro));
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
    open_database_with_syncs(path, sharing, super::CacheSize::DEFAULT).map(|(db, _)| db)
}

/// Opens the store file; held alone, with redb's syncs behind the writer
/// (`behind.rs`), whose progress it also returns.
pub(super) fn open_database_with_syncs(
    path: &Path,
    sharing: super::Sharing,
    cache: super::CacheSize,
) -> StoreResult<(Database, Option<Arc<RedbSyncs>>)> {
    let builder = super::redb_builder(sharing.mode(), cache);
    match sharing {
        super::Sharing::Exclusive { .. } => {
            let (backend, syncs) = SyncBehind::open(path)?;
            Ok((builder.create_with_backend(backend)?, Some(syncs)))
        }
        super::Sharing::LiveReaders => Ok((builder.create(path)?, None)),
    }
}

/// A checkpoint: the pending write transaction (every row logged since
/// the last checkpoint) commits durably, recording `log`'s generation;
/// then readers find its rows in redb, the overlay starts a new
/// generation, and the log starts again one generation on (see
/// `redo.rs`). A commit that fails without losing the handle (not an I/O
/// error) leaves the rows in a new pending transaction, given again from
/// the overlay.
fn checkpoint_with(shared: &Shared, db: &Database, log: &mut RedoLog) -> StoreResult<()> {
    let overlay = &shared.overlay;
    // Every batch handed to the syncer answered, and a refused one's rows
    // out of the pending transaction, before redb makes it durable.
    settle(shared, db, log).map_err(|refused| refused.error)?;
    let mut txn = match log.pending.take() {
        Some(pending) => pending.into_txn(),
        None => begin(db)?,
    };
    // redb saves its allocator state in the commit, so a start after a
    // crash loads it instead of reading the whole file (`behind.rs`,
    // "Quick repair"); its second phase's header waits behind the first
    // sync there, not here.
    txn.set_quick_repair(true);
    let committed = redo::record_generation(&txn, log.generation)
        .and_then(|()| txn.commit().map_err(StoreError::from));
    if let Err(e) = committed {
        if !e.is_transient() {
            log.pending = Some(restore(db, overlay)?);
        }
        return Err(e);
    }
    shared.retire(overlay.restart());
    log.checkpointed()
}

/// A new pending write transaction holding the overlay's rows: what an
/// aborted one held (a batch that failed part-way, or a checkpoint whose
/// commit failed), since the overlay holds every row logged since the
/// last checkpoint and nothing else.
fn restore(db: &Database, overlay: &Overlay) -> StoreResult<Pending> {
    let txn = begin(db)?;
    for (table, cleared, rows) in overlay.latest() {
        redo::apply_rows(&txn, table, cleared, &rows)?;
    }
    Ok(Pending::of(txn))
}

/// After a checkpoint fails, the next waits this long, doubling with
/// each failure up to `CHECKPOINT_RETRY_MAX`: a failed checkpoint costs a
/// reopen (redb refuses every call after it), whose replay of the log
/// holds reads up for a moment, so a full disk must not bring one every
/// `--checkpoint-interval`. Commits go on meanwhile, into the log.
const CHECKPOINT_RETRY_MIN: std::time::Duration = std::time::Duration::from_millis(500);
const CHECKPOINT_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// When no write waits for the writer, a checkpoint comes after this
/// share of `--checkpoint-interval` (20 ms of the default 50 ms); when
/// writes queue, after the whole interval. A share rather than a fixed
/// time, so that an operator who sets a long interval (fewer writes to
/// the disk) still gets one.
///
/// Why sooner when idle: a checkpoint holds the writer while redb commits
/// every page the generation dirtied (since `behind.rs`, it hands them
/// over rather than writing and syncing them, a shorter pause), so its
/// pause grows with the rows since the last one, and a lone submit that
/// arrives meanwhile waits it out: at one
/// connection, every 50 ms meant a ~2 ms pause before one submit in ~90,
/// which set the p99. Under load the same pause is shared by a queue of
/// submits, and a checkpoint's fixed cost by more rows: at 32
/// connections a 20 ms interval cost 16% of the rate against 50 ms
/// (interleaved runs, docs/performance-history.md, "Tables kept open").
pub(super) const CHECKPOINT_IDLE_SHARE: f64 = 0.4;

/// Whether the writer checkpoints now, after a batch it answered:
/// `since` the last checkpoint (or failed try), the interval (`every`),
/// the pause after failures (`retry`, zero while checkpoints succeed),
/// the log's length, and whether a write is already waiting. Pure, so the
/// policy is tested without a clock.
pub(super) fn checkpoint_due(
    since: std::time::Duration,
    every: std::time::Duration,
    retry: std::time::Duration,
    log_bytes: u64,
    write_waiting: bool,
) -> bool {
    let interval = match write_waiting {
        true => every,
        false => every.mul_f64(CHECKPOINT_IDLE_SHARE),
    };
    since >= interval.max(retry) || (log_bytes >= redo::CHECKPOINT_BYTES && since >= retry)
}

/// What the writer keeps from one batch to the next; whoever runs a
/// batch holds it (`Shared::turn`).
pub(super) struct Turn {
    last_checkpoint: std::time::Instant,
    /// Zero while checkpoints succeed; else the pause before the next try.
    checkpoint_retry: std::time::Duration,
    /// The batch's rows go straight into the redo record (`RecordBuf`).
    record: redo::RecordBuf,
}

impl Turn {
    /// Whether a checkpoint is due after the next batch, were it run
    /// now with nothing queued behind it.
    pub(super) fn checkpoint_due(&self, log: &RedoLog) -> bool {
        checkpoint_due(
            self.last_checkpoint.elapsed(),
            log.checkpoint_every,
            self.checkpoint_retry,
            log.bytes(),
            false,
        )
    }

    pub(super) fn new() -> Turn {
        Turn {
            last_checkpoint: std::time::Instant::now(),
            checkpoint_retry: std::time::Duration::ZERO,
            record: redo::RecordBuf::default(),
        }
    }
}

pub(super) fn writer_loop(shared: Arc<Shared>, mut rx: mpsc::Receiver<WriteJob>) {
    while let Some(first) = rx.blocking_recv() {
        // Sized once for what is queued: grown one push at a time it
        // was reallocated (and its jobs copied) at each doubling.
        let mut batch = Vec::with_capacity(MAX_JOBS_PER_COMMIT.min(rx.len() + 1));
        batch.push(first);
        while batch.len() < MAX_JOBS_PER_COMMIT {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let mut turn = shared.turn.held();
        run_batch(&shared, &mut turn, batch, Place::WriterThread(&rx));
    }
}

/// Where a batch runs (`run_batch`).
pub(super) enum Place<'q> {
    /// On the writer thread, which took it off the write queue.
    WriterThread(&'q mpsc::Receiver<WriteJob>),
    /// On the thread of the caller that submitted it, a lone job on an
    /// idle store with no checkpoint due (`Store::run_here_if_idle`);
    /// the queue's sending side, to see what queues meanwhile.
    Caller(&'q mpsc::Sender<WriteJob>),
}

impl Place<'_> {
    /// Whether jobs wait in the write queue.
    fn queued(&self) -> bool {
        match self {
            Place::WriterThread(rx) => !rx.is_empty(),
            Place::Caller(tx) => tx.capacity() < tx.max_capacity(),
        }
    }
}

/// Runs one batch: its jobs in the pending transaction, its commit (or
/// its hand-over to the syncer), its answers, and the checkpoint when one
/// is due and this is the writer thread. The caller holds `turn` (the
/// writer's state between batches), so batches run one at a time, in the
/// order they take it, wherever they run.
///
/// A panic past the jobs (which are caught one by one) may leave the
/// pending transaction taken and not given back, and a batch after it
/// would then begin a new one without the rows acknowledged since the
/// last checkpoint: the store is reopened, which applies the log again,
/// as after an I/O error. The jobs it left unanswered see the
/// closed-store error.
pub(super) fn run_batch(shared: &Shared, turn: &mut Turn, batch: Vec<WriteJob>, place: Place<'_>) {
    let jobs = batch.len();
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_batch_unguarded(shared, turn, batch, &place)
    }));
    // Written by the turn's holder only, so a load and a store suffice.
    let lone = &shared.lone_batches_in_a_row;
    let in_a_row = match jobs == 1 && !place.queued() {
        true => (lone.load(std::sync::atomic::Ordering::Relaxed) + 1).min(QUIET_BATCHES),
        false => 0,
    };
    lone.store(in_a_row, std::sync::atomic::Ordering::Relaxed);
    if ran.is_err() {
        tracing::error!("a store batch panicked; reopening the store from its redo log");
        shared.reopen();
    }
}

fn run_batch_unguarded(
    shared: &Shared,
    turn: &mut Turn,
    mut batch: Vec<WriteJob>,
    place: &Place<'_>,
) {
    let Turn {
        last_checkpoint,
        checkpoint_retry,
        record,
    } = turn;
    record.start();
    let Some(db) = handle(shared, &batch) else {
        let e = closed_or_reopening(shared);
        batch
            .into_iter()
            .for_each(|job| (job.finish)(Some(e.clone())));
        return;
    };
    // Before the transaction: the one lock order (`Shared::redo`).
    let mut log = shared.redo_log();
    // A close has begun (`Store::close`), and its last checkpoint is
    // the file's last commit: a batch after it would leave rows only
    // the log holds, and a write transaction redb cannot close the
    // file with. Checked under the log's lock, which the close takes
    // after raising the flag, so no batch slips in between.
    if shared.closed.load(std::sync::atomic::Ordering::SeqCst) {
        drop(log);
        batch
            .into_iter()
            .for_each(|job| (job.finish)(Some(StoreError::closed())));
        return;
    }
    // Batches the syncer refused left their rows in the pending
    // transaction: out with them before this batch runs in it.
    let unsettled = match log.as_deref_mut() {
        Some(log) if shared.syncer.as_ref().is_some_and(Syncer::failed) => {
            settle(shared, &db, log).err()
        }
        _ => None,
    };
    if let Some(refused) = unsettled {
        batch
            .into_iter()
            .for_each(|job| (job.finish)(Some(refused.error.clone())));
        drop(log);
        drop(db);
        shared.reopen();
        return;
    }
    let txn = match pending_or_begin(&db, log.as_deref_mut()) {
        Ok(pending) => pending,
        Err(err) => {
            tracing::error!(error = %err, "store write transaction could not start");
            batch
                .into_iter()
                .for_each(|job| (job.finish)(Some(err.clone())));
            if err.is_transient() {
                drop(log);
                drop(db);
                shared.reopen();
            }
            return;
        }
    };
    let (failed, hooks) = run_in(&txn, log.is_some(), record, |tx| {
        let mut failed = Vec::with_capacity(batch.len());
        for job in batch.iter_mut() {
            // A job that panics fails its batch as an error would: the
            // pending transaction is given the overlay's rows again
            // (`abandon`), so no acknowledged row goes with it.
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (job.run)(tx)));
            let failure = run.unwrap_or_else(|_| {
                tracing::error!(
                    "a write job panicked; its batch is dropped and the rest run again"
                );
                Some(StoreError::other(
                    "a write job failed unexpectedly; nothing of it was stored",
                ))
            });
            let stop = failure.is_some();
            failed.push(failure);
            if stop {
                // Nothing of this batch will land: the rest run alone.
                break;
            }
        }
        failed.resize_with(batch.len(), || None);
        failed
    });
    let job_failed = failed.iter().any(Option::is_some);
    // A batch takes the reserve only if every job in it may.
    let urgency = match batch.iter().all(|j| j.urgency == redo::Urgency::Must) {
        true => redo::Urgency::Must,
        false => redo::Urgency::May,
    };
    let (refused, hooks, batch) = match log.as_deref_mut() {
        _ if job_failed => {
            // A job failed part-way: nothing of this batch may land.
            let refused = abandon(shared, txn, &db, log.as_deref_mut()).err();
            (refused, hooks, batch)
        }
        Some(log) if goes_behind(shared, batch.len(), place.queued()) => {
            match hand_over(shared, txn, &db, log, record, urgency, hooks, batch) {
                Ok(()) => (None, Vec::new(), Vec::new()),
                Err((refused, hooks, batch)) => (Some(refused), hooks, batch),
            }
        }
        _ => {
            let refused = commit(shared, txn, &db, log.as_deref_mut(), record, urgency).err();
            (refused, hooks, batch)
        }
    };
    if !job_failed && refused.is_none() {
        // Answered here, or by the syncer once its sync covers them.
        run_hooks(hooks);
        batch.into_iter().for_each(|job| (job.finish)(None));
        let mut handle_lost = false;
        if let Some(log) = log.as_deref_mut() {
            let due = match place {
                Place::WriterThread(_) => checkpoint_due(
                    last_checkpoint.elapsed(),
                    log.checkpoint_every,
                    *checkpoint_retry,
                    log.bytes(),
                    place.queued(),
                ),
                // Not on a caller's thread, which would hold its answer
                // for the checkpoint's redb commit: one due before the
                // batch sent it to the writer thread instead
                // (`Store::run_here_if_idle`), and one that fell due
                // during it is made after the next batch, which goes
                // there for it.
                Place::Caller(_) => false,
            };
            if due {
                *last_checkpoint = std::time::Instant::now();
                match checkpoint_with(shared, &db, log) {
                    Ok(()) => *checkpoint_retry = std::time::Duration::ZERO,
                    Err(e) => {
                        // The log still holds every commit since the
                        // last one; a later checkpoint tries again.
                        *checkpoint_retry = (*checkpoint_retry * 2)
                            .clamp(CHECKPOINT_RETRY_MIN, CHECKPOINT_RETRY_MAX);
                        tracing::error!(error = %e, retry_in = ?checkpoint_retry, log_bytes = log.bytes(),
                                "store checkpoint failed; commits go on into the redo log");
                        handle_lost = e.is_transient() || log.pending.is_none();
                    }
                }
            }
        }
        if handle_lost {
            // Now, so the next batch does not meet the failed handle.
            drop(log);
            drop(db);
            shared.reopen();
        }
        return;
    }
    let commit_error = refused.as_ref().map(|r| r.error.clone());
    let handle_lost = refused.as_ref().is_some_and(|r| r.handle_lost);
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
    if handle_lost {
        renew(shared, &mut db, &mut log);
    }
    // The batch did not land. A job that failed by itself gets its own
    // error; every other job runs again, alone, so one job's error (or
    // one too large for the disk) never fails its batch-mates.
    for (job, failure) in batch.into_iter().zip(failed) {
        let poisoned = match (failure, &db, &commit_error) {
            (Some(e), _, _) => {
                (job.finish)(Some(e));
                false
            }
            (None, _, Some(e)) if !e.is_transient() && !job_failed => {
                (job.finish)(Some(e.clone()));
                false
            }
            (None, Some(db), _) => {
                run_alone(shared, db, job, log.as_deref_mut(), record) == Some(true)
            }
            (None, None, _) => {
                (job.finish)(Some(closed_or_reopening(shared)));
                false
            }
        };
        if poisoned {
            // The next job runs on a fresh handle, not the failed one.
            renew(shared, &mut db, &mut log);
        }
    }
}

/// Lets go of a failed handle (and the log's lock, taken again after, in
/// the one lock order) and reopens the file.
fn renew<'s>(
    shared: &'s Shared,
    db: &mut Option<Arc<Database>>,
    log: &mut Option<std::sync::MutexGuard<'s, RedoLog>>,
) {
    drop(log.take());
    drop(db.take());
    shared.reopen();
    *db = shared.current();
    *log = shared.redo_log();
}

/// A write transaction, committed durably: without a redo log, by its
/// batch; with one, by the next checkpoint.
fn begin(db: &Database) -> StoreResult<WriteTransaction> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| StoreError::other(e.to_string()))?;
    Ok(txn)
}

/// Runs `jobs` in `txn` with the tables it keeps open; with a redo log
/// (`logged`), the rows they write go into `record`'s buffer (lent for the
/// run, taken back after). Returns what `jobs` returned and the hooks to
/// run after the commit.
fn run_in<R>(
    txn: &Pending,
    logged: bool,
    record: &mut redo::RecordBuf,
    jobs: impl FnOnce(&Tx<'_, '_>) -> R,
) -> (R, Vec<Hook>) {
    let ops = logged.then(|| record.lend());
    let (outcome, hooks, ops) = txn.with_dependent(|txn, open| {
        let tx = Tx::pending(txn, open, ops);
        let outcome = jobs(&tx);
        let (hooks, ops) = tx.finish();
        (outcome, hooks, ops)
    });
    if let Some(ops) = ops {
        record.take_back(ops);
    }
    (outcome, hooks)
}

/// The transaction a batch runs in: with a redo log, the pending one that
/// holds every row logged since the last checkpoint (a new one after a
/// checkpoint); without, its own.
fn pending_or_begin(db: &Database, log: Option<&mut RedoLog>) -> StoreResult<Pending> {
    match log.and_then(|log| log.pending.take()) {
        Some(pending) => Ok(pending),
        None => begin(db).map(Pending::of),
    }
}

/// A commit that did not land: why, and whether the handle went with it
/// (redb refuses every call after an I/O error in its commit; a redo log
/// that refused an append aborted the transaction and left it whole).
struct Refused {
    error: StoreError,
    handle_lost: bool,
}

impl Refused {
    fn by_redb(error: StoreError) -> Refused {
        let handle_lost = error.is_transient();
        Refused { error, handle_lost }
    }
}

/// Drops what a batch wrote: without a redo log its transaction aborts;
/// with one, the pending transaction held earlier batches' rows too, so a
/// new one is given them again from the overlay (`restore`). A restore
/// that fails loses the handle (the reopen replays the log).
fn abandon(
    shared: &Shared,
    txn: Pending,
    db: &Database,
    log: Option<&mut RedoLog>,
) -> Result<(), Refused> {
    let _ = txn.into_txn().abort();
    let Some(log) = log else {
        return Ok(());
    };
    // The overlay must hold every answered batch's rows before it is
    // given to a new transaction: the syncer's first.
    if let Some(failure) = shared.syncer.as_ref().and_then(Syncer::settle) {
        rewind(log, &failure);
    }
    match restore(db, &shared.overlay) {
        Ok(txn) => {
            log.pending = Some(txn);
            Ok(())
        }
        Err(error) => {
            tracing::error!(error = %error, "cannot restore the pending transaction; reopening the store");
            Err(Refused {
                error,
                handle_lost: true,
            })
        }
    }
}

/// Waits until the syncer has answered every batch handed to it. When it
/// refused some, the pending transaction (which holds their rows) is
/// aborted and given the overlay's rows again, and the log rewound.
fn settle(shared: &Shared, db: &Database, log: &mut RedoLog) -> Result<(), Refused> {
    let Some(failure) = shared.syncer.as_ref().and_then(Syncer::settle) else {
        return Ok(());
    };
    rewind(log, &failure);
    match log.pending.take() {
        Some(txn) => abandon(shared, txn, db, Some(log)),
        None => Ok(()),
    }
}

/// After the syncer voided the records it refused: the next record goes
/// where the first of them began.
fn rewind(log: &mut RedoLog, failure: &syncer::Failure) {
    if let Some(from) = failure.from {
        log.rewind(from);
    }
    log.remember_unvoided(&failure.unvoided);
}

/// Whether a batch goes to the syncer rather than being synced here: when
/// its sync can overlap other work (the next batch's jobs are already
/// queued, or this one has several, a sign of load), or when batches are
/// in the syncer's hands (answers go out in order). A lone submit on an
/// idle store is synced here: handing it over costs a thread wake-up and
/// overlaps nothing.
fn goes_behind(shared: &Shared, jobs: usize, queued: bool) -> bool {
    match &shared.syncer {
        Some(syncer) => jobs > 1 || queued || !syncer.idle(),
        None => false,
    }
}

/// Hands a batch whose jobs ran to the syncer (`syncer.rs`): its record is
/// written here, and its sync, publication, hooks and answers follow
/// there; the transaction stays pending. A batch the syncer cannot take
/// is given back, its rows dropped (`abandon`), with why.
#[allow(clippy::too_many_arguments)]
fn hand_over(
    shared: &Shared,
    txn: Pending,
    db: &Database,
    log: &mut RedoLog,
    record: &mut redo::RecordBuf,
    urgency: redo::Urgency,
    hooks: Vec<Hook>,
    jobs: Vec<WriteJob>,
) -> Result<(), (Refused, Vec<Hook>, Vec<WriteJob>)> {
    let answers = Answers { hooks, jobs };
    let copy = record.shared_rows();
    let handed = match (redo::ops_in(&copy), shared.syncer.as_ref()) {
        (Ok(ops), Some(syncer)) => {
            let staged = super::overlay::Staged::of_record(&copy, ops);
            syncer.hand(log, record, urgency, staged, answers)
        }
        (Err(error), _) => Err((error, answers)),
        (Ok(_), None) => Err((
            StoreError::other("no redo log syncer to hand a batch to"),
            answers,
        )),
    };
    match handed {
        Ok(()) => {
            log.pending = Some(txn);
            Ok(())
        }
        Err((error, Answers { hooks, jobs })) => {
            let handle_lost = abandon(shared, txn, db, Some(log)).is_err();
            Err((Refused { error, handle_lost }, hooks, jobs))
        }
    }
}

/// Runs a committed batch's hooks in order. A hook that panics is logged
/// and skipped: its batch is durable and its jobs are still answered, and
/// the thread running it (the writer, or the syncer) must go on, or every
/// later write would fail or wait for ever.
fn run_hooks(hooks: Vec<Hook>) {
    for hook in hooks {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(hook)).is_err() {
            tracing::error!("an after-commit hook panicked; its batch is committed and answered");
        }
    }
}

/// What a batch handed to the syncer leaves to do once its sync is done:
/// run its hooks and answer its jobs; or, refused, answer them with why.
struct Answers {
    hooks: Vec<Hook>,
    jobs: Vec<WriteJob>,
}

impl syncer::Answer for Answers {
    fn answer(self, refused: Option<StoreError>) {
        match refused {
            None => {
                run_hooks(self.hooks);
                self.jobs.into_iter().for_each(|job| (job.finish)(None));
            }
            Some(error) => {
                drop(self.hooks);
                self.jobs
                    .into_iter()
                    .for_each(|job| (job.finish)(Some(error.clone())));
            }
        }
    }
}

/// Commits a batch. Without a redo log, redb's durable commit. With one,
/// its rows are appended to the log and synced, then published to
/// readers (the overlay), and the transaction stays pending until the
/// next checkpoint; a log that cannot be written drops the batch's rows
/// (`abandon`).
fn commit(
    shared: &Shared,
    txn: Pending,
    db: &Database,
    log: Option<&mut RedoLog>,
    record: &mut redo::RecordBuf,
    urgency: redo::Urgency,
) -> Result<(), Refused> {
    let Some(log) = log else {
        return txn
            .into_txn()
            .commit()
            .map_err(|e| Refused::by_redb(e.into()));
    };
    // Synced here only when nothing waits in the syncer (`goes_behind`),
    // or this batch's answers would overtake those.
    debug_assert!(shared.syncer.as_ref().is_none_or(Syncer::idle));
    if record.rows().is_empty() {
        log.pending = Some(txn);
        return Ok(());
    }
    let appended = match crate::failpoints::hit_in("redo.append", record.rows()) {
        true => Err(StoreError::injected("redo.append")),
        false => log.append(record, urgency),
    };
    let start = match appended {
        Ok(start) => start,
        Err(error) => {
            abandon(shared, txn, db, Some(log))?;
            return Err(Refused {
                error,
                handle_lost: false,
            });
        }
    };
    let published = match crate::failpoints::hit_in("redo.commit", record.rows()) {
        true => Err(StoreError::injected("redo.commit")),
        false => {
            let copy = record.shared_rows();
            redo::ops_in(&copy).map(|ops| {
                let staged = super::overlay::Staged::of_record(&copy, ops);
                shared.overlay.publish_staged(staged)
            })
        }
    };
    if let Err(error) = published {
        if let Err(undo) = log.take_back(start) {
            tracing::error!(error = %undo, "cannot take a refused commit back out of the redo log");
        }
        abandon(shared, txn, db, Some(log))?;
        return Err(Refused {
            error,
            handle_lost: false,
        });
    }
    log.pending = Some(txn);
    Ok(())
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

/// Runs one job in a transaction of its own (with a redo log, the pending
/// one, with nothing of another job in it), committed as any batch is
/// (with a redo log, through it: a full disk then refuses the append,
/// cheaply, and leaves the handle whole). Returns `Some(true)` when the
/// handle must be reopened (an I/O error in redb), `Some(false)` on
/// another failure, `None` when it committed.
fn run_alone(
    shared: &Shared,
    db: &Database,
    mut job: WriteJob,
    mut log: Option<&mut RedoLog>,
    record: &mut redo::RecordBuf,
) -> Option<bool> {
    let txn = match pending_or_begin(db, log.as_deref_mut()) {
        Ok(pending) => pending,
        Err(err) => {
            let transient = err.is_transient();
            (job.finish)(Some(err));
            return Some(transient);
        }
    };
    record.start();
    let (failure, hooks) = run_in(&txn, log.is_some(), record, |tx| (job.run)(tx));
    if let Some(e) = failure {
        let lost = abandon(shared, txn, db, log).is_err();
        (job.finish)(Some(e));
        return Some(lost);
    }
    match commit(shared, txn, db, log, record, job.urgency) {
        Ok(()) => {
            run_hooks(hooks);
            (job.finish)(None);
            None
        }
        Err(refused) => {
            tracing::error!(error = %refused.error, "store commit of a re-run job failed");
            (job.finish)(Some(refused.error));
            Some(refused.handle_lost)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const EVERY: Duration = Duration::from_millis(50);
    const NO_RETRY: Duration = Duration::ZERO;

    #[test]
    fn an_idle_writer_checkpoints_sooner_than_a_busy_one() {
        let soon = Duration::from_millis(20);
        assert!(checkpoint_due(soon, EVERY, NO_RETRY, 0, false));
        assert!(!checkpoint_due(soon, EVERY, NO_RETRY, 0, true));
        let sooner = soon - Duration::from_millis(1);
        assert!(!checkpoint_due(sooner, EVERY, NO_RETRY, 0, false));
        assert!(checkpoint_due(EVERY, EVERY, NO_RETRY, 0, true));
    }

    #[test]
    fn a_long_interval_stays_long_when_idle() {
        // An operator who asked for a checkpoint a minute apart gets one
        // after 24 s when idle, not after 20 ms.
        let every = Duration::from_secs(60);
        assert!(!checkpoint_due(
            Duration::from_secs(23),
            every,
            NO_RETRY,
            0,
            false
        ));
        assert!(checkpoint_due(
            Duration::from_secs(24),
            every,
            NO_RETRY,
            0,
            false
        ));
        assert!(!checkpoint_due(
            Duration::from_secs(59),
            every,
            NO_RETRY,
            0,
            true
        ));
    }

    #[test]
    fn a_full_log_checkpoints_at_once_unless_failures_ask_for_a_pause() {
        let full = redo::CHECKPOINT_BYTES;
        assert!(checkpoint_due(Duration::ZERO, EVERY, NO_RETRY, full, true));
        let retry = CHECKPOINT_RETRY_MIN;
        // After a failure neither a full log nor an idle writer comes
        // before the pause is over: a failed checkpoint costs a reopen.
        assert!(!checkpoint_due(retry / 2, EVERY, retry, full, true));
        assert!(!checkpoint_due(retry / 2, EVERY, retry, 0, false));
        assert!(checkpoint_due(retry, EVERY, retry, 0, false));
        assert!(checkpoint_due(retry, EVERY, retry, full, true));
    }
}
