//! `berth serve`: open the data dir and the store, recover, then serve HTTP
//! and run the queue until SIGTERM/SIGINT.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::api::{self, Ctx};
use crate::engine::Engine;
use crate::settings::Settings;
use crate::store::location::Location;
use crate::store::Store;

/// Random bytes in a generated secret (256 bits).
const SECRET_BYTES: usize = 32;

/// Everything the engine runs by itself, once it is ready.
fn run_in_the_background(engine: &Arc<crate::engine::Engine>) {
    tokio::spawn(engine.clone().run_queue());
    tokio::spawn(engine.clone().run_callbacks());
    tokio::spawn(engine.clone().run_webhooks());
    tokio::spawn(engine.clone().run_sweeps());
    tokio::spawn(engine.clone().run_leases());
    tokio::spawn(engine.clone().run_node_sweep());
    tokio::spawn(engine.clone().sweep_staging());
    tokio::spawn(engine.clone().run_denial_flush());
    tokio::spawn(engine.clone().run_updates());
    if let Some(lease) = engine.lease() {
        tokio::spawn(crate::cluster::self_fence(engine.clone(), lease));
    }
}

/// The server log on stderr: `BERTH_LOG` filters it; `BERTH_LOG_FORMAT`
/// is `text` (the default; colours only when stderr is a terminal, so
/// journald and files get plain text) or `json` (one object per line, for
/// log shippers).
pub fn init_tracing() -> Result<(), String> {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("BERTH_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,warp=warn,hyper=warn,hyper_util=warn")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let format = std::env::var("BERTH_LOG_FORMAT").unwrap_or_default();
    // A second init (tests running serve twice) is not an error.
    let _ = match format.as_str() {
        "" | "text" => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        "json" => builder.json().try_init(),
        _ => return Err("BERTH_LOG_FORMAT must be text or json".into()),
    };
    Ok(())
}

/// The refusal to start on a store redb cannot recover (README
/// "Repairing a damaged store"): what is wrong, that nothing was changed,
/// and the way back.
fn damaged_store(path: &Path, data_dir: &Path, e: &crate::store::StoreError) -> String {
    format!(
        "cannot open {}: the store is damaged ({}); berth does not start on it and has \
         changed nothing. To repair: move {} aside, then restore the last export into a new \
         store with `berth import --data-dir {} --from <export>` and start again",
        path.display(),
        e.detail,
        path.display(),
        data_dir.display()
    )
}

/// Reads a secret file, or creates it (0600) with fresh random bytes as hex.
fn load_or_create_secret(path: &Path) -> Result<String, String> {
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_string()),
        Ok(_) => return Err(format!("{} is empty", path.display())),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(format!("cannot read {}: {e}", path.display()))
        }
        Err(_) => {}
    }
    let mut bytes = [0u8; SECRET_BYTES];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness for a new secret: {e}"))?;
    let secret = crate::hex::encode(&bytes);
    // Whole or not at all: a power cut mid-way leaves no file, and the next
    // start makes one (never an empty one it then refuses).
    crate::durable::create(path, secret.as_bytes(), 0o600)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    tracing::info!(path = %path.display(), "generated a new secret file");
    Ok(secret)
}

fn read_secret_file(path: &Path) -> Result<String, String> {
    let s = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let s = s.trim().to_string();
    if s.is_empty() {
        return Err(format!("{} is empty", path.display()));
    }
    Ok(s)
}

pub fn run(settings: Settings) -> i32 {
    if let Err(e) = init_tracing() {
        eprintln!("berth: {e}");
        return 2;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("berth: cannot start the async runtime: {e}");
            return 1;
        }
    };
    match runtime.block_on(serve(settings)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("berth: {e}");
            1
        }
    }
}

