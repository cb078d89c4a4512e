//! Layout versions: what each version of the store file holds, and the
//! migrations from one to the next (storage.md "Layout versions").
//!
//! Why it exists: indexes and counters used to be added by a presence check
//! and a backfill at open, with the version left at 1. An older binary then
//! opened a newer file and silently skipped the index, and the read path
//! kept branches for "a record stored before the index". Here the version
//! in `meta` changes with every change of layout; opening an older file
//! runs each migration in order, each in its own write transaction that
//! also records the version it reaches (a crash between two leaves a file
//! at a version berth knows); a file newer than the binary is refused with
//! both versions named. The readers can then trust every index.
//!
//! An import writes a new file directly at the current version (it
//! rebuilds every index as it loads: `dump::Loader`).
//!
//! The history:
//!
//! | version | change |
//! |---|---|
//! | 1 | the first layout |
//! | 2 | `log_index`: where each log chunk sits (line, byte, length) |
//! | 3 | `idempotency_expiry`: idempotency records by expiry |
//! | 4 | `meta.build_counts`: builds by status, for `/metrics` |
//! | 6 | an idempotency record holds its identity part by part (the export needs them apart) |
//! | 5 | safe deploys: a build's `rollback_of` and `log_gaps`, a deployment's `auto_rollback` and its deployed nodes' fingerprints (every build and deployment record rewritten) |
//! | 7 | webhooks: `webhooks`, `webhook_deliveries` and their `webhook_due` index (new tables, empty) |
//! | 8 | a redo log beside a store held alone (no row changes) |
//! | 9 | `deployment_rows`: a deployment's builds index, channel events and audit index in one table (the three tables before it removed) |
//! | 10 | `merkle_nodes` keeps subtrees of 8 audit events and up (`store::tables::STORED_FROM_LEVEL`); the smaller ones are computed from the events, except a pruned prefix's |
//! | 11 | `webhook_queue`: the pending deliveries by subscription, then by when they are due (`webhook_due`, by time first, removed), so one subscription's backlog never hides another's |
//! | 12 | `tokens`, `attempts`: worker tokens and build attempts (new tables, empty) |
//! | 13 | `work_states`, `work_state_blobs`, `work_state_pieces`: deployments' work states (new tables, empty) |
//! | 14 | `rollouts`, `rollout_policies`, `freezes`: rollouts in waves, each deployment's policy, freezes (new tables, empty) |
//! | 15 | a build's `log_holes` (every build record rewritten) and `rollout_results` (new, empty): a rollout goes on after a restart |
//! | 16 | a token's `node`: an agent token's binding (every token record rewritten); a freeze whose daily window was stored without its `day` (layouts 14 and 15 skipped it) written again with it |
//! | 17 | `nodes`: nodes bound to agents, their documents and reports (new table, empty) |
//!
//! Releases before version 2 existed wrote version 1 but may already hold
//! any of the later indexes (they were added by presence checks), so each
//! migration rebuilds its index from the rows it indexes rather than
//! assume it is absent. Every migration is tested on the store file in
//! `tests/data/store-v1` (written by the last release that wrote version 1)
//! and on a store whose index was removed; the steps from 8 also on
//! `tests/data/store-v8-crashed`, a store of layout 8 killed with most of
//! its rows still in its redo log, and the step to 10 also on
//! `tests/data/store-v9-crashed`, the same of layout 9 (its log holds the
//! small audit subtrees that step drops).
//!
//! A redo log is written at the layout of its berth. A berth applies a log
//! of an older layout from `OLDEST_LOG_LAYOUT` on (its rows may name tables
//! that layout had, `Retired` keeps their definitions) to a file still at
//! that layout, and only then migrates; a log older than that is refused at
//! open with the advice to run the berth that wrote it once
//! (`redo::replay`).

use redb::{Database, ReadableTable, ReadableTableMetadata, WriteTransaction};

use super::compress::decompress;
use super::tables::*;
use super::{
    decode, encode_counts, split_chunk_row, ChunkPlace, IdempotencyIdentity, IdempotencyRecord,
    StoreError, StoreResult, BUILD_COUNTS_KEY,
};
use crate::model::BuildId;

/// The layout this binary writes and reads.
pub const LAYOUT_VERSION: u32 = 17;

/// The `meta` key holding the layout version (u32 LE). Its name predates
/// the word "layout" and stays, so every release finds it.
pub const VERSION_KEY: &str = "schema_version";

/// One step of the history: it takes a file at `to - 1` to `to`.
struct Migration {
    to: u32,
    /// What it does, for the log line at open.
    what: &'static str,
    run: fn(&WriteTransaction) -> StoreResult<()>,
}

/// Every migration, in order; `MIGRATIONS[i].to == i + 2`.
const MIGRATIONS: [Migration; 16] = [
    Migration {
        to: 2,
        what: "index every build's log chunks",
        run: index_log_chunks,
    },
    Migration {
        to: 3,
        what: "index idempotency records by expiry",
        run: index_idempotency_expiry,
    },
    Migration {
        to: 4,
        what: "count builds by status",
        run: count_builds_by_status,
    },
    Migration {
        to: 5,
        what: "add rollbacks and health checks to build and deployment records",
        run: records_for_safe_deploys,
    },
    Migration {
        to: 6,
        what: "keep each idempotency record's identity part by part",
        run: idempotency_identities,
    },
    Migration {
        to: 7,
        what: "add the webhook tables",
        run: webhook_tables,
    },
    Migration {
        to: 8,
        what: "allow a redo log beside the store",
        run: redo_log_beside,
    },
    Migration {
        to: 9,
        what: "file each deployment's builds, events and audit index in one table",
        run: deployment_rows_in_one_table,
    },
    Migration {
        to: 10,
        what: "keep only the audit tree's subtrees of 8 events and up",
        run: audit_subtrees_from_level_3,
    },
    Migration {
        to: 11,
        what: "queue each webhook subscription's pending deliveries by when they are due",
        run: webhook_queue_by_subscription,
    },
    Migration {
        to: 12,
        what: "add the tables of worker tokens and build attempts",
        run: worker_tables,
    },
    Migration {
        to: 13,
        what: "add the tables of deployments' work states",
        run: work_state_tables,
    },
    Migration {
        to: 14,
        what: "add the tables of rollouts, rollout policies and freezes",
        run: rollout_tables,
    },
    Migration {
        to: 15,
        what: "let a rollout go on after a restart (log holes, deploy results)",
        run: rollouts_after_a_restart,
    },
    Migration {
        to: 16,
        what: "bind agent tokens to a node; repair freezes with a daily window",
        run: tokens_bound_and_freezes_repaired,
    },
    Migration {
        to: 17,
        what: "add the table of nodes bound to agents",
        run: node_table,
    },
];

