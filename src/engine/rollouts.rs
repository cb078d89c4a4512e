//! Rollouts in waves, run by berth (rollouts.md "The procedure"): for a
//! deploy whose source lists `activate`, the changed nodes are activated a
//! wave at a time, each wave gated by `check`, with the policy's pauses
//! and waits between waves, then confirmed; pause, resume and abort come
//! as actions.
//!
//! Why it exists apart from `health`: the health step is one wave with no
//! holds; a rollout may run for hours, and people steer it while it runs.
//! What may happen next is `crate::rollout`'s pure machine; this module
//! runs the calls it asks for, stores each step in one transaction (the
//! record; on a visible change the deployment's revision and its
//! `rollout` and `deployment` events, so `If-Match` guards every step), and
//! emits the build channel's `rollout` event as the runner sees each
//! change. Actions change the record in their own transactions and ring
//! `rollout_wake`; the runner reads the record again before each step.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::watch;

use super::audit::{Audited, Record};
use super::health::{self, HealthEnd, HealthIo, PipeHealth};
use super::log_pipe::LogPipe;
use super::outcome::{Halt, NodeOutcome};
use super::refusal::{ActionReason, Conflict, Missing, Refusal};
use super::runner::Ended;
use super::transition::Change;
use super::Engine;
use crate::events::BuildEvent;
use crate::model::*;
use crate::rollout::{self as plan, Event, Next, Policy, Staging};
use crate::store::{Lookup, StoreError, StoreResult};

/// How often a held rollout looks again without a wake (a wait's end).
const HOLD_STEP: Duration = Duration::from_secs(1);
/// A node's reason from `activate` is cut to this many characters.
const MAX_ACTIVATE_REASON_CHARS: usize = 500;

/// The summary of a rollout (rollouts.md "States"): the deployment read's
/// `rollout` and the data of `rollout` events.
pub fn summary(r: &RolloutRecord) -> Value {
    let nodes_total: usize = r.rollout.waves.iter().map(|w| w.nodes.len()).sum();
    json!({
        "deployment": r.deployment,
        "build_id": format_build_id(r.build),
        "state": r.rollout.state,
        "wave": r.rollout.wave,
        "wave_count": r.rollout.waves.len(),
        "nodes_total": nodes_total,
        "nodes_activated": r.rollout.activated_nodes().len(),
        "unhealthy_count": r.unhealthy.len(),
        "paused": r.pause.as_ref().map(note_view),
        "wait_until": r.rollout.wait_until.map(format_time),
        "abort": r.abort.as_ref().map(note_view),
        "result": r.rollout.result,
    })
}

/// The build read's `rollout`.
pub fn view(r: &RolloutRecord) -> Value {
    let policy: Value = serde_json::from_str(&r.policy).unwrap_or(Value::Null);
    json!({
        "state": r.rollout.state,
        "wave": r.rollout.wave,
        "wave_count": r.rollout.waves.len(),
        "policy": policy,
        "wait_until": r.rollout.wait_until.map(format_time),
        "waves": r.rollout.waves.iter().map(|w| json!({
            "nodes": w.nodes,
            "state": w.state,
            "activated": w.activated,
            "activated_at": w.activated_at.map(format_time),
            "passed_at": w.passed_at.map(format_time),
        })).collect::<Vec<_>>(),
        "unhealthy": r.unhealthy.iter().map(|(node, reason, since)| json!({
            "node": node, "reason": reason, "since": format_time(*since),
        })).collect::<Vec<_>>(),
        "paused": r.pause.as_ref().map(note_view),
        "abort": r.abort.as_ref().map(note_view),
        "result": r.rollout.result,
        "started_at": format_time(r.started_at),
        "updated_at": format_time(r.updated_at),
    })
}

fn note_view(n: &RolloutNote) -> Value {
    json!({
        "by": n.by,
        "at": format_time(n.at),
        "actor": n.actor.as_deref().and_then(|a| serde_json::from_str::<Value>(a).ok()),
        "reason": n.reason,
    })
}

/// The webhook a step of a rollout sends (notifications.md): a pause in
/// effect, a resume, an abort begun, the end.
fn webhook(before: &RolloutRecord, after: &RolloutRecord) -> Option<&'static str> {
    use crate::model::RolloutState;
    let (a, b) = (&before.rollout, &after.rollout);
    if a.result.is_none() && b.result.is_some() {
        Some("rollout.finished")
    } else if a.abort.is_none() && b.abort.is_some() {
        Some("rollout.aborted")
    } else if a.state != RolloutState::Paused && b.state == RolloutState::Paused {
        Some("rollout.paused")
    } else if a.paused && !b.paused {
        Some("rollout.resumed")
    } else {
        None
    }
}

/// Whether a change of `before` to `after` is one people see (a new
/// revision and events): its state, wave, pause, abort or result.
fn visible(before: &RolloutRecord, after: &RolloutRecord) -> bool {
    let (a, b) = (&before.rollout, &after.rollout);
    a.state != b.state
        || a.wave != b.wave
        || a.paused != b.paused
        || a.abort != b.abort
        || a.result != b.result
}

/// The note an event leaves: who paused, who or what aborted.
pub struct Noted {
    pub event: Event,
    pub note: Option<RolloutNote>,
}

impl Noted {
    pub(super) fn bare(event: Event) -> Noted {
        Noted { event, note: None }
    }

    fn by(event: Event, by: &str, reason: impl Into<String>) -> Noted {
        Noted {
            event,
            note: Some(RolloutNote {
                by: by.into(),
                at: now_millis(),
                actor: None,
                reason: Some(reason.into()),
            }),
        }
    }
}

#[derive(Deserialize)]
struct ActivateResult {
    nodes: Vec<ActivateNode>,
}

#[derive(Deserialize)]
struct ActivateNode {
    name: String,
    activated: bool,
    #[serde(default)]
    reason: Option<String>,
}

/// Which of `check` and `confirm` a rollout's deployer lists: without
/// `check` a gate counts only the `activate` answers; without `confirm`
/// nothing is called after the last wave.
#[derive(Debug, Clone, Copy)]
pub struct Verbs {
    pub check: bool,
    pub confirm: bool,
}

/// How one `activate` call ended: each node's answer, or why the call
/// failed (its failure reason and words).
type Activation = Result<BTreeMap<String, (bool, Option<String>)>, (FailureReason, String)>;

