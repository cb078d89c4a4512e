//! Cluster mode (cluster.md): replicas of the real binary on the machine's
//! PostgreSQL, a fresh database per test. One replica leads and serves;
//! another waits, and takes over when the leader is killed or paused past
//! its lease, with every acknowledged write; a paused leader that wakes
//! stops its deployer and writes nothing; bad store URLs and flags are
//! refused with their codes; a crash of PostgreSQL itself (a private
//! server) under load loses and repeats nothing. The black-box suites also
//! run against three replicas (`BERTH_TEST_CLUSTER=3`, harness.rs).

use std::path::Path;
use std::time::Duration;

use serde_json::json;

use crate::harness::*;

const LEASE: &str = "5s";

fn replica(db: &PgDb, extra: &[&str]) -> Options {
    let mut opts = Options::default()
        .arg("--store")
        .arg(&db.url())
        .arg("--lease-ttl")
        .arg(LEASE);
    for a in extra {
        opts = opts.arg(a);
    }
    opts
}

/// A replica's data dir holding the leader's secrets (cluster.md: replicas
/// share them as files).
fn with_secrets_of(leader: &Server, tag: &str) -> std::path::PathBuf {
    let dir = temp_dir(tag);
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    for name in SHARED_SECRETS {
        let from = leader.dir.join("data").join(name);
        std::fs::copy(&from, data.join(name)).unwrap();
    }
    dir
}

