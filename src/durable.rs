//! Files berth relies on after a restart (the secrets, the audit signing
//! key, the last pushed head, a deployer's state), written so that a power
//! cut leaves either the old file or the new one, never a part of either
//! (storage.md "Power loss"): the bytes go to a temporary file in the same
//! directory, which is synced, then moved into place (renamed over the old
//! file, or linked to a name that must not exist yet), then the directory
//! is synced so the new name itself is durable.
//!
//! Why it exists: a secret created in place and cut before its sync was
//! left empty, and every later start refused it ("... is empty") until
//! someone deleted it by hand.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// A temporary name beside `path`, unique to this call.
fn temporary(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", uuid::Uuid::now_v7().simple()));
    path.with_file_name(name)
}

fn directory(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// Writes `bytes` to a new temporary file of `mode` beside `path`, synced.
fn write_temporary(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<PathBuf> {
    let tmp = temporary(path);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()));
    match written {
        Ok(()) => Ok(tmp),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Syncs a directory, so the names created, renamed or removed in it are
/// durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Creates `dir` (mode `mode`) and each missing parent, each made durable
/// by syncing the directory it was created in: a file synced into a
/// directory whose own name was never synced is lost with it at a power
/// cut. Does nothing when `dir` exists.
pub fn create_dir_all(dir: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    let parent = directory(dir);
    create_dir_all(parent, mode)?;
    match std::fs::DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => sync_dir(parent),
        // Made meanwhile by someone else, who syncs it.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(e),
    }
}

/// Replaces `path` with `bytes` (mode `mode`) atomically and durably.
pub fn replace(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let dir = directory(path);
    create_dir_all(dir, 0o777)?;
    let tmp = write_temporary(path, bytes, mode)?;
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(dir)
}

/// Creates `path` with `bytes` (mode `mode`) atomically and durably; fails
/// with `AlreadyExists` when it exists (a hard link never overwrites).
pub fn create(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let dir = directory(path);
    let tmp = write_temporary(path, bytes, mode)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    linked?;
    sync_dir(dir)
}

/// The mode of every file berth writes under its data dir: readable by
/// berth only (the store, its redo log and the secrets hold every
/// configuration's secrets).
pub const PRIVATE_FILE_MODE: u32 = 0o600;
/// The mode of the data dir and every directory berth makes in it.
pub const PRIVATE_DIR_MODE: u32 = 0o700;
/// What `create_files_private` masks: group and other get nothing.
const PRIVATE_UMASK: u32 = 0o077;

/// Sets the process's file-creation mask so every file and directory it
/// creates from now on (redb's store file, an import's new file, the redo
/// log, a snapshot copy) is private from its first byte. A chmod after
/// the fact would revoke nothing: a descriptor opened in between keeps
/// reading the file. Deployers get the usual 022 back (`runner`'s gate).
pub fn create_files_private() {
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(PRIVATE_UMASK));
}

/// Narrows `dir` to `PRIVATE_DIR_MODE` and every entry directly in it to
/// berth alone (group and other bits cleared; symlinks are left as they
/// are): a data dir an older berth made 0711, or files it made 0644, are
/// private again from this start on.
pub fn make_private(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(PRIVATE_DIR_MODE))?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = std::fs::symlink_metadata(entry.path())?;
        let mode = meta.permissions().mode() & 0o7777;
        if meta.file_type().is_symlink() || mode & PRIVATE_UMASK == 0 {
            continue;
        }
        let private = std::fs::Permissions::from_mode(mode & !PRIVATE_UMASK);
        std::fs::set_permissions(entry.path(), private)?;
    }
    Ok(())
}

/// Removes everything in `dir` but keeps `dir` itself, with its mode and
/// owner (a deployers' scratch root that `--deployer-user` made
/// traversable stays so). A missing `dir` is empty.
pub fn empty_dir(dir: &Path) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            std::fs::remove_dir_all(entry.path())?;
        } else {
            std::fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn create_never_overwrites_and_replace_does_and_neither_leaves_a_temporary() {
        let dir = std::env::temp_dir().join(format!("berth-durable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secret");
        create(&path, b"one", 0o600).unwrap();
        let e = create(&path, b"two", 0o600).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        replace(&path, b"three", 0o600).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"three");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("secret")],
            "a temporary file was left"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn make_private_narrows_the_dir_and_its_entries_and_empty_dir_keeps_the_dir() {
        let dir = std::env::temp_dir().join(format!("berth-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("scratch/call-1")).unwrap();
        std::fs::write(dir.join("berth.redo"), b"rows").unwrap();
        let set = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        set(&dir, 0o711);
        set(&dir.join("berth.redo"), 0o644);
        set(&dir.join("scratch"), 0o755);
        make_private(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("berth.redo")), 0o600);
        assert_eq!(mode(&dir.join("scratch")), 0o700);
        set(&dir.join("scratch"), 0o711);
        empty_dir(&dir.join("scratch")).unwrap();
        assert_eq!(mode(&dir.join("scratch")), 0o711, "the root keeps its mode");
        assert_eq!(std::fs::read_dir(dir.join("scratch")).unwrap().count(), 0);
        empty_dir(&dir.join("missing")).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
