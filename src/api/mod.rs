//! The HTTP layer: thin handlers that parse, authorize, call the engine and
//! map errors.
//!
//! One warp filter takes every request; `dispatch` matches it against
//! `routes::ROUTES` (the same table `GET /v1/openapi.json` is checked
//! against), so unknown routes get 404, wrong methods 405 with `Allow`, and
//! every error carries the request id, all in one place; a token route is
//! authenticated (`routes::authorize`) before its body is read, and its
//! handler gets the authenticated caller.
//!
//! A request's path: `serve::accept_loop` gives each connection a
//! `wire::Conn` and hyper's HTTP/1.1 server; the filter calls `handle` ->
//! `dispatch`, which matches the route (404/405), checks the header size,
//! and for a token route calls `routes::authorize` *before the body*: the
//! service token (actor headers checked) or the authorization callback asked
//! the route's question (`auth::Authz::decide`, cached); a refusal is audited
//! (`audit::refused`) and answered with `Connection: close`. Then the body up
//! to `--max-body` (413, within its share of `--max-body-bytes-in-flight`,
//! within `--body-timeout`), the content type (415), and the handler of the
//! route's class (`routes::public`, `token`, `mutation`, `stream`). A mutation
//! runs under `idempotency::mutation` (per-key lock, replay, conflict), hands
//! the engine a `Write` (its audit draft and the hook that stores its
//! answer), and writes its audit event alone when it ends in an error.

pub mod agents;
pub mod audit;
pub mod auth;
pub mod builds;
pub mod cors;
pub mod cursor;
pub mod deployments;
pub mod derive;
pub mod errors;
pub mod events;
pub mod freeze;
pub mod idempotency;
pub mod metrics;
pub mod ops;
pub mod page;
pub mod ranges;
pub mod routes;
pub mod sboms;
pub mod webhooks;
pub mod workers;

pub use routes::ROUTES;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use serde::Serialize;
use warp::http::{HeaderMap, HeaderValue, Method, StatusCode};
use warp::Filter;

use crate::engine::Engine;
use errors::{ApiError, Code};

/// Total size of request headers berth accepts.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// A JSON body may nest this deep at most.
pub const MAX_JSON_DEPTH: usize = 64;
/// Times a GET that raced a store reopen is run again.
pub(crate) const READ_RETRIES: u32 = 5;
/// How long a read waits before it runs again on a reopening store.
const READ_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(20);

/// A response before it becomes HTTP: what the idempotency store keeps.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub content_type: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    /// A JSON answer. Encoding berth's own answer types does not fail (string
    /// keys, finite numbers); if one ever did, the client gets a 500, never
    /// a success with an empty body.
    pub fn json<T: Serialize + ?Sized>(status: u16, value: &T) -> Reply {
        match serde_json::to_vec(value) {
            Ok(body) => Reply {
                status,
                content_type: "application/json".into(),
                headers: vec![],
                body,
            },
            Err(e) => {
                tracing::error!(error = %e, status, "cannot encode an answer");
                Reply::from_error(&ApiError::internal(), "")
            }
        }
    }
    pub fn text(status: u16, content_type: &str, body: Vec<u8>) -> Reply {
        Reply {
            status,
            content_type: content_type.into(),
            headers: vec![],
            body,
        }
    }
    pub fn header(mut self, name: &str, value: impl Into<String>) -> Reply {
        self.headers.push((name.to_string(), value.into()));
        self
    }
    pub fn from_error(e: &ApiError, request_id: &str) -> Reply {
        let mut r = Reply::text(
            e.code.status(),
            "application/problem+json",
            e.body(request_id),
        );
        if let Some(s) = e.retry_after {
            r = r.header("Retry-After", s.to_string());
        }
        if let Some(allow) = &e.allow {
            r = r.header("Allow", allow.clone());
        }
        if let Some(range) = &e.content_range {
            r = r.header("Content-Range", range.clone());
        }
        if e.close {
            r = r.header("Connection", "close");
        }
        r
    }
}

