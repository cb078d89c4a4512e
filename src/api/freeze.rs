//! Freezes (rollouts.md "Freeze"): the global one (`/v1/freeze`) and each
//! deployment's (`/v1/deployments/{id}/freeze`). Thin: the body's rules
//! here, the rest in `engine::freeze`.

use serde_json::{json, Value};

use super::errors::ApiError;
use super::idempotency::Write;
use super::{Ctx, Reply, Request};
use crate::engine::freeze::{self, FreezeChanged, Scope};
use crate::model::*;
use crate::store::Lookup;

fn bad(pointer: &str, code: &str, message: &str) -> ApiError {
    ApiError::bad_request(message.to_string()).field(pointer, code)
}

fn scope_of(req: &Request) -> Scope {
    match req.params.get("id") {
        Some(id) => Scope::Deployment(id.clone()),
        None => Scope::Global,
    }
}

/// `If-Match: "<n>"`: the global `ETag` or the deployment's revision.
fn if_match(req: &Request) -> Result<Option<u64>, ApiError> {
    super::deployments::if_match(req)
}

/// `GET /v1/freeze` and `GET /v1/deployments/{id}/freeze`.
pub fn read(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let scope = scope_of(req);
    let rx = ctx.engine.read()?;
    let tag = match &scope {
        Scope::Global => rx.freeze_etag()?,
        Scope::Deployment(id) => {
            rx.deployment(id)?
                .ok_or_else(|| ApiError::not_found("deployment"))?
                .revision
        }
    };
    let shown = rx
        .freeze(scope.key())?
        .map_or(Value::Null, |f| freeze::view(&scope, &f, now_millis()));
    Ok(Reply::json(200, &json!({"freeze": shown})).header("ETag", format!("\"{tag}\"")))
}

/// `PUT`: sets or replaces the freeze.
pub async fn set(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let scope = scope_of(req);
    let expected = if_match(req)?;
    let record = parse(req, &w)?;
    let reply = |c: &FreezeChanged| changed_reply(c);
    let changed = ctx
        .engine
        .set_freeze(scope, record, expected, w.record(reply))
        .await?;
    Ok(changed_reply(&changed))
}

/// `DELETE`: lifts it; `404 not_frozen` when none is set.
pub async fn lift(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let scope = scope_of(req);
    let expected = if_match(req)?;
    let reply = |c: &FreezeChanged| changed_reply(c);
    let changed = ctx
        .engine
        .lift_freeze(scope, expected, w.record(reply))
        .await?;
    Ok(changed_reply(&changed))
}

fn changed_reply(c: &FreezeChanged) -> Reply {
    Reply::json(200, &json!({"freeze": c.freeze})).header("ETag", format!("\"{}\"", c.etag))
}

/// A freeze body: `{"reason", "until"?, "window"?}`, each rule checked.
fn parse(req: &Request, w: &Write) -> Result<FreezeRecord, ApiError> {
    let map = super::json_object(&req.body, &["reason", "until", "window"])?;
    let reason = match map.get("reason") {
        Some(Value::String(r)) => {
            crate::rollout::check_reason(r).map_err(|code| {
                bad(
                    "/reason",
                    code,
                    "reason: 1-500 characters without control characters",
                )
            })?;
            r.clone()
        }
        None | Some(Value::Null) => {
            return Err(bad(
                "/reason",
                "required",
                "a freeze needs a reason, in words",
            ))
        }
        Some(_) => return Err(bad("/reason", "type", "reason must be a string")),
    };
    let now = now_millis();
    let until = match map.get("until") {
        None | Some(Value::Null) => None,
        Some(Value::String(t)) => Some(
            parse_time(t)
                .ok_or_else(|| bad("/until", "format", "until must be an RFC 3339 time"))?,
        ),
        Some(_) => {
            return Err(bad(
                "/until",
                "type",
                "until must be an RFC 3339 time or null",
            ))
        }
    };
    freeze::check_until(until, now).map_err(|(pointer, code)| {
        bad(
            pointer,
            code,
            "until must be after now and at most 366 days ahead",
        )
    })?;
    let window = match map.get("window") {
        None | Some(Value::Null) => None,
        Some(v) => Some(parse_window(v)?),
    };
    Ok(FreezeRecord {
        reason,
        until,
        window,
        set_at: now,
        set_by: w
            .audit
            .actor
            .as_ref()
            .and_then(|a| serde_json::to_string(a).ok()),
    })
}

fn parse_window(v: &Value) -> Result<FreezeWindow, ApiError> {
    let window: FreezeWindow = serde_json::from_value(v.clone()).map_err(|_| {
        bad(
            "/window",
            "type",
            "window: {frequency, day?, start, duration_minutes, time_zone}",
        )
    })?;
    use crate::window::InvalidPolicy as I;
    freeze::check_window(&window).map_err(|e| match e {
        I::Day => bad(
            "/window/day",
            "range",
            "day: none for daily, 1-7 weekly, 1-31 monthly",
        ),
        I::Start => bad("/window/start", "format", "start: a local HH:MM"),
        I::Duration => bad(
            "/window/duration_minutes",
            "range",
            "duration_minutes: 15 to 1440 (daily) or 10080 (weekly, monthly)",
        ),
        I::TimeZone => bad("/window/time_zone", "time_zone", "time_zone: an IANA name"),
    })?;
    Ok(window)
}