/// A rollout action (rollouts.md "Pause, resume, abort").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolloutAction {
    Pause,
    Resume,
    Abort,
}

impl RolloutAction {
    pub fn from_name(name: &str) -> Option<RolloutAction> {
        match name {
            "rollout_pause" => Some(RolloutAction::Pause),
            "rollout_resume" => Some(RolloutAction::Resume),
            "rollout_abort" => Some(RolloutAction::Abort),
            _ => None,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            RolloutAction::Pause => "rollout_pause",
            RolloutAction::Resume => "rollout_resume",
            RolloutAction::Abort => "rollout_abort",
        }
    }

    /// The first reason that disables it for a deployment whose unfinished
    /// rollout is `r` (none: `no_rollout`), `frozen` while a freeze holds.
    pub fn disabled(self, r: Option<&Rollout>, frozen: bool) -> Option<ActionReason> {
        use crate::model::RolloutState;
        let Some(r) = r.filter(|r| r.state != RolloutState::Finished) else {
            return Some(ActionReason::NoRollout);
        };
        let ending = matches!(r.state, RolloutState::Confirming | RolloutState::Aborting);
        match self {
            RolloutAction::Pause if r.paused => Some(ActionReason::AlreadyPaused),
            RolloutAction::Pause | RolloutAction::Abort if ending => {
                Some(ActionReason::RolloutEnding)
            }
            RolloutAction::Resume if !r.paused => Some(ActionReason::NotPaused),
            RolloutAction::Resume if frozen => Some(ActionReason::Frozen),
            RolloutAction::Pause | RolloutAction::Resume | RolloutAction::Abort => None,
        }
    }

    fn event(self) -> Event {
        match self {
            RolloutAction::Pause => Event::PauseAsked,
            RolloutAction::Resume => Event::Resumed,
            RolloutAction::Abort => Event::AbortAsked,
        }
    }
}

/// A rollout action taken: the rollout's build and its summary after it.
#[derive(Debug)]
pub struct RolloutActed {
    pub build_id: BuildId,
    pub summary: Value,
}

impl Audited for RolloutActed {
    fn audited_build(&self) -> Option<BuildId> {
        Some(self.build_id)
    }
}

impl Engine {
    /// `POST /v1/deployments/{id}/actions/rollout_*`: one step of the
    /// deployment's unfinished rollout, under `If-Match`, in one
    /// transaction with its audit event; the runner is rung.
    pub async fn rollout_act(
        self: &Arc<Self>,
        id: &str,
        action: RolloutAction,
        if_match: Option<u64>,
        reason: Option<String>,
        actor: Option<String>,
        record: Record<RolloutActed>,
    ) -> Result<RolloutActed, Refusal> {
        let (hub, id) = (self.hub.clone(), id.to_string());
        let record = Arc::new(record);
        let acted = self
            .store
            .write(move |tx| {
                let Some(mut d) = tx.deployment(&id)? else {
                    return Ok(Err(Refusal::NotFound(Missing::Deployment)));
                };
                if if_match.is_some_and(|r| r != d.revision) {
                    return Ok(Err(Refusal::PreconditionFailed));
                }
                let found = match d.running {
                    Some(b) => tx.rollout(b)?,
                    None => None,
                };
                let held = super::freeze::holding(tx, &id, now_millis())?;
                let disabled = action.disabled(found.as_ref().map(|r| &r.rollout), held.is_some());
                if let Some(reason) = disabled {
                    return Ok(Err(super::freeze::action_refusal(reason, &held)));
                }
                let Some(before) = found else {
                    return Ok(Err(Refusal::ActionRefused(ActionReason::NoRollout)));
                };
                let now = now_millis();
                let Ok(rollout) = before.rollout.apply(&action.event(), now, false) else {
                    return Ok(Err(Refusal::ActionRefused(ActionReason::RolloutEnding)));
                };
                let mut after = before.clone();
                after.rollout = rollout;
                after.updated_at = now;
                let note = RolloutNote {
                    by: "action".into(),
                    at: now,
                    actor: actor.clone(),
                    reason: reason.clone(),
                };
                take_note(
                    &mut after,
                    &Noted {
                        event: action.event(),
                        note: Some(note),
                    },
                );
                tx.put_rollout(&after)?;
                let change = Change::new(tx, &hub);
                let hook = webhook(&before, &after);
                change.rollout_changed(&mut d, summary(&after).to_string(), hook)?;
                let acted = RolloutActed {
                    build_id: after.build,
                    summary: summary(&after),
                };
                record.store(&change, &acted)?;
                Ok(Ok(acted))
            })
            .await??;
        self.wake_rollouts();
        Ok(acted)
    }

    /// `PUT /v1/deployments/{id}/rollout-policy` (and a submit's
    /// `rollout`): stores the policy as given; a policy other than `{}`
    /// needs a source that lists `activate`.
    pub async fn set_rollout_policy(
        self: &Arc<Self>,
        id: &str,
        text: String,
        policy: Policy,
        if_match: Option<u64>,
        record: Record<super::updates::PolicySet>,
    ) -> Result<super::updates::PolicySet, Refusal> {
        let d = self
            .store
            .read()?
            .deployment(id)?
            .ok_or(Refusal::NotFound(Missing::Deployment))?;
        if !policy.is_default() && !self.describe(&d.snapshot.source).await?.activates() {
            return Err(Refusal::Conflict(Conflict::RolloutUnsupported));
        }
        let (hub, id) = (self.hub.clone(), id.to_string());
        self.store
            .write(move |tx| {
                let Some(mut d) = tx.deployment(&id)? else {
                    return Ok(Err(Refusal::NotFound(Missing::Deployment)));
                };
                if if_match.is_some_and(|r| r != d.revision) {
                    return Ok(Err(Refusal::PreconditionFailed));
                }
                let change = Change::new(tx, &hub);
                if tx.rollout_policy(&id)?.as_deref() != Some(text.as_str()) {
                    tx.put_rollout_policy(&id, Some(&text))?;
                    change.update(&mut d)?;
                }
                change.audit(&record.audit)?;
                let set = super::updates::PolicySet {
                    last_build: d.last_build.map(|b| tx.build(b)).transpose()?.flatten(),
                    last_try: tx.update_try(&id)?,
                    audit: super::audit::of_deployment(tx, &id)?,
                    rollback_target: tx.rollback_target(&d)?,
                    rollout: d.running.map(|b| tx.rollout(b)).transpose()?.flatten(),
                    frozen: super::freeze::holding(tx, &id, now_millis())?.is_some(),
                    deployment: d,
                };
                if let Some(reply) = &record.reply {
                    reply(tx, &set)?;
                }
                Ok(Ok(set))
            })
            .await?
    }

