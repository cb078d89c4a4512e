//! One deployer process: spawn it in its own process group with the protocol
//! environment, capture its output line by line, stop it on cancel or
//! timeout, and read its result file with limits.
//!
//! This is the only code that starts or signals processes.

use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{mpsc, watch};

use crate::model::Job;

/// A log line longer than this is split into several lines (events.md).
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// A result file larger than this is a protocol error (deployer.md).
pub const MAX_RESULT_BYTES: u64 = 1024 * 1024;
/// After the deployer exits, how long its output pipes may stay open.
const PIPE_DRAIN_LIMIT: Duration = Duration::from_secs(5);

/// How to run the deployer: a program and the arguments before the verb.
#[derive(Debug, Clone)]
pub struct DeployerCommand {
    pub program: PathBuf,
    pub prefix: Vec<OsString>,
    /// (uid, gid) to run as, from `--deployer-user`.
    pub run_as: Option<(u32, u32)>,
    /// For a deployer built into this binary: the `BERTH_*` prefix of the
    /// knobs it is given (`BERTH_LOCAL_`, `BERTH_NIX_`); every other
    /// `BERTH_*` variable is withheld from every deployer.
    pub knobs: Option<&'static str>,
}

/// `--deployer` values naming a deployer built into this binary:
/// (value, `berth deployer <name>`, its knob prefix).
const BUILT_IN: &[(&str, &str, &str)] = &[
    ("builtin:local", "local", "BERTH_LOCAL_"),
    ("builtin:nix", "nix", "BERTH_NIX_"),
];

impl DeployerCommand {
    /// `--deployer` when given (an executable, or `builtin:local` /
    /// `builtin:nix`), else this binary's `deployer local`.
    pub fn from_setting(deployer: Option<&Path>, user: Option<&str>) -> Result<Self, String> {
        let run_as = match user {
            None => None,
            Some(name) => {
                if !nix::unistd::Uid::effective().is_root() {
                    return Err("--deployer-user needs berth to run as root".into());
                }
                let u = nix::unistd::User::from_name(name)
                    .map_err(|e| format!("--deployer-user: cannot look up users: {e}"))?
                    .ok_or_else(|| format!("--deployer-user: no user named {name:?}"))?;
                Some((u.uid.as_raw(), u.gid.as_raw()))
            }
        };
        let built_in = deployer.and_then(|p| {
            BUILT_IN
                .iter()
                .find(|(value, _, _)| p.as_os_str() == *value)
        });
        let (program, prefix, knobs) = match (deployer, built_in) {
            (Some(p), None) => (p.to_path_buf(), vec![], None),
            // No --deployer: the built-in local one.
            (_, built) => {
                let (_, name, knobs) = built.copied().unwrap_or(BUILT_IN[0]);
                (
                    std::env::current_exe()
                        .map_err(|e| format!("cannot find this executable: {e}"))?,
                    vec!["deployer".into(), name.into()],
                    Some(knobs),
                )
            }
        };
        Ok(Self {
            program,
            prefix,
            run_as,
            knobs,
        })
    }
}

/// One call of the deployer.
pub struct Invocation {
    pub verb: &'static str,
    pub request: Vec<u8>,
    pub work_dir: PathBuf,
    pub scratch_dir: PathBuf,
    pub result_path: PathBuf,
}

/// A started deployer, held at its gate until `start` (see `spawn`).
pub struct Spawned {
    child: Child,
    pub job: Job,
    /// The gate: the write end of the deployer's stdin and the request to
    /// write into it after `GATE_OPEN`. Dropping it without `start` closes
    /// the stdin, and the gate exits without running the deployer.
    gate: Option<(ChildStdin, Vec<u8>)>,
}

impl Spawned {
    /// Lets the deployer run: called once its job record is committed.
    /// `GATE_OPEN` and then the request go to its stdin on a task of their
    /// own (a deployer may write before it reads). A deployer that exited
    /// meanwhile is told by its exit status, as any other.
    pub fn start(&mut self) {
        if let Some((mut stdin, request)) = self.gate.take() {
            tokio::spawn(async move {
                if stdin.write_all(GATE_OPEN).await.is_ok() {
                    let _ = stdin.write_all(&request).await;
                }
                let _ = stdin.shutdown().await;
            });
        }
    }

