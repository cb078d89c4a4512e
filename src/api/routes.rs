//! The route table: every route berth serves, one row each, saying
//! everything the request path needs to know about it: method and path
//! template, who may call it, what the authorization callback is asked,
//! whether a denied read answers 404, whether and as what it is audited,
//! and the handler.
//!
//! Why it is shaped so: what a route needs used to be spread over four
//! matches with wildcard arms, so a new mutation could be authorized as a
//! read or answer 500 at run time. Here the access class *is* the variant of
//! `Handler`, and each variant carries exactly what its class needs (a
//! token route its `Ask`, a mutation also its `Audit`) as struct fields with
//! no defaults; every match over `PublicCall`, `TokenCall`, `MutationCall`,
//! `StreamCall` and `Scope` is exhaustive with no `_` arm. Adding a route
//! without deciding each of these does not compile.
//!
//! The same rows drive matching (404, 405 with `Allow`), the metric label
//! (the template), and the test that compares them with `openapi.json`.
//! A token route is authenticated before a byte of its body is read
//! (`authorize`), and its handler receives the authenticated `Caller`, never
//! an `Option`.

use std::sync::Arc;

use super::auth::{self, Caller, Procedure, Question, Refused};
use super::errors::{ApiError, Code};
use super::{
    agents, audit, builds, deployments, derive, events, freeze, idempotency, ops, page, sboms,
    webhooks, workers, Answer, Ctx, Request,
};
use crate::model::parse_build_id;
use crate::store::{Lookup, StoreErrorKind};

/// A route anyone may call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PublicCall {
    Page,
    PageAsset,
    Healthz,
    Readyz,
    OpenApi,
    DeriveInstances,
    DeriveApplications,
    DeriveSections,
}

/// A route that needs the service token or a token the callback allows,
/// and changes nothing (or, like a stream ticket, nothing a retry could
/// duplicate harmfully).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenCall {
    ListDeployments,
    ReadDeployment,
    Preview,
    ListSboms,
    ReadSbom,
    ListBuilds,
    ReadBuild,
    BuildLog,
    StreamTicket,
    AuditList,
    AuditProof,
    AuditConsistency,
    ListWebhooks,
    ReadWebhook,
    ListDeliveries,
    ListTokens,
    ListWorkers,
    Cluster,
    ReadWorkState,
    ReadFreeze,
    ListNodes,
    ReadNode,
    ListAllNodes,
}

/// A route that changes state: token-authenticated, audited, and run under
/// its idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MutationCall {
    Submit,
    Act,
    SetUpdatePolicy,
    SetRolloutPolicy,
    DeleteDeployment,
    CancelBuild,
    CreateWebhook,
    DeleteWebhook,
    RotateWebhookSecret,
    TestWebhook,
    CreateToken,
    RevokeToken,
    PutWorkState,
    SetFreeze,
    LiftFreeze,
}

/// A route of `berth worker`: a worker token only (workers.md "Internal
/// routes"), authenticated before the body; its handler applies the
/// authority rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkerCall {
    Queue,
    Claim,
    Renew,
    Progress,
    Outcome,
    /// A rollout build's call ended (`calls/{seq}`).
    CallReport,
    Blob,
    WorkState,
}

/// A route of `berth agent`: an agent token of the node in the path only
/// (agents.md), authenticated before the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AgentCall {
    Desired,
    Report,
    Claim,
    Renew,
    Progress,
    Outcome,
    Artifact,
}

impl Handler {
    /// The most bytes of a route whose body is a file (received into one,
    /// not into memory, and not JSON); `None` for every other route.
    pub fn file_body_limit(self, settings: &crate::settings::Settings) -> Option<u64> {
        match self {
            Handler::Worker(WorkerCall::Blob) => {
                Some(crate::engine::staging::max_blob_bytes(settings))
            }
            Handler::Mutation(MutationCall::PutWorkState, ..) => Some(settings.max_work_state),
            Handler::Public(_)
            | Handler::Metrics
            | Handler::Stream(_)
            | Handler::Token(..)
            | Handler::Mutation(..)
            | Handler::Worker(_)
            | Handler::Agent(_) => None,
        }
    }
}

/// An event stream: the service token or a stream ticket for its path (a
/// browser's `EventSource` cannot send a header); the handler checks which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamCall {
    DeploymentEvents,
    BuildEvents,
}

/// What the authorization callback is asked about a token route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    pub procedure: Procedure,
    /// Which deployment (or actor) the question names.
    pub scope: Scope,
    /// What a callback caller who is denied gets.
    pub denial: Denial,
}

