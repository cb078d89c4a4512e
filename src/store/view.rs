//! A table as a reader sees it: redb's rows with the overlay's merged
//! over them (`overlay.rs`).
//!
//! Why it exists: every read of berth's own process goes through here,
//! so no reader can forget the rows acknowledged since the last
//! checkpoint, which redb's read transactions do not hold yet. It reads
//! as redb's table does (`get`, `range`, `iter`, `last`, `len`,
//! rows whose `value()` decodes), so a reader's code is the same whether
//! a row comes from redb or from the overlay; a write job's reads use the
//! same type with no overlay (its write transaction holds every row).

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};

use bytes::Bytes;
use redb::{AccessGuard, Key, ReadableTable, StorageError, Value};

use super::overlay::{Found, OverlayRow, Seen};
use super::tables::Table;

/// A table's entry in `enum Table`, which the overlay and the redo log
/// name it by.
pub(super) fn table_named(name: &str) -> super::StoreResult<Table> {
    Table::named(name).ok_or_else(|| super::StoreError::other("a table missing from `enum Table`"))
}

/// One table for reading: redb's (`stored`) and, for a reader, the
/// overlay's rows of it.
pub struct Rows<'r, K: Key + 'static, V: Value + 'static, T: ReadableTable<K, V>> {
    pub(super) stored: T,
    pub(super) overlay: Option<(&'r Seen, Table)>,
    pub(super) types: PhantomData<(K, V)>,
}

/// A key or a value read: redb's guard, or the overlay's bytes.
pub enum Row<'a, T: Value + 'static> {
    Stored(AccessGuard<'a, T>),
    Overlay(Bytes, PhantomData<T>),
}

impl<T: Value + 'static> Row<'_, T> {
    pub fn value(&self) -> T::SelfType<'_> {
        match self {
            Row::Stored(guard) => guard.value(),
            Row::Overlay(bytes, _) => T::from_bytes(bytes),
        }
    }

    fn overlay(bytes: Bytes) -> Self {
        Row::Overlay(bytes, PhantomData)
    }
}

/// A stored row: its key and value guards.
type StoredRow<'a, K, V> = (AccessGuard<'a, K>, AccessGuard<'a, V>);
/// A row read: its key and value.
pub type RowPair<'a, K, V> = (Row<'a, K>, Row<'a, V>);

impl<'r, K: Key + 'static, V: Value + 'static, T: ReadableTable<K, V>> Rows<'r, K, V, T> {
    /// A table with no overlay (a write job's, or a reader of a file no
    /// berth writes).
    pub(super) fn stored(stored: T) -> Self {
        Rows {
            stored,
            overlay: None,
            types: PhantomData,
        }
    }

    fn hidden(&self) -> bool {
        self.overlay
            .is_some_and(|(seen, table)| seen.hides_stored(table))
    }