    /// A deployment's rollout policy (`{}` when none is stored).
    pub fn rollout_policy(&self, deployment: &str) -> StoreResult<(Policy, String)> {
        stored_policy(&self.store.read()?, deployment)
    }

    /// Applies `noted` to a build's rollout in one transaction; the record
    /// after it, or `None` when the event did not fit (nothing changed).
    pub async fn rollout_apply(
        &self,
        build: BuildId,
        noted: Noted,
    ) -> StoreResult<Option<RolloutRecord>> {
        let hub = self.hub.clone();
        let noted = Arc::new(noted);
        self.store
            .write(move |tx| {
                let Some(before) = tx.rollout(build)? else {
                    return Ok(None);
                };
                let now = now_millis();
                let frozen = super::freeze::holding(tx, &before.deployment, now)?.is_some();
                let Ok(rollout) = before.rollout.apply(&noted.event, now, frozen) else {
                    return Ok(None);
                };
                let mut after = before.clone();
                after.rollout = rollout;
                after.updated_at = now;
                take_note(&mut after, &noted);
                tx.put_rollout(&after)?;
                if visible(&before, &after) {
                    if let Some(mut d) = tx.deployment(&after.deployment)? {
                        let change = Change::new(tx, &hub);
                        let hook = webhook(&before, &after);
                        change.rollout_changed(&mut d, summary(&after).to_string(), hook)?;
                    }
                }
                Ok(Some(after))
            })
            .await
    }

    /// Stores what the latest checks said of the nodes they named: each
    /// unhealthy node with its reason, since when (kept while it stays
    /// unhealthy); a node that answered healthy leaves the list. Health
    /// answers raise no revision.
    async fn note_health(&self, build: BuildId, answers: Vec<(String, Option<String>)>) {
        let written = self
            .store
            .write(move |tx| {
                let Some(mut r) = tx.rollout(build)? else {
                    return Ok(());
                };
                let now = now_millis();
                let before = r.unhealthy.clone();
                for (node, reason) in &answers {
                    let known = r.unhealthy.iter().position(|(n, _, _)| n == node);
                    match (reason, known) {
                        (None, Some(i)) => {
                            r.unhealthy.remove(i);
                        }
                        (None, None) => {}
                        (Some(why), Some(i)) => r.unhealthy[i].1 = why.clone(),
                        (Some(why), None) => r.unhealthy.push((node.clone(), why.clone(), now)),
                    }
                }
                if r.unhealthy != before {
                    tx.put_rollout(&r)?;
                }
                Ok(())
            })
            .await;
        if let Err(e) = written {
            tracing::error!(error = %e, build = %format_build_id(build), "cannot store a rollout's health answers; the next check tries again");
        }
    }

    /// Rings every rollout runner (an action changed a rollout).
    pub fn wake_rollouts(&self) {
        self.rollout_wake.notify_waiters();
    }

    /// The rollout of a deploy that exited 0 with a valid result (`nodes`),
    /// whose source lists `activate`: planned, stored with that result,
    /// run to its end. How it ended, as the build's verdict reads a health
    /// step.
    pub(super) async fn rollout_step(
        self: &Arc<Self>,
        build: &BuildRecord,
        request: &Value,
        nodes: &[NodeOutcome],
        verbs: Verbs,
        pipe: &mut LogPipe,
        cancel: &mut watch::Receiver<Halt>,
    ) -> HealthEnd {
        let changed: Vec<String> = nodes
            .iter()
            .filter(|n| n.changed)
            .map(|n| n.name.clone())
            .collect();
        if changed.len() > plan::MAX_ROLLOUT_NODES {
            return HealthEnd::Aborted(
                FailureReason::DeployerProtocol,
                format!(
                    "the deploy changed {} nodes; a rollout takes at most {}",
                    changed.len(),
                    plan::MAX_ROLLOUT_NODES
                ),
            );
        }
        match self.start_rollout(build, changed, nodes.to_vec()).await {
            Ok(Ok(())) => {}
            Ok(Err(why)) => return HealthEnd::Aborted(FailureReason::DeployerProtocol, why),
            Err(e) => {
                tracing::error!(error = %e, build = %format_build_id(build.id), "cannot store a rollout's plan");
                return HealthEnd::Failed("the rollout's plan could not be stored".into());
            }
        }
        self.run_rollout(build, request, verbs, pipe, cancel).await
    }

    /// Runs a stored rollout from where its record says it is, to its end
    /// or to a shutdown (the record stays as it is then).
    pub(super) async fn run_rollout(
        self: &Arc<Self>,
        build: &BuildRecord,
        request: &Value,
        verbs: Verbs,
        pipe: &mut LogPipe,
        cancel: &mut watch::Receiver<Halt>,
    ) -> HealthEnd {
        let mut io = PipeHealth::of(self, build, pipe, cancel);
        let end = Run::new(self, build.id, request, verbs)
            .run_to_end(&mut io)
            .await;
        io.pipe.commit_pending().await;
        end
    }

    /// Plans the rollout and stores it with the deploy's result (what the
    /// final commit stores, also after a restart), with its first
    /// `rollout` events.
    async fn start_rollout(
        &self,
        build: &BuildRecord,
        changed: Vec<String>,
        nodes: Vec<NodeOutcome>,
    ) -> StoreResult<Result<(), String>> {
        let (hub, build, nodes) = (self.hub.clone(), build.clone(), Arc::new(nodes));
        self.store
            .write(move |tx| plan_tx(tx, &hub, &build, &changed, &nodes))
            .await
    }
}

/// A deployment's stored rollout policy (`{}` when none is stored).
fn stored_policy(rx: &impl Lookup, deployment: &str) -> StoreResult<(Policy, String)> {
    let text = rx.rollout_policy(deployment)?;
    let text = text.unwrap_or_else(|| "{}".to_string());
    let value: Value = serde_json::from_str(&text)
        .map_err(|_| StoreError::corrupt("a stored rollout policy is not JSON"))?;
    let policy = Policy::parse(&value)
        .map_err(|_| StoreError::corrupt("a stored rollout policy breaks its rules"))?;
    Ok((policy, text))
}

