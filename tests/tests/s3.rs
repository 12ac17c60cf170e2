//! Packing to and verifying on the real local S3 server (SeaweedFS), damage done to real
//! objects, and origin faults (HTTP 503, stalls, wrong keys) injected by a TCP proxy.

use std::time::{Duration, Instant};

use bytes::Bytes;
use ramjet_engine::format::{Manifest, ShardView};
use ramjet_engine::Store;
use ramjet_tests::{
    block_on, json_of, ramjet, ramjet_fails_naming, ramjet_ok, s3, s3_prefix, synth_dataset, text, CountingProxy,
    Fault, FaultProxy,
};

const N: usize = 90;

/// Packs the synthetic set to a fresh S3 prefix, forcing multipart uploads.
fn packed(name: &str) -> (String, Manifest) {
    s3();
    let url = s3_prefix(name);
    let src = synth_dataset(N);
    let o = ramjet(
        &["pack", src.to_str().unwrap(), &url, "--shard-size", "6MiB"],
        // Parts are at least 5 MiB: a 6 MiB shard goes up in two parts.
        &[("RAMJET_MULTIPART_THRESHOLD_BYTES", "1048576")],
    );
    assert!(o.status.success(), "{}", text(&o));
    let store = Store::open(&url).unwrap();
    let m = Manifest::parse(&block_on(store.get("manifest.json")).unwrap(), "manifest.json").unwrap();
    (url, m)
}

/// A dataset on S3 whose shards are listed in a binary shard table reads like the same dataset
/// listed in its JSON under every shuffle, from the origin and from a disk cache (the table's
/// blocks are read with ranged GETs from the stream's runtime threads, its cache tasks and the
/// consumer's thread); a flipped byte in a block of records is then found by the stream and by
/// `verify`, each naming the table and the block.
#[test]
fn a_shard_table_on_s3_is_read_a_block_at_a_time() {
    s3();
    let src = synth_dataset(N);
    let (listed, tabled) = (s3_prefix("listed"), s3_prefix("tabled"));
    for (url, mode) in [(&listed, "never"), (&tabled, "always")] {
        ramjet_ok(&[
            "pack",
            src.to_str().unwrap(),
            url,
            "--shard-size",
            "160KiB",
            "--shard-table",
            mode,
        ]);
    }
    let cache = tempfile::tempdir().unwrap();
    // Every sample in order: one line each (epoch, position, stream, shard, index, global index,
    // record length; each record was verified against its checksum), so the comparison covers
    // which samples came in which order, not only counts.
    let stream = |url: &str, shuffle: &str, cached: bool| {
        let out = cache.path().join("samples.txt");
        let _ = std::fs::remove_file(&out);
        let mut args = vec![
            "stream",
            url,
            "--shuffle",
            shuffle,
            "--json",
            "--out",
            out.to_str().unwrap(),
        ];
        if cached {
            args.extend(["--cache-dir", cache.path().to_str().unwrap()]);
        }
        let v = json_of(&ramjet_ok(&args));
        (
            v["samples"].clone(),
            v["sample_bytes"].clone(),
            std::fs::read_to_string(&out).unwrap(),
        )
    };
    // The samples without their positions, sorted: the same samples, whatever the order.
    let samples = |lines: &str| {
        let mut v: Vec<String> = lines
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                [&f[..1], &f[2..]].concat().join(" ")
            })
            .collect();
        v.sort();
        v
    };
    for shuffle in ["none", "block", "global"] {
        let want = stream(&listed, shuffle, false);
        assert_eq!(want.0, N as u64, "{shuffle}");
        assert_eq!(want.2.lines().count(), N, "{shuffle}");
        let origin = stream(&tabled, shuffle, false);
        assert_eq!((&origin.0, &origin.1), (&want.0, &want.1), "{shuffle}, from the origin");
        assert_eq!(samples(&origin.2), samples(&want.2), "{shuffle}: other samples");
        // The two manifests differ (the listing), so their versions, and with them the seeds
        // of the shuffled orders, differ: the order itself is compared where it must agree,
        // unshuffled, and for the same dataset from the origin and through the cache.
        if shuffle == "none" {
            assert_eq!(origin.2, want.2, "unshuffled: another order");
        }
        assert_eq!(stream(&tabled, shuffle, true), origin, "{shuffle}, through the cache");
    }
    ramjet_ok(&["verify", &tabled]);
    // A byte of shard 1's record, rewritten in place on the server.
    let store = Store::open(&tabled).unwrap();
    let m = Manifest::parse(&block_on(store.get("manifest.json")).unwrap(), "manifest.json").unwrap();
    let key = m.table_ref().unwrap().key.clone();
    let mut raw = block_on(store.get(&key)).unwrap().to_vec();
    raw[ramjet_engine::format::shard_table_head_len(m.shard_count() as u64) as usize + 48] ^= 1;
    block_on(store.put(&key, Bytes::from(raw))).unwrap();
    ramjet_fails_naming(
        &["stream", &tabled, "--shuffle", "global"],
        &[&key, "block 0", "checksum"],
    );
    verify_fails_naming(&tabled, &[&key, "block 0"]);
}

