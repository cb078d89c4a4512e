//! Live-tail figures (events.md "Live-tail performance"):
//! - latency from the deployer's write() of a line to a subscribed client's
//!   receipt, p50/p99, at 10,000 lines/s with 10 subscribers and at 1,000
//!   lines/s with 1,000 subscribers, against a plain pipe from a writer
//!   process to a reader measured in the same run;
//! - log ingest throughput for a deployer that writes as fast as it can,
//!   against `cat` of the same bytes to /dev/null;
//! - zstd ratio of a realistic build log, chunked as berth stores it;
//! - the 1,000-subscriber latency again while 32 connections submit (wrk,
//!   the store held alone), next to the same run alone, and the submits/s
//!   during it next to their rate alone on the same server.
//!
//! This executable is also the deployer berth runs (and the pipe writer).
//! Run: `cargo bench --bench events` (`BENCH_ONLY=fanout`, `mixed` or
//! `ingest` for one part).

mod common;

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The latency goal of a live line at p99 (events.md), in milliseconds.
const SSE_P99_GOAL_MS: f64 = 10.0;

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// Writes `lines` timestamped lines at `rate` per second to stdout.
fn paced_writer(lines: u64, rate: u64) {
    let out = std::io::stdout();
    let mut out = out.lock();
    let start = Instant::now();
    for i in 0..lines {
        let due = start + Duration::from_nanos(i * 1_000_000_000 / rate);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        // One write() per line, as a deployer's line-buffered output does.
        let line = format!(
            "ts={} building '/nix/store/{:032x}-pkg-{i}.drv'...\n",
            now_nanos(),
            i
        );
        out.write_all(line.as_bytes()).unwrap();
        out.flush().unwrap();
    }
}

fn deployer(verb: &str) {
    let result = std::env::var("BERTH_RESULT").unwrap();
    std::io::copy(&mut std::io::stdin(), &mut std::io::sink()).unwrap();
    let answer = match verb {
        "describe" => {
            r#"{"methods":["local"],"default_method":"local","catalog":[],"schema":null}"#
        }
        "eval" => r#"{"nodes":[]}"#,
        _ => {
            let go = std::env::var("BENCH_GO_FILE").unwrap_or_default();
            while !go.is_empty() && !std::path::Path::new(&go).exists() {
                std::thread::sleep(Duration::from_millis(5));
            }
            match std::env::var("BENCH_MODE").as_deref() {
                Ok("cat") => {
                    let status = Command::new("cat")
                        .arg(std::env::var("BENCH_FILE").unwrap())
                        .status()
                        .unwrap();
                    assert!(status.success());
                }
                _ => {
                    let lines = std::env::var("BENCH_LINES").unwrap().parse().unwrap();
                    let rate = std::env::var("BENCH_RATE").unwrap().parse().unwrap();
                    paced_writer(lines, rate);
                }
            }
            r#"{"nodes":[]}"#
        }
    };
    std::fs::write(result, answer).unwrap();
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1e6
}

fn pipe_baseline(lines: u64, rate: u64) -> Vec<u64> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg("pipe-writer")
        .env("BENCH_LINES", lines.to_string())
        .env("BENCH_RATE", rate.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let reader = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut lat = Vec::new();
    for line in reader.lines() {
        let line = line.unwrap();
        let ts: u64 = line
            .strip_prefix("ts=")
            .and_then(|r| r.split(' ').next())
            .unwrap()
            .parse()
            .unwrap();
        lat.push(now_nanos().saturating_sub(ts));
    }
    child.wait().unwrap();
    lat.sort_unstable();
    lat
}

/// The cores berth, its fan-out thread, this bench (its SSE readers) and
/// its finished children (wrk) used from `start` to `cores`, from `/proc`.
struct CpuShare {
    berth: u32,
    at: Instant,
    used: [f64; 4],
}

impl CpuShare {
    /// CPU so far, in us: [berth, its fan-out thread (none before the
    /// first live stream), this bench, wrk].
    fn now(berth: u32) -> [f64; 4] {
        let me = std::path::Path::new("/proc/self/stat");
        [
            common::stat_cpu_us(std::path::Path::new(&format!("/proc/{berth}/stat"))),
            common::thread_cpu_us(berth, "berth-fanout").unwrap_or(0.0),
            common::stat_cpu_us(me),
            common::stat_children_cpu_us(me),
        ]
    }

    fn start(berth: u32) -> CpuShare {
        CpuShare {
            berth,
            at: Instant::now(),
            used: CpuShare::now(berth),
        }
    }

