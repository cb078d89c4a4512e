//! The engine: every state change of deployments and builds, and everything
//! that runs by itself (the queue, builds, recovery, callbacks, sweeps).
//!
//! Handlers in `api` parse and authorize, then call one function here. Each
//! state change is one store transaction that checks the lifecycle rules
//! (spec lifecycle.md) and writes the records, the idempotency record and
//! the events of the change, together.

pub mod builds;
pub mod callbacks;
pub mod deployer;
pub mod recovery;
pub mod runner;
pub mod sweeps;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::{watch, Notify, Semaphore};

use crate::api::errors::{ApiError, Code};
use crate::api::idempotency::IdemWrite;
use crate::api::Reply;
use crate::events;
use crate::model::*;
use crate::settings::Settings;
use crate::store::{PendingCallback, Store, Tx};
use deployer::{Described, EvalVerdict};
use runner::DeployerCommand;

/// Counters shown on /metrics that are not in the store.
#[derive(Default)]
pub struct Metrics {
    pub requests: Mutex<HashMap<(String, u16), u64>>,
    pub log_bytes: AtomicU64,
    /// Stored builds by status (index = `BuildStatus as usize`), counted by
    /// a full scan at start and at every sweep: a scrape must stay cheap
    /// with millions of builds, so finished counts may be a sweep old.
    pub builds_by_status: Mutex<[u64; 5]>,
}

#[derive(Default)]
struct Sched {
    /// Builds that hold a build slot, with their deployment.
    running: HashMap<BuildId, String>,
    /// Deployments whose orphaned deployer (from before a restart) is still
    /// being stopped: nothing of theirs starts until it has exited.
    blocked: HashSet<String>,
}

pub struct Engine {
    pub settings: Arc<Settings>,
    pub store: Store,
    pub deployer: DeployerCommand,
    /// The source new submits use.
    pub default_source: Source,
    /// True when `--default-source` was given (a self-pin); automatic updates
    /// need one.
    pub has_self_pin: bool,
    eval_slots: Arc<Semaphore>,
    described: Mutex<HashMap<String, Arc<Described>>>,
    sched: Mutex<Sched>,
    wake: Notify,
    pub callbacks_wake: Notify,
    cancels: Mutex<HashMap<BuildId, watch::Sender<bool>>>,
    pub ready: AtomicBool,
    pub stopping: AtomicBool,
    pub metrics: Metrics,
    pub callback_secret: Vec<u8>,
    pub hub: Arc<crate::events::Hub>,
    stop: watch::Sender<bool>,
}

/// The source berth uses for its embedded `local` deployer when no
/// `--default-source` is given: named after berth's own version.
pub fn builtin_source() -> Source {
    let version = env!("CARGO_PKG_VERSION");
    let digest = Sha256::digest(format!("berth-local-deployer {version}").as_bytes());
    Source {
        url: "builtin:berth-local-deployer".into(),
        rev: version.into(),
        digest: format!("sha256:{}", crate::hex::encode(&digest)),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Replace,
    Enqueue,
}

/// A parsed submit or preview body.
pub struct SubmitInput {
    /// The configuration exactly as submitted.
    pub configuration_text: String,
    pub configuration: Value,
    pub source: Option<Source>,
    pub mode: Mode,
    pub keep_deployed_revision: bool,
    pub update_policy: Option<UpdatePolicy>,
}

/// What a validated configuration resolved to.
struct Validated {
    source: Source,
    method: String,
    domain: Option<String>,
    nodes: Option<Value>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn contains_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(a) => a.iter().any(contains_nul),
        Value::Object(m) => m.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)),
        _ => false,
    }
}

fn origin_of(url: &str) -> Option<String> {
    let u = reqwest::Url::parse(url).ok()?;
    let host = u.host_str()?;
    Some(match u.port_or_known_default() {
        Some(p) => format!("{}://{}:{}", u.scheme(), host, p),
        None => format!("{}://{}", u.scheme(), host),
    })
}

