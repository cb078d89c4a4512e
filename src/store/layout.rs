//! Layout versions: what each version of the store file holds, and the
//! migrations from one to the next (storage.md "Layout versions").
//!
//! Why it exists: indexes and counters used to be added by a presence check
//! and a backfill at open, with the version left at 1. An older binary then
//! opened a newer file and silently skipped the index, and the read path
//! kept branches for "a record stored before the index". Here the version
//! in `meta` changes with every change of layout; opening an older file
//! runs each migration in order, each in its own write transaction that
//! also records the version it reaches (a crash between two leaves a file
//! at a version berth knows); a file newer than the binary is refused with
//! both versions named. The readers can then trust every index.
//!
//! An import writes a new file directly at the current version (it
//! rebuilds every index as it loads: `dump::Loader`).
//!
//! The history:
//!
//! | version | change |
//! |---|---|
//! | 1 | the first layout |
//! | 2 | `log_index`: where each log chunk sits (line, byte, length) |
//! | 3 | `idempotency_expiry`: idempotency records by expiry |
//! | 4 | `meta.build_counts`: builds by status, for `/metrics` |
//!
//! Releases before version 2 existed wrote version 1 but may already hold
//! any of the later indexes (they were added by presence checks), so each
//! migration rebuilds its index from the rows it indexes rather than
//! assume it is absent. Every migration is tested on the store file in
//! `tests/data/store-v1` (written by the last release that wrote version 1)
//! and on a store whose index was removed.

use redb::{Database, ReadableTable, ReadableTableMetadata, WriteTransaction};

use super::compress::decompress;
use super::tables::*;
use super::{
    count_builds, decode, encode_counts, split_chunk_row, ChunkPlace, IdempotencyRecord,
    StoreError, StoreResult, BUILD_COUNTS_KEY,
};
use crate::model::BuildId;

/// The layout this binary writes and reads.
pub const LAYOUT_VERSION: u32 = 4;

/// The `meta` key holding the layout version (u32 LE). Its name predates
/// the word "layout" and stays, so every release finds it.
pub const VERSION_KEY: &str = "schema_version";

/// One step of the history: it takes a file at `to - 1` to `to`.
struct Migration {
    to: u32,
    /// What it does, for the log line at open.
    what: &'static str,
    run: fn(&WriteTransaction) -> StoreResult<()>,
}

/// Every migration, in order; `MIGRATIONS[i].to == i + 2`.
const MIGRATIONS: [Migration; 3] = [
    Migration {
        to: 2,
        what: "index every build's log chunks",
        run: index_log_chunks,
    },
    Migration {
        to: 3,
        what: "index idempotency records by expiry",
        run: index_idempotency_expiry,
    },
    Migration {
        to: 4,
        what: "count builds by status",
        run: count_builds_by_status,
    },
];

/// The version a file records; `None` for a file berth never opened.
fn recorded_version(txn: &WriteTransaction) -> StoreResult<Option<u32>> {
    let meta = txn.open_table(META)?;
    let Some(bytes) = meta.get(VERSION_KEY)?.map(|v| v.value().to_vec()) else {
        return Ok(None);
    };
    <[u8; 4]>::try_from(bytes.as_slice())
        .map(|b| Some(u32::from_le_bytes(b)))
        .map_err(|_| StoreError::corrupt("meta.schema_version is not a u32"))
}

fn record_version(txn: &WriteTransaction, version: u32) -> StoreResult<()> {
    txn.open_table(META)?
        .insert(VERSION_KEY, version.to_le_bytes().as_slice())?;
    Ok(())
}

