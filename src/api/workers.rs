//! Worker tokens, the workers list, and the internal routes a `berth
//! worker` calls (workers.md "Internal routes"). Thin: each handler checks
//! the shape of its call and asks the engine, whose write jobs apply the
//! authority rules of `crate::authority`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::errors::{ApiError, Code};
use super::idempotency::Write;
use super::{Ctx, Reply, Request};
use crate::authority::{self, LOCAL_WORKER};
use crate::engine::attempts::{
    Answered, AuthorityCall, ClaimCall, ProgressItem, RemoteEnd, RemoteOutcome, WorkerCaller,
};
use crate::engine::health::HealthEnd;
use crate::engine::outcome::Halt;
use crate::engine::staging::AttemptAuthority;
use crate::engine::tokens::{NewToken, Token, TOKEN_PREFIX};
use crate::engine::work_state::Expected;
use crate::model::*;
use crate::store::Lookup;

/// Open polls one worker may hold (workers.md "Limits and errors").
const POLLS_PER_WORKER: usize = 2;
/// The key of every open poll in `Ctx::polls`: no token may be named so
/// (a DNS label has no `*`).
pub const ALL_POLLS: &str = "*";

/// Why an outcome has no result (workers.md "Outcome").
const RESULT_PROBLEMS: [&str; 4] = ["missing", "too_large", "not_json", "unsafe"];

/// A queue poll's `wait` at most, and its default (seconds).
const MAX_POLL_WAIT_S: u64 = 60;
const DEFAULT_POLL_WAIT_S: u64 = 25;
/// How often a waiting poll looks at the queue again without a wake (a
/// deployment's hold after a lost attempt ends without one).
const POLL_STEP: Duration = Duration::from_millis(500);
/// The longest detail a worker may give a `not_run` or a failed health step.
const MAX_DETAIL_CHARS: usize = 2000;

/// A worker token's call, authenticated before its body is read.
pub struct WorkerAuth {
    pub hash: String,
    pub record: TokenRecord,
}

impl WorkerAuth {
    fn caller(&self) -> WorkerCaller {
        WorkerCaller {
            name: self.record.name.clone(),
            token_labels: self.record.labels.clone(),
        }
    }
}

/// The worker token of an internal call: no token or an unknown one is
/// `401`; the service token or another kind `403 token_kind`. Worker
/// tokens never go to the authorization callback.
pub fn authenticate(ctx: &Ctx, headers: &warp::http::HeaderMap) -> Result<WorkerAuth, ApiError> {
    let Some(token) = super::auth::bearer(headers) else {
        return Err(ApiError::new(
            Code::Unauthenticated,
            "a worker token is required",
        ));
    };
    let forbidden = || {
        ApiError::new(Code::Forbidden, "the internal routes take a worker token")
            .reason("token_kind")
    };
    if super::auth::has_service_token(&ctx.service_token, headers)
        || !token.starts_with(TOKEN_PREFIX)
    {
        return Err(forbidden());
    }
    match ctx.engine.token_of(token)? {
        None => Err(ApiError::new(
            Code::Unauthenticated,
            "this token is unknown or revoked",
        )),
        Some((_, record)) if record.kind != TokenKind::Worker => Err(forbidden()),
        Some((hash, record)) => Ok(WorkerAuth { hash, record }),
    }
}

/// A `brt_` token on a route of another kind: `403 token_kind` when berth
/// issued it, `401` when not (such tokens never go to the callback).
pub fn refuse_issued_token(ctx: &Ctx, headers: &warp::http::HeaderMap) -> Option<ApiError> {
    let token = super::auth::bearer(headers)?;
    if !token.starts_with(TOKEN_PREFIX)
        || super::auth::has_service_token(&ctx.service_token, headers)
    {
        return None;
    }
    Some(match ctx.engine.token_of(token) {
        Ok(Some(_)) => ApiError::new(
            Code::Forbidden,
            "a worker or agent token reaches only its own internal routes",
        )
        .reason("token_kind"),
        Ok(None) => ApiError::new(Code::Unauthenticated, "this token is unknown or revoked"),
        Err(e) => e.into(),
    })
}

fn bad(pointer: &str, code: &str, message: &str) -> ApiError {
    ApiError::bad_request(message.to_string()).field(pointer, code)
}

fn token_view(t: &Token) -> Value {
    let mut v = json!({
        "name": t.record.name,
        "kind": t.record.kind.as_str(),
        "labels": t.record.labels,
        "deployment": t.record.node.as_ref().map(|n| &n.deployment),
        "node": t.record.node.as_ref().map(|n| &n.node),
        "created_at": format_time(t.record.created_at),
    });
    if let Some(secret) = &t.secret {
        v["token"] = json!(secret);
    }
    v
}

