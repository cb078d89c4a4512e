//! A full deploy then delete with the embedded `local` deployer (SC-001),
//! previews, logs, lists and the derived fields of a deployment.

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

/// A one-shot HTTP server that answers 200 and hands back what it got.
async fn callback_sink() -> (String, tokio::sync::oneshot::Receiver<String>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = sock.read(&mut chunk).await.unwrap();
            buf.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&buf).to_string();
            if let Some(i) = text.find("\r\n\r\n") {
                let len: usize = text
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse().unwrap())
                    })
                    .unwrap_or(0);
                if buf.len() >= i + 4 + len || n == 0 {
                    break;
                }
            }
        }
        sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let _ = tx.send(String::from_utf8_lossy(&buf).to_string());
    });
    (format!("http://{addr}"), rx)
}

#[tokio::test]
async fn deploy_then_delete_with_the_local_deployer() {
    let (sink, received) = callback_sink().await;
    let s = Server::start(Options::default().arg("--callback-origin").arg(&sink)).await;
    let config = json!({"domain": "alice.example.org", "applications": {"mastodon": {"enable": true}, "forgejo": {"enable": true}}});
    let build = s.submit_ok("alice", config.clone()).await;
    let b = s.wait_build(&build, "final").await;
    assert_eq!(b["status"], "succeeded", "{b}\n{}", s.log());
    assert_eq!(b["exit_code"], 0);
    assert!(b["job_id"].as_str().unwrap().starts_with("pid:"));
    assert!(b["log_lines"].as_u64().unwrap() > 5);
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["state"], "active", "{d}");
    assert_eq!(d["deployed"]["configuration"], config);
    assert_eq!(d["configuration"], config);
    let git = d["deployed_instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "forgejo")
        .unwrap()
        .clone();
    assert_eq!(git["url"], "https://git.alice.example.org/");
    let log = s.log_text(&build).await;
    assert!(log.contains("activating node mastodon"), "{log}");
    assert!(log.contains("deployment alice is active\n"), "{log}");
    // The local deployer checks health: the build ends confirmed.
    assert!(
        log.ends_with("[berth] health step: every changed node is healthy; confirmed\n"),
        "{log}"
    );
    assert_eq!(log.len() as u64, b["log_bytes"].as_u64().unwrap());
    // The work dir holds the rendered nodes.
    let nodes = s.dir.join("data/work/alice/nodes");
    assert!(nodes.join("mastodon.json").exists() && nodes.join("base.json").exists());

    // A second deploy of the same configuration changes nothing.
    let again = s.submit_ok("alice", config.clone()).await;
    s.wait_build(&again, "succeeded").await;
    assert!(s
        .log_text(&again)
        .await
        .contains("node mastodon is up to date"));

    let r = s
        .delete("/v1/deployments/alice")
        .json(&json!({"callback": format!("{sink}/hooks/destroyed")}))
        .send()
        .await
        .unwrap();
    let (status, body) = read(r).await;
    assert_eq!(status, 202);
    assert_eq!(body["status"], "queued");
    let destroy = body["build_id"].as_str().unwrap().to_string();
    let b = s.wait_build(&destroy, "final").await;
    assert_eq!(b["status"], "succeeded");
    assert_eq!(b["kind"], "destroy");
    assert_eq!(b["trigger"], "delete");
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["state"], "idle");
    assert_eq!(d["deployed"], Value::Null);
    assert_eq!(d["deployed_instances"], json!([]));
    assert!(
        !s.dir.join("data/work/alice").exists(),
        "the work dir outlived the destroy"
    );

    let request = tokio::time::timeout(std::time::Duration::from_secs(20), received)
        .await
        .expect("callback")
        .unwrap();
    assert!(request.starts_with("POST /hooks/destroyed"), "{request}");
    let body = request.split("\r\n\r\n").nth(1).unwrap();
    let v: Value = serde_json::from_str(body).unwrap();
    assert_eq!(
        v,
        json!({"deployment": "alice", "build_id": destroy, "status": "destroyed"})
    );
    let secret = std::fs::read(s.dir.join("data/callback-secret")).unwrap();
    let sig_line = request
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("berth-signature:"))
        .unwrap();
    let expected = berth::engine::callbacks::signature(&secret, body.as_bytes());
    assert_eq!(sig_line.split_once(':').unwrap().1.trim(), expected);
}

