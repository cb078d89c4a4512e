//! Hostile input, round two: one callback-authorized tenant must not see,
//! steer or starve another (api.md "Authentication", "Pagination", "Fair
//! shares"). A callback that knows two tenants, alice and bob, each allowed
//! on their own deployments only; loopback only, bounded loops.

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use crate::harness::*;

/// alice may do anything on deployments named `alice*` except change an
/// update policy; bob on `bob*`, policies included. Both may list and ask
/// for stream tickets. Records every question.
fn two_tenants() -> (JsonHandler, Arc<Mutex<Vec<Value>>>) {
    let asked = Arc::new(Mutex::new(Vec::new()));
    let log = asked.clone();
    let handler: JsonHandler = Arc::new(move |q: Value| {
        log.lock().unwrap().push(q.clone());
        let deployment = q["deployment"].as_str().unwrap_or("");
        let server_wide =
            q["deployment"].is_null() && (q["procedure"] == "read" || q["procedure"] == "stream");
        let answer = match q["token"].as_str() {
            Some("alice-token") => {
                let allow = server_wide
                    || deployment.starts_with("alice") && q["procedure"] != "update_policy";
                json!({"allow": allow, "subject": "alice@example.org"})
            }
            Some("bob-token") => {
                let allow = server_wide || deployment.starts_with("bob");
                json!({"allow": allow, "subject": "bob@example.org"})
            }
            _ => json!({"allow": false}),
        };
        (200, answer)
    });
    (handler, asked)
}

async fn with_tenants(opts: Options) -> (Server, Arc<Mutex<Vec<Value>>>) {
    let (handler, asked) = two_tenants();
    let (url, _server) = json_server(handler).await;
    // The callback server lives as long as the test's runtime.
    std::mem::forget(_server);
    (
        Server::start(opts.arg("--authz-url").arg(&url)).await,
        asked,
    )
}

async fn as_tenant(s: &Server, token: &str, r: reqwest::RequestBuilder) -> (u16, Value) {
    let _ = s;
    read(r.bearer_auth(token).send().await.unwrap()).await
}

/// Item 2: a submit that carries an update policy (or `auto_rollback`)
/// needs `update_policy` too.
#[tokio::test]
async fn a_submit_cannot_change_the_policy_its_caller_may_not() {
    let (s, _) = with_tenants(Options::default()).await;
    let submit = |body: Value| {
        s.http
            .post(s.url("/v1/deployments/alice/submit"))
            .json(&body)
    };
    let (status, p) = as_tenant(
        &s,
        "alice-token",
        submit(json!({"configuration": mastodon("a.org")})),
    )
    .await;
    assert_eq!(status, 202, "{p}");
    let put = s
        .http
        .put(s.url("/v1/deployments/alice/update-policy"))
        .json(&json!({"kind": "automatic"}));
    assert_eq!(as_tenant(&s, "alice-token", put).await.0, 403);
    for extra in [
        json!({"update_policy": {"kind": "automatic"}}),
        json!({"auto_rollback": false}),
    ] {
        let mut body = json!({"configuration": mastodon("a.org"), "mode": "enqueue"});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, p) = as_tenant(&s, "alice-token", submit(body)).await;
        assert_eq!(
            (status, p["code"].as_str()),
            (403, Some("forbidden")),
            "{p}"
        );
    }
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(
        d["update_policy"],
        json!({"kind": "manual"}),
        "the policy changed"
    );
    assert_eq!(d["auto_rollback"], true);
    let (_, builds) = s.json("/v1/deployments/alice/builds").await;
    assert_eq!(
        builds["items"].as_array().unwrap().len(),
        1,
        "a refused submit queued a build"
    );
    // bob may: his submit with a policy goes through.
    let bob = s
        .http
        .post(s.url("/v1/deployments/bob/submit"))
        .json(&json!({"configuration": mastodon("b.org"), "update_policy": {"kind": "automatic"}}));
    assert_eq!(as_tenant(&s, "bob-token", bob).await.0, 202);
}

