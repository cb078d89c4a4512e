//! Who is calling, and may they (spec api.md "Authentication").
//!
//! The service token marks a trusted backend, which may name the person it
//! acts for (`X-Actor-Subject`, `X-Actor-Issuer`). Any other bearer token
//! goes to the authorization callback (`--authz-url`), which answers allow
//! or deny and who the token belongs to. Answers are cached at most
//! `DECISION_TTL` per (token, procedure, deployment, target); a callback
//! that fails or is slower than `CALLBACK_TIMEOUT` denies. Authentication
//! runs before a byte of the body is read.

use crate::locks::Held;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Deserialize;
use sha2::{Digest, Sha256};
use warp::http::HeaderMap;

use super::errors::{ApiError, Code};
use crate::audit::Actor;

/// Longest `X-Actor-Subject` / `X-Actor-Issuer` (and callback subject).
pub const MAX_ACTOR_CHARS: usize = 256;
/// The callback's time limit: past it, the call is denied.
pub const CALLBACK_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one callback answer is reused (api.md: at most 30 s).
pub const DECISION_TTL: Duration = Duration::from_secs(30);
/// Cached answers at most; past it, expired ones go, then all (a bound on
/// memory against callers cycling tokens).
pub const MAX_CACHED_DECISIONS: usize = 100_000;
/// Bytes the cached answers may take at most (keys and actors counted):
/// what bounds memory when entries are large. Expired entries are also
/// swept every `DECISION_TTL` (`Authz::sweep`), not only at the cap.
pub const MAX_CACHED_DECISION_BYTES: usize = 16 * 1024 * 1024;
/// Largest callback answer read.
const MAX_CALLBACK_ANSWER: usize = 16 * 1024;

/// The authenticated caller.
#[derive(Debug, Clone)]
pub struct Caller {
    /// Who acts: the named actor, `None` for the backend acting as itself.
    pub actor: Option<Actor>,
    pub trusted_backend: bool,
    /// The callback token, for later decisions (list items, stream
    /// re-checks); `None` for the service token.
    pub token: Option<String>,
}

impl Caller {
    /// The key idempotency records and cursors are bound to: distinct per
    /// principal, so a trusted backend naming alice and alice's own token
    /// never share keys.
    pub fn identity(&self) -> String {
        match (&self.actor, self.trusted_backend) {
            (None, _) => "service".into(),
            (Some(a), true) => format!("backend\u{0}{}", a.key()),
            (Some(a), false) => format!("callback\u{0}{}", a.key()),
        }
    }
}

/// What the callback is asked about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Procedure {
    Read,
    Submit,
    Preview,
    Cancel,
    Delete,
    Action,
    UpdatePolicy,
    AuditRead,
    Stream,
    /// Webhook subscriptions: never asked (the service token only).
    Webhooks,
    /// Worker tokens and the workers list: never asked (the service token
    /// only).
    Tokens,
    /// A deployment's freeze (rollouts.md "Freeze").
    Freeze,
}

impl Procedure {
    pub fn as_str(self) -> &'static str {
        match self {
            Procedure::Read => "read",
            Procedure::Submit => "submit",
            Procedure::Preview => "preview",
            Procedure::Cancel => "cancel",
            Procedure::Delete => "delete",
            Procedure::Action => "action",
            Procedure::UpdatePolicy => "update_policy",
            Procedure::AuditRead => "audit_read",
            Procedure::Stream => "stream",
            Procedure::Webhooks => "webhooks",
            Procedure::Tokens => "tokens",
            Procedure::Freeze => "freeze",
        }
    }
}

/// One question to the callback.
#[derive(Debug, Clone)]
pub struct Question<'a> {
    pub procedure: Procedure,
    pub deployment: Option<&'a str>,
    pub target_actor: Option<&'a Actor>,
    pub method: &'a str,
    pub path: &'a str,
}

/// The callback's answer (or the denial standing in for a failed call).
#[derive(Debug, Clone)]
pub struct Decision {
    pub allow: bool,
    /// Who the token belongs to; `None` = unknown token.
    pub actor: Option<Actor>,
}

/// A refused authentication, with who was refused when known (for the
/// audit event).
#[derive(Debug)]
pub struct Refused {
    pub error: ApiError,
    pub actor: Option<Actor>,
    /// The service token was presented (a bad actor header).
    pub trusted_backend: bool,
}

