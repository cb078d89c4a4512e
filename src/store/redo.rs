//! The redo log in front of redb (`berth.redo` beside `berth.redb`), used
//! when berth holds the store alone (`berth serve`'s default; not with
//! `--shared-store`).
//!
//! Why it exists: a redb commit that is durable on its own writes every
//! page its copy-on-write B-trees dirtied and syncs twice. With the log, a
//! group commit is one append of the rows it wrote and one fdatasync, then
//! redb's non-durable commit (readers see the rows from then on); a
//! checkpoint every `--checkpoint-interval` (or `CHECKPOINT_BYTES` of log)
//! is redb's durable commit, and empties the log. At open, the records
//! written after the last checkpoint are applied again.
//!
//! The log is written from its start again after a checkpoint, over the
//! bytes already there (created as `PREALLOCATED_BYTES` of zeros), so a
//! sync never has to write the file's size. Records of older generations
//! left beyond the end are skipped by the replay.
//!
//! Each record starts on a 4 KiB block of its own and is padded with zeros
//! to whole blocks, written with `O_DIRECT` where the file system allows
//! (`blocks.rs`: the fdatasync then only flushes the disk's cache); the
//! replay finds the next record on the next block. The logs of the layout
//! 8 and 9 fixtures, whose records a berth before blocks packed one behind
//! the other (`PACKED_MAGIC`), are read as they were written.
//!
//! The record format is rows, not requests: a record holds each insert and
//! remove of its batch, in order, as redb's own key and value bytes, so a
//! replay is exact and needs no engine. Each record carries the checkpoint
//! generation it belongs to; the checkpoint stores its generation in `meta`
//! in the same commit, so a record already in redb (a cut between the
//! checkpoint and the log's truncation) is skipped. A record whose length
//! or checksum does not hold is a torn tail (never acknowledged: the sync
//! that would have made it so did not return) and ends the replay. A
//! checksum says a record is whole, not that berth wrote it, so each
//! record also carries a tag under the store's secret key (`RedoKey`),
//! and the replay ends at one whose tag does not hold (`Trust`).
//!
//! The order that keeps an answer honest: the batch's rows are appended and
//! synced *before* any reader can see them. A log that cannot be written
//! aborts the batch, so a refused batch changes nothing; a record whose
//! batch redb then refuses is voided (`void_at`) before anything is
//! written behind it.
//!
//! redb refuses non-durable commits when other processes may read the
//! file, so the default shared store (`berth audit verify` and `export`
//! reading the live file) keeps redb's own durable commits.

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use redb::{Database, Key, ReadableTable, TableDefinition, Value, WriteTransaction};

use super::blocks::{self, BlockWriter};
use super::layout::{LoggedTable, Retired};
use super::logged::RowLog;
use super::tables::*;
use super::{StoreError, StoreResult};

/// How often the writer makes redb durable and empties the log, for
/// tests (berth's own default is `--checkpoint-interval`'s).
#[cfg(test)]
const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(50);
/// A checkpoint is due sooner when the log has grown this far: to the
/// end of its preallocated zeros less the reserve, so while checkpoints
/// succeed the log never grows and never writes zeros past them. It also
/// bounds the replay at open, which must stay under a second (`cargo bench
/// --bench submit` times a start with a full log).
pub const CHECKPOINT_BYTES: u64 = PREALLOCATED_BYTES - RESERVED_BYTES;
/// The log's length at most. Past `CHECKPOINT_BYTES` the log keeps growing
/// only while checkpoints fail (a full disk: they are retried with a
/// backoff, `writer.rs`); up to here commits go on into it, and past it
/// they are refused as a full disk. It bounds the longest replay at open
/// to about twice a full log's, the full-disk case only.
pub const MAX_LOG_BYTES: u64 = 2 * CHECKPOINT_BYTES;
/// The log's bytes written (zeros) when it is created: a record written
/// over bytes the file already has leaves its size alone, so fdatasync
/// writes the data and not the inode as well (half the I/O of a growing
/// append). Past it the log grows as any file does.
pub const PREALLOCATED_BYTES: u64 = 16 << 20;
/// One record (one group commit) at most: a batch larger than this fails
/// as a too-large write, never half-logged.
pub const MAX_RECORD_BYTES: usize = 256 << 20;

/// The `meta` key of the last checkpoint's generation (u64 LE).
pub const GENERATION_KEY: &str = "redo_generation";

/// The `meta` key of the log's record key (`RedoKey`): 32 random bytes,
/// made by the first start of a store whose replay commits durably, and
/// never exported (`dump.rs`).
pub const KEY_KEY: &str = "redo_key";

/// The key a record's tag is made with (HMAC-SHA-256, `tag_of`). Why: a
/// record's CRC says it is whole, not that berth wrote it. The bytes
/// behind the log's last record are stale records, and those hold what
/// berth stored, build logs among them, which a deployer writes: a record
/// image forged inside one, with a valid CRC and the coming generation,
/// and found right behind the last record at a restart, would be applied
/// as acknowledged rows. Without the key no one outside berth can make a
/// tag the replay accepts.
pub type RedoKey = [u8; 32];

/// The magic of a record that starts on a block of its own, is padded to
/// the end of its last (`blocks.rs`), and carries a tag made with the
/// store's `RedoKey`. Every record written now is one, unless the store
/// has no durable key yet (`UNKEYED_MAGIC`).
const MAGIC: [u8; 4] = *b"BRDK";
/// As `MAGIC`, with no tag: written only until the store's key is durable
/// (a first start of this berth on a full disk, whose replay could not
/// commit it), and read only from a store without a key, or as a record
/// already checkpointed (`Trust`).
const UNKEYED_MAGIC: [u8; 4] = *b"BRDU";
/// The magic of a record written by a berth before blocks: the next
/// record starts right behind it; the short header (`LEGACY_HEADER`).
/// Read, never written: the logs of the committed fixtures of layouts 8
/// and 9 (`tests/data/store-v8-crashed`, `store-v9-crashed`) hold them,
/// and are replayed before their files migrate.
const PACKED_MAGIC: [u8; 4] = *b"BRDO";
/// magic, payload length (u32), crc32 of the generation, layout and rows,
/// generation (u64), layout version (u32), then the tag (`TAG_BYTES`).
const HEADER: usize = 4 + 4 + 4 + 8 + 4 + TAG_BYTES;
/// The header of `PACKED_MAGIC` records: no tag.
const LEGACY_HEADER: usize = 4 + 4 + 4 + 8 + 4;
/// HMAC-SHA-256 cut to 128 bits: forging one is a 2^-128 guess per try.
const TAG_BYTES: usize = 16;

/// The keyed hash of a record (HMAC-SHA-256 under `key`) fed its length,
/// generation, layout and rows: finalized into a tag (`tag_of`), or
/// checked against one (`record_at`).
fn mac_of(key: &RedoKey, len: u32, checked: &[u8], rows: &[u8]) -> hmac::Hmac<sha2::Sha256> {
    use hmac::{KeyInit, Mac};
    // HMAC takes a key of any length; 32 bytes never fail.
    let mut mac = match hmac::Hmac::<sha2::Sha256>::new_from_slice(key) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC takes a key of any length"),
    };
    mac.update(&len.to_le_bytes());
    mac.update(checked);
    mac.update(rows);
    mac
}

/// The tag of a record: its `mac_of`, cut to `TAG_BYTES`.
fn tag_of(key: &RedoKey, len: u32, checked: &[u8], rows: &[u8]) -> [u8; TAG_BYTES] {
    use hmac::Mac;
    let full = mac_of(key, len, checked, rows).finalize().into_bytes();
    let mut tag = [0u8; TAG_BYTES];
    tag.copy_from_slice(&full[..TAG_BYTES]);
    tag
}

