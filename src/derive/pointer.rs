//! PURE: RFC 6901 JSON pointers, as renames and error fields use them.

use serde_json::Value;

/// A parsed, non-empty JSON pointer (a list of unescaped tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pointer(Vec<String>);

/// Escapes one token: `~` as `~0`, `/` as `~1`.
pub fn escape(token: &str) -> std::borrow::Cow<'_, str> {
    if !token.contains(['~', '/']) {
        return std::borrow::Cow::Borrowed(token);
    }
    std::borrow::Cow::Owned(token.replace('~', "~0").replace('/', "~1"))
}

impl Pointer {
    /// Parses `/a/b~1c`; `None` for the empty (root) pointer, a pointer not
    /// starting with `/`, or a `~` not followed by `0` or `1`.
    pub fn parse(text: &str) -> Option<Pointer> {
        let rest = text.strip_prefix('/')?;
        let mut tokens = Vec::new();
        for raw in rest.split('/') {
            let mut token = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                if c == '~' {
                    match chars.next() {
                        Some('0') => token.push('~'),
                        Some('1') => token.push('/'),
                        _ => return None,
                    }
                } else {
                    token.push(c);
                }
            }
            tokens.push(token);
        }
        Some(Pointer(tokens))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn token(&self, i: usize) -> &str {
        &self.0[i]
    }

    /// The pointer's text without its leading `/`.
    pub fn escaped_tail(&self) -> String {
        self.0
            .iter()
            .map(|t| escape(t))
            .collect::<Vec<_>>()
            .join("/")
    }

    /// True when `self` names a place strictly below `other`.
    pub fn is_strictly_inside(&self, other: &Pointer) -> bool {
        self.0.len() > other.0.len() && self.0[..other.0.len()] == other.0[..]
    }

    fn parent_and_last(&self) -> (&[String], &str) {
        let (last, parent) = self
            .0
            .split_last()
            .expect("a parsed pointer has at least one token");
        (parent, last)
    }
}

fn object_at_mut<'v>(
    root: &'v mut Value,
    path: &[String],
) -> Option<&'v mut serde_json::Map<String, Value>> {
    let mut here = root;
    for token in path {
        here = here.as_object_mut()?.get_mut(token)?;
    }
    here.as_object_mut()
}

/// Moves the value at `from` to `to` when `from` has a value, `to` is absent,
/// and the parent of `to` is an object. Returns whether it moved.
pub fn move_value(root: &mut Value, from: &Pointer, to: &Pointer) -> bool {
    if to.is_strictly_inside(from) || from == to {
        return false;
    }
    let (to_parent, to_last) = to.parent_and_last();
    match object_at_mut(root, to_parent) {
        Some(parent) if !parent.contains_key(to_last) => {}
        _ => return false,
    }
    let (from_parent, from_last) = from.parent_and_last();
    let Some(value) = object_at_mut(root, from_parent).and_then(|p| p.remove(from_last)) else {
        return false;
    };
    // The parent of `to` was checked above, and removing `from` cannot
    // remove it because `to` is not inside `from`... unless `to`'s parent is
    // inside `from`; then put the value back.
    match object_at_mut(root, to_parent) {
        Some(parent) => {
            parent.insert(to_last.to_string(), value);
            true
        }
        None => {
            if let Some(p) = object_at_mut(root, from_parent) {
                p.insert(from_last.to_string(), value);
            }
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parse_and_escape() {
        assert_eq!(Pointer::parse("/a~1b/c~0d").unwrap().0, vec!["a/b", "c~d"]);
        assert!(Pointer::parse("").is_none());
        assert!(Pointer::parse("a").is_none());
        assert!(Pointer::parse("/a~2").is_none());
        assert!(Pointer::parse("/a~").is_none());
        assert_eq!(escape("a/b~c"), "a~1b~0c");
    }

    #[test]
    fn moves_only_into_an_absent_place_with_an_object_parent() {
        let mut v = json!({"a": {"x": 1}, "b": {}});
        let p = |s| Pointer::parse(s).unwrap();
        assert!(move_value(&mut v, &p("/a/x"), &p("/b/y")));
        assert_eq!(v, json!({"a": {}, "b": {"y": 1}}));
        assert!(
            !move_value(&mut v, &p("/b/y"), &p("/missing/y")),
            "parent of to is missing"
        );
        assert!(!move_value(&mut v, &p("/a"), &p("/b")), "to is present");
        assert!(
            !move_value(&mut v, &p("/a"), &p("/a/inner")),
            "to inside from"
        );
        assert_eq!(v, json!({"a": {}, "b": {"y": 1}}));
    }

    #[test]
    fn parent_of_to_inside_from_leaves_the_value_in_place() {
        // to's parent (/a/x) lies inside from (/a); after removing /a it is gone.
        let mut v = json!({"a": {"x": {}}});
        let p = |s| Pointer::parse(s).unwrap();
        assert!(!move_value(&mut v, &p("/a"), &p("/a/x/y")));
        assert_eq!(v, json!({"a": {"x": {}}}));
    }
}
