//! The published OpenAPI document matches the router; operations routes.

use serde_json::Value;

use crate::harness::*;

#[tokio::test]
async fn openapi_lists_exactly_the_routes_and_each_answers() {
    let s = Server::start(Options::default()).await;
    let r = s.http.get(s.url("/v1/openapi.json")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let doc: Value = r.json().await.unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    let mut documented: Vec<(String, String)> = vec![];
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in ["get", "post", "put", "delete", "patch"] {
            if item.get(method).is_some() {
                documented.push((method.to_uppercase(), path.clone()));
            }
        }
    }
    documented.sort();
    let mut served: Vec<(String, String)> = berth::api::ROUTES
        .iter()
        .map(|r| (r.method.to_string(), r.template.to_string()))
        .collect();
    served.sort();
    // The document spells out an instance of a template where it takes
    // a body of its own (`.../actions/rollback` of `.../actions/{name}`):
    // such a path is the served row whose template it matches.
    let mut covered: Vec<(String, String)> = documented
        .iter()
        .map(|(method, path)| {
            if served.contains(&(method.clone(), path.clone())) {
                return (method.clone(), path.clone());
            }
            let segments = berth::api::routes::path_segments(path);
            let row = berth::api::ROUTES
                .iter()
                .find(|r| {
                    r.method == method
                        && berth::api::routes::match_template(r.template, &segments).is_some()
                })
                .unwrap_or_else(|| panic!("{method} {path} is documented but not served"));
            (method.clone(), row.template.to_string())
        })
        .collect();
    covered.sort();
    covered.dedup();
    assert_eq!(covered, served);
    // Each documented route answers (not 404-for-the-route, not 405).
    for (method, path) in documented {
        let concrete = path
            .replace("{id}", "ghost")
            .replace("{build}", "01a228d4-3cd7-7412-b493-83edc2196f8a");
        let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let r = s
            .http
            .request(m, s.url(&concrete))
            .bearer_auth(&s.token)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_ne!(r.status(), 405, "{method} {path}");
        assert!(
            r.status().as_u16() < 500,
            "{method} {path} answered {}",
            r.status()
        );
        if r.status() == 404 {
            let p: Value = r.json().await.unwrap();
            assert_ne!(p["message"], "no such route", "{method} {path}");
        }
    }
}

#[tokio::test]
async fn health_ready_metrics() {
    let s = Server::start(Options::default()).await;
    assert_eq!(
        s.http.get(s.url("/healthz")).send().await.unwrap().status(),
        200
    );
    assert_eq!(
        s.http.get(s.url("/readyz")).send().await.unwrap().status(),
        200
    );
    assert_eq!(
        s.http.get(s.url("/metrics")).send().await.unwrap().status(),
        401
    );
    s.submit_ok("alice", serde_json::json!({})).await;
    let m = s.metrics().await;
    assert!(
        m.contains(
            "berth_http_requests_total{route=\"/v1/deployments/{id}/submit\",code=\"202\"} 1"
        ),
        "{m}"
    );
    assert!(m.contains("berth_store_bytes "), "{m}");
    assert!(
        m.contains("berth_builds{status=\"queued\"}")
            && m.contains("berth_builds{status=\"succeeded\"}"),
        "{m}"
    );
    let mode = std::fs::metadata(s.dir.join("data/service-token")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(mode.permissions().mode() & 0o777, 0o600);
    assert!(!s.log().contains(&s.token), "the token was logged");
}
