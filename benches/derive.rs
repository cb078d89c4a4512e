//! Sections of a configuration with 200 applications against a deployed one
//! with renames: time per call. Run: `cargo bench --bench derive`.

mod common;

use std::time::Instant;

use berth::derive::{self, Rename};
use serde_json::{json, Map, Value};

fn main() {
    let catalog = berth::local_deployer::catalog::catalog();
    let mut draft_apps = Map::new();
    let mut deployed_apps = Map::new();
    let mut renames = Vec::new();
    for i in 0..200 {
        let settings = json!({"enable": i % 3 != 0, "replicas": i % 5, "tags": ["a", "b", i], "nested": {"x": i, "y": format!("v{i}")}});
        draft_apps.insert(format!("app{i:03}"), settings.clone());
        // Half of the deployed ones are stored under their old names.
        if i % 2 == 0 {
            deployed_apps.insert(format!("old{i:03}"), settings);
            renames.push(Rename {
                from: format!("/old{i:03}"),
                to: format!("/app{i:03}"),
            });
        } else {
            let mut changed = settings;
            changed["replicas"] = json!(99);
            deployed_apps.insert(format!("app{i:03}"), changed);
        }
    }
    let draft = json!({"domain": "a.example.org", "applications": Value::Object(draft_apps)});
    let deployed = json!({"deployment": {"local": {"domain": "a.example.org", "applications": Value::Object(deployed_apps)}}});

    let run = || derive::sections(&draft, Some(&deployed), &renames, &catalog).expect("valid");
    let sections = run();
    assert_eq!(sections.iter().filter(|s| s.changed).count(), 100);
    for _ in 0..50 {
        run();
    }
    let mut samples = Vec::new();
    for _ in 0..15 {
        let n = 200;
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(run());
        }
        samples.push(t.elapsed().as_secs_f64() / f64::from(n) * 1e6);
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    // Baseline in the same run: a deep clone of both configurations, the
    // least any derivation that copies before renaming must do.
    let t = Instant::now();
    for _ in 0..200 {
        std::hint::black_box((draft.clone(), deployed.clone()));
    }
    let clone_us = t.elapsed().as_secs_f64() / 200.0 * 1e6;
    println!(
        "derive sections, 200 applications, 100 renames: median {:.1} us/call (min {:.1}, max {:.1}); clone of both configurations {:.1} us; ratio {:.1}x",
        samples[samples.len() / 2],
        samples[0],
        samples[samples.len() - 1],
        clone_us,
        samples[samples.len() / 2] / clone_us
    );
    hostile_derivation();
}

/// The public derive request of the hostile-input issue (one application
/// holding a 470,000-element array, 1,000 renames `/a/q` -> `/a/r`, ~1 MB)
/// against the real binary: its answer time, and `/healthz` latency while
/// two of them run, next to `/healthz` on an idle server in the same run.
fn hostile_derivation() {
    let dir = std::env::temp_dir().join(format!("berth-bench-derive-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let renames: Vec<Value> = (0..1000)
        .map(|_| json!({"from": "/a/q", "to": "/a/r"}))
        .collect();
    let big: Vec<u32> = (0..470_000).map(|i| i % 10).collect();
    let body = json!({"draft": {"applications": {"a": {"big": big}}}, "deployed": {"applications": {"a": {}}}, "renames": renames});
    let body = serde_json::to_vec(&body).unwrap();
    let rt = common::runtime();
    rt.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_berth"));
        // No deployer is called by this route; any executable will do.
        let mut started = common::start_berth(&dir, &exe, &["--max-body", "2000000"], &[]).await;
        let http = reqwest::Client::new();
        let url = format!("{}/v1/derive/applications", started.base);
        let healthz = format!("{}/healthz", started.base);
        let health = |http: reqwest::Client, url: String| async move {
            let t = Instant::now();
            assert!(http.get(url).send().await.unwrap().status().is_success());
            t.elapsed().as_secs_f64() * 1000.0
        };
        let mut idle = Vec::new();
        for _ in 0..20 {
            idle.push(health(http.clone(), healthz.clone()).await);
        }
        let t = Instant::now();
        let r = http.post(&url).header("content-type", "application/json").body(body.clone()).send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.status());
        let one = t.elapsed().as_secs_f64() * 1000.0;
        let busy: Vec<_> = (0..2)
            .map(|_| {
                let (http, url, body) = (http.clone(), url.clone(), body.clone());
                tokio::spawn(async move {
                    http.post(url).header("content-type", "application/json").body(body).send().await.unwrap().status()
                })
            })
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let mut during = Vec::new();
        for _ in 0..20 {
            during.push(health(http.clone(), healthz.clone()).await);
        }
        for b in busy {
            assert!(b.await.unwrap().is_success());
        }
        let median = |mut v: Vec<f64>| {
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        };
        println!(
            "hostile derive (470,000-element array, 1,000 renames, {:.1} MB): {one:.0} ms; /healthz with two in flight: median {:.2} ms (idle {:.2} ms)",
            body.len() as f64 / 1e6,
            median(during),
            median(idle)
        );
        let _ = started.child.kill();
        let _ = started.child.wait();
    });
    let _ = std::fs::remove_dir_all(&dir);
}
