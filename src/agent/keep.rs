//! What the agent keeps on its node (agents.md "Artifacts", `--keep`):
//! the file artifacts in `artifacts/` and the Nix GC roots in `gcroots/`
//! of what the node runs, boots, holds on probation and confirmed last.
//! Everything else goes after each confirm and at each start, so a node
//! that follows a deployment for years holds a bounded set, and a
//! garbage collection on the node never takes a toplevel it may go back
//! to.

use std::collections::BTreeSet;
use std::path::Path;

/// Records a confirmed artifact (a digest or a store path): newest last,
/// once, at most `keep`.
pub fn remember(confirmed: &mut Vec<String>, artifact: &str, keep: u32) {
    confirmed.retain(|a| a != artifact);
    confirmed.push(artifact.to_string());
    let excess = confirmed.len().saturating_sub(keep as usize);
    confirmed.drain(..excess);
    debug_assert!(confirmed.len() <= keep as usize);
}

/// The file name of a digest in `artifacts/`.
pub fn file_name(digest: &str) -> &str {
    digest.trim_start_matches("sha256:")
}

/// Removes every file of `artifacts/` whose digest is not `needed`; the
/// count removed.
pub fn prune_files(state_dir: &Path, needed: &BTreeSet<String>) -> Result<usize, String> {
    let dir = state_dir.join("artifacts");
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(format!("cannot list {}: {e}", dir.display())),
    };
    let keep: BTreeSet<&str> = needed.iter().map(|d| file_name(d)).collect();
    let mut removed = 0;
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
        let name = entry.file_name();
        if keep.contains(name.to_string_lossy().as_ref()) {
            continue;
        }
        std::fs::remove_file(entry.path())
            .map_err(|e| format!("cannot remove {}: {e}", entry.path().display()))?;
        removed += 1;
    }
    Ok(removed)
}

/// The GC root name of a store path: its base name, unique in the store.
fn root_name(store_path: &str) -> Option<&str> {
    store_path
        .strip_prefix("/nix/store/")
        .filter(|name| !name.is_empty() && !name.contains('/') && !name.starts_with('.'))
}

/// Makes `gcroots/` hold exactly a root of each of `paths`: a missing one
/// is added with `nix-store --add-root` (an indirect root Nix finds
/// through its own registry), one of any other path is removed (Nix
/// forgets a root whose link is gone).
pub async fn set_roots(state_dir: &Path, paths: &BTreeSet<String>) -> Result<(), String> {
    let dir = state_dir.join("gcroots");
    crate::durable::create_dir_all(&dir, 0o700)
        .map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
    let wanted: BTreeSet<&str> = paths.iter().filter_map(|p| root_name(p)).collect();
    let listed =
        std::fs::read_dir(&dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut present = BTreeSet::new();
    for entry in listed {
        let entry = entry.map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if wanted.contains(name.as_str()) {
            present.insert(name);
        } else {
            std::fs::remove_file(entry.path())
                .map_err(|e| format!("cannot remove {}: {e}", entry.path().display()))?;
        }
    }
    for name in wanted.iter().filter(|n| !present.contains(**n)) {
        let mut add = tokio::process::Command::new("nix-store");
        add.arg("--add-root")
            .arg(dir.join(name))
            .arg("--realise")
            .arg(format!("/nix/store/{name}"))
            .stdout(std::process::Stdio::null());
        super::run_command(add, "nix-store --add-root").await?;
    }
    Ok(())
}

impl super::Agent {
    /// Keeps what the node may go back to and removes the rest (after a
    /// confirm, and at a start). A failure is logged and reported as the
    /// node's last error: the node runs on, only its disk holds more.
    pub(super) async fn tidy(&mut self) {
        if let Err(why) = self.tidy_files().await {
            tracing::warn!(%why, "cannot remove the artifacts no longer kept");
            self.last_error = Some(("tidy_failed".into(), why));
        }
        let roots = self.roots();
        if roots.is_empty() && !self.args.state_dir.join("gcroots").exists() {
            return;
        }
        if let Err(why) = set_roots(&self.args.state_dir, &roots).await {
            tracing::warn!(%why, "cannot set the node's GC roots");
            self.last_error = Some(("tidy_failed".into(), why));
        }
    }

    /// The file artifacts kept: what `current` and `booted` hold (digested
    /// as a report digests them, off the agent's loop), the held
    /// activation's, and the last `--keep` confirmed.
    async fn tidy_files(&self) -> Result<usize, String> {
        let dir = self.args.state_dir.clone();
        let mut needed: BTreeSet<String> = self.kept(|a| a.starts_with("sha256:")).collect();
        if let Some(held) = &self.state.attempt {
            needed.extend(held.before.clone());
            needed.insert(held.artifact.clone());
        }
        tokio::task::spawn_blocking(move || {
            for file in ["current", "booted"] {
                let artifact = super::file_artifact(&dir.join(file));
                needed.extend(artifact["digest"].as_str().map(str::to_string));
            }
            prune_files(&dir, &needed)
        })
        .await
        .map_err(|e| format!("tidying the artifacts failed: {e}"))?
    }

    /// The toplevels rooted: once the node confirmed one, what it runs and
    /// boots, the held activation's, and the last `--keep` confirmed.
    fn roots(&self) -> BTreeSet<String> {
        let mut roots: BTreeSet<String> = self.kept(|a| a.starts_with("/nix/store/")).collect();
        if roots.is_empty() {
            return roots;
        }
        for link in [&self.args.current_system, &self.args.system_profile] {
            if let Ok(path) = std::fs::canonicalize(link) {
                roots.insert(path.to_string_lossy().into_owned());
            }
        }
        if let Some(held) = self
            .state
            .attempt
            .as_ref()
            .filter(|h| h.kind == "nix-store-path")
        {
            roots.extend(held.before.clone());
            roots.insert(held.artifact.clone());
        }
        roots
    }

    fn kept<'a>(&'a self, kind: impl Fn(&str) -> bool + 'a) -> impl Iterator<Item = String> + 'a {
        self.state
            .confirmed
            .iter()
            .filter(move |a| kind(a))
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remember_keeps_the_newest_once_and_at_most_keep() {
        let mut confirmed = Vec::new();
        for a in ["a", "b", "c", "b", "d"] {
            remember(&mut confirmed, a, 3);
        }
        assert_eq!(confirmed, ["c", "b", "d"]);
        remember(&mut confirmed, "e", 0);
        assert!(confirmed.is_empty());
    }

    #[test]
    fn prune_files_removes_only_what_is_not_needed() {
        let dir = std::env::temp_dir().join(format!("berth-keep-{}", std::process::id()));
        let artifacts = dir.join("artifacts");
        std::fs::create_dir_all(&artifacts).unwrap();
        for name in ["aa", "bb", "cc"] {
            std::fs::write(artifacts.join(name), name).unwrap();
        }
        let needed: BTreeSet<String> = ["sha256:aa".to_string(), "sha256:cc".to_string()].into();
        assert_eq!(prune_files(&dir, &needed), Ok(1));
        let mut left: Vec<String> = std::fs::read_dir(&artifacts)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["aa", "cc"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_root_is_named_by_a_store_path_only() {
        assert_eq!(root_name("/nix/store/abc-system"), Some("abc-system"));
        assert_eq!(root_name("/nix/store/abc/bin"), None);
        assert_eq!(root_name("/etc/passwd"), None);
        assert_eq!(root_name("/nix/store/"), None);
    }
}
