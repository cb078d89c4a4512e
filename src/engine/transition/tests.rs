//! The transition module against a real store: every legal and illegal
//! build status change, what each change does to the deployment, and a
//! property test over random interleavings of the engine's own write jobs
//! (submit, enqueue, cancel, delete, start, finish, restart).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::engine::build::{finish_tx, start_tx, Finished};
use crate::engine::recovery::recover_tx;
use crate::engine::refusal::Refusal;
use crate::engine::requests::{cancel_tx, delete_tx, submit_tx, Mode, SubmitRecord};
use crate::store::Lookup;
use crate::store::Store;

/// An audit record as the engine's own callers make it.
fn rec<O: crate::engine::audit::Audited>() -> crate::engine::audit::Record<O> {
    crate::engine::audit::Record::audit_only(crate::engine::audit::system_draft(
        "submit",
        None,
        crate::audit::AuditResult::Ok,
    ))
}

const ALL: [BuildStatus; 5] = [
    BuildStatus::Queued,
    BuildStatus::Running,
    BuildStatus::Succeeded,
    BuildStatus::Failed,
    BuildStatus::Cancelled,
];

#[test]
fn every_legal_and_illegal_build_status_change() {
    use BuildStatus::*;
    let legal = [
        (None, Queued),
        (Some(Queued), Running),
        (Some(Queued), Cancelled),
        (Some(Running), Succeeded),
        (Some(Running), Failed),
        (Some(Running), Cancelled),
    ];
    let froms = std::iter::once(None).chain(ALL.iter().copied().map(Some));
    let mut checked = 0;
    for from in froms {
        for to in ALL {
            let expected = legal.contains(&(from, to));
            assert_eq!(
                check(from, to).is_ok(),
                expected,
                "{from:?} -> {to:?} should be {}",
                if expected { "legal" } else { "illegal" }
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 30);
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "illegal build status change")]
fn an_illegal_change_asserts_in_debug_builds() {
    let _ = guard(Some(BuildStatus::Succeeded), BuildStatus::Running);
}

#[test]
#[cfg(not(debug_assertions))]
fn an_illegal_change_is_an_error_in_release_builds() {
    assert!(guard(Some(BuildStatus::Succeeded), BuildStatus::Running).is_err());
}

static STORES: AtomicUsize = AtomicUsize::new(0);

/// A fresh store in its own directory, removed on drop.
struct TempStore {
    store: Store,
    dir: std::path::PathBuf,
}

impl TempStore {
    fn new() -> TempStore {
        let n = STORES.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("berth-transition-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store = Store::open(&dir.join("berth.redb")).unwrap();
        TempStore { store, dir }
    }
}

impl Drop for TempStore {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn source() -> Source {
    source_of('a')
}

fn source_of(tag: char) -> Source {
    Source {
        url: "builtin:test".into(),
        rev: tag.to_string(),
        digest: format!("sha256:{}", tag.to_string().repeat(64)),
    }
}

fn submit_record(id: &str, mode: Mode) -> SubmitRecord {
    submit_record_of(id, mode, source())
}

fn submit_record_of(id: &str, mode: Mode, source: Source) -> SubmitRecord {
    SubmitRecord {
        id: id.into(),
        snapshot: Snapshot {
            configuration: "{}".into(),
            source,
        },
        method: "m".into(),
        domain: None,
        mode,
        update_policy: None,
        auto_rollback: None,
        max_queued: 100,
        rollout_policy: None,
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn end(status: BuildStatus) -> Arc<Finished> {
    Arc::new(Finished {
        end: match status {
            BuildStatus::Succeeded => End {
                status,
                failure: None,
                exit_code: Some(0),
            },
            BuildStatus::Cancelled => End::cancelled("cancelled while running"),
            _ => End::failed(
                FailureReason::ExitStatus,
                "the deployer exited with status 1",
            ),
        },
        nodes: vec![],
        last_chunk: None,
        late_frames: vec![],
        last_seq_used: 0,
        log_gaps: vec![],
        work_state: crate::engine::work_state::NewWorkState::Unchanged,
        keep_work_states: 3,
    })
}

#[test]
fn each_change_keeps_the_deployment_in_step() {
    let rt = runtime();
    let t = TempStore::new();
    let hub = Arc::new(Hub::default());
    rt.block_on(async {
        let store = &t.store;
        let h = hub.clone();
        let first = store
            .write(move |tx| submit_tx(tx, &h, &submit_record("d", Mode::Replace), &rec()))
            .await
            .unwrap()
            .unwrap();
        let d = store.read().unwrap().deployment("d").unwrap().unwrap();
        assert_eq!(
            (d.revision, d.pending_deploys, d.state()),
            (1, 1, DeploymentState::Building)
        );
        assert_eq!(d.last_build, Some(first.build.id));

        // A second submit queued behind, then cancelled while queued: it
        // never ran, so the deployment's state ignores it.
        let h = hub.clone();
        let second = store
            .write(move |tx| submit_tx(tx, &h, &submit_record("d", Mode::Enqueue), &rec()))
            .await
            .unwrap()
            .unwrap();
        let h = hub.clone();
        let taken = store
            .write(move |tx| cancel_tx(tx, &h, second.build.id, &rec()))
            .await
            .unwrap()
            .unwrap();
        assert!(!taken.was_running);
        let d = store.read().unwrap().deployment("d").unwrap().unwrap();
        assert_eq!((d.revision, d.pending_deploys), (3, 1));
        assert!(
            d.last_finished.is_none(),
            "a build cancelled while queued is not the last finished"
        );

        let h = hub.clone();
        let (running, snaps) = store
            .write(move |tx| start_tx(tx, &h, first.build.id, "local-test"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(running.status, BuildStatus::Running);
        assert!(snaps.previous.is_none());
        assert_eq!(running.log_first_seq, running.event_seq + 1);
        let d = store.read().unwrap().deployment("d").unwrap().unwrap();
        assert_eq!((d.revision, d.running), (4, Some(first.build.id)));

        let h = hub.clone();
        let id = first.build.id;
        store
            .write(move |tx| finish_tx(tx, &h, id, &end(BuildStatus::Succeeded)))
            .await
            .unwrap();
        let d = store.read().unwrap().deployment("d").unwrap().unwrap();
        assert_eq!((d.revision, d.running, d.pending_deploys), (5, None, 0));
        assert_eq!(d.state(), DeploymentState::Active);
        assert_eq!(d.deployed.as_ref().map(|x| x.build_id), Some(id));

        // A destroy with a callback: armed when it succeeds; the deployment
        // is no longer deployed nor suspended.
        let h = hub.clone();
        let destroy = store
            .write(move |tx| delete_tx(tx, &h, "d", Some("http://127.0.0.1:1/cb".into()), &rec()))
            .await
            .unwrap()
            .unwrap();
        let h = hub.clone();
        store
            .write(move |tx| start_tx(tx, &h, destroy.build_id, "local-test"))
            .await
            .unwrap()
            .unwrap();
        let h = hub.clone();
        store
            .write(move |tx| finish_tx(tx, &h, destroy.build_id, &end(BuildStatus::Succeeded)))
            .await
            .unwrap();
        let rx = store.read().unwrap();
        let d = rx.deployment("d").unwrap().unwrap();
        assert!(d.deployed.is_none() && !d.suspended);
        assert_eq!(d.state(), DeploymentState::Idle);
        let callbacks = rx.callbacks().unwrap();
        assert_eq!(callbacks.len(), 1);
        assert!(
            callbacks[0].1.armed,
            "a successful destroy arms its callback"
        );

        // A finished build cannot be cancelled; nothing is written.
        let h = hub.clone();
        let refused = store
            .write(move |tx| cancel_tx(tx, &h, id, &rec()))
            .await
            .unwrap();
        assert!(matches!(refused, Err(Refusal::Conflict(_))));
        assert_eq!(
            store
                .read()
                .unwrap()
                .deployment("d")
                .unwrap()
                .unwrap()
                .revision,
            d.revision
        );
    });
}

/// One step of the engine, as its write jobs see it.
#[derive(Debug, Clone)]
enum Op {
    Submit {
        deployment: u8,
        enqueue: bool,
        newer: bool,
    },
    Rollback {
        deployment: u8,
    },
    Delete {
        deployment: u8,
    },
    Cancel {
        pick: u8,
    },
    Start,
    Finish {
        pick: u8,
        status: u8,
    },
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, any::<bool>(), any::<bool>()).prop_map(|(deployment, enqueue, newer)| Op::Submit { deployment, enqueue, newer }),
        2 => (0u8..3).prop_map(|deployment| Op::Rollback { deployment }),
        1 => (0u8..3).prop_map(|deployment| Op::Delete { deployment }),
        2 => any::<u8>().prop_map(|pick| Op::Cancel { pick }),
        3 => Just(Op::Start),
        3 => (any::<u8>(), 0u8..3).prop_map(|(pick, status)| Op::Finish { pick, status }),
        1 => Just(Op::Restart),
    ]
}

const DEPLOYMENTS: [&str; 3] = ["alpha", "beta", "gamma"];

/// Runs the ops against a real store through the engine's write jobs;
/// returns every build id created.
async fn run_ops(store: &Store, hub: &Arc<Hub>, ops: &[Op]) -> Vec<BuildId> {
    let mut builds: Vec<BuildId> = Vec::new();
    for op in ops {
        let h = hub.clone();
        match op.clone() {
            Op::Submit {
                deployment,
                enqueue,
                newer,
            } => {
                let mode = if enqueue {
                    Mode::Enqueue
                } else {
                    Mode::Replace
                };
                let id = DEPLOYMENTS[deployment as usize];
                let source = source_of(if newer { 'b' } else { 'a' });
                let r = store
                    .write(move |tx| {
                        submit_tx(tx, &h, &submit_record_of(id, mode, source.clone()), &rec())
                    })
                    .await
                    .unwrap();
                if let Ok(s) = r {
                    builds.push(s.build.id);
                }
            }
            Op::Rollback { deployment } => {
                use crate::engine::actions::{act_tx, ActionCall, Checked, Named};
                let id = DEPLOYMENTS[deployment as usize];
                let digest = store
                    .read()
                    .unwrap()
                    .deployment(id)
                    .unwrap()
                    .and_then(|d| d.deployed)
                    .map(|x| x.snapshot.source.digest);
                let call = ActionCall {
                    name: "rollback".into(),
                    if_match: None,
                    target: None,
                };
                let _ = store
                    .write(move |tx| {
                        let checked = Checked {
                            named: Named::Rollback,
                            described_digest: digest.clone(),
                            supported: true,
                        };
                        act_tx(tx, &h, id, &call, &checked, &rec())
                    })
                    .await
                    .unwrap();
            }
            Op::Delete { deployment } => {
                let id = DEPLOYMENTS[deployment as usize];
                let r = store
                    .write(move |tx| delete_tx(tx, &h, id, None, &rec()))
                    .await
                    .unwrap();
                if let Ok(q) = r {
                    builds.push(q.build_id);
                }
            }
            Op::Cancel { pick } => {
                if builds.is_empty() {
                    continue;
                }
                let id = builds[pick as usize % builds.len()];
                let _ = store
                    .write(move |tx| cancel_tx(tx, &h, id, &rec()))
                    .await
                    .unwrap();
            }
            Op::Start => {
                // The queue's rule: the oldest queued build of a deployment
                // with nothing running.
                let rx = store.read().unwrap();
                let next = rx.queued().unwrap().into_iter().find(|(_, dep)| {
                    rx.deployment(dep)
                        .unwrap()
                        .is_some_and(|d| d.running.is_none())
                });
                if let Some((id, _)) = next {
                    store
                        .write(move |tx| start_tx(tx, &h, id, "local-test"))
                        .await
                        .unwrap();
                }
            }
            Op::Finish { pick, status } => {
                let running = store.read().unwrap().running().unwrap();
                if running.is_empty() {
                    continue;
                }
                let (id, _) = running[pick as usize % running.len()].clone();
                let status = [
                    BuildStatus::Succeeded,
                    BuildStatus::Failed,
                    BuildStatus::Cancelled,
                ][status as usize];
                store
                    .write(move |tx| finish_tx(tx, &h, id, &end(status)))
                    .await
                    .unwrap();
            }
            Op::Restart => {
                for (id, _) in store.read().unwrap().running().unwrap() {
                    let h = hub.clone();
                    store
                        .write(move |tx| {
                            recover_tx(tx, &h, id, crate::engine::recovery::Start::Restart)
                        })
                        .await
                        .unwrap();
                }
            }
        }
    }
    builds
}

fn field<'a>(data: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    data.get(name).unwrap_or(&serde_json::Value::Null)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_interleavings_keep_every_status_sequence_legal(ops in proptest::collection::vec(op(), 1..40)) {
        let rt = runtime();
        let t = TempStore::new();
        let hub = Arc::new(Hub::default());
        rt.block_on(run_ops(&t.store, &hub, &ops));
        let rx = t.store.read().unwrap();
        // Every build stored, automatic rollbacks included.
        let builds: Vec<BuildId> = DEPLOYMENTS
            .iter()
            .flat_map(|name| rx.builds_of(name, None, 10_000).unwrap())
            .map(|b| b.id)
            .collect();
        // Never a rollback after a rollback: the build each automatic
        // rollback answers (its audit event's build) was not one.
        use crate::store::AuditLookup;
        let events: Vec<crate::audit::Event> = (1..=rx.audit_size().unwrap())
            .filter_map(|seq| rx.audit_event(seq).unwrap())
            .collect();
        for e in events.iter().filter(|e| e.action == "automatic_rollback") {
            let failed = e.build.as_deref().and_then(parse_build_id).expect("the failed build");
            let failed = rx.build(failed).unwrap().unwrap();
            prop_assert!(failed.rollback_of.is_none(), "a rollback was rolled back: {:?}", failed.id);
            prop_assert_eq!(failed.status, BuildStatus::Failed);
        }
        for id in &builds {
            let b = rx.build(*id).unwrap().unwrap();
            if b.trigger == Trigger::AutomaticRollback {
                prop_assert!(b.rollback_of.is_some());
            }
        }
        // The builds-by-status counts follow every change.
        let mut expected = [0u64; 5];
        for id in &builds {
            expected[rx.build(*id).unwrap().unwrap().status as usize] += 1;
        }
        prop_assert_eq!(rx.build_status_counts().unwrap(), expected);
        for id in &builds {
            let record = rx.build(*id).unwrap().unwrap();
            let mut previous = None;
            for (_, e) in rx.build_events(*id).unwrap() {
                prop_assert_eq!(e.event.as_str(), "status");
                let data: serde_json::Value = serde_json::from_str(&e.data).unwrap();
                let status = ALL
                    .into_iter()
                    .find(|s| field(&data, "status") == s.as_str())
                    .expect("a known status");
                prop_assert!(check(previous, status).is_ok(), "{:?} -> {:?}", previous, status);
                previous = Some(status);
            }
            prop_assert_eq!(previous, Some(record.status), "the record ends where its events end");
        }
        for name in DEPLOYMENTS {
            let Some(d) = rx.deployment(name).unwrap() else { continue };
            let mut last_revision = 0;
            for (_, e) in rx.deployment_events_after(name, 0, 100_000).unwrap() {
                if e.event != "deployment" {
                    continue;
                }
                let data: serde_json::Value = serde_json::from_str(&e.data).unwrap();
                let revision = field(&data, "revision").as_u64().unwrap();
                prop_assert!(revision > last_revision, "revision {} after {}", revision, last_revision);
                last_revision = revision;
            }
            prop_assert_eq!(last_revision, d.revision);
            // The counters the state is derived from match the builds.
            let mine: Vec<BuildRecord> = builds
                .iter()
                .filter_map(|id| rx.build(*id).unwrap())
                .filter(|b| b.deployment == name)
                .collect();
            let pending = |kind| {
                mine.iter()
                    .filter(|b| b.kind == kind && !b.status.is_finished())
                    .count() as u32
            };
            prop_assert_eq!(d.pending_deploys, pending(BuildKind::Deploy));
            prop_assert_eq!(d.pending_destroys, pending(BuildKind::Destroy));
            let running: Vec<BuildId> = mine
                .iter()
                .filter(|b| b.status == BuildStatus::Running)
                .map(|b| b.id)
                .collect();
            prop_assert!(running.len() <= 1, "two running builds of one deployment");
            prop_assert_eq!(d.running, running.first().copied());
            // A held-back source is never the deployed one (once nothing
            // of the deployment is pending).
            if let (Some(t), Some(deployed), false) = (rx.update_try(name).unwrap(), &d.deployed, d.has_pending_build()) {
                if t.result == TryResult::RolledBack && t.blocks {
                    prop_assert_ne!(&t.source, &deployed.snapshot.source, "{} holds back what it runs", name);
                }
            }
        }
    }
}
