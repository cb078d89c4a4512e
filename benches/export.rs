//! Export and import throughput for a store of 10,000 builds with 100 MB of
//! logs, on SQLite and on PostgreSQL, next to the databases' own tools on
//! the same data in the same run: `sqlite3 .backup` of the exported file,
//! `pg_dump` of the exported database and its restore with `psql`.
//! Run: `cargo bench --bench export` (needs PostgreSQL on 127.0.0.1:5432
//! with trust auth, `sqlite3`, `pg_dump` and `psql`; says so and stops
//! otherwise).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use berth::model::{
    BuildKind, BuildRecord, BuildSnapshots, BuildStatus, DeploymentRecord, LastFinished, Snapshot,
    Source, Trigger, UpdatePolicy,
};
use berth::store::dump::{Loader, Row};
use berth::store::StoredEvent;

const BUILDS: u64 = 10_000;
const DEPLOYMENTS: u64 = 1_000;
/// Log bytes per build: 100 MB in all.
const LOG_PER_BUILD: usize = 10_000;
/// Lines per stored chunk.
const LINES_PER_CHUNK: usize = 64;

fn tool(name: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name} >/dev/null"))
        .status()
        .is_ok_and(|s| s.success())
}

fn run(cmd: &mut Command) -> f64 {
    let started = Instant::now();
    let out = cmd.output().expect("run a command");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    started.elapsed().as_secs_f64()
}

fn psql(db: &str, sql: &str) {
    run(Command::new("psql").args(["-h", "127.0.0.1", "-U", "postgres", "-qd", db, "-c", sql]));
}

