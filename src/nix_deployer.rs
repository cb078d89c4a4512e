//! The Nix deployer: `berth deployer nix <verb>` (`--deployer builtin:nix`),
//! the protocol of deployer.md over real Nix code. Why it exists: berth is
//! for people who run NixOS machines, and this is the deployer that builds
//! and activates what their source's Nix code says.
//!
//! A source is a directory of Nix code (`url` = an absolute path or
//! `file://` URL) whose NAR hash is its digest (`nix-hash --type sha256`);
//! the deployer refuses a source whose content does not match. Its entry
//! file `default.nix` is a function of `{ configuration, deployment,
//! suspended }` returning `describe` (the describe result), `nodes` (per
//! node: `names`, `toplevel` (a derivation; `system.build.toplevel` on
//! NixOS), optional `sbom` (a derivation whose output is a CycloneDX JSON
//! file; `system.build.sbom`) and optional `target` (an SSH destination)),
//! and an optional `destroy` derivation whose output is a script.
//!
//! - `describe`, `eval`: `nix-instantiate --eval --strict --json`; a Nix
//!   evaluation error (a `throw` in the source) refuses the configuration
//!   with Nix's message, cut and without store paths.
//! - `deploy`: one evaluation gives every node's derivations; `nix-store
//!   --realise` builds them, its output streaming into the build log; a
//!   node is `changed` when its toplevel store path differs from the last
//!   deploy's (kept in the work dir); changed nodes are activated and their
//!   SBOM built (a failed SBOM never fails the deploy).
//! - Activation, modelled on deploy-rs's "magic rollback": a node with a
//!   `target` (an SSH destination) is copied with `nix-copy-closure --to`
//!   and activated with `ssh -- TARGET ...`: the target first arms a revert
//!   to its previous system (a detached process on the target that fires
//!   after `BERTH_NIX_CONFIRM_TIMEOUT`, default 300 s, unless `confirm`
//!   disarms it), then runs `switch-to-configuration test`. A node without
//!   a target is built only. `BERTH_NIX_ACTIVATE` (a shell command; `NODE`,
//!   `TOPLEVEL`, `TARGET` in its environment) replaces all of that: no
//!   revert, and its nodes' checks answer healthy.
//! - `check`: on each changed node, `systemctl is-system-running` (anything
//!   but `running` is unhealthy, the failed units named) and the source's
//!   own `check` (a derivation whose output is an executable) when given.
//! - `confirm`: disarm, the system profile (`BERTH_NIX_PROFILE`), and
//!   `switch-to-configuration boot`; the toplevel joins the last
//!   `BERTH_NIX_KEEP` (default 5) confirmed ones, each with a GC root in the
//!   work dir, so a rollback to one of them builds nothing.
//! - Remote builds: `BERTH_NIX_BUILDERS` is passed to Nix as its
//!   `builders` option (Nix's own remote builders; berth invents none).
//! - Cancel and timeouts: berth signals the whole process group, Nix
//!   included; the state file is written only after a successful deploy.

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{json, Value};

/// Nix's answer on stdout at most.
const MAX_NIX_OUTPUT_BYTES: u64 = 16 << 20;
/// Nix's error output kept at most (a message is cut from its start).
const MAX_NIX_STDERR_BYTES: u64 = 64 << 10;
/// A refusal message at most (Nix's error, cut).
const MAX_MESSAGE_CHARS: usize = 2_000;
/// Nodes a source may define at most.
const MAX_NODES: usize = 256;
/// The deploy state in the work dir: each node's toplevel store path.
const STATE_FILE: &str = "nix-state.json";

/// What went wrong: a verdict on the configuration (exit 1, refused) or a
/// failure of the machinery (exit 2).
enum VerbError {
    Refused(String),
    Broken(String),
}

type VerbResult = Result<Value, VerbError>;

pub fn run(verb: &str) -> i32 {
    crate::deployer_side::run("nix", verb, |verb, request| {
        let outcome = match verb {
            "describe" => describe(request),
            "eval" => eval(request),
            "deploy" => deploy(request),
            "activate" => activate_nodes(request),
            "check" => check(request),
            "confirm" => confirm(request),
            "destroy" => destroy(request),
            _ => return None,
        };
        Some(match outcome {
            Ok(v) => (Some(v), 0),
            Err(VerbError::Refused(message)) => (Some(json!({"error": {"message": message}})), 1),
            Err(VerbError::Broken(message)) => {
                eprintln!("berth deployer nix: {message}");
                (None, 2)
            }
        })
    })
}

/// A directory berth names in the deployer's environment. Run by hand
/// without it, the deployer says so instead of working in the current
/// directory.
fn dir_from_env(name: &str) -> Result<PathBuf, VerbError> {
    match std::env::var_os(name) {
        Some(dir) if !dir.is_empty() => Ok(PathBuf::from(dir)),
        _ => Err(VerbError::Broken(format!(
            "{name} is not set: berth sets it when it runs the deployer"
        ))),
    }
}

/// The source's directory, checked against its digest.
fn source_dir(request: &Value) -> Result<PathBuf, VerbError> {
    let source = &request["source"];
    let url = source["url"].as_str().unwrap_or("");
    let path = url.strip_prefix("file://").unwrap_or(url);
    if !path.starts_with('/') {
        return Err(VerbError::Broken(
            "the nix deployer reads a source from a local directory (url=/path or file:///path); put other sources there first".into(),
        ));
    }
    let dir = PathBuf::from(path);
    if !dir.join("default.nix").is_file() {
        return Err(VerbError::Broken(format!(
            "the source directory {} has no default.nix",
            dir.display()
        )));
    }
    let out = Command::new("nix-hash")
        .args(["--type", "sha256"])
        .arg(&dir)
        .output()
        .map_err(|e| VerbError::Broken(format!("cannot run nix-hash (is Nix installed?): {e}")))?;
    let hash = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let expected = source["digest"].as_str().unwrap_or("");
    if !out.status.success() || format!("sha256:{hash}") != expected {
        return Err(VerbError::Broken(format!(
            "the source at {} does not match its digest (its NAR hash is sha256:{hash})",
            dir.display()
        )));
    }
    Ok(dir)
}

/// Nix's error output as a message a person can act on: the `error:` part,
/// store paths hidden (they may name secrets), the hint to --show-trace
/// dropped, cut to `MAX_MESSAGE_CHARS`.
pub fn cut_message(stderr: &str) -> String {
    let mut kept: Vec<String> = Vec::new();
    for line in stderr.lines() {
        let line = line.trim_end();
        if line.contains("--show-trace") || line.is_empty() {
            continue;
        }
        kept.push(hide_store_paths(line));
    }
    let text = kept.join("\n");
    let start = text.find("error:").unwrap_or(0);
    let mut message: String = text[start..].chars().take(MAX_MESSAGE_CHARS).collect();
    if message.is_empty() {
        message = "Nix evaluation failed without a message".into();
    }
    message
}

