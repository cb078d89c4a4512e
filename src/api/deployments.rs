//! Deployment routes: list, read, submit, preview, delete.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::auth::Caller;
use super::errors::ApiError;
use super::idempotency::Write;
use super::{cursor, json_object, Ctx, Reply, Request};
use crate::derive::{CatalogEntry, Instance};
use crate::engine::actions::ActionQueued;
use crate::engine::deployer::Described;
use crate::engine::updates::PolicySet;
use crate::engine::{self, DestroyQueued, Mode, SubmitInput, Submitted};
use crate::model::*;
use crate::store::Lookup;
use crate::store::StoreError;

/// Most `id` parameters one list request may filter on.
pub const MAX_ID_FILTERS: usize = 200;
/// The `{id}` of the path, checked (FR-002).
pub fn deployment_id(req: &Request) -> Result<String, ApiError> {
    req.deployment_id()
}

pub use super::invalid_deployment_id;

/// Deployments one list request looks at, at most, to fill a page for a
/// caller the callback filters (each costs a `read` question, cached):
/// a caller who may read none of this many in a row gets the page so far.
pub const MAX_LIST_SCAN: usize = 10_000;

pub async fn list(ctx: &Ctx, req: &Request, caller: &Caller) -> Result<Reply, ApiError> {
    let limit = super::cursor::page_limit(req)?;
    let ids = id_filter(req)?;
    // The cursor is bound to the filter: an unambiguous encoding of it (a
    // JSON list), so one filter's cursor never passes for another's.
    let filter = if ids.is_empty() {
        String::new()
    } else {
        serde_json::to_string(&ids).map_err(|_| ApiError::internal())?
    };
    let after = match req.query_one("cursor") {
        Some(c) => Some(cursor::decode(
            &ctx.cursor_key,
            &caller.identity(),
            &filter,
            c,
        )?),
        None => None,
    };
    let rx = ctx.engine.read()?;
    let (mut allowed, scanned) = readable_page(ctx, caller, &rx, &ids, after, limit).await?;
    let next_cursor = if allowed.len() > limit {
        allowed.truncate(limit);
        allowed
            .last()
            .map(|d| cursor::encode(&ctx.cursor_key, &caller.identity(), &filter, &d.id))
    } else if scanned >= MAX_LIST_SCAN {
        // The scan's bound: go on after the last item shown (never after a
        // hidden one); a page that showed none ends the list here.
        allowed
            .last()
            .map(|d| cursor::encode(&ctx.cursor_key, &caller.identity(), &filter, &d.id))
    } else {
        None
    };
    let mut items = Vec::with_capacity(allowed.len());
    for d in &allowed {
        let last = d.last_build.map(|b| rx.build(b)).transpose()?.flatten();
        items.push(d.summary(last.as_ref()));
    }
    Ok(Reply::json(
        200,
        &serde_json::json!({"items": items, "next_cursor": next_cursor}),
    ))
}

