//! SBOM storage and serving (sbom.md "What the benchmark checks").
//!
//! 1. 1,000 nodes x 1,500 components, 90% shared, stored through the real
//!    final transaction: bytes stored for components against the bytes of
//!    the unique components compressed on their own, and the store file
//!    against the sum of the raw documents.
//! 2. A 5 MB SBOM served by the real binary over HTTP, against reading the
//!    same file from disk and parsing it, in the same run.
//!
//! Run: `cargo bench --bench sboms`.

mod common;

use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use berth::engine::build::{finish_tx, start_tx, Finished};
use berth::engine::outcome::End;
use berth::engine::outcome::{ComponentBytes, NodeOutcome, PreparedSbom, SbomOutcome};
use berth::engine::requests::{submit_tx, Mode, SubmitRecord};
use berth::events::Hub;
use berth::model::*;
use berth::store::{compress, Store};

const NODES: usize = 1_000;
const COMPONENTS: usize = 1_500;
const SHARED: usize = COMPONENTS * 9 / 10;
const NODES_PER_DEPLOYMENT: usize = 10;

fn component(name: &str, i: usize) -> Value {
    json!({
        "type": "library",
        "bom-ref": format!("pkg:nix/{name}@{i}.{}", i % 7),
        "name": name,
        "version": format!("{i}.{}", i % 7),
        "purl": format!("pkg:nix/{name}@{i}.{}", i % 7),
        "hashes": [{"alg": "SHA-256", "content": format!("{:064x}", i * 7919 + name.len())}],
        "licenses": [{"license": {"id": "MIT"}}],
    })
}

fn document(node: usize) -> Value {
    let mut components: Vec<Value> = (0..SHARED).map(|i| component("shared", i)).collect();
    components.extend((0..COMPONENTS - SHARED).map(|i| component(&format!("node{node}"), i)));
    json!({
        "bomFormat": "CycloneDX", "specVersion": "1.5", "version": 1,
        "metadata": {"component": {"type": "operating-system", "name": format!("node{node}")}},
        "components": components,
        "dependencies": [{"ref": format!("node{node}"), "dependsOn": []}],
    })
}

fn prepare(doc: Value) -> PreparedSbom {
    let split = berth::sbom::split(doc).unwrap();
    PreparedSbom {
        skeleton: compress::compress(split.skeleton.to_string().as_bytes()).unwrap(),
        had_components: split.had_components,
        components: split
            .components
            .iter()
            .map(|c| {
                let bytes = compress::compress(c.text.as_bytes()).unwrap();
                (c.hash, ComponentBytes::Compressed(bytes))
            })
            .collect(),
    }
}

