//! Bad input gets the documented error, stores nothing, and the server
//! keeps serving.

use serde_json::{json, Value};

use crate::harness::*;

async fn assert_nothing_stored(s: &Server) {
    let (status, list) = s.json("/v1/deployments").await;
    assert_eq!(status, 200);
    assert_eq!(list["items"], json!([]), "a refused call stored something");
}

fn assert_problem(body: &Value, code: &str) {
    assert_eq!(body["code"], code, "{body}");
    assert!(
        body["request_id"].as_str().is_some_and(|r| !r.is_empty()),
        "{body}"
    );
    assert!(body["message"].is_string());
}

#[tokio::test]
async fn refused_submits_store_nothing_and_never_echo_values() {
    let s = Server::start(Options::default()).await;
    let secret = "s3cr3t-value-XYZ";
    let long_id = "a".repeat(41);
    // (id, body, status, code, the field it names: pointer and rule; an eval's
    // refusal names none, its text is in `deployer_message`).
    type Case<'a> = (&'a str, Vec<u8>, u16, &'a str, Option<(&'a str, &'a str)>);
    let cases: Vec<Case> = vec![
        ("alice", b"[1,2]".to_vec(), 400, "invalid_request", Some(("", "type"))),
        ("alice", b"{\"configuration\": {\"domain\": ".to_vec(), 400, "invalid_request", Some(("", "malformed_json"))),
        ("alice", json!({"configuration": {}, secret: 1}).to_string().into_bytes(), 400, "invalid_request", Some(("", "unknown_field"))),
        ("alice", json!({"configuration": secret}).to_string().into_bytes(), 400, "invalid_request", Some(("/configuration", "type"))),
        ("alice", json!({"configuration": {}, "mode": secret}).to_string().into_bytes(), 400, "invalid_request", Some(("/mode", "enum"))),
        ("Alice", json!({"configuration": {}}).to_string().into_bytes(), 400, "invalid_request", Some(("/path/id", "deployment_id"))),
        (&long_id, json!({"configuration": {}}).to_string().into_bytes(), 400, "invalid_request", Some(("/path/id", "deployment_id"))),
        ("-alice", json!({"configuration": {}}).to_string().into_bytes(), 400, "invalid_request", Some(("/path/id", "deployment_id"))),
        // Schema: enable must be a boolean.
        ("alice", json!({"configuration": {"domain": "a.org", "applications": {"mastodon": {"enable": secret}}}}).to_string().into_bytes(), 422, "invalid_configuration", Some(("/configuration/applications/mastodon/enable", "type"))),
        // Eval: an enabled application needs a domain.
        ("alice", json!({"configuration": {"applications": {"mastodon": {"enable": true}}}}).to_string().into_bytes(), 422, "invalid_configuration", None),
        // A method the source does not give.
        ("alice", json!({"configuration": {"method": "nixos", "domain": "a.org"}}).to_string().into_bytes(), 422, "invalid_configuration", Some(("/configuration/method", "method"))),
        ("alice", json!({"configuration": {"deployment": {"tofu": {"domain": secret}}}}).to_string().into_bytes(), 422, "invalid_configuration", Some(("/configuration/deployment/tofu", "method"))),
        // Shape: domain must be a string.
        ("alice", json!({"configuration": {"domain": 7}}).to_string().into_bytes(), 422, "invalid_configuration", Some(("/configuration/domain", "type"))),
        ("alice", json!({"configuration": {"domain": "a.org", "x": "nul\u{0}here"}}).to_string().into_bytes(), 422, "invalid_configuration", Some(("/configuration", "nul_character"))),
    ];
    for (id, body, status, code, field) in cases {
        let r = s
            .http
            .post(s.url(&format!("/v1/deployments/{id}/submit")))
            .bearer_auth(&s.token)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let (got, problem) = read(r).await;
        assert_eq!(
            got,
            status,
            "{} -> {problem}",
            String::from_utf8_lossy(&body)
        );
        assert_problem(&problem, code);
        let fields = problem["fields"].as_array().cloned().unwrap_or_default();
        match field {
            Some((pointer, rule)) => {
                assert_eq!(fields.len(), 1, "{problem}");
                assert_eq!(fields[0]["pointer"], pointer, "{problem}");
                assert_eq!(fields[0]["code"], rule, "{problem}");
            }
            None => {
                assert!(fields.is_empty(), "{problem}");
                assert!(problem["deployer_message"].is_string(), "{problem}");
            }
        }
        assert!(
            !problem.to_string().contains(secret),
            "the error echoes a request value: {problem}"
        );
    }
    assert_nothing_stored(&s).await;

    // Pointers name the place of a schema error; the eval's own text is shown.
    let (_, p) = s.submit("alice", json!({"configuration": {"domain": "a.org", "applications": {"mastodon": {"enable": "yes"}}}})).await;
    assert_eq!(
        p["fields"][0]["pointer"], "/configuration/applications/mastodon/enable",
        "{p}"
    );
    assert_eq!(p["fields"][0]["code"], "type");
    let (_, p) = s
        .submit(
            "alice",
            json!({"configuration": {"applications": {"mastodon": {"enable": true}}}}),
        )
        .await;
    assert!(
        p["deployer_message"]
            .as_str()
            .unwrap()
            .contains("needs a domain"),
        "{p}"
    );
    let (_, p) = s
        .submit("alice", json!({"configuration": {"method": "nixos"}}))
        .await;
    assert_eq!(p["fields"][0]["pointer"], "/configuration/method", "{p}");

    // The server still serves.
    s.submit_ok("alice", mastodon("a.org")).await;
}