async fn serve(mut settings: Settings) -> Result<(), String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    check_flags(&settings)?;
    raise_file_limit(settings.max_connections);
    prepare_data_dir(&mut settings)?;
    let Secrets {
        service_token,
        cursor_key,
        callback_secret,
    } = load_secrets(&settings)?;
    prepare_deployers_root(&settings)?;
    let (store, start, mut lost, listener, cluster) = match settings.store_location()? {
        Location::Redb(_) => {
            let store = open_redb(&settings).await?;
            if settings.reset_dev_state {
                reset_dev_state(&settings, &store).await?;
            }
            let start = crate::engine::recovery::Start::Restart;
            (store, start, None, bind(&settings)?, None)
        }
        Location::Postgres(target) => start_replica(&settings, target).await?,
    };
    // Before the recovery that makes berth ready. A standby (above) still
    // stops at once on SIGTERM: it holds nothing to hand over.
    let mut signals = StopSignals::install();
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let settings = Arc::new(settings);
    let engine = Engine::new(settings.clone(), store, callback_secret)
        .map_err(|e| format!("deployer: {e}"))?;
    let ctx = Arc::new(Ctx {
        engine: engine.clone(),
        service_token,
        cursor_key,
        idempotency: Default::default(),
        tickets: Default::default(),
        streams: Default::default(),
        polls: Default::default(),
        agent_streams: Default::default(),
        downloads: Arc::new(tokio::sync::Semaphore::new(
            crate::engine::activations::MAX_DOWNLOADS,
        )),
        derivations: Default::default(),
        body_budget: api::BodyBudget::new(engine.settings.max_body_bytes_in_flight),
        authz: api::auth::Authz::new(engine.settings.authz_url.clone()),
        cluster,
    });

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(accept_loop(listener, ctx.clone(), stop_rx.clone()));
    tracing::info!(address = %local, "berth listening on http://{local}");

    engine
        .recover(start)
        .await
        .map_err(|e| format!("recovery failed: {e}"))?;
    engine.ready.store(true, Ordering::SeqCst);
    run_in_the_background(&engine);
    tokio::spawn(sweep_decisions(ctx.clone()));

    match stop_or_lost_lead(&mut signals, lost.as_mut()).await {
        None => {
            shut_down(&engine, server, stop_tx, &settings, settings.shutdown_grace).await;
            Ok(())
        }
        // Its writes cannot land any more: what runs is stopped at once.
        Some(why) => {
            shut_down(&engine, server, stop_tx, &settings, Duration::ZERO).await;
            Err(format!(
                "this replica stopped leading the cluster: {why} (lease_lost)"
            ))
        }
    }
}

/// Forgets expired authorization decisions and stream tickets, every
/// decision's lifetime.
async fn sweep_decisions(ctx: Arc<Ctx>) {
    let mut every = tokio::time::interval(api::auth::DECISION_TTL);
    loop {
        every.tick().await;
        ctx.authz.sweep();
        ctx.tickets.sweep();
    }
}

/// Waits for SIGTERM/SIGINT (`None`) or, on PostgreSQL, for the lease to
/// be taken by another replica (`Some(why)`).
async fn stop_or_lost_lead(
    signals: &mut StopSignals,
    lost: Option<&mut tokio::sync::watch::Receiver<Option<String>>>,
) -> Option<String> {
    let Some(lost) = lost else {
        signals.wait().await;
        return None;
    };
    tokio::select! {
        () = signals.wait() => None,
        why = lost.wait_for(Option::is_some) => Some(match why {
            Ok(why) => why.clone().unwrap_or_default(),
            Err(_) => "the lease keeper stopped".to_string(),
        }),
    }
}

/// Listens on `--listen` and writes `--address-file`.
fn bind(settings: &Settings) -> Result<tokio::net::TcpListener, String> {
    let listener = listen(settings.listen).map_err(|e| {
        format!(
            "cannot listen on {}: {e} (choose another with --listen)",
            settings.listen
        )
    })?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    if let Some(file) = &settings.address_file {
        write_address_file(file, local)?;
    }
    Ok(listener)
}

/// What a start on PostgreSQL gives the rest of `serve`.
type Replica = (
    Store,
    crate::engine::recovery::Start,
    Option<tokio::sync::watch::Receiver<Option<String>>>,
    tokio::net::TcpListener,
    Option<Arc<crate::store::upstream::Status>>,
);