/// `POST /v1/tokens`: 201 with the token's secret, shown here only (a
/// replay of the same call answers without it: berth keeps no secret).
pub async fn create_token(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let map = super::json_object(&req.body, &["name", "kind", "labels", "deployment", "node"])?;
    let name = match map.get("name").and_then(Value::as_str) {
        Some(n) if is_dns_label(n, 63) && n != LOCAL_WORKER => n.to_string(),
        _ => {
            return Err(bad(
                "/name",
                "format",
                "name must be a DNS label (lower-case letters, digits, '-'), not \"local\"",
            ))
        }
    };
    let kind = match map.get("kind").and_then(Value::as_str) {
        Some("worker") => TokenKind::Worker,
        Some("agent") => TokenKind::Agent,
        _ => return Err(bad("/kind", "enum", "kind must be \"worker\" or \"agent\"")),
    };
    let labels = match map.get("labels") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(list)) => {
            let texts: Option<Vec<&str>> = list.iter().map(Value::as_str).collect();
            let joined = texts.map(|t| t.join(",")).unwrap_or_else(|| ",".into());
            authority::parse_labels(&joined).map_err(|why| bad("/labels", "format", &why))?
        }
        Some(_) => return Err(bad("/labels", "type", "labels must be a list of labels")),
    };
    let node = token_node(&map, kind)?;
    if kind == TokenKind::Agent && !labels.is_empty() {
        return Err(bad(
            "/labels",
            "not_allowed",
            "only a worker token lists labels",
        ));
    }
    let record = w.record(|t: &Token| Reply::json(201, &token_view(t)));
    let new = NewToken {
        name,
        kind,
        labels,
        node,
    };
    let made = ctx.engine.create_token(new, record).await?;
    Ok(Reply::json(201, &token_view(&made)))
}

/// An agent token's node (both `deployment` and `node`, required); a
/// worker token names neither.
fn token_node(
    map: &serde_json::Map<String, Value>,
    kind: TokenKind,
) -> Result<Option<NodeBinding>, ApiError> {
    let given = |field: &str| !matches!(map.get(field), None | Some(Value::Null));
    match kind {
        TokenKind::Worker => {
            for field in ["deployment", "node"] {
                if given(field) {
                    return Err(bad(
                        &format!("/{field}"),
                        "not_allowed",
                        "only an agent token names a deployment and a node",
                    ));
                }
            }
            Ok(None)
        }
        TokenKind::Agent => {
            let deployment = match map.get("deployment").and_then(Value::as_str) {
                Some(d) if crate::model::is_valid_deployment_id(d) => d.to_string(),
                _ => {
                    return Err(bad(
                        "/deployment",
                        "format",
                        "an agent token names its deployment: a deployment id",
                    ))
                }
            };
            let node = match map.get("node").and_then(Value::as_str) {
                Some(n) if crate::engine::verdict::valid_node_name(n) => n.to_string(),
                _ => {
                    return Err(bad(
                        "/node",
                        "format",
                        "an agent token names its node: a DNS label",
                    ))
                }
            };
            Ok(Some(NodeBinding { deployment, node }))
        }
    }
}

/// `GET /v1/tokens`: every token (at most `--max-workers` + `--max-agents`, one page), never
/// a secret.
pub fn list_tokens(ctx: &Ctx) -> Result<Reply, ApiError> {
    let mut tokens = ctx.engine.read()?.tokens()?;
    tokens.sort_by(|a, b| a.1.name.cmp(&b.1.name));
    let items: Vec<Value> = tokens
        .into_iter()
        .map(|(_, record)| {
            token_view(&Token {
                record,
                secret: None,
            })
        })
        .collect();
    Ok(Reply::json(
        200,
        &json!({"items": items, "next_cursor": null}),
    ))
}

/// `DELETE /v1/tokens/{name}`: revoked at once.
pub async fn revoke_token(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let record = w.record(|t: &Token| Reply::json(200, &token_view(t)));
    let gone = ctx
        .engine
        .revoke_token(req.param("name").to_string(), record)
        .await?;
    Ok(Reply::json(200, &token_view(&gone)))
}

