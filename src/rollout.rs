//! Rollouts in waves (rollouts.md), the pure part: the rollout policy and
//! its rules, the plan (which nodes go in which wave), and the procedure as
//! a state machine that says what the rollout does next and takes what
//! happened. No I/O: the engine runs the deployer calls it asks for and
//! stores the record it returns.
//!
//! Why it exists: a rollout runs for hours, through pauses, freezes,
//! aborts and restarts, and steps of it are asked for by people acting
//! seconds apart. What may happen next must be decided in one place that a
//! test can drive through every order of events: never two activations of
//! a node in one rollout, never a revert of a node no `activate` named,
//! never a wave while a freeze holds (`tests::the_rollout_machine_holds_its_invariants`).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::model::{AbortBy, Millis, Rollout, RolloutOutcome, RolloutState, Wave, WaveState};

/// Wave steps a policy lists at most.
pub const MAX_WAVE_STEPS: usize = 64;
/// Nodes `first` names at most.
pub const MAX_FIRST_NODES: usize = 1000;
/// Entries of `pause_after` at most, and the largest one.
pub const MAX_PAUSE_AFTER: usize = 65;
/// Nodes one rollout activates at most; more fails the build.
pub const MAX_ROLLOUT_NODES: usize = 10_000;
/// A wave step's count at most; `max_unhealthy`'s too.
pub const MAX_STEP_COUNT: u32 = 10_000;
/// `wait_seconds` and `progress_deadline_seconds` at most (a day).
pub const MAX_POLICY_SECONDS: u32 = 86_400;
/// `progress_deadline_seconds` at least.
pub const MIN_PROGRESS_DEADLINE_SECONDS: u32 = 5;
/// A pause's or an abort's reason at most (characters).
pub const MAX_REASON_CHARS: usize = 500;

/// A count of nodes, or a share of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Amount {
    Count(u32),
    /// `"N%"`.
    Percent(u32),
}

impl Amount {
    fn to_json(self) -> Value {
        match self {
            Amount::Count(n) => Value::from(n),
            Amount::Percent(p) => Value::from(format!("{p}%")),
        }
    }
}

/// A deployment's rollout policy (rollouts.md "The rollout policy"); `{}`
/// is the default.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Policy {
    /// Cumulative targets: after wave k, that many changed nodes run the
    /// new state.
    pub waves: Vec<Amount>,
    /// Nodes that go first, in this order.
    pub first: Vec<String>,
    /// Waves after whose gate the rollout pauses.
    pub pause_after: BTreeSet<u32>,
    pub wait_seconds: u32,
    /// Unhealthy nodes each wave may keep at a gate.
    pub max_unhealthy: Option<Amount>,
    /// `None`: `--health-timeout`.
    pub progress_deadline_seconds: Option<u32>,
}

/// A rule a policy breaks: where (a JSON pointer below the policy), which
/// code, and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub pointer: String,
    pub code: &'static str,
    pub message: String,
}

fn problem(pointer: impl Into<String>, code: &'static str, message: impl Into<String>) -> Problem {
    Problem {
        pointer: pointer.into(),
        code,
        message: message.into(),
    }
}

/// The fields a policy takes.
const FIELDS: [&str; 6] = [
    "waves",
    "first",
    "pause_after",
    "wait_seconds",
    "max_unhealthy",
    "progress_deadline_seconds",
];

