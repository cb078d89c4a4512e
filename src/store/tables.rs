//! Every redb table in one place: name, key type, value type, and why it exists.
//!
//! Values named `&[u8]` are `codec`-encoded records (a version byte, then
//! bincode) unless said otherwise.
//!
//! Records are `codec::encode`d: a version byte, then bincode 2 (serde). A
//! configuration is stored as the JSON text the client sent (shown back
//! byte for byte); a build's configuration and source live in
//! `build_snapshots`, apart from the build record, which is rewritten at
//! every log chunk and so stays small; an update policy is JSON text inside
//! its record (bincode cannot read internally tagged enums). The layout as a
//! whole has a version (`layout`).

use redb::TableDefinition;

/// Schema version and other single facts (`schema_version` -> u32 LE).
pub const META: TableDefinition<&str, &[u8]> = TableDefinition::new(Table::Meta.name());

/// Deployment id -> `DeploymentRecord`.
pub const DEPLOYMENTS: TableDefinition<&str, &[u8]> =
    TableDefinition::new(Table::Deployments.name());

/// Build id (UUIDv7 as u128, so time-ordered) -> `BuildRecord`.
pub const BUILDS: TableDefinition<u128, &[u8]> = TableDefinition::new(Table::Builds.name());

/// Build id -> deployment id for every queued build; key order is queue order.
pub const QUEUED: TableDefinition<u128, &str> = TableDefinition::new(Table::Queued.name());

/// Build id -> deployment id for every running build (recovery reads this).
pub const RUNNING: TableDefinition<u128, &str> = TableDefinition::new(Table::Running.name());

/// (build id, chunk number) -> first line index (u64 LE) then the
/// zstd-compressed log text of whole lines.
pub const LOG_CHUNKS: TableDefinition<(u128, u32), &[u8]> =
    TableDefinition::new(Table::LogChunks.name());

/// "subject\u{0}route\u{0}key" -> `IdempotencyRecord`.
pub const IDEMPOTENCY: TableDefinition<&str, &[u8]> =
    TableDefinition::new(Table::Idempotency.name());

/// Source digest -> `Source`: a digest names one (url, rev) forever.
pub const SOURCES: TableDefinition<&str, &[u8]> = TableDefinition::new(Table::Sources.name());

/// Source digest -> the deployer's `describe` result (JSON text).
pub const DESCRIBE_CACHE: TableDefinition<&str, &[u8]> =
    TableDefinition::new(Table::DescribeCache.name());

/// Destroy build id -> `PendingCallback`.
pub const CALLBACKS: TableDefinition<u128, &[u8]> = TableDefinition::new(Table::Callbacks.name());

/// (deployment id, part, number) -> bytes: every row filed under one
/// deployment apart from its record, by `Part`: its builds, its channel's
/// events, its audit events. One B-tree rather than three because a submit
/// writes one row of each, and here they share a leaf and one path of
/// copied pages (`tools/writer-instructions` counts what it saves). The
/// number is a build id (u128) or a seq (u64, widened).
pub const DEPLOYMENT_ROWS: TableDefinition<(&str, u8, u128), &[u8]> =
    TableDefinition::new(Table::DeploymentRows.name());

/// The value of a row that is all key (an index row).
pub const EMPTY: &[u8] = &[];

/// The kinds of row in `DEPLOYMENT_ROWS`, by the key's second member.
/// Stored: a part's number never changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Part {
    /// number = build id, value empty: the deployment's builds, in order
    /// (an index: an import writes it again from the builds).
    Build = 1,
    /// number = event seq, value `StoredEvent`: the deployment channel
    /// (carried by an export).
    Event = 2,
    /// number = audit seq, value empty: the deployment's audit events other
    /// than denied calls, for the deployment read's last 20 (an index: an
    /// import writes it again from the audit events).
    Audit = 3,
}

/// A key of `DEPLOYMENT_ROWS`.
pub type DeploymentRowKey<'a> = (&'a str, u8, u128);

