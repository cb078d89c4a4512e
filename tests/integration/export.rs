//! Export and import (storage.md "Export and import"): a store built
//! through the HTTP API goes to the real PostgreSQL and to real SQLite files
//! and comes back with every API read, log byte, SBOM and the audit verify
//! report equal; an export is one snapshot of a live store; a failed export
//! (its connection killed midway) leaves the target as it was; refusals
//! change nothing; `serve --import-from` imports once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::*;

/// `berth <args>`: exit code and stderr (where export and import report).
fn berth_cli(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(args)
        .output()
        .expect("run berth");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!("berth {}: {stderr}", args.join(" "));
    (out.status.code().unwrap_or(-1), stderr)
}

fn data(dir: &Path) -> String {
    dir.join("data").display().to_string()
}

/// A deployer that writes `<plans>/<dep>/lines` log lines (20 by default),
/// copies `<plans>/<dep>/scratch/` and `result.json`, and fails when
/// `<plans>/<dep>/fail` exists.
fn export_deployer(dir: &Path) -> (PathBuf, PathBuf) {
    let plans = dir.join("plans");
    std::fs::create_dir_all(&plans).unwrap();
    let body = format!(
        r#"{SCRIPT_PRELUDE}
p="{plans}/$dep"
case "$verb" in
deploy)
  n=20; [ -e "$p/lines" ] && n=$(cat "$p/lines")
  seq 1 "$n" | sed "s/^/$dep line /"
  [ -d "$p/scratch" ] && cp -r "$p/scratch/." "$BERTH_SCRATCH_DIR/"
  if [ -e "$p/result.json" ]; then cp "$p/result.json" "$BERTH_RESULT"; else printf '{{"nodes":[]}}' > "$BERTH_RESULT"; fi
  [ -e "$p/fail" ] && exit 1
  exit 0;;
destroy) echo "destroying $dep"; printf '{{}}' > "$BERTH_RESULT"; exit 0;;
esac
exit 2
"#,
        plans = plans.display()
    );
    (script(dir, "export-deployer.sh", &body), plans)
}

fn sbom_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/sbom");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("the SBOM test data is missing at {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
}

/// Deploys `id` once and returns the build (whatever its end).
async fn deploy(s: &Server, id: &str, n: u32) -> Value {
    let b = s
        .submit_ok(id, json!({"domain": format!("{id}.example.org"), "n": n}))
        .await;
    s.wait_build(&b, "final").await
}

