//! A table opened inside a write job, and the tables a batch keeps open.
//!
//! A `Logged` table reads as redb's own table; every insert and every
//! remove that removed a row (and `retain_in`'s removals) also lands in the
//! batch's redo ops when the store keeps a redo log (`redo.rs`). Write jobs
//! reach tables only through `Tx::table`, so no write can miss the log.
//!
//! Dropping a `Logged` table hands it back to the `OpenTables` it came
//! from instead of closing it, so a batch opens each table once (see
//! `Pending`); a `Tx` of its own (an import, a test's) closes them when it
//! is dropped, before its commit.

use std::borrow::Borrow;
use std::cell::RefCell;
use std::ops::RangeBounds;

use redb::{AccessGuard, Key, StorageError, Value};

use super::tables::Table;

/// One table a batch keeps open, by its key and value types (one variant
/// per pair of types some table has).
pub(super) enum Open<'txn> {
    Str(redb::Table<'txn, &'static str, &'static [u8]>),
    Id(redb::Table<'txn, u128, &'static [u8]>),
    Seq(redb::Table<'txn, u64, &'static [u8]>),
    IdToStr(redb::Table<'txn, u128, &'static str>),
    StrPartNumber(redb::Table<'txn, (&'static str, u8, u128), &'static [u8]>),
    StrSeq(redb::Table<'txn, (&'static str, u64), &'static [u8]>),
    IdSeq(redb::Table<'txn, (u128, u64), &'static [u8]>),
    IdChunk(redb::Table<'txn, (u128, u32), &'static [u8]>),
    StrStr(redb::Table<'txn, (&'static str, &'static str), &'static [u8]>),
    Bytes(redb::Table<'txn, &'static [u8], &'static [u8]>),
    AtStr(redb::Table<'txn, (i64, &'static str), ()>),
    Node(redb::Table<'txn, (u8, u64), &'static [u8]>),
    IdId(redb::Table<'txn, (u128, u128), &'static [u8]>),
    IdAtId(redb::Table<'txn, (u128, i64, u128), ()>),
}

/// A table of key type `K` and value type `V` can be kept open in an
/// `Open` and taken out again with its types.
pub(super) trait Keep<'txn, K: Key + 'static, V: Value + 'static>: Sized {
    fn keep(table: redb::Table<'txn, K, V>) -> Self;
    /// The table, when this holds one of those types; else itself back.
    fn take(self) -> Result<redb::Table<'txn, K, V>, Self>;
}

macro_rules! keep {
    ($($variant:ident: $k:ty, $v:ty;)*) => {$(
        impl<'txn> Keep<'txn, $k, $v> for Open<'txn> {
            fn keep(table: redb::Table<'txn, $k, $v>) -> Self {
                Open::$variant(table)
            }
            fn take(self) -> Result<redb::Table<'txn, $k, $v>, Self> {
                match self {
                    Open::$variant(table) => Ok(table),
                    other => Err(other),
                }
            }
        }
    )*};
}

