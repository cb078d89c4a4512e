//! Activations through agents (agents.md "Activation"): a rollout's wave
//! publishes an `activate` document for each bound node of the wave, the
//! node's agent claims it, reports its steps and health, and confirms it
//! when berth publishes `confirm`; a build that ends unconfirmed sends the
//! node back to the artifact it ran before.
//!
//! Why it exists apart from `nodes`: this is the authority half. Each call
//! of an agent is one write job that checks its token, its attempt, its
//! replay and then `authority::judge` (the rules worker attempts follow,
//! on the same `AttemptRecord`), before it changes the node. The rollout
//! runner (`rollouts::Run`) publishes, reads the activations for its gates
//! and its confirm, and sees a lost one; the lease sweep loses them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde_json::json;

use super::outcome::NodeOutcome;
use super::refusal::Refusal;
use super::transition::Change;
use super::Engine;
use crate::audit::AuditResult;
use crate::authority::{self, Call, Replay};
use crate::events::Hub;
use crate::model::*;
use crate::nodes as rules;
use crate::store::{Lookup, StoreError, StoreResult, Tx};

/// Log items one activation keeps (agents.md "Limits and scale").
pub const MAX_ACTIVATION_LOG_LINES: u32 = 1000;
/// The reasons a `failed` outcome may give.
pub const FAILED_REASONS: [&str; 6] = [
    "fetch_failed",
    "digest_mismatch",
    "unsupported_artifact",
    "activation_failed",
    "confirm_failed",
    "reverted",
];

/// The id of a node's activation under `fence` (its routes name the node).
pub fn activation_id(fence: u64) -> String {
    format!("activation-{fence}")
}

/// The fence an activation id names.
pub fn parse_activation_id(id: &str) -> Option<u64> {
    let n = id.strip_prefix("activation-")?;
    if n.starts_with('0') {
        return None;
    }
    n.parse().ok()
}

/// The file digests a node's record names: each holds one reference to
/// its stored bytes (the blobs work states use), so an artifact is kept
/// while a document, a staged rollout or an activation names it.
fn named_files(n: &NodeRecord) -> BTreeSet<String> {
    let file = |a: &Artifact| (a.kind == ArtifactKind::File).then(|| a.id.clone());
    let mut out = BTreeSet::new();
    out.extend(
        n.desired
            .as_ref()
            .and_then(|d| d.artifact.as_ref())
            .and_then(file),
    );
    out.extend(n.staged.as_ref().and_then(|s| file(&s.artifact)));
    if let Some(a) = &n.activation {
        out.extend(file(&a.artifact));
        out.extend(a.before.as_ref().and_then(file));
    }
    out
}

/// The compressed bytes of new file artifacts, by digest (a deploy's).
pub type Blobs<'a> = &'a dyn Fn(&str) -> Option<(u64, Arc<Vec<u8>>)>;

/// No new artifact bytes: every digest the record gains is named already.
pub fn no_blobs(_: &str) -> Option<(u64, Arc<Vec<u8>>)> {
    None
}

/// Stores a node's record: the one writer of `nodes` rows, which keeps the
/// references of the artifacts they name.
pub fn put_node(
    tx: &Tx,
    before: Option<&NodeRecord>,
    after: &NodeRecord,
    blobs: Blobs,
) -> StoreResult<()> {
    let old = before.map(named_files).unwrap_or_default();
    let new = named_files(after);
    for digest in new.difference(&old) {
        let known = tx.work_state_blob(digest)?.is_some();
        let bytes = blobs(digest);
        match (known, bytes) {
            (_, Some((size, compressed))) => tx.ref_work_state(digest, size, || Ok(compressed))?,
            (true, None) => tx.ref_work_state(digest, 0, || {
                Err(StoreError::corrupt(
                    "a stored artifact vanished while referenced",
                ))
            })?,
            (false, None) => {
                return Err(StoreError::corrupt(
                    "a node names an artifact whose bytes berth never had",
                ))
            }
        }
    }
    for digest in old.difference(&new) {
        tx.unref_work_state(digest)?;
    }
    tx.put_node(after)
}

