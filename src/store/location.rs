//! Where the store lives: `--store redb:<path>` (the default) or
//! `--store postgres://...` (cluster.md "The store flag"), read and judged
//! before anything connects.
//!
//! Why it exists: a store URL is hostile input of its own kind. It may
//! carry a password into a process list or a log, or ask for a TLS mode
//! that silently falls back to plain text; each such URL is refused here,
//! with a code and a reason that never repeats the URL. Pure: no I/O but
//! the caller's reading of `--store-file`.

use std::path::PathBuf;

/// The default port of PostgreSQL.
const DEFAULT_PORT: u16 = 5432;
/// Hosts in one URL at most (`h1:5432,h2:5432`).
const MAX_HOSTS: usize = 8;
/// A store URL's length at most.
pub const MAX_URL_BYTES: usize = 4096;

/// Where the store is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// storage.md's embedded file.
    Redb(PathBuf),
    /// The store's tables in PostgreSQL.
    Postgres(PgTarget),
}

/// A PostgreSQL database as `--store` named it (never with a password:
/// that comes from `--store-file` or `PGPASSFILE`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgTarget {
    /// Host names or addresses with their ports; empty with `socket_dir`.
    pub hosts: Vec<(String, u16)>,
    /// A Unix socket directory (`host=/run/postgresql`), with its port.
    pub socket_dir: Option<(PathBuf, u16)>,
    pub user: Option<String>,
    pub dbname: String,
    pub password: Option<String>,
    /// `options=-csearch_path=<schema>`: one cluster per schema.
    pub schema: Option<String>,
    pub application_name: Option<String>,
    pub tls: TlsMode,
}

/// How the connection is protected. `allow` and `prefer` are refused:
/// they fall back to plain text without a word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsMode {
    Disable,
    Require,
    VerifyCa,
    VerifyFull,
}

/// A refused store URL: the code (cluster.md's) and what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: &'static str,
    pub reason: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.reason, self.code)
    }
}

fn refuse(code: &'static str, reason: impl Into<String>) -> Refusal {
    Refusal {
        code,
        reason: reason.into(),
    }
}

fn invalid(reason: impl Into<String>) -> Refusal {
    refuse("invalid_store_url", reason)
}

/// Reads `--store`'s value. `from_file`: it came from `--store-file`, the
/// one place a password may be written.
pub fn parse(text: &str, from_file: bool) -> Result<Location, Refusal> {
    let text = text.trim();
    if text.len() > MAX_URL_BYTES {
        return Err(invalid(format!(
            "the store URL is longer than {MAX_URL_BYTES} bytes"
        )));
    }
    if let Some(path) = text.strip_prefix("redb:") {
        if path.is_empty() {
            return Err(invalid(
                "redb: needs a path (redb:/var/lib/berth/berth.redb)",
            ));
        }
        return Ok(Location::Redb(PathBuf::from(path)));
    }
    let rest = text
        .strip_prefix("postgresql://")
        .or_else(|| text.strip_prefix("postgres://"))
        .ok_or_else(|| {
            invalid("a store is redb:<path> or postgres://user@host[:port]/database[?params]")
        })?;
    let target = parse_postgres(rest)?;
    if target.password.is_some() && !from_file {
        return Err(refuse(
            "store_url_has_password",
            "--store holds a password, which would show in the process list and in logs: \
             write the URL to a file readable by berth only and pass --store-file, or use PGPASSFILE",
        ));
    }
    Ok(Location::Postgres(target))
}

/// `user[:password]@hosts/db?params`, after the scheme.
fn parse_postgres(rest: &str) -> Result<PgTarget, Refusal> {
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let (authority, path) = before_query.split_once('/').unwrap_or((before_query, ""));
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let mut target = PgTarget {
        hosts: Vec::new(),
        socket_dir: None,
        user: None,
        dbname: decode(path)?,
        password: None,
        schema: None,
        application_name: None,
        tls: TlsMode::VerifyFull,
    };
    if let Some(userinfo) = userinfo {
        let (user, password) = match userinfo.split_once(':') {
            Some((u, p)) => (u, Some(decode(p)?)),
            None => (userinfo, None),
        };
        target.user = Some(decode(user)?).filter(|u| !u.is_empty());
        target.password = password;
    }
    for host in hosts.split(',').filter(|h| !h.is_empty()) {
        target.hosts.push(host_port(host)?);
    }
    if target.hosts.len() > MAX_HOSTS {
        return Err(invalid(format!("more than {MAX_HOSTS} hosts")));
    }
    let mut tls = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        apply_param(&mut target, &mut tls, name, decode(value)?)?;
    }
    if target.hosts.is_empty() && target.socket_dir.is_none() {
        return Err(invalid("the store URL names no host"));
    }
    if target.dbname.is_empty() {
        return Err(invalid(
            "the store URL names no database (postgres://user@host/berth)",
        ));
    }
    target.tls = match tls {
        Some(mode) => mode,
        None if target.is_local() => TlsMode::Disable,
        None => TlsMode::VerifyFull,
    };
    if target.tls != TlsMode::Disable {
        return Err(refuse(
            "store_tls_unsupported",
            "this berth does not speak TLS to PostgreSQL yet: reach it over loopback or a Unix \
             socket (sslmode=disable, the default there), or through a tunnel",
        ));
    }
    Ok(target)
}

