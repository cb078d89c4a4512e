//! Hostile input, round three: what a local user, a tenant or a dead
//! receiver could do to a release binary, each checked as they would act.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use serde_json::json;

use crate::harness::*;

/// Every file and directory berth wrote under `dir` (symlinks, sockets
/// and the deployers' own `work/` and `scratch/` aside) with a group or
/// other permission bit: what another local user could read.
fn readable_by_others(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if d == dir && (path.ends_with("work") || path.ends_with("scratch")) {
                continue;
            }
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let mode = meta.permissions().mode() & 0o777;
            if meta.is_dir() {
                stack.push(path.clone());
            } else if !meta.is_file() {
                continue;
            }
            if mode & 0o077 != 0 {
                found.push(format!("{} {:o}", path.display(), mode));
            }
        }
    }
    found
}

fn mode_of(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// The store, its redo log and the secrets are private from the first
/// byte (the process creates every file 0600), and a data dir an older
/// berth left 0711 with a 0644 log is narrowed at the next start.
#[tokio::test]
async fn every_file_berth_writes_in_its_data_dir_is_private_from_the_start() {
    let dir = temp_dir("private-files");
    let mut s = Server::start_in(dir.clone(), Options::default()).await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", s.pid())).unwrap();
    assert!(
        status.lines().any(|l| l == "Umask:\t0077"),
        "berth creates files with a mask that lets others read them:\n{status}"
    );
    let id = s.submit_ok("alice", json!({"n": 1})).await;
    s.wait_build(&id, "succeeded").await;
    let data = dir.join("data");
    assert!(data.join("berth.redo").exists());
    assert_eq!(readable_by_others(&data), Vec::<String>::new());
    assert_eq!(mode_of(&data), 0o700);

    // What an older berth left: a traversable data dir, a readable log.
    s.terminate();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o711)).unwrap();
    for name in ["berth.redo", "berth.redb", "service-token"] {
        std::fs::set_permissions(data.join(name), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    s.launch().await;
    assert_eq!(mode_of(&data), 0o700);
    assert_eq!(readable_by_others(&data), Vec::<String>::new());
}

/// With `--deployer-user` the deployer works in a directory of its own
/// beside the data dir, which stays 0700: it reads neither the redo log
/// nor the store by their fixed names, before or after a restart, and
/// its scratch root keeps the mode it needs after recovery.
#[tokio::test]
async fn a_deployer_user_reaches_nothing_in_the_data_dir_across_a_restart() {
    let nobody = nix::unistd::User::from_name("nobody").ok().flatten();
    let (true, Some(nobody)) = (nix::unistd::Uid::effective().is_root(), nobody) else {
        skip(
            "a_deployer_user_reaches_nothing_in_the_data_dir_across_a_restart",
            "needs root and a `nobody` user",
        );
        return;
    };
    let dir = temp_dir("deployer-user-dirs");
    let data = dir.join("data");
    let mut probes = String::new();
    for name in [
        "berth.redo",
        "berth.redb",
        "service-token",
        "callback-secret",
    ] {
        probes.push_str(&format!(
            "if cat {d}/{name} >/dev/null 2>&1; then echo READABLE-{name}; else echo protected-{name}; fi\n",
            d = data.display()
        ));
    }
    let body = format!(
        "{SCRIPT_PRELUDE}\necho \"uid=$(id -u)\"\n{probes}echo \"work=$BERTH_WORK_DIR\"\ntouch \"$BERTH_WORK_DIR/mine\" && echo work-writable\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\""
    );
    let deployer = script(&dir, "d.sh", &body);
    let opts = || {
        Options::default()
            .deployer(&deployer)
            .arg("--deployer-user")
            .arg("nobody")
    };
    let mut s = Server::start_in(dir.clone(), opts()).await;
    for round in 0..2 {
        let id = s.submit_ok("alice", json!({"round": round})).await;
        let b = s.wait_build(&id, "final").await;
        let log = s.log_text(&id).await;
        assert_eq!(b["status"], "succeeded", "{b}\n{log}");
        assert!(log.contains(&format!("uid={}", nobody.uid)), "{log}");
        assert!(!log.contains("READABLE"), "{log}");
        assert!(log.contains("protected-berth.redo"), "{log}");
        assert!(log.contains("work-writable"), "{log}");
        let deployers = dir.join("data-deployers");
        assert!(
            log.contains(&format!("work={}/work/alice", deployers.display())),
            "{log}"
        );
        assert_eq!(mode_of(&data), 0o700, "round {round}");
        assert_eq!(mode_of(&deployers.join("scratch")), 0o711, "round {round}");
        // The second round runs after a restart (recovery empties scratch).
        s.terminate();
        s.launch().await;
    }
}

/// `--deployer-dir` inside the data dir with `--deployer-user` is refused
/// at start, naming the flag.
#[test]
fn a_deployer_dir_inside_the_data_dir_is_refused() {
    let dir = temp_dir("deployer-dir-inside");
    let data = dir.join("data");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--deployer-user",
            "nobody",
        ])
        .arg("--data-dir")
        .arg(&data)
        .arg("--deployer-dir")
        .arg(data.join("deployers"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--deployer-dir") && stderr.contains("inside the data dir"),
        "{stderr}"
    );
}

