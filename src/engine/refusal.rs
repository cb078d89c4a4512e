//! Why the engine said no, in the domain's words: which rule, which
//! reason code of api.md, which field. No HTTP here: `api::errors` alone
//! turns a refusal into a status code and a problem+json body, and the
//! messages a client reads are written there too (never with a request
//! value in them).

use serde::Serialize;

use crate::store::StoreError;

/// A field of the request that broke a rule: a JSON pointer and a rule name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FieldError {
    pub pointer: String,
    pub code: String,
}

impl FieldError {
    pub fn new(pointer: impl Into<String>, code: impl Into<String>) -> FieldError {
        FieldError {
            pointer: pointer.into(),
            code: code.into(),
        }
    }
}

/// What a request named that does not exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missing {
    Deployment,
    Build,
    /// An action name berth does not know.
    Action,
    Webhook,
    /// A worker or agent token by name.
    Token,
    /// An attempt id no attempt has, or another token's attempt.
    Attempt,
    /// A deployment without a stored work state (or not that digest).
    WorkState,
    /// No freeze is set there (`404 not_frozen`).
    Freeze,
}

/// A lifecycle rule that refuses the change (api.md: 409 `conflict` with
/// these reasons).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conflict {
    /// The deployment is suspended: resume it first.
    Suspended,
    /// A source digest is already registered with another url or rev.
    SourceImmutable,
    /// An explicit source needs the manual update policy.
    PolicyNotManual,
    /// The build has already finished.
    BuildFinished,
    /// `--max-webhooks` subscriptions exist.
    TooManyWebhooks,
    /// A token of that name exists.
    TokenExists,
    /// `--max-workers` worker tokens exist.
    WorkerLimit,
    /// The node has `MAX_TOKENS_PER_NODE` live agent tokens already.
    NodeBound,
    /// `--max-agents` agent tokens exist.
    AgentLimit,
    /// A build of the deployment is claimed or running (a work state PUT).
    BuildRunning,
    /// A rollout policy other than `{}` for a source without `activate`.
    RolloutUnsupported,
}

impl Conflict {
    /// The reason code of api.md.
    pub fn code(self) -> &'static str {
        match self {
            Conflict::Suspended => "suspended",
            Conflict::SourceImmutable => "source_immutable",
            Conflict::PolicyNotManual => "policy_not_manual",
            Conflict::BuildFinished => "build_finished",
            Conflict::TooManyWebhooks => "max_webhooks",
            Conflict::TokenExists => "token_exists",
            Conflict::WorkerLimit => "worker_limit",
            Conflict::NodeBound => "node_bound",
            Conflict::AgentLimit => "agent_limit",
            Conflict::BuildRunning => "build_running",
            Conflict::RolloutUnsupported => "rollout_unsupported",
        }
    }
}

/// Why the queue of a deployment takes no other build (409 `queue_full`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueFull {
    /// A build runs and the submit asked to replace, not to enqueue.
    BuildRunning,
    /// The deployment has `--max-queued-builds` builds waiting.
    QueueLimit,
}

/// What is wrong with an explicit `source` (400 `invalid_request`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvalidSource {
    /// The digest is not `sha256:` and 64 lower-case hex digits.
    DigestFormat,
    /// The url's origin is not in `--source-origin`.
    OriginNotAllowed,
}

/// Why the deployer cannot evaluate now (503 `eval_unavailable`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalUnavailable {
    SlotsBusy,
    Timeout,
    Crashed,
}

impl EvalUnavailable {
    pub fn code(self) -> &'static str {
        match self {
            EvalUnavailable::SlotsBusy => "eval_slots_busy",
            EvalUnavailable::Timeout => "eval_timeout",
            EvalUnavailable::Crashed => "eval_crashed",
        }
    }
}

