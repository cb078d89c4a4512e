//! The one way every benchmark starts berth: the real binary on a free
//! loopback port, waited for until `/readyz` answers 200.

use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

pub struct Started {
    pub child: Child,
    pub base: String,
    pub token: String,
}

/// `berth serve` on a free port with its data in `<dir>/data`, the given
/// deployer, and `args`; `envs` are added to its environment.
pub async fn start_berth(
    dir: &Path,
    deployer: &Path,
    args: &[&str],
    envs: &[(&str, String)],
) -> Started {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(env!("CARGO_BIN_EXE_berth"))
        .arg("serve")
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--deployer")
        .arg(deployer)
        .args(args)
        .envs(envs.iter().map(|(k, v)| (k.to_string(), v.clone())))
        .env("BERTH_LOG", "warn")
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    while http
        .get(format!("{base}/readyz"))
        .send()
        .await
        .map(|r| r.status() != 200)
        .unwrap_or(true)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let token = std::fs::read_to_string(dir.join("data/service-token")).unwrap();
    Started { child, base, token }
}