/// `/nix/store/<32 chars>-name` -> `/nix/store/…-name`.
fn hide_store_paths(line: &str) -> String {
    const STORE: &str = "/nix/store/";
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = rest.find(STORE) {
        out.push_str(&rest[..at + STORE.len()]);
        let after = &rest[at + STORE.len()..];
        let hash_len = after
            .bytes()
            .take_while(|c| c.is_ascii_alphanumeric())
            .count();
        if hash_len == 32 {
            out.push('…');
            rest = &after[32..];
        } else {
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Evaluates `body` (a Nix expression in which `source` is the source's
/// result for this request) to JSON. `write` lets it instantiate
/// derivations (their `drvPath`).
fn nix_eval(dir: &Path, request: &Value, body: &str, write: bool) -> VerbResult {
    // The request (every tenant's configuration, secrets included) goes
    // to Nix in a 0600 file, never on a command line: any local user reads
    // /proc/<pid>/cmdline, and an argument is at most 128 KiB.
    let request_file = request_file(request)?;
    let expr = format!(
        "{{ requestFile, sourceDir }}:\n\
         let\n\
           request = builtins.fromJSON (builtins.readFile requestFile);\n\
           source = import (/. + sourceDir) {{\n\
             configuration = request.configuration or {{ }};\n\
             deployment = request.deployment or \"\";\n\
             suspended = request.suspended or false;\n\
           }};\n\
         in {body}"
    );
    let mut cmd = Command::new("nix-instantiate");
    cmd.args(["--eval", "--strict", "--json"]);
    if write {
        cmd.arg("--read-write-mode");
    }
    cmd.arg("--argstr")
        .arg("requestFile")
        .arg(request_file.path())
        .arg("--argstr")
        .arg("sourceDir")
        .arg(dir)
        .arg("-E")
        .arg(expr)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd.spawn().map_err(|e| {
        VerbError::Broken(format!(
            "cannot run nix-instantiate (is Nix installed?): {e}"
        ))
    })?;
    let (stdout, stderr, status) =
        bounded_output(child).map_err(|e| VerbError::Broken(format!("nix-instantiate: {e}")))?;
    if !status.success() {
        return Err(VerbError::Refused(cut_message(&String::from_utf8_lossy(
            &stderr,
        ))));
    }
    if stdout.len() as u64 > MAX_NIX_OUTPUT_BYTES {
        return Err(VerbError::Broken("Nix's answer is too large".into()));
    }
    serde_json::from_slice(&stdout)
        .map_err(|e| VerbError::Broken(format!("Nix's answer is not JSON: {e}")))
}

/// The request in a file readable by this user only, in the call's own
/// scratch dir (or the system's temporary dir for a call without one),
/// removed when dropped.
struct RequestFile(std::path::PathBuf);

impl RequestFile {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for RequestFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn request_file(request: &Value) -> Result<RequestFile, VerbError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = std::env::var_os("BERTH_SCRATCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let path = dir.join(format!(
        "nix-request-{}.json",
        uuid::Uuid::now_v7().simple()
    ));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| VerbError::Broken(format!("cannot write the request for Nix: {e}")))?;
    let written = RequestFile(path);
    file.write_all(request.to_string().as_bytes())
        .map_err(|e| VerbError::Broken(format!("cannot write the request for Nix: {e}")))?;
    Ok(written)
}

/// A child's stdout (at most one byte past `MAX_NIX_OUTPUT_BYTES`, so the
/// caller can tell it was too large) and stderr (at most
/// `MAX_NIX_STDERR_BYTES`; only its start becomes a message), read at once
/// so neither pipe fills; the rest of each is drained, not kept.
fn bounded_output(
    mut child: std::process::Child,
) -> std::io::Result<(Vec<u8>, Vec<u8>, std::process::ExitStatus)> {
    fn keep_some(pipe: Option<impl Read>, limit: u64) -> std::io::Result<Vec<u8>> {
        let mut kept = Vec::new();
        if let Some(mut pipe) = pipe {
            (&mut pipe).take(limit).read_to_end(&mut kept)?;
            std::io::copy(&mut pipe, &mut std::io::sink())?;
        }
        Ok(kept)
    }
    let stderr = child.stderr.take();
    let errors = std::thread::spawn(move || keep_some(stderr, MAX_NIX_STDERR_BYTES));
    let stdout = keep_some(child.stdout.take(), MAX_NIX_OUTPUT_BYTES + 1)?;
    let stderr = errors
        .join()
        .map_err(|_| std::io::Error::other("reading Nix's errors failed"))??;
    Ok((stdout, stderr, child.wait()?))
}

fn describe(request: &Value) -> VerbResult {
    let dir = source_dir(request)?;
    // A source that cannot describe itself is broken, not a verdict.
    let mut described =
        nix_eval(&dir, &json!({}), "source.describe", false).map_err(|e| match e {
            VerbError::Refused(m) => VerbError::Broken(format!("describe: {m}")),
            other => other,
        })?;
    // This deployer activates, checks and confirms every node itself
    // (deployer.md), whatever the source says: berth rolls a deploy out
    // node by node (rollouts.md).
    match described.as_object_mut() {
        Some(map) => {
            map.insert("verbs".into(), json!(["check", "confirm", "activate"]));
        }
        None => {
            return Err(VerbError::Broken(
                "describe: the source's describe is not an attribute set".into(),
            ))
        }
    }
    Ok(described)
}

fn eval(request: &Value) -> VerbResult {
    let dir = source_dir(request)?;
    let nodes = nix_eval(
        &dir,
        request,
        "builtins.mapAttrs (name: node: { names = node.names or [ ]; fingerprint = if node ? toplevel then node.toplevel.drvPath else null; }) source.nodes",
        false,
    )?;
    // The fingerprint is the toplevel's derivation path: it changes exactly
    // when what the node would run does (lifecycle.md, preview `changes`).
    let list = node_list(&nodes)?
        .into_iter()
        .map(|(name, node)| json!({"name": name, "names": node["names"], "fingerprint": node["fingerprint"]}))
        .collect::<Vec<_>>();
    Ok(json!({ "nodes": list }))
}

/// The nodes of an evaluation, in name order, bounded.
fn node_list(nodes: &Value) -> Result<Vec<(String, Value)>, VerbError> {
    let map = nodes
        .as_object()
        .ok_or_else(|| VerbError::Broken("the source's `nodes` is not an attribute set".into()))?;
    if map.len() > MAX_NODES {
        return Err(VerbError::Refused(format!(
            "the configuration gives {} nodes; at most {MAX_NODES}",
            map.len()
        )));
    }
    // A node name reaches file paths (the GC root, the SBOM copy) and can
    // come from a configuration: only a DNS label is ever used.
    if map.keys().any(|name| !crate::model::is_dns_label(name, 63)) {
        return Err(VerbError::Refused(
            "the source names a node that is not a DNS label (a-z, 0-9, -, at most 63)".into(),
        ));
    }
    Ok(map.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

/// `nix-store --realise` of `drvs`, Nix's output in the build log; the
/// output paths in order.
fn realise(drvs: &[String]) -> Result<Vec<String>, String> {
    if drvs.is_empty() {
        return Ok(vec![]);
    }
    let mut cmd = Command::new("nix-store");
    cmd.arg("--realise");
    if let Ok(builders) = std::env::var("BERTH_NIX_BUILDERS") {
        cmd.args(["--option", "builders", &builders]);
    }
    let mut child = cmd
        .args(drvs)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot run nix-store: {e}"))?;
    let mut paths = Vec::new();
    if let Some(out) = child.stdout.take() {
        for line in std::io::BufReader::new(out).lines() {
            let line = line.map_err(|e| format!("nix-store: {e}"))?;
            println!("{line}");
            paths.push(line);
        }
    }
    let status = child.wait().map_err(|e| format!("nix-store: {e}"))?;
    if !status.success() || paths.len() != drvs.len() {
        return Err(format!("nix-store --realise failed ({status})"));
    }
    Ok(paths)
}

/// What the deployer remembers of a node between calls (the work dir's
/// `nix-state.json`), written only after a deploy or confirm succeeded.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
struct NodeState {
    /// The toplevel the last successful deploy activated.
    toplevel: String,
    /// Where it was activated (an SSH destination), if anywhere.
    #[serde(default)]
    target: Option<String>,
    /// The source's own health check for it (a store path), if any.
    #[serde(default)]
    check: Option<String>,
    /// Whether `confirm` made it permanent. A node not confirmed counts as
    /// changed on the next deploy (its revert may have fired).
    #[serde(default)]
    confirmed: bool,
    /// The confirmed toplevels, newest first, at most `BERTH_NIX_KEEP`:
    /// each has a GC root, so a rollback to one builds nothing.
    #[serde(default)]
    kept: Vec<String>,
}

type NodeStates = std::collections::BTreeMap<String, NodeState>;

/// The deploy state; none before the first deploy. A state file that does
/// not parse is an error, never an empty state (that would re-activate
/// every node and forget what is kept).
fn read_state(work: &Path) -> Result<NodeStates, VerbError> {
    let bytes = match std::fs::read(work.join(STATE_FILE)) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(NodeStates::new()),
        Err(e) => {
            return Err(VerbError::Broken(format!(
                "cannot read the deploy state: {e}"
            )))
        }
    };
    let broken = || {
        VerbError::Broken(format!("the deploy state {STATE_FILE} in the work dir is damaged; remove it to redeploy every node"))
    };
    let map: serde_json::Map<String, Value> =
        serde_json::from_slice(&bytes).map_err(|_| broken())?;
    let mut state = NodeStates::new();
    for (node, value) in map {
        let node_state = match value {
            // The first layout: the toplevel alone, activated for good.
            Value::String(toplevel) => NodeState {
                kept: vec![toplevel.clone()],
                toplevel,
                confirmed: true,
                ..NodeState::default()
            },
            other => serde_json::from_value(other).map_err(|_| broken())?,
        };
        state.insert(node, node_state);
    }
    Ok(state)
}

fn write_state(work: &Path, state: &NodeStates) -> Result<(), VerbError> {
    let text = serde_json::to_vec(state)
        .map_err(|e| VerbError::Broken(format!("cannot write the deploy state: {e}")))?;
    crate::deployer_side::write_atomically(&work.join(STATE_FILE), &text)
        .map_err(|e| VerbError::Broken(format!("cannot write the deploy state: {e}")))
}

/// Confirmed toplevels kept per node by default (`BERTH_NIX_KEEP`).
const DEFAULT_KEEP: u32 = 5;
/// At most this many (each pins a whole system closure on disk).
const MAX_KEEP: u32 = 100;
/// Seconds after an activation before the target goes back by itself
/// unless confirmed (`BERTH_NIX_CONFIRM_TIMEOUT`): above berth's default
/// `--health-timeout` (120 s) with room for the checks' interval.
const DEFAULT_CONFIRM_TIMEOUT_SECS: u64 = 300;
/// At most a day: a revert armed for longer protects nothing.
const MAX_CONFIRM_TIMEOUT_SECS: u64 = 86_400;
/// The target's system profile `confirm` sets (`BERTH_NIX_PROFILE`).
const DEFAULT_PROFILE: &str = "/nix/var/nix/profiles/system";
/// Where on a target the deployer keeps its arm (`BERTH_NIX_TARGET_DIR`;
/// relative paths are below the SSH login's home).
const DEFAULT_TARGET_DIR: &str = ".cache/berth-nix";

/// A whole-number knob from the environment, or its default; a value that
/// is not a number in `1..=max` is an error naming the variable.
fn knob(name: &str, default: u64, max: u64) -> Result<u64, VerbError> {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(default),
        Ok(text) => match text.trim().parse::<u64>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(VerbError::Broken(format!(
                "{name} must be a whole number from 1 to {max}"
            ))),
        },
        Err(std::env::VarError::NotUnicode(_)) => Err(VerbError::Broken(format!(
            "{name} must be a whole number from 1 to {max}"
        ))),
    }
}

fn text_knob(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_string())
}