/// Item 1, berth's side: a deployer's result naming a node that is not a
/// DNS label is a protocol error (the name would reach SBOM routes and a
/// deployer's paths), in eval and in deploy alike.
#[tokio::test]
async fn a_result_with_a_node_name_that_is_not_a_dns_label_is_refused() {
    let dir = temp_dir("node-names");
    let body = format!(
        r#"{SCRIPT_PRELUDE}
printf '%s' '{{"nodes":[{{"name":"../../etc/x","changed":true}}]}}' > "$BERTH_RESULT"
"#
    );
    let deployer = script(&dir, "names.sh", &body);
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let b = s.submit_ok("alice", json!({"domain": "a.org"})).await;
    let end = s.wait_build(&b, "final").await;
    assert_eq!(end["failure"]["reason"], "deployer_protocol", "{end}");
    let (_, sboms) = s.json("/v1/deployments/alice/sboms").await;
    assert_eq!(sboms["nodes"], json!([]));
}

async fn ticket(s: &Server, token: &str, channel: &str) -> (u16, Value) {
    let r = s
        .http
        .post(s.url("/v1/stream-tickets"))
        .json(&json!({"channel": channel}));
    as_tenant(s, token, r).await
}

/// Item 5: one tenant cannot take every stream ticket: past its share, its
/// own oldest ticket goes, and the other tenant still gets one.
#[tokio::test]
async fn one_tenant_cannot_take_every_stream_ticket() {
    let (s, _) = with_tenants(Options::default().arg("--max-tickets-per-caller").arg("5")).await;
    s.submit_ok("bob", mastodon("b.org")).await;
    let channel = "/v1/deployments/bob/events";
    let mut mine = Vec::new();
    for _ in 0..8 {
        let (status, t) = ticket(&s, "bob-token", channel).await;
        assert_eq!(status, 200, "{t}");
        mine.push(t["ticket"].as_str().unwrap().to_string());
    }
    let opens = |t: &str| {
        let url = s.url(&format!("{channel}?ticket={t}"));
        let http = s.http.clone();
        async move { http.get(url).send().await.unwrap().status().as_u16() }
    };
    for old in &mine[..3] {
        assert_eq!(
            opens(old).await,
            401,
            "a ticket past the caller's share still opens"
        );
    }
    assert_eq!(opens(&mine[7]).await, 200);
    let (status, _) = ticket(&s, "alice-token", "/v1/deployments/alice/events").await;
    assert_eq!(status, 200, "the other tenant gets a ticket");
}

