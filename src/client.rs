//! The command-line client (spec cli.md): `berth deploy`, `logs --follow`,
//! `status`, ... over the same HTTP API as every other front-end, no
//! private route. Why it exists: operators script deploys and tail logs,
//! and hand-written JSON and `curl -N` do neither safely (a retried curl
//! deploys twice; a dropped `curl -N` loses lines).
//!
//! It depends on nothing of the server but the wire: JSON in, JSON out.
//! Every mutation carries one fresh `Idempotency-Key` through all of its
//! retries, so a flaky network never queues a build twice. `logs --follow`
//! reads the log in one request, then follows the build channel from the
//! `Berth-Event-Cursor` of that answer, reconnecting with `Last-Event-ID`
//! through dropped connections and restarts, printing each line once.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};

use crate::settings::{ClientArgs, Command};

/// Exit statuses (cli.md): a build's outcome, or why there is none.
const EXIT_OK: i32 = 0;
const EXIT_BUILD_FAILED: i32 = 1;
const EXIT_REFUSED: i32 = 3;
const EXIT_UNREACHABLE: i32 = 4;
const EXIT_BUILD_CANCELLED: i32 = 5;

/// Tries of one request when the connection fails or berth answers 5xx
/// (with the same idempotency key), and the wait before each retry.
const RETRY_WAITS: [Duration; 4] = [
    Duration::from_millis(200),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
];
/// A follower waits at most this long between reconnects (it never gives
/// up: a restart of berth takes as long as it takes).
const MAX_RECONNECT_WAIT: Duration = Duration::from_secs(2);
/// One server-sent event at most (berth's are a log line or a build
/// summary; anything far larger is not berth).
const MAX_EVENT_BYTES: usize = 16 << 20;
/// The token file berth serve writes by default.
const DEFAULT_TOKEN_FILE: &str = "./berth-data/service-token";
/// A configuration read from a file or stdin at most (berth's own limit on
/// a request body is lower; this only bounds the client's memory).
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// A line on stdout. A reader that went away (`berth logs | head`) ends
/// the command quietly, as a pipe's writer should, instead of a panic.
macro_rules! out {
    ($($arg:tt)*) => {
        emit(&format!($($arg)*))
    };
}

fn emit(line: &str) {
    let mut stdout = std::io::stdout().lock();
    if writeln!(stdout, "{line}")
        .and_then(|_| stdout.flush())
        .is_err()
    {
        std::process::exit(EXIT_OK);
    }
}

/// Why a command stopped: printed on stderr, and its exit status.
struct Stop {
    code: i32,
    message: String,
}

impl Stop {
    fn unreachable(what: &str) -> Stop {
        Stop {
            code: EXIT_UNREACHABLE,
            message: format!("berth could not be reached: {what}"),
        }
    }
    fn usage(message: String) -> Stop {
        Stop { code: 2, message }
    }
}

type CommandResult = Result<i32, Stop>;

/// Runs one client command; the exit status.
pub fn run(command: Command) -> i32 {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("berth: cannot start: {e}");
            return EXIT_UNREACHABLE;
        }
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    match runtime.block_on(dispatch(command)) {
        Ok(code) => code,
        Err(stop) => {
            eprintln!("berth: {}", stop.message);
            stop.code
        }
    }
}

async fn dispatch(command: Command) -> CommandResult {
    match command {
        Command::Deploy {
            id,
            config,
            enqueue,
            keep_deployed_revision,
            wait,
            conn,
        } => deploy(&id, &config, enqueue, keep_deployed_revision, wait, &conn).await,
        Command::Preview { id, config, conn } => preview(&id, &config, &conn).await,
        Command::Status { ids, conn } => status(&ids, &conn).await,
        Command::Builds { id, conn } => {
            let c = Client::new(&conn)?;
            let page = c
                .call(
                    "GET",
                    &format!("/v1/deployments/{}/builds?limit=50", path(&id)),
                    None,
                    None,
                )
                .await?;
            if c.json {
                c.print_json(&page);
            } else {
                c.builds_table(&page["items"]);
            }
            Ok(EXIT_OK)
        }
        Command::Logs {
            build,
            follow,
            raw,
            conn,
        } => logs(&build, follow, raw, &conn).await,
        Command::Cancel { build, conn } => cancel(&build, &conn).await,
        Command::Rollback { id, to, wait, conn } => {
            let c = Client::new(&conn)?;
            let body = to.map(|b| json!({"build_id": b}));
            let answer = c
                .mutate(
                    "POST",
                    &format!("/v1/deployments/{}/actions/rollback", path(&id)),
                    body,
                )
                .await?;
            c.queued(answer, wait).await
        }
        Command::Suspend { id, wait, conn } => action("suspend", &id, wait, &conn).await,
        Command::Resume { id, wait, conn } => action("resume", &id, wait, &conn).await,
        Command::Delete { id, wait, conn } => {
            let c = Client::new(&conn)?;
            let answer = c
                .mutate("DELETE", &format!("/v1/deployments/{}", path(&id)), None)
                .await?;
            c.queued(answer, wait).await
        }
        Command::Tokens { tokens } => tokens_command(tokens).await,
        Command::Rollout { rollout } => rollout_command(rollout).await,
        Command::Freeze { freeze } => freeze_command(freeze).await,
        Command::Workers { conn } => workers(&conn).await,
        Command::Nodes {
            deployment,
            drifted,
            unreachable,
            conn,
        } => nodes(deployment.as_deref(), (drifted, unreachable), &conn).await,
        Command::Serve(_)
        | Command::Worker(_)
        | Command::Agent(_)
        | Command::Completions { .. }
        | Command::Man
        | Command::Audit { .. }
        | Command::Export { .. }
        | Command::Import { .. }
        | Command::Deployer { .. } => Err(Stop::usage("not a client command".into())),
    }
}

