//! The command-line client (cli.md) run as a process against the real
//! server: commands good and refused (exit 3 with the field pointer on
//! stderr), `deploy --wait` of a failing build exits 1, `logs --follow`
//! through cut connections and a restart of berth prints every line once
//! and exits with the build's outcome, `--json` parses, no ANSI escapes
//! when stdout is not a terminal, and the token never shows.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use crate::harness::*;

/// `berth <args>` against `url` with the server's token file, `stdin`
/// given; its output.
fn cli(url: &str, token_file: &Path, args: &[&str], stdin: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(args)
        .env("BERTH_URL", url)
        .env("BERTH_TOKEN_FILE", token_file)
        .env_remove("BERTH_TOKEN")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn token_file(s: &Server) -> std::path::PathBuf {
    s.dir.join("data/service-token")
}

fn said(o: &Output) -> (i32, String, String) {
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A proxy on a fixed port whose target can change (berth restarts on a
/// new port) and whose open connections can be cut.
struct Proxy {
    url: String,
    target: Arc<Mutex<String>>,
    open: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Proxy {
    async fn start(target: &str) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let target = Arc::new(Mutex::new(target.to_string()));
        let open: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let (t, list) = (target.clone(), open.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let to = t.lock().unwrap().clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&to).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                list.lock().unwrap().push(task.abort_handle());
            }
        });
        Proxy { url, target, open }
    }

    fn cut(&self) {
        for h in self.open.lock().unwrap().drain(..) {
            h.abort();
        }
    }

    fn retarget(&self, to: &str) {
        *self.target.lock().unwrap() = to.to_string();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_command_once_good_and_once_refused() {
    let s = Server::start(Options::default()).await;
    let (url, tf) = (s.base.clone(), token_file(&s));
    let run = |args: &[&str], stdin: &str| said(&cli(&url, &tf, args, stdin));
    let token = std::fs::read_to_string(&tf).unwrap();
    let token = token.trim();
    let config =
        r#"{"domain": "alice.example.org", "applications": {"mastodon": {"enable": true}}}"#;

    // deploy: refused with the field pointer, then good with --wait.
    let (code, out, err) = run(&["deploy", "alice"], r#"{"domain": 5}"#);
    assert_eq!(code, 3, "{out}{err}");
    assert!(err.contains("/configuration/domain"), "{err}");
    let (code, out, err) = run(&["deploy", "alice", "--wait"], config);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("[berth] health step"),
        "the log is on stdout: {out}"
    );
    // preview: the changes of a submit.
    let (code, out, err) = run(&["preview", "alice", "--json"], config);
    assert_eq!(code, 0, "{err}");
    let preview: Value = serde_json::from_str(&out).unwrap();
    assert!(preview["changes"].is_array(), "{preview}");
    let (code, _, err) = run(&["preview", "alice"], "not json");
    assert_eq!(code, 2, "a usage error: {err}");
    let (code, _, err) = run(&["preview", "alice"], r#"{"domain": 5}"#);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("/configuration/domain"), "{err}");
    // status: the table and one deployment; a missing one is refused.
    let (code, out, _) = run(&["status"], "");
    assert_eq!(code, 0);
    assert!(out.starts_with("ID") && out.contains("alice"), "{out}");
    assert!(
        !out.contains('\u{1b}'),
        "no ANSI escapes into a pipe: {out:?}"
    );
    let (code, out, _) = run(&["status", "alice", "--json"], "");
    assert_eq!(code, 0);
    let status: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["deployment"]["id"], "alice", "{status}");
    let (code, _, err) = run(&["status", "ghost"], "");
    assert_eq!(code, 3, "{err}");
    // builds.
    let (code, out, _) = run(&["builds", "alice", "--json"], "");
    assert_eq!(code, 0);
    let builds: Value = serde_json::from_str(&out).unwrap();
    let first = builds["items"][0]["id"].as_str().unwrap().to_string();
    let (code, _, err) = run(&["builds", "ghost"], "");
    assert_eq!(code, 3, "{err}");
    let (code, _, err) = run(&["logs", "01a231a9-0000-7000-8000-000000000000"], "");
    assert_eq!(code, 3, "{err}");
    // rollback: nothing earlier yet (refused), then after a second deploy.
    let (code, _, err) = run(&["rollback", "alice"], "");
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("no_earlier_build"), "{err}");
    let second = r#"{"domain": "alice.example.org", "applications": {"mastodon": {"enable": true}, "homepage": {"enable": true}}}"#;
    let (code, _, err) = run(&["deploy", "alice", "--wait"], second);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = run(&["rollback", "alice", "--to", &first, "--wait"], "");
    assert_eq!(code, 0, "{out}{err}");
    // logs of a finished build: its outcome as the exit status.
    let (code, out, _) = run(&["logs", &first], "");
    assert_eq!(code, 0);
    assert_eq!(out, s.log_text(&first).await);
    // cancel: a finished build is refused; suspend/resume.
    let (code, _, err) = run(&["cancel", &first], "");
    assert_eq!(code, 3, "{err}");
    let (code, _, err) = run(&["resume", "alice"], "");
    assert_eq!(code, 3, "not suspended: {err}");
    let (code, out, err) = run(&["suspend", "alice", "--wait"], "");
    assert_eq!(code, 0, "{out}{err}");
    // delete: good, then refused for a deployment that is not there.
    let (code, _, err) = run(&["delete", "alice", "--wait"], "");
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run(&["delete", "nobody-here"], "");
    assert_eq!(code, 3, "{err}");
    // The actor the backend acts for is named with the service token.
    let (code, _, err) = run(
        &[
            "deploy",
            "carol",
            "--actor-subject",
            "carol@example.org",
            "--actor-issuer",
            "https://id.example.org",
        ],
        r#"{"domain": "carol.example.org"}"#,
    );
    assert_eq!(code, 0, "{err}");
    let (_, events) = s
        .json(
            "/v1/audit?actor_subject=carol%40example.org&actor_issuer=https%3A%2F%2Fid.example.org",
        )
        .await;
    assert_eq!(events["items"][0]["action"], "submit", "{events}");
    // Unreachable: exit 4.
    let o = cli("http://127.0.0.1:9", &tf, &["status"], "");
    assert_eq!(o.status.code(), Some(4));
    // The token never shows in anything printed.
    for args in [&["status"][..], &["status", "ghost"], &["logs", &first]] {
        let (_, out, err) = run(args, "");
        assert!(
            !out.contains(token) && !err.contains(token),
            "the token was printed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_wait_of_a_failing_build_exits_1() {
    let dir = temp_dir("cli-fail");
    let deployer = script(
        &dir,
        "fail.sh",
        &format!("{SCRIPT_PRELUDE}\necho about to fail\nexit 1\n"),
    );
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let (code, out, err) = said(&cli(
        &s.base,
        &token_file(&s),
        &["deploy", "f", "--wait"],
        "{}",
    ));
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("about to fail"), "{out}");
}

/// `logs --follow` through two cut connections and a kill -9 and restart
/// of berth: every line once, in order, and the build's exit status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_survives_cuts_and_a_restart_with_every_line_once() {
    let dir = temp_dir("cli-follow");
    let (deployer, gates) = {
        let gates = dir.join("gates");
        std::fs::create_dir_all(&gates).unwrap();
        let body = format!(
            "{SCRIPT_PRELUDE}\ni=0\nwhile [ $i -lt 300 ]; do i=$((i+1)); echo \"line $i\"; [ $((i % 30)) -eq 0 ] && sleep 0.1; done\nwhile [ ! -e {g}/go ]; do sleep 0.05; done\necho last\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"\n",
            g = gates.display()
        );
        (script(&dir, "follow.sh", &body), gates)
    };
    let mut s = Server::start(Options::default().deployer(&deployer)).await;
    let proxy = Proxy::start(s.base.trim_start_matches("http://")).await;
    let build = s.submit_ok("f", json!({})).await;
    let follower = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["logs", &build, "--follow"])
        .env("BERTH_URL", &proxy.url)
        .env("BERTH_TOKEN_FILE", token_file(&s))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    eventually("some lines are written", || async {
        s.build(&build).await["log_lines"].as_u64().unwrap_or(0) >= 60
    })
    .await;
    proxy.cut();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    proxy.cut();
    eventually("the deployer waits at its gate", || async {
        s.build(&build).await["log_lines"].as_u64().unwrap_or(0) >= 300
    })
    .await;
    // kill -9 and a restart: the running build is adopted or ended by
    // recovery; either way the follower gets the rest and the end.
    s.kill();
    std::fs::write(gates.join("go"), b"").unwrap();
    s.launch().await;
    proxy.retarget(s.base.trim_start_matches("http://"));
    let end = s.wait_build(&build, "final").await;
    let output = tokio::task::spawn_blocking(move || follower.wait_with_output().unwrap())
        .await
        .unwrap();
    let (code, out, err) = said(&output);
    let stored = s.log_text(&build).await;
    assert_eq!(out, stored, "every line once, in order\nstderr: {err}");
    let expected = match end["status"].as_str() {
        Some("succeeded") => 0,
        Some("cancelled") => 5,
        _ => 1,
    };
    assert_eq!(code, expected, "the build's outcome: {end}\n{err}");
}