/// `GET /v1/workers`: the embedded worker and every worker token.
pub fn list_workers(ctx: &Ctx) -> Result<Reply, ApiError> {
    let rx = ctx.engine.read()?;
    let mut attempts: Vec<AttemptRecord> = Vec::new();
    for (build, _) in rx.running()? {
        if let Some(a) = rx.last_attempt(build)? {
            if a.state == AttemptState::Active {
                attempts.push(a);
            }
        }
    }
    let held = |name: &str| -> Vec<Value> {
        attempts
            .iter()
            .filter(|a| a.worker == name)
            .map(|a| {
                json!({
                    "attempt_id": authority::attempt_id(a.build, a.fence),
                    "build": format_build_id(a.build),
                    "deployment": a.deployment,
                    "fence": a.fence,
                    "lease_expires_at": a.lease_expires_at.map(format_time),
                })
            })
            .collect()
    };
    let settings = &ctx.engine.settings;
    let mut items = Vec::new();
    if settings.local_worker {
        items.push(json!({
            "name": LOCAL_WORKER, "kind": "local", "labels": settings.local_labels.0,
            "token_labels": [], "incarnation": null, "slots": settings.build_slots,
            "last_seen_at": null, "connected": true, "attempts": held(LOCAL_WORKER),
        }));
    }
    let ttl = i64::try_from(settings.lease_ttl.as_millis()).unwrap_or(i64::MAX);
    let mut tokens = rx.tokens()?;
    tokens.sort_by(|a, b| a.1.name.cmp(&b.1.name));
    for (_, t) in tokens
        .into_iter()
        .filter(|(_, t)| t.kind == TokenKind::Worker)
    {
        let seen = t.seen.as_ref();
        items.push(json!({
            "name": t.name, "kind": "remote",
            "labels": seen.map(|s| s.labels.clone()).unwrap_or_default(),
            "token_labels": t.labels,
            "incarnation": seen.map(|s| s.incarnation.clone()),
            "slots": null,
            "last_seen_at": seen.map(|s| format_time(s.at)),
            "connected": seen.is_some_and(|s| now_millis() - s.at <= ttl.max(authority::SEEN_EVERY_MS)),
            "attempts": held(&t.name),
        }));
    }
    Ok(Reply::json(
        200,
        &json!({"items": items, "next_cursor": null}),
    ))
}

/// The labels a worker offers: valid, and each in its token's when the
/// token lists any (else `403 label_not_allowed`).
fn offered_labels(auth: &WorkerAuth, text: &str, pointer: &str) -> Result<Vec<String>, ApiError> {
    let labels = authority::parse_labels(text).map_err(|why| bad(pointer, "format", &why))?;
    let allowed = &auth.record.labels;
    if !allowed.is_empty() && !labels.iter().all(|l| allowed.contains(l)) {
        return Err(ApiError::new(
            Code::Forbidden,
            "this worker offers a label its token does not list",
        )
        .reason("label_not_allowed"));
    }
    Ok(labels)
}

fn incarnation(value: Option<&Value>, pointer: &str) -> Result<String, ApiError> {
    match value.and_then(Value::as_str) {
        Some(i) if authority::is_authority_id(i) => Ok(i.to_string()),
        _ => Err(bad(
            pointer,
            "format",
            "worker_incarnation must match ^[A-Za-z0-9][A-Za-z0-9_-]{7,127}$",
        )),
    }
}

fn operation_id(value: Option<&Value>) -> Result<String, ApiError> {
    match value.and_then(Value::as_str) {
        Some(o) if authority::is_operation_id(o) => Ok(o.to_string()),
        _ => Err(operation_id_refused()),
    }
}

fn operation_id_refused() -> ApiError {
    bad(
        "/operation_id",
        "format",
        "operation_id must be 16-128 of [A-Za-z0-9._~-]",
    )
}

fn number_param(req: &Request, name: &str, default: u64, max: u64) -> Result<u64, ApiError> {
    match req.query_one(name) {
        None => Ok(default),
        Some(text) => text
            .parse::<u64>()
            .ok()
            .filter(|n| *n <= max)
            .ok_or_else(|| {
                ApiError::bad_request(format!("{name} must be a whole number from 0 to {max}"))
            }),
    }
}

