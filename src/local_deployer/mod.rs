//! The embedded `local` deployer: `berth deployer local <verb>`.
//!
//! It exists so that `berth serve` works on any machine with nothing else
//! installed, and so that every part of the deployer protocol (spec
//! deployer.md) is exercised for real: it talks only the protocol (stdin,
//! `BERTH_RESULT`, `BERTH_WORK_DIR`, `BERTH_SCRATCH_DIR`, exit status) and
//! shares no state with the server. It "deploys" into the work dir.

mod activate;
pub mod catalog;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

/// Default of `BERTH_LOCAL_MAX_NODES`.
const DEFAULT_MAX_NODES: usize = 32;
/// Default of `BERTH_LOCAL_STEP_MS`.
const DEFAULT_STEP_MS: u64 = 200;
/// Exit status after SIGTERM (128 + 15, as a shell would report it).
const EXIT_TERMINATED: i32 = 143;

static TERMINATED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigterm(_: nix::libc::c_int) {
    TERMINATED.store(true, Ordering::SeqCst);
}

fn install_sigterm_handler() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(on_sigterm),
        SaFlags::empty(),
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    let _ = unsafe { sigaction(Signal::SIGTERM, &action) };
}

/// A node the deployment stands up.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub name: String,
    pub names: Vec<String>,
    /// The applications it runs (one, or none for `base`).
    pub application: Option<String>,
}

/// Runs one verb; returns the process exit status.
pub fn run(verb: &str) -> i32 {
    install_sigterm_handler();
    crate::deployer_side::run("local", verb, |verb, request| {
        let outcome = match verb {
            "describe" => Ok(describe()),
            "eval" => eval_verb(request),
            "deploy" => deploy(request),
            "destroy" => destroy(request),
            "check" => check(request),
            "confirm" => confirm(request),
            "activate" if activate::enabled() => activate::activate(request),
            _ => return None,
        };
        Some(match outcome {
            Ok(v) => (v, 0),
            Err((v, code)) => (v, code),
        })
    })
}

type VerbResult = Result<Option<Value>, (Option<Value>, i32)>;

fn describe() -> Option<Value> {
    Some(json!({
        "methods": ["local"],
        "default_method": "local",
        "actions": {"suspend": ["local"], "resume": ["local"]},
        "catalog": catalog::catalog(),
        "renames": [],
        "schema": catalog::schema(),
        "verbs": if activate::enabled() {
            json!(["check", "confirm", "activate"])
        } else {
            json!(["check", "confirm"])
        },
    }))
}

fn refuse(message: String) -> (Option<Value>, i32) {
    (Some(json!({"error": {"message": message}})), 1)
}

fn eval_verb(request: &Value) -> VerbResult {
    let nodes = evaluate(request).map_err(refuse)?;
    let rendered = Rendering::of(request);
    Ok(Some(json!({"nodes": nodes
        .iter()
        .map(|n| json!({"name": n.name, "names": n.names, "fingerprint": fingerprint(&rendered.text(n))}))
        .collect::<Vec<_>>()})))
}

/// What a node's rendered configuration is made of (deploy writes it to
/// `nodes/<node>.json`; its digest is the node's fingerprint).
struct Rendering {
    deployment: String,
    apps: Map<String, Value>,
    suspended: bool,
}

impl Rendering {
    fn of(request: &Value) -> Rendering {
        let config = request.get("configuration").cloned().unwrap_or(Value::Null);
        Rendering {
            deployment: request
                .get("deployment")
                .and_then(Value::as_str)
                .unwrap_or("unknown")
                .to_string(),
            apps: crate::derive::shape(&config)
                .map(|s| s.apps().clone())
                .unwrap_or_default(),
            suspended: request
                .get("suspended")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        }
    }

    /// The settings of a node's application.
    fn settings(&self, node: &Node) -> Option<&Value> {
        node.application.as_ref().and_then(|a| self.apps.get(a))
    }

