//! The error table of spec/api.md, and nothing else maps errors.
//!
//! Every refusal berth answers is an `ApiError`: a code from the table, an
//! optional finer `reason`, a message that never contains a request value,
//! and field pointers. The engine refuses in domain terms (`Refusal`); the
//! one `From<Refusal>` below decides their status codes and messages.
//! `Reply::from_error` turns an `ApiError` into a problem+json response.

use serde::Serialize;

pub use crate::engine::refusal::FieldError;
use crate::engine::refusal::{
    Conflict, EvalUnavailable, InvalidSource, Missing, QueueFull, Refusal,
};
use crate::store::{StoreError, StoreErrorKind};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    InvalidRequest,
    InvalidConfiguration,
    Unauthenticated,
    Forbidden,
    NotFound,
    MethodNotAllowed,
    Conflict,
    QueueFull,
    IdempotencyConflict,
    PreconditionFailed,
    /// A worker's stale authority (workers.md): spelled as a failed
    /// precondition, answered 409 (an `If-Match` stays 412).
    #[serde(rename = "precondition_failed")]
    StaleAuthority,
    PayloadTooLarge,
    UnsupportedMediaType,
    RangeNotSatisfiable,
    EvalUnavailable,
    Unavailable,
    Internal,
}

impl Code {
    /// The code as the error body spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::InvalidRequest => "invalid_request",
            Code::InvalidConfiguration => "invalid_configuration",
            Code::Unauthenticated => "unauthenticated",
            Code::Forbidden => "forbidden",
            Code::NotFound => "not_found",
            Code::MethodNotAllowed => "method_not_allowed",
            Code::Conflict => "conflict",
            Code::QueueFull => "queue_full",
            Code::IdempotencyConflict => "idempotency_conflict",
            Code::PreconditionFailed | Code::StaleAuthority => "precondition_failed",
            Code::PayloadTooLarge => "payload_too_large",
            Code::UnsupportedMediaType => "unsupported_media_type",
            Code::RangeNotSatisfiable => "range_not_satisfiable",
            Code::EvalUnavailable => "eval_unavailable",
            Code::Unavailable => "unavailable",
            Code::Internal => "internal",
        }
    }

    pub fn status(self) -> u16 {
        match self {
            Code::InvalidRequest => 400,
            Code::InvalidConfiguration => 422,
            Code::Unauthenticated => 401,
            Code::Forbidden => 403,
            Code::NotFound => 404,
            Code::MethodNotAllowed => 405,
            Code::Conflict | Code::QueueFull | Code::IdempotencyConflict | Code::StaleAuthority => {
                409
            }
            Code::PreconditionFailed => 412,
            Code::PayloadTooLarge => 413,
            Code::UnsupportedMediaType => 415,
            Code::RangeNotSatisfiable => 416,
            Code::EvalUnavailable | Code::Unavailable => 503,
            Code::Internal => 500,
        }
    }
}

/// Boxed so that `Result<T, ApiError>` stays one pointer wide on the happy path.
#[derive(Debug, Clone)]
pub struct ApiError(Box<Problem>);

#[derive(Debug, Clone)]
pub struct Problem {
    pub code: Code,
    pub reason: Option<String>,
    pub message: String,
    pub fields: Vec<FieldError>,
    pub deployer_message: Option<String>,
    pub retry_after: Option<u32>,
    pub allow: Option<String>,
    pub content_range: Option<String>,
    /// A read that raced the store's reopen: the same request may simply
    /// run again.
    pub retry_read: bool,
    /// Answer with `Connection: close` (the body was not read).
    pub close: bool,
    /// A progress gap's extension member (workers.md "Progress").
    pub applied_through: Option<u64>,
}

/// The deployer's own explanation is cut to this many characters.
pub const MAX_DEPLOYER_MESSAGE_CHARS: usize = 2000;

impl std::ops::Deref for ApiError {
    type Target = Problem;
    fn deref(&self) -> &Problem {
        &self.0
    }
}

impl std::ops::DerefMut for ApiError {
    fn deref_mut(&mut self) -> &mut Problem {
        &mut self.0
    }
}

/// The body of an error whose own body could not be encoded: the same
/// members as every error body (a unit test holds them equal).
const UNENCODABLE_ERROR_BODY: &[u8] = br#"{"code":"internal","reason":null,"message":"internal error; the server log has the detail","request_id":"","fields":[],"deployer_message":null}"#;

