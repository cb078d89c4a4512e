//! The `local` deployer's built-in catalog, JSON Schema and package lists.

use serde_json::{json, Value};

use crate::derive::CatalogEntry;

/// (name, configurable, operator_toggled, subdomain), in catalog order.
const CATALOG: &[(&str, bool, bool, Option<&str>)] = &[
    ("mastodon", true, false, Some("mastodon")),
    ("pixelfed", true, false, Some("pixelfed")),
    ("peertube", true, false, Some("peertube")),
    ("forgejo", true, false, Some("git")),
    ("homepage", true, false, None),
    ("garage", false, true, Some("s3")),
];

pub fn catalog() -> Vec<CatalogEntry> {
    CATALOG
        .iter()
        .map(|(name, configurable, operator_toggled, sub)| CatalogEntry {
            name: name.to_string(),
            configurable: *configurable,
            operator_toggled: *operator_toggled,
            subdomain: sub.map(str::to_string),
        })
        .collect()
}

/// The JSON Schema (2020-12) of a configuration, both shapes.
pub fn schema() -> Value {
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$defs": {
            "body": {
                "type": "object",
                "properties": {
                    "domain": {"type": ["string", "null"], "maxLength": 253},
                    "applications": {
                        "type": "object",
                        "maxProperties": 64,
                        "additionalProperties": {
                            "type": "object",
                            "properties": {
                                "enable": {"type": "boolean"},
                                "unhealthy": {"type": "boolean", "description": "The local deployer's health check fails this application's node (to try an automatic rollback)."}
                            }
                        }
                    }
                }
            }
        },
        "type": "object",
        "if": {"required": ["deployment"]},
        "then": {
            "properties": {
                "deployment": {
                    "type": "object",
                    "properties": {"local": {"$ref": "#/$defs/body"}},
                    "minProperties": 1,
                    "maxProperties": 1
                }
            }
        },
        "else": {
            "$ref": "#/$defs/body",
            "properties": {"method": {"type": "string"}}
        }
    })
}

/// One package of a node's SBOM: (name, version, license).
type Package = (&'static str, &'static str, &'static str);

const BASE: &[Package] = &[
    ("glibc", "2.40-66", "LGPL-2.1-or-later"),
    ("systemd", "256.10", "LGPL-2.1-or-later"),
    ("openssl", "3.3.2", "Apache-2.0"),
    ("openssh", "9.9p1", "BSD-2-Clause"),
    ("nginx", "1.26.2", "BSD-2-Clause"),
    ("bash", "5.2p37", "GPL-3.0-or-later"),
    ("coreutils", "9.5", "GPL-3.0-or-later"),
];

/// The system packages every node runs on (its NixOS closure's base).
pub fn base_packages() -> &'static [Package] {
    BASE
}

/// The packages of an application's node.
pub fn packages(app: &str) -> &'static [Package] {
    match app {
        "base" => BASE,
        "mastodon" => &[
            ("mastodon", "4.3.2", "AGPL-3.0-or-later"),
            ("ruby", "3.3.6", "Ruby"),
            ("nodejs", "20.18.1", "MIT"),
            ("postgresql", "16.6", "PostgreSQL"),
            ("redis", "7.2.6", "BSD-3-Clause"),
            ("imagemagick", "7.1.1-41", "ImageMagick"),
            ("ffmpeg-headless", "7.1", "LGPL-2.1-or-later"),
        ],
        "pixelfed" => &[
            ("pixelfed", "0.12.4", "AGPL-3.0-only"),
            ("php", "8.3.14", "PHP-3.01"),
            ("postgresql", "16.6", "PostgreSQL"),
            ("redis", "7.2.6", "BSD-3-Clause"),
            ("jpegoptim", "1.5.5", "GPL-3.0-or-later"),
        ],
        "peertube" => &[
            ("peertube", "6.3.3", "AGPL-3.0-only"),
            ("nodejs", "20.18.1", "MIT"),
            ("postgresql", "16.6", "PostgreSQL"),
            ("redis", "7.2.6", "BSD-3-Clause"),
            ("ffmpeg-headless", "7.1", "LGPL-2.1-or-later"),
        ],
        "forgejo" => &[
            ("forgejo", "9.0.3", "GPL-3.0-or-later"),
            ("git", "2.47.1", "GPL-2.0-only"),
            ("openssh", "9.9p1", "BSD-2-Clause"),
        ],
        "homepage" => &[("homepage-dashboard", "0.9.13", "GPL-3.0-only")],
        "garage" => &[("garage", "1.0.1", "AGPL-3.0-only")],
        // An application the catalog does not know runs in a generic container.
        _ => &[
            ("podman", "5.3.1", "Apache-2.0"),
            ("conmon", "2.1.12", "Apache-2.0"),
        ],
    }
}
