//! A file system that forgets what was not synced, for the power-loss
//! trials (storage.md "Power loss"; the idea is Jepsen's LazyFS).
//!
//! Why it exists: kill -9 leaves the kernel's page cache intact, so it never
//! shows what a power cut does to a file written but not yet synced, or to
//! a rename whose directory was not synced. Mounted with FUSE (`fuser`,
//! served from a thread of the test process), it keeps every change since
//! the last sync in its own memory and applies a change to the durable
//! image only when the program syncs it:
//!
//! - a file's writes and truncations reach its durable bytes (one file per
//!   inode in the backing directory) on `fsync`/`fdatasync` of that file;
//! - a directory's entries (create, link, unlink, rename) become durable on
//!   `fsync` of that directory; a new file whose name was never synced is
//!   gone after a cut, whatever was synced into it.
//!
//! On a cut ([`PowerFs::cut`]) every file and directory goes back to its
//! durable state ([`Cut::DropUnsynced`]), or keeps a random prefix of its
//! unsynced changes, the last of them possibly cut part-way through its
//! bytes ([`Cut::Torn`]: a torn write). What a cut keeps reached the
//! disk, so it is durable from then on: a later cut starts from it. Before
//! that, [`PowerFs::sever`] makes every call fail with EIO: from that
//! instant nothing reaches the "disk", as when the power goes.
//!
//! Metadata (mode, owner) is treated as durable at once; the trials are
//! about data and names. Everything lives under one lock: the trials need
//! correctness, not speed (the benchmark `power_loss` measures its cost).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, OpenFlags,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

/// The most bytes all files may hold together (live copies in memory):
/// past it a write fails with ENOSPC, as a full disk does.
pub const MAX_TOTAL_BYTES: u64 = 4 << 30;
/// The kernel must ask again for every name and attribute: after a cut
/// what it cached may be gone.
const TTL: Duration = Duration::ZERO;
const ROOT: u64 = 1;
const BLOCK: u32 = 4096;

/// What a cut keeps of the changes that were not synced.
#[derive(Clone, Copy, Debug)]
pub enum Cut {
    /// Nothing: every file and directory is as it was last synced.
    DropUnsynced,
    /// For each file and directory, a random prefix of its unsynced
    /// changes (from this seed); the last change kept may be a write cut
    /// part-way through its bytes.
    Torn(u64),
    /// Files named `file` keep a random prefix of their unsynced writes and
    /// then half of the next one (a torn page); everything else unsynced
    /// is dropped.
    TearOne { seed: u64, file: &'static str },
}

/// What a cut threw away, for the trials' report.
#[derive(Clone, Copy, Debug, Default)]
pub struct CutReport {
    /// Unsynced changes (writes, truncations, entry changes) dropped.
    pub dropped_changes: u64,
    /// Changes kept only in part (a torn write).
    pub torn_writes: u64,
    /// Files and directories no durable name leads to any more.
    pub lost_nodes: u64,
}

#[derive(Clone, Debug)]
enum FileChange {
    Write { offset: u64, bytes: Vec<u8> },
    SetLen(u64),
}

#[derive(Clone, Debug)]
enum DirChange {
    /// `name` now names `ino` (a create, a link, or the new side of a
    /// rename across directories).
    Link(OsString, u64),
    Unlink(OsString),
    /// A rename inside this directory: atomic, as a journal makes it.
    Rename {
        from: OsString,
        to: OsString,
    },
}

enum Body {
    File {
        live: Vec<u8>,
        unsynced: Vec<FileChange>,
    },
    Dir {
        live: BTreeMap<OsString, u64>,
        durable: BTreeMap<OsString, u64>,
        unsynced: Vec<DirChange>,
    },
    Symlink(PathBuf),
}

struct Node {
    perm: u16,
    uid: u32,
    gid: u32,
    mtime: SystemTime,
    /// Live names of this node (its hard links).
    nlink: u32,
    body: Body,
}

struct State {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    next_fh: u64,
    backing: PathBuf,
    severed: bool,
    live_bytes: u64,
    /// Counts for the report: syncs of files and of directories.
    file_syncs: u64,
    dir_syncs: u64,
}

/// A small pseudo-random sequence for torn cuts (xorshift64*), seeded per
/// cut so a failing trial can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn upto(&mut self, n: usize) -> usize {
        (self.next() % (n as u64 + 1)) as usize
    }
}