/// The tables a layout removed, with the definitions they had, so a redo
/// log written at the layout before (whose rows name them) can still be
/// applied to a file of that layout before it migrates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retired {
    /// Until layout 8: (deployment id, build id) -> ().
    DeploymentBuilds,
    /// Until layout 8: (deployment id, seq) -> `StoredEvent`.
    DeploymentEvents,
    /// Until layout 8: (deployment id, audit seq) -> empty.
    AuditByDeployment,
    /// Layouts 7 to 10: (next attempt ms, webhook id, delivery id) -> ().
    WebhookDue,
}

mod v8 {
    use redb::TableDefinition;

    use super::Retired;

    pub const DEPLOYMENT_BUILDS: TableDefinition<(&str, u128), ()> =
        TableDefinition::new(Retired::DeploymentBuilds.name());
    pub const DEPLOYMENT_EVENTS: TableDefinition<(&str, u64), &[u8]> =
        TableDefinition::new(Retired::DeploymentEvents.name());
    pub const AUDIT_BY_DEPLOYMENT: TableDefinition<(&str, u64), &[u8]> =
        TableDefinition::new(Retired::AuditByDeployment.name());
}

mod v10 {
    use redb::TableDefinition;

    use super::Retired;

    pub const WEBHOOK_DUE: TableDefinition<(i64, u128, u128), ()> =
        TableDefinition::new(Retired::WebhookDue.name());
}

/// The oldest layout whose redo log this berth applies (to a file still
/// at that layout, before it migrates). Logs of older layouts are refused:
/// layout 8 was the first with a redo log at all, and each step since is
/// known to keep the tables and keys a log of its layout names (layout 9
/// retired three and layout 11 one, `Retired`; layout 10 changed no table).
pub const OLDEST_LOG_LAYOUT: u32 = 8;

/// A table a redo record names: one of this layout's, or one the layout
/// the log was written at had and this one removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoggedTable {
    Current(Table),
    Retired(Retired),
}

impl Retired {
    /// The tables a log of layout 8 may name that later layouts removed.
    const AFTER_8: [Retired; 4] = [
        Retired::DeploymentBuilds,
        Retired::DeploymentEvents,
        Retired::AuditByDeployment,
        Retired::WebhookDue,
    ];
    /// The table a log of layout 9 or 10 may name that layout 11 removed.
    const AFTER_10: [Retired; 1] = [Retired::WebhookDue];

    /// Whether a redo log of `layout` can be applied by this berth (to a
    /// file of that layout, before it migrates).
    pub fn replayable(layout: u32) -> bool {
        (OLDEST_LOG_LAYOUT..=LAYOUT_VERSION).contains(&layout)
    }

    /// The table named `name` in a redo log of `layout`: one of today's,
    /// or one that layout had and a later one removed.
    pub fn named(layout: u32, name: &[u8]) -> Option<LoggedTable> {
        let retired: &[Retired] = match layout {
            8 => &Retired::AFTER_8,
            9 | 10 => &Retired::AFTER_10,
            _ => &[],
        };
        if let Some(r) = retired.iter().find(|r| r.name().as_bytes() == name) {
            return Some(LoggedTable::Retired(*r));
        }
        Table::ALL
            .into_iter()
            .find(|t| t.name().as_bytes() == name)
            .map(LoggedTable::Current)
    }

    pub const fn name(self) -> &'static str {
        match self {
            Retired::DeploymentBuilds => "deployment_builds",
            Retired::DeploymentEvents => "deployment_events",
            Retired::AuditByDeployment => "audit_by_deployment",
            Retired::WebhookDue => "webhook_due",
        }
    }

    /// Runs `each` with the table's definition (as `Table::visit`).
    pub fn visit<E: EachTable>(self, each: &mut E) -> E::Output {
        match self {
            Retired::DeploymentBuilds => each.with(v8::DEPLOYMENT_BUILDS),
            Retired::DeploymentEvents => each.with(v8::DEPLOYMENT_EVENTS),
            Retired::AuditByDeployment => each.with(v8::AUDIT_BY_DEPLOYMENT),
            Retired::WebhookDue => each.with(v10::WEBHOOK_DUE),
        }
    }
}

