//! Authority over a build: the vocabulary workers, rollouts and agents
//! share (workers.md "Words" and "Every internal call"), as pure rules with
//! no I/O, tested directly.
//!
//! Why it exists: berth stays the only writer of state while a worker on
//! another machine runs a build. A worker holds a time-bounded authority
//! (an attempt id, a fence, its incarnation, a lease); whatever it sends
//! without it must have no effect at all. Every rule about that (the ids,
//! the order of the checks, the replay of a resent call, the lease, which
//! progress items apply) is written once here, and the engine's write jobs
//! only load the records, call these, and store what they return.

use sha2::{Digest, Sha256};

use crate::model::{
    AttemptRecord, AttemptState, BuildId, BuildStatus, KeptReply, LossCause, Millis,
};

/// `--lease-ttl`: the default and its bounds (workers.md "Words").
pub const LEASE_TTL_DEFAULT_MS: u64 = 30_000;
pub const LEASE_TTL_MIN_MS: u64 = 5_000;
pub const LEASE_TTL_MAX_MS: u64 = 600_000;
/// Labels in one set at most, and the longest label.
pub const MAX_LABELS: usize = 32;
pub const MAX_LABEL_LEN: usize = 63;
/// Answers an attempt keeps for replays. A worker resends only the call it
/// has in flight (one per route: workers.md "Progress"), so the last few
/// of each route are every answer a resend can ask for.
pub const KEPT_REPLIES: usize = 16;
/// Authoritative attempts one worker may hold at once (`--slots` 1-64).
pub const MAX_ATTEMPTS_PER_WORKER: usize = 64;
/// Items in one progress batch at most.
pub const MAX_BATCH_ITEMS: usize = 1000;
/// The longest log line a worker may send (bytes).
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// A worker's `last_seen_at` is stored at most this often.
pub const SEEN_EVERY_MS: Millis = 30_000;
/// The name of the embedded worker; no token may take it.
pub const LOCAL_WORKER: &str = "local";

/// A label: `^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`.
pub fn is_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_LABEL_LEN
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

/// A comma-separated label set (empty text: none), each label valid, at
/// most `MAX_LABELS`, sorted without repeats.
pub fn parse_labels(text: &str) -> Result<Vec<String>, String> {
    if text.is_empty() {
        return Ok(vec![]);
    }
    let mut labels: Vec<String> = text.split(',').map(str::to_string).collect();
    if let Some(bad) = labels.iter().find(|l| !is_label(l)) {
        let shown = if bad.is_empty() {
            "an empty label"
        } else {
            "a label"
        };
        return Err(format!(
            "{shown} is not a label (letters, digits, `.`, `_` and `-`, starting with a letter or digit, at most {MAX_LABEL_LEN})"
        ));
    }
    labels.sort();
    labels.dedup();
    if labels.len() > MAX_LABELS {
        return Err(format!("at most {MAX_LABELS} labels"));
    }
    Ok(labels)
}

/// An id of an attempt or an incarnation:
/// `^[A-Za-z0-9][A-Za-z0-9_-]{7,127}$`.
pub fn is_authority_id(s: &str) -> bool {
    let b = s.as_bytes();
    (8..=128).contains(&b.len())
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-'))
}

/// An `operation_id`: 16-128 of `[A-Za-z0-9._~-]`.
pub fn is_operation_id(s: &str) -> bool {
    (16..=128).contains(&s.len())
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'~' | b'-'))
}

/// The id of the attempt of `build` under `fence`. It names both, so a
/// call finds its attempt without an index; what it may do is decided by
/// its token, fence and incarnation, never by knowing the id.
pub fn attempt_id(build: BuildId, fence: u64) -> String {
    format!("att-{}-{fence}", uuid::Uuid::from_u128(build).simple())
}

/// The build and fence an attempt id names; `None` for an id berth could
/// not have made.
pub fn parse_attempt_id(id: &str) -> Option<(BuildId, u64)> {
    let rest = id.strip_prefix("att-")?;
    let (build, fence) = rest.split_once('-')?;
    if build.len() != 32 || fence.is_empty() || fence.starts_with('0') {
        return None;
    }
    let build = uuid::Uuid::try_parse(build).ok()?.as_u128();
    let fence = fence.parse::<u64>().ok()?;
    Some((build, fence))
}

