//! The routes of `berth agent` (agents.md): its node's desired state, as a
//! document, a long poll or an event stream, and its reports; and the node
//! reads of the public API. Thin: the engine stores reports and
//! documents, `crate::nodes` says what they mean.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use warp::http::HeaderValue;
use warp::Reply as _;

use super::auth::Caller;
use super::errors::{ApiError, Code};
use super::{Answer, Ctx, Reply, Request};
use crate::engine::activations::{
    ActivationAuthority, ActivationCall, AgentItem, AgentRefusal, OutOfOrder, FAILED_REASONS,
};
use crate::engine::nodes::ReportRefusal;
use crate::model::*;
use crate::nodes::{self as rules, AgentStatus, MAX_REPORT_BYTES};

/// Desired-state streams one token holds at once: a third ends the
/// oldest (agents.md "Limits and scale": an agent that reconnects before
/// its old connection timed out is not refused).
pub const STREAMS_PER_TOKEN: usize = 2;

/// The open desired-state streams of each token, oldest first, each with
/// the switch that ends it.
#[derive(Default)]
pub struct Streams {
    open: std::sync::Mutex<std::collections::HashMap<String, TokenStreams>>,
    next_id: std::sync::atomic::AtomicU64,
}

/// One token's streams: each one's id and the switch that ends it.
type TokenStreams = std::collections::VecDeque<(u64, tokio::sync::watch::Sender<bool>)>;

/// A stream's place among its token's; leaving it frees the place.
struct StreamPlace {
    ctx: Arc<Ctx>,
    token: String,
    id: u64,
}

impl Streams {
    /// Takes a place for a new stream of `token`, ending the oldest past
    /// `STREAMS_PER_TOKEN`; the receiver turns true when this one must end.
    fn take(ctx: &Arc<Ctx>, token: &str) -> (StreamPlace, tokio::sync::watch::Receiver<bool>) {
        use crate::locks::Held;
        let s = &ctx.agent_streams;
        let id = s.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (end, ended) = tokio::sync::watch::channel(false);
        let mut open = s.open.held();
        let mine = open.entry(token.to_string()).or_default();
        mine.push_back((id, end));
        while mine.len() > STREAMS_PER_TOKEN {
            if let Some((_, oldest)) = mine.pop_front() {
                // Its stream may have ended already: nothing to end then.
                oldest.send_replace(true);
            }
        }
        let place = StreamPlace {
            ctx: ctx.clone(),
            token: token.to_string(),
            id,
        };
        (place, ended)
    }
}

impl Drop for StreamPlace {
    fn drop(&mut self) {
        use crate::locks::Held;
        let mut open = self.ctx.agent_streams.open.held();
        if let Some(mine) = open.get_mut(&self.token) {
            mine.retain(|(id, _)| *id != self.id);
            if mine.is_empty() {
                open.remove(&self.token);
            }
        }
    }
}

/// A long poll's `wait` at most, and its default (seconds).
const MAX_WAIT_S: u64 = 60;
const DEFAULT_WAIT_S: u64 = 30;

/// An agent token's call, authenticated before its body is read, on its
/// own node's routes.
pub struct AgentAuth {
    pub token: String,
    pub binding: NodeBinding,
}

/// The agent token of a node route: no token or an unknown one is `401`;
/// the service token or another kind `403 token_kind`; another node's
/// token `403 token_scope`, whatever exists there.
pub fn authenticate(
    ctx: &Ctx,
    headers: &warp::http::HeaderMap,
    (deployment, node): (Option<&String>, Option<&String>),
) -> Result<AgentAuth, ApiError> {
    let Some(token) = super::auth::bearer(headers) else {
        return Err(ApiError::new(
            Code::Unauthenticated,
            "an agent token is required",
        ));
    };
    let kind = || {
        ApiError::new(Code::Forbidden, "the node routes take an agent token").reason("token_kind")
    };
    if super::auth::has_service_token(&ctx.service_token, headers)
        || !token.starts_with(crate::engine::tokens::TOKEN_PREFIX)
    {
        return Err(kind());
    }
    let record = match ctx.engine.token_of(token)? {
        None => {
            return Err(ApiError::new(
                Code::Unauthenticated,
                "this token is unknown or revoked",
            ))
        }
        Some((_, record)) => record,
    };
    let Some(binding) = record
        .node
        .clone()
        .filter(|_| record.kind == TokenKind::Agent)
    else {
        return Err(kind());
    };
    if (deployment, node) != (Some(&binding.deployment), Some(&binding.node)) {
        return Err(ApiError::new(
            Code::Forbidden,
            "an agent token reaches only the routes of the node it is bound to",
        )
        .reason("token_scope"));
    }
    Ok(AgentAuth {
        token: record.name,
        binding,
    })
}

