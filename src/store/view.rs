//! A table as a reader sees it: redb's, read through one small type.
//!
//! Why it exists: every read (a reader's and a write job's) goes through
//! `Rows`, so the read path names one type, whose rows decode with
//! `record` (`get`, `range`, `iter`, `last`, `len`, as redb's own table).

use std::borrow::Borrow;
use std::marker::PhantomData;
use std::ops::RangeBounds;

use redb::{AccessGuard, Key, ReadableTable, StorageError, Value};

use super::tables::Table;

/// A table's entry in `enum Table`, which the redo log names it by.
pub(super) fn table_named(name: &str) -> super::StoreResult<Table> {
    Table::named(name).ok_or_else(|| super::StoreError::other("a table missing from `enum Table`"))
}

/// One table for reading.
pub struct Rows<'r, K: Key + 'static, V: Value + 'static, T: ReadableTable<K, V>> {
    pub(super) stored: T,
    types: PhantomData<(&'r (), K, V)>,
}

/// A key or a value read.
pub type Row<'a, T> = AccessGuard<'a, T>;
/// A row read: its key and value.
pub type RowPair<'a, K, V> = (Row<'a, K>, Row<'a, V>);

impl<K: Key + 'static, V: Value + 'static, T: ReadableTable<K, V>> Rows<'_, K, V, T> {
    pub(super) fn stored(stored: T) -> Self {
        Rows {
            stored,
            types: PhantomData,
        }
    }

    pub fn get<'k>(
        &self,
        key: impl Borrow<K::SelfType<'k>>,
    ) -> Result<Option<Row<'_, V>>, StorageError> {
        self.stored.get(key)
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
    ) -> Result<redb::Range<'_, K, V>, StorageError>
    where
        KR: Borrow<K::SelfType<'k>> + 'k,
    {
        self.stored.range(range)
    }

    pub fn iter(&self) -> Result<redb::Range<'_, K, V>, StorageError> {
        self.stored.iter()
    }

    pub fn last(&self) -> Result<Option<RowPair<'_, K, V>>, StorageError> {
        self.stored.last()
    }

    pub fn len(&self) -> Result<u64, StorageError> {
        self.stored.len()
    }
}
