//! The audit side of the HTTP layer (spec audit.md): which calls are
//! audited and as what, the events of calls that changed nothing (denied,
//! invalid, refused), and the audit routes: one actor's events and the
//! Merkle proofs.

use serde_json::json;

use super::auth::{Caller, Refused};
use super::errors::{ApiError, Code};
use super::{cursor, Ctx, Reply, Request};
use crate::audit::merkle;
use crate::audit::{Actor, AuditResult, Draft, Event};
use crate::model::{format_build_id, is_valid_deployment_id, parse_build_id};
use crate::store::{AuditLookup, StoredNodes};

/// The event of an audited call, before its caller and result are known.
/// Only ids that are valid are recorded (an invalid one is a request value
/// that may be anything); a cancel names its build's deployment, which the
/// authorization already read (`routes::Scope::BuildsDeployment`).
pub fn draft(
    action: &'static str,
    deployment: Option<&str>,
    params: &std::collections::HashMap<&'static str, String>,
    request_id: &str,
) -> Draft {
    let build = parse_build_id(params.get("build").map(String::as_str).unwrap_or(""));
    let deployment = deployment
        .filter(|id| is_valid_deployment_id(id))
        .map(str::to_string);
    // The same event as berth's own, then the request's id and build.
    let mut draft = crate::engine::audit::system_draft(action, deployment, AuditResult::Ok);
    draft.build = build.map(format_build_id);
    draft.request_id = request_id.to_string();
    draft
}

/// The draft with the caller filled in.
pub fn by(mut draft: Draft, caller: &Caller) -> Draft {
    draft.actor = caller.actor.clone();
    draft.trusted_backend = caller.trusted_backend;
    draft
}

/// Result and reason of a call that failed: the error's code or finer
/// reason, never a value of the request.
fn classify(e: &ApiError) -> (AuditResult, String) {
    let outcome = match e.code {
        Code::Unauthenticated | Code::Forbidden => AuditResult::Denied,
        Code::InvalidRequest | Code::PayloadTooLarge | Code::UnsupportedMediaType => {
            AuditResult::Invalid
        }
        // A configuration the deployer or the schema refused is a refusal
        // of the change (audit.md), as every other answer here.
        Code::InvalidConfiguration
        | Code::RangeNotSatisfiable
        | Code::MethodNotAllowed
        | Code::NotFound
        | Code::Conflict
        | Code::QueueFull
        | Code::IdempotencyConflict
        | Code::PreconditionFailed
        | Code::StaleAuthority
        | Code::EvalUnavailable
        | Code::Unavailable
        | Code::Internal => AuditResult::Refused,
    };
    let reason = e
        .reason
        .clone()
        .unwrap_or_else(|| e.code.as_str().to_string());
    (outcome, reason)
}

/// Records a refused authentication: a known actor's denial (or a bad
/// actor header) gets its own event; an anonymous one is folded.
pub async fn refused(ctx: &Ctx, mut draft: Draft, r: &Refused) {
    let (outcome, reason) = classify(&r.error);
    draft.result = outcome;
    draft.reason = Some(reason);
    draft.actor = r.actor.clone();
    draft.trusted_backend = r.trusted_backend;
    if draft.actor.is_none() && !draft.trusted_backend {
        ctx.engine.audit_anonymous_denial(draft).await;
    } else {
        if let (Some(actor), AuditResult::Denied) = (&draft.actor, draft.result) {
            let issuer = actor.issuer.as_deref().unwrap_or("");
            ctx.engine
                .metrics
                .count_denial(format!("{} {issuer}", actor.subject).trim_end());
        }
        ctx.engine.audit_alone(draft).await;
    }
}

/// Records a call that ended in an error (the change, had there been one,
/// wrote its own event with it).
pub async fn failed(ctx: &Ctx, mut draft: Draft, e: &ApiError) {
    let (outcome, reason) = classify(e);
    draft.result = outcome;
    draft.reason = Some(reason);
    ctx.engine.audit_alone(draft).await;
}

/// Records an agent's refused or invalid report (audit.md: folded per
/// token and `--audit-denial-interval` into `node_report_refused`).
pub async fn refused_report(
    ctx: &Ctx,
    (token, binding): (&str, &crate::model::NodeBinding),
    e: &ApiError,
) {
    let (outcome, reason) = classify(e);
    let mut draft = crate::engine::audit::system_draft(
        "node_report_refused",
        Some(binding.deployment.clone()),
        outcome,
    );
    draft.actor = Some(crate::audit::Actor::agent(token));
    draft.node = Some(binding.node.clone());
    draft.reason = Some(reason);
    ctx.engine.audit_report_refused(token, draft).await;
}

/// An event as the API shows it.
pub fn view(e: &Event) -> serde_json::Value {
    serde_json::to_value(e).unwrap_or(serde_json::Value::Null)
}

