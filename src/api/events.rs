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
    /// A callback token's holder: the stream is re-checked through the
    /// callback (`None` for the service token).
    token: Option<String>,
    /// The deployment the channel belongs to, for those re-checks.
    deployment: Option<String>,
    expires_at: Millis,
}

#[derive(Default)]
pub struct Tickets(Mutex<HashMap<String, Ticket>>);

impl Tickets {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Ticket>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The ticket's holder (token, deployment), if it is valid for `channel`.
    #[allow(clippy::type_complexity)]
    fn valid_for(&self, ticket: &str, channel: &str) -> Option<(Option<String>, Option<String>)> {
        self.lock()
            .get(ticket)
            .filter(|t| t.channel == channel && t.expires_at > now_millis())
            .map(|t| (t.token.clone(), t.deployment.clone()))
    }
}

/// The deployment a channel belongs to (a build's, for a build channel).
fn channel_deployment(ctx: &Ctx, channel: &Channel) -> Option<String> {
    match channel {
        Channel::Deployment(id) => Some(id.clone()),
        Channel::Build(b) => ctx
            .engine
            .store
            .read()
            .ok()?
            .build(*b)
            .ok()?
            .map(|b| b.deployment),
    }
}

/// Whether a callback token may stream `deployment` now.
async fn may_stream(ctx: &Ctx, token: &str, deployment: Option<&str>, path: &str) -> bool {
    let q = auth::Question {
        procedure: auth::Procedure::Stream,
        deployment,
        target_actor: None,
        method: "GET",
        path,
    };
    ctx.authz.decide(token, &q).await.allow
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
pub async fn ticket(ctx: &Ctx, req: &Request, caller: &Caller) -> Result<Reply, ApiError> {
    let map = json_object(&req.body, &["channel"])?;
    let channel = map.get("channel").and_then(|v| v.as_str()).unwrap_or("");
    let Some(parsed) = parse_channel(channel) else {
        return Err(ApiError::bad_request(
            "channel must be /v1/builds/<build>/events or /v1/deployments/<id>/events",
        )
        .field("/channel", "channel"));
    };
    let deployment = channel_deployment(ctx, &parsed);
    if let Some(token) = &caller.token {
        if !may_stream(ctx, token, deployment.as_deref(), channel).await {
            return Err(ApiError::new(
                Code::Forbidden,
                "the authorization callback denied this stream",
            ));
        }
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
            token: caller.token.clone(),
            deployment,
            expires_at,
        },
    );
    Ok(Reply::json(
        200,
        &serde_json::json!({"ticket": value, "expires_at": format_time(expires_at)}),
    ))
}

/// The stream's credential now, and a check of it for later (every
/// `REAUTHORIZE_EVERY`, through the callback for a callback token).
async fn authorize_stream(
    ctx: &Arc<Ctx>,
    req: &Request,
    path: &str,
    deployment: Option<String>,
) -> Result<Reauthorize, ApiError> {
    let plain_401 = || {
        ApiError::new(
            Code::Unauthenticated,
            "a valid bearer token or stream ticket is required",
        )
    };
    if let Some(ticket) = req.query_one("ticket") {
        let Some((token, _)) = ctx.tickets.valid_for(ticket, path) else {
            return Err(plain_401());
        };
        if let Some(token) = &token {
            if !may_stream(ctx, token, deployment.as_deref(), path).await {
                return Err(plain_401());
            }
        }
        let (ctx, ticket, path) = (ctx.clone(), ticket.to_string(), path.to_string());
        return Ok(Box::new(move || {
            let (ctx, ticket, path) = (ctx.clone(), ticket.clone(), path.clone());
            Box::pin(async move {
                match ctx.tickets.valid_for(&ticket, &path) {
                    None => false,
                    Some((None, _)) => true,
                    Some((Some(token), deployment)) => {
                        may_stream(&ctx, &token, deployment.as_deref(), &path).await
                    }
                }
            })
        }));
    }
    if auth::has_service_token(&ctx.service_token, &req.headers) {
        // The service token cannot change while berth runs.
        return Ok(Box::new(|| Box::pin(async { true })));
    }
    if let (Some(token), true) = (auth::bearer(&req.headers), ctx.authz.configured()) {
        if !may_stream(ctx, token, deployment.as_deref(), path).await {
            return Err(plain_401());
        }
        let (ctx, token, path) = (ctx.clone(), token.to_string(), path.to_string());
        return Ok(Box::new(move || {
            let (ctx, token, path, deployment) =
                (ctx.clone(), token.clone(), path.clone(), deployment.clone());
            Box::pin(async move { may_stream(&ctx, &token, deployment.as_deref(), &path).await })
        }));
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
        keep_alive: ctx.engine.settings.sse_keep_alive,
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
pub async fn build_events(
    ctx: &Arc<Ctx>,
    req: &Request,
) -> Result<warp::reply::Response, ApiError> {
    let path = format!("/v1/builds/{}/events", req.param("build"));
    let id = parse_build_id(req.param("build"));
    let deployment = id.and_then(|b| channel_deployment(ctx, &Channel::Build(b)));
    let reauthorize = authorize_stream(ctx, req, &path, deployment.clone()).await?;
    let id = id.ok_or_else(|| ApiError::not_found("build"))?;
    if deployment.is_none() {
        return Err(ApiError::not_found("build"));
    }
    open(ctx, req, Channel::Build(id), reauthorize)
}

/// `GET /v1/deployments/{id}/events`: allowed before the deployment exists.
pub async fn deployment_events(
    ctx: &Arc<Ctx>,
    req: &Request,
) -> Result<warp::reply::Response, ApiError> {
    let id = super::deployments::deployment_id(req)?;
    let path = format!("/v1/deployments/{id}/events");
    let reauthorize = authorize_stream(ctx, req, &path, Some(id.clone())).await?;
    if !ctx.engine.ready.load(std::sync::atomic::Ordering::SeqCst) {
        return Err(ApiError::new(Code::Unavailable, "the store is not ready yet").retry_after(1));
    }
    open(ctx, req, Channel::Deployment(id), reauthorize)
}