/// `berth deploy`: a submit, then its build id or (`--wait`) its log.
async fn deploy(
    id: &str,
    config: &str,
    enqueue: bool,
    keep_deployed_revision: bool,
    wait: bool,
    conn: &ClientArgs,
) -> CommandResult {
    let c = Client::new(conn)?;
    let configuration = read_config(config)?;
    let mut body = json!({"configuration": configuration});
    if enqueue {
        body["mode"] = json!("enqueue");
    }
    if keep_deployed_revision {
        body["keep_deployed_revision"] = json!(true);
    }
    let answer = c
        .mutate(
            "POST",
            &format!("/v1/deployments/{}/submit", path(id)),
            Some(body),
        )
        .await?;
    c.queued(answer, wait).await
}

/// `berth logs`: a build's log (`--follow`: until it ends), and its
/// outcome as the exit status.
async fn logs(build: &str, follow: bool, raw: bool, conn: &ClientArgs) -> CommandResult {
    let mut c = Client::new(conn)?;
    c.raw_log_lines = raw || !std::io::stdout().is_terminal();
    if follow {
        return c.follow(build).await;
    }
    let mut lines = LogLines::new(c.raw_log_lines);
    c.log(build, &mut |bytes| lines.print(bytes)).await?;
    let b = c
        .call("GET", &format!("/v1/builds/{}", path(build)), None, None)
        .await?;
    Ok(outcome_code(&b["status"]).unwrap_or(EXIT_OK))
}

/// `berth cancel`: the build's status after the cancel.
async fn cancel(build: &str, conn: &ClientArgs) -> CommandResult {
    let c = Client::new(conn)?;
    let answer = c
        .mutate("POST", &format!("/v1/builds/{}/cancel", path(build)), None)
        .await?;
    if c.json {
        c.print_json(&answer);
    } else {
        out!(
            "{} {}",
            text(&answer["id"]),
            c.state(&text(&answer["status"]))
        );
    }
    Ok(EXIT_OK)
}

/// `berth preview`: the changes a submit would make, as a table.
async fn preview(id: &str, config: &str, conn: &ClientArgs) -> CommandResult {
    let c = Client::new(conn)?;
    let body = json!({"configuration": read_config(config)?});
    let answer = c
        .call(
            "POST",
            &format!("/v1/deployments/{}/preview", path(id)),
            Some(body),
            None,
        )
        .await?;
    if c.json {
        c.print_json(&answer);
    } else {
        let rows: Vec<Vec<String>> = answer["changes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|ch| vec![text(&ch["node"]), text(&ch["change"])])
            .collect();
        c.table(&["NODE", "CHANGE"], &rows);
    }
    Ok(EXIT_OK)
}

/// `berth status`: one deployment in full, or a table of several.
async fn status(ids: &[String], conn: &ClientArgs) -> CommandResult {
    let c = Client::new(conn)?;
    if let [id] = ids {
        return c.one_status(id).await;
    }
    let mut query = String::from("/v1/deployments?limit=200");
    for id in ids {
        query.push_str(&format!("&id={}", path(id)));
    }
    let page = c.call("GET", &query, None, None).await?;
    if c.json {
        c.print_json(&page);
        return Ok(EXIT_OK);
    }
    let rows: Vec<Vec<String>> = page["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            vec![
                text(&d["id"]),
                c.state(&text(&d["state"])),
                text(&d["domain"]),
                match d["last_build"].as_object() {
                    Some(b) => format!(
                        "{} {}",
                        short(&text(&b["id"])),
                        c.state(&text(&b["status"]))
                    ),
                    None => "-".into(),
                },
                text(&d["updated_at"]),
            ]
        })
        .collect();
    c.table(&["ID", "STATE", "DOMAIN", "LAST BUILD", "UPDATED"], &rows);
    Ok(EXIT_OK)
}

/// `berth tokens create|list|revoke` (api.md "Tokens").
async fn tokens_command(command: crate::settings::TokensCommand) -> CommandResult {
    use crate::settings::TokensCommand;
    match command {
        TokensCommand::Create {
            name,
            kind,
            labels,
            deployment,
            node,
            conn,
        } => {
            let c = Client::new(&conn)?;
            let labels = crate::authority::parse_labels(&labels).map_err(Stop::usage)?;
            let body = json!({"name": name, "kind": kind, "labels": labels,
                "deployment": deployment, "node": node});
            let made = c.mutate("POST", "/v1/tokens", Some(body)).await?;
            // Only the token, so `berth tokens create w1 > w1.token` works.
            println!("{}", text(&made["token"]));
            Ok(EXIT_OK)
        }
        TokensCommand::List { conn } => {
            let c = Client::new(&conn)?;
            let page = c.call("GET", "/v1/tokens", None, None).await?;
            if c.json {
                c.print_json(&page);
                return Ok(EXIT_OK);
            }
            let rows: Vec<Vec<String>> = items(&page)
                .map(|t| {
                    let node = match (t["deployment"].as_str(), t["node"].as_str()) {
                        (Some(d), Some(n)) => format!("{d}/{n}"),
                        _ => "-".to_string(),
                    };
                    vec![
                        text(&t["name"]),
                        text(&t["kind"]),
                        list(&t["labels"]),
                        node,
                        text(&t["created_at"]),
                    ]
                })
                .collect();
            c.table(&["NAME", "KIND", "LABELS", "NODE", "CREATED"], &rows);
            Ok(EXIT_OK)
        }
        TokensCommand::Revoke { name, conn } => {
            let c = Client::new(&conn)?;
            c.mutate("DELETE", &format!("/v1/tokens/{}", path(&name)), None)
                .await?;
            eprintln!("revoked {}", shown(&name));
            Ok(EXIT_OK)
        }
    }
}

