//! Rollouts in waves (rollouts.md): the real `berth serve` with a scripted
//! deployer that lists `activate`, `check` and `confirm` and records every
//! call it gets, one line each.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::harness::*;

/// A deployer whose deploy changes nodes n1..n5 and activates nothing;
/// `activate`, `check` and `confirm` append `<verb> [target wave] nodes` to
/// `<dir>/calls.log`. A node named in `<dir>/unhealthy` is unhealthy; while
/// `<dir>/slow` exists an `activate` writes its pid to `<dir>/slow.pid`
/// and hangs.
fn recording_deployer(dir: &Path) -> (PathBuf, PathBuf) {
    let calls = dir.join("calls.log");
    let body = format!(
        r#"verb="$1"
req=$(cat)
calls="{calls}"
unhealthy="{unhealthy}"
field() {{ printf '%s' "$req" | python3 -c "import json,sys; r=json.load(sys.stdin); v=r.get('$1'); print(' '.join(v) if isinstance(v, list) else v)"; }}
case "$verb" in
describe) printf '%s' '{{"methods":["local"],"default_method":"local","actions":{{}},"catalog":[],"schema":null,"verbs":["check","confirm","activate"]}}' > "$BERTH_RESULT";;
eval) printf '%s' '{{"nodes":[]}}' > "$BERTH_RESULT";;
deploy)
  echo "deploy" >> "$calls"
  printf '%s' '{{"nodes":[{{"name":"n1","changed":true}},{{"name":"n2","changed":true}},{{"name":"n3","changed":true}},{{"name":"n4","changed":true}},{{"name":"n5","changed":true}}]}}' > "$BERTH_RESULT";;
activate)
  nodes=$(field nodes)
  echo "activate $(field target) $(field wave) $nodes" >> "$calls"
  if [ -e "{slow}" ]; then echo $$ > "{slow}.pid"; sleep 600; fi
  out=""
  for n in $nodes; do out="$out{{\"name\":\"$n\",\"activated\":true}},"; done
  printf '{{"nodes":[%s]}}' "${{out%,}}" > "$BERTH_RESULT";;
check)
  nodes=$(field nodes)
  echo "check $nodes" >> "$calls"
  out=""
  for n in $nodes; do
    if grep -qx "$n" "$unhealthy" 2>/dev/null; then h=false; else h=true; fi
    out="$out{{\"name\":\"$n\",\"healthy\":$h,\"reason\":\"test\"}},"
  done
  printf '{{"nodes":[%s]}}' "${{out%,}}" > "$BERTH_RESULT";;
confirm) echo "confirm $(field nodes)" >> "$calls"; printf '{{}}' > "$BERTH_RESULT";;
destroy) printf '{{}}' > "$BERTH_RESULT";;
esac
exit 0
"#,
        calls = calls.display(),
        unhealthy = dir.join("unhealthy").display(),
        slow = dir.join("slow").display()
    );
    (script(dir, "rollout.sh", &body), calls)
}

fn calls_of(file: &Path) -> Vec<String> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

async fn rollout_server(tag: &str) -> (Server, PathBuf) {
    rollout_server_with(tag, &[]).await
}

/// berth on the recording deployer (checks every second), with more flags.
async fn rollout_server_with(tag: &str, flags: &[&str]) -> (Server, PathBuf) {
    let dir = temp_dir(tag);
    let (deployer, calls) = recording_deployer(&dir);
    let mut opts = Options::default()
        .deployer(&deployer)
        .arg("--health-interval")
        .arg("1s")
        .arg("--update-interval")
        .arg("1s");
    for flag in flags {
        opts = opts.arg(flag);
    }
    (Server::start_in(dir.join("berth"), opts).await, calls)
}

/// berth that runs no build itself: remote workers take them (leases of
/// 5 s).
const REMOTE: [&str; 6] = [
    "--local-worker",
    "off",
    "--lease-ttl",
    "5s",
    "--cancel-grace",
    "1s",
];

async fn set_policy(s: &Server, policy: Value) -> Value {
    let r = s
        .http
        .put(s.url("/v1/deployments/alice/rollout-policy"))
        .bearer_auth(&s.token)
        .json(&policy)
        .send()
        .await
        .unwrap();
    let (status, body) = read(r).await;
    assert_eq!(status, 200, "{body}");
    body
}

async fn wait_rollout(s: &Server, build: &str, state: &str) -> Value {
    let mut last = Value::Null;
    for _ in 0..400 {
        last = s.build(build).await;
        if last["rollout"]["state"] == state {
            return last;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("the rollout never reached {state}: {last}");
}

/// Waits until `build`'s log holds `text`.
async fn wait_log(s: &Server, build: &str, text: &str) {
    eventually(text, || async { s.log_text(build).await.contains(text) }).await;
}

async fn act(s: &Server, name: &str, revision: Option<u64>, body: Value) -> (u16, Value) {
    let mut req = s
        .http
        .post(s.url(&format!("/v1/deployments/alice/actions/{name}")))
        .bearer_auth(&s.token)
        .json(&body);
    if let Some(r) = revision {
        req = req.header("If-Match", format!("\"{r}\""));
    }
    read(req.send().await.unwrap()).await
}

fn reason_of<'a>(d: &'a Value, action: &str) -> &'a Value {
    let actions = d["actions"].as_array().expect("actions");
    &actions.iter().find(|a| a["name"] == action).expect(action)["reason"]
}

