//! `Range: bytes=` over bytes berth serves: one range per request (the
//! log, a work state archive, an artifact). Pure parsing and arithmetic,
//! plus the answer for bytes held whole and named by their digest.

use super::errors::{ApiError, Code};
use super::{Reply, Request};

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

/// Bytes stored by their digest as an answer: the digest as the ETag, a
/// `Range: bytes=` honoured as the log's is (`206`, or `416` outside).
pub fn content_addressed(
    req: &Request,
    content_type: &'static str,
    digest: &str,
    bytes: Vec<u8>,
) -> Result<Reply, ApiError> {
    let etag = format!("\"{digest}\"");
    let Some(range) = req.headers.get("range") else {
        return Ok(Reply::text(200, content_type, bytes).header("ETag", etag));
    };
    let range = range.to_str().map_err(|_| {
        ApiError::bad_request("Range must be bytes=START-[END]").field("/headers/range", "format")
    })?;
    let len = bytes.len() as u64;
    let Some((start, end)) = resolve_range(&parse_range(range)?, len) else {
        return Err(ApiError::new(
            Code::RangeNotSatisfiable,
            format!("the range is outside the {len} bytes"),
        ));
    };
    let part = bytes[start as usize..=end as usize].to_vec();
    Ok(Reply::text(206, content_type, part)
        .header("ETag", etag)
        .header("Content-Range", format!("bytes {start}-{end}/{len}")))
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
