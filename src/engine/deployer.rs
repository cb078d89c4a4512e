//! Calls of `describe` and `eval`: the deployer's answers about a source and
//! a configuration, with their caches, slots and timeouts.

use crate::locks::Held;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use serde_json::Value;
use tokio::sync::{mpsc, watch};

use super::refusal::{EvalUnavailable, FieldError, Refusal};
use super::runner::{self, CallDirs, Ended, Invocation};
use super::Engine;
use crate::derive::{CatalogEntry, Rename};
use crate::model::Source;
use crate::store::Lookup;

/// Schema errors reported in one refusal at most.
const MAX_SCHEMA_FIELDS: usize = 20;
/// Output of an eval or describe kept for the server log.
const MAX_CALL_OUTPUT_LINES: usize = 50;

#[derive(Debug, Deserialize)]
struct DescribeResult {
    methods: Vec<String>,
    default_method: String,
    #[serde(default)]
    actions: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    catalog: Vec<CatalogEntry>,
    #[serde(default)]
    renames: Vec<Rename>,
    #[serde(default)]
    schema: Option<Value>,
    #[serde(default)]
    verbs: Vec<String>,
    #[serde(default)]
    labels: Vec<String>,
}

/// What a source says about itself, with its schema compiled.
pub struct Described {
    pub methods: Vec<String>,
    pub default_method: String,
    pub actions: BTreeMap<String, Vec<String>>,
    pub catalog: Vec<CatalogEntry>,
    pub renames: Vec<Rename>,
    /// The optional verbs the deployer implements (`check`, `confirm`,
    /// `activate`).
    pub verbs: Vec<String>,
    /// The labels a worker needs to run this source's builds (sorted).
    pub labels: Vec<String>,
    validator: Option<(boon::Schemas, boon::SchemaIndex)>,
}

impl Described {
    /// Whether this source lists `action` for `method`.
    pub fn supports(&self, action: &str, method: &str) -> bool {
        self.actions
            .get(action)
            .is_some_and(|methods| methods.iter().any(|m| m == method))
    }

    /// deployer.md: with both `check` and `confirm`, every deploy has a
    /// health step.
    pub fn checks_health(&self) -> bool {
        ["check", "confirm"]
            .iter()
            .all(|v| self.verbs.iter().any(|have| have == v))
    }

    /// rollouts.md: with `activate`, a deploy builds and activates nothing,
    /// and berth activates its changed nodes in waves.
    pub fn activates(&self) -> bool {
        self.verbs.iter().any(|v| v == "activate")
    }

    pub fn parse(text: &str) -> Result<Described, String> {
        let r: DescribeResult =
            serde_json::from_str(text).map_err(|e| format!("describe result: {e}"))?;
        if !r.methods.contains(&r.default_method) {
            return Err("describe result: default_method is not one of methods".into());
        }
        let labels = crate::authority::parse_labels(&r.labels.join(","))
            .map_err(|why| format!("describe result: labels: {why}"))?;
        let validator = match r.schema {
            None | Some(Value::Null) => None,
            Some(schema) => {
                let mut schemas = boon::Schemas::new();
                let mut compiler = boon::Compiler::new();
                let url = "urn:berth:configuration-schema";
                compiler
                    .add_resource(url, schema)
                    .map_err(|e| format!("describe schema: {e}"))?;
                let index = compiler
                    .compile(url, &mut schemas)
                    .map_err(|e| format!("describe schema: {e}"))?;
                Some((schemas, index))
            }
        };
        Ok(Described {
            methods: r.methods,
            default_method: r.default_method,
            actions: r.actions,
            catalog: r.catalog,
            renames: r.renames,
            verbs: r.verbs,
            labels,
            validator,
        })
    }

    /// Schema errors as field pointers under `/configuration`, keyword as code.
    pub fn schema_errors(&self, config: &Value) -> Vec<FieldError> {
        let Some((schemas, index)) = &self.validator else {
            return vec![];
        };
        let Err(error) = schemas.validate(config, *index) else {
            return vec![];
        };
        let mut out = Vec::new();
        collect_leaves(&error, &mut out);
        out.dedup();
        out.truncate(MAX_SCHEMA_FIELDS);
        out
    }

