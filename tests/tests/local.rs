//! `ramjet synth / pack / inspect / verify` on real local files: determinism, the three
//! input layouts, bad inputs, and every corruption `verify` must name.

use std::fs;
use std::path::{Path, PathBuf};

use ramjet_engine::format::{Manifest, ShardReader, Value};
use ramjet_tests::{copy_tree, flip_byte, ramjet, ramjet_fails_naming, ramjet_ok, synth_dataset, text};

const N: usize = 40;

fn pack_to(src: &Path, dst: &Path, extra: &[&str]) -> String {
    let mut args = vec!["pack", src.to_str().unwrap(), dst.to_str().unwrap()];
    args.extend_from_slice(extra);
    ramjet_ok(&args)
}

fn manifest(dir: &Path) -> Manifest {
    let p = dir.join("manifest.json");
    Manifest::parse(&fs::read(&p).unwrap(), &p.display().to_string()).unwrap()
}

/// A packed copy of the shared synthetic set, in shards of about 1 MiB.
fn packed(tmp: &Path) -> (PathBuf, Manifest) {
    let dst = tmp.join("packed");
    pack_to(&synth_dataset(N), &dst, &["--shard-size", "1MiB"]);
    let m = manifest(&dst);
    (dst, m)
}

#[test]
fn synth_writes_photo_sized_jpegs_and_valid_labels() {
    let ds = synth_dataset(N);
    let mut sizes = Vec::new();
    for i in 0..N {
        let img = fs::read(ds.join(format!("images/{i:06}.jpg"))).unwrap();
        let info = ramjet_engine::image::probe::probe(&img).unwrap();
        assert_eq!((info.width, info.height), (640, 480));
        sizes.push(img.len());
        let labels = fs::read_to_string(ds.join(format!("labels/{i:06}.txt"))).unwrap();
        assert!(!labels.trim().is_empty(), "image {i} has no boxes");
        ramjet_tools::pack::parse_yolo_labels(&labels, Path::new("l.txt")).unwrap();
    }
    assert!(
        sizes.iter().all(|&s| (60_000..=150_000).contains(&s)),
        "sizes {sizes:?}"
    );
    // Photo-like, not noise: consecutive images differ, and none compress to almost nothing.
    assert_ne!(
        fs::read(ds.join("images/000000.jpg")).unwrap(),
        fs::read(ds.join("images/000001.jpg")).unwrap()
    );
}