/// Whether the process with `pid` is still there.
fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[tokio::test]
async fn a_standby_takes_over_after_kill_9_with_every_acknowledged_submit() {
    let test = "a_standby_takes_over_after_kill_9_with_every_acknowledged_submit";
    let Some(db) = PgDb::create(test).await else {
        return;
    };
    let mut leader = Server::start(replica(&db, &[])).await;
    let finished = leader
        .submit_ok("alice", mastodon("alice.example.org"))
        .await;
    leader.wait_build(&finished, "succeeded").await;
    let events_before = build_events(&leader, &finished).await;
    let mut standby = Server::unstarted(with_secrets_of(&leader, "standby"), replica(&db, &[]));
    standby.spawn();
    standby.wait_listening().await;
    // The standby serves every route by forwarding to the leader.
    let through_standby = standby.submit_ok("bob", mastodon("bob.example.org")).await;
    leader.wait_build(&through_standby, "succeeded").await;
    eventually("both replicas in GET /v1/cluster", || {
        let s = &standby;
        async move {
            let (_, c) = s.json("/v1/cluster").await;
            c["replicas"].as_array().map(Vec::len) == Some(2)
        }
    })
    .await;
    let (_, cluster) = standby.json("/v1/cluster").await;
    assert_eq!(cluster["store"], "postgres", "{cluster}");
    let metrics = leader.metrics().await;
    assert!(metrics.contains("\nberth_store_up 1\n"), "{metrics}");
    assert!(
        metrics.contains("\nberth_cluster_replicas 2\n"),
        "{metrics}"
    );
    assert_eq!(
        cluster["replica"], cluster["leader"],
        "answered by the leader: {cluster}"
    );
    assert!(
        !cluster["database"].as_str().unwrap().contains('@')
            || !cluster.to_string().contains("password")
    );
    // Submits in flight while the leader dies: each one answered 202 must
    // be on the standby once it leads.
    let base = leader.base.clone();
    let token = leader.token.clone();
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = answered.clone();
    let load = tokio::spawn(async move {
        let http = client();
        let mut acknowledged = Vec::new();
        for i in 0..400 {
            let answer = http
                .post(format!("{base}/v1/deployments/d{i}/submit"))
                .bearer_auth(&token)
                .header("Idempotency-Key", format!("cluster-submit-{i:08}"))
                .json(&json!({"configuration": {"n": i}}))
                .send()
                .await;
            match answer {
                Ok(r) if r.status() == 202 => {
                    acknowledged.push(i);
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                Ok(_) | Err(_) => break,
            }
        }
        acknowledged
    });
    // The kill lands while submits flow.
    eventually("twenty submits answered", || {
        let n = answered.load(std::sync::atomic::Ordering::SeqCst);
        async move { n >= 20 }
    })
    .await;
    leader.kill();
    let acknowledged = load.await.unwrap();
    assert!(
        !acknowledged.is_empty(),
        "no submit was answered before the kill"
    );
    standby.wait_ready().await;
    let (_, cluster) = standby.json("/v1/cluster").await;
    assert_eq!(cluster["replica"], cluster["leader"], "{cluster}");
    for i in &acknowledged {
        let (status, d) = standby.json(&format!("/v1/deployments/d{i}")).await;
        assert_eq!(
            status, 200,
            "acknowledged d{i} missing after the takeover: {d}"
        );
    }
    // The same key on the new leader replays the same build.
    let last = acknowledged[acknowledged.len() - 1];
    let (_, first_answer) = standby.json(&format!("/v1/deployments/d{last}")).await;
    let replay = standby
        .post(
            &format!("/v1/deployments/d{last}/submit"),
            &json!({"configuration": {"n": last}}),
        )
        .header("Idempotency-Key", format!("cluster-submit-{last:08}"))
        .send()
        .await
        .unwrap();
    let (status, replayed) = read(replay).await;
    assert_eq!(status, 202, "{replayed}");
    assert_eq!(
        replayed["build_id"], first_answer["last_build"]["id"],
        "the key ran twice: {replayed}"
    );
    // A finished build's events read the same, ids and all.
    assert_eq!(build_events(&standby, &finished).await, events_before);
    // The chain, verified from one snapshot of the database while the
    // replica runs.
    let (code, report, _) = cli(&["audit", "verify", "--json", "--store", &db.url()]);
    assert_eq!(code, 0, "{report}");
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(report["ok"], true, "{report}");
}

/// Every event of a finished build's channel, ids included.
async fn build_events(s: &Server, build: &str) -> Vec<SseEvent> {
    Sse::open(s.get(&format!("/v1/builds/{build}/events")))
        .await
        .until_end()
        .await
}

#[tokio::test]
async fn a_paused_leader_is_replaced_and_when_it_wakes_stops_its_deployer_and_writes_nothing() {
    let test =
        "a_paused_leader_is_replaced_and_when_it_wakes_stops_its_deployer_and_writes_nothing";
    let Some(db) = PgDb::create(test).await else {
        return;
    };
    let dir = temp_dir("paused-leader");
    let _ = test;
    let (deployer, _gates) = gated_deployer(&dir);
    let opts = replica(&db, &["--cancel-grace", "1s"]).deployer(&deployer);
    let mut leader = Server::start_in(dir, opts).await;
    let running = leader.submit_ok("alice", json!({"n": 1})).await;
    leader.wait_build(&running, "running").await;
    let deployer_pids = processes_running(&deployer);
    assert!(!deployer_pids.is_empty(), "no deployer runs");
    let standby_opts = replica(&db, &["--cancel-grace", "1s"]).deployer(&deployer);
    let mut standby = Server::unstarted(with_secrets_of(&leader, "standby"), standby_opts);
    standby.spawn();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(leader.pid() as i32),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    standby.wait_ready().await;
    let ended = standby.wait_build(&running, "failed").await;
    assert_eq!(ended["failure"]["reason"], "lost_attempt", "{ended}");
    let events = build_events(&standby, &running).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(leader.pid() as i32),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    // Awake, it finds its fence taken: it stops what it ran and exits.
    eventually("the woken leader to exit", || {
        let exited = leader.exited().is_some();
        async move { exited }
    })
    .await;
    assert!(leader.log().contains("lease_lost"), "{}", leader.log());
    eventually("the woken leader's deployer to stop", || {
        let gone = !deployer_pids.iter().any(|p| alive(*p));
        async move { gone }
    })
    .await;
    // Nothing it wrote after the takeover landed.
    let after = build_events(&standby, &running).await;
    assert_eq!(
        after, events,
        "the old leader wrote after its fence was taken"
    );
    assert_eq!(standby.build(&running).await["status"], ended["status"]);
}

/// The pids of processes running `script` (berth itself, which names it
/// in `--deployer`, left out).
fn processes_running(script: &Path) -> Vec<u32> {
    let wanted = script.to_string_lossy().into_owned();
    let berth = env!("CARGO_BIN_EXE_berth");
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if cmdline.contains(&wanted) && !cmdline.starts_with(berth) {
            pids.push(pid);
        }
    }
    pids
}

