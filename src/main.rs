//! The `berth` command line: parse flags, then run one command.

use clap::Parser;

use berth::settings::{AuditCommand, Cli, Command, DeployerCommand};

fn main() {
    // FAILPOINTS, in a test build only (src/failpoints.rs).
    let _failpoints = berth::failpoints::setup();
    let cli = Cli::parse();
    if cli.command.writes_a_data_dir() {
        berth::durable::create_files_private();
    }
    let code = match cli.command {
        Command::Serve(settings) => berth::serve::run(*settings),
        Command::Audit { audit } => run_audit(audit),
        Command::Export {
            data_dir,
            store,
            to,
            replace,
        } => berth::cluster::run_export(&store, &data_dir, &to, replace),
        Command::Import {
            data_dir,
            store,
            from,
            replace,
        } => berth::cluster::run_import(&store, &data_dir, &from, replace),
        Command::Worker(args) => berth::worker::run(*args),
        Command::Agent(args) => berth::agent::run(*args),
        Command::Deployer {
            deployer: DeployerCommand::Local { verb },
        } => berth::local_deployer::run(&verb),
        Command::Deployer {
            deployer: DeployerCommand::Nix { verb },
        } => berth::nix_deployer::run(&verb),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "berth", &mut std::io::stdout());
            0
        }
        Command::Man => {
            use clap::CommandFactory;
            match clap_mangen::Man::new(Cli::command()).render(&mut std::io::stdout()) {
                Ok(()) => 0,
                // A reader that went away (`berth man | head`) is not an error.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => 0,
                Err(e) => {
                    eprintln!("berth man: {e}");
                    1
                }
            }
        }
        client @ (Command::Deploy { .. }
        | Command::Preview { .. }
        | Command::Status { .. }
        | Command::Builds { .. }
        | Command::Logs { .. }
        | Command::Cancel { .. }
        | Command::Rollback { .. }
        | Command::Suspend { .. }
        | Command::Resume { .. }
        | Command::Delete { .. }
        | Command::Tokens { .. }
        | Command::Rollout { .. }
        | Command::Freeze { .. }
        | Command::Workers { .. }
        | Command::Nodes { .. }) => berth::client::run(client),
    };
    std::process::exit(code);
}

/// `berth audit verify | push-head | public-key`.
fn run_audit(audit: AuditCommand) -> i32 {
    match audit {
        AuditCommand::Verify {
            data_dir,
            store,
            json,
        } => berth::cluster::run_verify(&store, &data_dir, json),
        AuditCommand::PushHead {
            data_dir,
            store,
            sink,
            audit_origin,
        } => berth::cluster::run_push_head(&store, &data_dir, &sink, audit_origin.as_deref()),
        AuditCommand::PublicKey {
            data_dir,
            audit_origin,
        } => berth::audit_cli::run_public_key(&data_dir, audit_origin.as_deref()),
    }
}