/// v9: `deployment_rows` takes the rows of `deployment_builds`,
/// `deployment_events` and `audit_by_deployment` (keys widened, values as
/// they were), and those three go.
fn deployment_rows_in_one_table(txn: &WriteTransaction) -> StoreResult<()> {
    // The rows go in in the new table's key order (deployment by
    // deployment: its builds, its events, its audit index), so each insert
    // appends to the last leaf: table by table, the events would land
    // between the builds already there and split every leaf on the way
    // (a store of a million events grew its file fourfold that way).
    let builds = txn.open_table(v8::DEPLOYMENT_BUILDS)?;
    let events = txn.open_table(v8::DEPLOYMENT_EVENTS)?;
    let audit = txn.open_table(v8::AUDIT_BY_DEPLOYMENT)?;
    let mut parts = [
        OldRows::new(
            Part::Build,
            Box::new(builds.iter()?.map(|entry| {
                let (k, _) = entry?;
                let (deployment, build) = k.value();
                Ok((deployment.to_string(), build, Vec::new()))
            })),
        )?,
        OldRows::new(Part::Event, seq_rows(&events)?)?,
        // Its values are empty, as they stay.
        OldRows::new(Part::Audit, seq_rows(&audit)?)?,
    ];
    let mut rows = txn.open_table(DEPLOYMENT_ROWS)?;
    let before = rows.len()?;
    let mut moved = 0u64;
    // The smallest deployment any old table has left, until none has.
    while let Some(deployment) = parts
        .iter()
        .filter_map(|p| p.head.as_ref().map(|(d, _, _)| d.clone()))
        .min()
    {
        for part in parts.iter_mut() {
            while let Some((_, number, value)) = part.next_of(&deployment)? {
                rows.insert(part.part.key(&deployment, number), value.as_slice())?;
                moved += 1;
            }
        }
    }
    assert_eq!(
        rows.len()?,
        before + moved,
        "each moved row has a key of its own"
    );
    drop(rows);
    drop(parts);
    drop((builds, events, audit));
    txn.delete_table(v8::DEPLOYMENT_BUILDS)?;
    txn.delete_table(v8::DEPLOYMENT_EVENTS)?;
    txn.delete_table(v8::AUDIT_BY_DEPLOYMENT)?;
    Ok(())
}

/// The rows of an old table keyed (deployment, seq), values as stored.
fn seq_rows<'t>(
    table: &'t redb::Table<'_, (&'static str, u64), &'static [u8]>,
) -> StoreResult<OldRowsIter<'t>> {
    Ok(Box::new(table.iter()?.map(|entry| {
        let (k, v) = entry?;
        let (deployment, seq) = k.value();
        Ok((deployment.to_string(), seq.into(), v.value().to_vec()))
    })))
}

/// A row of an old table: (deployment, number, value).
type OldRow = (String, u128, Vec<u8>);

/// One old table's rows in key order.
type OldRowsIter<'t> = Box<dyn Iterator<Item = StoreResult<OldRow>> + 't>;

/// One old table's rows in key order, with the next one read ahead.
struct OldRows<'t> {
    part: Part,
    rows: OldRowsIter<'t>,
    head: Option<OldRow>,
}

impl<'t> OldRows<'t> {
    fn new(part: Part, mut rows: OldRowsIter<'t>) -> StoreResult<Self> {
        let head = rows.next().transpose()?;
        Ok(OldRows { part, rows, head })
    }

    /// The next row if it is `deployment`'s.
    fn next_of(&mut self, deployment: &str) -> StoreResult<Option<OldRow>> {
        if self.head.as_ref().is_none_or(|(d, _, _)| d != deployment) {
            return Ok(None);
        }
        let next = self.rows.next().transpose()?;
        Ok(std::mem::replace(&mut self.head, next))
    }
}

/// v10: the audit tree's subtrees below `STORED_FROM_LEVEL` go, but for
/// those of a pruned prefix (their events are gone); readers compute them
/// from the events.
fn audit_subtrees_from_level_3(txn: &WriteTransaction) -> StoreResult<()> {
    drop_computable_subtrees(txn)
}

/// Removes the stored subtrees below `STORED_FROM_LEVEL` that are not
/// inside the pruned prefix: the layout-10 migration (a store of an older
/// layout stored every level) and an import (an export of an older layout
/// carries them). The ones inside the prefix are its compact range's, kept
/// because their events are gone.
pub(super) fn drop_computable_subtrees(txn: &WriteTransaction) -> StoreResult<()> {
    let prefix = match txn.open_table(META)?.get(ANCHOR_KEY)? {
        Some(v) => {
            let anchor: crate::audit::Anchor = serde_json::from_slice(v.value())
                .map_err(|_| StoreError::corrupt("meta.audit_anchor is not an anchor"))?;
            anchor.first_seq.saturating_sub(1)
        }
        None => 0,
    };
    let mut nodes = txn.open_table(MERKLE_NODES)?;
    for level in 0..STORED_FROM_LEVEL {
        // A subtree ends inside the prefix when its last leaf does:
        // (index + 1) << level <= prefix.
        let first_outside = prefix >> level;
        nodes.retain_in((level, first_outside)..=(level, u64::MAX), |_, _| false)?;
    }
    Ok(())
}

/// v8: a store held alone (then `--exclusive-store`, now the default) keeps a redo log,
/// `berth.redo`, whose rows are part of the store until a checkpoint puts
/// them into the file. No row changes; the version stops a berth that does
/// not know the log from opening the store and missing them.
fn redo_log_beside(_txn: &WriteTransaction) -> StoreResult<()> {
    Ok(())
}

/// v7: the webhook tables, empty (the open creates every table of today;
/// this step makes the version say so, and adds the due index of then).
fn webhook_tables(txn: &WriteTransaction) -> StoreResult<()> {
    for table in [Table::Webhooks, Table::WebhookDeliveries] {
        table.create(txn)?;
    }
    txn.open_table(v10::WEBHOOK_DUE)?;
    Ok(())
}

/// v11: `webhook_queue` takes the rows of `webhook_due` with the key
/// reordered (subscription first), and `webhook_due` goes.
fn webhook_queue_by_subscription(txn: &WriteTransaction) -> StoreResult<()> {
    let due = txn.open_table(v10::WEBHOOK_DUE)?;
    let mut queue = txn.open_table(WEBHOOK_QUEUE)?;
    for entry in due.iter()? {
        let (at, webhook, delivery) = entry?.0.value();
        queue.insert((webhook, at, delivery), ())?;
    }
    assert_eq!(queue.len()?, due.len()?, "each due row has a queue row");
    drop((due, queue));
    txn.delete_table(v10::WEBHOOK_DUE)?;
    Ok(())
}

/// v12: the worker tables, empty (the open creates every table of today;
/// this step makes the version say so).
fn worker_tables(_txn: &WriteTransaction) -> StoreResult<()> {
    Ok(())
}

