//! Cluster mode (docs/cluster.md) on the machine's PostgreSQL, each figure
//! next to a baseline in the same run:
//!
//! - submits/s at 32 connections, one replica, against 32 plain
//!   PostgreSQL clients each committing a submit's rows (the same count
//!   and bytes as berth's, measured from the database) in a loop, one
//!   transaction each;
//! - submits/s through a round-robin proxy to three replicas against the
//!   same proxy to the one that leads;
//! - failover: from kill -9 of the leader to the proxy's next accepted
//!   submit, against the lease;
//! - a log line's latency (deployer's write to a subscriber's read) on a
//!   stream opened at a standby, against one opened at the leader, both
//!   on the same build at once.
//!
//! Run: `cargo bench --bench cluster` (needs wrk and PostgreSQL on
//! 127.0.0.1:5432 with trust auth).

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SECONDS: Duration = Duration::from_secs(8);
const CONNECTIONS: usize = 32;
const LEASE: &str = "5s";
const ADMIN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=postgres";

async fn pg(conn: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(conn, tokio_postgres::NoTls)
        .await
        .expect("PostgreSQL on 127.0.0.1:5432");
    tokio::spawn(connection);
    client
}

/// A fresh database; its URL.
async fn database(name: &str) -> String {
    let admin = pg(ADMIN).await;
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await
        .unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    format!("postgres://postgres@127.0.0.1:5432/{name}")
}

fn secrets_from(from: &Path, to: &Path) {
    std::fs::create_dir_all(to.join("data")).unwrap();
    for name in [
        "service-token",
        "cursor-key",
        "callback-secret",
        "audit-signing.key",
    ] {
        std::fs::copy(from.join("data").join(name), to.join("data").join(name)).unwrap();
    }
}

/// A round-robin TCP proxy on a free port over `targets`, one connection
/// to the next target in turn; its address.
async fn round_robin(targets: Vec<String>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let next = Arc::new(AtomicU64::new(0));
    tokio::spawn(async move {
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                continue;
            };
            client.set_nodelay(true).unwrap();
            let n = next.fetch_add(1, Ordering::Relaxed) as usize;
            let targets = targets.clone();
            tokio::spawn(async move {
                // A target that refuses (a dead replica) passes the
                // connection to the next one, as a proxy's retry would.
                for i in 0..targets.len() {
                    let target = &targets[(n + i) % targets.len()];
                    if let Ok(mut server) = tokio::net::TcpStream::connect(target).await {
                        server.set_nodelay(true).unwrap();
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        return;
                    }
                }
            });
        }
    });
    format!("http://{address}")
}

