use super::*;
use proptest::prelude::*;

#[test]
fn attempt_ids_name_their_build_and_fence_and_nothing_else_parses() {
    let build = 0x0192_3456_789a_7bcd_8ef0_1234_5678_9abc_u128;
    let id = attempt_id(build, 7);
    assert!(is_authority_id(&id), "{id}");
    assert_eq!(parse_attempt_id(&id), Some((build, 7)));
    for bad in [
        "",
        "att-",
        "att-xyz-1",
        &format!("{id}x"),
        &attempt_id(build, 0),
        "att-0192345678-01",
    ] {
        assert!(
            bad == attempt_id(build, 0) || parse_attempt_id(bad).is_none(),
            "{bad}"
        );
    }
    assert_eq!(parse_attempt_id(&id.replace("-7", "-07")), None);
}

#[test]
fn labels_and_operation_ids_follow_their_patterns() {
    assert_eq!(parse_labels("b,a,b").unwrap(), vec!["a", "b"]);
    assert_eq!(parse_labels("").unwrap(), Vec::<String>::new());
    assert!(parse_labels("a,,b").is_err());
    assert!(parse_labels("-a").is_err());
    assert!(parse_labels(&"x".repeat(64)).is_err());
    let many: Vec<String> = (0..33).map(|i| format!("l{i}")).collect();
    assert!(parse_labels(&many.join(",")).is_err());
    assert!(is_operation_id("0123456789abcdef"));
    assert!(!is_operation_id("0123456789abcde"));
    assert!(!is_operation_id("0123456789abcdef/"));
}

#[test]
fn progress_applies_only_what_is_above_applied_through_and_refuses_a_gap() {
    assert_eq!(new_items(0, &[1, 2, 3]), Ok(0..3));
    assert_eq!(new_items(2, &[1, 2, 3, 4]), Ok(2..4));
    assert_eq!(new_items(4, &[1, 2, 3, 4]), Ok(4..4));
    assert_eq!(new_items(2, &[4, 5]), Err(2));
    assert_eq!(new_items(2, &[3, 5]), Err(2));
    assert_eq!(new_items(0, &[0, 1]), Err(0));
    assert_eq!(new_items(9, &[]), Ok(0..0));
}

#[test]
fn the_authority_check_goes_incarnation_and_fence_then_lease_then_end() {
    let mut a = new_attempt(1, "d", "w", "incarnation-1", 0, 1_000, Some(5_000));
    let call = |fence, inc| Call {
        operation_id: "op-0000000000000001",
        fence,
        incarnation: inc,
    };
    assert_eq!(judge(&a, &call(1, "incarnation-1"), 1_000), Ok(()));
    assert_eq!(
        judge(&a, &call(2, "incarnation-1"), 1_000),
        Err(Stale::Authority)
    );
    assert_eq!(
        judge(&a, &call(1, "incarnation-2"), 1_000),
        Err(Stale::Authority)
    );
    assert_eq!(
        judge(&a, &call(1, "incarnation-1"), 6_000),
        Err(Stale::LeaseExpired)
    );
    // A stale fence is stale even after the lease passed.
    assert_eq!(
        judge(&a, &call(0, "incarnation-1"), 9_000),
        Err(Stale::Authority)
    );
    lose(&mut a, LossCause::TokenRevoked);
    assert_eq!(
        judge(&a, &call(1, "incarnation-1"), 1_000),
        Err(Stale::Authority)
    );
}

#[test]
fn a_replay_finds_the_same_body_and_refuses_another() {
    let mut a = new_attempt(1, "d", "w", "incarnation-1", 0, 0, Some(5_000));
    keep_reply(&mut a, "renew", "op-1", "d1", "{}".into());
    assert_eq!(replay(&a, "renew", "op-1", "d1"), Replay::Same("{}"));
    assert_eq!(replay(&a, "renew", "op-1", "d2"), Replay::Conflict);
    assert_eq!(replay(&a, "progress", "op-1", "d1"), Replay::New);
    for i in 0..KEPT_REPLIES {
        keep_reply(&mut a, "renew", &format!("op-{}", i + 2), "d", "{}".into());
    }
    assert_eq!(a.replies.len(), KEPT_REPLIES);
    assert_eq!(replay(&a, "renew", "op-1", "d1"), Replay::New);
}

