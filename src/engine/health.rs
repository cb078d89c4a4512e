//! The health step of a deploy (lifecycle.md "Health checks and automatic
//! rollback"): after a deploy exits 0 with a valid result, and when its
//! deployer lists `check` and `confirm` in `describe`, berth calls `check`
//! at once and every `--health-interval` until every node the deploy
//! changed is healthy or `--health-timeout` has passed, then `confirm`.
//!
//! Why it exists apart from `build`: a deploy that exited 0 has only
//! applied a configuration; this is where berth learns whether the nodes
//! came up, and the verdict (`HealthEnd`) decides whether the build
//! succeeds, fails with `health_check_failed` (and may be rolled back by
//! `transition`), or ends cancelled (a cancel confirms nothing).
//!
//! Each node's answer is a `health` event on the build channel and a log
//! line. A health event takes a seq amid the log's lines (`log_gaps`), so
//! the lines before it are committed first and the event commits alone,
//! published after its commit like every event.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::watch;

use super::log_pipe::LogPipe;
use super::outcome::Halt;
use super::runner::{Ended, Lines};
use super::Engine;
use crate::events;
use crate::model::*;
use crate::store::{Lookup, StoreError};

/// A deployer's reason for an unhealthy node is cut to this many characters
/// (lifecycle.md: 500).
pub const MAX_HEALTH_REASON_CHARS: usize = 500;
/// Lines of a check's or confirm's output copied into the build log, per call.
const MAX_CALL_LINES_IN_LOG: usize = 50;

/// How long `confirm` may take. Not `--health-interval`, which bounds a
/// `check`: a confirm makes the new state permanent, and on NixOS that is
/// `switch-to-configuration boot`, which installs the boot loader's
/// entries and can take far longer than a check (a 3 s interval failed a
/// healthy deploy whose confirm over ssh ran on a loaded machine, and
/// rolled it back). Still a bound: a confirm that hangs must not keep the
/// build running for ever.
pub const CONFIRM_TIME_LIMIT: Duration = Duration::from_secs(300);

/// How the health step ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthEnd {
    /// Every changed node healthy, and `confirm` answered.
    Confirmed,
    /// A node still unhealthy at the timeout, or `check`/`confirm` failed:
    /// the detail names the first unhealthy node and its reason.
    Failed(String),
    /// Cancelled (or berth stopping) during the step: nothing confirmed.
    Halted(Halt),
    /// A rollout that aborted otherwise than by a gate (rollouts.md
    /// "Abort"): by an action (`rollout_aborted`) or a failed `activate`
    /// call (its call's reason).
    Aborted(FailureReason, String),
}

#[derive(Deserialize)]
struct CheckResult {
    nodes: Vec<NodeHealth>,
}

#[derive(Deserialize)]
struct NodeHealth {
    name: String,
    healthy: bool,
    #[serde(default)]
    reason: Option<String>,
}

/// One node's answer, as the event and the log line show it.
pub struct HealthAnswer {
    pub node: String,
    pub healthy: bool,
    pub reason: Option<String>,
}

fn cut(text: &str) -> String {
    text.chars().take(MAX_HEALTH_REASON_CHARS).collect()
}

/// How one `check` or `confirm` call ended: its end, its result file, its
/// first output lines; `Err` when it could not be started.
pub type CallEnd = Result<(Ended, Result<Option<Vec<u8>>, String>, Vec<String>), String>;

/// What the health step needs from whoever runs it: berth's embedded
/// worker (the build's log pipe) or a remote worker (its progress
/// batches). The step itself, its order and its verdict are one.
pub trait HealthIo {
    /// One deployer call (`check`, `confirm`) within `limit`.
    fn call(
        &mut self,
        verb: &'static str,
        request: &Value,
        limit: Duration,
    ) -> impl std::future::Future<Output = CallEnd> + Send;
    /// Lines into the build's log.
    fn lines(&mut self, lines: &[String]) -> impl std::future::Future<Output = ()> + Send;
    /// One node's answer: its `health` event, then its log line.
    fn answer(
        &mut self,
        attempt: u32,
        a: &HealthAnswer,
    ) -> impl std::future::Future<Output = ()> + Send;
    /// Who stopped the build, if anyone did.
    fn halted(&self) -> Halt;
    /// Returns when `halted` may have changed.
    fn halt_changed(&mut self) -> impl std::future::Future<Output = ()> + Send;
}

