//! Who is calling: the service token marks a trusted backend, which may name
//! the person it acts for (`X-Actor-Subject`, `X-Actor-Issuer`). Any other
//! token is unknown until the authorization callback lands (audit issue).

use super::errors::{ApiError, Code};
use super::{Ctx, Request};
use warp::http::HeaderMap;

/// Longest `X-Actor-Subject` / `X-Actor-Issuer`.
pub const MAX_ACTOR_CHARS: usize = 256;

#[derive(Debug, Clone)]
pub struct Caller {
    /// The actor's subject, or `service` for the backend acting as itself.
    pub subject: String,
    pub issuer: Option<String>,
    pub trusted_backend: bool,
}

/// Compares without an early exit, so timing does not leak the token.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get("authorization")?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// The service token, from the request's headers alone (usable before the
/// body is read).
pub fn has_service_token(ctx: &Ctx, headers: &HeaderMap) -> bool {
    bearer(headers).is_some_and(|t| constant_time_eq(t.as_bytes(), ctx.service_token.as_bytes()))
}

pub fn is_service_token(ctx: &Ctx, req: &Request) -> bool {
    has_service_token(ctx, &req.headers)
}

pub fn authenticate(ctx: &Ctx, req: &Request) -> Result<Caller, ApiError> {
    if !is_service_token(ctx, req) {
        return Err(ApiError::new(
            Code::Unauthenticated,
            "a valid bearer token is required",
        ));
    }
    let actor = |name: &str| -> Result<Option<String>, ApiError> {
        match req.header(name) {
            None => Ok(None),
            Some(v) if v.chars().count() <= MAX_ACTOR_CHARS && !v.is_empty() => {
                Ok(Some(v.to_string()))
            }
            Some(_) => Err(
                ApiError::bad_request(format!("{name} must be 1 to 256 characters"))
                    .field(format!("/headers/{name}"), "length"),
            ),
        }
    };
    let subject = actor("x-actor-subject")?;
    let issuer = actor("x-actor-issuer")?;
    Ok(Caller {
        subject: subject.unwrap_or_else(|| "service".into()),
        issuer,
        trusted_backend: true,
    })
}
