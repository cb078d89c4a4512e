//! PURE: the facts a front-end shows without reading option names (FR-004).
//!
//! Reads both configuration shapes (flat and collapsed), applies a source's
//! renames, and computes the domain, instances, application paths, changed
//! applications and sections of spec/configuration.md. No I/O, no clock: every
//! function here is a function of its arguments, tested directly.

pub mod pointer;

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use pointer::Pointer;

/// One entry of a source's catalog (spec/configuration.md "The catalog").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogEntry {
    pub name: String,
    pub configurable: bool,
    pub operator_toggled: bool,
    pub subdomain: Option<String>,
}

/// A rename of an application or setting, pointers relative to the
/// applications object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rename {
    pub from: String,
    pub to: String,
}

/// Why a configuration or a rename list cannot be read. `pointer` names
/// the place (never a value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeriveError {
    pub pointer: String,
    pub rule: &'static str,
    pub message: &'static str,
}

/// The label rule for application names and subdomains.
pub fn is_dns_label(name: &str) -> bool {
    crate::model::is_dns_label(name, 63)
}

/// The longest host name a `domain` may be (configuration.md; DNS's own
/// limit on a name's text form).
pub const MAX_HOST_NAME_LEN: usize = 253;

/// A host name: dot-separated DNS labels (letters of either case, digits,
/// inner hyphens, 1 to 63 characters each), at most `MAX_HOST_NAME_LEN`.
pub fn is_host_name(name: &str) -> bool {
    let label = |l: &str| {
        let b = l.as_bytes();
        let inner = |c: &u8| c.is_ascii_alphanumeric();
        !b.is_empty()
            && b.len() <= 63
            && inner(&b[0])
            && inner(&b[b.len() - 1])
            && b.iter().all(|c| inner(c) || *c == b'-')
    };
    name.len() <= MAX_HOST_NAME_LEN && name.split('.').all(label)
}

/// A configuration read through its shape.
#[derive(Debug, Clone)]
pub struct Shaped<'a> {
    /// The method of a collapsed configuration; a flat one's `method` member
    /// when it is a string.
    pub method: Option<&'a str>,
    pub domain: Option<&'a str>,
    /// RFC 6901 pointer of the applications object.
    pub applications_path: String,
    pub applications: Option<&'a Map<String, Value>>,
}

static EMPTY: std::sync::LazyLock<Map<String, Value>> = std::sync::LazyLock::new(Map::new);

impl<'a> Shaped<'a> {
    pub fn apps(&self) -> &'a Map<String, Value> {
        self.applications.unwrap_or(&EMPTY)
    }
}

/// Reads a configuration's shape: collapsed when it has a `deployment` key.
pub fn shape(config: &Value) -> Result<Shaped<'_>, DeriveError> {
    let Some(top) = config.as_object() else {
        return Err(DeriveError {
            pointer: String::new(),
            rule: "type",
            message: "a configuration must be a JSON object",
        });
    };
    let (method, inner, prefix) = match top.get("deployment") {
        Some(deployment) => {
            let only = deployment
                .as_object()
                .filter(|m| m.len() == 1)
                .and_then(|m| m.iter().next());
            let Some((method, inner)) = only else {
                return Err(DeriveError {
                    pointer: "/deployment".into(),
                    rule: "shape",
                    message: "`deployment` must be an object with exactly one member, the method",
                });
            };
            let prefix = format!("/deployment/{}", pointer::escape(method));
            let Some(inner) = inner.as_object() else {
                return Err(DeriveError {
                    pointer: prefix,
                    rule: "type",
                    message: "the method's value must be an object",
                });
            };
            (Some(method.as_str()), inner, prefix)
        }
        None => (
            top.get("method").and_then(Value::as_str),
            top,
            String::new(),
        ),
    };
    let domain = match inner.get("domain") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if is_host_name(s) => Some(s.as_str()),
        Some(Value::String(_)) => {
            return Err(DeriveError {
                pointer: format!("{prefix}/domain"),
                rule: "host_name",
                message: "`domain` must be a host name: dot-separated DNS labels (letters, digits, inner hyphens), at most 253 characters",
            })
        }
        Some(_) => {
            return Err(DeriveError {
                pointer: format!("{prefix}/domain"),
                rule: "type",
                message: "`domain` must be a string",
            })
        }
    };
    let applications_path = format!("{prefix}/applications");
    let applications = match inner.get("applications") {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) => Some(m),
        Some(_) => {
            return Err(DeriveError {
                pointer: applications_path,
                rule: "type",
                message: "`applications` must be an object",
            })
        }
    };
    Ok(Shaped {
        method,
        domain,
        applications_path,
        applications,
    })
}

/// One derived instance (spec/configuration.md "Instances").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Instance {
    pub name: String,
    pub configurable: bool,
    pub operator_toggled: bool,
    pub enabled: bool,
    pub domain: Option<String>,
    pub url: Option<String>,
    pub section: Option<String>,
}

