//! The redo log's record writes: whole blocks, past the page cache where
//! the file system allows (`O_DIRECT`).
//!
//! Why it exists: a record written into the page cache and synced with
//! fdatasync makes the kernel find the dirty pages, build their writes,
//! wait for them and then flush the disk's cache. Written with `O_DIRECT`,
//! the record goes to the disk in the write itself, and the fdatasync that
//! follows only flushes (`benches/submit.rs` compares the two).
//!
//! `O_DIRECT` takes only whole blocks, from memory aligned to them, at
//! offsets aligned to them: so every record starts on a block of its own
//! and is padded with zeros to the end of its last one. That also means a
//! write never covers a block that holds an earlier record (one already
//! acknowledged): a page-cache write of a partly filled page wrote those
//! records again with every sync, where a torn write could reach them.
//!
//! A file system that refuses `O_DIRECT` (tmpfs; some FUSE file systems)
//! gets the same blocks through the page cache: the log's format does not
//! depend on how it was written.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// The block every record starts on and is padded to. 4 KiB: the page
/// size, and the logical block of every disk `O_DIRECT` is used on here
/// (most take 512 B; 4 KiB satisfies both).
pub const LOG_BLOCK_BYTES: usize = 4096;

/// A scratch buffer that grew past this (a large batch) is given back
/// after its write rather than kept.
const KEPT_SCRATCH_BYTES: usize = 4 << 20;

/// `len` rounded up to whole blocks.
pub fn padded(len: usize) -> usize {
    len.div_ceil(LOG_BLOCK_BYTES) * LOG_BLOCK_BYTES
}

/// The first block boundary at or after `at`.
pub fn block_start(at: u64) -> u64 {
    at.div_ceil(LOG_BLOCK_BYTES as u64) * LOG_BLOCK_BYTES as u64
}

/// Writes records of one log file as whole blocks.
pub struct BlockWriter {
    /// A handle opened with `O_DIRECT`, or `None` where the file system
    /// refused it (the writes then go through the log's own handle).
    direct: Option<File>,
    /// Where a record is copied, padded, for its write: the block-aligned
    /// window of it (`aligned`). Kept between writes.
    scratch: Vec<u8>,
}

impl BlockWriter {
    /// Opens `path` again with `O_DIRECT` for writing, if its file system
    /// allows.
    pub fn open(path: &Path) -> BlockWriter {
        let direct = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(nix::fcntl::OFlag::O_DIRECT.bits())
            .open(path);
        let direct = match direct {
            Ok(file) => Some(file),
            Err(e) => {
                tracing::debug!(error = %e, path = %path.display(),
                    "the redo log's file system refuses O_DIRECT; records go through the page cache");
                None
            }
        };
        BlockWriter {
            direct,
            scratch: Vec::new(),
        }
    }

    /// Whether records bypass the page cache.
    #[cfg(test)]
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Writes `bytes` at `at` (a block boundary), then zeros to the end of
    /// its last block; through `buffered` when there is no `O_DIRECT`
    /// handle, or when the direct write is refused as misaligned (a disk
    /// whose blocks are larger than `LOG_BLOCK_BYTES`: every later write
    /// goes through `buffered` too). Not synced. Returns the length written.
    pub fn write(&mut self, buffered: &File, bytes: &[u8], at: u64) -> std::io::Result<u64> {
        debug_assert_eq!(at % LOG_BLOCK_BYTES as u64, 0, "a record starts on a block");
        let len = padded(bytes.len());
        let written = match aligned(&mut self.scratch, len) {
            Some(window) => {
                window[..bytes.len()].copy_from_slice(bytes);
                window[bytes.len()..].fill(0);
                let window = &*window;
                match &self.direct {
                    Some(direct) => match direct_write(direct, window, at) {
                        Err(e) if e.raw_os_error() == Some(nix::libc::EINVAL) => {
                            tracing::warn!(error = %e,
                                "the redo log's disk refuses its O_DIRECT writes; records go through the page cache from now on");
                            self.direct = None;
                            buffered.write_all_at(window, at)
                        }
                        other => other,
                    },
                    None => buffered.write_all_at(window, at),
                }
            }
            None => {
                // No aligned window to be had (`align_offset` may refuse):
                // the page cache takes any buffer.
                let zeros = vec![0u8; len - bytes.len()];
                buffered
                    .write_all_at(bytes, at)
                    .and_then(|()| buffered.write_all_at(&zeros, at + bytes.len() as u64))
            }
        };
        if self.scratch.len() > KEPT_SCRATCH_BYTES {
            self.scratch = Vec::new();
        }
        written.map(|()| len as u64)
    }
}