#[test]
fn synth_is_deterministic() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    ramjet_ok(&["synth", a.to_str().unwrap(), "--samples", "3"]);
    for i in 0..3 {
        let name = format!("images/{i:06}.jpg");
        assert_eq!(
            fs::read(a.join(&name)).unwrap(),
            fs::read(synth_dataset(N).join(&name)).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn pack_is_deterministic_across_thread_counts() {
    let t = tempfile::tempdir().unwrap();
    let src = synth_dataset(N);
    let (a, b) = (t.path().join("a"), t.path().join("b"));
    pack_to(&src, &a, &["--shard-size", "1MiB"]);
    pack_to(&src, &b, &["--shard-size", "1MiB", "--threads", "1"]);
    let ma = manifest(&a);
    assert!(ma.shard_count() > 1, "expected several shards");
    assert_eq!(ma, manifest(&b));
    assert_eq!(
        fs::read(a.join("manifest.json")).unwrap(),
        fs::read(b.join("manifest.json")).unwrap()
    );
    for s in ma.shards().map(Result::unwrap) {
        assert_eq!(
            fs::read(a.join(&s.key)).unwrap(),
            fs::read(b.join(&s.key)).unwrap(),
            "{}",
            s.key
        );
    }
    assert!(a.join(format!("manifests/{}.json", ma.version)).exists());
}

#[test]
fn packed_samples_match_their_inputs() {
    let t = tempfile::tempdir().unwrap();
    let (dst, m) = packed(t.path());
    assert_eq!(m.samples, N as u64);
    assert_eq!(m.packed_from, "yolo");
    assert_eq!(m.meta["classes"].as_array().unwrap().len(), 8);
    let src = synth_dataset(N);
    for (gi, want) in [0usize, 17, N - 1].into_iter().map(|i| (i, i)) {
        let (si, local) = m.locate(gi as u64).unwrap().unwrap();
        let f = fs::File::open(dst.join(&m.shard(si).unwrap().key)).unwrap();
        let r = ShardReader::open(f, &m.shard(si).unwrap().key).unwrap();
        let vals = r.read_sample(local).unwrap();
        let Value::Bytes(img) = &vals[0] else {
            panic!("image column")
        };
        assert_eq!(img, &fs::read(src.join(format!("images/{want:06}.jpg"))).unwrap());
        assert_eq!(vals[1], Value::Str(format!("images/{want:06}.jpg")));
        assert_eq!((&vals[2], &vals[3]), (&Value::Int64(640), &Value::Int64(480)));
        let Value::Json(boxes) = &vals[4] else {
            panic!("boxes column")
        };
        let txt = fs::read_to_string(src.join(format!("labels/{want:06}.txt"))).unwrap();
        let want_boxes: serde_json::Value =
            serde_json::from_str(&ramjet_tools::pack::parse_yolo_labels(&txt, Path::new("x")).unwrap()).unwrap();
        assert_eq!(serde_json::from_str::<serde_json::Value>(boxes).unwrap(), want_boxes);
    }
}

#[test]
fn jpeg_restarts_keep_every_pixel_and_every_crop() {
    // `pack --jpeg-restarts` stores each JPEG transcoded: other bytes, with restart markers,
    // the same pixels. The loader's train path (a random crop, cut at the restart markers
    // before it is decoded) gives the very same tensors as from the original files.
    use ramjet_engine::image::{decode_rgb, process, ImageSpec, SampleRng, Scratch, Slot};
    let t = tempfile::tempdir().unwrap();
    let dst = t.path().join("restarts");
    pack_to(&synth_dataset(N), &dst, &["--shard-size", "1MiB", "--jpeg-restarts"]);
    let m = manifest(&dst);
    assert_eq!(m.meta["jpeg_restart_px"], 32);
    let src = synth_dataset(N);
    let spec = ImageSpec::train(224);
    let (mut s1, mut s2) = (Scratch::default(), Scratch::default());
    let (mut stored_bytes, mut given_bytes) = (0, 0);
    for gi in 0..N {
        let (si, local) = m.locate(gi as u64).unwrap().unwrap();
        let key = m.shard(si).unwrap().key;
        let r = ShardReader::open(fs::File::open(dst.join(&key)).unwrap(), &key).unwrap();
        let vals = r.read_sample(local).unwrap();
        let Value::Bytes(img) = &vals[0] else {
            panic!("image column")
        };
        let given = fs::read(src.join(format!("images/{gi:06}.jpg"))).unwrap();
        assert_ne!(img, &given, "sample {gi} was stored as given");
        assert!(
            img.windows(2).any(|w| w == [0xFF, 0xDD]),
            "sample {gi} has no DRI marker"
        );
        (stored_bytes, given_bytes) = (stored_bytes + img.len(), given_bytes + given.len());
        let (a, b) = (decode_rgb(img, 1, None).unwrap(), decode_rgb(&given, 1, None).unwrap());
        assert!(a.data == b.data, "sample {gi}: the full decodes differ");
        for k in 0..5 {
            let (mut x, mut y) = (vec![0u8; spec.elems()], vec![0u8; spec.elems()]);
            process(
                img,
                &spec,
                &mut SampleRng::new(3, 0, k, gi as u64),
                Slot::U8(&mut x),
                &mut s1,
            )
            .unwrap();
            process(
                &given,
                &spec,
                &mut SampleRng::new(3, 0, k, gi as u64),
                Slot::U8(&mut y),
                &mut s2,
            )
            .unwrap();
            assert!(x == y, "sample {gi}, crop {k}: the tensors differ");
        }
    }
    // Optimal Huffman tables pay for the markers.
    assert!(
        stored_bytes < given_bytes,
        "{stored_bytes} bytes stored for {given_bytes} given"
    );
    ramjet_ok(&["verify", dst.to_str().unwrap()]);
}

#[test]
fn inspect_prints_schema_counts_and_bytes() {
    let t = tempfile::tempdir().unwrap();
    let (dst, m) = packed(t.path());
    let out = ramjet_ok(&["inspect", dst.to_str().unwrap()]);
    for want in [
        "image:bytes, path:str, width:int64, height:int64, boxes:json".to_owned(),
        format!("shards   {}", m.shard_count()),
        format!("samples  {N}"),
        m.version.clone(),
    ] {
        assert!(out.contains(&want), "missing {want:?} in:\n{out}");
    }
    let js: serde_json::Value =
        serde_json::from_str(&ramjet_ok(&["inspect", "--json", dst.to_str().unwrap()])).unwrap();
    assert_eq!(js["bytes"], m.bytes);
}

fn verify_fails_naming(dir: &Path, needles: &[&str]) -> String {
    let o = ramjet(&["verify", dir.to_str().unwrap()], &[]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "verify should fail:\n{t}");
    for n in needles {
        assert!(t.contains(n), "verify output lacks {n:?}:\n{t}");
    }
    t
}

#[test]
fn verify_passes_then_names_the_flipped_shard_and_sample() {
    let t = tempfile::tempdir().unwrap();
    let (dst, m) = packed(t.path());
    let out = ramjet_ok(&["verify", dst.to_str().unwrap()]);
    assert!(out.contains("verify: OK"), "{out}");
    // Flip one byte inside sample 2's image bytes in shard 1.
    let key = &m.shard(1).unwrap().key;
    let path = dst.join(key);
    let r = ShardReader::open(fs::File::open(&path).unwrap(), key).unwrap();
    let e = r.entry(2).unwrap();
    flip_byte(&path, e.offset + e.len / 2);
    let global = m.shard_start(1).unwrap() + 2;
    verify_fails_naming(
        &dst,
        &[
            key,
            "sample 2",
            &format!("global {global}"),
            "checksum mismatch",
            "1 of",
        ],
    );
}

#[test]
fn verify_names_a_truncated_shard() {
    let t = tempfile::tempdir().unwrap();
    let (dst, m) = packed(t.path());
    let key = &m.shard(0).unwrap().key;
    let p = dst.join(key);
    let b = fs::read(&p).unwrap();
    fs::write(&p, &b[..b.len() / 2]).unwrap();
    verify_fails_naming(&dst, &[key, "truncated"]);
}

#[test]
fn verify_names_a_missing_shard_object() {
    let t = tempfile::tempdir().unwrap();
    let (dst, m) = packed(t.path());
    let key = m.shards().map(Result::unwrap).last().unwrap().key.clone();
    fs::remove_file(dst.join(&key)).unwrap();
    verify_fails_naming(&dst, &["missing object", &key]);
}

#[test]
fn verify_names_a_schema_mismatch() {
    let t = tempfile::tempdir().unwrap();
    let (dst, mut m) = packed(t.path());
    // A manifest that is internally consistent (its version matches) but whose schema does
    // not match its shards.
    m.schema.columns[2].ty = ramjet_engine::format::ColumnType::Str;
    m.version = m.compute_version();
    fs::write(dst.join("manifest.json"), m.to_bytes()).unwrap();
    verify_fails_naming(
        &dst,
        &["schema mismatch", "width:str", "width:int64", &m.shard(0).unwrap().key],
    );
}

#[test]
fn an_edited_manifest_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let (dst, _) = packed(t.path());
    let p = dst.join("manifest.json");
    let s = fs::read_to_string(&p)
        .unwrap()
        .replace("\"samples\": 40", "\"samples\": 41");
    fs::write(&p, s).unwrap();
    let o = ramjet(&["verify", dst.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("does not match its content"), "{}", text(&o));
}

#[test]
fn a_missing_manifest_is_named() {
    let t = tempfile::tempdir().unwrap();
    let o = ramjet(&["inspect", t.path().to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("missing object") && text(&o).contains("manifest.json"),
        "{}",
        text(&o)
    );
}

/// A copy of the synthetic set with `damage` applied, packed with `extra` flags.
fn pack_damaged(damage: impl FnOnce(&Path), extra: &[&str]) -> (std::process::Output, tempfile::TempDir) {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    copy_tree(&synth_dataset(N), &src);
    damage(&src);
    let mut args = vec![
        "pack".to_owned(),
        src.display().to_string(),
        t.path().join("out").display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    (ramjet(&args, &[]), t)
}

#[test]
fn pack_aborts_on_an_unsupported_file_and_skip_bad_lists_it() {
    let damage = |src: &Path| fs::write(src.join("images/000003.jpg"), b"this is not an image").unwrap();
    let (o, t) = pack_damaged(damage, &[]);
    assert_eq!(o.status.code(), Some(1));
    let msg = text(&o);
    assert!(
        msg.contains("images/000003.jpg") && msg.contains("not a JPEG, PNG or WebP"),
        "{msg}"
    );
    assert!(
        !t.path().join("out/manifest.json").exists(),
        "a failed pack must not publish a manifest"
    );

    let (o, t) = pack_damaged(damage, &["--skip-bad"]);
    let msg = text(&o);
    assert!(o.status.success(), "{msg}");
    assert!(
        msg.contains("skipped 1 bad input(s)") && msg.contains("images/000003.jpg: not a JPEG, PNG or WebP"),
        "{msg}"
    );
    assert_eq!(manifest(&t.path().join("out")).samples, N as u64 - 1);
}

#[test]
fn pack_refuses_a_truncated_jpeg_and_a_broken_label() {
    let (o, _t) = pack_damaged(
        |src| {
            let p = src.join("images/000005.jpg");
            let b = fs::read(&p).unwrap();
            fs::write(&p, &b[..b.len() / 3]).unwrap();
        },
        &[],
    );
    let msg = text(&o);
    assert!(
        !o.status.success() && msg.contains("000005.jpg") && msg.contains("end-of-image"),
        "{msg}"
    );

    let (o, _t) = pack_damaged(
        |src| fs::write(src.join("labels/000007.txt"), "0 0.5 0.5 0.2\n").unwrap(),
        &[],
    );
    let msg = text(&o);
    assert!(
        !o.status.success() && msg.contains("labels/000007.txt:1") && msg.contains("found 4 fields"),
        "{msg}"
    );
}

#[test]
fn pack_names_an_unreadable_input() {
    let (o, _t) = pack_damaged(
        |src| std::os::unix::fs::symlink(src.join("does-not-exist.jpg"), src.join("images/zzz.jpg")).unwrap(),
        &[],
    );
    let msg = text(&o);
    assert!(
        !o.status.success() && msg.contains("images/zzz.jpg") && msg.contains("i/o error"),
        "{msg}"
    );
}

#[test]
fn pack_imagefolder_labels_by_folder() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("cls");
    let synth = synth_dataset(N);
    for (i, class) in ["cat", "dog", "dog"].iter().enumerate() {
        fs::create_dir_all(src.join(class)).unwrap();
        fs::copy(
            synth.join(format!("images/{i:06}.jpg")),
            src.join(class).join(format!("{i}.jpg")),
        )
        .unwrap();
    }
    let dst = t.path().join("out");
    pack_to(&src, &dst, &[]);
    let m = manifest(&dst);
    assert_eq!(m.packed_from, "imagefolder");
    assert_eq!(m.meta["classes"], serde_json::json!(["cat", "dog"]));
    let key = &m.shard(0).unwrap().key;
    let r = ShardReader::open(fs::File::open(dst.join(key)).unwrap(), key).unwrap();
    let labels: Vec<Value> = (0..3).map(|i| r.read_sample(i).unwrap()[1].clone()).collect();
    assert_eq!(labels, vec![Value::Int64(0), Value::Int64(1), Value::Int64(1)]);
    ramjet_ok(&["verify", dst.to_str().unwrap()]);
}

#[test]
fn pack_jsonl_infers_types_and_names_bad_lines() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("rows.jsonl");
    fs::write(
        &src,
        "{\"id\": 1, \"score\": 0.5, \"text\": \"a\", \"tags\": [\"x\"]}\n\n{\"id\": 2, \"score\": 1, \"text\": \"b\", \"tags\": []}\n",
    )
    .unwrap();
    let dst = t.path().join("out");
    pack_to(&src, &dst, &[]);
    let m = manifest(&dst);
    assert_eq!(m.schema.describe(), "id:int64, score:float64, tags:json, text:str");
    let key = &m.shard(0).unwrap().key;
    let r = ShardReader::open(fs::File::open(dst.join(key)).unwrap(), key).unwrap();
    assert_eq!(
        r.read_sample(1).unwrap(),
        vec![
            Value::Int64(2),
            Value::Float64(1.0),
            Value::Json("[]".into()),
            Value::Str("b".into())
        ]
    );

    fs::write(&src, "{\"id\": 1}\n{\"id\": 2\n{\"id\": \"three\"}\n{\"id\": 4}\n").unwrap();
    let o = ramjet(
        &["pack", src.to_str().unwrap(), t.path().join("bad").to_str().unwrap()],
        &[],
    );
    let msg = text(&o);
    assert!(
        !o.status.success() && msg.contains("rows.jsonl:2") && msg.contains("invalid JSON"),
        "{msg}"
    );
    let o = ramjet(
        &[
            "pack",
            src.to_str().unwrap(),
            t.path().join("skip").to_str().unwrap(),
            "--skip-bad",
        ],
        &[],
    );
    let msg = text(&o);
    assert!(
        o.status.success() && msg.contains("rows.jsonl:2") && msg.contains("rows.jsonl:3"),
        "{msg}"
    );
    assert_eq!(manifest(&t.path().join("skip")).samples, 2);
}

/// Columns `names` of the packed dataset at `dir`, through the engine's sidecar reader.
fn columns_of(dir: &Path, names: &[&str]) -> ramjet_engine::Result<Vec<Vec<Value>>> {
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    ramjet_tests::block_on(async {
        let ds = ramjet_engine::Dataset::open(dir.to_str().unwrap()).await?;
        ds.columns(&names, 4).await
    })
}

#[test]
fn pack_writes_columns_sidecars_that_match_the_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let (dst, m) = packed(tmp.path());
    assert!(m.shard_count() > 1);
    for s in m.shards().map(Result::unwrap) {
        let c = s.columns.as_ref().expect("every YOLO shard has a sidecar");
        let path = dst.join(&c.key);
        let r = ShardReader::open(fs::File::open(&path).unwrap(), &c.key).unwrap();
        assert_eq!(r.samples(), s.samples);
        let names: Vec<&str> = r.schema().columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["path", "width", "height", "boxes"]);
        // A sidecar is a few percent of its shard.
        assert!(
            c.bytes * 20 < s.bytes,
            "sidecar {} bytes for a {}-byte shard",
            c.bytes,
            s.bytes
        );
    }
    let cols = columns_of(&dst, &["path", "boxes"]).unwrap();
    assert_eq!(cols[0].len(), N);
    for i in [0usize, 17, N - 1] {
        assert_eq!(cols[0][i], Value::Str(format!("images/{i:06}.jpg")));
        let want = fs::read_to_string(synth_dataset(N).join(format!("labels/{i:06}.txt"))).unwrap();
        let Value::Json(boxes) = &cols[1][i] else {
            panic!("boxes is json")
        };
        let parsed: Vec<Vec<f64>> = serde_json::from_str(boxes).unwrap();
        assert_eq!(parsed.len(), want.lines().count());
    }
    let out = ramjet_ok(&["verify", dst.to_str().unwrap()]);
    assert!(out.contains("OK"), "{out}");
}

