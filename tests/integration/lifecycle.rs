//! Suspend and resume through the actions route, update policies with
//! `If-Match`, automatic updates across restarts, maintenance windows, and
//! the queue rules around them (lifecycle.md).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::harness::*;

/// `--default-source` of revision `rev` (its digest is `rev` repeated).
fn pin(rev: char) -> String {
    format!(
        "url=builtin:modules,rev={rev},digest=sha256:{}",
        rev.to_string().repeat(64)
    )
}

/// A deployer whose eval names one node after the source's rev, whose
/// deploy fails for source revision `fail_rev`, and whose describe lists
/// `actions`.
fn rev_deployer(dir: &Path, actions: &str, fail_rev: &str) -> PathBuf {
    let body = format!(
        r#"
verb="$1"
req=$(cat)
rev=$(printf '%s' "$req" | sed -n 's/.*"rev":"\([^"]*\)".*/\1/p' | head -n 1)
case "$verb" in
describe) printf '%s' '{{"methods":["local"],"default_method":"local","actions":{actions},"catalog":[],"schema":null}}' > "$BERTH_RESULT"; exit 0;;
eval) printf '{{"nodes":[{{"name":"rev-%s","names":[]}}]}}' "$(printf '%s' "${{rev:-none}}" | tr . -)" > "$BERTH_RESULT"; exit 0;;
deploy) echo "deploy of rev $rev"; if [ "$rev" = "{fail_rev}" ]; then echo "rev $rev is refused"; exit 1; fi; printf '%s' '{{"nodes":[]}}' > "$BERTH_RESULT"; exit 0;;
destroy) echo "destroy"; printf '%s' '{{}}' > "$BERTH_RESULT"; exit 0;;
esac
exit 2
"#
    );
    script(dir, "rev-deployer.sh", &body)
}

const BOTH_ACTIONS: &str = r#"{"suspend":["local"],"resume":["local"]}"#;

async fn action(s: &Server, id: &str, name: &str, if_match: Option<&str>) -> (u16, Value) {
    let mut r = s.post(&format!("/v1/deployments/{id}/actions/{name}"), &json!({}));
    if let Some(tag) = if_match {
        r = r.header("if-match", tag);
    }
    read(r.send().await.unwrap()).await
}

async fn put_policy(s: &Server, id: &str, policy: &Value, if_match: Option<&str>) -> (u16, Value) {
    let mut r = s
        .http
        .put(s.url(&format!("/v1/deployments/{id}/update-policy")))
        .bearer_auth(&s.token)
        .json(policy);
    if let Some(tag) = if_match {
        r = r.header("if-match", tag);
    }
    read(r.send().await.unwrap()).await
}