/// Brings the file to `LAYOUT_VERSION`: creates a new file at it, migrates
/// an older one step by step, refuses a newer one. Every table exists
/// afterwards, so readers never meet a missing one.
pub fn open_layout(db: &Database) -> StoreResult<()> {
    let txn = db.begin_write()?;
    let found = recorded_version(&txn)?;
    let Some(mut version) = found else {
        // A new file: every table, empty counts, the current version.
        for table in Table::ALL {
            table.create(&txn)?;
        }
        txn.open_table(META)?
            .insert(BUILD_COUNTS_KEY, encode_counts(&[0; 5]).as_slice())?;
        record_version(&txn, LAYOUT_VERSION)?;
        txn.commit()?;
        return Ok(());
    };
    if version > LAYOUT_VERSION {
        return Err(StoreError::corrupt(format!(
            "the store has layout version {version}, newer than this berth's {LAYOUT_VERSION}; \
             run the berth that wrote it (or a newer one), or export with it and import here"
        )));
    }
    if version == 0 {
        return Err(StoreError::corrupt(
            "the store records layout version 0, which no berth writes",
        ));
    }
    drop(txn);
    let found = version;
    for step in MIGRATIONS.iter().filter(|m| m.to > found) {
        assert_eq!(step.to, version + 1, "migrations are listed in order");
        tracing::info!(
            from = version,
            to = step.to,
            "migrating the store: {}",
            step.what
        );
        let txn = db.begin_write()?;
        for table in Table::ALL {
            table.create(&txn)?;
        }
        (step.run)(&txn)?;
        record_version(&txn, step.to)?;
        txn.commit()?;
        version = step.to;
    }
    assert_eq!(version, LAYOUT_VERSION, "every migration ran");
    // A file at the current version still gets any table it lacks (an
    // empty one an older import did not write).
    let txn = db.begin_write()?;
    for table in Table::ALL {
        table.create(&txn)?;
    }
    txn.commit()?;
    Ok(())
}

/// Version 2: `log_index`. A build whose index rows do not match its chunks
/// one for one gets them again, from the chunks themselves (each is
/// decompressed once, for its length).
fn index_log_chunks(txn: &WriteTransaction) -> StoreResult<()> {
    let chunks = txn.open_table(LOG_CHUNKS)?;
    let mut index = txn.open_table(LOG_INDEX)?;
    let mut build: Option<BuildId> = None;
    let mut places: Vec<ChunkPlace> = Vec::new();
    let mut flush = |build: BuildId, places: &mut Vec<ChunkPlace>| -> StoreResult<()> {
        let mut same = 0usize;
        for entry in index.range((build, 0u32)..=(build, u32::MAX))? {
            let (k, v) = entry?;
            let (_, number) = k.value();
            let stored = ChunkPlace::decode(number, v.value());
            if stored.as_ref() == places.get(same) {
                same += 1;
            } else {
                same = usize::MAX;
                break;
            }
        }
        if same != places.len() {
            index.retain_in((build, 0u32)..=(build, u32::MAX), |_, _| false)?;
            for place in places.iter() {
                index.insert((build, place.number), place.encode().as_slice())?;
            }
        }
        places.clear();
        Ok(())
    };
    let mut next_byte = 0u64;
    for entry in chunks.iter()? {
        let (k, v) = entry?;
        let (id, number) = k.value();
        if build != Some(id) {
            if let Some(done) = build {
                flush(done, &mut places)?;
            }
            build = Some(id);
            next_byte = 0;
        }
        let (first_line, compressed) = split_chunk_row(v.value())?;
        let raw_len = decompress(compressed)?.len() as u64;
        places.push(ChunkPlace {
            number,
            first_line,
            first_byte: next_byte,
            raw_len,
        });
        next_byte += raw_len;
    }
    if let Some(done) = build {
        flush(done, &mut places)?;
    }
    Ok(())
}

/// Version 3: `idempotency_expiry`, rebuilt from the records.
fn index_idempotency_expiry(txn: &WriteTransaction) -> StoreResult<()> {
    let records = txn.open_table(IDEMPOTENCY)?;
    let mut expiry = txn.open_table(IDEMPOTENCY_EXPIRY)?;
    expiry.retain(|_, _| false)?;
    for entry in records.iter()? {
        let (k, v) = entry?;
        let r: IdempotencyRecord = decode(v.value())?;
        expiry.insert((r.expires_at, k.value()), ())?;
    }
    assert_eq!(expiry.len()?, records.len()?, "one expiry row per record");
    Ok(())
}

/// Version 4: `meta.build_counts`, counted from the builds.
fn count_builds_by_status(txn: &WriteTransaction) -> StoreResult<()> {
    let counts = count_builds(txn)?;
    txn.open_table(META)?
        .insert(BUILD_COUNTS_KEY, encode_counts(&counts).as_slice())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_migrations_are_listed_in_order_and_reach_the_current_layout() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.to as usize, i + 2);
        }
        assert_eq!(MIGRATIONS.last().map(|m| m.to), Some(LAYOUT_VERSION));
    }
}
