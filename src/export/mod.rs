//! `berth export` / `berth import` / `berth serve --import-from`: the whole
//! store to and from PostgreSQL or SQLite (storage.md "Export and import").
//!
//! Why it exists: self-hosters want to query their history with `psql` or
//! `sqlite3`, back it up with their own tools, and move a service that kept
//! its state in SQLite or PostgreSQL onto berth without losing it.
//!
//! How: the store hands out its carried tables row by row from one read
//! snapshot (`store::dump`), `schema` maps each row to a relational row, and
//! a target (`sqlite`, `postgres`) writes them all in one transaction. An
//! import reads the relational rows back, rebuilds the store rows, and loads
//! them into a new redb file that replaces the store only once complete.

pub mod postgres;
mod progress;
pub mod schema;
pub mod sqlite;

use std::path::{Path, PathBuf};

use crate::model::{format_time, now_millis};
use crate::store::dump::{self, Loader, IMPORTED_AT_KEY, IMPORTED_FROM_KEY};
use crate::store::tables::Table;
use crate::store::{ReadOnlyStore, StoreError};
use progress::Progress;
use schema::{from_values, to_values, RelTable, Value, EXPORT_SCHEMA_VERSION, META_TABLE, TABLES};

/// The store file inside a data dir.
fn store_path(data_dir: &Path) -> PathBuf {
    data_dir.join("berth.redb")
}

/// Where an export goes or an import comes from.
#[derive(Debug, Clone)]
pub enum Endpoint {
    Sqlite(PathBuf),
    Postgres(String),
}

impl Endpoint {
    /// `sqlite:PATH` or `postgres://...` / `postgresql://...`.
    pub fn parse(text: &str) -> Result<Endpoint, String> {
        if let Some(path) = text.strip_prefix("sqlite:") {
            if path.is_empty() {
                return Err("sqlite: needs a file path (sqlite:/var/backups/berth.sqlite)".into());
            }
            return Ok(Endpoint::Sqlite(PathBuf::from(path)));
        }
        if text.starts_with("postgres://") || text.starts_with("postgresql://") {
            text.parse::<tokio_postgres::Config>()
                .map_err(|_| "the PostgreSQL URL does not parse (postgres://user@host:5432/db)")?;
            return Ok(Endpoint::Postgres(text.to_string()));
        }
        Err("a target is sqlite:PATH or postgres://user@host:port/database".into())
    }

    /// A name for the endpoint that holds no password: the path of a SQLite
    /// file (absolute when it exists), or user, hosts, ports and database.
    pub fn identity(&self) -> String {
        match self {
            Endpoint::Sqlite(path) => {
                let shown = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
                format!("sqlite:{}", shown.display())
            }
            Endpoint::Postgres(url) => match url.parse::<tokio_postgres::Config>() {
                Ok(c) => {
                    let hosts: Vec<String> = c
                        .get_hosts()
                        .iter()
                        .zip(c.get_ports().iter().chain(std::iter::repeat(&5432)))
                        .map(|(h, port)| match h {
                            tokio_postgres::config::Host::Tcp(name) => format!("{name}:{port}"),
                            tokio_postgres::config::Host::Unix(dir) => {
                                format!("[{}]:{port}", dir.display())
                            }
                        })
                        .collect();
                    format!(
                        "postgres://{}@{}/{}",
                        c.get_user().unwrap_or(""),
                        hosts.join(","),
                        c.get_dbname().unwrap_or("")
                    )
                }
                Err(_) => "postgres://(unparsable)".into(),
            },
        }
    }
}

/// A relational database an export writes, in one transaction.
pub trait Target {
    fn begin_table(&mut self, table: &'static RelTable) -> Result<(), String>;
    fn row(&mut self, values: &[Value]) -> Result<(), String>;
    fn end_table(&mut self) -> Result<(), String>;
    /// Writes `berth_meta` and commits.
    fn commit(self: Box<Self>, meta: &[(&str, String)]) -> Result<(), String>;
}

/// A relational database an import reads, in one snapshot.
pub trait Origin {
    /// The export schema version the origin holds (`berth_meta`).
    fn version(&self) -> u32;