/// The `reason` of action `name` in a deployment read.
fn reason(d: &Value, name: &str) -> Value {
    let a = d["actions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == name)
        .unwrap_or_else(|| panic!("no action {name} in {d}"));
    assert_eq!(a["enabled"], a["reason"].is_null(), "{a}");
    a["reason"].clone()
}

/// The deployment read and its `ETag`.
async fn read_with_etag(s: &Server, id: &str) -> (Value, String) {
    let r = s
        .get(&format!("/v1/deployments/{id}"))
        .send()
        .await
        .unwrap();
    let etag = r.headers()["etag"].to_str().unwrap().to_string();
    let (status, d) = read(r).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(etag, format!("\"{}\"", d["revision"]));
    (d, etag)
}

async fn builds_of(s: &Server, id: &str) -> Vec<Value> {
    let (status, list) = s.json(&format!("/v1/deployments/{id}/builds")).await;
    assert_eq!(status, 200, "{list}");
    list["items"].as_array().unwrap().clone()
}

/// Waits until the automatic update loop has made `n` more passes (its
/// `berth_update_passes_total`), so a "nothing more starts" check runs
/// after passes that could have started something.
async fn update_passes(s: &Server, n: u64) {
    let passes = |text: String| {
        text.lines()
            .find_map(|l| l.strip_prefix("berth_update_passes_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .expect("berth_update_passes_total in /metrics")
    };
    let from = passes(s.metrics().await);
    eventually("the automatic update loop's passes", || async {
        passes(s.metrics().await) >= from + n
    })
    .await;
}

async fn automatic_builds(s: &Server, id: &str) -> Vec<Value> {
    builds_of(s, id)
        .await
        .into_iter()
        .filter(|b| b["trigger"] == "automatic_update")
        .collect()
}

#[tokio::test]
async fn suspend_and_resume_with_every_reason_and_if_match() {
    let s = Server::start(Options::default()).await;
    let build = s.submit_ok("alice", mastodon("alice.example.org")).await;
    let (d, _) = read_with_etag(&s, "alice").await;
    assert_eq!(reason(&d, "suspend"), "not_deployed");
    assert_eq!(reason(&d, "resume"), "not_deployed");
    let (status, e) = action(&s, "alice", "suspend", None).await;
    assert_eq!(
        (status, e["reason"].clone()),
        (409, json!("not_deployed")),
        "{e}"
    );
    s.wait_build(&build, "succeeded").await;

    let (d, etag) = read_with_etag(&s, "alice").await;
    assert_eq!(reason(&d, "deploy"), Value::Null);
    assert_eq!(reason(&d, "delete"), Value::Null);
    assert_eq!(reason(&d, "suspend"), Value::Null);
    assert_eq!(reason(&d, "resume"), "not_suspended");
    let (status, e) = action(&s, "alice", "resume", None).await;
    assert_eq!(
        (status, e["reason"].clone()),
        (409, json!("not_suspended")),
        "{e}"
    );

    // A stale If-Match changes nothing.
    let (status, e) = action(&s, "alice", "suspend", Some("\"1\"")).await;
    assert_eq!(
        (status, e["code"].clone()),
        (412, json!("precondition_failed")),
        "{e}"
    );
    let (status, e) = action(&s, "alice", "suspend", Some("seven")).await;
    assert_eq!(status, 400, "{e}");
    let (unchanged, _) = read_with_etag(&s, "alice").await;
    assert_eq!(unchanged["revision"], d["revision"]);
    assert_eq!(unchanged["suspended"], false);

    // Suspend with the current ETag: the flag is stored at once.
    let (status, q) = action(&s, "alice", "suspend", Some(&etag)).await;
    assert_eq!(status, 202, "{q}");
    let suspend_build = q["build_id"].as_str().unwrap().to_string();
    let b = s.build(&suspend_build).await;
    assert_eq!(
        (b["trigger"].clone(), b["suspended"].clone()),
        (json!("action:suspend"), json!(true))
    );
    assert_eq!(
        b["configuration"],
        mastodon("alice.example.org"),
        "the last successful configuration"
    );
    let (d, _) = read_with_etag(&s, "alice").await;
    assert_eq!(d["suspended"], true);
    assert_eq!(reason(&d, "deploy"), "suspended");
    assert_eq!(reason(&d, "suspend"), "build_pending");
    assert_eq!(reason(&d, "resume"), "build_pending");
    let (status, e) = s
        .submit(
            "alice",
            json!({"configuration": mastodon("alice.example.org")}),
        )
        .await;
    assert_eq!(
        (status, e["reason"].clone()),
        (409, json!("suspended")),
        "{e}"
    );
    s.wait_build(&suspend_build, "succeeded").await;
    // The local deployer publishes no names for a suspended node.
    assert!(s.log_text(&suspend_build).await.contains("suspended"));
    let (d, _) = read_with_etag(&s, "alice").await;
    assert_eq!(reason(&d, "suspend"), "already_suspended");
    assert_eq!(reason(&d, "resume"), Value::Null);

    let (status, q) = action(&s, "alice", "resume", None).await;
    assert_eq!(status, 202, "{q}");
    let b = s
        .wait_build(q["build_id"].as_str().unwrap(), "succeeded")
        .await;
    assert_eq!(
        (b["trigger"].clone(), b["suspended"].clone()),
        (json!("action:resume"), json!(false))
    );
    let (d, _) = read_with_etag(&s, "alice").await;
    assert_eq!(
        (d["suspended"].clone(), d["state"].clone()),
        (json!(false), json!("active"))
    );

    let (status, e) = action(&s, "alice", "reboot", None).await;
    assert_eq!(status, 404, "an unknown action: {e}");
    let (status, e) = action(&s, "nobody", "suspend", None).await;
    assert_eq!(status, 404, "an unknown deployment: {e}");

    // A destroy carries the flag, and clears it when it succeeds.
    let (status, q) = action(&s, "alice", "suspend", None).await;
    assert_eq!(status, 202, "{q}");
    s.wait_build(q["build_id"].as_str().unwrap(), "succeeded")
        .await;
    let (status, del) = read(s.delete("/v1/deployments/alice").send().await.unwrap()).await;
    assert_eq!(status, 202, "{del}");
    let destroy = s
        .wait_build(del["build_id"].as_str().unwrap(), "succeeded")
        .await;
    assert_eq!(destroy["suspended"], true);
    let (d, _) = read_with_etag(&s, "alice").await;
    assert_eq!(
        (d["suspended"].clone(), d["state"].clone()),
        (json!(false), json!("idle"))
    );
}

#[tokio::test]
async fn an_action_the_deployed_revision_lacks_is_unsupported() {
    let dir = temp_dir("no-actions");
    let deployer = rev_deployer(&dir, "{}", "none");
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let b = s.submit_ok("bob", json!({"domain": "bob.org"})).await;
    s.wait_build(&b, "succeeded").await;
    let (d, _) = read_with_etag(&s, "bob").await;
    assert_eq!(reason(&d, "suspend"), "unsupported_by_revision");
    assert_eq!(
        reason(&d, "resume"),
        "not_suspended",
        "the state reason comes first"
    );
    let (status, e) = action(&s, "bob", "suspend", None).await;
    assert_eq!(
        (status, e["reason"].clone()),
        (409, json!("unsupported_by_revision")),
        "{e}"
    );
}

#[tokio::test]
async fn update_policies_are_checked_and_honour_if_match() {
    let s = Server::start(Options::default()).await;
    let b = s.submit_ok("carol", mastodon("carol.example.org")).await;
    s.wait_build(&b, "succeeded").await;
    let window = |tz: &str, day: Value, start: &str, minutes: u32| json!({"kind": "window", "frequency": "weekly", "day": day, "start": start, "duration_minutes": minutes, "time_zone": tz});
    let bad = [
        (
            window("Europe/Atlantis", json!(1), "03:00", 60),
            "/time_zone",
        ),
        (
            window("europe/amsterdam", json!(1), "03:00", 60),
            "/time_zone",
        ),
        (window("Europe/Amsterdam", json!(8), "03:00", 60), "/day"),
        (window("Europe/Amsterdam", json!(1), "25:00", 60), "/start"),
        (
            window("Europe/Amsterdam", json!(1), "03:00", 14),
            "/duration_minutes",
        ),
        (
            window("Europe/Amsterdam", json!(1), "03:00", 1441),
            "/duration_minutes",
        ),
        (json!({"kind": "sometimes"}), ""),
        // A kind without settings takes none (serde alone would ignore them).
        (json!({"kind": "manual", "day": 3}), ""),
        (json!({"kind": "automatic", "time_zone": "UTC"}), ""),
    ];
    let (before, _) = read_with_etag(&s, "carol").await;
    for (policy, pointer) in bad {
        let (status, e) = put_policy(&s, "carol", &policy, None).await;
        assert_eq!(status, 400, "{policy}: {e}");
        assert_eq!(e["fields"][0]["pointer"], pointer, "{e}");
    }
    // The same checks on submit, under /update_policy.
    let (status, e) = s
        .submit(
            "carol",
            json!({"configuration": mastodon("carol.example.org"), "update_policy": window("Mars/Base", json!(1), "03:00", 60)}),
        )
        .await;
    assert_eq!(
        (status, e["fields"][0]["pointer"].clone()),
        (400, json!("/update_policy/time_zone")),
        "{e}"
    );
    let (after, etag) = read_with_etag(&s, "carol").await;
    assert_eq!(
        after["revision"], before["revision"],
        "a refusal changed the deployment"
    );

    let good = window("Europe/Amsterdam", json!(7), "03:00", 120);
    let (status, e) = put_policy(&s, "carol", &good, Some("\"1\"")).await;
    assert_eq!(
        (status, e["code"].clone()),
        (412, json!("precondition_failed")),
        "{e}"
    );
    let (status, d) = put_policy(&s, "carol", &good, Some(&etag)).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["update_policy"], good);
    assert_eq!(
        d["revision"].as_u64(),
        before["revision"].as_u64().map(|r| r + 1)
    );
    assert_eq!(
        d["update"]["available"], false,
        "no --default-source: never available"
    );
    assert_eq!(d["update"]["default_source"], Value::Null);

    // A submit without a policy keeps it; an explicit source is refused
    // while it is not manual.
    let b = s.submit_ok("carol", mastodon("carol.example.org")).await;
    s.wait_build(&b, "succeeded").await;
    let (d, _) = read_with_etag(&s, "carol").await;
    assert_eq!(d["update_policy"], good);
    let (status, e) = s
        .submit(
            "carol",
            json!({"configuration": mastodon("carol.example.org"), "source": d["source"]}),
        )
        .await;
    assert_eq!(
        (status, e["reason"].clone()),
        (409, json!("policy_not_manual")),
        "{e}"
    );
}

#[tokio::test]
async fn an_automatic_update_runs_once_across_two_restarts() {
    let dir = temp_dir("auto-update");
    let options = |rev| {
        Options::default()
            .arg("--default-source")
            .arg(&pin(rev))
            .arg("--update-interval")
            .arg("1s")
    };
    let mut s = Server::start_in(dir, options('a')).await;
    let (status, q) = s
        .submit(
            "dave",
            json!({"configuration": mastodon("dave.example.org"), "update_policy": {"kind": "automatic"}}),
        )
        .await;
    assert_eq!(status, 202, "{q}");
    s.wait_build(q["build_id"].as_str().unwrap(), "succeeded")
        .await;
    let (d, _) = read_with_etag(&s, "dave").await;
    assert_eq!(d["update"]["available"], false);
    assert_eq!(d["update"]["last_automatic"], Value::Null);

    // The operator ships revision b by restarting with it, twice.
    for restart in 0..2 {
        s.kill();
        s.args = options('b').args;
        s.launch().await;
        eventually("the automatic update ran", || async {
            automatic_builds(&s, "dave").await.len() == 1
        })
        .await;
        let update = automatic_builds(&s, "dave").await.remove(0);
        s.wait_build(update["id"].as_str().unwrap(), "succeeded")
            .await;
        // Three passes of the loop: nothing more starts.
        update_passes(&s, 3).await;
        assert_eq!(
            automatic_builds(&s, "dave").await.len(),
            1,
            "restart {restart}"
        );
        let (d, _) = read_with_etag(&s, "dave").await;
        let last = &d["update"]["last_automatic"];
        assert_eq!(last["result"], "succeeded", "{d}");
        assert_eq!(last["source"]["rev"], "b");
        assert_eq!(last["build_id"], update["id"]);
        assert_eq!(d["deployed"]["source"]["rev"], "b");
        assert_eq!(d["update"]["available"], false);
    }
}

#[tokio::test]
async fn a_failed_update_waits_for_a_new_policy_and_an_open_window() {
    let dir = temp_dir("window-update");
    let deployer = rev_deployer(&dir, BOTH_ACTIONS, "b");
    let options = |rev| {
        Options::default()
            .deployer(&deployer)
            .arg("--default-source")
            .arg(&pin(rev))
            .arg("--update-interval")
            .arg("1s")
    };
    let mut s = Server::start_in(dir.clone(), options('a')).await;
    let (status, q) = s
        .submit(
            "erin",
            // Without the automatic rollback: this is the failed update's
            // own story (safe_deploys.rs tells the one with it).
            json!({"configuration": {"domain": "erin.org"}, "update_policy": {"kind": "automatic"}, "auto_rollback": false}),
        )
        .await;
    assert_eq!(status, 202, "{q}");
    s.wait_build(q["build_id"].as_str().unwrap(), "succeeded")
        .await;

    s.kill();
    s.args = options('b').args;
    s.launch().await;
    eventually("the automatic update ran", || async {
        automatic_builds(&s, "erin").await.len() == 1
    })
    .await;
    let first = automatic_builds(&s, "erin").await.remove(0);
    s.wait_build(first["id"].as_str().unwrap(), "failed").await;
    let (d, _) = read_with_etag(&s, "erin").await;
    assert_eq!(d["update"]["available"], true);
    assert_eq!(d["update"]["last_automatic"]["result"], "failed", "{d}");
    assert_eq!(d["update"]["last_automatic"]["reason"], "exit_status");

    // FR-016: keep_deployed_revision previews and submits against what is
    // deployed (rev a), not the default source (rev b).
    let body = |keep: bool| json!({"configuration": {"domain": "erin.org"}, "keep_deployed_revision": keep});
    let (status, p) = read(
        s.post("/v1/deployments/erin/preview", &body(true))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status, p["nodes"][0]["name"].clone()),
        (200, json!("rev-a")),
        "{p}"
    );
    let (status, p) = read(
        s.post("/v1/deployments/erin/preview", &body(false))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status, p["nodes"][0]["name"].clone()),
        (200, json!("rev-b")),
        "{p}"
    );
    let (status, q) = s.submit("erin", body(true)).await;
    assert_eq!(status, 202, "{q}");
    let kept = s
        .wait_build(q["build_id"].as_str().unwrap(), "succeeded")
        .await;
    assert_eq!(kept["source"]["rev"], "a");

    // Active again on rev a, but rev b was tried under this policy.
    update_passes(&s, 3).await;
    assert_eq!(
        automatic_builds(&s, "erin").await.len(),
        1,
        "tried twice under one policy"
    );

    // A new policy allows a new try, but only inside its window.
    let now = time::OffsetDateTime::now_utc();
    let at = |t: time::OffsetDateTime| format!("{:02}:{:02}", t.hour(), t.minute());
    let window = |start: String| json!({"kind": "window", "frequency": "daily", "start": start, "duration_minutes": 60, "time_zone": "UTC"});
    let (status, d) = put_policy(
        &s,
        "erin",
        &window(at(now + time::Duration::hours(6))),
        None,
    )
    .await;
    assert_eq!(status, 200, "{d}");
    update_passes(&s, 3).await;
    assert_eq!(
        automatic_builds(&s, "erin").await.len(),
        1,
        "an update started while its window was closed"
    );
    let (status, d) = put_policy(
        &s,
        "erin",
        &window(at(now - time::Duration::minutes(10))),
        None,
    )
    .await;
    assert_eq!(status, 200, "{d}");
    eventually("the update ran in its window", || async {
        automatic_builds(&s, "erin").await.len() == 2
    })
    .await;
}

