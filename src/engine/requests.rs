//! The changes a caller asks for: preview, submit, delete, cancel.
//!
//! Each validates what it can outside any transaction (shape, source,
//! schema, eval), then runs one store write job that checks the lifecycle
//! rules against the current records and, only if they hold, makes the
//! change through `transition` and stores the caller's idempotency record
//! (`Recorder`) in the same transaction. The job's body is a plain function
//! of the transaction (`submit_tx`, ...), so tests drive the very same code
//! against a real store.
//!
//! How a submit flows here (the HTTP half is in `api`'s module doc):
//!
//! 1. `Engine::submit` validates outside any transaction: `derive::shape`,
//!    U+0000, `resolve_source`, `describe` of the source (memory, then the
//!    `describe_cache` table, then the deployer), method, JSON Schema, then
//!    `eval` if an eval slot is free. A failed check is a `Refusal`.
//! 2. `Store::write(submit_tx)` queues the write job for the writer thread.
//!    `submit_tx` re-checks the rules against the current records
//!    (suspended, `queue_full` while running, the queue limit, source
//!    immutability), stores the source and the new configuration, and calls
//!    `transition::Change::enqueue`, which counts the build as pending, writes
//!    the build's `status` event and the deployment's `build` and
//!    `deployment` events, bumps `revision`, and stores the build, its
//!    snapshot and the deployment. `Record::store` appends the audit event
//!    (`Change::audit` -> `Tx::append_audit`: the sealed row, its index
//!    entries, the stored Merkle subtrees it completes) and the idempotency record
//!    with the same answer. Each event writer registers a `Tx::after_commit`
//!    hook. The writer folds every job queued meanwhile into the same
//!    transaction and commits once.
//! 3. After the commit the writer thread runs the hooks in commit order
//!    (`Hub::publish`, which wakes readers and the fan-out); only then does the
//!    handler answer 202 with the bytes the recorder stored.
//! 4. `Engine::wake_queue` makes the queue (`queue.rs`) start the oldest
//!    build of a deployment with nothing running while a slot is free;
//!    `build.rs` runs it.

use crate::locks::Held;
use std::sync::Arc;

use serde_json::{json, Value};

use super::audit::{Audited, Record};
use super::deployer::EvalVerdict;
use super::outcome::End;
use super::refusal::{
    Conflict, EvalUnavailable, FieldError, InvalidSource, Missing, QueueFull, Refusal,
};
use super::transition::{Change, NewBuild};
use super::{origin_allowed, Engine};
use crate::events::Hub;
use crate::model::*;
use crate::store::Lookup;
use crate::store::{PendingCallback, StoreError, StoreResult, Tx};

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
    /// `auto_rollback`; `None` keeps the stored value.
    pub auto_rollback: Option<bool>,
    /// `rollout`: the policy and its JSON text; `None` keeps the stored one.
    pub rollout: Option<(crate::rollout::Policy, String)>,
}

/// What a validated configuration resolved to.
pub(super) struct Validated {
    pub(super) source: Source,
    pub(super) method: String,
    pub(super) domain: Option<String>,
    nodes: Option<Value>,
}

/// A submit that was stored: its queued build and the deployment after it.
#[derive(Debug)]
pub struct Submitted {
    pub build: BuildRecord,
    /// The deployment's summary after the submit, as JSON: the text its
    /// `deployment` event carries, so the answer (rendered on the store's
    /// writer thread for the idempotency record, then again for the
    /// reply) copies it rather than encoding the summary twice more.
    pub deployment_json: String,
}

impl Audited for Submitted {
    fn audited_build(&self) -> Option<BuildId> {
        Some(self.build.id)
    }
}

/// A delete that was stored: the queued destroy.
#[derive(Debug)]
pub struct DestroyQueued {
    pub build_id: BuildId,
}

impl Audited for DestroyQueued {
    fn audited_build(&self) -> Option<BuildId> {
        Some(self.build_id)
    }
}

impl Audited for CancelTaken {
    fn audited_build(&self) -> Option<BuildId> {
        parse_build_id(&self.build.summary.id)
    }
}

/// A cancel that was taken: the build as it is now (still running when the
/// runner has yet to stop it).
#[derive(Debug)]
pub struct CancelTaken {
    pub build: BuildView,
    pub was_running: bool,
}