impl Policy {
    /// Reads a policy, checking every rule; every broken rule is one
    /// problem (nothing is stored when there is one).
    pub fn parse(v: &Value) -> Result<Policy, Vec<Problem>> {
        let Some(map) = v.as_object() else {
            return Err(vec![problem("", "type", "the rollout policy is an object")]);
        };
        let mut problems: Vec<Problem> = map
            .keys()
            .filter(|k| !FIELDS.contains(&k.as_str()))
            .map(|k| {
                problem(
                    format!("/{k}"),
                    "unknown_field",
                    format!("a rollout policy takes only {}", FIELDS.join(", ")),
                )
            })
            .collect();
        let mut policy = Policy::default();
        let mut take = |r: Result<(), Vec<Problem>>| {
            if let Err(p) = r {
                problems.extend(p);
            }
        };
        take(parse_waves(map.get("waves"), &mut policy.waves));
        take(parse_first(map.get("first"), &mut policy.first));
        take(parse_pause_after(
            map.get("pause_after"),
            &mut policy.pause_after,
        ));
        take(
            seconds(map.get("wait_seconds"), "/wait_seconds", 0)
                .map(|s| policy.wait_seconds = s.unwrap_or(0)),
        );
        take(
            seconds(
                map.get("progress_deadline_seconds"),
                "/progress_deadline_seconds",
                MIN_PROGRESS_DEADLINE_SECONDS,
            )
            .map(|s| policy.progress_deadline_seconds = s),
        );
        take(match map.get("max_unhealthy") {
            None | Some(Value::Null) => Ok(()),
            Some(v) => amount(v, "/max_unhealthy", 0)
                .map(|a| policy.max_unhealthy = Some(a))
                .map_err(|p| vec![p]),
        });
        if problems.is_empty() {
            Ok(policy)
        } else {
            Err(problems)
        }
    }

    /// The policy as JSON, with every field.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "waves": self.waves.iter().map(|a| a.to_json()).collect::<Vec<_>>(),
            "first": self.first,
            "pause_after": self.pause_after,
            "wait_seconds": self.wait_seconds,
            "max_unhealthy": self.max_unhealthy.map(Amount::to_json),
            "progress_deadline_seconds": self.progress_deadline_seconds,
        })
    }

    /// Whether it is `{}` (what a source without `activate` may have).
    pub fn is_default(&self) -> bool {
        *self == Policy::default()
    }
}

/// An integer 1-10,000 (`min` 0 for `max_unhealthy`) or `"N%"`.
fn amount(v: &Value, at: &str, min: u32) -> Result<Amount, Problem> {
    let range = || {
        problem(
            at,
            "range",
            format!(
                "a count is {min}-{MAX_STEP_COUNT}, a share \"{}%\" to \"100%\"",
                min.max(1) - 1 + min.min(1)
            ),
        )
    };
    match v {
        Value::Number(n) => {
            let n = n.as_u64().ok_or_else(range)?;
            let n = u32::try_from(n).map_err(|_| range())?;
            if n < min || n > MAX_STEP_COUNT {
                return Err(range());
            }
            Ok(Amount::Count(n))
        }
        Value::String(s) => {
            let digits = s
                .strip_suffix('%')
                .ok_or_else(|| problem(at, "type", "a share is written \"N%\""))?;
            let p = digits
                .parse::<u32>()
                .ok()
                .filter(|_| digits.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| problem(at, "type", "a share is written \"N%\""))?;
            if p < min || p > 100 {
                return Err(range());
            }
            Ok(Amount::Percent(p))
        }
        _ => Err(problem(at, "type", "an integer or \"N%\"")),
    }
}

fn array<'v>(v: Option<&'v Value>, at: &str, max: usize) -> Result<&'v [Value], Vec<Problem>> {
    match v {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(items)) if items.len() > max => Err(vec![problem(
            at,
            "too_many",
            format!("at most {max} entries"),
        )]),
        Some(Value::Array(items)) => Ok(items),
        Some(_) => Err(vec![problem(at, "type", "a list")]),
    }
}