/// On a slow link (the origin's answers throttled to 256 KiB/s, so each 512 KiB shard of tiny
/// rows takes two seconds) the first samples do not wait for the first whole shard: past the
/// first 64, samples go on being read one by one while it downloads, and every sample still
/// comes exactly once.
#[test]
fn on_a_slow_link_samples_are_read_one_by_one_until_the_first_shard_arrives() {
    s3();
    let url = s3_prefix("slow");
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("rows.jsonl");
    let rows: String = (0..20_000)
        .map(|i| format!("{{\"id\": {i}, \"text\": \"row {i}\"}}\n"))
        .collect();
    std::fs::write(&src, rows).unwrap();
    ramjet_ok(&["pack", src.to_str().unwrap(), &url, "--shard-size", "512KiB"]);
    let proxy = FaultProxy::start(&upstream(), Fault::Throttle(256 << 10), usize::MAX);
    let o = ramjet(
        &["stream", &url, "--shuffle", "none", "--json"],
        &[("AWS_ENDPOINT_URL", &proxy.url)],
    );
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let out = String::from_utf8_lossy(&o.stdout);
    let m = json_of(&out);
    assert_eq!(m["samples"], 20_000u64, "{t}");
    let ranged = m["ranged_samples"].as_u64().unwrap();
    assert!(
        ranged > 64,
        "only {ranged} samples were read one by one before the first shard: {t}"
    );
}

/// A stream opens its first batch's connections while it reads the manifest: 8 HEADs of the
/// manifest go out (RAMJET_PRECONNECT), none with RAMJET_PRECONNECT=0, and none for commands
/// that do not stream.
#[test]
fn a_stream_opens_its_connections_while_it_reads_the_manifest() {
    let (url, _) = packed("preconnect");
    let proxy = CountingProxy::start(&upstream());
    let heads = |env: &[(&str, &str)], args: &[&str]| {
        proxy.reset();
        let mut e = vec![("AWS_ENDPOINT_URL", proxy.url.as_str())];
        e.extend_from_slice(env);
        let o = ramjet(args, &e);
        assert!(o.status.success(), "{}", text(&o));
        // The HEADs run in the background: give the last of them a moment to be counted.
        let t0 = Instant::now();
        while proxy.count("HEAD", "manifest.json") < 8 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        (
            proxy.count("HEAD", "manifest.json"),
            proxy.count("GET", "manifest.json"),
        )
    };
    let stream = ["stream", &url, "--limit", "8", "--json"];
    assert_eq!(heads(&[], &stream), (8, 1));
    assert_eq!(heads(&[("RAMJET_PRECONNECT", "0")], &stream), (0, 1));
    assert_eq!(heads(&[], &["inspect", &url]), (0, 1));
}

fn verify_fails_naming(url: &str, needles: &[&str]) {
    let o = ramjet(&["verify", url], &[]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "verify should fail:\n{t}");
    for n in needles {
        assert!(t.contains(n), "verify output lacks {n:?}:\n{t}");
    }
}