/// `POST /internal/v1/nodes/{deployment}/{node}/report`. A refused or
/// invalid report is audited, folded per token (audit.md); one berth
/// could not take (its rate, a store away: `503`, or a fault: `500`) is
/// not: the agent sends it again.
pub async fn report(ctx: &Ctx, req: &Request, auth: &AgentAuth) -> Result<Reply, ApiError> {
    let answer = take_report(ctx, req, auth).await;
    if let Err(e) = &answer {
        if !matches!(e.code, Code::Unavailable | Code::Internal) {
            super::audit::refused_report(ctx, (&auth.token, &auth.binding), e).await;
        }
    }
    answer
}

async fn take_report(ctx: &Ctx, req: &Request, auth: &AgentAuth) -> Result<Reply, ApiError> {
    if req.body.len() > MAX_REPORT_BYTES {
        return Err(ApiError::new(
            Code::PayloadTooLarge,
            "a report is at most 16 KiB",
        ));
    }
    let map = super::json_object(&req.body, &rules::REPORT_FIELDS)?;
    let parsed = rules::parse_report(&map, &auth.token, now_millis()).map_err(|b| {
        ApiError::bad_request(format!("the report's {} must be {}", b.pointer, b.message))
            .field(&b.pointer, "invalid")
    })?;
    match ctx.engine.node_report(&auth.binding, parsed).await {
        Ok(generation) => Ok(Reply::json(200, &json!({"generation": generation}))),
        Err(ReportRefusal::TooSoon) => Err(ApiError::new(
            Code::Unavailable,
            "a node reports at most once a second",
        )
        .reason("report_rate")
        .retry_after(1)),
        Err(ReportRefusal::Refused(r)) => Err(r.into()),
    }
}

/// The node's document now.
fn current(ctx: &Ctx, binding: &NodeBinding) -> Result<Value, ApiError> {
    let n = ctx
        .engine
        .node(&binding.deployment, &binding.node)?
        .unwrap_or_else(|| NodeRecord::new(&binding.deployment, &binding.node));
    Ok(rules::document(&n, ctx.engine.document_times()))
}

/// `GET /internal/v1/nodes/{deployment}/{node}/desired`: the document; a
/// long poll with `?after=G&wait=S`; an event stream when asked for one.
pub async fn desired(ctx: &Arc<Ctx>, req: &Request, auth: &AgentAuth) -> Result<Answer, ApiError> {
    let wants_stream = req
        .headers
        .get("accept")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/event-stream"));
    if wants_stream {
        return Ok(Answer::Stream(stream(ctx, req, auth)));
    }
    let after = match req.query_one("after") {
        None => None,
        Some(g) => Some(g.parse::<u64>().map_err(|_| {
            ApiError::bad_request("after must be a generation (a whole number)")
                .field("/query/after", "invalid")
        })?),
    };
    let wait = match req.query_one("wait") {
        None => DEFAULT_WAIT_S,
        Some(w) => w
            .parse::<u64>()
            .ok()
            .filter(|w| (1..=MAX_WAIT_S).contains(w))
            .ok_or_else(|| {
                ApiError::bad_request("wait must be a whole number of seconds from 1 to 60")
                    .field("/query/wait", "range")
            })?,
    };
    let mut changes = ctx.engine.document_changes();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(wait);
    loop {
        let doc = current(ctx, &auth.binding)?;
        if after.is_none() || doc["generation"].as_u64() != after {
            return Ok(Answer::Reply(Reply::json(200, &doc)));
        }
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep_until(deadline) => {
                return Ok(Answer::Reply(Reply::text(204, "application/json", vec![])));
            }
        }
        // A revoked token's poll ends with its next look.
        authenticate_again(ctx, req)?;
    }
}

fn authenticate_again(ctx: &Ctx, req: &Request) -> Result<AgentAuth, ApiError> {
    let path = (req.params.get("deployment"), req.params.get("node"));
    authenticate(ctx, &req.headers, path)
}

