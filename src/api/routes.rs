//! The route table: every route berth serves, with who may call it and the
//! handler that answers it. This one table drives matching (404, 405 with
//! `Allow`), authentication, the metric label (the template), and the test
//! that compares it with `openapi.json`. Each route names a `Call`, and
//! `call` matches every `Call` exhaustively: a route cannot be listed and
//! not served, nor served and not listed.

use std::sync::Arc;

use super::auth::{self, Caller, Procedure, Question, Refused};
use super::errors::{ApiError, Code};
use super::{
    audit, builds, deployments, derive, events, idempotency, ops, page, sboms, Answer, Ctx, Reply,
    Request,
};
use crate::audit::Draft;
use crate::model::parse_build_id;
use crate::store::Lookup;

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Anyone: probes, the contract, the pure derive routes.
    Public,
    /// The service token (actor headers name who acts) or a token the
    /// authorization callback allows; the store must be ready (recovery
    /// done).
    Token,
    /// The service token or a stream ticket for this path; the handler
    /// checks which (a browser's `EventSource` cannot send a header).
    StreamCredential,
    /// Public with `--metrics-public`, else the service token; the handler
    /// checks.
    Metrics,
}

/// The handler of a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    Page,
    PageAsset,
    Healthz,
    Readyz,
    Metrics,
    OpenApi,
    ListDeployments,
    ReadDeployment,
    DeleteDeployment,
    Submit,
    Act,
    SetUpdatePolicy,
    Preview,
    ListSboms,
    ReadSbom,
    ListBuilds,
    ReadBuild,
    BuildLog,
    CancelBuild,
    DeploymentEvents,
    BuildEvents,
    StreamTicket,
    DeriveInstances,
    DeriveApplications,
    DeriveSections,
    AuditList,
    AuditProof,
    AuditConsistency,
}

/// One route: method, template (`{x}` matches one segment), access, handler.
#[derive(Debug, Clone, Copy)]
pub struct Route {
    pub method: &'static str,
    pub template: &'static str,
    pub access: Access,
    pub call: Call,
}

const fn route(method: &'static str, template: &'static str, access: Access, call: Call) -> Route {
    Route {
        method,
        template,
        access,
        call,
    }
}

/// Every route berth serves.
#[rustfmt::skip]
pub const ROUTES: &[Route] = &[
    route("GET", "/", Access::Public, Call::Page),
    route("GET", "/ui/{file}", Access::Public, Call::PageAsset),
    route("GET", "/healthz", Access::Public, Call::Healthz),
    route("GET", "/readyz", Access::Public, Call::Readyz),
    route("GET", "/metrics", Access::Metrics, Call::Metrics),
    route("GET", "/v1/openapi.json", Access::Public, Call::OpenApi),
    route("GET", "/v1/deployments", Access::Token, Call::ListDeployments),
    route("GET", "/v1/deployments/{id}", Access::Token, Call::ReadDeployment),
    route("DELETE", "/v1/deployments/{id}", Access::Token, Call::DeleteDeployment),
    route("POST", "/v1/deployments/{id}/submit", Access::Token, Call::Submit),
    route("POST", "/v1/deployments/{id}/preview", Access::Token, Call::Preview),
    route("POST", "/v1/deployments/{id}/actions/{name}", Access::Token, Call::Act),
    route("PUT", "/v1/deployments/{id}/update-policy", Access::Token, Call::SetUpdatePolicy),
    route("GET", "/v1/deployments/{id}/builds", Access::Token, Call::ListBuilds),
    route("GET", "/v1/deployments/{id}/sboms", Access::Token, Call::ListSboms),
    route("GET", "/v1/deployments/{id}/sboms/{node}", Access::Token, Call::ReadSbom),
    route("GET", "/v1/builds/{build}", Access::Token, Call::ReadBuild),
    route("GET", "/v1/builds/{build}/log", Access::Token, Call::BuildLog),
    route("POST", "/v1/builds/{build}/cancel", Access::Token, Call::CancelBuild),
    route("GET", "/v1/deployments/{id}/events", Access::StreamCredential, Call::DeploymentEvents),
    route("GET", "/v1/builds/{build}/events", Access::StreamCredential, Call::BuildEvents),
    route("POST", "/v1/stream-tickets", Access::Token, Call::StreamTicket),
    route("POST", "/v1/derive/instances", Access::Public, Call::DeriveInstances),
    route("POST", "/v1/derive/applications", Access::Public, Call::DeriveApplications),
    route("POST", "/v1/derive/sections", Access::Public, Call::DeriveSections),
    route("GET", "/v1/audit", Access::Token, Call::AuditList),
    route("GET", "/v1/audit/proof", Access::Token, Call::AuditProof),
    route("GET", "/v1/audit/consistency", Access::Token, Call::AuditConsistency),
];