#[test]
fn a_flipped_sidecar_byte_is_named_by_reader_and_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let (dst, m) = packed(tmp.path());
    let c = m.shard(1).unwrap().columns.clone().unwrap();
    flip_byte(&dst.join(&c.key), c.bytes / 2);
    let e = columns_of(&dst, &["boxes"]).unwrap_err().to_string();
    assert!(e.contains(&c.key), "{e}");
    let out = verify_fails_naming(&dst, &[&c.key]);
    assert!(out.contains("checksum"), "{out}");
}

#[test]
fn a_missing_sidecar_fails_loudly_and_old_manifests_read_whole_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let (dst, m) = packed(tmp.path());
    let c = m.shard(0).unwrap().columns.clone().unwrap();
    fs::remove_file(dst.join(&c.key)).unwrap();
    let e = columns_of(&dst, &["path"]).unwrap_err().to_string();
    assert!(e.contains(&c.key), "{e}");
    // A manifest without sidecars (as written before they existed) reads the shards instead.
    let mut old = m.clone();
    for s in old.shards_mut() {
        s.columns = None;
    }
    let old = Manifest::new(
        old.packed_from.clone(),
        old.schema.clone(),
        old.meta.clone(),
        old.shards().map(Result::unwrap).collect(),
    );
    fs::write(dst.join("manifest.json"), old.to_bytes()).unwrap();
    let cols = columns_of(&dst, &["path", "width"]).unwrap();
    assert_eq!(cols[0].len(), N);
    assert!(cols[1].iter().all(|w| *w == Value::Int64(640)));
    // Images are never a table column.
    let e = columns_of(&dst, &["image"]).unwrap_err().to_string();
    assert!(e.contains("bytes column"), "{e}");
}

