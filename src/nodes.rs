//! Nodes bound to agents (agents.md), as pure rules with no I/O, tested
//! directly: the JSON of artifacts, desired-state documents, reports and
//! node entries, and the judgements made of them (drift, an agent's
//! status, whether a report changes anything).
//!
//! Why it exists: the engine stores a report or a document in one write
//! job, the HTTP layer shows entries, and `berth agent` reads documents
//! and writes reports; each rule about what they mean is written once
//! here, so the three cannot disagree.

use serde_json::{json, Map, Value};

use crate::model::{
    format_time, Artifact, ArtifactKind, DesiredState, Millis, NodeActivation, NodeDrift,
    NodePhase, NodeRecord, NodeReport, ReportedError, ReportedHealth,
};

/// Live agent tokens one node may have: its agent's, and the next one
/// during a rotation (agents.md "Binding").
pub const MAX_TOKENS_PER_NODE: usize = 2;
/// A report's body at most (agents.md "Actual state": `413` past it).
pub const MAX_REPORT_BYTES: usize = 16 * 1024;
/// `--report-interval`'s bounds and default (ms).
pub const REPORT_INTERVAL_MIN_MS: u64 = 1_000;
pub const REPORT_INTERVAL_MAX_MS: u64 = 3_600_000;
/// The most confirmed artifacts an agent's `--keep` may keep.
pub const MAX_KEEP: u32 = 100;
pub const REPORT_INTERVAL_DEFAULT_MS: u64 = 60_000;
/// An agent silent for this many of its report intervals is unreachable.
pub const UNREACHABLE_INTERVALS: u64 = 3;
/// A node reports at most once per this many ms (`503 report_rate`).
pub const REPORT_EVERY_MS: u64 = 1_000;
/// The longest texts a report may carry.
pub const MAX_VERSION_CHARS: usize = 64;
pub const MAX_REASON_CHARS: usize = 500;
pub const MAX_ERROR_CODE_CHARS: usize = 64;
/// The longest store path or cache URL an artifact may name.
pub const MAX_PATH_CHARS: usize = 512;
pub const MAX_URL_CHARS: usize = 2048;
/// Nodes a deployment read shows at most (the rest through the list).
pub const NODES_IN_DEPLOYMENT_READ: usize = 200;

/// A shape error: the JSON pointer of the field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bad {
    pub pointer: String,
    pub message: String,
}

fn bad(pointer: &str, message: impl Into<String>) -> Bad {
    Bad {
        pointer: pointer.to_string(),
        message: message.into(),
    }
}

/// `sha256:` and 64 lowercase hex digits.
pub fn is_digest(s: &str) -> bool {
    s.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    })
}

/// A store path: `/nix/store/` and a name, printable, without `..`.
pub fn is_store_path(s: &str) -> bool {
    s.len() <= MAX_PATH_CHARS
        && s.strip_prefix("/nix/store/").is_some_and(|rest| {
            !rest.is_empty()
                && !rest.contains("..")
                && rest
                    .bytes()
                    .all(|c| c.is_ascii_graphic() && c != b'\\' && c != b'"')
        })
}

/// The URL an agent fetches a file artifact of its node from.
pub fn artifact_url(deployment: &str, node: &str, digest: &str) -> String {
    format!("/internal/v1/nodes/{deployment}/{node}/artifacts/{digest}")
}

/// An artifact as JSON (agents.md "Desired state"); a file's `url` only
/// in a document (`at`: its node).
pub fn artifact_json(a: &Artifact, at: Option<(&str, &str)>) -> Value {
    match a.kind {
        ArtifactKind::File => {
            let mut v = json!({"kind": "file", "digest": a.id, "size": a.size});
            if let Some((deployment, node)) = at {
                v["url"] = json!(artifact_url(deployment, node, &a.id));
            }
            v
        }
        ArtifactKind::NixStorePath => json!({"kind": "nix-store-path", "path": a.id, "url": a.url}),
    }
}