/// The list's `id` filter: at most `MAX_ID_FILTERS` valid ids, sorted and
/// without repeats.
fn id_filter(req: &Request) -> Result<Vec<&str>, ApiError> {
    let mut ids: Vec<&str> = req.query_all("id").collect();
    if ids.len() > MAX_ID_FILTERS {
        return Err(
            ApiError::bad_request("at most 200 id parameters").field("/query/id", "too_many")
        );
    }
    if ids.iter().any(|id| !is_valid_deployment_id(id)) {
        return Err(ApiError::bad_request(
            "each id is a deployment id: a DNS label of at most 40 characters",
        )
        .field("/query/id", "deployment_id"));
    }
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// Up to `limit + 1` deployments after `after` that `caller` may read,
/// and how many were scanned (at most `MAX_LIST_SCAN`). api.md
/// "Pagination": a cursor names only the last item its caller was shown,
/// so items are filtered through `read` *before* the page and its cursor
/// are cut: neither a hidden id nor the existence of a guessed one leaks
/// through `next_cursor`.
async fn readable_page(
    ctx: &Ctx,
    caller: &Caller,
    rx: &crate::store::Rx,
    ids: &[&str],
    after: Option<String>,
    limit: usize,
) -> Result<(Vec<DeploymentRecord>, usize), ApiError> {
    let mut allowed: Vec<DeploymentRecord> = Vec::with_capacity(limit + 1);
    let mut position = after;
    let mut scanned = 0usize;
    'scan: while allowed.len() <= limit {
        let batch = match ids.is_empty() {
            true => rx.deployments_after(position.as_deref(), limit + 1)?,
            false => named_after(rx, ids, position.as_deref(), limit)?,
        };
        if batch.is_empty() {
            break;
        }
        for d in batch {
            position = Some(d.id.clone());
            scanned += 1;
            let path = format!("/v1/deployments/{}", d.id);
            if super::auth::may_read(&ctx.authz, caller, &d.id, &path).await {
                allowed.push(d);
                if allowed.len() > limit {
                    break 'scan;
                }
            }
            if scanned >= MAX_LIST_SCAN {
                break 'scan;
            }
        }
    }
    Ok((allowed, scanned))
}

/// Of the deployments `ids` names (sorted), up to `limit + 1` that exist
/// after `after`.
fn named_after(
    rx: &crate::store::Rx,
    ids: &[&str],
    after: Option<&str>,
    limit: usize,
) -> Result<Vec<DeploymentRecord>, ApiError> {
    let mut found = Vec::new();
    for id in ids.iter().filter(|id| after.is_none_or(|a| **id > a)) {
        if let Some(d) = rx.deployment(id)? {
            found.push(d);
            if found.len() > limit {
                break;
            }
        }
    }
    Ok(found)
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
    auto_rollback: bool,
    last_build: Option<BuildSummary>,
    audit: Vec<Value>,
    event_cursor: String,
    created_at: String,
    updated_at: String,
    /// The deployment read (GET) only: its work states (workers.md), its
    /// rollout policy and its newest rollout (rollouts.md).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    read_only: Option<serde_json::Map<String, Value>>,
}

/// What a deployment's view shows besides its record.
pub struct Shown {
    /// A retained succeeded deploy build before the deployed one exists.
    pub earlier_build: bool,
    /// The rollout of its running build (the rollout actions' reasons).
    pub rollout: Option<RolloutRecord>,
    /// A freeze holds it (the actions' `frozen` reasons).
    pub frozen: bool,
    /// Fields only the read (GET) shows.
    pub read_only: Option<serde_json::Map<String, Value>>,
}

/// What a read shows of the sources of a deployment, from their cached
/// `describe` (taken before any transaction, so the answer can be rendered
/// inside one, for an idempotent replay).
pub struct SourceFacts {
    /// The describe of each source, by digest; a source the deployer cannot
    /// describe is absent (its catalog then is empty, and logged).
    described: HashMap<String, Arc<Described>>,
    /// The self-pinned default source, if any.
    default_source: Option<Source>,
}

impl SourceFacts {
    /// The describe of the deployment's sources (last submitted, deployed).
    pub async fn of(ctx: &Ctx, d: &DeploymentRecord) -> SourceFacts {
        let mut described = HashMap::new();
        let deployed = d.deployed.as_ref().map(|x| &x.snapshot.source);
        for source in std::iter::once(&d.snapshot.source).chain(deployed) {
            if described.contains_key(&source.digest) {
                continue;
            }
            match ctx.engine.describe(source).await {
                Ok(found) => {
                    described.insert(source.digest.clone(), found);
                }
                Err(e) => {
                    tracing::warn!(digest = %source.digest, reason = %e.describe(), "no describe for a stored source");
                }
            }
        }
        SourceFacts {
            described,
            default_source: ctx.engine.self_pin().cloned(),
        }
    }

