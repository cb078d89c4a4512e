//! The audit chain and the authorization callback (audit.md, api.md
//! "Authentication"): the events each audited call leaves, denials, the
//! callback's decisions, `berth audit verify` against a tamper matrix on a
//! store the real binary wrote, proofs, and a witness that checks signed
//! checkpoints and consistency between pushes.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use crate::harness::*;

const ALICE: &str = "alice@example.org";

/// A call with the service token acting for alice, tagged with a request id.
fn as_alice(r: reqwest::RequestBuilder, request_id: &str) -> reqwest::RequestBuilder {
    r.header("x-actor-subject", ALICE)
        .header("x-actor-issuer", "https://id.example.org")
        .header("x-request-id", request_id)
}

/// Every event of alice, oldest first, keyed by request id.
async fn alice_events(s: &Server) -> Vec<Value> {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!(
            "/v1/audit?actor_subject={}&actor_issuer={}&limit=7",
            "alice%40example.org", "https%3A%2F%2Fid.example.org"
        );
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let (status, page) = s.json(&path).await;
        assert_eq!(status, 200, "{page}");
        out.extend(page["items"].as_array().unwrap().iter().cloned());
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    out.reverse();
    out
}

/// `berth audit push-head` of the store in `data` to `sink`: (exit code, output).
fn push_head(sink: &str, data: &Path) -> (i32, String) {
    berth(&[
        "audit",
        "push-head",
        "--sink",
        sink,
        "--data-dir",
        data.to_str().unwrap(),
    ])
}

