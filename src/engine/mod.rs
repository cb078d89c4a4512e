//! The engine: every state change of deployments and builds, and everything
//! that runs by itself (the queue, builds, recovery, callbacks, sweeps).
//!
//! Handlers in `api` parse and authorize, then call one function here. Each
//! state change is one store transaction that checks the lifecycle rules
//! (spec lifecycle.md) and writes the records, the idempotency record and
//! the events of the change, together.

pub mod actions;
pub mod activations;
pub mod attempts;
pub mod audit;
pub mod audit_events;
pub mod build;
pub mod callbacks;
pub mod deployer;
pub mod freeze;
pub mod health;
pub mod log_pipe;
pub mod nodes;
pub mod outbox;
pub mod outcome;
pub mod queue;
pub mod recovery;
pub mod refusal;
pub mod remote_log;
pub mod remote_rollout;
pub mod requests;
pub mod resume;
pub mod rollouts;
pub mod runner;
pub mod sboms;
pub mod staging;
pub mod sweeps;
pub mod tokens;
pub mod transition;
pub mod updates;
pub mod verdict;
pub mod webhooks;
pub mod work_state;

pub use audit::Recorder;
pub use requests::{CancelTaken, DestroyQueued, Mode, SubmitInput, Submitted};

use crate::locks::Held;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use tokio::sync::{watch, Notify, Semaphore};

use crate::model::*;
use crate::settings::Settings;
use crate::store::Store;
use deployer::Described;
use runner::DeployerCommand;

/// The first pause before a write that must land is tried again
/// (`Engine::write_until_landed`).
const WRITE_RETRY_FIRST_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// Counters shown on /metrics that are not in the store.
#[derive(Default)]
pub struct Metrics {
    pub requests: Mutex<HashMap<(String, u16), u64>>,
    pub log_bytes: AtomicU64,
    /// A known actor's denied calls, by principal (`subject issuer`): each
    /// is an audit event (audit.md keeps them), and this lets an operator
    /// see one tenant doing it. At most `MAX_DENIAL_PRINCIPALS` rows; the
    /// rest count under "other".
    pub denials: Mutex<HashMap<String, u64>>,
    /// Webhook attempts by result (notifications.md): delivered, retried,
    /// failed.
    pub webhooks: [AtomicU64; 3],
    /// Passes the automatic update loop finished: an operator sees it
    /// runs, and a test waits for passes instead of guessing their time.
    pub update_passes: AtomicU64,
}

/// Principals `/metrics` counts denials of one by one, at most.
pub const MAX_DENIAL_PRINCIPALS: usize = 1000;

impl Metrics {
    pub fn count_denial(&self, principal: &str) {
        let mut denials = self.denials.held();
        let key = if denials.contains_key(principal) || denials.len() < MAX_DENIAL_PRINCIPALS {
            principal
        } else {
            "other"
        };
        *denials.entry(key.to_string()).or_default() += 1;
    }
}

#[derive(Default)]
struct Sched {
    /// Builds that hold a build slot, with their deployment.
    running: HashMap<BuildId, String>,
    /// Deployments whose orphaned deployer (from before a restart) is still
    /// being stopped: nothing of theirs starts until it has exited.
    blocked: HashSet<String>,
}

pub struct Engine {
    pub settings: Arc<Settings>,
    /// How a destroy's callback is checked (`--callback-origin`).
    pub callback_rule: OriginUrlRule,
    /// How a webhook subscription's URL is checked (`--webhook-origin`).
    pub webhook_rule: OriginUrlRule,
    /// Reached from above only through the engine's operations (`read`,
    /// `reader`, `keep_answer`, `close_store`).
    store: Store,
    deployer: DeployerCommand,
    /// The source new submits use.
    pub default_source: Source,
    /// True when `--default-source` was given (a self-pin); automatic updates
    /// need one.
    has_self_pin: bool,
    eval_slots: Arc<Semaphore>,
    described: Mutex<HashMap<String, Arc<Described>>>,
    /// Describes in flight and recent failures, per source digest.
    describing: deployer::Describing,
    sched: Mutex<Sched>,
    wake: Notify,
    /// Wakes every open worker poll: the queue changed (a build queued or
    /// ended, a cancel asked).
    queue_changed: Notify,
    /// Rings when an action changed a rollout: its runner reads it again.
    rollout_wake: Notify,
    /// The calls of rollouts on remote workers waiting for them.
    remote_rollouts: remote_rollout::RemoteRollouts,
    /// What berth saw of each node's agent since it started.
    agents: nodes::Agents,
    callbacks_wake: Notify,
    /// Wakes the automatic update loop (a policy changed).
    updates_wake: Notify,
    cancels: Mutex<HashMap<BuildId, watch::Sender<outcome::Halt>>>,
    pub ready: AtomicBool,
    stopping: AtomicBool,
    pub metrics: Metrics,
    callback_secret: Vec<u8>,
    pub hub: Arc<crate::events::Hub>,
    /// Anonymous denials folded per `--audit-denial-interval`.
    denials: audit::Denials,
    stop: watch::Sender<bool>,
    /// The embedded worker's incarnation: drawn at each start, so a
    /// restart is "the old incarnation's attempts end" (workers.md).
    pub incarnation: String,
}