/// The bytes of a deploy's file artifacts, for `put_node`.
pub fn blobs_of(nodes: &[NodeOutcome]) -> impl Fn(&str) -> Option<(u64, Arc<Vec<u8>>)> + '_ {
    move |digest| {
        nodes
            .iter()
            .filter_map(|n| n.artifact_bytes.as_ref())
            .find(|b| b.0 == digest)
            .map(|b| (b.1, b.2.clone()))
    }
}

/// A rollout's plan: each bound node of the deployment whose artifact in
/// the result differs from its desired one (or that drifted) is staged
/// and changed, whatever the deployer said; every other node keeps the
/// deployer's `changed`. A bound node without an artifact fails the
/// deploy (`Err`, deployer.md).
pub fn stage_tx(
    tx: &Tx,
    build: &BuildRecord,
    changed: &[String],
    nodes: &[NodeOutcome],
) -> StoreResult<Result<Vec<String>, String>> {
    let mut changed: BTreeSet<String> = changed.iter().cloned().collect();
    let blobs = blobs_of(nodes);
    for before in tx.nodes(Some(&build.deployment), None, usize::MAX)? {
        let Some(outcome) = nodes.iter().find(|o| o.name == before.node) else {
            continue;
        };
        if before.tokens.is_empty() {
            continue;
        }
        let Some(artifact) = &outcome.artifact else {
            return Ok(Err(format!(
                "node {} is bound to an agent, and the deploy result gives it no artifact",
                before.node
            )));
        };
        let desired = before.desired.as_ref().and_then(|d| d.artifact.as_ref());
        let differs = !desired.is_some_and(|d| rules::same_artifact(d, artifact));
        changed.remove(&before.node);
        if !differs && before.drift.is_none() {
            continue;
        }
        changed.insert(before.node.clone());
        let mut n = before.clone();
        n.staged = Some(StagedArtifact {
            build: build.id,
            artifact: artifact.clone(),
        });
        put_node(tx, Some(&before), &n, &blobs)?;
    }
    Ok(Ok(changed.into_iter().collect()))
}

/// Which of `nodes` go through their agents in this build's rollout: those
/// staged for it whose binding still lives (a wave reads bindings as it
/// starts).
pub fn bound_of(
    rx: &impl Lookup,
    deployment: &str,
    build: BuildId,
    nodes: &[String],
) -> StoreResult<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    for name in nodes {
        if let Some(n) = rx.node(deployment, name)? {
            let staged = n.staged.as_ref().is_some_and(|s| s.build == build);
            let activating = n.activation.as_ref().is_some_and(|a| a.build == build);
            if (staged || activating) && !n.tokens.is_empty() {
                out.insert(name.clone());
            }
        }
    }
    Ok(out)
}

/// What a rollout's gate, confirm and loss checks read of a bound node.
#[derive(Debug, Clone)]
pub struct Seen {
    pub status: ActivationStatus,
    pub reason: Option<String>,
    pub health: Option<ReportedHealth>,
}

impl Engine {
    /// Publishes `activate` for `nodes` of `build` in one transaction: a
    /// new fence and generation each, the artifact staged for them. A node
    /// whose activation for this build is already published keeps it (a
    /// rollout that goes on after a restart).
    pub(super) async fn publish_activations(
        &self,
        build: BuildId,
        deployment: &str,
        nodes: BTreeSet<String>,
    ) -> StoreResult<()> {
        self.change_activations(deployment, nodes, move |n, now| publish_node(n, build, now))
            .await
    }

    /// Publishes `confirm` for `nodes` activated by `build`, in one
    /// transaction (same artifact, same fence).
    pub(super) async fn publish_confirms(
        &self,
        build: BuildId,
        deployment: &str,
        nodes: BTreeSet<String>,
    ) -> StoreResult<()> {
        self.change_activations(deployment, nodes, move |n, now| {
            let a = n
                .activation
                .as_mut()
                .filter(|a| a.build == build && a.status == ActivationStatus::Activated)?;
            a.status = ActivationStatus::Confirming;
            n.generation += 1;
            n.desired = Some(DesiredState {
                phase: NodePhase::Confirm,
                artifact: Some(a.artifact.clone()),
                build: Some(build),
                published_at: now,
            });
            Some(())
        })
        .await
    }

