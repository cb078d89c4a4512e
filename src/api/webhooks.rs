//! Webhook routes (notifications.md "Subscriptions"): the service token
//! only. The secret is in the answers that make one (create, rotate) and
//! nowhere else.

use serde_json::{json, Value};

use super::auth::Caller;
use super::cursor::page_limit;
use super::errors::ApiError;
use super::idempotency::Write;
use super::{cursor, Ctx, Reply, Request};
use crate::engine::outbox::EVENT_TYPES;
use crate::engine::webhooks::{NewSubscription, Subscription};
use crate::model::{format_time, is_valid_deployment_id};
use crate::store::{DeliveryRecord, Lookup};

/// A webhook URL's length at most.
const MAX_URL_BYTES: usize = 2048;
/// Event types one subscription names at most.
const MAX_EVENTS: usize = 16;
/// Deployments one subscription names at most.
const MAX_DEPLOYMENTS: usize = 200;
/// A description's length at most.
const MAX_DESCRIPTION_CHARS: usize = 500;

fn view(s: &Subscription, with_secret: bool) -> Value {
    let mut v = json!({
        "id": uuid::Uuid::from_u128(s.id).to_string(),
        "url": s.record.url,
        "events": s.record.events,
        "deployments": s.record.deployments,
        "description": s.record.description,
        "created_at": format_time(s.record.created_at),
    });
    if with_secret {
        v["secret"] = json!(s.record.secret);
    }
    v
}

fn delivery_view(id: u128, d: &DeliveryRecord) -> Value {
    json!({
        "id": uuid::Uuid::from_u128(id).to_string(),
        "event_type": d.event_type,
        "webhook_id_header": d.message_id,
        "created_at": format_time(d.created_at),
        "status": d.status,
        "attempts": d.attempts,
        "last_attempt_at": d.last_attempt_at.map(format_time),
        "last_status_code": d.last_status_code,
        "last_error": d.last_error,
        "next_attempt_at": d.next_attempt_at.map(format_time),
    })
}

/// The `{webhook}` of the path; one that is not a UUID names none.
fn webhook_id(req: &Request) -> Result<u128, ApiError> {
    uuid::Uuid::parse_str(req.param("webhook"))
        .map(|u| u.as_u128())
        .map_err(|_| ApiError::not_found("webhook"))
}

/// `POST /v1/webhooks`: 201 with the subscription and its secret.
pub async fn create(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let map = super::json_object(&req.body, &["url", "events", "deployments", "description"])?;
    let url = checked_url(map.get("url"), &ctx.engine.webhook_rule)?;
    let events = checked_events(map.get("events"))?;
    let deployments = checked_deployments(map.get("deployments"))?;
    let description = match map.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) if d.chars().count() <= MAX_DESCRIPTION_CHARS => Some(d.clone()),
        _ => {
            return Err(bad(
                "/description",
                "type",
                "description must be null or a string of at most 500 characters",
            ))
        }
    };
    let record = w.record(|s: &Subscription| Reply::json(201, &view(s, true)));
    let made = ctx
        .engine
        .create_webhook(
            NewSubscription {
                url,
                events,
                deployments,
                description,
            },
            record,
        )
        .await?;
    Ok(Reply::json(201, &view(&made, true)))
}

/// A refusal of one field of a new subscription.
fn bad(pointer: &str, code: &str, message: &str) -> ApiError {
    ApiError::bad_request(message.to_string()).field(pointer, code)
}

/// A subscription's `url`: http(s), at most `MAX_URL_BYTES`, no userinfo,
/// one of `--webhook-origin`'s origins spelled as configured, then a path
/// (`rule`, the pattern the served document states).
fn checked_url(
    url: Option<&Value>,
    rule: &crate::engine::OriginUrlRule,
) -> Result<String, ApiError> {
    let url = match url {
        Some(Value::String(u)) if u.len() <= MAX_URL_BYTES => u.clone(),
        _ => {
            return Err(bad(
                "/url",
                "type",
                "url must be a string of at most 2048 bytes",
            ))
        }
    };
    let parsed = reqwest::Url::parse(&url)
        .ok()
        .filter(|u| matches!(u.scheme(), "http" | "https"));
    let Some(parsed) = parsed else {
        return Err(bad("/url", "format", "url must be an http or https URL"));
    };
    // A password in the URL would be stored and shown in every listing.
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(bad(
            "/url",
            "webhook_userinfo",
            "url must not carry a user name or password; authenticate the receiver by the signature",
        ));
    }
    if !rule.takes(&url) {
        return Err(bad(
            "/url",
            "webhook_origin_not_allowed",
            "the url's origin is not one --webhook-origin allows",
        ));
    }
    Ok(url)
}