    /// Keeps the deployer from ever running (its job could not be stored).
    pub fn abandon(&mut self) {
        self.gate = None;
    }
}

/// What the gate reads from stdin before it runs the deployer.
const GATE_OPEN: &[u8] = b"go\n";
/// Exit status of a gate that was closed without `go` (berth died, or the
/// job record could not be stored): the deployer never ran.
pub const GATE_CLOSED_EXIT: i32 = 97;
/// The gate: `/bin/sh` reads `go` from stdin and becomes the deployer
/// (`exec`: same pid, same process group, same start time, the same stdin
/// with the request next). A shell's `read` takes a pipe one byte at a
/// time so as to leave what follows the line unread (dash, bash and
/// busybox's ash alike), so the deployer reads exactly the request
/// (`tests::a_deployer_waits_at_its_gate` checks the bytes).
const GATE_SCRIPT: &str =
    "umask 022; IFS= read -r go && [ \"$go\" = go ] || exit 97; exec \"$0\" \"$@\"";

/// The environment a deployer sees: berth's own minus every `BERTH_*`
/// variable (flag values may hold secrets; deployer.md). A built-in
/// deployer also gets its own knobs (`BERTH_LOCAL_*`, `BERTH_NIX_*`).
fn deployer_env(knobs: Option<&str>) -> Vec<(OsString, OsString)> {
    std::env::vars_os()
        .filter(|(k, _)| {
            let k = k.to_string_lossy();
            !k.starts_with("BERTH_") || knobs.is_some_and(|prefix| k.starts_with(prefix))
        })
        .collect()
}

/// Starts the deployer behind a gate: the process exists (its pid, start
/// time and group are known and can be committed as the build's job) but
/// runs nothing of the deployer until `Spawned::start`. A crash of berth in
/// between closes the gate and the process exits: recovery never meets a
/// deployer whose job was not stored.
pub fn spawn(cmd: &DeployerCommand, inv: &Invocation) -> std::io::Result<Spawned> {
    // The gate's shell would start even when the deployer cannot: say so
    // here, as a spawn error, rather than as the shell's exit status.
    nix::unistd::access(&cmd.program, nix::unistd::AccessFlags::X_OK).map_err(|e| {
        std::io::Error::new(
            std::io::Error::from(e).kind(),
            format!("{} is not an executable file", cmd.program.display()),
        )
    })?;
    // The gate is the deployer's stdin, not a descriptor of its own: a
    // command with no `pre_exec` step (and no uid) is started with
    // posix_spawn, which does not copy berth's page tables as fork does.
    // With berth's page cache resident, each fork copied them and made
    // every thread fault on its next write to a shared page: about 15% of
    // berth's CPU samples where each submit ran a build (the webhook
    // bench).
    let mut command = Command::new(GATE_SHELL);
    command.arg("-c").arg(GATE_SCRIPT).arg(&cmd.program);
    if let Some((uid, gid)) = cmd.run_as {
        // The deployer owns its own dirs and nothing else of the data dir.
        // The result file's own directory (never the call's root: a
        // deployer that owned the root could swap its dirs for symlinks).
        let result_dir = inv
            .result_path
            .parent()
            .unwrap_or(&inv.scratch_dir)
            .to_path_buf();
        for dir in [&inv.work_dir, &inv.scratch_dir, &result_dir] {
            std::os::unix::fs::chown(dir, Some(uid), Some(gid))?;
        }
        command.uid(uid).gid(gid);
    }
    command
        .args(&cmd.prefix)
        .arg(inv.verb)
        .env_clear()
        .envs(deployer_env(cmd.knobs))
        .env("BERTH_RESULT", &inv.result_path)
        .env("BERTH_WORK_DIR", &inv.work_dir)
        .env("BERTH_SCRATCH_DIR", &inv.scratch_dir)
        .current_dir(&inv.scratch_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(false);
    let mut child = command.spawn()?;
    // The deployer waits at its gate, so it is alive here: a missing pid or
    // start time is an error, never a 0 stored as if it were one (recovery
    // would then not recognise the group).
    let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) else {
        let _ = child.start_kill();
        return Err(std::io::Error::other("the deployer has no process id"));
    };
    let Some(start_ticks) = process_start_ticks(pid) else {
        signal_group(pid, Signal::SIGKILL);
        return Err(std::io::Error::other(
            "the deployer's start time could not be read from /proc",
        ));
    };
    let job = Job { pid, start_ticks };
    let Some(stdin) = child.stdin.take() else {
        signal_group(pid, Signal::SIGKILL);
        return Err(std::io::Error::other("the deployer has no stdin pipe"));
    };
    Ok(Spawned {
        child,
        job,
        gate: Some((stdin, inv.request.clone())),
    })
}