#[tokio::test]
async fn store_urls_and_flags_that_cannot_work_are_refused_with_their_codes() {
    let test = "store_urls_and_flags_that_cannot_work_are_refused_with_their_codes";
    let Some(db) = PgDb::create(test).await else {
        return;
    };
    let dir = temp_dir("refusals");
    let data = dir.join("data");
    let data = data.to_str().unwrap();
    let with_password = "postgres://postgres:hunter2@127.0.0.1/x";
    let refused = |args: &[&str], code: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
            .args(["serve", "--data-dir", data, "--listen", "127.0.0.1:0"])
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(code), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("hunter2"),
            "a password in the output: {stderr}"
        );
    };
    refused(&["--store", with_password], "store_url_has_password");
    refused(
        &["--store", "postgres://127.0.0.1/x?sslmode=prefer"],
        "store_insecure_tls",
    );
    refused(
        &["--store", "postgres://127.0.0.1/x?foo=1"],
        "invalid_store_url",
    );
    refused(&["--store", &db.url(), "--shared-store"], "redb_only_flag");
    let file = dir.join("store-url");
    std::fs::write(&file, format!("{with_password}\n")).unwrap();
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    refused(&["--store-file", file.to_str().unwrap()], "store_file_mode");
    // A database holding other tables is not berth's.
    db.client()
        .await
        .batch_execute("CREATE TABLE customers (id int)")
        .await
        .unwrap();
    refused(&["--store", &db.url()], "not_a_berth_database");
    // A cluster takes 16 live replicas at most: a leader and 15 others
    // seen within the lease (rows as their heartbeats write them).
    let Some(full) = PgDb::create(test).await else {
        return;
    };
    let leader = Server::start(replica(&full, &[])).await;
    full.client()
        .await
        .batch_execute(
            "INSERT INTO berth_replicas
             SELECT 'live-' || n, 'r' || n, 'http://127.0.0.1:1', now(), now()
             FROM generate_series(1, 15) AS n",
        )
        .await
        .unwrap();
    let one_more = with_secrets_of(&leader, "one-more");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["serve", "--listen", "127.0.0.1:0", "--lease-ttl", LEASE])
        .arg("--data-dir")
        .arg(one_more.join("data"))
        .args(["--store", &full.url()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("too_many_replicas"), "{stderr}");
}

/// A TCP proxy to the machine's PostgreSQL that the test can cut: every
/// connection through it closes at once, and new ones are closed as they
/// come, until it is restored. To berth that is the database going away
/// (a restart, a partition) without touching the server other tests use.
struct CutProxy {
    port: u16,
    up: tokio::sync::watch::Sender<bool>,
}

impl CutProxy {
    async fn start() -> CutProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (up, up_rx) = tokio::sync::watch::channel(true);
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                let mut up = up_rx.clone();
                if !*up.borrow() {
                    continue;
                }
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect("127.0.0.1:5432").await
                    else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = up.wait_for(|u| !*u) => {}
                    }
                });
            }
        });
        CutProxy { port, up }
    }

    fn url(&self, db: &PgDb) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{}", self.port, db.name)
    }

    fn set(&self, up: bool) {
        self.up.send_replace(up);
    }
}

