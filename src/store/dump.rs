//! The whole store as rows, and a new store file from rows: what `berth
//! export` reads and `berth import` writes (storage.md "Export and import").
//!
//! It lives in the store because it is the one module that knows every
//! table. A table is either *carried* (its rows go out one by one, decoded)
//! or *rebuilt* (an index of a carried table, written again by the import
//! from the rows it indexes): `Table::export` says which, and the matches
//! here on `Table` have no `_` arm, so a new table cannot be forgotten by
//! the export.

use std::path::Path;

use redb::{Database, ReadableTable, ReadableTableMetadata, WriteTransaction};

use super::compress::{compress, decompress};
use super::tables::*;
use super::tx::Tx;
use super::{
    component_row, decode, split_chunk_row, split_component_row, ChunkPlace, DeliveryRecord,
    IdempotencyRecord, PendingCallback, Rx, StoreError, StoreResult, StoredEvent, WebhookRecord,
};
use crate::audit::{self as chain, AuditResult};
use crate::model::{
    AttemptRecord, BuildId, BuildRecord, BuildSnapshots, DeploymentRecord, FreezeRecord,
    NodeRecord, NodeSbom, RolloutRecord, Source, TokenRecord, UpdateTry, WorkStateBlob, WorkStates,
};

/// One row of a carried table, decoded (compressed text decompressed).
#[derive(Debug, Clone)]
pub enum Row {
    Meta {
        key: String,
        value: Vec<u8>,
    },
    Source(Source),
    Describe {
        digest: String,
        json: String,
    },
    Deployment(Box<DeploymentRecord>),
    Build(Box<BuildRecord>),
    Snapshots {
        build: BuildId,
        snapshots: Box<BuildSnapshots>,
    },
    LogChunk {
        build: BuildId,
        number: u32,
        first_line: u64,
        /// The chunk's text (whole lines), decompressed.
        text: Vec<u8>,
    },
    BuildEvent {
        build: BuildId,
        seq: u64,
        event: StoredEvent,
    },
    DeploymentEvent {
        deployment: String,
        seq: u64,
        event: StoredEvent,
    },
    Callback {
        build: BuildId,
        callback: PendingCallback,
    },
    Idempotency {
        /// "subject\0route\0key".
        identity: String,
        record: IdempotencyRecord,
    },
    UpdateTry {
        deployment: String,
        record: UpdateTry,
    },
    Component {
        hash: [u8; 32],
        refs: u32,
        /// The component's RFC 8785 text, decompressed.
        text: Vec<u8>,
    },
    SbomNode {
        deployment: String,
        node: String,
        /// Its `skeleton` holds the skeleton's JSON text, decompressed.
        sbom: NodeSbom,
    },
    Audit {
        seq: u64,
        hash: [u8; 32],
        /// The event's RFC 8785 text, exactly as chained.
        canonical: Vec<u8>,
    },
    MerkleNode {
        level: u8,
        index: u64,
        hash: [u8; 32],
    },
    Webhook {
        id: u128,
        record: WebhookRecord,
    },
    Delivery {
        webhook: u128,
        id: u128,
        record: DeliveryRecord,
    },
    Token {
        /// SHA-256 of the secret, hex.
        hash: String,
        record: TokenRecord,
    },
    Attempt(AttemptRecord),
    WorkStates {
        deployment: String,
        record: WorkStates,
    },
    WorkStateBlob {
        digest: String,
        record: WorkStateBlob,
    },
    /// One piece of an archive's zstd stream, as stored.
    WorkStatePiece {
        digest: String,
        n: u64,
        bytes: Vec<u8>,
    },
    Rollout(RolloutRecord),
    RolloutPolicy {
        deployment: String,
        text: String,
    },
    Freeze {
        /// `*` (global) or a deployment id.
        key: String,
        record: FreezeRecord,
    },
    /// A rollout build's deploy result, the engine's bytes as stored.
    RolloutResult {
        build: BuildId,
        bytes: Vec<u8>,
    },
    Node(Box<NodeRecord>),
}

