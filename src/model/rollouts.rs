//! A rollout as stored with its build (rollouts.md): plain data. What
//! changes it, and how, is `crate::rollout`.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::{BuildId, Frequency, Millis};

/// Where a rollout is (rollouts.md "States").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutState {
    Running,
    Waiting,
    Paused,
    Frozen,
    Confirming,
    Aborting,
    Finished,
}

impl RolloutState {
    pub const fn as_str(self) -> &'static str {
        match self {
            RolloutState::Running => "running",
            RolloutState::Waiting => "waiting",
            RolloutState::Paused => "paused",
            RolloutState::Frozen => "frozen",
            RolloutState::Confirming => "confirming",
            RolloutState::Aborting => "aborting",
            RolloutState::Finished => "finished",
        }
    }
}

/// Where one wave is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaveState {
    Pending,
    Activating,
    Checking,
    Passed,
    Reverting,
    Reverted,
}

/// How a finished rollout ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutOutcome {
    Succeeded,
    Aborted,
    Failed,
    Cancelled,
}

/// What began an abort.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AbortBy {
    Action,
    Health,
    Activate,
    Confirm,
}

/// One wave of a rollout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wave {
    pub nodes: Vec<String>,
    pub state: WaveState,
    /// Each node an `activate` `new` named, with its answer (`false`
    /// until answered).
    pub activated: BTreeMap<String, bool>,
    /// Whether the `activate` `new` call's answer was taken.
    pub answered: bool,
    pub activated_at: Option<Millis>,
    pub passed_at: Option<Millis>,
}

/// A rollout as stored with its build: the plan and where it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollout {
    pub state: RolloutState,
    /// The current wave, 1-based (0 before the first).
    pub wave: usize,
    pub waves: Vec<Wave>,
    /// The policy's pauses (`pause_after`) and its wait, kept at the start.
    pub pause_after: BTreeSet<u32>,
    pub wait_seconds: u32,
    pub wait_until: Option<Millis>,
    /// A pause asked for (by the policy or an action) and not yet resumed.
    pub paused: bool,
    /// The last wave whose holds (its policy pause, its wait) are spent.
    pub held: usize,
    /// The gate runs again over every activated node (after a hold).
    pub regate: bool,
    pub abort: Option<AbortBy>,
    pub result: Option<RolloutOutcome>,
}

/// A rollout with what its reads show besides the machine: the policy it
/// started with, who paused or aborted it and why, the unhealthy nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutRecord {
    pub build: BuildId,
    pub deployment: String,
    pub rollout: Rollout,
    /// The policy as stored when the build started (JSON text).
    pub policy: String,
    pub pause: Option<RolloutNote>,
    pub abort: Option<RolloutNote>,
    /// Nodes whose latest answer was unhealthy: (node, reason, since).
    pub unhealthy: Vec<(String, String, Millis)>,
    pub started_at: Millis,
    pub updated_at: Millis,
}

/// Who paused or aborted a rollout, when and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutNote {
    /// `policy` or `action` (a pause); `action`, `health`, `activate` or
    /// `confirm` (an abort).
    pub by: String,
    pub at: Millis,
    /// The actor as JSON text, when a person acted.
    pub actor: Option<String>,
    pub reason: Option<String>,
}

/// The key of the global freeze in the store (no deployment id has a `*`).
pub const GLOBAL_FREEZE: &str = "*";

/// A freeze's window (rollouts.md "Freeze"): lifecycle.md's window fields
/// without `kind`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreezeWindow {
    pub frequency: Frequency,
    /// Never skipped when `None`: the store's bincode has no field names,
    /// so a skipped field misreads every field after it.
    #[serde(default)]
    pub day: Option<u8>,
    pub start: String,
    pub duration_minutes: u32,
    pub time_zone: String,
}

/// A freeze, global or of one deployment: no change while it is active.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreezeRecord {
    /// Whoever set it, in their words (1-500 characters, no control
    /// characters): what a refusal's message quotes.
    pub reason: String,
    /// When it ends by itself; `None`: until lifted.
    pub until: Option<Millis>,
    /// Active only while this window is open, when given.
    pub window: Option<FreezeWindow>,
    pub set_at: Millis,
    /// The actor who set it, as JSON text.
    pub set_by: Option<String>,
}
