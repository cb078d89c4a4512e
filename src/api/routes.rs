//! The route table: every route berth serves, with who may call it and the
//! handler that answers it. This one table drives matching (404, 405 with
//! `Allow`), authentication, the metric label (the template), and the test
//! that compares it with `openapi.json`. Each route names a `Call`, and
//! `call` matches every `Call` exhaustively: a route cannot be listed and
//! not served, nor served and not listed.

use std::sync::Arc;

use super::errors::{ApiError, Code};
use super::{
    auth, builds, deployments, derive, events, idempotency, ops, sboms, Answer, Ctx, Request,
};

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Anyone: probes, the contract, the pure derive routes.
    Public,
    /// The service token (actor headers name who acts); the store must be
    /// ready (recovery done).
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
];

/// Authenticates by the route's access class, then runs its handler.
pub async fn call(ctx: &Arc<Ctx>, route: &Route, req: &Request) -> Result<Answer, ApiError> {
    let caller = match route.access {
        Access::Token => {
            let caller = auth::authenticate(ctx, req)?;
            if !ctx.engine.ready.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(
                    ApiError::new(Code::Unavailable, "the store is not ready yet").retry_after(1),
                );
            }
            Some(caller)
        }
        Access::Public | Access::StreamCredential | Access::Metrics => None,
    };
    // Only `Access::Token` routes read `caller`; the table guarantees it.
    let caller = || caller.as_ref().ok_or_else(ApiError::internal);
    let reply = match route.call {
        Call::Healthz => Ok(ops::healthz()),
        Call::Readyz => Ok(ops::readyz(ctx)),
        Call::Metrics => ops::metrics(ctx, req),
        Call::OpenApi => Ok(ops::openapi()),
        Call::DeriveInstances => derive::instances(ctx, req).await,
        Call::DeriveApplications => derive::applications(ctx, req).await,
        Call::DeriveSections => derive::sections(ctx, req).await,
        Call::DeploymentEvents => return events::deployment_events(ctx, req).map(Answer::Stream),
        Call::BuildEvents => return events::build_events(ctx, req).map(Answer::Stream),
        Call::ListDeployments => deployments::list(ctx, req, caller()?).await,
        Call::ReadDeployment => deployments::read(ctx, req).await,
        Call::Preview => deployments::preview(ctx, req).await,
        Call::Submit => {
            idempotency::mutation(ctx, req, caller()?, |w| deployments::submit(ctx, req, w)).await
        }
        Call::Act => {
            idempotency::mutation(ctx, req, caller()?, |w| deployments::act(ctx, req, w)).await
        }
        Call::SetUpdatePolicy => {
            idempotency::mutation(ctx, req, caller()?, |w| {
                deployments::set_update_policy(ctx, req, w)
            })
            .await
        }
        Call::DeleteDeployment => {
            idempotency::mutation(ctx, req, caller()?, |w| deployments::delete(ctx, req, w)).await
        }
        Call::ListBuilds => builds::list(ctx, req, caller()?),
        Call::ListSboms => sboms::list(ctx, req),
        Call::ReadSbom => sboms::node(ctx, req).await,
        Call::ReadBuild => builds::read(ctx, req),
        Call::BuildLog => return builds::log(ctx, req).await,
        Call::CancelBuild => {
            idempotency::mutation(ctx, req, caller()?, |w| builds::cancel(ctx, req, w)).await
        }
        Call::StreamTicket => events::ticket(ctx, req, caller()?),
    };
    reply.map(Answer::Reply)
}

/// The params of `template` in `segments`, if it matches.
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
                "/metrics" => Access::Metrics,
                t if t.starts_with("/v1/derive/") => Access::Public,
                "/healthz" | "/readyz" | "/v1/openapi.json" => Access::Public,
                _ => Access::Token,
            };
            assert_eq!(r.access, expected, "{} {}", r.method, r.template);
        }
    }
}
