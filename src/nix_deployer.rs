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
//! - Activation: `BERTH_NIX_ACTIVATE` (a shell command; `NODE`, `TOPLEVEL`,
//!   `TARGET` in its environment) when set, else for a node with a `target`
//!   `nix-copy-closure --to TARGET` and `ssh TARGET TOPLEVEL/bin/
//!   switch-to-configuration switch`, else nothing (built only, logged).
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
enum Failure {
    Refused(String),
    Broken(String),
}

type Outcome = Result<Value, Failure>;

pub fn run(verb: &str) -> i32 {
    crate::deployer_side::run("nix", verb, |verb, request| {
        let outcome = match verb {
            "describe" => describe(request),
            "eval" => eval(request),
            "deploy" => deploy(request),
            "destroy" => destroy(request),
            _ => return None,
        };
        Some(match outcome {
            Ok(v) => (Some(v), 0),
            Err(Failure::Refused(message)) => (Some(json!({"error": {"message": message}})), 1),
            Err(Failure::Broken(message)) => {
                eprintln!("berth deployer nix: {message}");
                (None, 2)
            }
        })
    })
}

/// A directory berth names in the deployer's environment. Run by hand
/// without it, the deployer says so instead of working in the current
/// directory.
fn dir_from_env(name: &str) -> Result<PathBuf, Failure> {
    match std::env::var_os(name) {
        Some(dir) if !dir.is_empty() => Ok(PathBuf::from(dir)),
        _ => Err(Failure::Broken(format!(
            "{name} is not set: berth sets it when it runs the deployer"
        ))),
    }
}

