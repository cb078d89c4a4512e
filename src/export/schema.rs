//! The relational schema of an export (docs/export-schema.md), and the
//! mapping between a store row and a relational row. Pure: no I/O, the same
//! for PostgreSQL and SQLite, tested directly.
//!
//! Each carried store table becomes one relational table whose columns are
//! there to be read by people (times as times, JSON as JSON, logs as text,
//! build ids as UUIDs). Where a store record has more fields than are worth
//! a column, its `record` column holds all of it as JSON, and that is what
//! an import reads back: the readable columns are a view, never the source.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::model::{BuildId, BuildSnapshots, DeploymentRecord, Millis, NodeSbom, SbomStatus};
use crate::store::dump::Row;
use crate::store::tables::Table;
use crate::store::{
    IdempotencyIdentity, IdempotencyRecord, PendingCallback, Principal, StoredEvent,
};

/// The version of this relational layout, in `berth_meta`. A target holding
/// a newer one is refused; bump it when a table or column changes meaning.
pub const EXPORT_SCHEMA_VERSION: u32 = 8;

/// The first export layout with the webhook tables (an older export has
/// none, and imports without subscriptions).
pub const FIRST_EXPORT_WITH_WEBHOOKS: u32 = 3;

/// The first export layout with worker tokens and build attempts (an
/// older export has none).
pub const FIRST_EXPORT_WITH_WORKERS: u32 = 4;

/// The first export layout with deployments' work states (an older export
/// has none).
pub const FIRST_EXPORT_WITH_WORK_STATES: u32 = 5;

/// The first export layout with rollouts and rollout policies.
pub const FIRST_EXPORT_WITH_ROLLOUTS: u32 = 6;

/// The first export layout with rollout builds' deploy results.
pub const FIRST_EXPORT_WITH_ROLLOUT_RESULTS: u32 = 7;

/// The first export layout with nodes bound to agents.
pub const FIRST_EXPORT_WITH_NODES: u32 = 8;

/// The export layouts this berth reads: version 1 split an idempotency
/// key's identity wrongly (its `subject` held U+0000 for callback and
/// backend callers), so its idempotency rows (which expire within 24 h
/// anyway) are not imported; everything else is.
pub const OLDEST_READ_EXPORT_VERSION: u32 = 1;

/// The table of facts about the export itself (schema version, when, from
/// which berth). It also marks a database or file as a berth export.
pub const META_TABLE: &str = "berth_meta";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    Text,
    /// JSON text. PostgreSQL: a `jsonb` column for queries plus
    /// `<name>_text`, the exact text (what an import reads: `jsonb` reorders
    /// keys and refuses `\u0000`). SQLite: one TEXT column, exact.
    Json,
    Bytes,
    Int,
    Bool,
    /// Milliseconds since the epoch; `timestamptz` / ISO-8601 text.
    Time,
    /// A build id; `uuid` / its text.
    Uuid,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Text(String),
    Json(String),
    Bytes(Vec<u8>),
    Int(i64),
    Bool(bool),
    Time(Millis),
    Uuid(BuildId),
}

impl Value {
    /// Bytes this value carries (for progress).
    pub fn size(&self) -> usize {
        match self {
            Value::Text(s) | Value::Json(s) => s.len(),
            Value::Bytes(b) => b.len(),
            Value::Null | Value::Bool(_) => 1,
            _ => 8,
        }
    }
}

pub struct Column {
    pub name: &'static str,
    pub ty: Ty,
    pub nullable: bool,
}

pub struct RelTable {
    pub name: &'static str,
    /// The carried store table it holds.
    pub store_table: Table,
    pub columns: &'static [Column],
    pub primary_key: &'static [&'static str],
    /// (column, table it references by its `build_id`).
    pub references: &'static [(&'static str, &'static str)],
}

const fn col(name: &'static str, ty: Ty) -> Column {
    Column {
        name,
        ty,
        nullable: false,
    }
}

const fn opt(name: &'static str, ty: Ty) -> Column {
    Column {
        name,
        ty,
        nullable: true,
    }
}

use Ty::*;

