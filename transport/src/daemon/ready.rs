//! `/ready` from state the daemon already has. A background task probes the other members (one
//! authenticated handshake each, all at once: [`Inner::ready_doc`]) at most once every
//! [`READY_PROBE_EVERY`], and only while `/ready` was asked within [`READY_WANTED_FOR`]; a
//! request reads the last result. Any number of requests, from any number of addresses, cost the
//! members at most one handshake each per period: unauthenticated requests can no longer
//! amplify into handshakes (100 concurrent requests made a peer refuse 42,419 of them, and the
//! daemon's real fetches then failed). Before the first probe completes, a request waits for it,
//! at most the peer timeout and a second, so the first `/ready` still says what holds now.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Inner;
use crate::stats::ReadyDoc;

/// The most often the members are probed for `/ready`.
pub(super) const READY_PROBE_EVERY: Duration = Duration::from_secs(2);

/// Probing stops when `/ready` has not been asked for this long.
pub(super) const READY_WANTED_FOR: Duration = Duration::from_secs(60);

/// The last probe's result and when `/ready` was last asked.
pub(super) struct Readiness {
    last: tokio::sync::watch::Sender<Option<(Instant, ReadyDoc)>>,
    asked: Mutex<Option<Instant>>,
    wake: tokio::sync::Notify,
}

impl Default for Readiness {
    fn default() -> Self {
        Readiness {
            last: tokio::sync::watch::channel(None).0,
            asked: Mutex::new(None),
            wake: tokio::sync::Notify::new(),
        }
    }
}

impl Readiness {
    /// The answer to one `/ready` request: the last probe's document (waiting for the first
    /// one, at most `wait`). It starts no handshake itself.
    pub(super) async fn answer(&self, node: &str, wait: Duration) -> ReadyDoc {
        *self.asked.lock().expect("asked lock") = Some(Instant::now());
        self.wake.notify_one();
        let mut rx = self.last.subscribe();
        let got = tokio::time::timeout(wait, rx.wait_for(|d| d.is_some())).await;
        match got {
            Ok(Ok(d)) => d.as_ref().map(|(_, doc)| doc.clone()).expect("waited for a document"),
            _ => ReadyDoc {
                node: node.to_owned(),
                ready: false,
                problems: vec![format!(
                    "the first readiness probe of the members has not completed within {:.1} s",
                    wait.as_secs_f64()
                )],
                ..Default::default()
            },
        }
    }

    fn wanted(&self) -> bool {
        self.asked
            .lock()
            .expect("asked lock")
            .is_some_and(|t| t.elapsed() < READY_WANTED_FOR)
    }

    fn fresh(&self) -> bool {
        self.last
            .borrow()
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < READY_PROBE_EVERY)
    }
}

/// The background probe (see the module docs): runs for the daemon's life.
pub(super) async fn probe_members(inner: Arc<Inner>) {
    loop {
        let r = &inner.readiness;
        if r.wanted() && !r.fresh() {
            let doc = inner.ready_doc().await;
            r.last.send_replace(Some((Instant::now(), doc)));
            tokio::time::sleep(READY_PROBE_EVERY).await;
            continue;
        }
        // Asked (or the period passed): look again.
        let _ = tokio::time::timeout(READY_PROBE_EVERY, r.wake.notified()).await;
    }
}
