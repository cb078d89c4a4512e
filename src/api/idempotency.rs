//! Idempotency keys on every mutation (spec api.md "Idempotency").
//!
//! The key's identity is (caller subject, route template, key). The response
//! of a mutation is stored with the mutation, in the same transaction (see
//! `IdemWrite::store`); a 4xx refusal is stored in its own transaction; 5xx
//! never. A second request with the same identity waits for the first (a
//! per-identity lock) and then replays it.

use std::future::Future;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::auth::Caller;
use super::errors::{ApiError, Code};
use super::{Ctx, Reply, Request};
use crate::audit::Draft;
use crate::engine::audit::{Audited, Record};
use crate::engine::Recorder;
use crate::model::{format_time, now_millis, Millis};
use crate::store::Lookup;
use crate::store::{IdempotencyIdentity, IdempotencyRecord, Principal, StoreResult, Tx};

/// How long a stored response is replayed.
pub const IDEMPOTENCY_TTL: Millis = 24 * 3600 * 1000;

/// What a mutation stores with itself.
#[derive(Debug, Clone)]
pub struct IdemWrite {
    pub identity: IdempotencyIdentity,
    pub fingerprint: Vec<u8>,
    pub expires_at: Millis,
}

impl IdemWrite {
    /// The engine's hook that stores this record, with the answer `render`
    /// makes of the outcome, in the mutation's own transaction. The handler
    /// answers with the same `render`, so a replay is byte-for-byte the
    /// first answer.
    pub fn recorder<O: 'static>(
        self,
        render: impl Fn(&O) -> StoreResult<Reply> + Send + Sync + 'static,
    ) -> Recorder<O> {
        Box::new(move |tx, outcome| self.store(tx, &render(outcome)?))
    }

    pub fn store(&self, tx: &Tx, reply: &Reply) -> StoreResult<()> {
        tx.put_idempotency(
            &self.identity.store_key(),
            &IdempotencyRecord {
                fingerprint: self.fingerprint.clone(),
                status: reply.status,
                content_type: reply.content_type.clone(),
                body: reply.body.clone(),
                headers: reply.headers.clone(),
                expires_at: self.expires_at,
                identity: self.identity.clone(),
            },
        )
    }
}

/// What a mutation stores with its change: its audit event, and its
/// answer when it came with an `Idempotency-Key`.
pub struct Write {
    pub idem: Option<IdemWrite>,
    pub audit: Draft,
}

impl Write {
    /// The engine's record of this mutation; `render` makes the answer
    /// (stored for a replay, and sent).
    pub fn record<O: Audited + 'static>(
        self,
        render: impl Fn(&O) -> Reply + Send + Sync + 'static,
    ) -> Record<O> {
        self.record_checked(move |outcome| Ok(render(outcome)))
    }

    /// As `record`, for an answer rendered from stored records that may
    /// turn out damaged: the mutation's transaction then fails with the
    /// store's error, and no answer is stored.
    pub fn record_checked<O: Audited + 'static>(
        self,
        render: impl Fn(&O) -> StoreResult<Reply> + Send + Sync + 'static,
    ) -> Record<O> {
        Record {
            audit: self.audit,
            reply: self.idem.map(|w| w.recorder(render)),
        }
    }
}

pub fn valid_key(key: &str) -> bool {
    (16..=128).contains(&key.len())
        && key
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._~-".contains(&c))
}

/// SHA-256 of the RFC 8785 form of {path params, query, body, If-Match}:
/// a retry with another precondition is another request (a conflict), not
/// a replay of the first one's answer.
pub fn fingerprint(req: &Request) -> Result<Vec<u8>, ApiError> {
    let params: serde_json::Map<String, Value> = req
        .params
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    let mut query: Vec<(String, String)> = req.query.clone();
    query.sort();
    let body = match serde_json::from_slice::<Value>(&req.body) {
        Ok(v) => v,
        Err(_) if req.body.is_empty() => Value::Null,
        Err(_) => json!({"sha256": crate::hex::encode(&Sha256::digest(&req.body))}),
    };
    let if_match = req
        .headers
        .get("if-match")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let doc = json!({"params": params, "query": query, "body": body, "if_match": if_match});
    let text = crate::derive::canonical(&doc).map_err(|e| {
        // Not the request's values: only why it could not be written.
        tracing::error!(error = %e, "cannot write a request's fingerprint");
        ApiError::internal()
    })?;
    Ok(Sha256::digest(text.as_bytes()).to_vec())
}

