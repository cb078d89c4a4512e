//! Typed reads inside a read transaction: a consistent snapshot (MVCC),
//! on the caller's thread.

use redb::ReadTransaction;

use super::tables::*;
use super::view::Rows;
use super::{
    decode, decode_counts, row_seq, split_component_row, ChunkPlace, PendingCallback, StoreError,
    StoreResult, StoredEvent, BUILD_COUNTS_KEY,
};
use crate::model::{BuildId, BuildRecord, DeploymentRecord, NodeSbom};

/// Typed access inside a read transaction: a consistent snapshot (MVCC)
/// that holds every write answered before it began.
pub struct Rx {
    pub(super) txn: ReadTransaction,
}

impl Rx {
    /// Opens `def` for reading.
    pub(super) fn rows<K: redb::Key + 'static, V: redb::Value + 'static>(
        &self,
        def: redb::TableDefinition<'static, K, V>,
    ) -> StoreResult<Rows<'_, K, V, redb::ReadOnlyTable<K, V>>> {
        Ok(Rows::stored(self.txn.open_table(def)?))
    }

    /// Deployments with id > `after`, in id order, at most `limit`.
    pub fn deployments_after(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> StoreResult<Vec<DeploymentRecord>> {
        let t = self.rows(DEPLOYMENTS)?;
        let mut out = Vec::new();
        let iter = match after {
            Some(a) => {
                t.range::<&str>((std::ops::Bound::Excluded(a), std::ops::Bound::Unbounded))?
            }
            None => t.range::<&str>(..)?,
        };
        for entry in iter {
            let (_, v) = entry?;
            out.push(decode(v.value())?);
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    pub fn deployment_count(&self) -> StoreResult<u64> {
        Ok(self.rows(DEPLOYMENTS)?.len()?)
    }

    /// Builds of one deployment older than `before`, newest first.
    pub fn builds_of(
        &self,
        deployment: &str,
        before: Option<BuildId>,
        limit: usize,
    ) -> StoreResult<Vec<BuildRecord>> {
        let index = self.rows(DEPLOYMENT_ROWS)?;
        let builds = self.rows(BUILDS)?;
        let range = match before {
            Some(before) => {
                index.range(Part::Build.key(deployment, 0)..Part::Build.key(deployment, before))?
            }
            None => index.range(Part::Build.all(deployment))?,
        };
        let mut out = Vec::new();
        for entry in range.rev() {
            let (k, _) = entry?;
            let (_, _, id) = k.value();
            if let Some(v) = builds.get(id)? {
                out.push(decode(v.value())?);
            }
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    /// How many builds a deployment has (from the index; nothing decoded).
    pub fn build_count(&self, deployment: &str) -> StoreResult<usize> {
        let index = self.rows(DEPLOYMENT_ROWS)?;
        let mut n = 0;
        for entry in index.range(Part::Build.all(deployment))? {
            entry?;
            n += 1;
        }
        Ok(n)
    }

    /// Every queued build id with its deployment, oldest first.
    pub fn queued(&self) -> StoreResult<Vec<(BuildId, String)>> {
        let t = self.rows(QUEUED)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (k, v) = entry?;
            out.push((k.value(), v.value().to_string()));
        }
        Ok(out)
    }

    pub fn running(&self) -> StoreResult<Vec<(BuildId, String)>> {
        let t = self.rows(RUNNING)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (k, v) = entry?;
            out.push((k.value(), v.value().to_string()));
        }
        Ok(out)
    }

    /// The layout version the file records (`None`: never opened by berth).
    pub fn layout_version(&self) -> StoreResult<Option<u32>> {
        let meta = match self.txn.open_table(META) {
            Ok(meta) => Rows::stored(meta),
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let Some(v) = meta.get(super::layout::VERSION_KEY)? else {
            return Ok(None);
        };
        <[u8; 4]>::try_from(v.value())
            .map(|b| Some(u32::from_le_bytes(b)))
            .map_err(|_| StoreError::corrupt("meta.schema_version is not a u32"))
    }

    /// Every build by status, as kept by each status change.
    pub fn build_status_counts(&self) -> StoreResult<[u64; 5]> {
        match self.rows(META)?.get(BUILD_COUNTS_KEY)? {
            Some(v) => decode_counts(v.value()),
            // Every layout since version 4 has them (`layout`).
            None => Err(StoreError::corrupt("meta.build_counts is missing")),
        }
    }

    /// Where each of a build's `chunks` log chunks sits, in order. Every
    /// chunk is indexed (the layout migration to version 2 indexed the
    /// older ones), so an index that disagrees with the build is damage.
    pub fn log_index(&self, build: BuildId, chunks: u32) -> StoreResult<Vec<ChunkPlace>> {
        let t = self.rows(LOG_INDEX)?;
        let mut out = Vec::with_capacity(chunks as usize);
        for entry in t.range((build, 0u32)..=(build, u32::MAX))? {
            let (k, v) = entry?;
            let place = ChunkPlace::decode(k.value().1, v.value())
                .ok_or_else(|| StoreError::corrupt("a log index row"))?;
            out.push(place);
        }
        let complete = out.len() == chunks as usize
            && out.iter().enumerate().all(|(i, p)| p.number as usize == i);
        if !complete {
            return Err(StoreError::corrupt(format!(
                "the log index of a build holds {} of its {chunks} chunks",
                out.len()
            )));
        }
        Ok(out)
    }

    /// One compressed log chunk (without its header).
    pub fn log_chunk(&self, build: BuildId, number: u32) -> StoreResult<Option<Vec<u8>>> {
        let t = self.rows(LOG_CHUNKS)?;
        let Some(v) = t.get((build, number))? else {
            return Ok(None);
        };
        let body = v
            .value()
            .get(8..)
            .ok_or_else(|| StoreError::corrupt("a log chunk without its header"))?;
        Ok(Some(body.to_vec()))
    }

    /// A build's stored status events, in seq order.
    pub fn build_events(&self, build: BuildId) -> StoreResult<Vec<(u64, StoredEvent)>> {
        let t = self.rows(BUILD_EVENTS)?;
        let mut out = Vec::new();
        for entry in t.range((build, 0u64)..=(build, u64::MAX))? {
            let (k, v) = entry?;
            out.push((k.value().1, decode(v.value())?));
        }
        Ok(out)
    }

    /// A deployment's events with seq > `after`, at most `limit`.
    pub fn deployment_events_after(
        &self,
        deployment: &str,
        after: u64,
        limit: usize,
    ) -> StoreResult<Vec<(u64, StoredEvent)>> {
        let t = self.rows(DEPLOYMENT_ROWS)?;
        let mut out = Vec::new();
        // No event follows the largest seq (a client's cursor may name it).
        let Some(from) = after.checked_add(1) else {
            return Ok(Vec::new());
        };
        for entry in t.range(Part::Event.range(deployment, from.into(), u64::MAX.into()))? {
            let (k, v) = entry?;
            out.push((row_seq(k.value().2)?, decode(v.value())?));
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    /// The oldest kept event seq of a deployment's channel.
    pub fn first_deployment_event(&self, deployment: &str) -> StoreResult<Option<u64>> {
        let t = self.rows(DEPLOYMENT_ROWS)?;
        let first = t.range(Part::Event.all(deployment))?.next().transpose()?;
        first.map(|(k, _)| row_seq(k.value().2)).transpose()
    }

    /// Every deployment id (for sweeps).
    pub fn deployment_ids(&self) -> StoreResult<Vec<String>> {
        let t = self.rows(DEPLOYMENTS)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            out.push(entry?.0.value().to_string());
        }
        Ok(out)
    }

    pub fn describe(&self, digest: &str) -> StoreResult<Option<String>> {
        let t = self.rows(DESCRIBE_CACHE)?;
        let v = t.get(digest)?;
        Ok(v.map(|v| String::from_utf8_lossy(v.value()).into_owned()))
    }

    /// Pending webhook deliveries due at `now`, soonest first, at most
    /// `limit`: (webhook, delivery).
    /// The oldest due delivery of each subscription that has one, as
    /// (webhook, delivery), the subscriptions in turn from the first after
    /// `after` (wrapping round): one seek per subscription (at most
    /// `--max-webhooks`), so no backlog, however long, hides another
    /// subscription's due rows.
    pub fn due_deliveries(&self, now: i64, after: u128) -> StoreResult<Vec<(u128, u128)>> {
        let webhooks = self.rows(WEBHOOKS)?;
        let queue = self.rows(WEBHOOK_QUEUE)?;
        let mut ids = Vec::new();
        for entry in webhooks.iter()? {
            ids.push(entry?.0.value());
        }
        let turn = ids.partition_point(|id| *id <= after);
        ids.rotate_left(turn);
        let mut out = Vec::new();
        for webhook in ids {
            let oldest = queue
                .range((webhook, i64::MIN, 0u128)..=(webhook, now, u128::MAX))?
                .next();
            if let Some(entry) = oldest {
                let (_, _, delivery) = entry?.0.value();
                out.push((webhook, delivery));
            }
        }
        Ok(out)
    }

    /// Pending webhook deliveries (`/metrics`).
    pub fn pending_deliveries(&self) -> StoreResult<u64> {
        Ok(self.rows(WEBHOOK_QUEUE)?.len()?)
    }

    pub fn callbacks(&self) -> StoreResult<Vec<(BuildId, PendingCallback)>> {
        let t = self.rows(CALLBACKS)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (k, v) = entry?;
            out.push((k.value(), decode(v.value())?));
        }
        Ok(out)
    }

    pub fn sbom_node(&self, deployment: &str, node: &str) -> StoreResult<Option<NodeSbom>> {
        self.rows(SBOM_NODES)?
            .get((deployment, node))?
            .map(|v| decode(v.value()))
            .transpose()
    }

    /// Runs `f` on a component's compressed text, without copying it.
    pub fn with_component<R>(
        &self,
        hash: &[u8; 32],
        f: impl FnOnce(&[u8]) -> R,
    ) -> StoreResult<Option<R>> {
        let t = self.rows(SBOM_COMPONENTS)?;
        let Some(row) = t.get(hash.as_slice())? else {
            return Ok(None);
        };
        Ok(Some(f(split_component_row(row.value())?.1)))
    }

    /// A component's compressed text.
    pub fn component(&self, hash: &[u8; 32]) -> StoreResult<Option<Vec<u8>>> {
        let t = self.rows(SBOM_COMPONENTS)?;
        let Some(row) = t.get(hash.as_slice())? else {
            return Ok(None);
        };
        Ok(Some(split_component_row(row.value())?.1.to_vec()))
    }

    /// Whether a component is stored.
    pub fn has_component(&self, hash: &[u8; 32]) -> StoreResult<bool> {
        Ok(self.rows(SBOM_COMPONENTS)?.get(hash.as_slice())?.is_some())
    }

    /// Stored components (distinct, across every deployment).
    pub fn component_count(&self) -> StoreResult<u64> {
        Ok(self.rows(SBOM_COMPONENTS)?.len()?)
    }

    /// Stored components and the bytes they take (compressed, with their
    /// reference counts).
    pub fn component_totals(&self) -> StoreResult<(u64, u64)> {
        let t = self.rows(SBOM_COMPONENTS)?;
        let mut bytes = 0u64;
        for entry in t.iter()? {
            let (k, v) = entry?;
            bytes += (k.value().len() + v.value().len()) as u64;
        }
        Ok((t.len()?, bytes))
    }
}
