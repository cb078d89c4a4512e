//! The audit chain's costs, each next to a baseline from the same run:
//!
//! 1. What the audit append adds to a submit's transaction: submit write
//!    jobs (each with its event) against the same jobs with a second event
//!    appended, in group commits of 256 (so the fsync is shared and the
//!    CPU work shows).
//! 2. `berth audit verify` over a chain of 1,000,000 events (events/s),
//!    against `sha256sum` over a file of the same number of bytes.
//! 3. Proof route latency at 1,000,000 events, against `/healthz` on the
//!    same connection (a lean client: one keep-alive connection, in turn).

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth::audit::{Actor, AuditResult, Draft};
use berth::engine::audit::{system_draft, Record};
use berth::engine::requests::{submit_tx, Mode, SubmitRecord};
use berth::model::{Snapshot, Source};
use berth::store::Store;

const CHAIN: u64 = 1_000_000;
const EVENTS_PER_TXN: u64 = 20_000;
const JOBS: usize = 20_000;
const PROOFS: usize = 400;

fn draft(i: u64) -> Draft {
    Draft {
        at: berth::model::now_millis(),
        actor: Some(Actor {
            subject: format!("user{}@example.org", i % 1000),
            issuer: Some("https://id.example.org".into()),
        }),
        trusted_backend: true,
        action: "submit",
        deployment: Some(format!("d{}", i % 10_000)),
        build: Some("01a22bfb-27b9-7222-a157-9af6b48ca15a".into()),
        node: None,
        request_id: format!("01a22bfb27a272b7bf90ca577a1a{i:08}"),
        result: AuditResult::Ok,
        reason: None,
        count: 1,
    }
}

fn submit_record(n: usize) -> SubmitRecord {
    SubmitRecord {
        id: format!("d{n}"),
        snapshot: Snapshot {
            configuration: "{\"domain\":\"a.example.org\"}".into(),
            source: Source {
                url: "builtin:modules".into(),
                rev: "r".into(),
                digest: format!("sha256:{}", "a".repeat(64)),
            },
        },
        method: "local".into(),
        domain: None,
        mode: Mode::Enqueue,
        update_policy: None,
        auto_rollback: None,
        max_queued: 1_000_000,
        rollout_policy: None,
    }
}

/// Seconds for `JOBS` submit jobs, 256 in flight, each appending
/// `extra` events beyond its own.
fn submit_jobs(rt: &tokio::runtime::Runtime, dir: &Path, extra: u64) -> f64 {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let store = Store::open(&dir.join("berth.redb")).unwrap();
    let hub = Arc::new(berth::events::Hub::default());
    let start = Instant::now();
    rt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for n in 0..JOBS {
            let (store, hub) = (store.clone(), hub.clone());
            set.spawn(async move {
                store
                    .write(move |tx| {
                        let record =
                            Record::audit_only(system_draft("submit", None, AuditResult::Ok));
                        let out = submit_tx(tx, &hub, &submit_record(n), &record)?;
                        for i in 0..extra {
                            tx.append_audit(&draft(i))?;
                        }
                        Ok(out.is_ok())
                    })
                    .await
                    .unwrap()
            });
            if set.len() >= 256 {
                assert!(set.join_next().await.unwrap().unwrap());
            }
        }
        while let Some(r) = set.join_next().await {
            assert!(r.unwrap());
        }
    });
    let took = start.elapsed().as_secs_f64();
    store.close().unwrap();
    took
}

/// Writes a chain of `CHAIN` events; returns the bytes of its rows.
fn write_chain(rt: &tokio::runtime::Runtime, data: &Path) -> u64 {
    std::fs::create_dir_all(data).unwrap();
    let store = Store::open(&data.join("berth.redb")).unwrap();
    let mut bytes = 0u64;
    for batch in 0..CHAIN / EVENTS_PER_TXN {
        bytes += rt
            .block_on(store.write(move |tx| {
                let mut b = 0u64;
                for i in 0..EVENTS_PER_TXN {
                    b += tx
                        .append_audit(&draft(batch * EVENTS_PER_TXN + i))?
                        .row
                        .len() as u64;
                }
                Ok(b)
            }))
            .unwrap();
    }
    store.close().unwrap();
    bytes
}