    /// Sends `nodes` of `build` back: a steady document with the artifact
    /// they ran before and a new fence; their activations end (an abort's
    /// `activate` `previous` of a bound node).
    pub(super) async fn send_back(
        &self,
        build: BuildId,
        deployment: &str,
        nodes: BTreeSet<String>,
        why: &str,
    ) -> StoreResult<()> {
        let why = why.to_string();
        self.change_activations(deployment, nodes, move |n, now| {
            send_back_node(n, build, &why, now)
        })
        .await
    }

    /// Runs `change` on each of `nodes` in one transaction; a node it
    /// answers `None` for is left as it is.
    async fn change_activations(
        &self,
        deployment: &str,
        nodes: BTreeSet<String>,
        change: impl Fn(&mut NodeRecord, Millis) -> Option<()> + Send + Sync + 'static,
    ) -> StoreResult<()> {
        let (hub, deployment) = (self.hub.clone(), deployment.to_string());
        self.store
            .write(move |tx| {
                let now = now_millis();
                let mut d = tx.deployment(&deployment)?;
                for name in &nodes {
                    let Some(before) = tx.node(&deployment, name)? else {
                        continue;
                    };
                    let mut n = before.clone();
                    if change(&mut n, now).is_none() {
                        continue;
                    }
                    put_node(tx, Some(&before), &n, &no_blobs)?;
                    node_event(tx, &hub, d.as_mut(), &n)?;
                }
                if let Some(d) = &d {
                    tx.put_deployment(d)?;
                }
                Ok(())
            })
            .await
    }

    /// The activations of `build` on `nodes`, as they are now.
    pub(super) fn activations(
        &self,
        deployment: &str,
        build: BuildId,
        nodes: &BTreeSet<String>,
    ) -> StoreResult<BTreeMap<String, Seen>> {
        let rx = self.store.read()?;
        let mut out = BTreeMap::new();
        for name in nodes {
            let seen = rx
                .node(deployment, name)?
                .and_then(|n| n.activation)
                .filter(|a| a.build == build)
                .map(|a| Seen {
                    status: a.status,
                    reason: a.reason,
                    health: a.health,
                });
            if let Some(seen) = seen {
                out.insert(name.clone(), seen);
            }
        }
        Ok(out)
    }

    /// The first activation of `build` that was lost, with its words.
    pub(super) fn lost_activation(
        &self,
        deployment: &str,
        build: BuildId,
    ) -> StoreResult<Option<String>> {
        let rx = self.store.read()?;
        for n in rx.nodes(Some(deployment), None, usize::MAX)? {
            if let Some(a) = n
                .activation
                .as_ref()
                .filter(|a| a.build == build && a.status == ActivationStatus::Lost)
            {
                return Ok(Some(format!(
                    "the agent of node {} lost its activation ({})",
                    n.node,
                    a.reason.as_deref().unwrap_or("its lease passed")
                )));
            }
        }
        Ok(None)
    }
}

/// The `activate` document of one node staged for `build` (see
/// `publish_activations`); `None` when it is published already or was
/// never staged.
fn publish_node(n: &mut NodeRecord, build: BuildId, now: Millis) -> Option<()> {
    if n.activation.as_ref().is_some_and(|a| a.build == build) {
        return None;
    }
    let staged = n.staged.take().filter(|s| s.build == build)?;
    let steady = n.desired.as_ref().filter(|d| d.phase == NodePhase::Steady);
    let (before, before_build) = (
        steady.and_then(|d| d.artifact.clone()),
        steady.and_then(|d| d.build),
    );
    n.fence += 1;
    n.generation += 1;
    n.activation = Some(NodeActivation {
        build,
        fence: n.fence,
        artifact: staged.artifact.clone(),
        before,
        before_build,
        status: ActivationStatus::Pending,
        reason: None,
        health: None,
        attempt: None,
        published_at: now,
        activated_at: None,
        finished_at: None,
        log_lines: 0,
        dropped_lines: 0,
    });
    n.desired = Some(DesiredState {
        phase: NodePhase::Activate,
        artifact: Some(staged.artifact),
        build: Some(build),
        published_at: now,
    });
    n.drift = None;
    Some(())
}