/// `berth <args>` against `s` with its token file; with `tty`, inside a
/// pseudo-terminal (`script`), as a person runs it. Its exit code and
/// what it printed (stdout and stderr; through the terminal, both).
fn cli_as(s: &Server, args: &[&str], stdin: &str, tty: bool) -> (i32, Vec<u8>, String) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let bin = env!("CARGO_BIN_EXE_berth");
    let mut command = if tty {
        let line = std::iter::once(bin)
            .chain(args.iter().copied())
            .map(|a| format!("'{a}'"))
            .collect::<Vec<_>>()
            .join(" ");
        let mut c = Command::new("script");
        c.args(["-qec", &line, "/dev/null"]);
        c
    } else {
        let mut c = Command::new(bin);
        c.args(args);
        c
    };
    let mut child = command
        .env("BERTH_URL", &s.base)
        .env("BERTH_TOKEN_FILE", s.dir.join("data/service-token"))
        .env_remove("BERTH_TOKEN")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run berth (or util-linux's script)");
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.as_bytes()).unwrap();
    drop(input);
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A tenant's text cannot drive the operator's terminal: a `domain` with
/// an OSC sequence is refused at submit with its pointer; a configuration
/// key with escapes comes back in a field pointer shown escaped; a log
/// line's escapes are shown on a terminal and kept when piped or with
/// `--raw`.
#[tokio::test]
async fn a_tenants_escapes_never_reach_the_operators_terminal() {
    let dir = temp_dir("terminal-escapes");
    let body = format!(
        "{SCRIPT_PRELUDE}\nprintf 'before \\033]0;pwned\\007 \\033[2J after\\n'\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\""
    );
    let deployer = script(&dir, "d.sh", &body);
    let s = Server::start_in(dir.clone(), Options::default().deployer(&deployer)).await;

    let (status, answer) = s
        .submit(
            "alice",
            json!({"configuration": {"domain": "a\u{1b}]0;x\u{7}.org"}}),
        )
        .await;
    assert_eq!(status, 422, "{answer}");
    assert_eq!(answer["fields"][0]["pointer"], "/configuration/domain");
    assert_eq!(answer["fields"][0]["code"], "host_name");
    let (status, _) = s.json("/v1/deployments/alice").await;
    assert_eq!(status, 404, "a refused submit changes nothing");

    let hostile = r#"{"deployment": {"\u001b]52;c;cHduZWQ=\u0007": 5}}"#;
    let (code, _, err) = cli_as(&s, &["deploy", "alice"], hostile, false);
    assert_eq!(code, 3, "{err}");
    assert!(!err.contains('\u{1b}'), "a raw escape on stderr: {err:?}");
    assert!(err.contains("\\x1b]52;c;cHduZWQ=\\x07"), "{err}");

    let id = s.submit_ok("alice", json!({})).await;
    s.wait_build(&id, "succeeded").await;
    let (code, piped, _) = cli_as(&s, &["logs", &id], "", false);
    assert_eq!(code, 0);
    assert!(
        piped.windows(5).any(|w| w == b"\x1b]0;p"),
        "piped output is as it is"
    );
    let (code, shown, _) = cli_as(&s, &["logs", &id], "", true);
    assert_eq!(code, 0);
    let text = String::from_utf8_lossy(&shown);
    assert!(!shown.contains(&0x1b) && !shown.contains(&0x07), "{text:?}");
    assert!(
        text.contains("before \\x1b]0;pwned\\x07 \\x1b[2J after"),
        "{text:?}"
    );
    let (_, raw, _) = cli_as(&s, &["logs", "--raw", &id], "", true);
    assert!(raw.windows(5).any(|w| w == b"\x1b]0;p"), "--raw keeps them");
}

