//! berth: a single-binary deployment control plane for self-hosters.
//!
//! See ARCHITECTURE.md for the map; `main.rs` is only the CLI.

pub mod agent;
pub mod api;
pub mod archive;
pub mod audit;
pub mod audit_cli;
pub mod authority;
pub mod client;
pub mod cluster;
pub mod deployer_side;
pub mod derive;
pub mod durable;
pub mod engine;
pub mod events;
pub mod export;
pub mod failpoints;
pub mod hex;
pub mod local_deployer;
pub mod locks;
pub mod model;
pub mod nix_deployer;
pub mod nodes;
pub mod rollout;
pub mod sbom;
pub mod serve;
pub mod settings;
pub mod store;
pub mod window;
pub mod wire;
pub mod worker;