/// The authority a call carries.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    pub operation_id: &'a str,
    pub fence: u64,
    pub incarnation: &'a str,
}

/// Why a call's authority is refused (`409 precondition_failed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stale {
    /// Another fence or incarnation, or an attempt that ended otherwise.
    Authority,
    /// The lease passed (lost by expiry, or lost now).
    LeaseExpired,
}

impl Stale {
    pub const fn reason(self) -> &'static str {
        match self {
            Stale::Authority => "stale_authority",
            Stale::LeaseExpired => "lease_expired",
        }
    }
}

/// The authority check, after the token, the shape, the attempt and the
/// replay (workers.md "Every internal call"): another incarnation or fence
/// is stale; then a lease that passed; then an attempt that ended
/// otherwise. `Ok` means the call may change state.
pub fn judge(a: &AttemptRecord, call: &Call, now: Millis) -> Result<(), Stale> {
    if call.incarnation != a.incarnation || call.fence != a.fence {
        return Err(Stale::Authority);
    }
    match a.state {
        AttemptState::Active if lease_passed(a, now) => Err(Stale::LeaseExpired),
        AttemptState::Active => Ok(()),
        AttemptState::Lost => match a.lost_by {
            Some(LossCause::LeaseExpired) => Err(Stale::LeaseExpired),
            Some(LossCause::TokenRevoked) | None => Err(Stale::Authority),
        },
        AttemptState::Ended | AttemptState::Interrupted => Err(Stale::Authority),
    }
}

/// Whether an active attempt's lease has passed at `now`.
pub fn lease_passed(a: &AttemptRecord, now: Millis) -> bool {
    a.lease_expires_at.is_some_and(|at| now >= at)
}

/// SHA-256 of a request body, hex: what a replay compares.
pub fn body_digest(body: &[u8]) -> String {
    crate::hex::encode(&Sha256::digest(body))
}

/// What a call's `operation_id` finds among the kept answers.
#[derive(Debug, PartialEq, Eq)]
pub enum Replay<'a> {
    /// Not seen: judge and run it.
    New,
    /// The same call again: its first answer, and nothing changes.
    Same(&'a str),
    /// The same id with another body: `409 idempotency_conflict`.
    Conflict,
}

pub fn replay<'a>(
    a: &'a AttemptRecord,
    route: &str,
    operation_id: &str,
    digest: &str,
) -> Replay<'a> {
    match a
        .replies
        .iter()
        .find(|r| r.route == route && r.operation_id == operation_id)
    {
        None => Replay::New,
        Some(r) if r.body_digest == digest => Replay::Same(&r.answer),
        Some(_) => Replay::Conflict,
    }
}

/// Keeps an accepted call's answer for its replays (the oldest goes past
/// `KEPT_REPLIES`).
pub fn keep_reply(
    a: &mut AttemptRecord,
    route: &str,
    operation_id: &str,
    digest: &str,
    answer: String,
) {
    if a.replies.len() >= KEPT_REPLIES {
        a.replies.remove(0);
    }
    a.replies.push(KeptReply {
        route: route.to_string(),
        operation_id: operation_id.to_string(),
        body_digest: digest.to_string(),
        answer,
    });
    assert!(a.replies.len() <= KEPT_REPLIES);
}

/// Why a claim is refused (`409 conflict`, by its reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimRefusal {
    AlreadyClaimed,
    NotQueued,
    NotClaimable,
    LabelsMismatch,
    WorkerFull,
}

impl ClaimRefusal {
    pub const fn reason(self) -> &'static str {
        match self {
            ClaimRefusal::AlreadyClaimed => "already_claimed",
            ClaimRefusal::NotQueued => "not_queued",
            ClaimRefusal::NotClaimable => "not_claimable",
            ClaimRefusal::LabelsMismatch => "labels_mismatch",
            ClaimRefusal::WorkerFull => "worker_full",
        }
    }
}

/// What a claim is judged on.
pub struct ClaimScene<'a> {
    pub status: BuildStatus,
    /// The oldest queued build of its deployment, with nothing of that
    /// deployment running or held.
    pub claimable: bool,
    pub required: &'a [String],
    pub offered: &'a [String],
    /// Authoritative attempts the worker holds now.
    pub held: usize,
    /// A running rollout build whose worker was lost between calls: it
    /// goes on with the next claim (workers.md "Rollouts on workers").
    pub handed_over: bool,
}

