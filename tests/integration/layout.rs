//! Layout versions (storage.md): a store written by the release before the
//! current layout opens with this binary, migrates, and reads back exactly
//! as that release read it; a store newer than the binary is refused with
//! both versions named.
//!
//! `tests/data/store-v1` holds a store written by the last release of
//! layout version 1 and that release's answers to every read below
//! (`reads.json`); `tests/data/store-v8-crashed` the same of a berth of
//! layout 8 killed with most rows still in its redo log (`berth.redo`),
//! and `tests/data/store-v9-crashed` the same of a berth of layout 9.
//! `tools/make-store-fixture` is the command that made them, and says how.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::harness::*;

fn fixture_named(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// A data dir holding a copy of the fixture store (never the file itself:
/// opening it migrates it).
fn data_dir_with_fixture(tag: &str) -> PathBuf {
    data_dir_with(tag, "store-v1")
}

/// A data dir holding a copy of the fixture `name`: its store, and its
/// redo log if it has one.
fn data_dir_with(tag: &str, name: &str) -> PathBuf {
    let dir = temp_dir(tag);
    std::fs::create_dir_all(dir.join("data")).unwrap();
    for file in ["berth.redb", "berth.redo"] {
        let from = fixture_named(name).join(file);
        if from.exists() {
            std::fs::copy(from, dir.join("data").join(file)).unwrap();
        }
    }
    dir
}

/// The names of the tables in the store file at `path`.
fn tables_in(path: &Path) -> Vec<String> {
    let db = redb::Database::open(path).unwrap();
    let txn = redb::ReadableDatabase::begin_read(&db).unwrap();
    let mut names: Vec<String> = txn
        .list_tables()
        .unwrap()
        .map(|t| redb::TableHandle::name(&t).to_string())
        .collect();
    names.sort();
    names
}

/// `new` holds everything `old` held, equal: members added by a later
/// layout (`rollback_of`, `auto_rollback`, ...) are allowed, nothing the
/// older release answered may change or go.
fn assert_contains(new: &Value, old: &Value, at: &str) {
    match (new, old) {
        (Value::Object(n), Value::Object(o)) => {
            for (k, v) in o {
                let got = n
                    .get(k)
                    .unwrap_or_else(|| panic!("{at}: member {k} is gone"));
                assert_contains(got, v, &format!("{at}/{k}"));
            }
        }
        // A list may grow at its end (the `actions` list gained `rollback`),
        // never lose or change what it had.
        (Value::Array(n), Value::Array(o)) => {
            assert!(n.len() >= o.len(), "{at}: items are gone");
            for (i, (n, o)) in n.iter().zip(o).enumerate() {
                assert_contains(n, o, &format!("{at}/{i}"));
            }
        }
        _ => assert_eq!(new, old, "{at} reads back differently"),
    }
}

#[tokio::test]
async fn a_store_of_the_previous_layout_migrates_and_reads_back_equal() {
    migrates_and_reads_back_equal(
        "store-v1",
        &[
            "index every build's log chunks",
            "index idempotency records by expiry",
            "count builds by status",
            "file each deployment's builds, events and audit index in one table",
        ],
    )
    .await;
}

/// A berth of layout 8 killed with its rows in its redo log: this berth
/// applies that log (written at the layout before its own) to the file
/// first, then migrates it, and every read answers as that berth did.
#[tokio::test]
async fn a_store_of_layout_8_killed_with_rows_in_its_redo_log_applies_them_then_migrates() {
    crashed_store_migrates(
        "store-v8-crashed",
        8,
        "file each deployment's builds, events and audit index in one table",
    )
    .await;
}

/// A berth of layout 9 killed with its rows in its redo log, the audit
/// tree's small subtrees among them: this berth applies the log to the
/// file while the file is still at layout 9, then the step to 10 drops
/// those subtrees, and every read and every inclusion proof answers as
/// before (the unit test `store::redo` covers the rule; this is a real
/// berth's log, made by `tools/make-store-fixture`).
#[tokio::test]
async fn a_store_of_layout_9_killed_with_rows_in_its_redo_log_applies_them_then_migrates() {
    crashed_store_migrates(
        "store-v9-crashed",
        9,
        "keep only the audit tree's subtrees of 8 events and up",
    )
    .await;
}

/// The fixture `name`, a store of `layout` killed with rows in its redo
/// log: the log is applied, then `first_step` migrates the file, and
/// every read answers as before (`migrates_and_reads_back_equal`).
async fn crashed_store_migrates(name: &str, layout: u32, first_step: &str) {
    let redo = fixture_named(name).join("berth.redo");
    assert!(
        std::fs::metadata(&redo).unwrap().len() > 4096,
        "the fixture's redo log holds records"
    );
    assert_eq!(
        recorded_layout(&fixture_named(name).join("berth.redb")),
        layout,
        "the fixture is a layout-{layout} file"
    );
    migrates_and_reads_back_equal(
        name,
        &["applied the redo log's acknowledged writes", first_step],
    )
    .await;
}

/// The reads the berth that wrote fixture `name` answered.
fn recorded_reads(name: &str) -> Vec<Value> {
    let reads: Vec<Value> = serde_json::from_str(
        &std::fs::read_to_string(fixture_named(name).join("reads.json"))
            .unwrap_or_else(|e| panic!("tests/data/{name}/reads.json: {e}")),
    )
    .unwrap();
    assert!(reads.len() > 20, "the fixture records its reads");
    reads
}

/// Every read in `reads` answers on `s` as it did when recorded.
async fn reads_back_equal(s: &Server, reads: &[Value]) {
    let mut compared = 0;
    for read in reads {
        let path = read["path"].as_str().unwrap();
        let r = s.get(path).send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        assert_eq!(Some(status as u64), read["status"].as_u64(), "GET {path}");
        let body = match read["kind"].as_str() {
            Some("json") => serde_json::from_str(&text).unwrap(),
            _ => Value::String(text),
        };
        assert_contains(&body, &read["body"], &format!("GET {path}"));
        compared += 1;
    }
    assert_eq!(compared, reads.len());
}

/// `berth audit verify` of the stopped store in `dir` passes.
fn audit_verifies(dir: &Path) {
    let verify = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["audit", "verify", "--data-dir"])
        .arg(dir.join("data"))
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "{}",
        String::from_utf8_lossy(&verify.stdout)
    );
}

