//! How a deployer run ended, turned into a build's final status: the exit,
//! a cancel or timeout, a log that could not be stored, and for a deploy the
//! result file checked against the protocol with every SBOM it names.

use std::time::Duration;

use serde::Deserialize;

use super::log_pipe::LogBuffer;
use super::runner::{self, Ended, OpenError};
use super::transition::End;
use crate::model::*;

/// Largest SBOM file read from a deployer (sbom.md).
pub const MAX_SBOM_BYTES: u64 = 64 * 1024 * 1024;

pub(super) type NodeResults = Vec<(String, Result<(), String>)>;

/// How a build's deployer run ended, before it is stored.
pub(super) struct Outcome {
    pub(super) root: std::path::PathBuf,
    pub(super) ended: Ended,
    /// For exit 0: the checked result (nodes and their SBOM verdicts).
    pub(super) result: Option<Result<NodeResults, String>>,
    pub(super) log: LogBuffer,
    pub(super) disk_failure: Option<String>,
    pub(super) user_cancelled: bool,
    /// Why the deployer could not even be started.
    pub(super) not_started: Option<Failure>,
}

impl Outcome {
    /// The deployer never ran (its directories or its process could not be made).
    pub(super) fn failed(
        root: &std::path::Path,
        reason: &str,
        detail: String,
        log: LogBuffer,
    ) -> Outcome {
        Outcome {
            root: root.to_path_buf(),
            ended: Ended::Exit(-1),
            result: None,
            log,
            disk_failure: None,
            user_cancelled: false,
            not_started: Some(Failure {
                reason: reason.into(),
                detail,
            }),
        }
    }

    /// The build's final status, failure and exit code.
    pub(super) fn verdict(&self, timeout: Duration) -> End {
        let (status, failure, exit_code) = self.judge(timeout);
        End {
            status,
            failure,
            exit_code,
        }
    }

    fn judge(&self, timeout: Duration) -> (BuildStatus, Option<Failure>, Option<i32>) {
        let fail = |reason: &str, detail: String| {
            Some(Failure {
                reason: reason.into(),
                detail,
            })
        };
        if let Some(f) = &self.not_started {
            return (BuildStatus::Failed, Some(f.clone()), None);
        }
        if let Some(reason) = &self.disk_failure {
            return (
                BuildStatus::Failed,
                fail(reason, "the build log could not be stored".into()),
                None,
            );
        }
        match self.ended {
            Ended::Cancelled if self.user_cancelled => (
                BuildStatus::Cancelled,
                fail("cancelled", "cancelled while running".into()),
                None,
            ),
            Ended::Cancelled => (
                BuildStatus::Failed,
                fail("cancelled", "stopped".into()),
                None,
            ),
            Ended::Timeout => (
                BuildStatus::Failed,
                fail(
                    "timeout",
                    format!("the build ran longer than {}s", timeout.as_secs()),
                ),
                None,
            ),
            Ended::Signal(sig) => (
                BuildStatus::Failed,
                fail(
                    "exit_status",
                    format!("the deployer was killed by signal {sig}"),
                ),
                None,
            ),
            Ended::Exit(0) => match &self.result {
                Some(Ok(_)) => (BuildStatus::Succeeded, None, Some(0)),
                Some(Err(e)) => (
                    BuildStatus::Failed,
                    fail("deployer_protocol", e.clone()),
                    Some(0),
                ),
                None => (
                    BuildStatus::Failed,
                    fail("deployer_protocol", "no result was read".into()),
                    Some(0),
                ),
            },
            Ended::Exit(-1) => (
                BuildStatus::Failed,
                fail("exit_status", "the deployer ended abnormally".into()),
                None,
            ),
            Ended::Exit(code) => (
                BuildStatus::Failed,
                fail(
                    "exit_status",
                    format!("the deployer exited with status {code}"),
                ),
                Some(code),
            ),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeployResultNode {
    name: String,
    changed: bool,
    #[serde(default)]
    sbom: Option<SbomRef>,
}

#[derive(Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
enum SbomRef {
    Ready { path: String },
    Unavailable { reason: String },
}

/// Checks a deploy or destroy result against the protocol and the SBOM
/// files it names (each file: beneath the scratch dir, regular, limited,
/// CycloneDX JSON). A bad SBOM makes only that node's SBOM unavailable.
pub(super) fn read_deploy_result(
    root: &std::path::Path,
    kind: BuildKind,
) -> Result<NodeResults, String> {
    let bytes = match runner::read_result(&root.join("result.json")) {
        Ok(Some(b)) => b,
        Ok(None) => return Err("the deployer wrote no result".into()),
        Err(e) => return Err(format!("result file: {e}")),
    };
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|_| "the result is not JSON".to_string())?;
    if kind == BuildKind::Destroy {
        return if value.is_object() {
            Ok(vec![])
        } else {
            Err("a destroy result must be an object".into())
        };
    }
    #[derive(Deserialize)]
    struct DeployResult {
        nodes: Vec<DeployResultNode>,
    }
    let parsed: DeployResult = serde_json::from_value(value)
        .map_err(|_| "the deploy result does not match the protocol (nodes)".to_string())?;
    let scratch = root.join("scratch");
    let mut out = Vec::with_capacity(parsed.nodes.len());
    let mut names = std::collections::HashSet::new();
    for node in parsed.nodes {
        if !names.insert(node.name.clone()) {
            return Err("the deploy result names a node twice".into());
        }
        let verdict = match (&node.sbom, node.changed) {
            (Some(SbomRef::Ready { path }), _) => check_sbom(&scratch, path),
            (Some(SbomRef::Unavailable { reason }), _) => Err(reason.chars().take(2000).collect()),
            (None, false) => Ok(()),
            (None, true) => Err("the deployer gave no SBOM".into()),
        };
        out.push((node.name, verdict));
    }
    Ok(out)
}

fn check_sbom(scratch: &std::path::Path, rel: &str) -> Result<(), String> {
    let bytes = runner::open_beneath(scratch, rel, MAX_SBOM_BYTES).map_err(|e| match e {
        OpenError::Missing => "the SBOM file is missing".to_string(),
        OpenError::Refused(why) => why,
    })?;
    let doc: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|_| "the SBOM is not JSON".to_string())?;
    if doc.get("bomFormat").and_then(|v| v.as_str()) != Some("CycloneDX") {
        return Err("the SBOM is not CycloneDX".into());
    }
    if bytes.windows(6).any(|w| w == b"\\u0000") {
        return Err("the SBOM contains U+0000".into());
    }
    Ok(())
}