/// The health step's two limits (`--health-interval`, `--health-timeout`).
#[derive(Debug, Clone, Copy)]
pub struct HealthLimits {
    pub interval: Duration,
    pub timeout: Duration,
}

/// Runs the health step for the nodes a deploy changed. `request` is the
/// deploy's request.
pub async fn health_step(
    io: &mut impl HealthIo,
    limits: HealthLimits,
    request: &Value,
    changed: Vec<String>,
) -> HealthEnd {
    let HealthLimits { interval, timeout } = limits;
    let deadline = tokio::time::Instant::now() + timeout;
    if timeout.is_zero() {
        // Checks are off, but a deployer that armed a revert still hears
        // `confirm`: turning checks off must not make every deploy go
        // back by itself.
        io.lines(&[
            "[berth] health checks are off (--health-timeout 0): confirming at once".to_string(),
        ])
        .await;
        return confirm(io, request, &changed).await;
    }
    io.lines(&[format!(
        "[berth] health step: checking {} changed node(s) every {}s for up to {}s",
        changed.len(),
        interval.as_secs_f64(),
        timeout.as_secs()
    )])
    .await;
    let mut attempt: u32 = 1;
    loop {
        let halted = io.halted();
        if halted != Halt::No {
            return HealthEnd::Halted(halted);
        }
        let mut call = request.clone();
        call["nodes"] = json!(changed);
        call["attempt"] = json!(attempt);
        let answers = check(io, &call, &changed, interval).await;
        for answer in &answers {
            io.answer(attempt, answer).await;
        }
        match answers.iter().find(|a| !a.healthy) {
            None => return confirm(io, request, &changed).await,
            Some(a) if tokio::time::Instant::now() + interval > deadline => {
                let reason = a.reason.as_deref().unwrap_or("unhealthy");
                return HealthEnd::Failed(cut(&format!(
                    "node {} was not healthy within --health-timeout: {reason}",
                    a.node
                )));
            }
            Some(_) => {}
        }
        // The next check, unless a cancel comes first.
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = io.halt_changed() => {}
        }
        attempt = attempt.saturating_add(1);
    }
}

/// One `check` call: an answer for every changed node (a node the
/// deployer did not answer for, a call that failed or timed out, all count
/// as unhealthy, with the reason).
pub(super) async fn check(
    io: &mut impl HealthIo,
    request: &Value,
    changed: &[String],
    timeout: Duration,
) -> Vec<HealthAnswer> {
    let all_unhealthy = |reason: &str| {
        changed
            .iter()
            .map(|node| HealthAnswer {
                node: node.clone(),
                healthy: false,
                reason: Some(reason.to_string()),
            })
            .collect::<Vec<_>>()
    };
    let (ended, result, output) = match io.call("check", request, timeout).await {
        Ok(c) => c,
        Err(_) => return all_unhealthy("the deployer's check could not be started"),
    };
    io.lines(&output).await;
    let parsed = match (ended, result) {
        (Ended::Exit(0), Ok(Some(bytes))) => serde_json::from_slice::<CheckResult>(&bytes)
            .map_err(|_| "the deployer's check result breaks the protocol"),
        (Ended::Timeout, _) => return all_unhealthy("check_timeout"),
        _ => Err("the deployer's check failed"),
    };
    let result = match parsed {
        Ok(r) => r,
        Err(why) => return all_unhealthy(why),
    };
    changed
        .iter()
        .map(|node| match result.nodes.iter().find(|n| &n.name == node) {
            Some(n) => HealthAnswer {
                node: node.clone(),
                healthy: n.healthy,
                reason: if n.healthy {
                    None
                } else {
                    Some(cut(n.reason.as_deref().unwrap_or("unhealthy")))
                },
            },
            None => HealthAnswer {
                node: node.clone(),
                healthy: false,
                reason: Some("the check gave no answer for this node".into()),
            },
        })
        .collect()
}

