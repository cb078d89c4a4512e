//! Event stream routes and stream tickets (spec events.md).
//!
//! A browser's `EventSource` cannot send a header, and a token in a URL ends
//! up in access logs: a token holder asks for a ticket bound to one channel
//! and to itself, and the page passes it as `?ticket=`. Tickets live in
//! memory: after a restart a page asks for a new one (its reconnect gets a
//! plain 401, which stops `EventSource` from retrying).

use crate::locks::Held;
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
    /// Who holds it (`Caller::identity`): its share of
    /// `--max-tickets-per-caller`, and of streams opened with it.
    principal: String,
    /// A callback token's holder: the stream is re-checked through the
    /// callback (`None` for the service token).
    token: Option<String>,
    /// The deployment the channel belongs to, for those re-checks.
    deployment: Option<String>,
    expires_at: Millis,
}

/// The live tickets, and each principal's in the order it got them.
#[derive(Default)]
pub struct Tickets(Mutex<TicketTable>);

#[derive(Default)]
struct TicketTable {
    by_value: HashMap<String, Ticket>,
    by_principal: HashMap<String, std::collections::VecDeque<String>>,
}

impl TicketTable {
    fn remove(&mut self, value: &str) {
        if let Some(t) = self.by_value.remove(value) {
            if let Some(mine) = self.by_principal.get_mut(&t.principal) {
                mine.retain(|v| v != value);
                if mine.is_empty() {
                    self.by_principal.remove(&t.principal);
                }
            }
        }
    }

    fn sweep(&mut self, now: Millis) {
        let expired: Vec<String> = self
            .by_value
            .iter()
            .filter(|(_, t)| t.expires_at <= now)
            .map(|(v, _)| v.clone())
            .collect();
        for value in expired {
            self.remove(&value);
        }
    }

    /// Adds a ticket; past `per_caller` live tickets of its principal, that
    /// principal's oldest is revoked (api.md "Fair shares"): one tenant can
    /// never fill the table for the others.
    fn insert(&mut self, value: String, ticket: Ticket, per_caller: usize) {
        let principal = ticket.principal.clone();
        let now = now_millis();
        let mine = self.by_principal.entry(principal.clone()).or_default();
        mine.retain(|v| self.by_value.get(v).is_some_and(|t| t.expires_at > now));
        let mut revoked = Vec::new();
        while mine.len() >= per_caller {
            if let Some(oldest) = mine.pop_front() {
                revoked.push(oldest);
            }
        }
        mine.push_back(value.clone());
        for old in revoked {
            self.by_value.remove(&old);
        }
        self.by_value.insert(value, ticket);
    }
}

impl Tickets {
    fn lock(&self) -> std::sync::MutexGuard<'_, TicketTable> {
        self.0.held()
    }

    /// Drops expired tickets (run every 30 s by `serve`, not only when the
    /// table is full).
    pub fn sweep(&self) {
        self.lock().sweep(now_millis());
    }

    /// The ticket's holder (token, deployment, principal), if it is valid
    /// for `channel`.
    #[allow(clippy::type_complexity)]
    fn valid_for(
        &self,
        ticket: &str,
        channel: &str,
    ) -> Option<(Option<String>, Option<String>, String)> {
        self.lock()
            .by_value
            .get(ticket)
            .filter(|t| t.channel == channel && t.expires_at > now_millis())
            .map(|t| (t.token.clone(), t.deployment.clone(), t.principal.clone()))
    }
}

/// The deployment a channel belongs to (a build's, for a build channel).
fn channel_deployment(ctx: &Ctx, channel: &Channel) -> Option<String> {
    match channel {
        Channel::Deployment(id) => Some(id.clone()),
        Channel::Build(b) => ctx
            .engine
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
    if tickets.by_value.len() >= MAX_TICKETS {
        tickets.sweep(now_millis());
        if tickets.by_value.len() >= MAX_TICKETS {
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
            principal: caller.identity(),
            token: caller.token.clone(),
            deployment,
            expires_at,
        },
        ctx.engine.settings.max_tickets_per_caller as usize,
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
) -> Result<(Reauthorize, String), ApiError> {
    let plain_401 = || {
        ApiError::new(
            Code::Unauthenticated,
            "a valid bearer token or stream ticket is required",
        )
    };
    if let Some(ticket) = req.query_one("ticket") {
        let Some((token, _, principal)) = ctx.tickets.valid_for(ticket, path) else {
            return Err(plain_401());
        };
        if let Some(token) = &token {
            if !may_stream(ctx, token, deployment.as_deref(), path).await {
                return Err(plain_401());
            }
        }
        let (ctx, ticket, path) = (ctx.clone(), ticket.to_string(), path.to_string());
        let check: Reauthorize = Box::new(move || {
            let (ctx, ticket, path) = (ctx.clone(), ticket.clone(), path.clone());
            Box::pin(async move {
                match ctx.tickets.valid_for(&ticket, &path) {
                    None => false,
                    Some((None, _, _)) => true,
                    Some((Some(token), deployment, _)) => {
                        may_stream(&ctx, &token, deployment.as_deref(), &path).await
                    }
                }
            })
        });
        return Ok((check, principal));
    }
    if auth::has_service_token(&ctx.service_token, &req.headers) {
        let principal = auth::trusted_caller(&req.headers)?.identity();
        // The service token cannot change while berth runs.
        return Ok((Box::new(|| Box::pin(async { true })), principal));
    }
    if let (Some(token), true) = (auth::bearer(&req.headers), ctx.authz.configured()) {
        let q = auth::Question {
            procedure: auth::Procedure::Stream,
            deployment: deployment.as_deref(),
            target_actor: None,
            method: "GET",
            path,
        };
        let decision = ctx.authz.decide(token, &q).await;
        let (true, Some(actor)) = (decision.allow, decision.actor) else {
            return Err(plain_401());
        };
        let principal = Caller {
            actor: Some(actor),
            trusted_backend: false,
            token: None,
        }
        .identity();
        let (ctx, token, path) = (ctx.clone(), token.to_string(), path.to_string());
        let check: Reauthorize = Box::new(move || {
            let (ctx, token, path, deployment) =
                (ctx.clone(), token.clone(), path.clone(), deployment.clone());
            Box::pin(async move { may_stream(&ctx, &token, deployment.as_deref(), &path).await })
        });
        return Ok((check, principal));
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
    (reauthorize, principal): (Reauthorize, String),
) -> Result<warp::reply::Response, ApiError> {
    // The caller's own share first (api.md "Fair shares"), then the
    // process-wide slot.
    let share = ctx
        .streams
        .take(&principal, ctx.engine.settings.streams_per_caller())
        .ok_or_else(|| {
            ApiError::new(
                Code::Unavailable,
                "this caller has --max-streams-per-caller event streams open; close one first",
            )
            .reason("caller_stream_limit")
            .retry_after(5)
        })?;
    let slot = ClientSlot::take(&ctx.engine.hub, ctx.engine.settings.max_sse_clients)
        .ok_or_else(|| {
            ApiError::new(Code::Unavailable, "too many event streams are open").retry_after(5)
        })?
        .with(Box::new(share));
    let sources = stream::Sources {
        store: ctx.engine.reader(),
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
