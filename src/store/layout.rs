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
    use crate::store::{codec, compress::compress};

    fn temp_db(tag: &str) -> (Database, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("berth-layout-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        (Database::create(dir.join("berth.redb")).unwrap(), dir)
    }

    fn version(db: &Database) -> u32 {
        let txn = db.begin_write().unwrap();
        let v = recorded_version(&txn).unwrap().unwrap();
        txn.abort().unwrap();
        v
    }

    /// A version-1 file whose indexes are missing, partial or wrong gets
    /// each rebuilt from its rows, one transaction per step, and ends at
    /// the current version.
    #[test]
    fn each_migration_rebuilds_its_index_from_the_rows() {
        let (db, dir) = temp_db("rebuild");
        open_layout(&db).unwrap();
        assert_eq!(version(&db), LAYOUT_VERSION);
        let (a, b) = (1u128 << 80, 2u128 << 80);
        let text = |n: usize| "a line of log\n".repeat(n).into_bytes();
        {
            let txn = db.begin_write().unwrap();
            let mut chunks = txn.open_table(LOG_CHUNKS).unwrap();
            // Build a: three chunks; build b: one.
            for (build, number, first_line, lines) in
                [(a, 0u32, 0u64, 3), (a, 1, 3, 5), (a, 2, 8, 1), (b, 0, 0, 2)]
            {
                let mut row = first_line.to_le_bytes().to_vec();
                row.extend(compress(&text(lines)).unwrap());
                chunks.insert((build, number), row.as_slice()).unwrap();
            }
            drop(chunks);
            let mut index = txn.open_table(LOG_INDEX).unwrap();
            // a: a wrong row; b: none at all.
            let wrong = ChunkPlace {
                number: 1,
                first_line: 9,
                first_byte: 9,
                raw_len: 9,
            };
            index.insert((a, 1), wrong.encode().as_slice()).unwrap();
            drop(index);
            let record = IdempotencyRecord {
                fingerprint: vec![1],
                status: 202,
                content_type: "application/json".into(),
                body: b"{}".to_vec(),
                headers: vec![],
                expires_at: 5_000,
            };
            txn.open_table(IDEMPOTENCY)
                .unwrap()
                .insert("service\u{0}/r\u{0}key", codec::encode(&record).as_slice())
                .unwrap();
            txn.open_table(META)
                .unwrap()
                .remove(BUILD_COUNTS_KEY)
                .unwrap();
            record_version(&txn, 1).unwrap();
            txn.commit().unwrap();
        }
        open_layout(&db).unwrap();
        assert_eq!(version(&db), LAYOUT_VERSION);
        let txn = db.begin_write().unwrap();
        let index = txn.open_table(LOG_INDEX).unwrap();
        let places: Vec<(u128, ChunkPlace)> = index
            .iter()
            .unwrap()
            .map(|e| {
                let (k, v) = e.unwrap();
                let (build, number) = k.value();
                (build, ChunkPlace::decode(number, v.value()).unwrap())
            })
            .collect();
        let line = "a line of log\n".len() as u64;
        let place = |number, first_line: u64, first_byte: u64, lines: u64| ChunkPlace {
            number,
            first_line,
            first_byte,
            raw_len: lines * line,
        };
        assert_eq!(
            places,
            vec![
                (a, place(0, 0, 0, 3)),
                (a, place(1, 3, 3 * line, 5)),
                (a, place(2, 8, 8 * line, 1)),
                (b, place(0, 0, 0, 2)),
            ]
        );
        let expiry: Vec<i64> = txn
            .open_table(IDEMPOTENCY_EXPIRY)
            .unwrap()
            .iter()
            .unwrap()
            .map(|e| e.unwrap().0.value().0)
            .collect();
        assert_eq!(expiry, vec![5_000]);
        assert!(txn
            .open_table(META)
            .unwrap()
            .get(BUILD_COUNTS_KEY)
            .unwrap()
            .is_some());
        drop(index);
        drop(txn);
        drop(db);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_newer_file_is_refused_naming_both_versions_and_left_as_it_is() {
        let (db, dir) = temp_db("newer");
        open_layout(&db).unwrap();
        let txn = db.begin_write().unwrap();
        record_version(&txn, LAYOUT_VERSION + 1).unwrap();
        txn.commit().unwrap();
        let e = open_layout(&db).unwrap_err().to_string();
        assert!(
            e.contains(&format!("layout version {}", LAYOUT_VERSION + 1)),
            "{e}"
        );
        assert!(e.contains(&format!("this berth's {LAYOUT_VERSION}")), "{e}");
        assert_eq!(version(&db), LAYOUT_VERSION + 1);
        drop(db);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_migrations_are_listed_in_order_and_reach_the_current_layout() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.to as usize, i + 2);
        }
        assert_eq!(MIGRATIONS.last().map(|m| m.to), Some(LAYOUT_VERSION));
    }
}
