//! Power cuts (storage.md "Power loss"): the torture trials' clients and
//! checks, with berth's data dir on the power-loss file system
//! (`powerfs.rs`). At a random instant the power goes: the file system
//! stops taking writes, every process berth started dies at once (its
//! cgroup), and whatever was not synced is dropped or torn. After each
//! restart: everything the torture trials check, `berth audit verify`
//! passes, the secrets and the signing key are the ones clients already
//! use, and a head `berth audit push-head` reported pushed is still there.
//! Some cuts land during a very first start, when the secrets are created.
//!
//! `cargo test` runs a few trials (`BERTH_POWER_TRIALS`, default 4, and
//! `BERTH_POWER_FIRST_STARTS`, default 4); `tools/torture --power-loss
//! [TRIALS] [SEED]` runs many.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::*;
use crate::powerfs::{mount_or_skip, Cut, CutReport, PowerFs};
use crate::torture::{check_after_restart, run_client, Rng};

/// The files clients and the audit chain rely on, which must never change
/// once berth answered with them.
const KEPT_FILES: [&str; 4] = [
    "service-token",
    "cursor-key",
    "callback-secret",
    "audit-signing.key",
];

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn seed() -> u64 {
    std::env::var("BERTH_TORTURE_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::process::id() as u64 * 6151 + 29)
}

/// Each kept file: there, whole (64 hex digits), as berth reads it.
fn read_kept(data: &std::path::Path, trial: u64) -> Vec<String> {
    KEPT_FILES
        .iter()
        .map(|name| {
            let text = std::fs::read_to_string(data.join(name))
                .unwrap_or_else(|e| panic!("trial {trial}: {name} after the cut: {e}"));
            let text = text.trim().to_string();
            assert!(
                text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()),
                "trial {trial}: {name} is not whole after the cut: {text:?}"
            );
            text
        })
        .collect()
}

/// The pushed head's size, if one was recorded (it must parse).
fn pushed_size(data: &std::path::Path, trial: u64) -> Option<u64> {
    let bytes = match std::fs::read(data.join("audit-pushed-head.json")) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("trial {trial}: the pushed head: {e}"),
    };
    let head: Value = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
        panic!(
            "trial {trial}: the pushed head is not whole: {:?}",
            String::from_utf8_lossy(&bytes)
        )
    });
    Some(
        head["size"]
            .as_u64()
            .unwrap_or_else(|| panic!("trial {trial}: a pushed head without a size: {head}")),
    )
}

/// The power goes: nothing reaches the disk from this instant, every
/// process of the group dies, the unsynced writes are dropped or torn.
fn power_cut(fs: &PowerFs, group: &Group, s: &mut Server, rng: &mut Rng) -> CutReport {
    fs.sever();
    group.kill_all();
    s.kill();
    let how = if rng.below(2) == 0 {
        Cut::DropUnsynced
    } else {
        Cut::Torn(rng.next())
    };
    fs.cut(how)
}

fn verify(data: &std::path::Path, trial: u64) {
    let (code, report) = berth(&[
        "audit",
        "verify",
        "--json",
        "--data-dir",
        data.to_str().expect("a UTF-8 temp path"),
    ]);
    assert_eq!(
        code, 0,
        "trial {trial}: audit verify after a power cut: {report}"
    );
}