#[tokio::test]
async fn a_database_outage_answers_503_store_unreachable_and_loses_and_repeats_nothing() {
    let test = "a_database_outage_answers_503_store_unreachable_and_loses_and_repeats_nothing";
    let Some(db) = PgDb::create(test).await else {
        return;
    };
    let proxy = CutProxy::start().await;
    let opts = Options::default()
        .arg("--store")
        .arg(&proxy.url(&db))
        .arg("--lease-ttl")
        .arg(LEASE)
        .arg("--store-connect-timeout")
        .arg("1s");
    let leader = Server::start(opts).await;
    let submit = |i: usize| {
        leader
            .post(
                &format!("/v1/deployments/d{i}/submit"),
                &json!({"configuration": {"n": i}}),
            )
            .header("Idempotency-Key", format!("outage-submit-{i:08}"))
            .send()
    };
    let mut acknowledged = Vec::new();
    for i in 0..20 {
        let (status, body) = read(submit(i).await.unwrap()).await;
        assert_eq!(status, 202, "{body}");
        acknowledged.push((i, body["build_id"].clone()));
    }
    proxy.set(false);
    // Writes and reads both say the database is away; nothing is guessed.
    let mut i = 20;
    eventually("a submit refused store_unreachable", || {
        i += 1;
        let answer = submit(i);
        async move {
            let (status, body) = read(answer.await.unwrap()).await;
            status == 503 && body["reason"] == "store_unreachable"
        }
    })
    .await;
    eventually("a read refused store_unreachable", || {
        let answer = leader.get("/v1/deployments/d0").send();
        async move {
            let (status, body) = read(answer.await.unwrap()).await;
            status == 503 && body["reason"] == "store_unreachable"
        }
    })
    .await;
    let ready = leader.http.get(leader.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    proxy.set(true);
    let mut after = 1000;
    eventually("a submit accepted after the outage", || {
        after += 1;
        let answer = submit(after);
        async move { read(answer.await.unwrap()).await.0 == 202 }
    })
    .await;
    // Every acknowledged submit is there, and its key replays it.
    for (i, build) in &acknowledged {
        let (status, body) = read(submit(*i).await.unwrap()).await;
        assert_eq!((status, &body["build_id"]), (202, build), "d{i}: {body}");
    }
    assert!(
        !leader.log().contains("stopping so that a start loads"),
        "{}",
        leader.log()
    );
}

/// `berth <args>` as the CLI runs them: exit code, stdout and stderr.
fn cli(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(args)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (
        out.status.code().unwrap_or(-1),
        text(&out.stdout),
        text(&out.stderr),
    )
}

#[tokio::test]
async fn a_store_moves_into_a_cluster_and_back_out_with_every_read_equal() {
    let test = "a_store_moves_into_a_cluster_and_back_out_with_every_read_equal";
    let Some(db) = PgDb::create(test).await else {
        return;
    };
    let mut single = Server::start(Options::default()).await;
    let mut builds = Vec::new();
    for name in ["alice", "bob"] {
        let b = single
            .submit_ok(name, mastodon(&format!("{name}.example.org")))
            .await;
        single.wait_build(&b, "succeeded").await;
        builds.push(b);
    }
    let (_, before) = single.json("/v1/deployments").await;
    let events = build_events(&single, &builds[0]).await;
    single.terminate();
    // In: an export of the single node, imported once into an empty
    // database by the first replica.
    let moved_in = single.dir.join("in.sqlite");
    let to = format!("sqlite:{}", moved_in.display());
    let data = single.dir.join("data");
    let (code, _, err) = cli(&["export", "--data-dir", data.to_str().unwrap(), "--to", &to]);
    assert_eq!(code, 0, "{err}");
    let opts = replica(&db, &["--import-from", &to]);
    let mut leader = Server::start_in(with_secrets_of(&single, "moved-in"), opts).await;
    assert_eq!(leader.json("/v1/deployments").await.1, before);
    assert_eq!(build_events(&leader, &builds[0]).await, events);
    let third = leader
        .submit_ok("carol", mastodon("carol.example.org"))
        .await;
    leader.wait_build(&third, "succeeded").await;
    let (_, in_cluster) = leader.json("/v1/deployments").await;
    // An export read from one snapshot of the database, the leader running.
    let live = leader.dir.join("live.sqlite");
    let to_live = format!("sqlite:{}", live.display());
    let (code, _, err) = cli(&["export", "--store", &db.url(), "--to", &to_live]);
    assert_eq!(code, 0, "{err}");
    assert!(leader.terminate().success());
    // Out: the last leader's file holds the whole store.
    let moved_out = leader.dir.join("out.sqlite");
    let to = format!("sqlite:{}", moved_out.display());
    let data = leader.dir.join("data");
    let (code, _, err) = cli(&["export", "--data-dir", data.to_str().unwrap(), "--to", &to]);
    assert_eq!(code, 0, "{err}");
    let back = with_secrets_of(&leader, "moved-out");
    let new_data = back.join("data");
    let (code, _, err) = cli(&[
        "import",
        "--data-dir",
        new_data.to_str().unwrap(),
        "--from",
        &to,
    ]);
    assert_eq!(code, 0, "{err}");
    let single_again = Server::start_in(back, Options::default()).await;
    assert_eq!(single_again.json("/v1/deployments").await.1, in_cluster);
    assert_eq!(build_events(&single_again, &builds[0]).await, events);
    // The live export reads the same.
    let from_live = with_secrets_of(&leader, "from-live");
    let data = from_live.join("data");
    let (code, _, err) = cli(&[
        "import",
        "--data-dir",
        data.to_str().unwrap(),
        "--from",
        &to_live,
    ]);
    assert_eq!(code, 0, "{err}");
    let imported = Server::start_in(from_live, Options::default()).await;
    assert_eq!(imported.json("/v1/deployments").await.1, in_cluster);
    // Into another database with `import --store`: served as it was. Into
    // one that holds a store, only with --replace.
    let (code, _, err) = cli(&["import", "--store", &db.url(), "--from", &to_live]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--replace"), "{err}");
    let db2 = PgDb::create(test).await.unwrap();
    let (code, _, err) = cli(&["import", "--store", &db2.url(), "--from", &to_live]);
    assert_eq!(code, 0, "{err}");
    let opts = replica(&db2, &[]);
    let second = Server::start_in(with_secrets_of(&leader, "second-db"), opts).await;
    assert_eq!(second.json("/v1/deployments").await.1, in_cluster);
    assert_eq!(build_events(&second, &builds[0]).await, events);
}

#[tokio::test]
async fn a_stopped_leader_hands_over_at_once_and_a_replica_with_other_secrets_is_refused() {
    let test = "a_stopped_leader_hands_over_at_once_and_a_replica_with_other_secrets_is_refused";
    let Some(db) = PgDb::create(test).await else {
        return;
    };
    // A long lease: only the hand-over at the stop can make this quick.
    let long = |extra: &[&str]| {
        let mut o = Options::default()
            .arg("--store")
            .arg(&db.url())
            .arg("--lease-ttl")
            .arg("10m");
        for a in extra {
            o = o.arg(a);
        }
        o.arg("--agent-revert-after").arg("30m")
    };
    let mut leader = Server::start(long(&[])).await;
    let build = leader
        .submit_ok("alice", mastodon("alice.example.org"))
        .await;
    leader.wait_build(&build, "succeeded").await;
    // Its own secrets (generated at its start): refused, naming the file.
    let stranger = temp_dir("stranger");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store", &db.url()])
        .args([
            "--lease-ttl",
            "10m",
            "--agent-revert-after",
            "30m",
            "--data-dir",
        ])
        .arg(stranger.join("data"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("secrets_mismatch") && stderr.contains("service-token"),
        "{stderr}"
    );
    // A flag every replica must share, given otherwise: refused too.
    let mut other = Server::unstarted(
        with_secrets_of(&leader, "other-flags"),
        long(&["--keep-builds", "7"]),
    );
    other.spawn();
    eventually("the replica with another --keep-builds to exit", || {
        let exited = other.exited().is_some();
        async move { exited }
    })
    .await;
    assert!(
        other.log().contains("settings_mismatch") && other.log().contains("--keep-builds"),
        "{}",
        other.log()
    );
    let mut standby = Server::unstarted(with_secrets_of(&leader, "standby"), long(&[]));
    standby.spawn();
    standby.wait_listening().await;
    assert!(leader.terminate().success());
    let stopped = std::time::Instant::now();
    standby.wait_ready().await;
    assert!(
        stopped.elapsed() < Duration::from_secs(60),
        "the standby took over only after {:?}",
        stopped.elapsed()
    );
    assert_eq!(standby.build(&build).await["status"], "succeeded");
}

#[tokio::test]
async fn a_leader_cut_off_from_its_database_past_its_lease_stops_its_deployers() {
    let test = "a_leader_cut_off_from_its_database_past_its_lease_stops_its_deployers";
    let Some(db) = PgDb::create(test).await else {
        return;
    };
    let proxy = CutProxy::start().await;
    let dir = temp_dir("cut-leader");
    let (deployer, _gates) = gated_deployer(&dir);
    let opts = Options::default()
        .deployer(&deployer)
        .arg("--store")
        .arg(&proxy.url(&db))
        .arg("--lease-ttl")
        .arg(LEASE)
        .arg("--cancel-grace")
        .arg("1s")
        .arg("--store-connect-timeout")
        .arg("1s");
    let mut leader = Server::start_in(dir, opts).await;
    let running = leader.submit_ok("alice", json!({"n": 1})).await;
    leader.wait_build(&running, "running").await;
    // `running` is stored before the deployer is started.
    eventually("the deployer started", || {
        let started = !processes_running(&deployer).is_empty();
        async move { started }
    })
    .await;
    let pids = processes_running(&deployer);
    // Its output stored, the build writes nothing more: only the
    // self-fence can stop it.
    eventually("the deployer's first line stored", || {
        let read = leader.build(&running);
        async move { read.await["log_lines"].as_u64() >= Some(1) }
    })
    .await;
    proxy.set(false);
    // Past the lease another replica could lead: the deployer stops while
    // the database is still away.
    eventually("the cut-off leader to stop its deployer", || {
        let gone = !pids.iter().any(|p| alive(*p));
        async move { gone }
    })
    .await;
    proxy.set(true);
    // Nobody took the lease: the same leader records the stopped build's
    // end once the database is back, and goes on serving.
    eventually("the stopped build's end recorded", || {
        let answer = leader.get(&format!("/v1/builds/{running}")).send();
        async move {
            let (status, build) = read(answer.await.unwrap()).await;
            status == 200 && build["status"] == "failed"
        }
    })
    .await;
    let ended = leader.build(&running).await;
    assert_eq!(
        ended["failure"]["reason"], "interrupted_by_shutdown",
        "{ended}"
    );
    let mut n = 0;
    eventually("a submit accepted once the database is back", || {
        n += 1;
        let answer = leader
            .post(
                &format!("/v1/deployments/bob{n}/submit"),
                &json!({"configuration": {"n": n}}),
            )
            .send();
        async move { read(answer.await.unwrap()).await.0 == 202 }
    })
    .await;
    assert!(leader.exited().is_none(), "{}", leader.log());
}

#[tokio::test]
async fn one_key_sent_to_two_replicas_at_once_runs_once() {
    let test = "one_key_sent_to_two_replicas_at_once_runs_once";
    let Some(db) = PgDb::create(test).await else {
        return;
    };
    let leader = Server::start(replica(&db, &[])).await;
    let mut standby = Server::unstarted(with_secrets_of(&leader, "standby"), replica(&db, &[]));
    standby.spawn();
    standby.wait_listening().await;
    for round in 0..40 {
        let key = format!("race-submit-{round:08}");
        let send = |s: &Server| {
            s.post(
                &format!("/v1/deployments/race{round}/submit"),
                &json!({"configuration": {"round": round}}),
            )
            .header("Idempotency-Key", key.clone())
            .send()
        };
        let (a, b) = tokio::join!(send(&leader), send(&standby));
        let (a, b) = (read(a.unwrap()).await, read(b.unwrap()).await);
        assert_eq!((a.0, b.0), (202, 202), "round {round}: {a:?} {b:?}");
        assert_eq!(
            a.1["build_id"], b.1["build_id"],
            "round {round}: the key ran twice"
        );
        let (_, builds) = leader
            .json(&format!("/v1/deployments/race{round}/builds"))
            .await;
        assert_eq!(
            builds["items"].as_array().map(Vec::len),
            Some(1),
            "{builds}"
        );
    }
}

/// A PostgreSQL server of the test's own (the machine's binaries, a data
/// dir under the test's temp dir, a Unix socket only): the test may crash
/// and restart it without touching the server other tests share.
struct PrivatePg {
    dir: std::path::PathBuf,
    bin: std::path::PathBuf,
}

/// The socket's port number (a file name in the private socket dir, so
/// it cannot collide with another server).
const PRIVATE_PG_PORT: u16 = 5499;

impl PrivatePg {
    /// None (and a visible skip) without PostgreSQL's server binaries.
    fn start(test: &str) -> Option<PrivatePg> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .ok()
            .and_then(|versions| versions.flatten().map(|v| v.path().join("bin")).max())
            .filter(|bin| bin.join("pg_ctl").exists());
        let Some(bin) = bin else {
            skip(
                test,
                "no PostgreSQL server binaries under /usr/lib/postgresql",
            );
            return None;
        };
        let dir = temp_dir("pg");
        let pg = PrivatePg { dir, bin };
        // initdb refuses root: as root the server runs as postgres.
        let (code, _) = pg.run(&["chown", "-R", "postgres", &pg.dir.display().to_string()]);
        assert!(code == 0 || !as_root());
        let data = pg.dir.join("data").display().to_string();
        let initdb = pg.bin.join("initdb").display().to_string();
        let (code, out) = pg.as_server(&[
            &initdb,
            "-D",
            &data,
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
        ]);
        assert_eq!(code, 0, "initdb: {out}");
        pg.ctl(&["start"]);
        Some(pg)
    }

    fn url(&self) -> String {
        format!(
            "postgres://postgres@/postgres?host={}&port={PRIVATE_PG_PORT}",
            self.dir.display()
        )
    }

    /// `pg_ctl <action>` with the server's options, waiting for it.
    fn ctl(&self, action: &[&str]) {
        let pg_ctl = self.bin.join("pg_ctl").display().to_string();
        let data = self.dir.join("data").display().to_string();
        let log = self.dir.join("postgres.log").display().to_string();
        let options = format!(
            "-p {PRIVATE_PG_PORT} -k {} -c listen_addresses=''",
            self.dir.display()
        );
        let mut args = vec![
            pg_ctl.as_str(),
            "-D",
            &data,
            "-l",
            &log,
            "-o",
            &options,
            "-w",
        ];
        args.extend_from_slice(action);
        let (code, out) = self.as_server(&args);
        assert_eq!(code, 0, "pg_ctl {action:?}: {out}");
    }

    fn as_server(&self, args: &[&str]) -> (i32, String) {
        if as_root() {
            let mut all = vec!["runuser", "-u", "postgres", "--"];
            all.extend_from_slice(args);
            return self.run(&all);
        }
        self.run(args)
    }

    fn run(&self, args: &[&str]) -> (i32, String) {
        let out = std::process::Command::new(args[0])
            .args(&args[1..])
            .output()
            .unwrap_or_else(|e| panic!("{}: {e}", args[0]));
        let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        (out.status.code().unwrap_or(-1), text.into_owned())
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        self.ctl(&["-m", "immediate", "stop"]);
    }
}

fn as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

#[tokio::test]
async fn a_postgresql_crash_and_restart_under_load_loses_and_repeats_nothing() {
    let test = "a_postgresql_crash_and_restart_under_load_loses_and_repeats_nothing";
    let Some(pg) = PrivatePg::start(test) else {
        return;
    };
    let opts = Options::default()
        .arg("--store")
        .arg(&pg.url())
        .arg("--lease-ttl")
        .arg(LEASE)
        .arg("--store-connect-timeout")
        .arg("1s");
    let leader = std::sync::Arc::new(Server::start(opts).await);
    // Eight submitters, each on deployments of its own with keys of its
    // own, until told to stop; each remembers what it was answered.
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let acks = std::sync::Arc::new(AtomicUsize::new(0));
    let mut submitters = Vec::new();
    for task in 0..8 {
        let (leader, stop, acks) = (leader.clone(), stop.clone(), acks.clone());
        submitters.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            let mut i = 0;
            while !stop.load(SeqCst) {
                let answer = submit_once(&leader, task, i).await;
                acks.fetch_add(usize::from(answer.is_some()), SeqCst);
                answers.push((i, answer));
                i += 1;
            }
            answers
        }));
    }
    eventually("submits acknowledged before the crash", || {
        let n = acks.load(SeqCst);
        async move { n >= 100 }
    })
    .await;
    let before_crash = acks.load(SeqCst);
    // The crash: no shutdown checkpoint, every session cut; then the start
    // replays PostgreSQL's WAL.
    pg.ctl(&["-m", "immediate", "restart"]);
    eventually("a submit acknowledged after the restart", || {
        let answer = submit_once(&leader, 99, 0);
        async move { answer.await.is_some() }
    })
    .await;
    stop.store(true, SeqCst);
    let mut acknowledged = 0;
    for (task, submitter) in submitters.into_iter().enumerate() {
        for (i, answer) in submitter.await.unwrap() {
            // Every key replays its build (an unacknowledged one ran at most
            // once, in doubt or not); every deployment holds one build.
            let replayed = submit_once(&leader, task, i).await;
            assert!(replayed.is_some(), "{}", leader.log());
            if let Some(build) = answer {
                acknowledged += 1;
                assert_eq!(Some(&build), replayed.as_ref(), "c{task}-{i}");
                // A build whose deployer could not be recorded still ends.
                leader.wait_build(build.as_str().unwrap(), "final").await;
            }
            let (_, builds) = leader
                .json(&format!("/v1/deployments/c{task}-{i}/builds"))
                .await;
            assert_eq!(
                builds["items"].as_array().map(Vec::len),
                Some(1),
                "{builds}"
            );
        }
    }
    assert!(acknowledged >= before_crash);
    assert!(alive(leader.pid()), "{}", leader.log());
}

