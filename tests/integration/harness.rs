//! The real `berth` binary on a free loopback port with a temp data dir,
//! and small helpers to talk HTTP to it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

static NEXT: AtomicU32 = AtomicU32::new(0);

pub fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "berth-it-{}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst),
        tag
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// reqwest is built without a default TLS provider; tests install ring once.
pub fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

pub struct Server {
    pub dir: PathBuf,
    pub base: String,
    pub token: String,
    pub args: Vec<String>,
    pub envs: Vec<(String, String)>,
    pub group: Option<PathBuf>,
    child: Option<Child>,
    pub http: reqwest::Client,
    /// With `BERTH_TEST_CLUSTER=3`: the other replicas, the proxy and the
    /// database behind `base` (this server is the first replica, the leader).
    cluster: Option<ClusterFront>,
}

pub struct Options {
    pub args: Vec<String>,
    pub envs: Vec<(String, String)>,
    /// A process group (cgroup) berth starts in; its deployers inherit it.
    pub group: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            args: vec![],
            envs: vec![("BERTH_LOCAL_STEP_MS".into(), "0".into())],
            group: None,
        }
    }
}

impl Options {
    pub fn arg(mut self, a: &str) -> Self {
        self.args.push(a.to_string());
        self
    }
    /// Runs builds with this deployer instead of the embedded `local` one.
    pub fn deployer(self, path: &Path) -> Self {
        self.arg("--deployer")
            .arg(path.to_str().expect("a UTF-8 temp path"))
    }
    pub fn env(mut self, k: &str, v: &str) -> Self {
        self.envs.push((k.into(), v.into()));
        self
    }
    /// Starts berth inside `group`, so that everything it starts can be
    /// killed at one instant (a power cut).
    pub fn group(mut self, group: &Group) -> Self {
        self.group = Some(group.path.clone());
        self
    }
}

/// A cgroup of its own (v2, or v1's `pids` hierarchy): every process berth
/// starts (deployers in their own sessions included) stays in it, so a
/// power cut can end them all, as the machine's power does.
pub struct Group {
    pub path: PathBuf,
}

