//! Table tests of every rule of spec/configuration.md, and property tests.

use super::*;
use proptest::prelude::*;
use serde_json::json;

pub fn local_catalog() -> Vec<CatalogEntry> {
    crate::local_deployer::catalog::catalog()
}

fn renames(list: &[(&str, &str)]) -> Vec<Rename> {
    list.iter()
        .map(|(f, t)| Rename {
            from: f.to_string(),
            to: t.to_string(),
        })
        .collect()
}

fn example() -> (Value, Value, Vec<Rename>) {
    (
        json!({"domain": "a.example.org", "applications": {"mastodon": {"enable": true}, "fedi2": {"x": 1}, "garage": {"enable": true}}}),
        json!({"deployment": {"local": {"domain": "a.example.org", "applications": {"fedi": {"enable": true}}}}}),
        renames(&[("/fedi", "/mastodon")]),
    )
}

#[test]
fn worked_example_sections() {
    let (draft, deployed, r) = example();
    let s = sections(&draft, Some(&deployed), &r, &local_catalog()).unwrap();
    let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["mastodon", "pixelfed", "peertube", "forgejo", "homepage", "fedi2"]
    );
    assert_eq!(
        s[0],
        Section {
            name: "mastodon".into(),
            path: "/applications/mastodon".into(),
            deployed_path: Some("/deployment/local/applications/fedi".into()),
            changed: false
        }
    );
    for mid in &s[1..5] {
        assert_eq!(mid.path, format!("/applications/{}", mid.name));
        assert_eq!(mid.deployed_path, None);
        assert!(!mid.changed);
    }
    assert_eq!(
        s[5],
        Section {
            name: "fedi2".into(),
            path: "/applications/fedi2".into(),
            deployed_path: None,
            changed: true
        }
    );
}

#[test]
fn worked_example_applications_and_instances() {
    let (draft, deployed, r) = example();
    let a = applications(&draft, Some(&deployed), &r).unwrap();
    assert_eq!(a.changed, ["fedi2", "garage"]);
    assert_eq!(a.draft_path, "/applications");
    assert_eq!(
        a.deployed_path.as_deref(),
        Some("/deployment/local/applications")
    );
    let without = applications(&draft, Some(&deployed), &[]).unwrap();
    assert_eq!(without.changed, ["fedi", "fedi2", "garage", "mastodon"]);

    let (domain, inst) = instances(&draft, &local_catalog()).unwrap();
    assert_eq!(domain.as_deref(), Some("a.example.org"));
    let garage = inst.iter().find(|i| i.name == "garage").unwrap();
    assert_eq!(
        garage,
        &Instance {
            name: "garage".into(),
            configurable: false,
            operator_toggled: true,
            enabled: true,
            domain: Some("s3.a.example.org".into()),
            url: Some("https://s3.a.example.org/".into()),
            section: None
        }
    );
    let homepage = inst.iter().find(|i| i.name == "homepage").unwrap();
    assert_eq!(homepage.domain.as_deref(), Some("a.example.org"));
    assert_eq!(homepage.url, None, "disabled instance has no url");
    let forgejo = inst.iter().find(|i| i.name == "forgejo").unwrap();
    assert_eq!(forgejo.domain.as_deref(), Some("git.a.example.org"));
    assert_eq!(inst.last().unwrap().name, "fedi2");
    assert_eq!(inst.last().unwrap().section.as_deref(), Some("fedi2"));
}

#[test]
fn no_domain_means_no_domains_and_no_urls() {
    let c = json!({"applications": {"mastodon": {"enable": true}}});
    let (domain, inst) = instances(&c, &local_catalog()).unwrap();
    assert_eq!(domain, None);
    assert!(inst.iter().all(|i| i.domain.is_none() && i.url.is_none()));
    assert!(inst.iter().find(|i| i.name == "mastodon").unwrap().enabled);
}

#[test]
fn unknown_applications_sorted_and_non_label_has_no_domain() {
    let c = json!({"domain": "d.org", "applications": {"zeta": {"enable": true}, "Not A Label": {"enable": true}, "alpha": {}}});
    let (_, inst) = instances(&c, &local_catalog()).unwrap();
    let tail: Vec<&str> = inst[6..].iter().map(|i| i.name.as_str()).collect();
    assert_eq!(tail, ["Not A Label", "alpha", "zeta"]);
    assert_eq!(inst[6].domain, None);
    assert_eq!(inst[6].url, None);
    assert!(inst[6].configurable && !inst[6].operator_toggled);
    assert_eq!(inst[8].url.as_deref(), Some("https://zeta.d.org/"));
    assert_eq!(inst[7].url, None, "alpha is not enabled");
}

#[test]
fn enable_must_be_exactly_true() {
    let c = json!({"domain": "d.org", "applications": {"mastodon": {"enable": "true"}, "pixelfed": {"enable": 1}}});
    let (_, inst) = instances(&c, &local_catalog()).unwrap();
    assert!(inst.iter().all(|i| !i.enabled));
}

