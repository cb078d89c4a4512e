//! The operator page end to end in headless Chromium (tests/browser/page.mjs
//! drives it with playwright-core): sign in, a 401 screen, a 422 at its
//! field, submit and watch the log to `end` with every line exactly once
//! across dropped connections, a deployment page that follows its channel,
//! health events, the automatic rollback and a Rollback button, a phone in
//! dark mode, a 100,000-line log, delete. Screenshots go to
//! target/browser-artifacts/.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use crate::harness::*;

/// A deployer whose schema wants a string domain, and whose deploy writes
/// `"lines": N` lines stamped with their write time (ms), or 100,000 lines
/// at once for `"fast": true`. Its one node `web` checks unhealthy when the
/// configuration says `"unhealthy": true`.
fn page_deployer(dir: &Path) -> PathBuf {
    script(
        dir,
        "page-deployer.sh",
        r#"
verb="$1"
input=$(cat)
case "$verb" in
describe) printf '%s' '{"methods":["local"],"default_method":"local","actions":{"suspend":["local"],"resume":["local"]},"verbs":["check","confirm"],"catalog":[],"schema":{"type":"object","properties":{"domain":{"type":"string"}}}}' > "$BERTH_RESULT"; exit 0;;
check)
  case "$input" in
  *'"unhealthy":true'*) printf '%s' '{"nodes":[{"name":"web","healthy":false,"reason":"the page test made it unhealthy"}]}' > "$BERTH_RESULT";;
  *) printf '%s' '{"nodes":[{"name":"web","healthy":true}]}' > "$BERTH_RESULT";;
  esac
  exit 0;;
confirm) printf '{}' > "$BERTH_RESULT"; exit 0;;
eval) printf '%s' '{"nodes":[]}' > "$BERTH_RESULT"; exit 0;;
deploy)
  case "$input" in
  *'"fast":true'*) seq 1 100000 | sed 's/^/fast line /';;
  *)
    n=$(printf '%s' "$input" | sed -n 's/.*"lines":\([0-9]*\).*/\1/p' | head -n 1)
    i=0
    while [ "$i" -lt "${n:-1}" ]; do
      i=$((i+1)); echo "line $i t=$(date +%s%3N)"
      [ $((i % 20)) -eq 0 ] && sleep 0.1
    done;;
  esac
  printf '%s' '{"nodes":[{"name":"web","changed":true}]}' > "$BERTH_RESULT"; exit 0;;
destroy) printf '{}' > "$BERTH_RESULT"; exit 0;;
esac
exit 2
"#,
    )
}

/// A TCP proxy in front of berth whose connections the test can drop.
struct Proxy {
    port: u16,
    open: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Proxy {
    async fn start(target: String) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let open: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let list = open.clone();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = target.clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                list.lock().unwrap().push(task.abort_handle());
            }
        });
        Proxy { port, open }
    }

    /// Drops every open connection (both sockets close).
    fn cut(&self) -> usize {
        let handles: Vec<_> = self.open.lock().unwrap().drain(..).collect();
        handles.iter().for_each(|h| h.abort());
        handles.len()
    }
}