impl Refused {
    fn unauthenticated() -> Refused {
        Refused {
            error: ApiError::new(Code::Unauthenticated, "a valid bearer token is required"),
            actor: None,
            trusted_backend: false,
        }
    }
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
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// The service token, from the request's headers alone.
pub fn has_service_token(service_token: &str, headers: &HeaderMap) -> bool {
    bearer(headers).is_some_and(|t| constant_time_eq(t.as_bytes(), service_token.as_bytes()))
}

/// An actor header: absent, or 1-256 printable ASCII characters. Anything
/// else is a 400, never read as absent (it would act as the service).
fn actor_header(headers: &HeaderMap, name: &str) -> Result<Option<String>, ApiError> {
    let Some(raw) = headers.get(name) else {
        return Ok(None);
    };
    let bad = || {
        ApiError::bad_request(format!(
            "{name} must be 1 to {MAX_ACTOR_CHARS} printable ASCII characters"
        ))
        .field(format!("/headers/{name}"), "format")
    };
    let text = raw.to_str().map_err(|_| bad())?;
    if text.is_empty()
        || text.len() > MAX_ACTOR_CHARS
        || !text.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
    {
        return Err(bad());
    }
    Ok(Some(text.to_string()))
}

/// The trusted backend's caller, from its actor headers.
pub fn trusted_caller(headers: &HeaderMap) -> Result<Caller, ApiError> {
    let subject = actor_header(headers, "x-actor-subject")?;
    let issuer = actor_header(headers, "x-actor-issuer")?;
    if subject.is_none() && issuer.is_some() {
        return Err(
            ApiError::bad_request("X-Actor-Issuer needs X-Actor-Subject")
                .field("/headers/x-actor-subject", "required"),
        );
    }
    Ok(Caller {
        actor: subject.map(|subject| Actor { subject, issuer }),
        trusted_backend: true,
        token: None,
    })
}

/// The authorization callback client and its answer cache.
pub struct Authz {
    url: Option<String>,
    client: Option<reqwest::Client>,
    cache: Mutex<Cache>,
    /// Who each token was last known to be (at most `DECISION_TTL` old):
    /// a denial while the callback is down is still attributed.
    known: Mutex<HashMap<[u8; 32], (Actor, Instant)>>,
}

/// The cached answers and the bytes they take.
#[derive(Default)]
struct Cache {
    answers: HashMap<CacheKey, (Decision, Instant)>,
    bytes: usize,
}

impl Cache {
    fn cost(key: &CacheKey, d: &Decision) -> usize {
        let text = |s: &Option<String>| s.as_ref().map_or(0, String::len);
        std::mem::size_of::<(CacheKey, Decision, Instant)>()
            + text(&key.deployment)
            + text(&key.target)
            + d.actor.as_ref().map_or(0, |a| {
                a.subject.len() + a.issuer.as_ref().map_or(0, String::len)
            })
    }

    fn retain_fresh(&mut self, now: Instant) {
        self.answers
            .retain(|_, (_, at)| now.duration_since(*at) < DECISION_TTL);
        self.bytes = self
            .answers
            .iter()
            .map(|(k, (d, _))| Cache::cost(k, d))
            .sum();
    }

    fn insert(&mut self, key: CacheKey, d: Decision, now: Instant) {
        let cost = Cache::cost(&key, &d);
        if self.answers.len() >= MAX_CACHED_DECISIONS
            || self.bytes + cost > MAX_CACHED_DECISION_BYTES
        {
            self.retain_fresh(now);
            if self.answers.len() >= MAX_CACHED_DECISIONS
                || self.bytes + cost > MAX_CACHED_DECISION_BYTES
            {
                self.answers.clear();
                self.bytes = 0;
            }
        }
        if let Some((old, _)) = self.answers.insert(key.clone(), (d, now)) {
            self.bytes -= Cache::cost(&key, &old);
        }
        self.bytes += cost;
        debug_assert!(
            self.bytes <= MAX_CACHED_DECISION_BYTES,
            "the decision cache is past its bound"
        );
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    token: [u8; 32],
    procedure: Procedure,
    deployment: Option<String>,
    target: Option<String>,
}

#[derive(Deserialize)]
struct CallbackAnswer {
    allow: bool,
    #[serde(default)]
    subject: Option<String>,
    #[serde(default)]
    issuer: Option<String>,
}

impl Authz {
    pub fn new(url: Option<String>) -> Authz {
        let client = url.as_ref().and_then(|_| {
            reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .timeout(CALLBACK_TIMEOUT)
                .build()
                .map_err(|e| tracing::error!(error = %e, "cannot build the authorization callback client; every callback token will be denied"))
                .ok()
        });
        Authz {
            url,
            client,
            cache: Mutex::new(Cache::default()),
            known: Mutex::new(HashMap::new()),
        }
    }