/// Colour only on a terminal, never with NO_COLOR (util-linux `script`
/// gives the client a terminal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colour_only_on_a_terminal_and_never_with_no_color() {
    if Command::new("script").arg("--version").output().is_err() {
        skip(
            "cli::colour_only_on_a_terminal_and_never_with_no_color",
            "no util-linux `script` to give the client a terminal",
        );
        return;
    }
    let s = Server::start(Options::default()).await;
    let b = s.submit_ok("alice", json!({})).await;
    s.wait_build(&b, "final").await;
    let on_terminal = |no_color: bool| {
        let mut c = Command::new("script");
        c.args(["-qec"])
            .arg(format!("{} status", env!("CARGO_BIN_EXE_berth")))
            .arg("/dev/null")
            .env("BERTH_URL", &s.base)
            .env("BERTH_TOKEN_FILE", token_file(&s))
            .env_remove("NO_COLOR");
        if no_color {
            c.env("NO_COLOR", "1");
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let coloured = on_terminal(false);
    assert!(
        coloured.contains("\u{1b}[32m"),
        "a terminal gets colour: {coloured:?}"
    );
    let plain = on_terminal(true);
    assert!(
        plain.contains("alice") && !plain.contains('\u{1b}'),
        "NO_COLOR: {plain:?}"
    );
}

/// A mutation whose answer is lost on the way back is retried with the
/// same idempotency key: berth answers the stored 202 and queues one build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_deploy_after_a_lost_answer_queues_once() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = Server::start(Options::default()).await;
    let target = s.base.trim_start_matches("http://").to_string();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    // The first connection reaches berth, but its answer never comes back;
    // later ones pass.
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((mut inbound, _)) = listener.accept().await {
            let to = target.clone();
            let swallow = std::mem::replace(&mut first, false);
            tokio::spawn(async move {
                let Ok(mut outbound) = tokio::net::TcpStream::connect(&to).await else {
                    return;
                };
                if swallow {
                    let mut request = vec![0u8; 65536];
                    let n = inbound.read(&mut request).await.unwrap_or(0);
                    let _ = outbound.write_all(&request[..n]).await;
                    let mut answer = [0u8; 4096];
                    let _ = outbound.read(&mut answer).await;
                    // Dropped: the client sees the connection close.
                    return;
                }
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    });
    let (code, out, err) = said(&cli(
        &url,
        &token_file(&s),
        &["deploy", "once"],
        r#"{"domain": "once.example.org"}"#,
    ));
    assert_eq!(code, 0, "{out}{err}");
    let (_, page) = s.json("/v1/deployments/once/builds").await;
    let builds = page["items"].as_array().unwrap();
    assert_eq!(builds.len(), 1, "queued twice: {page}");
    assert_eq!(
        builds[0]["id"],
        out.trim(),
        "the retry got the stored answer"
    );
}

#[test]
fn completions_and_the_man_page_come_from_the_flags() {
    let bash = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert!(bash.status.success());
    let script = String::from_utf8_lossy(&bash.stdout);
    assert!(
        script.contains("berth__deploy") || script.contains("deploy"),
        "{script}"
    );
    let man = Command::new(env!("CARGO_BIN_EXE_berth"))
        .arg("man")
        .output()
        .unwrap();
    assert!(man.status.success());
    let page = String::from_utf8_lossy(&man.stdout);
    assert!(
        page.contains(".TH berth 1") && page.contains("deploy"),
        "{page}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_of_a_running_build_and_its_follower_exits_5() {
    let dir = temp_dir("cli-cancel");
    let (deployer, _gates) = gated_deployer(&dir);
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let build = s.submit_ok("c", json!({})).await;
    s.wait_build(&build, "running").await;
    let follower = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["logs", &build, "--follow"])
        .env("BERTH_URL", &s.base)
        .env("BERTH_TOKEN_FILE", token_file(&s))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (code, out, err) = said(&cli(&s.base, &token_file(&s), &["cancel", &build], ""));
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with(&build), "{out}");
    let output = tokio::task::spawn_blocking(move || follower.wait_with_output().unwrap())
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(5), "a cancelled build's outcome");
}