fn enabled(app: Option<&Value>) -> bool {
    app.and_then(|a| a.get("enable")) == Some(&Value::Bool(true))
}

/// The domain and instances of a configuration.
pub fn instances(
    config: &Value,
    catalog: &[CatalogEntry],
) -> Result<(Option<String>, Vec<Instance>), DeriveError> {
    let shaped = shape(config)?;
    let apps = shaped.apps();
    let domain = shaped.domain;
    let mut out = Vec::with_capacity(catalog.len() + apps.len());
    for entry in catalog {
        let sub = entry.subdomain.as_deref();
        out.push(make_instance(
            &entry.name,
            entry.configurable,
            entry.operator_toggled,
            sub,
            sub.is_none(),
            apps.get(&entry.name),
            domain,
        ));
    }
    // serde_json's Map iterates in key (code point) order.
    for (name, value) in apps {
        if catalog.iter().any(|e| &e.name == name) {
            continue;
        }
        let label = is_dns_label(name);
        let sub = if label { Some(name.as_str()) } else { None };
        let mut inst = make_instance(name, true, false, sub, false, Some(value), domain);
        if !label {
            inst.domain = None;
            inst.url = None;
        }
        out.push(inst);
    }
    Ok((domain.map(str::to_string), out))
}

fn make_instance(
    name: &str,
    configurable: bool,
    operator_toggled: bool,
    subdomain: Option<&str>,
    is_apex: bool,
    app: Option<&Value>,
    domain: Option<&str>,
) -> Instance {
    let enabled = enabled(app);
    let domain = domain.and_then(|d| match subdomain {
        Some(sub) => Some(format!("{sub}.{d}")),
        None if is_apex => Some(d.to_string()),
        None => None,
    });
    let url = match (&domain, enabled) {
        (Some(d), true) => Some(format!("https://{d}/")),
        _ => None,
    };
    Instance {
        name: name.to_string(),
        configurable,
        operator_toggled,
        enabled,
        domain,
        url,
        section: if configurable {
            Some(name.to_string())
        } else {
            None
        },
    }
}

/// Parsed renames, checked once: malformed pointers and a `to` inside its
/// own `from` are refused with the index of the rename.
pub fn parse_renames(renames: &[Rename]) -> Result<Vec<(Pointer, Pointer)>, DeriveError> {
    renames
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let bad = |which: &str, message: &'static str| DeriveError {
                pointer: format!("/renames/{i}/{which}"),
                rule: "rename",
                message,
            };
            let from = Pointer::parse(&r.from)
                .ok_or_else(|| bad("from", "not a JSON pointer below the applications object"))?;
            let to = Pointer::parse(&r.to)
                .ok_or_else(|| bad("to", "not a JSON pointer below the applications object"))?;
            if to.is_strictly_inside(&from) {
                return Err(bad("to", "a rename cannot move a value inside itself"));
            }
            Ok((from, to))
        })
        .collect()
}

/// The applications object after renames, and for each top-level
/// application the name it had as stored. Values are borrowed from the
/// configuration; only an application that a setting rename touches is
/// copied, so a derivation over hundreds of applications stays cheap.
pub struct Renamed<'a> {
    pub apps: BTreeMap<Cow<'a, str>, Cow<'a, Value>>,
    /// Where each value was stored: its pointer below the applications
    /// object, escaped, without the leading `/`.
    pub origin: BTreeMap<Cow<'a, str>, Cow<'a, str>>,
}

/// Applies renames in one pass, in list order, to a copy of `apps`.
pub fn apply_renames<'a>(
    apps: &'a Map<String, Value>,
    renames: &[(Pointer, Pointer)],
) -> Renamed<'a> {
    let mut map: BTreeMap<Cow<'a, str>, Cow<'a, Value>> = apps
        .iter()
        .map(|(k, v)| (Cow::Borrowed(k.as_str()), Cow::Borrowed(v)))
        .collect();
    let mut origin: BTreeMap<Cow<'a, str>, Cow<'a, str>> = apps
        .keys()
        .map(|k| (Cow::Borrowed(k.as_str()), pointer::escape(k)))
        .collect();
    for (from, to) in renames {
        if to.is_strictly_inside(from) || from == to {
            continue;
        }
        if from.len() == 1 && to.len() == 1 {
            // An application renamed: move it whole, without copying.
            let (f, t) = (from.token(0), to.token(0));
            if map.contains_key(t) {
                continue;
            }
            if let Some(v) = map.remove(f) {
                map.insert(Cow::Owned(t.to_string()), v);
                if let Some(was) = origin.remove(f) {
                    origin.insert(Cow::Owned(t.to_string()), was);
                }
            }
            continue;
        }
        // A setting moved. The applications involved become owned at most
        // once (the first rename that touches one copies it; later ones move
        // it), so the cost is linear in the input however many renames.
        if !map.contains_key(from.token(0)) {
            continue;
        }
        let mut root = Map::new();
        for app in [from.token(0), to.token(0)] {
            if let Some((k, v)) = map.remove_entry(app) {
                root.insert(k.into_owned(), v.into_owned());
            }
        }
        let mut root = Value::Object(root);
        let moved = pointer::move_value(&mut root, from, to);
        if let Value::Object(apps_back) = root {
            for (k, v) in apps_back {
                map.insert(Cow::Owned(k), Cow::Owned(v));
            }
        }
        if moved {
            if from.len() == 1 {
                map.remove(from.token(0));
                origin.remove(from.token(0));
            }
            if to.len() == 1 {
                origin.insert(
                    Cow::Owned(to.token(0).to_string()),
                    Cow::Owned(from.escaped_tail()),
                );
            }
        }
    }
    Renamed { apps: map, origin }
}

