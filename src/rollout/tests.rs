use super::*;
use proptest::prelude::*;
use serde_json::json;

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("web-{i}")).collect()
}

#[test]
fn the_specs_example_plans_as_it_says() {
    let policy = Policy::parse(&json!({"waves": [1, "50%"]})).expect("valid");
    let waves = plan(&names(7), &policy, Staging::Staged);
    let sizes: Vec<usize> = waves.iter().map(Vec::len).collect();
    assert_eq!(sizes, [1, 3, 3]);
    // Byte order: web-10 before web-2.
    let waves = plan(&names(11), &Policy::default(), Staging::Staged);
    assert_eq!(waves.len(), 1);
    assert_eq!(waves[0][2], "web-10");
    assert_eq!(waves[0][3], "web-2");
    assert!(plan(&[], &policy, Staging::Staged).is_empty());
    let first = Policy::parse(&json!({"first": ["web-6", "nope"], "waves": [1]})).expect("valid");
    assert_eq!(plan(&names(7), &first, Staging::Staged)[0], ["web-6"]);
    // The way back is one wave, in the same order.
    let back = plan(&names(7), &first, Staging::OneWave);
    assert_eq!(back.len(), 1);
    assert_eq!(back[0][0], "web-6");
}

#[test]
fn a_broken_policy_names_each_problem_and_its_place() {
    let bad = json!({
        "waves": [2, 2, "0%", "x%", true],
        "first": ["web-1", "web-1", "Bad_Name"],
        "pause_after": [0, 3, 3],
        "wait_seconds": 86_401,
        "max_unhealthy": "101%",
        "progress_deadline_seconds": 4,
        "extra": 1,
    });
    let problems = Policy::parse(&bad).expect_err("refused");
    let found: BTreeSet<(String, &str)> = problems
        .iter()
        .map(|p| (p.pointer.clone(), p.code))
        .collect();
    for (pointer, code) in [
        ("/waves/1", "not_increasing"),
        ("/waves/2", "range"),
        ("/waves/3", "type"),
        ("/waves/4", "type"),
        ("/first/1", "duplicate"),
        ("/first/2", "type"),
        ("/pause_after/0", "range"),
        ("/pause_after/2", "duplicate"),
        ("/wait_seconds", "range"),
        ("/max_unhealthy", "range"),
        ("/progress_deadline_seconds", "range"),
        ("/extra", "unknown_field"),
    ] {
        assert!(
            found.contains(&(pointer.to_string(), code)),
            "{pointer} {code} missing from {found:?}"
        );
    }
    let many = json!({"waves": (1..=65).collect::<Vec<u32>>()});
    assert_eq!(
        Policy::parse(&many).expect_err("too many")[0].code,
        "too_many"
    );
    let policy = Policy::parse(&json!({})).expect("the default");
    assert!(policy.is_default());
    let round = Policy::parse(&policy.to_json()).expect("its own JSON");
    assert_eq!(round, policy);
}

#[test]
fn allowances_round_down_and_reasons_are_checked() {
    assert_eq!(allowance(Some(Amount::Percent(5)), 30), 1);
    assert_eq!(allowance(Some(Amount::Percent(5)), 19), 0);
    assert_eq!(allowance(Some(Amount::Count(2)), 1), 2);
    assert_eq!(allowance(None, 100), 0);
    assert!(check_reason("bad deploy").is_ok());
    assert_eq!(check_reason(""), Err("range"));
    assert_eq!(check_reason("a\u{1b}[31m"), Err("control_character"));
}

fn amount_strategy() -> impl Strategy<Value = Amount> {
    prop_oneof![
        (1u32..=50).prop_map(Amount::Count),
        (1u32..=100).prop_map(Amount::Percent),
    ]
}

proptest! {
    #[test]
    fn each_node_is_in_one_wave_first_then_byte_order(
        n in 0usize..80,
        steps in prop::collection::vec(amount_strategy(), 0..6),
        first in prop::collection::btree_set(0usize..100, 0..5),
        staged in any::<bool>(),
    ) {
        let nodes = names(n);
        let policy = Policy {
            waves: steps.clone(),
            first: first.iter().map(|i| format!("web-{i}")).collect(),
            ..Policy::default()
        };
        let staging = if staged { Staging::Staged } else { Staging::OneWave };
        let waves = plan(&nodes, &policy, staging);
        let flat: Vec<String> = waves.iter().flatten().cloned().collect();
        // Each node once.
        let set: BTreeSet<&String> = flat.iter().collect();
        prop_assert_eq!(set.len(), n);
        prop_assert_eq!(flat.len(), n);
        prop_assert!(waves.iter().all(|w| !w.is_empty()));
        // `first`'s nodes first, in its order; the rest in byte order.
        let firsts: Vec<String> = policy.first.iter().filter(|f| nodes.contains(f)).cloned().collect();
        prop_assert_eq!(&flat[..firsts.len()], &firsts[..]);
        let rest = &flat[firsts.len()..];
        prop_assert!(rest.windows(2).all(|w| w[0] < w[1]));
        // Staged: each target of the policy is a wave's end, when above the one before.
        if staged && n > 0 {
            let mut ends = Vec::new();
            let mut done = 0;
            for w in &waves { done += w.len(); ends.push(done); }
            let mut highest = 0;
            for a in &steps {
                let t = target(*a, n);
                // A target not above an earlier one is dropped; the rest end waves.
                prop_assert!(t <= highest || ends.contains(&t), "{t} of {ends:?}");
                highest = highest.max(t);
            }
            prop_assert_eq!(*ends.last().unwrap(), n);
        } else {
            prop_assert!(waves.len() <= 1);
        }
    }
}

