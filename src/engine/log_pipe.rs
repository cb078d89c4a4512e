//! A running build's log: lines numbered, published live, and committed in
//! zstd chunks beside the line path (`LogPipe`); the buffer of lines not yet
//! committed and the `--max-log-bytes` cap (`LogBuffer`); one chunk
//! (`Chunk`).
//!
//! How a line travels: `runner::read_lines` splits the deployer's output at
//! LF, CRLF, a lone CR or 64 KiB and sends each read's lines as one batch
//! (`runner::Lines`: one buffer). `LogPipe` gives each line the next seq of
//! the build channel, holds it in `LogBuffer` for the next chunk, encodes
//! its SSE text into one buffer per read (`events::LogLines`: each frame is
//! a slice of it) and publishes the read's lines at once. Every 100 ms or
//! 1 MiB a chunk is compressed on the blocking pool and committed beside the
//! line path: up to `MAX_FLUSHES_IN_FLIGHT` at once, so one compresses while
//! the one before it commits, but each commits only after the one before it
//! landed (never a gap in `log_index`). A chunk's commit also moves the seq
//! reservation (`seq_reserved`, 64 Ki ahead), so a crash never makes berth
//! reuse an id it sent; the hub keeps sent-but-uncommitted lines (`pending`)
//! until their commit lands (`Hub::committed`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use super::Engine;
use crate::events::{self, SEQ_BLOCK};
use crate::model::*;
use crate::store::Lookup;
use crate::store::{logs, ChunkPlace, StoreError, StoreErrorKind, StoreResult};

/// A log chunk is committed at least this often while lines arrive.
pub const LOG_FLUSH_INTERVAL: Duration = Duration::from_millis(100);
/// ... or when this many uncompressed bytes are waiting.
pub const LOG_CHUNK_BYTES: usize = 1024 * 1024;
/// Batches (one per read, at most 64 KiB each) buffered between the pipe
/// readers and the log writer: at most 4 MiB; past it the deployer waits.
pub(super) const LINE_QUEUE: usize = 64;
/// Chunks between the line path and the store at once: one compressing
/// while the one before it commits. Commits stay in chunk order (each waits
/// for the one before it to land); past this the deployer waits.
pub(super) const MAX_FLUSHES_IN_FLIGHT: usize = 2;

/// The path of a running build's output: each line gets its seq, goes to
/// live subscribers at once (the lines of one read as one batch), and is
/// committed in zstd chunks. A chunk's commit runs beside the line path,
/// so a slow fsync never holds a live line back; ids are reserved in the
/// store well ahead of use, so that wait is rare too.
pub(super) struct LogPipe {
    store: crate::store::Store,
    hub: Arc<events::Hub>,
    build_id: BuildId,
    pub(super) log: LogBuffer,
    /// Lines of the current read, encoded, not yet published.
    held: events::LogLines,
    /// Chunk flushes started and not yet reported on `done_rx`.
    pub(super) in_flight: usize,
    /// Whether the last started flush landed: the next one commits only
    /// after it, and not at all when it did not (a gap in the chunk index).
    last_landed: Option<tokio::sync::oneshot::Receiver<bool>>,
    done_tx: mpsc::Sender<Result<u64, crate::store::StoreError>>,
    pub(super) done_rx: mpsc::Receiver<Result<u64, crate::store::StoreError>>,
    pub(super) disk_failure: Option<FailureReason>,
    stop: watch::Sender<bool>,
}

impl LogPipe {
    pub(super) fn new(
        engine: &Engine,
        build_id: BuildId,
        log: LogBuffer,
        stop: watch::Sender<bool>,
    ) -> LogPipe {
        let (done_tx, done_rx) = mpsc::channel(MAX_FLUSHES_IN_FLIGHT);
        LogPipe {
            store: engine.store.clone(),
            hub: engine.hub.clone(),
            build_id,
            log,
            held: events::LogLines::default(),
            in_flight: 0,
            last_landed: None,
            done_tx,
            done_rx,
            disk_failure: None,
            stop,
        }
    }