impl Row {
    /// The carried table this row belongs to.
    pub fn table(&self) -> Table {
        match self {
            Row::Meta { .. } => Table::Meta,
            Row::Source(_) => Table::Sources,
            Row::Describe { .. } => Table::DescribeCache,
            Row::Deployment(_) => Table::Deployments,
            Row::Build(_) => Table::Builds,
            Row::Snapshots { .. } => Table::BuildSnapshots,
            Row::LogChunk { .. } => Table::LogChunks,
            Row::BuildEvent { .. } => Table::BuildEvents,
            Row::DeploymentEvent { .. } => Table::DeploymentRows,
            Row::Callback { .. } => Table::Callbacks,
            Row::Idempotency { .. } => Table::Idempotency,
            Row::UpdateTry { .. } => Table::UpdateTries,
            Row::Component { .. } => Table::SbomComponents,
            Row::SbomNode { .. } => Table::SbomNodes,
            Row::Audit { .. } => Table::AuditEvents,
            Row::MerkleNode { .. } => Table::MerkleNodes,
            Row::Webhook { .. } => Table::Webhooks,
            Row::Delivery { .. } => Table::WebhookDeliveries,
            Row::Token { .. } => Table::Tokens,
            Row::Attempt(_) => Table::Attempts,
            Row::WorkStates { .. } => Table::WorkStates,
            Row::WorkStateBlob { .. } => Table::WorkStateBlobs,
            Row::WorkStatePiece { .. } => Table::WorkStatePieces,
            Row::Rollout(_) => Table::Rollouts,
            Row::RolloutPolicy { .. } => Table::RolloutPolicies,
            Row::Freeze { .. } => Table::Freezes,
            Row::RolloutResult { .. } => Table::RolloutResults,
            Row::Node(_) => Table::Nodes,
        }
    }
}

fn hash32(bytes: &[u8], what: &str) -> StoreResult<[u8; 32]> {
    bytes
        .try_into()
        .map_err(|_| StoreError::corrupt(format!("{what} is not a 32-byte hash")))
}

fn utf8(bytes: Vec<u8>, what: &str) -> StoreResult<String> {
    String::from_utf8(bytes).map_err(|_| StoreError::corrupt(format!("{what} is not UTF-8")))
}

/// An index has no rows of its own to carry: the import rebuilds it.
fn rebuilt_not_carried(table: Table) -> StoreError {
    StoreError::other(format!(
        "table {} is an index the import rebuilds; it has no rows to export",
        table.name()
    ))
}

/// Calls `each` for every row of `table` in key order.
type Sink<'a> = &'a mut dyn FnMut(Row) -> StoreResult<()>;

