//! An agent and a worker reaching berth over https through a TLS proxy
//! whose certificate a private CA signed: trusted with `--ca-file`,
//! refused without it (agents.md "Running an agent", docs/workers.md).

use std::path::Path;
use std::sync::Arc;

use crate::agents::Agent;
use crate::harness::*;

/// A private CA and a certificate for localhost it signed (openssl).
fn make_certificates(dir: &Path) {
    // `args` split at spaces, then the subject (which has spaces).
    let openssl = |args: &str, subject: Option<&str>| {
        let mut command = std::process::Command::new("openssl");
        command.args(args.split_whitespace()).current_dir(dir);
        if let Some(subject) = subject {
            command.arg("-subj").arg(subject);
        }
        let out = command
            .output()
            .expect("openssl (Debian's openssl) is needed for the TLS tests");
        assert!(
            out.status.success(),
            "openssl {args}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let key = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes";
    openssl(
        &format!("req -x509 {key} -keyout ca.key -out ca.pem -days 2"),
        Some("/CN=berth test CA"),
    );
    openssl(
        &format!("req {key} -keyout leaf.key -out leaf.csr"),
        Some("/CN=localhost"),
    );
    std::fs::write(dir.join("san.ext"), "subjectAltName=DNS:localhost\n").unwrap();
    openssl(
        "x509 -req -in leaf.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out leaf.pem -days 2 -extfile san.ext",
        None,
    );
}

/// A TLS proxy on loopback in front of berth: its address.
async fn tls_proxy(dir: &Path, berth: std::net::SocketAddr) -> std::net::SocketAddr {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("leaf.pem"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(dir.join("leaf.key")).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A handshake the client refuses ends here: that is the test.
                let Ok(mut tls) = acceptor.accept(client).await else {
                    return;
                };
                if let Ok(mut upstream) = tokio::net::TcpStream::connect(berth).await {
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut upstream).await;
                }
            });
        }
    });
    addr
}

/// A TLS proxy in front of `s` with a certificate of a private CA: its
/// `https://localhost:PORT` address, and the dir with `ca.pem`.
async fn behind_tls(s: &Server) -> (String, std::path::PathBuf) {
    let dir = s.dir.join("tls");
    std::fs::create_dir_all(&dir).unwrap();
    make_certificates(&dir);
    let berth: std::net::SocketAddr = s.base.trim_start_matches("http://").parse().unwrap();
    let proxy = tls_proxy(&dir, berth).await;
    (format!("https://localhost:{}", proxy.port()), dir)
}

#[tokio::test]
async fn an_agent_trusts_berths_private_ca_with_ca_file_and_refuses_it_without() {
    let s = Server::start(Options::default()).await;
    let (url, dir) = behind_tls(&s).await;
    let web = crate::agents::agent_token(&s, "web-1", "alice", "web").await;
    let db = crate::agents::agent_token(&s, "db-1", "alice", "db").await;
    let ca = dir.join("ca.pem");
    let trusted = Agent::start_at(
        &url,
        &web,
        "alice/web",
        &dir.join("web"),
        &["--ca-file", ca.to_str().unwrap()],
    );
    let untrusted = Agent::start_at(&url, &db, "alice/db", &dir.join("db"), &[]);
    eventually("the agent with the CA reports over https", || async {
        let (_, e) = s.json("/v1/deployments/alice/nodes/web").await;
        e["agent"]["status"] == "reporting"
    })
    .await;
    eventually("the agent without it refuses the certificate", || async {
        untrusted.log().to_lowercase().contains("certificate")
    })
    .await;
    let (_, e) = s.json("/v1/deployments/alice/nodes/db").await;
    assert_eq!(
        e["agent"]["status"],
        "never_reported",
        "{e}\n{}",
        trusted.log()
    );
    // A file with no certificate in it: exit 1, naming the flag.
    std::fs::write(dir.join("empty.pem"), "not a certificate\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["agent", "--url", &url, "--node", "alice/web"])
        .arg("--token-file")
        .arg(dir.join("web/token"))
        .arg("--state-dir")
        .arg(dir.join("web-2"))
        .arg("--ca-file")
        .arg(dir.join("empty.pem"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--ca-file"), "{stderr}");
}

#[tokio::test]
async fn a_worker_trusts_berths_private_ca_with_ca_file() {
    let dir = temp_dir("worker-tls");
    let deployer = script(
        &dir,
        "ok.sh",
        &format!("{SCRIPT_PRELUDE}\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"\n"),
    );
    let s = crate::workers::server(&dir, &deployer).await;
    let (url, tls) = behind_tls(&s).await;
    let (_, token_file) = crate::workers::worker_token(&s, "w1").await;
    let ca = tls.join("ca.pem");
    let worker = crate::workers::Worker::start_at(
        &url,
        &token_file,
        &dir.join("w1"),
        &deployer,
        &["--ca-file", ca.to_str().unwrap()],
    );
    let build = s
        .submit_ok_without_rollback("alice", serde_json::json!({}))
        .await;
    let done = s.wait_build(&build, "final").await;
    assert_eq!(done["status"], "succeeded", "{done}\n{}", worker.log());
}