/// Every relational table, parents first (the order of writing).
pub const TABLES: &[RelTable] = &[
    RelTable {
        name: "store_meta",
        store_table: Table::Meta,
        columns: &[col("key", Text), col("value", Bytes)],
        primary_key: &["key"],
        references: &[],
    },
    RelTable {
        name: "sources",
        store_table: Table::Sources,
        columns: &[col("digest", Text), col("url", Text), col("rev", Text)],
        primary_key: &["digest"],
        references: &[],
    },
    RelTable {
        name: "describe_cache",
        store_table: Table::DescribeCache,
        columns: &[col("digest", Text), col("describe", Json)],
        primary_key: &["digest"],
        references: &[],
    },
    RelTable {
        name: "deployments",
        store_table: Table::Deployments,
        columns: &[
            col("id", Text),
            col("state", Text),
            col("revision", Int),
            col("suspended", Bool),
            opt("domain", Text),
            col("method", Text),
            col("configuration", Json),
            col("source_url", Text),
            col("source_rev", Text),
            col("update_policy", Json),
            opt("last_build_id", Uuid),
            col("created_at", Time),
            col("updated_at", Time),
            col("record", Json),
        ],
        primary_key: &["id"],
        references: &[],
    },
    RelTable {
        name: "builds",
        store_table: Table::Builds,
        columns: &[
            col("build_id", Uuid),
            col("deployment_id", Text),
            col("kind", Text),
            col("status", Text),
            col("trigger", Text),
            col("created_at", Time),
            opt("started_at", Time),
            opt("finished_at", Time),
            opt("exit_code", Int),
            opt("failure_reason", Text),
            col("log_lines", Int),
            col("log_bytes", Int),
            col("record", Json),
        ],
        primary_key: &["build_id"],
        references: &[],
    },
    RelTable {
        name: "build_snapshots",
        store_table: Table::BuildSnapshots,
        columns: &[
            col("build_id", Uuid),
            col("configuration", Json),
            col("source_digest", Text),
            col("record", Json),
        ],
        primary_key: &["build_id"],
        references: &[("build_id", "builds")],
    },
    RelTable {
        name: "log_chunks",
        store_table: Table::LogChunks,
        columns: &[
            col("build_id", Uuid),
            col("chunk", Int),
            col("first_line", Int),
            // NULL only for a chunk holding a NUL byte (PostgreSQL text
            // cannot), whose bytes are then in `raw`.
            opt("text", Text),
            opt("raw", Bytes),
        ],
        primary_key: &["build_id", "chunk"],
        references: &[("build_id", "builds")],
    },
    RelTable {
        name: "build_events",
        store_table: Table::BuildEvents,
        columns: &[
            col("build_id", Uuid),
            col("seq", Int),
            col("event", Text),
            col("data", Json),
            col("at", Time),
        ],
        primary_key: &["build_id", "seq"],
        references: &[("build_id", "builds")],
    },
    RelTable {
        name: "deployment_events",
        // Its events only: the other parts are indexes.
        store_table: Table::DeploymentRows,
        columns: &[
            col("deployment_id", Text),
            col("seq", Int),
            col("event", Text),
            col("data", Json),
            col("at", Time),
        ],
        primary_key: &["deployment_id", "seq"],
        references: &[],
    },
    RelTable {
        name: "callbacks",
        store_table: Table::Callbacks,
        columns: &[
            col("build_id", Uuid),
            col("deployment_id", Text),
            col("url", Text),
            col("armed", Bool),
            col("attempts", Int),
            col("next_at", Time),
            col("first_at", Time),
        ],
        primary_key: &["build_id"],
        references: &[("build_id", "builds")],
    },
    RelTable {
        name: "idempotency",
        store_table: Table::Idempotency,
        columns: &[
            // `actor_subject`/`actor_issuer` are '' when the principal has
            // none (a primary key's columns are never NULL).
            col("principal", Text),
            col("actor_subject", Text),
            col("actor_issuer", Text),
            col("route", Text),
            col("idempotency_key", Text),
            col("status", Int),
            col("content_type", Text),
            col("body", Bytes),
            col("headers", Json),
            col("fingerprint", Bytes),
            col("expires_at", Time),
        ],
        primary_key: &[
            "principal",
            "actor_subject",
            "actor_issuer",
            "route",
            "idempotency_key",
        ],
        references: &[],
    },
    RelTable {
        name: "update_tries",
        store_table: Table::UpdateTries,
        columns: &[
            col("deployment_id", Text),
            col("at", Time),
            col("result", Text),
            col("record", Json),
        ],
        primary_key: &["deployment_id"],
        references: &[],
    },
    RelTable {
        name: "sbom_components",
        store_table: Table::SbomComponents,
        columns: &[col("hash", Text), col("refs", Int), col("component", Json)],
        primary_key: &["hash"],
        references: &[],
    },
    RelTable {
        name: "sbom_nodes",
        store_table: Table::SbomNodes,
        columns: &[
            col("deployment_id", Text),
            col("node", Text),
            col("status", Text),
            opt("build_id", Uuid),
            col("at", Time),
            opt("reason", Text),
            opt("skeleton", Json),
            col("had_components", Bool),
            // The component hashes in document order (a JSON array of hex).
            col("components", Json),
        ],
        primary_key: &["deployment_id", "node"],
        references: &[],
    },
    RelTable {
        name: "audit_events",
        store_table: Table::AuditEvents,
        columns: &[
            col("seq", Int),
            col("hash", Text),
            col("at", Time),
            col("action", Text),
            col("result", Text),
            opt("deployment_id", Text),
            opt("actor_subject", Text),
            // The event's RFC 8785 text, exactly as chained.
            col("event", Json),
        ],
        primary_key: &["seq"],
        references: &[],
    },
    RelTable {
        name: "merkle_nodes",
        store_table: Table::MerkleNodes,
        columns: &[col("level", Int), col("position", Int), col("hash", Text)],
        primary_key: &["level", "position"],
        references: &[],
    },
    RelTable {
        name: "webhooks",
        store_table: Table::Webhooks,
        columns: &[
            col("webhook_id", Uuid),
            col("url", Text),
            col("created_at", Time),
            // The record holds the signing secret: an export is as
            // private as the store (0600, storage.md).
            col("record", Json),
        ],
        primary_key: &["webhook_id"],
        references: &[],
    },
    RelTable {
        name: "webhook_deliveries",
        store_table: Table::WebhookDeliveries,
        columns: &[
            col("webhook_id", Uuid),
            col("delivery_id", Uuid),
            col("event_type", Text),
            col("status", Text),
            col("record", Json),
        ],
        primary_key: &["webhook_id", "delivery_id"],
        // (A reference names a `build_id` column; a delivery's parent is
        // its subscription, which the import writes first.)
        references: &[],
    },
    RelTable {
        name: "worker_tokens",
        store_table: Table::Tokens,
        columns: &[
            // The SHA-256 of the secret: the secret itself is never stored.
            col("token_hash", Text),
            col("name", Text),
            col("kind", Text),
            col("created_at", Time),
            col("record", Json),
        ],
        primary_key: &["token_hash"],
        references: &[],
    },
    RelTable {
        name: "build_attempts",
        store_table: Table::Attempts,
        columns: &[
            col("build_id", Uuid),
            col("fence", Int),
            col("worker", Text),
            col("state", Text),
            col("claimed_at", Time),
            col("record", Json),
        ],
        primary_key: &["build_id", "fence"],
        references: &[("build_id", "builds")],
    },
    RelTable {
        name: "work_state_blobs",
        store_table: Table::WorkStateBlobs,
        columns: &[
            col("digest", Text),
            col("size", Int),
            col("refs", Int),
            col("record", Json),
        ],
        primary_key: &["digest"],
        references: &[],
    },
    RelTable {
        // An archive's zstd stream in pieces: concatenated in `piece`
        // order they decompress to the tar whose SHA-256 is `digest`.
        name: "work_state_pieces",
        store_table: Table::WorkStatePieces,
        columns: &[col("digest", Text), col("piece", Int), col("data", Bytes)],
        primary_key: &["digest", "piece"],
        references: &[],
    },
    RelTable {
        name: "work_states",
        store_table: Table::WorkStates,
        columns: &[
            col("deployment_id", Text),
            opt("current_digest", Text),
            col("record", Json),
        ],
        primary_key: &["deployment_id"],
        references: &[],
    },
    RelTable {
        name: "build_rollouts",
        store_table: Table::Rollouts,
        columns: &[
            col("build_id", Uuid),
            col("deployment_id", Text),
            col("state", Text),
            col("record", Json),
        ],
        primary_key: &["build_id"],
        references: &[("build_id", "builds")],
    },
    RelTable {
        name: "rollout_policies",
        store_table: Table::RolloutPolicies,
        columns: &[col("deployment_id", Text), col("policy", Json)],
        primary_key: &["deployment_id"],
        references: &[],
    },
    RelTable {
        name: "freezes",
        store_table: Table::Freezes,
        columns: &[
            col("scope_key", Text),
            col("reason", Text),
            col("record", Json),
        ],
        primary_key: &["scope_key"],
        references: &[],
    },
    RelTable {
        name: "rollout_results",
        store_table: Table::RolloutResults,
        columns: &[col("build_id", Uuid), col("result", Bytes)],
        primary_key: &["build_id"],
        references: &[("build_id", "builds")],
    },
    RelTable {
        name: "nodes",
        store_table: Table::Nodes,
        columns: &[
            col("deployment_id", Text),
            col("node", Text),
            col("generation", Int),
            col("fence", Int),
            col("record", Json),
        ],
        primary_key: &["deployment_id", "node"],
        references: &[],
    },
];