/// A new record key, from the operating system's random source.
fn new_key() -> StoreResult<RedoKey> {
    let mut key = [0u8; 32];
    getrandom::fill(&mut key)
        .map_err(|e| StoreError::other(format!("no random bytes for the redo log's key: {e}")))?;
    Ok(key)
}

/// The store's record key, if it has one.
fn stored_key(
    meta: &impl ReadableTable<&'static str, &'static [u8]>,
) -> StoreResult<Option<RedoKey>> {
    match meta.get(KEY_KEY)? {
        None => Ok(None),
        Some(v) => RedoKey::try_from(v.value())
            .map(Some)
            .map_err(|_| StoreError::corrupt("meta.redo_key is not 32 bytes")),
    }
}

/// Which records a read of the log may take as the store's.
#[derive(Clone, Copy)]
enum Trust {
    /// Whole ones of any kind, tags unchecked: only to tell whether the
    /// log holds records at all (`unapplied`, which then asks `pending`).
    Unverified,
    /// The store's: a keyed record only with a tag made with `key`; an
    /// unkeyed one only if the store has no key, or if it is checkpointed
    /// (its generation at most `durable`: it is passed over, never
    /// applied). Every record written since the key became durable is
    /// keyed, so an unkeyed record newer than the checkpoint is forged.
    Store { key: Option<RedoKey>, durable: u64 },
}

const OP_INSERT: u8 = 1;
const OP_REMOVE: u8 = 2;
const OP_CLEAR: u8 = 3;

/// The log's path beside the store file.
pub fn path_of(store: &Path) -> PathBuf {
    store.with_extension("redo")
}

/// The rows one write job changed, encoded in order. In the writer they
/// are appended straight behind the record's header (`RecordBuf::lend`),
/// so they are never copied and their buffer is not allocated anew.
#[derive(Default)]
pub struct Ops {
    bytes: Vec<u8>,
}

impl Ops {
    fn table(&mut self, table: Table, op: u8) {
        let name = table.name().as_bytes();
        debug_assert!(name.len() < 256);
        self.bytes.push(name.len() as u8);
        self.bytes.extend_from_slice(name);
        self.bytes.push(op);
    }

    fn bytes(&mut self, b: &[u8]) {
        self.bytes
            .extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.bytes.extend_from_slice(b);
    }

    pub fn clear(&mut self, table: Table) {
        self.table(table, OP_CLEAR);
    }

    #[cfg(test)]
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }
}

impl RowLog for Ops {
    fn insert(&mut self, table: Table, key: &[u8], value: &[u8]) {
        self.table(table, OP_INSERT);
        self.bytes(key);
        self.bytes(value);
    }

    fn remove(&mut self, table: Table, key: &[u8]) {
        self.table(table, OP_REMOVE);
        self.bytes(key);
    }
}

/// The last bytes of the log's written room that only a commit berth
/// must land to leave nothing stuck may use (`Urgency::Must`: a build's
/// final commit, a restart's recovery): on a full disk the log cannot
/// grow, and without them a build whose output filled the disk would stay
/// `running` until space returned. A final commit carries its build's
/// last log chunk, at most `LOG_CHUNK_BYTES` (1 MiB) before compression,
/// so 2 MiB holds one of the worst (output that does not compress) and
/// many of the usual few-KB ones. One larger than what is left waits, as
/// any final commit on a full disk does, for space.
pub const RESERVED_BYTES: u64 = 2 << 20;
/// The log grows by this much at a time once past its preallocation, with
/// zeros written (a record then overwrites room already held, as before).
const GROW_BYTES: u64 = 1 << 20;

/// How much a commit may take of the log's room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Urgency {
    /// Any commit: it leaves `RESERVED_BYTES` free.
    May,
    /// A commit that must land for nothing to stay stuck: it may use the
    /// reserve.
    Must,
}

/// Writes zeros from `from` up to `to`, synced; on a failure (a full
/// disk) the file is cut back to `from`.
fn write_zeros(file: &std::fs::File, from: u64, to: u64) -> std::io::Result<()> {
    let zeros = vec![0u8; 1 << 20];
    let mut at = from;
    let written = (|| {
        while at < to {
            let n = (to - at).min(zeros.len() as u64) as usize;
            file.write_all_at(&zeros[..n], at)?;
            at += n as u64;
        }
        file.sync_all()
    })();
    if written.is_err() {
        let _ = file.set_len(from);
    }
    written
}

/// One group commit's record, built in place: the header's bytes come
/// first, the batch's rows are appended behind them as its jobs run, and
/// `RedoLog::append` fills the header in and writes it all in one call (no
/// copy of the rows). Kept between commits, so a commit does not allocate
/// and free a buffer of its size each time: glibc's malloc consolidates
/// its free lists on every free of 64 KiB or more, which a 32-submit
/// batch is.
#[derive(Default)]
pub struct RecordBuf {
    bytes: Vec<u8>,
}

/// A record buffer that grew past this (a large batch of log chunks) is
/// given back when the next record starts rather than kept.
const KEPT_RECORD_BYTES: usize = 4 << 20;

impl RecordBuf {
    /// Empties the buffer for the next commit's rows.
    pub fn start(&mut self) {
        if self.bytes.capacity() > KEPT_RECORD_BYTES {
            self.bytes = Vec::new();
        }
        self.bytes.clear();
        self.bytes.resize(HEADER, 0);
    }

    /// The buffer, header and all, for a transaction's `Tx` to append its
    /// rows to; `take_back` returns it when the jobs are done (one buffer
    /// kept, not one grown and freed per batch).
    pub fn lend(&mut self) -> Ops {
        debug_assert!(self.bytes.len() >= HEADER, "lent before `start`");
        Ops {
            bytes: std::mem::take(&mut self.bytes),
        }
    }

    /// Takes back the buffer `lend` gave, with the rows appended to it.
    pub fn take_back(&mut self, ops: Ops) {
        debug_assert!(ops.bytes.len() >= HEADER, "not the buffer `lend` gave");
        self.bytes = ops.bytes;
    }

    /// The rows pushed since `start`.
    pub fn rows(&self) -> &[u8] {
        self.bytes.get(HEADER..).unwrap_or_default()
    }
}

/// The append side, owned by the writer thread.
pub struct RedoLog {
    file: std::fs::File,
    /// How records reach `file`: whole blocks, with `O_DIRECT` where the
    /// file system allows (`blocks.rs`).
    blocks: BlockWriter,
    /// Where the next record goes (the log's valid length).
    end: u64,
    /// How many bytes of the file are written (zeros or records): room a
    /// record takes without the disk giving a block.
    room: u64,
    /// The generation of records written now (the last checkpoint's + 1).
    pub generation: u64,
    /// The store's record key, once it is durable in the store file;
    /// until then records are written unkeyed (`UNKEYED_MAGIC`).
    key: Option<RedoKey>,
    layout: u32,
    /// How long between checkpoints, at most.
    pub checkpoint_every: Duration,
    /// Where refused records start whose headers could not be voided (the
    /// disk refused that write too): no record is written until each is,
    /// since a record written behind one would let a replay reach it.
    unvoided: Vec<u64>,
}

fn io_error(e: std::io::Error) -> StoreError {
    StoreError::from(e)
}

