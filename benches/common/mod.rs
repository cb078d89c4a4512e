//! The one way every benchmark starts berth: the real binary on a free
//! loopback port, waited for until `/readyz` answers 200; and the pieces
//! several benchmarks share (a scripted deployer, the runtime).
// Each benchmark compiles this module on its own and uses part of it.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

pub struct Started {
    pub child: Child,
    pub base: String,
    pub token: String,
}

/// `berth serve` on a free port with its data in `<dir>/data`, the given
/// deployer, and `args`; `envs` are added to its environment.
pub async fn start_berth(
    dir: &Path,
    deployer: &Path,
    args: &[&str],
    envs: &[(&str, String)],
) -> Started {
    start_berth_at(dir, deployer, "127.0.0.1:0", args, envs).await
}

/// `start_berth` listening on `listen` (a restart on the port clients
/// know).
pub async fn start_berth_at(
    dir: &Path,
    deployer: &Path,
    listen: &str,
    args: &[&str],
    envs: &[(&str, String)],
) -> Started {
    // The kernel picks the port; berth writes what it bound.
    let address_file = dir.join("address");
    let _ = std::fs::remove_file(&address_file);
    let child = Command::new(env!("CARGO_BIN_EXE_berth"))
        .arg("serve")
        .arg("--listen")
        .arg(listen)
        .arg("--address-file")
        .arg(&address_file)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--deployer")
        .arg(deployer)
        // A bench is one principal holding every stream it measures.
        .arg("--max-streams-per-caller")
        .arg("4000")
        .args(args)
        .envs(envs.iter().map(|(k, v)| (k.to_string(), v.clone())))
        .env("BERTH_LOG", "warn")
        .spawn()
        .unwrap();
    let address = loop {
        match std::fs::read_to_string(&address_file) {
            Ok(text) => break text.trim().to_string(),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    };
    let base = format!("http://{address}");
    let http = reqwest::Client::new();
    while http
        .get(format!("{base}/readyz"))
        .send()
        .await
        .map(|r| r.status() != 200)
        .unwrap_or(true)
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let token = std::fs::read_to_string(dir.join("data/service-token")).unwrap();
    Started { child, base, token }
}

/// `wrk` with tools/submit.lua (a new deployment and idempotency key per
/// request) for `duration`: (submits/s, p99 in ms). Panics if one failed.
pub fn wrk_submits(base: &str, token: &str, connections: usize, duration: Duration) -> (f64, f64) {
    wrk_submits_to(base, token, connections, duration, 0)
}

/// As `wrk_submits`, to `deployments` deployments in turn (0: a new one
/// per submit).
pub fn wrk_submits_to(
    base: &str,
    token: &str,
    connections: usize,
    duration: Duration,
    deployments: usize,
) -> (f64, f64) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/submit.lua");
    let threads = connections.min(2).to_string();
    let out = Command::new("wrk")
        .args(["-t", &threads, "-c", &connections.to_string()])
        .args(["-d", &format!("{}s", duration.as_secs().max(1))])
        .arg("-s")
        .arg(&script)
        .arg(base)
        .env("BERTH_TOKEN", token.trim())
        .env("BERTH_BENCH_DEPLOYMENTS", deployments.to_string())
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

/// Whether `wrk` is on this machine (the submit figures need it).
pub fn wrk_here() -> bool {
    Command::new("wrk").arg("--version").output().is_ok()
}

/// `GET /metrics` of a running berth, as text.
pub async fn metrics(http: &reqwest::Client, base: &str, token: &str) -> String {
    http.get(format!("{base}/metrics"))
        .bearer_auth(token.trim())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Enqueues a submit of `configuration` for deployment `id`: its build id.
pub async fn submit(
    http: &reqwest::Client,
    base: &str,
    token: &str,
    id: &str,
    configuration: serde_json::Value,
) -> String {
    let answer: serde_json::Value = http
        .post(format!("{base}/v1/deployments/{id}/submit"))
        .bearer_auth(token.trim())
        .json(&serde_json::json!({"configuration": configuration, "mode": "enqueue"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    answer["build_id"].as_str().expect("a build id").to_string()
}

/// A build once it has finished (read every `poll`).
pub async fn finished(
    http: &reqwest::Client,
    base: &str,
    token: &str,
    id: &str,
    poll: Duration,
) -> serde_json::Value {
    loop {
        let b: serde_json::Value = http
            .get(format!("{base}/v1/builds/{id}"))
            .bearer_auth(token.trim())
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if b["finished_at"].is_string() {
            return b;
        }
        tokio::time::sleep(poll).await;
    }
}

/// The runtime of a benchmark's client side: two workers, as the machine.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A deployer script in `dir`: describe, eval and destroy answer at once;
/// `deploy` runs the shell lines given (which write `$BERTH_RESULT`).
pub fn deployer_script(dir: &Path, deploy: &str) -> std::path::PathBuf {
    let path = dir.join("deployer.sh");
    let body = format!(
        r#"#!/bin/sh
verb="$1"; cat >/dev/null
case "$verb" in
describe) printf '%s' '{{"methods":["local"],"default_method":"local","actions":{{}},"catalog":[],"schema":null}}' > "$BERTH_RESULT";;
eval) printf '%s' '{{"nodes":[]}}' > "$BERTH_RESULT";;
deploy) {deploy};;
destroy) printf '{{}}' > "$BERTH_RESULT";;
esac
"#
    );
    std::fs::write(&path, body).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    path
}

/// One row of the benchmark table: appended as a JSON line to the file in
/// `BERTH_BENCH_FIGURES` (tools/bench sets it and prints the table), and
/// printed either way. `higher_is_better` says which way `ratio` must go
/// to meet `goal` (a ratio; None when the figure has no goal).
pub fn record(
    figure: &str,
    berth: &str,
    baseline: &str,
    ratio: f64,
    goal: Option<f64>,
    higher_is_better: bool,
) {
    let met = goal.map(|g| {
        if higher_is_better {
            ratio >= g
        } else {
            ratio <= g
        }
    });
    let goal_text = goal
        .map(|g| format!("{} {g}x", if higher_is_better { ">=" } else { "<=" }))
        .unwrap_or_default();
    record_with_goal(figure, berth, baseline, ratio, &goal_text, met);
}

/// A figure whose goal is not a ratio to its baseline (a latency bound):
/// the table shows `goal_text` and whether it was `met`.
pub fn record_with_goal(
    figure: &str,
    berth: &str,
    baseline: &str,
    ratio: f64,
    goal_text: &str,
    met: Option<bool>,
) {
    println!("{figure}: {berth} | {baseline} | {ratio:.2}x | goal {goal_text} | met {met:?}");
    let Ok(path) = std::env::var("BERTH_BENCH_FIGURES") else {
        return;
    };
    let line = serde_json::json!({
        "figure": figure, "berth": berth, "baseline": baseline,
        "ratio": (ratio * 100.0).round() / 100.0, "goal": goal_text, "met": met,
    });
    use std::io::Write;
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(f, "{line}");
    }
}

