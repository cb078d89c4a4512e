//! Restart recovery (storage.md "Restart", SC-003): kill -9 the server in the
//! middle of a build, start it again.

use serde_json::json;

use crate::harness::*;

#[tokio::test]
async fn kill_9_mid_build_then_restart() {
    let (mut s, gates, running) = server_with_a_running_build("restart", "alice").await;
    let queued = s.submit_ok("alice", json!({"n": 2})).await;
    let other = s.submit_ok("bob", json!({"n": 1})).await;
    s.wait_build(&other, "running").await;
    open_gate(&gates, "bob");
    s.wait_build(&other, "succeeded").await;
    let job = s.build(&running).await["job_id"]
        .as_str()
        .unwrap()
        .trim_start_matches("pid:")
        .parse::<i32>()
        .unwrap();
    s.kill();
    // The deployer outlived berth (its own process group).
    assert!(std::path::Path::new(&format!("/proc/{job}")).exists());
    s.launch().await;
    let b = s.build(&running).await;
    assert_eq!(b["status"], "failed");
    assert_eq!(b["failure"]["reason"], "interrupted_by_restart");
    // The orphan is stopped before the next build of alice starts.
    eventually("the orphaned deployer is gone", || async {
        !std::path::Path::new(&format!("/proc/{job}")).exists()
            || std::fs::read_to_string(format!("/proc/{job}/stat")).is_ok_and(|s| s.contains(") Z"))
    })
    .await;
    s.wait_build(&queued, "running").await;
    open_gate(&gates, "alice");
    s.wait_build(&queued, "succeeded").await;
    // Everything else is as before.
    let (_, bob) = s.json("/v1/deployments/bob").await;
    assert_eq!(bob["state"], "active");
    let (_, list) = s.json("/v1/deployments").await;
    assert_eq!(list["items"].as_array().unwrap().len(), 2);
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["state"], "active");
}

#[tokio::test]
async fn sigterm_waits_for_running_builds_then_exits() {
    let dir = temp_dir("shutdown");
    let (deployer, gates) = gated_deployer(&dir);
    let mut s = Server::start_in(
        dir,
        Options::default()
            .deployer(&deployer)
            .arg("--shutdown-grace")
            .arg("20s"),
    )
    .await;
    let b = s.submit_ok("alice", json!({})).await;
    s.wait_build(&b, "running").await;
    let mut stream = Sse::open(s.get("/v1/deployments/alice/events")).await;
    assert_eq!(stream.next().await.unwrap().event, "deployment");
    let gates2 = gates.clone();
    let opener = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(500));
        open_gate(&gates2, "alice");
    });
    let status = s.terminate();
    opener.join().unwrap();
    assert!(status.success(), "{status:?}");
    // Open streams are closed cleanly at shutdown.
    while let Some(e) = stream.next().await {
        assert_ne!(e.event, "resync_required");
    }
    s.launch().await;
    assert_eq!(
        s.build(&b).await["status"],
        "succeeded",
        "the build was not allowed to finish"
    );
}

#[tokio::test]
async fn reset_dev_state_needs_dev() {
    let mut s = Server::start(Options::default()).await;
    s.submit_ok("alice", json!({})).await;
    s.kill();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["serve", "--reset-dev-state", "--data-dir"])
        .arg(s.dir.join("data"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs --dev"));
    s.args = vec!["--dev".into(), "--reset-dev-state".into()];
    s.launch().await;
    let (_, list) = s.json("/v1/deployments").await;
    assert_eq!(list["items"].as_array().unwrap().len(), 0);
    assert!(s.log().contains("deleting 1 deployment(s)"));
}