    /// The method a configuration names: a collapsed one's key, a flat one's
    /// `method` member, else the source's default.
    pub fn method_of(&self, shaped: &crate::derive::Shaped) -> String {
        shaped
            .method
            .map(str::to_string)
            .unwrap_or_else(|| self.default_method.clone())
    }
}

fn collect_leaves(e: &boon::ValidationError, out: &mut Vec<FieldError>) {
    if e.causes.is_empty() {
        // The keyword is the variant name of the error kind, never its values.
        let debug = format!("{:?}", e.kind);
        let name: String = debug
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect();
        out.push(FieldError::new(
            format!("/configuration{}", e.instance_location),
            snake(&name),
        ));
    }
    for cause in &e.causes {
        collect_leaves(cause, out);
    }
}

fn snake(camel: &str) -> String {
    let mut s = String::new();
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            s.push('_');
        }
        s.push(c.to_ascii_lowercase());
    }
    s
}

/// deployer.md: every node an eval names is a DNS label (a name can come
/// from a configuration, and names reach paths and routes).
fn eval_names_ok(result: &Value) -> bool {
    result["nodes"].as_array().is_some_and(|nodes| {
        nodes.iter().all(|n| {
            n.get("name")
                .and_then(Value::as_str)
                .is_some_and(super::verdict::valid_node_name)
        })
    })
}

/// The outcome of an eval that ran to a verdict.
pub enum EvalVerdict {
    Nodes(Value),
    Refused(String),
}

/// Describe calls running at once at most (each is a deployer process; the
/// public derive routes can ask for one).
const MAX_DESCRIBES: usize = 4;
/// How long a failed describe answers for its source without a new call.
const DESCRIBE_FAILURE_TTL: std::time::Duration = std::time::Duration::from_secs(10);

/// Describes in flight and recent failures: one call per source digest at a
/// time (the others wait for its answer), at most `MAX_DESCRIBES` at once,
/// and a failure remembered for `DESCRIBE_FAILURE_TTL`.
pub struct Describing {
    in_flight: crate::locks::KeyLocks,
    failed: Mutex<HashMap<String, (std::time::Instant, Refusal)>>,
    slots: tokio::sync::Semaphore,
}

impl Default for Describing {
    fn default() -> Self {
        Describing {
            in_flight: crate::locks::KeyLocks::default(),
            failed: Mutex::new(HashMap::new()),
            slots: tokio::sync::Semaphore::new(MAX_DESCRIBES),
        }
    }
}

impl Describing {
    fn recent_failure(&self, digest: &str) -> Option<Refusal> {
        let mut failed = self.failed.held();
        match failed.get(digest) {
            Some((at, refusal)) if at.elapsed() < DESCRIBE_FAILURE_TTL => Some(refusal.clone()),
            Some(_) => {
                failed.remove(digest);
                None
            }
            None => None,
        }
    }

    fn remember_failure(&self, digest: &str, refusal: &Refusal) {
        let mut failed = self.failed.held();
        // Bounded: expired entries go first; the map holds at most one entry
        // per source a caller named in the last `DESCRIBE_FAILURE_TTL`.
        failed.retain(|_, (at, _)| at.elapsed() < DESCRIBE_FAILURE_TTL);
        failed.insert(
            digest.to_string(),
            (std::time::Instant::now(), refusal.clone()),
        );
    }
}

impl Engine {
    fn described_in_memory(&self, digest: &str) -> Option<Arc<Described>> {
        self.described.held().get(digest).cloned()
    }

    /// The labels a build of `source` requires (workers.md "Which builds go
    /// where"): `--build-labels` and the source's own, sorted. `None` while
    /// the source is not described in this process yet (a claim describes
    /// it and decides).
    pub fn required_labels(&self, source_digest: &str) -> Option<Vec<String>> {
        let described = self.described_in_memory(source_digest)?;
        let mut labels = self.settings.build_labels.0.clone();
        labels.extend(described.labels.iter().cloned());
        labels.sort();
        labels.dedup();
        Some(labels)
    }

    /// Whether a deploy of this source rolls out: its deployer lists
    /// `activate`. Known only once described in this process.
    pub fn lists_activate(&self, source_digest: &str) -> bool {
        self.described_in_memory(source_digest)
            .is_some_and(|d| d.activates())
    }