/// Every way the engine refuses a request. A refusal has written nothing.
#[derive(Debug, Clone)]
pub enum Refusal {
    NotFound(Missing),
    /// The submitted `source` is not one berth may use.
    InvalidSource(InvalidSource),
    /// The configuration does not validate: its shape, the source's schema
    /// or method, or the deployer's eval (`deployer_message`, its own words).
    InvalidConfiguration {
        /// Says which check failed; never contains a request value.
        message: String,
        fields: Vec<FieldError>,
        deployer_message: Option<String>,
    },
    Conflict(Conflict),
    /// An action the deployment's `actions` list shows disabled (409
    /// `conflict` with the list's reason code).
    ActionRefused(ActionReason),
    /// `If-Match` names another revision than the current one (412).
    PreconditionFailed,
    QueueFull(QueueFull),
    EvalUnavailable {
        reason: EvalUnavailable,
        /// Which call failed and how; never a request value.
        message: &'static str,
    },
    /// A worker's claim lost (409 `conflict`, workers.md "Claim").
    Claim(crate::authority::ClaimRefusal),
    /// A worker's call without authority: it had no effect (409
    /// `precondition_failed`, workers.md "Every internal call").
    Stale(crate::authority::Stale),
    /// An `operation_id` used again with another body (409).
    IdempotencyConflict,
    /// A progress batch or outcome that does not follow what was applied
    /// (409 `conflict` `progress_gap`).
    ProgressGap {
        applied_through: u64,
    },
    /// An upload past its limit (413; the text names the limit).
    TooLarge(String),
    /// A freeze holds (409 `conflict` `frozen`): its scope and its own
    /// words.
    Frozen {
        scope: &'static str,
        reason: String,
    },
    /// The store failed; its class decides the answer (a full disk, ...).
    Store(StoreError),
    /// Something berth itself got wrong; the server log has the detail.
    Internal,
}

impl From<StoreError> for Refusal {
    fn from(e: StoreError) -> Self {
        Refusal::Store(e)
    }
}

impl Refusal {
    pub fn invalid_configuration(message: impl Into<String>, field: FieldError) -> Refusal {
        Refusal::InvalidConfiguration {
            message: message.into(),
            fields: vec![field],
            deployer_message: None,
        }
    }

    pub fn eval_unavailable(reason: EvalUnavailable, message: &'static str) -> Refusal {
        Refusal::EvalUnavailable { reason, message }
    }

    /// A short form for logs.
    pub fn describe(&self) -> String {
        match self {
            Refusal::InvalidConfiguration { message, .. } => message.clone(),
            Refusal::EvalUnavailable { message, .. } => message.to_string(),
            Refusal::Store(e) => e.to_string(),
            other => format!("{other:?}"),
        }
    }
}

/// Why an action is disabled (lifecycle.md's codes): the `actions` list
/// shows it, and the actions route refuses with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActionReason {
    Suspended,
    NotDeployed,
    BuildPending,
    AlreadySuspended,
    NotSuspended,
    UnsupportedByRevision,
    /// Rollback: no retained succeeded deploy build before the deployed one.
    NoEarlierBuild,
    /// Rollback: the named build is not a retained succeeded deploy build
    /// of this deployment (unknown, another deployment's, a destroy, failed,
    /// pruned: all alike, so nobody can probe other deployments' builds).
    RollbackTargetInvalid,
    /// No unfinished rollout (rollouts.md "Pause, resume, abort").
    NoRollout,
    AlreadyPaused,
    NotPaused,
    /// The rollout is confirming or aborting.
    RolloutEnding,
    /// A freeze holds the deployment (rollouts.md "Freeze").
    Frozen,
}

impl ActionReason {
    pub fn code(self) -> &'static str {
        match self {
            ActionReason::Suspended => "suspended",
            ActionReason::NotDeployed => "not_deployed",
            ActionReason::BuildPending => "build_pending",
            ActionReason::AlreadySuspended => "already_suspended",
            ActionReason::NotSuspended => "not_suspended",
            ActionReason::UnsupportedByRevision => "unsupported_by_revision",
            ActionReason::NoEarlierBuild => "no_earlier_build",
            ActionReason::RollbackTargetInvalid => "rollback_target_invalid",
            ActionReason::NoRollout => "no_rollout",
            ActionReason::AlreadyPaused => "already_paused",
            ActionReason::NotPaused => "not_paused",
            ActionReason::RolloutEnding => "rollout_ending",
            ActionReason::Frozen => "frozen",
        }
    }
}