/// Keeps GC roots (in the work dir's `gcroots/<node>/`, one per store
/// path) for exactly `paths`, so a `nix-collect-garbage` on this host
/// removes none of them and a rollback to one builds nothing; removes the
/// node's other roots. A failure is logged: the deploy stands.
fn keep_roots(work: &Path, node: &str, paths: &[&str]) {
    let dir = work.join("gcroots").join(node);
    // The first layout had one symlink `gcroots/<node>`.
    if std::fs::symlink_metadata(&dir).is_ok_and(|m| m.file_type().is_symlink()) {
        let _ = std::fs::remove_file(&dir);
    }
    if let Err(e) = crate::durable::create_dir_all(&dir, 0o777) {
        println!("{node}: could not make its GC root directory ({e})");
        return;
    }
    let name_of = |path: &str| path.rsplit('/').next().unwrap_or("").to_string();
    let wanted: Vec<String> = paths.iter().map(|p| name_of(p)).collect();
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for entry in entries.flatten() {
            if !wanted
                .iter()
                .any(|w| entry.file_name().to_string_lossy() == *w)
            {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    for (path, name) in paths.iter().zip(&wanted) {
        let root = dir.join(name);
        if std::fs::symlink_metadata(&root).is_ok() {
            continue;
        }
        let added = Command::new("nix-store")
            .arg("--add-root")
            .arg(&root)
            .args(["--indirect", "--realise", path])
            .stdout(Stdio::null())
            .status();
        match added {
            Ok(s) if s.success() => {}
            Ok(s) => println!("{node}: could not register a GC root ({s})"),
            Err(e) => println!("{node}: could not register a GC root ({e})"),
        }
    }
}

/// `text` as one word of a POSIX shell command line.
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// An SSH destination as the source gives it: `[user@]host[:port]`-like
/// text that ssh and nix-copy-closure can only read as a host (nothing
/// that starts with `-`, no spaces or shell characters).
fn valid_target(target: &str) -> bool {
    !target.is_empty()
        && target.len() <= 255
        && !target.starts_with('-')
        && target
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-@:[]".contains(&b))
}

/// `ssh [NIX_SSHOPTS] -- TARGET sh -c SCRIPT berth ARGS...`: the script
/// and its arguments quoted for the login's shell. `NIX_SSHOPTS` is Nix's
/// own variable for its SSH options, so one setting serves the copy and
/// the activation.
fn ssh(target: &str, script: &str, args: &[&str]) -> Command {
    let mut remote = format!("sh -c {} berth", shell_quote(script));
    for arg in args {
        remote.push(' ');
        remote.push_str(&shell_quote(arg));
    }
    let mut cmd = Command::new("ssh");
    // First, so no option after it can turn it off: a deployer has no
    // terminal, and a password or host-key prompt would hang the build.
    cmd.args(["-o", "BatchMode=yes"]);
    if let Ok(options) = std::env::var("NIX_SSHOPTS") {
        cmd.args(options.split_whitespace());
    }
    // `--`: a target is a host, never an option of ssh's.
    cmd.arg("--").arg(target).arg(remote);
    cmd.stdin(Stdio::null());
    cmd
}

/// `NIX_SSHOPTS` for `nix-copy-closure`: `BatchMode=yes` first, then
/// the operator's own options.
fn batch_ssh_options() -> String {
    match std::env::var("NIX_SSHOPTS") {
        Ok(options) => format!("-o BatchMode=yes {options}"),
        Err(_) => "-o BatchMode=yes".into(),
    }
}

/// On the target: claim the host for this node, arm the revert, then
/// `switch-to-configuration test`. Arguments: the node's dir, the
/// deploy's token (its build id), the previous toplevel (empty: the
/// running system, if any), the new toplevel, the timeout in seconds, the
/// node's name as the host's holder (`<deployment>.<node>`), and the
/// `REVERT` script. The revert is a detached process on the target
/// itself, so it fires even when berth never reaches the node again.
///
/// Each arm has its own id, `<token>.<time>.<pid>`, in `armed`; settling
/// an arm is `mkdir settled.<arm id>`, which the revert, a confirm and a
/// re-arm (`CHECK`) each take first, so exactly one of them acts on it.
/// The previous toplevel stays in `previous` for a re-arm and a revert
/// asked by berth (`GO_BACK`).
///
/// One arm per host: a host's system is one, so the first node that arms
/// on it holds it (`.holder` beside the node dirs, made with `ln -s`,
/// which is atomic and never replaces), and another deployment's node is
/// refused there until a destroy releases it (`RELEASE`).
const ARM_AND_TEST: &str = r#"set -u
d="$1"; token="$2"; previous="$3"; toplevel="$4"; timeout="$5"; holder="$6"; revert="$7"
mkdir -p "$d" || exit 1
base="$(dirname "$d")"
# The link points nowhere ("held-by:..." names no file), so `ln` never
# follows it into a directory: a second `ln -s` fails while it exists.
if ! ln -s "held-by:$holder" "$base/.holder" 2>/dev/null && [ "$(readlink "$base/.holder")" != "held-by:$holder" ]; then
  echo "refused: this host's system is $(readlink "$base/.holder") (one deployment's node per host); destroy that deployment first, or remove $base/.holder on the host" >&2
  exit 1
fi
if [ -z "$previous" ] && [ -e /run/current-system ]; then previous="$(readlink -f /run/current-system)"; fi
rm -rf "$d/reverted" "$d"/settled.*
arm="$token.$(date +%s).$$"
printf '%s\n' "$arm" > "$d/armed" || exit 1
printf '%s\n' "$previous" > "$d/previous" || exit 1
if [ -n "$previous" ]; then
  detach=; command -v setsid >/dev/null 2>&1 && detach=setsid
  nohup $detach sh -c 'sleep "$1"; shift; sh -c "$@"' revert "$timeout" "$revert" revert "$d" "$arm" "$previous" </dev/null >>"$d/revert.log" 2>&1 &
  echo "armed: back to the previous system after ${timeout}s unless confirmed"
else
  echo "no previous system on this node: nothing to go back to"
fi
if ! "$toplevel/bin/switch-to-configuration" test; then
  echo "switch-to-configuration test failed" >&2
  if [ -n "$previous" ] && mkdir "$d/settled.$arm" 2>/dev/null; then
    rm -f "$d/armed"; echo "going back to the previous system"
    "$previous/bin/switch-to-configuration" test
  fi
  exit 1
fi"#;

/// On the target, when the armed time is up: go back to the previous
/// system, unless this arm was settled first. Arguments: the node's dir,
/// the arm's id, the previous toplevel. `mkdir settled.<arm id>` is the
/// one atomic step this, `CONFIRM` and a re-arm take first: whichever
/// makes it acts, the others find it made and do nothing, so a confirm
/// near the timeout never leaves the node on the old system while its
/// boot entry says the new one, and a re-armed node ignores its old timer.
const REVERT: &str = r#"d="$1"; arm="$2"; previous="$3"
mkdir "$d/settled.$arm" 2>/dev/null || exit 0
[ "$(cat "$d/armed" 2>/dev/null)" = "$arm" ] || exit 0
rm -f "$d/armed"; printf '%s\n' "${arm%%.*}" > "$d/reverted"
"$previous/bin/switch-to-configuration" test"#;

/// On the target, for `activate` `previous`: settle this deploy's arm (its
/// timer then does nothing) and go back to the previous system now.
/// Arguments: the node's dir, the token. Exit 3: nothing to go back to.
const GO_BACK: &str = r#"d="$1"; token="$2"
previous="$(cat "$d/previous" 2>/dev/null)"
arm="$(cat "$d/armed" 2>/dev/null)"
case "$arm" in "$token".*) mkdir "$d/settled.$arm" 2>/dev/null && rm -f "$d/armed" ;; esac
if [ -z "$previous" ]; then echo "no previous system on this node: nothing to go back to" >&2; exit 3; fi
"$previous/bin/switch-to-configuration" test || exit 1
printf '%s\n' "$token" > "$d/reverted"
echo "back on the previous system""#;

/// On the target, at a destroy: the host's claim is released if this
/// node holds it. Arguments: the node dirs' base, the holder's name.
const RELEASE: &str =
    r#"if [ "$(readlink "$1/.holder" 2>/dev/null)" = "held-by:$2" ]; then rm -f "$1/.holder"; fi"#;

/// On the target: the node's health, one last line `healthy` or
/// `unhealthy: <reason>`; a healthy node holding this deploy's arm is
/// re-armed for another timeout (the old arm settled first, so its timer
/// does nothing): a rollout's watch keeps its nodes from going back while
/// berth runs. Arguments: the node's dir, the token, the source's check (a
/// store path, or empty), the timeout in seconds, the `REVERT` script.
const CHECK: &str = r#"d="$1"; token="$2"; check="$3"; timeout="$4"; revert="$5"
if [ "$(cat "$d/reverted" 2>/dev/null)" = "$token" ]; then
  echo "unhealthy: the node went back to its previous system (no confirm in time)"; exit 0
fi
state="$(systemctl is-system-running 2>/dev/null)"
case "$state" in
  running) ;;
  *) failed="$(systemctl --failed --no-legend --plain 2>/dev/null | awk '{print $1}' | head -n 5 | tr '\n' ' ')"
     echo "unhealthy: the system is ${state:-unknown}${failed:+; failed units: $failed}"; exit 0 ;;
