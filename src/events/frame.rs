//! How events become SSE bytes: a frame is encoded once and written to any
//! number of subscribers; consecutive frames travel as one batch; a writer
//! gathers what a client needs into one buffer.

use std::sync::Arc;

use bytes::Bytes;

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
    let mut out = Vec::with_capacity(data.len() + event.len() + 36);
    encode_into(&mut out, seq, event, data);
    bytes::Bytes::from(out)
}

/// Appends one event's SSE text to `out`, in place.
fn encode_into(out: &mut Vec<u8>, seq: u64, event: &str, data: &str) {
    // Not `write!`: the formatting machinery was a tenth of a busy log's
    // line path (every line of a build passes here).
    out.extend_from_slice(b"id: ");
    out.extend_from_slice(itoa::Buffer::new().format(seq).as_bytes());
    out.extend_from_slice(b"\nevent: ");
    out.extend_from_slice(event.as_bytes());
    out.push(b'\n');
    if memchr::memchr2(b'\n', b'\r', data.as_bytes()).is_none() {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(data.as_bytes());
        out.extend_from_slice(b"\n\n");
        return;
    }
    for part in data.split(['\n', '\r']) {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(part.as_bytes());
        out.push(b'\n');
    }
    out.push(b'\n');
}

/// Consecutive log lines encoded into one buffer as they arrive: each frame
/// is then a slice of it, and their batch is the buffer itself (no copy
/// per line, none to join them). The line path of a busy build.
#[derive(Default)]
pub struct LogLines {
    text: Vec<u8>,
    /// (seq, end of the line's SSE text in `text`).
    lines: Vec<(u64, usize)>,
}

impl LogLines {
    pub fn push(&mut self, seq: u64, line: &str) {
        debug_assert!(
            self.lines.last().is_none_or(|&(last, _)| last < seq),
            "log lines out of order"
        );
        encode_into(&mut self.text, seq, "log", line);
        self.lines.push((seq, self.text.len()));
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// The frames and their batch; leaves this empty.
    pub fn take(&mut self) -> Option<(Vec<Arc<Frame>>, Arc<Batch>)> {
        if self.lines.is_empty() {
            return None;
        }
        let text = Bytes::from(std::mem::take(&mut self.text));
        let mut start = 0;
        let frames: Vec<Arc<Frame>> = self
            .lines
            .drain(..)
            .map(|(seq, end)| {
                let frame = Arc::new(Frame {
                    seq,
                    event: "log",
                    data: String::new(),
                    last: false,
                    encoded: text.slice(start..end),
                });
                start = end;
                frame
            })
            .collect();
        let batch = Arc::new(Batch {
            frames: frames.clone(),
            encoded: text,
        });
        Some((frames, batch))
    }
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

/// Encoded events gathered into one buffer, so that many lines that
/// arrived together cost the client one write.
#[derive(Default)]
pub(super) struct Gather {
    parts: Vec<Bytes>,
    pub(super) size: usize,
}

impl Gather {
    /// The gathered bytes as one buffer, if any.
    pub(super) fn take(&mut self) -> Option<Bytes> {
        let bytes = match self.parts.len() {
            0 => return None,
            1 => self.parts.pop().expect("one part"),
            _ => {
                let mut joined = Vec::with_capacity(self.size);
                for p in self.parts.drain(..) {
                    joined.extend_from_slice(&p);
                }
                Bytes::from(joined)
            }
        };
        self.size = 0;
        Some(bytes)
    }

    pub(super) fn push(&mut self, frame: &Frame) {
        self.push_bytes(frame.encoded());
    }
    pub(super) fn push_bytes(&mut self, bytes: &Bytes) {
        self.size += bytes.len();
        self.parts.push(bytes.clone());
    }
    /// Gathers what of `batch` is after `last`; returns the final status
    /// frame when the batch has it.
    pub(super) fn push_batch(&mut self, batch: &Batch, last: &mut u64) -> Option<Arc<Frame>> {
        if batch.last_seq() <= *last {
            return None;
        }
        if batch.first_seq() > *last {
            self.push_bytes(batch.encoded());
            *last = batch.last_seq();
        } else {
            let from = *last;
            for f in batch.frames.iter().filter(|f| f.seq > from) {
                self.push(f);
                *last = f.seq;
            }
        }
        batch.frames.iter().find(|f| f.last).cloned()
    }
    pub(super) fn raw(&mut self, text: &str) {
        self.push_bytes(&Bytes::from(text.to_string()));
    }
}

/// The live events of `batches` after `last` as one buffer, and whether
/// they end the stream (then the buffer ends with `end`).
pub(super) fn gather_live(batches: &[Arc<Batch>], last: &mut u64) -> (Option<Bytes>, bool) {
    let mut out = Gather::default();
    for batch in batches {
        if let Some(final_frame) = out.push_batch(batch, last) {
            out.raw(&end_text(&final_frame));
            return (out.take(), true);
        }
    }
    (out.take(), false)
}

pub(super) fn end_text(final_status: &Frame) -> String {
    format!("event: end\ndata: {}\n\n", final_status.data)
}

pub(super) fn resync(reason: &str) -> String {
    format!("event: resync_required\ndata: {{\"reason\":\"{reason}\"}}\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_encoded_as_sse_text() {
        assert_eq!(
            &encode(7, "log", "make: ok")[..],
            b"id: 7\nevent: log\ndata: make: ok\n\n"
        );
        // A break in the data (never in a captured line) becomes data lines.
        assert_eq!(
            &encode(18446744073709551615, "status", "a\nb\rc")[..],
            b"id: 18446744073709551615\nevent: status\ndata: a\ndata: b\ndata: c\n\n"
        );
        assert_eq!(&encode(1, "log", "")[..], b"id: 1\nevent: log\ndata: \n\n");
    }

    #[test]
    fn log_lines_share_one_buffer_and_equal_frames_made_one_by_one() {
        let mut lines = LogLines::default();
        assert!(lines.take().is_none());
        for (seq, text) in [(5, "one"), (6, ""), (7, "three\rwith a break")] {
            lines.push(seq, text);
        }
        let (frames, batch) = lines.take().unwrap();
        assert!(lines.is_empty() && lines.take().is_none());
        let single: Vec<_> = [(5, "one"), (6, ""), (7, "three\rwith a break")]
            .into_iter()
            .map(|(seq, text)| Frame::new(seq, "log", text.to_string(), false))
            .collect();
        for (a, b) in frames.iter().zip(&single) {
            assert_eq!((a.seq, a.event, a.encoded()), (b.seq, b.event, b.encoded()));
        }
        assert_eq!(batch.encoded(), Batch::new(single).encoded());
        assert_eq!((batch.first_seq(), batch.last_seq()), (5, 7));
    }
}
