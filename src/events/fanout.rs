//! The fan-out thread: one pass over every live subscriber writes each one
//! everything published since its last write, straight to its socket.
//!
//! Why a thread and not a task per client: a thousand clients tailing one
//! build at 1,000 lines/s made the runtime wake, poll and flush a thousand
//! hyper connections per line; here a pass costs one `write(2)` per client
//! and clients that share a position share one encoded chunk. A busy pass
//! takes longer, so the next one finds more lines and writes them in the
//! same single write: the thread batches by itself under load and adds no
//! delay when idle.
//!
//! A member leaves when its stream takes the socket back (shutdown, a
//! revoked credential), when it falls behind the channel's tail or its
//! socket's backlog fills (it catches up from the store, then comes back),
//! when its build ends (after `end`), or when its socket fails.

use crate::locks::Held;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use bytes::Bytes;

use super::frame::gather_live;
use super::{Batch, Subscription};
use crate::wire::{self, Return, Stopped, Wire};

/// Bytes one pass writes to one client at most; the rest goes next pass.
const MAX_PASS_WRITE: usize = 64 * 1024;

/// One live stream whose socket the fan-out holds.
struct Member {
    subscription: Subscription,
    /// The last seq written to this client.
    last: u64,
    wire: Arc<Wire>,
}

#[derive(Default)]
struct Inbox {
    joining: Vec<Member>,
    /// Something was published since the thread last looked.
    kicked: bool,
}

#[derive(Default)]
pub struct FanOut {
    inbox: Mutex<Inbox>,
    wake: Condvar,
    /// Whether the thread started (once, at the first stream).
    thread: OnceLock<bool>,
    /// Streams whose socket the fan-out holds (for /metrics).
    pub streams: AtomicUsize,
}

/// What one read of a channel's tail gives every member at that position.
struct Made {
    chunk: Option<Bytes>,
    next_pos: u64,
    last: u64,
    ended: bool,
    more: bool,
}

impl FanOut {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inbox> {
        self.inbox.held()
    }

    /// A stream's socket is now the fan-out's: write from `last` on.
    pub fn join(self: &Arc<Self>, subscription: Subscription, last: u64, wire: Arc<Wire>) {
        let running = *self.thread.get_or_init(|| {
            let me = self.clone();
            let started = std::thread::Builder::new()
                .name("berth-fanout".into())
                .spawn(move || me.run());
            if let Err(e) = &started {
                tracing::error!(error = %e, "cannot start the event fan-out thread; live streams end after their replay");
            }
            started.is_ok()
        });
        if !running {
            // The client reconnects with its cursor and replays.
            wire.give_back(Return::Failed);
            return;
        }
        self.streams.fetch_add(1, Ordering::Relaxed);
        let mut inbox = self.lock();
        inbox.joining.push(Member {
            subscription,
            last,
            wire,
        });
        inbox.kicked = true;
        self.wake.notify_one();
    }

    /// Something was published.
    pub fn kick(&self) {
        let mut inbox = self.lock();
        if !inbox.kicked {
            inbox.kicked = true;
            self.wake.notify_one();
        }
    }

    fn run(self: Arc<Self>) {
        let mut members: Vec<Member> = Vec::new();
        let mut more = false;
        loop {
            {
                let mut inbox = self.lock();
                while !inbox.kicked && !more {
                    inbox = self.wake.wait(inbox).unwrap_or_else(|p| p.into_inner());
                }
                inbox.kicked = false;
                members.append(&mut inbox.joining);
            }
            more = false;
            let mut made: HashMap<(usize, u64, u64, u64), Made> = HashMap::new();
            let before = members.len();
            members.retain_mut(|m| serve(m, &mut made, &mut more));
            self.streams
                .fetch_sub(before - members.len(), Ordering::Relaxed);
        }
    }
}

/// Writes one member what it has not seen; false when it leaves.
fn serve(
    m: &mut Member,
    made: &mut HashMap<(usize, u64, u64, u64), Made>,
    more: &mut bool,
) -> bool {
    // The tail's end is part of the key: a line published during the pass
    // reaches every client the pass has not written yet, in this pass.
    let key = (
        m.subscription.channel_key(),
        m.subscription.next_pos(),
        m.last,
        m.subscription.tail_end(),
    );
    if key.1 == key.3 {
        // Nothing new: stay, unless the stream took its socket back.
        return m.wire.held_by_fan_out();
    }
    let out = match made.get(&key) {
        Some(out) => out,
        None => {
            let mut batches: Vec<Arc<Batch>> = Vec::new();
            let Ok(peeked) = m.subscription.peek(&mut batches, MAX_PASS_WRITE) else {
                m.wire.give_back(Return::Behind(m.last));
                return false;
            };
            let mut last = m.last;
            let (bytes, ended) = gather_live(&batches, &mut last);
            made.entry(key).or_insert(Made {
                chunk: bytes.map(|b| wire::chunk(&b)),
                next_pos: peeked.next_pos,
                last,
                ended,
                more: peeked.more,
            })
        }
    };
    *more |= out.more;
    let Some(chunk) = &out.chunk else {
        // Only lines this client already had (from its pending snapshot):
        // move past them, so they are not read again nor make it lag.
        m.subscription.set_next_pos(out.next_pos);
        return m.wire.held_by_fan_out();
    };
    match m.wire.write_chunk(chunk) {
        Ok(()) => {
            m.subscription.set_next_pos(out.next_pos);
            m.last = out.last;
            if out.ended {
                m.wire.give_back(Return::Ended);
                return false;
            }
            true
        }
        Err(Stopped::NotHeld) => false,
        Err(Stopped::Slow) => {
            m.wire.give_back(Return::Behind(m.last));
            false
        }
        Err(Stopped::Failed) => {
            m.wire.give_back(Return::Failed);
            false
        }
    }
}