esac
if [ -n "$check" ]; then
  if ! out="$("$check" 2>&1)"; then
    echo "unhealthy: the source's check failed: $(printf '%s\n' "$out" | tail -n 1)"; exit 0
  fi
fi
arm="$(cat "$d/armed" 2>/dev/null)"; previous="$(cat "$d/previous" 2>/dev/null)"
case "$arm" in "$token".*)
  if [ -n "$previous" ] && mkdir "$d/settled.$arm" 2>/dev/null; then
    new="$token.$(date +%s).$$"
    printf '%s\n' "$new" > "$d/armed"
    detach=; command -v setsid >/dev/null 2>&1 && detach=setsid
    nohup $detach sh -c 'sleep "$1"; shift; sh -c "$@"' revert "$timeout" "$revert" revert "$d" "$new" "$previous" </dev/null >>"$d/revert.log" 2>&1 &
    echo "re-armed: back to the previous system after ${timeout}s unless confirmed"
  fi ;;
esac
echo healthy"#;

/// On the target: disarm (only this deploy's arm), then the system
/// profile and the boot entry. Arguments: the node's dir, the token, the
/// toplevel, the profile.
const CONFIRM: &str = r#"d="$1"; token="$2"; toplevel="$3"; profile="$4"
arm="$(cat "$d/armed" 2>/dev/null)"
case "$arm" in "$token".*) ;; *) arm=; ;; esac
if [ -z "$arm" ] || ! mkdir "$d/settled.$arm" 2>/dev/null || [ "$(cat "$d/armed" 2>/dev/null)" != "$arm" ]; then
  echo "this deploy's revert is not armed on the node any more: it fired, or another deploy armed it" >&2; exit 1