/// `GET /internal/v1/queue`: the claimable builds this worker can take
/// and its attempts whose build was cancelled, at once when there are any,
/// else after `wait`.
pub async fn queue(ctx: &Ctx, req: &Request, auth: &WorkerAuth) -> Result<Reply, ApiError> {
    let incarnation = match req.query_one("worker_incarnation") {
        Some(i) if authority::is_authority_id(i) => i.to_string(),
        _ => {
            return Err(ApiError::bad_request(
                "worker_incarnation must match ^[A-Za-z0-9][A-Za-z0-9_-]{7,127}$",
            ))
        }
    };
    let labels = offered_labels(auth, req.query_one("labels").unwrap_or(""), "/labels")?;
    let free = number_param(
        req,
        "free_slots",
        1,
        authority::MAX_ATTEMPTS_PER_WORKER as u64,
    )?;
    let wait = number_param(req, "wait", DEFAULT_POLL_WAIT_S, MAX_POLL_WAIT_S)?;
    let too_many = || {
        ApiError::new(
            Code::Unavailable,
            "too many open worker polls; poll again shortly",
        )
        .reason("too_many_polls")
        .retry_after(1)
    };
    let max = ctx.engine.settings.max_worker_polls as usize;
    let _all = ctx.polls.take(ALL_POLLS, max).ok_or_else(too_many)?;
    let _mine = ctx
        .polls
        .take(&auth.record.name, POLLS_PER_WORKER)
        .ok_or_else(too_many)?;
    ctx.engine
        .saw_worker(auth.hash.clone(), &auth.record, &incarnation, &labels)
        .await;
    let deadline = Instant::now() + Duration::from_secs(wait);
    loop {
        // Armed before the read: a build queued between the two wakes it.
        let changed = ctx.engine.queue_changed();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let (builds, cancel) = queue_now(ctx, &auth.record.name, &labels, free as usize)?;
        if !builds.is_empty() || !cancel.is_empty() || Instant::now() >= deadline {
            return Ok(Reply::json(
                200,
                &json!({"builds": builds, "cancel": cancel}),
            ));
        }
        // The wake, or a look again anyway (a hold after a loss passing).
        tokio::select! {
            _ = changed => {}
            _ = tokio::time::sleep(POLL_STEP.min(deadline - Instant::now())) => {}
        }
    }
}

/// What a poll answers now.
fn queue_now(
    ctx: &Ctx,
    worker: &str,
    labels: &[String],
    free: usize,
) -> Result<(Vec<Value>, Vec<Value>), ApiError> {
    let rx = ctx.engine.read()?;
    let mut busy = std::collections::HashSet::new();
    let mut cancel = Vec::new();
    let mut builds = Vec::new();
    let flag_labels = &ctx.engine.settings.build_labels.0;
    for (build, deployment) in rx.running()? {
        // A rollout whose worker was lost between calls goes on with the
        // next claim (workers.md "Rollouts on workers").
        if let Some(b) = rx.build(build)? {
            let required = required_of(ctx, &rx, build)?;
            if builds.len() < free
                && required.iter().all(|l| labels.contains(l))
                && crate::engine::remote_rollout::awaits_claim(&rx, &b)?
            {
                builds.push(listed(&b, required));
            }
        }
        busy.insert(deployment);
        if let Some(a) = rx.last_attempt(build)? {
            if a.worker == worker
                && a.state == AttemptState::Active
                && a.cancel_requested_at.is_some()
            {
                cancel.push(json!({"attempt_id": authority::attempt_id(a.build, a.fence), "build": format_build_id(build)}));
            }
        }
    }
    let grace = i64::try_from(ctx.engine.settings.cancel_grace.as_millis()).unwrap_or(i64::MAX);
    let now = now_millis();
    if flag_labels.iter().all(|l| labels.contains(l)) {
        for (build, deployment) in rx.queued()? {
            if builds.len() >= free {
                break;
            }
            // Only the oldest queued build of a deployment with nothing running.
            if !busy.insert(deployment.clone()) {
                continue;
            }
            let Some(b) = rx.build(build)? else { continue };
            let held = match rx.deployment(&deployment)? {
                Some(d) => crate::engine::queue::held_after_loss(&rx, &d, now, grace)?,
                None => true,
            };
            let required = required_of(ctx, &rx, build)?;
            if held
                || crate::engine::queue::frozen_out(&rx, &b, now)?
                || !required.iter().all(|l| labels.contains(l))
            {
                continue;
            }
            builds.push(listed(&b, required));
        }
    }
    Ok((builds, cancel))
}

/// The labels a build requires. A source not described yet in this
/// process is listed with the flag's: the claim describes it and decides.
fn required_of(
    ctx: &Ctx,
    rx: &impl crate::store::Lookup,
    build: BuildId,
) -> Result<Vec<String>, ApiError> {
    Ok(match rx.build_snapshots(build)? {
        Some(snaps) => ctx.engine.required_labels(&snaps.snapshot.source.digest),
        None => None,
    }
    .unwrap_or_else(|| ctx.engine.settings.build_labels.0.clone()))
}

/// A build as a poll lists it.
fn listed(b: &BuildRecord, required: Vec<String>) -> Value {
    json!({
        "build": format_build_id(b.id),
        "deployment": b.deployment,
        "kind": b.kind,
        "labels": required,
        "queued_at": format_time(b.created_at),
    })
}

/// An internal call's answer, marked when it is a replay.
fn answered(a: Answered) -> Reply {
    let reply = Reply::text(200, "application/json", a.body.into_bytes());
    if a.replayed {
        reply.header("Idempotent-Replayed", "true")
    } else {
        reply
    }
}

