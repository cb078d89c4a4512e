//! Per-node SBOMs through real deploys (sbom.md): real CycloneDX files
//! round-trip value-equal, shared components are stored once and collected
//! exactly, unchanged nodes keep theirs, bad files give a reason while the
//! deploy succeeds, and a deployer cannot make berth read outside its dir.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::harness::*;

/// Real third-party CycloneDX SBOMs (tests/data/sbom, CC0; its README says
/// where they come from).
fn testdata() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/sbom");
    assert!(
        dir.is_dir(),
        "the SBOM test data is missing: expected {} (part of the repository)",
        dir.display()
    );
    dir
}

fn testdata_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(testdata())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 8, "{files:?}");
    files
}

/// A deployer that plays a plan: for deployment `d`, its deploy copies
/// `<plans>/d/scratch/` into its scratch dir and `<plans>/d/result.json` to
/// its result, after running `<plans>/d/hook.sh` if present, and exits 1
/// when `<plans>/d/fail` exists.
fn plan_deployer(dir: &Path) -> (PathBuf, PathBuf) {
    let plans = dir.join("plans");
    std::fs::create_dir_all(&plans).unwrap();
    let body = format!(
        r#"{SCRIPT_PRELUDE}
p="{plans}/$dep"
case "$verb" in
deploy)
  [ -x "$p/hook.sh" ] && "$p/hook.sh"
  [ -d "$p/scratch" ] && cp -r "$p/scratch/." "$BERTH_SCRATCH_DIR/"
  cp "$p/result.json" "$BERTH_RESULT"
  [ -e "$p/fail" ] && exit 1
  exit 0;;
destroy) printf '{{}}' > "$BERTH_RESULT"; exit 0;;
esac
exit 2
"#,
        plans = plans.display()
    );
    (script(dir, "plan.sh", &body), plans)
}

/// Sets the next deploy of `deployment`: files to put in its scratch dir
/// (relative path, source file) and the nodes of its result.
fn plan(plans: &Path, deployment: &str, files: &[(&str, &Path)], nodes: Value) {
    let p = plans.join(deployment);
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(p.join("scratch")).unwrap();
    for (rel, src) in files {
        let to = p.join("scratch").join(rel);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(src, to).unwrap();
    }
    std::fs::write(p.join("result.json"), json!({"nodes": nodes}).to_string()).unwrap();
}

fn ready(name: &str, rel: &str) -> Value {
    json!({"name": name, "changed": true, "sbom": {"status": "ready", "path": rel}})
}

async fn deploy(s: &Server, id: &str) -> Value {
    let b = s
        .submit_ok(id, json!({"domain": format!("{id}.org")}))
        .await;
    let b = s.wait_build(&b, "final").await;
    assert_eq!(b["status"], "succeeded", "{b}\n{}", s.log());
    b
}

async fn sboms(s: &Server, id: &str) -> Vec<Value> {
    let (status, list) = s.json(&format!("/v1/deployments/{id}/sboms")).await;
    assert_eq!(status, 200, "{list}");
    list["nodes"].as_array().unwrap().clone()
}

fn node<'a>(list: &'a [Value], name: &str) -> &'a Value {
    list.iter()
        .find(|n| n["node"] == name)
        .unwrap_or_else(|| panic!("no node {name} in {list:?}"))
}

async fn component_rows(s: &Server) -> u64 {
    let metrics = s.metrics().await;
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("berth_sbom_components "))
        .expect("the component gauge")
        .trim()
        .parse()
        .unwrap()
}

/// Distinct top-level components of these documents, as berth keys them.
fn distinct_components(files: &[&Path]) -> usize {
    let mut set = HashSet::new();
    for f in files {
        let doc: Value = serde_json::from_slice(&std::fs::read(f).unwrap()).unwrap();
        for c in doc["components"].as_array().into_iter().flatten() {
            set.insert(berth::sbom::canonical(c).unwrap().hash);
        }
    }
    set.len()
}