/// The desired-state channel as an event stream (events.md "Desired-state
/// channel"): the document at once unless `Last-Event-ID` is its
/// generation, then one `desired` event per new generation, keep-alives
/// between; a revoked token's stream ends at its next wake (a revocation
/// wakes every stream).
fn stream(ctx: &Arc<Ctx>, req: &Request, auth: &AgentAuth) -> warp::reply::Response {
    let last_sent: Option<u64> = req
        .headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    let (place, ended) = Streams::take(ctx, &auth.token);
    let secret = super::auth::bearer(&req.headers)
        .unwrap_or_default()
        .to_string();
    let state = DesiredStream {
        ctx: ctx.clone(),
        secret,
        binding: auth.binding.clone(),
        last_sent,
        changes: ctx.engine.document_changes(),
        stop: ctx.engine.stop_signal(),
        first: true,
        _open: ctx.engine.count_stream(),
        _place: place,
        ended,
    };
    let body = futures_util::stream::unfold(state, |mut s| async move {
        let bytes = s.next().await?;
        Some((Ok::<Bytes, Infallible>(bytes), s))
    });
    let mut response = warp::reply::stream(body).into_response();
    let h = response.headers_mut();
    h.insert(
        "content-type",
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert("cache-control", HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

struct DesiredStream {
    ctx: Arc<Ctx>,
    /// The token's secret: the stream ends once it no longer binds the
    /// node (revoked).
    secret: String,
    binding: NodeBinding,
    last_sent: Option<u64>,
    changes: tokio::sync::watch::Receiver<u64>,
    stop: tokio::sync::watch::Receiver<bool>,
    first: bool,
    /// Counted while it lives (`berth_agent_streams`).
    _open: crate::engine::nodes::StreamCount,
    /// Its place among its token's streams, and the switch that ends it.
    _place: StreamPlace,
    ended: tokio::sync::watch::Receiver<bool>,
}

impl DesiredStream {
    /// The next bytes to send; `None` ends the stream.
    async fn next(&mut self) -> Option<Bytes> {
        if std::mem::take(&mut self.first) {
            let retry = "retry: 3000\n\n".to_string();
            return Some(Bytes::from(retry + &self.event_if_new()?));
        }
        loop {
            let keep_alive = self.ctx.engine.settings.sse_keep_alive;
            tokio::select! {
                changed = self.changes.changed() => {
                    changed.ok()?;
                }
                _ = self.stop.changed() => return None,
                _ = self.ended.changed() => return None,
                _ = tokio::time::sleep(keep_alive) => return Some(Bytes::from_static(b": keep-alive\n\n")),
            }
            let bound = self.ctx.engine.token_of(&self.secret).ok()??.1.node;
            if bound.as_ref() != Some(&self.binding) {
                return None;
            }
            let event = self.event_if_new()?;
            if !event.is_empty() {
                return Some(Bytes::from(event));
            }
        }
    }

    /// The current document as an event when its generation was not sent
    /// (empty when it was); `None` when the store cannot be read.
    fn event_if_new(&mut self) -> Option<String> {
        let doc = match current(&self.ctx, &self.binding) {
            Ok(doc) => doc,
            Err(e) => {
                tracing::warn!(error = %e.message, "a desired-state stream cannot read its node; it ends");
                return None;
            }
        };
        let generation = doc["generation"].as_u64().unwrap_or(0);
        if self.last_sent == Some(generation) {
            return Some(String::new());
        }
        self.last_sent = Some(generation);
        Some(format!("id: {generation}\nevent: desired\ndata: {doc}\n\n"))
    }
}

/// The query filters of a node list.
struct NodeFilter {
    drifted: Option<bool>,
    unreachable: Option<bool>,
}

fn flag(req: &Request, name: &str) -> Result<Option<bool>, ApiError> {
    match req.query_one(name) {
        None => Ok(None),
        Some("true") => Ok(Some(true)),
        Some("false") => Ok(Some(false)),
        Some(_) => Err(
            ApiError::bad_request(format!("{name} must be true or false"))
                .field(format!("/query/{name}"), "invalid"),
        ),
    }
}

impl NodeFilter {
    fn of(req: &Request) -> Result<NodeFilter, ApiError> {
        Ok(NodeFilter {
            drifted: flag(req, "drifted")?,
            unreachable: flag(req, "unreachable")?,
        })
    }

    fn text(&self) -> String {
        format!(
            "drifted={:?}&unreachable={:?}",
            self.drifted, self.unreachable
        )
    }

    fn keeps(&self, entry: &Value) -> bool {
        let drifted = !entry["drift"].is_null();
        let unreachable = entry["agent"]["status"] == json!(AgentStatus::Unreachable.as_str());
        self.drifted.is_none_or(|want| want == drifted)
            && self.unreachable.is_none_or(|want| want == unreachable)
    }
}

/// Nodes a list reads at most for one page (a filter that keeps few of
/// them ends the page early, with a cursor after the last one shown).
const MAX_NODE_SCAN: usize = 10_000;

/// A page of node entries: of one deployment, or the bound nodes of every
/// deployment the caller may `read`. Entries are filtered before the page
/// and its cursor are cut, so a cursor names only what its caller saw.
async fn page(
    ctx: &Ctx,
    req: &Request,
    caller: &Caller,
    deployment: Option<&str>,
) -> Result<Reply, ApiError> {
    let limit = super::cursor::page_limit(req)?;
    let filter = NodeFilter::of(req)?;
    let filter_text = format!("{}|{}", deployment.unwrap_or("*"), filter.text());
    let (key, identity) = (&ctx.cursor_key, caller.identity());
    let mut position = match req.query_one("cursor") {
        None => None,
        Some(c) => {
            let at = super::cursor::decode(key, &identity, &filter_text, c)?;
            let (d, n) = at.split_once('/').ok_or_else(|| {
                ApiError::bad_request("the cursor is not valid for this list")
                    .field("/query/cursor", "cursor_invalid")
            })?;
            Some((d.to_string(), n.to_string()))
        }
    };
    let mut shown: Vec<(String, String, Value)> = Vec::with_capacity(limit + 1);
    let mut scanned = 0usize;
    'scan: while shown.len() <= limit && scanned < MAX_NODE_SCAN {
        let at = position.as_ref().map(|(d, n)| (d.as_str(), n.as_str()));
        let batch = ctx.engine.nodes(deployment, at, super::cursor::MAX_PAGE)?;
        if batch.is_empty() {
            break;
        }
        for n in batch {
            position = Some((n.deployment.clone(), n.node.clone()));
            scanned += 1;
            let path = format!("/v1/deployments/{}", n.deployment);
            let visible = deployment.is_some()
                || (!n.tokens.is_empty()
                    && super::auth::may_read(&ctx.authz, caller, &n.deployment, &path).await);
            let entry = with_deployment(ctx.engine.node_entry(&n), deployment.is_none(), &n);
            if visible && filter.keeps(&entry) {
                shown.push((n.deployment, n.node, entry));
                if shown.len() > limit {
                    break 'scan;
                }
            }
            if scanned >= MAX_NODE_SCAN {
                break 'scan;
            }
        }
    }
    let cut = shown.len() > limit || scanned >= MAX_NODE_SCAN;
    shown.truncate(limit);
    let next = match (cut, shown.last()) {
        (true, Some((d, n, _))) => Some(super::cursor::encode(
            key,
            &identity,
            &filter_text,
            &format!("{d}/{n}"),
        )),
        (true, None) | (false, _) => None,
    };
    let items: Vec<Value> = shown.into_iter().map(|(_, _, e)| e).collect();
    Ok(Reply::json(
        200,
        &json!({"items": items, "next_cursor": next}),
    ))
}

/// An entry of the list of every deployment's nodes names its deployment.
fn with_deployment(mut entry: Value, all: bool, n: &NodeRecord) -> Value {
    if all {
        entry["deployment"] = json!(n.deployment);
    }
    entry
}

/// `GET /v1/deployments/{id}/nodes`.
pub async fn list(ctx: &Ctx, req: &Request, caller: &Caller) -> Result<Reply, ApiError> {
    let id = req.deployment_id()?;
    page(ctx, req, caller, Some(&id)).await
}

/// `GET /v1/nodes`.
pub async fn list_all(ctx: &Ctx, req: &Request, caller: &Caller) -> Result<Reply, ApiError> {
    page(ctx, req, caller, None).await
}

/// `GET /v1/deployments/{id}/nodes/{node}`: an unbound node berth knows
/// nothing of has an entry of nulls.
pub fn read(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let id = req.deployment_id()?;
    let node = req.param("node");
    if !crate::engine::verdict::valid_node_name(node) {
        return Err(
            ApiError::bad_request("a node name is a DNS label").field("/path/node", "invalid")
        );
    }
    let entry = match ctx.engine.node(&id, node)? {
        Some(n) => ctx.engine.node_entry(&n),
        None => rules::empty_entry(node),
    };
    Ok(Reply::json(200, &entry))
}

/// The deployment read's `nodes` (its first `NODES_IN_DEPLOYMENT_READ` by
/// name) and `nodes_next_cursor` (for `GET /v1/deployments/{id}/nodes`
/// with no filter).
pub fn of_deployment(ctx: &Ctx, caller: &Caller, id: &str) -> Result<(Value, Value), ApiError> {
    let limit = rules::NODES_IN_DEPLOYMENT_READ;
    let read = ctx.engine.nodes(Some(id), None, limit + 1)?;
    let more = read.len() > limit;
    let entries: Vec<Value> = read
        .iter()
        .take(limit)
        .map(|n| ctx.engine.node_entry(n))
        .collect();
    let filter_text = format!(
        "{id}|{}",
        NodeFilter {
            drifted: None,
            unreachable: None
        }
        .text()
    );
    let next = match (more, entries.len().checked_sub(1).map(|i| &read[i])) {
        (true, Some(last)) => json!(super::cursor::encode(
            &ctx.cursor_key,
            &caller.identity(),
            &filter_text,
            &format!("{}/{}", last.deployment, last.node)
        )),
        (true, None) | (false, _) => Value::Null,
    };
    Ok((json!(entries), next))
}

/// The authority part of an agent's call (checked for shape here; its
/// meaning is the engine's).
fn agent_call(
    req: &Request,
    auth: &AgentAuth,
    map: &serde_json::Map<String, Value>,
) -> Result<ActivationAuthority, ApiError> {
    let text = |k: &str| map.get(k).and_then(Value::as_str);
    let operation_id = text("operation_id")
        .filter(|o| crate::authority::is_operation_id(o))
        .ok_or_else(|| {
            ApiError::bad_request("operation_id must be 16-128 of [A-Za-z0-9._~-]")
                .field("/operation_id", "invalid")
        })?;
    let incarnation = text("worker_incarnation")
        .filter(|i| crate::authority::is_authority_id(i))
        .ok_or_else(|| {
            ApiError::bad_request("worker_incarnation must be 8-128 of [A-Za-z0-9_-]")
                .field("/worker_incarnation", "invalid")
        })?;
    let fence = map
        .get("fence")
        .and_then(Value::as_u64)
        .filter(|f| *f >= 1)
        .ok_or_else(|| {
            ApiError::bad_request("fence must be a whole number of at least 1")
                .field("/fence", "invalid")
        })?;
    Ok(ActivationAuthority {
        token: auth.token.clone(),
        deployment: auth.binding.deployment.clone(),
        node: auth.binding.node.clone(),
        operation_id: operation_id.to_string(),
        fence,
        incarnation: incarnation.to_string(),
        digest: crate::authority::body_digest(&req.body),
    })
}

fn answered(result: Result<String, AgentRefusal>) -> Result<Reply, ApiError> {
    match result {
        Ok(text) => Ok(Reply::text(200, "application/json", text.into_bytes())),
        Err(AgentRefusal::Refused(r)) => Err(r.into()),
        Err(AgentRefusal::OutOfOrder(OutOfOrder::Progress)) => Err(ApiError::bad_request(
            "a step or health answer before its turn (fetched, then activated, then health)",
        )
        .reason("progress_order")),
        Err(AgentRefusal::OutOfOrder(OutOfOrder::Outcome)) => Err(ApiError::bad_request(
            "confirmed is an outcome only after berth published confirm",
        )
        .reason("outcome_order")),
    }
}

/// `POST /internal/v1/nodes/{deployment}/{node}/claim`.
pub async fn claim(ctx: &Ctx, req: &Request, auth: &AgentAuth) -> Result<Reply, ApiError> {
    let map = super::json_object(&req.body, &["operation_id", "fence", "worker_incarnation"])?;
    let call = agent_call(req, auth, &map)?;
    answered(ctx.engine.claim_activation(call).await)
}

/// `POST /internal/v1/nodes/{deployment}/{node}/attempts/{attempt}/renew`.
pub async fn renew(ctx: &Ctx, req: &Request, auth: &AgentAuth) -> Result<Reply, ApiError> {
    let map = super::json_object(&req.body, &["operation_id", "fence", "worker_incarnation"])?;
    let call = agent_call(req, auth, &map)?;
    let attempt = req.param("attempt").to_string();
    answered(
        ctx.engine
            .activation_call(call, attempt, ActivationCall::Renew)
            .await,
    )
}

/// `POST .../attempts/{attempt}/progress`: `items` of `seq` and one of
/// `step` (`fetched`, `activated`), `health` or `log`.
pub async fn progress(ctx: &Ctx, req: &Request, auth: &AgentAuth) -> Result<Reply, ApiError> {
    let map = super::json_object(
        &req.body,
        &["operation_id", "fence", "worker_incarnation", "items"],
    )?;
    let call = agent_call(req, auth, &map)?;
    let items = map
        .get("items")
        .and_then(Value::as_array)
        .filter(|a| a.len() <= crate::authority::MAX_BATCH_ITEMS)
        .ok_or_else(|| {
            ApiError::bad_request("items must be a list of at most 1,000")
                .field("/items", "invalid")
        })?;
    let mut parsed = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        parsed.push(
            progress_item(item).map_err(|why| {
                ApiError::bad_request(why).field(format!("/items/{i}"), "invalid")
            })?,
        );
    }
    let attempt = req.param("attempt").to_string();
    answered(
        ctx.engine
            .activation_call(call, attempt, ActivationCall::Progress(parsed))
            .await,
    )
}

fn progress_item(v: &Value) -> Result<(u64, AgentItem), String> {
    let seq = v
        .get("seq")
        .and_then(Value::as_u64)
        .filter(|s| *s >= 1)
        .ok_or("each item has a seq of at least 1")?;
    let step = v.get("step").and_then(Value::as_str);
    let log = v.get("log").and_then(Value::as_str);
    let health = v.get("health");
    let item = match (step, log, health) {
        (Some("fetched"), None, None) => AgentItem::Fetched,
        (Some("activated"), None, None) => AgentItem::Activated,
        (None, Some(line), None) if line.len() <= crate::authority::MAX_LINE_BYTES => AgentItem::Log(line.to_string()),
        (None, None, Some(h)) => {
            let healthy = h.get("healthy").and_then(Value::as_bool).ok_or("a health answer says healthy, true or false")?;
            let reason = h.get("reason").and_then(Value::as_str).map(|r| r.chars().take(rules::MAX_REASON_CHARS).collect());
            AgentItem::Health(ReportedHealth { healthy, reason })
        }
        _ => return Err("each item has exactly one of step (fetched, activated), a log line of at most 64 KiB, or health".into()),
    };
    Ok((seq, item))
}

/// `POST .../attempts/{attempt}/outcome`: `result` `confirmed`, or
/// `failed` with a `reason`.
pub async fn outcome(ctx: &Ctx, req: &Request, auth: &AgentAuth) -> Result<Reply, ApiError> {
    let map = super::json_object(
        &req.body,
        &[
            "operation_id",
            "fence",
            "worker_incarnation",
            "result",
            "reason",
            "detail",
        ],
    )?;
    let call = agent_call(req, auth, &map)?;
    let text = |k: &str| map.get(k).and_then(Value::as_str);
    let what = match (text("result"), text("reason")) {
        (Some("confirmed"), None) => ActivationCall::Outcome {
            confirmed: true,
            reason: None,
            detail: None,
        },
        (Some("failed"), Some(reason)) if FAILED_REASONS.contains(&reason) => {
            ActivationCall::Outcome {
                confirmed: false,
                reason: Some(reason.to_string()),
                detail: text("detail").map(|d| d.chars().take(rules::MAX_REASON_CHARS).collect()),
            }
        }
        _ => {
            return Err(ApiError::bad_request(format!(
                "result is confirmed, or failed with a reason of {}",
                FAILED_REASONS.join(", ")
            ))
            .field("/result", "invalid"))
        }
    };
    let attempt = req.param("attempt").to_string();
    answered(ctx.engine.activation_call(call, attempt, what).await)
}

/// `GET .../artifacts/{digest}`: a file artifact the node's documents
/// named, at most `MAX_DOWNLOADS` at once; with `Range`, a part of it (an
/// agent on a poor line resumes instead of starting again).
pub async fn artifact(ctx: &Ctx, req: &Request, auth: &AgentAuth) -> Result<Reply, ApiError> {
    let digest = req.param("digest");
    let Ok(_turn) = ctx.downloads.clone().try_acquire_owned() else {
        return Err(
            ApiError::new(Code::Unavailable, "256 artifact downloads are running")
                .reason("busy")
                .retry_after(1),
        );
    };
    let (engine, b, wanted) = (ctx.engine.clone(), auth.binding.clone(), digest.to_string());
    let bytes =
        tokio::task::spawn_blocking(move || engine.node_artifact(&b.deployment, &b.node, &wanted))
            .await
            .map_err(|_| ApiError::internal())??;
    match bytes {
        Some(bytes) => {
            super::ranges::content_addressed(req, "application/octet-stream", digest, bytes)
        }
        None => Err(ApiError::not_found("artifact")),
    }
}