#[tokio::test]
async fn every_audited_route_leaves_exactly_its_events_good_and_bad() {
    let dir = temp_dir("audit-routes");
    let (deployer, gates) = gated_deployer(&dir);
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let post = |path: &str, body: &Value, rid: &str| as_alice(s.post(path, body), rid);
    let send = |r: reqwest::RequestBuilder| async move { read(r.send().await.unwrap()).await };

    let (st, first) = send(post(
        "/v1/deployments/alice/submit",
        &json!({"configuration": mastodon("a.org")}),
        "r-submit",
    ))
    .await;
    assert_eq!(st, 202, "{first}");
    let b1 = first["build_id"].as_str().unwrap().to_string();
    let (st, second) = send(post(
        "/v1/deployments/alice/submit",
        &json!({"configuration": mastodon("a.org"), "mode": "enqueue"}),
        "r-enqueue",
    ))
    .await;
    assert_eq!(st, 202, "{second}");
    let b2 = second["build_id"].as_str().unwrap().to_string();
    let (st, _) = send(post(
        &format!("/v1/builds/{b2}/cancel"),
        &json!({}),
        "r-cancel",
    ))
    .await;
    assert_eq!(st, 202);
    // Bad JSON, an unknown field, a bad id: invalid, and nothing changes.
    let bad_json = as_alice(
        s.http
            .post(s.url("/v1/deployments/alice/submit"))
            .bearer_auth(&s.token)
            .header("content-type", "application/json")
            .body("{"),
        "r-badjson",
    );
    assert_eq!(send(bad_json).await.0, 400);
    assert_eq!(
        send(post(
            "/v1/deployments/alice/submit",
            &json!({"configuration": {}, "colour": "red"}),
            "r-unknown"
        ))
        .await
        .0,
        400
    );
    assert_eq!(
        send(post(
            "/v1/deployments/Bad_Id/submit",
            &json!({"configuration": {}}),
            "r-badid"
        ))
        .await
        .0,
        400
    );
    assert_eq!(
        send(post(
            "/v1/deployments/alice/submit",
            &json!({"configuration": mastodon("a.org")}),
            "r-full"
        ))
        .await
        .0,
        409
    );
    open_gate(&gates, "alice");
    s.wait_build(&b1, "succeeded").await;
    let (st, acted) = send(post(
        "/v1/deployments/alice/actions/suspend",
        &json!({}),
        "r-suspend",
    ))
    .await;
    assert_eq!(st, 202, "{acted}");
    let b3 = acted["build_id"].as_str().unwrap().to_string();
    assert_eq!(
        send(post(
            "/v1/deployments/alice/actions/frobnicate",
            &json!({}),
            "r-frob"
        ))
        .await
        .0,
        404
    );
    let put = |body: &Value, rid: &str| {
        as_alice(
            s.http
                .put(s.url("/v1/deployments/alice/update-policy"))
                .bearer_auth(&s.token)
                .json(body),
            rid,
        )
    };
    assert_eq!(
        send(put(&json!({"kind": "manual"}), "r-policy")).await.0,
        200
    );
    assert_eq!(send(put(&json!([]), "r-badpolicy")).await.0, 400);
    assert_eq!(
        send(post(
            &format!("/v1/builds/{b1}/cancel"),
            &json!({}),
            "r-cancel-done"
        ))
        .await
        .0,
        409
    );
    assert_eq!(
        send(post(
            "/v1/builds/not-a-build/cancel",
            &json!({}),
            "r-cancel-none"
        ))
        .await
        .0,
        404
    );
    assert_eq!(
        send(as_alice(s.delete("/v1/deployments/Bad_Id"), "r-baddelete"))
            .await
            .0,
        400
    );
    let (st, deleted) = send(as_alice(s.delete("/v1/deployments/alice"), "r-delete")).await;
    assert_eq!(st, 202, "{deleted}");
    // An idempotent replay is the same call: no second event.
    for _ in 0..2 {
        let r = post(
            "/v1/deployments/bob/submit",
            &json!({"configuration": mastodon("b.org")}),
            "r-idem",
        )
        .header("idempotency-key", "key-0123456789abcdef");
        assert_eq!(send(r).await.0, 202);
    }

    let events = alice_events(&s).await;
    let by_request: HashMap<&str, &Value> = events
        .iter()
        .map(|e| (e["request_id"].as_str().unwrap(), e))
        .collect();
    assert_eq!(
        by_request.len(),
        events.len(),
        "one event per call: {events:#?}"
    );
    let expect = [
        (
            "r-submit",
            "submit",
            "ok",
            Value::Null,
            json!("alice"),
            json!(b1),
        ),
        (
            "r-enqueue",
            "submit",
            "ok",
            Value::Null,
            json!("alice"),
            json!(b2),
        ),
        (
            "r-cancel",
            "cancel",
            "ok",
            Value::Null,
            json!("alice"),
            json!(b2),
        ),
        (
            "r-badjson",
            "submit",
            "invalid",
            json!("invalid_request"),
            json!("alice"),
            Value::Null,
        ),
        (
            "r-unknown",
            "submit",
            "invalid",
            json!("invalid_request"),
            json!("alice"),
            Value::Null,
        ),
        (
            "r-badid",
            "submit",
            "invalid",
            json!("invalid_request"),
            Value::Null,
            Value::Null,
        ),
        (
            "r-full",
            "submit",
            "refused",
            json!("queue_full"),
            json!("alice"),
            Value::Null,
        ),
        (
            "r-suspend",
            "action:suspend",
            "ok",
            Value::Null,
            json!("alice"),
            json!(b3),
        ),
        (
            "r-frob",
            "action",
            "refused",
            json!("not_found"),
            json!("alice"),
            Value::Null,
        ),
        (
            "r-policy",
            "update_policy",
            "ok",
            Value::Null,
            json!("alice"),
            Value::Null,
        ),
        (
            "r-badpolicy",
            "update_policy",
            "invalid",
            json!("invalid_request"),
            json!("alice"),
            Value::Null,
        ),
        (
            "r-cancel-done",
            "cancel",
            "refused",
            json!("build_finished"),
            json!("alice"),
            json!(b1),
        ),
        (
            "r-cancel-none",
            "cancel",
            "refused",
            json!("not_found"),
            Value::Null,
            Value::Null,
        ),
        (
            "r-baddelete",
            "delete",
            "invalid",
            json!("invalid_request"),
            Value::Null,
            Value::Null,
        ),
        (
            "r-delete",
            "delete",
            "ok",
            Value::Null,
            json!("alice"),
            deleted["build_id"].clone(),
        ),
        (
            "r-idem",
            "submit",
            "ok",
            Value::Null,
            json!("bob"),
            Value::Null,
        ),
    ];
    assert_eq!(events.len(), expect.len(), "{events:#?}");
    for (rid, action, result, reason, deployment, build) in expect {
        let e = by_request
            .get(rid)
            .unwrap_or_else(|| panic!("no event for {rid}: {events:#?}"));
        assert_eq!(e["action"], action, "{rid}: {e}");
        assert_eq!(e["result"], result, "{rid}: {e}");
        assert_eq!(e["reason"], reason, "{rid}: {e}");
        assert_eq!(e["deployment"], deployment, "{rid}: {e}");
        if rid != "r-idem" {
            assert_eq!(e["build"], build, "{rid}: {e}");
        }
        assert_eq!(e["actor"]["subject"], ALICE);
        assert_eq!(e["trusted_backend"], true);
        assert_eq!(e["count"], 1);
    }
    // The chain links each event to the one before.
    let (code, report) = verify_json(&s.dir.join("data"));
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["size"], events.len() as u64);

    // A non-ASCII actor header is a 400, never the service acting alone.
    let r = s
        .post(
            "/v1/deployments/alice/submit",
            &json!({"configuration": {}}),
        )
        .header(
            "x-actor-subject",
            reqwest::header::HeaderValue::from_bytes("zoë".as_bytes()).unwrap(),
        )
        .header("x-request-id", "r-nonascii");
    let (st, e) = send(r).await;
    assert_eq!(st, 400, "{e}");
    // The deployment read shows its events (denied calls left out), newest
    // first, the bad header's among them with no actor.
    let (_, d) = s.json("/v1/deployments/alice").await;
    let shown: Vec<&str> = d["audit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["request_id"].as_str().unwrap())
        .collect();
    assert_eq!(shown.first(), Some(&"r-nonascii"), "{shown:?}");
    assert!(
        shown.contains(&"r-submit") && !shown.contains(&"r-idem"),
        "{shown:?}"
    );
    let metrics = s.metrics().await;
    assert!(metrics.contains("berth_audit_events_total 17"), "{metrics}");
}

