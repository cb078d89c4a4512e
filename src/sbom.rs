//! PURE: a CycloneDX SBOM split into its skeleton and its top-level
//! components, each component keyed by the SHA-256 of its RFC 8785 text, and
//! rebuilt from them (spec sbom.md "Content-addressed components"). No I/O:
//! the store keeps the pieces, the engine decides when.
//!
//! The skeleton is the document without `components`; the node keeps it and
//! the ordered list of component hashes (a hash may repeat). Rebuilding puts
//! `components` back with the components in their order, so the result is
//! JSON-value-equal to the deployer's document. bom-refs are never touched;
//! nested components stay inside their parent's text.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Largest SBOM file read from a deployer (sbom.md).
pub const MAX_SBOM_BYTES: u64 = 64 * 1024 * 1024;

/// A component's key: SHA-256 of its RFC 8785 canonical text.
pub type Hash = [u8; 32];

/// One top-level component, canonical.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Component {
    pub hash: Hash,
    /// RFC 8785 text of the component.
    pub text: String,
}

/// A document split for storage.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    /// The document without its `components` member.
    pub skeleton: Value,
    /// Whether the document had a `components` member (an empty list and no
    /// list rebuild differently).
    pub had_components: bool,
    /// The top-level components in their order.
    pub components: Vec<Component>,
}

/// Why a file is not a usable SBOM; its text is for the person reading the
/// node's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SbomError {
    Nul,
    NotJson,
    NotCycloneDx,
    ComponentsNotList,
    NotCanonical,
}

impl std::fmt::Display for SbomError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SbomError::Nul => "the SBOM contains the character U+0000",
            SbomError::NotJson => "the SBOM is not JSON",
            SbomError::NotCycloneDx => "the SBOM is not CycloneDX (bomFormat is not \"CycloneDX\")",
            SbomError::ComponentsNotList => "the SBOM's components member is not a list",
            SbomError::NotCanonical => "a component cannot be written as RFC 8785 JSON",
        })
    }
}

/// The document, if `bytes` is a usable CycloneDX SBOM.
pub fn check(bytes: &[u8]) -> Result<Value, SbomError> {
    // JSON escapes U+0000 as \u0000; a raw NUL byte is not valid JSON anyway.
    if bytes.windows(6).any(|w| w == b"\\u0000") {
        return Err(SbomError::Nul);
    }
    let doc: Value = serde_json::from_slice(bytes).map_err(|_| SbomError::NotJson)?;
    if doc.get("bomFormat").and_then(Value::as_str) != Some("CycloneDX") {
        return Err(SbomError::NotCycloneDx);
    }
    if doc.get("components").is_some_and(|c| !c.is_array()) {
        return Err(SbomError::ComponentsNotList);
    }
    Ok(doc)
}

/// Splits a checked document.
pub fn split(mut doc: Value) -> Result<Split, SbomError> {
    let components = match doc.as_object_mut().and_then(|m| m.remove("components")) {
        None => None,
        Some(Value::Array(list)) => Some(list),
        Some(_) => return Err(SbomError::ComponentsNotList),
    };
    let had_components = components.is_some();
    let components = components
        .unwrap_or_default()
        .iter()
        .map(canonical)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Split {
        skeleton: doc,
        had_components,
        components,
    })
}

/// A component's canonical text and hash.
pub fn canonical(value: &Value) -> Result<Component, SbomError> {
    let text = serde_jcs::to_string(value).map_err(|_| SbomError::NotCanonical)?;
    Ok(Component {
        hash: Sha256::digest(text.as_bytes()).into(),
        text,
    })
}

/// The document again: the skeleton with `components` in their order.
pub fn rebuild(mut skeleton: Value, had_components: bool, components: Vec<Value>) -> Value {
    if had_components {
        if let Some(map) = skeleton.as_object_mut() {
            map.insert("components".into(), Value::Array(components));
        }
    }
    skeleton
}

/// The document again, as JSON text, without parsing the components: the
/// skeleton's text with `"components":[...]` spliced in, where the caller
/// appends the stored canonical text of each component. The pieces joined
/// are value-equal to `rebuild` (tested): a 5 MB document costs copies,
/// not a parse.
///
/// It comes in pieces of about `piece_bytes`, one per `next_piece` (a
/// piece ends after the component that reaches the size, so a component is
/// never split and a piece is at most `piece_bytes` plus one component):
/// the read route streams them and makes the next only when the reader
/// took the last, so a reader that stops reading holds a piece, not the
/// document (api.md "Fair shares").
pub struct Pieces {
    /// The skeleton's text up to its closing brace, until the first piece.
    head: Option<String>,
    had_components: bool,
    count: usize,
    /// The next component to write.
    next: usize,
    piece_bytes: usize,
    done: bool,
}

impl Pieces {
    /// `None` when `skeleton` is not the text of an object (as `split`
    /// makes it).
    pub fn new(
        skeleton: &str,
        had_components: bool,
        count: usize,
        piece_bytes: usize,
    ) -> Option<Pieces> {
        let body = skeleton.trim_end().strip_suffix('}')?;
        Some(Pieces {
            head: Some(body.to_string()),
            had_components,
            count,
            next: 0,
            piece_bytes: piece_bytes.max(1),
            done: false,
        })
    }