/// What a token route's question is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The server as a whole (no deployment named).
    Server,
    /// The deployment in the path's `{id}`.
    PathDeployment,
    /// The deployment of the build in the path's `{build}` (read from the
    /// store; a store error answers 503).
    BuildsDeployment,
    /// The actor named in the query (`GET /v1/audit`): the callback is
    /// asked about that target.
    QueryActor,
    /// A list: a known caller suffices, and each item is filtered through
    /// `read` by the handler.
    EachItem,
    /// The service token only (webhooks, notifications.md): a callback
    /// token is refused with 403 without asking the callback.
    ServiceOnly,
}

/// What a denied callback caller is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denial {
    /// 403 `forbidden`.
    Forbidden,
    /// 404, as for a deployment that does not exist: nobody can probe which
    /// deployments exist by reading them.
    NotFound,
}

/// As what a mutation is recorded in the audit chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audit {
    /// Always this action.
    Action(&'static str),
    /// `action:<name>` for the known action names in `{name}`, plain
    /// `action` for any other (the name is a value of the request).
    ActionByName,
}

/// Who may call a route and the handler that answers it. The access class
/// is the variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handler {
    Public(PublicCall),
    /// Public with `--metrics-public`, else the service token; the handler
    /// checks.
    Metrics,
    Stream(StreamCall),
    Token(TokenCall, Ask),
    Mutation(MutationCall, Ask, Audit),
    Worker(WorkerCall),
    Agent(AgentCall),
}

/// Who may call a route, as the route-table test and the docs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Public,
    Metrics,
    StreamCredential,
    Token,
    WorkerToken,
    AgentToken,
}

impl Handler {
    pub fn access(self) -> Access {
        match self {
            Handler::Public(_) => Access::Public,
            Handler::Metrics => Access::Metrics,
            Handler::Stream(_) => Access::StreamCredential,
            Handler::Token(..) | Handler::Mutation(..) => Access::Token,
            Handler::Worker(_) => Access::WorkerToken,
            Handler::Agent(_) => Access::AgentToken,
        }
    }
}

/// One route: method, template (`{x}` matches one segment), handler.
#[derive(Debug, Clone, Copy)]
pub struct Route {
    pub method: &'static str,
    pub template: &'static str,
    pub handler: Handler,
}

impl Route {
    pub fn access(&self) -> Access {
        self.handler.access()
    }
}

const fn public_row(method: &'static str, template: &'static str, call: PublicCall) -> Route {
    Route {
        method,
        template,
        handler: Handler::Public(call),
    }
}

const fn worker_row(method: &'static str, template: &'static str, call: WorkerCall) -> Route {
    Route {
        method,
        template,
        handler: Handler::Worker(call),
    }
}

const fn agent_row(method: &'static str, template: &'static str, call: AgentCall) -> Route {
    Route {
        method,
        template,
        handler: Handler::Agent(call),
    }
}

const fn stream_row(template: &'static str, call: StreamCall) -> Route {
    Route {
        method: "GET",
        template,
        handler: Handler::Stream(call),
    }
}

const fn token_row(
    method: &'static str,
    template: &'static str,
    call: TokenCall,
    procedure: Procedure,
    scope: Scope,
    denial: Denial,
) -> Route {
    Route {
        method,
        template,
        handler: Handler::Token(
            call,
            Ask {
                procedure,
                scope,
                denial,
            },
        ),
    }
}

const fn mutation_row(
    method: &'static str,
    template: &'static str,
    call: MutationCall,
    procedure: Procedure,
    scope: Scope,
    audit: Audit,
) -> Route {
    Route {
        method,
        template,
        // A denied mutation is a 403: it is not a read to hide.
        handler: Handler::Mutation(
            call,
            Ask {
                procedure,
                scope,
                denial: Denial::Forbidden,
            },
            audit,
        ),
    }
}

use Denial::{Forbidden, NotFound};
use Procedure as P;
use Scope::{BuildsDeployment, EachItem, PathDeployment, QueryActor, Server, ServiceOnly};

