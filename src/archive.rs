//! A deployment's work state as a tar archive (workers.md "The work
//! state"): made from a directory, checked, and unpacked into one.
//!
//! Why it exists: the work dir travels between berth and its workers, and
//! both sides must agree byte for byte on what an archive of the same
//! directory is (its digest says whether anything changed) and on what an
//! archive may hold (nothing that writes outside the directory it is
//! unpacked in). One module, used by `berth serve` and `berth worker`.
//!
//! An archive is a POSIX tar of directories, regular files and symbolic
//! links, entries in byte order of path, uid and gid 0, no owner names,
//! modes and mtimes kept; a path that does not fit the ustar header gets a
//! pax `path` (or `linkpath`) record. `check` refuses absolute paths, `..`,
//! an entry below a link, a path twice, any other kind of entry, more than
//! `MAX_ENTRIES` entries; links are never followed, when packing or
//! unpacking.

use std::collections::HashSet;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

/// The most entries one archive holds.
pub const MAX_ENTRIES: usize = 100_000;

/// The size of a tar header block; an entry's data is padded to it.
const BLOCK: u64 = 512;

/// An archive made from a directory, with its digest.
pub struct Packed {
    pub tar: Vec<u8>,
    /// `sha256:<64 hex>` of `tar`.
    pub digest: String,
}

/// Why a directory could not be packed (an outcome's `work_state_problem`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PackProblem {
    /// More than the byte limit, or more than `MAX_ENTRIES` entries.
    TooLarge,
    /// Something in it could not be read, or is not a file, directory or
    /// link; the text says what.
    Unreadable(String),
}

impl PackProblem {
    /// The protocol's word for it.
    pub fn as_str(&self) -> &'static str {
        match self {
            PackProblem::TooLarge => "too_large",
            PackProblem::Unreadable(_) => "unreadable",
        }
    }
}

/// `sha256:<64 hex>` of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", crate::hex::encode(&Sha256::digest(bytes)))
}

