//! The redo log of a store held alone (`berth serve`'s default,
//! src/store/redo.rs): a commit is one append to `berth.redo` and one
//! sync; redb's own commits are non-durable until a checkpoint. After a
//! kill -9 the next start applies the log; until then a reader of the file
//! alone refuses (it would see less than was acknowledged), and an import
//! refuses to replace such a store; after a clean stop the file alone holds
//! everything.

use serde_json::json;

use crate::harness::*;

fn redo_len(s: &Server) -> u64 {
    std::fs::metadata(s.dir.join("data/berth.redo"))
        .map(|m| m.len())
        .unwrap_or(0)
}

/// Enqueues one build for each of `count` deployments named
/// `prefix-0`, `prefix-1`, ..., `pause` apart; their build ids, in order.
async fn enqueue_one_each(
    s: &Server,
    prefix: &str,
    count: usize,
    pause: std::time::Duration,
) -> Vec<String> {
    let mut builds = Vec::new();
    for i in 0..count {
        let (status, body) = s
            .submit(
                &format!("{prefix}-{i}"),
                json!({"configuration": {}, "mode": "enqueue"}),
            )
            .await;
        assert_eq!(status, 202, "{body}");
        builds.push(body["build_id"].as_str().unwrap().to_string());
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
    builds
}

#[tokio::test]
async fn after_a_kill_the_redo_log_is_applied_and_readers_wait_for_it() {
    // No checkpoint before the kill: every submit's rows are only in the log.
    let mut s = Server::start(Options::default().arg("--checkpoint-interval").arg("60s")).await;
    let builds = enqueue_one_each(&s, "redo", 5, std::time::Duration::ZERO).await;
    s.kill();
    let data = s.dir.join("data");
    assert!(
        redo_len(&s) > 0,
        "the submits' rows are not in the redo log"
    );
    // The file alone is behind what was answered: readers say so. (redb
    // itself already refuses a file not closed cleanly; the redo log's own
    // check backs it up.)
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["audit", "verify", "--data-dir"])
        .arg(&data)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "verify read a store whose redo log holds rows"
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("start `berth serve`"), "{said}");
    // An import must not replace it as if it were empty.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["import", "--data-dir"])
        .arg(&data)
        .arg("--from")
        .arg(format!("sqlite:{}", s.dir.join("none.sqlite").display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("berth.redo"), "{said}");
    s.launch().await;
    assert!(
        s.log()
            .contains("applied the redo log's acknowledged writes"),
        "{}",
        s.log()
    );
    for b in &builds {
        let (status, _) = s.json(&format!("/v1/builds/{b}")).await;
        assert_eq!(status, 200, "acknowledged build {b} is gone");
    }
    // A clean stop: the file alone holds everything (verify would refuse
    // a log with rows the file lacks), and the log never grew past the
    // bytes it was made with (its syncs write no file size).
    assert!(s.terminate().success());
    assert_eq!(
        redo_len(&s),
        berth::store::redo::PREALLOCATED_BYTES,
        "the redo log grew"
    );
    let (code, report) = verify_json(&data);
    assert_eq!(code, 0, "{report}");
    assert!(report["size"].as_u64().unwrap() >= 5, "{report}");
}

#[tokio::test]
async fn a_store_moves_between_the_two_modes_with_nothing_lost() {
    // Held alone first, killed with rows only in the log; then opened
    // shared: the shared start applies them too.
    let mut s = Server::start(Options::default()).await;
    let b = s.submit_ok("moved", json!({})).await;
    s.kill();
    s.args.push("--shared-store".into());
    s.launch().await;
    let (status, _) = s.json(&format!("/v1/builds/{b}")).await;
    assert_eq!(status, 200);
    // The shared start applied the log: a reader of the live file finds no
    // rows it lacks.
    let data = s.dir.join("data");
    let (code, report) = berth(&["audit", "verify", "--data-dir", data.to_str().unwrap()]);
    assert_eq!(code, 0, "{report}");
    let b2 = s.submit_ok("moved", json!({})).await;
    s.kill();
    s.args.retain(|a| a != "--shared-store");
    s.launch().await;
    for id in [&b, &b2] {
        let (status, _) = s.json(&format!("/v1/builds/{id}")).await;
        assert_eq!(status, 200);
    }
}