    fn rows(
        &mut self,
        table: &'static RelTable,
        each: &mut dyn FnMut(Vec<Value>) -> Result<(), String>,
    ) -> Result<(), String>;
}

/// Whether an export may write into a target holding `tables` (with
/// `berth_meta` at `version`); `Ok(true)` when it must first drop the
/// berth tables there. Tables that are not a berth export are never
/// touched, `--replace` or not.
pub fn judge_target(
    tables: &[String],
    version: Option<u32>,
    replace: bool,
    target: &str,
) -> Result<bool, String> {
    if tables.iter().any(|t| t == META_TABLE) {
        match version {
            Some(v) if v > EXPORT_SCHEMA_VERSION => Err(format!(
                "{target} holds a berth export of schema version {v}, newer than this berth writes ({EXPORT_SCHEMA_VERSION}); use a newer berth or another target"
            )),
            None => Err(format!(
                "{target} has a {META_TABLE} table without a schema version; it is not a berth export this berth can replace"
            )),
            Some(_) if !replace => Err(format!(
                "{target} already holds a berth export; pass --replace to overwrite it"
            )),
            Some(_) => Ok(true),
        }
    } else if !tables.is_empty() {
        Err(format!(
            "{target} holds {} table(s) that are not a berth export; export into an empty database (or schema) or a new SQLite file",
            tables.len()
        ))
    } else {
        Ok(false)
    }
}

/// Whether an import may read a source holding `tables`.
/// Whether an import may read `tables` (with `berth_meta` at `version`);
/// the version it reads.
pub fn judge_origin(tables: &[String], version: Option<u32>, source: &str) -> Result<u32, String> {
    if !tables.iter().any(|t| t == META_TABLE) {
        return Err(format!(
            "{source} is not a berth export (it has no {META_TABLE} table)"
        ));
    }
    match version {
        Some(v) if v <= EXPORT_SCHEMA_VERSION => Ok(v),
        Some(v) => Err(format!(
            "{source} holds a berth export of schema version {v}, newer than this berth reads ({EXPORT_SCHEMA_VERSION}); use a newer berth"
        )),
        None => Err(format!(
            "{source} has a {META_TABLE} table without a schema version"
        )),
    }
}

fn store_error(e: StoreError) -> String {
    e.detail
}

/// Figures of one run, for the summary line.
#[derive(Debug, Default, Clone, Copy)]
pub struct Totals {
    pub rows: u64,
    pub bytes: u64,
}

/// Exports the store in `data_dir` to `to`. Reads one snapshot, also while
/// `berth serve` runs on it.
pub fn export(data_dir: &Path, to: &Endpoint, replace: bool) -> Result<Totals, String> {
    let path = store_path(data_dir);
    if !path.is_file() {
        return Err(format!("no store at {}", path.display()));
    }
    let store =
        ReadOnlyStore::open(&path, crate::store::SnapshotScope::All).map_err(store_error)?;
    let rx = store.read().map_err(store_error)?;
    let identity = to.identity();
    let mut target: Box<dyn Target> = match to {
        Endpoint::Sqlite(file) => Box::new(sqlite::SqliteTarget::open(file, replace)?),
        Endpoint::Postgres(url) => Box::new(postgres::PgTarget::open(url, &identity, replace)?),
    };
    let progress = Progress::new("exported");
    let mut totals = Totals::default();
    for table in TABLES {
        let total = rx.carried_rows(table.store_table).map_err(store_error)?;
        let mut bar = progress.table(table.name, total);
        target.begin_table(table)?;
        let mut failure: Option<String> = None;
        let dumped = rx.dump(table.store_table, &mut |row| {
            let written = to_values(&row).and_then(|values| {
                bar.row(values.iter().map(Value::size).sum());
                target.row(&values)
            });
            written.map_err(|e| {
                failure = Some(e);
                StoreError::other("the export stopped")
            })
        });
        if let Some(e) = failure {
            return Err(format!("table {}: {e}", table.name));
        }
        dumped.map_err(store_error)?;
        target.end_table()?;
        totals.rows += bar.rows();
        totals.bytes += bar.bytes();
        bar.finish();
    }
    let meta = [
        ("schema_version", EXPORT_SCHEMA_VERSION.to_string()),
        ("berth_version", env!("CARGO_PKG_VERSION").to_string()),
        ("exported_at", format_time(now_millis())),
    ];
    target.commit(&meta)?;
    Ok(totals)
}

/// Imports `from` into the store of `data_dir`: refuses a store holding
/// state unless `replace`; writes a new file beside it and moves it over
/// the store only once everything is in and durable.
pub fn import(data_dir: &Path, from: &Endpoint, replace: bool) -> Result<Totals, String> {
    // storage.md: the data dir is berth's alone (0700), like `serve` makes it.
    crate::durable::create_dir_all(data_dir, 0o700)
        .map_err(|e| format!("cannot create {}: {e}", data_dir.display()))?;
    let path = store_path(data_dir);
    // Rows only the redo log holds (berth killed while it held the store
    // alone) are part of the store: the file alone would look emptier.
    if crate::store::redo::unapplied(&path).map_err(store_error)? {
        return Err(format!(
            "{} holds writes not yet in the store: start `berth serve` on this data dir once \
             (and stop it) so they are applied, then import",
            crate::store::redo::path_of(&path).display()
        ));
    }
    if path.exists() {
        let state = dump::inspect(&path).map_err(store_error)?;
        if state.holds_state && !replace {
            return Err(format!(
                "the store in {} already holds deployments, builds or audit events; pass --replace to overwrite it",
                data_dir.display()
            ));
        }
    }
    let identity = from.identity();
    let mut origin: Box<dyn Origin> = match from {
        Endpoint::Sqlite(file) => Box::new(sqlite::SqliteOrigin::open(file)?),
        Endpoint::Postgres(url) => Box::new(postgres::PgOrigin::open(url, &identity)?),
    };
    let partial = data_dir.join("berth.redb.importing");
    // Ours by name: left behind by an import that was stopped.
    let _ = std::fs::remove_file(&partial);
    let totals = load_into(&partial, origin.as_mut(), &identity);
    let totals = match totals {
        Ok(t) => t,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
    };
    // The store holds every configuration and log: readable by berth only,
    // before it has its name.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| format!("cannot make the imported store private (0600): {e}"))?;
    }
    // The old store's (empty) redo log goes first: nothing of it may be
    // applied to the new store.
    crate::store::redo::remove(&path).map_err(store_error)?;
    std::fs::rename(&partial, &path)
        .and_then(|_| std::fs::File::open(data_dir).and_then(|d| d.sync_all()))
        .map_err(|e| format!("cannot move the imported store into place: {e}"))?;
    Ok(totals)
}