/// `berth rollout status|pause|resume|abort` (rollouts.md).
async fn rollout_command(command: crate::settings::RolloutCommand) -> CommandResult {
    use crate::settings::RolloutCommand as R;
    let (name, id, reason, revision, wait, conn) = match command {
        R::Status { id, conn } => return rollout_status(&id, &conn).await,
        R::Pause {
            id,
            reason,
            revision,
            conn,
        } => ("rollout_pause", id, reason, revision, false, conn),
        R::Resume { id, revision, conn } => ("rollout_resume", id, None, revision, false, conn),
        R::Abort {
            id,
            reason,
            revision,
            wait,
            conn,
        } => ("rollout_abort", id, reason, revision, wait, conn),
    };
    let mut c = Client::new(&conn)?;
    c.if_match = revision;
    let body = reason.map(|r| json!({"reason": r}));
    let answer = c
        .mutate(
            "POST",
            &format!("/v1/deployments/{}/actions/{name}", path(&id)),
            body,
        )
        .await?;
    if wait {
        return c.follow(&text(&answer["build_id"])).await;
    }
    if c.json {
        c.print_json(&answer);
    } else {
        out!("{}", text(&answer["rollout"]["state"]));
    }
    Ok(EXIT_OK)
}

/// The freeze route of `id`, or of `--global`; neither (or both) is a
/// usage error.
fn freeze_path(id: Option<&str>, global: bool) -> Result<String, Stop> {
    match (id, global) {
        (Some(id), false) => Ok(format!("/v1/deployments/{}/freeze", path(id))),
        (None, true) => Ok("/v1/freeze".into()),
        (Some(_), true) | (None, false) => Err(Stop::usage(
            "name a deployment, or --global for every one (never both)".into(),
        )),
    }
}

/// `berth freeze set|lift|status` (rollouts.md "Freeze").
async fn freeze_command(command: crate::settings::FreezeCommand) -> CommandResult {
    use crate::settings::FreezeCommand as F;
    match command {
        F::Set {
            id,
            global,
            reason,
            until,
            window,
            conn,
        } => {
            let route = freeze_path(id.as_deref(), global)?;
            let window = match window {
                Some(w) => Some(
                    serde_json::from_str::<Value>(&w)
                        .map_err(|e| Stop::usage(format!("--window is not JSON: {e}")))?,
                ),
                None => None,
            };
            let c = Client::new(&conn)?;
            let body = json!({"reason": reason, "until": until, "window": window});
            let answer = c.mutate("PUT", &route, Some(body)).await?;
            c.show_freeze(&answer["freeze"]);
            Ok(EXIT_OK)
        }
        F::Lift { id, global, conn } => {
            let route = freeze_path(id.as_deref(), global)?;
            let c = Client::new(&conn)?;
            c.mutate("DELETE", &route, None).await?;
            eprintln!("lifted");
            Ok(EXIT_OK)
        }
        F::Status { id, conn } => {
            let c = Client::new(&conn)?;
            let global = c.call("GET", "/v1/freeze", None, None).await?;
            let Some(id) = id else {
                c.show_freeze(&global["freeze"]);
                return Ok(EXIT_OK);
            };
            let d = c
                .call("GET", &format!("/v1/deployments/{}", path(&id)), None, None)
                .await?;
            if c.json {
                c.print_json(&json!({"freeze": d["freeze"], "frozen": d["frozen"], "global": global["freeze"]}));
                return Ok(EXIT_OK);
            }
            out!("own:     {}", describe_freeze(&d["freeze"]));
            out!("global:  {}", describe_freeze(&global["freeze"]));
            out!("holding: {}", describe_freeze(&d["frozen"]));
            Ok(EXIT_OK)
        }
    }
}

/// A freeze in one line (its reason with control characters escaped by
/// `text`), or `none`.
fn describe_freeze(f: &Value) -> String {
    if f.is_null() {
        return "none".into();
    }
    let active = match &f["active"] {
        Value::Bool(false) => " (not active now)",
        _ => "",
    };
    format!(
        "{} ({}){active}, until {}",
        text(&f["reason"]),
        text(&f["scope"]),
        text(&f["until"])
    )
}

