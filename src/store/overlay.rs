//! The rows acknowledged since the last checkpoint, for readers.
//!
//! Why it exists: with a redo log the writer keeps one redb write
//! transaction open from one checkpoint to the next (`writer.rs`), so a
//! batch's commit is the append and sync of its rows and nothing of
//! redb's; a row's B-tree pages are copied once per checkpoint, not once
//! per group commit. Readers cannot see into an open write transaction,
//! so each batch's rows, once synced, are also published here, and a
//! reader merges them over its redb read transaction (`view.rs`).
//!
//! A reader sees one instant: every version carries the number of the
//! batch that wrote it, and a reader sees the versions up to the last
//! batch published when it began (`Seen`). A checkpoint starts a new
//! generation once redb holds the old one durably; a reader that began
//! before keeps the old generation (an `Arc`) and its redb snapshot
//! from before the checkpoint, so it never misses a row. The pair is
//! taken together under one lock (`Overlay::begin`), and a checkpoint
//! swaps the generation under the same lock after its commit, so a reader
//! at worst meets a row in both (the same value) but never in neither.
//!
//! Pure: no I/O. The size is bounded by the redo log's (a generation
//! holds what the log holds, `redo::CHECKPOINT_BYTES`, before a
//! checkpoint is due).

use crate::locks::{Held, HeldRw};
use std::borrow::Borrow;
use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;

use super::tables::{EachTable, Table};

/// How a table orders its keys: redb's `Key::compare` of its key type.
pub(super) type Compare = fn(&[u8], &[u8]) -> Ordering;

/// A table's key bytes, ordered as redb orders that table's keys. The
/// bytes are a slice of the batch's record, shared by all its rows
/// (`Staged::of_record`): one copy a batch, not two allocations a row.
struct RowKey {
    bytes: Bytes,
    compare: Compare,
}

/// Key bytes with their table's order: a stored key (`RowKey`), or one a
/// reader looks up or bounds a range with (`Probe`), which the map finds
/// through `Borrow` without copying it into a `RowKey` first.
trait OrderedKey {
    fn bytes(&self) -> &[u8];
    fn compare(&self) -> Compare;
}

impl OrderedKey for RowKey {
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    fn compare(&self) -> Compare {
        self.compare
    }
}

/// A key a reader asks for, borrowed from the reader.
struct Probe<'k> {
    bytes: &'k [u8],
    compare: Compare,
}

impl OrderedKey for Probe<'_> {
    fn bytes(&self) -> &[u8] {
        self.bytes
    }
    fn compare(&self) -> Compare {
        self.compare
    }
}

impl<'a> Borrow<dyn OrderedKey + 'a> for RowKey {
    fn borrow(&self) -> &(dyn OrderedKey + 'a) {
        self
    }
}

impl PartialEq for dyn OrderedKey + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for dyn OrderedKey + '_ {}
impl PartialOrd for dyn OrderedKey + '_ {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for dyn OrderedKey + '_ {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.compare())(self.bytes(), other.bytes())
    }
}

// `RowKey`'s order is the one `dyn OrderedKey` has, as `Borrow` requires.
impl PartialEq for RowKey {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for RowKey {}
impl PartialOrd for RowKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for RowKey {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.compare)(&self.bytes, &other.bytes)
    }
}

/// A row's value as a batch left it: `None` when the batch removed it.
pub(super) type Version = Option<Bytes>;

/// A row's versions in batch order: most rows of a generation are
/// written once, so one version is kept without a `Vec` of its own (an
/// allocation less per row, on the writer thread).
enum Versions {
    One((u64, Version)),
    Many(Vec<(u64, Version)>),
}

impl Versions {
    fn as_slice(&self) -> &[(u64, Version)] {
        match self {
            Versions::One(v) => std::slice::from_ref(v),
            Versions::Many(vs) => vs,
        }
    }

