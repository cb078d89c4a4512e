//! The operator page (`GET /` and `GET /ui/{file}`): three static files
//! embedded in the binary, so `berth serve` still needs nothing else. They
//! are served with a strict Content-Security-Policy (no inline script, no
//! other origin), revalidated by ETag, and never see a token in a URL: the
//! page keeps the token in sessionStorage and streams with tickets.

use std::sync::OnceLock;

use sha2::{Digest, Sha256};

use super::errors::{ApiError, Code};
use super::{Reply, Request};

/// Everything the page may load: its own scripts, styles and API.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

struct File {
    name: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

const INDEX: File = File {
    name: "index.html",
    content_type: "text/html; charset=utf-8",
    body: include_bytes!("../../web/index.html"),
};

const ASSETS: &[File] = &[
    File {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../../web/app.js"),
    },
    File {
        name: "style.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../../web/style.css"),
    },
];

/// The page's size in bytes, all files (for the docs and the note).
pub fn total_bytes() -> usize {
    INDEX.body.len() + ASSETS.iter().map(|f| f.body.len()).sum::<usize>()
}

/// A strong ETag per file, computed once.
fn etag(file: &File) -> &'static str {
    static TAGS: OnceLock<Vec<(&'static str, String)>> = OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        std::iter::once(&INDEX)
            .chain(ASSETS.iter())
            .map(|f| {
                let digest = Sha256::digest(f.body);
                (f.name, format!("\"{}\"", crate::hex::encode(&digest[..12])))
            })
            .collect()
    });
    tags.iter()
        .find(|(name, _)| *name == file.name)
        .map(|(_, tag)| tag.as_str())
        .unwrap_or("\"\"")
}

fn serve(file: &File, req: &Request) -> Reply {
    let tag = etag(file);
    let fresh = req
        .headers
        .get("if-none-match")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == tag));
    let reply = if fresh {
        Reply::text(304, file.content_type, Vec::new())
    } else {
        Reply::text(200, file.content_type, file.body.to_vec())
    };
    reply
        .header("etag", tag)
        // Revalidate every time: a new berth serves a new page at once.
        .header("cache-control", "no-cache")
        .header("content-security-policy", CONTENT_SECURITY_POLICY)
        .header("x-content-type-options", "nosniff")
        .header("referrer-policy", "no-referrer")
}

/// `GET /`.
pub fn index(req: &Request) -> Reply {
    serve(&INDEX, req)
}

/// `GET /ui/{file}`.
pub fn asset(req: &Request) -> Result<Reply, ApiError> {
    let name = req.params.get("file").map(String::as_str).unwrap_or("");
    ASSETS
        .iter()
        .find(|f| f.name == name)
        .map(|f| serve(f, req))
        .ok_or_else(|| ApiError::new(Code::NotFound, "no such file of the page"))
}
