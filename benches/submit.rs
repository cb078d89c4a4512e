//! Submit throughput with 1 and 32 connections from `wrk` (tools/submit.lua:
//! a new deployment and idempotency key per request, and again to a fleet
//! of 100 deployments in turn; no eval:
//! `--eval-slots 0`, a deployer that blocks so builds do not compete)
//! against a 128 B append + fdatasync loop and SQLite doing the same
//! transaction (WAL, synchronous=FULL; 1 and 32 writers) on the same disk
//! in the same run; the floors under it (bare redb with the same table
//! count, durable and, as the redo path commits, non-durable with
//! checkpoints, in 13, 2 or 1 tables and without checkpoints, and with a
//! submit's rows kept in memory and written once per checkpoint; the disk
//! writing as many scattered pages as a submit dirties; `/healthz` and a
//! read of one deployment over HTTP, the request under a submit); RSS of the idle server and with 10,000 deployments; startup with
//! 100,000 builds.
//!
//! Run: `cargo bench --bench submit` (release build of berth);
//! `BENCH_ONLY=floors` runs only the non-durable redb floors,
//! `BENCH_ONLY=http-floor` only the least a durable submit over HTTP costs
//! (`durable_http_floor`) against the fdatasync loop and SQLite.

mod common;

use std::io::Write;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PHASE: Duration = Duration::from_secs(5);

/// The 128 B append + fdatasync loop: (syncs/s, p99 of one in ms).
fn fsync_rate(dir: &std::path::Path) -> (f64, f64) {
    let path = dir.join("fsync-loop");
    let mut f = std::fs::File::create(&path).unwrap();
    let start = Instant::now();
    let mut each = Vec::with_capacity(1 << 16);
    while start.elapsed() < PHASE {
        let one = Instant::now();
        f.write_all(&[b'x'; 128]).unwrap();
        f.sync_data().unwrap();
        each.push(one.elapsed());
    }
    each.sort();
    let p99 = each[each.len() * 99 / 100].as_secs_f64() * 1000.0;
    (each.len() as f64 / start.elapsed().as_secs_f64(), p99)
}

/// One 4 KiB block at a time, written with O_DIRECT over a file of zeros
/// written beforehand (in turn over its `BLOCKS` blocks): what berth's
/// redo log records write (`src/store/blocks.rs`), the fastest durable
/// write this disk offers.
struct DirectBlocks {
    file: std::fs::File,
    /// Twice a block, so that one block of it is aligned (O_DIRECT).
    scratch: Vec<u8>,
    at: u64,
}

impl DirectBlocks {
    const BLOCK: usize = 4096;
    const BLOCKS: u64 = 4096;

    /// `None` where the file system refuses O_DIRECT.
    fn create(path: &std::path::Path) -> Option<DirectBlocks> {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::write(path, vec![0u8; Self::BLOCK * Self::BLOCKS as usize]).unwrap();
        std::fs::File::open(path).unwrap().sync_all().unwrap();
        let file = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
            .open(path)
            .ok()?;
        Some(DirectBlocks {
            file,
            scratch: vec![b'x'; 2 * Self::BLOCK],
            at: 0,
        })
    }

    /// Writes the next block and syncs it; `None` if the direct write is
    /// refused.
    fn write_and_sync(&mut self) -> Option<()> {
        use std::os::unix::fs::FileExt;
        let offset = self.scratch.as_ptr().align_offset(Self::BLOCK);
        let block = &self.scratch[offset..offset + Self::BLOCK];
        let place = (self.at % Self::BLOCKS) * Self::BLOCK as u64;
        self.file.write_all_at(block, place).ok()?;
        self.file.sync_data().unwrap();
        self.at += 1;
        Some(())
    }
}

/// What berth's redo log records now write: `DirectBlocks` in a loop:
/// (syncs/s, p99 of one in ms), or `None` where the file system refuses
/// O_DIRECT.
fn direct_fsync_rate(dir: &std::path::Path) -> Option<(f64, f64)> {
    let mut blocks = DirectBlocks::create(&dir.join("direct-fsync-loop"))?;
    let start = Instant::now();
    let mut each = Vec::with_capacity(1 << 16);
    while start.elapsed() < PHASE {
        let one = Instant::now();
        blocks.write_and_sync()?;
        each.push(one.elapsed());
    }
    each.sort();
    let p99 = each[each.len() * 99 / 100].as_secs_f64() * 1000.0;
    Some((each.len() as f64 / start.elapsed().as_secs_f64(), p99))
}

/// How the minimal durable server of `durable_http_floor` makes its
/// writes durable.
#[derive(Clone, Copy, Debug)]
enum FloorSync {
    /// On the async worker that read the request, under a lock: the least
    /// a lone request can cost (no thread hand-off), and one sync per
    /// request, of the fastest durable write this disk offers (a
    /// `DirectBlocks` block, as berth's records are written; a 128 B
    /// append where the file system refuses O_DIRECT).
    Inline,
    /// On one thread that takes every request waiting, appends 128 B for
    /// each at once and syncs once (a group commit, as berth's log does).
    Grouped,
}

/// The lone request's durable write (`FloorSync::Inline`).
enum InlineWrite {
    Direct(DirectBlocks),
    Append(std::fs::File),
}

impl InlineWrite {
    fn write_and_sync(&mut self) {
        match self {
            InlineWrite::Direct(blocks) => blocks
                .write_and_sync()
                .expect("a direct write that worked once works again"),
            InlineWrite::Append(file) => {
                file.write_all(&[b'x'; 128]).unwrap();
                file.sync_data().unwrap();
            }
        }
    }

    /// What the row says the server wrote per request.
    fn what(&self) -> &'static str {
        match self {
            InlineWrite::Direct(_) => "one 4 KiB O_DIRECT block + fdatasync",
            InlineWrite::Append(_) => "128 B append + fdatasync",
        }
    }
}

/// The syncs of the minimal durable server.
enum FloorSyncer {
    Inline(std::sync::Mutex<InlineWrite>),
    Grouped(std::sync::Mutex<std::sync::mpsc::Sender<tokio::sync::oneshot::Sender<()>>>),
}

impl FloorSyncer {
    fn new(dir: &std::path::Path, sync: FloorSync) -> FloorSyncer {
        let path = dir.join(format!("durable-http-floor-{sync:?}"));
        match sync {
            FloorSync::Inline => {
                let write = match DirectBlocks::create(&path)
                    .and_then(|mut blocks| blocks.write_and_sync().map(|()| blocks))
                {
                    Some(blocks) => InlineWrite::Direct(blocks),
                    None => InlineWrite::Append(std::fs::File::create(&path).unwrap()),
                };
                FloorSyncer::Inline(std::sync::Mutex::new(write))
            }
            FloorSync::Grouped => {
                let mut file = std::fs::File::create(&path).unwrap();
                let (waiting, arrivals) =
                    std::sync::mpsc::channel::<tokio::sync::oneshot::Sender<()>>();
                std::thread::spawn(move || {
                    // Ends when the server's runtime is dropped with it.
                    while let Ok(first) = arrivals.recv() {
                        let mut answers = vec![first];
                        answers.extend(arrivals.try_iter());
                        file.write_all(&vec![b'x'; 128 * answers.len()]).unwrap();
                        file.sync_data().unwrap();
                        for answer in answers {
                            let _ = answer.send(());
                        }
                    }
                });
                FloorSyncer::Grouped(std::sync::Mutex::new(waiting))
            }
        }
    }