impl RedoLog {
    /// Opens (or creates, durably named and preallocated) the log after
    /// `replay` applied it; writing goes on where the replay says (its
    /// start after a checkpoint, behind the records a kept log holds).
    pub fn open(
        path: &Path,
        at: Resume,
        layout: u32,
        checkpoint_every: Duration,
    ) -> StoreResult<RedoLog> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let existed = path.exists();
        // The log holds every row since the last checkpoint (secrets
        // among them): created readable by berth only, and an older
        // log's mode narrowed at every open.
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(crate::durable::PRIVATE_FILE_MODE)
            .open(path)
            .map_err(io_error)?;
        file.set_permissions(std::fs::Permissions::from_mode(
            crate::durable::PRIVATE_FILE_MODE,
        ))
        .map_err(io_error)?;
        let len = file.metadata().map_err(io_error)?.len();
        let mut room = len;
        if len < PREALLOCATED_BYTES {
            match write_zeros(&file, len, PREALLOCATED_BYTES) {
                Ok(()) => room = PREALLOCATED_BYTES,
                Err(e) => {
                    // A disk with less room than that: the log grows as it
                    // is written instead, but holds its reserve at least.
                    tracing::warn!(error = %e, bytes = PREALLOCATED_BYTES,
                        "cannot preallocate the redo log; it grows as it is written");
                    if len < RESERVED_BYTES {
                        match write_zeros(&file, len, RESERVED_BYTES) {
                            Ok(()) => room = RESERVED_BYTES,
                            Err(e) => tracing::warn!(error = %e, bytes = RESERVED_BYTES,
                                "cannot reserve the redo log's room for final commits"),
                        }
                    }
                }
            }
        }
        // Out of the page cache: the zeros were written in large folios,
        // and a record dirtying one would make each sync write the whole
        // folio (2 MiB here, measured: 512 pages a sync, against 1.4 once
        // evicted). Pages a record writes afterwards are small. Synced
        // first: dirty pages are not dropped.
        file.sync_all().map_err(io_error)?;
        nix::fcntl::posix_fadvise(
            &file,
            0,
            0,
            nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
        )
        .map_err(|e| io_error(std::io::Error::from(e)))?;
        if !existed {
            if let Some(dir) = path.parent() {
                crate::durable::sync_dir(dir).map_err(io_error)?;
            }
        }
        Ok(RedoLog {
            blocks: BlockWriter::open(path),
            file,
            end: at.end,
            room,
            generation: at.generation,
            key: at.key,
            layout,
            checkpoint_every,
            unvoided: Vec::new(),
        })
    }

    /// The log's valid length in bytes.
    pub fn bytes(&self) -> u64 {
        self.end
    }

    /// Appends `record` (its header filled in here) and syncs it; returns
    /// where it starts. On failure the log is cut back to where it was
    /// (best effort; a torn tail is ignored by the replay).
    pub fn append(&mut self, record: &mut RecordBuf, urgency: Urgency) -> StoreResult<u64> {
        let start = self.write(record, urgency)?;
        match self.file.sync_data() {
            Ok(()) => Ok(start),
            Err(e) => {
                // Whatever part of it reached the disk must never replay.
                self.void_or_remember(start);
                self.end = start;
                Err(io_error(e))
            }
        }
    }

    /// Voids the refused record at `at`, or remembers it for `void_unvoided`
    /// when the disk refuses that too.
    fn void_or_remember(&mut self, at: u64) {
        if let Err(e) = self.void_at(at) {
            tracing::error!(error = %e, at, "cannot void a refused record in the redo log; no record is written until it is");
            self.unvoided.push(at);
        }
    }

    /// Voids every refused record not voided yet; an error while one is
    /// left refuses the record about to be written.
    fn void_unvoided(&mut self) -> StoreResult<()> {
        while let Some(&at) = self.unvoided.last() {
            self.void_at(at).map_err(io_error)?;
            self.unvoided.pop();
        }
        Ok(())
    }

    /// Writes `record` (its header filled in here) on the first block
    /// boundary behind the last one, padded to whole blocks
    /// (`blocks.rs`), not synced; returns where it starts. A sync of the
    /// log's file (`sync_handle`) makes it durable; until then it must be
    /// voided (`void_at`) if it is not to land. On a failed write the log
    /// is cut back to where it was.
    pub fn write(&mut self, record: &mut RecordBuf, urgency: Urgency) -> StoreResult<u64> {
        self.void_unvoided()?;
        let payload_len = record.rows().len();
        if payload_len > MAX_RECORD_BYTES {
            return Err(StoreError::other(format!(
                "one commit's rows are {payload_len} bytes, over the redo log's {MAX_RECORD_BYTES}"
            )));
        }
        let start = blocks::block_start(self.end);
        let after = start + blocks::padded(HEADER + payload_len) as u64;
        if after > MAX_LOG_BYTES && urgency == Urgency::May {
            return Err(StoreError::log_full(MAX_LOG_BYTES));
        }
        self.make_room(after, urgency)?;
        let mut checked = [0u8; 12];
        checked[..8].copy_from_slice(&self.generation.to_le_bytes());
        checked[8..].copy_from_slice(&self.layout.to_le_bytes());
        let mut crc = crc32fast::Hasher::new();
        crc.update(&checked);
        crc.update(record.rows());
        let (magic, tag) = match &self.key {
            Some(key) => (
                MAGIC,
                tag_of(key, payload_len as u32, &checked, record.rows()),
            ),
            None => (UNKEYED_MAGIC, [0u8; TAG_BYTES]),
        };
        let bytes = &mut record.bytes;
        bytes[..4].copy_from_slice(&magic);
        bytes[4..8].copy_from_slice(&(payload_len as u32).to_le_bytes());
        bytes[8..12].copy_from_slice(&crc.finalize().to_le_bytes());
        bytes[12..LEGACY_HEADER].copy_from_slice(&checked);
        bytes[LEGACY_HEADER..HEADER].copy_from_slice(&tag);
        match self.blocks.write(&self.file, bytes, start) {
            Ok(written) => {
                debug_assert_eq!(start + written, after);
                self.end = after;
                Ok(start)
            }
            Err(e) => {
                // Whatever part of it reached the disk must never replay.
                self.void_or_remember(start);
                Err(io_error(e))
            }
        }
    }

    /// Grows the log's written room, when needed, so a record ending at
    /// `after` fits with the reserve left over (`Urgency::May`) or at all
    /// (`Urgency::Must`). A disk that cannot give the room refuses the
    /// record, as a full disk, before any of it is written.
    fn make_room(&mut self, after: u64, urgency: Urgency) -> StoreResult<()> {
        let needed = match urgency {
            Urgency::May => after + RESERVED_BYTES,
            Urgency::Must => after,
        };
        if needed <= self.room {
            return Ok(());
        }
        let to = needed.div_ceil(GROW_BYTES) * GROW_BYTES;
        match write_zeros(&self.file, self.room, to) {
            Ok(()) => {
                self.room = to;
                Ok(())
            }
            Err(e) => {
                // Perhaps a smaller step still fits what this one needs.
                if write_zeros(&self.file, self.room, needed).is_ok() {
                    self.room = needed;
                    return Ok(());
                }
                Err(io_error(e))
            }
        }
    }

    /// Overwrites the header of a record at `at` with zeros and syncs: the
    /// replay stops there.
    fn void_at(&self, at: u64) -> std::io::Result<()> {
        void_at(&self.file, at)
    }

    #[cfg(all(test, feature = "failpoints"))]
    /// After records written with `write` were voided (never to land):
    /// the next record goes where the first of them began.
    pub(super) fn rewind(&mut self, to: u64) {
        debug_assert!(to <= self.end);
        self.end = to;
    }

    /// Takes the last record back, given where it starts (its redb
    /// commit failed after the sync): cut and synced, so a restart never
    /// applies what was refused.
    pub fn take_back(&mut self, start: u64) -> StoreResult<()> {
        self.void_at(start).map_err(io_error)?;
        self.end = start;
        Ok(())
    }

    /// After a checkpoint: the log is written from its start again, one
    /// generation on (the records there now are all checkpointed, and the
    /// replay skips them).
    pub fn restart(&mut self, generation: u64) -> StoreResult<()> {
        debug_assert!(generation > self.generation || self.end == 0);
        self.generation = generation;
        self.end = 0;
        Ok(())
    }

    /// After a replay: writing goes on where it says (behind the records
    /// a `Replay::KeepLog` left the only durable copy of, or from the start).
    pub fn resume(&mut self, at: Resume) {
        self.generation = at.generation;
        self.end = at.end;
        self.key = at.key;
    }
}