impl Part {
    /// The key of `deployment`'s row `number` of this part.
    pub fn key(self, deployment: &str, number: u128) -> DeploymentRowKey<'_> {
        (deployment, self as u8, number)
    }

    /// The keys of `deployment`'s rows of this part numbered `from..=to`.
    pub fn range(
        self,
        deployment: &str,
        from: u128,
        to: u128,
    ) -> std::ops::RangeInclusive<DeploymentRowKey<'_>> {
        self.key(deployment, from)..=self.key(deployment, to)
    }

    /// Every row of this part of `deployment`.
    pub fn all(self, deployment: &str) -> std::ops::RangeInclusive<DeploymentRowKey<'_>> {
        self.range(deployment, 0, u128::MAX)
    }

    /// The part a stored key names; `None` for a number no berth writes.
    pub fn of(stored: u8) -> Option<Part> {
        [Part::Build, Part::Event, Part::Audit]
            .into_iter()
            .find(|p| *p as u8 == stored)
    }
}

/// (build id, event seq) -> `StoredEvent`: a build's status events (its log
/// lines live in `LOG_CHUNKS`, their seqs follow from the build record).
pub const BUILD_EVENTS: TableDefinition<(u128, u64), &[u8]> =
    TableDefinition::new(Table::BuildEvents.name());

/// Build id -> `BuildSnapshots`: the configuration and source a build runs
/// (written when queued, `previous` added when it starts).
pub const BUILD_SNAPSHOTS: TableDefinition<u128, &[u8]> =
    TableDefinition::new(Table::BuildSnapshots.name());

/// Deployment id -> `UpdateTry`: the last automatic update tried, written in
/// the transaction of its build (or of its refusal), so a restart never
/// tries the same default source twice under one policy.
pub const UPDATE_TRIES: TableDefinition<&str, &[u8]> =
    TableDefinition::new(Table::UpdateTries.name());

/// (deployment id, node) -> `NodeSbom`: each node's SBOM status, skeleton
/// and ordered component hashes (sbom.md).
pub const SBOM_NODES: TableDefinition<(&str, &str), &[u8]> =
    TableDefinition::new(Table::SbomNodes.name());

/// SHA-256 of a component's RFC 8785 text -> reference count (u32 LE, one
/// per occurrence in any node's list) then the zstd of that text. A row
/// goes in the transaction that drops its last reference.
pub const SBOM_COMPONENTS: TableDefinition<&[u8], &[u8]> =
    TableDefinition::new(Table::SbomComponents.name());

/// (build id, chunk number) -> the chunk's place in its log: first line
/// index, first byte offset and raw length (3 x u64 LE). Lets a `Range`
/// read, a replay after a cursor and a catch-up decompress only the chunks
/// they need (builds stored before this table have no rows: read whole).
pub const LOG_INDEX: TableDefinition<(u128, u32), &[u8]> =
    TableDefinition::new(Table::LogIndex.name());

/// (expires_at ms, identity) -> (): idempotency records by expiry, so the
/// sweep reads only what expired, in bounded batches, decoding nothing.
pub const IDEMPOTENCY_EXPIRY: TableDefinition<(i64, &str), ()> =
    TableDefinition::new(Table::IdempotencyExpiry.name());

/// Audit seq -> the sealed event: its 32-byte chain hash, then its RFC 8785
/// text without the hash (`audit::seal`). Rows are never rewritten; the
/// oldest are removed by retention, which moves the anchor (`META`).
pub const AUDIT_EVENTS: TableDefinition<u64, &[u8]> =
    TableDefinition::new(Table::AuditEvents.name());

/// ("subject\0issuer", audit seq) -> empty: one actor's events, denied
/// calls included (`GET /v1/audit`).
pub const AUDIT_BY_ACTOR: TableDefinition<(&str, u64), &[u8]> =
    TableDefinition::new(Table::AuditByActor.name());

