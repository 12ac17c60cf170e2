//! The host daemon and its peer ring, as separate `ramjet serve` processes on distinct
//! loopback addresses in front of the real local S3 server (behind a proxy that counts every
//! request): one origin GET per shard for the whole cluster, ring shares, SIGKILL of a daemon
//! mid-epoch, wrong API keys, lying, stalling and vanishing peers, request validation, and
//! the embedded daemon.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ramjet_engine::cache::{CacheConfig, ShardId};
use ramjet_engine::{Dataset, FetchedFrom, Opened, ShardProvider, ShardRequest, Stream, StreamConfig};
use ramjet_tests::{
    block_on, free_port, once_per_run, ramjet_bin, ramjet_ok, s3, s3_prefix, synth_dataset, test_index_dir, text,
    CountingProxy,
};
use ramjet_transport::{wire, DaemonClient, Ring};

const N: usize = 120;

/// The synthetic set packed once per test run into ~30 small shards on S3.
fn dataset() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        s3();
        once_per_run("cluster-dataset", || {
            let url = s3_prefix("cluster");
            ramjet_ok(&[
                "pack",
                synth_dataset(N).to_str().unwrap(),
                &url,
                "--shard-size",
                "160KiB",
            ]);
            url
        })
    })
}

fn shard_ids(url: &str) -> Vec<ShardId> {
    let ds = block_on(Dataset::open(url)).unwrap();
    ds.manifest()
        .shards()
        .map(Result::unwrap)
        .map(|s| ShardId {
            checksum: s.checksum_u64(),
            bytes: s.bytes,
        })
        .collect()
}

fn s3_upstream() -> String {
    s3().endpoint.trim_start_matches("http://").to_owned()
}

struct Node {
    child: Child,
    sock: PathBuf,
    peer: String,
    http: String,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    fn stats(&self) -> serde_json::Value {
        let mut s = std::net::TcpStream::connect(&self.http).expect("stats port");
        write!(s, "GET /stats HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n").unwrap();
        let mut r = String::new();
        s.read_to_string(&mut r).unwrap();
        serde_json::from_str(r.split_once("\r\n\r\n").unwrap().1).unwrap()
    }
}

/// Peer names (`127.0.0.K:PORT`) for `n` daemons, the first on 127.0.0.`first`.
fn names(n: usize, first: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let ip = format!("127.0.0.{}", first + i);
            format!("{ip}:{}", free_port(&ip))
        })
        .collect()
}

/// Starts daemon `me` of `members`, its origin through `origin_url`.
fn start_node(dir: &Path, me: &str, members: &[String], origin_url: &str, env: &[(&str, &str)]) -> Node {
    let ip = me.split(':').next().unwrap();
    let http = format!("{ip}:{}", free_port(ip));
    let tag = me.replace([':', '.'], "_");
    let sock = dir.join(format!("{tag}.sock"));
    let mut c = Command::new(ramjet_bin());
    c.env("RAMJET_INDEX_DIR", test_index_dir());
    c.args(["serve", "--socket", sock.to_str().unwrap()])
        .args(["--cache-dir", dir.join(format!("cache-{tag}")).to_str().unwrap()])
        .args([
            "--cache-limit",
            "1GiB",
            "--listen",
            me,
            "--advertise",
            me,
            "--http",
            &http,
        ])
        .args(["--peers", &members.join(","), "--threads", "2"])
        .env("AWS_ENDPOINT_URL", origin_url)
        .env_remove("RAMJET_API_KEY")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    let child = c.spawn().expect("spawn ramjet serve");
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() || std::net::TcpStream::connect(&http).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(60), "daemon {me} did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    Node {
        child,
        sock,
        peer: me.to_owned(),
        http,
    }
}

