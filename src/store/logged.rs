//! A table opened inside a write job. It reads as redb's own table; every
//! insert and every remove that removed a row (and `retain_in`'s removals)
//! also lands in the job's redo ops when the store keeps a redo log
//! (`redo.rs`). Write jobs reach tables only through `Tx::table`, so no
//! write can miss the log.

use std::borrow::Borrow;
use std::cell::RefCell;
use std::ops::RangeBounds;

use redb::{AccessGuard, Key, StorageError, Value};

use super::redo::Ops;
use super::tables::Table;

pub struct Logged<'t, K: Key + 'static, V: Value + 'static> {
    pub(super) table: redb::Table<'t, K, V>,
    /// The job's redo ops and this table's name in them; `None` without a
    /// redo log.
    pub(super) log: Option<(&'t RefCell<Ops>, Table)>,
}

impl<'t, K: Key + 'static, V: Value + 'static> std::ops::Deref for Logged<'t, K, V> {
    type Target = redb::Table<'t, K, V>;
    /// Reads only: redb's writes take `&mut self`, which this never hands out.
    fn deref(&self) -> &Self::Target {
        &self.table
    }
}

impl<K: Key + 'static, V: Value + 'static> Logged<'_, K, V> {
    pub fn insert<'k, 'v>(
        &mut self,
        key: impl Borrow<K::SelfType<'k>>,
        value: impl Borrow<V::SelfType<'v>>,
    ) -> Result<Option<AccessGuard<'_, V>>, StorageError> {
        if let Some((ops, id)) = self.log {
            ops.borrow_mut().insert(
                id,
                K::as_bytes(key.borrow()).as_ref(),
                V::as_bytes(value.borrow()).as_ref(),
            );
        }
        self.table.insert(key, value)
    }

    /// A remove of a row that is not there changes nothing, so it is not
    /// logged (a replay reaches the same state without it).
    pub fn remove<'a>(
        &mut self,
        key: impl Borrow<K::SelfType<'a>>,
    ) -> Result<Option<AccessGuard<'_, V>>, StorageError> {
        let removed = self.table.remove(key.borrow())?;
        if let (Some((ops, id)), true) = (self.log, removed.is_some()) {
            ops.borrow_mut()
                .remove(id, K::as_bytes(key.borrow()).as_ref());
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
        let log = self.log;
        self.table.retain_in(range, |k, v| {
            let kept = match log {
                Some((ops, id)) => {
                    let bytes = K::as_bytes(&k).as_ref().to_vec();
                    let kept = keep(k, v);
                    if !kept {
                        ops.borrow_mut().remove(id, &bytes);
                    }
                    kept
                }
                None => keep(k, v),
            };
            kept
        })
    }
}
