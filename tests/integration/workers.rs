//! Builds on remote workers (workers.md): the real `berth serve` with its
//! embedded worker off, real `berth worker` processes on loopback with
//! their own work dirs, and scripted deployers; and the internal routes
//! called by hand where a test must hold an attempt's authority itself.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::*;

/// A deployer whose deploy writes its pid, says `start`, prints `tick N`
/// every 50 ms until `<gates>/<deployment>` exists, then says `end`. It
/// ignores SIGPIPE, as a long build would, so it outlives a killed worker.
fn ticking_deployer(dir: &Path) -> (PathBuf, PathBuf) {
    let gates = dir.join("gates");
    std::fs::create_dir_all(&gates).unwrap();
    let body = format!(
        "{SCRIPT_PRELUDE}\ntrap '' PIPE\necho $$ > {g}/$dep.pid\necho \"start $verb $dep\"\nn=0\nwhile [ ! -e {g}/$dep ]; do n=$((n+1)); echo \"tick $n\"; sleep 0.05; done\nrm -f {g}/$dep\necho \"end $verb $dep\"\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"\n",
        g = gates.display()
    );
    (script(dir, "ticking.sh", &body), gates)
}

/// berth with its embedded worker off, on `deployer`, leases of 5 s.
pub(crate) async fn server(dir: &Path, deployer: &Path) -> Server {
    server_with_lease(dir, deployer, "5s").await
}

async fn server_with_lease(dir: &Path, deployer: &Path, lease: &str) -> Server {
    let opts = Options::default()
        .deployer(deployer)
        .arg("--local-worker")
        .arg("off")
        .arg("--lease-ttl")
        .arg(lease)
        .arg("--cancel-grace")
        .arg("1s");
    Server::start_in(dir.join("berth"), opts).await
}

