//! The agent's side of an activation (agents.md "Activation" and "The
//! armed revert"): claim, fetch and verify, test-activate under an armed
//! revert, renew, answer health, confirm when berth says so, and go back
//! by itself when berth ends the activation, stays silent past the revert
//! window, or the agent stops.
//!
//! A file artifact: the node's `current` is replaced atomically with the
//! artifact (the bytes it replaced kept first, so a revert puts them
//! back), `booted` is written at the confirm. A toplevel: its
//! `switch-to-configuration test`, the earlier one's for a revert, the
//! system profile and `boot` at the confirm. The state file records the
//! activation (synced) before the node is touched, so an agent that
//! starts and finds one unconfirmed reverts it: its authority died with
//! its incarnation.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::time::Instant;

use super::{Agent, ReportFailure, CALL_TIMEOUT};

/// Tries of a fetch before the activation fails.
const FETCH_TRIES: u32 = 3;
/// The longest artifact the agent fetches.
const MAX_ARTIFACT_BYTES: usize = 4 << 30;

/// The activation the agent holds, as `state.json` keeps it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Held {
    pub attempt_id: String,
    pub fence: u64,
    pub worker_incarnation: String,
    /// The artifact's digest, or its store path.
    pub artifact: String,
    /// `file` or `nix-store-path`.
    #[serde(default = "file_kind")]
    pub kind: String,
    /// The digest of what `current` held before (its bytes kept in
    /// `artifacts/`); `None`: there was no `current`.
    pub before: Option<String>,
    /// `test` (activated, on probation) or `confirming`.
    pub phase: String,
}

fn file_kind() -> String {
    "file".into()
}

/// What the main loop keeps of a held activation besides the state file.
pub struct Live {
    pub lease_ttl: Duration,
    pub revert_after: Duration,
    pub health_every: Duration,
    /// When the last renew that berth accepted was sent (or the test
    /// activation, before any): the revert window runs from here.
    pub last_accepted: Instant,
    pub next_renew: Instant,
    pub next_health: Instant,
    pub last_health: Option<bool>,
    pub seq: u64,
    /// Progress items berth has not taken yet, oldest first.
    pub unsent: Vec<Value>,
}

impl Live {
    pub fn revert_at(&self) -> Instant {
        self.last_accepted + self.revert_after
    }
}

fn ms(v: &Value, key: &str, default_ms: u64) -> Duration {
    Duration::from_millis(v[key].as_u64().unwrap_or(default_ms))
}

fn artifact_path(dir: &Path, digest: &str) -> std::path::PathBuf {
    dir.join("artifacts")
        .join(digest.trim_start_matches("sha256:"))
}

impl Agent {
    fn attempt_path(&self, held: &Held, call: &str) -> String {
        format!("{}/attempts/{}/{call}", self.node_path(), held.attempt_id)
    }

    fn authority(&self, fence: u64) -> Value {
        json!({
            "operation_id": crate::worker::new_operation_id(),
            "fence": fence,
            "worker_incarnation": self.incarnation,
        })
    }

