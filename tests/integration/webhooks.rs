//! Webhooks (notifications.md) against real receivers on loopback: a
//! delivery the Python `standardwebhooks` library (PyPI, pinned) verifies;
//! retries with one `webhook-id`; a kill -9 between commit and delivery
//! loses nothing; a refused submit sends nothing; a receiver that never
//! answers does not hold up another subscription; a redirect is not
//! followed; an origin not listed is refused; a callback token gets 403.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::*;

/// The Python library's version the test verifies with.
const PY_STANDARDWEBHOOKS: &str = "standardwebhooks==1.1.0";

/// One request a receiver got: its headers (lower-case names) and body.
#[derive(Debug, Clone)]
struct Got {
    headers: Vec<(String, String)>,
    body: String,
}

impl Got {
    fn header(&self, name: &str) -> &str {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or("")
    }
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap()
    }
}

/// How a receiver answers.
#[derive(Clone, Copy)]
enum Answer {
    Status(u16),
    /// Accept and never answer.
    Silent,
    /// 302 to another URL.
    Redirect(u16),
}

/// A tiny HTTP receiver: records each request, answers from `script` (then
/// 200 for ever).
struct Receiver {
    url: String,
    got: Arc<Mutex<Vec<Got>>>,
}

impl Receiver {
    async fn start(script: Vec<Answer>) -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Receiver::serve(listener, script)
    }

    fn serve(listener: tokio::net::TcpListener, script: Vec<Answer>) -> Receiver {
        use tokio::io::AsyncWriteExt;
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let got: Arc<Mutex<Vec<Got>>> = Arc::default();
        let script = Arc::new(Mutex::new(VecDeque::from(script)));
        let (g, sc) = (got.clone(), script.clone());
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let (g, sc) = (g.clone(), sc.clone());
                tokio::spawn(async move {
                    let Some((head, body)) = read_request(&mut sock).await else {
                        return;
                    };
                    let headers = head
                        .lines()
                        .skip(1)
                        .filter_map(|l| l.split_once(':'))
                        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
                        .collect();
                    let body = String::from_utf8_lossy(&body).to_string();
                    g.lock().unwrap().push(Got { headers, body });
                    let answer = sc
                        .lock()
                        .unwrap()
                        .pop_front()
                        .unwrap_or(Answer::Status(200));
                    let response = match answer {
                        Answer::Status(code) => format!(
                            "HTTP/1.1 {code} X\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
                        ),
                        Answer::Redirect(port) => format!(
                            "HTTP/1.1 302 Found\r\nlocation: http://127.0.0.1:{port}/hook\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                        ),
                        Answer::Silent => {
                            tokio::time::sleep(Duration::from_secs(3600)).await;
                            return;
                        }
                    };
                    let _ = sock.write_all(response.as_bytes()).await;
                    let _ = sock.shutdown().await;
                });
            }
        });
        Receiver { url, got }
    }

    fn got(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }

    fn port(&self) -> u16 {
        self.url
            .trim_start_matches("http://127.0.0.1:")
            .trim_end_matches("/hook")
            .parse()
            .unwrap()
    }
}

fn origin(url: &str) -> String {
    url.trim_end_matches("/hook").to_string()
}

/// berth allowing `origins` for webhooks, retrying after 1 s each time.
async fn server(origins: &[&str], extra: &[&str]) -> Server {
    let mut opts = Options::default()
        .arg("--webhook-origin")
        .arg(&origins.join(","))
        .arg("--webhook-retry-schedule")
        .arg("1s,1s,1s");
    for a in extra {
        opts = opts.arg(a);
    }
    Server::start(opts).await
}

