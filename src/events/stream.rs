//! One SSE stream: replay from the store after the client's cursor, then
//! live events from the hub, with keep-alives, periodic re-authorization,
//! catch-up after falling behind, and a clean end.
//!
//! A producer task writes replayed SSE text into a small bounded channel
//! that feeds the HTTP body; live events go from the hub's tail to the
//! socket through the fan-out thread (`super::fanout`). When the client goes
//! away the channel closes and the task ends at once, freeing its slot.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::body::{Control, SseBody, MAX_WRITE};
use super::frame::{end_text, resync, Gather};
use super::{BuildEvent, Channel, Frame, Hub, Subscription};
use crate::model::BuildId;
use crate::store::Lookup;
use crate::store::{logs, Reader, StoreError};
use crate::wire::Wire;

/// How often an open stream's credential is checked again.
pub const REAUTHORIZE_EVERY: Duration = Duration::from_secs(30);
/// Writes queued towards the client before the producer waits.
const BODY_QUEUE: usize = 8;
/// Deployment events read from the store per page of a replay.
const REPLAY_PAGE: usize = 1000;

/// Checks, again and again, that the stream's credential is still good.
pub type Reauthorize = Box<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>> + Send + Sync,
>;

/// Holds one `--max-sse-clients` slot until dropped, and whatever else
/// the stream holds for as long as it lives (its caller's share).
pub struct ClientSlot(Arc<Hub>, Option<Box<dyn Send + Sync>>);