/// Every route berth serves.
#[rustfmt::skip]
pub const ROUTES: &[Route] = &[
    public_row("GET", "/", PublicCall::Page),
    public_row("GET", "/ui/{file}", PublicCall::PageAsset),
    public_row("GET", "/healthz", PublicCall::Healthz),
    public_row("GET", "/readyz", PublicCall::Readyz),
    Route { method: "GET", template: "/metrics", handler: Handler::Metrics },
    public_row("GET", "/v1/openapi.json", PublicCall::OpenApi),
    token_row("GET", "/v1/deployments", TokenCall::ListDeployments, P::Read, EachItem, Forbidden),
    token_row("GET", "/v1/deployments/{id}", TokenCall::ReadDeployment, P::Read, PathDeployment, NotFound),
    mutation_row("DELETE", "/v1/deployments/{id}", MutationCall::DeleteDeployment, P::Delete, PathDeployment, Audit::Action("delete")),
    mutation_row("POST", "/v1/deployments/{id}/submit", MutationCall::Submit, P::Submit, PathDeployment, Audit::Action("submit")),
    token_row("POST", "/v1/deployments/{id}/preview", TokenCall::Preview, P::Preview, PathDeployment, Forbidden),
    mutation_row("POST", "/v1/deployments/{id}/actions/{name}", MutationCall::Act, P::Action, PathDeployment, Audit::ActionByName),
    mutation_row("PUT", "/v1/deployments/{id}/update-policy", MutationCall::SetUpdatePolicy, P::UpdatePolicy, PathDeployment, Audit::Action("update_policy")),
    mutation_row("PUT", "/v1/deployments/{id}/rollout-policy", MutationCall::SetRolloutPolicy, P::UpdatePolicy, PathDeployment, Audit::Action("rollout_policy")),
    token_row("GET", "/v1/deployments/{id}/builds", TokenCall::ListBuilds, P::Read, PathDeployment, NotFound),
    token_row("GET", "/v1/deployments/{id}/sboms", TokenCall::ListSboms, P::Read, PathDeployment, NotFound),
    token_row("GET", "/v1/deployments/{id}/sboms/{node}", TokenCall::ReadSbom, P::Read, PathDeployment, NotFound),
    token_row("GET", "/v1/deployments/{id}/work-state", TokenCall::ReadWorkState, P::Tokens, ServiceOnly, Forbidden),
    mutation_row("PUT", "/v1/deployments/{id}/work-state", MutationCall::PutWorkState, P::Tokens, ServiceOnly, Audit::Action("work_state_put")),
    token_row("GET", "/v1/builds/{build}", TokenCall::ReadBuild, P::Read, BuildsDeployment, NotFound),
    token_row("GET", "/v1/builds/{build}/log", TokenCall::BuildLog, P::Read, BuildsDeployment, NotFound),
    mutation_row("POST", "/v1/builds/{build}/cancel", MutationCall::CancelBuild, P::Cancel, BuildsDeployment, Audit::Action("cancel")),
    stream_row("/v1/deployments/{id}/events", StreamCall::DeploymentEvents),
    stream_row("/v1/builds/{build}/events", StreamCall::BuildEvents),
    token_row("POST", "/v1/stream-tickets", TokenCall::StreamTicket, P::Stream, Server, Forbidden),
    public_row("POST", "/v1/derive/instances", PublicCall::DeriveInstances),
    public_row("POST", "/v1/derive/applications", PublicCall::DeriveApplications),
    public_row("POST", "/v1/derive/sections", PublicCall::DeriveSections),
    token_row("GET", "/v1/audit", TokenCall::AuditList, P::AuditRead, QueryActor, Forbidden),
    token_row("GET", "/v1/audit/proof", TokenCall::AuditProof, P::AuditRead, Server, Forbidden),
    token_row("GET", "/v1/audit/consistency", TokenCall::AuditConsistency, P::AuditRead, Server, Forbidden),
    mutation_row("POST", "/v1/webhooks", MutationCall::CreateWebhook, P::Webhooks, ServiceOnly, Audit::Action("webhook_create")),
    token_row("GET", "/v1/webhooks", TokenCall::ListWebhooks, P::Webhooks, ServiceOnly, Forbidden),
    token_row("GET", "/v1/webhooks/{webhook}", TokenCall::ReadWebhook, P::Webhooks, ServiceOnly, Forbidden),
    mutation_row("DELETE", "/v1/webhooks/{webhook}", MutationCall::DeleteWebhook, P::Webhooks, ServiceOnly, Audit::Action("webhook_delete")),
    mutation_row("POST", "/v1/webhooks/{webhook}/rotate-secret", MutationCall::RotateWebhookSecret, P::Webhooks, ServiceOnly, Audit::Action("webhook_rotate")),
    mutation_row("POST", "/v1/webhooks/{webhook}/test", MutationCall::TestWebhook, P::Webhooks, ServiceOnly, Audit::Action("webhook_test")),
    token_row("GET", "/v1/webhooks/{webhook}/deliveries", TokenCall::ListDeliveries, P::Webhooks, ServiceOnly, Forbidden),
    mutation_row("POST", "/v1/tokens", MutationCall::CreateToken, P::Tokens, ServiceOnly, Audit::Action("token_create")),
    token_row("GET", "/v1/tokens", TokenCall::ListTokens, P::Tokens, ServiceOnly, Forbidden),
    mutation_row("DELETE", "/v1/tokens/{name}", MutationCall::RevokeToken, P::Tokens, ServiceOnly, Audit::Action("token_revoke")),
    token_row("GET", "/v1/workers", TokenCall::ListWorkers, P::Tokens, ServiceOnly, Forbidden),
    token_row("GET", "/v1/cluster", TokenCall::Cluster, P::Tokens, ServiceOnly, Forbidden),
    token_row("GET", "/v1/freeze", TokenCall::ReadFreeze, P::Read, Server, Forbidden),
    mutation_row("PUT", "/v1/freeze", MutationCall::SetFreeze, P::Freeze, ServiceOnly, Audit::Action("freeze_set")),
    mutation_row("DELETE", "/v1/freeze", MutationCall::LiftFreeze, P::Freeze, ServiceOnly, Audit::Action("freeze_lift")),
    token_row("GET", "/v1/deployments/{id}/freeze", TokenCall::ReadFreeze, P::Read, PathDeployment, NotFound),
    mutation_row("PUT", "/v1/deployments/{id}/freeze", MutationCall::SetFreeze, P::Freeze, PathDeployment, Audit::Action("freeze_set")),
    mutation_row("DELETE", "/v1/deployments/{id}/freeze", MutationCall::LiftFreeze, P::Freeze, PathDeployment, Audit::Action("freeze_lift")),
    worker_row("GET", "/internal/v1/queue", WorkerCall::Queue),
    worker_row("POST", "/internal/v1/builds/{build}/claim", WorkerCall::Claim),
    worker_row("POST", "/internal/v1/attempts/{attempt}/renew", WorkerCall::Renew),
    worker_row("POST", "/internal/v1/attempts/{attempt}/progress", WorkerCall::Progress),
    worker_row("PUT", "/internal/v1/attempts/{attempt}/blobs/{digest}", WorkerCall::Blob),
    worker_row("GET", "/internal/v1/attempts/{attempt}/work-state", WorkerCall::WorkState),
    worker_row("POST", "/internal/v1/attempts/{attempt}/outcome", WorkerCall::Outcome),
    worker_row("POST", "/internal/v1/attempts/{attempt}/calls/{seq}", WorkerCall::CallReport),
    token_row("GET", "/v1/deployments/{id}/nodes", TokenCall::ListNodes, P::Read, PathDeployment, NotFound),
    token_row("GET", "/v1/deployments/{id}/nodes/{node}", TokenCall::ReadNode, P::Read, PathDeployment, NotFound),
    token_row("GET", "/v1/nodes", TokenCall::ListAllNodes, P::Read, EachItem, Forbidden),
    agent_row("GET", "/internal/v1/nodes/{deployment}/{node}/desired", AgentCall::Desired),
    agent_row("POST", "/internal/v1/nodes/{deployment}/{node}/report", AgentCall::Report),
    agent_row("POST", "/internal/v1/nodes/{deployment}/{node}/claim", AgentCall::Claim),
    agent_row("POST", "/internal/v1/nodes/{deployment}/{node}/attempts/{attempt}/renew", AgentCall::Renew),
    agent_row("POST", "/internal/v1/nodes/{deployment}/{node}/attempts/{attempt}/progress", AgentCall::Progress),
    agent_row("POST", "/internal/v1/nodes/{deployment}/{node}/attempts/{attempt}/outcome", AgentCall::Outcome),
    agent_row("GET", "/internal/v1/nodes/{deployment}/{node}/artifacts/{digest}", AgentCall::Artifact),
];

