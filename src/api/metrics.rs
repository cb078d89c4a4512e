//! `GET /metrics`: what berth counts and holds, in the Prometheus text
//! format.
//!
//! Why it exists: the exposition format (names, types, label escaping,
//! the `_total` of counters) is `prometheus-client`'s job; this module
//! only reads the values a scrape reports, from the engine's counters and
//! one read of the store, into a registry made for that scrape. Values
//! kept in the store (builds by status) are exact at every scrape.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::errors::{ApiError, Code};
use super::{auth, Ctx, Reply, Request};
use crate::locks::Held;
use crate::model::BuildStatus;
use crate::store::{Lookup, Store};

/// One sample's labels, as `name="value"` pairs.
type Labels = Vec<(&'static str, String)>;

/// The metrics of one scrape, made from the values read for it.
#[derive(Default)]
struct Scrape {
    registry: Registry,
}

impl Scrape {
    /// A counter without labels; `name` ends in `_total` (the encoder writes
    /// that suffix itself).
    fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.counters(name, help, [(Labels::new(), value)]);
    }

    fn counters(&mut self, name: &str, help: &str, rows: impl IntoIterator<Item = (Labels, u64)>) {
        let family = Family::<Labels, Counter>::default();
        for (labels, value) in rows {
            family.get_or_create(&labels).inc_by(value);
        }
        let base = name.strip_suffix("_total").unwrap_or(name);
        debug_assert!(base != name, "a counter's name ends in _total: {name}");
        self.registry.register(base, help, family);
    }

    fn gauge(&mut self, name: &str, help: &str, value: u64) {
        self.gauges(name, help, [(Labels::new(), value)]);
    }

    fn gauges(&mut self, name: &str, help: &str, rows: impl IntoIterator<Item = (Labels, u64)>) {
        let family = Family::<Labels, Gauge>::default();
        for (labels, value) in rows {
            family
                .get_or_create(&labels)
                .set(i64::try_from(value).unwrap_or(i64::MAX));
        }
        self.registry.register(name, help, family);
    }

    fn into_text(self) -> Result<String, ApiError> {
        let mut out = String::new();
        encode(&mut out, &self.registry).map_err(|e| {
            tracing::error!(error = %e, "cannot encode the metrics");
            ApiError::internal()
        })?;
        Ok(out)
    }
}

fn label(name: &'static str, value: impl Into<String>) -> Labels {
    vec![(name, value.into())]
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
    let mut scrape = Scrape::default();
    requests(ctx, with_token, &mut scrape);
    builds_and_streams(ctx, &mut scrape)?;
    workers(ctx, &mut scrape)?;
    rollouts(&ctx.engine.read()?, &mut scrape)?;
    agents(ctx, &mut scrape)?;
    cluster(ctx, &mut scrape);
    Ok(Reply::text(
        200,
        "application/openmetrics-text; version=1.0.0; charset=utf-8",
        scrape.into_text()?.into_bytes(),
    ))
}

/// Requests by route and status, denied calls, webhook attempts, update
/// passes: the engine's counters since start.
fn requests(ctx: &Ctx, with_token: bool, scrape: &mut Scrape) {
    let e = &ctx.engine;
    let by_route: Vec<(Labels, u64)> = e
        .metrics
        .requests
        .held()
        .iter()
        .map(|((route, status), n)| {
            (
                vec![("route", route.clone()), ("code", status.to_string())],
                *n,
            )
        })
        .collect();
    scrape.counters(
        "berth_http_requests_total",
        "Requests by route template and status",
        by_route,
    );
    let denials = e.metrics.denials.held();
    let denied: Vec<(Labels, u64)> = match with_token {
        true => denials
            .iter()
            .map(|(p, n)| (label("principal", p.clone()), *n))
            .collect(),
        // Who was denied is the operator's to know, not the public's.
        false => vec![(Labels::new(), denials.values().sum())],
    };
    drop(denials);
    scrape.counters(
        "berth_denied_calls_total",
        "A known actor's denied calls, by principal (subject and issuer) with the service token; without it (--metrics-public) only their sum",
        denied,
    );
    use crate::engine::webhooks::{DELIVERED, FAILED, RETRIED};
    let webhooks = [
        ("delivered", DELIVERED),
        ("retried", RETRIED),
        ("failed", FAILED),
    ]
    .map(|(result, slot)| {
        (
            label("result", result),
            e.metrics.webhooks[slot].load(Ordering::Relaxed),
        )
    });
    scrape.counters(
        "berth_webhook_deliveries_total",
        "Webhook attempts by result since start",
        webhooks,
    );
    scrape.counter(
        "berth_update_passes_total",
        "Passes of the automatic update loop since start",
        e.metrics.update_passes.load(Ordering::Relaxed),
    );
}