/// The shell that runs the gate (POSIX `sh`; present on every Linux,
/// NixOS included).
const GATE_SHELL: &str = "/bin/sh";

/// Field 22 of /proc/<pid>/stat (start time in clock ticks since boot).
pub fn process_start_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// Whether `job`'s process group may still hold a deployer of ours: its
/// leader is the same process (pid and start time), or no process has the
/// leader's pid any more and the group still has members (a group outlives
/// its leader, and its id cannot be given to a new process while any
/// member lives). A pid that now belongs to another process means the old
/// group is empty.
pub fn group_may_be_ours(job: &Job) -> bool {
    if job.pid <= 0 {
        return false;
    }
    match process_start_ticks(job.pid) {
        Some(ticks) => ticks == job.start_ticks,
        None => group_alive(job.pid),
    }
}

/// True when `job`'s leader is still the very process (pid and start
/// time) on this machine.
pub fn same_process(job: &Job) -> bool {
    job.pid > 0 && process_start_ticks(job.pid) == Some(job.start_ticks)
}

pub fn signal_group(pgid: i32, signal: Signal) {
    if pgid > 0 {
        let _ = killpg(Pid::from_raw(pgid), signal);
    }
}

/// True while any process of the group is alive.
pub fn group_alive(pgid: i32) -> bool {
    pgid > 0 && killpg(Pid::from_raw(pgid), None).is_ok()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Exit(i32),
    Signal(i32),
    /// The process ended but its status could not be read (the wait
    /// failed, or neither a code nor a signal).
    StatusUnknown,
    Timeout,
    Cancelled,
}

/// Waits for the deployer, sending its output lines to `lines`; stops it on
/// timeout or cancel (SIGTERM to the group, then SIGKILL after `grace`), and
/// at the end kills whatever is left in its process group.
pub async fn wait(
    mut spawned: Spawned,
    timeout: Option<Duration>,
    grace: Duration,
    mut cancel: watch::Receiver<bool>,
    lines: mpsc::Sender<Lines>,
) -> Ended {
    let pgid = spawned.job.pid;
    let readers = [
        spawned
            .child
            .stdout
            .take()
            .map(|s| tokio::spawn(read_lines(s, lines.clone()))),
        spawned
            .child
            .stderr
            .take()
            .map(|s| tokio::spawn(read_lines(s, lines.clone()))),
    ];
    drop(lines);
    let deadline = async {
        match timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    let cancelled = async {
        loop {
            if *cancel.borrow_and_update() {
                return;
            }
            if cancel.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    };
    let mut stopped_by = None;
    let status = tokio::select! {
        s = spawned.child.wait() => s.ok(),
        _ = deadline => { stopped_by = Some(Ended::Timeout); None }
        _ = cancelled => { stopped_by = Some(Ended::Cancelled); None }
    };
    let status = match status {
        Some(s) => Some(s),
        None => {
            signal_group(pgid, Signal::SIGTERM);
            match tokio::time::timeout(grace, spawned.child.wait()).await {
                Ok(s) => s.ok(),
                Err(_) => {
                    signal_group(pgid, Signal::SIGKILL);
                    spawned.child.wait().await.ok()
                }
            }
        }
    };
    // No stray child outlives its build.
    signal_group(pgid, Signal::SIGKILL);
    for reader in readers.into_iter().flatten() {
        let abort = reader.abort_handle();
        if tokio::time::timeout(PIPE_DRAIN_LIMIT, reader)
            .await
            .is_err()
        {
            abort.abort();
        }
    }
    if let Some(by) = stopped_by {
        return by;
    }
    use std::os::unix::process::ExitStatusExt;
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(code), _) => Ended::Exit(code),
            (None, Some(sig)) => Ended::Signal(sig),
            (None, None) => Ended::StatusUnknown,
        },
        None => Ended::StatusUnknown,
    }
}