/// The source's directory, checked against its digest.
fn source_dir(request: &Value) -> Result<PathBuf, Failure> {
    let source = &request["source"];
    let url = source["url"].as_str().unwrap_or("");
    let path = url.strip_prefix("file://").unwrap_or(url);
    if !path.starts_with('/') {
        return Err(Failure::Broken(
            "the nix deployer reads a source from a local directory (url=/path or file:///path); put other sources there first".into(),
        ));
    }
    let dir = PathBuf::from(path);
    if !dir.join("default.nix").is_file() {
        return Err(Failure::Broken(format!(
            "the source directory {} has no default.nix",
            dir.display()
        )));
    }
    let out = Command::new("nix-hash")
        .args(["--type", "sha256"])
        .arg(&dir)
        .output()
        .map_err(|e| Failure::Broken(format!("cannot run nix-hash (is Nix installed?): {e}")))?;
    let hash = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let expected = source["digest"].as_str().unwrap_or("");
    if !out.status.success() || format!("sha256:{hash}") != expected {
        return Err(Failure::Broken(format!(
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
fn nix_eval(dir: &Path, request: &Value, body: &str, write: bool) -> Outcome {
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
        Failure::Broken(format!(
            "cannot run nix-instantiate (is Nix installed?): {e}"
        ))
    })?;
    let (stdout, stderr, status) =
        bounded_output(child).map_err(|e| Failure::Broken(format!("nix-instantiate: {e}")))?;
    if !status.success() {
        return Err(Failure::Refused(cut_message(&String::from_utf8_lossy(
            &stderr,
        ))));
    }
    if stdout.len() as u64 > MAX_NIX_OUTPUT_BYTES {
        return Err(Failure::Broken("Nix's answer is too large".into()));
    }
    serde_json::from_slice(&stdout)
        .map_err(|e| Failure::Broken(format!("Nix's answer is not JSON: {e}")))
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

fn request_file(request: &Value) -> Result<RequestFile, Failure> {
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
        .map_err(|e| Failure::Broken(format!("cannot write the request for Nix: {e}")))?;
    let written = RequestFile(path);
    file.write_all(request.to_string().as_bytes())
        .map_err(|e| Failure::Broken(format!("cannot write the request for Nix: {e}")))?;
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

fn describe(request: &Value) -> Outcome {
    let dir = source_dir(request)?;
    // A source that cannot describe itself is broken, not a verdict.
    nix_eval(&dir, &json!({}), "source.describe", false).map_err(|e| match e {
        Failure::Refused(m) => Failure::Broken(format!("describe: {m}")),
        other => other,
    })
}

fn eval(request: &Value) -> Outcome {
    let dir = source_dir(request)?;
    let nodes = nix_eval(
        &dir,
        request,
        "builtins.mapAttrs (name: node: { names = node.names or [ ]; }) source.nodes",
        false,
    )?;
    let list = node_list(&nodes)?
        .into_iter()
        .map(|(name, node)| json!({"name": name, "names": node["names"]}))
        .collect::<Vec<_>>();
    Ok(json!({ "nodes": list }))
}

/// The nodes of an evaluation, in name order, bounded.
fn node_list(nodes: &Value) -> Result<Vec<(String, Value)>, Failure> {
    let map = nodes
        .as_object()
        .ok_or_else(|| Failure::Broken("the source's `nodes` is not an attribute set".into()))?;
    if map.len() > MAX_NODES {
        return Err(Failure::Refused(format!(
            "the configuration gives {} nodes; at most {MAX_NODES}",
            map.len()
        )));
    }
    // A node name reaches file paths (the GC root, the SBOM copy) and can
    // come from a configuration: only a DNS label is ever used.
    if map.keys().any(|name| !crate::model::is_dns_label(name, 63)) {
        return Err(Failure::Refused(
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

/// Registers a node's toplevel as a garbage-collector root in the work dir
/// (`gcroots/<node>`), so a `nix-collect-garbage` on this host does not
/// remove what is deployed; the next deploy of the node replaces it, a
/// destroy removes the work dir and with it the root. A failure is logged:
/// the deploy stands.
fn keep(work: &Path, node: &str, toplevel: &str) {
    let roots = work.join("gcroots");
    let added = std::fs::create_dir_all(&roots)
        .map_err(|e| e.to_string())
        .and_then(|_| {
            Command::new("nix-store")
                .arg("--add-root")
                .arg(roots.join(node))
                .args(["--indirect", "--realise", toplevel])
                .stdout(Stdio::null())
                .status()
                .map_err(|e| e.to_string())
        });
    match added {
        Ok(s) if s.success() => {}
        Ok(s) => println!("{node}: could not register a GC root ({s})"),
        Err(e) => println!("{node}: could not register a GC root ({e})"),
    }
}

fn read_state(work: &Path) -> serde_json::Map<String, Value> {
    std::fs::read(work.join(STATE_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default()
}

fn write_state(work: &Path, state: &serde_json::Map<String, Value>) -> Result<(), String> {
    crate::deployer_side::write_atomically(
        &work.join(STATE_FILE),
        Value::Object(state.clone()).to_string().as_bytes(),
    )
    .map_err(|e| format!("cannot write the deploy state: {e}"))
}

fn activate(node: &str, toplevel: &str, target: Option<&str>) -> Result<(), String> {
    let status = if let Ok(command) = std::env::var("BERTH_NIX_ACTIVATE") {
        println!("activating {node} with the configured command");
        Command::new("/bin/sh")
            .args(["-c", &command])
            .env("NODE", node)
            .env("TOPLEVEL", toplevel)
            .env("TARGET", target.unwrap_or(""))
            .status()
    } else if let Some(target) = target {
        println!("copying {node} to {target}");
        let copied = Command::new("nix-copy-closure")
            .args(["--to", target, toplevel])
            .status()
            .map_err(|e| format!("cannot run nix-copy-closure: {e}"))?;
        if !copied.success() {
            return Err(format!("copying {node} to its target failed ({copied})"));
        }
        println!("activating {node} on {target}");
        // `--`: a target is a host, never an option of ssh's.
        Command::new("ssh")
            .args([
                "--",
                target,
                &format!("{toplevel}/bin/switch-to-configuration"),
                "switch",
            ])
            .status()
    } else {
        println!("{node}: built; no target and no activation command, so nothing to activate");
        return Ok(());
    };
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("activating {node} failed ({s})")),
        Err(e) => Err(format!("activating {node}: {e}")),
    }
}

fn deploy(request: &Value) -> Outcome {
    let work = dir_from_env("BERTH_WORK_DIR")?;
    let scratch = dir_from_env("BERTH_SCRATCH_DIR")?;
    let dir = source_dir(request)?;
    println!("evaluating the source");
    // One evaluation gives every node's derivations.
    let nodes = nix_eval(
        &dir,
        request,
        "builtins.mapAttrs (name: node: {\n\
           toplevel = node.toplevel.drvPath;\n\
           sbom = if node ? sbom then node.sbom.drvPath else null;\n\
           target = node.target or null;\n\
         }) source.nodes",
        true,
    )
    .map_err(|e| match e {
        Failure::Refused(m) => Failure::Broken(format!("evaluation failed: {m}")),
        other => other,
    })?;
    let nodes = node_list(&nodes)?;
    let drvs: Vec<String> = nodes
        .iter()
        .map(|(_, n)| n["toplevel"].as_str().unwrap_or("").to_string())
        .collect();
    println!("building {} node(s)", drvs.len());
    let toplevels = realise(&drvs).map_err(Failure::Broken)?;
    let state = read_state(&work);
    let mut next = serde_json::Map::new();
    let mut results = Vec::new();
    let mut changed_nodes = Vec::new();
    for ((name, node), toplevel) in nodes.iter().zip(&toplevels) {
        let changed = state.get(name).and_then(Value::as_str) != Some(toplevel.as_str());
        next.insert(name.clone(), Value::String(toplevel.clone()));
        keep(&work, name, toplevel);
        if changed {
            activate(name, toplevel, node["target"].as_str()).map_err(Failure::Broken)?;
            changed_nodes.push((name.as_str(), node));
        } else {
            println!("{name}: unchanged");
            results.push(json!({"name": name, "changed": false}));
        }
    }
    for (name, report) in sboms(&changed_nodes, &scratch) {
        results.push(json!({"name": name, "changed": true, "sbom": report}));
    }
    write_state(&work, &next).map_err(Failure::Broken)?;
    Ok(json!({ "nodes": results }))
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

fn destroy(request: &Value) -> Outcome {
    let work = dir_from_env("BERTH_WORK_DIR")?;
    let dir = source_dir(request)?;
    let hook = nix_eval(
        &dir,
        request,
        "if source ? destroy then source.destroy.drvPath else null",
        true,
    )
    .map_err(|e| match e {
        Failure::Refused(m) => Failure::Broken(format!("evaluation failed: {m}")),
        other => other,
    })?;
    if let Some(drv) = hook.as_str() {
        let script = realise(&[drv.to_string()]).map_err(Failure::Broken)?;
        println!("running the source's destroy hook");
        let status = Command::new("/bin/sh")
            .args(&script)
            .env("DEPLOYMENT", request["deployment"].as_str().unwrap_or(""))
            .status()
            .map_err(|e| Failure::Broken(format!("the destroy hook: {e}")))?;
        if !status.success() {
            return Err(Failure::Broken(format!(
                "the destroy hook failed ({status})"
            )));
        }
    } else {
        println!("the source has no destroy hook");
    }
    let _ = std::fs::remove_file(work.join(STATE_FILE));
    Ok(json!({}))
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
}
