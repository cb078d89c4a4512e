//! The audit tables: appending a sealed event with its index entries and
//! Merkle subtrees, retention with its anchor, and the reads of the audit
//! routes, the proofs and `berth audit verify`. The chain and tree math are
//! the pure `crate::audit`; this file only moves rows.

use std::path::Path;

use redb::{ReadableDatabase, ReadableTable};

use super::tables::*;
use super::{Lookup, Rx, StoreError, StoreResult, Tx};
use crate::audit::merkle::{self, Hash, MissingNode, Nodes};
use crate::audit::{self as chain, Anchor, AuditResult, Draft, Event, Sealed, Walk};
use crate::model::Millis;

/// The chain hash a stored row starts with.
fn row_hash(row: &[u8]) -> StoreResult<Hash> {
    row.get(..32)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| StoreError::corrupt("an audit row without its hash"))
}

/// Rows per batch handed from the reading thread to the walking one, and
/// batches in flight (a bound on memory: about 4 MB of rows).
const WALK_BATCH: usize = 1024;
const WALK_BATCHES_IN_FLIGHT: usize = 8;

impl From<MissingNode> for StoreError {
    fn from(m: MissingNode) -> Self {
        StoreError::corrupt(format!(
            "the audit Merkle tree lacks the subtree at level {} index {}",
            m.level, m.index
        ))
    }
}

/// Audit reads in a read or a write transaction.
pub trait AuditLookup: Lookup {
    /// The retention anchor (genesis before any removal).
    fn audit_anchor(&self) -> StoreResult<Anchor> {
        let meta = self.open(META)?;
        let Some(v) = meta.get(ANCHOR_KEY)? else {
            return Ok(Anchor::genesis());
        };
        serde_json::from_slice(v.value())
            .map_err(|_| StoreError::corrupt("meta.audit_anchor is not an anchor"))
    }

    /// The newest event's seq and hash, or the anchor's when none is kept.
    fn audit_tail(&self) -> StoreResult<(u64, Hash)> {
        let events = self.open(AUDIT_EVENTS)?;
        if let Some((k, v)) = events.last()? {
            return Ok((k.value(), row_hash(v.value())?));
        }
        let anchor = self.audit_anchor()?;
        let prev = chain::decode_hash(&anchor.prev_hash)
            .ok_or_else(|| StoreError::corrupt("the audit anchor's hash is not hex"))?;
        Ok((anchor.first_seq.saturating_sub(1), prev))
    }

    /// The Merkle tree's size: every event since the first, pruned included.
    fn audit_size(&self) -> StoreResult<u64> {
        Ok(self.audit_tail()?.0)
    }

    fn audit_event(&self, seq: u64) -> StoreResult<Option<Event>> {
        let events = self.open(AUDIT_EVENTS)?;
        let Some(v) = events.get(seq)? else {
            return Ok(None);
        };
        chain::decode_row(v.value())
            .map(Some)
            .map_err(|_| StoreError::corrupt("an audit row is not an event"))
    }

    fn merkle_node(&self, level: u8, index: u64) -> StoreResult<Option<Hash>> {
        let nodes = self.open(MERKLE_NODES)?;
        let found = nodes.get((level, index))?;
        found
            .map(|v| {
                v.value()
                    .try_into()
                    .map_err(|_| StoreError::corrupt("a Merkle node is not 32 bytes"))
            })
            .transpose()
    }

    /// A deployment's newest `limit` events other than denied calls,
    /// below seq `before`, newest first.
    fn audit_of_deployment(
        &self,
        deployment: &str,
        before: Option<u64>,
        limit: usize,
    ) -> StoreResult<Vec<Event>> {
        let index = self.open(DEPLOYMENT_ROWS)?;
        let end = before.map_or(u128::MAX, u128::from);
        let range = Part::Audit.key(deployment, 0)..Part::Audit.key(deployment, end);
        let seqs = index
            .range(range)?
            .rev()
            .take(limit)
            .map(|entry| super::row_seq(entry?.0.value().2))
            .collect::<StoreResult<Vec<u64>>>()?;
        self.audit_events_at(seqs)
    }