fn parse_waves(v: Option<&Value>, out: &mut Vec<Amount>) -> Result<(), Vec<Problem>> {
    let items = array(v, "/waves", MAX_WAVE_STEPS)?;
    let mut problems = Vec::new();
    let (mut last_count, mut last_share) = (0u32, 0u32);
    for (i, item) in items.iter().enumerate() {
        let at = format!("/waves/{i}");
        match amount(item, &at, 1) {
            Ok(a) => {
                let (last, n) = match a {
                    Amount::Count(n) => (&mut last_count, n),
                    Amount::Percent(p) => (&mut last_share, p),
                };
                if n <= *last {
                    problems.push(problem(
                        at,
                        "not_increasing",
                        "counts, and shares, each strictly increase",
                    ));
                }
                *last = n;
                out.push(a);
            }
            Err(p) => problems.push(p),
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

fn parse_first(v: Option<&Value>, out: &mut Vec<String>) -> Result<(), Vec<Problem>> {
    let items = array(v, "/first", MAX_FIRST_NODES)?;
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("/first/{i}");
        match item.as_str() {
            Some(name) if crate::model::is_dns_label(name, 63) => {
                if seen.insert(name) {
                    out.push(name.to_string());
                } else {
                    problems.push(problem(at, "duplicate", "each node once"));
                }
            }
            _ => problems.push(problem(at, "type", "a node name (a DNS label)")),
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

fn parse_pause_after(v: Option<&Value>, out: &mut BTreeSet<u32>) -> Result<(), Vec<Problem>> {
    let items = array(v, "/pause_after", MAX_PAUSE_AFTER)?;
    let mut problems = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("/pause_after/{i}");
        match item.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) if (1..=MAX_PAUSE_AFTER as u32).contains(&n) => {
                if !out.insert(n) {
                    problems.push(problem(at, "duplicate", "each wave once"));
                }
            }
            Some(_) => problems.push(problem(at, "range", "a wave number 1-65")),
            None => problems.push(problem(at, "type", "a wave number 1-65")),
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

fn seconds(v: Option<&Value>, at: &str, min: u32) -> Result<Option<u32>, Vec<Problem>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(s) if (min..=MAX_POLICY_SECONDS).contains(&s) => Ok(Some(s)),
            _ => Err(vec![problem(
                at,
                "range",
                format!("{min} to {MAX_POLICY_SECONDS} seconds"),
            )]),
        },
        Some(_) => Err(vec![problem(at, "type", "a whole number of seconds")]),
    }
}

/// Whether a build's trigger stages its rollout: a submit and an automatic
/// update are staged; the way back (a rollback) and a toggle of what ran
/// before (suspend, resume) go in one wave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Staging {
    Staged,
    OneWave,
}

/// The plan (rollouts.md "The plan"): the changed nodes in waves. `first`'s
/// names among them in its order, then the others in byte order; each
/// target of the policy (a count, or a share rounded up), then all of
/// them; a target not above the one before is dropped. Zero nodes, zero
/// waves.
pub fn plan(changed: &[String], policy: &Policy, staging: Staging) -> Vec<Vec<String>> {
    let mut rest: BTreeSet<&str> = changed.iter().map(String::as_str).collect();
    let mut order: Vec<String> = Vec::with_capacity(rest.len());
    for name in &policy.first {
        if rest.remove(name.as_str()) {
            order.push(name.clone());
        }
    }
    order.extend(rest.into_iter().map(str::to_string));
    let n = order.len();
    let mut targets: Vec<usize> = match staging {
        Staging::Staged => policy.waves.iter().map(|a| target(*a, n)).collect(),
        Staging::OneWave => vec![],
    };
    targets.push(n);
    let mut waves = Vec::new();
    let mut done = 0;
    for t in targets {
        if t > done {
            waves.push(order[done..t].to_vec());
            done = t;
        }
    }
    waves
}

fn target(a: Amount, n: usize) -> usize {
    match a {
        Amount::Count(c) => n.min(c as usize),
        Amount::Percent(p) => (p as usize * n).div_ceil(100),
    }
}

/// Unhealthy nodes a wave of `len` nodes may keep at a gate (a share is
/// rounded down).
pub fn allowance(max_unhealthy: Option<Amount>, len: usize) -> usize {
    match max_unhealthy {
        None => 0,
        Some(Amount::Count(c)) => c as usize,
        Some(Amount::Percent(p)) => p as usize * len / 100,
    }
}

/// A checked reason text (a pause's or an abort's): 1-500 characters,
/// no control characters.
pub fn check_reason(text: &str) -> Result<(), &'static str> {
    let chars = text.chars().count();
    if chars == 0 || chars > MAX_REASON_CHARS {
        return Err("range");
    }
    if text.chars().any(char::is_control) {
        return Err("control_character");
    }
    Ok(())
}

