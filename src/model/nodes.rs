//! The stored records of nodes bound to agents (agents.md): what berth
//! wants a node to run (its desired-state document), what its agent last
//! said it runs, and since when the two differ. Plain data; the rules are
//! `crate::nodes`.

use serde::{Deserialize, Serialize};

use super::{AttemptRecord, BuildId, Millis};

/// What an agent fetches to run a node (deployer.md "deploy": a node's
/// `artifact`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArtifactKind {
    /// A file berth stores by digest (the `local` deployer's render).
    File,
    /// A Nix store path, fetched from a substituter.
    NixStorePath,
}

impl ArtifactKind {
    pub const fn as_str(self) -> &'static str {
        match self {
            ArtifactKind::File => "file",
            ArtifactKind::NixStorePath => "nix-store-path",
        }
    }
}

/// One artifact. Stored as a plain struct (bincode cannot read the
/// internally tagged JSON form); `crate::nodes` writes and reads the JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    pub kind: ArtifactKind,
    /// A file's `sha256:<64 hex>`, or a store path.
    pub id: String,
    /// A file's bytes; `None` for a store path.
    pub size: Option<u64>,
    /// A store path's binary cache, as the deployer named it.
    pub url: Option<String>,
}

/// What a desired-state document tells its agent to do with `artifact`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodePhase {
    /// Run it (and revert an activation berth no longer backs).
    Steady,
    /// Claim and test-activate it.
    Activate,
    /// Make it permanent.
    Confirm,
}

impl NodePhase {
    pub const fn as_str(self) -> &'static str {
        match self {
            NodePhase::Steady => "steady",
            NodePhase::Activate => "activate",
            NodePhase::Confirm => "confirm",
        }
    }
}

/// The desired state of one node, as berth last published it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DesiredState {
    pub phase: NodePhase,
    /// `None`: nothing is desired (the deployment destroyed, a deploy
    /// without the node); the agent leaves the node as it is.
    pub artifact: Option<Artifact>,
    /// The build whose result named the artifact.
    pub build: Option<BuildId>,
    pub published_at: Millis,
}

/// An agent's health verdict, as reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportedHealth {
    pub healthy: bool,
    pub reason: Option<String>,
}

/// The last error an agent reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportedError {
    pub code: String,
    pub message: String,
}

/// What a node's agent last reported (agents.md "Actual state").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    /// The generation of the document the agent had seen.
    pub generation: u64,
    /// The highest fence the agent had seen.
    pub fence: u64,
    pub running: Option<Artifact>,
    pub booted: Option<Artifact>,
    pub health: Option<ReportedHealth>,
    pub last_error: Option<ReportedError>,
    pub agent_version: String,
    pub uptime_s: u64,
    pub report_interval_ms: u64,
    /// The token and incarnation that sent it.
    pub token: String,
    pub incarnation: String,
    pub reported_at: Millis,
}

/// Since when, and in what, a node runs other than its desired artifact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeDrift {
    pub since: Millis,
    /// `running`, `booted`, or both.
    pub what: Vec<String>,
}

/// Where a node's activation through its agent is (agents.md "Desired vs
/// actual": `activation.status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivationStatus {
    /// Published; no agent claimed it yet.
    Pending,
    Claimed,
    /// The agent has the artifact on the node, verified.
    Fetched,
    /// Test-activated, its revert armed: health answers count from here.
    Activated,
    /// berth published `confirm`.
    Confirming,
    Confirmed,
    /// The agent said so (its reason).
    Failed,
    /// Its lease passed or its token was revoked.
    Lost,
    /// berth ended it (an abort, a build that ended unconfirmed).
    Ended,
}

impl ActivationStatus {
    pub const fn as_str(self) -> &'static str {
        match self {
            ActivationStatus::Pending => "pending",
            ActivationStatus::Claimed => "claimed",
            ActivationStatus::Fetched => "fetched",
            ActivationStatus::Activated => "activated",
            ActivationStatus::Confirming => "confirming",
            ActivationStatus::Confirmed => "confirmed",
            ActivationStatus::Failed => "failed",
            ActivationStatus::Lost => "lost",
            ActivationStatus::Ended => "ended",
        }
    }

    /// Whether it has ended (nothing an agent sends changes it).
    pub const fn is_final(self) -> bool {
        match self {
            ActivationStatus::Confirmed
            | ActivationStatus::Failed
            | ActivationStatus::Lost
            | ActivationStatus::Ended => true,
            ActivationStatus::Pending
            | ActivationStatus::Claimed
            | ActivationStatus::Fetched
            | ActivationStatus::Activated
            | ActivationStatus::Confirming => false,
        }
    }
}

/// One activation of a node through its agent: a rollout's wave asked for
/// it under a new fence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeActivation {
    pub build: BuildId,
    /// The node's fence it was published under.
    pub fence: u64,
    pub artifact: Artifact,
    /// The steady document's artifact before it, and its build: where
    /// berth sends the node back when the build ends unconfirmed.
    pub before: Option<Artifact>,
    pub before_build: Option<BuildId>,
    pub status: ActivationStatus,
    /// Why it failed, was lost or ended.
    pub reason: Option<String>,
    /// The agent's latest health answer (from `activated` on).
    pub health: Option<ReportedHealth>,
    /// The agent's authority over it, from its claim on (the worker
    /// field names the agent's token).
    pub attempt: Option<AttemptRecord>,
    pub published_at: Millis,
    pub activated_at: Option<Millis>,
    pub finished_at: Option<Millis>,
    /// Log items taken (`MAX_ACTIVATION_LOG_LINES` at most; the rest
    /// counted in `dropped_lines`).
    pub log_lines: u32,
    pub dropped_lines: u32,
}

/// A rollout build's artifact for a bound node, staged with its plan
/// until the node's wave publishes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedArtifact {
    pub build: BuildId,
    pub artifact: Artifact,
}

/// One bound node, under (deployment, node). The row exists from the
/// first document or report on and is kept for ever: its fence is never
/// handed out twice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub deployment: String,
    pub node: String,
    /// Grows by one with every change of the document (0 before the first).
    pub generation: u64,
    /// The node's activation fence (0 at first).
    pub fence: u64,
    /// The live agent tokens bound to it, oldest first (at most
    /// `nodes::MAX_TOKENS_PER_NODE`): bound while not empty.
    pub tokens: Vec<String>,
    pub desired: Option<DesiredState>,
    pub actual: Option<NodeReport>,
    pub drift: Option<NodeDrift>,
    /// A rollout's artifact waiting for the node's wave.
    pub staged: Option<StagedArtifact>,
    /// The latest activation through the agent (kept after it ends).
    pub activation: Option<NodeActivation>,
}

impl NodeRecord {
    pub fn new(deployment: &str, node: &str) -> NodeRecord {
        NodeRecord {
            deployment: deployment.to_string(),
            node: node.to_string(),
            generation: 0,
            fence: 0,
            tokens: vec![],
            desired: None,
            actual: None,
            drift: None,
            staged: None,
            activation: None,
        }
    }
}