/// `berth rollout status ID`: the deployment's newest rollout.
async fn rollout_status(id: &str, conn: &ClientArgs) -> CommandResult {
    let c = Client::new(conn)?;
    let d = c
        .call("GET", &format!("/v1/deployments/{}", path(id)), None, None)
        .await?;
    if c.json {
        c.print_json(&json!({"revision": d["revision"], "rollout": d["rollout"]}));
        return Ok(EXIT_OK);
    }
    let r = &d["rollout"];
    if r.is_null() {
        out!("no rollout (revision {})", text(&d["revision"]));
        return Ok(EXIT_OK);
    }
    let paused = match &r["paused"] {
        Value::Null => "-".to_string(),
        p => format!("by {} {}", text(&p["by"]), text(&p["reason"])),
    };
    let rows = vec![
        vec!["build".to_string(), text(&r["build_id"])],
        vec!["state".to_string(), text(&r["state"])],
        vec![
            "wave".to_string(),
            format!("{}/{}", text(&r["wave"]), text(&r["wave_count"])),
        ],
        vec![
            "nodes".to_string(),
            format!(
                "{}/{} activated, {} unhealthy",
                text(&r["nodes_activated"]),
                text(&r["nodes_total"]),
                text(&r["unhealthy_count"])
            ),
        ],
        vec!["paused".to_string(), paused],
        vec!["wait until".to_string(), text(&r["wait_until"])],
        vec!["result".to_string(), text(&r["result"])],
        vec!["revision".to_string(), text(&d["revision"])],
    ];
    for row in rows {
        out!("{:<11} {}", row[0], row[1]);
    }
    Ok(EXIT_OK)
}

/// `berth workers`: the embedded worker and every worker token.
async fn workers(conn: &ClientArgs) -> CommandResult {
    let c = Client::new(conn)?;
    let page = c.call("GET", "/v1/workers", None, None).await?;
    if c.json {
        c.print_json(&page);
        return Ok(EXIT_OK);
    }
    let rows: Vec<Vec<String>> = items(&page)
        .map(|w| {
            vec![
                text(&w["name"]),
                text(&w["kind"]),
                list(&w["labels"]),
                text(&w["incarnation"]),
                w["attempts"].as_array().map_or(0, Vec::len).to_string(),
                text(&w["last_seen_at"]),
            ]
        })
        .collect();
    c.table(
        &[
            "NAME",
            "KIND",
            "LABELS",
            "INCARNATION",
            "ATTEMPTS",
            "LAST SEEN",
        ],
        &rows,
    );
    Ok(EXIT_OK)
}

/// `berth nodes`: one deployment's nodes, or every bound node, a page of
/// 200 (cli.md).
async fn nodes(
    deployment: Option<&str>,
    (drifted, unreachable): (bool, bool),
    conn: &ClientArgs,
) -> CommandResult {
    let c = Client::new(conn)?;
    let mut query = vec!["limit=200".to_string()];
    if drifted {
        query.push("drifted=true".into());
    }
    if unreachable {
        query.push("unreachable=true".into());
    }
    let url = match deployment {
        Some(id) => format!("/v1/deployments/{}/nodes?{}", path(id), query.join("&")),
        None => format!("/v1/nodes?{}", query.join("&")),
    };
    let page = c.call("GET", &url, None, None).await?;
    if c.json {
        c.print_json(&page);
        return Ok(EXIT_OK);
    }
    let rows: Vec<Vec<String>> = items(&page)
        .map(|n| {
            vec![
                n["deployment"]
                    .as_str()
                    .unwrap_or(deployment.unwrap_or("-"))
                    .to_string(),
                text(&n["name"]),
                text(&n["agent"]["status"]),
                short_artifact(&n["desired"]["artifact"]),
                short_artifact(&n["actual"]["running"]),
                short_artifact(&n["actual"]["booted"]),
                list(&n["drift"]["what"]),
                text(&n["agent"]["last_seen_at"]),
            ]
        })
        .collect();
    c.table(
        &[
            "DEPLOYMENT",
            "NODE",
            "AGENT",
            "DESIRED",
            "RUNNING",
            "BOOTED",
            "DRIFT",
            "LAST SEEN",
        ],
        &rows,
    );
    Ok(EXIT_OK)
}

/// An artifact in a table: a digest cut to 12 hex, a store path to its
/// name, `-` for none.
fn short_artifact(a: &Value) -> String {
    if let Some(digest) = a["digest"].as_str() {
        let hex = digest.trim_start_matches("sha256:");
        return hex.chars().take(12).collect();
    }
    match a["path"].as_str() {
        Some(path) => path
            .trim_start_matches("/nix/store/")
            .split_once('-')
            .map_or(path, |(_, name)| name)
            .to_string(),
        None => "-".into(),
    }
}

fn items(page: &Value) -> impl Iterator<Item = &Value> {
    page["items"].as_array().into_iter().flatten()
}

/// A list of strings as `a,b` (`-` when empty).
fn list(v: &Value) -> String {
    let parts: Vec<String> = v.as_array().into_iter().flatten().map(text).collect();
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(",")
    }
}

/// `berth suspend` and `berth resume`: the actions without a body.
async fn action(name: &str, id: &str, wait: bool, conn: &ClientArgs) -> CommandResult {
    let c = Client::new(conn)?;
    let answer = c
        .mutate(
            "POST",
            &format!("/v1/deployments/{}/actions/{name}", path(id)),
            None,
        )
        .await?;
    c.queued(answer, wait).await
}