/// The relational table holding a carried store table.
pub fn table_for(store_table: Table) -> Option<&'static RelTable> {
    TABLES.iter().find(|t| t.store_table == store_table)
}

fn int(n: u64, what: &str) -> Result<Value, String> {
    i64::try_from(n)
        .map(Value::Int)
        .map_err(|_| format!("{what} is too large to export"))
}

fn json<T: Serialize>(value: &T) -> Result<Value, String> {
    serde_json::to_string(value)
        .map(Value::Json)
        .map_err(|e| format!("a record does not encode as JSON: {e}"))
}

fn text_or_null(s: &Option<String>) -> Value {
    s.clone().map(Value::Text).unwrap_or(Value::Null)
}

fn time_or_null(t: Option<Millis>) -> Value {
    t.map(Value::Time).unwrap_or(Value::Null)
}

fn hex(bytes: &[u8]) -> String {
    crate::hex::encode(bytes)
}

/// A store row as the values of its relational row, in column order.
///
/// One arm per kind of row: the match is exhaustive on purpose (a
/// new table does not compile until it is decided here), so its length
/// is the number of tables, not logic to follow.
pub fn to_values(row: &Row) -> Result<Vec<Value>, String> {
    use Value as V;
    Ok(match row {
        Row::Meta { key, value } => vec![V::Text(key.clone()), V::Bytes(value.clone())],
        Row::Source(s) => vec![
            V::Text(s.digest.clone()),
            V::Text(s.url.clone()),
            V::Text(s.rev.clone()),
        ],
        Row::Describe { digest, json } => vec![V::Text(digest.clone()), V::Json(json.clone())],
        Row::Deployment(d) => deployment_values(d)?,
        Row::Build(b) => vec![
            V::Uuid(b.id),
            V::Text(b.deployment.clone()),
            V::Text(serde_plain(&b.kind)?),
            V::Text(b.status.as_str().to_string()),
            V::Text(b.trigger.label()),
            V::Time(b.created_at),
            time_or_null(b.started_at),
            time_or_null(b.finished_at),
            b.exit_code.map(|c| V::Int(c.into())).unwrap_or(V::Null),
            b.failure
                .as_ref()
                .map(|f| V::Text(f.reason.to_string()))
                .unwrap_or(V::Null),
            int(b.log_lines, "a log's line count")?,
            int(b.log_bytes, "a log's size")?,
            json(b)?,
        ],
        Row::Snapshots { build, snapshots } => vec![
            V::Uuid(*build),
            V::Json(snapshots.snapshot.configuration.clone()),
            V::Text(snapshots.snapshot.source.digest.clone()),
            json(snapshots)?,
        ],
        Row::LogChunk {
            build,
            number,
            first_line,
            text,
        } => {
            let (as_text, raw) = match std::str::from_utf8(text) {
                Ok(t) if !t.contains('\0') => (V::Text(t.to_string()), V::Null),
                _ => (V::Null, V::Bytes(text.clone())),
            };
            vec![
                V::Uuid(*build),
                V::Int((*number).into()),
                int(*first_line, "a log line index")?,
                as_text,
                raw,
            ]
        }
        Row::BuildEvent { build, seq, event } => vec![
            V::Uuid(*build),
            int(*seq, "an event seq")?,
            V::Text(event.event.clone()),
            V::Json(event.data.clone()),
            V::Time(event.at),
        ],
        Row::DeploymentEvent {
            deployment,
            seq,
            event,
        } => vec![
            V::Text(deployment.clone()),
            int(*seq, "an event seq")?,
            V::Text(event.event.clone()),
            V::Json(event.data.clone()),
            V::Time(event.at),
        ],
        Row::Callback { build, callback: c } => vec![
            V::Uuid(*build),
            V::Text(c.deployment.clone()),
            V::Text(c.url.clone()),
            V::Bool(c.armed),
            V::Int(c.attempts.into()),
            V::Time(c.next_at),
            V::Time(c.first_at),
        ],
        Row::Idempotency {
            identity,
            record: r,
        } => {
            if *identity != r.identity.store_key() {
                return Err("an idempotency record's key is not its identity".into());
            }
            let who = &r.identity;
            vec![
                V::Text(who.principal.as_str().to_string()),
                V::Text(who.subject.clone().unwrap_or_default()),
                V::Text(who.issuer.clone().unwrap_or_default()),
                V::Text(who.route.clone()),
                V::Text(who.key.clone()),
                V::Int(r.status.into()),
                V::Text(r.content_type.clone()),
                V::Bytes(r.body.clone()),
                json(&r.headers)?,
                V::Bytes(r.fingerprint.clone()),
                V::Time(r.expires_at),
            ]
        }
        Row::UpdateTry { deployment, record } => vec![
            V::Text(deployment.clone()),
            V::Time(record.at),
            V::Text(serde_plain(&record.result)?),
            json(record)?,
        ],
        Row::Webhook { id, record } => vec![
            V::Uuid(*id),
            V::Text(record.url.clone()),
            V::Time(record.created_at),
            json(record)?,
        ],
        Row::Delivery {
            webhook,
            id,
            record,
        } => vec![
            V::Uuid(*webhook),
            V::Uuid(*id),
            V::Text(record.event_type.clone()),
            V::Text(serde_plain(&record.status)?),
            json(record)?,
        ],
        Row::Token { hash, record } => vec![
            V::Text(hash.clone()),
            V::Text(record.name.clone()),
            V::Text(record.kind.as_str().to_string()),
            V::Time(record.created_at),
            json(record)?,
        ],
        Row::Attempt(a) => vec![
            V::Uuid(a.build),
            int(a.fence, "a fence")?,
            V::Text(a.worker.clone()),
            V::Text(a.state.as_str().to_string()),
            V::Time(a.claimed_at),
            json(a)?,
        ],
        Row::WorkStates { deployment, record } => vec![
            V::Text(deployment.clone()),
            text_or_null(&record.current.as_ref().map(|c| c.digest.clone())),
            json(record)?,
        ],
        Row::WorkStateBlob { digest, record } => vec![
            V::Text(digest.clone()),
            int(record.size, "a work state's size")?,
            V::Int(record.refs.into()),
            json(record)?,
        ],
        Row::Freeze { key, record } => vec![
            V::Text(key.clone()),
            V::Text(record.reason.clone()),
            json(record)?,
        ],
        Row::Node(n) => vec![
            V::Text(n.deployment.clone()),
            V::Text(n.node.clone()),
            int(n.generation, "a node's generation")?,
            int(n.fence, "a node's fence")?,
            json(n)?,
        ],
        Row::Rollout(r) => vec![
            V::Uuid(r.build),
            V::Text(r.deployment.clone()),
            V::Text(serde_plain(&r.rollout.state)?),
            json(r)?,
        ],
        Row::RolloutResult { build, bytes } => vec![V::Uuid(*build), V::Bytes(bytes.clone())],
        Row::RolloutPolicy { deployment, text } => {
            vec![V::Text(deployment.clone()), V::Json(text.clone())]
        }
        Row::WorkStatePiece { digest, n, bytes } => vec![
            V::Text(digest.clone()),
            int(*n, "a piece number")?,
            V::Bytes(bytes.clone()),
        ],
        Row::Component { hash, refs, text } => vec![
            V::Text(hex(hash)),
            V::Int((*refs).into()),
            V::Json(utf8(text, "a component")?),
        ],
        Row::SbomNode {
            deployment,
            node,
            sbom,
        } => {
            let hashes: Vec<String> = sbom.hashes.iter().map(|h| hex(h)).collect();
            vec![
                V::Text(deployment.clone()),
                V::Text(node.clone()),
                V::Text(serde_plain(&sbom.status)?),
                sbom.build_id.map(V::Uuid).unwrap_or(V::Null),
                V::Time(sbom.at),
                text_or_null(&sbom.reason),
                if sbom.skeleton.is_empty() {
                    V::Null
                } else {
                    V::Json(utf8(&sbom.skeleton, "an SBOM skeleton")?)
                },
                V::Bool(sbom.had_components),
                json(&hashes)?,
            ]
        }
        Row::Audit {
            seq,
            hash,
            canonical,
        } => {
            let text = utf8(canonical, "an audit event")?;
            let event: crate::audit::Event = serde_json::from_str(&text)
                .map_err(|_| "an audit row does not hold an event".to_string())?;
            let at = crate::model::parse_time(&event.at)
                .ok_or("an audit event's time is not RFC 3339")?;
            vec![
                int(*seq, "an audit seq")?,
                V::Text(hex(hash)),
                V::Time(at),
                V::Text(event.action.clone()),
                V::Text(event.result.as_str().to_string()),
                text_or_null(&event.deployment),
                event
                    .actor
                    .as_ref()
                    .map(|a| V::Text(a.subject.clone()))
                    .unwrap_or(V::Null),
                V::Json(text),
            ]
        }
        Row::MerkleNode { level, index, hash } => vec![
            V::Int((*level).into()),
            int(*index, "a Merkle node index")?,
            V::Text(hex(hash)),
        ],
    })
}