/// What the store holds and what runs: builds by status, slots, streams,
/// log and audit counters, SBOM components, the store's size.
fn builds_and_streams(ctx: &Ctx, scrape: &mut Scrape) -> Result<(), ApiError> {
    let e = &ctx.engine;
    let rx = e.read()?;
    scrape.gauge(
        "berth_webhook_pending",
        "Webhook deliveries not yet delivered or failed",
        rx.pending_deliveries()?,
    );
    // Kept in the store by every status change: one read however many
    // builds there are.
    let counts = rx.build_status_counts()?;
    let statuses = [
        BuildStatus::Queued,
        BuildStatus::Running,
        BuildStatus::Succeeded,
        BuildStatus::Failed,
        BuildStatus::Cancelled,
    ];
    let by_status = statuses.map(|s| (label("status", s.as_str()), counts[s as usize]));
    scrape.gauges("berth_builds", "Stored builds by status", by_status);
    scrape.gauge(
        "berth_running_builds",
        "Builds holding a build slot",
        e.running_builds() as u64,
    );
    scrape.gauge(
        "berth_eval_slots_in_use",
        "Eval calls running",
        e.eval_slots_in_use() as u64,
    );
    scrape.gauge(
        "berth_sse_clients",
        "Open event streams",
        e.hub.clients.load(Ordering::SeqCst) as u64,
    );
    scrape.gauge(
        "berth_sse_live_streams",
        "Event streams whose socket the fan-out thread writes (the rest replay or catch up)",
        e.hub.fanout.streams.load(Ordering::Relaxed) as u64,
    );
    scrape.counter(
        "berth_sse_catch_ups_total",
        "Times an event stream fell behind and caught up from the store",
        e.hub.catch_ups.load(Ordering::Relaxed),
    );
    scrape.counter(
        "berth_log_bytes_total",
        "Log bytes stored since start",
        e.metrics.log_bytes.load(Ordering::Relaxed),
    );
    scrape.counter(
        "berth_audit_events_total",
        "Audit events written since start",
        crate::engine::audit::EVENTS_WRITTEN.load(Ordering::Relaxed),
    );
    scrape.counter(
        "berth_audit_write_failures_total",
        "Audit events of refused calls that could not be written (the call was answered)",
        crate::engine::audit::WRITE_FAILURES.load(Ordering::Relaxed),
    );
    scrape.gauge(
        "berth_sbom_components",
        "Distinct SBOM components stored (each shared one once)",
        rx.component_count()?,
    );
    scrape.gauge(
        "berth_store_bytes",
        "Size of berth.redb",
        Store::file_size(&e.settings.db_path()),
    );
    Ok(())
}

