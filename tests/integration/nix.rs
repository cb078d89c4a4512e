//! The Nix deployer (`--deployer builtin:nix`) through berth's HTTP API with
//! the pure-Nix example source (nix/example-source): a preview gives the
//! nodes the Nix code computes, a configuration the Nix code rejects gets
//! 422 with Nix's message, a submit builds real store paths and the node
//! SBOMs come from the SBOM derivation, a second submit with one
//! application changed reports `changed` for that node only, a delete runs
//! the destroy hook. Offline: Nix's binary cache is turned off.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde_json::json;

use crate::harness::*;

pub(crate) fn example_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("nix/example-source")
}

/// The source's digest: its NAR hash, as the deployer checks it.
fn digest(dir: &Path) -> String {
    let out = Command::new("nix-hash")
        .args(["--type", "sha256"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success());
    format!("sha256:{}", String::from_utf8_lossy(&out.stdout).trim())
}

/// Whether Nix is here and can build into /nix/store; says why not.
pub(crate) fn nix_can_build(test: &str) -> bool {
    match NIX_BUILDS.get_or_init(probe_nix_build) {
        Ok(()) => true,
        Err(why) => {
            skip(test, why);
            false
        }
    }
}

/// The probe's verdict, made once per run: the Nix tests start together,
/// and a probe each at once met the others in Nix's own database ("SQLite
/// database '/nix/var/nix/db/db.sqlite' is busy", seen in CI) and skipped
/// a test that could run.
static NIX_BUILDS: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();

/// Tries of the probe build while Nix's database is busy (another Nix
/// process holds it), a second apart.
const PROBE_ATTEMPTS: u32 = 5;

fn probe_nix_build() -> Result<(), String> {
    if Command::new("nix-instantiate")
        .arg("--version")
        .output()
        .is_err()
    {
        return Err("no nix-instantiate (Debian's nix-bin; .ci/run installs it)".to_string());
    }
    let mut attempt = 1;
    loop {
        let built = Command::new("nix-build")
            .args(["--no-out-link", "--option", "substituters", "", "-E"])
            .arg("builtins.derivation { name = \"berth-probe\"; system = builtins.currentSystem; builder = \"/bin/sh\"; args = [ \"-c\" \"echo ok > $out\" ]; }")
            .output()
            .map_err(|e| format!("cannot run nix-build: {e}"))?;
        if built.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&built.stderr);
        let last = stderr.lines().last().unwrap_or("").to_string();
        if last.contains("is busy") && attempt < PROBE_ATTEMPTS {
            attempt += 1;
            std::thread::sleep(std::time::Duration::from_secs(1));
            continue;
        }
        return Err(format!(
            "Nix cannot build here (no /nix/store writes?): {last}"
        ));
    }
}

/// berth with the Nix deployer and `source` as its default source, offline
/// (nothing needs a binary cache).
pub(crate) fn nix_options(source: &Path) -> Options {
    Options::default()
        .arg("--deployer")
        .arg("builtin:nix")
        .arg("--default-source")
        .arg(&format!(
            "url={},rev=v1,digest={}",
            source.display(),
            digest(source)
        ))
        .env("NIX_CONFIG", "substituters =")
}

