//! Operations routes: /healthz, /readyz, /metrics, /v1/openapi.json.

use crate::locks::Held;
use std::fmt::Write;
use std::sync::atomic::Ordering;

use super::errors::{ApiError, Code};
use super::{auth, Ctx, Reply, Request};
use crate::engine;
use crate::model::BuildStatus;
use crate::store::Store;

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
    let origins = &ctx.engine.settings.callback_origin;
    match served_document(origins) {
        Ok(body) => Reply::text(200, "application/json", body),
        Err(e) => {
            tracing::error!(error = %e, "the OpenAPI document does not parse");
            Reply::from_error(&ApiError::internal(), "")
        }
    }
}

fn served_document(callback_origins: &[String]) -> Result<Vec<u8>, String> {
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
    serde_json::to_vec(&doc).map_err(|e| e.to_string())
}

/// A label value in the exposition format: `\\`, `"` and line feeds
/// escaped as it requires, and a carriage return too, so no value can
/// start a line of its own for a reader that splits on either.
fn label_value(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
        .replace('\r', "\\r")
}

pub fn count_request(ctx: &Ctx, route: &'static str, status: u16) {
    let mut m = ctx.engine.metrics.requests.held();
    *m.entry((route.to_string(), status)).or_default() += 1;
}

pub fn metrics(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let with_token = auth::has_service_token(&ctx.service_token, &req.headers);
    if !ctx.engine.settings.metrics_public && !with_token {
        return Err(ApiError::new(
            Code::Unauthenticated,
            "/metrics needs the service token (or --metrics-public)",
        ));
    }
    let mut out = String::new();
    let e = &ctx.engine;
    let components = e.read()?.component_count()?;
    out.push_str("# HELP berth_http_requests_total Requests by route template and status.\n# TYPE berth_http_requests_total counter\n");
    {
        let m = e.metrics.requests.held();
        let mut rows: Vec<_> = m.iter().collect();
        rows.sort();
        for ((route, status), n) in rows {
            let _ = writeln!(
                out,
                "berth_http_requests_total{{route=\"{route}\",code=\"{status}\"}} {n}"
            );
        }
    }
    out.push_str("# HELP berth_denied_calls_total A known actor's denied calls, by principal (subject and issuer) with the service token; without it (--metrics-public) only their sum.\n# TYPE berth_denied_calls_total counter\n");
    {
        let m = e.metrics.denials.held();
        if with_token {
            let mut rows: Vec<_> = m.iter().collect();
            rows.sort();
            for (principal, n) in rows {
                let label = label_value(principal);
                let _ = writeln!(out, "berth_denied_calls_total{{principal=\"{label}\"}} {n}");
            }
        } else {
            // Who was denied is the operator's to know, not the public's.
            let _ = writeln!(out, "berth_denied_calls_total {}", m.values().sum::<u64>());
        }
    }
    out.push_str("# HELP berth_webhook_deliveries_total Webhook attempts by result since start.\n# TYPE berth_webhook_deliveries_total counter\n");
    for (result, slot) in [
        ("delivered", crate::engine::webhooks::DELIVERED),
        ("retried", crate::engine::webhooks::RETRIED),
        ("failed", crate::engine::webhooks::FAILED),
    ] {
        let n = e.metrics.webhooks[slot].load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "berth_webhook_deliveries_total{{result=\"{result}\"}} {n}"
        );
    }
    let _ = writeln!(
        out,
        "# HELP berth_update_passes_total Passes of the automatic update loop since start.\n# TYPE berth_update_passes_total counter\nberth_update_passes_total {}",
        e.metrics.update_passes.load(Ordering::Relaxed)
    );
    let pending = e.read()?.pending_deliveries()?;
    let _ = writeln!(
        out,
        "# HELP berth_webhook_pending Webhook deliveries not yet delivered or failed.\n# TYPE berth_webhook_pending gauge\nberth_webhook_pending {pending}"
    );
    // Kept in the store by every status change: exact at every scrape, and
    // one read however many builds there are.
    let counts = e.read()?.build_status_counts()?;
    out.push_str("# HELP berth_builds Stored builds by status.\n# TYPE berth_builds gauge\n");
    for status in [
        BuildStatus::Queued,
        BuildStatus::Running,
        BuildStatus::Succeeded,
        BuildStatus::Failed,
        BuildStatus::Cancelled,
    ] {
        let _ = writeln!(
            out,
            "berth_builds{{status=\"{}\"}} {}",
            status.as_str(),
            counts[status as usize]
        );
    }
    let plain = [
        (
            "berth_running_builds",
            "Builds holding a build slot.",
            e.running_builds() as u64,
        ),
        (
            "berth_eval_slots_in_use",
            "Eval calls running.",
            e.eval_slots_in_use() as u64,
        ),
        (
            "berth_sse_clients",
            "Open event streams.",
            e.hub.clients.load(Ordering::SeqCst) as u64,
        ),
        (
            "berth_sse_live_streams",
            "Event streams whose socket the fan-out thread writes (the rest replay or catch up).",
            e.hub.fanout.streams.load(Ordering::Relaxed) as u64,
        ),
        (
            "berth_sse_catch_ups_total",
            "Times an event stream fell behind and caught up from the store.",
            e.hub.catch_ups.load(Ordering::Relaxed),
        ),
        (
            "berth_log_bytes_total",
            "Log bytes stored since start.",
            e.metrics.log_bytes.load(Ordering::Relaxed),
        ),
        (
            "berth_audit_events_total",
            "Audit events written since start.",
            crate::engine::audit::EVENTS_WRITTEN.load(Ordering::Relaxed),
        ),
        (
            "berth_audit_write_failures_total",
            "Audit events of refused calls that could not be written (the call was answered).",
            crate::engine::audit::WRITE_FAILURES.load(Ordering::Relaxed),
        ),
        (
            "berth_sbom_components",
            "Distinct SBOM components stored (each shared one once).",
            components,
        ),
        (
            "berth_store_bytes",
            "Size of berth.redb.",
            Store::file_size(&e.settings.db_path()),
        ),
    ];
    for (name, help, value) in plain {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    }
    workers_exposition(ctx, &mut out)?;
    rollout_exposition(&ctx.engine.read()?, &mut out)?;
    agent_exposition(ctx, &mut out)?;
    cluster_exposition(ctx, &mut out);
    Ok(Reply::text(
        200,
        "text/plain; version=0.0.4",
        out.into_bytes(),
    ))
}

