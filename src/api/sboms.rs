//! SBOM routes (spec api.md "SBOMs"): every node's status, and one node's
//! CycloneDX document rebuilt from its skeleton and the shared components.

use super::deployments::deployment_id;
use super::errors::{ApiError, Code};
use super::{Answer, Ctx, Reply, Request};
use crate::model::*;
use crate::store::{compress, Lookup, StoreError};

/// The media type of a CycloneDX JSON document.
const CYCLONEDX_JSON: &str = "application/vnd.cyclonedx+json";

/// `GET /v1/deployments/{id}/sboms`.
pub fn list(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let rx = ctx.engine.read()?;
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

/// Bytes of one piece of a streamed document: big enough that a 5 MB
/// document is some 80 hops to the blocking pool, small enough that a
/// reader that stops reading holds little.
const SBOM_PIECE_BYTES: usize = 64 * 1024;
/// Pieces made ahead of a slow reader: at most this many wait for the
/// socket (api.md "Fair shares").
const SBOM_STREAM_AHEAD: usize = 1;

/// What one piece's making needs, moved to the blocking pool and back.
struct Rebuild {
    snapshot: std::sync::Arc<crate::store::Rx>,
    unpacker: compress::Unpacker,
    pieces: crate::sbom::Pieces,
    hashes: Vec<[u8; 32]>,
}

impl Rebuild {
    fn next_piece(&mut self) -> Result<Option<Vec<u8>>, StoreError> {
        let max = crate::sbom::MAX_SBOM_BYTES as usize;
        let Rebuild {
            snapshot,
            unpacker,
            pieces,
            hashes,
        } = self;
        pieces.next_piece(|i, out| {
            snapshot
                .with_component(&hashes[i], |text| unpacker.unpack_into(text, max, out))?
                .ok_or_else(|| StoreError::corrupt("an SBOM refers to a missing component"))?
        })
    }
}

/// `GET /v1/deployments/{id}/sboms/{node}`: the document, JSON-value-equal
/// to the deployer's file, streamed in pieces from one snapshot of the
/// store. Each piece is made on the blocking pool only when the reader took
/// the one before (a document may be megabytes; a stalled reader holds a
/// piece and no thread).
pub async fn node(ctx: &Ctx, req: &Request) -> Result<Answer, ApiError> {
    let id = deployment_id(req)?;
    let node = req.param("node").to_string();
    let store = ctx.engine.reader();
    let rebuild = tokio::task::spawn_blocking(move || start_rebuild(&store, &id, &node))
        .await
        .map_err(|_| ApiError::internal())??;
    let (tx, body) =
        tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(SBOM_STREAM_AHEAD);
    tokio::spawn(send_pieces(rebuild, tx));
    use warp::Reply as _;
    let body = tokio_stream::wrappers::ReceiverStream::new(body);
    let mut response = warp::reply::stream(body).into_response();
    response.headers_mut().insert(
        "content-type",
        warp::http::HeaderValue::from_static(CYCLONEDX_JSON),
    );
    Ok(Answer::Stream(response))
}

/// A node's stored SBOM, ready to be made again piece by piece from one
/// read snapshot.
fn start_rebuild(store: &crate::store::Reader, id: &str, node: &str) -> Result<Rebuild, ApiError> {
    let rx = store.read()?;
    if rx.deployment(id)?.is_none() {
        return Err(ApiError::not_found("deployment"));
    }
    let sbom = rx
        .sbom_node(id, node)?
        .ok_or_else(|| ApiError::not_found("node with an SBOM"))?;
    if sbom.status != SbomStatus::Ready {
        return Err(ApiError::new(
            Code::NotFound,
            "this node has no SBOM; GET .../sboms says why",
        )
        .reason("sbom_unavailable"));
    }
    let corrupt = |what: &str| ApiError::from(StoreError::corrupt(what.to_string()));
    let mut unpacker = compress::Unpacker::new()?;
    let mut skeleton = Vec::new();
    unpacker.unpack_into(
        &sbom.skeleton,
        crate::sbom::MAX_SBOM_BYTES as usize,
        &mut skeleton,
    )?;
    let skeleton =
        String::from_utf8(skeleton).map_err(|_| corrupt("a stored SBOM skeleton is not text"))?;
    let pieces = crate::sbom::Pieces::new(
        &skeleton,
        sbom.had_components,
        sbom.hashes.len(),
        SBOM_PIECE_BYTES,
    )
    .ok_or_else(|| corrupt("a stored SBOM skeleton is not an object"))?;
    Ok(Rebuild {
        snapshot: std::sync::Arc::new(rx),
        unpacker,
        pieces,
        hashes: sbom.hashes,
    })
}

/// Makes each piece only once the channel has room for it: a reader that
/// does not read stops the making.
async fn send_pieces(
    mut rebuild: Rebuild,
    tx: tokio::sync::mpsc::Sender<Result<bytes::Bytes, std::io::Error>>,
) {
    loop {
        let Ok(permit) = tx.reserve().await else {
            return;
        };
        let made = tokio::task::spawn_blocking(move || {
            let piece = rebuild.next_piece();
            (rebuild, piece)
        })
        .await;
        let piece = match made {
            Ok((back, Ok(Some(piece)))) => {
                rebuild = back;
                piece
            }
            Ok((_, Ok(None))) => return,
            Ok((_, Err(e))) => {
                tracing::error!(error = %e, "an SBOM stream stopped");
                permit.send(Err(std::io::Error::other(e.to_string())));
                return;
            }
            Err(_) => {
                tracing::error!("an SBOM piece's task stopped");
                permit.send(Err(std::io::Error::other("an SBOM piece's task stopped")));
                return;
            }
        };
        permit.send(Ok(bytes::Bytes::from(piece)));
    }
}