/// `POST /internal/v1/builds/{build}/claim`.
pub async fn claim(ctx: &Ctx, req: &Request, auth: &WorkerAuth) -> Result<Reply, ApiError> {
    let build = parse_build_id(req.param("build")).ok_or_else(|| ApiError::not_found("build"))?;
    let map = super::json_object(&req.body, &["operation_id", "worker_incarnation", "labels"])?;
    let operation_id = operation_id(map.get("operation_id"))?;
    let incarnation = incarnation(map.get("worker_incarnation"), "/worker_incarnation")?;
    let labels = match map.get("labels") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(list)) => {
            let texts: Option<Vec<&str>> = list.iter().map(Value::as_str).collect();
            offered_labels(
                auth,
                &texts.map(|t| t.join(",")).unwrap_or_else(|| ",".into()),
                "/labels",
            )?
        }
        Some(_) => return Err(bad("/labels", "type", "labels must be a list of labels")),
    };
    ctx.engine
        .saw_worker(auth.hash.clone(), &auth.record, &incarnation, &labels)
        .await;
    let call = ClaimCall {
        operation_id,
        incarnation,
        labels,
        digest: authority::body_digest(&req.body),
    };
    Ok(answered(
        ctx.engine.claim(auth.caller(), build, call).await?,
    ))
}

/// The attempt a path names: `404` for an id berth could not have made.
fn attempt_of(req: &Request) -> Result<(BuildId, u64), ApiError> {
    authority::parse_attempt_id(req.param("attempt")).ok_or_else(|| ApiError::not_found("attempt"))
}

/// The authority fields every call after the claim carries.
fn authority_call(
    req: &Request,
    map: &serde_json::Map<String, Value>,
) -> Result<AuthorityCall, ApiError> {
    let fence = map
        .get("fence")
        .and_then(Value::as_u64)
        .filter(|f| *f >= 1)
        .ok_or_else(|| bad("/fence", "type", "fence must be a whole number from 1"))?;
    Ok(AuthorityCall {
        operation_id: operation_id(map.get("operation_id"))?,
        fence,
        incarnation: incarnation(map.get("worker_incarnation"), "/worker_incarnation")?,
        digest: authority::body_digest(&req.body),
    })
}

/// `POST /internal/v1/attempts/{attempt}/renew`.
pub async fn renew(ctx: &Ctx, req: &Request, auth: &WorkerAuth) -> Result<Reply, ApiError> {
    let attempt = attempt_of(req)?;
    let map = super::json_object(&req.body, &["operation_id", "fence", "worker_incarnation"])?;
    let call = authority_call(req, &map)?;
    Ok(answered(
        ctx.engine.renew(auth.caller(), attempt, call).await?,
    ))
}