#[test]
fn shape_errors_name_the_pointer() {
    let cases = [
        (json!({"domain": 5}), "/domain"),
        (json!({"applications": []}), "/applications"),
        (json!({"deployment": {}}), "/deployment"),
        (json!({"deployment": {"a": {}, "b": {}}}), "/deployment"),
        (json!({"deployment": {"local": 1}}), "/deployment/local"),
        (
            json!({"deployment": {"lo/cal": {"domain": true}}}),
            "/deployment/lo~1cal/domain",
        ),
        (json!([1]), ""),
    ];
    for (c, ptr) in cases {
        assert_eq!(shape(&c).unwrap_err().pointer, ptr, "{c}");
    }
    assert_eq!(
        shape(&json!({})).unwrap().applications_path,
        "/applications"
    );
    assert_eq!(shape(&json!({"domain": null})).unwrap().domain, None);
}

#[test]
fn renames_of_settings_and_chains() {
    let draft = json!({"applications": {"mastodon": {"single_user": true}}});
    let deployed = json!({"applications": {"mastodon": {"singleUser": true}}});
    let r = renames(&[("/mastodon/singleUser", "/mastodon/single_user")]);
    assert!(applications(&draft, Some(&deployed), &r)
        .unwrap()
        .changed
        .is_empty());
    assert_eq!(
        applications(&draft, Some(&deployed), &[]).unwrap().changed,
        ["mastodon"]
    );

    // a -> b, then b -> c: values stored under a or b both reach c in one pass.
    let chain = renames(&[("/a", "/b"), ("/b", "/c")]);
    for old in ["a", "b"] {
        let deployed = json!({"applications": {old: {"enable": true}}});
        let draft = json!({"applications": {"c": {"enable": true}}});
        let s = sections(&draft, Some(&deployed), &chain, &local_catalog()).unwrap();
        let c = s.iter().find(|s| s.name == "c").unwrap();
        assert!(!c.changed, "{old}");
        assert_eq!(
            c.deployed_path.as_deref(),
            Some(format!("/applications/{old}").as_str())
        );
    }
}

#[test]
fn rename_whose_target_parent_is_missing_does_nothing() {
    let deployed = json!({"applications": {"mastodon": {"x": 1}}});
    let r = renames(&[("/mastodon/x", "/pixelfed/x")]);
    let renamed = apply_renames(
        shape(&deployed).unwrap().apps(),
        &parse_renames(&r).unwrap(),
    );
    let apps: Map<String, Value> = renamed
        .apps
        .into_iter()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    assert_eq!(Value::Object(apps), json!({"mastodon": {"x": 1}}));
}

#[test]
fn malformed_renames_are_refused_with_their_index() {
    let c = json!({});
    for (list, ptr) in [
        (
            renames(&[("/ok", "/fine"), ("nope", "/x")]),
            "/renames/1/from",
        ),
        (renames(&[("/a", "/b~")]), "/renames/0/to"),
        (renames(&[("", "/b")]), "/renames/0/from"),
        (renames(&[("/a", "/a/b")]), "/renames/0/to"),
    ] {
        assert_eq!(applications(&c, None, &list).unwrap_err().pointer, ptr);
        assert_eq!(
            sections(&c, None, &list, &local_catalog())
                .unwrap_err()
                .pointer,
            ptr
        );
    }
}

#[test]
fn catalog_not_configurable_is_never_a_section() {
    let c = json!({"applications": {"garage": {"enable": true}}});
    let s = sections(&c, None, &[], &local_catalog()).unwrap();
    assert!(s.iter().all(|s| s.name != "garage"));
}

#[test]
fn json_eq_matches_canonical_comparison() {
    let cases = [
        (json!(1), json!(1.0), true),
        (
            json!({"a": [1, {"b": 2.50}]}),
            json!({"a": [1.0, {"b": 2.5}]}),
            true,
        ),
        (json!([1, 2]), json!([2, 1]), false),
        (json!({"a": 1}), json!({"a": 1, "b": null}), false),
        (json!("1"), json!(1), false),
        (json!(9007199254740993u64), json!(9007199254740992u64), true),
    ];
    for (a, b, eq) in cases {
        assert_eq!(json_eq(&a, &b), eq, "{a} vs {b}");
        assert_eq!(
            canonical(&a).ok() == canonical(&b).ok(),
            eq,
            "canonical {a} vs {b}"
        );
    }
}

#[test]
fn setting_renames_across_applications() {
    // A setting moves from one application into another that exists.
    let deployed = json!({"applications": {"old": {"x": 1}, "new": {}}});
    let r = parse_renames(&renames(&[("/old/x", "/new/x")])).unwrap();
    let renamed = apply_renames(shape(&deployed).unwrap().apps(), &r);
    assert_eq!(renamed.apps["new"].as_ref(), &json!({"x": 1}));
    assert_eq!(renamed.apps["old"].as_ref(), &json!({}));
}

