//! Nodes bound to agents (agents.md): the binding kept with each node, the
//! steady document a deploy publishes for its bound nodes, the reports
//! agents send, and what berth remembers of each agent between reports.
//!
//! Why it exists apart from `tokens` and `attempts`: a node outlives its
//! tokens (its fence is never handed out twice) and is neither a build nor
//! an attempt; its record changes by a report, a binding or a deploy, each
//! one write job here. What a report or a document means is the pure
//! `crate::nodes`; a report that changes nothing but the time commits
//! nothing, so what berth knows of an agent between changes (when it was
//! last seen, by which incarnation) lives in memory (`Agents`), bounded by
//! `--max-agents`, and starts again with berth.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::watch;

use super::outcome::NodeOutcome;
use super::refusal::Refusal;
use super::transition::Change;
use super::Engine;
use crate::events::Hub;
use crate::locks::Held;
use crate::model::*;
use crate::nodes::{self as rules, AgentStatus, AgentView, DocumentTimes, ParsedReport, Seen};
use crate::store::{Lookup, StoreResult, Tx};

/// How often berth looks for agents that went silent.
const NODE_SWEEP: std::time::Duration = std::time::Duration::from_secs(1);

/// A node by (deployment, node name).
type NodeKey = (String, String);

/// What berth knows of the agents since it started.
pub struct Agents {
    seen: Mutex<HashMap<NodeKey, Seen>>,
    /// When each node's last report was taken (one per second at most).
    last_report: Mutex<HashMap<NodeKey, Instant>>,
    /// The nodes shown unreachable in this episode (one event and
    /// webhook each, until the agent reports again).
    unreachable: Mutex<HashSet<NodeKey>>,
    /// When berth started: every agent counts as seen then.
    pub started: Millis,
    /// Open desired-state streams (`berth_agent_streams`).
    streams: std::sync::atomic::AtomicUsize,
    /// Reports taken since the start (`berth_agent_reports_total`).
    reports: std::sync::atomic::AtomicU64,
}

/// An open desired-state stream, counted while it lives.
pub struct StreamCount(Arc<Engine>);