#[tokio::test]
async fn transport_errors() {
    let mut s = Server::start(Options::default().arg("--max-body").arg("1048576")).await;
    // 2 MiB body: 413.
    let big = vec![b' '; 2 * 1024 * 1024];
    let r = s
        .http
        .post(s.url("/v1/deployments/alice/submit"))
        .bearer_auth(&s.token)
        .header("content-type", "application/json")
        .body(big)
        .send()
        .await
        .unwrap();
    let (status, p) = read(r).await;
    assert_eq!(status, 413);
    assert_problem(&p, "payload_too_large");
    // Not JSON: 415.
    // The 413 closed that connection before reading the body: a new client,
    // so the next requests do not race the close on a pooled connection.
    s.http = client();
    let r = s
        .http
        .post(s.url("/v1/deployments/alice/submit"))
        .bearer_auth(&s.token)
        .header("content-type", "text/plain")
        .body("{}")
        .send()
        .await
        .unwrap();
    let (status, p) = read(r).await;
    assert_eq!(status, 415);
    assert_problem(&p, "unsupported_media_type");
    // Unknown route: 404; wrong method: 405 with Allow.
    let (status, p) = s.json("/v1/nothing-here").await;
    assert_eq!(status, 404);
    assert_problem(&p, "not_found");
    let r = s
        .http
        .put(s.url("/v1/deployments/alice"))
        .bearer_auth(&s.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    let allow = r.headers()["allow"].to_str().unwrap().to_string();
    assert!(allow.contains("GET") && allow.contains("DELETE"), "{allow}");
    // No token, wrong token: 401.
    let r = s.http.get(s.url("/v1/deployments")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = s
        .http
        .get(s.url("/v1/deployments"))
        .bearer_auth("not-the-token")
        .send()
        .await
        .unwrap();
    let (status, p) = read(r).await;
    assert_eq!(status, 401);
    assert_problem(&p, "unauthenticated");
    // A valid request id is echoed; an invalid one is replaced.
    let r = s
        .http
        .get(s.url("/v1/deployments/nobody"))
        .bearer_auth(&s.token)
        .header("x-request-id", "ingress-42.a_b")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-request-id"], "ingress-42.a_b");
    let (status, p) = read(r).await;
    assert_eq!(
        (status, p["request_id"].as_str()),
        (404, Some("ingress-42.a_b"))
    );
    let r = s
        .http
        .get(s.url("/healthz"))
        .header("x-request-id", "bad id!")
        .send()
        .await
        .unwrap();
    assert_ne!(r.headers()["x-request-id"], "bad id!");
    // Unknown build, cancel of a finished one.
    let (status, _) = s.json("/v1/builds/not-a-build").await;
    assert_eq!(status, 404);
    assert_nothing_stored(&s).await;
}

#[tokio::test]
async fn delete_errors() {
    let s = Server::start(
        Options::default()
            .arg("--callback-origin")
            .arg("https://panel.example.org"),
    )
    .await;
    let (status, p) = read(s.delete("/v1/deployments/ghost").send().await.unwrap()).await;
    assert_eq!(status, 404);
    assert_problem(&p, "not_found");
    s.submit_ok("alice", mastodon("a.org")).await;
    let bad = s
        .delete("/v1/deployments/alice")
        .json(&json!({"callback": "https://evil.example.com/hook"}))
        .send()
        .await
        .unwrap();
    let (status, p) = read(bad).await;
    assert_eq!(status, 400);
    assert_eq!(p["fields"][0]["code"], "callback_origin_not_allowed", "{p}");
    assert_eq!(p["fields"][0]["pointer"], "/callback", "{p}");
    let (_, builds) = s.json("/v1/deployments/alice/builds").await;
    assert_eq!(
        builds["items"].as_array().unwrap().len(),
        1,
        "a refused delete queued something"
    );
    // What the served document's pattern refuses, the server refuses too:
    // a fragment, a space, an origin spelled otherwise than configured.
    for callback in [
        "https://panel.example.org/hooks/x#frag",
        "https://panel.example.org/hooks/a b",
        "https://panel.example.org:443/hooks/x",
    ] {
        let bad = s
            .delete("/v1/deployments/alice")
            .json(&json!({ "callback": callback }))
            .send()
            .await
            .unwrap();
        let (status, p) = read(bad).await;
        assert_eq!(status, 400, "{callback:?} was taken: {p}");
        assert_eq!(p["fields"][0]["code"], "pattern", "{p}");
        assert!(
            !p.to_string().contains(callback),
            "the error echoes the request: {p}"
        );
    }
    let (_, builds) = s.json("/v1/deployments/alice/builds").await;
    assert_eq!(builds["items"].as_array().unwrap().len(), 1);
    let ok = s
        .delete("/v1/deployments/alice")
        .json(&json!({"callback": "https://panel.example.org/hooks/x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 202);
}

#[tokio::test]
async fn idempotency_keys_replay_and_conflict() {
    let s = Server::start(Options::default()).await;
    let body = json!({"configuration": mastodon("a.org"), "mode": "enqueue"});
    let send = |b: &Value, key: &str| {
        s.post("/v1/deployments/alice/submit", b)
            .header("Idempotency-Key", key)
            .send()
    };
    let first = send(&body, "key-0000000000000001").await.unwrap();
    assert_eq!(first.status(), 202);
    assert!(first.headers().contains_key("idempotency-expires-at"));
    let (_, first) = read(first).await;
    let again = send(&body, "key-0000000000000001").await.unwrap();
    assert_eq!(again.status(), 202);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let (_, again) = read(again).await;
    assert_eq!(first, again);
    let (_, builds) = s.json("/v1/deployments/alice/builds").await;
    assert_eq!(
        builds["items"].as_array().unwrap().len(),
        1,
        "a replay ran the submit again"
    );
    // Same key, other body: 409, nothing happens.
    let other = json!({"configuration": mastodon("b.org"), "mode": "enqueue"});
    let (status, p) = read(send(&other, "key-0000000000000001").await.unwrap()).await;
    assert_eq!(status, 409);
    assert_eq!(p["code"], "idempotency_conflict");
    // A refusal (4xx) is stored too and replayed.
    let bad = json!({"configuration": {"domain": 1}});
    let (s1, p1) = read(send(&bad, "key-0000000000000002").await.unwrap()).await;
    let r2 = send(&bad, "key-0000000000000002").await.unwrap();
    assert_eq!(r2.headers()["idempotent-replayed"], "true");
    let (s2, p2) = read(r2).await;
    assert_eq!((s1, &p1), (s2, &p2));
    // Two at once: one runs, the other replays it.
    let fresh = json!({"configuration": mastodon("c.org"), "mode": "enqueue"});
    let (a, b) = tokio::join!(
        send(&fresh, "key-0000000000000003"),
        send(&fresh, "key-0000000000000003")
    );
    let (a, b) = (read(a.unwrap()).await, read(b.unwrap()).await);
    assert_eq!(a, b);
    let (_, builds) = s.json("/v1/deployments/alice/builds").await;
    assert_eq!(builds["items"].as_array().unwrap().len(), 2);
    // A malformed key is refused.
    let (status, p) = read(send(&fresh, "short").await.unwrap()).await;
    assert_eq!(status, 400);
    assert_eq!(p["fields"][0]["pointer"], "/headers/idempotency-key", "{p}");
    assert_eq!(p["fields"][0]["code"], "format", "{p}");
}