/// The source berth uses for its embedded `local` deployer when no
/// `--default-source` is given: named after berth's own version.
pub fn builtin_source() -> Source {
    let version = env!("CARGO_PKG_VERSION");
    let digest = Sha256::digest(format!("berth-local-deployer {version}").as_bytes());
    Source {
        url: "builtin:berth-local-deployer".into(),
        rev: version.into(),
        digest: format!("sha256:{}", crate::hex::encode(&digest)),
    }
}

fn origin_of(url: &str) -> Option<String> {
    let u = reqwest::Url::parse(url).ok()?;
    let host = u.host_str()?;
    Some(match u.port_or_known_default() {
        Some(p) => format!("{}://{}:{}", u.scheme(), host, p),
        None => format!("{}://{}", u.scheme(), host),
    })
}

/// True when `url`'s origin is one of `allowed` (each `scheme://host[:port]`).
pub fn origin_allowed(url: &str, allowed: &[String]) -> bool {
    let Some(origin) = origin_of(url) else {
        return false;
    };
    allowed
        .iter()
        .any(|a| origin_of(a).as_deref() == Some(origin.as_str()))
}

/// The longest callback URL a destroy takes. A callback is stored with the
/// pending destroy and sent for up to a day; 2 KiB is what browsers and
/// proxies reliably carry, and what a webhook's URL may be.
pub const CALLBACK_MAX_BYTES: usize = 2048;

/// What may follow a callback's origin: a path and query of RFC 3986's
/// `pchar`s (unreserved, sub-delims, `:`, `@`, and `%` with two hex digits),
/// `/` and `?`. No fragment (it is never sent), no space, nothing a client
/// would have to escape. Written once, in the regular expression the served
/// OpenAPI document states and the server checks with (`OriginUrlRule`), so
/// the document and the server cannot disagree (`api::ops` tests that the
/// document's engine and the server's read it alike).
const CALLBACK_REST_PATTERN: &str = "(/([A-Za-z0-9._~!$&'()*+,;=:@/?-]|%[0-9A-Fa-f]{2})*)?";

/// The regular expression (ECMA-262, anchored) a callback must match: one
/// of `allowed` origins spelled exactly as configured, then a path.
pub fn callback_pattern(allowed: &[String]) -> String {
    let escaped: Vec<String> = allowed
        .iter()
        .map(|o| {
            o.chars()
                .map(|c| match c {
                    '\\' | '.' | '^' | '$' | '|' | '?' | '*' | '+' | '(' | ')' | '[' | ']'
                    | '{' | '}' => format!("\\{c}"),
                    c => c.to_string(),
                })
                .collect()
        })
        .collect();
    format!("^({}){CALLBACK_REST_PATTERN}$", escaped.join("|"))
}

/// The rule a destroy's callback (of `--callback-origin`) or a webhook's
/// URL (of `--webhook-origin`) is checked by: [`callback_pattern`] of the
/// allowed origins, compiled once, and [`CALLBACK_MAX_BYTES`], the two
/// things the served document states. One implementation, so the
/// document and the server cannot drift apart.
pub struct OriginUrlRule {
    pattern: regex::Regex,
}

impl OriginUrlRule {
    /// The rule of the origins `flag` (its name, for the error) allows.
    pub fn new(allowed: &[String], flag: &str) -> Result<OriginUrlRule, String> {
        regex::Regex::new(&callback_pattern(allowed))
            .map(|pattern| OriginUrlRule { pattern })
            .map_err(|e| format!("the origins of {flag} make no valid pattern: {e}"))
    }

    /// Whether `url` is at most `CALLBACK_MAX_BYTES` and matches the
    /// pattern.
    pub fn takes(&self, url: &str) -> bool {
        url.len() <= CALLBACK_MAX_BYTES && self.pattern.is_match(url)
    }
}