/// A worker token made through the API; its secret in a file.
pub(crate) async fn worker_token(s: &Server, name: &str) -> (String, PathBuf) {
    let (status, made) = read(
        s.post("/v1/tokens", &json!({"name": name, "kind": "worker"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 201, "{made}");
    let token = made["token"].as_str().unwrap().to_string();
    assert!(token.starts_with("brt_"));
    let file = s.dir.join(format!("{name}.token"));
    std::fs::write(&file, &token).unwrap();
    (token, file)
}

/// A `berth worker` process.
pub(crate) struct Worker {
    child: Child,
    dir: PathBuf,
}

impl Worker {
    pub(crate) fn start(s: &Server, token_file: &Path, dir: &Path, deployer: &Path) -> Worker {
        Worker::start_with(s, token_file, dir, deployer, &[])
    }

    /// A worker with more flags (`--labels gpu`, ...).
    fn start_with(
        s: &Server,
        token_file: &Path,
        dir: &Path,
        deployer: &Path,
        flags: &[&str],
    ) -> Worker {
        Worker::start_at(&s.base, token_file, dir, deployer, flags)
    }

    /// A worker of berth at `url` (a proxy in front of it).
    pub(crate) fn start_at(
        url: &str,
        token_file: &Path,
        dir: &Path,
        deployer: &Path,
        flags: &[&str],
    ) -> Worker {
        std::fs::create_dir_all(dir).unwrap();
        let log = std::fs::File::create(dir.join("worker.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_berth"))
            .arg("worker")
            .arg("--url")
            .arg(url)
            .arg("--token-file")
            .arg(token_file)
            .arg("--work-dir")
            .arg(dir.join("w"))
            .arg("--deployer")
            .arg(deployer)
            .arg("--shutdown-grace")
            .arg("1s")
            .args(flags)
            .env("BERTH_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start berth worker");
        Worker {
            child,
            dir: dir.to_path_buf(),
        }
    }

    /// kill -9 of the worker (its deployers stay, as after a crash).
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("worker.log")).unwrap_or_default()
    }

    pub(crate) fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    async fn exit_code(&mut self) -> Option<i32> {
        for _ in 0..400 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        None
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        kill_groups_working_in(&self.dir);
    }
}

fn pid_alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

async fn events_of(s: &Server, build: &str) -> Vec<SseEvent> {
    let mut sse = Sse::open(s.get(&format!("/v1/builds/{build}/events"))).await;
    sse.until_end().await
}

#[tokio::test]
async fn a_build_on_a_remote_worker_reads_and_streams_as_a_local_one() {
    let dir = temp_dir("worker-basic");
    let (deployer, gates) = ticking_deployer(&dir);
    let s = server(&dir, &deployer).await;
    let (_, token_file) = worker_token(&s, "w1").await;
    let _worker = Worker::start(&s, &token_file, &dir.join("w1"), &deployer);
    let build = s.submit_ok("alice", json!({"n": 1})).await;
    let running = s.wait_build(&build, "running").await;
    assert_eq!(running["worker"], "w1", "{running}");
    assert_eq!(running["attempt"]["state"], "active");
    assert_eq!(running["attempt"]["fence"], 1);
    let attempt = running["attempt"]["attempt_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(running["job_id"], format!("attempt:{attempt}"));
    let (_, workers) = s.json("/v1/workers").await;
    let w1 = workers["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["name"] == "w1")
        .unwrap()
        .clone();
    assert_eq!(
        w1["attempts"][0]["attempt_id"],
        attempt.as_str(),
        "{workers}"
    );
    assert_eq!(w1["connected"], true);
    eventually("ticks in the stored log", || async {
        s.log_text(&build).await.contains("tick 3")
    })
    .await;
    open_gate(&gates, "alice");
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}");
    let log = s.log_text(&build).await;
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(
        lines[0],
        format!("[berth] running on worker w1 (attempt {attempt})")
    );
    assert_eq!(lines[1], "start deploy alice");
    assert_eq!(*lines.last().unwrap(), "end deploy alice");
    let ticks: Vec<u64> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("tick ")?.parse().ok())
        .collect();
    assert_eq!(
        ticks,
        (1..=ticks.len() as u64).collect::<Vec<_>>(),
        "every line once, in order"
    );
    // The stream replays the claim before the first line, ids rising.
    let events = events_of(&s, &build).await;
    let ids: Vec<u64> = events.iter().filter_map(|e| e.id).collect();
    assert!(ids.windows(2).all(|w| w[1] > w[0]), "{ids:?}");
    let claimed = events.iter().position(|e| e.event == "attempt").unwrap();
    let first_line = events.iter().position(|e| e.event == "log").unwrap();
    assert!(claimed < first_line);
    let claim: Value = serde_json::from_str(&events[claimed].data).unwrap();
    assert_eq!(claim["change"], "claimed");
    assert_eq!(claim["worker"], "w1");
    let streamed: Vec<&str> = events
        .iter()
        .filter(|e| e.event == "log")
        .map(|e| e.data.as_str())
        .collect();
    assert_eq!(streamed, lines, "the stream and the stored log agree");
    let after = s.build(&build).await;
    assert_eq!(after["attempt"]["state"], "ended");
    let (_, list) = s.json("/v1/deployments/alice/builds").await;
    assert_eq!(list["items"][0]["worker"], "w1", "{list}");
    let token_file = s.dir.join("data/service-token");
    let (code, out) = berth(&[
        "builds",
        "alice",
        "--url",
        &s.base,
        "--token-file",
        token_file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    assert!(out.contains("WORKER") && out.contains("w1"), "{out}");
}

#[tokio::test]
async fn a_worker_paused_past_its_lease_loses_the_build_and_nothing_it_sends_after_lands() {
    let dir = temp_dir("worker-paused");
    let (deployer, gates) = ticking_deployer(&dir);
    let s = server(&dir, &deployer).await;
    let (_, token_file) = worker_token(&s, "w1").await;
    let worker = Worker::start(&s, &token_file, &dir.join("w1"), &deployer);
    let build = s.submit_ok("alice", json!({"n": 1})).await;
    s.wait_build(&build, "running").await;
    eventually("ticks in the stored log", || async {
        s.log_text(&build).await.contains("tick 2")
    })
    .await;
    worker.signal("-STOP");
    let lost = s.wait_build(&build, "final").await;
    assert_eq!(lost["status"], "failed", "{lost}");
    assert_eq!(lost["failure"]["reason"], "lost_attempt", "{lost}");
    assert_eq!(lost["attempt"]["state"], "lost");
    let log_at_loss = s.log_text(&build).await;
    assert!(
        log_at_loss.contains("[berth] lost: worker w1"),
        "{log_at_loss}"
    );
    let events_at_loss = events_of(&s, &build).await;
    let losses = events_at_loss
        .iter()
        .filter(|e| e.event == "attempt" && e.data.contains("\"lost\""))
        .count();
    assert_eq!(losses, 1);
    let pid: i32 = std::fs::read_to_string(gates.join("alice.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    worker.signal("-CONT");
    // The worker fences itself: its deployer is stopped (cancel grace 1 s
    // comes with the claim), and what it sent after the loss was refused.
    eventually("the deployer stopped after the resume", || async {
        !pid_alive(pid)
    })
    .await;
    eventually("the worker saw its authority end", || async {
        let log = worker.log();
        log.contains("self-fence")
            || log.contains("the attempt is over")
            || log.contains("outcome refused")
    })
    .await;
    assert_eq!(
        s.log_text(&build).await,
        log_at_loss,
        "no line of the old attempt after the loss"
    );
    assert_eq!(events_of(&s, &build).await, events_at_loss);
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(
        d["state"], "failed",
        "no rollback follows a lost attempt: {d}"
    );
}

/// Holds an attempt's authority by hand: the protocol's refusals.
struct ByHand<'a> {
    s: &'a Server,
    token: String,
}

impl ByHand<'_> {
    async fn call(&self, path: &str, body: &Value) -> (u16, Value, bool) {
        let r = self
            .s
            .http
            .post(self.s.url(path))
            .bearer_auth(&self.token)
            .json(body)
            .send()
            .await
            .unwrap();
        let replayed = r.headers().get("idempotent-replayed").is_some();
        let (status, body) = read(r).await;
        (status, body, replayed)
    }

    async fn claim(&self, build: &str, op: &str) -> (u16, Value, bool) {
        self.call(
            &format!("/internal/v1/builds/{build}/claim"),
            &json!({"operation_id": op, "worker_incarnation": "incarnation-by-hand", "labels": []}),
        )
        .await
    }
}

fn op(n: u32) -> String {
    format!("op-by-hand-{n:08}")
}

#[tokio::test]
async fn stale_authority_resends_gaps_and_replays_follow_the_protocol() {
    let dir = temp_dir("worker-protocol");
    let (deployer, _gates) = ticking_deployer(&dir);
    let s = server(&dir, &deployer).await;
    let (token, _) = worker_token(&s, "hand").await;
    let w = ByHand { s: &s, token };
    let build = s.submit_ok("alice", json!({"n": 1})).await;
    let (status, claim, _) = w.claim(&build, &op(1)).await;
    assert_eq!(status, 200, "{claim}");
    assert_eq!(claim["verb"], "deploy");
    assert_eq!(claim["request"]["deployment"], "alice");
    assert_eq!(claim["request"]["configuration"], json!({"n": 1}));
    let attempt = claim["authority"]["attempt_id"]
        .as_str()
        .unwrap()
        .to_string();
    // The claim resent: the same answer, replayed, no second attempt.
    let (status, again, replayed) = w.claim(&build, &op(1)).await;
    assert_eq!((status, replayed), (200, true));
    assert_eq!(again, claim);
    let base = |op: &str, fence: u64| json!({"operation_id": op, "fence": fence, "worker_incarnation": "incarnation-by-hand"});
    let progress = |op: &str, items: Value| {
        let mut b = base(op, 1);
        b["items"] = items;
        b
    };
    let lines = |from: u64, to: u64| {
        json!((from..=to)
            .map(|n| json!({"seq": n, "log": format!("line {n}")}))
            .collect::<Vec<_>>())
    };
    let p = format!("/internal/v1/attempts/{attempt}/progress");
    let log_before = s.log_text(&build).await;
    // Stale fence and incarnation: refused, no effect.
    let (status, e, _) = w
        .call(&p, &{
            let mut b = progress(&op(2), lines(1, 3));
            b["fence"] = json!(2);
            b
        })
        .await;
    assert_eq!(
        (status, e["code"].as_str(), e["reason"].as_str()),
        (409, Some("precondition_failed"), Some("stale_authority"))
    );
    let (status, _, _) = w
        .call(&p, &{
            let mut b = progress(&op(2), lines(1, 3));
            b["worker_incarnation"] = json!("someone-else-1");
            b
        })
        .await;
    assert_eq!(status, 409);
    assert_eq!(s.log_text(&build).await, log_before);
    // Lines 1-3, resent: applied once.
    let (status, a, _) = w.call(&p, &progress(&op(3), lines(1, 3))).await;
    assert_eq!((status, a["applied_through"].as_u64()), (200, Some(3)));
    let (status, _, replayed) = w.call(&p, &progress(&op(3), lines(1, 3))).await;
    assert_eq!((status, replayed), (200, true));
    let (status, e, _) = w.call(&p, &progress(&op(3), lines(1, 4))).await;
    assert_eq!(
        (status, e["code"].as_str()),
        (409, Some("idempotency_conflict"))
    );
    // An overlapping batch applies its new items only; a gap is refused.
    let (status, a, _) = w.call(&p, &progress(&op(4), lines(2, 5))).await;
    assert_eq!((status, a["applied_through"].as_u64()), (200, Some(5)));
    let (status, e, _) = w.call(&p, &progress(&op(5), lines(7, 8))).await;
    assert_eq!(
        (status, e["reason"].as_str(), e["applied_through"].as_u64()),
        (409, Some("progress_gap"), Some(5))
    );
    let log = s.log_text(&build).await;
    let ours: Vec<&str> = log.lines().filter(|l| l.starts_with("line ")).collect();
    assert_eq!(ours, ["line 1", "line 2", "line 3", "line 4", "line 5"]);
    // Renew: a fresh lease.
    let (status, r, _) = w
        .call(
            &format!("/internal/v1/attempts/{attempt}/renew"),
            &base(&op(6), 1),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["cancel"], false);
    // The outcome must follow what was applied.
    let o = format!("/internal/v1/attempts/{attempt}/outcome");
    let outcome = |op: &str, through: u64| {
        let mut b = base(op, 1);
        b["progress_through"] = json!(through);
        b["ended"] = json!({"kind": "exit", "code": 0});
        b["result"] = json!({"nodes": [{"name": "web", "changed": true, "sbom": {"status": "unavailable", "reason": "none here"}}]});
        b["health"] = Value::Null;
        b
    };
    // A result problem workers.md does not name is refused (it would
    // become the build's failure detail).
    let mut odd = outcome(&op(11), 5);
    odd["result"] = Value::Null;
    odd["result_problem"] = json!("the worker's own words");
    let (status, _, _) = w.call(&o, &odd).await;
    assert_eq!(status, 400);
    let (status, e, _) = w.call(&o, &outcome(&op(7), 4)).await;
    assert_eq!((status, e["reason"].as_str()), (409, Some("progress_gap")));
    let (status, done, _) = w.call(&o, &outcome(&op(8), 5)).await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["status"], "succeeded");
    // After the end: the outcome replays; anything new is stale.
    let (status, again, replayed) = w.call(&o, &outcome(&op(8), 5)).await;
    assert_eq!((status, replayed), (200, true));
    assert_eq!(again, done);
    let (status, e, _) = w.call(&p, &progress(&op(9), lines(6, 6))).await;
    assert_eq!(
        (status, e["reason"].as_str()),
        (409, Some("stale_authority"))
    );
    assert_eq!(s.build(&build).await["status"], "succeeded");
    assert!(!s.log_text(&build).await.contains("line 6"));
    // Another token's attempt does not exist for it.
    let (other, _) = worker_token(&s, "other").await;
    let w2 = ByHand {
        s: &s,
        token: other,
    };
    let (status, _, _) = w2
        .call(
            &format!("/internal/v1/attempts/{attempt}/renew"),
            &base(&op(10), 1),
        )
        .await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn two_workers_racing_for_each_build_win_it_exactly_once() {
    let dir = temp_dir("worker-race");
    let (deployer, _gates) = ticking_deployer(&dir);
    let s = server(&dir, &deployer).await;
    let (a, _) = worker_token(&s, "racer-a").await;
    let (b, _) = worker_token(&s, "racer-b").await;
    let (wa, wb) = (ByHand { s: &s, token: a }, ByHand { s: &s, token: b });
    for round in 0..20u32 {
        let build = s.submit_ok("alice", json!({"round": round})).await;
        let (op_a, op_b) = (op(round * 2), op(round * 2 + 1));
        let (ra, rb) = tokio::join!(wa.claim(&build, &op_a), wb.claim(&build, &op_b));
        let wins = [&ra, &rb].iter().filter(|r| r.0 == 200).count();
        assert_eq!(wins, 1, "round {round}: {ra:?} {rb:?}");
        let (winner, (_, claim, _), loser) = if ra.0 == 200 {
            (&wa, ra, rb)
        } else {
            (&wb, rb, ra)
        };
        assert_eq!(
            (loser.0, loser.1["reason"].as_str()),
            (409, Some("already_claimed")),
            "round {round}"
        );
        let attempt = claim["authority"]["attempt_id"].as_str().unwrap();
        let body = json!({
            "operation_id": op(1000 + round), "fence": claim["authority"]["fence"], "worker_incarnation": "incarnation-by-hand",
            "progress_through": 0, "ended": {"kind": "exit", "code": 0}, "result": {"nodes": []}, "health": null,
        });
        let (status, done, _) = winner
            .call(&format!("/internal/v1/attempts/{attempt}/outcome"), &body)
            .await;
        assert_eq!(
            (status, done["status"].as_str()),
            (200, Some("succeeded")),
            "{done}"
        );
    }
}

#[tokio::test]
async fn a_revoked_token_loses_its_build_at_once_and_its_worker_stops_with_3() {
    let dir = temp_dir("worker-revoked");
    let (deployer, gates) = ticking_deployer(&dir);
    let s = server_with_lease(&dir, &deployer, "60s").await;
    let (token, token_file) = worker_token(&s, "w1").await;
    let mut worker = Worker::start(&s, &token_file, &dir.join("w1"), &deployer);
    let build = s.submit_ok("alice", json!({"n": 1})).await;
    s.wait_build(&build, "running").await;
    eventually("the deployer started", || async {
        gates.join("alice.pid").exists()
    })
    .await;
    let (status, _) = read(s.delete("/v1/tokens/w1").send().await.unwrap()).await;
    assert_eq!(status, 200);
    // At once, long before its 60 s lease.
    let lost = s.build(&build).await;
    assert_eq!(lost["failure"]["reason"], "lost_attempt", "{lost}");
    assert!(s.log_text(&build).await.contains("its token was revoked"));
    assert_eq!(worker.exit_code().await, Some(3), "{}", worker.log());
    let pid: i32 = std::fs::read_to_string(gates.join("alice.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        !pid_alive(pid),
        "the deployer is stopped before the worker exits"
    );
    let r = s
        .http
        .get(s.url("/internal/v1/queue?worker_incarnation=incarnation-x"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}

#[tokio::test]
async fn a_remote_build_goes_on_through_a_restart_of_berth() {
    let dir = temp_dir("worker-restart");
    let (deployer, gates) = ticking_deployer(&dir);
    let mut s = server(&dir, &deployer).await;
    let (_, token_file) = worker_token(&s, "w1").await;
    let _worker = Worker::start(&s, &token_file, &dir.join("w1"), &deployer);
    let build = s.submit_ok("alice", json!({"n": 1})).await;
    s.wait_build(&build, "running").await;
    eventually("ticks stored", || async {
        s.log_text(&build).await.contains("tick 2")
    })
    .await;
    s.kill();
    // Same port: the worker's --url stays right.
    let port = s.base.rsplit(':').next().unwrap().to_string();
    s.args.push("--listen".into());
    s.args.push(format!("127.0.0.1:{port}"));
    s.launch().await;
    let after = s.build(&build).await;
    assert_eq!(
        after["status"], "running",
        "a remote build is not interrupted by a restart: {after}"
    );
    eventually("ticks after the restart", || async {
        let log = s.log_text(&build).await;
        log.lines().filter(|l| l.starts_with("tick ")).count() > 20
    })
    .await;
    open_gate(&gates, "alice");
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}\n{}", s.log());
    let log = s.log_text(&build).await;
    let ticks: Vec<u64> = log
        .lines()
        .filter_map(|l| l.strip_prefix("tick ")?.parse().ok())
        .collect();
    assert_eq!(
        ticks,
        (1..=ticks.len() as u64).collect::<Vec<_>>(),
        "every line once, in order"
    );
    let events = events_of(&s, &build).await;
    let ids: Vec<u64> = events.iter().filter_map(|e| e.id).collect();
    assert!(ids.windows(2).all(|w| w[1] > w[0]), "{ids:?}");
}

#[tokio::test]
async fn a_cancelled_remote_build_stops_its_deployer_and_ends_cancelled() {
    let dir = temp_dir("worker-cancel");
    let (deployer, gates) = ticking_deployer(&dir);
    let s = server(&dir, &deployer).await;
    let (_, token_file) = worker_token(&s, "w1").await;
    let _worker = Worker::start(&s, &token_file, &dir.join("w1"), &deployer);
    let build = s.submit_ok("alice", json!({"n": 1})).await;
    s.wait_build(&build, "running").await;
    eventually("the deployer started", || async {
        gates.join("alice.pid").exists()
    })
    .await;
    let r = s
        .post(&format!("/v1/builds/{build}/cancel"), &json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "cancelled", "{done}");
    let pid: i32 = std::fs::read_to_string(gates.join("alice.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(!pid_alive(pid));
}

#[tokio::test]
async fn worker_tokens_reach_only_their_routes_and_the_service_token_not_theirs() {
    let dir = temp_dir("worker-tokens");
    let (deployer, _gates) = ticking_deployer(&dir);
    let s = server(&dir, &deployer).await;
    let (token, _) = worker_token(&s, "w1").await;
    let r = s
        .http
        .get(s.url("/v1/deployments"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    let (status, e) = read(r).await;
    assert_eq!((status, e["reason"].as_str()), (403, Some("token_kind")));
    let r = s
        .http
        .get(s.url("/internal/v1/queue?worker_incarnation=incarnation-1"))
        .bearer_auth(&s.token)
        .send()
        .await
        .unwrap();
    let (status, e) = read(r).await;
    assert_eq!((status, e["reason"].as_str()), (403, Some("token_kind")));
    let r = s
        .http
        .get(s.url("/internal/v1/queue?worker_incarnation=incarnation-1&wait=0"))
        .bearer_auth("brt_nobody")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // Two open polls per worker; a third waits its turn.
    let poll = || {
        s.http
            .get(s.url("/internal/v1/queue?worker_incarnation=incarnation-1&wait=3"))
            .bearer_auth(&token)
            .send()
    };
    let (first, second) = (poll(), poll());
    let held = async {
        eventually("two polls open", || async {
            s.metrics().await.contains("berth_worker_polls 2")
        })
        .await;
        read(poll().await.unwrap()).await
    };
    let (first, second, (status, e)) = tokio::join!(first, second, held);
    assert_eq!(
        (status, e["reason"].as_str()),
        (503, Some("too_many_polls"))
    );
    assert_eq!(
        (
            first.unwrap().status().as_u16(),
            second.unwrap().status().as_u16()
        ),
        (200, 200)
    );
    // The name is taken, `local` is reserved, and no secret is ever listed.
    let (status, _) = read(
        s.post("/v1/tokens", &json!({"name": "w1", "kind": "worker"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 409);
    let (status, _) = read(
        s.post("/v1/tokens", &json!({"name": "local", "kind": "worker"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 400);
    let (_, list) = s.json("/v1/tokens").await;
    assert_eq!(list["items"][0]["name"], "w1");
    assert!(!list.to_string().contains("brt_"));
    // The CLI prints only the token, and lists the workers.
    let token_file = s.dir.join("data/service-token");
    let (code, out) = berth(&[
        "tokens",
        "create",
        "w2",
        "--kind",
        "worker",
        "--url",
        &s.base,
        "--token-file",
        token_file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    assert!(
        out.trim().starts_with("brt_") && out.trim().lines().count() == 1,
        "{out}"
    );
    let (code, out) = berth(&[
        "workers",
        "--url",
        &s.base,
        "--token-file",
        token_file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    assert!(
        out.contains("w1") && out.contains("w2") && out.contains("remote"),
        "{out}"
    );
}

/// A deployer with a health step: `web` unhealthy at the first check,
/// healthy from the second; confirms are counted in `<ctrl>/confirms`.
fn health_deployer(dir: &Path) -> (PathBuf, PathBuf) {
    let ctrl = dir.join("ctrl");
    std::fs::create_dir_all(&ctrl).unwrap();
    let c = ctrl.display();
    let body = format!(
        r#"verb="$1"
cat >/dev/null
case "$verb" in
describe) printf '%s' '{{"methods":["local"],"default_method":"local","actions":{{}},"catalog":[],"schema":null,"verbs":["check","confirm"]}}' > "$BERTH_RESULT";;
eval) printf '%s' '{{"nodes":[{{"name":"web","names":[],"fingerprint":"f"}}]}}' > "$BERTH_RESULT";;
deploy) echo "deploying web"; printf '%s' '{{"nodes":[{{"name":"web","changed":true,"fingerprint":"f"}}]}}' > "$BERTH_RESULT";;
check)
  n=$(cat {c}/checks 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}/checks
  if [ $n -ge 2 ]; then h=true; else h=false; fi
  printf '{{"nodes":[{{"name":"web","healthy":%s,"reason":"web.service failed"}}]}}' $h > "$BERTH_RESULT";;
confirm) echo confirmed >> {c}/confirms; printf '{{}}' > "$BERTH_RESULT";;
destroy) printf '{{}}' > "$BERTH_RESULT";;
esac
"#
    );
    (script(dir, "health.sh", &body), ctrl)
}

#[tokio::test]
async fn a_worker_runs_the_health_step_and_berth_stores_its_answers() {
    let dir = temp_dir("worker-health");
    let (deployer, ctrl) = health_deployer(&dir);
    let opts = Options::default()
        .deployer(&deployer)
        .arg("--local-worker")
        .arg("off")
        .arg("--health-interval")
        .arg("1s");
    let s = Server::start_in(dir.join("berth"), opts).await;
    let (_, token_file) = worker_token(&s, "w1").await;
    let _worker = Worker::start(&s, &token_file, &dir.join("w1"), &deployer);
    let build = s.submit_ok("alice", json!({"n": 1})).await;
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(
        std::fs::read_to_string(ctrl.join("confirms")).unwrap(),
        "confirmed\n"
    );
    let log = s.log_text(&build).await;
    assert!(
        log.contains("[berth] health check 1: node web is not healthy: web.service failed"),
        "{log}"
    );
    assert!(
        log.contains("[berth] health check 2: node web is healthy"),
        "{log}"
    );
    assert!(
        log.contains("every changed node is healthy; confirmed"),
        "{log}"
    );
    let events = events_of(&s, &build).await;
    let health: Vec<Value> = events
        .iter()
        .filter(|e| e.event == "health")
        .map(|e| serde_json::from_str(&e.data).unwrap())
        .collect();
    assert_eq!(health.len(), 2, "{events:?}");
    assert_eq!(
        (
            health[0]["healthy"].as_bool(),
            health[1]["healthy"].as_bool()
        ),
        (Some(false), Some(true))
    );
}

#[tokio::test]
async fn a_killed_worker_loses_its_build_and_restarted_stops_the_orphan_and_runs_the_next() {
    let dir = temp_dir("worker-killed");
    let (deployer, gates) = ticking_deployer(&dir);
    let s = server(&dir, &deployer).await;
    let (_, token_file) = worker_token(&s, "w1").await;
    let mut worker = Worker::start(&s, &token_file, &dir.join("w1"), &deployer);
    let build = s.submit_ok("alice", json!({"n": 1})).await;
    let running = s.wait_build(&build, "running").await;
    let first_incarnation = running["attempt"]["worker_incarnation"].clone();
    eventually("the deployer started", || async {
        gates.join("alice.pid").exists()
    })
    .await;
    let orphan: i32 = std::fs::read_to_string(gates.join("alice.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    worker.child.kill().unwrap();
    worker.child.wait().unwrap();
    let lost = s.wait_build(&build, "final").await;
    assert_eq!(lost["failure"]["reason"], "lost_attempt", "{lost}");
    // Lost by the sweep within a second of the lease's end (berth's clock).
    let expired =
        berth::model::parse_time(lost["attempt"]["lease_expires_at"].as_str().unwrap()).unwrap();
    let finished = berth::model::parse_time(lost["finished_at"].as_str().unwrap()).unwrap();
    assert!(
        (0..=1_500).contains(&(finished - expired)),
        "lost {} ms after the lease",
        finished - expired
    );
    let (_, builds) = s.json("/v1/deployments/alice/builds").await;
    assert_eq!(
        builds["items"].as_array().unwrap().len(),
        1,
        "no rollback queued: {builds}"
    );
    assert!(
        pid_alive(orphan),
        "kill -9 of the worker leaves its deployer running"
    );
    std::fs::remove_file(gates.join("alice.pid")).unwrap();
    // The same work dir: the orphan is stopped before the first call.
    let _again = Worker::start(&s, &token_file, &dir.join("w1"), &deployer);
    eventually("the orphaned deployer stopped", || async {
        !pid_alive(orphan)
    })
    .await;
    let next = s.submit_ok("alice", json!({"n": 2})).await;
    let running = s.wait_build(&next, "running").await;
    assert_ne!(running["attempt"]["worker_incarnation"], first_incarnation);
    eventually("the next deployer started", || async {
        gates.join("alice.pid").exists()
    })
    .await;
    open_gate(&gates, "alice");
    assert_eq!(s.wait_build(&next, "final").await["status"], "succeeded");
}

/// A proxy between a worker and berth that forwards every request and
/// drops every `nth` answer (closing the connection instead).
async fn dropping_proxy(upstream: String, nth: u64) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let answers = Arc::new(AtomicU64::new(0));
    let upstream = upstream.trim_start_matches("http://").to_string();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            let (answers, upstream) = (answers.clone(), upstream.clone());
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut cr, &mut sw).await;
                });
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match sr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if answers.fetch_add(1, Ordering::SeqCst) % nth == nth - 1 {
                        break;
                    }
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                up.abort();
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn answers_dropped_on_the_way_back_are_resent_and_every_line_lands_once_in_order() {
    let dir = temp_dir("worker-dropped");
    let (deployer, gates) = ticking_deployer(&dir);
    let s = server(&dir, &deployer).await;
    let (_, token_file) = worker_token(&s, "w1").await;
    let proxy = dropping_proxy(s.base.clone(), 3).await;
    let mut behind = Server::unstarted(dir.join("unused"), Options::default());
    behind.base = proxy;
    let worker = Worker::start(&behind, &token_file, &dir.join("w1"), &deployer);
    let build = s.submit_ok("alice", json!({"n": 1})).await;
    s.wait_build(&build, "running").await;
    eventually("many ticks stored", || async {
        s.log_text(&build)
            .await
            .lines()
            .filter(|l| l.starts_with("tick "))
            .count()
            >= 40
    })
    .await;
    open_gate(&gates, "alice");
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}\n{}", worker.log());
    let log = s.log_text(&build).await;
    let ticks: Vec<u64> = log
        .lines()
        .filter_map(|l| l.strip_prefix("tick ")?.parse().ok())
        .collect();
    assert_eq!(
        ticks,
        (1..=ticks.len() as u64).collect::<Vec<_>>(),
        "every line once, in order"
    );
    assert_eq!(log.lines().filter(|l| *l == "end deploy alice").count(), 1);
    assert_eq!(done["attempt"]["fence"], 1, "one attempt");
    let events = events_of(&s, &build).await;
    assert_eq!(events.iter().filter(|e| e.event == "end").count(), 1);
}

#[tokio::test]
async fn the_embedded_worker_runs_builds_as_attempts_that_a_restart_interrupts() {
    let (mut s, gates, running) = server_with_a_running_build("worker-local", "alice").await;
    let b = s.build(&running).await;
    assert_eq!(b["worker"], "local", "{b}");
    assert_eq!(
        (
            b["attempt"]["fence"].as_u64(),
            b["attempt"]["state"].as_str()
        ),
        (Some(1), Some("active"))
    );
    assert!(
        b["attempt"]["lease_expires_at"].is_null(),
        "no lease on a single node"
    );
    assert!(b["attempt"]["worker_incarnation"]
        .as_str()
        .unwrap()
        .starts_with("local-"));
    s.kill();
    s.launch().await;
    let b = s.build(&running).await;
    assert_eq!(b["failure"]["reason"], "interrupted_by_restart", "{b}");
    assert_eq!(b["attempt"]["state"], "interrupted");
    let next = s.submit_ok("alice", json!({"n": 2})).await;
    let r = s.wait_build(&next, "running").await;
    assert_ne!(
        r["attempt"]["worker_incarnation"],
        b["attempt"]["worker_incarnation"]
    );
    open_gate(&gates, "alice");
    let done = s.wait_build(&next, "final").await;
    assert_eq!(
        (done["status"].as_str(), done["attempt"]["state"].as_str()),
        (Some("succeeded"), Some("ended"))
    );
}

/// A deployer that records each deploy it runs (`<dir>/runs.log`, one line
/// per build id), prints a few lines over a short random time, and ends.
fn recording_deployer(dir: &Path) -> PathBuf {
    let runs = dir.join("runs.log");
    let body = format!(
        r#"verb="$1"
request=$(cat)
case "$verb" in
describe) printf '%s' '{{"methods":["local"],"default_method":"local","actions":{{}},"catalog":[],"schema":null}}' > "$BERTH_RESULT"; exit 0;;
eval) printf '%s' '{{"nodes":[]}}' > "$BERTH_RESULT"; exit 0;;
esac
trap '' PIPE
build=$(printf '%s' "$request" | sed -n 's/.*"build":"\([^"]*\)".*/\1/p')
echo "$build" >> {runs}
i=0; while [ $i -lt 5 ]; do i=$((i+1)); echo "step $i"; sleep 0.0$(( $$ % 9 + 1 )); done
printf '%s' '{{"nodes":[]}}' > "$BERTH_RESULT"
"#,
        runs = runs.display()
    );
    script(dir, "recording.sh", &body)
}

/// kill -9 of berth and of workers at random instants while builds are
/// queued: nothing acknowledged is lost, no build stays `running`, and no
/// build's deployer runs twice. `BERTH_WORKER_TORTURE_TRIALS` (default 4)
/// rounds; the seed is printed.
#[tokio::test]
async fn kill_9_of_berth_and_workers_loses_nothing_and_runs_no_build_twice() {
    let trials: u64 = std::env::var("BERTH_WORKER_TORTURE_TRIALS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(4);
    let seed = std::env::var("BERTH_TORTURE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("worker torture: {trials} trials, seed {seed} (BERTH_TORTURE_SEED to replay)");
    let mut rng = crate::torture::Rng(seed);
    let dir = temp_dir("worker-torture");
    let deployer = recording_deployer(&dir);
    let mut s = server(&dir, &deployer).await;
    let port = s.base.rsplit(':').next().unwrap().to_string();
    s.args.push("--listen".into());
    s.args.push(format!("127.0.0.1:{port}"));
    let (_, t1) = worker_token(&s, "w1").await;
    let (_, t2) = worker_token(&s, "w2").await;
    let mut workers = [
        Worker::start(&s, &t1, &dir.join("w1"), &deployer),
        Worker::start(&s, &t2, &dir.join("w2"), &deployer),
    ];
    let mut acknowledged = Vec::new();
    for trial in 0..trials {
        for n in 0..(3 + rng.below(5)) {
            let id = format!("d{}", rng.below(4));
            let r = s
                .post(
                    &format!("/v1/deployments/{id}/submit"),
                    &json!({"configuration": {"t": trial, "n": n}, "mode": "enqueue"}),
                )
                .send()
                .await;
            if let Ok(r) = r {
                let (status, body) = read(r).await;
                if status == 202 {
                    acknowledged.push(body["build_id"].as_str().unwrap().to_string());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
        match rng.below(3) {
            0 => {
                s.kill();
                s.launch().await;
            }
            which => {
                let i = (which - 1) as usize;
                let name = ["w1", "w2"][i];
                let token = [&t1, &t2][i];
                workers[i].child.kill().unwrap();
                workers[i].child.wait().unwrap();
                workers[i] = Worker::start(&s, token, &dir.join(name), &deployer);
            }
        }
    }
    // Every acknowledged build ends (a lost one a lease later), none twice.
    for build in &acknowledged {
        let b = s.wait_build(build, "final").await;
        assert!(
            matches!(b["status"].as_str(), Some("succeeded" | "failed")),
            "{b}"
        );
        if b["status"] == "failed" {
            assert!(
                matches!(
                    b["failure"]["reason"].as_str(),
                    Some("lost_attempt" | "interrupted_by_restart")
                ),
                "{b}"
            );
        }
    }
    let runs = std::fs::read_to_string(dir.join("runs.log")).unwrap_or_default();
    let mut seen = std::collections::HashMap::new();
    for line in runs.lines() {
        *seen.entry(line.to_string()).or_insert(0) += 1;
    }
    for (build, n) in &seen {
        assert_eq!(*n, 1, "build {build} ran {n} times");
    }
    let (_, workers_now) = s.json("/v1/workers").await;
    for w in workers_now["items"].as_array().unwrap() {
        assert_eq!(w["attempts"], json!([]), "nothing left running: {w}");
    }
    eprintln!(
        "worker torture: {} acknowledged builds, {} deploys ran, each once",
        acknowledged.len(),
        seen.len()
    );
}

#[tokio::test]
async fn a_sources_labels_send_its_builds_only_to_a_worker_offering_them() {
    let dir = temp_dir("worker-labels");
    let body = r#"verb="$1"
cat >/dev/null
case "$verb" in
describe) printf '%s' '{"methods":["local"],"default_method":"local","actions":{},"catalog":[],"schema":null,"labels":["gpu"]}' > "$BERTH_RESULT";;
eval) printf '%s' '{"nodes":[]}' > "$BERTH_RESULT";;
*) echo "ran on $(basename "$(dirname "$(dirname "$BERTH_WORK_DIR")")")"; printf '%s' '{"nodes":[]}' > "$BERTH_RESULT";;
esac
"#;
    let deployer = script(&dir, "labelled.sh", body);
    // The embedded worker stays on but offers no label.
    let s = Server::start_in(dir.join("berth"), Options::default().deployer(&deployer)).await;
    let (token, token_file) = worker_token(&s, "plain").await;
    let build = s.submit_ok("alice", json!({"n": 1})).await;
    let queued = s.build(&build).await;
    assert_eq!(queued["labels"], json!(["gpu"]), "{queued}");
    // A worker without the label is offered nothing and may not claim it.
    let r = s
        .http
        .get(s.url("/internal/v1/queue?worker_incarnation=incarnation-1&wait=0"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    let (_, q) = read(r).await;
    assert_eq!(q["builds"], json!([]), "{q}");
    let w = ByHand {
        s: &s,
        token: token.clone(),
    };
    let (status, e, _) = w.claim(&build, &op(1)).await;
    assert_eq!(
        (status, e["reason"].as_str()),
        (409, Some("labels_mismatch"))
    );
    assert_eq!(
        s.build(&build).await["status"],
        "queued",
        "neither the embedded worker nor a plain one runs it"
    );
    drop(token_file);
    let (_, gpu_file) = worker_token(&s, "gpu-box").await;
    let gpu = Worker::start_with(
        &s,
        &gpu_file,
        &dir.join("gpu-box"),
        &deployer,
        &["--labels", "gpu"],
    );
    let done = s.wait_build(&build, "final").await;
    assert_eq!(
        (done["status"].as_str(), done["worker"].as_str()),
        (Some("succeeded"), Some("gpu-box")),
        "{done}\n{}",
        gpu.log()
    );
}

/// A deployer that counts its deploys of a deployment in its work dir
/// (`count N` in the log) and hands over one node's SBOM, copied from
/// `sbom`; its destroy leaves nothing.
fn counting_deployer(dir: &Path, sbom: &Path) -> PathBuf {
    let body = format!(
        r#"{SCRIPT_PRELUDE}
case "$verb" in
deploy)
  n=$(cat "$BERTH_WORK_DIR/count" 2>/dev/null || echo 0)
  n=$((n+1))
  echo "$n" > "$BERTH_WORK_DIR/count"
  mkdir -p "$BERTH_WORK_DIR/deep/er"
  ln -sf ../count "$BERTH_WORK_DIR/deep/link"
  echo "count $n"
  mkdir -p "$BERTH_SCRATCH_DIR/sbom"
  cp "{sbom}" "$BERTH_SCRATCH_DIR/sbom/web.cdx.json"
  printf '%s' '{{"nodes":[{{"name":"web","changed":true,"sbom":{{"status":"ready","path":"sbom/web.cdx.json"}}}}]}}' > "$BERTH_RESULT"
  exit 0;;
destroy) printf '{{}}' > "$BERTH_RESULT"; exit 0;;
esac
exit 2
"#,
        sbom = sbom.display()
    );
    script(dir, "counting.sh", &body)
}

fn sha256_digest(bytes: &[u8]) -> String {
    berth::archive::digest(bytes)
}

#[tokio::test]
async fn the_work_state_and_sboms_travel_between_workers_and_a_destroy_forgets_them() {
    let dir = temp_dir("worker-work-state");
    let sbom =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/sbom/dropwizard-1.3.15__bom.json");
    assert!(sbom.is_file(), "missing test data {}", sbom.display());
    let deployer = counting_deployer(&dir, &sbom);
    let s = server(&dir, &deployer).await;
    let (_, token_file) = worker_token(&s, "w1").await;
    let first = Worker::start(&s, &token_file, &dir.join("w1"), &deployer);
    let build = s.submit_ok("alice", json!({"n": 1})).await;
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done} {}", first.log());
    assert!(s.log_text(&build).await.contains("count 1"));
    let (_, d) = s.json("/v1/deployments/alice").await;
    let d1 = d["work_state"]["digest"]
        .as_str()
        .expect("a work state")
        .to_string();
    assert_eq!(d["work_state"]["build_id"], build.as_str(), "{d}");
    // The SBOM the worker uploaded is the node's.
    let (status, node) = s.json("/v1/deployments/alice/sboms/web").await;
    assert_eq!(status, 200, "{node}");
    // Another worker, on another work dir, takes the next build from where
    // the first left the work dir.
    drop(first);
    let (_, token_file) = worker_token(&s, "w2").await;
    let second = Worker::start(&s, &token_file, &dir.join("w2"), &deployer);
    let next = s.submit_ok("alice", json!({"n": 2})).await;
    let done = s.wait_build(&next, "final").await;
    assert_eq!(done["status"], "succeeded", "{done} {}", second.log());
    assert_eq!(done["worker"], "w2");
    assert!(
        s.log_text(&next).await.contains("count 2"),
        "the work state travelled"
    );
    let (_, d) = s.json("/v1/deployments/alice").await;
    let d2 = d["work_state"]["digest"].as_str().unwrap().to_string();
    assert_ne!(d1, d2);
    assert_eq!(d["work_state"]["previous"][0]["digest"], d1.as_str(), "{d}");
    // Served with its digest: the current one, and a kept one by digest.
    let current = s
        .get("/v1/deployments/alice/work-state")
        .send()
        .await
        .unwrap();
    assert_eq!(current.status(), 200);
    assert_eq!(current.headers()["etag"], format!("\"{d2}\"").as_str());
    let tar = current.bytes().await.unwrap();
    assert_eq!(sha256_digest(&tar), d2);
    let old = s
        .get(&format!("/v1/deployments/alice/work-state?digest={d1}"))
        .send()
        .await
        .unwrap();
    assert_eq!(sha256_digest(&old.bytes().await.unwrap()), d1);
    // A repair: If-Match must name the current one, the body be an archive.
    let put = |if_match: String, body: Vec<u8>| {
        client()
            .put(s.url("/v1/deployments/alice/work-state"))
            .bearer_auth(&s.token)
            .header("If-Match", if_match)
            .body(body)
            .send()
    };
    let stale = put(format!("\"{d1}\""), tar.to_vec()).await.unwrap();
    assert_eq!(stale.status(), 412);
    let (status, bad) = read(
        put(format!("\"{d2}\""), b"not a tar".repeat(100))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 400, "{bad}");
    assert_eq!(bad["fields"][0]["code"], "work_state_invalid", "{bad}");
    assert!(
        !bad.to_string().contains("not a tar"),
        "the body is never echoed: {bad}"
    );
    let old_tar = s
        .get(&format!("/v1/deployments/alice/work-state?digest={d1}"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let (status, put_back) = read(put(format!("\"{d2}\""), old_tar.to_vec()).await.unwrap()).await;
    assert_eq!(status, 200, "{put_back}");
    assert_eq!(put_back["digest"], d1.as_str());
    let third = s.submit_ok("alice", json!({"n": 3})).await;
    s.wait_build(&third, "final").await;
    assert!(
        s.log_text(&third).await.contains("count 2"),
        "the repaired state was used"
    );
    assert!(s.metrics().await.contains("berth_work_state_bytes "));
    // A destroy that succeeds forgets every work state of the deployment.
    let (status, gone) = read(s.delete("/v1/deployments/alice").send().await.unwrap()).await;
    assert_eq!(status, 202, "{gone}");
    let destroy = gone["build_id"].as_str().unwrap().to_string();
    assert_eq!(s.wait_build(&destroy, "final").await["status"], "succeeded");
    let (status, _) = s.json("/v1/deployments/alice/work-state").await;
    assert_eq!(status, 404);
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["work_state"], Value::Null, "{d}");
}

/// Deploys alice on the counting deployer: it succeeds on `worker` and its
/// log counts `n` (the work dir came along). The build's id.
async fn deploy_counted(s: &Server, n: u32, worker: &str) -> String {
    let build = s.submit_ok("alice", json!({"n": n})).await;
    let done = s.wait_build(&build, "final").await;
    assert_eq!(
        (done["status"].as_str(), done["worker"].as_str()),
        (Some("succeeded"), Some(worker)),
        "{done}"
    );
    let log = s.log_text(&build).await;
    assert!(
        log.contains(&format!("count {n}")),
        "the work dir came along: {log}"
    );
    build
}

#[tokio::test]
async fn the_embedded_worker_hands_its_work_dir_to_a_remote_one_and_continues_from_the_stored_state(
) {
    let dir = temp_dir("worker-work-state-embedded");
    let sbom =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/sbom/dropwizard-1.3.15__bom.json");
    let deployer = counting_deployer(&dir, &sbom);
    // First the embedded worker alone: its work dir is berth's own.
    let opts = Options::default()
        .deployer(&deployer)
        .arg("--lease-ttl")
        .arg("5s");
    let mut s = Server::start_in(dir.join("berth"), opts).await;
    let first = s.submit_ok("alice", json!({"n": 1})).await;
    assert_eq!(s.wait_build(&first, "final").await["status"], "succeeded");
    assert!(s.log_text(&first).await.contains("count 1"));
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(
        d["work_state"],
        Value::Null,
        "nothing archived before a remote claim: {d}"
    );
    // Builds that need a label only a remote worker offers: its first
    // claim archives berth's work dir, and the count goes on there.
    let port = s.base.rsplit(':').next().unwrap().to_string();
    s.kill();
    s.args
        .extend(["--listen".into(), format!("127.0.0.1:{port}")]);
    s.args.extend(["--build-labels".into(), "remote".into()]);
    s.launch().await;
    let (_, token_file) = worker_token(&s, "far").await;
    let far = Worker::start_with(
        &s,
        &token_file,
        &dir.join("far"),
        &deployer,
        &["--labels", "remote"],
    );
    deploy_counted(&s, 2, "far").await;
    // The embedded worker again: it starts from the stored state, and
    // stores what it leaves.
    drop(far);
    s.kill();
    let labels = s.args.iter().position(|a| a == "--build-labels").unwrap();
    s.args.drain(labels..labels + 2);
    s.launch().await;
    let third = deploy_counted(&s, 3, "local").await;
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["work_state"]["build_id"], third.as_str(), "{d}");
    let tar = s
        .get("/v1/deployments/alice/work-state")
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let mut archive = tar::Archive::new(tar.as_ref());
    let mut count = String::new();
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        if entry.path().unwrap().as_os_str() == "count" {
            std::io::Read::read_to_string(&mut entry, &mut count).unwrap();
        }
    }
    assert_eq!(count.trim(), "3");
}

/// A deployer that lists `activate` (so a deploy is a rollout) and whose
/// deploy renders node `web` as a file artifact (deployer.md's
/// `artifact`, `kind: file`). Its only node is bound to an agent, so its
/// own `activate`, `check` and `confirm` are never called for it.
fn artifact_deployer(dir: &Path) -> PathBuf {
    let body = r#"verb="$1"
dep=$(basename "$BERTH_WORK_DIR")
cat >/dev/null
case "$verb" in
describe) printf '%s' '{"methods":["local"],"default_method":"local","actions":{},"catalog":[],"schema":null,"verbs":["check","confirm","activate"]}' > "$BERTH_RESULT";;
eval) printf '%s' '{"nodes":[]}' > "$BERTH_RESULT";;
deploy)
  echo "web of $dep" > "$BERTH_SCRATCH_DIR/web.json"
  printf '%s' '{"nodes":[{"name":"web","changed":true,"artifact":{"kind":"file","path":"web.json"}}]}' > "$BERTH_RESULT";;
activate|check) printf '%s' '{"nodes":[]}' > "$BERTH_RESULT";;
*) printf '{}' > "$BERTH_RESULT";;
esac
"#;
    script(dir, "artifact.sh", body)
}

#[tokio::test]
async fn a_file_artifact_a_remote_worker_renders_reaches_the_nodes_agent_through_berth() {
    let dir = temp_dir("worker-artifact");
    let deployer = artifact_deployer(&dir);
    let s = server(&dir, &deployer).await;
    let (_, token_file) = worker_token(&s, "w1").await;
    let worker = Worker::start(&s, &token_file, &dir.join("w1"), &deployer);
    let agent_token = crate::agents::agent_token(&s, "web-1", "alice", "web").await;
    let agent = crate::agents::Agent::start(&s, &agent_token, "alice/web", &dir.join("agent"), &[]);
    let build = s.submit_ok_without_rollback("alice", json!({})).await;
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}\n{}", worker.log());
    // The node's document names the artifact berth stored from the
    // worker's upload; the agent activated and confirmed it, and runs it.
    let (_, entry) = s.json("/v1/deployments/alice/nodes/web").await;
    assert_eq!(entry["desired"]["artifact"]["kind"], "file", "{entry}");
    let digest = entry["desired"]["artifact"]["digest"].clone();
    eventually("the agent runs the worker's artifact", || async {
        let (_, e) = s.json("/v1/deployments/alice/nodes/web").await;
        e["actual"]["running"]["digest"] == digest
    })
    .await;
    let running = std::fs::read_to_string(agent.dir.join("state/current")).unwrap();
    assert_eq!(running, "web of alice\n");
}
