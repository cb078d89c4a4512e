//! The error table of spec/api.md, and nothing else maps errors.
//!
//! Every refusal in berth is an `ApiError`: a code from the table, an
//! optional finer `reason`, a message that never contains a request value,
//! and field pointers. `render` turns it into a problem+json response.

use serde::Serialize;

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
    PayloadTooLarge,
    UnsupportedMediaType,
    RangeNotSatisfiable,
    EvalUnavailable,
    Unavailable,
    Internal,
}

impl Code {
    pub fn status(self) -> u16 {
        match self {
            Code::InvalidRequest => 400,
            Code::InvalidConfiguration => 422,
            Code::Unauthenticated => 401,
            Code::Forbidden => 403,
            Code::NotFound => 404,
            Code::MethodNotAllowed => 405,
            Code::Conflict | Code::QueueFull | Code::IdempotencyConflict => 409,
            Code::PreconditionFailed => 412,
            Code::PayloadTooLarge => 413,
            Code::UnsupportedMediaType => 415,
            Code::RangeNotSatisfiable => 416,
            Code::EvalUnavailable | Code::Unavailable => 503,
            Code::Internal => 500,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FieldError {
    pub pointer: String,
    pub code: String,
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
        }))
    }
    pub fn reason(mut self, reason: &str) -> Self {
        self.reason = Some(reason.to_string());
        self
    }
    pub fn field(mut self, pointer: impl Into<String>, code: impl Into<String>) -> Self {
        self.fields.push(FieldError {
            pointer: pointer.into(),
            code: code.into(),
        });
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
        }
        serde_json::to_vec(&Body {
            code: self.code,
            reason: &self.reason,
            message: &self.message,
            request_id,
            fields: &self.fields,
            deployer_message: &self.deployer_message,
        })
        .unwrap_or_default()
    }
}

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
            StoreErrorKind::Io => {
                tracing::error!(error = %e, "store I/O error");
                ApiError::new(
                    Code::Unavailable,
                    "the store hit an I/O error; nothing was stored",
                )
                .reason("storage_io")
                .retry_after(5)
            }
            _ => {
                tracing::error!(error = %e, "store failure");
                ApiError::internal()
            }
        }
    }
}
