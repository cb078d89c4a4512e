//! A full disk (storage.md): the mutation that hits it answers 503 and
//! stores nothing, reads keep working, and berth recovers by itself when
//! space returns. Runs on a small tmpfs (needs root, as CI has).

use std::process::Command;

use serde_json::json;

use crate::harness::*;

pub struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// `dir`/data as a tmpfs of `size`: only the data dir is small, the
/// server's own log stays writable. `None` (the test says skipped) where
/// a tmpfs cannot be mounted.
pub fn small_data_dir(test: &str, dir: &std::path::Path, size: &str) -> Option<Mount> {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(&data)
        .status();
    if !mounted.is_ok_and(|s| s.success()) {
        skip(test, "cannot mount a tmpfs here (needs root)");
        return None;
    }
    Some(Mount(data))
}

/// With the store held alone (the default, a redo log): the commits a
/// failed checkpoint could not write stay in the log, the reopen that
/// follows writes nothing to the store file, so reads go on; and a restart
/// on the full disk is ready with every acknowledged write.
#[tokio::test]
async fn a_full_disk_refuses_writes_keeps_reads_and_recovers() {
    full_disk(
        "disk::a_full_disk_refuses_writes_keeps_reads_and_recovers",
        Mode::HeldAlone,
    )
    .await
}

/// The same with a shared store: every commit is redb's own.
#[tokio::test]
async fn a_full_disk_under_a_shared_store_refuses_writes_keeps_reads_and_recovers() {
    full_disk(
        "disk::a_full_disk_under_a_shared_store_refuses_writes_keeps_reads_and_recovers",
        Mode::Shared,
    )
    .await
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `berth serve`'s default.
    HeldAlone,
    /// `--shared-store`.
    Shared,
}

impl Mode {
    fn options(self) -> Options {
        match self {
            Mode::HeldAlone => Options::default(),
            Mode::Shared => Options::default().arg("--shared-store"),
        }
    }
}

async fn full_disk(test: &str, mode: Mode) {
    let dir = temp_dir("disk");
    // 8 MiB, of which the filler takes all but ~2.5 MB: the disk fills
    // after a few submits, and once the filler goes there is room for
    // every build stored meanwhile to run to its end (with 4 MiB and a
    // 1.5 MB filler, builds' logs could fill it again under load).
    let Some(_mount) = small_data_dir(test, &dir, "8m") else {
        return;
    };
    let data = dir.join("data");
    let filler = data.join("filler");
    std::fs::write(&filler, vec![0u8; 1_500_000 + (4 << 20)]).unwrap();
    let options = mode
        .options()
        .arg("--eval-slots")
        .arg("0")
        .arg("--build-slots")
        .arg("1");
    let mut s = Server::start_in(dir.clone(), options).await;
    let pad = "x".repeat(60_000);
    let (mut stored, mut refused_full) = (0, 0);
    for i in 0..200 {
        let (status, body) = s
            .submit(
                &format!("d{i}"),
                json!({"configuration": {"pad": pad}, "mode": "enqueue"}),
            )
            .await;
        match status {
            202 => stored += 1,
            503 => {
                assert_eq!(body["code"], "unavailable", "{body}");
                if body["reason"] == "disk_full" {
                    refused_full += 1;
                }
                if refused_full >= 3 {
                    break;
                }
            }
            other => panic!("a full disk must answer 503, not {other}: {body}"),
        }
    }
    assert!(refused_full > 0, "the disk never filled");
    // Reads keep working, and only what was acknowledged is there.
    let (status, list) = s.json("/v1/deployments?limit=200").await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["items"].as_array().unwrap().len(), stored);
    if mode == Mode::HeldAlone {
        // Past a checkpoint's retry (they fail on this disk), and again
        // after a kill -9 and a start on the full disk.
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        let (status, list) = s.json("/v1/deployments?limit=200").await;
        assert_eq!(status, 200, "{list}");
        assert_eq!(list["items"].as_array().unwrap().len(), stored);
        // A start on the full disk: the log's reserve takes the recovery
        // of the interrupted build, so berth is ready, with every
        // acknowledged write, and still refuses new ones.
        s.kill();
        s.launch().await;
        let (status, list) = s.json("/v1/deployments?limit=200").await;
        assert_eq!(status, 200, "{list}");
        assert_eq!(list["items"].as_array().unwrap().len(), stored);
        let (status, body) = s
            .submit(
                "refused",
                json!({"configuration": {"pad": pad}, "mode": "enqueue"}),
            )
            .await;
        assert_eq!(
            (status, &body["reason"]),
            (503, &json!("disk_full")),
            "{body}"
        );
    }
    // Space returns: writes work again, without a restart.
    std::fs::remove_file(&filler).unwrap();
    eventually("writes work again", || async {
        s.submit("after", json!({"configuration": {}, "mode": "enqueue"}))
            .await
            .0
            == 202
    })
    .await;
    let (_, list) = s.json("/v1/deployments?limit=200").await;
    assert_eq!(list["items"].as_array().unwrap().len(), stored + 1);
    // Nothing is left `running` without a job: every build ends.
    eventually("every build finishes", || async {
        let (_, list) = s.json("/v1/deployments?limit=200").await;
        let mut all_final = true;
        for d in list["items"].as_array().unwrap() {
            let (_, builds) = s
                .json(&format!(
                    "/v1/deployments/{}/builds",
                    d["id"].as_str().unwrap()
                ))
                .await;
            for b in builds["items"].as_array().unwrap() {
                all_final &= matches!(
                    b["status"].as_str(),
                    Some("succeeded" | "failed" | "cancelled")
                );
            }
        }
        all_final
    })
    .await;
}