/// Whether `text` is a digest as `digest` writes it.
pub fn is_digest(text: &str) -> bool {
    text.strip_prefix("sha256:").is_some_and(|hex| {
        hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// Packs `dir` into an archive of at most `max_bytes`; `None` when the
/// directory is missing or empty (a work state of nothing).
pub fn pack(dir: &Path, max_bytes: u64) -> Result<Option<Packed>, PackProblem> {
    let mut entries = Vec::new();
    match std::fs::symlink_metadata(dir) {
        Ok(_) => walk(dir, PathBuf::new(), &mut entries)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(unreadable(dir, &e)),
    }
    if entries.is_empty() {
        return Ok(None);
    }
    entries.sort_by(|a, b| a.as_os_str().as_bytes().cmp(b.as_os_str().as_bytes()));
    let mut builder = tar::Builder::new(Vec::new());
    let mut written = 0u64;
    for rel in &entries {
        written = append(&mut builder, dir, rel, written, max_bytes)?;
    }
    let tar = builder
        .into_inner()
        .map_err(|e| PackProblem::Unreadable(format!("cannot finish the archive: {e}")))?;
    if tar.len() as u64 > max_bytes {
        return Err(PackProblem::TooLarge);
    }
    let digest = digest(&tar);
    Ok(Some(Packed { tar, digest }))
}

fn unreadable(path: &Path, e: &io::Error) -> PackProblem {
    PackProblem::Unreadable(format!("{}: {e}", path.display()))
}

/// Every path below `dir` (relative), links not followed.
fn walk(dir: &Path, rel: PathBuf, out: &mut Vec<PathBuf>) -> Result<(), PackProblem> {
    let here = dir.join(&rel);
    let listing = std::fs::read_dir(&here).map_err(|e| unreadable(&here, &e))?;
    for entry in listing {
        let entry = entry.map_err(|e| unreadable(&here, &e))?;
        let path = rel.join(entry.file_name());
        let kind = entry.file_type().map_err(|e| unreadable(&here, &e))?;
        out.push(path.clone());
        if out.len() > MAX_ENTRIES {
            return Err(PackProblem::TooLarge);
        }
        if kind.is_dir() {
            walk(dir, path, out)?;
        }
    }
    Ok(())
}

/// Appends one entry; returns the archive's size so far.
fn append(
    builder: &mut tar::Builder<Vec<u8>>,
    dir: &Path,
    rel: &Path,
    written: u64,
    max_bytes: u64,
) -> Result<u64, PackProblem> {
    let full = dir.join(rel);
    let meta = std::fs::symlink_metadata(&full).map_err(|e| unreadable(&full, &e))?;
    let mut header = tar::Header::new_ustar();
    header.set_mode(meta.mode() & 0o7777);
    // A tar mtime cannot be before 1970: an older file is archived at 0.
    header.set_mtime(u64::try_from(meta.mtime()).unwrap_or(0));
    header.set_uid(0);
    header.set_gid(0);
    header.set_size(0);
    let kind = meta.file_type();
    let data_len = if kind.is_file() { meta.len() } else { 0 };
    // Header, a pax record at most, and the data padded to a block.
    let next = written + 3 * BLOCK + data_len.div_ceil(BLOCK) * BLOCK;
    if next > max_bytes {
        return Err(PackProblem::TooLarge);
    }
    let failed = |e: io::Error| unreadable(&full, &e);
    if kind.is_dir() {
        header.set_entry_type(tar::EntryType::Directory);
        set_path(builder, &mut header, rel, "path").map_err(failed)?;
        header.set_cksum();
        builder.append(&header, io::empty()).map_err(failed)?;
    } else if kind.is_symlink() {
        let target = std::fs::read_link(&full).map_err(failed)?;
        header.set_entry_type(tar::EntryType::Symlink);
        set_path(builder, &mut header, rel, "path").map_err(failed)?;
        set_path(builder, &mut header, &target, "linkpath").map_err(failed)?;
        header.set_cksum();
        builder.append(&header, io::empty()).map_err(failed)?;
    } else if kind.is_file() {
        let file = std::fs::File::open(&full).map_err(failed)?;
        header.set_entry_type(tar::EntryType::Regular);
        header.set_size(data_len);
        set_path(builder, &mut header, rel, "path").map_err(failed)?;
        header.set_cksum();
        // A file that grew since its stat is cut at the stated size.
        builder
            .append(&header, file.take(data_len))
            .map_err(failed)?;
    } else {
        return Err(PackProblem::Unreadable(format!(
            "{} is not a file, directory or link",
            full.display()
        )));
    }
    Ok(builder.get_ref().len() as u64)
}

/// Sets a path (or a link's target) in the header, or, when it does not
/// fit there, writes a pax record with it first.
fn set_path(
    builder: &mut tar::Builder<Vec<u8>>,
    header: &mut tar::Header,
    path: &Path,
    key: &str,
) -> io::Result<()> {
    let fits = match key {
        "path" => header.set_path(path).is_ok(),
        _ => header.set_link_name(path).is_ok(),
    };
    if fits {
        return Ok(());
    }
    let record = pax_record(key, path.as_os_str().as_bytes());
    let mut pax = tar::Header::new_ustar();
    pax.set_entry_type(tar::EntryType::XHeader);
    pax.set_size(record.len() as u64);
    pax.set_path("././@PaxHeader")?;
    pax.set_cksum();
    builder.append(&pax, record.as_slice())?;
    // The header keeps a short stand-in; readers take the pax record.
    let stand_in = format!("long-{}", &digest(path.as_os_str().as_bytes())[7..27]);
    match key {
        "path" => header.set_path(&stand_in),
        _ => header.set_link_name(&stand_in),
    }
}

/// One pax record: `<length> <key>=<value>\n`, the length counting itself.
fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
    let rest = key.len() + value.len() + 3;
    let mut len = rest + 1;
    while len != rest + len.to_string().len() {
        len = rest + len.to_string().len();
    }
    let mut out = format!("{len} {key}=").into_bytes();
    out.extend_from_slice(value);
    out.push(b'\n');
    out
}

/// Checks an archive against the rules above; the error says which entry
/// broke which.
pub fn check(tar: &[u8]) -> Result<(), String> {
    let mut archive = tar::Archive::new(tar);
    // The tar crate's errors may quote the bytes it read: never passed on.
    let entries = archive
        .entries()
        .map_err(|_| "not a tar archive".to_string())?;
    let mut seen = HashSet::new();
    let mut links = HashSet::new();
    for (n, entry) in entries.enumerate() {
        if n >= MAX_ENTRIES {
            return Err(format!("more than {MAX_ENTRIES} entries"));
        }
        let entry = entry.map_err(|_| format!("entry {} is not a valid tar entry", n + 1))?;
        let path = entry
            .path()
            .map_err(|_| format!("entry {} has a path that cannot be read", n + 1))?
            .into_owned();
        check_path(&path, &links).map_err(|why| format!("{}: {why}", path.display()))?;
        match entry.header().entry_type() {
            tar::EntryType::Directory | tar::EntryType::Regular | tar::EntryType::Continuous => {}
            tar::EntryType::Symlink => {
                links.insert(normal(&path));
            }
            other => {
                return Err(format!(
                    "{}: a {other:?} entry (only files, directories and links)",
                    path.display()
                ))
            }
        }
        if !seen.insert(normal(&path)) {
            return Err(format!("{}: in the archive twice", path.display()));
        }
    }
    Ok(())
}

/// A path without `.` parts and a trailing slash, for comparing.
fn normal(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect()
}

fn check_path(path: &Path, links: &HashSet<PathBuf>) -> Result<(), &'static str> {
    if path.as_os_str().is_empty() {
        return Err("an empty path");
    }
    let mut above = PathBuf::new();
    for part in path.components() {
        match part {
            Component::Normal(name) => {
                if links.contains(&above) && !above.as_os_str().is_empty() {
                    return Err("below a link");
                }
                above.push(name);
            }
            Component::CurDir => {}
            Component::ParentDir => return Err("a `..` in the path"),
            Component::RootDir | Component::Prefix(_) => return Err("an absolute path"),
        }
    }
    if above.as_os_str().is_empty() {
        return Err("an empty path");
    }
    Ok(())
}

/// Makes `dir` hold exactly what `tar` holds (checked with `check` first):
/// whatever it held is removed.
pub fn unpack(tar: &[u8], dir: &Path) -> io::Result<()> {
    check(tar).map_err(|why| io::Error::new(io::ErrorKind::InvalidData, why))?;
    empty_dir(dir)?;
    let mut archive = tar::Archive::new(tar);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(false);
    archive.unpack(dir)
}

/// Removes `dir` with everything in it and makes it again, empty.
pub fn empty_dir(dir: &Path) -> io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::create_dir_all(dir)
}