/// Item 6: one tenant cannot fill every stream: past its share its own
/// next stream is refused, while the service token still opens one and the
/// probes answer.
#[tokio::test]
async fn one_tenant_cannot_fill_every_stream() {
    let (s, _) = with_tenants(
        Options::default()
            .arg("--max-streams-per-caller")
            .arg("3")
            .arg("--max-sse-clients")
            .arg("10"),
    )
    .await;
    s.submit_ok("bob", mastodon("b.org")).await;
    let stream = |token: &str| {
        s.http
            .get(s.url("/v1/deployments/bob/events"))
            .bearer_auth(token)
            .send()
    };
    let mut open = Vec::new();
    for _ in 0..3 {
        let r = stream("bob-token").await.unwrap();
        assert_eq!(r.status(), 200);
        open.push(r);
    }
    let (status, p) = read(stream("bob-token").await.unwrap()).await;
    assert_eq!(
        (status, p["reason"].as_str()),
        (503, Some("caller_stream_limit")),
        "{p}"
    );
    let service = stream(&s.token).await.unwrap();
    assert_eq!(service.status(), 200, "the service token is locked out");
    assert_eq!(
        s.http.get(s.url("/healthz")).send().await.unwrap().status(),
        200
    );
    // A stream that closes gives its share back.
    drop(open.pop());
    let mut reopened = false;
    for _ in 0..50 {
        if stream("bob-token").await.unwrap().status() == 200 {
            reopened = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(reopened, "a closed stream's share did not come back");
}

/// Item 4: list cursors reveal nothing their caller may not read: walking
/// the list one by one, every cursor names a deployment of the caller's,
/// and a guessed id never makes a cursor appear.
#[tokio::test]
async fn list_cursors_leak_no_hidden_id() {
    let (s, _) = with_tenants(Options::default()).await;
    for id in ["alice1", "bob1", "alice2", "bob2", "bob3", "alice3"] {
        s.submit_ok(id, json!({"domain": format!("{id}.org")}))
            .await;
    }
    let list = |query: String| s.http.get(s.url(&format!("/v1/deployments?{query}")));
    let mut seen = Vec::new();
    let mut query = "limit=1".to_string();
    for _ in 0..10 {
        let (status, page) = as_tenant(&s, "alice-token", list(query.clone())).await;
        assert_eq!(status, 200, "{page}");
        for item in page["items"].as_array().unwrap() {
            seen.push(item["id"].as_str().unwrap().to_string());
        }
        let Some(cursor) = page["next_cursor"].as_str() else {
            break;
        };
        // The position a cursor carries is one alice was shown.
        let payload = cursor.split('.').next().unwrap();
        let named =
            String::from_utf8(berth::hex::decode(payload).unwrap_or_default()).unwrap_or_default();
        assert!(
            named.is_empty() || named.starts_with("alice"),
            "a cursor names {named}"
        );
        query = format!("limit=1&cursor={cursor}");
    }
    assert_eq!(seen, ["alice1", "alice2", "alice3"]);
    // A guess: bob2 exists, ghost does not; neither may be told apart.
    for guess in ["bob2", "ghost"] {
        let (_, page) = as_tenant(
            &s,
            "alice-token",
            list(format!("id={guess}&id=alice2&limit=1")),
        )
        .await;
        assert_eq!(page["items"].as_array().unwrap().len(), 1, "{page}");
        assert_eq!(page["next_cursor"], Value::Null, "{guess}: {page}");
    }
}

/// Item 9: a reader that does not read pins a few chunks, never the log:
/// eight stalled `Range: bytes=0-` readers of a 64 MiB log keep berth
/// under 50 MiB above what it held before them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_range_readers_do_not_pin_the_log() {
    let dir = temp_dir("stalled-range");
    // 64 MiB of log: 1 MiB lines of 1023 characters each, 65,536 lines.
    let body = format!(
        "{SCRIPT_PRELUDE}\nyes \"$(head -c 1023 /dev/zero | tr '\\0' x)\" | head -n 65536\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"\n"
    );
    let deployer = script(&dir, "big-log.sh", &body);
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let b = s.submit_ok("big", json!({})).await;
    let end = s.wait_build(&b, "final").await;
    assert_eq!(end["log_bytes"], 64 * 1024 * 1024, "{end}");
    let head = format!("GET /v1/builds/{b}/log HTTP/1.1\r\nRange: bytes=0-");
    let (before, after, stalled) = stalled_readers(&s, &head, "HTTP/1.1 206").await;
    let grown_mib = after.saturating_sub(before) / 1024;
    println!("RSS with 8 stalled Range readers of a 64 MiB log: {before} KiB before, {after} KiB after (+{grown_mib} MiB)");
    assert!(
        grown_mib < 50,
        "8 stalled readers grew berth by {grown_mib} MiB"
    );
    drop(stalled);
}

/// Eight connections that send `request_head` (its first line and any
/// headers but Host and Authorization), read the answer's first bytes
/// (which must start with `status_line`) and then stop reading: berth's
/// RSS before them and two seconds after, and the sockets (kept open).
async fn stalled_readers(
    s: &Server,
    request_head: &str,
    status_line: &str,
) -> (u64, u64, Vec<tokio::net::TcpStream>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let before = s.rss_kib();
    let address = s.base.trim_start_matches("http://").to_string();
    let mut stalled = Vec::new();
    for _ in 0..8 {
        let mut sock = tokio::net::TcpStream::connect(&address).await.unwrap();
        let request = format!(
            "{request_head}\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n",
            s.token
        );
        sock.write_all(request.as_bytes()).await.unwrap();
        // Read the head only, then stop reading.
        let mut head = [0u8; 512];
        let n = sock.read(&mut head).await.unwrap();
        assert!(
            String::from_utf8_lossy(&head[..n]).starts_with(status_line),
            "{}",
            String::from_utf8_lossy(&head[..n])
        );
        stalled.push(sock);
    }
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    (before, s.rss_kib(), stalled)
}

/// Item 9, the SBOM document: eight stalled readers of a 32 MiB document
/// keep berth under 50 MiB above what it held before them (each held the
/// whole rebuilt document before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_sbom_readers_do_not_pin_the_document() {
    let dir = temp_dir("stalled-sbom");
    // 32,768 distinct components of about 1 KiB each.
    let filler = "x".repeat(1000);
    let components: Vec<Value> = (0..32_768)
        .map(|i| json!({"type": "library", "name": format!("c{i}"), "description": filler}))
        .collect();
    let doc = json!({"bomFormat": "CycloneDX", "specVersion": "1.5", "components": components});
    let sbom = dir.join("big.cdx.json");
    std::fs::write(&sbom, doc.to_string()).unwrap();
    assert!(std::fs::metadata(&sbom).unwrap().len() > 32 * 1024 * 1024);
    let body = format!(
        "{SCRIPT_PRELUDE}\ncp {sbom} \"$BERTH_SCRATCH_DIR/web.cdx.json\"\nprintf '%s' '{{\"nodes\":[{{\"name\":\"web\",\"changed\":true,\"sbom\":{{\"status\":\"ready\",\"path\":\"web.cdx.json\"}}}}]}}' > \"$BERTH_RESULT\"\n",
        sbom = sbom.display()
    );
    let deployer = script(&dir, "big-sbom.sh", &body);
    let mut s = Server::start(Options::default().deployer(&deployer)).await;
    let b = s.submit_ok("big", json!({})).await;
    let end = s.wait_build(&b, "final").await;
    assert_eq!(end["status"], "succeeded", "{end}\n{}", s.log());
    let (_, list) = s.json("/v1/deployments/big/sboms").await;
    assert_eq!(list["nodes"][0]["status"], "ready", "{list}");
    // A fresh process, so what the store took to keep the document is not
    // counted and not there for the readers to reuse.
    s.kill();
    s.launch().await;
    let (before, after, stalled) = stalled_readers(
        &s,
        "GET /v1/deployments/big/sboms/web HTTP/1.1",
        "HTTP/1.1 200",
    )
    .await;
    let grown_mib = after.saturating_sub(before) / 1024;
    println!("RSS with 8 stalled readers of a 32 MiB SBOM: {before} KiB before, {after} KiB after (+{grown_mib} MiB)");
    assert!(
        grown_mib < 50,
        "8 stalled SBOM readers grew berth by {grown_mib} MiB"
    );
    // A reader that reads gets the whole document, value-equal.
    let whole: Value = s
        .get("/v1/deployments/big/sboms/web")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(whole, doc);
    drop(stalled);
}

