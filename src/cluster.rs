//! A replica's start on a store in PostgreSQL (`--store postgres://...`,
//! docs/cluster.md): connect and check the server, create or check the
//! tables under the migration lock, wait for the lease, load the rows into
//! a fresh store file, and open the store with each batch committed to
//! the database first (`store::upstream`).
//!
//! Why it exists apart from `serve`: these steps block (one database
//! connection driven by its own runtime) and run before anything serves;
//! `serve` calls `start` off the async workers and gets a `Store` back.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::engine::recovery::Start;
use crate::settings::Settings;
use crate::store::location::PgTarget;
use crate::store::upstream::{
    fingerprint, Freshness, LeaseKeeper, Limits, Replica, Shared, Status, Upstream,
};
use crate::store::{Sharing, Store};

/// How often a waiting replica looks whether the lease has passed.
const STANDBY_POLL: Duration = Duration::from_secs(1);
/// How often the leader looks whether its lease still surely holds.
const SELF_FENCE_CHECK: Duration = Duration::from_millis(250);
/// How long a standby waits to reach the leading replica for a request.
const FORWARD_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// What a standby reads of a request it answers 503 itself, at most.
const FORWARD_DRAIN_BYTES: usize = 64 * 1024;
/// How long a standby waits before trying an unreachable leader again.
const FORWARD_RETRY: Duration = Duration::from_millis(200);
/// Replicas of one cluster live at once at most (cluster.md `MAX_REPLICAS`):
/// each holds database sessions and heartbeats every third of the lease.
pub const MAX_REPLICAS: usize = 16;
/// Bytes of a replica id (random, hex in `<data-dir>/replica-id`).
const REPLICA_ID_BYTES: usize = 8;

/// What a replica's start made: its store, and a receiver that fires
/// (with why) once it no longer leads.
pub struct Started {
    pub store: Store,
    /// Held while the process lives: one replica per data dir.
    pub data_dir_lock: nix::fcntl::Flock<std::fs::File>,
    pub lost: tokio::sync::watch::Receiver<Option<String>>,
    /// Whether another replica led before (its running builds are lost).
    pub start: Start,
}

fn limits(settings: &Settings) -> Limits {
    Limits {
        connect_timeout: settings.store_connect_timeout,
        statement_timeout: settings.store_timeout,
        migrate_timeout: settings.store_migrate_timeout,
        dev: settings.dev,
    }
}

