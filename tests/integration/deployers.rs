//! Deployers that misbehave: every case ends in the documented build
//! failure reason, and the server keeps serving.

use serde_json::json;

use crate::harness::*;

async fn run_with(body: &str, extra: &[&str]) -> (Server, serde_json::Value) {
    let dir = temp_dir("deployer");
    let deployer = script(&dir, "d.sh", &format!("{SCRIPT_PRELUDE}\n{body}"));
    let mut opts = Options::default().deployer(&deployer);
    for a in extra {
        opts = opts.arg(a);
    }
    let s = Server::start_in(dir, opts).await;
    let id = s.submit_ok("alice", json!({})).await;
    let b = s.wait_build(&id, "final").await;
    (s, b)
}

#[tokio::test]
async fn exit_1_fails_with_exit_status_and_keeps_the_log() {
    let (s, b) = run_with("echo 'about to fail'; echo 'to stderr' >&2; exit 1", &[]).await;
    assert_eq!(
        (
            b["status"].as_str(),
            b["failure"]["reason"].as_str(),
            b["exit_code"].as_i64()
        ),
        (Some("failed"), Some("exit_status"), Some(1))
    );
    let log = s.log_text(b["id"].as_str().unwrap()).await;
    assert!(
        log.contains("about to fail\n") && log.contains("to stderr\n"),
        "{log}"
    );
}

#[tokio::test]
async fn protocol_errors() {
    for body in [
        "echo not-json > \"$BERTH_RESULT\"",
        "true",                                                         // no result at all
        "printf '%s' '{\"nodes\": 5}' > \"$BERTH_RESULT\"",             // wrong shape
        "head -c 2097152 /dev/zero | tr '\\0' ' ' > \"$BERTH_RESULT\"", // 2 MiB result
    ] {
        let (_s, b) = run_with(body, &[]).await;
        assert_eq!(b["status"], "failed", "{body}: {b}");
        assert_eq!(b["failure"]["reason"], "deployer_protocol", "{body}: {b}");
    }
}

#[tokio::test]
async fn an_sbom_outside_the_scratch_dir_fails_only_that_sbom() {
    let (s, b) = run_with(
        "ln -s /etc/passwd \"$BERTH_SCRATCH_DIR/link.json\"\nprintf '%s' '{\"nodes\":[{\"name\":\"web\",\"changed\":true,\"sbom\":{\"status\":\"ready\",\"path\":\"../../../etc/passwd\"}},{\"name\":\"db\",\"changed\":true,\"sbom\":{\"status\":\"ready\",\"path\":\"link.json\"}}]}' > \"$BERTH_RESULT\"",
        &[],
    )
    .await;
    assert_eq!(b["status"], "succeeded", "{b}");
    let log = s.log_text(b["id"].as_str().unwrap()).await;
    assert!(
        log.contains("node web: SBOM unavailable: the path leaves the scratch dir"),
        "{log}"
    );
    assert!(
        log.contains("node db: SBOM unavailable: the path goes through a symlink"),
        "{log}"
    );
}

#[tokio::test]
async fn a_deployer_that_never_exits_times_out() {
    let (s, b) = run_with(
        "echo started; sleep 600",
        &["--build-timeout", "1s", "--cancel-grace", "1s"],
    )
    .await;
    assert_eq!(b["status"], "failed");
    assert_eq!(b["failure"]["reason"], "timeout");
    assert!(s
        .log_text(b["id"].as_str().unwrap())
        .await
        .contains("started"));
}