    /// What the server writes per request (for the rows).
    fn what(&self) -> &'static str {
        match self {
            FloorSyncer::Inline(write) => write.lock().unwrap().what(),
            FloorSyncer::Grouped(_) => "128 B appends, one fdatasync per group",
        }
    }

    async fn make_durable(&self) {
        match self {
            FloorSyncer::Inline(write) => write.lock().unwrap().write_and_sync(),
            FloorSyncer::Grouped(waiting) => {
                let (answer, durable) = tokio::sync::oneshot::channel();
                waiting.lock().unwrap().send(answer).unwrap();
                durable.await.unwrap();
            }
        }
    }
}

/// The least a durable submit over HTTP costs on this machine: a server
/// on the same hyper and tokio as berth (HTTP/1.1, two async workers)
/// whose every request is read whole, then one write made durable
/// (`sync`), then a 202 with a short JSON body. No routing, no token, no
/// parsing, no store. wrk sends it the requests of berth's own rows
/// (tools/submit.lua), for `PHASE`: (requests/s, p99 in ms, what it wrote
/// per request).
///
/// Why: a goal stated against SQLite, which commits in process, is out of
/// reach for any server that answers over HTTP when this server, doing
/// nothing but the sync, is slower than SQLite in the same run.
fn durable_http_floor(
    dir: &std::path::Path,
    connections: usize,
    sync: FloorSync,
) -> (f64, f64, &'static str) {
    use hyper::body::Body as _;
    let syncer = Arc::new(FloorSyncer::new(dir, sync));
    let what = syncer.what();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            stream.set_nodelay(true).unwrap();
            let syncer = syncer.clone();
            let service = hyper::service::service_fn(
                move |request: hyper::Request<hyper::body::Incoming>| {
                    let syncer = syncer.clone();
                    async move {
                        let mut body = request.into_body();
                        while let Some(frame) =
                            std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx))
                                .await
                        {
                            frame?;
                        }
                        syncer.make_durable().await;
                        let answer = hyper::Response::builder()
                            .status(202)
                            .header("content-type", "application/json")
                            .body(String::from(r#"{"status":"queued"}"#))
                            .expect("a fixed response is valid");
                        Ok::<_, hyper::Error>(answer)
                    }
                },
            );
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
            );
        }
    });
    let (rate, p99) = common::wrk_submits(&base, "unused", connections, PHASE);
    rt.shutdown_background();
    (rate, p99, what)
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// `wrk` with tools/submit.lua for `PHASE`: (submits/s, p99 in ms).
fn wrk_phase(base: &str, token: &str, connections: usize) -> (f64, f64) {
    common::wrk_submits(base, token, connections, PHASE)
}

/// `wrk` on `GET /healthz` for `PHASE`: the HTTP floor on these 2 cores,
/// load generator included: (requests/s, p99 in ms).
fn healthz_rate(base: &str, connections: usize) -> (f64, f64) {
    get_rate(base, "/healthz", None, connections)
}

/// `wrk` on `GET path` for `PHASE`, with the bearer token when given:
/// (requests/s, p99 in ms).
fn get_rate(base: &str, path: &str, token: Option<&str>, connections: usize) -> (f64, f64) {
    let threads = connections.min(2).to_string();
    let mut wrk = Command::new("wrk");
    wrk.args(["-t", &threads, "-c", &connections.to_string()])
        .args(["-d", &format!("{}s", PHASE.as_secs())])
        .arg("--latency");
    if let Some(token) = token {
        wrk.arg("-H")
            .arg(format!("Authorization: Bearer {}", token.trim()));
    }
    let out = wrk.arg(format!("{base}{path}")).output().expect("run wrk");
    let text = String::from_utf8_lossy(&out.stdout);
    let rate = text
        .lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("wrk printed no rate: {text}"));
    // The latency table: "     99%    1.15ms".
    let p99 = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("99%"))
        .and_then(|v| wrk_duration_ms(v.trim()))
        .unwrap_or_else(|| panic!("wrk printed no p99: {text}"));
    (rate, p99)
}

/// A duration as wrk prints it (`812.00us`, `1.15ms`, `2.01s`), in ms.
fn wrk_duration_ms(text: &str) -> Option<f64> {
    let (number, scale) = if let Some(v) = text.strip_suffix("us") {
        (v, 0.001)
    } else if let Some(v) = text.strip_suffix("ms") {
        (v, 1.0)
    } else if let Some(v) = text.strip_suffix('s') {
        (v, 1000.0)
    } else {
        return None;
    };
    number.parse::<f64>().ok().map(|n| n * scale)
}