    fn last_mut(&mut self) -> Option<&mut (u64, Version)> {
        match self {
            Versions::One(v) => Some(v),
            Versions::Many(vs) => vs.last_mut(),
        }
    }

    fn push(&mut self, version: (u64, Version)) {
        *self = match std::mem::replace(self, Versions::Many(Vec::new())) {
            Versions::One(first) => Versions::Many(vec![first, version]),
            Versions::Many(vs) if vs.is_empty() => Versions::One(version),
            Versions::Many(mut vs) => {
                vs.push(version);
                Versions::Many(vs)
            }
        };
    }

    fn pop(&mut self) {
        match self {
            Versions::One(_) => *self = Versions::Many(Vec::new()),
            Versions::Many(vs) => {
                vs.pop();
            }
        }
    }
}

/// One table's rows written in a generation, each with its versions in
/// batch order.
struct TableRows {
    /// Which table (the rows are kept at its number: asserted on use).
    table: Table,
    compare: Compare,
    /// The batches that emptied the table (`Tx::clear`), in order: from
    /// the first on, redb's rows of the table are not there, and from
    /// each on, no version written before it.
    clears: Vec<u64>,
    rows: BTreeMap<RowKey, Versions>,
}

impl TableRows {
    fn new(table: Table) -> Self {
        TableRows {
            table,
            compare: compare_of(table),
            clears: Vec::new(),
            rows: BTreeMap::new(),
        }
    }

    fn probe<'k>(&self, bytes: &'k [u8]) -> Probe<'k> {
        Probe {
            bytes,
            compare: self.compare,
        }
    }

    /// The last clear a reader at `upto` sees, if any.
    fn cleared_by(&self, upto: u64) -> Option<u64> {
        self.clears.iter().rev().find(|c| **c <= upto).copied()
    }

    /// Whether redb's rows are hidden from a reader at `upto`.
    fn hides_stored(&self, upto: u64) -> bool {
        self.cleared_by(upto).is_some()
    }

    /// The version a reader at `upto` sees among `versions`, if any.
    fn visible<'v>(&self, versions: &'v [(u64, Version)], upto: u64) -> Option<&'v Version> {
        let floor = self.cleared_by(upto).unwrap_or(0);
        versions
            .iter()
            .rev()
            .find(|(seq, _)| *seq <= upto)
            .filter(|(seq, _)| *seq >= floor)
            .map(|(_, v)| v)
    }
}

/// A row of the overlay: its key bytes and its version.
pub(super) type OverlayRow = (Bytes, Version);

/// One table's rows as the last batch left them (`Overlay::latest`):
/// whether a batch emptied it, then its rows.
pub(super) type LatestRows = (Table, bool, Vec<OverlayRow>);

/// What the overlay says of a key to a reader.
#[derive(Debug, PartialEq)]
pub(super) enum Found {
    /// The overlay has this version of the row (`None`: removed).
    Here(Version),
    /// Not in the overlay: redb's row (if any) is the one.
    Stored,
}

/// One generation: the rows of the batches between two checkpoints.
pub(super) struct Generation {
    tables: RwLock<Vec<TableRows>>,
}

impl Generation {
    fn new() -> Self {
        // Indexed by the table's number (`Table as usize`), as
        // `logged::OpenTables` is, not by its place in `Table::ALL`.
        let mut tables: Vec<Option<TableRows>> = (0..Table::ALL.len()).map(|_| None).collect();
        for table in Table::ALL {
            tables[table as usize] = Some(TableRows::new(table));
        }
        debug_assert!(tables.iter().all(Option::is_some), "a table without rows");
        Generation {
            tables: RwLock::new(tables.into_iter().flatten().collect()),
        }
    }
}

/// The overlay: the generation being written and the last batch
/// published.
#[derive(Default)]
pub(super) struct Overlay {
    state: Mutex<State>,
}

struct State {
    current: Arc<Generation>,
    published: u64,
}