#[test]
fn pack_multipart_then_verify_and_inspect_on_s3() {
    let (url, m) = packed("ok");
    assert_eq!(m.samples, N as u64);
    assert!(
        m.shards().map(Result::unwrap).any(|s| s.bytes > 5 << 20),
        "no shard large enough to be multipart"
    );
    let out = ramjet_ok(&["verify", &url]);
    assert!(
        out.contains("verify: OK") && out.contains(&format!("{N} samples")),
        "{out}"
    );
    let out = ramjet_ok(&["inspect", &format!("{url}/manifest.json")]);
    assert!(
        out.contains(&m.version) && out.contains(&format!("{url}/manifest.json")),
        "{out}"
    );
    // The version-named copy of the manifest is there too.
    let store = Store::open(&url).unwrap();
    assert!(block_on(store.size(&format!("manifests/{}.json", m.version))).is_ok());
}

#[test]
fn a_flipped_byte_in_an_s3_object_is_named_by_shard_and_sample() {
    let (url, m) = packed("flip");
    let store = Store::open(&url).unwrap();
    let key = &m.shard(0).unwrap().key;
    let mut b = block_on(store.get(key)).unwrap().to_vec();
    let view = ShardView::parse(&b, key).unwrap();
    let rec = view.record(5).unwrap();
    let off = rec.as_ptr() as usize - b.as_ptr() as usize + rec.len() / 2;
    b[off] ^= 0x01;
    block_on(store.put(key, Bytes::from(b))).unwrap();
    verify_fails_naming(
        &url,
        &[
            &format!("{url}/{key}"),
            "sample 5 (global 5)",
            "sample checksum mismatch",
        ],
    );
}

#[test]
fn a_truncated_s3_object_is_named() {
    let (url, m) = packed("trunc");
    let store = Store::open(&url).unwrap();
    let key = &m.shard(1).unwrap().key;
    let b = block_on(store.get(key)).unwrap();
    block_on(store.put(key, b.slice(..b.len() - 1000))).unwrap();
    verify_fails_naming(&url, &[key, "truncated"]);
}

#[test]
fn a_missing_s3_object_is_named() {
    let (url, m) = packed("missing");
    let store = Store::open(&url).unwrap();
    let key = &m.shard(0).unwrap().key;
    block_on(store.delete(key)).unwrap();
    verify_fails_naming(&url, &["missing object", &format!("{url}/{key}")]);
}

#[test]
fn a_schema_mismatch_on_s3_is_named() {
    let (url, mut m) = packed("schema");
    m.schema.columns.swap(2, 3);
    m.version = m.compute_version();
    let store = Store::open(&url).unwrap();
    block_on(store.put("manifest.json", Bytes::from(m.to_bytes()))).unwrap();
    verify_fails_naming(&url, &["schema mismatch", "height:int64, width:int64"]);
}

fn upstream() -> String {
    s3().endpoint.trim_start_matches("http://").to_owned()
}

#[test]
fn http_503s_are_retried_with_backoff() {
    let (url, _) = packed("retry503");
    let proxy = FaultProxy::start(&upstream(), Fault::Status503, 3);
    let o = ramjet(
        &["verify", &url],
        &[("AWS_ENDPOINT_URL", &proxy.url), ("RAMJET_RETRY_BACKOFF_MS", "20")],
    );
    assert!(o.status.success(), "verify through 3 injected 503s:\n{}", text(&o));
    assert!(
        proxy.connections() > 3,
        "only {} connections: the 503s were not retried",
        proxy.connections()
    );
}

#[test]
fn a_persistently_failing_origin_gives_a_clear_error_after_the_retries() {
    let (url, _) = packed("retryfail");
    let proxy = FaultProxy::start(&upstream(), Fault::Status503, usize::MAX);
    let t0 = Instant::now();
    let o = ramjet(
        &["inspect", &url],
        &[
            ("AWS_ENDPOINT_URL", &proxy.url),
            ("RAMJET_RETRY_ATTEMPTS", "4"),
            ("RAMJET_RETRY_BACKOFF_MS", "200"),
        ],
    );
    let took = t0.elapsed();
    let msg = text(&o);
    assert_eq!(o.status.code(), Some(1), "{msg}");
    // The backoff doubles: 200 + 400 + 800 ms between the 4 attempts (a fixed one would wait
    // 600 ms). A lower bound, so no machine is too slow for it.
    assert!(
        took >= Duration::from_millis(1_400),
        "4 attempts with a doubling backoff from 200 ms took only {took:?}"
    );
    assert!(
        msg.contains(&format!("origin error on {url}/manifest.json after 4 attempt(s)")),
        "{msg}"
    );
    assert!(msg.contains("503"), "{msg}");
    assert_eq!(proxy.connections(), 4);
    assert!(took < Duration::from_secs(60), "a hang guard: {took:?}");
}