fn configuration(forgejo_theme: &str) -> serde_json::Value {
    json!({"domain": "alice.example.org", "applications": {
        "mastodon": {"enable": true},
        "forgejo": {"enable": true, "theme": forgejo_theme},
    }})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nix_deployer_evaluates_builds_and_changes_only_what_changed() {
    let test = "nix::the_nix_deployer_evaluates_builds_and_changes_only_what_changed";
    if !nix_can_build(test) {
        return;
    }
    let dir = temp_dir("nix");
    let source = example_source();
    let activations = dir.join("activations.log");
    let opts = nix_options(&source).env(
        "BERTH_NIX_ACTIVATE",
        &format!("echo \"$NODE $TOPLEVEL\" >> {}", activations.display()),
    );
    let s = Server::start(opts).await;

    // A preview gives the nodes the Nix code computes.
    let started = Instant::now();
    let r = s
        .post(
            "/v1/deployments/alice/preview",
            &json!({"configuration": configuration("dark")}),
        )
        .send()
        .await
        .unwrap();
    let (status, preview) = read(r).await;
    let first_preview = started.elapsed();
    assert_eq!(status, 200, "{preview}\n{}", s.log());
    let text = preview.to_string();
    assert!(
        text.contains("git.alice.example.org") && text.contains("social.alice.example.org"),
        "{preview}"
    );

    // A configuration the Nix code rejects: 422 with Nix's message.
    let (status, refused) = s
        .submit(
            "alice",
            json!({"configuration": {"applications": {"mastodon": {"enable": true}}}}),
        )
        .await;
    assert_eq!(status, 422, "{refused}");
    let message = refused["deployer_message"].as_str().unwrap_or("");
    assert!(
        message.contains("an enabled application needs a domain"),
        "{refused}"
    );
    assert!(
        !message.contains("/nix/store/") || message.contains("/nix/store/…"),
        "{message}"
    );

    // A submit builds real store paths; the SBOMs come from the derivation.
    let started = Instant::now();
    let b1 = s.submit_ok("alice", configuration("dark")).await;
    let build = s.wait_build(&b1, "final").await;
    let first_deploy = started.elapsed();
    assert_eq!(
        build["status"],
        "succeeded",
        "{build}\n{}",
        s.log_text(&b1).await
    );
    let log = s.log_text(&b1).await;
    assert!(
        log.contains("building 2 node(s)") && log.contains("/nix/store/"),
        "{log}"
    );
    let first: Vec<String> = std::fs::read_to_string(&activations)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(first.len(), 2, "{first:?}");
    for line in &first {
        let path = line.split_whitespace().nth(1).unwrap();
        assert!(Path::new(path).exists(), "{path} is not in the store");
    }
    // What is deployed is a GC root on this host (one per kept toplevel).
    let roots = s.dir.join("data/work/alice/gcroots/mastodon");
    let kept: Vec<PathBuf> = std::fs::read_dir(&roots)
        .unwrap_or_else(|e| panic!("{}: {e}", roots.display()))
        .map(|e| std::fs::read_link(e.unwrap().path()).unwrap())
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(kept[0].starts_with("/nix/store/"), "{}", kept[0].display());
    let (_, sboms) = s.json("/v1/deployments/alice/sboms").await;
    for node in ["mastodon", "forgejo"] {
        let entry = sboms["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["node"] == node)
            .unwrap_or_else(|| panic!("{sboms}"));
        assert_eq!(entry["status"], "ready", "{entry}");
        let (status, doc) = s.json(&format!("/v1/deployments/alice/sboms/{node}")).await;
        assert_eq!(status, 200);
        assert!(
            doc.to_string().contains(&format!("pkg:nix/{node}@1.0.0")),
            "{doc}"
        );
    }

    // One application changed: only its node changes.
    let b2 = s.submit_ok("alice", configuration("light")).await;
    assert_eq!(s.wait_build(&b2, "final").await["status"], "succeeded");
    let all = std::fs::read_to_string(&activations).unwrap();
    let second: Vec<&str> = all.lines().skip(first.len()).collect();
    assert_eq!(second.len(), 1, "{second:?}");
    assert!(second[0].starts_with("forgejo "), "{second:?}");
    let (_, sboms) = s.json("/v1/deployments/alice/sboms").await;
    let build_of = |node: &str| {
        sboms["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["node"] == node)
            .unwrap()["build_id"]
            .clone()
    };
    assert_eq!(build_of("forgejo"), json!(b2));
    assert_eq!(
        build_of("mastodon"),
        json!(b1),
        "an unchanged node keeps its SBOM"
    );

    // Describe/eval through berth against nix-instantiate alone.
    let started = Instant::now();
    let r = s
        .post(
            "/v1/deployments/alice/preview",
            &json!({"configuration": configuration("dark")}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let cached_preview = started.elapsed();
    let started = Instant::now();
    let alone = Command::new("nix-instantiate")
        .args(["--eval", "--strict", "--json", "-E"])
        .arg(format!(
            "builtins.mapAttrs (n: v: v.names) (import {} {{ configuration = builtins.fromJSON ''{}''; }}).nodes",
            source.display(),
            configuration("dark")
        ))
        .output()
        .unwrap();
    let nix_alone = started.elapsed();
    assert!(
        alone.status.success(),
        "{}",
        String::from_utf8_lossy(&alone.stderr)
    );
    eprintln!(
        "nix figures: first preview (describe + eval) {first_preview:?}, preview (eval) {cached_preview:?}, nix-instantiate alone {nix_alone:?}, first deploy end to end (2 nodes, 2 SBOMs) {first_deploy:?}"
    );

    // Delete runs the source's destroy hook.
    let r = s.delete("/v1/deployments/alice").send().await.unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let (_, builds) = s.json("/v1/deployments/alice/builds").await;
    let destroy = builds["items"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(s.wait_build(&destroy, "final").await["status"], "succeeded");
    assert!(s
        .log_text(&destroy)
        .await
        .contains("running the source's destroy hook"));
}

/// Which lib the module is evaluated with.
#[derive(Clone, Debug)]
enum ModuleLib {
    /// tests/nix/stub-lib.nix: the few functions the module uses.
    Stub,
    /// nixpkgs' own lib (`NIXPKGS_LIB`): `lib.evalModules`, real option
    /// types, `mkIf`, `escapeShellArgs`.
    Nixpkgs(PathBuf),
}

/// The module's `config`, evaluated with `overrides` (JSON) on top of
/// `enable = true`; `Err` is Nix's message.
fn try_module_config(
    lib: &ModuleLib,
    overrides: &serde_json::Value,
) -> Result<serde_json::Value, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut command = Command::new("nix-instantiate");
    command.args(["--eval", "--strict", "--json"]);
    match lib {
        ModuleLib::Stub => command.arg(root.join("tests/nix/eval-module.nix")),
        ModuleLib::Nixpkgs(path) => command
            .arg(root.join("tests/nix/eval-module-nixpkgs.nix"))
            .arg("--arg")
            .arg("nixpkgsLib")
            .arg(path),
    };
    let out = command
        .args(["--argstr", "overrides", &overrides.to_string()])
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&out.stdout).unwrap())
}

fn module_config(lib: &ModuleLib, overrides: &serde_json::Value) -> serde_json::Value {
    try_module_config(lib, overrides).unwrap_or_else(|e| panic!("{lib:?}: {e}"))
}

/// The words of a unit's `ExecStart` as a shell splits them (either lib's
/// quoting).
fn exec_words(unit: &serde_json::Value) -> Vec<String> {
    let command = unit["serviceConfig"]["ExecStart"].as_str().unwrap();
    let out = Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("printf '%s\\n' {command}"))
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// `flag` followed by `value` in `words`.
fn has_flag(words: &[String], flag: &str, value: &str) -> bool {
    words.windows(2).any(|w| w[0] == flag && w[1] == value)
}

/// A unit the module does not make: absent (nixpkgs' `mkIf false`) or
/// empty (the stub's).
fn absent(unit: &serde_json::Value) -> bool {
    unit.is_null() || *unit == json!({})
}

/// Every .nix file of the repository.
fn nix_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if path.is_dir() && !["target", "node_modules", ".git"].contains(&name.as_str()) {
            nix_files(&path, out);
        } else if name.ends_with(".nix") {
            out.push(path);
        }
    }
}

#[tokio::test]
async fn the_module_is_hardened_and_its_audit_units_verify_a_real_store() {
    let test = "nix::the_module_is_hardened_and_its_audit_units_verify_a_real_store";
    if Command::new("nix-instantiate")
        .arg("--version")
        .output()
        .is_err()
    {
        skip(
            test,
            "no nix-instantiate (Debian's nix-bin; .ci/run installs it)",
        );
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    nix_files(root, &mut files);
    assert!(files.len() >= 6, "{files:?}");
    for f in &files {
        let out = Command::new("nix-instantiate")
            .arg("--parse")
            .arg(f)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            f.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // The units, with the stub lib and (when NIXPKGS_LIB names one)
    // with nixpkgs' own.
    let mut libs = vec![ModuleLib::Stub];
    match std::env::var_os("NIXPKGS_LIB") {
        Some(path) => libs.push(ModuleLib::Nixpkgs(PathBuf::from(path))),
        None => skip(
            &format!("{test} (nixpkgs' lib)"),
            "NIXPKGS_LIB is not set (point it at the lib/ of any nixpkgs checkout; .ci/run sets it when the workspace has one)",
        ),
    }
    for lib in &libs {
        // Defaults: the berth user, no capability, hardening, the daily verify.
        let config = module_config(lib, &json!({}));
        let services = &config["systemd"]["services"];
        let service = &services["berth"]["serviceConfig"];
        for (key, value) in [
            ("User", json!("berth")),
            ("CapabilityBoundingSet", json!([""])),
            ("ProtectSystem", json!("strict")),
            ("ProtectHome", json!(true)),
            ("PrivateTmp", json!(true)),
            ("NoNewPrivileges", json!(true)),
            (
                "RestrictAddressFamilies",
                json!(["AF_UNIX", "AF_INET", "AF_INET6"]),
            ),
            ("SystemCallFilter", json!(["@system-service"])),
            ("StateDirectory", json!(["berth"])),
            ("KillMode", json!("mixed")),
        ] {
            assert_eq!(service[key], value, "{key}: {service}");
        }
        assert!(has_flag(
            &exec_words(&services["berth"]),
            "--deployer",
            "builtin:nix"
        ));
        assert_eq!(
            config["systemd"]["timers"]["berth-audit-verify"]["timerConfig"]["OnCalendar"],
            "daily"
        );
        assert!(
            absent(&services["berth-audit-push-head"]),
            "no sink, no push unit"
        );
        assert!(
            absent(&services["berth-worker"]) && absent(&services["berth-agent"]),
            "no worker and no agent unless enabled"
        );
        let verify = &services["berth-audit-verify"]["serviceConfig"];
        assert_eq!(verify["SyslogIdentifier"], "berth-audit");
        assert_eq!(verify["LogExtraFields"], "BERTH_AUDIT=1");
        assert_eq!(verify["Type"], "oneshot");
        let hidden = verify["InaccessiblePaths"].to_string();
        for secret in [
            "/run/credentials/berth.service",
            "service-token",
            "cursor-key",
            "callback-secret",
            "audit-signing.key",
        ] {
            assert!(
                hidden.contains(secret),
                "verify can read {secret}: {hidden}"
            );
        }
        assert_eq!(
            verify["ReadOnlyPaths"],
            json!(["/var/lib/berth/berth.redb"])
        );
        // A snapshot of a store held alone is deleted by its reader.
        assert_eq!(
            verify["ReadWritePaths"],
            json!(["-/var/lib/berth/snapshots"])
        );

        // A token file, a deployer user and a sink.
        let config = module_config(
            lib,
            &json!({
                "serviceTokenFile": "/run/keys/berth-token",
                "deployerUser": "deploy",
                "audit": {"sink": "https://witness.example.org/berth"},
            }),
        );
        let services = &config["systemd"]["services"];
        let service = &services["berth"]["serviceConfig"];
        assert_eq!(
            service["LoadCredential"],
            json!(["service-token:/run/keys/berth-token"])
        );
        let words = exec_words(&services["berth"]);
        assert!(has_flag(&words, "--service-token-file", "%d/service-token"));
        assert!(has_flag(&words, "--deployer-user", "deploy"));
        // Deployers work outside the data dir, which stays 0700.
        assert!(has_flag(
            &words,
            "--deployer-dir",
            "/var/lib/berth-deployers"
        ));
        assert_eq!(
            service["StateDirectory"],
            json!(["berth", "berth-deployers"])
        );
        assert_eq!(
            service["User"],
            serde_json::Value::Null,
            "root, to switch to the deployer user"
        );
        assert_eq!(
            service["CapabilityBoundingSet"],
            json!([
                "CAP_SETUID",
                "CAP_SETGID",
                "CAP_CHOWN",
                "CAP_KILL",
                "CAP_DAC_OVERRIDE"
            ])
        );
        let push = &services["berth-audit-push-head"]["serviceConfig"];
        assert_eq!(push["SyslogIdentifier"], "berth-audit");
        assert_eq!(push["User"], "root", "the store is root's then");
        assert!(has_flag(
            &exec_words(&services["berth-audit-push-head"]),
            "--sink",
            "https://witness.example.org/berth"
        ));
        assert!(push["InaccessiblePaths"]
            .to_string()
            .contains("/run/credentials/berth.service"));
        assert_eq!(
            config["systemd"]["timers"]["berth-audit-push-head"]["timerConfig"]["OnCalendar"],
            "hourly"
        );
    }
    if let Some(lib @ ModuleLib::Nixpkgs(_)) = libs.get(1) {
        every_option_reaches_its_unit(lib);
    }

    // The verify unit's command, run against a real store, passes.
    let mut s = Server::start(Options::default()).await;
    s.submit_ok("unit", mastodon("unit.example.org")).await;
    s.terminate();
    let command = module_config(&ModuleLib::Stub, &json!({}))["systemd"]["services"]
        ["berth-audit-verify"]["serviceConfig"]["ExecStart"]
        .as_str()
        .unwrap()
        .replace("/nix/store/berth/bin/berth", env!("CARGO_BIN_EXE_berth"))
        .replace("/var/lib/berth", &s.dir.join("data").display().to_string());
    let out = Command::new("/bin/sh")
        .arg("-c")
        .arg(&command)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{command}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Every option of the module set to a value other than its default, with
/// nixpkgs' lib: each reaches its flag, variable, credential or timer; the
/// test knows every option (a new one fails it until it is checked here);
/// a value of the wrong type is refused by the option's real type.
fn every_option_reaches_its_unit(lib: &ModuleLib) {
    let digest = format!("sha256:{}", "a".repeat(64));
    let source = format!("url=/etc/berth/source,rev=v1,digest={digest}");
    let mut all = json!({
        "listen": "0.0.0.0:9090",
        "deployer": "builtin:local",
        "deployerUser": "deploy",
        "defaultSource": source,
        "sourceOrigins": ["https://git.example.org"],
        "callbackOrigins": ["https://panel.example.org"],
        "corsOrigins": ["https://ui.example.org", "https://ui2.example.org"],
        "buildSlots": 8,
        "evalSlots": 3,
        "buildTimeout": "6h",
        "evalTimeout": "2m",
        "shutdownGrace": "45s",
        "authzUrl": "https://authz.example.org/check",
        "metricsPublic": true,
        "serviceTokenFile": "/run/keys/berth-token",
        "callbackSecretFile": "/run/keys/berth-callback",
        "nix": {
            "builders": "ssh://builder x86_64-linux",
            "activateCommand": "activate-it",
            "confirmTimeout": 600,
            "keep": 3,
            "sshOptions": "-i /run/keys/deploy",
        },
        "audit": {
            "sink": "https://witness.example.org/berth",
            "verifyInterval": "hourly",
            "pushInterval": "*:0/15",
            "retentionDays": 30,
            "denialInterval": "5m",
            "origin": "berth/test/audit",
        },
        "extraArgs": ["--keep-builds", "50"],
        "localWorker": false,
        "localLabels": ["gpu"],
        "buildLabels": ["gpu", "x86"],
        "leaseTtl": "1m",
        "maxWorkState": 268435456,
        "worker": {
            "enable": true,
            "package": {"type": "derivation", "name": "berth", "outPath": "/nix/store/berth-worker"},
            "url": "https://berth.example.org",
            "tokenFile": "/run/keys/worker-token",
            "labels": ["gpu", "x86"],
            "slots": 4,
            "workDir": "/srv/berth-worker",
            "deployer": "builtin:local",
            "deployerUser": "deploy",
            "allowHttp": true,
            "caFile": "/etc/ssl/berth-ca.pem",
            "extraArgs": ["--shutdown-grace", "2m"],
        },
        "agent": {
            "enable": true,
            "package": {"type": "derivation", "name": "berth", "outPath": "/nix/store/berth-agent"},
            "url": "https://berth.example.org",
            "tokenFile": "/run/keys/agent-token",
            "node": "alice/web",
            "reportInterval": "30s",
            "substituters": ["https://cache.example.org"],
            "checkCommand": "systemctl is-active web",
            "allowHttp": true,
            "keep": 3,
            "caFile": "/etc/ssl/berth-ca.pem",
            "extraArgs": ["--transport", "poll"],
        },
    });
    // Cluster mode's options (one literal above would pass the json!
    // macro's recursion limit).
    for (option, value) in [
        ("store", "postgres://berth@db.internal/berth"),
        ("storeFile", "/run/keys/berth-store"),
        ("replicaUrl", "http://10.0.0.1:9090"),
        ("replicaName", "a"),
    ] {
        all[option] = json!(value);
    }
    let config = module_config(lib, &all);
    // The test names every option the module declares.
    fn leaves(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
        match v.as_object() {
            Some(map) if !map.is_empty() && !map.contains_key("outPath") => {
                for (k, v) in map {
                    leaves(v, format!("{at}/{k}"), out);
                }
            }
            _ => out.push(at),
        }
    }
    let (mut declared, mut set) = (vec![], vec![]);
    leaves(&config["options"], String::new(), &mut declared);
    leaves(&all, String::new(), &mut set);
    declared.retain(|o| o != "/enable" && o != "/package");
    declared.sort();
    set.sort();
    assert_eq!(declared, set, "an option of the module is not checked here");

    let services = &config["systemd"]["services"];
    let words = exec_words(&services["berth"]);
    for (flag, value) in [
        ("--listen", "0.0.0.0:9090"),
        ("--deployer", "builtin:local"),
        ("--deployer-user", "deploy"),
        ("--default-source", source.as_str()),
        ("--source-origin", "https://git.example.org"),
        ("--callback-origin", "https://panel.example.org"),
        (
            "--cors-origin",
            "https://ui.example.org,https://ui2.example.org",
        ),
        ("--build-slots", "8"),
        ("--eval-slots", "3"),
        ("--build-timeout", "6h"),
        ("--eval-timeout", "2m"),
        ("--shutdown-grace", "45s"),
        ("--authz-url", "https://authz.example.org/check"),
        ("--audit-retention-days", "30"),
        ("--audit-denial-interval", "5m"),
        ("--audit-origin", "berth/test/audit"),
        ("--service-token-file", "%d/service-token"),
        ("--callback-secret-file", "%d/callback-secret"),
        ("--keep-builds", "50"),
        ("--local-worker", "off"),
        ("--local-labels", "gpu"),
        ("--build-labels", "gpu,x86"),
        ("--lease-ttl", "1m"),
        ("--max-work-state", "268435456"),
        ("--store", "postgres://berth@db.internal/berth"),
        ("--store-file", "%d/store-url"),
        ("--replica-url", "http://10.0.0.1:9090"),
        ("--replica-name", "a"),
    ] {
        assert!(has_flag(&words, flag, value), "{flag} {value}: {words:?}");
    }
    // The audit units read the database's chain, the URL a credential.
    for unit in ["berth-audit-verify", "berth-audit-push-head"] {
        let words = exec_words(&services[unit]);
        assert!(
            has_flag(&words, "--store", "postgres://berth@db.internal/berth")
                && has_flag(&words, "--store-file", "%d/store-url"),
            "{unit}: {words:?}"
        );
        assert_eq!(
            services[unit]["serviceConfig"]["LoadCredential"],
            json!(["store-url:/run/keys/berth-store"]),
            "{unit}"
        );
    }
    // A password in `store` never reaches the unit.
    let with_password = json!({"store": "postgres://berth:hunter2@db/berth"});
    let refused = try_module_config(lib, &with_password).expect_err("a password in store");
    assert!(refused.contains("store_url_has_password"), "{refused}");
    // The worker: its token a credential, never on the command line.
    let worker = &services["berth-worker"];
    let worker_words = exec_words(worker);
    assert_eq!(
        worker_words[..2],
        ["/nix/store/berth-worker/bin/berth", "worker"]
    );
    for (flag, value) in [
        ("--url", "https://berth.example.org"),
        ("--token-file", "%d/worker-token"),
        ("--labels", "gpu,x86"),
        ("--slots", "4"),
        ("--work-dir", "/srv/berth-worker"),
        ("--deployer", "builtin:local"),
        ("--deployer-user", "deploy"),
        ("--shutdown-grace", "2m"),
        ("--ca-file", "/etc/ssl/berth-ca.pem"),
    ] {
        assert!(
            has_flag(&worker_words, flag, value),
            "{flag} {value}: {worker_words:?}"
        );
    }
    assert!(
        worker_words.iter().any(|w| w == "--allow-http"),
        "{worker_words:?}"
    );
    let unit = &worker["serviceConfig"];
    assert_eq!(
        unit["LoadCredential"],
        json!(["worker-token:/run/keys/worker-token"])
    );
    assert_eq!(unit["RestartPreventExitStatus"], 3);
    assert_eq!(unit["KillMode"], "mixed");
    assert_eq!(unit["ReadWritePaths"], json!(["/srv/berth-worker"]));
    // The agent: its token a credential, never restarted by a switch.
    let agent = &services["berth-agent"];
    let agent_words = exec_words(agent);
    assert_eq!(
        agent_words[..2],
        ["/nix/store/berth-agent/bin/berth", "agent"]
    );
    for (flag, value) in [
        ("--url", "https://berth.example.org"),
        ("--token-file", "%d/agent-token"),
        ("--node", "alice/web"),
        ("--state-dir", "/var/lib/berth-agent"),
        ("--report-interval", "30s"),
        ("--check-command", "systemctl is-active web"),
        ("--substituter", "https://cache.example.org"),
        ("--transport", "poll"),
        ("--keep", "3"),
        ("--ca-file", "/etc/ssl/berth-ca.pem"),
        ("--unit", "berth-agent.service"),
    ] {
        assert!(
            has_flag(&agent_words, flag, value),
            "{flag} {value}: {agent_words:?}"
        );
    }
    assert!(
        agent_words.iter().any(|w| w == "--allow-http"),
        "{agent_words:?}"
    );
    assert_eq!(agent["restartIfChanged"], false);
    let unit = &agent["serviceConfig"];
    assert_eq!(
        unit["LoadCredential"],
        json!(["agent-token:/run/keys/agent-token"])
    );
    assert_eq!(
        (
            unit["Restart"].as_str(),
            unit["RestartPreventExitStatus"].as_i64()
        ),
        (Some("always"), Some(3))
    );
    assert!(words.iter().any(|w| w == "--metrics-public"), "{words:?}");
    let berth = &services["berth"];
    assert_eq!(
        berth["environment"]["BERTH_NIX_BUILDERS"],
        "ssh://builder x86_64-linux"
    );
    assert_eq!(berth["environment"]["BERTH_NIX_ACTIVATE"], "activate-it");
    assert_eq!(berth["environment"]["BERTH_NIX_CONFIRM_TIMEOUT"], "600");
    assert_eq!(berth["environment"]["BERTH_NIX_KEEP"], "3");
    assert_eq!(berth["environment"]["NIX_SSHOPTS"], "-i /run/keys/deploy");
    assert_eq!(
        berth["serviceConfig"]["LoadCredential"],
        json!([
            "store-url:/run/keys/berth-store",
            "service-token:/run/keys/berth-token",
            "callback-secret:/run/keys/berth-callback"
        ])
    );
    let timers = &config["systemd"]["timers"];
    assert_eq!(
        timers["berth-audit-verify"]["timerConfig"]["OnCalendar"],
        "hourly"
    );
    assert_eq!(
        timers["berth-audit-push-head"]["timerConfig"]["OnCalendar"],
        "*:0/15"
    );
    let push = exec_words(&services["berth-audit-push-head"]);
    assert!(has_flag(
        &push,
        "--sink",
        "https://witness.example.org/berth"
    ));
    assert!(has_flag(&push, "--audit-origin", "berth/test/audit"));
    assert!(config["users"]["users"]["berth"]["isSystemUser"] == json!(true));

    // The real types refuse what the stub would pass through.
    for (bad, option) in [
        (json!({"buildSlots": "eight"}), "buildSlots"),
        (json!({"metricsPublic": "yes"}), "metricsPublic"),
        (
            json!({"sourceOrigins": "https://git.example.org"}),
            "sourceOrigins",
        ),
    ] {
        let e = try_module_config(lib, &bad).expect_err(option);
        assert!(e.contains(option), "{option}: {e}");
    }
}

/// Hostile input round two, items 1 and 3 (deployer.md "Limits berth
/// enforces"): a source that names nodes after configuration keys cannot be
/// made to use a name that is not a DNS label (it would reach the GC-root
/// and SBOM paths), and a configuration larger than one command-line
/// argument (128 KiB) evaluates: the request reaches Nix in a 0600 file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_names_are_checked_and_the_request_never_rides_a_command_line() {
    let test = "nix::node_names_are_checked_and_the_request_never_rides_a_command_line";
    if !nix_can_build(test) {
        return;
    }
    let dir = temp_dir("nix-hostile");
    let source = dir.join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(
        source.join("default.nix"),
        r#"{ configuration ? { }, deployment ? "x", suspended ? false }: {
  describe = { methods = [ "nix" ]; default_method = "nix"; catalog = [ ]; schema = null; };
  nodes = builtins.mapAttrs (name: app: { names = [ ]; }) (configuration.applications or { });
}
"#,
    )
    .unwrap();
    let opts = nix_options(&source);
    let s = Server::start(opts).await;
    let preview = |config: serde_json::Value| {
        let s = &s;
        async move {
            read(
                s.post(
                    "/v1/deployments/eve/preview",
                    &json!({"configuration": config}),
                )
                .send()
                .await
                .unwrap(),
            )
            .await
        }
    };
    let (status, p) = preview(json!({"applications": {"../../../../tmp/berth-escape": {}}})).await;
    assert_eq!(status, 422, "{p}");
    assert!(
        p["deployer_message"]
            .as_str()
            .unwrap_or("")
            .contains("DNS label"),
        "{p}"
    );
    // 200 KiB of configuration: past what one argument may carry.
    let big = "x".repeat(200 * 1024);
    let (status, p) = preview(json!({"applications": {"web": {"notes": big}}})).await;
    assert_eq!(
        status,
        200,
        "{}",
        p.to_string().chars().take(300).collect::<String>()
    );
    assert_eq!(p["nodes"][0]["name"], "web");
}
