//! `ramjet pack` from data people already have, in a format ramjet reads in place: a folder of
//! Parquet files (a Hugging Face dataset's split), LitData's optimized chunks, or a MosaicML
//! MDS folder.
//!
//! The input is opened as the loader opens it ([`Dataset::open`], learned on first open and
//! kept per host), so every foreign shard it packs from (a Parquet row group, a LitData chunk,
//! an MDS shard) is checked exactly as a read in place is checked: its bytes against the XXH3
//! the index recorded, then as a ramjet shard. The inputs are its samples, in its order
//! (shard by shard, row by row): input number `p` is sample `p` of the dataset, so a group of a
//! split pack starts at a known shard and row without any listing. A sample's name (in its
//! group's hash) is its foreign shard's key, that shard's checksum and its row, so a file
//! changed since a plan changes its groups' hashes and the task refuses it.
//!
//! The columns are the input's, as the reader maps them (docs/format.md). The image column (the
//! bytes column named `image`, or `--image-column`) gets what an image folder's images get:
//! `--check-decode` decodes it in full, `--jpeg-restarts` transcodes its JPEGs, and without
//! `width`/`height` columns of its own the rows gain the image's shown size.

use std::collections::BTreeMap;

use rayon::prelude::*;
use serde_json::{Map, Value as Json};

use ramjet_engine::format::{Column, ColumnType, Schema, ShardBuilder, ShardView, Value};
use ramjet_engine::image::probe::{probe, ImageFormat};
use ramjet_engine::image::turbo::with_restarts_or_given;
use ramjet_engine::{Dataset, Error, Result};

use super::{put_built, reason_of, rows_out, with_workers, Ctx, GroupOut, GroupStat, Layout, PackOptions, SourceKind};
use super::{Source, JPEG_RESTART_PX};

/// Where a foreign input's rows come from.
enum Reader {
    /// Read as the loader reads it in place.
    Engine(Box<Dataset>),
    /// A `save_to_disk` folder's Arrow files ([`super::arrow_rows`]).
    Arrow(super::arrow_rows::ArrowInput),
}

/// One unit a foreign input is read by (a foreign shard, or an Arrow file).
struct Unit {
    key: String,
    checksum: u64,
    bytes: u64,
}

/// A foreign input, opened: its units and where each starts.
pub struct ForeignInput {
    reader: Reader,
    units: Vec<Unit>,
    /// Sample index each unit starts at, and the total last.
    starts: Vec<u64>,
    schema: Schema,
    /// Names this version of the input (its manifest's version, or its files' checksums).
    version: String,
    /// Columns of image files, by their foreign encoding.
    images: Vec<String>,
}

/// Foreign encodings whose values are image files (Parquet's Hugging Face image struct,
/// LitData's and MDS's `jpeg`, MDS's `png` and `webp`).
const IMAGE_ENCODINGS: [&str; 4] = ["image", "jpeg", "png", "webp"];