/// Splits output into lines at LF, CRLF or a lone CR (a progress bar's
/// redraw becomes its own line, so every line is one SSE `data:` line), or
/// at `MAX_LINE_BYTES` on a character boundary; replaces invalid UTF-8; a
/// last line without newline is kept.
pub async fn read_lines<R: AsyncRead + Unpin>(mut reader: R, out: mpsc::Sender<Lines>) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut line: Vec<u8> = Vec::with_capacity(1024);
    // The previous line ended with CR: an LF right after it is the same break.
    let mut skip_lf = false;
    loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // All lines of one read go out together: one channel operation.
        let mut batch = Lines::default();
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            if skip_lf {
                skip_lf = false;
                if rest[0] == b'\n' {
                    rest = &rest[1..];
                    continue;
                }
            }
            let room = MAX_LINE_BYTES - line.len();
            let window = &rest[..rest.len().min(room)];
            match memchr::memchr2(b'\n', b'\r', window) {
                Some(i) => {
                    skip_lf = window[i] == b'\r';
                    if line.is_empty() {
                        // The whole line is in this read: no copy of it
                        // before the batch's.
                        batch.push(&window[..i]);
                    } else {
                        line.extend_from_slice(&window[..i]);
                        batch.push(&line);
                        line.clear();
                    }
                    rest = &rest[i + 1..];
                }
                None => {
                    line.extend_from_slice(window);
                    rest = &rest[window.len()..];
                    if line.len() >= MAX_LINE_BYTES {
                        let carry = incomplete_utf8_tail(&line);
                        let tail = line.split_off(line.len() - carry);
                        batch.push(&line);
                        line = tail;
                    }
                }
            }
        }
        if !batch.is_empty() && out.send(batch).await.is_err() {
            return;
        }
    }
    if !line.is_empty() {
        let mut last = Lines::default();
        last.push(&line);
        let _ = out.send(last).await;
    }
}

/// The lines of one read, in one buffer: no allocation per line.
#[derive(Debug, Default)]
pub struct Lines {
    text: String,
    /// Where each line ends in `text`.
    ends: Vec<usize>,
}

impl Lines {
    /// Adds a line; invalid UTF-8 is repaired with U+FFFD (valid text,
    /// nearly every line, takes the fast check).
    fn push(&mut self, line: &[u8]) {
        match std::str::from_utf8(line) {
            Ok(text) => self.text.push_str(text),
            Err(_) => self.text.push_str(&String::from_utf8_lossy(line)),
        }
        self.ends.push(self.text.len());
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Lines berth writes into a build's log itself (and a short call's
    /// kept output); a line break inside one is written as a space, so each
    /// stays one line.
    pub fn of<'a>(lines: impl IntoIterator<Item = &'a str>) -> Lines {
        let mut out = Lines::default();
        for line in lines {
            out.push(line.replace(['\n', '\r'], " ").as_bytes());
        }
        out
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let line = &self.text[start..end];
            start = end;
            line
        })
    }
}

/// How many bytes at the end of `bytes` start a UTF-8 character that is
/// not complete yet (0 to 3).
fn incomplete_utf8_tail(bytes: &[u8]) -> usize {
    match std::str::from_utf8(bytes) {
        Ok(_) => 0,
        Err(e) if e.error_len().is_none() => bytes.len() - e.valid_up_to(),
        Err(_) => {
            // Invalid bytes somewhere; look only at the last three.
            let start = bytes.len().saturating_sub(3);
            match std::str::from_utf8(&bytes[start..]) {
                Err(e) if e.error_len().is_none() => bytes.len() - start - e.valid_up_to(),
                _ => 0,
            }
        }
    }
}