    /// What `now` counts, as cores since `start`.
    fn cores(&self) -> [f64; 4] {
        let wall_us = self.at.elapsed().as_secs_f64() * 1e6;
        let now = CpuShare::now(self.berth);
        std::array::from_fn(|i| (now[i] - self.used[i]) / wall_us)
    }
}

struct Berth {
    child: std::process::Child,
    base: String,
    token: String,
    dir: std::path::PathBuf,
    http: reqwest::Client,
}

impl Berth {
    async fn start(dir: &std::path::Path, envs: &[(&str, String)]) -> Berth {
        Berth::start_with(dir, envs, &[]).await
    }

    async fn start_with(dir: &std::path::Path, envs: &[(&str, String)], args: &[&str]) -> Berth {
        let deployer = std::env::current_exe().unwrap();
        let started = common::start_berth(dir, &deployer, args, envs).await;
        Berth {
            child: started.child,
            base: started.base,
            token: started.token,
            dir: dir.to_path_buf(),
            http: reqwest::Client::new(),
        }
    }

    async fn submit(&self, id: &str) -> String {
        let r = self
            .http
            .post(format!("{}/v1/deployments/{id}/submit", self.base))
            .bearer_auth(&self.token)
            .json(&serde_json::json!({"configuration": {}, "mode": "enqueue"}))
            .send()
            .await
            .unwrap();
        let v: serde_json::Value = r.json().await.unwrap();
        v["build_id"].as_str().unwrap().to_string()
    }

