//! Property tests of the shard format: any schema and samples round-trip exactly through the
//! writer and both readers, and any single flipped byte or truncation is caught, never
//! yielded and never a panic.

use proptest::prelude::*;
use ramjet_engine::format::array::{Array, ArraySpec, Dims, DTYPES};
use ramjet_engine::format::{
    verify_shard_bytes, ColumnType, Schema, ShardBuilder, ShardExpect, ShardReader, ShardView, Value, ValueRef,
};

fn column_type() -> impl Strategy<Value = ColumnType> {
    prop_oneof![
        Just(ColumnType::Bytes),
        Just(ColumnType::Str),
        Just(ColumnType::Int64),
        Just(ColumnType::Float64),
        Just(ColumnType::Json),
        Just(ColumnType::Array(ArraySpec::parse("int32[?]").unwrap())),
        Just(ColumnType::Array(ArraySpec::parse("float32[?,3]").unwrap())),
        Just(ColumnType::Array(ArraySpec::parse("bfloat16[2,2]").unwrap())),
        Just(ColumnType::Array(ArraySpec::parse("any[*]").unwrap())),
    ]
}

/// An array of `spec`: its declared dtype (any when free), its fixed axes, 0..5 on free ones.
fn array(spec: ArraySpec) -> BoxedStrategy<Value> {
    let dtype = match spec.dtype {
        Some(d) => Just(d).boxed(),
        None => proptest::sample::select(DTYPES.to_vec()).boxed(),
    };
    let shape = match spec.dims {
        Dims::Any => proptest::collection::vec(0u64..4, 0..3).boxed(),
        Dims::Rank { rank, dims } => (0..rank as usize)
            .map(|i| match Dims::axis(&dims, i) {
                Some(n) => Just(n).boxed(),
                None => (0u64..5).boxed(),
            })
            .collect::<Vec<_>>()
            .boxed(),
    };
    (dtype, shape)
        .prop_flat_map(|(d, shape)| {
            let n = shape.iter().product::<u64>() as usize * d.size();
            (Just(d), Just(shape), proptest::collection::vec(any::<u8>(), n))
        })
        .prop_map(|(d, shape, data)| Value::Array(Array::new(d, shape, data).unwrap()))
        .boxed()
}

fn value(ty: ColumnType) -> BoxedStrategy<Value> {
    match ty {
        ColumnType::Bytes => proptest::collection::vec(any::<u8>(), 0..300)
            .prop_map(Value::Bytes)
            .boxed(),
        ColumnType::Str => ".{0,40}".prop_map(Value::Str).boxed(),
        ColumnType::Int64 => any::<i64>().prop_map(Value::Int64).boxed(),
        // Any bit pattern, NaNs included: the format stores bits, not numbers.
        ColumnType::Float64 => any::<u64>().prop_map(|b| Value::Float64(f64::from_bits(b))).boxed(),
        ColumnType::Json => prop_oneof![
            any::<i32>().prop_map(|v| v.to_string()),
            "[a-z]{0,10}".prop_map(|s| serde_json::json!({ "k": s, "n": [1, 2] }).to_string()),
            Just("null".to_owned()),
        ]
        .prop_map(Value::Json)
        .boxed(),
        ColumnType::Array(spec) => array(spec),
    }
}

/// A schema and 0..40 samples of it.
fn dataset() -> impl Strategy<Value = (Schema, Vec<Vec<Value>>)> {
    proptest::collection::vec(column_type(), 1..6).prop_flat_map(|types| {
        let schema = Schema::new(types.iter().enumerate().map(|(i, t)| (format!("c{i}"), *t))).unwrap();
        let row: Vec<BoxedStrategy<Value>> = types.iter().map(|t| value(*t)).collect();
        (Just(schema), proptest::collection::vec(row, 0..40))
    })
}

fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Float64(x), Value::Float64(y)) => x.to_bits() == y.to_bits(),
        _ => a == b,
    }
}