fn deployment_values(d: &DeploymentRecord) -> Result<Vec<Value>, String> {
    use Value as V;
    Ok(vec![
        V::Text(d.id.clone()),
        V::Text(serde_plain(&d.state())?),
        int(d.revision, "a revision")?,
        V::Bool(d.suspended),
        text_or_null(&d.domain),
        V::Text(d.method.clone()),
        V::Json(d.snapshot.configuration.clone()),
        V::Text(d.snapshot.source.url.clone()),
        V::Text(d.snapshot.source.rev.clone()),
        json(&d.update_policy)?,
        d.last_build.map(V::Uuid).unwrap_or(V::Null),
        V::Time(d.created_at),
        V::Time(d.updated_at),
        json(d)?,
    ])
}

/// A unit enum's serde name ("succeeded", "deploy").
fn serde_plain<T: Serialize>(value: &T) -> Result<String, String> {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(s)) => Ok(s),
        _ => Err("a state does not encode as a name".into()),
    }
}

fn utf8(bytes: &[u8], what: &str) -> Result<String, String> {
    String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
}

/// Reads a relational row (values in column order) back into a store row,
/// and refuses it unless every readable column says what its canonical
/// column (`record`, `*_text`) says (storage.md): an export edited by
/// hand is never half believed.
pub fn from_values(table: &RelTable, values: Vec<Value>) -> Result<Row, String> {
    let given = values.clone();
    let row = row_of(table, values)?;
    let canonical = to_values(&row)?;
    if let Some(at) = (0..given.len()).find(|&i| given.get(i) != canonical.get(i)) {
        let key: Vec<String> = table
            .primary_key
            .iter()
            .filter_map(|k| table.columns.iter().position(|c| c.name == *k))
            .map(|i| match &canonical[i] {
                // A key part is a value of the file: shown cut, never whole.
                Value::Text(t) => t.chars().take(MAX_KEY_CHARS_SHOWN).collect(),
                Value::Int(n) => n.to_string(),
                Value::Uuid(u) => crate::model::format_build_id(*u),
                Value::Null
                | Value::Json(_)
                | Value::Bytes(_)
                | Value::Bool(_)
                | Value::Time(_) => "?".to_string(),
            })
            .collect();
        return Err(format!(
            "table {}: the row with key ({}) disagrees with its canonical record in column {}; an export edited by hand is refused",
            table.name,
            key.join(", "),
            table.columns[at].name
        ));
    }
    Ok(row)
}