impl ApiError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self(Box::new(Problem {
            code,
            reason: None,
            message: message.into(),
            fields: Vec::new(),
            deployer_message: None,
            retry_after: None,
            allow: None,
            content_range: None,
            retry_read: false,
            close: false,
            applied_through: None,
        }))
    }
    pub fn reason(mut self, reason: &str) -> Self {
        self.reason = Some(reason.to_string());
        self
    }
    pub fn field(mut self, pointer: impl Into<String>, code: impl Into<String>) -> Self {
        self.fields.push(FieldError::new(pointer, code));
        self
    }
    pub fn retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = Some(seconds);
        self
    }
    pub fn deployer_message(mut self, text: &str) -> Self {
        self.deployer_message = Some(text.chars().take(MAX_DEPLOYER_MESSAGE_CHARS).collect());
        self
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidRequest, message)
    }
    pub fn not_found(what: &str) -> Self {
        Self::new(Code::NotFound, format!("no such {what}"))
    }
    pub fn conflict(reason: &str, message: impl Into<String>) -> Self {
        Self::new(Code::Conflict, message).reason(reason)
    }
    pub fn internal() -> Self {
        Self::new(
            Code::Internal,
            "internal error; the server log has the detail",
        )
    }

    /// The problem+json body.
    pub fn body(&self, request_id: &str) -> Vec<u8> {
        #[derive(Serialize)]
        struct Body<'a> {
            code: Code,
            reason: &'a Option<String>,
            message: &'a str,
            request_id: &'a str,
            fields: &'a [FieldError],
            deployer_message: &'a Option<String>,
            #[serde(skip_serializing_if = "Option::is_none")]
            applied_through: Option<u64>,
        }
        serde_json::to_vec(&Body {
            code: self.code,
            reason: &self.reason,
            message: &self.message,
            request_id,
            fields: &self.fields,
            deployer_message: &self.deployer_message,
            applied_through: self.applied_through,
        })
        .unwrap_or_else(|e| {
            // Cannot happen with these field types; if it did, the client
            // still gets a body of the documented shape.
            tracing::error!(error = %e, "cannot encode an error body");
            UNENCODABLE_ERROR_BODY.to_vec()
        })
    }
}

/// The one mapping of store errors to answers. One arm per kind of store
/// error: the match is exhaustive on purpose (a new kind does not compile
/// until its status, reason and log level are decided here), so its
/// length is the number of kinds, not logic to follow.
impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e.kind {
            StoreErrorKind::DiskFull => {
                tracing::error!(error = %e, "disk full");
                ApiError::new(Code::Unavailable, "the disk is full; nothing was stored")
                    .reason("disk_full")
                    .retry_after(10)
            }
            StoreErrorKind::Closed => {
                ApiError::new(Code::Unavailable, "the store is shutting down").retry_after(1)
            }
            StoreErrorKind::Reopening => {
                let mut e = ApiError::new(
                    Code::Unavailable,
                    "the store is reopening after an I/O error; nothing was stored",
                )
                .retry_after(1);
                e.retry_read = true;
                e
            }
            StoreErrorKind::Unreachable => {
                tracing::warn!(error = %e, "store unreachable");
                ApiError::new(
                    Code::Unavailable,
                    "the store's database cannot be reached; nothing was stored",
                )
                .reason("store_unreachable")
                .retry_after(1)
            }
            StoreErrorKind::Io => {
                tracing::error!(error = %e, "store I/O error");
                ApiError::new(
                    Code::Unavailable,
                    "the store hit an I/O error; nothing was stored",
                )
                .reason("storage_io")
                .retry_after(5)
            }
            StoreErrorKind::Corrupt | StoreErrorKind::Damaged | StoreErrorKind::Other => {
                tracing::error!(error = %e, "store failure");
                ApiError::internal()
            }
        }
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::NotFound(Missing::Deployment) => ApiError::not_found("deployment"),
            Refusal::NotFound(Missing::Build) => ApiError::not_found("build"),
            Refusal::NotFound(Missing::Action) => ApiError::not_found("action"),
            Refusal::NotFound(Missing::Webhook) => ApiError::not_found("webhook"),
            Refusal::NotFound(Missing::Token) => ApiError::not_found("token"),
            Refusal::NotFound(Missing::Attempt) => ApiError::not_found("attempt"),
            Refusal::NotFound(Missing::WorkState) => ApiError::not_found("work state"),
            Refusal::NotFound(Missing::Freeze) => {
                ApiError::new(Code::NotFound, "no freeze is set there").reason("not_frozen")
            }
            Refusal::Frozen { scope, reason } => {
                ApiError::conflict("frozen", format!("frozen ({scope}): {reason}"))
            }
            Refusal::TooLarge(why) => ApiError::new(Code::PayloadTooLarge, why),
            Refusal::Claim(c) => ApiError::conflict(c.reason(), claim_message(c)),
            Refusal::Stale(stale) => {
                ApiError::new(Code::StaleAuthority, stale_message(stale)).reason(stale.reason())
            }
            Refusal::IdempotencyConflict => ApiError::new(
                Code::IdempotencyConflict,
                "this operation_id was used with another body; send a new operation_id",
            ),
            Refusal::ProgressGap { applied_through } => {
                let mut e = ApiError::conflict(
                    "progress_gap",
                    "the items do not follow applied_through; send from applied_through + 1",
                );
                e.0.applied_through = Some(applied_through);
                e
            }
            Refusal::ActionRefused(reason) => ApiError::conflict(
                reason.code(),
                "the deployment's actions list shows this action disabled; its reason says why",
            ),
            Refusal::PreconditionFailed => ApiError::new(
                Code::PreconditionFailed,
                "If-Match does not match the deployment's current revision; read it again",
            ),
            Refusal::InvalidSource(InvalidSource::DigestFormat) => ApiError::bad_request(
                "the source digest must be sha256: and 64 lower-case hex digits",
            )
            .field("/source/digest", "format"),
            Refusal::InvalidSource(InvalidSource::OriginNotAllowed) => ApiError::bad_request(
                "the source url's origin is not allowed (see --source-origin)",
            )
            .field("/source/url", "source_origin_not_allowed"),
            Refusal::InvalidConfiguration {
                message,
                fields,
                deployer_message,
            } => {
                let mut e = ApiError::new(Code::InvalidConfiguration, message);
                e.fields = fields;
                if let Some(text) = deployer_message {
                    e = e.deployer_message(&text);
                }
                e
            }
            Refusal::Conflict(c) => ApiError::conflict(c.code(), conflict_message(c)),
            Refusal::QueueFull(QueueFull::BuildRunning) => ApiError::new(
                Code::QueueFull,
                "a build of this deployment is running; use mode \"enqueue\" to queue behind it",
            ),
            Refusal::QueueFull(QueueFull::QueueLimit) => ApiError::new(
                Code::QueueFull,
                "this deployment has as many queued builds as --max-queued-builds allows",
            )
            .reason("queue_limit"),
            Refusal::EvalUnavailable { reason, message } => {
                let message = match reason {
                    EvalUnavailable::SlotsBusy => "every eval slot is busy",
                    EvalUnavailable::Timeout | EvalUnavailable::Crashed => message,
                };
                ApiError::new(Code::EvalUnavailable, message)
                    .reason(reason.code())
                    .retry_after(1)
            }
            Refusal::Store(e) => e.into(),
            Refusal::Internal => ApiError::internal(),
        }
    }
}