/// A progress batch as it arrives: typed, so a batch of a thousand lines
/// is read without building a JSON tree of it (the writer of the log is
/// one thread; this runs before it, on the request's).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ProgressBody {
    operation_id: String,
    fence: u64,
    worker_incarnation: String,
    items: Vec<ItemBody>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ItemBody {
    seq: u64,
    #[serde(default)]
    log: Option<String>,
    #[serde(default)]
    health: Option<HealthBody>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct HealthBody {
    node: String,
    healthy: bool,
    #[serde(default)]
    reason: Option<String>,
    attempt: u32,
}

/// `POST /internal/v1/attempts/{attempt}/progress`.
pub async fn progress(ctx: &Ctx, req: &Request, auth: &WorkerAuth) -> Result<Reply, ApiError> {
    let attempt = attempt_of(req)?;
    // serde's own message may quote the body: the refusal says what a
    // batch is instead.
    let body: ProgressBody = serde_json::from_slice(&req.body).map_err(|_| {
        ApiError::bad_request(
            "the body is not a progress batch: {\"operation_id\", \"fence\", \"worker_incarnation\", \"items\": [{\"seq\", \"log\"} or {\"seq\", \"health\"}]}",
        )
    })?;
    if !authority::is_operation_id(&body.operation_id) {
        return Err(operation_id_refused());
    }
    let call = AuthorityCall {
        fence: Some(body.fence)
            .filter(|f| *f >= 1)
            .ok_or_else(|| bad("/fence", "type", "fence must be a whole number from 1"))?,
        incarnation: incarnation(
            Some(&Value::String(body.worker_incarnation)),
            "/worker_incarnation",
        )?,
        operation_id: body.operation_id,
        digest: authority::body_digest(&req.body),
    };
    if body.items.len() > authority::MAX_BATCH_ITEMS {
        return Err(bad(
            "/items",
            "batch_too_large",
            "at most 1000 items in one batch",
        ));
    }
    let items = body
        .items
        .into_iter()
        .enumerate()
        .map(|(i, item)| progress_item(i, item))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(answered(
        ctx.engine
            .progress(auth.caller(), attempt, call, items)
            .await?,
    ))
}

fn progress_item(i: usize, item: ItemBody) -> Result<(u64, ProgressItem), ApiError> {
    let invalid = || {
        bad(&format!("/items/{i}"), "line_invalid", "an item is {\"seq\", \"log\"} or {\"seq\", \"health\"}; a log line has no CR or LF and at most 64 KiB")
    };
    if item.seq == 0 {
        return Err(invalid());
    }
    match (item.log, item.health) {
        (Some(line), None) => {
            if line.len() > authority::MAX_LINE_BYTES || line.contains(['\r', '\n']) {
                return Err(invalid());
            }
            Ok((item.seq, ProgressItem::Log(line)))
        }
        (None, Some(h)) => {
            if !crate::engine::verdict::valid_node_name(&h.node) {
                return Err(invalid());
            }
            let reason = h.reason.map(|r| {
                r.chars()
                    .take(MAX_DETAIL_CHARS)
                    .collect::<String>()
                    .replace(['\r', '\n'], " ")
            });
            Ok((
                item.seq,
                ProgressItem::Health {
                    node: h.node,
                    healthy: h.healthy,
                    reason,
                    attempt: h.attempt,
                },
            ))
        }
        (Some(_), Some(_)) | (None, None) => Err(invalid()),
    }
}

/// The members of an outcome (`health` only there) and of a call's report.
const OUTCOME_MEMBERS: [&str; 11] = [
    "operation_id",
    "fence",
    "worker_incarnation",
    "progress_through",
    "ended",
    "result",
    "result_problem",
    "health",
    "files",
    "work_state",
    "work_state_problem",
];

/// `POST /internal/v1/attempts/{attempt}/outcome`.
pub async fn outcome(ctx: &Ctx, req: &Request, auth: &WorkerAuth) -> Result<Reply, ApiError> {
    let attempt = attempt_of(req)?;
    let map = super::json_object(&req.body, &OUTCOME_MEMBERS)?;
    let call = authority_call(req, &map)?;
    let outcome = remote_outcome(&map)?;
    Ok(answered(
        ctx.engine
            .outcome(auth.caller(), attempt, call, outcome)
            .await?,
    ))
}

/// `POST /internal/v1/attempts/{attempt}/calls/{seq}`: one call of a
/// rollout build ended (workers.md "Rollouts on workers"); the body is an
/// outcome's without `health`.
pub async fn call_report(ctx: &Ctx, req: &Request, auth: &WorkerAuth) -> Result<Reply, ApiError> {
    let attempt = attempt_of(req)?;
    let seq = req
        .param("seq")
        .parse::<u64>()
        .ok()
        .filter(|s| *s >= 1)
        .ok_or_else(|| ApiError::not_found("call"))?;
    let members: Vec<&str> = OUTCOME_MEMBERS
        .into_iter()
        .filter(|m| *m != "health")
        .collect();
    let map = super::json_object(&req.body, &members)?;
    let call = authority_call(req, &map)?;
    let report = remote_outcome(&map)?;
    Ok(answered(
        ctx.engine
            .call_report(auth.caller(), attempt, call, seq, report)
            .await?,
    ))
}

/// An outcome's (or a call report's) members past its authority.
fn remote_outcome(map: &serde_json::Map<String, Value>) -> Result<RemoteOutcome, ApiError> {
    let progress_through = map
        .get("progress_through")
        .and_then(Value::as_u64)
        .ok_or_else(|| {
            bad(
                "/progress_through",
                "type",
                "progress_through must be a whole number",
            )
        })?;
    let ended = remote_end(map.get("ended"))?;
    let result = match (map.get("result"), map.get("result_problem")) {
        (Some(v), None | Some(Value::Null)) if !v.is_null() => Ok(v.to_string()),
        // Only the problems workers.md names reach the build's failure.
        (None | Some(Value::Null), Some(Value::String(p)))
            if RESULT_PROBLEMS.contains(&p.as_str()) =>
        {
            Err(p.clone())
        }
        (None | Some(Value::Null), None | Some(Value::Null)) => Err("missing".to_string()),
        _ => {
            return Err(bad(
                "/result",
                "type",
                "give result, or result_problem with result null",
            ))
        }
    };
    let health = remote_health(map.get("health"))?;
    let (work_state, work_state_problem) = outcome_work_state(map)?;
    Ok(RemoteOutcome {
        progress_through,
        ended,
        result,
        health,
        files: outcome_files(map.get("files"))?,
        work_state,
        work_state_problem,
    })
}

/// The most SBOM files one outcome names.
const MAX_OUTCOME_FILES: usize = 10_000;

/// An outcome's `files`: SBOM paths -> digests of staged blobs.
fn outcome_files(v: Option<&Value>) -> Result<BTreeMap<String, String>, ApiError> {
    let invalid = || {
        bad(
            "/files",
            "type",
            "files must map each SBOM path to the sha256:<hex> digest of an uploaded blob",
        )
    };
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(BTreeMap::new());
    };
    let map = v.as_object().ok_or_else(invalid)?;
    if map.len() > MAX_OUTCOME_FILES {
        return Err(bad("/files", "too_many", "at most 10000 files"));
    }
    map.iter()
        .map(|(path, digest)| match digest.as_str() {
            Some(d) if crate::archive::is_digest(d) => Ok((path.clone(), d.to_string())),
            _ => Err(invalid()),
        })
        .collect()
}