fi
rm -f "$d/armed"
nix-env -p "$profile" --set "$toplevel" || exit 1
"$toplevel/bin/switch-to-configuration" boot || exit 1
echo "confirmed: the new system is the boot entry""#;

/// The node's directory on its target.
fn target_dir(deployment: &str, node: &str) -> String {
    format!(
        "{}/{}",
        text_knob("BERTH_NIX_TARGET_DIR", DEFAULT_TARGET_DIR),
        holder(deployment, node)
    )
}

/// The name a node holds its host by (and its dir's name there).
fn holder(deployment: &str, node: &str) -> String {
    format!("{deployment}.{node}")
}

/// Activates a changed node: a configured command, or over SSH with an
/// armed revert (deployer.md "The built-in Nix deployer"), or nothing for
/// a node without a target (built only).
fn activate(
    request: &Value,
    node: &str,
    toplevel: &str,
    check: Option<&str>,
    target: Option<&str>,
    previous: Option<&str>,
) -> Result<(), String> {
    if let Ok(command) = std::env::var("BERTH_NIX_ACTIVATE") {
        println!("activating {node} with the configured command");
        let status = Command::new("/bin/sh")
            .args(["-c", &command])
            .env("NODE", node)
            .env("TOPLEVEL", toplevel)
            .env("TARGET", target.unwrap_or(""))
            .status()
            .map_err(|e| format!("activating {node}: {e}"))?;
        return if status.success() {
            Ok(())
        } else {
            Err(format!("activating {node} failed ({status})"))
        };
    }
    let Some(target) = target else {
        println!("{node}: built; no target and no activation command, so nothing to activate");
        return Ok(());
    };
    let timeout = knob(
        "BERTH_NIX_CONFIRM_TIMEOUT",
        DEFAULT_CONFIRM_TIMEOUT_SECS,
        MAX_CONFIRM_TIMEOUT_SECS,
    )
    .map_err(|e| match e {
        VerbError::Refused(m) | VerbError::Broken(m) => m,
    })?;
    println!("copying {node} to {target}");
    let mut copy = Command::new("nix-copy-closure");
    copy.args(["--to", target, toplevel]);
    copy.env("NIX_SSHOPTS", batch_ssh_options());
    if let Some(check) = check {
        copy.arg(check);
    }
    let copied = copy
        .stdin(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run nix-copy-closure: {e}"))?;
    if !copied.success() {
        return Err(format!("copying {node} to its target failed ({copied})"));
    }
    println!(
        "activating {node} on {target} (switch-to-configuration test; the revert is armed first)"
    );
    let token = request["build"].as_str().unwrap_or("");
    let deployment = request["deployment"].as_str().unwrap_or("");
    let status = ssh(
        target,
        ARM_AND_TEST,
        &[
            &target_dir(deployment, node),
            token,
            previous.unwrap_or(""),
            toplevel,
            &timeout.to_string(),
            &holder(deployment, node),
            REVERT,
        ],
    )
    .status()
    .map_err(|e| format!("cannot run ssh: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("activating {node} on its target failed ({status})"))
    }
}

/// Every node's derivations from one evaluation, each target checked to
/// be an SSH destination before anything runs.
fn evaluated_nodes(dir: &Path, request: &Value) -> Result<Vec<(String, Value)>, VerbError> {
    println!("evaluating the source");
    let nodes = nix_eval(
        dir,
        request,
        "builtins.mapAttrs (name: node: {\n\
           toplevel = node.toplevel.drvPath;\n\
           sbom = if node ? sbom then node.sbom.drvPath else null;\n\
           check = if node ? check then node.check.drvPath else null;\n\
           target = node.target or null;\n\
         }) source.nodes",
        true,
    )
    .map_err(|e| match e {
        VerbError::Refused(m) => VerbError::Broken(format!("evaluation failed: {m}")),
        other => other,
    })?;
    let nodes = node_list(&nodes)?;
    for (name, node) in &nodes {
        if let Some(target) = node["target"].as_str() {
            if !valid_target(target) {
                return Err(VerbError::Broken(format!(
                    "node {name}'s target is not an SSH destination (letters, digits, . _ - @ : [ ], not starting with -)"
                )));
            }
        }
    }
    Ok(nodes)
}

/// The nodes' toplevels and their checks (a store path or none, per
/// node), built in one `nix-store --realise`: toplevels first.
fn built_nodes(nodes: &[(String, Value)]) -> Result<(Vec<String>, Vec<Option<String>>), VerbError> {
    let mut drvs: Vec<String> = nodes
        .iter()
        .map(|(_, n)| n["toplevel"].as_str().unwrap_or("").to_string())
        .collect();
    let checks: Vec<(usize, String)> = nodes
        .iter()
        .enumerate()
        .filter_map(|(i, (_, n))| n["check"].as_str().map(|c| (i, c.to_string())))
        .collect();
    drvs.extend(checks.iter().map(|(_, c)| c.clone()));
    println!("building {} node(s)", nodes.len());
    let built = realise(&drvs).map_err(VerbError::Broken)?;
    let (toplevels, check_paths) = built.split_at(nodes.len());
    let per_node = (0..nodes.len())
        .map(|i| {
            checks
                .iter()
                .position(|(at, _)| *at == i)
                .and_then(|k| check_paths.get(k).cloned())
        })
        .collect();
    Ok((toplevels.to_vec(), per_node))
}

fn deploy(request: &Value) -> VerbResult {
    let work = dir_from_env("BERTH_WORK_DIR")?;
    let scratch = dir_from_env("BERTH_SCRATCH_DIR")?;
    let dir = source_dir(request)?;
    let keep = knob(
        "BERTH_NIX_KEEP",
        u64::from(DEFAULT_KEEP),
        u64::from(MAX_KEEP),
    )?;
    let nodes = evaluated_nodes(&dir, request)?;
    let (toplevels, checks) = built_nodes(&nodes)?;
    let cache = Cache::from_env();
    if let Some(cache) = &cache {
        cache.copy(&toplevels)?;
    }
    let check_of = |i: usize| checks.get(i).cloned().flatten();
    let state = read_state(&work)?;
    let mut next = NodeStates::new();
    let mut results = Vec::new();
    let mut changed_nodes = Vec::new();
    for (i, ((name, node), toplevel)) in nodes.iter().zip(&toplevels).enumerate() {
        let fingerprint = node["toplevel"].clone();
        let before = state.get(name);
        let changed = before.is_none_or(|b| b.toplevel != *toplevel || !b.confirmed);
        let kept = before.map(|b| b.kept.clone()).unwrap_or_default();
        let check = check_of(i);
        let target = node["target"].as_str();
        let mut roots: Vec<&str> = kept.iter().map(String::as_str).collect();
        roots.push(toplevel);
        keep_roots(&work, name, &roots);
        if changed {
            // Activated by `activate`, wave by wave (rollouts.md).
            println!("{name}: built; berth activates it in its wave");
            changed_nodes.push((name.as_str(), node, fingerprint));
        } else {
            println!("{name}: unchanged");
            let artifact = artifact_of(toplevel, cache.as_ref());
            results.push(json!({"name": name, "changed": false, "fingerprint": fingerprint, "artifact": artifact}));
        }
        next.insert(
            name.clone(),
            NodeState {
                toplevel: toplevel.clone(),
                target: target.map(str::to_string),
                check,
                confirmed: !changed,
                kept: kept.into_iter().take(keep as usize).collect(),
            },
        );
    }
    let sbom_nodes: Vec<(&str, &Value)> = changed_nodes.iter().map(|(n, v, _)| (*n, *v)).collect();
    for ((name, report), (_, _, fingerprint)) in
        sboms(&sbom_nodes, &scratch).into_iter().zip(&changed_nodes)
    {
        let toplevel = next.get(name).map(|n| n.toplevel.as_str()).unwrap_or("");
        let artifact = artifact_of(toplevel, cache.as_ref());
        results.push(
            json!({"name": name, "changed": true, "sbom": report, "fingerprint": fingerprint, "artifact": artifact}),
        );
    }
    write_state(&work, &next)?;
    Ok(json!({ "nodes": results }))
}

/// Where `deploy` copies each toplevel's closure for agents
/// (`BERTH_NIX_CACHE`, a store URL `nix copy --to` takes, signing keys
/// included), and the URL the artifact names (`BERTH_NIX_CACHE_URL`,
/// default the same).
struct Cache {
    to: String,
    url: String,
}

impl Cache {
    fn from_env() -> Option<Cache> {
        let to = std::env::var("BERTH_NIX_CACHE")
            .ok()
            .filter(|v| !v.is_empty())?;
        let url = std::env::var("BERTH_NIX_CACHE_URL")
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| to.clone());
        Some(Cache { to, url })
    }

    /// Copies the toplevels' closures to the cache (paths it has already
    /// are not copied again).
    fn copy(&self, toplevels: &[String]) -> Result<(), VerbError> {
        println!(
            "copying {} toplevel(s) to the binary cache for agents",
            toplevels.len()
        );
        let status = Command::new("nix")
            .args([
                "--extra-experimental-features",
                "nix-command",
                "copy",
                "--to",
                &self.to,
            ])
            .args(toplevels)
            .stdin(Stdio::null())
            .status()
            .map_err(|e| VerbError::Broken(format!("cannot run nix copy: {e}")))?;
        if status.success() {
            Ok(())
        } else {
            Err(VerbError::Broken(format!(
                "copying the toplevels to BERTH_NIX_CACHE failed ({status})"
            )))
        }
    }
}

/// A node's artifact (deployer.md): its toplevel, and the cache that has
/// its closure when there is one.
fn artifact_of(toplevel: &str, cache: Option<&Cache>) -> Value {
    json!({"kind": "nix-store-path", "path": toplevel, "url": cache.map(|c| c.url.as_str())})
}

/// The toplevel a node goes back to: the newest confirmed one other than
/// its last deploy's (a rollback's own toplevel is among the kept).
fn previous_of(node: &NodeState) -> Option<&str> {
    node.kept
        .iter()
        .map(String::as_str)
        .find(|p| *p != node.toplevel)
}

/// `activate`: each requested node to its new toplevel (copy, arm the
/// revert, `switch-to-configuration test`) or back to its previous one;
/// one node's failure answers `false` and the others go on.
fn activate_nodes(request: &Value) -> VerbResult {
    let work = dir_from_env("BERTH_WORK_DIR")?;
    let state = read_state(&work)?;
    let to_new = match request["target"].as_str() {
        Some("new") => true,
        Some("previous") => false,
        _ => {
            return Err(VerbError::Broken(
                "the request's target is not \"new\" or \"previous\"".into(),
            ))
        }
    };
    let mut answers = Vec::new();
    for (name, node) in requested_nodes(request, &state)? {
        let done = if to_new {
            let target = node.target.as_deref();
            activate(
                request,
                &name,
                &node.toplevel,
                node.check.as_deref(),
                target,
                previous_of(node),
            )
        } else {
            go_back(request, &name, node)
        };
        answers.push(match done {
            Ok(()) => json!({"name": name, "activated": true}),
            Err(reason) => {
                println!("{name}: {reason}");
                json!({"name": name, "activated": false, "reason": reason})
            }
        });
    }
    Ok(json!({ "nodes": answers }))
}

/// `activate` `previous` for one node: the configured command with the
/// previous toplevel, or over SSH (`GO_BACK`), or nothing for a node
/// built only.
fn go_back(request: &Value, name: &str, node: &NodeState) -> Result<(), String> {
    if let Ok(command) = std::env::var("BERTH_NIX_ACTIVATE") {
        let previous = previous_of(node).ok_or("no previous system: nothing to go back to")?;
        println!("putting {name} back with the configured command");
        let status = Command::new("/bin/sh")
            .args(["-c", &command])
            .env("NODE", name)
            .env("TOPLEVEL", previous)
            .env("TARGET", node.target.as_deref().unwrap_or(""))
            .status()
            .map_err(|e| format!("putting {name} back: {e}"))?;
        return if status.success() {
            Ok(())
        } else {
            Err(format!("putting {name} back failed ({status})"))
        };
    }
    let Some(target) = node.target.as_deref() else {
        println!("{name}: built only; nothing to put back");
        return Ok(());
    };
    let token = request["build"].as_str().unwrap_or("");
    let deployment = request["deployment"].as_str().unwrap_or("");
    println!("putting {name} back on {target}");
    let status = ssh(target, GO_BACK, &[&target_dir(deployment, name), token])
        .status()
        .map_err(|e| format!("cannot run ssh: {e}"))?;
    match status.code() {
        Some(0) => Ok(()),
        Some(3) => Err("no previous system on the node: nothing to go back to".into()),
        _ => Err(format!(
            "putting {name} back on its target failed ({status})"
        )),
    }
}

/// The nodes a `check` or `confirm` request names, with their state.
fn requested_nodes<'a>(
    request: &Value,
    state: &'a NodeStates,
) -> Result<Vec<(String, &'a NodeState)>, VerbError> {
    let names = request["nodes"]
        .as_array()
        .ok_or_else(|| VerbError::Broken("the request has no list of nodes".into()))?;
    names
        .iter()
        .map(|n| {
            let name = n.as_str().unwrap_or("");
            state
                .get(name)
                .map(|s| (name.to_string(), s))
                .ok_or_else(|| {
                    VerbError::Broken(
                        "the request names a node the last deploy did not give".into(),
                    )
                })
        })
        .collect()
}