/// True when `url`'s origin is one of `allowed` (each `scheme://host[:port]`).
pub fn origin_allowed(url: &str, allowed: &[String]) -> bool {
    let Some(origin) = origin_of(url) else {
        return false;
    };
    allowed
        .iter()
        .any(|a| origin_of(a).as_deref() == Some(origin.as_str()))
}

impl Engine {
    pub fn new(
        settings: Arc<Settings>,
        store: Store,
        callback_secret: Vec<u8>,
    ) -> Result<Arc<Engine>, String> {
        let deployer = DeployerCommand::from_setting(
            settings.deployer.as_deref(),
            settings.deployer_user.as_deref(),
        )?;
        let (default_source, has_self_pin) = match &settings.default_source {
            Some(s) => (s.clone(), true),
            None => (builtin_source(), false),
        };
        Ok(Arc::new(Engine {
            eval_slots: Arc::new(Semaphore::new(settings.eval_slots)),
            settings,
            store,
            deployer,
            default_source,
            has_self_pin,
            described: Mutex::new(HashMap::new()),
            sched: Mutex::new(Sched::default()),
            wake: Notify::new(),
            callbacks_wake: Notify::new(),
            cancels: Mutex::new(HashMap::new()),
            ready: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            metrics: Metrics::default(),
            callback_secret,
            hub: Arc::new(crate::events::Hub::default()),
            stop: watch::channel(false).0,
        }))
    }

    /// Tells long-lived tasks (event streams) that berth is stopping.
    pub fn begin_shutdown(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.stop.send_replace(true);
    }

