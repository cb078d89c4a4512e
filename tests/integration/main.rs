//! Black-box tests: the real `berth` binary, real HTTP, real deployer
//! processes (the embedded `local` one and small shell scripts).

mod harness;

mod agents;
mod audit;
mod bad_input;
mod cli;
mod cluster;
mod cors;
mod deploy;
mod deployers;
mod disk;
mod events;
mod export;
mod failpoints;
mod faults;
mod hostile;
mod hostile3;
mod layout;
mod lifecycle;
mod nix;
mod nix_ssh;
mod page;
mod power_loss;
mod powerfs;
mod queue;
mod redo;
mod restart;
mod rollouts;
mod routes;
mod safe_deploys;
mod sboms;
mod tenants;
mod tls;
mod torture;
mod webhooks;
mod workers;
