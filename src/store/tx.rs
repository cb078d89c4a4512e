//! Typed writes (and the reads a write job needs) inside the writer's
//! transaction, and the hooks that run once it is durable.

use redb::{ReadableTable, TableHandle, WriteTransaction};

use super::logged::{Keep, Logged, Open, OpenTables};
use super::lookup::Lookup;
use super::redo::Ops;
use super::tables::*;
use super::writer::Hook;
use super::{
    codec, component_row, decode, decode_counts, encode_counts, get_record, put_record,
    split_component_row, ChunkPlace, DeliveryRecord, IdempotencyRecord, PendingCallback,
    StoreError, StoreResult, StoredEvent, WebhookRecord, BUILD_COUNTS_KEY,
};
use crate::model::{
    AttemptRecord, BuildId, BuildRecord, BuildSnapshots, BuildStatus, DeploymentRecord,
    FreezeRecord, Millis, NodeRecord, NodeSbom, RolloutRecord, Source, TokenRecord, UpdateTry,
    WorkStateBlob, WorkStates,
};

/// A table's entry in `enum Table`, which the redo log names it by.
fn logged_id(name: &str) -> StoreResult<Table> {
    super::view::table_named(name)
}

/// Typed access inside a write transaction, shared by the jobs of one
/// batch (they commit together or not at all).
pub struct Tx<'o, 'a> {
    pub(super) txn: &'a WriteTransaction,
    /// The tables not in use right now, kept open (`logged.rs`).
    open: Tables<'o, 'a>,
    pub(super) hooks: std::cell::RefCell<Vec<Hook>>,
    /// The rows the batch writes, for the redo log (`None`: no log).
    pub(super) ops: Option<std::cell::RefCell<Ops>>,
}

/// Where a `Tx` keeps its tables open: its own, closed when it is
/// dropped (a transaction of its own: an import's, a test's), or the
/// batch's (`logged::Pending`), closed when the batch commits or aborts.
enum Tables<'o, 'a> {
    Own(OpenTables<'a>),
    Pending(&'o OpenTables<'a>),
}

impl<'a> std::ops::Deref for Tables<'_, 'a> {
    type Target = OpenTables<'a>;
    fn deref(&self) -> &OpenTables<'a> {
        match self {
            Tables::Own(open) => open,
            Tables::Pending(open) => open,
        }
    }
}

impl<'a> Tx<'a, 'a> {
    /// Access to `txn`, with tables of its own (closed when it is
    /// dropped); `ops` collects the rows written, for a redo log.
    pub(super) fn new(txn: &'a WriteTransaction, ops: Option<Ops>) -> Tx<'a, 'a> {
        Tx::with_tables(txn, Tables::Own(OpenTables::new()), ops)
    }
}

impl<'o, 'a> Tx<'o, 'a> {
    /// Access to a pending transaction's `txn` with the tables it keeps
    /// open (`Pending::with_dependent`); `ops` (the redo record's buffer,
    /// `RecordBuf::lend`) when the store keeps a redo log.
    pub(super) fn pending(
        txn: &'a WriteTransaction,
        open: &'o OpenTables<'a>,
        ops: Option<Ops>,
    ) -> Tx<'o, 'a> {
        Tx::with_tables(txn, Tables::Pending(open), ops)
    }

    fn with_tables(
        txn: &'a WriteTransaction,
        open: Tables<'o, 'a>,
        ops: Option<Ops>,
    ) -> Tx<'o, 'a> {
        Tx {
            txn,
            open,
            hooks: std::cell::RefCell::new(Vec::new()),
            ops: ops.map(std::cell::RefCell::new),
        }
    }

    /// What the batch's jobs left to do after the commit and to log: its
    /// hooks and the redo ops (`Tx::new`'s, with the rows appended).
    /// Closes tables of its own (so the transaction can commit); a
    /// batch's stay open until it commits.
    pub(super) fn finish(self) -> (Vec<Hook>, Option<Ops>) {
        let Tx { hooks, ops, .. } = self;
        (hooks.into_inner(), ops.map(|o| o.into_inner()))
    }