/// This replica's secrets (fingerprints of the files) and cluster-wide
/// flags, which every replica must share (docs/cluster.md).
fn shared_of(settings: &Settings) -> Result<Shared, String> {
    let data = &settings.data_dir;
    let files = [
        (
            "service-token",
            settings
                .service_token_file
                .clone()
                .unwrap_or_else(|| data.join("service-token")),
        ),
        ("cursor-key", data.join("cursor-key")),
        (
            "callback-secret",
            settings
                .callback_secret_file
                .clone()
                .unwrap_or_else(|| data.join("callback-secret")),
        ),
        ("audit-signing.key", data.join("audit-signing.key")),
    ];
    let mut secrets = Vec::new();
    for (name, path) in files {
        let fingerprint = match std::fs::read(&path) {
            Ok(bytes) => Some(fingerprint(name, &bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        secrets.push((name, fingerprint));
    }
    let s = settings;
    let settings = vec![
        ("--default-source", format!("{:?}", s.default_source)),
        ("--callback-origin", format!("{:?}", s.callback_origin)),
        ("--webhook-origin", format!("{:?}", s.webhook_origin)),
        ("--lease-ttl", format!("{:?}", s.lease_ttl)),
        ("--cancel-grace", format!("{:?}", s.cancel_grace)),
        ("--build-timeout", format!("{:?}", s.build_timeout)),
        ("--update-interval", format!("{:?}", s.update_interval)),
        ("--sweep-interval", format!("{:?}", s.sweep_interval)),
        ("--keep-builds", s.keep_builds.to_string()),
        ("--keep-build-days", s.keep_build_days.to_string()),
        (
            "--keep-rollback-targets",
            s.keep_rollback_targets.to_string(),
        ),
        ("--audit-retention-days", s.audit_retention_days.to_string()),
        ("--max-log-bytes", s.max_log_bytes.to_string()),
        ("--max-queued-builds", s.max_queued_builds.to_string()),
        ("--max-webhooks", s.max_webhooks.to_string()),
        ("--ticket-ttl", format!("{:?}", s.ticket_ttl)),
        (
            "--max-tickets-per-caller",
            s.max_tickets_per_caller.to_string(),
        ),
        ("--audit-origin", format!("{:?}", s.audit_origin)),
        ("--build-labels", format!("{:?}", s.build_labels)),
        ("--max-work-state", s.max_work_state.to_string()),
        ("--keep-work-states", s.keep_work_states.to_string()),
        (
            "--agent-revert-after",
            format!("{:?}", s.agent_revert_after),
        ),
        ("--max-agents", s.max_agents.to_string()),
        ("--max-artifact-bytes", s.max_artifact_bytes.to_string()),
    ];
    Ok(Shared { secrets, settings })
}

/// The flags that have no meaning with PostgreSQL, refused by name.
pub fn refuse_redb_flags(settings: &Settings) -> Result<(), String> {
    let given = [
        (settings.shared_store, "--shared-store"),
        (settings.reset_dev_state, "--reset-dev-state"),
        (
            settings.checkpoint_interval != Duration::from_millis(50),
            "--checkpoint-interval",
        ),
    ];
    match given.iter().find(|(set, _)| *set) {
        Some((_, flag)) => Err(format!(
            "{flag} is a flag of the embedded store and has no meaning with --store postgres:// (redb_only_flag)"
        )),
        None => Ok(()),
    }
}

/// This replica as it registers: its id, `--replica-name` and
/// `--replica-url` (or what `bound` gives).
pub fn me(settings: &Settings, bound: std::net::SocketAddr) -> Result<Replica, String> {
    let id = replica_id(&settings.data_dir)?;
    let url = match &settings.replica_url {
        Some(url) => url.trim_end_matches('/').to_string(),
        None if bound.ip().is_unspecified() => {
            return Err(format!(
                "--listen {bound} names no address the other replicas can reach: give --replica-url (replica_url_needed)"
            ))
        }
        None => format!("http://{bound}"),
    };
    let name = match &settings.replica_name {
        Some(name) => name.clone(),
        None => {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}:{}", host.trim(), bound.port())
        }
    };
    Ok(Replica { id, name, url })
}

/// Starts this replica on `target`; blocks until it leads, meanwhile
/// telling `leader` where the leading replica is (the standby forwards
/// requests there, `forward_while_standby`).
pub fn start(
    settings: &Settings,
    target: &PgTarget,
    me: &Replica,
    leader: &tokio::sync::watch::Sender<Option<String>>,
    status: std::sync::Arc<Status>,
) -> Result<Started, String> {
    let data_dir_lock = lock_data_dir(&settings.data_dir)?;
    let mut up = Upstream::connect(target, limits(settings))?;
    let found = up.prepare(&shared_of(settings)?)?;
    refuse_past_max_replicas(&mut up, me, settings.lease_ttl)?;
    let keeper = Upstream::connect(target, limits(settings))?;
    let (fence, taken_at, start) =
        wait_for_lease(&mut up, me, settings.lease_ttl, leader, &status)?;
    tracing::info!(replica = %me.id, fence, database = %target.redacted(), "this replica leads the cluster");
    // The lease holds from when it was asked for, and is kept from now
    // on: a load longer than the lease must not let another replica in.
    let fresh = std::sync::Arc::new(Freshness::new());
    fresh.extend(taken_at, settings.lease_ttl);
    let (lost_tx, lost) = tokio::sync::watch::channel(None);
    let heartbeat = Heartbeat {
        me: me.clone(),
        status,
        seen_within: settings.lease_ttl,
    };
    LeaseKeeper::start(
        keeper,
        (fence, fresh.clone()),
        settings.lease_ttl,
        move |up| heartbeat.beat(up),
        move |why| {
            tracing::error!(why, "this replica no longer leads the cluster; stopping");
            lost_tx.send_replace(Some(why.to_string()));
        },
    )?;
    let path = settings.db_path();
    fill_cache(&mut up, settings, found.empty)?;
    let sharing = Sharing::Exclusive {
        checkpoint_every: settings.checkpoint_interval,
    };
    let store = Store::open_behind(&path, sharing, settings.cache_size, Some((up, fresh)))
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    // A new cluster's first rows, an import, or rows a migration of the
    // layout changed at open: the database takes the whole store.
    if found.empty || found.layout != crate::store::LAYOUT_VERSION {
        store
            .upload_all()
            .map_err(|e| format!("cannot write the store to its database: {e}"))?;
    }
    Ok(Started {
        store,
        data_dir_lock,
        lost,
        start,
    })
}

/// Makes this replica's store file anew: every row of the database, or
/// for a new cluster the import `--import-from` names (once: only into an
/// empty database).
fn fill_cache(up: &mut Upstream, settings: &Settings, empty: bool) -> Result<(), String> {
    let path = settings.db_path();
    remove_cache(&path)?;
    let import = match (&settings.import_from, empty) {
        (Some(source), true) => Some(source.clone()),
        (Some(_), false) => {
            tracing::info!(
                "--import-from: the store's database holds a store already; nothing imported"
            );
            None
        }
        (None, _) => None,
    };
    if !empty {
        let rows = up
            .load_into_new_file(&path, settings.cache_size)
            .map_err(|e| {
                format!(
                    "cannot load the store from its database into {}: {e}",
                    path.display()
                )
            })?;
        tracing::info!(rows, "loaded the store from its database");
    }
    if let Some(source) = &import {
        let from =
            crate::export::Endpoint::parse(source).map_err(|e| format!("--import-from: {e}"))?;
        crate::export::import_at_start(&settings.data_dir, &from)?;
    }
    Ok(())
}

/// The self-fence (workers.md's rule, for the leader's own builds): once
/// this replica cannot confirm its lease (no renew landed within
/// `--lease-ttl`: another replica may lead and start the next build of a
/// deployment), it stops the deployers it runs rather than let them
/// overlap. Their end is recorded when the database answers again, if
/// this replica still holds its fence; if not, the new leader already
/// ended them `lost_attempt`.
pub async fn self_fence(
    engine: std::sync::Arc<crate::engine::Engine>,
    lease: std::sync::Arc<crate::store::upstream::Freshness>,
) {
    let mut every = tokio::time::interval(SELF_FENCE_CHECK);
    loop {
        every.tick().await;
        if lease.ended() {
            return;
        }
        if !lease.holds() && engine.running_builds() > 0 {
            tracing::warn!(
                running = engine.running_builds(),
                "this replica cannot confirm its lease: stopping the deployers it runs"
            );
            engine.stop_running_builds();
        }
    }
}

/// What a replica does at each heartbeat: registers itself and reads the
/// replica list for `GET /v1/cluster`.
struct Heartbeat {
    me: Replica,
    status: std::sync::Arc<Status>,
    seen_within: Duration,
}

impl Heartbeat {
    /// The leading replica's URL, when one leads.
    fn beat(&self, up: &mut Upstream) -> Option<String> {
        if let Err(e) = up.register(&self.me) {
            tracing::warn!(error = %e, "cannot record this replica's heartbeat");
            return None;
        }
        match up.replicas(self.seen_within) {
            Ok(rows) => {
                let leader = rows.iter().find(|r| r.leads).map(|r| r.url.clone());
                self.status.set(rows);
                leader
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the replica list");
                None
            }
        }
    }
}

/// Waits (as a standby) until the lease is free, then takes it.
/// Refuses a start that would make more than `MAX_REPLICAS` live
/// replicas (seen within the lease; this one's own row does not count).
fn refuse_past_max_replicas(up: &mut Upstream, me: &Replica, ttl: Duration) -> Result<(), String> {
    let live = up
        .replicas(ttl)
        .map_err(|e| format!("cannot read the cluster's replicas: {e}"))?;
    let others = live.iter().filter(|r| r.id != me.id).count();
    match others < MAX_REPLICAS {
        true => Ok(()),
        false => Err(format!(
            "{others} replicas of this cluster are live, the most it takes is {MAX_REPLICAS}: stop one, or wait for a stopped one's lease to pass (too_many_replicas)"
        )),
    }
}

fn wait_for_lease(
    up: &mut Upstream,
    me: &Replica,
    ttl: Duration,
    leader: &tokio::sync::watch::Sender<Option<String>>,
    status: &std::sync::Arc<Status>,
) -> Result<(i64, std::time::Instant, Start), String> {
    let heartbeat = Heartbeat {
        me: me.clone(),
        status: status.clone(),
        seen_within: ttl,
    };
    let mut told = false;
    loop {
        let url = heartbeat.beat(up);
        let asked = std::time::Instant::now();
        match up.try_lead(&me.id, ttl) {
            Ok(Some((fence, before))) => {
                leader.send_replace(None);
                // `GET /v1/cluster` names this replica from its first answer.
                heartbeat.beat(up);
                let start = match before.is_empty() || before == me.id {
                    true => Start::Restart,
                    false => Start::Takeover,
                };
                return Ok((fence, asked, start));
            }
            Ok(None) => {
                if !told {
                    tracing::info!(leader = ?url, "standby: another replica leads; forwarding requests to it and waiting for its lease to pass");
                    told = true;
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot reach the store's database; trying again"),
        }
        leader.send_replace(url);
        std::thread::sleep(STANDBY_POLL);
    }
}

/// While this replica waits, each connection it accepts is joined to the
/// leading replica's (bytes both ways, so streams, uploads and every
/// route work as there); with no leader reached within
/// `FORWARD_CONNECT_TIMEOUT` it gets a 503 (`forward`). Returns the
/// listener once `done` fires,
/// and closes the connections it joined: the replica they reach may be
/// the one that lost the lease (paused, it would hold them for ever), and
/// a client that sees its connection close sends again, to this one now.
pub async fn forward_while_standby(
    listener: tokio::net::TcpListener,
    leader: tokio::sync::watch::Receiver<Option<String>>,
    mut done: tokio::sync::oneshot::Receiver<()>,
    max_connections: usize,
) -> tokio::net::TcpListener {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(max_connections));
    let mut joined = tokio::task::JoinSet::new();
    loop {
        while joined.try_join_next().is_some() {}
        let client = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => client,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut done => {
                joined.abort_all();
                return listener;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            continue;
        };
        let leader = leader.clone();
        joined.spawn(async move {
            let _slot = slot;
            forward(client, leader).await;
        });
    }
}

/// Joins `client` to the leading replica. The leader may be changing
/// hands (its address changes at the next standby poll): each address
/// the replica learns is tried until `FORWARD_CONNECT_TIMEOUT`; then the
/// client gets `503 unavailable`, reason `leader_unreachable`, and
/// `Retry-After`, as a request to a replica cut off from its database
/// does, rather than a closed connection it cannot tell from a crash.
async fn forward(
    mut client: tokio::net::TcpStream,
    mut leader: tokio::sync::watch::Receiver<Option<String>>,
) {
    let deadline = tokio::time::Instant::now() + FORWARD_CONNECT_TIMEOUT;
    loop {
        let address = leader.borrow_and_update().as_deref().and_then(host_port_of);
        if let Some(address) = address {
            let connect = tokio::net::TcpStream::connect(&address);
            match tokio::time::timeout_at(deadline, connect).await {
                Ok(Ok(mut upstream)) => {
                    if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut upstream).await
                    {
                        tracing::debug!(error = %e, "a forwarded connection ended with an error");
                    }
                    return;
                }
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, %address, "cannot reach the leading replica")
                }
                Err(_) => break,
            }
        }
        // A new address, or a moment before the same one again.
        let changed = tokio::time::timeout(FORWARD_RETRY, leader.changed());
        if tokio::time::Instant::now() >= deadline || matches!(changed.await, Ok(Err(_))) {
            break;
        }
    }
    answer_leader_unreachable(client).await;
}

