//! Build routes: list of a deployment's builds, read, log (with Range), cancel.

use super::auth::Caller;
use super::cursor::page_limit;
use super::deployments::deployment_id;
use super::errors::{ApiError, Code};
use super::idempotency::Write;
use super::ranges::{parse_range, resolve_range};
use super::{cursor, Answer, Ctx, Reply, Request};
use crate::engine::CancelTaken;
use crate::model::*;
use crate::store::logs::decompress_chunk_sized;
use crate::store::{ChunkPlace, Lookup, Reader, StoreError};

fn build_id(req: &Request) -> Result<BuildId, ApiError> {
    parse_build_id(req.param("build")).ok_or_else(|| ApiError::not_found("build"))
}

pub fn list(ctx: &Ctx, req: &Request, caller: &Caller) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let limit = page_limit(req)?;
    let filter = format!("deployment={id}");
    let before = match req.query_one("cursor") {
        Some(c) => {
            let position = cursor::decode(&ctx.cursor_key, &caller.identity(), &filter, c)?;
            Some(parse_build_id(&position).ok_or_else(ApiError::internal)?)
        }
        None => None,
    };
    let rx = ctx.engine.read()?;
    if rx.deployment(&id)?.is_none() {
        return Err(ApiError::not_found("deployment"));
    }
    let mut builds = rx.builds_of(&id, before, limit + 1)?;
    let next_cursor = if builds.len() > limit {
        builds.truncate(limit);
        builds.last().map(|b| {
            cursor::encode(
                &ctx.cursor_key,
                &caller.identity(),
                &filter,
                &format_build_id(b.id),
            )
        })
    } else {
        None
    };
    // Each summary with its labels and worker (workers.md "What berth shows").
    let mut items = Vec::with_capacity(builds.len());
    for b in &builds {
        let mut item = serde_json::to_value(b.summary()).map_err(|_| ApiError::internal())?;
        let digest = rx.build_snapshots(b.id)?.map(|s| s.snapshot.source.digest);
        item["labels"] = serde_json::json!(required_labels(ctx, digest.as_deref().unwrap_or("")));
        item["worker"] = serde_json::json!(rx.last_attempt(b.id)?.map(|a| a.worker));
        items.push(item);
    }
    Ok(Reply::json(
        200,
        &serde_json::json!({"items": items, "next_cursor": next_cursor}),
    ))
}

/// The labels a build of a source requires, as far as this process knows
/// its source (else `--build-labels` alone).
fn required_labels(ctx: &Ctx, digest: &str) -> Vec<String> {
    ctx.engine
        .required_labels(digest)
        .unwrap_or_else(|| ctx.engine.settings.build_labels.0.clone())
}

pub fn read(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let id = build_id(req)?;
    let rx = ctx.engine.read()?;
    let b = rx.build(id)?.ok_or_else(|| ApiError::not_found("build"))?;
    let snaps = rx.build_snapshots(id)?.ok_or_else(|| {
        tracing::error!(build = %format_build_id(id), "a build without its snapshots");
        ApiError::internal()
    })?;
    let view = b.view(&snaps).map_err(StoreError::damaged_snapshot)?;
    let mut shown = serde_json::to_value(&view).map_err(|_| ApiError::internal())?;
    let attempt = rx.last_attempt(id)?;
    // workers.md "What berth shows": the labels it needs, its worker, its attempt.
    shown["labels"] = serde_json::json!(required_labels(ctx, &snaps.snapshot.source.digest));
    // `worker` as the list shows it; `attempt` below in full.
    shown["worker"] = serde_json::json!(attempt.as_ref().map(|a| a.worker.clone()));
    if let Some(a) = attempt
        .as_ref()
        .filter(|a| a.worker != crate::authority::LOCAL_WORKER)
    {
        shown["job_id"] = serde_json::json!(format!(
            "attempt:{}",
            crate::authority::attempt_id(a.build, a.fence)
        ));
    }
    shown["attempt"] = serde_json::json!(attempt.as_ref().map(|a| serde_json::json!({
        "attempt_id": crate::authority::attempt_id(a.build, a.fence),
        "worker": a.worker,
        "worker_incarnation": a.incarnation,
        "fence": a.fence,
        "claimed_at": format_time(a.claimed_at),
        "lease_expires_at": a.lease_expires_at.map(format_time),
        "state": a.state.as_str(),
        "cancel_requested_at": a.cancel_requested_at.map(format_time),
    })));
    shown["rollout"] = match rx.rollout(id)? {
        Some(r) => crate::engine::rollouts::view(&r),
        None => serde_json::Value::Null,
    };
    Ok(Reply::json(200, &shown))
}

