//! A store in PostgreSQL (cluster.md): the database every replica shares,
//! and the lease that says which replica writes to it.
//!
//! Why it exists: a machine that holds berth's only copy of its state is a
//! machine berth cannot outlive. With `--store postgres://...` the rows
//! live in the database (one table of redb's own key and value bytes per
//! row, `berth_rows`), and each replica's store file is a cache of them.
//!
//! How a write becomes durable there: a batch's rows (the same rows the
//! redo log takes, `redo::row_ops`) are committed to PostgreSQL first, in
//! one transaction that also checks the lease's fence (`berth_leader`);
//! only then does the batch go on as on a single node (redo log, redb,
//! hooks, answers). A batch PostgreSQL refused changed nothing anywhere.
//!
//! One replica leads at a time: it holds the lease (renewed every third of
//! `--lease-ttl`) and serves; the others wait for it to pass and then take
//! it with a higher fence, load every row into a fresh store file, and
//! serve. Each batch's transaction names the fence it leads with, under
//! the lease row's lock: a batch either commits before a takeover (whose
//! load then holds it) or is refused after it. So the fence alone keeps
//! the store whole; the lease's time only says when another replica may
//! take over. A leader whose lease passed while nobody took it (the
//! database was away) still holds its fence and goes on; one that finds
//! its fence taken stops (`LeaseKeeper`).

use std::collections::BTreeMap;
use std::time::Duration;

use redb::Database;
use tokio_postgres::{Client, NoTls};

use super::location::PgTarget;
use super::redo::{self, RowOp};
use super::tables::Table;
use super::{StoreError, StoreResult};
use crate::locks::Held;

/// The version of the tables below; a database of a newer one is refused.
pub const SCHEMA_VERSION: i64 = 1;
/// Rows per statement when a whole store is written at once.
const ROWS_PER_STATEMENT: usize = 1000;
/// How long a dead replica's open transaction may hold its locks
/// (cluster.md's `ORPHAN_BOUND`).
const ORPHAN_BOUND: Duration = Duration::from_secs(30);
/// The advisory lock berth's migrations take (with the schema's hash).
const MIGRATION_LOCK: i32 = 0x6265_7274; // "bert"

/// How berth talks to the database: `--store-connect-timeout`,
/// `--store-timeout`, `--store-migrate-timeout`, `--dev`.
#[derive(Clone, Debug)]
pub struct Limits {
    pub connect_timeout: Duration,
    pub statement_timeout: Duration,
    pub migrate_timeout: Duration,
    /// `--dev`: a server with `fsync = off` is taken.
    pub dev: bool,
}

/// One connection to the store's database, with the runtime that drives
/// it (a current-thread one: the writer thread blocks on each call).
pub struct Upstream {
    rt: tokio::runtime::Runtime,
    config: tokio_postgres::Config,
    client: Option<Client>,
    limits: Limits,
    /// The fence this replica leads with, once it leads.
    fence: Option<i64>,
    /// The server process of the current connection (`settle` ends it).
    backend: Option<i32>,
}

/// Until when this replica's reads may answer: its lease as last renewed,
/// timed from when the renew was sent (the database's own expiry is
/// later). Past it another replica may lead and write, so this one's file
/// may be behind: reads answer `store_unreachable` instead of a guess.
pub struct Freshness {
    start: std::time::Instant,
    until_ms: std::sync::atomic::AtomicU64,
    /// The lease was given up (a clean stop): the keeper renews no more.
    ended: std::sync::atomic::AtomicBool,
}