type Params = std::collections::HashMap<&'static str, String>;

/// The audit action of a call, `None` when the call is not audited.
fn audited_action(call: Call, params: &Params) -> Option<&'static str> {
    let action_name = params.get("name").map(String::as_str).unwrap_or("");
    Some(match call {
        Call::Submit => "submit",
        Call::CancelBuild => "cancel",
        Call::DeleteDeployment => "delete",
        Call::SetUpdatePolicy => "update_policy",
        // An unknown action name is recorded as plain `action`: the name
        // is a value of the request.
        Call::Act => match action_name {
            "suspend" => "action:suspend",
            "resume" => "action:resume",
            _ => "action",
        },
        _ => return None,
    })
}

/// The question a token route asks the callback, and whether a denial is
/// hidden as 404 (a read of a deployment: nobody can probe which exist).
fn question_of(ctx: &Ctx, call: Call, params: &Params) -> (Procedure, Option<String>, bool) {
    let param = |n: &str| params.get(n).cloned();
    // The deployment a build route acts on: its build's.
    let of_build = || {
        parse_build_id(params.get("build").map(String::as_str).unwrap_or(""))
            .and_then(|b| ctx.engine.store.read().ok()?.build(b).ok()?)
            .map(|b| b.deployment)
    };
    match call {
        Call::ListDeployments => (Procedure::Read, None, false),
        Call::ReadDeployment | Call::ListBuilds | Call::ListSboms | Call::ReadSbom => {
            (Procedure::Read, param("id"), true)
        }
        Call::ReadBuild | Call::BuildLog => (Procedure::Read, of_build(), true),
        Call::CancelBuild => (Procedure::Cancel, of_build(), false),
        Call::Submit => (Procedure::Submit, param("id"), false),
        Call::Preview => (Procedure::Preview, param("id"), false),
        Call::Act => (Procedure::Action, param("id"), false),
        Call::SetUpdatePolicy => (Procedure::UpdatePolicy, param("id"), false),
        Call::DeleteDeployment => (Procedure::Delete, param("id"), false),
        Call::StreamTicket => (Procedure::Stream, None, false),
        Call::AuditList | Call::AuditProof | Call::AuditConsistency => {
            (Procedure::AuditRead, None, false)
        }
        _ => (Procedure::Read, None, false),
    }
}

