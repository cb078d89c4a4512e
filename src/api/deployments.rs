//! Deployment routes: list, read, submit, preview, delete.

use std::collections::HashMap;

use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::auth::Caller;
use super::errors::ApiError;
use super::idempotency::IdemWrite;
use super::{cursor, json_object, Ctx, Reply, Request};
use crate::derive::{CatalogEntry, Instance};
use crate::engine::{self, DestroyQueued, Mode, SubmitInput, Submitted};
use crate::model::*;
use crate::store::Lookup;

/// Most `id` parameters one list request may filter on.
pub const MAX_ID_FILTERS: usize = 200;
/// Page size bounds and default.
pub const MAX_PAGE: usize = 200;
pub const DEFAULT_PAGE: usize = 50;

pub fn page_limit(req: &Request) -> Result<usize, ApiError> {
    match req.query_one("limit") {
        None => Ok(DEFAULT_PAGE),
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_PAGE).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request("limit must be a whole number from 1 to 200")
                    .field("/query/limit", "range")
            }),
    }
}

/// The `{id}` of the path, checked (FR-002).
pub fn deployment_id(req: &Request) -> Result<String, ApiError> {
    let id = req.param("id");
    if !is_valid_deployment_id(id) {
        return Err(ApiError::bad_request(
            "a deployment id is a DNS label of at most 40 characters: a-z, 0-9 and inner -",
        )
        .field("/path/id", "deployment_id"));
    }
    Ok(id.to_string())
}

pub async fn list(ctx: &Ctx, req: &Request, caller: &Caller) -> Result<Reply, ApiError> {
    let limit = page_limit(req)?;
    let mut ids: Vec<&str> = req.query_all("id").collect();
    if ids.len() > MAX_ID_FILTERS {
        return Err(
            ApiError::bad_request("at most 200 id parameters").field("/query/id", "too_many")
        );
    }
    ids.sort_unstable();
    ids.dedup();
    let filter = if ids.is_empty() {
        String::new()
    } else {
        format!("ids={}", ids.join(","))
    };
    let after = match req.query_one("cursor") {
        Some(c) => Some(cursor::decode(
            &ctx.cursor_key,
            &caller.subject,
            &filter,
            c,
        )?),
        None => None,
    };
    let rx = ctx.engine.store.read()?;
    let mut records = if ids.is_empty() {
        rx.deployments_after(after.as_deref(), limit + 1)?
    } else {
        let mut found = Vec::new();
        for id in ids
            .iter()
            .filter(|id| after.as_deref().is_none_or(|a| **id > a))
        {
            if let Some(d) = rx.deployment(id)? {
                found.push(d);
                if found.len() > limit {
                    break;
                }
            }
        }
        found
    };
    let next_cursor = if records.len() > limit {
        records.truncate(limit);
        records
            .last()
            .map(|d| cursor::encode(&ctx.cursor_key, &caller.subject, &filter, &d.id))
    } else {
        None
    };
    let mut items = Vec::with_capacity(records.len());
    for d in &records {
        let last = d.last_build.map(|b| rx.build(b)).transpose()?.flatten();
        items.push(d.summary(last.as_ref()));
    }
    Ok(Reply::json(
        200,
        &serde_json::json!({"items": items, "next_cursor": next_cursor}),
    ))
}

#[derive(Serialize)]
struct DeployedView {
    build_id: String,
    configuration: Box<RawValue>,
    source: Source,
    finished_at: String,
}

#[derive(Serialize)]
struct ActionView {
    name: &'static str,
    enabled: bool,
    reason: Option<&'static str>,
}

#[derive(Serialize)]
struct DeploymentView {
    id: String,
    revision: u64,
    state: DeploymentState,
    suspended: bool,
    configuration: Box<RawValue>,
    source: Source,
    deployed: Option<DeployedView>,
    domain: Option<String>,
    instances: Vec<Instance>,
    deployed_instances: Vec<Instance>,
    actions: Vec<ActionView>,
    update_policy: UpdatePolicy,
    update: Value,
    last_build: Option<BuildSummary>,
    audit: Vec<Value>,
    event_cursor: String,
    created_at: String,
    updated_at: String,
}

/// The catalog of a source from its cached `describe`; empty (and logged)
/// when the deployer cannot describe it, so a read never fails on that.
async fn catalog_and_actions(
    ctx: &Ctx,
    source: &Source,
) -> (Vec<CatalogEntry>, HashMap<String, Vec<String>>) {
    match ctx.engine.describe(source).await {
        Ok(d) => (d.catalog.clone(), d.actions.clone().into_iter().collect()),
        Err(e) => {
            tracing::warn!(digest = %source.digest, reason = %e.describe(), "no describe for a stored source");
            (vec![], HashMap::new())
        }
    }
}

fn instances_of(text: &str, catalog: &[CatalogEntry]) -> Vec<Instance> {
    let config: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    crate::derive::instances(&config, catalog)
        .map(|(_, i)| i)
        .unwrap_or_default()
}