    /// An actor's newest `limit` events, denied calls included, below seq
    /// `before`, newest first.
    fn audit_of_actor(
        &self,
        actor_key: &str,
        before: Option<u64>,
        limit: usize,
    ) -> StoreResult<Vec<Event>> {
        let index = self.open(AUDIT_BY_ACTOR)?;
        let end = before.unwrap_or(u64::MAX);
        let seqs = index
            .range((actor_key, 0u64)..(actor_key, end))?
            .rev()
            .take(limit)
            .map(|entry| Ok(entry?.0.value().1))
            .collect::<StoreResult<Vec<u64>>>()?;
        self.audit_events_at(seqs)
    }

    /// The events at `seqs` that are still kept, in that order.
    fn audit_events_at(&self, seqs: Vec<u64>) -> StoreResult<Vec<Event>> {
        let mut out = Vec::with_capacity(seqs.len());
        for seq in seqs {
            if let Some(e) = self.audit_event(seq)? {
                out.push(e);
            }
        }
        Ok(out)
    }
}

impl<T: Lookup> AuditLookup for T {}

/// The stored subtrees, for the proof math.
pub struct StoredNodes<'l, L: AuditLookup>(pub &'l L);

impl<L: AuditLookup> Nodes for StoredNodes<'_, L> {
    type Error = StoreError;
    /// A stored subtree; below `STORED_FROM_LEVEL`, one computed from the
    /// kept events under it (at most `2^STORED_FROM_LEVEL - 1` of them for
    /// a proof), or, where retention removed some of them, from the
    /// subtrees the prune kept for them (`prune_audit`).
    fn node(&self, level: u8, index: u64) -> StoreResult<Option<Hash>> {
        if let Some(stored) = self.0.merkle_node(level, index)? {
            return Ok(Some(stored));
        }
        if level >= STORED_FROM_LEVEL {
            return Ok(None);
        }
        self.computed(level, index)
    }
}

impl<L: AuditLookup> StoredNodes<'_, L> {
    /// Subtree `(level, index)` (level at most `STORED_FROM_LEVEL`) from
    /// the events under it, or, where some are pruned, from its halves.
    /// Not looked up itself: the append computes the lowest subtree it
    /// stores with this, one read of its 8 events.
    fn computed(&self, level: u8, index: u64) -> StoreResult<Option<Hash>> {
        let Some(first) = index.checked_mul(1u64 << level) else {
            return Ok(None);
        };
        if let Some(root) = kept_subtree(self.0, first, 1u64 << level)? {
            return Ok(Some(root));
        }
        if level == 0 {
            return Ok(None);
        }
        let (Some(left), Some(right)) = (
            self.node(level - 1, index * 2)?,
            self.node(level - 1, index * 2 + 1)?,
        ) else {
            return Ok(None);
        };
        Ok(Some(merkle::node_hash(&left, &right)))
    }
}

/// The root of the perfect subtree of the `width` leaves from leaf `first`,
/// from their events' hashes; `None` unless every one of those events is
/// kept (leaf `i` is the event of seq `i + 1`).
fn kept_subtree<L: Lookup>(lookup: &L, first: u64, width: u64) -> StoreResult<Option<Hash>> {
    debug_assert!(width.is_power_of_two() && width <= 1 << STORED_FROM_LEVEL);
    let Some(last_seq) = first.checked_add(width) else {
        return Ok(None);
    };
    let events = lookup.open(AUDIT_EVENTS)?;
    let mut range = merkle::CompactRange::new();
    for entry in events.range(first + 1..=last_seq)? {
        let (seq, row) = entry?;
        if seq.value() != first + 1 + range.size() {
            return Ok(None);
        }
        range.push(merkle::leaf_hash(&row_hash(row.value())?));
    }
    if range.size() != width {
        return Ok(None);
    }
    Ok(Some(range.root()))
}

/// What one retention pass removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pruned {
    pub removed: u64,
    pub first_seq: u64,
}

