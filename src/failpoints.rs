//! Places where a test makes storage fail for good, so the paths that only
//! a broken disk takes are tested (storage.md "Power loss"; tests in
//! tests/integration/failpoints.rs). Built on the `fail` crate, as TiKV
//! uses it, behind the `failpoints` feature: `cargo test --features
//! failpoints` turns them on, and a build without the feature (every
//! release) has none: `hit` is then `false` and compiles away.
//!
//! A test names the places in `FAILPOINTS` when it starts berth, as the
//! crate reads it: `build.final_commit=return` (every time),
//! `build.final_commit=1*return` (once), `submit.job=return(dep-id)` (only
//! for that subject).
//!
//! The places (each a write job; the error fails it for good, not as a
//! passing I/O error, so no retry hides it, except where said):
//! - `build.final_commit`: a build's final commit (subject: the build id);
//! - `submit.job`: a submit's write job (subject: the deployment id);
//! - `audit.alone`: the audit event of a call that changed nothing;
//! - `redo.append`: a redo log append (the batch's transaction aborts);
//! - `redo.commit`: redb's commit right after a redo log append's sync
//!   (the record is taken back out of the log, the batch's rows dropped).
//!   Both take as argument bytes the batch's rows must hold
//!   (`redo.commit=return(dep-id)`);
//! - `redo.void`: the write that voids a refused record's header in the
//!   redo log (the log then refuses to write until it can void it);
//! - `redo.direct_write`: a redo log record's `O_DIRECT` write
//!   (`store/blocks.rs`), refused with `EINVAL` as a disk whose blocks are
//!   larger than 4 KiB refuses it (the log then writes through the page
//!   cache for good; this one is not a failure the caller sees);
//! - `redb.checkpoint`: a checkpoint (redb's durable commit): `sleep(ms)`
//!   holds each one back, `return(8)` fails the process's 8th (subject: its
//!   number), and the store is then reopened from its redo log;
//! - `recover.job`: a start's write that marks an interrupted build failed
//!   (subject: the build id). It fails as a full disk does, a failure that
//!   may pass, so recovery retries it: `recover.job=3*return`.
//!
//! A failed place fails with `StoreError::injected`. This module is a leaf
//! (it names no other module), so the store can use it too.

/// Whether the failpoint `name` is set to fail for `subject` (a `return`
/// without an argument fails every subject).
#[cfg(feature = "failpoints")]
pub fn hit(name: &str, subject: &str) -> bool {
    fail::eval(name, |arg| arg.is_none_or(|a| a.is_empty() || a == subject)).unwrap_or(false)
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &str, _subject: &str) -> bool {
    false
}

/// Whether the failpoint `name` is set to fail where `bytes` hold its
/// argument (a redo record naming a deployment); without an argument, always.
#[cfg(feature = "failpoints")]
pub fn hit_in(name: &str, bytes: &[u8]) -> bool {
    fail::eval(name, |arg| {
        arg.is_none_or(|a| a.is_empty() || memchr::memmem::find(bytes, a.as_bytes()).is_some())
    })
    .unwrap_or(false)
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit_in(_name: &str, _bytes: &[u8]) -> bool {
    false
}

/// Reads `FAILPOINTS` for the life of the process (a no-op without the
/// feature).
pub struct Scenario {
    #[cfg(feature = "failpoints")]
    _scenario: fail::FailScenario<'static>,
}

pub fn setup() -> Scenario {
    Scenario {
        #[cfg(feature = "failpoints")]
        _scenario: fail::FailScenario::setup(),
    }
}