/// `check`: each changed node's health, asked on its target.
fn check(request: &Value) -> VerbResult {
    let work = dir_from_env("BERTH_WORK_DIR")?;
    let state = read_state(&work)?;
    let token = request["build"].as_str().unwrap_or("");
    let deployment = request["deployment"].as_str().unwrap_or("");
    let timeout = knob(
        "BERTH_NIX_CONFIRM_TIMEOUT",
        DEFAULT_CONFIRM_TIMEOUT_SECS,
        MAX_CONFIRM_TIMEOUT_SECS,
    )?;
    let mut answers = Vec::new();
    for (name, node) in requested_nodes(request, &state)? {
        let Some(target) = node
            .target
            .as_deref()
            .filter(|_| std::env::var_os("BERTH_NIX_ACTIVATE").is_none())
        else {
            // Built only, or activated by the configured command: nothing
            // here to ask.
            answers.push(json!({"name": name, "healthy": true}));
            continue;
        };
        let asked = ssh(
            target,
            CHECK,
            &[
                &target_dir(deployment, &name),
                token,
                node.check.as_deref().unwrap_or(""),
                &timeout.to_string(),
                REVERT,
            ],
        )
        .stderr(Stdio::inherit())
        .output();
        let verdict = match asked {
            Err(e) => Err(format!("cannot run ssh: {e}")),
            Ok(out) => {
                let text = String::from_utf8_lossy(&out.stdout).to_string();
                for line in text.lines() {
                    println!("{name}: {line}");
                }
                match text.lines().last().map(str::trim) {
                    Some("healthy") if out.status.success() => Ok(()),
                    Some(line) if line.starts_with("unhealthy: ") => {
                        Err(line.trim_start_matches("unhealthy: ").to_string())
                    }
                    _ => Err(format!("the node did not answer over SSH ({})", out.status)),
                }
            }
        };
        answers.push(match verdict {
            Ok(()) => json!({"name": name, "healthy": true}),
            Err(reason) => json!({"name": name, "healthy": false, "reason": reason}),
        });
    }
    Ok(json!({ "nodes": answers }))
}

