//! Destroy callbacks: after a destroy succeeds, berth POSTs
//! `{"deployment", "build_id", "status": "destroyed"}` to the URL given with
//! the delete, signed with `Berth-Signature: sha256=<hex HMAC>`. Pending
//! callbacks live in the store, so retries (exponential backoff, up to 24 h)
//! survive restarts. Redirects are not followed. The URL is checked
//! against `--callback-origin` again before every attempt.

use std::sync::Arc;
use std::time::Duration;

use hmac::{KeyInit, Mac};
use sha2::Sha256;

use super::Engine;
use crate::model::*;

/// A callback is given up this long after its destroy succeeded.
const CALLBACK_GIVE_UP: Millis = 24 * 3600 * 1000;
/// Backoff between attempts: 1 s doubling, at most this.
const MAX_BACKOFF: Millis = 3600 * 1000;
/// One attempt's time limit.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the sender looks for due callbacks without a wake-up.
const CALLBACK_POLL: Duration = Duration::from_secs(1);

pub fn signature(secret: &[u8], body: &[u8]) -> String {
    let mut mac = hmac::Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(body);
    format!(
        "sha256={}",
        crate::hex::encode(&mac.finalize().into_bytes())
    )
}

pub fn backoff(attempts: u32) -> Millis {
    (1000i64 << attempts.min(30)).min(MAX_BACKOFF)
}

impl Engine {
    pub async fn run_callbacks(self: Arc<Self>) {
        let client = match reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(ATTEMPT_TIMEOUT)
            .build()
        {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "cannot build the HTTP client; destroy callbacks are disabled");
                return;
            }
        };
        loop {
            if let Err(e) = self.send_due_callbacks(&client).await {
                tracing::error!(error = %e, "callback sender");
            }
            let _ = tokio::time::timeout(CALLBACK_POLL, self.callbacks_wake.notified()).await;
        }
    }

    async fn send_due_callbacks(
        &self,
        client: &reqwest::Client,
    ) -> Result<(), crate::store::StoreError> {
        let now = now_millis();
        let due: Vec<_> = self
            .store
            .read()?
            .callbacks()?
            .into_iter()
            .filter(|(_, c)| c.armed && c.next_at <= now)
            .collect();
        for (build_id, callback) in due {
            // Checked against the origins berth runs with now: a list
            // narrowed since the delete sends the old callback nothing.
            if !self.callback_rule.takes(&callback.url) {
                tracing::error!(build = %format_build_id(build_id), "destroy callback dropped unsent: its origin is not in --callback-origin now");
                self.store
                    .write(move |tx| tx.remove_callback(build_id))
                    .await?;
                continue;
            }
            let body = serde_json::json!({
                "deployment": callback.deployment,
                "build_id": format_build_id(build_id),
                "status": "destroyed",
            })
            .to_string();
            let sent = client
                .post(&callback.url)
                .header("content-type", "application/json")
                .header(
                    "Berth-Signature",
                    signature(&self.callback_secret, body.as_bytes()),
                )
                .body(body)
                .send()
                .await;
            let ok = matches!(&sent, Ok(r) if r.status().is_success());
            if !ok {
                let status = sent.as_ref().map(|r| r.status().as_u16()).ok();
                tracing::warn!(build = %format_build_id(build_id), ?status, attempts = callback.attempts + 1, "destroy callback failed; will retry");
            }
            self.store
                .write(move |tx| {
                    let Some(mut c) = tx.callback(build_id)? else { return Ok(()) };
                    let now = now_millis();
                    if ok || now - c.first_at > CALLBACK_GIVE_UP {
                        if !ok {
                            tracing::error!(build = %format_build_id(build_id), "destroy callback given up after 24 h");
                        }
                        return tx.remove_callback(build_id);
                    }
                    c.attempts += 1;
                    c.next_at = now + backoff(c.attempts);
                    tx.put_callback(build_id, &c)
                })
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(backoff(0), 1000);
        assert_eq!(backoff(3), 8000);
        assert_eq!(backoff(40), MAX_BACKOFF);
    }

    #[test]
    fn signature_is_hmac_sha256() {
        // RFC 4231 test case 2.
        let sig = signature(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(
            sig,
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
