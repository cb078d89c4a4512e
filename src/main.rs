//! The `berth` command line: parse flags, then run one command.

use clap::Parser;

use berth::settings::{Cli, Command, DeployerCommand};

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Serve(settings) => berth::serve::run(*settings),
        Command::Deployer {
            deployer: DeployerCommand::Local { verb },
        } => berth::local_deployer::run(&verb),
    };
    std::process::exit(code);
}