impl Tx<'_, '_> {
    /// Appends `draft` to the chain: the row, its index entries and the
    /// Merkle subtrees it completes, all in this transaction.
    pub fn append_audit(&self, draft: &Draft) -> StoreResult<Sealed> {
        let mut events = self.table(AUDIT_EVENTS)?;
        let tail = match events.last()? {
            Some((k, v)) => Some((k.value(), row_hash(v.value())?)),
            None => None,
        };
        let (last, prev) = match tail {
            Some(t) => t,
            // Nothing kept: the chain goes on from the anchor.
            None => {
                let anchor = self.audit_anchor()?;
                let prev = chain::decode_hash(&anchor.prev_hash)
                    .ok_or_else(|| StoreError::corrupt("the audit anchor's hash is not hex"))?;
                (anchor.first_seq.saturating_sub(1), prev)
            }
        };
        let seq = last + 1;
        let sealed = chain::seal(draft, seq, &prev);
        events.insert(seq, sealed.row.as_slice())?;
        drop(events);
        if let (Some(d), false) = (&draft.deployment, draft.result == AuditResult::Denied) {
            self.table(DEPLOYMENT_ROWS)?
                .insert(Part::Audit.key(d, seq.into()), EMPTY)?;
        }
        if let Some(actor) = &draft.actor {
            self.table(AUDIT_BY_ACTOR)?
                .insert((actor.key().as_str(), seq), EMPTY)?;
        }
        // The subtrees this event completes, from `STORED_FROM_LEVEL` up:
        // the lowest from the kept events under it, each one above from its
        // stored left half and the one below.
        let leaf_index = seq - 1;
        let mut completed = merkle::completed_by(leaf_index)
            .filter(|(level, _)| *level >= STORED_FROM_LEVEL)
            .peekable();
        if let Some(&(lowest, index)) = completed.peek() {
            let stored = StoredNodes(self);
            let mut below = stored.computed(lowest, index)?.ok_or(MissingNode {
                level: lowest,
                index,
            })?;
            let mut new_nodes: Vec<((u8, u64), Hash)> = Vec::with_capacity(merkle::MAX_LEVELS);
            for (level, index) in completed {
                if level > lowest {
                    let left = merkle::get(&stored, level - 1, index * 2)?;
                    below = merkle::node_hash(&left, &below);
                }
                new_nodes.push(((level, index), below));
            }
            let mut nodes = self.table(MERKLE_NODES)?;
            for (key, hash) in &new_nodes {
                nodes.insert(*key, hash.as_slice())?;
            }
        }
        Ok(sealed)
    }

    /// Removes up to `max` of the oldest events written before `cutoff`,
    /// moving the anchor (with the compact range of the removed prefix) in
    /// the same transaction. `None` when nothing was old enough.
    pub fn prune_audit(&self, cutoff: Millis, max: usize) -> StoreResult<Option<Pruned>> {
        let removed = self.oldest_audit_before(cutoff, max)?;
        let Some((last_seq, last)) = removed.last() else {
            return Ok(None);
        };
        let (last_seq, last_hash, last_at) = (
            *last_seq,
            last.hash.clone().ok_or_else(|| {
                StoreError::corrupt("a stored audit event has no hash; run `berth audit verify`")
            })?,
            last.at.clone(),
        );
        // The anchor keeps the compact range of [0, last_seq); the other
        // subtrees inside it are no longer needed by any proof. Its
        // subtrees below `STORED_FROM_LEVEL` were computed from events
        // until now, so they are read (or computed) before the events go,
        // and stored below.
        let prefix = last_seq;
        let compact: Vec<((u8, u64), Hash)> = {
            let stored = StoredNodes(self);
            merkle::compact_nodes(prefix)
                .into_iter()
                .map(|(level, index)| Ok(((level, index), merkle::get(&stored, level, index)?)))
                .collect::<StoreResult<_>>()?
        };
        self.remove_audit_rows(&removed)?;
        self.keep_compact_nodes(prefix, &compact)?;
        let compact_range = compact
            .iter()
            .map(|(_, hash)| crate::hex::encode(hash))
            .collect();
        let anchor = Anchor {
            first_seq: last_seq + 1,
            prev_hash: last_hash,
            removed_count: last_seq,
            removed_until: Some(last_at),
            compact_range,
        };
        let json = serde_json::to_vec(&anchor).map_err(|e| StoreError::other(e.to_string()))?;
        self.table(META)?.insert(ANCHOR_KEY, json.as_slice())?;
        Ok(Some(Pruned {
            removed: removed.len() as u64,
            first_seq: last_seq + 1,
        }))
    }