    /// The lines of one read, published together as one batch. (A client
    /// that falls behind drains several batches per write by itself; holding
    /// lines back on a timer was measured to add latency and save nothing.)
    pub(super) async fn lines(&mut self, batch: super::runner::Lines) {
        for line in batch.iter() {
            self.line(line).await;
        }
        self.publish_held();
    }

    async fn line(&mut self, line: &str) {
        if self.disk_failure.is_some() {
            // Lines are still read (so the deployer is not blocked) and counted.
            self.log.push(line);
            self.log.discard_pending();
            return;
        }
        // Never send an id that is not reserved in the store.
        if self.log.next_seq > self.log.reserved {
            self.publish_held();
            self.wait_all().await;
            self.start_flush();
            self.wait_all().await;
        }
        if let Some(seq) = self.log.push(line) {
            self.held.push(seq, line);
        }
        if self.log.pending.len() >= LOG_CHUNK_BYTES {
            self.publish_held();
            // A bounded number of flushes in flight: a disk slower than the
            // deployer slows the deployer (its pipe fills), never loses a line.
            self.wait_for_room().await;
            self.start_flush();
        }
    }

    fn publish_held(&mut self) {
        self.hub.publish_log_lines(self.build_id, &mut self.held);
    }

    /// Starts committing the waiting lines (and a reservation ahead).
    pub(super) fn start_flush(&mut self) {
        debug_assert!(
            self.in_flight < MAX_FLUSHES_IN_FLIGHT,
            "more chunk flushes in flight than allowed"
        );
        let chunk = self.log.take_chunk();
        let reserve = self.log.next_seq.saturating_sub(1) + SEQ_BLOCK;
        let (store, hub, build_id, done) = (
            self.store.clone(),
            self.hub.clone(),
            self.build_id,
            self.done_tx.clone(),
        );
        self.in_flight += 1;
        let after = self.last_landed.take();
        let (landed, landed_rx) = tokio::sync::oneshot::channel();
        self.last_landed = Some(landed_rx);
        tokio::spawn(async move {
            // zstd runs on the blocking pool, off the line path.
            let chunk = match chunk {
                Some(c) => match tokio::task::spawn_blocking(move || c.compress()).await {
                    Ok(Ok(c)) => Some(c),
                    Ok(Err(e)) => {
                        let _ = done.send(Err(e)).await;
                        return;
                    }
                    Err(_) => {
                        let e = StoreError::other("the log compression task stopped");
                        let _ = done.send(Err(e)).await;
                        return;
                    }
                },
                None => None,
            };
            // Commits in chunk order; never past a chunk that did not land.
            if let Some(after) = after {
                if after.await != Ok(true) {
                    let e = StoreError::other("an earlier log chunk was not stored");
                    let _ = done.send(Err(e)).await;
                    return;
                }
            }
            let result = store
                .write(move |tx| {
                    let Some(mut b) = tx.build(build_id)? else {
                        return Ok(reserve);
                    };
                    if let Some(chunk) = &chunk {
                        chunk.store(tx, &mut b)?;
                        b.event_seq = chunk.last_seq;
                        let last = chunk.last_seq;
                        let hub = hub.clone();
                        tx.after_commit(move || hub.committed(build_id, last));
                    }
                    b.seq_reserved = b.seq_reserved.max(reserve);
                    tx.put_build(&b)?;
                    Ok(reserve)
                })
                .await;
            let stored = result.is_ok();
            let _ = done.send(result).await;
            let _ = landed.send(stored);
        });
    }

    pub(super) fn flush_done(&mut self, result: Result<u64, crate::store::StoreError>) {
        debug_assert!(self.in_flight > 0, "a flush reported twice");
        self.in_flight = self.in_flight.saturating_sub(1);
        match result {
            Ok(reserve) => self.log.reserved = self.log.reserved.max(reserve),
            // The first failure is the reason; a chunk after it reports
            // only that it could not follow.
            Err(_) if self.disk_failure.is_some() => {}
            Err(e) => {
                let reason = if e.kind == StoreErrorKind::DiskFull {
                    FailureReason::DiskFull
                } else {
                    FailureReason::LogWriteFailed
                };
                tracing::error!(error = %e, build = %format_build_id(self.build_id), "cannot store the build log; stopping the build");
                self.disk_failure = Some(reason);
                self.log.discard_pending();
                let _ = self.stop.send(true);
            }
        }
    }