#[tokio::test]
async fn sigterm_ignored_gets_sigkill_after_grace() {
    let dir = temp_dir("stubborn");
    let marker = dir.join("child-alive");
    let body = format!(
        "{SCRIPT_PRELUDE}\ntrap '' TERM\n(trap '' TERM; while true; do touch {m}; sleep 0.05; done) &\necho stubborn\nwhile true; do sleep 0.05; done\n",
        m = marker.display()
    );
    let deployer = script(&dir, "d.sh", &body);
    let s = Server::start_in(
        dir.clone(),
        Options::default()
            .deployer(&deployer)
            .arg("--cancel-grace")
            .arg("1s"),
    )
    .await;
    let id = s.submit_ok("alice", json!({})).await;
    s.wait_build(&id, "running").await;
    eventually("the deployer logs", || async {
        s.log_text(&id).await.contains("stubborn")
    })
    .await;
    let started = std::time::Instant::now();
    s.post(&format!("/v1/builds/{id}/cancel"), &json!({}))
        .send()
        .await
        .unwrap();
    let b = s.wait_build(&id, "final").await;
    assert_eq!(b["status"], "cancelled");
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(900),
        "SIGKILL came before the grace period"
    );
    // The background child of the deployer died with its process group.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let _ = std::fs::remove_file(&marker);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        !marker.exists(),
        "a child of the deployer outlived its build"
    );
}

#[tokio::test]
async fn long_lines_garbage_and_a_last_line_without_newline() {
    let (s, b) = run_with("head -c 150000 /dev/zero | tr '\\0' 'x'; echo; printf 'bad \\377\\376 bytes\\n'; printf 'no newline'; printf '%s' '{\"nodes\":[]}' > \"$BERTH_RESULT\"", &[]).await;
    assert_eq!(b["status"], "succeeded", "{b}");
    let log = s.log_text(b["id"].as_str().unwrap()).await;
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines[0].len(), 65536);
    assert_eq!(lines[1].len(), 65536);
    assert_eq!(lines[2].len(), 150000 - 2 * 65536);
    assert_eq!(lines[3], "bad \u{fffd}\u{fffd} bytes");
    assert_eq!(lines[4], "no newline");
    assert_eq!(b["log_lines"], 5);
}

