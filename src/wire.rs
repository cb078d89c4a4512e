//! The TCP connections berth serves HTTP on, and the one way to write to
//! one of them outside hyper.
//!
//! Why: with a thousand clients tailing one build, waking each client's
//! hyper task to write a frame cost three times a bare `write(2)`
//! (measured: `cargo bench --bench events`). So a live event stream hands
//! its socket to the fan-out thread (`events::fanout`), which writes every
//! live subscriber in one pass, and takes it back to catch up or to end.
//!
//! hyper still parses every request and writes every head, replay and
//! error. The hand-over is safe because hyper calls `poll_flush` here only
//! when its own buffer is empty: the socket changes hands there, and only
//! there. While the fan-out has it, every write is an HTTP/1.1 chunk
//! (hyper chose chunked encoding for the stream), made under this
//! connection's lock, so bytes never interleave. Bytes the socket cannot
//! take at once wait in a small backlog that is written before anything
//! else; a backlog past `MAX_BACKLOG` means a slow client, which goes back
//! to catching up from the store.
//!
//! Closing lingers (`LINGER`): after its last answer a connection keeps
//! reading and dropping what the client still sends, so that an early
//! answer (a 413 before the body was read) is not lost to a reset.
//!
//! What the hand-over rules out in-process: TLS (the fan-out writes plain
//! bytes to the TCP socket), HTTP/2 (one stream per socket is assumed), and
//! compression of streams (chunks are written as encoded). Put a proxy in
//! front for those, with `text/event-stream` unbuffered.
//!
//! One file over 600 lines on purpose: the I/O object hyper drives, the
//! socket state the fan-out shares, and the tests on real sockets (and a
//! real hyper connection) that pin their interplay are read together.

use crate::locks::Held;
use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Bytes queued for a socket that is not taking them before the client
/// counts as slow.
pub const MAX_BACKLOG: usize = 256 * 1024;

/// How long a closing connection keeps reading (and dropping) what its
/// client still sends.
pub const LINGER: std::time::Duration = std::time::Duration::from_secs(2);
/// Bytes a closing connection reads and drops at most.
pub const LINGER_BYTES: usize = 4 << 20;

/// One served connection (the I/O object hyper reads and writes).
pub struct Conn {
    wire: Arc<Wire>,
    linger: Option<Linger>,
}

/// A closing connection that still reads: an early answer (413 before the
/// body was read) must reach a client that is still sending, and closing
/// a socket with unread bytes resets the connection under it.
struct Linger {
    until: Pin<Box<tokio::time::Sleep>>,
    dropped: usize,
}

impl Conn {
    pub fn new(stream: TcpStream) -> Conn {
        let wire = Arc::new(Wire {
            stream,
            state: Mutex::new(WireState {
                holder: Holder::Hyper,
                backlog: VecDeque::new(),
                backlog_bytes: 0,
                body: None,
            }),
        });
        Conn { wire, linger: None }
    }

    /// The handle a request carries so that its stream can hand the socket
    /// over.
    pub fn handle(&self) -> Arc<Wire> {
        self.wire.clone()
    }
}

/// Who writes to the socket now.
enum Holder {
    Hyper,
    /// The stream asked for the socket; hyper's next flush gives it away.
    Asked(Box<dyn FnOnce(Arc<Wire>) + Send>),
    FanOut,
    /// The fan-out gave the socket back, saying why.
    Returned(Return),
}

/// Why the fan-out gave a socket back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Return {
    /// The client fell behind; catch up from the store after this seq.
    Behind(u64),
    /// The final status and `end` were written: the stream is over.
    Ended,
    /// The socket failed (the client went away).
    Failed,
}

struct WireState {
    holder: Holder,
    backlog: VecDeque<Bytes>,
    backlog_bytes: usize,
    /// The HTTP body of the stream, woken when the socket comes back or
    /// its backlog needs writing.
    body: Option<Waker>,
}

/// A served connection's socket, who writes to it now, and what waits to
/// be written. Shared by hyper's I/O object (`Conn`), the stream's HTTP
/// body and the fan-out thread.
pub struct Wire {
    stream: TcpStream,
    state: Mutex<WireState>,
}

