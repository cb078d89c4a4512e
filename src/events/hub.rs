//! The hub: every channel with live subscribers or uncommitted log lines,
//! each with one shared tail of recent batches.

use crate::locks::Held;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;

use super::fanout;
use super::{Batch, Channel, Frame, TAIL_BATCHES, TAIL_BYTES};
use crate::model::BuildId;

/// One channel's live state, shared by the hub and its live subscribers.
#[derive(Default)]
struct Live {
    state: Mutex<LiveState>,
    /// Woken at every publish; each parked subscriber then reads the tail.
    notify: Arc<Notify>,
    /// `state.end_pos()`, readable without the lock (the fan-out checks it
    /// for every client it writes).
    end_pos: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct LiveState {
    /// The latest batches, oldest first; `recent[0]` has position `first_pos`.
    recent: VecDeque<Arc<Batch>>,
    first_pos: u64,
    recent_bytes: usize,
    /// Log lines sent live whose chunk is not committed yet.
    pending: VecDeque<Arc<Frame>>,
}

impl Live {
    fn lock(&self) -> std::sync::MutexGuard<'_, LiveState> {
        self.state.held()
    }

    fn push(&self, state: &mut LiveState, batch: Arc<Batch>) {
        state.push(batch);
        self.end_pos
            .store(state.end_pos(), std::sync::atomic::Ordering::Release);
    }
}

impl LiveState {
    fn end_pos(&self) -> u64 {
        self.first_pos + self.recent.len() as u64
    }

    fn push(&mut self, batch: Arc<Batch>) {
        self.recent_bytes += batch.encoded().len();
        self.recent.push_back(batch);
        while self.recent.len() > TAIL_BATCHES
            || (self.recent_bytes > TAIL_BYTES && self.recent.len() > 1)
        {
            let old = self.recent.pop_front().expect("not empty");
            self.recent_bytes -= old.encoded().len();
            self.first_pos += 1;
        }
    }

    /// Drops the tail (nobody reads it) but keeps positions increasing.
    fn forget_tail(&mut self) {
        self.first_pos = self.end_pos();
        self.recent.clear();
        self.recent_bytes = 0;
    }
}

/// Every channel with subscribers or uncommitted lines. One shared tail per
/// channel, not one queue per subscriber: a publish costs one push and one
/// wake-up of the subscribers that wait, however many there are, and a
/// subscriber that wakes reads everything published since its last read.
#[derive(Default)]
pub struct Hub {
    channels: Mutex<HashMap<Channel, Arc<Live>>>,
    /// Writes the live streams that handed it their socket.
    pub fanout: Arc<fanout::FanOut>,
    /// Open event streams (for `--max-sse-clients` and /metrics).
    pub clients: AtomicUsize,
    /// Times a stream fell behind and caught up from the store (/metrics).
    pub catch_ups: std::sync::atomic::AtomicU64,
    /// Woken after a commit that queued webhook deliveries (the outbox):
    /// the sender then reads them at once instead of at its next look.
    pub outbox: tokio::sync::Notify,
    /// Counts committed changes of nodes' desired-state documents
    /// (agents.md): a waiting desired-state read looks at its node again
    /// when it moves. One counter, not a channel per node: a wave's
    /// documents commit in one transaction, and 10,000 idle agents then
    /// cost no per-node state here.
    pub documents: tokio::sync::watch::Sender<u64>,
    /// What every document carries from berth's settings (set once, when
    /// the engine makes the hub), so a transaction that shows a node's
    /// entry has them at hand.
    pub document_times: crate::nodes::DocumentTimes,
}

/// The subscriber fell further behind than the tail keeps: it catches up
/// from the store.
#[derive(Debug, PartialEq, Eq)]
pub struct Lagged;

/// One live subscriber's place in a channel's tail. Dropping it frees the
/// channel's state once nobody else needs it.
pub struct Subscription {
    hub: Arc<Hub>,
    channel: Channel,
    live: Option<Arc<Live>>,
    next_pos: u64,
    notified: Option<std::pin::Pin<Box<OwnedNotified>>>,
}

/// What a read of the tail found.
pub struct Peeked {
    /// The position after the batches read.
    pub next_pos: u64,
    /// The tail holds more than was read (the byte limit stopped it).
    pub more: bool,
}