impl Drop for StreamCount {
    fn drop(&mut self) {
        self.0
            .agents
            .streams
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Default for Agents {
    fn default() -> Agents {
        Agents {
            seen: Mutex::default(),
            last_report: Mutex::default(),
            unreachable: Mutex::default(),
            started: now_millis(),
            streams: Default::default(),
            reports: Default::default(),
        }
    }
}

impl Agents {
    fn seen_of(&self, key: &NodeKey) -> Option<Seen> {
        self.seen.held().get(key).cloned()
    }

    /// Forgets a node's agent (its last token revoked).
    fn forget(&self, key: &NodeKey) {
        self.seen.held().remove(key);
        self.last_report.held().remove(key);
        self.unreachable.held().remove(key);
    }
}

/// Why a report was refused.
#[derive(Debug)]
pub enum ReportRefusal {
    /// The node took a report less than a second ago.
    TooSoon,
    /// The agent's fence is below the node's (`409 stale_authority`).
    Refused(Refusal),
}

impl From<Refusal> for ReportRefusal {
    fn from(r: Refusal) -> ReportRefusal {
        ReportRefusal::Refused(r)
    }
}

/// A bound node's entry as the node reads show it.
pub struct NodeEntry {
    pub record: NodeRecord,
    pub entry: serde_json::Value,
}

/// What every document carries from berth's settings.
pub fn document_times(settings: &crate::settings::Settings) -> DocumentTimes {
    let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    DocumentTimes {
        lease_ttl_ms: ms(settings.lease_ttl),
        revert_after_ms: ms(settings.agent_revert_after),
        health_interval_ms: ms(settings.health_interval),
    }
}

impl Engine {
    /// What every document carries from berth's settings.
    pub fn document_times(&self) -> DocumentTimes {
        self.hub.document_times
    }

    /// The entry of a node as berth knows it now.
    pub fn node_entry(&self, n: &NodeRecord) -> serde_json::Value {
        entry_of(n, &self.agents, self.document_times(), now_millis())
    }

    /// A node's record; `None` when berth never bound or heard of it.
    pub fn node(&self, deployment: &str, node: &str) -> StoreResult<Option<NodeRecord>> {
        self.store.read()?.node(deployment, node)
    }

    /// Up to `limit` nodes after `after`, of one deployment or of all.
    pub fn nodes(
        &self,
        deployment: Option<&str>,
        after: Option<(&str, &str)>,
        limit: usize,
    ) -> StoreResult<Vec<NodeRecord>> {
        self.store.read()?.nodes(deployment, after, limit)
    }

    /// Counts an open desired-state stream while the guard lives.
    pub fn count_stream(self: &Arc<Self>) -> StreamCount {
        self.agents
            .streams
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        StreamCount(self.clone())
    }

    /// `berth_agent_streams` and `berth_agent_reports_total`.
    pub fn agent_counts(&self) -> (usize, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.agents.streams.load(Relaxed),
            self.agents.reports.load(Relaxed),
        )
    }

    /// The bound nodes by their agent's status (`berth_nodes{status}`).
    pub fn nodes_by_status(&self) -> StoreResult<[(&'static str, u64); 3]> {
        let now = now_millis();
        let mut counts = [0u64; 3];
        for n in self.store.read()?.nodes(None, None, usize::MAX)? {
            if n.tokens.is_empty() {
                continue;
            }
            let seen = self.agents.seen_of(&(n.deployment.clone(), n.node.clone()));
            let i =
                match AgentStatus::of(seen.as_ref(), n.actual.as_ref(), self.agents.started, now) {
                    AgentStatus::Reporting => 0,
                    AgentStatus::Unreachable => 1,
                    AgentStatus::NeverReported => 2,
                };
            counts[i] += 1;
        }
        Ok([
            (AgentStatus::Reporting.as_str(), counts[0]),
            (AgentStatus::Unreachable.as_str(), counts[1]),
            (AgentStatus::NeverReported.as_str(), counts[2]),
        ])
    }

    /// A receiver that changes when any node's document does.
    pub fn document_changes(&self) -> watch::Receiver<u64> {
        self.hub.documents.subscribe()
    }

    /// `POST /internal/v1/nodes/{deployment}/{node}/report`: the node's
    /// generation. A report that changes nothing but its time writes
    /// nothing; one whose fence is below the node's is refused with no
    /// effect; one above raises the node's fence to it.
    pub async fn node_report(
        self: &Arc<Self>,
        binding: &NodeBinding,
        parsed: ParsedReport,
    ) -> Result<u64, ReportRefusal> {
        let key = (binding.deployment.clone(), binding.node.clone());
        self.take_report_turn(&key)?;
        self.agents
            .reports
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let now = now_millis();
        let report = parsed.report;
        let stored = self.node(&key.0, &key.1).map_err(Refusal::from)?;
        let seen = Seen::report(self.agents.seen_of(&key).as_ref(), &report, now);
        let changes = match &stored {
            Some(n) if report.fence < n.fence => {
                return Err(Refusal::Stale(crate::authority::Stale::Authority).into())
            }
            Some(n) => report.fence > n.fence || rules::report_changes(n.actual.as_ref(), &report),
            None => true,
        };
        let was_unreachable = self.agents.unreachable.held().remove(&key);
        let shown_change = changes
            || was_unreachable
            || self.agents.seen_of(&key).as_ref().map(|s| s.duplicate) != Some(seen.duplicate);
        self.agents.seen.held().insert(key.clone(), seen.clone());
        let Some(stored) = stored.filter(|_| !shown_change) else {
            return self.store_report(key, report, seen).await;
        };
        Ok(stored.generation)
    }

    /// One report per node per `REPORT_EVERY_MS`.
    fn take_report_turn(&self, key: &NodeKey) -> Result<(), ReportRefusal> {
        let mut last = self.agents.last_report.held();
        let now = Instant::now();
        let every = std::time::Duration::from_millis(rules::REPORT_EVERY_MS);
        if last
            .get(key)
            .is_some_and(|at| now.duration_since(*at) < every)
        {
            return Err(ReportRefusal::TooSoon);
        }
        // Bounded by the bound nodes: only an authenticated agent token
        // of this node gets here, and tokens are bounded by --max-agents.
        last.insert(key.clone(), now);
        Ok(())
    }

    async fn store_report(
        self: &Arc<Self>,
        key: NodeKey,
        report: NodeReport,
        seen: Seen,
    ) -> Result<u64, ReportRefusal> {
        let (hub, times) = (self.hub.clone(), self.document_times());
        let started = self.agents.started;
        let written = self
            .store
            .write(move |tx| {
                let before = tx.node(&key.0, &key.1)?;
                let mut n = before
                    .clone()
                    .unwrap_or_else(|| NodeRecord::new(&key.0, &key.1));
                if report.fence < n.fence {
                    return Ok(Err(Refusal::Stale(crate::authority::Stale::Authority)));
                }
                let now = now_millis();
                // A fence above the node's: berth was restored from an
                // older backup; both sides go on from the higher one, in a
                // new generation of the document (it carries the fence).
                let raised = report.fence > n.fence;
                if raised {
                    n.fence = report.fence;
                    n.generation += 1;
                }
                n.actual = Some(report.clone());
                let drift = rules::drift(&n, now);
                let drift_began = n.drift.is_none() && drift.is_some();
                n.drift = drift;
                super::activations::put_node(
                    tx,
                    before.as_ref(),
                    &n,
                    &super::activations::no_blobs,
                )?;
                let agent = agent_view(&n, Some(&seen), started, now);
                let entry = rules::entry(&n, &agent, times);
                let change = Change::new(tx, &hub);
                change.node_changed(&n, &entry, drift_began)?;
                if raised {
                    change.node_fence_raised(&n, &report.token)?;
                }
                Ok(Ok(n.generation))
            })
            .await
            .map_err(Refusal::from)?;
        written.map_err(ReportRefusal::from)
    }

    /// Every `NODE_SWEEP`, tells the nodes whose agents went silent.
    pub async fn run_node_sweep(self: Arc<Self>) {
        loop {
            tokio::time::sleep(NODE_SWEEP).await;
            self.sweep_unreachable().await;
            self.sweep_activation_leases().await;
        }
    }

    /// Tells each node whose agent went silent for three of its intervals:
    /// a `node` event and the `node.unreachable` webhook, once per
    /// episode.
    async fn sweep_unreachable(self: &Arc<Self>) {
        let now = now_millis();
        let silent: Vec<NodeKey> = {
            let seen = self.agents.seen.held();
            let shown = self.agents.unreachable.held();
            seen.iter()
                .filter(|(k, s)| {
                    !shown.contains(*k)
                        && AgentStatus::of(Some(s), None, self.agents.started, now)
                            == AgentStatus::Unreachable
                })
                .map(|(k, _)| k.clone())
                .collect()
        };
        for key in silent {
            self.agents.unreachable.held().insert(key.clone());
            let (hub, times, started) =
                (self.hub.clone(), self.document_times(), self.agents.started);
            let seen = self.agents.seen_of(&key);
            let written = self
                .store
                .write(move |tx| {
                    let Some(n) = tx.node(&key.0, &key.1)? else {
                        return Ok(());
                    };
                    let now = now_millis();
                    let agent = agent_view(&n, seen.as_ref(), started, now);
                    let entry = rules::entry(&n, &agent, times);
                    let last_seen = seen.as_ref().map(|s| s.at);
                    Change::new(tx, &hub).node_unreachable(&n, entry, last_seen)
                })
                .await;
            if let Err(e) = written {
                tracing::warn!(error = %e, "cannot tell that a node's agent is unreachable");
            }
        }
    }
}

/// The agent part of a node's entry.
fn agent_view<'a>(
    n: &'a NodeRecord,
    seen: Option<&'a Seen>,
    started: Millis,
    now: Millis,
) -> AgentView<'a> {
    AgentView {
        token: n.tokens.last().map(String::as_str),
        seen,
        status: AgentStatus::of(seen, n.actual.as_ref(), started, now),
    }
}

