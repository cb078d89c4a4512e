use super::*;

fn draft(i: u64) -> Draft {
    Draft {
        at: 1_700_000_000_000 + i as i64,
        actor: Some(Actor {
            subject: format!("user{i}@example.org"),
            issuer: Some("https://id.example.org".into()),
        }),
        trusted_backend: true,
        action: "submit",
        deployment: Some("alice".into()),
        build: None,
        node: None,
        request_id: format!("req-{i}"),
        result: AuditResult::Ok,
        reason: None,
        count: 1,
    }
}

/// `n` chained rows, seq 1..=n.
fn chain(n: u64) -> Vec<(u64, Vec<u8>)> {
    let mut prev = GENESIS;
    (1..=n)
        .map(|seq| {
            let s = seal(&draft(seq), seq, &prev);
            prev = s.hash;
            (seq, s.row)
        })
        .collect()
}

fn walk(rows: &[(u64, Vec<u8>)], pushed: Option<PushedHead>) -> Report {
    let mut w = Walk::new(Anchor::genesis(), pushed);
    for (seq, row) in rows {
        w.feed(*seq, row);
    }
    w.finish()
}

fn kinds(r: &Report) -> Vec<(u64, ProblemKind)> {
    r.problems.iter().map(|p| (p.seq, p.kind)).collect()
}

#[test]
fn a_sealed_event_hashes_as_the_spec_says() {
    let s = seal(&draft(1), 1, &GENESIS);
    let body = &s.row[32..];
    let text = std::str::from_utf8(body).unwrap();
    assert!(
        text.starts_with("{\"action\":\"submit\",\"actor\":{"),
        "{text}"
    );
    assert!(!text.contains("\"hash\""));
    let mut h = Sha256::new();
    h.update(b"berth-audit-v1\n");
    h.update("0".repeat(64).as_bytes());
    h.update(body);
    assert_eq!(<[u8; 32]>::from(h.finalize()), s.hash);
    let back = decode_row(&s.row).unwrap();
    assert_eq!(back, s.event);
}

#[test]
fn an_intact_chain_verifies_and_its_root_is_the_merkle_root() {
    let rows = chain(20);
    let r = walk(&rows, None);
    assert!(r.ok, "{:?}", r.problems);
    assert_eq!(r.size, 20);
    assert_eq!(r.head.as_ref().unwrap().seq, 20);
    let mut c = CompactRange::new();
    for (_, row) in &rows {
        c.push(merkle::leaf_hash(&row[..32]));
    }
    assert_eq!(r.merkle_root, crate::hex::encode(&c.root()));
}

#[test]
fn each_kind_of_tampering_is_found_at_its_seq() {
    // An edited reason.
    let mut rows = chain(10);
    let text = String::from_utf8(rows[2].1[32..].to_vec()).unwrap();
    let edited = text.replace("\"reason\":null", "\"reason\":\"queue_full\"");
    rows[2].1.truncate(32);
    rows[2].1.extend_from_slice(edited.as_bytes());
    assert_eq!(kinds(&walk(&rows, None)), vec![(3, ProblemKind::Changed)]);

    // A middle event removed.
    let mut rows = chain(10);
    rows.remove(4);
    assert_eq!(kinds(&walk(&rows, None)), vec![(5, ProblemKind::Removed)]);

    // Two events swapped (rows moved between keys).
    let mut rows = chain(10);
    let (a, b) = (rows[4].1.clone(), rows[5].1.clone());
    rows[4].1 = b;
    rows[5].1 = a;
    assert_eq!(
        kinds(&walk(&rows, None)),
        vec![(5, ProblemKind::Changed), (6, ProblemKind::Changed)]
    );

    // The tail removed: only a pushed head tells.
    let full = chain(10);
    let pushed = {
        let r = walk(&full, None);
        PushedHead {
            size: r.size,
            root: r.merkle_root,
            at: "now".into(),
        }
    };
    let cut = &full[..8];
    assert!(walk(cut, None).ok);
    assert_eq!(
        kinds(&walk(cut, Some(pushed.clone()))),
        vec![(9, ProblemKind::Rollback)]
    );

    // A chain rewritten whole, consistently: only the pushed root tells.
    let mut prev = GENESIS;
    let forged: Vec<(u64, Vec<u8>)> = (1..=10)
        .map(|seq| {
            let mut d = draft(seq);
            d.result = AuditResult::Refused;
            let s = seal(&d, seq, &prev);
            prev = s.hash;
            (seq, s.row)
        })
        .collect();
    assert!(walk(&forged, None).ok);
    assert_eq!(
        kinds(&walk(&forged, Some(pushed))),
        vec![(10, ProblemKind::Rollback)]
    );
}

#[test]
fn a_pruned_chain_verifies_through_its_anchor_and_a_forged_anchor_does_not() {
    let rows = chain(30);
    let full_root = walk(&rows, None).merkle_root;
    let removed = 11u64;
    let mut c = CompactRange::new();
    for (_, row) in &rows[..removed as usize] {
        c.push(merkle::leaf_hash(&row[..32]));
    }
    let anchor = Anchor {
        first_seq: removed + 1,
        prev_hash: crate::hex::encode(&rows[removed as usize - 1].1[..32]),
        removed_count: removed,
        removed_until: None,
        compact_range: c.hashes().iter().map(|h| crate::hex::encode(h)).collect(),
    };
    let run = |anchor: Anchor| {
        let mut w = Walk::new(anchor, None);
        for (seq, row) in &rows[removed as usize..] {
            w.feed(*seq, row);
        }
        w.finish()
    };
    let r = run(anchor.clone());
    assert!(r.ok, "{:?}", r.problems);
    assert_eq!(
        r.merkle_root, full_root,
        "the root covers the pruned events"
    );
    assert_eq!(r.size, 30);

    let mut forged = anchor.clone();
    forged.prev_hash = "ab".repeat(32);
    assert_eq!(kinds(&run(forged)), vec![(12, ProblemKind::AnchorMismatch)]);
    let mut forged = anchor;
    forged.compact_range.pop();
    assert_eq!(
        kinds(&run(forged)).first(),
        Some(&(12, ProblemKind::AnchorMismatch))
    );
}

#[test]
fn a_garbage_row_is_changed_and_not_a_panic() {
    let mut rows = chain(3);
    rows[1].1 = b"short".to_vec();
    assert_eq!(kinds(&walk(&rows, None)), vec![(2, ProblemKind::Changed)]);
}

proptest::proptest! {
    #[test]
    fn the_fast_canonical_form_is_rfc_8785(
        subject in "\\PC{0,40}|[\\x00-\\x1f\"\\\\/\u{7f}\u{2028}\u{e9}\u{1f600}]{0,12}",
        id in proptest::option::of("[\\x00-\\x7f]{0,20}"),
        seq in 0u64..(1u64 << 53),
    ) {
        let mut d = draft(1);
        d.actor = Some(Actor { subject: subject.clone(), issuer: id.clone() });
        d.request_id = subject;
        d.reason = id;
        let sealed = seal(&d, seq, &GENESIS);
        let mut e = sealed.event.clone();
        e.hash = None;
        let jcs = serde_jcs::to_vec(&e).unwrap();
        proptest::prop_assert_eq!(&sealed.row[32..], jcs.as_slice());
    }
}