/// `confirm`: the deployer makes the new state permanent.
pub(super) async fn confirm(
    io: &mut impl HealthIo,
    request: &Value,
    changed: &[String],
) -> HealthEnd {
    let mut call = request.clone();
    call["nodes"] = json!(changed);
    let failed = match io.call("confirm", &call, CONFIRM_TIME_LIMIT).await {
        Ok((ended, result, output)) => {
            io.lines(&output).await;
            confirm_failure(ended, result.is_ok_and(|r| r.is_some()))
        }
        Err(_) => Some("the deployer's confirm could not be started".to_string()),
    };
    match failed {
        None => {
            io.lines(&[
                "[berth] health step: every changed node is healthy; confirmed".to_string(),
            ])
            .await;
            HealthEnd::Confirmed
        }
        Some(why) => {
            io.lines(&[format!("[berth] health step: {why}")]).await;
            HealthEnd::Failed(why)
        }
    }
}

/// A health answer's log line.
pub fn answer_line(attempt: u32, a: &HealthAnswer) -> String {
    match &a.reason {
        None => format!("[berth] health check {attempt}: node {} is healthy", a.node),
        Some(reason) => format!(
            "[berth] health check {attempt}: node {} is not healthy: {reason}",
            a.node
        ),
    }
}

/// The embedded worker's side of the health step (and of a rollout's
/// calls): its log pipe.
pub(super) struct PipeHealth<'a> {
    pub(super) engine: &'a Arc<Engine>,
    pub(super) build: BuildId,
    pub(super) work_dir: std::path::PathBuf,
    pub(super) pipe: &'a mut LogPipe,
    pub(super) cancel: &'a mut watch::Receiver<Halt>,
}

impl<'a> PipeHealth<'a> {
    /// The embedded worker's side of `build`'s calls: its work dir, its
    /// log pipe, its halt signal.
    pub(super) fn of(
        engine: &'a Arc<Engine>,
        build: &BuildRecord,
        pipe: &'a mut LogPipe,
        cancel: &'a mut watch::Receiver<Halt>,
    ) -> PipeHealth<'a> {
        PipeHealth {
            engine,
            build: build.id,
            work_dir: engine.settings.work_dir(&build.deployment),
            pipe,
            cancel,
        }
    }
}