#[tokio::test]
async fn waves_of_the_stated_sizes_pause_resume_under_if_match_and_confirm_once() {
    let (s, calls) = rollout_server("rollout-waves").await;
    // The first deploy has no policy: one wave of every changed node.
    let first = s.submit_ok("alice", json!({"n": 1})).await;
    assert_eq!(s.wait_build(&first, "final").await["status"], "succeeded");
    assert_eq!(
        calls_of(&calls),
        [
            "deploy",
            "activate new 1 n1 n2 n3 n4 n5",
            "check n1 n2 n3 n4 n5",
            "confirm n1 n2 n3 n4 n5"
        ]
    );
    std::fs::remove_file(&calls).unwrap();
    let policy = json!({"waves": [1, "60%"], "pause_after": [1]});
    let d = set_policy(&s, policy.clone()).await;
    assert_eq!(
        d["rollout_policy"],
        Value::Null,
        "the answer is not the read"
    );
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["rollout_policy"], policy);
    let build = s.submit_ok("alice", json!({"n": 2})).await;
    let paused = wait_rollout(&s, &build, "paused").await;
    assert_eq!(paused["status"], "running");
    assert_eq!(paused["rollout"]["wave"], 1);
    assert_eq!(paused["rollout"]["wave_count"], 3);
    assert_eq!(paused["rollout"]["paused"]["by"], "policy");
    let sizes: Vec<usize> = paused["rollout"]["waves"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["nodes"].as_array().unwrap().len())
        .collect();
    assert_eq!(sizes, [1, 2, 2]);
    assert_eq!(
        calls_of(&calls),
        ["deploy", "activate new 1 n1", "check n1"],
        "nothing after wave 1's gate while paused"
    );
    assert!(
        s.metrics()
            .await
            .contains("berth_rollouts{state=\"paused\"} 1"),
        "the paused rollout is counted"
    );
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["rollout"]["state"], "paused", "{d}");
    assert_eq!(reason_of(&d, "rollout_pause"), "already_paused");
    assert_eq!(reason_of(&d, "rollout_resume"), &Value::Null);
    assert_eq!(reason_of(&d, "rollback"), "build_pending");
    let revision = d["revision"].as_u64().unwrap();
    // A stale If-Match changes nothing; the CLI shows what it would act on.
    let (status, _) = act(&s, "rollout_resume", Some(revision - 1), json!({})).await;
    assert_eq!(status, 412);
    let token_file = s.dir.join("data/service-token");
    let cli = |args: &[&str]| {
        let mut all = vec!["rollout"];
        all.extend_from_slice(args);
        all.extend_from_slice(&[
            "--url",
            &s.base,
            "--token-file",
            token_file.to_str().unwrap(),
        ]);
        berth(&all)
    };
    let (code, out) = cli(&["status", "alice"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("paused") && out.contains("1/3"), "{out}");
    assert!(out.contains(&format!("revision    {revision}")), "{out}");
    let stale = (revision - 1).to_string();
    let (code, out) = cli(&["resume", "alice", "--revision", &stale]);
    assert_eq!(code, 3, "a stale revision is refused: {out}");
    assert_eq!(s.build(&build).await["rollout"]["state"], "paused");
    let (status, resumed) = act(&s, "rollout_resume", Some(revision), json!({})).await;
    assert_eq!(status, 202, "{resumed}");
    assert_eq!(resumed["build_id"], build.as_str());
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(done["rollout"]["result"], "succeeded");
    assert_eq!(
        calls_of(&calls),
        [
            "deploy",
            "activate new 1 n1",
            "check n1",
            "check n1",
            "activate new 2 n2 n3",
            "check n2 n3",
            "activate new 3 n4 n5",
            "check n4 n5",
            "confirm n1 n2 n3 n4 n5"
        ],
        "the gate again after the pause, each node activated once, one confirm"
    );
    // Both channels carried the rollout's steps.
    let mut sse = Sse::open(s.get(&format!("/v1/builds/{build}/events"))).await;
    let events = sse.until_end().await;
    assert!(events.iter().any(|e| e.event == "rollout"));
    let (status, _) = act(&s, "rollout_pause", None, json!({})).await;
    assert_eq!(status, 409, "no rollout any more");
}

