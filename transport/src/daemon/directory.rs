//! The daemon of a job's node: where a node's daemon asks for a split shard, its reader node's
//! daemon, found by the job's heartbeats in the gathered cluster view (each consumer reports
//! its node of the job's deal: `Heartbeat::node`).
//!
//! A node that is not found (its loaders not started yet, or its daemon down) is looked for
//! again for at most [`FIND_WAIT`] (the nodes of a job start at about the same time), then
//! remembered as missing for [`MISSING_FOR`]: its split shards are read from the origin, as
//! without a reader, and nothing is lost but the bytes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Inner;

/// How long a request waits for a reader node that the cluster view does not name yet.
pub const FIND_WAIT: Duration = Duration::from_secs(3);
/// How often the cluster view is gathered again meanwhile (it is at most a second old).
const FIND_EVERY: Duration = Duration::from_millis(250);
/// How long a node not found stays missing before it is looked for again.
pub const MISSING_FOR: Duration = Duration::from_secs(30);
/// Entries held at most (a job's nodes; past it the directory starts afresh).
const ENTRIES_MAX: usize = 16_384;

#[derive(Debug, Clone)]
enum Entry {
    At(String),
    Missing(Instant),
}

/// The daemons found by (job, node).
#[derive(Debug, Default)]
pub(super) struct Directory {
    found: Mutex<HashMap<(String, u32), Entry>>,
}

impl Directory {
    fn get(&self, job: &str, node: u32) -> Option<Entry> {
        let m = self.found.lock().expect("directory lock");
        match m.get(&(job.to_owned(), node)) {
            Some(Entry::Missing(at)) if at.elapsed() >= MISSING_FOR => None,
            e => e.cloned(),
        }
    }

    fn put(&self, job: &str, node: u32, e: Entry) {
        let mut m = self.found.lock().expect("directory lock");
        if m.len() >= ENTRIES_MAX {
            m.clear();
        }
        m.insert((job.to_owned(), node), e);
    }
}

impl Inner {
    /// The daemon (a ring member other than this one) of node `node` of job `job`, or `None`
    /// when the cluster view names none within [`FIND_WAIT`] (then for [`MISSING_FOR`]).
    pub(super) async fn reader_daemon(self: &Arc<Self>, job: &str, node: u32) -> Option<String> {
        match self.directory.get(job, node) {
            Some(Entry::At(d)) => return Some(d),
            Some(Entry::Missing(_)) => return None,
            None => {}
        }
        let until = Instant::now() + FIND_WAIT;
        loop {
            let doc = self.cluster().await;
            let at = doc
                .jobs
                .iter()
                .find(|v| v.beat.job == job && v.beat.node == Some(node) && v.node != self.me)
                .map(|v| v.node.clone());
            if let Some(d) = at {
                self.directory.put(job, node, Entry::At(d.clone()));
                return Some(d);
            }
            if Instant::now() + FIND_EVERY > until {
                tracing::info!(
                    job,
                    node,
                    "no daemon of the split shard's reader node in the cluster view; reading it from the origin"
                );
                self.directory.put(job, node, Entry::Missing(Instant::now()));
                return None;
            }
            tokio::time::sleep(FIND_EVERY).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_node_is_remembered_for_a_while_and_a_found_one_kept() {
        let d = Directory::default();
        assert!(d.get("j", 1).is_none());
        d.put("j", 1, Entry::At("10.0.0.2:7000".into()));
        assert!(matches!(d.get("j", 1), Some(Entry::At(a)) if a == "10.0.0.2:7000"));
        assert!(d.get("k", 1).is_none(), "another job's node");
        d.put("j", 2, Entry::Missing(Instant::now()));
        assert!(matches!(d.get("j", 2), Some(Entry::Missing(_))));
        d.put("j", 3, Entry::Missing(Instant::now() - MISSING_FOR));
        assert!(
            d.get("j", 3).is_none(),
            "a miss older than MISSING_FOR is looked for again"
        );
    }
}
