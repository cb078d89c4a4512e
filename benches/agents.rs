//! Agents at scale (agents.md "Limits and scale"), each figure next to a
//! baseline of the same run: berth's memory with `AGENTS` desired-state
//! streams open against idle; the time for one deploy's documents to
//! reach every agent; submits at 32 connections while the agents report,
//! against submits alone; after kill -9 and a start of berth, the time
//! until every agent is connected again. The agents are a lean simulator in this process:
//! one raw HTTP/1.1 connection per stream, reports over a small pool.
//!
//! Run: `cargo bench --bench agents` (`BERTH_BENCH_AGENTS` agents, 10,000
//! by default).

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Connections the reports go over.
const REPORT_CONNECTIONS: usize = 64;
/// How long each submit figure runs.
const SUBMIT_SECONDS: u64 = 10;

/// A deployer with no `activate`: its deploy names `nodes` nodes `n<i>`,
/// each with one file artifact holding the configuration's `v`, and stamps
/// when it is done.
fn deployer(dir: &Path, nodes: usize) -> std::path::PathBuf {
    let path = dir.join("agents-deployer.sh");
    let done = dir.join("deploy-done");
    let body = format!(
        r#"#!/bin/sh
verb="$1"; req=$(cat)
case "$verb" in
describe) printf '%s' '{{"methods":["local"],"default_method":"local","actions":{{}},"catalog":[],"schema":null,"verbs":[]}}' > "$BERTH_RESULT";;
eval) printf '%s' '{{"nodes":[]}}' > "$BERTH_RESULT";;
deploy)
  mkdir -p "$BERTH_SCRATCH_DIR/artifacts"
  printf '%s' "$req" | python3 -c 'import json,sys; print(json.load(sys.stdin)["configuration"].get("v", 0))' > "$BERTH_SCRATCH_DIR/artifacts/a.json"
  case "$req" in *'"agents":true'*)
    awk -v n={nodes} 'BEGIN {{ printf "{{\"nodes\":["; for (i = 0; i < n; i++) printf "%s{{\"name\":\"n%05d\",\"changed\":true,\"artifact\":{{\"kind\":\"file\",\"path\":\"artifacts/a.json\"}}}}", (i ? "," : ""), i; printf "]}}" }}' > "$BERTH_RESULT";;
  *) printf '{{"nodes":[]}}' > "$BERTH_RESULT";;
  esac
  date +%s%N > "{done}";;
*) printf '{{}}' > "$BERTH_RESULT";;
esac
"#,
        done = done.display()
    );
    std::fs::write(&path, body).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    path
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn now_ns() -> i64 {
    i64::try_from(time::OffsetDateTime::now_utc().unix_timestamp_nanos()).unwrap()
}

/// What the simulated agents saw: each one's latest generation, when it
/// arrived, and how many connections brought a document.
struct Seen {
    generation: Vec<AtomicU64>,
    at_ns: Vec<AtomicI64>,
    connections: Vec<AtomicU64>,
}

/// One agent's desired-state stream, connected again as `berth agent`
/// does when it ends: the n-th failure in a row waits a random time in
/// [0, min(30 s, 2^n s)].
async fn stream(addr: String, token: String, node: usize, seen: Arc<Seen>) {
    let mut failures: u32 = 0;
    let mut random = 0x9E37_79B9_7F4A_7C15u64 ^ node as u64;
    loop {
        if connection(&addr, &token, node, &seen).await {
            failures = 0;
        } else {
            failures = failures.saturating_add(1);
        }
        // xorshift: a spread, not a secret.
        random ^= random << 13;
        random ^= random >> 7;
        random ^= random << 17;
        let ceiling = Duration::from_secs(1u64 << failures.min(5)).min(Duration::from_secs(30));
        tokio::time::sleep(ceiling.mul_f64((random % 10_000) as f64 / 10_000.0)).await;
    }
}

