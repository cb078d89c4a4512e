//! Public derivation routes (FR-004): they read only the request, so they
//! need no token. A malformed shape is a 400 with its pointer, never a 500.

use serde_json::{json, Value};

use super::errors::{ApiError, Code};
use super::{json_object, Ctx, Reply, Request};
use crate::derive::{self, DeriveError, Rename};

/// Most renames one request may carry.
pub const MAX_RENAMES: usize = 1000;
/// Derivations running at once at most: a 1 MB body is up to tens of
/// milliseconds of CPU, run on the blocking pool so health checks and event
/// streams never wait behind it, and bounded so a few public requests
/// cannot take every core.
pub const MAX_DERIVATIONS: usize = 2;
/// How long a derivation waits for a free slot before answering 503.
const DERIVATION_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The slots of `MAX_DERIVATIONS`.
pub struct Derivations(std::sync::Arc<tokio::sync::Semaphore>);

impl Default for Derivations {
    fn default() -> Self {
        Derivations(std::sync::Arc::new(tokio::sync::Semaphore::new(
            MAX_DERIVATIONS,
        )))
    }
}

/// Runs a derivation off the async workers, in a slot that stays taken
/// until the work ends (also when the caller has left).
async fn off_runtime<T: Send + 'static>(
    ctx: &Ctx,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let busy = || ApiError::new(Code::Unavailable, "every derivation slot is busy").retry_after(1);
    let slot = tokio::time::timeout(DERIVATION_WAIT, ctx.derivations.0.clone().acquire_owned())
        .await
        .map_err(|_| busy())?
        .map_err(|_| busy())?;
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        work()
    })
    .await
    .map_err(|_| ApiError::internal())?
}

fn shape_error(e: DeriveError) -> ApiError {
    ApiError::bad_request(e.message).field(e.pointer, e.rule)
}

fn object_member<'a>(
    map: &'a serde_json::Map<String, Value>,
    name: &str,
    nullable: bool,
) -> Result<Option<&'a Value>, ApiError> {
    match map.get(name) {
        Some(v @ Value::Object(_)) => Ok(Some(v)),
        None | Some(Value::Null) if nullable => Ok(None),
        None => Err(ApiError::bad_request(format!("{name} is required"))
            .field(format!("/{name}"), "required")),
        Some(_) => Err(
            ApiError::bad_request(format!("{name} must be a JSON object"))
                .field(format!("/{name}"), "type"),
        ),
    }
}

fn renames(map: &serde_json::Map<String, Value>) -> Result<Vec<Rename>, ApiError> {
    let Some(v) = map.get("renames").filter(|v| !v.is_null()) else {
        return Ok(vec![]);
    };
    if v.as_array().is_some_and(|a| a.len() > MAX_RENAMES) {
        return Err(ApiError::bad_request("at most 1,000 renames").field("/renames", "too_many"));
    }
    serde_json::from_value(v.clone()).map_err(|_| {
        ApiError::bad_request("renames must be a list of {from, to} JSON pointers")
            .field("/renames", "type")
    })
}

async fn default_catalog(ctx: &Ctx) -> Result<Vec<derive::CatalogEntry>, ApiError> {
    Ok(ctx
        .engine
        .describe(&ctx.engine.default_source)
        .await?
        .catalog
        .clone())
}

pub async fn instances(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let catalog = default_catalog(ctx).await?;
    let body = req.body.clone();
    off_runtime(ctx, move || {
        let map = json_object(&body, &["configuration"])?;
        let config = object_member(&map, "configuration", false)?.unwrap_or(&Value::Null);
        let (domain, instances) = derive::instances(config, &catalog)
            .map_err(|e| shape_error(e.under("/configuration")))?;
        Ok(Reply::json(
            200,
            &json!({"domain": domain, "instances": instances}),
        ))
    })
    .await
}

pub async fn applications(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let body = req.body.clone();
    off_runtime(ctx, move || {
        let map = json_object(&body, &["draft", "deployed", "renames"])?;
        let draft = object_member(&map, "draft", false)?.unwrap_or(&Value::Null);
        let deployed = object_member(&map, "deployed", true)?;
        let renames = renames(&map)?;
        let result = derive::applications(draft, deployed, &renames).map_err(shape_error)?;
        Ok(Reply::json(200, &result))
    })
    .await
}

pub async fn sections(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let catalog = default_catalog(ctx).await?;
    let body = req.body.clone();
    off_runtime(ctx, move || {
        let map = json_object(&body, &["configuration", "deployed", "renames"])?;
        let config = object_member(&map, "configuration", false)?.unwrap_or(&Value::Null);
        let deployed = object_member(&map, "deployed", true)?;
        let renames = renames(&map)?;
        let sections =
            derive::sections(config, deployed, &renames, &catalog).map_err(shape_error)?;
        Ok(Reply::json(200, &json!({"sections": sections})))
    })
    .await
}