    fn catalog(&self, source: &Source) -> &[CatalogEntry] {
        self.described
            .get(&source.digest)
            .map_or(&[], |d| d.catalog.as_slice())
    }
}

/// The instances a stored configuration derives to. The text was valid
/// JSON when stored and passed the shape check derive makes, so either
/// failing now is damage to the store: an error, never an empty list.
fn instances_of(text: &str, catalog: &[CatalogEntry]) -> Result<Vec<Instance>, StoreError> {
    let config: Value = serde_json::from_str(text)
        .map_err(|_| StoreError::damaged_snapshot(crate::model::DamagedSnapshot))?;
    crate::derive::instances(&config, catalog)
        .map(|(_, i)| i)
        .map_err(|e| {
            tracing::error!(pointer = %e.pointer, "a stored configuration no longer derives");
            StoreError::corrupt("a stored configuration no longer derives its instances")
        })
}

/// `update.held_back`: the digest a rollback holds back from automatic
/// updates, while it is still the default source (lifecycle.md "Rollback").
fn held_back(last_try: Option<&UpdateTry>, default: Option<&Source>) -> Option<String> {
    let t = last_try?;
    let holds = t.result == TryResult::RolledBack && t.blocks && Some(&t.source) == default;
    holds.then(|| t.source.digest.clone())
}

/// The deployment read (api.md), with `ETag: "<revision>"`.
pub fn render_view(
    facts: &SourceFacts,
    d: &DeploymentRecord,
    last_build: Option<&BuildRecord>,
    last_try: Option<&UpdateTry>,
    audit: &[crate::audit::Event],
    shown: Shown,
) -> Result<Reply, StoreError> {
    let Shown {
        earlier_build,
        rollout,
        frozen,
        read_only,
    } = shown;
    let instances = instances_of(&d.snapshot.configuration, facts.catalog(&d.snapshot.source))?;
    let deployed_instances = match &d.deployed {
        Some(dep) => instances_of(
            &dep.snapshot.configuration,
            facts.catalog(&dep.snapshot.source),
        )?,
        None => Vec::new(),
    };
    let damaged = StoreError::damaged_snapshot;
    let actions = action_views(facts, d, earlier_build, rollout.as_ref(), frozen);
    let default = facts.default_source.as_ref();
    let available = match (default, &d.deployed) {
        (Some(default), Some(dep)) => dep.snapshot.source != *default,
        _ => false,
    };
    let v = DeploymentView {
        id: d.id.clone(),
        revision: d.revision,
        state: d.state(),
        suspended: d.suspended,
        configuration: raw_json(&d.snapshot.configuration).map_err(damaged)?,
        source: d.snapshot.source.clone(),
        deployed: match &d.deployed {
            Some(dep) => Some(DeployedView {
                build_id: format_build_id(dep.build_id),
                configuration: raw_json(&dep.snapshot.configuration).map_err(damaged)?,
                source: dep.snapshot.source.clone(),
                finished_at: format_time(dep.finished_at),
            }),
            None => None,
        },
        domain: d.domain.clone(),
        instances,
        deployed_instances,
        actions,
        update_policy: d.update_policy.clone(),
        update: serde_json::json!({
            "available": available,
            "default_source": default,
            "last_automatic": last_try.map(UpdateTry::view),
            "held_back": held_back(last_try, default),
        }),
        auto_rollback: d.auto_rollback,
        last_build: last_build.map(BuildRecord::summary),
        audit: audit.iter().map(super::audit::view).collect(),
        event_cursor: d.event_seq.to_string(),
        created_at: format_time(d.created_at),
        updated_at: format_time(d.updated_at),
        read_only,
    };
    Ok(Reply::json(200, &v).header("ETag", format!("\"{}\"", d.revision)))
}