#[test]
fn a_manifest_listing_a_sidecar_key_twice_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (_dst, m) = packed(tmp.path());
    let mut bad = m.clone();
    let k = bad.shard(0).unwrap().columns.clone().unwrap();
    bad.shards_mut()[1].columns = Some(k);
    let bad = Manifest::new(
        bad.packed_from.clone(),
        bad.schema.clone(),
        bad.meta.clone(),
        bad.shards().map(Result::unwrap).collect(),
    );
    let e = Manifest::parse(&bad.to_bytes(), "m").unwrap_err().to_string();
    assert!(e.contains("listed twice"), "{e}");
}

/// A dataset packed with a binary shard table reads exactly like the same dataset listed in
/// the JSON: same shards, same samples, and `verify` passes; the manifest says format 2 and
/// lists no shard itself, and the table is 48 bytes a shard after its 32-byte header.
#[test]
fn a_shard_table_manifest_reads_like_a_listed_one() {
    let t = tempfile::tempdir().unwrap();
    let (listed, tabled) = (t.path().join("listed"), t.path().join("tabled"));
    let src = synth_dataset(N);
    pack_to(&src, &listed, &["--shard-size", "300KiB", "--shard-table", "never"]);
    pack_to(&src, &tabled, &["--shard-size", "300KiB", "--shard-table", "always"]);
    let (ml, mt) = (manifest(&listed), manifest(&tabled));
    assert_eq!(ml.table_ref(), None);
    let r = mt.table_ref().cloned().expect("a shard table");
    assert_eq!((mt.format_version, r.shards), (2, ml.shard_count() as u64));
    assert!(ml.shard_count() > 3, "several shards");
    let raw = fs::read(tabled.join(&r.key)).unwrap();
    assert_eq!(
        raw.len() as u64,
        ramjet_engine::format::shard_table_len(ml.shard_count() as u64, true)
    );
    let ds = ramjet_tests::block_on(ramjet_engine::Dataset::open(tabled.to_str().unwrap())).unwrap();
    let m = ds.manifest();
    assert_eq!(
        m.shards().map(Result::unwrap).collect::<Vec<_>>(),
        ml.shards().map(Result::unwrap).collect::<Vec<_>>()
    );
    assert_eq!((m.samples, m.bytes), (ml.samples, ml.bytes));
    for g in [0u64, 7, N as u64 - 1] {
        assert_eq!(m.locate(g).unwrap(), ml.locate(g).unwrap());
    }
    assert_eq!(m.locate(N as u64).unwrap(), None);
    ramjet_ok(&["verify", tabled.to_str().unwrap()]);
    let samples = |dir: &Path| {
        let out = ramjet_ok(&["stream", dir.to_str().unwrap(), "--shuffle", "none", "--json"]);
        ramjet_tests::json_of(&out)["sample_bytes"].clone()
    };
    assert_eq!(samples(&tabled), samples(&listed));
}