#[tokio::test]
async fn an_abort_puts_the_activated_waves_back_last_first_without_confirm_or_rollback() {
    let (s, calls) = rollout_server("rollout-abort").await;
    let first = s.submit_ok("alice", json!({"n": 1})).await;
    assert_eq!(s.wait_build(&first, "final").await["status"], "succeeded");
    set_policy(&s, json!({"waves": [1, 3], "pause_after": [2]})).await;
    std::fs::remove_file(&calls).unwrap();
    let build = s.submit_ok("alice", json!({"n": 2})).await;
    wait_rollout(&s, &build, "paused").await;
    let (status, body) = act(&s, "rollout_abort", None, json!({"reason": "bad metrics"})).await;
    assert_eq!(status, 202, "{body}");
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "failed", "{done}");
    assert_eq!(done["failure"]["reason"], "rollout_aborted", "{done}");
    assert_eq!(done["rollout"]["result"], "aborted");
    assert_eq!(done["rollout"]["abort"]["by"], "action");
    assert_eq!(done["rollout"]["abort"]["reason"], "bad metrics");
    assert_eq!(
        calls_of(&calls),
        [
            "deploy",
            "activate new 1 n1",
            "check n1",
            "activate new 2 n2 n3",
            "check n2 n3",
            "activate previous 2 n2 n3",
            "activate previous 1 n1"
        ],
        "back wave by wave, last first; no confirm"
    );
    // No automatic rollback after an abort: the nodes are back already.
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["last_build"]["id"], build.as_str(), "{d}");
}

#[tokio::test]
async fn a_wave_that_stays_unhealthy_aborts_by_itself() {
    let (s, calls) = rollout_server("rollout-unhealthy").await;
    let first = s.submit_ok("alice", json!({"n": 1})).await;
    assert_eq!(s.wait_build(&first, "final").await["status"], "succeeded");
    set_policy(&s, json!({"waves": [2], "progress_deadline_seconds": 5})).await;
    std::fs::write(calls.with_file_name("unhealthy"), "n4\n").unwrap();
    std::fs::remove_file(&calls).unwrap();
    let build = s.submit_ok_without_rollback("alice", json!({"n": 2})).await;
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "failed", "{done}");
    assert_eq!(done["failure"]["reason"], "health_check_failed");
    assert!(
        done["failure"]["detail"].as_str().unwrap().contains("n4"),
        "{done}"
    );
    assert_eq!(done["rollout"]["abort"]["by"], "health");
    let log = calls_of(&calls);
    assert!(
        log.contains(&"activate previous 2 n3 n4 n5".to_string()),
        "{log:?}"
    );
    assert_eq!(log.last().unwrap(), "activate previous 1 n1 n2");
    assert!(!log.iter().any(|l| l.starts_with("confirm")), "{log:?}");
}

