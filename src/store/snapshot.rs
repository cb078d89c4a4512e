//! Reading a store that `berth serve` holds alone (its default; not with
//! `--shared-store`) from another process: `berth audit verify`, `audit
//! push-head` and `berth export` while the server runs.
//!
//! Why it exists: held alone, redb locks the whole file, and the newest
//! commits are in the server's memory and its redo log until the next
//! checkpoint; no other process may open the file, and what it holds
//! lags what was acknowledged. So a reader asks the server instead, over
//! a Unix socket in a directory only berth's user can enter
//! (`snapshots/berth.sock` beside the store, mode 0700): the server
//! copies the tables asked for, each row as the bytes it stores (nothing
//! decoded or encoded again), from one read transaction into a new file
//! in that directory, and answers its name. The reader opens that file
//! read-only, reads it itself (`audit verify` still checks every hash and
//! every signature on its own; it never asks whether the chain is good),
//! and deletes it. A snapshot holds every write acknowledged before the
//! request: there is no lag to bound.
//!
//! The protocol is one line each way: `snapshot audit` or `snapshot all`,
//! answered by `ok <file name>` or `error <what went wrong>`. Each
//! connection is served by a thread of its own (at most
//! `MAX_CONNECTIONS`; past it a reader is told at once that berth is
//! busy), so a reader that connects and sends nothing delays nobody. The
//! copies themselves are made one at a time (each is a full copy of what
//! it names), and at most `MAX_SNAPSHOTS_HELD` exist at once. A reader
//! that goes away before the answer leaves nothing behind, and a snapshot
//! a reader never deleted (it was killed) is removed at the server's
//! next start or, at the latest, by a request `SNAPSHOT_MAX_AGE` later.

use crate::locks::Held;
use std::io::{BufRead, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redb::{Key, TableDefinition, Value};

use super::tables::{EachTable, Table};
use super::{StoreError, StoreResult};

/// The directory (beside the store) that holds the socket and the
/// snapshots: 0700, so only berth's user reaches either, even where the
/// data dir itself is 0711 (`--deployer-user`).
pub const DIR: &str = "snapshots";
/// The socket's name in `DIR`.
const SOCKET: &str = "berth.sock";
/// A request line is at most this long (`snapshot audit` is 14 bytes).
const MAX_REQUEST_BYTES: u64 = 64;
/// A refused request's further bytes are read (and dropped) up to this
/// many, so the refusal reaches the reader.
const MAX_DRAIN_BYTES: u64 = 64 << 10;
/// An answer line is at most this long (an error's text included).
const MAX_ANSWER_BYTES: u64 = 4096;
/// Readers connected at once at most: each holds a thread until it has
/// sent its request (`REQUEST_WAIT` at most) and had its answer.
const MAX_CONNECTIONS: usize = 8;
/// Snapshot files that exist at once at most (made, not yet deleted by
/// their readers): each may be as large as the store.
const MAX_SNAPSHOTS_HELD: usize = 4;
/// How long the server pauses after a failed accept before the next.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);
/// How long the server waits for a connected reader's request line.
const REQUEST_WAIT: Duration = Duration::from_secs(5);
/// How long a reader waits for its snapshot: a copy of a large store (an
/// export's `all`: every log) takes seconds per GiB on a slow disk.
pub const SNAPSHOT_WAIT: Duration = Duration::from_secs(600);
/// A snapshot file older than this was left by a reader that was killed
/// before it deleted it.
const SNAPSHOT_MAX_AGE: Duration = Duration::from_secs(3600);
/// Room a snapshot must leave free on the data dir's disk, beyond the
/// store file's own size (an upper bound of any copy): a copy that filled
/// the disk would make the server's next checkpoint fail.
const SNAPSHOT_HEADROOM_BYTES: u64 = 64 << 20;
// The copy's size below is the file's: redb's non-durable commits since
// the last checkpoint may add at most a log's worth, inside the headroom.
const _: () = assert!(SNAPSHOT_HEADROOM_BYTES > super::redo::MAX_LOG_BYTES);

/// What a reader needs copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The audit chain and what verifies it (`audit verify`, `push-head`).
    Audit,
    /// Every table (`export`).
    All,
}

impl Scope {
    fn word(self) -> &'static str {
        match self {
            Scope::Audit => "audit",
            Scope::All => "all",
        }
    }

    fn parse(word: &str) -> Option<Scope> {
        match word {
            "audit" => Some(Scope::Audit),
            "all" => Some(Scope::All),
            _ => None,
        }
    }

    /// The tables a snapshot of this scope holds.
    fn tables(self) -> Vec<Table> {
        match self {
            Scope::Audit => vec![
                Table::Meta,
                Table::AuditEvents,
                Table::MerkleNodes,
                // Not `DeploymentRows`: its audit part is an index that
                // verify and push-head do not read, beside every
                // deployment's events.
                Table::AuditByActor,
            ],
            Scope::All => Table::ALL.to_vec(),
        }
    }
}

