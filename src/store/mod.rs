//! The store: the only code that touches redb.
//!
//! Writes go through one writer thread that group-commits: every write job
//! queued while the previous commit was in flight runs in the next single
//! transaction, which commits (fsync) once. Concurrent requests so share the
//! cost of an fsync, and each job still sees the writes of the jobs before it.
//! A job must check before it writes: a job that returns a domain refusal
//! must not have written anything. A storage error aborts the whole batch.
//!
//! Reads use redb read transactions on the caller's thread (MVCC snapshots).

pub mod codec;
pub mod tables;

use std::path::Path;
use std::sync::Arc;

use redb::{
    Database, ReadTransaction, ReadableDatabase, ReadableTable, ReadableTableMetadata,
    WriteTransaction,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::model::{BuildId, BuildRecord, BuildSnapshots, DeploymentRecord, Millis, Source};
use tables::*;

/// The on-disk layout version in `meta`; an older file is migrated at open.
pub const SCHEMA_VERSION: u32 = 1;
/// Write jobs waiting for the writer thread before `write` waits for room.
const WRITE_QUEUE_DEPTH: usize = 4096;
/// Jobs folded into one transaction at most, to bound commit latency.
const MAX_JOBS_PER_COMMIT: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreErrorKind {
    DiskFull,
    /// Another I/O error; the store reopens its file after one.
    Io,
    /// The file is being reopened after an I/O error; try again shortly.
    Reopening,
    Corrupt,
    Closed,
    Other,
}

#[derive(Debug, Clone)]
pub struct StoreError {
    pub kind: StoreErrorKind,
    pub detail: String,
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "store error ({:?}): {}", self.kind, self.detail)
    }
}

impl std::error::Error for StoreError {}

impl StoreError {
    pub fn corrupt(detail: impl Into<String>) -> Self {
        Self {
            kind: StoreErrorKind::Corrupt,
            detail: detail.into(),
        }
    }
    /// A failure that may pass by itself (a full disk, an I/O error, a reopen).
    pub fn is_transient(&self) -> bool {
        matches!(
            self.kind,
            StoreErrorKind::DiskFull | StoreErrorKind::Io | StoreErrorKind::Reopening
        )
    }
    fn reopening() -> Self {
        Self {
            kind: StoreErrorKind::Reopening,
            detail: "the store is reopening its file after an I/O error".into(),
        }
    }
    fn closed() -> Self {
        Self {
            kind: StoreErrorKind::Closed,
            detail: "the store writer has stopped".into(),
        }
    }
}

fn is_io(text: &str) -> bool {
    text.contains("I/O error") || text.contains("Previous I/O error")
}

fn is_disk_full(text: &str) -> bool {
    text.contains("No space left") || text.contains("os error 28") || text.contains("StorageFull")
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> Self {
                let detail = e.to_string();
                let debug = format!("{e:?}");
                let kind = if is_disk_full(&detail) || is_disk_full(&debug) {
                    StoreErrorKind::DiskFull
                } else if detail.contains("has been closed") || detail.contains("Previous I/O error") {
                    // A read that raced a reopen after an I/O error.
                    StoreErrorKind::Reopening
                } else if is_io(&detail) || debug.contains("Io(") {
                    StoreErrorKind::Io
                } else {
                    StoreErrorKind::Other
                };
                Self { kind, detail }
            }
        }
    )*};
}
from_redb!(
    redb::Error,
    redb::StorageError,
    redb::TableError,
    redb::TransactionError,
    redb::CommitError,
    redb::DatabaseError
);

pub type StoreResult<T> = Result<T, StoreError>;

type Completion = Box<dyn FnOnce(Option<StoreError>) + Send>;
/// Work to run after the transaction that queued it is durable (publishing
/// events to live subscribers), in commit order.
pub type Hook = Box<dyn FnOnce() + Send>;
/// Runs one job; returns its completion, the store error it failed with (if
/// any: the batch then aborts), and its after-commit hooks.
type WriteJob = Box<
    dyn FnOnce(Result<&WriteTransaction, StoreError>) -> (Completion, Option<StoreError>, Vec<Hook>)
        + Send,