/// A receiver on loopback that counts requests and answers `status`, or
/// never answers (`None`): (its URL, the count).
async fn receiver(status: Option<u16>) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let count = std::sync::Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                if read_request(&mut sock).await.is_none() {
                    return;
                }
                seen.fetch_add(1, Ordering::SeqCst);
                let Some(code) = status else {
                    // Held open, never answered, until the test ends.
                    std::future::pending::<()>().await;
                    return;
                };
                let answer =
                    format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = sock.write_all(answer.as_bytes()).await;
            });
        }
    });
    (url, count)
}

fn origin_of(url: &str) -> String {
    url.trim_end_matches("/hook").to_string()
}

async fn subscribe(s: &Server, url: &str) -> String {
    let r = s
        .post("/v1/webhooks", &json!({"url": url, "events": ["ping"]}))
        .send()
        .await
        .unwrap();
    let (status, body) = read(r).await;
    assert_eq!(status, 201, "{body}");
    body["id"].as_str().unwrap().to_string()
}

async fn ping(s: &Server, webhook: &str) {
    let r = s
        .post(&format!("/v1/webhooks/{webhook}/test"), &json!({}))
        .send()
        .await
        .unwrap();
    let (status, body) = read(r).await;
    assert!(status == 200 || status == 202, "{status} {body}");
}

/// The newest delivery of a subscription.
async fn last_delivery(s: &Server, webhook: &str) -> serde_json::Value {
    let (_, page) = s
        .json(&format!("/v1/webhooks/{webhook}/deliveries?limit=1"))
        .await;
    page["items"][0].clone()
}

/// How long a healthy subscription's ping takes to be delivered while
/// `backlog` pings are due to a receiver that never answers.
async fn healthy_delivery_behind(backlog: usize) -> std::time::Duration {
    let (dead, _) = receiver(None).await;
    let (healthy, _) = receiver(Some(200)).await;
    let origins = format!("{},{}", origin_of(&dead), origin_of(&healthy));
    let s = Server::start(
        Options::default()
            .arg("--webhook-origin")
            .arg(&origins)
            .arg("--webhook-timeout")
            .arg("60s"),
    )
    .await;
    let dead_id = subscribe(&s, &dead).await;
    let healthy_id = subscribe(&s, &healthy).await;
    for _ in 0..backlog {
        ping(&s, &dead_id).await;
    }
    let sent = std::time::Instant::now();
    ping(&s, &healthy_id).await;
    // Polled every 2 ms (not `eventually`'s pace): the time is the figure.
    let deadline = sent + std::time::Duration::from_secs(30);
    while last_delivery(&s, &healthy_id).await["status"] != "delivered" {
        assert!(
            std::time::Instant::now() < deadline,
            "the healthy subscription's ping was not delivered behind {backlog} due pings"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    sent.elapsed()
}

/// 300 pings due to a receiver that never answers hide no other
/// subscription's delivery: the sender takes each subscription's oldest
/// due delivery in turn. (`BERTH_TEST_WEBHOOK_BACKLOGS=0,300,3000` prints
/// the latency for each backlog, the figure the issue asks for.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_receivers_backlog_does_not_starve_another_subscription() {
    let backlogs: Vec<usize> = std::env::var("BERTH_TEST_WEBHOOK_BACKLOGS")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_else(|| vec![300]);
    for backlog in backlogs {
        let took = healthy_delivery_behind(backlog).await;
        eprintln!("a healthy delivery behind {backlog} due to a dead receiver: {took:?}");
    }
}

/// A subscription made while its origin was allowed is never sent to once
/// berth runs without that origin: its delivery fails `origin_not_allowed`
/// unsent. A URL with userinfo is refused at create.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_narrowed_webhook_origin_stops_old_subscriptions() {
    let (url, count) = receiver(Some(200)).await;
    let dir = temp_dir("narrowed-webhook-origin");
    let mut s = Server::start_in(
        dir,
        Options::default()
            .arg("--webhook-origin")
            .arg(&origin_of(&url)),
    )
    .await;
    let with_password = url.replacen("http://", "http://user:secret@", 1);
    let r = s
        .post(
            "/v1/webhooks",
            &json!({"url": with_password, "events": ["ping"]}),
        )
        .send()
        .await
        .unwrap();
    let (status, body) = read(r).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["fields"][0]["code"], "webhook_userinfo", "{body}");
    assert!(!body.to_string().contains("secret@"), "{body}");

    let id = subscribe(&s, &url).await;
    s.terminate();
    let at = s.args.iter().position(|a| a == "--webhook-origin").unwrap();
    s.args[at + 1] = "https://elsewhere.example.org".into();
    s.launch().await;
    ping(&s, &id).await;
    eventually("the delivery fails unsent", || async {
        let d = last_delivery(&s, &id).await;
        d["status"] == "failed" && d["last_error"] == "origin_not_allowed"
    })
    .await;
    assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// A destroy callback stored while its origin was allowed is dropped unsent