/// `confirm`: disarm each changed node's revert and make its toplevel the
/// boot entry; then it is kept (GC root) among the last `BERTH_NIX_KEEP`.
fn confirm(request: &Value) -> VerbResult {
    let work = dir_from_env("BERTH_WORK_DIR")?;
    let keep = knob(
        "BERTH_NIX_KEEP",
        u64::from(DEFAULT_KEEP),
        u64::from(MAX_KEEP),
    )? as usize;
    let mut state = read_state(&work)?;
    let token = request["build"].as_str().unwrap_or("");
    let deployment = request["deployment"].as_str().unwrap_or("");
    let profile = text_knob("BERTH_NIX_PROFILE", DEFAULT_PROFILE);
    let names: Vec<(String, NodeState)> = requested_nodes(request, &state)?
        .into_iter()
        .map(|(n, s)| (n, s.clone()))
        .collect();
    for (name, node) in names {
        if let Some(target) = node
            .target
            .as_deref()
            .filter(|_| std::env::var_os("BERTH_NIX_ACTIVATE").is_none())
        {
            let status = ssh(
                target,
                CONFIRM,
                &[
                    &target_dir(deployment, &name),
                    token,
                    &node.toplevel,
                    &profile,
                ],
            )
            .status()
            .map_err(|e| VerbError::Broken(format!("cannot run ssh: {e}")))?;
            if !status.success() {
                return Err(VerbError::Broken(format!(
                    "confirming {name} on its target failed ({status})"
                )));
            }
        }
        let mut kept = vec![node.toplevel.clone()];
        kept.extend(node.kept.iter().filter(|k| **k != node.toplevel).cloned());
        kept.truncate(keep);
        let roots: Vec<&str> = kept.iter().map(String::as_str).collect();
        keep_roots(&work, &name, &roots);
        println!(
            "{name}: confirmed; {} system(s) kept for rollback",
            kept.len()
        );
        state.insert(
            name,
            NodeState {
                confirmed: true,
                kept,
                ..node
            },
        );
    }
    write_state(&work, &state)?;
    Ok(json!({}))
}

/// Builds the SBOMs of the changed nodes into the scratch dir, all in one
/// `nix-store --realise` (each alone when that fails, so one bad SBOM
/// spoils only its node); never fails the deploy (FR-017).
fn sboms<'a>(nodes: &[(&'a str, &Value)], scratch: &Path) -> Vec<(&'a str, Value)> {
    let unavailable = |reason: &str| json!({"status": "unavailable", "reason": reason});
    let wanted: Vec<(&str, String)> = nodes
        .iter()
        .filter_map(|(name, node)| node["sbom"].as_str().map(|d| (*name, d.to_string())))
        .collect();
    let drvs: Vec<String> = wanted.iter().map(|(_, d)| d.clone()).collect();
    let built: Vec<Option<String>> = match realise(&drvs) {
        Ok(paths) => paths.into_iter().map(Some).collect(),
        Err(_) => drvs
            .iter()
            .map(|d| {
                realise(std::slice::from_ref(d))
                    .ok()
                    .and_then(|p| p.into_iter().next())
            })
            .collect(),
    };
    let mut out = Vec::new();
    for (name, _) in nodes {
        let path = wanted
            .iter()
            .position(|(n, _)| n == name)
            .map(|at| built.get(at).cloned().flatten());
        let report = match path {
            None => unavailable("the source gives no sbom for this node"),
            Some(None) => unavailable("building the sbom derivation failed"),
            Some(Some(path)) => {
                let rel = format!("sbom/{name}.cdx.json");
                let copied = std::fs::create_dir_all(scratch.join("sbom"))
                    .and_then(|_| std::fs::copy(&path, scratch.join(&rel)));
                match copied {
                    Ok(_) => json!({"status": "ready", "path": rel}),
                    Err(_) => unavailable("the sbom derivation's output is not a file"),
                }
            }
        };
        out.push((*name, report));
    }
    out
}

fn destroy(request: &Value) -> VerbResult {
    let work = dir_from_env("BERTH_WORK_DIR")?;
    let dir = source_dir(request)?;
    let hook = nix_eval(
        &dir,
        request,
        "if source ? destroy then source.destroy.drvPath else null",
        true,
    )
    .map_err(|e| match e {
        VerbError::Refused(m) => VerbError::Broken(format!("evaluation failed: {m}")),
        other => other,
    })?;
    if let Some(drv) = hook.as_str() {
        let script = realise(&[drv.to_string()]).map_err(VerbError::Broken)?;
        println!("running the source's destroy hook");
        let status = Command::new("/bin/sh")
            .args(&script)
            .env("DEPLOYMENT", request["deployment"].as_str().unwrap_or(""))
            .status()
            .map_err(|e| VerbError::Broken(format!("the destroy hook: {e}")))?;
        if !status.success() {
            return Err(VerbError::Broken(format!(
                "the destroy hook failed ({status})"
            )));
        }
    } else {
        println!("the source has no destroy hook");
    }
    release_hosts(request, &read_state(&work)?);
    let _ = std::fs::remove_file(work.join(STATE_FILE));
    Ok(json!({}))
}