/// The workers' part of `/metrics` (workers.md "What berth shows").
/// `berth_agent_streams`, `berth_agent_reports_total`, `berth_nodes{status}`
/// (agents.md).
fn agent_exposition(ctx: &Ctx, out: &mut String) -> Result<(), ApiError> {
    let (streams, reports) = ctx.engine.agent_counts();
    let _ = writeln!(
        out,
        "# HELP berth_agent_streams Open desired-state streams of agents.\n# TYPE berth_agent_streams gauge\nberth_agent_streams {streams}"
    );
    let _ = writeln!(
        out,
        "# HELP berth_agent_reports_total Agents' reports taken.\n# TYPE berth_agent_reports_total counter\nberth_agent_reports_total {reports}"
    );
    let _ = writeln!(
        out,
        "# HELP berth_nodes Nodes bound to agents by their agent's status.\n# TYPE berth_nodes gauge"
    );
    for (status, n) in ctx.engine.nodes_by_status()? {
        let _ = writeln!(out, "berth_nodes{{status=\"{status}\"}} {n}");
    }
    Ok(())
}

/// With a store in PostgreSQL: `berth_store_up` (this replica surely
/// leads: its lease holds) and `berth_cluster_replicas` (those the last
/// heartbeat saw).
fn cluster_exposition(ctx: &Ctx, out: &mut String) {
    let (Some(status), Some(lease)) = (&ctx.cluster, ctx.engine.lease()) else {
        return;
    };
    let up = u8::from(lease.holds());
    let replicas = status.replica_count();
    let _ = writeln!(
        out,
        "# HELP berth_store_up Whether this replica reaches its store and surely leads (1) or not (0).\n# TYPE berth_store_up gauge\nberth_store_up {up}"
    );
    let _ = writeln!(
        out,
        "# HELP berth_cluster_replicas Replicas seen within the lease.\n# TYPE berth_cluster_replicas gauge\nberth_cluster_replicas {replicas}"
    );
}

/// `berth_rollouts{state}` and `berth_freezes_active{scope}`.
fn rollout_exposition(rx: &crate::store::Rx, out: &mut String) -> Result<(), ApiError> {
    use crate::store::Lookup;
    let mut rollouts: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
    for (build, _) in rx.running()? {
        if let Some(r) = rx.rollout(build)? {
            *rollouts.entry(r.rollout.state.as_str()).or_default() += 1;
        }
    }
    let _ = writeln!(
        out,
        "# HELP berth_rollouts Rollouts of running builds by state.\n# TYPE berth_rollouts gauge"
    );
    for (state, n) in rollouts {
        let _ = writeln!(out, "berth_rollouts{{state=\"{state}\"}} {n}");
    }
    let now = crate::model::now_millis();
    let (mut global, mut own) = (0u64, 0u64);
    for (key, f) in rx.freezes()? {
        if crate::engine::freeze::is_active(&f, now) {
            if key == crate::model::GLOBAL_FREEZE {
                global += 1;
            } else {
                own += 1;
            }
        }
    }
    let _ = writeln!(out, "# HELP berth_freezes_active Active freezes by scope.\n# TYPE berth_freezes_active gauge\nberth_freezes_active{{scope=\"global\"}} {global}\nberth_freezes_active{{scope=\"deployment\"}} {own}");
    Ok(())
}