impl Freshness {
    pub fn new() -> Freshness {
        Freshness {
            start: std::time::Instant::now(),
            until_ms: std::sync::atomic::AtomicU64::new(0),
            ended: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// A renew (or the takeover) sent at `sent` landed.
    pub fn extend(&self, sent: std::time::Instant, ttl: Duration) {
        let until = (sent + ttl)
            .saturating_duration_since(self.start)
            .as_millis() as u64;
        self.until_ms
            .fetch_max(until, std::sync::atomic::Ordering::SeqCst);
    }

    /// The lease is given up: no read answers and no renew follows.
    pub fn end(&self) {
        self.ended.store(true, std::sync::atomic::Ordering::SeqCst);
        self.until_ms.store(0, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn ended(&self) -> bool {
        self.ended.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn holds(&self) -> bool {
        let now = self.start.elapsed().as_millis() as u64;
        now < self.until_ms.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Default for Freshness {
    fn default() -> Self {
        Freshness::new()
    }
}

/// A replica as it registers itself.
#[derive(Clone, Debug)]
pub struct Replica {
    pub id: String,
    pub name: String,
    /// Where the others forward requests to while it leads.
    pub url: String,
}

/// A replica as the database lists it (`GET /v1/cluster`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct ReplicaRow {
    pub id: String,
    pub name: String,
    pub url: String,
    pub started_at: String,
    pub last_seen_at: String,
    /// It holds the lease.
    pub leads: bool,
}

/// What `GET /v1/cluster` shows: this replica, the database, and the
/// replicas as the last heartbeat read them.
pub struct Status {
    pub replica: String,
    pub database: String,
    pub replicas: std::sync::Mutex<Vec<ReplicaRow>>,
}

impl Status {
    /// With redb: one replica, no database.
    pub fn single() -> serde_json::Value {
        serde_json::json!({
            "store": "redb",
            "database": null,
            "schema_version": null,
            "replica": null,
            "leader": null,
            "replicas": [],
        })
    }

    pub fn new(replica: &str, database: String) -> Status {
        Status {
            replica: replica.to_string(),
            database,
            replicas: std::sync::Mutex::new(Vec::new()),
        }
    }

    pub fn set(&self, rows: Vec<ReplicaRow>) {
        *self.replicas.held() = rows;
    }

    /// The replicas the last heartbeat saw.
    pub fn replica_count(&self) -> usize {
        self.replicas.held().len()
    }

    /// The body of `GET /v1/cluster`.
    pub fn view(&self) -> serde_json::Value {
        let replicas = self.replicas.held().clone();
        let leader = replicas.iter().find(|r| r.leads).map(|r| r.id.clone());
        serde_json::json!({
            "store": "postgres",
            "database": self.database,
            "schema_version": SCHEMA_VERSION,
            "replica": self.replica,
            "leader": leader,
            "replicas": replicas,
        })
    }
}

/// What every replica of a cluster must share: the secret files (by
/// name, as fingerprints; `None` when this replica has no such file) and
/// the cluster-wide flags (by name, as their values' text).
pub struct Shared {
    pub secrets: Vec<(&'static str, Option<String>)>,
    pub settings: Vec<(&'static str, String)>,
}

/// A secret's fingerprint as the database keeps it (never the secret):
/// SHA-256("berth-secret-v1\n" || name || "\n" || content), hex.
pub fn fingerprint(name: &str, content: &[u8]) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"berth-secret-v1\n");
    h.update(name.as_bytes());
    h.update(b"\n");
    h.update(content);
    crate::hex::encode(&h.finalize())
}

/// What a start found in the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    /// No row yet: a new cluster.
    pub empty: bool,
    /// The layout of the rows (`store::LAYOUT_VERSION` when written).
    pub layout: u32,
}

fn unreachable(e: impl std::fmt::Display) -> StoreError {
    StoreError::unreachable(format!("PostgreSQL: {e}"))
}

/// A database error is the server's answer; anything else (a closed
/// connection, a timeout) says the server could not be reached.
fn of_pg(e: tokio_postgres::Error) -> StoreError {
    match e.as_db_error() {
        Some(db) if db.code().code().starts_with("08") || db.code().code().starts_with("57") => {
            unreachable(db.message())
        }
        Some(db) => StoreError::other(format!("PostgreSQL refused a statement: {}", db.message())),
        None if e.is_closed() || io_source(&e) => unreachable(e),
        None => StoreError::other(format!("PostgreSQL: {e}")),
    }
}

/// Whether an error without the server's answer came from the connection.
fn io_source(e: &tokio_postgres::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return true;
        }
        source = s.source();
    }
    false
}

impl Upstream {
    /// Connects to `target` and checks the server: PostgreSQL 15 or
    /// later, durable, a primary.
    pub fn connect(target: &PgTarget, limits: Limits) -> Result<Upstream, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the database runtime: {e}"))?;
        let mut up = Upstream {
            rt,
            config: config_of(target, &limits)?,
            client: None,
            limits,
            fence: None,
            backend: None,
        };
        up.session().map_err(|e| {
            format!(
                "cannot reach the store's database {}: {} (store_unreachable)",
                target.redacted(),
                e.detail
            )
        })?;
        up.check_server()?;
        Ok(up)
    }

    /// The connection, made again when the last one broke.
    fn session(&mut self) -> StoreResult<&Client> {
        if self.client.as_ref().is_some_and(|c| !c.is_closed()) {
            return self
                .client
                .as_ref()
                .ok_or_else(|| unreachable("no connection"));
        }
        self.client = None;
        let config = self.config.clone();
        let timeout = self.limits.connect_timeout;
        let statement_ms = self.limits.statement_timeout.as_millis();
        let client = self.rt.block_on(async move {
            let (client, connection) = tokio::time::timeout(timeout, config.connect(NoTls))
                .await
                .map_err(|_| unreachable("connecting timed out"))?
                .map_err(of_pg)?;
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::warn!(error = %e, "the store's database connection ended");
                }
            });
            let setup = format!(
                "SET synchronous_commit = on; SET statement_timeout = {statement_ms}; \
                 SET idle_in_transaction_session_timeout = {}",
                ORPHAN_BOUND.as_millis()
            );
            client.batch_execute(&setup).await.map_err(of_pg)?;
            let pid: i32 = client
                .query_one("SELECT pg_backend_pid()", &[])
                .await
                .map_err(of_pg)?
                .try_get(0)
                .map_err(of_pg)?;
            Ok::<_, StoreError>((client, pid))
        })?;
        let (client, pid) = client;
        self.backend = Some(pid);
        Ok(self.client.insert(client))
    }

    /// Runs `f` with the session under `--store-timeout`.
    fn call<T>(
        &mut self,
        f: impl for<'c> FnOnce(
            &'c Client,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, tokio_postgres::Error>> + 'c>,
        >,
    ) -> StoreResult<T> {
        let timeout = self.limits.statement_timeout;
        self.session()?;
        let client = self
            .client
            .as_ref()
            .ok_or_else(|| unreachable("no connection"))?;
        let answer = self
            .rt
            .block_on(async { tokio::time::timeout(timeout, f(client)).await });
        match answer {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(of_pg(e)),
            Err(_) => {
                // The statement may still run: this connection is dropped,
                // which ends it on the server.
                self.client = None;
                Err(unreachable("a statement timed out (--store-timeout)"))
            }
        }
    }

    fn check_server(&mut self) -> Result<(), String> {
        let dev = self.limits.dev;
        let (version, fsync, recovery) = self
            .call(|c| {
                Box::pin(async move {
                    let row = c
                        .query_one(
                            "SELECT current_setting('server_version_num')::int, \
                             current_setting('fsync'), pg_is_in_recovery()",
                            &[],
                        )
                        .await?;
                    Ok((
                        row.try_get::<_, i32>(0)?,
                        row.try_get::<_, String>(1)?,
                        row.try_get::<_, bool>(2)?,
                    ))
                })
            })
            .map_err(|e| format!("cannot read the database server's settings: {}", e.detail))?;
        if version < 150000 {
            return Err(format!(
                "the store's database runs PostgreSQL {}, older than the 15 berth needs (store_version_unsupported)",
                version / 10000
            ));
        }
        if fsync != "on" && !dev {
            return Err("the store's database server runs with fsync = off, so an acknowledged write could be lost in a crash; turn fsync on, or pass --dev for a throwaway setup (store_not_durable)".into());
        }
        if recovery {
            return Err("the store's database is a standby in recovery: point --store at the primary (store_read_only)".into());
        }
        Ok(())
    }

    /// Creates the tables in an empty database, or checks them, under the
    /// migration lock (whichever replica starts first does it; the others
    /// wait for it and find nothing to do); then, under the same lock,
    /// checks `shared` (`Shared::check`).
    pub fn prepare(&mut self, shared: &Shared) -> Result<Found, String> {
        let wait_ms = self.limits.migrate_timeout.as_millis();
        let lock = format!(
            "SET lock_timeout = {wait_ms}; SELECT pg_advisory_lock({MIGRATION_LOCK}, hashtext(current_schema())); SET lock_timeout = 0"
        );
        let unlock =
            format!("SELECT pg_advisory_unlock({MIGRATION_LOCK}, hashtext(current_schema()))");
        self.call(|c| Box::pin(async move { c.batch_execute(&lock).await }))
            .map_err(|e| match e.detail.contains("lock timeout") {
                true => "another replica held the migration lock past --store-migrate-timeout (store_migrate_timeout)".to_string(),
                false => format!("cannot take the migration lock: {} (store_unreachable)", e.detail),
            })?;
        let found = self
            .create_or_check()
            .and_then(|found| self.check_shared(shared).map(|()| found));
        let unlocked = self.call(|c| Box::pin(async move { c.batch_execute(&unlock).await }));
        let found = found?;
        unlocked.map_err(|e| format!("cannot release the migration lock: {}", e.detail))?;
        Ok(found)
    }

    fn create_or_check(&mut self) -> Result<Found, String> {
        let tables: Vec<String> = self
            .call(|c| {
                Box::pin(async move {
                    let rows = c
                        .query(
                            "SELECT table_name::text FROM information_schema.tables WHERE table_schema = current_schema()",
                            &[],
                        )
                        .await?;
                    rows.iter().map(|r| r.try_get::<_, String>(0)).collect()
                })
            })
            .map_err(|e| format!("cannot list the database's tables: {}", e.detail))?;
        if tables.is_empty() {
            self.create()
                .map_err(|e| format!("cannot create berth's tables: {}", e.detail))?;
            return Ok(Found {
                empty: true,
                layout: super::LAYOUT_VERSION,
            });
        }
        if !tables.iter().any(|t| t == "berth_store") {
            let export = tables.iter().any(|t| t == "berth_meta");
            return Err(match export {
                true => "the store's database holds a berth export, not a served store: serve an empty database with --import-from pointing at the export (not_a_berth_database)".into(),
                false => "the store's database (or schema) holds other tables: give berth an empty database or schema of its own (not_a_berth_database)".into(),
            });
        }
        self.check_version()
    }

    fn create(&mut self) -> StoreResult<()> {
        let ddl = format!(
            "BEGIN;
             CREATE TABLE berth_store (key text PRIMARY KEY, value text NOT NULL);
             CREATE TABLE berth_rows (tbl text NOT NULL, k bytea NOT NULL, v bytea NOT NULL, PRIMARY KEY (tbl, k));
             CREATE TABLE berth_leader (id int PRIMARY KEY CHECK (id = 1), fence bigint NOT NULL,
                 replica text NOT NULL, expires_at timestamptz NOT NULL, batch bigint NOT NULL);
             CREATE TABLE berth_replicas (id text PRIMARY KEY, name text NOT NULL, url text NOT NULL,
                 started_at timestamptz NOT NULL, last_seen_at timestamptz NOT NULL);
             INSERT INTO berth_leader VALUES (1, 0, '', '-infinity', 0);
             INSERT INTO berth_store VALUES ('schema_version', '{SCHEMA_VERSION}'), ('layout', '{}');
             COMMIT",
            super::LAYOUT_VERSION
        );
        self.call(|c| Box::pin(async move { c.batch_execute(&ddl).await }))
    }

    fn check_version(&mut self) -> Result<Found, String> {
        let (version, layout, empty) = self
            .call(|c| {
                Box::pin(async move {
                    let row = c
                        .query_one(
                            "SELECT (SELECT value FROM berth_store WHERE key = 'schema_version'),
                                    (SELECT value FROM berth_store WHERE key = 'layout'),
                                    NOT EXISTS (SELECT 1 FROM berth_rows)",
                            &[],
                        )
                        .await?;
                    Ok((
                        row.get::<_, Option<String>>(0),
                        row.get::<_, Option<String>>(1),
                        row.try_get::<_, bool>(2)?,
                    ))
                })
            })
            .map_err(|e| format!("cannot read berth's tables: {}", e.detail))?;
        let version: i64 = version.and_then(|v| v.parse().ok()).unwrap_or(0);
        let layout: u32 = layout.and_then(|v| v.parse().ok()).unwrap_or(0);
        if version > SCHEMA_VERSION || layout > super::LAYOUT_VERSION {
            return Err(format!(
                "the store's database was written by a newer berth (tables {version}, layout {layout}; this berth knows {SCHEMA_VERSION} and {}) (schema_newer)",
                super::LAYOUT_VERSION
            ));
        }
        Ok(Found { empty, layout })
    }

    /// Compares `shared` with what the database recorded: a secret that
    /// differs or is missing, or a cluster-wide flag that differs, refuses
    /// the start (naming the file or the flag, never a value). What the
    /// database lacks is recorded; a flag changed while no replica leads
    /// (every replica stopped, as docs/cluster.md says) is recorded anew.
    fn check_shared(&mut self, shared: &Shared) -> Result<(), String> {
        let recorded: Vec<(String, String)> = self
            .call(|c| {
                Box::pin(async move {
                    let rows = c
                        .query("SELECT key, value FROM berth_store WHERE key LIKE 'secret:%' OR key LIKE 'setting:%'", &[])
                        .await?;
                    rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).collect()
                })
            })
            .map_err(|e| format!("cannot read the recorded secrets and settings: {}", e.detail))?;
        let recorded: BTreeMap<String, String> = recorded.into_iter().collect();
        let (_, lease_passed) = self
            .leader()
            .map_err(|e| format!("cannot read the lease: {}", e.detail))?;
        let mut record: Vec<(String, String)> = Vec::new();
        for (name, value) in &shared.secrets {
            let key = format!("secret:{name}");
            match (recorded.get(&key), value) {
                (Some(had), Some(mine)) if had != mine => return Err(format!("the secret file {name} differs from the one the cluster's other replicas use: copy it from the first replica's secrets (secrets_mismatch)")),
                (Some(_), None) => return Err(format!("the cluster has a secret {name} this replica lacks: copy the file from the first replica's secrets (secrets_missing)")),
                (None, Some(mine)) => record.push((key, mine.clone())),
                (Some(_), Some(_)) | (None, None) => {}
            }
        }
        for (flag, value) in &shared.settings {
            let key = format!("setting:{flag}");
            match recorded.get(&key) {
                Some(had) if had != value && !lease_passed => return Err(format!("{flag} differs from the value the running replicas use: give every replica the same, or stop them all to change it (settings_mismatch)")),
                Some(had) if had == value => {}
                Some(_) | None => record.push((key, value.clone())),
            }
        }
        if record.is_empty() {
            return Ok(());
        }
        let (keys, values): (Vec<String>, Vec<String>) = record.into_iter().unzip();
        self.call(move |c| {
            Box::pin(async move {
                c.execute(
                    "INSERT INTO berth_store SELECT * FROM unnest($1::text[], $2::text[])
                     ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    &[&keys, &values],
                )
                .await
            })
        })
        .map(|_| ())
        .map_err(|e| format!("cannot record the secrets and settings: {}", e.detail))
    }

    /// Takes the lease when it has passed (or was this replica's own):
    /// the new fence and the replica that held it before (empty for a
    /// new cluster), or `None` while another replica holds it.
    pub fn try_lead(&mut self, replica: &str, ttl: Duration) -> StoreResult<Option<(i64, String)>> {
        let replica = replica.to_string();
        let ttl_ms = ttl.as_millis() as i64;
        let taken = self.call(move |c| {
            Box::pin(async move {
                let row = c
                    .query_opt(
                        "UPDATE berth_leader l SET fence = l.fence + 1, replica = $1,
                             expires_at = clock_timestamp() + $2::bigint * interval '1 millisecond'
                         FROM (SELECT replica AS before FROM berth_leader WHERE id = 1) old
                         WHERE l.id = 1 AND (l.expires_at < clock_timestamp() OR l.replica = $1)
                         RETURNING l.fence, old.before",
                        &[&replica, &ttl_ms],
                    )
                    .await?;
                row.map(|r| Ok((r.try_get::<_, i64>(0)?, r.try_get::<_, String>(1)?)))
                    .transpose()
            })
        })?;
        self.fence = taken.as_ref().map(|t| t.0);
        Ok(taken)
    }

    /// Records this replica (at start, and as each heartbeat): its name
    /// and the URL other replicas forward requests to while it leads.
    pub fn register(&mut self, me: &Replica) -> StoreResult<()> {
        let me = me.clone();
        self.call(move |c| {
            Box::pin(async move {
                c.execute(
                    "INSERT INTO berth_replicas VALUES ($1, $2, $3, clock_timestamp(), clock_timestamp())
                     ON CONFLICT (id) DO UPDATE SET name = $2, url = $3, last_seen_at = clock_timestamp()",
                    &[&me.id, &me.name, &me.url],
                )
                .await
            })
        })
        .map(|_| ())
    }

    /// The replicas seen within `within`, and which one leads (if its
    /// lease holds).
    pub fn replicas(&mut self, within: Duration) -> StoreResult<Vec<ReplicaRow>> {
        let within_ms = within.as_millis() as i64;
        self.call(move |c| {
            Box::pin(async move {
                let rows = c
                    .query(
                        "SELECT r.id, r.name, r.url,
                                to_char(r.started_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),
                                to_char(r.last_seen_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),
                                (l.replica = r.id AND l.expires_at > clock_timestamp()) AS leads
                         FROM berth_replicas r CROSS JOIN berth_leader l
                         WHERE r.last_seen_at > clock_timestamp() - $1::bigint * interval '1 millisecond'
                         ORDER BY r.id",
                        &[&within_ms],
                    )
                    .await?;
                rows.iter()
                    .map(|r| {
                        Ok(ReplicaRow {
                            id: r.try_get(0)?,
                            name: r.try_get(1)?,
                            url: r.try_get(2)?,
                            started_at: r.try_get(3)?,
                            last_seen_at: r.try_get(4)?,
                            leads: r.try_get(5)?,
                        })
                    })
                    .collect()
            })
        })
    }

    /// Leads with `fence` (taken by another connection of this replica).
    pub fn lead_with(&mut self, fence: i64) {
        self.fence = Some(fence);
    }

    /// The replica holding the lease, and whether it has passed.
    pub fn leader(&mut self) -> StoreResult<(String, bool)> {
        self.call(|c| {
            Box::pin(async move {
                let row = c
                    .query_one(
                        "SELECT replica, expires_at < clock_timestamp() FROM berth_leader WHERE id = 1",
                        &[],
                    )
                    .await?;
                Ok((row.try_get::<_, String>(0)?, row.try_get::<_, bool>(1)?))
            })
        })
    }

    /// Gives the lease up at a clean stop, so that a standby takes over at
    /// once rather than after `--lease-ttl` (a new fence: nothing this
    /// replica sends after it lands).
    pub fn release(&mut self) -> StoreResult<()> {
        let Some(fence) = self.fence.take() else {
            return Ok(());
        };
        self.call(move |c| {
            Box::pin(async move {
                c.execute(
                    "UPDATE berth_leader SET fence = fence + 1, replica = '', expires_at = '-infinity'
                     WHERE id = 1 AND fence = $1",
                    &[&fence],
                )
                .await
            })
        })
        .map(|_| ())
    }

    /// Extends the lease: false when this replica no longer holds it.
    pub fn renew(&mut self, ttl: Duration) -> StoreResult<bool> {
        let fence = self
            .fence
            .ok_or_else(|| StoreError::other("renewing a lease never taken"))?;
        let ttl_ms = ttl.as_millis() as i64;
        let renewed = self.call(move |c| {
            Box::pin(async move {
                c.execute(
                    "UPDATE berth_leader SET expires_at = clock_timestamp() + $2::bigint * interval '1 millisecond'
                     WHERE id = 1 AND fence = $1",
                    &[&fence, &ttl_ms],
                )
                .await
            })
        })?;
        Ok(renewed == 1)
    }

    /// Commits a batch's rows, fenced by the lease. `Err` with nothing
    /// stored when the database refused, could not be reached, or took
    /// the lease from this replica; a commit whose answer was lost is
    /// settled (`settle`).
    pub fn commit(&mut self, rows: &[u8]) -> StoreResult<()> {
        let fence = self
            .fence
            .ok_or_else(|| StoreError::other("a write before the lease was taken"))?;
        let ops = redo::row_ops(rows)?;
        let change = Change::of(&ops);
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
        let marker = sent.clone();
        let committed = self.call(move |c| Box::pin(change.commit(c, fence, marker)));
        match (committed, sent.load(std::sync::atomic::Ordering::SeqCst)) {
            (Ok(true), _) => Ok(()),
            (Ok(false), _) => Err(StoreError::unreachable(
                "this replica's lease passed: another replica leads now, and nothing was stored",
            )),
            (Err(e), 0) => Err(e),
            (Err(e), batch) => {
                tracing::warn!(error = %e, batch, "the answer to a commit was lost; settling it");
                self.settle(fence, batch)
            }
        }
    }

    /// Learns whether batch `batch`, whose COMMIT was sent and whose
    /// answer was lost, landed: the old session is ended on the server,
    /// then the lease row is read under a share lock, which waits for a
    /// commit still in progress. Landed: `Ok`. Not landed: `Err`, nothing
    /// stored. Unknowable within `ORPHAN_BOUND` (the database away): the
    /// replica's file can no longer be known to match the database, and
    /// the process stops; a start loads the store again.
    fn settle(&mut self, fence: i64, batch: i64) -> StoreResult<()> {
        let old = self.backend.take();
        self.client = None;
        let deadline = std::time::Instant::now() + ORPHAN_BOUND;
        let mut pause = Duration::from_millis(100);
        loop {
            let read = self.call(move |c| {
                Box::pin(async move {
                    if let Some(pid) = old {
                        c.execute("SELECT pg_terminate_backend($1, 5000)", &[&pid])
                            .await?;
                    }
                    let row = c
                        .query_one(
                            "SELECT fence, batch FROM berth_leader WHERE id = 1 FOR SHARE",
                            &[],
                        )
                        .await?;
                    Ok((row.try_get::<_, i64>(0)?, row.try_get::<_, i64>(1)?))
                })
            });
            match read {
                Ok((now, at)) if now == fence && at >= batch => return Ok(()),
                Ok((now, _)) if now == fence => {
                    return Err(unreachable(
                        "the connection broke before the commit landed; nothing was stored",
                    ))
                }
                Ok(_) => {
                    return Err(StoreError::unreachable(
                        "this replica's lease was taken while a commit's answer was lost",
                    ))
                }
                Err(e) if std::time::Instant::now() < deadline => {
                    tracing::warn!(error = %e, "cannot settle a commit yet");
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot learn whether a commit to the store's database landed; stopping so that a start loads the store again");
                    std::process::exit(super::EXIT_STORE_IN_DOUBT);
                }
            }
        }
    }

    /// Loads every row of the database into `db` (a new, empty store
    /// file) in one write transaction made durable at its end, reading
    /// `ROWS_PER_STATEMENT` rows at a time (this replica leads: nothing
    /// else writes meanwhile).
    pub fn load_into_new_file(
        &mut self,
        path: &std::path::Path,
        cache: super::CacheSize,
    ) -> StoreResult<u64> {
        let db = super::redb_builder(redb::ConcurrencyMode::ExclusiveWriter, cache).create(path)?;
        self.load_into(&db)
    }

    /// As `load_into_new_file`, from one snapshot of a database replicas
    /// may be writing to (`REPEATABLE READ READ ONLY`): what `berth audit
    /// verify --store` and `berth export --store` read. Refuses a database
    /// that is not a served berth store.
    pub fn snapshot_into_new_file(&mut self, path: &std::path::Path) -> Result<u64, String> {
        let tables: i64 = self
            .call(|c| {
                Box::pin(async move {
                    c.query_one(
                        "SELECT count(*) FROM information_schema.tables
                         WHERE table_schema = current_schema() AND table_name IN ('berth_store', 'berth_rows')",
                        &[],
                    )
                    .await?
                    .try_get(0)
                })
            })
            .map_err(|e| format!("cannot read the database's tables: {}", e.detail))?;
        if tables != 2 {
            return Err("the database holds no served berth store (not_a_berth_database)".into());
        }
        self.call(|c| {
            Box::pin(async move {
                c.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                    .await
            })
        })
        .map_err(|e| e.detail)?;
        let loaded = self.load_into_new_file(path, super::CacheSize::DEFAULT);
        // The snapshot's transaction ends either way (a broken connection
        // ends it on the server).
        let ended = self.call(|c| Box::pin(async move { c.batch_execute("COMMIT").await }));
        let loaded = loaded.map_err(|e| e.detail)?;
        ended.map_err(|e| e.detail)?;
        Ok(loaded)
    }

    fn load_into(&mut self, db: &Database) -> StoreResult<u64> {
        let txn = db.begin_write()?;
        // Every table, even one without rows: a reader of the file (a
        // snapshot's) opens tables, and never creates them.
        for table in Table::ALL {
            table.create(&txn)?;
        }
        let mut after: (String, Vec<u8>) = (String::new(), Vec::new());
        let mut loaded = 0u64;
        loop {
            let from = after.clone();
            let page: Vec<(String, Vec<u8>, Vec<u8>)> = self.call(move |c| {
                Box::pin(async move {
                    let rows = c
                        .query(
                            "SELECT tbl, k, v FROM berth_rows WHERE (tbl, k) > ($1, $2)
                             ORDER BY tbl, k LIMIT $3",
                            &[&from.0, &from.1, &(ROWS_PER_STATEMENT as i64)],
                        )
                        .await?;
                    rows.into_iter()
                        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
                        .collect()
                })
            })?;
            for (name, k, v) in &page {
                let table = Table::named(name).ok_or_else(|| {
                    StoreError::corrupt(format!(
                        "the database holds rows of a table {name:?} this berth lacks"
                    ))
                })?;
                redo::put_raw(&txn, table, k, v)?;
            }
            loaded += page.len() as u64;
            match page.into_iter().last() {
                Some((name, k, _)) => after = (name, k),
                None => break,
            }
        }
        txn.commit()?;
        Ok(loaded)
    }

    /// Replaces every row of the database with `rx`'s (a new cluster's
    /// first store, an import, a migrated layout), fenced.
    pub fn replace_all(&mut self, rx: &super::Rx) -> StoreResult<()> {
        let fence = self
            .fence
            .ok_or_else(|| StoreError::other("a write before the lease was taken"))?;
        let mut rows: Vec<(String, Vec<u8>, Vec<u8>)> = Vec::new();
        for table in Table::ALL {
            for (k, v) in redo::raw_rows(rx, table)? {
                rows.push((table.name().to_string(), k, v));
            }
        }
        let layout = super::LAYOUT_VERSION.to_string();
        let replaced = self.call(move |c| {
            Box::pin(async move {
                c.batch_execute("BEGIN").await?;
                if c.execute(
                    "UPDATE berth_leader SET batch = batch + 1 WHERE id = 1 AND fence = $1",
                    &[&fence],
                )
                .await?
                    != 1
                {
                    c.batch_execute("ROLLBACK").await?;
                    return Ok(false);
                }
                c.execute("DELETE FROM berth_rows", &[]).await?;
                for chunk in rows.chunks(ROWS_PER_STATEMENT) {
                    let (names, keys, values) = columns(chunk);
                    c.execute(
                        "INSERT INTO berth_rows SELECT * FROM unnest($1::text[], $2::bytea[], $3::bytea[])",
                        &[&names, &keys, &values],
                    )
                    .await?;
                }
                c.execute("UPDATE berth_store SET value = $1 WHERE key = 'layout'", &[&layout])
                    .await?;
                c.batch_execute("COMMIT").await?;
                Ok(true)
            })
        })?;
        match replaced {
            true => Ok(()),
            false => Err(StoreError::unreachable(
                "this replica's lease passed before its store was written",
            )),
        }
    }
}