/// Every kept event's inclusion proof at the chain's size verifies against
/// the root `berth audit verify --json` computes from the events (read
/// from the running server's store, through its snapshot).
async fn audit_proofs_verify(s: &Server) {
    let out = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["audit", "verify", "--json", "--data-dir"])
        .arg(s.dir.join("data"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let size = report["size"].as_u64().unwrap();
    let root = crate::audit::hash(report["merkle_root"].as_str().unwrap());
    assert!(size >= 8, "the fixture has a subtree of 8 to prove through");
    for seq in 1..=size {
        let (status, p) = s
            .json(&format!("/v1/audit/proof?seq={seq}&size={size}"))
            .await;
        assert_eq!(status, 200, "{p}");
        assert_eq!(
            crate::audit::inclusion_verifies(&p, seq, size),
            root,
            "seq {seq}"
        );
    }
}

/// The layout version the store file at `path` records.
fn recorded_layout(path: &Path) -> u32 {
    use berth::store::tables::META;
    // Opened as a copy: an open writes the file (a killed one is
    // repaired, which a read-only open refuses), and a committed fixture
    // must stay as committed.
    let copy = temp_dir("recorded-layout").join("berth.redb");
    std::fs::copy(path, &copy).unwrap();
    let db = redb::Database::open(&copy).unwrap();
    let txn = redb::ReadableDatabase::begin_read(&db).unwrap();
    let meta = txn.open_table(META).unwrap();
    let v = meta
        .get("schema_version")
        .unwrap()
        .unwrap()
        .value()
        .to_vec();
    u32::from_le_bytes(v.try_into().unwrap())
}

/// Opens a copy of the fixture `name`, checks the log names each of
/// `steps` (migrations, the redo log applied), then every read the fixture
/// recorded, the audit chain, the file's tables, and a restart.
async fn migrates_and_reads_back_equal(name: &str, steps: &[&str]) {
    let reads = recorded_reads(name);
    let dir = data_dir_with(&format!("layout-{name}"), name);
    let mut s = Server::start_in(dir.clone(), Options::default()).await;
    let log = s.log();
    for step in steps {
        assert!(log.contains(step), "no step {step:?} at open:\n{log}");
    }
    reads_back_equal(&s, &reads).await;
    // The migrated store is whole: the chain verifies, and a restart
    // migrates nothing again.
    let status = s.terminate();
    assert!(status.success(), "{}", s.log());
    audit_verifies(&dir);
    // The tables layout 9 replaced are gone from the file.
    let tables = tables_in(&dir.join("data/berth.redb"));
    for gone in [
        "deployment_builds",
        "deployment_events",
        "audit_by_deployment",
    ] {
        assert!(
            !tables.contains(&gone.to_string()),
            "{gone} is still in {tables:?}"
        );
    }
    assert!(
        tables.contains(&"deployment_rows".to_string()),
        "{tables:?}"
    );
    // Layout 10 keeps the audit tree's subtrees of 8 events and up (the
    // fixtures never pruned, so no smaller one has a reason to stay).
    let db = redb::Database::open(dir.join("data/berth.redb")).unwrap();
    let levels: Vec<u8> = {
        let txn = redb::ReadableDatabase::begin_read(&db).unwrap();
        let nodes = txn.open_table(berth::store::tables::MERKLE_NODES).unwrap();
        redb::ReadableTable::iter(&nodes)
            .unwrap()
            .map(|e| e.unwrap().0.value().0)
            .collect()
    };
    drop(db);
    assert!(
        !levels.is_empty() && levels.iter().all(|l| *l >= 3),
        "stored subtree levels {levels:?}"
    );
    std::fs::write(dir.join("server.log"), "").unwrap();
    s.launch().await;
    assert!(
        !s.log().contains("migrating the store"),
        "a migrated store was migrated again:\n{}",
        s.log()
    );
    // Every event's inclusion proof, from the subtrees kept and those
    // computed from the events, verifies against the root `berth audit
    // verify` computed from the events alone.
    audit_proofs_verify(&s).await;
    let first = &reads[1];
    let (status, body) = s.json(first["path"].as_str().unwrap()).await;
    assert_eq!(status, 200);
    assert_contains(&body, &first["body"], "after a restart");
    assert_eq!(
        body["auto_rollback"], true,
        "a migrated deployment rolls back by default"
    );
}

#[tokio::test]
async fn a_store_newer_than_this_berth_is_refused_with_both_versions() {
    let dir = data_dir_with_fixture("layout-newer");
    let path = dir.join("data/berth.redb");
    {
        let db = redb::Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(berth::store::tables::META)
            .unwrap()
            .insert("schema_version", 99u32.to_le_bytes().as_slice())
            .unwrap();
        txn.commit().unwrap();
    }
    let out = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.join("data"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let current = berth::store::LAYOUT_VERSION.to_string();
    assert!(
        stderr.contains("layout version 99") && stderr.contains(&current),
        "{stderr}"
    );
    assert_eq!(recorded_layout(&path), 99, "a refused store was migrated");
}

/// A stopped store of an older layout: `berth export` refuses it with the
/// advice to start `berth serve` on it once (an export reads every table
/// in this berth's layout, and layout 9 moved a deployment's events), and
/// writes nothing; `berth audit verify` reads it as it is (the chain's
/// tables kept their layout) and leaves it unmigrated.
#[tokio::test]
async fn an_export_of_a_stopped_older_store_is_refused_with_advice_and_verify_reads_it() {
    let dir = data_dir_with_fixture("layout-export-older");
    let data = dir.join("data");
    let target = dir.join("export.sqlite");
    let out = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["export", "--data-dir"])
        .arg(&data)
        .arg("--to")
        .arg(format!("sqlite:{}", target.display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("layout version 1, older than")
            && stderr.contains("start `berth serve` on it once"),
        "{stderr}"
    );
    assert!(
        !target.exists(),
        "a refused export wrote {}",
        target.display()
    );
    let verify = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["audit", "verify", "--data-dir"])
        .arg(&data)
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "{}{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
    let tables = tables_in(&data.join("berth.redb"));
    assert!(
        tables.contains(&"deployment_events".to_string())
            && !tables.contains(&"deployment_rows".to_string()),
        "a read-only command migrated the store: {tables:?}"
    );
}

/// A start that must write the store before it can migrate it, on a disk
/// without room (storage.md: nothing acknowledged is lost on a full
/// disk): a berth of layout 8 killed with rows in its redo log, which go
/// into the file (durably, through layout 8's tables) before the file may
/// move to a later layout, restored as a sparse file onto a full disk. The start
/// stops with an error that says the disk is full, that nothing is lost
/// and what to free, and leaves the file at layout 8 with its log. Once
/// there is room, the next start applies the log, migrates, and every read
/// answers as the killed berth did. Runs on a small tmpfs (needs root, as
/// CI has).
#[tokio::test]
async fn a_start_on_a_full_disk_that_must_replay_before_migrating_stops_and_the_next_finishes() {
    full_disk_start(
        "layout::a_start_on_a_full_disk_that_must_replay_before_migrating_stops_and_the_next_finishes",
        &fixture_named("store-v8-crashed"),
        &recorded_reads("store-v8-crashed"),
        &format!(
            "must go into the store before it moves to layout {}",
            berth::store::LAYOUT_VERSION
        ),
    )
    .await;
}

/// The step to layout 9 itself on a disk without room: `store-v8-crashed`
/// with its log applied (as the berth that wrote it would at its next
/// start) and its file compacted, so the file keeps no free pages and the
/// migration, which writes each deployment's rows into a new table before
/// it frees the old ones, needs new blocks. The start stops with the same
/// error and leaves the file at layout 8; with room the next migrates, and
/// every read answers as the killed berth did. (Copied whole, the fixture
/// migrates within its own free pages and a full disk never stops it.)
#[tokio::test]
async fn a_start_on_a_full_disk_whose_migration_needs_room_stops_and_the_next_finishes() {
    let compacted = temp_dir("layout-full-disk-compacted");
    std::fs::create_dir_all(&compacted).unwrap();
    let store = compacted.join("berth.redb");
    for file in ["berth.redb", "berth.redo"] {
        std::fs::copy(
            fixture_named("store-v8-crashed").join(file),
            compacted.join(file),
        )
        .unwrap();
    }
    {
        let mut db = redb::Database::create(&store).unwrap();
        // Layout 8's records into the layout 8 file, durably.
        berth::store::redo::replay(&db, &store, 8, berth::store::redo::Replay::Checkpoint).unwrap();
        while db.compact().unwrap() {}
    }
    std::fs::remove_file(compacted.join("berth.redo")).unwrap();
    assert_eq!(recorded_layout(&store), 8);
    full_disk_start(
        "layout::a_start_on_a_full_disk_whose_migration_needs_room_stops_and_the_next_finishes",
        &compacted,
        &recorded_reads("store-v8-crashed"),
        "migrating the store: file each deployment's builds, events and audit index in one table",
    )
    .await;
}

/// The store in `from` (with its redo log, if it has one) copied sparse
/// onto a full disk: the start fails as a full disk, having got as far as
/// `got_to` says (in its error or its log), and changes nothing; the next
/// one with room migrates and reads back `reads`.
async fn full_disk_start(test: &str, from: &Path, reads: &[Value], got_to: &str) {
    let dir = temp_dir("layout-full-disk");
    let Some(_mount) = crate::disk::small_data_dir(test, &dir, "4m") else {
        return;
    };
    let data = dir.join("data");
    let store = data.join("berth.redb");
    let with_log = from.join("berth.redo").exists();
    // Copied sparse, as a backup tool restores a file: the file's free
    // pages (zeros) take no room on the disk, so the replay's writes into
    // them need new blocks. (Copied whole, the replay and the migration
    // fit in the file's own free pages, and a full disk stops neither;
    // store-v1's migration fits even copied sparse. A compacted file has
    // no free pages to fit anything in.)
    for file in ["berth.redb", "berth.redo"] {
        if file == "berth.redo" && !with_log {
            continue;
        }
        let copied = Command::new("cp")
            .arg("--sparse=always")
            .arg(from.join(file))
            .arg(data.join(file))
            .status()
            .unwrap();
        assert!(copied.success(), "cp --sparse=always {file}");
    }
    // The secrets a first start writes before it opens the store, made by
    // a start elsewhere: then the only writes before the failure are the
    // store's own, and not one page is free for them.
    let elsewhere = temp_dir("layout-full-disk-secrets");
    let mut first = Server::start_in(elsewhere.clone(), Options::default()).await;
    assert!(first.terminate().success());
    for secret in SECRETS_WRITTEN_AT_A_FIRST_START {
        std::fs::copy(elsewhere.join("data").join(secret), data.join(secret))
            .unwrap_or_else(|e| panic!("{secret}: {e}"));
    }
    let filler = data.join("filler");
    fill_all_but(&filler, 0);

    let mut child = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let mut stderr = String::new();
            let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr);
            panic!("berth started on a full disk: nothing it wrote at open needed new blocks:\n{stderr}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    for says in [
        "the disk is full",
        "Nothing is lost",
        "Free some space",
        got_to,
    ] {
        assert!(
            stderr.contains(says),
            "the error does not say {says:?}:\n{stderr}"
        );
    }
    assert_eq!(
        recorded_layout(&store),
        8,
        "the failed start moved the file to another layout"
    );
    if with_log {
        assert!(
            data.join("berth.redo").metadata().unwrap().len() > 0,
            "the failed start lost the redo log"
        );
    }

    std::fs::remove_file(&filler).unwrap();
    let mut s = Server::start_in(dir.clone(), Options::default()).await;
    assert!(
        s.log()
            .contains("file each deployment's builds, events and audit index in one table"),
        "the start with room did not migrate:\n{}",
        s.log()
    );
    reads_back_equal(&s, reads).await;
    let status = s.terminate();
    assert!(status.success(), "{}", s.log());
    assert_eq!(recorded_layout(&store), berth::store::LAYOUT_VERSION);
    audit_verifies(&dir);
}

/// The files `berth serve` creates in an empty data dir before it opens
/// the store.
const SECRETS_WRITTEN_AT_A_FIRST_START: [&str; 4] = [
    "service-token",
    "cursor-key",
    "callback-secret",
    "audit-signing.key",
];

/// Fills the file system `filler` is on, then gives `free` bytes back.
fn fill_all_but(filler: &Path, free: u64) {
    use std::io::Write;
    let mut file = std::fs::File::create(filler).unwrap();
    let chunk = vec![0u8; 64 << 10];
    loop {
        match file.write(&chunk) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(28) => break,
            Err(e) => panic!("filling {}: {e}", filler.display()),
        }
    }
    let written = file.metadata().unwrap().len();
    assert!(written >= free, "the file system was already full");
    file.set_len(written - free).unwrap();
}