/// What every handler gets.
pub struct Ctx {
    pub engine: Arc<Engine>,
    pub service_token: String,
    pub cursor_key: Vec<u8>,
    /// One request at a time per idempotency identity.
    pub idempotency: crate::locks::KeyLocks,
    pub tickets: events::Tickets,
    /// Open event streams per principal (`--max-streams-per-caller`).
    pub streams: crate::locks::Quotas,
    /// Open worker polls: per worker, and all of them under `ALL_POLLS`.
    pub polls: crate::locks::Quotas,
    /// Artifact downloads at once (`activations::MAX_DOWNLOADS`).
    pub downloads: Arc<tokio::sync::Semaphore>,
    /// Agents' open desired-state streams, per token.
    pub agent_streams: agents::Streams,
    /// Derivations running at once (see `derive::MAX_DERIVATIONS`).
    pub derivations: derive::Derivations,
    /// Bytes of request bodies in memory at once.
    pub body_budget: BodyBudget,
    /// The authorization callback and its answer cache.
    pub authz: auth::Authz,
    /// The replicas, with a store in PostgreSQL (`GET /v1/cluster`).
    pub cluster: Option<Arc<crate::store::upstream::Status>>,
}

/// One parsed request.
pub struct Request {
    pub method: Method,
    pub route: &'static str,
    pub params: HashMap<&'static str, String>,
    pub query: Vec<(String, String)>,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub request_id: String,
    /// The connection, when an event stream may take it over (HTTP/1.1).
    pub wire: Option<Arc<crate::wire::Wire>>,
    /// A route whose body is a file (`Handler::file_body_limit`): the body
    /// received into one; `body` then holds its digest, which is what an
    /// idempotency key's body check compares.
    pub upload: Option<crate::engine::staging::Upload>,
}

/// The connection a request came on, put in its extensions by `serve`.
#[derive(Clone)]
pub struct WireHandle(pub Arc<crate::wire::Wire>);

/// The answer to an `{id}` berth could not have made.
pub fn invalid_deployment_id() -> ApiError {
    ApiError::bad_request(
        "a deployment id is a DNS label of at most 40 characters: a-z, 0-9 and inner -",
    )
    .field("/path/id", "deployment_id")
}

impl Request {
    /// The `{id}` of the path, checked (FR-002).
    pub fn deployment_id(&self) -> Result<String, ApiError> {
        let id = self.param("id");
        if !crate::model::is_valid_deployment_id(id) {
            return Err(invalid_deployment_id());
        }
        Ok(id.to_string())
    }

    pub fn param(&self, name: &str) -> &str {
        self.params.get(name).map(String::as_str).unwrap_or("")
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn query_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.query
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    pub fn query_one(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The one warp filter: everything goes through `handle`.
pub fn filter(
    ctx: Arc<Ctx>,
) -> impl Filter<Extract = (warp::reply::Response,), Error = Infallible> + Clone {
    let query = warp::query::raw().or(warp::any().map(String::new)).unify();
    warp::any()
        .and(warp::method())
        .and(warp::path::full())
        .and(query)
        .and(warp::header::headers_cloned())
        .and(warp::body::stream())
        .and(warp::ext::optional::<WireHandle>())
        .then(
            move |method,
                  path: warp::path::FullPath,
                  query: String,
                  headers: HeaderMap,
                  body,
                  wire: Option<WireHandle>| {
                let ctx = ctx.clone();
                let wire = wire.map(|w| w.0);
                async move {
                    let head = Head {
                        method,
                        path: path.as_str().to_string(),
                        query,
                        headers,
                        wire,
                    };
                    handle(ctx, head, body).await
                }
            },
        )
        .recover(|_| async {
            Ok::<_, Infallible>(into_http(
                Reply::from_error(&ApiError::internal(), "-"),
                "-",
            ))
        })
        .unify()
}

fn valid_request_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
}

/// A request as it arrives, before its route is known.
struct Head {
    method: Method,
    path: String,
    query: String,
    headers: HeaderMap,
    wire: Option<Arc<crate::wire::Wire>>,
}

async fn handle<S, B>(ctx: Arc<Ctx>, head: Head, body: S) -> warp::reply::Response
where
    S: futures_util::Stream<Item = Result<B, warp::Error>> + Unpin,
    B: bytes::Buf,
{
    let request_id = head
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| valid_request_id(v))
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::now_v7().simple().to_string());
    let origins = &ctx.engine.settings.cors_origin;
    let origin = cors::allowed_origin(origins, &head.headers);
    if origin.is_some() {
        if let Some(mut response) = cors::preflight(&head.method, &head.headers, &head.path) {
            cors::decorate(origins, origin, &mut response);
            return response;
        }
    }
    let (route, reply) = match dispatch(&ctx, head, body, &request_id).await {
        Ok((route, Answer::Reply(r))) => (route, r),
        Ok((route, Answer::Stream(mut response))) => {
            metrics::count_request(&ctx, route, response.status().as_u16());
            if let Ok(v) = HeaderValue::from_str(&request_id) {
                response.headers_mut().insert("x-request-id", v);
            }
            cors::decorate(origins, origin, &mut response);
            return response;
        }
        Err((route, e)) => (route, Reply::from_error(&e, &request_id)),
    };
    if reply.status >= 500 {
        tracing::warn!(%request_id, route, status = reply.status, "request failed");
    }
    metrics::count_request(&ctx, route, reply.status);
    let mut response = into_http(reply, &request_id);
    cors::decorate(origins, origin, &mut response);
    response
}