/// The write job that starts a rollout: the plan of `build`'s changed
/// nodes under the deployment's policy, stored with the deploy's result
/// (`nodes`), and its first `rollout` events.
pub(super) fn plan_tx(
    tx: &crate::store::Tx,
    hub: &Arc<crate::events::Hub>,
    build: &BuildRecord,
    changed: &[String],
    nodes: &[NodeOutcome],
) -> StoreResult<Result<(), String>> {
    // Bound nodes are in the plan by their artifacts (agents.md).
    let changed = match super::activations::stage_tx(tx, build, changed, nodes)? {
        Ok(changed) => changed,
        Err(why) => return Ok(Err(why)),
    };
    let changed = changed.as_slice();
    let (policy, text) = stored_policy(tx, &build.deployment)?;
    // The way back (a rollback) and a toggle of what ran before (suspend,
    // resume) are one wave.
    let staging = match &build.trigger {
        Trigger::Submit | Trigger::AutomaticUpdate => Staging::Staged,
        Trigger::Action(_) | Trigger::AutomaticRollback | Trigger::Delete => Staging::OneWave,
    };
    let waves = plan::plan(changed, &policy, staging);
    let now = now_millis();
    let record = RolloutRecord {
        build: build.id,
        deployment: build.deployment.clone(),
        rollout: Rollout::new(waves, &policy, staging),
        policy: text,
        pause: None,
        abort: None,
        unhealthy: vec![],
        started_at: now,
        updated_at: now,
    };
    tx.put_rollout(&record)?;
    tx.put_rollout_result(record.build, Some(&nodes))?;
    if let Some(mut d) = tx.deployment(&record.deployment)? {
        let change = Change::new(tx, hub);
        change.rollout_changed(&mut d, summary(&record).to_string(), None)?;
    }
    Ok(Ok(()))
}

/// The nodes of `waves` whose `activate` answered `false`.
fn not_activated(waves: &[&Wave]) -> BTreeMap<String, String> {
    waves
        .iter()
        .flat_map(|w| w.activated.iter())
        .filter(|(_, ok)| !**ok)
        .map(|(node, _)| (node.clone(), "not activated".to_string()))
        .collect()
}

/// Why a gate failed: the wave, its first unhealthy node and the reason.
fn gate_failure(wave: usize, over: &Wave, unhealthy: &BTreeMap<String, String>) -> String {
    match over.nodes.iter().find(|n| unhealthy.contains_key(*n)) {
        Some(n) => format!(
            "wave {wave}: node {n} was not healthy in time: {}",
            unhealthy[n]
        ),
        None => format!("wave {wave}: the gate did not pass"),
    }
}

/// What a pause, abort or resume leaves on the record.
fn take_note(after: &mut RolloutRecord, noted: &Noted) {
    match &noted.event {
        Event::PauseAsked => after.pause = noted.note.clone(),
        Event::Resumed => after.pause = None,
        Event::AbortAsked | Event::GateFailed | Event::ActivateFailed | Event::ConfirmFailed => {
            if after.abort.is_none() {
                after.abort = noted.note.clone();
            }
        }
        Event::GatePassed
        | Event::ActivateStarted { .. }
        | Event::Activated { .. }
        | Event::WaitOver
        | Event::FreezeHeld
        | Event::FreezeLifted
        | Event::Reverted { .. }
        | Event::Confirmed
        | Event::Cancelled
        | Event::Failed => {}
    }
    // A pause set by the policy at a gate.
    if after.rollout.paused && after.pause.is_none() {
        after.pause = Some(RolloutNote {
            by: "policy".into(),
            at: after.updated_at,
            actor: None,
            reason: None,
        });
    }
    if !after.rollout.paused {
        after.pause = None;
    }
}

/// What a rollout's runner needs beyond the health step's calls: events
/// of its own amid the build's log (the `rollout` event). The embedded
/// worker's log pipe (`PipeHealth`) and a remote worker's attempt
/// (`remote_rollout::RemoteIo`) each give it.
pub(super) trait RolloutIo: HealthIo + Send {
    fn event(
        &mut self,
        kind: BuildEvent,
        data: String,
    ) -> impl std::future::Future<Output = ()> + Send;
}

impl RolloutIo for PipeHealth<'_> {
    async fn event(&mut self, kind: BuildEvent, data: String) {
        self.engine
            .build_event_amid(self.build, kind, data, self.pipe)
            .await;
    }
}

/// How a finished rollout ended, as the build's verdict reads a health
/// step; `activate_failure` is why an `activate` call failed, when the
/// runner saw it (else the abort's words).
pub(super) fn end_of(
    outcome: crate::model::RolloutOutcome,
    record: &RolloutRecord,
    activate_failure: Option<&(FailureReason, String)>,
) -> HealthEnd {
    let why = || {
        record
            .abort
            .as_ref()
            .and_then(|n| n.reason.clone())
            .unwrap_or_else(|| "the rollout was aborted".into())
    };
    match outcome {
        crate::model::RolloutOutcome::Succeeded => HealthEnd::Confirmed,
        crate::model::RolloutOutcome::Cancelled => HealthEnd::Halted(Halt::Cancel),
        crate::model::RolloutOutcome::Failed => HealthEnd::Failed(why()),
        crate::model::RolloutOutcome::Aborted => match record.rollout.abort {
            Some(AbortBy::Action) => HealthEnd::Aborted(
                FailureReason::RolloutAborted,
                format!("aborted in wave {}: {}", record.rollout.wave, why()),
            ),
            Some(AbortBy::Activate) => match activate_failure {
                Some((reason, detail)) => HealthEnd::Aborted(*reason, detail.clone()),
                None => HealthEnd::Aborted(FailureReason::ExitStatus, why()),
            },
            Some(AbortBy::Health | AbortBy::Confirm) | None => HealthEnd::Failed(why()),
        },
    }
}

/// The nodes of `nodes` the deployer's verbs name: those not bound to an
/// agent.
fn unbound_of(nodes: &[String], bound: &BTreeSet<String>) -> Vec<String> {
    nodes
        .iter()
        .filter(|n| !bound.contains(*n))
        .cloned()
        .collect()
}

