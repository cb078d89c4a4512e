//! Event channels over real HTTP/SSE (spec events.md).

use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::*;

fn stream(s: &Server, path: &str) -> reqwest::RequestBuilder {
    s.http.get(s.url(path)).bearer_auth(&s.token)
}

/// Checks ids go up by one from `first`, and the log lines equal `log`.
fn assert_gap_free(events: &[SseEvent], first: u64) {
    let ids: Vec<u64> = events.iter().filter_map(|e| e.id).collect();
    let expected: Vec<u64> = (first..first + ids.len() as u64).collect();
    assert_eq!(ids, expected, "ids are not gap-free");
}

/// The `key` member of the JSON data of every `event` event, in order.
fn fields(events: &[SseEvent], event: &str, key: &str) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.event == event)
        .map(|e| {
            serde_json::from_str::<Value>(&e.data).unwrap()[key]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

fn log_of(events: &[SseEvent]) -> String {
    events
        .iter()
        .filter(|e| e.event == "log")
        .map(|e| format!("{}\n", e.data))
        .collect()
}

#[tokio::test]
async fn replay_from_every_position_equals_the_stored_log() {
    let body = "echo first\nhead -c 70000 /dev/zero | tr '\\0' 'y'; echo\nprintf 'bin \\377 ary\\n'\nprintf 'cr\\rlf\\r\\n'\nfor i in 1 2 3 4 5; do echo \"line $i\"; done\nprintf 'no newline'\nprintf '%s' '{\"nodes\":[]}' > \"$BERTH_RESULT\"";
    let dir = temp_dir("replay");
    let deployer = script(&dir, "d.sh", &format!("{SCRIPT_PRELUDE}\n{body}"));
    let s = Server::start_in(dir, Options::default().deployer(&deployer)).await;
    let id = s.submit_ok("alice", json!({})).await;
    s.wait_build(&id, "succeeded").await;
    let stored = s.log_text(&id).await;
    let mut sse = Sse::open(stream(&s, &format!("/v1/builds/{id}/events"))).await;
    let all = sse.until_end().await;
    assert_gap_free(&all[..all.len() - 1], 1);
    let statuses = fields(&all, "status", "status");
    assert_eq!(statuses, ["queued", "running", "succeeded"]);
    let end = all.last().unwrap();
    assert_eq!(end.event, "end");
    assert_eq!(
        serde_json::from_str::<Value>(&end.data).unwrap()["status"],
        "succeeded"
    );
    assert_eq!(log_of(&all), stored);
    assert!(stored.contains("bin \u{fffd} ary\ncr\nlf\n"), "{stored}");
    assert!(stored.ends_with("no newline\n"));
    // From every position: exactly the rest.
    let last_id = all[all.len() - 2].id.unwrap();
    for cursor in 0..=last_id {
        let mut sse = Sse::open(
            stream(&s, &format!("/v1/builds/{id}/events"))
                .header("Last-Event-ID", cursor.to_string()),
        )
        .await;
        let rest = sse.until_end().await;
        let expected: Vec<&SseEvent> = all
            .iter()
            .filter(|e| e.id.is_none_or(|i| i > cursor))
            .collect();
        assert_eq!(rest.iter().collect::<Vec<_>>(), expected, "cursor {cursor}");
    }
    // ?cursor= works the same way.
    let mut sse = Sse::open(stream(
        &s,
        &format!("/v1/builds/{id}/events?cursor={}", last_id - 1),
    ))
    .await;
    assert_eq!(sse.until_end().await.len(), 2);
}

#[tokio::test]
async fn bad_or_foreign_cursors_resync_then_start_from_the_first_event() {
    let s = Server::start(Options::default()).await;
    let id = s
        .submit_ok(
            "alice",
            json!({"domain": "a.org", "applications": {"mastodon": {"enable": true}}}),
        )
        .await;
    s.wait_build(&id, "succeeded").await;
    for cursor in ["not-a-number", "999999"] {
        let mut sse = Sse::open(
            stream(&s, &format!("/v1/builds/{id}/events")).header("Last-Event-ID", cursor),
        )
        .await;
        let first = sse.next().await.unwrap();
        assert_eq!(first.event, "resync_required");
        assert_eq!(
            serde_json::from_str::<Value>(&first.data).unwrap()["reason"],
            "cursor_invalid"
        );
        let rest = sse.until_end().await;
        assert_eq!(
            rest[0].id,
            Some(1),
            "after a resync the stream starts at the first event"
        );
    }
}

#[tokio::test]
async fn reconnect_mid_build_sees_every_line_exactly_once() {
    let dir = temp_dir("reconnect");
    let (deployer, gates) = gated_deployer(&dir);
    // A deployer that talks for a while before waiting at its gate.
    let talky = script(
        &dir,
        "talky.sh",
        &format!("{SCRIPT_PRELUDE}\ni=0; while [ $i -lt 300 ]; do echo \"line $i\"; i=$((i+1)); [ $((i % 50)) -eq 0 ] && sleep 0.05; done\nexec {} \"$verb\" < /dev/null", deployer.display()),
    );
    let s = Server::start_in(dir, Options::default().deployer(&talky)).await;
    let id = s.submit_ok("alice", json!({})).await;
    let mut sse = Sse::open(stream(&s, &format!("/v1/builds/{id}/events"))).await;
    let mut seen = vec![];
    while seen.len() < 120 {
        seen.push(sse.next().await.unwrap());
    }
    drop(sse); // a network blip
    let last = seen.last().unwrap().id.unwrap();
    let mut sse = Sse::open(
        stream(&s, &format!("/v1/builds/{id}/events")).header("Last-Event-ID", last.to_string()),
    )
    .await;
    let mut more = vec![sse.next().await.unwrap()];
    open_gate(&gates, "alice");
    more.extend(sse.until_end().await);
    seen.extend(more);
    assert_gap_free(&seen[..seen.len() - 1], 1);
    assert_eq!(log_of(&seen), s.log_text(&id).await);
}

#[tokio::test]
async fn two_hundred_subscribers_see_identical_gap_free_sequences() {
    let dir = temp_dir("fanout");
    let (gated, gates) = gated_deployer(&dir);
    let burst = script(
        &dir,
        "burst.sh",
        &format!(
            "{SCRIPT_PRELUDE}\nseq 1 2000 | sed 's/^/burst line /'\nexec {} \"$verb\" < /dev/null",
            gated.display()
        ),
    );
    let s = Server::start_in(
        dir,
        Options::default()
            .deployer(&burst)
            .arg("--max-sse-clients")
            .arg("500")
            // One principal (the service token) holds every subscriber here.
            .arg("--max-streams-per-caller")
            .arg("300"),
    )
    .await;
    let id = s.submit_ok("alice", json!({})).await;
    let mut tasks = vec![];
    for _ in 0..200 {
        let req = stream(&s, &format!("/v1/builds/{id}/events"));
        tasks.push(tokio::spawn(async move {
            Sse::open(req).await.until_end().await
        }));
    }
    // Every stream is open before the burst.
    eventually("200 streams open", || async {
        let metrics = s.metrics().await;
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("berth_sse_clients "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n >= 200)
    })
    .await;
    open_gate(&gates, "alice");
    let mut results = vec![];
    for t in tasks {
        results.push(t.await.unwrap());
    }
    let first = &results[0];
    assert_gap_free(&first[..first.len() - 1], 1);
    assert!(log_of(first).contains("burst line 2000\n"));
    for r in &results[1..] {
        assert_eq!(r, first);
    }
}

#[tokio::test]
async fn a_subscriber_that_reads_nothing_does_not_hold_the_build() {
    let dir = temp_dir("slow");
    let deployer = script(&dir, "d.sh", &format!("{SCRIPT_PRELUDE}\nseq 1 300000 | sed 's/^/a fairly long log line to fill buffers quickly: /'\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\""));
    let opts = Options::default().deployer(&deployer);
    let s = Server::start_in(dir, opts).await;
    // Subscribe to the channel before the build exists... via a build queued
    // behind nothing: open the stream right after the submit, read nothing.
    let id = s.submit_ok("alice", json!({})).await;
    let mut stalled = Sse::open(stream(&s, &format!("/v1/builds/{id}/events"))).await;
    let b = s.wait_build(&id, "final").await;
    assert_eq!(
        b["status"], "succeeded",
        "the build was held up by a subscriber that reads nothing"
    );
    // It then reads everything, in order and without a gap (catch-up).
    let all = stalled.until_end().await;
    assert_gap_free(&all[..all.len() - 1], 1);
    assert_eq!(log_of(&all), s.log_text(&id).await);
    assert!(
        metric(&s, "berth_sse_catch_ups_total").await > 0,
        "the subscriber never fell behind: this test did not exercise catch-up"
    );
}

#[tokio::test]
async fn tickets_are_bound_to_a_channel_and_expire() {
    let s = Server::start(Options::default().arg("--ticket-ttl").arg("1s")).await;
    let id = s.submit_ok("alice", json!({})).await;
    s.wait_build(&id, "final").await;
    let channel = format!("/v1/builds/{id}/events");
    let (status, t) = read(
        s.post("/v1/stream-tickets", &json!({"channel": channel}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{t}");
    let ticket = t["ticket"].as_str().unwrap();
    let mut sse = Sse::open(s.http.get(s.url(&format!("{channel}?ticket={ticket}")))).await;
    assert_eq!(sse.until_end().await.last().unwrap().event, "end");
    // Another channel with this ticket, no credential at all: plain 401.
    let other = s
        .http
        .get(s.url(&format!("/v1/deployments/alice/events?ticket={ticket}")))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 401);
    assert_eq!(
        s.http.get(s.url(&channel)).send().await.unwrap().status(),
        401
    );
    // Past --ticket-ttl the same ticket is refused (a plain 401).
    eventually("the ticket to expire", || {
        let answer = s
            .http
            .get(s.url(&format!("{channel}?ticket={ticket}")))
            .send();
        async move { answer.await.unwrap().status() == 401 }
    })
    .await;
    let (status, _) = read(
        s.post("/v1/stream-tickets", &json!({"channel": "/v1/elsewhere"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn deployment_channel_across_a_deploy_and_a_destroy() {
    let s = Server::start(Options::default().arg("--max-sse-clients").arg("2")).await;
    // Subscribing before the deployment exists is allowed: it sees the first submit.
    let mut sse = Sse::open(stream(&s, "/v1/deployments/alice/events")).await;
    let id = s
        .submit_ok(
            "alice",
            json!({"domain": "a.org", "applications": {"mastodon": {"enable": true}}}),
        )
        .await;
    s.wait_build(&id, "succeeded").await;
    let r = s.delete("/v1/deployments/alice").send().await.unwrap();
    let destroy = read(r).await.1["build_id"].as_str().unwrap().to_string();
    s.wait_build(&destroy, "succeeded").await;
    let mut events = vec![];
    loop {
        let e = sse.next().await.unwrap();
        let done = e.event == "deployment"
            && serde_json::from_str::<Value>(&e.data).unwrap()["state"] == "idle";
        events.push(e);
        if done {
            break;
        }
    }
    assert_gap_free(&events, 1);
    let states = fields(&events, "deployment", "state");
    assert_eq!(
        states,
        [
            "building",
            "building",
            "active",
            "destroying",
            "destroying",
            "idle"
        ]
    );
    let builds: Vec<(String, String)> = events
        .iter()
        .filter(|e| e.event == "build")
        .map(|e| {
            let v: Value = serde_json::from_str(&e.data).unwrap();
            (
                v["kind"].as_str().unwrap().to_string(),
                v["status"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        builds
            .iter()
            .map(|(k, s)| format!("{k}:{s}"))
            .collect::<Vec<_>>(),
        [
            "deploy:queued",
            "deploy:running",
            "deploy:succeeded",
            "destroy:queued",
            "destroy:running",
            "destroy:succeeded"
        ]
    );
    // The read's event_cursor is the position of that snapshot.
    let (_, d) = s.json("/v1/deployments/alice").await;
    assert_eq!(
        d["event_cursor"],
        events.last().unwrap().id.unwrap().to_string()
    );
    // Too many streams: 503 (two are allowed, one is open).
    let mut second = Sse::open(stream(&s, "/v1/deployments/alice/events?cursor=2")).await;
    let replayed = second.next().await.unwrap();
    assert_eq!(replayed.id, Some(3));
    let third = stream(&s, "/v1/deployments/alice/events")
        .send()
        .await
        .unwrap();
    assert_eq!(third.status(), 503);
    // Without a cursor the stream starts with the current summary.
    drop(second);
    drop(sse);
    // The closed streams' places come free as the server sees them go:
    // the first stream taken again is the one read on.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut fresh = loop {
        match Sse::try_open(stream(&s, "/v1/deployments/alice/events")).await {
            Ok(fresh) => break fresh,
            Err((status, body)) => {
                assert_eq!(status, 503, "{body}");
                assert!(
                    std::time::Instant::now() < deadline,
                    "no stream's place came free: {body}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let first = fresh.next().await.unwrap();
    assert_eq!(first.event, "deployment");
    assert_eq!(first.id, events.last().unwrap().id);
    let mut bad = Sse::open(stream(&s, "/v1/deployments/alice/events?cursor=abc")).await;
    assert_eq!(bad.next().await.unwrap().event, "resync_required");
}

#[tokio::test]
async fn an_idle_stream_gets_keep_alive_comments() {
    let s = Server::start(Options::default().arg("--sse-keep-alive").arg("200ms")).await;
    let mut sse = Sse::open(stream(&s, "/v1/deployments/quiet/events")).await;
    // Two comments, each within a few intervals of silence.
    for _ in 0..2 {
        assert!(
            sse.wait_comment(Duration::from_secs(2)).await,
            "no `: keep-alive` after 2 s of silence with --sse-keep-alive 200ms"
        );
    }
}

/// One unlabelled metric from /metrics.
async fn metric(s: &Server, name: &str) -> u64 {
    s.metrics()
        .await
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} in /metrics"))
}

#[tokio::test]
async fn an_http_1_0_client_tails_a_build_and_a_client_that_leaves_frees_its_stream() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = temp_dir("http10");
    let (deployer, gates) = gated_deployer(&dir);
    let s = Server::start_in(dir, Options::default().deployer(&deployer)).await;
    let id = s.submit_ok("alice", json!({})).await;
    // HTTP/1.0 has no chunked encoding: berth cannot hand this connection
    // to the fan-out and serves the live tail from the connection's task.
    let mut conn = tokio::net::TcpStream::connect(s.base.trim_start_matches("http://"))
        .await
        .unwrap();
    let request = format!(
        "GET /v1/builds/{id}/events HTTP/1.0\r\nAuthorization: Bearer {}\r\n\r\n",
        s.token.trim()
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut text = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    // Live: the deployer's first line arrives while the build waits.
    while !String::from_utf8_lossy(&text).contains("start deploy alice") {
        let n = tokio::time::timeout(Duration::from_secs(30), conn.read(&mut buf))
            .await
            .expect("no live line over HTTP/1.0")
            .unwrap();
        assert!(n > 0, "closed before the first line");
        text.extend_from_slice(&buf[..n]);
    }
    open_gate(&gates, "alice");
    tokio::time::timeout(Duration::from_secs(30), conn.read_to_end(&mut text))
        .await
        .expect("the stream did not end")
        .unwrap();
    let text = String::from_utf8(text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.0 200"), "{head}");
    assert!(!head.to_ascii_lowercase().contains("chunked"), "{head}");
    let events: Vec<SseEvent> = body.split("\n\n").filter_map(parse_event).collect();
    assert_eq!(events.last().unwrap().event, "end");
    assert_gap_free(&events[..events.len() - 1], 1);
    assert_eq!(log_of(&events), s.log_text(&id).await);

    // An HTTP/1.1 stream, live (its socket is the fan-out's), then gone.
    let mut sse = Sse::open(stream(&s, "/v1/deployments/alice/events")).await;
    assert_eq!(sse.next().await.unwrap().event, "deployment");
    assert_eq!(metric(&s, "berth_sse_clients").await, 1);
    eventually("the fan-out writes the live stream", || async {
        metric(&s, "berth_sse_live_streams").await == 1
    })
    .await;
    drop(sse);
    eventually("the stream is freed when its client leaves", || async {
        metric(&s, "berth_sse_clients").await == 0
            && metric(&s, "berth_sse_live_streams").await == 0
    })
    .await;
}

/// api.md `Berth-Event-Cursor`: a log read while the build writes says
/// which event its body covers, and the channel followed from there gives
/// exactly the rest: body and stream together are the log, every line once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_read_and_the_channel_from_its_cursor_give_every_line_once() {
    let dir = temp_dir("event-cursor");
    let body = format!(
        "{SCRIPT_PRELUDE}\ni=0\nwhile [ $i -lt 400 ]; do i=$((i+1)); echo \"line $i\"; [ $((i % 40)) -eq 0 ] && sleep 0.2; done\nprintf '%s' '{{\"nodes\":[]}}' > \"$BERTH_RESULT\"\n"
    );
    let deployer = script(&dir, "slow-lines.sh", &body);
    let s = Server::start(Options::default().deployer(&deployer)).await;
    let id = s.submit_ok("alice", json!({})).await;
    // Some lines are committed, not all.
    eventually("the first lines are committed", || async {
        s.build(&id).await["log_lines"].as_u64().unwrap_or(0) >= 80
    })
    .await;
    let r = stream(&s, &format!("/v1/builds/{id}/log"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let cursor: u64 = r
        .headers()
        .get("berth-event-cursor")
        .expect("the log read says which event it covers")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let so_far = r.text().await.unwrap();
    assert!(so_far.lines().count() >= 80, "{so_far}");
    let mut sse = Sse::open(stream(
        &s,
        &format!("/v1/builds/{id}/events?cursor={cursor}"),
    ))
    .await;
    let rest = sse.until_end().await;
    let stored = s.log_text(&id).await;
    let together = format!("{so_far}{}", log_of(&rest));
    assert_eq!(
        together, stored,
        "the body and the stream after its cursor are the log"
    );
    assert_eq!(stored.lines().count(), 400);
    // A finished build's log covers its last event: the channel from there
    // has nothing left but its end.
    let r = stream(&s, &format!("/v1/builds/{id}/log"))
        .send()
        .await
        .unwrap();
    let last: u64 = r.headers()["berth-event-cursor"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let mut after = Sse::open(stream(&s, &format!("/v1/builds/{id}/events?cursor={last}"))).await;
    let tail = after.until_end().await;
    assert!(
        tail.iter().all(|e| e.event == "end"),
        "only the end after a finished log's cursor: {tail:?}"
    );
}