#[test]
fn a_stalled_request_times_out_and_is_retried() {
    let (url, _) = packed("stall");
    let proxy = FaultProxy::start(&upstream(), Fault::Stall, 1);
    let t0 = Instant::now();
    let o = ramjet(
        &["inspect", &url],
        &[
            ("AWS_ENDPOINT_URL", &proxy.url),
            ("RAMJET_REQUEST_TIMEOUT_MS", "700"),
            ("RAMJET_RETRY_BACKOFF_MS", "20"),
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        t0.elapsed() >= Duration::from_millis(700),
        "the stall was not waited out"
    );
    assert!(proxy.connections() >= 2);
}

#[test]
fn a_wrong_secret_is_refused_without_retrying() {
    let (url, _) = packed("auth");
    let proxy = FaultProxy::start(&upstream(), Fault::Pass, 0);
    let o = ramjet(
        &["inspect", &url],
        &[("AWS_ENDPOINT_URL", &proxy.url), ("AWS_SECRET_ACCESS_KEY", "wrong")],
    );
    let msg = text(&o);
    assert_eq!(o.status.code(), Some(1), "{msg}");
    assert!(
        msg.contains("access denied to") && msg.contains("manifest.json"),
        "{msg}"
    );
    assert_eq!(proxy.connections(), 1, "a 403 must not be retried");
}

/// Uploads every file under local folder `dir` to `url` (keys relative to `dir`).
fn upload_tree(dir: &std::path::Path, url: &str) {
    let store = Store::open(url).unwrap();
    let mut stack = vec![dir.to_path_buf()];
    let mut puts = Vec::new();
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let key = p.strip_prefix(dir).unwrap().to_str().unwrap().to_owned();
                puts.push((key, Bytes::from(std::fs::read(&p).unwrap())));
            }
        }
    }
    block_on(async {
        for (k, b) in puts {
            store.put(&k, b).await.unwrap();
        }
    });
}

fn pack_version(out: &str) -> String {
    out.lines()
        .find_map(|l| l.strip_prefix("pack: manifest version "))
        .unwrap_or_else(|| panic!("no version in {out}"))
        .to_owned()
}