fn claim_message(c: crate::authority::ClaimRefusal) -> &'static str {
    use crate::authority::ClaimRefusal as C;
    match c {
        C::AlreadyClaimed => "another worker claimed this build first",
        C::NotQueued => "the build is not queued any more",
        C::NotClaimable => {
            "the build waits behind another build of its deployment; poll the queue again"
        }
        C::LabelsMismatch => "the build requires labels this worker does not offer",
        C::WorkerFull => "this worker holds as many attempts as it may",
    }
}

fn stale_message(s: crate::authority::Stale) -> &'static str {
    use crate::authority::Stale;
    match s {
        Stale::Authority => {
            "this attempt's authority is not current (another fence or incarnation, or it ended); the call had no effect"
        }
        Stale::LeaseExpired => {
            "this attempt's lease passed and the build was taken from it; the call had no effect"
        }
    }
}

fn conflict_message(c: Conflict) -> &'static str {
    match c {
        Conflict::Suspended => "the deployment is suspended; resume it first",
        Conflict::SourceImmutable => "this digest is already registered with another url or rev",
        Conflict::PolicyNotManual => "an explicit source needs the manual update policy",
        Conflict::BuildFinished => "the build has already finished",
        Conflict::TooManyWebhooks => "--max-webhooks subscriptions exist; delete one first",
        Conflict::TokenExists => {
            "a token of this name exists; revoke it first or pick another name"
        }
        Conflict::WorkerLimit => "--max-workers worker tokens exist; revoke one first",
        Conflict::NodeBound => {
            "this node has two live agent tokens (one and its rotation); revoke one first"
        }
        Conflict::AgentLimit => "--max-agents agent tokens exist; revoke one first",
        Conflict::BuildRunning => {
            "a build of this deployment is claimed or running; wait for it to end"
        }
        Conflict::RolloutUnsupported => {
            "this deployment's source does not list activate; only the policy {} applies to it"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fallback_error_body_has_every_member_of_an_error_body() {
        let keys = |bytes: &[u8]| -> Vec<String> {
            let v: serde_json::Value = serde_json::from_slice(bytes).expect("a JSON body");
            let mut keys: Vec<String> = v.as_object().expect("an object").keys().cloned().collect();
            keys.sort();
            keys
        };
        assert_eq!(
            keys(UNENCODABLE_ERROR_BODY),
            keys(&ApiError::internal().body("req"))
        );
    }
}
