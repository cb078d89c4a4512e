//! `berth audit verify | push-head | public-key` (spec audit.md "Verify"),
//! and the checkpoint signing key `berth serve` creates on first start.
//!
//! These commands run beside a live server: they open the store read-only
//! (the server opens it in `SingleWriter` mode), read no service token and
//! no deployer secret. The last head a sink accepted is kept beside the
//! store in `audit-pushed-head.json`: only the server writes the store,
//! and `push-head` runs while it does.

use std::path::Path;

use base64::Engine as _;
use serde_json::json;
use signed_note::{Note, Signer as _};

use crate::audit::{merkle, PushedHead, Report, Walk};
use crate::store::{AuditLookup, ReadOnlyStore, StoredNodes};

/// The signing key's file in the data dir.
pub const SIGNING_KEY_FILE: &str = "audit-signing.key";
/// The last head a sink accepted.
pub const PUSHED_HEAD_FILE: &str = "audit-pushed-head.json";
/// How long push-head waits for the sink.
const SINK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// The sink's answer is read up to this many bytes (for the error line).
const MAX_SINK_ANSWER: usize = 4096;

/// Exit codes: 0 the chain is intact (and the sink took it), 1 a problem
/// or a refusal, 2 the command could not run.
const EXIT_PROBLEM: i32 = 1;
pub const EXIT_CANNOT_RUN: i32 = 2;

/// `berth/<hostname>/audit`, or `--audit-origin`.
pub fn origin(configured: Option<&str>) -> String {
    if let Some(o) = configured {
        return o.to_string();
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty() && signed_note::is_key_name_valid(h))
        .unwrap_or_else(|| "localhost".into());
    format!("berth/{host}/audit")
}

/// Loads the Ed25519 key, creating it (mode 0600) when absent.
pub fn ensure_signing_key(data_dir: &Path) -> Result<ed25519_dalek::SigningKey, String> {
    let path = data_dir.join(SIGNING_KEY_FILE);
    if path.exists() {
        return load_signing_key(data_dir);
    }
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| format!("no randomness for the audit key: {e}"))?;
    crate::durable::create(
        &path,
        format!("{}\n", crate::hex::encode(&seed)).as_bytes(),
        0o600,
    )
    .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    tracing::info!(path = %path.display(), "created the audit checkpoint signing key");
    Ok(ed25519_dalek::SigningKey::from_bytes(&seed))
}

fn load_signing_key(data_dir: &Path) -> Result<ed25519_dalek::SigningKey, String> {
    let path = data_dir.join(SIGNING_KEY_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "cannot read {}: {e} (berth serve creates it on first start)",
            path.display()
        )
    })?;
    let seed: [u8; 32] = crate::hex::decode(text.trim())
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| format!("{} is not 64 hex digits", path.display()))?;
    Ok(ed25519_dalek::SigningKey::from_bytes(&seed))
}

/// The C2SP verifier key line: `<name>+<hex key id>+<base64(0x01 || key)>`.
pub fn verifier_key(origin: &str, key: &ed25519_dalek::SigningKey) -> String {
    signed_note::new_ed25519_verifier_key(origin, &key.verifying_key())
}

fn signer(
    origin: &str,
    key: &ed25519_dalek::SigningKey,
) -> Result<signed_note::StandardSigner, String> {
    let mut encoded = vec![1u8];
    encoded.extend_from_slice(&key.verifying_key().to_bytes());
    let id = signed_note::key_id(origin, &encoded);
    let mut private = vec![1u8];
    private.extend_from_slice(&key.to_bytes());
    let skey = format!(
        "PRIVATE+KEY+{origin}+{id:08x}+{}",
        base64::engine::general_purpose::STANDARD.encode(private)
    );
    signed_note::StandardSigner::new(&skey)
        .map_err(|e| format!("the audit origin cannot name a signing key: {e}"))
}

/// The signed C2SP `tlog-checkpoint` of a tree head.
pub fn checkpoint(
    origin: &str,
    key: &ed25519_dalek::SigningKey,
    size: u64,
    root: &merkle::Hash,
) -> Result<String, String> {
    let text = format!(
        "{origin}\n{size}\n{}\n",
        base64::engine::general_purpose::STANDARD.encode(root)
    );
    let mut note = Note::new(text.as_bytes(), &[]).map_err(|e| format!("checkpoint: {e}"))?;
    let s = signer(origin, key)?;
    debug_assert_eq!(s.name(), origin);
    note.add_sigs(&[&s])
        .map_err(|e| format!("checkpoint: {e}"))?;
    String::from_utf8(note.to_bytes()).map_err(|_| "checkpoint is not text".into())
}