/// An outcome's `work_state` digest (null: an empty work dir) and its
/// `work_state_problem`.
fn outcome_work_state(
    map: &serde_json::Map<String, Value>,
) -> Result<(Option<String>, Option<String>), ApiError> {
    let digest = match map.get("work_state") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) if crate::archive::is_digest(d) => Some(d.clone()),
        Some(_) => {
            return Err(bad(
                "/work_state",
                "type",
                "work_state must be null or a sha256:<hex> digest",
            ))
        }
    };
    let problem = match map.get("work_state_problem") {
        None | Some(Value::Null) => None,
        Some(Value::String(p)) if p == "too_large" || p == "unreadable" => Some(p.clone()),
        Some(_) => {
            return Err(bad(
                "/work_state_problem",
                "type",
                "work_state_problem must be null, too_large or unreadable",
            ))
        }
    };
    Ok((digest, problem))
}

fn remote_end(v: Option<&Value>) -> Result<RemoteEnd, ApiError> {
    let invalid = || {
        bad("/ended", "type", "ended must be {\"kind\": exit|signal|status_unknown|timeout|cancelled|shutdown|not_run, ...}")
    };
    let v = v.ok_or_else(invalid)?;
    let int = |name: &str| {
        v.get(name)
            .and_then(Value::as_i64)
            .and_then(|n| i32::try_from(n).ok())
    };
    Ok(match v.get("kind").and_then(Value::as_str) {
        Some("exit") => RemoteEnd::Exit(int("code").ok_or_else(invalid)?),
        Some("signal") => RemoteEnd::Signal(int("signal").ok_or_else(invalid)?),
        Some("status_unknown") => RemoteEnd::StatusUnknown,
        Some("timeout") => RemoteEnd::Timeout,
        Some("cancelled") => RemoteEnd::Cancelled,
        Some("shutdown") => RemoteEnd::Shutdown,
        Some("not_run") => {
            let reason = match v.get("reason").and_then(Value::as_str) {
                Some("spawn_failed") => FailureReason::SpawnFailed,
                Some("work_state_unavailable") => FailureReason::WorkStateUnavailable,
                _ => return Err(invalid()),
            };
            let detail = v
                .get("detail")
                .and_then(Value::as_str)
                .unwrap_or("the deployer did not run");
            RemoteEnd::NotRun {
                reason,
                detail: detail.chars().take(MAX_DETAIL_CHARS).collect(),
            }
        }
        _ => return Err(invalid()),
    })
}

fn remote_health(v: Option<&Value>) -> Result<Option<HealthEnd>, ApiError> {
    let invalid = || {
        bad("/health", "type", "health must be null, {\"end\": confirmed}, {\"end\": failed, \"detail\"} or {\"end\": halted, \"by\": cancel|shutdown}")
    };
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    Ok(Some(match v.get("end").and_then(Value::as_str) {
        Some("confirmed") => HealthEnd::Confirmed,
        Some("failed") => HealthEnd::Failed(
            v.get("detail")
                .and_then(Value::as_str)
                .unwrap_or("the health step failed")
                .chars()
                .take(MAX_DETAIL_CHARS)
                .collect(),
        ),
        Some("halted") => match v.get("by").and_then(Value::as_str) {
            Some("cancel") => HealthEnd::Halted(Halt::Cancel),
            Some("shutdown") => HealthEnd::Halted(Halt::Shutdown),
            _ => return Err(invalid()),
        },
        _ => return Err(invalid()),
    }))
}

/// The authority a blob upload or a work state download carries in its
/// headers.
fn header_authority(req: &Request) -> Result<AttemptAuthority, ApiError> {
    let header = |name: &str| req.headers.get(name).and_then(|v| v.to_str().ok());
    let fence = header("berth-fence")
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|f| *f >= 1)
        .ok_or_else(|| {
            bad(
                "/headers/berth-fence",
                "format",
                "Berth-Fence must be the attempt's fence, a whole number from 1",
            )
        })?;
    let incarnation = header("berth-worker-incarnation")
        .filter(|i| authority::is_authority_id(i))
        .ok_or_else(|| {
            bad(
                "/headers/berth-worker-incarnation",
                "format",
                "Berth-Worker-Incarnation must match ^[A-Za-z0-9][A-Za-z0-9_-]{7,127}$",
            )
        })?;
    Ok(AttemptAuthority {
        fence,
        incarnation: incarnation.to_string(),
    })
}