    /// Waits until another flush may start.
    async fn wait_for_room(&mut self) {
        while self.in_flight >= MAX_FLUSHES_IN_FLIGHT {
            self.wait_one().await;
        }
    }

    /// Waits until every started flush has reported.
    /// Commits every pending line now (before an event that takes a seq
    /// after them) and waits for it to land.
    pub(super) async fn commit_pending(&mut self) {
        self.publish_held();
        if !self.log.pending.is_empty() {
            self.wait_all().await;
            self.start_flush();
        }
        self.wait_all().await;
    }

    pub(super) async fn wait_all(&mut self) {
        while self.in_flight > 0 {
            self.wait_one().await;
        }
    }

    async fn wait_one(&mut self) {
        match self.done_rx.recv().await {
            Some(result) => self.flush_done(result),
            // Cannot happen while `self` holds a sender; if it did, waiting
            // again would spin.
            None => self.in_flight = 0,
        }
    }
}

/// Lines waiting to be committed, their seqs, and the counts behind
/// `--max-log-bytes`.
pub struct LogBuffer {
    pub(super) pending: Vec<u8>,
    pending_lines: u64,
    pending_first_seq: u64,
    /// The line index of the first pending line.
    pending_first_line: u64,
    /// The seq the next stored line gets.
    pub next_seq: u64,
    /// The index in the log the next stored line gets (seqs can skip: a
    /// `health` event takes one, `take_gap`).
    next_line: u64,
    /// `BuildRecord::log_gaps` as this buffer handed them out; every commit
    /// of the build record stores them.
    pub(super) gaps: Vec<u64>,
    /// Seqs up to this are reserved in the store.
    pub reserved: u64,
    next_chunk: u32,
    pub(super) stored_bytes: u64,
    max_bytes: u64,
    pub(super) dropped_lines: u64,
    pub(super) dropped_bytes: u64,
}

/// Lines cut for one commit; `compressed` holds the raw text until
/// `compress` runs (off the line path).
pub struct Chunk {
    number: u32,
    /// The log's gaps when the chunk was cut (stored with it).
    gaps: Vec<u64>,
    /// Index of the chunk's first line in the build's log.
    first_line: u64,
    last_seq: u64,
    compressed: Vec<u8>,
    bytes: u64,
    lines: u64,
}

impl LogBuffer {
    pub fn new(max_bytes: u64, first_seq: u64, reserved: u64) -> Self {
        LogBuffer {
            pending: Vec::new(),
            pending_lines: 0,
            pending_first_seq: first_seq,
            pending_first_line: 0,
            next_seq: first_seq,
            next_line: 0,
            gaps: Vec::new(),
            reserved,
            next_chunk: 0,
            stored_bytes: 0,
            max_bytes,
            dropped_lines: 0,
            dropped_bytes: 0,
        }
    }

    /// The buffer of a build whose every line is committed (a worker's
    /// build, whose lines are stored before they are published): the next
    /// seq follows the last committed event.
    pub fn resume(b: &BuildRecord, max_bytes: u64, dropped_lines: u64) -> Self {
        let mut log = LogBuffer::new(max_bytes, b.event_seq + 1, u64::MAX);
        log.pending_first_line = b.log_lines;
        log.next_line = b.log_lines;
        log.gaps = b.log_gaps.clone();
        log.next_chunk = b.log_chunks;
        log.stored_bytes = b.log_bytes;
        log.dropped_lines = dropped_lines;
        log
    }

    /// The buffer of a build of the embedded worker that goes on after a
    /// restart (a rollout): as `resume`, with lines published before
    /// they commit, so within the reservation.
    pub fn after_restart(b: &BuildRecord, max_bytes: u64) -> Self {
        let mut log = LogBuffer::resume(b, max_bytes, 0);
        log.reserved = b.seq_reserved;
        log
    }

    /// Adds a line and returns its seq, or counts it as dropped (no seq)
    /// past `--max-log-bytes`.
    pub fn push(&mut self, line: &str) -> Option<u64> {
        let size = line.len() as u64 + 1;
        if self.dropped_lines > 0 || self.stored_bytes + size > self.max_bytes {
            self.dropped_lines += 1;
            self.dropped_bytes += size;
            return None;
        }
        Some(self.force_push(line))
    }

