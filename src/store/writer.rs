//! The writer thread and the file handle it shares with readers.
//!
//! One thread group-commits: every write job queued while the previous
//! batch was being made durable runs in the next single transaction. A
//! batch is run by `run_batch`, under `Shared::turn`: by this thread, or,
//! for a lone job on an idle store, by the thread that submitted it
//! (`Store::run_here_if_idle`), which never checkpoints: a checkpoint is
//! made here, after the batch that finds it due (`Place`).
//!
//! With a redo log (a store held alone) a batch becomes durable so:
//! its jobs run in a write transaction; its rows, recorded as they are
//! written (`logged.rs`), are appended to the log and fdatasynced; then
//! the transaction commits to redb non-durably (readers see it at once);
//! then its hooks run and its jobs are answered. A checkpoint is redb's
//! durable commit, recording the log's generation, after which the log is
//! written from its start again. Without a redo log (`--shared-store`)
//! each batch is redb's own durable commit.
//!
//! Failures: a job that fails (or panics) aborts the batch, whose other
//! jobs run again, each alone. A log that refuses an append (a full disk)
//! aborts the batch and leaves the handle whole. Any I/O failure of redb
//! after an append (its commit, a checkpoint) is handled by one path: the
//! batch's record is voided, the handle dropped, the file reopened and
//! the log replayed (`Shared::reopen`). While the file cannot be opened
//! for writing, reads wait (503 after `READ_WAIT_ATTEMPTS`).

use std::path::Path;
use std::sync::Arc;

use redb::{Database, Durability, ReadableDatabase, WriteTransaction};
use tokio::sync::mpsc;

use super::logged::Pending;
use super::redo::{self, RedoLog};
use super::upstream::Upstream;
use super::{StoreError, StoreResult, Tx, MAX_JOBS_PER_COMMIT};
use crate::locks::{Held, HeldRw};

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
    /// While the file cannot be opened for writing (a full disk) and
    /// there is no redo log, reads go through a read-only handle.
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
    /// The store's database, when it is in PostgreSQL (`upstream.rs`):
    /// each batch commits there first. Locked after `redo`.
    pub(super) upstream: Option<std::sync::Mutex<Upstream>>,
    /// With `upstream`: whether this replica surely still leads, so that
    /// its file holds every write (`upstream::Freshness`).
    pub(super) lease: Option<Arc<super::upstream::Freshness>>,
    /// The writer's state between batches, held by whoever runs one.
    pub(super) turn: std::sync::Mutex<Turn>,
    /// How many batches in a row were one job with none queued behind it
    /// when they ended (counting stops at `QUIET_BATCHES`): the store is
    /// idle, not between two batches of a load. `Store::run_here_if_idle`
    /// runs a job where it was submitted only after `QUIET_BATCHES` of
    /// them.
    pub(super) lone_batches_in_a_row: std::sync::atomic::AtomicU32,
}

/// Lone batches in a row after which the store counts as idle
/// (`Shared::lone_batches_in_a_row`). Why more than one: at 32
/// connections a batch of one now and then falls between two waves of
/// submits, and the first of the next wave, run on its worker, would hold
/// that worker (and the wave queued behind it) for its sync.
pub(super) const QUIET_BATCHES: u32 = 3;