/// Writes `window` at `at` through the `O_DIRECT` handle; the
/// `redo.direct_write` failpoint refuses it as a disk with larger blocks
/// would (`EINVAL`).
fn direct_write(direct: &File, window: &[u8], at: u64) -> std::io::Result<()> {
    match crate::failpoints::hit("redo.direct_write", "") {
        true => Err(std::io::Error::from_raw_os_error(nix::libc::EINVAL)),
        false => direct.write_all_at(window, at),
    }
}

/// A block-aligned window of `len` bytes of `scratch`, grown to hold one.
fn aligned(scratch: &mut Vec<u8>, len: usize) -> Option<&mut [u8]> {
    let needed = len + LOG_BLOCK_BYTES;
    if scratch.len() < needed {
        scratch.resize(needed, 0);
    }
    let offset = scratch.as_ptr().align_offset(LOG_BLOCK_BYTES);
    scratch.get_mut(offset..offset.checked_add(len)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a record of one block and 10 bytes at the second block of
    /// a file of four blocks of 0xAB, and checks every byte of the file.
    fn write_one_record(writer: &mut BlockWriter, path: &Path) {
        let buffered = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        buffered
            .write_all_at(&[0xAB; 4 * LOG_BLOCK_BYTES], 0)
            .unwrap();
        let record = vec![7u8; LOG_BLOCK_BYTES + 10];
        let written = writer
            .write(&buffered, &record, LOG_BLOCK_BYTES as u64)
            .unwrap();
        assert_eq!(written, 2 * LOG_BLOCK_BYTES as u64);
        let bytes = std::fs::read(path).unwrap();
        assert_eq!(bytes.len(), 4 * LOG_BLOCK_BYTES);
        assert!(
            bytes[..LOG_BLOCK_BYTES].iter().all(|b| *b == 0xAB),
            "the block before is untouched"
        );
        let at = LOG_BLOCK_BYTES;
        assert_eq!(&bytes[at..at + record.len()], &record[..]);
        assert!(
            bytes[at + record.len()..3 * LOG_BLOCK_BYTES]
                .iter()
                .all(|b| *b == 0),
            "zeros to the block's end"
        );
        assert!(
            bytes[3 * LOG_BLOCK_BYTES..].iter().all(|b| *b == 0xAB),
            "the block after is untouched"
        );
    }

    /// Says, visibly and where `.ci/run` counts them
    /// (`BERTH_SKIPPED_FILE`), that part of a test could not run here.
    fn skipped(test: &str, why: &str) {
        use std::io::Write;
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test} cannot run on this machine: {why}. In CI (CI=true) a test that cannot run fails"
        );
        let line = format!("skipped: {test}: {why}\n");
        let _ = std::io::stderr().write_all(line.as_bytes());
        if let Ok(path) = std::env::var("BERTH_SKIPPED_FILE") {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path);
            if let Ok(mut file) = file {
                let _ = file.write_all(line.as_bytes());
            }
        }
    }

    #[test]
    fn a_record_is_written_whole_blocks_from_its_start_with_zeros_behind_it_direct_or_not() {
        // Under the crate's own target dir, on the disk of the checkout
        // (a temp dir may be tmpfs, which refuses O_DIRECT).
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("target")
            .join(format!("berth-blocks-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("log");
        std::fs::write(&path, b"").unwrap();
        let mut writer = BlockWriter::open(&path);
        match writer.is_direct() {
            true => write_one_record(&mut writer, &path),
            false => skipped(
                "store::blocks::tests (the O_DIRECT half; the page-cache half runs)",
                &format!("{} refuses O_DIRECT", dir.display()),
            ),
        }
        writer.direct = None;
        write_one_record(&mut writer, &path);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn padding_and_block_starts_round_up_to_whole_blocks() {
        assert_eq!(padded(1), LOG_BLOCK_BYTES);
        assert_eq!(padded(LOG_BLOCK_BYTES), LOG_BLOCK_BYTES);
        assert_eq!(padded(LOG_BLOCK_BYTES + 1), 2 * LOG_BLOCK_BYTES);
        assert_eq!(block_start(0), 0);
        assert_eq!(block_start(1), LOG_BLOCK_BYTES as u64);
        assert_eq!(block_start(LOG_BLOCK_BYTES as u64), LOG_BLOCK_BYTES as u64);
    }
}