impl Engine {
    pub fn new(
        settings: Arc<Settings>,
        store: Store,
        callback_secret: Vec<u8>,
    ) -> Result<Arc<Engine>, String> {
        let deployer = DeployerCommand::from_setting(
            settings.deployer.as_deref(),
            settings.deployer_user.as_deref(),
        )?;
        let (default_source, has_self_pin) = match &settings.default_source {
            Some(s) => (s.clone(), true),
            None => (builtin_source(), false),
        };
        let callback_rule = OriginUrlRule::new(&settings.callback_origin, "--callback-origin")?;
        let webhook_rule = OriginUrlRule::new(&settings.webhook_origin, "--webhook-origin")?;
        let mut random = [0u8; 16];
        getrandom::fill(&mut random)
            .map_err(|e| format!("no randomness for the incarnation: {e}"))?;
        let incarnation = format!("local-{}", crate::hex::encode(&random));
        let document_times = nodes::document_times(&settings);
        Ok(Arc::new(Engine {
            incarnation,
            callback_rule,
            webhook_rule,
            eval_slots: Arc::new(Semaphore::new(settings.eval_slots)),
            settings,
            store,
            deployer,
            default_source,
            has_self_pin,
            described: Mutex::new(HashMap::new()),
            describing: deployer::Describing::default(),
            sched: Mutex::new(Sched::default()),
            wake: Notify::new(),
            queue_changed: Notify::new(),
            rollout_wake: Notify::new(),
            remote_rollouts: remote_rollout::RemoteRollouts::default(),
            agents: nodes::Agents::default(),
            callbacks_wake: Notify::new(),
            updates_wake: Notify::new(),
            cancels: Mutex::new(HashMap::new()),
            ready: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            metrics: Metrics::default(),
            callback_secret,
            hub: Arc::new(crate::events::Hub::with_document_times(document_times)),
            denials: audit::Denials::default(),
            stop: watch::channel(false).0,
        }))
    }

    /// Tells long-lived tasks (event streams, rollouts between calls) that
    /// berth is stopping.
    pub fn begin_shutdown(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.stop.send_replace(true);
        self.wake_rollouts();
    }

    /// Commits `job` as a write that must land (`Urgency::Must`: it may
    /// take the redo log's reserve), again after each failure that may
    /// pass (a full disk that recovers, a store's database that comes
    /// back), pausing from
    /// `WRITE_RETRY_FIRST_PAUSE` and doubling up to `max_pause`, until it
    /// lands, fails for good, or berth is stopping. `what` names it, for
    /// `build`, in the log.
    pub(crate) async fn write_until_landed<T, F>(
        &self,
        build: BuildId,
        what: &str,
        max_pause: std::time::Duration,
        job: F,
    ) -> crate::store::StoreResult<T>
    where
        T: Send + 'static,
        F: FnMut(&crate::store::Tx) -> crate::store::StoreResult<T> + Clone + Send + 'static,
    {
        let mut pause = WRITE_RETRY_FIRST_PAUSE;
        loop {
            let attempt = self
                .store
                .write_with(crate::store::Urgency::Must, job.clone())
                .await;
            match attempt {
                Err(e)
                    if e.may_pass() && !self.stopping.load(std::sync::atomic::Ordering::SeqCst) =>
                {
                    tracing::warn!(error = %e, build = %format_build_id(build), retry_in = ?pause,
                        "{what} failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(max_pause);
                }
                other => return other,
            }
        }
    }

    /// A reader of the store at one instant.
    pub fn read(&self) -> crate::store::StoreResult<crate::store::Rx> {
        self.store.read()
    }

    /// A handle that only reads the store, for work on the blocking pool
    /// or a stream that reads again as it goes.
    pub fn reader(&self) -> crate::store::Reader {
        self.store.reader()
    }

    /// Stores what a caller's answer needs kept (an idempotent refusal's
    /// answer) in a commit of its own.
    pub async fn keep_answer(
        &self,
        job: impl FnMut(&crate::store::Tx) -> crate::store::StoreResult<()> + Send + 'static,
    ) -> crate::store::StoreResult<()> {
        self.store.write(job).await
    }

    /// Closes the store cleanly at shutdown (`Store::close`).
    pub fn close_store(&self) -> crate::store::StoreResult<()> {
        self.store.close()
    }

    pub fn stop_signal(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    pub fn eval_slots_in_use(&self) -> usize {
        self.settings.eval_slots - self.eval_slots.available_permits()
    }

    pub fn running_builds(&self) -> usize {
        self.sched.held().running.len()
    }

    /// After `--shutdown-grace`: every running build's deployer is stopped
    /// (SIGTERM, `--cancel-grace`, SIGKILL) and recorded `failed` with
    /// `interrupted_by_shutdown`.
    /// With a store in PostgreSQL: until when this replica surely leads.
    pub fn lease(&self) -> Option<Arc<crate::store::upstream::Freshness>> {
        self.store.lease()
    }

    pub fn stop_running_builds(&self) {
        for halt in self.cancels.held().values() {
            let _ = halt.send(outcome::Halt::Shutdown);
        }
    }

    /// Wakes the queue: something was queued or a slot came free.
    pub fn wake_queue(&self) {
        self.wake.notify_one();
        self.queue_changed.notify_waiters();
    }

    /// A future that completes at the next `wake_queue` (a worker's poll
    /// waits on it; enable it before reading the queue so no wake falls
    /// between the read and the wait).
    pub fn queue_changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.queue_changed.notified()
    }
}