/// A matched route's path parameters.
pub type Params = std::collections::HashMap<&'static str, String>;

impl Audit {
    /// The audit action of one call.
    pub fn action(self, params: &Params) -> &'static str {
        match self {
            Audit::Action(action) => action,
            Audit::ActionByName => match params.get("name").map(String::as_str) {
                Some("suspend") => "action:suspend",
                Some("resume") => "action:resume",
                Some("rollback") => "action:rollback",
                Some("rollout_pause") => "action:rollout_pause",
                Some("rollout_resume") => "action:rollout_resume",
                Some("rollout_abort") => "action:rollout_abort",
                Some(_) | None => "action",
            },
        }
    }
}

/// A token route's caller, authenticated, and the deployment its question
/// named (for the audit event).
pub struct Authorized {
    pub caller: Caller,
    pub deployment: Option<String>,
}

/// The deployment a question names, by the route's scope.
async fn scope_deployment(
    ctx: &Ctx,
    scope: Scope,
    params: &Params,
) -> Result<Option<String>, ApiError> {
    let param = |name: &str| params.get(name).map(String::as_str).unwrap_or("");
    match scope {
        Scope::Server | Scope::QueryActor | Scope::EachItem | Scope::ServiceOnly => Ok(None),
        Scope::PathDeployment => Ok(Some(param("id").to_string())),
        Scope::BuildsDeployment => {
            // An id that does not parse names no build: the handler answers
            // it. A store that cannot be read is not "no deployment": it is
            // read again while it reopens (as a GET is), then answered 503.
            let Some(build) = parse_build_id(param("build")) else {
                return Ok(None);
            };
            let found = super::reading(
                || async { ctx.engine.read().and_then(|rx| rx.build(build)) },
                |e: &crate::store::StoreError| e.kind == StoreErrorKind::Reopening,
            )
            .await;
            match found {
                Ok(found) => Ok(found.map(|b| b.deployment)),
                Err(e) => {
                    tracing::error!(error = %e, "cannot read a build to authorize a call");
                    Err(ApiError::new(
                        Code::Unavailable,
                        "the store could not be read to authorize this call",
                    )
                    .retry_after(1))
                }
            }
        }
    }
}

