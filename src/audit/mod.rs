//! The audit chain (spec audit.md), as pure functions: what an event holds,
//! how it is sealed into the hash chain, how it is stored, and the one-pass
//! walk that `berth audit verify` runs over the stored chain. No I/O: the
//! store appends what `seal` makes, and hands `Walk` the stored rows.
//!
//! `hash = SHA-256("berth-audit-v1\n" || prev_hash || canonical(event
//! without hash))`, where `prev_hash` enters as its 64 lower-case hex
//! characters (as it appears in the event) and `canonical` is RFC 8785.
//! A stored row is the 32-byte hash followed by those canonical bytes, so
//! verifying an event is one SHA-256 over bytes already in hand.

pub mod merkle;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use merkle::{CompactRange, Hash};

/// The domain prefix of every event hash.
pub const DOMAIN: &[u8] = b"berth-audit-v1\n";
/// The first event's `prev_hash`.
pub const GENESIS: Hash = [0u8; 32];
/// Events the deployment read shows.
pub const DEPLOYMENT_READ_EVENTS: usize = 20;
/// Problems `verify` lists one by one; past it, it only counts them (a
/// wiped store must not print a gigabyte of JSON).
pub const MAX_LISTED_PROBLEMS: usize = 10_000;

/// Who acted. `issuer` is absent when the trusted backend named only a
/// subject.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Actor {
    // Fields in RFC 8785 order (see `canonical`).
    pub issuer: Option<String>,
    pub subject: String,
}

impl Actor {
    /// An agent token as the actor of its calls (agents.md "Errors, audit,
    /// events").
    pub fn agent(token: &str) -> Actor {
        Actor {
            issuer: Some("berth:agent".into()),
            subject: token.to_string(),
        }
    }

    /// The key of this actor's index entries.
    pub fn key(&self) -> String {
        format!(
            "{}\u{0}{}",
            self.subject,
            self.issuer.as_deref().unwrap_or("")
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AuditResult {
    Ok,
    Refused,
    Denied,
    Invalid,
}

impl AuditResult {
    pub fn as_str(self) -> &'static str {
        match self {
            AuditResult::Ok => "ok",
            AuditResult::Refused => "refused",
            AuditResult::Denied => "denied",
            AuditResult::Invalid => "invalid",
        }
    }
}

/// An event before it joins the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Draft {
    pub at: crate::model::Millis,
    pub actor: Option<Actor>,
    pub trusted_backend: bool,
    /// `submit`, `cancel`, `action:suspend`, ... (audit.md); never a value
    /// the request chose.
    pub action: &'static str,
    pub deployment: Option<String>,
    pub build: Option<String>,
    /// The node of an agent's call or a node activation (agents.md).
    pub node: Option<String>,
    pub request_id: String,
    pub result: AuditResult,
    /// An error code or rule name, never a value of the request.
    pub reason: Option<String>,
    pub count: u64,
}

/// An event as stored and served (audit.md "What is recorded").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Event {
    // Fields in RFC 8785 order (sorted by name): `canonical` relies on it.
    pub action: String,
    pub actor: Option<Actor>,
    pub at: String,
    pub build: Option<String>,
    pub count: u64,
    pub deployment: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    /// Present only when set: the events chained before the field existed
    /// keep their canonical form, and so their hashes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    pub prev_hash: String,
    pub reason: Option<String>,
    pub request_id: String,
    pub result: AuditResult,
    pub seq: u64,
    pub trusted_backend: bool,
}

/// `SHA-256(DOMAIN || prev_hash hex || canonical)`.
pub fn chain_hash(prev_hash_hex: &[u8], canonical: &[u8]) -> Hash {
    let mut h = Sha256::new();
    h.update(DOMAIN);
    h.update(prev_hash_hex);
    h.update(canonical);
    h.finalize().into()
}

