//! A rollout build on this worker (workers.md "Rollouts on workers"):
//! berth orchestrates, the worker executes. After its `deploy` the worker
//! reports it as call 1 (with its SBOM files and work state uploaded), then
//! runs each call berth hands out (`next_call` in the answers to its
//! reports and renews) in the deployment's work dir, its output sent as
//! progress first, and reports it; when an answer says `done`, it sends
//! the outcome. While the rollout waits, pauses or is frozen the worker
//! holds the attempt by renewing.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use std::sync::Arc;

use tokio::sync::{mpsc, watch};

use super::files::Carried;
use super::{
    accepted, new_operation_id, Attempt, AttemptEnd, Courier, Halt, Run, Worker, WorkerHealth,
};
use crate::engine::health::HealthIo;
use crate::engine::runner::{self, Ended};

/// The deploy's call.
const FIRST_CALL: u64 = 1;
/// The pause before an idle rollout asks berth for its next call again
/// (a renew, which berth holds until a call comes or a few seconds pass).
const IDLE_POLL: Duration = Duration::from_millis(100);
/// A call's time limit when the claim gives no build timeout.
const UNBOUNDED_CALL: Duration = Duration::from_secs(24 * 3600);

/// A call's end as reports and outcomes say it.
pub(super) fn ended_json(ended: &Ended, halted: Halt) -> Value {
    match ended {
        Ended::Exit(code) => json!({"kind": "exit", "code": code}),
        Ended::Signal(sig) => json!({"kind": "signal", "signal": sig}),
        Ended::StatusUnknown => json!({"kind": "status_unknown"}),
        Ended::Timeout => json!({"kind": "timeout"}),
        Ended::Cancelled => match halted {
            Halt::Shutdown => json!({"kind": "shutdown"}),
            Halt::No | Halt::Cancel | Halt::Fenced => json!({"kind": "cancelled"}),
        },
    }
}

/// A result file's JSON, or null and why not.
pub(super) fn result_json(read: Result<Option<Vec<u8>>, String>) -> (Value, Value) {
    match read {
        Ok(Some(bytes)) => match serde_json::from_slice::<Value>(&bytes) {
            Ok(v) => (v, Value::Null),
            Err(_) => (Value::Null, json!("not_json")),
        },
        Ok(None) => (Value::Null, json!("missing")),
        Err(_) => (Value::Null, json!("unsafe")),
    }
}

impl Worker {
    /// The rest of a rollout build after its deploy exited 0: its calls,
    /// then its outcome.
    pub(super) async fn follow_rollout(
        &self,
        a: &mut Attempt,
        run: &mut Run,
        work_dir: &Path,
        root: &Path,
        carried: Carried,
    ) -> AttemptEnd {
        let deployed = json!({"kind": "exit", "code": 0});
        let (result, problem) = result_json(runner::read_result(root));
        let answer = match self
            .report_call(a, run, FIRST_CALL, &deployed, (&result, &problem), &carried)
            .await
        {
            Ok(answer) => answer,
            Err(end) => return end,
        };
        // Stored with the plan: what the next archive compares with.
        if let Some(digest) = carried.work_state.as_str() {
            a.work_state = Some(digest.to_string());
        }
        self.follow_calls(a, run, work_dir, root, answer).await
    }

    /// A rollout build another worker deployed, handed over to this one
    /// (its worker was lost between calls): the work state the claim
    /// names, then its calls and its outcome.
    pub(super) async fn take_over(
        self: Arc<Self>,
        mut a: Attempt,
        halt: watch::Receiver<Halt>,
        work_dir: &Path,
        root: &Path,
    ) -> AttemptEnd {
        if let Err(detail) = self.restore(&a, work_dir).await {
            let ended =
                json!({"kind": "not_run", "reason": "work_state_unavailable", "detail": detail});
            let untouched = Carried::untouched(&a);
            return self
                .send_outcome(&mut a, 0, ended, None, Value::Null, untouched)
                .await;
        }
        if let Err(e) = std::fs::create_dir_all(root) {
            tracing::warn!(error = %e, dir = %root.display(), "cannot make an attempt's scratch dir");
        }
        // No deployer of its own: its line channel is closed from the start.
        let (_, lines) = mpsc::channel(1);
        let (stop, _) = watch::channel(false);
        let (renewed_tx, renewed) = watch::channel(a.deadline);
        let (fence_tx, fenced) = watch::channel(None::<AttemptEnd>);
        let renewer = tokio::spawn(self.clone().renew_loop(
            a.id.clone(),
            a.fence,
            a.ttl,
            renewed_tx,
            fence_tx,
        ));
        let mut run = Run {
            courier: Courier::default(),
            lines,
            stop,
            renewed,
            fenced,
            halt,
            halted: Halt::No,
        };
        let start = json!({"next_call": null, "done": false});
        let end = self
            .follow_calls(&mut a, &mut run, work_dir, root, start)
            .await;
        renewer.abort();
        end
    }