/// A bound node's health in a gate: healthy once its agent activated it
/// and said so.
fn agent_health(seen: Option<&super::activations::Seen>) -> (bool, Option<String>) {
    let Some(s) = seen else {
        return (false, Some("its activation is not published".into()));
    };
    let said = |what: &str| {
        Some(format!(
            "{what} ({})",
            s.reason.as_deref().unwrap_or("no reason")
        ))
    };
    match s.status {
        ActivationStatus::Pending => (
            false,
            Some("its agent has not claimed the activation".into()),
        ),
        ActivationStatus::Claimed | ActivationStatus::Fetched => {
            (false, Some("its agent is activating it".into()))
        }
        ActivationStatus::Activated
        | ActivationStatus::Confirming
        | ActivationStatus::Confirmed => match &s.health {
            Some(h) if h.healthy => (true, None),
            Some(h) => (
                false,
                Some(h.reason.clone().unwrap_or_else(|| "unhealthy".into())),
            ),
            None => (
                false,
                Some("its agent has not answered its health yet".into()),
            ),
        },
        ActivationStatus::Failed => (false, said("its agent failed the activation")),
        ActivationStatus::Lost => (false, said("its activation was lost")),
        ActivationStatus::Ended => (false, said("berth ended its activation")),
    }
}

/// One rollout's runner.
pub(super) struct Run {
    engine: Arc<Engine>,
    build: BuildId,
    request: Value,
    verbs: Verbs,
    /// The summary the build channel showed last.
    shown: Option<String>,
    /// When the watch last checked the activated nodes of a held rollout.
    watched: Option<tokio::time::Instant>,
    /// Why an `activate` call failed, for the build's failure.
    activate_failure: Option<(FailureReason, String)>,
}

impl Run {
    pub(super) fn new(engine: &Arc<Engine>, build: BuildId, request: &Value, verbs: Verbs) -> Run {
        Run {
            engine: engine.clone(),
            build,
            request: request.clone(),
            verbs,
            shown: None,
            watched: None,
            activate_failure: None,
        }
    }

    /// Runs the stored rollout from where its record is to its end (or to
    /// a halt).
    pub(super) async fn run_to_end(&mut self, io: &mut impl RolloutIo) -> HealthEnd {
        loop {
            let record = match self
                .engine
                .store
                .read()
                .and_then(|rx| rx.rollout(self.build))
            {
                Ok(Some(r)) => r,
                Ok(None) | Err(_) => {
                    return HealthEnd::Failed("the rollout's record cannot be read".into())
                }
            };
            self.show(io, &record).await;
            match self.halted(io) {
                Halt::No => {}
                Halt::Cancel => {
                    self.apply(Noted::bare(Event::Cancelled)).await;
                    return HealthEnd::Halted(Halt::Cancel);
                }
                // The record stays as it is: the rollout goes on after the
                // next start.
                Halt::Shutdown => return HealthEnd::Halted(Halt::Shutdown),
            }
            if let Some(why) = self.lost(&record) {
                io.lines(&[format!("[berth] {why}")]).await;
                self.apply(Noted::bare(Event::Failed)).await;
                return HealthEnd::Aborted(FailureReason::LostAttempt, why);
            }
            let frozen = self.frozen(&record.deployment);
            let step = record.rollout.next(frozen);
            match step {
                Next::Done(outcome) => return self.ended(outcome, &record),
                Next::Activate { wave, nodes } => self.activate(io, &record, wave, nodes).await,
                Next::Gate { nodes } => self.gate(io, &record, nodes).await,
                Next::Hold(state) => self.hold(io, &record, state).await,
                Next::Confirm { nodes } => {
                    let Some(noted) = self.confirm(io, &record, nodes).await else {
                        continue;
                    };
                    self.apply(noted).await;
                }
                Next::Revert { wave, nodes } => {
                    self.revert(io, &record.deployment, wave, nodes).await;
                }
            }
        }
    }

    /// Who stops the rollout: a cancel, or a shutdown as soon as berth
    /// begins one (a rollout between calls need not wait out
    /// `--shutdown-grace`: it goes on after the next start).
    fn halted(&self, io: &impl RolloutIo) -> Halt {
        match io.halted() {
            Halt::No
                if self
                    .engine
                    .stopping
                    .load(std::sync::atomic::Ordering::SeqCst) =>
            {
                Halt::Shutdown
            }
            halted => halted,
        }
    }

    async fn apply(&self, noted: Noted) -> Option<RolloutRecord> {
        match self.engine.rollout_apply(self.build, noted).await {
            Ok(after) => after,
            Err(e) => {
                tracing::error!(error = %e, build = %format_build_id(self.build), "cannot store a rollout's step; it is tried again");
                tokio::time::sleep(HOLD_STEP).await;
                None
            }
        }
    }

    /// The build channel's `rollout` event when the summary changed since
    /// it was last shown.
    async fn show(&mut self, io: &mut impl RolloutIo, record: &RolloutRecord) {
        let text = summary(record).to_string();
        if self.shown.as_deref() == Some(text.as_str()) {
            return;
        }
        io.event(BuildEvent::Rollout, text.clone()).await;
        self.shown = Some(text);
    }

    fn ended(&self, outcome: crate::model::RolloutOutcome, record: &RolloutRecord) -> HealthEnd {
        end_of(outcome, record, self.activate_failure.as_ref())
    }

    /// Wave `wave`'s `activate` `new` (its nodes named first).
    async fn activate(
        &mut self,
        io: &mut impl RolloutIo,
        record: &RolloutRecord,
        wave: usize,
        nodes: Vec<String>,
    ) {
        if record.rollout.unanswered() != Some(wave) {
            self.apply(Noted::bare(Event::ActivateStarted { wave }))
                .await;
            return;
        }
        io.lines(&[format!(
            "[berth] wave {wave}/{}: activating {}",
            record.rollout.waves.len(),
            nodes.join(", ")
        )])
        .await;
        let Some(bound) = self.bound(&record.deployment, &nodes).await else {
            return;
        };
        let unbound = unbound_of(&nodes, &bound);
        let called = match unbound.is_empty() {
            true => Ok(BTreeMap::new()),
            false => self.call_activate(io, wave, &unbound, "new").await,
        };
        let called = match (called, bound.is_empty()) {
            (Ok(mut answers), false) => {
                match self.publish(io, &record.deployment, wave, bound).await {
                    Ok(published) => {
                        answers.extend(published);
                        Ok(answers)
                    }
                    Err(failure) => Err(failure),
                }
            }
            (called, _) => called,
        };
        let noted = match called {
            Ok(answers) => {
                for (node, (ok, reason)) in &answers {
                    if !ok {
                        let reason = reason.as_deref().unwrap_or("not activated");
                        io.lines(&[format!("[berth] node {node} was not activated: {reason}")])
                            .await;
                    }
                }
                let answers = answers.into_iter().map(|(n, (ok, _))| (n, ok)).collect();
                Noted::bare(Event::Activated { wave, answers })
            }
            Err((reason, detail)) => {
                io.lines(&[format!("[berth] wave {wave}: {detail}")]).await;
                self.activate_failure = Some((reason, detail.clone()));
                Noted::by(Event::ActivateFailed, "activate", detail)
            }
        };
        self.apply(noted).await;
    }

