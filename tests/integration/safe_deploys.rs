//! Safe deploys (lifecycle.md "Rollback", "Health checks and automatic
//! rollback", "What a submit would change"): the rollback action with every
//! refusal, the health step with scripted deployers (healthy, healthy after
//! two checks, a check that hangs, a confirm that fails, a cancel during the
//! step), the automatic rollback of the local deployer's broken deploy, and
//! a preview's `changes`.

use std::path::Path;

use serde_json::{json, Value};

use crate::harness::*;

/// Health checks every 300 ms (each call's time limit too: room for a
/// shell to start on a loaded machine) for up to 1.5 s: a short step.
fn quick_health(opts: Options) -> Options {
    opts.arg("--health-interval")
        .arg("300ms")
        .arg("--health-timeout")
        .arg("1500ms")
}

fn config(n: u32) -> Value {
    json!({"domain": "a.org", "applications": {"mastodon": {"enable": true}}, "n": n})
}

/// A deployer with a health step whose answers `<ctrl>/mode` decides:
/// `healthy`, `after2` (healthy from the second check), `hang` (a check that
/// never answers in time), `confirm-fails`, anything else unhealthy. It
/// counts checks in `<ctrl>/checks` and confirms in `<ctrl>/confirms`.
fn health_deployer(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let ctrl = dir.join("ctrl");
    std::fs::create_dir_all(&ctrl).unwrap();
    std::fs::write(ctrl.join("mode"), "healthy").unwrap();
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
  mode=$(cat {c}/mode)
  echo "checking web ($mode, $n)"
  case "$mode" in
    healthy|confirm-fails) h=true;;
    after2) if [ $n -ge 2 ]; then h=true; else h=false; fi;;
    hang) sleep 5; h=true;;
    *) h=false;;
  esac
  printf '{{"nodes":[{{"name":"web","healthy":%s,"reason":"web.service failed"}}]}}' $h > "$BERTH_RESULT";;
confirm)
  echo confirmed >> {c}/confirms
  if [ "$(cat {c}/mode)" = confirm-fails ]; then exit 1; fi
  printf '{{}}' > "$BERTH_RESULT";;
destroy) printf '{{}}' > "$BERTH_RESULT";;
esac
"#
    );
    (script(dir, "health.sh", &body), ctrl)
}

/// Confirms (one line each) or checks (the file holds their number).
fn count(ctrl: &Path, file: &str) -> usize {
    let text = std::fs::read_to_string(ctrl.join(file)).unwrap_or_default();
    match file {
        "checks" => text.trim().parse().unwrap_or(0),
        _ => text.lines().count(),
    }
}

async fn build_events(s: &Server, build: &str) -> Vec<SseEvent> {
    let mut sse = Sse::open(
        s.http
            .get(s.url(&format!("/v1/builds/{build}/events")))
            .bearer_auth(&s.token),
    )
    .await;
    sse.until_end().await
}

async fn builds_of(s: &Server, id: &str) -> Vec<Value> {
    let (_, b) = s.json(&format!("/v1/deployments/{id}/builds")).await;
    b["items"].as_array().unwrap().clone()
}

async fn act(s: &Server, id: &str, name: &str, body: Option<Value>) -> (u16, Value) {
    let mut r = s
        .http
        .post(s.url(&format!("/v1/deployments/{id}/actions/{name}")))
        .bearer_auth(&s.token);
    if let Some(body) = body {
        r = r.json(&body);
    }
    read(r.send().await.unwrap()).await
}