/// 32 plain clients, each committing `rows` rows of `bytes` bytes in one
/// transaction (with the fence check berth makes) in a loop: commits/s.
async fn plain_clients(url: &str, rows: usize, bytes: usize) -> f64 {
    let conn = url.replace(
        "postgres://postgres@127.0.0.1:5432/",
        "host=127.0.0.1 port=5432 user=postgres dbname=",
    );
    let setup = pg(&conn).await;
    setup
        .batch_execute(
            "CREATE TABLE bench_rows (tbl text, k bytea, v bytea, PRIMARY KEY (tbl, k));
             CREATE TABLE bench_leader (id int PRIMARY KEY, fence bigint, batch bigint);
             INSERT INTO bench_leader VALUES (1, 1, 0);",
        )
        .await
        .unwrap();
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + SECONDS;
    let mut tasks = Vec::new();
    for client_no in 0..CONNECTIONS {
        let (conn, done) = (conn.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let c = pg(&conn).await;
            c.batch_execute("SET synchronous_commit = on").await.unwrap();
            let mut n: u64 = 0;
            while Instant::now() < deadline {
                let names: Vec<String> = (0..rows).map(|i| format!("t{}", i % 8)).collect();
                let keys: Vec<Vec<u8>> = (0..rows)
                    .map(|i| format!("{client_no}-{n}-{i}").into_bytes())
                    .collect();
                let values: Vec<Vec<u8>> = (0..rows).map(|_| vec![7u8; bytes]).collect();
                c.batch_execute("BEGIN").await.unwrap();
                c.execute("UPDATE bench_leader SET batch = batch + 1 WHERE id = 1 AND fence = 1", &[])
                    .await
                    .unwrap();
                c.execute(
                    "INSERT INTO bench_rows SELECT * FROM unnest($1::text[], $2::bytea[], $3::bytea[])
                     ON CONFLICT (tbl, k) DO UPDATE SET v = excluded.v",
                    &[&names, &keys, &values],
                )
                .await
                .unwrap();
                c.batch_execute("COMMIT").await.unwrap();
                n += 1;
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / SECONDS.as_secs_f64()
}

/// Rows and bytes per submit, from what the database holds after `submits`.
async fn rows_per_submit(url: &str, submits: f64) -> (usize, usize) {
    let conn = url.replace(
        "postgres://postgres@127.0.0.1:5432/",
        "host=127.0.0.1 port=5432 user=postgres dbname=",
    );
    let c = pg(&conn).await;
    let row = c
        .query_one(
            "SELECT count(*), coalesce(sum(length(k) + length(v)), 0)::bigint FROM berth_rows",
            &[],
        )
        .await
        .unwrap();
    let (rows, bytes): (i64, i64) = (row.get(0), row.get(1));
    let per = (rows as f64 / submits).max(1.0);
    (
        per.round() as usize,
        (bytes as f64 / rows.max(1) as f64) as usize,
    )
}

fn main() {
    if !common::wrk_here() {
        println!("cluster: needs wrk (apt install wrk)");
        return;
    }
    // reqwest without its default TLS: the provider is ring's (stack.md).
    if rustls::crypto::ring::default_provider()
        .install_default()
        .is_err()
    {
        println!("cluster: a TLS provider was installed already");
    }
    let rt = common::runtime();
    rt.block_on(run());
}

async fn run() {
    let root = tempfile_dir();
    let deployer = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/blocking-deployer");
    let url = database("berth_bench_cluster").await;
    let flags = |extra: &'static [&'static str]| {
        let mut v = vec![
            "--store".to_string(),
            url.clone(),
            "--lease-ttl".into(),
            LEASE.into(),
            "--eval-slots".into(),
            "0".into(),
            "--build-slots".into(),
            "1".into(),
            "--max-queued-builds".into(),
            "10000000".into(),
        ];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let args = flags(&[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let a_dir = root.join("a");
    let leader = common::start_berth(&a_dir, &deployer, &args, &[]).await;
    let (one, p99) = common::wrk_submits(&leader.base, &leader.token, CONNECTIONS, SECONDS);
    let (rows, bytes) = rows_per_submit(&url, one * SECONDS.as_secs_f64()).await;
    let plain = plain_clients(&database("berth_bench_plain").await, rows, bytes).await;
    common::record(
        "cluster: submits/s, 1 replica on PostgreSQL, 32 connections (vs 32 plain clients committing the same rows)",
        &format!("{one:.0}/s, p99 {p99:.1} ms"),
        &format!("{plain:.0}/s ({rows} rows of {bytes} B each)"),
        one / plain,
        Some(1.0),
        true,
    );
    // Two standbys, then the proxy over one replica and over three.
    let mut standbys = Vec::new();
    for name in ["b", "c"] {
        let dir = root.join(name);
        secrets_from(&a_dir, &dir);
        let address_file = dir.join("address");
        let child = Command::new(env!("CARGO_BIN_EXE_berth"))
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--address-file"])
            .arg(&address_file)
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--deployer")
            .arg(&deployer)
            .args(&args)
            .env("BERTH_LOG", "warn")
            .spawn()
            .unwrap();
        while !address_file.exists() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let address = std::fs::read_to_string(&address_file)
            .unwrap()
            .trim()
            .to_string();
        standbys.push((child, address));
    }
    let leader_address = leader.base.trim_start_matches("http://").to_string();
    let alone = round_robin(vec![leader_address.clone()]).await;
    let (through_one, _) = common::wrk_submits(&alone, &leader.token, CONNECTIONS, SECONDS);
    let mut all = vec![leader_address];
    all.extend(standbys.iter().map(|(_, a)| a.clone()));
    let three = round_robin(all).await;
    let (through_three, p99_three) =
        common::wrk_submits(&three, &leader.token, CONNECTIONS, SECONDS);
    common::record(
        "cluster: submits/s through a round-robin proxy, 3 replicas (vs the proxy to the leader alone)",
        &format!("{through_three:.0}/s, p99 {p99_three:.1} ms"),
        &format!("{through_one:.0}/s"),
        through_three / through_one,
        Some(0.8),
        true,
    );
    // Failover: kill -9 of the leader, then submit through the proxy
    // until one is accepted.
    let mut leader = leader;
    let http = reqwest::Client::new();
    let killed = Instant::now();
    leader.child.kill().unwrap();
    leader.child.wait().unwrap();
    let mut n = 0u64;
    loop {
        n += 1;
        let answer = http
            .post(format!("{three}/v1/deployments/failover-{n}/submit"))
            .bearer_auth(leader.token.trim())
            .header("Idempotency-Key", format!("failover-submit-{n:08}"))
            .json(&serde_json::json!({"configuration": {"n": n}}))
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        if answer.is_ok_and(|r| r.status() == 202) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let failover = killed.elapsed();
    let lease = Duration::from_secs(5);
    common::record_with_goal(
        "cluster: failover, kill -9 of the leader to the next accepted submit (vs --lease-ttl)",
        &format!("{:.2} s", failover.as_secs_f64()),
        &format!("{:.0} s", lease.as_secs_f64()),
        failover.as_secs_f64() / lease.as_secs_f64(),
        "",
        None,
    );
    for (mut child, _) in standbys {
        let _ = child.kill();
        let _ = child.wait();
    }
    log_latency(&root).await;
}

/// Lines the latency deployer writes, and the pause between two.
const LATENCY_LINES: usize = 400;
const LATENCY_GAP: &str = "0.01";

/// One build whose deployer writes a line holding the time now
/// (nanoseconds) every 10 ms; one stream of it at the leader, one at a
/// standby (forwarded), read at once: p50 and p99 of each line's latency.
async fn log_latency(root: &Path) {
    let url = database("berth_bench_cluster_log").await;
    let dir = root.join("log");
    std::fs::create_dir_all(&dir).unwrap();
    let deployer = common::deployer_script(
        &dir,
        &format!(
            "sleep 1; i=0; while [ $i -lt {LATENCY_LINES} ]; do echo \"t $(date +%s%N)\"; sleep {LATENCY_GAP}; i=$((i+1)); done; printf '{{}}' > \"$BERTH_RESULT\""
        ),
    );
    let args = ["--store", url.as_str(), "--lease-ttl", LEASE];
    let leader = common::start_berth(&dir.join("a"), &deployer, &args, &[]).await;
    let standby_dir = dir.join("b");
    secrets_from(&dir.join("a"), &standby_dir);
    let standby = common::start_berth(&standby_dir, &deployer, &args, &[]).await;
    let http = reqwest::Client::new();
    let configuration = serde_json::json!({});
    let build = common::submit(&http, &leader.base, &leader.token, "latency", configuration).await;
    let events = |base: &str| {
        http.get(format!("{base}/v1/builds/{build}/events"))
            .bearer_auth(leader.token.trim())
            .send()
    };
    let (at_leader, at_standby) = tokio::join!(
        line_latencies(events(&leader.base)),
        line_latencies(events(&standby.base))
    );
    let (p50_leader, p99_leader) = percentiles(at_leader);
    let (p50_standby, p99_standby) = percentiles(at_standby);
    common::record_with_goal(
        "cluster: a log line's latency to a subscriber at a standby (vs at the leader, same build)",
        &format!("p50 {p50_standby:.2} ms, p99 {p99_standby:.2} ms"),
        &format!("p50 {p50_leader:.2} ms, p99 {p99_leader:.2} ms"),
        p50_standby / p50_leader,
        "",
        None,
    );
    for mut replica in [standby, leader] {
        let _ = replica.child.kill();
        let _ = replica.child.wait();
    }
}

/// Each `t <nanoseconds>` log line's latency (ms) as this stream reads it,
/// until the build's end.
async fn line_latencies(
    answer: impl std::future::Future<Output = reqwest::Result<reqwest::Response>>,
) -> Vec<f64> {
    let mut response = answer.await.expect("a stream");
    let (mut text, mut latencies) = (String::new(), Vec::new());
    while let Ok(Some(chunk)) = response.chunk().await {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as f64;
        text.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = text.find("\n\n") {
            let event: String = text.drain(..end + 2).collect();
            if event.contains("event: end") {
                return latencies;
            }
            for line in event.lines() {
                if let Some(sent) = line
                    .strip_prefix("data: t ")
                    .and_then(|t| t.parse::<f64>().ok())
                {
                    latencies.push((now - sent) / 1e6);
                }
            }
        }
    }
    latencies
}

/// p50 and p99 of `v`.
fn percentiles(mut v: Vec<f64>) -> (f64, f64) {
    assert!(!v.is_empty(), "no log line reached the stream");
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99))
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("berth-bench-cluster-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