/// One `?name=value` of the URL, into `target` (and `tls`).
fn apply_param(
    target: &mut PgTarget,
    tls: &mut Option<TlsMode>,
    name: &str,
    value: String,
) -> Result<(), Refusal> {
    match name {
        "sslmode" => *tls = Some(tls_mode(&value)?),
        "host" if value.starts_with('/') => {
            let port = target.hosts.first().map_or(DEFAULT_PORT, |h| h.1);
            target.socket_dir = Some((PathBuf::from(value), port));
        }
        "host" => target.hosts.push(host_port(&value)?),
        "port" => {
            let port = port_of(&value)?;
            target.hosts.iter_mut().for_each(|h| h.1 = port);
            if let Some(dir) = target.socket_dir.as_mut() {
                dir.1 = port;
            }
        }
        "user" => target.user = Some(value),
        "dbname" => target.dbname = value,
        "password" => target.password = Some(value),
        "options" => target.schema = Some(schema_of(&value)?),
        "application_name" => target.application_name = Some(value),
        "target_session_attrs" if value == "read-write" => {}
        "target_session_attrs" => {
            return Err(invalid(
                "target_session_attrs must be read-write: berth writes to the primary only",
            ))
        }
        "sslrootcert" | "sslcert" | "sslkey" => {
            return Err(refuse(
                "store_tls_unsupported",
                format!("{name}: this berth does not speak TLS to PostgreSQL yet; reach it over loopback or a Unix socket"),
            ))
        }
        other => {
            return Err(invalid(format!(
                "the store URL parameter {:?} is not one berth takes",
                truncated(other)
            )))
        }
    }
    Ok(())
}

fn truncated(s: &str) -> String {
    s.chars().take(64).collect()
}

fn tls_mode(value: &str) -> Result<TlsMode, Refusal> {
    match value {
        "disable" => Ok(TlsMode::Disable),
        "require" => Ok(TlsMode::Require),
        "verify-ca" => Ok(TlsMode::VerifyCa),
        "verify-full" => Ok(TlsMode::VerifyFull),
        "allow" | "prefer" => Err(refuse(
            "store_insecure_tls",
            format!("sslmode={value} falls back to plain text without a word: use verify-full, or disable on loopback"),
        )),
        _ => Err(invalid("sslmode is one of disable, require, verify-ca, verify-full")),
    }
}

/// `options=-csearch_path=<schema>`, nothing else.
fn schema_of(options: &str) -> Result<String, Refusal> {
    let schema = options
        .strip_prefix("-csearch_path=")
        .or_else(|| options.strip_prefix("-c search_path="))
        .ok_or_else(|| invalid("options takes only -csearch_path=<schema>"))?;
    let plain = !schema.is_empty()
        && schema.len() <= 63
        && schema
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    match plain {
        true => Ok(schema.to_string()),
        false => Err(invalid(
            "a schema name is 1-63 lowercase letters, digits and underscores",
        )),
    }
}

fn host_port(text: &str) -> Result<(String, u16), Refusal> {
    // `[::1]:5432`, `host:5432` or `host`.
    if let Some(inner) = text.strip_prefix('[') {
        let (addr, after) = inner
            .split_once(']')
            .ok_or_else(|| invalid("an IPv6 host lacks its closing ]"))?;
        let port = match after.strip_prefix(':') {
            Some(p) => port_of(p)?,
            None if after.is_empty() => DEFAULT_PORT,
            None => return Err(invalid("a host is host[:port]")),
        };
        return Ok((addr.to_string(), port));
    }
    let (host, port) = match text.split_once(':') {
        Some((h, p)) => (h, port_of(p)?),
        None => (text, DEFAULT_PORT),
    };
    let host = decode(host)?;
    if host.is_empty() {
        return Err(invalid("a host is empty"));
    }
    Ok((host, port))
}

fn port_of(text: &str) -> Result<u16, Refusal> {
    text.parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| invalid("a port is a number from 1 to 65535"))
}

/// Percent-decoding of one URL part.
fn decode(text: &str) -> Result<String, Refusal> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| {
                        invalid("a % in the store URL is not followed by two hex digits")
                    })?;
                out.push(hex);
                i += 3;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| invalid("the store URL is not UTF-8 once decoded"))
}

impl PgTarget {
    /// Loopback hosts or a Unix socket: where plain text crosses no wire.
    pub fn is_local(&self) -> bool {
        let loopback = |h: &str| {
            h == "localhost"
                || h.parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        };
        self.socket_dir.is_some() || self.hosts.iter().all(|(h, _)| loopback(h))
    }

