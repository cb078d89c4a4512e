//! The event hub: state events written in the same transaction as the change
//! they describe and published after the commit; log lines published as they
//! arrive and kept here until their chunk commits (spec events.md).
//!
//! A subscriber registers with the hub *before* it reads the store, and gets
//! the not-yet-committed lines as a snapshot under the same lock, so nothing
//! falls between "replayed from the store" and "live". Each channel keeps
//! a bounded tail of recent batches that all its subscribers read; one that
//! falls further behind than the tail catches up from the store on its own
//! (see `stream`), so it never slows the build or anyone else.

mod body;
pub mod fanout;
mod frame;
mod hub;
pub mod stream;

pub use frame::{Batch, Frame, LogLines};
pub use hub::{Hub, Lagged, Peeked, Subscription};

use std::sync::Arc;

use crate::model::{BuildId, BuildRecord, DeploymentRecord, Millis};
use crate::store::Lookup;
use crate::store::{StoreResult, StoredEvent, Tx};

/// Recent batches a channel keeps for its live subscribers: a subscriber
/// further behind than this catches up from the store.
pub const TAIL_BATCHES: usize = 1024;
/// The same bound in bytes, so a deployer writing 64 KiB reads cannot make
/// the tail hold 64 MiB.
pub const TAIL_BYTES: usize = 1 << 20;
/// Log seqs reserved ahead of use: a crash never lets an id be reused.
pub const SEQ_BLOCK: u64 = 65_536;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Channel {
    Deployment(String),
    Build(BuildId),
}

/// Stores a build's status event (with the build summary) and publishes it
/// after the commit. Only `engine::transition` calls this (and stores the
/// build record after it, with the seq it took). Returns the summary as
/// the event carries it, for the deployment channel's `build` event of the
/// same change (`deployment_changed`), which carries the same text.
pub fn build_status(
    tx: &Tx,
    hub: &Arc<Hub>,
    b: &mut BuildRecord,
    now: Millis,
) -> StoreResult<String> {
    let seq = b.event_seq + 1;
    b.event_seq = seq;
    b.seq_reserved = b.seq_reserved.max(seq);
    let summary = event_json(&b.summary())?;
    tx.put_build_event(
        b.id,
        seq,
        &StoredEvent {
            event: BuildEvent::Status.name().into(),
            data: summary.clone(),
            at: now,
        },
    )?;
    let (hub, id, last, data) = (hub.clone(), b.id, b.status.is_finished(), summary.clone());
    tx.after_commit(move || {
        hub.publish(
            &Channel::Build(id),
            Frame::new(seq, BuildEvent::Status.name(), data, last),
        )
    });
    Ok(summary)
}

/// The events a build channel stores besides its log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildEvent {
    /// The build summary, at each status change.
    Status,
    /// One node's answer to a health check (lifecycle.md).
    Health,
    /// A worker claimed the build, or lost it (workers.md).
    Attempt,
    /// A rollout's summary, at each change the runner sees (rollouts.md).
    Rollout,
}

impl BuildEvent {
    pub const fn name(self) -> &'static str {
        match self {
            BuildEvent::Status => "status",
            BuildEvent::Health => "health",
            BuildEvent::Attempt => "attempt",
            BuildEvent::Rollout => "rollout",
        }
    }

    /// The kind of a stored event by its name; `None` for a name no berth
    /// stores (damage).
    pub fn named(name: &str) -> Option<BuildEvent> {
        [
            BuildEvent::Status,
            BuildEvent::Health,
            BuildEvent::Attempt,
            BuildEvent::Rollout,
        ]
        .into_iter()
        .find(|e| e.name() == name)
    }
}

/// A `health` event of a running build, at `seq` (a gap in its log's seqs,
/// `LogBuffer::take_gap`), published after the commit.
pub fn build_health(
    tx: &Tx,
    hub: &Arc<Hub>,
    build: BuildId,
    seq: u64,
    data: String,
    now: Millis,
) -> StoreResult<()> {
    build_event_amid_log(tx, hub, build, seq, BuildEvent::Health, data, now)
}

/// An event of a running build that takes a seq amid its log lines (a
/// gap, `LogBuffer::take_gap`): stored, and published after the commit.
pub fn build_event_amid_log(
    tx: &Tx,
    hub: &Arc<Hub>,
    build: BuildId,
    seq: u64,
    kind: BuildEvent,
    data: String,
    now: Millis,
) -> StoreResult<()> {
    tx.put_build_event(
        build,
        seq,
        &StoredEvent {
            event: kind.name().into(),
            data: data.clone(),
            at: now,
        },
    )?;
    let hub = hub.clone();
    tx.after_commit(move || {
        hub.publish(
            &Channel::Build(build),
            Frame::new(seq, kind.name(), data, false),
        )
    });
    Ok(())
}

