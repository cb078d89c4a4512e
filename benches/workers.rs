//! Builds on remote workers (workers.md), each figure next to the embedded
//! worker doing the same in the same run: a queued build's start, a build
//! log's ingest, builds per second with 8 workers against 8 local slots,
//! and the time from a worker's death to its build's `lost_attempt`
//! against the lease. The real binary; workers are `berth worker`
//! processes on loopback.
//!
//! Run: `cargo bench --bench workers`.

mod common;

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const ROUNDS: usize = 20;
/// Lines the log-ingest deploy prints (80 bytes each).
const LOG_LINES: usize = 200_000;
/// Builds of the throughput figure.
const MANY: usize = 80;
const LEASE: &str = "5s";

fn millis(at: &Value) -> i128 {
    let text = at.as_str().expect("a time");
    time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
        .expect("an RFC 3339 time")
        .unix_timestamp_nanos()
        / 1_000_000
}

fn median(mut v: Vec<i128>) -> i128 {
    v.sort();
    v[v.len() / 2]
}

struct Bench {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Bench {
    async fn submit(&self, id: &str, config: Value) -> String {
        common::submit(&self.http, &self.base, &self.token, id, config).await
    }

    async fn ended(&self, id: &str) -> Value {
        let poll = Duration::from_millis(10);
        common::finished(&self.http, &self.base, &self.token, id, poll).await
    }

