//! Per-node SBOMs (spec sbom.md): what a deploy that succeeded, or a
//! destroy that succeeded, does to a deployment's SBOMs and to the shared,
//! reference-counted components. Called only by `transition::Change::finish`,
//! inside the transaction that marks the build succeeded; every change sends
//! an `sbom` event on the deployment channel.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::outcome::{NodeOutcome, SbomOutcome};
use crate::events::{self, Hub};
use crate::model::*;
use crate::store::{Lookup, StoreResult, Tx};

/// The reason of a node no deploy has given an SBOM yet.
pub const NO_SBOM_YET: &str = "no deploy gave an SBOM yet";

/// A deploy succeeded: each node listed gets its new SBOM or reason, an
/// unchanged node keeps its own, a node no longer listed loses its SBOM.
pub fn apply(
    tx: &Tx,
    hub: &Arc<Hub>,
    d: &mut DeploymentRecord,
    build_id: BuildId,
    nodes: &[NodeOutcome],
    now: Millis,
) -> StoreResult<()> {
    let mut existing: BTreeMap<String, NodeSbom> = tx.sbom_nodes(&d.id)?.into_iter().collect();
    for node in nodes {
        let old = existing.remove(&node.name);
        let new = match &node.sbom {
            SbomOutcome::Ready(prepared) => {
                // References first, then the old ones dropped: a component
                // both lists share never reaches zero in between.
                for (hash, bytes) in &prepared.components {
                    tx.ref_component(hash, || bytes.compressed())?;
                }
                NodeSbom {
                    status: SbomStatus::Ready,
                    build_id: Some(build_id),
                    at: now,
                    reason: None,
                    skeleton: prepared.skeleton.clone(),
                    had_components: prepared.had_components,
                    hashes: prepared.components.iter().map(|(h, _)| *h).collect(),
                }
            }
            SbomOutcome::Unavailable(reason) => unavailable(Some(build_id), reason, now),
            // Unchanged: the stored SBOM and its build id stay as they are.
            SbomOutcome::Kept if old.is_some() => continue,
            SbomOutcome::Kept => unavailable(None, NO_SBOM_YET, now),
        };
        if let Some(old) = &old {
            unref_all(tx, old)?;
        }
        tx.put_sbom_node(&d.id, &node.name, &new)?;
        event(tx, hub, d, &node.name, Some(&new), now)?;
    }
    for (name, gone) in existing {
        unref_all(tx, &gone)?;
        tx.remove_sbom_node(&d.id, &name)?;
        event(tx, hub, d, &name, None, now)?;
    }
    Ok(())
}

/// A destroy succeeded: the deployment has no SBOMs, and components no
/// node uses any more are gone.
pub fn clear(tx: &Tx, hub: &Arc<Hub>, d: &mut DeploymentRecord, now: Millis) -> StoreResult<()> {
    for (name, gone) in tx.sbom_nodes(&d.id)? {
        unref_all(tx, &gone)?;
        tx.remove_sbom_node(&d.id, &name)?;
        event(tx, hub, d, &name, None, now)?;
    }
    Ok(())
}

fn unavailable(build_id: Option<BuildId>, reason: &str, now: Millis) -> NodeSbom {
    NodeSbom {
        status: SbomStatus::Unavailable,
        build_id,
        at: now,
        reason: Some(reason.to_string()),
        skeleton: Vec::new(),
        had_components: false,
        hashes: Vec::new(),
    }
}

fn unref_all(tx: &Tx, old: &NodeSbom) -> StoreResult<()> {
    for hash in &old.hashes {
        tx.unref_component(hash)?;
    }
    Ok(())
}

/// `sbom` on the deployment channel: `{"node", "status", "build_id"}`;
/// status `removed` when the node lost its SBOM.
fn event(
    tx: &Tx,
    hub: &Arc<Hub>,
    d: &mut DeploymentRecord,
    node: &str,
    sbom: Option<&NodeSbom>,
    now: Millis,
) -> StoreResult<()> {
    let data = serde_json::json!({
        "node": node,
        "status": sbom.map_or("removed", |s| match s.status {
            SbomStatus::Ready => "ready",
            SbomStatus::Unavailable => "unavailable",
        }),
        "build_id": sbom.and_then(|s| s.build_id).map(format_build_id),
    });
    events::deployment_event(tx, hub, d, "sbom", data.to_string(), now)
}