keep! {
    Str: &'static str, &'static [u8];
    Id: u128, &'static [u8];
    Seq: u64, &'static [u8];
    IdToStr: u128, &'static str;
    StrPartNumber: (&'static str, u8, u128), &'static [u8];
    StrSeq: (&'static str, u64), &'static [u8];
    IdSeq: (u128, u64), &'static [u8];
    IdChunk: (u128, u32), &'static [u8];
    StrStr: (&'static str, &'static str), &'static [u8];
    Bytes: &'static [u8], &'static [u8];
    AtStr: (i64, &'static str), ();
    Node: (u8, u64), &'static [u8];
    IdId: (u128, u128), &'static [u8];
    IdAtId: (u128, i64, u128), ();
}

/// Where a `Logged` table records the rows it writes: the batch's redo
/// ops (`redo::Ops`). A trait, so this module need not import the log's
/// (which keeps `Pending`).
pub(super) trait RowLog {
    fn insert(&mut self, table: Table, key: &[u8], value: &[u8]);
    fn remove(&mut self, table: Table, key: &[u8]);
}

self_cell::self_cell!(
    /// A batch's write transaction and the tables its jobs opened, kept
    /// open with it until the batch ends: redb's `open_table` looks the
    /// table up in its table tree and a close stages the new root, so a
    /// batch opens each table once, not once per job. `into_txn` closes
    /// them, as redb requires before a commit or an abort.
    pub(super) struct Pending {
        owner: redb::WriteTransaction,
        #[not_covariant]
        dependent: OpenTables,
    }
);

impl Pending {
    /// A transaction with no table open yet.
    pub(super) fn of(txn: redb::WriteTransaction) -> Pending {
        Pending::new(txn, |_| OpenTables::new())
    }

    /// The transaction, with every table it kept open closed.
    pub(super) fn into_txn(self) -> redb::WriteTransaction {
        self.into_owner()
    }
}

/// The tables a batch has opened and not in use right now, by table.
pub(super) struct OpenTables<'txn> {
    idle: RefCell<Vec<Option<Open<'txn>>>>,
}

impl<'txn> OpenTables<'txn> {
    pub(super) fn new() -> Self {
        OpenTables {
            idle: RefCell::new((0..Table::ALL.len()).map(|_| None).collect()),
        }
    }

    /// The table kept open for `table`, if any (it is then in use).
    pub(super) fn take(&self, table: Table) -> Option<Open<'txn>> {
        self.idle.borrow_mut()[table as usize].take()
    }

    /// Closes `table` if it is kept open (before redb opens or deletes it
    /// another way, which it refuses while it is open).
    pub(super) fn close(&self, table: Table) {
        drop(self.take(table));
    }

    fn put(&self, table: Table, open: Open<'txn>) {
        self.idle.borrow_mut()[table as usize] = Some(open);
    }
}

pub struct Logged<'t, 'txn, K: Key + 'static, V: Value + 'static>
where
    Open<'txn>: Keep<'txn, K, V>,
{
    /// `Some` until dropped, when it goes back to `kept`.
    pub(super) table: Option<redb::Table<'txn, K, V>>,
    pub(super) name: Table,
    pub(super) kept: &'t OpenTables<'txn>,
    /// The batch's redo ops (`redo::Ops`); `None` without a redo log.
    pub(super) log: Option<&'t RefCell<dyn RowLog>>,
}

impl<'txn, K: Key + 'static, V: Value + 'static> Drop for Logged<'_, 'txn, K, V>
where
    Open<'txn>: Keep<'txn, K, V>,
{
    fn drop(&mut self) {
        if let Some(table) = self.table.take() {
            self.kept.put(self.name, Open::keep(table));
        }
    }
}

impl<'txn, K: Key + 'static, V: Value + 'static> Logged<'_, 'txn, K, V>
where
    Open<'txn>: Keep<'txn, K, V>,
{
    fn open(&self) -> &redb::Table<'txn, K, V> {
        self.table
            .as_ref()
            .expect("a Logged table holds its table until it is dropped")
    }

    fn open_mut(&mut self) -> &mut redb::Table<'txn, K, V> {
        self.table
            .as_mut()
            .expect("a Logged table holds its table until it is dropped")
    }

    pub fn insert<'k, 'v>(
        &mut self,
        key: impl Borrow<K::SelfType<'k>>,
        value: impl Borrow<V::SelfType<'v>>,
    ) -> Result<Option<AccessGuard<'_, V>>, StorageError> {
        if let Some(ops) = self.log {
            ops.borrow_mut().insert(
                self.name,
                K::as_bytes(key.borrow()).as_ref(),
                V::as_bytes(value.borrow()).as_ref(),
            );
        }
        self.open_mut().insert(key, value)
    }

    /// A remove of a row that is not there changes nothing, so it is not
    /// logged (a replay reaches the same state without it).
    pub fn remove<'a>(
        &mut self,
        key: impl Borrow<K::SelfType<'a>>,
    ) -> Result<Option<AccessGuard<'_, V>>, StorageError> {
        let (log, name) = (self.log, self.name);
        let removed = self.open_mut().remove(key.borrow())?;
        if let (Some(ops), true) = (log, removed.is_some()) {
            ops.borrow_mut()
                .remove(name, K::as_bytes(key.borrow()).as_ref());
        }
        Ok(removed)
    }

    /// Removes the rows of `range` for which `keep` says false.
    pub fn retain_in<'a, KR>(
        &mut self,
        range: impl RangeBounds<KR> + 'a,
        mut keep: impl for<'f> FnMut(K::SelfType<'f>, V::SelfType<'f>) -> bool,
    ) -> Result<(), StorageError>
    where
        KR: Borrow<K::SelfType<'a>> + 'a,
    {
        let (log, name) = (self.log, self.name);
        self.open_mut().retain_in(range, |k, v| match log {
            Some(ops) => {
                let bytes = K::as_bytes(&k).as_ref().to_vec();
                let kept = keep(k, v);
                if !kept {
                    ops.borrow_mut().remove(name, &bytes);
                }
                kept
            }
            None => keep(k, v),
        })
    }
}

/// A write job's lookups read a table the batch keeps open as any reader
/// reads a table (`Lookup::open`, `view::Rows`).
impl<'txn, K: Key + 'static, V: Value + 'static> redb::ReadableTableMetadata
    for Logged<'_, 'txn, K, V>
where
    Open<'txn>: Keep<'txn, K, V>,
{
    fn stats(&self) -> Result<redb::TableStats, StorageError> {
        self.open().stats()
    }

    fn len(&self) -> Result<u64, StorageError> {
        self.open().len()
    }
}

impl<'txn, K: Key + 'static, V: Value + 'static> redb::ReadableTable<K, V>
    for Logged<'_, 'txn, K, V>
where
    Open<'txn>: Keep<'txn, K, V>,
{
    fn get<'a>(
        &self,
        key: impl Borrow<K::SelfType<'a>>,
    ) -> Result<Option<AccessGuard<'_, V>>, StorageError> {
        self.open().get(key)
    }

    fn range<'a, KR>(
        &self,
        range: impl RangeBounds<KR> + 'a,
    ) -> Result<redb::Range<'_, K, V>, StorageError>
    where
        KR: Borrow<K::SelfType<'a>> + 'a,
    {
        self.open().range(range)
    }

    fn first(&self) -> Result<Option<(AccessGuard<'_, K>, AccessGuard<'_, V>)>, StorageError> {
        self.open().first()
    }

    fn last(&self) -> Result<Option<(AccessGuard<'_, K>, AccessGuard<'_, V>)>, StorageError> {
        self.open().last()
    }
}