/// What the rollout does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// `activate` `new` for these nodes of wave `wave`.
    Activate {
        wave: usize,
        nodes: Vec<String>,
    },
    /// `check` these nodes until the gate passes or fails.
    Gate {
        nodes: Vec<String>,
    },
    /// Nothing until the wait's end (`Waiting`), a resume (`Paused`) or a
    /// lift (`Frozen`): the watch runs meanwhile.
    Hold(RolloutState),
    /// `confirm` every activated node.
    Confirm {
        nodes: Vec<String>,
    },
    /// `activate` `previous` for the nodes an `activate` named in `wave`.
    Revert {
        wave: usize,
        nodes: Vec<String>,
    },
    Done(RolloutOutcome),
}

/// What happened, for `Rollout::apply`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Wave `wave`'s `activate` `new` is about to be called: its nodes are
    /// named from now on (an abort meanwhile reverts them).
    ActivateStarted {
        wave: usize,
    },
    /// The answers of wave `wave`'s `activate` `new`, one per node.
    Activated {
        wave: usize,
        answers: BTreeMap<String, bool>,
    },
    /// An `activate` call failed as a call (exit, protocol, timeout): any
    /// of its nodes may have been activated.
    ActivateFailed,
    GatePassed,
    /// Too many unhealthy nodes, or the gate's deadline passed.
    GateFailed,
    WaitOver,
    /// A freeze holds the next wave.
    FreezeHeld,
    FreezeLifted,
    PauseAsked,
    Resumed,
    AbortAsked,
    /// Wave `wave`'s revert call ended (whatever it answered).
    Reverted {
        wave: usize,
    },
    Confirmed,
    ConfirmFailed,
    Cancelled,
    /// The build failed otherwise (its deployer calls cannot go on).
    Failed,
}

/// An event that does not fit where the rollout is (the engine's bug, or
/// an action the `actions` list shows disabled): nothing changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused;

impl Rollout {
    /// A new rollout of `waves`, before its first wave.
    pub fn new(waves: Vec<Vec<String>>, policy: &Policy, staging: Staging) -> Rollout {
        let (pause_after, wait_seconds) = match staging {
            Staging::Staged => (policy.pause_after.clone(), policy.wait_seconds),
            Staging::OneWave => (BTreeSet::new(), 0),
        };
        Rollout {
            state: RolloutState::Running,
            wave: 0,
            waves: waves
                .into_iter()
                .map(|nodes| Wave {
                    nodes,
                    state: WaveState::Pending,
                    activated: BTreeMap::new(),
                    answered: false,
                    activated_at: None,
                    passed_at: None,
                })
                .collect(),
            pause_after,
            wait_seconds,
            wait_until: None,
            paused: false,
            held: 0,
            regate: false,
            abort: None,
            result: None,
        }
    }

    /// Every node an `activate` `new` named, in wave order.
    pub fn activated_nodes(&self) -> Vec<String> {
        self.waves
            .iter()
            .flat_map(|w| w.activated.keys().cloned())
            .collect()
    }

    /// What to do now, with a freeze active (`frozen`) or not.
    pub fn next(&self, frozen: bool) -> Next {
        match self.state {
            RolloutState::Finished => Next::Done(self.result.unwrap_or(RolloutOutcome::Failed)),
            RolloutState::Aborting => match self
                .waves
                .iter()
                .rposition(|w| w.state == WaveState::Reverting)
            {
                Some(i) => Next::Revert {
                    wave: i + 1,
                    nodes: self.waves[i].activated.keys().cloned().collect(),
                },
                None => Next::Done(RolloutOutcome::Aborted),
            },
            RolloutState::Confirming => Next::Confirm {
                nodes: self.activated_nodes(),
            },
            RolloutState::Paused | RolloutState::Waiting | RolloutState::Frozen => {
                Next::Hold(self.state)
            }
            RolloutState::Running => self.running(frozen),
        }
    }