/// lifecycle.md "Actions": each action with its first disabling reason.
fn actions(
    d: &DeploymentRecord,
    deployed_actions: &HashMap<String, Vec<String>>,
) -> Vec<ActionView> {
    let after_failure = matches!(d.state(), DeploymentState::Failed);
    let supported = |name: &str| {
        d.deployed.as_ref().is_some_and(|dep| {
            deployed_actions
                .get(name)
                .is_some_and(|m| m.contains(&dep.method))
        })
    };
    let toggle = |name: &'static str, wrong_state: bool, state_reason: &'static str| {
        let reason = if d.deployed.is_none() {
            Some("not_deployed")
        } else if d.has_pending_build() {
            Some("build_pending")
        } else if wrong_state && !after_failure {
            Some(state_reason)
        } else if !supported(name) {
            Some("unsupported_by_revision")
        } else {
            None
        };
        ActionView {
            name,
            enabled: reason.is_none(),
            reason,
        }
    };
    vec![
        ActionView {
            name: "deploy",
            enabled: !d.suspended,
            reason: d.suspended.then_some("suspended"),
        },
        ActionView {
            name: "delete",
            enabled: true,
            reason: None,
        },
        toggle("suspend", d.suspended, "already_suspended"),
        toggle("resume", !d.suspended, "not_suspended"),
    ]
}

pub async fn view(ctx: &Ctx, d: &DeploymentRecord) -> Result<Reply, ApiError> {
    let last_build = d
        .last_build
        .map(|b| ctx.engine.store.read()?.build(b))
        .transpose()?
        .flatten();
    let (catalog, _) = catalog_and_actions(ctx, &d.snapshot.source).await;
    let instances = instances_of(&d.snapshot.configuration, &catalog);
    let (deployed_instances, deployed_actions) = match &d.deployed {
        Some(dep) => {
            let (catalog, actions) = catalog_and_actions(ctx, &dep.snapshot.source).await;
            (instances_of(&dep.snapshot.configuration, &catalog), actions)
        }
        None => (vec![], HashMap::new()),
    };
    let default = &ctx.engine.default_source;
    let available = d
        .deployed
        .as_ref()
        .is_some_and(|dep| dep.snapshot.source != *default);
    let v = DeploymentView {
        id: d.id.clone(),
        revision: d.revision,
        state: d.state(),
        suspended: d.suspended,
        configuration: raw_json(&d.snapshot.configuration),
        source: d.snapshot.source.clone(),
        deployed: d.deployed.as_ref().map(|dep| DeployedView {
            build_id: format_build_id(dep.build_id),
            configuration: raw_json(&dep.snapshot.configuration),
            source: dep.snapshot.source.clone(),
            finished_at: format_time(dep.finished_at),
        }),
        domain: d.domain.clone(),
        instances,
        deployed_instances,
        actions: actions(d, &deployed_actions),
        update_policy: d.update_policy.clone(),
        update: serde_json::json!({"available": available, "default_source": default, "last_automatic": null}),
        last_build: last_build.as_ref().map(BuildRecord::summary),
        audit: vec![],
        event_cursor: d.event_seq.to_string(),
        created_at: format_time(d.created_at),
        updated_at: format_time(d.updated_at),
    };
    Ok(Reply::json(200, &v).header("ETag", format!("\"{}\"", d.revision)))
}

pub async fn read(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let d = ctx
        .engine
        .store
        .read()?
        .deployment(&id)?
        .ok_or_else(|| ApiError::not_found("deployment"))?;
    view(ctx, &d).await
}

const SUBMIT_FIELDS: &[&str] = &[
    "configuration",
    "source",
    "mode",
    "keep_deployed_revision",
    "update_policy",
];
const PREVIEW_FIELDS: &[&str] = &["configuration", "source", "keep_deployed_revision"];

/// Parses a submit or preview body; `configuration` keeps its exact text.
fn parse_submit(req: &Request, allowed: &[&str]) -> Result<SubmitInput, ApiError> {
    if req.body.is_empty() {
        return Err(
            ApiError::bad_request("a JSON body is required").field("/configuration", "required")
        );
    }
    let map = json_object(&req.body, allowed)?;
    let configuration = match map.get("configuration") {
        Some(c @ Value::Object(_)) => c.clone(),
        Some(_) => {
            return Err(ApiError::bad_request("configuration must be a JSON object")
                .field("/configuration", "type"))
        }
        None => {
            return Err(ApiError::bad_request("configuration is required")
                .field("/configuration", "required"))
        }
    };
    let raw: HashMap<String, Box<RawValue>> =
        serde_json::from_slice(&req.body).map_err(|_| ApiError::internal())?;
    let configuration_text = raw
        .get("configuration")
        .map(|r| r.get().to_string())
        .unwrap_or_default();
    let source = match map.get("source") {
        None | Some(Value::Null) => None,
        Some(s) => Some(serde_json::from_value::<Source>(s.clone()).map_err(|_| {
            ApiError::bad_request("source must be {url, rev, digest}, all strings")
                .field("/source", "type")
        })?),
    };
    let mode = match map.get("mode") {
        None | Some(Value::Null) => Mode::Replace,
        Some(Value::String(s)) if s == "replace" => Mode::Replace,
        Some(Value::String(s)) if s == "enqueue" => Mode::Enqueue,
        Some(_) => {
            return Err(
                ApiError::bad_request("mode must be \"replace\" or \"enqueue\"")
                    .field("/mode", "enum"),
            )
        }
    };
    let keep_deployed_revision = match map.get("keep_deployed_revision") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(
                ApiError::bad_request("keep_deployed_revision must be a boolean")
                    .field("/keep_deployed_revision", "type"),
            )
        }
    };
    let update_policy = match map.get("update_policy") {
        None | Some(Value::Null) => None,
        Some(p) => Some(parse_policy(p, "/update_policy")?),
    };
    Ok(SubmitInput {
        configuration_text,
        configuration,
        source,
        mode,
        keep_deployed_revision,
        update_policy,
    })
}

