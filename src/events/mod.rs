//! The event hub: state events written in the same transaction as the change
//! they describe and published after the commit; log lines published as they
//! arrive and kept here until their chunk commits (spec events.md).
//!
//! A subscriber registers with the hub *before* it reads the store, and gets
//! the not-yet-committed lines as a snapshot under the same lock, so nothing
//! falls between "replayed from the store" and "live". Each subscriber has a
//! bounded queue; a subscriber that falls behind is dropped from the hub and
//! catches up from the store on its own (see `stream`), so it never slows
//! the build or anyone else.

pub mod stream;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use crate::model::{BuildId, BuildRecord, DeploymentRecord, Millis};
use crate::store::{StoreResult, StoredEvent, Tx};

/// Batches queued for one subscriber before it counts as slow (a batch is
/// at most one read of the deployer's output, 64 KiB).
pub const SUBSCRIBER_QUEUE: usize = 64;
/// Log seqs reserved ahead of use: a crash never lets an id be reused.
pub const SEQ_BLOCK: u64 = 65_536;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Channel {
    Deployment(String),
    Build(BuildId),
}

/// One event, encoded once and written to any number of subscribers.
#[derive(Debug)]
pub struct Frame {
    pub seq: u64,
    pub event: &'static str,
    /// The JSON of a status event (an `end` event repeats it); empty for
    /// log lines, whose text lives only in `encoded`.
    pub data: String,
    /// The final status of a build: the stream ends after it.
    pub last: bool,
    encoded: bytes::Bytes,
}

impl Frame {
    pub fn new(seq: u64, event: &'static str, data: String, last: bool) -> Arc<Frame> {
        let encoded = encode(seq, event, &data);
        let data = if event == "log" { String::new() } else { data };
        Arc::new(Frame {
            seq,
            event,
            data,
            last,
            encoded,
        })
    }

    /// The SSE text of this event.
    pub fn encoded(&self) -> &bytes::Bytes {
        &self.encoded
    }
}

/// Data never contains a line break (JSON is compact; log lines are split at
/// CR and LF when captured); if one ever did, each part becomes its own
/// `data:` line.
fn encode(seq: u64, event: &str, data: &str) -> bytes::Bytes {
    let mut out = Vec::with_capacity(data.len() + 32);
    out.extend_from_slice(format!("id: {seq}\nevent: {event}\n").as_bytes());
    for part in data.split(['\n', '\r']) {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(part.as_bytes());
        out.push(b'\n');
    }
    out.push(b'\n');
    bytes::Bytes::from(out)
}

/// Consecutive events of one channel, sent to every subscriber as one item
/// and, when the subscriber needs all of them, written as one buffer.
#[derive(Debug)]
pub struct Batch {
    pub frames: Vec<Arc<Frame>>,
    encoded: bytes::Bytes,
}

impl Batch {
    pub fn new(frames: Vec<Arc<Frame>>) -> Arc<Batch> {
        assert!(!frames.is_empty(), "an empty batch");
        let encoded = if frames.len() == 1 {
            frames[0].encoded().clone()
        } else {
            let mut joined = Vec::with_capacity(frames.iter().map(|f| f.encoded().len()).sum());
            for f in &frames {
                joined.extend_from_slice(f.encoded());
            }
            bytes::Bytes::from(joined)
        };
        Arc::new(Batch { frames, encoded })
    }
    pub fn first_seq(&self) -> u64 {
        self.frames[0].seq
    }
    pub fn last_seq(&self) -> u64 {
        self.frames[self.frames.len() - 1].seq
    }
    pub fn encoded(&self) -> &bytes::Bytes {
        &self.encoded
    }
}

#[derive(Default)]
struct State {
    subscribers: Vec<mpsc::Sender<Arc<Batch>>>,
    /// Log lines sent live whose chunk is not committed yet.
    pending: VecDeque<Arc<Frame>>,
}

#[derive(Default)]
pub struct Hub {
    channels: Mutex<HashMap<Channel, State>>,
    /// Open event streams (for `--max-sse-clients` and /metrics).
    pub clients: AtomicUsize,
}

impl Hub {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Channel, State>> {
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends to every subscriber that has room; one that has none is
    /// dropped and catches up from the store.
    pub fn publish(&self, channel: &Channel, frame: Arc<Frame>) {
        let batch = Batch::new(vec![frame]);
        let mut map = self.lock();
        if let Some(state) = map.get_mut(channel) {
            state
                .subscribers
                .retain(|s| s.try_send(batch.clone()).is_ok());
            if state.subscribers.is_empty() && state.pending.is_empty() {
                map.remove(channel);
            }
        }
    }

    /// Log lines: published now, kept until their chunk commits. They go to
    /// each subscriber as one batch, encoded once: the cost per subscriber
    /// does not grow with the number of lines.
    pub fn publish_lines(&self, build: BuildId, frames: Vec<Arc<Frame>>) {
        if frames.is_empty() {
            return;
        }
        let mut map = self.lock();
        let state = map.entry(Channel::Build(build)).or_default();
        state.pending.extend(frames.iter().cloned());
        if !state.subscribers.is_empty() {
            let batch = Batch::new(frames);
            state
                .subscribers
                .retain(|s| s.try_send(batch.clone()).is_ok());
        }
    }

