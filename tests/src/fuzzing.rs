//! Fuzz entry points, shared by the cargo-fuzz targets in `tests/fuzz/` and by the corpus
//! replay test that runs in the normal test suite. Each must return normally for any input:
//! a panic here is a bug in a parser.

use ramjet_engine::format::{verify_shard_bytes, ColumnType, Manifest, Schema, ShardExpect, ShardReader, ShardView};

/// Samples of a fuzzed shard that are decoded (bounds the work per input).
const SAMPLES_CHECKED_MAX: u64 = 256;

/// Feeds `data` to every shard reading path.
pub fn shard(data: &[u8]) {
    if let Ok(v) = ShardView::parse(data, "fuzz.rjs") {
        let _ = v.check_checksum();
        for i in 0..v.samples().min(SAMPLES_CHECKED_MAX) {
            let _ = v.sample(i);
        }
        let _ = v.sample(v.samples());
    }
    if let Ok(r) = ShardReader::open(data, "fuzz.rjs") {
        for i in 0..r.samples().min(SAMPLES_CHECKED_MAX) {
            let _ = r.read_sample(i);
        }
    }
    let schema = Schema::new([("x", ColumnType::Bytes)]).expect("valid schema");
    let expect = ShardExpect {
        bytes: data.len() as u64,
        samples: 1,
        checksum: 0,
        schema: &schema,
    };
    if data.len() < 1 << 20 {
        let _ = verify_shard_bytes(data, "fuzz.rjs", &expect);
    }
}

/// Feeds `data` to the manifest parser; a manifest that parses must survive a round trip.
pub fn manifest(data: &[u8]) {
    if let Ok(m) = Manifest::parse(data, "fuzz.json") {
        let again = Manifest::parse(&m.to_bytes(), "fuzz.json").expect("a parsed manifest re-parses");
        assert_eq!(again, m, "manifest round trip changed it");
        let _ = m.locate(m.samples.saturating_sub(1));
    }
}

/// Feeds `data` to the wire protocol's frame parsers: a bare frame, and a frame body checked
/// against a keyed session (as a peer connection's every frame after the handshake is).
pub fn wire(data: &[u8]) {
    use ramjet_transport::wire;
    let _ = wire::parse_frame(data);
    let _ = wire::read_msg_blocking(&mut &data[..]);
    let mut s = wire::Session::keyed_for_fuzzing("fuzz", false);
    let _ = s.open(data);
    if data.len() > 4 {
        let _ = s.open(&data[4..]);
    }
}

/// Feeds `data` to the image probe and decoders: full size, DCT-scaled, row-limited, and the
/// whole per-image path (crop-region decode, resize) of a training and an evaluation spec.
pub fn image(data: &[u8]) {
    use ramjet_engine::image::{decode_rgb, process, ImageSpec, SampleRng, Scratch, Slot};
    let _ = ramjet_engine::image::probe::probe(data);
    let _ = decode_rgb(data, 1, None);
    let _ = decode_rgb(data, 2, Some((0, 8)));
    let o = ramjet_engine::image::exif::orientation(data);
    let _ = ramjet_engine::image::decode_shown(data, o);
    let mut scratch = Scratch::default();
    for spec in [ImageSpec::train(32), ImageSpec::eval(24)] {
        let mut out = vec![0u8; spec.elems()];
        let _ = process(
            data,
            &spec,
            &mut SampleRng::new(0, 0, 0, 0),
            Slot::U8(&mut out),
            &mut scratch,
        );
    }
}