fn seconds_of(cmd: &mut Command) -> f64 {
    let start = Instant::now();
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{:?}: {}",
        cmd,
        String::from_utf8_lossy(&out.stderr)
    );
    start.elapsed().as_secs_f64()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let root = std::env::temp_dir().join(format!("berth-bench-audit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let rt = common::runtime();

    // 1. The append's share of a submit transaction.
    let one = submit_jobs(&rt, &root.join("jobs-1"), 0);
    let two = submit_jobs(&rt, &root.join("jobs-2"), 1);
    let per_job = one / JOBS as f64 * 1e6;
    let append = (two - one) / JOBS as f64 * 1e6;
    println!(
        "submit jobs with their audit event: {:.0}/s ({per_job:.1} us each); one more event per job: {:.0}/s, so one append costs {append:.1} us ({:.0}% of an audited submit job; without it about {:.0}/s)",
        JOBS as f64 / one,
        JOBS as f64 / two,
        100.0 * append / per_job,
        1e6 / (per_job - append).max(0.1),
    );

    // 2. verify over 1,000,000 events against sha256sum of as many bytes.
    let data = root.join("chain/data");
    let start = Instant::now();
    let row_bytes = write_chain(&rt, &data);
    println!(
        "wrote {CHAIN} events ({} MB of rows) in {:.1} s; store file {} MB",
        row_bytes / 1_000_000,
        start.elapsed().as_secs_f64(),
        std::fs::metadata(data.join("berth.redb")).unwrap().len() / 1_000_000
    );
    let same_bytes = root.join("same-bytes");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&same_bytes).unwrap();
        let block = vec![b'x'; 1 << 20];
        let mut left = row_bytes;
        while left > 0 {
            let n = left.min(block.len() as u64) as usize;
            f.write_all(&block[..n]).unwrap();
            left -= n as u64;
        }
    }
    // Warm both files into the page cache, then time each three times.
    let _ = std::fs::read(data.join("berth.redb"));
    let _ = std::fs::read(&same_bytes);
    let berth = env!("CARGO_BIN_EXE_berth");
    let mut verify = Vec::new();
    let mut sha = Vec::new();
    for _ in 0..3 {
        verify.push(seconds_of(
            Command::new(berth)
                .args(["audit", "verify", "--json", "--data-dir"])
                .arg(&data),
        ));
        sha.push(seconds_of(Command::new("sha256sum").arg(&same_bytes)));
    }
    verify.sort_by(f64::total_cmp);
    sha.sort_by(f64::total_cmp);
    let (v, s) = (verify[1], sha[1]);
    println!(
        "verify of {CHAIN} events: {:.2} s = {:.0} events/s (median of 3); sha256sum of the same {} MB: {:.2} s; verify / hash limit = {:.2}x",
        v,
        CHAIN as f64 / v,
        row_bytes / 1_000_000,
        s,
        v / s
    );

    // 3. Proof latency at 1,000,000 events, next to /healthz.
    let deployer = common::deployer_script(&root, "printf '{}' > \"$BERTH_RESULT\"");
    let started = rt.block_on(common::start_berth(
        &root.join("chain"),
        &deployer,
        &[],
        &[],
    ));
    let (base, token) = (started.base.clone(), started.token.trim().to_string());
    let (healthz, proofs, consistency) = rt.block_on(async {
        let http = reqwest::Client::new();
        let timed = |path: String| {
            let (http, base, token) = (http.clone(), base.clone(), token.clone());
            async move {
                let start = Instant::now();
                let r = http
                    .get(format!("{base}{path}"))
                    .bearer_auth(&token)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200, "{path}");
                let _ = r.bytes().await.unwrap();
                start.elapsed()
            }
        };
        let (mut h, mut p, mut c) = (Vec::new(), Vec::new(), Vec::new());
        let mut x = 12345u64;
        for _ in 0..PROOFS {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let seq = 1 + (x >> 11) % CHAIN;
            let from = 1 + (x >> 23) % CHAIN;
            h.push(timed("/healthz".into()).await);
            p.push(timed(format!("/v1/audit/proof?seq={seq}&size={CHAIN}")).await);
            c.push(timed(format!("/v1/audit/consistency?from={from}&to={CHAIN}")).await);
        }
        h.sort();
        p.sort();
        c.sort();
        (h, p, c)
    });
    let mut child = started.child;
    let _ = child.kill();
    let _ = child.wait();
    for (name, t) in [
        ("/healthz", &healthz),
        ("inclusion proof", &proofs),
        ("consistency proof", &consistency),
    ] {
        println!(
            "{name} at {CHAIN} events: median {:.2} ms, p99 {:.2} ms ({} calls)",
            percentile(t, 0.5).as_secs_f64() * 1e3,
            percentile(t, 0.99).as_secs_f64() * 1e3,
            t.len()
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}
