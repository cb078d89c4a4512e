//! Cross-origin front-ends (api.md "Cross-origin front-ends"): a browser
//! page on another origin may call berth only when that origin is listed in
//! `--cors-origin`. Exact origins only, never `*`, never credentials (berth
//! uses no cookies). Why a module: every answer passes through here, event
//! streams included, so no route can forget the headers.

use warp::http::{HeaderMap, HeaderValue, Method, StatusCode};

use super::routes::{match_template, path_segments, ROUTES};

/// Headers a cross-origin page may send.
const ALLOW_HEADERS: &str = "Authorization, Content-Type, Idempotency-Key, If-Match, Last-Event-ID";
/// Headers a cross-origin page may read.
const EXPOSE_HEADERS: &str = "ETag, X-Request-Id, Retry-After, Berth-Event-Cursor, Content-Range";
/// How long a browser may cache a preflight answer (seconds).
const PREFLIGHT_MAX_AGE: &str = "600";
/// Listed origins at most (each is compared on every request).
pub const MAX_CORS_ORIGINS: usize = 64;

/// Checks `--cors-origin` at start: each an exact `scheme://host[:port]`.
pub fn check_origins(origins: &[String]) -> Result<(), String> {
    if origins.len() > MAX_CORS_ORIGINS {
        return Err(format!(
            "--cors-origin lists more than {MAX_CORS_ORIGINS} origins"
        ));
    }
    for o in origins {
        let rest = o
            .strip_prefix("https://")
            .or_else(|| o.strip_prefix("http://"))
            .ok_or_else(|| {
                format!("--cors-origin: {o:?} must start with https:// or http:// (an exact origin, never *)")
            })?;
        let valid = !rest.is_empty()
            && rest
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || b".-:[]".contains(&c));
        if !valid {
            return Err(format!(
                "--cors-origin: {o:?} is not scheme://host[:port] (no path, no trailing slash)"
            ));
        }
    }
    Ok(())
}

/// The request's origin when it is listed.
pub fn allowed_origin(origins: &[String], headers: &HeaderMap) -> Option<HeaderValue> {
    let origin = headers.get("origin")?;
    let text = origin.to_str().ok()?;
    origins.iter().any(|o| o == text).then(|| origin.clone())
}

/// The answer to a preflight (`OPTIONS` with
/// `Access-Control-Request-Method`) from a listed origin: 204 with the
/// route's methods, or None when the path is no route (the normal 404).
pub fn preflight(
    method: &Method,
    headers: &HeaderMap,
    path: &str,
) -> Option<warp::reply::Response> {
    if method != Method::OPTIONS || !headers.contains_key("access-control-request-method") {
        return None;
    }
    let segments = path_segments(path);
    let methods: Vec<&str> = ROUTES
        .iter()
        .filter(|r| match_template(r.template, &segments).is_some())
        .map(|r| r.method)
        .collect();
    if methods.is_empty() {
        return None;
    }
    let mut response = warp::reply::Response::new(Default::default());
    *response.status_mut() = StatusCode::NO_CONTENT;
    let h = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&methods.join(", ")) {
        h.insert("access-control-allow-methods", v);
    }
    h.insert(
        "access-control-allow-headers",
        HeaderValue::from_static(ALLOW_HEADERS),
    );
    h.insert(
        "access-control-max-age",
        HeaderValue::from_static(PREFLIGHT_MAX_AGE),
    );
    Some(response)
}

/// Adds the CORS headers to an answer: `Vary: Origin` whenever origins are
/// configured (a cache must not serve one origin's answer to another), the
/// rest only for a listed origin.
pub fn decorate(
    origins: &[String],
    allowed: Option<HeaderValue>,
    response: &mut warp::reply::Response,
) {
    if origins.is_empty() {
        return;
    }
    let h = response.headers_mut();
    h.append("vary", HeaderValue::from_static("Origin"));
    if let Some(origin) = allowed {
        h.insert("access-control-allow-origin", origin);
        h.insert(
            "access-control-expose-headers",
            HeaderValue::from_static(EXPOSE_HEADERS),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_exact_origins_are_accepted() {
        assert!(check_origins(&["https://panel.example.org".into()]).is_ok());
        assert!(check_origins(&["http://localhost:5173".into()]).is_ok());
        for bad in [
            "*",
            "https://panel.example.org/",
            "panel.example.org",
            "https://a/b",
            "https://",
        ] {
            assert!(check_origins(&[bad.to_string()]).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_unlisted_origin_gets_nothing() {
        let origins = vec!["https://panel.example.org".to_string()];
        let mut headers = HeaderMap::new();
        headers.insert(
            "origin",
            HeaderValue::from_static("https://evil.example.org"),
        );
        assert!(allowed_origin(&origins, &headers).is_none());
        headers.insert(
            "origin",
            HeaderValue::from_static("https://panel.example.org"),
        );
        assert!(allowed_origin(&origins, &headers).is_some());
    }
}