/// A subscription's `events`: 1 to `MAX_EVENTS` known types, or `["*"]`.
fn checked_events(events: Option<&Value>) -> Result<Vec<String>, ApiError> {
    match events {
        Some(Value::Array(list)) if !list.is_empty() && list.len() <= MAX_EVENTS => list
            .iter()
            .map(|e| match e.as_str() {
                Some(name) if name == "*" || EVENT_TYPES.contains(&name) => Ok(name.to_string()),
                _ => Err(bad(
                    "/events",
                    "unknown_event_type",
                    "events must name known event types (notifications.md), or be [\"*\"]",
                )),
            })
            .collect(),
        _ => Err(bad(
            "/events",
            "type",
            "events must be a list of 1 to 16 event types",
        )),
    }
}

/// A subscription's `deployments`: null (all), or at most
/// `MAX_DEPLOYMENTS` deployment ids.
fn checked_deployments(deployments: Option<&Value>) -> Result<Option<Vec<String>>, ApiError> {
    match deployments {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(list)) if list.len() <= MAX_DEPLOYMENTS => list
            .iter()
            .map(|d| match d.as_str() {
                Some(id) if is_valid_deployment_id(id) => Ok(id.to_string()),
                _ => Err(bad(
                    "/deployments",
                    "format",
                    "deployments must be deployment ids",
                )),
            })
            .collect::<Result<_, _>>()
            .map(Some),
        _ => Err(bad(
            "/deployments",
            "type",
            "deployments must be null or a list of at most 200 deployment ids",
        )),
    }
}

/// `GET /v1/webhooks`: every subscription (at most `--max-webhooks`, one
/// page).
pub fn list(ctx: &Ctx) -> Result<Reply, ApiError> {
    let items: Vec<Value> = ctx
        .engine
        .read()?
        .webhooks()?
        .into_iter()
        .map(|(id, record)| view(&Subscription { id, record }, false))
        .collect();
    Ok(Reply::json(
        200,
        &json!({"items": items, "next_cursor": null}),
    ))
}

/// `GET /v1/webhooks/{webhook}`.
pub fn read(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let id = webhook_id(req)?;
    let record = ctx
        .engine
        .read()?
        .webhook(id)?
        .ok_or_else(|| ApiError::not_found("webhook"))?;
    Ok(Reply::json(200, &view(&Subscription { id, record }, false)))
}

/// `DELETE /v1/webhooks/{webhook}`: 200 with what was deleted.
pub async fn delete(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let id = webhook_id(req)?;
    let record = w.record(|s: &Subscription| Reply::json(200, &view(s, false)));
    let gone = ctx.engine.delete_webhook(id, record).await?;
    Ok(Reply::json(200, &view(&gone, false)))
}

/// `POST /v1/webhooks/{webhook}/rotate-secret`: 200 with the new secret.
pub async fn rotate(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let id = webhook_id(req)?;
    let record = w.record(|s: &Subscription| Reply::json(200, &view(s, true)));
    let rotated = ctx.engine.rotate_webhook_secret(id, record).await?;
    Ok(Reply::json(200, &view(&rotated, true)))
}

/// `POST /v1/webhooks/{webhook}/test`: 202, one `ping` queued.
pub async fn test(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let id = webhook_id(req)?;
    let record = w.record(|s: &Subscription| Reply::json(202, &view(s, false)));
    let pinged = ctx.engine.ping_webhook(id, record).await?;
    Ok(Reply::json(202, &view(&pinged, false)))
}

/// `GET /v1/webhooks/{webhook}/deliveries`: newest first.
pub fn deliveries(ctx: &Ctx, req: &Request, caller: &Caller) -> Result<Reply, ApiError> {
    let id = webhook_id(req)?;
    let limit = page_limit(req)?;
    let filter = format!("webhook={id:032x}");
    let before = match req.query_one("cursor") {
        Some(c) => {
            let position = cursor::decode(&ctx.cursor_key, &caller.identity(), &filter, c)?;
            Some(u128::from_str_radix(&position, 16).map_err(|_| ApiError::internal())?)
        }
        None => None,
    };
    let rx = ctx.engine.read()?;
    if rx.webhook(id)?.is_none() {
        return Err(ApiError::not_found("webhook"));
    }
    let mut page = rx.deliveries(id, before, limit + 1)?;
    let next_cursor = (page.len() > limit).then(|| {
        page.truncate(limit);
        page.last().map(|(last, _)| {
            cursor::encode(
                &ctx.cursor_key,
                &caller.identity(),
                &filter,
                &format!("{last:032x}"),
            )
        })
    });
    let items: Vec<Value> = page.iter().map(|(d, r)| delivery_view(*d, r)).collect();
    Ok(Reply::json(
        200,
        &json!({"items": items, "next_cursor": next_cursor.flatten()}),
    ))
}