/// (level, index) -> 32-byte hash: the perfect subtrees of the RFC 6962
/// tree over the audit events (leaf `seq - 1` at level 0) from level
/// `STORED_FROM_LEVEL` up, written as each event completes one, so a proof
/// at any size reads O(log^2 n) rows (and at most 7 event rows for the
/// subtrees below, `store::audit::StoredNodes`). Retention removes the
/// subtrees inside the pruned prefix except its compact range, which it
/// stores at every level (its events are gone).
pub const MERKLE_NODES: TableDefinition<(u8, u64), &[u8]> =
    TableDefinition::new(Table::MerkleNodes.name());

/// The levels of the Merkle tree below this one are not stored: a subtree
/// of fewer than 8 events is computed from their rows when a proof, a root
/// or the next stored subtree needs it. Why: storing every level wrote two
/// `merkle_nodes` rows per audit event on average (the leaf and the
/// subtrees it completes), each a B-tree insert on the store's single
/// writer thread in every submit; from level 3 up it is a quarter of a row
/// per event, and a proof reads at most 7 event rows more (layout 10).
/// The exceptions are the subtrees of a pruned prefix's compact range,
/// whose events are gone (`prune_audit`).
pub const STORED_FROM_LEVEL: u8 = 3;
const _: () = assert!(STORED_FROM_LEVEL >= 1 && STORED_FROM_LEVEL <= 8);

/// `meta` key of the audit retention anchor (JSON `audit::Anchor`); absent
/// until the first removal.
pub const ANCHOR_KEY: &str = "audit_anchor";

/// Webhook id (UUIDv7 as u128) -> `WebhookRecord`: the subscriptions.
pub const WEBHOOKS: TableDefinition<u128, &[u8]> = TableDefinition::new(Table::Webhooks.name());

/// (webhook id, delivery id) -> `DeliveryRecord`: the outbox, each row
/// written in the transaction of the change it reports; newest last.
pub const WEBHOOK_DELIVERIES: TableDefinition<(u128, u128), &[u8]> =
    TableDefinition::new(Table::WebhookDeliveries.name());

/// (webhook id, next attempt ms, delivery id) -> (): each subscription's
/// pending deliveries by when they are due, so the sender finds the
/// oldest due one of every subscription with one seek each, however long
/// another's backlog (notifications.md "Delivery").
pub const WEBHOOK_QUEUE: TableDefinition<(u128, i64, u128), ()> =
    TableDefinition::new(Table::WebhookQueue.name());

/// SHA-256 of a worker or agent token's secret (hex) -> `TokenRecord`
/// (api.md "Tokens"): a call's token is found with one lookup, and the
/// secret is never stored.
pub const TOKENS: TableDefinition<&str, &[u8]> = TableDefinition::new(Table::Tokens.name());

/// (build id, fence) -> `AttemptRecord`: each attempt of a build, the
/// newest last (workers.md); the attempt id names both parts.
pub const ATTEMPTS: TableDefinition<(u128, u64), &[u8]> =
    TableDefinition::new(Table::Attempts.name());

/// Deployment id -> `WorkStates`: its current and kept work states, from
/// its first remote claim on (workers.md "The work state").
pub const WORK_STATES: TableDefinition<&str, &[u8]> =
    TableDefinition::new(Table::WorkStates.name());

/// Digest (`sha256:<hex>`) -> `WorkStateBlob`: each stored archive once,
/// with the count of lists naming it.
pub const WORK_STATE_BLOBS: TableDefinition<&str, &[u8]> =
    TableDefinition::new(Table::WorkStateBlobs.name());

/// (digest, piece number from 0) -> compressed bytes: an archive's zstd
/// stream in pieces of at most `WorkStateBlob::PIECE_BYTES`, so no row is
/// as large as the archive.
pub const WORK_STATE_PIECES: TableDefinition<(&str, u64), &[u8]> =
    TableDefinition::new(Table::WorkStatePieces.name());

/// Build id -> `RolloutRecord`: a deploy build's rollout in waves
/// (rollouts.md), its plan and where it is.
pub const ROLLOUTS: TableDefinition<u128, &[u8]> = TableDefinition::new(Table::Rollouts.name());

