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

use crate::settings::Settings;
use crate::store::location::PgTarget;
use crate::store::upstream::{LeaseKeeper, Limits, Upstream};
use crate::store::{Sharing, Store};

/// How often a waiting replica looks whether the lease has passed.
const STANDBY_POLL: Duration = Duration::from_secs(1);
/// Bytes of a replica id (random, hex in `<data-dir>/replica-id`).
const REPLICA_ID_BYTES: usize = 8;

/// What a replica's start made: its store, and a receiver that fires
/// (with why) once it no longer leads.
pub struct Started {
    pub store: Store,
    /// Held while the process lives: one replica per data dir.
    pub data_dir_lock: nix::fcntl::Flock<std::fs::File>,
    pub replica: String,
    pub lost: tokio::sync::watch::Receiver<Option<String>>,
}

fn limits(settings: &Settings) -> Limits {
    Limits {
        connect_timeout: settings.store_connect_timeout,
        statement_timeout: settings.store_timeout,
        migrate_timeout: settings.store_migrate_timeout,
        dev: settings.dev,
    }
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

/// Starts this replica on `target`; blocks until it leads.
pub fn start(settings: &Settings, target: &PgTarget) -> Result<Started, String> {
    let data_dir_lock = lock_data_dir(&settings.data_dir)?;
    let mut up = Upstream::connect(target, limits(settings))?;
    let found = up.prepare()?;
    let replica = replica_id(&settings.data_dir)?;
    let fence = wait_for_lease(&mut up, &replica, settings.lease_ttl)?;
    tracing::info!(%replica, fence, database = %target.redacted(), "this replica leads the cluster");
    let path = settings.db_path();
    remove_cache(&path)?;
    let import = match (&settings.import_from, found.empty) {
        (Some(source), true) => Some(source.clone()),
        (Some(_), false) => {
            tracing::info!(
                "--import-from: the store's database holds a store already; nothing imported"
            );
            None
        }
        (None, _) => None,
    };
    if !found.empty {
        let db = redb::Database::create(&path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let rows = up
            .load_into(&db)
            .map_err(|e| format!("cannot load the store from its database: {e}"))?;
        tracing::info!(rows, "loaded the store from its database");
    }
    if let Some(source) = &import {
        let from =
            crate::export::Endpoint::parse(source).map_err(|e| format!("--import-from: {e}"))?;
        crate::export::import_at_start(&settings.data_dir, &from)?;
    }
    let keeper = Upstream::connect(target, limits(settings))?;
    let sharing = Sharing::Exclusive {
        checkpoint_every: settings.checkpoint_interval,
    };
    let store = Store::open_behind(&path, sharing, settings.cache_size, Some(up))
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    // A new cluster's first rows, an import, or rows a migration of the
    // layout changed at open: the database takes the whole store.
    if found.empty || found.layout != crate::store::LAYOUT_VERSION {
        store
            .upload_all()
            .map_err(|e| format!("cannot write the store to its database: {e}"))?;
    }
    let (lost_tx, lost) = tokio::sync::watch::channel(None);
    LeaseKeeper::start(keeper, fence, settings.lease_ttl, move |why| {
        tracing::error!(why, "this replica no longer leads the cluster; stopping");
        let _ = lost_tx.send(Some(why.to_string()));
    })?;
    Ok(Started {
        store,
        data_dir_lock,
        replica,
        lost,
    })
}

/// Waits (as a standby) until the lease is free, then takes it.
fn wait_for_lease(up: &mut Upstream, replica: &str, ttl: Duration) -> Result<i64, String> {
    let mut told = false;
    loop {
        match up.try_lead(replica, ttl) {
            Ok(Some(fence)) => return Ok(fence),
            Ok(None) => {
                if !told {
                    let holder = up.leader().map(|(r, _)| r).unwrap_or_default();
                    tracing::info!(leader = %holder, "standby: another replica leads; waiting for its lease to pass");
                    told = true;
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot reach the store's database; trying again"),
        }
        std::thread::sleep(STANDBY_POLL);
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