/// A replica's start (docs/cluster.md): it listens at once, and while it
/// waits for the lease it forwards each connection to the replica that
/// leads; once it leads, the listener serves here.
async fn start_replica(
    settings: &Settings,
    target: crate::store::location::PgTarget,
) -> Result<Replica, String> {
    use crate::cluster;
    cluster::refuse_redb_flags(settings)?;
    let listener = bind(settings)?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let me = cluster::me(settings, bound)?;
    let status = Arc::new(crate::store::upstream::Status::new(
        &me.id,
        target.redacted(),
    ));
    let (leader_tx, leader_rx) = tokio::sync::watch::channel(None);
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let max_connections = settings.max_connections as usize;
    let forwarder = tokio::spawn(cluster::forward_while_standby(
        listener,
        leader_rx,
        done_rx,
        max_connections,
    ));
    let (flags, shown) = (settings.clone(), status.clone());
    // One blocking database connection, and a wait for the lease.
    let started = tokio::task::spawn_blocking(move || {
        cluster::start(&flags, &target, &me, &leader_tx, shown)
    })
    .await
    .map_err(|e| format!("cannot start on the store's database: {e}"));
    if done_tx.send(()).is_err() {
        tracing::debug!("the standby's forwarder ended before its hand-over");
    }
    let listener = forwarder
        .await
        .map_err(|e| format!("the standby's listener failed: {e}"))?;
    let started = started??;
    // The data dir's lock lives as long as the process.
    std::mem::forget(started.data_dir_lock);
    Ok((
        started.store,
        started.start,
        Some(started.lost),
        listener,
        Some(status),
    ))
}

/// The embedded store: an import first when `--import-from` asks, then
/// the file.
async fn open_redb(settings: &Settings) -> Result<Store, String> {
    if let Some(source) = &settings.import_from {
        let from =
            crate::export::Endpoint::parse(source).map_err(|e| format!("--import-from: {e}"))?;
        let data_dir = settings.data_dir.clone();
        // The import drives its own PostgreSQL client: off the async workers.
        tokio::task::spawn_blocking(move || crate::export::import_at_start(&data_dir, &from))
            .await
            .map_err(|e| format!("--import-from: {e}"))??;
    }
    open_store(settings)
}

/// Files berth holds besides its connections (the store, the redo log,
/// deployers' pipes and results, snapshots).
const FILES_BESIDES_CONNECTIONS: u64 = 512;

/// Raises the soft limit of open files to what `--max-connections` needs
/// (agents.md: each agent's stream holds a connection, so a fleet needs
/// more than the usual 1,024), up to the hard limit; a hard limit below
/// it is logged with the flag and the setting to change.
fn raise_file_limit(max_connections: u32) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let needed = u64::from(max_connections) + FILES_BESIDES_CONNECTIONS;
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        tracing::warn!("cannot read the limit of open files; it stays as it is");
        return;
    };
    if soft < needed {
        let raised = needed.min(hard);
        if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, raised, hard) {
            tracing::warn!(error = %e, "cannot raise the limit of open files");
        }
    }
    if hard < needed {
        tracing::warn!(
            max_connections,
            hard,
            "--max-connections needs {needed} open files and this process may open at most {hard}: connections past it are refused at accept; raise the hard limit (systemd LimitNOFILE, ulimit -Hn) or lower --max-connections"
        );
    }
}

/// Flags that are wrong together, refused before anything is touched.
fn check_flags(settings: &Settings) -> Result<(), String> {
    crate::api::cors::check_origins(&settings.cors_origin)?;
    let per_caller = settings.streams_per_caller();
    if per_caller > settings.max_sse_clients || per_caller >= settings.max_connections as usize {
        return Err(format!(
            "--max-streams-per-caller ({per_caller}) must be at most --max-sse-clients ({}) and below --max-connections ({}): one caller must never take every connection",
            settings.max_sse_clients, settings.max_connections
        ));
    }
    if settings.reset_dev_state && !settings.dev {
        return Err("--reset-dev-state deletes every stored deployment; it needs --dev too".into());
    }
    let revert = settings.agent_revert_after;
    if revert < settings.lease_ttl * 3 || revert > std::time::Duration::from_secs(24 * 3600) {
        return Err(format!(
            "--agent-revert-after ({}s) must be from 3 x --lease-ttl ({}s) to 24h: an agent must outlast a renew missed twice before it reverts",
            revert.as_secs(),
            settings.lease_ttl.as_secs() * 3
        ));
    }
    Ok(())
}