    pub fn get<'k>(
        &self,
        key: impl Borrow<K::SelfType<'k>>,
    ) -> Result<Option<Row<'_, V>>, StorageError> {
        if let Some((seen, table)) = self.overlay {
            match seen.get(table, K::as_bytes(key.borrow()).as_ref()) {
                Found::Here(Some(v)) => return Ok(Some(Row::overlay(v))),
                Found::Here(None) => return Ok(None),
                Found::Stored => {}
            }
        }
        Ok(self.stored.get(key)?.map(Row::Stored))
    }

    /// The record stored under `key`, decoded.
    pub fn record<'k, R: serde::de::DeserializeOwned>(
        &self,
        key: impl Borrow<K::SelfType<'k>>,
    ) -> super::StoreResult<Option<R>>
    where
        V: for<'a> Value<SelfType<'a> = &'a [u8]>,
    {
        self.get(key)?.map(|v| super::decode(v.value())).transpose()
    }

    pub fn range<'k, KR>(
        &self,
        range: impl RangeBounds<KR> + 'k,
    ) -> Result<Merged<'_, K, V>, StorageError>
    where
        KR: Borrow<K::SelfType<'k>> + 'k,
    {
        let over = match self.overlay {
            Some((seen, table)) => {
                let bytes = |b: Bound<&KR>| b.map(|k| K::as_bytes(k.borrow()).as_ref().to_vec());
                let (start, end) = (bytes(range.start_bound()), bytes(range.end_bound()));
                seen.range(
                    table,
                    start.as_ref().map(Vec::as_slice),
                    end.as_ref().map(Vec::as_slice),
                )
            }
            None => Vec::new(),
        };
        let stored = match self.hidden() {
            true => None,
            false => Some(self.stored.range(range)?),
        };
        Ok(Merged::new(stored, over))
    }

    pub fn iter(&self) -> Result<Merged<'_, K, V>, StorageError> {
        let over = match self.overlay {
            Some((seen, table)) => seen.range(table, Bound::Unbounded, Bound::Unbounded),
            None => Vec::new(),
        };
        let stored = match self.hidden() {
            true => None,
            false => Some(self.stored.iter()?),
        };
        Ok(Merged::new(stored, over))
    }

    pub fn last(&self) -> Result<Option<RowPair<'_, K, V>>, StorageError> {
        self.iter()?.next_back().transpose()
    }

    /// The number of rows: redb's, less those the overlay removed, plus
    /// those it added (a walk of the overlay's rows of the table, which a
    /// checkpoint bounds).
    pub fn len(&self) -> Result<u64, StorageError> {
        let Some((seen, table)) = self.overlay else {
            return self.stored.len();
        };
        let hidden = self.hidden();
        let mut n = match hidden {
            true => 0,
            false => self.stored.len()?,
        };
        for (key, version) in seen.range(table, Bound::Unbounded, Bound::Unbounded) {
            let stored = !hidden && self.stored.get(K::from_bytes(&key))?.is_some();
            match (version.is_some(), stored) {
                (true, false) => n += 1,
                (false, true) => n = n.saturating_sub(1),
                (true, true) | (false, false) => {}
            }
        }
        Ok(n)
    }
}

/// A range of a table as a reader sees it: redb's rows and the overlay's
/// merged in key order, an overlay row in place of redb's of the same
/// key, a removal hiding it; both ends, as redb's own range.
pub struct Merged<'a, K: Key + 'static, V: Value + 'static> {
    /// `None` when the overlay emptied the table.
    stored: Option<redb::Range<'a, K, V>>,
    /// The next stored row from each end, taken out to compare: at most
    /// one each, and once the stored range is spent from one end, the
    /// other's is the last.
    front: Option<StoredRow<'a, K, V>>,
    back: Option<StoredRow<'a, K, V>>,
    over: VecDeque<OverlayRow>,
}

impl<'a, K: Key + 'static, V: Value + 'static> Merged<'a, K, V> {
    fn new(stored: Option<redb::Range<'a, K, V>>, over: Vec<OverlayRow>) -> Self {
        Merged {
            stored,
            front: None,
            back: None,
            over: over.into(),
        }
    }

    /// The overlay's row taken from the front or back, if not a removal.
    fn overlay_row(row: Option<OverlayRow>) -> Option<RowPair<'a, K, V>> {
        let (key, value) = row?;
        Some((Row::overlay(key), Row::overlay(value?)))
    }
}

/// Which row comes next from one end of a merged range.
#[derive(PartialEq)]
enum Next {
    Stored,
    Overlay,
    /// Both have the key: the overlay's version is the newer one.
    Both,
}

/// The next row from the front (`forward`) or the back, given the next
/// stored row and the overlay's next from that end; `None` when both are
/// spent.
fn next_of<K: Key + 'static, V: Value + 'static>(
    stored: Option<&StoredRow<'_, K, V>>,
    over: Option<&OverlayRow>,
    forward: bool,
) -> Option<Next> {
    Some(match (stored, over) {
        (None, None) => return None,
        (Some(_), None) => Next::Stored,
        (None, Some(_)) => Next::Overlay,
        (Some((k, _)), Some((o, _))) => {
            match (K::compare(K::as_bytes(&k.value()).as_ref(), o), forward) {
                (Ordering::Equal, _) => Next::Both,
                (Ordering::Less, true) | (Ordering::Greater, false) => Next::Stored,
                (Ordering::Greater, true) | (Ordering::Less, false) => Next::Overlay,
            }
        }
    })
}