/// The 503 a standby answers when no leader can be reached. What the
/// client sent is read first (up to `FORWARD_DRAIN_BYTES`): a socket
/// closed with unread input is reset, and a reset can lose the answer.
async fn answer_leader_unreachable(mut client: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < FORWARD_DRAIN_BYTES {
        match client.try_read(&mut sink) {
            Ok(0) => break,
            Ok(n) => drained += n,
            // Nothing more has arrived: answer now.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => {
                tracing::debug!(error = %e, "a client no leader can serve went away");
                return;
            }
        }
    }
    let error = crate::api::errors::ApiError::new(
        crate::api::errors::Code::Unavailable,
        "no replica leads that this one can reach (a takeover may be under way); try again",
    )
    .reason("leader_unreachable")
    .retry_after(1);
    let body = error.body("");
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let written = async {
        client.write_all(head.as_bytes()).await?;
        client.write_all(&body).await?;
        client.shutdown().await
    };
    if let Err(e) = written.await {
        tracing::debug!(error = %e, "cannot answer a client that no leader is reachable");
    }
}

/// `host:port` of an `http://host:port[/...]` URL.
fn host_port_of(url: &str) -> Option<String> {
    let rest = url.strip_prefix("http://")?;
    let authority = rest.split('/').next()?;
    match authority.contains(':') {
        true => Some(authority.to_string()),
        false => Some(format!("{authority}:80")),
    }
}