/// A sealed event: its stored row and its hash.
pub struct Sealed {
    pub event: Event,
    pub hash: Hash,
    /// The stored row: `hash || canonical(event without hash)`.
    pub row: Vec<u8>,
}

/// Gives `draft` its place after (`seq - 1`, `prev`).
pub fn seal(draft: &Draft, seq: u64, prev: &Hash) -> Sealed {
    let mut event = Event {
        seq,
        at: crate::model::format_time(draft.at),
        actor: draft.actor.clone(),
        trusted_backend: draft.trusted_backend,
        action: draft.action.to_string(),
        deployment: draft.deployment.clone(),
        build: draft.build.clone(),
        node: draft.node.clone(),
        request_id: draft.request_id.clone(),
        result: draft.result,
        reason: draft.reason.clone(),
        count: draft.count,
        prev_hash: crate::hex::encode(prev),
        hash: None,
    };
    let canonical = canonical(&event);
    let hash = chain_hash(event.prev_hash.as_bytes(), &canonical);
    event.hash = Some(crate::hex::encode(&hash));
    let mut row = Vec::with_capacity(32 + canonical.len());
    row.extend_from_slice(&hash);
    row.extend_from_slice(&canonical);
    Sealed { event, hash, row }
}

/// RFC 8785 bytes of an event without its hash.
///
/// An event is strings, integers below 2^53, booleans and nulls, with its
/// fields declared in sorted order: for such a value serde_json's compact
/// output is the RFC 8785 form (same escapes, lower-case `\u00xx`), at a
/// fifth of `serde_jcs`'s cost on the append path. Tests check the two
/// agree on arbitrary strings; debug builds check every event.
fn canonical(event: &Event) -> Vec<u8> {
    debug_assert!(event.hash.is_none());
    let bytes = serde_json::to_vec(event).expect("an audit event is plain JSON");
    debug_assert_eq!(
        Some(&bytes),
        serde_jcs::to_vec(event).ok().as_ref(),
        "an audit event's fields are not in RFC 8785 order"
    );
    bytes
}

/// A stored row that is not `hash || JSON event`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRow;

/// Reads a stored row back into the event it holds (with its hash).
pub fn decode_row(row: &[u8]) -> Result<Event, BadRow> {
    let (hash, body) = split_row(row).ok_or(BadRow)?;
    let mut event: Event = serde_json::from_slice(body).map_err(|_| BadRow)?;
    event.hash = Some(crate::hex::encode(hash));
    Ok(event)
}

fn split_row(row: &[u8]) -> Option<(&[u8; 32], &[u8])> {
    let (hash, body) = row.split_at_checked(32)?;
    Some((hash.try_into().ok()?, body))
}

/// What retention keeps of the removed prefix (audit.md "The chain").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Anchor {
    /// The seq of the first kept event.
    pub first_seq: u64,
    /// The hash of the last removed event (genesis when none was).
    pub prev_hash: String,
    pub removed_count: u64,
    /// The time of the last removed event.
    pub removed_until: Option<String>,
    /// The compact range of the removed prefix in the Merkle tree.
    #[serde(default)]
    pub compact_range: Vec<String>,
}

impl Anchor {
    pub fn genesis() -> Anchor {
        Anchor {
            first_seq: 1,
            prev_hash: crate::hex::encode(&GENESIS),
            removed_count: 0,
            removed_until: None,
            compact_range: vec![],
        }
    }
}

/// The last head a sink accepted (`berth audit push-head`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushedHead {
    pub size: u64,
    pub root: String,
    pub at: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProblemKind {
    Changed,
    Removed,
    AnchorMismatch,
    Rollback,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    pub seq: u64,
    pub kind: ProblemKind,
}

#[derive(Debug, Clone, Serialize)]
pub struct Head {
    pub seq: u64,
    pub hash: String,
}