/// The snapshot socket of a store held alone (src/store/snapshot.rs), in
/// a directory only berth's user may enter: a request that is not one gets
/// an error line and makes no file; a reader that goes away before its
/// answer leaves no snapshot behind; a good request gets a file in that
/// directory.
#[tokio::test]
async fn the_snapshot_socket_refuses_bad_requests_and_cleans_up_after_readers_that_leave() {
    use std::io::{BufRead, Read, Write};
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::net::UnixStream;
    let s = Server::start(Options::default()).await;
    s.submit_ok("snap", json!({})).await;
    let dir = s.dir.join("data/snapshots");
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "{mode:o}");
    let socket = dir.join("berth.sock");
    let too_long = format!("snapshot {}\n", "a".repeat(200));
    for bad in [
        "hello\n",
        "snapshot everything\n",
        &too_long,
        "snapshot audit",
    ] {
        let mut c = UnixStream::connect(&socket).unwrap();
        c.write_all(bad.as_bytes()).unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        let mut answer = String::new();
        c.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("error "), "{bad:?}: {answer}");
    }
    // Readers that ask and leave at once.
    for _ in 0..3 {
        let mut c = UnixStream::connect(&socket).unwrap();
        c.write_all(b"snapshot all\n").unwrap();
    }
    let c = UnixStream::connect(&socket).unwrap();
    (&c).write_all(b"snapshot audit\n").unwrap();
    let mut answer = String::new();
    std::io::BufReader::new(&c).read_line(&mut answer).unwrap();
    let name = answer
        .trim_end()
        .strip_prefix("ok ")
        .unwrap_or_else(|| panic!("{answer}"));
    assert!(dir.join(name).is_file(), "{name}");
    std::fs::remove_file(dir.join(name)).unwrap();
    // The readers that left are served by threads of their own, their
    // copies one at a time: each copy is removed once its answer fails.
    let left = || -> Vec<String> {
        std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    };
    eventually("the snapshots of readers that left are removed", || async {
        left() == vec!["berth.sock".to_string()]
    })
    .await;
}

/// The store's page cache is bounded by `--cache-size`: a build that
/// writes ~97 MB of log that compresses little (a store of ~135 MiB),
/// read back whole twice, grows berth by less than half the store. (With
/// redb's own default of 1 GiB every page written or read stayed in
/// memory: +92 MiB for a 68 MiB store, against +44 MiB with a 4 MiB
/// cache, whose growth is the ingest's buffers and the rows kept for
/// readers until a checkpoint, the same for any store size.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_within_the_cache_size_as_the_store_grows() {
    let dir = temp_dir("cache-size");
    let deployer = script(
        &dir,
        "loud.sh",
        &format!(
            "{SCRIPT_PRELUDE}\nhead -c 80000000 /dev/urandom | base64 -w 76\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"\n"
        ),
    );
    let cache_mib = 4;
    // 80 MB of random bytes make ~108 MB of log lines, which keep the
    // store file past 100 MiB however redb reuses its freed pages (72 MB
    // once left it at exactly 100 MiB in a full run of the suite).
    let s = Server::start_in(
        dir.clone(),
        Options::default()
            .deployer(&deployer)
            .arg("--cache-size")
            .arg(&format!("{cache_mib}MiB")),
    )
    .await;
    let before = s.rss_kib();
    let b = s.submit_ok("loud", json!({})).await;
    let end = s.wait_build(&b, "succeeded").await;
    let log_bytes = end["log_bytes"].as_u64().unwrap();
    assert!(log_bytes > 90_000_000, "{end}");
    for _ in 0..2 {
        let r = s.get(&format!("/v1/builds/{b}/log")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let read = r.bytes().await.unwrap().len() as u64;
        assert_eq!(read, log_bytes);
    }
    let store_mib = std::fs::metadata(dir.join("data/berth.redb"))
        .unwrap()
        .len()
        >> 20;
    assert!(store_mib > 100, "a {store_mib} MiB store");
    let after = s.rss_kib();
    let grown_mib = after.saturating_sub(before) / 1024;
    println!(
        "RSS with --cache-size {cache_mib}MiB and a {store_mib} MiB store: {before} KiB before, {after} KiB after (+{grown_mib} MiB)"
    );
    assert!(
        grown_mib < store_mib / 2,
        "berth grew by {grown_mib} MiB with a {cache_mib} MiB cache and a {store_mib} MiB store"
    );
}

/// A start after kill -9 loads the allocator state redb saved at the last
/// checkpoint (src/store/behind.rs, "Quick repair") instead of reading the
/// whole store file to rebuild it: the log says nothing of a full repair,
/// and every acknowledged submit is there, before and after that
/// checkpoint.
#[tokio::test]
async fn a_start_after_a_kill_needs_no_full_repair_of_the_store_file() {
    let mut s = Server::start(Options::default()).await;
    // Checkpoints (50 ms apart at most) fall between the submits.
    let builds = enqueue_one_each(&s, "quick", 10, std::time::Duration::from_millis(30)).await;
    s.kill();
    s.launch().await;
    let log = s.log();
    assert!(
        !log.contains(berth::store::FULL_REPAIR_WARNING),
        "a start after kill -9 read the whole store file to repair it:\n{log}"
    );
    for b in &builds {
        let (status, _) = s.json(&format!("/v1/builds/{b}")).await;
        assert_eq!(status, 200, "acknowledged build {b} is gone");
    }
}