/// A reader process: the whole dataset, unshuffled, through the daemon at `sock`.
fn reader(url: &str, sock: &Path, out: &Path, origin_url: &str, step_ms: u64) -> Child {
    Command::new(ramjet_bin())
        .env("RAMJET_INDEX_DIR", test_index_dir())
        .args(["stream", url, "--shuffle", "none", "--daemon", sock.to_str().unwrap()])
        .args([
            "--out",
            out.to_str().unwrap(),
            "--step-ms",
            &step_ms.to_string(),
            "--json",
        ])
        // Slow readers fetch as they go (one shard ahead), so a kill lands mid-epoch.
        .args(["--prefetch", if step_ms > 0 { "1KiB" } else { "512MiB" }])
        .env("AWS_ENDPOINT_URL", origin_url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn reader")
}

fn finish(c: Child) -> serde_json::Value {
    let o = c.wait_with_output().unwrap();
    assert!(o.status.success(), "reader failed:\n{}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("reader JSON: {e}\n{}", text(&o)))
}

/// What every reader must deliver: a run straight from the origin.
fn reference(url: &str) -> String {
    static REF: OnceLock<String> = OnceLock::new();
    REF.get_or_init(|| {
        once_per_run("cluster-reference", || {
            let d = tempfile::tempdir().unwrap();
            let out = d.path().join("ref.txt");
            ramjet_ok(&["stream", url, "--shuffle", "none", "--out", out.to_str().unwrap()]);
            std::fs::read_to_string(out).unwrap()
        })
    })
    .clone()
}

fn u(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

#[test]
fn three_daemons_fetch_each_shard_from_the_origin_once_and_hold_their_ring_share() {
    let url = dataset();
    let ids = shard_ids(url);
    let want = reference(url);
    let proxy = CountingProxy::start(&s3_upstream());
    let dir = tempfile::tempdir().unwrap();
    let members = names(3, 1);
    let nodes: Vec<Node> = members
        .iter()
        .map(|m| start_node(dir.path(), m, &members, &proxy.url, &[]))
        .collect();
    proxy.reset();
    let outs: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("out{i}"))).collect();
    let readers: Vec<Child> = nodes
        .iter()
        .zip(&outs)
        .map(|(n, o)| reader(url, &n.sock, o, &proxy.url, 0))
        .collect();
    let metrics: Vec<serde_json::Value> = readers.into_iter().map(finish).collect();
    for o in &outs {
        assert_eq!(
            std::fs::read_to_string(o).unwrap(),
            want,
            "a reader delivered different samples"
        );
    }
    // Every shard crossed from the origin once for the whole cluster: one GET per shard
    // (shards are smaller than one ranged part), none from the readers themselves.
    let shard_gets = proxy.count("GET", "/shards/");
    assert_eq!(shard_gets, ids.len(), "origin shard GETs for {} shards", ids.len());
    let total: u64 = ids.iter().map(|i| i.bytes).sum();
    let stats: Vec<serde_json::Value> = nodes.iter().map(Node::stats).collect();
    let origin_bytes: u64 = stats.iter().map(|s| u(&s["origin_bytes"])).sum();
    assert_eq!(origin_bytes, total, "origin bytes = 1.0x the dataset");
    for m in &metrics {
        assert_eq!(u(&m["daemon_failures"]), 0, "{m}");
        let got = u(&m["daemon_cache_local"]) + u(&m["daemon_cache_peer"]) + u(&m["daemon_origin"]);
        assert_eq!(got, ids.len() as u64, "every shard came through the daemon: {m}");
    }
    // Each daemon caches exactly the shards the ring gives it.
    let ring = Ring::new(1, members.clone(), ramjet_transport::ring::VNODES_DEFAULT);
    for (n, s) in nodes.iter().zip(&stats) {
        let share = ids.iter().filter(|i| ring.owner(**i) == Some(n.peer.as_str())).count() as u64;
        assert_eq!(u(&s["cache_shards"]), share, "{}: {s}", n.peer);
        assert!(
            share as f64 >= ids.len() as f64 / 3.0 * 0.4,
            "a lopsided ring: {share} of {}",
            ids.len()
        );
        assert_eq!(u(&s["ring_version"]), 1);
        assert!(u(&s["reads"]["cache_peer"]) > 0, "{s}");
    }
    // The cluster view.
    let hosts: Vec<&str> = nodes.iter().map(|n| n.http.as_str()).collect();
    let mut args = vec!["stats"];
    args.extend(hosts);
    let view = ramjet_ok(&args);
    assert!(view.contains("cluster: 3 nodes"), "{view}");
    // A second epoch reads nothing from the origin.
    proxy.reset();
    let again = dir.path().join("again");
    finish(reader(url, &nodes[0].sock, &again, &proxy.url, 0));
    assert_eq!(proxy.count("GET", "/shards/"), 0, "a warm cluster went to the origin");
}

/// Rank `rank` of a 4-rank job of 2 nodes (2 ranks each, ranks numbered node by node, as
/// torchrun sets them) reading 2 epochs of a sticky order through the daemon at `sock`.
fn node_reader(url: &str, sock: &Path, out: &Path, origin_url: &str, rank: usize, env: &[(&str, &str)]) -> Child {
    Command::new(ramjet_bin())
        .envs(env.iter().copied())
        .env("RAMJET_INDEX_DIR", test_index_dir())
        .args(["stream", url, "--daemon", sock.to_str().unwrap(), "--json"])
        .args(["--shuffle", "block", "--window", "2", "--partitions", "4", "--sticky"])
        .args(["--epochs", "2", "--ranged-bytes", "0", "--out", out.to_str().unwrap()])
        .envs([
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "4".into()),
            ("LOCAL_RANK", (rank % 2).to_string()),
            ("LOCAL_WORLD_SIZE", "2".into()),
        ])
        .env("AWS_ENDPOINT_URL", origin_url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn reader")
}

/// Two nodes of two ranks, a sticky order dealt node by node: each node's daemon fetches from
/// the origin (counted behind the node's own proxy) only the shards its ranks read, each once,
/// and keeps them, so the second epoch costs no origin bytes; a shard both nodes read (a cut
/// splits it) crosses from the origin once, into its reader (the node of its first partition:
/// node 0 here), and node 1's daemon fetches it from node 0's, found by the job's heartbeats;
/// and every sample is delivered once an epoch.
#[test]
fn each_node_reads_only_its_share_and_keeps_it_for_the_next_epoch() {
    two_nodes_of_a_sticky_order(Split::Reader);
}

/// The same job with `RAMJET_SPLIT_SHARDS=owner`: a shard both nodes read crosses from the
/// origin once, into its ring owner, and from there to the other node, which keeps it too.
#[test]
fn with_split_shards_through_the_owner_a_split_shard_crosses_from_the_origin_once() {
    two_nodes_of_a_sticky_order(Split::Owner);
}

/// The same job with `RAMJET_SPLIT_SHARDS=origin`: a shard both nodes read crosses from the
/// origin into each of them.
#[test]
fn with_split_shards_from_the_origin_each_node_reads_a_split_shard_itself() {
    two_nodes_of_a_sticky_order(Split::Origin);
}

/// A peer's request that says its node reads the shard too and this node is its reader (`keep`)
/// is kept here, though another daemon owns the shard on the ring; a plain peer request for
/// such a shard is served and left to its owner. (A reader that did not keep it would fetch it
/// from the origin again for its own node.)
#[test]
fn a_split_shards_reader_keeps_what_a_peer_asks_it_for() {
    use ramjet_transport::peer::{LinkConfig, PeerTransport, ShardGet, TcpTransport, TRANSFER_MIN_BYTES_PER_S_DEFAULT};
    let url = dataset();
    let ids = shard_ids(url);
    let dir = tempfile::tempdir().unwrap();
    let members = names(2, 64);
    let nodes: Vec<Node> = members
        .iter()
        .map(|m| start_node(dir.path(), m, &members, &s3().endpoint, &[]))
        .collect();
    let ring = Ring::new(1, members.clone(), ramjet_transport::ring::VNODES_DEFAULT);
    // Two shards the second daemon owns, asked of the first.
    let theirs: Vec<usize> = (0..ids.len())
        .filter(|&i| ring.owner(ids[i]) == Some(members[1].as_str()))
        .take(2)
        .collect();
    assert_eq!(theirs.len(), 2, "the ring gives the second daemon two shards");
    let t = TcpTransport::new(LinkConfig {
        api_key: None,
        peer_timeout: Duration::from_secs(10),
        reply_timeout: Duration::from_secs(30),
        transfer_min_bytes_per_s: TRANSFER_MIN_BYTES_PER_S_DEFAULT,
    });
    // One runtime for the transport's pooled connections.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ds = rt.block_on(Dataset::open(url)).unwrap();
    let cached = || u(&nodes[0].stats()["cache_shards"]);
    for (i, keep) in [(theirs[0], false), (theirs[1], true)] {
        let get = ShardGet {
            manifest_url: ds.manifest_url().to_owned(),
            shard: i as u32,
            checksum: ids[i].checksum,
            bytes: ids[i].bytes,
            what: format!("shard {i}"),
            keep,
        };
        let before = cached();
        let got = rt.block_on(t.fetch(&members[0], &get)).unwrap();
        assert_eq!(got.len() as u64, ids[i].bytes);
        assert_eq!(cached() - before, keep as u64, "shard {i}, keep {keep}");
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Split {
    Reader,
    Owner,
    Origin,
}

/// Waits until `node`'s daemon lists `n` consumers of the job with a node in their heartbeats.
fn wait_for_consumers(node: &Node, n: usize) {
    let t = std::time::Instant::now();
    loop {
        let mut s = std::net::TcpStream::connect(&node.http).expect("jobs port");
        write!(s, "GET /jobs HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n").unwrap();
        let mut r = String::new();
        s.read_to_string(&mut r).unwrap();
        let v: serde_json::Value = serde_json::from_str(r.split_once("\r\n\r\n").unwrap().1).unwrap();
        let with_node = v
            .as_array()
            .unwrap()
            .iter()
            .filter(|j| j["beat"]["node"].is_u64())
            .count();
        if with_node >= n {
            return;
        }
        assert!(
            t.elapsed().as_secs() < 60,
            "the daemon lists no consumers with a node: {v}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn two_nodes_of_a_sticky_order(mode: Split) {
    let env: &[(&str, &str)] = match mode {
        Split::Reader => &[],
        Split::Owner => &[("RAMJET_SPLIT_SHARDS", "owner")],
        Split::Origin => &[("RAMJET_SPLIT_SHARDS", "origin")],
    };
    let url = dataset();
    let ids = shard_ids(url);
    let dir = tempfile::tempdir().unwrap();
    let members = names(2, 60);
    let proxies: Vec<CountingProxy> = (0..2).map(|_| CountingProxy::start(&s3_upstream())).collect();
    let nodes: Vec<Node> = members
        .iter()
        .zip(&proxies)
        .map(|(m, p)| start_node(dir.path(), m, &members, &p.url, &[]))
        .collect();
    proxies.iter().for_each(CountingProxy::reset);
    let outs: Vec<PathBuf> = (0..4).map(|r| dir.path().join(format!("rank{r}"))).collect();
    // Node 0's ranks first, so that node 1's daemon finds their heartbeats (in a job started
    // at once, a split shard asked for before its reader's loaders beat comes from the
    // origin, within `directory::FIND_WAIT`).
    let mut readers: Vec<Child> = Vec::new();
    for r in 0..4 {
        if r == 2 {
            wait_for_consumers(&nodes[0], 2);
        }
        readers.push(node_reader(
            url,
            &nodes[r / 2].sock,
            &outs[r],
            &proxies[r / 2].url,
            r,
            env,
        ));
    }
    readers.into_iter().for_each(|c| drop(finish(c)));
    // Each line: epoch position stream shard index global_index record_bytes.
    let lines: Vec<Vec<Vec<String>>> = outs
        .iter()
        .map(|o| {
            let t = std::fs::read_to_string(o).unwrap();
            t.lines()
                .map(|l| l.split_whitespace().map(str::to_owned).collect())
                .collect()
        })
        .collect();
    let want: std::collections::BTreeSet<String> = reference(url)
        .lines()
        .map(|l| l.split_whitespace().skip(2).take(3).collect::<Vec<_>>().join(" "))
        .collect();
    for epoch in ["0", "1"] {
        let got: Vec<String> = lines
            .iter()
            .flatten()
            .filter(|f| f[0] == epoch)
            .map(|f| f[2..5].join(" "))
            .collect();
        assert_eq!(got.len(), want.len(), "epoch {epoch}: samples delivered");
        assert_eq!(
            got.into_iter().collect::<std::collections::BTreeSet<_>>(),
            want,
            "epoch {epoch}"
        );
    }
    let shards_of = |node: usize, epoch: &str| -> std::collections::BTreeSet<String> {
        lines[node * 2..node * 2 + 2]
            .iter()
            .flatten()
            .filter(|f| f[0] == epoch)
            .map(|f| f[3].clone())
            .collect()
    };
    // Rounds of 4 partitions x 2 shards: each round's cut between the nodes splits at most one
    // shard, which both nodes read.
    let rounds = ids.len().div_ceil(8);
    let (a, b) = (shards_of(0, "0"), shards_of(1, "0"));
    assert!(a.intersection(&b).count() <= rounds, "{a:?} {b:?}");
    for (n, node) in nodes.iter().enumerate() {
        let (first, second) = (shards_of(n, "0"), shards_of(n, "1"));
        // The same shards, but for a cut that moved by a sample onto a neighbouring shard
        // (the extra samples' sweep follows the rounds' new order): at most one a round.
        let new: Vec<&String> = second.difference(&first).collect();
        assert!(
            new.len() <= rounds,
            "node {n} read other shards in its second epoch: {new:?}"
        );
        assert!(
            first.len() <= ids.len() / 2 + rounds,
            "node {n} read {} shards",
            first.len()
        );
        let s = node.stats();
        assert_eq!(
            u(&s["cache_shards"]),
            first.union(&second).count() as u64,
            "node {n} keeps its share: {s}"
        );
    }
    // A shard only one node reads crossed from the origin into that node alone, once for both
    // epochs. A shard both nodes read in the first epoch (a cut split it) crossed from the
    // origin once for the cluster, into its reader (by default) or its ring owner, and the
    // other node fetched it from that peer; or (from the origin) into both. So did one split in
    // the second epoch that a node had not read before. The peer bytes are exactly those. A loaded machine may repeat a GET (a loader whose daemon
    // did not answer in time reads the origin itself, as it should): at most one a node.
    let ring = Ring::new(1, members.clone(), ramjet_transport::ring::VNODES_DEFAULT);
    let owner = |shard: &String| {
        let id = ids[shard.parse::<usize>().unwrap()];
        (
            members.iter().position(|m| ring.owner(id) == Some(m.as_str())).unwrap(),
            id.bytes,
        )
    };
    let reads: Vec<std::collections::BTreeSet<String>> = (0..2)
        .map(|n| shards_of(n, "0").union(&shards_of(n, "1")).cloned().collect())
        .collect();
    let split_in = |e: &str| -> std::collections::BTreeSet<String> {
        shards_of(0, e).intersection(&shards_of(1, e)).cloned().collect()
    };
    let split = split_in("0");
    assert!(
        !split.is_empty(),
        "no cut split a shard: the test sees nothing of the split rule"
    );
    // Where a split shard crosses from the origin: its ring owner, or its reader (node 0).
    let source = |shard: &String| match mode {
        Split::Reader => (0, owner(shard).1),
        _ => owner(shard),
    };
    let mut peer_want = [0u64; 2];
    for (e, before) in [("0", None), ("1", Some("0"))]
        .into_iter()
        .filter(|_| mode != Split::Origin)
    {
        for shard in split_in(e) {
            let (o, bytes) = source(&shard);
            let had = before.is_some_and(|b| shards_of(1 - o, b).contains(&shard));
            if !had {
                peer_want[1 - o] += bytes;
            }
        }
    }
    let gets = |n: usize, shard: &str| {
        proxies[n].count_distinct("GET", &format!("/shards/{:06}-", shard.parse::<usize>().unwrap()))
    };
    for (n, node) in nodes.iter().enumerate() {
        let other = 1 - n;
        for shard in reads[n].difference(&reads[other]) {
            assert_eq!(
                (gets(n, shard), gets(other, shard)),
                (1, 0),
                "shard {shard}, only node {n} reads it"
            );
        }
        for shard in &split {
            let want = match (mode, source(shard).0 == n) {
                (Split::Origin, _) => (1, 1),
                (_, true) => (1, 0),
                (_, false) => (0, 1),
            };
            assert_eq!(
                (gets(n, shard), gets(other, shard)),
                want,
                "split shard {shard} ({mode:?}), node {n}"
            );
        }
        let all = proxies[n].count("GET", "/shards/");
        let distinct = proxies[n].count_distinct("GET", "/shards/");
        assert!(
            all <= distinct + 1,
            "node {n} fetched {all} times for {distinct} shards"
        );
        let s = node.stats();
        assert_eq!(u(&s["reads"]["cache_peer"]) > 0, peer_want[n] > 0, "node {n}: {s}");
    }
    for (n, node) in nodes.iter().enumerate() {
        let s = node.stats();
        assert_eq!(
            u(&s["peer_fetched_bytes"]),
            peer_want[n],
            "node {n}'s bytes from its peer: {s}"
        );
    }
}

#[test]
fn sigkill_of_a_daemon_mid_epoch_leaves_every_reader_with_correct_data() {
    let url = dataset();
    let want = reference(url);
    let dir = tempfile::tempdir().unwrap();
    let members = names(3, 4);
    let origin = s3().endpoint.clone();
    let mut nodes: Vec<Node> = members
        .iter()
        .map(|m| start_node(dir.path(), m, &members, &origin, &[("RAMJET_PEER_TIMEOUT_MS", "2000")]))
        .collect();
    let outs: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("out{i}"))).collect();
    let readers: Vec<Child> = nodes
        .iter()
        .zip(&outs)
        .map(|(n, o)| reader(url, &n.sock, o, &origin, 25))
        .collect();
    let t0 = Instant::now();
    while std::fs::read_to_string(&outs[1])
        .map(|s| s.lines().count())
        .unwrap_or(0)
        < N / 4
    {
        assert!(t0.elapsed() < Duration::from_secs(60), "readers made no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SIGKILL: no clean-up of any kind.
    let victim = &mut nodes[1].child;
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(victim.id() as i32, libc::SIGKILL) };
    victim.wait().unwrap();
    let metrics: Vec<serde_json::Value> = readers.into_iter().map(finish).collect();
    for (i, o) in outs.iter().enumerate() {
        assert_eq!(
            std::fs::read_to_string(o).unwrap(),
            want,
            "reader {i} delivered different samples"
        );
    }
    // The reader whose own daemon died went on by itself.
    assert!(u(&metrics[1]["daemon_failures"]) > 0, "{}", metrics[1]);
    // The survivors saw the dead peer.
    for n in [&nodes[0], &nodes[2]] {
        let s = n.stats();
        let peer = &s["peers"][&members[1]];
        assert!(u(&peer["failures"]) > 0 || !peer["healthy"].as_bool().unwrap(), "{s}");
    }
}

/// Robustness row "no stale lock, socket or partial file after a crash": a daemon SIGKILLed
/// while it fills its cache for a reader is started again on the same socket and cache
/// directory. It comes up (the dead daemon's socket file and cache lock are not in its way), the
/// dead one's partial writes are gone, and a reader through it gets every sample right without
/// failing over.
#[test]
fn a_daemon_killed_mid_fill_restarts_on_its_socket_and_cache_with_nothing_stale() {
    let url = dataset();
    let want = reference(url);
    let dir = tempfile::tempdir().unwrap();
    let me = names(1, 47).remove(0);
    let origin = s3().endpoint.clone();
    let mut first = start_node(dir.path(), &me, std::slice::from_ref(&me), &origin, &[]);
    let out = dir.path().join("out0");
    let r = reader(url, &first.sock, &out, &origin, 25);
    let t0 = Instant::now();
    while std::fs::read_to_string(&out).map(|s| s.lines().count()).unwrap_or(0) < N / 4 {
        assert!(t0.elapsed() < Duration::from_secs(60), "the reader made no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(first.child.id() as i32, libc::SIGKILL) };
    first.child.wait().unwrap();
    let m = finish(r);
    assert_eq!(std::fs::read_to_string(&out).unwrap(), want);
    assert!(
        u(&m["daemon_failures"]) > 0,
        "the daemon died under the reader unnoticed: {m}"
    );
    assert!(
        first.sock.exists(),
        "SIGKILL leaves the socket file behind (what the restart must survive)"
    );
    let again = start_node(dir.path(), &me, std::slice::from_ref(&me), &origin, &[]);
    assert_eq!(again.sock, first.sock);
    let cache = dir.path().join(format!("cache-{}", me.replace([':', '.'], "_")));
    let tmp: Vec<_> = std::fs::read_dir(cache.join("tmp"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(tmp.is_empty(), "partial writes of the killed daemon were left: {tmp:?}");
    let out = dir.path().join("out1");
    let m = finish(reader(url, &again.sock, &out, &origin, 0));
    assert_eq!(std::fs::read_to_string(&out).unwrap(), want);
    assert_eq!(u(&m["daemon_failures"]), 0, "{m}");
}

#[test]
fn a_wrong_api_key_is_refused_and_counted() {
    let url = dataset();
    let want = reference(url);
    let dir = tempfile::tempdir().unwrap();
    let members = names(2, 7);
    let origin = s3().endpoint.clone();
    let a = start_node(
        dir.path(),
        &members[0],
        &members,
        &origin,
        &[("RAMJET_API_KEY", "alpha")],
    );
    let b = start_node(
        dir.path(),
        &members[1],
        &members,
        &origin,
        &[("RAMJET_API_KEY", "bravo")],
    );
    let out = dir.path().join("out");
    finish(reader(url, &a.sock, &out, &origin, 0));
    assert_eq!(std::fs::read_to_string(&out).unwrap(), want);
    let (sa, sb) = (a.stats(), b.stats());
    assert!(u(&sb["auth_refused"]) >= 1, "{sb}");
    assert_eq!(u(&sb["peer_served"]), 0, "{sb}");
    let err = sa["peers"][&members[1]]["last_error"].as_str().unwrap_or("").to_owned();
    assert!(err.contains("API key"), "{sa}");
    // A client without the key is refused too, and the key is never needed on the wire.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let r = rt.block_on(async {
        let mut s = tokio::net::TcpStream::connect(&members[1]).await.unwrap();
        wire::connect(&mut s, Some(&wire::ApiKey::new("charlie"))).await
    });
    assert!(matches!(r, Err(wire::HandshakeError::Refused(_))), "{r:?}");
    let r = rt.block_on(async {
        let mut s = tokio::net::TcpStream::connect(&members[1]).await.unwrap();
        wire::connect(&mut s, Some(&wire::ApiKey::new("bravo"))).await
    });
    assert!(r.is_ok(), "{r:?}");
    assert!(u(&b.stats()["auth_refused"]) >= 2);
}

#[derive(Clone, Copy, Debug)]
enum Lie {
    /// The right size, one byte flipped.
    Corrupt,
    /// Half the shard, then silence.
    Stall,
    /// Half the shard, then the connection closes (a peer killed mid-transfer).
    Vanish,
    /// A byte every 100 ms: never idle long enough for the peer timeout.
    Trickle,
}

/// A peer that speaks the protocol and then lies. Returns its name.
fn lying_peer(rt: &tokio::runtime::Runtime, lie: Lie) -> String {
    let l = rt.block_on(tokio::net::TcpListener::bind("127.0.0.12:0")).unwrap();
    let name = l.local_addr().unwrap().to_string();
    rt.spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let Ok(session) = wire::accept(&mut s, None).await else {
                    return;
                };
                let mut s = wire::Channel { stream: s, session };
                while let Ok(wire::Msg::Get {
                    manifest_url,
                    shard,
                    bytes,
                    ..
                }) = s.recv().await
                {
                    let ds = Dataset::open(&manifest_url).await.unwrap();
                    let mut data = ds.fetch_shard(shard as usize).await.unwrap().to_vec();
                    let reply = wire::Msg::Data {
                        bytes,
                        source: "cache_local".into(),
                    };
                    if s.send(&reply).await.is_err() {
                        return;
                    }
                    let s = &mut s.stream;
                    match lie {
                        Lie::Corrupt => {
                            data[bytes as usize / 2] ^= 0x5a;
                            if s.write_all(&data).await.is_err() {
                                return;
                            }
                        }
                        Lie::Stall => {
                            let _ = s.write_all(&data[..data.len() / 2]).await;
                            tokio::time::sleep(Duration::from_secs(120)).await;
                            return;
                        }
                        Lie::Vanish => {
                            let _ = s.write_all(&data[..data.len() / 2]).await;
                            return;
                        }
                        Lie::Trickle => {
                            for b in &data {
                                if s.write_all(&[*b]).await.is_err() {
                                    return;
                                }
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                        }
                    }
                }
            });
        }
    });
    name
}

#[test]
fn lying_stalling_and_vanishing_peers_are_survived_with_correct_data() {
    let url = dataset();
    let want = reference(url);
    let rt = tokio::runtime::Runtime::new().unwrap();
    for lie in [Lie::Corrupt, Lie::Stall, Lie::Vanish, Lie::Trickle] {
        let dir = tempfile::tempdir().unwrap();
        let liar = lying_peer(&rt, lie);
        let me = names(1, 11).remove(0);
        let members = vec![me.clone(), liar.clone()];
        let origin = s3().endpoint.clone();
        let a = start_node(
            dir.path(),
            &me,
            &members,
            &origin,
            // A trickle of 10 B/s is far under 1 MiB/s: the shard's transfer deadline is about
            // 1.2 s, though no gap between bytes reaches the 1 s peer timeout.
            &[
                ("RAMJET_PEER_TIMEOUT_MS", "1000"),
                ("RAMJET_PEER_MIN_BYTES_PER_S", "1048576"),
            ],
        );
        let out = dir.path().join("out");
        let t0 = Instant::now();
        let m = finish(reader(url, &a.sock, &out, &origin, 0));
        assert_eq!(std::fs::read_to_string(&out).unwrap(), want, "{lie:?}");
        assert!(t0.elapsed() < Duration::from_secs(60), "{lie:?}: too slow");
        let s = a.stats();
        let peer = &s["peers"][&liar];
        assert!(u(&peer["failures"]) >= 1, "{lie:?}: {s}");
        let err = peer["last_error"].as_str().unwrap_or("");
        match lie {
            Lie::Corrupt => assert!(u(&s["peer_corrupt"]) >= 1 && err.contains("corrupt"), "{s}"),
            Lie::Stall => assert!(err.contains("stalled"), "{s}"),
            Lie::Vanish => assert!(err.contains("closed"), "{s}"),
            Lie::Trickle => assert!(err.contains("transfer deadline"), "{s}"),
        }
        // Nothing the liar sent reached the reader: every delivered shard verified.
        assert_eq!(u(&m["daemon_failures"]), 0, "{lie:?}: {m}");
        assert_eq!(u(&s["reads"]["cache_peer"]), 0, "{lie:?}: {s}");
    }
}

#[test]
fn the_embedded_daemon_starts_once_validates_requests_and_serves_from_its_cache() {
    let url = dataset();
    let ids = shard_ids(url);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("embedded.sock");
    let cache = CacheConfig::new(dir.path().join("cache"), 1 << 30);
    let host = ramjet_transport::ensure_daemon(&sock, cache.clone()).unwrap();
    assert!(host.embedded.is_some(), "no daemon was running, so one starts here");
    let read = |client: std::sync::Arc<DaemonClient>| {
        let mut cfg = StreamConfig::new(url);
        cfg.provider = Some(client);
        let mut s = Stream::open(cfg).unwrap();
        let mut n = 0;
        while s.next_sample().unwrap().is_some() {
            n += 1;
        }
        assert_eq!(n, N);
        s.metrics()
    };
    let cold = read(host.client.clone());
    assert_eq!(cold.daemon_origin, ids.len() as u64, "{cold:?}");
    // A second process-level caller finds the daemon and shares it.
    let second = ramjet_transport::ensure_daemon(&sock, cache).unwrap();
    assert!(second.embedded.is_none());
    let warm = read(second.client.clone());
    assert_eq!(warm.daemon_cache_local, ids.len() as u64, "{warm:?}");
    assert_eq!(warm.origin_bytes, 0);
    // Requests are validated: path traversal, unknown schemes, shards not in the manifest,
    // and identities that do not match.
    let ds = block_on(Dataset::open(url)).unwrap();
    let good = ds.manifest_url().to_owned();
    let bucket = &s3().bucket;
    let traversal = format!("s3://{bucket}/tests/../../etc/manifest.json");
    let cases: [(&str, u32, ShardId); 4] = [
        (&traversal, 0, ids[0]),
        ("ftp://x/manifest.json", 0, ids[0]),
        (&good, ids.len() as u32, ids[0]),
        (
            &good,
            0,
            ShardId {
                checksum: ids[0].checksum ^ 1,
                bytes: ids[0].bytes,
            },
        ),
    ];
    for (m, shard, id) in cases {
        let e = second
            .client
            .fetch(&ShardRequest {
                manifest_url: m,
                shard,
                id,
                keep: false,
                split: false,
                reader: None,
                job: "",
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("refused"), "{m} {shard}: {e}");
    }
    let d = host.embedded.as_ref().unwrap().stats();
    assert_eq!(d.requests_refused, 4);
    assert_eq!(d.reads[FetchedFrom::CacheLocal.name()], ids.len() as u64);
    // A copy a reader reports corrupt is dropped and fetched again.
    second.client.report_corrupt(&ShardRequest {
        manifest_url: &good,
        shard: 0,
        id: ids[0],
        keep: false,
        split: false,
        reader: None,
        job: "",
    });
    let got = second
        .client
        .fetch(&ShardRequest {
            manifest_url: &good,
            shard: 0,
            id: ids[0],
            keep: false,
            split: false,
            reader: None,
            job: "",
        })
        .unwrap();
    assert_eq!(got.from, FetchedFrom::Origin);
    ds.check_shard(0, &got.bytes).unwrap();
}

/// Regression: the daemon kept every manifest it had loaded for its whole life, so after a
/// dataset was re-packed under the same URL each request for the new shards was refused.
#[test]
fn a_daemon_serves_a_dataset_repacked_under_the_same_url() {
    let dir = tempfile::tempdir().unwrap();
    let url = s3_prefix("repack");
    let read_all = |client: std::sync::Arc<DaemonClient>| {
        let mut cfg = StreamConfig::new(&url);
        cfg.provider = Some(client);
        let mut s = Stream::open(cfg).unwrap();
        let mut n = 0;
        while s.next_sample().unwrap().is_some() {
            n += 1;
        }
        n
    };
    ramjet_ok(&[
        "pack",
        synth_dataset(20).to_str().unwrap(),
        &url,
        "--shard-size",
        "160KiB",
    ]);
    let sock = dir.path().join("d.sock");
    let host = ramjet_transport::ensure_daemon(&sock, CacheConfig::new(dir.path().join("cache"), 1 << 30)).unwrap();
    assert_eq!(read_all(host.client.clone()), 20);
    // Re-packed: other samples, other shards, the same URL.
    std::thread::sleep(Duration::from_millis(1100));
    ramjet_ok(&[
        "pack",
        synth_dataset(33).to_str().unwrap(),
        &url,
        "--shard-size",
        "160KiB",
    ]);
    assert_eq!(
        read_all(host.client.clone()),
        33,
        "the re-packed dataset was not served"
    );
}

/// Regression: two daemons whose rings disagree (each thinks the other owns a shard) sent each
/// other's requests back into their own flights and waited on each other until the
/// singleflight timeout. A peer's request now joins only flights that go to the origin.
#[test]
fn rings_that_disagree_do_not_loop_a_request_between_two_peers() {
    let url = dataset();
    let want = reference(url);
    let dir = tempfile::tempdir().unwrap();
    let m = names(2, 21);
    let origin = s3().endpoint.clone();
    let env = [
        ("RAMJET_SINGLEFLIGHT_TIMEOUT_MS", "60000"),
        ("RAMJET_PEER_TIMEOUT_MS", "60000"),
    ];
    // A's ring holds only B, and B's only A.
    let a = start_node(dir.path(), &m[0], &m[1..], &origin, &env);
    let b = start_node(dir.path(), &m[1], &m[..1], &origin, &env);
    let t0 = Instant::now();
    let (oa, ob) = (dir.path().join("a"), dir.path().join("b"));
    let (ra, rb) = (
        reader(url, &a.sock, &oa, &origin, 0),
        reader(url, &b.sock, &ob, &origin, 0),
    );
    finish(ra);
    finish(rb);
    let took = t0.elapsed();
    assert_eq!(std::fs::read_to_string(&oa).unwrap(), want);
    assert_eq!(std::fs::read_to_string(&ob).unwrap(), want);
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(
        u(&sa["singleflight_timeouts"]) + u(&sb["singleflight_timeouts"]),
        0,
        "{sa}\n{sb}"
    );
    assert!(
        took < Duration::from_secs(45),
        "the two daemons waited on each other: {took:?}"
    );
}

/// Regression: the request that started a flight waited on it without a deadline, behind a
/// peer that stalls (here for a minute); it now gives up after the singleflight timeout and
/// reads the origin, while the flight goes on.
#[test]
fn the_request_that_starts_a_flight_has_a_deadline() {
    let url = dataset();
    let ids = shard_ids(url);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let liar = lying_peer(&rt, Lie::Stall);
    let dir = tempfile::tempdir().unwrap();
    let me = names(1, 25).remove(0);
    let origin = s3().endpoint.clone();
    // Every shard belongs to the liar; it stalls for longer than the peer timeout allows.
    let a = start_node(
        dir.path(),
        &me,
        std::slice::from_ref(&liar),
        &origin,
        &[
            ("RAMJET_SINGLEFLIGHT_TIMEOUT_MS", "1500"),
            ("RAMJET_PEER_TIMEOUT_MS", "60000"),
        ],
    );
    let ds = block_on(Dataset::open(url)).unwrap();
    let client = DaemonClient::new(&a.sock);
    let t0 = Instant::now();
    let got = client
        .fetch(&ShardRequest {
            manifest_url: ds.manifest_url(),
            shard: 0,
            id: ids[0],
            keep: false,
            split: false,
            reader: None,
            job: "",
        })
        .unwrap();
    let took = t0.elapsed();
    assert_eq!(got.from, FetchedFrom::Origin);
    ds.check_shard(0, &got.bytes).unwrap();
    assert!(took < Duration::from_secs(15), "the starting request waited {took:?}");
    assert!(u(&a.stats()["singleflight_timeouts"]) >= 1);
}

/// Sends `request` and reads the answer to its end. An empty string is a connection the
/// daemon closed without answering (end of file or a reset: a refusal); no answer within 10 s
/// fails the test as a timeout, so a hung daemon never passes for a refusing one.
fn http(addr: &str, request: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(request.as_bytes()); // a refused connection may be reset mid-write
    let mut r = Vec::new();
    match s.read_to_end(&mut r) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            panic!("{addr}: no answer and no close within 10 s (a hang, not a refusal)")
        }
        Err(e) => panic!("{addr}: {e}"),
    }
    String::from_utf8_lossy(&r).into_owned()
}

/// Regression: `POST /freeze` on the HTTP port froze the ring for anyone who could reach it,
/// unauthenticated; the HTTP endpoints were a hand-written parser. The port is read-only now.
#[test]
fn the_http_port_cannot_freeze_the_ring() {
    let dir = tempfile::tempdir().unwrap();
    let me = names(1, 27).remove(0);
    let a = start_node(dir.path(), &me, std::slice::from_ref(&me), &s3().endpoint, &[]);
    for path in ["/freeze", "/unfreeze"] {
        let r = http(
            &a.http,
            &format!("POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"),
        );
        assert!(r.starts_with("HTTP/1.1 405"), "{path}: {r}");
    }
    assert_eq!(a.stats()["frozen"], serde_json::json!(false));
    // Malformed requests get an HTTP error, not a crash; the daemon keeps serving.
    let r = http(&a.http, "GARBAGE\r\n\r\n");
    assert!(r.is_empty() || r.starts_with("HTTP/1.1 4"), "{r}");
    assert!(http(&a.http, "GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").ends_with("ok\n"));
    // Over the Unix socket (this user only), freezing works; the freeze is a lease.
    let mut lease = DaemonClient::new(&a.sock).freeze().unwrap();
    assert_eq!(a.stats()["frozen"], serde_json::json!(true));
    lease.release().unwrap();
    assert_eq!(a.stats()["frozen"], serde_json::json!(false));
}

/// Issue 42 defect 4: a freeze outlived its holder, so the ring stayed frozen for good after a
/// trainer was killed. A freeze is now a lease on its connection: released explicitly, or when
/// the connection closes. (SIGKILL of a real holder process: bindings/tests/test_robustness.py.)
#[test]
fn a_freeze_is_a_lease_released_when_its_connection_closes() {
    let dir = tempfile::tempdir().unwrap();
    let me = names(1, 45).remove(0);
    let a = start_node(dir.path(), &me, std::slice::from_ref(&me), &s3().endpoint, &[]);
    let frozen = |n: &Node| n.stats()["frozen"].as_bool().unwrap();
    let c = DaemonClient::new(&a.sock);
    let one = c.freeze().unwrap();
    let mut two = c.freeze().unwrap();
    assert!(frozen(&a));
    two.release().unwrap();
    assert!(!two.held());
    two.release().unwrap(); // twice: nothing more is released
    assert!(frozen(&a), "releasing one lease released the other");
    drop(one); // the connection closes: the daemon releases it
    let t0 = Instant::now();
    while frozen(&a) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "a dropped lease still holds the ring"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // An unfreeze on a connection that holds nothing is refused, not counted against another
    // holder's freeze.
    let held = c.freeze().unwrap();
    let mut raw = std::os::unix::net::UnixStream::connect(&a.sock).unwrap();
    raw.write_all(&wire::encode(&wire::Msg::Unfreeze)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = vec![0u8; 4096];
    let n = raw.read(&mut buf).unwrap();
    let (reply, _) = wire::parse_frame(&buf[..n]).unwrap().unwrap();
    assert!(
        matches!(&reply, wire::Msg::Fail { message } if message.contains("holds no freeze")),
        "{reply:?}"
    );
    assert!(frozen(&a));
    drop(held);
}

/// Issue 48: the descriptor the daemon handed a loader was a copy of the one its cache pinned
/// the shard with, and a shared flock belongs to the open file description: the loader (and any
/// worker it forked) then held the pin for as long as it kept the descriptor, and the shard could
/// never be evicted. It is now a fresh open: with the received descriptor still open, an
/// exclusive lock on the cached file (what eviction takes) is granted.
#[test]
fn a_handed_out_descriptor_holds_no_lock_on_the_cached_shard() {
    use std::os::fd::AsRawFd;
    let url = dataset();
    let id = shard_ids(url)[0];
    let dir = tempfile::tempdir().unwrap();
    let cfg = ramjet_transport::DaemonConfig::new(
        dir.path().join("h.sock"),
        CacheConfig::new(dir.path().join("cache"), 1 << 30),
    );
    let d = ramjet_transport::Daemon::start(cfg).unwrap();
    let ds = block_on(Dataset::open(url)).unwrap();
    let get = |s: &mut std::os::unix::net::UnixStream| -> Option<std::os::fd::OwnedFd> {
        s.write_all(&wire::encode(&wire::Msg::Get {
            manifest_url: ds.manifest_url().to_owned(),
            shard: 0,
            checksum: id.checksum,
            bytes: id.bytes,
            keep: false,
            split: false,
            reader: None,
            job: None,
        }))
        .unwrap();
        let (mut buf, mut chunk, mut fds) = (Vec::new(), [0u8; 4096], Vec::new());
        loop {
            if let Some((m, _)) = wire::parse_frame(&buf).unwrap() {
                assert!(matches!(m, wire::Msg::Data { .. }), "{m:?}");
                return fds.pop();
            }
            let n = ramjet_transport::sys::recv_with_fds(s.as_raw_fd(), &mut chunk, &mut fds).unwrap();
            assert!(n > 0, "the daemon closed the connection");
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    let mut s = std::os::unix::net::UnixStream::connect(d.socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    get(&mut s).expect("a descriptor"); // fills the cache
    let cached = dir.path().join("cache/shards").join(id.file_name());
    assert!(cached.exists(), "the shard was not cached");
    let held = get(&mut s).expect("a descriptor of the cached file");
    let probe = std::fs::File::open(&cached).unwrap();
    let t0 = Instant::now();
    // SAFETY: flock on a descriptor this test owns.
    while unsafe { libc::flock(probe.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the descriptor handed to the loader still pins the cached shard"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(held);
}

/// Raises this process's soft descriptor limit to `want` (or fails the test, naming the hard
/// limit, when it cannot): the flood below holds thousands of sockets.
fn raise_nofile(want: u64) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    assert!(
        r.rlim_max >= want,
        "this test holds {want} descriptors; the hard limit is {} (raise `ulimit -Hn`)",
        r.rlim_max
    );
    if r.rlim_cur < want {
        r.rlim_cur = want;
        // SAFETY: as above.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);
    }
}

/// Issue 42 defect 3: 1,100 idle TCP connections to the peer port made every local loader
/// fail over to direct reads and `/health` stop answering (one budget for every class, and an
/// unauthenticated connection held 10 s). Now each class has its own budget, a connection
/// still in the handshake is bounded per address and cut off after the handshake timeout:
/// 2,000 idle unauthenticated connections, reopened as the daemon closes them, while a loader
/// streams the whole dataset through the daemon and `/health` is polled.
#[test]
fn a_flood_of_idle_peer_connections_starves_neither_loaders_nor_health() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    const FLOOD: usize = 2_000;
    raise_nofile(3 * FLOOD as u64);
    let url = dataset();
    let want = reference(url);
    let dir = tempfile::tempdir().unwrap();
    let me = names(1, 46).remove(0);
    let origin = s3().endpoint.clone();
    let node = start_node(dir.path(), &me, std::slice::from_ref(&me), &origin, &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let (opened, reopened) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let flood = {
        let (stop, opened, reopened, peer) = (stop.clone(), opened.clone(), reopened.clone(), node.peer.clone());
        std::thread::spawn(move || {
            let addr: std::net::SocketAddr = peer.parse().unwrap();
            let connect = || {
                let s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
                s.set_nonblocking(true).ok()?;
                Some(s)
            };
            let mut conns: Vec<Option<std::net::TcpStream>> = Vec::with_capacity(FLOOD);
            while conns.len() < FLOOD && !stop.load(Ordering::Relaxed) {
                conns.push(connect());
                opened.fetch_add(1, Ordering::Relaxed);
            }
            let mut byte = [0u8; 1];
            while !stop.load(Ordering::Relaxed) {
                for c in conns.iter_mut() {
                    let closed = match c {
                        None => true,
                        Some(s) => match s.read(&mut byte) {
                            Ok(n) => n == 0,
                            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                        },
                    };
                    if closed {
                        *c = connect();
                        reopened.fetch_add(1, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let t0 = Instant::now();
    while opened.load(Ordering::Relaxed) < FLOOD as u64 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the flood did not open {FLOOD} connections"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // `/health` answers all along, each poll on a fresh connection (30 s timeouts: hang
    // guards only, no speed asserted).
    let health = {
        let (stop, http) = (stop.clone(), node.http.clone());
        std::thread::spawn(move || {
            let (mut ok, mut bad) = (0u32, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let r = std::net::TcpStream::connect_timeout(&http.parse().unwrap(), Duration::from_secs(30)).and_then(
                    |mut s| {
                        s.set_read_timeout(Some(Duration::from_secs(30)))?;
                        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")?;
                        let mut r = String::new();
                        s.read_to_string(&mut r)?;
                        Ok(r)
                    },
                );
                match r {
                    Ok(r) if r.ends_with("ok\n") => ok += 1,
                    other => bad.push(format!("{:?} after {:?}", other, t.elapsed())),
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            (ok, bad)
        })
    };
    // A loader reads the whole dataset through the daemon, with the flood going on. Twice:
    // cold (the daemon fetches from the origin) and warm (from its cache).
    let mut failures = 0;
    for round in 0..2 {
        let out = dir.path().join(format!("out{round}"));
        let m = finish(reader(url, &node.sock, &out, &origin, 0));
        assert_eq!(std::fs::read_to_string(&out).unwrap(), want, "round {round}");
        failures += u(&m["daemon_failures"]);
    }
    let flood_reopened = reopened.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    let (ok, bad) = health.join().unwrap();
    let s = node.stats();
    assert_eq!(failures, 0, "loaders failed over to direct reads under the flood: {s}");
    assert!(
        bad.is_empty(),
        "/health failed {} times ({ok} answered): {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
    assert!(ok > 0);
    let refused = &s["connections_refused"];
    assert_eq!(u(&refused["local"]), 0, "{s}");
    assert_eq!(u(&refused["http"]), 0, "{s}");
    // The flood was bounded (per address, then closed after the handshake timeout).
    assert!(u(&refused["handshake"]) > 0, "{s}");
    assert!(flood_reopened > 0, "the daemon closed none of the idle connections");
}

/// Regression: a daemon without RAMJET_API_KEY listened on any address it was given, and held
/// an unbounded number of datasets and connections.
#[test]
fn a_daemon_without_a_key_stays_on_loopback_and_bounds_datasets_and_connections() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(ramjet_bin())
        .args(["serve", "--socket", dir.path().join("x.sock").to_str().unwrap()])
        .args([
            "--cache-dir",
            dir.path().join("c").to_str().unwrap(),
            "--listen",
            "0.0.0.0:0",
        ])
        .env_remove("RAMJET_API_KEY")
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("without an API key"), "{}", text(&o));
    // Two datasets, one held at a time; two connections at most.
    let urls: Vec<String> = (0..2)
        .map(|i| {
            let u = s3_prefix(&format!("bounds{i}"));
            ramjet_ok(&["pack", synth_dataset(4).to_str().unwrap(), &u]);
            u
        })
        .collect();
    let mut cfg = ramjet_transport::DaemonConfig::new(
        dir.path().join("b.sock"),
        CacheConfig::new(dir.path().join("cache"), 1 << 30),
    );
    cfg.datasets_open_max = 1;
    cfg.connections_max = 2;
    cfg.http = Some("127.0.0.1:0".parse().unwrap());
    let d = ramjet_transport::Daemon::start(cfg).unwrap();
    let client = DaemonClient::new(d.socket());
    for u in &urls {
        let ds = block_on(Dataset::open(u)).unwrap();
        let id = shard_ids(u)[0];
        client
            .fetch(&ShardRequest {
                manifest_url: ds.manifest_url(),
                shard: 0,
                id,
                keep: false,
                split: false,
                reader: None,
                job: "",
            })
            .unwrap();
        assert_eq!(d.datasets_open(), 1);
    }
    // HTTP has a budget of two of its own (the client's local connection is not in it): hold
    // two open, and the third is closed.
    let http_addr = d.http_addr().unwrap().to_string();
    let _held = std::net::TcpStream::connect(&http_addr).unwrap();
    let _held2 = std::net::TcpStream::connect(&http_addr).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let r = http(
        &http_addr,
        "GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    );
    assert!(r.is_empty(), "a connection beyond connections_max was served: {r}");
    assert!(u(&serde_json::to_value(d.stats()).unwrap()["connections_refused"]["http"]) > 0);
    drop(_held);
    std::thread::sleep(Duration::from_millis(200));
    let r = http(
        &http_addr,
        "GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    );
    assert!(r.ends_with("ok\n"), "{r}");
}

fn ready(n: &Node) -> (bool, serde_json::Value) {
    let r = http(&n.http, "GET /ready HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    let (head, body) = r.split_once("\r\n\r\n").expect("an HTTP answer");
    (
        head.starts_with("HTTP/1.1 200"),
        serde_json::from_str(body).expect("ReadyDoc JSON"),
    )
}

fn stats_wait(hosts: &[&str], timeout_s: &str) -> std::process::Output {
    Command::new(ramjet_bin())
        .args(["stats", "--wait", "--timeout", timeout_s])
        .args(hosts)
        .output()
        .expect("run ramjet stats --wait")
}

/// Regression: each `/ready` request handshook afresh with every member, so unauthenticated
/// requests amplified into handshakes (100 concurrent ones from 10 addresses made a peer refuse
/// 42,419, and the daemon's real fetches then failed). Now `/ready` answers from the last
/// background probe: 100 requests from 10 concurrent clients all answer 200, and the peer sees
/// a handful of handshakes (one a probe period), not one a request.
#[test]
fn concurrent_ready_requests_cost_the_peers_one_probe_a_period_not_a_handshake_each() {
    let dir = tempfile::tempdir().unwrap();
    let members = names(2, 50);
    let origin = s3().endpoint.clone();
    let key = [("RAMJET_API_KEY", "a-key-of-at-least-16-bytes")];
    let a = start_node(dir.path(), &members[0], &members, &origin, &key);
    let b = start_node(dir.path(), &members[1], &members, &origin, &key);
    let handshakes = || {
        let r = http(
            &b.http,
            "GET /stats HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n",
        );
        let body = r.split_once("\r\n\r\n").expect("an HTTP answer").1.to_owned();
        u(&serde_json::from_str::<serde_json::Value>(&body).unwrap()["handshakes"])
    };
    let before = handshakes();
    let t0 = Instant::now();
    let threads: Vec<_> = (0..10)
        .map(|_| {
            let addr = a.http.clone();
            std::thread::spawn(move || {
                (0..10)
                    .map(|_| http(&addr, "GET /ready HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"))
                    .filter(|r| r.starts_with("HTTP/1.1 200"))
                    .count()
            })
        })
        .collect();
    let ok: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let secs = t0.elapsed().as_secs_f64();
    let made = handshakes() - before;
    assert!(ok >= 90, "{ok} of 100 /ready requests answered 200");
    // One handshake a probe period (2 s), plus the real traffic's none.
    let most = (secs / 2.0).ceil() as u64 + 2;
    assert!(
        made <= most,
        "{made} handshakes at the peer for 100 /ready requests in {secs:.1} s (at most {most})"
    );
    let (ok, doc) = ready(&a);
    assert!(ok, "{doc}");
}

/// `/ready` and `ramjet stats --wait` (what the Slurm launcher waits on): a member that is not
/// up and a member with another key are each named, and the wait ends once every daemon has
/// completed an authenticated handshake with every other.
#[test]
fn ready_names_a_missing_peer_and_a_wrong_key_and_the_wait_ends_when_the_ring_is_complete() {
    let dir = tempfile::tempdir().unwrap();
    let members = names(3, 31);
    let origin = s3().endpoint.clone();
    let key = [("RAMJET_API_KEY", "alpha")];
    let a = start_node(dir.path(), &members[0], &members, &origin, &key);
    let b = start_node(dir.path(), &members[1], &members, &origin, &key);

    // The third member is not up.
    let (ok, doc) = ready(&a);
    assert!(!ok, "{doc}");
    assert_eq!(doc["peers"][&members[1]], serde_json::Value::Null, "{doc}");
    let why = doc["peers"][&members[2]].as_str().unwrap_or("");
    assert!(why.contains("connect"), "{doc}");
    let nobody = format!("127.0.0.33:{}", free_port("127.0.0.33"));
    let out = stats_wait(&[&a.http, &b.http, &nobody], "1");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("gave up") && err.contains(&nobody) && err.contains("not answering"),
        "{err}"
    );
    assert!(err.contains(&format!("peer {}", members[2])), "{err}");

    // It comes up with another key: named as refused, on both sides.
    let c = start_node(
        dir.path(),
        &members[2],
        &members,
        &origin,
        &[("RAMJET_API_KEY", "bravo")],
    );
    let (ok, doc) = ready(&a);
    assert!(!ok, "{doc}");
    let why = doc["peers"][&members[2]].as_str().unwrap_or("");
    assert!(why.contains("refused") || why.contains("API key"), "{doc}");
    let out = stats_wait(&[&a.http, &b.http, &c.http], "1");
    assert!(!out.status.success());
    drop(c);

    // With the right key the ring is complete, and the wait ends (the same members and version
    // everywhere, as many as the daemons named).
    let c = start_node(dir.path(), &members[2], &members, &origin, &key);
    let out = stats_wait(&[&a.http, &b.http, &c.http], "30");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("ring ready") && err.contains("3 members"), "{err}");
    for n in [&a, &b, &c] {
        let (ok, doc) = ready(n);
        assert!(ok, "{doc}");
        assert_eq!(doc["members"].as_array().unwrap().len(), 3);
    }
    // Two daemons named for a ring of three is not complete.
    let out = stats_wait(&[&a.http, &b.http], "1");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("3 members"), "{err}");
}

/// An MDS dataset (`index.json` version 2, uncompressed `.mds` shards of a `jpeg` and an
/// `int` column, the layout MosaicML's MDSWriter writes) of the synthetic images, on S3,
/// indexed in place by `ramjet index`. Returns its URL and its shard count.
/// An MDS dataset in S3, written as MDSWriter lays it out; with a ramjet manifest beside it
/// when `indexed` (`ramjet index`), else read as it is (the index learned on first open).
fn mds_dataset(indexed: bool) -> (String, usize) {
    let url = s3_prefix("cluster-mds");
    let store = ramjet_engine::Store::open(&url).unwrap();
    let mut images: Vec<PathBuf> = std::fs::read_dir(synth_dataset(N).join("images"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    images.sort();
    let config = br#"{"column_encodings":["jpeg","int"],"column_names":["image","label"],"column_sizes":[null,8],"compression":null,"format":"mds","hashes":[],"size_limit":67108864,"version":2}"#;
    let mut shards = Vec::new();
    for (k, chunk) in images.chunks(10).enumerate() {
        let samples: Vec<Vec<u8>> = chunk
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let img = std::fs::read(p).unwrap();
                let mut s = (img.len() as u32).to_le_bytes().to_vec();
                s.extend_from_slice(&img);
                s.extend_from_slice(&((k * 10 + i) as i64).to_le_bytes());
                s
            })
            .collect();
        let n = samples.len();
        let mut file = (n as u32).to_le_bytes().to_vec();
        // Offsets: the start of every sample, then the end of the last.
        let mut at = (4 + 4 * (n + 1) + config.len()) as u32;
        for s in &samples {
            file.extend_from_slice(&at.to_le_bytes());
            at += s.len() as u32;
        }
        file.extend_from_slice(&at.to_le_bytes());
        file.extend_from_slice(config);
        for s in &samples {
            file.extend_from_slice(s);
        }
        let name = format!("shard.{k:05}.mds");
        shards.push(serde_json::json!({
            "column_encodings": ["jpeg", "int"], "column_names": ["image", "label"], "column_sizes": [null, 8],
            "compression": null, "format": "mds", "hashes": [], "samples": n, "size_limit": 67108864, "version": 2,
            "raw_data": {"basename": name, "bytes": file.len(), "hashes": {}}, "zip_data": null,
        }));
        block_on(store.put(&name, file.into())).unwrap();
    }
    let index = serde_json::json!({"version": 2, "shards": shards});
    block_on(store.put("index.json", serde_json::to_vec(&index).unwrap().into())).unwrap();
    if indexed {
        ramjet_ok(&["index", &url]);
    }
    (url, shards.len())
}

#[test]
fn a_foreign_dataset_crosses_from_the_origin_once_through_the_ring() {
    foreign_dataset_through_the_ring(true);
}

/// Without `ramjet index`: the first open on a host learns the index. The readers' is learned
/// by the reference read; each daemon has an index folder of its own, empty, and learns the
/// source when first asked for it. From then on the daemons, their ring and the readers name
/// the dataset by its `index.json` and read it as they read an indexed one.
#[test]
fn a_foreign_dataset_read_without_ramjet_index_crosses_from_the_origin_once_through_the_ring() {
    foreign_dataset_through_the_ring(false);
}

fn foreign_dataset_through_the_ring(indexed: bool) {
    let (url, shards) = mds_dataset(indexed);
    let d = tempfile::tempdir().unwrap();
    let want_path = d.path().join("ref.txt");
    ramjet_ok(&[
        "stream",
        &url,
        "--shuffle",
        "none",
        "--out",
        want_path.to_str().unwrap(),
    ]);
    let want = std::fs::read_to_string(&want_path).unwrap();
    assert_eq!(want.lines().count(), N);
    let proxy = CountingProxy::start(&s3_upstream());
    let members = names(2, 40);
    let index_dirs: Vec<PathBuf> = members.iter().map(|m| d.path().join(format!("index-{m}"))).collect();
    let nodes: Vec<Node> = members
        .iter()
        .zip(&index_dirs)
        .map(|(m, ix)| {
            let env = [("RAMJET_INDEX_DIR", ix.to_str().unwrap())];
            start_node(d.path(), m, &members, &proxy.url, if indexed { &[] } else { &env })
        })
        .collect();
    proxy.reset();
    let outs: Vec<PathBuf> = (0..2).map(|i| d.path().join(format!("out{i}"))).collect();
    let readers: Vec<Child> = nodes
        .iter()
        .zip(&outs)
        .map(|(n, o)| reader(&url, &n.sock, o, &proxy.url, 0))
        .collect();
    for m in readers.into_iter().map(finish) {
        assert_eq!(u(&m["daemon_failures"]), 0, "{m}");
    }
    for o in &outs {
        assert_eq!(
            std::fs::read_to_string(o).unwrap(),
            want,
            "a reader delivered other samples"
        );
    }
    // Every foreign shard crossed from the origin once for the cluster, and each daemon holds
    // its ring share of them, transcoded. Without `ramjet index`, each daemon's host also read
    // every shard once to learn the index: once, though both readers asked it at once.
    let learning = if indexed { 0 } else { nodes.len() * shards };
    assert_eq!(
        proxy.count("GET", ".mds"),
        shards + learning,
        "origin GETs of {shards} MDS shards, {learning} of them to learn the index"
    );
    for ix in index_dirs.iter().filter(|_| !indexed) {
        let learned = std::fs::read_dir(ix).map(|r| r.count()).unwrap_or(0);
        assert_eq!(learned, 1, "{}: the daemon's learned manifest", ix.display());
    }
    let held: u64 = nodes.iter().map(|n| u(&n.stats()["cache_shards"])).sum();
    assert_eq!(held, shards as u64);
    proxy.reset();
    finish(reader(&url, &nodes[1].sock, &d.path().join("again"), &proxy.url, 0));
    assert_eq!(proxy.count("GET", ".mds"), 0, "a warm cluster went to the origin");
    // Nothing was written beside the data without `ramjet index`.
    let beside = block_on(ramjet_engine::Store::open(&url).unwrap().size("manifest.json"));
    assert_eq!(beside.is_ok(), indexed, "a manifest beside the data: {beside:?}");
}

/// The daemon answers only loaders of its own user (or root): a process of another user that
/// reaches its socket (here the socket is opened to everyone on purpose, past the 0600 mode
/// that normally stops it first) gets no reply and its connection closed, and the refusal is
/// counted; the same request from this user is served.
#[test]
fn the_daemon_refuses_a_loader_of_another_user() {
    use std::os::unix::fs::PermissionsExt;
    if !ramjet_transport::sys::root_or_skip("run a loader as another user") {
        return;
    }
    let url = dataset();
    let ids = shard_ids(url);
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let sock = dir.path().join("d.sock");
    let host = ramjet_transport::ensure_daemon(&sock, CacheConfig::new(dir.path().join("cache"), 1 << 30)).unwrap();
    let daemon = host.embedded.as_ref().expect("an embedded daemon");
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o777)).unwrap();
    let ds = block_on(Dataset::open(url)).unwrap();
    let get = wire::encode(&wire::Msg::Get {
        manifest_url: ds.manifest_url().to_owned(),
        shard: 0,
        checksum: ids[0].checksum,
        bytes: ids[0].bytes,
        keep: false,
        split: false,
        reader: None,
        job: None,
    });
    // Everything the child needs is made before the fork: it only makes system calls.
    // SAFETY: a zeroed sockaddr_un is a valid value; the path is copied in below.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let path = sock.as_os_str().as_encoded_bytes();
    assert!(path.len() < addr.sun_path.len());
    for (d, s) in addr.sun_path.iter_mut().zip(path) {
        *d = *s as libc::c_char;
    }
    // SAFETY: the child makes plain system calls on memory prepared before the fork and leaves
    // with _exit; it never returns into the harness. Its exit code is what it saw:
    // 0 = the connection closed with no reply; 1 = a reply came; 2..5 = it could not try.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: see above.
        unsafe {
            if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                libc::_exit(2);
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if fd < 0 {
                libc::_exit(3);
            }
            let tv = libc::timeval { tv_sec: 20, tv_usec: 0 };
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            );
            let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
            if libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len) != 0 {
                libc::_exit(4);
            }
            // The write may fail once the daemon has closed the connection: either way, no reply.
            libc::send(fd, get.as_ptr().cast(), get.len(), libc::MSG_NOSIGNAL);
            let mut b = [0u8; 64];
            let n = libc::recv(fd, b.as_mut_ptr().cast(), b.len(), 0);
            libc::_exit(match n {
                0 => 0,
                n if n > 0 => 1,
                _ if *libc::__errno_location() == libc::ECONNRESET => 0,
                _ => 5,
            });
        }
    }
    let mut status = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // SAFETY: reaps our own child without blocking.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        if Instant::now() > deadline {
            // SAFETY: ends and reaps our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            panic!("the other user's loader did not finish in 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the other user's loader (uid 65534) got a reply, or could not ask (2 setuid, 3 socket, 4 connect, 5 recv error)"
    );
    assert_eq!(daemon.stats().requests_refused, 1, "the refusal is counted");
    // The same request from this user is served.
    let got = host
        .client
        .fetch(&ShardRequest {
            manifest_url: ds.manifest_url(),
            shard: 0,
            id: ids[0],
            keep: false,
            split: false,
            reader: None,
            job: "",
        })
        .unwrap();
    assert_eq!(got.bytes.len() as u64, ids[0].bytes);
    assert_eq!(daemon.stats().requests_refused, 1);
}

/// A daemon alive but stuck (it accepts and never answers) costs a loader its request timeout
/// (`RAMJET_DAEMON_TIMEOUT_MS`, here 300 ms), not the test's or the job's: each request gives
/// up, is counted, and the shard is read from the origin; every sample arrives, in order.
#[test]
fn a_stuck_daemon_costs_a_loader_its_request_timeout_and_nothing_else() {
    let url = dataset();
    let ids = shard_ids(url);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("stuck.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    listener.set_nonblocking(true).unwrap();
    let holder = std::thread::spawn(move || {
        let mut held = Vec::new();
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            match listener.accept() {
                Ok((c, _)) => held.push(c),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        held.len()
    });
    let client = std::sync::Arc::new(DaemonClient::new(&sock).with_timeout(Duration::from_millis(300)));
    let mut cfg = StreamConfig::new(url);
    cfg.provider = Some(client);
    let start = Instant::now();
    let mut s = Stream::open(cfg).unwrap();
    let mut got = Vec::new();
    while let Some(x) = s.next_sample().unwrap() {
        got.push(x.global_index);
    }
    let took = start.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let accepted = holder.join().unwrap();
    let m = s.metrics();
    got.sort_unstable();
    assert_eq!(got, (0..N as u64).collect::<Vec<_>>(), "every sample once");
    assert!(accepted >= 1, "the loader asked the stuck daemon");
    assert!(m.daemon_failures >= 1, "{m:?}");
    assert_eq!((m.daemon_origin, m.daemon_cache_local), (0, 0), "{m:?}");
    assert!(
        m.origin_bytes >= ids.iter().map(|i| i.bytes).sum::<u64>(),
        "every shard from the origin: {m:?}"
    );
    assert!(took < Duration::from_secs(60), "took {took:?}");
}

/// The body of `GET path` on `addr` (HTTP 200 asserted).
fn get_ok(addr: &str, path: &str) -> String {
    let r = http(
        addr,
        &format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"),
    );
    assert!(r.starts_with("HTTP/1.1 200"), "{addr}{path}: {r}");
    r.split_once("\r\n\r\n").unwrap().1.to_owned()
}

/// Every metric name the Grafana dashboard's queries use (`ramjet_...`).
fn grafana_metrics() -> std::collections::BTreeSet<String> {
    let p = ramjet_tests::repo_root().join("tools/grafana/ramjet.json");
    let d: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let mut names = std::collections::BTreeSet::new();
    let panels = d["panels"].as_array().expect("panels");
    assert!(!panels.is_empty());
    let mut ids = std::collections::BTreeSet::new();
    for p in panels {
        assert!(ids.insert(p["id"].as_u64().expect("a panel id")), "panel ids repeat");
        assert!(p["gridPos"]["w"].as_u64().is_some() && p["title"].is_string(), "{p}");
        for t in p["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().expect("expr");
            assert!(t["refId"].is_string(), "{t}");
            let mut rest = expr;
            while let Some(i) = rest.find("ramjet_") {
                let tail = &rest[i..];
                let end = tail
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(tail.len());
                names.insert(tail[..end].to_owned());
                rest = &tail[end..];
            }
        }
    }
    names
}

/// Issue 44: two daemons in a ring and a reader through the first. Either daemon's
/// `/cluster` lists both members and the reader (its heartbeat: dataset, position, rate, the
/// split of its time); the first keeps the reader's history (`/jobs`) and exports it on
/// `/metrics` (OpenMetrics, through prometheus-client), where every metric the Grafana
/// dashboard queries is found. A stopped daemon is shown down within 10 s, naming why.
#[test]
fn the_cluster_view_lists_every_member_and_reader_and_a_stopped_daemon_goes_down() {
    let url = dataset();
    let dir = tempfile::tempdir().unwrap();
    let members = names(2, 41);
    let a = start_node(dir.path(), &members[0], &members, &s3().endpoint, &[]);
    let b = start_node(dir.path(), &members[1], &members, &s3().endpoint, &[]);
    let out = dir.path().join("r.txt");
    // 120 samples at 60 ms each: about 7 s, three heartbeats or more.
    let r = reader(url, &a.sock, &out, &s3().endpoint, 60);
    let t0 = Instant::now();
    let doc = loop {
        let doc: serde_json::Value = serde_json::from_str(&get_ok(&b.http, "/cluster")).unwrap();
        let seen = doc["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|j| j["beat"]["samples"].as_u64() > Some(0));
        if seen {
            break doc;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no reader on the dashboard: {doc}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(doc["served_by"], members[1].as_str());
    let nodes = doc["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2, "{doc}");
    for n in nodes {
        assert!(members.contains(&n["name"].as_str().unwrap().to_owned()), "{n}");
        assert!(matches!(n["state"].as_str().unwrap(), "ready" | "up"), "{n}");
        assert_eq!(n["summary"]["cache_limit_bytes"], 1u64 << 30, "{n}");
    }
    let job = &doc["jobs"][0];
    assert_eq!(job["node"], members[0].as_str(), "{job}");
    assert_eq!(job["beat"]["dataset"], url, "{job}");
    let split: f64 = job["beat"]["split"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .sum();
    assert!((split - 1.0).abs() < 1e-3, "{job}");
    // The reader's own daemon keeps its history, and exports it.
    let jobs: serde_json::Value = serde_json::from_str(&get_ok(&a.http, "/jobs")).unwrap();
    assert!(!jobs[0]["history"].as_array().unwrap().is_empty(), "{jobs}");
    let metrics = get_ok(&a.http, "/metrics");
    assert!(metrics.ends_with("# EOF\n"), "{metrics}");
    assert!(metrics.contains("ramjet_job_data_wait_share{job="), "{metrics}");
    let exported: std::collections::BTreeSet<String> = metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect();
    for name in grafana_metrics() {
        assert!(
            exported.contains(&name),
            "the Grafana dashboard queries {name}, which /metrics lacks:\n{metrics}"
        );
    }
    // The page itself: served whole from the binary, nothing from elsewhere.
    let page = get_ok(&a.http, "/");
    assert!(page.contains("<title>ramjet cluster</title>") && !page.contains("http://") && !page.contains("https://"));
    finish(r);
    // Stop the second daemon: the first shows it down, with the reason.
    drop(b);
    let t0 = Instant::now();
    loop {
        let doc: serde_json::Value = serde_json::from_str(&get_ok(&a.http, "/cluster")).unwrap();
        let n = doc["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["name"] == members[1].as_str())
            .cloned()
            .unwrap();
        if n["state"] == "down" {
            assert!(n["error"].as_str().is_some_and(|e| !e.is_empty()), "{n}");
            assert_eq!(doc["down"], 1u64, "{doc}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "a stopped daemon is still {n}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Issue 67, item 5: a rank's own metrics show its job's pace across ranks. Two ranks of one
/// job, each on its own daemon, report heartbeats (rank 1 three times slower a step). Each
/// daemon first answers with its host's ranks alone; once it has gathered the ring's
/// consumers (every 5 s while a job spans hosts) it answers with the whole job: both ranks,
/// the slow one named, the skew, and the asking rank's step against the median.
#[test]
fn a_ranks_heartbeat_brings_back_its_jobs_pace_across_every_node() {
    let dir = tempfile::tempdir().unwrap();
    let members = names(2, 70);
    let nodes: Vec<Node> = members
        .iter()
        .map(|m| start_node(dir.path(), m, &members, &s3().endpoint, &[]))
        .collect();
    let beat = |rank: u32, step_s: f64| ramjet_engine::Heartbeat {
        consumer: format!("{}/{rank}.0", 1000 + rank),
        job: "pace-test".into(),
        dataset: "s3://b/d/manifest.json".into(),
        pid: 1000 + rank,
        rank,
        world: 2,
        workers: 1,
        samples: 100,
        samples_per_s: 8.0 / step_s,
        batches: 10,
        step_s,
        elapsed_s: 1.0,
        pace: true,
        ..Default::default()
    };
    let clients: Vec<DaemonClient> = nodes.iter().map(|n| DaemonClient::new(&n.sock)).collect();
    let ask = |rank: usize| {
        clients[rank]
            .heartbeat(&beat(rank as u32, [0.02, 0.06][rank]))
            .unwrap()
            .job
            .expect("a pace")
    };
    let first = ask(0);
    assert_eq!((first.scope.as_str(), first.ranks_seen), ("host", 1), "{first:?}");
    assert!((first.rank_step_s - 0.02).abs() < 1e-9, "{first:?}");
    // An older loader (no `pace`) gets the older answer.
    let old = ramjet_engine::Heartbeat {
        pace: false,
        ..beat(0, 0.02)
    };
    assert_eq!(clients[0].heartbeat(&old).unwrap().job, None);
    let t0 = Instant::now();
    let (p0, p1) = loop {
        let (p0, p1) = (ask(0), ask(1));
        if p0.scope == "cluster" && p1.scope == "cluster" {
            break (p0, p1);
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no cluster pace: {p0:?} {p1:?}");
        std::thread::sleep(Duration::from_millis(200));
    };
    for p in [&p0, &p1] {
        assert_eq!(p.ranks_seen, 2, "{p:?}");
        assert_eq!(p.skew.slowest_rank, Some(1), "{p:?}");
        assert!(
            (p.skew.step_s_max - 0.06).abs() < 1e-9 && (p.skew.step_s_min - 0.02).abs() < 1e-9,
            "{p:?}"
        );
        assert!(p.skew.skew > 0.6, "{p:?}");
        assert_eq!(p.skew.ranks.len(), 2);
        assert!(p.age_s < 15.0);
    }
    assert!((p0.rank_step_s - 0.02).abs() < 1e-9 && (p1.rank_step_s - 0.06).abs() < 1e-9);
    let m = p0.metrics();
    assert_eq!(m["job_scope"], "cluster");
    assert_eq!(m["job_slowest_rank"], 1);
    assert!(
        (m["step_vs_median"].as_f64().unwrap() - 0.02 / 0.06).abs() < 1e-9,
        "{m:?}"
    );
}