/// v13: the work state tables, empty (as v12).
fn work_state_tables(_txn: &WriteTransaction) -> StoreResult<()> {
    Ok(())
}

/// v14: the rollout tables, empty (as v12).
fn rollout_tables(_txn: &WriteTransaction) -> StoreResult<()> {
    Ok(())
}

/// v17: `nodes` is new (created empty by the open, as every table).
fn node_table(_txn: &WriteTransaction) -> StoreResult<()> {
    Ok(())
}

/// v15: every build record gains `log_holes` (read in its layout-14
/// shape, `v14`, and written in the current one); `rollout_results` is
/// new and empty.
fn rollouts_after_a_restart(txn: &WriteTransaction) -> StoreResult<()> {
    use crate::store::codec;
    let mut builds = txn.open_table(BUILDS)?;
    let mut rewritten: Vec<(u128, Vec<u8>)> = Vec::new();
    for entry in builds.iter()? {
        let (k, v) = entry?;
        let old: v14::BuildRecord = decode(v.value())?;
        rewritten.push((k.value(), codec::encode(&old.into_current())));
    }
    for (id, bytes) in &rewritten {
        builds.insert(*id, bytes.as_slice())?;
    }
    Ok(())
}

/// v16: every token record gains `node` (read in its layout-15 shape,
/// `v15`, and written in the current one).
fn tokens_bound_and_freezes_repaired(txn: &WriteTransaction) -> StoreResult<()> {
    use crate::store::codec;
    let mut tokens = txn.open_table(TOKENS)?;
    let mut rewritten: Vec<(String, Vec<u8>)> = Vec::new();
    for entry in tokens.iter()? {
        let (k, v) = entry?;
        let old: v15::TokenRecord = decode(v.value())?;
        rewritten.push((k.value().to_string(), codec::encode(&old.into_current())));
    }
    for (hash, bytes) in &rewritten {
        tokens.insert(hash.as_str(), bytes.as_slice())?;
    }
    let mut freezes = txn.open_table(FREEZES)?;
    let mut repaired: Vec<(String, Vec<u8>)> = Vec::new();
    for entry in freezes.iter()? {
        let (k, v) = entry?;
        if decode::<crate::model::FreezeRecord>(v.value()).is_ok() {
            continue;
        }
        let old: v15::FreezeRecord = decode(v.value())?;
        repaired.push((k.value().to_string(), codec::encode(&old.into_current())));
    }
    for (key, bytes) in &repaired {
        freezes.insert(key.as_str(), bytes.as_slice())?;
    }
    Ok(())
}

/// The token record as layouts 12 to 15 stored it (read by the migration
/// to 16).
mod v15 {
    use serde::{Deserialize, Serialize};

    use crate::model::{Millis, TokenKind, WorkerSeen};

    #[derive(Deserialize, Serialize)]
    pub struct TokenRecord {
        pub name: String,
        pub kind: TokenKind,
        pub labels: Vec<String>,
        pub created_at: Millis,
        pub seen: Option<WorkerSeen>,
    }

    /// A freeze with a daily window as layouts 14 and 15 stored it: the
    /// window's `day` skipped (a weekly or monthly one reads as current).
    #[derive(Deserialize, Serialize)]
    pub struct FreezeRecord {
        pub reason: String,
        pub until: Option<Millis>,
        pub window: Option<DailyWindow>,
        pub set_at: Millis,
        pub set_by: Option<String>,
    }

    #[derive(Deserialize, Serialize)]
    pub struct DailyWindow {
        pub frequency: crate::model::Frequency,
        pub start: String,
        pub duration_minutes: u32,
        pub time_zone: String,
    }

    impl FreezeRecord {
        pub fn into_current(self) -> crate::model::FreezeRecord {
            crate::model::FreezeRecord {
                reason: self.reason,
                until: self.until,
                window: self.window.map(|w| crate::model::FreezeWindow {
                    frequency: w.frequency,
                    day: None,
                    start: w.start,
                    duration_minutes: w.duration_minutes,
                    time_zone: w.time_zone,
                }),
                set_at: self.set_at,
                set_by: self.set_by,
            }
        }
    }

    impl TokenRecord {
        pub fn into_current(self) -> crate::model::TokenRecord {
            crate::model::TokenRecord {
                name: self.name,
                kind: self.kind,
                labels: self.labels,
                created_at: self.created_at,
                seen: self.seen,
                node: None,
            }
        }
    }
}

/// The version a file records; `None` for a file berth never opened.
pub(super) fn recorded_version(txn: &WriteTransaction) -> StoreResult<Option<u32>> {
    let meta = txn.open_table(META)?;
    let Some(bytes) = meta.get(VERSION_KEY)?.map(|v| v.value().to_vec()) else {
        return Ok(None);
    };
    <[u8; 4]>::try_from(bytes.as_slice())
        .map(|b| Some(u32::from_le_bytes(b)))
        .map_err(|_| StoreError::corrupt("meta.schema_version is not a u32"))
}

fn record_version(txn: &WriteTransaction, version: u32) -> StoreResult<()> {
    txn.open_table(META)?
        .insert(VERSION_KEY, version.to_le_bytes().as_slice())?;
    Ok(())
}

