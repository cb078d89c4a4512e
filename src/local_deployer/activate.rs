//! The local deployer's rollouts (rollouts.md "The deployers"), with
//! `BERTH_LOCAL_ACTIVATE=1`: `deploy` renders each node into
//! `pending/<node>.json` and activates nothing; `activate` `new` keeps a
//! node's render as `previous/<node>.json` and moves the pending one into
//! `nodes/`; `previous` moves it back, or removes a node that had none.
//! `BERTH_LOCAL_FAIL` names a node whose activation answers `false`.

use std::path::Path;

use serde_json::{json, Value};

use super::{fail, work_dir, VerbResult};
use crate::deployer_side::write_atomically;

/// Whether `BERTH_LOCAL_ACTIVATE=1` is set.
pub fn enabled() -> bool {
    std::env::var("BERTH_LOCAL_ACTIVATE").is_ok_and(|v| v == "1")
}

/// Where a node's render waits for its activation.
pub fn pending_path(work: &Path, node: &str) -> std::path::PathBuf {
    work.join("pending").join(format!("{node}.json"))
}

/// `activate`: each requested node to `target` (`new` or `previous`), one
/// answer per node; a node already there is left alone.
pub fn activate(request: &Value) -> VerbResult {
    let work = work_dir().map_err(fail)?;
    let target = request.get("target").and_then(Value::as_str).unwrap_or("");
    let asked: Vec<&str> = request
        .get("nodes")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let fail_node = std::env::var("BERTH_LOCAL_FAIL").ok();
    for dir in ["nodes", "pending", "previous"] {
        crate::durable::create_dir_all(&work.join(dir), 0o777)
            .map_err(|e| fail(format!("cannot create {dir}/: {e}")))?;
    }
    let mut answers = Vec::new();
    for name in asked {
        // A node name reaches a path: only a DNS label ever does.
        if !crate::derive::is_dns_label(name) {
            return Err(fail("a node name in the request is not a DNS label"));
        }
        let answer = match (target, fail_node.as_deref() == Some(name)) {
            ("new", true) => Err("activation failed (BERTH_LOCAL_FAIL)".to_string()),
            ("new", false) => to_new(&work, name),
            ("previous", _) => to_previous(&work, name),
            _ => return Err(fail("target must be new or previous")),
        };
        println!(
            "{} node {name}: {}",
            if target == "new" {
                "activating"
            } else {
                "putting back"
            },
            match &answer {
                Ok(()) => "done".to_string(),
                Err(why) => why.clone(),
            }
        );
        answers.push(match answer {
            Ok(()) => json!({"name": name, "activated": true}),
            Err(why) => json!({"name": name, "activated": false, "reason": why}),
        });
    }
    Ok(Some(json!({"nodes": answers})))
}

/// The pending render becomes the node's; what it ran is kept.
fn to_new(work: &Path, name: &str) -> Result<(), String> {
    let pending = pending_path(work, name);
    let current = work.join("nodes").join(format!("{name}.json"));
    let kept = work.join("previous").join(format!("{name}.json"));
    let Ok(new) = std::fs::read(&pending) else {
        // Already activated (the call again after a restart), or never
        // rendered: the node runs what it runs.
        return if current.is_file() {
            Ok(())
        } else {
            Err("nothing is pending for this node".into())
        };
    };
    match std::fs::read(&current) {
        Ok(old) if old == new => {}
        Ok(old) => write_atomically(&kept, &old).map_err(|e| e.to_string())?,
        Err(_) => remove(&kept)?,
    }
    std::fs::rename(&pending, &current).map_err(|e| e.to_string())
}

/// What the node ran before comes back; a node that ran nothing goes.
fn to_previous(work: &Path, name: &str) -> Result<(), String> {
    let current = work.join("nodes").join(format!("{name}.json"));
    let kept = work.join("previous").join(format!("{name}.json"));
    if kept.is_file() {
        std::fs::rename(&kept, &current).map_err(|e| e.to_string())
    } else {
        remove(&current)
    }
}

fn remove(path: &Path) -> Result<(), String> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e.to_string()),
    }
}
