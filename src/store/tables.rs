//! Every redb table in one place: name, key type, value type, and why it exists.
//!
//! Values named `&[u8]` are `codec`-encoded records (a version byte, then
//! bincode) unless said otherwise.

use redb::TableDefinition;

/// Schema version and other single facts (`schema_version` -> u32 LE).
pub const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

/// Deployment id -> `DeploymentRecord`.
pub const DEPLOYMENTS: TableDefinition<&str, &[u8]> = TableDefinition::new("deployments");

/// Build id (UUIDv7 as u128, so time-ordered) -> `BuildRecord`.
pub const BUILDS: TableDefinition<u128, &[u8]> = TableDefinition::new("builds");

/// (deployment id, build id) -> (): the builds of one deployment, in order.
pub const DEPLOYMENT_BUILDS: TableDefinition<(&str, u128), ()> =
    TableDefinition::new("deployment_builds");

/// Build id -> deployment id for every queued build; key order is queue order.
pub const QUEUED: TableDefinition<u128, &str> = TableDefinition::new("queued");

/// Build id -> deployment id for every running build (recovery reads this).
pub const RUNNING: TableDefinition<u128, &str> = TableDefinition::new("running");

/// (build id, chunk number) -> first line index (u64 LE) then the
/// zstd-compressed log text of whole lines.
pub const LOG_CHUNKS: TableDefinition<(u128, u32), &[u8]> = TableDefinition::new("log_chunks");

/// "subject\u{0}route\u{0}key" -> `IdempotencyRecord`.
pub const IDEMPOTENCY: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency");

/// Source digest -> `Source`: a digest names one (url, rev) forever.
pub const SOURCES: TableDefinition<&str, &[u8]> = TableDefinition::new("sources");

/// Source digest -> the deployer's `describe` result (JSON text).
pub const DESCRIBE_CACHE: TableDefinition<&str, &[u8]> = TableDefinition::new("describe_cache");

/// Destroy build id -> `PendingCallback`.
pub const CALLBACKS: TableDefinition<u128, &[u8]> = TableDefinition::new("callbacks");

/// (deployment id, event seq) -> `StoredEvent`: the deployment channel.
pub const DEPLOYMENT_EVENTS: TableDefinition<(&str, u64), &[u8]> =
    TableDefinition::new("deployment_events");

/// (build id, event seq) -> `StoredEvent`: a build's status events (its log
/// lines live in `LOG_CHUNKS`, their seqs follow from the build record).
pub const BUILD_EVENTS: TableDefinition<(u128, u64), &[u8]> = TableDefinition::new("build_events");

/// Build id -> `BuildSnapshots`: the configuration and source a build runs
/// (written when queued, `previous` added when it starts).
pub const BUILD_SNAPSHOTS: TableDefinition<u128, &[u8]> = TableDefinition::new("build_snapshots");

/// Deployment id -> `UpdateTry`: the last automatic update tried, written in
/// the transaction of its build (or of its refusal), so a restart never
/// tries the same default source twice under one policy.
pub const UPDATE_TRIES: TableDefinition<&str, &[u8]> = TableDefinition::new("update_tries");

/// (deployment id, node) -> `NodeSbom`: each node's SBOM status, skeleton
/// and ordered component hashes (sbom.md).
pub const SBOM_NODES: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("sbom_nodes");

/// SHA-256 of a component's RFC 8785 text -> reference count (u32 LE, one
/// per occurrence in any node's list) then the zstd of that text. A row
/// goes in the transaction that drops its last reference.
pub const SBOM_COMPONENTS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("sbom_components");

/// (build id, chunk number) -> the chunk's place in its log: first line
/// index, first byte offset and raw length (3 x u64 LE). Lets a `Range`
/// read, a replay after a cursor and a catch-up decompress only the chunks
/// they need (builds stored before this table have no rows: read whole).
pub const LOG_INDEX: TableDefinition<(u128, u32), &[u8]> = TableDefinition::new("log_index");

/// (expires_at ms, identity) -> (): idempotency records by expiry, so the
/// sweep reads only what expired, in bounded batches, decoding nothing.
pub const IDEMPOTENCY_EXPIRY: TableDefinition<(i64, &str), ()> =
    TableDefinition::new("idempotency_expiry");

/// Audit seq -> the sealed event: its 32-byte chain hash, then its RFC 8785
/// text without the hash (`audit::seal`). Rows are never rewritten; the
/// oldest are removed by retention, which moves the anchor (`META`).
pub const AUDIT_EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("audit_events");

/// (deployment id, audit seq) -> empty: a deployment's events other than
/// denied calls, for the deployment read's last 20.
pub const AUDIT_BY_DEPLOYMENT: TableDefinition<(&str, u64), &[u8]> =
    TableDefinition::new("audit_by_deployment");

/// ("subject\0issuer", audit seq) -> empty: one actor's events, denied
/// calls included (`GET /v1/audit`).
pub const AUDIT_BY_ACTOR: TableDefinition<(&str, u64), &[u8]> =
    TableDefinition::new("audit_by_actor");

/// (level, index) -> 32-byte hash: every perfect subtree of the RFC 6962
/// tree over the audit events (leaf `seq - 1` at level 0), written as each
/// event completes it, so a proof at any size reads O(log^2 n) rows.
/// Retention removes the subtrees inside the pruned prefix except its
/// compact range.
pub const MERKLE_NODES: TableDefinition<(u8, u64), &[u8]> = TableDefinition::new("merkle_nodes");

/// Every table above by name: the store's table list. A test checks that a
/// new store's file holds exactly these, and that the export carries or
/// rebuilds each (`dump`).
pub const ALL: &[&str] = &[
    "meta",
    "deployments",
    "builds",
    "deployment_builds",
    "queued",
    "running",
    "log_chunks",
    "idempotency",
    "sources",
    "describe_cache",
    "callbacks",
    "deployment_events",
    "build_events",
    "build_snapshots",
    "update_tries",
    "sbom_nodes",
    "sbom_components",
    "log_index",
    "idempotency_expiry",
    "audit_events",
    "audit_by_deployment",
    "audit_by_actor",
    "merkle_nodes",
];