/// Overwrites the header of the record at `at` with zeros and syncs: a
/// replay stops there, so neither it nor anything written after it lands.
pub(super) fn void_at(file: &std::fs::File, at: u64) -> std::io::Result<()> {
    if crate::failpoints::hit("redo.void", "") {
        return Err(std::io::Error::other("injected: redo.void"));
    }
    file.write_all_at(&[0u8; HEADER], at)
        .and_then(|()| file.sync_data())
}

/// The generation of the last checkpoint recorded in `txn`'s `meta`.
fn durable_generation(meta: &impl ReadableTable<&'static str, &'static [u8]>) -> StoreResult<u64> {
    match meta.get(GENERATION_KEY)? {
        None => Ok(0),
        Some(v) => <[u8; 8]>::try_from(v.value())
            .map(u64::from_le_bytes)
            .map_err(|_| StoreError::corrupt("meta.redo_generation is not a u64")),
    }
}

/// Records a checkpoint's generation in the commit that makes it durable.
pub fn record_generation(txn: &WriteTransaction, generation: u64) -> StoreResult<()> {
    txn.open_table(META)?
        .insert(GENERATION_KEY, generation.to_le_bytes().as_slice())?;
    Ok(())
}

/// One valid record of the log.
struct Record {
    generation: u64,
    layout: u32,
    /// Written by a berth before blocks (`PACKED_MAGIC`).
    packed: bool,
    /// Where the record behind it starts: right behind it when packed,
    /// else on the next block.
    next: u64,
    /// Where its rows are in `Records::bytes` (not a copy: a log near its
    /// limit is read once, so a replay holds it in memory once).
    payload: std::ops::Range<usize>,
}

/// The log file as read, and its valid records.
struct Records {
    bytes: Vec<u8>,
    valid: Vec<Record>,
}

impl Records {
    fn payload(&self, record: &Record) -> &[u8] {
        &self.bytes[record.payload.clone()]
    }
}

/// The record that starts at `at` in `bytes`, if one whole and valid
/// does (its magic, length and checksum hold, and its tag under `trust`).
fn record_at(bytes: &[u8], at: usize, trust: Trust) -> Option<Record> {
    let magic = <[u8; 4]>::try_from(bytes.get(at..at.checked_add(4)?)?).ok()?;
    let (header, packed, keyed) = match magic {
        MAGIC => (HEADER, false, true),
        UNKEYED_MAGIC => (HEADER, false, false),
        PACKED_MAGIC => (LEGACY_HEADER, true, false),
        _ => return None,
    };
    let head = bytes.get(at..at.checked_add(header)?)?;
    let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    let crc = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
    if len as usize > MAX_RECORD_BYTES {
        return None;
    }
    let payload = at + header..at + header + len as usize;
    let rows = bytes.get(payload.clone())?;
    let checked = &head[12..LEGACY_HEADER];
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(checked);
    hasher.update(rows);
    if hasher.finalize() != crc {
        return None;
    }
    let generation = u64::from_le_bytes(checked[..8].try_into().ok()?);
    let layout = u32::from_le_bytes(checked[8..12].try_into().ok()?);
    let trusted = match (trust, keyed) {
        (Trust::Unverified, _) => true,
        (Trust::Store { key: Some(key), .. }, true) => {
            // Compared in constant time (the crate's own check of a tag
            // cut to its left bytes): the tag is a secret's output.
            use hmac::Mac;
            mac_of(&key, len, checked, rows)
                .verify_truncated_left(&head[LEGACY_HEADER..HEADER])
                .is_ok()
        }
        // A keyed record and no key: the key was never durable, so this
        // berth wrote no such record.
        (Trust::Store { key: None, .. }, true) => false,
        (Trust::Store { key: None, .. }, false) => true,
        (
            Trust::Store {
                key: Some(_),
                durable,
            },
            false,
        ) => generation <= durable,
    };
    if !trusted {
        return None;
    }
    let end = payload.end as u64;
    Some(Record {
        generation,
        layout,
        packed,
        next: match packed {
            true => end,
            false => blocks::block_start(end),
        },
        payload,
    })
}

/// The records of the log at `path` up to its first torn, foreign or
/// untrusted one (`Trust`).
fn read_records(path: &Path, trust: Trust) -> StoreResult<Records> {
    let mut bytes = Vec::new();
    match std::fs::File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes).map_err(io_error)?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Records {
                bytes,
                valid: Vec::new(),
            })
        }
        Err(e) => return Err(io_error(e)),
    }
    let mut records: Vec<Record> = Vec::new();
    let mut at = 0usize;
    loop {
        // Generations only grow along the log: an older one past the end
        // is what the log held before it was written from its start again.
        let newest = records.last().map_or(0, |r| r.generation);
        let found = match record_at(&bytes, at, trust).filter(|r| r.generation >= newest) {
            Some(record) => Some(record),
            // Behind a packed record (a berth before blocks, whose log a
            // reopen kept) the next one written since starts on the
            // next block.
            None if records.last().is_some_and(|r| r.packed) => {
                record_at(&bytes, blocks::block_start(at as u64) as usize, trust)
                    .filter(|r| !r.packed && r.generation >= newest)
            }
            None => None,
        };
        let Some(record) = found else {
            break;
        };
        at = usize::try_from(record.next).unwrap_or(usize::MAX);
        records.push(record);
    }
    Ok(Records {
        bytes,
        valid: records,
    })
}

/// Whether the log beside `store` holds rows the store file lacks (berth
/// killed while it held the store alone), for a command that reads the
/// file alone; an error when a running berth holds the store. A file it
/// cannot open to tell counts as yes.
pub fn unapplied(store: &Path) -> StoreResult<bool> {
    // Whole records of any kind: whether they are the store's, and newer
    // than its checkpoint, `pending` tells with the store's key.
    let records = read_records(&path_of(store), Trust::Unverified)?;
    if records.valid.is_empty() {
        return Ok(false);
    }
    if !store.exists() {
        return Ok(true);
    }
    let db = match super::redb_builder(
        redb::ConcurrencyMode::SingleWriter,
        super::CacheSize::DEFAULT,
    )
    .open_read_only(store)
    {
        Ok(db) => db,
        // A server holds it alone (its log is live, not left over).
        Err(redb::DatabaseError::DatabaseAlreadyOpen) => return Err(StoreError::in_use(store)),
        Err(_) => return Ok(true),
    };
    let txn = redb::ReadableDatabase::begin_read(&db)?;
    pending(store, &txn.open_table(META)?)
}

/// Removes the log beside `store`, durably (an import's new store must not
/// get the old store's rows).
pub fn remove(store: &Path) -> StoreResult<()> {
    let path = path_of(store);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error(e)),
    }
    match path.parent() {
        Some(dir) => crate::durable::sync_dir(dir).map_err(io_error),
        None => Ok(()),
    }
}

/// Whether the log beside `store` holds rows a checkpoint has not put into
/// the file yet (a reader then sees less than was acknowledged).
pub fn pending(
    store: &Path,
    meta: &impl ReadableTable<&'static str, &'static [u8]>,
) -> StoreResult<bool> {
    let durable = durable_generation(meta)?;
    let trust = Trust::Store {
        key: stored_key(meta)?,
        durable,
    };
    Ok(read_records(&path_of(store), trust)?
        .valid
        .iter()
        .any(|r| r.generation > durable))
}

/// How a replay commits what it applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replay {
    /// In one durable commit that records the records' generation as
    /// checkpointed: the log is then written from its start again (at
    /// open, where a start may write).
    Checkpoint,
    /// In one non-durable commit: the log stays the truth for those rows,
    /// and writing goes on behind its last record (a reopen after an I/O
    /// error, perhaps a full disk: it must not need to write the store
    /// file to serve reads again).
    KeepLog,
}