/// `PUT /internal/v1/attempts/{attempt}/blobs/{digest}`: an SBOM file or
/// the work state archive, staged for the attempt's outcome.
pub async fn blob(ctx: &Ctx, req: &Request, auth: &WorkerAuth) -> Result<Reply, ApiError> {
    let attempt = attempt_of(req)?;
    let who = header_authority(req)?;
    let digest = req.param("digest");
    if !crate::archive::is_digest(digest) {
        return Err(bad(
            "/path/digest",
            "format",
            "the digest must be sha256: and 64 lower-case hex digits",
        ));
    }
    let Some(upload) = &req.upload else {
        return Err(ApiError::internal());
    };
    if upload.digest != digest {
        return Err(bad(
            "/path/digest",
            "digest_mismatch",
            "the body's SHA-256 is not the digest in the path",
        ));
    }
    let stored = ctx
        .engine
        .stage_blob(&auth.caller().name, attempt, &who, digest, upload)
        .await?;
    let status = if stored { 201 } else { 200 };
    Ok(Reply::json(
        status,
        &json!({"digest": digest, "size": upload.len}),
    ))
}

/// An archive as an answer: `application/x-tar`, its digest as the ETag,
/// a `Range: bytes=` honoured as the log's is.
fn tar_reply(req: &Request, digest: &str, tar: Vec<u8>) -> Result<Reply, ApiError> {
    super::ranges::content_addressed(req, "application/x-tar", digest, tar)
}

/// `GET /internal/v1/attempts/{attempt}/work-state`: the archive the
/// attempt starts from.
pub fn attempt_work_state(ctx: &Ctx, req: &Request, auth: &WorkerAuth) -> Result<Reply, ApiError> {
    let attempt = attempt_of(req)?;
    let who = header_authority(req)?;
    let (found, tar) = ctx
        .engine
        .attempt_work_state(&auth.caller().name, attempt, &who)?;
    tar_reply(req, &found.digest, tar)
}

/// `GET /v1/deployments/{id}/work-state[?digest=]`: a kept archive.
pub fn read_work_state(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let digest = req
        .query
        .iter()
        .find(|(k, _)| k == "digest")
        .map(|(_, v)| v.as_str());
    let (found, tar) = ctx.engine.work_state(req.param("id"), digest)?;
    tar_reply(req, &found.digest, tar)
}

/// `If-Match` of a work state PUT: `"<digest>"`, or `"none"` when the
/// deployment has none; required.
fn expected_work_state(req: &Request) -> Result<Expected, ApiError> {
    let bad_match = || {
        ApiError::bad_request(
            "If-Match must be the current work state's ETag, \"sha256:<hex>\", or \"none\"",
        )
        .field("/headers/if-match", "format")
    };
    let raw = req.headers.get("if-match").ok_or_else(bad_match)?;
    let text = raw.to_str().map_err(|_| bad_match())?.trim();
    let text = text
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(text);
    match text {
        "none" => Ok(Expected::Nothing),
        d if crate::archive::is_digest(d) => Ok(Expected::Digest(d.to_string())),
        _ => Err(bad_match()),
    }
}

/// `PUT /v1/deployments/{id}/work-state`: makes an archive current.
pub async fn put_work_state(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let id = req.param("id").to_string();
    let expected = expected_work_state(req)?;
    let Some(upload) = &req.upload else {
        return Err(ApiError::internal());
    };
    let (path, max) = (upload.path.clone(), ctx.engine.settings.max_work_state);
    let prepared = tokio::task::spawn_blocking(move || {
        let tar = std::fs::read(&path).map_err(|e| format!("the upload cannot be read: {e}"))?;
        crate::engine::work_state::prepare(&tar, max)
    })
    .await
    .map_err(|_| ApiError::internal())?
    .map_err(|why| {
        ApiError::bad_request(format!("not a valid work state: {why}"))
            .field("/body", "work_state_invalid")
    })?;
    let record = w.record(|r: &WorkStateRef| Reply::json(200, &stored_work_state(r)));
    let stored = ctx
        .engine
        .put_work_state(id, expected, prepared, record)
        .await?;
    Ok(Reply::json(200, &stored_work_state(&stored)))
}

fn stored_work_state(r: &WorkStateRef) -> Value {
    json!({
        "digest": r.digest,
        "size": r.size,
        "build_id": r.build.map(format_build_id),
        "stored_at": format_time(r.stored_at),
    })
}