    /// In `Running`: the current wave's activate or gate, or the next
    /// wave's activate (held while frozen).
    fn running(&self, frozen: bool) -> Next {
        let current = self.wave.checked_sub(1).map(|i| &self.waves[i]);
        match current.map(|w| w.state) {
            Some(WaveState::Pending | WaveState::Activating) => Next::Activate {
                wave: self.wave,
                nodes: self.waves[self.wave - 1].nodes.clone(),
            },
            Some(WaveState::Checking) if !self.regate => Next::Gate {
                nodes: self.waves[self.wave - 1]
                    .activated
                    .keys()
                    .cloned()
                    .collect(),
            },
            Some(WaveState::Checking | WaveState::Passed) if self.regate => Next::Gate {
                nodes: self.activated_nodes(),
            },
            Some(WaveState::Passed) | None => match self.waves.get(self.wave) {
                Some(_) if frozen && self.wave > 0 => Next::Hold(RolloutState::Frozen),
                Some(w) => Next::Activate {
                    wave: self.wave + 1,
                    nodes: w.nodes.clone(),
                },
                None => Next::Confirm {
                    nodes: self.activated_nodes(),
                },
            },
            // Not in `Running`: an abort moved them.
            Some(WaveState::Checking | WaveState::Reverting | WaveState::Reverted) => {
                Next::Done(RolloutOutcome::Failed)
            }
        }
    }

    /// Takes what happened at `now`; the rollout after it, or `Refused`
    /// (nothing changes).
    pub fn apply(&self, event: &Event, now: Millis, frozen: bool) -> Result<Rollout, Refused> {
        let mut r = self.clone();
        let next = r.next(frozen);
        match (event, next) {
            (Event::Cancelled, _) if r.state != RolloutState::Finished => {
                r.finish(RolloutOutcome::Cancelled)
            }
            (Event::Failed, _) if r.state != RolloutState::Finished => {
                r.finish(RolloutOutcome::Failed)
            }
            (Event::AbortAsked, _) if r.can_abort() => r.begin_abort(AbortBy::Action),
            (Event::PauseAsked, _) if r.can_pause() => r.pause(),
            (Event::Resumed, _) if r.paused && !frozen && r.can_abort() => {
                r.paused = false;
                if r.state == RolloutState::Paused {
                    r.state = RolloutState::Running;
                    r.regate = true;
                }
            }
            (Event::ActivateStarted { wave }, Next::Activate { wave: w, nodes })
                if *wave == w && r.unanswered().is_none() =>
            {
                r.wave = w;
                let wave = &mut r.waves[w - 1];
                wave.state = WaveState::Activating;
                wave.activated = nodes.into_iter().map(|n| (n, false)).collect();
                wave.activated_at = Some(now);
            }
            (Event::Activated { wave, answers }, _) if r.in_flight(*wave, answers) => {
                let w = &mut r.waves[wave - 1];
                w.activated = answers.clone();
                w.answered = true;
                if r.state == RolloutState::Running {
                    w.state = WaveState::Checking;
                    r.regate = false;
                }
            }
            (Event::ActivateFailed, _) if r.unanswered().is_some() => {
                let w = r.wave;
                r.waves[w - 1].answered = true;
                if r.state == RolloutState::Running {
                    r.begin_abort(AbortBy::Activate);
                }
            }
            (Event::GatePassed, Next::Gate { .. }) => r.gate_passed(now),
            (Event::GateFailed, Next::Gate { .. }) => r.begin_abort(AbortBy::Health),
            (Event::WaitOver, Next::Hold(RolloutState::Waiting)) => r.resume_after_hold(),
            (Event::FreezeHeld, Next::Hold(RolloutState::Frozen))
                if r.state == RolloutState::Running =>
            {
                r.state = RolloutState::Frozen;
            }
            (Event::FreezeLifted, Next::Hold(RolloutState::Frozen)) if !frozen => {
                r.resume_after_hold()
            }
            (Event::Reverted { wave }, Next::Revert { wave: w, .. }) if *wave == w => {
                r.waves[w - 1].state = WaveState::Reverted;
                if r.next(frozen) == Next::Done(RolloutOutcome::Aborted) {
                    r.finish(RolloutOutcome::Aborted);
                }
            }
            (Event::Confirmed, Next::Confirm { .. }) => r.finish(RolloutOutcome::Succeeded),
            (Event::ConfirmFailed, Next::Confirm { .. }) => r.begin_abort(AbortBy::Confirm),
            _ => return Err(Refused),
        }
        Ok(r)
    }