    /// The next piece, or `None` after the last. `write_component(i, out)`
    /// appends the i-th component's text.
    pub fn next_piece<E>(
        &mut self,
        mut write_component: impl FnMut(usize, &mut Vec<u8>) -> Result<(), E>,
    ) -> Result<Option<Vec<u8>>, E> {
        if self.done {
            return Ok(None);
        }
        let mut out = Vec::new();
        if let Some(body) = self.head.take() {
            out.extend_from_slice(body.as_bytes());
            if self.had_components {
                // An object with members ends them with a value before
                // `}`; an empty one is `{` and whitespace.
                let empty = body.trim_end().ends_with('{');
                out.extend_from_slice(if empty {
                    b"\"components\":["
                } else {
                    b",\"components\":["
                });
            }
        }
        if self.had_components {
            while self.next < self.count {
                if self.next > 0 {
                    out.push(b',');
                }
                write_component(self.next, &mut out)?;
                self.next += 1;
                if out.len() >= self.piece_bytes {
                    return Ok(Some(out));
                }
            }
            out.push(b']');
        }
        out.push(b'}');
        self.done = true;
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn split_and_rebuild_are_value_equal_with_repeats_and_nesting() {
        let doc = json!({
            "bomFormat": "CycloneDX", "specVersion": "1.5",
            "metadata": {"component": {"name": "web"}},
            "components": [
                {"name": "a", "version": "1", "bom-ref": "dup"},
                {"version": "2", "name": "b", "components": [{"name": "inner"}]},
                {"name": "a", "bom-ref": "dup", "version": "1"}
            ],
            "dependencies": [{"ref": "dup"}]
        });
        let split = split(check(doc.to_string().as_bytes()).unwrap()).unwrap();
        assert_eq!(split.components.len(), 3);
        assert_eq!(
            split.components[0].hash, split.components[2].hash,
            "key order does not change the hash"
        );
        assert_ne!(split.components[0].hash, split.components[1].hash);
        assert!(split.skeleton.get("components").is_none());
        let parts = split
            .components
            .iter()
            .map(|c| serde_json::from_str(&c.text).unwrap())
            .collect();
        assert_eq!(rebuild(split.skeleton, true, parts), doc);
    }

    #[test]
    fn the_spliced_text_is_value_equal_to_the_rebuilt_value() {
        let docs = [
            json!({"bomFormat": "CycloneDX", "components": [{"name": "a"}, {"name": "b", "components": [{"x": 1}]}], "metadata": {}}),
            json!({"bomFormat": "CycloneDX"}),
            json!({"bomFormat": "CycloneDX", "components": []}),
            json!({"components": [{"name": "only"}]}),
        ];
        for doc in docs {
            let s = split(doc.clone()).unwrap();
            let texts: Vec<&[u8]> = s.components.iter().map(|c| c.text.as_bytes()).collect();
            let largest = texts.iter().map(|t| t.len()).max().unwrap_or(0);
            let skeleton = s.skeleton.to_string();
            for piece_bytes in [1, 16, usize::MAX] {
                let mut pieces: Vec<Vec<u8>> = Vec::new();
                let mut rebuilt =
                    Pieces::new(&skeleton, s.had_components, texts.len(), piece_bytes).unwrap();
                while let Some(piece) = rebuilt
                    .next_piece(|i, out| {
                        out.extend_from_slice(texts[i]);
                        Ok::<(), ()>(())
                    })
                    .unwrap()
                {
                    pieces.push(piece);
                }
                if piece_bytes < usize::MAX {
                    // Every piece but the first (the skeleton) and the
                    // last (the closing) holds whole components up to the
                    // size and at most one more.
                    for p in pieces.iter().skip(1).take(pieces.len().saturating_sub(2)) {
                        assert!(p.len() <= piece_bytes + largest + 1, "a piece is bounded");
                    }
                } else {
                    assert_eq!(pieces.len(), 1);
                }
                let parsed: Value = serde_json::from_slice(&pieces.concat()).unwrap();
                assert_eq!(parsed, doc);
            }
        }
        let none = Pieces::new("[1]", true, 0, 16).is_none();
        assert!(none, "not an object");
    }

    #[test]
    fn a_document_without_components_stays_without() {
        let doc = json!({"bomFormat": "CycloneDX", "specVersion": "1.4"});
        let s = split(doc.clone()).unwrap();
        assert!(!s.had_components);
        assert_eq!(rebuild(s.skeleton, false, vec![]), doc);
        let empty = json!({"bomFormat": "CycloneDX", "components": []});
        let s = split(empty.clone()).unwrap();
        assert_eq!(rebuild(s.skeleton, s.had_components, vec![]), empty);
    }

    #[test]
    fn bad_documents_say_why() {
        assert_eq!(check(b"not json"), Err(SbomError::NotJson));
        assert_eq!(
            check(br#"{"bomFormat": "SPDX"}"#),
            Err(SbomError::NotCycloneDx)
        );
        assert_eq!(
            check(br#"{"bomFormat": "CycloneDX", "x": "a\u0000b"}"#),
            Err(SbomError::Nul)
        );
        assert_eq!(
            check(br#"{"bomFormat": "CycloneDX", "components": {}}"#),
            Err(SbomError::ComponentsNotList)
        );
    }
}