/// Makes `dir` a deployer's work dir holding `tar` (empty for `None`),
/// owned by `owner` (the `--deployer-user`) when given, on the blocking
/// pool. The error says what failed.
pub async fn restore(
    tar: Option<Vec<u8>>,
    dir: PathBuf,
    owner: Option<(u32, u32)>,
) -> Result<(), String> {
    tokio::task::spawn_blocking(move || {
        match tar {
            Some(tar) => unpack(&tar, &dir),
            None => empty_dir(&dir),
        }
        .and_then(|()| chown_all(&dir, owner))
    })
    .await
    .map_err(|e| format!("unpacking the work state failed: {e}"))?
    .map_err(|e| format!("cannot unpack the work state: {e}"))
}

/// Gives `dir` and everything in it to `owner` (uid, gid), links
/// themselves and not what they name; nothing when `None`.
pub fn chown_all(dir: &Path, owner: Option<(u32, u32)>) -> io::Result<()> {
    let Some((uid, gid)) = owner else {
        return Ok(());
    };
    std::os::unix::fs::lchown(dir, Some(uid), Some(gid))?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            chown_all(&entry.path(), owner)?;
        } else {
            std::os::unix::fs::lchown(entry.path(), Some(uid), Some(gid))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "berth-archive-{name}-{}-{}",
            std::process::id(),
            crate::model::now_millis()
        ));
        empty_dir(&dir).expect("a scratch dir");
        dir
    }

    #[test]
    fn a_directory_packs_the_same_twice_and_unpacks_to_what_it_was() {
        let src = scratch("src");
        std::fs::create_dir_all(src.join("b/deep")).expect("dirs");
        std::fs::write(src.join("a.txt"), "alpha").expect("a file");
        std::fs::write(src.join("b/deep/z"), vec![7u8; 3000]).expect("a file");
        let long = "x".repeat(150);
        std::fs::write(src.join("b").join(&long), "long name").expect("a long name");
        std::os::unix::fs::symlink("a.txt", src.join("link")).expect("a link");
        let one = pack(&src, 1 << 20).expect("packs").expect("not empty");
        let two = pack(&src, 1 << 20).expect("packs").expect("not empty");
        assert_eq!(one.digest, two.digest, "the same directory, the same bytes");
        check(&one.tar).expect("its own archive is valid");
        let dst = scratch("dst");
        std::fs::write(dst.join("stale"), "from before").expect("a stale file");
        unpack(&one.tar, &dst).expect("unpacks");
        assert!(!dst.join("stale").exists(), "what was there is gone");
        assert_eq!(
            std::fs::read(dst.join("b/deep/z")).expect("z"),
            vec![7u8; 3000]
        );
        assert_eq!(
            std::fs::read_to_string(dst.join("b").join(&long)).expect("long"),
            "long name"
        );
        assert_eq!(
            std::fs::read_link(dst.join("link")).expect("a link"),
            Path::new("a.txt")
        );
        let again = pack(&dst, 1 << 20).expect("packs").expect("not empty");
        assert_eq!(again.digest, one.digest, "unpacked and packed: the same");
        assert!(matches!(pack(&src, 2048), Err(PackProblem::TooLarge)));
        assert!(pack(&scratch("empty"), 1 << 20).expect("packs").is_none());
        assert!(pack(&src.join("missing"), 1 << 20)
            .expect("packs")
            .is_none());
    }

    fn hostile(entries: &[(&str, tar::EntryType, &str)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, link) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_size(0);
            h.set_mode(0o644);
            // Written raw: the builder refuses `..` itself.
            let name = &mut h.as_old_mut().name;
            name[..path.len()].copy_from_slice(path.as_bytes());
            if !link.is_empty() {
                h.set_link_name(link).expect("a link name");
            }
            h.set_cksum();
            b.append(&h, io::empty()).expect("appends");
        }
        b.into_inner().expect("an archive")
    }

    #[test]
    fn an_archive_that_would_write_outside_its_dir_is_refused() {
        use tar::EntryType::{Block, Directory, Regular, Symlink};
        type Entries<'a> = &'a [(&'a str, tar::EntryType, &'a str)];
        let cases: [(Entries, &str); 6] = [
            (&[("../evil", Regular, "")], "`..`"),
            (&[("/etc/evil", Regular, "")], "absolute"),
            (
                &[("out", Symlink, "/etc"), ("out/passwd", Regular, "")],
                "below a link",
            ),
            (&[("d", Directory, ""), ("d", Regular, "")], "twice"),
            (&[("dev", Block, "")], "only files"),
            (&[("a/../../b", Regular, "")], "`..`"),
        ];
        for (entries, why) in cases {
            let err = check(&hostile(entries)).expect_err("refused");
            assert!(err.contains(why), "{err} should say {why}");
            let dst = scratch("hostile");
            assert!(unpack(&hostile(entries), &dst).is_err());
        }
        assert!(check(b"not a tar at all, just text that is long enough").is_err());
    }

    #[test]
    fn digests_are_checked_for_their_shape() {
        assert!(is_digest(&digest(b"x")));
        assert!(!is_digest("sha256:ABC"));
        assert!(!is_digest("md5:00"));
    }
}
