//! kill -9 at a random instant while clients submit, enqueue, cancel and
//! delete and deployers write logs; after each restart, check what berth
//! promised. `cargo test` runs a short series (`BERTH_TORTURE_TRIALS`,
//! default 10); `tools/torture` runs a long one.
//!
//! After each restart: every acknowledged mutation is there; no build is
//! `running` without a live deployer; a finished build's SSE replay equals
//! its stored log, with event ids strictly increasing (none reused across
//! the crash); a request whose answer was lost, retried with its
//! idempotency key, takes effect exactly once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::*;

/// A small, fast pseudo-random sequence (the trials must not depend on a
/// crate of their own; the seed is printed so a failure can be replayed).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One mutation a client sent, with its key, and what it got (if anything).
#[derive(Clone, Debug)]
pub(crate) struct Sent {
    method: &'static str,
    path: String,
    body: Value,
    key: String,
    pub(crate) answer: Option<(u16, Value)>,
}

const DEPLOYMENTS: [&str; 3] = ["t-alpha", "t-beta", "t-gamma"];

pub(crate) async fn send(
    s_base: &str,
    token: &str,
    http: &reqwest::Client,
    sent: &Sent,
) -> Option<(u16, Value)> {
    let url = format!("{s_base}{}", sent.path);
    let req = match sent.method {
        "POST" => http.post(url).json(&sent.body),
        _ => http.delete(url),
    };
    let r = req
        .bearer_auth(token)
        .header("idempotency-key", &sent.key)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    let status = r.status().as_u16();
    let body = r.json::<Value>().await.ok()?;
    Some((status, body))
}

/// One client: random mutations until the server goes away.
async fn run_client(
    base: String,
    token: String,
    seed: u64,
    log: Arc<Mutex<Vec<Sent>>>,
    builds: Arc<Mutex<Vec<String>>>,
) {
    let http = client();
    let mut rng = Rng(seed | 1);
    for n in 0.. {
        let dep = DEPLOYMENTS[rng.below(3) as usize];
        let key = format!("torture-{seed:x}-{n:06}");
        let known = builds.lock().unwrap().clone();
        let sent = match rng.below(10) {
            0..=5 => Sent {
                method: "POST",
                path: format!("/v1/deployments/{dep}/submit"),
                body: json!({"configuration": mastodon(&format!("{dep}.example.org")), "mode": if rng.below(2) == 0 { "replace" } else { "enqueue" }}),
                key,
                answer: None,
            },
            6..=7 if !known.is_empty() => Sent {
                method: "POST",
                path: format!(
                    "/v1/builds/{}/cancel",
                    known[rng.below(known.len() as u64) as usize]
                ),
                body: json!({}),
                key,
                answer: None,
            },
            _ => Sent {
                method: "DELETE",
                path: format!("/v1/deployments/{dep}"),
                body: json!({}),
                key,
                answer: None,
            },
        };
        let index = {
            let mut log = log.lock().unwrap();
            log.push(sent.clone());
            log.len() - 1
        };
        let answer = send(&base, &token, &http, &sent).await;
        let gone = answer.is_none();
        if let Some((_, body)) = &answer {
            if let Some(id) = body["build_id"].as_str() {
                builds.lock().unwrap().push(id.to_string());
            }
        }
        log.lock().unwrap()[index].answer = answer;
        if gone {
            return;
        }
    }
}

/// What the clients of one trial sent (with the answers), the builds they
/// know of, and the clients themselves.
pub(crate) type Trial = (
    Arc<Mutex<Vec<Sent>>>,
    Arc<Mutex<Vec<String>>>,
    Vec<tokio::task::JoinHandle<()>>,
);

/// Four clients sending random mutations to `s` until it goes away.
pub(crate) fn spawn_clients(s: &Server, seed: u64, known_builds: &[String]) -> Trial {
    let log = Arc::new(Mutex::new(Vec::new()));
    let builds = Arc::new(Mutex::new(known_builds.to_vec()));
    let clients = (0..4)
        .map(|c| {
            tokio::spawn(run_client(
                s.base.clone(),
                s.token.clone(),
                seed ^ c,
                log.clone(),
                builds.clone(),
            ))
        })
        .collect();
    (log, builds, clients)
}

/// With a shared store (`--shared-store`): every commit is redb's own.
#[tokio::test]
async fn kill_9_at_random_instants_loses_nothing_acknowledged() {
    kill_trials(&["--shared-store"], 10).await;
}