impl Group {
    /// Creates one, or says why it cannot (no writable cgroup file system).
    pub fn create(tag: &str) -> Result<Group, String> {
        let base = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            PathBuf::from("/sys/fs/cgroup")
        } else {
            PathBuf::from("/sys/fs/cgroup/pids")
        };
        let path = base.join(format!(
            "berth-it-{}-{}-{tag}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir(&path)
            .map_err(|e| format!("cannot create a cgroup at {}: {e}", path.display()))?;
        Ok(Group { path })
    }

    fn members(&self) -> Vec<i32> {
        std::fs::read_to_string(self.path.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// kill -9 to every member, until none is left (a member may fork while
    /// the others die).
    pub fn kill_all(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let members = self.members();
            if members.is_empty() {
                return;
            }
            for pid in members {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            assert!(
                Instant::now() < deadline,
                "processes of {} do not die",
                self.path.display()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Makes `command` start inside this group (before it runs anything).
    pub fn enter(&self, command: &mut Command) {
        enter_group(&self.path, command);
    }
}

fn enter_group(path: &Path, command: &mut Command) {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::process::CommandExt;
    let procs = std::ffi::CString::new(path.join("cgroup.procs").as_os_str().as_bytes())
        .expect("a cgroup path without NUL");
    // Between fork and exec only async-signal-safe calls: open and write
    // (no allocation). Writing "0" moves the writing process itself.
    unsafe {
        command.pre_exec(move || {
            let fd = nix::fcntl::open(
                procs.as_c_str(),
                nix::fcntl::OFlag::O_WRONLY,
                nix::sys::stat::Mode::empty(),
            )
            .map_err(std::io::Error::from)?;
            nix::unistd::write(&fd, b"0").map_err(std::io::Error::from)?;
            Ok(())
        });
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill_all();
        let _ = std::fs::remove_dir(&self.path);
    }
}

impl Server {
    /// One berth on a free port; with `BERTH_TEST_CLUSTER=3` in the
    /// environment, three replicas on a fresh PostgreSQL database behind a
    /// round-robin proxy, so a black-box suite runs unchanged against a
    /// cluster (`.ci/run` runs the suites that never restart berth so).
    pub async fn start(opts: Options) -> Server {
        if let Some(replicas) = cluster_replicas() {
            return Self::start_replicas(opts, replicas)
                .await
                .expect("BERTH_TEST_CLUSTER needs PostgreSQL on 127.0.0.1:5432");
        }
        Self::start_in(temp_dir("server"), opts).await
    }

    pub async fn start_in(dir: PathBuf, opts: Options) -> Server {
        let mut s = Server::unstarted(dir, opts);
        s.launch().await;
        s
    }

    /// One not started yet (`spawn` or `launch` start it).
    pub fn unstarted(dir: PathBuf, opts: Options) -> Server {
        std::fs::create_dir_all(&dir).unwrap();
        Server {
            dir,
            base: String::new(),
            token: String::new(),
            args: opts.args,
            envs: opts.envs,
            group: opts.group,
            child: None,
            http: client(),
            cluster: None,
        }
    }

    /// How the started binary exited, if it did.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Starts the binary (again) with the same data dir, on a port the
    /// kernel picks (`--listen 127.0.0.1:0`): berth writes the address it
    /// bound to `--address-file`, so no other process can take the port
    /// between choosing it and binding it.
    pub async fn launch(&mut self) {
        self.spawn();
        self.wait_ready().await;
    }

    /// Starts the binary without waiting for it (a cut during a start).
    pub fn spawn(&mut self) {
        let address_file = self.dir.join("address");
        let _ = std::fs::remove_file(&address_file);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_berth"));
        command.arg("serve");
        // A test that restarts berth on the port it had (a worker's --url)
        // gives its own --listen.
        if !self.args.iter().any(|a| a == "--listen") {
            command.arg("--listen").arg("127.0.0.1:0");
        }
        command
            .arg("--address-file")
            .arg(&address_file)
            .arg("--data-dir")
            .arg(self.dir.join("data"))
            .args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        if let Some(group) = &self.group {
            enter_group(group, &mut command);
        }
        self.child = Some(command.spawn().expect("start berth"));
    }

    /// Waits for a spawned binary to listen and be ready; reads its token.
    pub async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        self.wait_listening().await;
        loop {
            if let Ok(r) = self.http.get(format!("{}/readyz", self.base)).send().await {
                if r.status() == 200 {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "berth did not become ready; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits for a spawned binary to listen (ready or not); reads its token.
    pub async fn wait_listening(&mut self) {
        let address_file = self.dir.join("address");
        let deadline = Instant::now() + Duration::from_secs(30);
        let address = loop {
            if let Ok(text) = std::fs::read_to_string(&address_file) {
                break text.trim().to_string();
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "berth exited ({status}) before listening; log:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "berth did not listen; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        self.base = format!("http://{address}");
        self.token = std::fs::read_to_string(self.dir.join("data/service-token"))
            .unwrap()
            .trim()
            .to_string();
    }

    pub fn log(&self) -> String {
        let mut log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        for (i, replica) in self.cluster.iter().flat_map(|c| &c.replicas).enumerate() {
            log.push_str(&format!("\n--- replica {} ---\n{}", i + 1, replica.log()));
        }
        log
    }

    /// The running server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// The server's resident memory now (VmRSS), in KiB.
    pub fn rss_kib(&self) -> u64 {
        let pid = self.child.as_ref().expect("running").id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/<pid>/status")
    }

    /// kill -9.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then wait for the exit. A stop with a healthy disk closes
    /// the store cleanly (an export or `audit verify` right after must not
    /// find it half-closed), so its log never says otherwise.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(c.id().to_string())
            .status();
        let status = c.wait().unwrap();
        let log = self.log();
        assert!(
            !log.contains("the store was not closed cleanly"),
            "a stop left the store half-closed; log:\n{log}"
        );
        status
    }

    /// `GET /metrics` with the token.
    pub async fn metrics(&self) -> String {
        let r = self.get("/metrics").send().await.unwrap();
        r.text().await.unwrap()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.http.get(self.url(path)).bearer_auth(&self.token)
    }

    pub fn post(&self, path: &str, body: &Value) -> reqwest::RequestBuilder {
        self.http
            .post(self.url(path))
            .bearer_auth(&self.token)
            .json(body)
    }

    pub fn delete(&self, path: &str) -> reqwest::RequestBuilder {
        self.http.delete(self.url(path)).bearer_auth(&self.token)
    }

    pub async fn json(&self, path: &str) -> (u16, Value) {
        read(self.get(path).send().await.unwrap()).await
    }

    pub async fn submit(&self, id: &str, body: Value) -> (u16, Value) {
        read(
            self.post(&format!("/v1/deployments/{id}/submit"), &body)
                .send()
                .await
                .unwrap(),
        )
        .await
    }

    /// Submits and returns the new build id; panics unless 202.
    pub async fn submit_ok(&self, id: &str, config: Value) -> String {
        let (status, body) = self
            .submit(id, json!({"configuration": config, "mode": "enqueue"}))
            .await;
        assert_eq!(status, 202, "{body}\n{}", self.log());
        body["build_id"].as_str().unwrap().to_string()
    }

    /// As `submit_ok`, with `auto_rollback: false`: a test of what a failed
    /// deploy leaves behind, without the rollback that would follow it.
    pub async fn submit_ok_without_rollback(&self, id: &str, config: Value) -> String {
        let (status, body) = self
            .submit(
                id,
                json!({"configuration": config, "mode": "enqueue", "auto_rollback": false}),
            )
            .await;
        assert_eq!(
            status,
            202,
            "{body}
{}",
            self.log()
        );
        body["build_id"].as_str().unwrap().to_string()
    }

    pub async fn build(&self, id: &str) -> Value {
        let (status, b) = self.json(&format!("/v1/builds/{id}")).await;
        assert_eq!(status, 200, "{b}");
        b
    }

    /// Waits until the build has `status` (or any final status when "final").
    pub async fn wait_build(&self, id: &str, status: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let b = self.build(id).await;
            let s = b["status"].as_str().unwrap_or("");
            let done = if status == "final" {
                matches!(s, "succeeded" | "failed" | "cancelled")
            } else {
                s == status
            };
            if done {
                return b;
            }
            assert!(
                Instant::now() < deadline,
                "build {id} never reached {status}: {b}\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    pub async fn log_text(&self, build: &str) -> String {
        self.get(&format!("/v1/builds/{build}/log"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        // kill -9 leaves the deployers berth was running (each in its own
        // process group, working in the data dir): a test must not leave
        // them spinning on the machine.
        kill_groups_working_in(&self.dir);
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// SIGKILL to the process group of every process whose working directory
/// is under `dir`.
pub fn kill_groups_working_in(dir: &Path) {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in procs.flatten() {
        let inside =
            std::fs::read_link(entry.path().join("cwd")).is_ok_and(|cwd| cwd.starts_with(dir));
        if !inside {
            continue;
        }
        // Field 5 of stat (the third after the parenthesised name).
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let group = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().nth(2))
            .and_then(|g| g.parse::<i32>().ok());
        if let Some(group) = group.filter(|&g| g > 1) {
            let _ = Command::new("kill")
                .args(["-9", "--", &format!("-{group}")])
                .status();
        }
    }
}

pub async fn read(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

pub fn mastodon(domain: &str) -> Value {
    json!({"domain": domain, "applications": {"mastodon": {"enable": true}}})
}

/// A test deployer: a shell script, made executable.
pub fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// describe/eval answers every scripted deployer shares.
pub const SCRIPT_PRELUDE: &str = r#"
verb="$1"
dep=$(basename "$BERTH_WORK_DIR")
case "$verb" in
describe) cat >/dev/null; printf '%s' '{"methods":["local"],"default_method":"local","actions":{"suspend":["local"],"resume":["local"]},"catalog":[],"schema":null}' > "$BERTH_RESULT"; exit 0;;
eval) cat >/dev/null; printf '%s' '{"nodes":[]}' > "$BERTH_RESULT"; exit 0;;
esac
cat >/dev/null
"#;

/// A deployer whose builds wait until `<gates>/<deployment>` exists (the
/// file is removed as the build passes, so each build needs its own open).
pub fn gated_deployer(dir: &Path) -> (PathBuf, PathBuf) {
    let gates = dir.join("gates");
    std::fs::create_dir_all(&gates).unwrap();
    let body = format!(
        "{SCRIPT_PRELUDE}\necho \"start $verb $dep\"\necho \"$verb\" >> {g}/$dep.log\nwhile [ ! -e {g}/$dep ]; do sleep 0.02; done\nrm -f {g}/$dep\necho \"end $verb $dep\"\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"\n",
        g = gates.display()
    );
    (script(dir, "gated.sh", &body), gates)
}

/// A server on a gated deployer (`--cancel-grace 1s`, so a restart stops
/// an orphaned deployer fast) with one build of `deployment` running:
/// the server, its gates and the running build's id.
pub async fn server_with_a_running_build(
    name: &str,
    deployment: &str,
) -> (Server, PathBuf, String) {
    let dir = temp_dir(name);
    let (deployer, gates) = gated_deployer(&dir);
    let s = Server::start_in(
        dir,
        Options::default()
            .deployer(&deployer)
            .arg("--cancel-grace")
            .arg("1s"),
    )
    .await;
    let running = s.submit_ok(deployment, json!({"n": 1})).await;
    s.wait_build(&running, "running").await;
    (s, gates, running)
}

pub fn open_gate(gates: &Path, deployment: &str) {
    std::fs::write(gates.join(deployment), b"").unwrap();
}

pub async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// One parsed server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub id: Option<u64>,
    pub event: String,
    pub data: String,
}

/// One block of a `text/event-stream` (None for a comment-only block).
pub fn parse_event(block: &str) -> Option<SseEvent> {
    let mut ev = SseEvent {
        id: None,
        event: "message".into(),
        data: String::new(),
    };
    let mut has_data = false;
    for line in block.lines() {
        if let Some(v) = line.strip_prefix("id: ") {
            ev.id = v.parse().ok();
        } else if let Some(v) = line.strip_prefix("event: ") {
            ev.event = v.to_string();
        } else if let Some(v) = line.strip_prefix("data: ") {
            if has_data {
                ev.data.push('\n');
            }
            ev.data.push_str(v);
            has_data = true;
        }
    }
    has_data.then_some(ev)
}

/// A minimal `text/event-stream` reader.
pub struct Sse {
    resp: reqwest::Response,
    buf: String,
    pub comments: usize,
}

impl Sse {
    pub async fn open(req: reqwest::RequestBuilder) -> Sse {
        match Sse::try_open(req).await {
            Ok(sse) => sse,
            Err((status, body)) => panic!("stream refused: {status} {body}"),
        }
    }

    /// The stream, or the status and body it was refused with.
    pub async fn try_open(req: reqwest::RequestBuilder) -> Result<Sse, (u16, String)> {
        let resp = req.send().await.unwrap();
        if resp.status() != 200 {
            let status = resp.status().as_u16();
            return Err((status, resp.text().await.unwrap_or_default()));
        }
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        Ok(Sse {
            resp,
            buf: String::new(),
            comments: 0,
        })
    }

    /// The next event, or None when the server closed the stream.
    pub async fn next(&mut self) -> Option<SseEvent> {
        loop {
            while let Some(end) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..end + 2).collect();
                self.comments += block.lines().filter(|l| l.starts_with(':')).count();
                if let Some(ev) = parse_event(&block) {
                    return Some(ev);
                }
            }
            let chunk = tokio::time::timeout(Duration::from_secs(30), self.resp.chunk())
                .await
                .expect("stream stalled");
            match chunk {
                Ok(Some(bytes)) => self.buf.push_str(&String::from_utf8_lossy(&bytes)),
                _ => return None,
            }
        }
    }

    /// Waits (up to `limit`) for a `: keep-alive` comment, and consumes
    /// the stream up to its end (a second call waits for the next one).
    pub async fn wait_comment(&mut self, limit: Duration) -> bool {
        const COMMENT: &str = ": keep-alive\n\n";
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(at) = self.buf.find(COMMENT) {
                self.buf.drain(..at + COMMENT.len());
                return true;
            }
            match tokio::time::timeout(Duration::from_millis(500), self.resp.chunk()).await {
                Ok(Ok(Some(bytes))) => self.buf.push_str(&String::from_utf8_lossy(&bytes)),
                Ok(_) => return false,
                Err(_) => {}
            }
        }
        false
    }

    /// Every event until the stream ends (the `end` event included).
    pub async fn until_end(&mut self) -> Vec<SseEvent> {
        let mut out = vec![];
        while let Some(e) = self.next().await {
            let done = e.event == "end";
            out.push(e);
            if done {
                break;
            }
        }
        out
    }
}

/// A test that cannot run here says so where a person sees it (straight to
/// stderr, past the test harness's capture) and in the file named by
/// `BERTH_SKIPPED_FILE`, which `.ci/run` counts in its summary. It never
/// passes silently: in CI (`CI=true`, as `.ci/run` runs, which installs
/// what every test needs) it fails, naming what is missing.
pub fn skip(test: &str, why: &str) {
    use std::io::Write;
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test} cannot run on this machine: {why}. In CI (CI=true) a test that cannot run fails: install what it names (.ci/run does)"
    );
    let line = format!("skipped: {test}: {why}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Ok(path) = std::env::var("BERTH_SKIPPED_FILE") {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// What a `json_server` answers a request body with: a status and a body.
pub type JsonHandler = std::sync::Arc<dyn Fn(Value) -> (u16, Value) + Send + Sync>;

/// A tiny HTTP/1.1 JSON endpoint on a free loopback port (a test's
/// authorization callback or witness sink): each POST body goes to
/// `handler`. Returns its URL; aborting the handle takes it down.
pub async fn json_server(handler: JsonHandler) -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let handler = handler.clone();
            tokio::spawn(async move {
                let Some((_, body)) = read_request(&mut sock).await else {
                    return;
                };
                let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let (status, answer) = handler(body);
                let text = answer.to_string();
                let response = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                    text.len()
                );
                let _ = sock.write_all(response.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    (url, task)
}

/// One HTTP/1.1 request read from `sock`: its head (request line and
/// headers, as text) and its body (by `content-length`); `None` when the
/// peer closes first.
pub async fn read_request(sock: &mut tokio::net::TcpStream) -> Option<(String, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let (head_end, length) = loop {
        let n = sock.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            break (end + 4, length);
        }
    };
    while buf.len() < head_end + length {
        let n = sock.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    Some((head, buf[head_end..head_end + length].to_vec()))
}

/// Runs `berth <args>` and returns (exit code, stdout).
/// Copies the files of a directory (not its subdirectories).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// `berth audit verify --json` on `data`: its exit code and report.
pub fn verify_json(data: &Path) -> (i32, serde_json::Value) {
    let (code, out) = berth(&[
        "audit",
        "verify",
        "--json",
        "--data-dir",
        data.to_str().unwrap(),
    ]);
    let report: serde_json::Value =
        serde_json::from_str(out.trim()).unwrap_or_else(|_| panic!("not JSON: {out}"));
    (code, report)
}

/// The snapshot files in `data`/snapshots (the socket aside).
pub fn snapshots_left(data: &Path) -> Vec<String> {
    std::fs::read_dir(data.join("snapshots"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "berth.sock")
        .collect()
}

pub fn berth(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(args)
        .output()
        .expect("run berth");
    // Shown with a failing test's output.
    eprintln!(
        "berth {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

pub const PG_ADMIN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test";

/// A database of its own on the real PostgreSQL, dropped at the end.
pub struct PgDb {
    pub name: String,
}

impl PgDb {
    /// None (and a visible skip) when no PostgreSQL answers here.
    pub async fn create(test: &str) -> Option<PgDb> {
        let admin = match pg(PG_ADMIN).await {
            Ok(c) => c,
            Err(e) => {
                skip(test, &format!("no PostgreSQL on 127.0.0.1:5432 ({e})"));
                return None;
            }
        };
        static NEXT_DB: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let name = format!(
            "berth_it_{}_{}",
            std::process::id(),
            NEXT_DB.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        );
        // One statement per call: CREATE DATABASE refuses a transaction block.
        for sql in [
            format!("DROP DATABASE IF EXISTS {name}"),
            format!("CREATE DATABASE {name}"),
        ] {
            admin.batch_execute(&sql).await.unwrap();
        }
        Some(PgDb { name })
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:5432/{}", self.name)
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        pg(&format!(
            "host=127.0.0.1 port=5432 user=postgres dbname={}",
            self.name
        ))
        .await
        .unwrap()
    }
}

impl Drop for PgDb {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .args(["-h", "127.0.0.1", "-U", "postgres", "-d", "test", "-qc"])
            .arg(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .output();
    }
}

pub async fn pg(conn: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(conn, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// How many replicas `Server::start` runs (`BERTH_TEST_CLUSTER`), if any.
fn cluster_replicas() -> Option<usize> {
    let n: usize = std::env::var("BERTH_TEST_CLUSTER").ok()?.parse().ok()?;
    assert!(
        (2..=5).contains(&n),
        "BERTH_TEST_CLUSTER is 2 to 5 replicas"
    );
    Some(n)
}

/// What a cluster-mode `Server` stands for: replicas, the proxy in front
/// of them (the `Server`'s `base`) and their database.
struct ClusterFront {
    replicas: Vec<Server>,
    backends: Backends,
    proxy: tokio::task::JoinHandle<()>,
    db: PgDb,
}

impl Drop for ClusterFront {
    fn drop(&mut self) {
        self.proxy.abort();
    }
}

/// The replicas' addresses a round-robin proxy hands connections to.
pub type Backends = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

impl Server {
    /// `replicas` replicas of the binary on a fresh PostgreSQL database
    /// (`--lease-ttl 5s` unless `opts` says otherwise) behind a
    /// round-robin proxy: the `Server` returned talks to the proxy, a new
    /// connection per request, so consecutive requests reach different
    /// replicas. Its `dir` is the first replica's (the token, the secrets).
    /// None (and a visible skip) when no PostgreSQL answers here.
    pub async fn start_replicas(opts: Options, replicas: usize) -> Option<Server> {
        let test = std::thread::current()
            .name()
            .unwrap_or("cluster")
            .to_string();
        let db = PgDb::create(&test).await?;
        let mut args = [opts.args.clone(), vec!["--store".into(), db.url()]].concat();
        if !args.iter().any(|a| a == "--lease-ttl") {
            args.extend(["--lease-ttl".into(), "5s".into()]);
        }
        let with_store = || Options {
            args: args.clone(),
            envs: opts.envs.clone(),
            group: opts.group.clone(),
        };
        let first = Server::start_in(temp_dir("replica"), with_store()).await;
        let mut started = vec![first];
        for _ in 1..replicas {
            let dir = temp_dir("replica");
            let data = dir.join("data");
            std::fs::create_dir_all(&data).unwrap();
            for name in SHARED_SECRETS {
                std::fs::copy(started[0].dir.join("data").join(name), data.join(name)).unwrap();
            }
            started.push(Server::start_in(dir, with_store()).await);
        }
        let backends: Backends = std::sync::Arc::new(std::sync::Mutex::new(
            started.iter().map(|r| r.base.clone()).collect(),
        ));
        let (base, proxy) = round_robin_proxy(backends.clone()).await;
        let mut front = Server::unstarted(started[0].dir.clone(), Options::default());
        front.base = base;
        front.token = started[0].token.clone();
        front.http = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        front.cluster = Some(ClusterFront {
            replicas: started,
            backends,
            proxy,
            db,
        });
        front.wait_for_replicas(replicas).await;
        Some(front)
    }

    /// Waits until `GET /v1/cluster` lists `n` replicas on PostgreSQL.
    async fn wait_for_replicas(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            // A replica with a low --max-connections may close one.
            let cluster = match self.get("/v1/cluster").send().await {
                Ok(answer) => read(answer).await.1,
                Err(_) => Value::Null,
            };
            let listed = cluster["replicas"].as_array().map_or(0, |r| r.len());
            if cluster["store"] == "postgres" && listed == n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster never listed {n} replicas: {cluster}\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The cluster's database URL (cluster mode only).
    pub fn store_url(&self) -> String {
        self.cluster.as_ref().expect("a cluster").db.url()
    }

    /// kill -9 of the replica that leads; once another has taken over,
    /// the killed one starts again (a standby now).
    pub async fn kill_leader(&mut self) {
        let (_, view) = self.json("/v1/cluster").await;
        let leader = view["replica"].as_str().expect("a leader's id").to_string();
        let front = self.cluster.as_mut().expect("a cluster");
        let index = front
            .replicas
            .iter()
            .position(|r| {
                std::fs::read_to_string(r.dir.join("data/replica-id"))
                    .is_ok_and(|id| id.trim() == leader)
            })
            .unwrap_or_else(|| panic!("no replica has the leader's id {leader}"));
        front.replicas[index].kill();
        let survivor = &front.replicas[(index + 1) % front.replicas.len()];
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            // Its pooled connections were joined to the killed leader: an
            // error on one is not an answer.
            let view = match survivor.get("/v1/cluster").send().await {
                Ok(answer) => read(answer).await.1,
                Err(_) => Value::Null,
            };
            if view["replica"].as_str().is_some_and(|r| r != leader) {
                break;
            }
            assert!(Instant::now() < deadline, "no replica took over: {view}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let replica = &mut front.replicas[index];
        replica.launch().await;
        front.backends.lock().unwrap()[index] = replica.base.clone();
    }
}

/// The files every replica of one cluster holds alike (cluster.md).
pub const SHARED_SECRETS: [&str; 4] = [
    "service-token",
    "cursor-key",
    "callback-secret",
    "audit-signing.key",
];

/// A TCP proxy on a free loopback port handing each new connection to the
/// next of `backends` (`http://host:port`) in turn. Returns its base URL.
pub async fn round_robin_proxy(backends: Backends) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let mut next = 0;
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                continue;
            };
            let addr = {
                let backends = backends.lock().unwrap();
                backends[next % backends.len()]
                    .trim_start_matches("http://")
                    .to_string()
            };
            next += 1;
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(&addr).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    (base, task)
}
