//! Every flag of `berth`, its environment variable, its default and its limit.
//!
//! One place to read what can be tuned. Each flag is also read from a
//! `BERTH_*` environment variable; `berth serve --help` prints them all.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::model::Source;

#[derive(Debug, Parser)]
#[command(
    name = "berth",
    version,
    about = "A single-binary deployment control plane for self-hosters"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP server, the build queue and the deployers.
    Serve(Box<Settings>),
    /// Check and publish the audit chain (spec audit.md); works while the
    /// server runs, reading the store only.
    Audit {
        #[command(subcommand)]
        audit: AuditCommand,
    },
    /// Copy the whole store into PostgreSQL or a SQLite file (one
    /// consistent snapshot, one target transaction); works while the server
    /// runs. Secrets are not exported: copy the key files to keep them.
    Export {
        #[arg(long, env = "BERTH_DATA_DIR", default_value = "./berth-data")]
        data_dir: PathBuf,
        #[command(flatten)]
        store: StoreFlags,
        /// sqlite:PATH or postgres://user@host:port/database
        #[arg(long)]
        to: String,
        /// Overwrite an earlier berth export in the target.
        #[arg(long)]
        replace: bool,
    },
    /// Load the whole store from an export; the server must be stopped.
    /// Refuses a store holding state unless --replace.
    Import {
        #[arg(long, env = "BERTH_DATA_DIR", default_value = "./berth-data")]
        data_dir: PathBuf,
        #[command(flatten)]
        store: StoreFlags,
        /// sqlite:PATH or postgres://user@host:port/database
        #[arg(long)]
        from: String,
        /// Replace a store that holds state.
        #[arg(long)]
        replace: bool,
    },
    /// Run builds for a berth on this machine (workers.md): poll its queue,
    /// claim builds, run the deployer here, report back.
    Worker(Box<WorkerArgs>),
    /// Run the pull agent of one node (agents.md): watch its desired
    /// state, report what it runs.
    Agent(Box<AgentArgs>),
    /// Worker tokens: create (prints only the token), list, revoke.
    Tokens {
        #[command(subcommand)]
        tokens: TokensCommand,
    },
    /// A deployment's rollout in waves: status, pause, resume, abort
    /// (rollouts.md).
    Rollout {
        #[command(subcommand)]
        rollout: RolloutCommand,
    },
    /// Freezes (rollouts.md "Freeze"): set, lift, status.
    Freeze {
        #[command(subcommand)]
        freeze: FreezeCommand,
    },
    /// The workers: name, kind, labels, incarnation, running attempts, last seen.
    Workers {
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// Nodes bound to agents: desired against actual, drift, last seen
    /// (agents.md).
    Nodes {
        /// One deployment's nodes (else every deployment's bound nodes).
        deployment: Option<String>,
        /// Only nodes that drifted.
        #[arg(long)]
        drifted: bool,
        /// Only nodes whose agent is unreachable.
        #[arg(long)]
        unreachable: bool,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// Run a built-in deployer (berth calls this itself; see spec deployer.md).
    Deployer {
        #[command(subcommand)]
        deployer: DeployerCommand,
    },
    /// Submit a configuration (from --config FILE, or stdin with `-`).
    Deploy {
        id: String,
        /// The configuration: a JSON file, or `-` for stdin.
        #[arg(long, default_value = "-")]
        config: String,
        /// Queue behind a running build instead of replacing a queued one.
        #[arg(long)]
        enqueue: bool,
        /// Keep the deployed source's revision (lifecycle.md).
        #[arg(long)]
        keep_deployed_revision: bool,
        /// Follow the build's log to its end; the exit status is its outcome.
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// What a submit would change: the nodes, their names, the changes.
    Preview {
        id: String,
        #[arg(long, default_value = "-")]
        config: String,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// The deployments; with one id, that deployment, its actions and builds.
    Status {
        ids: Vec<String>,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// A deployment's builds, newest first.
    Builds {
        id: String,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// A build's log; --follow streams it to the build's end.
    Logs {
        build: String,
        #[arg(long, short)]
        follow: bool,
        /// Print log lines as they are on a terminal too (by default their
        /// control characters are shown as escapes there; piped output is
        /// always as it is).
        #[arg(long)]
        raw: bool,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// Cancel a build.
    Cancel {
        build: String,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// Roll back to an earlier succeeded build (the newest one by default).
    Rollback {
        id: String,
        #[arg(long)]
        to: Option<String>,
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// Suspend a deployment (a deploy with the suspended flag).
    Suspend {
        id: String,
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// Resume a suspended deployment.
    Resume {
        id: String,
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// A shell completion script on stdout: `berth completions bash >
    /// /etc/bash_completion.d/berth` (also zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// The manual page (roff) on stdout: `berth man | man -l -`.
    Man,
    /// Queue the destroy of a deployment.
    Delete {
        id: String,
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        conn: ClientArgs,
    },
}

/// How the command-line client reaches berth (spec cli.md "Connection").
/// The token is read from a file or the environment, never an argument,
/// so it is never in `ps`.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// berth's address.
    #[arg(long, env = "BERTH_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// A file holding the token (default ./berth-data/service-token, or
    /// BERTH_TOKEN holding the token itself).
    #[arg(long, env = "BERTH_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Sent as X-Actor-Subject with the service token.
    #[arg(long)]
    pub actor_subject: Option<String>,
    /// Sent as X-Actor-Issuer with the service token.
    #[arg(long)]
    pub actor_issuer: Option<String>,
    /// The API's JSON instead of a table (for `logs --follow`, one JSON
    /// object per event).
    #[arg(long)]
    pub json: bool,
}

impl Command {
    /// Whether the command writes under a data dir, so creates its files
    /// private (`durable::create_files_private`). Deployers and the
    /// client write what their users expect with the usual mask.
    pub fn writes_a_data_dir(&self) -> bool {
        match self {
            Command::Serve(_)
            | Command::Audit { .. }
            | Command::Export { .. }
            | Command::Import { .. } => true,
            Command::Deployer { .. }
            | Command::Worker(_)
            | Command::Agent(_)
            | Command::Tokens { .. }
            | Command::Rollout { .. }
            | Command::Freeze { .. }
            | Command::Workers { .. }
            | Command::Nodes { .. }
            | Command::Deploy { .. }
            | Command::Preview { .. }
            | Command::Status { .. }
            | Command::Builds { .. }
            | Command::Logs { .. }
            | Command::Cancel { .. }
            | Command::Rollback { .. }
            | Command::Suspend { .. }
            | Command::Resume { .. }
            | Command::Completions { .. }
            | Command::Man
            | Command::Delete { .. } => false,
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum FreezeCommand {
    /// Set or replace a freeze: of one deployment, or with --global of
    /// every one (neither is a usage error, so nobody freezes everything by
    /// accident).
    Set {
        id: Option<String>,
        #[arg(long)]
        global: bool,
        /// Why, in words others will read (1-500 characters).
        #[arg(long)]
        reason: String,
        /// When it ends by itself (RFC 3339).
        #[arg(long)]
        until: Option<String>,
        /// A window (JSON: frequency, day, start, duration_minutes, time_zone).
        #[arg(long)]
        window: Option<String>,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// Lift a freeze.
    Lift {
        id: Option<String>,
        #[arg(long)]
        global: bool,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// The global freeze; with an id, that deployment's own and the one
    /// holding it now.
    Status {
        id: Option<String>,
        #[command(flatten)]
        conn: ClientArgs,
    },
}

#[derive(Debug, Subcommand)]
pub enum RolloutCommand {
    /// State, wave k/n, nodes activated and unhealthy, pause or wait, and
    /// the deployment's revision (for --revision).
    Status {
        id: String,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// Pause after the current wave's gate (at once while waiting).
    Pause {
        id: String,
        #[arg(long)]
        reason: Option<String>,
        /// Act only if the deployment is still at this revision.
        #[arg(long)]
        revision: Option<u64>,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// Resume: the gate again, then the next wave.
    Resume {
        id: String,
        #[arg(long)]
        revision: Option<u64>,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// Put the activated waves back, last first; the build fails.
    Abort {
        id: String,
        #[arg(long)]
        reason: Option<String>,
        #[arg(long)]
        revision: Option<u64>,
        /// Wait for the build's end; the exit status is its outcome.
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        conn: ClientArgs,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokensCommand {
    /// Make a token; only the token (`brt_...`) is printed, on stdout.
    Create {
        name: String,
        /// `worker`, or `agent` (with --deployment and --node).
        #[arg(long, default_value = "worker")]
        kind: String,
        /// Labels a worker holding it may offer (comma-separated; none: any).
        #[arg(long, default_value = "")]
        labels: String,
        /// An agent token's deployment.
        #[arg(long)]
        deployment: Option<String>,
        /// An agent token's node.
        #[arg(long)]
        node: Option<String>,
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// The tokens (never their secrets).
    List {
        #[command(flatten)]
        conn: ClientArgs,
    },
    /// Revoke a token at once: its worker's attempts are lost.
    Revoke {
        name: String,
        #[command(flatten)]
        conn: ClientArgs,
    },
}

/// Flags of `berth worker` (workers.md "`berth worker`").
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// berth's address (https unless on loopback or --allow-http).
    #[arg(long, env = "BERTH_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// A file holding the worker token (never on a command line).
    #[arg(long, env = "BERTH_TOKEN_FILE")]
    pub token_file: PathBuf,
    /// Labels this worker offers (comma-separated).
    #[arg(long, env = "BERTH_WORKER_LABELS", default_value = "", value_parser = parse_label_set)]
    pub labels: LabelSet,
    /// Attempts at once.
    #[arg(long, env = "BERTH_WORKER_SLOTS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=64))]
    pub slots: u8,
    /// Its directory (0700, locked): work/, scratch/, jobs/, lost/.
    #[arg(long, env = "BERTH_WORKER_DIR", default_value = "./berth-worker")]
    pub work_dir: PathBuf,
    /// The deployer it runs (as `berth serve --deployer`).
    #[arg(long, env = "BERTH_DEPLOYER")]
    pub deployer: Option<PathBuf>,
    /// Run deployers as this user (the worker must run as root).
    #[arg(long, env = "BERTH_DEPLOYER_USER")]
    pub deployer_user: Option<String>,
    /// On SIGTERM/SIGINT, how long running builds may go on before they
    /// are stopped.
    #[arg(long, env = "BERTH_SHUTDOWN_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// Allow http:// to a berth that is not on loopback.
    #[arg(long)]
    pub allow_http: bool,
    /// PEM certificates trusted besides the system's roots for berth's
    /// https (a private CA).
    #[arg(long, env = "BERTH_WORKER_CA_FILE")]
    pub ca_file: Option<PathBuf>,
}

/// `berth agent` (agents.md "Running an agent").
#[derive(Debug, Clone, Args)]
pub struct AgentArgs {
    /// berth's address (https unless on loopback or --allow-http).
    #[arg(long, env = "BERTH_URL")]
    pub url: String,
    /// A file holding the agent token (never on a command line); refused
    /// when group or others may read it.
    #[arg(long, env = "BERTH_TOKEN_FILE")]
    pub token_file: PathBuf,
    /// The node: `DEPLOYMENT/NODE`, the token's binding.
    #[arg(long, env = "BERTH_AGENT_NODE")]
    pub node: String,
    /// Its memory (0700): state.json, artifacts/, current, booted.
    #[arg(
        long,
        env = "BERTH_AGENT_STATE_DIR",
        default_value = "/var/lib/berth-agent"
    )]
    pub state_dir: PathBuf,
    /// How often it reports what the node runs (1s to 1h).
    #[arg(long, env = "BERTH_AGENT_REPORT_INTERVAL", default_value = "60s", value_parser = parse_report_interval)]
    pub report_interval: Duration,
    /// Health: `/bin/sh -c CMD`, exit 0 healthy, else unhealthy with its
    /// last line.
    #[arg(long, env = "BERTH_AGENT_CHECK_COMMAND")]
    pub check_command: Option<String>,
    /// Run after each switch of a file artifact, with `BERTH_ARTIFACT` (the
    /// node's file) and `BERTH_PHASE` (`test`, `boot`, `revert`); for a
    /// store path, run instead of its `switch-to-configuration`, with
    /// `BERTH_ARTIFACT` the toplevel.
    #[arg(long, env = "BERTH_AGENT_ACTIVATE_COMMAND")]
    pub activate_command: Option<String>,
    /// Nix binary caches a store path is fetched from, tried in order
    /// (Nix checks signatures against the node's trusted-public-keys).
    #[arg(
        long = "substituter",
        env = "BERTH_AGENT_SUBSTITUTERS",
        value_delimiter = ','
    )]
    pub substituters: Vec<String>,
    /// What the node runs: the link to its running toplevel.
    #[arg(
        long,
        env = "BERTH_AGENT_CURRENT_SYSTEM",
        default_value = "/run/current-system"
    )]
    pub current_system: PathBuf,
    /// What the node boots: its system profile.
    #[arg(
        long,
        env = "BERTH_AGENT_SYSTEM_PROFILE",
        default_value = "/nix/var/nix/profiles/system"
    )]
    pub system_profile: PathBuf,
    /// How the desired state is watched: `sse`, `poll` (a long poll), or
    /// `auto` (SSE; the long poll when a stream stays silent 45 s).
    #[arg(long, env = "BERTH_AGENT_TRANSPORT", default_value = "auto", value_parser = ["auto", "sse", "poll"])]
    pub transport: String,
    /// Allow http:// to a berth that is not on loopback.
    #[arg(long)]
    pub allow_http: bool,
    /// PEM certificates trusted besides the system's roots for berth's
    /// https (a private CA).
    #[arg(long, env = "BERTH_AGENT_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// Confirmed artifacts kept besides the running and booted ones
    /// (files in artifacts/, GC roots in gcroots/), 0 to 100.
    #[arg(long, env = "BERTH_AGENT_KEEP", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(0..=i64::from(crate::nodes::MAX_KEEP)))]
    pub keep: u32,
    /// The agent's own systemd unit (the NixOS module names it): after a
    /// confirm of a toplevel that changed it, the agent exits 0 once its
    /// outcome is posted, so systemd starts the new one.
    #[arg(long, env = "BERTH_AGENT_UNIT")]
    pub unit: Option<String>,
}

fn parse_report_interval(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    let ms = d.as_millis();
    let (min, max) = (
        u128::from(crate::nodes::REPORT_INTERVAL_MIN_MS),
        u128::from(crate::nodes::REPORT_INTERVAL_MAX_MS),
    );
    if (min..=max).contains(&ms) {
        Ok(d)
    } else {
        Err("must be from 1s to 1h".into())
    }
}

#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Walk the chain from its anchor and report every problem; exits
    /// non-zero on any. Needs no token and reads no secret.
    Verify {
        #[arg(long, env = "BERTH_DATA_DIR", default_value = "./berth-data")]
        data_dir: PathBuf,
        #[command(flatten)]
        store: StoreFlags,
        /// Print one JSON object (also when the chain is broken).
        #[arg(long)]
        json: bool,
    },
    /// Verify, then POST a signed checkpoint and the verify report to a
    /// witness sink; exits non-zero on a problem or a refusal. With
    /// `--store postgres://...` the chain is the database's; the signing
    /// key and the pushed head are the data dir's (a replica's).
    PushHead {
        #[arg(long, env = "BERTH_DATA_DIR", default_value = "./berth-data")]
        data_dir: PathBuf,
        #[command(flatten)]
        store: StoreFlags,
        /// The sink's URL.
        #[arg(long, env = "BERTH_AUDIT_SINK")]
        sink: String,
        #[arg(long, env = "BERTH_AUDIT_ORIGIN")]
        audit_origin: Option<String>,
    },
    /// Print the checkpoint verifier key (C2SP note form), one line.
    PublicKey {
        #[arg(long, env = "BERTH_DATA_DIR", default_value = "./berth-data")]
        data_dir: PathBuf,
        #[arg(long, env = "BERTH_AUDIT_ORIGIN")]
        audit_origin: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum DeployerCommand {
    /// The embedded `local` deployer: `berth deployer local <verb>`.
    Local {
        /// describe, eval, deploy or destroy
        verb: String,
    },
    /// The Nix deployer: `berth deployer nix <verb>` (`--deployer
    /// builtin:nix`); reads the source's Nix code, builds with Nix.
    Nix {
        /// describe, eval, deploy or destroy
        verb: String,
    },
}

/// `--store` / `--store-file` of the commands that read a store in
/// PostgreSQL from one snapshot (`audit verify`, `export`) or fill one
/// (`import`).
#[derive(Debug, Clone, Args)]
pub struct StoreFlags {
    /// Read the store in PostgreSQL at this URL (no password: use
    /// --store-file or PGPASSFILE) instead of the data dir's.
    #[arg(long = "store", env = "BERTH_STORE", conflicts_with = "store_file")]
    pub store: Option<String>,
    /// A file whose first line is the --store URL (0600).
    #[arg(long = "store-file", env = "BERTH_STORE_FILE")]
    pub store_file: Option<PathBuf>,
}

impl StoreFlags {
    /// The database named, or `None` for the data dir's redb store.
    pub fn postgres(&self) -> Result<Option<crate::store::location::PgTarget>, String> {
        use crate::store::location::{parse, Location};
        let (text, from_file) = match (&self.store, &self.store_file) {
            (Some(url), _) => (url.clone(), false),
            (None, Some(file)) => (read_store_file(file)?, true),
            (None, None) => return Ok(None),
        };
        match parse(&text, from_file).map_err(|r| format!("--store: {r}"))? {
            Location::Postgres(target) => Ok(Some(target)),
            Location::Redb(_) => Err("--store: give a postgres:// URL, or --data-dir for a store file (invalid_store_url)".into()),
        }
    }
}

/// Flags of `berth serve`.
#[derive(Debug, Clone, Args)]
pub struct Settings {
    /// Address to listen on.
    #[arg(long, env = "BERTH_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// Directory holding berth.redb, secrets, work/ and scratch/.
    #[arg(long, env = "BERTH_DATA_DIR", default_value = "./berth-data")]
    pub data_dir: PathBuf,

    /// Import an export (sqlite:PATH or postgres://...) into a new store at
    /// start, once: the store records the source (no password) and the
    /// time, and a later start with the flag still set imports nothing.
    #[arg(long, env = "BERTH_IMPORT_FROM")]
    pub import_from: Option<String>,

    /// File holding the service token; when absent berth generates
    /// <data-dir>/service-token (0600) on first start.
    #[arg(long, env = "BERTH_SERVICE_TOKEN_FILE")]
    pub service_token_file: Option<PathBuf>,

    /// Deployer executable (run as `<deployer> <verb>`), or a deployer
    /// built into this binary: `builtin:local` (the default) or
    /// `builtin:nix`.
    #[arg(long, env = "BERTH_DEPLOYER")]
    pub deployer: Option<PathBuf>,

    /// Run deployers as this user (berth must run as root): they then cannot
    /// read the store or the secret files in the data dir.
    #[arg(long, env = "BERTH_DEPLOYER_USER")]
    pub deployer_user: Option<String>,

    /// The directory of deployers' `work/` and `scratch/` dirs. Default:
    /// the data dir; with --deployer-user, `<data-dir>-deployers` beside
    /// it, since a deployer run as another user must not reach the data
    /// dir at all (it stays 0700), and must be outside it.
    #[arg(long, env = "BERTH_DEPLOYER_DIR")]
    pub deployer_dir: Option<PathBuf>,

    /// The default source (a self-pin): url=...,rev=...,digest=sha256:<64 hex>.
    /// Without it berth uses a built-in source for the `local` deployer.
    #[arg(long, env = "BERTH_DEFAULT_SOURCE", value_parser = parse_source)]
    pub default_source: Option<Source>,

    /// Origins (scheme://host[:port]) an explicit source url may have;
    /// comma-separated. Default: none.
    #[arg(long, env = "BERTH_SOURCE_ORIGIN", value_delimiter = ',')]
    pub source_origin: Vec<String>,

    /// Origins a delete callback may have; comma-separated. Default: none.
    /// Each is written `scheme://host[:port]` and kept as its canonical
    /// spelling (lower case, no default port): a callback must start with it.
    #[arg(long, env = "BERTH_CALLBACK_ORIGIN", value_delimiter = ',', value_parser = parse_origin)]
    pub callback_origin: Vec<String>,

    /// HMAC key for callback signatures; generated in the data dir when absent.
    #[arg(long, env = "BERTH_CALLBACK_SECRET_FILE")]
    pub callback_secret_file: Option<PathBuf>,

    /// Open connections at most; a connection past it is closed at accept.
    #[arg(long, env = "BERTH_MAX_CONNECTIONS", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,

    /// Time a request body may take to arrive (a body that trickles in
    /// forever would hold memory and a connection).
    #[arg(long, env = "BERTH_BODY_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub body_timeout: Duration,

    /// Bytes of request bodies in memory at once, across all requests; past
    /// it a request gets 503 (it bounds what many slow uploads can hold).
    #[arg(long, env = "BERTH_MAX_BODY_BYTES_IN_FLIGHT", default_value_t = 64 * 1024 * 1024)]
    pub max_body_bytes_in_flight: usize,

    /// Largest request body in bytes.
    #[arg(long, env = "BERTH_MAX_BODY", default_value_t = 1024 * 1024)]
    pub max_body: usize,

    /// Concurrent `eval` calls.
    #[arg(long, env = "BERTH_EVAL_SLOTS", default_value_t = 2)]
    pub eval_slots: usize,

    /// Time limit of one `eval` or `describe` call (e.g. 60s, 2m).
    #[arg(long, env = "BERTH_EVAL_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub eval_timeout: Duration,

    /// Builds running at once across deployments.
    #[arg(long, env = "BERTH_BUILD_SLOTS", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub build_slots: u16,

    /// Time limit of one deploy or destroy; 0 turns it off.
    #[arg(long, env = "BERTH_BUILD_TIMEOUT", default_value = "24h", value_parser = parse_duration)]
    pub build_timeout: Duration,

    /// Time between SIGTERM and SIGKILL when a build is stopped.
    #[arg(long, env = "BERTH_CANCEL_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub cancel_grace: Duration,

    /// On SIGTERM/SIGINT, how long to wait for running builds before exiting.
    #[arg(long, env = "BERTH_SHUTDOWN_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    /// Stored log bytes per build; past it lines are counted, not stored.
    #[arg(long, env = "BERTH_MAX_LOG_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub max_log_bytes: u64,

    /// Builds kept per deployment: older ones beyond this many go (with their
    /// logs and events) once also older than --keep-build-days.
    #[arg(long, env = "BERTH_KEEP_BUILDS", default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..))]
    pub keep_builds: u32,

    /// Days a build is kept at least (see --keep-builds).
    #[arg(long, env = "BERTH_KEEP_BUILD_DAYS", default_value_t = 90)]
    pub keep_build_days: u32,

    /// The last succeeded deploy builds of a deployment that retention
    /// always keeps, as rollback targets (and the target of any queued
    /// rollback).
    #[arg(long, env = "BERTH_KEEP_ROLLBACK_TARGETS", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub keep_rollback_targets: u32,

    /// How often a deploy's health step calls the deployer's `check`, and
    /// the time limit of each check (lifecycle.md "Health checks"); the
    /// `confirm` after them has 300 s, since on NixOS it installs the boot
    /// entry.
    #[arg(long, env = "BERTH_HEALTH_INTERVAL", default_value = "5s", value_parser = parse_health_interval)]
    pub health_interval: Duration,

    /// How often a held rollout (paused, waiting, frozen) checks its
    /// activated nodes (5s to 10m; keep it under a third of a deployer's
    /// revert timeout): the answers keep armed reverts alive and the page
    /// current, and decide nothing.
    #[arg(long, env = "BERTH_ROLLOUT_WATCH_INTERVAL", default_value = "60s", value_parser = parse_watch_interval)]
    pub rollout_watch_interval: Duration,

    /// Origins (scheme://host[:port]) a webhook URL may have
    /// (comma-separated; none by default, so no subscription is possible
    /// until one is named).
    #[arg(long, env = "BERTH_WEBHOOK_ORIGIN", value_delimiter = ',', value_parser = parse_origin)]
    pub webhook_origin: Vec<String>,

    /// Webhook subscriptions at most.
    #[arg(long, env = "BERTH_MAX_WEBHOOKS", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub max_webhooks: u32,

    /// One webhook attempt's time limit (a 2xx within it is delivered).
    #[arg(long, env = "BERTH_WEBHOOK_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub webhook_timeout: Duration,

    /// Webhook deliveries in flight at once, across subscriptions (each
    /// subscription has at most one, so a dead receiver holds one).
    #[arg(long, env = "BERTH_WEBHOOK_CONCURRENCY", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub webhook_concurrency: u32,

    /// The waits before each retry of a webhook delivery; after the last,
    /// it is failed (Standard Webhooks' schedule by default).
    #[arg(long, env = "BERTH_WEBHOOK_RETRY_SCHEDULE", default_value = "5s,5m,30m,2h,5h,10h,10h", value_delimiter = ',', value_parser = parse_duration)]
    pub webhook_retry_schedule: Vec<Duration>,

    /// How long a deploy's changed nodes have to become healthy; 0 turns
    /// the checks off (a deployer with `confirm` is still confirmed at once,
    /// so a revert it armed does not fire).
    #[arg(long, env = "BERTH_HEALTH_TIMEOUT", default_value = "120s", value_parser = parse_duration)]
    pub health_timeout: Duration,

    /// Whether the embedded worker runs builds (workers.md "Which builds
    /// go where"); `off`: only `berth worker` processes run them.
    #[arg(long, env = "BERTH_LOCAL_WORKER", default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    pub local_worker: bool,

    /// Labels the embedded worker offers (comma-separated).
    #[arg(long, env = "BERTH_LOCAL_LABELS", default_value = "", value_parser = parse_label_set)]
    pub local_labels: LabelSet,

    /// Labels every build requires (comma-separated): a build runs only on
    /// a worker offering them all.
    #[arg(long, env = "BERTH_BUILD_LABELS", default_value = "", value_parser = parse_label_set)]
    pub build_labels: LabelSet,

    /// Where the store lives: redb:<path> (the default: berth.redb in the
    /// data dir) or postgres://user@host[:port]/database[?params] (cluster
    /// mode, docs/cluster.md). A URL with a password is refused: use
    /// --store-file or PGPASSFILE.
    #[arg(long, env = "BERTH_STORE", conflicts_with = "store_file")]
    pub store: Option<String>,

    /// A file whose first line is the --store URL: the one place for a
    /// password. Refused when group or others may read it.
    #[arg(long, env = "BERTH_STORE_FILE")]
    pub store_file: Option<PathBuf>,

    /// With PostgreSQL: this replica's name in GET /v1/cluster (default
    /// <hostname>:<port>).
    #[arg(long, env = "BERTH_REPLICA_NAME")]
    pub replica_name: Option<String>,

    /// With PostgreSQL: the URL the other replicas forward requests to
    /// while this one leads (default http://<--listen>; required when
    /// --listen is 0.0.0.0 or [::]).
    #[arg(long, env = "BERTH_REPLICA_URL")]
    pub replica_url: Option<String>,

    /// With PostgreSQL: how long connecting may take (1s to 60s), then
    /// 503 store_unreachable.
    #[arg(long, env = "BERTH_STORE_CONNECT_TIMEOUT", default_value = "5s", value_parser = parse_store_connect_timeout)]
    pub store_connect_timeout: Duration,

    /// With PostgreSQL: how long one statement may take (1s to 10m), then
    /// 503 store_unreachable and nothing stored.
    #[arg(long, env = "BERTH_STORE_TIMEOUT", default_value = "10s", value_parser = parse_store_timeout)]
    pub store_timeout: Duration,

    /// With PostgreSQL: how long a start waits for another replica's
    /// migration lock (1s to 1h), then exits.
    #[arg(long, env = "BERTH_STORE_MIGRATE_TIMEOUT", default_value = "10m", value_parser = parse_store_migrate_timeout)]
    pub store_migrate_timeout: Duration,

    /// How long a worker's claim or renew holds its build (5s to 10m).
    #[arg(long, env = "BERTH_LEASE_TTL", default_value = "30s", value_parser = parse_lease_ttl)]
    pub lease_ttl: Duration,

    /// Open worker polls at most, all workers together (each worker may
    /// hold 2).
    #[arg(long, env = "BERTH_MAX_WORKER_POLLS", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_worker_polls: u32,

    /// The largest work state (a deployment's work dir as a tar archive;
    /// 1 MiB to 4 GiB).
    #[arg(long, env = "BERTH_MAX_WORK_STATE", default_value_t = 64 << 20, value_parser = clap::value_parser!(u64).range((1 << 20)..=(4 << 30)))]
    pub max_work_state: u64,

    /// Work states kept per deployment, the current one included (1-100).
    #[arg(long, env = "BERTH_KEEP_WORK_STATES", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub keep_work_states: u32,

    /// Bytes a worker may stage per attempt (its SBOM files and work
    /// state, uploaded before its outcome).
    #[arg(long, env = "BERTH_MAX_ATTEMPT_UPLOAD", default_value_t = 2 << 30, value_parser = clap::value_parser!(u64).range((1 << 20)..))]
    pub max_attempt_upload: u64,

    /// Worker tokens at most.
    #[arg(long, env = "BERTH_MAX_WORKERS", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_workers: u32,

    /// Agent tokens at most (agents.md "Binding"): one node's agent each,
    /// two during a rotation.
    #[arg(long, env = "BERTH_MAX_AGENTS", default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(1..=200_000))]
    pub max_agents: u32,

    /// The largest file artifact a deploy result may name (deployer.md;
    /// 1 KiB to 4 GiB): berth reads it to take its digest.
    #[arg(long, env = "BERTH_MAX_ARTIFACT_BYTES", default_value_t = 64 << 20, value_parser = clap::value_parser!(u64).range(1024..=(4 << 30)))]
    pub max_artifact_bytes: u64,

    /// How long an agent keeps an unconfirmed activation without an
    /// accepted renew before it reverts by itself (agents.md "The armed
    /// revert"; 3 x `--lease-ttl` to 24 h, checked at start).
    #[arg(long, env = "BERTH_AGENT_REVERT_AFTER", default_value = "300s", value_parser = parse_duration)]
    pub agent_revert_after: Duration,

    /// How often the retention sweeps run (idempotency records, events, builds).
    #[arg(long, env = "BERTH_SWEEP_INTERVAL", default_value = "10m", value_parser = parse_duration)]
    pub sweep_interval: Duration,

    /// How often berth looks for due automatic updates (at most 5m, so no
    /// maintenance window is shorter than three looks).
    #[arg(long, env = "BERTH_UPDATE_INTERVAL", default_value = "60s", value_parser = parse_update_interval)]
    pub update_interval: Duration,

    /// Queued builds one deployment may have before a submit gets queue_full
    /// (a delete always queues).
    #[arg(long, env = "BERTH_MAX_QUEUED_BUILDS", default_value_t = 100)]
    pub max_queued_builds: u32,

    /// Share the store file with readers in other processes (redb's
    /// `SingleWriter`): `berth audit verify`, `audit push-head` and
    /// `export` then open the live file themselves, and every commit pays
    /// redb's own two fdatasyncs (about 0.6x the default's submits). For a
    /// data dir on a file system without Unix sockets. By default berth
    /// holds the file alone: a commit is one append to the redo log
    /// (`berth.redo`) and one fdatasync, redb catches up at each
    /// checkpoint, and those readers get a snapshot berth copies for them
    /// over `snapshots/berth.sock` in the data dir.
    #[arg(long, env = "BERTH_SHARED_STORE", conflicts_with = "exclusive_store")]
    pub shared_store: bool,

    /// The default (berth holds the store file alone, with a redo log);
    /// accepted so command lines from before it was keep working.
    #[arg(long, env = "BERTH_EXCLUSIVE_STORE", hide = true)]
    pub exclusive_store: bool,

    /// Unless --shared-store: how long between checkpoints at most (each
    /// makes redb durable and empties the redo log; a crash replays at
    /// most this much). A checkpoint holds the writer while it writes what
    /// redb gathered since the last, so a longer interval means rarer but
    /// longer pauses in commits. When no write is waiting, a checkpoint
    /// comes sooner, after 40% of it (20ms of the default). At most 60s.
    // Why 50ms (interleaved runs, docs/performance-history.md, "The
    // checkpoint interval is 50 ms"): the p99 of a submit follows the
    // interval (at 32 connections 7-9 ms at 25-50 ms, 13 ms at 100 ms,
    // 20 ms at 200 ms; at one connection under 2 ms only from 50 ms down)
    // while the rate moves within noise down to 50 ms and drops ~5% at
    // 25 ms.
    #[arg(long, env = "BERTH_CHECKPOINT_INTERVAL", default_value = "50ms", value_parser = parse_checkpoint_interval)]
    pub checkpoint_interval: Duration,

    /// The most memory the store's page cache may take (its pages read and
    /// those written since the last checkpoint), as a number with a unit:
    /// KiB, MiB or GiB. From 1MiB to 64GiB. Pages past it are read from
    /// the file again (through the kernel's page cache) when needed.
    // Why 64MiB (docs/performance-history.md, "The page cache bounded"):
    // redb's own default, 1 GiB, let berth's memory follow its store file,
    // and the growing cost CPU (at 32 connections submits ran 16-23%
    // faster with 64 MiB); 16, 64 and 256 MiB ran alike.
    #[arg(long, env = "BERTH_CACHE_SIZE", default_value = "64MiB", value_parser = parse_cache_size)]
    pub cache_size: crate::store::CacheSize,

    /// How long a stream ticket (for a browser's EventSource) stays valid.
    #[arg(long, env = "BERTH_TICKET_TTL", default_value = "1h", value_parser = parse_duration)]
    pub ticket_ttl: Duration,

    /// How often an idle event stream gets a `: keep-alive` comment, so
    /// proxies and clients see that it lives (100ms to 5m).
    #[arg(long, env = "BERTH_SSE_KEEP_ALIVE", default_value = "15s", value_parser = parse_keep_alive)]
    pub sse_keep_alive: Duration,

    /// Write the address berth listens on (`127.0.0.1:PORT`) to this file,
    /// atomically, once it listens: with `--listen 127.0.0.1:0` the kernel
    /// picks a free port and scripts read it here.
    #[arg(long, env = "BERTH_ADDRESS_FILE")]
    pub address_file: Option<PathBuf>,

    /// Open event streams one principal may hold (api.md "Fair shares"), at
    /// most --max-sse-clients and below --max-connections, so one tenant
    /// never takes every connection [default: 100, or lower with those]
    #[arg(long, env = "BERTH_MAX_STREAMS_PER_CALLER", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_streams_per_caller: Option<u32>,

    /// Live stream tickets one principal may hold; a new one past it
    /// revokes that principal's oldest.
    #[arg(long, env = "BERTH_MAX_TICKETS_PER_CALLER", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub max_tickets_per_caller: u32,

    /// Open event streams at most; past it a stream request gets 503.
    #[arg(long, env = "BERTH_MAX_SSE_CLIENTS", default_value_t = 10_000)]
    pub max_sse_clients: usize,

    /// Origins of browser front-ends allowed to call berth (exact
    /// `scheme://host[:port]`, comma-separated; default none). Answers
    /// their CORS preflights and adds `Access-Control-Allow-Origin` to every
    /// answer for them, event streams included; never `*`.
    #[arg(long, env = "BERTH_CORS_ORIGIN", value_delimiter = ',')]
    pub cors_origin: Vec<String>,

    /// Serve /metrics without the service token.
    #[arg(long, env = "BERTH_METRICS_PUBLIC")]
    pub metrics_public: bool,

    /// The authorization callback: any bearer token other than the service
    /// token is POSTed here (spec api.md "Authentication"); without it only
    /// the service token is accepted.
    #[arg(long, env = "BERTH_AUTHZ_URL")]
    pub authz_url: Option<String>,

    /// Anonymous denials (no actor, no service token) are recorded once per
    /// interval, then folded into one `denied_anonymous` event with a count;
    /// an agent token's refused reports likewise, per token, into
    /// `node_report_refused`.
    #[arg(long, env = "BERTH_AUDIT_DENIAL_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub audit_denial_interval: Duration,

    /// Audit events older than this many days are removed (the removal keeps
    /// an anchor and is itself audited); 0 keeps every event.
    #[arg(long, env = "BERTH_AUDIT_RETENTION_DAYS", default_value_t = 365)]
    pub audit_retention_days: u32,

    /// The checkpoint origin line and signing key name (default
    /// `berth/<hostname>/audit`).
    #[arg(long, env = "BERTH_AUDIT_ORIGIN")]
    pub audit_origin: Option<String>,

    /// Development mode (allows --reset-dev-state).
    #[arg(long, env = "BERTH_DEV")]
    pub dev: bool,

    /// Delete the stored state at start (needs --dev).
    #[arg(long, env = "BERTH_RESET_DEV_STATE")]
    pub reset_dev_state: bool,
}

impl Settings {
    /// The store file: `--store redb:<path>`, else berth.redb in the data
    /// dir (with PostgreSQL, the replica's cache of the database).
    pub fn db_path(&self) -> PathBuf {
        match self
            .store
            .as_deref()
            .and_then(|s| s.trim().strip_prefix("redb:"))
        {
            Some(path) if !path.is_empty() => PathBuf::from(path),
            Some(_) | None => self.data_dir.join("berth.redb"),
        }
    }

    /// Whether the store is in PostgreSQL (cluster mode): `--store-file`,
    /// or a `--store` that is not `redb:`.
    pub fn is_cluster(&self) -> bool {
        match (&self.store, &self.store_file) {
            (Some(url), _) => !url.trim().starts_with("redb:"),
            (None, file) => file.is_some(),
        }
    }

    /// Where the store lives, from `--store` or `--store-file`.
    pub fn store_location(&self) -> Result<crate::store::location::Location, String> {
        use crate::store::location::{parse, Location};
        let (text, from_file) = match (&self.store, &self.store_file) {
            (Some(url), _) => (url.clone(), false),
            (None, Some(file)) => (read_store_file(file)?, true),
            (None, None) => return Ok(Location::Redb(self.db_path())),
        };
        parse(&text, from_file).map_err(|r| format!("--store: {r}"))
    }
    /// Where deployers' `work/` and `scratch/` live (`--deployer-dir`).
    pub fn deployers_root(&self) -> PathBuf {
        match (&self.deployer_dir, &self.deployer_user) {
            (Some(dir), _) => dir.clone(),
            (None, None) => self.data_dir.clone(),
            (None, Some(_)) => {
                let mut name = self.data_dir.file_name().unwrap_or_default().to_os_string();
                name.push("-deployers");
                self.data_dir.with_file_name(name)
            }
        }
    }
    pub fn work_root(&self) -> PathBuf {
        self.deployers_root().join("work")
    }
    pub fn work_dir(&self, deployment: &str) -> PathBuf {
        self.work_root().join(deployment)
    }
    pub fn scratch_root(&self) -> PathBuf {
        self.deployers_root().join("scratch")
    }
}

/// `url=...,rev=...,digest=sha256:...`
pub fn parse_source(text: &str) -> Result<Source, String> {
    let (mut url, mut rev, mut digest) = (None, None, None);
    for part in text.split(',') {
        let (key, value) = part
            .split_once('=')
            .ok_or("expected key=value pairs: url=...,rev=...,digest=sha256:...")?;
        match key.trim() {
            "url" => url = Some(value.trim().to_string()),
            "rev" => rev = Some(value.trim().to_string()),
            "digest" => digest = Some(value.trim().to_string()),
            _ => return Err("unknown key; expected url, rev and digest".into()),
        }
    }
    let source = Source {
        url: url.ok_or("missing url=")?,
        rev: rev.ok_or("missing rev=")?,
        digest: digest.ok_or("missing digest=")?,
    };
    if !Source::digest_is_valid(&source.digest) {
        return Err("digest must be sha256: followed by 64 lower-case hex digits".into());
    }
    Ok(source)
}

/// `--update-interval` at most: no maintenance window (15 minutes at least)
/// is shorter than three looks.
pub const MAX_UPDATE_INTERVAL: Duration = Duration::from_secs(300);

/// The default of `--max-streams-per-caller`.
pub const DEFAULT_STREAMS_PER_CALLER: usize = 100;

impl Settings {
    /// `--max-streams-per-caller`, or its default.
    pub fn streams_per_caller(&self) -> usize {
        let below_connections = (self.max_connections as usize).saturating_sub(1).max(1);
        self.max_streams_per_caller.map_or(
            DEFAULT_STREAMS_PER_CALLER
                .min(self.max_sse_clients)
                .min(below_connections),
            |n| n as usize,
        )
    }
}

/// The shortest and longest keep-alive interval: shorter only costs writes,
/// longer than most proxies' idle timeouts would let them cut the stream.
const KEEP_ALIVE_RANGE: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(300));

/// A check more often than this would only load the deployer; one less
/// often than this would leave a broken node up too long.
const HEALTH_INTERVAL_RANGE: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(600));

/// `--update-interval`: 1 s to 5 minutes.
/// `--rollout-watch-interval`: 5 s to 10 min (rollouts.md).
const WATCH_INTERVAL_RANGE: (Duration, Duration) =
    (Duration::from_secs(5), Duration::from_secs(600));
const UPDATE_INTERVAL_RANGE: (Duration, Duration) = (Duration::from_secs(1), MAX_UPDATE_INTERVAL);

/// A duration within `range`; the error names the flag's range.
fn duration_within(
    text: &str,
    range: (Duration, Duration),
    what: &str,
) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    if d < range.0 || d > range.1 {
        return Err(format!(
            "the {what} is {} to {}",
            show(range.0),
            show(range.1)
        ));
    }
    Ok(d)
}

/// `100ms`, `5s`, `10m`: how a range is written back to the user.
fn show(d: Duration) -> String {
    match (d.as_millis(), d.as_secs()) {
        (ms, _) if ms % 1000 != 0 => format!("{ms}ms"),
        (_, s) if s % 60 == 0 => format!("{}m", s / 60),
        (_, s) => format!("{s}s"),
    }
}

fn parse_keep_alive(text: &str) -> Result<Duration, String> {
    duration_within(text, KEEP_ALIVE_RANGE, "keep-alive interval")
}

/// A label set as a flag holds it: sorted, without repeats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSet(pub Vec<String>);

fn parse_label_set(text: &str) -> Result<LabelSet, String> {
    crate::authority::parse_labels(text).map(LabelSet)
}

fn parse_on_off(text: &str) -> Result<bool, String> {
    match text {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err("on or off".into()),
    }
}

fn parse_lease_ttl(text: &str) -> Result<Duration, String> {
    use crate::authority::{LEASE_TTL_MAX_MS, LEASE_TTL_MIN_MS};
    let d = parse_duration(text)?;
    let ms = d.as_millis();
    if ms < u128::from(LEASE_TTL_MIN_MS) || ms > u128::from(LEASE_TTL_MAX_MS) {
        return Err("the lease ttl is 5s to 10m".into());
    }
    Ok(d)
}

fn parse_store_connect_timeout(text: &str) -> Result<Duration, String> {
    duration_within(
        text,
        (Duration::from_secs(1), Duration::from_secs(60)),
        "store connect timeout",
    )
}

fn parse_store_timeout(text: &str) -> Result<Duration, String> {
    duration_within(
        text,
        (Duration::from_secs(1), Duration::from_secs(600)),
        "store timeout",
    )
}

fn parse_store_migrate_timeout(text: &str) -> Result<Duration, String> {
    duration_within(
        text,
        (Duration::from_secs(1), Duration::from_secs(3600)),
        "store migrate timeout",
    )
}

fn parse_health_interval(text: &str) -> Result<Duration, String> {
    duration_within(text, HEALTH_INTERVAL_RANGE, "health interval")
}

fn parse_watch_interval(text: &str) -> Result<Duration, String> {
    duration_within(text, WATCH_INTERVAL_RANGE, "rollout watch interval")
}

fn parse_update_interval(text: &str) -> Result<Duration, String> {
    duration_within(text, UPDATE_INTERVAL_RANGE, "update interval")
}

/// `250ms`, `30s`, `5m`, `24h`, or a plain number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| "expected a number followed by ms, s, m or h".to_string())?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "" | "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => return Err("unit must be ms, s, m or h".into()),
    };
    Ok(d)
}

/// `--callback-origin`, `--webhook-origin`: an http(s) origin and nothing
/// else (a trailing `/` is allowed), kept in its canonical spelling so a
/// URL is compared with what the served OpenAPI document states.
pub fn parse_origin(text: &str) -> Result<String, String> {
    const FORM: &str = "an origin is written scheme://host[:port], http or https, with no path";
    let url = reqwest::Url::parse(text.trim()).map_err(|_| FORM.to_string())?;
    let bare = matches!(url.scheme(), "http" | "https")
        && url.host_str().is_some()
        && url.username().is_empty()
        && url.password().is_none()
        && url.path() == "/"
        && url.query().is_none()
        && url.fragment().is_none();
    if !bare {
        return Err(FORM.into());
    }
    Ok(url.origin().ascii_serialization())
}

/// `--cache-size`: a whole number of KiB, MiB or GiB, within
/// `CacheSize::MIN_BYTES..=CacheSize::MAX_BYTES`.
fn parse_cache_size(text: &str) -> Result<crate::store::CacheSize, String> {
    use crate::store::CacheSize;
    const FORM: &str = "must be a whole number with a unit, like 64MiB, 512KiB or 2GiB";
    let (digits, shift) = [("KiB", 10u32), ("MiB", 20), ("GiB", 30)]
        .iter()
        .find_map(|(unit, shift)| text.strip_suffix(unit).map(|n| (n, *shift)))
        .ok_or(FORM)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(FORM.into());
    }
    let out_of_range = || {
        format!(
            "must be from {}MiB to {}GiB",
            CacheSize::MIN_BYTES >> 20,
            CacheSize::MAX_BYTES >> 30
        )
    };
    let count: u64 = digits.parse().map_err(|_| out_of_range())?;
    count
        .checked_mul(1 << shift)
        .and_then(CacheSize::of_bytes)
        .ok_or_else(out_of_range)
}

/// The longest `--checkpoint-interval`: it bounds the redo log a crash
/// leaves to replay.
pub const MAX_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(60);

/// `--checkpoint-interval`: above zero, at most `MAX_CHECKPOINT_INTERVAL`.
fn parse_checkpoint_interval(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    let max = MAX_CHECKPOINT_INTERVAL;
    if d.is_zero() || d > max {
        return Err(format!("must be above 0 and at most {}s", max.as_secs()));
    }
    Ok(d)
}

/// The first line of `--store-file`, which must be private to its owner.
pub(crate) fn read_store_file(path: &std::path::Path) -> Result<String, String> {
    use std::os::unix::fs::PermissionsExt;
    let meta =
        std::fs::metadata(path).map_err(|e| format!("--store-file {}: {e}", path.display()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(format!(
            "--store-file {} may be read by group or others: chmod 600 it (store_file_mode)",
            path.display()
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--store-file {}: {e}", path.display()))?;
    match text.lines().next().map(str::trim) {
        Some(line) if !line.is_empty() => Ok(line.to_string()),
        Some(_) | None => Err(format!("--store-file {} is empty", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_is_held_alone_unless_shared_and_the_old_flag_still_parses() {
        use clap::Parser;
        let serve = |args: &[&str]| {
            Cli::try_parse_from(["berth", "serve"].iter().chain(args)).map(|cli| {
                match cli.command {
                    Command::Serve(s) => s.shared_store,
                    _ => unreachable!("parsed serve"),
                }
            })
        };
        assert!(!serve(&[]).unwrap(), "held alone by default");
        assert!(!serve(&["--exclusive-store"]).unwrap());
        assert!(serve(&["--shared-store"]).unwrap());
        assert!(serve(&["--shared-store", "--exclusive-store"]).is_err());
    }

    #[test]
    fn cache_sizes_take_a_unit_and_stay_in_range() {
        let bytes = |t: &str| parse_cache_size(t).map(|c| c.bytes());
        assert_eq!(bytes("64MiB"), Ok(64 << 20));
        assert_eq!(bytes("1024KiB"), Ok(1 << 20));
        assert_eq!(bytes("64GiB"), Ok(64 << 30));
        for refused in [
            "", "64", "MiB", "64 MiB", "-1MiB", "1.5GiB", "64mb", "+64MiB",
        ] {
            let e = parse_cache_size(refused).unwrap_err();
            assert!(e.contains("unit"), "{refused:?}: {e}");
        }
        for refused in ["0MiB", "1023KiB", "65GiB", "99999999999999999999GiB"] {
            let e = parse_cache_size(refused).unwrap_err();
            assert!(e.contains("from 1MiB to 64GiB"), "{refused:?}: {e}");
        }
        use clap::Parser;
        let cli = Cli::try_parse_from(["berth", "serve"]).unwrap();
        match cli.command {
            Command::Serve(s) => assert_eq!(s.cache_size, crate::store::CacheSize::DEFAULT),
            _ => unreachable!("parsed serve"),
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86400)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn origins_are_kept_in_their_canonical_spelling_and_anything_more_is_refused() {
        let ok = |text: &str| parse_origin(text).unwrap();
        assert_eq!(ok("https://panel.example.org"), "https://panel.example.org");
        assert_eq!(
            ok("https://panel.example.org/"),
            "https://panel.example.org"
        );
        assert_eq!(
            ok("HTTPS://Panel.Example.org:443"),
            "https://panel.example.org"
        );
        assert_eq!(ok("http://127.0.0.1:9000"), "http://127.0.0.1:9000");
        for bad in [
            "panel.example.org",
            "ftp://panel.example.org",
            "https://panel.example.org/hooks",
            "https://panel.example.org/?a=b",
            "https://user@panel.example.org",
            "",
        ] {
            assert!(parse_origin(bad).is_err(), "{bad:?} was taken");
        }
    }

    #[test]
    fn sources() {
        let d = format!("sha256:{}", "a".repeat(64));
        let s = parse_source(&format!("url=https://x.org/m,rev=v1,digest={d}")).unwrap();
        assert_eq!(s.rev, "v1");
        assert!(parse_source("url=x,rev=y,digest=sha256:zz").is_err());
        assert!(parse_source("url=x,rev=y").is_err());
    }
}