/// Deployment id -> its rollout policy, the JSON text as given (rollouts.md
/// "The rollout policy"); no row: `{}`.
pub const ROLLOUT_POLICIES: TableDefinition<&str, &[u8]> =
    TableDefinition::new(Table::RolloutPolicies.name());

/// Build id -> a rollout build's deploy result as checked (its nodes and
/// their SBOMs prepared for the store), stored with the plan so a rollout
/// that goes on after a restart can finish; removed with the final
/// status. The bytes are the engine's (`engine::rollouts`).
pub const ROLLOUT_RESULTS: TableDefinition<u128, &[u8]> =
    TableDefinition::new(Table::RolloutResults.name());

/// (deployment id, node name) -> `NodeRecord`: a node bound to an agent,
/// its desired-state document, its last report and its drift
/// (agents.md); kept for ever, so a fence is never handed out twice.
pub const NODES: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new(Table::Nodes.name());

/// `*` (the global freeze) or a deployment id -> `FreezeRecord`
/// (rollouts.md "Freeze").
pub const FREEZES: TableDefinition<&str, &[u8]> = TableDefinition::new(Table::Freezes.name());

/// Every redb table, one variant each: its name, whether an export carries
/// its rows or an import rebuilds it from another table, and the store's
/// open creating it. Every decision about a table is an exhaustive `match`
/// on this enum (here, in `dump` and in `export::schema`), so a new table
/// does not compile until each of them says what happens to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Table {
    Meta,
    Sources,
    DescribeCache,
    Deployments,
    Builds,
    BuildSnapshots,
    LogChunks,
    BuildEvents,
    DeploymentRows,
    Callbacks,
    Idempotency,
    UpdateTries,
    SbomComponents,
    SbomNodes,
    AuditEvents,
    MerkleNodes,
    Queued,
    Running,
    LogIndex,
    IdempotencyExpiry,
    AuditByActor,
    Webhooks,
    WebhookDeliveries,
    WebhookQueue,
    Tokens,
    Attempts,
    WorkStates,
    WorkStateBlobs,
    WorkStatePieces,
    Rollouts,
    RolloutPolicies,
    Freezes,
    RolloutResults,
    Nodes,
}

/// What an export does with a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportKind {
    /// Its rows go out one by one, decoded, and come back in an import.
    /// `DeploymentRows` is carried for its `Part::Event` rows; its other
    /// parts are indexes the import writes again (from the builds and the
    /// audit events), as for a `Rebuilt` table.
    Carried,
    /// An index: an import writes it again from the rows of `from`.
    Rebuilt { from: Table },
}

impl Table {
    /// Every table. The carried ones come first, in the order an import
    /// writes them (a row's parent before the row: builds before their
    /// logs), then the rebuilt indexes.
    pub const ALL: [Table; 34] = [
        Table::Meta,
        Table::Sources,
        Table::DescribeCache,
        Table::Deployments,
        Table::Builds,
        Table::BuildSnapshots,
        Table::LogChunks,
        Table::BuildEvents,
        Table::DeploymentRows,
        Table::Callbacks,
        Table::Idempotency,
        Table::UpdateTries,
        Table::SbomComponents,
        Table::SbomNodes,
        Table::AuditEvents,
        Table::MerkleNodes,
        Table::Webhooks,
        Table::WebhookDeliveries,
        Table::Tokens,
        Table::Attempts,
        Table::WorkStateBlobs,
        Table::WorkStatePieces,
        Table::WorkStates,
        Table::Rollouts,
        Table::RolloutPolicies,
        Table::Freezes,
        Table::RolloutResults,
        Table::Nodes,
        Table::Queued,
        Table::Running,
        Table::LogIndex,
        Table::IdempotencyExpiry,
        Table::AuditByActor,
        Table::WebhookQueue,
    ];

