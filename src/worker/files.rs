//! What travels with an attempt besides its lines (workers.md "Blobs",
//! "The work state"): the deployment's work state, unpacked into the work
//! dir before the deployer runs and archived after it; the SBOM files its
//! result names; both uploaded before the outcome that names them.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use super::{Attempt, Worker, CALL_TIMEOUT, MAX_BACKOFF};
use crate::archive;
use crate::engine::runner;
use crate::engine::verdict::node_paths;

/// What the outcome says of the files: `files`, `work_state` and
/// `work_state_problem`.
pub(super) struct Carried {
    pub files: BTreeMap<String, String>,
    pub work_state: Value,
    pub work_state_problem: Value,
}

impl Carried {
    /// A run that never reached the deployer: the work state is the one
    /// it was handed.
    pub(super) fn untouched(a: &Attempt) -> Carried {
        Carried {
            files: BTreeMap::new(),
            work_state: a.work_state.as_ref().map_or(Value::Null, |d| json!(d)),
            work_state_problem: Value::Null,
        }
    }
}

impl Worker {
    /// Makes the work dir hold the work state the claim names (empty when
    /// it names none). `Err` is the `not_run` detail.
    pub(super) async fn restore(&self, a: &Attempt, work_dir: &Path) -> Result<(), String> {
        let tar = match &a.work_state {
            None => None,
            Some(digest) => Some(self.download(a, digest).await?),
        };
        archive::restore(tar, work_dir.to_path_buf(), self.deployer.run_as).await
    }

    /// The attempt's work state archive, checked against its digest.
    async fn download(&self, a: &Attempt, digest: &str) -> Result<Vec<u8>, String> {
        let path = format!("/internal/v1/attempts/{}/work-state", a.id);
        let mut pause = Duration::from_millis(100);
        loop {
            if Instant::now() >= a.deadline {
                return Err("the work state could not be downloaded within the lease".into());
            }
            let got = self
                .api
                .bytes(
                    reqwest::Method::GET,
                    &path,
                    self.authority(a),
                    None,
                    a.max_work_state,
                )
                .await;
            match got {
                Ok((200, tar)) if archive::digest(&tar) == digest => return Ok(tar),
                Ok((200, _)) => return Err("the downloaded work state has another digest".into()),
                Ok((status, _)) if status < 500 => {
                    return Err(format!("berth refused the work state download ({status})"))
                }
                Ok(_) | Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    fn authority(&self, a: &Attempt) -> Vec<(&'static str, String)> {
        vec![
            ("Berth-Fence", a.fence.to_string()),
            ("Berth-Worker-Incarnation", self.incarnation.clone()),
        ]
    }

    /// After the run: the SBOM files and file artifacts `result` names and
    /// the work dir's archive, uploaded (what berth has already is not sent again).
    pub(super) async fn carry(
        &self,
        a: &Attempt,
        root: &Path,
        work_dir: &Path,
        result: &Value,
    ) -> Carried {
        let mut files = BTreeMap::new();
        let named = node_paths(result, "sbom", ("status", "ready"))
            .into_iter()
            .map(|path| (path, crate::sbom::MAX_SBOM_BYTES))
            .chain(
                node_paths(result, "artifact", ("kind", "file"))
                    .into_iter()
                    .map(|path| (path, a.max_artifact_bytes)),
            );
        for (path, limit) in named {
            let read = runner::open_in_scratch(root, &path, limit);
            let Ok(bytes) = read else {
                // Not in `files`: berth judges it a missing file.
                continue;
            };
            let digest = archive::digest(&bytes);
            if self.upload(a, &digest, bytes).await {
                files.insert(path, digest);
            }
        }
        let (dir, max) = (work_dir.to_path_buf(), a.max_work_state);
        let packed = tokio::task::spawn_blocking(move || archive::pack(&dir, max)).await;
        let (work_state, problem) = match packed {
            Ok(Ok(None)) => (Value::Null, Value::Null),
            Ok(Ok(Some(p))) if Some(&p.digest) == a.work_state.as_ref() => {
                (json!(p.digest), Value::Null)
            }
            Ok(Ok(Some(p))) => {
                let digest = p.digest.clone();
                if self.upload(a, &digest, p.tar).await {
                    (json!(digest), Value::Null)
                } else {
                    (Value::Null, json!("unreadable"))
                }
            }
            Ok(Err(problem)) => {
                tracing::warn!(attempt = %a.id, problem = ?problem, "the work dir cannot be archived");
                (Value::Null, json!(problem.as_str()))
            }
            Err(e) => {
                tracing::warn!(attempt = %a.id, error = %e, "archiving the work dir failed");
                (Value::Null, json!("unreadable"))
            }
        };
        Carried {
            files,
            work_state,
            work_state_problem: problem,
        }
    }

    /// One blob, resent until answered or the deadline passes; whether
    /// berth has it.
    async fn upload(&self, a: &Attempt, digest: &str, bytes: Vec<u8>) -> bool {
        let path = format!("/internal/v1/attempts/{}/blobs/{digest}", a.id);
        let mut headers = self.authority(a);
        headers.push(("Content-Type", "application/octet-stream".into()));
        let mut pause = Duration::from_millis(100);
        while Instant::now() < a.deadline {
            let sent = self
                .api
                .bytes(
                    reqwest::Method::PUT,
                    &path,
                    headers.clone(),
                    Some(bytes.clone()),
                    64 * 1024,
                )
                .await;
            match sent {
                Ok((200 | 201, _)) => return true,
                Ok((status, answer)) if status < 500 => {
                    tracing::warn!(status, answer = %String::from_utf8_lossy(&answer), attempt = %a.id, "a blob upload was refused");
                    return false;
                }
                Ok(_) | Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_BACKOFF);
                }
            }
        }
        false
    }
}

impl super::Api {
    /// One call with a raw body and raw answer (at most `max_answer`
    /// bytes): a blob upload, the work state download.
    pub(super) async fn bytes(
        &self,
        method: reqwest::Method,
        path: &str,
        headers: Vec<(&'static str, String)>,
        body: Option<Vec<u8>>,
        max_answer: u64,
    ) -> Result<(u16, Vec<u8>), String> {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .timeout(CALL_TIMEOUT * 4);
        for (name, value) in headers {
            req = req.header(name, value);
        }
        if let Some(body) = body {
            req = req.body(body);
        }
        let mut resp = req.send().await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let mut bytes = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
            if (bytes.len() + chunk.len()) as u64 > max_answer {
                return Err(format!("an answer longer than {max_answer} bytes"));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok((status, bytes))
    }
}
