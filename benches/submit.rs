//! Submit throughput with 1 and 32 concurrent clients (idempotency keys, no
//! eval: `--eval-slots 0`) against a plain fsync loop on the same disk in the
//! same run; RSS of the idle server and with 10,000 deployments.
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

async fn submit_phase(base: &str, token: &str, clients: usize, ids: Arc<AtomicU64>) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (base, token, done, ids) = (
            base.to_string(),
            token.to_string(),
            done.clone(),
            ids.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let http = reqwest::Client::new();
            while start.elapsed() < PHASE {
                let n = ids.fetch_add(1, Ordering::Relaxed);
                let body = serde_json::json!({"configuration": {"domain": format!("d{n}.example.org")}, "mode": "enqueue"});
                let r = http
                    .post(format!("{base}/v1/deployments/d{n}/submit"))
                    .bearer_auth(&token)
                    .header("Idempotency-Key", format!("bench-key-{c:04}-{n:012}"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 202, "{}", r.text().await.unwrap_or_default());
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
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

    // Throughput, against an fsync loop on the same disk.
    let dir = root.join("throughput");
    let (child, base, token) = start(&dir, &rt);
    let fsyncs = fsync_rate(&dir);
    let ids = Arc::new(AtomicU64::new(0));
    let one = rt.block_on(submit_phase(&base, &token, 1, ids.clone()));
    let many = rt.block_on(submit_phase(&base, &token, 32, ids.clone()));
    stop(child, &dir);

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

    println!("fsync loop (128 B append + fdatasync): {fsyncs:.0}/s");
    println!(
        "submit, 1 client:   {one:.0}/s = {:.2}x the fsync rate",
        one / fsyncs
    );
    println!(
        "submit, 32 clients: {many:.0}/s = {:.2}x the fsync rate",
        many / fsyncs
    );
    println!(
        "RSS idle: {:.1} MiB; with 10,000 deployments: {:.1} MiB; store file {:.1} MiB",
        idle_rss as f64 / 1024.0,
        full_rss as f64 / 1024.0,
        store_bytes as f64 / f64::from(1 << 20)
    );
    let _ = std::fs::remove_dir_all(&root);
}