/// The same with the store held alone (the default): every commit through
/// the redo log (src/store/redo.rs); the audit chain is verified beside
/// the running server from the snapshot it copies (src/store/snapshot.rs).
#[tokio::test]
async fn kill_9_with_the_redo_log_loses_nothing_acknowledged() {
    kill_trials(&[], 5).await;
}

/// Two replicas on PostgreSQL behind a round-robin proxy (cluster.md):
/// the leader is killed at a random instant and started again as a
/// standby while the other takes over; the same checks through the proxy,
/// and the audit chain verified in the database.
#[tokio::test]
async fn kill_9_of_the_leader_of_two_replicas_loses_nothing_acknowledged() {
    kill_trials_of(Kill::Leader, &[], 3).await;
}

/// What a trial kills.
#[derive(Clone, Copy)]
enum Kill {
    /// The one server, started again on its data dir.
    Server,
    /// The leading replica of two; the other takes over.
    Leader,
}

async fn kill_trials(args: &[&str], default_trials: u64) {
    kill_trials_of(Kill::Server, args, default_trials).await;
}

async fn kill_trials_of(kill: Kill, args: &[&str], default_trials: u64) {
    let trials: u64 = std::env::var("BERTH_TORTURE_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_trials);
    let seed: u64 = std::env::var("BERTH_TORTURE_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::process::id() as u64 * 7919 + 17);
    eprintln!("torture: {trials} trials, seed {seed} (BERTH_TORTURE_SEED to replay)");
    let mut rng = Rng(seed);
    // A webhook receiver: every acknowledged build's `build.queued` must
    // arrive at least once, through every kill (notifications.md).
    let queued_seen: Arc<Mutex<std::collections::HashSet<String>>> = Arc::default();
    let seen = queued_seen.clone();
    let (hook_url, _hook_task) = json_server(Arc::new(move |body: Value| {
        if body["type"] == "build.queued" {
            if let Some(id) = body["data"]["id"].as_str() {
                seen.lock().unwrap().insert(id.to_string());
            }
        }
        (200, json!({}))
    }))
    .await;
    let mut options = Options::default()
        .env("BERTH_LOCAL_STEP_MS", "2")
        .arg("--webhook-origin")
        .arg(hook_url.trim_end_matches('/'))
        .arg("--webhook-retry-schedule")
        .arg(&["200ms"; 30].join(","));
    for a in args {
        options = options.arg(a);
    }
    let mut s = match kill {
        Kill::Server => Server::start(options).await,
        Kill::Leader => match Server::start_replicas(options, 2).await {
            Some(s) => s,
            None => return,
        },
    };
    let (status, made) = read(
        s.post(
            "/v1/webhooks",
            &json!({"url": hook_url, "events": ["build.queued"]}),
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(status, 201, "{made}");
    let mut acknowledged_builds: Vec<String> = Vec::new();
    let mut acknowledged = 0usize;
    let mut seen_builds: Vec<String> = Vec::new();
    // On a loaded machine a short run can see every kill land before any
    // answer: it then runs more trials (up to 3x) rather than check nothing.
    let mut trial = 0u64;
    while trial < trials || (acknowledged == 0 && trial < trials * 3) {
        trial += 1;
        let (log, builds, clients) = spawn_clients(&s, seed ^ (trial << 8), &seen_builds);
        // The kill lands at a random instant once work is flowing: on a
        // loaded machine the first answer can take longer than the window.
        let flowing = std::time::Instant::now();
        while flowing.elapsed() < Duration::from_secs(5)
            && !log.lock().unwrap().iter().any(|m| m.answer.is_some())
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
        match kill {
            Kill::Server => {
                s.kill();
                for c in clients {
                    let _ = c.await;
                }
                s.launch().await;
            }
            Kill::Leader => {
                // Clients see the other replica take over (503s, then
                // answers), not a server gone: they are stopped here, and
                // what was in flight counts as an answer lost.
                s.kill_leader().await;
                for c in clients {
                    c.abort();
                    let _ = c.await;
                }
            }
        }
        // The audit chain survived the crash intact (read beside the
        // server: from the live file, a snapshot of a store held alone, or
        // the cluster's database).
        verify_beside(&s, kill, trial);
        let sent = log.lock().unwrap().clone();
        seen_builds = builds.lock().unwrap().clone();
        let acked = check_after_restart(&s, trial, &sent, &seen_builds).await;
        acknowledged += acked.len();
        acknowledged_builds.extend(acked);
    }
    // Counts by deployment, to show the run did something.
    let mut per: HashMap<&str, usize> = HashMap::new();
    for d in DEPLOYMENTS {
        let (_, list) = s
            .json(&format!("/v1/deployments/{d}/builds?limit=200"))
            .await;
        per.insert(d, list["items"].as_array().map_or(0, Vec::len));
    }
    // Every acknowledged build's `build.queued` reached the receiver.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let missing: Vec<String> = {
            let seen = queued_seen.lock().unwrap();
            acknowledged_builds
                .iter()
                .filter(|b| !seen.contains(*b))
                .cloned()
                .collect()
        };
        if missing.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "build.queued never arrived for {} acknowledged builds, e.g. {:?}",
            missing.len(),
            &missing[..missing.len().min(3)]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("torture: {trials} trials, {acknowledged} acknowledged mutations, builds per deployment {per:?}, every acknowledged build's build.queued delivered ({} builds)", acknowledged_builds.len());
    assert!(
        acknowledged > 0,
        "no mutation was acknowledged: the trials checked nothing"
    );
}

fn verify_beside(s: &Server, kill: Kill, trial: u64) {
    let data = s.dir.join("data");
    let store = match kill {
        Kill::Server => None,
        Kill::Leader => Some(s.store_url()),
    };
    let (code, report) = match &store {
        None => berth(&[
            "audit",
            "verify",
            "--json",
            "--data-dir",
            data.to_str().expect("a UTF-8 temp path"),
        ]),
        Some(url) => berth(&["audit", "verify", "--json", "--store", url]),
    };
    assert_eq!(
        code, 0,
        "trial {trial}: audit verify after a kill -9: {report}"
    );
}

/// What every restart must show (a kill -9 or a power cut before it):
/// every acknowledged mutation is there, a lost answer retried takes
/// effect once, no build runs without its deployer, finished builds replay
/// their stored log. Returns the acknowledged builds.
pub(crate) async fn check_after_restart(
    s: &Server,
    trial: u64,
    sent: &[Sent],
    seen_builds: &[String],
) -> Vec<String> {
    let mut acknowledged = Vec::new();

    // Every acknowledged mutation is there.
    for m in sent
        .iter()
        .filter(|m| m.answer.as_ref().is_some_and(|(st, _)| *st == 202))
    {
        let body = &m.answer.as_ref().unwrap().1;
        let id = body["build_id"]
            .as_str()
            .or_else(|| body["id"].as_str())
            .unwrap_or_else(|| panic!("trial {trial}: a 202 without a build: {body}"));
        let (status, b) = s.json(&format!("/v1/builds/{id}")).await;
        assert_eq!(
            status, 200,
            "trial {trial}: acknowledged build {id} is gone ({m:?})"
        );
        acknowledged.push(id.to_string());
        assert!(b["status"].is_string());
    }

    // A request whose answer was lost takes effect exactly once when
    // retried with its key: the retry and a second retry agree.
    for m in sent.iter().filter(|m| m.answer.is_none()) {
        let http = client();
        let first = send(&s.base, &s.token, &http, m)
            .await
            .expect("an answer after restart");
        let second = send(&s.base, &s.token, &http, m).await.expect("an answer");
        assert_eq!(
            first, second,
            "trial {trial}: a retry took effect twice ({m:?})"
        );
        assert!(first.0 < 500, "trial {trial}: {first:?}");
    }

    // No build runs without a live deployer; finished builds replay
    // their stored log exactly, ids strictly increasing.
    for id in seen_builds.iter().rev().take(6) {
        let b = s.build(id).await;
        if b["status"] == "running" {
            // Its deployer is alive, or it has just exited and its
            // final commit lands at once; a build left running for
            // good is the failure.
            let pid: i32 = b["job_id"]
                .as_str()
                .and_then(|j| j.strip_prefix("pid:"))
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            let alive = pid > 0 && std::path::Path::new(&format!("/proc/{pid}")).exists();
            if !alive {
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                while s.build(id).await["status"] == "running" {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "trial {trial}: build {id} stays running without its deployer: {b}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            continue;
        }
        if b["status"] == "queued" {
            continue;
        }
        let text = s.log_text(id).await;
        let mut stream = Sse::open(s.get(&format!("/v1/builds/{id}/events"))).await;
        let events = stream.until_end().await;
        let mut last = 0;
        let mut replayed = String::new();
        for e in &events {
            if let Some(seq) = e.id {
                assert!(
                    seq > last,
                    "trial {trial}: build {id}: id {seq} after {last}"
                );
                last = seq;
            }
            if e.event == "log" {
                replayed.push_str(&e.data);
                replayed.push('\n');
            }
        }
        assert_eq!(
            replayed, text,
            "trial {trial}: build {id}: replay differs from the log"
        );
    }
    acknowledged
}