fn dir_of(store: &Path) -> PathBuf {
    match store.parent() {
        Some(parent) => parent.join(DIR),
        None => PathBuf::from(DIR),
    }
}

/// The socket a server holding `store` alone answers on.
pub fn socket_of(store: &Path) -> PathBuf {
    dir_of(store).join(SOCKET)
}

/// The server side: a thread answering snapshot requests; stopped (and
/// its socket removed) when dropped.
pub(super) struct SnapshotServer {
    socket: PathBuf,
    stop: Arc<AtomicBool>,
}

impl Drop for SnapshotServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the thread from its accept, so it sees the flag and ends.
        let _ = UnixStream::connect(&self.socket);
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// The live handle to copy from: `None` once the store is gone (closed,
/// or reopening after an I/O error).
pub(super) type Current = dyn Fn() -> StoreResult<super::Rx> + Send + Sync;

/// What every connection's thread shares.
struct Served {
    current: Box<Current>,
    store: PathBuf,
    dir: PathBuf,
    /// Connections being served now.
    connected: AtomicUsize,
    /// Held while a copy is made: one at a time.
    copying: Mutex<()>,
}

/// Starts answering snapshot requests for the store at `store`, read
/// through `current`. A socket that cannot be made (a path too long for
/// one, a file system without sockets) costs only the live readers, so it
/// is logged, not fatal.
pub(super) fn serve(
    current: impl Fn() -> StoreResult<super::Rx> + Send + Sync + 'static,
    store: &Path,
) -> Option<SnapshotServer> {
    let dir = dir_of(store);
    let socket = dir.join(SOCKET);
    let listener = match listen(&dir, &socket) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(socket = %socket.display(), error = %e,
                "cannot answer snapshot requests: `berth audit verify`, `push-head` and `export` cannot read this store while berth runs");
            return None;
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let served = Arc::new(Served {
        current: Box::new(current),
        store: store.to_path_buf(),
        dir,
        connected: AtomicUsize::new(0),
        copying: Mutex::new(()),
    });
    let spawned = std::thread::Builder::new()
        .name("berth-snapshots".into())
        .spawn(move || {
            for conn in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    return;
                }
                match conn {
                    Ok(conn) => hand_over(&served, conn),
                    // Out of file descriptors, say: no busy loop meanwhile.
                    Err(_) => std::thread::sleep(ACCEPT_RETRY),
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the snapshot thread");
        let _ = std::fs::remove_file(&socket);
        return None;
    }
    Some(SnapshotServer { socket, stop })
}

/// Makes the private directory (emptied of an earlier run's snapshots)
/// and binds the socket in it. Only one server can hold the store alone,
/// so a socket file already there is stale.
fn listen(dir: &Path, socket: &Path) -> std::io::Result<UnixListener> {
    crate::durable::create_dir_all(dir, 0o700)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        std::fs::remove_file(entry.path())?;
    }
    UnixListener::bind(socket)
}

/// Serves `conn` on a thread of its own, or tells it at once that
/// `MAX_CONNECTIONS` readers are served already.
fn hand_over(served: &Arc<Served>, conn: UnixStream) {
    if served.connected.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
        served.connected.fetch_sub(1, Ordering::SeqCst);
        drain(&conn);
        if let Err(e) = reply(
            &conn,
            &format!("error busy: {MAX_CONNECTIONS} readers are connected; try again"),
        ) {
            tracing::debug!(error = %e, "a snapshot reader left before its answer");
        }
        return;
    }
    let mine = served.clone();
    let spawned = std::thread::Builder::new()
        .name("berth-snapshot".into())
        .spawn(move || {
            answer(&mine, conn);
            mine.connected.fetch_sub(1, Ordering::SeqCst);
        });
    if let Err(e) = spawned {
        served.connected.fetch_sub(1, Ordering::SeqCst);
        tracing::warn!(error = %e, "cannot start a thread for a snapshot reader");
    }
}

/// Snapshot files in `dir` now.
fn snapshots_held(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .filter(|e| is_snapshot_name(&e.file_name().to_string_lossy()))
            .count()
    })
}