    /// One `activate` call for `nodes` of `wave` towards `target`.
    async fn call_activate(
        &self,
        io: &mut impl RolloutIo,
        wave: usize,
        nodes: &[String],
        target: &str,
    ) -> Activation {
        let mut call = self.request.clone();
        call["nodes"] = json!(nodes);
        call["wave"] = json!(wave);
        call["target"] = json!(target);
        let limit = match self.engine.settings.build_timeout {
            t if t.is_zero() => Duration::from_secs(24 * 3600),
            t => t,
        };
        let (ended, result, output) = io.call("activate", &call, limit).await.map_err(|e| {
            (
                FailureReason::SpawnFailed,
                format!("the deployer's activate could not be started: {e}"),
            )
        })?;
        io.lines(&output).await;
        let bytes = match (ended, result) {
            (Ended::Exit(0), Ok(Some(bytes))) => bytes,
            (Ended::Exit(0), _) => {
                return Err((
                    FailureReason::DeployerProtocol,
                    "the deployer's activate exited 0 without a result".into(),
                ))
            }
            (Ended::Timeout, _) => {
                return Err((
                    FailureReason::Timeout,
                    "the deployer's activate ran longer than --build-timeout".into(),
                ))
            }
            (ended, _) => {
                return Err((
                    FailureReason::ExitStatus,
                    format!("the deployer's activate failed ({ended:?})"),
                ))
            }
        };
        let protocol = |why: &str| (FailureReason::DeployerProtocol, why.to_string());
        let parsed: ActivateResult = serde_json::from_slice(&bytes)
            .map_err(|_| protocol("the deployer's activate result breaks the protocol"))?;
        let mut answers = BTreeMap::new();
        for n in parsed.nodes {
            let reason = n.reason.map(|r| {
                r.chars()
                    .take(MAX_ACTIVATE_REASON_CHARS)
                    .collect::<String>()
            });
            answers.insert(n.name, (n.activated, reason));
        }
        let asked: BTreeSet<&String> = nodes.iter().collect();
        if answers.len() != nodes.len() || !answers.keys().all(|k| asked.contains(k)) {
            return Err(protocol(
                "the deployer's activate did not answer once for each requested node",
            ));
        }
        Ok(answers)
    }

    /// The gate: `check` the nodes at once and every `--health-interval`
    /// until each wave has at most its allowance of unhealthy nodes, or
    /// the deadline passes. Without checks (`--health-timeout 0` and no
    /// deadline in the policy, or no `check` verb) the `activate` answers
    /// alone decide it, at once.
    async fn gate(&mut self, io: &mut impl RolloutIo, record: &RolloutRecord, nodes: Vec<String>) {
        let policy = self.started_policy(record);
        let settings = &self.engine.settings;
        let interval = settings.health_interval;
        let deadline_after = match policy.progress_deadline_seconds {
            Some(s) => Duration::from_secs(u64::from(s)),
            None => settings.health_timeout,
        };
        let Some(bound) = self.bound(&record.deployment, &nodes).await else {
            return;
        };
        // A bound node passes a gate only once its agent activated it and
        // says it is healthy: the gate checks even without `check`, and
        // waits at most the revert window when it has no deadline.
        let deadline_after = match (deadline_after.is_zero(), bound.is_empty()) {
            (true, false) => settings.agent_revert_after,
            (true, true) | (false, _) => deadline_after,
        };
        let checks = (self.verbs.check || !bound.is_empty()) && !deadline_after.is_zero();
        let deadline = tokio::time::Instant::now() + deadline_after;
        let waves: Vec<&Wave> = record
            .rollout
            .waves
            .iter()
            .filter(|w| w.activated.keys().any(|n| nodes.contains(n)))
            .collect();
        let mut attempt: u32 = 1;
        loop {
            let mut unhealthy = not_activated(&waves);
            if checks {
                for (node, reason) in self.check_gate(io, record, (&nodes, &bound), attempt).await {
                    unhealthy.entry(node).or_insert(reason);
                }
                if self.lost(record).is_some() {
                    return;
                }
            }
            let over = waves.iter().find(|w| {
                let bad = w
                    .nodes
                    .iter()
                    .filter(|n| unhealthy.contains_key(*n))
                    .count();
                bad > plan::allowance(policy.max_unhealthy, w.nodes.len())
            });
            let Some(over) = over else {
                self.apply(Noted::bare(Event::GatePassed)).await;
                self.watched = Some(tokio::time::Instant::now());
                return;
            };
            let out_of_time = !checks || tokio::time::Instant::now() + interval > deadline;
            if out_of_time || self.halted(io) != Halt::No || self.aborted().await {
                if self.halted(io) == Halt::No && !self.aborted().await {
                    let detail = gate_failure(record.rollout.wave, over, &unhealthy);
                    self.apply(Noted::by(Event::GateFailed, "health", detail))
                        .await;
                }
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = io.halt_changed() => {}
                _ = self.engine.rollout_wake.notified() => {}
            }
            attempt = attempt.saturating_add(1);
        }
    }

    /// The policy the rollout started with, not one set since.
    fn started_policy(&self, record: &RolloutRecord) -> Policy {
        serde_json::from_str::<Value>(&record.policy)
            .map_err(|e| e.to_string())
            .and_then(|v| Policy::parse(&v).map_err(|_| "it breaks its rules".to_string()))
            .unwrap_or_else(|why| {
                tracing::error!(build = %format_build_id(self.build), error = %why, "a rollout's stored policy cannot be read; its gates allow no unhealthy node");
                Policy::default()
            })
    }

