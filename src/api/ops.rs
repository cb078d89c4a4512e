//! Operations routes: /healthz, /readyz, /v1/cluster, /v1/openapi.json
//! (`/metrics` is `metrics.rs`).

use std::sync::atomic::Ordering;

use super::errors::ApiError;
use super::{Ctx, Reply};
use crate::engine;

/// The published contract, kept in the repo and checked against `ROUTES`.
pub const OPENAPI: &str = include_str!("openapi.json");

pub fn healthz() -> Reply {
    Reply::text(200, "text/plain; charset=utf-8", b"ok\n".to_vec())
}

pub fn readyz(ctx: &Ctx) -> Reply {
    // A replica on PostgreSQL that cannot confirm its lease serves
    // nothing: a proxy must send elsewhere.
    if let Err(e) = ctx.engine.read() {
        if e.kind == crate::store::StoreErrorKind::Unreachable {
            let body = format!("not ready: {} (store_unreachable)\n", e.detail);
            return Reply::text(503, "text/plain; charset=utf-8", body.into_bytes());
        }
    }
    if ctx.engine.ready.load(Ordering::SeqCst) {
        Reply::text(200, "text/plain; charset=utf-8", b"ready\n".to_vec())
    } else {
        Reply::text(
            503,
            "text/plain; charset=utf-8",
            b"starting: recovery is not done\n".to_vec(),
        )
    }
}

/// `GET /v1/cluster`: the store, this replica and the replicas the last
/// heartbeat saw (docs/cluster.md).
pub fn cluster(ctx: &Ctx) -> Reply {
    let view = match &ctx.cluster {
        Some(status) => status.view(),
        None => crate::store::upstream::Status::single(),
    };
    Reply::json(200, &view)
}

/// The contract as this server applies it: the document, with the
/// callback origins `--callback-origin` allows stated in the delete body's
/// schema (so a client, or a fuzzer, knows which callbacks are accepted).
pub fn openapi(ctx: &Ctx) -> Reply {
    let settings = &ctx.engine.settings;
    match served_document(&settings.callback_origin, &settings.webhook_origin) {
        Ok(body) => Reply::text(200, "application/json", body),
        Err(e) => {
            tracing::error!(error = %e, "the OpenAPI document does not parse");
            Reply::from_error(&ApiError::internal(), "")
        }
    }
}