impl Subscription {
    fn live(&self) -> &Arc<Live> {
        self.live.as_ref().expect("live until dropped")
    }

    /// Identifies the channel (the fan-out shares reads between subscribers
    /// at one position of one channel).
    pub fn channel_key(&self) -> usize {
        Arc::as_ptr(self.live()) as usize
    }

    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// The position after the newest batch of the channel's tail.
    pub fn tail_end(&self) -> u64 {
        self.live()
            .end_pos
            .load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn next_pos(&self) -> u64 {
        self.next_pos
    }

    pub fn set_next_pos(&mut self, pos: u64) {
        self.next_pos = pos;
    }

    /// Copies the batches after this subscriber's position into `out` (about
    /// `max_bytes` at most), without moving the position.
    pub fn peek(&self, out: &mut Vec<Arc<Batch>>, max_bytes: usize) -> Result<Peeked, Lagged> {
        let state = self.live().lock();
        if self.next_pos < state.first_pos {
            return Err(Lagged);
        }
        let start = (self.next_pos - state.first_pos) as usize;
        let mut next_pos = self.next_pos;
        let mut bytes = 0;
        for batch in state.recent.iter().skip(start) {
            if bytes >= max_bytes {
                break;
            }
            bytes += batch.encoded().len();
            out.push(batch.clone());
            next_pos += 1;
        }
        Ok(Peeked {
            next_pos,
            more: next_pos < state.end_pos(),
        })
    }

    /// Moves the batches published since the last call into `out` (up to
    /// about `max_bytes`); pending until there is one.
    pub fn poll_batches(
        &mut self,
        cx: &mut std::task::Context<'_>,
        out: &mut Vec<Arc<Batch>>,
        max_bytes: usize,
    ) -> std::task::Poll<Result<(), Lagged>> {
        use std::future::Future;
        use std::task::Poll;
        loop {
            // Armed before the tail is read: a publish after the read wakes us.
            if self.notified.is_none() {
                let mut n = Box::pin(self.live().notify.clone().notified_owned());
                n.as_mut().enable();
                self.notified = Some(n);
            }
            let before = out.len();
            let peeked = match self.peek(out, max_bytes) {
                Ok(p) => p,
                Err(Lagged) => return Poll::Ready(Err(Lagged)),
            };
            if out.len() > before {
                self.next_pos = peeked.next_pos;
                return Poll::Ready(Ok(()));
            }
            let notified = self.notified.as_mut().expect("armed above");
            match notified.as_mut().poll(cx) {
                Poll::Ready(()) => self.notified = None,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut map = self.hub.lock();
        // Counted under the map lock, where every clone is made.
        drop(self.live.take());
        if let Some(live) = map.get(&self.channel) {
            if Arc::strong_count(live) == 1 {
                let mut state = live.lock();
                state.forget_tail();
                if state.pending.is_empty() {
                    drop(state);
                    map.remove(&self.channel);
                }
            }
        }
    }
}

impl Hub {
    /// A hub whose node entries show these document times.
    pub fn with_document_times(times: crate::nodes::DocumentTimes) -> Hub {
        Hub {
            document_times: times,
            ..Hub::default()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Channel, Arc<Live>>> {
        self.channels.held()
    }

    /// Appends to the channel's tail if anyone listens.
    pub fn publish(&self, channel: &Channel, frame: Arc<Frame>) {
        self.publish_all(channel, vec![frame]);
    }

    /// Whether anyone listens on `channel` now. A subscriber that comes
    /// later reads what is committed from the store first, so frames of
    /// committed rows need not be made for nobody.
    pub fn listened(&self, channel: &Channel) -> bool {
        self.lock()
            .get(channel)
            .is_some_and(|live| Arc::strong_count(live) > 1)
    }

    /// Appends frames whose rows are committed (a worker's progress batch)
    /// to the channel's tail as one batch, if anyone listens.
    pub fn publish_all(&self, channel: &Channel, frames: Vec<Arc<Frame>>) {
        if frames.is_empty() {
            return;
        }
        let map = self.lock();
        let Some(live) = map.get(channel) else {
            return;
        };
        if Arc::strong_count(live) > 1 {
            live.push(&mut live.lock(), Batch::new(frames));
            let notify = live.notify.clone();
            drop(map);
            self.wake(&notify);
        }
    }

    /// Wakes the readers of a channel that got a batch: the ones waiting in
    /// their own task, and the fan-out. Called without the hub's lock.
    fn wake(&self, notify: &Notify) {
        notify.notify_waiters();
        self.fanout.kick();
    }

    /// Tests publish frames made one by one.
    #[cfg(test)]
    pub fn publish_lines(&self, build: BuildId, frames: Vec<Arc<Frame>>) {
        if frames.is_empty() {
            return;
        }
        let batch = Batch::new(frames.clone());
        self.publish_batch(build, frames, batch);
    }

    /// Log lines (a running build's, encoded as they arrived): published
    /// now, kept until their chunk commits. They are one batch, encoded
    /// once: the cost per subscriber does not grow with the number of lines.
    pub fn publish_log_lines(&self, build: BuildId, lines: &mut super::LogLines) {
        if let Some((frames, batch)) = lines.take() {
            self.publish_batch(build, frames, batch);
        }
    }

    fn publish_batch(&self, build: BuildId, frames: Vec<Arc<Frame>>, batch: Arc<Batch>) {
        let mut map = self.lock();
        let live = map.entry(Channel::Build(build)).or_default();
        let listened = Arc::strong_count(live) > 1;
        let mut state = live.lock();
        state.pending.extend(frames);
        if listened {
            live.push(&mut state, batch);
            drop(state);
            let notify = live.notify.clone();
            drop(map);
            self.wake(&notify);
        }
    }

    /// Lines up to `seq` are in the store now.
    pub fn committed(&self, build: BuildId, seq: u64) {
        let mut map = self.lock();
        let channel = Channel::Build(build);
        if let Some(live) = map.get(&channel) {
            let mut state = live.lock();
            while state.pending.front().is_some_and(|f| f.seq <= seq) {
                state.pending.pop_front();
            }
            if state.pending.is_empty() && Arc::strong_count(live) == 1 {
                drop(state);
                map.remove(&channel);
            }
        }
    }

    /// Registers a subscriber at the end of the channel's tail; returns it
    /// and the lines sent live but not committed yet, taken together so that
    /// nothing falls between them.
    pub fn subscribe(self: &Arc<Self>, channel: &Channel) -> (Subscription, Vec<Arc<Frame>>) {
        let mut map = self.lock();
        let live = map.entry(channel.clone()).or_default().clone();
        let (next_pos, pending) = {
            let state = live.lock();
            (state.end_pos(), state.pending.iter().cloned().collect())
        };
        let subscription = Subscription {
            hub: self.clone(),
            channel: channel.clone(),
            live: Some(live),
            next_pos,
            notified: None,
        };
        (subscription, pending)
    }

    /// The highest seq sent live on a build channel, if any line is pending.
    pub fn pending_max(&self, build: BuildId) -> Option<u64> {
        let map = self.lock();
        let live = map.get(&Channel::Build(build))?;
        let state = live.lock();
        state.pending.back().map(|f| f.seq)
    }

    /// Channels the hub holds state for.
    #[cfg(test)]
    pub fn channel_count(&self) -> usize {
        self.lock().len()
    }
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

    fn seqs(batches: &[Arc<Batch>]) -> Vec<u64> {
        batches
            .iter()
            .flat_map(|b| b.frames.iter().map(|f| f.seq))
            .collect()
    }

    async fn next(sub: &mut Subscription) -> Result<Vec<Arc<Batch>>, Lagged> {
        let mut out = Vec::new();
        std::future::poll_fn(|cx| sub.poll_batches(cx, &mut out, usize::MAX)).await?;
        Ok(out)
    }

    #[tokio::test]
    async fn pending_lines_reach_late_subscribers_and_laggards_are_told() {
        let hub = Arc::new(Hub::default());
        hub.publish_lines(1, vec![Frame::new(3, "log", "a".into(), false)]);
        let (mut sub, pending) = hub.subscribe(&Channel::Build(1));
        assert_eq!(pending.iter().map(|f| f.seq).collect::<Vec<_>>(), [3]);
        hub.publish_lines(1, vec![Frame::new(4, "log", "b".into(), false)]);
        hub.publish(
            &Channel::Build(1),
            Frame::new(5, "status", "{}".into(), false),
        );
        // Everything published since the last read comes in one read.
        assert_eq!(seqs(&next(&mut sub).await.unwrap()), [4, 5]);
        hub.committed(1, 4);
        assert_eq!(hub.pending_max(1), None);
        for seq in 0..(TAIL_BATCHES as u64 + 1) {
            hub.publish(
                &Channel::Build(1),
                Frame::new(10 + seq, "log", String::new(), false),
            );
        }
        assert_eq!(next(&mut sub).await.err(), Some(Lagged));
        drop(sub);
        assert_eq!(
            hub.channel_count(),
            0,
            "the last subscriber frees the channel"
        );
    }

    #[tokio::test]
    async fn a_waiting_subscriber_wakes_at_a_publish_and_bytes_bound_the_tail() {
        let hub = Arc::new(Hub::default());
        let (mut sub, _) = hub.subscribe(&Channel::Deployment("d".into()));
        let reader = tokio::spawn(async move { (seqs(&next(&mut sub).await.unwrap()), sub) });
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        hub.publish(
            &Channel::Deployment("d".into()),
            Frame::new(1, "deployment", "{}".into(), false),
        );
        let (got, sub) = tokio::time::timeout(std::time::Duration::from_secs(5), reader)
            .await
            .expect("woken")
            .unwrap();
        assert_eq!(got, [1]);
        // Three 600 KiB batches: the tail keeps at most 1 MiB, so the oldest
        // unread ones are gone and the subscriber must catch up.
        let big = "x".repeat(600 << 10);
        for seq in 2..5 {
            hub.publish_lines(7, vec![Frame::new(seq, "log", big.clone(), false)]);
        }
        let (mut build_sub, _) = hub.subscribe(&Channel::Build(7));
        for seq in 5..8 {
            hub.publish_lines(7, vec![Frame::new(seq, "log", big.clone(), false)]);
        }
        assert_eq!(next(&mut build_sub).await.err(), Some(Lagged));
        drop(sub);
    }

    /// Readers on other threads, publishes racing their reads and their
    /// subscribing: every reader sees seqs strictly increasing with no gap
    /// after its pending snapshot, up to the last line, or is told it lagged.
    #[test]
    fn concurrent_readers_see_gap_free_sequences_or_lag() {
        const LINES: u64 = 20_000;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let hub = Arc::new(Hub::default());
        let readers: Vec<_> = (0..8)
            .map(|r| {
                let hub = hub.clone();
                runtime.spawn(async move {
                    // Subscribe at different moments of the build.
                    tokio::time::sleep(std::time::Duration::from_micros(r * 300)).await;
                    let (mut sub, pending) = hub.subscribe(&Channel::Build(9));
                    let mut seen: Vec<u64> = pending.iter().map(|f| f.seq).collect();
                    loop {
                        match next(&mut sub).await {
                            Ok(batches) => seen.extend(seqs(&batches)),
                            Err(Lagged) => return (seen, true),
                        }
                        if seen.last() == Some(&LINES) {
                            return (seen, false);
                        }
                    }
                })
            })
            .collect();
        let publisher = std::thread::spawn({
            let hub = hub.clone();
            move || {
                for seq in 1..=LINES {
                    hub.publish_lines(9, vec![Frame::new(seq, "log", "x".into(), false)]);
                    if seq % 64 == 0 {
                        hub.committed(9, seq - 32);
                    }
                    // A deployer's pace, well inside what the tail keeps.
                    if seq % 256 == 0 {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
            }
        });
        publisher.join().unwrap();
        let mut checked = 0;
        for reader in readers {
            let (seen, lagged) = runtime.block_on(reader).unwrap();
            assert!(!seen.is_empty() || lagged);
            // Lines before the snapshot come from the store. A snapshot and
            // the tail may overlap (the stream drops what it already sent by
            // seq); after that, no gap and no reordering.
            let mut last = seen.first().map_or(0, |s| s - 1);
            checked += seen.len();
            for seq in seen {
                assert!(seq <= last + 1, "a gap after {last}: {seq}");
                last = last.max(seq);
            }
            if !lagged {
                assert_eq!(last, LINES);
            }
        }
        assert!(
            checked >= LINES as usize,
            "the readers saw only {checked} lines: the test checked little"
        );
    }
}
