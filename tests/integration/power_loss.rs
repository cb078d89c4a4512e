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
use crate::torture::{check_after_restart, spawn_clients, Rng};

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

/// A data dir on the power-loss file system and a cgroup for berth, or
/// `None` after saying (visibly) why this machine cannot run `test`.
fn rig(test: &str, tag: &str) -> Option<(std::path::PathBuf, PowerFs, Group)> {
    let dir = temp_dir(tag);
    let fs = mount_or_skip(test, &dir)?;
    match Group::create(tag) {
        Ok(group) => Some((dir, fs, group)),
        Err(why) => {
            skip(test, &why);
            None
        }
    }
}

/// The power goes: nothing reaches the disk from this instant, every
/// process of the group dies, the unsynced writes are dropped or torn.
fn power_cut(fs: &PowerFs, group: &Group, s: &mut Server, how: Cut) -> CutReport {
    fs.sever();
    group.kill_all();
    s.kill();
    fs.cut(how)
}

/// Drops what was not synced, or tears it, at random.
fn random_cut(rng: &mut Rng) -> Cut {
    if rng.below(2) == 0 {
        Cut::DropUnsynced
    } else {
        Cut::Torn(rng.next())
    }
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
    power_trials(Mode::Shared).await;
}

/// The same with the store held alone (the default): every commit
/// goes through the redo log (src/store/redo.rs), redb's own commits are
/// non-durable between checkpoints. The audit chain is verified once berth
/// stops (no other process may read such a store while it runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_cuts_with_the_redo_log_lose_nothing_acknowledged() {
    power_trials(Mode::Exclusive).await;
}

/// The same with every checkpoint held back 300 ms
/// (`redb.checkpoint=sleep(300)`, src/failpoints.rs), so most cuts land
/// while the redo log holds many batches that redb holds only in memory
/// (non-durable commits). The restart must replay them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_cuts_while_checkpoints_are_slow_lose_nothing_acknowledged() {
    if !cfg!(feature = "failpoints") {
        skip(
            "power_loss::slow_checkpoint",
            "built without `--features failpoints` (the README's test command has it)",
        );
        return;
    }
    power_trials(Mode::SlowCheckpoints).await;
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Shared,
    Exclusive,
    /// Held alone, with every checkpoint held back.
    SlowCheckpoints,
}

impl Mode {
    /// Whether berth holds the store alone (with its redo log).
    fn alone(self) -> bool {
        match self {
            Mode::Shared => false,
            Mode::Exclusive | Mode::SlowCheckpoints => true,
        }
    }
}