/// A preview's answer: the evaluated nodes, and what a deploy would change.
pub struct Preview {
    pub nodes: Vec<Value>,
    pub changes: Vec<NodeChange>,
}

/// lifecycle.md "What a submit would change": one node's plan.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NodeChange {
    pub node: String,
    pub change: ChangeKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    Added,
    Removed,
    Changed,
    Unchanged,
    /// Either side has no fingerprint.
    Unknown,
}

/// Pure: each node of the evaluated configuration (`planned`) or of the
/// deployed state, compared by fingerprint; evaluated nodes first, in
/// their order, then the removed ones in theirs.
pub fn changes(
    planned: &[(String, Option<String>)],
    deployed: &[(String, Option<String>)],
) -> Vec<NodeChange> {
    let mut out: Vec<NodeChange> = planned
        .iter()
        .map(|(node, print)| {
            let change = match deployed.iter().find(|(n, _)| n == node) {
                None => ChangeKind::Added,
                Some((_, old)) => match (print, old) {
                    (Some(new), Some(old)) if new == old => ChangeKind::Unchanged,
                    (Some(_), Some(_)) => ChangeKind::Changed,
                    (None, _) | (_, None) => ChangeKind::Unknown,
                },
            };
            NodeChange {
                node: node.clone(),
                change,
            }
        })
        .collect();
    for (node, _) in deployed {
        if !planned.iter().any(|(n, _)| n == node) {
            out.push(NodeChange {
                node: node.clone(),
                change: ChangeKind::Removed,
            });
        }
    }
    out
}

/// What a submit stores, after validation.
pub struct SubmitRecord {
    pub id: String,
    pub snapshot: Snapshot,
    pub method: String,
    pub domain: Option<String>,
    pub mode: Mode,
    pub update_policy: Option<UpdatePolicy>,
    pub auto_rollback: Option<bool>,
    pub max_queued: u32,
    /// The rollout policy's JSON text to store with the submit.
    pub rollout_policy: Option<String>,
}

fn contains_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(a) => a.iter().any(contains_nul),
        Value::Object(m) => m.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)),
        _ => false,
    }
}

impl Engine {
    /// Resolves the source of a submit or preview (api.md "Source resolution").
    fn resolve_source(
        &self,
        input: &SubmitInput,
        existing: Option<&DeploymentRecord>,
    ) -> Result<Source, Refusal> {
        if let Some(source) = &input.source {
            let policy = input
                .update_policy
                .as_ref()
                .or(existing.map(|d| &d.update_policy));
            if policy.is_some_and(|p| *p != UpdatePolicy::Manual) {
                return Err(Refusal::Conflict(Conflict::PolicyNotManual));
            }
            if !Source::digest_is_valid(&source.digest) {
                return Err(Refusal::InvalidSource(InvalidSource::DigestFormat));
            }
            let registered = self.store.read()?.source(&source.digest)?;
            return match registered {
                Some(r) if r == *source => Ok(r),
                Some(_) => Err(Refusal::Conflict(Conflict::SourceImmutable)),
                None if *source == self.default_source => Ok(source.clone()),
                None if origin_allowed(&source.url, &self.settings.source_origin) => {
                    Ok(source.clone())
                }
                None => Err(Refusal::InvalidSource(InvalidSource::OriginNotAllowed)),
            };
        }
        if input.keep_deployed_revision {
            if let Some(deployed) = existing.and_then(|d| d.deployed.as_ref()) {
                return Ok(deployed.snapshot.source.clone());
            }
        }
        Ok(self.default_source.clone())
    }