/// `ramjet pack s3://…` reads its input in place, through the same store as every read: a YOLO
/// layout (labels fetched beside each image), an image folder (classes from the prefix's
/// folders, files loose at its top refused unless skipped) and a JSONL object whose rows name
/// images by key and by s3:// URL give the same manifest version as the same input packed from
/// local disk.
#[test]
fn pack_reads_its_input_from_s3_the_same_as_from_disk() {
    let s = s3();
    let t = tempfile::tempdir().unwrap();
    let yolo = synth_dataset(40);
    // An image folder of the same images, two classes, and a stray file at its top.
    let folder = t.path().join("folder");
    for i in 0..40 {
        let class = if i % 3 == 0 { "cat" } else { "dog" };
        std::fs::create_dir_all(folder.join(class)).unwrap();
        std::fs::copy(
            yolo.join(format!("images/{i:06}.jpg")),
            folder.join(format!("{class}/{i:03}.jpg")),
        )
        .unwrap();
    }
    std::fs::write(folder.join("README.txt"), "not an image").unwrap();
    let raw = s3_prefix("raw");
    upload_tree(&yolo, &format!("{raw}/yolo"));
    upload_tree(&folder, &format!("{raw}/folder"));
    // Rows naming images: by key relative to the JSONL's folder, and by URL.
    let bucket_rel = raw.strip_prefix(&format!("s3://{}/", s.bucket)).unwrap();
    let rows: String = (0..40)
        .map(|i| {
            let name = if i % 2 == 0 {
                format!("yolo/images/{i:06}.jpg")
            } else {
                format!("s3://{}/{bucket_rel}/yolo/images/{i:06}.jpg", s.bucket)
            };
            format!("{{\"image\": \"{name}\", \"caption\": \"image {i}\"}}\n")
        })
        .collect();
    let jsonl = t.path().join("rows.jsonl");
    std::fs::write(&jsonl, &rows).unwrap();
    block_on(Store::open(&raw).unwrap().put("rows.jsonl", Bytes::from(rows))).unwrap();
    // The local copy of the rows names local files for the even rows.
    std::fs::create_dir_all(t.path().join("yolo")).unwrap();
    std::os::unix::fs::symlink(yolo.join("images"), t.path().join("yolo/images")).unwrap();

    let dst = |n: &str| t.path().join(n).to_str().unwrap().to_owned();
    for (remote, local, extra) in [
        (format!("{raw}/yolo"), yolo.to_str().unwrap().to_owned(), vec![]),
        (
            format!("{raw}/folder"),
            folder.to_str().unwrap().to_owned(),
            vec!["--skip-bad"],
        ),
        (
            format!("{raw}/rows.jsonl"),
            jsonl.to_str().unwrap().to_owned(),
            vec!["--image-column", "image"],
        ),
    ] {
        let mut a = vec![
            "pack",
            remote.as_str(),
            "x",
            "--shard-size",
            "300KiB",
            "--group-size",
            "16",
        ];
        a.extend_from_slice(&extra);
        let (ra, la) = (dst(&format!("r{}", a.len())), dst(&format!("l{}", a.len())));
        a[2] = &ra;
        let from_s3 = ramjet_ok(&a);
        a[1] = &local;
        a[2] = &la;
        let from_disk = ramjet_ok(&a);
        assert_eq!(
            pack_version(&from_s3),
            pack_version(&from_disk),
            "{remote}:\n{from_s3}\n{from_disk}"
        );
        assert!(from_s3.contains("pack: 40 samples"), "{from_s3}");
        if remote.ends_with("folder") {
            assert!(
                from_s3.contains("README.txt: file is not inside a class folder"),
                "{from_s3}"
            );
        }
        ramjet_ok(&["verify", &ra]);
    }
    // A row naming an image that is not there is named, line and image.
    let bad = s3_prefix("badrows");
    block_on(Store::open(&bad).unwrap().put(
        "rows.jsonl",
        Bytes::from(format!("{{\"image\": \"{bucket_rel}/nope.jpg\", \"n\": 1}}\n")),
    ))
    .unwrap();
    ramjet_fails_naming(
        &[
            "pack",
            &format!("{bad}/rows.jsonl"),
            &dst("bad"),
            "--image-column",
            "image",
        ],
        &["rows.jsonl:1: image", "nope.jpg"],
    );
}

/// A pack split into three tasks reading from S3 and writing to S3, each task through a proxy
/// that answers its first connections with 503, retries and gives the manifest version of one
/// pack; the merge checks every stored shard.
#[test]
fn a_split_pack_from_s3_to_s3_retries_and_equals_one_pack() {
    s3();
    let raw = s3_prefix("raw-split");
    upload_tree(&synth_dataset(40), &raw);
    let (one, split) = (s3_prefix("one"), s3_prefix("split"));
    let extra = ["--group-size", "6", "--shard-size", "300KiB"];
    let mut a = vec!["pack", raw.as_str(), one.as_str()];
    a.extend_from_slice(&extra);
    let v = pack_version(&ramjet_ok(&a));
    for i in 0..3 {
        let proxy = FaultProxy::start(&upstream(), Fault::Status503, 2);
        let task = i.to_string();
        let mut a = vec!["pack", raw.as_str(), split.as_str(), "--tasks", "3", "--task", &task];
        a.extend_from_slice(&extra);
        let o = ramjet(
            &a,
            &[("AWS_ENDPOINT_URL", &proxy.url), ("RAMJET_RETRY_BACKOFF_MS", "20")],
        );
        assert!(o.status.success(), "task {i} through two 503s:\n{}", text(&o));
        assert!(proxy.connections() > 2, "task {i}: the 503s were not retried");
    }
    let mut a = vec!["pack", raw.as_str(), split.as_str(), "--tasks", "3", "--merge"];
    a.extend_from_slice(&extra);
    let out = ramjet_ok(&a);
    assert!(
        out.contains("merged 7 parts (") && out.contains("stored objects checked"),
        "{out}"
    );
    assert_eq!(pack_version(&out), v);
}
