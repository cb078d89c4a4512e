//! One SSE stream: replay from the store after the client's cursor, then
//! live events from the hub, with keep-alives, periodic re-authorization,
//! catch-up after falling behind, and a clean end.
//!
//! A producer task writes SSE text into a small bounded channel that is the
//! HTTP body; when the client goes away the channel closes and the task ends
//! at once, freeing its hub slot.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{Channel, Frame, Hub};
use crate::engine::builds::decompress_chunk;
use crate::engine::Engine;
use crate::model::BuildId;

/// Silence after which a `: keep-alive` comment is sent.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// How often an open stream's credential is checked again.
pub const REAUTHORIZE_EVERY: Duration = Duration::from_secs(30);
/// Bytes gathered into one write to the client at most.
const MAX_WRITE: usize = 64 * 1024;
/// Writes queued towards the client before the producer waits.
const BODY_QUEUE: usize = 8;
/// Deployment events read from the store per page of a replay.
const REPLAY_PAGE: usize = 1000;

/// Checks, again and again, that the stream's credential is still good.
pub type Reauthorize = Box<dyn Fn() -> bool + Send + Sync>;

/// Holds one `--max-sse-clients` slot until dropped.
pub struct ClientSlot(Arc<Hub>);

impl ClientSlot {
    pub fn take(hub: &Arc<Hub>, max: usize) -> Option<ClientSlot> {
        let prev = hub.clients.fetch_add(1, Ordering::SeqCst);
        if prev >= max {
            hub.clients.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(ClientSlot(hub.clone()))
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        self.0.clients.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Why a stream stopped early.
enum Stop {
    Closed,
}

struct Writer {
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
    buf: Vec<u8>,
    last_write: Instant,
}

impl Writer {
    fn push(&mut self, frame: &Frame) {
        frame.encode_into(&mut self.buf);
    }
    fn raw(&mut self, text: &str) {
        self.buf.extend_from_slice(text.as_bytes());
    }
    async fn flush(&mut self) -> Result<(), Stop> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let bytes = Bytes::from(std::mem::take(&mut self.buf));
        self.tx.send(Ok(bytes)).await.map_err(|_| Stop::Closed)?;
        self.last_write = Instant::now();
        Ok(())
    }
    async fn flush_if_full(&mut self) -> Result<(), Stop> {
        if self.buf.len() >= MAX_WRITE {
            self.flush().await?;
        }
        Ok(())
    }
}

fn resync(reason: &str) -> String {
    format!("event: resync_required\ndata: {{\"reason\":\"{reason}\"}}\n\n")
}

/// Starts a producer; returns the body stream for the HTTP response.
pub fn spawn(
    engine: Arc<Engine>,
    channel: Channel,
    cursor: Option<String>,
    reauthorize: Reauthorize,
    slot: ClientSlot,
) -> tokio_stream::wrappers::ReceiverStream<Result<Bytes, Infallible>> {
    let (tx, rx) = mpsc::channel(BODY_QUEUE);
    tokio::spawn(async move {
        let _slot = slot;
        let mut w = Writer {
            tx,
            buf: Vec::new(),
            last_write: Instant::now(),
        };
        w.raw("retry: 2000\n\n");
        let _ = match channel {
            Channel::Build(id) => build_stream(&engine, id, cursor, &reauthorize, &mut w).await,
            Channel::Deployment(ref id) => {
                deployment_stream(&engine, id, cursor, &reauthorize, &mut w).await
            }
        };
        let _ = w.flush().await;
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Waits for the next live frame, keeping the stream alive and authorized.
/// `Ok(None)`: the hub dropped this subscriber (it fell behind): catch up.
async fn next_live(
    engine: &Engine,
    rx: &mut mpsc::Receiver<Arc<Frame>>,
    w: &mut Writer,
    reauthorize: &Reauthorize,
    next_check: &mut Instant,
) -> Result<Option<Arc<Frame>>, Stop> {
    let mut stopping = engine.stop_signal();
    loop {
        if *stopping.borrow() {
            return Err(Stop::Closed);
        }
        let keep_alive_at = w.last_write + KEEP_ALIVE;
        tokio::select! {
            frame = rx.recv() => return Ok(frame),
            _ = tokio::time::sleep_until(keep_alive_at) => {
                w.raw(": keep-alive\n\n");
                w.flush().await?;
            }
            _ = tokio::time::sleep_until(*next_check) => {
                if !reauthorize() {
                    return Err(Stop::Closed);
                }
                *next_check = Instant::now() + REAUTHORIZE_EVERY;
            }
            _ = stopping.changed() => return Err(Stop::Closed),
            _ = w.tx.closed() => return Err(Stop::Closed),
        }
    }
}

/// The build channel: status events and log lines share one seq.
async fn build_stream(
    engine: &Arc<Engine>,
    id: BuildId,
    cursor: Option<String>,
    reauthorize: &Reauthorize,
    w: &mut Writer,
) -> Result<(), Stop> {
    let mut last = 0u64;
    if let Some(text) = cursor {
        let current = {
            let committed = engine
                .store
                .read()
                .ok()
                .and_then(|rx| rx.build(id).ok().flatten())
                .map(|b| b.event_seq)
                .unwrap_or(0);
            committed.max(engine.hub.pending_max(id).unwrap_or(0))
        };
        match text.trim().parse::<u64>() {
            Ok(n) if n <= current => last = n,
            _ => w.raw(&resync("cursor_invalid")),
        }
    }
    let mut next_check = Instant::now() + REAUTHORIZE_EVERY;
    loop {
        let (mut rx, pending) = engine.hub.subscribe(&Channel::Build(id));
        if let Some(final_frame) = replay_build(engine, id, &mut last, w).await? {
            return end(w, &final_frame).await;
        }
        for f in pending {
            if f.seq > last {
                last = f.seq;
                w.push(&f);
                w.flush_if_full().await?;
            }
        }
        w.flush().await?;
        loop {
            let Some(frame) = next_live(engine, &mut rx, w, reauthorize, &mut next_check).await?
            else {
                tracing::debug!(build = %crate::model::format_build_id(id), "subscriber fell behind; catching up from the store");
                break;
            };
            let mut batch = vec![frame];
            while batch.len() < 1024 {
                match rx.try_recv() {
                    Ok(f) => batch.push(f),
                    Err(_) => break,
                }
            }
            for f in batch {
                if f.seq <= last {
                    continue;
                }
                last = f.seq;
                w.push(&f);
                if f.last {
                    return end(w, &f).await;
                }
            }
            w.flush().await?;
        }
    }
}

async fn end(w: &mut Writer, final_status: &Frame) -> Result<(), Stop> {
    w.raw(&format!("event: end\ndata: {}\n\n", final_status.data));
    w.flush().await
}

/// Sends every stored event of the build after `last`, merged by seq;
/// returns the final status frame if the build has finished.
async fn replay_build(
    engine: &Arc<Engine>,
    id: BuildId,
    last: &mut u64,
    w: &mut Writer,
) -> Result<Option<Arc<Frame>>, Stop> {
    let store = engine.store.clone();
    let loaded = tokio::task::spawn_blocking(move || -> Option<_> {
        let rx = store.read().ok()?;
        let b = rx.build(id).ok()??;
        Some((b, rx.build_events(id).ok()?, rx.log_chunks(id).ok()?))
    })
    .await
    .ok()
    .flatten();
    let Some((build, statuses, chunks)) = loaded else {
        return Ok(None);
    };
    let mut statuses = statuses.into_iter().peekable();
    let mut final_frame = None;
    let mut emit_status_before = |seq_limit: u64, w: &mut Writer, last: &mut u64| {
        while let Some((seq, _)) = statuses.peek() {
            if *seq >= seq_limit {
                break;
            }
            let (seq, e) = statuses.next().expect("peeked");
            let is_final = seq == build.event_seq && build.status.is_finished();
            let frame = Frame::new(seq, "status", e.data, is_final);
            if seq > *last {
                *last = seq;
                w.push(&frame);
            }
            if is_final {
                final_frame = Some(frame);
            }
        }
    };
    for (first_line, compressed) in chunks {
        let text = decompress_chunk(&compressed);
        // Every stored line ends with a newline.
        let body = text.strip_suffix(b"\n").unwrap_or(&text);
        let first_seq = build.log_first_seq + first_line;
        for (seq, line) in (first_seq..).zip(body.split(|&b| b == b'\n')) {
            emit_status_before(seq, w, last);
            if seq > *last {
                *last = seq;
                w.push(&Frame {
                    seq,
                    event: "log",
                    data: String::from_utf8_lossy(line).into_owned(),
                    last: false,
                });
            }
            w.flush_if_full().await?;
        }
    }
    emit_status_before(u64::MAX, w, last);
    w.flush().await?;
    Ok(final_frame)
}

/// The deployment channel: state events only, never ends by itself.
async fn deployment_stream(
    engine: &Arc<Engine>,
    id: &str,
    cursor: Option<String>,
    reauthorize: &Reauthorize,
    w: &mut Writer,
) -> Result<(), Stop> {
    let channel = Channel::Deployment(id.to_string());
    let (mut rx, _) = engine.hub.subscribe(&channel);
    let (current, summary) = {
        let rx = engine.store.read().ok();
        let d = rx.as_ref().and_then(|r| r.deployment(id).ok().flatten());
        let summary = d.as_ref().map(|d| {
            let last = d
                .last_build
                .and_then(|b| rx.as_ref()?.build(b).ok().flatten());
            crate::engine::summary(d, last.as_ref())
        });
        (d.map(|d| d.event_seq).unwrap_or(0), summary)
    };
    let mut last = current;
    match cursor {
        None => {
            if let Some(s) = summary {
                w.push(&Frame {
                    seq: current,
                    event: "deployment",
                    data: serde_json::to_string(&s).unwrap_or_default(),
                    last: false,
                });
            }
        }
        Some(text) => match text.trim().parse::<u64>() {
            Ok(n) if n <= current => {
                let first = engine
                    .store
                    .read()
                    .ok()
                    .and_then(|r| r.first_deployment_event(id).ok().flatten());
                if n < current && first.is_some_and(|f| f > n + 1) {
                    w.raw(&resync("cursor_expired"));
                } else {
                    last = n;
                }
            }
            _ => w.raw(&resync("cursor_invalid")),
        },
    }
    let mut next_check = Instant::now() + REAUTHORIZE_EVERY;
    loop {
        // Replay what the store has after `last` (also after falling behind).
        loop {
            let page = engine
                .store
                .read()
                .ok()
                .and_then(|r| r.deployment_events_after(id, last, REPLAY_PAGE).ok())
                .unwrap_or_default();
            let n = page.len();
            if n > 0 && page[0].0 > last + 1 && last > 0 {
                w.raw(&resync("history_unavailable"));
            }
            for (seq, e) in page {
                last = seq;
                let event = if e.event == "build" {
                    "build"
                } else if e.event == "sbom" {
                    "sbom"
                } else {
                    "deployment"
                };
                w.push(&Frame {
                    seq,
                    event,
                    data: e.data,
                    last: false,
                });
                w.flush_if_full().await?;
            }
            if n < REPLAY_PAGE {
                break;
            }
        }
        w.flush().await?;
        loop {
            let Some(frame) = next_live(engine, &mut rx, w, reauthorize, &mut next_check).await?
            else {
                break;
            };
            if frame.seq > last {
                last = frame.seq;
                w.push(&frame);
            }
            while let Ok(f) = rx.try_recv() {
                if f.seq > last {
                    last = f.seq;
                    w.push(&f);
                }
            }
            w.flush().await?;
        }
        let (again, _) = engine.hub.subscribe(&channel);
        rx = again;
    }
}