    /// Schema, method and eval checks shared by submit, preview and the
    /// automatic update.
    pub(super) async fn validate(
        &self,
        id: &str,
        input: &SubmitInput,
        existing: Option<&DeploymentRecord>,
        suspended: bool,
        eval_required: bool,
    ) -> Result<Validated, Refusal> {
        let shaped = crate::derive::shape(&input.configuration).map_err(|e| {
            Refusal::invalid_configuration(
                e.message,
                FieldError::new(format!("/configuration{}", e.pointer), e.rule),
            )
        })?;
        if contains_nul(&input.configuration) {
            return Err(Refusal::invalid_configuration(
                "the configuration contains the character U+0000",
                FieldError::new("/configuration", "nul_character"),
            ));
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
            return Err(Refusal::invalid_configuration(
                "the configuration names a method the source does not give",
                FieldError::new(pointer, "method"),
            ));
        }
        let fields = described.schema_errors(&input.configuration);
        if !fields.is_empty() {
            return Err(Refusal::InvalidConfiguration {
                message: "the configuration does not match the source's schema".into(),
                fields,
                deployer_message: None,
            });
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
                return Err(Refusal::InvalidConfiguration {
                    message: "the deployer's eval refused the configuration".into(),
                    fields: vec![],
                    deployer_message: Some(message),
                })
            }
            None if eval_required => {
                return Err(Refusal::eval_unavailable(
                    EvalUnavailable::SlotsBusy,
                    "every eval slot is busy",
                ))
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

    /// Preview: the eval's nodes; stores nothing.
    pub async fn preview(&self, id: &str, input: SubmitInput) -> Result<Preview, Refusal> {
        let existing = self.store.read()?.deployment(id)?;
        let suspended = existing.as_ref().is_some_and(|d| d.suspended);
        let v = self
            .validate(id, &input, existing.as_ref(), suspended, true)
            .await?;
        let evaluated = v
            .nodes
            .and_then(|n| n.get("nodes").cloned())
            .unwrap_or(Value::Array(vec![]));
        let evaluated = evaluated.as_array().cloned().unwrap_or_default();
        let planned: Vec<(String, Option<String>)> = evaluated
            .iter()
            .map(|n| {
                let text = |k: &str| n.get(k).and_then(Value::as_str).map(str::to_string);
                (text("name").unwrap_or_default(), text("fingerprint"))
            })
            .collect();
        let deployed = existing
            .as_ref()
            .and_then(|d| d.deployed.as_ref())
            .map_or(&[][..], |x| x.nodes.as_slice());
        // The nodes as api.md shows them: name and published names.
        let nodes = evaluated
            .iter()
            .map(|n| serde_json::json!({"name": n.get("name"), "names": n.get("names")}))
            .collect();
        Ok(Preview {
            nodes,
            changes: changes(&planned, deployed),
        })
    }

    /// Submit: validate, then store the deployment and a queued deploy
    /// build in one transaction.
    pub async fn submit(
        self: &Arc<Self>,
        id: &str,
        input: SubmitInput,
        record: Record<Submitted>,
    ) -> Result<Submitted, Refusal> {
        let existing = self.store.read()?.deployment(id)?;
        if existing.as_ref().is_some_and(|d| d.suspended) {
            return Err(Refusal::Conflict(Conflict::Suspended));
        }
        let v = self
            .validate(id, &input, existing.as_ref(), false, false)
            .await?;
        if let Some((policy, _)) = &input.rollout {
            if !policy.is_default() && !self.describe(&v.source).await?.activates() {
                return Err(Refusal::Conflict(Conflict::RolloutUnsupported));
            }
        }
        let submit = SubmitRecord {
            id: id.to_string(),
            snapshot: Snapshot {
                configuration: input.configuration_text,
                source: v.source,
            },
            method: v.method,
            domain: v.domain,
            mode: input.mode,
            update_policy: input.update_policy,
            auto_rollback: input.auto_rollback,
            max_queued: self.settings.max_queued_builds,
            rollout_policy: input.rollout.map(|(_, text)| text),
        };
        let hub = self.hub.clone();
        let submitted = self
            .store
            .write(move |tx| submit_tx(tx, &hub, &submit, &record))
            .await??;
        self.wake_queue();
        Ok(submitted)
    }

    /// Delete: queue a destroy behind whatever is queued.
    pub async fn delete(
        self: &Arc<Self>,
        id: &str,
        callback: Option<String>,
        record: Record<DestroyQueued>,
    ) -> Result<DestroyQueued, Refusal> {
        let id = id.to_string();
        let hub = self.hub.clone();
        let queued = self
            .store
            .write(move |tx| delete_tx(tx, &hub, &id, callback.clone(), &record))
            .await??;
        self.wake_queue();
        Ok(queued)
    }

    /// Cancel: a queued build ends at once, a running one is stopped by its
    /// runner (SIGTERM, grace, SIGKILL).
    pub async fn cancel(
        self: &Arc<Self>,
        build_id: BuildId,
        record: Record<CancelTaken>,
    ) -> Result<CancelTaken, Refusal> {
        let hub = self.hub.clone();
        let taken = self
            .store
            .write(move |tx| cancel_tx(tx, &hub, build_id, &record))
            .await??;
        if taken.was_running {
            if let Some(cancel) = self.cancels.held().get(&build_id) {
                let _ = cancel.send(super::outcome::Halt::Cancel);
            }
            // A remote worker hears it through its open poll; a rollout's
            // runner for a remote worker at once.
            self.remote_rollouts
                .halt(build_id, super::outcome::Halt::Cancel);
            self.wake_queue();
        }
        Ok(taken)
    }
}

/// The submit's write job: checks the rules against the current records,
/// then stores the deployment and its queued build.
pub fn submit_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    s: &SubmitRecord,
    record: &Record<Submitted>,
) -> StoreResult<Result<Submitted, Refusal>> {
    if crate::failpoints::hit("submit.job", &s.id) {
        return Err(crate::store::StoreError::injected("submit.job"));
    }
    let change = Change::new(tx, hub);
    let existing = tx.deployment(&s.id)?;
    let registered = tx.source(&s.snapshot.source.digest)?;
    if let Some(refusal) =
        submit_refusal(tx, s, existing.as_ref(), registered.as_ref(), change.now())?
    {
        return Ok(Err(refusal));
    }
    let now = change.now();
    let mut d = existing.unwrap_or_else(|| DeploymentRecord {
        id: s.id.clone(),
        revision: 0,
        suspended: false,
        method: s.method.clone(),
        domain: None,
        snapshot: s.snapshot.clone(),
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
        auto_rollback: true,
    });
    // A source is immutable: written once, when first seen (a rewrite of
    // the same bytes would still cost the commit a B-tree page).
    if registered.is_none() {
        tx.put_source(&s.snapshot.source)?;
    }
    d.snapshot = s.snapshot.clone();
    d.method = s.method.clone();
    d.domain = s.domain.clone();
    if let Some(p) = s.update_policy.clone() {
        change.set_policy(&mut d, p)?;
    }
    if let Some(on) = s.auto_rollback {
        d.auto_rollback = on;
    }
    if let Some(text) = &s.rollout_policy {
        tx.put_rollout_policy(&s.id, Some(text))?;
    }
    let queued = change.enqueue_summarized(
        &mut d,
        NewBuild {
            kind: BuildKind::Deploy,
            trigger: Trigger::Submit,
            suspended: false,
            method: s.method.clone(),
            snapshot: s.snapshot.clone(),
            rollback_of: None,
        },
    )?;
    debug_assert_eq!(
        serde_json::to_string(&d.summary(Some(&queued.build))).ok(),
        Some(queued.deployment_json.clone()),
        "the deployment event's summary is not the deployment after the submit"
    );
    let submitted = Submitted {
        build: queued.build,
        deployment_json: queued.deployment_json,
    };
    record.store(&change, &submitted)?;
    Ok(Ok(submitted))
}

/// Why a submit may not be stored now, in the order of the checks: a
/// freeze, a suspended deployment, a running build it would replace, a
/// full queue, a digest registered with another url or rev.
fn submit_refusal(
    tx: &Tx,
    s: &SubmitRecord,
    existing: Option<&DeploymentRecord>,
    registered: Option<&Source>,
    now: Millis,
) -> StoreResult<Option<Refusal>> {
    if let Some((scope, f)) = super::freeze::holding(tx, &s.id, now)? {
        return Ok(Some(super::freeze::refusal(&scope, &f)));
    }
    if let Some(d) = existing {
        if d.suspended {
            return Ok(Some(Refusal::Conflict(Conflict::Suspended)));
        }
        if s.mode == Mode::Replace && d.running.is_some() {
            return Ok(Some(Refusal::QueueFull(QueueFull::BuildRunning)));
        }
        if let Err(refusal) = check_queue_room(d, s.max_queued) {
            return Ok(Some(refusal));
        }
    }
    if registered.is_some_and(|registered| *registered != s.snapshot.source) {
        return Ok(Some(Refusal::Conflict(Conflict::SourceImmutable)));
    }
    Ok(None)
}

/// The delete's write job: a destroy of what is deployed (or of the last
/// submit when nothing is), with its callback stored unarmed.
pub fn delete_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    id: &str,
    callback: Option<String>,
    record: &Record<DestroyQueued>,
) -> StoreResult<Result<DestroyQueued, Refusal>> {
    let change = Change::new(tx, hub);
    let Some(mut d) = tx.deployment(id)? else {
        return Ok(Err(Refusal::NotFound(Missing::Deployment)));
    };
    // A destroy always queues (FR-009): `--max-queued-builds` bounds
    // submits only, so a deployment can always be deleted.
    let (snapshot, method) = match &d.deployed {
        Some(dep) => (dep.snapshot.clone(), dep.method.clone()),
        None => (d.snapshot.clone(), d.method.clone()),
    };
    let suspended = d.suspended;
    let build = change.enqueue(
        &mut d,
        NewBuild {
            kind: BuildKind::Destroy,
            trigger: Trigger::Delete,
            suspended,
            method,
            snapshot,
            rollback_of: None,
        },
    )?;
    if let Some(url) = callback {
        let now = change.now();
        let pending = PendingCallback {
            url,
            deployment: id.to_string(),
            armed: false,
            attempts: 0,
            next_at: now,
            first_at: now,
        };
        tx.put_callback(build.id, &pending)?;
    }
    let queued = DestroyQueued { build_id: build.id };
    record.store(&change, &queued)?;
    Ok(Ok(queued))
}