    /// Runs the calls berth hands out until it says `done` (or a halt),
    /// then sends the outcome.
    async fn follow_calls(
        &self,
        a: &mut Attempt,
        run: &mut Run,
        work_dir: &Path,
        root: &Path,
        mut answer: Value,
    ) -> AttemptEnd {
        let deployed = json!({"kind": "exit", "code": 0});
        let mut last = FIRST_CALL;
        while answer["done"].as_bool() != Some(true) && run.halted == Halt::No {
            if answer["cancel"].as_bool() == Some(true) {
                run.halted = Halt::Cancel;
                break;
            }
            let next = &answer["next_call"];
            let step = match next["seq"].as_u64().filter(|seq| *seq > last) {
                Some(seq) => {
                    last = seq;
                    self.run_call(a, run, work_dir, seq, next).await
                }
                None => self.wait_for_call(a, run).await,
            };
            answer = match step {
                Ok(answer) => answer,
                Err(end) => return end,
            };
        }
        let ended = match run.halted {
            Halt::No => deployed,
            Halt::Cancel | Halt::Fenced => json!({"kind": "cancelled"}),
            Halt::Shutdown => json!({"kind": "shutdown"}),
        };
        let through = run.courier.sent_through;
        let (result, _) = result_json(runner::read_result(root));
        let carried = self.carry(a, root, work_dir, &result).await;
        self.send_outcome(a, through, ended, Some(root), Value::Null, carried)
            .await
    }

    /// Runs one call berth handed out, its output sent as progress first,
    /// and reports it; berth's answer.
    async fn run_call(
        &self,
        a: &mut Attempt,
        run: &mut Run,
        work_dir: &Path,
        seq: u64,
        call: &Value,
    ) -> Result<Value, AttemptEnd> {
        let verb: Option<&'static str> = match call["verb"].as_str() {
            Some("activate") => Some("activate"),
            Some("check") => Some("check"),
            Some("confirm") => Some("confirm"),
            Some(_) | None => None,
        };
        let limit = a.build_timeout.unwrap_or(UNBOUNDED_CALL);
        let mut io = WorkerHealth {
            worker: self,
            attempt: a,
            work_dir: work_dir.to_path_buf(),
            courier: &mut run.courier,
            halt: run.halt.clone(),
            renewed: &mut run.renewed,
            gone: None,
        };
        let (ended, result) = match verb {
            None => (
                json!({"kind": "not_run", "reason": "spawn_failed", "detail": "berth handed out a verb this worker does not run"}),
                (Value::Null, json!("missing")),
            ),
            Some(verb) => match io.call(verb, &call["request"], limit).await {
                Ok((ended, read, output)) => {
                    io.lines(&output).await;
                    (ended_json(&ended, Halt::No), result_json(read))
                }
                Err(detail) => (
                    json!({"kind": "not_run", "reason": "spawn_failed", "detail": detail}),
                    (Value::Null, json!("missing")),
                ),
            },
        };
        io.flush().await;
        if let Some(end) = io.gone.take() {
            return Err(end);
        }
        let none = Carried::untouched(a);
        self.report_call(a, run, seq, &ended, (&result.0, &result.1), &none)
            .await
    }

    /// Holds the attempt while berth has no call for it: a renew after a
    /// short pause (its answer carries the next call), or a halt.
    async fn wait_for_call(&self, a: &mut Attempt, run: &mut Run) -> Result<Value, AttemptEnd> {
        tokio::select! {
            _ = tokio::time::sleep(IDLE_POLL) => {}
            changed = run.halt.changed() => {
                if changed.is_ok() {
                    match *run.halt.borrow() {
                        Halt::Fenced => return Err(AttemptEnd::Done),
                        Halt::No => {}
                        h => run.halted = h,
                    }
                }
            }
        }
        let path = format!("/internal/v1/attempts/{}/renew", a.id);
        let body = json!({"operation_id": new_operation_id(), "fence": a.fence, "worker_incarnation": self.incarnation});
        let sent = tokio::time::Instant::now();
        let renewed = self
            .api
            .resend(reqwest::Method::POST, &path, &body, a.deadline)
            .await;
        let answer = accepted(renewed, "a renew", &a.id)?;
        if let Some(ttl) = answer["lease_ttl_ms"].as_u64().map(Duration::from_millis) {
            a.deadline = sent + ttl;
        }
        Ok(answer)
    }

    /// `POST .../calls/{seq}`, resent until answered or the deadline.
    async fn report_call(
        &self,
        a: &mut Attempt,
        run: &mut Run,
        seq: u64,
        ended: &Value,
        (result, problem): (&Value, &Value),
        carried: &Carried,
    ) -> Result<Value, AttemptEnd> {
        let body = json!({
            "operation_id": new_operation_id(), "fence": a.fence, "worker_incarnation": self.incarnation,
            "progress_through": run.courier.sent_through, "ended": ended, "result": result,
            "result_problem": problem, "files": carried.files, "work_state": carried.work_state,
            "work_state_problem": carried.work_state_problem,
        });
        let path = format!("/internal/v1/attempts/{}/calls/{seq}", a.id);
        let sent = self
            .api
            .resend(reqwest::Method::POST, &path, &body, a.deadline)
            .await;
        accepted(sent, "a call's report", &a.id)
    }
}