/// Where the log is written next after a replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resume {
    pub generation: u64,
    pub end: u64,
    /// The store's record key, when it is durable in the store file.
    pub key: Option<RedoKey>,
}

/// Applies every record of the log written after the last checkpoint in
/// one commit, durable or not as `how` says.
pub fn replay(db: &Database, store: &Path, layout: u32, how: Replay) -> StoreResult<Resume> {
    let path = path_of(store);
    let mut txn = db.begin_write()?;
    // A durable replay is a checkpoint: it saves redb's allocator state as
    // every checkpoint does (quick repair), or a crash
    // before the first checkpoint after it would cost the next start a
    // read of the whole file.
    if how == Replay::Checkpoint {
        txn.set_quick_repair(true);
    }
    if how == Replay::KeepLog {
        txn.set_durability(redb::Durability::None)
            .map_err(|e| StoreError::other(e.to_string()))?;
    }
    let (durable, key) = {
        let meta = txn.open_table(META)?;
        (durable_generation(&meta)?, stored_key(&meta)?)
    };
    let records = read_records(&path, Trust::Store { key, durable })?;
    let file_layout = super::layout::recorded_version(&txn)?;
    let mut last = durable;
    let mut end = 0;
    let mut applied = 0usize;
    for record in records.valid.iter().filter(|r| r.generation > durable) {
        check_layout(&path, record.layout, layout, file_layout, how)?;
        // Generations only grow along the log (`read_records` stops where
        // one falls), so the records newer than the checkpoint come last,
        // behind any it holds already (a log not yet written from its
        // start again after the checkpoint, `RedoLog::checkpointed`);
        // writing resumes right behind the last of them.
        apply_payload(&txn, records.payload(record), record.layout)?;
        last = last.max(record.generation);
        end = record.next;
        applied += 1;
    }
    let resume = resume_after(&txn, how, key, (durable, last, end, applied))?;
    txn.commit()?;
    if applied > 0 {
        tracing::info!(records = applied, path = %path.display(), durable = how == Replay::Checkpoint,
            "applied the redo log's acknowledged writes to the store");
    }
    Ok(resume)
}

/// Whether a record of `record_layout` may be applied by this berth
/// (`layout`) to a file of `file_layout`. A log of the layout before this
/// berth's is applied to the file it was written for, still at that
/// layout, which then migrates (`layout.rs`); only durably, since a file
/// migrated with the log's generation unrecorded would meet those rows
/// again.
fn check_layout(
    path: &Path,
    record_layout: u32,
    layout: u32,
    file_layout: Option<u32>,
    how: Replay,
) -> StoreResult<()> {
    let older = record_layout != layout;
    if older && !(Retired::replayable(record_layout) && file_layout == Some(record_layout)) {
        return Err(StoreError::corrupt(format!(
            "{} holds rows of layout version {record_layout}, and this berth writes {layout}: \
             run the berth that wrote it once, so it applies them",
            path.display(),
        )));
    }
    if older && how == Replay::KeepLog {
        return Err(StoreError {
            kind: super::StoreErrorKind::DiskFull,
            detail: format!(
                "{} holds rows of layout version {record_layout}, which must go into the store \
                 before it moves to layout {layout}, and the disk has no room for \
                 that: free some space and start berth again",
                path.display(),
            ),
        });
    }
    Ok(())
}

/// Where writing resumes after a replay: `(durable, last, end, applied)`
/// are the checkpointed generation, the last applied one, the end of the
/// last applied record and how many were applied.
fn resume_after(
    txn: &redb::WriteTransaction,
    how: Replay,
    key: Option<RedoKey>,
    (durable, last, end, applied): (u64, u64, u64, usize),
) -> StoreResult<Resume> {
    Ok(match how {
        Replay::Checkpoint => {
            record_generation(txn, last)?;
            // A store's first durable replay makes its record key, in
            // the commit that makes it durable: records are keyed only
            // once a restart is sure to find the key.
            let key = match key {
                Some(key) => key,
                None => {
                    let key = new_key()?;
                    txn.open_table(META)?.insert(KEY_KEY, key.as_slice())?;
                    key
                }
            };
            // The log stays as it is: its records are all checkpointed
            // now, and the writer writes over them from the start.
            Resume {
                generation: last + 1,
                end: 0,
                key: Some(key),
            }
        }
        // Non-durable: a key made here could be lost with the records
        // made with it; a store without one writes unkeyed until a start
        // can make it.
        Replay::KeepLog if applied == 0 => Resume {
            generation: durable + 1,
            end: 0,
            key,
        },
        Replay::KeepLog => Resume {
            generation: last,
            end,
            key,
        },
    })
}

/// A reader over one record's payload.
struct Cursor<'a> {
    bytes: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> StoreResult<&'a [u8]> {
        if self.bytes.len() < n {
            return Err(StoreError::corrupt("a redo record ends inside a row"));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    fn sized(&mut self) -> StoreResult<&'a [u8]> {
        let len = self.take(4)?;
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        self.take(len)
    }
}

/// Applies one record's rows, written at `layout`.
fn apply_payload(txn: &WriteTransaction, payload: &[u8], layout: u32) -> StoreResult<()> {
    let mut c = Cursor { bytes: payload };
    while !c.bytes.is_empty() {
        let name_len = c.take(1)?[0] as usize;
        let name = c.take(name_len)?;
        let table = Retired::named(layout, name)
            .ok_or_else(|| StoreError::corrupt("a redo record names a table this berth lacks"))?;
        let op = c.take(1)?[0];
        match op {
            OP_INSERT => {
                let key = c.sized()?;
                let value = c.sized()?;
                apply(txn, table, Some(key), Some(value))?;
            }
            OP_REMOVE => {
                let key = c.sized()?;
                apply(txn, table, Some(key), None)?;
            }
            OP_CLEAR => apply(txn, table, None, None)?,
            _ => {
                return Err(StoreError::corrupt(
                    "a redo record holds an unknown operation",
                ))
            }
        }
    }
    Ok(())
}

/// One row written again: `key` with `value` (insert), without (remove),
/// or no key (the whole table emptied).
fn apply(
    txn: &WriteTransaction,
    table: LoggedTable,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
) -> StoreResult<()> {
    struct Row<'a, 't> {
        txn: &'t WriteTransaction,
        key: Option<&'a [u8]>,
        value: Option<&'a [u8]>,
    }
    impl EachTable for Row<'_, '_> {
        type Output = StoreResult<()>;
        fn with<K: Key + 'static, V: Value + 'static>(
            &mut self,
            def: TableDefinition<'static, K, V>,
        ) -> StoreResult<()> {
            row(self.txn, def, self.key, self.value)
        }
    }
    let mut row = Row { txn, key, value };
    match table {
        LoggedTable::Current(table) => table.visit(&mut row),
        LoggedTable::Retired(retired) => retired.visit(&mut row),
    }
}

/// Checks a stored width before redb reads it (its fixed-width keys and
/// values assume theirs).
fn width_fits<T: Key>(bytes: &[u8]) -> StoreResult<()> {
    match T::fixed_width() {
        Some(w) if w != bytes.len() => Err(StoreError::corrupt(
            "a redo record's row does not have its table's width",
        )),
        _ => Ok(()),
    }
}

fn value_width_fits<T: Value>(bytes: &[u8]) -> StoreResult<()> {
    match T::fixed_width() {
        Some(w) if w != bytes.len() => Err(StoreError::corrupt(
            "a redo record's row does not have its table's width",
        )),
        _ => Ok(()),
    }
}

fn row<K: Key + 'static, V: Value + 'static>(
    txn: &WriteTransaction,
    def: TableDefinition<K, V>,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
) -> StoreResult<()> {
    let Some(key) = key else {
        txn.delete_table(def)?;
        txn.open_table(def)?;
        return Ok(());
    };
    width_fits::<K>(key)?;
    let mut t = txn.open_table(def)?;
    match value {
        Some(value) => {
            value_width_fits::<V>(value)?;
            t.insert(K::from_bytes(key), V::from_bytes(value))?;
        }
        None => {
            t.remove(K::from_bytes(key))?;
        }
    }
    Ok(())
}