/// Releases the hosts the deployment's nodes hold (`ARM_AND_TEST`). A host
/// that cannot be reached keeps its claim, and the log says how to
/// release it by hand; the destroy itself goes on.
fn release_hosts(request: &Value, state: &NodeStates) {
    if std::env::var_os("BERTH_NIX_ACTIVATE").is_some() {
        return;
    }
    let deployment = request["deployment"].as_str().unwrap_or("");
    let base = text_knob("BERTH_NIX_TARGET_DIR", DEFAULT_TARGET_DIR);
    for (name, node) in state {
        let Some(target) = node.target.as_deref() else {
            continue;
        };
        let released = ssh(target, RELEASE, &[&base, &holder(deployment, name)]).status();
        match released {
            Ok(status) if status.success() => println!("{name}: released its host {target}"),
            Ok(status) => println!(
                "{name}: could not release its host {target} ({status}); remove {base}/.holder there by hand before another deployment uses it"
            ),
            Err(e) => println!(
                "{name}: cannot run ssh to release its host {target} ({e}); remove {base}/.holder there by hand before another deployment uses it"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nix_errors_are_cut_and_hide_store_paths() {
        let stderr = "error: an enabled application needs a domain\n\
                      \n       at /nix/store/0123456789abcdefghijklmnopqrstuv-source/default.nix:12:5:\n\
                      (use '--show-trace' to show detailed location information)\n";
        let m = cut_message(stderr);
        assert!(
            m.starts_with("error: an enabled application needs a domain"),
            "{m}"
        );
        assert!(m.contains("/nix/store/…-source/default.nix"), "{m}");
        assert!(!m.contains("0123456789abcdef"), "{m}");
        assert!(!m.contains("show-trace"), "{m}");
        assert!(cut_message(&"error: x".repeat(1000)).chars().count() <= MAX_MESSAGE_CHARS);
    }

    /// A directory for one test of the target scripts: fake toplevels
    /// whose `switch-to-configuration` appends `<name> <verb>` to
    /// `history`, and a `nix-env` stand-in first on the PATH.
    fn target_scratch(tag: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("berth-target-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (name, body) in [
            (
                "old/bin/switch-to-configuration",
                format!("echo \"old $1\" >> {}/history", dir.display()),
            ),
            (
                "new/bin/switch-to-configuration",
                format!("echo \"new $1\" >> {}/history", dir.display()),
            ),
            ("stubs/nix-env", "exit 0".to_string()),
            ("stubs/systemctl", "echo running".to_string()),
        ] {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        dir
    }

    /// One target script run by `/bin/sh` as ssh would run it.
    fn on_target(dir: &Path, script: &str, args: &[&str]) -> Command {
        let path = format!(
            "{}:{}",
            dir.join("stubs").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut c = Command::new("/bin/sh");
        c.arg("-c")
            .arg(script)
            .arg("berth")
            .args(args)
            .env("PATH", path);
        c.stdout(Stdio::null()).stderr(Stdio::null());
        c
    }

    /// A confirm and the armed revert racing near the timeout settle one
    /// way only: either the confirm succeeds and the node stays on the new
    /// system, or the revert went back and the confirm fails, never both.
    #[test]
    fn a_confirm_and_its_revert_at_the_same_instant_settle_one_way_only() {
        let dir = target_scratch("race");
        let node = dir.join("node");
        let (old, new) = (dir.join("old"), dir.join("new"));
        let profile = dir.join("profile");
        for round in 0..40 {
            let token = format!("build-{round}");
            let arm = format!("{token}.0.{round}");
            std::fs::create_dir_all(&node).unwrap();
            std::fs::write(node.join("armed"), format!("{arm}\n")).unwrap();
            let _ = std::fs::remove_file(dir.join("history"));
            let node = node.to_str().unwrap();
            let mut revert = on_target(&dir, REVERT, &[node, &arm, old.to_str().unwrap()])
                .spawn()
                .unwrap();
            let confirm_args = [
                node,
                &token,
                new.to_str().unwrap(),
                profile.to_str().unwrap(),
            ];
            let confirmed = on_target(&dir, CONFIRM, &confirm_args)
                .status()
                .unwrap()
                .success();
            assert!(revert.wait().unwrap().success());
            let history = std::fs::read_to_string(dir.join("history")).unwrap_or_default();
            let went_back = history.contains("old test");
            assert!(
                confirmed != went_back,
                "round {round}: confirmed {confirmed}, history {history:?}"
            );
            assert_eq!(
                confirmed,
                history.contains("new boot"),
                "round {round}: {history:?}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A healthy check re-arms: the old arm's timer then does nothing, and
    /// the confirm settles the new arm.
    #[test]
    fn a_check_re_arms_so_the_old_timer_does_nothing_and_the_confirm_still_settles() {
        let dir = target_scratch("re-arm");
        let node = dir.join("node");
        std::fs::create_dir_all(&node).unwrap();
        std::fs::write(node.join("armed"), "tok.0.1\n").unwrap();
        std::fs::write(
            node.join("previous"),
            format!("{}\n", dir.join("old").display()),
        )
        .unwrap();
        let node_text = node.to_str().unwrap();
        // The new timer's script does nothing here (it would sleep an hour).
        let checked = on_target(&dir, CHECK, &[node_text, "tok", "", "3600", "exit 0"])
            .stdout(Stdio::piped())
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&checked.stdout).to_string();
        assert!(
            said.contains("re-armed") && said.trim_end().ends_with("healthy"),
            "{said}"
        );
        let armed = std::fs::read_to_string(node.join("armed")).unwrap();
        assert!(
            armed.starts_with("tok.") && armed.trim() != "tok.0.1",
            "{armed}"
        );
        let old = dir.join("old");
        let fired =
            on_target(&dir, REVERT, &[node_text, "tok.0.1", old.to_str().unwrap()]).status();
        assert!(fired.unwrap().success());
        let history = || std::fs::read_to_string(dir.join("history")).unwrap_or_default();
        assert!(
            !history().contains("old test"),
            "the old timer went back: {}",
            history()
        );
        let new = dir.join("new");
        let profile = dir.join("profile");
        let confirm = [
            node_text,
            "tok",
            new.to_str().unwrap(),
            profile.to_str().unwrap(),
        ];
        assert!(on_target(&dir, CONFIRM, &confirm)
            .status()
            .unwrap()
            .success());
        assert!(history().contains("new boot"), "{}", history());
        // The new timer would sleep on for an hour after the test: its
        // command line names this node's dir, and it leads its own group
        // (setsid), its sleep in it.
        let found = Command::new("pgrep")
            .args(["-f", node_text])
            .output()
            .unwrap();
        let timers: Vec<i32> = String::from_utf8_lossy(&found.stdout)
            .split_whitespace()
            .filter_map(|pid| pid.parse().ok())
            .collect();
        assert!(!timers.is_empty(), "no timer of {node_text} to stop");
        for pid in timers {
            let group = nix::unistd::Pid::from_raw(pid);
            nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL).unwrap();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// One node per host: a second deployment's node is refused where
    /// another holds the host, until a destroy releases it.
    #[test]
    fn a_host_held_by_one_deployment_refuses_another_until_released() {
        let dir = target_scratch("holder");
        let base = dir.join("nodes");
        let new = dir.join("new");
        let arm = |holder: &str| {
            let node = base.join(holder);
            on_target(
                &dir,
                ARM_AND_TEST,
                &[
                    node.to_str().unwrap(),
                    "t1",
                    "",
                    new.to_str().unwrap(),
                    "60",
                    holder,
                    REVERT,
                ],
            )
            .status()
            .unwrap()
            .success()
        };
        assert!(arm("alice.web"));
        assert!(arm("alice.web"), "its holder arms again");
        assert!(!arm("bob.web"), "another deployment's node is refused");
        let released = |holder: &str| {
            on_target(&dir, RELEASE, &[base.to_str().unwrap(), holder])
                .status()
                .unwrap()
                .success()
        };
        assert!(released("bob.web"), "a release by another changes nothing");
        assert!(!arm("bob.web"));
        assert!(released("alice.web"));
        assert!(arm("bob.web"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// ssh is run in batch mode before any option the operator gives
    /// (ssh keeps an option's first value), so no prompt can hang a build.
    #[test]
    fn ssh_runs_in_batch_mode_whatever_the_options() {
        let cmd = ssh("root@host", "true", &[]);
        let args: Vec<_> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(args[..2], ["-o", "BatchMode=yes"], "{args:?}");
        assert!(batch_ssh_options().starts_with("-o BatchMode=yes"));
    }
}