/// Authenticates a token route before its body is read: the service
/// token, or the callback's decision on this route's procedure. A refused
/// audited call leaves its event.
#[allow(clippy::too_many_arguments)]
pub async fn authorize(
    ctx: &Ctx,
    route: &Route,
    params: &Params,
    query: &[(String, String)],
    headers: &warp::http::HeaderMap,
    method: &str,
    path: &str,
    request_id: &str,
) -> Result<Caller, ApiError> {
    let target = match route.call {
        Call::AuditList if !auth::has_service_token(&ctx.service_token, headers) => {
            // The callback is asked about this target: check it first.
            Some(audit::target_actor(query)?)
        }
        _ => None,
    };
    let (procedure, deployment, hide) = question_of(ctx, route.call, params);
    let q = Question {
        procedure,
        deployment: deployment.as_deref(),
        target_actor: target.as_ref(),
        method,
        path,
    };
    let result = if route.call == Call::ListDeployments {
        list_caller(ctx, headers, &q).await
    } else {
        auth::authenticate(&ctx.service_token, &ctx.authz, headers, &q, hide).await
    };
    match result {
        Ok(caller) => Ok(caller),
        Err(refused) => {
            if let Some(draft) =
                audited_action(route.call, params).map(|a| audit::draft(ctx, a, params, request_id))
            {
                audit::refused(ctx, draft, &refused).await;
            }
            Err(refused.error)
        }
    }
}

/// A list needs only a known caller: each item is filtered through `read`.
async fn list_caller(
    ctx: &Ctx,
    headers: &warp::http::HeaderMap,
    q: &Question<'_>,
) -> Result<Caller, Refused> {
    match auth::authenticate(&ctx.service_token, &ctx.authz, headers, q, false).await {
        Ok(c) => Ok(c),
        Err(Refused {
            actor: Some(actor),
            trusted_backend: false,
            ..
        }) => Ok(Caller {
            actor: Some(actor),
            trusted_backend: false,
            token: auth::bearer(headers).map(str::to_string),
        }),
        Err(r) => Err(r),
    }
}

/// Runs a route's handler (the caller of a token route was authenticated
/// by `authorize` before the body was read).
pub async fn call(ctx: &Arc<Ctx>, route: &Route, req: &Request) -> Result<Answer, ApiError> {
    if route.access == Access::Token && !ctx.engine.ready.load(std::sync::atomic::Ordering::SeqCst)
    {
        return Err(ApiError::new(Code::Unavailable, "the store is not ready yet").retry_after(1));
    }
    // Only `Access::Token` routes read `caller`; `dispatch` sets it for them.
    let caller = || req.caller.as_ref().ok_or_else(ApiError::internal);
    if let Some(draft) = audited_action(route.call, &req.params)
        .map(|a| audit::draft(ctx, a, &req.params, &req.request_id))
    {
        return audited(ctx, route, req, audit::by(draft, caller()?))
            .await
            .map(Answer::Reply);
    }
    let reply = match route.call {
        Call::Healthz => Ok(ops::healthz()),
        Call::Readyz => Ok(ops::readyz(ctx)),
        Call::Metrics => ops::metrics(ctx, req),
        Call::OpenApi => Ok(ops::openapi()),
        Call::Page => Ok(page::index(req)),
        Call::PageAsset => page::asset(req),
        Call::DeriveInstances => derive::instances(ctx, req).await,
        Call::DeriveApplications => derive::applications(ctx, req).await,
        Call::DeriveSections => derive::sections(ctx, req).await,
        Call::DeploymentEvents => {
            return events::deployment_events(ctx, req)
                .await
                .map(Answer::Stream)
        }
        Call::BuildEvents => return events::build_events(ctx, req).await.map(Answer::Stream),
        Call::ListDeployments => deployments::list(ctx, req, caller()?).await,
        Call::ReadDeployment => deployments::read(ctx, req).await,
        Call::Preview => deployments::preview(ctx, req).await,
        Call::ListBuilds => builds::list(ctx, req, caller()?),
        Call::ListSboms => sboms::list(ctx, req),
        Call::ReadSbom => sboms::node(ctx, req).await,
        Call::ReadBuild => builds::read(ctx, req),
        Call::BuildLog => return builds::log(ctx, req).await,
        Call::StreamTicket => events::ticket(ctx, req, caller()?).await,
        Call::AuditList => audit::list(ctx, req, caller()?),
        Call::AuditProof => audit::proof(ctx, req),
        Call::AuditConsistency => audit::consistency(ctx, req),
        Call::Submit
        | Call::Act
        | Call::SetUpdatePolicy
        | Call::DeleteDeployment
        | Call::CancelBuild => Err(ApiError::internal()),
    };
    reply.map(Answer::Reply)
}

