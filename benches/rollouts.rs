//! Rollouts in waves (rollouts.md), each figure next to a baseline of the
//! same run: berth's own time between a wave's passing gate and the next
//! wave's `activate` against a queued submit's time to its `deploy` call;
//! a rollout of 1,000 nodes in 10 waves against the sum of the deployer's
//! own time. The real binary, a shell deployer that stamps each call.
//!
//! Run: `cargo bench --bench rollouts`.

mod common;

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

/// Rollouts of `SMALL_NODES` nodes, a wave each, for the gap figure.
const ROUNDS: usize = 5;
const SMALL_NODES: usize = 10;
/// The big rollout.
const BIG_NODES: usize = 1000;

/// A deployer whose deploy changes `n<i>` for i < the configuration's
/// `nodes`, whose `activate` and `check` answer yes for every node asked,
/// and which appends `<verb> <start ns> <end ns>` to `<dir>/stamps`.
fn deployer(dir: &Path) -> std::path::PathBuf {
    let stamps = dir.join("stamps");
    let path = dir.join("rollout-deployer.sh");
    let body = format!(
        r#"#!/bin/sh
start=$(date +%s%N)
verb="$1"; req=$(cat)
answer() {{ printf '%s' "$req" | python3 -c 'import json,sys; r=json.load(sys.stdin); k=sys.argv[1]; print(json.dumps({{"nodes":[{{"name":n,k:True}} for n in r["nodes"]]}}))' "$1" > "$BERTH_RESULT"; }}
case "$verb" in
describe) printf '%s' '{{"methods":["local"],"default_method":"local","actions":{{}},"catalog":[],"schema":null,"verbs":["check","confirm","activate"]}}' > "$BERTH_RESULT";;
eval) printf '%s' '{{"nodes":[]}}' > "$BERTH_RESULT";;
deploy)
  n=$(printf '%s' "$req" | python3 -c 'import json,sys; print(json.load(sys.stdin)["configuration"]["nodes"])')
  awk -v n="$n" 'BEGIN {{ printf "{{\"nodes\":["; for (i = 0; i < n; i++) printf "%s{{\"name\":\"n%04d\",\"changed\":true}}", (i ? "," : ""), i; printf "]}}" }}' > "$BERTH_RESULT";;
activate) answer activated;;
check) answer healthy;;
confirm) printf '{{}}' > "$BERTH_RESULT";;
destroy) printf '{{}}' > "$BERTH_RESULT";;
esac
echo "$verb $start $(date +%s%N)" >> "{stamps}"
"#,
        stamps = stamps.display()
    );
    std::fs::write(&path, body).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    path
}

/// The stamps: (verb, start ns, end ns), in call order.
fn stamps(dir: &Path) -> Vec<(String, i128, i128)> {
    std::fs::read_to_string(dir.join("stamps"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut parts = l.split(' ');
            Some((
                parts.next()?.to_string(),
                parts.next()?.parse().ok()?,
                parts.next()?.parse().ok()?,
            ))
        })
        .collect()
}

fn percentile(mut v: Vec<i128>, p: f64) -> i128 {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Client {
    async fn send(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        self.http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap_or(Value::Null)
    }

    async fn deploy(&self, id: &str, nodes: usize) -> Value {
        let body = json!({"configuration": {"nodes": nodes}, "mode": "enqueue"});
        let r = self
            .send(
                reqwest::Method::POST,
                &format!("/v1/deployments/{id}/submit"),
                body,
            )
            .await;
        let build = r["build_id"].as_str().expect("a build id").to_string();
        loop {
            let b = self
                .send(
                    reqwest::Method::GET,
                    &format!("/v1/builds/{build}"),
                    Value::Null,
                )
                .await;
            if b["finished_at"].is_string() {
                assert_eq!(b["status"], "succeeded", "{b}");
                return b;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = std::env::temp_dir().join(format!("berth-bench-rollouts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let deployer = deployer(&dir);
    common::runtime().block_on(async {
        let berth = common::start_berth(
            &dir.join("berth"),
            &deployer,
            &["--max-queued-builds", "1000"],
            &[],
        )
        .await;
        let c = Client {
            http: reqwest::Client::new(),
            base: berth.base.clone(),
            token: berth.token.trim().to_string(),
        };
        // The baseline: a queued submit's time to its deploy call.
        let mut to_deploy = Vec::new();
        for round in 0..ROUNDS * (SMALL_NODES - 1) {
            let before =
                std::fs::read_to_string(dir.join("stamps")).map_or(0, |s| s.lines().count());
            let sent = time::OffsetDateTime::now_utc().unix_timestamp_nanos();
            c.deploy(&format!("q{round}"), 0).await;
            let call = stamps(&dir)
                .into_iter()
                .skip(before)
                .find(|(verb, _, _)| verb == "deploy")
                .expect("a deploy call");
            to_deploy.push(call.1 - sent);
        }
        // The gaps: a wave's passing check to the next wave's activate.
        c.deploy("small", SMALL_NODES).await;
        let waves: Vec<usize> = (1..SMALL_NODES).collect();
        c.send(
            reqwest::Method::PUT,
            "/v1/deployments/small/rollout-policy",
            json!({"waves": waves}),
        )
        .await;
        let mut gaps = Vec::new();
        for _ in 0..ROUNDS {
            let before = stamps(&dir).len();
            c.deploy("small", SMALL_NODES).await;
            let calls: Vec<_> = stamps(&dir).into_iter().skip(before).collect();
            for pair in calls.windows(2) {
                if pair[0].0 == "check" && pair[1].0 == "activate" {
                    gaps.push(pair[1].1 - pair[0].2);
                }
            }
        }
        // The big rollout: total time against the deployer's own.
        c.deploy("big", 0).await;
        let steps: Vec<String> = (1..10).map(|k| format!("{}%", k * 10)).collect();
        c.send(
            reqwest::Method::PUT,
            "/v1/deployments/big/rollout-policy",
            json!({"waves": steps}),
        )
        .await;
        let before = stamps(&dir).len();
        let started = std::time::Instant::now();
        c.deploy("big", BIG_NODES).await;
        let total = started.elapsed().as_secs_f64();
        let own: f64 = stamps(&dir)
            .into_iter()
            .skip(before)
            .map(|(_, s, e)| (e - s) as f64 / 1e9)
            .sum();
        let mut berth = berth;
        let _ = berth.child.kill();
        let _ = berth.child.wait();

        let ms = |ns: i128| ns as f64 / 1e6;
        let (gap50, gap99) = (
            percentile(gaps.clone(), 0.5),
            percentile(gaps.clone(), 0.99),
        );
        let (base50, base99) = (
            percentile(to_deploy.clone(), 0.5),
            percentile(to_deploy.clone(), 0.99),
        );
        common::record(
            &format!(
                "a wave's passing gate to the next wave's activate (median; p99 {:.1} ms; {} gaps)",
                ms(gap99),
                gaps.len()
            ),
            &format!("{:.1} ms", ms(gap50)),
            &format!(
                "a queued submit to its deploy call: {:.1} ms (p99 {:.1} ms)",
                ms(base50),
                ms(base99)
            ),
            gap50 as f64 / base50.max(1) as f64,
            None,
            false,
        );
        common::record(
            &format!("a rollout of {BIG_NODES} nodes in 10 waves, submit to end"),
            &format!("{total:.2} s"),
            &format!("the deployer's own time: {own:.2} s"),
            total / own.max(1e-9),
            None,
            false,
        );
    });
    let _ = std::fs::remove_dir_all(&dir);
}
