//! Event stream routes and stream tickets (spec events.md).
//!
//! A browser's `EventSource` cannot send a header, and a token in a URL ends
//! up in access logs: a token holder asks for a ticket bound to one channel
//! and to itself, and the page passes it as `?ticket=`. Tickets live in
//! memory: after a restart a page asks for a new one (its reconnect gets a
//! plain 401, which stops `EventSource` from retrying).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use warp::http::HeaderValue;
use warp::Reply as _;

use super::auth::{self, Caller};
use super::errors::{ApiError, Code};
use super::{json_object, Ctx, Reply, Request};
use crate::events::stream::{self, ClientSlot, Reauthorize};
use crate::events::Channel;
use crate::model::{format_time, is_valid_deployment_id, now_millis, parse_build_id, Millis};
use crate::store::Lookup;

/// Tickets held at once; past it, expired ones are swept, then 503.
pub const MAX_TICKETS: usize = 100_000;

struct Ticket {
    channel: String,
    #[allow(dead_code)] // kept for the audit issue: who opened the stream
    subject: String,
    expires_at: Millis,
}

#[derive(Default)]
pub struct Tickets(Mutex<HashMap<String, Ticket>>);

impl Tickets {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Ticket>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn valid_for(&self, ticket: &str, channel: &str) -> bool {
        self.lock()
            .get(ticket)
            .is_some_and(|t| t.channel == channel && t.expires_at > now_millis())
    }
}

/// The channel a path names, if it is one of the two event routes.
fn parse_channel(path: &str) -> Option<Channel> {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        ["v1", "builds", id, "events"] => parse_build_id(id).map(Channel::Build),
        ["v1", "deployments", id, "events"] if is_valid_deployment_id(id) => {
            Some(Channel::Deployment(id.to_string()))
        }
        _ => None,
    }
}

/// `POST /v1/stream-tickets {"channel": "/v1/builds/<id>/events"}`.
pub fn ticket(ctx: &Ctx, req: &Request, caller: &Caller) -> Result<Reply, ApiError> {
    let map = json_object(&req.body, &["channel"])?;
    let channel = map.get("channel").and_then(|v| v.as_str()).unwrap_or("");
    if parse_channel(channel).is_none() {
        return Err(ApiError::bad_request(
            "channel must be /v1/builds/<build>/events or /v1/deployments/<id>/events",
        )
        .field("/channel", "channel"));
    }
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|_| ApiError::internal())?;
    let value = crate::hex::encode(&bytes);
    let ttl = i64::try_from(ctx.engine.settings.ticket_ttl.as_millis()).unwrap_or(i64::MAX);
    let expires_at = now_millis().saturating_add(ttl);
    let mut tickets = ctx.tickets.lock();
    if tickets.len() >= MAX_TICKETS {
        let now = now_millis();
        tickets.retain(|_, t| t.expires_at > now);
        if tickets.len() >= MAX_TICKETS {
            return Err(ApiError::new(
                Code::Unavailable,
                "too many stream tickets are open; try again later",
            )
            .retry_after(60));
        }
    }
    tickets.insert(
        value.clone(),
        Ticket {
            channel: channel.to_string(),
            subject: caller.subject.clone(),
            expires_at,
        },
    );
    Ok(Reply::json(
        200,
        &serde_json::json!({"ticket": value, "expires_at": format_time(expires_at)}),
    ))
}

/// The stream's credential now, and a check of it for later.
fn authorize_stream(ctx: &Arc<Ctx>, req: &Request, path: &str) -> Result<Reauthorize, ApiError> {
    let plain_401 = || {
        ApiError::new(
            Code::Unauthenticated,
            "a valid bearer token or stream ticket is required",
        )
    };
    if let Some(ticket) = req.query_one("ticket") {
        if !ctx.tickets.valid_for(ticket, path) {
            return Err(plain_401());
        }
        let (ctx, ticket, path) = (ctx.clone(), ticket.to_string(), path.to_string());
        return Ok(Box::new(move || ctx.tickets.valid_for(&ticket, &path)));
    }
    if auth::is_service_token(ctx, req) {
        // The service token cannot change while berth runs.
        return Ok(Box::new(|| true));
    }
    Err(plain_401())
}

fn cursor(req: &Request) -> Option<String> {
    req.header("last-event-id")
        .or_else(|| req.query_one("cursor"))
        .map(str::to_string)
}

fn open(
    ctx: &Arc<Ctx>,
    req: &Request,
    channel: Channel,
    reauthorize: Reauthorize,
) -> Result<warp::reply::Response, ApiError> {
    let slot = ClientSlot::take(&ctx.engine.hub, ctx.engine.settings.max_sse_clients).ok_or_else(
        || ApiError::new(Code::Unavailable, "too many event streams are open").retry_after(5),
    )?;
    let sources = stream::Sources {
        store: ctx.engine.store.clone(),
        hub: ctx.engine.hub.clone(),
        stopping: ctx.engine.stop_signal(),
    };
    let body = stream::spawn(
        sources,
        channel,
        cursor(req),
        reauthorize,
        slot,
        req.wire.clone(),
    );
    let mut response = warp::reply::stream(body).into_response();
    let h = response.headers_mut();
    h.insert(
        "content-type",
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert("cache-control", HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
}

/// `GET /v1/builds/{build}/events`.
pub fn build_events(ctx: &Arc<Ctx>, req: &Request) -> Result<warp::reply::Response, ApiError> {
    let path = format!("/v1/builds/{}/events", req.param("build"));
    let reauthorize = authorize_stream(ctx, req, &path)?;
    let id = parse_build_id(req.param("build")).ok_or_else(|| ApiError::not_found("build"))?;
    if ctx.engine.store.read()?.build(id)?.is_none() {
        return Err(ApiError::not_found("build"));
    }
    open(ctx, req, Channel::Build(id), reauthorize)
}

/// `GET /v1/deployments/{id}/events`: allowed before the deployment exists.
pub fn deployment_events(ctx: &Arc<Ctx>, req: &Request) -> Result<warp::reply::Response, ApiError> {
    let id = super::deployments::deployment_id(req)?;
    let path = format!("/v1/deployments/{id}/events");
    let reauthorize = authorize_stream(ctx, req, &path)?;
    if !ctx.engine.ready.load(std::sync::atomic::Ordering::SeqCst) {
        return Err(ApiError::new(Code::Unavailable, "the store is not ready yet").retry_after(1));
    }
    open(ctx, req, Channel::Deployment(id), reauthorize)
}
