//! Queue rules (lifecycle.md "Queue", FR-009), with a deployer that blocks
//! until the test opens its gate.

use serde_json::json;

use crate::harness::*;

fn gated(dir: &std::path::Path, slots: &str) -> (Options, std::path::PathBuf) {
    let (deployer, gates) = gated_deployer(dir);
    (
        Options::default()
            .deployer(&deployer)
            .arg("--build-slots")
            .arg(slots),
        gates,
    )
}

#[tokio::test]
async fn replace_enqueue_and_fifo() {
    let dir = temp_dir("queue");
    let (opts, gates) = gated(&dir, "4");
    let s = Server::start(opts).await;
    let first = s.submit_ok("alice", json!({"n": 1})).await;
    s.wait_build(&first, "running").await;
    // Replace while running: queue_full, nothing stored.
    let (status, p) = s.submit("alice", json!({"configuration": {"n": 2}})).await;
    assert_eq!(status, 409, "{p}");
    assert_eq!(p["code"], "queue_full");
    let (_, builds) = s.json("/v1/deployments/alice/builds").await;
    assert_eq!(builds["items"].as_array().unwrap().len(), 1);
    // Enqueue always queues.
    let second = s.submit_ok("alice", json!({"n": 2})).await;
    let third = s.submit_ok("alice", json!({"n": 3})).await;
    assert_eq!(s.build(&second).await["status"], "queued");
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["state"], "building");
    assert_eq!(d["configuration"], json!({"n": 3}));
    // One at a time, oldest first.
    open_gate(&gates, "alice");
    s.wait_build(&first, "succeeded").await;
    s.wait_build(&second, "running").await;
    assert_eq!(s.build(&third).await["status"], "queued");
    open_gate(&gates, "alice");
    s.wait_build(&second, "succeeded").await;
    s.wait_build(&third, "running").await;
    // A delete queues a destroy behind whatever is queued...
    let r = s.delete("/v1/deployments/alice").send().await.unwrap();
    let (_, del) = read(r).await;
    let destroy = del["build_id"].as_str().unwrap().to_string();
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["state"], "destroying");
    open_gate(&gates, "alice");
    s.wait_build(&third, "succeeded").await;
    s.wait_build(&destroy, "running").await;
    // ...and a replace-mode submit behind a *queued* build is accepted.
    open_gate(&gates, "alice");
    s.wait_build(&destroy, "succeeded").await;
    let fourth = s.submit_ok("alice", json!({"n": 4})).await;
    s.wait_build(&fourth, "running").await;
    let fifth = s.submit_ok("alice", json!({"n": 5})).await; // queued behind the running one
                                                             // The running build's deployer notes its start once it passes its gate.
    eventually("the fourth deployer started", || async {
        std::fs::read_to_string(gates.join("alice.log")).is_ok_and(|o| o.lines().count() >= 5)
    })
    .await;
    let order = std::fs::read_to_string(gates.join("alice.log")).unwrap();
    assert_eq!(
        order.lines().collect::<Vec<_>>(),
        ["deploy", "deploy", "deploy", "destroy", "deploy"]
    );
    open_gate(&gates, "alice");
    s.wait_build(&fourth, "succeeded").await;
    s.wait_build(&fifth, "running").await;
    let (status, _) = s.submit("alice", json!({"configuration": {"n": 6}})).await;
    assert_eq!(status, 409);
    open_gate(&gates, "alice");
    s.wait_build(&fifth, "succeeded").await;
}

