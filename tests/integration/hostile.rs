//! Hostile callers without a token (issue "Hostile input"): an upload is
//! refused before its body is read, a body that trickles in is cut off, and
//! open connections are bounded.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::*;

fn addr(s: &Server) -> String {
    s.base.trim_start_matches("http://").to_string()
}

/// Reads what the server sends until it closes (or `limit` passes).
async fn read_until_close(stream: &mut TcpStream, limit: Duration) -> (String, bool) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&got).into_owned(), true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&got).into_owned(), false),
        }
    }
}

#[tokio::test]
async fn an_upload_without_a_token_is_refused_before_its_body() {
    let s = Server::start(Options::default()).await;
    let mut stream = TcpStream::connect(addr(&s)).await.unwrap();
    // A 1 MiB - 1 byte submit announced, not one byte of it sent.
    stream
        .write_all(
            b"POST /v1/deployments/x/submit HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1048575\r\n\r\n",
        )
        .await
        .unwrap();
    let (answer, closed) = read_until_close(&mut stream, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    assert!(closed, "the connection stayed open for the body");
}

#[tokio::test]
async fn a_body_that_trickles_in_is_cut_off() {
    let s = Server::start(Options::default().arg("--body-timeout").arg("1s")).await;
    let mut stream = TcpStream::connect(addr(&s)).await.unwrap();
    let head = format!(
        "POST /v1/deployments/x/preview HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"configuration\"",
        s.token
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let (answer, _) = read_until_close(&mut stream, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn connections_past_the_limit_are_closed_at_accept() {
    let s = Server::start(Options::default().arg("--max-connections").arg("2")).await;
    // The harness's own client may hold an idle keep-alive connection of
    // its own: serve connections until one is refused.
    let mut held = Vec::new();
    let mut refused = false;
    for _ in 0..3 {
        let mut c = TcpStream::connect(addr(&s)).await.unwrap();
        let _ = c
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await;
        let mut buf = [0u8; 256];
        match tokio::time::timeout(Duration::from_secs(2), c.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {
                assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
                held.push(c);
            }
            // Closed (or reset) without an answer: refused at accept.
            Ok(_) => {
                refused = true;
                break;
            }
            Err(_) => panic!("a connection past the limit hangs instead of closing"),
        }
    }
    assert!(
        refused,
        "{} connections served with --max-connections 2",
        held.len()
    );
    assert!(held.len() <= 2);
    drop(held);
    // Once they are gone, a new one is served.
    eventually("a connection is served again", || async {
        let Ok(mut c) = TcpStream::connect(addr(&s)).await else {
            return false;
        };
        if c.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .is_err()
        {
            return false;
        }
        let (answer, _) = read_until_close(&mut c, Duration::from_secs(2)).await;
        answer.starts_with("HTTP/1.1 200")
    })
    .await;
}

/// Bodies in memory are bounded across requests: past the budget a request
/// gets 503, within it the same route answers.
#[tokio::test]
async fn bodies_in_flight_are_bounded() {
    let s = Server::start(
        Options::default()
            .arg("--max-body-bytes-in-flight")
            .arg("1000"),
    )
    .await;
    let padded = serde_json::json!({"draft": {"applications": {"a": {"pad": "x".repeat(1500)}}}});
    let r = s
        .http
        .post(s.url("/v1/derive/applications"))
        .json(&padded)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let small = serde_json::json!({"draft": {"applications": {"a": {}}}});
    let r = s
        .http
        .post(s.url("/v1/derive/applications"))
        .json(&small)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        200,
        "the budget is given back after each request"
    );
    // A declared length takes its share before the first byte: a body
    // that cannot fit is refused at once, not after it trickled in.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(s.base.trim_start_matches("http://"))
        .await
        .unwrap();
    sock.write_all(b"POST /v1/derive/applications HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{")
        .await
        .unwrap();
    let mut answer = vec![0u8; 512];
    let n = tokio::time::timeout(std::time::Duration::from_secs(5), sock.read(&mut answer))
        .await
        .expect("refused without waiting for the body")
        .unwrap();
    let head = String::from_utf8_lossy(&answer[..n]).to_string();
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
}