    /// The oldest events before `cutoff`, at most `max`.
    fn oldest_audit_before(&self, cutoff: Millis, max: usize) -> StoreResult<Vec<(u64, Event)>> {
        let events = self.table(AUDIT_EVENTS)?;
        let mut oldest: Vec<(u64, Event)> = Vec::new();
        for entry in events.iter()? {
            let (k, v) = entry?;
            let e = chain::decode_row(v.value())
                .map_err(|_| StoreError::corrupt("an audit row is not an event"))?;
            let at = crate::model::parse_time(&e.at)
                .ok_or_else(|| StoreError::corrupt("an audit event's time is not RFC 3339"))?;
            if at >= cutoff || oldest.len() >= max {
                break;
            }
            oldest.push((k.value(), e));
        }
        Ok(oldest)
    }

    /// Removes the events and their rows in the deployment and actor
    /// indexes.
    fn remove_audit_rows(&self, removed: &[(u64, Event)]) -> StoreResult<()> {
        let mut events = self.table(AUDIT_EVENTS)?;
        let mut by_deployment = self.table(DEPLOYMENT_ROWS)?;
        let mut by_actor = self.table(AUDIT_BY_ACTOR)?;
        for (seq, e) in removed {
            events.remove(*seq)?;
            if let Some(d) = &e.deployment {
                by_deployment.remove(Part::Audit.key(d, (*seq).into()))?;
            }
            if let Some(a) = &e.actor {
                by_actor.remove((a.key().as_str(), *seq))?;
            }
        }
        Ok(())
    }

    /// Drops the subtrees inside the pruned prefix but its compact range,
    /// which is stored whole (its small subtrees were computed until now).
    fn keep_compact_nodes(&self, prefix: u64, compact: &[((u8, u64), Hash)]) -> StoreResult<()> {
        let mut nodes = self.table(MERKLE_NODES)?;
        for level in 0..64u8 {
            let inside = prefix >> level;
            if inside == 0 {
                break;
            }
            // The compact node of this level (if any) is the last inside.
            let keep_last = prefix & (1u64 << level) != 0;
            let end = if keep_last { inside - 1 } else { inside };
            nodes.retain_in((level, 0u64)..(level, end), |_, _| false)?;
        }
        for (key, hash) in compact {
            if key.0 < STORED_FROM_LEVEL {
                nodes.insert(*key, hash.as_slice())?;
            }
        }
        Ok(())
    }
}

impl Rx {
    /// Rows and bytes of the kept events (a baseline for verify: reading
    /// without checking).
    pub fn count_audit_rows(&self) -> StoreResult<(u64, u64)> {
        let events = self.rows(AUDIT_EVENTS)?;
        let (mut rows, mut bytes) = (0u64, 0u64);
        for entry in events.iter()? {
            let (_, v) = entry?;
            rows += 1;
            bytes += v.value().len() as u64;
        }
        Ok((rows, bytes))
    }

    /// Feeds every kept event, in seq order, to `walk`: this thread reads
    /// rows from redb while another hashes them, in batches, so reading
    /// and hashing overlap on two cores.
    pub fn walk_audit(&self, walk: &mut Walk) -> StoreResult<()> {
        let events = self.rows(AUDIT_EVENTS)?;
        /// Rows in one buffer: (seq, end offset) per row.
        #[derive(Default)]
        struct Batch {
            rows: Vec<(u64, usize)>,
            bytes: Vec<u8>,
        }
        let (to_walker, batches) = std::sync::mpsc::sync_channel::<Batch>(WALK_BATCHES_IN_FLIGHT);
        std::thread::scope(|scope| {
            let walker = scope.spawn(move || {
                for batch in batches {
                    let mut start = 0;
                    for (seq, end) in batch.rows {
                        walk.feed(seq, &batch.bytes[start..end]);
                        start = end;
                    }
                }
            });
            let mut batch = Batch::default();
            let mut read = || -> StoreResult<()> {
                for entry in events.iter()? {
                    let (k, v) = entry?;
                    batch.bytes.extend_from_slice(v.value());
                    batch.rows.push((k.value(), batch.bytes.len()));
                    if batch.rows.len() == WALK_BATCH
                        && to_walker.send(std::mem::take(&mut batch)).is_err()
                    {
                        break;
                    }
                }
                let _ = to_walker.send(std::mem::take(&mut batch));
                Ok(())
            };
            let read = read();
            drop(to_walker);
            walker
                .join()
                .map_err(|_| StoreError::other("the verify walker panicked"))?;
            read
        })
    }
}