impl<'a, K: Key + 'static, V: Value + 'static> Merged<'a, K, V> {
    /// The next row from the front (`forward`) or the back.
    fn step(&mut self, forward: bool) -> Option<Result<RowPair<'a, K, V>, StorageError>> {
        let Merged {
            stored,
            front,
            back,
            over,
        } = self;
        let (mine, other) = match forward {
            true => (front, back),
            false => (back, front),
        };
        loop {
            if mine.is_none() {
                let next = stored.as_mut().and_then(|s| match forward {
                    true => s.next(),
                    false => s.next_back(),
                });
                match next {
                    Some(Ok(row)) => *mine = Some(row),
                    Some(Err(e)) => return Some(Err(e)),
                    // Spent from this end: the other end's row is the last.
                    None => *mine = other.take(),
                }
            }
            let over_next = match forward {
                true => over.front(),
                false => over.back(),
            };
            let next = next_of(mine.as_ref(), over_next, forward)?;
            if next == Next::Stored {
                let (k, v) = mine.take()?;
                return Some(Ok((Row::Stored(k), Row::Stored(v))));
            }
            if next == Next::Both {
                *mine = None;
            }
            let taken = match forward {
                true => over.pop_front(),
                false => over.pop_back(),
            };
            if let Some(row) = Self::overlay_row(taken) {
                return Some(Ok(row));
            }
        }
    }
}

impl<'a, K: Key + 'static, V: Value + 'static> Iterator for Merged<'a, K, V> {
    type Item = Result<RowPair<'a, K, V>, StorageError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.step(true)
    }
}