/// Fills a store through the import path (the same rows an export carries).
fn make_store(dir: &Path) -> (u64, u64) {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let mut loader = Loader::create(&data.join("berth.redb")).unwrap();
    let source = Source {
        url: "https://example.org/modules.git".into(),
        rev: "v1".into(),
        digest: format!("sha256:{}", "ab".repeat(32)),
    };
    let snapshot = |d: u64| Snapshot {
        configuration: format!(
            r#"{{"domain":"d{d}.example.org","applications":{{"mastodon":{{"enable":true}}}}}}"#
        ),
        source: source.clone(),
    };
    let line = "building '/nix/store/0123456789abcdefghijklmnopqrstuv-some-package-1.2.3.drv'...\n";
    let mut log = String::new();
    while log.len() < LOG_PER_BUILD {
        log.push_str(line);
    }
    let lines: Vec<&str> = log.split_inclusive('\n').collect();
    let (mut rows, mut log_bytes) = (0u64, 0u64);
    let t0: i64 = 1_764_000_000_000;
    for d in 0..DEPLOYMENTS {
        loader
            .load(Row::Deployment(Box::new(DeploymentRecord {
                id: format!("d{d}"),
                revision: 10,
                suspended: false,
                method: "local".into(),
                domain: Some(format!("d{d}.example.org")),
                snapshot: snapshot(d),
                update_policy: UpdatePolicy::Manual,
                deployed: None,
                last_build: None,
                last_finished: Some(LastFinished {
                    build_id: 1,
                    kind: BuildKind::Deploy,
                    status: BuildStatus::Succeeded,
                }),
                pending_deploys: 0,
                pending_destroys: 0,
                running: None,
                event_seq: 0,
                created_at: t0,
                updated_at: t0,
                auto_rollback: true,
            })))
            .unwrap();
        rows += 1;
    }
    for b in 0..BUILDS {
        let id = uuid::Uuid::now_v7().as_u128();
        let d = b % DEPLOYMENTS;
        loader
            .load(Row::Build(Box::new(BuildRecord {
                status: if b % 10 == 0 {
                    BuildStatus::Failed
                } else {
                    BuildStatus::Succeeded
                },
                started_at: Some(t0 + b as i64),
                finished_at: Some(t0 + b as i64 + 1_000),
                exit_code: Some(0),
                log_bytes: log.len() as u64,
                log_lines: lines.len() as u64,
                log_chunks: lines.len().div_ceil(LINES_PER_CHUNK) as u32,
                event_seq: 2,
                seq_reserved: 2,
                log_first_seq: 2,
                ..BuildRecord::queued(
                    id,
                    format!("d{d}"),
                    BuildKind::Deploy,
                    Trigger::Submit,
                    "local".into(),
                    t0 + b as i64,
                )
            })))
            .unwrap();
        loader
            .load(Row::Snapshots {
                build: id,
                snapshots: Box::new(BuildSnapshots {
                    snapshot: snapshot(d),
                    previous: None,
                }),
            })
            .unwrap();
        for (n, chunk) in lines.chunks(LINES_PER_CHUNK).enumerate() {
            let text: String = chunk.concat();
            log_bytes += text.len() as u64;
            loader
                .load(Row::LogChunk {
                    build: id,
                    number: n as u32,
                    first_line: (n * LINES_PER_CHUNK) as u64,
                    text: text.into_bytes(),
                })
                .unwrap();
            rows += 1;
        }
        for seq in 1..=2 {
            loader
                .load(Row::BuildEvent {
                    build: id,
                    seq,
                    event: StoredEvent {
                        event: "status".into(),
                        data: format!(r#"{{"status":"running","seq":{seq}}}"#),
                        at: t0,
                    },
                })
                .unwrap();
            rows += 1;
        }
        rows += 2;
    }
    loader.finish(&[]).unwrap();
    (rows, log_bytes)
}

fn main() {
    if !(tool("sqlite3") && tool("pg_dump") && tool("psql")) {
        eprintln!("skipped: benches/export: needs sqlite3, pg_dump and psql");
        return;
    }
    let probe = Command::new("psql")
        .args([
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-qd",
            "test",
            "-c",
            "SELECT 1",
        ])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: benches/export: no PostgreSQL on 127.0.0.1:5432");
        return;
    }
    let dir = std::env::temp_dir().join(format!("berth-bench-export-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (rows, log_bytes) = make_store(&dir);
    let mb = log_bytes as f64 / 1e6;
    let berth = env!("CARGO_BIN_EXE_berth");
    let data = dir.join("data");
    let store_mb = std::fs::metadata(data.join("berth.redb")).unwrap().len() as f64 / 1e6;
    println!(
        "store: {BUILDS} builds, {rows} rows, {mb:.0} MB of log text ({store_mb:.0} MB redb file)\n"
    );
    let (db, restored) = (
        format!("berth_bench_{}", std::process::id()),
        format!("berth_bench_restore_{}", std::process::id()),
    );
    for name in [&db, &restored] {
        psql("test", &format!("DROP DATABASE IF EXISTS {name}"));
        psql("test", &format!("CREATE DATABASE {name}"));
    }
    let pg_url = format!("postgres://postgres@127.0.0.1:5432/{db}");
    let sqlite = dir.join("export.sqlite");
    let sqlite_url = format!("sqlite:{}", sqlite.display());

    let export_sqlite = run(Command::new(berth)
        .args(["export", "--data-dir"])
        .arg(&data)
        .args(["--to", &sqlite_url]));
    let backup = run(Command::new("sqlite3")
        .arg(&sqlite)
        .arg(format!(".backup {}", dir.join("backup.sqlite").display())));
    let import_sqlite = run(Command::new(berth)
        .args(["import", "--data-dir"])
        .arg(dir.join("from-sqlite"))
        .args(["--from", &sqlite_url]));

    let export_pg = run(Command::new(berth)
        .args(["export", "--data-dir"])
        .arg(&data)
        .args(["--to", &pg_url]));
    let dump_file = dir.join("dump.sql");
    let dump = run(Command::new("sh").arg("-c").arg(format!(
        "pg_dump -h 127.0.0.1 -U postgres {db} > {}",
        dump_file.display()
    )));
    let restore = run(Command::new("psql")
        .args([
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-q",
            "-o",
            "/dev/null",
            "-d",
            &restored,
        ])
        .arg("-f")
        .arg(&dump_file));
    let import_pg = run(Command::new(berth)
        .args(["import", "--data-dir"])
        .arg(dir.join("from-pg"))
        .args(["--from", &pg_url]));

    println!("| figure | berth | baseline, same run | ratio (baseline time / berth time) |");
    println!("|---|---|---|---|");
    let line = |what: &str, ours: f64, base_name: &str, base: f64| {
        common::record(
            &format!("{what} (10,000 builds, 100 MB of logs)"),
            &format!("{:.0} rows/s, {:.0} MB/s", rows as f64 / ours, mb / ours),
            &format!("{base_name}: {base:.2} s"),
            base / ours,
            None,
            true,
        );
        println!(
            "| {what} | {:.2} s: {:.0} rows/s, {:.1} MB/s | {base_name}: {:.2} s | {:.2}x |",
            ours,
            rows as f64 / ours,
            mb / ours,
            base,
            base / ours
        );
    };
    line(
        "export to SQLite",
        export_sqlite,
        "sqlite3 .backup of the export",
        backup,
    );
    line(
        "import from SQLite",
        import_sqlite,
        "sqlite3 .backup of the export",
        backup,
    );
    line(
        "export to PostgreSQL",
        export_pg,
        "pg_dump of the export",
        dump,
    );
    line(
        "import from PostgreSQL",
        import_pg,
        "psql restore of that dump",
        restore,
    );

    // The same export while `berth serve` holds the store (alone, its
    // default): it reads a snapshot the server copies for it
    // (src/store/snapshot.rs), so its cost over the stopped store's export
    // is that copy.
    let deployer = dir.join("idle.sh");
    std::fs::write(&deployer, "#!/bin/sh\ncase \"$1\" in describe) cat >/dev/null; printf '%s' '{\"methods\":[\"local\"],\"default_method\":\"local\",\"catalog\":[],\"schema\":null}' > \"$BERTH_RESULT\";; *) cat >/dev/null; printf '%s' '{\"nodes\":[]}' > \"$BERTH_RESULT\";; esac\n").unwrap();
    run(Command::new("chmod").arg("+x").arg(&deployer));
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut server = rt
        .block_on(common::start_berth(&dir, &deployer, &[], &[]))
        .child;
    let live_sqlite = dir.join("live.sqlite");
    let export_live = run(Command::new(berth)
        .args(["export", "--data-dir"])
        .arg(&data)
        .args(["--to", &format!("sqlite:{}", live_sqlite.display())]));
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = server.wait();
    common::record(
        "export to SQLite while berth serve holds the store (from its snapshot)",
        &format!("{export_live:.2} s"),
        &format!("the same export of the stopped store: {export_sqlite:.2} s"),
        export_sqlite / export_live,
        None,
        true,
    );
    println!(
        "| export to SQLite, live (snapshot) | {export_live:.2} s | the stopped store's export: {export_sqlite:.2} s | {:.2}x |",
        export_sqlite / export_live
    );

    for name in [&db, &restored] {
        psql(
            "test",
            &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
