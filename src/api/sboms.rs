//! SBOM routes (spec api.md "SBOMs"): every node's status, and one node's
//! CycloneDX document rebuilt from its skeleton and the shared components.

use super::deployments::deployment_id;
use super::errors::{ApiError, Code};
use super::{Ctx, Reply, Request};
use crate::model::*;
use crate::store::{compress, Lookup, StoreError};

/// The media type of a CycloneDX JSON document.
const CYCLONEDX_JSON: &str = "application/vnd.cyclonedx+json";

/// `GET /v1/deployments/{id}/sboms`.
pub fn list(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let rx = ctx.engine.store.read()?;
    if rx.deployment(&id)?.is_none() {
        return Err(ApiError::not_found("deployment"));
    }
    let nodes: Vec<NodeSbomView> = rx
        .sbom_nodes(&id)?
        .iter()
        .map(|(name, s)| s.view(name))
        .collect();
    Ok(Reply::json(200, &serde_json::json!({ "nodes": nodes })))
}

/// `GET /v1/deployments/{id}/sboms/{node}`: the document, JSON-value-equal
/// to the deployer's file. Decompressing and parsing run off the async
/// workers (a document may be megabytes).
pub async fn node(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let node = req.param("node").to_string();
    let store = ctx.engine.store.clone();
    let rebuilt = tokio::task::spawn_blocking(move || -> Result<Vec<u8>, ApiError> {
        let rx = store.read()?;
        if rx.deployment(&id)?.is_none() {
            return Err(ApiError::not_found("deployment"));
        }
        let sbom = rx
            .sbom_node(&id, &node)?
            .ok_or_else(|| ApiError::not_found("node with an SBOM"))?;
        if sbom.status != SbomStatus::Ready {
            return Err(ApiError::new(
                Code::NotFound,
                "this node has no SBOM; GET .../sboms says why",
            )
            .reason("sbom_unavailable"));
        }
        let corrupt = |what: &str| ApiError::from(StoreError::corrupt(what.to_string()));
        let max = crate::sbom::MAX_SBOM_BYTES as usize;
        let mut unpacker = compress::Unpacker::new()?;
        let mut skeleton = Vec::new();
        unpacker.unpack_into(&sbom.skeleton, max, &mut skeleton)?;
        let skeleton = String::from_utf8(skeleton)
            .map_err(|_| corrupt("a stored SBOM skeleton is not text"))?;
        // Stored components are typically a few hundred bytes each; the
        // guess never reserves more than the largest document berth takes.
        let hint = sbom.hashes.len().saturating_mul(512).min(max);
        let components = &sbom.hashes;
        crate::sbom::rebuild_text(
            &skeleton,
            sbom.had_components,
            components.len(),
            hint,
            |i, out| {
                rx.with_component(&components[i], |text| unpacker.unpack_into(text, max, out))?
                    .ok_or_else(|| corrupt("an SBOM refers to a missing component"))?
                    .map_err(ApiError::from)
            },
        )?
        .ok_or_else(|| corrupt("a stored SBOM skeleton is not an object"))
    })
    .await
    .map_err(|_| ApiError::internal())??;
    Ok(Reply::text(200, CYCLONEDX_JSON, rebuilt))
}