/// Item 11: a known actor's denials are each an audit event (audit.md
/// keeps them), and `/metrics` counts them per principal, so an operator
/// sees one tenant doing it.
#[tokio::test]
async fn a_tenants_denials_are_counted_per_principal() {
    let (s, _) = with_tenants(Options::default()).await;
    for _ in 0..3 {
        let r = s
            .http
            .post(s.url("/v1/deployments/bob/submit"))
            .json(&json!({"configuration": mastodon("b.org")}));
        assert_eq!(as_tenant(&s, "alice-token", r).await.0, 403);
    }
    let metrics = s.metrics().await;
    assert!(
        metrics.contains("berth_denied_calls_total{principal=\"alice@example.org\"} 3"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("principal=\"bob@example.org\""),
        "{metrics}"
    );
}

/// Item 7: an id berth could not have made is refused before the callback
/// sees it (so nothing of it is sent or cached): a 16 KiB id from a caller
/// the callback does not know is a 400, and the callback is never asked.
#[tokio::test]
async fn an_invalid_id_never_reaches_the_callback() {
    let (s, asked) = with_tenants(Options::default()).await;
    let long = "a".repeat(16 * 1024);
    for path in [
        format!("/v1/deployments/{long}"),
        format!("/v1/deployments/{long}/submit"),
    ] {
        let r = s.http.get(s.url(&path)).bearer_auth("stranger-token");
        let r = if path.ends_with("/submit") {
            s.http
                .post(s.url(&path))
                .bearer_auth("stranger-token")
                .json(&json!({"configuration": {}}))
        } else {
            r
        };
        let (status, p) = read(r.send().await.unwrap()).await;
        assert_eq!(
            (status, p["fields"][0]["pointer"].as_str()),
            (400, Some("/path/id")),
            "{p}"
        );
    }
    let questions = asked.lock().unwrap().clone();
    assert!(
        questions
            .iter()
            .all(|q| q["deployment"].as_str().is_none_or(|d| d.len() <= 40)),
        "the callback was asked about an invalid id"
    );
    assert!(questions.is_empty(), "{questions:?}");
}
