//! Per-key async locks that leave memory with their last holder: one
//! request at a time per idempotency identity (api), one `describe` at a
//! time per source digest (engine). The entry of a key goes when its last
//! holder's guard is dropped, also when the request holding it is dropped
//! mid-way (a client that left), so the map never grows with abandoned work.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Taking a lock that a thread panicked while holding.
///
/// Why a poisoned lock is used as it is, once for every lock in berth:
/// each one guards state that is whole between statements (its fields
/// are replaced, never left half-set, and a write job that panics is
/// caught before its batch's state is touched), so what a panicking
/// holder left is as good as any. Refusing it would turn one panic into
/// every later request failing.
pub trait Held<T: ?Sized> {
    type Guard<'a>
    where
        Self: 'a;
    fn held(&self) -> Self::Guard<'_>;
}

impl<T: ?Sized> Held<T> for Mutex<T> {
    type Guard<'a>
        = MutexGuard<'a, T>
    where
        Self: 'a;
    fn held(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// `Held` for the two sides of a `RwLock`.
pub trait HeldRw<T: ?Sized> {
    fn read_held(&self) -> RwLockReadGuard<'_, T>;
    fn write_held(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> HeldRw<T> for RwLock<T> {
    fn read_held(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(|p| p.into_inner())
    }
    fn write_held(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// In-process locks, one per key in flight.
#[derive(Default)]
pub struct KeyLocks(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl KeyLocks {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<tokio::sync::Mutex<()>>>> {
        self.0.held()
    }

    /// Waits for, then holds, the lock of one key. The entry leaves the
    /// map when its last holder's guard is dropped, also when the request
    /// that held it is dropped mid-way (a client that left).
    pub async fn lock(&self, key: String) -> KeyGuard<'_> {
        let entry = self.map().entry(key.clone()).or_default().clone();
        let mut guard = KeyGuard {
            locks: self,
            key,
            entry,
            held: None,
        };
        guard.held = Some(guard.entry.clone().lock_owned().await);
        guard
    }

    /// Keys with a lock in memory.
    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One key's lock, held; see `KeyLocks::lock`.
pub struct KeyGuard<'a> {
    locks: &'a KeyLocks,
    key: String,
    entry: Arc<tokio::sync::Mutex<()>>,
    held: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for KeyGuard<'_> {
    fn drop(&mut self) {
        self.held = None;
        let mut map = self.locks.map();
        // The map's reference and ours: nobody else holds or waits.
        if map
            .get(&self.key)
            .is_some_and(|l| Arc::ptr_eq(l, &self.entry) && Arc::strong_count(l) == 2)
        {
            map.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_dropped_request_leaves_no_lock_behind() {
        let locks = KeyLocks::default();
        // Held, then the request is dropped mid-way.
        let held = async {
            let _g = locks.lock("a".into()).await;
            std::future::pending::<()>().await;
        };
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(20), held)
                .await
                .is_err()
        );
        assert_eq!(locks.len(), 0, "the holder's entry leaked");
        // A holder and a waiter; the waiter is dropped while it waits, then
        // the holder finishes.
        let first = locks.lock("b".into()).await;
        let waiter = async {
            let _g = locks.lock("b".into()).await;
        };
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(20), waiter)
                .await
                .is_err()
        );
        drop(first);
        assert!(locks.is_empty(), "an entry leaked after its waiter left");
    }
}

/// Counted shares per key (api.md "Fair shares": each principal's open
/// streams): `take` gives a guard while the key holds fewer than `max`;
/// the count goes down when the guard is dropped, and the key's entry goes
/// with its last guard, so the map holds only principals with something
/// open.
#[derive(Default, Clone)]
pub struct Quotas(Arc<Mutex<HashMap<String, usize>>>);

impl Quotas {
    /// The shares of `key` held now.
    pub fn held(&self, key: &str) -> usize {
        self.0.held().get(key).copied().unwrap_or(0)
    }

    pub fn take(&self, key: &str, max: usize) -> Option<QuotaGuard> {
        let mut held = self.0.held();
        let count = held.entry(key.to_string()).or_default();
        if *count >= max {
            if *count == 0 {
                held.remove(key);
            }
            return None;
        }
        *count += 1;
        Some(QuotaGuard {
            quotas: self.clone(),
            key: key.to_string(),
        })
    }
}

/// One share of a key in `Quotas`, given back on drop.
pub struct QuotaGuard {
    quotas: Quotas,
    key: String,
}

impl Drop for QuotaGuard {
    fn drop(&mut self) {
        let mut held = self.quotas.0.held();
        if let Some(count) = held.get_mut(&self.key) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                held.remove(&self.key);
            }
        }
    }
}