/// once berth runs without that origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_narrowed_callback_origin_drops_a_stored_callback() {
    use std::sync::atomic::Ordering;
    let (url, count) = receiver(Some(500)).await;
    let dir = temp_dir("narrowed-callback-origin");
    let mut s = Server::start_in(
        dir,
        Options::default()
            .arg("--callback-origin")
            .arg(&origin_of(&url)),
    )
    .await;
    let build = s.submit_ok("alice", json!({})).await;
    s.wait_build(&build, "succeeded").await;
    let r = s
        .delete("/v1/deployments/alice")
        .json(&json!({ "callback": url }))
        .send()
        .await
        .unwrap();
    let (status, body) = read(r).await;
    assert_eq!(status, 202, "{body}");
    let destroy = body["build_id"].as_str().unwrap().to_string();
    s.wait_build(&destroy, "succeeded").await;
    // Refused once (500), so it stays stored for its retry.
    eventually("the first attempt", || async {
        count.load(Ordering::SeqCst) >= 1
    })
    .await;
    s.kill();
    let before = count.load(Ordering::SeqCst);
    let at = s
        .args
        .iter()
        .position(|a| a == "--callback-origin")
        .unwrap();
    s.args[at + 1] = "https://elsewhere.example.org".into();
    s.launch().await;
    eventually("the stored callback is dropped", || async {
        s.log().contains("destroy callback dropped unsent")
    })
    .await;
    assert_eq!(
        count.load(Ordering::SeqCst),
        before,
        "sent after the origin left the list"
    );
}