#[tokio::test]
async fn real_sboms_round_trip_value_equal() {
    let dir = temp_dir("sbom-roundtrip");
    let (deployer, plans) = plan_deployer(&dir);
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let files = testdata_files();
    let names: Vec<String> = (0..files.len()).map(|i| format!("n{i}")).collect();
    let placed: Vec<(String, &Path)> = files
        .iter()
        .enumerate()
        .map(|(i, f)| (format!("sbom/{i}.json"), f.as_path()))
        .collect();
    let placed_refs: Vec<(&str, &Path)> = placed.iter().map(|(r, f)| (r.as_str(), *f)).collect();
    let nodes: Vec<Value> = names
        .iter()
        .zip(&placed)
        .map(|(n, (rel, _))| ready(n, rel))
        .collect();
    plan(&plans, "real", &placed_refs, Value::Array(nodes));
    let build = deploy(&s, "real").await;
    let list = sboms(&s, "real").await;
    assert_eq!(list.len(), files.len());
    for (name, file) in names.iter().zip(&files) {
        let status = node(&list, name);
        assert_eq!(status["status"], "ready", "{status}");
        assert_eq!(status["build_id"], build["id"]);
        let original: Value = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
        assert_eq!(
            status["components"].as_u64().unwrap() as usize,
            original["components"].as_array().map_or(0, Vec::len),
            "{}",
            file.display()
        );
        let r = s
            .get(&format!("/v1/deployments/real/sboms/{name}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()["content-type"],
            "application/vnd.cyclonedx+json"
        );
        let served: Value = r.json().await.unwrap();
        assert!(served == original, "{} does not round-trip", file.display());
    }
    let (status, e) = s.json("/v1/deployments/real/sboms/ghost").await;
    assert_eq!(status, 404, "{e}");
    // Every change was announced on the deployment channel.
    let mut events = Sse::open(
        s.get("/v1/deployments/real/events")
            .header("last-event-id", "0"),
    )
    .await;
    let mut announced = 0;
    while let Some(e) = tokio::time::timeout(std::time::Duration::from_secs(2), events.next())
        .await
        .ok()
        .flatten()
    {
        if e.event == "sbom" {
            let data: Value = serde_json::from_str(&e.data).unwrap();
            assert_eq!(data["status"], "ready", "{data}");
            announced += 1;
            if announced == files.len() {
                break;
            }
        }
    }
    assert_eq!(announced, files.len());
}

#[tokio::test]
async fn shared_components_are_stored_once_and_collected_exactly() {
    let dir = temp_dir("sbom-shared");
    let (deployer, plans) = plan_deployer(&dir);
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let data = testdata();
    let old = data.join("proton-bridge__proton-bridge-v1.6.3.bom.json");
    let new = data.join("proton-bridge__proton-bridge-v1.8.0.bom.json");
    plan(
        &plans,
        "one",
        &[("a.json", &old)],
        json!([ready("bridge", "a.json")]),
    );
    plan(
        &plans,
        "two",
        &[("b.json", &new)],
        json!([ready("bridge", "b.json")]),
    );
    deploy(&s, "one").await;
    deploy(&s, "two").await;
    let both = distinct_components(&[&old, &new]);
    let only_new = distinct_components(&[&new]);
    let each = distinct_components(&[&old]) + only_new;
    assert!(
        both < each,
        "the two versions share components ({both} < {each})"
    );
    assert_eq!(component_rows(&s).await as usize, both);

    // Destroy the first: exactly the components only it used are gone.
    let (status, del) = read(s.delete("/v1/deployments/one").send().await.unwrap()).await;
    assert_eq!(status, 202, "{del}");
    s.wait_build(del["build_id"].as_str().unwrap(), "succeeded")
        .await;
    assert!(sboms(&s, "one").await.is_empty());
    assert_eq!(component_rows(&s).await as usize, only_new);
    let (status, _) = s.json("/v1/deployments/two/sboms/bridge").await;
    assert_eq!(status, 200, "the other deployment keeps its SBOM");
    let (status, del) = read(s.delete("/v1/deployments/two").send().await.unwrap()).await;
    assert_eq!(status, 202, "{del}");
    s.wait_build(del["build_id"].as_str().unwrap(), "succeeded")
        .await;
    assert_eq!(component_rows(&s).await, 0);
}

#[tokio::test]
async fn unchanged_nodes_keep_theirs_and_dropped_nodes_lose_theirs() {
    let dir = temp_dir("sbom-unchanged");
    let (deployer, plans) = plan_deployer(&dir);
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let small = testdata().join("cern-lhc-vdm-editor-e564943__bom.json");
    plan(
        &plans,
        "keep",
        &[("web.json", &small), ("db.json", &small)],
        json!([ready("web", "web.json"), ready("db", "db.json")]),
    );
    let first = deploy(&s, "keep").await;
    // Second deploy: web unchanged, db gone, cache new and never given one.
    plan(
        &plans,
        "keep",
        &[],
        json!([{"name": "web", "changed": false}, {"name": "cache", "changed": false}]),
    );
    deploy(&s, "keep").await;
    let list = sboms(&s, "keep").await;
    assert_eq!(list.len(), 2, "{list:?}");
    assert_eq!(node(&list, "web")["status"], "ready");
    assert_eq!(
        node(&list, "web")["build_id"],
        first["id"],
        "kept with its build id"
    );
    assert_eq!(node(&list, "cache")["status"], "unavailable");
    assert_eq!(node(&list, "cache")["reason"], "no deploy gave an SBOM yet");
    assert_eq!(node(&list, "cache")["build_id"], Value::Null);
    let (status, e) = s.json("/v1/deployments/keep/sboms/cache").await;
    assert_eq!(
        (status, e["reason"].clone()),
        (404, json!("sbom_unavailable")),
        "{e}"
    );
    // web and db shared every component: web's references keep them.
    assert_eq!(
        component_rows(&s).await as usize,
        distinct_components(&[&small])
    );

    // A failed deploy changes no SBOM, even when its deployer wrote a result
    // naming new ones.
    let other = testdata().join("laravel-7.12.0__bom.1.4.json");
    plan(
        &plans,
        "keep",
        &[("web.json", &other)],
        json!([ready("web", "web.json")]),
    );
    std::fs::write(plans.join("keep/fail"), b"").unwrap();
    let b = s.submit_ok("keep", json!({"domain": "keep.org"})).await;
    let b = s.wait_build(&b, "final").await;
    assert_eq!(b["status"], "failed", "{b}");
    assert_eq!(
        sboms(&s, "keep").await,
        list,
        "a failed deploy changed the SBOMs"
    );
}

#[tokio::test]
async fn bad_sboms_give_a_reason_while_the_deploy_succeeds() {
    let dir = temp_dir("sbom-bad");
    let (deployer, plans) = plan_deployer(&dir);
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let junk = dir.join("junk");
    std::fs::create_dir_all(&junk).unwrap();
    std::fs::write(junk.join("text"), b"this is not json").unwrap();
    std::fs::write(junk.join("spdx"), br#"{"spdxVersion": "SPDX-2.3"}"#).unwrap();
    std::fs::write(
        junk.join("nul"),
        br#"{"bomFormat": "CycloneDX", "x": "a\u0000b"}"#,
    )
    .unwrap();
    plan(
        &plans,
        "bad",
        &[
            ("text.json", &junk.join("text")),
            ("spdx.json", &junk.join("spdx")),
            ("nul.json", &junk.join("nul")),
        ],
        json!([
            ready("text", "text.json"),
            ready("spdx", "spdx.json"),
            ready("nul", "nul.json"),
            ready("missing", "nowhere.json"),
            ready("escape", "../result/result.json"),
            ready("absolute", "/etc/passwd"),
            ready("link", "link.json"),
            ready("huge", "huge.json"),
            {"name": "given-up", "changed": true, "sbom": {"status": "unavailable", "reason": "nix eval of system.build.sbom timed out"}},
            {"name": "silent", "changed": true},
        ]),
    );
    // Made by the deployer itself, in its scratch dir: a symlink out, and a
    // sparse file over 64 MiB.
    std::fs::write(
        plans.join("bad/hook.sh"),
        "#!/bin/sh\nln -s /etc/passwd \"$BERTH_SCRATCH_DIR/link.json\"\ntruncate -s 65M \"$BERTH_SCRATCH_DIR/huge.json\"\n",
    )
    .unwrap();
    std::fs::set_permissions(
        plans.join("bad/hook.sh"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    deploy(&s, "bad").await;
    let list = sboms(&s, "bad").await;
    let reason = |name: &str| {
        let n = node(&list, name);
        assert_eq!(n["status"], "unavailable", "{n}");
        n["reason"].as_str().unwrap().to_string()
    };
    assert!(reason("text").contains("not JSON"));
    assert!(reason("spdx").contains("not CycloneDX"));
    assert!(reason("nul").contains("U+0000"));
    assert!(reason("missing").contains("missing"));
    assert!(reason("escape").contains("leaves the scratch dir"));
    assert!(reason("absolute").contains("leaves the scratch dir"));
    assert!(reason("link").contains("symlink"));
    assert!(reason("huge").contains("larger than"));
    assert_eq!(
        reason("given-up"),
        "nix eval of system.build.sbom timed out"
    );
    assert!(reason("silent").contains("gave no SBOM"));
    assert_eq!(component_rows(&s).await, 0);
}

/// With `--deployer-user`, a deployer that swaps its scratch dir for a
/// symlink to /etc must not make berth (root) read /etc/passwd: it does
/// not own the directory holding its scratch dir, so the swap fails, and a
/// swapped dir would be refused by `O_NOFOLLOW` anyway.
#[tokio::test]
async fn a_deployer_cannot_swap_its_scratch_dir_for_a_symlink() {
    let nobody = nix::unistd::User::from_name("nobody").ok().flatten();
    let (true, Some(_)) = (nix::unistd::Uid::effective().is_root(), nobody) else {
        skip(
            "a_deployer_cannot_swap_its_scratch_dir_for_a_symlink",
            "needs root and a `nobody` user",
        );
        return;
    };
    let dir = temp_dir("sbom-swap");
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let body = format!(
        r#"{SCRIPT_PRELUDE}
case "$verb" in
deploy)
  mv "$BERTH_SCRATCH_DIR" "$BERTH_SCRATCH_DIR.moved" 2>/dev/null && ln -s /etc "$BERTH_SCRATCH_DIR" && echo "swapped"
  printf '%s' '{{"nodes":[{{"name":"web","changed":true,"sbom":{{"status":"ready","path":"passwd"}}}}]}}' > "$BERTH_RESULT"; exit 0;;
destroy) printf '{{}}' > "$BERTH_RESULT"; exit 0;;
esac
"#
    );
    let deployer = script(&dir, "swap.sh", &body);
    let s = Server::start(
        Options::default()
            .deployer(&deployer)
            .arg("--deployer-user")
            .arg("nobody"),
    )
    .await;
    let b = deploy(&s, "swap").await;
    let log = s.log_text(b["id"].as_str().unwrap()).await;
    assert!(
        !log.contains("swapped"),
        "the deployer could swap its scratch dir:\n{log}"
    );
    let list = sboms(&s, "swap").await;
    assert_eq!(node(&list, "web")["status"], "unavailable", "{list:?}");
}

/// The embedded `local` deployer gives each node a realistic SBOM: its
/// application on the base system the nodes share.
#[tokio::test]
async fn the_local_deployers_nodes_share_their_base_system() {
    let s = Server::start(Options::default()).await;
    let config = json!({"domain": "alice.example.org", "applications": {"mastodon": {"enable": true}, "forgejo": {"enable": true}}});
    let b = s.submit_ok("alice", config).await;
    s.wait_build(&b, "succeeded").await;
    let list = sboms(&s, "alice").await;
    let names: Vec<&str> = list.iter().map(|n| n["node"].as_str().unwrap()).collect();
    assert!(
        names.contains(&"mastodon") && names.contains(&"forgejo"),
        "{list:?}"
    );
    let mut total = 0;
    for n in &list {
        assert_eq!(n["status"], "ready", "{n}");
        total += n["components"].as_u64().unwrap();
    }
    let (status, doc) = s.json("/v1/deployments/alice/sboms/mastodon").await;
    assert_eq!(status, 200, "{doc}");
    let purls: Vec<&str> = doc["components"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["purl"].as_str().unwrap())
        .collect();
    assert!(
        purls.iter().any(|p| p.starts_with("pkg:nix/mastodon@")),
        "{purls:?}"
    );
    assert!(
        purls.iter().any(|p| p.starts_with("pkg:nix/glibc@")),
        "{purls:?}"
    );
    assert!(doc["dependencies"].as_array().unwrap().len() > 1);
    let rows = component_rows(&s).await;
    assert!(
        rows < total,
        "the nodes share components: {rows} rows for {total}"
    );
}
