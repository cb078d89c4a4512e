//! The Nix deployer's safe activation over a real SSH connection
//! (deployer.md "The built-in Nix deployer", lifecycle.md "Health checks
//! and automatic rollback"): a real `sshd` (Debian's openssh-server) on a
//! loopback port with generated host and user keys is the target; the
//! deployer copies with `nix-copy-closure --to` and activates with `ssh --
//! host ...`. The example source's toplevels record what the target
//! activates, and tests/data/nix-target/systemctl (first on the target's
//! PATH) reports a toplevel built with `broken = true` as a failed unit.
//!
//! What a user would check: a good deploy is confirmed and becomes the
//! boot entry; a broken one fails its check and the automatic rollback
//! re-activates the previous toplevel without building anything (its GC
//! root kept it); a deploy whose `confirm` never comes (berth killed during
//! the health step) is reverted by the target itself after
//! `BERTH_NIX_CONFIRM_TIMEOUT`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::*;
use crate::nix::{example_source, nix_can_build, nix_options};

/// A real sshd on 127.0.0.1 for this test: its own host key, one user key,
/// and a client config (`ssh -F`) naming it `berth-target`.
struct Sshd {
    child: Child,
    ssh_config: PathBuf,
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn keygen(path: &Path) {
    let made = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .status()
        .unwrap();
    assert!(made.success(), "ssh-keygen");
}

/// Starts sshd with `path` first on its sessions' PATH and `machine` as
/// the example's state dir; `None` (with the reason said) when this
/// machine has no sshd.
fn start_sshd(test: &str, dir: &Path, path: &Path, machine: &Path) -> Option<Sshd> {
    let sshd = Path::new("/usr/sbin/sshd");
    if !sshd.exists() || Command::new("ssh-keygen").arg("-?").output().is_err() {
        skip(
            test,
            "no /usr/sbin/sshd or ssh-keygen (Debian's openssh-server; .ci/run installs it)",
        );
        return None;
    }
    // sshd refuses to start without its privilege separation directory.
    let _ = std::fs::create_dir_all("/run/sshd");
    let user = String::from_utf8(Command::new("id").arg("-un").output().unwrap().stdout)
        .unwrap()
        .trim()
        .to_string();
    keygen(&dir.join("host_key"));
    keygen(&dir.join("user_key"));
    std::fs::copy(dir.join("user_key.pub"), dir.join("authorized_keys")).unwrap();
    let host_public = std::fs::read_to_string(dir.join("host_key.pub")).unwrap();
    // A port the kernel gave a moment ago; sshd is started again on a new
    // one if another process took it meanwhile.
    for _ in 0..5 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.join("sshd_config");
        std::fs::write(
            &config,
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\nPidFile {d}/sshd.pid\n\
                 AuthorizedKeysFile {d}/authorized_keys\nStrictModes no\nUsePAM no\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\n\
                 PermitRootLogin prohibit-password\n\
                 SetEnv PATH={path}:/usr/local/bin:/usr/bin:/bin BERTH_EXAMPLE_STATE={machine}\n",
                d = dir.display(),
                path = path.display(),
                machine = machine.display(),
            ),
        )
        .unwrap();
        let mut child = Command::new(sshd)
            .args(["-D", "-e", "-f"])
            .arg(&config)
            .stderr(std::fs::File::create(dir.join("sshd.log")).unwrap())
            .spawn()
            .unwrap();
        let ssh_config = dir.join("ssh_config");
        std::fs::write(
            dir.join("known_hosts"),
            format!("[127.0.0.1]:{port} {host_public}"),
        )
        .unwrap();
        std::fs::write(
            &ssh_config,
            format!(
                "Host berth-target\n  HostName 127.0.0.1\n  Port {port}\n  User {user}\n\
                 IdentityFile {d}/user_key\n  IdentitiesOnly yes\n\
                 UserKnownHostsFile {d}/known_hosts\n  StrictHostKeyChecking yes\n\
                 BatchMode yes\n  ConnectTimeout 5\n",
                d = dir.display()
            ),
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            let probe = Command::new("ssh")
                .arg("-F")
                .arg(&ssh_config)
                .args(["--", "berth-target", "echo ready"])
                .stdin(Stdio::null())
                .output()
                .unwrap();
            if String::from_utf8_lossy(&probe.stdout).trim() == "ready" {
                return Some(Sshd { child, ssh_config });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!(
        "sshd did not come up: {}",
        std::fs::read_to_string(dir.join("sshd.log")).unwrap_or_default()
    );
}

fn configuration(theme: &str, broken: bool) -> Value {
    json!({"domain": "alice.example.org", "applications": {
        "mastodon": {"enable": true, "target": "berth-target", "theme": theme, "broken": broken},
    }})
}

/// What the target's state dir says: the active system, the boot entry.
fn machine(state: &Path) -> (String, String) {
    let read = |f: &str| {
        std::fs::read_to_string(state.join(f))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    (read("active"), read("boot"))
}

fn millis(at: &Value) -> i128 {
    let text = at.as_str().expect("a time");
    let t = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
        .expect("an RFC 3339 time");
    t.unix_timestamp_nanos() / 1_000_000
}

fn took_ms(build: &Value) -> i128 {
    millis(&build["finished_at"]) - millis(&build["started_at"])
}

async fn builds(s: &Server) -> Vec<Value> {
    let (status, page) = s.json("/v1/deployments/alice/builds?limit=50").await;
    assert_eq!(status, 200, "{page}");
    page["items"].as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn activation_over_ssh_is_confirmed_checked_rolled_back_and_reverted_by_the_target() {
    let test =
        "nix_ssh::activation_over_ssh_is_confirmed_checked_rolled_back_and_reverted_by_the_target";
    if !nix_can_build(test) {
        return;
    }
    let dir = temp_dir("nix-ssh");
    let state = dir.join("machine");
    let stand_ins = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/nix-target");
    let Some(sshd) = start_sshd(test, &dir, &stand_ins, &state) else {
        return;
    };
    std::fs::create_dir_all(dir.join("profiles")).unwrap();
    let profile = dir.join("profiles/system");
    let source = example_source();
    let mut s = Server::start(
        nix_options(&source)
            .env("NIX_SSHOPTS", &format!("-F {}", sshd.ssh_config.display()))
            // Room for ssh on a loaded machine: each check may take 3 s,
            // the checks 9 s, the revert fires 20 s after an activation.
            .env("BERTH_NIX_CONFIRM_TIMEOUT", "20")
            .env("BERTH_NIX_PROFILE", profile.to_str().unwrap())
            .env(
                "BERTH_NIX_TARGET_DIR",
                dir.join("target-dir").to_str().unwrap(),
            )
            .arg("--health-interval")
            .arg("3s")
            .arg("--health-timeout")
            .arg("9s"),
    )
    .await;

    // A good deploy: activated with `test`, checked, confirmed: the boot
    // entry and the system profile are the new toplevel.
    let first_started = Instant::now();
    let b1 = s.submit_ok("alice", configuration("light", false)).await;
    let end1 = s.wait_build(&b1, "final").await;
    let first_deploy = first_started.elapsed();
    assert_eq!(
        end1["status"],
        "succeeded",
        "{end1}\n{}",
        s.log_text(&b1).await
    );
    let (active1, boot1) = machine(&state);
    assert!(active1.starts_with("/nix/store/"), "{active1}");
    assert_eq!(boot1, active1, "confirm made it the boot entry");
    assert_eq!(
        std::fs::canonicalize(&profile).unwrap(),
        PathBuf::from(&active1),
        "confirm set the system profile"
    );
    let log1 = s.log_text(&b1).await;
    assert!(log1.contains("copying mastodon to berth-target"), "{log1}");

    // A second good deploy; the first stays kept for a rollback.
    let b2 = s.submit_ok("alice", configuration("dark", false)).await;
    let end2 = s.wait_build(&b2, "final").await;
    assert_eq!(
        end2["status"],
        "succeeded",
        "{end2}\n{}",
        s.log_text(&b2).await
    );
    let (active2, boot2) = machine(&state);
    assert_ne!(active2, active1);
    assert_eq!(boot2, active2);
    let log2 = s.log_text(&b2).await;
    assert!(
        log2.contains("armed: back to the previous system"),
        "{log2}"
    );
    // Its GC root keeps the first toplevel alive.
    let deleted = Command::new("nix-store")
        .args(["--delete", &active1])
        .output()
        .unwrap();
    assert!(
        !deleted.status.success() && std::path::Path::new(&active1).exists(),
        "a kept toplevel could be deleted: {}",
        String::from_utf8_lossy(&deleted.stderr)
    );

    // A broken deploy: activated, its check fails (systemctl says
    // degraded), and the automatic rollback re-activates the second
    // toplevel without building.
    let b3 = s.submit_ok("alice", configuration("dark", true)).await;
    let end3 = s.wait_build(&b3, "final").await;
    assert_eq!(end3["status"], "failed", "{end3}");
    assert_eq!(end3["failure"]["reason"], "health_check_failed", "{end3}");
    let detail = end3["failure"]["detail"].as_str().unwrap_or("");
    assert!(
        detail.contains("degraded") && detail.contains("example-app.service"),
        "{detail}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut rollback = None;
    while rollback.is_none() {
        assert!(
            Instant::now() < deadline,
            "no automatic rollback was queued: {:?}",
            builds(&s).await
        );
        rollback = builds(&s)
            .await
            .into_iter()
            .find(|b| b["trigger"] == "automatic_rollback");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rollback = rollback.unwrap();
    assert_eq!(rollback["rollback_of"], json!(b2), "{rollback}");
    let rb = rollback["id"].as_str().unwrap().to_string();
    let end_rb = s.wait_build(&rb, "final").await;
    assert_eq!(
        end_rb["status"],
        "succeeded",
        "{end_rb}\n{}",
        s.log_text(&rb).await
    );
    let log_rb = s.log_text(&rb).await;
    assert!(
        !log_rb.contains("will be built") && !log_rb.contains("building '/nix/store"),
        "the rollback built something:\n{log_rb}"
    );
    let (active_rb, boot_rb) = machine(&state);
    assert_eq!(
        active_rb, active2,
        "the rollback re-activated the second toplevel"
    );
    assert_eq!(boot_rb, active2);
    let history = std::fs::read_to_string(state.join("history")).unwrap();
    println!(
        "nix rollback figures: first deploy end to end {first_deploy:?}; deploy builds {} ms, {} ms; automatic rollback build {} ms (health interval 3 s)",
        took_ms(&end1),
        took_ms(&end2),
        took_ms(&end_rb)
    );

    // A deploy whose confirm never comes: berth is killed once the target
    // runs it, and the target goes back by itself after the timeout.
    let b4 = s.submit_ok("alice", configuration("blue", true)).await;
    eventually("the broken system is active on the target", || {
        let state = &state;
        let active2 = &active2;
        async move { !machine(state).0.is_empty() && machine(state).0 != *active2 }
    })
    .await;
    s.kill();
    let killed_at = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(90);
    while machine(&state).0 != active2 {
        assert!(
            Instant::now() < deadline,
            "the target did not revert by itself"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reverted_after = killed_at.elapsed();
    let (_, boot_after) = machine(&state);
    assert_eq!(boot_after, active2, "the boot entry never changed");
    let history_after = std::fs::read_to_string(state.join("history")).unwrap();
    assert!(
        history_after.len() > history.len()
            && history_after
                .trim_end()
                .ends_with(&format!("test {active2}")),
        "{history_after}"
    );
    println!("the target reverted {reverted_after:?} after berth was killed (BERTH_NIX_CONFIRM_TIMEOUT 20 s from the activation)");
    // After a restart the rollout goes on (rollouts.md): its gate finds
    // the node unhealthy or gone back, it aborts, and the automatic
    // rollback follows; the target stays on the second toplevel.
    s.launch().await;
    let end4 = s.wait_build(&b4, "final").await;
    assert_eq!(end4["status"], "failed", "{end4}");
    assert_eq!(end4["failure"]["reason"], "health_check_failed", "{end4}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let rollbacks: Vec<Value> = builds(&s)
            .await
            .into_iter()
            .filter(|b| b["trigger"] == "automatic_rollback")
            .collect();
        if rollbacks.len() == 2 && rollbacks.iter().all(|b| b["status"] == "succeeded") {
            break;
        }
        assert!(Instant::now() < deadline, "{rollbacks:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(machine(&state), (active2.clone(), active2.clone()));
    drop(sshd);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Hostile input round two, item 11: a node's target comes from the
/// source (here from a tenant's configuration) and reaches `ssh` and
/// `nix-copy-closure`; one that ssh would read as an option is refused
/// before either runs, so no ProxyCommand ever starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_is_an_ssh_option_never_reaches_ssh() {
    let test = "nix_ssh::a_target_that_is_an_ssh_option_never_reaches_ssh";
    if !nix_can_build(test) {
        return;
    }
    let dir = temp_dir("nix-ssh-option");
    let marker = dir.join("proxy-command-ran");
    let s = Server::start(nix_options(&example_source())).await;
    let hostile = format!("-oProxyCommand=touch {}", marker.display());
    let b = s
        .submit_ok(
            "mallory",
            json!({"domain": "mallory.example.org", "applications": {
                "mastodon": {"enable": true, "target": hostile}}}),
        )
        .await;
    let end = s.wait_build(&b, "final").await;
    assert_eq!(end["status"], "failed", "{end}");
    let log = s.log_text(&b).await;
    assert!(log.contains("is not an SSH destination"), "{log}");
    assert!(!marker.exists(), "ssh ran the target's ProxyCommand");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two nodes: `mastodon` on the SSH target, `forgejo` built only.
fn two_nodes(theme: &str) -> Value {
    json!({"domain": "alice.example.org", "applications": {
        "mastodon": {"enable": true, "target": "berth-target", "theme": theme},
        "forgejo": {"enable": true, "theme": theme},
    }})
}

async fn put_policy(s: &Server, policy: Value) {
    let r = s
        .http
        .put(s.url("/v1/deployments/alice/rollout-policy"))
        .bearer_auth(&s.token)
        .json(&policy)
        .send()
        .await
        .unwrap();
    let (status, body) = read(r).await;
    assert_eq!(status, 200, "{body}");
}

/// rollouts.md "The deployers": the Nix deployer's `activate` per node over
/// a real sshd, in two waves with a wait longer than the target's revert
/// timeout between them (the watch's checks re-arm the revert, so the node
/// never goes back), then an abort after the first wave that puts the
/// node back on its previous system.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nix_rollout_keeps_its_revert_alive_across_a_long_wait_and_an_abort_puts_the_node_back() {
    let test = "nix_ssh::a_nix_rollout_keeps_its_revert_alive_across_a_long_wait_and_an_abort_puts_the_node_back";
    if !nix_can_build(test) {
        return;
    }
    let dir = temp_dir("nix-ssh-rollout");
    let state = dir.join("machine");
    let stand_ins = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/nix-target");
    let Some(sshd) = start_sshd(test, &dir, &stand_ins, &state) else {
        return;
    };
    std::fs::create_dir_all(dir.join("profiles")).unwrap();
    let profile = dir.join("profiles/system");
    let s = Server::start(
        nix_options(&example_source())
            .env("NIX_SSHOPTS", &format!("-F {}", sshd.ssh_config.display()))
            .env("BERTH_NIX_CONFIRM_TIMEOUT", "12")
            .env("BERTH_NIX_PROFILE", profile.to_str().unwrap())
            .env(
                "BERTH_NIX_TARGET_DIR",
                dir.join("target-dir").to_str().unwrap(),
            )
            .arg("--health-interval")
            .arg("3s")
            .arg("--health-timeout")
            .arg("20s")
            .arg("--rollout-watch-interval")
            .arg("5s"),
    )
    .await;
    let b1 = s.submit_ok("alice", two_nodes("light")).await;
    let end1 = s.wait_build(&b1, "final").await;
    assert_eq!(
        end1["status"],
        "succeeded",
        "{end1}\n{}",
        s.log_text(&b1).await
    );
    let (active1, _) = machine(&state);

    // Two waves with 30 s between them: the revert armed at wave 1 (12 s)
    // is re-armed by every watch check (5 s), so it never fires.
    put_policy(
        &s,
        json!({"waves": [1], "first": ["mastodon"], "wait_seconds": 30}),
    )
    .await;
    let b2 = s.submit_ok("alice", two_nodes("dark")).await;
    let end2 = s.wait_build(&b2, "final").await;
    let log2 = s.log_text(&b2).await;
    assert_eq!(end2["status"], "succeeded", "{end2}\n{log2}");
    let waves = end2["rollout"]["waves"].as_array().unwrap();
    assert_eq!(waves[0]["nodes"], json!(["mastodon"]));
    assert_eq!(waves[1]["nodes"], json!(["forgejo"]));
    assert!(
        log2.contains("re-armed: back to the previous system"),
        "{log2}"
    );
    let (active2, boot2) = machine(&state);
    assert_ne!(active2, active1);
    assert_eq!(boot2, active2, "confirmed after the last wave");
    let history = std::fs::read_to_string(state.join("history")).unwrap();
    let since: Vec<&str> = history
        .lines()
        .skip_while(|l| *l != format!("test {active2}"))
        .collect();
    assert!(
        !since.contains(&format!("test {active1}").as_str()),
        "the target went back during the wait:\n{history}"
    );

    // An abort after wave 1 puts mastodon back; nothing is confirmed.
    put_policy(
        &s,
        json!({"waves": [1], "first": ["mastodon"], "pause_after": [1]}),
    )
    .await;
    let b3 = s.submit_ok("alice", two_nodes("blue")).await;
    eventually("the rollout pauses after wave 1", || {
        let s = &s;
        let b3 = b3.clone();
        async move { s.build(&b3).await["rollout"]["state"] == "paused" }
    })
    .await;
    assert_ne!(machine(&state).0, active2, "wave 1 activated mastodon");
    let r = s
        .post("/v1/deployments/alice/actions/rollout_abort", &json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let end3 = s.wait_build(&b3, "final").await;
    assert_eq!(end3["status"], "failed", "{end3}");
    assert_eq!(end3["failure"]["reason"], "rollout_aborted", "{end3}");
    assert_eq!(
        machine(&state),
        (active2.clone(), active2.clone()),
        "mastodon is back on the second system and it stays the boot entry"
    );
    drop(sshd);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_activates_one_node_over_ssh_and_one_through_its_agent() {
    let test = "nix_ssh::a_rollout_activates_one_node_over_ssh_and_one_through_its_agent";
    if !nix_can_build(test) {
        return;
    }
    let dir = temp_dir("nix-ssh-agent");
    let state = dir.join("machine");
    let stand_ins = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/nix-target");
    let Some(sshd) = start_sshd(test, &dir, &stand_ins, &state) else {
        return;
    };
    std::fs::create_dir_all(dir.join("profiles")).unwrap();
    let s = Server::start(
        nix_options(&example_source())
            .env("NIX_SSHOPTS", &format!("-F {}", sshd.ssh_config.display()))
            .env(
                "BERTH_NIX_PROFILE",
                dir.join("profiles/system").to_str().unwrap(),
            )
            .env(
                "BERTH_NIX_TARGET_DIR",
                dir.join("target-dir").to_str().unwrap(),
            )
            .arg("--health-interval")
            .arg("1s")
            .arg("--health-timeout")
            .arg("20s"),
    )
    .await;
    // forgejo is bound to an agent; mastodon's target is the SSH machine.
    let (status, made) = read(
        s.post(
            "/v1/tokens",
            &json!({"name": "f-1", "kind": "agent", "deployment": "alice", "node": "forgejo"}),
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(status, 201, "{made}");
    let node = dir.join("node");
    std::fs::create_dir_all(node.join("profiles")).unwrap();
    let system = node.join("current-system");
    let switch = format!("ln -sfn \"$BERTH_ARTIFACT\" {}", system.display());
    let agent = crate::agents::Agent::start(
        &s,
        made["token"].as_str().unwrap(),
        "alice/forgejo",
        &dir.join("agent"),
        &[
            "--activate-command",
            &switch,
            "--current-system",
            system.to_str().unwrap(),
            "--system-profile",
            node.join("profiles/system").to_str().unwrap(),
        ],
    );
    let b1 = s.submit_ok("alice", two_nodes("light")).await;
    let end = s.wait_build(&b1, "final").await;
    let log = s.log_text(&b1).await;
    assert_eq!(end["status"], "succeeded", "{end}\n{log}\n{}", agent.log());
    assert!(log.contains("published to the agents of forgejo"), "{log}");
    // Over SSH: mastodon, activated and confirmed there.
    let (active, boot) = machine(&state);
    assert!(!active.is_empty() && boot == active, "{active} {boot}");
    // Through the agent: forgejo, running and booted on its node, never
    // sent to the SSH machine.
    let (_, entry) = s.json("/v1/deployments/alice/nodes/forgejo").await;
    let toplevel = entry["desired"]["artifact"]["path"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(entry["activation"]["status"], "confirmed", "{entry}");
    assert_eq!(
        std::fs::canonicalize(&system).unwrap().to_str(),
        Some(toplevel.as_str())
    );
    let history = std::fs::read_to_string(state.join("history")).unwrap_or_default();
    assert!(
        !history.contains(&toplevel),
        "forgejo went over SSH:\n{history}"
    );
}