impl HealthIo for PipeHealth<'_> {
    async fn call(&mut self, verb: &'static str, request: &Value, limit: Duration) -> CallEnd {
        self.engine
            .call_within(
                verb,
                request.to_string().into_bytes(),
                Some(self.work_dir.clone()),
                None,
                limit,
                Some(self.build),
            )
            .await
            .map_err(|e| e.describe())
    }

    async fn lines(&mut self, lines: &[String]) {
        self.engine.log_lines(self.pipe, lines).await;
    }

    async fn answer(&mut self, attempt: u32, a: &HealthAnswer) {
        self.engine
            .health_event(self.build, attempt, a, self.pipe)
            .await;
    }

    fn halted(&self) -> Halt {
        *self.cancel.borrow()
    }

    async fn halt_changed(&mut self) {
        if self.cancel.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Engine {
    /// Runs the health step of `build` for the nodes its deploy changed.
    /// `request` is the deploy's request; `cancel` the build's halt signal.
    pub(super) async fn health_step(
        self: &Arc<Self>,
        build: &BuildRecord,
        request: &Value,
        changed: Vec<String>,
        pipe: &mut LogPipe,
        cancel: &mut watch::Receiver<Halt>,
    ) -> HealthEnd {
        let limits = HealthLimits {
            interval: self.settings.health_interval,
            timeout: self.settings.health_timeout,
        };
        let mut io = PipeHealth::of(self, build, pipe, cancel);
        health_step(&mut io, limits, request, changed).await
    }

    /// Lines of berth's own (or of a check's output, cut) into the log.
    pub(super) async fn log_lines(&self, pipe: &mut LogPipe, lines: &[String]) {
        let lines = Lines::of(lines.iter().take(MAX_CALL_LINES_IN_LOG).map(String::as_str));
        if !lines.is_empty() {
            pipe.lines(lines).await;
        }
    }

    /// One node's answer: a `health` event (its own commit, after the log
    /// lines before it), then its log line.
    async fn health_event(
        &self,
        build: BuildId,
        attempt: u32,
        a: &HealthAnswer,
        pipe: &mut LogPipe,
    ) {
        let data = json!({
            "node": a.node,
            "healthy": a.healthy,
            "reason": a.reason,
            "attempt": attempt,
        })
        .to_string();
        self.build_event_amid(build, events::BuildEvent::Health, data, pipe)
            .await;
        self.log_lines(pipe, &[answer_line(attempt, a)]).await;
    }

    /// An event of a running build on the embedded worker amid its log
    /// lines: its own commit, after the lines before it, with the next id
    /// of the build channel.
    pub(super) async fn build_event_amid(
        &self,
        build: BuildId,
        kind: events::BuildEvent,
        data: String,
        pipe: &mut LogPipe,
    ) {
        pipe.commit_pending().await;
        if pipe.log.gaps.len() >= MAX_LOG_GAPS {
            return;
        }
        let (seq, gaps) = pipe.log.take_gap();
        let hub = self.hub.clone();
        let stored = self
            .store
            .write(move |tx| {
                let Some(mut b) = tx.build(build)? else {
                    return Err(StoreError::corrupt("a running build without its record"));
                };
                b.log_gaps = gaps.clone();
                b.event_seq = b.event_seq.max(seq);
                b.seq_reserved = b.seq_reserved.max(seq);
                events::build_event_amid_log(
                    tx,
                    &hub,
                    build,
                    seq,
                    kind,
                    data.clone(),
                    now_millis(),
                )?;
                tx.put_build(&b)
            })
            .await;
        // The seq stays skipped (every later commit of the build stores
        // the gaps), so a lost event never shifts a line's id.
        if let Err(e) = stored {
            tracing::error!(error = %e, build = %format_build_id(build), event = kind.name(), "cannot store a build event; the log has what it said");
        }
    }
}

/// Why a `confirm` call failed, in words for the build's failure detail
/// and log, or `None` when it confirmed (exit 0 with a result). Each way it
/// can end is named, so the next way is decided here too.
fn confirm_failure(ended: Ended, has_result: bool) -> Option<String> {
    match ended {
        Ended::Exit(0) if has_result => None,
        Ended::Exit(0) => Some("the deployer's confirm exited 0 without a result".into()),
        Ended::Exit(code) => Some(format!(
            "the deployer's confirm failed (exit status {code}; its output is in the log)"
        )),
        Ended::Signal(signal) => Some(format!(
            "the deployer's confirm was killed by signal {signal}"
        )),
        Ended::StatusUnknown => {
            Some("the deployer's confirm ended with a status berth could not read".into())
        }
        Ended::Timeout => Some(format!(
            "the deployer's confirm did not end within {} s",
            CONFIRM_TIME_LIMIT.as_secs()
        )),
        Ended::Cancelled => Some("the deployer's confirm was stopped".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_confirm_succeeds_only_with_exit_0_and_a_result_and_says_how_it_failed() {
        assert_eq!(confirm_failure(Ended::Exit(0), true), None);
        for (ended, has_result, words) in [
            (Ended::Exit(0), false, "without a result"),
            (Ended::Exit(3), true, "exit status 3"),
            (Ended::Signal(9), true, "signal 9"),
            (Ended::StatusUnknown, true, "could not read"),
            (Ended::Timeout, true, "did not end within 300 s"),
            (Ended::Cancelled, true, "stopped"),
        ] {
            let why = confirm_failure(ended, has_result).expect("a failure");
            assert!(why.contains(words), "{why}");
        }
    }
}