#[tokio::test]
async fn preview_list_log_range_and_failed_deploy() {
    let s = Server::start(Options::default().env("BERTH_LOCAL_FAIL", "pixelfed")).await;
    let r = s.post("/v1/deployments/new/preview", &json!({"configuration": {"domain": "a.org", "applications": {"mastodon": {"enable": true}, "homepage": {"enable": true}}}})).send().await.unwrap();
    let (status, p) = read(r).await;
    assert_eq!(status, 200, "{p}");
    assert_eq!(
        p["nodes"],
        json!([{"name": "base", "names": []}, {"name": "mastodon", "names": ["mastodon.a.org"]}, {"name": "homepage", "names": ["a.org"]}])
    );
    let (status, _) = s.json("/v1/deployments/new").await;
    assert_eq!(status, 404, "a preview stored something");

    // A failing node fails the deploy; the log says why.
    let b = s
        .submit_ok(
            "broken",
            json!({"domain": "b.org", "applications": {"pixelfed": {"enable": true}}}),
        )
        .await;
    let b = s.wait_build(&b, "final").await;
    assert_eq!(b["status"], "failed");
    assert_eq!(b["failure"]["reason"], "exit_status");
    assert_eq!(b["exit_code"], 1);
    let log = s.log_text(b["id"].as_str().unwrap()).await;
    assert!(log.contains("activation of node pixelfed failed"), "{log}");
    let (_, d) = s.json("/v1/deployments/broken").await;
    assert_eq!(d["state"], "failed");
    assert_eq!(d["deployed"], Value::Null);

    // Range requests resume a log.
    let id = b["id"].as_str().unwrap();
    let r = s
        .get(&format!("/v1/builds/{id}/log"))
        .header("range", "bytes=10-")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(r.text().await.unwrap(), log[10..]);
    let r = s
        .get(&format!("/v1/builds/{id}/log"))
        .header("range", format!("bytes={}-", log.len()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 416);
    let r = s
        .get(&format!("/v1/builds/{id}/log"))
        .header("range", "bytes=0-1,4-5")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    // Lists: id filter, order, pagination with a cursor bound to the filter.
    for id in ["d3", "d1", "d2"] {
        s.submit_ok(id, json!({"domain": null})).await;
    }
    let (_, page) = s.json("/v1/deployments?limit=2").await;
    let ids: Vec<&str> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["broken", "d1"]);
    let cursor = page["next_cursor"].as_str().unwrap().to_string();
    let (_, page2) = s
        .json(&format!("/v1/deployments?limit=2&cursor={cursor}"))
        .await;
    let ids: Vec<&str> = page2["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["d2", "d3"]);
    assert_eq!(page2["next_cursor"], Value::Null);
    let (status, p) = s
        .json(&format!("/v1/deployments?limit=2&id=d1&cursor={cursor}"))
        .await;
    assert_eq!(status, 400);
    assert_eq!(p["fields"][0]["code"], "cursor_invalid");
    let (status, _) = s.json(&format!("/v1/deployments?cursor=00{cursor}")).await;
    assert_eq!(status, 400);
    let (_, filtered) = s.json("/v1/deployments?id=d3&id=ghost&id=d1").await;
    let ids: Vec<&str> = filtered["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["d1", "d3"]);
    let (status, _) = s.json("/v1/deployments?limit=0").await;
    assert_eq!(status, 400);
    // `id` values are deployment ids (so `id=a,b` is not two ids), and a
    // cursor of one filter is refused for another.
    let (status, p) = s.json("/v1/deployments?id=d1,d3").await;
    assert_eq!(
        (status, p["fields"][0]["pointer"].clone()),
        (400, json!("/query/id")),
        "{p}"
    );
    let (_, page) = s.json("/v1/deployments?id=d1&id=d2&id=d3&limit=1").await;
    let filtered_cursor = page["next_cursor"].as_str().unwrap().to_string();
    let (status, _) = s
        .json(&format!(
            "/v1/deployments?id=d1&id=d2&id=d3&limit=1&cursor={filtered_cursor}"
        ))
        .await;
    assert_eq!(status, 200);
    let (status, p) = s
        .json(&format!(
            "/v1/deployments?id=d1&id=d2&limit=1&cursor={filtered_cursor}"
        ))
        .await;
    assert_eq!(
        (status, p["fields"][0]["code"].clone()),
        (400, json!("cursor_invalid"))
    );

    // Builds newest first, paged.
    let second = s.submit_ok("d1", json!({"domain": null})).await;
    let (_, builds) = s.json("/v1/deployments/d1/builds?limit=1").await;
    assert_eq!(builds["items"][0]["id"], second);
    let c = builds["next_cursor"].as_str().unwrap();
    let (_, older) = s
        .json(&format!("/v1/deployments/d1/builds?limit=1&cursor={c}"))
        .await;
    assert_eq!(older["items"].as_array().unwrap().len(), 1);
    assert_ne!(older["items"][0]["id"], second);
    let (status, _) = s.json("/v1/deployments/ghost/builds").await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn deployment_fields_across_shapes() {
    // The second deploy fails (pixelfed), so the collapsed one stays deployed.
    let s = Server::start(Options::default().env("BERTH_LOCAL_FAIL", "pixelfed")).await;
    let collapsed = json!({"deployment": {"local": {"domain": "a.org", "applications": {"mastodon": {"enable": true}}}}});
    let b = s.submit_ok("shapes", collapsed.clone()).await;
    s.wait_build(&b, "succeeded").await;
    let flat = json!({"domain": "a.org", "applications": {"mastodon": {"enable": false}, "pixelfed": {"enable": true}}});
    let (_, d0) = s.json("/v1/deployments/shapes").await;
    assert_eq!(d0["deployed_instances"], d0["instances"]);
    let failing = s.submit_ok_without_rollback("shapes", flat.clone()).await;
    assert_eq!(s.wait_build(&failing, "final").await["status"], "failed");
    let (_, d) = s.json("/v1/deployments/shapes").await;
    assert_eq!(
        d["deployed"]["configuration"], collapsed,
        "stored exactly as submitted"
    );
    assert_eq!(d["domain"], "a.org");
    let en = |list: &Value, name: &str| {
        list.as_array()
            .unwrap()
            .iter()
            .find(|i| i["name"] == name)
            .unwrap()["enabled"]
            .clone()
    };
    assert_eq!(en(&d["instances"], "pixelfed"), true);
    assert_eq!(en(&d["instances"], "mastodon"), false);
    assert_eq!(en(&d["deployed_instances"], "mastodon"), true);
    // Public derive routes, no token.
    let r = s
        .http
        .post(s.url("/v1/derive/sections"))
        .json(&json!({"configuration": flat, "deployed": collapsed}))
        .send()
        .await
        .unwrap();
    let (status, v) = read(r).await;
    assert_eq!(status, 200, "{v}");
    let m = &v["sections"][0];
    assert_eq!(m["name"], "mastodon");
    assert_eq!(
        m["deployed_path"],
        "/deployment/local/applications/mastodon"
    );
    assert_eq!(m["changed"], true);
    let r = s
        .http
        .post(s.url("/v1/derive/applications"))
        .json(&json!({"draft": flat, "deployed": collapsed}))
        .send()
        .await
        .unwrap();
    let (_, v) = read(r).await;
    assert_eq!(
        v,
        json!({"draft_path": "/applications", "deployed_path": "/deployment/local/applications", "changed": ["mastodon", "pixelfed"]})
    );
    let r = s
        .http
        .post(s.url("/v1/derive/instances"))
        .json(&json!({"configuration": {"domain": "z.org"}}))
        .send()
        .await
        .unwrap();
    let (_, v) = read(r).await;
    assert_eq!(v["domain"], "z.org");
    assert_eq!(v["instances"].as_array().unwrap().len(), 6);
    // Malformed shapes and renames: 400 with the pointer, never 500.
    for (route, body, pointer) in [
        (
            "/v1/derive/instances",
            json!({"configuration": {"applications": []}}),
            "/configuration/applications",
        ),
        (
            "/v1/derive/sections",
            json!({"configuration": {}, "deployed": {"deployment": {}}}),
            "/deployed/deployment",
        ),
        (
            "/v1/derive/applications",
            json!({"draft": {}, "renames": [{"from": "x", "to": "/y"}]}),
            "/renames/0/from",
        ),
        ("/v1/derive/applications", json!({"draft": 5}), "/draft"),
    ] {
        let (status, p) = read(s.http.post(s.url(route)).json(&body).send().await.unwrap()).await;
        assert_eq!(status, 400, "{route} {p}");
        assert_eq!(p["fields"][0]["pointer"], pointer, "{p}");
    }
}

#[tokio::test]
async fn cancelling_a_local_deploy_stops_it_between_steps() {
    let s = Server::start(Options::default().env("BERTH_LOCAL_STEP_MS", "300")).await;
    let config = json!({"domain": "a.org", "applications": {"mastodon": {"enable": true}, "pixelfed": {"enable": true}, "forgejo": {"enable": true}}});
    let id = s.submit_ok("alice", config).await;
    s.wait_build(&id, "running").await;
    eventually("the deploy is under way", || async {
        s.log_text(&id).await.contains("evaluating node base")
    })
    .await;
    s.post(&format!("/v1/builds/{id}/cancel"), &json!({}))
        .send()
        .await
        .unwrap();
    let b = s.wait_build(&id, "final").await;
    assert_eq!(b["status"], "cancelled");
    let log = s.log_text(&id).await;
    assert!(
        log.contains("received SIGTERM: stopping between steps"),
        "{log}"
    );
    assert!(!log.contains("deployment alice is active"), "{log}");
    // The state file it leaves is whole JSON.
    let state = std::fs::read_to_string(s.dir.join("data/work/alice/state.json"))
        .unwrap_or_else(|_| "{}".into());
    serde_json::from_str::<Value>(&state).expect("a consistent state file");
}

#[tokio::test]
async fn a_verbose_deploy_is_capped_not_failed() {
    let dir = temp_dir("cap");
    let deployer = script(&dir, "d.sh", &format!("{SCRIPT_PRELUDE}\nseq 1 1000 | sed 's/^/line /'\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\""));
    let s = Server::start_in(
        dir,
        Options::default()
            .deployer(&deployer)
            .arg("--max-log-bytes")
            .arg("1000"),
    )
    .await;
    let id = s.submit_ok("alice", json!({})).await;
    let b = s.wait_build(&id, "final").await;
    assert_eq!(
        b["status"], "succeeded",
        "a deploy must not fail because it was verbose"
    );
    let log = s.log_text(&id).await;
    let last = log.lines().last().unwrap();
    assert!(
        last.starts_with("[berth] ")
            && last.contains("not stored: the log reached --max-log-bytes"),
        "{last}"
    );
    // Lines up to the cap are kept whole, in order.
    assert!(log.starts_with("line 1\nline 2\n"));
    assert!(log.len() <= 1000 + last.len() + 1);
    assert_eq!(b["log_bytes"].as_u64().unwrap() as usize, log.len());
}