/// The actions a client may offer now, each with why not when it may not.
fn action_views(
    facts: &SourceFacts,
    d: &DeploymentRecord,
    earlier_build: bool,
    rollout: Option<&RolloutRecord>,
    frozen: bool,
) -> Vec<ActionView> {
    let supported = |name: &str| {
        d.deployed.as_ref().is_some_and(|dep| {
            facts
                .described
                .get(&dep.snapshot.source.digest)
                .is_some_and(|described| described.supports(name, &dep.method))
        })
    };
    let facts_of_actions = engine::actions::Facts {
        supported,
        earlier_build,
        rollout: rollout.map(|r| &r.rollout),
        frozen,
    };
    engine::actions::list(d, &facts_of_actions)
        .into_iter()
        .map(|a| ActionView {
            name: a.name,
            enabled: a.reason.is_none(),
            reason: a.reason.map(|r| r.code()),
        })
        .collect()
}

/// What only the deployment read shows, and the running build's rollout.
fn read_extras(rx: &crate::store::Rx, d: &DeploymentRecord) -> Result<Shown, StoreError> {
    let running = d.running.map(|b| rx.rollout(b)).transpose()?.flatten();
    let newest = match &running {
        Some(r) => Some(r.clone()),
        None => d.last_build.map(|b| rx.rollout(b)).transpose()?.flatten(),
    };
    let policy = match rx.rollout_policy(&d.id)? {
        Some(text) => serde_json::from_str(&text)
            .map_err(|_| StoreError::corrupt("a stored rollout policy is not JSON"))?,
        None => serde_json::json!({}),
    };
    let mut read_only = serde_json::Map::new();
    read_only.insert(
        "work_state".into(),
        work_state_view(rx.work_states(&d.id)?.as_ref()),
    );
    read_only.insert("rollout_policy".into(), policy);
    read_only.insert(
        "rollout".into(),
        newest
            .as_ref()
            .map_or(Value::Null, engine::rollouts::summary),
    );
    let now = now_millis();
    let scope = engine::freeze::Scope::Deployment(d.id.clone());
    let own = rx.freeze(&d.id)?;
    read_only.insert(
        "freeze".into(),
        own.as_ref()
            .map_or(Value::Null, |f| engine::freeze::view(&scope, f, now)),
    );
    let held = engine::freeze::holding(rx, &d.id, now)?;
    read_only.insert("frozen".into(), engine::freeze::frozen_view(&held, now));
    Ok(Shown {
        earlier_build: rx.rollback_target(d)?.is_some(),
        rollout: running,
        frozen: held.is_some(),
        read_only: Some(read_only),
    })
}

/// A deployment's work states as its read shows them.
fn work_state_view(w: Option<&WorkStates>) -> Value {
    let one = |r: &WorkStateRef| {
        serde_json::json!({
            "digest": r.digest,
            "size": r.size,
            "build_id": r.build.map(format_build_id),
            "stored_at": format_time(r.stored_at),
        })
    };
    match w {
        None => Value::Null,
        Some(w) => {
            let previous: Vec<Value> = w.previous.iter().map(one).collect();
            match &w.current {
                Some(c) => {
                    let mut v = one(c);
                    v["previous"] = Value::Array(previous);
                    v
                }
                None => serde_json::json!({
                    "digest": null, "size": 0, "build_id": null, "stored_at": null,
                    "previous": previous,
                }),
            }
        }
    }
}

pub async fn read(ctx: &Ctx, req: &Request, caller: &Caller) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let (d, last_build, last_try, audit, mut extras) = {
        let rx = ctx.engine.read()?;
        let d = rx
            .deployment(&id)?
            .ok_or_else(|| ApiError::not_found("deployment"))?;
        let last_build = d.last_build.map(|b| rx.build(b)).transpose()?.flatten();
        let audit = crate::engine::audit::of_deployment(&rx, &id)?;
        let extras = read_extras(&rx, &d)?;
        (d, last_build, rx.update_try(&id)?, audit, extras)
    };
    let (nodes, nodes_next) = super::agents::of_deployment(ctx, caller, &id)?;
    if let Some(fields) = extras.read_only.as_mut() {
        fields.insert("nodes".into(), nodes);
        fields.insert("nodes_next_cursor".into(), nodes_next);
    }
    let facts = SourceFacts::of(ctx, &d).await;
    Ok(render_view(
        &facts,
        &d,
        last_build.as_ref(),
        last_try.as_ref(),
        &audit,
        extras,
    )?)
}