/// The cancel's write job: a queued build is cancelled here; a running one
/// is left to its runner (the caller signals it after the commit).
pub fn cancel_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    build_id: BuildId,
    record: &Record<CancelTaken>,
) -> StoreResult<Result<CancelTaken, Refusal>> {
    let change = Change::new(tx, hub);
    let Some(mut b) = tx.build(build_id)? else {
        return Ok(Err(Refusal::NotFound(Missing::Build)));
    };
    let was_running = match b.status {
        BuildStatus::Succeeded | BuildStatus::Failed | BuildStatus::Cancelled => {
            return Ok(Err(Refusal::Conflict(Conflict::BuildFinished)))
        }
        BuildStatus::Running => {
            // A remote worker learns it from its poll and its next renew or
            // progress answer, and stops the deployer (workers.md).
            if let Some(mut a) = tx.last_attempt(build_id)? {
                if a.state == AttemptState::Active && a.cancel_requested_at.is_none() {
                    a.cancel_requested_at = Some(change.now());
                    tx.put_attempt(&a)?;
                }
            }
            true
        }
        BuildStatus::Queued => {
            let mut d = tx
                .deployment(&b.deployment)?
                .ok_or_else(|| StoreError::corrupt("a build without its deployment"))?;
            change.finish(
                Some(&mut d),
                &mut b,
                End::cancelled("cancelled while queued"),
                &[],
            )?;
            false
        }
    };
    let snaps = tx
        .build_snapshots(build_id)?
        .ok_or_else(|| StoreError::corrupt("a build without its snapshots"))?;
    let taken = CancelTaken {
        build: b.view(&snaps).map_err(StoreError::damaged_snapshot)?,
        was_running,
    };
    record.store(&change, &taken)?;
    Ok(Ok(taken))
}