/// One row operation of a batch, as a store in PostgreSQL takes it
/// (`upstream.rs`): redb's own key and value bytes, by table name.
pub(super) enum RowOp<'a> {
    Insert(&'a str, &'a [u8], &'a [u8]),
    Remove(&'a str, &'a [u8]),
    Clear(&'a str),
}

/// The operations of a batch's rows (`RecordBuf::rows`), in order.
pub(super) fn row_ops(rows: &[u8]) -> StoreResult<Vec<RowOp<'_>>> {
    let mut c = Cursor { bytes: rows };
    let mut out = Vec::new();
    while !c.bytes.is_empty() {
        let name_len = c.take(1)?[0] as usize;
        let name = std::str::from_utf8(c.take(name_len)?)
            .map_err(|_| StoreError::corrupt("a row names a table that is not UTF-8"))?;
        let op = c.take(1)?[0];
        out.push(match op {
            OP_INSERT => RowOp::Insert(name, c.sized()?, c.sized()?),
            OP_REMOVE => RowOp::Remove(name, c.sized()?),
            OP_CLEAR => RowOp::Clear(name),
            _ => {
                return Err(StoreError::corrupt(
                    "a batch holds an unknown row operation",
                ))
            }
        });
    }
    Ok(out)
}

/// Writes one row (redb's bytes) into `table` of `txn`: a store in
/// PostgreSQL loading its rows into the replica's file.
pub(super) fn put_raw(
    txn: &WriteTransaction,
    table: Table,
    key: &[u8],
    value: &[u8],
) -> StoreResult<()> {
    apply(txn, LoggedTable::Current(table), Some(key), Some(value))
}

/// Every row of `table` as redb's bytes.
pub(super) fn raw_rows(rx: &super::Rx, table: Table) -> StoreResult<Vec<(Vec<u8>, Vec<u8>)>> {
    struct Rows<'t>(&'t super::Rx);
    impl EachTable for Rows<'_> {
        type Output = StoreResult<Vec<(Vec<u8>, Vec<u8>)>>;
        fn with<K: Key + 'static, V: Value + 'static>(
            &mut self,
            def: TableDefinition<'static, K, V>,
        ) -> Self::Output {
            let t = self.0.rows(def)?;
            let mut out = Vec::new();
            for entry in t.iter()? {
                let (k, v) = entry?;
                let key = K::as_bytes(&k.value()).as_ref().to_vec();
                let row = V::as_bytes(&v.value()).as_ref().to_vec();
                out.push((key, row));
            }
            Ok(out)
        }
    }
    table.visit(&mut Rows(rx))
}