/// A handler's answer: a stored-able reply, or a live event stream.
pub enum Answer {
    Reply(Reply),
    Stream(warp::reply::Response),
}

/// A matched route with the credential its class needs: a token route's
/// handler can only be reached with its caller authenticated.
enum Bound {
    Public(routes::PublicCall),
    Metrics,
    Stream(routes::StreamCall),
    Token(routes::TokenCall, routes::Authorized),
    Mutation(routes::MutationCall, routes::Audit, routes::Authorized),
    Worker(routes::WorkerCall, workers::WorkerAuth),
    Agent(routes::AgentCall, agents::AgentAuth),
}

type Dispatched = Result<(&'static str, Answer), (&'static str, ApiError)>;

/// Finds the route; answers 404/405/413/415 itself; calls the handler.
async fn dispatch<S, B>(ctx: &Arc<Ctx>, head: Head, body: S, request_id: &str) -> Dispatched
where
    S: futures_util::Stream<Item = Result<B, warp::Error>> + Unpin,
    B: bytes::Buf,
{
    let Head {
        method,
        path,
        query,
        headers,
        wire,
    } = head;
    let (matched, params) = find_route(&method, &path).map_err(|e| ("unknown", e))?;
    let route = matched.template;
    let fail = |e: ApiError| Err((route, e));
    let query = parse_query(&query);
    // A token route authenticates (and asks the callback) before reading a
    // byte of the body, and a refusal closes: an unauthenticated client
    // cannot make berth hold its upload.
    let authorize = |ask, audit| {
        routes::authorize(
            ctx,
            ask,
            audit,
            &params,
            &query,
            &headers,
            method.as_str(),
            &path,
            request_id,
        )
    };
    let internal = Internal {
        ctx,
        headers: &headers,
        params: &params,
    };
    let bound = match bind(matched.handler, authorize, internal).await {
        Ok(bound) => bound,
        Err(mut e) => {
            e.close = true;
            return fail(e);
        }
    };
    // The body's share of --max-body-bytes-in-flight is held until the
    // request is answered.
    let (body, upload, _body_share) =
        match request_body(ctx, matched.handler, &method, &headers, body).await {
            Ok(read) => read,
            Err(e) => {
                // After authentication a refusal is the caller's (audit.md).
                if let Bound::Mutation(_, audit_as, who) = &bound {
                    routes::audit_failure(ctx, *audit_as, &params, request_id, who, &e).await;
                }
                return fail(e);
            }
        };
    let req = Request {
        method,
        route,
        params,
        query,
        headers,
        body,
        request_id: request_id.to_string(),
        wire,
        upload,
    };
    // A read that raced a store reopen (after an I/O error) runs again.
    let answer = reading(
        || run_handler(ctx, &bound, &req),
        |e: &ApiError| e.retry_read && req.method == Method::GET,
    )
    .await;
    match answer {
        Ok(r) => Ok((route, r)),
        Err(e) => fail(e),
    }
}