/// Brings the file to `LAYOUT_VERSION`: creates a new file at it, migrates
/// an older one step by step, refuses a newer one. Every table exists
/// afterwards, so readers never meet a missing one.
pub fn open_layout(db: &Database) -> StoreResult<()> {
    let txn = db.begin_write()?;
    let found = recorded_version(&txn)?;
    let Some(mut version) = found else {
        // A new file: every table, empty counts, the current version.
        for table in Table::ALL {
            table.create(&txn)?;
        }
        txn.open_table(META)?
            .insert(BUILD_COUNTS_KEY, encode_counts(&[0; 5]).as_slice())?;
        record_version(&txn, LAYOUT_VERSION)?;
        txn.commit()?;
        return Ok(());
    };
    if version > LAYOUT_VERSION {
        return Err(StoreError::corrupt(format!(
            "the store has layout version {version}, newer than this berth's {LAYOUT_VERSION}; \
             run the berth that wrote it (or a newer one), or export with it and import here"
        )));
    }
    if version == 0 {
        return Err(StoreError::corrupt(
            "the store records layout version 0, which no berth writes",
        ));
    }
    drop(txn);
    let found = version;
    for step in MIGRATIONS.iter().filter(|m| m.to > found) {
        assert_eq!(step.to, version + 1, "migrations are listed in order");
        tracing::info!(
            from = version,
            to = step.to,
            "migrating the store: {}",
            step.what
        );
        let mut txn = db.begin_write()?;
        // As a checkpoint's commit: a crash before the next one finds
        // redb's allocator state saved (quick repair).
        txn.set_quick_repair(true);
        for table in Table::ALL {
            table.create(&txn)?;
        }
        (step.run)(&txn)?;
        record_version(&txn, step.to)?;
        txn.commit()?;
        version = step.to;
    }
    assert_eq!(version, LAYOUT_VERSION, "every migration ran");
    // A file at the current version still gets any table it lacks (an
    // empty one an older import did not write). Only then is there a
    // commit: a start on a full disk must not need to write the file.
    let txn = db.begin_write()?;
    let present: std::collections::HashSet<String> = txn
        .list_tables()?
        .map(|t| redb::TableHandle::name(&t).to_string())
        .collect();
    if Table::ALL.iter().all(|t| present.contains(t.name())) {
        txn.abort()?;
        return Ok(());
    }
    for table in Table::ALL {
        table.create(&txn)?;
    }
    txn.commit()?;
    Ok(())
}

/// Version 2: `log_index`. A build whose index rows do not match its chunks
/// one for one gets them again, from the chunks themselves (each is
/// decompressed once, for its length).
fn index_log_chunks(txn: &WriteTransaction) -> StoreResult<()> {
    let chunks = txn.open_table(LOG_CHUNKS)?;
    let mut index = txn.open_table(LOG_INDEX)?;
    let mut build: Option<BuildId> = None;
    let mut places: Vec<ChunkPlace> = Vec::new();
    let mut flush = |build: BuildId, places: &mut Vec<ChunkPlace>| -> StoreResult<()> {
        let mut same = 0usize;
        for entry in index.range((build, 0u32)..=(build, u32::MAX))? {
            let (k, v) = entry?;
            let (_, number) = k.value();
            let stored = ChunkPlace::decode(number, v.value());
            if stored.as_ref() == places.get(same) {
                same += 1;
            } else {
                same = usize::MAX;
                break;
            }
        }
        if same != places.len() {
            index.retain_in((build, 0u32)..=(build, u32::MAX), |_, _| false)?;
            for place in places.iter() {
                index.insert((build, place.number), place.encode().as_slice())?;
            }
        }
        places.clear();
        Ok(())
    };
    let mut next_byte = 0u64;
    for entry in chunks.iter()? {
        let (k, v) = entry?;
        let (id, number) = k.value();
        if build != Some(id) {
            if let Some(done) = build {
                flush(done, &mut places)?;
            }
            build = Some(id);
            next_byte = 0;
        }
        let (first_line, compressed) = split_chunk_row(v.value())?;
        let raw_len = decompress(compressed)?.len() as u64;
        places.push(ChunkPlace {
            number,
            first_line,
            first_byte: next_byte,
            raw_len,
        });
        next_byte += raw_len;
    }
    if let Some(done) = build {
        flush(done, &mut places)?;
    }
    Ok(())
}

/// Version 3: `idempotency_expiry`, rebuilt from the records.
fn index_idempotency_expiry(txn: &WriteTransaction) -> StoreResult<()> {
    let records = txn.open_table(IDEMPOTENCY)?;
    let mut expiry = txn.open_table(IDEMPOTENCY_EXPIRY)?;
    expiry.retain(|_, _| false)?;
    for entry in records.iter()? {
        let (k, v) = entry?;
        let r: v5::IdempotencyRecord = decode(v.value())?;
        expiry.insert((r.expires_at, k.value()), ())?;
    }
    assert_eq!(expiry.len()?, records.len()?, "one expiry row per record");
    Ok(())
}

/// Version 4: `meta.build_counts`, counted from the builds (read in their
/// version-4 shape: each migration reads the layout it starts from).
fn count_builds_by_status(txn: &WriteTransaction) -> StoreResult<()> {
    let mut counts = [0u64; 5];
    for entry in txn.open_table(BUILDS)?.iter()? {
        let (_, v) = entry?;
        let b: v4::BuildRecord = decode(v.value())?;
        counts[b.status() as usize] += 1;
    }
    txn.open_table(META)?
        .insert(BUILD_COUNTS_KEY, encode_counts(&counts).as_slice())?;
    Ok(())
}

/// Version 5: every build and deployment record gains the fields of safe
/// deploys. bincode has no field names, so each record is read in its
/// version-4 shape (`v4`) and written in the current one.
fn records_for_safe_deploys(txn: &WriteTransaction) -> StoreResult<()> {
    use crate::store::codec;
    let mut builds = txn.open_table(BUILDS)?;
    let mut rewritten: Vec<(u128, Vec<u8>)> = Vec::new();
    for entry in builds.iter()? {
        let (k, v) = entry?;
        let old: v4::BuildRecord = decode(v.value())?;
        rewritten.push((k.value(), codec::encode(&old.into_v14())));
    }
    for (id, bytes) in &rewritten {
        builds.insert(*id, bytes.as_slice())?;
    }
    let mut deployments = txn.open_table(DEPLOYMENTS)?;
    let mut rewritten: Vec<(String, Vec<u8>)> = Vec::new();
    for entry in deployments.iter()? {
        let (k, v) = entry?;
        let old: v4::DeploymentRecord = decode(v.value())?;
        rewritten.push((k.value().to_string(), codec::encode(&old.into_current()?)));
    }
    for (id, bytes) in &rewritten {
        deployments.insert(id.as_str(), bytes.as_slice())?;
    }
    Ok(())
}