/// Why the file itself could not be opened for reading.
enum OpenFailure {
    /// A server holds it alone: ask it for a snapshot.
    Held,
    Failed(StoreError),
}
use OpenFailure::{Failed, Held};

/// The store opened read-only beside a running server (`berth audit
/// verify`, `push-head`, `export`). A server with `--shared-store` opens
/// redb in `SingleWriter` mode, so other processes may read the file and
/// follow its commits; one holding it alone (the default) is asked
/// for a snapshot of what the reader needs instead (`snapshot.rs`), which
/// is read here the same way and deleted when this is dropped.
pub struct ReadOnlyStore {
    db: redb::ReadOnlyDatabase,
    /// The snapshot file read instead of the live one, if any.
    _snapshot: Option<super::snapshot::SnapshotFile>,
}

impl ReadOnlyStore {
    /// Opens the store at `path` for a reader that needs `scope`'s tables.
    pub fn open(path: &Path, scope: super::snapshot::Scope) -> StoreResult<ReadOnlyStore> {
        match ReadOnlyStore::open_file(path, scope) {
            Err(Held) => {
                let snapshot = super::snapshot::request(path, scope)?;
                let mut store =
                    ReadOnlyStore::open_file(&snapshot.path, scope).map_err(|e| match e {
                        Held => StoreError::other("a snapshot file is held by another process"),
                        Failed(e) => e,
                    })?;
                store._snapshot = Some(snapshot);
                Ok(store)
            }
            Err(Failed(e)) => Err(e),
            Ok(store) => Ok(store),
        }
    }

    fn open_file(path: &Path, scope: super::snapshot::Scope) -> Result<ReadOnlyStore, OpenFailure> {
        let db = super::redb_builder(redb::ConcurrencyMode::SingleWriter, super::CacheSize::DEFAULT)
            .open_read_only(path)
            .map_err(|e| match e {
                redb::DatabaseError::DatabaseAlreadyOpen => Held,
                redb::DatabaseError::RepairAborted => Failed(StoreError::other(
                    "the store was not closed cleanly (berth was killed?) and no berth runs to repair it: start `berth serve` on it once, then verify (also while it runs)",
                )),
                other => Failed(StoreError::from(other)),
            })?;
        let store = ReadOnlyStore {
            db,
            _snapshot: None,
        };
        store.check(path, scope).map_err(Failed)?;
        Ok(store)
    }

    fn check(&self, path: &Path, scope: super::snapshot::Scope) -> StoreResult<()> {
        // A redo log still holding acknowledged rows (a store held alone,
        // then killed): the file alone is older than what was answered.
        let pending = super::redo::pending(path, &self.read()?.txn.open_table(META)?)?;
        if pending {
            return Err(StoreError::other(format!(
                "{} holds acknowledged writes not yet in the store (berth was stopped without a \
                 clean shutdown): start `berth serve` on it once to apply them, then read it",
                super::redo::path_of(path).display()
            )));
        }
        // A file of a newer layout may hold what this berth would misread.
        let newer = self
            .read()?
            .layout_version()?
            .filter(|v| *v > super::LAYOUT_VERSION);
        if let Some(version) = newer {
            return Err(StoreError::other(format!(
                "the store has layout version {version}, newer than this berth's {}; read it with the berth that wrote it",
                super::LAYOUT_VERSION
            )));
        }
        // An export reads every table in this berth's layout, and a file
        // of an older one has some elsewhere (layout 9 moved a
        // deployment's events): it would miss rows or fail part-way. The
        // audit chain's tables have kept their layout, so verify and
        // push-head read any older file.
        let older = self
            .read()?
            .layout_version()?
            .filter(|v| *v < super::LAYOUT_VERSION);
        match (scope, older) {
            (super::snapshot::Scope::All, Some(version)) => Err(StoreError::other(format!(
                "the store has layout version {version}, older than this berth's {}: start \
                 `berth serve` on it once (it migrates the store at start), then export",
                super::LAYOUT_VERSION
            ))),
            (super::snapshot::Scope::All | super::snapshot::Scope::Audit, _) => Ok(()),
        }
    }