/// The directories of one deployer call under its own root, which berth
/// owns: the deployer owns `scratch/` and `result/` (with
/// `--deployer-user`), never the root, so it cannot swap either directory
/// for a symlink; berth opens them with `O_NOFOLLOW` and every file beneath
/// them with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`.
pub struct CallDirs {
    pub root: PathBuf,
    pub scratch: PathBuf,
    pub result_path: PathBuf,
}

/// Where the deployer writes its result, under the call's root.
const RESULT_DIR: &str = "result";
const RESULT_FILE: &str = "result.json";
const SCRATCH_DIR: &str = "scratch";

impl CallDirs {
    /// Makes `root/scratch` and `root/result` (removing what a crashed
    /// earlier call left). The root is 0711 whatever berth's file mask: a
    /// deployer run as another user passes through it to the two dirs it
    /// is given, and lists nothing.
    pub fn create(root: PathBuf) -> std::io::Result<CallDirs> {
        use std::os::unix::fs::PermissionsExt;
        match std::fs::remove_dir_all(&root) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            Ok(()) | Err(_) => {}
        }
        let scratch = root.join(SCRATCH_DIR);
        std::fs::create_dir_all(&root)?;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o711))?;
        std::fs::create_dir(&scratch)?;
        std::fs::create_dir(root.join(RESULT_DIR))?;
        Ok(CallDirs {
            result_path: root.join(RESULT_DIR).join(RESULT_FILE),
            scratch,
            root,
        })
    }
}

/// Reads the result file of the call rooted at `root`: `Ok(None)` when
/// missing, `Err` when too big, not a regular file, or reached through a
/// symlink.
pub fn read_result(root: &Path) -> Result<Option<Vec<u8>>, String> {
    match open_beneath(&root.join(RESULT_DIR), RESULT_FILE, MAX_RESULT_BYTES) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(OpenError::Missing) => Ok(None),
        Err(OpenError::Refused(why)) => Err(why),
    }
}

/// Reads `rel` beneath the scratch dir of the call rooted at `root`.
pub fn open_in_scratch(root: &Path, rel: &str, limit: u64) -> Result<Vec<u8>, OpenError> {
    open_beneath(&root.join(SCRATCH_DIR), rel, limit)
}

#[derive(Debug)]
pub enum OpenError {
    Missing,
    Refused(String),
}

/// Opens `rel` beneath the directory `dir` only: `dir` itself must not be a
/// symlink (`O_NOFOLLOW`), and `rel` is resolved by the kernel beneath it
/// with no symlink anywhere (`openat2`, or `openat` per component with
/// `O_NOFOLLOW` where the kernel lacks openat2); a regular file, at most
/// `limit` bytes.
pub fn open_beneath(dir: &Path, rel: &str, limit: u64) -> Result<Vec<u8>, OpenError> {
    use nix::errno::Errno;
    use nix::fcntl::{open, openat2, OFlag, OpenHow, ResolveFlag};
    use nix::sys::stat::Mode;

    let rel_path = Path::new(rel);
    if rel.is_empty()
        || rel_path
            .components()
            .any(|c| !matches!(c, Component::Normal(_)))
    {
        return Err(OpenError::Refused("the path leaves the scratch dir".into()));
    }
    let dir_fd = match open(
        dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Err(OpenError::Missing),
        Err(_) => {
            return Err(OpenError::Refused(
                "the deployer's directory was replaced (not a directory, or a symlink)".into(),
            ))
        }
    };
    let file_flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    let how = OpenHow::new()
        .flags(file_flags)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
    let opened = match openat2(&dir_fd, rel_path, how) {
        Err(Errno::ENOSYS) => open_per_component(&dir_fd, rel_path, file_flags),
        other => other,
    };
    let fd = match opened {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Err(OpenError::Missing),
        Err(Errno::ELOOP) => {
            return Err(OpenError::Refused("the path goes through a symlink".into()))
        }
        Err(Errno::EXDEV) => {
            return Err(OpenError::Refused("the path leaves the scratch dir".into()))
        }
        Err(_) => {
            return Err(OpenError::Refused(
                "the file cannot be opened (not a regular file?)".into(),
            ))
        }
    };
    read_regular(std::fs::File::from(fd), limit)
}