/// A node's `node` event in a transaction that holds its deployment.
fn node_event(
    tx: &Tx,
    hub: &Arc<Hub>,
    d: Option<&mut DeploymentRecord>,
    n: &NodeRecord,
) -> StoreResult<()> {
    let Some(d) = d else {
        // A node of a deployment that does not exist: documents still
        // wake their readers.
        let hub = hub.clone();
        tx.after_commit(move || hub.documents.send_modify(|g| *g += 1));
        return Ok(());
    };
    let reported = n.actual.as_ref().map_or(0, |r| r.reported_at);
    let agent = rules::AgentView {
        token: n.tokens.last().map(String::as_str),
        seen: None,
        status: rules::AgentStatus::of(None, n.actual.as_ref(), reported, now_millis()),
    };
    Change::new(tx, hub).node_changed_in(d, rules::entry(n, &agent, hub.document_times))
}

/// One node sent back to its steady artifact (see `send_back`); `None`
/// when `build` has no activation there that is still open.
fn send_back_node(n: &mut NodeRecord, build: BuildId, why: &str, now: Millis) -> Option<()> {
    let a = n.activation.as_mut().filter(|a| a.build == build)?;
    if a.status == ActivationStatus::Confirmed {
        return None;
    }
    if !a.status.is_final() {
        a.status = ActivationStatus::Ended;
        a.reason = Some(why.to_string());
        a.finished_at = Some(now);
        if let Some(att) = a
            .attempt
            .as_mut()
            .filter(|t| t.state == AttemptState::Active)
        {
            att.state = AttemptState::Ended;
        }
    }
    let (artifact, before_build) = (a.before.clone(), a.before_build);
    n.fence += 1;
    n.generation += 1;
    n.desired = Some(DesiredState {
        phase: NodePhase::Steady,
        artifact,
        build: before_build,
        published_at: now,
    });
    Some(())
}

/// A build ended: each node it activated and did not confirm goes back
/// (agents.md "Desired state": in the transaction that ends it), and what
/// it staged is dropped. Called by the build's final transaction.
pub fn build_ended_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    d: &mut DeploymentRecord,
    b: &BuildRecord,
) -> StoreResult<()> {
    let now = now_millis();
    let mut changed = false;
    for before in tx.nodes(Some(&d.id), None, usize::MAX)? {
        let mut n = before.clone();
        if n.staged.as_ref().is_some_and(|s| s.build == b.id) {
            n.staged = None;
        }
        let succeeded = b.status == BuildStatus::Succeeded;
        let why = format!(
            "build {} ended {}",
            format_build_id(b.id),
            b.status.as_str()
        );
        let sent_back = !succeeded && send_back_node(&mut n, b.id, &why, now).is_some();
        if n == before {
            continue;
        }
        put_node(tx, Some(&before), &n, &no_blobs)?;
        if sent_back {
            node_event(tx, hub, Some(d), &n)?;
            changed = true;
        }
    }
    if changed {
        tx.put_deployment(d)?;
    }
    Ok(())
}

/// What an agent's call carries.
pub struct ActivationAuthority {
    pub token: String,
    pub deployment: String,
    pub node: String,
    pub operation_id: String,
    pub fence: u64,
    pub incarnation: String,
    /// SHA-256 of the body, for replays.
    pub digest: String,
}

impl ActivationAuthority {
    fn authority(&self) -> Call<'_> {
        Call {
            operation_id: &self.operation_id,
            fence: self.fence,
            incarnation: &self.incarnation,
        }
    }
}

/// One item of an agent's progress batch.
#[derive(Debug, Clone)]
pub enum AgentItem {
    Fetched,
    Activated,
    Health(ReportedHealth),
    Log(String),
}

/// A progress or outcome that came before its turn (`400`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutOfOrder {
    Progress,
    Outcome,
}

/// Why an agent's call changed nothing.
#[derive(Debug)]
pub enum AgentRefusal {
    Refused(Refusal),
    OutOfOrder(OutOfOrder),
}