impl Default for State {
    fn default() -> Self {
        State {
            current: Arc::new(Generation::new()),
            published: 0,
        }
    }
}

/// What one reader sees of the overlay: a generation up to a batch.
#[derive(Clone)]
pub(super) struct Seen {
    generation: Arc<Generation>,
    upto: u64,
}

/// One batch's rows copied out of its redo record, ready to publish:
/// keys and values are copied before any lock is taken, so readers never
/// wait on the allocations (the new versions are invisible until
/// `published` names their batch).
pub(super) struct Staged(Vec<(Table, Option<(RowKey, Version)>)>);

impl Staged {
    /// Rows from anywhere, each key and value copied (`Overlay::publish`,
    /// the tests' way in).
    #[cfg(test)]
    pub(super) fn of<'a>(ops: impl IntoIterator<Item = Op<'a>>) -> Staged {
        Staged::sliced(ops, Bytes::copy_from_slice)
    }

    /// A redo record's rows, `ops` parsed from `shared` (its copy from
    /// `RecordBuf::shared_rows`, by `redo::ops_in`): every key and value
    /// is a slice of that copy. Why: a copy of each key and value cost two
    /// allocations a row on the writer, and as many frees where a
    /// generation is dropped. Every op's bytes must lie inside `shared`
    /// (`Bytes::slice_ref` asserts it).
    pub(super) fn of_record<'a>(
        shared: &'a Bytes,
        ops: impl IntoIterator<Item = Op<'a>>,
    ) -> Staged {
        Staged::sliced(ops, |part| shared.slice_ref(part))
    }

    fn sliced<'a>(
        ops: impl IntoIterator<Item = Op<'a>>,
        own: impl Fn(&'a [u8]) -> Bytes,
    ) -> Staged {
        Staged(
            ops.into_iter()
                .map(|op| match op {
                    Op::Insert(table, key, value) => {
                        (table, Some((row_key(table, own(key)), Some(own(value)))))
                    }
                    Op::Remove(table, key) => (table, Some((row_key(table, own(key)), None))),
                    Op::Clear(table) => (table, None),
                })
                .collect(),
        )
    }
}

/// One op of a batch, as the redo record holds it.
pub(super) enum Op<'a> {
    Insert(Table, &'a [u8], &'a [u8]),
    Remove(Table, &'a [u8]),
    Clear(Table),
}

impl Overlay {
    /// What a reader beginning now sees, and `open_stored` (its redb read
    /// transaction) begun under the same lock, so no checkpoint falls
    /// between the two.
    pub(super) fn begin<T, E>(
        &self,
        open_stored: impl FnOnce() -> Result<T, E>,
    ) -> Result<(T, Seen), E> {
        let state = self.lock();
        let stored = open_stored()?;
        let seen = Seen {
            generation: state.current.clone(),
            upto: state.published,
        };
        Ok((stored, seen))
    }