#[test]
fn a_setting_moved_to_the_top_keeps_its_stored_place() {
    let deployed = json!({"applications": {"legacy": {"blog": {"enable": true}}}});
    let draft = json!({"applications": {"blog": {"enable": true}}});
    let s = sections(
        &draft,
        Some(&deployed),
        &renames(&[("/legacy/blog", "/blog")]),
        &local_catalog(),
    )
    .unwrap();
    let blog = s.iter().find(|s| s.name == "blog").unwrap();
    assert_eq!(
        blog.deployed_path.as_deref(),
        Some("/applications/legacy/blog")
    );
    assert!(!blog.changed);
}

#[test]
fn numbers_and_order_do_not_count_as_changes() {
    let a: Value = serde_json::from_str(r#"{"applications":{"m":{"a":1,"b":[1.0,2]}}}"#).unwrap();
    let b: Value = serde_json::from_str(r#"{"applications":{"m":{"b":[1,2.0],"a":1.0}}}"#).unwrap();
    assert!(applications(&a, Some(&b), &[]).unwrap().changed.is_empty());
}

fn arb_json(depth: u32) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i32>().prop_map(|n| json!(n)),
        "[a-z/~ ]{0,6}".prop_map(Value::String),
    ];
    leaf.prop_recursive(depth, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            prop::collection::btree_map("[a-z/~]{1,5}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn arb_apps() -> impl Strategy<Value = Map<String, Value>> {
    let name = prop_oneof![
        Just("mastodon".to_string()),
        Just("garage".to_string()),
        Just("homepage".to_string()),
        "[a-z~/]{1,6}",
    ];
    let app = (any::<Option<bool>>(), arb_json(2)).prop_map(|(en, extra)| {
        let mut m = Map::new();
        if let Some(en) = en {
            m.insert("enable".into(), Value::Bool(en));
        }
        m.insert("extra".into(), extra);
        Value::Object(m)
    });
    prop::collection::btree_map(name, app, 0..6).prop_map(|m| m.into_iter().collect())
}

fn flat(domain: &Option<String>, apps: &Map<String, Value>) -> Value {
    json!({"domain": domain, "applications": apps})
}

fn collapsed(domain: &Option<String>, apps: &Map<String, Value>) -> Value {
    json!({"deployment": {"local": {"domain": domain, "applications": apps}}})
}

fn respell(v: &Value) -> Value {
    // Integers become floats: 1 -> 1.0. Order of members is irrelevant in a
    // Map, so re-inserting in reverse tests nothing new; spelling does.
    match v {
        Value::Number(n) => n.as_f64().map(|f| json!(f)).unwrap_or_else(|| v.clone()),
        Value::Array(a) => Value::Array(a.iter().map(respell).collect()),
        Value::Object(m) => Value::Object(
            m.iter()
                .rev()
                .map(|(k, v)| (k.clone(), respell(v)))
                .collect(),
        ),
        _ => v.clone(),
    }
}

proptest! {
    #[test]
    fn flat_and_collapsed_agree(domain in proptest::option::of("[a-z]{1,8}\\.org"), a in arb_apps(), b in arb_apps()) {
        let cat = local_catalog();
        let r = renames(&[("/mastodon", "/homepage")]);
        let (d1, i1) = instances(&flat(&domain, &a), &cat).unwrap();
        let (d2, i2) = instances(&collapsed(&domain, &a), &cat).unwrap();
        prop_assert_eq!(d1, d2);
        prop_assert_eq!(i1, i2);
        let s1 = sections(&flat(&domain, &a), Some(&collapsed(&domain, &b)), &r, &cat).unwrap();
        let s2 = sections(&collapsed(&domain, &a), Some(&flat(&domain, &b)), &r, &cat).unwrap();
        let strip = |s: &[Section]| s.iter().map(|s| (s.name.clone(), s.changed, s.deployed_path.is_some())).collect::<Vec<_>>();
        prop_assert_eq!(strip(&s1), strip(&s2));
        let a1 = applications(&flat(&domain, &a), Some(&collapsed(&domain, &b)), &r).unwrap();
        let a2 = applications(&collapsed(&domain, &a), Some(&flat(&domain, &b)), &r).unwrap();
        prop_assert_eq!(a1.changed, a2.changed);
    }

    #[test]
    fn respelling_changes_nothing(a in arb_apps()) {
        let c = flat(&Some("x.org".into()), &a);
        let again = respell(&c);
        prop_assert!(applications(&c, Some(&again), &[]).unwrap().changed.is_empty());
        let s = sections(&c, Some(&again), &[], &local_catalog()).unwrap();
        prop_assert!(s.iter().all(|s| !s.changed));
    }

    #[test]
    fn any_object_never_panics(v in arb_json(4), w in arb_json(3)) {
        let cat = local_catalog();
        let _ = instances(&v, &cat);
        let _ = applications(&v, Some(&w), &renames(&[("/a~1b", "/c"), ("/x~0", "/y/z")]));
        let _ = sections(&v, Some(&w), &[], &cat);
    }
}