impl From<Refusal> for AgentRefusal {
    fn from(r: Refusal) -> Self {
        AgentRefusal::Refused(r)
    }
}

type Answered = Result<String, AgentRefusal>;

impl Engine {
    /// `POST .../claim`: the activation's authority for this incarnation.
    pub async fn claim_activation(self: &Arc<Self>, call: ActivationAuthority) -> Answered {
        let (hub, ttl) = (self.hub.clone(), self.lease_ttl_ms());
        let call = Arc::new(call);
        let answered = self
            .store
            .write(move |tx| claim_tx(tx, &hub, &call, ttl))
            .await
            .map_err(Refusal::from)?;
        answered
    }

    /// `POST .../attempts/{attempt}/renew|progress|outcome`: judged, then
    /// applied, in one write job.
    pub async fn activation_call(
        self: &Arc<Self>,
        call: ActivationAuthority,
        attempt: String,
        what: ActivationCall,
    ) -> Answered {
        let (hub, ttl) = (self.hub.clone(), self.lease_ttl_ms());
        let (call, what) = (Arc::new(call), Arc::new(what));
        let answered = self
            .store
            .write(move |tx| activation_tx(tx, &hub, &call, &attempt, &what, ttl))
            .await
            .map_err(Refusal::from)?;
        if answered.is_ok() {
            self.wake_rollouts();
        }
        answered
    }

    /// Loses every activation whose lease passed (the lease sweep).
    pub(super) async fn sweep_activation_leases(self: &Arc<Self>) {
        // A read first: most seconds nothing is due, and then nothing is
        // written.
        let now = now_millis();
        let due = self.store.read().and_then(|rx| {
            Ok(rx.nodes(None, None, usize::MAX)?.iter().any(|n| {
                n.activation
                    .as_ref()
                    .and_then(|a| a.attempt.as_ref())
                    .is_some_and(|t| {
                        t.state == AttemptState::Active && authority::lease_passed(t, now)
                    })
            }))
        });
        match due {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                tracing::error!(error = %e, "the activation lease sweep cannot read the store; it tries again");
                return;
            }
        }
        let hub = self.hub.clone();
        let swept = self
            .store
            .write(move |tx| {
                let now = now_millis();
                let mut lost = 0usize;
                for before in tx.nodes(None, None, usize::MAX)? {
                    let due = before
                        .activation
                        .as_ref()
                        .and_then(|a| a.attempt.as_ref())
                        .is_some_and(|t| {
                            t.state == AttemptState::Active && authority::lease_passed(t, now)
                        });
                    if due {
                        let mut n = before.clone();
                        lose(tx, &mut n, LossCause::LeaseExpired, now)?;
                        put_node(tx, Some(&before), &n, &no_blobs)?;
                        let mut d = tx.deployment(&n.deployment)?;
                        node_event(tx, &hub, d.as_mut(), &n)?;
                        if let Some(d) = &d {
                            tx.put_deployment(d)?;
                        }
                        lost += 1;
                    }
                }
                Ok(lost)
            })
            .await;
        match swept {
            Ok(0) => {}
            Ok(_) => self.wake_rollouts(),
            Err(e) => {
                tracing::error!(error = %e, "the activation lease sweep cannot write; it tries again")
            }
        }
    }
}

/// A restart of berth: every open activation's lease starts again now
/// (berth's down time never counts against an agent).
pub fn restart_leases_tx(tx: &Tx, ttl_ms: u64) -> StoreResult<()> {
    let now = now_millis();
    for before in tx.nodes(None, None, usize::MAX)? {
        let open = before
            .activation
            .as_ref()
            .and_then(|a| a.attempt.as_ref())
            .is_some_and(|t| t.state == AttemptState::Active);
        if !open {
            continue;
        }
        let mut n = before.clone();
        if let Some(t) = n.activation.as_mut().and_then(|a| a.attempt.as_mut()) {
            authority::restart(t, now, ttl_ms);
        }
        put_node(tx, Some(&before), &n, &no_blobs)?;
    }
    Ok(())
}