    /// Opens a table (or takes the one the batch keeps open): every write
    /// to it is also a redo op.
    pub(super) fn table<K: redb::Key + 'static, V: redb::Value + 'static>(
        &self,
        def: redb::TableDefinition<'static, K, V>,
    ) -> StoreResult<Logged<'_, 'a, K, V>>
    where
        Open<'a>: Keep<'a, K, V>,
    {
        let name = logged_id(def.name())?;
        let table = match self.open.take(name) {
            Some(kept) => kept.take().map_err(|_| {
                StoreError::other("a table was kept open with other key or value types")
            })?,
            None => self.txn.open_table(def)?,
        };
        Ok(Logged {
            table: Some(table),
            name,
            kept: &self.open,
            log: self
                .ops
                .as_ref()
                .map(|ops| ops as &std::cell::RefCell<dyn super::logged::RowLog>),
        })
    }

    /// Empties a whole table (`--reset-dev-state`).
    pub(super) fn clear<K: redb::Key + 'static, V: redb::Value + 'static>(
        &self,
        def: redb::TableDefinition<'static, K, V>,
    ) -> StoreResult<()> {
        let name = logged_id(def.name())?;
        if let Some(ops) = &self.ops {
            ops.borrow_mut().clear(name);
        }
        self.open.close(name);
        self.txn.delete_table(def)?;
        self.txn.open_table(def)?;
        Ok(())
    }

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
            self.table(DEPLOYMENT_ROWS)?,
            Part::Event.key(deployment, seq.into()),
            e,
        )
    }

    pub fn put_build_event(&self, build: BuildId, seq: u64, e: &StoredEvent) -> StoreResult<()> {
        put_record(self.table(BUILD_EVENTS)?, (build, seq), e)
    }

    /// Removes a deployment's events with seq below `below` that are older
    /// than `before`; returns how many.
    pub fn prune_deployment_events(
        &self,
        deployment: &str,
        below: u64,
        before: Millis,
    ) -> StoreResult<usize> {
        let mut t = self.table(DEPLOYMENT_ROWS)?;
        let mut doomed = Vec::new();
        let range = Part::Event.key(deployment, 0)..Part::Event.key(deployment, below.into());
        for entry in t.range(range)? {
            let (k, v) = entry?;
            let e: StoredEvent = decode(v.value())?;
            if e.at >= before {
                break;
            }
            doomed.push(k.value().2);
        }
        for seq in &doomed {
            t.remove(Part::Event.key(deployment, *seq))?;
        }
        Ok(doomed.len())
    }

    pub fn put_deployment(&self, d: &DeploymentRecord) -> StoreResult<()> {
        put_record(self.table(DEPLOYMENTS)?, d.id.as_str(), d)
    }

    /// Stores a build and keeps the queued/running indexes in step with its status.
    pub fn put_build(&self, b: &BuildRecord) -> StoreResult<()> {
        use crate::model::BuildStatus::*;
        let mut builds = self.table(BUILDS)?;
        codec::with_encoded(b, |bytes| builds.insert(b.id, bytes))?;
        drop(builds);
        self.table(DEPLOYMENT_ROWS)?
            .insert(Part::Build.key(&b.deployment, b.id), EMPTY)?;
        let mut queued = self.table(QUEUED)?;
        let mut running = self.table(RUNNING)?;
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

    /// Every running build with its deployment, in build order (at most
    /// the slots of every worker).
    pub fn running_builds(&self) -> StoreResult<Vec<(BuildId, String)>> {
        let t = self.table(RUNNING)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (k, v) = entry?;
            out.push((k.value(), v.value().to_string()));
        }
        Ok(out)
    }

    /// Whether a build of `deployment` older than `before` is queued
    /// (reads the queue up to `before`).
    pub fn queued_before(&self, deployment: &str, before: BuildId) -> StoreResult<bool> {
        let t = self.table(QUEUED)?;
        for entry in t.range(..before)? {
            if entry?.1.value() == deployment {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// A log chunk and its place in the log.
    pub fn put_log_chunk(
        &self,
        build: BuildId,
        place: &ChunkPlace,
        compressed: &[u8],
    ) -> StoreResult<()> {
        let mut value = Vec::with_capacity(8 + compressed.len());
        value.extend_from_slice(&place.first_line.to_le_bytes());
        value.extend_from_slice(compressed);
        self.table(LOG_CHUNKS)?
            .insert((build, place.number), value.as_slice())?;
        self.table(LOG_INDEX)?
            .insert((build, place.number), place.encode().as_slice())?;
        Ok(())
    }

    pub fn put_update_try(&self, deployment: &str, t: &UpdateTry) -> StoreResult<()> {
        put_record(self.table(UPDATE_TRIES)?, deployment, t)
    }

    pub fn put_sbom_node(&self, deployment: &str, node: &str, s: &NodeSbom) -> StoreResult<()> {
        put_record(self.table(SBOM_NODES)?, (deployment, node), s)
    }

    pub fn remove_sbom_node(&self, deployment: &str, node: &str) -> StoreResult<()> {
        self.table(SBOM_NODES)?.remove((deployment, node))?;
        Ok(())
    }

    /// One more reference to a component; stores its text (zstd, made by
    /// `compressed` only when the row is new).
    pub fn ref_component(
        &self,
        hash: &[u8; 32],
        compressed: impl FnOnce() -> StoreResult<Vec<u8>>,
    ) -> StoreResult<()> {
        let mut t = self.table(SBOM_COMPONENTS)?;
        let value = match t.get(hash.as_slice())? {
            Some(row) => {
                let (count, text) = split_component_row(row.value())?;
                let count = count
                    .checked_add(1)
                    .ok_or_else(|| StoreError::corrupt("a component with 2^32 references"))?;
                component_row(count, text)
            }
            None => component_row(1, &compressed()?),
        };
        t.insert(hash.as_slice(), value.as_slice())?;
        Ok(())
    }

    /// One reference fewer; the row goes with its last reference.
    pub fn unref_component(&self, hash: &[u8; 32]) -> StoreResult<()> {
        let mut t = self.table(SBOM_COMPONENTS)?;
        let next = match t.get(hash.as_slice())? {
            Some(row) => {
                let (count, text) = split_component_row(row.value())?;
                if count == 0 {
                    return Err(StoreError::corrupt("a component with no references"));
                }
                (count > 1).then(|| component_row(count - 1, text))
            }
            None => return Err(StoreError::corrupt("a node refers to a missing component")),
        };
        match next {
            Some(value) => t.insert(hash.as_slice(), value.as_slice())?,
            None => t.remove(hash.as_slice())?,
        };
        Ok(())
    }

    pub fn put_source(&self, s: &Source) -> StoreResult<()> {
        put_record(self.table(SOURCES)?, s.digest.as_str(), s)
    }

    pub fn put_describe(&self, digest: &str, json: &str) -> StoreResult<()> {
        self.table(DESCRIBE_CACHE)?
            .insert(digest, json.as_bytes())?;
        Ok(())
    }

    pub fn put_idempotency(&self, key: &str, r: &IdempotencyRecord) -> StoreResult<()> {
        self.table(IDEMPOTENCY_EXPIRY)?
            .insert((r.expires_at, key), ())?;
        put_record(self.table(IDEMPOTENCY)?, key, r)
    }

    /// Removes at most `max` idempotency records that expired before `now`,
    /// found through the expiry index; returns how many. A record written
    /// again since (a key reused after it expired) has a later expiry and
    /// stays.
    pub fn sweep_idempotency(&self, now: Millis, max: usize) -> StoreResult<usize> {
        let mut expiry = self.table(IDEMPOTENCY_EXPIRY)?;
        let mut records = self.table(IDEMPOTENCY)?;
        let mut due: Vec<(i64, String)> = Vec::new();
        for entry in expiry.range((i64::MIN, "")..(now, ""))? {
            let (k, _) = entry?;
            let (at, key) = k.value();
            due.push((at, key.to_string()));
            if due.len() >= max {
                break;
            }
        }
        let mut removed = 0;
        for (at, key) in &due {
            expiry.remove((*at, key.as_str()))?;
            let still_expired = match records.get(key.as_str())? {
                Some(v) => decode::<IdempotencyRecord>(v.value())?.expires_at <= now,
                None => false,
            };
            if still_expired {
                records.remove(key.as_str())?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    pub fn put_webhook(&self, id: u128, w: &WebhookRecord) -> StoreResult<()> {
        put_record(self.table(WEBHOOKS)?, id, w)
    }

    /// Removes a subscription and every delivery of it (pending ones are
    /// dropped with it, notifications.md).
    pub fn remove_webhook(&self, id: u128) -> StoreResult<()> {
        self.table(WEBHOOKS)?.remove(id)?;
        let mut deliveries = self.table(WEBHOOK_DELIVERIES)?;
        let mut due = self.table(WEBHOOK_QUEUE)?;
        let mut gone = Vec::new();
        for entry in deliveries.range((id, 0u128)..=(id, u128::MAX))? {
            let (k, v) = entry?;
            let record: DeliveryRecord = decode(v.value())?;
            gone.push((k.value().1, record.next_attempt_at));
        }
        for (delivery, next) in gone {
            deliveries.remove((id, delivery))?;
            if let Some(at) = next {
                due.remove((id, at, delivery))?;
            }
        }
        Ok(())
    }

    /// Stores a delivery and keeps the due index: its old entry goes, a
    /// pending one's new entry comes.
    pub fn put_delivery(&self, webhook: u128, id: u128, d: &DeliveryRecord) -> StoreResult<()> {
        let mut deliveries = self.table(WEBHOOK_DELIVERIES)?;
        let mut due = self.table(WEBHOOK_QUEUE)?;
        let old: Option<DeliveryRecord> = get_record(&deliveries, (webhook, id))?;
        if let Some(at) = old.and_then(|o| o.next_attempt_at) {
            due.remove((webhook, at, id))?;
        }
        if let (super::DeliveryStatus::Pending, Some(at)) = (d.status, d.next_attempt_at) {
            due.insert((webhook, at, id), ())?;
        }
        deliveries.insert((webhook, id), codec::encode(d).as_slice())?;
        Ok(())
    }

    /// Removes a delivery that is no longer pending (retention).
    pub fn remove_delivery(&self, webhook: u128, id: u128) -> StoreResult<()> {
        let old: Option<DeliveryRecord> =
            get_record(&self.table(WEBHOOK_DELIVERIES)?, (webhook, id))?;
        if let Some(at) = old.and_then(|o| o.next_attempt_at) {
            self.table(WEBHOOK_QUEUE)?.remove((webhook, at, id))?;
        }
        self.table(WEBHOOK_DELIVERIES)?.remove((webhook, id))?;
        Ok(())
    }

    pub fn callback(&self, build: BuildId) -> StoreResult<Option<PendingCallback>> {
        get_record(&self.table(CALLBACKS)?, build)
    }

    pub fn put_callback(&self, build: BuildId, c: &PendingCallback) -> StoreResult<()> {
        put_record(self.table(CALLBACKS)?, build, c)
    }

    pub fn remove_callback(&self, build: BuildId) -> StoreResult<()> {
        self.table(CALLBACKS)?.remove(build)?;
        Ok(())
    }

    /// The builds of a deployment, newest first, as (id, created_at, status).
    /// A deployment's builds, newest first, as retention judges them.
    pub fn build_ages(&self, deployment: &str) -> StoreResult<Vec<BuildRecord>> {
        let index = self.table(DEPLOYMENT_ROWS)?;
        let builds = self.table(BUILDS)?;
        let mut out = Vec::new();
        for entry in index.range(Part::Build.all(deployment))?.rev() {
            let (k, _) = entry?;
            let id = k.value().2;
            if let Some(v) = builds.get(id)? {
                out.push(decode(v.value())?);
            }
        }
        Ok(out)
    }

    pub fn put_build_snapshots(&self, id: BuildId, s: &BuildSnapshots) -> StoreResult<()> {
        put_record(self.table(BUILD_SNAPSHOTS)?, id, s)
    }

    /// Moves one build from `from` to `to` in the builds-by-status counts
    /// (`None`: created, or deleted).
    pub fn shift_build_count(
        &self,
        from: Option<BuildStatus>,
        to: Option<BuildStatus>,
    ) -> StoreResult<()> {
        let mut meta = self.table(META)?;
        let mut counts = match meta.get(BUILD_COUNTS_KEY)? {
            Some(v) => decode_counts(v.value())?,
            // Every layout since version 4 has them (`layout`).
            None => return Err(StoreError::corrupt("meta.build_counts is missing")),
        };
        if let Some(from) = from {
            let c = &mut counts[from as usize];
            *c = c
                .checked_sub(1)
                .ok_or_else(|| StoreError::corrupt("a build count below zero"))?;
        }
        if let Some(to) = to {
            counts[to as usize] += 1;
        }
        meta.insert(BUILD_COUNTS_KEY, encode_counts(&counts).as_slice())?;
        Ok(())
    }

    /// Removes a finished build with its snapshots, log chunks and events.
    pub fn delete_build(&self, deployment: &str, id: BuildId) -> StoreResult<()> {
        let removed: Option<BuildRecord> = {
            let mut builds = self.table(BUILDS)?;
            let old = builds.remove(id)?;
            old.map(|v| decode(v.value())).transpose()?
        };
        if let Some(b) = removed {
            self.shift_build_count(Some(b.status), None)?;
        }
        self.table(BUILD_SNAPSHOTS)?.remove(id)?;
        self.table(DEPLOYMENT_ROWS)?
            .remove(Part::Build.key(deployment, id))?;
        self.table(CALLBACKS)?.remove(id)?;
        let mut chunks = self.table(LOG_CHUNKS)?;
        chunks.retain_in((id, 0u32)..=(id, u32::MAX), |_, _| false)?;
        let mut index = self.table(LOG_INDEX)?;
        index.retain_in((id, 0u32)..=(id, u32::MAX), |_, _| false)?;
        let mut events = self.table(BUILD_EVENTS)?;
        events.retain_in((id, 0u64)..=(id, u64::MAX), |_, _| false)?;
        let mut attempts = self.table(ATTEMPTS)?;
        attempts.retain_in((id, 0u64)..=(id, u64::MAX), |_, _| false)?;
        Ok(())
    }

    /// Stores a worker or agent token under the SHA-256 of its secret.
    pub fn put_token(&self, hash: &str, t: &TokenRecord) -> StoreResult<()> {
        put_record(self.table(TOKENS)?, hash, t)
    }

    pub fn remove_token(&self, hash: &str) -> StoreResult<()> {
        self.table(TOKENS)?.remove(hash)?;
        Ok(())
    }

    /// Stores a node bound to an agent under (deployment, node).
    pub fn put_node(&self, n: &NodeRecord) -> StoreResult<()> {
        put_record(
            self.table(NODES)?,
            (n.deployment.as_str(), n.node.as_str()),
            n,
        )
    }

    /// Stores an attempt under its build and fence.
    pub fn put_attempt(&self, a: &AttemptRecord) -> StoreResult<()> {
        put_record(self.table(ATTEMPTS)?, (a.build, a.fence), a)
    }

    /// Sets (`Some`) or lifts (`None`) the freeze under `key`
    /// (`GLOBAL_FREEZE` or a deployment id).
    pub fn put_freeze(&self, key: &str, f: Option<&FreezeRecord>) -> StoreResult<()> {
        match f {
            Some(f) => put_record(self.table(FREEZES)?, key, f),
            None => {
                self.table(FREEZES)?.remove(key)?;
                Ok(())
            }
        }
    }

    /// The global freeze's `ETag` counter, raised by each set and lift.
    pub fn bump_freeze_etag(&self) -> StoreResult<u64> {
        let next = self.freeze_etag()? + 1;
        self.table(META)?
            .insert(super::FREEZE_ETAG_KEY, next.to_le_bytes().as_slice())?;
        Ok(next)
    }

    pub fn put_rollout(&self, r: &RolloutRecord) -> StoreResult<()> {
        put_record(self.table(ROLLOUTS)?, r.build, r)
    }

    /// Stores a rollout build's deploy result (any record of the
    /// engine's); `None` removes it.
    pub fn put_rollout_result<T: serde::Serialize>(
        &self,
        build: BuildId,
        result: Option<&T>,
    ) -> StoreResult<()> {
        match result {
            Some(result) => put_record(self.table(ROLLOUT_RESULTS)?, build, result),
            None => {
                self.table(ROLLOUT_RESULTS)?.remove(build)?;
                Ok(())
            }
        }
    }

    /// Stores a rollout build's deploy result as an import carries it.
    pub(super) fn put_rollout_result_bytes(&self, build: BuildId, bytes: &[u8]) -> StoreResult<()> {
        self.table(ROLLOUT_RESULTS)?.insert(build, bytes)?;
        Ok(())
    }

    /// Stores a deployment's rollout policy (its JSON text); `None`: `{}`.
    pub fn put_rollout_policy(&self, deployment: &str, text: Option<&str>) -> StoreResult<()> {
        let mut t = self.table(ROLLOUT_POLICIES)?;
        match text {
            Some(text) => t.insert(deployment, text.as_bytes())?,
            None => t.remove(deployment)?,
        };
        Ok(())
    }

    pub fn put_work_states(&self, deployment: &str, w: &WorkStates) -> StoreResult<()> {
        put_record(self.table(WORK_STATES)?, deployment, w)
    }

    pub fn remove_work_states(&self, deployment: &str) -> StoreResult<()> {
        self.table(WORK_STATES)?.remove(deployment)?;
        Ok(())
    }

    /// One more list naming the archive `digest`; stores it (`compressed`,
    /// zstd, called only when the archive is new) in pieces.
    pub fn ref_work_state(
        &self,
        digest: &str,
        size: u64,
        compressed: impl FnOnce() -> StoreResult<std::sync::Arc<Vec<u8>>>,
    ) -> StoreResult<()> {
        let blob = match self.work_state_blob(digest)? {
            Some(mut blob) => {
                blob.refs = blob
                    .refs
                    .checked_add(1)
                    .ok_or_else(|| StoreError::corrupt("a work state named by 2^32 lists"))?;
                blob
            }
            None => {
                let bytes = compressed()?;
                let mut pieces = self.table(WORK_STATE_PIECES)?;
                let mut n = 0u64;
                for piece in bytes.chunks(WorkStateBlob::PIECE_BYTES) {
                    pieces.insert((digest, n), piece)?;
                    n += 1;
                }
                WorkStateBlob {
                    size,
                    stored_bytes: bytes.len() as u64,
                    pieces: n,
                    refs: 1,
                }
            }
        };
        put_record(self.table(WORK_STATE_BLOBS)?, digest, &blob)
    }

    /// One list fewer naming `digest`; the archive goes with the last.
    pub fn unref_work_state(&self, digest: &str) -> StoreResult<()> {
        let Some(mut blob) = self.work_state_blob(digest)? else {
            return Err(StoreError::corrupt(
                "a work state list names a missing archive",
            ));
        };
        if blob.refs > 1 {
            blob.refs -= 1;
            return put_record(self.table(WORK_STATE_BLOBS)?, digest, &blob);
        }
        let mut pieces = self.table(WORK_STATE_PIECES)?;
        for n in 0..blob.pieces {
            pieces.remove((digest, n))?;
        }
        self.table(WORK_STATE_BLOBS)?.remove(digest)?;
        Ok(())
    }

    /// Deletes every stored row (the `--reset-dev-state` path).
    pub fn clear_all(&self) -> StoreResult<()> {
        macro_rules! clear {
            ($($t:expr),*) => {$( self.clear($t)?; )*};
        }
        clear!(
            DEPLOYMENTS,
            BUILDS,
            QUEUED,
            RUNNING,
            LOG_CHUNKS,
            LOG_INDEX,
            IDEMPOTENCY,
            IDEMPOTENCY_EXPIRY,
            CALLBACKS,
            BUILD_EVENTS,
            BUILD_SNAPSHOTS,
            UPDATE_TRIES,
            SBOM_NODES,
            SBOM_COMPONENTS,
            ATTEMPTS,
            WORK_STATES,
            WORK_STATE_BLOBS,
            WORK_STATE_PIECES,
            ROLLOUTS,
            ROLLOUT_POLICIES,
            FREEZES,
            ROLLOUT_RESULTS
        );
        // The audit chain outlives a reset (it records the reset), and so
        // does its by-deployment index; builds and events go.
        self.table(DEPLOYMENT_ROWS)?
            .retain_in::<DeploymentRowKey>(.., |(_, part, _), _| part == Part::Audit as u8)?;
        self.table(META)?
            .insert(BUILD_COUNTS_KEY, encode_counts(&[0; 5]).as_slice())?;
        Ok(())
    }
}
