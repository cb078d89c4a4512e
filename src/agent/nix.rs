//! The agent's Nix side (agents.md "Artifacts"): a toplevel fetched from
//! the operator's binary caches, Nix checking its signatures against the
//! node's `trusted-public-keys` (never `--no-check-sigs`), and the system
//! profile set at a confirm.

use std::path::Path;

use tokio::process::Command;

/// `nix` with the command set of Nix 2.x stable.
fn nix() -> Command {
    let mut c = Command::new("nix");
    c.args(["--extra-experimental-features", "nix-command"]);
    c.stdin(std::process::Stdio::null()).kill_on_drop(true);
    c
}

/// Whether `path` is valid in the node's store already.
async fn valid(path: &str) -> bool {
    let mut c = nix();
    c.args(["path-info", path]);
    c.output().await.is_ok_and(|o| o.status.success())
}

/// Fetches `path` from each substituter in turn (the document's `url`
/// first when it is one of them); a valid path is not fetched again.
/// `Err` is the outcome's reason.
pub async fn fetch(substituters: &[String], url: &str, path: &str) -> Result<(), &'static str> {
    if valid(path).await {
        return Ok(());
    }
    let mut order: Vec<&String> = substituters.iter().filter(|s| s.as_str() == url).collect();
    order.extend(substituters.iter().filter(|s| s.as_str() != url));
    for from in order {
        let mut c = nix();
        c.args(["copy", "--from", from, path]);
        match c.output().await {
            Ok(out) if out.status.success() => return Ok(()),
            Ok(out) => {
                tracing::warn!(from, stderr = %String::from_utf8_lossy(&out.stderr), "nix copy failed")
            }
            Err(e) => tracing::warn!(from, error = %e, "cannot run nix copy"),
        }
    }
    Err("fetch_failed")
}

/// `nix-env -p <profile> --set <toplevel>`: what the node boots next.
pub async fn set_profile(profile: &Path, toplevel: &str) -> Result<(), String> {
    let mut command = Command::new("nix-env");
    command.arg("-p").arg(profile).args(["--set", toplevel]);
    super::run_command(command, "nix-env --set").await
}