#[tokio::test]
async fn a_destroy_queues_past_the_queue_limit() {
    let dir = temp_dir("destroy-queues");
    let (deployer, gates) = gated_deployer(&dir);
    let s = Server::start(
        Options::default()
            .deployer(&deployer)
            .arg("--max-queued-builds")
            .arg("1"),
    )
    .await;
    let running = s.submit_ok("fred", json!({"domain": "fred.org"})).await;
    s.wait_build(&running, "running").await;
    let queued = s.submit_ok("fred", json!({"domain": "fred.org"})).await;
    let (status, e) = s
        .submit(
            "fred",
            json!({"configuration": {"domain": "fred.org"}, "mode": "enqueue"}),
        )
        .await;
    assert_eq!(
        (status, e["reason"].clone()),
        (409, json!("queue_limit")),
        "{e}"
    );
    let (status, del) = read(s.delete("/v1/deployments/fred").send().await.unwrap()).await;
    assert_eq!(status, 202, "a delete must always queue: {del}");
    // Each build waits at the gate in turn: open it until the queued one
    // has run.
    eventually("the queued build to succeed", || {
        open_gate(&gates, "fred");
        let build = s.build(&queued);
        async move { build.await["status"] == "succeeded" }
    })
    .await;
    s.wait_build(del["build_id"].as_str().unwrap(), "final")
        .await;
}