    /// `describe` of a source: memory, then the store, then the deployer
    /// (one call per digest at a time; a failure is remembered briefly).
    pub async fn describe(&self, source: &Source) -> Result<Arc<Described>, Refusal> {
        if let Some(d) = self.described_in_memory(&source.digest) {
            return Ok(d);
        }
        if let Some(refusal) = self.describing.recent_failure(&source.digest) {
            return Err(refusal);
        }
        // A dropped caller frees the digest's entry too (the guard's drop).
        let _one_at_a_time = self.describing.in_flight.lock(source.digest.clone()).await;
        // Whoever held it before may have answered for us.
        let answer = match self.described_in_memory(&source.digest) {
            Some(d) => Ok(d),
            None => match self.describing.recent_failure(&source.digest) {
                Some(refusal) => Err(refusal),
                None => {
                    let answer = self.describe_now(source).await;
                    if let Err(refusal) = &answer {
                        if !matches!(refusal, Refusal::Store(_)) {
                            self.describing.remember_failure(&source.digest, refusal);
                        }
                    }
                    answer
                }
            },
        };
        answer
    }

    /// The store's cached describe, else the deployer's (in a describe slot).
    async fn describe_now(&self, source: &Source) -> Result<Arc<Described>, Refusal> {
        let cached = self.store.read()?.describe(&source.digest)?;
        let text = match cached {
            Some(text) => text,
            None => {
                let request = serde_json::json!({"source": source})
                    .to_string()
                    .into_bytes();
                let _slot = self
                    .describing
                    .slots
                    .acquire()
                    .await
                    .map_err(|_| Refusal::Internal)?;
                let (ended, result, output) = self.call("describe", request, None, None).await?;
                let text = match (ended, result) {
                    (Ended::Exit(0), Ok(Some(bytes))) => {
                        String::from_utf8_lossy(&bytes).into_owned()
                    }
                    (Ended::Timeout, _) => {
                        return Err(Refusal::eval_unavailable(
                            EvalUnavailable::Timeout,
                            "the deployer's describe timed out",
                        ))
                    }
                    _ => {
                        tracing::warn!(digest = %source.digest, ?ended, output = ?output, "describe failed");
                        return Err(Refusal::eval_unavailable(
                            EvalUnavailable::Crashed,
                            "the deployer's describe failed; the server log has its output",
                        ));
                    }
                };
                // Check before caching: a bad answer is not cached.
                Described::parse(&text).map_err(|e| {
                    tracing::warn!(digest = %source.digest, error = %e, "describe result is invalid");
                    Refusal::eval_unavailable(EvalUnavailable::Crashed, "the deployer's describe result is invalid; the server log has the detail")
                })?;
                let digest = source.digest.clone();
                let stored = text.clone();
                self.store
                    .write(move |tx| tx.put_describe(&digest, &stored))
                    .await?;
                text
            }
        };
        let described = Arc::new(Described::parse(&text).map_err(|e| {
            tracing::error!(digest = %source.digest, error = %e, "cached describe result is invalid");
            Refusal::Internal
        })?);
        self.described
            .held()
            .insert(source.digest.clone(), described.clone());
        Ok(described)
    }