/// Characters of one key part an import's refusal shows at most.
const MAX_KEY_CHARS_SHOWN: usize = 64;

/// A relational row read from its canonical columns.
///
/// One arm per carried table: the match is exhaustive on purpose (a
/// new table does not compile until it is decided here), so its length
/// is the number of tables, not logic to follow.
fn row_of(table: &RelTable, values: Vec<Value>) -> Result<Row, String> {
    if values.len() != table.columns.len() {
        return Err(format!(
            "table {}: {} values for {} columns",
            table.name,
            values.len(),
            table.columns.len()
        ));
    }
    let mut cells = Cells {
        table: table.name,
        columns: table.columns,
        values: values.into_iter().map(Some).collect(),
    };
    let c = &mut cells;
    Ok(match table.store_table {
        Table::Meta => Row::Meta {
            key: c.text("key")?,
            value: c.bytes("value")?,
        },
        Table::Sources => Row::Source(crate::model::Source {
            digest: c.text("digest")?,
            url: c.text("url")?,
            rev: c.text("rev")?,
        }),
        Table::DescribeCache => Row::Describe {
            digest: c.text("digest")?,
            json: c.json_text("describe")?,
        },
        Table::Deployments => {
            let d: DeploymentRecord = c.record()?;
            valid_id(&d.id, table)?;
            Row::Deployment(Box::new(d))
        }
        Table::Builds => {
            let b: crate::model::BuildRecord = c.record()?;
            valid_id(&b.deployment, table)?;
            Row::Build(Box::new(b))
        }
        Table::BuildSnapshots => Row::Snapshots {
            build: c.uuid("build_id")?,
            snapshots: Box::new(c.record::<BuildSnapshots>()?),
        },
        Table::LogChunks => {
            let build = c.uuid("build_id")?;
            let number = u32::try_from(c.int("chunk")?).map_err(|_| c.bad("chunk"))?;
            let first_line = c.u64("first_line")?;
            let text = match (c.take("text")?, c.take("raw")?) {
                (Value::Text(t), Value::Null) => t.into_bytes(),
                (Value::Null, Value::Bytes(b)) => b,
                _ => return Err(c.bad("text")),
            };
            Row::LogChunk {
                build,
                number,
                first_line,
                text,
            }
        }
        Table::BuildEvents => Row::BuildEvent {
            build: c.uuid("build_id")?,
            seq: c.u64("seq")?,
            event: StoredEvent {
                event: c.text("event")?,
                data: c.json_text("data")?,
                at: c.time("at")?,
            },
        },
        Table::DeploymentRows => Row::DeploymentEvent {
            deployment: c.text("deployment_id")?,
            seq: c.u64("seq")?,
            event: StoredEvent {
                event: c.text("event")?,
                data: c.json_text("data")?,
                at: c.time("at")?,
            },
        },
        Table::Callbacks => Row::Callback {
            build: c.uuid("build_id")?,
            callback: PendingCallback {
                deployment: c.text("deployment_id")?,
                url: c.text("url")?,
                armed: c.bool("armed")?,
                attempts: u32::try_from(c.int("attempts")?).map_err(|_| c.bad("attempts"))?,
                next_at: c.time("next_at")?,
                first_at: c.time("first_at")?,
            },
        },
        Table::Idempotency => {
            let principal = c.text("principal")?;
            let identity = IdempotencyIdentity {
                principal: Principal::named(&principal).ok_or_else(|| c.bad("principal"))?,
                subject: Some(c.text("actor_subject")?).filter(|s| !s.is_empty()),
                issuer: Some(c.text("actor_issuer")?).filter(|s| !s.is_empty()),
                route: c.text("route")?,
                key: c.text("idempotency_key")?,
            };
            // Every part as berth itself could have made it (no U+0000, a
            // route of the table, a key of the header's grammar, an actor
            // exactly when the principal has one).
            let printable = |s: &Option<String>| {
                s.as_ref().is_none_or(|s| {
                    !s.is_empty()
                        && s.len() <= 256
                        && s.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
                })
            };
            let actor_fits = match identity.principal {
                Principal::Service => identity.subject.is_none() && identity.issuer.is_none(),
                Principal::Backend | Principal::Callback => identity.subject.is_some(),
            };
            if !actor_fits || !printable(&identity.subject) || !printable(&identity.issuer) {
                return Err(c.bad("actor_subject"));
            }
            if !crate::api::ROUTES
                .iter()
                .any(|r| r.template == identity.route)
            {
                return Err(c.bad("route"));
            }
            if !crate::api::idempotency::valid_key(&identity.key) {
                return Err(c.bad("idempotency_key"));
            }
            let headers: Vec<(String, String)> = c.parsed("headers")?;
            if !stored_headers_ok(&headers) {
                return Err(c.bad("headers"));
            }
            let record = IdempotencyRecord {
                status: u16::try_from(c.int("status")?).map_err(|_| c.bad("status"))?,
                content_type: c.text("content_type")?,
                body: c.bytes("body")?,
                headers,
                fingerprint: c.bytes("fingerprint")?,
                expires_at: c.time("expires_at")?,
                identity: identity.clone(),
            };
            Row::Idempotency {
                identity: identity.store_key(),
                record,
            }
        }
        Table::UpdateTries => Row::UpdateTry {
            deployment: c.text("deployment_id")?,
            record: c.record()?,
        },
        Table::Webhooks => Row::Webhook {
            id: c.uuid("webhook_id")?,
            record: c.record()?,
        },
        Table::WebhookDeliveries => Row::Delivery {
            webhook: c.uuid("webhook_id")?,
            id: c.uuid("delivery_id")?,
            record: c.record()?,
        },
        Table::Tokens => Row::Token {
            hash: c.text("token_hash")?,
            record: c.record()?,
        },
        Table::Attempts => Row::Attempt(c.record()?),
        Table::WorkStates => Row::WorkStates {
            deployment: c.text("deployment_id")?,
            record: c.record()?,
        },
        Table::WorkStateBlobs => Row::WorkStateBlob {
            digest: c.text("digest")?,
            record: c.record()?,
        },
        Table::Rollouts => Row::Rollout(c.record()?),
        Table::Nodes => Row::Node(Box::new(c.record()?)),
        Table::RolloutResults => Row::RolloutResult {
            build: c.uuid("build_id")?,
            bytes: c.bytes("result")?,
        },
        Table::Freezes => Row::Freeze {
            key: c.text("scope_key")?,
            record: c.record()?,
        },
        Table::RolloutPolicies => Row::RolloutPolicy {
            deployment: c.text("deployment_id")?,
            text: c.json_text("policy")?,
        },
        Table::WorkStatePieces => Row::WorkStatePiece {
            digest: c.text("digest")?,
            n: u64::try_from(c.int("piece")?).map_err(|_| c.bad("piece"))?,
            bytes: c.bytes("data")?,
        },
        Table::SbomComponents => Row::Component {
            hash: c.hash("hash")?,
            refs: u32::try_from(c.int("refs")?).map_err(|_| c.bad("refs"))?,
            text: c.json_text("component")?.into_bytes(),
        },
        Table::SbomNodes => {
            let deployment = c.text("deployment_id")?;
            let node = c.text("node")?;
            let status: SbomStatus =
                serde_json::from_value(c.text("status")?.into()).map_err(|_| c.bad("status"))?;
            let build_id = match c.take("build_id")? {
                Value::Uuid(id) => Some(id),
                Value::Null => None,
                _ => return Err(c.bad("build_id")),
            };
            let at = c.time("at")?;
            let reason = c.opt_text("reason")?;
            let skeleton = match c.take("skeleton")? {
                Value::Json(t) => t.into_bytes(),
                Value::Null => Vec::new(),
                _ => return Err(c.bad("skeleton")),
            };
            let had_components = c.bool("had_components")?;
            let hex_hashes: Vec<String> = c.parsed("components")?;
            let hashes = hex_hashes
                .iter()
                .map(|h| crate::audit::decode_hash(h).ok_or_else(|| c.bad("components")))
                .collect::<Result<Vec<_>, _>>()?;
            Row::SbomNode {
                deployment,
                node,
                sbom: NodeSbom {
                    status,
                    build_id,
                    at,
                    reason,
                    skeleton,
                    had_components,
                    hashes,
                },
            }
        }
        Table::AuditEvents => Row::Audit {
            seq: c.u64("seq")?,
            hash: c.hash("hash")?,
            canonical: c.json_text("event")?.into_bytes(),
        },
        Table::MerkleNodes => Row::MerkleNode {
            level: u8::try_from(c.int("level")?).map_err(|_| c.bad("level"))?,
            index: c.u64("position")?,
            hash: c.hash("hash")?,
        },
        Table::Queued
        | Table::Running
        | Table::LogIndex
        | Table::IdempotencyExpiry
        | Table::AuditByActor
        | Table::WebhookQueue => {
            return Err(format!(
                "table {}: {} is an index the import rebuilds, not a table of rows",
                table.name,
                table.store_table.name()
            ))
        }
    })
}