impl Rx {
    /// How many rows a carried table holds (for progress).
    pub fn carried_rows(&self, table: Table) -> StoreResult<u64> {
        // An export reads a stopped store or a snapshot, never the live
        // one (whose rows since the last checkpoint may be in its log).
        if !self.has_table(table)? {
            return Ok(0);
        }
        let txn = &self.txn;
        Ok(match table {
            Table::Meta => {
                // Less the redo log's key, which `dump` leaves out.
                let meta = txn.open_table(META)?;
                meta.len()? - u64::from(meta.get(super::redo::KEY_KEY)?.is_some())
            }
            Table::Sources => txn.open_table(SOURCES)?.len()?,
            Table::DescribeCache => txn.open_table(DESCRIBE_CACHE)?.len()?,
            Table::Deployments => txn.open_table(DEPLOYMENTS)?.len()?,
            Table::Builds => txn.open_table(BUILDS)?.len()?,
            Table::BuildSnapshots => txn.open_table(BUILD_SNAPSHOTS)?.len()?,
            Table::LogChunks => txn.open_table(LOG_CHUNKS)?.len()?,
            Table::BuildEvents => txn.open_table(BUILD_EVENTS)?.len()?,
            // Only its events are carried (the other parts are indexes):
            // counted one by one, as redb counts only whole tables.
            Table::DeploymentRows => {
                let mut events = 0;
                for entry in txn.open_table(DEPLOYMENT_ROWS)?.iter()? {
                    if entry?.0.value().1 == Part::Event as u8 {
                        events += 1;
                    }
                }
                events
            }
            Table::Callbacks => txn.open_table(CALLBACKS)?.len()?,
            Table::Idempotency => txn.open_table(IDEMPOTENCY)?.len()?,
            Table::UpdateTries => txn.open_table(UPDATE_TRIES)?.len()?,
            Table::SbomComponents => txn.open_table(SBOM_COMPONENTS)?.len()?,
            Table::SbomNodes => txn.open_table(SBOM_NODES)?.len()?,
            Table::AuditEvents => txn.open_table(AUDIT_EVENTS)?.len()?,
            Table::MerkleNodes => txn.open_table(MERKLE_NODES)?.len()?,
            Table::Webhooks => txn.open_table(WEBHOOKS)?.len()?,
            Table::WebhookDeliveries => txn.open_table(WEBHOOK_DELIVERIES)?.len()?,
            Table::Tokens => txn.open_table(TOKENS)?.len()?,
            Table::Attempts => txn.open_table(ATTEMPTS)?.len()?,
            Table::WorkStates => txn.open_table(WORK_STATES)?.len()?,
            Table::WorkStateBlobs => txn.open_table(WORK_STATE_BLOBS)?.len()?,
            Table::WorkStatePieces => txn.open_table(WORK_STATE_PIECES)?.len()?,
            Table::Rollouts => txn.open_table(ROLLOUTS)?.len()?,
            Table::RolloutPolicies => txn.open_table(ROLLOUT_POLICIES)?.len()?,
            Table::Freezes => txn.open_table(FREEZES)?.len()?,
            Table::RolloutResults => txn.open_table(ROLLOUT_RESULTS)?.len()?,
            Table::Nodes => txn.open_table(NODES)?.len()?,
            Table::Queued
            | Table::Running
            | Table::LogIndex
            | Table::IdempotencyExpiry
            | Table::AuditByActor
            | Table::WebhookQueue => return Err(rebuilt_not_carried(table)),
        })
    }

    /// Whether the file has `table` (a store from before it has not, and
    /// a file only `berth serve` opened creates every table).
    fn has_table(&self, table: Table) -> StoreResult<bool> {
        use redb::TableHandle;
        Ok(self.txn.list_tables()?.any(|t| t.name() == table.name()))
    }