fn entry_of(
    n: &NodeRecord,
    agents: &Agents,
    times: DocumentTimes,
    now: Millis,
) -> serde_json::Value {
    let seen = agents.seen_of(&(n.deployment.clone(), n.node.clone()));
    let agent = agent_view(n, seen.as_ref(), agents.started, now);
    rules::entry(n, &agent, times)
}

/// Binds (`add`) or unbinds a token of a node, in the token's write job.
/// The row is made at the first binding and kept after the last.
pub(super) fn bind_tx(tx: &Tx, binding: &NodeBinding, token: &str, add: bool) -> StoreResult<()> {
    let before = tx.node(&binding.deployment, &binding.node)?;
    let mut n = before
        .clone()
        .unwrap_or_else(|| NodeRecord::new(&binding.deployment, &binding.node));
    n.tokens.retain(|t| t != token);
    if add {
        n.tokens.push(token.to_string());
    } else {
        // A revoked token's activation is lost with it.
        super::activations::token_revoked(tx, &mut n, token, now_millis())?;
    }
    assert!(n.tokens.len() <= rules::MAX_TOKENS_PER_NODE);
    super::activations::put_node(tx, before.as_ref(), &n, &super::activations::no_blobs)
}

impl Engine {
    /// Forgets what berth saw of a node's agent once no token binds it.
    pub(super) fn unbound(&self, binding: &NodeBinding) {
        self.agents
            .forget(&(binding.deployment.clone(), binding.node.clone()));
    }
}