>;

/// A stored response to a mutation, replayed for the same idempotency key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    pub fingerprint: Vec<u8>,
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
    pub headers: Vec<(String, String)>,
    pub expires_at: Millis,
}

/// A destroy callback waiting to be sent (or retried).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PendingCallback {
    pub url: String,
    pub deployment: String,
    /// False until the destroy succeeds.
    pub armed: bool,
    pub attempts: u32,
    pub next_at: Millis,
    pub first_at: Millis,
}

/// The open database, swapped for a fresh handle after an I/O error: redb
/// refuses every call after one ("close and re-open the database"), and a
/// full disk must not need a restart of berth.
struct Shared {
    path: std::path::PathBuf,
    db: std::sync::RwLock<Option<Arc<Database>>>,
    /// While the file cannot be opened for writing (a full disk), reads go
    /// through a read-only handle.
    read_only: std::sync::RwLock<Option<Arc<redb::ReadOnlyDatabase>>>,
}

impl Shared {
    fn current(&self) -> Option<Arc<Database>> {
        self.db.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Drops the poisoned handle and opens the file again; retries while
    /// old read transactions still hold the file. Leaves `None` when it
    /// cannot open yet (the next write tries again).
    fn reopen(&self) {
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
const READ_WAIT_ATTEMPTS: usize = 100;
const REOPEN_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);

/// Waits `REOPEN_PAUSE` for a reopen in progress. On a runtime worker the
/// worker first hands its other tasks on (`block_in_place`), so a read that
/// waits never stalls unrelated requests; elsewhere it simply sleeps.
fn pause_for_reopen() {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(|| std::thread::sleep(REOPEN_PAUSE))
        }
        _ => std::thread::sleep(REOPEN_PAUSE),
    }
}

fn open_database(path: &Path) -> StoreResult<Database> {
    Ok(Database::builder()
        .set_concurrency_mode(redb::ConcurrencyMode::SingleWriter)
        .create(path)?)
}

#[derive(Clone)]
pub struct Store {
    shared: Arc<Shared>,
    writer: mpsc::Sender<WriteJob>,
}

impl Store {
    /// Opens (or creates) the store and starts its writer thread.
    pub fn open(path: &Path) -> StoreResult<Store> {
        let db = open_database(path)?;
        init_schema(&db)?;
        let shared = Arc::new(Shared {
            path: path.to_path_buf(),
            db: std::sync::RwLock::new(Some(Arc::new(db))),
            read_only: std::sync::RwLock::new(None),
        });
        let (tx, rx) = mpsc::channel::<WriteJob>(WRITE_QUEUE_DEPTH);
        let writer_shared = shared.clone();
        std::thread::Builder::new()
            .name("berth-store-writer".into())
            .spawn(move || writer_loop(writer_shared, rx))
            .map_err(|e| StoreError {
                kind: StoreErrorKind::Other,
                detail: e.to_string(),
            })?;
        Ok(Store { shared, writer: tx })
    }

    /// Runs `job` inside the next group commit and returns its value once the
    /// commit is durable. The job must not write when it returns a refusal.
    pub async fn write<T, F>(&self, job: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Tx) -> StoreResult<T> + Send + 'static,
    {
        let (done_tx, done_rx) = oneshot::channel::<StoreResult<T>>();
        let wrapped: WriteJob = Box::new(move |txn: Result<&WriteTransaction, StoreError>| {
            let txn = match txn {
                Ok(t) => t,
                Err(e) => {
                    let completion: Completion = Box::new(move |_| {
                        let _ = done_tx.send(Err(e));
                    });
                    return (completion, None, Vec::new());
                }
            };
            let tx = Tx {
                txn,
                hooks: std::cell::RefCell::new(Vec::new()),
            };
            let result = job(&tx);
            let failed = result.as_ref().err().cloned();
            let hooks = tx.hooks.into_inner();
            let completion: Completion = Box::new(move |commit_error| {
                let outcome = match commit_error {
                    Some(e) => Err(e),
                    None => result,
                };
                let _ = done_tx.send(outcome);
            });
            (completion, failed, hooks)
        });
        self.writer
            .send(wrapped)
            .await
            .map_err(|_| StoreError::closed())?;
        done_rx.await.map_err(|_| StoreError::closed())?
    }