fn apply_file_change(bytes: &mut Vec<u8>, change: &FileChange) {
    match change {
        FileChange::Write {
            offset,
            bytes: data,
        } => {
            let start = *offset as usize;
            let end = start + data.len();
            if bytes.len() < end {
                bytes.resize(end, 0);
            }
            bytes[start..end].copy_from_slice(data);
        }
        FileChange::SetLen(len) => bytes.resize(*len as usize, 0),
    }
}

fn apply_dir_change(entries: &mut BTreeMap<OsString, u64>, change: &DirChange) {
    match change {
        DirChange::Link(name, ino) => {
            entries.insert(name.clone(), *ino);
        }
        DirChange::Unlink(name) => {
            entries.remove(name);
        }
        DirChange::Rename { from, to } => {
            if let Some(ino) = entries.remove(from) {
                entries.insert(to.clone(), ino);
            }
        }
    }
}

impl State {
    fn backing_file(&self, ino: u64) -> PathBuf {
        self.backing.join(ino.to_string())
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let node = self.nodes.get(&ino)?;
        let (kind, size) = match &node.body {
            Body::File { live, .. } => (FileType::RegularFile, live.len() as u64),
            Body::Dir { live, .. } => (FileType::Directory, live.len() as u64 + 2),
            Body::Symlink(target) => (FileType::Symlink, target.as_os_str().len() as u64),
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: node.mtime,
            mtime: node.mtime,
            ctime: node.mtime,
            crtime: node.mtime,
            kind,
            perm: node.perm,
            nlink: node.nlink.max(1),
            uid: node.uid,
            gid: node.gid,
            rdev: 0,
            blksize: BLOCK,
            flags: 0,
        })
    }

    fn dir_entries(&self, ino: u64) -> Result<&BTreeMap<OsString, u64>, Errno> {
        match self.nodes.get(&ino).map(|n| &n.body) {
            Some(Body::Dir { live, .. }) => Ok(live),
            Some(_) => Err(Errno::ENOTDIR),
            None => Err(Errno::ENOENT),
        }
    }

    fn lookup(&self, parent: u64, name: &OsStr) -> Result<u64, Errno> {
        self.dir_entries(parent)?
            .get(name)
            .copied()
            .ok_or(Errno::ENOENT)
    }

    /// Changes a directory's live entries and records the change.
    fn change_dir(&mut self, dir: u64, change: DirChange) -> Result<(), Errno> {
        let node = self.nodes.get_mut(&dir).ok_or(Errno::ENOENT)?;
        node.mtime = SystemTime::now();
        match &mut node.body {
            Body::Dir { live, unsynced, .. } => {
                apply_dir_change(live, &change);
                unsynced.push(change);
                Ok(())
            }
            _ => Err(Errno::ENOTDIR),
        }
    }

    fn new_node(&mut self, req: &Request, perm: u16, body: Body) -> u64 {
        let ino = self.next_ino;
        self.next_ino += 1;
        self.nodes.insert(
            ino,
            Node {
                perm,
                uid: req.uid(),
                gid: req.gid(),
                mtime: SystemTime::now(),
                nlink: 0,
                body,
            },
        );
        ino
    }

    /// Names `ino` as `name` in `parent` (which must not have it yet).
    fn add_name(&mut self, parent: u64, name: &OsStr, ino: u64) -> Result<(), Errno> {
        if self.dir_entries(parent)?.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        self.change_dir(parent, DirChange::Link(name.to_os_string(), ino))?;
        if let Some(n) = self.nodes.get_mut(&ino) {
            n.nlink += 1;
        }
        Ok(())
    }

    fn drop_name(&mut self, ino: u64) {
        if let Some(n) = self.nodes.get_mut(&ino) {
            n.nlink = n.nlink.saturating_sub(1);
        }
    }

    fn write(&mut self, ino: u64, offset: u64, data: &[u8]) -> Result<(), Errno> {
        let end = offset.checked_add(data.len() as u64).ok_or(Errno::EFBIG)?;
        let node = self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)?;
        let Body::File { live, unsynced } = &mut node.body else {
            return Err(Errno::EISDIR);
        };
        let grow = end.saturating_sub(live.len() as u64);
        if self.live_bytes + grow > MAX_TOTAL_BYTES {
            return Err(Errno::ENOSPC);
        }
        let change = FileChange::Write {
            offset,
            bytes: data.to_vec(),
        };
        apply_file_change(live, &change);
        unsynced.push(change);
        node.mtime = SystemTime::now();
        self.live_bytes += grow;
        Ok(())
    }

    fn set_len(&mut self, ino: u64, len: u64) -> Result<(), Errno> {
        let node = self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)?;
        let Body::File { live, unsynced } = &mut node.body else {
            return Err(Errno::EISDIR);
        };
        let old = live.len() as u64;
        if len > old && self.live_bytes + (len - old) > MAX_TOTAL_BYTES {
            return Err(Errno::ENOSPC);
        }
        let change = FileChange::SetLen(len);
        apply_file_change(live, &change);
        unsynced.push(change);
        node.mtime = SystemTime::now();
        if len >= old {
            self.live_bytes += len - old;
        } else {
            self.live_bytes = self.live_bytes.saturating_sub(old - len);
        }
        Ok(())
    }

    /// `fsync` of a file: its unsynced changes reach its durable bytes.
    fn sync_file(&mut self, ino: u64) -> Result<(), Errno> {
        let path = self.backing_file(ino);
        let node = self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)?;
        match &mut node.body {
            Body::File { unsynced, .. } => {
                if unsynced.is_empty() {
                    return Ok(());
                }
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&path)
                    .map_err(|_| Errno::EIO)?;
                for change in unsynced.drain(..) {
                    match change {
                        FileChange::Write { offset, bytes } => {
                            file.write_all_at(&bytes, offset).map_err(|_| Errno::EIO)?
                        }
                        FileChange::SetLen(len) => file.set_len(len).map_err(|_| Errno::EIO)?,
                    }
                }
                self.file_syncs += 1;
                Ok(())
            }
            Body::Dir { .. } => self.sync_dir(ino),
            Body::Symlink(_) => Ok(()),
        }
    }

    /// `fsync` of a directory: its live entries become its durable ones.
    fn sync_dir(&mut self, ino: u64) -> Result<(), Errno> {
        let node = self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)?;
        match &mut node.body {
            Body::Dir {
                live,
                durable,
                unsynced,
            } => {
                *durable = live.clone();
                unsynced.clear();
                self.dir_syncs += 1;
                Ok(())
            }
            _ => Err(Errno::ENOTDIR),
        }
    }

    /// The cut: every node back to its durable state, or that plus a random
    /// prefix of its unsynced changes; nodes no durable name reaches go.
    fn cut(&mut self, how: Cut) -> CutReport {
        let mut report = CutReport::default();
        let (mut rng, torn_name) = match how {
            Cut::DropUnsynced => (None, None),
            Cut::Torn(seed) => (Some(Rng(seed | 1)), None),
            Cut::TearOne { seed, file } => (Some(Rng(seed | 1)), Some(OsStr::new(file))),
        };
        // With `TearOne`, the nodes some name `file` leads to.
        let tear: HashSet<u64> = match torn_name {
            None => HashSet::new(),
            Some(name) => self
                .nodes
                .values()
                .filter_map(|n| match &n.body {
                    Body::Dir { live, .. } => live.get(name).copied(),
                    _ => None,
                })
                .collect(),
        };
        let inos: Vec<u64> = self.nodes.keys().copied().collect();
        for ino in inos {
            let backing = self.backing_file(ino);
            let Some(node) = self.nodes.get_mut(&ino) else {
                continue;
            };
            // Which of this node's unsynced changes survive, and whether
            // the first one lost is kept in part (half of it, or a random
            // part).
            let (keep_changes, tear_next) = match (&mut rng, torn_name) {
                (None, _) => (false, None),
                (Some(_), None) => (true, Some(false)),
                (Some(_), Some(_)) if tear.contains(&ino) => (true, Some(true)),
                (Some(_), Some(_)) => (false, None),
            };
            match &mut node.body {
                Body::File { live, unsynced } => {
                    let mut bytes = std::fs::read(&backing).unwrap_or_default();
                    let keep = match (&mut rng, keep_changes) {
                        (Some(r), true) if tear_next == Some(true) => {
                            r.upto(unsynced.len().saturating_sub(1))
                        }
                        (Some(r), true) => r.upto(unsynced.len()),
                        _ => 0,
                    };
                    for change in &unsynced[..keep] {
                        apply_file_change(&mut bytes, change);
                    }
                    report.dropped_changes += (unsynced.len() - keep) as u64;
                    if let (
                        Some(r),
                        Some(half),
                        Some(FileChange::Write {
                            offset,
                            bytes: data,
                        }),
                    ) = (rng.as_mut(), tear_next, unsynced.get(keep))
                    {
                        let part = if half {
                            data.len() / 2
                        } else {
                            r.upto(data.len().saturating_sub(1))
                        };
                        if part > 0 {
                            apply_file_change(
                                &mut bytes,
                                &FileChange::Write {
                                    offset: *offset,
                                    bytes: data[..part].to_vec(),
                                },
                            );
                            report.torn_writes += 1;
                        }
                    }
                    // What the cut kept reached the disk: the next cut
                    // starts from it (kept only in `live`, a torn
                    // checkpoint's pages vanished at the next cut, after
                    // later commits had been built on them).
                    std::fs::write(&backing, &bytes)
                        .expect("the backing directory takes what a cut kept");
                    *live = bytes;
                    unsynced.clear();
                }
                Body::Dir {
                    live,
                    durable,
                    unsynced,
                } => {
                    let mut entries = durable.clone();
                    let keep = match (&mut rng, keep_changes) {
                        (Some(r), true) => r.upto(unsynced.len()),
                        _ => 0,
                    };
                    for change in &unsynced[..keep] {
                        apply_dir_change(&mut entries, change);
                    }
                    report.dropped_changes += (unsynced.len() - keep) as u64;
                    // As for a file: the entries the cut kept are durable.
                    *durable = entries.clone();
                    *live = entries;
                    unsynced.clear();
                }
                Body::Symlink(_) => {}
            }
        }
        // What a name still reaches survives; recount the names.
        let mut reached: HashMap<u64, u32> = HashMap::from([(ROOT, 1)]);
        let mut todo = vec![ROOT];
        let mut seen = HashSet::from([ROOT]);
        while let Some(dir) = todo.pop() {
            if let Some(Node {
                body: Body::Dir { live, .. },
                ..
            }) = self.nodes.get(&dir)
            {
                for &child in live.values() {
                    *reached.entry(child).or_default() += 1;
                    if seen.insert(child) {
                        todo.push(child);
                    }
                }
            }
        }
        // A name whose node is gone (it never existed durably) goes too.
        let known: HashSet<u64> = self.nodes.keys().copied().collect();
        for node in self.nodes.values_mut() {
            if let Body::Dir { live, durable, .. } = &mut node.body {
                live.retain(|_, ino| known.contains(ino));
                durable.retain(|_, ino| known.contains(ino));
            }
        }
        let gone: Vec<u64> = self
            .nodes
            .keys()
            .copied()
            .filter(|ino| !reached.contains_key(ino))
            .collect();
        for ino in gone {
            self.nodes.remove(&ino);
            let _ = std::fs::remove_file(self.backing_file(ino));
            report.lost_nodes += 1;
        }
        self.live_bytes = 0;
        for (ino, node) in self.nodes.iter_mut() {
            node.nlink = reached.get(ino).copied().unwrap_or(0);
            if let Body::File { live, .. } = &node.body {
                self.live_bytes += live.len() as u64;
            }
        }
        report
    }
}