#[tokio::test]
async fn a_rollback_deploys_an_earlier_snapshot_and_refuses_every_bad_target_alike() {
    let s = Server::start(Options::default()).await;
    let (status, p) = act(&s, "ghost", "rollback", None).await;
    assert_eq!(
        (status, p["code"].as_str()),
        (404, Some("not_found")),
        "{p}"
    );
    let first = s.submit_ok("alice", config(1)).await;
    s.wait_build(&first, "succeeded").await;
    // One deploy: nothing earlier to go back to.
    let (status, p) = act(&s, "alice", "rollback", None).await;
    assert_eq!(
        (status, p["reason"].as_str()),
        (409, Some("no_earlier_build")),
        "{p}"
    );
    let (_, d) = s.json("/v1/deployments/alice").await;
    let rollback = d["actions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "rollback")
        .unwrap()
        .clone();
    assert_eq!(
        rollback,
        json!({"name": "rollback", "enabled": false, "reason": "no_earlier_build"})
    );
    let second = s.submit_ok("alice", config(2)).await;
    s.wait_build(&second, "succeeded").await;
    let other = s.submit_ok("bob", config(9)).await;
    s.wait_build(&other, "succeeded").await;

    // Every bad target answers alike; a malformed id is a 400.
    let unknown = "01a228d4-3cd7-7412-b493-83edc2196f8a";
    for target in [unknown, other.as_str()] {
        let (status, p) = act(&s, "alice", "rollback", Some(json!({"build_id": target}))).await;
        assert_eq!(
            (status, p["reason"].as_str()),
            (409, Some("rollback_target_invalid")),
            "{p}"
        );
    }
    let (status, p) = act(&s, "alice", "rollback", Some(json!({"build_id": "nope"}))).await;
    assert_eq!(
        (status, p["fields"][0]["pointer"].as_str()),
        (400, Some("/build_id")),
        "{p}"
    );
    // If-Match: a stale revision is refused and queues nothing.
    let stale = s
        .http
        .post(s.url("/v1/deployments/alice/actions/rollback"))
        .bearer_auth(&s.token)
        .header("if-match", "\"1\"")
        .send()
        .await
        .unwrap();
    assert_eq!(stale.status(), 412);
    assert_eq!(builds_of(&s, "alice").await.len(), 2);

    // Without a target: back to the newest succeeded deploy before the
    // deployed one, under an idempotency key (a retry replays).
    let send = || {
        s.http
            .post(s.url("/v1/deployments/alice/actions/rollback"))
            .bearer_auth(&s.token)
            .header("idempotency-key", "rollback-000000001")
            .send()
    };
    let (status, q) = read(send().await.unwrap()).await;
    assert_eq!(status, 202, "{q}");
    let (_, again) = read(send().await.unwrap()).await;
    assert_eq!(again, q);
    let id = q["build_id"].as_str().unwrap();
    let b = s.wait_build(id, "succeeded").await;
    assert_eq!(b["trigger"], "action:rollback");
    assert_eq!(b["rollback_of"], first.as_str());
    assert_eq!(
        b["configuration"],
        config(1),
        "the target's snapshot, exactly"
    );
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["configuration"], config(1));
    assert_eq!(d["deployed"]["build_id"], id);
    assert_eq!(d["last_build"]["rollback_of"], first.as_str());
    assert_eq!(
        builds_of(&s, "alice").await.len(),
        3,
        "a replay queued nothing"
    );
    // The refusals above are audited too (refused, invalid); one went through.
    let taken = d["audit"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "action:rollback" && e["result"] == "ok")
        .count();
    assert_eq!(taken, 1, "{}", d["audit"]);
    // An explicit target: the second deploy again.
    let (status, q) = act(&s, "alice", "rollback", Some(json!({"build_id": second}))).await;
    assert_eq!(status, 202, "{q}");
    let b = s
        .wait_build(q["build_id"].as_str().unwrap(), "succeeded")
        .await;
    assert_eq!(
        (b["rollback_of"].as_str(), &b["configuration"]),
        (Some(second.as_str()), &config(2))
    );
}