/// Feeds `data` to the foreign-shard readers (`ramjet_engine::foreign`): as an MDS
/// shard of one column of each kind, as a WebDataset tar, as one sample's span of each (the
/// ranged read through a sample index), and to both decompressors (bounded).
pub fn foreign(data: &[u8]) {
    use ramjet_engine::foreign::{
        decompress, mds, transcode, transcode_sample, wds, ForeignColumn, ForeignFormat, ForeignSpec,
    };
    use ramjet_engine::Location;
    // MDS column order is the names sorted, as MDSWriter writes them (the corpus's seeds).
    let cols: Vec<ForeignColumn> = [
        ("b", "bytes", None),
        ("f", "float32", Some(4)),
        ("h", "float16", Some(2)),
        ("i", "int", Some(8)),
        ("j", "json", None),
        ("s", "str", None),
        ("u", "uint8", Some(1)),
    ]
    .into_iter()
    .map(|(n, e, s)| ForeignColumn {
        name: n.into(),
        encoding: e.into(),
        size: s,
    })
    .collect();
    let schema = Schema::new(
        cols.iter()
            .map(|c| (c.name.clone(), mds::column_type(&c.encoding).expect("known encoding"))),
    )
    .expect("valid schema");
    let spec = ForeignSpec {
        format: ForeignFormat::Mds,
        columns: cols,
        jpeg_restart_px: None,
    };
    let _ = transcode(&spec, &schema, data, "fuzz.mds");
    let _ = transcode_sample(&spec, &schema, data, &Location::sample("fuzz.mds", 0));
    let exts = ["cls", "jpg"].into_iter().map(str::to_owned).collect();
    let (columns, schema) = wds::columns(&exts).expect("valid columns");
    // The tar's `jpg` members go through the restart transcoder too.
    let spec = ForeignSpec {
        format: ForeignFormat::Wds,
        columns,
        jpeg_restart_px: Some(ramjet_engine::image::turbo::JPEG_RESTART_PX),
    };
    let _ = transcode(&spec, &schema, data, "fuzz.tar");
    let _ = transcode_sample(&spec, &schema, data, &Location::sample("fuzz.tar", 0));
    for c in ["zstd", "gz"] {
        if let Ok(plain) = decompress(data, Some(c), 1 << 20, "fuzz.z") {
            assert!(plain.len() <= 1 << 20, "{c}: decompressed past its bound");
        }
    }
}

/// Feeds `data` to the index readers of datasets read in place: an MDS `index.json` (and its
/// columns), a LitData `index.json` read as one, and a NumPy `.npy` header and body.
pub fn index(data: &[u8]) {
    use ramjet_engine::foreign::{lit, mds};
    if let Ok(ix) = mds::Index::parse(data, "fuzz/index.json") {
        let _ = ix.columns("fuzz/index.json");
    }
    if let Ok(Some(ix)) = lit::as_mds_index(data, "fuzz/index.json") {
        let _ = ix.columns("fuzz/index.json");
    }
    let _ = ramjet_engine::format::npy::parse_npy(data);
}

/// Feeds `data` to the Parquet reader as a whole file: its footer from the tail, its schema as
/// columns, and each row group (its span of `data`) transcoded against the footer.
pub fn parquet(data: &[u8]) {
    use ramjet_engine::foreign::{parquet_footer, parquet_rows, parquet_schema};
    use ramjet_engine::foreign::{ForeignFormat, ForeignSpec, ParquetPart};
    use ramjet_engine::format::Checksum;
    let n = data.len();
    if n < 12 || &data[n - 4..] != b"PAR1" {
        return;
    }
    let len = u32::from_le_bytes(data[n - 8..n - 4].try_into().expect("4 bytes")) as usize;
    let Some(offset) = n.checked_sub(8 + len) else {
        return;
    };
    let Ok(meta) = parquet_footer::decode(&data[offset..n - 8], "fuzz.parquet") else {
        return;
    };
    let Ok((columns, schema)) = parquet_schema::columns(&[meta.as_ref()]) else {
        return;
    };
    let spec = ForeignSpec {
        format: ForeignFormat::Parquet,
        columns,
        jpeg_restart_px: None,
    };
    for (r, rg) in meta.row_groups().iter().enumerate() {
        let Ok((start, bytes)) = parquet_rows::row_group_span(rg) else {
            continue;
        };
        let part = ParquetPart {
            file: "fuzz.parquet".into(),
            file_bytes: n as u64,
            row_group: r as u32,
            offset: start,
            footer_offset: offset as u64,
            footer_bytes: len as u64,
            footer_checksum: Checksum(0),
        };
        if part.check(bytes).is_err() {
            continue;
        }
        let span = bytes::Bytes::copy_from_slice(&data[start as usize..(start + bytes) as usize]);
        let _ = parquet_rows::transcode_row_group(&spec, &schema, &meta, &part, span, "fuzz.parquet#rg");
    }
}
