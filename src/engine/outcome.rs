//! What a build run produced, as plain values shared by the modules that
//! judge it (`verdict`), store it (`transition`, `sboms`) and run it
//! (`build`): how it ended, who stopped it, and each node's SBOM prepared
//! for the store. Data only, so none of those modules imports another for it.

use serde::{Deserialize, Serialize};

use crate::model::*;
use crate::sbom;
use crate::store::compress;

/// Why a running build is asked to stop (the deployer's group gets
/// SIGTERM, then SIGKILL after `--cancel-grace`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Halt {
    /// Nobody asked.
    No,
    /// `POST /v1/builds/{build}/cancel`: the build ends `cancelled`.
    Cancel,
    /// berth is stopping and `--shutdown-grace` is over: the build ends
    /// `failed` with `interrupted_by_shutdown`.
    Shutdown,
}

/// How a build ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct End {
    pub status: BuildStatus,
    pub failure: Option<Failure>,
    pub exit_code: Option<i32>,
}

impl End {
    pub fn failed(reason: FailureReason, detail: &str) -> End {
        End {
            status: BuildStatus::Failed,
            failure: Some(Failure::new(reason, detail)),
            exit_code: None,
        }
    }

    pub fn cancelled(detail: &str) -> End {
        End {
            status: BuildStatus::Cancelled,
            failure: Some(Failure::new(FailureReason::Cancelled, detail)),
            exit_code: None,
        }
    }
}

/// A node of a deploy result, with its SBOM read, checked and prepared for
/// the store (split, canonical, compressed) off the async runtime.
/// (A rollout stores its build's nodes with its plan: `Serialize`.)
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeOutcome {
    pub name: String,
    pub changed: bool,
    pub sbom: SbomOutcome,
    pub fingerprint: Option<String>,
    /// What an agent fetches to run the node (deployer.md), its file read
    /// and digested. Not kept with a rollout's stored result: only the
    /// final transaction of a deploy without `activate` uses it so far.
    #[serde(skip)]
    pub artifact: Option<crate::model::Artifact>,
    /// A file artifact's digest, size and zstd bytes, for the store (a
    /// bound node's document names it; only then is it stored).
    #[serde(skip)]
    pub artifact_bytes: Option<(String, u64, std::sync::Arc<Vec<u8>>)>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum SbomOutcome {
    Ready(PreparedSbom),
    /// Why the node has no SBOM from this deploy (a person reads it).
    Unavailable(String),
    /// `changed: false` without an SBOM: the node keeps the one it has.
    Kept,
}

/// A document split for the store.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PreparedSbom {
    /// zstd of the skeleton's JSON text.
    pub skeleton: Vec<u8>,
    pub had_components: bool,
    /// In the document's order.
    pub components: Vec<(sbom::Hash, ComponentBytes)>,
}

/// A component's bytes for the store: compressed when it was new when read;
/// a component already stored keeps only its text (compressed in the
/// transaction only if it was collected meanwhile). With 90% of components
/// shared, this spares most of the compression.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ComponentBytes {
    Compressed(Vec<u8>),
    Known(String),
}

impl ComponentBytes {
    pub fn compressed(&self) -> crate::store::StoreResult<Vec<u8>> {
        match self {
            ComponentBytes::Compressed(c) => Ok(c.clone()),
            ComponentBytes::Known(text) => compress::compress(text.as_bytes()),
        }
    }
}
