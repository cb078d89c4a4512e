//! Automatic rollback (lifecycle.md "Health checks and automatic
//! rollback"): the time from a deploy's failed health check (the failed
//! build's end, committed with the rollback queued in the same
//! transaction) to the rollback build's start, with the built-in local
//! deployer and the real binary; next to the time from a submit's build
//! being queued to its start in the same run (the queue's own latency).
//! Median of 20 each.
//!
//! Run: `cargo bench --bench rollback`.

mod common;

use std::time::Duration;

use serde_json::{json, Value};

const ROUNDS: usize = 20;

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

fn configuration(unhealthy: bool) -> Value {
    json!({"domain": "bench.example.org", "applications": {
        "mastodon": {"enable": true, "unhealthy": unhealthy}}})
}

async fn ended(http: &reqwest::Client, base: &str, token: &str, id: &str) -> Value {
    common::finished(http, base, token, id, Duration::from_millis(20)).await
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = std::env::temp_dir().join(format!("berth-bench-rollback-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    common::runtime().block_on(async {
        let mut berth = common::start_berth(
            &dir,
            std::path::Path::new("builtin:local"),
            &["--health-interval", "100ms", "--health-timeout", "300ms"],
            &[],
        )
        .await;
        let (base, token) = (berth.base.clone(), berth.token.trim().to_string());
        let http = reqwest::Client::new();
        let mut to_rollback = Vec::new();
        let mut to_start = Vec::new();
        for round in 0..ROUNDS {
            let id = format!("r{round}");
            let good = common::submit(&http, &base, &token, &id, configuration(false)).await;
            let good = ended(&http, &base, &token, &good).await;
            assert_eq!(good["status"], "succeeded", "{good}");
            to_start.push(millis(&good["started_at"]) - millis(&good["created_at"]));
            let bad = common::submit(&http, &base, &token, &id, configuration(true)).await;
            let bad = ended(&http, &base, &token, &bad).await;
            assert_eq!(bad["failure"]["reason"], "health_check_failed", "{bad}");
            let list: Value = http
                .get(format!("{base}/v1/deployments/{id}/builds?limit=5"))
                .bearer_auth(&token)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let rollback = list["items"]
                .as_array()
                .unwrap()
                .iter()
                .find(|b| b["trigger"] == "automatic_rollback")
                .expect("an automatic rollback")["id"]
                .as_str()
                .unwrap()
                .to_string();
            let rollback = ended(&http, &base, &token, &rollback).await;
            assert_eq!(rollback["status"], "succeeded", "{rollback}");
            to_rollback.push(millis(&rollback["started_at"]) - millis(&bad["finished_at"]));
        }
        let _ = berth.child.kill();
        let _ = berth.child.wait();
        let (rollback_ms, start_ms) = (median(to_rollback), median(to_start));
        common::record(
            "failed health check to the rollback's start (local deployer, median of 20)",
            &format!("{rollback_ms} ms"),
            &format!("a queued submit to its start: {start_ms} ms"),
            rollback_ms as f64 / (start_ms.max(1)) as f64,
            None,
            false,
        );
    });
    let _ = std::fs::remove_dir_all(&dir);
}