/// `If-Match: "<revision>"` (also bare, or weak `W/"..."`); `*` or absent
/// matches any revision.
pub fn if_match(req: &Request) -> Result<Option<u64>, ApiError> {
    let Some(raw) = req.headers.get("if-match") else {
        return Ok(None);
    };
    let bad = || {
        ApiError::bad_request("If-Match must be the deployment's ETag: \"<revision>\"")
            .field("/headers/if-match", "format")
    };
    let text = raw.to_str().map_err(|_| bad())?.trim();
    if text == "*" {
        return Ok(None);
    }
    let text = text.strip_prefix("W/").unwrap_or(text);
    let text = text
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(text);
    text.parse::<u64>().map(Some).map_err(|_| bad())
}

/// `POST /v1/deployments/{id}/actions/{name}`. A rollback takes an
/// optional `{"build_id": "..."}`; the other actions take no body.
pub async fn act(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let expected = if_match(req)?;
    let name = req.param("name");
    if let Some(action) = engine::rollouts::RolloutAction::from_name(name) {
        return rollout_act(ctx, req, w, action).await;
    }
    let target = match (name, req.body.is_empty()) {
        (_, true) => None,
        ("rollback", false) => rollback_target(&req.body)?,
        // The other actions take no body, or an empty object.
        (_, false) => {
            super::json_object(&req.body, &[])?;
            None
        }
    };
    let record = w.record(action_reply);
    let call = engine::actions::ActionCall {
        name: name.to_string(),
        if_match: expected,
        target,
    };
    let queued = ctx.engine.act(&id, call, record).await?;
    Ok(action_reply(&queued))
}

/// `POST .../actions/rollout_pause|rollout_resume|rollout_abort`: 202
/// with the rollout's build and its summary after the step. Pause and
/// abort take an optional `{"reason"}`.
async fn rollout_act(
    ctx: &Ctx,
    req: &Request,
    w: Write,
    action: engine::rollouts::RolloutAction,
) -> Result<Reply, ApiError> {
    use engine::rollouts::{RolloutActed, RolloutAction};
    let id = deployment_id(req)?;
    let expected = if_match(req)?;
    let fields: &[&str] = match action {
        RolloutAction::Pause | RolloutAction::Abort => &["reason"],
        RolloutAction::Resume => &[],
    };
    let reason = if req.body.is_empty() {
        None
    } else {
        match super::json_object(&req.body, fields)?.get("reason") {
            None | Some(Value::Null) => None,
            Some(Value::String(r)) => {
                crate::rollout::check_reason(r).map_err(|code| {
                    ApiError::bad_request("a reason is 1-500 characters without control characters")
                        .field("/reason", code)
                })?;
                Some(r.clone())
            }
            Some(_) => {
                return Err(
                    ApiError::bad_request("reason must be a string").field("/reason", "type")
                )
            }
        }
    };
    let actor = w
        .audit
        .actor
        .as_ref()
        .and_then(|a| serde_json::to_string(a).ok());
    let reply = |a: &RolloutActed| {
        Reply::json(
            202,
            &serde_json::json!({"build_id": format_build_id(a.build_id), "rollout": a.summary}),
        )
    };
    let record = w.record(reply);
    let acted = ctx
        .engine
        .rollout_act(&id, action, expected, reason, actor, record)
        .await?;
    Ok(reply(&acted))
}

