//! Plain data shared by the store, the engine and the HTTP layer.
//!
//! Records here are what the store persists (bincode, see `store::codec`);
//! the `*View` types are what the API shows. Keeping both in one place makes
//! "what is stored" and "what is shown" easy to compare.

use serde::{Deserialize, Serialize};

mod nodes;
mod rollouts;
mod workers;
pub use nodes::*;
pub use rollouts::*;
use serde_json::value::RawValue;
pub use workers::*;

/// A build id: a UUIDv7, so ids sort by creation time in the store.
pub type BuildId = u128;

/// Milliseconds since the Unix epoch, UTC.
pub type Millis = i64;

pub fn now_millis() -> Millis {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(now.as_millis()).unwrap_or(i64::MAX)
}

/// RFC 3339 UTC with milliseconds, as every API time is written.
///
/// The digits are written by hand rather than through `format!`: a submit
/// formats nine times (build and deployment summaries, events, its reply)
/// on the store's single writer thread, where `format!`'s machinery was
/// 2.8% of that thread's time at 32 connections. The calendar arithmetic
/// stays `time`'s.
pub fn format_time(ms: Millis) -> String {
    let nanos = i128::from(ms) * 1_000_000;
    let Ok(t) = time::OffsetDateTime::from_unix_timestamp_nanos(nanos) else {
        return UNREPRESENTABLE_TIME.to_string();
    };
    let (year, month, day) = t.to_calendar_date();
    let (hour, minute, second, milli) = t.to_hms_milli();
    let year = match u16::try_from(year) {
        Ok(year) if year <= 9999 => year,
        // Outside RFC 3339's four digits (a `time` built with large dates,
        // or a year before 0): written as `format!` writes it.
        _ => {
            return format!(
                "{year:04}-{:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{milli:03}Z",
                u8::from(month)
            )
        }
    };
    let mut out = String::with_capacity(RFC3339_MILLIS_LEN);
    fn digits(out: &mut String, value: u16, width: u32) {
        for place in (0..width).rev() {
            let digit = (value / 10u16.pow(place) % 10) as u8;
            out.push(char::from(b'0' + digit));
        }
    }
    digits(&mut out, year, 4);
    out.push('-');
    digits(&mut out, u8::from(month).into(), 2);
    out.push('-');
    digits(&mut out, day.into(), 2);
    out.push('T');
    digits(&mut out, hour.into(), 2);
    out.push(':');
    digits(&mut out, minute.into(), 2);
    out.push(':');
    digits(&mut out, second.into(), 2);
    out.push('.');
    digits(&mut out, milli, 3);
    out.push('Z');
    debug_assert_eq!(out.len(), RFC3339_MILLIS_LEN);
    out
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ`.
const RFC3339_MILLIS_LEN: usize = 24;

/// What a time outside `time`'s range (+-9999 years) is shown as: no
/// stored time is, since berth writes only its own clock's.
const UNREPRESENTABLE_TIME: &str = "1970-01-01T00:00:00.000Z";

/// The inverse of `format_time` (any RFC 3339 time, to the millisecond).
pub fn parse_time(text: &str) -> Option<Millis> {
    let t =
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

pub fn new_build_id() -> BuildId {
    uuid::Uuid::now_v7().as_u128()
}

pub fn format_build_id(id: BuildId) -> String {
    uuid::Uuid::from_u128(id).hyphenated().to_string()
}

pub fn parse_build_id(text: &str) -> Option<BuildId> {
    uuid::Uuid::try_parse(text).ok().map(|u| u.as_u128())
}

/// The longest deployment id (FR-002).
pub const MAX_DEPLOYMENT_ID_LEN: usize = 40;

/// `^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$`: a DNS label of at most 40 characters.
pub fn is_valid_deployment_id(id: &str) -> bool {
    is_dns_label(id, MAX_DEPLOYMENT_ID_LEN)
}

/// A lower-case DNS label of at most `max` characters.
pub fn is_dns_label(s: &str, max: usize) -> bool {
    let b = s.as_bytes();
    if b.is_empty() || b.len() > max {
        return false;
    }
    let inner = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    inner(&b[0]) && inner(&b[b.len() - 1]) && b.iter().all(|c| inner(c) || *c == b'-')
}

/// A module source, pinned by digest and immutable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Source {
    pub url: String,
    pub rev: String,
    pub digest: String,
}

impl Source {
    /// `sha256:` followed by 64 lower-case hex digits.
    pub fn digest_is_valid(digest: &str) -> bool {
        digest.strip_prefix("sha256:").is_some_and(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BuildKind {
    Deploy,
    Destroy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BuildStatus {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl BuildStatus {
    pub fn is_finished(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Trigger {
    Submit,
    Delete,
    Action(String),
    AutomaticUpdate,
    /// Queued by berth when a deploy broke (lifecycle.md "Automatic
    /// rollback"). Listed last: bincode stores a variant by its index.
    AutomaticRollback,
}

impl Trigger {
    pub fn label(&self) -> String {
        match self {
            Self::Submit => "submit".into(),
            Self::Delete => "delete".into(),
            Self::Action(name) => format!("action:{name}"),
            Self::AutomaticUpdate => "automatic_update".into(),
            Self::AutomaticRollback => "automatic_rollback".into(),
        }
    }
}

/// Why a build failed or was cancelled; `reason` is a stable code.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub reason: FailureReason,
    /// What happened, for a person; never a value of the request.
    pub detail: String,
}

impl Failure {
    pub fn new(reason: FailureReason, detail: impl Into<String>) -> Failure {
        Failure {
            reason,
            detail: detail.into(),
        }
    }
}

/// Every reason a build can fail or be cancelled with (api.md, build
/// `failure.reason`). Stored and shown as its code (`as_str`), so records
/// written before it was an enum read back unchanged; the one place a code
/// is spelled is `as_str`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum FailureReason {
    /// The build's directories or the deployer's process could not be made,
    /// or its stored snapshot is damaged.
    SpawnFailed,
    /// The deployer's process record could not be stored; it was not run.
    JobRecordFailed,
    /// The deployer exited non-zero or was killed by a signal.
    ExitStatus,
    /// The deployer's result broke the protocol.
    DeployerProtocol,
    /// `--build-timeout` passed.
    Timeout,
    /// Cancelled by a caller.
    Cancelled,
    /// berth was stopping and `--shutdown-grace` was over.
    InterruptedByShutdown,
    /// berth stopped (crash, kill -9) while the build ran.
    InterruptedByRestart,
    /// The log could not be stored: the disk is full.
    DiskFull,
    /// The log could not be stored: another storage error.
    LogWriteFailed,
    /// The build's last log lines and results could not be stored.
    FinalCommitFailed,
    /// berth itself failed while running the build (a bug: the task
    /// waiting on the deployer ended without an answer).
    Internal,
    /// A node the deploy changed was not healthy by `--health-timeout`, or
    /// the deployer's `check` or `confirm` failed (lifecycle.md).
    HealthCheckFailed,
    /// The worker running the build lost its lease or its token before
    /// its outcome (workers.md "Cancel, timeout, loss, restart").
    LostAttempt,
    /// The worker could not unpack the deployment's work state.
    WorkStateUnavailable,
    /// The worker's work state at the end was missing, too large or not
    /// a valid archive.
    WorkStateInvalid,
    /// A rollout aborted by `rollout_abort` (its nodes are back already).
    RolloutAborted,
}

impl FailureReason {
    pub const ALL: [FailureReason; 17] = [
        FailureReason::SpawnFailed,
        FailureReason::JobRecordFailed,
        FailureReason::ExitStatus,
        FailureReason::DeployerProtocol,
        FailureReason::Timeout,
        FailureReason::Cancelled,
        FailureReason::InterruptedByShutdown,
        FailureReason::InterruptedByRestart,
        FailureReason::DiskFull,
        FailureReason::LogWriteFailed,
        FailureReason::FinalCommitFailed,
        FailureReason::Internal,
        FailureReason::HealthCheckFailed,
        FailureReason::LostAttempt,
        FailureReason::WorkStateUnavailable,
        FailureReason::WorkStateInvalid,
        FailureReason::RolloutAborted,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            FailureReason::SpawnFailed => "spawn_failed",
            FailureReason::JobRecordFailed => "job_record_failed",
            FailureReason::ExitStatus => "exit_status",
            FailureReason::DeployerProtocol => "deployer_protocol",
            FailureReason::Timeout => "timeout",
            FailureReason::Cancelled => "cancelled",
            FailureReason::InterruptedByShutdown => "interrupted_by_shutdown",
            FailureReason::InterruptedByRestart => "interrupted_by_restart",
            FailureReason::DiskFull => "disk_full",
            FailureReason::LogWriteFailed => "log_write_failed",
            FailureReason::FinalCommitFailed => "final_commit_failed",
            FailureReason::Internal => "internal",
            FailureReason::HealthCheckFailed => "health_check_failed",
            FailureReason::LostAttempt => "lost_attempt",
            FailureReason::WorkStateUnavailable => "work_state_unavailable",
            FailureReason::WorkStateInvalid => "work_state_invalid",
            FailureReason::RolloutAborted => "rollout_aborted",
        }
    }
}

impl std::fmt::Display for FailureReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<FailureReason> for String {
    fn from(r: FailureReason) -> String {
        r.as_str().to_string()
    }
}

impl TryFrom<String> for FailureReason {
    type Error = String;
    fn try_from(code: String) -> Result<FailureReason, String> {
        FailureReason::ALL
            .into_iter()
            .find(|r| r.as_str() == code)
            .ok_or_else(|| "a failure reason this berth does not know".to_string())
    }
}

/// The process group of a running build, enough to recognise it after a
/// restart (a pid alone may have been reused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub pid: i32,
    /// Field 22 of `/proc/<pid>/stat`: clock ticks after boot.
    pub start_ticks: u64,
}

/// The configuration and source a build runs against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The configuration exactly as submitted (JSON text).
    pub configuration: String,
    pub source: Source,
}

/// What a build runs against, stored once in its own table (the build
/// record itself is rewritten at every log chunk and must stay small).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BuildSnapshots {
    pub snapshot: Snapshot,
    /// What the deployment ran before this build (given to the deployer).
    pub previous: Option<Snapshot>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BuildRecord {
    pub id: BuildId,
    pub deployment: String,
    pub kind: BuildKind,
    pub trigger: Trigger,
    pub status: BuildStatus,
    pub suspended: bool,
    pub method: String,
    pub created_at: Millis,
    pub started_at: Option<Millis>,
    pub finished_at: Option<Millis>,
    pub exit_code: Option<i32>,
    pub failure: Option<Failure>,
    pub job: Option<Job>,
    pub log_bytes: u64,
    pub log_lines: u64,
    /// Number of log chunks committed for this build.
    pub log_chunks: u32,
    /// Last event seq of the build channel that is committed.
    pub event_seq: u64,
    /// Seqs up to this may have been sent live (log lines go out before
    /// their chunk commits); after a crash, new events start above it.
    pub seq_reserved: u64,
    /// The seq of the first log line; line `i` has seq `log_first_seq + i`
    /// plus one for each entry of `log_gaps` at or below `i` and the seqs of
    /// each of `log_holes` at or below `i` (`line_seq`).
    pub log_first_seq: u64,
    /// The build this one returns to (a rollback), else `None`. (`default`:
    /// an export of layout 4 has no such member; bincode records are
    /// migrated by `store::layout` instead.)
    #[serde(default)]
    pub rollback_of: Option<BuildId>,
    /// Line indexes before which a seq went to an event that is not a log
    /// line (a `health` event), in order; at most `MAX_LOG_GAPS`.
    #[serde(default)]
    pub log_gaps: Vec<u64>,
    /// Runs of seqs skipped before a line: a rollout that went on after a
    /// restart starts above the ids its last run may have sent
    /// (`seq_reserved`), one hole per restart; at most `MAX_LOG_HOLES`.
    #[serde(default)]
    pub log_holes: Vec<LogHole>,
}

/// Non-log events amid a build's log lines at most (health events: one per
/// changed node per check).
pub const MAX_LOG_GAPS: usize = 4096;

/// Restarts one build goes on after at most (a rollout's); past it the
/// build fails `interrupted_by_restart`.
pub const MAX_LOG_HOLES: usize = 64;

/// `seqs` ids skipped before log line `line`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogHole {
    pub line: u64,
    pub seqs: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum UpdatePolicy {
    Manual,
    Automatic,
    Window {
        frequency: Frequency,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        day: Option<u8>,
        start: String,
        duration_minutes: u32,
        time_zone: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Frequency {
    Daily,
    Weekly,
    Monthly,
}

/// The automatic update berth last tried for a deployment (lifecycle.md
/// "Update policies"): one try per default source per policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateTry {
    pub at: Millis,
    pub source: Source,
    pub build_id: Option<BuildId>,
    pub result: TryResult,
    /// Why it was refused or failed (a reason code).
    pub reason: Option<String>,
    /// Whether it still counts against this source: a new policy allows a
    /// new try.
    pub blocks: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TryResult {
    Queued,
    Succeeded,
    Failed,
    Refused,
    /// A rollback went back from this source: it is held back from
    /// automatic updates until the default source or the policy changes.
    /// Listed last: bincode stores a variant by its index.
    RolledBack,
}

/// `update.last_automatic` of a deployment read.
#[derive(Debug, Clone, Serialize)]
pub struct UpdateTryView {
    pub at: String,
    pub source: Source,
    pub build_id: Option<String>,
    pub result: TryResult,
    pub reason: Option<String>,
}

impl UpdateTry {
    pub fn view(&self) -> UpdateTryView {
        UpdateTryView {
            at: format_time(self.at),
            source: self.source.clone(),
            build_id: self.build_id.map(format_build_id),
            result: self.result,
            reason: self.reason.clone(),
        }
    }
}

/// Whether a node has an SBOM (spec sbom.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SbomStatus {
    Ready,
    Unavailable,
}

/// A node's SBOM as stored: its status and, when ready, the document's
/// skeleton and the ordered hashes of its top-level components (the
/// components themselves are stored once, content-addressed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSbom {
    pub status: SbomStatus,
    /// The deploy that gave it (none for "no deploy gave an SBOM yet").
    pub build_id: Option<BuildId>,
    pub at: Millis,
    /// Why it is unavailable.
    pub reason: Option<String>,
    /// zstd of the skeleton's JSON text; empty when unavailable.
    pub skeleton: Vec<u8>,
    pub had_components: bool,
    pub hashes: Vec<[u8; 32]>,
}

/// One node in `GET /v1/deployments/{id}/sboms`.
#[derive(Debug, Clone, Serialize)]
pub struct NodeSbomView {
    pub node: String,
    pub status: SbomStatus,
    pub build_id: Option<String>,
    pub at: String,
    pub reason: Option<String>,
    pub components: usize,
}

impl NodeSbom {
    pub fn view(&self, node: &str) -> NodeSbomView {
        NodeSbomView {
            node: node.to_string(),
            status: self.status,
            build_id: self.build_id.map(format_build_id),
            at: format_time(self.at),
            reason: self.reason.clone(),
            components: self.hashes.len(),
        }
    }
}

/// What the last successful deploy ran.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Deployed {
    pub build_id: BuildId,
    pub snapshot: Snapshot,
    pub method: String,
    pub finished_at: Millis,
    /// Every node of the deploy with its fingerprint when the deployer gave
    /// one (deployer.md); a preview compares against these.
    #[serde(default)]
    pub nodes: Vec<(String, Option<String>)>,
}

/// The last finished build that counts for the derived state.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct LastFinished {
    pub build_id: BuildId,
    pub kind: BuildKind,
    pub status: BuildStatus,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeploymentRecord {
    pub id: String,
    pub revision: u64,
    pub suspended: bool,
    pub method: String,
    /// The domain of the last submitted configuration (derived at submit).
    pub domain: Option<String>,
    pub snapshot: Snapshot,
    #[serde(with = "as_json_text")]
    pub update_policy: UpdatePolicy,
    pub deployed: Option<Deployed>,
    pub last_build: Option<BuildId>,
    pub last_finished: Option<LastFinished>,
    /// Deploy builds queued or running.
    pub pending_deploys: u32,
    /// Destroy builds queued or running.
    pub pending_destroys: u32,
    pub running: Option<BuildId>,
    /// Last event seq of the deployment channel.
    pub event_seq: u64,
    pub created_at: Millis,
    pub updated_at: Millis,
    /// Roll back by itself when a deploy breaks (lifecycle.md); on unless
    /// a submit turned it off.
    #[serde(default = "on")]
    pub auto_rollback: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeploymentState {
    Destroying,
    Building,
    Failed,
    Active,
    Idle,
}

impl DeploymentRecord {
    /// lifecycle.md "Deployment state": the first row that applies wins.
    pub fn state(&self) -> DeploymentState {
        if self.pending_destroys > 0 {
            return DeploymentState::Destroying;
        }
        if self.pending_deploys > 0 {
            return DeploymentState::Building;
        }
        match self.last_finished {
            Some(LastFinished {
                status: BuildStatus::Failed | BuildStatus::Cancelled,
                ..
            }) => DeploymentState::Failed,
            Some(LastFinished {
                kind: BuildKind::Deploy,
                status: BuildStatus::Succeeded,
                ..
            }) => DeploymentState::Active,
            // A successful destroy, or nothing finished yet (lifecycle.md);
            // a finished build is never queued or running.
            Some(LastFinished {
                kind: BuildKind::Destroy,
                status: BuildStatus::Succeeded,
                ..
            })
            | Some(LastFinished {
                status: BuildStatus::Queued | BuildStatus::Running,
                ..
            })
            | None => DeploymentState::Idle,
        }
    }

    pub fn has_pending_build(&self) -> bool {
        self.pending_deploys + self.pending_destroys > 0
    }

    /// The short form every list, event and submit answer shows.
    pub fn summary(&self, last_build: Option<&BuildRecord>) -> DeploymentSummary {
        DeploymentSummary {
            id: self.id.clone(),
            revision: self.revision,
            state: self.state(),
            suspended: self.suspended,
            domain: self.domain.clone(),
            updated_at: format_time(self.updated_at),
            last_build: last_build.map(BuildRecord::summary),
        }
    }
}

/// A stored configuration as JSON, for embedding in a response without
/// re-encoding (so it is shown exactly as submitted).
pub fn raw_json(text: &str) -> Result<Box<RawValue>, DamagedSnapshot> {
    RawValue::from_string(text.to_string()).map_err(|_| DamagedSnapshot)
}

/// A stored configuration snapshot that is not JSON any more (it was
/// valid JSON when stored): damage to the store, never shown as `null`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DamagedSnapshot;

impl std::fmt::Display for DamagedSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a stored configuration snapshot is not JSON (the store is damaged)")
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BuildSummary {
    pub id: String,
    pub deployment: String,
    pub kind: BuildKind,
    pub trigger: String,
    pub status: BuildStatus,
    pub suspended: bool,
    pub created_at: String,
    pub started_at: Option<String>,
    pub finished_at: Option<String>,
    pub exit_code: Option<i32>,
    pub failure: Option<Failure>,
    pub rollback_of: Option<String>,
}

impl BuildRecord {
    /// A build just queued: nothing run, nothing logged, no events yet.
    pub fn queued(
        id: BuildId,
        deployment: String,
        kind: BuildKind,
        trigger: Trigger,
        method: String,
        created_at: Millis,
    ) -> BuildRecord {
        BuildRecord {
            id,
            deployment,
            kind,
            trigger,
            status: BuildStatus::Queued,
            suspended: false,
            method,
            created_at,
            started_at: None,
            finished_at: None,
            exit_code: None,
            failure: None,
            job: None,
            log_bytes: 0,
            log_lines: 0,
            log_chunks: 0,
            event_seq: 0,
            seq_reserved: 0,
            log_first_seq: 0,
            rollback_of: None,
            log_gaps: Vec::new(),
            log_holes: Vec::new(),
        }
    }

    /// The seq of log line `line` (its index in the log).
    pub fn line_seq(&self, line: u64) -> u64 {
        let skipped = self.log_gaps.partition_point(|&g| g <= line) as u64;
        let holes: u64 = self
            .log_holes
            .iter()
            .filter(|h| h.line <= line)
            .map(|h| h.seqs)
            .sum();
        self.log_first_seq + line + skipped + holes
    }

    pub fn summary(&self) -> BuildSummary {
        BuildSummary {
            id: format_build_id(self.id),
            deployment: self.deployment.clone(),
            kind: self.kind,
            trigger: self.trigger.label(),
            status: self.status,
            suspended: self.suspended,
            created_at: format_time(self.created_at),
            started_at: self.started_at.map(format_time),
            finished_at: self.finished_at.map(format_time),
            exit_code: self.exit_code,
            failure: self.failure.clone(),
            rollback_of: self.rollback_of.map(format_build_id),
        }
    }

    pub fn view(&self, snaps: &BuildSnapshots) -> Result<BuildView, DamagedSnapshot> {
        Ok(BuildView {
            summary: self.summary(),
            configuration: raw_json(&snaps.snapshot.configuration)?,
            source: snaps.snapshot.source.clone(),
            job_id: self.job.map(|j| format!("pid:{}", j.pid)),
            log_bytes: self.log_bytes,
            log_lines: self.log_lines,
        })
    }
}

#[derive(Debug, Serialize)]
pub struct BuildView {
    #[serde(flatten)]
    pub summary: BuildSummary,
    pub configuration: Box<RawValue>,
    pub source: Source,
    pub job_id: Option<String>,
    pub log_bytes: u64,
    pub log_lines: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct DeploymentSummary {
    pub id: String,
    pub revision: u64,
    pub state: DeploymentState,
    pub suspended: bool,
    pub domain: Option<String>,
    pub updated_at: String,
    pub last_build: Option<BuildSummary>,
}

/// Stores a value as its JSON text: for types whose serde form bincode
/// cannot read back (internally tagged enums, skipped fields).
fn on() -> bool {
    true
}

mod as_json_text {
    use serde::{de::DeserializeOwned, Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<T: Serialize, S: Serializer>(value: &T, s: S) -> Result<S::Ok, S::Error> {
        let text = serde_json::to_string(value).map_err(serde::ser::Error::custom)?;
        s.serialize_str(&text)
    }

    pub fn deserialize<'de, T: DeserializeOwned, D: Deserializer<'de>>(
        d: D,
    ) -> Result<T, D::Error> {
        let text = String::deserialize(d)?;
        serde_json::from_str(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod time_tests {
    use super::*;

    /// The hand-written digits agree with `time`'s own RFC 3339 writer
    /// (which drops a zero millisecond part, so it is compared padded).
    #[test]
    fn format_time_writes_what_time_writes_and_parse_time_reads_it_back() {
        let mut samples = vec![0, 1, 999, 1_000, -1, -86_400_000, 253_402_300_799_999];
        let mut x: i64 = 0x5DEE_CE66;
        for _ in 0..10_000 {
            // A linear congruential walk over 0..=9999-12-31.
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            samples.push(x.rem_euclid(253_402_300_800_000));
        }
        for ms in samples {
            let ours = format_time(ms);
            let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
                .expect("in range");
            let theirs = t
                .format(&time::format_description::well_known::Rfc3339)
                .expect("formats");
            let padded = match theirs.find('.') {
                Some(dot) => format!(
                    "{}{:0<3}Z",
                    &theirs[..=dot],
                    &theirs[dot + 1..theirs.len() - 1]
                ),
                None => format!("{}.000Z", &theirs[..theirs.len() - 1]),
            };
            assert_eq!(ours, padded, "{ms}");
            assert_eq!(ours.len(), RFC3339_MILLIS_LEN);
            assert_eq!(parse_time(&ours), Some(ms), "{ours}");
        }
        assert_eq!(format_time(i64::MAX), UNREPRESENTABLE_TIME);
    }
}