/// The FUSE side: every call takes the one lock, and fails with EIO while
/// the power is off.
struct Served(Arc<Mutex<State>>);

impl Served {
    fn state(&self) -> Result<MutexGuard<'_, State>, Errno> {
        let state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if state.severed {
            return Err(Errno::EIO);
        }
        Ok(state)
    }
}

/// Answers a call whose reply carries nothing but success or an errno.
fn answer(reply: ReplyEmpty, result: Result<(), Errno>) {
    match result {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

macro_rules! state_or {
    ($self:ident, $reply:ident) => {
        match $self.state() {
            Ok(s) => s,
            Err(e) => return $reply.error(e),
        }
    };
}

impl Filesystem for Served {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let s = state_or!(self, reply);
        match s
            .lookup(parent.0, name)
            .and_then(|ino| s.attr(ino).ok_or(Errno::ENOENT))
        {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let s = state_or!(self, reply);
        match s.attr(ino.0) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut s = state_or!(self, reply);
        if let Some(len) = size {
            if let Err(e) = s.set_len(ino.0, len) {
                return reply.error(e);
            }
        }
        let Some(node) = s.nodes.get_mut(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        if let Some(mode) = mode {
            node.perm = (mode & 0o7777) as u16;
        }
        if let Some(uid) = uid {
            node.uid = uid;
        }
        if let Some(gid) = gid {
            node.gid = gid;
        }
        match s.attr(ino.0) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let s = state_or!(self, reply);
        match s.nodes.get(&ino.0).map(|n| &n.body) {
            Some(Body::Symlink(target)) => reply.data(target.as_os_str().as_bytes()),
            Some(_) => reply.error(Errno::EINVAL),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & libc_mode::S_IFMT != libc_mode::S_IFREG {
            return reply.error(Errno::EPERM);
        }
        let mut s = state_or!(self, reply);
        match create_file(&mut s, req, parent.0, name, mode & !umask) {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let mut s = state_or!(self, reply);
        if s.lookup(parent.0, name).is_ok() {
            return reply.error(Errno::EEXIST);
        }
        let ino = s.new_node(
            req,
            ((mode & !umask) & 0o7777) as u16,
            Body::Dir {
                live: BTreeMap::new(),
                durable: BTreeMap::new(),
                unsynced: Vec::new(),
            },
        );
        match s
            .add_name(parent.0, name, ino)
            .and_then(|()| s.attr(ino).ok_or(Errno::ENOENT))
        {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut s = state_or!(self, reply);
        let result = s.lookup(parent.0, name).and_then(|ino| {
            if matches!(s.nodes.get(&ino).map(|n| &n.body), Some(Body::Dir { .. })) {
                return Err(Errno::EISDIR);
            }
            s.change_dir(parent.0, DirChange::Unlink(name.to_os_string()))?;
            s.drop_name(ino);
            Ok(())
        });
        answer(reply, result)
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut s = state_or!(self, reply);
        let result = s.lookup(parent.0, name).and_then(|ino| {
            if !s.dir_entries(ino)?.is_empty() {
                return Err(Errno::ENOTEMPTY);
            }
            s.change_dir(parent.0, DirChange::Unlink(name.to_os_string()))?;
            s.drop_name(ino);
            Ok(())
        });
        answer(reply, result)
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let mut s = state_or!(self, reply);
        if s.lookup(parent.0, link_name).is_ok() {
            return reply.error(Errno::EEXIST);
        }
        let ino = s.new_node(req, 0o777, Body::Symlink(target.to_path_buf()));
        match s
            .add_name(parent.0, link_name, ino)
            .and_then(|()| s.attr(ino).ok_or(Errno::ENOENT))
        {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let mut s = state_or!(self, reply);
        answer(
            reply,
            rename(&mut s, parent.0, name, newparent.0, newname, flags),
        )
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let mut s = state_or!(self, reply);
        if matches!(s.nodes.get(&ino.0).map(|n| &n.body), Some(Body::Dir { .. })) {
            return reply.error(Errno::EPERM);
        }
        match s
            .add_name(newparent.0, newname, ino.0)
            .and_then(|()| s.attr(ino.0).ok_or(Errno::ENOENT))
        {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut s = state_or!(self, reply);
        if !s.nodes.contains_key(&ino.0) {
            return reply.error(Errno::ENOENT);
        }
        s.next_fh += 1;
        reply.opened(FileHandle(s.next_fh), FopenFlags::empty());
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        let s = state_or!(self, reply);
        match s.nodes.get(&ino.0).map(|n| &n.body) {
            Some(Body::File { live, .. }) => {
                let start = (offset as usize).min(live.len());
                let end = start.saturating_add(size as usize).min(live.len());
                reply.data(&live[start..end]);
            }
            Some(_) => reply.error(Errno::EISDIR),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut s = state_or!(self, reply);
        match s.write(ino.0, offset, data) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: fuser::LockOwner,
        reply: ReplyEmpty,
    ) {
        // A close is not a sync: nothing becomes durable here.
        let _s = state_or!(self, reply);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let mut s = state_or!(self, reply);
        answer(reply, s.sync_file(ino.0))
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut s = state_or!(self, reply);
        if let Err(e) = s.dir_entries(ino.0) {
            return reply.error(e);
        }
        s.next_fh += 1;
        reply.opened(FileHandle(s.next_fh), FopenFlags::empty());
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let s = state_or!(self, reply);
        let entries = match s.dir_entries(ino.0) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        let mut all: Vec<(u64, FileType, OsString)> = vec![
            (ino.0, FileType::Directory, ".".into()),
            (ino.0, FileType::Directory, "..".into()),
        ];
        for (name, child) in entries {
            let kind = match s.nodes.get(child).map(|n| &n.body) {
                Some(Body::Dir { .. }) => FileType::Directory,
                Some(Body::Symlink(_)) => FileType::Symlink,
                _ => FileType::RegularFile,
            };
            all.push((*child, kind, name.clone()));
        }
        for (i, (child, kind, name)) in all.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(child), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let mut s = state_or!(self, reply);
        answer(reply, s.sync_dir(ino.0))
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let s = state_or!(self, reply);
        let total = MAX_TOTAL_BYTES / BLOCK as u64;
        let free = total.saturating_sub(s.live_bytes / BLOCK as u64);
        reply.statfs(total, free, free, 1 << 20, 1 << 20, BLOCK, 255, BLOCK);
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        let s = state_or!(self, reply);
        if s.nodes.contains_key(&ino.0) {
            reply.ok()
        } else {
            reply.error(Errno::ENOENT)
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let mut s = state_or!(self, reply);
        match create_file(&mut s, req, parent.0, name, mode & !umask) {
            Ok(attr) => {
                s.next_fh += 1;
                reply.created(
                    &TTL,
                    &attr,
                    Generation(0),
                    FileHandle(s.next_fh),
                    FopenFlags::empty(),
                )
            }
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let mut s = state_or!(self, reply);
        if mode != 0 {
            return reply.error(Errno::EOPNOTSUPP);
        }
        let end = offset.saturating_add(length);
        let len = match s.nodes.get(&ino.0).map(|n| &n.body) {
            Some(Body::File { live, .. }) => live.len() as u64,
            _ => return reply.error(Errno::EINVAL),
        };
        if end <= len {
            return reply.ok();
        }
        answer(reply, s.set_len(ino.0, end))
    }
}

/// The file-type bits of a mode (libc's names; the test crate has no libc).
mod libc_mode {
    pub const S_IFMT: u32 = 0o170000;
    pub const S_IFREG: u32 = 0o100000;
}

fn create_file(
    s: &mut State,
    req: &Request,
    parent: u64,
    name: &OsStr,
    mode: u32,
) -> Result<FileAttr, Errno> {
    if s.lookup(parent, name).is_ok() {
        return Err(Errno::EEXIST);
    }
    s.dir_entries(parent)?;
    let ino = s.new_node(
        req,
        (mode & 0o7777) as u16,
        Body::File {
            live: Vec::new(),
            unsynced: Vec::new(),
        },
    );
    s.add_name(parent, name, ino)?;
    s.attr(ino).ok_or(Errno::ENOENT)
}

fn rename(
    s: &mut State,
    parent: u64,
    name: &OsStr,
    newparent: u64,
    newname: &OsStr,
    flags: RenameFlags,
) -> Result<(), Errno> {
    if flags.contains(RenameFlags::RENAME_EXCHANGE) || flags.contains(RenameFlags::RENAME_WHITEOUT)
    {
        return Err(Errno::EINVAL);
    }
    let ino = s.lookup(parent, name)?;
    let moving_dir = matches!(s.nodes.get(&ino).map(|n| &n.body), Some(Body::Dir { .. }));
    if let Ok(old) = s.lookup(newparent, newname) {
        if old == ino {
            return Ok(());
        }
        if flags.contains(RenameFlags::RENAME_NOREPLACE) {
            return Err(Errno::EEXIST);
        }
        match (
            moving_dir,
            s.nodes
                .get(&old)
                .map(|n| matches!(n.body, Body::Dir { .. })),
        ) {
            (true, Some(true)) => {
                if !s.dir_entries(old)?.is_empty() {
                    return Err(Errno::ENOTEMPTY);
                }
            }
            (true, Some(false)) => return Err(Errno::ENOTDIR),
            (false, Some(true)) => return Err(Errno::EISDIR),
            (false, Some(false)) | (_, None) => {}
        }
        s.drop_name(old);
    }
    s.dir_entries(newparent)?;
    if parent == newparent {
        s.change_dir(
            parent,
            DirChange::Rename {
                from: name.to_os_string(),
                to: newname.to_os_string(),
            },
        )
    } else {
        s.change_dir(parent, DirChange::Unlink(name.to_os_string()))?;
        s.change_dir(newparent, DirChange::Link(newname.to_os_string(), ino))
    }
}

/// A mounted power-loss file system. Unmounted when dropped.
pub struct PowerFs {
    state: Arc<Mutex<State>>,
    session: Option<fuser::BackgroundSession>,
}

impl PowerFs {
    /// Mounts an empty file system at `mount` (an empty directory), keeping
    /// durable bytes in `backing` (created empty). Fails with why when FUSE
    /// is not there (no /dev/fuse, no fusermount3 and not root).
    pub fn mount(mount: &Path, backing: &Path) -> Result<PowerFs, String> {
        std::fs::create_dir_all(mount).map_err(|e| format!("{}: {e}", mount.display()))?;
        let _ = std::fs::remove_dir_all(backing);
        std::fs::create_dir_all(backing).map_err(|e| format!("{}: {e}", backing.display()))?;
        let root = Node {
            perm: 0o755,
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
            mtime: SystemTime::now(),
            nlink: 1,
            body: Body::Dir {
                live: BTreeMap::new(),
                durable: BTreeMap::new(),
                unsynced: Vec::new(),
            },
        };
        let state = Arc::new(Mutex::new(State {
            nodes: HashMap::from([(ROOT, root)]),
            next_ino: ROOT + 1,
            next_fh: 0,
            backing: backing.to_path_buf(),
            severed: false,
            live_bytes: 0,
            file_syncs: 0,
            dir_syncs: 0,
        }));
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            fuser::MountOption::FSName("berth-powerfs".into()),
            fuser::MountOption::Exec,
        ];
        let session = fuser::spawn_mount(Served(state.clone()), mount, &config).map_err(|e| {
            format!(
                "cannot mount a FUSE file system at {}: {e}",
                mount.display()
            )
        })?;
        Ok(PowerFs {
            state,
            session: Some(session),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The power goes: from now every call fails with EIO and changes
    /// nothing, until `cut` brings the machine back.
    pub fn sever(&self) {
        self.lock().severed = true;
    }

    /// Applies the cut (everything not synced is lost, or torn) and turns
    /// the power back on.
    pub fn cut(&self, how: Cut) -> CutReport {
        let mut s = self.lock();
        s.severed = true;
        let report = s.cut(how);
        s.severed = false;
        report
    }

    /// Syncs of files and of directories so far.
    pub fn syncs(&self) -> (u64, u64) {
        let s = self.lock();
        (s.file_syncs, s.dir_syncs)
    }
}

impl Drop for PowerFs {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            let _ = session.umount_and_join();
        }
    }
}

/// Mounts one for a test, or says why it cannot run here (visibly: the
/// skip is written where `.ci/run` counts it).
pub fn mount_or_skip(test: &str, dir: &Path) -> Option<PowerFs> {
    match PowerFs::mount(&dir.join("data"), &dir.join("backing")) {
        Ok(fs) => Some(fs),
        Err(why) => {
            crate::harness::skip(test, &why);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn fresh(tag: &str) -> Option<(PathBuf, PowerFs)> {
        let dir = crate::harness::temp_dir(tag);
        let fs = mount_or_skip(tag, &dir)?;
        Some((dir.join("data"), fs))
    }

    fn write_file(path: &Path, bytes: &[u8], sync: bool) {
        let mut f = std::fs::File::create(path).unwrap();
        f.write_all(bytes).unwrap();
        if sync {
            f.sync_all().unwrap();
        }
    }

    /// Writes `bytes` over the start of the existing file at `path`,
    /// synced or not.
    fn overwrite(path: &Path, bytes: &[u8], sync: bool) {
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.write_all_at(bytes, 0).unwrap();
        if sync {
            f.sync_data().unwrap();
        }
    }

    fn sync_dir(dir: &Path) {
        std::fs::File::open(dir).unwrap().sync_all().unwrap();
    }

    #[test]
    fn unsynced_data_is_gone_after_a_cut_and_synced_data_stays() {
        let Some((root, fs)) = fresh("powerfs-drop") else {
            return;
        };
        write_file(&root.join("synced"), b"kept", true);
        write_file(&root.join("unsynced"), b"lost", false);
        sync_dir(&root);
        // Appended after the sync: gone.
        std::fs::OpenOptions::new()
            .append(true)
            .open(root.join("synced"))
            .unwrap()
            .write_all(b" and more")
            .unwrap();
        assert_eq!(
            std::fs::read(root.join("synced")).unwrap(),
            b"kept and more"
        );
        let report = fs.cut(Cut::DropUnsynced);
        assert_eq!(std::fs::read(root.join("synced")).unwrap(), b"kept");
        // Its name was synced, its bytes were not: an empty file.
        assert_eq!(std::fs::read(root.join("unsynced")).unwrap(), b"");
        assert!(report.dropped_changes >= 2, "{report:?}");
    }

    #[test]
    fn a_name_is_durable_only_once_its_directory_is_synced() {
        let Some((root, fs)) = fresh("powerfs-names") else {
            return;
        };
        write_file(&root.join("old"), b"old", true);
        sync_dir(&root);
        // The classic: synced bytes, a rename over the old name, no sync of
        // the directory.
        write_file(&root.join("new.tmp"), b"new", true);
        std::fs::rename(root.join("new.tmp"), root.join("old")).unwrap();
        write_file(&root.join("never-named"), b"synced bytes", true);
        std::fs::create_dir(root.join("sub")).unwrap();
        fs.cut(Cut::DropUnsynced);
        assert_eq!(std::fs::read(root.join("old")).unwrap(), b"old");
        assert!(!root.join("new.tmp").exists());
        assert!(!root.join("never-named").exists());
        assert!(!root.join("sub").exists());
        // The same, with the directory synced: the new file stays.
        write_file(&root.join("new.tmp"), b"new", true);
        std::fs::rename(root.join("new.tmp"), root.join("old")).unwrap();
        sync_dir(&root);
        fs.cut(Cut::DropUnsynced);
        assert_eq!(std::fs::read(root.join("old")).unwrap(), b"new");
        // A hard link (how berth creates a file that must not exist yet)
        // and an unlink follow the same rule.
        write_file(&root.join("a.tmp"), b"linked", true);
        std::fs::hard_link(root.join("a.tmp"), root.join("a")).unwrap();
        std::fs::remove_file(root.join("a.tmp")).unwrap();
        sync_dir(&root);
        std::fs::remove_file(root.join("old")).unwrap();
        fs.cut(Cut::DropUnsynced);
        assert_eq!(std::fs::read(root.join("a")).unwrap(), b"linked");
        assert!(!root.join("a.tmp").exists());
        assert_eq!(std::fs::read(root.join("old")).unwrap(), b"new");
    }

    #[test]
    fn a_torn_write_keeps_a_prefix_of_what_was_written() {
        let Some((root, fs)) = fresh("powerfs-torn") else {
            return;
        };
        let page: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8 + 1).collect();
        write_file(&root.join("f"), &vec![0u8; 8192], true);
        sync_dir(&root);
        let mut torn = 0;
        let mut whole = 0;
        let mut none = 0;
        for seed in 1..200u64 {
            // Zeros again, synced: what an earlier cut kept is on the disk.
            write_file(&root.join("f"), &vec![0u8; 8192], true);
            overwrite(&root.join("f"), &page, false);
            fs.cut(Cut::Torn(seed));
            let after = std::fs::read(root.join("f")).unwrap();
            assert_eq!(after.len(), 8192);
            // A prefix of the new bytes, then the old (zeros), never a mix.
            let new_part = after.iter().take_while(|b| **b != 0).count();
            assert_eq!(&after[..new_part], &page[..new_part]);
            assert!(after[new_part..].iter().all(|b| *b == 0), "seed {seed}");
            match new_part {
                0 => none += 1,
                8192 => whole += 1,
                _ => torn += 1,
            }
        }
        assert!(
            torn > 0 && whole > 0,
            "torn {torn}, whole {whole}, none {none}"
        );
        // Synced bytes are never torn.
        overwrite(&root.join("f"), &page, true);
        fs.cut(Cut::Torn(7));
        assert_eq!(std::fs::read(root.join("f")).unwrap(), page);
    }

    /// What a cut keeps reached the disk: a later cut, with nothing
    /// unsynced, keeps it too. (It once stayed only in the served bytes,
    /// so the next cut took a torn checkpoint's pages back to what was
    /// under them, after redb had built later commits on those pages:
    /// both of its commit slots then failed their checksums.)
    #[test]
    fn what_a_cut_keeps_stays_through_the_next_cut() {
        let Some((root, fs)) = fresh("powerfs-kept") else {
            return;
        };
        write_file(&root.join("f"), b"old bytes", true);
        sync_dir(&root);
        overwrite(&root.join("f"), b"NEW BYTES", false);
        // One unsynced write in `f`: torn, it keeps its first half.
        fs.cut(Cut::TearOne { seed: 1, file: "f" });
        let kept = std::fs::read(root.join("f")).unwrap();
        assert_eq!(kept, b"NEW bytes");
        fs.cut(Cut::DropUnsynced);
        assert_eq!(std::fs::read(root.join("f")).unwrap(), kept);
        // A name a cut kept stays named.
        write_file(&root.join("named"), b"synced", true);
        let mut kept_name = false;
        for seed in 1..64u64 {
            fs.cut(Cut::Torn(seed));
            if root.join("named").exists() {
                kept_name = true;
                break;
            }
            write_file(&root.join("named"), b"synced", true);
        }
        assert!(kept_name, "no torn cut kept the unsynced name in 63 tries");
        fs.cut(Cut::DropUnsynced);
        assert_eq!(std::fs::read(root.join("named")).unwrap(), b"synced");
    }

    #[test]
    fn while_the_power_is_off_nothing_reaches_the_disk() {
        let Some((root, fs)) = fresh("powerfs-sever") else {
            return;
        };
        write_file(&root.join("f"), b"before", true);
        sync_dir(&root);
        fs.sever();
        let error = std::fs::write(root.join("f"), b"after").unwrap_err();
        assert_eq!(error.raw_os_error(), Some(5), "{error}");
        fs.cut(Cut::DropUnsynced);
        assert_eq!(std::fs::read(root.join("f")).unwrap(), b"before");
        let (file_syncs, dir_syncs) = fs.syncs();
        assert!(file_syncs >= 1 && dir_syncs >= 1);
    }
}