/// A deploy or destroy that succeeded: every bound node of the deployment
/// gets a steady document with the artifact the result names for it
/// (none for a destroy, or for a node the result does not have), in the
/// build's final transaction. Only a node whose document changes gets a
/// new generation and a `node` event.
pub(super) fn deployed_tx(
    tx: &Tx,
    hub: &Arc<Hub>,
    d: &mut DeploymentRecord,
    b: &BuildRecord,
    nodes: &[NodeOutcome],
) -> StoreResult<()> {
    let (now, times) = (now_millis(), hub.document_times);
    // Read only when a bound node needs it: most deployments have none,
    // and this runs in every build's final transaction.
    let mut rollout: Option<bool> = None;
    let blobs = super::activations::blobs_of(nodes);
    let mut changed = false;
    let mut after: Option<(String, String)> = None;
    loop {
        let page = tx.nodes(
            Some(&d.id),
            after.as_ref().map(|(a, b)| (a.as_str(), b.as_str())),
            PAGE,
        )?;
        let Some(last) = page.last() else {
            break;
        };
        after = Some((last.deployment.clone(), last.node.clone()));
        for before in page {
            if before.tokens.is_empty() {
                continue;
            }
            let is_rollout = match rollout {
                Some(known) => known,
                None => *rollout.insert(tx.rollout(b.id)?.is_some()),
            };
            let Some(artifact) = deployed_artifact(&before, b, is_rollout, nodes) else {
                continue;
            };
            let Some(desired) = rules::steady(&before, artifact.as_ref(), b.id, now) else {
                continue;
            };
            let mut n = before.clone();
            n.generation += 1;
            n.desired = Some(desired);
            n.drift = rules::drift(&n, now);
            super::activations::put_node(tx, Some(&before), &n, &blobs)?;
            changed = true;
            // The agent part from the stored report alone: what berth saw
            // since is the engine's, not this transaction's.
            let reported = n.actual.as_ref().map_or(now, |r| r.reported_at);
            let agent = agent_view(&n, None, reported, now);
            Change::new(tx, hub).node_changed_in(d, rules::entry(&n, &agent, times))?;
        }
    }
    if changed {
        tx.put_deployment(d)?;
    }
    Ok(())
}

/// What a bound node runs after build `b` succeeded: the artifact its
/// rollout activated or staged there; for a build without a rollout, the
/// result's (none for a destroy, or a node the result lacks). `None`: the
/// node's document stays (a rollout that did not change it; its result's
/// artifacts are not kept past a restart, its staged ones are).
fn deployed_artifact(
    n: &NodeRecord,
    b: &BuildRecord,
    rollout: bool,
    nodes: &[NodeOutcome],
) -> Option<Option<Artifact>> {
    if let Some(a) = n.activation.as_ref().filter(|a| a.build == b.id) {
        return Some(Some(a.artifact.clone()));
    }
    if let Some(s) = n.staged.as_ref().filter(|s| s.build == b.id) {
        return Some(Some(s.artifact.clone()));
    }
    match (b.kind, rollout) {
        (BuildKind::Destroy, _) => Some(None),
        (BuildKind::Deploy, true) => None,
        (BuildKind::Deploy, false) => Some(
            nodes
                .iter()
                .find(|o| o.name == n.node)
                .and_then(|o| o.artifact.clone()),
        ),
    }
}

/// Node rows a deploy reads at a time.
const PAGE: usize = 256;