/// A store with many deployments, a multi-MB log, SBOMs from real files, a
/// failed build, a destroyed deployment and audit events.
async fn populate(s: &Server, plans: &Path) -> Vec<String> {
    let files = sbom_files();
    let ids: Vec<String> = (0..8).map(|i| format!("d{i}")).collect();
    for id in &ids {
        std::fs::create_dir_all(plans.join(id)).unwrap();
    }
    // d0: a log of several MB.
    std::fs::write(plans.join("d0/lines"), "250000").unwrap();
    // d1: two nodes with real SBOMs.
    let scratch = plans.join("d1/scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    std::fs::copy(&files[0], scratch.join("a.json")).unwrap();
    std::fs::copy(&files[1], scratch.join("b.json")).unwrap();
    std::fs::write(
        plans.join("d1/result.json"),
        json!({"nodes": [
            {"name": "web", "changed": true, "sbom": {"status": "ready", "path": "a.json"}},
            {"name": "db", "changed": true, "sbom": {"status": "ready", "path": "b.json"}},
        ]})
        .to_string(),
    )
    .unwrap();
    // d5: a node bound to an agent, its artifact a file (agents.md): the
    // node's document, its report and the artifact's bytes travel too.
    let scratch = plans.join("d5/scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    std::fs::write(scratch.join("web.json"), b"{\"web\": 1}").unwrap();
    std::fs::copy(&files[0], scratch.join("sbom.json")).unwrap();
    std::fs::write(
        plans.join("d5/result.json"),
        json!({"nodes": [{"name": "web", "changed": true, "sbom": {"status": "ready", "path": "sbom.json"}, "artifact": {"kind": "file", "path": "web.json"}}]}).to_string(),
    )
    .unwrap();
    let (status, made) = read(
        s.post(
            "/v1/tokens",
            &json!({"name": "web-1", "kind": "agent", "deployment": "d5", "node": "web"}),
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(status, 201, "{made}");
    let agent = made["token"].as_str().unwrap().to_string();
    AGENT_TOKEN.set(agent.clone()).unwrap();
    for (n, id) in ids.iter().enumerate() {
        let b = deploy(s, id, 1).await;
        assert_eq!(b["status"], "succeeded", "{b}\n{}", s.log());
        if n % 2 == 0 {
            deploy(s, id, 2).await;
        }
    }
    let (_, entry) = s.json("/v1/deployments/d5/nodes/web").await;
    let report = json!({
        "operation_id": "op-0000000000000001", "fence": 0, "worker_incarnation": "incarnation-0001",
        "generation": entry["desired"]["generation"], "running": entry["desired"]["artifact"], "booted": null,
        "health": {"healthy": true, "reason": null}, "last_error": null,
        "agent_version": "test", "uptime_s": 5, "report_interval_ms": 3_600_000,
    });
    let r = s
        .http
        .post(s.url("/internal/v1/nodes/d5/web/report"))
        .bearer_auth(&agent)
        .json(&report)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // d2: a failed build (not rolled back); d3: destroyed.
    std::fs::write(plans.join("d2/fail"), "").unwrap();
    let failed = s
        .submit_ok_without_rollback("d2", json!({"domain": "d2.example.org", "n": 3}))
        .await;
    assert_eq!(s.wait_build(&failed, "final").await["status"], "failed");
    let r = s.delete("/v1/deployments/d3").send().await.unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    eventually("d3 destroyed", || async {
        let (status, d) = s.json("/v1/deployments/d3").await;
        status == 404 || d["state"] == "idle"
    })
    .await;
    // d4: work states (as a repair makes them), two kept.
    let mut current = "none".to_string();
    for n in 0..2 {
        let src = plans.join(format!("d4/state{n}"));
        std::fs::create_dir_all(src.join("gcroots")).unwrap();
        std::fs::write(src.join("generation"), format!("{n}\n")).unwrap();
        let packed = berth::archive::pack(&src, 1 << 20).unwrap().unwrap();
        let r = s
            .http
            .put(s.url("/v1/deployments/d4/work-state"))
            .bearer_auth(&s.token)
            .header("If-Match", format!("\"{current}\""))
            .body(packed.tar)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        current = packed.digest;
    }
    // A denied call is audited too.
    let r = s
        .http
        .get(s.url("/v1/deployments"))
        .bearer_auth("wrong-token")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    ids
}

/// The agent token of d5's node (its hash travels with the export).
static AGENT_TOKEN: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Every read a user can make of this store, by path.
async fn reads(s: &Server, ids: &[String], audit_size: u64) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    let mut get = |path: String, value: Value| {
        out.insert(path, value);
    };
    // What d5's agent reads: its document and its artifact's bytes.
    let agent = AGENT_TOKEN.get().expect("populated");
    let (_, entry) = s.json("/v1/deployments/d5/nodes/web").await;
    let url = entry["desired"]["artifact"]["url"]
        .as_str()
        .expect("an artifact")
        .to_string();
    let bytes = s
        .http
        .get(s.url(&url))
        .bearer_auth(agent)
        .send()
        .await
        .unwrap();
    assert_eq!(bytes.status(), 200);
    get(url, Value::String(bytes.text().await.unwrap()));
    get("/v1/nodes".into(), s.json("/v1/nodes").await.1);
    let (_, list) = s.json("/v1/deployments?limit=100").await;
    get("/v1/deployments".into(), list);
    let mut builds = Vec::new();
    for id in ids {
        for path in [
            format!("/v1/deployments/{id}"),
            format!("/v1/deployments/{id}/sboms"),
        ] {
            let (status, v) = s.json(&path).await;
            get(path, json!({"status": status, "body": v}));
        }
        let state = s
            .get(&format!("/v1/deployments/{id}/work-state"))
            .send()
            .await
            .unwrap();
        let status = state.status().as_u16();
        let body = state.bytes().await.unwrap();
        get(
            format!("/v1/deployments/{id}/work-state"),
            json!({"status": status, "digest": (status == 200).then(|| berth::archive::digest(&body))}),
        );
        let (_, sboms) = s.json(&format!("/v1/deployments/{id}/sboms")).await;
        for node in sboms["nodes"].as_array().into_iter().flatten() {
            let path = format!(
                "/v1/deployments/{id}/sboms/{}",
                node["node"].as_str().unwrap()
            );
            let (status, v) = s.json(&path).await;
            get(path, json!({"status": status, "body": v}));
        }
        let (_, list) = s
            .json(&format!("/v1/deployments/{id}/builds?limit=100"))
            .await;
        for b in list["items"].as_array().into_iter().flatten() {
            builds.push(b["id"].as_str().unwrap().to_string());
        }
        get(format!("/v1/deployments/{id}/builds"), list);
    }
    for b in &builds {
        get(format!("/v1/builds/{b}"), s.build(b).await);
        get(
            format!("/v1/builds/{b}/log"),
            Value::String(s.log_text(b).await),
        );
        let mut sse = Sse::open(s.get(&format!("/v1/builds/{b}/events"))).await;
        let events: Vec<Value> = sse
            .until_end()
            .await
            .into_iter()
            .map(|e| json!([e.id, e.event, e.data]))
            .collect();
        get(format!("/v1/builds/{b}/events"), Value::Array(events));
    }
    // Proofs come from the Merkle nodes (the first 3 events are pruned).
    for path in [
        format!("/v1/audit/consistency?from=5&to={audit_size}"),
        format!("/v1/audit/proof?seq=6&size={audit_size}"),
    ] {
        let (status, v) = s.json(&path).await;
        assert_eq!(status, 200, "{path}: {v}");
        get(path, v);
    }
    out
}

/// The audit chain's size as `berth audit verify --json` reports it, and the report.
fn verify(data_dir: &str) -> Value {
    let (code, out) = berth(&["audit", "verify", "--json", "--data-dir", data_dir]);
    assert_eq!(code, 0, "{out}");
    serde_json::from_str(&out).unwrap()
}

/// Removes the oldest audit events (as retention does) so the chain has an
/// anchor; the server must be stopped.
async fn prune_first_audit_events(data_dir: &str, count: usize) {
    let store = berth::store::Store::open(&Path::new(data_dir).join("berth.redb")).unwrap();
    let pruned = store
        .write(move |tx| tx.prune_audit(i64::MAX, count))
        .await
        .unwrap();
    assert!(pruned.is_some(), "nothing pruned");
    store.close().unwrap();
}

/// Every row of every export table on PostgreSQL, as JSON text, without
/// the facts that differ by design (when, and an import's own record).
async fn pg_rows(db: &PgDb) -> BTreeMap<String, Vec<String>> {
    let c = db.client().await;
    let mut out = BTreeMap::new();
    for t in berth::export::schema::TABLES {
        let key: Vec<String> = t.primary_key.iter().map(|k| format!("\"{k}\"")).collect();
        let rows = c
            .query(
                &format!(
                    "SELECT to_jsonb(t)::text FROM \"{}\" t ORDER BY {}",
                    t.name,
                    key.join(", ")
                ),
                &[],
            )
            .await
            .unwrap();
        let texts: Vec<String> = rows
            .iter()
            .map(|r| r.get::<_, String>(0))
            .filter(|row| !row.contains("\"key\": \"imported_"))
            .collect();
        out.insert(t.name.to_string(), texts);
    }
    out
}

/// The SQL blocks of docs/export-schema.md for one database: (title, query).
fn doc_queries(flavour: &str) -> Vec<(String, String)> {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/export-schema.md"),
    )
    .expect("docs/export-schema.md");
    let mut out = Vec::new();
    for block in doc.split("```sql\n").skip(1) {
        let body = block.split("```").next().unwrap();
        let first = body.lines().next().unwrap_or("");
        if let Some(title) = first.strip_prefix(&format!("-- {flavour}: ")) {
            out.push((title.to_string(), body.to_string()));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_comes_back_equal_from_postgres_and_sqlite() {
    let test = "export::a_store_comes_back_equal_from_postgres_and_sqlite";
    let Some(db1) = PgDb::create(test).await else {
        return;
    };
    let db2 = PgDb::create(test).await.unwrap();
    let dir = temp_dir("export-roundtrip");
    let (deployer, plans) = export_deployer(&dir);
    let opts = Options::default().deployer(&deployer);
    let mut original = Server::start_in(dir.join("original"), opts).await;
    let ids = populate(&original, &plans).await;
    let original_data = data(&original.dir);
    original.terminate();
    prune_first_audit_events(&original_data, 3).await;
    original.launch().await;
    let report = verify(&original_data);
    let audit_size = report["head"]["seq"].as_u64().unwrap();
    let before = reads(&original, &ids, audit_size).await;
    assert_eq!(report["anchor"]["removed_count"], 3, "{report}");
    let big_id = before["/v1/deployments/d0/builds"]["items"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let big_log = before[&format!("/v1/builds/{big_id}/log")]
        .as_str()
        .unwrap()
        .len();
    assert!(big_log > 3_000_000, "the big log has {big_log} bytes");

    // Export while the server runs.
    let (code, err) = berth_cli(&["export", "--data-dir", &original_data, "--to", &db1.url()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("exported log_chunks:"),
        "one line per table: {err}"
    );

    // A second export into the same database is refused without --replace.
    let (code, err) = berth_cli(&["export", "--data-dir", &original_data, "--to", &db1.url()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--replace"), "{err}");

    // An export whose connection is killed midway leaves the target as it was.
    let exported_rows = pg_rows(&db1).await;
    // The redo log's record key is the store's secret, never exported.
    assert!(
        exported_rows
            .values()
            .flatten()
            .any(|row| row.contains("redo_generation")),
        "the store's meta rows are exported"
    );
    assert!(
        !exported_rows
            .values()
            .flatten()
            .any(|row| row.contains("redo_key")),
        "the redo log's key was exported"
    );
    killed_export_changes_nothing(&db1, &original_data, &exported_rows).await;
    original.terminate();
    // An export of the stopped store reads its file itself (no snapshot):
    // the redo log's key stays behind all the same.
    let stopped = dir.join("stopped.sqlite");
    let to = format!("sqlite:{}", stopped.display());
    let (code, err) = berth_cli(&["export", "--data-dir", &original_data, "--to", &to]);
    assert_eq!(code, 0, "{err}");
    let (meta_rows, keys): (i64, i64) = rusqlite::Connection::open(&stopped)
        .unwrap()
        .query_row(
            "SELECT count(*), count(*) FILTER (WHERE key = 'redo_key') FROM store_meta",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert!(meta_rows > 0, "the store's meta rows are exported");
    assert_eq!(keys, 0, "the redo log's key was exported");

    // PostgreSQL -> a new store: every read equal.
    let a = temp_dir("export-a");
    let a_data = data(&a);
    let (code, err) = berth_cli(&["import", "--data-dir", &a_data, "--from", &db1.url()]);
    assert_eq!(code, 0, "{err}");
    let mut imported_verify = verify(&a_data);
    let mut original_verify = report.clone();
    for r in [&mut imported_verify, &mut original_verify] {
        r.as_object_mut().unwrap().remove("checked_at");
    }
    assert_eq!(imported_verify, original_verify, "audit verify differs");
    // On to SQLite before a server opens the copy (its dir goes with it).
    let sqlite = dir.join("export.sqlite");
    let to = format!("sqlite:{}", sqlite.display());
    let (code, err) = berth_cli(&["export", "--data-dir", &a_data, "--to", &to]);
    assert_eq!(code, 0, "{err}");
    let copy = Server::start_in(a.clone(), Options::default().deployer(&deployer)).await;
    let after = reads(&copy, &ids, audit_size).await;
    assert_eq!(before.len(), after.len());
    for (path, value) in &before {
        assert_eq!(Some(value), after.get(path), "{path} differs after import");
    }
    // An idempotency key replays its stored answer on the copy.
    let replay = copy
        .post(
            "/v1/deployments/d5/submit",
            &json!({"configuration": {"domain": "d5.example.org", "n": 1}, "mode": "enqueue"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(replay.status(), 202);
    drop(copy);

    // The documented queries on the PostgreSQL export.
    let failed = before["/v1/deployments/d2/builds"]["items"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let big = before["/v1/deployments/d0/builds"]["items"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let c = db1.client().await;
    let queries = doc_queries("postgres");
    assert_eq!(queries.len(), 3, "three PostgreSQL queries in the doc");
    for (title, sql) in &queries {
        let sql = sql.replace("$BUILD", &big);
        let rows = c
            .query(sql.as_str(), &[])
            .await
            .unwrap_or_else(|e| panic!("{title}: {e}"));
        check_doc_query(title, &rows_as_text(&rows), &before, &failed, &big);
    }

    // PostgreSQL -> SQLite -> redb -> PostgreSQL: equal rows.
    let conn = rusqlite::Connection::open(&sqlite).unwrap();
    let queries = doc_queries("sqlite");
    assert_eq!(queries.len(), 3, "three SQLite queries in the doc");
    for (title, sql) in &queries {
        let sql = sql.replace("$BUILD", &big);
        let mut stmt = conn
            .prepare(&sql)
            .unwrap_or_else(|e| panic!("{title}: {e}"));
        let n = stmt.column_count();
        let rows: Vec<Vec<String>> = stmt
            .query_map([], |r| {
                (0..n)
                    .map(|i| {
                        r.get::<_, rusqlite::types::Value>(i).map(|v| match v {
                            rusqlite::types::Value::Text(t) => t,
                            rusqlite::types::Value::Integer(n) => n.to_string(),
                            other => format!("{other:?}"),
                        })
                    })
                    .collect()
            })
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        check_doc_query(title, &rows, &before, &failed, &big);
    }
    // An export of a layout before 10 carried every level of the audit
    // tree; an import keeps only what this layout stores (subtrees of 8
    // and up, and the pruned prefix's). Wrong hashes here would show in the
    // round trip's rows had the import kept them.
    for position in 3..audit_size {
        conn.execute(
            "INSERT INTO merkle_nodes (level, position, hash) VALUES (0, ?1, ?2)",
            (position as i64, "00".repeat(32)),
        )
        .unwrap();
    }
    drop(conn);
    let b = temp_dir("export-b");
    let b_data = data(&b);
    let (code, err) = berth_cli(&["import", "--data-dir", &b_data, "--from", &to]);
    assert_eq!(code, 0, "{err}");
    let (code, err) = berth_cli(&["export", "--data-dir", &b_data, "--to", &db2.url()]);
    assert_eq!(code, 0, "{err}");
    let round_trip = pg_rows(&db2).await;
    for (table, rows) in &exported_rows {
        assert_eq!(rows.len(), round_trip[table].len(), "rows of {table}");
        for (x, y) in rows.iter().zip(&round_trip[table]) {
            assert_eq!(x, y, "a row of {table} changed on the round trip");
        }
    }
    let _ = std::fs::remove_dir_all(&a);
    let _ = std::fs::remove_dir_all(&b);
    let _ = std::fs::remove_dir_all(&dir);
}

fn rows_as_text(rows: &[tokio_postgres::Row]) -> Vec<Vec<String>> {
    rows.iter()
        .map(|r| {
            (0..r.len())
                .map(|i| {
                    r.try_get::<_, String>(i)
                        .or_else(|_| r.try_get::<_, i64>(i).map(|n| n.to_string()))
                        .or_else(|_| r.try_get::<_, uuid::Uuid>(i).map(|u| u.to_string()))
                        .unwrap_or_else(|_| "?".into())
                })
                .collect()
        })
        .collect()
}

/// What each documented query must answer on this store.
fn check_doc_query(
    title: &str,
    rows: &[Vec<String>],
    before: &BTreeMap<String, Value>,
    failed: &str,
    big: &str,
) {
    if title.starts_with("failed builds") {
        assert!(
            rows.iter().any(|r| r.iter().any(|c| c == failed)),
            "{title}: {rows:?} lacks {failed}"
        );
        assert_eq!(rows.len(), 1, "{title}: {rows:?}");
    } else if title.starts_with("deployments by state") {
        let mut expected: BTreeMap<String, i64> = BTreeMap::new();
        for d in before["/v1/deployments"]["items"].as_array().unwrap() {
            *expected
                .entry(d["state"].as_str().unwrap().to_string())
                .or_default() += 1;
        }
        let got: BTreeMap<String, i64> = rows
            .iter()
            .map(|r| (r[0].clone(), r[1].parse().unwrap()))
            .collect();
        assert_eq!(got, expected, "{title}");
    } else if title.starts_with("a build's log") {
        let log = before[&format!("/v1/builds/{big}/log")].as_str().unwrap();
        assert_eq!(rows.len(), 1, "{title}");
        assert!(
            rows[0][0] == log,
            "{title}: the log differs from GET .../log"
        );
    } else {
        panic!("a query the test does not know: {title}");
    }
}

/// Runs an export with --replace and terminates its PostgreSQL backend
/// while it copies rows; the database must hold the earlier export.
async fn killed_export_changes_nothing(
    db: &PgDb,
    data_dir: &str,
    before: &BTreeMap<String, Vec<String>>,
) {
    let admin = pg(PG_ADMIN).await.unwrap();
    let url = format!("{}?application_name=berth-export-kill", db.url());
    for _attempt in 0..5 {
        let mut child = Command::new(env!("CARGO_BIN_EXE_berth"))
            .args(["export", "--replace", "--data-dir", data_dir, "--to", &url])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut killed = false;
        while child.try_wait().unwrap().is_none() {
            let rows = admin
                .query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE application_name = 'berth-export-kill' AND query LIKE 'COPY \"log_chunks\"%'",
                    &[],
                )
                .await
                .unwrap();
            if !rows.is_empty() {
                killed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !killed {
            // Finished before it was caught: that export replaced the rows
            // with equal ones; try again.
            assert!(out.status.success(), "{stderr}");
            continue;
        }
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("nothing was changed"), "{stderr}");
        let now = pg_rows(db).await;
        assert_eq!(&now, before, "a killed export changed the target");
        return;
    }
    panic!("five exports finished before their connection could be killed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_is_one_snapshot_of_a_build_writing_its_log() {
    let dir = temp_dir("export-live");
    let deployer = script(
        &dir,
        "slow.sh",
        &format!(
            "{SCRIPT_PRELUDE}\ni=0\nwhile [ $i -lt 4000 ]; do i=$((i+1)); echo \"line $i\"; [ $((i % 50)) -eq 0 ] && sleep 0.01; done\nprintf '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"\n"
        ),
    );
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let build = s.submit_ok("live", json!({"domain": "live.org"})).await;
    s.wait_build(&build, "running").await;
    let data_dir = data(&s.dir);
    let mut exports = Vec::new();
    for n in 0..3 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let file = dir.join(format!("live-{n}.sqlite"));
        let (code, err) = berth_cli(&[
            "export",
            "--data-dir",
            &data_dir,
            "--to",
            &format!("sqlite:{}", file.display()),
        ]);
        assert_eq!(code, 0, "{err}");
        exports.push(file);
    }
    s.wait_build(&build, "final").await;
    let mut seen_lines = Vec::new();
    for file in &exports {
        let conn = rusqlite::Connection::open(file).unwrap();
        // The build record and its log chunks are of one instant.
        let (lines, bytes): (i64, i64) = conn
            .query_row(
                "SELECT log_lines, log_bytes FROM builds WHERE build_id = ?1",
                [&build],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        let text: String = conn
            .query_row(
                "SELECT coalesce(group_concat(text, ''), '') FROM \
                 (SELECT text FROM log_chunks WHERE build_id = ?1 ORDER BY chunk)",
                [&build],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(text.len() as i64, bytes, "log bytes vs the build record");
        assert_eq!(
            text.lines().count() as i64,
            lines,
            "log lines vs the build record"
        );
        for (i, line) in text.lines().enumerate() {
            assert_eq!(line, format!("line {}", i + 1));
        }
        seen_lines.push(lines);
    }
    assert!(
        seen_lines.iter().any(|&n| n > 0 && n < 4000),
        "no export caught the build midway: {seen_lines:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_exports_and_imports_change_nothing() {
    let dir = temp_dir("export-refusals");
    let mut s = Server::start(Options::default()).await;
    s.submit_ok("r1", mastodon("r1.org")).await;
    let data_dir = data(&s.dir);
    s.terminate();

    // A SQLite file that is not ours, and a file that is not SQLite.
    let foreign = dir.join("foreign.sqlite");
    {
        let c = rusqlite::Connection::open(&foreign).unwrap();
        c.execute_batch("CREATE TABLE customers (id INTEGER); INSERT INTO customers VALUES (1)")
            .unwrap();
    }
    let text = dir.join("notes.txt");
    std::fs::write(&text, "not a database, just notes ".repeat(200)).unwrap();
    for (file, expected) in [
        (&foreign, "not a berth export"),
        (&text, "is not a SQLite database"),
    ] {
        let before = std::fs::read(file).unwrap();
        for replace in [false, true] {
            let to = format!("sqlite:{}", file.display());
            let mut args = vec!["export", "--data-dir", &data_dir, "--to", &to];
            if replace {
                args.push("--replace");
            }
            let (code, err) = berth_cli(&args);
            assert_eq!(code, 1, "{err}");
            assert!(err.contains(expected), "{err}");
            assert_eq!(
                std::fs::read(file).unwrap(),
                before,
                "{} changed",
                file.display()
            );
        }
    }

    // An export of a newer schema version is neither replaced nor imported.
    let newer = dir.join("newer.sqlite");
    let to = format!("sqlite:{}", newer.display());
    assert_eq!(
        berth_cli(&["export", "--data-dir", &data_dir, "--to", &to]).0,
        0
    );
    {
        let c = rusqlite::Connection::open(&newer).unwrap();
        c.execute(
            "UPDATE berth_meta SET value = '99' WHERE key = 'schema_version'",
            [],
        )
        .unwrap();
    }
    let (code, err) = berth_cli(&["export", "--replace", "--data-dir", &data_dir, "--to", &to]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("newer"), "{err}");
    let fresh = dir.join("fresh");
    let (code, err) = berth_cli(&["import", "--data-dir", &data(&fresh), "--from", &to]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("newer"), "{err}");
    assert!(
        !fresh.join("data/berth.redb").exists(),
        "a refused import left a store"
    );

    // A missing file, an unreachable database, a foreign SQLite file as source.
    for (from, expected) in [
        (
            format!("sqlite:{}", dir.join("missing.sqlite").display()),
            "does not exist",
        ),
        (
            "postgres://postgres:hunter2@127.0.0.1:1/x".to_string(),
            "cannot connect",
        ),
        (
            format!("sqlite:{}", foreign.display()),
            "not a berth export",
        ),
    ] {
        let (code, err) = berth_cli(&["import", "--data-dir", &data(&fresh), "--from", &from]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains(expected), "{err}");
        assert!(!err.contains("hunter2"), "a password was echoed: {err}");
    }

    // A store holding state is not replaced unless asked, and never while
    // a server holds it.
    let mut other = Server::start(Options::default()).await;
    other.submit_ok("x1", mastodon("x1.org")).await;
    let other_data = data(&other.dir);
    other.terminate();
    let other_export = dir.join("other.sqlite");
    let from = format!("sqlite:{}", other_export.display());
    assert_eq!(
        berth_cli(&["export", "--data-dir", &other_data, "--to", &from]).0,
        0
    );
    let (code, err) = berth_cli(&["import", "--data-dir", &data_dir, "--from", &from]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--replace"), "{err}");
    s.launch().await;
    assert_eq!(s.json("/v1/deployments/r1").await.0, 200);
    assert_eq!(s.json("/v1/deployments/x1").await.0, 404);
    let (code, err) = berth_cli(&[
        "import",
        "--replace",
        "--data-dir",
        &data_dir,
        "--from",
        &from,
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("in use"), "{err}");
    assert_eq!(s.json("/v1/deployments/r1").await.0, 200);
    s.terminate();
    let (code, err) = berth_cli(&[
        "import",
        "--replace",
        "--data-dir",
        &data_dir,
        "--from",
        &from,
    ]);
    assert_eq!(code, 0, "{err}");
    s.launch().await;
    assert_eq!(s.json("/v1/deployments/x1").await.0, 200);
    assert_eq!(s.json("/v1/deployments/r1").await.0, 404);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_imports_from_an_export_exactly_once() {
    let dir = temp_dir("import-at-start");
    let mut s = Server::start(Options::default()).await;
    let build = s.submit_ok("old", mastodon("old.org")).await;
    s.wait_build(&build, "final").await;
    let old_log = s.log_text(&build).await;
    let data_dir = data(&s.dir);
    s.terminate();
    let file = dir.join("old-service.sqlite");
    let from = format!("sqlite:{}", file.display());
    assert_eq!(
        berth_cli(&["export", "--data-dir", &data_dir, "--to", &from]).0,
        0
    );

    let opts = Options::default().arg("--import-from").arg(&from);
    let mut fresh = Server::start_in(dir.join("new"), opts).await;
    assert_eq!(fresh.log_text(&build).await, old_log);
    // Work done after the import survives a restart with the flag still set.
    let newer = fresh.submit_ok("new", mastodon("new.org")).await;
    fresh.wait_build(&newer, "final").await;
    fresh.terminate();
    fresh.launch().await;
    let (status, _) = fresh.json("/v1/deployments/new").await;
    assert_eq!(status, 200, "a restart imported again over newer work");
    assert!(fresh.log().contains("imported already"), "{}", fresh.log());
    let imported = fresh.log().matches("imported the store").count();
    assert_eq!(imported, 1, "{}", fresh.log());
    let _ = std::fs::remove_dir_all(&dir);
}

/// storage.md: an export file holds every configuration, log and stored
/// answer, and a store imported from it as much: both readable by berth's
/// user only, the data dir too.
#[tokio::test]
async fn export_files_and_imported_stores_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let (dir, file, to) = one_deployment_exported("modes").await;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&file), 0o600, "the export file is readable by others");
    let target = dir.join("fresh-data");
    let (code, err) = berth_cli(&[
        "import",
        "--data-dir",
        target.to_str().unwrap(),
        "--from",
        &to,
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(mode(&target), 0o700, "the data dir an import made");
    assert_eq!(
        mode(&target.join("berth.redb")),
        0o600,
        "the imported store"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Hostile input round two, item 11: an import refuses a SQLite file whose
/// berth tables are views (a view runs SQL on every read; a recursive one
/// runs until the disk is full).
#[tokio::test]
async fn an_import_refuses_a_file_whose_tables_are_views() {
    let (dir, file, to) = one_deployment_exported("views").await;
    {
        let conn = rusqlite::Connection::open(&file).unwrap();
        conn.execute_batch(
            "PRAGMA foreign_keys = OFF; DROP TABLE builds; CREATE VIEW builds AS WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) SELECT x FROM n;",
        )
        .unwrap();
    }
    let (err, target) = import_refused(&dir, &to);
    assert!(err.contains("builds is a view"), "{err}");
    assert!(
        !target.join("berth.redb").exists(),
        "a refused import made a store"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Hostile input round two, item 8: a tenant's idempotency key never
/// breaks a PostgreSQL export: the caller's parts are columns of their own
/// (no U+0000 in a text column), and they come back as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_of_any_caller_exports_to_postgres_and_back() {
    let test = "export::an_idempotency_key_of_any_caller_exports_to_postgres_and_back";
    let Some(db) = PgDb::create(test).await else {
        return;
    };
    let mut s = Server::start(Options::default()).await;
    let (status, _) = read(
        s.post(
            "/v1/deployments/k1/submit",
            &json!({"configuration": mastodon("k1.org")}),
        )
        .header("Idempotency-Key", "tenant-key-00000001")
        .header("X-Actor-Subject", "alice@example.org")
        .header("X-Actor-Issuer", "https://id.example.org")
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(status, 202);
    s.terminate();
    let (code, err) = berth_cli(&["export", "--data-dir", &data(&s.dir), "--to", &db.url()]);
    assert_eq!(code, 0, "{err}");
    let rows = db
        .client()
        .await
        .query(
            "SELECT principal, actor_subject, actor_issuer, route, idempotency_key FROM idempotency",
            &[],
        )
        .await
        .unwrap();
    let got: Vec<Vec<String>> = rows
        .iter()
        .map(|r| (0..5).map(|i| r.get::<_, String>(i)).collect())
        .collect();
    assert_eq!(
        got,
        vec![vec![
            "backend".to_string(),
            "alice@example.org".into(),
            "https://id.example.org".into(),
            "/v1/deployments/{id}/submit".into(),
            "tenant-key-00000001".into()
        ]]
    );
    let target = temp_dir("idem-import").join("data");
    let (code, err) = berth_cli(&[
        "import",
        "--data-dir",
        target.to_str().unwrap(),
        "--from",
        &db.url(),
    ]);
    assert_eq!(code, 0, "{err}");
}

/// Hostile input round two, item 12: a readable column edited by hand
/// (an audit row's `action`) no longer agrees with the row's canonical
/// text, and the import refuses the file, naming the table and the key.
#[tokio::test]
async fn an_export_edited_by_hand_is_refused() {
    let (dir, file, to) = one_deployment_exported("edited").await;
    {
        let conn = rusqlite::Connection::open(&file).unwrap();
        let changed = conn
            .execute(
                "UPDATE audit_events SET action = 'delete' WHERE seq = 1",
                [],
            )
            .unwrap();
        assert_eq!(changed, 1);
    }
    let (err, target) = import_refused(&dir, &to);
    assert!(
        err.contains("table audit_events")
            && err.contains("key (1)")
            && err.contains("column action"),
        "{err}"
    );
    assert!(
        !target.join("berth.redb").exists(),
        "a refused import made a store"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Hostile input round two, item 11: an imported idempotency record's
/// stored headers are replayed to callers, so an import refuses any header
/// berth itself never sends (a file cannot make berth set a cookie).
#[tokio::test]
async fn an_import_refuses_stored_headers_berth_never_sends() {
    let dir = temp_dir("headers");
    let mut s = Server::start(Options::default()).await;
    let (status, body) = read(
        s.post(
            "/v1/deployments/h1/submit",
            &json!({"configuration": mastodon("h1.org")}),
        )
        .header("Idempotency-Key", "headers-key-0001")
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    s.wait_build(body["build_id"].as_str().unwrap(), "final")
        .await;
    s.terminate();
    let file = dir.join("export.sqlite");
    let to = format!("sqlite:{}", file.display());
    let (code, err) = berth_cli(&["export", "--data-dir", &data(&s.dir), "--to", &to]);
    assert_eq!(code, 0, "{err}");
    {
        let conn = rusqlite::Connection::open(&file).unwrap();
        let headers: String = conn
            .query_row("SELECT headers FROM idempotency", [], |r| r.get(0))
            .unwrap();
        let stored: Value = serde_json::from_str(&headers).unwrap();
        assert!(stored.is_array(), "{headers}");
        let changed = conn
            .execute(
                "UPDATE idempotency SET headers = '[[\"Set-Cookie\",\"session=stolen\"]]'",
                [],
            )
            .unwrap();
        assert_eq!(changed, 1);
    }
    let (err, target) = import_refused(&dir, &to);
    assert!(
        err.contains("table idempotency") && err.contains("column headers"),
        "{err}"
    );
    assert!(
        !target.join("berth.redb").exists(),
        "a refused import made a store"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stopped server's store with one deployment, exported to a SQLite file
/// in a temp dir: (that dir, the file, its `sqlite:` endpoint).
async fn one_deployment_exported(tag: &str) -> (PathBuf, PathBuf, String) {
    let dir = temp_dir(tag);
    let mut s = Server::start(Options::default()).await;
    let build = s.submit_ok(tag, mastodon(&format!("{tag}.org"))).await;
    s.wait_build(&build, "final").await;
    s.terminate();
    let file = dir.join("export.sqlite");
    let to = format!("sqlite:{}", file.display());
    let (code, err) = berth_cli(&["export", "--data-dir", &data(&s.dir), "--to", &to]);
    assert_eq!(code, 0, "{err}");
    (dir, file, to)
}

/// An import of `from` into a new data dir under `dir` that must fail:
/// what it said, and the data dir it was given.
fn import_refused(dir: &Path, from: &str) -> (String, PathBuf) {
    let target = dir.join("fresh");
    let (code, err) = berth_cli(&[
        "import",
        "--data-dir",
        target.to_str().unwrap(),
        "--from",
        from,
    ]);
    assert_ne!(code, 0, "the import went through");
    (err, target)
}

/// Webhooks (notifications.md): an export carries subscriptions (their
/// secret included: the file is 0600) and pending deliveries, and the
/// imported store has them as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_and_pending_deliveries_travel_with_an_export() {
    let dir = temp_dir("export-webhooks");
    // Nothing listens on port 9: every attempt fails, deliveries stay pending.
    let mut s = Server::start(
        Options::default()
            .arg("--webhook-origin")
            .arg("http://127.0.0.1:9"),
    )
    .await;
    let (status, made) = read(
        s.post(
            "/v1/webhooks",
            &json!({"url": "http://127.0.0.1:9/hook", "events": ["*"], "description": "ops"}),
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(status, 201, "{made}");
    let id = made["id"].as_str().unwrap().to_string();
    let b = s.submit_ok("w1", mastodon("w1.org")).await;
    s.wait_build(&b, "final").await;
    let (_, before) = s.json(&format!("/v1/webhooks/{id}/deliveries")).await;
    let pending = before["items"].as_array().unwrap().len();
    assert!(pending >= 3, "{before}");
    s.terminate();
    let file = dir.join("export.sqlite");
    let to = format!("sqlite:{}", file.display());
    let (code, err) = berth_cli(&["export", "--data-dir", &data(&s.dir), "--to", &to]);
    assert_eq!(code, 0, "{err}");
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the export holds webhook secrets");
        let conn = rusqlite::Connection::open(&file).unwrap();
        let record: String = conn
            .query_row("SELECT record FROM webhooks", [], |r| r.get(0))
            .unwrap();
        assert!(record.contains("whsec_"), "the secret travels: {record}");
    }
    let target = dir.join("imported");
    let (code, err) = berth_cli(&[
        "import",
        "--data-dir",
        target.join("data").to_str().unwrap(),
        "--from",
        &to,
    ]);
    assert_eq!(code, 0, "{err}");
    let s2 = Server::start_in(
        target,
        Options::default()
            .arg("--webhook-origin")
            .arg("http://127.0.0.1:9"),
    )
    .await;
    let (_, list) = s2.json("/v1/webhooks").await;
    assert_eq!(list["items"][0]["id"], id, "{list}");
    assert_eq!(list["items"][0]["description"], "ops", "{list}");
    let (_, after) = s2.json(&format!("/v1/webhooks/{id}/deliveries")).await;
    let ids = |v: &Value| -> Vec<Value> {
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["webhook_id_header"].clone())
            .collect()
    };
    assert_eq!(ids(&after), ids(&before), "{after}");
    let _ = std::fs::remove_dir_all(&dir);
}
