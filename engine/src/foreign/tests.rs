//! Tests of the foreign readers: MDS, WebDataset, compression and transcoding.

use super::*;
use crate::error::Location;
use crate::format::ColumnType;

#[test]
fn webdataset_keys_split_at_the_first_dot_of_the_file_name() {
    assert_eq!(wds::key_ext("a/b/000.seg.png"), Some(("a/b/000", "seg.png")));
    assert_eq!(wds::key_ext("x.y/000.jpg"), Some(("x.y/000", "jpg")));
    assert_eq!(wds::key_ext("noext"), None);
    assert_eq!(wds::key_ext("dir/.hidden"), None);
}

#[test]
fn a_decompression_past_its_bound_is_refused_not_allocated() {
    let zeros = vec![0u8; 8 << 20];
    let z = zstd::encode_all(&zeros[..], 3).unwrap();
    assert!(z.len() < 4096);
    let e = decompress(&z, Some("zstd"), 1 << 20, "bomb.mds.zstd")
        .unwrap_err()
        .to_string();
    assert!(e.contains("bomb.mds.zstd") && e.contains("more than"), "{e}");
    assert_eq!(decompress(&z, Some("zstd:9"), 8 << 20, "x").unwrap(), zeros);
    let e = decompress(&z, Some("br"), 8 << 20, "x.br").unwrap_err().to_string();
    assert!(e.contains("not supported"), "{e}");
}

#[test]
fn pickled_columns_are_refused_by_name() {
    let e = mds::column_type("pkl").unwrap_err();
    assert!(e.contains("arbitrary code"), "{e}");
    assert_eq!(mds::column_type("ndarray:uint8:2,2").unwrap().name(), "uint8[2,2]");
    assert_eq!(mds::column_type("ndarray:int16").unwrap().name(), "int16[*]");
    assert_eq!(mds::column_type("ndarray").unwrap().name(), "any[*]");
    assert!(mds::column_type("ndarray:complex64").is_err());
    assert_eq!(mds::column_type("jpeg_array").unwrap(), ColumnType::Bytes);
    assert_eq!(mds::column_type("str_int").unwrap(), ColumnType::Int64);
}

#[test]
fn a_tar_header_with_a_flipped_byte_is_named() {
    let mut t = vec![0u8; 512 * 4];
    t[..5].copy_from_slice(b"a.txt");
    t[124..135].copy_from_slice(b"00000000003");
    t[156] = b'0';
    t[257..263].copy_from_slice(b"ustar\0");
    let sum = wds::header_sum(&t);
    t[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
    t[512..515].copy_from_slice(b"abc");
    let s = wds::samples(&t, "x.tar").unwrap();
    assert_eq!(
        (s.len(), s[0].key.as_str(), &t[s[0].members[0].1.clone()]),
        (1, "a", &b"abc"[..])
    );
    t[3] ^= 1;
    let e = wds::samples(&t, "x.tar").unwrap_err().to_string();
    assert!(e.contains("x.tar") && e.contains("checksum"), "{e}");
}

use crate::image::tests::jpeg;

/// A ustar of `files` (name, bytes), ended by its two zero blocks.
fn tar_of(files: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut t = Vec::new();
    for (name, data) in files {
        let mut h = vec![0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        h[124..135].copy_from_slice(format!("{:011o}", data.len()).as_bytes());
        h[156] = b'0';
        h[257..263].copy_from_slice(b"ustar\0");
        let sum = wds::header_sum(&h);
        h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        t.extend_from_slice(&h);
        t.extend_from_slice(data);
        t.resize(t.len().div_ceil(512) * 512, 0);
    }
    t.resize(t.len() + 1024, 0);
    t
}

#[test]
fn jpeg_restarts_transcode_the_jpeg_members_alike_whole_or_alone_and_keep_their_pixels() {
    let mut files = Vec::new();
    for i in 0..6 {
        files.push((format!("s{i}.cls"), format!("{i}").into_bytes()));
        // Sample 5's starts as a JPEG and is cut short: libjpeg-turbo will not transcode it.
        let j = if i == 5 {
            jpeg(64, 64)[..200].to_vec()
        } else {
            jpeg(200 + 16 * i as u16, 120)
        };
        files.push((format!("s{i}.jpg"), j));
    }
    let tar = tar_of(&files);
    let exts = ["cls", "jpg"].into_iter().map(str::to_owned).collect();
    let (columns, schema) = wds::columns(&exts).unwrap();
    let given = ForeignSpec {
        format: ForeignFormat::Wds,
        columns: columns.clone(),
        jpeg_restart_px: None,
    };
    let rst = ForeignSpec {
        jpeg_restart_px: Some(crate::image::turbo::JPEG_RESTART_PX),
        ..given.clone()
    };
    let jpg = columns.iter().position(|c| c.encoding == "jpg").unwrap();
    let cls = columns.iter().position(|c| c.encoding == "cls").unwrap();
    let key = columns.iter().position(|c| c.encoding == wds::KEY_COLUMN).unwrap();
    assert!(rst.may_hold_jpeg(&columns[jpg]) && rst.may_hold_jpeg(&columns[cls]));
    assert!(!rst.may_hold_jpeg(&columns[key]));

    let (a, spans) = transcode_with_spans(&given, &schema, &tar, "x.tar").unwrap();
    let (b, spans_b) = transcode_with_spans(&rst, &schema, &tar, "x.tar").unwrap();
    assert_eq!(spans, spans_b);
    assert_ne!(a.checksum, b.checksum);
    let (va, vb) = (
        crate::format::ShardView::parse(&a.bytes, "a").unwrap(),
        crate::format::ShardView::parse(&b.bytes, "b").unwrap(),
    );
    for i in 0..6u64 {
        let at = Location::sample("x.tar", i);
        let (ra, rb) = (va.record(i).unwrap(), vb.record(i).unwrap());
        let get = |r, col: usize| match crate::format::decode_record(&schema, r, &at).unwrap()[col] {
            crate::format::ValueRef::Bytes(b) => b.to_vec(),
            _ => unreachable!(),
        };
        let (ja, jb) = (get(ra, jpg), get(rb, jpg));
        // A member that is not a JPEG is stored as given.
        assert_eq!(get(rb, cls), format!("{i}").into_bytes());
        assert_eq!(ja, files[2 * i as usize + 1].1, "the given bytes");
        if i == 5 {
            // A damaged JPEG: stored as given (and decoded, or refused, as given).
            assert_eq!(jb, ja);
        } else {
            assert_ne!(jb, ja);
            assert!(
                jb.windows(2).any(|w| w == [0xFF, 0xDD]),
                "sample {i} has no restart interval"
            );
            let (pa, pb) = (
                crate::image::decode_rgb(&ja, 1, None).unwrap(),
                crate::image::decode_rgb(&jb, 1, None).unwrap(),
            );
            assert!(pa.data == pb.data, "sample {i}: other pixels");
        }
        // Read alone from its span, a sample transcodes to the record the whole shard
        // holds (the whole shard's JPEGs were transcoded on several threads).
        let span = spans[i as usize].start as usize..spans[i as usize].end as usize;
        let alone = transcode_sample(&rst, &schema, &tar[span], &at).unwrap();
        assert_eq!(alone, rb, "sample {i}");
    }
}