fn served_document(
    callback_origins: &[String],
    webhook_origins: &[String],
) -> Result<Vec<u8>, String> {
    let mut doc: serde_json::Value = serde_json::from_str(OPENAPI).map_err(|e| e.to_string())?;
    let callback = doc
        .pointer_mut("/components/schemas/DeleteRequest/properties/callback")
        .ok_or("the document has no DeleteRequest callback")?;
    *callback = if callback_origins.is_empty() {
        serde_json::json!({"type": "null", "description": "no --callback-origin is set: a callback is refused"})
    } else {
        serde_json::json!({
            "type": ["string", "null"],
            "maxLength": engine::CALLBACK_MAX_BYTES,
            "pattern": engine::callback_pattern(callback_origins),
            "description": "where the destroy is reported: under one of --callback-origin"
        })
    };
    let url = doc
        .pointer_mut("/components/schemas/WebhookRequest/properties/url")
        .ok_or("the document has no WebhookRequest url")?;
    url["pattern"] = serde_json::Value::String(match webhook_origins.is_empty() {
        // No origin is allowed: a pattern nothing matches.
        true => "^(?!)$".to_string(),
        false => engine::callback_pattern(webhook_origins),
    });
    serde_json::to_vec(&doc).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ORIGINS: [&str; 2] = ["https://panel.example.org", "http://127.0.0.1:9000"];

    /// The callback schema the served document states, compiled.
    fn served_callback_schema() -> (boon::Schemas, boon::SchemaIndex) {
        let origins: Vec<String> = ORIGINS.iter().map(|o| o.to_string()).collect();
        let doc: serde_json::Value = serde_json::from_slice(
            &served_document(&origins, &origins).expect("the document parses"),
        )
        .expect("the served document is JSON");
        let schema = doc
            .pointer("/components/schemas/DeleteRequest/properties/callback")
            .expect("the callback's schema")
            .clone();
        let mut schemas = boon::Schemas::new();
        let mut compiler = boon::Compiler::new();
        compiler
            .add_resource("urn:callback", schema)
            .expect("the schema loads");
        let index = compiler
            .compile("urn:callback", &mut schemas)
            .expect("the schema compiles");
        (schemas, index)
    }

    fn agree(schema: &(boon::Schemas, boon::SchemaIndex), url: &str) -> (bool, bool) {
        let origins: Vec<String> = ORIGINS.iter().map(|o| o.to_string()).collect();
        let stated = schema
            .0
            .validate(&serde_json::Value::String(url.into()), schema.1)
            .is_ok();
        let rule = engine::OriginUrlRule::new(&origins, "--callback-origin")
            .expect("the pattern compiles");
        let taken = rule.takes(url);
        (stated, taken)
    }

    #[test]
    fn the_served_webhook_url_pattern_is_the_one_the_server_checks_with() {
        let origins: Vec<String> = ORIGINS.iter().map(|o| o.to_string()).collect();
        let doc: serde_json::Value =
            serde_json::from_slice(&served_document(&[], &origins).expect("the document parses"))
                .expect("the served document is JSON");
        let stated = doc
            .pointer("/components/schemas/WebhookRequest/properties/url/pattern")
            .and_then(serde_json::Value::as_str)
            .expect("the webhook url's pattern");
        assert_eq!(stated, engine::callback_pattern(&origins));
        let none: serde_json::Value =
            serde_json::from_slice(&served_document(&[], &[]).expect("the document parses"))
                .expect("the served document is JSON");
        assert_eq!(
            none.pointer("/components/schemas/WebhookRequest/properties/url/pattern"),
            Some(&serde_json::json!("^(?!)$")),
            "without --webhook-origin the document says no url is taken"
        );
    }

    #[test]
    fn the_served_callback_pattern_takes_exactly_the_callbacks_the_server_takes() {
        let schema = served_callback_schema();
        for (url, expected) in [
            ("https://panel.example.org/hooks/destroyed", true),
            ("https://panel.example.org", true),
            ("https://panel.example.org/", true),
            ("https://panel.example.org/*", true),
            ("https://panel.example.org/a?b=c&d=%2F", true),
            ("http://127.0.0.1:9000/x", true),
            ("https://panel.example.org/a b", false),
            ("https://panel.example.org/a#frag", false),
            ("https://panel.example.org/%zz", false),
            ("https://panel.example.org/%4", false),
            ("https://panel.example.orgx/", false),
            ("https://panel.example.org:443/", false),
            ("HTTPS://panel.example.org/", false),
            ("https://evil.example.com/", false),
            ("https://panel.example.org/é", false),
            ("http://127.0.0.1:90000/x", false),
        ] {
            let (stated, taken) = agree(&schema, url);
            assert_eq!(stated, expected, "the document on {url:?}");
            assert_eq!(taken, expected, "the server on {url:?}");
        }
        let long = format!("{}/{}", ORIGINS[0], "a".repeat(engine::CALLBACK_MAX_BYTES));
        assert_eq!(
            agree(&schema, &long),
            (false, false),
            "a callback past the limit"
        );
    }

    proptest! {
        #[test]
        fn the_served_callback_pattern_and_the_server_agree_on_any_tail(
            origin in 0..ORIGINS.len(),
            tail in "[ -~é%/#?]{0,40}",
        ) {
            let schema = served_callback_schema();
            let url = format!("{}{tail}", ORIGINS[origin]);
            let (stated, taken) = agree(&schema, &url);
            prop_assert_eq!(stated, taken, "on {:?}", url);
        }
    }
}
