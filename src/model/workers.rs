//! The stored records of builds on workers (workers.md): the tokens that
//! workers (and later agents) hold, and each attempt of a build with its
//! authority. Plain data; the rules that change them are `crate::authority`.

use serde::{Deserialize, Serialize};

use super::{BuildId, Millis};

/// What a token issued by `POST /v1/tokens` may reach (api.md "Tokens").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenKind {
    /// The worker routes (workers.md "Internal routes").
    Worker,
    /// One node's agent routes (agents.md).
    Agent,
}

impl TokenKind {
    pub const fn as_str(self) -> &'static str {
        match self {
            TokenKind::Worker => "worker",
            TokenKind::Agent => "agent",
        }
    }
}

/// A worker or agent token. Stored under the SHA-256 of its secret; the
/// secret itself is shown once, in the create answer, and never kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    pub name: String,
    pub kind: TokenKind,
    /// The labels a worker holding it may offer (empty: any).
    pub labels: Vec<String>,
    pub created_at: Millis,
    /// What the worker said about itself at its last call (stored at most
    /// every `authority::SEEN_EVERY`).
    pub seen: Option<WorkerSeen>,
    /// The node an agent token is bound to (agents.md "Binding"); `None`
    /// for a worker token. (`default`: an export before agent tokens.)
    #[serde(default)]
    pub node: Option<NodeBinding>,
}

/// A deployment's node, as an agent token names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeBinding {
    pub deployment: String,
    pub node: String,
}

/// A worker as its last call described it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerSeen {
    pub at: Millis,
    pub incarnation: String,
    pub labels: Vec<String>,
}

/// Where an attempt is in its life (the build read's `attempt.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptState {
    /// Its worker holds the authority over the build.
    Active,
    /// Its outcome was accepted (or it ended with its build: a cancel).
    Ended,
    /// Its lease passed, or its token was revoked, before its outcome.
    Lost,
    /// The embedded worker's attempt, ended by a restart of berth.
    Interrupted,
}

impl AttemptState {
    pub const fn as_str(self) -> &'static str {
        match self {
            AttemptState::Active => "active",
            AttemptState::Ended => "ended",
            AttemptState::Lost => "lost",
            AttemptState::Interrupted => "interrupted",
        }
    }
}

/// Why an attempt stopped being authoritative without an outcome; it
/// decides which refusal its late calls get (workers.md "Every internal
/// call": an expired lease is `lease_expired`, the rest
/// `stale_authority`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossCause {
    LeaseExpired,
    TokenRevoked,
}

/// The answer kept for a replay of one internal call: the same token,
/// route and `operation_id` with the same body get it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptReply {
    /// The route's name (`claim`, `renew`, `progress`, `outcome`).
    pub route: String,
    pub operation_id: String,
    /// SHA-256 of the request body, hex.
    pub body_digest: String,
    /// The answer's JSON text.
    pub answer: String,
}

/// One worker's run of one build (workers.md "Words"), under
/// `(build, fence)`; its id is `authority::attempt_id(build, fence)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    pub build: BuildId,
    pub deployment: String,
    /// The worker token's name, or `local` for the embedded worker.
    pub worker: String,
    pub incarnation: String,
    /// One more than the highest fence the build ever had (1 at first).
    pub fence: u64,
    pub claimed_at: Millis,
    /// `None` for the embedded worker on a single node: its authority ends
    /// with the build or with berth.
    pub lease_expires_at: Option<Millis>,
    pub last_renewed_at: Millis,
    pub state: AttemptState,
    /// Set with `state == Lost`.
    pub lost_by: Option<LossCause>,
    /// The highest progress seq applied (items above it apply, in order).
    pub applied_through: u64,
    /// Renew and progress calls accepted (the outcome's audit `count`).
    pub accepted_calls: u64,
    /// Log lines (and their bytes) past `--max-log-bytes`: counted, not
    /// stored; the last line of the log says how many.
    pub dropped_lines: u64,
    pub dropped_bytes: u64,
    pub cancel_requested_at: Option<Millis>,
    /// Whether a refused call of this attempt was audited (the first only).
    pub refusal_audited: bool,
    /// The last answers, for replays (at most `authority::KEPT_REPLIES`).
    pub replies: Vec<KeptReply>,
}

/// One stored work state of a deployment (workers.md "The work state"):
/// an archive of its `BERTH_WORK_DIR`, kept by digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkStateRef {
    /// `sha256:<64 hex>` of the archive.
    pub digest: String,
    /// The archive's bytes (uncompressed).
    pub size: u64,
    /// The build whose end left it; `None` for the first one (archived
    /// from berth's own work dir at the first remote claim) and for one a
    /// `PUT` made current.
    pub build: Option<BuildId>,
    pub stored_at: Millis,
}

/// A deployment's work states, under its id. The row exists from the
/// deployment's first remote claim on: before it, the work dir on berth's
/// machine is the truth; after it, the stored state is.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkStates {
    /// The one the next attempt gets; `None`: an empty work dir.
    pub current: Option<WorkStateRef>,
    /// Older ones, newest first (at most `--keep-work-states` - 1), each
    /// digest at most once in the list with `current`.
    pub previous: Vec<WorkStateRef>,
}

impl WorkStates {
    /// Every kept state, the current first.
    pub fn all(&self) -> impl Iterator<Item = &WorkStateRef> {
        self.current.iter().chain(self.previous.iter())
    }
}

/// A stored archive, once per digest: zstd-compressed, in pieces of at
/// most `PIECE_BYTES`, counted by the deployments' lists that name it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkStateBlob {
    /// The archive's bytes (uncompressed).
    pub size: u64,
    /// Its compressed bytes, all pieces.
    pub stored_bytes: u64,
    pub pieces: u64,
    /// Entries of `WorkStates` lists naming it.
    pub refs: u32,
}

impl WorkStateBlob {
    /// The most compressed bytes one piece row holds.
    pub const PIECE_BYTES: usize = 1 << 20;
}
