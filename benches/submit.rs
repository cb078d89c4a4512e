//! Submit throughput with 1 and 32 connections from `wrk` (tools/submit.lua:
//! a new deployment and idempotency key per request, no eval:
//! `--eval-slots 0`, a deployer that blocks so builds do not compete)
//! against a 128 B append + fdatasync loop and SQLite doing the same
//! transaction (WAL, synchronous=FULL; 1 and 32 writers) on the same disk
//! in the same run; RSS of the idle server and with 10,000 deployments.
//!
//! Run: `cargo bench --bench submit` (release build of berth).

mod common;

use std::io::Write;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PHASE: Duration = Duration::from_secs(5);

fn fsync_rate(dir: &std::path::Path) -> f64 {
    let path = dir.join("fsync-loop");
    let mut f = std::fs::File::create(&path).unwrap();
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < PHASE {
        f.write_all(&[b'x'; 128]).unwrap();
        f.sync_data().unwrap();
        n += 1;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// `wrk` with tools/submit.lua for `PHASE`: (submits/s, p99 in ms).
fn wrk_phase(base: &str, token: &str, connections: usize) -> (f64, f64) {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/submit.lua");
    let threads = connections.min(2).to_string();
    let out = Command::new("wrk")
        .args(["-t", &threads, "-c", &connections.to_string()])
        .args(["-d", &format!("{}s", PHASE.as_secs())])
        .arg("-s")
        .arg(&script)
        .arg(base)
        .env("BERTH_TOKEN", token.trim())
        .output()
        .expect("run wrk");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("wrk printed no figures: {text}"));
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["failed"], 0, "some submits failed: {v}");
    let rate = v["requests"].as_f64().unwrap() / v["seconds"].as_f64().unwrap();
    (rate, v["p99_us"].as_f64().unwrap() / 1000.0)
}