    /// Every row of the carried `table`, in key order, to `each`.
    ///
    /// One arm per carried table: the match is exhaustive on purpose (a
    /// new table does not compile until it is decided here), so its length
    /// is the number of tables, not logic to follow.
    pub fn dump(&self, table: Table, each: Sink<'_>) -> StoreResult<()> {
        if !self.has_table(table)? {
            return Ok(());
        }
        let txn = &self.txn;
        match table {
            Table::Meta => {
                for entry in txn.open_table(META)?.iter()? {
                    let (k, v) = entry?;
                    if k.value() == super::redo::KEY_KEY {
                        // The redo log's record key is the store's own
                        // secret: an export never carries it, and an
                        // imported store makes its own at its first start.
                        continue;
                    }
                    each(Row::Meta {
                        key: k.value().to_string(),
                        value: v.value().to_vec(),
                    })?;
                }
            }
            Table::Sources => {
                for entry in txn.open_table(SOURCES)?.iter()? {
                    each(Row::Source(decode(entry?.1.value())?))?;
                }
            }
            Table::DescribeCache => {
                for entry in txn.open_table(DESCRIBE_CACHE)?.iter()? {
                    let (k, v) = entry?;
                    each(Row::Describe {
                        digest: k.value().to_string(),
                        json: utf8(v.value().to_vec(), "a cached describe")?,
                    })?;
                }
            }
            Table::Deployments => {
                for entry in txn.open_table(DEPLOYMENTS)?.iter()? {
                    each(Row::Deployment(Box::new(decode(entry?.1.value())?)))?;
                }
            }
            Table::Builds => {
                for entry in txn.open_table(BUILDS)?.iter()? {
                    each(Row::Build(Box::new(decode(entry?.1.value())?)))?;
                }
            }
            Table::BuildSnapshots => {
                for entry in txn.open_table(BUILD_SNAPSHOTS)?.iter()? {
                    let (k, v) = entry?;
                    each(Row::Snapshots {
                        build: k.value(),
                        snapshots: Box::new(decode(v.value())?),
                    })?;
                }
            }
            Table::LogChunks => {
                for entry in txn.open_table(LOG_CHUNKS)?.iter()? {
                    let (k, v) = entry?;
                    let (build, number) = k.value();
                    let (first_line, compressed) = split_chunk_row(v.value())?;
                    each(Row::LogChunk {
                        build,
                        number,
                        first_line,
                        text: decompress(compressed)?,
                    })?;
                }
            }
            Table::BuildEvents => {
                for entry in txn.open_table(BUILD_EVENTS)?.iter()? {
                    let (k, v) = entry?;
                    let (build, seq) = k.value();
                    each(Row::BuildEvent {
                        build,
                        seq,
                        event: decode(v.value())?,
                    })?;
                }
            }
            Table::DeploymentRows => {
                for entry in txn.open_table(DEPLOYMENT_ROWS)?.iter()? {
                    let (k, v) = entry?;
                    let (deployment, part, number) = k.value();
                    match Part::of(part) {
                        Some(Part::Event) => each(Row::DeploymentEvent {
                            deployment: deployment.to_string(),
                            seq: super::row_seq(number)?,
                            event: decode(v.value())?,
                        })?,
                        // Indexes: the import writes them again.
                        Some(Part::Build | Part::Audit) => {}
                        None => {
                            return Err(StoreError::corrupt(
                                "a deployment row of a kind no berth writes",
                            ))
                        }
                    }
                }
            }
            Table::Callbacks => {
                for entry in txn.open_table(CALLBACKS)?.iter()? {
                    let (k, v) = entry?;
                    each(Row::Callback {
                        build: k.value(),
                        callback: decode(v.value())?,
                    })?;
                }
            }
            Table::Idempotency => {
                for entry in txn.open_table(IDEMPOTENCY)?.iter()? {
                    let (k, v) = entry?;
                    each(Row::Idempotency {
                        identity: k.value().to_string(),
                        record: decode(v.value())?,
                    })?;
                }
            }
            Table::UpdateTries => {
                for entry in txn.open_table(UPDATE_TRIES)?.iter()? {
                    let (k, v) = entry?;
                    each(Row::UpdateTry {
                        deployment: k.value().to_string(),
                        record: decode(v.value())?,
                    })?;
                }
            }
            Table::SbomComponents => {
                for entry in txn.open_table(SBOM_COMPONENTS)?.iter()? {
                    let (k, v) = entry?;
                    let (refs, compressed) = split_component_row(v.value())?;
                    each(Row::Component {
                        hash: hash32(k.value(), "a component key")?,
                        refs,
                        text: decompress(compressed)?,
                    })?;
                }
            }
            Table::SbomNodes => {
                for entry in txn.open_table(SBOM_NODES)?.iter()? {
                    let (k, v) = entry?;
                    let (deployment, node) = k.value();
                    let mut sbom: NodeSbom = decode(v.value())?;
                    if !sbom.skeleton.is_empty() {
                        sbom.skeleton = decompress(&sbom.skeleton)?;
                    }
                    each(Row::SbomNode {
                        deployment: deployment.to_string(),
                        node: node.to_string(),
                        sbom,
                    })?;
                }
            }
            Table::AuditEvents => {
                for entry in txn.open_table(AUDIT_EVENTS)?.iter()? {
                    let (k, v) = entry?;
                    let (hash, canonical) = v
                        .value()
                        .split_at_checked(32)
                        .ok_or_else(|| StoreError::corrupt("an audit row without its hash"))?;
                    each(Row::Audit {
                        seq: k.value(),
                        hash: hash32(hash, "an audit row's hash")?,
                        canonical: canonical.to_vec(),
                    })?;
                }
            }
            Table::MerkleNodes => {
                for entry in txn.open_table(MERKLE_NODES)?.iter()? {
                    let (k, v) = entry?;
                    let (level, index) = k.value();
                    each(Row::MerkleNode {
                        level,
                        index,
                        hash: hash32(v.value(), "a Merkle node")?,
                    })?;
                }
            }
            Table::Webhooks => {
                for entry in txn.open_table(WEBHOOKS)?.iter()? {
                    let (k, v) = entry?;
                    each(Row::Webhook {
                        id: k.value(),
                        record: decode(v.value())?,
                    })?;
                }
            }
            Table::WebhookDeliveries => {
                for entry in txn.open_table(WEBHOOK_DELIVERIES)?.iter()? {
                    let (k, v) = entry?;
                    let (webhook, id) = k.value();
                    each(Row::Delivery {
                        webhook,
                        id,
                        record: decode(v.value())?,
                    })?;
                }
            }
            Table::Tokens => {
                for entry in txn.open_table(TOKENS)?.iter()? {
                    let (k, v) = entry?;
                    each(Row::Token {
                        hash: k.value().to_string(),
                        record: decode(v.value())?,
                    })?;
                }
            }
            Table::Attempts => {
                for entry in txn.open_table(ATTEMPTS)?.iter()? {
                    each(Row::Attempt(decode(entry?.1.value())?))?;
                }
            }
            Table::WorkStates => {
                for entry in txn.open_table(WORK_STATES)?.iter()? {
                    let (k, v) = entry?;
                    each(Row::WorkStates {
                        deployment: k.value().to_string(),
                        record: decode(v.value())?,
                    })?;
                }
            }
            Table::WorkStateBlobs => {
                for entry in txn.open_table(WORK_STATE_BLOBS)?.iter()? {
                    let (k, v) = entry?;
                    each(Row::WorkStateBlob {
                        digest: k.value().to_string(),
                        record: decode(v.value())?,
                    })?;
                }
            }
            Table::WorkStatePieces => {
                for entry in txn.open_table(WORK_STATE_PIECES)?.iter()? {
                    let (k, v) = entry?;
                    let (digest, n) = k.value();
                    each(Row::WorkStatePiece {
                        digest: digest.to_string(),
                        n,
                        bytes: v.value().to_vec(),
                    })?;
                }
            }
            Table::Rollouts => {
                for entry in txn.open_table(ROLLOUTS)?.iter()? {
                    each(Row::Rollout(decode(entry?.1.value())?))?;
                }
            }
            Table::RolloutPolicies => {
                for entry in txn.open_table(ROLLOUT_POLICIES)?.iter()? {
                    let (k, v) = entry?;
                    each(Row::RolloutPolicy {
                        deployment: k.value().to_string(),
                        text: utf8(v.value().to_vec(), "a rollout policy")?,
                    })?;
                }
            }
            Table::Freezes => {
                for entry in txn.open_table(FREEZES)?.iter()? {
                    let (k, v) = entry?;
                    each(Row::Freeze {
                        key: k.value().to_string(),
                        record: decode(v.value())?,
                    })?;
                }
            }
            Table::RolloutResults => {
                for entry in txn.open_table(ROLLOUT_RESULTS)?.iter()? {
                    let (k, v) = entry?;
                    each(Row::RolloutResult {
                        build: k.value(),
                        bytes: v.value().to_vec(),
                    })?;
                }
            }
            Table::Nodes => {
                for entry in txn.open_table(NODES)?.iter()? {
                    each(Row::Node(Box::new(decode(entry?.1.value())?)))?;
                }
            }
            Table::Queued
            | Table::Running
            | Table::LogIndex
            | Table::IdempotencyExpiry
            | Table::AuditByActor
            | Table::WebhookQueue => return Err(rebuilt_not_carried(table)),
        }
        Ok(())
    }
}

