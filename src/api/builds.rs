//! Build routes: list of a deployment's builds, read, log (with Range), cancel.

use super::auth::Caller;
use super::deployments::{deployment_id, page_limit};
use super::errors::{ApiError, Code};
use super::idempotency::IdemWrite;
use super::{cursor, Ctx, Reply, Request};
use crate::engine::CancelTaken;
use crate::model::*;
use crate::store::logs::decompress_chunks;
use crate::store::Lookup;

fn build_id(req: &Request) -> Result<BuildId, ApiError> {
    parse_build_id(req.param("build")).ok_or_else(|| ApiError::not_found("build"))
}

pub fn list(ctx: &Ctx, req: &Request, caller: &Caller) -> Result<Reply, ApiError> {
    let id = deployment_id(req)?;
    let limit = page_limit(req)?;
    let filter = format!("deployment={id}");
    let before = match req.query_one("cursor") {
        Some(c) => {
            let position = cursor::decode(&ctx.cursor_key, &caller.subject, &filter, c)?;
            Some(parse_build_id(&position).ok_or_else(ApiError::internal)?)
        }
        None => None,
    };
    let rx = ctx.engine.store.read()?;
    if rx.deployment(&id)?.is_none() {
        return Err(ApiError::not_found("deployment"));
    }
    let mut builds = rx.builds_of(&id, before, limit + 1)?;
    let next_cursor = if builds.len() > limit {
        builds.truncate(limit);
        builds.last().map(|b| {
            cursor::encode(
                &ctx.cursor_key,
                &caller.subject,
                &filter,
                &format_build_id(b.id),
            )
        })
    } else {
        None
    };
    let items: Vec<BuildSummary> = builds.iter().map(BuildRecord::summary).collect();
    Ok(Reply::json(
        200,
        &serde_json::json!({"items": items, "next_cursor": next_cursor}),
    ))
}

pub fn read(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let id = build_id(req)?;
    let rx = ctx.engine.store.read()?;
    let b = rx.build(id)?.ok_or_else(|| ApiError::not_found("build"))?;
    let snaps = rx.build_snapshots(id)?.ok_or_else(|| {
        tracing::error!(build = %format_build_id(id), "a build without its snapshots");
        ApiError::internal()
    })?;
    Ok(Reply::json(200, &b.view(&snaps)))
}

/// A parsed `Range: bytes=` header: one range only.
#[derive(Debug, PartialEq, Eq)]
pub enum ByteRange {
    From(u64),
    FromTo(u64, u64),
    Last(u64),
}

pub fn parse_range(header: &str) -> Result<ByteRange, ApiError> {
    let bad = || {
        ApiError::bad_request("Range must be one bytes=START-[END] or bytes=-SUFFIX")
            .field("/headers/range", "format")
    };
    let spec = header.trim().strip_prefix("bytes=").ok_or_else(bad)?;
    if spec.contains(',') {
        return Err(
            ApiError::bad_request("one Range per request").field("/headers/range", "multiple")
        );
    }
    let (a, b) = spec.split_once('-').ok_or_else(bad)?;
    let num = |s: &str| s.trim().parse::<u64>().map_err(|_| bad());
    match (a.trim().is_empty(), b.trim().is_empty()) {
        (true, false) => Ok(ByteRange::Last(num(b)?)),
        (false, true) => Ok(ByteRange::From(num(a)?)),
        (false, false) => {
            let (a, b) = (num(a)?, num(b)?);
            if b < a {
                return Err(bad());
            }
            Ok(ByteRange::FromTo(a, b))
        }
        (true, true) => Err(bad()),
    }
}

/// The inclusive byte span of a range over `len` bytes, if satisfiable.
pub fn resolve_range(r: &ByteRange, len: u64) -> Option<(u64, u64)> {
    let (start, end) = match *r {
        ByteRange::From(a) => (a, len.checked_sub(1)?),
        ByteRange::FromTo(a, b) => (a, b.min(len.checked_sub(1)?)),
        ByteRange::Last(n) => (len.saturating_sub(n), len.checked_sub(1)?),
    };
    (start <= end && start < len && !matches!(r, ByteRange::Last(0))).then_some((start, end))
}

pub async fn log(ctx: &Ctx, req: &Request) -> Result<Reply, ApiError> {
    let id = build_id(req)?;
    let range = req.header("range").map(parse_range).transpose()?;
    let store = ctx.engine.store.clone();
    let text = tokio::task::spawn_blocking(move || -> Result<Option<Vec<u8>>, ApiError> {
        let rx = store.read()?;
        if rx.build(id)?.is_none() {
            return Ok(None);
        }
        Ok(Some(decompress_chunks(&rx.log_chunks(id)?)?))
    })
    .await
    .map_err(|_| ApiError::internal())??
    .ok_or_else(|| ApiError::not_found("build"))?;
    const TEXT: &str = "text/plain; charset=utf-8";
    let len = text.len() as u64;
    let Some(range) = range else {
        return Ok(Reply::text(200, TEXT, text).header("Accept-Ranges", "bytes"));
    };
    match resolve_range(&range, len) {
        Some((start, end)) => {
            Ok(
                Reply::text(206, TEXT, text[start as usize..=end as usize].to_vec())
                    .header("Content-Range", format!("bytes {start}-{end}/{len}"))
                    .header("Accept-Ranges", "bytes"),
            )
        }
        None => {
            let mut e = ApiError::new(
                Code::RangeNotSatisfiable,
                "the range starts at or after the end of the log so far",
            );
            e.reason = Some("range_not_satisfiable".into());
            e.content_range = Some(format!("bytes */{len}"));
            Err(e)
        }
    }
}

pub async fn cancel(ctx: &Ctx, req: &Request, idem: Option<IdemWrite>) -> Result<Reply, ApiError> {
    let id = build_id(req)?;
    let record = idem.map(|w| w.recorder(cancel_reply));
    let taken = ctx.engine.cancel(id, record).await?;
    Ok(cancel_reply(&taken))
}

/// 202 with the build as it is now.
fn cancel_reply(taken: &CancelTaken) -> Reply {
    Reply::json(202, &taken.build)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=5-").unwrap(), ByteRange::From(5));
        assert_eq!(parse_range("bytes=-5").unwrap(), ByteRange::Last(5));
        assert_eq!(parse_range("bytes=1-2").unwrap(), ByteRange::FromTo(1, 2));
        assert!(parse_range("bytes=1-2,4-5").is_err());
        assert!(parse_range("bytes=2-1").is_err());
        assert!(parse_range("items=1-2").is_err());
        assert_eq!(resolve_range(&ByteRange::From(5), 10), Some((5, 9)));
        assert_eq!(resolve_range(&ByteRange::From(10), 10), None);
        assert_eq!(resolve_range(&ByteRange::FromTo(2, 100), 10), Some((2, 9)));
        assert_eq!(resolve_range(&ByteRange::Last(3), 10), Some((7, 9)));
        assert_eq!(resolve_range(&ByteRange::Last(30), 10), Some((0, 9)));
        assert_eq!(resolve_range(&ByteRange::From(0), 0), None);
    }
}