/// A rollback body: `{"build_id": "<uuid>"}` or `{}`. An id that is not a
/// UUID is malformed (400); one that is is checked by the engine, where
/// every bad target answers alike (409 `rollback_target_invalid`).
fn rollback_target(body: &[u8]) -> Result<Option<BuildId>, ApiError> {
    let map = super::json_object(body, &["build_id"])?;
    match map.get("build_id") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => parse_build_id(text).map(Some).ok_or_else(|| {
            ApiError::bad_request("build_id must be a build id (a UUID)")
                .field("/build_id", "format")
        }),
        Some(_) => {
            Err(ApiError::bad_request("build_id must be a string").field("/build_id", "type"))
        }
    }
}

/// 202 with the queued build's id.
fn action_reply(q: &ActionQueued) -> Reply {
    Reply::json(
        202,
        &serde_json::json!({"build_id": format_build_id(q.build_id)}),
    )
}

/// `PUT /v1/deployments/{id}/update-policy`: 200 with the deployment.
pub async fn set_update_policy(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let expected = if_match(req)?;
    if req.body.is_empty() {
        return Err(ApiError::bad_request("a policy body is required").field("", "required"));
    }
    let body = super::parse_json(&req.body)?;
    let policy = parse_policy(&body, "")?;
    policy_change(ctx, &id, w, |record| {
        ctx.engine.set_update_policy(&id, policy, expected, record)
    })
    .await
}

/// `PUT /v1/deployments/{id}/rollout-policy`: 200 with the deployment; the
/// policy is stored as given (rollouts.md "The rollout policy").
pub async fn set_rollout_policy(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let expected = if_match(req)?;
    if req.body.is_empty() {
        return Err(ApiError::bad_request("a policy body is required").field("", "required"));
    }
    let body = super::parse_json(&req.body)?;
    let policy = rollout_policy(&body, "")?;
    policy_change(ctx, &id, w, |record| {
        ctx.engine
            .set_rollout_policy(&id, body.to_string(), policy, expected, record)
    })
    .await
}

/// A rollout policy, or a 400 naming each broken rule (`at`: where the
/// policy sits in the body).
pub fn rollout_policy(body: &Value, at: &str) -> Result<crate::rollout::Policy, ApiError> {
    crate::rollout::Policy::parse(body).map_err(|problems| {
        let first = problems
            .first()
            .map(|p| p.message.clone())
            .unwrap_or_default();
        problems.iter().fold(
            ApiError::bad_request(format!("the rollout policy breaks its rules: {first}")),
            |e, p| e.field(format!("{at}{}", p.pointer), p.code),
        )
    })
}

/// A change of a deployment's policies, answered with the deployment as
/// the change's transaction renders it (an idempotent replay is the same
/// bytes), from describes read before it.
async fn policy_change<F, Fut>(ctx: &Ctx, id: &str, w: Write, change: F) -> Result<Reply, ApiError>
where
    F: FnOnce(engine::audit::Record<PolicySet>) -> Fut,
    Fut: std::future::Future<Output = Result<PolicySet, engine::refusal::Refusal>>,
{
    let d = ctx
        .engine
        .read()?
        .deployment(id)?
        .ok_or_else(|| ApiError::not_found("deployment"))?;
    let facts = Arc::new(SourceFacts::of(ctx, &d).await);
    let render = move |set: &PolicySet| {
        render_view(
            &facts,
            &set.deployment,
            set.last_build.as_ref(),
            set.last_try.as_ref(),
            &set.audit,
            Shown {
                earlier_build: set.rollback_target.is_some(),
                rollout: set.rollout.clone(),
                frozen: set.frozen,
                read_only: None,
            },
        )
    };
    let render = Arc::new(render);
    let record = {
        let render = render.clone();
        w.record_checked(move |set: &PolicySet| render(set))
    };
    let set = change(record).await?;
    Ok(render(&set)?)
}

