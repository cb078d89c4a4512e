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

/// Events queued for one subscriber before it counts as slow.
pub const SUBSCRIBER_QUEUE: usize = 4096;
/// Log seqs reserved ahead of use: a crash never lets an id be reused.
pub const SEQ_BLOCK: u64 = 1024;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Channel {
    Deployment(String),
    Build(BuildId),
}

/// One event, ready to be written to any number of subscribers.
#[derive(Debug)]
pub struct Frame {
    pub seq: u64,
    pub event: &'static str,
    pub data: String,
    /// The final status of a build: the stream ends after it.
    pub last: bool,
}

impl Frame {
    pub fn new(seq: u64, event: &'static str, data: String, last: bool) -> Arc<Frame> {
        Arc::new(Frame {
            seq,
            event,
            data,
            last,
        })
    }

    /// The SSE text of this event. Data never contains a line break (JSON is
    /// compact; log lines are split at CR and LF when captured); if one ever
    /// did, each part becomes its own `data:` line.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(format!("id: {}\nevent: {}\n", self.seq, self.event).as_bytes());
        for part in self.data.split(['\n', '\r']) {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(part.as_bytes());
            out.push(b'\n');
        }
        out.push(b'\n');
    }
}

#[derive(Default)]
struct State {
    subscribers: Vec<mpsc::Sender<Arc<Frame>>>,
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
        let mut map = self.lock();
        if let Some(state) = map.get_mut(channel) {
            state
                .subscribers
                .retain(|s| s.try_send(frame.clone()).is_ok());
            if state.subscribers.is_empty() && state.pending.is_empty() {
                map.remove(channel);
            }
        }
    }

    /// A log line: published now, kept until its chunk commits.
    pub fn publish_line(&self, build: BuildId, frame: Arc<Frame>) {
        let mut map = self.lock();
        let state = map.entry(Channel::Build(build)).or_default();
        state.pending.push_back(frame.clone());
        state
            .subscribers
            .retain(|s| s.try_send(frame.clone()).is_ok());
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
    pub fn subscribe(&self, channel: &Channel) -> (mpsc::Receiver<Arc<Frame>>, Vec<Arc<Frame>>) {
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
        let mut out = Vec::new();
        Frame::new(7, "log", "hello: world".into(), false).encode_into(&mut out);
        assert_eq!(out, b"id: 7\nevent: log\ndata: hello: world\n\n");
        let mut out = Vec::new();
        Frame::new(8, "log", "a\rb".into(), false).encode_into(&mut out);
        assert_eq!(out, b"id: 8\nevent: log\ndata: a\ndata: b\n\n");
    }

    #[tokio::test]
    async fn pending_lines_reach_late_subscribers_and_slow_ones_are_dropped() {
        let hub = Hub::default();
        hub.publish_line(1, Frame::new(3, "log", "a".into(), false));
        let (mut rx, pending) = hub.subscribe(&Channel::Build(1));
        assert_eq!(pending.iter().map(|f| f.seq).collect::<Vec<_>>(), [3]);
        hub.publish_line(1, Frame::new(4, "log", "b".into(), false));
        assert_eq!(rx.recv().await.unwrap().seq, 4);
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