    /// The URL without its password, for logs and `GET /v1/cluster`.
    pub fn redacted(&self) -> String {
        let user = self
            .user
            .as_deref()
            .map(|u| format!("{u}@"))
            .unwrap_or_default();
        let hosts: Vec<String> = self
            .hosts
            .iter()
            .map(|(h, p)| match h.contains(':') {
                true => format!("[{h}]:{p}"),
                false => format!("{h}:{p}"),
            })
            .collect();
        let mut params = Vec::new();
        if let Some((dir, port)) = &self.socket_dir {
            params.push(format!("host={}&port={port}", dir.display()));
        }
        if let Some(schema) = &self.schema {
            params.push(format!("options=-csearch_path%3D{schema}"));
        }
        let query = match params.is_empty() {
            true => String::new(),
            false => format!("?{}", params.join("&")),
        };
        format!(
            "postgres://{user}{}/{}{query}",
            hosts.join(","),
            self.dbname
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg(text: &str) -> PgTarget {
        match parse(text, false) {
            Ok(Location::Postgres(t)) => t,
            other => panic!("{text}: {other:?}"),
        }
    }

    fn code(text: &str, from_file: bool) -> &'static str {
        parse(text, from_file).unwrap_err().code
    }

    #[test]
    fn urls_name_hosts_ports_databases_and_schemas() {
        let t = pg("postgres://berth@127.0.0.1:5433/berth?options=-csearch_path%3Dblue");
        assert_eq!(t.hosts, vec![("127.0.0.1".into(), 5433)]);
        assert_eq!(t.user.as_deref(), Some("berth"));
        assert_eq!(t.dbname, "berth");
        assert_eq!(t.schema.as_deref(), Some("blue"));
        assert_eq!(t.tls, TlsMode::Disable);
        let t = pg("postgresql://localhost,[::1]:6000/db");
        assert_eq!(
            t.hosts,
            vec![("localhost".into(), 5432), ("::1".into(), 6000)]
        );
        let t = pg("postgres://berth@/berth?host=/run/postgresql");
        assert_eq!(t.socket_dir, Some(("/run/postgresql".into(), 5432)));
        assert_eq!(
            t.redacted(),
            "postgres://berth@/berth?host=/run/postgresql&port=5432"
        );
        assert_eq!(
            parse("redb:/var/lib/berth/berth.redb", false),
            Ok(Location::Redb("/var/lib/berth/berth.redb".into()))
        );
    }

    #[test]
    fn a_password_is_taken_from_a_file_only_and_never_shown() {
        let url = "postgres://berth:s3cret@127.0.0.1/berth";
        let refused = parse(url, false).unwrap_err();
        assert_eq!(refused.code, "store_url_has_password");
        assert!(!refused.to_string().contains("s3cret"), "{refused}");
        assert_eq!(
            code("postgres://berth@127.0.0.1/berth?password=x", false),
            "store_url_has_password"
        );
        let t = pg_from_file(url);
        assert_eq!(t.password.as_deref(), Some("s3cret"));
        assert!(!t.redacted().contains("s3cret"));
    }

    fn pg_from_file(text: &str) -> PgTarget {
        match parse(text, true) {
            Ok(Location::Postgres(t)) => t,
            other => panic!("{text}: {other:?}"),
        }
    }

    #[test]
    fn tls_that_falls_back_to_plain_text_and_unknown_parameters_are_refused() {
        assert_eq!(
            code("postgres://h/db?sslmode=prefer", false),
            "store_insecure_tls"
        );
        assert_eq!(
            code("postgres://h/db?sslmode=allow", false),
            "store_insecure_tls"
        );
        // A remote host defaults to verify-full, which this berth lacks.
        assert_eq!(
            code("postgres://db.example.org/db", false),
            "store_tls_unsupported"
        );
        assert_eq!(
            code("postgres://127.0.0.1/db?connect_timeout=3", false),
            "invalid_store_url"
        );
        assert_eq!(
            code("postgres://127.0.0.1/db?options=-cwork_mem%3D1GB", false),
            "invalid_store_url"
        );
        assert_eq!(code("postgres://127.0.0.1/", false), "invalid_store_url");
        assert_eq!(code("postgres:///db", false), "invalid_store_url");
        assert_eq!(code("mysql://h/db", false), "invalid_store_url");
        assert_eq!(
            code("postgres://127.0.0.1:0/db", false),
            "invalid_store_url"
        );
        assert_eq!(
            code("postgres://127.0.0.1/db%zz", false),
            "invalid_store_url"
        );
        assert_eq!(
            code("postgres://127.0.0.1/db?target_session_attrs=any", false),
            "invalid_store_url"
        );
        let long = format!("postgres://127.0.0.1/{}", "d".repeat(MAX_URL_BYTES));
        assert_eq!(code(&long, false), "invalid_store_url");
    }
}