fn load_into(partial: &Path, origin: &mut dyn Origin, identity: &str) -> Result<Totals, String> {
    let mut loader = Loader::create(partial).map_err(store_error)?;
    let progress = Progress::new("imported");
    let mut totals = Totals::default();
    for store_table in Table::carried() {
        let table = schema::table_for(store_table)
            .ok_or_else(|| format!("no relational table for {}", store_table.name()))?;
        if store_table == Table::Idempotency && origin.version() < 2 {
            // See `schema::OLDEST_READ_EXPORT_VERSION`.
            eprintln!(
                "berth import: the idempotency records of a version-{} export are not imported (they expire within 24 h; retried requests run again)",
                origin.version()
            );
            continue;
        }
        if matches!(store_table, Table::Webhooks | Table::WebhookDeliveries)
            && origin.version() < schema::FIRST_EXPORT_WITH_WEBHOOKS
        {
            // An export from before webhooks has no subscriptions.
            continue;
        }
        if matches!(store_table, Table::Tokens | Table::Attempts)
            && origin.version() < schema::FIRST_EXPORT_WITH_WORKERS
        {
            // An export from before workers has no tokens and no attempts.
            continue;
        }
        if matches!(
            store_table,
            Table::WorkStates | Table::WorkStateBlobs | Table::WorkStatePieces
        ) && origin.version() < schema::FIRST_EXPORT_WITH_WORK_STATES
        {
            continue;
        }
        if matches!(
            store_table,
            Table::Rollouts | Table::RolloutPolicies | Table::Freezes
        ) && origin.version() < schema::FIRST_EXPORT_WITH_ROLLOUTS
        {
            continue;
        }
        if store_table == Table::RolloutResults
            && origin.version() < schema::FIRST_EXPORT_WITH_ROLLOUT_RESULTS
        {
            continue;
        }
        if store_table == Table::Nodes && origin.version() < schema::FIRST_EXPORT_WITH_NODES {
            continue;
        }
        let mut bar = progress.table(table.name, 0);
        origin.rows(table, &mut |values| {
            bar.row(values.iter().map(Value::size).sum());
            let row = from_values(table, values)?;
            loader.load(row).map_err(store_error)
        })?;
        totals.rows += bar.rows();
        totals.bytes += bar.bytes();
        bar.finish();
    }
    let meta = [
        (IMPORTED_FROM_KEY, identity.as_bytes().to_vec()),
        (IMPORTED_AT_KEY, format_time(now_millis()).into_bytes()),
    ];
    loader.finish(&meta).map_err(store_error)?;
    Ok(totals)
}