/// One submit of deployment `c<task>-<i>` under its own key: the build id
/// when acknowledged.
async fn submit_once(leader: &Server, task: usize, i: usize) -> Option<serde_json::Value> {
    let answer = leader
        .post(
            &format!("/v1/deployments/c{task}-{i}/submit"),
            &json!({"configuration": {"n": i}}),
        )
        .header("Idempotency-Key", format!("restart-{task:02}-{i:06}"))
        .send()
        .await
        .ok()?;
    let (status, body) = read(answer).await;
    (status == 202).then(|| body["build_id"].clone())
}

// Multi-threaded: the sink answers while `berth audit push-head` blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_databases_chain_is_pushed_with_a_replicas_key_and_verified_against_it() {
    let test = "the_databases_chain_is_pushed_with_a_replicas_key_and_verified_against_it";
    let Some(db) = PgDb::create(test).await else {
        return;
    };
    let leader = Server::start(replica(&db, &[])).await;
    for i in 0..3 {
        leader.submit_ok(&format!("p{i}"), json!({"n": i})).await;
    }
    let pushed: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>> = Default::default();
    let got = pushed.clone();
    let (sink, _sink_task) = json_server(std::sync::Arc::new(move |body| {
        got.lock().unwrap().push(body);
        (200, json!({"ok": true}))
    }))
    .await;
    let data = leader.dir.join("data");
    let data = data.to_str().unwrap();
    let url = db.url();
    let push = || {
        cli(&[
            "audit",
            "push-head",
            "--store",
            &url,
            "--data-dir",
            data,
            "--sink",
            &sink,
        ])
    };
    let (code, out, err) = push();
    assert_eq!(code, 0, "{out}{err}");
    // The head the database's chain has, signed with the replica's key,
    // recorded in its data dir.
    let (code, report, err) = cli(&[
        "audit",
        "verify",
        "--json",
        "--store",
        &url,
        "--data-dir",
        data,
    ]);
    assert_eq!(code, 0, "{report}{err}");
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    let first = pushed.lock().unwrap()[0].clone();
    assert_eq!(first["verify"]["size"], report["size"], "{first}");
    let recorded: serde_json::Value = serde_json::from_slice(
        &std::fs::read(leader.dir.join("data/audit-pushed-head.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(recorded["size"], report["size"]);
    // The next push proves it extends the last one.
    leader.submit_ok("p9", json!({"n": 9})).await;
    let (code, out, err) = push();
    assert_eq!(code, 0, "{out}{err}");
    let second = pushed.lock().unwrap()[1].clone();
    assert_eq!(second["consistency"]["from"], report["size"], "{second}");
}