/// Locks the data dir for this process: its store file is removed and
/// made again at start, which must never happen under another replica
/// (a paused one) still using it.
fn lock_data_dir(data_dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join("replica.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let locked = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|_| {
            format!(
                "another berth serves the data dir {} (it holds {}); stop it first",
                data_dir.display(),
                path.display()
            )
        })?;
    Ok(locked)
}

/// The store file and redo log left by an earlier start: a cache the
/// database replaces.
fn remove_cache(path: &Path) -> Result<(), String> {
    for file in [path.to_path_buf(), crate::store::redo::path_of(path)] {
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(format!(
                    "cannot remove the old cache {}: {e}",
                    file.display()
                ))
            }
        }
    }
    Ok(())
}

/// This replica's id: random, made at a data dir's first start.
pub fn replica_id(data_dir: &Path) -> Result<String, String> {
    let path: PathBuf = data_dir.join("replica-id");
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_string()),
        Ok(_) => {
            return Err(format!(
                "{} is empty: remove it to get a new id",
                path.display()
            ))
        }
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(format!("cannot read {}: {e}", path.display()))
        }
        Err(_) => {}
    }
    let mut bytes = [0u8; REPLICA_ID_BYTES];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness for a replica id: {e}"))?;
    let id = crate::hex::encode(&bytes);
    crate::durable::create(&path, id.as_bytes(), 0o600)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    Ok(id)
}