    pub fn read(&self) -> StoreResult<Rx> {
        // A reopen after an I/O error takes some milliseconds: a read waits
        // for it rather than failing.
        for _ in 0..READ_WAIT_ATTEMPTS {
            if let Some(db) = self.shared.current() {
                return Ok(Rx {
                    txn: db.begin_read()?,
                });
            }
            let ro = self
                .shared
                .read_only
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            if let Some(ro) = ro {
                return Ok(Rx {
                    txn: ro.begin_read()?,
                });
            }
            pause_for_reopen();
        }
        Err(StoreError::reopening())
    }

    /// Bytes the store file takes on disk.
    pub fn file_size(path: &Path) -> u64 {
        std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
    }
}

fn init_schema(db: &Database) -> StoreResult<()> {
    let txn = db.begin_write()?;
    {
        let mut meta = txn.open_table(META)?;
        let found = meta.get("schema_version")?.map(|v| v.value().to_vec());
        match found {
            None => {
                meta.insert("schema_version", SCHEMA_VERSION.to_le_bytes().as_slice())?;
            }
            Some(bytes) => {
                let version = <[u8; 4]>::try_from(bytes.as_slice())
                    .map(u32::from_le_bytes)
                    .map_err(|_| StoreError::corrupt("meta.schema_version is not a u32"))?;
                if version > SCHEMA_VERSION {
                    return Err(StoreError::corrupt(format!(
                        "the store has schema version {version}, newer than this berth ({SCHEMA_VERSION}); use a newer berth"
                    )));
                }
                // Version 1 is the first layout: nothing to migrate yet.
            }
        }
        // Create every table so readers never meet a missing one.
        txn.open_table(DEPLOYMENTS)?;
        txn.open_table(BUILDS)?;
        txn.open_table(DEPLOYMENT_BUILDS)?;
        txn.open_table(QUEUED)?;
        txn.open_table(RUNNING)?;
        txn.open_table(LOG_CHUNKS)?;
        txn.open_table(IDEMPOTENCY)?;
        txn.open_table(SOURCES)?;
        txn.open_table(DESCRIBE_CACHE)?;
        txn.open_table(CALLBACKS)?;
        txn.open_table(DEPLOYMENT_EVENTS)?;
        txn.open_table(BUILD_EVENTS)?;
        txn.open_table(BUILD_SNAPSHOTS)?;
    }
    txn.commit()?;
    Ok(())
}

fn writer_loop(shared: Arc<Shared>, mut rx: mpsc::Receiver<WriteJob>) {
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

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> StoreResult<T> {
    codec::decode(bytes).map_err(StoreError::corrupt)
}

/// Stores `value` under `key` in `table`.
fn put_record<'k, K: redb::Key + 'static, T: Serialize>(
    mut table: redb::Table<'_, K, &'static [u8]>,
    key: impl std::borrow::Borrow<K::SelfType<'k>>,
    value: &T,
) -> StoreResult<()> {
    table.insert(key, codec::encode(value).as_slice())?;
    Ok(())
}

/// The record stored under `key` in `table`, decoded.
fn get_record<'k, K: redb::Key + 'static, T: serde::de::DeserializeOwned>(
    table: &impl ReadableTable<K, &'static [u8]>,
    key: impl std::borrow::Borrow<K::SelfType<'k>>,
) -> StoreResult<Option<T>> {
    table.get(key)?.map(|v| decode(v.value())).transpose()
}

/// Typed access inside a write transaction.
pub struct Tx<'a> {
    txn: &'a WriteTransaction,
    hooks: std::cell::RefCell<Vec<Hook>>,
}

/// One stored event of a channel (events.md).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredEvent {
    pub event: String,
    pub data: String,
    pub at: Millis,
}

