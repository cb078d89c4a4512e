//! How a deployer run ended, turned into a build's final status: the exit,
//! a cancel or timeout, a log that could not be stored, and for a deploy the
//! result file checked against the protocol with every SBOM it names.

use std::time::Duration;

use serde::Deserialize;

use super::health::HealthEnd;
use super::log_pipe::LogBuffer;
use super::outcome::{ComponentBytes, End, Halt, NodeOutcome, PreparedSbom, SbomOutcome};
use super::runner::{self, Ended, OpenError};
use crate::model::*;
use crate::sbom;
use crate::store::compress;

/// How a build's deployer run ended, before it is stored.
pub(super) struct RunOutcome {
    pub(super) root: std::path::PathBuf,
    /// How the deployer's process ended; `Err` when it never ran (its
    /// directories or process could not be made, its record not stored)
    /// or berth lost track of it (the task waiting on it failed).
    pub(super) ended: Result<Ended, Failure>,
    /// For exit 0: the checked result (nodes and their SBOM verdicts).
    pub(super) result: Option<Result<Vec<NodeOutcome>, String>>,
    /// How the health step ended, when the deploy had one.
    pub(super) health: Option<HealthEnd>,
    pub(super) log: LogBuffer,
    /// Why the log could not be stored, when it could not.
    pub(super) disk_failure: Option<FailureReason>,
    /// Who stopped the deployer, when it was stopped.
    pub(super) halted: Halt,
    /// Why the work dir at the end could not be stored (a deployment whose
    /// work state is stored): a would-be success fails `work_state_invalid`.
    pub(super) work_state_problem: Option<String>,
}

impl RunOutcome {
    /// The deployer did not run to an end berth saw.
    pub(super) fn failed(root: &std::path::Path, failure: Failure, log: LogBuffer) -> RunOutcome {
        RunOutcome {
            root: root.to_path_buf(),
            ended: Err(failure),
            result: None,
            health: None,
            log,
            disk_failure: None,
            halted: Halt::No,
            work_state_problem: None,
        }
    }

    /// The build's final status, failure and exit code.
    pub(super) fn verdict(&self, timeout: Duration) -> End {
        let (mut status, mut failure, exit_code) = self.judge(timeout);
        if let (BuildStatus::Succeeded, Some(why)) = (status, &self.work_state_problem) {
            status = BuildStatus::Failed;
            failure = Some(Failure::new(FailureReason::WorkStateInvalid, why.clone()));
        }
        End {
            status,
            failure,
            exit_code,
        }
    }

    fn judge(&self, timeout: Duration) -> (BuildStatus, Option<Failure>, Option<i32>) {
        use FailureReason as R;
        let fail = |reason: FailureReason, detail: String| Some(Failure::new(reason, detail));
        let ended = match &self.ended {
            Ok(ended) => *ended,
            Err(f) => return (BuildStatus::Failed, Some(f.clone()), None),
        };
        if let Some(reason) = self.disk_failure {
            return (
                BuildStatus::Failed,
                fail(reason, "the build log could not be stored".into()),
                None,
            );
        }
        match ended {
            Ended::Cancelled => match self.halted {
                Halt::Cancel => (
                    BuildStatus::Cancelled,
                    fail(R::Cancelled, "cancelled while running".into()),
                    None,
                ),
                Halt::Shutdown => (
                    BuildStatus::Failed,
                    fail(
                        R::InterruptedByShutdown,
                        "berth was stopping and --shutdown-grace was over".into(),
                    ),
                    None,
                ),
                // Stopped by berth itself: the log could not be stored
                // (`disk_failure`, judged above) is the only other cause.
                Halt::No => (
                    BuildStatus::Failed,
                    fail(R::Cancelled, "stopped".into()),
                    None,
                ),
            },
            Ended::Timeout => (
                BuildStatus::Failed,
                fail(
                    R::Timeout,
                    format!("the build ran longer than {}s", timeout.as_secs()),
                ),
                None,
            ),
            Ended::Signal(sig) => (
                BuildStatus::Failed,
                fail(
                    R::ExitStatus,
                    format!("the deployer was killed by signal {sig}"),
                ),
                None,
            ),
            Ended::StatusUnknown => (
                BuildStatus::Failed,
                fail(
                    R::ExitStatus,
                    "the deployer's exit status could not be read".into(),
                ),
                None,
            ),
            Ended::Exit(0) => self.judge_exit_zero(),
            Ended::Exit(code) => (
                BuildStatus::Failed,
                fail(
                    R::ExitStatus,
                    format!("the deployer exited with status {code}"),
                ),
                Some(code),
            ),
        }
    }