/// The headers a stored answer replays are the few berth itself adds to a
/// mutation's answer, each a valid header: an import never makes berth
/// send a header a file invented.
fn stored_headers_ok(headers: &[(String, String)]) -> bool {
    // `Reply::header` calls of mutations and `Reply::from_error`.
    const BERTH_SETS: [&str; 5] = [
        "etag",
        "retry-after",
        "allow",
        "content-range",
        "connection",
    ];
    headers.len() <= BERTH_SETS.len()
        && headers.iter().all(|(name, value)| {
            BERTH_SETS.contains(&name.to_ascii_lowercase().as_str())
                && value.len() <= 256
                && warp::http::HeaderValue::from_str(value).is_ok()
        })
}

/// A deployment id read back must be one berth could have made: it names
/// directories and is matched by routes.
fn valid_id(id: &str, table: &RelTable) -> Result<(), String> {
    if crate::model::is_valid_deployment_id(id) {
        Ok(())
    } else {
        Err(format!(
            "table {}: a deployment id is not a DNS label of at most {} characters",
            table.name,
            crate::model::MAX_DEPLOYMENT_ID_LEN
        ))
    }
}

/// The values of one relational row, taken by column name.
struct Cells {
    table: &'static str,
    columns: &'static [Column],
    values: Vec<Option<Value>>,
}