/// An update policy (lifecycle.md "Update policies"), checked field by field.
pub fn parse_policy(v: &Value, at: &str) -> Result<UpdatePolicy, ApiError> {
    let bad = |field: &str, code: &str, message: &str| {
        ApiError::bad_request(message.to_string()).field(format!("{at}{field}"), code)
    };
    let policy: UpdatePolicy = serde_json::from_value(v.clone())
        .map_err(|_| bad("", "invalid", "update_policy must be manual, automatic, or a window with frequency, start, duration_minutes and time_zone"))?;
    if let UpdatePolicy::Window {
        frequency,
        day,
        start,
        duration_minutes,
        time_zone,
    } = &policy
    {
        let day_ok = match frequency {
            Frequency::Daily => day.is_none(),
            Frequency::Weekly => day.is_some_and(|d| (1..=7).contains(&d)),
            Frequency::Monthly => day.is_some_and(|d| (1..=31).contains(&d)),
        };
        if !day_ok {
            return Err(bad(
                "/day",
                "range",
                "day is absent for daily, 1-7 for weekly (Monday = 1), 1-31 for monthly",
            ));
        }
        let hm: Vec<&str> = start.split(':').collect();
        let start_ok = hm.len() == 2
            && hm
                .iter()
                .all(|p| p.len() == 2 && p.bytes().all(|c| c.is_ascii_digit()))
            && hm[0].parse::<u8>().is_ok_and(|h| h < 24)
            && hm[1].parse::<u8>().is_ok_and(|m| m < 60);
        if !start_ok {
            return Err(bad("/start", "format", "start is a local time HH:MM"));
        }
        if !(15..=1440).contains(duration_minutes) {
            return Err(bad(
                "/duration_minutes",
                "range",
                "duration_minutes is 15 to 1440",
            ));
        }
        let tz_ok = !time_zone.is_empty()
            && time_zone.len() <= 64
            && time_zone
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"_+-/".contains(&c));
        if !tz_ok {
            return Err(bad(
                "/time_zone",
                "time_zone",
                "time_zone must be an IANA zone name",
            ));
        }
    }
    Ok(policy)
}

pub async fn submit(ctx: &Ctx, req: &Request, idem: Option<IdemWrite>) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let input = parse_submit(req, SUBMIT_FIELDS)?;
    let record = idem.map(|w| w.recorder(submitted_reply));
    let submitted = ctx.engine.submit(&id, input, record).await?;
    Ok(submitted_reply(&submitted))
}

/// 202 with the queued build's id and the deployment after the submit.
fn submitted_reply(s: &Submitted) -> Reply {
    Reply::json(
        202,
        &serde_json::json!({"build_id": format_build_id(s.build.id), "deployment": s.deployment}),
    )
}

/// 202 with the queued destroy's id.
fn destroy_queued_reply(q: &DestroyQueued) -> Reply {
    Reply::json(
        202,
        &serde_json::json!({"status": "queued", "build_id": format_build_id(q.build_id)}),
    )
}

pub async fn preview(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let input = parse_submit(req, PREVIEW_FIELDS)?;
    let nodes = ctx.engine.preview(&id, input).await?;
    Ok(Reply::json(200, &serde_json::json!({"nodes": nodes})))
}

pub async fn delete(ctx: &Ctx, req: &Request, idem: Option<IdemWrite>) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let callback = if req.body.is_empty() {
        None
    } else {
        let map = json_object(&req.body, &["callback"])?;
        match map.get("callback") {
            None | Some(Value::Null) => None,
            Some(Value::String(url)) => {
                let parsed = reqwest::Url::parse(url)
                    .ok()
                    .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some());
                if parsed.is_none() {
                    return Err(ApiError::bad_request("callback must be an http(s) URL")
                        .field("/callback", "format"));
                }
                if !engine::origin_allowed(url, &ctx.engine.settings.callback_origin) {
                    return Err(ApiError::bad_request(
                        "the callback's origin is not allowed (see --callback-origin)",
                    )
                    .field("/callback", "callback_origin_not_allowed"));
                }
                Some(url.clone())
            }
            Some(_) => {
                return Err(
                    ApiError::bad_request("callback must be a string").field("/callback", "type")
                )
            }
        }
    };
    let record = idem.map(|w| w.recorder(destroy_queued_reply));
    let queued = ctx.engine.delete(&id, callback, record).await?;
    Ok(destroy_queued_reply(&queued))
}