fn columns(rows: &[(String, Vec<u8>, Vec<u8>)]) -> (Vec<&str>, Vec<&[u8]>, Vec<&[u8]>) {
    let names = rows.iter().map(|r| r.0.as_str()).collect();
    let keys = rows.iter().map(|r| r.1.as_slice()).collect();
    let values = rows.iter().map(|r| r.2.as_slice()).collect();
    (names, keys, values)
}

/// A batch's rows, reduced to what changed: the tables emptied, then each
/// row's last state (one statement per kind, whatever the batch's size).
struct Change {
    cleared: Vec<String>,
    removed: (Vec<String>, Vec<Vec<u8>>),
    written: (Vec<String>, Vec<Vec<u8>>, Vec<Vec<u8>>),
}

impl Change {
    fn of(ops: &[RowOp<'_>]) -> Change {
        let mut cleared: Vec<String> = Vec::new();
        let mut last: BTreeMap<(&str, &[u8]), Option<&[u8]>> = BTreeMap::new();
        for op in ops {
            match *op {
                RowOp::Insert(t, k, v) => {
                    last.insert((t, k), Some(v));
                }
                RowOp::Remove(t, k) => {
                    last.insert((t, k), None);
                }
                RowOp::Clear(t) => {
                    last.retain(|(table, _), _| *table != t);
                    cleared.push(t.to_string());
                }
            }
        }
        let mut change = Change {
            cleared,
            removed: (Vec::new(), Vec::new()),
            written: (Vec::new(), Vec::new(), Vec::new()),
        };
        for ((t, k), v) in last {
            match v {
                Some(v) => {
                    change.written.0.push(t.to_string());
                    change.written.1.push(k.to_vec());
                    change.written.2.push(v.to_vec());
                }
                None => {
                    change.removed.0.push(t.to_string());
                    change.removed.1.push(k.to_vec());
                }
            }
        }
        change
    }

    /// One transaction: the fence checked (and the batch counted), then
    /// the rows. `Ok(false)`: the fence is not the lease's any more.
    async fn commit(
        self,
        c: &Client,
        fence: i64,
        sent: std::sync::Arc<std::sync::atomic::AtomicI64>,
    ) -> Result<bool, tokio_postgres::Error> {
        c.batch_execute("BEGIN").await?;
        let fenced = c
            .query_opt(
                "UPDATE berth_leader SET batch = batch + 1 WHERE id = 1 AND fence = $1 RETURNING batch",
                &[&fence],
            )
            .await?;
        let Some(batch) = fenced.map(|row| row.try_get::<_, i64>(0)).transpose()? else {
            c.batch_execute("ROLLBACK").await?;
            return Ok(false);
        };
        if !self.cleared.is_empty() {
            c.execute(
                "DELETE FROM berth_rows WHERE tbl = ANY($1)",
                &[&self.cleared],
            )
            .await?;
        }
        if !self.removed.0.is_empty() {
            c.execute(
                "DELETE FROM berth_rows WHERE (tbl, k) IN (SELECT * FROM unnest($1::text[], $2::bytea[]))",
                &[&self.removed.0, &self.removed.1],
            )
            .await?;
        }
        if !self.written.0.is_empty() {
            c.execute(
                "INSERT INTO berth_rows SELECT * FROM unnest($1::text[], $2::bytea[], $3::bytea[])
                 ON CONFLICT (tbl, k) DO UPDATE SET v = excluded.v",
                &[&self.written.0, &self.written.1, &self.written.2],
            )
            .await?;
        }
        // From here on a lost answer leaves the batch in doubt: the
        // caller settles it by its number.
        sent.store(batch, std::sync::atomic::Ordering::SeqCst);
        c.batch_execute("COMMIT").await?;
        Ok(true)
    }
}

/// The connection settings of `target`.
fn config_of(target: &PgTarget, limits: &Limits) -> Result<tokio_postgres::Config, String> {
    let mut config = tokio_postgres::Config::new();
    for (host, port) in &target.hosts {
        config.host(host).port(*port);
    }
    if let Some((dir, port)) = &target.socket_dir {
        config.host_path(dir).port(*port);
    }
    let user = match &target.user {
        Some(u) => u.clone(),
        None => std::env::var("USER").unwrap_or_else(|_| "berth".into()),
    };
    config.user(&user).dbname(&target.dbname);
    let password = match &target.password {
        Some(p) => Some(p.clone()),
        None => pgpass(target, &user)?,
    };
    if let Some(p) = password {
        config.password(p);
    }
    if let Some(schema) = &target.schema {
        config.options(format!("-csearch_path={schema}"));
    }
    config
        .application_name(target.application_name.as_deref().unwrap_or("berth"))
        .connect_timeout(limits.connect_timeout)
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        .target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
    Ok(config)
}

/// The password `PGPASSFILE` (or `~/.pgpass`) holds for `target`, read as
/// libpq does: `host:port:database:user:password`, `*` matching anything.
/// A file group or others may read is refused, as libpq ignores it.
fn pgpass(target: &PgTarget, user: &str) -> Result<Option<String>, String> {
    use std::os::unix::fs::PermissionsExt;
    let path = match std::env::var_os("PGPASSFILE") {
        Some(p) => std::path::PathBuf::from(p),
        None => match std::env::var_os("HOME") {
            Some(home) => std::path::Path::new(&home).join(".pgpass"),
            None => return Ok(None),
        },
    };
    let Ok(meta) = std::fs::metadata(&path) else {
        return Ok(None);
    };
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(format!(
            "{} may be read by group or others: chmod 600 it (store_file_mode)",
            path.display()
        ));
    }
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let (host, port) = match (target.hosts.first(), &target.socket_dir) {
        (Some((h, p)), _) => (h.clone(), *p),
        (None, Some((_, p))) => ("localhost".to_string(), *p),
        (None, None) => return Ok(None),
    };
    let port = port.to_string();
    let wanted = [host.as_str(), port.as_str(), target.dbname.as_str(), user];
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let fields = split_pgpass(line);
        if fields.len() == 5
            && fields[..4]
                .iter()
                .zip(wanted)
                .all(|(f, w)| f == "*" || f == w)
        {
            return Ok(Some(fields[4].clone()));
        }
    }
    Ok(None)
}

