//! What can go wrong in the store, sorted into the classes the rest of
//! berth acts on: a full disk (503 `disk_full`, the file is reopened), another
//! I/O error (reopened too), a reopen in progress (a read waits and retries),
//! corruption, a stopped writer. The class comes from redb's error variants
//! and `io::ErrorKind`, never from the text of a message.

/// The store's error classes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreErrorKind {
    DiskFull,
    /// Another I/O error; the store reopens its file after one.
    Io,
    /// The file is being reopened after an I/O error; try again shortly.
    Reopening,
    Corrupt,
    /// redb could not recover the file at open (a damaged store): berth
    /// refuses to start on it (README "Repairing a damaged store").
    Damaged,
    Closed,
    /// The database of a store in PostgreSQL did not answer, or answered
    /// that this replica no longer leads (`upstream.rs`): nothing was
    /// stored, and a retry may succeed.
    Unreachable,
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

pub type StoreResult<T> = Result<T, StoreError>;

impl StoreError {
    pub fn damaged_snapshot(e: crate::model::DamagedSnapshot) -> Self {
        Self::corrupt(e.to_string())
    }

    pub fn corrupt(detail: impl Into<String>) -> Self {
        Self {
            kind: StoreErrorKind::Corrupt,
            detail: detail.into(),
        }
    }
    /// The error a failpoint fails its place with (`crate::failpoints`):
    /// not transient, so the caller takes its for-good path at once.
    pub fn injected(name: &str) -> Self {
        Self::other(format!("failpoint {name}"))
    }
    /// A failpoint that fails as a full disk does: a failure that may
    /// pass, so the caller's retry is what the test sees.
    pub fn injected_disk_full(name: &str) -> Self {
        Self {
            kind: StoreErrorKind::DiskFull,
            detail: format!("failpoint {name} (as a full disk)"),
        }
    }
    pub fn other(detail: impl Into<String>) -> Self {
        Self {
            kind: StoreErrorKind::Other,
            detail: detail.into(),
        }
    }
    /// A failure a retry may get past: a transient one, or a store's
    /// database that cannot be reached now (cluster mode).
    pub fn may_pass(&self) -> bool {
        self.is_transient() || self.kind == StoreErrorKind::Unreachable
    }

    /// A failure that may pass by itself (a full disk, an I/O error, a reopen).
    pub fn is_transient(&self) -> bool {
        matches!(
            self.kind,
            StoreErrorKind::DiskFull | StoreErrorKind::Io | StoreErrorKind::Reopening
        )
    }
    pub(super) fn reopening() -> Self {
        Self {
            kind: StoreErrorKind::Reopening,
            detail: "the store is reopening its file after an I/O error".into(),
        }
    }
    /// A running `berth serve` holds the store at `path` (an import or an
    /// inspection must not touch it).
    pub(super) fn in_use(path: &std::path::Path) -> Self {
        StoreError::other(format!(
            "{} is in use: stop berth serve on this data dir first",
            path.display()
        ))
    }
    /// The redo log reached `limit` because checkpoints keep failing
    /// (`redo::MAX_LOG_BYTES`): most likely the disk is full.
    pub(super) fn log_full(limit: u64) -> Self {
        Self {
            kind: StoreErrorKind::DiskFull,
            detail: format!(
                "the redo log reached its limit of {} MiB because checkpoints keep failing \
                 (the server's log says why; most likely the disk is full)",
                limit >> 20
            ),
        }
    }
    pub(super) fn unreachable(detail: impl Into<String>) -> Self {
        Self {
            kind: StoreErrorKind::Unreachable,
            detail: detail.into(),
        }
    }
    pub(super) fn closed() -> Self {
        Self {
            kind: StoreErrorKind::Closed,
            detail: "the store writer has stopped".into(),
        }
    }
}

impl From<std::io::Error> for StoreError {
    fn from(e: std::io::Error) -> Self {
        StoreError {
            kind: io_kind(&e),
            detail: e.to_string(),
        }
    }
}

/// ENOSPC and EDQUOT: the disk (or the quota) is full.
fn io_kind(e: &std::io::Error) -> StoreErrorKind {
    const ENOSPC: i32 = 28;
    const EDQUOT: i32 = 122;
    if e.kind() == std::io::ErrorKind::StorageFull
        || e.kind() == std::io::ErrorKind::QuotaExceeded
        || matches!(e.raw_os_error(), Some(ENOSPC | EDQUOT))
    {
        StoreErrorKind::DiskFull
    } else {
        StoreErrorKind::Io
    }
}

fn storage_kind(e: &redb::StorageError) -> StoreErrorKind {
    use redb::StorageError as S;
    match e {
        S::Io(io) => io_kind(io),
        // redb refuses every call after an I/O error until the file is
        // reopened: a caller meeting this raced the reopen.
        S::PreviousIo | S::DatabaseClosed => StoreErrorKind::Reopening,
        S::Corrupted(_) => StoreErrorKind::Corrupt,
        _ => StoreErrorKind::Other,
    }
}

/// The class of any redb error: the storage error inside it decides.
trait Classify {
    fn kind(&self) -> StoreErrorKind;
}

impl Classify for redb::StorageError {
    fn kind(&self) -> StoreErrorKind {
        storage_kind(self)
    }
}

macro_rules! classify_by_storage {
    ($($t:ident),*) => {$(
        impl Classify for redb::$t {
            fn kind(&self) -> StoreErrorKind {
                match self {
                    redb::$t::Storage(s) => storage_kind(s),
                    _ => StoreErrorKind::Other,
                }
            }
        }
    )*};
}
classify_by_storage!(TableError, TransactionError, CommitError, DatabaseError);

impl Classify for redb::Error {
    fn kind(&self) -> StoreErrorKind {
        use redb::Error as E;
        match self {
            E::Io(io) => io_kind(io),
            E::PreviousIo | E::DatabaseClosed => StoreErrorKind::Reopening,
            E::Corrupted(_) => StoreErrorKind::Corrupt,
            _ => StoreErrorKind::Other,
        }
    }
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> Self {
                Self { kind: e.kind(), detail: e.to_string() }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_come_from_variants_and_io_kinds() {
        let full = std::io::Error::from_raw_os_error(28);
        let e = StoreError::from(redb::StorageError::Io(full));
        assert_eq!(e.kind, StoreErrorKind::DiskFull);
        let full = std::io::Error::new(std::io::ErrorKind::StorageFull, "x");
        let e = StoreError::from(redb::CommitError::Storage(redb::StorageError::Io(full)));
        assert_eq!(e.kind, StoreErrorKind::DiskFull);
        let eio = std::io::Error::from_raw_os_error(5);
        let e = StoreError::from(redb::TransactionError::Storage(redb::StorageError::Io(eio)));
        assert_eq!(e.kind, StoreErrorKind::Io);
        assert!(e.is_transient());
        let e = StoreError::from(redb::StorageError::PreviousIo);
        assert_eq!(e.kind, StoreErrorKind::Reopening);
        let e = StoreError::from(redb::Error::DatabaseClosed);
        assert_eq!(e.kind, StoreErrorKind::Reopening);
        let e = StoreError::from(redb::StorageError::Corrupted("x".into()));
        assert_eq!(e.kind, StoreErrorKind::Corrupt);
        assert!(!e.is_transient());
        let e = StoreError::from(redb::Error::TableDoesNotExist("t".into()));
        assert_eq!(e.kind, StoreErrorKind::Other);
    }
}