#[tokio::test]
async fn a_policy_is_checked_rule_by_rule_and_a_broken_one_stores_nothing() {
    let (s, _) = rollout_server("rollout-policy").await;
    s.submit_ok("alice", json!({"n": 1})).await;
    let r = s
        .http
        .put(s.url("/v1/deployments/alice/rollout-policy"))
        .bearer_auth(&s.token)
        .json(&json!({"waves": [2, 1], "wait_seconds": -1}))
        .send()
        .await
        .unwrap();
    let (status, body) = read(r).await;
    assert_eq!(status, 400, "{body}");
    let fields: Vec<(String, String)> = body["fields"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["pointer"].as_str().unwrap().into(),
                f["code"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert!(
        fields.contains(&("/waves/1".into(), "not_increasing".into())),
        "{body}"
    );
    assert!(
        fields.contains(&("/wait_seconds".into(), "range".into())),
        "{body}"
    );
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["rollout_policy"], json!({}), "nothing stored");
    // A submit may carry the policy; a broken one stores neither.
    let (status, body) = s
        .submit(
            "alice",
            json!({"configuration": {"n": 2}, "rollout": {"waves": [0]}}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["fields"][0]["pointer"], "/rollout/waves/0", "{body}");
    let (status, body) = s
        .submit(
            "alice",
            json!({"configuration": {"n": 3}, "rollout": {"waves": [2]}, "mode": "enqueue"}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["rollout_policy"], json!({"waves": [2]}));
}

async fn put_freeze(s: &Server, path: &str, body: Value) -> (u16, Value) {
    let r = s
        .http
        .put(s.url(path))
        .bearer_auth(&s.token)
        .json(&body)
        .send()
        .await
        .unwrap();
    read(r).await
}

#[tokio::test]
async fn a_freeze_refuses_change_in_its_own_words_and_lets_the_way_back_through() {
    let (s, _) = rollout_server("freeze-refuses").await;
    for n in 1..=2 {
        let b = s.submit_ok("alice", json!({"n": n})).await;
        assert_eq!(s.wait_build(&b, "final").await["status"], "succeeded");
    }
    let (status, set) = put_freeze(
        &s,
        "/v1/deployments/alice/freeze",
        json!({"reason": "release week: ask Ada"}),
    )
    .await;
    assert_eq!(status, 200, "{set}");
    assert_eq!(set["freeze"]["active"], true);
    let (_, before) = s.json("/v1/deployments/alice").await;
    assert_eq!(before["frozen"]["reason"], "release week: ask Ada");
    assert_eq!(reason_of(&before, "deploy"), "frozen");
    let (status, refused) = s.submit("alice", json!({"configuration": {"n": 3}})).await;
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["reason"], "frozen");
    assert_eq!(
        refused["message"],
        "frozen (deployment): release week: ask Ada"
    );
    let (_, after) = s.json("/v1/deployments/alice").await;
    assert_eq!(
        after["revision"], before["revision"],
        "a refused submit stores nothing"
    );
    // The way back goes through a freeze.
    let (status, back) = act(&s, "rollback", None, json!({})).await;
    assert_eq!(status, 202, "{back}");
    let back = back["build_id"].as_str().unwrap().to_string();
    assert_eq!(s.wait_build(&back, "final").await["status"], "succeeded");
    // Lifted, it is gone; a second lift finds none.
    let lift = || async {
        read(
            s.delete("/v1/deployments/alice/freeze")
                .send()
                .await
                .unwrap(),
        )
        .await
    };
    assert_eq!(lift().await.0, 200);
    let (status, again) = lift().await;
    assert_eq!(
        (status, again["reason"].as_str()),
        (404, Some("not_frozen"))
    );
    let b = s.submit_ok("alice", json!({"n": 4})).await;
    assert_eq!(s.wait_build(&b, "final").await["status"], "succeeded");
    // The CLI: neither an id nor --global is a usage error.
    let token_file = s.dir.join("data/service-token");
    let conn = [
        "--url",
        s.base.as_str(),
        "--token-file",
        token_file.to_str().unwrap(),
    ];
    let cli = |args: &[&str]| {
        let mut all = vec!["freeze"];
        all.extend_from_slice(args);
        all.extend_from_slice(&conn);
        berth(&all)
    };
    assert_eq!(cli(&["set", "--reason", "x"]).0, 2);
    let (code, out) = cli(&["set", "alice", "--reason", "audit\u{1b}[31m"]);
    assert_eq!(code, 3, "a control character is refused: {out}");
    let (code, out) = cli(&["set", "alice", "--reason", "audit week"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = cli(&["status", "alice"]);
    assert!(
        code == 0 && out.contains("holding: audit week (deployment)"),
        "{out}"
    );
    assert_eq!(cli(&["lift", "alice"]).0, 0);
    // A freeze that ends by itself.
    let until = berth::model::format_time(berth::model::now_millis() + 1500);
    let (status, _) = put_freeze(
        &s,
        "/v1/freeze",
        json!({"reason": "for a moment", "until": until}),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _) = s.submit("alice", json!({"configuration": {"n": 5}})).await;
    assert_eq!(status, 409, "the global freeze holds every deployment");
    assert!(s
        .metrics()
        .await
        .contains("berth_freezes_active{scope=\"global\"} 1"));
    eventually("the freeze expired", || async {
        s.json("/v1/freeze").await.1["freeze"].is_null()
    })
    .await;
    let b = s.submit_ok("alice", json!({"n": 6})).await;
    assert_eq!(s.wait_build(&b, "final").await["status"], "succeeded");
}

#[tokio::test]
async fn a_freeze_holds_a_rollouts_next_wave_until_it_is_lifted() {
    let (s, calls) = rollout_server("freeze-rollout").await;
    let first = s.submit_ok("alice", json!({"n": 1})).await;
    assert_eq!(s.wait_build(&first, "final").await["status"], "succeeded");
    set_policy(&s, json!({"waves": [1], "wait_seconds": 1})).await;
    std::fs::remove_file(&calls).unwrap();
    let build = s.submit_ok("alice", json!({"n": 2})).await;
    wait_rollout(&s, &build, "waiting").await;
    let (status, _) = put_freeze(&s, "/v1/freeze", json!({"reason": "incident 42"})).await;
    assert_eq!(status, 200);
    let held = wait_rollout(&s, &build, "frozen").await;
    assert_eq!(held["status"], "running");
    assert_eq!(
        calls_of(&calls),
        ["deploy", "activate new 1 n1", "check n1", "check n1"],
        "the gate ran again after the wait, and no wave began"
    );
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["frozen"]["scope"], "global");
    assert_eq!(
        reason_of(&d, "rollout_pause"),
        &Value::Null,
        "a pause stops: allowed"
    );
    let lifted = s.delete("/v1/freeze").send().await.unwrap();
    assert_eq!(lifted.status(), 200);
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}");
    let log = calls_of(&calls);
    assert_eq!(
        &log[4..],
        [
            "check n1",
            "activate new 2 n2 n3 n4 n5",
            "check n2 n3 n4 n5",
            "confirm n1 n2 n3 n4 n5"
        ],
        "after the lift: the gate again, then the next wave: {log:?}"
    );
}

/// Every node file of the local deployer's work dir for `deployment`:
/// name -> content.
fn local_nodes(s: &Server, deployment: &str) -> std::collections::BTreeMap<String, String> {
    let dir = s.dir.join("data/work").join(deployment).join("nodes");
    std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| {
                    (
                        e.file_name().to_string_lossy().into_owned(),
                        std::fs::read_to_string(e.path()).unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn the_local_deployer_activates_in_waves_and_an_abort_puts_its_nodes_back() {
    let dir = temp_dir("rollout-local");
    let opts = Options::default()
        .env("BERTH_LOCAL_ACTIVATE", "1")
        .arg("--health-interval")
        .arg("1s");
    let s = Server::start_in(dir.join("berth"), opts).await;
    let config = |domain: &str| json!({"domain": domain, "applications": {"mastodon": {"enable": true}, "nextcloud": {"enable": true}}});
    let first = s.submit_ok("alice", config("a.example.org")).await;
    let done = s.wait_build(&first, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}\n{}", s.log());
    assert_eq!(done["rollout"]["result"], "succeeded");
    let before = local_nodes(&s, "alice");
    assert!(before.len() >= 2, "{before:?}");
    set_policy(&s, json!({"waves": [1], "pause_after": [1]})).await;
    let build = s.submit_ok("alice", config("b.example.org")).await;
    let paused = wait_rollout(&s, &build, "paused").await;
    let first_wave: Vec<String> = paused["rollout"]["waves"][0]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_string())
        .collect();
    assert_eq!(first_wave.len(), 1);
    let during = local_nodes(&s, "alice");
    let changed: Vec<&String> = during
        .iter()
        .filter(|(name, text)| before.get(*name) != Some(*text))
        .map(|(name, _)| name)
        .collect();
    assert_eq!(
        changed,
        [&format!("{}.json", first_wave[0])],
        "only wave 1's node runs the new configuration"
    );
    let (status, _) = act(&s, "rollout_abort", None, json!({})).await;
    assert_eq!(status, 202);
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["failure"]["reason"], "rollout_aborted", "{done}");
    assert_eq!(local_nodes(&s, "alice"), before, "every node is back");
}

#[tokio::test]
async fn a_rollout_on_a_remote_worker_runs_each_call_there_and_a_lost_worker_fails_it() {
    let (s, calls) = rollout_server_with("rollout-remote", &REMOTE).await;
    let (_, token_file) = crate::workers::worker_token(&s, "w1").await;
    let deployer = s.dir.join("../rollout.sh");
    let mut worker =
        crate::workers::Worker::start(&s, &token_file, &s.dir.join("../w1"), &deployer);
    let first = s.submit_ok("alice", json!({"n": 1})).await;
    let done = s.wait_build(&first, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}\n{}", worker.log());
    assert_eq!(done["attempt"]["worker"], "w1", "{done}");
    assert_eq!(
        calls_of(&calls),
        [
            "deploy",
            "activate new 1 n1 n2 n3 n4 n5",
            "check n1 n2 n3 n4 n5",
            "confirm n1 n2 n3 n4 n5"
        ],
        "every call ran on the worker, once"
    );
    std::fs::remove_file(&calls).unwrap();
    set_policy(&s, json!({"waves": [1, "60%"], "pause_after": [1]})).await;
    let build = s.submit_ok("alice", json!({"n": 2})).await;
    wait_rollout(&s, &build, "paused").await;
    assert_eq!(
        calls_of(&calls),
        ["deploy", "activate new 1 n1", "check n1"]
    );
    let (status, _) = act(&s, "rollout_resume", None, json!({})).await;
    assert_eq!(status, 202);
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}\n{}", worker.log());
    let activated: Vec<String> = calls_of(&calls)
        .into_iter()
        .filter(|c| c.starts_with("activate"))
        .collect();
    assert_eq!(
        activated,
        [
            "activate new 1 n1",
            "activate new 2 n2 n3",
            "activate new 3 n4 n5"
        ]
    );
    let log = s.log_text(&build).await;
    assert!(log.contains("[berth] wave 2/3: activating n2, n3"), "{log}");
    let mut sse = Sse::open(s.get(&format!("/v1/builds/{build}/events"))).await;
    let events = sse.until_end().await;
    assert!(events.iter().any(|e| e.event == "rollout"));
    assert!(events.iter().any(|e| e.event == "health"));
    let ids: Vec<u64> = events.iter().filter_map(|e| e.id).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");

    // The worker dies while the rollout is paused: its lease passes, the
    // build waits for the next claim; a cancel then ends it with no
    // worker to send an outcome.
    std::fs::remove_file(&calls).unwrap();
    let lost = s.submit_ok("alice", json!({"n": 3})).await;
    wait_rollout(&s, &lost, "paused").await;
    worker.kill();
    wait_log(&s, &lost, "the rollout waits for the next worker").await;
    assert_eq!(s.build(&lost).await["status"], "running");
    let (status, body) = read(
        s.post(&format!("/v1/builds/{lost}/cancel"), &json!({}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    let end = s.wait_build(&lost, "final").await;
    assert_eq!(end["status"], "cancelled", "{end}");
    assert_eq!(end["rollout"]["result"], "cancelled", "{end}");
}

#[tokio::test]
async fn a_rollout_whose_worker_is_lost_between_calls_goes_on_with_the_next_claim() {
    let (s, calls) = rollout_server_with("rollout-hand-over", &REMOTE).await;
    let deployer = s.dir.join("../rollout.sh");
    let (_, token1) = crate::workers::worker_token(&s, "w1").await;
    let (_, token2) = crate::workers::worker_token(&s, "w2").await;
    let mut w1 = crate::workers::Worker::start(&s, &token1, &s.dir.join("../w1"), &deployer);
    let first = s.submit_ok("alice", json!({"n": 1})).await;
    assert_eq!(s.wait_build(&first, "final").await["status"], "succeeded");
    set_policy(&s, json!({"waves": [1, "60%"], "pause_after": [1]})).await;
    std::fs::remove_file(&calls).unwrap();
    let build = s.submit_ok("alice", json!({"n": 2})).await;
    wait_rollout(&s, &build, "paused").await;
    // Paused past its lease (SIGSTOP), w1 loses the attempt between calls.
    w1.signal("-STOP");
    wait_log(&s, &build, "the rollout waits for the next worker").await;
    let mut w2 = crate::workers::Worker::start(&s, &token2, &s.dir.join("../w2"), &deployer);
    eventually("w2 takes the rollout over", || {
        let s = &s;
        let build = build.clone();
        async move { s.build(&build).await["attempt"]["worker"] == "w2" }
    })
    .await;
    w1.signal("-CONT");
    let (status, _) = act(&s, "rollout_resume", None, json!({})).await;
    assert_eq!(status, 202);
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}\n{}", w2.log());
    assert_eq!(done["attempt"]["fence"], 2, "{done}");
    let activated: Vec<String> = calls_of(&calls)
        .into_iter()
        .filter(|c| c.starts_with("activate"))
        .collect();
    assert_eq!(
        activated,
        [
            "activate new 1 n1",
            "activate new 2 n2 n3",
            "activate new 3 n4 n5"
        ],
        "the next attempt went on with the next call; no node twice"
    );
    assert!(s
        .log_text(&build)
        .await
        .contains("the rollout goes on on worker w2"));
    w1.kill();

    // Lost during a call (kill -9 while `activate` hangs): the build fails
    // `lost_attempt`; nothing is handed over.
    std::fs::remove_file(&calls).unwrap();
    std::fs::write(s.dir.join("../slow"), "").unwrap();
    let hung = s.submit_ok("alice", json!({"n": 3})).await;
    eventually("wave 1's activate runs on w2", || {
        let calls = calls.clone();
        async move { calls_of(&calls).iter().any(|c| c.starts_with("activate")) }
    })
    .await;
    w2.kill();
    let end = s.wait_build(&hung, "final").await;
    assert_eq!(end["failure"]["reason"], "lost_attempt", "{end}");
    assert!(
        end["failure"]["detail"]
            .as_str()
            .is_some_and(|d| d.contains("during the activate call")),
        "{end}"
    );
    std::fs::remove_file(s.dir.join("../slow")).unwrap();
    // The hung activate outlived its worker (the fault is real): its
    // process group is stopped here, as the worker's next start would.
    let pid: i32 = std::fs::read_to_string(s.dir.join("../slow.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let group = nix::unistd::Pid::from_raw(pid);
    nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL).unwrap();
}

#[tokio::test]
async fn a_paused_rollout_is_watched_and_the_watch_decides_nothing() {
    let (s, calls) =
        rollout_server_with("rollout-watch", &["--rollout-watch-interval", "5s"]).await;
    let first = s.submit_ok("alice", json!({"n": 1})).await;
    assert_eq!(s.wait_build(&first, "final").await["status"], "succeeded");
    set_policy(&s, json!({"waves": [1], "pause_after": [1]})).await;
    std::fs::remove_file(&calls).unwrap();
    let build = s.submit_ok("alice", json!({"n": 2})).await;
    wait_rollout(&s, &build, "paused").await;
    // n1 goes bad while the rollout is paused: the watch sees it.
    std::fs::write(calls.with_file_name("unhealthy"), "n1\n").unwrap();
    eventually("the watch saw n1 unhealthy", || async {
        s.build(&build).await["rollout"]["unhealthy"][0]["node"] == "n1"
    })
    .await;
    let b = s.build(&build).await;
    assert_eq!(b["rollout"]["state"], "paused", "the watch decides nothing");
    assert!(
        calls_of(&calls).iter().filter(|l| *l == "check n1").count() >= 2,
        "the gate's check, then the watch's"
    );
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["rollout"]["unhealthy_count"], 1);
}

#[tokio::test]
async fn the_global_freezes_webhooks_reach_only_subscriptions_to_every_deployment() {
    let (server, _) = rollout_server_with(
        "freeze-webhooks",
        &["--webhook-origin", "http://127.0.0.1:9"],
    )
    .await;
    let s = &server;
    s.submit_ok("alice", json!({"n": 1})).await;
    let subscribe = |deployments: Value| {
        let body = json!({"url": "http://127.0.0.1:9/hook", "events": ["freeze.set"], "deployments": deployments});
        async move {
            let (status, made) = read(s.post("/v1/webhooks", &body).send().await.unwrap()).await;
            assert_eq!(status, 201, "{made}");
            made["id"].as_str().unwrap().to_string()
        }
    };
    let everyone = subscribe(Value::Null).await;
    let alice_only = subscribe(json!(["alice"])).await;
    let count = |id: String| async move {
        let (_, page) = s.json(&format!("/v1/webhooks/{id}/deliveries")).await;
        page["items"].as_array().map_or(0, Vec::len)
    };
    put_freeze(s, "/v1/freeze", json!({"reason": "all of it"})).await;
    assert_eq!(count(everyone.clone()).await, 1);
    assert_eq!(
        count(alice_only.clone()).await,
        0,
        "the global freeze is no one deployment's"
    );
    put_freeze(
        s,
        "/v1/deployments/alice/freeze",
        json!({"reason": "alice"}),
    )
    .await;
    assert_eq!(count(everyone).await, 2);
    assert_eq!(count(alice_only).await, 1);
}

/// The ids of a build's events, replayed from the start.
async fn replayed_ids(s: &Server, build: &str) -> Vec<u64> {
    let mut sse = Sse::open(s.get(&format!("/v1/builds/{build}/events"))).await;
    sse.until_end().await.iter().filter_map(|e| e.id).collect()
}

#[tokio::test]
async fn a_rollout_goes_on_after_a_stop_and_after_kill_9_without_activating_a_node_twice() {
    let (mut s, calls) = rollout_server("rollout-restart").await;
    let first = s.submit_ok("alice", json!({"n": 1})).await;
    assert_eq!(s.wait_build(&first, "final").await["status"], "succeeded");
    std::fs::remove_file(&calls).unwrap();
    set_policy(
        &s,
        json!({"waves": [1, "60%"], "pause_after": [1], "progress_deadline_seconds": 120}),
    )
    .await;
    let build = s.submit_ok("alice", json!({"n": 2})).await;
    wait_rollout(&s, &build, "paused").await;
    // A stop while paused: quick (no --shutdown-grace for a rollout
    // between calls), and the build stays running.
    let stopped_at = std::time::Instant::now();
    assert!(s.terminate().success());
    assert!(
        stopped_at.elapsed() < std::time::Duration::from_secs(20),
        "a paused rollout held the stop for {:?}",
        stopped_at.elapsed()
    );
    s.launch().await;
    let after_stop = s.build(&build).await;
    assert_eq!(after_stop["status"], "running", "{after_stop}");
    assert_eq!(after_stop["rollout"]["state"], "paused");
    assert_eq!(after_stop["rollout"]["wave"], 1);
    // Wave 2's gate holds on an unhealthy n2; berth is killed during it.
    std::fs::write(s.dir.join("../unhealthy"), "n2\n").unwrap();
    let (status, body) = act(&s, "rollout_resume", None, json!({})).await;
    assert_eq!(status, 202, "{body}");
    eventually("wave 2's gate checks n2 twice", || async {
        calls_of(&calls)
            .iter()
            .filter(|c| *c == "check n2 n3")
            .count()
            >= 2
    })
    .await;
    s.kill();
    s.launch().await;
    let after_kill = s.build(&build).await;
    assert_eq!(after_kill["status"], "running", "{after_kill}");
    assert_eq!(after_kill["rollout"]["wave"], 2);
    std::fs::remove_file(s.dir.join("../unhealthy")).unwrap();
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(done["rollout"]["result"], "succeeded");
    let activated: Vec<String> = calls_of(&calls)
        .into_iter()
        .filter(|c| c.starts_with("activate"))
        .collect();
    assert_eq!(
        activated,
        [
            "activate new 1 n1",
            "activate new 2 n2 n3",
            "activate new 3 n4 n5"
        ],
        "each node activated once across a stop and a kill -9"
    );
    assert_eq!(
        calls_of(&calls).last().map(String::as_str),
        Some("confirm n1 n2 n3 n4 n5")
    );
    // The log says where it went on, and no event id was used twice.
    let log = s.log_text(&build).await;
    assert_eq!(
        log.matches("the rollout goes on where it was").count(),
        2,
        "{log}"
    );
    let ids = replayed_ids(&s, &build).await;
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "replayed ids rise strictly: {ids:?}"
    );
    // Each start ran it under a new attempt; the last ended with it.
    assert_eq!(done["attempt"]["fence"], 3, "{done}");
    assert_eq!(done["attempt"]["state"], "ended");
}

#[tokio::test]
async fn an_activate_in_flight_at_kill_9_is_stopped_and_called_again_after_the_restart() {
    let (mut s, calls) = rollout_server("rollout-orphan").await;
    let first = s.submit_ok("alice", json!({"n": 1})).await;
    assert_eq!(s.wait_build(&first, "final").await["status"], "succeeded");
    std::fs::remove_file(&calls).unwrap();
    set_policy(&s, json!({"waves": [2, 3]})).await;
    let slow = s.dir.join("../slow");
    std::fs::write(&slow, "").unwrap();
    let build = s.submit_ok("alice", json!({"n": 2})).await;
    let pid_file = s.dir.join("../slow.pid");
    eventually("wave 1's activate hangs", || async { pid_file.exists() }).await;
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    s.kill();
    let alive = |pid: i32| std::path::Path::new(&format!("/proc/{pid}")).exists();
    assert!(
        alive(pid),
        "the activate outlived berth (the fault is real)"
    );
    std::fs::remove_file(&slow).unwrap();
    s.launch().await;
    eventually("the orphaned activate is stopped", || async { !alive(pid) }).await;
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}");
    let activated: Vec<String> = calls_of(&calls)
        .into_iter()
        .filter(|c| c.starts_with("activate"))
        .collect();
    assert_eq!(
        activated,
        [
            "activate new 1 n1 n2",
            "activate new 1 n1 n2",
            "activate new 2 n3",
            "activate new 3 n4 n5"
        ],
        "the call whose answer was not stored is made again, once"
    );
}

#[tokio::test]
async fn a_remote_rollout_goes_on_after_kill_9_of_berth() {
    let (mut s, calls) = rollout_server_with("rollout-remote-restart", &REMOTE).await;
    let deployer = s.dir.join("../rollout.sh");
    let (_, token) = crate::workers::worker_token(&s, "w1").await;
    let worker = crate::workers::Worker::start(&s, &token, &s.dir.join("../w1"), &deployer);
    let first = s.submit_ok("alice", json!({"n": 1})).await;
    assert_eq!(s.wait_build(&first, "final").await["status"], "succeeded");
    set_policy(&s, json!({"waves": [1, "60%"], "pause_after": [1]})).await;
    std::fs::remove_file(&calls).unwrap();
    let build = s.submit_ok("alice", json!({"n": 2})).await;
    wait_rollout(&s, &build, "paused").await;
    s.kill();
    // Same port: the worker's --url stays right.
    let port = s.base.rsplit(':').next().unwrap().to_string();
    s.args.push("--listen".into());
    s.args.push(format!("127.0.0.1:{port}"));
    s.launch().await;
    let after = s.build(&build).await;
    assert_eq!(after["status"], "running", "{after}");
    assert_eq!(after["rollout"]["state"], "paused");
    let (status, _) = act(&s, "rollout_resume", None, json!({})).await;
    assert_eq!(status, 202);
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}\n{}", worker.log());
    assert_eq!(
        done["attempt"]["fence"], 1,
        "the same attempt went on: {done}"
    );
    let activated: Vec<String> = calls_of(&calls)
        .into_iter()
        .filter(|c| c.starts_with("activate"))
        .collect();
    assert_eq!(
        activated,
        [
            "activate new 1 n1",
            "activate new 2 n2 n3",
            "activate new 3 n4 n5"
        ]
    );
}

/// A freeze with a daily window (no `day`) is stored and read back, and
/// every read that asks the freezes keeps working (the fuzzer found one
/// that made them answer 500).
#[tokio::test]
async fn a_freeze_with_a_daily_window_reads_back_and_breaks_no_read() {
    let (s, _) = rollout_server("freeze-daily").await;
    // Twelve hours away: closed now, so the submit below goes through.
    let hour = (time::OffsetDateTime::now_utc().hour() + 12) % 24;
    let window = json!({"frequency": "daily", "start": format!("{hour:02}:00"),
        "duration_minutes": 15, "time_zone": "UTC"});
    let (status, set) = put_freeze(
        &s,
        "/v1/freeze",
        json!({"reason": "nightly backups \u{10d766}", "window": window}),
    )
    .await;
    assert_eq!(status, 200, "{set}");
    let (status, read_back) = s.json("/v1/freeze").await;
    assert_eq!(status, 200, "{read_back}");
    assert_eq!(read_back["freeze"]["window"]["frequency"], "daily");
    assert_eq!(read_back["freeze"]["reason"], "nightly backups \u{10d766}");
    assert!(s.metrics().await.contains("berth_freezes_active"));
    let build = s.submit_ok("alice", json!({"n": 1})).await;
    let (status, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(s.wait_build(&build, "final").await["status"], "succeeded");
}