/// The target actor of `GET /v1/audit` (checked before the callback is
/// asked about it).
pub fn target_actor(query: &[(String, String)]) -> Result<Actor, ApiError> {
    let one = |name: &str| -> Result<Option<String>, ApiError> {
        let mut values = query.iter().filter(|(k, _)| k == name).map(|(_, v)| v);
        let v = values.next().cloned();
        if values.next().is_some() {
            return Err(ApiError::bad_request(format!("{name} is given twice"))
                .field(format!("/query/{name}"), "duplicate"));
        }
        match v {
            Some(s) if s.is_empty() || s.chars().count() > super::auth::MAX_ACTOR_CHARS => Err(
                ApiError::bad_request(format!("{name} is 1 to 256 characters"))
                    .field(format!("/query/{name}"), "length"),
            ),
            other => Ok(other),
        }
    };
    let subject = one("actor_subject")?.ok_or_else(|| {
        ApiError::bad_request("actor_subject is required").field("/query/actor_subject", "required")
    })?;
    Ok(Actor {
        subject,
        issuer: one("actor_issuer")?,
    })
}

/// `GET /v1/audit?actor_subject=&actor_issuer=&limit=&cursor=`.
pub fn list(ctx: &Ctx, req: &Request, caller: &Caller) -> Result<Reply, ApiError> {
    let actor = target_actor(&req.query)?;
    let limit = super::cursor::page_limit(req)?;
    let filter = serde_json::to_string(&actor).map_err(|_| ApiError::internal())?;
    let before = match req.query_one("cursor") {
        Some(c) => {
            let position = cursor::decode(&ctx.cursor_key, &caller.identity(), &filter, c)?;
            Some(position.parse::<u64>().map_err(|_| ApiError::internal())?)
        }
        None => None,
    };
    let rx = ctx.engine.read()?;
    let mut events = rx.audit_of_actor(&actor.key(), before, limit + 1)?;
    let next_cursor = if events.len() > limit {
        events.truncate(limit);
        events.last().map(|e| {
            cursor::encode(
                &ctx.cursor_key,
                &caller.identity(),
                &filter,
                &e.seq.to_string(),
            )
        })
    } else {
        None
    };
    let items: Vec<serde_json::Value> = events.iter().map(view).collect();
    Ok(Reply::json(
        200,
        &json!({"items": items, "next_cursor": next_cursor}),
    ))
}

fn number(req: &Request, name: &str) -> Result<u64, ApiError> {
    req.query_one(name)
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|n| *n >= 1)
        .ok_or_else(|| {
            ApiError::bad_request(format!("{name} is a positive integer"))
                .field(format!("/query/{name}"), "range")
        })
}

fn pruned() -> ApiError {
    ApiError::not_found("audit event").reason("pruned")
}

fn beyond_head() -> ApiError {
    ApiError::not_found("audit event")
}

fn hex_all(path: &[merkle::Hash]) -> Vec<String> {
    path.iter().map(|h| crate::hex::encode(h)).collect()
}

/// `GET /v1/audit/proof?seq=N&size=S`: event N's inclusion in the tree of
/// size S.
pub fn proof(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let (seq, size) = (number(req, "seq")?, number(req, "size")?);
    let rx = ctx.engine.read()?;
    let head = rx.audit_size()?;
    if seq > size || size > head {
        return Err(beyond_head());
    }
    let anchor = rx.audit_anchor()?;
    if seq < anchor.first_seq {
        return Err(pruned());
    }
    let event = rx.audit_event(seq)?.ok_or_else(pruned)?;
    let nodes = StoredNodes(&rx);
    let path = merkle::inclusion_path(&nodes, seq - 1, size)?;
    let root = merkle::root(&nodes, size)?;
    Ok(Reply::json(
        200,
        &json!({
            "seq": seq, "size": size, "leaf_index": seq - 1,
            "event_hash": event.hash, "root": crate::hex::encode(&root),
            "path": hex_all(&path),
        }),
    ))
}

/// `GET /v1/audit/consistency?from=S1&to=S2`.
pub fn consistency(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let (from, to) = (number(req, "from")?, number(req, "to")?);
    let rx = ctx.engine.read()?;
    if from > to || to > rx.audit_size()? {
        return Err(beyond_head());
    }
    if from < rx.audit_anchor()?.first_seq {
        return Err(pruned());
    }
    let nodes = StoredNodes(&rx);
    let path = merkle::consistency_path(&nodes, from, to)?;
    Ok(Reply::json(
        200,
        &json!({
            "from": from, "to": to,
            "from_root": crate::hex::encode(&merkle::root(&nodes, from)?),
            "to_root": crate::hex::encode(&merkle::root(&nodes, to)?),
            "path": hex_all(&path),
        }),
    ))
}