/// A `.pgpass` line's fields (`\:` and `\\` escaped).
fn split_pgpass(line: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut field = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => field.extend(chars.next()),
            ':' => fields.push(std::mem::take(&mut field)),
            c => field.push(c),
        }
    }
    fields.push(field);
    fields
}

/// Keeps this replica's lease alive from a thread of its own, and stops
/// the replica (`on_lost`) once another replica took it (a higher fence).
/// While the database cannot be reached it keeps trying: the lease may
/// pass meanwhile, but no write can land without the fence.
pub struct LeaseKeeper;

impl LeaseKeeper {
    /// Renews every third of `ttl`, then runs `beat` (the replica's
    /// heartbeat) on the same connection.
    pub fn start<T>(
        mut up: Upstream,
        (fence, fresh): (i64, std::sync::Arc<Freshness>),
        ttl: Duration,
        beat: impl Fn(&mut Upstream) -> T + Send + 'static,
        on_lost: impl FnOnce(&str) + Send + 'static,
    ) -> Result<(), String> {
        up.lead_with(fence);
        std::thread::Builder::new()
            .name("berth-lease".into())
            .spawn(move || loop {
                std::thread::sleep(ttl / 3);
                if fresh.ended() {
                    return;
                }
                let sent = std::time::Instant::now();
                match up.renew(ttl) {
                    Ok(true) => fresh.extend(sent, ttl),
                    Ok(false) => return on_lost("another replica took the lease"),
                    Err(e) => tracing::warn!(error = %e, "cannot renew the lease yet"),
                }
                beat(&mut up);
            })
            .map(|_| ())
            .map_err(|e| format!("cannot start the lease thread: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_reduces_to_each_rows_last_state_after_its_clears() {
        let ops = [
            RowOp::Insert("a", b"1", b"x"),
            RowOp::Insert("b", b"1", b"y"),
            RowOp::Remove("a", b"1"),
            RowOp::Insert("a", b"2", b"z"),
            RowOp::Clear("b"),
            RowOp::Insert("b", b"2", b"w"),
            RowOp::Insert("a", b"2", b"v"),
        ];
        let c = Change::of(&ops);
        assert_eq!(c.cleared, vec!["b".to_string()]);
        assert_eq!(c.removed, (vec!["a".to_string()], vec![b"1".to_vec()]));
        assert_eq!(
            c.written,
            (
                vec!["a".to_string(), "b".to_string()],
                vec![b"2".to_vec(), b"2".to_vec()],
                vec![b"v".to_vec(), b"w".to_vec()]
            )
        );
    }

    #[test]
    fn pgpass_fields_unescape() {
        assert_eq!(
            split_pgpass(r"db\:1:5432:*:berth:p\\w\:d"),
            vec!["db:1", "5432", "*", "berth", r"p\w:d"]
        );
    }
}
