//! Hedged ranged reads against the real local S3 server, behind a proxy that never answers
//! the first connection. A test binary of its own: it points this process's
//! `AWS_ENDPOINT_URL` at each proxy in turn, which the other tests must not see.

use std::time::{Duration, Instant};

use bytes::Bytes;
use ramjet_engine::store::{RetryPolicy, StoreConfig};
use ramjet_engine::Store;
use ramjet_tests::{block_on, s3, s3_prefix, Fault, FaultProxy};

/// One stalled connection, then every other forwarded: the same ranged read with the hedge
/// on and off. On, it is answered by the second request long before the request timeout;
/// off, it waits the timeout out and succeeds on the retry. Both give the right bytes.
#[test]
fn a_stalled_small_ranged_read_is_hedged_and_not_without_the_hedge() {
    let s3 = s3();
    let url = s3_prefix("hedge");
    let data: Vec<u8> = (0..300_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    block_on(Store::open(&url).unwrap().put("obj", Bytes::from(data.clone()))).unwrap();
    let upstream = s3
        .endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let config = |hedge_max_bytes: u64| StoreConfig {
        request_timeout_ms: 3_000,
        preconnect: 0,
        hedge_max_bytes,
        retry: RetryPolicy {
            backoff_initial_ms: 10,
            ..RetryPolicy::default()
        },
        ..StoreConfig::default()
    };
    let read = |hedge_max_bytes: u64| {
        let proxy = FaultProxy::start(&upstream, Fault::Stall, 1);
        // A new endpoint is a new client (the client cache is keyed by the AWS_* variables):
        // a fresh connection pool and no latency seen yet.
        std::env::set_var("AWS_ENDPOINT_URL", &proxy.url);
        let store = Store::open_with(&url, config(hedge_max_bytes)).unwrap();
        let t0 = Instant::now();
        let got = block_on(store.get_range("obj", 1_000..81_000)).expect("the ranged read");
        let took = t0.elapsed();
        assert_eq!(&got[..], &data[1_000..81_000], "wrong bytes");
        (took, store.hedges(), proxy.connections())
    };

    let (took, hedges, conns) = read(1 << 20);
    // No latency seen yet: the second request starts after 200 ms (a lower bound; that the
    // hedge, not the retry after the 3 s timeout, answered is the counters' to say).
    assert!(took >= Duration::from_millis(200), "hedged read took {took:?}");
    assert_eq!(hedges, (1, 1), "one hedge, won by the second request");
    assert_eq!(conns, 2, "the stalled connection and the hedge's");

    let (took, hedges, _) = read(0);
    assert!(
        took >= Duration::from_millis(3_000),
        "without the hedge the stall is waited out (the request timeout), yet it took {took:?}"
    );
    assert_eq!(hedges, (0, 0));

    // A read larger than the hedge's limit is not hedged either.
    let (took, hedges, _) = read(79_999);
    assert!(took >= Duration::from_millis(3_000), "took {took:?}");
    assert_eq!(hedges, (0, 0));
}