/// Version 6: each idempotency record gains its identity, parsed from its
/// key (the route and the key never hold U+0000: they are its last parts).
fn idempotency_identities(txn: &WriteTransaction) -> StoreResult<()> {
    use crate::store::codec;
    let mut records = txn.open_table(IDEMPOTENCY)?;
    let mut rewritten: Vec<(String, Vec<u8>)> = Vec::new();
    for entry in records.iter()? {
        let (k, v) = entry?;
        let old: v5::IdempotencyRecord = decode(v.value())?;
        let identity = IdempotencyIdentity::parse(k.value())
            .ok_or_else(|| StoreError::corrupt("an idempotency key that is not an identity"))?;
        let record = IdempotencyRecord {
            fingerprint: old.fingerprint,
            status: old.status,
            content_type: old.content_type,
            body: old.body,
            headers: old.headers,
            expires_at: old.expires_at,
            identity,
        };
        rewritten.push((k.value().to_string(), codec::encode(&record)));
    }
    for (key, bytes) in &rewritten {
        records.insert(key.as_str(), bytes.as_slice())?;
    }
    Ok(())
}

/// The idempotency record as layouts 1 to 5 stored it.
mod v5 {
    use serde::{Deserialize, Serialize};

    #[derive(Deserialize, Serialize)]
    pub struct IdempotencyRecord {
        pub fingerprint: Vec<u8>,
        pub status: u16,
        pub content_type: String,
        pub body: Vec<u8>,
        pub headers: Vec<(String, String)>,
        pub expires_at: crate::model::Millis,
    }
}

/// The build record as layouts 5 to 14 stored it (read by the migration to
/// 15; the migration to 5 writes it).
mod v14 {
    use serde::{Deserialize, Serialize};

    use crate::model::{self as current, *};

    #[derive(Deserialize, Serialize)]
    pub struct BuildRecord {
        pub id: BuildId,
        pub deployment: String,
        pub kind: BuildKind,
        pub trigger: Trigger,
        pub status: BuildStatus,
        pub suspended: bool,
        pub method: String,
        pub created_at: Millis,
        pub started_at: Option<Millis>,
        pub finished_at: Option<Millis>,
        pub exit_code: Option<i32>,
        pub failure: Option<Failure>,
        pub job: Option<Job>,
        pub log_bytes: u64,
        pub log_lines: u64,
        pub log_chunks: u32,
        pub event_seq: u64,
        pub seq_reserved: u64,
        pub log_first_seq: u64,
        pub rollback_of: Option<BuildId>,
        pub log_gaps: Vec<u64>,
    }

    impl BuildRecord {
        pub fn into_current(self) -> current::BuildRecord {
            current::BuildRecord {
                id: self.id,
                deployment: self.deployment,
                kind: self.kind,
                trigger: self.trigger,
                status: self.status,
                suspended: self.suspended,
                method: self.method,
                created_at: self.created_at,
                started_at: self.started_at,
                finished_at: self.finished_at,
                exit_code: self.exit_code,
                failure: self.failure,
                job: self.job,
                log_bytes: self.log_bytes,
                log_lines: self.log_lines,
                log_chunks: self.log_chunks,
                event_seq: self.event_seq,
                seq_reserved: self.seq_reserved,
                log_first_seq: self.log_first_seq,
                rollback_of: self.rollback_of,
                log_gaps: self.log_gaps,
                log_holes: Vec::new(),
            }
        }
    }
}

/// The records as layout 4 stored them (read by the migration to 5 only).
mod v4 {
    use serde::Deserialize;

    use crate::model::{self as current, *};
    use crate::store::StoreError;

    #[derive(Deserialize)]
    pub struct BuildRecord {
        id: BuildId,
        deployment: String,
        kind: BuildKind,
        trigger: Trigger,
        status: BuildStatus,
        suspended: bool,
        method: String,
        created_at: Millis,
        started_at: Option<Millis>,
        finished_at: Option<Millis>,
        exit_code: Option<i32>,
        failure: Option<Failure>,
        job: Option<Job>,
        log_bytes: u64,
        log_lines: u64,
        log_chunks: u32,
        event_seq: u64,
        seq_reserved: u64,
        log_first_seq: u64,
    }

    impl BuildRecord {
        pub fn status(&self) -> BuildStatus {
            self.status
        }

        pub fn into_v14(self) -> super::v14::BuildRecord {
            super::v14::BuildRecord {
                id: self.id,
                deployment: self.deployment,
                kind: self.kind,
                trigger: self.trigger,
                status: self.status,
                suspended: self.suspended,
                method: self.method,
                created_at: self.created_at,
                started_at: self.started_at,
                finished_at: self.finished_at,
                exit_code: self.exit_code,
                failure: self.failure,
                job: self.job,
                log_bytes: self.log_bytes,
                log_lines: self.log_lines,
                log_chunks: self.log_chunks,
                event_seq: self.event_seq,
                seq_reserved: self.seq_reserved,
                log_first_seq: self.log_first_seq,
                rollback_of: None,
                log_gaps: Vec::new(),
            }
        }
    }

    #[derive(Deserialize)]
    struct Deployed {
        build_id: BuildId,
        snapshot: Snapshot,
        method: String,
        finished_at: Millis,
    }

    #[derive(Deserialize)]
    pub struct DeploymentRecord {
        id: String,
        revision: u64,
        suspended: bool,
        method: String,
        domain: Option<String>,
        snapshot: Snapshot,
        /// JSON text inside the record, as `model` stores it.
        update_policy: String,
        deployed: Option<Deployed>,
        last_build: Option<BuildId>,
        last_finished: Option<LastFinished>,
        pending_deploys: u32,
        pending_destroys: u32,
        running: Option<BuildId>,
        event_seq: u64,
        created_at: Millis,
        updated_at: Millis,
    }