/// An artifact from JSON (a report's `running`/`booted`, an agent reading
/// its document): null is `None`.
pub fn parse_artifact(v: &Value, pointer: &str) -> Result<Option<Artifact>, Bad> {
    if v.is_null() {
        return Ok(None);
    }
    let Some(o) = v.as_object() else {
        return Err(bad(pointer, "an artifact is an object or null"));
    };
    let text = |k: &str| o.get(k).and_then(Value::as_str);
    let url = match o.get("url") {
        None | Some(Value::Null) => None,
        Some(Value::String(u)) if u.len() <= MAX_URL_CHARS => Some(u.clone()),
        Some(_) => {
            return Err(bad(
                &format!("{pointer}/url"),
                "a URL of at most 2048 bytes",
            ))
        }
    };
    match text("kind") {
        Some("file") => {
            let digest = text("digest").filter(|d| is_digest(d)).ok_or_else(|| {
                bad(
                    &format!("{pointer}/digest"),
                    "a digest `sha256:<64 lowercase hex>`",
                )
            })?;
            let size = match o.get("size") {
                None | Some(Value::Null) => None,
                Some(s) => Some(
                    s.as_u64()
                        .ok_or_else(|| bad(&format!("{pointer}/size"), "a size in bytes"))?,
                ),
            };
            Ok(Some(Artifact {
                kind: ArtifactKind::File,
                id: digest.to_string(),
                size,
                url: None,
            }))
        }
        Some("nix-store-path") => {
            let path = text("path")
                .filter(|p| is_store_path(p))
                .ok_or_else(|| bad(&format!("{pointer}/path"), "a store path `/nix/store/...`"))?;
            Ok(Some(Artifact {
                kind: ArtifactKind::NixStorePath,
                id: path.to_string(),
                size: None,
                url,
            }))
        }
        _ => Err(bad(
            &format!("{pointer}/kind"),
            "`file` or `nix-store-path`",
        )),
    }
}

/// Whether two artifacts name the same thing (a cache URL aside).
pub fn same_artifact(a: &Artifact, b: &Artifact) -> bool {
    a.kind == b.kind && a.id == b.id
}

/// What berth's settings put in every document.
#[derive(Debug, Clone, Copy, Default)]
pub struct DocumentTimes {
    pub lease_ttl_ms: u64,
    pub revert_after_ms: u64,
    pub health_interval_ms: u64,
}

/// A node's desired-state document (agents.md "Desired state").
pub fn document(n: &NodeRecord, times: DocumentTimes) -> Value {
    let desired = n.desired.as_ref();
    json!({
        "deployment": n.deployment,
        "node": n.node,
        "generation": n.generation,
        "fence": n.fence,
        "phase": desired.map_or(NodePhase::Steady, |d| d.phase).as_str(),
        "artifact": desired
            .and_then(|d| d.artifact.as_ref())
            .map(|a| artifact_json(a, Some((&n.deployment, &n.node)))),
        "build_id": desired.and_then(|d| d.build).map(crate::model::format_build_id),
        "lease_ttl_ms": times.lease_ttl_ms,
        "revert_after_ms": times.revert_after_ms,
        "health_interval_ms": times.health_interval_ms,
        "deadline": Value::Null,
    })
}

/// A report's body, checked (agents.md "Actual state"); `token` and
/// `now` are berth's.
pub struct ParsedReport {
    pub operation_id: String,
    pub report: NodeReport,
}