impl ForeignInput {
    /// Opens `src` (a folder or prefix) as an input of `kind`: a `save_to_disk` folder by its
    /// Arrow files, anything else as a dataset read in place, which must be of `kind`.
    pub fn open(src: &Source, rt: &tokio::runtime::Runtime, kind: SourceKind) -> Result<ForeignInput> {
        if src.file.is_some() {
            return Err(Error::invalid(
                &src.display,
                format!("a {} input is a folder or prefix, not one file", kind.name()),
            ));
        }
        if kind == SourceKind::Arrow {
            let a = super::arrow_rows::ArrowInput::open(src, rt)?;
            let units: Vec<Unit> = a
                .files
                .iter()
                .map(|f| Unit {
                    key: f.name.clone(),
                    checksum: f.checksum,
                    bytes: f.bytes,
                })
                .collect();
            let sums: Vec<u8> = units.iter().flat_map(|u| u.checksum.to_le_bytes()).collect();
            let counts = a.files.iter().map(|f| f.rows);
            return Ok(ForeignInput {
                starts: starts(counts),
                units,
                schema: a.schema.clone(),
                version: format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&sums)),
                images: a.image_columns(),
                reader: Reader::Arrow(a),
            });
        }
        let ds = rt.block_on(Dataset::open(&src.display))?;
        let m = ds.manifest();
        let got = m.foreign().map(|f| f.format.name());
        let want = match kind {
            SourceKind::Parquet => "parquet",
            SourceKind::Litdata => "litdata",
            SourceKind::Mds => "mds",
            other => unreachable!("{} is not a foreign layout", other.name()),
        };
        if got != Some(want) {
            return Err(Error::invalid(
                &src.display,
                format!(
                    "--format {want}, but it reads as {}",
                    got.unwrap_or("a ramjet dataset (already packed)")
                ),
            ));
        }
        let units = m
            .shards()
            .map(|s| {
                s.map(|s| Unit {
                    checksum: s.checksum_u64(),
                    bytes: s.bytes,
                    key: s.key,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let counts = (0..m.shard_count())
            .map(|i| m.shard_samples(i))
            .collect::<Result<Vec<_>>>()?;
        let images = m
            .foreign()
            .map(|f| {
                f.columns
                    .iter()
                    .filter(|c| IMAGE_ENCODINGS.contains(&c.encoding.as_str()))
                    .map(|c| c.name.clone())
                    .collect()
            })
            .unwrap_or_default();
        Ok(ForeignInput {
            starts: starts(counts),
            units,
            schema: m.schema.clone(),
            version: m.version.clone(),
            images,
            reader: Reader::Engine(Box::new(ds)),
        })
    }

    /// Samples in all.
    pub fn items(&self) -> u64 {
        *self.starts.last().unwrap_or(&0)
    }

    /// Sample `pos`'s name in its group's hash (its unit's key and checksum, and its row) and
    /// in messages (`KEY row N`).
    pub fn name_of(&self, pos: u64) -> (String, String) {
        let s = self.starts.partition_point(|&x| x <= pos) - 1;
        let (u, row) = (&self.units[s], pos - self.starts[s]);
        (
            format!("{}#{:016x}#{row}", u.key, u.checksum),
            format!("{} row {row}", u.key),
        )
    }

    /// The units holding samples `[from, to)`, each with the rows of it in that range.
    fn spans(&self, from: u64, to: u64) -> Vec<(usize, std::ops::Range<u64>)> {
        let first = self.starts.partition_point(|&x| x <= from).saturating_sub(1);
        (first..self.starts.len() - 1)
            .take_while(|&s| self.starts[s] < to)
            .map(|s| {
                let (a, b) = (self.starts[s], self.starts[s + 1]);
                (s, from.max(a) - a..to.min(b) - a)
            })
            .filter(|(_, r)| !r.is_empty())
            .collect()
    }

    /// Rows `rows` of unit `s`, as values, each checked as its reader checks it: a foreign
    /// shard against the XXH3 its index recorded and then as a ramjet shard, an Arrow file
    /// against its first read's checksum.
    fn unit_rows(&self, ctx: &Ctx, s: usize, rows: std::ops::Range<u64>) -> Result<Vec<Result<Vec<Value>>>> {
        match &self.reader {
            Reader::Arrow(a) => a.rows(ctx.src, ctx.rt, s, rows),
            Reader::Engine(ds) => {
                let bytes = ctx.rt.block_on(ds.fetch_shard(s))?;
                let name = ds.store().url(&self.units[s].key);
                let view = ShardView::parse(&bytes, &name)?;
                Ok(rows
                    .map(|r| view.sample(r).map(|v| v.iter().map(|x| x.to_owned_value()).collect()))
                    .collect())
            }
        }
    }
}

/// Where each unit of `counts` samples starts, and the total last.
fn starts(counts: impl IntoIterator<Item = u64>) -> Vec<u64> {
    let mut at = 0u64;
    let mut out: Vec<u64> = counts
        .into_iter()
        .map(|n| {
            let s = at;
            at += n;
            s
        })
        .collect();
    out.push(at);
    out
}

/// Guesses whether a folder holds a format packed from its rows, from its top-level names: an
/// `index.json` (LitData's chunks or MosaicML's MDS, told apart by its fields), a
/// `save_to_disk` folder (`state.json` or `dataset_dict.json`), or Parquet files and no
/// subfolders.
pub fn detect(src: &Source, rt: &tokio::runtime::Runtime, dirs: &[String], files: &[String]) -> Option<SourceKind> {
    if files.iter().any(|f| f == "index.json") {
        let idx = src.read(rt, "index.json").ok()?;
        let j: Json = serde_json::from_slice(&idx).ok()?;
        if j.get("chunks").is_some() && j.get("config").is_some() {
            return Some(SourceKind::Litdata);
        }
        if j.get("shards").is_some() {
            return Some(SourceKind::Mds);
        }
    }
    if files.iter().any(|f| f == "state.json" || f == "dataset_dict.json") {
        return Some(SourceKind::Arrow);
    }
    (dirs.is_empty() && files.iter().any(|f| f.ends_with(".parquet"))).then_some(SourceKind::Parquet)
}

/// The layout of a foreign input: its columns, and the image column's size columns when it has
/// none; the manifest's metadata names what it was packed from.
pub fn layout(src: &Source, input: &ForeignInput, kind: SourceKind, opts: &PackOptions) -> Result<Layout> {
    let schema = input.schema.clone();
    let image = image_column(src, input, opts)?;
    let mut meta = Map::new();
    meta.insert(
        "packed_from".into(),
        serde_json::json!({
            "format": kind.name(),
            "source": src.display,
            "version": input.version,
        }),
    );
    let mut cols = schema.columns.clone();
    if let Some(c) = &image {
        meta.insert("image_column".into(), Json::from(c.as_str()));
        if schema.index_of("width").is_none() && schema.index_of("height").is_none() {
            meta.insert("image_dims".into(), serde_json::json!(["width", "height"]));
            for name in ["width", "height"] {
                cols.push(Column {
                    name: name.into(),
                    ty: ColumnType::Int64,
                    nullable: false,
                });
            }
        }
        if opts.jpeg_restarts {
            meta.insert("jpeg_restart_px".into(), Json::from(JPEG_RESTART_PX));
        }
    }
    let schema = Schema::from_columns(cols)?;
    let schema = match &opts.tokenizer {
        None => schema,
        Some(path) => {
            let tok = super::tokens::Tok::load(path)?;
            let (schema, info) = super::tokens::tokenized_schema(&schema, &opts.text_column, &tok, &src.display)?;
            meta.insert("tokenizer".into(), info);
            schema
        }
    };
    Ok(Layout { kind, schema, meta })
}

/// The input's image column: `--image-column` (a bytes column), else the column named `image`
/// if its encoding is an image file's, else the first such column, else none (then
/// `--check-decode` and `--jpeg-restarts` have nothing to work on and are refused).
fn image_column(src: &Source, input: &ForeignInput, opts: &PackOptions) -> Result<Option<String>> {
    let schema = &input.schema;
    if let Some(name) = opts.image_column.as_deref() {
        return match schema.index_of(name).map(|i| &schema.columns[i]) {
            Some(c) if c.ty == ColumnType::Bytes => Ok(Some(name.to_owned())),
            Some(c) => Err(Error::invalid(
                "--image-column",
                format!(
                    "column {name:?} of {} holds {}, not image bytes",
                    src.display,
                    c.ty.name()
                ),
            )),
            None => Err(Error::invalid(
                "--image-column",
                format!("no column {name:?} in {} ({})", src.display, schema.describe()),
            )),
        };
    }
    let images = &input.images;
    let found = images.iter().find(|c| *c == "image").or(images.first());
    if found.is_none() {
        for (flag, set) in [
            ("--check-decode", opts.check_decode),
            ("--jpeg-restarts", opts.jpeg_restarts),
        ] {
            if set {
                return Err(Error::invalid(
                    flag,
                    format!(
                        "{} has no column of image files ({}): name one with --image-column",
                        src.display,
                        schema.describe()
                    ),
                ));
            }
        }
    }
    Ok(found.map(|c| c.to_string()))
}

/// One sample's values as packed, and its size: the image checked (`--check-decode`),
/// transcoded (`--jpeg-restarts`) and measured (the size columns pack adds).
fn row_values(ctx: &Ctx, mut vals: Vec<Value>, what: &str) -> Result<(Vec<Value>, u64)> {
    let meta = &ctx.layout.meta;
    let image = meta
        .get("image_column")
        .and_then(Json::as_str)
        .and_then(|c| ctx.layout.schema.index_of(c));
    if meta.contains_key("image_dims") {
        vals.extend([Value::Int64(0), Value::Int64(0)]);
    }
    if let Some(ic) = image {
        let Value::Bytes(b) = &mut vals[ic] else {
            return Err(Error::invalid(what, "the image column holds no bytes"));
        };
        let info = probe(b).map_err(|r| Error::invalid(what, format!("image: {r}")))?;
        if ctx.opts.check_decode {
            ramjet_engine::image::decode_rgb(b, 1, None)
                .map_err(|r| Error::invalid(what, format!("image does not decode: {r}")))?;
        }
        if ctx.opts.jpeg_restarts && info.format == ImageFormat::Jpeg {
            *b = with_restarts_or_given(std::mem::take(b), JPEG_RESTART_PX);
        }
        if meta.contains_key("image_dims") {
            let (w, h) = ramjet_engine::image::exif::orientation(b).displayed(info.width, info.height);
            let n = vals.len();
            (vals[n - 2], vals[n - 1]) = (Value::Int64(w as i64), Value::Int64(h as i64));
        }
    }
    let size = ramjet_engine::format::encoded_len(&vals);
    Ok((vals, size))
}

/// The rows `rows` of unit `s` (read and checked by [`ForeignInput::unit_rows`]), made into
/// values on the pack's pool; a row that cannot be made is an error naming it. The unit's
/// bytes are returned beside them.
type Rows = (Vec<(u64, Result<(Vec<Value>, u64)>)>, u64);

fn read_rows(
    ctx: &Ctx,
    input: &ForeignInput,
    tokenize: Option<&super::tokens::Tokenize>,
    s: usize,
    rows: std::ops::Range<u64>,
) -> Result<Rows> {
    let got = input.unit_rows(ctx, s, rows.clone())?;
    let (start, key) = (input.starts[s], &input.units[s].key);
    let what = |r: usize| ctx.src.name(&format!("{key} row {r}"));
    let mut made: Vec<Result<(Vec<Value>, u64)>> = got
        .into_par_iter()
        .enumerate()
        .map(|(k, vals)| vals.and_then(|v| row_values(ctx, v, &what(rows.start as usize + k))))
        .collect();
    if let Some(t) = tokenize {
        // The tokenizer's batch names a row by its number in the unit.
        let names: Vec<(usize, String)> = rows.clone().map(|r| (r as usize, String::new())).collect();
        t.apply(&names, &mut made, &what);
    }
    let made = rows.map(|r| start + r).zip(made).collect();
    Ok((made, input.units[s].bytes))
}

/// Packs samples `[first_pos, first_pos + limit)` of a foreign input (all of it from
/// `first_pos` when `limit` is `None`): its shards are read one after the other, their rows
/// pushed in order into the current shard, and each full shard finished and uploaded by a
/// worker while the next fills, as a JSONL input's lines are (`pack_jsonl`). A shard never spans
/// two groups. A foreign shard that fails its check fails the pack naming it, or with
/// `--skip-bad` skips its rows (listed once per group they fall in).
pub(crate) fn pack_rows(
    ctx: &Ctx,
    input: &ForeignInput,
    first_pos: u64,
    limit: Option<u64>,
) -> Result<BTreeMap<u64, GroupOut>> {
    let gi = ctx.opts.group_items;
    let schema = &ctx.layout.schema;
    let tokenize = super::tokens::Tokenize::of(ctx)?;
    let end = limit.map_or(input.items(), |n| (first_pos + n).min(input.items()));
    let mut stats: BTreeMap<u64, GroupStat> = BTreeMap::new();
    for p in first_pos..end {
        let (name, label) = input.name_of(p);
        stats.entry(p / gi).or_default().add(name.as_bytes(), p, || label);
    }
    let mut skips: Vec<(u64, String, String)> = Vec::new();
    let mut read_bytes: BTreeMap<u64, u64> = BTreeMap::new();
    let mut dedupe_keys: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let done = with_workers(
        |(g, j, b): (u64, u64, ShardBuilder)| put_built(ctx, g, j, b, "samples"),
        |send| {
            let mut filling = super::Filling::new(first_pos / gi);
            for (s, rows) in input.spans(first_pos, end) {
                let (made, bytes) = match read_rows(ctx, input, tokenize.as_ref(), s, rows.clone()) {
                    Ok(m) => m,
                    Err(e) if ctx.opts.skip_bad => {
                        let a = input.starts[s] + rows.start;
                        let b = input.starts[s] + rows.end;
                        let key = &input.units[s].key;
                        for g in a / gi..=(b - 1) / gi {
                            let (ra, rb) = (a.max(g * gi) - input.starts[s], b.min((g + 1) * gi) - input.starts[s]);
                            skips.push((g, ctx.src.name(&format!("{key} rows {ra}..{rb}")), reason_of(&e)));
                        }
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                ctx.progress.inc(bytes);
                let share = bytes / made.len().max(1) as u64;
                for (p, r) in made {
                    let g = p / gi;
                    let what = || ctx.src.name(&input.name_of(p).1);
                    let (vals, size) = match r {
                        Ok(v) => v,
                        Err(e) if ctx.opts.skip_bad => {
                            skips.push((g, what(), reason_of(&e)));
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    if !filling.push(ctx, g, &vals, size, &what(), send)? {
                        return Ok(());
                    }
                    if let Some(d) = &ctx.dedupe {
                        dedupe_keys.entry(g).or_default().push(d.key(schema, &vals, p));
                    }
                    *read_bytes.entry(g).or_default() += share;
                }
            }
            filling.finish(send);
            Ok(())
        },
    );
    Ok(rows_out(stats, skips, read_bytes, dedupe_keys, done?))
}