impl Tx<'_> {
    /// Runs `hook` after this transaction is durable; never if it aborts.
    pub fn after_commit(&self, hook: impl FnOnce() + Send + 'static) {
        self.hooks.borrow_mut().push(Box::new(hook));
    }

    pub fn put_deployment_event(
        &self,
        deployment: &str,
        seq: u64,
        e: &StoredEvent,
    ) -> StoreResult<()> {
        put_record(
            self.txn.open_table(DEPLOYMENT_EVENTS)?,
            (deployment, seq),
            e,
        )
    }

    pub fn put_build_event(&self, build: BuildId, seq: u64, e: &StoredEvent) -> StoreResult<()> {
        put_record(self.txn.open_table(BUILD_EVENTS)?, (build, seq), e)
    }

    /// Removes a deployment's events with seq below `below` that are older
    /// than `before`; returns how many.
    pub fn prune_deployment_events(
        &self,
        deployment: &str,
        below: u64,
        before: Millis,
    ) -> StoreResult<usize> {
        let mut t = self.txn.open_table(DEPLOYMENT_EVENTS)?;
        let mut doomed = Vec::new();
        for entry in t.range((deployment, 0u64)..(deployment, below))? {
            let (k, v) = entry?;
            let e: StoredEvent = decode(v.value())?;
            if e.at >= before {
                break;
            }
            doomed.push(k.value().1);
        }
        for seq in &doomed {
            t.remove((deployment, *seq))?;
        }
        Ok(doomed.len())
    }

    pub fn deployment(&self, id: &str) -> StoreResult<Option<DeploymentRecord>> {
        get_record(&self.txn.open_table(DEPLOYMENTS)?, id)
    }

    pub fn put_deployment(&self, d: &DeploymentRecord) -> StoreResult<()> {
        put_record(self.txn.open_table(DEPLOYMENTS)?, d.id.as_str(), d)
    }

    pub fn build(&self, id: BuildId) -> StoreResult<Option<BuildRecord>> {
        get_record(&self.txn.open_table(BUILDS)?, id)
    }

    /// Stores a build and keeps the queued/running indexes in step with its status.
    pub fn put_build(&self, b: &BuildRecord) -> StoreResult<()> {
        use crate::model::BuildStatus::*;
        self.txn
            .open_table(BUILDS)?
            .insert(b.id, codec::encode(b).as_slice())?;
        self.txn
            .open_table(DEPLOYMENT_BUILDS)?
            .insert((b.deployment.as_str(), b.id), ())?;
        let mut queued = self.txn.open_table(QUEUED)?;
        let mut running = self.txn.open_table(RUNNING)?;
        match b.status {
            Queued => {
                queued.insert(b.id, b.deployment.as_str())?;
                running.remove(b.id)?;
            }
            Running => {
                queued.remove(b.id)?;
                running.insert(b.id, b.deployment.as_str())?;
            }
            Succeeded | Failed | Cancelled => {
                queued.remove(b.id)?;
                running.remove(b.id)?;
            }
        }
        Ok(())
    }

    pub fn put_log_chunk(
        &self,
        build: BuildId,
        chunk: u32,
        first_line: u64,
        compressed: &[u8],
    ) -> StoreResult<()> {
        let mut value = Vec::with_capacity(8 + compressed.len());
        value.extend_from_slice(&first_line.to_le_bytes());
        value.extend_from_slice(compressed);
        self.txn
            .open_table(LOG_CHUNKS)?
            .insert((build, chunk), value.as_slice())?;
        Ok(())
    }

    pub fn source(&self, digest: &str) -> StoreResult<Option<Source>> {
        get_record(&self.txn.open_table(SOURCES)?, digest)
    }

    pub fn put_source(&self, s: &Source) -> StoreResult<()> {
        put_record(self.txn.open_table(SOURCES)?, s.digest.as_str(), s)
    }

    pub fn put_describe(&self, digest: &str, json: &str) -> StoreResult<()> {
        self.txn
            .open_table(DESCRIBE_CACHE)?
            .insert(digest, json.as_bytes())?;
        Ok(())
    }

    pub fn idempotency(&self, key: &str) -> StoreResult<Option<IdempotencyRecord>> {
        get_record(&self.txn.open_table(IDEMPOTENCY)?, key)
    }

    pub fn put_idempotency(&self, key: &str, r: &IdempotencyRecord) -> StoreResult<()> {
        put_record(self.txn.open_table(IDEMPOTENCY)?, key, r)
    }

    /// Removes idempotency records that expired before `now`; returns how many.
    pub fn sweep_idempotency(&self, now: Millis, max: usize) -> StoreResult<usize> {
        let mut t = self.txn.open_table(IDEMPOTENCY)?;
        let mut expired = Vec::new();
        for entry in t.iter()? {
            let (k, v) = entry?;
            let r: IdempotencyRecord = decode(v.value())?;
            if r.expires_at <= now {
                expired.push(k.value().to_string());
                if expired.len() >= max {
                    break;
                }
            }
        }
        for k in &expired {
            t.remove(k.as_str())?;
        }
        Ok(expired.len())
    }

    pub fn callback(&self, build: BuildId) -> StoreResult<Option<PendingCallback>> {
        get_record(&self.txn.open_table(CALLBACKS)?, build)
    }

    pub fn put_callback(&self, build: BuildId, c: &PendingCallback) -> StoreResult<()> {
        put_record(self.txn.open_table(CALLBACKS)?, build, c)
    }

    pub fn remove_callback(&self, build: BuildId) -> StoreResult<()> {
        self.txn.open_table(CALLBACKS)?.remove(build)?;
        Ok(())
    }

    /// The builds of a deployment, newest first, as (id, created_at, status).
    pub fn build_ages(
        &self,
        deployment: &str,
    ) -> StoreResult<Vec<(BuildId, Millis, crate::model::BuildStatus)>> {
        let index = self.txn.open_table(DEPLOYMENT_BUILDS)?;
        let builds = self.txn.open_table(BUILDS)?;
        let mut out = Vec::new();
        for entry in index
            .range((deployment, 0u128)..=(deployment, u128::MAX))?
            .rev()
        {
            let (k, _) = entry?;
            let id = k.value().1;
            if let Some(v) = builds.get(id)? {
                let b: BuildRecord = decode(v.value())?;
                out.push((id, b.created_at, b.status));
            }
        }
        Ok(out)
    }

    pub fn build_snapshots(&self, id: BuildId) -> StoreResult<Option<BuildSnapshots>> {
        get_record(&self.txn.open_table(BUILD_SNAPSHOTS)?, id)
    }

    pub fn put_build_snapshots(&self, id: BuildId, s: &BuildSnapshots) -> StoreResult<()> {
        put_record(self.txn.open_table(BUILD_SNAPSHOTS)?, id, s)
    }

    /// Removes a finished build with its snapshots, log chunks and events.
    pub fn delete_build(&self, deployment: &str, id: BuildId) -> StoreResult<()> {
        self.txn.open_table(BUILDS)?.remove(id)?;
        self.txn.open_table(BUILD_SNAPSHOTS)?.remove(id)?;
        self.txn
            .open_table(DEPLOYMENT_BUILDS)?
            .remove((deployment, id))?;
        self.txn.open_table(CALLBACKS)?.remove(id)?;
        let mut chunks = self.txn.open_table(LOG_CHUNKS)?;
        chunks.retain_in((id, 0u32)..=(id, u32::MAX), |_, _| false)?;
        let mut events = self.txn.open_table(BUILD_EVENTS)?;
        events.retain_in((id, 0u64)..=(id, u64::MAX), |_, _| false)?;
        Ok(())
    }

    /// Deletes every stored row (the `--reset-dev-state` path).
    pub fn clear_all(&self) -> StoreResult<()> {
        macro_rules! clear {
            ($($t:expr),*) => {$( self.txn.delete_table($t)?; self.txn.open_table($t)?; )*};
        }
        clear!(
            DEPLOYMENTS,
            BUILDS,
            DEPLOYMENT_BUILDS,
            QUEUED,
            RUNNING,
            LOG_CHUNKS,
            IDEMPOTENCY,
            CALLBACKS,
            DEPLOYMENT_EVENTS,
            BUILD_EVENTS,
            BUILD_SNAPSHOTS
        );
        Ok(())
    }
}