    /// Runs `eval`. `Ok(None)` when no eval slot is free.
    pub async fn eval(&self, request: Value) -> Result<Option<EvalVerdict>, Refusal> {
        let Ok(permit) = self.eval_slots.clone().try_acquire_owned() else {
            return Ok(None);
        };
        let (ended, result, output) = self
            .call("eval", request.to_string().into_bytes(), None, Some(permit))
            .await?;
        let parsed = result
            .ok()
            .flatten()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok());
        match ended {
            Ended::Exit(0) => match parsed {
                Some(v) if v.get("nodes").is_some_and(Value::is_array) && eval_names_ok(&v) => {
                    Ok(Some(EvalVerdict::Nodes(v)))
                }
                _ => {
                    tracing::warn!(output = ?output, "eval result breaks the protocol");
                    Err(Refusal::eval_unavailable(
                        EvalUnavailable::Crashed,
                        "the deployer's eval result is invalid",
                    ))
                }
            },
            Ended::Exit(1) => match parsed
                .as_ref()
                .and_then(|v| v.pointer("/error/message"))
                .and_then(Value::as_str)
            {
                Some(message) => Ok(Some(EvalVerdict::Refused(message.to_string()))),
                None => {
                    tracing::warn!(output = ?output, "eval exited 1 without an error result");
                    Err(Refusal::eval_unavailable(
                        EvalUnavailable::Crashed,
                        "the deployer's eval failed without a verdict",
                    ))
                }
            },
            Ended::Timeout => Err(Refusal::eval_unavailable(
                EvalUnavailable::Timeout,
                "the deployer's eval timed out",
            )),
            other => {
                tracing::warn!(?other, output = ?output, "eval crashed");
                Err(Refusal::eval_unavailable(
                    EvalUnavailable::Crashed,
                    "the deployer's eval crashed",
                ))
            }
        }
    }

    /// One short call (describe, eval) with the eval timeout, in a fresh
    /// scratch dir that is removed afterwards. The call runs in its own task,
    /// which owns the process, the eval slot (`permit`) and the dir: a caller
    /// that goes away (a dropped request) leaves nothing behind; the timeout
    /// still holds, the slot is freed when the process group is dead, and
    /// the dir is removed.
    async fn call(
        &self,
        verb: &'static str,
        request: Vec<u8>,
        work_dir: Option<std::path::PathBuf>,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Result<(Ended, Result<Option<Vec<u8>>, String>, Vec<String>), Refusal> {
        self.call_within(
            verb,
            request,
            work_dir,
            permit,
            self.settings.eval_timeout,
            None,
        )
        .await
    }

    /// As `call`, with its own time limit (a health check's is
    /// `--health-interval`); a call of a running build (`of_build`: a
    /// health step's or a rollout's) is its job until the next one, so a
    /// restart stops it if it outlives berth.
    pub(super) async fn call_within(
        &self,
        verb: &'static str,
        request: Vec<u8>,
        work_dir: Option<std::path::PathBuf>,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
        timeout: std::time::Duration,
        of_build: Option<crate::model::BuildId>,
    ) -> Result<CallEnded, Refusal> {
        let grace = self
            .settings
            .cancel_grace
            .min(std::time::Duration::from_secs(5));
        let call = OneCall {
            verb,
            request,
            work_dir,
            timeout,
            grace,
        };
        let store = self.store.clone();
        let record = |job| async move {
            let Some(build) = of_build else {
                return Ok(());
            };
            store
                .write(move |tx| {
                    let Some(mut b) = tx.build(build)? else {
                        return Ok(());
                    };
                    b.job = Some(job);
                    tx.put_build(&b)
                })
                .await
                .map_err(|e| e.to_string())
        };
        call.run_recorded(&self.deployer, &self.settings.scratch_root(), permit, record)
            .await
            .map_err(|e| match e {
                CallError::Setup(e) => {
                    tracing::error!(error = %e, "cannot create a scratch dir");
                    Refusal::Internal
                }
                CallError::Spawn(e) => {
                    tracing::error!(error = %e, program = %self.deployer.program.display(), "cannot start the deployer");
                    Refusal::eval_unavailable(
                        EvalUnavailable::Crashed,
                        "the deployer cannot be started; the server log has the detail",
                    )
                }
                CallError::Task(e) => {
                    tracing::error!(error = %e, "a deployer call's task stopped");
                    Refusal::Internal
                }
                CallError::Record(e) => {
                    tracing::error!(error = %e, "cannot record a deployer call's process; it did not run");
                    Refusal::Internal
                }
            })
    }
}

/// One deployer call that records no job (describe, eval, a health
/// step's check and confirm), the same for berth and a worker: its own
/// scratch dir under `scratch_root`, its time limit, its output kept.
pub struct OneCall {
    pub verb: &'static str,
    pub request: Vec<u8>,
    /// Its `BERTH_WORK_DIR` (a scratch dir of its own when `None`).
    pub work_dir: Option<std::path::PathBuf>,
    pub timeout: std::time::Duration,
    /// SIGTERM to SIGKILL when it runs past `timeout`.
    pub grace: std::time::Duration,
}