/// A query string as its pairs, percent-decoded.
fn parse_query(query: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(query.as_bytes())
        .into_owned()
        .collect()
}

/// What an internal route's token is checked against.
struct Internal<'a> {
    ctx: &'a Ctx,
    headers: &'a HeaderMap,
    params: &'a routes::Params,
}

/// A route's handler with the credential its class needs (`authorize`,
/// for the classes that take a token).
async fn bind<Fut>(
    handler: routes::Handler,
    authorize: impl Fn(routes::Ask, Option<routes::Audit>) -> Fut,
    internal: Internal<'_>,
) -> Result<Bound, ApiError>
where
    Fut: std::future::Future<Output = Result<routes::Authorized, ApiError>>,
{
    match handler {
        routes::Handler::Public(call) => Ok(Bound::Public(call)),
        routes::Handler::Metrics => Ok(Bound::Metrics),
        routes::Handler::Stream(call) => Ok(Bound::Stream(call)),
        routes::Handler::Token(call, ask) => authorize(ask, None)
            .await
            .map(|who| Bound::Token(call, who)),
        routes::Handler::Mutation(call, ask, audit) => authorize(ask, Some(audit))
            .await
            .map(|who| Bound::Mutation(call, audit, who)),
        routes::Handler::Worker(call) => workers::authenticate(internal.ctx, internal.headers)
            .map(|auth| Bound::Worker(call, auth)),
        routes::Handler::Agent(call) => {
            let path = (
                internal.params.get("deployment"),
                internal.params.get("node"),
            );
            agents::authenticate(internal.ctx, internal.headers, path)
                .map(|auth| Bound::Agent(call, auth))
        }
    }
}

/// Runs the handler of a bound route.
async fn run_handler(ctx: &Arc<Ctx>, bound: &Bound, req: &Request) -> Result<Answer, ApiError> {
    match bound {
        Bound::Public(call) => routes::public(ctx, *call, req).await,
        Bound::Metrics => routes::metrics(ctx, req),
        Bound::Stream(call) => routes::stream(ctx, *call, req).await,
        Bound::Token(call, who) => routes::token(ctx, *call, req, &who.caller).await,
        Bound::Mutation(call, audit, who) => routes::mutation(ctx, *call, *audit, req, who).await,
        Bound::Worker(call, auth) => routes::worker(ctx, *call, req, auth).await,
        Bound::Agent(call, auth) => routes::agent(ctx, *call, req, auth).await,
    }
}

/// The route `method` and `path` name, with its params; a 404, or a 405
/// with the methods the path takes (`Allow`).
fn find_route(
    method: &Method,
    path: &str,
) -> Result<(&'static routes::Route, routes::Params), ApiError> {
    let segments = routes::path_segments(path);
    let mut allowed = Vec::new();
    let mut found = None;
    for r in ROUTES {
        if let Some(params) = routes::match_template(r.template, &segments) {
            if r.method == method.as_str() {
                found = Some((r, params));
            } else {
                allowed.push(r.method);
            }
        }
    }
    if let Some(found) = found {
        return Ok(found);
    }
    if allowed.is_empty() {
        return Err(ApiError::new(Code::NotFound, "no such route"));
    }
    let mut e = ApiError::new(
        Code::MethodNotAllowed,
        "this route does not take that method",
    );
    e.allow = Some(allowed.join(", "));
    Err(e)
}

