//! The agent's watch of its node's desired state: an event stream
//! (`sse`), a long poll (`poll`), or the stream falling back to the long
//! poll once it stays silent `SILENT_STREAM` (`auto`, for proxies that
//! buffer streams). Each new document goes to the agent; a refused token
//! ends the watch and tells the agent.

use std::time::Duration;

use serde_json::Value;
use tokio::sync::{mpsc, watch};

use crate::worker::Api;

/// A stream silent this long (keep-alives included) is given up.
const SILENT_STREAM: Duration = Duration::from_secs(45);
/// A long poll's wait (seconds), and its call's limit beyond it.
const POLL_WAIT_S: u64 = 30;
const POLL_SLACK: Duration = Duration::from_secs(15);
/// The most bytes of one event the agent holds.
const MAX_EVENT_BYTES: usize = 1 << 20;

pub struct Watcher {
    pub api: Api,
    /// `/internal/v1/nodes/{deployment}/{node}/desired`.
    pub path: String,
    pub transport: String,
    pub docs: mpsc::Sender<Value>,
    pub refused: watch::Sender<bool>,
    /// Counts the watches that answered again after one failed: the agent
    /// reports after each (agents.md "Actual state"), so a berth that
    /// restarted sees at once what the node runs.
    pub reconnected: watch::Sender<u64>,
    /// A watch failed since the last answer.
    pub lost: std::sync::atomic::AtomicBool,
}

/// How one watch ended.
enum Ended {
    /// The token was refused: the agent stops.
    Refused,
    /// The connection ended or failed: watch again (after a pause).
    Again,
    /// A stream stayed silent: go over to the long poll (`auto`).
    Silent,
    /// The agent is gone.
    Gone,
}

impl Watcher {
    /// Watches until the token is refused or the agent is gone.
    pub async fn run(self, mut generation: u64) {
        let mut poll = self.transport == "poll";
        let mut failures: u32 = 0;
        loop {
            let ended = if poll {
                self.poll(&mut generation).await
            } else {
                self.stream(&mut generation).await
            };
            match ended {
                Ended::Refused => {
                    // The receiver is the agent's loop; if it is gone, so
                    // is the agent.
                    if self.refused.send(true).is_err() {
                        tracing::debug!("the agent ended before its watch");
                    }
                    return;
                }
                Ended::Gone => return,
                Ended::Silent => {
                    tracing::info!("the desired-state stream stayed silent; watching by long poll");
                    poll = true;
                }
                Ended::Again => {
                    self.lost.store(true, std::sync::atomic::Ordering::Relaxed);
                    failures = failures.saturating_add(1);
                    tokio::time::sleep(super::backoff(failures)).await;
                    continue;
                }
            }
            failures = 0;
        }
    }

    /// A watch answered: after a failure, the agent hears of it.
    fn answered(&self) {
        if self.lost.swap(false, std::sync::atomic::Ordering::Relaxed) {
            self.reconnected.send_modify(|n| *n += 1);
        }
    }

    async fn send(&self, doc: Value, generation: &mut u64) -> bool {
        *generation = doc["generation"].as_u64().unwrap_or(*generation);
        self.docs.send(doc).await.is_ok()
    }

    /// Long polls until one fails.
    async fn poll(&self, generation: &mut u64) -> Ended {
        let mut first = true;
        loop {
            let path = if first {
                self.path.clone()
            } else {
                format!("{}?after={generation}&wait={POLL_WAIT_S}", self.path)
            };
            let limit = Duration::from_secs(POLL_WAIT_S) + POLL_SLACK;
            match self
                .api
                .call::<Value>(reqwest::Method::GET, &path, None, limit)
                .await
            {
                Ok((200, doc)) => {
                    first = false;
                    self.answered();
                    if !self.send(doc, generation).await {
                        return Ended::Gone;
                    }
                }
                Ok((204, _)) => self.answered(),
                Ok((401 | 403, _)) => return Ended::Refused,
                Ok((status, answer)) => {
                    tracing::warn!(status, %answer, "berth refused a desired-state poll");
                    return Ended::Again;
                }
                Err(why) => {
                    tracing::warn!(%why, "cannot reach berth for the desired state");
                    return Ended::Again;
                }
            }
        }
    }

    /// One event stream, read to its end.
    async fn stream(&self, generation: &mut u64) -> Ended {
        let request = self
            .api
            .http
            .get(format!("{}{}", self.api.base, self.path))
            .bearer_auth(&self.api.token)
            .header("accept", "text/event-stream")
            .header("last-event-id", generation.to_string());
        let mut resp = match request.send().await {
            Ok(resp) => resp,
            Err(e) => {
                tracing::warn!(error = %e, "cannot reach berth for the desired state");
                return Ended::Again;
            }
        };
        match resp.status().as_u16() {
            200 => self.answered(),
            401 | 403 => return Ended::Refused,
            status => {
                tracing::warn!(status, "berth refused a desired-state stream");
                return Ended::Again;
            }
        }
        let mut pending: Vec<u8> = Vec::new();
        loop {
            let chunk = match tokio::time::timeout(SILENT_STREAM, resp.chunk()).await {
                Err(_) if self.transport == "auto" => return Ended::Silent,
                Err(_) | Ok(Err(_)) | Ok(Ok(None)) => return Ended::Again,
                Ok(Ok(Some(chunk))) => chunk,
            };
            pending.extend_from_slice(&chunk);
            while let Some(end) = find_event_end(&pending) {
                let event: Vec<u8> = pending.drain(..end).collect();
                if let Some(doc) = desired_event(&event) {
                    if !self.send(doc, generation).await {
                        return Ended::Gone;
                    }
                }
            }
            if pending.len() > MAX_EVENT_BYTES {
                tracing::warn!("an event of the desired-state stream is too long; reconnecting");
                return Ended::Again;
            }
        }
    }
}

/// The end (after its blank line) of the first whole event in `bytes`.
fn find_event_end(bytes: &[u8]) -> Option<usize> {
    bytes.windows(2).position(|w| w == b"\n\n").map(|i| i + 2)
}

/// The document of a `desired` event; `None` for keep-alives and others.
fn desired_event(event: &[u8]) -> Option<Value> {
    let text = std::str::from_utf8(event).ok()?;
    let mut name = None;
    let mut data = String::new();
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("event:") {
            name = Some(v.trim());
        } else if let Some(v) = line.strip_prefix("data:") {
            data.push_str(v.trim_start());
        }
    }
    if name != Some("desired") {
        return None;
    }
    serde_json::from_str(&data).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_split_at_blank_lines_and_only_desired_ones_are_read() {
        let bytes =
            b"retry: 3000\n\nid: 3\nevent: desired\ndata: {\"generation\": 3}\n\n: keep-alive\n\n";
        let first = find_event_end(bytes).unwrap();
        assert_eq!(desired_event(&bytes[..first]), None);
        let rest = &bytes[first..];
        let second = find_event_end(rest).unwrap();
        assert_eq!(desired_event(&rest[..second]).unwrap()["generation"], 3);
        assert_eq!(desired_event(&rest[second..]), None);
    }
}