/// An audited mutation: its event is written with the change (inside the
/// engine's transaction) or, when it changed nothing, here on its own. An
/// idempotent replay is not a new call and writes none.
async fn audited(ctx: &Ctx, route: &Route, req: &Request, draft: Draft) -> Result<Reply, ApiError> {
    let caller = req.caller.as_ref().ok_or_else(ApiError::internal)?;
    let w = draft.clone();
    let result = match route.call {
        Call::Submit => {
            idempotency::mutation(ctx, req, caller, w, |w| deployments::submit(ctx, req, w)).await
        }
        Call::Act => {
            idempotency::mutation(ctx, req, caller, w, |w| deployments::act(ctx, req, w)).await
        }
        Call::SetUpdatePolicy => {
            idempotency::mutation(ctx, req, caller, w, |w| {
                deployments::set_update_policy(ctx, req, w)
            })
            .await
        }
        Call::DeleteDeployment => {
            idempotency::mutation(ctx, req, caller, w, |w| deployments::delete(ctx, req, w)).await
        }
        Call::CancelBuild => {
            idempotency::mutation(ctx, req, caller, w, |w| builds::cancel(ctx, req, w)).await
        }
        _ => Err(ApiError::internal()),
    };
    if let Err(e) = &result {
        audit::failed(ctx, draft, e).await;
    }
    result
}

/// The params of `template` in `segments`, if it matches.
/// A request path as the route table matches it: its segments, each
/// percent-decoded.
pub fn path_segments(path: &str) -> Vec<String> {
    path.trim_start_matches('/')
        .split('/')
        .map(|s| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        })
        .collect()
}

pub fn match_template(
    template: &'static str,
    segments: &[String],
) -> Option<std::collections::HashMap<&'static str, String>> {
    let parts: Vec<&'static str> = template.trim_start_matches('/').split('/').collect();
    if parts.len() != segments.len() {
        return None;
    }
    let mut params = std::collections::HashMap::new();
    for (part, seg) in parts.iter().zip(segments) {
        if let Some(name) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
            if seg.is_empty() {
                return None;
            }
            params.insert(name, seg.clone());
        } else if part != seg {
            return None;
        }
    }
    Some(params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_match_segments() {
        let segs = |p: &str| {
            p.trim_start_matches('/')
                .split('/')
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        let m = match_template(
            "/v1/deployments/{id}/submit",
            &segs("/v1/deployments/alice/submit"),
        )
        .unwrap();
        assert_eq!(m["id"], "alice");
        assert!(match_template("/v1/deployments/{id}", &segs("/v1/deployments/")).is_none());
        assert!(match_template("/v1/deployments", &segs("/v1/deployments/x")).is_none());
    }

    #[test]
    fn every_route_is_listed_once_with_its_own_handler() {
        let mut seen = std::collections::HashSet::new();
        let mut calls = std::collections::HashSet::new();
        for r in ROUTES {
            assert!(
                seen.insert((r.method, r.template)),
                "{} {} twice",
                r.method,
                r.template
            );
            assert!(calls.insert(r.call), "{:?} serves two routes", r.call);
            // Event streams check their own credential (a ticket); every
            // other route under /v1 that is not derive needs the token.
            let expected = match r.template {
                t if t.ends_with("/events") => Access::StreamCredential,
                t if t.starts_with("/v1/audit") => Access::Token,
                "/metrics" => Access::Metrics,
                t if t.starts_with("/v1/derive/") => Access::Public,
                // The page is public; what it shows needs the token.
                "/healthz" | "/readyz" | "/v1/openapi.json" | "/" | "/ui/{file}" => Access::Public,
                _ => Access::Token,
            };
            assert_eq!(r.access, expected, "{} {}", r.method, r.template);
        }
    }
}
