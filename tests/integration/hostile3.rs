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
