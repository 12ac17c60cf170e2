//! The RDMA transport's negotiation, on hosts without RDMA hardware (this project's CI): a
//! daemon asked for RDMA without a device refuses to start with a clear error, and an owner
//! without RDMA answers `rdma_connect` and `get_rdma` with `fail`, which sends requesters to TCP.
//! The requester's side runs on a stand-in for the verbs layer (no device here): against an
//! owner without RDMA it asks once, is told no, and reads that owner's shards over TCP, whole
//! and verified. The RDMA data path itself awaits hardware (docs/cluster.md).

use std::time::Duration;

use ramjet_engine::cache::CacheConfig;
use ramjet_transport::wire::{self, Msg, QpInfo};
use ramjet_transport::{Daemon, DaemonConfig, TransportKind};

fn config(dir: &std::path::Path) -> DaemonConfig {
    let mut cfg = DaemonConfig::new(dir.join("sock"), CacheConfig::new(dir.join("cache"), 1 << 30));
    cfg.api_key = None;
    cfg.threads = 1;
    cfg
}

#[test]
fn a_daemon_asked_for_rdma_without_a_device_refuses_to_start() {
    // On a host with RDMA devices, a device that does not exist stands for "none": the test
    // checks the refusal either way, never returns early.
    let has_rdma = std::path::Path::new("/sys/class/infiniband").exists();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.transport = TransportKind::Rdma {
        device: has_rdma.then(|| "ramjet_no_such_device".to_owned()),
        gid_index: 0,
    };
    let e = Daemon::start(cfg).err().expect("no RDMA device, no daemon").to_string();
    assert!(e.contains("RDMA"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_without_rdma_says_so_and_keeps_serving_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.listen = Some("127.0.0.1:0".parse().unwrap());
    let d = tokio::task::spawn_blocking(move || Daemon::start(cfg).unwrap())
        .await
        .unwrap();
    let addr = d.peer_addr().unwrap();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    wire::connect(&mut s, None).await.unwrap();

    let qp = QpInfo {
        qpn: 7,
        psn: 1,
        lid: 0,
        gid: "fe80::1".into(),
    };
    wire::write_msg(&mut s, &Msg::RdmaConnect(qp)).await.unwrap();
    match tokio::time::timeout(Duration::from_secs(5), wire::read_msg(&mut s))
        .await
        .unwrap()
        .unwrap()
    {
        Msg::Fail { message } => assert!(message.contains("RDMA"), "{message}"),
        m => panic!("expected fail, got {m:?}"),
    }

    // A get_rdma on a connection without a link is refused (the request is not even valid:
    // the manifest does not exist), and the connection stays usable for TCP gets.
    let get_rdma = Msg::GetRdma {
        manifest_url: "file:///nonexistent/x/manifest.json".into(),
        shard: 0,
        checksum: 1,
        bytes: 10,
        addr: 4096,
        rkey: 1,
    };
    wire::write_msg(&mut s, &get_rdma).await.unwrap();
    assert!(matches!(wire::read_msg(&mut s).await.unwrap(), Msg::Fail { .. }));
    let get = Msg::Get {
        manifest_url: "file:///nonexistent/manifest.json".into(),
        shard: 0,
        checksum: 1,
        bytes: 10,
        keep: false,
        split: false,
        reader: None,
        job: None,
    };
    wire::write_msg(&mut s, &get).await.unwrap();
    match wire::read_msg(&mut s).await.unwrap() {
        Msg::Fail { message } => assert!(message.contains("manifest"), "{message}"),
        m => panic!("expected fail, got {m:?}"),
    }
    drop(s);
    tokio::task::spawn_blocking(move || drop(d)).await.unwrap();
}

/// A stand-in for an RDMA device: queue pairs that are never connected, and a count of how
/// many the requester asked for. Registering memory must never happen against an owner that
/// has no RDMA.
#[cfg(feature = "rdma")]
#[derive(Default)]
struct NoHardware {
    endpoints: std::sync::atomic::AtomicUsize,
}

#[cfg(feature = "rdma")]
struct UnconnectedQp;

#[cfg(feature = "rdma")]
impl ramjet_transport::rdma::LinkEndpoint for UnconnectedQp {
    fn info(&self) -> QpInfo {
        QpInfo {
            qpn: 7,
            psn: 1,
            lid: 0,
            gid: "fe80::1".into(),
        }
    }
    fn connect(&self, _remote: &QpInfo) -> Result<(), ramjet_transport::Error> {
        panic!("an owner without RDMA answered with a queue pair")
    }
}

#[cfg(feature = "rdma")]
impl ramjet_transport::rdma::Verbs for NoHardware {
    fn endpoint(&self) -> Result<std::sync::Arc<dyn ramjet_transport::rdma::LinkEndpoint>, ramjet_transport::Error> {
        self.endpoints.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(std::sync::Arc::new(UnconnectedQp))
    }
    unsafe fn register_for_write(
        &self,
        _ptr: *const u8,
        _len: usize,
    ) -> Result<(u32, Box<dyn Send>), ramjet_transport::Error> {
        panic!("memory registered for an owner without RDMA")
    }
}

#[cfg(feature = "rdma")]
/// A one-shard dataset in `dir`: its manifest path and the shard's bytes.
fn one_shard_dataset(dir: &std::path::Path) -> (String, Vec<u8>, u64) {
    use ramjet_engine::format::{ColumnType, Manifest, Schema, ShardBuilder, ShardInfo, Value};
    let schema = Schema::new([("x", ColumnType::Bytes)]).unwrap();
    let mut b = ShardBuilder::new(schema.clone());
    for i in 0..50u32 {
        b.push(&[Value::Bytes(i.to_le_bytes().repeat(300))], "t").unwrap();
    }
    let s = b.finish();
    let key = ramjet_engine::format::shard_key(0, s.checksum);
    std::fs::create_dir_all(dir.join("shards")).unwrap();
    std::fs::write(dir.join(&key), &s.bytes).unwrap();
    let m = Manifest::new(
        "test",
        schema,
        Default::default(),
        vec![ShardInfo {
            key,
            bytes: s.bytes.len() as u64,
            samples: s.samples,
            checksum: s.checksum.into(),
            columns: None,
            foreign: None,
        }],
    );
    let path = dir.join("manifest.json");
    std::fs::write(&path, m.to_bytes()).unwrap();
    (format!("file://{}", path.display()), s.bytes, s.checksum)
}

/// Regression for a claim of docs/cluster.md (only the owner's answer was tested): a
/// requester that has RDMA, against an owner that has none, asks once, hears `fail`, and reads
/// the shard over TCP, whole; it asks no more until the peer is forgotten.
#[cfg(feature = "rdma")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requester_falls_back_to_tcp_against_an_owner_without_rdma() {
    use ramjet_transport::peer::{LinkConfig, PeerTransport, ShardGet};
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let (manifest, shard, checksum) = one_shard_dataset(&dir.path().join("ds"));
    let mut cfg = config(dir.path());
    cfg.listen = Some("127.0.0.1:0".parse().unwrap());
    let d = tokio::task::spawn_blocking(move || Daemon::start(cfg).unwrap())
        .await
        .unwrap();
    let peer = d.peer_addr().unwrap().to_string();
    let verbs = std::sync::Arc::new(NoHardware::default());
    let t = ramjet_transport::rdma::RdmaTransport::with_verbs(
        LinkConfig {
            api_key: None,
            peer_timeout: Duration::from_secs(5),
            reply_timeout: Duration::from_secs(30),
            transfer_min_bytes_per_s: ramjet_transport::peer::TRANSFER_MIN_BYTES_PER_S_DEFAULT,
        },
        verbs.clone(),
    );
    let get = ShardGet {
        manifest_url: manifest,
        shard: 0,
        checksum,
        bytes: shard.len() as u64,
        what: "shard 0".into(),
        keep: false,
    };
    for round in 0..2 {
        let got = tokio::time::timeout(Duration::from_secs(60), t.fetch(&peer, &get))
            .await
            .expect("no answer in 60 s")
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(&got[..], &shard[..], "round {round}: the shard came whole over TCP");
        assert_eq!(
            verbs.endpoints.load(Ordering::SeqCst),
            1,
            "asked for RDMA once, then remembered the answer"
        );
    }
    t.forget(&peer);
    let got = t.fetch(&peer, &get).await.unwrap();
    assert_eq!(&got[..], &shard[..]);
    assert_eq!(
        verbs.endpoints.load(Ordering::SeqCst),
        2,
        "a forgotten peer is asked again"
    );
    tokio::task::spawn_blocking(move || drop(d)).await.unwrap();
}