fn workers_exposition(ctx: &Ctx, out: &mut String) -> Result<(), ApiError> {
    use crate::engine::attempts::{ATTEMPTS_LOST, REFUSED_STALE};
    use crate::store::Lookup;
    let e = &ctx.engine;
    let rx = e.read()?;
    let mut running: std::collections::BTreeMap<String, u64> = Default::default();
    for (build, _) in rx.running()? {
        if let Some(a) = rx.last_attempt(build)? {
            if a.state == crate::model::AttemptState::Active {
                *running.entry(a.worker).or_default() += 1;
            }
        }
    }
    let ttl = i64::try_from(e.settings.lease_ttl.as_millis()).unwrap_or(i64::MAX);
    let (mut connected, mut disconnected) = (0u64, 0u64);
    for (_, t) in rx.tokens()? {
        let seen = t.seen.as_ref().is_some_and(|s| {
            crate::model::now_millis() - s.at <= ttl.max(crate::authority::SEEN_EVERY_MS)
        });
        if seen {
            connected += 1;
        } else {
            disconnected += 1;
        }
    }
    let local_takes_builds = e.settings.local_worker
        && e.settings
            .build_labels
            .0
            .iter()
            .all(|l| e.settings.local_labels.0.contains(l));
    let waiting = if local_takes_builds {
        0
    } else {
        rx.queued()?.len()
    };
    let _ = writeln!(out, "# HELP berth_workers Worker tokens by whether their worker called within a lease.\n# TYPE berth_workers gauge\nberth_workers{{state=\"connected\"}} {connected}\nberth_workers{{state=\"disconnected\"}} {disconnected}");
    let _ = writeln!(out, "# HELP berth_attempts_running Authoritative attempts by worker.\n# TYPE berth_attempts_running gauge");
    for (worker, n) in running {
        let _ = writeln!(
            out,
            "berth_attempts_running{{worker=\"{}\"}} {n}",
            label_value(&worker)
        );
    }
    let lost = ATTEMPTS_LOST.load(Ordering::Relaxed);
    let _ = writeln!(out, "# HELP berth_attempts_lost_total Attempts lost (lease passed, token revoked) since start.\n# TYPE berth_attempts_lost_total counter\nberth_attempts_lost_total {lost}");
    let _ = writeln!(out, "# HELP berth_internal_refused_total Worker calls refused for stale authority since start.\n# TYPE berth_internal_refused_total counter");
    for (reason, n) in ["stale_authority", "lease_expired"]
        .iter()
        .zip(&REFUSED_STALE)
    {
        let _ = writeln!(
            out,
            "berth_internal_refused_total{{reason=\"{reason}\"}} {}",
            n.load(Ordering::Relaxed)
        );
    }
    let polls = ctx.polls.held(super::workers::ALL_POLLS);
    let _ = writeln!(out, "# HELP berth_worker_polls Open worker polls.\n# TYPE berth_worker_polls gauge\nberth_worker_polls {polls}");
    let _ = writeln!(out, "# HELP berth_builds_waiting_for_worker Queued builds the embedded worker cannot take.\n# TYPE berth_builds_waiting_for_worker gauge\nberth_builds_waiting_for_worker {waiting}");
    let stored = rx.work_state_bytes()?;
    let _ = writeln!(out, "# HELP berth_work_state_bytes Compressed bytes of the stored work states.\n# TYPE berth_work_state_bytes gauge\nberth_work_state_bytes {stored}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ORIGINS: [&str; 2] = ["https://panel.example.org", "http://127.0.0.1:9000"];

    /// The callback schema the served document states, compiled.
    fn served_callback_schema() -> (boon::Schemas, boon::SchemaIndex) {
        let origins: Vec<String> = ORIGINS.iter().map(|o| o.to_string()).collect();
        let doc: serde_json::Value =
            serde_json::from_slice(&served_document(&origins).expect("the document parses"))
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
        let rule = engine::CallbackRule::new(&origins).expect("the pattern compiles");
        let taken = rule.takes(url);
        (stated, taken)
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
