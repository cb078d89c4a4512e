//! The HTTP body of one SSE stream: replayed bytes from the producer task,
//! then the socket handed to the fan-out thread and taken back.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::fanout::FanOut;
use super::frame::gather_live;
use super::{Batch, Lagged, Subscription};
use crate::wire::{Return, Stopped, Wire};

/// Bytes gathered into one write to the client at most.
pub(super) const MAX_WRITE: usize = 64 * 1024;

/// What the producer task tells the HTTP body.
pub(super) enum Control {
    /// Replayed or catch-up events, keep-alives, `resync_required`, `end`.
    Bytes(Bytes),
    /// From here on live events come from the channel's tail, after seq `last`.
    Live {
        subscription: Subscription,
        last: u64,
    },
}

/// The HTTP body of a stream. Replay and catch-up come from the producer
/// task. Live events are written by the fan-out thread straight to the
/// socket (`crate::wire`): the body hands the socket over and waits for it
/// to come back (the client fell behind: the producer catches up; the
/// build ended; the socket failed). Where the connection cannot be handed
/// over (not HTTP/1.1), the body reads the tail itself.
pub struct SseBody {
    pub(super) control: mpsc::Receiver<Control>,
    pub(super) wire: Option<Arc<Wire>>,
    /// The fan-out holds the socket, or was asked for it.
    pub(super) handed: bool,
    pub(super) fanout: Option<Arc<FanOut>>,
    pub(super) live: Option<(Subscription, u64)>,
    pub(super) behind: mpsc::Sender<u64>,
    pub(super) batches: Vec<Arc<Batch>>,
    pub(super) finished: bool,
}

impl Drop for SseBody {
    /// However the stream ends (the client left, hyper dropped the
    /// response), the fan-out lets go of the socket now, not at its next
    /// write.
    fn drop(&mut self) {
        self.reclaim();
    }
}

impl SseBody {
    fn reclaim(&mut self) {
        if let (true, Some(wire)) = (self.handed, &self.wire) {
            if wire.reclaim() {
                if let Some(fanout) = &self.fanout {
                    fanout.kick();
                }
            }
        }
        self.handed = false;
    }

    /// While the fan-out holds the socket: true once it came back (the
    /// body then goes on: catch up, or finish).
    fn poll_socket_back(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        let Some(wire) = self.wire.as_ref() else {
            return false;
        };
        let std::task::Poll::Ready(why) = wire.poll_returned(cx) else {
            return false;
        };
        self.handed = false;
        match why {
            None => {}
            Some(Return::Behind(last)) => {
                let _ = self.behind.try_send(last);
            }
            Some(Return::Ended | Return::Failed) => self.finished = true,
        }
        true
    }
}

impl futures_util::Stream for SseBody {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            if this.finished {
                return Poll::Ready(None);
            }
            if this.handed && this.poll_socket_back(cx) {
                continue;
            }
            match this.control.poll_recv(cx) {
                Poll::Ready(Some(Control::Bytes(b))) if this.handed => {
                    // A keep-alive while the fan-out writes: it goes the same
                    // way, in order. When the socket is backed up it is not
                    // idle, and the comment is not needed.
                    let written = match &this.wire {
                        Some(wire) => wire.write_chunk(&crate::wire::chunk(&b)),
                        None => Ok(()),
                    };
                    if written == Err(Stopped::Failed) {
                        this.finished = true;
                    }
                    continue;
                }
                Poll::Ready(Some(Control::Bytes(b))) => return Poll::Ready(Some(Ok(b))),
                Poll::Ready(Some(Control::Live { subscription, last })) => {
                    match &this.wire {
                        Some(wire) => {
                            let fanout = subscription.hub().fanout.clone();
                            this.fanout = Some(fanout.clone());
                            wire.ask(
                                Box::new(move |wire| fanout.join(subscription, last, wire)),
                                cx.waker(),
                            );
                            this.handed = true;
                        }
                        None => this.live = Some((subscription, last)),
                    }
                    continue;
                }
                // The producer stopped (shutdown, a revoked credential, end).
                Poll::Ready(None) => {
                    this.reclaim();
                    return Poll::Ready(None);
                }
                Poll::Pending => {}
            }
            if this.handed {
                return Poll::Pending;
            }
            let Some((subscription, last)) = this.live.as_mut() else {
                return Poll::Pending;
            };
            match subscription.poll_batches(cx, &mut this.batches, MAX_WRITE) {
                Poll::Ready(Ok(())) => {
                    let (bytes, ended) = gather_live(&this.batches, last);
                    this.batches.clear();
                    this.finished = ended;
                    if let Some(bytes) = bytes {
                        return Poll::Ready(Some(Ok(bytes)));
                    }
                }
                Poll::Ready(Err(Lagged)) => {
                    // Hand back to the producer to catch up from the store.
                    let (_, last) = this.live.take().expect("live");
                    let _ = this.behind.try_send(last);
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}