    /// Drops expired answers and identities (run every `DECISION_TTL` by
    /// `serve`): memory follows the callers of the last 30 s, not of the
    /// last time the cap was reached.
    pub fn sweep(&self) {
        let now = Instant::now();
        self.cache.held().retain_fresh(now);
        self.known
            .held()
            .retain(|_, (_, at)| now.duration_since(*at) < DECISION_TTL);
    }

    pub fn configured(&self) -> bool {
        self.url.is_some()
    }

    /// Asks the callback (or its cached answer) about `token`.
    pub async fn decide(&self, token: &str, q: &Question<'_>) -> Decision {
        let token_hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let key = CacheKey {
            token: token_hash,
            procedure: q.procedure,
            deployment: q.deployment.map(str::to_string),
            target: q.target_actor.map(Actor::key),
        };
        let now = Instant::now();
        if let Some((d, at)) = self.cache.held().answers.get(&key) {
            if now.duration_since(*at) < DECISION_TTL {
                return d.clone();
            }
        }
        match self.ask(token, q).await {
            Ok(decision) => {
                self.cache.held().insert(key, decision.clone(), now);
                if let Some(actor) = &decision.actor {
                    let mut known = self.known.held();
                    if known.len() >= MAX_CACHED_DECISIONS {
                        known.clear();
                    }
                    known.insert(token_hash, (actor.clone(), now));
                }
                decision
            }
            Err(why) => {
                tracing::warn!(
                    procedure = q.procedure.as_str(),
                    why,
                    "authorization callback failed: denying"
                );
                let actor = self
                    .known
                    .held()
                    .get(&token_hash)
                    .filter(|(_, at)| now.duration_since(*at) < DECISION_TTL)
                    .map(|(a, _)| a.clone());
                Decision {
                    allow: false,
                    actor,
                }
            }
        }
    }

