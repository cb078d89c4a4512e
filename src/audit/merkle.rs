//! RFC 6962 / RFC 9162 Merkle tree math over the audit chain: tree heads,
//! inclusion and consistency proofs, and their verification. Pure: the
//! store hands in the stored perfect subtrees through a lookup closure, so
//! the same code proves against redb and against a `Vec` in the tests.
//!
//! Leaves are indexed from 0; a perfect aligned subtree is named by
//! `(level, index)`: it covers leaves `[index << level, (index + 1) << level)`.

use sha2::{Digest, Sha256};

pub type Hash = [u8; 32];

/// Tree sizes are u64, so no path is longer than this; also the most
/// hashes a compact range holds.
pub const MAX_LEVELS: usize = 64;

/// `SHA-256(0x00 || data)`.
pub fn leaf_hash(data: &[u8]) -> Hash {
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update(data);
    h.finalize().into()
}

/// `SHA-256(0x01 || left || right)`.
pub fn node_hash(left: &Hash, right: &Hash) -> Hash {
    let mut h = Sha256::new();
    h.update([1u8]);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

/// The root of the empty tree: `SHA-256("")`.
pub fn empty_root() -> Hash {
    Sha256::digest([]).into()
}

/// The largest power of two smaller than `n` (n >= 2): RFC 6962's split.
fn split(n: u64) -> u64 {
    debug_assert!(n >= 2);
    1u64 << (63 - (n - 1).leading_zeros())
}

/// A stored perfect subtree was not there (pruned, or the store is short).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingNode {
    pub level: u8,
    pub index: u64,
}

/// Looks up a perfect aligned subtree's hash.
pub trait Nodes {
    type Error: From<MissingNode>;
    fn node(&self, level: u8, index: u64) -> Result<Option<Hash>, Self::Error>;
}

/// The subtree `(level, index)`, or `MissingNode` as the lookup's error.
pub fn get<N: Nodes>(nodes: &N, level: u8, index: u64) -> Result<Hash, N::Error> {
    nodes
        .node(level, index)?
        .ok_or(N::Error::from(MissingNode { level, index }))
}

/// MTH(D[a:b]) for a range that RFC 6962's recursion produces (`a` aligned
/// to the largest power of two not above `b - a`): the right fold of its
/// binary decomposition into perfect subtrees.
pub fn range_root<N: Nodes>(nodes: &N, a: u64, b: u64) -> Result<Hash, N::Error> {
    if a == b {
        return Ok(empty_root());
    }
    let mut parts: Vec<Hash> = Vec::with_capacity(MAX_LEVELS);
    let mut start = a;
    while start < b {
        let size = b - start;
        let level = 63 - size.leading_zeros();
        // The largest aligned perfect subtree starting at `start` that fits.
        let align = if start == 0 {
            level
        } else {
            start.trailing_zeros().min(level)
        };
        parts.push(get(nodes, align as u8, start >> align)?);
        start += 1u64 << align;
    }
    let mut acc = parts.pop().unwrap_or_else(empty_root);
    while let Some(left) = parts.pop() {
        acc = node_hash(&left, &acc);
    }
    Ok(acc)
}

/// The root of the tree of the first `size` leaves.
pub fn root<N: Nodes>(nodes: &N, size: u64) -> Result<Hash, N::Error> {
    range_root(nodes, 0, size)
}

/// RFC 6962 PATH(m, D[0:size]): the inclusion proof of leaf `m`.
pub fn inclusion_path<N: Nodes>(nodes: &N, m: u64, size: u64) -> Result<Vec<Hash>, N::Error> {
    assert!(m < size, "leaf {m} is not in a tree of {size}");
    let mut path = Vec::new();
    let (mut a, mut b) = (0u64, size);
    // Walk down, collecting siblings top-down; the proof lists them bottom-up.
    while b - a > 1 {
        let k = split(b - a);
        if m < a + k {
            path.push(range_root(nodes, a + k, b)?);
            b = a + k;
        } else {
            path.push(range_root(nodes, a, a + k)?);
            a += k;
        }
    }
    path.reverse();
    Ok(path)
}

/// RFC 6962 PROOF(m, D[0:n]): the consistency proof from size `m` to `n`
/// (0 < m <= n; empty when m == n).
pub fn consistency_path<N: Nodes>(nodes: &N, m: u64, n: u64) -> Result<Vec<Hash>, N::Error> {
    assert!(0 < m && m <= n, "no consistency proof from {m} to {n}");
    let mut path = Vec::new();
    let (mut a, mut b, mut m, mut whole) = (0u64, n, m, true);
    loop {
        let size = b - a;
        if m == size {
            if !whole {
                path.push(range_root(nodes, a, b)?);
            }
            break;
        }
        let k = split(size);
        if m <= k {
            path.push(range_root(nodes, a + k, b)?);
            b = a + k;
        } else {
            path.push(range_root(nodes, a, a + k)?);
            a += k;
            m -= k;
            whole = false;
        }
    }
    path.reverse();
    Ok(path)
}