    pub fn read(&self) -> StoreResult<Rx> {
        Ok(Rx {
            txn: self.db.begin_read()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::merkle::{verify_consistency, verify_inclusion};
    use crate::audit::{Actor, ProblemKind};

    fn draft(at: Millis, i: u64) -> Draft {
        Draft {
            at,
            actor: Some(Actor {
                subject: format!("user{}", i % 3),
                issuer: None,
            }),
            trusted_backend: true,
            action: "submit",
            deployment: Some(format!("d{}", i % 5)),
            build: None,
            node: None,
            request_id: format!("r{i}"),
            result: AuditResult::Ok,
            reason: None,
            count: 1,
        }
    }

    /// The leaf hash of the kept event `seq`.
    fn leaf_of(rx: &Rx, seq: u64) -> Hash {
        let e = rx.audit_event(seq).unwrap().unwrap();
        merkle::leaf_hash(&chain::decode_hash(e.hash.as_deref().unwrap()).unwrap())
    }

    /// A prune inside a block of 8 events, then the events that complete
    /// that block: the stored subtree of 8 is computed from the pruned
    /// prefix's small subtrees (kept by the prune) and the kept events, and
    /// every root and proof past the prefix agrees with the tree of all
    /// leaves. Only subtrees of 8 and up are stored, but for the prefix's.
    #[tokio::test]
    async fn a_subtree_completed_across_a_pruned_prefix_is_stored_right() {
        let dir = std::env::temp_dir().join(format!("berth-audit-across-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store = crate::store::Store::open(&dir.join("berth.redb")).unwrap();
        let old = crate::model::now_millis() - 400 * 24 * 3600 * 1000;
        let new = crate::model::now_millis();
        const PRUNED: u64 = 13;
        const ALL: u64 = 41;
        store
            .write(move |tx| {
                for i in 0..PRUNED {
                    tx.append_audit(&draft(old, i))?;
                }
                Ok(())
            })
            .await
            .unwrap();
        let mut leaves: Vec<Hash> = {
            let rx = store.read().unwrap();
            (1..=PRUNED).map(|seq| leaf_of(&rx, seq)).collect()
        };
        let pruned = store
            .write(move |tx| tx.prune_audit(new - 1000, 100))
            .await
            .unwrap();
        assert_eq!(pruned.map(|p| p.first_seq), Some(PRUNED + 1));
        // One event a transaction, as submits append them.
        for i in PRUNED..ALL {
            store
                .write(move |tx| tx.append_audit(&draft(new, i)).map(|_| ()))
                .await
                .unwrap();
        }
        let rx = store.read().unwrap();
        leaves.extend((PRUNED + 1..=ALL).map(|seq| leaf_of(&rx, seq)));
        let nodes = StoredNodes(&rx);
        for size in PRUNED + 1..=ALL {
            let mut all = merkle::CompactRange::new();
            leaves[..size as usize].iter().for_each(|l| all.push(*l));
            assert_eq!(
                merkle::root(&nodes, size).unwrap(),
                all.root(),
                "size {size}"
            );
            for seq in PRUNED + 1..=size {
                let path = merkle::inclusion_path(&nodes, seq - 1, size).unwrap();
                assert!(
                    verify_inclusion(seq - 1, size, &leaves[seq as usize - 1], &path, &all.root()),
                    "seq {seq} in {size}"
                );
            }
        }
        for entry in rx.open(MERKLE_NODES).unwrap().iter().unwrap() {
            let (level, index) = entry.unwrap().0.value();
            assert!(
                level >= STORED_FROM_LEVEL || (index + 1) << level <= PRUNED,
                "a computable subtree ({level}, {index}) is stored"
            );
        }
        // Exactly the subtrees of 8 and up that 41 leaves complete, and the
        // prefix's compact range below 8 (a subtree of 4 and one leaf).
        let stored = rx.open(MERKLE_NODES).unwrap().iter().unwrap().count();
        assert_eq!(
            stored,
            5 + 2 + 1 + 2,
            "subtrees of 8, 16, 32 and the prefix's"
        );
        drop(rx);
        store.close().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn retention_keeps_the_root_the_proofs_and_a_clean_verify() {
        let dir = std::env::temp_dir().join(format!("berth-audit-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("berth.redb");
        let store = crate::store::Store::open(&path).unwrap();
        let old = crate::model::now_millis() - 400 * 24 * 3600 * 1000;
        let new = crate::model::now_millis();
        store
            .write(move |tx| {
                for i in 0..37u64 {
                    tx.append_audit(&draft(if i < 23 { old } else { new }, i))?;
                }
                Ok(())
            })
            .await
            .unwrap();
        let roots: Vec<Hash> = {
            let rx = store.read().unwrap();
            (1..=37)
                .map(|n| merkle::root(&StoredNodes(&rx), n).unwrap())
                .collect()
        };
        // Two batches: 10, then the other 13 old ones.
        let cutoff = new - 1000;
        let first = store
            .write(move |tx| tx.prune_audit(cutoff, 10))
            .await
            .unwrap();
        assert_eq!(
            first,
            Some(Pruned {
                removed: 10,
                first_seq: 11
            })
        );
        let second = store
            .write(move |tx| tx.prune_audit(cutoff, 100))
            .await
            .unwrap();
        assert_eq!(
            second,
            Some(Pruned {
                removed: 13,
                first_seq: 24
            })
        );
        assert_eq!(
            store
                .write(move |tx| tx.prune_audit(cutoff, 100))
                .await
                .unwrap(),
            None
        );

        let rx = store.read().unwrap();
        let anchor = rx.audit_anchor().unwrap();
        assert_eq!((anchor.first_seq, anchor.removed_count), (24, 23));
        assert_eq!(anchor.compact_range.len(), 23u64.count_ones() as usize);
        let mut walk = Walk::new(anchor, None);
        rx.walk_audit(&mut walk).unwrap();
        let report = walk.finish();
        assert!(report.ok, "{:?}", report.problems);
        assert_eq!(report.size, 37);
        assert_eq!(
            report.merkle_root,
            crate::hex::encode(&roots[36]),
            "the root survives pruning"
        );
        // Proofs of kept events, at every size past the anchor, still verify.
        let nodes = StoredNodes(&rx);
        for size in 24..=37u64 {
            assert_eq!(
                merkle::root(&nodes, size).unwrap(),
                roots[size as usize - 1]
            );
            for seq in 24..=size {
                let e = rx.audit_event(seq).unwrap().unwrap();
                let leaf =
                    merkle::leaf_hash(&chain::decode_hash(e.hash.as_deref().unwrap()).unwrap());
                let path = merkle::inclusion_path(&nodes, seq - 1, size).unwrap();
                assert!(verify_inclusion(
                    seq - 1,
                    size,
                    &leaf,
                    &path,
                    &roots[size as usize - 1]
                ));
            }
            for from in 24..=size {
                let path = merkle::consistency_path(&nodes, from, size).unwrap();
                let (r1, r2) = (&roots[from as usize - 1], &roots[size as usize - 1]);
                assert!(verify_consistency(from, size, r1, r2, &path));
            }
        }
        // Index entries of removed events are gone with them.
        let kept = rx
            .audit_of_actor(
                &Actor {
                    subject: "user0".into(),
                    issuer: None,
                }
                .key(),
                None,
                100,
            )
            .unwrap();
        assert!(kept.iter().all(|e| e.seq >= 24) && !kept.is_empty());
        // The next event follows the kept chain.
        drop(rx);
        store
            .write(move |tx| tx.append_audit(&draft(new, 99)).map(|_| ()))
            .await
            .unwrap();
        let rx = store.read().unwrap();
        let mut walk = Walk::new(rx.audit_anchor().unwrap(), None);
        rx.walk_audit(&mut walk).unwrap();
        let report = walk.finish();
        assert!(report.ok && report.size == 38, "{:?}", report.problems);
        // A forged anchor is caught.
        let mut forged = rx.audit_anchor().unwrap();
        forged.prev_hash = "00".repeat(32);
        let mut walk = Walk::new(forged, None);
        rx.walk_audit(&mut walk).unwrap();
        let kinds: Vec<ProblemKind> = walk.finish().problems.iter().map(|p| p.kind).collect();
        assert_eq!(kinds, [ProblemKind::AnchorMismatch]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