fn storage(rt: &tokio::runtime::Runtime) {
    let dir = std::env::temp_dir().join(format!("berth-bench-sboms-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let store = Store::open(&dir.join("berth.redb")).unwrap();
    let hub = Arc::new(Hub::default());
    let source = Source {
        url: "builtin:modules".into(),
        rev: "a".into(),
        digest: format!("sha256:{}", "a".repeat(64)),
    };
    let mut raw_bytes = 0u64;
    let mut unique = std::collections::HashMap::new();
    let started = Instant::now();
    for deployment in 0..NODES / NODES_PER_DEPLOYMENT {
        let mut nodes = Vec::new();
        for n in 0..NODES_PER_DEPLOYMENT {
            let index = deployment * NODES_PER_DEPLOYMENT + n;
            let doc = document(index);
            raw_bytes += serde_json::to_vec(&doc).unwrap().len() as u64;
            let prepared = prepare(doc);
            for (hash, bytes) in &prepared.components {
                if let ComponentBytes::Compressed(c) = bytes {
                    unique.entry(*hash).or_insert(c.len());
                }
            }
            nodes.push(NodeOutcome {
                name: format!("node{index}"),
                changed: true,
                sbom: SbomOutcome::Ready(prepared),
                fingerprint: None,
                artifact: None,
                artifact_bytes: None,
            });
        }
        let (hub, source) = (hub.clone(), source.clone());
        let done = Arc::new(Finished {
            end: End {
                status: BuildStatus::Succeeded,
                failure: None,
                exit_code: Some(0),
            },
            nodes,
            last_chunk: None,
            late_frames: vec![],
            last_seq_used: 0,
            log_gaps: vec![],
            work_state: berth::engine::work_state::NewWorkState::Unchanged,
            keep_work_states: 3,
        });
        rt.block_on(store.write(move |tx| {
            let record = SubmitRecord {
                id: format!("d{deployment:04}"),
                snapshot: Snapshot {
                    configuration: "{}".into(),
                    source: source.clone(),
                },
                method: "local".into(),
                domain: None,
                mode: Mode::Replace,
                update_policy: None,
                auto_rollback: None,
                max_queued: 100,
                rollout_policy: None,
            };
            let audit =
                berth::engine::audit::system_draft("submit", None, berth::audit::AuditResult::Ok);
            let submitted = submit_tx(
                tx,
                &hub,
                &record,
                &berth::engine::audit::Record::audit_only(audit),
            )?
            .expect("stored");
            start_tx(tx, &hub, submitted.build.id, "local-bench")?.expect("started");
            finish_tx(tx, &hub, submitted.build.id, &done)
        }))
        .unwrap();
    }
    let elapsed = started.elapsed();
    let (rows, stored) = store.read().unwrap().component_totals().unwrap();
    let unique_bytes: u64 = unique.values().map(|n| *n as u64).sum();
    assert_eq!(rows as usize, unique.len());
    drop(store);
    let file = std::fs::metadata(dir.join("berth.redb")).unwrap().len();
    let values = stored - 32 * rows;
    println!(
        "components of {NODES} nodes x {COMPONENTS} ({}% shared): {rows} stored rows; the unique components compressed on their own: {:.1} MB; stored rows without their 32-byte keys: {:.1} MB = {:.3}x (goal <= 1.2x); with the keys: {:.1} MB = {:.2}x",
        SHARED * 100 / COMPONENTS,
        unique_bytes as f64 / 1e6,
        values as f64 / 1e6,
        values as f64 / unique_bytes as f64,
        stored as f64 / 1e6,
        stored as f64 / unique_bytes as f64
    );
    println!(
        "store file {:.1} MB vs {:.1} MB of raw documents: {:.3}x; stored in {:.1} s ({:.1} ms per node, split and compressed included)",
        file as f64 / 1e6,
        raw_bytes as f64 / 1e6,
        file as f64 / raw_bytes as f64,
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1000.0 / NODES as f64
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn serving(rt: &tokio::runtime::Runtime) {
    let dir = std::env::temp_dir().join(format!("berth-bench-sbom-serve-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A ~5 MB document: 19,500 components, a few nested.
    let mut components: Vec<Value> = (0..19_500).map(|i| component("pkg", i)).collect();
    for (i, c) in components.iter_mut().enumerate().take(100) {
        c["components"] = json!([component("inner", i)]);
    }
    let doc = json!({"bomFormat": "CycloneDX", "specVersion": "1.5", "components": components,
        "metadata": {"component": {"name": "big"}}});
    let big = dir.join("big.cdx.json");
    std::fs::write(&big, serde_json::to_vec(&doc).unwrap()).unwrap();
    let size = std::fs::metadata(&big).unwrap().len();
    let deployer = common::deployer_script(
        &dir,
        &format!(
            "cp {} \"$BERTH_SCRATCH_DIR/big.json\"; printf '%s' '{{\"nodes\":[{{\"name\":\"big\",\"changed\":true,\"sbom\":{{\"status\":\"ready\",\"path\":\"big.json\"}}}}]}}' > \"$BERTH_RESULT\"",
            big.display()
        ),
    );
    rt.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut started = common::start_berth(&dir, &deployer, &[], &[]).await;
        let http = reqwest::Client::new();
        let token = started.token.trim().to_string();
        let r = http
            .post(format!("{}/v1/deployments/big/submit", started.base))
            .bearer_auth(&token)
            .json(&json!({"configuration": {}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
        let url = format!("{}/v1/deployments/big/sboms/big", started.base);
        loop {
            let r = http.get(&url).bearer_auth(&token).send().await.unwrap();
            if r.status() == 200 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let (mut served, mut from_disk) = (Vec::new(), Vec::new());
        for _ in 0..15 {
            let t = Instant::now();
            let body = http.get(&url).bearer_auth(&token).send().await.unwrap().bytes().await.unwrap();
            served.push(t.elapsed().as_secs_f64() * 1000.0);
            assert!(body.len() as u64 > size / 2);
            let t = Instant::now();
            let parsed: Value = serde_json::from_slice(&std::fs::read(&big).unwrap()).unwrap();
            std::hint::black_box(parsed);
            from_disk.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let (s, d) = (median(served), median(from_disk));
        println!(
            "serve a {:.1} MB SBOM over HTTP: {s:.1} ms (goal < 50 ms); read and parse the same file from disk: {d:.1} ms; ratio {:.1}x",
            size as f64 / 1e6,
            s / d
        );
        let _ = started.child.kill();
        let _ = started.child.wait();
    });
    let _ = std::fs::remove_dir_all(&dir);
}

fn main() {
    let rt = common::runtime();
    serving(&rt);
    storage(&rt);
}