const SUBMIT_FIELDS: &[&str] = &[
    "configuration",
    "source",
    "mode",
    "keep_deployed_revision",
    "update_policy",
    "auto_rollback",
    "rollout",
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
    // Present: the parsed body above has it.
    let configuration_text = raw
        .get("configuration")
        .map(|r| r.get().to_string())
        .ok_or_else(ApiError::internal)?;
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
    let auto_rollback = match map.get("auto_rollback") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => {
            return Err(ApiError::bad_request("auto_rollback must be a boolean")
                .field("/auto_rollback", "type"))
        }
    };
    let rollout = match map.get("rollout") {
        None | Some(Value::Null) => None,
        Some(p) => Some((rollout_policy(p, "/rollout")?, p.to_string())),
    };
    Ok(SubmitInput {
        configuration_text,
        configuration,
        source,
        mode,
        keep_deployed_revision,
        update_policy,
        auto_rollback,
        rollout,
    })
}

/// `n` as a whole number of at most `u32::MAX` when it is one, whether
/// written `2` or `2.0`.
fn integral(n: &serde_json::Number) -> Option<u64> {
    if let Some(whole) = n.as_u64() {
        return Some(whole);
    }
    let f = n.as_f64()?;
    (f.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(&f)).then_some(f as u64)
}

/// An update policy (lifecycle.md "Update policies"), checked field by field.
pub fn parse_policy(v: &Value, at: &str) -> Result<UpdatePolicy, ApiError> {
    let bad = |field: &str, code: &str, message: &str| {
        ApiError::bad_request(message.to_string()).field(format!("{at}{field}"), code)
    };
    // serde ignores extra fields of a unit variant (`manual`, `automatic`)
    // even with deny_unknown_fields: refuse them here, as every unknown
    // field is refused.
    if let Value::Object(map) = v {
        let allowed: &[&str] = match map.get("kind").and_then(Value::as_str) {
            Some("manual" | "automatic") => &["kind"],
            _ => &[
                "kind",
                "frequency",
                "day",
                "start",
                "duration_minutes",
                "time_zone",
            ],
        };
        let unknown = map
            .keys()
            .filter(|k| !allowed.contains(&k.as_str()))
            .count();
        if unknown > 0 {
            return Err(bad(
                "",
                "unknown_field",
                &format!(
                    "the policy has {unknown} field(s) its kind does not take; it takes: {}",
                    allowed.join(", ")
                ),
            ));
        }
    }
    // JSON has one kind of number: `2.0` is the integer 2 to JSON Schema
    // (and to the document's `"type": "integer"`), so an integral number
    // written with a fraction is taken as the integer.
    let mut v = v.clone();
    if let Value::Object(map) = &mut v {
        for key in ["day", "duration_minutes"] {
            if let Some(Value::Number(n)) = map.get(key) {
                if let Some(whole) = integral(n) {
                    map.insert(key.to_string(), Value::from(whole));
                }
            }
        }
    }
    let policy: UpdatePolicy = serde_json::from_value(v)
        .map_err(|_| bad("", "invalid", "update_policy must be manual, automatic, or a window with frequency, start, duration_minutes and time_zone"))?;
    use crate::window::{InvalidPolicy, Window};
    match Window::from_policy(&policy) {
        Ok(_) => {}
        Err(InvalidPolicy::Day) => {
            return Err(bad(
                "/day",
                "range",
                "day is absent for daily, 1-7 for weekly (Monday = 1), 1-31 for monthly",
            ))
        }
        Err(InvalidPolicy::Start) => {
            return Err(bad("/start", "format", "start is a local time HH:MM"))
        }
        Err(InvalidPolicy::Duration) => {
            return Err(bad(
                "/duration_minutes",
                "range",
                "duration_minutes is 15 to 1440",
            ))
        }
        Err(InvalidPolicy::TimeZone) => {
            return Err(bad(
                "/time_zone",
                "time_zone",
                "time_zone must be an IANA zone name of the built-in database",
            ))
        }
    }
    Ok(policy)
}