/// Serves one connection: reads its request, copies, answers. Every
/// failure is answered as an `error` line (and logged), never a panic.
fn answer(served: &Served, conn: UnixStream) {
    let (current, store, dir) = (&*served.current, &served.store, &served.dir);
    let request = read_line(&conn, MAX_REQUEST_BYTES, REQUEST_WAIT);
    let scope = match request.as_deref().map(|l| l.split_once(' ')) {
        Ok(Some(("snapshot", word))) => Scope::parse(word),
        _ => None,
    };
    let Some(scope) = scope else {
        // What the reader sent past the line is read first: closing with
        // unread bytes would reset the connection and lose this answer.
        drain(&conn);
        let _ = reply(
            &conn,
            "error the request is not `snapshot audit` or `snapshot all`",
        );
        return;
    };
    let one_at_a_time = served.copying.held();
    remove_abandoned(dir);
    if snapshots_held(dir) >= MAX_SNAPSHOTS_HELD {
        let _ = reply(
            &conn,
            &format!("error {MAX_SNAPSHOTS_HELD} snapshots are held by readers still running; try again when one has ended"),
        );
        return;
    }
    let name = format!("snapshot-{}.redb", uuid::Uuid::now_v7().simple());
    let path = dir.join(&name);
    let started = std::time::Instant::now();
    let copied = copy(current, store, dir, &path, scope);
    drop(one_at_a_time);
    match copied {
        Ok(()) => {}
        Err(Failed::NoRoom(why)) => {
            tracing::warn!(%why, "a snapshot for a reader was refused");
            let _ = reply(&conn, &format!("error {why}"));
            return;
        }
        Err(Failed::Store(e)) => {
            let _ = std::fs::remove_file(&path);
            tracing::error!(error = %e, scope = scope.word(), "a snapshot for a reader failed");
            let _ = reply(&conn, &format!("error the snapshot failed: {e}"));
            return;
        }
    }
    tracing::info!(
        scope = scope.word(),
        ms = started.elapsed().as_millis() as u64,
        "snapshot made for a reader"
    );
    // A reader gone before its answer never learns the name: remove it.
    if reply(&conn, &format!("ok {name}")).is_err() {
        let _ = std::fs::remove_file(&path);
    }
}

/// Reads and drops what has already arrived, up to `MAX_DRAIN_BYTES`.
fn drain(mut conn: &UnixStream) {
    use std::io::Read;
    if conn.set_nonblocking(true).is_err() {
        return;
    }
    let mut buf = [0u8; 4096];
    let mut drained = 0u64;
    while drained < MAX_DRAIN_BYTES {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n as u64,
        }
    }
    let _ = conn.set_nonblocking(false);
}

fn reply(mut conn: &UnixStream, line: &str) -> std::io::Result<()> {
    conn.write_all(line.as_bytes())?;
    conn.write_all(b"\n")
}

/// One line of at most `max` bytes, within `wait`.
fn read_line(conn: &UnixStream, max: u64, wait: Duration) -> std::io::Result<String> {
    use std::io::Read;
    conn.set_read_timeout(Some(wait))?;
    let mut line = String::new();
    std::io::BufReader::new(conn.take(max)).read_line(&mut line)?;
    match line.strip_suffix('\n') {
        Some(whole) => Ok(whole.to_string()),
        None => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "a line that does not end within its limit",
        )),
    }
}

/// Why a snapshot was not made.
enum Failed {
    /// Refused before anything was written: the disk lacks the room.
    NoRoom(String),
    Store(StoreError),
}

impl<E: Into<StoreError>> From<E> for Failed {
    fn from(e: E) -> Failed {
        Failed::Store(e.into())
    }
}

/// The bytes a copy of `scope` takes at most: for the audit tables, what
/// redb says they hold (their pages, used, bookkeeping and fragmented); for
/// every table, the store file's size (walking every table of a large
/// store to size it would read it all twice). The rows since the last
/// checkpoint are not counted: they are at most a redo log's worth, which
/// `SNAPSHOT_HEADROOM_BYTES` holds.
fn copy_bytes(from: &redb::ReadTransaction, store: &Path, scope: Scope) -> StoreResult<u64> {
    struct TableBytes<'a>(&'a redb::ReadTransaction);
    impl EachTable for TableBytes<'_> {
        type Output = StoreResult<u64>;
        fn with<K: Key + 'static, V: Value + 'static>(
            &mut self,
            def: TableDefinition<'static, K, V>,
        ) -> StoreResult<u64> {
            let stats = redb::ReadableTableMetadata::stats(&self.0.open_table(def)?)?;
            Ok(stats.stored_bytes() + stats.metadata_bytes() + stats.fragmented_bytes())
        }
    }
    match scope {
        Scope::Audit => scope.tables().into_iter().try_fold(0u64, |sum, table| {
            Ok(sum.saturating_add(table.visit(&mut TableBytes(from))?))
        }),
        Scope::All => Ok(std::fs::metadata(store).map_or(0, |m| m.len())),
    }
}