fn check_queue_room(d: &DeploymentRecord, max_queued: u32) -> Result<(), Refusal> {
    let queued = d.pending_deploys + d.pending_destroys - u32::from(d.running.is_some());
    if queued >= max_queued {
        return Err(Refusal::QueueFull(QueueFull::QueueLimit));
    }
    Ok(())
}

#[cfg(test)]
mod change_tests {
    use super::*;

    #[test]
    fn each_node_is_added_removed_changed_unchanged_or_unknown() {
        let s = |n: &str, p: Option<&str>| (n.to_string(), p.map(str::to_string));
        let planned = [
            s("web", Some("a")),
            s("db", Some("b")),
            s("new", Some("c")),
            s("blind", None),
        ];
        let deployed = [
            s("web", Some("a")),
            s("db", Some("x")),
            s("old", Some("y")),
            s("blind", Some("z")),
        ];
        let got: Vec<(String, ChangeKind)> = changes(&planned, &deployed)
            .into_iter()
            .map(|c| (c.node, c.change))
            .collect();
        use ChangeKind::*;
        assert_eq!(
            got,
            [
                ("web".to_string(), Unchanged),
                ("db".to_string(), Changed),
                ("new".to_string(), Added),
                ("blind".to_string(), Unknown),
                ("old".to_string(), Removed),
            ]
        );
        assert!(changes(&[], &[]).is_empty());
    }
}