/// Makes the data dir (durably, private) and resolves it and
/// `--deployer-dir` to absolute paths.
fn prepare_data_dir(settings: &mut Settings) -> Result<(), String> {
    // Durably: a store synced into a data dir whose own name was not is
    // lost with it at a power cut.
    crate::durable::create_dir_all(&settings.data_dir, 0o700).map_err(|e| {
        format!(
            "cannot create the data dir {}: {e}",
            settings.data_dir.display()
        )
    })?;
    // Deployers run in their scratch dir: every path handed to them is absolute.
    settings.data_dir = std::fs::canonicalize(&settings.data_dir).map_err(|e| {
        format!(
            "cannot resolve the data dir {}: {e}",
            settings.data_dir.display()
        )
    })?;
    if let Some(dir) = &settings.deployer_dir {
        let absolute = std::path::absolute(dir)
            .map_err(|e| format!("cannot resolve --deployer-dir {}: {e}", dir.display()))?;
        settings.deployer_dir = Some(absolute);
    }
    // An older berth made the data dir 0711 and its files 0644.
    crate::durable::make_private(&settings.data_dir).map_err(|e| {
        format!(
            "cannot make the data dir {} and its files readable by berth only: {e}; check who owns them",
            settings.data_dir.display()
        )
    })?;
    Ok(())
}

/// The secrets a start needs, read or made (0600) in the data dir.
struct Secrets {
    service_token: String,
    cursor_key: Vec<u8>,
    callback_secret: Vec<u8>,
}

/// Reads (or makes) the service token, the cursor key, the callback
/// secret and the audit signing key.
fn load_secrets(settings: &Settings) -> Result<Secrets, String> {
    let service_token = match &settings.service_token_file {
        Some(p) => read_secret_file(p)?,
        None => {
            let path = settings.data_dir.join("service-token");
            let token = load_or_create_secret(&path)?;
            tracing::info!(path = %path.display(), "service token file (send it as Authorization: Bearer <token>)");
            token
        }
    };
    let cursor_key = load_or_create_secret(&settings.data_dir.join("cursor-key"))?.into_bytes();
    let callback_secret = match &settings.callback_secret_file {
        Some(p) => read_secret_file(p)?,
        None => load_or_create_secret(&settings.data_dir.join("callback-secret"))?,
    }
    .into_bytes();
    let audit_key = crate::audit_cli::ensure_signing_key(&settings.data_dir)?;
    tracing::info!(
        key = %crate::audit_cli::verifier_key(&crate::audit_cli::origin(settings.audit_origin.as_deref()), &audit_key),
        "audit checkpoint verifier key (berth audit public-key prints it)"
    );
    Ok(Secrets {
        service_token,
        cursor_key,
        callback_secret,
    })
}

/// Opens the store as the flags say, with an error a person can act on.
fn open_store(settings: &Settings) -> Result<Store, String> {
    let sharing = if settings.shared_store {
        crate::store::Sharing::LiveReaders
    } else {
        crate::store::Sharing::Exclusive {
            checkpoint_every: settings.checkpoint_interval,
        }
    };
    let opened = Store::open_with_cache(&settings.db_path(), sharing, settings.cache_size);
    let store = opened.map_err(|e| {
        use crate::store::StoreErrorKind as Kind;
        let path = settings.db_path();
        match e.kind {
            Kind::Damaged => damaged_store(&path, &settings.data_dir, &e),
            // At open berth writes a redo log's replay, each step of a
            // layout migration (one transaction each) and the new log's
            // preallocation: each lands whole or not at all.
            Kind::DiskFull => format!(
                "cannot open {}: the disk is full ({e}). Nothing is lost: each step of opening \
                 the store (a redo log's replay, each step of a layout migration) lands whole or \
                 not at all, and the next start goes on from there. Free some space (a migration \
                 of an older store needs about as much as the store file) and start berth again",
                path.display()
            ),
            Kind::Io
            | Kind::Reopening
            | Kind::Corrupt
            | Kind::Closed
            | Kind::Unreachable
            | Kind::Other => {
                format!("cannot open {}: {e}", path.display())
            }
        }
    })?;
    // redb syncs the file it creates, not the directory that names it.
    crate::durable::sync_dir(&settings.data_dir).map_err(|e| {
        format!(
            "cannot sync the data dir {}: {e}",
            settings.data_dir.display()
        )
    })?;
    Ok(store)
}