#[tokio::test]
async fn anonymous_denials_fold_and_a_known_actors_each_count() {
    let s = Server::start(Options::default().arg("--audit-denial-interval").arg("3s")).await;
    let started = std::time::Instant::now();
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (http, url, sent) = (
            s.http.clone(),
            s.url("/v1/deployments/x/submit"),
            sent.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 10_000 {
                let r = http
                    .post(&url)
                    .bearer_auth("not-a-token")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 401);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let took = started.elapsed();
    // The folded count of the last interval is written once it ends.
    let data = s.dir.join("data");
    eventually("the folded count is written", || {
        let data = data.clone();
        async move {
            verify_json(&data).1["size"]
                .as_u64()
                .is_some_and(|n| n >= 2)
        }
    })
    .await;
    let (code, report) = verify_json(&data);
    assert_eq!(code, 0, "{report}");
    let events = report["size"].as_u64().unwrap();
    // At most two events per interval begun (the first, then the fold).
    let intervals = took.as_secs() / 3 + 2;
    assert!(
        events <= intervals * 2,
        "{events} events for 10,000 denials in {took:?}"
    );
    assert!(
        events >= 2,
        "the first denial and the folded count: {report}"
    );
    println!("10,000 anonymous denials in {took:?} left {events} audit events");
}

/// The test's authorization callback: alice may do anything on `alice`
/// and read her own audit; mallory is known and denied; other tokens are
/// unknown. Records every question.
fn callback() -> (JsonHandler, Arc<Mutex<Vec<Value>>>) {
    let asked = Arc::new(Mutex::new(Vec::new()));
    let log = asked.clone();
    let handler: JsonHandler = Arc::new(move |q: Value| {
        log.lock().unwrap().push(q.clone());
        let answer = match q["token"].as_str() {
            Some("alice-token") => {
                let allow = q["deployment"] == "alice"
                    || q["procedure"] == "read" && q["deployment"].is_null()
                    || q["procedure"] == "audit_read" && q["target_actor"]["subject"] == ALICE
                    || q["procedure"] == "stream" && q["deployment"].is_null();
                json!({"allow": allow, "subject": ALICE, "issuer": "https://id.example.org"})
            }
            Some("mallory-token") => json!({"allow": false, "subject": "mallory@example.org"}),
            _ => json!({"allow": false}),
        };
        (200, answer)
    });
    (handler, asked)
}

#[tokio::test]
async fn the_callback_decides_and_a_callback_that_is_down_denies() {
    let (handler, asked) = callback();
    let (url, cb) = json_server(handler).await;
    let s = Server::start(Options::default().arg("--authz-url").arg(&url)).await;
    s.submit_ok("bob", mastodon("bob.org")).await;
    let with = |token: &str, r: reqwest::RequestBuilder| r.bearer_auth(token);
    let submit = |token: &str, id: &str| {
        let r = s
            .http
            .post(s.url(&format!("/v1/deployments/{id}/submit")))
            .json(&json!({"configuration": mastodon("a.org")}));
        with(token, r)
    };
    let (st, e) = read(submit("alice-token", "alice").send().await.unwrap()).await;
    assert_eq!(st, 202, "{e}");
    let read_as = |token: &str, path: &str| with(token, s.http.get(s.url(path)));
    assert_eq!(
        read_as("alice-token", "/v1/deployments/alice")
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    // A denied read is a 404: nobody can probe which ids exist.
    assert_eq!(
        read_as("alice-token", "/v1/deployments/bob")
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    let (_, list) = read(
        read_as("alice-token", "/v1/deployments")
            .send()
            .await
            .unwrap(),
    )
    .await;
    let ids: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["alice"], "lists are filtered through read");
    assert_eq!(
        submit("alice-token", "bob").send().await.unwrap().status(),
        403
    );
    assert_eq!(
        submit("mallory-token", "alice")
            .send()
            .await
            .unwrap()
            .status(),
        403
    );
    assert_eq!(
        submit("nobody-token", "alice")
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(submit("", "alice").send().await.unwrap().status(), 401);
    // audit_read is asked with the target actor.
    let (st, mine) = read(
        read_as(
            "alice-token",
            "/v1/audit?actor_subject=alice%40example.org&actor_issuer=https%3A%2F%2Fid.example.org",
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(st, 200, "{mine}");
    assert_eq!(
        read_as("alice-token", "/v1/audit?actor_subject=bob")
            .send()
            .await
            .unwrap()
            .status(),
        403
    );
    {
        let asked = asked.lock().unwrap();
        let q = asked
            .iter()
            .find(|q| q["procedure"] == "audit_read")
            .unwrap();
        assert_eq!(q["target_actor"]["subject"], ALICE, "{q}");
        let q = asked.iter().find(|q| q["procedure"] == "submit").unwrap();
        assert_eq!(q["method"], "POST");
        assert_eq!(q["path"], "/v1/deployments/alice/submit");
    }
    // Alice's denial is her own event, with her as actor; mallory's too.
    let events = alice_events(&s).await;
    let results: Vec<(&str, &str)> = events
        .iter()
        .map(|e| (e["action"].as_str().unwrap(), e["result"].as_str().unwrap()))
        .collect();
    assert_eq!(
        results,
        [("submit", "ok"), ("submit", "denied")],
        "{events:#?}"
    );
    assert_eq!(events[1]["deployment"], "bob");
    assert_eq!(events[1]["trusted_backend"], false);
    let (_, mallory) = s
        .json("/v1/audit?actor_subject=mallory%40example.org")
        .await;
    assert_eq!(mallory["items"][0]["result"], "denied", "{mallory}");
    assert_eq!(mallory["items"][0]["reason"], "forbidden");

    // The callback goes down: every callback token is denied; alice (known
    // from a recent answer) still gets her own event, an unknown token is
    // an anonymous 401.
    cb.abort();
    let _ = cb.await;
    let r = s
        .http
        .post(s.url("/v1/deployments/alice/actions/suspend"))
        .bearer_auth("alice-token")
        .json(&json!({}));
    assert_eq!(r.send().await.unwrap().status(), 403);
    assert_eq!(
        submit("stranger-token", "alice")
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    let events = alice_events(&s).await;
    let last = events.last().unwrap();
    assert_eq!(
        (last["action"].as_str(), last["result"].as_str()),
        (Some("action:suspend"), Some("denied")),
        "{events:#?}"
    );
    assert!(
        s.log().contains("authorization callback failed"),
        "the failure is logged"
    );
}

/// Opens a stopped server's store file and runs `edit` in one write
/// transaction.
fn edit_store(data: &Path, edit: impl FnOnce(&redb::WriteTransaction)) {
    let db = redb::Database::create(data.join("berth.redb")).unwrap();
    let txn = db.begin_write().unwrap();
    edit(&txn);
    txn.commit().unwrap();
}

fn problems(report: &Value) -> Vec<(u64, String)> {
    report["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["seq"].as_u64().unwrap(),
                p["kind"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The witness of the test: keeps the last head it accepted, checks each
/// checkpoint's signature with berth's public key and the consistency
/// proof from its last head.
struct Witness {
    verifier: signed_note::StandardVerifier,
    last: Mutex<Option<(u64, String)>>,
}

impl Witness {
    fn check(&self, body: &Value) -> Result<(), String> {
        use berth::audit::merkle;
        let note = signed_note::Note::from_bytes(
            body["checkpoint"]
                .as_str()
                .ok_or("no checkpoint")?
                .as_bytes(),
        )
        .map_err(|e| e.to_string())?;
        let list = signed_note::VerifierList::new(vec![Box::new(self.verifier.clone())]);
        note.verify(&list).map_err(|e| format!("signature: {e}"))?;
        let text = String::from_utf8(note.text().to_vec()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let size: u64 = lines[1].parse().unwrap();
        use base64::Engine as _;
        let root = hex_of(
            &base64::engine::general_purpose::STANDARD
                .decode(lines[2])
                .unwrap(),
        );
        let mut last = self.last.lock().unwrap();
        if let Some((old_size, old_root)) = last.as_ref() {
            let c = &body["consistency"];
            if c["from"] != *old_size
                || c["from_root"] != *old_root
                || c["to"] != size
                || c["to_root"] != root
            {
                return Err("the consistency proof does not start at my last head".into());
            }
            let path = hashes(&c["path"]);
            if !merkle::verify_consistency(*old_size, size, &hash(old_root), &hash(&root), &path) {
                return Err("the consistency proof does not verify".into());
            }
        }
        *last = Some((size, root));
        Ok(())
    }
}

fn hex_of(b: &[u8]) -> String {
    berth::hex::encode(b)
}

pub fn hash(h: &str) -> [u8; 32] {
    berth::hex::decode(h)
        .and_then(|bytes| bytes.try_into().ok())
        .unwrap_or_else(|| panic!("not a 32-byte hash in hex: {h}"))
}

/// A proof's path: a JSON array of hashes in hex.
fn hashes(path: &Value) -> Vec<berth::audit::merkle::Hash> {
    path.as_array()
        .unwrap()
        .iter()
        .map(|h| hash(h.as_str().unwrap()))
        .collect()
}

/// The inclusion proof `p` answered for `seq` at `size` verifies against
/// the root it names, which it returns.
pub fn inclusion_verifies(p: &Value, seq: u64, size: u64) -> berth::audit::merkle::Hash {
    use berth::audit::merkle;
    assert_eq!(p["leaf_index"], seq - 1, "{p}");
    let path = hashes(&p["path"]);
    let leaf = merkle::leaf_hash(&hash(p["event_hash"].as_str().unwrap()));
    let root = hash(p["root"].as_str().unwrap());
    assert!(
        merkle::verify_inclusion(seq - 1, size, &leaf, &path, &root),
        "{p}"
    );
    root
}

async fn some_events(s: &Server, n: usize, tag: &str) {
    for i in 0..n {
        let r = as_alice(
            s.post(
                &format!("/v1/deployments/{tag}-{i}/submit"),
                &json!({"configuration": mastodon("a.org")}),
            ),
            &format!("{tag}-{i}"),
        );
        assert_eq!(r.send().await.unwrap().status(), 202);
    }
}

// Multi-threaded: the witness answers while `berth audit push-head` blocks
// this test's thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_finds_each_tampering_and_the_witness_catches_a_rewrite() {
    use berth::store::tables::{AUDIT_EVENTS, META};
    let mut s = Server::start(Options::default()).await;
    let data = s.dir.join("data");
    let (code, public_key) = berth(&["audit", "public-key", "--data-dir", data.to_str().unwrap()]);
    assert_eq!(code, 0);
    let witness = Arc::new(Witness {
        verifier: signed_note::StandardVerifier::new(public_key.trim())
            .expect("a C2SP verifier key"),
        last: Mutex::new(None),
    });
    let w = witness.clone();
    let (sink, _sink_task) = json_server(Arc::new(move |body: Value| match w.check(&body) {
        Ok(()) => (200, json!({"ok": true})),
        Err(e) => (409, json!({"error": e})),
    }))
    .await;
    let push = |data: &Path| push_head(&sink, data).0;

    some_events(&s, 6, "one").await;
    // verify passes while the server writes events.
    let writer = {
        let (http, url, token) = (s.http.clone(), s.url(""), s.token.clone());
        tokio::spawn(async move {
            for i in 0..40 {
                let r = http
                    .post(format!("{url}/v1/deployments/busy-{i}/submit"))
                    .bearer_auth(&token)
                    .json(&json!({"configuration": mastodon("a.org")}));
                let _ = r.send().await;
            }
        })
    };
    for _ in 0..5 {
        let (code, report) = verify_json(&data);
        assert_eq!(code, 0, "verify while the server writes: {report}");
    }
    writer.await.unwrap();
    assert_eq!(push(&data), 0, "first push");
    some_events(&s, 4, "two").await;
    assert_eq!(
        push(&data),
        0,
        "second push: its consistency proof is checked"
    );
    some_events(&s, 3, "three").await;
    s.terminate();
    let (code, clean) = verify_json(&data);
    assert_eq!(code, 0, "{clean}");
    let size = clean["size"].as_u64().unwrap();
    assert!(size >= 13);

    // Each case on its own copy of the store.
    let case = |name: &str, edit: &dyn Fn(&redb::WriteTransaction)| {
        let copy = s.dir.join(format!("case-{name}"));
        copy_dir(&data, &copy);
        edit_store(&copy, |t| edit(t));
        let (code, report) = verify_json(&copy);
        assert_ne!(code, 0, "{name}: verify must fail: {report}");
        assert_eq!(report["ok"], false);
        problems(&report)
    };
    let row = |t: &redb::WriteTransaction, seq: u64| -> Vec<u8> {
        use redb::ReadableTable;
        t.open_table(AUDIT_EVENTS)
            .unwrap()
            .get(seq)
            .unwrap()
            .unwrap()
            .value()
            .to_vec()
    };
    let put = |t: &redb::WriteTransaction, seq: u64, v: &[u8]| {
        t.open_table(AUDIT_EVENTS).unwrap().insert(seq, v).unwrap();
    };
    let edited = case("reason", &|t| {
        let bytes = row(t, 3);
        let body = String::from_utf8(bytes[32..].to_vec()).unwrap();
        let mut v = bytes[..32].to_vec();
        v.extend_from_slice(
            body.replace("\"reason\":null", "\"reason\":\"queue_full\"")
                .as_bytes(),
        );
        put(t, 3, &v);
    });
    assert_eq!(edited, [(3, "changed".to_string())]);
    let removed = case("middle", &|t| {
        t.open_table(AUDIT_EVENTS).unwrap().remove(5).unwrap();
    });
    assert_eq!(removed, [(5, "removed".to_string())]);
    let swapped = case("swap", &|t| {
        let (a, b) = (row(t, 7), row(t, 8));
        put(t, 7, &b);
        put(t, 8, &a);
    });
    assert_eq!(
        swapped,
        [(7, "changed".to_string()), (8, "changed".to_string())]
    );
    let tail = case("tail", &|t| {
        let mut table = t.open_table(AUDIT_EVENTS).unwrap();
        for seq in 2..=size {
            table.remove(seq).unwrap();
        }
    });
    assert_eq!(
        tail,
        [(2, "rollback".to_string())],
        "only the pushed head tells"
    );
    let forged = case("anchor", &|t| {
        let anchor = json!({"first_seq": 1, "prev_hash": "ab".repeat(32), "removed_count": 0, "removed_until": null, "compact_range": []});
        t.open_table(META)
            .unwrap()
            .insert("audit_anchor", anchor.to_string().as_bytes())
            .unwrap();
    });
    assert_eq!(forged, [(1, "anchor_mismatch".to_string())]);

    // The whole chain rewritten consistently: intact on its own, caught
    // by the pushed head here and by the witness's own copy of it.
    let copy = s.dir.join("case-rewrite");
    copy_dir(&data, &copy);
    edit_store(&copy, |t| {
        let mut prev = berth::audit::GENESIS;
        for seq in 1..=size {
            let mut e = berth::audit::decode_row(&row(t, seq)).unwrap();
            let draft = berth::audit::Draft {
                at: 0,
                actor: e.actor.take(),
                trusted_backend: e.trusted_backend,
                action: "submit",
                deployment: e.deployment.take(),
                build: None,
                node: None,
                request_id: e.request_id.clone(),
                result: berth::audit::AuditResult::Refused,
                reason: Some("queue_full".into()),
                count: 1,
            };
            let sealed = berth::audit::seal(&draft, seq, &prev);
            prev = sealed.hash;
            put(t, seq, &sealed.row);
        }
    });
    let (code, report) = verify_json(&copy);
    assert_ne!(code, 0, "{report}");
    assert!(
        problems(&report).iter().any(|(_, k)| k == "rollback"),
        "{report}"
    );
    // The attacker also drops the local record of the pushed head: verify
    // passes, but the witness refuses the next head.
    std::fs::remove_file(copy.join("audit-pushed-head.json")).unwrap();
    assert_eq!(verify_json(&copy).0, 0);
    assert_ne!(push(&copy), 0, "the witness must refuse a rewritten chain");
}

#[tokio::test]
async fn proofs_verify_against_the_published_roots() {
    use berth::audit::merkle;
    let s = Server::start(Options::default()).await;
    some_events(&s, 11, "p").await;
    let head = 11u64;
    let mut roots = HashMap::new();
    for size in 1..=head {
        for seq in 1..=size {
            let (st, p) = s
                .json(&format!("/v1/audit/proof?seq={seq}&size={size}"))
                .await;
            assert_eq!(st, 200, "{p}");
            roots.insert(size, inclusion_verifies(&p, seq, size));
        }
    }
    for from in 1..=head {
        for to in from..=head {
            let (st, c) = s
                .json(&format!("/v1/audit/consistency?from={from}&to={to}"))
                .await;
            assert_eq!(st, 200, "{c}");
            let path: Vec<merkle::Hash> = c["path"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| hash(h.as_str().unwrap()))
                .collect();
            assert!(
                merkle::verify_consistency(from, to, &roots[&from], &roots[&to], &path),
                "{c}"
            );
        }
    }
    let (_, report) = verify_json(&s.dir.join("data"));
    assert_eq!(
        report["merkle_root"].as_str().unwrap(),
        hex_of(&roots[&head])
    );
    assert_eq!(s.json("/v1/audit/proof?seq=12&size=12").await.0, 404);
    assert_eq!(s.json("/v1/audit/proof?seq=0&size=3").await.0, 400);
    assert_eq!(s.json("/v1/audit/consistency?from=5&to=3").await.0, 404);
}

/// A store held alone (the default: one fdatasync per commit,
/// redb's own commits durable only at checkpoints, here a minute apart) is
/// verified, pushed and exported while berth runs, from a snapshot berth
/// copies: each acknowledged write is in what the reader sees at once,
/// though the file itself holds none of them yet. Nothing is left in
/// `snapshots/` afterwards; stopped, the file verifies alone; a server
/// with `--shared-store` opens it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_held_alone_is_verified_pushed_and_exported_while_berth_runs() {
    let mut s = Server::start(Options::default().arg("--checkpoint-interval").arg("60s")).await;
    let data = s.dir.join("data");
    let (code, report) = verify_json(&data);
    assert_eq!(code, 0, "{report}");
    let mut size = report["size"].as_u64().unwrap();
    for i in 0..3 {
        s.submit_ok(&format!("solo{i}"), mastodon("solo.example.org"))
            .await;
        let (code, report) = verify_json(&data);
        assert_eq!(code, 0, "{report}");
        assert!(
            report["size"].as_u64().unwrap() > size,
            "the acknowledged submit {i} is not in the live verify: {report}"
        );
        size = report["size"].as_u64().unwrap();
    }
    // The witness gets the head of what was acknowledged, live.
    let (sink, _sink_task) = json_server(Arc::new(|_body: Value| (200, json!({"ok": true})))).await;
    let (code, out) = push_head(&sink, &data);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(&format!("pushed head: size {size},")), "{out}");
    let sqlite = s.dir.join("live.sqlite");
    let (code, out) = berth(&[
        "export",
        "--data-dir",
        data.to_str().unwrap(),
        "--to",
        &format!("sqlite:{}", sqlite.display()),
    ]);
    assert_eq!(code, 0, "{out}");
    let conn = rusqlite::Connection::open(&sqlite).unwrap();
    let builds: i64 = conn
        .query_row("select count(*) from builds", [], |r| r.get(0))
        .unwrap();
    assert_eq!(builds, 3, "the live export misses acknowledged builds");
    let left = snapshots_left(&data);
    assert!(left.is_empty(), "snapshots left behind: {left:?}");
    assert!(s.terminate().success());
    let (code, report) = verify_json(&data);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["size"].as_u64().unwrap(), size, "{report}");
    // The same file, shared again.
    s.args.push("--shared-store".into());
    s.launch().await;
    let (code, report) = verify_json(&data);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["size"].as_u64().unwrap(), size, "{report}");
}

/// Hostile input round two, item 11: `berth audit push-head` reads at most
/// a few KiB of the sink's answer. A sink that refuses the head and then
/// answers without end gets its refusal reported (cut), instead of the
/// push reading until its time limit with the answer growing in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_head_reads_a_bounded_part_of_an_endless_answer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = Server::start(Options::default()).await;
    some_events(&s, 2, "endless").await;
    s.terminate();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sink = format!("http://{}/", listener.local_addr().unwrap());
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = sent.clone();
    let sink_task = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        // The request's head is enough; then the endless answer.
        let mut buf = [0u8; 65536];
        let _ = sock.read(&mut buf).await;
        let head = "HTTP/1.1 500 Refused\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n";
        if sock.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        let chunk = format!("{:x}\r\n{}\r\n", 65536, "x".repeat(65536));
        // Bounded: 16 GiB, far past any time limit of the push.
        for _ in 0..262_144 {
            if sock.write_all(chunk.as_bytes()).await.is_err() {
                return;
            }
            counter.fetch_add(65536, std::sync::atomic::Ordering::Relaxed);
        }
    });
    let data = s.dir.join("data");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
            .args(["audit", "push-head", "--sink", &sink, "--data-dir"])
            .arg(&data)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("refused the head (HTTP 500)"), "{stderr}");
    assert!(
        stderr.len() < 16 * 1024,
        "the refusal is cut: {} bytes",
        stderr.len()
    );
    let _ = sink_task.await;
    let sent_mib = sent.load(std::sync::atomic::Ordering::Relaxed) >> 20;
    assert!(
        sent_mib < 64,
        "push-head kept reading: {sent_mib} MiB of the answer sent"
    );
}