/// Checks a report's JSON and makes the record it stores.
pub fn parse_report(
    body: &Map<String, Value>,
    token: &str,
    now: Millis,
) -> Result<ParsedReport, Bad> {
    let text = |k: &str| body.get(k).and_then(Value::as_str);
    let count = |k: &str| {
        body.get(k)
            .and_then(Value::as_u64)
            .ok_or_else(|| bad(&format!("/{k}"), "a whole number of at least 0"))
    };
    let operation_id = text("operation_id")
        .filter(|o| crate::authority::is_operation_id(o))
        .ok_or_else(|| bad("/operation_id", "16-128 of `[A-Za-z0-9._~-]`"))?;
    let incarnation = text("worker_incarnation")
        .filter(|i| crate::authority::is_authority_id(i))
        .ok_or_else(|| bad("/worker_incarnation", "8-128 of `[A-Za-z0-9_-]`"))?;
    let version = text("agent_version")
        .filter(|v| !v.is_empty() && v.chars().count() <= MAX_VERSION_CHARS)
        .ok_or_else(|| bad("/agent_version", "a version of 1-64 characters"))?;
    let interval = count("report_interval_ms")?;
    if !(REPORT_INTERVAL_MIN_MS..=REPORT_INTERVAL_MAX_MS).contains(&interval) {
        return Err(bad("/report_interval_ms", "1,000 to 3,600,000"));
    }
    let null = Value::Null;
    let field = |k: &str| body.get(k).unwrap_or(&null);
    Ok(ParsedReport {
        operation_id: operation_id.to_string(),
        report: NodeReport {
            generation: count("generation")?,
            fence: count("fence")?,
            running: parse_artifact(field("running"), "/running")?,
            booted: parse_artifact(field("booted"), "/booted")?,
            health: parse_health(field("health"))?,
            last_error: parse_error(field("last_error"))?,
            agent_version: version.to_string(),
            uptime_s: count("uptime_s")?,
            report_interval_ms: interval,
            token: token.to_string(),
            incarnation: incarnation.to_string(),
            reported_at: now,
        },
    })
}

/// The fields a report may carry.
pub const REPORT_FIELDS: [&str; 11] = [
    "operation_id",
    "fence",
    "worker_incarnation",
    "generation",
    "running",
    "booted",
    "health",
    "last_error",
    "agent_version",
    "uptime_s",
    "report_interval_ms",
];

fn parse_health(v: &Value) -> Result<Option<ReportedHealth>, Bad> {
    if v.is_null() {
        return Ok(None);
    }
    let healthy = v
        .get("healthy")
        .and_then(Value::as_bool)
        .ok_or_else(|| bad("/health/healthy", "true or false"))?;
    let reason = match v.get("reason") {
        None | Some(Value::Null) => None,
        Some(Value::String(r)) => Some(r.chars().take(MAX_REASON_CHARS).collect()),
        Some(_) => return Err(bad("/health/reason", "a text or null")),
    };
    Ok(Some(ReportedHealth { healthy, reason }))
}

fn parse_error(v: &Value) -> Result<Option<ReportedError>, Bad> {
    if v.is_null() {
        return Ok(None);
    }
    let code = v
        .get("code")
        .and_then(Value::as_str)
        .filter(|c| !c.is_empty() && c.len() <= MAX_ERROR_CODE_CHARS)
        .ok_or_else(|| bad("/last_error/code", "a code of 1-64 characters"))?;
    let message = v
        .get("message")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("/last_error/message", "a text"))?;
    Ok(Some(ReportedError {
        code: code.to_string(),
        message: message.chars().take(MAX_REASON_CHARS).collect(),
    }))
}

/// Whether `after` says anything `before` did not: everything but
/// `uptime_s` and the time it came counts (agents.md: "one that changes
/// nothing but `uptime_s` commits nothing").
pub fn report_changes(before: Option<&NodeReport>, after: &NodeReport) -> bool {
    let Some(b) = before else {
        return true;
    };
    let mut b = b.clone();
    b.uptime_s = after.uptime_s;
    b.reported_at = after.reported_at;
    b != *after
}