fn build(schema: &Schema, rows: &[Vec<Value>]) -> ramjet_engine::format::BuiltShard {
    let mut b = ShardBuilder::new(schema.clone());
    for (i, r) in rows.iter().enumerate() {
        b.push(r, &format!("row {i}")).unwrap();
    }
    b.finish()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn round_trip((schema, rows) in dataset()) {
        let shard = build(&schema, &rows);
        let view = ShardView::parse(&shard.bytes, "p.rjs").unwrap();
        prop_assert_eq!(view.check_checksum().unwrap(), shard.checksum);
        prop_assert_eq!(view.schema(), &schema);
        let reader = ShardReader::open(&shard.bytes[..], "p.rjs").unwrap();
        prop_assert_eq!(reader.samples(), rows.len() as u64);
        for (i, row) in rows.iter().enumerate() {
            let from_view: Vec<Value> = view.sample(i as u64).unwrap().iter().map(ValueRef::to_owned_value).collect();
            let from_reader = reader.read_sample(i as u64).unwrap();
            prop_assert!(row.iter().zip(&from_view).all(|(a, b)| same(a, b)));
            prop_assert!(row.iter().zip(&from_reader).all(|(a, b)| same(a, b)));
        }
        let expect = ShardExpect { bytes: shard.bytes.len() as u64, samples: rows.len() as u64, checksum: shard.checksum, schema: &schema };
        prop_assert!(verify_shard_bytes(&shard.bytes, "p.rjs", &expect).is_empty());
    }

    #[test]
    fn any_flipped_byte_is_reported((schema, rows) in dataset(), pos in any::<prop::sample::Index>(), mask in 1u8..=255) {
        let shard = build(&schema, &rows);
        let expect = ShardExpect { bytes: shard.bytes.len() as u64, samples: rows.len() as u64, checksum: shard.checksum, schema: &schema };
        let mut bad = shard.bytes.clone();
        let at = pos.index(bad.len());
        bad[at] ^= mask;
        let problems = verify_shard_bytes(&bad, "p.rjs", &expect);
        prop_assert!(!problems.is_empty(), "flip at {} of {} went unnoticed", at, bad.len());
        // Readers never hand out a sample whose bytes differ from what was written.
        if let Ok(view) = ShardView::parse(&bad, "p.rjs") {
            for (i, row) in rows.iter().enumerate() {
                if let Ok(vals) = view.sample(i as u64) {
                    let got: Vec<Value> = vals.iter().map(ValueRef::to_owned_value).collect();
                    prop_assert!(row.iter().zip(&got).all(|(a, b)| same(a, b)), "sample {} changed but passed its checks", i);
                }
            }
        }
    }

    #[test]
    fn any_truncation_is_reported((schema, rows) in dataset(), cut in any::<prop::sample::Index>()) {
        let shard = build(&schema, &rows);
        let expect = ShardExpect { bytes: shard.bytes.len() as u64, samples: rows.len() as u64, checksum: shard.checksum, schema: &schema };
        let short = &shard.bytes[..cut.index(shard.bytes.len())];
        prop_assert!(!verify_shard_bytes(short, "p.rjs", &expect).is_empty());
        prop_assert!(ShardReader::open(short, "p.rjs").is_err());
    }
}

#[test]
fn type_mismatch_names_the_sample_and_column() {
    let schema = Schema::new([("label", ColumnType::Int64)]).unwrap();
    let mut b = ShardBuilder::new(schema);
    let e = b
        .push(&[Value::Str("cat".into())], "images/cat/001.jpg")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("images/cat/001.jpg") && e.contains("\"label\" is int64"),
        "{e}"
    );
}

#[test]
fn one_sample_costs_two_reads_after_open() {
    use std::cell::Cell;
    struct Counting<'a>(&'a [u8], Cell<u32>);
    impl ramjet_engine::format::ReadAt for Counting<'_> {
        fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.1.set(self.1.get() + 1);
            self.0.read_exact_at(buf, offset)
        }
        fn size(&self) -> std::io::Result<u64> {
            Ok(self.0.len() as u64)
        }
    }
    let schema = Schema::new([("x", ColumnType::Bytes)]).unwrap();
    let rows: Vec<Vec<Value>> = (0..100).map(|i| vec![Value::Bytes(vec![i as u8; 1000])]).collect();
    let shard = build(&schema, &rows);
    let src = Counting(&shard.bytes, Cell::new(0));
    let r = ShardReader::open(&src, "c.rjs").unwrap();
    let opened = src.1.get();
    assert_eq!(opened, 3, "open reads header, schema and footer");
    for i in [0u64, 57, 99] {
        let before = src.1.get();
        r.read_record(i).unwrap();
        assert_eq!(src.1.get() - before, 2, "sample {i}");
    }
}