    fn text(&self, node: &Node) -> String {
        let rendered = json!({
            "node": node.name,
            "deployment": self.deployment,
            "application": node.application,
            "settings": self.settings(node),
            "names": node.names,
            "suspended": self.suspended,
        });
        serde_json::to_string_pretty(&rendered).unwrap_or_default()
    }
}

/// A node's fingerprint: the digest of its rendered configuration, which
/// changes exactly when what the node runs changes.
fn fingerprint(rendered: &str) -> String {
    format!("sha256:{}", hex(&Sha256::digest(rendered.as_bytes())))
}

/// The setting of an application that makes its node fail every health
/// check (README: "A deploy that breaks a node is rolled back by
/// itself"): `{"enable": true, "unhealthy": true}`.
pub const UNHEALTHY_SETTING: &str = "unhealthy";

/// `check`: a node is healthy when it is deployed (its rendered file is
/// there) and its application does not ask to be unhealthy.
fn check(request: &Value) -> VerbResult {
    let work = work_dir().map_err(fail)?;
    let nodes = evaluate(request)
        .map_err(|e| fail(format!("evaluation refused the configuration: {e}")))?;
    let rendered = Rendering::of(request);
    let asked: Vec<&str> = request
        .get("nodes")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut answers = Vec::new();
    for name in asked {
        // A node name reaches a path: only a DNS label ever does.
        if !crate::derive::is_dns_label(name) {
            return Err(fail("a node name in the request is not a DNS label"));
        }
        let node = nodes.iter().find(|n| n.name == name);
        let deployed = work.join("nodes").join(format!("{name}.json")).is_file();
        let asks_to_fail = node
            .and_then(|n| rendered.settings(n))
            .and_then(|s| s.get(UNHEALTHY_SETTING))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let answer = match (node, deployed, asks_to_fail) {
            (None, _, _) => {
                json!({"name": name, "healthy": false, "reason": "the configuration has no such node"})
            }
            (Some(_), false, _) => {
                json!({"name": name, "healthy": false, "reason": "the node is not deployed"})
            }
            (Some(_), true, true) => {
                json!({"name": name, "healthy": false, "reason": format!("{name}.service failed (the configuration sets {UNHEALTHY_SETTING}: true)")})
            }
            (Some(_), true, false) => json!({"name": name, "healthy": true}),
        };
        println!(
            "checking node {name}: {}",
            if answer["healthy"] == true {
                "healthy"
            } else {
                "not healthy"
            }
        );
        answers.push(answer);
    }
    Ok(Some(json!({"nodes": answers})))
}

/// `confirm`: records the confirmed nodes (what a real deployer makes its
/// boot entry).
fn confirm(request: &Value) -> VerbResult {
    let work = work_dir().map_err(fail)?;
    let nodes = request.get("nodes").cloned().unwrap_or(json!([]));
    let deployment = request.get("deployment").cloned().unwrap_or(Value::Null);
    let record = json!({"deployment": deployment, "nodes": nodes, "build": request.get("build")});
    write_atomically(&work.join("confirmed.json"), record.to_string().as_bytes())
        .map_err(|e| fail(format!("cannot write the confirmed state: {e}")))?;
    println!("confirmed: this configuration is the one to keep");
    Ok(Some(json!({})))
}