/// Where a read-only command (`audit verify`, `export`) reads a store:
/// the data dir's, or a snapshot of the store in PostgreSQL loaded into a
/// private temporary data dir, removed when this is dropped.
pub enum SnapshotAt {
    DataDir(PathBuf),
    Loaded(PathBuf),
}

impl SnapshotAt {
    pub fn data_dir(&self) -> &Path {
        match self {
            SnapshotAt::DataDir(dir) | SnapshotAt::Loaded(dir) => dir,
        }
    }
}

impl Drop for SnapshotAt {
    fn drop(&mut self) {
        if let SnapshotAt::Loaded(dir) = self {
            if let Err(e) = std::fs::remove_dir_all(&*dir) {
                eprintln!("berth: cannot remove the snapshot {}: {e}", dir.display());
            }
        }
    }
}

/// The store `flags` name, as `SnapshotAt`: with `--store postgres://`,
/// one snapshot loaded (replicas may run meanwhile).
pub fn snapshot(
    flags: &crate::settings::StoreFlags,
    data_dir: &Path,
) -> Result<SnapshotAt, String> {
    let Some(target) = flags.postgres()? else {
        return Ok(SnapshotAt::DataDir(data_dir.to_path_buf()));
    };
    let mut up = Upstream::connect(&target, COMMAND_LIMITS)?;
    let at = SnapshotAt::Loaded(private_temp_dir("berth-snapshot")?);
    up.snapshot_into_new_file(&at.data_dir().join("berth.redb"))?;
    Ok(at)
}

/// How a command (`audit verify`, `export`, `import` with `--store`)
/// talks to the database: a snapshot or an import may take long; the
/// server's settings are the replicas' to check.
const COMMAND_LIMITS: Limits = Limits {
    connect_timeout: Duration::from_secs(10),
    statement_timeout: Duration::from_secs(600),
    migrate_timeout: Duration::from_secs(60),
    dev: true,
};

/// A new directory under the system's temporary one, private (0700) from
/// its creation.
fn private_temp_dir(prefix: &str) -> Result<PathBuf, String> {
    use std::os::unix::fs::DirBuilderExt;
    let mut name = [0u8; 8];
    getrandom::fill(&mut name).map_err(|e| format!("no randomness: {e}"))?;
    let dir = std::env::temp_dir().join(format!("{prefix}-{}", crate::hex::encode(&name)));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}

