//! Agents (agents.md), as far as they are built: agent tokens bound to a
//! deployment's node ("Binding"), through the API and the CLI.

use serde_json::{json, Value};

use crate::harness::*;

async fn make(s: &Server, body: Value) -> (u16, Value) {
    read(s.post("/v1/tokens", &body).send().await.unwrap()).await
}

fn agent(name: &str, deployment: &str, node: &str) -> Value {
    json!({"name": name, "kind": "agent", "deployment": deployment, "node": node})
}

#[tokio::test]
async fn an_agent_token_is_bound_to_one_node_two_at_most_and_reaches_no_other_route() {
    let s = Server::start(Options::default().arg("--max-agents").arg("3")).await;
    let (status, made) = make(&s, agent("web-1", "alice", "web")).await;
    assert_eq!(status, 201, "{made}");
    assert_eq!(
        (
            made["kind"].as_str(),
            made["deployment"].as_str(),
            made["node"].as_str()
        ),
        (Some("agent"), Some("alice"), Some("web"))
    );
    let secret = made["token"].as_str().unwrap().to_string();
    assert!(secret.starts_with("brt_"));
    // A rotation: a second token for the node; a third is refused.
    assert_eq!(make(&s, agent("web-2", "alice", "web")).await.0, 201);
    let (status, refused) = make(&s, agent("web-3", "alice", "web")).await;
    assert_eq!(
        (status, refused["reason"].as_str()),
        (409, Some("node_bound")),
        "{refused}"
    );
    // --max-agents 3 in all.
    assert_eq!(make(&s, agent("db-1", "alice", "db")).await.0, 201);
    let (status, refused) = make(&s, agent("db-2", "alice", "db")).await;
    assert_eq!(
        (status, refused["reason"].as_str()),
        (409, Some("agent_limit")),
        "{refused}"
    );
    // Worker tokens count apart.
    let (status, _) = make(&s, json!({"name": "w1", "kind": "worker"})).await;
    assert_eq!(status, 201);
    // Bad shapes change nothing.
    for (body, pointer) in [
        (
            json!({"name": "x1", "kind": "agent", "deployment": "alice"}),
            "/node",
        ),
        (
            json!({"name": "x2", "kind": "agent", "node": "web"}),
            "/deployment",
        ),
        (
            json!({"name": "x3", "kind": "agent", "deployment": "alice", "node": "Web_1"}),
            "/node",
        ),
        (
            json!({"name": "x4", "kind": "agent", "deployment": "alice", "node": "web", "labels": ["gpu"]}),
            "/labels",
        ),
        (
            json!({"name": "x5", "kind": "worker", "node": "web"}),
            "/node",
        ),
    ] {
        let (status, err) = make(&s, body).await;
        assert_eq!(status, 400, "{err}");
        assert_eq!(err["fields"][0]["pointer"], pointer, "{err}");
    }
    let (_, listed) = s.json("/v1/tokens").await;
    let names: Vec<&str> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(names, ["db-1", "w1", "web-1", "web-2"]);
    assert!(
        listed.to_string().find("brt_").is_none(),
        "a list never shows a secret"
    );
    // The CLI shows the binding.
    let token_file = s.dir.join("data/service-token");
    let (code, out) = berth(&[
        "tokens",
        "list",
        "--url",
        &s.base,
        "--token-file",
        token_file.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("alice/web") && out.contains("alice/db"),
        "{out}"
    );
    // An agent token reaches no worker route and no public one.
    for path in [
        "/internal/v1/queue?worker_incarnation=incarnation-0001&free_slots=1&wait=0",
        "/v1/deployments",
    ] {
        let r = s
            .http
            .get(s.url(path))
            .bearer_auth(&secret)
            .send()
            .await
            .unwrap();
        let (status, err) = read(r).await;
        assert_eq!(
            (status, err["reason"].as_str()),
            (403, Some("token_kind")),
            "{path}: {err}"
        );
    }
    // Revoked: 401 at once.
    let r = s.delete("/v1/tokens/web-1").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = s
        .http
        .get(s.url("/v1/deployments"))
        .bearer_auth(&secret)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(
        make(&s, agent("web-3", "alice", "web")).await.0,
        201,
        "a rotation's place came free"
    );
}

/// A running `berth agent` with its own state dir and log.
pub(crate) struct Agent {
    child: std::process::Child,
    pub(crate) dir: std::path::PathBuf,
}

impl Agent {
    pub(crate) fn start(
        s: &Server,
        token: &str,
        node: &str,
        dir: &std::path::Path,
        flags: &[&str],
    ) -> Agent {
        Agent::start_at(&s.base, token, node, dir, flags)
    }

    /// An agent of berth at `url` (a proxy in front of it).
    pub(crate) fn start_at(
        url: &str,
        token: &str,
        node: &str,
        dir: &std::path::Path,
        flags: &[&str],
    ) -> Agent {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir).unwrap();
        let token_file = dir.join("token");
        std::fs::write(&token_file, token).unwrap();
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let log = std::fs::File::create(dir.join("agent.log")).unwrap();
        // Reports every second unless the test says otherwise.
        let interval: &[&str] = match flags.contains(&"--report-interval") {
            true => &[],
            false => &["--report-interval", "1s"],
        };
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
            .args(["agent", "--url", url, "--node", node])
            .args(interval)
            .arg("--token-file")
            .arg(&token_file)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(flags)
            .env("BERTH_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start berth agent");
        Agent {
            child,
            dir: dir.to_path_buf(),
        }
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    pub(crate) fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).unwrap());
        nix::sys::signal::kill(pid, sig).unwrap();
    }

    pub(crate) async fn exit_code(&mut self) -> Option<i32> {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        while tokio::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
        None
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A node's entry.
pub(crate) async fn node(s: &Server, deployment: &str, node: &str) -> Value {
    let (status, entry) = s
        .json(&format!("/v1/deployments/{deployment}/nodes/{node}"))
        .await;
    assert_eq!(status, 200, "{entry}");
    entry
}

/// The deployment channel's events of `kind` so far.
async fn deployment_events(s: &Server, deployment: &str, kind: &str) -> Vec<Value> {
    let mut stream =
        Sse::open(s.get(&format!("/v1/deployments/{deployment}/events?cursor=0"))).await;
    let mut found = Vec::new();
    while let Some(e) = tokio::time::timeout(std::time::Duration::from_millis(300), stream.next())
        .await
        .ok()
        .flatten()
    {
        if e.event == kind {
            found.push(serde_json::from_str(&e.data).unwrap());
        }
    }
    found
}

pub(crate) async fn agent_token(s: &Server, name: &str, deployment: &str, node: &str) -> String {
    let (status, made) = make(s, agent(name, deployment, node)).await;
    assert_eq!(status, 201, "{made}");
    made["token"].as_str().unwrap().to_string()
}

/// The event types of a subscription's deliveries.
async fn delivered_types(s: &Server, webhook: &str) -> Vec<String> {
    let (_, page) = s.json(&format!("/v1/webhooks/{webhook}/deliveries")).await;
    page["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["event_type"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test]
async fn an_agent_reports_what_its_node_runs_berth_shows_drift_and_silence_once_and_a_revoked_token_stops_it(
) {
    // Webhooks to a receiver that is never there: each delivery is stored
    // with the change it reports, which is what this test reads.
    let s = Server::start(
        Options::default()
            .arg("--webhook-origin")
            .arg("http://127.0.0.1:9"),
    )
    .await;
    let (status, hook) = read(
        s.post("/v1/webhooks", &json!({"url": "http://127.0.0.1:9/hook", "events": ["node.drifted", "node.unreachable"]}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 201, "{hook}");
    let webhook = hook["id"].as_str().unwrap().to_string();
    let token = agent_token(&s, "m-1", "alice", "mastodon").await;
    let build = s.submit_ok("alice", mastodon("alice.example.org")).await;
    s.wait_build(&build, "succeeded").await;
    // The deploy published a steady document naming the node's render.
    let entry = node(&s, "alice", "mastodon").await;
    let desired = entry["desired"]["artifact"]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(entry["desired"]["phase"], "steady", "{entry}");
    assert_eq!(entry["agent"]["status"], "never_reported", "{entry}");
    // The node runs that render: the agent's `current`.
    let render = std::fs::read(s.dir.join("data/work/alice/nodes/mastodon.json")).unwrap();
    let dir = s.dir.join("agent-mastodon");
    std::fs::create_dir_all(dir.join("state")).unwrap();
    std::fs::write(dir.join("state/current"), &render).unwrap();
    let mut a = Agent::start(&s, &token, "alice/mastodon", &dir, &[]);
    eventually("the agent's report shows what the node runs", || async {
        let e = node(&s, "alice", "mastodon").await;
        e["actual"]["running"]["digest"] == json!(desired) && e["agent"]["status"] == "reporting"
    })
    .await;
    let metrics = s.metrics().await;
    for line in [
        "berth_agent_streams 1",
        "berth_nodes{status=\"reporting\"} 1",
    ] {
        assert!(metrics.contains(line), "{line}: {metrics}");
    }
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(d["nodes"][0]["name"], "mastodon", "{d}");
    assert!(d["nodes"][0]["drift"].is_null(), "{d}");
    // Changed behind berth's back: drift, once.
    std::fs::write(dir.join("state/current"), b"edited by hand").unwrap();
    eventually("the hand edit shows as drift", || async {
        node(&s, "alice", "mastodon").await["drift"]["what"] == json!(["running"])
    })
    .await;
    let seen = node(&s, "alice", "mastodon").await["agent"]["last_seen_at"].clone();
    eventually("two more reports", || async {
        node(&s, "alice", "mastodon").await["agent"]["last_seen_at"] != seen
    })
    .await;
    assert_eq!(
        deployment_events(&s, "alice", "node.drifted").await.len(),
        1
    );
    let (code, out) = berth(&[
        "nodes",
        "alice",
        "--drifted",
        "--url",
        &s.base,
        "--token-file",
        s.dir.join("data/service-token").to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("mastodon") && out.contains("running") && out.contains(&desired[7..19]),
        "{out}"
    );
    // Paused past three intervals: unreachable, once; back: reporting.
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    eventually("the silent agent is unreachable", || async {
        node(&s, "alice", "mastodon").await["agent"]["status"] == "unreachable"
    })
    .await;
    let (_, listed) = s.json("/v1/nodes?unreachable=true").await;
    assert_eq!(listed["items"][0]["deployment"], "alice", "{listed}");
    eventually("the node.unreachable webhook is queued", || async {
        delivered_types(&s, &webhook)
            .await
            .contains(&"node.unreachable".to_string())
    })
    .await;
    a.signal(nix::sys::signal::Signal::SIGCONT);
    eventually("the agent reports again", || async {
        node(&s, "alice", "mastodon").await["agent"]["status"] == "reporting"
    })
    .await;
    let types = delivered_types(&s, &webhook).await;
    let count = |t: &str| types.iter().filter(|x| *x == t).count();
    assert_eq!(
        (count("node.drifted"), count("node.unreachable")),
        (1, 1),
        "{types:?}"
    );
    // Revoked: its open stream ends at once, its next call is refused and
    // the agent exits 3.
    let mut stream = Sse::open(
        s.http
            .get(s.url("/internal/v1/nodes/alice/mastodon/desired"))
            .bearer_auth(&token)
            .header("accept", "text/event-stream"),
    )
    .await;
    assert_eq!(stream.next().await.unwrap().event, "desired");
    let r = s.delete("/v1/tokens/m-1").send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        stream.next().await.is_none(),
        "the revoked token's stream ended"
    );
    assert_eq!(a.exit_code().await, Some(3), "{}", a.log());
}

/// A raw report of `body`'s fields over the defaults, by `token`.
async fn report(s: &Server, token: &str, path_node: &str, fields: Value) -> (u16, Value) {
    let mut body = json!({
        "operation_id": format!("op-{}", uuid::Uuid::now_v7().simple()),
        "fence": 0, "worker_incarnation": "incarnation-0001", "generation": 0,
        "running": null, "booted": null, "health": null, "last_error": null,
        "agent_version": "test", "uptime_s": 1, "report_interval_ms": 60000,
    });
    for (k, v) in fields.as_object().unwrap() {
        body[k] = v.clone();
    }
    let r = s
        .http
        .post(s.url(&format!("/internal/v1/nodes/{path_node}/report")))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap();
    read(r).await
}

#[tokio::test]
async fn reports_are_fenced_rate_limited_bounded_and_scoped_to_their_node() {
    let s = Server::start(Options::default().arg("--audit-denial-interval").arg("5s")).await;
    let web = agent_token(&s, "web-1", "alice", "web").await;
    let db = agent_token(&s, "db-1", "alice", "db").await;
    // Another node's routes, whatever exists there: 403 token_scope.
    let (status, err) = report(&s, &web, "alice/db", json!({})).await;
    assert_eq!(
        (status, err["reason"].as_str()),
        (403, Some("token_scope")),
        "{err}"
    );
    // A fence above the node's raises it (berth restored from a backup),
    // in a new generation of the document.
    let (status, answer) = report(&s, &web, "alice/web", json!({"fence": 5})).await;
    assert_eq!(status, 200, "{answer}");
    let entry = node(&s, "alice", "web").await;
    assert_eq!(
        (
            entry["actual"]["fence"].as_u64(),
            answer["generation"].as_u64()
        ),
        (Some(5), Some(1)),
        "{entry}"
    );
    let r = s
        .http
        .get(s.url("/internal/v1/nodes/alice/web/desired"))
        .bearer_auth(&web)
        .send()
        .await
        .unwrap();
    let (_, doc) = read(r).await;
    assert_eq!(
        (doc["fence"].as_u64(), doc["generation"].as_u64()),
        (Some(5), Some(1)),
        "{doc}"
    );
    let (_, audit) = s
        .json("/v1/audit?actor_subject=web-1&actor_issuer=berth:agent")
        .await;
    assert!(audit.to_string().contains("node_fence_raised"), "{audit}");
    // Within a second of the last: 503 report_rate.
    let (status, err) = report(&s, &web, "alice/web", json!({"fence": 5})).await;
    assert_eq!(
        (status, err["reason"].as_str()),
        (503, Some("report_rate")),
        "{err}"
    );
    // A lower fence: stale, and nothing changes.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await; // the report rate's second
    let (status, err) = report(&s, &web, "alice/web", json!({"fence": 3, "uptime_s": 99})).await;
    assert_eq!(
        (status, err["reason"].as_str()),
        (409, Some("stale_authority")),
        "{err}"
    );
    assert_eq!(node(&s, "alice", "web").await["actual"]["uptime_s"], 1);
    // Over 16 KiB: 413; a bad field: 400 naming it.
    let (status, _) = report(
        &s,
        &db,
        "alice/db",
        json!({"last_error": {"code": "x", "message": "y".repeat(17 * 1024)}}),
    )
    .await;
    assert_eq!(status, 413);
    let (status, err) = report(
        &s,
        &db,
        "alice/db",
        json!({"running": {"kind": "file", "digest": "md5:1"}}),
    )
    .await;
    assert_eq!(
        (status, err["fields"][0]["pointer"].as_str()),
        (400, Some("/running/digest")),
        "{err}"
    );
    assert!(
        node(&s, "alice", "db").await["actual"].is_null(),
        "a refused report changes nothing"
    );
    // Audited per token like anonymous denials: the first of the interval
    // at once, then the others folded into one event with their count.
    let refused_reports = || async {
        let (_, audit) = s
            .json("/v1/audit?actor_subject=db-1&actor_issuer=berth:agent")
            .await;
        let events: Vec<Value> = audit["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["action"] == "node_report_refused")
            .cloned()
            .collect();
        events
    };
    let first = refused_reports().await;
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(
        (
            first[0]["node"].as_str(),
            first[0]["result"].as_str(),
            first[0]["count"].as_u64()
        ),
        (Some("db"), Some("invalid"), Some(1)),
        "{first:?}"
    );
    eventually(
        "the second refused report is folded into a count",
        || async {
            let events = refused_reports().await;
            events.len() == 2
                && events
                    .iter()
                    .any(|e| e["count"] == 1 && e["reason"] == "invalid_request")
        },
    )
    .await;
    // A long poll waits for a new generation, and answers 204 without one.
    let r = s
        .http
        .get(s.url("/internal/v1/nodes/alice/web/desired?after=1&wait=1"))
        .bearer_auth(&web)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    // Two streams per token: a third ends the oldest.
    let open = || {
        Sse::open(
            s.http
                .get(s.url("/internal/v1/nodes/alice/web/desired"))
                .bearer_auth(&web)
                .header("accept", "text/event-stream"),
        )
    };
    let mut first = open().await;
    assert_eq!(first.next().await.unwrap().event, "desired");
    let mut second = open().await;
    assert_eq!(second.next().await.unwrap().event, "desired");
    let _third = open().await;
    assert!(first.next().await.is_none(), "the oldest stream ended");
    // The service token is not an agent's.
    let (status, err) = read(
        s.get("/internal/v1/nodes/alice/web/desired")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status, err["reason"].as_str()),
        (403, Some("token_kind")),
        "{err}"
    );
}

/// berth whose `local` deployer lists `activate`, so a deploy is a rollout
/// (deployer.md), with quick health checks.
async fn activating_server(flags: &[&str]) -> Server {
    let mut opts = Options::default()
        .env("BERTH_LOCAL_ACTIVATE", "1")
        .arg("--health-interval")
        .arg("1s");
    for f in flags {
        opts = opts.arg(f);
    }
    Server::start(opts).await
}

/// An agent of alice/mastodon whose health is bad while `flag` exists.
fn checked_agent(s: &Server, token: &str, tag: &str) -> (Agent, std::path::PathBuf) {
    let dir = s.dir.join(tag);
    let flag = dir.join("unhealthy");
    let check = format!("test ! -e {}", flag.display());
    let agent = Agent::start(
        s,
        token,
        "alice/mastodon",
        &dir,
        &["--check-command", &check],
    );
    (agent, flag)
}

/// The digest of a node's file (`current`, `booted`), if it has one.
fn file_digest(path: &std::path::Path) -> Option<String> {
    use sha2::Digest;
    let bytes = std::fs::read(path).ok()?;
    Some(format!(
        "sha256:{}",
        berth::hex::encode(&sha2::Sha256::digest(&bytes))
    ))
}

async fn wait_activation(s: &Server, fence: u64, status: &str) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let e = node(s, "alice", "mastodon").await;
        if e["activation"]["fence"] == json!(fence) && e["activation"]["status"] == json!(status) {
            return e;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "activation {fence} never {status}: {e}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_deploy_reaches_a_bound_node_through_its_agent_and_a_deploy_of_the_same_configuration_corrects_a_drift(
) {
    let s = activating_server(&[]).await;
    let token = agent_token(&s, "m-1", "alice", "mastodon").await;
    let (a, _) = checked_agent(&s, &token, "agent");
    let build = s.submit_ok("alice", mastodon("alice.example.org")).await;
    s.wait_build(&build, "succeeded").await;
    let entry = wait_activation(&s, 1, "confirmed").await;
    let desired = entry["desired"]["artifact"]["digest"].clone();
    assert_eq!(entry["desired"]["phase"], "steady", "{entry}");
    // The agent switched and confirmed: current and booted are the artifact.
    let node_dir = a.dir.join("state");
    assert_eq!(
        file_digest(&node_dir.join("current")).map(Value::from),
        Some(desired.clone())
    );
    assert_eq!(
        file_digest(&node_dir.join("booted")).map(Value::from),
        Some(desired.clone())
    );
    eventually("the report shows it", || async {
        let e = node(&s, "alice", "mastodon").await;
        e["actual"]["running"]["digest"] == desired && e["drift"].is_null()
    })
    .await;
    // The deployer's activate never named the bound node; it activated
    // the other one.
    let work = s.dir.join("data/work/alice/nodes");
    assert!(work.join("base.json").exists());
    assert!(
        !work.join("mastodon.json").exists(),
        "the deployer activated a bound node"
    );
    let log = s.log_text(&build).await;
    assert!(log.contains("published to the agents of mastodon"), "{log}");
    // Audited as the agent's: its claim and its outcome, naming the node
    // and the build; the outcome counts the calls berth took.
    let (_, audit) = s
        .json("/v1/audit?actor_subject=m-1&actor_issuer=berth:agent")
        .await;
    let event = |action: &str| {
        audit["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["action"] == action)
            .cloned()
            .unwrap_or_else(|| panic!("no {action} in {audit}"))
    };
    let (claim, outcome) = (event("attempt_claim"), event("attempt_outcome"));
    assert_eq!(
        (claim["node"].as_str(), claim["build"].as_str()),
        (Some("mastodon"), build.as_str().into()),
        "{claim}"
    );
    assert_eq!(outcome["node"], "mastodon", "{outcome}");
    assert!(outcome["count"].as_u64().unwrap() >= 2, "{outcome}");
    // The artifact comes in parts too (an agent on a poor line).
    let path = format!(
        "/internal/v1/nodes/alice/mastodon/artifacts/{}",
        desired.as_str().unwrap()
    );
    let r = s
        .http
        .get(s.url(&path))
        .bearer_auth(&token)
        .header("range", "bytes=0-3")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    let range = r.headers()["content-range"].to_str().unwrap().to_string();
    assert!(range.starts_with("bytes 0-3/"), "{range}");
    assert_eq!(r.bytes().await.unwrap().len(), 4);
    // Changed by hand: drift; a deploy of the same configuration puts the
    // node back through its agent.
    std::fs::write(node_dir.join("current"), b"edited by hand").unwrap();
    eventually("the drift shows", || async {
        !node(&s, "alice", "mastodon").await["drift"].is_null()
    })
    .await;
    let again = s.submit_ok("alice", mastodon("alice.example.org")).await;
    s.wait_build(&again, "succeeded").await;
    wait_activation(&s, 2, "confirmed").await;
    eventually("the drift is gone", || async {
        let e = node(&s, "alice", "mastodon").await;
        e["actual"]["running"]["digest"] == desired && e["drift"].is_null()
    })
    .await;
    assert_eq!(
        file_digest(&node_dir.join("current")).map(Value::from),
        Some(desired.clone())
    );
    // The hand-edited bytes it kept to go back to went with the confirm:
    // the agent keeps what the node runs, boots and confirmed last.
    let kept: Vec<String> = std::fs::read_dir(node_dir.join("artifacts"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let name = desired.as_str().unwrap().trim_start_matches("sha256:");
    assert_eq!(kept, [name], "{kept:?}");
}

/// A first deploy through the agent, then a second one (another domain)
/// whose activation the agent reports unhealthy while `flag` exists: the
/// node entry once that activation is `activated`.
async fn second_activation_held(s: &Server, flag: &std::path::Path) -> (String, Value) {
    let first = s.submit_ok("alice", mastodon("alice.example.org")).await;
    s.wait_build(&first, "succeeded").await;
    let before = wait_activation(s, 1, "confirmed").await["desired"]["artifact"]["digest"].clone();
    std::fs::write(flag, b"").unwrap();
    // With the automatic rollback on: a lost activation must not start it.
    let second = s.submit_ok("alice", mastodon("bob.example.org")).await;
    wait_activation(s, 2, "activated").await;
    (second, before)
}

#[tokio::test]
async fn an_agent_paused_past_its_lease_fails_the_build_lost_without_a_rollback_and_goes_back_when_it_wakes(
) {
    let s = activating_server(&["--lease-ttl", "5s", "--agent-revert-after", "15s"]).await;
    let token = agent_token(&s, "m-1", "alice", "mastodon").await;
    let (a, flag) = checked_agent(&s, &token, "agent");
    let (second, before) = second_activation_held(&s, &flag).await;
    a.signal(nix::sys::signal::Signal::SIGSTOP);
    let failed = s.wait_build(&second, "failed").await;
    assert_eq!(failed["failure"]["reason"], "lost_attempt", "{failed}");
    let entry = node(&s, "alice", "mastodon").await;
    assert_eq!(entry["activation"]["status"], "lost", "{entry}");
    // Sent back: steady on the artifact before, under a new fence.
    assert_eq!(
        (
            entry["desired"]["phase"].as_str(),
            entry["desired"]["fence"].as_u64()
        ),
        (Some("steady"), Some(3)),
        "{entry}"
    );
    assert_eq!(entry["desired"]["artifact"]["digest"], before, "{entry}");
    eventually("the paused agent is unreachable", || async {
        node(&s, "alice", "mastodon").await["agent"]["status"] == "unreachable"
    })
    .await;
    // Woken: its late calls are refused, it goes back by itself, and the
    // activation stays lost.
    std::fs::remove_file(&flag).unwrap();
    a.signal(nix::sys::signal::Signal::SIGCONT);
    eventually("the node runs the artifact before again", || async {
        let e = node(&s, "alice", "mastodon").await;
        e["actual"]["running"]["digest"] == before && e["agent"]["status"] == "reporting"
    })
    .await;
    assert_eq!(
        file_digest(&a.dir.join("state/current")).map(Value::from),
        Some(before)
    );
    assert_eq!(
        node(&s, "alice", "mastodon").await["activation"]["status"],
        "lost"
    );
    // One audit event for the lost activation's refused calls.
    let (_, audit) = s
        .json("/v1/audit?actor_subject=m-1&actor_issuer=berth:agent&limit=200")
        .await;
    let refused = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "attempt_refused")
        .count();
    assert_eq!(refused, 1, "{audit}");
    let refusal = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["action"] == "attempt_refused")
        .unwrap();
    assert_eq!(refusal["node"], "mastodon", "{refusal}");
    // The loss is berth's own event: no actor, the node, the reason.
    let (_, all) = s.json("/v1/deployments/alice").await;
    let lost: Vec<&Value> = all["audit"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "attempt_lost" && e["node"] == "mastodon")
        .collect();
    assert_eq!(lost.len(), 1, "{all}");
    assert_eq!(
        (lost[0]["actor"].is_null(), lost[0]["reason"].as_str()),
        (true, Some("lease_expired")),
        "{all}"
    );
    // No automatic rollback after a lost activation.
    let (_, builds) = s.json("/v1/deployments/alice/builds").await;
    assert_eq!(builds["items"].as_array().unwrap().len(), 2, "{builds}");
}

#[tokio::test]
async fn with_berth_gone_after_a_test_activation_the_agent_goes_back_by_itself_within_the_revert_window(
) {
    let mut s = activating_server(&["--lease-ttl", "5s", "--agent-revert-after", "15s"]).await;
    let token = agent_token(&s, "m-1", "alice", "mastodon").await;
    let (a, flag) = checked_agent(&s, &token, "agent");
    let (_, before) = second_activation_held(&s, &flag).await;
    let current = a.dir.join("state/current");
    assert_ne!(file_digest(&current).map(Value::from), Some(before.clone()));
    let gone = std::time::Instant::now();
    s.kill();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(40);
    while file_digest(&current).map(Value::from) != Some(before.clone()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the agent never went back: {}",
            a.log()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // Not before the revert window less one renew interval (5 s / 3).
    let took = gone.elapsed();
    assert!(
        took >= std::time::Duration::from_millis(13_000),
        "went back after {took:?}"
    );
    assert!(
        a.log()
            .contains("no renew accepted within the revert window"),
        "{}",
        a.log()
    );
}

#[tokio::test]
async fn an_agent_reports_as_soon_as_it_reaches_a_restarted_berth_again() {
    let mut s = activating_server(&[]).await;
    let token = agent_token(&s, "m-1", "alice", "mastodon").await;
    // Reports an hour apart: only the report after a reconnect can show
    // berth what changed while it was away.
    let dir = s.dir.join("agent");
    let a = Agent::start(
        &s,
        &token,
        "alice/mastodon",
        &dir,
        &["--report-interval", "1h"],
    );
    let build = s.submit_ok("alice", mastodon("alice.example.org")).await;
    s.wait_build(&build, "succeeded").await;
    let desired =
        wait_activation(&s, 1, "confirmed").await["desired"]["artifact"]["digest"].clone();
    // Its report of the last document landed: none is due for an hour.
    eventually("the report shows the artifact running", || async {
        let e = node(&s, "alice", "mastodon").await;
        e["actual"]["running"]["digest"] == desired
            && e["actual"]["generation"] == e["desired"]["generation"]
            && s.build(&build).await["finished_at"].is_string()
    })
    .await;
    // kill -9, a hand edit, and a start on the same port (the agent's --url).
    s.kill();
    std::fs::write(dir.join("state/current"), b"edited while berth was away").unwrap();
    let port = s.base.rsplit(':').next().unwrap().to_string();
    s.args.push("--listen".into());
    s.args.push(format!("127.0.0.1:{port}"));
    s.launch().await;
    // The agent's backoff is at most 30 s; its stream answers again, and
    // it reports then.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let e = node(&s, "alice", "mastodon").await;
        if !e["drift"].is_null() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no drift after the agent came back: {e}\n{}",
            a.log()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn two_agents_on_one_token_make_one_claim_and_are_shown_as_a_duplicate() {
    let s = activating_server(&[]).await;
    let token = agent_token(&s, "m-1", "alice", "mastodon").await;
    let (one, _) = checked_agent(&s, &token, "one");
    let (two, _) = checked_agent(&s, &token, "two");
    let build = s.submit_ok("alice", mastodon("alice.example.org")).await;
    s.wait_build(&build, "succeeded").await;
    let switched: Vec<bool> = [&one, &two]
        .iter()
        .map(|a| a.dir.join("state/current").exists())
        .collect();
    assert_eq!(
        switched.iter().filter(|s| **s).count(),
        1,
        "exactly one agent activated: {switched:?}"
    );
    eventually("the two incarnations show as a duplicate", || async {
        node(&s, "alice", "mastodon").await["agent"]["duplicate"] == true
    })
    .await;
}

#[tokio::test]
async fn an_agent_restarted_with_a_fence_above_berths_raises_it_and_one_restarted_holding_a_lost_activation_goes_back(
) {
    let s = activating_server(&["--lease-ttl", "5s", "--agent-revert-after", "15s"]).await;
    let token = agent_token(&s, "m-1", "alice", "mastodon").await;
    // Its state file says fence 100 (berth restored from an older backup).
    let dir = s.dir.join("agent");
    std::fs::create_dir_all(dir.join("state")).unwrap();
    std::fs::write(
        dir.join("state/state.json"),
        json!({"version": 1, "node": "alice/mastodon", "highest_fence": 100, "generation": 0, "highest_claimed": 100, "attempt": null}).to_string(),
    )
    .unwrap();
    let flag = dir.join("unhealthy");
    let check = format!("test ! -e {}", flag.display());
    let mut a = Agent::start(
        &s,
        &token,
        "alice/mastodon",
        &dir,
        &["--check-command", &check],
    );
    eventually("berth raises the node's fence", || async {
        node(&s, "alice", "mastodon").await["actual"]["fence"] == 100
    })
    .await;
    let build = s.submit_ok("alice", mastodon("alice.example.org")).await;
    s.wait_build(&build, "succeeded").await;
    let before =
        wait_activation(&s, 101, "confirmed").await["desired"]["artifact"]["digest"].clone();
    // Killed while holding an activation; its lease passes; restarted, it
    // goes back by itself and converges.
    std::fs::write(&flag, b"").unwrap();
    let second = s
        .submit_ok_without_rollback("alice", mastodon("bob.example.org"))
        .await;
    wait_activation(&s, 102, "activated").await;
    let killed = node(&s, "alice", "mastodon").await["agent"]["incarnation"].clone();
    drop(a);
    assert_eq!(
        s.wait_build(&second, "failed").await["failure"]["reason"],
        "lost_attempt"
    );
    std::fs::remove_file(&flag).unwrap();
    a = Agent::start(
        &s,
        &token,
        "alice/mastodon",
        &dir,
        &["--check-command", &check],
    );
    eventually("the restarted agent went back", || async {
        let e = node(&s, "alice", "mastodon").await;
        e["agent"]["incarnation"] != killed
            && e["actual"]["running"]["digest"] == before
            && e["drift"].is_null()
    })
    .await;
    assert!(
        a.log().contains("its authority died with it"),
        "{}",
        a.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nix_toplevel_reaches_a_bound_node_from_a_signed_file_cache() {
    let test = "agents::a_nix_toplevel_reaches_a_bound_node_from_a_signed_file_cache";
    if !crate::nix::nix_can_build(test) {
        return;
    }
    let dir = temp_dir("nix-agent");
    let (secret, public) = (dir.join("cache.sec"), dir.join("cache.pub"));
    let made = std::process::Command::new("nix-store")
        .args(["--generate-binary-cache-key", "berth-test"])
        .args([&secret, &public])
        .status()
        .unwrap();
    assert!(made.success());
    let cache = format!("file://{}", dir.join("cache").display());
    let activations = dir.join("activations.log");
    let opts = crate::nix::nix_options(&crate::nix::example_source())
        .env(
            "BERTH_NIX_CACHE",
            &format!("{cache}?secret-key={}", secret.display()),
        )
        .env("BERTH_NIX_CACHE_URL", &cache)
        .env(
            "BERTH_NIX_ACTIVATE",
            &format!("echo \"$NODE $TOPLEVEL\" >> {}", activations.display()),
        )
        .arg("--health-interval")
        .arg("1s");
    let s = Server::start(opts).await;
    let token = agent_token(&s, "m-1", "alice", "mastodon").await;
    // The node's system: what the activate command links, and its profile.
    let node_dir = dir.join("node");
    std::fs::create_dir_all(node_dir.join("profiles")).unwrap();
    let system = node_dir.join("current-system");
    let switch = format!("ln -sfn \"$BERTH_ARTIFACT\" {}", system.display());
    let a = Agent::start(
        &s,
        &token,
        "alice/mastodon",
        &dir.join("agent"),
        &[
            "--substituter",
            &cache,
            "--activate-command",
            &switch,
            "--current-system",
            system.to_str().unwrap(),
            "--system-profile",
            node_dir.join("profiles/system").to_str().unwrap(),
        ],
    );
    let config = json!({"domain": "alice.example.org", "applications": {"mastodon": {"enable": true}, "forgejo": {"enable": true}}});
    let build = s.submit_ok("alice", config).await;
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}\n{}", a.log());
    let entry = wait_activation(&s, 1, "confirmed").await;
    let artifact = &entry["desired"]["artifact"];
    assert_eq!(
        (artifact["kind"].as_str(), artifact["url"].as_str()),
        (Some("nix-store-path"), Some(cache.as_str())),
        "{entry}"
    );
    let toplevel = artifact["path"].as_str().unwrap().to_string();
    // The cache has the toplevel, signed.
    let hash = toplevel
        .trim_start_matches("/nix/store/")
        .split('-')
        .next()
        .unwrap();
    let narinfo =
        std::fs::read_to_string(dir.join("cache").join(format!("{hash}.narinfo"))).unwrap();
    assert!(narinfo.contains("Sig: berth-test:"), "{narinfo}");
    // The node runs and boots it; the deployer activated only the other node.
    eventually(
        "the report shows the toplevel running and booted",
        || async {
            let e = node(&s, "alice", "mastodon").await;
            e["actual"]["running"]["path"] == json!(toplevel)
                && e["actual"]["booted"]["path"] == json!(toplevel)
        },
    )
    .await;
    let log = std::fs::read_to_string(&activations).unwrap_or_default();
    assert!(
        log.contains("forgejo") && !log.contains("mastodon"),
        "{log}"
    );
    // A GC root holds the confirmed toplevel on the node.
    let name = toplevel.trim_start_matches("/nix/store/");
    let root = dir.join("agent/state/gcroots").join(name);
    assert_eq!(
        std::fs::read_link(&root).ok(),
        Some(std::path::PathBuf::from(&toplevel)),
        "{}",
        a.log()
    );
}

#[tokio::test]
async fn an_outage_of_berth_shorter_than_the_revert_window_reverts_nothing_and_the_rollout_goes_on()
{
    // The window is far longer than any restart, even on a loaded CI
    // machine (a restart there once took longer than 15 s); nothing waits
    // on it.
    let mut s = activating_server(&["--lease-ttl", "5s", "--agent-revert-after", "300s"]).await;
    let token = agent_token(&s, "m-1", "alice", "mastodon").await;
    let (a, flag) = checked_agent(&s, &token, "agent");
    let (second, _) = second_activation_held(&s, &flag).await;
    let current = a.dir.join("state/current");
    let switched = file_digest(&current);
    // kill -9 and a start on the same port (the agent's --url).
    s.kill();
    let port = s.base.rsplit(':').next().unwrap().to_string();
    s.args.push("--listen".into());
    s.args.push(format!("127.0.0.1:{port}"));
    s.launch().await;
    // The node stays switched while berth is back; healthy, it passes.
    std::fs::remove_file(&flag).unwrap();
    let end = s.wait_build(&second, "final").await;
    assert_eq!(end["status"], "succeeded", "{end}\n{}", a.log());
    assert_eq!(
        wait_activation(&s, 2, "confirmed").await["activation"]["fence"],
        2
    );
    assert_eq!(file_digest(&current), switched, "the node never went back");
    assert!(
        !a.log().contains("reverted the unconfirmed activation"),
        "{}",
        a.log()
    );
}