impl Cells {
    fn bad(&self, column: &str) -> String {
        format!(
            "table {}: column {column} holds a value berth cannot read back",
            self.table
        )
    }

    fn take(&mut self, column: &str) -> Result<Value, String> {
        let at = self
            .columns
            .iter()
            .position(|c| c.name == column)
            .ok_or_else(|| format!("table {}: no column {column}", self.table))?;
        self.values[at].take().ok_or_else(|| self.bad(column))
    }

    fn text(&mut self, column: &str) -> Result<String, String> {
        match self.take(column)? {
            Value::Text(s) => Ok(s),
            _ => Err(self.bad(column)),
        }
    }

    fn opt_text(&mut self, column: &str) -> Result<Option<String>, String> {
        match self.take(column)? {
            Value::Text(s) => Ok(Some(s)),
            Value::Null => Ok(None),
            _ => Err(self.bad(column)),
        }
    }

    fn json_text(&mut self, column: &str) -> Result<String, String> {
        match self.take(column)? {
            Value::Json(s) => Ok(s),
            _ => Err(self.bad(column)),
        }
    }

    fn parsed<T: DeserializeOwned>(&mut self, column: &str) -> Result<T, String> {
        let text = self.json_text(column)?;
        serde_json::from_str(&text).map_err(|_| self.bad(column))
    }

    /// The whole store record, from the `record` column.
    fn record<T: DeserializeOwned>(&mut self) -> Result<T, String> {
        self.parsed("record")
    }

    fn bytes(&mut self, column: &str) -> Result<Vec<u8>, String> {
        match self.take(column)? {
            Value::Bytes(b) => Ok(b),
            _ => Err(self.bad(column)),
        }
    }

    fn int(&mut self, column: &str) -> Result<i64, String> {
        match self.take(column)? {
            Value::Int(n) => Ok(n),
            _ => Err(self.bad(column)),
        }
    }

    fn u64(&mut self, column: &str) -> Result<u64, String> {
        u64::try_from(self.int(column)?).map_err(|_| self.bad(column))
    }

    fn bool(&mut self, column: &str) -> Result<bool, String> {
        match self.take(column)? {
            Value::Bool(b) => Ok(b),
            _ => Err(self.bad(column)),
        }
    }

    fn time(&mut self, column: &str) -> Result<Millis, String> {
        match self.take(column)? {
            Value::Time(t) => Ok(t),
            _ => Err(self.bad(column)),
        }
    }

    fn uuid(&mut self, column: &str) -> Result<BuildId, String> {
        match self.take(column)? {
            Value::Uuid(id) => Ok(id),
            _ => Err(self.bad(column)),
        }
    }