/// A configuration from a file, or from stdin for `-`.
fn read_config(from: &str) -> Result<Value, Stop> {
    use std::io::Read;
    if from == "-" && std::io::stdin().is_terminal() {
        return Err(Stop::usage(
            "give the configuration with --config FILE, or pipe it on stdin".into(),
        ));
    }
    let mut bytes = Vec::new();
    let read = if from == "-" {
        std::io::stdin()
            .take(MAX_CONFIG_BYTES + 1)
            .read_to_end(&mut bytes)
    } else {
        std::fs::File::open(from).and_then(|f| f.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut bytes))
    };
    let what = if from == "-" {
        "stdin".to_string()
    } else {
        from.to_string()
    };
    read.map_err(|e| Stop::usage(format!("cannot read the configuration from {what}: {e}")))?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(Stop::usage(format!(
            "the configuration in {what} is larger than 16 MiB"
        )));
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        Stop::usage(format!(
            "the configuration in {what} is not JSON (line {}, column {})",
            e.line(),
            e.column()
        ))
    })
}

/// A path segment, percent-encoded (an id from the command line is the
/// user's text; berth refuses a bad one with a clear error).
fn path(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A value from the server as one line of text for people: its control
/// characters shown as escapes (`shown`).
fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => shown(s),
        other => other.to_string(),
    }
}

/// Text from the server as printed for people (cli.md "Output"): every
/// control character but tab (C0, newline included, ESC, DEL, C1) shown
/// as a visible escape, so nothing a tenant submitted (a domain, a
/// deployer's message, a health reason) can move the cursor, retitle the
/// window or write the clipboard, nor forge a line of its own.
fn shown(s: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\t' => out.push(c),
            '\0'..='\x1f' | '\x7f' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            '\u{80}'..='\u{9f}' => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            _ => out.push(c),
        }
    }
    out
}

/// A build's log as it arrives, printed whole lines or not: as it is when
/// `raw` (piped, or `--raw`), else with `shown`'s escapes but for the
/// newlines that end its lines. A chunk may end inside a character, which
/// is then kept for the next.
struct LogLines {
    raw: bool,
    carry: Vec<u8>,
}

impl LogLines {
    fn new(raw: bool) -> LogLines {
        LogLines {
            raw,
            carry: Vec::new(),
        }
    }

    fn print(&mut self, bytes: &[u8]) {
        if self.raw {
            return print_bytes(bytes);
        }
        self.carry.extend_from_slice(bytes);
        // A character cut at the chunk's end waits for the rest of it.
        let whole = match std::str::from_utf8(&self.carry) {
            Ok(_) => self.carry.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => self.carry.len(),
        };
        let rest = self.carry.split_off(whole);
        let text = String::from_utf8_lossy(&self.carry);
        let escaped: Vec<String> = text.split('\n').map(shown).collect();
        print_bytes(escaped.join("\n").as_bytes());
        self.carry = rest;
    }
}

fn short(id: &str) -> String {
    id.chars().take(13).collect()
}

fn print_bytes(bytes: &[u8]) {
    let mut stdout = std::io::stdout().lock();
    if stdout
        .write_all(bytes)
        .and_then(|_| stdout.flush())
        .is_err()
    {
        std::process::exit(EXIT_OK);
    }
}

/// A final build status as the exit status (cli.md).
fn outcome_code(status: &Value) -> Option<i32> {
    match status.as_str()? {
        "succeeded" => Some(EXIT_OK),
        "failed" => Some(EXIT_BUILD_FAILED),
        "cancelled" => Some(EXIT_BUILD_CANCELLED),
        _ => None,
    }
}

struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
    actor: Vec<(&'static str, String)>,
    json: bool,
    colour: bool,
    /// Log lines printed as they are (piped, or `logs --raw`).
    raw_log_lines: bool,
    /// `If-Match: "<revision>"` on every call (`--revision`).
    if_match: Option<u64>,
}