/// `--shard-samples` cuts shards at that many samples as well as at the size: with a group
/// size that is a multiple of it, every shard but the last holds exactly that many and the
/// table says it is uniform (its counts then cost no read), and the samples read back are the
/// listed copy's; with one that is not, each group's last shard is short and the table is not
/// uniform. A count of 0 is refused naming the option.
#[test]
fn shard_samples_cuts_shards_and_a_uniform_table_reads_like_a_listed_one() {
    let t = tempfile::tempdir().unwrap();
    let src = synth_dataset(N);
    let (listed, tabled, ragged) = (
        t.path().join("listed"),
        t.path().join("tabled"),
        t.path().join("ragged"),
    );
    let opts = ["--shard-samples", "6", "--group-size", "12"];
    pack_to(&src, &listed, &[&opts[..], &["--shard-table", "never"]].concat());
    pack_to(&src, &tabled, &[&opts[..], &["--shard-table", "always"]].concat());
    let ml = manifest(&listed);
    let counts: Vec<u64> = ml.shards().map(|s| s.unwrap().samples).collect();
    assert_eq!(counts, [6, 6, 6, 6, 6, 6, 4], "{N} samples in shards of 6");
    let ds = ramjet_tests::block_on(ramjet_engine::Dataset::open(tabled.to_str().unwrap())).unwrap();
    let table = ds.manifest().table().expect("a shard table");
    assert!(table.is_uniform());
    for g in [0u64, 5, 6, 35, 36, N as u64 - 1] {
        assert_eq!(ds.manifest().locate(g).unwrap(), ml.locate(g).unwrap(), "sample {g}");
    }
    ramjet_ok(&["verify", tabled.to_str().unwrap()]);
    let samples = |dir: &Path| {
        let out = ramjet_ok(&["stream", dir.to_str().unwrap(), "--json"]);
        ramjet_tests::json_of(&out)["sample_bytes"].clone()
    };
    assert_eq!(samples(&tabled), samples(&listed));
    pack_to(
        &src,
        &ragged,
        &["--shard-samples", "6", "--group-size", "15", "--shard-table", "always"],
    );
    let ds = ramjet_tests::block_on(ramjet_engine::Dataset::open(ragged.to_str().unwrap())).unwrap();
    let counts: Vec<u64> = ds.manifest().shards().map(|s| s.unwrap().samples).collect();
    assert_eq!(counts, [6, 6, 3, 6, 6, 3, 6, 4], "each group of 15 ends its last shard");
    assert!(!ds.manifest().table().unwrap().is_uniform());
    // Rows of a JSONL are cut the same way.
    let rows = t.path().join("rows.jsonl");
    fs::write(&rows, (0..20).map(|i| format!("{{\"x\": {i}}}\n")).collect::<String>()).unwrap();
    let out = t.path().join("rows");
    pack_to(&rows, &out, &opts);
    let counts: Vec<u64> = manifest(&out).shards().map(|s| s.unwrap().samples).collect();
    assert_eq!(counts, [6, 6, 6, 2], "20 rows in shards of 6");
    ramjet_tests::ramjet_fails_naming(
        &[
            "pack",
            src.to_str().unwrap(),
            t.path().join("zero").to_str().unwrap(),
            "--shard-samples",
            "0",
        ],
        &["--shard-samples"],
    );
}

