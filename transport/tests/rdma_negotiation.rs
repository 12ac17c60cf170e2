//! The RDMA transport's negotiation, on hosts without RDMA hardware (this project's CI): a
//! daemon asked for RDMA without a device refuses to start with a clear error, and an owner
//! without RDMA answers `rdma_connect` and `get_rdma` with `fail`, which sends requesters to TCP.
//! The RDMA data path itself awaits hardware (docs/cluster.md).

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
    };
    wire::write_msg(&mut s, &get).await.unwrap();
    match wire::read_msg(&mut s).await.unwrap() {
        Msg::Fail { message } => assert!(message.contains("manifest"), "{message}"),
        m => panic!("expected fail, got {m:?}"),
    }
    drop(s);
    tokio::task::spawn_blocking(move || drop(d)).await.unwrap();
}