    /// One `check` of a gate: each answer a `health` event and noted on
    /// the rollout; the unhealthy nodes with their reasons.
    async fn check_gate(
        &self,
        io: &mut impl RolloutIo,
        record: &RolloutRecord,
        (nodes, bound): (&[String], &BTreeSet<String>),
        attempt: u32,
    ) -> Vec<(String, String)> {
        let answers = self.health_of(io, record, (nodes, bound), attempt).await;
        for a in &answers {
            io.answer(attempt, a).await;
        }
        let noted = answers
            .iter()
            .map(|a| (a.node.clone(), a.reason.clone()))
            .collect();
        self.engine.note_health(self.build, noted).await;
        answers
            .into_iter()
            .filter(|a| !a.healthy)
            .map(|a| (a.node, a.reason.unwrap_or_else(|| "unhealthy".into())))
            .collect()
    }

    /// Whether the rollout is being aborted (an action came meanwhile).
    async fn aborted(&self) -> bool {
        matches!(
            self.engine.store.read().and_then(|rx| rx.rollout(self.build)),
            Ok(Some(r)) if r.rollout.state == crate::model::RolloutState::Aborting
        )
    }

    /// Whether a freeze holds the deployment now (a store that cannot be
    /// read holds it: no wave starts on a guess).
    fn frozen(&self, deployment: &str) -> bool {
        match self
            .engine
            .store
            .read()
            .and_then(|rx| super::freeze::holding(&rx, deployment, now_millis()))
        {
            Ok(held) => held.is_some(),
            Err(e) => {
                tracing::error!(error = %e, "cannot read the freezes; the rollout holds");
                true
            }
        }
    }

    /// A hold: until the wait's end, a wake (an action or a lift), the
    /// freeze's next look, or a halt.
    async fn hold(
        &mut self,
        io: &mut impl RolloutIo,
        record: &RolloutRecord,
        state: crate::model::RolloutState,
    ) {
        use crate::model::RolloutState;
        let now = now_millis();
        let event = match state {
            RolloutState::Waiting if record.rollout.wait_until.is_some_and(|at| now >= at) => {
                Some(Event::WaitOver)
            }
            // The next wave meets a freeze: the rollout shows it held.
            RolloutState::Frozen if record.rollout.state == RolloutState::Running => {
                Some(Event::FreezeHeld)
            }
            RolloutState::Frozen if !self.frozen(&record.deployment) => Some(Event::FreezeLifted),
            RolloutState::Waiting | RolloutState::Paused | RolloutState::Frozen => None,
            RolloutState::Running
            | RolloutState::Confirming
            | RolloutState::Aborting
            | RolloutState::Finished => None,
        };
        if let Some(event) = event {
            self.apply(Noted::bare(event)).await;
            return;
        }
        self.watch(io, record).await;
        tokio::select! {
            _ = tokio::time::sleep(HOLD_STEP) => {}
            _ = io.halt_changed() => {}
            _ = self.engine.rollout_wake.notified() => {}
        }
    }

    /// The watch of a held rollout: every `--rollout-watch-interval`, a
    /// `check` of every activated node; a `health` event only for a node
    /// whose health changed. It decides nothing (the next gate does).
    async fn watch(&mut self, io: &mut impl RolloutIo, record: &RolloutRecord) {
        let every = self.engine.settings.rollout_watch_interval;
        // A hold begins right after a gate's check: the first watch is a
        // whole interval later.
        let Some(last) = self.watched else {
            self.watched = Some(tokio::time::Instant::now());
            return;
        };
        let due = last.elapsed() >= every;
        let nodes: Vec<String> = record
            .rollout
            .waves
            .iter()
            .flat_map(|w| {
                w.activated
                    .iter()
                    .filter(|(_, ok)| **ok)
                    .map(|(n, _)| n.clone())
            })
            .collect();
        if !due || nodes.is_empty() {
            return;
        }
        self.watched = Some(tokio::time::Instant::now());
        let Some(bound) = self.bound(&record.deployment, &nodes).await else {
            return;
        };
        let answers = self.health_of(io, record, (&nodes, &bound), 0).await;
        let was_unhealthy = |node: &str| record.unhealthy.iter().any(|(n, _, _)| n == node);
        for a in &answers {
            if a.healthy == was_unhealthy(&a.node) {
                io.answer(0, a).await;
            }
        }
        let noted = answers
            .iter()
            .map(|a| (a.node.clone(), a.reason.clone()))
            .collect();
        self.engine.note_health(self.build, noted).await;
    }

    /// Which of `nodes` go through their agents; `None` (after a pause)
    /// when the store cannot be read: the step is tried again.
    async fn bound(&self, deployment: &str, nodes: &[String]) -> Option<BTreeSet<String>> {
        let read = self
            .engine
            .store
            .read()
            .and_then(|rx| super::activations::bound_of(&rx, deployment, self.build, nodes));
        match read {
            Ok(bound) => Some(bound),
            Err(e) => {
                tracing::error!(error = %e, "cannot read a rollout's bound nodes; it tries again");
                tokio::time::sleep(HOLD_STEP).await;
                None
            }
        }
    }

    /// Publishes `activate` for a wave's bound nodes: each answers `true`
    /// (agents.md: the gate then waits for its agent's `activated` step
    /// and health).
    async fn publish(
        &self,
        io: &mut impl RolloutIo,
        deployment: &str,
        wave: usize,
        bound: BTreeSet<String>,
    ) -> Activation {
        let names: Vec<String> = bound.iter().cloned().collect();
        self.engine
            .publish_activations(self.build, deployment, bound)
            .await
            .map_err(|e| {
                (
                    FailureReason::Internal,
                    format!("the activations could not be published: {e}"),
                )
            })?;
        io.lines(&[format!(
            "[berth] wave {wave}: published to the agents of {}",
            names.join(", ")
        )])
        .await;
        Ok(names.into_iter().map(|n| (n, (true, None))).collect())
    }

