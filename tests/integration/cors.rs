//! Cross-origin front-ends (api.md): a listed origin gets its preflights
//! answered and `Access-Control-Allow-Origin` on every answer, event streams
//! included; any other origin gets no CORS header at all.

use serde_json::json;

use crate::harness::*;

const PANEL: &str = "https://panel.example.org";

fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

#[tokio::test]
async fn a_listed_origin_may_call_every_route_and_others_get_nothing() {
    let s = Server::start(Options::default().arg("--cors-origin").arg(PANEL)).await;
    let preflight = |origin: &'static str| {
        s.http
            .request(
                reqwest::Method::OPTIONS,
                s.url("/v1/deployments/web/submit"),
            )
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization, content-type, idempotency-key",
            )
            .send()
    };
    let r = preflight(PANEL).await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(
        header(&r, "access-control-allow-origin").as_deref(),
        Some(PANEL)
    );
    assert_eq!(
        header(&r, "access-control-allow-methods").as_deref(),
        Some("POST")
    );
    let allowed = header(&r, "access-control-allow-headers").unwrap();
    for h in [
        "Authorization",
        "Content-Type",
        "Idempotency-Key",
        "If-Match",
        "Last-Event-ID",
    ] {
        assert!(allowed.contains(h), "{allowed}");
    }
    assert_eq!(header(&r, "access-control-max-age").as_deref(), Some("600"));
    assert!(header(&r, "access-control-allow-credentials").is_none());

    // Another origin: no preflight answer, no CORS header.
    let r = preflight("https://evil.example.org").await.unwrap();
    assert_eq!(r.status(), 405);
    assert!(header(&r, "access-control-allow-origin").is_none());

    // Answers of every kind carry the origin and the exposed headers.
    let build = s.submit_ok("web", mastodon("web.example.org")).await;
    for path in [
        "/v1/deployments".to_string(),
        format!("/v1/builds/{build}"),
        "/v1/nowhere".into(),
    ] {
        let r = s.get(&path).header("origin", PANEL).send().await.unwrap();
        assert_eq!(
            header(&r, "access-control-allow-origin").as_deref(),
            Some(PANEL),
            "{path}"
        );
        let exposed = header(&r, "access-control-expose-headers").unwrap();
        assert!(
            exposed.contains("ETag") && exposed.contains("X-Request-Id"),
            "{exposed}"
        );
        assert!(
            header(&r, "vary").unwrap_or_default().contains("Origin"),
            "{path}"
        );
        let r = s
            .get(&path)
            .header("origin", "https://evil.example.org")
            .send()
            .await
            .unwrap();
        assert!(
            header(&r, "access-control-allow-origin").is_none(),
            "{path}"
        );
    }
    let r = s
        .post("/v1/deployments/web/submit", &json!({"configuration": {}}))
        .header("origin", PANEL)
        .header("idempotency-key", "cors-submit-0001")
        .send()
        .await
        .unwrap();
    assert_eq!(
        header(&r, "access-control-allow-origin").as_deref(),
        Some(PANEL)
    );

    // An event stream too.
    let r = s
        .get(&format!("/v1/builds/{build}/events"))
        .header("origin", PANEL)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "access-control-allow-origin").as_deref(),
        Some(PANEL)
    );
    drop(r);
}

#[tokio::test]
async fn without_the_flag_there_is_no_cors_and_a_wildcard_is_refused() {
    let s = Server::start(Options::default()).await;
    let r = s
        .get("/v1/deployments")
        .header("origin", PANEL)
        .send()
        .await
        .unwrap();
    assert!(header(&r, "access-control-allow-origin").is_none());
    assert!(header(&r, "vary").is_none_or(|v| !v.contains("Origin")));
    let (code, _) = berth(&[
        "serve",
        "--cors-origin",
        "*",
        "--data-dir",
        "/nonexistent-berth",
    ]);
    assert_ne!(code, 0, "a wildcard origin was accepted");
    assert!(
        !std::path::Path::new("/nonexistent-berth").exists(),
        "refused only after start-up began"
    );
}