#[tokio::test]
async fn queued_build_does_not_block_replace() {
    let dir = temp_dir("queue-replace");
    let (opts, gates) = gated(&dir, "1");
    let s = Server::start(opts).await;
    // Slot taken by "other": alice's build stays queued, never running.
    let blocker = s.submit_ok("other", json!({})).await;
    s.wait_build(&blocker, "running").await;
    let queued = s.submit_ok("alice", json!({"n": 1})).await;
    let (status, body) = s
        .submit(
            "alice",
            json!({"configuration": {"n": 2}, "mode": "replace"}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let replaced = body["build_id"].as_str().unwrap().to_string();
    assert_eq!(s.build(&queued).await["status"], "queued");
    open_gate(&gates, "other");
    s.wait_build(&queued, "running").await;
    open_gate(&gates, "alice");
    s.wait_build(&replaced, "running").await;
    open_gate(&gates, "alice");
    s.wait_build(&replaced, "succeeded").await;
}

#[tokio::test]
async fn slots_are_shared_fairly_and_never_exceeded() {
    let dir = temp_dir("queue-slots");
    let (opts, gates) = gated(&dir, "2");
    let s = Server::start(opts).await;
    // a has three builds queued, then b and c one each.
    let a1 = s.submit_ok("a", json!({})).await;
    let a2 = s.submit_ok("a", json!({})).await;
    let b1 = s.submit_ok("b", json!({})).await;
    let c1 = s.submit_ok("c", json!({})).await;
    s.wait_build(&a1, "running").await;
    s.wait_build(&b1, "running").await;
    // Two slots: c waits although a has more queued.
    assert_eq!(s.build(&c1).await["status"], "queued");
    assert_eq!(s.build(&a2).await["status"], "queued");
    open_gate(&gates, "a");
    s.wait_build(&a1, "succeeded").await;
    // The oldest waiting build of a deployment with nothing running: a2 (queued before c1).
    s.wait_build(&a2, "running").await;
    assert_eq!(s.build(&c1).await["status"], "queued");
    open_gate(&gates, "b");
    s.wait_build(&c1, "running").await;
    let (_, m) = (
        0,
        s.get("/metrics")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    );
    assert!(m.contains("berth_running_builds 2"), "{m}");
    open_gate(&gates, "a");
    open_gate(&gates, "c");
    s.wait_build(&a2, "succeeded").await;
    s.wait_build(&c1, "succeeded").await;
}

#[tokio::test]
async fn cancel_queued_and_running() {
    let dir = temp_dir("queue-cancel");
    let (opts, _gates) = gated(&dir, "4");
    let s = Server::start(opts).await;
    let running = s.submit_ok("alice", json!({})).await;
    let queued = s.submit_ok("alice", json!({})).await;
    s.wait_build(&running, "running").await;
    let r = s
        .post(&format!("/v1/builds/{queued}/cancel"), &json!({}))
        .send()
        .await
        .unwrap();
    let (status, b) = read(r).await;
    assert_eq!(status, 202);
    assert_eq!(b["status"], "cancelled");
    // Cancel it once its deployer is at work (a build is `running` a moment
    // before its deployer starts: it waits for its job record to commit).
    eventually("the deployer started", || async {
        s.log_text(&running).await.contains("start deploy alice")
    })
    .await;
    let r = s
        .post(&format!("/v1/builds/{running}/cancel"), &json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let b = s.wait_build(&running, "final").await;
    assert_eq!(b["status"], "cancelled", "{b}");
    let (status, p) = read(
        s.post(&format!("/v1/builds/{running}/cancel"), &json!({}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 409);
    assert_eq!(p["code"], "conflict");
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(
        d["state"], "failed",
        "cancelled after it started counts as failed: {d}"
    );
    assert!(s.log_text(&running).await.contains("start deploy alice"));
}

#[tokio::test]
async fn old_builds_are_removed_but_never_the_last_successful_deploy() {
    // Every build is "old" (0 days); keep the newest 2.
    let s = Server::start(
        Options::default()
            .arg("--keep-builds")
            .arg("2")
            .arg("--keep-build-days")
            .arg("0")
            .arg("--sweep-interval")
            .arg("200ms")
            .env("BERTH_LOCAL_FAIL", "pixelfed"),
    )
    .await;
    let good = s
        .submit_ok(
            "alice",
            json!({"domain": "a.org", "applications": {"mastodon": {"enable": true}}}),
        )
        .await;
    s.wait_build(&good, "succeeded").await;
    let mut failing = vec![];
    for _ in 0..4 {
        let id = s
            .submit_ok_without_rollback(
                "alice",
                json!({"domain": "a.org", "applications": {"pixelfed": {"enable": true}}}),
            )
            .await;
        s.wait_build(&id, "failed").await;
        failing.push(id);
    }
    eventually("the sweep removes old builds", || async {
        let (_, b) = s.json("/v1/deployments/alice/builds").await;
        b["items"].as_array().unwrap().len() == 3
    })
    .await;
    let (_, b) = s.json("/v1/deployments/alice/builds").await;
    let ids: Vec<&str> = b["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [failing[3].as_str(), failing[2].as_str(), good.as_str()]
    );
    // A removed build is gone with its log; the kept deploy still has its own.
    let (status, _) = s.json(&format!("/v1/builds/{}", failing[0])).await;
    assert_eq!(status, 404);
    assert!(s
        .log_text(&good)
        .await
        .contains("deployment alice is active"));
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["deployed"]["build_id"], good.as_str());
}