/// A new store file filled from rows in one write transaction. Nothing is
/// visible under the store's name until the caller moves the finished file
/// there (`finish` makes it durable first).
pub struct Loader {
    db: Database,
    txn: WriteTransaction,
    /// The build whose log chunks are being loaded, and the byte offset its
    /// next chunk starts at (for the rebuilt `log_index`).
    log_position: Option<(BuildId, u64)>,
}

impl Loader {
    /// Creates the file at `path`, which must not exist.
    pub fn create(path: &Path) -> StoreResult<Loader> {
        if path.exists() {
            return Err(StoreError::other(format!(
                "{} already exists; remove it (an interrupted import leaves it behind)",
                path.display()
            )));
        }
        let db = super::writer::open_database(
            path,
            super::Sharing::LiveReaders,
            super::CacheSize::DEFAULT,
        )?;
        // Every table exists, as in a store `berth serve` made.
        super::init_schema(&db)?;
        let txn = db.begin_write()?;
        Ok(Loader {
            db,
            txn,
            log_position: None,
        })
    }

    /// Writes one row and the index entries it implies.
    ///
    /// One arm per kind of row: the match is exhaustive on purpose (a
    /// new table does not compile until it is decided here), so its length
    /// is the number of tables, not logic to follow.
    pub fn load(&mut self, row: Row) -> StoreResult<()> {
        let tx = Tx::new(&self.txn, None);
        match row {
            // The new file is in this berth's layout (every index is
            // rebuilt as it loads) and its counts are taken from its own
            // builds at `finish`: the carried values of both are checked or
            // dropped, never copied.
            Row::Meta { key, value } if key == super::layout::VERSION_KEY => {
                let version = <[u8; 4]>::try_from(value.as_slice())
                    .map(u32::from_le_bytes)
                    .map_err(|_| StoreError::corrupt("store_meta.schema_version is not a u32"))?;
                if version > super::LAYOUT_VERSION {
                    return Err(StoreError::other(format!(
                        "the export comes from a store of layout version {version}, newer than \
                         this berth's {}; import it with that berth or a newer one",
                        super::LAYOUT_VERSION
                    )));
                }
            }
            Row::Meta { key, .. } if key == super::BUILD_COUNTS_KEY => {}
            // Never exported; one in a file made by hand is not this
            // store's key, which its first start makes.
            Row::Meta { key, .. } if key == super::redo::KEY_KEY => {}
            Row::Meta { key, value } => {
                self.txn
                    .open_table(META)?
                    .insert(key.as_str(), value.as_slice())?;
            }
            Row::Source(s) => tx.put_source(&s)?,
            Row::Describe { digest, json } => tx.put_describe(&digest, &json)?,
            Row::Deployment(d) => tx.put_deployment(&d)?,
            Row::Build(b) => tx.put_build(&b)?,
            Row::Snapshots { build, snapshots } => tx.put_build_snapshots(build, &snapshots)?,
            Row::LogChunk {
                build,
                number,
                first_line,
                text,
            } => {
                let first_byte = match self.log_position {
                    Some((b, offset)) if b == build => offset,
                    _ => 0,
                };
                let raw_len = text.len() as u64;
                let place = ChunkPlace {
                    number,
                    first_line,
                    first_byte,
                    raw_len,
                };
                tx.put_log_chunk(build, &place, &compress(&text)?)?;
                self.log_position = Some((build, first_byte + raw_len));
            }
            Row::BuildEvent { build, seq, event } => tx.put_build_event(build, seq, &event)?,
            Row::DeploymentEvent {
                deployment,
                seq,
                event,
            } => tx.put_deployment_event(&deployment, seq, &event)?,
            Row::Callback { build, callback } => tx.put_callback(build, &callback)?,
            Row::Idempotency { identity, record } => tx.put_idempotency(&identity, &record)?,
            Row::UpdateTry { deployment, record } => tx.put_update_try(&deployment, &record)?,
            Row::Webhook { id, record } => tx.put_webhook(id, &record)?,
            // The due index is rebuilt from the row (`put_delivery`).
            Row::Delivery {
                webhook,
                id,
                record,
            } => tx.put_delivery(webhook, id, &record)?,
            Row::Token { hash, record } => tx.put_token(&hash, &record)?,
            Row::Attempt(record) => tx.put_attempt(&record)?,
            Row::WorkStates { deployment, record } => tx.put_work_states(&deployment, &record)?,
            Row::WorkStateBlob { digest, record } => {
                super::codec::with_encoded(&record, |bytes| {
                    self.txn
                        .open_table(WORK_STATE_BLOBS)?
                        .insert(digest.as_str(), bytes)
                        .map(drop)
                        .map_err(StoreError::from)
                })?;
            }
            Row::Rollout(record) => tx.put_rollout(&record)?,
            Row::RolloutPolicy { deployment, text } => {
                tx.put_rollout_policy(&deployment, Some(&text))?
            }
            Row::Freeze { key, record } => tx.put_freeze(&key, Some(&record))?,
            Row::RolloutResult { build, bytes } => tx.put_rollout_result_bytes(build, &bytes)?,
            Row::Node(record) => tx.put_node(&record)?,
            Row::WorkStatePiece { digest, n, bytes } => {
                self.txn
                    .open_table(WORK_STATE_PIECES)?
                    .insert((digest.as_str(), n), bytes.as_slice())?;
            }
            Row::Component { hash, refs, text } => {
                let row = component_row(refs, &compress(&text)?);
                self.txn
                    .open_table(SBOM_COMPONENTS)?
                    .insert(hash.as_slice(), row.as_slice())?;
            }
            Row::SbomNode {
                deployment,
                node,
                mut sbom,
            } => {
                if !sbom.skeleton.is_empty() {
                    sbom.skeleton = compress(&sbom.skeleton)?;
                }
                tx.put_sbom_node(&deployment, &node, &sbom)?;
            }
            Row::Audit {
                seq,
                hash,
                canonical,
            } => {
                let mut row = Vec::with_capacity(32 + canonical.len());
                row.extend_from_slice(&hash);
                row.extend_from_slice(&canonical);
                let event = chain::decode_row(&row)
                    .map_err(|_| StoreError::corrupt("an audit row is not an event"))?;
                if event.seq != seq {
                    return Err(StoreError::corrupt(
                        "an audit row's seq differs from its event's",
                    ));
                }
                self.txn
                    .open_table(AUDIT_EVENTS)?
                    .insert(seq, row.as_slice())?;
                // The same entries `Tx::append_audit` writes.
                if let (Some(d), false) = (&event.deployment, event.result == AuditResult::Denied) {
                    self.txn
                        .open_table(DEPLOYMENT_ROWS)?
                        .insert(Part::Audit.key(d, seq.into()), EMPTY)?;
                }
                if let Some(actor) = &event.actor {
                    self.txn
                        .open_table(AUDIT_BY_ACTOR)?
                        .insert((actor.key().as_str(), seq), [].as_slice())?;
                }
            }
            Row::MerkleNode { level, index, hash } => {
                self.txn
                    .open_table(MERKLE_NODES)?
                    .insert((level, index), hash.as_slice())?;
            }
        }
        Ok(())
    }