// Multi-threaded: `berth audit push-head` blocks a thread while the sink
// answers on another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_cuts_at_random_instants_lose_nothing_acknowledged() {
    let trials = env_or("BERTH_POWER_TRIALS", 4);
    let seed = seed();
    let dir = temp_dir("power");
    let Some(fs) = mount_or_skip("power_loss::power_cuts", &dir) else {
        return;
    };
    let group = match Group::create("power") {
        Ok(g) => g,
        Err(why) => return skip("power_loss::power_cuts", &why),
    };
    eprintln!("power loss: {trials} trials, seed {seed} (BERTH_TORTURE_SEED to replay)");
    let mut rng = Rng(seed);
    let (sink, _sink_task) = json_server(Arc::new(|_body: Value| (200, json!({"ok": true})))).await;
    let mut s = Server::start_in(
        dir.clone(),
        Options::default()
            .env("BERTH_LOCAL_STEP_MS", "2")
            .group(&group),
    )
    .await;
    let data = dir.join("data");
    let kept = read_kept(&data, 0);
    let mut pushed_floor = 0u64;
    let mut acknowledged = 0usize;
    let mut seen_builds: Vec<String> = Vec::new();
    let mut totals = CutReport::default();
    let mut trial = 0u64;
    while trial < trials || (acknowledged == 0 && trial < trials * 3) {
        trial += 1;
        let log = Arc::new(Mutex::new(Vec::new()));
        let builds = Arc::new(Mutex::new(seen_builds.clone()));
        let clients: Vec<_> = (0..4)
            .map(|c| {
                tokio::spawn(run_client(
                    s.base.clone(),
                    s.token.clone(),
                    seed ^ (trial << 8) ^ c,
                    log.clone(),
                    builds.clone(),
                ))
            })
            .collect();
        // A push of the audit head, in the group: it dies with the power.
        let pushed: Arc<Mutex<Option<u64>>> = Arc::default();
        let push = {
            let (sink, data, pushed) = (sink.clone(), data.clone(), pushed.clone());
            let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_berth"));
            command
                .args(["audit", "push-head", "--sink", &sink, "--data-dir"])
                .arg(&data)
                .stdin(std::process::Stdio::null());
            group.enter(&mut command);
            let delay = Duration::from_millis(rng.below(300));
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                if let Ok(out) = command.output() {
                    let text = String::from_utf8_lossy(&out.stdout);
                    // "pushed head: size N, root ..."
                    let size = text
                        .split("size ")
                        .nth(1)
                        .and_then(|t| t.split(',').next())
                        .and_then(|n| n.trim().parse().ok());
                    if out.status.success() {
                        *pushed.lock().unwrap() = size;
                    }
                }
            })
        };
        let flowing = Instant::now();
        while flowing.elapsed() < Duration::from_secs(5)
            && !log.lock().unwrap().iter().any(|m| m.answer.is_some())
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
        let report = power_cut(&fs, &group, &mut s, &mut rng);
        totals.dropped_changes += report.dropped_changes;
        totals.torn_writes += report.torn_writes;
        totals.lost_nodes += report.lost_nodes;
        for c in clients {
            let _ = c.await;
        }
        let _ = push.join();
        if let Some(size) = *pushed.lock().unwrap() {
            pushed_floor = pushed_floor.max(size);
        }
        s.launch().await;
        assert_eq!(
            read_kept(&data, trial),
            kept,
            "trial {trial}: a secret or the signing key changed"
        );
        if pushed_floor > 0 {
            let size = pushed_size(&data, trial)
                .unwrap_or_else(|| panic!("trial {trial}: a pushed head is gone"));
            assert!(
                size >= pushed_floor,
                "trial {trial}: the pushed head went back from {pushed_floor} to {size}"
            );
        } else {
            let _ = pushed_size(&data, trial);
        }
        verify(&data, trial);
        let sent = log.lock().unwrap().clone();
        seen_builds = builds.lock().unwrap().clone();
        acknowledged += check_after_restart(&s, trial, &sent, &seen_builds)
            .await
            .len();
    }
    let (file_syncs, dir_syncs) = fs.syncs();
    eprintln!(
        "power loss: {trial} trials, {acknowledged} acknowledged mutations, none lost; \
         {} unsynced changes dropped, {} torn writes, {} files never durably named; \
         {file_syncs} file syncs, {dir_syncs} directory syncs; last pushed head {pushed_floor}",
        totals.dropped_changes, totals.torn_writes, totals.lost_nodes
    );
    assert!(
        acknowledged > 0,
        "no mutation was acknowledged: the trials checked nothing"
    );
    s.kill();
}

/// A cut during a very first start, at a random instant of it (the secrets,
/// the signing key and the store are being created): the next start must
/// work, with whole files, and nobody has to delete anything by hand.
#[tokio::test]
async fn a_power_cut_during_a_first_start_never_needs_a_hand() {
    let starts = env_or("BERTH_POWER_FIRST_STARTS", 4);
    let seed = seed() ^ 0x5eed;
    let dir = temp_dir("power-first");
    let Some(fs) = mount_or_skip("power_loss::first_start", &dir) else {
        return;
    };
    let group = match Group::create("power-first") {
        Ok(g) => g,
        Err(why) => return skip("power_loss::first_start", &why),
    };
    let mut rng = Rng(seed);
    let data = dir.join("data");
    let mut s = Server::start_in(dir.clone(), Options::default().group(&group)).await;
    // How long a first start takes here: the cuts land within it.
    let started = Instant::now();
    s.kill();
    wipe(&data);
    s.launch().await;
    let first_start = started.elapsed();
    let mut cut_before_ready = 0;
    for n in 1..=starts {
        s.kill();
        wipe(&data);
        let at = Duration::from_micros(rng.below(first_start.as_micros() as u64 + 1));
        s.spawn();
        tokio::time::sleep(at).await;
        let ready = std::fs::read_to_string(dir.join("address")).is_ok();
        if !ready {
            cut_before_ready += 1;
        }
        power_cut(&fs, &group, &mut s, &mut rng);
        s.launch().await;
        read_kept(&data, n);
        verify(&data, n);
        let b = s.submit_ok("first", mastodon("first.example.org")).await;
        s.wait_build(&b, "succeeded").await;
    }
    eprintln!(
        "power loss during a first start: {starts} cuts ({cut_before_ready} before it listened) \
         within {first_start:?}, every next start ready"
    );
    s.kill();
}

/// Empties the data dir, durably (a new machine).
fn wipe(data: &std::path::Path) {
    for entry in std::fs::read_dir(data).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            std::fs::remove_dir_all(&path).unwrap();
        } else {
            std::fs::remove_file(&path).unwrap();
        }
    }
    std::fs::File::open(data).unwrap().sync_all().unwrap();
}