/// RFC 9162 2.1.3.2: does `path` prove leaf `index` (hash `leaf`) in the
/// tree of `size` with `root`?
pub fn verify_inclusion(index: u64, size: u64, leaf: &Hash, path: &[Hash], root: &Hash) -> bool {
    if index >= size {
        return false;
    }
    let (mut f_n, mut s_n) = (index, size - 1);
    let mut r = *leaf;
    for p in path {
        if s_n == 0 {
            return false;
        }
        if f_n & 1 == 1 || f_n == s_n {
            r = node_hash(p, &r);
            if f_n & 1 == 0 {
                while f_n & 1 == 0 && f_n != 0 {
                    f_n >>= 1;
                    s_n >>= 1;
                }
            }
        } else {
            r = node_hash(&r, p);
        }
        f_n >>= 1;
        s_n >>= 1;
    }
    s_n == 0 && r == *root
}

/// RFC 9162 2.1.4.2: does `path` prove the tree of `size1` (`root1`) is a
/// prefix of the tree of `size2` (`root2`)?
pub fn verify_consistency(
    size1: u64,
    size2: u64,
    root1: &Hash,
    root2: &Hash,
    path: &[Hash],
) -> bool {
    if size1 > size2 {
        return false;
    }
    if size1 == size2 {
        return path.is_empty() && root1 == root2;
    }
    if size1 == 0 {
        return path.is_empty();
    }
    let mut path: Vec<Hash> = path.to_vec();
    if size1.is_power_of_two() {
        path.insert(0, *root1);
    }
    let Some((first, rest)) = path.split_first() else {
        return false;
    };
    let (mut f_n, mut s_n) = (size1 - 1, size2 - 1);
    while f_n & 1 == 1 {
        f_n >>= 1;
        s_n >>= 1;
    }
    let (mut fr, mut sr) = (*first, *first);
    for c in rest {
        if s_n == 0 {
            return false;
        }
        if f_n & 1 == 1 || f_n == s_n {
            fr = node_hash(c, &fr);
            sr = node_hash(c, &sr);
            if f_n & 1 == 0 {
                while f_n & 1 == 0 && f_n != 0 {
                    f_n >>= 1;
                    s_n >>= 1;
                }
            }
        } else {
            sr = node_hash(&sr, c);
        }
        f_n >>= 1;
        s_n >>= 1;
    }
    fr == *root1 && sr == *root2 && s_n == 0
}

/// The compact range of a prefix `[0, size)`: the perfect subtrees of its
/// binary decomposition, largest (leftmost) first. Appending a leaf merges
/// equal-sized neighbours; the root folds them right to left. This is what
/// the retention anchor keeps of a pruned prefix, and how `verify`
/// recomputes the root in one pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactRange {
    size: u64,
    hashes: Vec<Hash>,
}

/// A compact range whose hash count does not match its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadCompactRange;

impl CompactRange {
    pub fn new() -> Self {
        Self::default()
    }

    /// From a stored anchor: `hashes` must be one per set bit of `size`.
    pub fn from_parts(size: u64, hashes: Vec<Hash>) -> Result<Self, BadCompactRange> {
        if hashes.len() != size.count_ones() as usize {
            return Err(BadCompactRange);
        }
        Ok(CompactRange { size, hashes })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn hashes(&self) -> &[Hash] {
        &self.hashes
    }

    /// Adds the leaf hash (already `leaf_hash`ed) of leaf `size`.
    pub fn push(&mut self, leaf: Hash) {
        let mut h = leaf;
        let mut merges = self.size.trailing_ones();
        while merges > 0 {
            // A set bit below means a perfect subtree of that size waits.
            let left = self.hashes.pop().expect("a set bit has its hash");
            h = node_hash(&left, &h);
            merges -= 1;
        }
        self.hashes.push(h);
        self.size += 1;
        debug_assert_eq!(self.hashes.len(), self.size.count_ones() as usize);
    }

    pub fn root(&self) -> Hash {
        let mut it = self.hashes.iter().rev();
        let Some(last) = it.next() else {
            return empty_root();
        };
        it.fold(*last, |acc, left| node_hash(left, &acc))
    }
}

/// The perfect subtrees `(level, index)` whose hashes make the compact
/// range of `[0, size)`, left to right.
pub fn compact_nodes(size: u64) -> Vec<(u8, u64)> {
    let mut out = Vec::new();
    let mut start = 0u64;
    for level in (0..64u8).rev() {
        if size & (1u64 << level) != 0 {
            out.push((level, start >> level));
            start += 1u64 << level;
        }
    }
    out
}

/// The perfect subtrees completed by appending leaf `index` (leaf level
/// first): what the store writes for each new event.
pub fn completed_by(index: u64) -> impl Iterator<Item = (u8, u64)> {
    let levels = (index + 1).trailing_zeros();
    (0..=levels).map(move |l| (l as u8, index >> l))
}

#[cfg(test)]
mod tests;
