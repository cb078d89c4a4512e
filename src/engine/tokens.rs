//! Worker and agent tokens (api.md "Tokens"): made with a random secret
//! shown once, stored as its SHA-256, revoked at once. A revoked worker
//! token loses its attempts in the revocation's transaction. An agent
//! token is bound to one deployment's node (agents.md "Binding"): at most
//! `MAX_TOKENS_PER_NODE` live per node, `--max-agents` in all.

use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::audit::{Audited, Record};
use super::refusal::{Conflict, Missing, Refusal};
use super::transition::Change;
use super::Engine;
use crate::model::*;
use crate::store::{Lookup, StoreResult};

pub use crate::nodes::MAX_TOKENS_PER_NODE;

/// Bytes of randomness in a token's secret.
const SECRET_BYTES: usize = 32;
/// What every token's secret starts with: a reader (and a secret scanner)
/// tells it from the service token.
pub const TOKEN_PREFIX: &str = "brt_";

/// A token as its routes show it; `secret` only in the answer that made it.
#[derive(Debug, Clone)]
pub struct Token {
    pub record: TokenRecord,
    pub secret: Option<String>,
}

impl Audited for Token {
    fn audited_build(&self) -> Option<BuildId> {
        None
    }
}

/// What a new token asks for, checked by the API.
pub struct NewToken {
    pub name: String,
    pub kind: TokenKind,
    pub labels: Vec<String>,
    /// An agent token's node (the API requires it exactly for agents).
    pub node: Option<NodeBinding>,
}

/// Why a new token may not be made beside `tokens`: its name is taken, or
/// a limit of its kind is reached.
fn token_refusal(
    tokens: &[(String, TokenRecord)],
    new: &NewToken,
    (max_workers, max_agents): (usize, usize),
) -> Option<Conflict> {
    if tokens.iter().any(|(_, t)| t.name == new.name) {
        return Some(Conflict::TokenExists);
    }
    let of_kind = tokens.iter().filter(|(_, t)| t.kind == new.kind).count();
    match new.kind {
        TokenKind::Worker if of_kind >= max_workers => Some(Conflict::WorkerLimit),
        TokenKind::Worker => None,
        TokenKind::Agent => {
            let on_node = tokens
                .iter()
                .filter(|(_, t)| t.node.is_some() && t.node == new.node)
                .count();
            if on_node >= MAX_TOKENS_PER_NODE {
                Some(Conflict::NodeBound)
            } else if of_kind >= max_agents {
                Some(Conflict::AgentLimit)
            } else {
                None
            }
        }
    }
}

/// The SHA-256 of a token's secret, hex: its key in the store.
pub fn token_hash(secret: &str) -> String {
    crate::hex::encode(&Sha256::digest(secret.as_bytes()))
}

fn new_secret() -> Result<String, Refusal> {
    let mut bytes = [0u8; SECRET_BYTES];
    getrandom::fill(&mut bytes).map_err(|e| {
        tracing::error!(error = %e, "the system's random source failed; no token was made");
        Refusal::Internal
    })?;
    Ok(format!("{TOKEN_PREFIX}{}", crate::hex::encode(&bytes)))
}

impl Engine {
    /// `POST /v1/tokens`.
    pub async fn create_token(
        self: &Arc<Self>,
        new: NewToken,
        record: Record<Token>,
    ) -> Result<Token, Refusal> {
        let secret = new_secret()?;
        let hash = token_hash(&secret);
        let hub = self.hub.clone();
        let limits = (
            self.settings.max_workers as usize,
            self.settings.max_agents as usize,
        );
        self.store
            .write(move |tx| {
                let tokens = tx.tokens()?;
                if let Some(conflict) = token_refusal(&tokens, &new, limits) {
                    return Ok(Err(Refusal::Conflict(conflict)));
                }
                let change = Change::new(tx, &hub);
                let made = TokenRecord {
                    name: new.name.clone(),
                    kind: new.kind,
                    labels: new.labels.clone(),
                    created_at: change.now(),
                    seen: None,
                    node: new.node.clone(),
                };
                tx.put_token(&hash, &made)?;
                if let Some(binding) = &made.node {
                    super::nodes::bind_tx(tx, binding, &made.name, true)?;
                }
                let token = Token {
                    record: made,
                    secret: Some(secret.clone()),
                };
                record.store(&change, &token)?;
                Ok(Ok(token))
            })
            .await?
    }

    /// `DELETE /v1/tokens/{name}`: the token answers 401 from now on, and
    /// its worker's attempts are lost in this transaction.
    pub async fn revoke_token(
        self: &Arc<Self>,
        name: String,
        record: Record<Token>,
    ) -> Result<Token, Refusal> {
        let revoked = self.revoke_token_tx(name, record).await?;
        if let Some(binding) = &revoked.record.node {
            self.unbound(binding);
            // Every desired-state read wakes and checks its token again:
            // the revoked one's streams end at once.
            self.hub.documents.send_modify(|g| *g += 1);
        }
        Ok(revoked)
    }

    async fn revoke_token_tx(
        self: &Arc<Self>,
        name: String,
        record: Record<Token>,
    ) -> Result<Token, Refusal> {
        let hub = self.hub.clone();
        self.store
            .write(move |tx| {
                let Some((hash, gone)) = tx.tokens()?.into_iter().find(|(_, t)| t.name == name)
                else {
                    return Ok(Err(Refusal::NotFound(Missing::Token)));
                };
                tx.remove_token(&hash)?;
                Engine::lose_attempts_of(tx, &hub, &gone.name)?;
                if let Some(binding) = &gone.node {
                    super::nodes::bind_tx(tx, binding, &gone.name, false)?;
                }
                let token = Token {
                    record: gone,
                    secret: None,
                };
                record.store(&Change::new(tx, &hub), &token)?;
                Ok(Ok(token))
            })
            .await?
    }

    /// The token whose secret this is, with its hash.
    pub fn token_of(&self, secret: &str) -> StoreResult<Option<(String, TokenRecord)>> {
        let hash = token_hash(secret);
        Ok(self.store.read()?.token(&hash)?.map(|t| (hash, t)))
    }

    /// Records what a worker said about itself, at most every
    /// `authority::SEEN_EVERY_MS` (a write per call would be a write per
    /// poll).
    pub async fn saw_worker(
        self: &Arc<Self>,
        hash: String,
        known: &TokenRecord,
        incarnation: &str,
        labels: &[String],
    ) {
        let now = now_millis();
        let fresh = known.seen.as_ref().is_some_and(|s| {
            now - s.at < crate::authority::SEEN_EVERY_MS
                && s.incarnation == incarnation
                && s.labels == labels
        });
        if fresh {
            return;
        }
        let seen = WorkerSeen {
            at: now,
            incarnation: incarnation.to_string(),
            labels: labels.to_vec(),
        };
        let stored = self
            .store
            .write(move |tx| {
                if let Some(mut t) = tx.token(&hash)? {
                    t.seen = Some(seen.clone());
                    tx.put_token(&hash, &t)?;
                }
                Ok(())
            })
            .await;
        if let Err(e) = stored {
            tracing::warn!(error = %e, "cannot record when a worker was last seen");
        }
    }
}
