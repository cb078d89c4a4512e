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
}