async fn power_trials(mode: Mode) {
    let trials = env_or("BERTH_POWER_TRIALS", 4);
    let seed = seed() ^ (mode as u64);
    let tag = match mode {
        Mode::Shared => "power",
        Mode::Exclusive => "power-redo",
        Mode::SlowCheckpoints => "power-slow-checkpoint",
    };
    let Some((dir, fs, group)) = rig(&format!("power_loss::{tag}"), tag) else {
        return;
    };
    eprintln!(
        "power loss ({mode:?} store): {trials} trials, seed {seed} (BERTH_TORTURE_SEED to replay)"
    );
    let mut rng = Rng(seed);
    let (sink, _sink_task) = json_server(Arc::new(|_body: Value| (200, json!({"ok": true})))).await;
    let mut options = Options::default()
        .env("BERTH_LOCAL_STEP_MS", "2")
        .group(&group);
    match mode {
        Mode::Shared => options = options.arg("--shared-store"),
        Mode::Exclusive => {}
        Mode::SlowCheckpoints => options = options.env("FAILPOINTS", "redb.checkpoint=sleep(300)"),
    }
    let mut s = Server::start_in(dir.clone(), options).await;
    let data = dir.join("data");
    let kept = read_kept(&data, 0);
    let mut pushed_floor = 0u64;
    let mut acknowledged = 0usize;
    let mut seen_builds: Vec<String> = Vec::new();
    let mut totals = CutReport::default();
    let mut trial = 0u64;
    while trial < trials || (acknowledged == 0 && trial < trials * 3) {
        trial += 1;
        let (log, builds, clients) = spawn_clients(&s, seed ^ (trial << 8), &seen_builds);
        // A push of the audit head, in the group: it dies with the power.
        let pushed: Arc<Mutex<Option<u64>>> = Arc::default();
        let push = (mode == Mode::Shared).then(|| {
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
        });
        let flowing = Instant::now();
        while flowing.elapsed() < Duration::from_secs(5)
            && !log.lock().unwrap().iter().any(|m| m.answer.is_some())
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
        // With the redo log, a third of the cuts tear one of its writes.
        let how = match (mode.alone(), rng.below(3)) {
            (true, 0) => Cut::TearOne {
                seed: rng.next(),
                file: "berth.redo",
            },
            _ => random_cut(&mut rng),
        };
        let report = power_cut(&fs, &group, &mut s, how);
        totals.dropped_changes += report.dropped_changes;
        totals.torn_writes += report.torn_writes;
        totals.lost_nodes += report.lost_nodes;
        for c in clients {
            let _ = c.await;
        }
        if let Some(push) = push {
            let _ = push.join();
        }
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
        if mode == Mode::Shared {
            verify(&data, trial);
        }
        let sent = log.lock().unwrap().clone();
        seen_builds = builds.lock().unwrap().clone();
        acknowledged += check_after_restart(&s, trial, &sent, &seen_builds)
            .await
            .len();
    }
    if mode.alone() {
        s.terminate();
        verify(&data, trial);
        s.launch().await;
    }
    let (file_syncs, dir_syncs) = fs.syncs();
    eprintln!(
        "power loss ({mode:?} store): {trial} trials, {acknowledged} acknowledged mutations, none lost; \
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
    let Some((dir, fs, group)) = rig("power_loss::first_start", "power-first") else {
        return;
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
        power_cut(&fs, &group, &mut s, random_cut(&mut rng));
        s.launch().await;
        read_kept(&data, n);
        // This file system has no Unix sockets, so a reader beside a
        // store held alone gets no snapshot: the chain is verified with
        // berth stopped (a clean stop checkpoints the redo log).
        assert!(s.terminate().success(), "trial {n}: a clean stop failed");
        verify(&data, n);
        s.launch().await;
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

/// A store damaged past what redb recovers (both commit slots of its
/// header overwritten): berth refuses to start, names the file, says how
/// to repair it, and changes nothing.
#[tokio::test]
async fn a_damaged_store_is_refused_with_the_file_and_the_repair() {
    let dir = temp_dir("damaged-store");
    let mut s = Server::start_in(dir.clone(), Options::default()).await;
    s.submit_ok("kept", json!({})).await;
    s.terminate();
    let db = dir.join("data/berth.redb");
    let mut bytes = std::fs::read(&db).unwrap();
    // redb's header: magic and flags, then two 128-byte commit slots.
    bytes[64..320].fill(0xa5);
    std::fs::write(&db, &bytes).unwrap();
    s.spawn();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = s.exited() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "berth started on a damaged store"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let said = s.log();
    assert!(!status.success());
    assert!(!said.contains("panicked"), "{said}");
    assert!(
        said.contains(db.to_str().unwrap()) && said.contains("berth import"),
        "{said}"
    );
    assert_eq!(
        std::fs::read(&db).unwrap(),
        bytes,
        "the refusal changed the file"
    );
}

/// A torn page in the store: cuts that keep half of one of the store's
/// unsynced page writes (and drop everything else unsynced). berth must
/// restart with everything acknowledged (the torture checks) or refuse
/// to start, naming the file and how to repair it; never a panic, never
/// a silently different state. With a shared store (`--shared-store`),
/// where every commit writes the file's pages (held alone, only a
/// checkpoint does, and the redo log's trials above cut those) and the
/// chain can be verified beside the running server on this file system.
#[tokio::test]
async fn a_torn_page_in_the_store_gives_the_synced_state_or_a_clear_refusal() {
    let cuts = env_or("BERTH_POWER_TORN_PAGES", 6);
    let seed = seed() ^ 0x7042;
    let Some((dir, fs, group)) = rig("power_loss::torn_page", "torn-page") else {
        return;
    };
    let mut rng = Rng(seed);
    let mut s = Server::start_in(
        dir.clone(),
        Options::default()
            .arg("--shared-store")
            .env("BERTH_LOCAL_STEP_MS", "2")
            .group(&group),
    )
    .await;
    let (mut torn, mut refused, mut acknowledged) = (0, 0, 0);
    let mut seen_builds: Vec<String> = Vec::new();
    for trial in 1..=cuts {
        let (log, builds, clients) = spawn_clients(&s, seed ^ (trial << 8), &seen_builds);
        tokio::time::sleep(Duration::from_millis(100 + rng.below(300))).await;
        let report = power_cut(
            &fs,
            &group,
            &mut s,
            Cut::TearOne {
                seed: rng.next(),
                file: "berth.redb",
            },
        );
        torn += report.torn_writes;
        for c in clients {
            let _ = c.await;
        }
        s.spawn();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::fs::read_to_string(dir.join("address")).is_err() {
            if let Some(status) = s.exited() {
                let said = s.log();
                assert!(!said.contains("panicked"), "trial {trial}: {said}");
                assert!(
                    said.contains("berth.redb") && said.contains("berth import"),
                    "trial {trial}: a refusal that does not name the file and the repair ({status}): {said}"
                );
                refused += 1;
                break;
            }
            assert!(
                Instant::now() < deadline,
                "trial {trial}: neither ready nor refused"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if s.exited().is_some() {
            // Refused: the next trial starts from an empty store.
            wipe(&dir.join("data"));
            s.launch().await;
            seen_builds.clear();
            continue;
        }
        s.wait_ready().await;
        verify(&dir.join("data"), trial);
        let sent = log.lock().unwrap().clone();
        seen_builds = builds.lock().unwrap().clone();
        acknowledged += check_after_restart(&s, trial, &sent, &seen_builds)
            .await
            .len();
    }
    eprintln!(
        "torn store pages: {cuts} cuts, {torn} page writes of berth.redb kept in half, \
         {refused} refused with the repair path, {acknowledged} acknowledged mutations kept"
    );
    s.kill();
}