#[tokio::test]
async fn a_broken_local_deploy_fails_its_health_step_and_is_rolled_back_by_itself() {
    let s = Server::start(quick_health(Options::default())).await;
    let good = s.submit_ok("alice", mastodon("a.org")).await;
    s.wait_build(&good, "succeeded").await;
    let broken = json!({"domain": "a.org", "applications": {"mastodon": {"enable": true, "unhealthy": true}}});
    let bad = s.submit_ok("alice", broken).await;
    let b = s.wait_build(&bad, "final").await;
    assert_eq!(b["status"], "failed", "{b}");
    assert_eq!(b["failure"]["reason"], "health_check_failed");
    assert!(
        b["failure"]["detail"]
            .as_str()
            .unwrap()
            .contains("mastodon"),
        "{b}"
    );
    // Its channel: log lines, then a health event per changed node per
    // check, ids rising by one, then the final status.
    let events = build_events(&s, &bad).await;
    let ids: Vec<u64> = events.iter().filter_map(|e| e.id).collect();
    assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "ids {ids:?}");
    let health: Vec<Value> = events
        .iter()
        .filter(|e| e.event == "health")
        .map(|e| serde_json::from_str(&e.data).unwrap())
        .collect();
    assert!(!health.is_empty(), "no health events");
    assert!(
        health
            .iter()
            .any(|h| h["node"] == "mastodon" && h["healthy"] == false && h["attempt"] == 1),
        "{health:?}"
    );
    let log = s.log_text(&bad).await;
    assert!(
        log.contains("[berth] health check 1: node mastodon is not healthy"),
        "{log}"
    );
    // The rollback: queued in the failure's transaction, to the good build.
    let all = builds_of(&s, "alice").await;
    let rollback = all
        .iter()
        .find(|b| b["trigger"] == "automatic_rollback")
        .expect("an automatic rollback")
        .clone();
    assert_eq!(rollback["rollback_of"], good.as_str());
    s.wait_build(rollback["id"].as_str().unwrap(), "succeeded")
        .await;
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["configuration"], mastodon("a.org"));
    assert_eq!(d["state"], "active");
    assert_eq!(d["auto_rollback"], true);
    let audit = d["audit"].as_array().unwrap();
    let event = audit
        .iter()
        .find(|e| e["action"] == "automatic_rollback")
        .expect("audited");
    assert_eq!(event["build"], bad.as_str());
    assert_eq!(event["reason"], "health_check_failed");
    assert_eq!(all.len(), 3, "one rollback, no loop");
}

#[tokio::test]
async fn without_auto_rollback_a_failed_deploy_stays_failed() {
    let s = Server::start(Options::default().env("BERTH_LOCAL_FAIL", "pixelfed")).await;
    let good = s.submit_ok("alice", mastodon("a.org")).await;
    s.wait_build(&good, "succeeded").await;
    let failing = json!({"domain": "a.org", "applications": {"pixelfed": {"enable": true}}});
    let bad = s.submit_ok_without_rollback("alice", failing).await;
    assert_eq!(
        s.wait_build(&bad, "final").await["failure"]["reason"],
        "exit_status"
    );
    // A rollback would be queued in the transaction of the final status.
    assert_eq!(builds_of(&s, "alice").await.len(), 2);
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(
        (d["auto_rollback"].as_bool(), d["state"].as_str()),
        (Some(false), Some("failed"))
    );
    // With it (the default again), the same failure is rolled back.
    let (status, _) = s.submit("alice", json!({"configuration": {"domain": "a.org", "applications": {"pixelfed": {"enable": true}}}, "auto_rollback": true})).await;
    assert_eq!(status, 202);
    eventually("the exit_status failure is rolled back", || async {
        builds_of(&s, "alice")
            .await
            .iter()
            .any(|b| b["trigger"] == "automatic_rollback" && b["status"] == "succeeded")
    })
    .await;
    let (status, p) = s
        .submit(
            "alice",
            json!({"configuration": mastodon("a.org"), "auto_rollback": "yes"}),
        )
        .await;
    assert_eq!(
        (status, p["fields"][0]["pointer"].as_str()),
        (400, Some("/auto_rollback"))
    );
}