    /// Writes `meta` entries last (over any the rows carried), commits
    /// durably and closes the file.
    pub fn finish(self, meta: &[(&str, Vec<u8>)]) -> StoreResult<()> {
        {
            // An export of a layout before 10 carries every level of the
            // audit tree; this layout keeps the small subtrees only for a
            // pruned prefix.
            super::layout::drop_computable_subtrees(&self.txn)?;
            let counts = super::count_builds(&self.txn)?;
            let mut table = self.txn.open_table(META)?;
            table.insert(
                super::layout::VERSION_KEY,
                super::LAYOUT_VERSION.to_le_bytes().as_slice(),
            )?;
            table.insert(
                super::BUILD_COUNTS_KEY,
                super::encode_counts(&counts).as_slice(),
            )?;
            for (key, value) in meta {
                table.insert(*key, value.as_slice())?;
            }
        }
        self.txn.commit()?;
        self.db.close()?;
        Ok(())
    }
}

/// `meta` keys of a store made by an import: where from (never with a
/// password) and when. `serve --import-from` reads them to import once.
pub const IMPORTED_FROM_KEY: &str = "imported_from";
pub const IMPORTED_AT_KEY: &str = "imported_at";

/// What an import needs to know of an existing store before replacing it.
#[derive(Debug, Clone, Default)]
pub struct Inspection {
    /// Any deployment, build or audit event.
    pub holds_state: bool,
    /// Where an earlier import came from (`meta`), if the store was made by one.
    pub imported_from: Option<String>,
    pub imported_at: Option<String>,
}