/// Whose key this is: distinct per principal, so a trusted backend naming
/// alice and alice's own token never share keys (`Caller::identity`).
fn identity_of(caller: &Caller, route: &str, key: &str) -> IdempotencyIdentity {
    let principal = match (&caller.actor, caller.trusted_backend) {
        (None, _) => Principal::Service,
        (Some(_), true) => Principal::Backend,
        (Some(_), false) => Principal::Callback,
    };
    IdempotencyIdentity {
        principal,
        subject: caller.actor.as_ref().map(|a| a.subject.clone()),
        issuer: caller.actor.as_ref().and_then(|a| a.issuer.clone()),
        route: route.to_string(),
        key: key.to_string(),
    }
}

/// Runs a mutation under its idempotency key, when it has one.
pub async fn mutation<'a, F, Fut>(
    ctx: &'a Ctx,
    req: &'a Request,
    caller: &Caller,
    audit: Draft,
    run: F,
) -> Result<Reply, ApiError>
where
    F: FnOnce(Write) -> Fut,
    Fut: Future<Output = Result<Reply, ApiError>> + 'a,
{
    let Some(key) = req.header("idempotency-key") else {
        return run(Write { idem: None, audit }).await;
    };
    if !valid_key(key) {
        return Err(
            ApiError::bad_request("Idempotency-Key must be 16 to 128 of [A-Za-z0-9._~-]")
                .field("/headers/idempotency-key", "format"),
        );
    }
    let identity = identity_of(caller, req.route, key);
    let _guard = ctx.idempotency.lock(identity.store_key()).await;
    run_locked(ctx, req, identity, audit, run).await
}

async fn run_locked<'a, F, Fut>(
    ctx: &'a Ctx,
    req: &'a Request,
    identity: IdempotencyIdentity,
    audit: Draft,
    run: F,
) -> Result<Reply, ApiError>
where
    F: FnOnce(Write) -> Fut,
    Fut: Future<Output = Result<Reply, ApiError>> + 'a,
{
    let fp = fingerprint(req)?;
    let now = now_millis();
    if let Some(stored) = ctx
        .engine
        .store
        .read()?
        .idempotency(&identity.store_key())?
    {
        if stored.expires_at > now {
            if stored.fingerprint != fp {
                return Err(ApiError::new(
                    Code::IdempotencyConflict,
                    "this Idempotency-Key was used with another request",
                ));
            }
            let mut reply = Reply::text(stored.status, &stored.content_type, stored.body);
            reply.headers = stored.headers;
            return Ok(reply
                .header("Idempotent-Replayed", "true")
                .header("Idempotency-Expires-At", format_time(stored.expires_at)));
        }
    }
    let write = IdemWrite {
        identity,
        fingerprint: fp,
        expires_at: now + IDEMPOTENCY_TTL,
    };
    let expires = format_time(write.expires_at);
    match run(Write {
        idem: Some(write.clone()),
        audit,
    })
    .await
    {
        Ok(reply) => Ok(reply.header("Idempotency-Expires-At", expires)),
        Err(e) if (400..500).contains(&e.code.status()) => {
            let reply = Reply::from_error(&e, &req.request_id);
            // A refusal is stored in its own transaction; if that fails the
            // caller still gets the refusal.
            let w = write.clone();
            if let Err(se) = ctx.engine.store.write(move |tx| w.store(tx, &reply)).await {
                tracing::error!(error = %se, "cannot store an idempotent refusal");
            }
            Err(e)
        }
        Err(e) => Err(e),
    }
}