/// Worker tokens, attempts by worker, lost attempts, refused calls, polls,
/// builds no worker here can take, stored work states.
fn workers(ctx: &Ctx, scrape: &mut Scrape) -> Result<(), ApiError> {
    use crate::engine::attempts::{ATTEMPTS_LOST, REFUSED_STALE};
    let e = &ctx.engine;
    let rx = e.read()?;
    let mut running: BTreeMap<String, u64> = BTreeMap::new();
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
        match seen {
            true => connected += 1,
            false => disconnected += 1,
        }
    }
    let local_takes_builds = e.settings.local_worker
        && e.settings
            .build_labels
            .0
            .iter()
            .all(|l| e.settings.local_labels.0.contains(l));
    let waiting = match local_takes_builds {
        true => 0,
        false => rx.queued()?.len() as u64,
    };
    scrape.gauges(
        "berth_workers",
        "Worker tokens by whether their worker called within a lease",
        [
            (label("state", "connected"), connected),
            (label("state", "disconnected"), disconnected),
        ],
    );
    scrape.gauges(
        "berth_attempts_running",
        "Authoritative attempts by worker",
        running.into_iter().map(|(w, n)| (label("worker", w), n)),
    );
    scrape.counter(
        "berth_attempts_lost_total",
        "Attempts lost (lease passed, token revoked) since start",
        ATTEMPTS_LOST.load(Ordering::Relaxed),
    );
    let refused = ["stale_authority", "lease_expired"]
        .iter()
        .zip(&REFUSED_STALE)
        .map(|(reason, n)| (label("reason", *reason), n.load(Ordering::Relaxed)));
    scrape.counters(
        "berth_internal_refused_total",
        "Worker calls refused for stale authority since start",
        refused,
    );
    let polls = ctx.polls.held(super::workers::ALL_POLLS);
    scrape.gauge("berth_worker_polls", "Open worker polls", polls as u64);
    scrape.gauge(
        "berth_builds_waiting_for_worker",
        "Queued builds the embedded worker cannot take",
        waiting,
    );
    scrape.gauge(
        "berth_work_state_bytes",
        "Compressed bytes of the stored work states",
        rx.work_state_bytes()?,
    );
    Ok(())
}

/// `berth_rollouts{state}` and `berth_freezes_active{scope}`.
fn rollouts(rx: &crate::store::Rx, scrape: &mut Scrape) -> Result<(), ApiError> {
    let mut by_state: BTreeMap<&str, u64> = BTreeMap::new();
    for (build, _) in rx.running()? {
        if let Some(r) = rx.rollout(build)? {
            *by_state.entry(r.rollout.state.as_str()).or_default() += 1;
        }
    }
    scrape.gauges(
        "berth_rollouts",
        "Rollouts of running builds by state",
        by_state
            .into_iter()
            .map(|(state, n)| (label("state", state), n)),
    );
    let now = crate::model::now_millis();
    let (mut global, mut own) = (0u64, 0u64);
    for (key, f) in rx.freezes()? {
        if crate::engine::freeze::is_active(&f, now) {
            match key == crate::model::GLOBAL_FREEZE {
                true => global += 1,
                false => own += 1,
            }
        }
    }
    scrape.gauges(
        "berth_freezes_active",
        "Active freezes by scope",
        [
            (label("scope", "global"), global),
            (label("scope", "deployment"), own),
        ],
    );
    Ok(())
}

/// Agents' streams and reports, nodes by their agent's status.
fn agents(ctx: &Ctx, scrape: &mut Scrape) -> Result<(), ApiError> {
    let (streams, reports) = ctx.engine.agent_counts();
    scrape.gauge(
        "berth_agent_streams",
        "Open desired-state streams of agents",
        streams as u64,
    );
    scrape.counter(
        "berth_agent_reports_total",
        "Agents' reports taken",
        reports,
    );
    let nodes = ctx.engine.nodes_by_status()?;
    scrape.gauges(
        "berth_nodes",
        "Nodes bound to agents by their agent's status",
        nodes
            .into_iter()
            .map(|(status, n)| (label("status", status), n)),
    );
    Ok(())
}

/// With a store in PostgreSQL: `berth_store_up` (this replica surely
/// leads: its lease holds) and `berth_cluster_replicas` (those the last
/// heartbeat saw).
fn cluster(ctx: &Ctx, scrape: &mut Scrape) {
    let (Some(status), Some(lease)) = (&ctx.cluster, ctx.engine.lease()) else {
        return;
    };
    scrape.gauge(
        "berth_store_up",
        "Whether this replica reaches its store and surely leads (1) or not (0)",
        u64::from(lease.holds()),
    );
    scrape.gauge(
        "berth_cluster_replicas",
        "Replicas seen within the lease",
        status.replica_count() as u64,
    );
}