/// Downloads of artifacts at once (agents.md "Limits and scale").
pub const MAX_DOWNLOADS: usize = 256;

impl Engine {
    /// A file artifact's bytes for the agent of `node`: only a digest its
    /// record names (`Ok(None)` for any other, as for one never given).
    pub fn node_artifact(
        &self,
        deployment: &str,
        node: &str,
        digest: &str,
    ) -> StoreResult<Option<Vec<u8>>> {
        let rx = self.store.read()?;
        let Some(n) = rx.node(deployment, node)? else {
            return Ok(None);
        };
        if !named_files(&n).contains(digest) {
            return Ok(None);
        }
        rx.work_state_archive(digest)
    }
}

/// A revoked token's open activation of `n` is lost at once.
pub fn token_revoked(tx: &Tx, n: &mut NodeRecord, token: &str, now: Millis) -> StoreResult<()> {
    let held = n
        .activation
        .as_ref()
        .and_then(|a| a.attempt.as_ref())
        .is_some_and(|t| t.worker == token && t.state == AttemptState::Active);
    if held {
        lose(tx, n, LossCause::TokenRevoked, now)?;
    }
    Ok(())
}

/// The activation lost: its attempt and its status, audited
/// `attempt_lost` (no actor: berth judged it) in the same transaction.
fn lose(tx: &Tx, n: &mut NodeRecord, cause: LossCause, now: Millis) -> StoreResult<()> {
    let Some(a) = n.activation.as_mut() else {
        return Ok(());
    };
    let Some(t) = a
        .attempt
        .as_mut()
        .filter(|t| t.state == AttemptState::Active)
    else {
        return Ok(());
    };
    authority::lose(t, cause);
    let count = t.accepted_calls;
    if !a.status.is_final() {
        a.status = ActivationStatus::Lost;
        a.reason = Some(
            match cause {
                LossCause::LeaseExpired => "its lease passed",
                LossCause::TokenRevoked => "its token was revoked",
            }
            .to_string(),
        );
        a.finished_at = Some(now);
    }
    let mut draft = activation_draft("attempt_lost", n, None, AuditResult::Ok);
    draft.reason = Some(
        match cause {
            LossCause::LeaseExpired => "lease_expired",
            LossCause::TokenRevoked => "token_revoked",
        }
        .to_string(),
    );
    draft.count = count;
    super::audit_events::append(tx, &draft)
}

/// The audit draft of a node activation's step (audit.md): its node and
/// build, and the agent's token as the actor of the agent's own calls.
fn activation_draft(
    action: &'static str,
    n: &NodeRecord,
    token: Option<&str>,
    result: AuditResult,
) -> crate::audit::Draft {
    let mut draft = super::audit_events::system_draft(action, Some(n.deployment.clone()), result);
    draft.node = Some(n.node.clone());
    draft.build = n.activation.as_ref().map(|a| format_build_id(a.build));
    draft.actor = token.map(crate::audit::Actor::agent);
    draft
}

fn claim_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    call: &ActivationAuthority,
    ttl: u64,
) -> StoreResult<Answered> {
    let stale = || Ok(Err(Refusal::Stale(authority::Stale::Authority).into()));
    let Some(before) = tx.node(&call.deployment, &call.node)? else {
        return stale();
    };
    let Some(a) = before.activation.as_ref().filter(|a| a.fence == call.fence) else {
        return stale();
    };
    if let Some(t) = &a.attempt {
        return Ok(
            match authority::replay(t, "claim", &call.operation_id, &call.digest) {
                Replay::Same(answer) => Ok(answer.to_string()),
                Replay::Conflict => Err(Refusal::IdempotencyConflict.into()),
                Replay::New => Err(Refusal::Stale(authority::Stale::Authority).into()),
            },
        );
    }
    if a.status != ActivationStatus::Pending || before.fence != call.fence {
        return stale();
    }
    let now = now_millis();
    let mut n = before.clone();
    let act = n.activation.as_mut().expect("checked above");
    let mut attempt = authority::new_attempt(
        act.build,
        &call.deployment,
        &call.token,
        &call.incarnation,
        call.fence - 1,
        now,
        Some(ttl),
    );
    let answer = json!({"authority": activation_id(call.fence), "lease_ttl_ms": ttl}).to_string();
    authority::keep_reply(
        &mut attempt,
        "claim",
        &call.operation_id,
        &call.digest,
        answer.clone(),
    );
    act.attempt = Some(attempt);
    act.status = ActivationStatus::Claimed;
    put_node(tx, Some(&before), &n, &no_blobs)?;
    let claimed = activation_draft("attempt_claim", &n, Some(&call.token), AuditResult::Ok);
    Change::new(tx, hub).audit(&claimed)?;
    let mut d = tx.deployment(&n.deployment)?;
    node_event(tx, hub, d.as_mut(), &n)?;
    if let Some(d) = &d {
        tx.put_deployment(d)?;
    }
    Ok(Ok(answer))
}