    fn hash(&mut self, column: &str) -> Result<[u8; 32], String> {
        let text = self.text(column)?;
        crate::audit::decode_hash(&text).ok_or_else(|| self.bad(column))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tables::ExportKind;

    /// Every carried store table has one relational table, in import
    /// order; an index has none (the import rebuilds it).
    #[test]
    fn every_store_table_has_an_export_mapping() {
        for t in Table::ALL {
            let mapped = TABLES.iter().filter(|r| r.store_table == t).count();
            match t.export() {
                ExportKind::Carried => assert_eq!(mapped, 1, "{t:?}: add a RelTable here"),
                ExportKind::Rebuilt { .. } => assert_eq!(mapped, 0, "{t:?} is rebuilt"),
            }
        }
        let order: Vec<Table> = TABLES.iter().map(|r| r.store_table).collect();
        assert_eq!(order, Table::carried().collect::<Vec<_>>());
        for t in TABLES {
            assert!(t
                .primary_key
                .iter()
                .all(|k| t.columns.iter().any(|c| c.name == *k)));
            for (column, parent) in t.references {
                assert!(t.columns.iter().any(|c| c.name == *column));
                let at = TABLES.iter().position(|p| p.name == *parent).unwrap();
                let me = TABLES.iter().position(|p| p.name == t.name).unwrap();
                assert!(at < me, "{} is written before its parent {parent}", t.name);
            }
        }
    }

    fn round_trip(row: Row) -> Row {
        let table = table_for(row.table()).unwrap();
        let values = to_values(&row).unwrap();
        assert_eq!(values.len(), table.columns.len(), "{}", table.name);
        for (v, c) in values.iter().zip(table.columns) {
            assert!(
                *v != Value::Null || c.nullable,
                "{}.{} is NULL",
                table.name,
                c.name
            );
        }
        from_values(table, values).unwrap()
    }

    #[test]
    fn rows_come_back_as_they_went() {
        let event = StoredEvent {
            event: "status".into(),
            data: r#"{"b":1,"a":"\u0000"}"#.into(),
            at: 1_700_000_000_123,
        };
        match round_trip(Row::BuildEvent {
            build: u128::MAX - 5,
            seq: 9,
            event: event.clone(),
        }) {
            Row::BuildEvent {
                build,
                seq,
                event: e,
            } => {
                assert_eq!((build, seq), (u128::MAX - 5, 9));
                assert_eq!((e.event, e.data, e.at), (event.event, event.data, event.at));
            }
            other => panic!("{other:?}"),
        }
        // A chunk with a NUL byte goes as bytes, one without as text.
        for text in [b"line\n".to_vec(), b"bad \0 byte\n".to_vec()] {
            match round_trip(Row::LogChunk {
                build: 7,
                number: 3,
                first_line: 100,
                text: text.clone(),
            }) {
                Row::LogChunk {
                    text: t,
                    first_line,
                    number,
                    ..
                } => {
                    assert_eq!((t, first_line, number), (text, 100, 3))
                }
                other => panic!("{other:?}"),
            }
        }
        // A callback caller's key: its identity holds U+0000 in the store's
        // key, never in a column.
        let identity = IdempotencyIdentity {
            principal: Principal::Callback,
            subject: Some("alice@example.org".into()),
            issuer: Some("https://id.example.org".into()),
            route: "/v1/deployments/{id}/submit".into(),
            key: "k-00000000000001".into(),
        };
        let record = IdempotencyRecord {
            fingerprint: vec![1, 2, 3],
            status: 202,
            content_type: "application/json".into(),
            body: b"{\"x\":1}".to_vec(),
            headers: vec![("ETag".into(), "\"3\"".into())],
            expires_at: 5,
            identity: identity.clone(),
        };
        let values = to_values(&Row::Idempotency {
            identity: identity.store_key(),
            record: record.clone(),
        })
        .unwrap();
        assert!(
            values
                .iter()
                .all(|v| !matches!(v, Value::Text(t) if t.contains('\0'))),
            "a column holds U+0000: {values:?}"
        );
        match round_trip(Row::Idempotency {
            identity: identity.store_key(),
            record: record.clone(),
        }) {
            Row::Idempotency {
                identity: key,
                record: r,
            } => {
                assert_eq!(key, identity.store_key());
                assert_eq!(r.identity, identity);
                assert_eq!(
                    (r.fingerprint, r.status, r.body, r.headers, r.expires_at),
                    (record.fingerprint, 202, record.body, record.headers, 5)
                );
            }
            other => panic!("{other:?}"),
        }
        let sbom = NodeSbom {
            status: SbomStatus::Ready,
            build_id: Some(42),
            at: 77,
            reason: None,
            skeleton: br#"{"bomFormat":"CycloneDX"}"#.to_vec(),
            had_components: true,
            hashes: vec![[7u8; 32], [9u8; 32]],
        };
        match round_trip(Row::SbomNode {
            deployment: "d".into(),
            node: "web".into(),
            sbom: sbom.clone(),
        }) {
            Row::SbomNode { sbom: s, .. } => assert_eq!(s, sbom),
            other => panic!("{other:?}"),
        }
        match round_trip(Row::MerkleNode {
            level: 3,
            index: 12,
            hash: [0xab; 32],
        }) {
            Row::MerkleNode { level, index, hash } => {
                assert_eq!((level, index, hash), (3, 12, [0xab; 32]))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_deployment_id_berth_could_not_have_made_is_refused() {
        let table = table_for(Table::Builds).unwrap();
        let row = Row::Build(Box::new(crate::model::BuildRecord {
            log_first_seq: 1,
            ..crate::model::BuildRecord::queued(
                1,
                "../../etc".into(),
                crate::model::BuildKind::Deploy,
                crate::model::Trigger::Submit,
                "local".into(),
                0,
            )
        }));
        let err = from_values(table, to_values(&row).unwrap()).unwrap_err();
        assert!(err.contains("DNS label") && !err.contains("etc"), "{err}");
    }

    #[test]
    fn a_malformed_row_is_an_error_not_a_default() {
        let table = table_for(Table::Sources).unwrap();
        let err = from_values(
            table,
            vec![Value::Text("d".into()), Value::Null, Value::Null],
        )
        .unwrap_err();
        assert!(err.contains("sources"), "{err}");
        assert!(from_values(table, vec![Value::Null]).is_err());
    }
}