    async fn ask(&self, token: &str, q: &Question<'_>) -> Result<Decision, &'static str> {
        let (Some(url), Some(client)) = (&self.url, &self.client) else {
            return Err("no callback");
        };
        let mut body = serde_json::json!({
            "token": token,
            "procedure": q.procedure.as_str(),
            "deployment": q.deployment,
            "method": q.method,
            "path": q.path,
        });
        if let Some(t) = q.target_actor {
            body["target_actor"] = serde_json::json!({"subject": t.subject, "issuer": t.issuer});
        }
        let response = client.post(url).json(&body).send().await.map_err(|e| {
            if e.is_timeout() {
                "timed out"
            } else {
                "unreachable"
            }
        })?;
        if response.status() != reqwest::StatusCode::OK {
            return Err("answered a status other than 200");
        }
        if response
            .content_length()
            .is_some_and(|n| n > MAX_CALLBACK_ANSWER as u64)
        {
            return Err("answer too large");
        }
        let bytes = response.bytes().await.map_err(|_| "answer cut off")?;
        if bytes.len() > MAX_CALLBACK_ANSWER {
            return Err("answer too large");
        }
        let answer: CallbackAnswer =
            serde_json::from_slice(&bytes).map_err(|_| "answer is not {allow, subject, issuer}")?;
        let valid = |s: &String| {
            !s.is_empty()
                && s.chars().count() <= MAX_ACTOR_CHARS
                && !s.chars().any(char::is_control)
        };
        let actor = match answer.subject {
            Some(subject) if valid(&subject) => Some(Actor {
                subject,
                issuer: answer.issuer.filter(valid),
            }),
            Some(_) => return Err("answer has an invalid subject"),
            None => None,
        };
        Ok(Decision {
            allow: answer.allow,
            actor,
        })
    }
}

/// Authenticates a token route: the service token, or the callback's
/// answer to `q`. `hide_denial`: a denied known actor gets 404 (a read of
/// a deployment), not 403.
pub async fn authenticate(
    service_token: &str,
    authz: &Authz,
    headers: &HeaderMap,
    q: &Question<'_>,
    hide_denial: bool,
) -> Result<Caller, Refused> {
    if has_service_token(service_token, headers) {
        return trusted_caller(headers).map_err(|error| Refused {
            error,
            actor: None,
            trusted_backend: true,
        });
    }
    let Some(token) = bearer(headers) else {
        return Err(Refused::unauthenticated());
    };
    if !authz.configured() {
        return Err(Refused::unauthenticated());
    }
    let decision = authz.decide(token, q).await;
    match decision {
        Decision {
            allow: true,
            actor: Some(actor),
        } => Ok(Caller {
            actor: Some(actor),
            trusted_backend: false,
            token: Some(token.to_string()),
        }),
        Decision {
            actor: Some(actor), ..
        } => Err(Refused {
            error: if hide_denial {
                ApiError::not_found("deployment")
            } else {
                ApiError::new(
                    Code::Forbidden,
                    "the authorization callback denied this call",
                )
            },
            actor: Some(actor),
            trusted_backend: false,
        }),
        // An allow without a subject names nobody: treated as unknown.
        Decision { actor: None, .. } => Err(Refused::unauthenticated()),
    }
}

/// Whether `caller` may read deployment `id` (always, for the service
/// token): lists filter each item through this.
/// Whether a callback caller may also do `procedure` on deployment `id`
/// (a submit that carries an update policy needs `update_policy` too: one
/// call may not do what its caller is refused as two). The service token
/// may.
pub async fn may_also(
    authz: &Authz,
    caller: &Caller,
    procedure: Procedure,
    id: &str,
    method: &str,
    path: &str,
) -> bool {
    let Some(token) = &caller.token else {
        return true;
    };
    let q = Question {
        procedure,
        deployment: Some(id),
        target_actor: None,
        method,
        path,
    };
    authz.decide(token, &q).await.allow
}

pub async fn may_read(authz: &Authz, caller: &Caller, id: &str, path: &str) -> bool {
    let Some(token) = &caller.token else {
        return true;
    };
    let q = Question {
        procedure: Procedure::Read,
        deployment: Some(id),
        target_actor: None,
        method: "GET",
        path,
    };
    authz.decide(token, &q).await.allow
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answer cache stays within its bytes however large its entries,
    /// and the count of bytes it keeps is exact.
    #[test]
    fn the_answer_cache_is_bounded_in_bytes() {
        let mut cache = Cache::default();
        let now = Instant::now();
        let big = "x".repeat(200);
        for i in 0..200_000u32 {
            let key = CacheKey {
                token: [0; 32],
                procedure: Procedure::Read,
                deployment: Some(format!("{i}")),
                target: Some(big.clone()),
            };
            let decision = Decision {
                allow: true,
                actor: Some(Actor {
                    subject: big.clone(),
                    issuer: Some(big.clone()),
                }),
            };
            cache.insert(key, decision, now);
            assert!(cache.bytes <= MAX_CACHED_DECISION_BYTES);
        }
        let counted: usize = cache
            .answers
            .iter()
            .map(|(k, (d, _))| Cache::cost(k, d))
            .sum();
        assert_eq!(counted, cache.bytes);
        assert!(cache.answers.len() < 200_000, "nothing was ever evicted");
    }

    fn headers(pairs: &[(&str, &[u8])]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                warp::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                warp::http::HeaderValue::from_bytes(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn a_non_ascii_actor_header_is_refused_not_ignored() {
        let h = headers(&[("x-actor-subject", "zoë@example.org".as_bytes())]);
        assert_eq!(trusted_caller(&h).unwrap_err().code, Code::InvalidRequest);
        let h = headers(&[("x-actor-subject", b"\xff\xfe")]);
        assert_eq!(trusted_caller(&h).unwrap_err().code, Code::InvalidRequest);
        let h = headers(&[("x-actor-subject", b"alice@example.org")]);
        let c = trusted_caller(&h).unwrap();
        assert_eq!(c.actor.unwrap().subject, "alice@example.org");
        let c = trusted_caller(&headers(&[])).unwrap();
        assert_eq!(c.identity(), "service");
    }
}