    /// A deployer that exited 0: its result, then the health step, decide.
    fn judge_exit_zero(&self) -> (BuildStatus, Option<Failure>, Option<i32>) {
        use FailureReason as R;
        let fail = |reason: FailureReason, detail: String| Some(Failure::new(reason, detail));
        match &self.result {
            Some(Ok(_)) => match &self.health {
                None | Some(HealthEnd::Confirmed) => (BuildStatus::Succeeded, None, Some(0)),
                Some(HealthEnd::Aborted(reason, detail)) => {
                    (BuildStatus::Failed, fail(*reason, detail.clone()), Some(0))
                }
                Some(HealthEnd::Failed(detail)) => (
                    BuildStatus::Failed,
                    fail(R::HealthCheckFailed, detail.clone()),
                    Some(0),
                ),
                Some(HealthEnd::Halted(Halt::Cancel)) => (
                    BuildStatus::Cancelled,
                    fail(
                        R::Cancelled,
                        "cancelled during the health step; nothing was confirmed".into(),
                    ),
                    Some(0),
                ),
                Some(HealthEnd::Halted(Halt::Shutdown | Halt::No)) => (
                    BuildStatus::Failed,
                    fail(
                        R::InterruptedByShutdown,
                        "berth was stopping during the health step; nothing was confirmed".into(),
                    ),
                    Some(0),
                ),
            },
            Some(Err(e)) => (
                BuildStatus::Failed,
                fail(R::DeployerProtocol, e.clone()),
                Some(0),
            ),
            None => (
                BuildStatus::Failed,
                fail(R::DeployerProtocol, "no result was read".into()),
                Some(0),
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
    /// deployer.md: changes exactly when what the node runs changes.
    #[serde(default)]
    fingerprint: Option<String>,
    /// deployer.md: what an agent fetches (checked by `result_artifact`).
    #[serde(default)]
    artifact: Option<serde_json::Value>,
}

/// Reads a file artifact a result names (its path beneath the scratch
/// dir): its digest and size; `Ok(None)` where the file is not at hand
/// (a remote worker's result: not carried yet).
pub(super) type ArtifactFile<'a> = &'a dyn Fn(&str) -> Result<Option<ArtifactRead>, String>;

/// A file artifact as read: its digest, size and zstd bytes.
pub(super) type ArtifactRead = (String, u64, std::sync::Arc<Vec<u8>>);

/// A node's `artifact` in a deploy result, checked: a file (read and
/// digested through `file`) or a store path.
fn result_artifact(
    v: &serde_json::Value,
    file: ArtifactFile,
) -> Result<(Option<Artifact>, Option<ArtifactRead>), String> {
    let kind = v.get("kind").and_then(serde_json::Value::as_str);
    match kind {
        Some("file") => {
            let path = v
                .get("path")
                .and_then(serde_json::Value::as_str)
                .ok_or("a file artifact names its `path` beneath the scratch dir")?;
            let read = file(path)?;
            let artifact = read.as_ref().map(|(digest, size, _)| Artifact {
                kind: ArtifactKind::File,
                id: digest.clone(),
                size: Some(*size),
                url: None,
            });
            Ok((artifact, read))
        }
        Some("nix-store-path") => crate::nodes::parse_artifact(v, "/artifact")
            .map(|a| (a, None))
            .map_err(|b| format!("a store path artifact: {}", b.message)),
        _ => Err("an artifact's kind is `file` or `nix-store-path`".into()),
    }
}

/// A file artifact beneath `root`'s scratch dir: its digest and size.
pub(super) fn read_artifact(
    root: &std::path::Path,
    rel: &str,
    limit: u64,
) -> Result<Option<ArtifactRead>, String> {
    use sha2::{Digest, Sha256};
    let bytes = runner::open_in_scratch(root, rel, limit).map_err(|e| match e {
        OpenError::Missing => format!("the artifact file {rel} is missing"),
        OpenError::Refused(why) => format!("the artifact file {rel}: {why}"),
    })?;
    let digest = format!("sha256:{}", crate::hex::encode(&Sha256::digest(&bytes)));
    let compressed = compress::compress(&bytes).map_err(|e| e.to_string())?;
    Ok(Some((
        digest,
        bytes.len() as u64,
        std::sync::Arc::new(compressed),
    )))
}

/// The paths a deploy result's nodes name under `key` where `key`'s
/// `field` is `value`: the ready SBOMs (`sbom`, `status`, `ready`), the
/// file artifacts (`artifact`, `kind`, `file`). The files a worker
/// uploads with its outcome.
pub fn node_paths(
    result: &serde_json::Value,
    key: &str,
    (field, value): (&str, &str),
) -> Vec<String> {
    result["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n[key][field] == value)
        .filter_map(|n| n[key]["path"].as_str().map(str::to_string))
        .collect()
}

/// A fingerprint longer than this is a protocol error (a digest or a store
/// path fits many times over).
pub const MAX_FINGERPRINT_CHARS: usize = 512;

/// deployer.md: every node name in a result is a DNS label (it names files
/// and SBOM routes).
pub fn valid_node_name(name: &str) -> bool {
    is_dns_label(name, 63)
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
/// Blocking: run it off the async workers (a document may be 64 MiB).
pub(super) fn read_deploy_result(
    root: &std::path::Path,
    kind: BuildKind,
    store: &crate::store::Store,
    artifact_limit: u64,
) -> Result<Vec<NodeOutcome>, String> {
    let bytes = match runner::read_result(root) {
        Ok(Some(b)) => b,
        Ok(None) => return Err("the deployer wrote no result".into()),
        Err(e) => return Err(format!("result file: {e}")),
    };
    parse_result(&bytes, kind, |path| read_sbom(root, path, store), &|path| {
        read_artifact(root, path, artifact_limit)
    })
}

/// Checks a result's JSON against the protocol; `sbom` reads and checks
/// the SBOM file a node names (a local build's scratch dir, a worker's
/// uploaded files).
pub(super) fn parse_result(
    bytes: &[u8],
    kind: BuildKind,
    sbom: impl Fn(&str) -> Result<PreparedSbom, String>,
    artifact: ArtifactFile,
) -> Result<Vec<NodeOutcome>, String> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|_| "the result is not JSON".to_string())?;
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
    let mut out = Vec::with_capacity(parsed.nodes.len());
    let mut names = std::collections::HashSet::new();
    for node in parsed.nodes {
        if !valid_node_name(&node.name) {
            return Err("the deploy result names a node that is not a DNS label".into());
        }
        if !names.insert(node.name.clone()) {
            return Err("the deploy result names a node twice".into());
        }
        if node
            .fingerprint
            .as_ref()
            .is_some_and(|f| f.is_empty() || f.chars().count() > MAX_FINGERPRINT_CHARS)
        {
            return Err("the deploy result has a fingerprint that is empty or too long".into());
        }
        let sbom = match (&node.sbom, node.changed) {
            (Some(SbomRef::Ready { path }), _) => match sbom(path) {
                Ok(prepared) => SbomOutcome::Ready(prepared),
                Err(reason) => SbomOutcome::Unavailable(reason),
            },
            (Some(SbomRef::Unavailable { reason }), _) => {
                SbomOutcome::Unavailable(reason.chars().take(MAX_REASON_CHARS).collect())
            }
            (None, false) => SbomOutcome::Kept,
            (None, true) => SbomOutcome::Unavailable("the deployer gave no SBOM".into()),
        };
        let (artifact, artifact_bytes) = match &node.artifact {
            Some(v) => {
                result_artifact(v, artifact).map_err(|why| format!("node {}: {why}", node.name))?
            }
            None => (None, None),
        };
        out.push(NodeOutcome {
            name: node.name,
            changed: node.changed,
            sbom,
            fingerprint: node.fingerprint,
            artifact,
            artifact_bytes,
        });
    }
    Ok(out)
}

/// A deployer's reason for a missing SBOM is cut to this many characters.
const MAX_REASON_CHARS: usize = 2000;

fn read_sbom(
    root: &std::path::Path,
    rel: &str,
    store: &crate::store::Store,
) -> Result<PreparedSbom, String> {
    let bytes = runner::open_in_scratch(root, rel, sbom::MAX_SBOM_BYTES).map_err(|e| match e {
        OpenError::Missing => "the SBOM file is missing".to_string(),
        OpenError::Refused(why) => why,
    })?;
    prepare_sbom(&bytes, store)
}

/// Checks an SBOM file's bytes (sbom.md) and splits and compresses it for
/// the build's final transaction (components the store has already are
/// not compressed again).
pub(super) fn prepare_sbom(
    bytes: &[u8],
    store: &crate::store::Store,
) -> Result<PreparedSbom, String> {
    let doc = sbom::check(bytes).map_err(|e| e.to_string())?;
    let split = sbom::split(doc).map_err(|e| e.to_string())?;
    let compress = |text: &[u8]| {
        compress::compress(text).map_err(|_| "the SBOM could not be compressed".to_string())
    };
    let skeleton = compress(split.skeleton.to_string().as_bytes())?;
    // A store that cannot be read now only costs compression.
    let rx = store.read().ok();
    let known = |hash: &sbom::Hash| {
        rx.as_ref()
            .is_some_and(|rx| rx.has_component(hash).unwrap_or(false))
    };
    let components = split
        .components
        .into_iter()
        .map(|c| {
            let bytes = if known(&c.hash) {
                ComponentBytes::Known(c.text)
            } else {
                ComponentBytes::Compressed(compress(c.text.as_bytes())?)
            };
            Ok((c.hash, bytes))
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(PreparedSbom {
        skeleton,
        had_components: split.had_components,
        components,
    })
}