/// Stops taking work, waits `--shutdown-grace` for running builds, stops
/// and records what still runs, then closes the store (storage.md).
async fn shut_down(
    engine: &Arc<Engine>,
    server: tokio::task::JoinHandle<()>,
    stop_tx: tokio::sync::watch::Sender<bool>,
    settings: &Settings,
    grace: Duration,
) {
    tracing::info!("shutting down: no new requests or builds; waiting for running builds");
    engine.begin_shutdown();
    let _ = stop_tx.send(true);
    let deadline = tokio::time::Instant::now() + grace;
    while engine.running_builds() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if engine.running_builds() > 0 {
        // storage.md: what still runs is ended on purpose and recorded,
        // rather than left to die at its next write to a closed pipe.
        tracing::warn!(
            running = engine.running_builds(),
            "shutdown grace is over: stopping the running deployers"
        );
        engine.stop_running_builds();
        let deadline = tokio::time::Instant::now() + settings.cancel_grace + SHUTDOWN_FINAL_COMMIT;
        while engine.running_builds() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if engine.running_builds() > 0 {
            tracing::error!(
                running = engine.running_builds(),
                "exiting with builds whose final status is not stored; the next start recovers them"
            );
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
    if let Err(e) = engine.close_store() {
        tracing::warn!(error = %e, "the store was not closed cleanly; the next start repairs it");
    }
}

/// Time for the final commits of builds stopped at shutdown, past
/// `--cancel-grace`.
const SHUTDOWN_FINAL_COMMIT: Duration = Duration::from_secs(10);

/// Bytes hyper buffers per connection at most (headers and body read-ahead):
/// the 16 KiB of headers api.md allows, and a little of the body.
const CONNECTION_READ_BUFFER: usize = 24 * 1024;

/// Pause after a failed accept (out of file descriptors, say), so a
/// persistent failure does not spin.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Serves HTTP/1.1 on every accepted connection until `stop`, then lets
/// open requests finish (event streams end at shutdown by themselves).
/// berth runs hyper itself rather than `warp::serve` so that each request
/// carries its connection (`wire`), which a live event stream hands to the
/// fan-out thread.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    ctx: Arc<api::Ctx>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let connections = Arc::new(tokio::sync::Semaphore::new(
        ctx.engine.settings.max_connections as usize,
    ));
    let service = hyper_util::service::TowerToHyperService::new(warp::service(api::filter(ctx)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            },
            () = async { let _ = stop.wait_for(|s| *s).await; } => break,
        };
        // Past --max-connections a connection is closed at once: open ones
        // (and their buffers) stay bounded whatever clients do.
        let Ok(slot) = connections.clone().try_acquire_owned() else {
            tracing::debug!("--max-connections reached: closing a new connection");
            drop(stream);
            continue;
        };
        let conn = crate::wire::Conn::new(stream);
        let wire = conn.handle();
        let service = service.clone();
        let per_request =
            hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                // Chunked encoding, which the fan-out writes, is HTTP/1.1's.
                if req.version() == hyper::Version::HTTP_11 {
                    req.extensions_mut().insert(api::WireHandle(wire.clone()));
                }
                hyper::service::Service::call(&service, req)
            });
        // The timer makes hyper's header read timeout (30 s) real: a client
        // that sends its request head slowly cannot hold a connection.
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            // hyper reads ahead up to this much per connection; its default
            // (~400 KB) let 1,000 stalled uploads hold 600 MB before berth
            // saw a byte. Room for the 16 KiB of headers berth accepts.
            .max_buf_size(CONNECTION_READ_BUFFER)
            .serve_connection(hyper_util::rt::TokioIo::new(conn), per_request);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Backlog of the HTTP listening socket.
