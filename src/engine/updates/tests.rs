//! `due` with injected instants: every condition of lifecycle.md "Update
//! policies", and window policies open and closed.

use time::macros::datetime;

use super::*;

fn source(tag: char) -> Source {
    Source {
        url: "builtin:test".into(),
        rev: tag.to_string(),
        digest: format!("sha256:{}", tag.to_string().repeat(64)),
    }
}

fn active(policy: UpdatePolicy) -> DeploymentRecord {
    let snapshot = Snapshot {
        configuration: "{}".into(),
        source: source('a'),
    };
    DeploymentRecord {
        id: "d".into(),
        revision: 2,
        suspended: false,
        method: "local".into(),
        domain: None,
        snapshot: snapshot.clone(),
        update_policy: policy,
        deployed: Some(Deployed {
            build_id: 1,
            snapshot,
            method: "local".into(),
            finished_at: 1,
            nodes: vec![],
        }),
        last_build: Some(1),
        last_finished: Some(LastFinished {
            build_id: 1,
            kind: BuildKind::Deploy,
            status: BuildStatus::Succeeded,
        }),
        pending_deploys: 0,
        pending_destroys: 0,
        running: None,
        event_seq: 3,
        created_at: 1,
        updated_at: 1,
        auto_rollback: true,
    }
}

fn tried(tag: char, blocks: bool) -> UpdateTry {
    UpdateTry {
        at: 1,
        source: source(tag),
        build_id: Some(2),
        result: TryResult::Failed,
        reason: Some("exit_status".into()),
        blocks,
    }
}

const NOW: OffsetDateTime = datetime!(2026-06-01 12:00 UTC);

#[test]
fn automatic_is_due_only_when_every_condition_holds() {
    let new = source('b');
    let d = active(UpdatePolicy::Automatic);
    assert!(due(&d, None, Some(&new), NOW));
    assert!(!due(&d, None, None, NOW), "no self-pinned default source");
    assert!(
        !due(&d, None, Some(&source('a')), NOW),
        "already on the default source"
    );
    assert!(
        !due(&active(UpdatePolicy::Manual), None, Some(&new), NOW),
        "manual"
    );

    let mut suspended = d.clone();
    suspended.suspended = true;
    assert!(!due(&suspended, None, Some(&new), NOW));
    let mut queued = d.clone();
    queued.pending_deploys = 1;
    assert!(!due(&queued, None, Some(&new), NOW), "something queued");
    let mut failed = d.clone();
    failed.last_finished = Some(LastFinished {
        build_id: 2,
        kind: BuildKind::Deploy,
        status: BuildStatus::Failed,
    });
    assert!(!due(&failed, None, Some(&new), NOW), "not active");
    let mut never = d.clone();
    never.deployed = None;
    assert!(!due(&never, None, Some(&new), NOW), "nothing deployed");

    // One try per default source per policy.
    assert!(!due(&d, Some(&tried('b', true)), Some(&new), NOW));
    assert!(
        due(&d, Some(&tried('b', false)), Some(&new), NOW),
        "a new policy tries again"
    );
    assert!(
        due(&d, Some(&tried('c', true)), Some(&new), NOW),
        "another source was tried"
    );
}

#[test]
fn a_window_policy_is_due_only_while_its_window_is_open() {
    let new = source('b');
    let window = |start: &str| {
        active(UpdatePolicy::Window {
            frequency: Frequency::Daily,
            day: None,
            start: start.into(),
            duration_minutes: 60,
            time_zone: "Europe/Amsterdam".into(),
        })
    };
    // 12:00 UTC is 14:00 in Amsterdam in June.
    assert!(due(&window("13:30"), None, Some(&new), NOW));
    assert!(!due(&window("15:00"), None, Some(&new), NOW));
    assert!(
        !due(&window("12:30"), None, Some(&new), NOW),
        "closed at 13:30 local"
    );
    assert!(due(
        &window("15:00"),
        None,
        Some(&new),
        datetime!(2026-06-01 13:10 UTC)
    ));
}