impl Wire {
    fn lock(&self) -> MutexGuard<'_, WireState> {
        self.state.held()
    }

    /// Asks for the socket on behalf of a stream: `give` runs, with the
    /// socket now owned by the fan-out, at hyper's next flush.
    pub fn ask(&self, give: Box<dyn FnOnce(Arc<Wire>) + Send>, body: &Waker) {
        let mut state = self.lock();
        debug_assert!(matches!(state.holder, Holder::Hyper));
        state.holder = Holder::Asked(give);
        state.body = Some(body.clone());
    }

    /// For the stream's body: pending while the fan-out has the socket (or
    /// is about to); ready once it came back (with why) and its backlog is
    /// written, or with `None` if hyper holds it. Registers the body to be
    /// woken.
    pub fn poll_returned(&self, cx: &mut Context<'_>) -> Poll<Option<Return>> {
        let mut state = self.lock();
        state.body = Some(cx.waker().clone());
        match state.holder {
            Holder::Hyper => Poll::Ready(None),
            Holder::Asked(_) => Poll::Pending,
            Holder::FanOut => match self.poll_drain(&mut state, cx) {
                // The fan-out queued bytes the socket could not take; they
                // are written from here when the socket is ready.
                Poll::Ready(Err(_)) => {
                    state.holder = Holder::Hyper;
                    Poll::Ready(Some(Return::Failed))
                }
                _ => Poll::Pending,
            },
            Holder::Returned(why) => match self.poll_drain(&mut state, cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Err(_)) => {
                    state.holder = Holder::Hyper;
                    Poll::Ready(Some(Return::Failed))
                }
                Poll::Ready(Ok(())) => {
                    state.holder = Holder::Hyper;
                    Poll::Ready(Some(why))
                }
            },
        }
    }

    /// Takes the socket back from the fan-out (the stream stops for its own
    /// reasons: shutdown, a revoked credential), or withdraws a request for
    /// it. After this, the fan-out never writes to it again.
    /// Returns whether the fan-out held it (it then drops its member at its
    /// next pass).
    pub fn reclaim(&self) -> bool {
        // What the backlog holds is still written before hyper's next bytes.
        let mut state = self.lock();
        let held = matches!(state.holder, Holder::FanOut);
        state.holder = Holder::Hyper;
        state.body = None;
        held
    }

    /// Writes `data` as one chunk if the fan-out holds the socket; bytes
    /// the socket does not take now go to the backlog. `Err` when the
    /// socket is not the fan-out's any more, or the backlog is full, or the
    /// socket failed: the caller stops writing and gives it back.
    pub fn write_chunk(&self, chunk: &Bytes) -> Result<(), Stopped> {
        let mut state = self.lock();
        if !matches!(state.holder, Holder::FanOut) {
            return Err(Stopped::NotHeld);
        }
        if state.backlog_bytes + chunk.len() > MAX_BACKLOG {
            return Err(Stopped::Slow);
        }
        let mut written = 0;
        if state.backlog.is_empty() {
            match self.stream.try_write(chunk) {
                Ok(n) => written = n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return Err(Stopped::Failed),
            }
        }
        if written < chunk.len() {
            state.backlog_bytes += chunk.len() - written;
            state.backlog.push_back(chunk.slice(written..));
            if let Some(body) = &state.body {
                body.wake_by_ref();
            }
        }
        Ok(())
    }

    /// The fan-out gives the socket back.
    pub fn give_back(&self, why: Return) {
        let mut state = self.lock();
        if matches!(state.holder, Holder::FanOut) {
            state.holder = Holder::Returned(why);
            if let Some(body) = state.body.take() {
                body.wake();
            }
        }
    }

    /// Whether the fan-out still holds the socket.
    pub fn held_by_fan_out(&self) -> bool {
        matches!(self.lock().holder, Holder::FanOut)
    }

    /// Writes the backlog; ready when it is empty.
    fn poll_drain(&self, state: &mut WireState, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some(front) = state.backlog.front_mut() {
            match self.stream.try_write(front) {
                Ok(n) => {
                    state.backlog_bytes -= n;
                    front.advance(n);
                    if front.is_empty() {
                        state.backlog.pop_front();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::task::ready!(self.stream.poll_write_ready(cx))?;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        Poll::Ready(Ok(()))
    }
}

/// Why the fan-out must stop writing to a socket.
#[derive(Debug, PartialEq, Eq)]
pub enum Stopped {
    NotHeld,
    Slow,
    Failed,
}

/// The HTTP/1.1 chunk of `data`.
pub fn chunk(data: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(data.len() + 12);
    out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    Bytes::from(out)
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            std::task::ready!(self.wire.stream.poll_read_ready(cx))?;
            match self.wire.stream.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl Conn {
    /// hyper writes after the backlog. It never writes while the fan-out
    /// holds the socket, except to close a connection whose client went
    /// away: then the fan-out loses the socket first, so bytes never
    /// interleave.
    fn poll_ready_for_hyper(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut state = self.wire.lock();
        if matches!(state.holder, Holder::FanOut) {
            state.holder = Holder::Returned(Return::Failed);
        }
        self.wire.poll_drain(&mut state, cx)
    }

    /// One write of hyper's: `write` until the socket takes some bytes.
    fn poll_hyper_write(
        &self,
        cx: &mut Context<'_>,
        write: impl Fn(&TcpStream) -> io::Result<usize>,
    ) -> Poll<io::Result<usize>> {
        std::task::ready!(self.poll_ready_for_hyper(cx))?;
        loop {
            match write(&self.wire.stream) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::task::ready!(self.wire.stream.poll_write_ready(cx))?;
                }
                other => return Poll::Ready(other),
            }
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_hyper_write(cx, |s| s.try_write(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.poll_hyper_write(cx, |s| s.try_write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// hyper's buffer is empty whenever it calls this: the one place where
    /// the socket may change hands.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut state = self.wire.lock();
        std::task::ready!(self.wire.poll_drain(&mut state, cx))?;
        if matches!(state.holder, Holder::Asked(_)) {
            let Holder::Asked(give) = std::mem::replace(&mut state.holder, Holder::FanOut) else {
                unreachable!("matched above");
            };
            drop(state);
            give(self.wire.clone());
        }
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.as_ref().poll_ready_for_hyper(cx))?;
        let this = &mut *self;
        let linger = this.linger.get_or_insert_with(|| {
            // FIN now (the fan-out may still hold a reference to the socket).
            let _ = socket2::SockRef::from(&this.wire.stream).shutdown(std::net::Shutdown::Write);
            Linger {
                until: Box::pin(tokio::time::sleep(LINGER)),
                dropped: 0,
            }
        });
        let mut scratch = [0u8; 16 * 1024];
        loop {
            if linger.until.as_mut().poll(cx).is_ready() || linger.dropped > LINGER_BYTES {
                return Poll::Ready(Ok(()));
            }
            match this.wire.stream.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => {}
            }
            match this.wire.stream.try_read(&mut scratch) {
                Ok(n) if n > 0 => linger.dropped += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // The client closed too, or the socket failed: done.
                _ => return Poll::Ready(Ok(())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A served connection on a real loopback socket, and its client.
    async fn pair() -> (Conn, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (served, _) = listener.accept().await.unwrap();
        (Conn::new(served), client)
    }

    /// Asks for the socket and lets a flush (as hyper's) hand it over.
    async fn hand_over(conn: &mut Conn) -> Arc<Wire> {
        let (tx, rx) = std::sync::mpsc::channel();
        conn.handle().ask(
            Box::new(move |wire| tx.send(wire).unwrap()),
            futures_util::task::noop_waker_ref(),
        );
        assert!(rx.try_recv().is_err(), "handed over before a flush");
        conn.flush().await.unwrap();
        let wire = rx.try_recv().expect("a flush hands the socket over");
        assert!(wire.held_by_fan_out());
        wire
    }

    #[tokio::test]
    async fn bytes_keep_their_order_across_hand_over_backlog_and_give_back() {
        let (mut conn, mut client) = pair().await;
        conn.write_all(b"head;").await.unwrap();
        let wire = hand_over(&mut conn).await;
        // The client reads nothing: the socket fills, the rest waits in
        // the backlog, and past its bound the client counts as slow.
        let piece = Bytes::from(vec![b'x'; 16 * 1024]);
        let mut sent = 0usize;
        loop {
            match wire.write_chunk(&piece) {
                Ok(()) => sent += 1,
                Err(stopped) => {
                    assert_eq!(stopped, Stopped::Slow);
                    break;
                }
            }
            assert!(sent < 100_000, "the backlog never filled");
        }
        wire.give_back(Return::Behind(7));
        assert!(wire.write_chunk(&piece).is_err(), "written after give-back");
        // hyper's next bytes come after everything the fan-out wrote.
        let writer = tokio::spawn(async move {
            let returned = std::future::poll_fn(|cx| conn.handle().poll_returned(cx)).await;
            assert_eq!(returned, Some(Return::Behind(7)));
            conn.write_all(b";tail").await.unwrap();
            conn.shutdown().await.unwrap();
        });
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        drop(client); // ends the server's lingering close
        writer.await.unwrap();
        assert!(got.starts_with(b"head;"));
        assert!(got.ends_with(b";tail"));
        let middle = &got[5..got.len() - 5];
        assert_eq!(middle.len(), sent * piece.len());
        assert!(middle.iter().all(|&b| b == b'x'));
    }

    #[tokio::test]
    async fn a_reclaimed_socket_is_never_written_by_the_fan_out() {
        let (mut conn, mut client) = pair().await;
        let wire = hand_over(&mut conn).await;
        wire.write_chunk(&Bytes::from_static(b"one")).unwrap();
        assert!(wire.reclaim(), "the fan-out held it");
        assert_eq!(
            wire.write_chunk(&Bytes::from_static(b"two")),
            Err(Stopped::NotHeld)
        );
        conn.write_all(b"three").await.unwrap();
        let closing = tokio::spawn(async move { conn.shutdown().await });
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"onethree");
        drop(client);
        closing.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn an_early_answer_reaches_a_client_that_is_still_sending() {
        let (mut conn, client) = pair().await;
        // Small buffers, so that the body cannot hide in them.
        socket2::SockRef::from(&conn.wire.stream)
            .set_recv_buffer_size(32 * 1024)
            .unwrap();
        socket2::SockRef::from(&client)
            .set_send_buffer_size(32 * 1024)
            .unwrap();
        let (mut from_client, mut to_server) = client.into_split();
        // As a 413: the answer goes out before the request body was read.
        conn.write_all(b"answer").await.unwrap();
        let closing = tokio::spawn(async move { conn.shutdown().await });
        to_server
            .write_all(&vec![b'b'; 2 << 20])
            .await
            .expect("the server reset the connection under a client still sending");
        let mut got = Vec::new();
        from_client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"answer");
        drop((from_client, to_server));
        closing.await.unwrap().unwrap();
    }

    #[test]
    fn chunks_are_http_1_1_chunks() {
        assert_eq!(&chunk(b"hello, world")[..], b"c\r\nhello, world\r\n");
    }

    /// A streaming body as an SSE stream's: one replayed frame through
    /// hyper, then the socket handed to a writer outside hyper (as the
    /// fan-out), then given back and one more frame through hyper.
    struct HandOverBody {
        wire: Arc<Wire>,
        step: u8,
    }

    impl hyper::body::Body for HandOverBody {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
            let data =
                |s: &'static str| Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from(s)))));
            match self.step {
                0 => {
                    self.step = 1;
                    data("replayed;")
                }
                1 => {
                    // Written by the "fan-out" at hyper's next flush, which
                    // hyper makes when the body has nothing to give.
                    self.wire.ask(
                        Box::new(|wire| {
                            for line in ["live-1;", "live-2;"] {
                                wire.write_chunk(&chunk(line.as_bytes())).unwrap();
                            }
                            wire.give_back(Return::Ended);
                        }),
                        cx.waker(),
                    );
                    self.step = 2;
                    Poll::Pending
                }
                2 => match self.wire.poll_returned(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(why) => {
                        assert_eq!(why, Some(Return::Ended), "hyper held the socket");
                        self.step = 3;
                        data("after;")
                    }
                },
                _ => Poll::Ready(None),
            }
        }
    }

    /// The behaviour the hand-over relies on, checked against the hyper
    /// that is built (Cargo.toml pins it): hyper flushes its buffer, with
    /// `poll_flush`, when a chunked body is pending, and writes nothing of
    /// the response between that flush and the body's next frame. A hyper
    /// that buffered the first chunk past the flush, or wrote a chunk
    /// header early, breaks the order or the framing this test reads.
    #[tokio::test]
    async fn a_real_hyper_connection_hands_its_socket_over_and_back() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (served, _) = listener.accept().await.unwrap();
            let conn = Conn::new(served);
            let wire = conn.handle();
            let service = hyper::service::service_fn(move |_req| {
                let body = HandOverBody {
                    wire: wire.clone(),
                    step: 0,
                };
                async move { Ok::<_, std::convert::Infallible>(hyper::Response::new(body)) }
            });
            hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(conn), service)
                .await
        });
        let mut client = TcpStream::connect(addr).await.unwrap();
        client
            .write_all(b"GET /stream HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut raw = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            client.read_to_end(&mut raw),
        )
        .await
        .expect("the response ended")
        .unwrap();
        server.await.unwrap().unwrap();
        let text = String::from_utf8(raw).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").expect("a head");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("transfer-encoding: chunked"),
            "{head}"
        );
        // De-chunk: every chunk well framed, in order, then the last chunk.
        let mut rest = body;
        let mut got = String::new();
        loop {
            let (size, after) = rest.split_once("\r\n").expect("a chunk size line");
            let size = usize::from_str_radix(size, 16).expect("a hex chunk size");
            if size == 0 {
                assert_eq!(after, "\r\n", "bytes after the last chunk");
                break;
            }
            got.push_str(&after[..size]);
            assert_eq!(&after[size..size + 2], "\r\n", "a chunk without its CRLF");
            rest = &after[size + 2..];
        }
        assert_eq!(got, "replayed;live-1;live-2;after;");
    }
}