fn browser_ready(test: &str) -> Option<(PathBuf, PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser");
    let chromium = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists());
    let Some(chromium) = chromium else {
        skip(
            test,
            "no Chromium (Debian's `chromium` package; .ci/run installs it)",
        );
        return None;
    };
    if Command::new("node").arg("--version").output().is_err() {
        skip(test, "no node");
        return None;
    }
    if !root.join("node_modules/playwright-core").is_dir() {
        skip(
            test,
            "tests/browser/node_modules is missing (npm ci in tests/browser; .ci/run does it)",
        );
        return None;
    }
    Some((chromium, root))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_signs_in_submits_and_follows_a_build_in_chromium() {
    let test = "page::the_page_signs_in_submits_and_follows_a_build_in_chromium";
    let Some((chromium, root)) = browser_ready(test) else {
        return;
    };
    let dir = temp_dir("page");
    let deployer = page_deployer(&dir);
    let s = Server::start(
        Options::default()
            .deployer(&deployer)
            .arg("--health-interval")
            .arg("1s")
            .arg("--health-timeout")
            .arg("3s")
            // Nothing listens on port 9: the page shows pending deliveries.
            .arg("--webhook-origin")
            .arg("http://127.0.0.1:9"),
    )
    .await;
    let proxy = Proxy::start(s.base.trim_start_matches("http://").to_string()).await;
    let artifacts = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/browser-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();

    let mut node = Command::new("node")
        .arg(root.join("page.mjs"))
        .env("BERTH_URL", format!("http://127.0.0.1:{}", proxy.port))
        .env("BERTH_TOKEN", &s.token)
        .env("CHROMIUM", &chromium)
        .env("ARTIFACTS", &artifacts)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to_node = node.stdin.take().unwrap();
    let from_node = BufReader::new(node.stdout.take().unwrap());
    let proxy = Arc::new(proxy);
    let cutter = proxy.clone();
    // The page's stdout is read on a thread: it blocks.
    let reader = std::thread::spawn(move || {
        let mut result = None;
        let mut cuts = 0;
        for line in from_node.lines() {
            let line = line.unwrap();
            if line == "cut" {
                cuts = cutter.cut();
                writeln!(to_node, "cut done").unwrap();
            } else if let Some(json) = line.strip_prefix("result ") {
                result = Some(json.to_string());
            }
        }
        (result, cuts)
    });
    let status = tokio::task::spawn_blocking(move || node.wait_with_output().unwrap())
        .await
        .unwrap();
    let (result, cuts) = reader.join().unwrap();
    assert!(
        status.status.success(),
        "the browser test failed:\n{}\n{}",
        String::from_utf8_lossy(&status.stderr),
        s.log()
    );
    assert!(cuts > 0, "no connection was open to cut mid-build");
    let figures: serde_json::Value = serde_json::from_str(&result.expect("figures")).unwrap();
    eprintln!(
        "page figures: {figures}; page size {} bytes",
        berth::api::page::total_bytes()
    );
    for shot in ["live-log.png", "deployment.png", "phone-dark.png"] {
        assert!(artifacts.join(shot).is_file(), "screenshot {shot}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_a_rollouts_waves_and_resumes_it_in_chromium() {
    let test = "page::the_page_shows_a_rollouts_waves_and_resumes_it_in_chromium";
    let Some((chromium, root)) = browser_ready(test) else {
        return;
    };
    let s = Server::start(Options::default().env("BERTH_LOCAL_ACTIVATE", "1")).await;
    let config = |domain: &str| serde_json::json!({"domain": domain, "applications": {"mastodon": {"enable": true}, "nextcloud": {"enable": true}}});
    let first = s.submit_ok("alice", config("a.example.org")).await;
    assert_eq!(s.wait_build(&first, "final").await["status"], "succeeded");
    let r = s
        .http
        .put(s.url("/v1/deployments/alice/rollout-policy"))
        .bearer_auth(&s.token)
        .json(&serde_json::json!({"waves": [1], "pause_after": [1]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let build = s.submit_ok("alice", config("b.example.org")).await;
    eventually("the rollout paused", || async {
        s.build(&build).await["rollout"]["state"] == "paused"
    })
    .await;
    let artifacts = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/browser-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("node")
            .arg(root.join("rollout.mjs"))
            .env("BERTH_URL", &s.base)
            .env("BERTH_TOKEN", &s.token)
            .env("CHROMIUM", &chromium)
            .env("ARTIFACTS", &artifacts)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "the browser test failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A report of `node` running `digest`, by `token`.
async fn report_running(s: &Server, token: &str, digest: &str) {
    let body = serde_json::json!({
        "operation_id": format!("op-{}", uuid::Uuid::now_v7().simple()), "fence": 0,
        "worker_incarnation": "incarnation-0001", "generation": 1,
        "running": {"kind": "file", "digest": digest}, "booted": null, "health": null,
        "last_error": null, "agent_version": "test", "uptime_s": 1, "report_interval_ms": 60000,
    });
    let r = s
        .http
        .post(s.url("/internal/v1/nodes/alice/mastodon/report"))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_marks_a_drifted_node_and_clears_it_live_in_chromium() {
    let test = "page::the_page_marks_a_drifted_node_and_clears_it_live_in_chromium";
    let Some((chromium, root)) = browser_ready(test) else {
        return;
    };
    let s = Server::start(Options::default()).await;
    let (_, made) = read(
        s.post(
            "/v1/tokens",
            &serde_json::json!({"name": "m-1", "kind": "agent", "deployment": "alice", "node": "mastodon"}),
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    let token = made["token"].as_str().unwrap().to_string();
    let build = s.submit_ok("alice", mastodon("alice.example.org")).await;
    assert_eq!(s.wait_build(&build, "final").await["status"], "succeeded");
    let (_, entry) = s.json("/v1/deployments/alice/nodes/mastodon").await;
    let desired = entry["desired"]["artifact"]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let other = format!("sha256:{}", "0".repeat(64));
    report_running(&s, &token, &other).await;
    let reported = std::time::Instant::now();
    let artifacts = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/browser-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let _ = std::fs::remove_file(artifacts.join("seen-drift"));
    let (base, service, seen) = (
        s.base.clone(),
        s.token.clone(),
        artifacts.join("seen-drift"),
    );
    let browser = tokio::task::spawn_blocking(move || {
        Command::new("node")
            .arg(root.join("nodes.mjs"))
            .env("BERTH_URL", &base)
            .env("BERTH_TOKEN", &service)
            .env("CHROMIUM", &chromium)
            .env("ARTIFACTS", &artifacts)
            .output()
            .unwrap()
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !seen.exists() && !browser.is_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "the page never showed the drift"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // A node reports at most once a second.
    let turn = std::time::Duration::from_millis(1100).saturating_sub(reported.elapsed());
    tokio::time::sleep(turn).await;
    report_running(&s, &token, &desired).await;
    let out = browser.await.unwrap();
    assert!(
        out.status.success(),
        "the browser test failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
