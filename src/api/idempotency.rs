//! Idempotency keys on every mutation (spec api.md "Idempotency").
//!
//! The key's identity is (caller subject, route template, key). The response
//! of a mutation is stored with the mutation, in the same transaction (see
//! `IdemWrite::store`); a 4xx refusal is stored in its own transaction; 5xx
//! never. A second request with the same identity waits for the first (a
//! per-identity lock) and then replays it.

use std::collections::HashMap;
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
    let if_match = req
        .headers
        .get("if-match")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    fingerprint_of(&req.params, &req.query, &req.body, if_match.as_deref()).map_err(|e| {
        // Not the request's values: only why it could not be written.
        tracing::error!(error = %e, "cannot write a request's fingerprint");
        ApiError::internal()
    })
}

/// `fingerprint`'s hash, written straight into SHA-256. The document is
/// never built: RFC 8785 writes an object as its members sorted by key
/// (UTF-16 code units), and "body" < "if_match" < "params" < "query", so
/// its canonical text is those members' texts in that order. Every value
/// is still written by `serde_jcs`; only the two fixed objects (the
/// document and the path params) are put together here. Why: `serde_jcs`
/// allocates on every write and parses each object key again to sort it,
/// and the whole document cost ~60,000 instructions a submit, a third of
/// the request's. The stored fingerprints must not change (a retry across
/// an upgrade would be refused as a conflict), so a test holds this equal
/// to the canonical text of the document built whole.
fn fingerprint_of(
    params: &HashMap<&'static str, String>,
    query: &[(String, String)],
    body: &[u8],
    if_match: Option<&str>,
) -> Result<Vec<u8>, serde_json::Error> {
    let mut hash = HashWriter(Sha256::new());
    hash.0.update(b"{\"body\":");
    match serde_json::from_slice::<Value>(body) {
        Ok(v) => serde_jcs::to_writer(&mut hash, &v)?,
        Err(_) if body.is_empty() => hash.0.update(b"null"),
        Err(_) => serde_jcs::to_writer(
            &mut hash,
            &json!({"sha256": crate::hex::encode(&Sha256::digest(body))}),
        )?,
    }
    hash.0.update(b",\"if_match\":");
    serde_jcs::to_writer(&mut hash, &if_match)?;
    hash.0.update(b",\"params\":{");
    let mut names: Vec<&&'static str> = params.keys().collect();
    names.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
    for (i, name) in names.into_iter().enumerate() {
        if i > 0 {
            hash.0.update(b",");
        }
        serde_jcs::to_writer(&mut hash, name)?;
        hash.0.update(b":");
        serde_jcs::to_writer(&mut hash, &params[name])?;
    }
    hash.0.update(b"},\"query\":");
    let mut query = query.to_vec();
    query.sort();
    serde_jcs::to_writer(&mut hash, &query)?;
    hash.0.update(b"}");
    Ok(hash.0.finalize().to_vec())
}

/// Bytes written into a SHA-256 (`serde_jcs` writes to an `io::Write`).
struct HashWriter(Sha256);

impl std::io::Write for HashWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.update(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
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
    if let Some(stored) = ctx.engine.read()?.idempotency(&identity.store_key())? {
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
            if let Err(se) = ctx.engine.keep_answer(move |tx| w.store(tx, &reply)).await {
                tracing::error!(error = %se, "cannot store an idempotent refusal");
            }
            Err(e)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fingerprint as it was first written: the whole document built
    /// and made canonical. Stored fingerprints were made so.
    fn built_whole(
        params: &HashMap<&'static str, String>,
        query: &[(String, String)],
        body: &[u8],
        if_match: Option<&str>,
    ) -> Vec<u8> {
        let params: serde_json::Map<String, Value> = params
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        let mut query = query.to_vec();
        query.sort();
        let body = match serde_json::from_slice::<Value>(body) {
            Ok(v) => v,
            Err(_) if body.is_empty() => Value::Null,
            Err(_) => json!({"sha256": crate::hex::encode(&Sha256::digest(body))}),
        };
        let doc = json!({"params": params, "query": query, "body": body, "if_match": if_match});
        Sha256::digest(crate::derive::canonical(&doc).unwrap().as_bytes()).to_vec()
    }

    #[test]
    fn fingerprints_equal_those_of_the_document_built_whole() {
        let bodies: [&[u8]; 9] = [
            b"",
            b"not json {",
            br#"{"configuration":{"domain":"a.example.org"},"mode":"enqueue"}"#,
            br#"{"b":1,"a":[1.5,1e21,-0.0,100,true,null],"\u00e9":"x","\ud83d\ude00":2,"\uffff":3}"#,
            br#"{"s":"tab\t nl\n \u0001 quote\" back\\ \u2028 del\u007f"}"#,
            b"[3, 2, 1]",
            b"\"just a string\"",
            b"12345678901234567890",
            b"  {\n \"spaced\" : { \"z\": 0, \"y\": 1e-7 } }  ",
        ];
        let params_sets: Vec<HashMap<&'static str, String>> = vec![
            HashMap::new(),
            HashMap::from([("id", "web-1".to_string())]),
            HashMap::from([
                ("id", "d\u{e9}\u{1f600}\n\"".to_string()),
                ("build", "0195".to_string()),
                ("Name", "x".to_string()),
            ]),
        ];
        let queries: Vec<Vec<(String, String)>> = vec![
            vec![],
            vec![
                ("limit".into(), "5".into()),
                ("after".into(), "x\u{1}".into()),
                ("after".into(), "a".into()),
            ],
        ];
        let mut checked = 0;
        for body in bodies {
            for params in &params_sets {
                for query in &queries {
                    for if_match in [None, Some("\"v1\""), Some("*")] {
                        assert_eq!(
                            fingerprint_of(params, query, body, if_match).unwrap(),
                            built_whole(params, query, body, if_match),
                            "body {:?}, params {params:?}, query {query:?}, if-match {if_match:?}",
                            String::from_utf8_lossy(body)
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 9 * 3 * 2 * 3);
    }
}