/// The claim rule (workers.md "Claim"): `None` when the claim wins.
pub fn claim_refusal(s: &ClaimScene) -> Option<ClaimRefusal> {
    match s.status {
        BuildStatus::Running if !s.handed_over => return Some(ClaimRefusal::AlreadyClaimed),
        BuildStatus::Running => {}
        BuildStatus::Succeeded | BuildStatus::Failed | BuildStatus::Cancelled => {
            return Some(ClaimRefusal::NotQueued)
        }
        BuildStatus::Queued => {}
    }
    if !s.required.iter().all(|l| s.offered.contains(l)) {
        return Some(ClaimRefusal::LabelsMismatch);
    }
    if !s.claimable {
        return Some(ClaimRefusal::NotClaimable);
    }
    if s.held >= MAX_ATTEMPTS_PER_WORKER {
        return Some(ClaimRefusal::WorkerFull);
    }
    None
}

/// The attempt a winning claim starts: the fence one more than the last
/// the build had.
pub fn new_attempt(
    build: BuildId,
    deployment: &str,
    worker: &str,
    incarnation: &str,
    last_fence: u64,
    now: Millis,
    lease_ttl_ms: Option<u64>,
) -> AttemptRecord {
    AttemptRecord {
        build,
        deployment: deployment.to_string(),
        worker: worker.to_string(),
        incarnation: incarnation.to_string(),
        fence: last_fence + 1,
        claimed_at: now,
        lease_expires_at: lease_ttl_ms.map(|ttl| lease_end(now, ttl)),
        last_renewed_at: now,
        state: AttemptState::Active,
        lost_by: None,
        applied_through: 0,
        accepted_calls: 0,
        dropped_lines: 0,
        dropped_bytes: 0,
        cancel_requested_at: None,
        refusal_audited: false,
        replies: vec![],
    }
}

fn lease_end(now: Millis, ttl_ms: u64) -> Millis {
    now.saturating_add(i64::try_from(ttl_ms).unwrap_or(i64::MAX))
}

/// A renew (or any accepted call) of an authoritative attempt: the lease
/// runs `ttl` from now.
pub fn renew(a: &mut AttemptRecord, now: Millis, ttl_ms: u64) {
    assert_eq!(
        a.state,
        AttemptState::Active,
        "only an active attempt renews"
    );
    if a.lease_expires_at.is_some() {
        a.lease_expires_at = Some(lease_end(now, ttl_ms));
    }
    a.last_renewed_at = now;
}

/// The attempt lost (an expired lease, a revoked token).
pub fn lose(a: &mut AttemptRecord, cause: LossCause) {
    assert_eq!(
        a.state,
        AttemptState::Active,
        "only an active attempt is lost"
    );
    a.state = AttemptState::Lost;
    a.lost_by = Some(cause);
}

/// A restart of berth: a remote attempt's lease starts again from now (the
/// down time never counts against a worker); an embedded one ends.
pub fn restart(a: &mut AttemptRecord, now: Millis, ttl_ms: u64) {
    if a.state != AttemptState::Active {
        return;
    }
    if a.worker == LOCAL_WORKER {
        a.state = AttemptState::Interrupted;
    } else {
        a.lease_expires_at = Some(lease_end(now, ttl_ms));
    }
}

/// Which items of a progress batch apply: those above `applied_through`,
/// in order. `Err(applied_through)` when the batch starts past the next
/// seq (a gap) or its seqs are not consecutive.
pub fn new_items(applied_through: u64, seqs: &[u64]) -> Result<std::ops::Range<usize>, u64> {
    let Some(&first) = seqs.first() else {
        return Ok(0..0);
    };
    if first == 0 || first > applied_through + 1 || seqs.windows(2).any(|w| w[1] != w[0] + 1) {
        return Err(applied_through);
    }
    let skip = usize::try_from(applied_through + 1 - first).unwrap_or(usize::MAX);
    Ok(skip.min(seqs.len())..seqs.len())
}

#[cfg(test)]
mod tests;