/// A log that fills the disk mid-build: the build fails with `disk_full`,
/// and what was stored of its log is a whole prefix, with no gap, even
/// though chunks compress and commit two at a time.
/// (The build's chunks fill the redo log's records; its final commit lands
/// in the log's reserve.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_that_fills_the_disk_fails_its_build_and_keeps_a_whole_prefix() {
    log_fills_disk(
        "disk::a_log_that_fills_the_disk_fails_its_build_and_keeps_a_whole_prefix",
        Mode::HeldAlone,
    )
    .await
}

/// The same with a shared store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_that_fills_the_disk_under_a_shared_store_fails_its_build_and_keeps_a_whole_prefix() {
    log_fills_disk(
        "disk::a_log_that_fills_the_disk_under_a_shared_store_fails_its_build_and_keeps_a_whole_prefix",
        Mode::Shared,
    )
    .await
}

async fn log_fills_disk(test: &str, mode: Mode) {
    let dir = temp_dir("disk-log");
    let Some(_mount) = small_data_dir(test, &dir, "8m") else {
        return;
    };
    let data = dir.join("data");
    let filler = data.join("filler");
    std::fs::write(&filler, vec![0u8; 3_000_000]).unwrap();
    // ~42 MB of hex dump that compresses about 2.5x: far past the space
    // left. Each line starts with its offset: 16 more than the line before.
    let deployer = script(
        &dir,
        "noisy.sh",
        &format!(
            "{SCRIPT_PRELUDE}\nhead -c 12000000 /dev/urandom | od -Ad -tx1 -w16 -v\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"\n"
        ),
    );
    let s = Server::start_in(dir.clone(), mode.options().deployer(&deployer)).await;
    let b = s.submit_ok("noisy", json!({})).await;
    let build = s.wait_build(&b, "failed").await;
    assert_eq!(build["failure"]["reason"], "disk_full", "{build}");
    std::fs::remove_file(&filler).unwrap();
    let log = s.log_text(&b).await;
    assert_eq!(log.len() as u64, build["log_bytes"].as_u64().unwrap());
    let lines: Vec<&str> = log.lines().collect();
    let dump: Vec<&str> = lines
        .iter()
        .copied()
        .take_while(|l| !l.starts_with("[berth]"))
        .collect();
    assert!(
        !dump.is_empty() && dump.len() < 750_000,
        "{} lines",
        dump.len()
    );
    for (i, line) in dump.iter().enumerate() {
        let offset: u64 = line.split_whitespace().next().unwrap().parse().unwrap();
        assert_eq!(offset, i as u64 * 16, "line {i} is not the next line");
        assert_eq!(line.split_whitespace().count(), 17, "line {i} is cut");
    }
}