/// A call after the claim.
#[derive(Debug, Clone)]
pub enum ActivationCall {
    Renew,
    Progress(Vec<(u64, AgentItem)>),
    /// `confirmed`, or `failed` with its reason and detail.
    Outcome {
        confirmed: bool,
        reason: Option<String>,
        detail: Option<String>,
    },
}

impl ActivationCall {
    fn route(&self) -> &'static str {
        match self {
            ActivationCall::Renew => "renew",
            ActivationCall::Progress(_) => "progress",
            ActivationCall::Outcome { .. } => "outcome",
        }
    }
}

fn activation_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    call: &ActivationAuthority,
    attempt_id: &str,
    what: &ActivationCall,
    ttl: u64,
) -> StoreResult<Answered> {
    let missing = || {
        Ok(Err(
            Refusal::NotFound(super::refusal::Missing::Attempt).into()
        ))
    };
    let Some(fence) = parse_activation_id(attempt_id) else {
        return missing();
    };
    let Some(before) = tx.node(&call.deployment, &call.node)? else {
        return missing();
    };
    let Some(t) = before
        .activation
        .as_ref()
        .filter(|a| a.fence == fence)
        .and_then(|a| a.attempt.as_ref())
    else {
        return missing();
    };
    match authority::replay(t, what.route(), &call.operation_id, &call.digest) {
        Replay::Same(answer) => return Ok(Ok(answer.to_string())),
        Replay::Conflict => return Ok(Err(Refusal::IdempotencyConflict.into())),
        Replay::New => {}
    }
    let now = now_millis();
    let mut n = before.clone();
    let a = n.activation.as_mut().expect("found above");
    let t = a.attempt.as_mut().expect("found above");
    if let Err(stale) = authority::judge(t, &call.authority(), now) {
        refused_tx(tx, hub, (&before, n), call, stale, now)?;
        return Ok(Err(Refusal::Stale(stale).into()));
    }
    let answer = match apply(a, what, now, ttl) {
        Ok(answer) => answer,
        Err(refusal) => return Ok(Err(refusal)),
    };
    let t = a.attempt.as_mut().expect("found above");
    if t.state == AttemptState::Active {
        authority::renew(t, now, ttl);
        t.accepted_calls += 1;
    }
    authority::keep_reply(
        t,
        what.route(),
        &call.operation_id,
        &call.digest,
        answer.clone(),
    );
    let accepted_calls = t.accepted_calls;
    put_node(tx, Some(&before), &n, &no_blobs)?;
    if let ActivationCall::Outcome { reason, .. } = what {
        let mut draft = activation_draft("attempt_outcome", &n, Some(&call.token), AuditResult::Ok);
        draft.reason = reason.clone();
        draft.count = accepted_calls;
        Change::new(tx, hub).audit(&draft)?;
    }
    let shown = before
        .activation
        .as_ref()
        .map(|a| (a.status, a.health.clone()))
        != n.activation.as_ref().map(|a| (a.status, a.health.clone()));
    if shown {
        let mut d = tx.deployment(&n.deployment)?;
        node_event(tx, hub, d.as_mut(), &n)?;
        if let Some(d) = &d {
            tx.put_deployment(d)?;
        }
    }
    Ok(Ok(answer))
}