/// The object `verify --json` prints (audit.md "Verify").
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub ok: bool,
    pub size: u64,
    pub head: Option<Head>,
    pub anchor: AnchorView,
    pub merkle_root: String,
    pub problems: Vec<Problem>,
    /// Problems found past `MAX_LISTED_PROBLEMS` (0 when all are listed).
    pub problems_not_listed: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct AnchorView {
    pub first_seq: u64,
    pub prev_hash: String,
    pub removed_count: u64,
    pub removed_until: Option<String>,
}

/// One pass over the stored chain, in seq order: feed every row, then
/// `finish`. Reports every problem, one per seq at most.
pub struct Walk {
    anchor: Anchor,
    pushed: Option<PushedHead>,
    /// The seq the next row should have.
    next_seq: u64,
    /// The stored hash of the previous row (the anchor's before the first).
    prev: Hash,
    /// The previous row was itself reported `changed`: a broken link to it
    /// is that problem, not another.
    prev_changed: bool,
    first: bool,
    compact: CompactRange,
    /// The last row's seq and stored hash.
    head: Option<(u64, Hash)>,
    problems: Vec<Problem>,
    not_listed: u64,
    pushed_checked: bool,
    /// A problem was found before the pushed size: the recomputed tree
    /// differs from the pushed one because of it, and that problem (not a
    /// rollback) is what is reported.
    gap: bool,
}

/// Fast field lookups in a canonical row: a key's quote cannot occur
/// unescaped inside a string value, so these patterns match only keys.
struct Patterns {
    prev_hash: memchr::memmem::Finder<'static>,
    seq: memchr::memmem::FinderRev<'static>,
}

fn patterns() -> &'static Patterns {
    static P: std::sync::OnceLock<Patterns> = std::sync::OnceLock::new();
    P.get_or_init(|| Patterns {
        prev_hash: memchr::memmem::Finder::new(b"\"prev_hash\":\""),
        seq: memchr::memmem::FinderRev::new(b"\"seq\":"),
    })
}

/// The `prev_hash` hex and `seq` a canonical body claims.
fn claimed(body: &[u8]) -> Option<(&[u8], u64)> {
    let p = patterns();
    let at = p.prev_hash.find(body)? + 13;
    let prev = body.get(at..at + 64)?;
    let s = p.seq.rfind(body)? + 6;
    let digits = body[s..].iter().take_while(|c| c.is_ascii_digit()).count();
    let seq = std::str::from_utf8(&body[s..s + digits])
        .ok()?
        .parse()
        .ok()?;
    Some((prev, seq))
}

/// An anchor whose fields do not fit together (its compact range).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadAnchor;

impl Walk {
    pub fn new(anchor: Anchor, pushed: Option<PushedHead>) -> Walk {
        let prev = decode_hash(&anchor.prev_hash).unwrap_or([0xff; 32]);
        let hashes: Option<Vec<Hash>> = anchor
            .compact_range
            .iter()
            .map(|h| decode_hash(h))
            .collect();
        let removed = anchor.first_seq.saturating_sub(1);
        let (compact, anchor_ok) = match hashes.map(|h| CompactRange::from_parts(removed, h)) {
            Some(Ok(c)) => (
                c,
                anchor.removed_count == removed && decode_hash(&anchor.prev_hash).is_some(),
            ),
            _ => (CompactRange::new(), false),
        };
        let mut walk = Walk {
            next_seq: anchor.first_seq.max(1),
            anchor,
            pushed,
            prev,
            prev_changed: false,
            first: true,
            compact,
            head: None,
            problems: Vec::new(),
            not_listed: 0,
            pushed_checked: false,
            gap: false,
        };
        if !anchor_ok {
            let seq = walk.next_seq;
            walk.report(seq, ProblemKind::AnchorMismatch);
        }
        walk.check_pushed();
        walk
    }

    fn report(&mut self, seq: u64, kind: ProblemKind) {
        if kind != ProblemKind::Rollback {
            self.gap = true;
        }
        if self.problems.len() < MAX_LISTED_PROBLEMS {
            self.problems.push(Problem { seq, kind });
        } else {
            self.not_listed += 1;
        }
    }

