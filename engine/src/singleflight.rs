//! One fetch per shard at a time: the one singleflight of ramjet, used by the stream (a whole
//! shard wanted by two datasets, or by a loader and random access, in one process, through the
//! same host-daemon client and cache directory) and by the
//! host daemon (every loader and peer of a host asking for the same shard).
//!
//! Two layers:
//! - in a process, [`Flights`]: the first caller starts the flight as a task of its own (it
//!   completes, and fills the cache, even if every waiter goes away); later callers join it
//!   and get a clone of its result;
//! - across the processes of a host, the cache's download lock
//!   ([`crate::cache::Cache::fetch_lock`]): one process fetches while the others wait, then
//!   read the shard from the cache. A flight of the stream takes it inside the flight.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use futures::future::{BoxFuture, FutureExt, Shared};

/// A flight in progress: await it for the result (every waiter gets a clone).
pub type Flight<V> = Shared<BoxFuture<'static, V>>;

/// Flights in progress, by key.
pub struct Flights<K, V: Clone> {
    map: Mutex<HashMap<K, Flight<V>>>,
}

impl<K, V: Clone> Default for Flights<K, V> {
    fn default() -> Self {
        Flights {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl<K, V> Flights<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// The flight of the first key of `join` that has one; else a new flight under `key` that
    /// runs `work` on the current runtime as a task of its own and leaves the map when done.
    /// `lost` makes the result of a flight whose task died (it panicked, or the runtime
    /// stopped). Also whether the caller joined a flight (true) or started one.
    pub fn join_or_start<F>(
        self: &Arc<Self>,
        join: &[K],
        key: K,
        work: impl FnOnce() -> F,
        lost: impl FnOnce(String) -> V + Send + 'static,
    ) -> (Flight<V>, bool)
    where
        F: Future<Output = V> + Send + 'static,
    {
        let mut map = self.map.lock().expect("flights lock");
        if let Some(f) = join.iter().find_map(|k| map.get(k)) {
            return (f.clone(), true);
        }
        let fut = work();
        let (me, k) = (self.clone(), key.clone());
        let task = tokio::spawn(async move {
            // Leaves the map when the work ends, or unwinds, or is cancelled: a dead flight
            // is never joined.
            let _leave = Leave { flights: me, key: k };
            fut.await
        });
        let flight = async move {
            match task.await {
                Ok(v) => v,
                Err(e) => lost(e.to_string()),
            }
        }
        .boxed()
        .shared();
        map.insert(key, flight.clone());
        (flight, false)
    }

    /// Flights in progress.
    pub fn len(&self) -> usize {
        self.map.lock().expect("flights lock").len()
    }

    /// Whether no flight is in progress.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

struct Leave<K: Hash + Eq, V: Clone> {
    flights: Arc<Flights<K, V>>,
    key: K,
}

impl<K: Hash + Eq, V: Clone> Drop for Leave<K, V> {
    fn drop(&mut self) {
        // A poisoned map (a panic while it was held) still lets the entry go.
        let mut map = self.flights.map.lock().unwrap_or_else(|p| p.into_inner());
        map.remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn concurrent_callers_share_one_flight_and_a_dead_task_is_an_error() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let flights: Arc<Flights<u32, Result<u64, String>>> = Arc::default();
            let runs = Arc::new(AtomicUsize::new(0));
            let mut waiters = Vec::new();
            let mut joined = 0;
            for _ in 0..8 {
                let r = runs.clone();
                let (f, j) = flights.join_or_start(
                    &[1],
                    1,
                    move || async move {
                        r.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        Ok(42)
                    },
                    Err,
                );
                joined += j as usize;
                waiters.push(f);
            }
            for w in waiters {
                assert_eq!(w.await, Ok(42));
            }
            assert_eq!((runs.load(Ordering::SeqCst), joined), (1, 7));
            assert!(flights.is_empty(), "a finished flight leaves the map");
            let (f, _) = flights.join_or_start(&[2], 2, || async { panic!("boom") }, Err);
            assert!(f.await.unwrap_err().contains("panic"));
            assert!(flights.is_empty(), "a dead flight leaves the map");
            let (f, j) = flights.join_or_start(&[2], 2, || async { Ok(7) }, Err);
            assert_eq!((f.await, j), (Ok(7), false));
        });
    }
}