/// `serve --import-from`: imports once. A store that records an import is
/// left alone (a restart with the flag still set imports nothing); a store
/// that holds state of its own is refused rather than replaced.
pub fn import_at_start(data_dir: &Path, from: &Endpoint) -> Result<(), String> {
    let path = store_path(data_dir);
    // Rows only the redo log holds (berth killed while it held the store
    // alone) are part of the store: the file alone would look emptier.
    if crate::store::redo::unapplied(&path).map_err(store_error)? {
        return Err(format!(
            "{} holds writes not yet in the store: start `berth serve` on this data dir once \
             (and stop it) so they are applied, then import",
            crate::store::redo::path_of(&path).display()
        ));
    }
    if path.exists() {
        let state = dump::inspect(&path).map_err(store_error)?;
        if let Some(previous) = state.imported_from {
            tracing::info!(
                source = %previous,
                at = %state.imported_at.unwrap_or_default(),
                "--import-from: this store was imported already; not importing again"
            );
            return Ok(());
        }
        if state.holds_state {
            return Err(
                "--import-from: the store already holds state that was not imported; remove the flag, or stop berth and run `berth import --replace`".into(),
            );
        }
    }
    let totals = import(data_dir, from, true)?;
    tracing::info!(
        source = %from.identity(),
        rows = totals.rows,
        bytes = totals.bytes,
        "imported the store"
    );
    Ok(())
}

pub fn run_export(data_dir: &Path, to: &str, replace: bool) -> i32 {
    let result = Endpoint::parse(to).and_then(|to| {
        let started = std::time::Instant::now();
        export(data_dir, &to, replace).map(|t| (t, started.elapsed(), to.identity()))
    });
    report("export", result)
}

pub fn run_import(data_dir: &Path, from: &str, replace: bool) -> i32 {
    let result = Endpoint::parse(from).and_then(|from| {
        let started = std::time::Instant::now();
        import(data_dir, &from, replace).map(|t| (t, started.elapsed(), from.identity()))
    });
    report("import", result)
}

fn report(verb: &str, result: Result<(Totals, std::time::Duration, String), String>) -> i32 {
    match result {
        Ok((totals, took, identity)) => {
            let secs = took.as_secs_f64().max(1e-9);
            eprintln!(
                "{verb} done ({identity}): {} rows, {:.1} MB in {:.2} s ({:.0} rows/s, {:.1} MB/s)",
                totals.rows,
                totals.bytes as f64 / 1e6,
                secs,
                totals.rows as f64 / secs,
                totals.bytes as f64 / 1e6 / secs
            );
            0
        }
        Err(e) => {
            eprintln!("berth {verb}: {e}");
            eprintln!("nothing was changed");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_never_holds_the_password() {
        let e = Endpoint::parse("postgres://alice:s3cret@db.example.org:6543/berth").unwrap();
        let id = e.identity();
        assert_eq!(id, "postgres://alice@db.example.org:6543/berth");
        assert!(!id.contains("s3cret"));
        assert!(Endpoint::parse("mysql://x").is_err());
        assert!(Endpoint::parse("sqlite:").is_err());
    }

    #[test]
    fn targets_are_judged_before_anything_is_written() {
        let none: Vec<String> = vec![];
        let ours = vec![META_TABLE.to_string(), "builds".to_string()];
        let theirs = vec!["customers".to_string()];
        assert_eq!(judge_target(&none, None, false, "t"), Ok(false));
        assert!(judge_target(&ours, Some(1), false, "t")
            .unwrap_err()
            .contains("--replace"));
        assert_eq!(judge_target(&ours, Some(1), true, "t"), Ok(true));
        assert!(
            judge_target(&ours, Some(EXPORT_SCHEMA_VERSION + 1), true, "t")
                .unwrap_err()
                .contains("newer")
        );
        assert!(judge_target(&theirs, None, true, "t")
            .unwrap_err()
            .contains("not a berth export"));
        assert!(judge_origin(&theirs, None, "s").is_err());
        assert!(judge_origin(&ours, Some(EXPORT_SCHEMA_VERSION + 1), "s")
            .unwrap_err()
            .contains("newer"));
        assert!(judge_origin(&ours, Some(1), "s").is_ok());
    }
}

#[cfg(test)]
mod doc_tests {
    /// docs/export-schema.md shows the DDL this berth runs, word for word.
    #[test]
    fn the_doc_shows_the_schema_this_berth_writes() {
        let doc = include_str!("../../docs/export-schema.md");
        for (name, ddl) in [
            ("PostgreSQL", super::postgres::ddl()),
            ("SQLite", super::sqlite::ddl()),
        ] {
            assert!(
                doc.contains(&ddl),
                "docs/export-schema.md lacks the {name} DDL; it is now:\n{ddl}"
            );
        }
    }
}