impl Client {
    fn new(conn: &ClientArgs) -> Result<Client, Stop> {
        let token = token(conn)?;
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| Stop::unreachable(&e.to_string()))?;
        let mut actor = Vec::new();
        if let Some(s) = &conn.actor_subject {
            actor.push(("x-actor-subject", s.clone()));
        }
        if let Some(i) = &conn.actor_issuer {
            actor.push(("x-actor-issuer", i.clone()));
        }
        Ok(Client {
            http,
            base: conn.url.trim_end_matches('/').to_string(),
            token,
            actor,
            json: conn.json,
            colour: std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
            raw_log_lines: !std::io::stdout().is_terminal(),
            if_match: None,
        })
    }

    fn request(&self, method: &str, path: &str) -> reqwest::RequestBuilder {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap_or(reqwest::Method::GET);
        let mut r = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token);
        for (k, v) in &self.actor {
            r = r.header(*k, v);
        }
        if let Some(revision) = self.if_match {
            r = r.header("if-match", format!("\"{revision}\""));
        }
        r
    }

    /// A freeze as `freeze status` and `set` show it.
    fn show_freeze(&self, f: &Value) {
        if self.json {
            self.print_json(f);
        } else {
            out!("{}", describe_freeze(f));
        }
    }

    /// A mutation: one fresh idempotency key through every retry.
    async fn mutate(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, Stop> {
        let key = format!("cli-{}", uuid::Uuid::now_v7().simple());
        self.call(method, path, body, Some(&key)).await
    }

    /// One call, retried on a connection failure or a 5xx; a 4xx is the
    /// refusal printed as cli.md says (exit 3).
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        key: Option<&str>,
    ) -> Result<Value, Stop> {
        let mut last = String::new();
        for (attempt, wait) in std::iter::once(Duration::ZERO)
            .chain(RETRY_WAITS)
            .enumerate()
        {
            tokio::time::sleep(wait).await;
            let mut r = self.request(method, path);
            if let Some(k) = key {
                r = r.header("idempotency-key", k);
            }
            if let Some(b) = &body {
                r = r.json(b);
            }
            let response = match r.send().await {
                Ok(response) => response,
                Err(e) => {
                    last = describe(&e);
                    continue;
                }
            };
            let status = response.status().as_u16();
            let answer: Value = match response.bytes().await {
                Ok(bytes) if bytes.is_empty() => Value::Null,
                Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or(Value::Null),
                Err(e) => {
                    last = describe(&e);
                    continue;
                }
            };
            match status {
                200..=299 => return Ok(answer),
                500..=599 if attempt < RETRY_WAITS.len() => {
                    last = format!("berth answered {status}");
                    continue;
                }
                _ => return Err(refusal(status, &answer)),
            }
        }
        Err(Stop::unreachable(&last))
    }

    /// The log so far, written to `sink` as it arrives (never held whole:
    /// a log may be hundreds of MB), and the event its body covers. A
    /// connection that drops mid-body resumes with `Range` from the bytes
    /// already written, so nothing is written twice.
    async fn log(&self, build: &str, sink: &mut dyn FnMut(&[u8])) -> Result<Option<u64>, Stop> {
        let mut last = String::new();
        let mut written: u64 = 0;
        // The newest cursor an answer gave: a resumed read's own, or the
        // first read's when the resumed one found nothing more.
        let mut covered: Option<u64> = None;
        for wait in std::iter::once(Duration::ZERO).chain(RETRY_WAITS) {
            tokio::time::sleep(wait).await;
            let mut r = self.request("GET", &format!("/v1/builds/{}/log", path(build)));
            if written > 0 {
                r = r.header("range", format!("bytes={written}-"));
            }
            let mut response = match r.send().await {
                Ok(r) => r,
                Err(e) => {
                    last = describe(&e);
                    continue;
                }
            };
            let status = response.status().as_u16();
            let cursor = response
                .headers()
                .get("berth-event-cursor")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok());
            covered = cursor.or(covered);
            match status {
                // Nothing after what was written: the log did not grow.
                416 if written > 0 => return Ok(covered),
                200..=299 => loop {
                    match response.chunk().await {
                        Ok(Some(chunk)) => {
                            sink(&chunk);
                            written += chunk.len() as u64;
                        }
                        Ok(None) => return Ok(covered),
                        Err(e) => {
                            last = describe(&e);
                            break;
                        }
                    }
                },
                500..=599 => last = format!("berth answered {status}"),
                _ => {
                    let answer = response.json::<Value>().await.unwrap_or(Value::Null);
                    return Err(refusal(status, &answer));
                }
            }
        }
        Err(Stop::unreachable(&last))
    }

    /// After a 202 with a build id: print it, or follow it (`--wait`).
    async fn queued(&self, answer: Value, wait: bool) -> CommandResult {
        let build = answer["build_id"].as_str().unwrap_or("").to_string();
        if !wait {
            if self.json {
                self.print_json(&answer);
            } else {
                out!("{}", shown(&build));
            }
            return Ok(EXIT_OK);
        }
        eprintln!("berth: build {} queued; following its log", shown(&build));
        if let Some(deployment) = answer["deployment"].as_str() {
            self.say_what_it_waits_behind(deployment, &build).await;
        }
        self.follow(&build).await
    }

    /// cli.md: while a build is queued behind another, `--wait` says which.
    async fn say_what_it_waits_behind(&self, deployment: &str, build: &str) {
        let Ok(page) = self
            .call(
                "GET",
                &format!("/v1/deployments/{}/builds?limit=20", path(deployment)),
                None,
                None,
            )
            .await
        else {
            return;
        };
        let running = page["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|b| b["status"] == "running" && b["id"] != build);
        if let Some(b) = running {
            eprintln!("berth: it waits behind build {} (running)", text(&b["id"]));
        }
    }

    /// `logs --follow`: the log in one read, then the channel from its
    /// cursor; each line once; the build's outcome as the exit status.
    async fn follow(&self, build: &str) -> CommandResult {
        // The body goes out as it comes; with --json, as one object per
        // whole line.
        let mut partial: Vec<u8> = Vec::new();
        let json_lines = self.json;
        let mut lines = LogLines::new(self.raw_log_lines);
        let cursor = self
            .log(build, &mut |bytes| {
                if !json_lines {
                    return lines.print(bytes);
                }
                partial.extend_from_slice(bytes);
                while let Some(at) = partial.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = partial.drain(..=at).collect();
                    let text = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
                    out!("{}", json!({"event": "log", "data": text}));
                }
            })
            .await?;
        // Lines the body held have seqs up to its cursor; the channel from
        // there gives the rest. (Without a cursor the channel is followed
        // from its start.)
        let mut last: u64 = cursor.unwrap_or(0);
        let mut wait = Duration::from_millis(100);
        loop {
            match self.stream_once(build, &mut last).await {
                Ok(Some(code)) => return Ok(code),
                Ok(None) => {}
                Err(Some(stop)) => return Err(stop),
                Err(None) => {
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(MAX_RECONNECT_WAIT);
                    continue;
                }
            }
            wait = Duration::from_millis(100);
        }
    }

    /// One connection to the build channel after `last`: `Ok(Some(code))`
    /// at `end`, `Ok(None)` when it closed cleanly, `Err(None)` when it
    /// dropped (reconnect), `Err(Some(_))` when berth refused.
    async fn stream_once(&self, build: &str, last: &mut u64) -> Result<Option<i32>, Option<Stop>> {
        let mut r = self.request("GET", &format!("/v1/builds/{}/events", path(build)));
        if *last > 0 {
            r = r.header("last-event-id", last.to_string());
        }
        let mut response = r.send().await.map_err(|_| None)?;
        let status = response.status().as_u16();
        if status >= 500 {
            return Err(None);
        }
        if status >= 400 {
            let answer = response.json::<Value>().await.unwrap_or(Value::Null);
            return Err(Some(refusal(status, &answer)));
        }
        let mut pending = Vec::new();
        loop {
            let chunk = match response.chunk().await {
                Ok(Some(c)) => c,
                Ok(None) => return Ok(None),
                Err(_) => return Err(None),
            };
            pending.extend_from_slice(&chunk);
            if pending.len() > MAX_EVENT_BYTES {
                return Err(Some(Stop::unreachable(
                    "the event stream sent an event larger than 16 MiB",
                )));
            }
            while let Some(at) = find_block_end(&pending) {
                let block: Vec<u8> = pending.drain(..at).collect();
                if let Some(code) = self.event(&block, last) {
                    return Ok(Some(code));
                }
            }
        }
    }

    /// One SSE block; the exit status at `end`.
    fn event(&self, block: &[u8], last: &mut u64) -> Option<i32> {
        let block = String::from_utf8_lossy(block);
        let (mut id, mut event, mut data) = (None, String::from("message"), Vec::new());
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("id:") {
                id = v.trim().parse::<u64>().ok();
            } else if let Some(v) = line.strip_prefix("event:") {
                event = v.trim().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
            }
        }
        let data = data.join("\n");
        // At least once on the wire, exactly once here.
        if let Some(seq) = id {
            if seq <= *last {
                return None;
            }
            *last = seq;
        }
        match event.as_str() {
            "log" => {
                if self.json {
                    out!("{}", json!({"event": "log", "seq": id, "data": data}));
                } else if self.raw_log_lines {
                    out!("{data}");
                } else {
                    out!("{}", shown(&data));
                }
                None
            }
            "end" => {
                let summary: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
                if self.json {
                    out!("{}", json!({"event": "end", "data": summary}));
                }
                let status = &summary["status"];
                eprintln!("berth: the build ended {}", text(status));
                Some(outcome_code(status).unwrap_or(EXIT_BUILD_FAILED))
            }
            "status" | "health" => {
                let v: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
                if self.json {
                    out!("{}", json!({"event": event, "seq": id, "data": v}));
                } else if event == "status" {
                    eprintln!("berth: build {}", text(&v["status"]));
                } else {
                    eprintln!(
                        "berth: node {} {}{}",
                        text(&v["node"]),
                        if v["healthy"] == true {
                            "healthy"
                        } else {
                            "unhealthy"
                        },
                        v["reason"]
                            .as_str()
                            .map(|r| format!(": {}", shown(r)))
                            .unwrap_or_default()
                    );
                }
                None
            }
            _ => None,
        }
    }

    async fn one_status(&self, id: &str) -> CommandResult {
        let d = self
            .call("GET", &format!("/v1/deployments/{}", path(id)), None, None)
            .await?;
        let builds = self
            .call(
                "GET",
                &format!("/v1/deployments/{}/builds?limit=10", path(id)),
                None,
                None,
            )
            .await?;
        if self.json {
            self.print_json(&json!({"deployment": d, "builds": builds["items"]}));
            return Ok(EXIT_OK);
        }
        out!(
            "{} {}  revision {}",
            text(&d["id"]),
            self.state(&text(&d["state"])),
            text(&d["revision"])
        );
        out!("domain: {}", text(&d["domain"]));
        out!(
            "automatic rollback: {}",
            if d["auto_rollback"] == true {
                "on"
            } else {
                "off"
            }
        );
        let actions: Vec<String> = d["actions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|a| match a["reason"].as_str() {
                Some(r) if a["enabled"] != true => {
                    format!("{} (no: {})", text(&a["name"]), shown(r))
                }
                _ => text(&a["name"]),
            })
            .collect();
        out!("actions: {}", actions.join(", "));
        out!("");
        self.builds_table(&builds["items"]);
        Ok(EXIT_OK)
    }

    fn builds_table(&self, items: &Value) {
        let rows: Vec<Vec<String>> = items
            .as_array()
            .into_iter()
            .flatten()
            .map(|b| {
                vec![
                    text(&b["id"]),
                    self.state(&text(&b["status"])),
                    text(&b["kind"]),
                    text(&b["trigger"]),
                    b["rollback_of"]
                        .as_str()
                        .map(|id| shown(&short(id)))
                        .unwrap_or_else(|| "-".into()),
                    b["worker"]
                        .as_str()
                        .map(shown)
                        .unwrap_or_else(|| "-".into()),
                    text(&b["created_at"]),
                ]
            })
            .collect();
        self.table(
            &[
                "BUILD",
                "STATUS",
                "KIND",
                "TRIGGER",
                "ROLLBACK TO",
                "WORKER",
                "CREATED",
            ],
            &rows,
        );
    }

    fn print_json(&self, v: &Value) {
        out!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    }

    /// A state word, coloured on a terminal without NO_COLOR.
    fn state(&self, s: &str) -> String {
        if !self.colour {
            return s.to_string();
        }
        let code = match s {
            "succeeded" | "active" | "healthy" => "32",
            "failed" | "cancelled" | "unhealthy" => "31",
            "running" | "queued" | "building" | "destroying" => "33",
            _ => return s.to_string(),
        };
        format!("\u{1b}[{code}m{s}\u{1b}[0m")
    }

    /// Columns padded to their widest cell (escape codes not counted).
    fn table(&self, head: &[&str], rows: &[Vec<String>]) {
        let visible = |s: &str| {
            let mut n = 0;
            let mut in_escape = false;
            for c in s.chars() {
                match (in_escape, c) {
                    (false, '\u{1b}') => in_escape = true,
                    (true, 'm') => in_escape = false,
                    (true, _) => {}
                    (false, _) => n += 1,
                }
            }
            n
        };
        let mut widths: Vec<usize> = head.iter().map(|h| h.len()).collect();
        for row in rows {
            for (i, cell) in row.iter().enumerate() {
                if let Some(w) = widths.get_mut(i) {
                    *w = (*w).max(visible(cell));
                }
            }
        }
        let line = |cells: Vec<String>| {
            let mut out = String::new();
            for (i, cell) in cells.iter().enumerate() {
                out.push_str(cell);
                if i + 1 < cells.len() {
                    let pad = widths[i].saturating_sub(visible(cell)) + 2;
                    out.push_str(&" ".repeat(pad));
                }
            }
            out!("{}", out.trim_end());
        };
        line(head.iter().map(|h| h.to_string()).collect());
        for row in rows {
            line(row.clone());
        }
    }
}