    async fn worker_token(&self, name: &str, dir: &Path) -> std::path::PathBuf {
        let made: Value = self
            .http
            .post(format!("{}/v1/tokens", self.base))
            .bearer_auth(&self.token)
            .json(&json!({"name": name, "kind": "worker"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let file = dir.join(format!("{name}.token"));
        std::fs::write(&file, made["token"].as_str().expect("a token")).unwrap();
        file
    }
}

fn start_worker(base: &str, token: &Path, dir: &Path, deployer: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_berth"))
        .arg("worker")
        .args(["--url", base])
        .arg("--token-file")
        .arg(token)
        .arg("--work-dir")
        .arg(dir)
        .arg("--deployer")
        .arg(deployer)
        .env("BERTH_LOG", "warn")
        .spawn()
        .unwrap()
}

/// One berth (embedded worker on, or off with `workers` remote ones).
struct Setup {
    bench: Bench,
    berth: common::Started,
    workers: Vec<Child>,
}

async fn setup(dir: &Path, deployer: &Path, workers: usize, slots: &str) -> Setup {
    std::fs::create_dir_all(dir).unwrap();
    let mut args = vec![
        "--lease-ttl",
        LEASE,
        "--build-slots",
        slots,
        "--max-queued-builds",
        "1000",
    ];
    if workers > 0 {
        args.extend(["--local-worker", "off"]);
    }
    let berth = common::start_berth(dir, deployer, &args, &[]).await;
    let bench = Bench {
        http: reqwest::Client::new(),
        base: berth.base.clone(),
        token: berth.token.trim().to_string(),
    };
    let mut children = Vec::new();
    for i in 0..workers {
        let token = bench.worker_token(&format!("w{i}"), dir).await;
        children.push(start_worker(
            &bench.base,
            &token,
            &dir.join(format!("w{i}")),
            deployer,
        ));
    }
    Setup {
        bench,
        berth,
        workers: children,
    }
}

impl Setup {
    fn stop(mut self) {
        for w in &mut self.workers {
            let _ = w.kill();
            let _ = w.wait();
        }
        let _ = self.berth.child.kill();
        let _ = self.berth.child.wait();
    }
}

/// Median queued-to-running and the log-ingest time, for one setup.
async fn start_and_ingest(s: &Setup) -> (i128, i128) {
    let mut to_start = Vec::new();
    for round in 0..ROUNDS {
        let b = s
            .bench
            .submit(&format!("q{round}"), json!({"lines": 0}))
            .await;
        let b = s.bench.ended(&b).await;
        assert_eq!(b["status"], "succeeded", "{b}");
        to_start.push(millis(&b["started_at"]) - millis(&b["created_at"]));
    }
    let b = s.bench.submit("logs", json!({"lines": LOG_LINES})).await;
    let b = s.bench.ended(&b).await;
    assert_eq!(b["status"], "succeeded", "{b}");
    (
        median(to_start),
        millis(&b["finished_at"]) - millis(&b["started_at"]),
    )
}

/// Seconds for `MANY` builds of as many deployments, all queued at once.
async fn many(s: &Setup) -> f64 {
    let started = Instant::now();
    let mut ids = Vec::new();
    for i in 0..MANY {
        ids.push(s.bench.submit(&format!("m{i}"), json!({"lines": 0})).await);
    }
    for id in ids {
        let b = s.bench.ended(&id).await;
        assert_eq!(b["status"], "succeeded", "{b}");
    }
    started.elapsed().as_secs_f64()
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = std::env::temp_dir().join(format!("berth-bench-workers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // The deployment `logs` prints LOG_LINES lines of 80 bytes; `dying`
    // never ends (its worker is killed); every other deploy ends at once.
    let deployer = common::deployer_script(
        &dir,
        &format!(
            r#"case "$(basename "$BERTH_WORK_DIR")" in
logs) awk 'BEGIN {{ for (i = 0; i < {LOG_LINES}; i++) printf "line %08d xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n", i }}';;
dying) while true; do sleep 1; done;;
esac
printf '{{"nodes":[]}}' > "$BERTH_RESULT""#
        ),
    );
    common::runtime().block_on(async {
        let local = setup(&dir.join("local"), &deployer, 0, "8").await;
        let (local_start, local_ingest) = start_and_ingest(&local).await;
        let local_many = many(&local).await;
        local.stop();
        let remote = setup(&dir.join("remote"), &deployer, 8, "8").await;
        let (remote_start, remote_ingest) = start_and_ingest(&remote).await;
        let remote_many = many(&remote).await;
        // A worker's death: kill -9 mid-build, then the lease runs out.
        let dying = remote.bench.submit("dying", json!({"lines": 0})).await;
        let running = loop {
            let b: Value = remote
                .bench
                .http
                .get(format!("{}/v1/builds/{dying}", remote.bench.base))
                .bearer_auth(&remote.bench.token)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if b["status"] == "running" {
                break b;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let worker: usize = running["worker"].as_str().unwrap()[1..].parse().unwrap();
        let mut remote = remote;
        let killed_at = time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000;
        remote.workers[worker].kill().unwrap();
        let lost = remote.bench.ended(&dying).await;
        assert_eq!(lost["failure"]["reason"], "lost_attempt", "{lost}");
        let to_lost = millis(&lost["finished_at"]) - killed_at;
        remote.stop();

        common::record(
            &format!("queued to running through a worker (median of {ROUNDS})"),
            &format!("{remote_start} ms"),
            &format!("the embedded worker: {local_start} ms"),
            remote_start as f64 / local_start.max(1) as f64,
            None,
            false,
        );
        let mb = (LOG_LINES * 81) as f64 / 1e6;
        common::record(
            &format!("log ingest through a worker ({LOG_LINES} lines, {mb:.0} MB)"),
            &format!("{:.1} MB/s", mb / (remote_ingest.max(1) as f64 / 1000.0)),
            &format!(
                "the embedded worker: {:.1} MB/s",
                mb / (local_ingest.max(1) as f64 / 1000.0)
            ),
            local_ingest as f64 / remote_ingest.max(1) as f64,
            Some(0.5),
            true,
        );
        common::record(
            &format!("builds/s, 8 workers ({MANY} trivial builds)"),
            &format!("{:.1}/s", MANY as f64 / remote_many),
            &format!(
                "the embedded worker, 8 slots: {:.1}/s",
                MANY as f64 / local_many
            ),
            local_many / remote_many,
            None,
            true,
        );
        common::record(
            "a worker's death (kill -9) to its build's lost_attempt",
            &format!("{to_lost} ms"),
            &format!("the lease: {LEASE}"),
            to_lost as f64 / 5000.0,
            None,
            false,
        );
    });
    let _ = std::fs::remove_dir_all(&dir);
}