/// `berth audit verify [--store ...]`: the data dir's store, or one
/// snapshot of the database.
pub fn run_verify(store: &crate::settings::StoreFlags, data_dir: &Path, json: bool) -> i32 {
    match snapshot(store, data_dir) {
        Ok(at) => crate::audit_cli::run_verify_at(at.data_dir(), data_dir, json),
        Err(e) => {
            eprintln!("berth audit verify: {e}");
            crate::audit_cli::EXIT_CANNOT_RUN
        }
    }
}

/// `berth audit push-head [--store ...]`: the chain of the data dir's
/// store, or of one snapshot of the database, signed with the data dir's
/// key (a replica's), the accepted head recorded in the data dir.
pub fn run_push_head(
    store: &crate::settings::StoreFlags,
    data_dir: &Path,
    sink: &str,
    origin: Option<&str>,
) -> i32 {
    match snapshot(store, data_dir) {
        Ok(at) => crate::audit_cli::run_push_head(at.data_dir(), data_dir, sink, origin),
        Err(e) => {
            eprintln!("berth audit push-head: {e}");
            crate::audit_cli::EXIT_CANNOT_RUN
        }
    }
}

/// `berth export [--store ...] --to ...`: the data dir's store, or one
/// snapshot of the database.
pub fn run_export(
    store: &crate::settings::StoreFlags,
    data_dir: &Path,
    to: &str,
    replace: bool,
) -> i32 {
    match snapshot(store, data_dir) {
        Ok(at) => crate::export::run_export(at.data_dir(), to, replace),
        Err(e) => {
            eprintln!("berth export: {e}");
            1
        }
    }
}

/// `berth import [--store ...] --from ...`: into the data dir's store, or
/// into the database (`import_into`).
pub fn run_import(
    store: &crate::settings::StoreFlags,
    data_dir: &Path,
    from: &str,
    replace: bool,
) -> i32 {
    match store.postgres() {
        Ok(None) => crate::export::run_import(data_dir, from, replace),
        Ok(Some(target)) => run_import_into(&target, from, replace),
        Err(e) => {
            eprintln!("berth import: {e}");
            1
        }
    }
}

/// `berth import --store postgres://X --from EXPORT [--replace]`: the
/// export loaded into a private temporary store, then written to X in one
/// transaction, under a lease taken for the import, so no replica may run
/// meanwhile (`replica_live`). A database holding a store is refused
/// without `--replace`.
fn run_import_into(target: &PgTarget, from: &str, replace: bool) -> i32 {
    match import_into(target, from, replace) {
        Ok(()) => {
            eprintln!("import done into {}", target.redacted());
            0
        }
        Err(e) => {
            eprintln!("berth import: {e}");
            eprintln!("nothing was changed");
            1
        }
    }
}

/// How long the import's lease lasts: the whole import, at most.
const IMPORT_LEASE: Duration = Duration::from_secs(3600);

fn import_into(target: &PgTarget, from: &str, replace: bool) -> Result<(), String> {
    let endpoint = crate::export::Endpoint::parse(from)?;
    let mut up = Upstream::connect(target, COMMAND_LIMITS)?;
    let found = up.prepare(&Shared {
        secrets: Vec::new(),
        settings: Vec::new(),
    })?;
    if !found.empty && !replace {
        return Err("the database holds a store: pass --replace to overwrite it".into());
    }
    let Some(_) = up
        .try_lead("berth-import", IMPORT_LEASE)
        .map_err(|e| e.detail)?
    else {
        return Err(
            "a replica leads this database: stop every replica first (replica_live)".into(),
        );
    };
    // Removed when dropped, whatever happens.
    let dir = SnapshotAt::Loaded(private_temp_dir("berth-import")?);
    let loaded = load_export(&endpoint, dir.data_dir()).and_then(|store| {
        let written = store
            .upload_all_to(&mut up)
            .map_err(|e| format!("cannot write the store: {e}"));
        if let Err(e) = store.close() {
            eprintln!("berth import: the temporary store did not close cleanly: {e}");
        }
        written
    });
    if let Err(e) = up.release() {
        eprintln!("berth import: cannot give the import's lease up ({}); the next replica waits for it to pass", e.detail);
    }
    loaded
}

/// The export, imported into a new store in `dir`.
fn load_export(from: &crate::export::Endpoint, dir: &Path) -> Result<Store, String> {
    crate::export::import_at_start(dir, from)?;
    Store::open(&dir.join("berth.redb")).map_err(|e| format!("cannot open the imported store: {e}"))
}