/// Opens the store at `path` for writing, which fails while a `berth serve`
/// holds it (an import must not swap a file from under a running server),
/// and reads what an import decides on.
pub fn inspect(path: &Path) -> StoreResult<Inspection> {
    let db = super::redb_builder(
        redb::ConcurrencyMode::SingleWriter,
        super::CacheSize::DEFAULT,
    )
    .create(path)
    .map_err(|e| match e {
        redb::DatabaseError::DatabaseAlreadyOpen => StoreError::in_use(path),
        other => StoreError::from(other),
    })?;
    let rx = Rx {
        txn: redb::ReadableDatabase::begin_read(&db)?,
    };
    let holds_state = rx.carried_rows(Table::Deployments)? > 0
        || rx.carried_rows(Table::Builds)? > 0
        || rx.carried_rows(Table::AuditEvents)? > 0;
    let text = |key: &str| -> StoreResult<Option<String>> {
        match rx.txn.open_table(META) {
            Ok(meta) => Ok(meta
                .get(key)?
                .map(|v| String::from_utf8_lossy(v.value()).into_owned())),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    };
    Ok(Inspection {
        holds_state,
        imported_from: text(IMPORTED_FROM_KEY)?,
        imported_at: text(IMPORTED_AT_KEY)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::TableHandle as _;

    /// A new store's file holds exactly the tables `Table::ALL` lists.
    #[test]
    fn a_new_store_holds_exactly_the_listed_tables() {
        let dir = std::env::temp_dir().join(format!("berth-dump-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("berth.redb");
        let store = super::super::Store::open(&path).unwrap();
        store.close().unwrap();
        drop(store);
        let db = Database::open(&path).unwrap();
        let rx = redb::ReadableDatabase::begin_read(&db).unwrap();
        let mut on_disk: Vec<String> = rx
            .list_tables()
            .unwrap()
            .map(|t| t.name().to_string())
            .collect();
        on_disk.sort();
        let mut listed: Vec<String> = Table::ALL.iter().map(|t| t.name().to_string()).collect();
        listed.sort();
        assert_eq!(on_disk, listed, "Table::ALL and the file disagree");
        let _ = std::fs::remove_dir_all(dir);
    }
}