    /// Lines up to `seq` are in the store now.
    pub fn committed(&self, build: BuildId, seq: u64) {
        let mut map = self.lock();
        let channel = Channel::Build(build);
        if let Some(state) = map.get_mut(&channel) {
            while state.pending.front().is_some_and(|f| f.seq <= seq) {
                state.pending.pop_front();
            }
            if state.subscribers.is_empty() && state.pending.is_empty() {
                map.remove(&channel);
            }
        }
    }

    /// Registers a subscriber; returns its queue and the lines sent live
    /// but not committed yet.
    pub fn subscribe(&self, channel: &Channel) -> (mpsc::Receiver<Arc<Batch>>, Vec<Arc<Frame>>) {
        let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE);
        let mut map = self.lock();
        let state = map.entry(channel.clone()).or_default();
        state.subscribers.push(tx);
        (rx, state.pending.iter().cloned().collect())
    }

    /// The highest seq sent live on a build channel, if any line is pending.
    pub fn pending_max(&self, build: BuildId) -> Option<u64> {
        self.lock()
            .get(&Channel::Build(build))
            .and_then(|s| s.pending.back().map(|f| f.seq))
    }
}

/// Stores a build's status event (with the build summary) and publishes it
/// after the commit. The caller stores the build record afterwards.
pub fn build_status(tx: &Tx, hub: &Arc<Hub>, b: &mut BuildRecord, now: Millis) -> StoreResult<()> {
    let seq = b.event_seq + 1;
    b.event_seq = seq;
    b.seq_reserved = b.seq_reserved.max(seq);
    let data = serde_json::to_string(&b.summary()).unwrap_or_default();
    tx.put_build_event(
        b.id,
        seq,
        &StoredEvent {
            event: "status".into(),
            data: data.clone(),
            at: now,
        },
    )?;
    let (hub, id, last) = (hub.clone(), b.id, b.status.is_finished());
    tx.after_commit(move || {
        hub.publish(&Channel::Build(id), Frame::new(seq, "status", data, last))
    });
    Ok(())
}

/// Stores the deployment-channel events of a change: `build` (when a build
/// changed) then `deployment` with the summary after the change.
pub fn deployment_changed(
    tx: &Tx,
    hub: &Arc<Hub>,
    d: &mut DeploymentRecord,
    changed: Option<&BuildRecord>,
    now: Millis,
) -> StoreResult<()> {
    let mut frames = Vec::with_capacity(2);
    if let Some(b) = changed {
        d.event_seq += 1;
        frames.push((
            d.event_seq,
            "build",
            serde_json::to_string(&b.summary()).unwrap_or_default(),
        ));
    }
    let last_build = match (d.last_build, changed) {
        (Some(id), Some(b)) if id == b.id => Some(b.clone()),
        (Some(id), _) => tx.build(id)?,
        (None, _) => None,
    };
    d.event_seq += 1;
    let summary = crate::engine::summary(d, last_build.as_ref());
    frames.push((
        d.event_seq,
        "deployment",
        serde_json::to_string(&summary).unwrap_or_default(),
    ));
    for (seq, event, data) in &frames {
        tx.put_deployment_event(
            &d.id,
            *seq,
            &StoredEvent {
                event: event.to_string(),
                data: data.clone(),
                at: now,
            },
        )?;
    }
    let (hub, id) = (hub.clone(), d.id.clone());
    tx.after_commit(move || {
        let channel = Channel::Deployment(id);
        for (seq, event, data) in frames {
            hub.publish(&channel, Frame::new(seq, event, data, false));
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_encode_as_sse() {
        let f = Frame::new(7, "log", "hello: world".into(), false);
        assert_eq!(
            &f.encoded()[..],
            b"id: 7\nevent: log\ndata: hello: world\n\n"
        );
        let f = Frame::new(8, "log", "a\rb".into(), false);
        assert_eq!(&f.encoded()[..], b"id: 8\nevent: log\ndata: a\ndata: b\n\n");
    }

    #[tokio::test]
    async fn pending_lines_reach_late_subscribers_and_slow_ones_are_dropped() {
        let hub = Hub::default();
        hub.publish_lines(1, vec![Frame::new(3, "log", "a".into(), false)]);
        let (mut rx, pending) = hub.subscribe(&Channel::Build(1));
        assert_eq!(pending.iter().map(|f| f.seq).collect::<Vec<_>>(), [3]);
        hub.publish_lines(1, vec![Frame::new(4, "log", "b".into(), false)]);
        assert_eq!(rx.recv().await.unwrap().first_seq(), 4);
        hub.committed(1, 4);
        assert_eq!(hub.pending_max(1), None);
        for seq in 0..(SUBSCRIBER_QUEUE as u64 + 1) {
            hub.publish(
                &Channel::Build(1),
                Frame::new(10 + seq, "log", String::new(), false),
            );
        }
        // The queue filled: the subscriber was dropped and sees the end of
        // its queue after what it already had.
        let mut n = 0;
        while rx.recv().await.is_some() {
            n += 1;
        }
        assert_eq!(n, SUBSCRIBER_QUEUE);
    }
}