    /// The table of this name, if berth has one.
    pub fn named(name: &str) -> Option<Table> {
        Table::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Its name in the redb file: the one place each name is spelled (the
    /// `TableDefinition`s above read it from here).
    pub const fn name(self) -> &'static str {
        match self {
            Table::Meta => "meta",
            Table::Deployments => "deployments",
            Table::Builds => "builds",
            Table::Queued => "queued",
            Table::Running => "running",
            Table::LogChunks => "log_chunks",
            Table::Idempotency => "idempotency",
            Table::Sources => "sources",
            Table::DescribeCache => "describe_cache",
            Table::Callbacks => "callbacks",
            Table::DeploymentRows => "deployment_rows",
            Table::BuildEvents => "build_events",
            Table::BuildSnapshots => "build_snapshots",
            Table::UpdateTries => "update_tries",
            Table::SbomNodes => "sbom_nodes",
            Table::SbomComponents => "sbom_components",
            Table::LogIndex => "log_index",
            Table::IdempotencyExpiry => "idempotency_expiry",
            Table::AuditEvents => "audit_events",
            Table::AuditByActor => "audit_by_actor",
            Table::MerkleNodes => "merkle_nodes",
            Table::Webhooks => "webhooks",
            Table::WebhookDeliveries => "webhook_deliveries",
            Table::WebhookQueue => "webhook_queue",
            Table::Tokens => "tokens",
            Table::Attempts => "attempts",
            Table::WorkStates => "work_states",
            Table::WorkStateBlobs => "work_state_blobs",
            Table::WorkStatePieces => "work_state_pieces",
            Table::Rollouts => "rollouts",
            Table::RolloutPolicies => "rollout_policies",
            Table::Freezes => "freezes",
            Table::RolloutResults => "rollout_results",
            Table::Nodes => "nodes",
        }
    }

    /// What an export does with it.
    pub fn export(self) -> ExportKind {
        use ExportKind::{Carried, Rebuilt};
        match self {
            Table::Meta
            | Table::Sources
            | Table::DescribeCache
            | Table::Deployments
            | Table::Builds
            | Table::BuildSnapshots
            | Table::LogChunks
            | Table::BuildEvents
            | Table::DeploymentRows
            | Table::Callbacks
            | Table::Idempotency
            | Table::UpdateTries
            | Table::SbomComponents
            | Table::SbomNodes
            | Table::AuditEvents
            | Table::MerkleNodes
            | Table::Webhooks
            | Table::WebhookDeliveries
            | Table::Tokens
            | Table::Attempts
            | Table::WorkStates
            | Table::WorkStateBlobs
            | Table::WorkStatePieces
            | Table::Rollouts
            | Table::RolloutPolicies
            | Table::Freezes
            | Table::RolloutResults
            | Table::Nodes => Carried,
            Table::Queued | Table::Running => Rebuilt {
                from: Table::Builds,
            },
            Table::LogIndex => Rebuilt {
                from: Table::LogChunks,
            },
            Table::IdempotencyExpiry => Rebuilt {
                from: Table::Idempotency,
            },
            Table::AuditByActor => Rebuilt {
                from: Table::AuditEvents,
            },
            Table::WebhookQueue => Rebuilt {
                from: Table::WebhookDeliveries,
            },
        }
    }

    /// The carried tables, in import order.
    pub fn carried() -> impl Iterator<Item = Table> {
        Table::ALL
            .into_iter()
            .filter(|t| t.export() == ExportKind::Carried)
    }

    /// Creates the table in `txn` if the file does not have it yet, so
    /// readers never meet a missing one.
    pub fn create(self, txn: &redb::WriteTransaction) -> Result<(), redb::TableError> {
        struct Create<'t>(&'t redb::WriteTransaction);
        impl EachTable for Create<'_> {
            type Output = Result<(), redb::TableError>;
            fn with<K: redb::Key + 'static, V: redb::Value + 'static>(
                &mut self,
                def: TableDefinition<'static, K, V>,
            ) -> Self::Output {
                self.0.open_table(def).map(drop)
            }
        }
        self.visit(&mut Create(txn))
    }

    /// Runs `each` with this table's definition, its key and value types
    /// included: the one place a `Table` becomes redb's typed table, for
    /// work that is the same for every table (creating it, applying a redo
    /// row, copying it into a snapshot).
    pub fn visit<E: EachTable>(self, each: &mut E) -> E::Output {
        match self {
            Table::Meta => each.with(META),
            Table::Sources => each.with(SOURCES),
            Table::DescribeCache => each.with(DESCRIBE_CACHE),
            Table::Deployments => each.with(DEPLOYMENTS),
            Table::Builds => each.with(BUILDS),
            Table::BuildSnapshots => each.with(BUILD_SNAPSHOTS),
            Table::LogChunks => each.with(LOG_CHUNKS),
            Table::BuildEvents => each.with(BUILD_EVENTS),
            Table::DeploymentRows => each.with(DEPLOYMENT_ROWS),
            Table::Callbacks => each.with(CALLBACKS),
            Table::Idempotency => each.with(IDEMPOTENCY),
            Table::UpdateTries => each.with(UPDATE_TRIES),
            Table::SbomComponents => each.with(SBOM_COMPONENTS),
            Table::SbomNodes => each.with(SBOM_NODES),
            Table::AuditEvents => each.with(AUDIT_EVENTS),
            Table::MerkleNodes => each.with(MERKLE_NODES),
            Table::Queued => each.with(QUEUED),
            Table::Running => each.with(RUNNING),
            Table::LogIndex => each.with(LOG_INDEX),
            Table::IdempotencyExpiry => each.with(IDEMPOTENCY_EXPIRY),
            Table::AuditByActor => each.with(AUDIT_BY_ACTOR),
            Table::Webhooks => each.with(WEBHOOKS),
            Table::WebhookDeliveries => each.with(WEBHOOK_DELIVERIES),
            Table::WebhookQueue => each.with(WEBHOOK_QUEUE),
            Table::Tokens => each.with(TOKENS),
            Table::Attempts => each.with(ATTEMPTS),
            Table::WorkStates => each.with(WORK_STATES),
            Table::WorkStateBlobs => each.with(WORK_STATE_BLOBS),
            Table::WorkStatePieces => each.with(WORK_STATE_PIECES),
            Table::Rollouts => each.with(ROLLOUTS),
            Table::RolloutPolicies => each.with(ROLLOUT_POLICIES),
            Table::Freezes => each.with(FREEZES),
            Table::RolloutResults => each.with(ROLLOUT_RESULTS),
            Table::Nodes => each.with(NODES),
        }
    }
}