/// One random step of the world around a rollout.
#[derive(Debug, Clone)]
enum Step {
    /// Do what `next` asks, succeeding or failing.
    Follow {
        ok: bool,
        healthy: bool,
    },
    Pause,
    Resume,
    Abort,
    Freeze(bool),
    Cancel,
    Time(i64),
}

fn step_strategy() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (any::<bool>(), any::<bool>()).prop_map(|(ok, healthy)| Step::Follow { ok: ok || healthy, healthy }),
        1 => Just(Step::Pause),
        1 => Just(Step::Resume),
        1 => Just(Step::Abort),
        1 => any::<bool>().prop_map(Step::Freeze),
        1 => (0i64..20_000).prop_map(Step::Time),
        1 => Just(Step::Cancel),
    ]
}

/// The event that doing `next` gives, by the step's luck.
fn outcome_of(next: &Next, ok: bool, healthy: bool, now: Millis, r: &Rollout) -> Option<Event> {
    Some(match next {
        Next::Activate { wave, .. } if r.unanswered() != Some(*wave) => {
            Event::ActivateStarted { wave: *wave }
        }
        Next::Activate { wave, nodes } if ok => Event::Activated {
            wave: *wave,
            answers: nodes
                .iter()
                .map(|n| (n.clone(), healthy || n.len() % 2 == 0))
                .collect(),
        },
        Next::Activate { .. } => Event::ActivateFailed,
        Next::Gate { .. } if healthy => Event::GatePassed,
        Next::Gate { .. } => Event::GateFailed,
        Next::Hold(RolloutState::Waiting) if r.wait_until.is_some_and(|at| now >= at) => {
            Event::WaitOver
        }
        Next::Hold(RolloutState::Frozen) if r.state == RolloutState::Running => Event::FreezeHeld,
        Next::Hold(RolloutState::Frozen) => Event::FreezeLifted,
        Next::Hold(_) => return None,
        Next::Confirm { .. } if ok => Event::Confirmed,
        Next::Confirm { .. } => Event::ConfirmFailed,
        Next::Revert { wave, .. } => Event::Reverted { wave: *wave },
        Next::Done(_) => return None,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
    #[test]
    fn the_rollout_machine_holds_its_invariants(
        n in 0usize..12,
        steps in prop::collection::vec(amount_strategy(), 0..4),
        pause_after in prop::collection::btree_set(1u32..5, 0..3),
        wait in prop_oneof![Just(0u32), 1u32..30],
        world in prop::collection::vec(step_strategy(), 1..80),
    ) {
        let policy = Policy { waves: steps, pause_after, wait_seconds: wait, ..Policy::default() };
        let waves = plan(&names(n), &policy, Staging::Staged);
        let mut r = Rollout::new(waves, &policy, Staging::Staged);
        let (mut now, mut frozen) = (1_000i64, false);
        let mut activated: Vec<String> = Vec::new();
        for step in world {
            let next = r.next(frozen);
            // A revert names only nodes an activate named.
            if let Next::Revert { nodes, .. } = &next {
                prop_assert!(nodes.iter().all(|n| activated.contains(n)), "{nodes:?} / {activated:?}");
            }
            let event = match step {
                Step::Follow { ok, healthy } => outcome_of(&next, ok, healthy, now, &r),
                Step::Pause => Some(Event::PauseAsked),
                Step::Resume => Some(Event::Resumed),
                Step::Abort => Some(Event::AbortAsked),
                Step::Cancel => Some(Event::Cancelled),
                Step::Freeze(on) => { frozen = on; None }
                Step::Time(ms) => { now += ms; None }
            };
            let Some(event) = event else { continue };
            let before = r.clone();
            match r.apply(&event, now, frozen) {
                Ok(after) => {
                    // Never a wave after the first begins while a freeze holds.
                    if let Event::ActivateStarted { wave } = &event {
                        prop_assert!(!(frozen && *wave > 1), "wave {wave} while frozen: {before:?}");
                    }
                    for node in named_by(&event, &next) {
                        // Never a node activated twice in one rollout.
                        prop_assert!(!activated.contains(&node), "{node} twice: {before:?}");
                        activated.push(node);
                    }
                    // Finished is final.
                    if before.state == RolloutState::Finished {
                        prop_assert_eq!(&after, &before);
                    }
                    r = after;
                }
                // A refused event changes nothing.
                Err(Refused) => prop_assert_eq!(&r, &before),
            }
            // Pauses and aborts never both pending; a finished one has a result.
            prop_assert_eq!(r.state == RolloutState::Finished, r.result.is_some());
            prop_assert!(!(r.state == RolloutState::Aborting && r.abort.is_none()));
        }
    }
}

/// The nodes an applied event says an `activate` `new` was called for.
fn named_by(event: &Event, next: &Next) -> Vec<String> {
    match (event, next) {
        (Event::ActivateStarted { .. }, Next::Activate { nodes, .. }) => nodes.clone(),
        _ => vec![],
    }
}

#[test]
fn a_walk_through_pause_wait_freeze_and_confirm() {
    let policy = Policy::parse(&json!({"waves": [1], "pause_after": [1], "wait_seconds": 10}))
        .expect("valid");
    let mut r = Rollout::new(
        plan(&names(3), &policy, Staging::Staged),
        &policy,
        Staging::Staged,
    );
    let go =
        |r: &Rollout, e: Event, now: Millis, frozen: bool| r.apply(&e, now, frozen).expect("fits");
    let answers = |nodes: &[&str]| nodes.iter().map(|n| (n.to_string(), true)).collect();
    assert_eq!(
        r.next(false),
        Next::Activate {
            wave: 1,
            nodes: vec!["web-0".into()]
        }
    );
    r = go(&r, Event::ActivateStarted { wave: 1 }, 0, false);
    r = go(
        &r,
        Event::Activated {
            wave: 1,
            answers: answers(&["web-0"]),
        },
        0,
        false,
    );
    assert_eq!(
        r.next(false),
        Next::Gate {
            nodes: vec!["web-0".into()]
        }
    );
    r = go(&r, Event::GatePassed, 1, false);
    assert_eq!(
        (r.state, r.paused),
        (RolloutState::Paused, true),
        "paused by the policy, no wait"
    );
    assert_eq!(
        r.apply(&Event::Resumed, 2, true),
        Err(Refused),
        "no resume while frozen"
    );
    r = go(&r, Event::Resumed, 2, false);
    assert_eq!(
        r.next(false),
        Next::Gate {
            nodes: vec!["web-0".into()]
        },
        "the gate again"
    );
    r = go(&r, Event::GatePassed, 3, false);
    assert_eq!(
        r.next(true),
        Next::Hold(RolloutState::Frozen),
        "the next wave waits for the freeze"
    );
    r = go(&r, Event::FreezeHeld, 3, true);
    r = go(&r, Event::FreezeLifted, 4, false);
    r = go(&r, Event::GatePassed, 5, false);
    assert_eq!(
        r.next(false),
        Next::Activate {
            wave: 2,
            nodes: vec!["web-1".into(), "web-2".into()]
        }
    );
    r = go(&r, Event::ActivateStarted { wave: 2 }, 6, false);
    r = go(
        &r,
        Event::Activated {
            wave: 2,
            answers: answers(&["web-1", "web-2"]),
        },
        6,
        false,
    );
    r = go(&r, Event::GatePassed, 7, false);
    assert_eq!(r.next(false), Next::Confirm { nodes: names(3) });
    r = go(&r, Event::Confirmed, 8, false);
    assert_eq!(
        (r.state, r.result),
        (RolloutState::Finished, Some(RolloutOutcome::Succeeded))
    );
}

#[test]
fn an_abort_reverts_the_activated_waves_last_first() {
    let policy = Policy::parse(&json!({"waves": [1, 2]})).expect("valid");
    let mut r = Rollout::new(
        plan(&names(3), &policy, Staging::Staged),
        &policy,
        Staging::Staged,
    );
    for wave in 1..=2 {
        let Next::Activate { nodes, .. } = r.next(false) else {
            panic!("{r:?}")
        };
        let answers = nodes.iter().map(|n| (n.clone(), true)).collect();
        r = r
            .apply(&Event::ActivateStarted { wave }, 0, false)
            .expect("fits");
        r = r
            .apply(&Event::Activated { wave, answers }, 0, false)
            .expect("fits");
        if wave == 1 {
            r = r.apply(&Event::GatePassed, 0, false).expect("fits");
        }
    }
    r = r.apply(&Event::AbortAsked, 0, false).expect("fits");
    assert_eq!(
        r.next(false),
        Next::Revert {
            wave: 2,
            nodes: vec!["web-1".into()]
        }
    );
    r = r
        .apply(&Event::Reverted { wave: 2 }, 0, false)
        .expect("fits");
    assert_eq!(
        r.next(false),
        Next::Revert {
            wave: 1,
            nodes: vec!["web-0".into()]
        }
    );
    r = r
        .apply(&Event::Reverted { wave: 1 }, 0, false)
        .expect("fits");
    assert_eq!(
        (r.result, r.abort),
        (Some(RolloutOutcome::Aborted), Some(AbortBy::Action))
    );
    assert_eq!(r.apply(&Event::PauseAsked, 0, false), Err(Refused));
}