/// Why a call did not run to an end.
#[derive(Debug)]
pub enum CallError {
    Setup(std::io::Error),
    Spawn(std::io::Error),
    Task(tokio::task::JoinError),
    /// Its process could not be recorded (a store that failed).
    Record(String),
}

/// How a call ended: its end, its result file, its first output lines.
pub type CallEnded = (Ended, Result<Option<Vec<u8>>, String>, Vec<String>);

impl OneCall {
    /// Runs it: how it ended, its result file, its first output lines.
    /// `permit` (an eval slot) is held until the call ends, even when the
    /// caller stops waiting for it.
    pub async fn run(
        self,
        deployer: &runner::DeployerCommand,
        scratch_root: &std::path::Path,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Result<CallEnded, CallError> {
        self.run_recorded(deployer, scratch_root, permit, |_| async { Ok(()) })
            .await
    }

    /// As `run`, with the call's process recorded by `record` before the
    /// deployer may do anything (its gate opens after), so a restart finds
    /// it if berth dies meanwhile. A record that fails: nothing ran.
    pub async fn run_recorded<R, F>(
        self,
        deployer: &runner::DeployerCommand,
        scratch_root: &std::path::Path,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
        record: R,
    ) -> Result<CallEnded, CallError>
    where
        R: FnOnce(crate::model::Job) -> F,
        F: std::future::Future<Output = Result<(), String>>,
    {
        let call_id = crate::hex::encode(&uuid::Uuid::now_v7().as_u128().to_be_bytes());
        let root = scratch_root.join(format!("call-{call_id}"));
        let dirs = CallDirs::create(root.clone()).map_err(CallError::Setup)?;
        let inv = Invocation {
            verb: self.verb,
            request: self.request,
            work_dir: self.work_dir.unwrap_or_else(|| dirs.scratch.clone()),
            scratch_dir: dirs.scratch,
            result_path: dirs.result_path,
        };
        let mut spawned = match runner::spawn(deployer, &inv) {
            Ok(spawned) => spawned,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&root);
                return Err(CallError::Spawn(e));
            }
        };
        if let Err(why) = record(spawned.job).await {
            // The gate stays closed: the process exits without running the
            // deployer, and is reaped here.
            spawned.abandon();
            runner::signal_group(spawned.job.pid, nix::sys::signal::Signal::SIGKILL);
            let (ended, _, _) =
                run_call(spawned, self.timeout, std::time::Duration::ZERO, root).await;
            tracing::debug!(
                ?ended,
                "reaped a deployer call whose process could not be recorded"
            );
            return Err(CallError::Record(why));
        }
        spawned.start();
        let (timeout, grace) = (self.timeout, self.grace);
        tokio::spawn(async move {
            let _slot = permit;
            run_call(spawned, timeout, grace, root).await
        })
        .await
        .map_err(CallError::Task)
    }
}

/// Waits for a describe or eval call: its output (a few lines kept for the
/// server log), its end, its result; then removes its dir.
async fn run_call(
    spawned: runner::Spawned,
    timeout: std::time::Duration,
    grace: std::time::Duration,
    root: std::path::PathBuf,
) -> (Ended, Result<Option<Vec<u8>>, String>, Vec<String>) {
    let (lines_tx, mut lines_rx) = mpsc::channel::<runner::Lines>(256);
    let (_cancel_tx, cancel_rx) = watch::channel(false);
    let collect = tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Some(batch) = lines_rx.recv().await {
            for line in batch.iter() {
                if kept.len() < MAX_CALL_OUTPUT_LINES {
                    kept.push(line.to_string());
                }
            }
        }
        kept
    });
    let ended = runner::wait(spawned, Some(timeout), grace, cancel_rx, lines_tx).await;
    let output = match collect.await {
        Ok(kept) => kept,
        Err(e) => {
            // Only a panic in the collector gets here; the call's result
            // file still decides how it ended.
            tracing::error!(error = %e, "the deployer call's output collector failed");
            vec!["[berth] the deployer's output was lost (see berth's log)".to_string()]
        }
    };
    let result = runner::read_result(&root);
    let _ = std::fs::remove_dir_all(&root);
    (ended, result, output)
}
