//! Public derivation routes (FR-004): they read only the request, so they
//! need no token. A malformed shape is a 400 with its pointer, never a 500.

use serde_json::{json, Value};

use super::errors::ApiError;
use super::{json_object, Ctx, Reply, Request};
use crate::derive::{self, DeriveError, Rename};

/// Most renames one request may carry.
pub const MAX_RENAMES: usize = 1000;

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
    let map = json_object(&req.body, &["configuration"])?;
    let config = object_member(&map, "configuration", false)?.unwrap_or(&Value::Null);
    let catalog = default_catalog(ctx).await?;
    let (domain, instances) =
        derive::instances(config, &catalog).map_err(|e| shape_error(e.under("/configuration")))?;
    Ok(Reply::json(
        200,
        &json!({"domain": domain, "instances": instances}),
    ))
}

pub fn applications(req: &Request) -> Result<Reply, ApiError> {
    let map = json_object(&req.body, &["draft", "deployed", "renames"])?;
    let draft = object_member(&map, "draft", false)?.unwrap_or(&Value::Null);
    let deployed = object_member(&map, "deployed", true)?;
    let renames = renames(&map)?;
    let result = derive::applications(draft, deployed, &renames).map_err(shape_error)?;
    Ok(Reply::json(200, &result))
}

pub async fn sections(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let map = json_object(&req.body, &["configuration", "deployed", "renames"])?;
    let config = object_member(&map, "configuration", false)?.unwrap_or(&Value::Null);
    let deployed = object_member(&map, "deployed", true)?;
    let renames = renames(&map)?;
    let catalog = default_catalog(ctx).await?;
    let sections = derive::sections(config, deployed, &renames, &catalog).map_err(shape_error)?;
    Ok(Reply::json(200, &json!({"sections": sections})))
}
