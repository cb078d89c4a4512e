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