    async fn build(&self, id: &str) -> serde_json::Value {
        let r = self
            .http
            .get(format!("{}/v1/builds/{id}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        r.json().await.unwrap()
    }

    async fn wait_final(&self, id: &str) -> serde_json::Value {
        loop {
            let b = self.build(id).await;
            if b["finished_at"].is_string() {
                return b;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Berth {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Subscribes `n` clients, lets the deployer start, returns all latencies.
async fn berth_latency(berth: &Berth, deployment: &str, n: usize) -> Vec<u64> {
    let build = berth.submit(deployment).await;
    latency_of(berth, deployment, build, n).await
}

/// As `berth_latency`, for a build already submitted (and running).
async fn latency_of(berth: &Berth, deployment: &str, build: String, n: usize) -> Vec<u64> {
    let go = berth.dir.join(format!("go-{deployment}"));
    // The client: one thread, epoll over every socket. It shares the two
    // cores with berth, so it must cost as little as it can per read.
    let addr = berth.base.trim_start_matches("http://").to_string();
    let request = format!("GET /v1/builds/{build}/events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\r\n", berth.token.trim());
    let client = std::thread::spawn(move || epoll_client(&addr, &request, n));
    // Start only when every subscriber is connected (berth_sse_clients).
    loop {
        let m = common::metrics(&berth.http, &berth.base, &berth.token).await;
        let open: usize = m
            .lines()
            .find_map(|l| l.strip_prefix("berth_sse_clients "))
            .unwrap()
            .parse()
            .unwrap();
        if open >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    std::fs::write(&go, b"").unwrap();
    let mut all = tokio::task::spawn_blocking(move || client.join().unwrap())
        .await
        .unwrap();
    berth.wait_final(&build).await;
    all.sort_unstable();
    all
}

/// `n` SSE connections read by one thread with epoll; returns every line's
/// latency (receipt time minus the `ts=` the deployer wrote).
fn epoll_client(addr: &str, request: &str, n: usize) -> Vec<u64> {
    use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
    use std::io::{Read, Write};
    let epoll = Epoll::new(EpollCreateFlags::empty()).unwrap();
    let mut socks = Vec::with_capacity(n);
    for i in 0..n {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        s.set_nonblocking(true).unwrap();
        epoll
            .add(&s, EpollEvent::new(EpollFlags::EPOLLIN, i as u64))
            .unwrap();
        socks.push(s);
    }
    let mut bufs: Vec<(Vec<u8>, usize)> = (0..n).map(|_| (vec![0u8; 256 * 1024], 0)).collect();
    let mut done = vec![false; n];
    let mut open = n;
    let mut lat = Vec::with_capacity(n * 4096);
    let mut events = vec![EpollEvent::empty(); 256];
    while open > 0 {
        let ready = epoll.wait(&mut events, 30_000u16).unwrap();
        assert!(ready > 0, "the streams stalled");
        for ev in &events[..ready] {
            let i = ev.data() as usize;
            let (buf, filled) = &mut bufs[i];
            loop {
                let room = buf.len() - *filled;
                match socks[i].read(&mut buf[*filled..]) {
                    Ok(0) => {
                        if !done[i] {
                            done[i] = true;
                            open -= 1;
                        }
                        break;
                    }
                    Ok(k) => {
                        let received = now_nanos();
                        *filled += k;
                        let complete = buf[..*filled]
                            .iter()
                            .rposition(|&b| b == b'\n')
                            .map_or(0, |p| p + 1);
                        for line in buf[..complete].split(|&b| b == b'\n') {
                            if let Some(rest) = line.strip_prefix(b"data: ts=") {
                                let ts = rest
                                    .iter()
                                    .take_while(|b| b.is_ascii_digit())
                                    .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
                                lat.push(received.saturating_sub(ts));
                            } else if line.starts_with(b"event: end") && !done[i] {
                                done[i] = true;
                                open -= 1;
                            }
                        }
                        buf.copy_within(complete..*filled, 0);
                        *filled -= complete;
                        // Level-triggered: what a read left is reported
                        // again, so one read per readiness is enough unless
                        // it filled the buffer.
                        if k < room {
                            break;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => panic!("read: {e}"),
                }
            }
            if done[i] {
                let _ = epoll.delete(&socks[i]);
            }
        }
    }
    lat
}

/// The floor of the fan-out on this machine: one thread that writes each
/// line to `n` loopback sockets itself (no berth, no pipe, no HTTP), read by
/// the same epoll client. A line's time is when it was due, so a writer
/// that falls behind counts against it, as berth's lines do.
fn socket_floor(n: usize, lines: u64, rate: u64) -> Vec<u64> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let writer = std::thread::spawn(move || {
        let mut socks: Vec<std::net::TcpStream> = (0..n)
            .map(|_| {
                let (s, _) = listener.accept().unwrap();
                s.set_nodelay(true).unwrap();
                s
            })
            .collect();
        let start = Instant::now();
        let wall = now_nanos();
        let mut i = 0;
        while i < lines {
            let due = Duration::from_nanos(i * 1_000_000_000 / rate);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
            // Every line due by now goes in this pass, as berth batches.
            let mut frames = String::new();
            while i < lines && Duration::from_nanos(i * 1_000_000_000 / rate) <= start.elapsed() {
                let ts = wall + i * 1_000_000_000 / rate;
                frames.push_str(&format!(
                    "id: {i}\nevent: log\ndata: ts={ts} building '/nix/store/{i:032x}-pkg-{i}.drv'...\n\n"
                ));
                i += 1;
            }
            for s in &mut socks {
                s.write_all(frames.as_bytes()).unwrap();
            }
        }
        for s in &mut socks {
            s.write_all(b"event: end\ndata: {}\n\n").unwrap();
        }
    });
    let mut lat = epoll_client(&addr, "", n);
    writer.join().unwrap();
    lat.sort_unstable();
    lat
}

fn realistic_log(bytes: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes + 200);
    let mut i = 0u64;
    let pkgs = [
        "openssl-3.3.2",
        "glibc-2.40",
        "python3-3.12.7",
        "rustc-1.82.0",
        "nodejs-20.18.1",
        "postgresql-16.6",
    ];
    while out.len() < bytes {
        let pkg = pkgs[(i % pkgs.len() as u64) as usize];
        let h = (i.wrapping_mul(0x9e3779b97f4a7c15) >> 3) as u128 * 0x1f3d;
        let line = match i % 7 {
            0 => format!("building '/nix/store/{h:032x}-{pkg}.drv'...\n"),
            1 => format!("{pkg}> gcc -O2 -pipe -fstack-protector-strong -c src/module_{i}.c -o build/module_{i}.o\n"),
            2 => format!("{pkg}> checking for {} in -lc... yes\n", ["malloc", "pthread_create", "dlopen"][(i % 3) as usize]),
            3 => format!("{pkg}> [{:3}%] Built target obj_{}\n", i % 101, i % 977),
            4 => format!("copying path '/nix/store/{h:032x}-{pkg}' from 'https://cache.nixos.org'...\n"),
            5 => format!("{pkg}> src/module_{i}.c:{}:{}: warning: unused variable 'tmp' [-Wunused-variable]\n", i % 400, i % 80),
            _ => format!("{pkg}> test_{} ... ok ({} ms)\n", i % 5000, i % 97),
        };
        out.extend_from_slice(line.as_bytes());
        i += 1;
    }
    out
}

fn main() {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("pipe-writer") => {
            let lines = std::env::var("BENCH_LINES").unwrap().parse().unwrap();
            let rate = std::env::var("BENCH_RATE").unwrap().parse().unwrap();
            return paced_writer(lines, rate);
        }
        Some(verb @ ("describe" | "eval" | "deploy" | "destroy"))
            if std::env::var("BERTH_RESULT").is_ok() =>
        {
            return deployer(verb)
        }
        _ => {}
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = std::env::temp_dir().join(format!("berth-bench-events-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();

    // Latency.
    // BENCH_ONLY=fanout runs only the 1,000-subscriber case (for
    // profiling); BENCH_ONLY=mixed that case alone and then while 32
    // connections submit.
    // BENCH_ONLY=ingest: only the log ingest and compression figures.
    let only = std::env::var("BENCH_ONLY").ok();
    let only_fanout = only.as_deref() == Some("fanout");
    let only_mixed = only.as_deref() == Some("mixed");
    let only_ingest = only.as_deref() == Some("ingest");
    let fanout_lines = std::env::var("BENCH_FANOUT_LINES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3_000u64);
    let fanout_subs = std::env::var("BENCH_FANOUT_SUBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000usize);
    let mut fanout_p99 = 0.0;
    for (rate, subscribers, lines) in [
        (10_000u64, 10usize, 30_000u64),
        (1_000, fanout_subs, fanout_lines),
    ] {
        if ((only_fanout || only_mixed) && subscribers == 10) || only_ingest {
            continue;
        }
        let pipe = pipe_baseline(lines, rate);
        let floor = socket_floor(subscribers, lines, rate);
        let berth_lat = rt.block_on(async {
            let berth = Berth::start(
                &dir.join(format!("lat-{rate}")),
                &[
                    ("BENCH_LINES", lines.to_string()),
                    ("BENCH_RATE", rate.to_string()),
                    (
                        "BENCH_GO_FILE",
                        dir.join(format!("lat-{rate}/go-d")).display().to_string(),
                    ),
                ],
            )
            .await;
            berth_latency(&berth, "d", subscribers).await
        });
        assert_eq!(
            berth_lat.len() as u64,
            lines * subscribers as u64,
            "a subscriber missed lines"
        );
        let p99 = percentile(&berth_lat, 0.99);
        if subscribers == fanout_subs {
            fanout_p99 = p99;
        }
        common::record_with_goal(
            &format!("SSE p99, {rate} lines/s x {subscribers} subscribers"),
            &format!("{p99:.2} ms"),
            &format!(
                "plain pipe p99 {:.3} ms; one thread writing the sockets itself p99 {:.2} ms",
                percentile(&pipe, 0.99),
                percentile(&floor, 0.99)
            ),
            p99 / percentile(&pipe, 0.99).max(1e-6),
            &format!("< {SSE_P99_GOAL_MS} ms"),
            Some(p99 < SSE_P99_GOAL_MS),
        );
        println!(
            "latency at {rate} lines/s, {subscribers} subscribers: berth p50 {:.2} ms, p99 {:.2} ms; plain pipe p50 {:.3} ms, p99 {:.3} ms; one thread writing the sockets itself p50 {:.2} ms, p99 {:.2} ms",
            percentile(&berth_lat, 0.5),
            percentile(&berth_lat, 0.99),
            percentile(&pipe, 0.5),
            percentile(&pipe, 0.99),
            percentile(&floor, 0.5),
            percentile(&floor, 0.99)
        );
    }

    if only_fanout {
        return;
    }
    // The wide fan-out while 32 connections submit.
    if !only_ingest && !common::wrk_here() {
        println!("skipped: SSE while submitting: needs wrk (apt install wrk)");
    }
    if !only_ingest && common::wrk_here() {
        let (rate, lines) = (1_000u64, fanout_lines);
        let during = Duration::from_secs(lines / rate + 2);
        let (p99, solo, loaded) = rt.block_on(async {
            let here = dir.join("mixed");
            // One build slot: the fan-out's build runs, the submitted
            // builds wait; no eval per submit (as the submit bench): the
            // store's work is what is measured.
            let berth = Berth::start_with(
                &here,
                &[
                    ("BENCH_LINES", lines.to_string()),
                    ("BENCH_RATE", rate.to_string()),
                    ("BENCH_GO_FILE", here.join("go-d").display().to_string()),
                ],
                &["--build-slots", "1", "--eval-slots", "0"],
            )
            .await;
            // The fan-out's build first: it takes the one slot and waits
            // for its go file while the submits run alone.
            let build = berth.submit("d").await;
            // 32 connections of wrk submitting for `duration`, off the runtime.
            let submits = |duration: Duration| {
                let (base, token) = (berth.base.clone(), berth.token.clone());
                tokio::task::spawn_blocking(move || {
                    common::wrk_submits(&base, &token, 32, duration)
                })
            };
            // A warm-up first: a fresh store file grows (and runs slower)
            // in its first seconds.
            submits(Duration::from_secs(2)).await.unwrap();
            let cpu = CpuShare::start(berth.child.id());
            let before = submits(during).await.unwrap();
            let alone = cpu.cores();
            let cpu = CpuShare::start(berth.child.id());
            let load = submits(during);
            let lat = latency_of(&berth, "d", build, fanout_subs).await;
            let loaded = load.await.unwrap();
            let both = cpu.cores();
            // Where the 2 cores went: whether the submits could have kept
            // their solo rate beside the fan-out and its readers at all.
            println!(
                "cores used, submits alone: berth {:.2}, wrk {:.2}; with the fan-out: berth {:.2} (its fan-out thread {:.2}), wrk {:.2}, the 1000 readers (this bench) {:.2}",
                alone[0], alone[3], both[0], both[1], both[3], both[2]
            );
            // The solo rate again after it: the store is larger by then,
            // and a rate that falls as the file grows would otherwise pass
            // for the fan-out's cost (or hide it). Their mean is the solo
            // figure.
            let after = submits(during).await.unwrap();
            println!(
                "submits/s alone, 32 connections: {:.0}/s before the fan-out, {:.0}/s after it",
                before.0, after.0
            );
            (percentile(&lat, 0.99), (before.0 + after.0) / 2.0, loaded.0)
        });
        common::record_with_goal(
            &format!(
                "SSE p99, {rate} lines/s x {fanout_subs} subscribers, while 32 connections submit"
            ),
            &format!("{p99:.2} ms"),
            &format!("the same fan-out alone, same run: {fanout_p99:.2} ms"),
            p99 / fanout_p99.max(1e-6),
            &format!("< {SSE_P99_GOAL_MS} ms"),
            Some(p99 < SSE_P99_GOAL_MS),
        );
        common::record(
            "submits/s, 32 connections, during that fan-out (default: redo log)",
            &format!("{loaded:.0}/s"),
            &format!("alone on the same server, before and after it: {solo:.0}/s"),
            loaded / solo,
            Some(0.8),
            true,
        );
    }
    if only_mixed {
        return;
    }
    // Ingest throughput and compression.
    let log = realistic_log(64 << 20);
    let file = dir.join("build.log");
    std::fs::write(&file, &log).unwrap();
    let t = Instant::now();
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!("cat '{}' > /dev/null", file.display()))
        .status()
        .unwrap();
    assert!(status.success());
    let cat_mbs = log.len() as f64 / 1e6 / t.elapsed().as_secs_f64();
    let (berth_mbs, stored) = rt.block_on(async {
        let berth = Berth::start(
            &dir.join("ingest"),
            &[
                ("BENCH_MODE", "cat".into()),
                ("BENCH_FILE", file.display().to_string()),
            ],
        )
        .await;
        let id = berth.submit("ingest").await;
        let b = berth.wait_final(&id).await;
        let started = time_of(&b["started_at"]);
        let finished = time_of(&b["finished_at"]);
        (
            b["log_bytes"].as_u64().unwrap() as f64 / 1e6 / (finished - started),
            b["log_bytes"].as_u64().unwrap(),
        )
    });
    assert_eq!(stored as usize, log.len());
    // The compression every stored log pays, on the same bytes.
    let mut compressed = 0usize;
    let t = Instant::now();
    for chunk in log.chunks(1 << 20) {
        compressed += zstd::bulk::compress(chunk, 3).unwrap().len();
    }
    let zstd_mbs = log.len() as f64 / 1e6 / t.elapsed().as_secs_f64();
    common::record(
        "log ingest",
        &format!("{berth_mbs:.0} MB/s"),
        &format!("zstd -3 of the same bytes: {zstd_mbs:.0} MB/s"),
        berth_mbs / zstd_mbs,
        Some(0.8),
        true,
    );
    println!(
        "ingest of a {} MB log: berth {berth_mbs:.0} MB/s (deployer start to final commit); cat to /dev/null {cat_mbs:.0} MB/s; ratio {:.2}",
        log.len() / 1_000_000,
        berth_mbs / cat_mbs
    );
    println!(
        "zstd level 3 in 1 MiB chunks on the realistic log: ratio {:.1}",
        log.len() as f64 / compressed as f64
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn time_of(v: &serde_json::Value) -> f64 {
    let t = time::OffsetDateTime::parse(
        v.as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    t.unix_timestamp_nanos() as f64 / 1e9
}
