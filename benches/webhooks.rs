//! Webhooks (notifications.md): the time from sending a submit to the
//! receiver getting its `build.queued` delivery (the commit is in between),
//! median and p99, with 1 and with 100 subscriptions, next to the time from
//! sending the same submit to its 202 (the commit's own latency, same run);
//! and submits per second with 10 subscriptions next to none, same run.
//!
//! Run: `cargo bench --bench webhooks`.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Submits timed per setting.
const SUBMITS: usize = 200;
/// Submits of the throughput runs, 8 at a time. 2,400 makes each run
/// 3-6 s here: at 800 (1-1.5 s) the ratio moved 0.55-0.82x between runs
/// of one binary, more than any change it was meant to show.
const THROUGHPUT_SUBMITS: usize = 2400;

/// A lean receiver: notes when each build's `build.queued` arrived (the
/// first arrival of each (subscription, build) counts).
async fn receiver() -> (String, Arc<Mutex<Vec<(String, Instant)>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let got: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let g = got.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let g = g.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 16384];
                loop {
                    let Ok(n) = sock.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    // One request per connection is enough to parse: berth
                    // keeps connections alive, so parse each in turn.
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let length: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse().ok())
                            .unwrap_or(0);
                        if buf.len() < end + 4 + length {
                            break;
                        }
                        let body: Value = serde_json::from_slice(&buf[end + 4..end + 4 + length])
                            .unwrap_or(Value::Null);
                        buf.drain(..end + 4 + length);
                        if let Some(id) = body["data"]["id"].as_str() {
                            g.lock().unwrap().push((id.to_string(), Instant::now()));
                        }
                        if sock
                            .write_all(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n")
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                }
            });
        }
    });
    (url, got)
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

async fn subscribe(http: &reqwest::Client, base: &str, token: &str, url: &str) {
    let r = http
        .post(format!("{base}/v1/webhooks"))
        .bearer_auth(token)
        .json(&json!({"url": url, "events": ["build.queued"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
}

/// Submits; the build id, when the request went out, and when its 202 came.
async fn submit(
    http: &reqwest::Client,
    base: &str,
    token: &str,
    id: &str,
) -> (String, Instant, Instant) {
    let sent = Instant::now();
    let build = common::submit(http, base, token, id, json!({})).await;
    (build, sent, Instant::now())
}

/// Latencies (ms) from each submit's request to the arrival of its
/// deliveries at `subscriptions` subscriptions (every one of them counted),
/// and from the request to its 202.
async fn latencies(subscriptions: usize, tag: &str) -> (Vec<f64>, Vec<f64>) {
    let dir =
        std::env::temp_dir().join(format!("berth-bench-webhooks-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (url, got) = receiver().await;
    let origin = url.trim_end_matches("/hook").to_string();
    let deployer =
        common::deployer_script(&dir, "printf '%s' '{\"nodes\":[]}' > \"$BERTH_RESULT\"");
    let mut berth = common::start_berth(
        &dir,
        &deployer,
        &[
            "--webhook-origin",
            &origin,
            "--max-webhooks",
            "200",
            "--webhook-concurrency",
            "16",
        ],
        &[],
    )
    .await;
    let (base, token) = (berth.base.clone(), berth.token.trim().to_string());
    let http = reqwest::Client::new();
    for _ in 0..subscriptions {
        subscribe(&http, &base, &token, &url).await;
    }
    let mut out = Vec::new();
    let mut answered = Vec::new();
    for i in 0..SUBMITS {
        let (build, at, acked) = submit(&http, &base, &token, &format!("d{}", i % 20)).await;
        answered.push(acked.duration_since(at).as_secs_f64() * 1000.0);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let arrivals: Vec<Instant> = got
                .lock()
                .unwrap()
                .iter()
                .filter(|(b, _)| *b == build)
                .map(|(_, t)| *t)
                .collect();
            if arrivals.len() >= subscriptions {
                out.extend(
                    arrivals
                        .iter()
                        .map(|t| t.saturating_duration_since(at).as_secs_f64() * 1000.0),
                );
                break;
            }
            assert!(Instant::now() < deadline, "deliveries did not arrive");
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
    let _ = berth.child.kill();
    let _ = berth.child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    (out, answered)
}

/// Submits per second, 8 at a time, with `subscriptions` subscriptions.
async fn throughput(subscriptions: usize, tag: &str) -> f64 {
    let dir = std::env::temp_dir().join(format!(
        "berth-bench-webhooks-t{tag}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (url, _got) = receiver().await;
    let origin = url.trim_end_matches("/hook").to_string();
    let deployer =
        common::deployer_script(&dir, "printf '%s' '{\"nodes\":[]}' > \"$BERTH_RESULT\"");
    let mut berth = common::start_berth(&dir, &deployer, &["--webhook-origin", &origin], &[]).await;
    let (base, token) = (berth.base.clone(), berth.token.trim().to_string());
    let http = reqwest::Client::new();
    for _ in 0..subscriptions {
        subscribe(&http, &base, &token, &url).await;
    }
    let started = Instant::now();
    let tasks: Vec<_> = (0..8)
        .map(|c| {
            let (http, base, token) = (http.clone(), base.clone(), token.clone());
            tokio::spawn(async move {
                for i in 0..THROUGHPUT_SUBMITS / 8 {
                    submit(&http, &base, &token, &format!("c{c}-{}", i % 25)).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let rate = THROUGHPUT_SUBMITS as f64 / started.elapsed().as_secs_f64();
    let _ = berth.child.kill();
    let _ = berth.child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    rate
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    common::runtime().block_on(async {
        for subscriptions in [1usize, 100] {
            let (mut l, mut acked) = latencies(subscriptions, &subscriptions.to_string()).await;
            let (p50, p99) = (percentile(&mut l, 0.5), percentile(&mut l, 0.99));
            let acked_p50 = percentile(&mut acked, 0.5);
            common::record(
                &format!("submit sent to its build.queued at the receiver, {subscriptions} subscription(s) (median; p99 {p99:.1} ms)"),
                &format!("{p50:.2} ms"),
                &format!("the same submit to its 202: {acked_p50:.2} ms"),
                p50 / acked_p50,
                None,
                false,
            );
        }
        let none = throughput(0, "0").await;
        let ten = throughput(10, "10").await;
        common::record(
            "submits/s with 10 webhook subscriptions",
            &format!("{ten:.0}/s"),
            &format!("no subscription, same run: {none:.0}/s"),
            ten / none,
            Some(0.8),
            true,
        );
    });
}