/// A store held alone on a disk with less room than the redo log's 16 MiB
/// of preallocated zeros: berth starts anyway (the log grows as it is
/// written) and a kill -9 loses nothing acknowledged.
#[tokio::test]
async fn a_store_held_alone_starts_on_a_disk_too_small_for_its_log() {
    let dir = temp_dir("disk-small-log");
    let test = "disk::a_store_held_alone_starts_on_a_disk_too_small_for_its_log";
    let Some(_mount) = small_data_dir(test, &dir, "4m") else {
        return;
    };
    let mut s = Server::start_in(dir.clone(), Options::default()).await;
    let log = dir.join("data/berth.redo");
    let log_bytes = std::fs::metadata(&log).unwrap().len();
    assert!(
        log_bytes < 4 << 20,
        "a {log_bytes}-byte log on a 4 MiB disk"
    );
    let mut builds = Vec::new();
    for i in 0..3 {
        builds.push(s.submit_ok(&format!("small{i}"), json!({})).await);
    }
    s.kill();
    s.launch().await;
    for b in &builds {
        assert_eq!(s.json(&format!("/v1/builds/{b}")).await.0, 200, "{b}");
    }
}

/// A snapshot for a live reader needs room for what it copies: on a disk
/// with room for the audit tables but not for the whole store, `berth
/// audit verify` runs beside the server and `berth export` is refused with
/// why, leaving nothing behind.
#[tokio::test]
async fn a_snapshot_needs_room_for_its_own_copy_only() {
    let test = "disk::a_snapshot_needs_room_for_its_own_copy_only";
    let dir = temp_dir("disk-snapshot");
    let Some(_mount) = small_data_dir(test, &dir, "160m") else {
        return;
    };
    // ~16 MB of log that compresses little: the store grows past the
    // audit tables by far.
    let deployer = script(
        &dir,
        "loud.sh",
        &format!(
            "{SCRIPT_PRELUDE}\nhead -c 12000000 /dev/urandom | base64 -w 76\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"\n"
        ),
    );
    let s = Server::start_in(dir.clone(), Options::default().deployer(&deployer)).await;
    let b = s.submit_ok("loud", json!({})).await;
    s.wait_build(&b, "succeeded").await;
    let data = dir.join("data");
    // Past a checkpoint, so the file holds the log's chunks.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let store_bytes = std::fs::metadata(data.join("berth.redb")).unwrap().len();
    assert!(store_bytes > 10 << 20, "a {store_bytes}-byte store");
    // Leave free the 64 MiB a snapshot keeps to spare and half the store.
    let stats = nix::sys::statvfs::statvfs(&data).unwrap();
    let free = stats.blocks_available() * stats.fragment_size();
    let leave = (64 << 20) + store_bytes / 2;
    std::fs::write(data.join("filler"), vec![0u8; (free - leave) as usize]).unwrap();
    let (code, report) = verify_json(&data);
    assert_eq!(code, 0, "{report}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["export", "--data-dir"])
        .arg(&data)
        .arg("--to")
        .arg(format!("sqlite:{}", dir.join("out.sqlite").display()))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "an export without room for its copy: {said}"
    );
    assert!(
        said.contains("not enough free disk for a snapshot"),
        "{said}"
    );
    let left = snapshots_left(&data);
    assert!(left.is_empty(), "snapshots left behind: {left:?}");
}
