//! A remote build's log: lines and events amid them, each with the next id
//! of the build channel, stored by write jobs (a worker's progress, berth's
//! own lines about a remote build) and published after the commit.
//!
//! Why it exists apart from `attempts`: both the worker routes
//! (`attempts`) and a remote rollout's runner (`remote_rollout`) write
//! into such a log; neither owns it.

use std::sync::Arc;

use super::log_pipe::{Chunk, LogBuffer};
use crate::events::{BuildEvent, Channel, Frame, Hub};
use crate::model::*;
use crate::store::{StoreResult, Tx};

/// What goes into a build's log amid its lines.
pub enum Amid {
    Line(String),
    Event(BuildEvent, String),
}

/// Stores lines and events amid them, each with the next id of the build
/// channel, and publishes them together after the commit. Lines past
/// `--max-log-bytes` are counted in the attempt, not stored; an event
/// past `MAX_LOG_GAPS` is kept only as its line.
pub fn append_amid(
    tx: &Tx,
    hub: &Arc<Hub>,
    b: &mut BuildRecord,
    a: &mut AttemptRecord,
    max_log: u64,
    items: &[Amid],
    now: Millis,
) -> StoreResult<()> {
    let mut log = LogBuffer::resume(b, max_log, a.dropped_lines);
    // (seq, kind, data) of what is stored, for the frames made after the
    // commit (only when someone listens).
    let mut sent: Vec<(u64, &'static str, String)> = Vec::with_capacity(items.len());
    for item in items {
        match item {
            Amid::Line(line) => match log.push(line) {
                Some(seq) => sent.push((seq, "log", line.clone())),
                None => {
                    a.dropped_lines += 1;
                    a.dropped_bytes += line.len() as u64 + 1;
                }
            },
            Amid::Event(kind, data) => {
                if log.gaps.len() >= MAX_LOG_GAPS {
                    continue;
                }
                store_chunk(tx, b, &mut log)?;
                let (seq, _) = log.take_gap();
                tx.put_build_event(
                    b.id,
                    seq,
                    &crate::store::StoredEvent {
                        event: kind.name().into(),
                        data: data.clone(),
                        at: now,
                    },
                )?;
                sent.push((seq, kind.name(), data.clone()));
            }
        }
    }
    store_chunk(tx, b, &mut log)?;
    let last = log.next_seq - 1;
    b.event_seq = b.event_seq.max(last);
    b.seq_reserved = b.seq_reserved.max(last);
    b.log_gaps = log.gaps.clone();
    let (hub, build) = (hub.clone(), b.id);
    tx.after_commit(move || {
        let channel = Channel::Build(build);
        if hub.listened(&channel) {
            let frames = sent
                .into_iter()
                .map(|(seq, kind, data)| Frame::new(seq, kind, data, false))
                .collect();
            hub.publish_all(&channel, frames);
        }
        hub.committed(build, last);
    });
    Ok(())
}

fn store_chunk(tx: &Tx, b: &mut BuildRecord, log: &mut LogBuffer) -> StoreResult<()> {
    if let Some(chunk) = log.take_chunk() {
        let chunk: Chunk = chunk.compress()?;
        chunk.store(tx, b)?;
    }
    Ok(())
}