    /// Checks the pushed head once the walk reaches its size.
    fn check_pushed(&mut self) {
        let Some(pushed) = &self.pushed else { return };
        if self.pushed_checked || self.compact.size() < pushed.size {
            return;
        }
        self.pushed_checked = true;
        // A head inside the pruned prefix cannot be recomputed: the anchor
        // vouches for it.
        if self.compact.size() == pushed.size
            && !self.gap
            && crate::hex::encode(&self.compact.root()) != pushed.root
        {
            let seq = pushed.size;
            self.report(seq, ProblemKind::Rollback);
        }
    }

    /// The row stored under `seq`.
    pub fn feed(&mut self, seq: u64, row: &[u8]) {
        let first = std::mem::replace(&mut self.first, false);
        let mut gap_reported = false;
        if seq > self.next_seq {
            if first {
                self.report(seq, ProblemKind::AnchorMismatch);
            } else {
                for missing in self.next_seq..seq {
                    self.report(missing, ProblemKind::Removed);
                }
            }
            gap_reported = true;
            self.gap = true;
        }
        let parsed = split_row(row).and_then(|(hash, body)| Some((*hash, body, claimed(body)?)));
        let (stored_hash, changed, linked) = match parsed {
            Some((hash, body, (prev_hex, claimed_seq))) => {
                let content_ok = chain_hash(prev_hex, body) == hash && claimed_seq == seq;
                let linked = prev_hex == hex_of(&self.prev);
                (hash, !content_ok, linked)
            }
            None => ([0u8; 32], true, false),
        };
        if changed {
            self.report(seq, ProblemKind::Changed);
        } else if !linked && !self.prev_changed && !gap_reported {
            let kind = if first {
                ProblemKind::AnchorMismatch
            } else {
                ProblemKind::Removed
            };
            self.report(seq, kind);
        }
        self.prev_changed = changed;
        self.prev = stored_hash;
        // The tree fills its leaves by position: a missing seq leaves a
        // hole that shifts every later leaf, so the root will differ.
        self.compact.push(merkle::leaf_hash(&stored_hash));
        self.next_seq = seq + 1;
        self.head = Some((seq, stored_hash));
        if self.pushed.is_some() {
            self.check_pushed();
        }
    }

    pub fn finish(mut self) -> Report {
        self.check_pushed();
        if self.pushed.is_some() && !self.pushed_checked {
            // The chain ends before the head a sink accepted.
            let seq = self.next_seq;
            self.report(seq, ProblemKind::Rollback);
        }
        let listed = self.problems.len() as u64;
        Report {
            ok: listed + self.not_listed == 0,
            size: self.compact.size(),
            head: self.head.map(|(seq, hash)| Head {
                seq,
                hash: crate::hex::encode(&hash),
            }),
            anchor: AnchorView {
                first_seq: self.anchor.first_seq,
                prev_hash: self.anchor.prev_hash.clone(),
                removed_count: self.anchor.removed_count,
                removed_until: self.anchor.removed_until.clone(),
            },
            merkle_root: crate::hex::encode(&self.compact.root()),
            problems: self.problems,
            problems_not_listed: self.not_listed,
        }
    }
}

/// Lower-case hex of a hash, without allocating (verify does this per row).
fn hex_of(hash: &Hash) -> [u8; 64] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 64];
    for (i, b) in hash.iter().enumerate() {
        out[2 * i] = DIGITS[(b >> 4) as usize];
        out[2 * i + 1] = DIGITS[(b & 0xf) as usize];
    }
    out
}

pub fn decode_hash(text: &str) -> Option<Hash> {
    decode_hash_bytes(text.as_bytes())
}

fn decode_hash_bytes(text: &[u8]) -> Option<Hash> {
    let text = std::str::from_utf8(text).ok()?;
    crate::hex::decode(text)?.try_into().ok()
}

#[cfg(test)]
mod tests;