/// Authenticates a token route before its body is read: the service
/// token, or the callback's decision on this route's question. A refused
/// audited call leaves its event.
#[allow(clippy::too_many_arguments)]
pub async fn authorize(
    ctx: &Ctx,
    ask: Ask,
    audit: Option<Audit>,
    params: &Params,
    query: &[(String, String)],
    headers: &warp::http::HeaderMap,
    method: &str,
    path: &str,
    request_id: &str,
) -> Result<Authorized, ApiError> {
    if let Some(e) = refused_before_the_callback(ctx, ask, audit, params, headers, request_id).await
    {
        return Err(e);
    }
    let deployment = scope_deployment(ctx, ask.scope, params).await?;
    let draft = |deployment: &Option<String>| {
        audit.map(|a| audit::draft(a.action(params), deployment.as_deref(), params, request_id))
    };
    let target = match ask.scope {
        // The callback is asked about this target: check it first.
        Scope::QueryActor if !auth::has_service_token(&ctx.service_token, headers) => {
            Some(audit::target_actor(query)?)
        }
        Scope::QueryActor
        | Scope::Server
        | Scope::PathDeployment
        | Scope::BuildsDeployment
        | Scope::EachItem
        | Scope::ServiceOnly => None,
    };
    let q = Question {
        procedure: ask.procedure,
        deployment: deployment.as_deref(),
        target_actor: target.as_ref(),
        method,
        path,
    };
    let hide = match ask.denial {
        Denial::NotFound => true,
        Denial::Forbidden => false,
    };
    let result = match ask.scope {
        Scope::EachItem => list_caller(ctx, headers, &q).await,
        // Another token is refused: webhooks are the operator's, not a
        // tenant's. The callback (or its cached answer) still says who
        // the caller is, so a known actor's denial is its own event.
        Scope::ServiceOnly if !auth::has_service_token(&ctx.service_token, headers) => {
            Err(service_only_refusal(ctx, headers, &q, hide).await)
        }
        Scope::ServiceOnly => {
            auth::authenticate(&ctx.service_token, &ctx.authz, headers, &q, hide).await
        }
        Scope::Server | Scope::PathDeployment | Scope::BuildsDeployment | Scope::QueryActor => {
            auth::authenticate(&ctx.service_token, &ctx.authz, headers, &q, hide).await
        }
    };
    match result {
        Ok(caller) => Ok(Authorized { caller, deployment }),
        Err(refused) => {
            if let Some(draft) = draft(&deployment) {
                audit::refused(ctx, draft, &refused).await;
            }
            Err(refused.error)
        }
    }
}

/// What is refused before the callback is asked: a token berth issued
/// (it reaches only its own routes, and never the callback: api.md
/// "Authentication"), and an id berth could not have made (nothing of an
/// invalid value is sent or cached).
async fn refused_before_the_callback(
    ctx: &Ctx,
    ask: Ask,
    audit: Option<Audit>,
    params: &Params,
    headers: &warp::http::HeaderMap,
    request_id: &str,
) -> Option<ApiError> {
    if let Some(e) = super::workers::refuse_issued_token(ctx, headers) {
        return Some(e);
    }
    let invalid_id = ask.scope == Scope::PathDeployment
        && !crate::model::is_valid_deployment_id(params.get("id").map_or("", String::as_str))
        && !auth::has_service_token(&ctx.service_token, headers);
    if !invalid_id {
        return None;
    }
    if let Some(a) = audit {
        let draft = audit::draft(a.action(params), None, params, request_id);
        let refused = Refused {
            error: deployments::invalid_deployment_id(),
            actor: None,
            trusted_backend: false,
        };
        audit::refused(ctx, draft, &refused).await;
    }
    Some(deployments::invalid_deployment_id())
}