#[tokio::test]
async fn eval_outcomes() {
    // A deployer whose eval crashes: submit and preview get 503 eval_crashed.
    let dir = temp_dir("eval");
    let deployer = script(
        &dir,
        "d.sh",
        "case \"$1\" in describe) cat >/dev/null; printf '%s' '{\"methods\":[\"local\"],\"default_method\":\"local\",\"catalog\":[],\"schema\":null}' > \"$BERTH_RESULT\";; eval) exit 3;; esac",
    );
    let s = Server::start_in(dir, Options::default().deployer(&deployer)).await;
    let (status, p) = s.submit("alice", json!({"configuration": {}})).await;
    assert_eq!(status, 503, "{p}");
    assert_eq!(
        (p["code"].as_str(), p["reason"].as_str()),
        (Some("eval_unavailable"), Some("eval_crashed"))
    );
    let (status, _) = s.json("/v1/deployments/alice").await;
    assert_eq!(status, 404);
    // With no eval slot, submit skips the eval and preview answers 503 with Retry-After.
    drop(s);
    let s = Server::start(Options::default().arg("--eval-slots").arg("0")).await;
    let r = s
        .post(
            "/v1/deployments/alice/preview",
            &json!({"configuration": {}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    // Skipping the eval: the deploy evaluates, and fails on a refused configuration.
    let b = s
        .submit_ok(
            "alice",
            json!({"applications": {"mastodon": {"enable": true}}}),
        )
        .await;
    let b = s.wait_build(&b, "final").await;
    assert_eq!(b["status"], "failed");
    assert!(s
        .log_text(b["id"].as_str().unwrap())
        .await
        .contains("needs a domain"));
}

#[tokio::test]
async fn flag_values_never_reach_the_deployer() {
    let dir = temp_dir("env");
    let deployer = script(
        &dir,
        "d.sh",
        &format!(
            "{SCRIPT_PRELUDE}\nenv | sort\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\""
        ),
    );
    let opts = Options::default()
        .deployer(&deployer)
        .env("BERTH_SECRET_DATABASE_URL", "postgres://user:hunter2@db/x")
        .env("BERTH_LOCAL_STEP_MS", "7")
        .env("UNRELATED_VAR", "kept");
    let s = Server::start_in(dir, opts).await;
    let id = s.submit_ok("alice", json!({})).await;
    s.wait_build(&id, "succeeded").await;
    let log = s.log_text(&id).await;
    assert!(!log.contains("hunter2"), "{log}");
    assert!(log.contains("UNRELATED_VAR=kept"));
    // The embedded deployer's knobs are its own, not another deployer's.
    assert!(!log.contains("BERTH_LOCAL_STEP_MS"), "{log}");
    assert!(
        log.contains("BERTH_WORK_DIR=")
            && log.contains("BERTH_SCRATCH_DIR=")
            && log.contains("BERTH_RESULT=")
    );
}

#[tokio::test]
async fn an_eval_that_never_answers_times_out() {
    let dir = temp_dir("eval-timeout");
    let deployer = script(
        &dir,
        "d.sh",
        "case \"$1\" in describe) cat >/dev/null; printf '%s' '{\"methods\":[\"local\"],\"default_method\":\"local\",\"catalog\":[],\"schema\":null}' > \"$BERTH_RESULT\";; eval) sleep 600;; esac",
    );
    let s = Server::start_in(
        dir,
        Options::default()
            .deployer(&deployer)
            .arg("--eval-timeout")
            .arg("1s"),
    )
    .await;
    let (status, p) = s.submit("alice", json!({"configuration": {}})).await;
    assert_eq!(status, 503, "{p}");
    assert_eq!(p["reason"], "eval_timeout");
    let (status, _) = s.json("/v1/deployments/alice").await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn sources_are_immutable_and_origins_checked() {
    let s = Server::start(
        Options::default()
            .arg("--source-origin")
            .arg("https://git.example.org"),
    )
    .await;
    let digest = format!("sha256:{}", "ab".repeat(32));
    let source = json!({"url": "https://git.example.org/modules", "rev": "v1", "digest": digest});
    let (status, p) = s
        .submit("alice", json!({"configuration": {}, "source": source}))
        .await;
    assert_eq!(status, 202, "{p}");
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["source"], source);
    // Same digest, another rev: refused.
    let other = json!({"url": "https://git.example.org/modules", "rev": "v2", "digest": digest});
    let (status, p) = s
        .submit("bob", json!({"configuration": {}, "source": other}))
        .await;
    assert_eq!(
        (status, p["reason"].as_str()),
        (409, Some("source_immutable")),
        "{p}"
    );
    // An origin not allowed.
    let foreign = json!({"url": "https://evil.example.com/m", "rev": "v1", "digest": format!("sha256:{}", "cd".repeat(32))});
    let (status, p) = s
        .submit("bob", json!({"configuration": {}, "source": foreign}))
        .await;
    assert_eq!(
        (status, p["fields"][0]["code"].as_str()),
        (400, Some("source_origin_not_allowed")),
        "{p}"
    );
    // An explicit source needs the manual policy.
    let (status, p) = s
        .submit(
            "carol",
            json!({"configuration": {}, "source": source, "update_policy": {"kind": "automatic"}}),
        )
        .await;
    assert_eq!(
        (status, p["reason"].as_str()),
        (409, Some("policy_not_manual")),
        "{p}"
    );
    // A window policy is validated field by field.
    let (status, p) = s
        .submit("carol", json!({"configuration": {}, "update_policy": {"kind": "window", "frequency": "weekly", "day": 9, "start": "03:00", "duration_minutes": 120, "time_zone": "Europe/Amsterdam"}}))
        .await;
    assert_eq!(
        (status, p["fields"][0]["pointer"].as_str()),
        (400, Some("/update_policy/day")),
        "{p}"
    );
    let (status, _) = s.json("/v1/deployments/carol").await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn a_deployer_that_cannot_start_fails_the_build() {
    let dir = temp_dir("vanish");
    let (deployer, gates) = gated_deployer(&dir);
    let s = Server::start_in(
        dir,
        Options::default()
            .deployer(&deployer)
            .arg("--build-slots")
            .arg("1"),
    )
    .await;
    let first = s.submit_ok("alice", json!({})).await;
    s.wait_build(&first, "running").await;
    // Running is stored before the deployer has its script open: alice's
    // must be reading it (its first line written) before the file goes,
    // or it too finds nothing to run.
    let started = gates.join("alice.log");
    eventually("alice's deployer runs its script", || {
        let started = started.clone();
        async move { started.exists() }
    })
    .await;
    let second = s.submit_ok("bob", json!({})).await;
    // The executable goes away while bob waits for the slot.
    std::fs::remove_file(&deployer).unwrap();
    open_gate(&gates, "alice");
    s.wait_build(&first, "succeeded").await;
    let b = s.wait_build(&second, "final").await;
    assert_eq!(b["status"], "failed");
    assert_eq!(b["failure"]["reason"], "spawn_failed", "{b}");
    assert!(s
        .log_text(&second)
        .await
        .contains("cannot start the deployer"));
    // The server keeps serving and the deployment can be retried later.
    let (status, _) = s.json("/v1/deployments/bob").await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn deployers_run_as_the_deployer_user_and_cannot_read_secrets() {
    let nobody = nix::unistd::User::from_name("nobody").ok().flatten();
    let (true, Some(nobody)) = (nix::unistd::Uid::effective().is_root(), nobody) else {
        skip(
            "deployers_run_as_the_deployer_user_and_cannot_read_secrets",
            "needs root and a `nobody` user",
        );
        return;
    };
    let dir = temp_dir("user");
    let data = dir.join("data");
    let body = format!(
        "{SCRIPT_PRELUDE}\necho \"uid=$(id -u)\"\nif cat {data}/service-token >/dev/null 2>&1; then echo TOKEN-READABLE; else echo token-protected; fi\nif cat {data}/berth.redb >/dev/null 2>&1; then echo STORE-READABLE; else echo store-protected; fi\ntouch \"$BERTH_WORK_DIR/mine\" && echo work-writable\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"",
        data = data.display()
    );
    let deployer = script(&dir, "d.sh", &body);
    let s = Server::start_in(
        dir.clone(),
        Options::default()
            .deployer(&deployer)
            .arg("--deployer-user")
            .arg("nobody"),
    )
    .await;
    let id = s.submit_ok("alice", json!({})).await;
    let b = s.wait_build(&id, "final").await;
    let log = s.log_text(&id).await;
    assert_eq!(b["status"], "succeeded", "{b}\n{log}");
    assert!(log.contains(&format!("uid={}", nobody.uid)), "{log}");
    assert!(
        log.contains("token-protected") && log.contains("store-protected"),
        "{log}"
    );
    assert!(log.contains("work-writable"), "{log}");
}

/// The nix deployer run by hand (outside `berth serve`) says which variable
/// berth would have set, and writes no result, instead of building in the
/// current directory.
#[test]
fn the_nix_deployer_without_its_directories_says_which_is_missing() {
    let dir = crate::harness::temp_dir("nix-by-hand");
    let result = dir.join("result.json");
    let request = serde_json::json!({
        "deployment": "d",
        "build": "b",
        "method": "nix",
        "configuration": {},
        "source": {"url": dir.display().to_string(), "digest": "sha256:00"},
        "suspended": false,
        "previous": null,
    });
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["deployer", "nix", "deploy"])
        .env("BERTH_RESULT", &result)
        .env_remove("BERTH_WORK_DIR")
        .env_remove("BERTH_SCRATCH_DIR")
        .current_dir(&dir)
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(request.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("BERTH_WORK_DIR is not set"), "{stderr}");
    assert!(!result.exists(), "no result is written");
}
