use std::collections::HashMap;

use super::*;

/// Every perfect subtree of `leaves`, as the store keeps them.
struct Tree(HashMap<(u8, u64), Hash>);

impl Tree {
    fn of(leaves: &[Hash]) -> Tree {
        let mut map = HashMap::new();
        for (i, leaf) in leaves.iter().enumerate() {
            let i = i as u64;
            map.insert((0, i), *leaf);
            for (level, index) in completed_by(i).skip(1) {
                let l = map[&(level - 1, index * 2)];
                let r = map[&(level - 1, index * 2 + 1)];
                map.insert((level, index), node_hash(&l, &r));
            }
        }
        Tree(map)
    }
}

impl Nodes for Tree {
    type Error = MissingNode;
    fn node(&self, level: u8, index: u64) -> Result<Option<Hash>, MissingNode> {
        Ok(self.0.get(&(level, index)).copied())
    }
}

fn h(s: &str) -> Hash {
    crate::hex::decode(s).unwrap().try_into().unwrap()
}

/// The Certificate Transparency reference leaves (RFC 6962 test data).
fn ct_leaves() -> Vec<Hash> {
    [
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    ]
    .iter()
    .map(|x| leaf_hash(&crate::hex::decode(x).unwrap()))
    .collect()
}

const CT_ROOTS: [&str; 9] = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
];

#[test]
fn roots_match_the_published_vectors_for_every_size() {
    let leaves = ct_leaves();
    let tree = Tree::of(&leaves);
    let mut compact = CompactRange::new();
    assert_eq!(compact.root(), h(CT_ROOTS[0]), "the empty tree");
    for size in 1..=8u64 {
        assert_eq!(root(&tree, size).unwrap(), h(CT_ROOTS[size as usize]));
        compact.push(leaves[size as usize - 1]);
        assert_eq!(compact.root(), h(CT_ROOTS[size as usize]), "size {size}");
    }
}

#[test]
fn inclusion_proofs_match_the_published_vectors() {
    let tree = Tree::of(&ct_leaves());
    let cases: [(u64, u64, &[&str]); 3] = [
        (0, 1, &[]),
        (
            0,
            8,
            &[
                "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
                "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
                "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
            ],
        ),
        (
            5,
            8,
            &[
                "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
                "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
                "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
            ],
        ),
    ];
    let leaves = ct_leaves();
    for (index, size, want) in cases {
        let want: Vec<Hash> = want.iter().map(|x| h(x)).collect();
        assert_eq!(inclusion_path(&tree, index, size).unwrap(), want);
        let r = h(CT_ROOTS[size as usize]);
        assert!(verify_inclusion(
            index,
            size,
            &leaves[index as usize],
            &want,
            &r
        ));
    }
}

#[test]
fn consistency_proofs_match_the_published_vectors() {
    let tree = Tree::of(&ct_leaves());
    let cases: [(u64, u64, &[&str]); 4] = [
        (1, 1, &[]),
        (
            2,
            8,
            &[
                "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
                "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
            ],
        ),
        (
            6,
            8,
            &[
                "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
                "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
                "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
            ],
        ),
        (
            2,
            5,
            &[
                "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
                "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            ],
        ),
    ];
    for (m, n, want) in cases {
        let want: Vec<Hash> = want.iter().map(|x| h(x)).collect();
        assert_eq!(consistency_path(&tree, m, n).unwrap(), want, "{m} -> {n}");
        let (r1, r2) = (h(CT_ROOTS[m as usize]), h(CT_ROOTS[n as usize]));
        assert!(verify_consistency(m, n, &r1, &r2, &want), "{m} -> {n}");
    }
}

#[test]
fn every_proof_in_trees_up_to_70_verifies_and_a_changed_one_does_not() {
    let leaves: Vec<Hash> = (0..70u32).map(|i| leaf_hash(&i.to_be_bytes())).collect();
    let tree = Tree::of(&leaves);
    let roots: Vec<Hash> = (0..=70).map(|n| root(&tree, n).unwrap()).collect();
    for n in 1..=70u64 {
        for i in 0..n {
            let mut path = inclusion_path(&tree, i, n).unwrap();
            assert!(verify_inclusion(
                i,
                n,
                &leaves[i as usize],
                &path,
                &roots[n as usize]
            ));
            let other = leaves[(i as usize + 1) % 70];
            assert!(!verify_inclusion(i, n, &other, &path, &roots[n as usize]));
            if let Some(first) = path.first_mut() {
                first[0] ^= 1;
                assert!(!verify_inclusion(
                    i,
                    n,
                    &leaves[i as usize],
                    &path,
                    &roots[n as usize]
                ));
            }
        }
        for m in 1..=n {
            let mut path = consistency_path(&tree, m, n).unwrap();
            assert!(
                verify_consistency(m, n, &roots[m as usize], &roots[n as usize], &path),
                "{m} -> {n}"
            );
            if let Some(first) = path.first_mut() {
                first[0] ^= 1;
                assert!(!verify_consistency(
                    m,
                    n,
                    &roots[m as usize],
                    &roots[n as usize],
                    &path
                ));
            }
        }
    }
}

#[test]
fn the_compact_range_of_a_prefix_is_its_stored_nodes() {
    let leaves: Vec<Hash> = (0..40u32).map(|i| leaf_hash(&i.to_be_bytes())).collect();
    let tree = Tree::of(&leaves);
    let mut compact = CompactRange::new();
    for (i, leaf) in leaves.iter().enumerate() {
        compact.push(*leaf);
        let size = i as u64 + 1;
        let stored: Vec<Hash> = compact_nodes(size)
            .into_iter()
            .map(|(l, x)| tree.0[&(l, x)])
            .collect();
        assert_eq!(compact.hashes(), stored.as_slice(), "size {size}");
        // Resuming from the stored range gives the same roots as the tree.
        let resumed = CompactRange::from_parts(size, stored).unwrap();
        assert_eq!(resumed.root(), root(&tree, size).unwrap());
    }
    assert!(CompactRange::from_parts(3, vec![[0; 32]]).is_err());
}

#[test]
fn a_proof_past_a_pruned_prefix_needs_only_the_compact_range() {
    // Keep only the compact range of [0, 13) and every node touching a
    // later leaf, as retention does; proofs of kept leaves still work.
    let leaves: Vec<Hash> = (0..50u32).map(|i| leaf_hash(&i.to_be_bytes())).collect();
    let mut tree = Tree::of(&leaves);
    let full: Vec<Hash> = (0..=50).map(|n| root(&tree, n).unwrap()).collect();
    let pruned = 13u64;
    let keep: std::collections::HashSet<(u8, u64)> = compact_nodes(pruned).into_iter().collect();
    tree.0
        .retain(|&(l, i), _| keep.contains(&(l, i)) || ((i + 1) << l) > pruned);
    for n in pruned + 1..=50 {
        assert_eq!(root(&tree, n).unwrap(), full[n as usize]);
        for i in pruned..n {
            let path = inclusion_path(&tree, i, n).unwrap();
            assert!(verify_inclusion(
                i,
                n,
                &leaves[i as usize],
                &path,
                &full[n as usize]
            ));
        }
        for m in pruned + 1..=n {
            let path = consistency_path(&tree, m, n).unwrap();
            assert!(verify_consistency(
                m,
                n,
                &full[m as usize],
                &full[n as usize],
                &path
            ));
        }
    }
}