/// The same work in SQLite (WAL, synchronous=FULL), one transaction per
/// submit: upsert the deployment, insert the build, its event and the
/// idempotency record. `writers` threads, each its own connection.
fn sqlite_rate(dir: &std::path::Path, writers: usize) -> f64 {
    let path = dir.join(format!("baseline-{writers}.sqlite"));
    let _ = std::fs::remove_file(&path);
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE deployments (id TEXT PRIMARY KEY, revision INTEGER, record BLOB);
             CREATE TABLE builds (id BLOB PRIMARY KEY, deployment TEXT, record BLOB);
             CREATE TABLE events (deployment TEXT, seq INTEGER, data TEXT, PRIMARY KEY (deployment, seq));
             CREATE TABLE idempotency (key TEXT PRIMARY KEY, response BLOB, expires INTEGER);",
        )
        .unwrap();
    }
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let record = vec![7u8; 600];
    std::thread::scope(|scope| {
        for w in 0..writers {
            let (path, done, record) = (&path, done.clone(), &record);
            scope.spawn(move || {
                let mut c = rusqlite::Connection::open(path).unwrap();
                c.execute_batch("PRAGMA synchronous = FULL; PRAGMA busy_timeout = 10000;")
                    .unwrap();
                let mut n = 0u64;
                while start.elapsed() < PHASE {
                    n += 1;
                    let id = format!("w{w}n{n}");
                    let tx = c
                        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                        .unwrap();
                    tx.execute(
                        "INSERT INTO deployments VALUES (?1, 1, ?2) ON CONFLICT (id) DO UPDATE SET revision = revision + 1, record = ?2",
                        rusqlite::params![id, record],
                    )
                    .unwrap();
                    tx.execute(
                        "INSERT INTO builds VALUES (?1, ?2, ?3)",
                        rusqlite::params![uuid::Uuid::now_v7().as_bytes().to_vec(), id, record],
                    )
                    .unwrap();
                    tx.execute(
                        "INSERT INTO events VALUES (?1, 1, ?2)",
                        rusqlite::params![id, r#"{"state":"building"}"#],
                    )
                    .unwrap();
                    tx.execute(
                        "INSERT INTO idempotency VALUES (?1, ?2, 0)",
                        rusqlite::params![format!("key-{id}"), record],
                    )
                    .unwrap();
                    tx.commit().unwrap();
                    done.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// Tables one submit wrote in layout 8 (a new deployment, the service
/// token): meta, build snapshots, build events, deployment events, builds,
/// deployment builds, queued, deployments, audit events, audit by
/// deployment, Merkle nodes, idempotency, idempotency expiry. Layout 9
/// keeps three of them in one (`deployment_rows`): 11. The floors below
/// model layout 8 and the co-locations measured against it.
const TABLES_PER_SUBMIT: usize = 13;
/// Deployments of the fleet phase (submitted to in turn).
const FLEET: usize = 100;

/// CPU time (user + system) of berth's store writer thread so far, in us.
fn writer_cpu_us(pid: u32) -> f64 {
    common::thread_cpu_us(pid, "berth-store-wri")
        .expect("berth has a store writer thread to measure (the writer's CPU row needs it)")
}

/// CPU time (user + system) of the whole berth process so far (every
/// thread, children not included), in us.
fn process_cpu_us(pid: u32) -> f64 {
    common::stat_cpu_us(std::path::Path::new(&format!("/proc/{pid}/stat")))
}

/// Bytes a process has caused to be written to storage so far
/// (`/proc/<pid>/io`, counted when it dirties page-cache pages).
/// A figure built on an unreadable count would be wrong, so it stops the
/// bench instead.
fn storage_write_bytes(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io"))
        .expect("read /proc/<berth>/io (the disk-floor row needs it)");
    io.lines()
        .find_map(|l| l.strip_prefix("write_bytes:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("/proc/<berth>/io has a write_bytes line")
}

/// The disk's own floor for a commit that writes `pages` 4 KiB pages at
/// scattered places and syncs the way redb's shared mode does (the pages,
/// fdatasync, then the header, fdatasync): commits/s with nothing else.
/// On a virtual disk an fdatasync costs more the more pages it flushes, so
/// this, not the 128 B append loop, is what a commit of that size can reach.
fn scattered_pages_rate(dir: &std::path::Path, pages: u64) -> f64 {
    use std::os::unix::fs::FileExt;
    const FILE_PAGES: u64 = 16 * 1024; // 64 MiB, about the store's size in the run
    let path = dir.join("scattered-pages");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(FILE_PAGES * 4096).unwrap();
    f.sync_all().unwrap();
    let page = [b'p'; 4096];
    let mut place = 0x9e37_79b9_7f4a_7c15u64;
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < PHASE {
        for _ in 0..pages {
            place = place
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            f.write_at(&page, (1 + (place >> 33) % (FILE_PAGES - 1)) * 4096)
                .unwrap();
        }
        f.sync_data().unwrap();
        f.write_at(&page[..320], 0).unwrap();
        f.sync_data().unwrap();
        n += 1;
    }
    let _ = std::fs::remove_file(&path);
    n as f64 / start.elapsed().as_secs_f64()
}

/// submit inserting one ~300 B row into each of `TABLES_PER_SUBMIT` tables
/// (string keys where berth's are strings), committed with
/// `Durability::Immediate`, one writer, in redb `mode`. Nothing else: no
/// HTTP, no JSON, no encoding, no thread hand-off.
fn redb_floor(dir: &std::path::Path, mode: redb::ConcurrencyMode) -> f64 {
    use redb::{TableDefinition, TableHandle};
    let path = dir.join(format!("floor-{mode:?}.redb"));
    let _ = std::fs::remove_file(&path);
    let db = redb::Database::builder()
        .set_concurrency_mode(mode)
        .create(&path)
        .unwrap();
    let names: Vec<String> = (0..TABLES_PER_SUBMIT).map(|t| format!("t{t}")).collect();
    let by_string: Vec<TableDefinition<&str, &[u8]>> = names[..3]
        .iter()
        .map(|n| TableDefinition::new(n.as_str()))
        .collect();
    let by_number: Vec<TableDefinition<u128, &[u8]>> = names[3..]
        .iter()
        .map(|n| TableDefinition::new(n.as_str()))
        .collect();
    let value = vec![7u8; 300];
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < PHASE {
        n += 1;
        let key = format!("w0r{:08x}n{n}", n.wrapping_mul(0x9e37_79b9) as u32);
        let txn = db.begin_write().unwrap();
        for t in &by_string {
            txn.open_table(*t)
                .unwrap()
                .insert(key.as_str(), value.as_slice())
                .unwrap();
        }
        for t in &by_number {
            let id = (u128::from(n) << 64) | u128::from(t.name().len() as u64);
            txn.open_table(*t)
                .unwrap()
                .insert(id, value.as_slice())
                .unwrap();
        }
        txn.commit().unwrap();
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// berth's default `--checkpoint-interval`, for the floors below.
const FLOOR_CHECKPOINT_EVERY: Duration = Duration::from_millis(50);

/// A fresh bare redb file for a floor, held alone as berth holds its
/// store, with tables of byte keys and values, committing as the redo
/// path does: non-durably, with an `Immediate` commit every
/// `checkpoint_every` (none when `None`).
struct FloorDb {
    db: redb::Database,
    names: Vec<String>,
    checkpoint_every: Option<Duration>,
    last_checkpoint: Instant,
}

impl FloorDb {
    fn create(
        path: &std::path::Path,
        tables: usize,
        checkpoint_every: Option<Duration>,
    ) -> FloorDb {
        let _ = std::fs::remove_file(path);
        let db = redb::Database::builder()
            .set_concurrency_mode(redb::ConcurrencyMode::ExclusiveWriter)
            .create(path)
            .unwrap();
        FloorDb {
            db,
            names: (0..tables).map(|t| format!("t{t}")).collect(),
            checkpoint_every,
            last_checkpoint: Instant::now(),
        }
    }

    /// The next commit's transaction: durable when a checkpoint is due.
    fn begin(&mut self) -> redb::WriteTransaction {
        let mut txn = self.db.begin_write().unwrap();
        let every = self.checkpoint_every;
        if every.is_some_and(|every| self.last_checkpoint.elapsed() >= every) {
            self.last_checkpoint = Instant::now();
        } else {
            txn.set_durability(redb::Durability::None).unwrap();
        }
        txn
    }

    fn insert(&self, txn: &redb::WriteTransaction, table: usize, key: &[u8], value: &[u8]) {
        let def = redb::TableDefinition::<&[u8], &[u8]>::new(self.names[table].as_str());
        txn.open_table(def).unwrap().insert(key, value).unwrap();
    }
}

/// How a floor's row keys are laid out in a table holding several kinds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum KeyOrder {
    /// The kind, then the submit's id: a submit's rows sit in as many
    /// places in the tree as it has kinds (a table per kind, merged).
    KindFirst,
    /// The submit's id, then the kind: a submit's rows sit side by side,
    /// in one leaf (what keying every row of a deployment by its id
    /// first would do).
    SubmitFirst,
}

/// The redo path's floor in bare redb: commits of `TABLES_PER_SUBMIT`
/// one-row inserts (~300 B each), non-durable (`Durability::None`, as a
/// store held alone, the default, commits), with an `Immediate` commit every
/// `FLOOR_CHECKPOINT_EVERY` (berth's default checkpoint; none when
/// `checkpoint_every` is `None`), spread
/// over `tables` tables under keys of the kind and the submit's id in
/// `order`: 13 tables is layout 8's, 2 a deployment-scoped and a
/// build-scoped table, 1 everything in one.
/// Commits/s, with no log and no HTTP: what co-locating a submit's rows, or
/// cheaper checkpoints, could buy on the writer thread.
fn redb_nondurable_floor(
    dir: &std::path::Path,
    tables: usize,
    checkpoint_every: Option<Duration>,
    order: KeyOrder,
) -> f64 {
    assert!((1..=TABLES_PER_SUBMIT).contains(&tables));
    let path = dir.join(format!(
        "floor-nondurable-{tables}-{}-{}.redb",
        checkpoint_every.is_some(),
        order == KeyOrder::SubmitFirst
    ));
    let mut floor = FloorDb::create(&path, tables, checkpoint_every);
    let value = vec![7u8; 300];
    let start = Instant::now();
    let mut n = 0u64;
    let mut key = Vec::with_capacity(64);
    while start.elapsed() < PHASE {
        n += 1;
        let txn = floor.begin();
        // Row `r` goes to table `r % tables`, its key prefixed by its kind
        // (so one table holds them all apart), then a scattered id.
        for r in 0..TABLES_PER_SUBMIT {
            let id = n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes();
            key.clear();
            match order {
                KeyOrder::KindFirst => {
                    key.push(r as u8);
                    key.extend_from_slice(&id);
                }
                KeyOrder::SubmitFirst => {
                    key.extend_from_slice(&id);
                    key.push(r as u8);
                }
            }
            floor.insert(&txn, r % tables, &key, &value);
        }
        txn.commit().unwrap();
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// A submit's rows by what keys them (berth's 13 tables): four by the
/// deployment id (the deployment, its build index, its event, its audit
/// index), one by the caller's idempotency key, four by the build id,
/// which grows (the build, its queue entry, its event, its snapshot), and
/// four by ids of their own that grow (the key's expiry, the audit event,
/// the actor index, a Merkle node), which no other row of a submit shares.
const ROWS_BY_DEPLOYMENT: usize = 4;
const ROWS_BY_IDEMPOTENCY_KEY: usize = 1;
const ROWS_BY_BUILD: usize = 4;
const ROWS_ALONE: usize = 4;

/// Which of a submit's rows share a table, keyed by their owner's id first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Colocation {
    /// A table per row: layout 8 (layout 9 put three of the
    /// deployment's four rows in one table).
    PerRow,
    /// The deployment's four rows in one table, the rest a table each.
    Deployment,
    /// A table per owner: the deployment's, the idempotency key's, the
    /// build's, and the four rows alone (seven tables).
    ByOwner,
}

/// Submit `n`'s rows with berth's key pattern (random deployment ids and
/// idempotency keys, growing build and audit ids), laid out as
/// `colocation` says (rows that share a table are keyed by their owner's
/// id first, so a submit's rows of one owner share a leaf): `row` gets
/// each one's table and key.
fn submit_rows(
    n: u64,
    colocation: Colocation,
    key: &mut Vec<u8>,
    mut row: impl FnMut(usize, &[u8]),
) {
    const ROWS: usize = ROWS_BY_DEPLOYMENT + ROWS_BY_IDEMPOTENCY_KEY + ROWS_BY_BUILD + ROWS_ALONE;
    const _: () = assert!(ROWS == TABLES_PER_SUBMIT);
    let deployment = n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes();
    let idempotency_key = n.wrapping_mul(0xc2b2_ae3d_27d4_eb4f).to_be_bytes();
    let growing = n.to_be_bytes();
    for r in 0..ROWS {
        // (the table of its owner when co-located, the owner's id)
        let (owner, id) = if r < ROWS_BY_DEPLOYMENT {
            (0, deployment)
        } else if r < ROWS_BY_DEPLOYMENT + ROWS_BY_IDEMPOTENCY_KEY {
            (1, idempotency_key)
        } else if r < ROWS_BY_DEPLOYMENT + ROWS_BY_IDEMPOTENCY_KEY + ROWS_BY_BUILD {
            (2, growing)
        } else {
            (r, growing)
        };
        key.clear();
        key.extend_from_slice(&id);
        let shared = match colocation {
            Colocation::PerRow => false,
            Colocation::Deployment => owner == 0,
            Colocation::ByOwner => true,
        };
        let table = match shared {
            true => {
                key.push(r as u8);
                owner
            }
            false => r,
        };
        row(table, key);
    }
}

/// Bare redb doing a submit's inserts (`submit_rows`), non-durable with
/// `FLOOR_CHECKPOINT_EVERY` checkpoints, laid out as `colocation` says;
/// `per_commit` submits to a commit, as a group commit folds them.
/// Submits/s.
fn redb_owner_floor(dir: &std::path::Path, colocation: Colocation, per_commit: u64) -> f64 {
    let path = dir.join(format!("floor-owner-{colocation:?}-{per_commit}.redb"));
    let mut floor = FloorDb::create(&path, TABLES_PER_SUBMIT, Some(FLOOR_CHECKPOINT_EVERY));
    let value = vec![7u8; 300];
    let start = Instant::now();
    let mut n = 0u64;
    let mut key = Vec::with_capacity(64);
    while start.elapsed() < PHASE {
        let txn = floor.begin();
        for _ in 0..per_commit {
            n += 1;
            submit_rows(n, colocation, &mut key, |table, key| {
                floor.insert(&txn, table, key, &value)
            });
        }
        txn.commit().unwrap();
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// The same submits (`submit_rows`, a table per row) where a commit only
/// puts its rows in memory, in an ordered map per table, and redb takes
/// them all at each `FLOOR_CHECKPOINT_EVERY` checkpoint, in one durable
/// transaction, in key order: the writer's floor if readers were answered
/// from such an overlay over redb (rows made visible once the redo log's
/// sync returns) and redb saw one transaction per checkpoint instead of
/// one per group commit. Submits/s, checkpoints included.
fn redb_overlay_floor(dir: &std::path::Path) -> f64 {
    let path = dir.join("floor-overlay.redb");
    let floor = FloorDb::create(&path, TABLES_PER_SUBMIT, None);
    let value = vec![7u8; 300];
    let mut overlay: Vec<std::collections::BTreeMap<Vec<u8>, Vec<u8>>> =
        vec![Default::default(); TABLES_PER_SUBMIT];
    let start = Instant::now();
    let mut last_checkpoint = Instant::now();
    let mut n = 0u64;
    let mut key = Vec::with_capacity(64);
    while start.elapsed() < PHASE {
        n += 1;
        submit_rows(n, Colocation::PerRow, &mut key, |table, key| {
            overlay[table].insert(key.to_vec(), value.clone());
        });
        if last_checkpoint.elapsed() >= FLOOR_CHECKPOINT_EVERY {
            last_checkpoint = Instant::now();
            let txn = floor.db.begin_write().unwrap();
            for (table, rows) in overlay.iter_mut().enumerate() {
                let def = redb::TableDefinition::<&[u8], &[u8]>::new(floor.names[table].as_str());
                let mut open = txn.open_table(def).unwrap();
                for (k, v) in std::mem::take(rows) {
                    open.insert(k.as_slice(), v.as_slice()).unwrap();
                }
            }
            txn.commit().unwrap();
        }
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// Starts berth with a deployer whose builds never finish (submits only queue).
fn start(
    dir: &std::path::Path,
    rt: &tokio::runtime::Runtime,
) -> (std::process::Child, String, String) {
    start_with(dir, rt, &[])
}

fn start_with(
    dir: &std::path::Path,
    rt: &tokio::runtime::Runtime,
    extra: &[&str],
) -> (std::process::Child, String, String) {
    std::fs::create_dir_all(dir).unwrap();
    let deployer = dir.join("sleepy.sh");
    std::fs::write(&deployer, "#!/bin/sh\ncase \"$1\" in describe) cat >/dev/null; printf '%s' '{\"methods\":[\"local\"],\"default_method\":\"local\",\"catalog\":[],\"schema\":null}' > \"$BERTH_RESULT\";; *) cat >/dev/null; sleep 3600;; esac\n").unwrap();
    Command::new("chmod")
        .arg("+x")
        .arg(&deployer)
        .status()
        .unwrap();
    let mut args = vec![
        "--eval-slots",
        "0",
        "--build-slots",
        "1",
        "--max-queued-builds",
        "1000000",
        // A clean stop ends the one running (sleeping) build at once.
        "--shutdown-grace",
        "1s",
        "--cancel-grace",
        "1s",
    ];
    args.extend_from_slice(extra);
    let started = rt.block_on(common::start_berth(dir, &deployer, &args, &[]));
    let (child, base, token) = (started.child, started.base, started.token);
    (child, base, token)
}

/// SSE clients held open for the memory figure.
const SSE_CLIENTS: usize = 1_000;
/// Builds in the store for the startup figure.
const STARTUP_BUILDS: u64 = 100_000;
/// Submits whose rows nearly fill the redo log before its forced
/// checkpoint (`CHECKPOINT_BYTES`, 14 MiB; a submit's rows are ~2.4 KB
/// here): the longest replay a start can meet.
const FULL_LOG_SUBMITS: u64 = 5_800;

/// `count` submits over 32 connections to deployments `d{first}..`, each
/// a new deployment or a build queued behind the last.
async fn submit_many(base: &str, token: &str, count: u64, first: u64) {
    let http = reqwest::Client::new();
    let mut set = tokio::task::JoinSet::new();
    for n in 0..count {
        let (http, base, token) = (http.clone(), base.to_string(), token.trim().to_string());
        // Past the first 10,000, builds queue on the existing deployments.
        let d = (first + n) % 10_000;
        set.spawn(async move {
            let body = serde_json::json!({"configuration": {"domain": format!("d{d}.example.org")}, "mode": "enqueue"});
            let r = http.post(format!("{base}/v1/deployments/d{d}/submit")).bearer_auth(&token).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 202);
        });
        if set.len() >= 32 {
            set.join_next().await;
        }
    }
    while set.join_next().await.is_some() {}
}

/// Opens `count` event streams (one per deployment) on raw sockets: a lean
/// client, so the figure is berth's memory and not the client's.
async fn open_streams(base: &str, token: &str, count: usize) -> Vec<tokio::net::TcpStream> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://").to_string();
    let mut streams = Vec::with_capacity(count);
    for n in 0..count {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let request = format!(
            "GET /v1/deployments/d{n}/events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\r\n",
            token.trim()
        );
        s.write_all(request.as_bytes()).await.unwrap();
        let mut head = [0u8; 12];
        s.read_exact(&mut head).await.unwrap();
        assert_eq!(&head, b"HTTP/1.1 200", "an event stream was refused");
        streams.push(s);
    }
    streams
}

/// SIGTERM and wait: the store is closed cleanly (the next start needs no
/// repair).
fn stop_gracefully(child: std::process::Child, dir: &std::path::Path) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    stop_after(child, dir)
}

fn stop(mut child: std::process::Child, dir: &std::path::Path) {
    let _ = child.kill();
    stop_after(child, dir)
}

fn stop_after(mut child: std::process::Child, dir: &std::path::Path) {
    let _ = child.wait();
    // The one running build's deployer sleeps in its own process group.
    let _ = Command::new("pkill")
        .arg("-f")
        .arg(dir.join("sleepy.sh"))
        .status();
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let root = std::env::temp_dir().join(format!("berth-bench-submit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let rt = tokio::runtime::Runtime::new().unwrap();

    std::fs::create_dir_all(&root).unwrap();
    // BENCH_ONLY=http-floor: the least a durable submit over HTTP costs,
    // against the loop and SQLite, 3 rounds (where the goals' ceilings are
    // on a given day; nothing of berth runs).
    if std::env::var("BENCH_ONLY").as_deref() == Ok("http-floor") {
        for _ in 0..3 {
            let (loop_rate, _) = fsync_rate(&root);
            let (one, many) = (sqlite_rate(&root, 1), sqlite_rate(&root, 32));
            let (floor_one, _, floor_one_write) = durable_http_floor(&root, 1, FloorSync::Inline);
            let floor_many = durable_http_floor(&root, 32, FloorSync::Grouped).0;
            println!(
                "fdatasync loop {loop_rate:.0}/s; SQLite {one:.0}/s (1 writer), {many:.0}/s (32); \
                 minimal durable server {floor_one:.0}/s at 1 connection ({floor_one_write}; \
                 {:.2}x the loop, {:.2}x SQLite), \
                 {floor_many:.0}/s at 32 ({:.2}x the loop, {:.2}x SQLite)",
                floor_one / loop_rate,
                floor_one / one,
                floor_many / loop_rate,
                floor_many / many
            );
        }
        let _ = std::fs::remove_dir_all(&root);
        return;
    }
    // What co-locating a submit's rows, or cheaper checkpoints, could buy
    // (BENCH_ONLY=floors: just these).
    let every = Some(FLOOR_CHECKPOINT_EVERY);
    let interval = format!("{} ms checkpoints", FLOOR_CHECKPOINT_EVERY.as_millis());
    let today = redb_nondurable_floor(&root, TABLES_PER_SUBMIT, every, KeyOrder::KindFirst);
    for (tables, checkpoints, order) in [
        (2, every, KeyOrder::KindFirst),
        (1, every, KeyOrder::KindFirst),
        (1, every, KeyOrder::SubmitFirst),
        (TABLES_PER_SUBMIT, None, KeyOrder::KindFirst),
    ] {
        let rate = redb_nondurable_floor(&root, tables, checkpoints, order);
        let how = match checkpoints {
            Some(_) => interval.as_str(),
            None => "no checkpoints",
        };
        let keyed = match order {
            KeyOrder::KindFirst => "",
            KeyOrder::SubmitFirst => ", keyed by the submit first (its rows in one leaf)",
        };
        common::record(
            &format!(
                "bare redb, {TABLES_PER_SUBMIT} one-row inserts per non-durable commit, {how}, in {tables} table(s){keyed}"
            ),
            &format!("{rate:.0}/s"),
            &format!("in {TABLES_PER_SUBMIT} tables with {interval} (layout 8's): {today:.0}/s"),
            rate / today,
            None,
            true,
        );
    }
    // A lone submit per commit (one connection) and a group commit's
    // worth (~14 at 32 connections).
    for per_commit in [1, 14] {
        let per_row = redb_owner_floor(&root, Colocation::PerRow, per_commit);
        for (colocation, how) in [
            (
                Colocation::Deployment,
                "the deployment's 4 rows in one table keyed by its id first (10 tables)",
            ),
            (
                Colocation::ByOwner,
                "in a table per owner keyed by the owner first (7 tables)",
            ),
        ] {
            let rate = redb_owner_floor(&root, colocation, per_commit);
            common::record(
                &format!("bare redb, {per_commit} submit(s) per non-durable commit, each {TABLES_PER_SUBMIT} rows with berth's keys, {interval}, {how}"),
                &format!("{rate:.0} submits/s"),
                &format!("in a table per row (layout 8): {per_row:.0}/s"),
                rate / per_row,
                None,
                true,
            );
        }
    }
    // One redb transaction per checkpoint, the rows in memory between:
    // against a lone submit per commit (one connection) and a group
    // commit's worth (32 connections), both a table per row.
    let overlay = redb_overlay_floor(&root);
    for per_commit in [1, 14] {
        let per_row = redb_owner_floor(&root, Colocation::PerRow, per_commit);
        common::record(
            &format!("bare redb, submits of {TABLES_PER_SUBMIT} rows with berth's keys kept in memory and written in one durable transaction per {interval}"),
            &format!("{overlay:.0} submits/s"),
            &format!("{per_commit} submit(s) per non-durable commit, a table per row: {per_row:.0}/s"),
            overlay / per_row,
            None,
            true,
        );
    }
    if std::env::var("BENCH_ONLY").as_deref() == Ok("floors") {
        let _ = std::fs::remove_dir_all(&root);
        return;
    }

    // Throughput, against an fsync loop and SQLite on the same disk, with
    // wrk as the load (a lean client: a heavy one on these 2 cores would
    // measure itself).
    let dir = root.join("throughput");
    let (child, base, token) = start_with(&dir, &rt, &["--shared-store"]);
    let (fsyncs, fsync_p99) = fsync_rate(&dir);
    match direct_fsync_rate(&dir) {
        Some((direct, direct_p99)) => common::record(
            "the sync berth's redo log records make: one 4 KiB block written with O_DIRECT over zeros + fdatasync, in a loop",
            &format!("{direct:.0}/s (p99 {direct_p99:.2} ms)"),
            &format!("128 B append + fdatasync loop: {fsyncs:.0}/s (p99 {fsync_p99:.2} ms)"),
            direct / fsyncs.max(1.0),
            None,
            false,
        ),
        None => println!("skipped: the O_DIRECT sync loop: this file system refuses O_DIRECT"),
    }
    let sqlite_one = sqlite_rate(&dir, 1);
    let sqlite_many = sqlite_rate(&dir, 32);
    let wrk_here = Command::new("wrk").arg("--version").output().is_ok();
    // The least a durable submit over HTTP costs here (see
    // `durable_http_floor`): one connection with the sync inline, 32 with
    // the syncs grouped.
    let http_floor = if wrk_here {
        (
            durable_http_floor(&dir, 1, FloorSync::Inline),
            durable_http_floor(&dir, 32, FloorSync::Grouped),
        )
    } else {
        ((0.0, 0.0, "none"), (0.0, 0.0, "none"))
    };
    let mut pages_per_submit = 0.0;
    let written_before = storage_write_bytes(child.id());
    let (one, many) = if wrk_here {
        let one = wrk_phase(&base, &token, 1);
        // Pages per submit at one connection (one submit per commit).
        let written = storage_write_bytes(child.id()) - written_before;
        pages_per_submit = (written as f64 / 4096.0 / (one.0 * PHASE.as_secs_f64())).round();
        (one, wrk_phase(&base, &token, 32))
    } else {
        println!("skipped: submit throughput: needs wrk (apt install wrk)");
        ((0.0, 0.0), (0.0, 0.0))
    };
    let (healthz, healthz_one_p99) = if wrk_here {
        (healthz_rate(&base, 32).0, healthz_rate(&base, 1).1)
    } else {
        (0.0, 0.0)
    };
    stop(child, &dir);
    // The same load on a store held alone (the default: one
    // fdatasync per commit), and the storage floor in both modes.
    let dir = root.join("exclusive");
    let (child, base, token) = start(&dir, &rt);
    let mut pages_alone = 0.0;
    let mut writer_us_per_submit = 0.0;
    // berth's CPU per submit, every thread, at 1 and 32 connections.
    let mut cpu_per_submit = (0.0, 0.0);
    // wrk's own CPU per submit at 32 connections, on the same cores.
    let mut wrk_us_per_submit = 0.0;
    // berth's RSS (KiB) and its store file's size (bytes) after both phases.
    let mut rss_after_submits = (0u64, 0u64);
    let exclusive = if wrk_here {
        let before = storage_write_bytes(child.id());
        let cpu_before = process_cpu_us(child.id());
        let one = wrk_phase(&base, &token, 1);
        cpu_per_submit.0 =
            (process_cpu_us(child.id()) - cpu_before) / (one.0 * PHASE.as_secs_f64());
        let written = storage_write_bytes(child.id()) - before;
        pages_alone = written as f64 / 4096.0 / (one.0 * PHASE.as_secs_f64());
        let (cpu_before, writer_before) = (process_cpu_us(child.id()), writer_cpu_us(child.id()));
        let wrk_before = common::stat_children_cpu_us(std::path::Path::new("/proc/self/stat"));
        let many = wrk_phase(&base, &token, 32);
        wrk_us_per_submit = (common::stat_children_cpu_us(std::path::Path::new("/proc/self/stat"))
            - wrk_before)
            / (many.0 * PHASE.as_secs_f64());
        writer_us_per_submit =
            (writer_cpu_us(child.id()) - writer_before) / (many.0 * PHASE.as_secs_f64());
        cpu_per_submit.1 =
            (process_cpu_us(child.id()) - cpu_before) / (many.0 * PHASE.as_secs_f64());
        rss_after_submits = (
            rss_kib(child.id()),
            std::fs::metadata(dir.join("data/berth.redb")).map_or(0, |m| m.len()),
        );
        (one, many)
    } else {
        ((0.0, 0.0), (0.0, 0.0))
    };
    // The request floor under a submit: a read of one deployment (routing,
    // auth, a read transaction, a JSON reply) on the same server and wrk.
    let read_floor = if wrk_here {
        rt.block_on(submit_many(&base, &token, 1, 0));
        let path = "/v1/deployments/d0";
        (
            get_rate(&base, path, Some(&token), 1).0,
            get_rate(&base, path, Some(&token), 32).0,
        )
    } else {
        (0.0, 0.0)
    };
    stop(child, &dir);
    // The same on a fleet that keeps deploying: FLEET deployments, each
    // submitted to in turn, so their rows rewrite the same leaves (the
    // phases above give every submit a new deployment, the case with the
    // most pages per submit).
    let fleet_dir = root.join("fleet");
    let (child, base, token) = start(&fleet_dir, &rt);
    let fleet = if wrk_here {
        (
            common::wrk_submits_to(&base, &token, 1, PHASE, FLEET),
            common::wrk_submits_to(&base, &token, 32, PHASE, FLEET),
        )
    } else {
        ((0.0, 0.0), (0.0, 0.0))
    };
    stop(child, &fleet_dir);
    let floor_shared = redb_floor(&dir, redb::ConcurrencyMode::SingleWriter);
    let floor_alone = redb_floor(&dir, redb::ConcurrencyMode::ExclusiveWriter);
    let disk_floor = scattered_pages_rate(&dir, pages_per_submit.max(1.0) as u64);
    if wrk_here {
        let fsync = format!("128 B append + fdatasync loop: {fsyncs:.0}/s");
        for (figure, (rate, p99), goal) in [
            ("submits/s, 1 connection, --shared-store", one, 0.5),
            ("submits/s, 32 connections, --shared-store", many, 3.0),
            (
                "submits/s, 1 connection (default: redo log)",
                exclusive.0,
                0.5,
            ),
            (
                "submits/s, 32 connections (default: redo log)",
                exclusive.1,
                3.0,
            ),
        ] {
            common::record(
                figure,
                &format!("{rate:.0}/s (p99 {p99:.1} ms)"),
                &fsync,
                rate / fsyncs,
                Some(goal),
                true,
            );
        }
        // redb's page cache is bounded (`--cache-size`, 64 MiB): berth's
        // memory must not follow its store file (it did up to 1 GiB).
        let (rss, store_bytes) = rss_after_submits;
        common::record(
            "RSS after the 1- and 32-connection submits (default: redo log)",
            &format!("{:.1} MiB", rss as f64 / 1024.0),
            &format!(
                "the store file it serves: {:.1} MiB",
                store_bytes as f64 / 1048576.0
            ),
            rss as f64 * 1024.0 / (store_bytes as f64).max(1.0),
            None,
            true,
        );
        for (connections, (rate, p99), other) in
            [(1, fleet.0, exclusive.0), (32, fleet.1, exclusive.1)]
        {
            common::record(
                &format!(
                    "submits/s, {connections} connection(s) (default), to {FLEET} deployments in turn"
                ),
                &format!("{rate:.0}/s (p99 {p99:.1} ms)"),
                &format!("a new deployment per submit, same run: {:.0}/s", other.0),
                rate / other.0.max(1e-6),
                None,
                true,
            );
        }
        common::record(
            "submit vs its storage floor, 1 connection, --shared-store",
            &format!("{:.0}/s", one.0),
            &format!(
                "bare redb, {TABLES_PER_SUBMIT} one-row inserts per commit, SingleWriter: {floor_shared:.0}/s"
            ),
            one.0 / floor_shared,
            None,
            true,
        );
        common::record(
            "submit vs its storage floor, 1 connection (default)",
            &format!("{:.0}/s", exclusive.0 .0),
            &format!("bare redb as above, ExclusiveWriter: {floor_alone:.0}/s"),
            exclusive.0 .0 / floor_alone,
            None,
            true,
        );
        common::record(
            "submit vs the disk floor of its writes, 1 connection, --shared-store",
            &format!("{:.0}/s ({pages_per_submit:.0} pages written per submit)", one.0),
            &format!(
                "{pages_per_submit:.0} scattered 4 KiB pages + fdatasync + header + fdatasync: {disk_floor:.0}/s"
            ),
            one.0 / disk_floor,
            None,
            true,
        );
        common::record(
            "submit vs the HTTP floor, 32 connections, --shared-store",
            &format!("{:.0}/s", many.0),
            &format!("GET /healthz, same server and wrk: {healthz:.0}/s"),
            many.0 / healthz,
            None,
            true,
        );
        // What a submit could reach at one connection if everything but
        // its request and one fdatasync were free: the two in sequence.
        let ceiling = 1.0 / (1.0 / read_floor.0 + 1.0 / fsyncs);
        common::record(
            "submit vs its request floor, 1 connection (default)",
            &format!("{:.0}/s", exclusive.0 .0),
            &format!(
                "GET of one deployment ({:.0}/s) then one fdatasync, in sequence: {ceiling:.0}/s ({:.2}x the fdatasync loop)",
                read_floor.0,
                ceiling / fsyncs
            ),
            exclusive.0 .0 / ceiling,
            None,
            true,
        );
        common::record(
            "submit vs its request floor, 32 connections (default)",
            &format!("{:.0}/s", exclusive.1 .0),
            &format!(
                "GET of one deployment, same server and wrk: {:.0}/s ({:.2}x the fdatasync loop)",
                read_floor.1,
                read_floor.1 / fsyncs
            ),
            exclusive.1 .0 / read_floor.1,
            None,
            true,
        );
        common::record(
            "submits/s, 1 writer, --shared-store",
            &format!("{:.0}/s", one.0),
            &format!("SQLite WAL synchronous=FULL, same transaction: {sqlite_one:.0}/s"),
            one.0 / sqlite_one,
            Some(0.6),
            true,
        );
        common::record(
            "submits/s, 32 writers, --shared-store",
            &format!("{:.0}/s", many.0),
            &format!("SQLite as above, 32 writers: {sqlite_many:.0}/s"),
            many.0 / sqlite_many,
            Some(4.0),
            true,
        );
        common::record(
            "submits/s, 1 writer (default: redo log)",
            &format!("{:.0}/s", exclusive.0 .0),
            &format!("SQLite WAL synchronous=FULL, same transaction: {sqlite_one:.0}/s"),
            exclusive.0 .0 / sqlite_one,
            Some(1.0),
            true,
        );
        common::record(
            "submits/s, 32 writers (default: redo log)",
            &format!("{:.0}/s", exclusive.1 .0),
            &format!("SQLite as above, 32 writers: {sqlite_many:.0}/s"),
            exclusive.1 .0 / sqlite_many,
            Some(4.0),
            true,
        );
        // The goals against the least any durable server over HTTP costs
        // here (`durable_http_floor`): where that server is slower than
        // SQLite, or than the goal's multiple of the loop, no berth that
        // answers over HTTP meets the goal on this machine.
        let ((floor_one, floor_one_p99, floor_one_write), (floor_many, floor_many_p99, _)) =
            http_floor;
        common::record(
            "the least a durable submit over HTTP costs here, 1 connection: a minimal hyper server, the fastest durable write this disk offers per request, nothing else",
            &format!(
                "{floor_one:.0}/s (p99 {floor_one_p99:.2} ms; {:.2}x the fdatasync loop; {floor_one_write})",
                floor_one / fsyncs
            ),
            &format!("SQLite WAL synchronous=FULL, same transaction, 1 writer: {sqlite_one:.0}/s"),
            floor_one / sqlite_one,
            None,
            true,
        );
        common::record(
            "the least a durable submit over HTTP costs here, 32 connections: the same server, its syncs grouped on one thread",
            &format!(
                "{floor_many:.0}/s (p99 {floor_many_p99:.2} ms; {:.2}x the fdatasync loop)",
                floor_many / fsyncs
            ),
            &format!("SQLite as above, 32 writers: {sqlite_many:.0}/s"),
            floor_many / sqlite_many,
            None,
            true,
        );
        for (connections, rate, floor) in [
            (1, exclusive.0 .0, floor_one),
            (32, exclusive.1 .0, floor_many),
        ] {
            common::record(
                &format!("submits/s, {connections} connection(s) (default), against the least a durable submit over HTTP costs"),
                &format!("{rate:.0}/s"),
                &format!("the minimal durable server above, same run: {floor:.0}/s"),
                rate / floor.max(1.0),
                None,
                true,
            );
        }
        // Against the tails under it, same run: one fdatasync, and the
        // cheapest request (its p99 is this machine's scheduling tail).
        common::record_with_goal(
            "p99 of a submit, 1 connection (default: redo log)",
            &format!("{:.2} ms", exclusive.0 .1),
            &format!(
                "fdatasync loop p99 {fsync_p99:.2} ms; GET /healthz p99 at 1 connection {healthz_one_p99:.2} ms"
            ),
            exclusive.0 .1 / fsync_p99.max(1e-6),
            "< 2 ms",
            Some(exclusive.0 .1 < 2.0),
        );
        common::record(
            "pages written per submit, 1 connection (default: redo log, checkpoints included)",
            &format!("{pages_alone:.1}"),
            &format!("shared store, same run: {pages_per_submit:.0}"),
            pages_alone / pages_per_submit.max(1.0),
            None,
            false,
        );
        println!(
            "the store writer thread's CPU per submit at 32 connections (default): {writer_us_per_submit:.0} us"
        );
        // Where a submit's time goes, as a floor: at one connection the
        // request is served one at a time, so its time is at least berth's
        // CPU for it plus one fdatasync; at 32 the cores are shared, so the
        // rate is at most the cores over berth's CPU per submit (wrk, on
        // the same cores, takes its share of them too).
        let fsync_us = 1e6 / fsyncs.max(1.0);
        let one_us = 1e6 / exclusive.0 .0.max(1.0);
        common::record(
            "time per submit, 1 connection (default), against berth's CPU per submit (every thread) plus one fdatasync",
            &format!("{one_us:.0} us ({:.0}/s)", exclusive.0 .0),
            &format!(
                "berth's CPU {:.0} us + the fdatasync loop's mean {fsync_us:.0} us = {:.0} us",
                cpu_per_submit.0,
                cpu_per_submit.0 + fsync_us
            ),
            one_us / (cpu_per_submit.0 + fsync_us).max(1.0),
            None,
            false,
        );
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let cpu_bound = cores * 1e6 / cpu_per_submit.1.max(1.0);
        common::record(
            "submits/s, 32 connections (default), against what the cores allow at berth's CPU per submit",
            &format!("{:.0}/s (berth's CPU {:.0} us per submit, every thread)", exclusive.1 .0, cpu_per_submit.1),
            &format!(
                "{cores:.0} cores / {:.0} us = {cpu_bound:.0}/s with nothing else running; 3x the fdatasync loop would need <= {:.0} us",
                cpu_per_submit.1,
                cores * 1e6 / (3.0 * fsyncs.max(1.0))
            ),
            exclusive.1 .0 / cpu_bound.max(1.0),
            None,
            true,
        );
        // The same with wrk's share: it runs on the same cores, so what is
        // left for berth at 3x the loop is the cores' time per submit less
        // wrk's own.
        let with_wrk = cores * 1e6 / (cpu_per_submit.1 + wrk_us_per_submit).max(1.0);
        common::record(
            "submits/s, 32 connections (default), against what the cores allow at berth's and wrk's CPU per submit",
            &format!(
                "{:.0}/s (berth {:.0} us + wrk {wrk_us_per_submit:.0} us of CPU per submit)",
                exclusive.1 .0, cpu_per_submit.1
            ),
            &format!(
                "{cores:.0} cores / {:.0} us = {with_wrk:.0}/s; 3x the fdatasync loop would leave berth <= {:.0} us",
                cpu_per_submit.1 + wrk_us_per_submit,
                cores * 1e6 / (3.0 * fsyncs.max(1.0)) - wrk_us_per_submit
            ),
            exclusive.1 .0 / with_wrk.max(1.0),
            None,
            true,
        );
    }

    // Memory: a fresh server, idle, then with exactly 10,000 deployments,
    // then with 1,000 SSE clients on top; then a restart with 100,000
    // builds in the store.
    let dir = root.join("memory");
    let spawned = Instant::now();
    let (child, base, token) = start(&dir, &rt);
    let empty_start = spawned.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let idle_rss = rss_kib(child.id());
    rt.block_on(submit_many(&base, &token, 10_000, 0));
    let full_rss = rss_kib(child.id());
    let streams = rt.block_on(open_streams(&base, &token, SSE_CLIENTS));
    std::thread::sleep(Duration::from_millis(500));
    let streams_rss = rss_kib(child.id());
    drop(streams);
    let store_bytes = std::fs::metadata(dir.join("data/berth.redb"))
        .map(|m| m.len())
        .unwrap_or(0);
    common::record(
        "RSS idle",
        &format!("{:.1} MiB", idle_rss as f64 / 1024.0),
        "goal: under 30 MiB",
        idle_rss as f64 / 1024.0 / 30.0,
        Some(1.0),
        false,
    );
    common::record(
        "RSS, 10,000 deployments + 1,000 SSE clients",
        &format!(
            "{:.1} MiB ({:.1} MiB before the clients)",
            streams_rss as f64 / 1024.0,
            full_rss as f64 / 1024.0
        ),
        "goal: under 200 MiB",
        streams_rss as f64 / 1024.0 / 200.0,
        Some(1.0),
        false,
    );
    println!(
        "store file with 10,000 deployments: {:.1} MiB",
        store_bytes as f64 / f64::from(1 << 20)
    );

    // Startup: 100,000 builds (the 10,000 above and 90,000 more queued
    // behind them), a clean stop, and the time from exec to /readyz.
    rt.block_on(submit_many(&base, &token, STARTUP_BUILDS - 10_000, 10_000));
    stop_gracefully(child, &dir);
    let spawned = Instant::now();
    let (child, base, token) = start(&dir, &rt);
    let full_start = spawned.elapsed();
    let builds = rt
        .block_on(common::metrics(&reqwest::Client::new(), &base, &token))
        .lines()
        .filter(|l| l.starts_with("berth_builds{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    stop(child, &dir);
    assert!(
        builds >= STARTUP_BUILDS as f64,
        "the store holds {builds} builds, not {STARTUP_BUILDS}"
    );
    // The same store held alone, killed with a redo log as full as it
    // gets (no checkpoint in the minute it is given, and rows short of the
    // `CHECKPOINT_BYTES` that would force one): the next start replays
    // all of it.
    let (child, base, token) = start_with(&dir, &rt, &["--checkpoint-interval", "60s"]);
    rt.block_on(submit_many(&base, &token, FULL_LOG_SUBMITS, 0));
    stop(child, &dir);
    let redo_bytes = std::fs::metadata(dir.join("data/berth.redo"))
        .map(|m| m.len())
        .unwrap_or(0);
    let spawned = Instant::now();
    let (child, _, _) = start(&dir, &rt);
    let replayed_start = spawned.elapsed();
    stop(child, &dir);
    common::record(
        "startup, 100,000 builds, after kill -9 (default: redo log)",
        &format!(
            "{:.0} ms to ready, replaying a redo log of {:.1} MiB ({FULL_LOG_SUBMITS} submits' rows, near the most it holds)",
            replayed_start.as_secs_f64() * 1000.0,
            redo_bytes as f64 / f64::from(1 << 20)
        ),
        "goal under 1 s",
        replayed_start.as_secs_f64(),
        Some(1.0),
        false,
    );
    common::record(
        "startup, 100,000 builds",
        &format!("{:.0} ms to ready", full_start.as_secs_f64() * 1000.0),
        &format!(
            "an empty store: {:.0} ms; goal under 1 s",
            empty_start.as_secs_f64() * 1000.0
        ),
        full_start.as_secs_f64(),
        Some(1.0),
        false,
    );
    let _ = std::fs::remove_dir_all(&root);
}