/// `openat` one component at a time, each with `O_NOFOLLOW` (kernels
/// before 5.6 have no openat2).
fn open_per_component(
    dir: &std::os::fd::OwnedFd,
    rel: &Path,
    file_flags: nix::fcntl::OFlag,
) -> nix::Result<std::os::fd::OwnedFd> {
    use nix::fcntl::{openat, OFlag};
    use nix::sys::stat::Mode;
    use std::os::fd::AsFd;

    let parts: Vec<_> = rel.components().collect();
    let mut current: Option<std::os::fd::OwnedFd> = None;
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let flags = if last {
            file_flags
        } else {
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
        };
        let base = match &current {
            Some(fd) => fd.as_fd(),
            None => dir.as_fd(),
        };
        current = Some(openat(base, part.as_os_str(), flags, Mode::empty())?);
    }
    current.ok_or(nix::errno::Errno::ENOENT)
}

fn read_regular(file: std::fs::File, limit: u64) -> Result<Vec<u8>, OpenError> {
    use std::io::Read;
    let meta = file
        .metadata()
        .map_err(|_| OpenError::Refused("cannot stat the file".into()))?;
    if !meta.file_type().is_file() {
        return Err(OpenError::Refused("not a regular file".into()));
    }
    if meta.len() > limit {
        return Err(OpenError::Refused(format!(
            "the file is larger than {limit} bytes"
        )));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|_| OpenError::Refused("cannot read the file".into()))?;
    if bytes.len() as u64 > limit {
        return Err(OpenError::Refused(format!(
            "the file is larger than {limit} bytes"
        )));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn lines_of(input: &[u8]) -> Vec<String> {
        let (tx, mut rx) = mpsc::channel(1024);
        read_lines(input, tx).await;
        let mut out = vec![];
        while let Some(batch) = rx.recv().await {
            out.extend(batch.iter().map(str::to_string));
        }
        out
    }

    #[tokio::test]
    async fn splits_long_lines_keeps_last_and_replaces_garbage() {
        assert_eq!(lines_of(b"a\nb\n\nlast").await, ["a", "b", "", "last"]);
        assert_eq!(
            lines_of(b"crlf\r\nbar 1%\rbar 2%\r\n\rx").await,
            ["crlf", "bar 1%", "bar 2%", "", "x"]
        );
        assert_eq!(lines_of(b"x\xff\xfey\n").await, ["x\u{fffd}\u{fffd}y"]);
        let long = vec![b'z'; MAX_LINE_BYTES * 2 + 10];
        let got = lines_of(&long).await;
        assert_eq!(
            got.iter().map(String::len).collect::<Vec<_>>(),
            [MAX_LINE_BYTES, MAX_LINE_BYTES, 10]
        );
        // A multi-byte character straddling the split point stays whole.
        let mut s = vec![b'a'; MAX_LINE_BYTES - 1];
        s.extend_from_slice("é\n".as_bytes());
        let got = lines_of(&s).await;
        assert_eq!(got.len(), 2);
        assert_eq!(got[1], "é");
    }

    /// The deployer does nothing until its gate opens; a closed gate means
    /// it never runs, and the process exits with `GATE_CLOSED_EXIT`. Once
    /// it runs, its stdin holds exactly the request: the gate's `go` line is
    /// not part of it, and a request larger than a pipe's buffer arrives
    /// whole.
    #[tokio::test]
    async fn a_deployer_waits_at_its_gate() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("berth-gate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let marker = dir.join("ran");
        let received = dir.join("stdin");
        let program = dir.join("deployer.sh");
        std::fs::write(
            &program,
            format!(
                "#!/bin/sh\necho \"$1\" > {}\ncat > {}\n",
                marker.display(),
                received.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        let cmd = DeployerCommand::from_setting(Some(&program), None).unwrap();
        let dirs = CallDirs::create(dir.join("call")).unwrap();
        // 200 KiB, past a pipe's 64 KiB, with a line of its own that reads
        // like the gate's.
        let mut request = b"go\n{\"pad\": \"".to_vec();
        request.extend(std::iter::repeat_n(b'x', 200 * 1024));
        request.extend_from_slice(b"\"}");
        let inv = Invocation {
            verb: "deploy",
            request: request.clone(),
            work_dir: dirs.scratch.clone(),
            scratch_dir: dirs.scratch.clone(),
            result_path: dirs.result_path.clone(),
        };
        let run = |mut spawned: Spawned, open: bool| {
            let marker = marker.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let before = marker.exists();
                if open {
                    spawned.start();
                } else {
                    spawned.abandon();
                }
                let (lines, _rx) = mpsc::channel(8);
                let (_stop, stop) = watch::channel(false);
                let ended = wait(
                    spawned,
                    Some(Duration::from_secs(5)),
                    Duration::from_secs(1),
                    stop,
                    lines,
                )
                .await;
                (before, ended)
            }
        };
        let (ran_before_gate, ended) = run(spawn(&cmd, &inv).unwrap(), true).await;
        assert!(!ran_before_gate, "the deployer ran before its gate opened");
        assert_eq!(ended, Ended::Exit(0));
        assert_eq!(std::fs::read_to_string(&marker).unwrap(), "deploy\n");
        assert!(
            std::fs::read(&received).unwrap() == request,
            "the deployer's stdin is not exactly the request"
        );
        std::fs::remove_file(&marker).unwrap();
        std::fs::remove_file(&received).unwrap();
        let (_, ended) = run(spawn(&cmd, &inv).unwrap(), false).await;
        assert_eq!(ended, Ended::Exit(GATE_CLOSED_EXIT));
        assert!(!marker.exists(), "a deployer ran through a closed gate");
        assert!(
            !received.exists(),
            "a deployer read a request through a closed gate"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A group whose leader exited (and was reaped) but left a child is
    /// still ours to stop; once empty, it is not.
    #[test]
    fn a_group_outlives_its_leader() {
        use std::os::unix::process::CommandExt;
        let mut leader = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg("sleep 30 & exit 0")
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = leader.id() as i32;
        let job = Job {
            pid,
            start_ticks: process_start_ticks(pid).unwrap(),
        };
        leader.wait().unwrap();
        assert_eq!(process_start_ticks(pid), None, "the leader is reaped");
        assert!(group_alive(pid), "its child lives on in the group");
        assert!(group_may_be_ours(&job));
        signal_group(pid, Signal::SIGKILL);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while group_alive(pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        // A killed child no parent reaps may linger as a zombie here; the
        // rule itself is what this checks.
        if !group_alive(pid) {
            assert!(!group_may_be_ours(&job));
        }
    }

    #[test]
    fn open_beneath_refuses_escapes() {
        let dir = std::env::temp_dir().join(format!("berth-open-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sbom")).unwrap();
        std::fs::write(dir.join("sbom/a.json"), b"{}").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.join("sbom/link")).unwrap_or(());
        assert_eq!(open_beneath(&dir, "sbom/a.json", 10).unwrap(), b"{}");
        assert!(matches!(
            open_beneath(&dir, "../x", 10),
            Err(OpenError::Refused(_))
        ));
        assert!(matches!(
            open_beneath(&dir, "/etc/passwd", 10),
            Err(OpenError::Refused(_))
        ));
        assert!(matches!(
            open_beneath(&dir, "sbom/link", 10),
            Err(OpenError::Refused(_))
        ));
        assert!(matches!(
            open_beneath(&dir, "sbom/a.json", 1),
            Err(OpenError::Refused(_))
        ));
        assert!(matches!(
            open_beneath(&dir, "sbom/none", 10),
            Err(OpenError::Missing)
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