/// Log chunks read ahead of a slow client while streaming a log (or a
/// range of it): at most this many (each at most `LOG_CHUNK_BYTES` raw)
/// wait for the socket, beside the `LOG_DECODE_AHEAD` being decoded, and
/// decoding waits for room here: a reader that stops reading holds a few
/// chunks, never the log (api.md "Fair shares").
const LOG_STREAM_AHEAD: usize = 1;
/// Chunks of one full-log read decoded at once (the machine's 2 cores).
const LOG_DECODE_AHEAD: usize = 2;

const TEXT: &str = "text/plain; charset=utf-8";

/// What the store says about a build's log, read in one snapshot.
struct LogFacts {
    len: u64,
    places: Vec<ChunkPlace>,
    /// The build channel's last committed event in that snapshot: every
    /// line of `places` has a seq at or below it, and every event after it
    /// is newer than the body (api.md `Berth-Event-Cursor`).
    covered: u64,
}

/// The answer's header that says which event a body reaching the end of
/// the log covers, so a client follows the channel from exactly there.
const EVENT_CURSOR: &str = "berth-event-cursor";

fn set_event_cursor(response: &mut warp::reply::Response, covered: u64) {
    response
        .headers_mut()
        .insert(EVENT_CURSOR, warp::http::HeaderValue::from(covered));
}

/// `GET /v1/builds/{build}/log`: with `Range`, only the chunks the range
/// touches are read; without, the log is streamed chunk by chunk. Either
/// way memory is bounded by a few chunks, not the log (a build stored
/// before the chunk index is read whole, as before).
pub async fn log(ctx: &Ctx, req: &Request) -> Result<Answer, ApiError> {
    let id = build_id(req)?;
    let range = req.header("range").map(parse_range).transpose()?;
    let store = ctx.engine.reader();
    let facts = {
        let store = store.clone();
        tokio::task::spawn_blocking(move || -> Result<Option<LogFacts>, ApiError> {
            let rx = store.read()?;
            let Some(b) = rx.build(id)? else {
                return Ok(None);
            };
            Ok(Some(LogFacts {
                len: b.log_bytes,
                places: rx.log_index(id, b.log_chunks)?,
                covered: b.event_seq,
            }))
        })
        .await
        .map_err(|_| ApiError::internal())??
        .ok_or_else(|| ApiError::not_found("build"))?
    };
    let places = facts.places;
    let len = facts.len;
    let Some(range) = range else {
        let mut response = stream_log(store, id, places, None);
        set_event_cursor(&mut response, facts.covered);
        return Ok(Answer::Stream(response));
    };
    let Some((start, end)) = resolve_range(&range, len) else {
        return Err(range_not_satisfiable(len));
    };
    // A range streams as the whole log does, chunk by chunk: a reader that
    // does not read holds a few chunks, never the range (api.md "Fair
    // shares").
    let needed: Vec<ChunkPlace> = places
        .into_iter()
        .filter(|p| p.first_byte <= end && p.first_byte + p.raw_len > start)
        .collect();
    let mut response = stream_log(store, id, needed, Some((start, end)));
    if end + 1 == len {
        set_event_cursor(&mut response, facts.covered);
    }
    *response.status_mut() = warp::http::StatusCode::PARTIAL_CONTENT;
    if let Ok(v) = warp::http::HeaderValue::from_str(&format!("bytes {start}-{end}/{len}")) {
        response.headers_mut().insert("content-range", v);
    }
    Ok(Answer::Stream(response))
}

