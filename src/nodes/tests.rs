use super::*;
use serde_json::json;

const DIGEST_A: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const DIGEST_B: &str = "sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

fn file(digest: &str) -> Artifact {
    Artifact {
        kind: ArtifactKind::File,
        id: digest.into(),
        size: Some(3),
        url: None,
    }
}

fn report(incarnation: &str, running: Option<Artifact>, generation: u64) -> NodeReport {
    let body = json!({
        "operation_id": "op-0123456789abcdef",
        "fence": 0,
        "worker_incarnation": incarnation,
        "generation": generation,
        "running": running.map(|a| artifact_json(&a, None)),
        "booted": null,
        "health": {"healthy": true, "reason": null},
        "last_error": null,
        "agent_version": "0.1.0",
        "uptime_s": 5,
        "report_interval_ms": 1000,
    });
    parse_report(body.as_object().unwrap(), "web-1", 1_000)
        .unwrap()
        .report
}

fn steady_node(generation: u64, want: &str) -> NodeRecord {
    let mut n = NodeRecord::new("alice", "web");
    n.generation = generation;
    n.desired = steady(&n, Some(&file(want)), 7, 0);
    n
}

#[test]
fn a_report_round_trips_its_artifacts_and_refuses_bad_fields_by_pointer() {
    let r = report("incarnation-a", Some(file(DIGEST_A)), 2);
    assert_eq!(r.running, Some(file(DIGEST_A)));
    assert_eq!(r.token, "web-1");
    let mut body = json!({"operation_id": "short"});
    let e = parse_report(body.as_object().unwrap(), "t", 0)
        .err()
        .unwrap();
    assert_eq!(e.pointer, "/operation_id");
    body = json!({"operation_id": "op-0123456789abcdef", "worker_incarnation": "incarnation-a",
        "agent_version": "1", "report_interval_ms": 1000, "generation": 0, "fence": 0, "uptime_s": 0,
        "running": {"kind": "file", "digest": "sha256:XYZ"}});
    let e = parse_report(body.as_object().unwrap(), "t", 0)
        .err()
        .unwrap();
    assert_eq!(e.pointer, "/running/digest");
    assert!(is_store_path("/nix/store/abc-nixos-system-web"));
    assert!(!is_store_path("/nix/store/../etc/passwd"));
    assert!(!is_store_path("/etc/passwd"));
}

#[test]
fn only_uptime_changes_nothing() {
    let a = report("incarnation-a", Some(file(DIGEST_A)), 1);
    let mut b = a.clone();
    b.uptime_s += 60;
    b.reported_at += 60_000;
    assert!(!report_changes(Some(&a), &b));
    b.running = Some(file(DIGEST_B));
    assert!(report_changes(Some(&a), &b));
    assert!(report_changes(None, &a));
}

#[test]
fn drift_is_judged_only_against_a_seen_steady_document_and_keeps_its_start() {
    let mut n = steady_node(3, DIGEST_A);
    n.actual = Some(report("incarnation-a", Some(file(DIGEST_A)), 3));
    assert_eq!(drift(&n, 10), None, "running what is desired");
    n.actual = Some(report("incarnation-a", Some(file(DIGEST_B)), 2));
    assert_eq!(drift(&n, 10), None, "a report of an older document");
    n.actual = Some(report("incarnation-a", Some(file(DIGEST_B)), 3));
    let d = drift(&n, 10).unwrap();
    assert_eq!((d.since, d.what.clone()), (10, vec!["running".to_string()]));
    n.drift = Some(d);
    assert_eq!(drift(&n, 99).unwrap().since, 10, "the start is kept");
    n.actual = Some(report("incarnation-a", None, 3));
    assert!(
        drift(&n, 10).is_some(),
        "running nothing where something is desired"
    );
    let mut booted = report("incarnation-a", Some(file(DIGEST_A)), 3);
    booted.booted = Some(file(DIGEST_B));
    n.actual = Some(booted);
    assert_eq!(drift(&n, 10).unwrap().what, vec!["booted".to_string()]);
}

#[test]
fn two_incarnations_in_turn_are_a_duplicate_until_one_reports_alone_for_three_intervals() {
    let a = report("incarnation-a", None, 0);
    let b = report("incarnation-b", None, 0);
    let s = Seen::report(None, &a, 0);
    let s = Seen::report(Some(&s), &b, 100);
    assert!(!s.duplicate, "a new incarnation alone is a restart");
    let s = Seen::report(Some(&s), &a, 200);
    assert!(s.duplicate, "A, B, A");
    let s = Seen::report(Some(&s), &a, 1_000);
    assert!(s.duplicate);
    let s = Seen::report(Some(&s), &a, 200 + 3_000);
    assert!(!s.duplicate, "A alone for three intervals");
}

#[test]
fn an_agent_silent_for_three_intervals_is_unreachable_and_a_restart_counts_as_seen() {
    let r = report("incarnation-a", None, 0);
    let s = Seen::report(None, &r, 0);
    assert_eq!(
        AgentStatus::of(Some(&s), None, 0, 3_000),
        AgentStatus::Reporting
    );
    assert_eq!(
        AgentStatus::of(Some(&s), None, 0, 3_001),
        AgentStatus::Unreachable
    );
    assert_eq!(
        AgentStatus::of(None, Some(&r), 50_000, 52_000),
        AgentStatus::Reporting
    );
    assert_eq!(
        AgentStatus::of(None, None, 0, 0),
        AgentStatus::NeverReported
    );
}

#[test]
fn a_steady_document_changes_only_when_its_artifact_does() {
    let n = steady_node(1, DIGEST_A);
    assert_eq!(steady(&n, Some(&file(DIGEST_A)), 8, 1), None);
    assert!(steady(&n, Some(&file(DIGEST_B)), 8, 1).is_some());
    assert!(steady(&n, None, 8, 1).is_some());
    let doc = document(
        &n,
        DocumentTimes {
            lease_ttl_ms: 1,
            revert_after_ms: 2,
            health_interval_ms: 3,
        },
    );
    assert_eq!(
        doc["artifact"]["url"],
        json!(artifact_url("alice", "web", DIGEST_A))
    );
    assert_eq!(doc["phase"], json!("steady"));
}