/// Every refusal of a mutation after its caller is known is that caller's
/// audit event: a body of the wrong type (415), too large (413), headers
/// over 16 KiB (400); and a known callback actor refused on a
/// service-only route (`POST /v1/webhooks`) is recorded as that actor.
#[tokio::test]
async fn refusals_after_authentication_are_the_callers_audit_events() {
    const ALICE: &str = "alice@example.org";
    let handler: JsonHandler = std::sync::Arc::new(|q: serde_json::Value| {
        let answer = match q["token"].as_str() {
            Some("alice-token") => json!({"allow": true, "subject": ALICE}),
            _ => json!({"allow": false}),
        };
        (200, answer)
    });
    let (url, _callback) = json_server(handler).await;
    let s = Server::start(
        Options::default()
            .arg("--authz-url")
            .arg(&url)
            .arg("--max-body")
            .arg("4096"),
    )
    .await;
    let submit = || {
        s.http
            .post(s.url("/v1/deployments/alice/submit"))
            .bearer_auth("alice-token")
    };
    let wrong_type = submit()
        .header("content-type", "text/plain")
        .body(r#"{"configuration": {}}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(wrong_type.status(), 415);
    let too_large = submit()
        .header("content-type", "application/json")
        .body(vec![b' '; 8192])
        .send()
        .await
        .unwrap();
    assert_eq!(too_large.status(), 413);
    let big_headers = submit()
        .header("x-padding", "p".repeat(17 * 1024))
        .json(&json!({"configuration": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(big_headers.status(), 400);
    let webhook = s
        .http
        .post(s.url("/v1/webhooks"))
        .bearer_auth("alice-token")
        .json(&json!({"url": "http://127.0.0.1:9/hook", "events": ["ping"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(webhook.status(), 403);

    let (status, page) = s
        .json("/v1/audit?actor_subject=alice%40example.org&limit=20")
        .await;
    assert_eq!(status, 200, "{page}");
    let mut seen: Vec<(String, String, String)> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let field = |k: &str| e[k].as_str().unwrap_or("").to_string();
            (field("action"), field("result"), field("reason"))
        })
        .collect();
    seen.sort();
    let want = |a: &str, r: &str, why: &str| (a.to_string(), r.to_string(), why.to_string());
    let mut expected = vec![
        want("submit", "invalid", "unsupported_media_type"),
        want("submit", "invalid", "payload_too_large"),
        want("submit", "invalid", "invalid_request"),
        want("webhook_create", "denied", "forbidden"),
    ];
    expected.sort();
    assert_eq!(seen, expected, "{page:#}");
}

/// `--metrics-public` publishes no principal: who was denied is for the
/// service token's holder only; without it, only the sum.
#[tokio::test]
async fn public_metrics_name_no_principal() {
    let handler: JsonHandler = std::sync::Arc::new(|_q: serde_json::Value| {
        (
            200,
            json!({"allow": false, "subject": "mallory@example.org"}),
        )
    });
    let (url, _callback) = json_server(handler).await;
    let s = Server::start(
        Options::default()
            .arg("--authz-url")
            .arg(&url)
            .arg("--metrics-public"),
    )
    .await;
    let denied = s
        .http
        .post(s.url("/v1/deployments/alice/submit"))
        .bearer_auth("mallory-token")
        .json(&json!({"configuration": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(denied.status(), 403);
    let public = s
        .http
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!public.contains("mallory"), "{public}");
    assert!(
        public.contains("\nberth_denied_calls_total 1\n"),
        "{public}"
    );
    let private = s.metrics().await;
    assert!(
        private.contains("berth_denied_calls_total{principal=\"mallory@example.org\"} 1"),
        "{private}"
    );
}

/// A destroy ends a deployment's history as rollback targets: after it,
/// neither a named build from before it nor the default target restores
/// the last owner's configuration.
#[tokio::test]
async fn a_rollback_never_crosses_a_destroy() {
    let s = Server::start(Options::default()).await;
    let first = s.submit_ok("alice", json!({"owner": "first"})).await;
    s.wait_build(&first, "succeeded").await;
    let r = s.delete("/v1/deployments/alice").send().await.unwrap();
    let (status, body) = read(r).await;
    assert_eq!(status, 202, "{body}");
    let destroy = body["build_id"].as_str().unwrap().to_string();
    s.wait_build(&destroy, "succeeded").await;
    let second = s.submit_ok("alice", json!({"owner": "second"})).await;
    s.wait_build(&second, "succeeded").await;

    let rollback = |body: serde_json::Value| {
        s.post("/v1/deployments/alice/actions/rollback", &body)
            .send()
    };
    let (status, named) = read(rollback(json!({"build_id": first})).await.unwrap()).await;
    assert_eq!(status, 409, "{named}");
    assert_eq!(named["reason"], "rollback_target_invalid", "{named}");
    let (status, default) = read(rollback(json!({})).await.unwrap()).await;
    assert_eq!(status, 409, "{default}");
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["configuration"]["owner"], "second", "{d}");
}

/// Readers that connect to the snapshot socket and send nothing delay no
/// other: `berth audit verify` is served while they are still waited
/// for; and connections past the bound are told at once that berth is
/// busy, not queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_snapshot_readers_delay_nobody_and_are_bounded() {
    use std::io::{ErrorKind, Read};
    use std::os::unix::net::UnixStream;
    let s = Server::start(Options::default()).await;
    s.submit_ok("alice", json!({})).await;
    let data = s.dir.join("data");
    let socket = data.join("snapshots/berth.sock");
    let idle: Vec<UnixStream> = (0..3)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();
    let (code, report) = verify_json(&data);
    assert_eq!(code, 0, "{report}");
    for mut c in &idle {
        c.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 64];
        let still_waited_for =
            matches!(c.read(&mut buf), Err(e) if e.kind() == ErrorKind::WouldBlock);
        assert!(
            still_waited_for,
            "an idle reader was answered before verify was"
        );
    }
    // Five more fill the bound of eight; the ninth is told at once.
    let more: Vec<UnixStream> = (0..5)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();
    let mut ninth = UnixStream::connect(&socket).unwrap();
    let mut answer = String::new();
    ninth.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("error busy"), "{answer}");
    drop((idle, more));
}