/// A call without authority changes nothing but this: a lease found
/// passed is lost now, and the attempt's first refusal is audited
/// (`attempt_refused`, by the agent's token).
fn refused_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    (before, mut n): (&NodeRecord, NodeRecord),
    call: &ActivationAuthority,
    stale: authority::Stale,
    now: Millis,
) -> StoreResult<()> {
    let Some(t) = n.activation.as_mut().and_then(|a| a.attempt.as_mut()) else {
        return Ok(());
    };
    let first = !t.refusal_audited;
    t.refusal_audited = true;
    let expired = stale == authority::Stale::LeaseExpired && t.state == AttemptState::Active;
    if !first && !expired {
        return Ok(());
    }
    if first {
        let mut draft = activation_draft(
            "attempt_refused",
            &n,
            Some(&call.token),
            AuditResult::Refused,
        );
        draft.reason = Some(stale.reason().to_string());
        Change::new(tx, hub).audit(&draft)?;
    }
    if expired {
        lose(tx, &mut n, LossCause::LeaseExpired, now)?;
    }
    put_node(tx, Some(before), &n, &no_blobs)?;
    Ok(())
}

/// Applies an accepted call to its activation: the answer, or why it came
/// before its turn.
fn apply(
    a: &mut NodeActivation,
    what: &ActivationCall,
    now: Millis,
    ttl: u64,
) -> Result<String, AgentRefusal> {
    match what {
        ActivationCall::Renew => {
            let expires = now.saturating_add(i64::try_from(ttl).unwrap_or(i64::MAX));
            Ok(json!({"lease_expires_at": format_time(expires), "lease_ttl_ms": ttl}).to_string())
        }
        ActivationCall::Progress(items) => progress(a, items, now),
        ActivationCall::Outcome {
            confirmed,
            reason,
            detail,
        } => {
            let status = match (confirmed, a.status) {
                (true, ActivationStatus::Confirming) => ActivationStatus::Confirmed,
                (true, _) => return Err(AgentRefusal::OutOfOrder(OutOfOrder::Outcome)),
                (false, _) => ActivationStatus::Failed,
            };
            a.status = status;
            a.reason = match (reason, detail) {
                (Some(r), Some(d)) => Some(format!("{r}: {d}")),
                (Some(r), None) => Some(r.clone()),
                (None, _) => None,
            };
            a.finished_at = Some(now);
            if let Some(t) = a.attempt.as_mut() {
                t.state = AttemptState::Ended;
            }
            Ok(json!({"status": status.as_str()}).to_string())
        }
    }
}

fn progress(
    a: &mut NodeActivation,
    items: &[(u64, AgentItem)],
    now: Millis,
) -> Result<String, AgentRefusal> {
    let t = a.attempt.as_ref().expect("a claimed activation");
    let seqs: Vec<u64> = items.iter().map(|(s, _)| *s).collect();
    let fresh = authority::new_items(t.applied_through, &seqs).map_err(|applied_through| {
        AgentRefusal::Refused(Refusal::ProgressGap { applied_through })
    })?;
    for (_, item) in &items[fresh] {
        match (item, a.status) {
            (AgentItem::Fetched, ActivationStatus::Claimed) => a.status = ActivationStatus::Fetched,
            (AgentItem::Activated, ActivationStatus::Fetched) => {
                a.status = ActivationStatus::Activated;
                a.activated_at = Some(now);
            }
            (AgentItem::Health(h), ActivationStatus::Activated | ActivationStatus::Confirming) => {
                a.health = Some(h.clone())
            }
            (AgentItem::Log(_), _) if a.log_lines < MAX_ACTIVATION_LOG_LINES => a.log_lines += 1,
            (AgentItem::Log(_), _) => a.dropped_lines = a.dropped_lines.saturating_add(1),
            (AgentItem::Fetched | AgentItem::Activated | AgentItem::Health(_), _) => {
                return Err(AgentRefusal::OutOfOrder(OutOfOrder::Progress))
            }
        }
    }
    let t = a.attempt.as_mut().expect("a claimed activation");
    t.applied_through = t.applied_through.max(seqs.last().copied().unwrap_or(0));
    Ok(json!({"applied_through": t.applied_through}).to_string())
}
