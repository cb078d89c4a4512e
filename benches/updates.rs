//! Update policies: one maintenance-window computation (pure), next to one
//! zone offset lookup; one automatic-update pass over 10,000 deployments,
//! next to a plain scan of the deployments table in the same store.
//! Run: `cargo bench --bench updates`.

mod common;

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use time::macros::datetime;
use time_tz::TimeZone;

use berth::engine::build::{finish_tx, start_tx, Finished};
use berth::engine::outcome::End;
use berth::engine::requests::{submit_tx, Mode, SubmitRecord};
use berth::engine::Engine;
use berth::model::*;
use berth::settings::{Cli, Command};
use berth::store::Store;
use berth::window::{zone, Window};

const DEPLOYMENTS: usize = 10_000;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn window_figures() {
    let w = Window::from_policy(&UpdatePolicy::Window {
        frequency: Frequency::Monthly,
        day: Some(31),
        start: "02:30".into(),
        duration_minutes: 120,
        time_zone: "Europe/Amsterdam".into(),
    })
    .unwrap()
    .unwrap();
    let tz = zone("Europe/Amsterdam").unwrap();
    let start = datetime!(2026-01-01 00:00 UTC);
    const N: i64 = 100_000;
    let mut window_ns = Vec::new();
    let mut lookup_ns = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        let mut open = 0;
        for i in 0..N {
            open += w.is_open(start + time::Duration::minutes(i * 7)) as u32;
        }
        window_ns.push(t.elapsed().as_nanos() as f64 / N as f64);
        std::hint::black_box(open);
        let t = Instant::now();
        let mut sum = 0i64;
        for i in 0..N {
            let off = tz.get_offset_utc(&(start + time::Duration::minutes(i * 7)));
            sum += time_tz::Offset::to_utc(&off).whole_seconds() as i64;
        }
        lookup_ns.push(t.elapsed().as_nanos() as f64 / N as f64);
        std::hint::black_box(sum);
    }
    let (w_ns, l_ns) = (median(window_ns), median(lookup_ns));
    println!(
        "window state (monthly, Europe/Amsterdam): {w_ns:.0} ns/call; one zone offset lookup: {l_ns:.0} ns; ratio {:.1}x",
        w_ns / l_ns
    );
}

fn main() {
    window_figures();
    let dir = std::env::temp_dir().join(format!("berth-bench-updates-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let pin = format!("url=builtin:modules,rev=b,digest=sha256:{}", "b".repeat(64));
    let cli = Cli::parse_from([
        "berth",
        "serve",
        "--data-dir",
        dir.to_str().unwrap(),
        "--default-source",
        &pin,
    ]);
    let Command::Serve(settings) = cli.command else {
        unreachable!("serve")
    };
    let rt = common::runtime();
    rt.block_on(async move {
        let store = Store::open(&dir.join("berth.redb")).unwrap();
        let engine = Engine::new(Arc::new(*settings), store.clone(), vec![0; 32]).unwrap();
        let hub = engine.hub.clone();
        let old = Source {
            url: "builtin:modules".into(),
            rev: "a".into(),
            digest: format!("sha256:{}", "a".repeat(64)),
        };
        // 10,000 active deployments on the old source, with a window policy
        // that is closed at the instant of the pass: every one is checked,
        // none is due, as on most ticks.
        let policy = UpdatePolicy::Window {
            frequency: Frequency::Weekly,
            day: Some(3),
            start: "03:00".into(),
            duration_minutes: 60,
            time_zone: "Europe/Amsterdam".into(),
        };
        for chunk in 0..(DEPLOYMENTS / 500) {
            let (hub, old, policy) = (hub.clone(), old.clone(), policy.clone());
            store
                .write(move |tx| {
                    for i in 0..500 {
                        let id = format!("d{:05}", chunk * 500 + i);
                        let record = SubmitRecord {
                            id: id.clone(),
                            snapshot: Snapshot {
                                configuration: r#"{"domain":"a.example.org"}"#.into(),
                                source: old.clone(),
                            },
                            method: "local".into(),
                            domain: Some("a.example.org".into()),
                            mode: Mode::Replace,
                            update_policy: Some(policy.clone()),
                            auto_rollback: None,
                            max_queued: 100,
                            rollout_policy: None,
                        };
                        let submitted = submit_tx(tx, &hub, &record, &berth::engine::audit::Record::audit_only(berth::engine::audit::system_draft("submit", None, berth::audit::AuditResult::Ok)))?.expect("stored");
                        start_tx(tx, &hub, submitted.build.id, "local-bench")?.expect("started");
                        let done = Arc::new(Finished {
                            end: End {
                                status: BuildStatus::Succeeded,
                                failure: None,
                                exit_code: Some(0),
                            },
                            nodes: vec![],
        last_chunk: None,
                            late_frames: vec![],
                            last_seq_used: 0,
                            log_gaps: vec![],
                            work_state: berth::engine::work_state::NewWorkState::Unchanged,
                            keep_work_states: 3,
                        });
                        finish_tx(tx, &hub, submitted.build.id, &done)?;
                    }
                    Ok(())
                })
                .await
                .unwrap();
        }
        // Monday 12:00 UTC: the Wednesday window is closed.
        let now = datetime!(2026-06-01 12:00 UTC);
        let mut pass_ms = Vec::new();
        let mut scan_ms = Vec::new();
        for _ in 0..7 {
            let t = Instant::now();
            let pass = engine.update_pass(now).await.unwrap();
            pass_ms.push(t.elapsed().as_secs_f64() * 1000.0);
            assert_eq!((pass.checked, pass.started), (DEPLOYMENTS, 0));
            let t = Instant::now();
            let rx = store.read().unwrap();
            let mut after: Option<String> = None;
            let mut n = 0;
            loop {
                let page = rx.deployments_after(after.as_deref(), 1000).unwrap();
                n += page.len();
                match page.last() {
                    Some(last) if page.len() == 1000 => after = Some(last.id.clone()),
                    _ => break,
                }
            }
            assert_eq!(n, DEPLOYMENTS);
            scan_ms.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let (p, s) = (median(pass_ms), median(scan_ms));
        println!(
            "update pass over {DEPLOYMENTS} deployments (none due): {p:.1} ms; scan of the deployments table: {s:.1} ms; ratio {:.2}x",
            p / s
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}