/// Where an SSE block ends (after its blank line).
fn find_block_end(bytes: &[u8]) -> Option<usize> {
    bytes.windows(2).position(|w| w == b"\n\n").map(|at| at + 2)
}

/// The token: `--token-file`, else `BERTH_TOKEN`, else the default file.
/// Never printed.
fn token(conn: &ClientArgs) -> Result<String, Stop> {
    if let Some(file) = &conn.token_file {
        return read_token(file);
    }
    if let Ok(t) = std::env::var("BERTH_TOKEN") {
        if !t.trim().is_empty() {
            return Ok(t.trim().to_string());
        }
    }
    read_token(&PathBuf::from(DEFAULT_TOKEN_FILE)).map_err(|_| {
        Stop::usage(format!(
            "no token: give --token-file, BERTH_TOKEN_FILE or BERTH_TOKEN (berth serve writes {DEFAULT_TOKEN_FILE})"
        ))
    })
}

fn read_token(file: &std::path::Path) -> Result<String, Stop> {
    std::fs::read_to_string(file)
        .map(|t| t.trim().to_string())
        .map_err(|e| {
            Stop::usage(format!(
                "cannot read the token file {}: {e}",
                file.display()
            ))
        })
}

/// A connection error without the URL's credentials or query.
fn describe(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timed out".into()
    } else if e.is_connect() {
        "the connection was refused or failed".into()
    } else {
        "the connection failed".into()
    }
}