/// Runs `read` again while it fails on a store that is reopening after an
/// I/O error (`reopening`), at most `READ_RETRIES` times
/// `READ_RETRY_PAUSE` apart: the one place a read waits out a reopen.
pub(crate) async fn reading<T, E, Fut>(
    mut read: impl FnMut() -> Fut,
    reopening: impl Fn(&E) -> bool,
) -> Result<T, E>
where
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut attempts = 0;
    loop {
        match read().await {
            Err(e) if reopening(&e) && attempts < READ_RETRIES => {
                attempts += 1;
                tokio::time::sleep(READ_RETRY_PAUSE).await;
            }
            done => return done,
        }
    }
}

/// A request's body: a file for a route whose body is one (its digest as
/// `body`, the `Upload` beside it), else `checked_body`'s.
async fn request_body<S, B>(
    ctx: &Ctx,
    handler: routes::Handler,
    method: &Method,
    headers: &HeaderMap,
    body: S,
) -> Result<
    (
        Bytes,
        Option<crate::engine::staging::Upload>,
        Option<tokio::sync::OwnedSemaphorePermit>,
    ),
    ApiError,
>
where
    S: futures_util::Stream<Item = Result<B, warp::Error>> + Unpin,
    B: bytes::Buf,
{
    match handler.file_body_limit(&ctx.engine.settings) {
        Some(limit) => {
            let upload = receive_upload(ctx, headers, body, limit).await?;
            Ok((Bytes::from(upload.digest.clone()), Some(upload), None))
        }
        None => {
            let (body, share) = checked_body(ctx, method, headers, body).await?;
            Ok((body, None, share))
        }
    }
}

/// What every request with a credential passes after it: headers of at
/// most `MAX_HEADER_BYTES`, a body of at most `--max-body` (within its
/// share of `--max-body-bytes-in-flight`) that arrives within
/// `--body-timeout`, of type `application/json`. The body, and its share
/// of the budget.
async fn checked_body<S, B>(
    ctx: &Ctx,
    method: &Method,
    headers: &HeaderMap,
    body: S,
) -> Result<(Bytes, Option<tokio::sync::OwnedSemaphorePermit>), ApiError>
where
    S: futures_util::Stream<Item = Result<B, warp::Error>> + Unpin,
    B: bytes::Buf,
{
    let header_bytes: usize = headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    if header_bytes > MAX_HEADER_BYTES {
        return Err(
            ApiError::bad_request("the request headers are larger than 16 KiB")
                .field("/headers", "too_large"),
        );
    }
    let max_body = ctx.engine.settings.max_body;
    let declared = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max_body as u64) {
        return Err(too_large(max_body));
    }
    let read = read_body(body, max_body, declared, &ctx.body_budget);
    let (body, share) = match tokio::time::timeout(ctx.engine.settings.body_timeout, read).await {
        Ok(read) => read?,
        Err(_) => {
            let mut e = ApiError::bad_request("the body did not arrive within --body-timeout")
                .field("", "body_timeout");
            e.close = true;
            return Err(e);
        }
    };
    if !body.is_empty() && method != Method::GET {
        let ct = headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let mime = ct
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if mime != "application/json" {
            return Err(ApiError::new(
                Code::UnsupportedMediaType,
                "the body must be application/json",
            ));
        }
    }
    Ok((body, share))
}

/// A file body's time: `--body-timeout` for each `UPLOAD_BYTES_PER_TIMEOUT`
/// of its declared length (or of its limit), so a large upload on a slow
/// link is not cut while a stalled one still is.
const UPLOAD_BYTES_PER_TIMEOUT: u64 = 8 << 20;

