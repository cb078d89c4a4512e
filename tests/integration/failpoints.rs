//! Storage that fails for good at chosen places (src/failpoints.rs, the
//! `failpoints` feature the README's test command turns on): the paths only
//! a broken disk takes. A build whose final commit fails is stored `failed`
//! with `final_commit_failed`, or, when even that fails, keeps its slot
//! until a restart recovers it; one failing job never fails the jobs
//! committed with it; an audit write that fails after the call is counted
//! and logged, and the call is still answered.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::*;

/// Whether this build has failpoints; a test without them says so.
fn available(test: &str) -> bool {
    if cfg!(feature = "failpoints") {
        return true;
    }
    skip(
        test,
        "built without `--features failpoints` (the README's test command has it)",
    );
    false
}

async fn wait_finished(s: &Server, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let b = s.build(id).await;
        if b["status"] != "queued" && b["status"] != "running" {
            return b;
        }
        assert!(Instant::now() < deadline, "never finished: {b}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_build_whose_final_commit_fails_is_stored_failed_with_its_reason() {
    if !available("failpoints::final_commit") {
        return;
    }
    let s =
        Server::start(Options::default().env("FAILPOINTS", "build.final_commit=1*return")).await;
    let b = s.submit_ok_without_rollback("alice", json!({})).await;
    let done = wait_finished(&s, &b).await;
    assert_eq!(done["status"], "failed", "{done}");
    assert_eq!(done["failure"]["reason"], "final_commit_failed", "{done}");
    // The next build is not held up by it.
    let next = s.submit_ok("alice", json!({})).await;
    assert_eq!(wait_finished(&s, &next).await["status"], "succeeded");
    assert!(s.log().contains("cannot store the final status of a build"));
}

#[tokio::test]
async fn a_build_whose_every_final_commit_fails_keeps_its_slot_until_a_restart() {
    if !available("failpoints::final_commit_always") {
        return;
    }
    let mut s =
        Server::start(Options::default().env("FAILPOINTS", "build.final_commit=return")).await;
    let first = s.submit_ok("alice", json!({})).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !s.log().contains("cannot store any final status of a build") {
        assert!(Instant::now() < deadline, "{}", s.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let second = s.submit_ok("alice", json!({})).await;
    // Its deployer is gone, yet the build keeps its slot: nothing else of
    // the deployment runs on top of a state berth could not record. A
    // build of another deployment, queued after it, starts: the queue
    // (oldest first) has passed over the second one by then.
    let other = s.submit_ok("bob", json!({})).await;
    s.wait_build(&other, "running").await;
    assert_eq!(s.build(&first).await["status"], "running");
    assert_eq!(s.build(&second).await["status"], "queued");
    s.kill();
    s.envs.retain(|(k, _)| k != "FAILPOINTS");
    s.launch().await;
    let recovered = s.build(&first).await;
    assert_eq!(recovered["status"], "failed", "{recovered}");
    assert_eq!(recovered["failure"]["reason"], "interrupted_by_restart");
    assert_eq!(wait_finished(&s, &second).await["status"], "succeeded");
}

#[tokio::test]
async fn a_failing_job_never_fails_the_jobs_committed_with_it() {
    if !available("failpoints::batch_mates") {
        return;
    }
    let s =
        Server::start(Options::default().env("FAILPOINTS", "submit.job=return(poisoned)")).await;
    // Sent at once, so the writer commits many of them together.
    let sends = (0..40).map(|i| {
        let id = if i % 8 == 0 {
            "poisoned".to_string()
        } else {
            format!("fine-{i}")
        };
        let r = s.post(
            &format!("/v1/deployments/{id}/submit"),
            &json!({"configuration": {}, "mode": "enqueue"}),
        );
        async move { (id, read(r.send().await.unwrap()).await) }
    });
    let answers = futures_util::future::join_all(sends).await;
    for (id, (status, body)) in &answers {
        if id == "poisoned" {
            assert!(*status >= 500, "{id}: {status} {body}");
            assert!(
                !body.to_string().contains("failpoint"),
                "an internal error's text reached the client: {body}"
            );
        } else {
            assert_eq!(*status, 202, "{id}: {body}");
            let (found, _) = s.json(&format!("/v1/deployments/{id}")).await;
            assert_eq!(found, 200, "{id} was acknowledged but is not stored");
        }
    }
    let (status, _) = s.json("/v1/deployments/poisoned").await;
    assert_eq!(status, 404, "the failed job left a deployment behind");
    // And it did share batches: the writer says when the rest of one ran
    // again alone.
    let log = s.log();
    let shared = log
        .lines()
        .filter(|l| l.contains("the rest of its batch runs again"))
        .filter_map(|l| l.split("jobs=").nth(1))
        .filter_map(|t| t.split(|c: char| !c.is_ascii_digit()).next())
        .filter_map(|n| n.parse::<usize>().ok())
        .any(|jobs| jobs > 1);
    assert!(shared, "no batch held the failing job with others:\n{log}");
}

#[tokio::test]
async fn an_audit_write_that_fails_is_counted_and_logged_and_the_call_answered() {
    if !available("failpoints::audit_alone") {
        return;
    }
    let s = Server::start(Options::default().env("FAILPOINTS", "audit.alone=return")).await;
    // A refused call: its event is written on its own, after the refusal.
    let (status, body) = s
        .submit("alice", json!({"configuration": {}, "mode": "sideways"}))
        .await;
    assert_eq!(status, 400, "{body}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = s.metrics().await;
        let failures = metrics
            .lines()
            .find_map(|l| l.strip_prefix("berth_audit_write_failures_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .expect("berth_audit_write_failures_total in /metrics");
        if failures >= 1 {
            break;
        }
        assert!(Instant::now() < deadline, "not counted:\n{metrics}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(s
        .log()
        .contains("cannot write the audit event of a refused call"));
    // Calls that change something carry their event in their own
    // transaction, untouched by this failpoint.
    s.submit_ok("alice", json!({})).await;
}

/// A store held alone, whose redo log fails: an append that fails aborts
/// its batch, and a redb commit that fails after the append takes the
/// record back; either way the submit is refused, and no restart (the
/// replay of the log) brings it back.
#[tokio::test]
async fn a_redo_log_that_fails_refuses_the_batch_and_no_restart_brings_it_back() {
    if !available("failpoints::redo") {
        return;
    }
    for place in ["redo.append", "redo.commit"] {
        let mut s = Server::start(
            Options::default()
                .arg("--checkpoint-interval")
                .arg("60s")
                .env("FAILPOINTS", &format!("{place}=return(refused)")),
        )
        .await;
        let (status, body) = s
            .submit("refused", json!({"configuration": {}, "mode": "enqueue"}))
            .await;
        assert!(status >= 500, "{place}: {status} {body}");
        let kept = s.submit_ok("kept", json!({})).await;
        assert_eq!(s.json("/v1/deployments/refused").await.0, 404, "{place}");
        s.kill();
        s.envs.retain(|(k, _)| k != "FAILPOINTS");
        s.launch().await;
        assert_eq!(
            s.json("/v1/deployments/refused").await.0,
            404,
            "{place}: the replay applied a refused batch"
        );
        assert_eq!(
            s.json(&format!("/v1/builds/{kept}")).await.0,
            200,
            "{place}"
        );
        s.kill();
    }
}

/// Whether files under `dir` can be opened with `O_DIRECT` (tmpfs
/// refuses it).
fn takes_direct_io(dir: &std::path::Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let probe = dir.join("direct-io-probe");
    let opened = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
        .open(&probe)
        .is_ok();
    let _ = std::fs::remove_file(&probe);
    opened
}

/// A disk that refuses every direct write of the redo log as misaligned
/// (one whose blocks are larger than 4 KiB, `store/blocks.rs`) gets the
/// records through the page cache: every submit is answered, and a
/// restart after kill -9 replays them all.
#[tokio::test]
async fn a_disk_that_refuses_the_logs_direct_writes_gets_its_records_through_the_page_cache() {
    if !available("failpoints::redo_direct_write") {
        return;
    }
    let mut s = Server::start(
        Options::default()
            .arg("--checkpoint-interval")
            .arg("60s")
            .env("FAILPOINTS", "redo.direct_write=return"),
    )
    .await;
    if !takes_direct_io(&s.dir.join("data")) {
        skip(
            "failpoints::redo_direct_write",
            "the data dir's file system refuses O_DIRECT, so the log never writes that way",
        );
        return;
    }
    let mut builds = Vec::new();
    for i in 0..5 {
        builds.push(s.submit_ok(&format!("direct-{i}"), json!({})).await);
    }
    assert!(
        s.log().contains("refuses its O_DIRECT writes"),
        "the refusal is not in the log: {}",
        s.log()
    );
    // Killed with every record only in the log (no checkpoint in 60 s).
    s.kill();
    relaunch_and_find(&mut s, &builds, "").await;
    s.kill();
}

/// Starts `s` again without failpoints and checks that every build in
/// `builds` is there (`when` ends each failure's message).
async fn relaunch_and_find(s: &mut Server, builds: &[String], when: &str) {
    s.envs.retain(|(k, _)| k != "FAILPOINTS");
    s.launch().await;
    for b in builds {
        assert_eq!(s.json(&format!("/v1/builds/{b}")).await.0, 200, "{b}{when}");
    }
}

#[tokio::test]
async fn a_restart_whose_recovery_meets_a_full_disk_stays_not_ready_and_retries_until_it_lands() {
    if !available("failpoints::recovery_retry") {
        return;
    }
    let (mut s, _gates, running) = server_with_a_running_build("recovery-retry", "alice").await;
    s.kill();
    // Recovery's write fails four times as on a full disk: it retries after
    // 0.1, 0.2, 0.4 and 0.8 s, and berth answers meanwhile, not ready.
    s.envs
        .push(("FAILPOINTS".into(), "recover.job=4*return".into()));
    s.spawn();
    s.wait_listening().await;
    let retrying =
        "marking an interrupted build failed (not ready until it lands) failed; retrying";
    let deadline = Instant::now() + Duration::from_secs(20);
    while !s.log().contains(retrying) {
        assert!(Instant::now() < deadline, "{}", s.log());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let readyz = s.http.get(s.url("/readyz")).send().await.unwrap().status();
    assert_eq!(readyz, 503, "ready while recovery still retries");
    let (status, body) = s
        .submit("bob", json!({"configuration": {"n": 1}, "mode": "enqueue"}))
        .await;
    assert_eq!(status, 503, "a submit before recovery landed: {body}");
    assert_eq!(body["code"], "unavailable", "{body}");
    s.wait_ready().await;
    assert_eq!(s.log().matches(retrying).count(), 4, "{}", s.log());
    let b = s.build(&running).await;
    assert_eq!(b["status"], "failed", "{b}");
    assert_eq!(b["failure"]["reason"], "interrupted_by_restart", "{b}");
    // Nothing acknowledged went missing and berth takes work again.
    s.submit_ok("bob", json!({"n": 1})).await;
}

/// A checkpoint that fails (redb's durable commit): the store is reopened
/// from its redo log, and every submit answered 202 before and after is
/// served, by the same berth and after a stop and a start.
#[tokio::test]
async fn a_failed_checkpoint_loses_nothing() {
    if !available("failpoints::redb_checkpoint") {
        return;
    }
    // The 12th checkpoint of the process.
    let mut s =
        Server::start(Options::default().env("FAILPOINTS", "redb.checkpoint=return(12)")).await;
    let mut builds = Vec::new();
    let submit = |n: usize| {
        let s = &s;
        async move {
            let id = format!("d-{n}");
            let (status, body) = s
                .submit(&id, json!({"configuration": {}, "mode": "enqueue"}))
                .await;
            match status {
                202 => Some(body["build_id"].as_str().unwrap().to_string()),
                503 => {
                    assert_eq!(body["reason"], "storage_io", "{body}");
                    None
                }
                _ => panic!("{status} {body}"),
            }
        }
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    while !s.log().contains("store reopened after an I/O error") {
        assert!(
            Instant::now() < deadline,
            "no reopen after the failed checkpoint:\n{}",
            s.log()
        );
        n += 1;
        builds.extend(submit(n).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        s.log().contains("failpoint redb.checkpoint"),
        "the reopen was not the failed checkpoint's:\n{}",
        s.log()
    );
    for _ in 0..10 {
        n += 1;
        let acknowledged = submit(n).await;
        assert!(
            acknowledged.is_some(),
            "a submit after the reopen failed:\n{}",
            s.log()
        );
        builds.extend(acknowledged);
    }
    for b in &builds {
        assert_eq!(s.json(&format!("/v1/builds/{b}")).await.0, 200, "{b}");
    }
    s.terminate();
    relaunch_and_find(&mut s, &builds, " after a restart").await;
    s.kill();
}