/// Whether the disk holding `dir` has room for a copy of `copy` bytes and
/// `SNAPSHOT_HEADROOM_BYTES` after it.
fn room_for_a_copy(copy: u64, dir: &Path) -> Result<(), String> {
    let needed = copy.saturating_add(SNAPSHOT_HEADROOM_BYTES);
    let stats = nix::sys::statvfs::statvfs(dir)
        .map_err(|e| format!("cannot tell the free space for a snapshot: {e}"))?;
    let free = stats
        .blocks_available()
        .saturating_mul(stats.fragment_size());
    if free < needed {
        return Err(format!(
            "not enough free disk for a snapshot: {} MiB free, {} MiB needed (the copy's size and {} MiB to spare)",
            free >> 20,
            needed >> 20,
            SNAPSHOT_HEADROOM_BYTES >> 20
        ));
    }
    Ok(())
}

/// Snapshots a killed reader left behind.
fn remove_abandoned(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > SNAPSHOT_MAX_AGE);
        let is_snapshot = entry.file_name().to_string_lossy().starts_with("snapshot-");
        if old && is_snapshot {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Copies `scope`'s tables as they are in one read transaction of the
/// live store into a new store file at `to`.
/// Copies `scope`'s tables from one read transaction into a new file at
/// `to`, once the disk is known to have room for it.
fn copy(
    current: &Current,
    store: &Path,
    dir: &Path,
    to: &Path,
    scope: Scope,
) -> Result<(), Failed> {
    // A reader of the live store, which holds every write acknowledged
    // before the request.
    let from = current()?;
    room_for_a_copy(copy_bytes(&from.txn, store, scope)?, dir).map_err(Failed::NoRoom)?;
    // Written once, front to back: a small cache, not redb's 1 GiB default.
    let out = super::redb_builder(
        redb::ConcurrencyMode::SingleWriter,
        super::CacheSize::DEFAULT,
    )
    .create(to)?;
    let txn = out.begin_write()?;
    for table in scope.tables() {
        table.visit(&mut CopyTable {
            from: &from,
            to: &txn,
        })?;
    }
    txn.commit()?;
    drop(out);
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o600))?;
    Ok(())
}

struct CopyTable<'a> {
    from: &'a super::Rx,
    to: &'a redb::WriteTransaction,
}

impl EachTable for CopyTable<'_> {
    type Output = StoreResult<()>;
    fn with<K: Key + 'static, V: Value + 'static>(
        &mut self,
        def: TableDefinition<'static, K, V>,
    ) -> StoreResult<()> {
        let source = self.from.rows(def)?;
        let mut target = self.to.open_table(def)?;
        for row in source.iter()? {
            let (key, value) = row?;
            target.insert(key.value(), value.value())?;
        }
        Ok(())
    }
}

/// The reader side: a snapshot file, deleted when dropped.
pub struct SnapshotFile {
    pub path: PathBuf,
}

impl Drop for SnapshotFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Asks the server holding `store` alone for a snapshot of `scope`.
pub fn request(store: &Path, scope: Scope) -> StoreResult<SnapshotFile> {
    let socket = socket_of(store);
    let unreachable = |e: std::io::Error| {
        StoreError::other(format!(
            "berth serve holds the store alone and did not answer for a snapshot on {}: {e} \
             (on a file system without Unix sockets, run berth serve --shared-store to read the live file)",
            socket.display()
        ))
    };
    let mut conn = UnixStream::connect(&socket).map_err(unreachable)?;
    conn.write_all(format!("snapshot {}\n", scope.word()).as_bytes())
        .map_err(unreachable)?;
    let line = read_line(&conn, MAX_ANSWER_BYTES, SNAPSHOT_WAIT).map_err(unreachable)?;
    match line.split_once(' ') {
        Some(("ok", name)) if is_snapshot_name(name) => Ok(SnapshotFile {
            path: dir_of(store).join(name),
        }),
        Some(("error", why)) => Err(StoreError::other(format!(
            "berth serve could not make a snapshot of the store: {why}"
        ))),
        _ => Err(StoreError::other(
            "berth serve answered the snapshot request with something else than a snapshot's name",
        )),
    }
}

/// A name the server makes (`snapshot-<32 hex>.redb`), and nothing that
/// would lead out of the snapshot directory.
fn is_snapshot_name(name: &str) -> bool {
    name.strip_prefix("snapshot-")
        .and_then(|rest| rest.strip_suffix(".redb"))
        .is_some_and(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_the_server_makes_are_taken() {
        assert!(is_snapshot_name(
            "snapshot-0123456789abcdef0123456789abcdef.redb"
        ));
        for bad in [
            "snapshot-../../etc/passwd.redb",
            "snapshot-0123456789abcdef0123456789abcde.redb",
            "/tmp/x.redb",
            "snapshot-0123456789abcdef0123456789abcdef.redb/..",
        ] {
            assert!(!is_snapshot_name(bad), "{bad}");
        }
    }
}