    pub fn stop_signal(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    pub fn eval_slots_in_use(&self) -> usize {
        self.settings.eval_slots - self.eval_slots.available_permits()
    }

    pub fn running_builds(&self) -> usize {
        lock(&self.sched).running.len()
    }

    /// Wakes the queue: something was queued or a slot came free.
    pub fn wake_queue(&self) {
        self.wake.notify_one();
    }

    /// Resolves the source of a submit or preview (api.md "Source resolution").
    fn resolve_source(
        &self,
        input: &SubmitInput,
        existing: Option<&DeploymentRecord>,
    ) -> Result<Source, ApiError> {
        if let Some(source) = &input.source {
            let policy = input
                .update_policy
                .as_ref()
                .or(existing.map(|d| &d.update_policy));
            if policy.is_some_and(|p| *p != UpdatePolicy::Manual) {
                return Err(ApiError::conflict(
                    "policy_not_manual",
                    "an explicit source needs the manual update policy",
                ));
            }
            if !Source::digest_is_valid(&source.digest) {
                return Err(ApiError::bad_request(
                    "the source digest must be sha256: and 64 lower-case hex digits",
                )
                .field("/source/digest", "format"));
            }
            let registered = self.store.read()?.source(&source.digest)?;
            return match registered {
                Some(r) if r == *source => Ok(r),
                Some(_) => Err(ApiError::conflict(
                    "source_immutable",
                    "this digest is already registered with another url or rev",
                )),
                None if *source == self.default_source => Ok(source.clone()),
                None if origin_allowed(&source.url, &self.settings.source_origin) => {
                    Ok(source.clone())
                }
                None => Err(ApiError::bad_request(
                    "the source url's origin is not allowed (see --source-origin)",
                )
                .field("/source/url", "source_origin_not_allowed")),
            };
        }
        if input.keep_deployed_revision {
            if let Some(deployed) = existing.and_then(|d| d.deployed.as_ref()) {
                return Ok(deployed.snapshot.source.clone());
            }
        }
        Ok(self.default_source.clone())
    }

    /// Schema, method and eval checks shared by submit and preview.
    async fn validate(
        &self,
        id: &str,
        input: &SubmitInput,
        existing: Option<&DeploymentRecord>,
        suspended: bool,
        eval_required: bool,
    ) -> Result<Validated, ApiError> {
        let shaped = crate::derive::shape(&input.configuration).map_err(|e| {
            ApiError::new(Code::InvalidConfiguration, e.message)
                .field(format!("/configuration{}", e.pointer), e.rule)
        })?;
        if contains_nul(&input.configuration) {
            return Err(ApiError::new(
                Code::InvalidConfiguration,
                "the configuration contains the character U+0000",
            )
            .field("/configuration", "nul_character"));
        }
        let domain = shaped.domain.map(str::to_string);
        let source = self.resolve_source(input, existing)?;
        let described = self.describe(&source).await?;
        let method = described.method_of(&shaped);
        if !described.methods.contains(&method) {
            let pointer = match shaped.method {
                Some(m) if input.configuration.get("deployment").is_some() => {
                    format!(
                        "/configuration/deployment/{}",
                        crate::derive::pointer::escape(m)
                    )
                }
                _ => "/configuration/method".to_string(),
            };
            return Err(ApiError::new(
                Code::InvalidConfiguration,
                "the configuration names a method the source does not give",
            )
            .field(pointer, "method"));
        }
        let fields = described.schema_errors(&input.configuration);
        if !fields.is_empty() {
            let mut e = ApiError::new(
                Code::InvalidConfiguration,
                "the configuration does not match the source's schema",
            );
            e.fields = fields;
            return Err(e);
        }
        let request = json!({
            "deployment": id,
            "method": method,
            "configuration": input.configuration,
            "source": source,
            "suspended": suspended,
        });
        let nodes = match self.eval(request).await? {
            Some(EvalVerdict::Nodes(v)) => Some(v),
            Some(EvalVerdict::Refused(message)) => {
                return Err(ApiError::new(
                    Code::InvalidConfiguration,
                    "the deployer's eval refused the configuration",
                )
                .deployer_message(&message))
            }
            None if eval_required => {
                return Err(
                    ApiError::new(Code::EvalUnavailable, "every eval slot is busy")
                        .reason("eval_slots_busy")
                        .retry_after(1),
                )
            }
            None => None,
        };
        Ok(Validated {
            source,
            method,
            domain,
            nodes,
        })
    }

    /// `POST /v1/deployments/{id}/preview`: the eval's nodes; stores nothing.
    pub async fn preview(&self, id: &str, input: SubmitInput) -> Result<Reply, ApiError> {
        let existing = self.store.read()?.deployment(id)?;
        let suspended = existing.as_ref().is_some_and(|d| d.suspended);
        let v = self
            .validate(id, &input, existing.as_ref(), suspended, true)
            .await?;
        let nodes = v
            .nodes
            .and_then(|n| n.get("nodes").cloned())
            .unwrap_or(Value::Array(vec![]));
        Ok(Reply::json(200, &json!({"nodes": nodes})))
    }

    /// `POST /v1/deployments/{id}/submit`: validate, then store the deployment
    /// and a queued deploy build in one transaction.
    pub async fn submit(
        self: &Arc<Self>,
        id: &str,
        input: SubmitInput,
        idem: Option<IdemWrite>,
    ) -> Result<Reply, ApiError> {
        let existing = self.store.read()?.deployment(id)?;
        if existing.as_ref().is_some_and(|d| d.suspended) {
            return Err(ApiError::conflict(
                "suspended",
                "the deployment is suspended; resume it first",
            ));
        }
        let v = self
            .validate(id, &input, existing.as_ref(), false, false)
            .await?;
        let id = id.to_string();
        let max_queued = self.settings.max_queued_builds;
        let SubmitInput {
            configuration_text,
            mode,
            update_policy,
            ..
        } = input;
        let hub = self.hub.clone();
        let reply = self
            .store
            .write(move |tx| {
                let now = now_millis();
                let existing = tx.deployment(&id)?;
                if let Some(d) = &existing {
                    if d.suspended {
                        return Ok(Err(ApiError::conflict("suspended", "the deployment is suspended; resume it first")));
                    }
                    if mode == Mode::Replace && d.running.is_some() {
                        return Ok(Err(ApiError::new(Code::QueueFull, "a build of this deployment is running; use mode \"enqueue\" to queue behind it")));
                    }
                    if let Err(e) = check_queue_room(d, max_queued) {
                        return Ok(Err(e));
                    }
                }
                if let Some(r) = tx.source(&v.source.digest)? {
                    if r != v.source {
                        return Ok(Err(ApiError::conflict("source_immutable", "this digest is already registered with another url or rev")));
                    }
                }
                let snapshot = Snapshot { configuration: configuration_text, source: v.source.clone() };
                let mut d = existing.unwrap_or_else(|| DeploymentRecord {
                    id: id.clone(),
                    revision: 0,
                    suspended: false,
                    method: v.method.clone(),
                    domain: None,
                    snapshot: snapshot.clone(),
                    update_policy: UpdatePolicy::Manual,
                    deployed: None,
                    last_build: None,
                    last_finished: None,
                    pending_deploys: 0,
                    pending_destroys: 0,
                    running: None,
                    event_seq: 0,
                    created_at: now,
                    updated_at: now,
                });
                let build = BuildRecord {
                    id: new_build_id(),
                    deployment: id.clone(),
                    kind: BuildKind::Deploy,
                    trigger: Trigger::Submit,
                    status: BuildStatus::Queued,
                    suspended: false,
                    method: v.method.clone(),
                    created_at: now,
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
                };
                d.snapshot = snapshot;
                d.method = v.method;
                d.domain = v.domain;
                if let Some(p) = update_policy {
                    d.update_policy = p;
                }
                d.pending_deploys += 1;
                d.last_build = Some(build.id);
                d.revision += 1;
                d.updated_at = now;
                let mut build = build;
                events::build_status(tx, &hub, &mut build, now)?;
                events::deployment_changed(tx, &hub, &mut d, Some(&build), now)?;
                tx.put_source(&v.source)?;
                tx.put_build(&build)?;
                tx.put_build_snapshots(build.id, &BuildSnapshots { snapshot: d.snapshot.clone(), previous: None })?;
                tx.put_deployment(&d)?;
                let reply = Reply::json(202, &json!({"build_id": format_build_id(build.id), "deployment": d.summary(Some(&build))}));
                record(tx, idem.as_ref(), &reply)?;
                Ok(Ok(reply))
            })
            .await??;
        self.wake_queue();
        Ok(reply)
    }

    /// `DELETE /v1/deployments/{id}`: queue a destroy behind whatever is queued.
    pub async fn delete(
        self: &Arc<Self>,
        id: &str,
        callback: Option<String>,
        idem: Option<IdemWrite>,
    ) -> Result<Reply, ApiError> {
        let id = id.to_string();
        let max_queued = self.settings.max_queued_builds;
        let hub = self.hub.clone();
        let reply = self
            .store
            .write(move |tx| {
                let Some(mut d) = tx.deployment(&id)? else {
                    return Ok(Err(ApiError::not_found("deployment")));
                };
                if let Err(e) = check_queue_room(&d, max_queued) {
                    return Ok(Err(e));
                }
                let now = now_millis();
                let (snapshot, method) = match &d.deployed {
                    Some(dep) => (dep.snapshot.clone(), dep.method.clone()),
                    None => (d.snapshot.clone(), d.method.clone()),
                };
                let build = BuildRecord {
                    id: new_build_id(),
                    deployment: id.clone(),
                    kind: BuildKind::Destroy,
                    trigger: Trigger::Delete,
                    status: BuildStatus::Queued,
                    suspended: d.suspended,
                    method,
                    created_at: now,
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
                };
                d.pending_destroys += 1;
                d.last_build = Some(build.id);
                d.revision += 1;
                d.updated_at = now;
                let mut build = build;
                events::build_status(tx, &hub, &mut build, now)?;
                events::deployment_changed(tx, &hub, &mut d, Some(&build), now)?;
                tx.put_build(&build)?;
                tx.put_build_snapshots(
                    build.id,
                    &BuildSnapshots {
                        snapshot,
                        previous: None,
                    },
                )?;
                tx.put_deployment(&d)?;
                if let Some(url) = callback {
                    let pending = PendingCallback {
                        url,
                        deployment: id.clone(),
                        armed: false,
                        attempts: 0,
                        next_at: now,
                        first_at: now,
                    };
                    tx.put_callback(build.id, &pending)?;
                }
                let reply = Reply::json(
                    202,
                    &json!({"status": "queued", "build_id": format_build_id(build.id)}),
                );
                record(tx, idem.as_ref(), &reply)?;
                Ok(Ok(reply))
            })
            .await??;
        self.wake_queue();
        Ok(reply)
    }

    /// `POST /v1/builds/{build}/cancel`: a queued build ends at once, a running
    /// one is stopped by its runner (SIGTERM, grace, SIGKILL).
    pub async fn cancel(
        self: &Arc<Self>,
        build_id: BuildId,
        idem: Option<IdemWrite>,
    ) -> Result<Reply, ApiError> {
        let hub = self.hub.clone();
        let (reply, was_running) = self
            .store
            .write(move |tx| {
                let Some(mut b) = tx.build(build_id)? else {
                    return Ok(Err(ApiError::not_found("build")));
                };
                match b.status {
                    s if s.is_finished() => {
                        return Ok(Err(ApiError::conflict(
                            "build_finished",
                            "the build has already finished",
                        )));
                    }
                    BuildStatus::Running => {
                        let snaps = build_snapshots(tx, build_id)?;
                        let reply = Reply::json(202, &b.view(&snaps));
                        record(tx, idem.as_ref(), &reply)?;
                        return Ok(Ok((reply, true)));
                    }
                    _ => {}
                }
                let Some(mut d) = tx.deployment(&b.deployment)? else {
                    return Err(crate::store::StoreError::corrupt(
                        "a build without its deployment",
                    ));
                };
                let now = now_millis();
                b.status = BuildStatus::Cancelled;
                b.finished_at = Some(now);
                b.failure = Some(Failure {
                    reason: "cancelled".into(),
                    detail: "cancelled while queued".into(),
                });
                release_pending(&mut d, b.kind);
                d.revision += 1;
                d.updated_at = now;
                events::build_status(tx, &hub, &mut b, now)?;
                events::deployment_changed(tx, &hub, &mut d, Some(&b), now)?;
                tx.put_build(&b)?;
                tx.put_deployment(&d)?;
                if b.kind == BuildKind::Destroy {
                    tx.remove_callback(b.id)?;
                }
                let snaps = build_snapshots(tx, build_id)?;
                let reply = Reply::json(202, &b.view(&snaps));
                record(tx, idem.as_ref(), &reply)?;
                Ok(Ok((reply, false)))
            })
            .await??;
        if was_running {
            if let Some(cancel) = lock(&self.cancels).get(&build_id) {
                let _ = cancel.send(true);
            }
        }
        Ok(reply)
    }
}

/// A build's snapshots; every stored build has them.
pub(crate) fn build_snapshots(tx: &Tx, id: BuildId) -> crate::store::StoreResult<BuildSnapshots> {
    tx.build_snapshots(id)?
        .ok_or_else(|| crate::store::StoreError::corrupt("a build without its snapshots"))
}

fn check_queue_room(d: &DeploymentRecord, max_queued: u32) -> Result<(), ApiError> {
    let queued = d.pending_deploys + d.pending_destroys - u32::from(d.running.is_some());
    if queued >= max_queued {
        return Err(ApiError::new(
            Code::QueueFull,
            "this deployment has as many queued builds as --max-queued-builds allows",
        )
        .reason("queue_limit"));
    }
    Ok(())
}

/// One queued or running build of `kind` is no longer pending.
fn release_pending(d: &mut DeploymentRecord, kind: BuildKind) {
    let counter = match kind {
        BuildKind::Deploy => &mut d.pending_deploys,
        BuildKind::Destroy => &mut d.pending_destroys,
    };
    debug_assert!(*counter > 0, "pending counter underflow");
    *counter = counter.saturating_sub(1);
}

/// Stores the response of a mutation with the mutation (same transaction).
fn record(tx: &Tx, idem: Option<&IdemWrite>, reply: &Reply) -> crate::store::StoreResult<()> {
    match idem {
        Some(w) => w.store(tx, reply),
        None => Ok(()),
    }
}