/// The refusal of another token on a service-only route: `403`, as the
/// actor the callback names when it knows the token (whatever it answers,
/// the route is the operator's); a token nobody knows is an anonymous
/// denial.
async fn service_only_refusal(
    ctx: &Ctx,
    headers: &warp::http::HeaderMap,
    q: &Question<'_>,
    hide: bool,
) -> Refused {
    let forbidden = || ApiError::new(Code::Forbidden, "webhooks take the service token");
    if auth::bearer(headers).is_none() {
        return Refused {
            error: ApiError::new(Code::Unauthenticated, "a bearer token is required"),
            actor: None,
            trusted_backend: false,
        };
    }
    match auth::authenticate(&ctx.service_token, &ctx.authz, headers, q, hide).await {
        Ok(caller) => Refused {
            error: forbidden(),
            actor: caller.actor,
            trusted_backend: false,
        },
        Err(refused) => Refused {
            error: forbidden(),
            ..refused
        },
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

/// A token route answers only once the store is ready (recovery done).
fn ready(ctx: &Ctx) -> Result<(), ApiError> {
    if ctx.engine.ready.load(std::sync::atomic::Ordering::SeqCst) {
        Ok(())
    } else {
        Err(ApiError::new(Code::Unavailable, "the store is not ready yet").retry_after(1))
    }
}

/// Runs a public route.
pub async fn public(ctx: &Arc<Ctx>, call: PublicCall, req: &Request) -> Result<Answer, ApiError> {
    let reply = match call {
        PublicCall::Healthz => Ok(ops::healthz()),
        PublicCall::Readyz => Ok(ops::readyz(ctx)),
        PublicCall::OpenApi => Ok(ops::openapi(ctx)),
        PublicCall::Page => Ok(page::index(req)),
        PublicCall::PageAsset => page::asset(req),
        PublicCall::DeriveInstances => derive::instances(ctx, req).await,
        PublicCall::DeriveApplications => derive::applications(ctx, req).await,
        PublicCall::DeriveSections => derive::sections(ctx, req).await,
    };
    reply.map(Answer::Reply)
}

/// Runs `/metrics` (the handler checks `--metrics-public`).
pub fn metrics(ctx: &Ctx, req: &Request) -> Result<Answer, ApiError> {
    super::metrics::metrics(ctx, req).map(Answer::Reply)
}

/// Runs an event stream (the handler checks its credential).
pub async fn stream(ctx: &Arc<Ctx>, call: StreamCall, req: &Request) -> Result<Answer, ApiError> {
    match call {
        StreamCall::DeploymentEvents => events::deployment_events(ctx, req).await,
        StreamCall::BuildEvents => events::build_events(ctx, req).await,
    }
    .map(Answer::Stream)
}

/// Runs a token route that changes nothing, for its authenticated caller.
pub async fn token(
    ctx: &Arc<Ctx>,
    call: TokenCall,
    req: &Request,
    caller: &Caller,
) -> Result<Answer, ApiError> {
    ready(ctx)?;
    let reply = match call {
        TokenCall::ListDeployments => deployments::list(ctx, req, caller).await,
        TokenCall::ReadDeployment => deployments::read(ctx, req, caller).await,
        TokenCall::Preview => deployments::preview(ctx, req).await,
        TokenCall::ListBuilds => builds::list(ctx, req, caller),
        TokenCall::ListSboms => sboms::list(ctx, req),
        TokenCall::ReadSbom => return sboms::node(ctx, req).await,
        TokenCall::ReadBuild => builds::read(ctx, req),
        TokenCall::BuildLog => return builds::log(ctx, req).await,
        TokenCall::StreamTicket => events::ticket(ctx, req, caller).await,
        TokenCall::AuditList => audit::list(ctx, req, caller),
        TokenCall::AuditProof => audit::proof(ctx, req),
        TokenCall::AuditConsistency => audit::consistency(ctx, req),
        TokenCall::ListWebhooks => webhooks::list(ctx),
        TokenCall::ReadWebhook => webhooks::read(ctx, req),
        TokenCall::ListDeliveries => webhooks::deliveries(ctx, req, caller),
        TokenCall::ListTokens => workers::list_tokens(ctx),
        TokenCall::ListWorkers => workers::list_workers(ctx),
        TokenCall::Cluster => Ok(ops::cluster(ctx)),
        TokenCall::ReadWorkState => workers::read_work_state(ctx, req),
        TokenCall::ReadFreeze => freeze::read(ctx, req),
        TokenCall::ListNodes => agents::list(ctx, req, caller).await,
        TokenCall::ReadNode => agents::read(ctx, req),
        TokenCall::ListAllNodes => agents::list_all(ctx, req, caller).await,
    };
    reply.map(Answer::Reply)
}

/// Runs a mutation for its authenticated caller, under its idempotency
/// key. Its audit event is written with the change (inside the engine's
/// transaction) or, when it changed nothing, here on its own. An
/// idempotent replay is not a new call and writes none.
///
/// One arm per mutation: the match is exhaustive on purpose (a new
/// mutation does not compile until it is routed here), so its length is
/// the number of mutations, not logic to follow.
pub async fn mutation(
    ctx: &Arc<Ctx>,
    call: MutationCall,
    audit_as: Audit,
    req: &Request,
    who: &Authorized,
) -> Result<Answer, ApiError> {
    ready(ctx)?;
    let caller = &who.caller;
    let draft = audit::by(
        audit::draft(
            audit_as.action(&req.params),
            who.deployment.as_deref(),
            &req.params,
            &req.request_id,
        ),
        caller,
    );
    let w = draft.clone();
    let result = match call {
        MutationCall::Submit => {
            idempotency::mutation(ctx, req, caller, w, |w| {
                deployments::submit(ctx, req, caller, w)
            })
            .await
        }
        MutationCall::Act => {
            idempotency::mutation(ctx, req, caller, w, |w| deployments::act(ctx, req, w)).await
        }
        MutationCall::SetUpdatePolicy => {
            idempotency::mutation(ctx, req, caller, w, |w| {
                deployments::set_update_policy(ctx, req, w)
            })
            .await
        }
        MutationCall::SetRolloutPolicy => {
            idempotency::mutation(ctx, req, caller, w, |w| {
                deployments::set_rollout_policy(ctx, req, w)
            })
            .await
        }
        MutationCall::DeleteDeployment => {
            idempotency::mutation(ctx, req, caller, w, |w| deployments::delete(ctx, req, w)).await
        }
        MutationCall::CancelBuild => {
            idempotency::mutation(ctx, req, caller, w, |w| builds::cancel(ctx, req, w)).await
        }
        MutationCall::CreateWebhook => {
            idempotency::mutation(ctx, req, caller, w, |w| webhooks::create(ctx, req, w)).await
        }
        MutationCall::DeleteWebhook => {
            idempotency::mutation(ctx, req, caller, w, |w| webhooks::delete(ctx, req, w)).await
        }
        MutationCall::RotateWebhookSecret => {
            idempotency::mutation(ctx, req, caller, w, |w| webhooks::rotate(ctx, req, w)).await
        }
        MutationCall::TestWebhook => {
            idempotency::mutation(ctx, req, caller, w, |w| webhooks::test(ctx, req, w)).await
        }
        MutationCall::CreateToken => {
            idempotency::mutation(ctx, req, caller, w, |w| workers::create_token(ctx, req, w)).await
        }
        MutationCall::RevokeToken => {
            idempotency::mutation(ctx, req, caller, w, |w| workers::revoke_token(ctx, req, w)).await
        }
        MutationCall::SetFreeze => {
            idempotency::mutation(ctx, req, caller, w, |w| freeze::set(ctx, req, w)).await
        }
        MutationCall::LiftFreeze => {
            idempotency::mutation(ctx, req, caller, w, |w| freeze::lift(ctx, req, w)).await
        }
        MutationCall::PutWorkState => {
            idempotency::mutation(ctx, req, caller, w, |w| {
                workers::put_work_state(ctx, req, w)
            })
            .await
        }
    };
    if let Err(e) = &result {
        audit::failed(ctx, draft, e).await;
    }
    result.map(Answer::Reply)
}

/// Runs a worker's internal call.
pub async fn worker(
    ctx: &Arc<Ctx>,
    call: WorkerCall,
    req: &Request,
    auth: &workers::WorkerAuth,
) -> Result<Answer, ApiError> {
    ready(ctx)?;
    let reply = match call {
        WorkerCall::Queue => workers::queue(ctx, req, auth).await,
        WorkerCall::Claim => workers::claim(ctx, req, auth).await,
        WorkerCall::Renew => workers::renew(ctx, req, auth).await,
        WorkerCall::Progress => workers::progress(ctx, req, auth).await,
        WorkerCall::Outcome => workers::outcome(ctx, req, auth).await,
        WorkerCall::CallReport => workers::call_report(ctx, req, auth).await,
        WorkerCall::Blob => workers::blob(ctx, req, auth).await,
        WorkerCall::WorkState => workers::attempt_work_state(ctx, req, auth),
    };
    reply.map(Answer::Reply)
}

/// Runs an agent's call on its node's routes.
pub async fn agent(
    ctx: &Arc<Ctx>,
    call: AgentCall,
    req: &Request,
    auth: &agents::AgentAuth,
) -> Result<Answer, ApiError> {
    ready(ctx)?;
    match call {
        AgentCall::Desired => agents::desired(ctx, req, auth).await,
        AgentCall::Report => agents::report(ctx, req, auth).await.map(Answer::Reply),
        AgentCall::Claim => agents::claim(ctx, req, auth).await.map(Answer::Reply),
        AgentCall::Renew => agents::renew(ctx, req, auth).await.map(Answer::Reply),
        AgentCall::Progress => agents::progress(ctx, req, auth).await.map(Answer::Reply),
        AgentCall::Outcome => agents::outcome(ctx, req, auth).await.map(Answer::Reply),
        AgentCall::Artifact => agents::artifact(ctx, req, auth).await.map(Answer::Reply),
    }
}

/// Records a mutation refused after its caller was authenticated but
/// before its handler ran (headers, body size, type or time), as that
/// caller's event.
pub async fn audit_failure(
    ctx: &Ctx,
    audit_as: Audit,
    params: &Params,
    request_id: &str,
    who: &Authorized,
    e: &ApiError,
) {
    let draft = audit::draft(
        audit_as.action(params),
        who.deployment.as_deref(),
        params,
        request_id,
    );
    audit::failed(ctx, audit::by(draft, &who.caller), e).await;
}

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

/// The params of `template` in `segments`, if it matches.
///
/// Every request is matched against every route (the others' methods
/// answer a 405's `Allow`), so a template that does not match costs no
/// allocation: the segments are checked first and copied only after.
pub fn match_template(template: &'static str, segments: &[String]) -> Option<Params> {
    // Most routes differ from a request in their number of segments: that
    // is counted first, one scan of the template's bytes (~17,000
    // instructions a request went to walking every template's segments).
    // A template starts with one `/` and has none doubled or trailing (a
    // test holds every route to it; `/` itself is one empty segment), so
    // it has one segment per `/`.
    if template.bytes().filter(|&b| b == b'/').count() != segments.len() {
        return None;
    }
    let parts = || template.trim_start_matches('/').split('/');
    let param_name = |part: &'static str| part.strip_prefix('{').and_then(|p| p.strip_suffix('}'));
    // One pass that stops at the first segment that differs (most routes
    // differ by their second or third).
    let (mut unmatched, mut remaining) = (parts(), segments.iter());
    loop {
        match (unmatched.next(), remaining.next()) {
            (None, None) => break,
            (Some(part), Some(seg)) => {
                let fits = match param_name(part) {
                    Some(_) => !seg.is_empty(),
                    None => part == seg,
                };
                if !fits {
                    return None;
                }
            }
            // One is longer than the other.
            (Some(_), None) | (None, Some(_)) => return None,
        }
    }
    let params = parts()
        .zip(segments)
        .filter_map(|(part, seg)| param_name(part).map(|name| (name, seg.clone())))
        .collect();
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

    /// `match_template` counts a template's segments by its slashes.
    #[test]
    fn every_template_has_one_segment_per_slash() {
        for r in ROUTES {
            let slashes = r.template.bytes().filter(|&b| b == b'/').count();
            let segments = r.template.trim_start_matches('/').split('/');
            assert!(
                r.template.starts_with('/')
                    && (r.template == "/" || segments.clone().all(|s| !s.is_empty())),
                "{}: a template starts with one `/` and has no empty segment",
                r.template
            );
            assert_eq!(slashes, segments.count(), "{}", r.template);
        }
    }

    #[test]
    fn every_route_is_listed_once_with_its_own_handler() {
        let mut seen = std::collections::HashSet::new();
        let mut handlers = std::collections::HashSet::new();
        for r in ROUTES {
            assert!(
                seen.insert((r.method, r.template)),
                "{} {} twice",
                r.method,
                r.template
            );
            assert!(
                handlers.insert(format!("{:?}", r.handler)),
                "{:?} serves two routes",
                r.handler
            );
            // Event streams check their own credential (a ticket); every
            // other route under /v1 that is not derive needs the token.
            let expected = match r.template {
                t if t.ends_with("/events") => Access::StreamCredential,
                t if t.starts_with("/v1/audit") => Access::Token,
                "/metrics" => Access::Metrics,
                t if t.starts_with("/v1/derive/") => Access::Public,
                t if t.starts_with("/internal/v1/nodes/") => Access::AgentToken,
                t if t.starts_with("/internal/") => Access::WorkerToken,
                // The page is public; what it shows needs the token.
                "/healthz" | "/readyz" | "/v1/openapi.json" | "/" | "/ui/{file}" => Access::Public,
                _ => Access::Token,
            };
            assert_eq!(r.access(), expected, "{} {}", r.method, r.template);
            // Every route that is not a GET (and not a derivation or a
            // ticket) changes state, so it must be a mutation: audited
            // and idempotent.
            let changes_state = r.method != "GET"
                && !r.template.starts_with("/v1/derive/")
                && !r.template.starts_with("/internal/")
                && !r.template.ends_with("/preview")
                && r.template != "/v1/stream-tickets";
            assert_eq!(
                changes_state,
                matches!(r.handler, Handler::Mutation(..)),
                "{} {}",
                r.method,
                r.template
            );
        }
    }

    #[test]
    fn a_read_of_a_deployment_hides_a_denial_and_a_mutation_never_does() {
        for r in ROUTES {
            match r.handler {
                Handler::Token(_, ask) => {
                    let names_a_deployment =
                        matches!(ask.scope, Scope::PathDeployment | Scope::BuildsDeployment);
                    let is_read = ask.procedure == Procedure::Read;
                    assert_eq!(
                        ask.denial == Denial::NotFound,
                        names_a_deployment && is_read,
                        "{} {}",
                        r.method,
                        r.template
                    );
                }
                Handler::Mutation(_, ask, _) => assert_eq!(ask.denial, Denial::Forbidden),
                Handler::Public(_)
                | Handler::Metrics
                | Handler::Stream(_)
                | Handler::Worker(_)
                | Handler::Agent(_) => {}
            }
        }
    }
}