fn max_nodes() -> usize {
    std::env::var("BERTH_LOCAL_MAX_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_MAX_NODES)
}

/// The eval rules: schema-level shape, then what a schema cannot say.
pub fn evaluate(request: &Value) -> Result<Vec<Node>, String> {
    let method = request
        .get("method")
        .and_then(Value::as_str)
        .unwrap_or("local");
    if method != "local" {
        return Err(format!(
            "this deployer has only the method \"local\", not {method:?}"
        ));
    }
    let config = request
        .get("configuration")
        .ok_or("the request has no configuration")?;
    let suspended = request
        .get("suspended")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let shaped =
        crate::derive::shape(config).map_err(|e| format!("{} at {:?}", e.message, e.pointer))?;
    for name in shaped.apps().keys() {
        if !crate::derive::is_dns_label(name) {
            return Err(format!("application name {name:?} is not a DNS label"));
        }
        if name == "base" {
            return Err("the application name \"base\" is reserved for the base node".into());
        }
    }
    let (domain, instances) =
        crate::derive::instances(config, &catalog::catalog()).map_err(|e| e.message.to_string())?;
    let enabled: Vec<_> = instances.iter().filter(|i| i.enabled).collect();
    if !enabled.is_empty() && domain.is_none() {
        return Err("an enabled application needs a domain".into());
    }
    let mut nodes = Vec::new();
    if !enabled.is_empty() {
        nodes.push(Node {
            name: "base".into(),
            names: vec![],
            application: None,
        });
    }
    for inst in enabled {
        let names = match (&inst.domain, suspended) {
            (Some(d), false) => vec![d.clone()],
            _ => vec![],
        };
        nodes.push(Node {
            name: inst.name.clone(),
            names,
            application: Some(inst.name.clone()),
        });
    }
    if nodes.len() > max_nodes() {
        return Err(format!(
            "{} nodes is more than this deployer stands up ({})",
            nodes.len(),
            max_nodes()
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for name in nodes.iter().flat_map(|n| n.names.iter()) {
        if !seen.insert(name) {
            return Err(format!("two nodes publish the name {name:?}"));
        }
    }
    Ok(nodes)
}

fn step_delay() -> Duration {
    let ms = std::env::var("BERTH_LOCAL_STEP_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_STEP_MS);
    Duration::from_millis(ms)
}

/// Logs a step, then waits the step delay; `Err` when SIGTERM arrived.
fn step(line: &str) -> Result<(), ()> {
    println!("{line}");
    let _ = std::io::stdout().flush();
    std::thread::sleep(step_delay());
    if TERMINATED.load(Ordering::SeqCst) {
        println!("received SIGTERM: stopping between steps; the state file is consistent");
        return Err(());
    }
    Ok(())
}

fn work_dir() -> Result<PathBuf, String> {
    std::env::var_os("BERTH_WORK_DIR")
        .map(PathBuf::from)
        .ok_or_else(|| "BERTH_WORK_DIR is not set".into())
}

fn fail(message: impl std::fmt::Display) -> (Option<Value>, i32) {
    eprintln!("error: {message}");
    (None, 1)
}

fn deploy(request: &Value) -> VerbResult {
    let deployment = request
        .get("deployment")
        .and_then(Value::as_str)
        .unwrap_or("unknown");
    let work = work_dir().map_err(fail)?;
    let scratch = std::env::var_os("BERTH_SCRATCH_DIR")
        .map(PathBuf::from)
        .ok_or_else(|| fail("BERTH_SCRATCH_DIR is not set"))?;
    let suspended = request
        .get("suspended")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let nodes = evaluate(request)
        .map_err(|e| fail(format!("evaluation refused the configuration: {e}")))?;
    let rendering = Rendering::of(request);
    let fail_node = std::env::var("BERTH_LOCAL_FAIL").ok();
    let nodes_dir = work.join("nodes");
    crate::durable::create_dir_all(&nodes_dir, 0o777)
        .map_err(|e| fail(format!("cannot create {}: {e}", nodes_dir.display())))?;

    let term = |_| (None, EXIT_TERMINATED);
    step(&format!(
        "planning deployment {deployment}: {} node(s){}",
        nodes.len(),
        if suspended { ", suspended" } else { "" }
    ))
    .map_err(term)?;
    let mut results = Vec::new();
    let mut activated: Vec<String> = Vec::new();
    for node in &nodes {
        let text = rendering.text(node);
        let print = fingerprint(&text);
        let path = nodes_dir.join(format!("{}.json", node.name));
        let changed = std::fs::read_to_string(&path)
            .map(|old| old != text)
            .unwrap_or(true);
        let drv = hex(&Sha256::digest(text.as_bytes()))[..32].to_string();
        step(&format!(
            "evaluating node {}: /nix/store/{drv}-nixos-system-{}",
            node.name, node.name
        ))
        .map_err(term)?;
        let artifact = write_artifact(&scratch, &node.name, &text)?;
        if !changed {
            step(&format!("node {} is up to date", node.name)).map_err(term)?;
            results.push(json!({"name": node.name, "changed": false, "fingerprint": print, "artifact": artifact}));
            activated.push(node.name.clone());
            continue;
        }
        print_builds(node);
        step(&format!("copying closure of node {} to local", node.name)).map_err(term)?;
        if fail_node.as_deref() == Some(node.name.as_str()) {
            write_state(&work, deployment, &activated, suspended).map_err(fail)?;
            return Err(fail(format!(
                "activation of node {} failed (BERTH_LOCAL_FAIL)",
                node.name
            )));
        }
        place(
            &work,
            node,
            &text,
            &path,
            (deployment, &mut activated, suspended),
        )?;
        let sbom = sbom_of(&scratch, node);
        results.push(json!({"name": node.name, "changed": true, "sbom": sbom, "fingerprint": print, "artifact": artifact}));
    }
    remove_dropped_nodes(&nodes_dir, &nodes).map_err(fail)?;
    write_state(&work, deployment, &activated, suspended).map_err(fail)?;
    println!("deployment {deployment} is active");
    Ok(Some(json!({"nodes": results})))
}

/// The build lines a node's packages would print under Nix.
fn print_builds(node: &Node) {
    for (pkg, version, _) in catalog::packages(node.application.as_deref().unwrap_or("base")) {
        println!(
            "building '/nix/store/{}-{pkg}-{version}.drv'...",
            &hex(&Sha256::digest(format!("{pkg}{version}").as_bytes()))[..32]
        );
    }
}

/// A node's SBOM written under the scratch dir, as the result names it.
fn sbom_of(scratch: &Path, node: &Node) -> Value {
    let sbom_rel = format!("sbom/{}.cdx.json", node.name);
    match write_sbom(&scratch.join(&sbom_rel), node) {
        Ok(()) => json!({"status": "ready", "path": sbom_rel}),
        Err(e) => {
            json!({"status": "unavailable", "reason": format!("sbom evaluation failed: {e}")})
        }
    }
}

/// Removes the nodes of an earlier deploy that this one no longer has.
fn remove_dropped_nodes(nodes_dir: &Path, nodes: &[Node]) -> Result<(), String> {
    let entries = std::fs::read_dir(nodes_dir)
        .map_err(|e| format!("cannot read {}: {e}", nodes_dir.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot read {}: {e}", nodes_dir.display()))?;
        let file_name = entry.file_name();
        let name = file_name.to_string_lossy();
        let name = name.trim_end_matches(".json");
        if !nodes.iter().any(|n| n.name == name) {
            println!("removing node {name}");
            std::fs::remove_file(entry.path())
                .map_err(|e| format!("cannot remove {}: {e}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// A changed node's render: pending for berth to activate it (with
/// `BERTH_LOCAL_ACTIVATE=1`), else activated here and now.
fn place(
    work: &Path,
    node: &Node,
    text: &str,
    path: &Path,
    (deployment, activated, suspended): (&str, &mut Vec<String>, bool),
) -> Result<(), (Option<Value>, i32)> {
    let term = |_| (None, EXIT_TERMINATED);
    if activate::enabled() {
        // berth activates it later, a wave at a time (`activate`).
        let pending = activate::pending_path(work, &node.name);
        crate::durable::create_dir_all(&work.join("pending"), 0o777)
            .and_then(|_| write_atomically(&pending, text.as_bytes()))
            .map_err(|e| fail(format!("cannot write {}: {e}", pending.display())))?;
        return step(&format!("node {} is built; berth activates it", node.name)).map_err(term);
    }
    write_atomically(path, text.as_bytes())
        .map_err(|e| fail(format!("cannot write {}: {e}", path.display())))?;
    activated.push(node.name.clone());
    write_state(work, deployment, activated, suspended).map_err(fail)?;
    step(&format!(
        "activating node {}: switching to configuration",
        node.name
    ))
    .map_err(term)
}

/// A node's artifact (deployer.md): a copy of its render at
/// `artifacts/<node>.json` in the scratch dir, so its digest is the node's
/// fingerprint. berth digests it and hands it to the node's agent.
fn write_artifact(scratch: &Path, node: &str, text: &str) -> Result<Value, (Option<Value>, i32)> {
    let rel = format!("artifacts/{node}.json");
    // The scratch dir is thrown away after the build: nothing to sync.
    std::fs::create_dir_all(scratch.join("artifacts"))
        .and_then(|_| std::fs::write(scratch.join(&rel), text.as_bytes()))
        .map_err(|e| fail(format!("cannot write the artifact {rel}: {e}")))?;
    Ok(json!({"kind": "file", "path": rel}))
}

fn destroy(request: &Value) -> VerbResult {
    let deployment = request
        .get("deployment")
        .and_then(Value::as_str)
        .unwrap_or("unknown");
    let work = work_dir().map_err(fail)?;
    let term = |_| (None, EXIT_TERMINATED);
    step(&format!("destroying deployment {deployment}")).map_err(term)?;
    let nodes_dir = work.join("nodes");
    let mut remaining: Vec<String> = std::fs::read_dir(&nodes_dir)
        .map(|d| {
            d.flatten()
                .map(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .trim_end_matches(".json")
                        .to_string()
                })
                .collect()
        })
        .unwrap_or_default();
    remaining.sort();
    while let Some(node) = remaining.pop() {
        step(&format!("stopping node {node}")).map_err(|_| {
            let _ = write_state(&work, deployment, &remaining_with(&remaining, &node), false);
            (None, EXIT_TERMINATED)
        })?;
        let _ = std::fs::remove_file(nodes_dir.join(format!("{node}.json")));
        write_state(&work, deployment, &remaining, false).map_err(fail)?;
    }
    let _ = std::fs::remove_dir(&nodes_dir);
    let _ = std::fs::remove_file(work.join("state.json"));
    println!("deployment {deployment} is destroyed");
    Ok(Some(json!({})))
}

fn remaining_with(list: &[String], node: &str) -> Vec<String> {
    let mut v = list.to_vec();
    v.push(node.to_string());
    v
}

fn write_state(
    work: &Path,
    deployment: &str,
    nodes: &[String],
    suspended: bool,
) -> Result<(), String> {
    let state = json!({"deployment": deployment, "nodes": nodes, "suspended": suspended});
    write_atomically(&work.join("state.json"), state.to_string().as_bytes())
        .map_err(|e| format!("cannot write the state file: {e}"))
}

/// Write to a temporary file, fsync, rename over the target, fsync the directory.
use crate::deployer_side::write_atomically;

fn hex(bytes: &[u8]) -> String {
    crate::hex::encode(bytes)
}

/// A CycloneDX 1.5 SBOM of the node's system: its application's packages
/// on top of the base system every node shares (so the nodes of one
/// deployment, and of every deployment, share most components), with
/// purls, hashes, licenses and a dependency graph (the node on everything,
/// the application on its runtime, everything on glibc).
fn write_sbom(path: &Path, node: &Node) -> std::io::Result<()> {
    let app_packages = catalog::packages(node.application.as_deref().unwrap_or("base"));
    let mut packages: Vec<(&str, &str, &str)> = app_packages.to_vec();
    for base in catalog::base_packages() {
        if !packages.iter().any(|(n, _, _)| *n == base.0) {
            packages.push(*base);
        }
    }
    let purl = |name: &str, version: &str| format!("pkg:nix/{name}@{version}");
    let node_ref = format!("node:{}", node.name);
    let components: Vec<Value> = packages
        .iter()
        .map(|(name, version, license)| {
            let purl = purl(name, version);
            json!({
                "type": "library",
                "bom-ref": purl,
                "name": name,
                "version": version,
                "purl": purl,
                "hashes": [{"alg": "SHA-256", "content": hex(&Sha256::digest(format!("{name}-{version}").as_bytes()))}],
                "licenses": [{"license": {"id": license}}],
            })
        })
        .collect();
    let glibc = catalog::base_packages()
        .iter()
        .find(|(n, _, _)| *n == "glibc")
        .map(|(n, v, _)| purl(n, v));
    let mut dependencies = vec![json!({
        "ref": node_ref,
        "dependsOn": packages.iter().map(|(n, v, _)| purl(n, v)).collect::<Vec<_>>(),
    })];
    for (i, (name, version, _)) in packages.iter().enumerate() {
        let this = purl(name, version);
        let mut on: Vec<String> = Vec::new();
        if i == 0 && node.application.is_some() {
            // The application runs on the rest of its own packages.
            on.extend(app_packages.iter().skip(1).map(|(n, v, _)| purl(n, v)));
        }
        if let Some(glibc) = &glibc {
            if *glibc != this && !on.contains(glibc) {
                on.push(glibc.clone());
            }
        }
        dependencies.push(json!({"ref": this, "dependsOn": on}));
    }
    let doc = json!({
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": format!("urn:uuid:{}", uuid::Uuid::now_v7()),
        "version": 1,
        "metadata": {
            "timestamp": crate::model::format_time(crate::model::now_millis()),
            "tools": {"components": [{"type": "application", "name": "berth-local-deployer", "version": env!("CARGO_PKG_VERSION")}]},
            "component": {"type": "operating-system", "name": node.name, "bom-ref": node_ref},
        },
        "components": components,
        "dependencies": dependencies,
    });
    write_atomically(
        path,
        serde_json::to_string_pretty(&doc)
            .unwrap_or_default()
            .as_bytes(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(config: Value, suspended: bool) -> Value {
        json!({"deployment": "alice", "method": "local", "configuration": config, "suspended": suspended})
    }

    #[test]
    fn nodes_and_names() {
        let c = json!({"domain": "a.org", "applications": {"mastodon": {"enable": true}, "homepage": {"enable": true}, "pixelfed": {}}});
        let nodes = evaluate(&req(c.clone(), false)).unwrap();
        let names: Vec<_> = nodes
            .iter()
            .map(|n| (n.name.as_str(), n.names.clone()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("base", vec![]),
                ("mastodon", vec!["mastodon.a.org".to_string()]),
                ("homepage", vec!["a.org".to_string()])
            ]
        );
        let suspended = evaluate(&req(c, true)).unwrap();
        assert!(suspended.iter().all(|n| n.names.is_empty()));
    }

    #[test]
    fn refusals() {
        for c in [
            json!({"applications": {"mastodon": {"enable": true}}}),
            json!({"domain": "a.org", "applications": {"base": {"enable": true}}}),
            json!({"domain": "a.org", "applications": {"Bad_Name": {}}}),
            json!({"domain": "a.org", "applications": {"s3": {"enable": true}, "garage": {"enable": true}}}),
        ] {
            assert!(evaluate(&req(c.clone(), false)).is_err(), "{c}");
        }
        assert!(evaluate(&json!({"method": "nix", "configuration": {}})).is_err());
        assert!(evaluate(&req(json!({}), false)).unwrap().is_empty());
    }
}