/// A 4xx as cli.md prints it: code, reason, message, each field pointer.
fn refusal(status: u16, answer: &Value) -> Stop {
    let said = |v: &Value, otherwise: &str| v.as_str().map(shown).unwrap_or(otherwise.into());
    let mut message = format!(
        "refused ({status} {}): {}",
        text(&answer["code"]),
        said(&answer["message"], "no message")
    );
    if answer["reason"].is_string() {
        message.push_str(&format!("\n  reason: {}", said(&answer["reason"], "")));
    }
    if answer["deployer_message"].is_string() {
        let m = said(&answer["deployer_message"], "");
        message.push_str(&format!("\n  deployer: {m}"));
    }
    for f in answer["fields"].as_array().into_iter().flatten() {
        message.push_str(&format!(
            "\n  {}: {}",
            said(&f["pointer"], ""),
            said(&f["code"], "")
        ));
    }
    Stop {
        code: EXIT_REFUSED,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_from_the_server_are_shown_as_escapes() {
        assert_eq!(
            shown("a\x1b]0;pwned\x07b\tc\nd\x7f\u{9b}2J"),
            "a\\x1b]0;pwned\\x07b\tc\\x0ad\\x7f\\u{9b}2J"
        );
        assert_eq!(shown("alice.example.org"), "alice.example.org");
        assert_eq!(text(&json!("\x1b[2J")), "\\x1b[2J");
    }

    #[test]
    fn ids_are_one_path_segment() {
        assert_eq!(path("alice"), "alice");
        assert_eq!(path("../x y"), "..%2Fx%20y");
    }

    #[test]
    fn sse_blocks_end_at_a_blank_line() {
        assert_eq!(find_block_end(b"id: 1\ndata: x\n\nid: 2"), Some(15));
        assert_eq!(find_block_end(b"id: 1\ndata: x\n"), None);
    }
}