pub async fn submit(
    ctx: &Ctx,
    req: &Request,
    caller: &Caller,
    w: Write,
) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let input = parse_submit(req, SUBMIT_FIELDS)?;
    // api.md "Authentication": a body that sets the policy or the automatic
    // rollback also needs `update_policy`.
    let sets_policy =
        input.update_policy.is_some() || input.auto_rollback.is_some() || input.rollout.is_some();
    if sets_policy
        && !super::auth::may_also(
            &ctx.authz,
            caller,
            super::auth::Procedure::UpdatePolicy,
            &id,
            req.method.as_str(),
            req.route,
        )
        .await
    {
        return Err(ApiError::new(
            super::errors::Code::Forbidden,
            "the authorization callback denied update_policy, which this submit's update_policy, auto_rollback or rollout needs",
        ));
    }
    let record = w.record(submitted_reply);
    let submitted = ctx.engine.submit(&id, input, record).await?;
    Ok(submitted_reply(&submitted))
}

/// 202 with the queued build's id and the deployment after the submit:
/// `{"build_id": ..., "deployment": <summary>}`, the summary copied from
/// the JSON its event carries. The answer is made on the store's writer
/// thread (the idempotency record keeps it), where encoding the summary
/// once more was a sixth of a submit's job at 32 connections.
fn submitted_reply(s: &Submitted) -> Reply {
    // The id as a JSON string, encoded as the summary's own strings are.
    let build_id = serde_json::Value::String(format_build_id(s.build.id)).to_string();
    let mut body = Vec::with_capacity(s.deployment_json.len() + build_id.len() + 32);
    body.extend_from_slice(b"{\"build_id\":");
    body.extend_from_slice(build_id.as_bytes());
    body.extend_from_slice(b",\"deployment\":");
    body.extend_from_slice(s.deployment_json.as_bytes());
    body.push(b'}');
    Reply::text(202, "application/json", body)
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
    let preview = ctx.engine.preview(&id, input).await?;
    Ok(Reply::json(
        200,
        &serde_json::json!({"nodes": preview.nodes, "changes": preview.changes}),
    ))
}

pub async fn delete(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let callback = if req.body.is_empty() {
        None
    } else {
        let map = json_object(&req.body, &["callback"])?;
        match map.get("callback") {
            None | Some(Value::Null) => None,
            Some(Value::String(url)) => {
                if url.len() > engine::CALLBACK_MAX_BYTES {
                    return Err(ApiError::bad_request(format!(
                        "callback must be at most {} bytes",
                        engine::CALLBACK_MAX_BYTES
                    ))
                    .field("/callback", "maxLength"));
                }
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
                if !ctx.engine.callback_rule.takes(url) {
                    return Err(ApiError::bad_request(
                        "callback must be an allowed origin spelled as --callback-origin states it (GET /v1/openapi.json shows the pattern), then a path and query of plain or %-escaped URL characters, no fragment",
                    )
                    .field("/callback", "pattern"));
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
    let record = w.record(destroy_queued_reply);
    let queued = ctx.engine.delete(&id, callback, record).await?;
    Ok(destroy_queued_reply(&queued))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// JSON Schema's integers include `2.0`; a fraction stays refused.
    #[test]
    fn a_policys_whole_numbers_may_be_written_with_a_fraction() {
        let window = |day: Value, minutes: Value| {
            serde_json::json!({"kind": "window", "frequency": "weekly", "day": day,
                "start": "02:00", "duration_minutes": minutes, "time_zone": "UTC"})
        };
        let parsed = parse_policy(&window(2.0.into(), 60.0.into()), "").unwrap();
        assert_eq!(
            parsed,
            parse_policy(&window(2.into(), 60.into()), "").unwrap()
        );
        assert!(parse_policy(&window(2.5.into(), 60.into()), "").is_err());
        assert!(parse_policy(&window(2.into(), 60.5.into()), "").is_err());
        assert!(parse_policy(&window((-2.0).into(), 60.into()), "").is_err());
        assert!(parse_policy(&window(2.into(), 1e300.into()), "").is_err());
    }
}