    /// An `activate` document: claim it, fetch, test-activate. `Err` only
    /// when the token was refused.
    pub(super) async fn activate(&mut self, doc: &Value) -> Result<(), ReportFailure> {
        let fence = doc["fence"].as_u64().unwrap_or(0);
        if fence <= self.state.highest_claimed {
            self.last_error = Some((
                "fence_regressed".into(),
                format!(
                    "an activation with fence {fence}, not above the {} this agent claimed",
                    self.state.highest_claimed
                ),
            ));
            return Ok(());
        }
        let kind = doc["artifact"]["kind"].as_str().unwrap_or("").to_string();
        let id = match kind.as_str() {
            "file" => doc["artifact"]["digest"].as_str(),
            "nix-store-path" => doc["artifact"]["path"].as_str(),
            _ => None,
        };
        let Some(digest) = id.map(str::to_string) else {
            tracing::warn!(%kind, "an activation of an artifact this agent does not know");
            return Ok(());
        };
        let Some(attempt_id) = self.claim(fence).await? else {
            return Ok(());
        };
        self.state.highest_claimed = fence;
        self.save().map_err(|_| ReportFailure::Again(None))?;
        let held = Held {
            attempt_id,
            fence,
            worker_incarnation: self.incarnation.clone(),
            artifact: digest.clone(),
            kind: kind.clone(),
            before: None,
            phase: "claimed".into(),
        };
        let url = doc["artifact"]["url"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let fetched = match kind.as_str() {
            "nix-store-path" => super::nix::fetch(&self.args.substituters, &url, &digest)
                .await
                .map(|()| vec![]),
            _ => self.fetch(&url, &digest).await,
        };
        let bytes = match fetched {
            Ok(bytes) => bytes,
            Err(reason) => {
                self.outcome(
                    &held,
                    Some((reason, "the artifact could not be fetched and verified")),
                )
                .await;
                return Ok(());
            }
        };
        self.probation(doc, held, &bytes).await;
        Ok(())
    }

    /// The fetched artifact switched to under an armed revert: `fetched`,
    /// the test activation, `activated` (or `failed` with the node back).
    async fn probation(&mut self, doc: &Value, held: Held, bytes: &[u8]) {
        let mut live = Live {
            lease_ttl: ms(doc, "lease_ttl_ms", 30_000),
            revert_after: ms(doc, "revert_after_ms", 300_000),
            health_every: ms(doc, "health_interval_ms", 5_000),
            last_accepted: Instant::now(),
            next_renew: Instant::now(),
            next_health: Instant::now(),
            last_health: None,
            seq: 0,
            unsent: Vec::new(),
        };
        self.step(&held, &mut live, json!({"step": "fetched"}))
            .await;
        match self.test_activate(held, bytes).await {
            Ok(held) => {
                live.last_accepted = Instant::now();
                live.next_renew = Instant::now() + live.lease_ttl / 3;
                self.step(&held, &mut live, json!({"step": "activated"}))
                    .await;
                self.held = Some((held, live));
            }
            Err((held, why)) => {
                tracing::warn!(%why, "the test activation failed; the node is back");
                self.outcome(
                    &held,
                    Some(("activation_failed", "the test activation failed")),
                )
                .await;
            }
        }
    }

    /// Claims the activation under `fence`: its id, or `None` when berth
    /// refused it (another incarnation claimed it) or cannot be reached.
    async fn claim(&self, fence: u64) -> Result<Option<String>, ReportFailure> {
        let claim = self.authority(fence);
        let path = format!("{}/claim", self.node_path());
        match self
            .api
            .call(reqwest::Method::POST, &path, Some(&claim), CALL_TIMEOUT)
            .await
        {
            Ok((200, answer)) => Ok(answer["authority"].as_str().map(str::to_string)),
            Ok((401 | 403, _)) => Err(ReportFailure::Refused),
            Ok((status, answer)) => {
                tracing::warn!(status, %answer, "berth refused a claim");
                Ok(None)
            }
            Err(why) => {
                tracing::warn!(%why, "cannot reach berth to claim an activation");
                Ok(None)
            }
        }
    }

    /// Fetches the artifact (3 tries), checks its digest, keeps it.
    async fn fetch(&self, url: &str, digest: &str) -> Result<Vec<u8>, &'static str> {
        use sha2::{Digest, Sha256};
        let mut reason = "fetch_failed";
        for _ in 0..FETCH_TRIES {
            let got = self.api.get_bytes(url, MAX_ARTIFACT_BYTES).await;
            match got {
                Ok(bytes) => {
                    let seen = format!("sha256:{}", crate::hex::encode(&Sha256::digest(&bytes)));
                    if seen == digest {
                        let path = artifact_path(&self.args.state_dir, digest);
                        crate::durable::replace(&path, &bytes, 0o600)
                            .map_err(|_| "fetch_failed")?;
                        return Ok(bytes);
                    }
                    reason = "digest_mismatch";
                }
                Err(why) => {
                    tracing::warn!(%why, "cannot fetch an artifact");
                    reason = "fetch_failed";
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Err(reason)
    }

    /// Records the activation (synced), keeps what `current` holds, and
    /// switches: `current` replaced atomically, then the activate command.
    async fn test_activate(
        &mut self,
        mut held: Held,
        bytes: &[u8],
    ) -> Result<Held, (Held, String)> {
        if held.kind == "nix-store-path" {
            return self.test_toplevel(held).await;
        }
        let dir = self.args.state_dir.clone();
        let current = dir.join("current");
        held.before = match std::fs::read(&current) {
            Ok(old) => {
                let digest = super::digest_of(&old);
                if let Err(e) = crate::durable::replace(&artifact_path(&dir, &digest), &old, 0o600)
                {
                    return Err((held, format!("cannot keep what the node ran: {e}")));
                }
                Some(digest)
            }
            Err(_) => None,
        };
        held.phase = "test".into();
        self.state.attempt = Some(held.clone());
        if let Err(why) = self.save() {
            self.state.attempt = None;
            return Err((held, why));
        }
        if let Err(e) = crate::durable::replace(&current, bytes, 0o644) {
            self.revert().await;
            return Err((held, format!("cannot switch: {e}")));
        }
        if let Err(why) = self.run_activate_command("test").await {
            self.revert().await;
            return Err((held, why));
        }
        Ok(held)
    }

    /// `--activate-command` with the phase; `Err` with its last line.
    async fn run_activate_command(&self, phase: &str) -> Result<(), String> {
        let Some(cmd) = &self.args.activate_command else {
            return Ok(());
        };
        let mut command = tokio::process::Command::new("/bin/sh");
        command
            .arg("-c")
            .arg(cmd)
            .env("BERTH_ARTIFACT", self.args.state_dir.join("current"))
            .env("BERTH_PHASE", phase);
        super::run_command(command, "the activate command").await
    }

    /// Puts back what the node ran before the held activation (`current`,
    /// or none) and forgets the activation.
    pub(super) async fn revert(&mut self) {
        let Some(held) = self.state.attempt.clone() else {
            return;
        };
        if held.kind == "nix-store-path" {
            if let Some(before) = &held.before {
                if let Err(why) = self.switch(before, "revert").await {
                    tracing::error!(%why, "cannot switch back; the node keeps the new toplevel");
                    self.last_error = Some(("revert_failed".into(), why));
                }
            }
            return self.forget_activation(&held);
        }
        let dir = self.args.state_dir.clone();
        let current = dir.join("current");
        let restored = match &held.before {
            Some(digest) => std::fs::read(artifact_path(&dir, digest))
                .and_then(|old| crate::durable::replace(&current, &old, 0o644)),
            None => match std::fs::remove_file(&current) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                Ok(()) | Err(_) => Ok(()),
            },
        };
        if let Err(e) = restored {
            tracing::error!(error = %e, "cannot put back what the node ran; it keeps the new artifact");
            self.last_error = Some(("revert_failed".into(), e.to_string()));
        }
        if let Err(why) = self.run_activate_command("revert").await {
            tracing::warn!(%why, "the activate command failed on a revert");
        }
        self.forget_activation(&held);
    }

    fn forget_activation(&mut self, held: &Held) {
        tracing::info!(fence = held.fence, "reverted the unconfirmed activation");
        self.state.attempt = None;
        self.held = None;
        if let Err(why) = self.save() {
            tracing::error!(%why, "cannot record the revert");
        }
    }

    /// A toplevel's test activation: the running one kept as `before`
    /// (synced in the state file first), then the switch.
    async fn test_toplevel(&mut self, mut held: Held) -> Result<Held, (Held, String)> {
        held.before = std::fs::canonicalize(&self.args.current_system)
            .ok()
            .map(|p| p.to_string_lossy().into_owned());
        held.phase = "test".into();
        self.state.attempt = Some(held.clone());
        if let Err(why) = self.save() {
            self.state.attempt = None;
            return Err((held, why));
        }
        let path = held.artifact.clone();
        if let Err(why) = self.switch(&path, "test").await {
            self.revert().await;
            return Err((held, why));
        }
        Ok(held)
    }

    /// Switches the node to `toplevel` for `phase` (`test`, `boot`,
    /// `revert`): `--activate-command` when given, else the toplevel's
    /// `switch-to-configuration` (`test` for a revert).
    async fn switch(&self, toplevel: &str, phase: &str) -> Result<(), String> {
        let mut command = match &self.args.activate_command {
            Some(cmd) => {
                let mut c = tokio::process::Command::new("/bin/sh");
                c.arg("-c").arg(cmd).env("BERTH_PHASE", phase);
                c
            }
            None => {
                let mut c =
                    tokio::process::Command::new(format!("{toplevel}/bin/switch-to-configuration"));
                c.arg(if phase == "boot" { "boot" } else { "test" });
                c
            }
        };
        command.env("BERTH_ARTIFACT", toplevel);
        super::run_command(command, "the switch").await
    }

    /// A `confirm` document for the held activation: `booted` written,
    /// the activate command's `boot`, then `confirmed`.
    pub(super) async fn confirm(&mut self) {
        let Some((held, _)) = self.held.as_ref() else {
            return;
        };
        let held = held.clone();
        let made = match held.kind.as_str() {
            "nix-store-path" => {
                match super::nix::set_profile(&self.args.system_profile, &held.artifact).await {
                    Ok(()) => self.switch(&held.artifact, "boot").await,
                    Err(why) => Err(why),
                }
            }
            _ => self.confirm_file().await,
        };
        if let Err(why) = made {
            tracing::warn!(%why, "the confirm failed");
            self.outcome(
                &held,
                Some(("confirm_failed", "the boot entry could not be written")),
            )
            .await;
            self.revert().await;
            return;
        }
        self.outcome(&held, None).await;
        self.state.attempt = None;
        self.held = None;
        super::keep::remember(&mut self.state.confirmed, &held.artifact, self.args.keep);
        if let Err(why) = self.save() {
            tracing::error!(%why, "cannot record the confirm");
        }
        self.tidy().await;
        self.unit_changed = held.kind == "nix-store-path" && self.own_unit_changed(&held);
    }

    /// Whether the confirmed toplevel defines the agent's own unit
    /// (`--unit`) otherwise than the one it replaced.
    fn own_unit_changed(&self, held: &Held) -> bool {
        let Some(unit) = &self.args.unit else {
            return false;
        };
        let definition = |toplevel: &str| {
            std::fs::canonicalize(Path::new(toplevel).join("etc/systemd/system").join(unit)).ok()
        };
        let before = held.before.as_deref().and_then(definition);
        before != definition(&held.artifact)
    }

    /// A file's confirm: `booted` written, then the activate command's
    /// `boot`.
    async fn confirm_file(&self) -> Result<(), String> {
        let dir = self.args.state_dir.clone();
        std::fs::read(dir.join("current"))
            .and_then(|bytes| crate::durable::replace(&dir.join("booted"), &bytes, 0o644))
            .map_err(|e| e.to_string())?;
        self.run_activate_command("boot").await
    }

    /// Posts the outcome (`None`: confirmed), resent while berth does not
    /// answer, for at most a lease.
    pub(super) async fn outcome(&self, held: &Held, failed: Option<(&str, &str)>) {
        let mut body = self.authority(held.fence);
        match failed {
            None => body["result"] = json!("confirmed"),
            Some((reason, detail)) => {
                body["result"] = json!("failed");
                body["reason"] = json!(reason);
                body["detail"] = json!(detail);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let path = self.attempt_path(held, "outcome");
        match self
            .api
            .resend(reqwest::Method::POST, &path, &body, deadline)
            .await
        {
            Ok((200, _)) => {}
            Ok((status, answer)) => tracing::warn!(status, %answer, "berth refused an outcome"),
            Err(why) => tracing::warn!(%why, "cannot reach berth with an outcome"),
        }
    }

    /// One progress item, sent with every earlier one berth has not
    /// taken (a call that got no answer is sent again, in order: seqs stay
    /// consecutive). A health answer while another waits replaces it.
    /// `false` when berth ended the activation.
    pub(super) async fn step(&mut self, held: &Held, live: &mut Live, item: Value) -> bool {
        let waiting_health = live
            .unsent
            .last()
            .is_some_and(|i| i.get("health").is_some());
        match (item.get("health"), waiting_health) {
            (Some(health), true) => {
                if let Some(last) = live.unsent.last_mut() {
                    last["health"] = health.clone();
                }
            }
            (Some(_), false) | (None, _) => {
                live.seq += 1;
                let mut item = item;
                item["seq"] = json!(live.seq);
                live.unsent.push(item);
            }
        }
        self.flush(held, live).await
    }

    /// Sends the items berth has not taken; `false` when berth ended the
    /// activation.
    pub(super) async fn flush(&self, held: &Held, live: &mut Live) -> bool {
        if live.unsent.is_empty() {
            return true;
        }
        let mut body = self.authority(held.fence);
        body["items"] = json!(live.unsent);
        let path = self.attempt_path(held, "progress");
        let answer = self
            .api
            .call(reqwest::Method::POST, &path, Some(&body), CALL_TIMEOUT)
            .await;
        match answer {
            Ok((200, _)) => {
                live.unsent.clear();
                true
            }
            Ok((409, answer)) if answer["reason"] == json!("progress_gap") => {
                let applied = answer["applied_through"].as_u64().unwrap_or(0);
                live.unsent
                    .retain(|i| i["seq"].as_u64().is_some_and(|seq| seq > applied));
                true
            }
            Ok((409, _)) => false,
            Ok((status, answer)) => {
                tracing::warn!(status, %answer, "berth refused progress items");
                // Refused for good (their order, their shape): sending them
                // again would be refused again.
                if status < 500 {
                    live.unsent.clear();
                }
                true
            }
            Err(why) => {
                tracing::warn!(%why, "cannot reach berth with progress items; they go again");
                true
            }
        }
    }

    /// The renew of the held activation: `false` when berth ended it.
    pub(super) async fn renew(&mut self) -> bool {
        let Some((held, _)) = self.held.as_ref() else {
            return true;
        };
        let held = held.clone();
        let sent = Instant::now();
        let body = self.authority(held.fence);
        let path = self.attempt_path(&held, "renew");
        let answer = self
            .api
            .call(reqwest::Method::POST, &path, Some(&body), CALL_TIMEOUT)
            .await;
        let Some((_, live)) = self.held.as_mut() else {
            return true;
        };
        live.next_renew = Instant::now() + live.lease_ttl / 3;
        let accepted = match answer {
            Ok((200, _)) => {
                live.last_accepted = sent;
                true
            }
            Ok((409, _)) => return false,
            Ok((status, answer)) => {
                tracing::warn!(status, %answer, "berth refused a renew");
                return true;
            }
            Err(why) => {
                tracing::warn!(%why, "cannot reach berth to renew");
                return true;
            }
        };
        // Berth answers again: what it did not take goes now.
        let Some((held, mut live)) = self.held.take() else {
            return accepted;
        };
        let going = self.flush(&held, &mut live).await;
        self.held = Some((held, live));
        going
    }

    /// A health answer of the held activation when due: at once, then
    /// every interval while unhealthy, then on each change.
    pub(super) async fn health_step(&mut self) -> bool {
        let health = self.health().await;
        let Some((held, mut live)) = self.held.take() else {
            return true;
        };
        let healthy = health["healthy"].as_bool().unwrap_or(false);
        live.next_health = Instant::now() + live.health_every;
        // Items berth has not taken yet go with this answer too.
        let changed = live.last_health != Some(healthy) || !live.unsent.is_empty();
        let mut going = true;
        if changed || !healthy {
            going = self.step(&held, &mut live, json!({"health": health})).await;
            live.last_health = Some(healthy);
        }
        self.held = Some((held, live));
        going
    }
}