    /// `publish_staged` of rows copied from anywhere (the tests' way in).
    #[cfg(test)]
    pub(super) fn publish<'a>(&self, ops: impl IntoIterator<Item = Op<'a>>) {
        self.publish_staged(Staged::of(ops))
    }

    /// Adds one batch's rows (after its sync), visible to readers that
    /// begin from now on. The rows were copied out beforehand
    /// (`Staged::of_record`), so the thread that publishes needs nothing
    /// of the record they came from.
    ///
    /// Called by the holder of the redo log's lock (the writer, or a
    /// checkpoint at close), or for it by the log's syncer thread
    /// (`syncer.rs`) for batches the holder handed it; `restart` comes
    /// only from the holder once the syncer has nothing in hand
    /// (`Syncer::settle`), so the two never interleave.
    pub(super) fn publish_staged(&self, Staged(staged): Staged) {
        let (generation, seq) = {
            let state = self.lock();
            (state.current.clone(), state.published + 1)
        };
        {
            let mut tables = generation.tables.write_held();
            for (table, row) in staged {
                let rows = rows_of_mut(&mut tables, table);
                match row {
                    Some((key, version)) => push(rows, key, seq, version),
                    None => {
                        // What this batch wrote before the clear goes
                        // with it (a version of this batch is after it).
                        rows.rows.retain(|_, versions| {
                            if versions.as_slice().last().is_some_and(|(s, _)| *s == seq) {
                                versions.pop();
                            }
                            !versions.as_slice().is_empty()
                        });
                        if rows.clears.last() != Some(&seq) {
                            rows.clears.push(seq);
                        }
                    }
                }
            }
        }
        self.lock().published = seq;
    }

    /// Starts a new generation: redb now holds every row of the old one
    /// durably (a checkpoint), or again (a reopen's replay). Returns the
    /// old one, for the caller to drop where its thousands of rows' frees
    /// cost no writer time (readers that began before may still hold it).
    #[must_use = "the old generation is dropped where the caller says"]
    pub(super) fn restart(&self) -> Arc<Generation> {
        let mut state = self.lock();
        std::mem::replace(&mut state.current, Arc::new(Generation::new()))
    }

    /// Every row of the generation being written, as its last batch left
    /// it, table by table: what an aborted write transaction lost and
    /// must be given again (`writer.rs`).
    pub(super) fn latest(&self) -> Vec<LatestRows> {
        let state = self.lock();
        let tables = state.current.tables.read_held();
        Table::ALL
            .into_iter()
            .map(|table| (table, rows_of(&tables, table)))
            .filter(|(_, t)| !t.clears.is_empty() || !t.rows.is_empty())
            .map(|(table, t)| {
                let rows = t
                    .rows
                    .iter()
                    .filter_map(|(k, versions)| {
                        let (seq, v) = versions.as_slice().last()?;
                        // A version from before the last clear went with it.
                        let cleared = t.clears.last().is_some_and(|c| seq < c);
                        (!cleared).then(|| (k.bytes.clone(), v.clone()))
                    })
                    .collect();
                (table, !t.clears.is_empty(), rows)
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.held()
    }
}

/// `table`'s rows among a generation's.
fn rows_of(tables: &[TableRows], table: Table) -> &TableRows {
    let rows = &tables[table as usize];
    assert_eq!(rows.table, table, "a generation's tables out of place");
    rows
}

fn rows_of_mut(tables: &mut [TableRows], table: Table) -> &mut TableRows {
    let rows = &mut tables[table as usize];
    assert_eq!(rows.table, table, "a generation's tables out of place");
    rows
}

fn row_key(table: Table, bytes: Bytes) -> RowKey {
    RowKey {
        bytes,
        compare: compare_of(table),
    }
}

fn push(rows: &mut TableRows, key: RowKey, seq: u64, version: Version) {
    match rows.rows.entry(key) {
        std::collections::btree_map::Entry::Vacant(e) => {
            e.insert(Versions::One((seq, version)));
        }
        std::collections::btree_map::Entry::Occupied(mut e) => {
            let versions = e.get_mut();
            debug_assert!(versions.as_slice().last().is_none_or(|(s, _)| *s <= seq));
            match versions.last_mut() {
                // A batch that wrote a row twice keeps its last value.
                Some((s, v)) if *s == seq => *v = version,
                _ => versions.push((seq, version)),
            }
        }
    }
}

impl Seen {
    fn read<T>(&self, f: impl FnOnce(&[TableRows]) -> T) -> T {
        let tables = self.generation.tables.read_held();
        f(&tables)
    }

    /// The overlay's word on `key` of `table`.
    pub(super) fn get(&self, table: Table, key: &[u8]) -> Found {
        self.read(|tables| {
            let rows = rows_of(tables, table);
            let hidden = rows.hides_stored(self.upto);
            let probe = rows.probe(key);
            match rows
                .rows
                .get(&probe as &dyn OrderedKey)
                .and_then(|v| rows.visible(v.as_slice(), self.upto))
            {
                Some(v) => Found::Here(v.clone()),
                None if hidden => Found::Here(None),
                None => Found::Stored,
            }
        })
    }

    /// Whether redb's rows of `table` are hidden (the table was emptied).
    pub(super) fn hides_stored(&self, table: Table) -> bool {
        self.read(|tables| rows_of(tables, table).hides_stored(self.upto))
    }

    /// The overlay's rows of `table` between `start` and `end`, in key
    /// order, removals included (`None`).
    pub(super) fn range(
        &self,
        table: Table,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
    ) -> Vec<OverlayRow> {
        self.read(|tables| {
            let rows = rows_of(tables, table);
            if empty_range(rows.compare, start, end) {
                return Vec::new();
            }
            let (start, end) = (start.map(|k| rows.probe(k)), end.map(|k| rows.probe(k)));
            rows.rows
                .range::<dyn OrderedKey, _>((as_ordered(&start), as_ordered(&end)))
                .filter_map(|(k, versions)| {
                    let v = rows.visible(versions.as_slice(), self.upto)?;
                    Some((k.bytes.clone(), v.clone()))
                })
                .collect()
        })
    }
}

/// A range bound of probes as the map's `Borrow` target.
fn as_ordered<'b>(bound: &'b Bound<Probe<'_>>) -> Bound<&'b (dyn OrderedKey + 'b)> {
    match bound {
        Bound::Included(k) => Bound::Included(k),
        Bound::Excluded(k) => Bound::Excluded(k),
        Bound::Unbounded => Bound::Unbounded,
    }
}

/// Whether `start..end` holds no key (`BTreeMap::range` panics on one
/// whose start is past its end).
fn empty_range(compare: Compare, start: Bound<&[u8]>, end: Bound<&[u8]>) -> bool {
    let (s, s_in, e, e_in) = match (start, end) {
        (Bound::Included(s), Bound::Included(e)) => (s, true, e, true),
        (Bound::Included(s), Bound::Excluded(e)) => (s, true, e, false),
        (Bound::Excluded(s), Bound::Included(e)) => (s, false, e, true),
        (Bound::Excluded(s), Bound::Excluded(e)) => (s, false, e, false),
        (Bound::Unbounded, _) | (_, Bound::Unbounded) => return false,
    };
    match compare(s, e) {
        Ordering::Greater => true,
        Ordering::Equal => !(s_in && e_in),
        Ordering::Less => false,
    }
}

/// The key order of `table`: its key type's `Key::compare`.
pub(super) fn compare_of(table: Table) -> Compare {
    struct Of;
    impl EachTable for Of {
        type Output = Compare;
        fn with<K: redb::Key + 'static, V: redb::Value + 'static>(
            &mut self,
            _: redb::TableDefinition<'static, K, V>,
        ) -> Compare {
            K::compare
        }
    }
    table.visit(&mut Of)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn be(n: u64) -> [u8; 8] {
        n.to_le_bytes()
    }

    #[test]
    fn a_reader_sees_the_batches_published_before_it_began_and_no_later() {
        let o = Overlay::default();
        o.publish([Op::Insert(Table::Webhooks, &1u128.to_le_bytes(), b"a")]);
        let ((), early) = o.begin(|| Ok::<_, ()>(())).unwrap();
        o.publish([Op::Insert(Table::Webhooks, &1u128.to_le_bytes(), b"b")]);
        o.publish([Op::Remove(Table::Webhooks, &2u128.to_le_bytes())]);
        let ((), late) = o.begin(|| Ok::<_, ()>(())).unwrap();
        let one = 1u128.to_le_bytes();
        assert_eq!(
            early.get(Table::Webhooks, &one),
            Found::Here(Some(b"a".as_slice().into()))
        );
        assert_eq!(
            late.get(Table::Webhooks, &one),
            Found::Here(Some(b"b".as_slice().into()))
        );
        assert_eq!(
            early.get(Table::Webhooks, &2u128.to_le_bytes()),
            Found::Stored
        );
        assert_eq!(
            late.get(Table::Webhooks, &2u128.to_le_bytes()),
            Found::Here(None)
        );
        assert_eq!(late.get(Table::Builds, &one), Found::Stored);
        // A new generation after a checkpoint: the old reader keeps its.
        drop(o.restart());
        let ((), after) = o.begin(|| Ok::<_, ()>(())).unwrap();
        assert_eq!(after.get(Table::Webhooks, &one), Found::Stored);
        assert_eq!(
            late.get(Table::Webhooks, &one),
            Found::Here(Some(b"b".as_slice().into()))
        );
    }

    #[test]
    fn a_range_follows_the_tables_key_order_not_the_bytes() {
        let o = Overlay::default();
        // u64 keys stored little-endian: byte order is not number order.
        let keys = [256u64, 1, 2, 65536];
        let bytes: Vec<[u8; 8]> = keys.iter().map(|k| be(*k)).collect();
        o.publish(
            bytes
                .iter()
                .map(|k| Op::Insert(Table::AuditEvents, k.as_slice(), b"x")),
        );
        let ((), seen) = o.begin(|| Ok::<_, ()>(())).unwrap();
        let all = seen.range(Table::AuditEvents, Bound::Unbounded, Bound::Unbounded);
        let got: Vec<u64> = all
            .iter()
            .map(|(k, _)| u64::from_le_bytes(k[..].try_into().unwrap()))
            .collect();
        assert_eq!(got, vec![1, 2, 256, 65536]);
        let (lo, hi) = (be(2), be(256));
        let some = seen.range(
            Table::AuditEvents,
            Bound::Included(&lo),
            Bound::Excluded(&hi),
        );
        assert_eq!(some.len(), 1);
        // A start past the end is empty, not a panic.
        assert!(seen
            .range(
                Table::AuditEvents,
                Bound::Included(&hi),
                Bound::Excluded(&lo)
            )
            .is_empty());
        assert!(seen
            .range(
                Table::AuditEvents,
                Bound::Excluded(&lo),
                Bound::Excluded(&lo)
            )
            .is_empty());
    }

    #[test]
    fn a_cleared_table_hides_the_stored_rows_and_the_earlier_versions() {
        let o = Overlay::default();
        let k = 7u128.to_le_bytes();
        o.publish([Op::Insert(Table::Builds, &k, b"old")]);
        o.publish([Op::Clear(Table::Builds)]);
        let ((), seen) = o.begin(|| Ok::<_, ()>(())).unwrap();
        assert!(seen.hides_stored(Table::Builds));
        assert_eq!(seen.get(Table::Builds, &k), Found::Here(None));
        assert!(seen
            .range(Table::Builds, Bound::Unbounded, Bound::Unbounded)
            .is_empty());
        o.publish([Op::Insert(Table::Builds, &k, b"new")]);
        let ((), later) = o.begin(|| Ok::<_, ()>(())).unwrap();
        assert_eq!(
            later.get(Table::Builds, &k),
            Found::Here(Some(b"new".as_slice().into()))
        );
        // A second clear in the same generation: the reader before it
        // still sees the row written between the two.
        o.publish([Op::Clear(Table::Builds)]);
        let ((), last) = o.begin(|| Ok::<_, ()>(())).unwrap();
        assert_eq!(last.get(Table::Builds, &k), Found::Here(None));
        assert_eq!(
            later.get(Table::Builds, &k),
            Found::Here(Some(b"new".as_slice().into()))
        );
        let latest = o.latest();
        assert_eq!(latest.len(), 1);
        assert!(latest[0].1, "the clear is given again");
        assert!(latest[0].2.is_empty(), "and no row from before it");
    }
}