/// Reads the file for tests.
#[cfg(test)]
pub(super) fn records_in(path: &Path) -> usize {
    read_records(path, Trust::Unverified)
        .map(|r| r.valid.len())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh(tag: &str) -> (PathBuf, PathBuf) {
        let dir = std::env::temp_dir().join(format!("berth-redo-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store = dir.join("berth.redb");
        (dir, store)
    }

    const LAYOUT: u32 = crate::store::LAYOUT_VERSION;

    /// A new log beside `store`, generation 1, this berth's layout.
    fn new_log(store: &Path) -> RedoLog {
        new_log_of(store, LAYOUT)
    }

    /// A new log beside `store`, generation 1, written at `layout`.
    fn new_log_of(store: &Path, layout: u32) -> RedoLog {
        let at = Resume {
            generation: 1,
            end: 0,
            key: None,
        };
        RedoLog::open(&path_of(store), at, layout, CHECKPOINT_INTERVAL).unwrap()
    }

    fn record_of(ops: Ops) -> RecordBuf {
        record_of_rows(&ops.into_bytes())
    }

    /// A record holding `rows` (encoded redo ops), made as the writer makes one.
    fn record_of_rows(rows: &[u8]) -> RecordBuf {
        let mut record = RecordBuf::default();
        record.start();
        let mut lent = record.lend();
        lent.bytes.extend_from_slice(rows);
        record.take_back(lent);
        record
    }

    /// A refused record whose header the disk would not let berth void is
    /// voided before anything is written behind it: until it is, every
    /// write is refused, so a replay can never reach the refused rows.
    #[cfg(feature = "failpoints")]
    #[test]
    fn a_record_that_could_not_be_voided_is_voided_before_the_next_write() {
        let (dir, store) = fresh("unvoided");
        let mut log = new_log(&store);
        let record = |byte: u8| {
            let mut ops = Ops::default();
            ops.insert(Table::Meta, b"k", &[byte]);
            record_of(ops)
        };
        let refused = log.append(&mut record(1), Urgency::May).unwrap();
        // Refused after its write (its sync failed, say), as `append` does.
        fail::cfg("redo.void", "2*return").unwrap();
        log.void_or_remember(refused);
        log.rewind(refused);
        assert_eq!(log.unvoided, [refused]);
        let e = log.write(&mut record(2), Urgency::May).unwrap_err();
        assert!(e.to_string().contains("redo.void"), "{e}");
        assert_eq!(
            records_in(&path_of(&store)),
            1,
            "the refused one is still there"
        );
        let next = log.append(&mut record(3), Urgency::May).unwrap();
        fail::remove("redo.void");
        assert!(log.unvoided.is_empty());
        assert_eq!(next, refused, "written where the refused one was");
        assert_eq!(records_in(&path_of(&store)), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_torn_or_foreign_tail_ends_the_records_and_the_rest_is_read_back() {
        let (dir, store) = fresh("tail");
        let mut log = new_log(&store);
        let mut starts = Vec::new();
        for i in 0..3u8 {
            let mut ops = Ops::default();
            ops.insert(Table::Meta, b"k", &[i]);
            starts.push(log.append(&mut record_of(ops), Urgency::May).unwrap());
        }
        assert_eq!(records_in(&path_of(&store)), 3);
        // Each on a block of its own, the first at the log's start.
        assert_eq!(starts, [0, 4096, 8192]);
        // A torn tail: half of a fourth record.
        let whole = log.bytes();
        let mut ops = Ops::default();
        ops.insert(Table::Meta, b"k", &[9; 100]);
        log.append(&mut record_of(ops), Urgency::May).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(path_of(&store))
            .unwrap();
        f.set_len(whole + 40).unwrap();
        assert_eq!(records_in(&path_of(&store)), 3);
        // A flipped byte in the third record's rows: two are left.
        let mut bytes = std::fs::read(path_of(&store)).unwrap();
        let third = starts[2] as usize + HEADER + 3;
        bytes[third] ^= 0xff;
        std::fs::write(path_of(&store), &bytes).unwrap();
        assert_eq!(records_in(&path_of(&store)), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn meta_of(db: &Database, key: &str) -> Option<Vec<u8>> {
        let txn = redb::ReadableDatabase::begin_read(db).unwrap();
        let meta = txn.open_table(META).unwrap();
        meta.get(key).unwrap().map(|v| v.value().to_vec())
    }

    fn exclusive(path: &Path) -> Database {
        Database::builder()
            .set_concurrency_mode(redb::ConcurrencyMode::ExclusiveWriter)
            .create(path)
            .unwrap()
    }

    /// A new store held alone at `path`, its `meta` table made.
    fn exclusive_with_meta(path: &Path) -> Database {
        let db = exclusive(path);
        let txn = db.begin_write().unwrap();
        txn.open_table(META).unwrap();
        txn.commit().unwrap();
        db
    }

    /// The store and its log copied as they are on disk while `db` is
    /// still open (a clean drop would make its commits durable), as a
    /// crash leaves them; `db` is then dropped and the copy opened.
    fn crashed_copy(dir: &Path, store: &Path, db: Database) -> (PathBuf, Database) {
        let copy = dir.join("copy");
        std::fs::create_dir_all(&copy).unwrap();
        std::fs::copy(store, copy.join("berth.redb")).unwrap();
        std::fs::copy(path_of(store), path_of(&copy.join("berth.redb"))).unwrap();
        drop(db);
        let store = copy.join("berth.redb");
        let db = exclusive(&store);
        (store, db)
    }

    #[test]
    fn a_replay_that_keeps_the_log_resumes_behind_it_and_a_later_checkpoint_applies_all() {
        let (dir, store) = fresh("keep");
        let db = exclusive_with_meta(&store);
        let mut log = new_log(&store);
        for i in 0..3u8 {
            let mut ops = Ops::default();
            ops.insert(Table::Meta, format!("k{i}").as_bytes(), &[i]);
            log.append(&mut record_of(ops), Urgency::May).unwrap();
        }
        let written = log.bytes();
        // As a reopen after a failed checkpoint does: the rows are back,
        // nothing was made durable, and the log goes on behind them.
        let at = replay(&db, &store, LAYOUT, Replay::KeepLog).unwrap();
        assert_eq!(
            at,
            Resume {
                generation: 1,
                end: written,
                key: None
            }
        );
        assert_eq!(meta_of(&db, "k2"), Some(vec![2]));
        assert_eq!(
            meta_of(&db, GENERATION_KEY),
            None,
            "a kept log records no checkpoint"
        );
        log.resume(at);
        let mut ops = Ops::default();
        ops.insert(Table::Meta, b"k3", &[3]);
        log.append(&mut record_of(ops), Urgency::May).unwrap();
        assert_eq!(records_in(&path_of(&store)), 4);
        // A crash now (the files as they are on disk, copied while the
        // handle is open: a clean drop would make them durable): the file
        // has none of them, and a start applies all four.
        let (store, db) = crashed_copy(&dir, &store, db);
        assert_eq!(
            meta_of(&db, "k0"),
            None,
            "a non-durable commit reached the file"
        );
        let at = replay(&db, &store, LAYOUT, Replay::Checkpoint).unwrap();
        assert_eq!((at.generation, at.end), (2, 0));
        assert!(at.key.is_some(), "a durable replay makes the store's key");
        for i in 0..4u8 {
            assert_eq!(meta_of(&db, &format!("k{i}")), Some(vec![i]));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A record as a berth before blocks wrote it (`PACKED_MAGIC`), to go
    /// right behind the one before.
    fn packed_record(generation: u64, ops: Ops) -> Vec<u8> {
        legacy_record(PACKED_MAGIC, generation, ops)
    }

    /// A record with the short header of a berth before keys.
    fn legacy_record(magic: [u8; 4], generation: u64, ops: Ops) -> Vec<u8> {
        record_bytes(magic, generation, ops, |_, _| None)
    }

    /// A record image of this berth's form, tagged with `key` (zeros
    /// without one), as someone who can put bytes into the log's stale
    /// region would make it.
    fn record_image(magic: [u8; 4], generation: u64, ops: Ops, key: Option<&RedoKey>) -> Vec<u8> {
        record_bytes(magic, generation, ops, |checked, rows| {
            Some(key.map_or([0u8; TAG_BYTES], |k| {
                tag_of(k, rows.len() as u32, checked, rows)
            }))
        })
    }

    /// A record's bytes by hand: header, the tag `tag` gives (none for
    /// the short header), rows.
    fn record_bytes(
        magic: [u8; 4],
        generation: u64,
        ops: Ops,
        tag: impl Fn(&[u8], &[u8]) -> Option<[u8; TAG_BYTES]>,
    ) -> Vec<u8> {
        let rows = ops.into_bytes();
        let mut checked = [0u8; 12];
        checked[..8].copy_from_slice(&generation.to_le_bytes());
        checked[8..].copy_from_slice(&LAYOUT.to_le_bytes());
        let mut crc = crc32fast::Hasher::new();
        crc.update(&checked);
        crc.update(&rows);
        let mut bytes = magic.to_vec();
        bytes.extend_from_slice(&(rows.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&crc.finalize().to_le_bytes());
        bytes.extend_from_slice(&checked);
        if let Some(tag) = tag(&checked, &rows) {
            bytes.extend_from_slice(&tag);
        }
        bytes.extend_from_slice(&rows);
        bytes
    }

    #[test]
    fn a_record_forged_behind_the_last_one_is_applied_only_with_a_tag_made_with_the_stores_key() {
        let (dir, store) = fresh("forged");
        let db = exclusive_with_meta(&store);
        let at = replay(&db, &store, LAYOUT, Replay::Checkpoint).unwrap();
        let key = at.key.expect("a durable replay makes the store's key");
        assert_eq!(
            meta_of(&db, KEY_KEY),
            Some(key.to_vec()),
            "the key is in the file"
        );
        let mut log = RedoLog::open(&path_of(&store), at, LAYOUT, CHECKPOINT_INTERVAL).unwrap();
        log.append(&mut record_of(one_row("k0", 0)), Urgency::May)
            .unwrap();
        // Where the next record would go: a forgery found there is read
        // as the log's next record.
        let behind = log.bytes() as usize;
        let generation = log.generation;
        let forged = || one_row("forged", 1);
        let trials = [
            (
                "an unkeyed record",
                record_image(UNKEYED_MAGIC, generation, forged(), None),
                false,
            ),
            (
                "a packed record",
                legacy_record(PACKED_MAGIC, generation, forged()),
                false,
            ),
            (
                "a keyed record tagged with another key",
                record_image(MAGIC, generation, forged(), Some(&[7u8; 32])),
                false,
            ),
            // The control: the same place and form, the store's key.
            (
                "a record tagged with the store's key",
                record_image(MAGIC, generation, forged(), Some(&key)),
                true,
            ),
        ];
        for (n, (what, image, applied)) in trials.into_iter().enumerate() {
            let copy = dir.join(format!("trial{n}"));
            std::fs::create_dir_all(&copy).unwrap();
            let copied = copy.join("berth.redb");
            std::fs::copy(&store, &copied).unwrap();
            let mut bytes = std::fs::read(path_of(&store)).unwrap();
            bytes[behind..behind + image.len()].copy_from_slice(&image);
            std::fs::write(path_of(&copied), &bytes).unwrap();
            let db = exclusive(&copied);
            replay(&db, &copied, LAYOUT, Replay::Checkpoint).unwrap();
            assert_eq!(meta_of(&db, "k0"), Some(vec![0]), "{what}: the real record");
            assert_eq!(
                meta_of(&db, "forged").is_some(),
                applied,
                "{what}: applied {}",
                !applied
            );
        }
        drop(log);
        drop(db);
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn one_row(key: &str, value: u8) -> Ops {
        let mut ops = Ops::default();
        ops.insert(Table::Meta, key.as_bytes(), &[value]);
        ops
    }

    #[test]
    fn records_an_earlier_berth_packed_and_those_written_on_blocks_behind_them_all_replay() {
        let (dir, store) = fresh("packed");
        let db = exclusive_with_meta(&store);
        // Two records of generation 2 packed by an earlier berth, and right
        // behind them a stale one of generation 1 (the log before it was
        // written from its start again).
        let mut bytes = [
            packed_record(2, one_row("k0", 0)),
            packed_record(2, one_row("k1", 1)),
        ]
        .concat();
        let packed_end = bytes.len() as u64;
        bytes.extend(packed_record(1, one_row("stale", 9)));
        bytes.resize(PREALLOCATED_BYTES as usize, 0);
        std::fs::write(path_of(&store), &bytes).unwrap();
        // This berth opened that log on a full disk, kept it, and goes on
        // behind it: on the next block.
        let at = replay(&db, &store, LAYOUT, Replay::KeepLog).unwrap();
        assert_eq!(
            at,
            Resume {
                generation: 2,
                end: packed_end,
                key: None
            }
        );
        assert_ne!(
            packed_end % 4096,
            0,
            "the packed records end inside a block"
        );
        let mut log = RedoLog::open(&path_of(&store), at, LAYOUT, CHECKPOINT_INTERVAL).unwrap();
        let start = log
            .append(&mut record_of(one_row("k2", 2)), Urgency::May)
            .unwrap();
        assert_eq!(start, blocks::block_start(packed_end));
        log.append(&mut record_of(one_row("k3", 3)), Urgency::May)
            .unwrap();
        assert_eq!(
            records_in(&path_of(&store)),
            4,
            "the stale record is not read"
        );
        // A crash now: a start applies all four, and not the stale one.
        let (store, db) = crashed_copy(&dir, &store, db);
        replay(&db, &store, LAYOUT, Replay::Checkpoint).unwrap();
        for i in 0..4u8 {
            assert_eq!(meta_of(&db, &format!("k{i}")), Some(vec![i]));
        }
        assert_eq!(meta_of(&db, "stale"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Layout 8's `deployment_events` (a table layout 9 removed).
    const EVENTS_AT_8: TableDefinition<(&str, u64), &[u8]> =
        TableDefinition::new("deployment_events");

    /// The row of ("alpha", 7) in layout 8's `deployment_events`.
    fn event_at_8(db: &Database) -> Option<Vec<u8>> {
        let txn = redb::ReadableDatabase::begin_read(db).unwrap();
        let events = txn.open_table(EVENTS_AT_8).unwrap();
        let row = events
            .get(("alpha", 7))
            .unwrap()
            .map(|v| v.value().to_vec());
        row
    }

    /// A store file recording `layout`, with an empty `deployment_events`
    /// of layout 8, and beside it a log written at `log_layout` holding one
    /// insert into that table: ("alpha", 7) -> "row".
    fn a_layout_8_row_in_the_log(
        tag: &str,
        layout: u32,
        log_layout: u32,
    ) -> (PathBuf, PathBuf, Database) {
        let (dir, store) = fresh(tag);
        let db = exclusive(&store);
        let txn = db.begin_write().unwrap();
        txn.open_table(META)
            .unwrap()
            .insert("schema_version", layout.to_le_bytes().as_slice())
            .unwrap();
        txn.open_table(EVENTS_AT_8).unwrap();
        txn.commit().unwrap();
        let mut rows = Vec::new();
        let name = b"deployment_events";
        rows.push(name.len() as u8);
        rows.extend_from_slice(name);
        rows.push(OP_INSERT);
        let key = <(&str, u64)>::as_bytes(&("alpha", 7));
        rows.extend_from_slice(&(key.len() as u32).to_le_bytes());
        rows.extend_from_slice(&key);
        rows.extend_from_slice(&3u32.to_le_bytes());
        rows.extend_from_slice(b"row");
        new_log_of(&store, log_layout)
            .append(&mut record_of_rows(&rows), Urgency::May)
            .unwrap();
        (dir, store, db)
    }

    #[test]
    fn a_log_of_layout_8_is_applied_to_a_file_of_that_layout_before_it_migrates() {
        let before = super::super::layout::OLDEST_LOG_LAYOUT;
        let (dir, store, db) = a_layout_8_row_in_the_log("older", before, before);
        // Not while keeping the log: the migration that follows would
        // make the file durable at a later layout with those rows' generation
        // unrecorded, and a later start would meet them again.
        let e = replay(&db, &store, LAYOUT, Replay::KeepLog).unwrap_err();
        assert_eq!(e.kind, super::super::StoreErrorKind::DiskFull, "{e}");
        assert!(e.to_string().contains("free some space"), "{e}");
        let db = {
            drop(db);
            exclusive(&store)
        };
        assert_eq!(event_at_8(&db), None, "a refused replay wrote its row");
        replay(&db, &store, LAYOUT, Replay::Checkpoint).unwrap();
        assert_eq!(event_at_8(&db), Some(b"row".to_vec()));
        assert!(meta_of(&db, GENERATION_KEY).is_some(), "applied durably");
        drop(db);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A log of layout 9 (the step to 10 changed no table) is applied to a
    /// file of layout 9, which then migrates: the small audit subtree the
    /// log held goes with the step to 10, as those already in the file do.
    #[test]
    fn a_log_of_layout_9_is_applied_before_the_file_moves_to_10() {
        use super::super::tables::MERKLE_NODES;
        let (dir, store) = fresh("layout-9");
        let db = exclusive(&store);
        let txn = db.begin_write().unwrap();
        txn.open_table(META)
            .unwrap()
            .insert("schema_version", 9u32.to_le_bytes().as_slice())
            .unwrap();
        txn.open_table(MERKLE_NODES)
            .unwrap()
            .insert((3u8, 0u64), [3u8; 32].as_slice())
            .unwrap();
        txn.commit().unwrap();
        let mut ops = Ops::default();
        ops.insert(
            Table::MerkleNodes,
            &<(u8, u64)>::as_bytes(&(0u8, 5u64)),
            &[0; 32],
        );
        ops.insert(Table::Meta, b"from-the-log", &[9]);
        new_log_of(&store, 9)
            .append(&mut record_of(ops), Urgency::May)
            .unwrap();
        replay(&db, &store, LAYOUT, Replay::Checkpoint).unwrap();
        assert_eq!(meta_of(&db, "from-the-log"), Some(vec![9]), "applied");
        let nodes = |db: &Database| -> Vec<(u8, u64)> {
            let txn = redb::ReadableDatabase::begin_read(db).unwrap();
            let table = txn.open_table(MERKLE_NODES).unwrap();
            let keys = table
                .iter()
                .unwrap()
                .map(|e| e.unwrap().0.value())
                .collect();
            keys
        };
        assert_eq!(nodes(&db), [(0, 5), (3, 0)], "the log's row is in the file");
        super::super::layout::open_layout(&db).unwrap();
        assert_eq!(nodes(&db), [(3, 0)], "the step to 10 kept a small subtree");
        assert_eq!(
            meta_of(&db, "schema_version"),
            Some(LAYOUT.to_le_bytes().to_vec())
        );
        drop(db);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_log_of_another_layout_than_its_file_or_an_older_one_is_refused_and_changes_nothing() {
        // Layout 8's rows beside a file already at this layout, and a log
        // of 7 (no berth of 7 wrote one; the check does not depend on that).
        let before = super::super::layout::OLDEST_LOG_LAYOUT;
        for (tag, file, log) in [("newer-file", LAYOUT, before), ("seven", 7, 7)] {
            let (dir, store, db) = a_layout_8_row_in_the_log(tag, file, log);
            let e = replay(&db, &store, LAYOUT, Replay::Checkpoint).unwrap_err();
            assert!(
                e.to_string().contains("run the berth that wrote it once"),
                "{e}"
            );
            assert_eq!(
                meta_of(&db, GENERATION_KEY),
                None,
                "{tag}: a checkpoint was recorded"
            );
            assert_eq!(
                event_at_8(&db),
                None,
                "{tag}: a refused replay wrote its row"
            );
            drop(db);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    #[test]
    fn a_record_past_the_logs_limit_is_refused_as_a_full_disk_and_writes_nothing() {
        let (dir, store) = fresh("limit");
        let mut log = new_log(&store);
        // As if checkpoints had failed until the log was nearly at its limit.
        log.end = MAX_LOG_BYTES - 64;
        let mut ops = Ops::default();
        ops.insert(Table::Meta, b"k", &[0; 64]);
        let e = log.append(&mut record_of(ops), Urgency::May).unwrap_err();
        assert_eq!(e.kind, super::super::StoreErrorKind::DiskFull, "{e}");
        assert_eq!(log.bytes(), MAX_LOG_BYTES - 64);
        assert!(std::fs::metadata(path_of(&store)).unwrap().len() <= PREALLOCATED_BYTES);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