    impl DeploymentRecord {
        pub fn into_current(self) -> Result<current::DeploymentRecord, StoreError> {
            // Written by `model`'s own encoder: text that does not read
            // back is damage, and stops the migration (nothing is written).
            let update_policy: UpdatePolicy = serde_json::from_str(&self.update_policy)
                .map_err(|_| StoreError::corrupt("a stored update policy does not parse"))?;
            Ok(current::DeploymentRecord {
                id: self.id,
                revision: self.revision,
                suspended: self.suspended,
                method: self.method,
                domain: self.domain,
                snapshot: self.snapshot,
                update_policy,
                deployed: self.deployed.map(|d| current::Deployed {
                    build_id: d.build_id,
                    snapshot: d.snapshot,
                    method: d.method,
                    finished_at: d.finished_at,
                    nodes: Vec::new(),
                }),
                last_build: self.last_build,
                last_finished: self.last_finished,
                pending_deploys: self.pending_deploys,
                pending_destroys: self.pending_destroys,
                running: self.running,
                event_seq: self.event_seq,
                created_at: self.created_at,
                updated_at: self.updated_at,
                auto_rollback: true,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{codec, compress::compress};

    fn temp_db(tag: &str) -> (Database, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("berth-layout-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        (Database::create(dir.join("berth.redb")).unwrap(), dir)
    }

    /// The step to 16 repairs a freeze whose daily window layout 15 wrote
    /// without its `day`, and leaves a readable one as it is.
    #[test]
    fn the_step_to_16_repairs_a_daily_freeze_window() {
        let (db, dir) = temp_db("v16-freeze");
        let broken = v15::FreezeRecord {
            reason: "release week".into(),
            until: None,
            window: Some(v15::DailyWindow {
                frequency: crate::model::Frequency::Daily,
                start: "00:00".into(),
                duration_minutes: 15,
                time_zone: "UTC".into(),
            }),
            set_at: 3,
            set_by: None,
        };
        let txn = db.begin_write().unwrap();
        txn.open_table(FREEZES)
            .unwrap()
            .insert("*", crate::store::codec::encode(&broken).as_slice())
            .unwrap();
        assert!(decode::<crate::model::FreezeRecord>(
            txn.open_table(FREEZES)
                .unwrap()
                .get("*")
                .unwrap()
                .unwrap()
                .value()
        )
        .is_err());
        tokens_bound_and_freezes_repaired(&txn).unwrap();
        let read: crate::model::FreezeRecord = decode(
            txn.open_table(FREEZES)
                .unwrap()
                .get("*")
                .unwrap()
                .unwrap()
                .value(),
        )
        .unwrap();
        txn.abort().unwrap();
        let window = read.window.unwrap();
        assert_eq!((window.day, window.duration_minutes), (None, 15));
        assert_eq!(read.reason, "release week");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The step to 16 reads each token in its layout-15 shape and writes
    /// it with `node: None`, keeping everything else.
    #[test]
    fn the_step_to_16_keeps_every_token_and_binds_none() {
        let (db, dir) = temp_db("v16");
        let old = v15::TokenRecord {
            name: "w1".into(),
            kind: crate::model::TokenKind::Worker,
            labels: vec!["gpu".into()],
            created_at: 7,
            seen: None,
        };
        let txn = db.begin_write().unwrap();
        txn.open_table(TOKENS)
            .unwrap()
            .insert("hash", crate::store::codec::encode(&old).as_slice())
            .unwrap();
        tokens_bound_and_freezes_repaired(&txn).unwrap();
        let read: crate::model::TokenRecord = decode(
            txn.open_table(TOKENS)
                .unwrap()
                .get("hash")
                .unwrap()
                .unwrap()
                .value(),
        )
        .unwrap();
        txn.abort().unwrap();
        assert_eq!(
            (read.name.as_str(), read.labels.len(), read.created_at),
            ("w1", 1, 7)
        );
        assert_eq!(read.node, None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn version(db: &Database) -> u32 {
        let txn = db.begin_write().unwrap();
        let v = recorded_version(&txn).unwrap().unwrap();
        txn.abort().unwrap();
        v
    }

    /// A version-1 file whose indexes are missing, partial or wrong gets
    /// each rebuilt from its rows, one transaction per step, and ends at
    /// the current version.
    #[test]
    fn each_migration_rebuilds_its_index_from_the_rows() {
        let (db, dir) = temp_db("rebuild");
        open_layout(&db).unwrap();
        assert_eq!(version(&db), LAYOUT_VERSION);
        let (a, b) = (1u128 << 80, 2u128 << 80);
        let text = |n: usize| "a line of log\n".repeat(n).into_bytes();
        {
            let txn = db.begin_write().unwrap();
            let mut chunks = txn.open_table(LOG_CHUNKS).unwrap();
            // Build a: three chunks; build b: one.
            for (build, number, first_line, lines) in
                [(a, 0u32, 0u64, 3), (a, 1, 3, 5), (a, 2, 8, 1), (b, 0, 0, 2)]
            {
                let mut row = first_line.to_le_bytes().to_vec();
                row.extend(compress(&text(lines)).unwrap());
                chunks.insert((build, number), row.as_slice()).unwrap();
            }
            drop(chunks);
            let mut index = txn.open_table(LOG_INDEX).unwrap();
            // a: a wrong row; b: none at all.
            let wrong = ChunkPlace {
                number: 1,
                first_line: 9,
                first_byte: 9,
                raw_len: 9,
            };
            index.insert((a, 1), wrong.encode().as_slice()).unwrap();
            drop(index);
            let record = v5::IdempotencyRecord {
                fingerprint: vec![1],
                status: 202,
                content_type: "application/json".into(),
                body: b"{}".to_vec(),
                headers: vec![],
                expires_at: 5_000,
            };
            txn.open_table(IDEMPOTENCY)
                .unwrap()
                .insert("service\u{0}/r\u{0}key", codec::encode(&record).as_slice())
                .unwrap();
            txn.open_table(META)
                .unwrap()
                .remove(BUILD_COUNTS_KEY)
                .unwrap();
            record_version(&txn, 1).unwrap();
            txn.commit().unwrap();
        }
        open_layout(&db).unwrap();
        assert_eq!(version(&db), LAYOUT_VERSION);
        let txn = db.begin_write().unwrap();
        let index = txn.open_table(LOG_INDEX).unwrap();
        let places: Vec<(u128, ChunkPlace)> = index
            .iter()
            .unwrap()
            .map(|e| {
                let (k, v) = e.unwrap();
                let (build, number) = k.value();
                (build, ChunkPlace::decode(number, v.value()).unwrap())
            })
            .collect();
        let line = "a line of log\n".len() as u64;
        let place = |number, first_line: u64, first_byte: u64, lines: u64| ChunkPlace {
            number,
            first_line,
            first_byte,
            raw_len: lines * line,
        };
        assert_eq!(
            places,
            vec![
                (a, place(0, 0, 0, 3)),
                (a, place(1, 3, 3 * line, 5)),
                (a, place(2, 8, 8 * line, 1)),
                (b, place(0, 0, 0, 2)),
            ]
        );
        let expiry: Vec<i64> = txn
            .open_table(IDEMPOTENCY_EXPIRY)
            .unwrap()
            .iter()
            .unwrap()
            .map(|e| e.unwrap().0.value().0)
            .collect();
        assert_eq!(expiry, vec![5_000]);
        let idem: IdempotencyRecord = decode(
            txn.open_table(IDEMPOTENCY)
                .unwrap()
                .get("service\u{0}/r\u{0}key")
                .unwrap()
                .unwrap()
                .value(),
        )
        .unwrap();
        assert_eq!(
            (idem.identity.route.as_str(), idem.identity.key.as_str()),
            ("/r", "key")
        );
        assert!(txn
            .open_table(META)
            .unwrap()
            .get(BUILD_COUNTS_KEY)
            .unwrap()
            .is_some());
        drop(index);
        drop(txn);
        drop(db);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Layout 8's three per-deployment tables move into `deployment_rows`
    /// row for row (values as they were, each under its part) and are
    /// gone from the file afterwards.
    #[test]
    fn the_step_to_9_moves_each_deployment_row_under_its_part_and_drops_the_old_tables() {
        let (db, dir) = temp_db("rows");
        open_layout(&db).unwrap();
        let (build_a, build_b) = (1u128 << 80, 2u128 << 80);
        {
            let txn = db.begin_write().unwrap();
            let mut builds = txn.open_table(v8::DEPLOYMENT_BUILDS).unwrap();
            builds.insert(("alpha", build_a), ()).unwrap();
            builds.insert(("alpha", build_b), ()).unwrap();
            builds.insert(("beta", build_a + 1), ()).unwrap();
            drop(builds);
            let mut events = txn.open_table(v8::DEPLOYMENT_EVENTS).unwrap();
            events.insert(("alpha", 1), b"one".as_slice()).unwrap();
            events.insert(("alpha", 2), b"two".as_slice()).unwrap();
            // Deployments only one old table has rows of, first and last.
            events.insert(("aaa", 9), b"nine".as_slice()).unwrap();
            drop(events);
            let mut audit = txn.open_table(v8::AUDIT_BY_DEPLOYMENT).unwrap();
            audit.insert(("beta", 40), EMPTY).unwrap();
            audit.insert(("zeta", 41), EMPTY).unwrap();
            drop(audit);
            record_version(&txn, 8).unwrap();
            txn.commit().unwrap();
        }
        open_layout(&db).unwrap();
        assert_eq!(version(&db), LAYOUT_VERSION);
        let txn = db.begin_write().unwrap();
        let rows: Vec<(String, u8, u128, Vec<u8>)> = txn
            .open_table(DEPLOYMENT_ROWS)
            .unwrap()
            .iter()
            .unwrap()
            .map(|e| {
                let (k, v) = e.unwrap();
                let (d, part, n) = k.value();
                (d.to_string(), part, n, v.value().to_vec())
            })
            .collect();
        let row =
            |d: &str, part: Part, n: u128, v: &[u8]| (d.to_string(), part as u8, n, v.to_vec());
        assert_eq!(
            rows,
            vec![
                row("aaa", Part::Event, 9, b"nine"),
                row("alpha", Part::Build, build_a, b""),
                row("alpha", Part::Build, build_b, b""),
                row("alpha", Part::Event, 1, b"one"),
                row("alpha", Part::Event, 2, b"two"),
                row("beta", Part::Build, build_a + 1, b""),
                row("beta", Part::Audit, 40, b""),
                row("zeta", Part::Audit, 41, b""),
            ]
        );
        let names: Vec<String> = txn
            .list_tables()
            .unwrap()
            .map(|t| redb::TableHandle::name(&t).to_string())
            .collect();
        for gone in Retired::AFTER_8 {
            assert!(
                !names.iter().any(|n| n == gone.name()),
                "{gone:?} is still in the file"
            );
        }
        drop(txn);
        drop(db);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_newer_file_is_refused_naming_both_versions_and_left_as_it_is() {
        let (db, dir) = temp_db("newer");
        open_layout(&db).unwrap();
        let txn = db.begin_write().unwrap();
        record_version(&txn, LAYOUT_VERSION + 1).unwrap();
        txn.commit().unwrap();
        let e = open_layout(&db).unwrap_err().to_string();
        assert!(
            e.contains(&format!("layout version {}", LAYOUT_VERSION + 1)),
            "{e}"
        );
        assert!(e.contains(&format!("this berth's {LAYOUT_VERSION}")), "{e}");
        assert_eq!(version(&db), LAYOUT_VERSION + 1);
        drop(db);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_migrations_are_listed_in_order_and_reach_the_current_layout() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.to as usize, i + 2);
        }
        assert_eq!(MIGRATIONS.last().map(|m| m.to), Some(LAYOUT_VERSION));
    }
}