async fn subscribe(s: &Server, url: &str, events: Value) -> (String, String) {
    let (status, body) = read(
        s.post("/v1/webhooks", &json!({"url": url, "events": events}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    (
        body["id"].as_str().unwrap().to_string(),
        body["secret"].as_str().unwrap().to_string(),
    )
}

async fn until<F: Fn() -> bool>(what: &str, f: F) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A virtualenv with the Python library, or `None` (said) without pip.
fn python_verifier(test: &str) -> Option<PathBuf> {
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/webhooks-venv");
    let python = venv.join("bin/python");
    if !python.exists() {
        let made = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status();
        let installed = made.is_ok_and(|s| s.success())
            && Command::new(venv.join("bin/pip"))
                .args([
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    PY_STANDARDWEBHOOKS,
                ])
                .status()
                .is_ok_and(|s| s.success());
        if !installed {
            skip(
                test,
                "cannot install the Python standardwebhooks library (python3 -m venv, pip)",
            );
            return None;
        }
    }
    Some(python)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_verifies_with_the_python_library_and_a_refusal_sends_nothing() {
    let test = "webhooks::a_delivery_verifies_with_the_python_library_and_a_refusal_sends_nothing";
    let receiver = Receiver::start(vec![]).await;
    let s = server(&[&origin(&receiver.url)], &[]).await;
    // An origin not listed, a callback token, unknown events: refused.
    let (status, body) = read(
        s.post(
            "/v1/webhooks",
            &json!({"url": "http://127.0.0.1:1/x", "events": ["*"]}),
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(
        body["fields"][0]["code"], "webhook_origin_not_allowed",
        "{body}"
    );
    let (status, _) = read(
        s.http
            .post(s.url("/v1/webhooks"))
            .bearer_auth("not-the-service-token")
            .json(&json!({"url": receiver.url, "events": ["*"]}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 403);
    let (status, _) = read(
        s.post(
            "/v1/webhooks",
            &json!({"url": receiver.url, "events": ["build.exploded"]}),
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(status, 400);

    let (id, secret) = subscribe(&s, &receiver.url, json!(["*"])).await;
    assert!(secret.starts_with("whsec_"), "{secret}");
    // The secret is shown once.
    let (_, read_back) = s.json(&format!("/v1/webhooks/{id}")).await;
    assert!(read_back.get("secret").is_none(), "{read_back}");
    // A refused submit sends nothing; a good one its build's events.
    let (status, _) = s
        .submit("alice", json!({"configuration": {"domain": 5}}))
        .await;
    assert_eq!(status, 422);
    let b = s
        .submit_ok("alice", json!({"domain": "alice.example.org"}))
        .await;
    s.wait_build(&b, "final").await;
    until("queued, started, succeeded", || receiver.got().len() >= 3).await;
    let got = receiver.got();
    let types: Vec<String> = got
        .iter()
        .map(|g| g.json()["type"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        types,
        ["build.queued", "build.started", "build.succeeded"],
        "{got:?}"
    );
    for g in &got {
        assert_eq!(g.json()["data"]["id"], b, "{g:?}");
        assert!(g.header("user-agent").starts_with("berth/"), "{g:?}");
    }
    let Some(python) = python_verifier(test) else {
        return;
    };
    let dir = temp_dir("webhook-verify");
    for (i, g) in got.iter().enumerate() {
        let body_file = dir.join(format!("body-{i}"));
        std::fs::write(&body_file, &g.body).unwrap();
        let headers = json!({
            "webhook-id": g.header("webhook-id"),
            "webhook-timestamp": g.header("webhook-timestamp"),
            "webhook-signature": g.header("webhook-signature"),
        });
        let out = Command::new(&python)
            .arg("-c")
            .arg("import json,sys\nfrom standardwebhooks.webhooks import Webhook\nbody=open(sys.argv[2],'rb').read()\nWebhook(sys.argv[1]).verify(body, json.loads(sys.argv[3]))\nprint('verified')")
            .arg(&secret)
            .arg(&body_file)
            .arg(headers.to_string())
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("verified"),
            "the Python library refused delivery {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // A body changed by one byte does not verify.
        std::fs::write(&body_file, g.body.replacen('{', "{ ", 1)).unwrap();
        let out = Command::new(&python)
            .arg("-c")
            .arg("import json,sys\nfrom standardwebhooks.webhooks import Webhook\nbody=open(sys.argv[2],'rb').read()\nWebhook(sys.argv[1]).verify(body, json.loads(sys.argv[3]))")
            .arg(&secret)
            .arg(&body_file)
            .arg(headers.to_string())
            .output()
            .unwrap();
        assert!(!out.status.success(), "a changed body verified");
    }
    // The deliveries route shows them delivered (each result commits just
    // after its receiver answered); /metrics counts them.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, page) = s.json(&format!("/v1/webhooks/{id}/deliveries")).await;
        let items = page["items"].as_array().unwrap();
        assert_eq!(items.len(), 3, "{page}");
        if items.iter().all(|d| d["status"] == "delivered") {
            break;
        }
        assert!(Instant::now() < deadline, "not all delivered: {page}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let metrics = s.metrics().await;
    assert!(
        metrics.contains("berth_webhook_deliveries_total{result=\"delivered\"} 3"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_receiver_gets_retries_with_one_webhook_id() {
    let receiver = Receiver::start(vec![Answer::Status(500), Answer::Status(500)]).await;
    let s = server(&[&origin(&receiver.url)], &[]).await;
    let (id, _) = subscribe(&s, &receiver.url, json!(["build.queued"])).await;
    s.submit_ok("alice", json!({"domain": "alice.example.org"}))
        .await;
    until("three attempts", || receiver.got().len() >= 3).await;
    let got = receiver.got();
    let ids: Vec<&str> = got.iter().map(|g| g.header("webhook-id")).collect();
    assert!(ids.iter().all(|i| *i == ids[0] && !i.is_empty()), "{ids:?}");
    let stamps: Vec<i64> = got
        .iter()
        .map(|g| g.header("webhook-timestamp").parse().unwrap())
        .collect();
    assert!(
        stamps.windows(2).all(|w| w[1] > w[0]),
        "a growing timestamp: {stamps:?}"
    );
    assert!(got.iter().all(|g| g.body == got[0].body), "the same body");
    // The third attempt's result commits just after the receiver answers.
    let deadline = Instant::now() + Duration::from_secs(30);
    let page = loop {
        let (_, page) = s.json(&format!("/v1/webhooks/{id}/deliveries")).await;
        if page["items"][0]["status"] == "delivered" {
            break page;
        }
        assert!(Instant::now() < deadline, "never delivered: {page}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(page["items"][0]["attempts"], 3, "{page}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_between_commit_and_delivery_loses_nothing() {
    // The receiver is down when the change commits: nothing listens on
    // its port (one the kernel gave and took back).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/hook");
    let mut s = server(&[&origin(&url)], &[]).await;
    let (id, _) = subscribe(&s, &url, json!(["build.queued"])).await;
    s.submit_ok("alice", json!({"domain": "alice.example.org"}))
        .await;
    s.kill();
    // Up again on its port, then berth again.
    let receiver = restart_receiver_on(port).await;
    s.launch().await;
    until("the delivery after the restart", || {
        !receiver.got().is_empty()
    })
    .await;
    // Once its row says delivered, nothing sends it again.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, page) = s.json(&format!("/v1/webhooks/{id}/deliveries")).await;
        if page["items"][0]["status"] == "delivered" {
            break;
        }
        assert!(Instant::now() < deadline, "never marked delivered: {page}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let got = receiver.got();
    assert_eq!(got.len(), 1, "delivered once: {got:?}");
    assert_eq!(got[0].json()["type"], "build.queued");
    let (_, page) = s.json(&format!("/v1/webhooks/{id}/deliveries")).await;
    assert_eq!(page["items"][0]["status"], "delivered", "{page}");
}

/// A receiver on a given port (its predecessor's).
async fn restart_receiver_on(port: u16) -> Receiver {
    for _ in 0..100 {
        if let Ok(listener) = tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
            return Receiver::serve(listener, vec![]);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("cannot bind the receiver's port again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_receiver_does_not_hold_up_another_and_a_redirect_is_not_followed() {
    let silent = Receiver::start(vec![Answer::Silent; 8]).await;
    let target = Receiver::start(vec![]).await;
    let redirecting = Receiver::start(vec![Answer::Redirect(target.port()); 8]).await;
    let healthy = Receiver::start(vec![]).await;
    let s = server(
        &[
            &origin(&silent.url),
            &origin(&redirecting.url),
            &origin(&healthy.url),
            &origin(&target.url),
        ],
        &["--webhook-timeout", "60s"],
    )
    .await;
    let (silent_id, _) = subscribe(&s, &silent.url, json!(["build.queued"])).await;
    let (redirect_id, _) = subscribe(&s, &redirecting.url, json!(["build.queued"])).await;
    subscribe(&s, &healthy.url, json!(["build.queued"])).await;
    s.submit_ok("alice", json!({"domain": "alice.example.org"}))
        .await;
    until("the healthy receiver's delivery", || {
        !healthy.got().is_empty()
    })
    .await;
    until("the redirect's attempt", || !redirecting.got().is_empty()).await;
    // The silent one still holds its attempt (60 s) while the others are done.
    let (_, page) = s
        .json(&format!("/v1/webhooks/{silent_id}/deliveries"))
        .await;
    assert_eq!(page["items"][0]["status"], "pending", "{page}");
    assert_eq!(page["items"][0]["attempts"], 0, "{page}");
    // A redirect is an error, never followed.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, page) = s
            .json(&format!("/v1/webhooks/{redirect_id}/deliveries"))
            .await;
        if page["items"][0]["last_error"] == "redirect" {
            break;
        }
        assert!(Instant::now() < deadline, "no redirect error: {page}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A followed redirect would have reached the target before the
    // attempt's error was recorded.
    assert!(target.got().is_empty(), "the redirect was followed");
}

/// Rotation: deliveries after it are signed with the new secret (the old
/// one no longer verifies them); a subscription for other deployments
/// gets nothing of this one's; deleting drops the subscription.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_secret_signs_what_follows_and_a_deployment_filter_holds() {
    let receiver = Receiver::start(vec![]).await;
    let other = Receiver::start(vec![]).await;
    let s = server(&[&origin(&receiver.url), &origin(&other.url)], &[]).await;
    let (id, old_secret) = subscribe(&s, &receiver.url, json!(["build.queued"])).await;
    let (status, filtered) = read(
        s.post(
            "/v1/webhooks",
            &json!({"url": other.url, "events": ["*"], "deployments": ["someone-else"]}),
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(status, 201, "{filtered}");
    let (status, rotated) = read(
        s.post(&format!("/v1/webhooks/{id}/rotate-secret"), &json!({}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{rotated}");
    let new_secret = rotated["secret"].as_str().unwrap().to_string();
    assert_ne!(new_secret, old_secret);
    s.submit_ok("alice", json!({"domain": "alice.example.org"}))
        .await;
    until("the delivery", || !receiver.got().is_empty()).await;
    let g = &receiver.got()[0];
    let mut headers = reqwest::header::HeaderMap::new();
    for name in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
        headers.insert(name, g.header(name).parse().unwrap());
    }
    let verify = |secret: &str| {
        standardwebhooks::Webhook::new(secret)
            .unwrap()
            .verify(g.body.as_bytes(), &headers)
    };
    assert!(verify(&new_secret).is_ok(), "the new secret signs");
    assert!(
        verify(&old_secret).is_err(),
        "the old secret no longer does"
    );
    // Deliveries are written with the event they carry: the filtered
    // subscription has none, and so never sends one.
    let filtered_id = filtered["id"].as_str().unwrap();
    let (_, page) = s
        .json(&format!("/v1/webhooks/{filtered_id}/deliveries"))
        .await;
    assert_eq!(page["items"], json!([]), "{page}");
    assert!(
        other.got().is_empty(),
        "another deployment's subscription got alice's event"
    );
    let (status, _) = read(
        s.delete(&format!("/v1/webhooks/{id}"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _) = s.json(&format!("/v1/webhooks/{id}")).await;
    assert_eq!(status, 404);
}

/// Retention (notifications.md): delivered and failed rows older than 7
/// days are pruned (at start, then hourly); a pending one and a recent
/// one stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_deliveries_older_than_a_week_are_pruned() {
    let receiver = Receiver::start(vec![]).await;
    let mut s = server(&[&origin(&receiver.url)], &[]).await;
    let (id, _) = subscribe(&s, &receiver.url, json!(["*"])).await;
    let b = s
        .submit_ok("alice", json!({"domain": "alice.example.org"}))
        .await;
    s.wait_build(&b, "final").await;
    until("three deliveries", || receiver.got().len() >= 3).await;
    // Their results are stored just after the receiver answered.
    let deliveries = format!("/v1/webhooks/{id}/deliveries");
    eventually("three deliveries recorded delivered", || {
        let page = s.json(&deliveries);
        async move {
            let (_, page) = page.await;
            let items = page["items"].as_array().cloned().unwrap_or_default();
            items.len() >= 3 && items.iter().all(|d| d["status"] == "delivered")
        }
    })
    .await;
    s.terminate();
    // Age two of them by eight days, as if a week had passed.
    let webhook = uuid::Uuid::parse_str(&id).unwrap().as_u128();
    let store = berth::store::Store::open(&s.dir.join("data/berth.redb")).unwrap();
    let aged = store
        .write(move |tx| {
            use berth::store::Lookup;
            let week_and_a_day = 8 * 24 * 3600 * 1000;
            let list = tx.deliveries(webhook, None, 10)?;
            let mut aged = 0;
            for (delivery, mut d) in list.into_iter().take(2) {
                d.last_attempt_at = d.last_attempt_at.map(|t| t - week_and_a_day);
                tx.put_delivery(webhook, delivery, &d)?;
                aged += 1;
            }
            Ok(aged)
        })
        .await
        .unwrap();
    assert_eq!(aged, 2);
    store.close().unwrap();
    s.launch().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, page) = s.json(&format!("/v1/webhooks/{id}/deliveries")).await;
        let left = page["items"].as_array().unwrap().len();
        if left == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "not pruned: {page}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