    /// The wave whose `activate` `new` was called and not answered.
    pub fn unanswered(&self) -> Option<usize> {
        let w = self.waves.get(self.wave.checked_sub(1)?)?;
        (w.activated_at.is_some() && !w.answered).then_some(self.wave)
    }

    /// Whether wave `wave`'s `activate` `new` is the call in flight and
    /// `answers` name exactly its nodes.
    fn in_flight(&self, wave: usize, answers: &BTreeMap<String, bool>) -> bool {
        self.unanswered() == Some(wave)
            && matches!(self.state, RolloutState::Running | RolloutState::Aborting)
            && answers.keys().eq(self.waves[wave - 1].activated.keys())
    }

    /// Whether a pause or an abort may still be asked (`rollout_ending`
    /// otherwise).
    pub fn can_abort(&self) -> bool {
        !matches!(
            self.state,
            RolloutState::Confirming | RolloutState::Aborting | RolloutState::Finished
        )
    }

    fn can_pause(&self) -> bool {
        !self.paused && self.can_abort()
    }

    /// A pause: at once while waiting, frozen or between waves; else after
    /// the current wave's gate.
    fn pause(&mut self) {
        self.paused = true;
        let between = self.state == RolloutState::Running
            && !self.regate
            && self.wave > 0
            && self.waves[self.wave - 1].state == WaveState::Passed;
        if matches!(self.state, RolloutState::Waiting | RolloutState::Frozen) || between {
            self.state = RolloutState::Paused;
            self.wait_until = None;
        }
    }

    /// After a wait or a freeze: the gate again.
    fn resume_after_hold(&mut self) {
        self.state = RolloutState::Running;
        self.wait_until = None;
        self.regate = true;
    }

    /// The gate of wave k passed: its holds in order (a pause, the wait;
    /// the freeze is `next`'s), then the next wave or `confirm`.
    fn gate_passed(&mut self, now: Millis) {
        let k = self.wave;
        let wave = &mut self.waves[k - 1];
        if wave.state == WaveState::Checking {
            wave.state = WaveState::Passed;
            wave.passed_at = Some(now);
        }
        self.regate = false;
        let last = k == self.waves.len();
        let fresh = self.held < k;
        self.held = k;
        if fresh && self.pause_after.contains(&(k as u32)) {
            self.paused = true;
        }
        self.state = if self.paused {
            RolloutState::Paused
        } else if fresh && !last && self.wait_seconds > 0 {
            self.wait_until = Some(now.saturating_add(i64::from(self.wait_seconds) * 1000));
            RolloutState::Waiting
        } else if last {
            RolloutState::Confirming
        } else {
            RolloutState::Running
        };
    }

    fn begin_abort(&mut self, by: AbortBy) {
        self.abort = Some(by);
        self.paused = false;
        self.regate = false;
        self.wait_until = None;
        self.state = RolloutState::Aborting;
        for w in &mut self.waves {
            if !w.activated.is_empty() && w.state != WaveState::Reverted {
                w.state = WaveState::Reverting;
            }
        }
        if self.next(false) == Next::Done(RolloutOutcome::Aborted) {
            self.finish(RolloutOutcome::Aborted);
        }
    }

    fn finish(&mut self, outcome: RolloutOutcome) {
        self.state = RolloutState::Finished;
        self.result = Some(outcome);
        self.wait_until = None;
        self.regate = false;
    }
}

#[cfg(test)]
mod tests;