/// The drift of a node (agents.md "Desired vs actual"): a node with a
/// steady document naming an artifact, whose report for that document's
/// generation or a later one runs, or boots, something else. A report
/// with no boot entry (`booted` null: a file node that never confirmed)
/// is no drift in `booted`; a node that runs nothing where something is
/// desired drifts in `running`. `since` is kept while it lasts.
pub fn drift(n: &NodeRecord, now: Millis) -> Option<NodeDrift> {
    let desired = n.desired.as_ref()?;
    if desired.phase != NodePhase::Steady {
        return None;
    }
    let want = desired.artifact.as_ref()?;
    let report = n.actual.as_ref()?;
    if report.generation < n.generation {
        return None;
    }
    let mut what = Vec::new();
    if !report
        .running
        .as_ref()
        .is_some_and(|r| same_artifact(r, want))
    {
        what.push("running".to_string());
    }
    if report
        .booted
        .as_ref()
        .is_some_and(|b| !same_artifact(b, want))
    {
        what.push("booted".to_string());
    }
    if what.is_empty() {
        return None;
    }
    let since = match &n.drift {
        Some(d) => d.since,
        None => now,
    };
    Some(NodeDrift { since, what })
}

/// What berth knows of an agent between reports (kept in memory: a
/// report that changes nothing commits nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub token: String,
    pub incarnation: String,
    pub version: String,
    pub at: Millis,
    pub report_interval_ms: u64,
    /// Two incarnations reported in turn (A, B, A).
    pub duplicate: bool,
    /// The incarnation before this one, and when this one took over.
    pub previous: Option<String>,
    pub since: Millis,
}

impl Seen {
    /// A report from `incarnation` at `now`.
    pub fn report(before: Option<&Seen>, r: &NodeReport, now: Millis) -> Seen {
        let window = r.report_interval_ms.saturating_mul(UNREACHABLE_INTERVALS);
        let (previous, since, duplicate) = match before {
            Some(b) if b.incarnation == r.incarnation => {
                let alone_long = now.saturating_sub(b.since) >= millis(window);
                (b.previous.clone(), b.since, b.duplicate && !alone_long)
            }
            Some(b) => {
                let back = b.previous.as_deref() == Some(r.incarnation.as_str())
                    && now.saturating_sub(b.since) < millis(window);
                (Some(b.incarnation.clone()), now, b.duplicate || back)
            }
            None => (None, now, false),
        };
        Seen {
            token: r.token.clone(),
            incarnation: r.incarnation.clone(),
            version: r.agent_version.clone(),
            at: now,
            report_interval_ms: r.report_interval_ms,
            duplicate,
            previous,
            since,
        }
    }
}

fn millis(ms: u64) -> Millis {
    Millis::try_from(ms).unwrap_or(Millis::MAX)
}

/// An agent's status (agents.md "Desired vs actual").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentStatus {
    Reporting,
    Unreachable,
    NeverReported,
}

impl AgentStatus {
    pub const fn as_str(self) -> &'static str {
        match self {
            AgentStatus::Reporting => "reporting",
            AgentStatus::Unreachable => "unreachable",
            AgentStatus::NeverReported => "never_reported",
        }
    }

    /// From what berth saw since its start (`seen`), else the stored
    /// report; `started` is when berth started (every agent counts as
    /// seen then).
    pub fn of(
        seen: Option<&Seen>,
        stored: Option<&NodeReport>,
        started: Millis,
        now: Millis,
    ) -> AgentStatus {
        let (at, interval) = match (seen, stored) {
            (Some(s), _) => (s.at, s.report_interval_ms),
            (None, Some(r)) => (r.reported_at.max(started), r.report_interval_ms),
            (None, None) => return AgentStatus::NeverReported,
        };
        let window = millis(interval.saturating_mul(UNREACHABLE_INTERVALS));
        if now.saturating_sub(at) > window {
            AgentStatus::Unreachable
        } else {
            AgentStatus::Reporting
        }
    }
}

/// What a node entry shows of its agent.
pub struct AgentView<'a> {
    /// The live agent token bound to the node (the newest), if any.
    pub token: Option<&'a str>,
    pub seen: Option<&'a Seen>,
    pub status: AgentStatus,
}