const LISTEN_BACKLOG: u32 = 1024;

/// The listening socket, with TCP_NODELAY (Linux passes it on to accepted
/// connections): an event stream writes small frames, and Nagle's algorithm
/// with the client's delayed ACK would hold some of them back for ~40 ms.
/// `--address-file`: the bound address, written whole (a temporary file
/// renamed over it), so a reader never sees half of it.
fn write_address_file(file: &Path, address: std::net::SocketAddr) -> Result<(), String> {
    let fail = |e: std::io::Error| format!("cannot write --address-file {}: {e}", file.display());
    let mut partial = file.as_os_str().to_owned();
    partial.push(".partial");
    let partial = std::path::PathBuf::from(partial);
    std::fs::write(&partial, format!("{address}\n")).map_err(fail)?;
    std::fs::rename(&partial, file).map_err(fail)
}

fn listen(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.set_nodelay(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// SIGTERM and SIGINT, caught from before berth says it is ready (a
/// stop sent as soon as `/readyz` answers 200 still shuts down cleanly);
/// `None` when the handlers cannot be installed.
struct StopSignals(Option<(Signal, Signal)>);

impl StopSignals {
    fn install() -> StopSignals {
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => StopSignals(Some((term, int))),
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!(error = %e, "cannot install signal handlers; stop berth with SIGKILL");
                StopSignals(None)
            }
        }
    }

    /// Until SIGTERM or SIGINT.
    async fn wait(&mut self) {
        let Some((term, int)) = &mut self.0 else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
}

/// Makes the deployers' root (`--deployer-dir`) with its `work/` and
/// `scratch/`. With `--deployer-user` they are 0711 (the deployer
/// traverses them to the dirs berth gives it, and lists nothing), and the
/// root must lie outside the data dir, which stays 0700; work dirs an
/// older berth kept in the data dir move there once.
fn prepare_deployers_root(settings: &Settings) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    if settings.deployer_user.is_none() {
        return Ok(());
    }
    let root = settings.deployers_root();
    if root.starts_with(&settings.data_dir) {
        return Err(format!(
            "--deployer-dir {} is inside the data dir {}: a deployer run as --deployer-user must not reach the data dir; choose a directory outside it",
            root.display(),
            settings.data_dir.display()
        ));
    }
    crate::durable::create_dir_all(&root, 0o711)
        .map_err(|e| format!("cannot create {}: {e}", root.display()))?;
    let old_work = settings.data_dir.join("work");
    let work = settings.work_root();
    if old_work.is_dir() && !work.exists() {
        std::fs::rename(&old_work, &work).map_err(|e| {
            format!(
                "cannot move the deployers' work dirs from {} to {}: {e}; move them by hand",
                old_work.display(),
                work.display()
            )
        })?;
        tracing::info!(from = %old_work.display(), to = %work.display(), "moved the deployers' work dirs out of the data dir");
    }
    for dir in [root.clone(), work, settings.scratch_root()] {
        crate::durable::create_dir_all(&dir, 0o711)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| format!("cannot set the mode of {}: {e}", dir.display()))?;
    }
    Ok(())
}

async fn reset_dev_state(settings: &Settings, store: &Store) -> Result<(), String> {
    let rx = store.read().map_err(|e| e.to_string())?;
    let deployments = rx.deployment_count().map_err(|e| e.to_string())?;
    eprintln!(
        "berth: --reset-dev-state: deleting {deployments} deployment(s) with their builds and logs from {}, and {}",
        settings.db_path().display(),
        settings.work_root().display()
    );
    store
        .write(|tx| tx.clear_all())
        .await
        .map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(settings.work_root());
    Ok(())
}