/// One build's life as the engine drives it: the same rules, in the same
/// order, over records held in memory.
#[derive(Clone, Debug, PartialEq)]
struct World {
    status: BuildStatus,
    attempts: Vec<AttemptRecord>,
    now: Millis,
    /// (fence, seq) of every progress item applied.
    log: Vec<(u64, u64)>,
}

const TTL: u64 = 5_000;

#[derive(Clone, Debug)]
enum Op {
    Claim {
        incarnation: u8,
    },
    /// A call by the `who`-th attempt ever made (or a forged one).
    Renew {
        who: usize,
        misnamed: bool,
    },
    Progress {
        who: usize,
        first: u64,
        len: u64,
    },
    Outcome {
        who: usize,
    },
    Advance {
        ms: i64,
    },
    Sweep,
    Restart,
    /// A rollout's build whose attempt was lost between calls becomes
    /// claimable again (workers.md "Hand-over between calls").
    HandOver,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..3).prop_map(|incarnation| Op::Claim { incarnation }),
        (0usize..4, any::<bool>()).prop_map(|(who, misnamed)| Op::Renew { who, misnamed }),
        (0usize..4, 0u64..8, 0u64..4).prop_map(|(who, first, len)| Op::Progress {
            who,
            first,
            len
        }),
        (0usize..4).prop_map(|who| Op::Outcome { who }),
        (0i64..4_000).prop_map(|ms| Op::Advance { ms }),
        Just(Op::Sweep),
        Just(Op::Restart),
        Just(Op::HandOver),
    ]
}

impl World {
    fn current(&mut self) -> Option<&mut AttemptRecord> {
        self.attempts.last_mut()
    }

    /// Returns whether the call was accepted. The call carries the
    /// authority of the `who`-th attempt; it names that attempt's id, or
    /// (`misnamed`) the newest attempt's, as a confused or forged call would.
    fn call(
        &mut self,
        who: usize,
        misnamed: bool,
        f: impl FnOnce(&mut World, usize) -> bool,
    ) -> bool {
        let Some(a) = self.attempts.get(who) else {
            return false;
        };
        let (fence, inc) = (a.fence, a.incarnation.clone());
        let call = Call {
            operation_id: "op-0000000000000001",
            fence,
            incarnation: &inc,
        };
        let named = if misnamed {
            self.attempts.len() - 1
        } else {
            who
        };
        match judge(&self.attempts[named], &call, self.now) {
            Ok(()) => f(self, named),
            Err(Stale::LeaseExpired) => {
                // Lost now, as the sweep would.
                if self.attempts[named].state == AttemptState::Active {
                    lose(&mut self.attempts[named], LossCause::LeaseExpired);
                    self.status = BuildStatus::Failed;
                }
                false
            }
            Err(Stale::Authority) => false,
        }
    }

    /// Whether the `who`-th attempt is the authoritative one.
    fn authoritative(&self, who: usize) -> bool {
        who + 1 == self.attempts.len()
            && self.attempts[who].state == AttemptState::Active
            && !lease_passed(&self.attempts[who], self.now)
    }