impl<K: Key + 'static, V: Value + 'static> DoubleEndedIterator for Merged<'_, K, V> {
    fn next_back(&mut self) -> Option<Self::Item> {
        self.step(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::overlay::{Op, Overlay};
    use crate::store::tables::AUDIT_EVENTS;
    use proptest::prelude::*;
    use redb::{ReadableDatabase, ReadableTableMetadata};

    #[derive(Clone, Debug)]
    enum Change {
        Insert(u64, u8),
        Remove(u64),
        Clear,
    }

    fn change() -> impl Strategy<Value = Change> {
        // Keys around 256 so that little-endian byte order and number
        // order disagree.
        let key = prop_oneof![0u64..8, 250u64..262, Just(65_536u64)];
        prop_oneof![
            8 => (key.clone(), any::<u8>()).prop_map(|(k, v)| Change::Insert(k, v)),
            4 => key.prop_map(Change::Remove),
            1 => Just(Change::Clear),
        ]
    }

    fn memory_db() -> redb::Database {
        redb::Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .unwrap()
    }

    fn apply(db: &redb::Database, changes: &[Change]) {
        let txn = db.begin_write().unwrap();
        {
            let mut t = txn.open_table(AUDIT_EVENTS).unwrap();
            for c in changes {
                match c {
                    Change::Insert(k, v) => {
                        t.insert(*k, [*v].as_slice()).unwrap();
                    }
                    Change::Remove(k) => {
                        t.remove(*k).unwrap();
                    }
                    Change::Clear => {
                        t.retain(|_, _| false).unwrap();
                    }
                }
            }
        }
        txn.commit().unwrap();
    }

    fn publish(overlay: &Overlay, changes: &[Change]) {
        let keys: Vec<[u8; 8]> = changes
            .iter()
            .map(|c| match c {
                Change::Insert(k, _) | Change::Remove(k) => k.to_le_bytes(),
                Change::Clear => [0; 8],
            })
            .collect();
        let values: Vec<[u8; 1]> = changes
            .iter()
            .map(|c| match c {
                Change::Insert(_, v) => [*v],
                Change::Remove(_) | Change::Clear => [0],
            })
            .collect();
        overlay.publish(changes.iter().enumerate().map(|(i, c)| match c {
            Change::Insert(..) => Op::Insert(Table::AuditEvents, &keys[i], &values[i]),
            Change::Remove(_) => Op::Remove(Table::AuditEvents, &keys[i]),
            Change::Clear => Op::Clear(Table::AuditEvents),
        }));
    }

    type Plain = Vec<(u64, Vec<u8>)>;

    fn rows_of<'a>(
        it: impl Iterator<Item = Result<RowPair<'a, u64, &'static [u8]>, StorageError>>,
    ) -> Plain {
        it.map(|r| {
            let (k, v) = r.unwrap();
            (k.value(), v.value().to_vec())
        })
        .collect()
    }

    fn expected<'a>(
        it: impl Iterator<Item = Result<StoredRow<'a, u64, &'static [u8]>, StorageError>>,
    ) -> Plain {
        it.map(|r| {
            let (k, v) = r.unwrap();
            (k.value(), v.value().to_vec())
        })
        .collect()
    }

    /// Takes from the front and the back in turn, as a reader may.
    fn zigzag<I: DoubleEndedIterator<Item = (u64, Vec<u8>)>>(mut it: I) -> Plain {
        let mut out = Vec::new();
        let mut front = true;
        loop {
            let next = if front { it.next() } else { it.next_back() };
            match next {
                Some(row) => out.push(row),
                None => return out,
            }
            front = !front;
        }
    }

    /// The merged view of (`merged`, `seen`) reads as `plain` does.
    fn same(merged: &redb::ReadTransaction, seen: &Seen, plain: &redb::ReadTransaction) {
        let view = Rows {
            stored: merged.open_table(AUDIT_EVENTS).unwrap(),
            overlay: Some((seen, Table::AuditEvents)),
            types: PhantomData,
        };
        let truth = plain.open_table(AUDIT_EVENTS).unwrap();
        let all = expected(truth.iter().unwrap());
        assert_eq!(rows_of(view.iter().unwrap()), all);
        assert_eq!(
            rows_of(view.iter().unwrap().rev()),
            all.iter().rev().cloned().collect::<Plain>()
        );
        let zig = zigzag(view.iter().unwrap().map(|r| {
            let (k, v) = r.unwrap();
            (k.value(), v.value().to_vec())
        }));
        assert_eq!(zig, zigzag(all.clone().into_iter()));
        assert_eq!(view.len().unwrap(), truth.len().unwrap());
        for k in (0u64..10).chain(248..264).chain([65_536]) {
            assert_eq!(
                view.get(k).unwrap().map(|v| v.value().to_vec()),
                truth.get(k).unwrap().map(|v| v.value().to_vec()),
                "get {k}"
            );
        }
        for (lo, hi) in [(0u64, 5u64), (3, 256), (255, 65_536), (260, 2), (7, 7)] {
            assert_eq!(
                rows_of(view.range(lo..hi).unwrap()),
                expected(truth.range(lo..hi).unwrap()),
                "{lo}..{hi}"
            );
            assert_eq!(
                rows_of(view.range(lo..=hi).unwrap().rev()),
                expected(truth.range(lo..=hi).unwrap().rev()),
                "{lo}..={hi} backwards"
            );
        }
        assert_eq!(
            view.last().unwrap().map(|(k, _)| k.value()),
            all.last().map(|(k, _)| *k)
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Rows read through redb and the overlay equal the same batches
        /// committed to redb, at the end and for a reader that began
        /// part-way (it sees nothing published after it).
        #[test]
        fn the_overlay_over_redb_reads_as_the_batches_applied_to_redb(
            base in prop::collection::vec(change(), 0..20),
            batches in prop::collection::vec(prop::collection::vec(change(), 1..6), 1..8),
            mid in 0usize..8,
        ) {
            let (merged, plain) = (memory_db(), memory_db());
            apply(&merged, &base);
            apply(&plain, &base);
            let overlay = Overlay::default();
            let mut early = None;
            for (i, batch) in batches.iter().enumerate() {
                apply(&plain, batch);
                publish(&overlay, batch);
                if i == mid {
                    let (txn, seen) = overlay.begin(|| merged.begin_read()).unwrap();
                    early = Some((txn, seen, plain.begin_read().unwrap()));
                }
            }
            let (txn, seen) = overlay.begin(|| merged.begin_read()).unwrap();
            same(&txn, &seen, &plain.begin_read().unwrap());
            if let Some((txn, seen, plain_then)) = early {
                same(&txn, &seen, &plain_then);
            }
        }
    }
}