/// Receives a file body (at most `limit` bytes) into a file under the
/// staging root's `incoming/`, hashing it as it arrives. The file goes
/// when the `Upload` is dropped, unless a handler moved it into place.
async fn receive_upload<S, B>(
    ctx: &Ctx,
    headers: &HeaderMap,
    body: S,
    limit: u64,
) -> Result<crate::engine::staging::Upload, ApiError>
where
    S: futures_util::Stream<Item = Result<B, warp::Error>> + Unpin,
    B: bytes::Buf,
{
    let too_large = || {
        ApiError::new(
            Code::PayloadTooLarge,
            format!("the body is larger than this route allows ({limit} bytes)"),
        )
    };
    let declared = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let periods = 1 + declared.unwrap_or(limit) / UPLOAD_BYTES_PER_TIMEOUT;
    let allowed = ctx
        .engine
        .settings
        .body_timeout
        .saturating_mul(u32::try_from(periods).unwrap_or(u32::MAX));
    match tokio::time::timeout(allowed, write_upload(ctx, body, limit)).await {
        Ok(Ok(Some(upload))) => Ok(upload),
        Ok(Ok(None)) => Err(too_large()),
        Ok(Err(e)) => Err(e),
        Err(_) => {
            let mut e =
                ApiError::bad_request("the body did not arrive in time (--body-timeout per 8 MiB)")
                    .field("", "body_timeout");
            e.close = true;
            Err(e)
        }
    }
}

/// The body into a new file; `None` when it passed `limit`.
async fn write_upload<S, B>(
    ctx: &Ctx,
    mut body: S,
    limit: u64,
) -> Result<Option<crate::engine::staging::Upload>, ApiError>
where
    S: futures_util::Stream<Item = Result<B, warp::Error>> + Unpin,
    B: bytes::Buf,
{
    use sha2::Digest;
    use tokio::io::AsyncWriteExt;
    let dir = ctx.engine.incoming_dir();
    let failed = |e: std::io::Error| {
        tracing::error!(error = %e, dir = %dir.display(), "cannot receive an upload");
        ApiError::new(Code::Unavailable, "the upload cannot be stored now").retry_after(5)
    };
    tokio::fs::create_dir_all(&dir).await.map_err(failed)?;
    let mut upload = crate::engine::staging::Upload {
        path: dir.join(uuid::Uuid::now_v7().simple().to_string()),
        digest: String::new(),
        len: 0,
    };
    let mut file = tokio::fs::File::create(&upload.path)
        .await
        .map_err(failed)?;
    let mut hasher = sha2::Sha256::new();
    while let Some(chunk) = body.next().await {
        let mut chunk = chunk.map_err(|_| ApiError::bad_request("the body could not be read"))?;
        while chunk.has_remaining() {
            let part = chunk.chunk();
            upload.len += part.len() as u64;
            if upload.len > limit {
                return Ok(None);
            }
            hasher.update(part);
            file.write_all(part).await.map_err(failed)?;
            let n = part.len();
            chunk.advance(n);
        }
    }
    file.flush().await.map_err(failed)?;
    upload.digest = format!("sha256:{}", crate::hex::encode(&hasher.finalize()));
    Ok(Some(upload))
}

fn too_large(max: usize) -> ApiError {
    ApiError::new(
        Code::PayloadTooLarge,
        format!("the body is larger than --max-body ({max} bytes)"),
    )
}

/// The bytes of request bodies in memory at once, across every request
/// (`--max-body-bytes-in-flight`); a body holds its share until its request
/// is answered.
pub struct BodyBudget(Arc<tokio::sync::Semaphore>);

impl BodyBudget {
    pub fn new(bytes: usize) -> BodyBudget {
        BodyBudget(Arc::new(tokio::sync::Semaphore::new(bytes)))
    }
}