/// Typed access inside a read transaction (a consistent snapshot).
pub struct Rx {
    txn: ReadTransaction,
}

impl Rx {
    pub fn deployment(&self, id: &str) -> StoreResult<Option<DeploymentRecord>> {
        get_record(&self.txn.open_table(DEPLOYMENTS)?, id)
    }

    /// Deployments with id > `after`, in id order, at most `limit`.
    pub fn deployments_after(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> StoreResult<Vec<DeploymentRecord>> {
        let t = self.txn.open_table(DEPLOYMENTS)?;
        let mut out = Vec::new();
        let iter = match after {
            Some(a) => {
                t.range::<&str>((std::ops::Bound::Excluded(a), std::ops::Bound::Unbounded))?
            }
            None => t.range::<&str>(..)?,
        };
        for entry in iter {
            let (_, v) = entry?;
            out.push(decode(v.value())?);
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    pub fn deployment_count(&self) -> StoreResult<u64> {
        Ok(self.txn.open_table(DEPLOYMENTS)?.len()?)
    }

    pub fn build(&self, id: BuildId) -> StoreResult<Option<BuildRecord>> {
        get_record(&self.txn.open_table(BUILDS)?, id)
    }

    pub fn build_snapshots(&self, id: BuildId) -> StoreResult<Option<BuildSnapshots>> {
        get_record(&self.txn.open_table(BUILD_SNAPSHOTS)?, id)
    }

    /// Builds of one deployment older than `before`, newest first.
    pub fn builds_of(
        &self,
        deployment: &str,
        before: Option<BuildId>,
        limit: usize,
    ) -> StoreResult<Vec<BuildRecord>> {
        let index = self.txn.open_table(DEPLOYMENT_BUILDS)?;
        let builds = self.txn.open_table(BUILDS)?;
        let upper = before.unwrap_or(u128::MAX);
        let range = index.range((deployment, 0u128)..(deployment, upper))?;
        let mut out = Vec::new();
        for entry in range.rev() {
            let (k, _) = entry?;
            let (_, id) = k.value();
            if before.is_none() && id == u128::MAX {
                continue;
            }
            if let Some(v) = builds.get(id)? {
                out.push(decode(v.value())?);
            }
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    /// How many builds a deployment has (from the index; nothing decoded).
    pub fn build_count(&self, deployment: &str) -> StoreResult<usize> {
        let index = self.txn.open_table(DEPLOYMENT_BUILDS)?;
        let mut n = 0;
        for entry in index.range((deployment, 0u128)..=(deployment, u128::MAX))? {
            entry?;
            n += 1;
        }
        Ok(n)
    }

    /// Every queued build id with its deployment, oldest first.
    pub fn queued(&self) -> StoreResult<Vec<(BuildId, String)>> {
        let t = self.txn.open_table(QUEUED)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (k, v) = entry?;
            out.push((k.value(), v.value().to_string()));
        }
        Ok(out)
    }

    pub fn running(&self) -> StoreResult<Vec<(BuildId, String)>> {
        let t = self.txn.open_table(RUNNING)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (k, v) = entry?;
            out.push((k.value(), v.value().to_string()));
        }
        Ok(out)
    }

    /// Counts of builds by status (for /metrics).
    /// Queued and running builds (table lengths; nothing decoded).
    pub fn pending_counts(&self) -> StoreResult<(u64, u64)> {
        Ok((
            self.txn.open_table(QUEUED)?.len()?,
            self.txn.open_table(RUNNING)?.len()?,
        ))
    }

    /// Every build by status: a full scan, for the periodic refresh only.
    pub fn build_status_counts(&self) -> StoreResult<[u64; 5]> {
        let t = self.txn.open_table(BUILDS)?;
        let mut counts = [0u64; 5];
        for entry in t.iter()? {
            let (_, v) = entry?;
            let b: BuildRecord = decode(v.value())?;
            counts[b.status as usize] += 1;
        }
        Ok(counts)
    }

    /// The compressed log chunks of a build, in order, each with the index
    /// of its first line.
    pub fn log_chunks(&self, build: BuildId) -> StoreResult<Vec<(u64, Vec<u8>)>> {
        let t = self.txn.open_table(LOG_CHUNKS)?;
        let mut out = Vec::new();
        for entry in t.range((build, 0u32)..=(build, u32::MAX))? {
            let (_, v) = entry?;
            let bytes = v.value();
            let (head, body) = bytes
                .split_at_checked(8)
                .ok_or_else(|| StoreError::corrupt("a log chunk without its header"))?;
            let first = u64::from_le_bytes(
                head.try_into()
                    .map_err(|_| StoreError::corrupt("log chunk header"))?,
            );
            out.push((first, body.to_vec()));
        }
        Ok(out)
    }

    /// A build's stored status events, in seq order.
    pub fn build_events(&self, build: BuildId) -> StoreResult<Vec<(u64, StoredEvent)>> {
        let t = self.txn.open_table(BUILD_EVENTS)?;
        let mut out = Vec::new();
        for entry in t.range((build, 0u64)..=(build, u64::MAX))? {
            let (k, v) = entry?;
            out.push((k.value().1, decode(v.value())?));
        }
        Ok(out)
    }

    /// A deployment's events with seq > `after`, at most `limit`.
    pub fn deployment_events_after(
        &self,
        deployment: &str,
        after: u64,
        limit: usize,
    ) -> StoreResult<Vec<(u64, StoredEvent)>> {
        let t = self.txn.open_table(DEPLOYMENT_EVENTS)?;
        let mut out = Vec::new();
        for entry in t.range((deployment, after.saturating_add(1))..=(deployment, u64::MAX))? {
            let (k, v) = entry?;
            out.push((k.value().1, decode(v.value())?));
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    /// The oldest kept event seq of a deployment's channel.
    pub fn first_deployment_event(&self, deployment: &str) -> StoreResult<Option<u64>> {
        let t = self.txn.open_table(DEPLOYMENT_EVENTS)?;
        let first = t
            .range((deployment, 0u64)..=(deployment, u64::MAX))?
            .next()
            .transpose()?;
        Ok(first.map(|(k, _)| k.value().1))
    }

    /// Every deployment id (for sweeps).
    pub fn deployment_ids(&self) -> StoreResult<Vec<String>> {
        let t = self.txn.open_table(DEPLOYMENTS)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            out.push(entry?.0.value().to_string());
        }
        Ok(out)
    }

    pub fn idempotency(&self, key: &str) -> StoreResult<Option<IdempotencyRecord>> {
        get_record(&self.txn.open_table(IDEMPOTENCY)?, key)
    }

    pub fn source(&self, digest: &str) -> StoreResult<Option<Source>> {
        get_record(&self.txn.open_table(SOURCES)?, digest)
    }

    pub fn describe(&self, digest: &str) -> StoreResult<Option<String>> {
        let t = self.txn.open_table(DESCRIBE_CACHE)?;
        let v = t.get(digest)?;
        Ok(v.map(|v| String::from_utf8_lossy(v.value()).into_owned()))
    }

    pub fn callbacks(&self) -> StoreResult<Vec<(BuildId, PendingCallback)>> {
        let t = self.txn.open_table(CALLBACKS)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (k, v) = entry?;
            out.push((k.value(), decode(v.value())?));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_store(tag: &str) -> (Store, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("berth-store-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        (Store::open(&dir.join("berth.redb")).unwrap(), dir)
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

    #[tokio::test]
    async fn a_failed_job_aborts_its_batch_and_hooks_run_only_after_commit() {
        let (store, dir) = temp_store("hooks");
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ran.clone();
        store
            .write(move |tx| {
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
}