/// The same work in SQLite (WAL, synchronous=FULL), one transaction per
/// submit: upsert the deployment, insert the build, its event and the
/// idempotency record. `writers` threads, each its own connection.
fn sqlite_rate(dir: &std::path::Path, writers: usize) -> f64 {
    let path = dir.join(format!("baseline-{writers}.sqlite"));
    let _ = std::fs::remove_file(&path);
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE deployments (id TEXT PRIMARY KEY, revision INTEGER, record BLOB);
             CREATE TABLE builds (id BLOB PRIMARY KEY, deployment TEXT, record BLOB);
             CREATE TABLE events (deployment TEXT, seq INTEGER, data TEXT, PRIMARY KEY (deployment, seq));
             CREATE TABLE idempotency (key TEXT PRIMARY KEY, response BLOB, expires INTEGER);",
        )
        .unwrap();
    }
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let record = vec![7u8; 600];
    std::thread::scope(|scope| {
        for w in 0..writers {
            let (path, done, record) = (&path, done.clone(), &record);
            scope.spawn(move || {
                let mut c = rusqlite::Connection::open(path).unwrap();
                c.execute_batch("PRAGMA synchronous = FULL; PRAGMA busy_timeout = 10000;")
                    .unwrap();
                let mut n = 0u64;
                while start.elapsed() < PHASE {
                    n += 1;
                    let id = format!("w{w}n{n}");
                    let tx = c
                        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                        .unwrap();
                    tx.execute(
                        "INSERT INTO deployments VALUES (?1, 1, ?2) ON CONFLICT (id) DO UPDATE SET revision = revision + 1, record = ?2",
                        rusqlite::params![id, record],
                    )
                    .unwrap();
                    tx.execute(
                        "INSERT INTO builds VALUES (?1, ?2, ?3)",
                        rusqlite::params![uuid::Uuid::now_v7().as_bytes().to_vec(), id, record],
                    )
                    .unwrap();
                    tx.execute(
                        "INSERT INTO events VALUES (?1, 1, ?2)",
                        rusqlite::params![id, r#"{"state":"building"}"#],
                    )
                    .unwrap();
                    tx.execute(
                        "INSERT INTO idempotency VALUES (?1, ?2, 0)",
                        rusqlite::params![format!("key-{id}"), record],
                    )
                    .unwrap();
                    tx.commit().unwrap();
                    done.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// Starts berth with a deployer whose builds never finish (submits only queue).
fn start(
    dir: &std::path::Path,
    rt: &tokio::runtime::Runtime,
) -> (std::process::Child, String, String) {
    std::fs::create_dir_all(dir).unwrap();
    let deployer = dir.join("sleepy.sh");
    std::fs::write(&deployer, "#!/bin/sh\ncase \"$1\" in describe) cat >/dev/null; printf '%s' '{\"methods\":[\"local\"],\"default_method\":\"local\",\"catalog\":[],\"schema\":null}' > \"$BERTH_RESULT\";; *) cat >/dev/null; sleep 3600;; esac\n").unwrap();
    Command::new("chmod")
        .arg("+x")
        .arg(&deployer)
        .status()
        .unwrap();
    let started = rt.block_on(common::start_berth(
        dir,
        &deployer,
        &[
            "--eval-slots",
            "0",
            "--build-slots",
            "1",
            "--max-queued-builds",
            "1000000",
        ],
        &[],
    ));
    let (child, base, token) = (started.child, started.base, started.token);
    (child, base, token)
}

fn stop(mut child: std::process::Child, dir: &std::path::Path) {
    let _ = child.kill();
    let _ = child.wait();
    // The one running build's deployer sleeps in its own process group.
    let _ = Command::new("pkill")
        .arg("-f")
        .arg(dir.join("sleepy.sh"))
        .status();
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let root = std::env::temp_dir().join(format!("berth-bench-submit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let rt = tokio::runtime::Runtime::new().unwrap();

    // Throughput, against an fsync loop and SQLite on the same disk, with
    // wrk as the load (a lean client: a heavy one on these 2 cores would
    // measure itself).
    let dir = root.join("throughput");
    let (child, base, token) = start(&dir, &rt);
    let fsyncs = fsync_rate(&dir);
    let sqlite_one = sqlite_rate(&dir, 1);
    let sqlite_many = sqlite_rate(&dir, 32);
    let wrk_here = Command::new("wrk").arg("--version").output().is_ok();
    let (one, many) = if wrk_here {
        (wrk_phase(&base, &token, 1), wrk_phase(&base, &token, 32))
    } else {
        println!("skipped: submit throughput: needs wrk (apt install wrk)");
        ((0.0, 0.0), (0.0, 0.0))
    };
    stop(child, &dir);
    if wrk_here {
        let fsync = format!("128 B append + fdatasync loop: {fsyncs:.0}/s");
        common::record(
            "submits/s, 1 connection",
            &format!("{:.0}/s (p99 {:.1} ms)", one.0, one.1),
            &fsync,
            one.0 / fsyncs,
            Some(0.4),
            true,
        );
        common::record(
            "submits/s, 32 connections",
            &format!("{:.0}/s (p99 {:.1} ms)", many.0, many.1),
            &fsync,
            many.0 / fsyncs,
            Some(5.0),
            true,
        );
        common::record(
            "submits/s, 1 writer",
            &format!("{:.0}/s", one.0),
            &format!("SQLite WAL synchronous=FULL, same transaction: {sqlite_one:.0}/s"),
            one.0 / sqlite_one,
            Some(0.6),
            true,
        );
        common::record(
            "submits/s, 32 writers",
            &format!("{:.0}/s", many.0),
            &format!("SQLite as above, 32 writers: {sqlite_many:.0}/s"),
            many.0 / sqlite_many,
            Some(3.0),
            true,
        );
    }

    // Memory: a fresh server, idle, then with exactly 10,000 deployments.
    let dir = root.join("memory");
    let (child, base, token) = start(&dir, &rt);
    std::thread::sleep(Duration::from_millis(500));
    let idle_rss = rss_kib(child.id());
    rt.block_on(async {
        let http = reqwest::Client::new();
        let mut set = tokio::task::JoinSet::new();
        for n in 0..10_000u64 {
            let (http, base, token) = (http.clone(), base.clone(), token.clone());
            set.spawn(async move {
                let body = serde_json::json!({"configuration": {"domain": format!("d{n}.example.org")}, "mode": "enqueue"});
                let r = http.post(format!("{base}/v1/deployments/d{n}/submit")).bearer_auth(&token).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 202);
            });
            if set.len() >= 32 {
                set.join_next().await;
            }
        }
        while set.join_next().await.is_some() {}
    });
    let full_rss = rss_kib(child.id());
    let store_bytes = std::fs::metadata(dir.join("data/berth.redb"))
        .map(|m| m.len())
        .unwrap_or(0);
    stop(child, &dir);

    common::record(
        "RSS idle",
        &format!("{:.1} MiB", idle_rss as f64 / 1024.0),
        "goal: under 30 MiB",
        idle_rss as f64 / 1024.0 / 30.0,
        Some(1.0),
        false,
    );
    println!(
        "RSS with 10,000 deployments: {:.1} MiB; store file {:.1} MiB",
        full_rss as f64 / 1024.0,
        store_bytes as f64 / f64::from(1 << 20)
    );
    let _ = std::fs::remove_dir_all(&root);
}