fn read_pushed(data_dir: &Path) -> Result<Option<PushedHead>, String> {
    let path = data_dir.join(PUSHED_HEAD_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|_| format!("{} is not a pushed head", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

fn write_pushed(data_dir: &Path, head: &PushedHead) -> Result<(), String> {
    let path = data_dir.join(PUSHED_HEAD_FILE);
    let json = serde_json::to_vec(head).map_err(|e| e.to_string())?;
    crate::durable::replace(&path, &json, 0o600)
        .map_err(|e| format!("cannot record the pushed head in {}: {e}", path.display()))
}

/// Walks the chain of the store in `data_dir`.
pub fn verify(data_dir: &Path) -> Result<Report, String> {
    verify_at(data_dir, data_dir)
}

/// Walks the chain of the store in `store_dir`, against the last head
/// pushed from `state_dir` (a replica's data dir; for a cluster the store
/// is a snapshot of the database loaded elsewhere).
pub fn verify_at(store_dir: &Path, state_dir: &Path) -> Result<Report, String> {
    let db = store_dir.join("berth.redb");
    if !db.exists() {
        return Err(format!("no store at {}", db.display()));
    }
    let store = ReadOnlyStore::open(&db, crate::store::SnapshotScope::Audit)
        .map_err(|e| format!("cannot open {}: {e}", db.display()))?;
    let rx = store.read().map_err(|e| e.to_string())?;
    let anchor = rx.audit_anchor().map_err(|e| e.to_string())?;
    let mut walk = Walk::new(anchor, read_pushed(state_dir)?);
    rx.walk_audit(&mut walk).map_err(|e| e.to_string())?;
    Ok(walk.finish())
}

fn print_report(report: &Report, json: bool) {
    if json {
        match serde_json::to_string(report) {
            Ok(text) => println!("{text}"),
            Err(e) => eprintln!("berth audit verify: cannot encode the report as JSON: {e}"),
        }
        return;
    }
    let head = report
        .head
        .as_ref()
        .map(|h| format!("head seq {} hash {}", h.seq, h.hash))
        .unwrap_or_else(|| "no events kept".into());
    if report.ok {
        println!(
            "audit chain intact: size {}, {head}, merkle root {}",
            report.size, report.merkle_root
        );
        return;
    }
    for p in &report.problems {
        let kind = serde_json::to_value(p.kind).unwrap_or_default();
        println!("seq {}: {}", p.seq, kind.as_str().unwrap_or("?"));
    }
    if report.problems_not_listed > 0 {
        println!("... and {} more problems", report.problems_not_listed);
    }
    println!(
        "audit chain BROKEN: {} problems; size {}, {head}",
        report.problems.len() as u64 + report.problems_not_listed,
        report.size
    );
}

pub fn run_verify(data_dir: &Path, json: bool) -> i32 {
    run_verify_at(data_dir, data_dir, json)
}

/// `run_verify` of the store in `store_dir` against `state_dir`'s pushed
/// head (`verify_at`).
pub fn run_verify_at(store_dir: &Path, state_dir: &Path, json: bool) -> i32 {
    match verify_at(store_dir, state_dir) {
        Ok(report) => {
            print_report(&report, json);
            if report.ok {
                0
            } else {
                EXIT_PROBLEM
            }
        }
        Err(e) => {
            if json {
                println!("{}", json!({"ok": false, "error": e}));
            }
            eprintln!("berth audit verify: {e}");
            EXIT_CANNOT_RUN
        }
    }
}

pub fn run_public_key(data_dir: &Path, configured_origin: Option<&str>) -> i32 {
    let origin = origin(configured_origin);
    match load_signing_key(data_dir) {
        Ok(key) => {
            println!("{}", verifier_key(&origin, &key));
            0
        }
        Err(e) => {
            eprintln!("berth audit public-key: {e}");
            EXIT_CANNOT_RUN
        }
    }
}

/// `berth audit push-head`: the chain of the store in `store_dir`, signed
/// with `state_dir`'s key, the accepted head recorded there (both the data
/// dir, or for a cluster a snapshot and the replica's data dir).
pub fn run_push_head(
    store_dir: &Path,
    state_dir: &Path,
    sink: &str,
    configured_origin: Option<&str>,
) -> i32 {
    let origin = origin(configured_origin);
    match push_head(store_dir, state_dir, sink, &origin) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("berth audit push-head: {e}");
            EXIT_CANNOT_RUN
        }
    }
}

fn push_head(store_dir: &Path, state_dir: &Path, sink: &str, origin: &str) -> Result<i32, String> {
    let key = load_signing_key(state_dir)?;
    let report = verify_at(store_dir, state_dir)?;
    if !report.ok {
        print_report(&report, false);
        eprintln!("berth audit push-head: the chain has problems; nothing pushed");
        return Ok(EXIT_PROBLEM);
    }
    let root: merkle::Hash =
        crate::audit::decode_hash(&report.merkle_root).ok_or("the verify report has no root")?;
    let checkpoint = checkpoint(origin, &key, report.size, &root)?;
    let mut body = json!({"checkpoint": checkpoint, "verify": report});
    // The consistency proof from the last accepted head, so a witness that
    // kept that head checks this one extends it.
    if let Some(consistency) = consistency_from_last(store_dir, state_dir, &report)? {
        body["consistency"] = consistency;
    }
    let (status, answer) = post_to_sink(sink, &body)?;
    if !status.is_success() {
        eprintln!(
            "berth audit push-head: the sink refused the head (HTTP {}): {}",
            status.as_u16(),
            answer.trim()
        );
        return Ok(EXIT_PROBLEM);
    }
    write_pushed(
        state_dir,
        &PushedHead {
            size: report.size,
            root: report.merkle_root.clone(),
            at: crate::model::format_time(crate::model::now_millis()),
        },
    )?;
    println!(
        "pushed head: size {}, root {}",
        report.size, report.merkle_root
    );
    Ok(0)
}

/// The consistency proof from the last head the sink accepted to this
/// report's, when there is one to prove.
fn consistency_from_last(
    store_dir: &Path,
    state_dir: &Path,
    report: &Report,
) -> Result<Option<serde_json::Value>, String> {
    let Some(last) = read_pushed(state_dir)? else {
        return Ok(None);
    };
    if last.size < 1 || last.size > report.size || last.size < report.anchor.first_seq {
        return Ok(None);
    }
    let db = store_dir.join("berth.redb");
    let store =
        ReadOnlyStore::open(&db, crate::store::SnapshotScope::Audit).map_err(|e| e.to_string())?;
    let rx = store.read().map_err(|e| e.to_string())?;
    let path = merkle::consistency_path(&StoredNodes(&rx), last.size, report.size)
        .map_err(|e| e.to_string())?;
    Ok(Some(json!({
        "from": last.size, "to": report.size,
        "from_root": last.root, "to_root": report.merkle_root,
        "path": path.iter().map(|h| crate::hex::encode(h)).collect::<Vec<_>>(),
    })))
}

/// POSTs `body` to the sink: its status and at most `MAX_SINK_ANSWER`
/// bytes of its answer (read chunk by chunk, so a sink that answers
/// without end costs no more memory than that).
fn post_to_sink(
    sink: &str,
    body: &serde_json::Value,
) -> Result<(reqwest::StatusCode, String), String> {
    if rustls::crypto::ring::default_provider()
        .install_default()
        .is_err()
    {
        tracing::debug!("a TLS provider was installed already");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(SINK_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| e.to_string())?;
        let mut response = client
            .post(sink)
            .json(body)
            .send()
            .await
            .map_err(|e| format!("the sink is unreachable: {}", without_url(&e)))?;
        let status = response.status();
        let mut kept: Vec<u8> = Vec::new();
        while kept.len() < MAX_SINK_ANSWER {
            let chunk = response
                .chunk()
                .await
                .map_err(|e| format!("the sink's answer could not be read: {}", without_url(&e)))?;
            let Some(chunk) = chunk else { break };
            let room = MAX_SINK_ANSWER - kept.len();
            kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
        }
        Ok((status, String::from_utf8_lossy(&kept).to_string()))
    })
}

/// An HTTP error without the URL (it may hold credentials).
fn without_url(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timed out".into()
    } else if e.is_connect() {
        "connection failed".into()
    } else {
        "request failed".into()
    }
}