/// Work done to one table whatever its types (`Table::visit`).
pub trait EachTable {
    type Output;
    fn with<K: redb::Key + 'static, V: redb::Value + 'static>(
        &mut self,
        def: TableDefinition<'static, K, V>,
    ) -> Self::Output;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_table_is_listed_once_and_each_index_is_rebuilt_from_a_carried_table() {
        let names: std::collections::HashSet<&str> = Table::ALL.iter().map(|t| t.name()).collect();
        assert_eq!(names.len(), Table::ALL.len(), "two tables share a name");
        // A batch's kept-open tables (`logged::OpenTables`) are indexed by
        // the variant's number: one slot each, below `ALL.len()`.
        let slots: std::collections::HashSet<usize> =
            Table::ALL.iter().map(|t| *t as usize).collect();
        assert_eq!(slots.len(), Table::ALL.len());
        assert!(slots.iter().all(|slot| *slot < Table::ALL.len()));
        let mut seen_rebuilt = false;
        for t in Table::ALL {
            match t.export() {
                ExportKind::Carried => assert!(!seen_rebuilt, "{t:?}: carried after an index"),
                ExportKind::Rebuilt { from } => {
                    seen_rebuilt = true;
                    assert_eq!(from.export(), ExportKind::Carried, "{t:?} from {from:?}");
                }
            }
        }
    }
}