async fn read_body<S, B>(
    mut body: S,
    limit: usize,
    declared: Option<u64>,
    budget: &BodyBudget,
) -> Result<(Bytes, Option<tokio::sync::OwnedSemaphorePermit>), ApiError>
where
    S: futures_util::Stream<Item = Result<B, warp::Error>> + Unpin,
    B: bytes::Buf,
{
    // Refused, not waited for: a full budget means many bodies at once.
    let take = |bytes: usize| {
        let n = u32::try_from(bytes).map_err(|_| too_large(limit))?;
        budget.0.clone().try_acquire_many_owned(n).map_err(|_| {
            let mut e = ApiError::new(
                Code::Unavailable,
                "too many request bodies are in memory; try again shortly",
            )
            .retry_after(1);
            e.close = true;
            e
        })
    };
    // A declared length takes its whole share (and its buffer) before the
    // first byte: the buffer never doubles past it, and a body that cannot
    // fit the budget is refused at once instead of after it trickled in.
    let mut share: Option<tokio::sync::OwnedSemaphorePermit> = None;
    let mut reserved = 0usize;
    let mut out = match declared {
        Some(n) if n > 0 => {
            let n = usize::try_from(n).map_err(|_| too_large(limit))?.min(limit);
            share = Some(take(n)?);
            reserved = n;
            BytesMut::with_capacity(n)
        }
        _ => BytesMut::new(),
    };
    while let Some(chunk) = body.next().await {
        let mut chunk = chunk.map_err(|_| ApiError::bad_request("the body could not be read"))?;
        if out.len() + chunk.remaining() > limit {
            return Err(too_large(limit));
        }
        let beyond = (out.len() + chunk.remaining()).saturating_sub(reserved);
        if beyond > 0 {
            let permit = take(beyond)?;
            reserved += beyond;
            match share.as_mut() {
                Some(s) => s.merge(permit),
                None => share = Some(permit),
            }
        }
        while chunk.has_remaining() {
            let part = chunk.chunk();
            out.extend_from_slice(part);
            let n = part.len();
            chunk.advance(n);
        }
    }
    Ok((out.freeze(), share))
}

fn into_http(reply: Reply, request_id: &str) -> warp::reply::Response {
    let mut response = warp::reply::Response::new(reply.body.into());
    *response.status_mut() =
        StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&reply.content_type) {
        h.insert("content-type", v);
    }
    for (name, value) in &reply.headers {
        if let (Ok(n), Ok(v)) = (
            warp::http::HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            h.append(n, v);
        }
    }
    if let Ok(v) = HeaderValue::from_str(request_id) {
        h.insert("x-request-id", v);
    }
    response
}

/// Parses a JSON body at most `MAX_JSON_DEPTH` deep; the error says where,
/// never what.
pub fn parse_json(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    let value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "the body is not valid JSON (line {}, column {})",
            e.line(),
            e.column()
        ))
        .field("", "malformed_json")
    })?;
    if depth(&value) > MAX_JSON_DEPTH {
        return Err(
            ApiError::bad_request("the body nests deeper than 64 levels").field("", "too_deep"),
        );
    }
    Ok(value)
}

/// Parses a JSON body into an object, with the errors of the contract:
/// not JSON, not an object, nested too deep, keys not in `allowed`.
pub fn json_object(
    body: &[u8],
    allowed: &[&str],
) -> Result<serde_json::Map<String, serde_json::Value>, ApiError> {
    let value = parse_json(body)?;
    let serde_json::Value::Object(map) = value else {
        return Err(ApiError::bad_request("the body must be a JSON object").field("", "type"));
    };
    let unknown = map
        .keys()
        .filter(|k| !allowed.contains(&k.as_str()))
        .count();
    if unknown > 0 {
        return Err(ApiError::bad_request(format!(
            "the body has {unknown} unknown field(s); this server knows: {}",
            allowed.join(", ")
        ))
        .field("", "unknown_field"));
    }
    Ok(map)
}

fn depth(v: &serde_json::Value) -> usize {
    // Iterative, so a hostile body cannot overflow the stack here.
    let mut max = 0;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, d)) = stack.pop() {
        max = max.max(d);
        match v {
            serde_json::Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            serde_json::Value::Object(m) => stack.extend(m.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    max
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_object_errors_never_echo_the_body() {
        let e = json_object(br#"{"secret-field-name": 1}"#, &["configuration"]).unwrap_err();
        assert!(!e.message.contains("secret"));
        assert_eq!(e.code, Code::InvalidRequest);
        assert!(json_object(b"[1]", &[]).is_err());
        assert!(json_object(b"{\"a\":", &["a"]).is_err());
        let deep = "[".repeat(70) + &"]".repeat(70);
        let e = json_object(format!("{{\"a\":{deep}}}").as_bytes(), &["a"]).unwrap_err();
        assert_eq!(e.fields[0].code, "too_deep");
    }
}