/// utime + stime of a `/proc/.../stat` file, in us. A figure built on an
/// unreadable count would be wrong, so it stops the bench instead.
pub fn stat_cpu_us(path: &Path) -> f64 {
    stat_fields_us(path, (11, 12))
}

/// cutime + cstime of a `/proc/.../stat` file (the CPU of its children
/// once waited for: a bench's wrk runs), in us.
pub fn stat_children_cpu_us(path: &Path) -> f64 {
    stat_fields_us(path, (13, 14))
}

fn stat_fields_us(path: &Path, (a, b): (usize, usize)) -> f64 {
    let ticks_per_s = 100.0; // USER_HZ on Linux
    let stat =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    // Fields after the ")" of the name: utime and stime are the 12th and
    // 13th, cutime and cstime the 14th and 15th.
    let rest = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| -> f64 {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{}: field {i} is not a number", path.display()))
    };
    (field(a) + field(b)) / ticks_per_s * 1e6
}

/// CPU time (user + system) so far, in us, of the thread of process `pid`
/// whose name starts with `name` (as the kernel keeps it: 15 characters
/// at most); `None` when it has none.
pub fn thread_cpu_us(pid: u32, name: &str) -> Option<f64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/task: {e}"));
    tasks.flatten().find_map(|task| {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        comm.starts_with(name)
            .then(|| stat_cpu_us(&task.path().join("stat")))
    })
}
