//! The cost of the power-loss trials' file system itself
//! (tests/integration/powerfs.rs, FUSE served from this process): submits
//! per second with berth's data dir on it, next to the same run on the
//! plain disk. It says how far the trials' timing is from a real disk's,
//! not how fast berth is.
//!
//! Run: `cargo bench --bench power_loss` (needs /dev/fuse and root or
//! fusermount3; says "skipped" without them).

mod common;

use std::time::Instant;

use serde_json::json;

/// The test crate's file system, as it is (its tests are not built here).
#[allow(dead_code)]
#[path = "../tests/integration/powerfs.rs"]
mod powerfs;

/// What powerfs.rs needs of the test harness (`temp_dir` for its own
/// tests, which a check of every target compiles).
#[allow(dead_code)]
mod harness {
    pub fn skip(test: &str, why: &str) {
        eprintln!("skipped: {test}: {why}");
    }
    pub fn temp_dir(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("berth-bench-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}

/// Submits of each run, 8 at a time.
const SUBMITS: usize = 800;

async fn submits_per_second(dir: &std::path::Path) -> f64 {
    let deployer = common::deployer_script(dir, "printf '%s' '{\"nodes\":[]}' > \"$BERTH_RESULT\"");
    let mut berth = common::start_berth(dir, &deployer, &[], &[]).await;
    let (base, token) = (berth.base.clone(), berth.token.trim().to_string());
    let http = reqwest::Client::new();
    let started = Instant::now();
    let tasks: Vec<_> = (0..8)
        .map(|c| {
            let (http, base, token) = (http.clone(), base.clone(), token.clone());
            tokio::spawn(async move {
                for i in 0..SUBMITS / 8 {
                    let r = http
                        .post(format!("{base}/v1/deployments/c{c}-{}/submit", i % 25))
                        .bearer_auth(&token)
                        .json(&json!({"configuration": {}, "mode": "enqueue"}))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 202);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let rate = SUBMITS as f64 / started.elapsed().as_secs_f64();
    let _ = berth.child.kill();
    let _ = berth.child.wait();
    rate
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let root = std::env::temp_dir().join(format!("berth-bench-powerfs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (plain, fused) = (root.join("plain"), root.join("fused"));
    std::fs::create_dir_all(&plain).unwrap();
    std::fs::create_dir_all(&fused).unwrap();
    let Some(fs) = powerfs::mount_or_skip("bench power_loss", &fused) else {
        return;
    };
    common::runtime().block_on(async {
        let disk = submits_per_second(&plain).await;
        let on_fs = submits_per_second(&fused).await;
        let (file_syncs, dir_syncs) = fs.syncs();
        common::record(
            &format!(
                "submits/s on the power-loss test file system ({file_syncs} file syncs, {dir_syncs} directory syncs)"
            ),
            &format!("{on_fs:.0}/s"),
            &format!("plain disk, same run: {disk:.0}/s"),
            on_fs / disk,
            None,
            true,
        );
    });
    drop(fs);
    let _ = std::fs::remove_dir_all(&root);
}