    /// One round of health answers for `nodes`: the deployer's `check`
    /// of the unbound ones (when it has the verb), the agents' latest
    /// answers for the bound ones.
    async fn health_of(
        &self,
        io: &mut impl RolloutIo,
        record: &RolloutRecord,
        (nodes, bound): (&[String], &BTreeSet<String>),
        attempt: u32,
    ) -> Vec<health::HealthAnswer> {
        let unbound = unbound_of(nodes, bound);
        let mut answers = if self.verbs.check && !unbound.is_empty() {
            let mut call = self.request.clone();
            call["nodes"] = json!(unbound);
            call["attempt"] = json!(attempt);
            call["wave"] = json!(record.rollout.wave);
            health::check(io, &call, &unbound, self.engine.settings.health_interval).await
        } else {
            vec![]
        };
        answers.extend(self.agent_answers(&record.deployment, bound));
        answers
    }

    /// The health of bound nodes as their agents reported it, as answers
    /// of a check.
    fn agent_answers(
        &self,
        deployment: &str,
        bound: &BTreeSet<String>,
    ) -> Vec<health::HealthAnswer> {
        if bound.is_empty() {
            return vec![];
        }
        let seen = match self.engine.activations(deployment, self.build, bound) {
            Ok(seen) => seen,
            Err(e) => {
                tracing::error!(error = %e, "cannot read the agents' activations");
                BTreeMap::new()
            }
        };
        bound
            .iter()
            .map(|node| {
                let (healthy, reason) = agent_health(seen.get(node));
                health::HealthAnswer {
                    node: node.clone(),
                    healthy,
                    reason,
                }
            })
            .collect()
    }

    /// Why the build fails `lost_attempt`: a bound node's activation lost.
    fn lost(&self, record: &RolloutRecord) -> Option<String> {
        match self.engine.lost_activation(&record.deployment, self.build) {
            Ok(lost) => lost,
            Err(e) => {
                tracing::error!(error = %e, "cannot read the agents' activations");
                None
            }
        }
    }

    /// The confirm after the last wave: `confirm` for the deployer's nodes,
    /// a `confirm` document for the bound ones (each agent's `confirmed`
    /// awaited, within `CONFIRM_TIME_LIMIT`). `None`: halted meanwhile.
    async fn confirm(
        &mut self,
        io: &mut impl RolloutIo,
        record: &RolloutRecord,
        nodes: Vec<String>,
    ) -> Option<Noted> {
        let bound = self.bound(&record.deployment, &nodes).await?;
        let unbound = unbound_of(&nodes, &bound);
        if self.verbs.confirm && !unbound.is_empty() {
            match health::confirm(io, &self.request, &unbound).await {
                HealthEnd::Confirmed => {}
                HealthEnd::Failed(why) | HealthEnd::Aborted(_, why) => {
                    return Some(Noted::by(Event::ConfirmFailed, "confirm", why))
                }
                HealthEnd::Halted(_) => return None,
            }
        }
        if bound.is_empty() {
            return Some(Noted::bare(Event::Confirmed));
        }
        match self.confirm_agents(io, record, bound).await {
            Ok(()) => Some(Noted::bare(Event::Confirmed)),
            Err(why) => Some(Noted::by(Event::ConfirmFailed, "confirm", why)),
        }
    }

    /// Publishes `confirm` to the agents of `bound` and waits for each
    /// one's `confirmed`.
    async fn confirm_agents(
        &self,
        io: &mut impl RolloutIo,
        record: &RolloutRecord,
        bound: BTreeSet<String>,
    ) -> Result<(), String> {
        let deployment = &record.deployment;
        self.engine
            .publish_confirms(self.build, deployment, bound.clone())
            .await
            .map_err(|e| format!("the confirms could not be published: {e}"))?;
        io.lines(&[format!(
            "[berth] confirming through the agents of {}",
            bound.iter().cloned().collect::<Vec<_>>().join(", ")
        )])
        .await;
        let deadline = tokio::time::Instant::now() + health::CONFIRM_TIME_LIMIT;
        loop {
            let seen = self
                .engine
                .activations(deployment, self.build, &bound)
                .map_err(|e| e.to_string())?;
            let open: Vec<&String> = bound
                .iter()
                .filter(|n| {
                    seen.get(*n)
                        .is_none_or(|s| s.status != ActivationStatus::Confirmed)
                })
                .collect();
            if open.is_empty() {
                return Ok(());
            }
            if let Some((node, s)) = seen
                .iter()
                .find(|(_, s)| s.status.is_final() && s.status != ActivationStatus::Confirmed)
            {
                return Err(format!(
                    "the agent of node {node} did not confirm: {} ({})",
                    s.status.as_str(),
                    s.reason.as_deref().unwrap_or("no reason")
                ));
            }
            if tokio::time::Instant::now() >= deadline || self.halted(io) != Halt::No {
                return Err(format!(
                    "the agents of {} did not confirm within 300 s",
                    open.iter()
                        .map(|n| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            tokio::select! {
                _ = tokio::time::sleep(HOLD_STEP) => {}
                _ = io.halt_changed() => {}
                _ = self.engine.rollout_wake.notified() => {}
            }
        }
    }

    /// Wave `wave` put back: `activate` `previous` for the nodes an
    /// `activate` named; a failure is logged and the next wave goes back
    /// anyway.
    async fn revert(
        &self,
        io: &mut impl RolloutIo,
        deployment: &str,
        wave: usize,
        nodes: Vec<String>,
    ) {
        io.lines(&[format!(
            "[berth] wave {wave}: putting back {}",
            nodes.join(", ")
        )])
        .await;
        let Some(bound) = self.bound(deployment, &nodes).await else {
            return;
        };
        if !bound.is_empty() {
            let why = "the rollout was aborted";
            if let Err(e) = self
                .engine
                .send_back(self.build, deployment, bound.clone(), why)
                .await
            {
                tracing::error!(error = %e, "cannot send bound nodes back; the build's end does");
            }
        }
        let nodes = unbound_of(&nodes, &bound);
        if nodes.is_empty() {
            self.apply(Noted::bare(Event::Reverted { wave })).await;
            return;
        }
        match self.call_activate(io, wave, &nodes, "previous").await {
            Ok(answers) => {
                for (node, (ok, reason)) in answers {
                    if !ok {
                        let reason = reason.unwrap_or_else(|| "not put back".into());
                        io.lines(&[format!("[berth] node {node} was not put back: {reason}")])
                            .await;
                    }
                }
            }
            Err((_, detail)) => {
                io.lines(&[format!("[berth] wave {wave} was not put back: {detail}")])
                    .await;
            }
        }
        self.apply(Noted::bare(Event::Reverted { wave })).await;
    }
}