#[tokio::test]
async fn the_health_step_with_scripted_deployers() {
    let dir = temp_dir("health");
    let (deployer, ctrl) = health_deployer(&dir);
    let s = Server::start(quick_health(Options::default().deployer(&deployer))).await;
    let set = |mode: &str| {
        std::fs::write(ctrl.join("mode"), mode).unwrap();
        let _ = std::fs::remove_file(ctrl.join("checks"));
        let _ = std::fs::remove_file(ctrl.join("confirms"));
    };
    // Healthy: checked (once, unless a check outran its time limit on a
    // loaded machine), then confirmed once.
    set("healthy");
    let b = s.submit_ok("web", config(1)).await;
    assert_eq!(s.wait_build(&b, "final").await["status"], "succeeded");
    assert!(count(&ctrl, "checks") >= 1);
    assert_eq!(count(&ctrl, "confirms"), 1);
    // Healthy from the second check.
    set("after2");
    let b = s.submit_ok("web", config(2)).await;
    assert_eq!(s.wait_build(&b, "final").await["status"], "succeeded");
    assert_eq!(
        (count(&ctrl, "checks") >= 2, count(&ctrl, "confirms")),
        (true, 1)
    );
    // A check that never answers in time: unhealthy (check_timeout), failed.
    set("hang");
    let b = s.submit_ok_without_rollback("web", config(3)).await;
    let end = s.wait_build(&b, "final").await;
    assert_eq!(end["failure"]["reason"], "health_check_failed", "{end}");
    assert!(
        end["failure"]["detail"]
            .as_str()
            .unwrap()
            .contains("check_timeout"),
        "{end}"
    );
    assert_eq!(count(&ctrl, "confirms"), 0, "nothing confirmed");
    // A confirm that fails fails the build.
    set("confirm-fails");
    let b = s.submit_ok_without_rollback("web", config(4)).await;
    let end = s.wait_build(&b, "final").await;
    assert_eq!(end["failure"]["reason"], "health_check_failed", "{end}");
    assert_eq!(count(&ctrl, "confirms"), 1);
}

#[tokio::test]
async fn a_cancel_during_the_health_step_confirms_nothing_and_rolls_nothing_back() {
    let dir = temp_dir("health-cancel");
    let (deployer, ctrl) = health_deployer(&dir);
    let s = Server::start(
        Options::default()
            .deployer(&deployer)
            .arg("--health-interval")
            .arg("300ms")
            .arg("--health-timeout")
            .arg("60s"),
    )
    .await;
    let good = s.submit_ok("web", config(1)).await;
    s.wait_build(&good, "succeeded").await;
    std::fs::write(ctrl.join("mode"), "unhealthy").unwrap();
    let _ = std::fs::remove_file(ctrl.join("confirms"));
    let b = s.submit_ok("web", config(2)).await;
    eventually("the health step checks", || async {
        count(&ctrl, "checks") >= 2
    })
    .await;
    let r = s
        .http
        .post(s.url(&format!("/v1/builds/{b}/cancel")))
        .bearer_auth(&s.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let end = s.wait_build(&b, "final").await;
    assert_eq!(end["status"], "cancelled", "{end}");
    assert_eq!(count(&ctrl, "confirms"), 0);
    // A rollback would be queued in the transaction of the final status.
    assert!(builds_of(&s, "web")
        .await
        .iter()
        .all(|b| b["trigger"] != "automatic_rollback"));
}

#[tokio::test]
async fn a_preview_says_what_a_submit_would_change() {
    let s = Server::start(Options::default()).await;
    let preview = |config: Value| {
        let s = &s;
        async move {
            let (status, p) = read(
                s.post(
                    "/v1/deployments/alice/preview",
                    &json!({"configuration": config}),
                )
                .send()
                .await
                .unwrap(),
            )
            .await;
            assert_eq!(status, 200, "{p}");
            let mut changes: Vec<(String, String)> = p["changes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| {
                    (
                        c["node"].as_str().unwrap().to_string(),
                        c["change"].as_str().unwrap().to_string(),
                    )
                })
                .collect();
            changes.sort();
            changes
        }
    };
    let pair = |n: &str, c: &str| (n.to_string(), c.to_string());
    let two = json!({"domain": "a.org", "applications": {"mastodon": {"enable": true}, "forgejo": {"enable": true}}});
    // Nothing deployed yet: every node is added.
    assert_eq!(
        preview(two.clone()).await,
        vec![
            pair("base", "added"),
            pair("forgejo", "added"),
            pair("mastodon", "added")
        ]
    );
    let b = s.submit_ok("alice", two.clone()).await;
    s.wait_build(&b, "succeeded").await;
    assert_eq!(
        preview(two).await,
        vec![
            pair("base", "unchanged"),
            pair("forgejo", "unchanged"),
            pair("mastodon", "unchanged")
        ]
    );
    let changed = json!({"domain": "a.org", "applications": {"mastodon": {"enable": true, "theme": "dark"}, "homepage": {"enable": true}}});
    assert_eq!(
        preview(changed).await,
        vec![
            pair("base", "unchanged"),
            pair("forgejo", "removed"),
            pair("homepage", "added"),
            pair("mastodon", "changed")
        ]
    );
}