impl ClientSlot {
    pub fn take(hub: &Arc<Hub>, max: usize) -> Option<ClientSlot> {
        let prev = hub.clients.fetch_add(1, Ordering::SeqCst);
        if prev >= max {
            hub.clients.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(ClientSlot(hub.clone(), None))
    }

    /// The slot, also holding `share` until the stream ends.
    pub fn with(mut self, share: Box<dyn Send + Sync>) -> ClientSlot {
        self.1 = Some(share);
        self
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        self.0.clients.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Why a stream stopped early.
enum Stop {
    /// The client left, berth is stopping, or the credential was revoked.
    Closed,
    /// The store failed while the stream read it. The stream ends rather
    /// than go on with a gap; the client reconnects with `Last-Event-ID`
    /// and the replay resumes exactly where it stopped.
    StoreFailed,
}

/// What a stream reads: the store, the hub, and berth's stop signal.
#[derive(Clone)]
pub struct Sources {
    pub store: Reader,
    pub hub: Arc<Hub>,
    pub stopping: tokio::sync::watch::Receiver<bool>,
    /// `--sse-keep-alive`.
    pub keep_alive: Duration,
}

/// Logs a store failure of a stream and ends it.
fn store_failed(e: StoreError) -> Stop {
    tracing::warn!(error = %e, "an event stream could not read the store; ending it so the client resumes from its last id");
    Stop::StoreFailed
}

/// Runs a store read off the async workers (a replay decompresses chunks).
async fn read_store<T: Send + 'static>(
    store: &Reader,
    read: impl FnOnce(&crate::store::Rx) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, Stop> {
    let store = store.clone();
    tokio::task::spawn_blocking(move || read(&store.read()?))
        .await
        .map_err(|_| store_failed(StoreError::other("a store read task stopped")))?
        .map_err(store_failed)
}

/// Gathers events in the producer task and hands them to the HTTP body.
struct Writer {
    tx: mpsc::Sender<Control>,
    gather: Gather,
}

impl Writer {
    fn push(&mut self, frame: &Frame) {
        self.gather.push(frame);
    }
    fn raw(&mut self, text: &str) {
        self.gather.raw(text);
    }
    async fn flush(&mut self) -> Result<(), Stop> {
        let Some(bytes) = self.gather.take() else {
            return Ok(());
        };
        self.tx
            .send(Control::Bytes(bytes))
            .await
            .map_err(|_| Stop::Closed)
    }
    async fn flush_if_full(&mut self) -> Result<(), Stop> {
        if self.gather.size >= MAX_WRITE {
            self.flush().await?;
        }
        Ok(())
    }
}

/// Starts a producer; returns the body stream for the HTTP response.
pub fn spawn(
    sources: Sources,
    channel: Channel,
    cursor: Option<String>,
    reauthorize: Reauthorize,
    slot: ClientSlot,
    wire: Option<Arc<Wire>>,
) -> SseBody {
    let (tx, control) = mpsc::channel(BODY_QUEUE);
    let (behind, mut behind_rx) = mpsc::channel(1);
    tokio::spawn(async move {
        let _slot = slot;
        let mut w = Writer {
            tx,
            gather: Gather::default(),
        };
        w.raw("retry: 2000\n\n");
        let _ = match channel {
            Channel::Build(id) => {
                build_stream(&sources, id, cursor, &reauthorize, &mut w, &mut behind_rx).await
            }
            Channel::Deployment(ref id) => {
                deployment_stream(&sources, id, cursor, &reauthorize, &mut w, &mut behind_rx).await
            }
        };
        let _ = w.flush().await;
    });
    SseBody {
        control,
        wire,
        handed: false,
        fanout: None,
        live: None,
        behind,
        batches: Vec::new(),
        finished: false,
    }
}

/// The timers of one stream, made once: re-arming them on every wake-up
/// would cost more than the write itself when a thousand streams tail a build.
struct Timers {
    keep_alive: std::pin::Pin<Box<tokio::time::Sleep>>,
    keep_alive_every: Duration,
    recheck: std::pin::Pin<Box<tokio::time::Sleep>>,
    stopping: tokio::sync::watch::Receiver<bool>,
}

impl Timers {
    fn new(sources: &Sources) -> Timers {
        Timers {
            keep_alive: Box::pin(tokio::time::sleep(sources.keep_alive)),
            keep_alive_every: sources.keep_alive,
            recheck: Box::pin(tokio::time::sleep(REAUTHORIZE_EVERY)),
            stopping: sources.stopping.clone(),
        }
    }
}

/// Hands the subscription to the body (which hands the socket to the
/// fan-out) and then only keeps the stream alive and authorized. Returns the seq to catch up from when the body fell
/// behind; `Err` when the stream is over.
async fn go_live(
    subscription: Subscription,
    last: u64,
    w: &mut Writer,
    reauthorize: &Reauthorize,
    timers: &mut Timers,
    behind: &mut mpsc::Receiver<u64>,
) -> Result<u64, Stop> {
    w.flush().await?;
    w.tx.send(Control::Live { subscription, last })
        .await
        .map_err(|_| Stop::Closed)?;
    loop {
        if *timers.stopping.borrow() {
            return Err(Stop::Closed);
        }
        tokio::select! {
            resume = behind.recv() => return resume.ok_or(Stop::Closed),
            _ = timers.keep_alive.as_mut() => {
                // The body writes live events itself: a comment every
                // interval is harmless, and tells proxies the stream lives.
                w.raw(": keep-alive\n\n");
                w.flush().await?;
                let every = timers.keep_alive_every;
                timers.keep_alive.as_mut().reset(Instant::now() + every);
            }
            _ = timers.recheck.as_mut() => {
                if !reauthorize().await {
                    return Err(Stop::Closed);
                }
                timers.recheck.as_mut().reset(Instant::now() + REAUTHORIZE_EVERY);
            }
            _ = timers.stopping.changed() => return Err(Stop::Closed),
            _ = w.tx.closed() => return Err(Stop::Closed),
        }
    }
}

/// The build channel: status events and log lines share one seq.
async fn build_stream(
    sources: &Sources,
    id: BuildId,
    cursor: Option<String>,
    reauthorize: &Reauthorize,
    w: &mut Writer,
    behind: &mut mpsc::Receiver<u64>,
) -> Result<(), Stop> {
    let mut last = 0u64;
    if let Some(text) = cursor {
        let committed = read_store(&sources.store, move |rx| {
            Ok(rx.build(id)?.map(|b| b.event_seq).unwrap_or(0))
        })
        .await?;
        let current = committed.max(sources.hub.pending_max(id).unwrap_or(0));
        match text.trim().parse::<u64>() {
            Ok(n) if n <= current => last = n,
            _ => w.raw(&resync("cursor_invalid")),
        }
    }
    let mut timers = Timers::new(sources);
    loop {
        let (subscription, pending) = sources.hub.subscribe(&Channel::Build(id));
        if let Some(final_frame) = replay_build(&sources.store, id, &mut last, w).await? {
            return end(w, &final_frame).await;
        }
        for f in pending {
            if f.seq > last {
                last = f.seq;
                w.push(&f);
                w.flush_if_full().await?;
            }
        }
        last = go_live(subscription, last, w, reauthorize, &mut timers, behind).await?;
        sources.hub.catch_ups.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(build = %crate::model::format_build_id(id), last, "subscriber fell behind; catching up from the store");
    }
}

async fn end(w: &mut Writer, final_status: &Frame) -> Result<(), Stop> {
    w.raw(&end_text(final_status));
    w.flush().await
}

/// Sends every stored event of the build after `last`, merged by seq;
/// returns the final status frame if the build has finished.
async fn replay_build(
    store: &Reader,
    id: BuildId,
    last: &mut u64,
    w: &mut Writer,
) -> Result<Option<Arc<Frame>>, Stop> {
    let loaded = load_replay(store, id).await?;
    let Some((build, statuses, places)) = loaded else {
        return Ok(None);
    };
    let plan = chunks_after(&build, &places, *last);
    let mut statuses = statuses.into_iter().peekable();
    let mut final_frame = None;
    let mut emit_status_before = |seq_limit: u64, w: &mut Writer, last: &mut u64| {
        while let Some((seq, _, _)) = statuses.peek() {
            if *seq >= seq_limit {
                break;
            }
            let (seq, kind, data) = statuses.next().expect("peeked");
            let is_final = seq == build.event_seq && build.status.is_finished();
            let frame = Frame::new(seq, kind.name(), data, is_final);
            if seq > *last {
                *last = seq;
                w.push(&frame);
            }
            if is_final {
                final_frame = Some(frame);
            }
        }
    };
    for (number, first_line) in plan {
        let compressed = read_store(store, move |rx| {
            rx.log_chunk(id, number)?
                .ok_or_else(|| StoreError::corrupt("an indexed log chunk is missing"))
        })
        .await?;
        let text = logs::decompress_chunk(&compressed).map_err(store_failed)?;
        // Every stored line ends with a newline.
        let body = text.strip_suffix(b"\n").unwrap_or(&text);
        for (i, line) in (first_line..).zip(body.split(|&b| b == b'\n')) {
            let seq = build.line_seq(i);
            emit_status_before(seq, w, last);
            if seq > *last {
                *last = seq;
                w.push(&Frame::new(
                    seq,
                    "log",
                    String::from_utf8_lossy(line).into_owned(),
                    false,
                ));
            }
            w.flush_if_full().await?;
        }
    }
    emit_status_before(u64::MAX, w, last);
    w.flush().await?;
    Ok(final_frame)
}

/// What a build's replay reads first: the build, its status events and
/// where each log chunk sits (small). Chunks are then read one at a time,
/// and only those after the cursor, so a replay or a catch-up holds one
/// chunk in memory, not the log.
async fn load_replay(store: &Reader, id: BuildId) -> Result<Option<ReplayStart>, Stop> {
    read_store(store, move |rx| {
        let Some(b) = rx.build(id)? else {
            return Ok(None);
        };
        let index = rx.log_index(id, b.log_chunks)?;
        let mut events = Vec::new();
        for (seq, e) in rx.build_events(id)? {
            let kind = BuildEvent::named(&e.event)
                .ok_or_else(|| StoreError::corrupt("a stored build event of no known kind"))?;
            events.push((seq, kind, e.data));
        }
        Ok(Some((b, events, index)))
    })
    .await
}

/// A build, its status events (id, kind, data) and its log chunks' places.
type ReplayStart = (
    crate::model::BuildRecord,
    Vec<(u64, BuildEvent, String)>,
    Vec<crate::store::ChunkPlace>,
);

/// (chunk number, its first line) of each chunk holding a line after
/// `last`.
fn chunks_after(
    build: &crate::model::BuildRecord,
    places: &[crate::store::ChunkPlace],
    last: u64,
) -> Vec<(u32, u64)> {
    places
        .iter()
        .enumerate()
        .filter_map(|(i, p)| {
            let next = places.get(i + 1).map_or(build.log_lines, |n| n.first_line);
            let lines = next.saturating_sub(p.first_line);
            let last_seq = build.line_seq(p.first_line + lines.saturating_sub(1));
            (lines > 0 && last_seq > last).then_some((p.number, p.first_line))
        })
        .collect()
}

/// The deployment channel: state events only, never ends by itself.
async fn deployment_stream(
    sources: &Sources,
    id: &str,
    cursor: Option<String>,
    reauthorize: &Reauthorize,
    w: &mut Writer,
    behind: &mut mpsc::Receiver<u64>,
) -> Result<(), Stop> {
    let channel = Channel::Deployment(id.to_string());
    let (mut subscription, _) = sources.hub.subscribe(&channel);
    let owned_id = id.to_string();
    let (current, summary, first) = read_store(&sources.store, move |rx| {
        let id = owned_id.as_str();
        let d = rx.deployment(id)?;
        let summary = match &d {
            Some(d) => {
                let last = d.last_build.map(|b| rx.build(b)).transpose()?.flatten();
                Some(d.summary(last.as_ref()))
            }
            None => None,
        };
        let first = rx.first_deployment_event(id)?;
        Ok((d.map(|d| d.event_seq).unwrap_or(0), summary, first))
    })
    .await?;
    let mut last = current;
    match cursor {
        None => {
            if let Some(s) = summary {
                let data = super::event_json(&s).map_err(store_failed)?;
                w.push(&Frame::new(current, "deployment", data, false));
            }
        }
        Some(text) => match text.trim().parse::<u64>() {
            Ok(n) if n <= current => {
                if n < current && first.is_some_and(|f| f > n + 1) {
                    w.raw(&resync("cursor_expired"));
                } else {
                    last = n;
                }
            }
            _ => w.raw(&resync("cursor_invalid")),
        },
    }
    let mut timers = Timers::new(sources);
    loop {
        // Replay what the store has after `last` (also after falling behind).
        loop {
            let (owned_id, after) = (id.to_string(), last);
            let page = read_store(&sources.store, move |rx| {
                rx.deployment_events_after(&owned_id, after, REPLAY_PAGE)
            })
            .await?;
            let n = page.len();
            if n > 0 && page[0].0 > last + 1 && last > 0 {
                w.raw(&resync("history_unavailable"));
            }
            for (seq, e) in page {
                last = seq;
                let event = super::deployment_event_name(&e.event);
                w.push(&Frame::new(seq, event, e.data, false));
                w.flush_if_full().await?;
            }
            if n < REPLAY_PAGE {
                break;
            }
        }
        last = go_live(subscription, last, w, reauthorize, &mut timers, behind).await?;
        sources.hub.catch_ups.fetch_add(1, Ordering::Relaxed);
        let (again, _) = sources.hub.subscribe(&channel);
        subscription = again;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;
    use crate::store::StoredEvent;
    use futures_util::StreamExt;

    fn build(id: BuildId) -> BuildRecord {
        BuildRecord {
            status: BuildStatus::Running,
            started_at: Some(2),
            log_bytes: 10,
            log_lines: 2,
            log_chunks: 1,
            event_seq: 3,
            seq_reserved: 3,
            log_first_seq: 2,
            ..BuildRecord::queued(
                id,
                "d".into(),
                BuildKind::Deploy,
                Trigger::Submit,
                "m".into(),
                1,
            )
        }
    }

    /// A log chunk that does not decompress is a store failure in the
    /// middle of a replay: the stream must end (the client resumes with
    /// `Last-Event-ID`), never skip the chunk and go live with a gap.
    #[tokio::test]
    async fn a_store_failure_during_replay_ends_the_stream() {
        let dir = std::env::temp_dir().join(format!("berth-replay-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store = crate::store::Store::open(&dir.join("berth.redb")).unwrap();
        let id = new_build_id();
        store
            .write(move |tx| {
                tx.put_build(&build(id))?;
                tx.put_build_event(
                    id,
                    1,
                    &StoredEvent {
                        event: "status".into(),
                        data: r#"{"status":"running"}"#.into(),
                        at: 2,
                    },
                )?;
                let place = crate::store::ChunkPlace {
                    number: 0,
                    first_line: 0,
                    first_byte: 0,
                    raw_len: 10,
                };
                tx.put_log_chunk(id, &place, b"these bytes are not zstd")
            })
            .await
            .unwrap();
        let hub = Arc::new(Hub::default());
        let (_stop, stopping) = tokio::sync::watch::channel(false);
        let sources = Sources {
            store: store.reader(),
            hub: hub.clone(),
            stopping,
            keep_alive: Duration::from_secs(15), // the default of --sse-keep-alive
        };
        let slot = ClientSlot::take(&hub, 10).unwrap();
        let mut body = spawn(
            sources,
            Channel::Build(id),
            None,
            Box::new(|| Box::pin(async { true })),
            slot,
            None,
        );
        let mut seen = Vec::new();
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(Ok(bytes)) = body.next().await {
                seen.extend_from_slice(&bytes);
            }
        })
        .await;
        let text = String::from_utf8_lossy(&seen);
        assert!(
            ended.is_ok(),
            "the stream went on after the failed read: {text}"
        );
        // Nothing after the unreadable chunk was sent, and no `end`.
        assert_eq!(text, "retry: 2000\n\n");
        // The producer frees its slot as it ends (just after the body's end).
        let freed = tokio::time::timeout(Duration::from_secs(5), async {
            while hub.clients.load(Ordering::SeqCst) != 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(freed.is_ok(), "the stream's slot was not freed");
        let _ = std::fs::remove_dir_all(dir);
    }
}
