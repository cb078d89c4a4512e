//! The keyed records that both a write job and a reader look up, written
//! once for both transactions: `Tx` and `Rx` differ only in how they open
//! a table.
//!
//! `open`'s bound names the store's own kinds of open table
//! (`logged::Keep`), so that a write job's lookup reads the table its
//! batch keeps open; only the store calls `open` (the rest of berth calls
//! the lookups), hence the lint allowed here.
#![allow(private_bounds)]

use redb::{ReadableTable, TableDefinition};

use super::logged::{Keep, Open};
use super::tables::*;
use super::view::Rows;
use super::{decode, DeliveryRecord, IdempotencyRecord, StoreResult, WebhookRecord};
use crate::model::{
    AttemptRecord, BuildId, BuildKind, BuildRecord, BuildSnapshots, BuildStatus, DeploymentRecord,
    FreezeRecord, NodeRecord, NodeSbom, RolloutRecord, Source, TokenRecord, UpdateTry,
    WorkStateBlob, WorkStates,
};

/// A table of encoded records.
type RecordTable<K> = TableDefinition<'static, K, &'static [u8]>;

/// Lookups of single records by key, in a read or a write transaction.
pub trait Lookup {
    /// Opens `table` for reading in this transaction, as it sees it.
    fn open<K: redb::Key + 'static>(
        &self,
        table: RecordTable<K>,
    ) -> StoreResult<Rows<'_, K, &'static [u8], impl ReadableTable<K, &'static [u8]> + '_>>
    where
        for<'t> Open<'t>: Keep<'t, K, &'static [u8]>;

    fn deployment(&self, id: &str) -> StoreResult<Option<DeploymentRecord>> {
        self.open(DEPLOYMENTS)?.record(id)
    }

    fn build(&self, id: BuildId) -> StoreResult<Option<BuildRecord>> {
        self.open(BUILDS)?.record(id)
    }

    fn build_snapshots(&self, id: BuildId) -> StoreResult<Option<BuildSnapshots>> {
        self.open(BUILD_SNAPSHOTS)?.record(id)
    }

    fn source(&self, digest: &str) -> StoreResult<Option<Source>> {
        self.open(SOURCES)?.record(digest)
    }

    fn update_try(&self, deployment: &str) -> StoreResult<Option<UpdateTry>> {
        self.open(UPDATE_TRIES)?.record(deployment)
    }

    /// A deployment's SBOM nodes, by node name.
    fn sbom_nodes(&self, deployment: &str) -> StoreResult<Vec<(String, NodeSbom)>> {
        let t = self.open(SBOM_NODES)?;
        let mut out = Vec::new();
        for entry in t.range((deployment, "")..)? {
            let (k, v) = entry?;
            let (dep, node) = k.value();
            if dep != deployment {
                break;
            }
            out.push((node.to_string(), decode(v.value())?));
        }
        Ok(out)
    }

    /// A node bound to an agent (agents.md).
    fn node(&self, deployment: &str, node: &str) -> StoreResult<Option<NodeRecord>> {
        self.open(NODES)?.record((deployment, node))
    }

    /// Up to `limit` nodes after `after` (deployment, node) in key order,
    /// only `deployment`'s when it is given.
    fn nodes(
        &self,
        deployment: Option<&str>,
        after: Option<(&str, &str)>,
        limit: usize,
    ) -> StoreResult<Vec<NodeRecord>> {
        let t = self.open(NODES)?;
        let start = after.unwrap_or((deployment.unwrap_or(""), ""));
        let mut out = Vec::new();
        for entry in t.range(start..)? {
            let (k, v) = entry?;
            let key = k.value();
            if after == Some(key) {
                continue;
            }
            if deployment.is_some_and(|d| d != key.0) || out.len() >= limit {
                break;
            }
            out.push(decode(v.value())?);
        }
        Ok(out)
    }

    fn webhook(&self, id: u128) -> StoreResult<Option<WebhookRecord>> {
        self.open(WEBHOOKS)?.record(id)
    }

    /// Every subscription, oldest first (at most `--max-webhooks`).
    fn webhooks(&self) -> StoreResult<Vec<(u128, WebhookRecord)>> {
        let t = self.open(WEBHOOKS)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (k, v) = entry?;
            out.push((k.value(), decode(v.value())?));
        }
        Ok(out)
    }

    fn delivery(&self, webhook: u128, id: u128) -> StoreResult<Option<DeliveryRecord>> {
        self.open_deliveries()?.record((webhook, id))
    }

    /// A subscription's deliveries, newest first, older than `before`,
    /// at most `limit`.
    fn deliveries(
        &self,
        webhook: u128,
        before: Option<u128>,
        limit: usize,
    ) -> StoreResult<Vec<(u128, DeliveryRecord)>> {
        let t = self.open_deliveries()?;
        let end = before.unwrap_or(u128::MAX);
        let mut out = Vec::new();
        for entry in t.range((webhook, 0u128)..(webhook, end))?.rev() {
            let (k, v) = entry?;
            out.push((k.value().1, decode(v.value())?));
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    /// Opens the deliveries table (its key is a pair).
    #[allow(clippy::type_complexity)]
    fn open_deliveries(
        &self,
    ) -> StoreResult<
        Rows<'_, (u128, u128), &'static [u8], impl ReadableTable<(u128, u128), &'static [u8]> + '_>,
    > {
        self.open(WEBHOOK_DELIVERIES)
    }

    /// The token whose secret has this SHA-256 (hex).
    fn token(&self, hash: &str) -> StoreResult<Option<TokenRecord>> {
        self.open(TOKENS)?.record(hash)
    }

    /// Every worker and agent token with its hash, in hash order (at most
    /// `--max-workers` and `--max-agents`).
    fn tokens(&self) -> StoreResult<Vec<(String, TokenRecord)>> {
        let t = self.open(TOKENS)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (k, v) = entry?;
            out.push((k.value().to_string(), decode(v.value())?));
        }
        Ok(out)
    }

    fn attempt(&self, build: BuildId, fence: u64) -> StoreResult<Option<AttemptRecord>> {
        self.open(ATTEMPTS)?.record((build, fence))
    }

    /// A build's newest attempt (the one with the highest fence).
    fn last_attempt(&self, build: BuildId) -> StoreResult<Option<AttemptRecord>> {
        let t = self.open(ATTEMPTS)?;
        let newest = t.range((build, 0u64)..=(build, u64::MAX))?.next_back();
        match newest {
            Some(entry) => Ok(Some(decode(entry?.1.value())?)),
            None => Ok(None),
        }
    }

    /// The freeze under `key` (`GLOBAL_FREEZE` or a deployment id).
    fn freeze(&self, key: &str) -> StoreResult<Option<FreezeRecord>> {
        self.open(FREEZES)?.record(key)
    }

    /// Every freeze with its key.
    fn freezes(&self) -> StoreResult<Vec<(String, FreezeRecord)>> {
        let t = self.open(FREEZES)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (k, v) = entry?;
            out.push((k.value().to_string(), decode(v.value())?));
        }
        Ok(out)
    }

    /// The global freeze's `ETag` counter (0 before the first set).
    fn freeze_etag(&self) -> StoreResult<u64> {
        let meta = self.open(META)?;
        let Some(v) = meta.get(super::FREEZE_ETAG_KEY)? else {
            return Ok(0);
        };
        let bytes: [u8; 8] = v
            .value()
            .try_into()
            .map_err(|_| super::StoreError::corrupt("a freeze ETag that is not 8 bytes"))?;
        Ok(u64::from_le_bytes(bytes))
    }

    /// A build's rollout; `None` for a build without one.
    fn rollout(&self, build: BuildId) -> StoreResult<Option<RolloutRecord>> {
        self.open(ROLLOUTS)?.record(build)
    }

    /// A rollout build's deploy result as the engine stored it with the
    /// plan; `None` once the build finished.
    fn rollout_result<T: serde::de::DeserializeOwned>(
        &self,
        build: BuildId,
    ) -> StoreResult<Option<T>>
    where
        Self: Sized,
    {
        self.open(ROLLOUT_RESULTS)?.record(build)
    }

    /// A deployment's rollout policy as given (JSON text); `None`: `{}`.
    fn rollout_policy(&self, deployment: &str) -> StoreResult<Option<String>> {
        match self.open(ROLLOUT_POLICIES)?.get(deployment)? {
            Some(v) => String::from_utf8(v.value().to_vec())
                .map(Some)
                .map_err(|_| super::StoreError::corrupt("a rollout policy that is not UTF-8")),
            None => Ok(None),
        }
    }

    /// A deployment's work states; `None` before its first remote claim.
    fn work_states(&self, deployment: &str) -> StoreResult<Option<WorkStates>> {
        self.open(WORK_STATES)?.record(deployment)
    }

    fn work_state_blob(&self, digest: &str) -> StoreResult<Option<WorkStateBlob>> {
        self.open(WORK_STATE_BLOBS)?.record(digest)
    }

    /// A stored archive's bytes, decompressed; `None` when none has that
    /// digest.
    fn work_state_archive(&self, digest: &str) -> StoreResult<Option<Vec<u8>>> {
        let Some(blob) = self.work_state_blob(digest)? else {
            return Ok(None);
        };
        let pieces = self.open(WORK_STATE_PIECES)?;
        let mut compressed = Vec::with_capacity(usize::try_from(blob.stored_bytes).unwrap_or(0));
        for n in 0..blob.pieces {
            let Some(piece) = pieces.get((digest, n))? else {
                return Err(super::StoreError::corrupt(
                    "a work state without one of its pieces",
                ));
            };
            compressed.extend_from_slice(piece.value());
        }
        let tar = super::compress::decompress(&compressed)?;
        if tar.len() as u64 != blob.size {
            return Err(super::StoreError::corrupt(
                "a work state of another size than recorded",
            ));
        }
        Ok(Some(tar))
    }

    /// The compressed bytes of every stored archive (`berth_work_state_bytes`).
    fn work_state_bytes(&self) -> StoreResult<u64> {
        let t = self.open(WORK_STATE_BLOBS)?;
        let mut total = 0u64;
        for entry in t.iter()? {
            let blob: WorkStateBlob = decode(entry?.1.value())?;
            total = total.saturating_add(blob.stored_bytes);
        }
        Ok(total)
    }

    fn idempotency(&self, key: &str) -> StoreResult<Option<IdempotencyRecord>> {
        self.open(IDEMPOTENCY)?.record(key)
    }

    /// Whether `target` may be rolled back to (lifecycle.md "Rollback"):
    /// a succeeded deploy build of `d` with no successful destroy of `d`
    /// after it (a destroy ends the deployment's history as rollback
    /// targets, so an id given to someone else never restores the last
    /// owner's configuration). Reads the builds after it, at most
    /// `--keep-builds`.
    fn is_rollback_target(&self, d: &DeploymentRecord, target: BuildId) -> StoreResult<bool> {
        let builds = self.open(BUILDS)?;
        match builds.record::<BuildRecord>(target)? {
            Some(b)
                if b.deployment == d.id
                    && b.kind == BuildKind::Deploy
                    && b.status == BuildStatus::Succeeded => {}
            Some(_) | None => return Ok(false),
        }
        let index = self.open(DEPLOYMENT_ROWS)?;
        let after =
            Part::Build.key(&d.id, target.saturating_add(1))..=Part::Build.key(&d.id, BuildId::MAX);
        for entry in index.range(after)? {
            let id = entry?.0.value().2;
            if let Some(b) = builds.record::<BuildRecord>(id)? {
                if b.kind == BuildKind::Destroy && b.status == BuildStatus::Succeeded {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// The newest succeeded deploy build of `d` older than its deployed
    /// one and newer than its last successful destroy: what a rollback
    /// without a target returns to (lifecycle.md "Rollback"). Reads builds
    /// newest first, at most `--keep-builds`.
    fn rollback_target(&self, d: &DeploymentRecord) -> StoreResult<Option<BuildId>> {
        let Some(deployed) = &d.deployed else {
            return Ok(None);
        };
        let index = self.open(DEPLOYMENT_ROWS)?;
        let builds = self.open(BUILDS)?;
        let range = Part::Build.key(&d.id, 0)..Part::Build.key(&d.id, deployed.build_id);
        for entry in index.range(range)?.rev() {
            let (k, _) = entry?;
            let id = k.value().2;
            let Some(b) = builds.record::<BuildRecord>(id)? else {
                continue;
            };
            match (b.kind, b.status) {
                (BuildKind::Deploy, BuildStatus::Succeeded) => return Ok(Some(id)),
                // History before a destroy is not the deployment's now.
                (BuildKind::Destroy, BuildStatus::Succeeded) => return Ok(None),
                _ => {}
            }
        }
        Ok(None)
    }
}

impl Lookup for super::Tx<'_, '_> {
    /// The table the batch keeps open (or opens and keeps): a lookup
    /// closing it to open one of its own cost two opens and two closes.
    fn open<K: redb::Key + 'static>(
        &self,
        table: RecordTable<K>,
    ) -> StoreResult<Rows<'_, K, &'static [u8], impl ReadableTable<K, &'static [u8]> + '_>>
    where
        for<'t> Open<'t>: Keep<'t, K, &'static [u8]>,
    {
        Ok(Rows::stored(self.table(table)?))
    }
}

impl Lookup for super::Rx {
    fn open<K: redb::Key + 'static>(
        &self,
        table: RecordTable<K>,
    ) -> StoreResult<Rows<'_, K, &'static [u8], impl ReadableTable<K, &'static [u8]> + '_>>
    where
        for<'t> Open<'t>: Keep<'t, K, &'static [u8]>,
    {
        self.rows(table)
    }
}