impl Shared {
    pub(super) fn redo_log(&self) -> Option<std::sync::MutexGuard<'_, RedoLog>> {
        self.redo.as_ref().map(|m| m.held())
    }

    /// Makes every commit so far durable (`checkpoint_with`). The only
    /// way berth commits durably while it keeps a redo log.
    pub(super) fn checkpoint(&self) -> StoreResult<()> {
        let Some(mut log) = self.redo_log() else {
            return Ok(());
        };
        let Some(db) = self.current() else {
            return Err(StoreError::reopening());
        };
        checkpoint_with(&db, &mut log)
    }

    /// A reader: redb's read transaction, which sees every batch answered
    /// before it began.
    pub(super) fn begin_read(&self, db: &Database) -> StoreResult<super::Rx> {
        Ok(super::Rx {
            txn: db.begin_read()?,
        })
    }

    pub(super) fn current(&self) -> Option<Arc<Database>> {
        self.db.read_held().clone()
    }

    /// Drops the failed handle and opens the file again, applying the
    /// redo log non-durably (`Replay::KeepLog`: a reopen writes nothing
    /// to the store file, so it succeeds on the full disk that perhaps
    /// made the handle fail; the next checkpoint that succeeds makes the
    /// rows durable). Leaves `None` when it cannot open yet (the next
    /// write tries again).
    ///
    /// Its pauses between tries run off the async workers: a lone write
    /// meets a failure on the worker that submitted it (`block_in_place`).
    pub(super) fn reopen(&self) {
        off_the_workers(|| self.reopen_here())
    }

    fn reopen_here(&self) {
        let old = self.db.write_held().take();
        drop(old);
        // The read-only handle (if any) would keep the writer out.
        let old_ro = self.read_only.write_held().take();
        drop(old_ro);
        for _ in 0..REOPEN_ATTEMPTS {
            // A shared store keeps no log (and redb refuses its
            // non-durable replay): its handle is only opened again.
            let reopened = match self.redo.is_some() {
                true => {
                    open_and_replay(&self.path, self.sharing, self.cache, redo::Replay::KeepLog)
                        .map(|(db, at)| (db, Some(at)))
                }
                false => open_database(&self.path, self.sharing, self.cache).map(|db| (db, None)),
            };
            match reopened {
                Ok((db, at)) => {
                    if let (Some(mut log), Some(at)) = (self.redo_log(), at) {
                        log.resume(at);
                    }
                    tracing::warn!(path = %self.path.display(), "store reopened after an I/O error");
                    *self.db.write_held() = Some(Arc::new(db));
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

/// Waits `REOPEN_PAUSE` for a reopen in progress, off the async workers.
pub(super) fn pause_for_reopen() {
    off_the_workers(|| std::thread::sleep(REOPEN_PAUSE))
}

/// Runs `f`, which may block for a while: on a runtime worker the worker
/// first hands its other tasks on (`block_in_place`), so unrelated
/// requests never wait for it; elsewhere it simply runs.
fn off_the_workers<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Opens (or creates) the store file as `sharing` says, with redb
/// holding at most `cache` of its pages.
pub(super) fn open_database(
    path: &Path,
    sharing: super::Sharing,
    cache: super::CacheSize,
) -> StoreResult<Database> {
    Ok(super::redb_builder(sharing.mode(), cache).create(path)?)
}

/// Opens the store file and applies its redo log as `how` says: the one
/// way berth opens its store, at start (`Replay::Checkpoint`, durably) and
/// after an I/O error (`Replay::KeepLog`). A file redb cannot open as a
/// store is `Damaged` (the start names the repair).
pub(super) fn open_and_replay(
    path: &Path,
    sharing: super::Sharing,
    cache: super::CacheSize,
    how: redo::Replay,
) -> StoreResult<(Database, redo::Resume)> {
    let db = open_database(path, sharing, cache).map_err(|e| match e.kind {
        super::StoreErrorKind::Corrupt => StoreError {
            kind: super::StoreErrorKind::Damaged,
            detail: e.detail,
        },
        _ => e,
    })?;
    let resume = redo::replay(&db, path, super::LAYOUT_VERSION, how)?;
    Ok((db, resume))
}

/// A checkpoint: one durable redb commit that records `log`'s generation
/// (every non-durable commit before it becomes durable with it), then the
/// log is written from its start again, one generation on (its records
/// are all in the file now, and a replay skips them). redb saves its
/// allocator state in the commit (quick repair), so a start after a crash
/// loads it instead of reading the whole file.
fn checkpoint_with(db: &Database, log: &mut RedoLog) -> StoreResult<()> {
    // The failpoint's subject is the process's checkpoint count, counted
    // only in a build that has failpoints (no work on a release's path).
    #[cfg(feature = "failpoints")]
    {
        static CHECKPOINTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = CHECKPOINTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if crate::failpoints::hit("redb.checkpoint", &n.to_string()) {
            return Err(StoreError::injected("redb.checkpoint"));
        }
    }
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| StoreError::other(e.to_string()))?;
    txn.set_quick_repair(true);
    redo::record_generation(&txn, log.generation)?;
    txn.commit()?;
    log.restart(log.generation + 1)
}

/// After a checkpoint fails, the next waits this long, doubling with
/// each failure up to `CHECKPOINT_RETRY_MAX`: a failed checkpoint costs a
/// reopen (redb refuses every call after it), whose replay of the log
/// holds reads up for a moment, so a full disk must not bring one every
/// `--checkpoint-interval`. Commits go on meanwhile, into the log.
const CHECKPOINT_RETRY_MIN: std::time::Duration = std::time::Duration::from_millis(500);
const CHECKPOINT_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// When no write waits for the writer, a checkpoint comes after this
/// share of `--checkpoint-interval`; when writes queue, after the whole
/// interval. A share rather than a fixed time, so that an operator who
/// sets a long interval (fewer writes to the disk) still gets one.
///
/// Why sooner when idle: a checkpoint holds the writer while redb writes
/// and syncs every page the interval dirtied, so its pause grows with the
/// rows since the last one, and a lone submit that arrives meanwhile
/// waits it out; under load the same pause is shared by a queue of
/// submits.
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

    /// Checkpoints when one is due after a batch the writer thread ran;
    /// true when the handle failed with it (it is then reopened).
    fn checkpoint_if_due(&mut self, db: &Database, log: &mut RedoLog, queued: bool) -> bool {
        let due = checkpoint_due(
            self.last_checkpoint.elapsed(),
            log.checkpoint_every,
            self.checkpoint_retry,
            log.bytes(),
            queued,
        );
        if !due {
            return false;
        }
        self.last_checkpoint = std::time::Instant::now();
        match checkpoint_with(db, log) {
            Ok(()) => {
                self.checkpoint_retry = std::time::Duration::ZERO;
                false
            }
            Err(e) => {
                // The log still holds every commit since the last one; a
                // later checkpoint tries again.
                self.checkpoint_retry =
                    (self.checkpoint_retry * 2).clamp(CHECKPOINT_RETRY_MIN, CHECKPOINT_RETRY_MAX);
                tracing::error!(error = %e, retry_in = ?self.checkpoint_retry, log_bytes = log.bytes(),
                        "store checkpoint failed; commits go on into the redo log");
                // redb refuses every call after a failed commit.
                true
            }
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

/// Runs one batch: its jobs in one transaction, its commit, its answers,
/// and the checkpoint when one is due and this is the writer thread. The
/// caller holds `turn` (the writer's state between batches), so batches
/// run one at a time, in the order they take it, wherever they run.
///
/// A panic past the jobs (which are caught one by one) reopens the store
/// from its redo log, as after an I/O error; the jobs it left unanswered
/// see the closed-store error.
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

/// Answers every job of `batch` with `e`.
fn fail_all(batch: Vec<WriteJob>, e: &StoreError) {
    batch
        .into_iter()
        .for_each(|job| (job.finish)(Some(e.clone())));
}

fn run_batch_unguarded(
    shared: &Shared,
    turn: &mut Turn,
    mut batch: Vec<WriteJob>,
    place: &Place<'_>,
) {
    let Some(db) = handle(shared) else {
        return fail_all(batch, &closed_or_reopening(shared));
    };
    // Before the transaction: the one lock order (`Shared::redo`).
    let mut log = shared.redo_log();
    // A close has begun (`Store::close`), and its last checkpoint is the
    // file's last commit: a batch after it would leave rows only the log
    // holds. Checked under the log's lock, which the close takes after
    // raising the flag, so no batch slips in between.
    if shared.closed.load(std::sync::atomic::Ordering::SeqCst) {
        drop(log);
        return fail_all(batch, &StoreError::closed());
    }
    let txn = match begin(&db, log.is_some()) {
        Ok(txn) => Pending::of(txn),
        Err(err) => {
            tracing::error!(error = %err, "store write transaction could not start");
            fail_all(batch, &err);
            if err.is_transient() {
                drop(log);
                drop(db);
                shared.reopen();
            }
            return;
        }
    };
    turn.record.start();
    let (failed, hooks) = run_in(&txn, log.is_some(), &mut turn.record, |tx| {
        run_jobs(tx, &mut batch)
    });
    let job_failed = failed.iter().any(Option::is_some);
    let refused = match job_failed {
        // A job failed part-way: nothing of this batch may land.
        true => {
            abort(txn);
            None
        }
        false => commit(
            txn,
            log.as_deref_mut(),
            shared.upstream.as_ref(),
            &mut turn.record,
            urgency_of(&batch),
        )
        .err(),
    };
    if !job_failed && refused.is_none() {
        run_hooks(hooks);
        batch.into_iter().for_each(|job| (job.finish)(None));
        let lost = match (log.as_deref_mut(), place) {
            (Some(log), Place::WriterThread(_)) => turn.checkpoint_if_due(&db, log, place.queued()),
            // Not on a caller's thread, which would hold its answer for
            // the checkpoint: one due sends the batch to the writer thread
            // (`Store::run_here_if_idle`).
            (Some(_), Place::Caller(_)) | (None, _) => false,
        };
        if lost {
            drop(log);
            drop(db);
            shared.reopen();
        }
        return;
    }
    drop(hooks);
    retry_alone(shared, turn, batch, failed, refused, db, log);
}

/// Runs the batch's jobs in order until one fails (or panics): what each
/// failed with, `None` for those that ran well or did not run.
fn run_jobs(tx: &Tx<'_, '_>, batch: &mut [WriteJob]) -> Vec<Option<StoreError>> {
    let mut failed = Vec::with_capacity(batch.len());
    for job in batch.iter_mut() {
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (job.run)(tx)));
        let failure = run.unwrap_or_else(|_| {
            tracing::error!("a write job panicked; its batch is dropped and the rest run again");
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
}

/// A batch takes the redo log's reserve only if every job in it may.
fn urgency_of(batch: &[WriteJob]) -> redo::Urgency {
    match batch.iter().all(|j| j.urgency == redo::Urgency::Must) {
        true => redo::Urgency::Must,
        false => redo::Urgency::May,
    }
}

/// A batch that did not land: a job that failed by itself gets its own
/// error; every other job runs again, alone, so one job's error (or one
/// too large for the disk) never fails its batch-mates. A commit that
/// lost the handle reopens it first.
fn retry_alone<'s>(
    shared: &'s Shared,
    turn: &mut Turn,
    batch: Vec<WriteJob>,
    failed: Vec<Option<StoreError>>,
    refused: Option<Refused>,
    db: Arc<Database>,
    mut log: Option<std::sync::MutexGuard<'s, RedoLog>>,
) {
    let job_failed = failed.iter().any(Option::is_some);
    let commit_error = refused.as_ref().map(|r| r.error.clone());
    let handle_lost = refused.as_ref().is_some_and(|r| r.handle_lost);
    match &commit_error {
        Some(e) => tracing::error!(error = %e, jobs = batch.len(), "store commit failed"),
        None => tracing::warn!(
            jobs = batch.len(),
            failed_jobs = failed.iter().filter(|f| f.is_some()).count(),
            "a write job failed; the rest of its batch runs again, each alone"
        ),
    }
    let mut db = Some(db);
    if handle_lost {
        renew(shared, &mut db, &mut log);
    }
    for (job, failure) in batch.into_iter().zip(failed) {
        let lost = match (failure, &db, &commit_error) {
            (Some(e), _, _) => {
                (job.finish)(Some(e));
                false
            }
            (None, _, Some(e)) if !e.is_transient() && !job_failed => {
                (job.finish)(Some(e.clone()));
                false
            }
            (None, Some(db), _) => run_alone(
                db,
                job,
                log.as_deref_mut(),
                shared.upstream.as_ref(),
                &mut turn.record,
            ),
            (None, None, _) => {
                (job.finish)(Some(closed_or_reopening(shared)));
                false
            }
        };
        if lost {
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

/// A batch's write transaction: committed non-durably when a redo log
/// makes it durable first, durably (redb's own commit) when there is none.
fn begin(db: &Database, logged: bool) -> StoreResult<WriteTransaction> {
    let mut txn = db.begin_write()?;
    let durability = match logged {
        true => Durability::None,
        false => Durability::Immediate,
    };
    txn.set_durability(durability)
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

fn abort(txn: Pending) {
    if let Err(e) = txn.into_txn().abort() {
        tracing::debug!(error = %e, "an aborted write transaction reported an error");
    }
}

/// A commit that did not land: why, and whether the handle went with it
/// (redb refuses every call after an I/O error in its commit; a redo log
/// that refused an append aborted the transaction and left it whole).
struct Refused {
    error: StoreError,
    handle_lost: bool,
}

/// Commits a batch. Without a redo log, redb's durable commit. With one,
/// its rows are appended to the log and synced, then redb commits
/// non-durably (readers see the rows from here on). A log that cannot be
/// written aborts the batch; a redb commit that fails after the append
/// takes the record back out of the log (a replay must never apply what
/// was refused) and loses the handle.
fn commit(
    txn: Pending,
    log: Option<&mut RedoLog>,
    upstream: Option<&std::sync::Mutex<Upstream>>,
    record: &mut redo::RecordBuf,
    urgency: redo::Urgency,
) -> Result<(), Refused> {
    let by_redb = |e: redb::CommitError| {
        let error = StoreError::from(e);
        let handle_lost = error.is_transient();
        Refused { error, handle_lost }
    };
    let Some(log) = log else {
        return txn.into_txn().commit().map_err(by_redb);
    };
    if record.rows().is_empty() {
        return txn.into_txn().commit().map_err(by_redb);
    }
    if let Some(upstream) = upstream {
        // The database first: a batch it refused changed nothing.
        if let Err(error) = upstream.held().commit(record.rows()) {
            abort(txn);
            return Err(Refused {
                error,
                handle_lost: false,
            });
        }
        return commit_behind_upstream(txn, log, record, urgency);
    }
    let appended = match crate::failpoints::hit_in("redo.append", record.rows()) {
        true => Err(StoreError::injected("redo.append")),
        false => log.append(record, urgency),
    };
    let start = match appended {
        Ok(start) => start,
        Err(error) => {
            abort(txn);
            return Err(Refused {
                error,
                handle_lost: false,
            });
        }
    };
    let committed = match crate::failpoints::hit_in("redo.commit", record.rows()) {
        true => {
            abort(txn);
            Err(Refused {
                error: StoreError::injected("redo.commit"),
                handle_lost: false,
            })
        }
        false => txn.into_txn().commit().map_err(by_redb),
    };
    if committed.is_err() {
        if let Err(undo) = log.take_back(start) {
            tracing::error!(error = %undo, "cannot take a refused commit back out of the redo log");
        }
    }
    committed
}

/// The replica's own commit of a batch the store's database holds: one
/// that fails leaves the replica's file behind the database, which no
/// retry may fix (its jobs would run twice there), so the replica stops
/// and its next start loads the store again (`upstream.rs`).
fn commit_behind_upstream(
    txn: Pending,
    log: &mut RedoLog,
    record: &mut redo::RecordBuf,
    urgency: redo::Urgency,
) -> Result<(), Refused> {
    let local = log
        .append(record, urgency)
        .and_then(|_| txn.into_txn().commit().map_err(StoreError::from));
    if let Err(e) = local {
        tracing::error!(error = %e, "a batch the store's database holds could not be written to this replica's file; stopping so that a start loads the store again");
        std::process::exit(super::EXIT_STORE_IN_DOUBT);
    }
    Ok(())
}

/// Runs a committed batch's hooks in order. A hook that panics is logged
/// and skipped: its batch is durable and its jobs are still answered, and
/// the writer must go on, or every later write would fail or wait for ever.
fn run_hooks(hooks: Vec<Hook>) {
    for hook in hooks {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(hook)).is_err() {
            tracing::error!("an after-commit hook panicked; its batch is committed and answered");
        }
    }
}

/// The handle to write with, reopening it when an I/O error dropped it.
fn handle(shared: &Shared) -> Option<Arc<Database>> {
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

/// Runs one job in a transaction of its own, committed as any batch is.
/// Returns true when the handle must be reopened (an I/O error in redb).
fn run_alone(
    db: &Database,
    mut job: WriteJob,
    log: Option<&mut RedoLog>,
    upstream: Option<&std::sync::Mutex<Upstream>>,
    record: &mut redo::RecordBuf,
) -> bool {
    let txn = match begin(db, log.is_some()) {
        Ok(txn) => Pending::of(txn),
        Err(err) => {
            let transient = err.is_transient();
            (job.finish)(Some(err));
            return transient;
        }
    };
    record.start();
    let (failure, hooks) = run_in(&txn, log.is_some(), record, |tx| (job.run)(tx));
    if let Some(e) = failure {
        abort(txn);
        (job.finish)(Some(e));
        return false;
    }
    match commit(txn, log, upstream, record, job.urgency) {
        Ok(()) => {
            run_hooks(hooks);
            (job.finish)(None);
            false
        }
        Err(refused) => {
            tracing::error!(error = %refused.error, "store commit of a re-run job failed");
            (job.finish)(Some(refused.error));
            refused.handle_lost
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
        let due = |secs: u64, waiting: bool| {
            checkpoint_due(Duration::from_secs(secs), every, NO_RETRY, 0, waiting)
        };
        assert!(!due(23, false));
        assert!(due(24, false));
        assert!(!due(59, true));
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