/// A node entry (agents.md "Desired vs actual").
pub fn entry(n: &NodeRecord, agent: &AgentView, times: DocumentTimes) -> Value {
    let agent_json = agent.token.map(|token| {
        let stored = n.actual.as_ref();
        json!({
            "token": token,
            "status": agent.status.as_str(),
            "duplicate": agent.seen.is_some_and(|s| s.duplicate),
            "incarnation": agent.seen.map(|s| s.incarnation.clone()).or_else(|| stored.map(|r| r.incarnation.clone())),
            "version": agent.seen.map(|s| s.version.clone()).or_else(|| stored.map(|r| r.agent_version.clone())),
            "last_seen_at": agent.seen.map(|s| s.at).or_else(|| stored.map(|r| r.reported_at)).map(format_time),
            "report_interval_ms": agent.seen.map(|s| s.report_interval_ms).or_else(|| stored.map(|r| r.report_interval_ms)),
        })
    });
    json!({
        "name": n.node,
        "agent": agent_json,
        "desired": n.desired.as_ref().map(|_| document(n, times)),
        "actual": n.actual.as_ref().map(|r| actual_json(r, agent.seen)),
        "activation": n.activation.as_ref().map(|a| activation_view(a, times.revert_after_ms)),
        "drift": n.drift.as_ref().map(|d| json!({"since": format_time(d.since), "what": d.what})),
    })
}

fn actual_json(r: &NodeReport, seen: Option<&Seen>) -> Value {
    json!({
        "generation": r.generation,
        "fence": r.fence,
        "running": r.running.as_ref().map(|a| artifact_json(a, None)),
        "booted": r.booted.as_ref().map(|a| artifact_json(a, None)),
        "health": r.health.as_ref().map(|h| json!({"healthy": h.healthy, "reason": h.reason})),
        "last_error": r.last_error.as_ref().map(|e| json!({"code": e.code, "message": e.message})),
        "agent_version": r.agent_version,
        "uptime_s": r.uptime_s,
        "reported_at": format_time(seen.map_or(r.reported_at, |s| s.at.max(r.reported_at))),
    })
}

/// An activation's part of a node entry.
pub fn activation_view(a: &NodeActivation, revert_after_ms: u64) -> Value {
    let deadline = a.activated_at.map(|at| {
        let last = a.attempt.as_ref().map_or(at, |t| t.last_renewed_at.max(at));
        format_time(last.saturating_add(i64::try_from(revert_after_ms).unwrap_or(i64::MAX)))
    });
    json!({
        "build_id": crate::model::format_build_id(a.build),
        "fence": a.fence,
        "attempt_id": a.attempt.as_ref().map(|_| format!("activation-{}", a.fence)),
        "status": a.status.as_str(),
        "reason": a.reason,
        "health": a.health.as_ref().map(|h| json!({"healthy": h.healthy, "reason": h.reason})),
        "deadline": deadline,
        "claimed_at": a.attempt.as_ref().map(|t| format_time(t.claimed_at)),
        "finished_at": a.finished_at.map(format_time),
    })
}

/// The entry of a node berth knows nothing of (an unbound node).
pub fn empty_entry(node: &str) -> Value {
    json!({"name": node, "agent": null, "desired": null, "actual": null, "activation": null, "drift": null})
}

/// A steady document for a deploy's artifact, or `None` when it is the
/// one the node already has.
pub fn steady(
    n: &NodeRecord,
    artifact: Option<&Artifact>,
    build: u128,
    now: Millis,
) -> Option<DesiredState> {
    let same = n.desired.as_ref().is_some_and(|d| {
        d.phase == NodePhase::Steady
            && match (&d.artifact, artifact) {
                (Some(a), Some(b)) => same_artifact(a, b),
                (None, None) => true,
                (Some(_), None) | (None, Some(_)) => false,
            }
    });
    (!same).then(|| DesiredState {
        phase: NodePhase::Steady,
        artifact: artifact.cloned(),
        build: Some(build),
        published_at: now,
    })
}

#[cfg(test)]
mod tests;