/// An event's data. A summary always serializes (string keys, no
/// non-finite numbers); if it ever did not, the change fails rather than
/// storing an event without data.
fn event_json(summary: &impl serde::Serialize) -> StoreResult<String> {
    serde_json::to_string(summary)
        .map_err(|e| crate::store::StoreError::other(format!("cannot encode an event: {e}")))
}

/// Only `engine::transition` calls this. Stores the deployment-channel
/// events of a change: `build` (when a build changed: the build and the
/// summary its status event carries, `build_status`) then `deployment`
/// with the summary after the change. Returns that summary's JSON, so an
/// answer that shows it does not encode it again.
pub fn deployment_changed(
    tx: &Tx,
    hub: &Arc<Hub>,
    d: &mut DeploymentRecord,
    changed: Option<(&BuildRecord, String)>,
    now: Millis,
) -> StoreResult<String> {
    let data = match changed {
        Some((b, summary)) if d.last_build == Some(b.id) => {
            let data = summary_with_build_text(d, &summary)?;
            debug_assert_eq!(
                event_json(&d.summary(Some(b))).ok().as_deref(),
                Some(data.as_str()),
                "the deployment summary put together is not the one encoded whole"
            );
            deployment_event(tx, hub, d, "build", summary, now)?;
            data
        }
        Some((_, summary)) => {
            deployment_event(tx, hub, d, "build", summary, now)?;
            stored_last_build_summary(tx, d)?
        }
        None => stored_last_build_summary(tx, d)?,
    };
    deployment_event(tx, hub, d, "deployment", data.clone(), now)?;
    Ok(data)
}

/// The deployment's summary as JSON, its last build read from the store.
fn stored_last_build_summary(tx: &Tx, d: &DeploymentRecord) -> StoreResult<String> {
    let last_build = match d.last_build {
        Some(id) => tx.build(id)?,
        None => None,
    };
    event_json(&d.summary(last_build.as_ref()))
}

/// The deployment's summary as JSON, with `build_text` (its last build's
/// summary as that build's status event stored it) as `last_build`: the
/// build is not encoded a second time, inside the deployment. Why: every
/// status change of a build stores both events, and on the store's writer
/// thread the second encoding of the build was half of all the encoding
/// of build summaries. `last_build` is the summary's last field, so the
/// summary encoded without a build ends with `null}`, and the build's
/// text takes the place of that `null`.
fn summary_with_build_text(d: &DeploymentRecord, build_text: &str) -> StoreResult<String> {
    const WITHOUT_BUILD: &str = ",\"last_build\":null}";
    let mut text = event_json(&d.summary(None))?;
    if !text.ends_with(WITHOUT_BUILD) {
        return Err(crate::store::StoreError::other(
            "a deployment summary's last field is not last_build (events::summary_with_build_text relies on it)",
        ));
    }
    text.truncate(text.len() - "null}".len());
    text.reserve(build_text.len() + 1);
    text.push_str(build_text);
    text.push('}');
    Ok(text)
}

/// The event types of the deployment channel (events.md), as stored.
pub const DEPLOYMENT_EVENTS: [&str; 6] = [
    "deployment",
    "build",
    "sbom",
    "rollout",
    "node",
    "node.drifted",
];

/// A stored event's type as a replay sends it; a name this berth does not
/// know (none is stored) is sent as `deployment`.
pub fn deployment_event_name(stored: &str) -> &'static str {
    DEPLOYMENT_EVENTS
        .into_iter()
        .find(|known| *known == stored)
        .unwrap_or("deployment")
}

/// Stores one more event of the deployment channel and publishes it after
/// the commit (hooks run in commit order). Only `engine::transition` (and
/// what it calls) does this; the caller stores the deployment record with
/// its new `event_seq`.
pub fn deployment_event(
    tx: &Tx,
    hub: &Arc<Hub>,
    d: &mut DeploymentRecord,
    event: &'static str,
    data: String,
    now: Millis,
) -> StoreResult<()> {
    debug_assert!(DEPLOYMENT_EVENTS.contains(&event), "{event}");
    d.event_seq += 1;
    let seq = d.event_seq;
    tx.put_deployment_event(
        &d.id,
        seq,
        &StoredEvent {
            event: event.to_string(),
            data: data.clone(),
            at: now,
        },
    )?;
    let (hub, id) = (hub.clone(), d.id.clone());
    tx.after_commit(move || {
        hub.publish(
            &Channel::Deployment(id),
            Frame::new(seq, event, data, false),
        )
    });
    Ok(())
}
