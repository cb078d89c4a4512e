//! Faults (issue "Faults"): a cancel ends a deployer whatever its pipes do,
//! shutdown ends what still runs after its grace and records it, recovery
//! stops a whole orphaned group.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::*;

/// The pid of a running build's deployer (`job_id` is `pid:N`).
fn pid_of(build: &Value) -> i32 {
    build["job_id"]
        .as_str()
        .and_then(|j| j.strip_prefix("pid:"))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no job id in {build}"))
}

/// The pid of a running build's deployer once its job record is stored
/// (a build is `running` a moment before its job record lands).
async fn running_pid(s: &Server, build: &str) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let b = s.build(build).await;
        if b["job_id"].is_string() {
            return pid_of(&b);
        }
        assert!(Instant::now() < deadline, "no job record: {b}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn group_alive(pgid: i32) -> bool {
    nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), None).is_ok()
}

async fn wait_gone(pgid: i32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while group_alive(pgid) {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    true
}

/// A deployer whose deploy closes stdout and stderr at once (as `exec
/// >logfile 2>&1` does) and then works for a long time in a child.
fn silent_deployer(dir: &std::path::Path) -> std::path::PathBuf {
    let body = format!(
        "{SCRIPT_PRELUDE}\nexec >/dev/null 2>&1\nsleep 60 &\nwait\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"\n"
    );
    script(dir, "silent.sh", &body)
}

#[tokio::test]
async fn a_cancel_stops_a_deployer_that_closed_its_pipes() {
    let dir = temp_dir("cancel-silent");
    let deployer = silent_deployer(&dir);
    let s = Server::start(
        Options::default()
            .deployer(&deployer)
            .arg("--cancel-grace")
            .arg("1s"),
    )
    .await;
    let b = s.submit_ok("quiet", json!({})).await;
    let running = s.wait_build(&b, "running").await;
    let pgid = running_pid(&s, &b).await;
    // Past the point where its pipes closed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(group_alive(pgid));
    let r = s
        .post(&format!("/v1/builds/{b}/cancel"), &json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let done = s.wait_build(&b, "final").await;
    assert_eq!(done["status"], "cancelled", "{done}\n{running}");
    assert!(
        wait_gone(pgid, Duration::from_secs(5)).await,
        "the deployer outlived its cancel"
    );
}

#[tokio::test]
async fn shutdown_stops_what_still_runs_after_its_grace_and_records_it() {
    let dir = temp_dir("shutdown-stop");
    let deployer = silent_deployer(&dir);
    let mut s = Server::start_in(
        dir,
        Options::default()
            .deployer(&deployer)
            .arg("--shutdown-grace")
            .arg("1s")
            .arg("--cancel-grace")
            .arg("1s"),
    )
    .await;
    let b = s.submit_ok("late", json!({})).await;
    s.wait_build(&b, "running").await;
    let pgid = running_pid(&s, &b).await;
    let started = Instant::now();
    let status = s.terminate();
    assert!(status.success(), "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "shutdown took {:?}",
        started.elapsed()
    );
    // (A killed child may stay a zombie until init reaps it.)
    assert!(
        wait_gone(pgid, Duration::from_secs(3)).await,
        "a deployer outlived berth's shutdown"
    );
    s.launch().await;
    let b = s.build(&b).await;
    assert_eq!(b["status"], "failed", "{b}");
    assert_eq!(b["failure"]["reason"], "interrupted_by_shutdown", "{b}");
}

/// berth dies; the deployer's leader exits afterwards but leaves a child in
/// its group. Recovery stops the group, not only a leader that is gone.
#[tokio::test]
async fn recovery_stops_an_orphaned_group_whose_leader_is_gone() {
    let dir = temp_dir("orphan-group");
    let child_pid = dir.join("child.pid");
    let body = format!(
        "{SCRIPT_PRELUDE}\nsleep 60 &\necho $! > {pidfile}\nsleep 1.5\nexit 0\n",
        pidfile = child_pid.display()
    );
    let deployer = script(&dir, "leaves-a-child.sh", &body);
    let mut s = Server::start_in(dir.clone(), Options::default().deployer(&deployer)).await;
    let b = s.submit_ok("orphan", json!({})).await;
    s.wait_build(&b, "running").await;
    let pgid = running_pid(&s, &b).await;
    eventually("the child started", || async { child_pid.exists() }).await;
    s.kill();
    // The leader exits while berth is down; its child lives on.
    let leader_gone = wait_gone_pid(pgid, Duration::from_secs(10)).await;
    assert!(leader_gone, "the leader did not exit");
    assert!(group_alive(pgid), "the child should still be alive");
    s.launch().await;
    assert!(
        wait_gone(pgid, Duration::from_secs(10)).await,
        "recovery left the orphaned group alive"
    );
    let b = s.build(&b).await;
    assert_eq!(b["failure"]["reason"], "interrupted_by_restart", "{b}");
}

async fn wait_gone_pid(pid: i32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    // A zombie still has /proc/<pid>; its state is Z.
    let alive = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                !s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(false)
    };
    while alive(pid) {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    true
}

fn builds_metric(metrics: &str, status: &str) -> u64 {
    let prefix = format!("berth_builds{{status=\"{status}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {prefix} in\n{metrics}"))
        .trim()
        .parse()
        .unwrap()
}

/// `/metrics` counts builds by status as they are, at every scrape, and
/// keeps them across a restart.
#[tokio::test]
async fn metrics_count_builds_by_status_as_they_are() {
    let mut s = Server::start(Options::default()).await;
    let b = s.submit_ok("counted", mastodon("counted.org")).await;
    let m = s.metrics().await;
    assert_eq!(
        builds_metric(&m, "queued") + builds_metric(&m, "running"),
        1,
        "{m}"
    );
    s.wait_build(&b, "succeeded").await;
    let m = s.metrics().await;
    assert_eq!(
        builds_metric(&m, "succeeded"),
        1,
        "a scrape right after a success"
    );
    assert_eq!(
        builds_metric(&m, "queued") + builds_metric(&m, "running"),
        0
    );
    let queued = s.submit_ok("counted", mastodon("counted.org")).await;
    let r = s
        .post(&format!("/v1/builds/{queued}/cancel"), &json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    s.wait_build(&queued, "final").await;
    s.kill();
    s.launch().await;
    let m = s.metrics().await;
    assert_eq!(builds_metric(&m, "succeeded"), 1, "{m}");
    assert_eq!(
        builds_metric(&m, "cancelled") + builds_metric(&m, "failed"),
        1,
        "{m}"
    );
}

/// The server log is plain text when stderr is a file, and one JSON object
/// per line with `BERTH_LOG_FORMAT=json`.
#[tokio::test]
async fn logs_are_plain_in_files_and_json_on_request() {
    let s = Server::start(Options::default()).await;
    let log = s.log();
    assert!(log.contains("berth listening"), "{log}");
    assert!(!log.contains('\u{1b}'), "colour codes in a file:\n{log}");
    drop(s);
    let s = Server::start(Options::default().env("BERTH_LOG_FORMAT", "json")).await;
    let log = s.log();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    for line in lines {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line}"));
        assert!(v.get("level").is_some(), "{v}");
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .arg("serve")
        .env("BERTH_LOG_FORMAT", "xml")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("BERTH_LOG_FORMAT must be text or json"));
}

/// A log of several chunks: the full log streams chunk by chunk, a Range
/// anywhere (across chunk boundaries, the tail) equals that slice of it,
/// and a replay from a cursor deep in the log gives exactly the lines after.
#[tokio::test]
async fn a_multi_chunk_log_is_read_by_range_and_replayed_from_a_cursor() {
    let dir = temp_dir("chunks");
    // ~2.7 MB in 40,000 numbered lines: at least three chunks of at most 1 MiB.
    let body = format!(
        "{SCRIPT_PRELUDE}\ni=0\nwhile [ $i -lt 40000 ]; do echo \"line $i of a long build log with some padding to make it longer\"; i=$((i+1)); done\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"\n"
    );
    let deployer = script(&dir, "chatty.sh", &body);
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let b = s.submit_ok("chatty", json!({})).await;
    let build = s.wait_build(&b, "succeeded").await;
    let full = s.log_text(&b).await.into_bytes();
    assert_eq!(full.len() as u64, build["log_bytes"].as_u64().unwrap());
    assert!(full.len() > (2 << 20) + 100_000, "{} bytes", full.len());
    let lines: Vec<&[u8]> = full.split(|&c| c == b'\n').collect();
    // Chunks decode in parallel and must still arrive in order.
    for (i, line) in lines[..40_000].iter().enumerate() {
        assert!(
            line.starts_with(format!("line {i} ").as_bytes()),
            "line {i} out of place"
        );
    }
    let mib = 1 << 20;
    for (spec, from, to) in [
        (
            format!("bytes={}-{}", mib - 10, mib + 10),
            mib - 10,
            mib + 11,
        ),
        (format!("bytes={}-{}", 100, 2 * mib + 5), 100, 2 * mib + 6),
        ("bytes=-100".to_string(), full.len() - 100, full.len()),
        (
            format!("bytes={}-", full.len() - 5),
            full.len() - 5,
            full.len(),
        ),
    ] {
        let r = s
            .get(&format!("/v1/builds/{b}/log"))
            .header("range", spec.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 206, "{spec}");
        assert_eq!(
            r.bytes().await.unwrap().to_vec(),
            full[from..to].to_vec(),
            "{spec}"
        );
    }
    // Replay from a cursor in the third chunk: exactly the lines after it.
    let first_seq = 3; // `queued` is seq 1, `running` seq 2, then the lines
    let cursor = first_seq + 30_000 - 1;
    let mut events = Sse::open(
        s.get(&format!("/v1/builds/{b}/events"))
            .header("last-event-id", cursor.to_string()),
    )
    .await;
    let all = events.until_end().await;
    let logs: Vec<&SseEvent> = all.iter().filter(|e| e.event == "log").collect();
    let total = build["log_lines"].as_u64().unwrap() as usize;
    assert_eq!(logs.len(), total - 30_000, "lines after the cursor");
    assert_eq!(logs[0].id, Some(cursor + 1));
    assert_eq!(logs[0].data.as_bytes(), lines[30_000]);
    assert!(all.iter().any(|e| e.event == "status"));
}

/// A preview whose client leaves mid-eval leaves nothing behind: the eval
/// keeps its slot until its process is dead, the timeout still stops it,
/// and its scratch dir goes.
#[tokio::test]
async fn an_abandoned_preview_leaves_no_process_slot_or_dir() {
    let dir = temp_dir("abandoned-eval");
    let pidfile = dir.join("eval.pid");
    let body = format!(
        r#"
verb="$1"
case "$verb" in
describe) cat >/dev/null; printf '%s' '{{"methods":["local"],"default_method":"local","actions":{{}},"catalog":[],"schema":null}}' > "$BERTH_RESULT"; exit 0;;
eval) cat >/dev/null; echo $$ > {pid}; sleep 30; exit 0;;
esac
cat >/dev/null
"#,
        pid = pidfile.display()
    );
    let deployer = script(&dir, "slow-eval.sh", &body);
    let s = Server::start(
        Options::default()
            .deployer(&deployer)
            .arg("--eval-timeout")
            .arg("2s")
            .arg("--cancel-grace")
            .arg("1s"),
    )
    .await;
    let slots = |m: &str| -> u64 {
        m.lines()
            .find_map(|l| l.strip_prefix("berth_eval_slots_in_use "))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    // The client gives up after 300 ms.
    let gave_up = s
        .post(
            "/v1/deployments/leaver/preview",
            &json!({"configuration": {}}),
        )
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(
        gave_up.is_err(),
        "the preview answered before the client left"
    );
    eventually("the eval started", || async { pidfile.exists() }).await;
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        slots(&s.metrics().await),
        1,
        "the slot is held while the eval runs"
    );
    // The eval timeout (2 s) and the grace (1 s) end it.
    let calls = s.dir.join("data/scratch");
    let leftovers = || {
        std::fs::read_dir(&calls)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter(|e| e.file_name().to_string_lossy().starts_with("call-"))
                    .count()
            })
            .unwrap_or(0)
    };
    assert!(
        wait_gone(pid, Duration::from_secs(10)).await,
        "the abandoned eval's process lives on"
    );
    eventually("the slot and the dir are released", || async {
        slots(&s.metrics().await) == 0 && leftovers() == 0
    })
    .await;
}

/// Forty public derive requests at once against a source whose describe
/// fails start one describe, not forty: one call per source at a time, and
/// its failure is remembered briefly.
#[tokio::test]
async fn concurrent_describes_of_one_source_share_one_call() {
    let dir = temp_dir("describe-shared");
    let count = dir.join("describes");
    let body = format!(
        "cat >/dev/null\ncase \"$1\" in\ndescribe) echo x >> {count}; sleep 0.3; exit 1;;\nesac\nexit 2\n",
        count = count.display()
    );
    let deployer = script(&dir, "broken-describe.sh", &body);
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let requests: Vec<_> = (0..40)
        .map(|_| {
            let http = s.http.clone();
            let url = s.url("/v1/derive/instances");
            tokio::spawn(async move {
                http.post(url)
                    .json(&json!({"configuration": {"domain": "a.org"}}))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            })
        })
        .collect();
    for r in requests {
        let status = r.await.unwrap().unwrap();
        assert!(status >= 500, "a describe failure answers 5xx: {status}");
    }
    let calls = std::fs::read_to_string(&count)
        .unwrap_or_default()
        .lines()
        .count();
    assert_eq!(calls, 1, "{calls} describe processes for one source");
}