/// RFC 8785 canonical text (used for fingerprints). An error is passed on,
/// never replaced by a default text: two requests must never share a
/// fingerprint because neither could be written.
pub fn canonical(value: &Value) -> Result<String, serde_json::Error> {
    serde_jcs::to_string(value)
}

/// Equality of JSON values as RFC 8785 sees them: member order never
/// matters and numbers compare by their IEEE-754 value (`1` equals `1.0`).
/// Same answer as comparing canonical texts, without building them.
pub fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x == y || x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| json_eq(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_eq(v, w)))
        }
        _ => a == b,
    }
}

fn same_value(a: Option<&Cow<Value>>, b: Option<&Cow<Value>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(x), Some(y)) => json_eq(x, y),
        _ => false,
    }
}

/// Answer of `POST /v1/derive/applications`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Applications {
    pub draft_path: String,
    pub deployed_path: Option<String>,
    pub changed: Vec<String>,
}

pub fn applications(
    draft: &Value,
    deployed: Option<&Value>,
    renames: &[Rename],
) -> Result<Applications, DeriveError> {
    let renames = parse_renames(renames)?;
    let draft_shape = shape(draft).map_err(|e| e.under("/draft"))?;
    let deployed_shape = deployed
        .map(shape)
        .transpose()
        .map_err(|e| e.under("/deployed"))?;
    let a = apply_renames(draft_shape.apps(), &renames);
    let b = apply_renames(
        deployed_shape.as_ref().map(Shaped::apps).unwrap_or(&EMPTY),
        &renames,
    );
    let mut changed: Vec<String> = a
        .apps
        .keys()
        .chain(b.apps.keys())
        .filter(|name| !same_value(a.apps.get(name.as_ref()), b.apps.get(name.as_ref())))
        .map(|name| name.to_string())
        .collect();
    changed.sort();
    changed.dedup();
    Ok(Applications {
        draft_path: draft_shape.applications_path,
        deployed_path: deployed_shape.map(|s| s.applications_path),
        changed,
    })
}

/// One section (spec/configuration.md "Sections").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Section {
    pub name: String,
    pub path: String,
    pub deployed_path: Option<String>,
    pub changed: bool,
}

pub fn sections(
    config: &Value,
    deployed: Option<&Value>,
    renames: &[Rename],
    catalog: &[CatalogEntry],
) -> Result<Vec<Section>, DeriveError> {
    let renames = parse_renames(renames)?;
    let c1 = shape(config).map_err(|e| e.under("/configuration"))?;
    let c2 = deployed
        .map(shape)
        .transpose()
        .map_err(|e| e.under("/deployed"))?;
    let a = apply_renames(c1.apps(), &renames);
    let b = apply_renames(c2.as_ref().map(Shaped::apps).unwrap_or(&EMPTY), &renames);
    let known = |name: &str| catalog.iter().any(|e| e.name == name);
    let names = catalog
        .iter()
        .filter(|e| e.configurable)
        .map(|e| e.name.as_str())
        .chain(a.apps.keys().map(|k| k.as_ref()).filter(|n| !known(n)));
    let section = |name: &str| Section {
        name: name.to_string(),
        path: format!("{}/{}", c1.applications_path, pointer::escape(name)),
        deployed_path: match (&c2, b.origin.get(name)) {
            (Some(s), Some(was)) => Some(format!("{}/{}", s.applications_path, was)),
            _ => None,
        },
        changed: !same_value(a.apps.get(name), b.apps.get(name)),
    };
    Ok(names.map(section).collect())
}

impl DeriveError {
    /// The same error, its pointer placed under a request member.
    pub fn under(mut self, prefix: &str) -> Self {
        self.pointer = format!("{prefix}{}", self.pointer);
        self
    }
}

#[cfg(test)]
mod tests;