    fn apply(&mut self, op: &Op) -> bool {
        match *op {
            Op::Claim { incarnation } => {
                let held = usize::from(
                    self.attempts
                        .iter()
                        .any(|a| a.state == AttemptState::Active),
                );
                let scene = ClaimScene {
                    status: self.status,
                    claimable: true,
                    required: &[],
                    offered: &[],
                    held,
                    handed_over: false,
                };
                if claim_refusal(&scene).is_some() {
                    return false;
                }
                let last = self.attempts.last().map_or(0, |a| a.fence);
                let a = new_attempt(
                    1,
                    "d",
                    "w",
                    &format!("incarnation-{incarnation}"),
                    last,
                    self.now,
                    Some(TTL),
                );
                self.attempts.push(a);
                self.status = BuildStatus::Running;
                true
            }
            Op::Renew { who, misnamed } => self.call(who, misnamed, |w, i| {
                let now = w.now;
                renew(&mut w.attempts[i], now, TTL);
                true
            }),
            Op::Progress { who, first, len } => self.call(who, false, |w, i| {
                let seqs: Vec<u64> = (first..first + len).collect();
                match new_items(w.attempts[i].applied_through, &seqs) {
                    Ok(range) => {
                        let fence = w.attempts[i].fence;
                        w.log.extend(seqs[range].iter().map(|s| (fence, *s)));
                        if let Some(&last) = seqs.last() {
                            w.attempts[i].applied_through = w.attempts[i].applied_through.max(last);
                        }
                        true
                    }
                    Err(_) => false,
                }
            }),
            Op::Outcome { who } => self.call(who, false, |w, i| {
                w.attempts[i].state = AttemptState::Ended;
                w.status = BuildStatus::Succeeded;
                true
            }),
            Op::Advance { ms } => {
                self.now += ms;
                true
            }
            Op::Sweep => {
                let now = self.now;
                let mut lost = false;
                if let Some(a) = self.current() {
                    if a.state == AttemptState::Active && lease_passed(a, now) {
                        lose(a, LossCause::LeaseExpired);
                        lost = true;
                    }
                }
                if lost {
                    self.status = BuildStatus::Failed;
                }
                lost
            }
            Op::Restart => {
                let now = self.now;
                for a in &mut self.attempts {
                    restart(a, now, TTL);
                }
                true
            }
            Op::HandOver => {
                let lost = self
                    .attempts
                    .last()
                    .is_some_and(|a| a.state == AttemptState::Lost);
                if lost && self.status == BuildStatus::Failed {
                    self.status = BuildStatus::Queued;
                    return true;
                }
                false
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// No two authoritative attempts, fences only grow, a refused call
    /// changes nothing, and every progress seq lands once, in order.
    #[test]
    fn the_attempt_state_machine_holds_its_invariants(ops in proptest::collection::vec(op(), 1..60)) {
        let mut w = World { status: BuildStatus::Queued, attempts: vec![], now: 0, log: vec![] };
        for op in &ops {
            let before = w.clone();
            let caller = match *op {
                Op::Renew { who, .. } | Op::Progress { who, .. } | Op::Outcome { who } => Some(who),
                _ => None,
            };
            let accepted = w.apply(op);
            if let (Some(who), true) = (caller, accepted) {
                prop_assert!(before.authoritative(who), "{op:?} accepted from an attempt without authority");
            }
            let active = w.attempts.iter().filter(|a| a.state == AttemptState::Active).count();
            prop_assert!(active <= 1, "two authoritative attempts after {op:?}");
            prop_assert!(w.attempts.windows(2).all(|p| p[1].fence > p[0].fence));
            if !accepted {
                // A refusal may only lose an expired attempt (and fail its build).
                let mut expected = before.clone();
                for (a, b) in expected.attempts.iter_mut().zip(&w.attempts) {
                    if a.state == AttemptState::Active && b.state == AttemptState::Lost {
                        prop_assert!(lease_passed(a, w.now));
                        a.state = AttemptState::Lost;
                        a.lost_by = Some(LossCause::LeaseExpired);
                        expected.status = BuildStatus::Failed;
                    }
                }
                prop_assert_eq!(&expected, &w, "a refused {:?} changed state", op);
            }
            if w.status != BuildStatus::Running {
                prop_assert_eq!(active, 0);
            }
            for a in &w.attempts {
                let seqs: Vec<u64> = w.log.iter().filter(|(f, _)| *f == a.fence).map(|(_, s)| *s).collect();
                let expected: Vec<u64> = (1..=seqs.len() as u64).collect();
                prop_assert_eq!(&seqs, &expected, "attempt {}'s items", a.fence);
            }
        }
    }
}