/// The log's chunks `places`, in order, from one snapshot of the store;
/// with `range`, only the bytes inside it (`start..=end`) of each.
fn stream_log(
    store: Reader,
    id: BuildId,
    places: Vec<ChunkPlace>,
    range: Option<(u64, u64)>,
) -> warp::reply::Response {
    use warp::Reply as _;
    let (tx, rx) =
        tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(LOG_STREAM_AHEAD);
    tokio::spawn(send_log(store, id, places, range, tx));
    let body = tokio_stream::wrappers::ReceiverStream::new(rx);
    let mut response = warp::reply::stream(body).into_response();
    let h = response.headers_mut();
    h.insert("content-type", warp::http::HeaderValue::from_static(TEXT));
    h.insert(
        "accept-ranges",
        warp::http::HeaderValue::from_static("bytes"),
    );
    response
}

/// Sends the log's chunks (or the part of each inside `range`) in order.
/// Chunks decode on the blocking pool, `LOG_DECODE_AHEAD` at once:
/// decompression, not the socket, bounds a full read, and it parallelizes
/// by chunk.
async fn send_log(
    store: Reader,
    id: BuildId,
    places: Vec<ChunkPlace>,
    range: Option<(u64, u64)>,
    tx: tokio::sync::mpsc::Sender<Result<bytes::Bytes, std::io::Error>>,
) {
    use futures_util::StreamExt as _;
    let fail = |e: String| {
        tracing::error!(build = %format_build_id(id), error = %e, "a log stream stopped");
        std::io::Error::other(e)
    };
    // One snapshot for the whole read, shared by the decoders.
    let snapshot = match store.read() {
        Ok(s) => std::sync::Arc::new(s),
        Err(e) => {
            if tx.send(Err(fail(e.to_string()))).await.is_err() {
                tracing::debug!("the log's reader left before its error");
            }
            return;
        }
    };
    let mut places = places.into_iter();
    let mut decoding = futures_util::stream::FuturesOrdered::new();
    loop {
        // Room for one more piece first: a reader that does not read
        // stops the decoding too, so it holds a few chunks at most.
        let Ok(permit) = tx.reserve().await else {
            return;
        };
        while decoding.len() < LOG_DECODE_AHEAD {
            let Some(p) = places.next() else { break };
            let snapshot = snapshot.clone();
            decoding.push_back(tokio::task::spawn_blocking(move || {
                decode_piece(&snapshot, id, &p, range)
            }));
        }
        let Some(decoded) = decoding.next().await else {
            return;
        };
        let item = decoded
            .map_err(|_| "a log decoding task stopped".to_string())
            .and_then(|r| r)
            .map(bytes::Bytes::from)
            .map_err(fail);
        let failed = item.is_err();
        permit.send(item);
        if failed {
            return;
        }
    }
}

/// One stored chunk decoded, cut to the part of it inside `range`.
fn decode_piece(
    snapshot: &crate::store::Rx,
    id: BuildId,
    p: &ChunkPlace,
    range: Option<(u64, u64)>,
) -> Result<Vec<u8>, String> {
    let chunk = snapshot
        .log_chunk(id, p.number)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "an indexed log chunk is missing".to_string())?;
    let raw = decompress_chunk_sized(&chunk, p.raw_len).map_err(|e| e.to_string())?;
    let Some((start, end)) = range else {
        return Ok(raw);
    };
    let from = start.saturating_sub(p.first_byte) as usize;
    let to = ((end + 1).min(p.first_byte + p.raw_len) - p.first_byte) as usize;
    raw.get(from..to)
        .map(<[u8]>::to_vec)
        .ok_or_else(|| "a log chunk is shorter than its index says".to_string())
}

fn range_not_satisfiable(len: u64) -> ApiError {
    let mut e = ApiError::new(
        Code::RangeNotSatisfiable,
        "the range starts at or after the end of the log so far",
    );
    e.reason = Some("range_not_satisfiable".into());
    e.content_range = Some(format!("bytes */{len}"));
    e
}

pub async fn cancel(ctx: &Ctx, req: &Request, w: Write) -> Result<Reply, ApiError> {
    let id = build_id(req)?;
    let record = w.record(cancel_reply);
    let taken = ctx.engine.cancel(id, record).await?;
    Ok(cancel_reply(&taken))
}

/// 202 with the build as it is now.
fn cancel_reply(taken: &CancelTaken) -> Reply {
    Reply::json(202, &taken.build)
}