    pub(super) fn force_push(&mut self, line: &str) -> u64 {
        if self.pending_lines == 0 {
            self.pending_first_seq = self.next_seq;
            self.pending_first_line = self.next_line;
        }
        self.next_line += 1;
        self.pending.extend_from_slice(line.as_bytes());
        self.pending.push(b'\n');
        self.pending_lines += 1;
        self.stored_bytes += line.len() as u64 + 1;
        self.next_seq += 1;
        self.next_seq - 1
    }

    /// Forgets lines that cannot be stored (their seqs stay used).
    pub(super) fn discard_pending(&mut self) {
        self.pending.clear();
        self.pending_lines = 0;
    }

    /// A seq for an event that is not a log line (a `health` event); the
    /// line index it comes before joins `gaps`. Returns the seq and every
    /// gap so far (what the build record stores). Only with no line
    /// pending: a chunk's lines have consecutive seqs.
    pub(super) fn take_gap(&mut self) -> (u64, Vec<u64>) {
        assert!(
            self.pending.is_empty(),
            "a gap in the seqs of pending lines"
        );
        assert!(
            self.gaps.len() < MAX_LOG_GAPS,
            "more log gaps than MAX_LOG_GAPS"
        );
        let seq = self.next_seq;
        self.next_seq += 1;
        self.gaps.push(self.next_line);
        (seq, self.gaps.clone())
    }

    pub(super) fn take_chunk(&mut self) -> Option<Chunk> {
        if self.pending.is_empty() {
            return None;
        }
        // The next chunk of a busy log is about as large as this one: room
        // for it up front spares ~20 regrowths of a 1 MiB buffer.
        let room = self.pending.len();
        let raw = std::mem::replace(&mut self.pending, Vec::with_capacity(room));
        let chunk = Chunk {
            number: self.next_chunk,
            gaps: self.gaps.clone(),
            first_line: self.pending_first_line,
            last_seq: self.pending_first_seq + self.pending_lines - 1,
            bytes: raw.len() as u64,
            compressed: raw,
            lines: self.pending_lines,
        };
        self.next_chunk += 1;
        self.pending_lines = 0;
        Some(chunk)
    }
}

impl Chunk {
    /// Writes the chunk and counts it in the build record (the caller stores
    /// the record).
    pub(super) fn store(
        &self,
        tx: &crate::store::Tx,
        b: &mut BuildRecord,
    ) -> crate::store::StoreResult<()> {
        let place = ChunkPlace {
            number: self.number,
            first_line: self.first_line,
            first_byte: b.log_bytes,
            raw_len: self.bytes,
        };
        tx.put_log_chunk(b.id, &place, &self.compressed)?;
        if b.log_gaps.len() < self.gaps.len() {
            b.log_gaps = self.gaps.clone();
        }
        b.log_bytes += self.bytes;
        b.log_lines += self.lines;
        b.log_chunks = self.number + 1;
        Ok(())
    }

    pub(super) fn compress(mut self) -> StoreResult<Chunk> {
        self.compressed = logs::compress_chunk(&self.compressed)?;
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_cap_counts_dropped_lines() {
        let mut log = LogBuffer::new(10, 3, 100);
        assert_eq!(log.push("12345"), Some(3)); // 6 bytes
        assert_eq!(log.push("1234"), None); // 5 bytes: over
        assert_eq!(log.push("1"), None); // dropped too, once dropping started
        assert_eq!((log.dropped_lines, log.dropped_bytes), (2, 7));
        let chunk = log.take_chunk().unwrap().compress().unwrap();
        assert_eq!((chunk.first_line, chunk.last_seq), (0, 3));
        assert_eq!(
            logs::decompress_chunks(&[(0, chunk.compressed)]).unwrap(),
            b"12345\n"
        );
        assert!(log.take_chunk().is_none());
        assert_eq!(log.force_push("notice"), 4);
        assert_eq!(log.take_chunk().unwrap().first_line, 1);
    }
}