/// A flipped byte in a shard table's head, a cut or a missing table, and a manifest that names
/// a table of the wrong size, are each refused when the dataset is opened, naming the object
/// and what is wrong. A flipped byte in a block of records is found when the block is first
/// read: the stream and `verify` fail naming the table and the block, never read a wrong shard.
#[test]
fn a_damaged_shard_table_is_refused_naming_it() {
    let t = tempfile::tempdir().unwrap();
    let dst = t.path().join("tabled");
    pack_to(
        &synth_dataset(N),
        &dst,
        &["--shard-size", "300KiB", "--shard-table", "always"],
    );
    let m = manifest(&dst);
    let key = m.table_ref().unwrap().key.clone();
    let table = dst.join(&key);
    let good = fs::read(&table).unwrap();
    let open = || {
        ramjet_tests::block_on(ramjet_engine::Dataset::open(dst.to_str().unwrap()))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert_eq!(open(), "");
    // A byte of the header (its sample total).
    flip_byte(&table, 16);
    let e = open();
    assert!(e.contains(&key) && e.contains("checksum"), "{e}");
    fs::write(&table, &good).unwrap();
    // A byte of a record (shard 1's sample count): opens, then fails where the block is read.
    let head = ramjet_engine::format::shard_table_head_len(m.shard_count() as u64);
    flip_byte(&table, head + 48);
    assert_eq!(open(), "");
    ramjet_fails_naming(
        &["stream", dst.to_str().unwrap(), "--shuffle", "none"],
        &[&key, "block 0", "checksum"],
    );
    verify_fails_naming(&dst, &[&key, "block 0"]);
    fs::write(&table, &good[..good.len() - 48]).unwrap();
    let e = open();
    assert!(e.contains(&key) && e.contains("bytes"), "{e}");
    fs::remove_file(&table).unwrap();
    let e = open();
    assert!(e.contains(&key), "{e}");
    fs::write(&table, &good).unwrap();
    // The manifest rewritten (version recomputed) to name a table of another size.
    let mut bad = m.clone();
    bad.table_ref_mut().unwrap().bytes += 48;
    bad.version = bad.compute_version();
    fs::write(dst.join("manifest.json"), bad.to_bytes()).unwrap();
    let e = open();
    assert!(e.contains("must be") && e.contains("bytes"), "{e}");
}

/// A JSONL file is packed as a stream: a million rows in 8 KiB shards (over 4,096 of them, so
/// listed in a shard table) stay far below what
/// holding the input would take (the pack before this gathered every row: about 1.1 GB for
/// a million rows), and the output depends on nothing but the input and the shard size (the
/// same shards and manifest with one thread or all of them).
#[test]
fn jsonl_is_packed_as_a_stream_in_bounded_memory_and_deterministically() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("rows.jsonl");
    let mut text = String::with_capacity(40 << 20);
    for i in 0..1_000_000u64 {
        text.push_str(&format!("{{\"id\": {i}, \"text\": \"row {i} of the test\"}}\n"));
    }
    fs::write(&src, text).unwrap();
    let (a, b) = (t.path().join("a"), t.path().join("b"));
    let out = pack_to(&src, &a, &["--shard-size", "8KiB"]);
    pack_to(&src, &b, &["--shard-size", "8KiB", "--threads", "1"]);
    let (ma, mb) = (manifest(&a), manifest(&b));
    assert_eq!(ma.samples, 1_000_000);
    assert!(ma.table_ref().is_some(), "{} shards: a table", ma.shard_count());
    assert_eq!(ma.version, mb.version, "the same manifest whatever the threads");
    let rss: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("pack: peak RSS ")?.strip_suffix(" MiB")?.parse().ok())
        .unwrap_or_else(|| panic!("no peak RSS line in {out}"));
    assert!(rss < 200, "packing a million rows held {rss} MiB");
    // Rows in order, across shard boundaries.
    let ds = ramjet_tests::block_on(ramjet_engine::Dataset::open(a.to_str().unwrap())).unwrap();
    for g in [0u64, 123_456, 999_999] {
        let (shard, i) = ds.manifest().locate(g).unwrap().unwrap();
        let key = ds.manifest().shard(shard).unwrap().key;
        let r = ShardReader::open(fs::File::open(a.join(&key)).unwrap(), &key).unwrap();
        assert_eq!(r.read_sample(i).unwrap()[0], Value::Int64(g as i64));
    }
}

/// In a log (stderr not a terminal), long commands print a progress line every
/// `RAMJET_PROGRESS_S` seconds: plain lines, no redraws joined by carriage returns.
#[test]
fn progress_in_a_log_is_plain_lines_every_few_seconds() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let o = ramjet(
        &["synth", dir.to_str().unwrap(), "--samples", "250"],
        &[("RAMJET_PROGRESS_S", "0.05")],
    );
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains('\r'), "carriage returns in a log:\n{err:?}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("synth: ")).collect();
    assert!(!lines.is_empty(), "no progress line in:\n{err}");
    for l in &lines {
        assert!(l.contains("/250 (") && l.ends_with(" s"), "{l}");
    }
}
