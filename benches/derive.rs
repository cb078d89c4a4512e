//! Sections of a configuration with 200 applications against a deployed one
//! with renames: time per call. Run: `cargo bench --bench derive`.

use std::time::Instant;

use berth::derive::{self, Rename};
use serde_json::{json, Map, Value};

fn main() {
    let catalog = berth::local_deployer::catalog::catalog();
    let mut draft_apps = Map::new();
    let mut deployed_apps = Map::new();
    let mut renames = Vec::new();
    for i in 0..200 {
        let settings = json!({"enable": i % 3 != 0, "replicas": i % 5, "tags": ["a", "b", i], "nested": {"x": i, "y": format!("v{i}")}});
        draft_apps.insert(format!("app{i:03}"), settings.clone());
        // Half of the deployed ones are stored under their old names.
        if i % 2 == 0 {
            deployed_apps.insert(format!("old{i:03}"), settings);
            renames.push(Rename {
                from: format!("/old{i:03}"),
                to: format!("/app{i:03}"),
            });
        } else {
            let mut changed = settings;
            changed["replicas"] = json!(99);
            deployed_apps.insert(format!("app{i:03}"), changed);
        }
    }
    let draft = json!({"domain": "a.example.org", "applications": Value::Object(draft_apps)});
    let deployed = json!({"deployment": {"local": {"domain": "a.example.org", "applications": Value::Object(deployed_apps)}}});

    let run = || derive::sections(&draft, Some(&deployed), &renames, &catalog).expect("valid");
    let sections = run();
    assert_eq!(sections.iter().filter(|s| s.changed).count(), 100);
    for _ in 0..50 {
        run();
    }
    let mut samples = Vec::new();
    for _ in 0..15 {
        let n = 200;
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(run());
        }
        samples.push(t.elapsed().as_secs_f64() / f64::from(n) * 1e6);
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    // Baseline in the same run: a deep clone of both configurations, the
    // least any derivation that copies before renaming must do.
    let t = Instant::now();
    for _ in 0..200 {
        std::hint::black_box((draft.clone(), deployed.clone()));
    }
    let clone_us = t.elapsed().as_secs_f64() / 200.0 * 1e6;
    println!(
        "derive sections, 200 applications, 100 renames: median {:.1} us/call (min {:.1}, max {:.1}); clone of both configurations {:.1} us; ratio {:.1}x",
        samples[samples.len() / 2],
        samples[0],
        samples[samples.len() - 1],
        clone_us,
        samples[samples.len() / 2] / clone_us
    );
}