/// One connection of a stream until it ends: the generation of each
/// `id:` line. Whether it brought a document.
async fn connection(addr: &str, token: &str, node: usize, seen: &Seen) -> bool {
    let Ok(mut sock) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let request = format!(
        "GET /internal/v1/nodes/fleet/n{node:05}/desired HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
    );
    if sock.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut buf = vec![0u8; 4096];
    let mut carry = String::new();
    let mut documents = 0u64;
    while let Ok(n) = sock.read(&mut buf).await {
        if n == 0 {
            break;
        }
        carry.push_str(&String::from_utf8_lossy(&buf[..n]));
        while let Some(end) = carry.find('\n') {
            let line: String = carry.drain(..=end).collect();
            if let Some(g) = line
                .strip_prefix("id: ")
                .and_then(|g| g.trim().parse::<u64>().ok())
            {
                seen.generation[node].store(g, Ordering::SeqCst);
                seen.at_ns[node].store(now_ns(), Ordering::SeqCst);
                if documents == 0 {
                    seen.connections[node].fetch_add(1, Ordering::SeqCst);
                }
                documents += 1;
            }
        }
    }
    documents > 0
}

fn percentile(mut v: Vec<i64>, p: f64) -> i64 {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

async fn wait_all(seen: &Seen, generation: u64, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if seen
            .generation
            .iter()
            .all(|g| g.load(Ordering::SeqCst) >= generation)
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

async fn deploy(http: &reqwest::Client, base: &str, token: &str, v: u64) {
    let configuration = json!({"agents": true, "v": v});
    let build = common::submit(http, base, token, "fleet", configuration).await;
    let b = common::finished(http, base, token, &build, Duration::from_millis(20)).await;
    assert_eq!(b["status"], "succeeded", "{b}");
}

/// Reports from every agent in turn, `per_second` in all, until `stop`.
async fn report_load(
    base: String,
    tokens: Arc<Vec<String>>,
    per_second: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> u64 {
    let sent = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..REPORT_CONNECTIONS {
        let (base, tokens, stop, sent) = (base.clone(), tokens.clone(), stop.clone(), sent.clone());
        tasks.push(tokio::spawn(async move {
            let http = reqwest::Client::new();
            let every = Duration::from_secs_f64(REPORT_CONNECTIONS as f64 / per_second as f64);
            let mut i = c;
            while !stop.load(Ordering::SeqCst) {
                let started = Instant::now();
                let node = i % tokens.len();
                let body = json!({
                    "operation_id": format!("op-{:032}", i), "fence": 0,
                    "worker_incarnation": format!("sim-{node:08}"), "generation": 1,
                    "running": null, "booted": null, "health": {"healthy": true, "reason": null},
                    "last_error": null, "agent_version": "sim", "uptime_s": i, "report_interval_ms": 60000,
                });
                let r = http
                    .post(format!("{base}/internal/v1/nodes/fleet/n{node:05}/report"))
                    .bearer_auth(&tokens[node])
                    .json(&body)
                    .send()
                    .await;
                if r.is_ok_and(|r| r.status() == 200) {
                    sent.fetch_add(1, Ordering::SeqCst);
                }
                i += REPORT_CONNECTIONS;
                tokio::time::sleep(every.saturating_sub(started.elapsed())).await;
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    sent.load(Ordering::SeqCst)
}

/// The floor of the memory figure: a second berth holding as many idle
/// keep-alive connections, each after one request (what any client that
/// keeps a connection open costs): its RSS before and with them.
async fn floor(dir: &Path, deployer: &Path, connections: usize) -> (u64, u64) {
    let limit = (connections + 200).to_string();
    let mut other = common::start_berth(
        &dir.join("floor"),
        deployer,
        &["--max-connections", &limit],
        &[],
    )
    .await;
    let pid = other.child.id();
    let idle = rss_kib(pid);
    let addr = other.base.trim_start_matches("http://").to_string();
    let mut held = Vec::with_capacity(connections);
    for _ in 0..connections {
        let mut sock = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let request = format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n");
        sock.write_all(request.as_bytes()).await.unwrap();
        let mut buf = [0u8; 512];
        let _ = sock.read(&mut buf).await.unwrap();
        held.push(sock);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let with = rss_kib(pid);
    drop(held);
    let _ = other.child.kill();
    let _ = other.child.wait();
    (idle, with)
}

/// kill -9 of berth and a start on the same port: the time from the start
/// until every agent has its document again (agents.md: within 2 minutes),
/// beside the start's own time to ready.
async fn restart(
    dir: &Path,
    deployer: &Path,
    berth: &mut common::Started,
    connections: &str,
    seen: &Seen,
) {
    let listen = berth.base.trim_start_matches("http://").to_string();
    let before: Vec<u64> = seen
        .connections
        .iter()
        .map(|c| c.load(Ordering::SeqCst))
        .collect();
    let _ = berth.child.kill();
    let _ = berth.child.wait();
    let started = Instant::now();
    *berth = common::start_berth_at(
        &dir.join("berth"),
        deployer,
        &listen,
        &["--max-agents", "20000", "--max-connections", connections],
        &[],
    )
    .await;
    let ready = started.elapsed();
    let deadline = started + Duration::from_secs(600);
    while seen
        .connections
        .iter()
        .zip(&before)
        .any(|(c, b)| c.load(Ordering::SeqCst) <= *b)
    {
        assert!(
            Instant::now() < deadline,
            "agents not connected again within 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let all = started.elapsed();
    let agents = seen.connections.len();
    common::record_with_goal(
        &format!("kill -9 and start of berth: all {agents} agents connected again"),
        &format!(
            "{:.1} s (berth ready after {:.1} s)",
            all.as_secs_f64(),
            ready.as_secs_f64()
        ),
        "goal: within 2 min",
        all.as_secs_f64() / 120.0,
        "<= 2 min",
        Some(all <= Duration::from_secs(120)),
    );
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    // This process holds a socket per simulated agent: its soft limit of
    // open files goes to the hard one (berth raises its own for
    // --max-connections).
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).expect("raise the limit of open files");
    }
    let agents: usize = std::env::var("BERTH_BENCH_AGENTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(10_000);
    let dir = std::env::temp_dir().join(format!("berth-bench-agents-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let deployer = deployer(&dir, agents);
    common::runtime().block_on(async {
        // Each stream holds a connection (agents.md): raised with the why.
        let connections = (agents + 2 * REPORT_CONNECTIONS + 200).to_string();
        let berth = common::start_berth(
            &dir.join("berth"),
            &deployer,
            &["--max-agents", "20000", "--max-connections", &connections],
            &[],
        )
        .await;
        let (base, token) = (berth.base.clone(), berth.token.trim().to_string());
        let http = reqwest::Client::new();
        let made = Instant::now();
        let mut tokens = Vec::with_capacity(agents);
        for i in 0..agents {
            let r: Value = http
                .post(format!("{base}/v1/tokens"))
                .bearer_auth(&token)
                .json(&json!({"name": format!("a{i:05}"), "kind": "agent", "deployment": "fleet", "node": format!("n{i:05}")}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            tokens.push(r["token"].as_str().expect("a token").to_string());
        }
        println!("{agents} agent tokens made in {:.1} s", made.elapsed().as_secs_f64());
        let pid = berth.child.id();
        let idle = rss_kib(pid);
        let (floor_idle, floor) = floor(&dir, &deployer, agents).await;
        let addr = base.trim_start_matches("http://").to_string();
        let seen = Arc::new(Seen {
            generation: (0..agents).map(|_| AtomicU64::new(u64::MAX)).collect(),
            at_ns: (0..agents).map(|_| AtomicI64::new(0)).collect(),
            connections: (0..agents).map(|_| AtomicU64::new(0)).collect(),
        });
        for (i, t) in tokens.iter().enumerate() {
            tokio::spawn(stream(addr.clone(), t.clone(), i, seen.clone()));
        }
        // Connected: every stream has its first document (generation 0).
        for g in &seen.generation {
            while g.load(Ordering::SeqCst) == u64::MAX {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let connected = rss_kib(pid);
        common::record(
            &format!("berth's memory with {agents} desired-state streams open"),
            &format!("+{:.1} MiB ({:.1} KiB a stream)", (connected - idle) as f64 / 1024.0, (connected - idle) as f64 / agents as f64),
            &format!(
                "{agents} idle keep-alive connections: +{:.1} MiB ({:.1} KiB each); idle {:.1} MiB",
                (floor - floor_idle) as f64 / 1024.0,
                (floor - floor_idle) as f64 / agents as f64,
                idle as f64 / 1024.0
            ),
            (connected - idle) as f64 / (floor - floor_idle).max(1) as f64,
            None,
            false,
        );
        // One deploy's documents to every agent.
        for v in 1..=3u64 {
            deploy(&http, &base, &token, v).await;
            assert!(wait_all(&seen, v, Duration::from_secs(60)).await, "not every agent got generation {v}");
            let done: i64 = std::fs::read_to_string(dir.join("deploy-done")).unwrap().trim().parse().unwrap();
            let lat: Vec<i64> = seen.at_ns.iter().map(|a| a.load(Ordering::SeqCst) - done).collect();
            let (p50, p99) = (percentile(lat.clone(), 0.5), percentile(lat.clone(), 0.99));
            common::record_with_goal(
                &format!("a deploy's documents to {agents} agents, deployer done to arrival (p50; deploy {v})"),
                &format!("{:.0} ms (p99 {:.0} ms)", p50 as f64 / 1e6, p99 as f64 / 1e6),
                "goal: p99 under 2 s",
                p99 as f64 / 2e9,
                "p99 <= 2 s",
                Some(p99 <= 2_000_000_000),
            );
        }
        // Submits alone, then while every agent reports at the default
        // interval (60 s: agents.md's "about 170 reports/s"). The
        // first report of each node is written; a warm-up takes them, so
        // the figure is of reports that change nothing (commit nothing).
        if common::wrk_here() {
            let tokens = Arc::new(tokens);
            let per_second = (agents / 60).max(1);
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let warm = tokio::spawn(report_load(base.clone(), tokens.clone(), per_second.max(1000), stop.clone()));
            tokio::time::sleep(Duration::from_secs((agents / 1000) as u64 + 2)).await;
            stop.store(true, Ordering::SeqCst);
            warm.await.unwrap();
            let (alone, _) = common::wrk_submits(&base, &token, 32, Duration::from_secs(SUBMIT_SECONDS));
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let load = tokio::spawn(report_load(base.clone(), tokens.clone(), per_second, stop.clone()));
            tokio::time::sleep(Duration::from_secs(2)).await;
            let (with, _) = common::wrk_submits(&base, &token, 32, Duration::from_secs(SUBMIT_SECONDS));
            stop.store(true, Ordering::SeqCst);
            let reports = load.await.unwrap();
            common::record(
                &format!("submits at 32 connections while {agents} agents report ({:.0} reports/s taken)", reports as f64 / (SUBMIT_SECONDS + 2) as f64),
                &format!("{with:.0}/s"),
                &format!("alone: {alone:.0}/s"),
                with / alone,
                Some(0.8),
                true,
            );
        } else {
            println!("wrk is not installed: the submit figure is left out");
        }
        let mut berth = berth;
        restart(&dir, &deployer, &mut berth, &connections, &seen).await;
        let _ = berth.child.kill();
        let _ = berth.child.wait();
    });
    let _ = std::fs::remove_dir_all(&dir);
}
