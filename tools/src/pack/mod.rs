//! `ramjet pack`: converts an image-classification folder, a YOLO layout, a JSONL file or data
//! in another format ([`foreign`]), on a local disk or in an object store, into shards plus a
//! manifest; on one machine, or split into tasks (a Slurm job array) and merged ([`split`]).
//!
//! The input is a sequence in a fixed order (`source.rs`), cut into **groups** of
//! [`PackOptions::group_items`] inputs (65,536 unless set). Each group is packed on its own, the
//! same way whoever packs it: its inputs are scanned, planned into shards greedily by estimated
//! size in input order (the last shard of a group ends with it), and each shard is read, checked,
//! encoded and uploaded by a worker. Shard `j` of group `g` is stored under key index
//! `g x group_items + j` (`shards/<index>-<checksum>.rjs`), so the shards of a dataset are the
//! same bytes under the same keys whether one process packed it or a thousand tasks did, and a
//! dataset smaller than one group packs exactly as before groups existed.
//!
//! Memory stays near `threads x shard size`: inputs are listed and scanned a chunk at a time,
//! and a shard waits for a free worker. The manifest is written last, first as
//! `manifests/<version>.json` and then as `manifest.json`: if any step fails, no new
//! `manifest.json` appears.

pub mod arrow_rows;
pub mod dedupe;
pub mod foreign;
pub mod source;
pub mod split;
pub mod tokens;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rayon::prelude::*;
use serde_json::{Map, Value as Json};

use ramjet_engine::format::array::Array;
use ramjet_engine::format::{
    columns_key, shard_key, Column, ColumnType, ColumnsInfo, Manifest, Schema, ShardBuilder, ShardInfo, ShardTable,
    Value, MANIFEST_NAME, NULL_INT64, SHARD_TABLE_AUTO_MIN,
};
use ramjet_engine::image::probe::{probe, ImageFormat};
use ramjet_engine::image::turbo::with_restarts_or_given;
use ramjet_engine::{Error, Result, Store};

pub use source::Source;

/// Input layouts `pack` understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SourceKind {
    /// `images/` and `labels/` (YOLO txt), with an optional `data.yaml` of class names.
    Yolo,
    /// One subfolder per class, images inside.
    Imagefolder,
    /// One JSON object per line.
    Jsonl,
    /// Parquet files (a Hugging Face dataset's split), read as the loader reads them in place.
    Parquet,
    /// LitData's optimized chunks (`index.json` and `chunk-*.bin`).
    Litdata,
    /// A MosaicML Streaming (MDS) folder.
    Mds,
    /// A Hugging Face `datasets` folder written by `save_to_disk` (Arrow IPC streams).
    Arrow,
}

impl SourceKind {
    /// Name stored in the manifest's `source` field.
    pub fn name(self) -> &'static str {
        match self {
            SourceKind::Yolo => "yolo",
            SourceKind::Imagefolder => "imagefolder",
            SourceKind::Jsonl => "jsonl",
            SourceKind::Parquet => "parquet",
            SourceKind::Litdata => "litdata",
            SourceKind::Mds => "mds",
            SourceKind::Arrow => "arrow",
        }
    }

    /// A format ramjet reads in place, packed from its samples ([`foreign`]).
    pub fn is_foreign(self) -> bool {
        matches!(
            self,
            SourceKind::Parquet | SourceKind::Litdata | SourceKind::Mds | SourceKind::Arrow
        )
    }

    /// The layout of a manifest's `source` field.
    pub fn from_name(n: &str) -> Option<SourceKind> {
        [
            SourceKind::Yolo,
            SourceKind::Imagefolder,
            SourceKind::Jsonl,
            SourceKind::Parquet,
            SourceKind::Litdata,
            SourceKind::Mds,
            SourceKind::Arrow,
        ]
        .into_iter()
        .find(|k| k.name() == n)
    }

    /// Guesses a folder's layout from its top-level folders: `images/` and `labels/` make it
    /// YOLO, anything else an image folder. (A file is JSONL.)
    pub fn detect(dirs: &[String]) -> SourceKind {
        if dirs.iter().any(|d| d == "images") && dirs.iter().any(|d| d == "labels") {
            return SourceKind::Yolo;
        }
        SourceKind::Imagefolder
    }
}

/// Inputs in a group unless set: 65,536 (about 150 shards of 64 MiB at 150 KB an image), so
/// that 9.5 billion images make about 145,000 groups, enough to spread over any job array.
pub const GROUP_ITEMS_DEFAULT: u64 = 65_536;

/// Options of `ramjet pack`.
#[derive(Debug, Clone)]
pub struct PackOptions {
    /// Shards are cut when the next sample would take them past this size.
    pub shard_bytes_target: u64,
    /// Shards are also cut at this many samples (`--shard-samples`): with a group size that is
    /// a multiple of it and nothing skipped, every shard but the last holds exactly as many,
    /// and the shard table says so (uniform, `docs/format.md`).
    pub shard_samples_max: Option<u64>,
    /// Skip unreadable or unsupported inputs instead of aborting.
    pub skip_bad: bool,
    /// Layout; detected when `None`.
    pub kind: Option<SourceKind>,
    /// Where the shards are listed.
    pub shard_table: ShardTableMode,
    /// Store each JPEG of an image folder or YOLO layout transcoded losslessly with restart
    /// markers ([`JPEG_RESTART_PX`]), so that a crop decodes only its part of the image. The
    /// pixels are the same; the bytes are not.
    pub jpeg_restarts: bool,
    /// Decode every image of an image folder or YOLO layout in full (in the pack's parallel
    /// workers), not only its header: an image whose data does not decode is refused (or
    /// skipped and listed with `skip_bad`) at pack time rather than by the loader, epochs later.
    pub check_decode: bool,
    /// Inputs in a group: the unit a pack is split into. The same input packed with the same
    /// group size gives the same shards whatever the number of tasks.
    pub group_items: u64,
    /// A JSONL column whose values name image objects (a key relative to the JSONL's folder, a
    /// path, or a URL): each is fetched and stored in its place as the image's bytes.
    pub image_column: Option<String>,
    /// JSONL columns whose type is given rather than taken from the first line, as
    /// `NAME:TYPE` (`tokens:int32[?]`, `emb:float32[768]`): an array type reads JSON lists of
    /// numbers (nested for more axes).
    pub column_types: Vec<String>,
    /// A Hugging Face `tokenizer.json` (a local file): the JSONL column `text_column` is
    /// tokenized and stored as a `tokens` array column in its place (`uint16[?]` when the
    /// tokenizer's largest id is at most 65,535, else `uint32[?]`).
    pub tokenizer: Option<String>,
    /// The column `tokenizer` reads.
    pub text_column: String,
    /// `--dedupe KEY|content`: drop each sample whose column `KEY` (or image bytes) an earlier
    /// sample had ([`dedupe`]).
    pub dedupe: Option<String>,
}

pub use ramjet_engine::image::turbo::JPEG_RESTART_PX;

/// Where a packed dataset lists its shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ShardTableMode {
    /// A binary shard table above [`SHARD_TABLE_AUTO_MIN`] shards, else the JSON.
    Auto,
    /// Always a binary shard table.
    Always,
    /// Always the manifest's JSON.
    Never,
}

impl ShardTableMode {
    /// Whether a dataset of `shards` shards gets a binary table.
    pub fn table_for(self, shards: u64) -> bool {
        match self {
            ShardTableMode::Always => true,
            ShardTableMode::Never => false,
            ShardTableMode::Auto => shards > SHARD_TABLE_AUTO_MIN as u64,
        }
    }
}

impl Default for PackOptions {
    fn default() -> Self {
        Self {
            shard_bytes_target: 64 << 20,
            shard_samples_max: None,
            skip_bad: false,
            kind: None,
            shard_table: ShardTableMode::Auto,
            jpeg_restarts: false,
            check_decode: false,
            group_items: GROUP_ITEMS_DEFAULT,
            image_column: None,
            column_types: Vec::new(),
            tokenizer: None,
            text_column: "text".into(),
            dedupe: None,
        }
    }
}

impl PackOptions {
    fn check(&self) -> Result<()> {
        if self.shard_bytes_target < 4096 {
            return Err(Error::invalid("--shard-size", "must be at least 4096 bytes"));
        }
        if self.shard_samples_max.is_some_and(|n| n == 0 || n > u32::MAX as u64) {
            return Err(Error::invalid(
                "--shard-samples",
                "must be between 1 and 2^32 - 1 samples",
            ));
        }
        if self.group_items == 0 || self.group_items > 1 << 32 {
            return Err(Error::invalid("--group-size", "must be between 1 and 2^32 inputs"));
        }
        Ok(())
    }

    /// Whether a shard of `samples` samples is full by `--shard-samples`.
    fn shard_full(&self, samples: usize) -> bool {
        self.shard_samples_max.is_some_and(|n| samples as u64 >= n)
    }
}

/// What [`pack`] did.
#[derive(Debug, Clone)]
pub struct PackReport {
    /// The manifest written.
    pub manifest: Manifest,
    /// URL of `manifest.json`.
    pub manifest_url: String,
    /// Inputs skipped with `--skip-bad`: (path or `path:line`, reason).
    pub skipped: Skipped,
    /// Input bytes read.
    pub input_bytes: u64,
    /// Wall time.
    pub elapsed: Duration,
}

/// Inputs skipped with `--skip-bad`: (path or `path:line`, reason).
pub type Skipped = Vec<(String, String)>;

/// A layout's schema and the manifest's metadata.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Its kind.
    pub kind: SourceKind,
    /// The schema of its shards.
    pub schema: Schema,
    /// The manifest's metadata (classes, source file, ...).
    pub meta: Map<String, Json>,
}

/// One group as packed: what it held and what it gave.
#[derive(Debug, Default)]
pub struct GroupOut {
    /// Inputs in the group (skipped ones included).
    pub items: u64,
    /// The group's hash ([`item_hash`] summed over its input names, or JSONL lines).
    pub hash: u64,
    /// The group's first input's name.
    pub first: String,
    /// Its shards, in order.
    pub shards: Vec<ShardInfo>,
    /// Inputs skipped with `--skip-bad`, in input order.
    pub skipped: Skipped,
    /// Input bytes read.
    pub input_bytes: u64,
    /// With `--dedupe`, each packed sample's key, in order.
    pub keys: Vec<u64>,
}

/// Running statistics of a group while its inputs are read.
#[derive(Default)]
pub(crate) struct GroupStat {
    items: u64,
    hash: u64,
    first: String,
}

/// One input's share of its group's hash: xxh3-64 of its name seeded with its position in the
/// input. A group's hash is the wrapping sum of its inputs' shares, so parts of a group listed
/// apart (a plan's units, listed in parallel) add up to the same hash, while a name moved,
/// added or removed changes it.
pub(crate) fn item_hash(name: &[u8], pos: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(name, pos)
}

impl GroupStat {
    fn add(&mut self, name: &[u8], pos: u64, label: impl FnOnce() -> String) {
        if self.items == 0 {
            self.first = label();
        }
        self.items += 1;
        self.hash = self.hash.wrapping_add(item_hash(name, pos));
    }
    fn into_out(self) -> GroupOut {
        GroupOut {
            items: self.items,
            hash: self.hash,
            first: self.first,
            ..GroupOut::default()
        }
    }
}

/// Everything a pack's steps share.
pub(crate) struct Ctx<'a> {
    pub src: &'a Source,
    pub dst: &'a Store,
    pub rt: &'a tokio::runtime::Runtime,
    pub opts: &'a PackOptions,
    pub layout: &'a Layout,
    pub progress: &'a indicatif::ProgressBar,
    /// Names the pack in progress lines ("pack", "pack task 2/6").
    pub label: String,
    /// Inputs packed so far (progress lines count them).
    pub objects: std::sync::atomic::AtomicU64,
    /// `--dedupe`, resolved against the layout's schema.
    pub dedupe: Option<dedupe::DedupeBy>,
}

/// `--dedupe` resolved against `layout`'s schema.
pub(crate) fn dedupe_by(opts: &PackOptions, layout: &Layout) -> Result<Option<dedupe::DedupeBy>> {
    let image = match layout.kind {
        SourceKind::Jsonl => opts.image_column.as_deref(),
        k if k.is_foreign() => layout.meta.get("image_column").and_then(Json::as_str),
        _ => Some("image"),
    };
    opts.dedupe
        .as_deref()
        .map(|by| dedupe::DedupeBy::resolve(by, &layout.schema, image))
        .transpose()
}

/// The runtime a pack's requests run on.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io("tokio runtime", e))
}

/// Packs `src` (a local folder or file, or an object store prefix or JSONL object) into `dst`
/// (a local folder or an object-store URL), on this machine.
pub fn pack(src: &str, dst: &str, opts: &PackOptions, progress: &indicatif::ProgressBar) -> Result<PackReport> {
    let t0 = Instant::now();
    opts.check()?;
    let source = Source::open(src)?;
    let store = open_dst(dst)?;
    let rt = runtime()?;
    let layout = layout(&source, &rt, opts)?;
    let input = match layout.kind.is_foreign() {
        true => Some(foreign::ForeignInput::open(&source, &rt, layout.kind)?),
        false => None,
    };
    let ctx = Ctx {
        src: &source,
        dst: &store,
        rt: &rt,
        opts,
        layout: &layout,
        progress,
        label: "pack".into(),
        objects: Default::default(),
        dedupe: dedupe_by(opts, &layout)?,
    };
    let groups = if let Some(input) = &input {
        foreign::pack_rows(&ctx, input, 0, None)?
    } else if layout.kind == SourceKind::Jsonl {
        progress.set_length(source.file_len(&rt)?);
        pack_jsonl(&ctx, source.file_reader(&rt, 0)?, 0, None)?
    } else {
        pack_files(&ctx, None, 0, None)?
    };
    progress.finish_and_clear();
    if groups.is_empty() {
        let what = if layout.kind == SourceKind::Jsonl {
            "no JSON objects found"
        } else {
            "no samples found"
        };
        return Err(Error::invalid(src, what));
    }
    let (mut shards, mut skipped, mut input_bytes) = (Vec::new(), Vec::new(), 0);
    let mut pass = dedupe::Pass::default();
    for (gi, g) in groups {
        if ctx.dedupe.is_some() {
            let samples = g.shards.iter().map(|s| s.samples).sum();
            pass.group(&g.keys, samples, &format!("group {gi}"))?;
        }
        shards.extend(g.shards);
        skipped.extend(g.skipped);
        input_bytes += g.input_bytes;
    }
    if shards.is_empty() {
        return Err(Error::invalid(src, "every input was skipped"));
    }
    let mut layout = layout.clone();
    if let Some(d) = &ctx.dedupe {
        pass.finish(d.name(), &store, &rt, &mut layout.meta)?;
    }
    let manifest = write_manifest(&store, &rt, &layout, opts.shard_table, &shards)?;
    Ok(PackReport {
        manifest_url: store.url(MANIFEST_NAME),
        manifest,
        skipped,
        input_bytes,
        elapsed: t0.elapsed(),
    })
}

/// Writes the shard table (if the mode asks for one), then `manifests/<version>.json`, then
/// `manifest.json`, last.
pub(crate) fn write_manifest(
    store: &Store,
    rt: &tokio::runtime::Runtime,
    layout: &Layout,
    mode: ShardTableMode,
    shards: &[ShardInfo],
) -> Result<Manifest> {
    let (kind, schema, meta) = (layout.kind.name(), layout.schema.clone(), layout.meta.clone());
    let manifest = if mode.table_for(shards.len() as u64) {
        let t = ShardTable::build(shards).map_err(|why| Error::invalid("shard table", why))?;
        put_table_and(store, rt, t, |t, key| Manifest::with_table(kind, schema, meta, t, key))?
    } else {
        Manifest::new(kind, schema, meta, shards.to_vec())
    };
    put_manifest(store, rt, &manifest)?;
    Ok(manifest)
}

/// Uploads a shard table (before any manifest names it) and makes the manifest that does.
pub(crate) fn put_table_and(
    store: &Store,
    rt: &tokio::runtime::Runtime,
    t: ShardTable,
    make: impl FnOnce(ShardTable, String) -> Manifest,
) -> Result<Manifest> {
    let key = format!("tables/{:016x}.rjt", t.checksum());
    rt.block_on(store.put(&key, t.as_bytes().expect("built in memory").clone()))?;
    Ok(make(t, key))
}

/// `manifests/<version>.json`, then `manifest.json`.
pub(crate) fn put_manifest(store: &Store, rt: &tokio::runtime::Runtime, manifest: &Manifest) -> Result<()> {
    let bytes = Bytes::from(manifest.to_bytes());
    rt.block_on(async {
        store
            .put(&format!("manifests/{}.json", manifest.version), bytes.clone())
            .await?;
        store.put(MANIFEST_NAME, bytes).await
    })
}

/// The layout of `src`: its kind (detected unless given), schema and metadata.
pub fn layout(src: &Source, rt: &tokio::runtime::Runtime, opts: &PackOptions) -> Result<Layout> {
    // A folder's top level, listed once: it tells the layout and an image folder's classes.
    let top = match src.file {
        Some(_) => None,
        None if opts.kind.is_some_and(|k| k != SourceKind::Imagefolder) => None,
        None => Some(src.top(rt)?),
    };
    let kind = match (opts.kind, &top) {
        (Some(k), _) => k,
        (None, None) => SourceKind::Jsonl,
        (None, Some((d, f))) => foreign::detect(src, rt, d, f).unwrap_or_else(|| SourceKind::detect(d)),
    };
    let dirs = top.map(|t| t.0);
    if kind.is_foreign() {
        if !opts.column_types.is_empty() {
            let why = format!(
                "a {} input's columns are typed by its files, and are packed as read",
                kind.name()
            );
            return Err(Error::invalid("--column", why));
        }
        let input = foreign::ForeignInput::open(src, rt, kind)?;
        return foreign::layout(src, &input, kind, opts);
    }
    if !opts.column_types.is_empty() && kind != SourceKind::Jsonl {
        return Err(Error::invalid(
            "--column",
            "only a JSONL input's column types can be given",
        ));
    }
    if opts.tokenizer.is_some() && kind != SourceKind::Jsonl {
        return Err(Error::invalid(
            "--tokenizer",
            "tokenizes a JSONL input's text column only",
        ));
    }
    if opts.image_column.is_some() && kind != SourceKind::Jsonl {
        return Err(Error::invalid(
            "--image-column",
            "only a JSONL input names images by column",
        ));
    }
    let mut l = match kind {
        SourceKind::Jsonl => jsonl_layout(src, rt, opts)?,
        SourceKind::Yolo => yolo_layout(src, rt)?,
        SourceKind::Imagefolder => imagefolder_layout(match dirs {
            Some(d) => d,
            None => src.top(rt)?.0,
        })?,
        foreign => unreachable!("{} is packed by its reader", foreign.name()),
    };
    if opts.jpeg_restarts && kind != SourceKind::Jsonl {
        l.meta.insert("jpeg_restart_px".into(), Json::from(JPEG_RESTART_PX));
    }
    Ok(l)
}

/// Inputs scanned at a time (file sizes, YOLO labels), in parallel.
const SCAN_CHUNK: usize = 4096;

/// One input found by the listing of a folder: a file (with its class for an image folder, and
/// its size when the listing gave it), or one refused as found (a loose file in an image
/// folder).
pub(crate) enum Found {
    File { rel: String, class: i64, size: Option<u64> },
    Bad(String, Error),
}

impl Found {
    pub(crate) fn rel(&self) -> &str {
        match self {
            Found::File { rel, .. } | Found::Bad(rel, _) => rel,
        }
    }
}

/// One input sample, as found by the scan.
struct Item {
    /// Key relative to the source: used in messages and stored in the `path` column.
    rel: String,
    /// Position in the input (its group is `pos / group_items`).
    pos: u64,
    /// Estimated record size, used to plan shards.
    size: u64,
    extra: Extra,
}

enum Extra {
    /// Image-folder class index.
    Label(i64),
    /// YOLO boxes as compact JSON.
    Boxes(String),
}

/// An image folder's or a YOLO layout's inputs as units listed one after the other: the names
/// of files loose at an image folder's top (each refused), then its classes (each a folder
/// walked, with its class index), or YOLO's `images/` (one folder). A plan lists the units in
/// parallel.
pub(crate) type Units = (Vec<String>, Vec<(String, i64)>);

/// The units of `kind`'s inputs in `src` ([`Units`]).
pub(crate) fn units(src: &Source, rt: &tokio::runtime::Runtime, kind: SourceKind) -> Result<Units> {
    match kind {
        SourceKind::Yolo => Ok((Vec::new(), vec![("images".to_owned(), -1)])),
        SourceKind::Imagefolder => {
            let (classes, loose) = src.top(rt)?;
            Ok((
                loose,
                classes.into_iter().enumerate().map(|(i, c)| (c, i as i64)).collect(),
            ))
        }
        k => unreachable!("{} inputs are not listed", k.name()),
    }
}

/// The inputs of an image folder or a YOLO layout in order ([`Units`]), starting after key
/// `after`: a loose file's name, or a key in a unit (its first component names the class).
pub(crate) fn entries(
    src: &Source,
    rt: &tokio::runtime::Runtime,
    kind: SourceKind,
    after: Option<&str>,
) -> Result<Box<dyn Iterator<Item = Result<Found>> + Send>> {
    let (loose, units) = units(src, rt, kind)?;
    // Where `after` is: among the loose files (no `/`), or in a unit (the one it is under).
    let (loose_after, unit_after) = match after {
        None => (None, None),
        Some(a) => match units.iter().position(|(u, _)| a.starts_with(&format!("{u}/"))) {
            Some(i) => (None, Some((i, a.to_owned()))),
            None if !a.contains('/') => (Some(a.to_owned()), None),
            // Not under any unit: after everything before the unit it would sort into.
            None => (
                None,
                Some((units.partition_point(|(u, _)| u.as_str() < a), String::new())),
            ),
        },
    };
    let skip_loose = unit_after.is_some();
    let refused: Vec<Result<Found>> = loose
        .into_iter()
        .filter(|n| !skip_loose && loose_after.as_deref().is_none_or(|a| n.as_str() > a))
        .map(|n| {
            let e = Error::invalid(src.name(&n), "file is not inside a class folder");
            Ok(Found::Bad(n, e))
        })
        .collect();
    let (src, h) = (src.clone(), rt.handle().clone());
    let files = units
        .into_iter()
        .enumerate()
        .filter(|(i, _)| unit_after.as_ref().is_none_or(|(ua, _)| i >= ua))
        .collect::<Vec<_>>()
        .into_iter()
        .flat_map(move |(i, (under, class))| {
            let after = unit_after
                .as_ref()
                .filter(|(ua, k)| *ua == i && !k.is_empty())
                .map(|(_, k)| k.clone());
            src.walk(&h, &under, after.as_deref())
                .map(move |r| r.map(|(rel, size)| Found::File { rel, class, size }))
        });
    Ok(Box::new(refused.into_iter().chain(files)))
}

/// What building one planned shard gave: the shard (none if every input was skipped), the
/// inputs skipped, and the input bytes read.
type ShardOutcome = (Option<ShardInfo>, Skipped, u64, Vec<u64>);

/// Packs the files of an image folder or a YOLO layout from after key `after` (the whole
/// input when `None`), at most `limit` of them, the first being input number `first_pos`: a
/// stream, listed and scanned a chunk at a time, planned into shards as they come (a shard
/// never spans two groups), each shard built and uploaded by a worker while the listing goes
/// on. Memory holds one chunk of scanned inputs and the shards being built (one per worker,
/// one queued), not the listing. Returns each group met, packed.
pub(crate) fn pack_files(
    ctx: &Ctx,
    after: Option<&str>,
    first_pos: u64,
    limit: Option<u64>,
) -> Result<BTreeMap<u64, GroupOut>> {
    let gi = ctx.opts.group_items;
    let found = entries(ctx.src, ctx.rt, ctx.layout.kind, after)?;
    let mut found: Box<dyn Iterator<Item = Result<Found>> + Send> = match limit {
        Some(n) => Box::new(found.take(n as usize)),
        None => found,
    };
    let side_schema = ctx.layout.schema.without_bytes();
    let mut stats: BTreeMap<u64, GroupStat> = BTreeMap::new();
    let mut scan_skips: Vec<(u64, String, String)> = Vec::new();
    let done = with_workers(
        |(g, j, items): (u64, u64, Vec<Item>)| Ok((g, j, build_shard(ctx, g * gi + j, &items, side_schema.as_ref())?)),
        |send| {
            let mut pos = first_pos;
            let (mut plan, mut acc, mut cur, mut j): (Vec<Item>, u64, u64, u64) = (Vec::new(), 0, first_pos / gi, 0);
            loop {
                let chunk: Vec<Found> = found.by_ref().take(SCAN_CHUNK).collect::<Result<_>>()?;
                if chunk.is_empty() {
                    break;
                }
                for (k, f) in chunk.iter().enumerate() {
                    let p = pos + k as u64;
                    stats
                        .entry(p / gi)
                        .or_default()
                        .add(f.rel().as_bytes(), p, || f.rel().to_owned());
                }
                let scanned = scan_chunk(ctx, chunk, pos);
                pos += scanned.len() as u64;
                for (p, rel, r) in scanned {
                    let it = match r {
                        Ok(it) => it,
                        Err(e) if ctx.opts.skip_bad => {
                            scan_skips.push((p / gi, rel, reason_of(&e)));
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    ctx.progress.inc_length(it.size);
                    let g = it.pos / gi;
                    if g != cur {
                        // A group's last shard ends with it.
                        if !plan.is_empty() && !send((cur, j, std::mem::take(&mut plan))) {
                            return Ok(());
                        }
                        (cur, j, acc) = (g, 0, 0);
                    }
                    if acc > 0 && (acc + it.size > ctx.opts.shard_bytes_target || ctx.opts.shard_full(plan.len())) {
                        if !send((cur, j, std::mem::take(&mut plan))) {
                            return Ok(());
                        }
                        j += 1;
                        acc = 0;
                    }
                    acc += it.size;
                    plan.push(it);
                }
            }
            if !plan.is_empty() {
                send((cur, j, plan));
            }
            Ok(())
        },
    );
    let mut done = done?;
    let mut out: BTreeMap<u64, GroupOut> = stats.into_iter().map(|(g, s)| (g, s.into_out())).collect();
    for (g, rel, why) in scan_skips {
        out.entry(g).or_default().skipped.push((rel, why));
    }
    done.sort_by_key(|(g, j, _)| (*g, *j));
    for (g, _, (info, sk, read, keys)) in done {
        let o = out.entry(g).or_default();
        o.shards.extend(info);
        o.skipped.extend(sk);
        o.input_bytes += read;
        o.keys.extend(keys);
    }
    Ok(out)
}

/// YOLO's label file for image `rel` (`images/a/b.jpg` → `labels/a/b.txt`).
fn label_key(rel: &str) -> String {
    let under = rel.strip_prefix("images/").unwrap_or(rel);
    let cut = match under.rfind('.') {
        Some(i) if i > under.rfind('/').map_or(0, |s| s + 1) => i,
        _ => under.len(),
    };
    format!("labels/{}.txt", &under[..cut])
}

/// Scans a chunk of inputs, the first being input number `pos`: each one's size (from the
/// listing, or a local file's metadata) and, for YOLO, its label file's boxes (fetched together
/// from an object store). Returns each input's position, name and item, in order.
fn scan_chunk(ctx: &Ctx, chunk: Vec<Found>, pos: u64) -> Vec<(u64, String, Result<Item>)> {
    let kind = ctx.layout.kind;
    let labels: Vec<Option<Result<Option<Vec<u8>>>>> = if kind == SourceKind::Yolo {
        let keys: Vec<String> = chunk.iter().map(|f| label_key(f.rel())).collect();
        ctx.src.read_opt_all(ctx.rt, &keys).into_iter().map(Some).collect()
    } else {
        chunk.iter().map(|_| None).collect()
    };
    chunk
        .into_par_iter()
        .zip(labels)
        .enumerate()
        .map(|(k, (f, label))| {
            let p = pos + k as u64;
            match f {
                Found::Bad(rel, e) => (p, rel, Err(e)),
                Found::File { rel, class, size } => {
                    let r = scan_one(ctx, &rel, class, size, label, p);
                    (p, rel, r)
                }
            }
        })
        .collect()
}

/// One input's item: its estimated record size and its label or boxes.
fn scan_one(
    ctx: &Ctx,
    rel: &str,
    class: i64,
    size: Option<u64>,
    label: Option<Result<Option<Vec<u8>>>>,
    pos: u64,
) -> Result<Item> {
    let size = match size {
        Some(s) => s,
        None => ctx.src.local_size(rel)?,
    };
    let (extra, more) = match label {
        None => (Extra::Label(class), 0),
        Some(label) => {
            let key = label_key(rel);
            let boxes = match label? {
                Some(b) => {
                    let name = ctx.src.name(&key);
                    let text = String::from_utf8(b).map_err(|_| Error::invalid(name.clone(), "not UTF-8 text"))?;
                    parse_yolo_labels(&text, Path::new(&name))?
                }
                // No label file is YOLO's way of saying "no objects".
                None => "[]".to_owned(),
            };
            let n = boxes.len() as u64;
            (Extra::Boxes(boxes), n)
        }
    };
    Ok(Item {
        size: size + more + rel.len() as u64 + 64,
        rel: rel.to_owned(),
        pos,
        extra,
    })
}

/// Runs `produce` on this thread while as many workers as the rayon pool has threads take the
/// jobs it sends (a queue of one, so memory holds the jobs being worked on and one more) and
/// run `work` on each. `send` returns false once a job has failed (then `produce` should stop;
/// the workers still take and drop what it sends, so it never blocks). Returns every job's
/// result, in no order, or the first failed job's error, else `produce`'s.
pub(crate) fn with_workers<J: Send, T: Send>(
    work: impl Fn(J) -> Result<T> + Sync,
    produce: impl FnOnce(&mut dyn FnMut(J) -> bool) -> Result<()>,
) -> Result<Vec<T>> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    let (tx, rx) = std::sync::mpsc::sync_channel::<J>(1);
    let rx = Mutex::new(rx);
    let done: Mutex<Vec<T>> = Mutex::new(Vec::new());
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    let stop = AtomicBool::new(false);
    let produced = std::thread::scope(|scope| {
        for _ in 0..rayon::current_num_threads().max(1) {
            scope.spawn(|| loop {
                let Ok(job) = rx.lock().expect("not poisoned").recv() else {
                    return;
                };
                if stop.load(Ordering::Relaxed) {
                    continue;
                }
                match work(job) {
                    Ok(t) => done.lock().expect("not poisoned").push(t),
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        failed.lock().expect("not poisoned").get_or_insert(e);
                    }
                }
            });
        }
        // Dropped when `produce` returns, which ends the workers.
        let tx = tx;
        produce(&mut |job| tx.send(job).is_ok() && !stop.load(Ordering::Relaxed))
    });
    if let Some(e) = failed.into_inner().expect("not poisoned") {
        return Err(e);
    }
    produced?;
    Ok(done.into_inner().expect("not poisoned"))
}

/// Builds and uploads the shard of key index `idx` holding `items` (and its columns sidecar,
/// first): an input that cannot be read or decoded is skipped with `--skip-bad`, else fails the
/// pack. From an object store the inputs are fetched [`source::FETCH_IN_FLIGHT`] at a time.
fn build_shard(ctx: &Ctx, idx: u64, items: &[Item], side_schema: Option<&Schema>) -> Result<ShardOutcome> {
    let mut b = ShardBuilder::new(ctx.layout.schema.clone());
    let mut side = side_schema.cloned().map(ShardBuilder::new);
    b.reserve(items.iter().map(|i| i.size).sum::<u64>() as usize);
    let mut skipped = Vec::new();
    let mut read = 0u64;
    let mut dedupe_keys = Vec::new();
    let keys: Vec<&str> = items.iter().map(|i| i.rel.as_str()).collect();
    // The inputs are read in order, then made into values on the pack's pool (a full decode
    // with --check-decode, a restart transcode with --jpeg-restarts: a shard's worth of work
    // that would otherwise run on one thread), then pushed in order.
    let mut got: Vec<Result<Vec<u8>>> = Vec::with_capacity(items.len());
    ctx.src.read_each(ctx.rt, &keys, |_, bytes| {
        got.push(bytes);
        Ok(())
    })?;
    let made: Vec<Result<(Vec<Value>, u64)>> = got
        .into_par_iter()
        .zip(items.par_iter())
        .map(|(bytes, it)| bytes.and_then(|bytes| values(ctx, it, bytes)))
        .collect();
    for (it, made) in items.iter().zip(made) {
        match made {
            Ok((vals, n)) => {
                read += n;
                b.push(&vals, &it.rel)?;
                if let Some(d) = &ctx.dedupe {
                    dedupe_keys.push(d.key(&ctx.layout.schema, &vals, it.pos));
                }
                if let Some(side) = side.as_mut() {
                    let small: Vec<Value> = vals
                        .iter()
                        .filter(|v| v.column_type() != ColumnType::Bytes)
                        .cloned()
                        .collect();
                    side.push(&small, &it.rel)?;
                }
            }
            Err(e) if ctx.opts.skip_bad => skipped.push((it.rel.clone(), reason_of(&e))),
            Err(e) => return Err(e),
        }
        ctx.progress.inc(it.size);
    }
    let n = items.len() as u64;
    let objects = ctx.objects.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
    ctx.progress.set_message(format!("{}, {objects} objects", ctx.label));
    if b.samples() == 0 {
        return Ok((None, skipped, read, dedupe_keys));
    }
    let shard = b.finish();
    let key = shard_key(idx as usize, shard.checksum);
    // The sidecar goes up first: a shard listed with a sidecar always has it.
    let columns = match side {
        Some(side) => {
            let built = side.finish();
            let c = ColumnsInfo {
                key: columns_key(idx as usize, built.checksum),
                bytes: built.bytes.len() as u64,
                checksum: built.checksum.into(),
            };
            ctx.rt.block_on(ctx.dst.put(&c.key, Bytes::from(built.bytes)))?;
            Some(c)
        }
        None => None,
    };
    let info = ShardInfo {
        key: key.clone(),
        bytes: shard.bytes.len() as u64,
        samples: shard.samples,
        checksum: shard.checksum.into(),
        columns,
        foreign: None,
    };
    ctx.rt.block_on(ctx.dst.put(&key, Bytes::from(shard.bytes)))?;
    Ok((Some(info), skipped, read, dedupe_keys))
}

/// Opens the destination, creating a local folder if needed.
pub fn open_dst(dst: &str) -> Result<Store> {
    let local = !dst.contains("://") || dst.starts_with("file://");
    if local {
        let p = dst.strip_prefix("file://").unwrap_or(dst);
        std::fs::create_dir_all(p).map_err(|e| Error::io(p, e))?;
    }
    Store::open(dst)
}

pub(crate) fn reason_of(e: &Error) -> String {
    match e {
        Error::InvalidInput { reason, .. } => reason.clone(),
        Error::Io { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}

/// One item's values, from its file's `bytes`, and the bytes read. With `--jpeg-restarts` a
/// JPEG is stored transcoded ([`with_restarts_or_given`]).
fn values(ctx: &Ctx, it: &Item, bytes: Vec<u8>) -> Result<(Vec<Value>, u64)> {
    let info = probe(&bytes).map_err(|r| Error::invalid(ctx.src.name(&it.rel), r.to_string()))?;
    if ctx.opts.check_decode {
        ramjet_engine::image::decode_rgb(&bytes, 1, None)
            .map_err(|r| Error::invalid(ctx.src.name(&it.rel), format!("does not decode: {r}")))?;
    }
    let n = bytes.len() as u64;
    let bytes = if ctx.opts.jpeg_restarts && info.format == ImageFormat::Jpeg {
        with_restarts_or_given(bytes, JPEG_RESTART_PX)
    } else {
        bytes
    };
    // The width and height columns are the image as shown: its EXIF orientation applied.
    let (w, h) = ramjet_engine::image::exif::orientation(&bytes).displayed(info.width, info.height);
    let (w, h) = (w as i64, h as i64);
    let vals = match &it.extra {
        Extra::Label(l) => vec![
            Value::Bytes(bytes),
            Value::Int64(*l),
            Value::Str(it.rel.clone()),
            Value::Int64(w),
            Value::Int64(h),
        ],
        Extra::Boxes(b) => vec![
            Value::Bytes(bytes),
            Value::Str(it.rel.clone()),
            Value::Int64(w),
            Value::Int64(h),
            Value::Json(b.clone()),
        ],
    };
    Ok((vals, n))
}

/// Parses YOLO label text into compact JSON `[[class, cx, cy, w, h], ...]`.
pub fn parse_yolo_labels(text: &str, path: &Path) -> Result<String> {
    let mut boxes = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let what = || format!("{}:{}", path.display(), n + 1);
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() != 5 {
            return Err(Error::invalid(
                what(),
                format!("expected 'class cx cy w h', found {} fields", f.len()),
            ));
        }
        let class: u32 = f[0]
            .parse()
            .map_err(|_| Error::invalid(what(), format!("class {:?} is not a non-negative integer", f[0])))?;
        let mut b = vec![Json::from(class)];
        for v in &f[1..] {
            let x: f64 = v
                .parse()
                .map_err(|_| Error::invalid(what(), format!("{v:?} is not a number")))?;
            if !(-1e-6..=1.0 + 1e-6).contains(&x) {
                return Err(Error::invalid(what(), format!("{v} is outside [0, 1]")));
            }
            b.push(Json::from(x));
        }
        boxes.push(Json::Array(b));
    }
    Ok(Json::Array(boxes).to_string())
}

/// Class names from a YOLO `data.yaml`: `names: [a, b]`, a block list, or `0: a` pairs.
fn read_yolo_names(text: &str) -> Option<Vec<String>> {
    let mut lines = text.lines().peekable();
    while let Some(l) = lines.next() {
        let Some(rest) = l.trim_start().strip_prefix("names:") else {
            continue;
        };
        let rest = rest.trim();
        let clean = |s: &str| s.trim().trim_matches(|c| c == '\'' || c == '"').to_owned();
        if let Some(inner) = rest.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            return Some(inner.split(',').map(clean).filter(|s| !s.is_empty()).collect());
        }
        let mut names = Vec::new();
        while let Some(n) = lines.peek() {
            let t = n.trim();
            if let Some(item) = t.strip_prefix("- ") {
                names.push(clean(item));
            } else if let Some((k, v)) = t.split_once(':').filter(|(k, _)| k.trim().parse::<u32>().is_ok()) {
                let _ = k;
                names.push(clean(v));
            } else {
                break;
            }
            lines.next();
        }
        return (!names.is_empty()).then_some(names);
    }
    None
}

fn json_type(v: &Json) -> ColumnType {
    match v {
        Json::Number(n) if n.is_i64() => ColumnType::Int64,
        Json::Number(n) if n.is_f64() => ColumnType::Float64,
        Json::String(_) => ColumnType::Str,
        _ => ColumnType::Json,
    }
}

/// A YOLO layout's schema and metadata (its class names, from `data.yaml` when there is one).
fn yolo_layout(src: &Source, rt: &tokio::runtime::Runtime) -> Result<Layout> {
    let schema = Schema::new([
        ("image", ColumnType::Bytes),
        ("path", ColumnType::Str),
        ("width", ColumnType::Int64),
        ("height", ColumnType::Int64),
        ("boxes", ColumnType::Json),
    ])?;
    let mut meta = Map::new();
    let yaml = src.read_opt(rt, "data.yaml").ok().flatten();
    if let Some(names) = yaml.and_then(|b| read_yolo_names(&String::from_utf8_lossy(&b))) {
        meta.insert("classes".into(), Json::from(names));
    }
    meta.insert(
        "boxes_format".into(),
        Json::from("[[class, cx, cy, w, h], ...] normalised to [0, 1]"),
    );
    Ok(Layout {
        kind: SourceKind::Yolo,
        schema,
        meta,
    })
}

/// An image folder's schema.
pub(crate) fn imagefolder_schema() -> Result<Schema> {
    Schema::new([
        ("image", ColumnType::Bytes),
        ("label", ColumnType::Int64),
        ("path", ColumnType::Str),
        ("width", ColumnType::Int64),
        ("height", ColumnType::Int64),
    ])
}

/// An image folder's schema and metadata: its classes are its top-level folders, sorted.
fn imagefolder_layout(classes: Vec<String>) -> Result<Layout> {
    let mut meta = Map::new();
    meta.insert("classes".into(), Json::from(classes));
    Ok(Layout {
        kind: SourceKind::Imagefolder,
        schema: imagefolder_schema()?,
        meta,
    })
}

/// A JSONL input's schema: the first non-empty object's keys and value types, in its order;
/// with `--image-column`, that column (strings naming images) holds the images' bytes.
fn jsonl_layout(src: &Source, rt: &tokio::runtime::Runtime, opts: &PackOptions) -> Result<Layout> {
    let mut reader = src.file_reader(rt, 0)?;
    let (mut line_no, mut remaining) = (0u64, u64::MAX);
    let schema = loop {
        let (lines, bytes) =
            read_chunk(&mut reader, &mut line_no, &mut remaining).map_err(|e| Error::io(&src.display, e))?;
        if let Some(s) = first_schema(&lines)? {
            break s;
        }
        if bytes == 0 {
            return Err(Error::invalid(&src.display, "no JSON objects found"));
        }
    };
    let schema = with_column_types(schema, &opts.column_types, &src.display)?;
    let schema = match &opts.image_column {
        None => schema,
        Some(c) => {
            let Some(i) = schema.index_of(c) else {
                return Err(Error::invalid(
                    "--image-column",
                    format!("no column {c:?} in {} ({})", src.display, schema.describe()),
                ));
            };
            if schema.columns[i].ty != ColumnType::Str {
                return Err(Error::invalid(
                    "--image-column",
                    format!(
                        "column {c:?} of {} holds {}, not strings naming images",
                        src.display,
                        schema.columns[i].ty.name()
                    ),
                ));
            }
            let mut cols = schema.columns.clone();
            cols[i].ty = ColumnType::Bytes;
            Schema::from_columns(cols)?
        }
    };
    let mut meta = Map::new();
    let name = src.file.as_deref().unwrap_or_default();
    meta.insert(
        "source_file".into(),
        Json::from(name.rsplit('/').next().unwrap_or(name)),
    );
    if let Some(c) = &opts.image_column {
        meta.insert("image_column".into(), Json::from(c.as_str()));
    }
    let schema = match &opts.tokenizer {
        None => schema,
        Some(path) => {
            let tok = tokens::Tok::load(path)?;
            let (schema, info) = tokens::tokenized_schema(&schema, &opts.text_column, &tok, &src.display)?;
            meta.insert("tokenizer".into(), info);
            schema
        }
    };
    // With an image column and no width or height key of their own, the rows gain the
    // image's shown size, as an image folder's do (read from its header at pack time).
    let schema = match &opts.image_column {
        Some(_) if schema.index_of("width").is_none() && schema.index_of("height").is_none() => {
            meta.insert("image_dims".into(), serde_json::json!(["width", "height"]));
            let mut cols = schema.columns.clone();
            for name in ["width", "height"] {
                cols.push(Column {
                    name: name.into(),
                    ty: ColumnType::Int64,
                    nullable: false,
                });
            }
            Schema::from_columns(cols)?
        }
        _ => schema,
    };
    Ok(Layout {
        kind: SourceKind::Jsonl,
        schema,
        meta,
    })
}

/// The schema a JSONL line is parsed with: `input` less the two size columns pack adds with an
/// image column (`meta.image_dims`, the last two), which no line holds.
fn line_schema(ctx: &Ctx, input: &Schema) -> Result<Option<Schema>> {
    if !ctx.layout.meta.contains_key("image_dims") {
        return Ok(None);
    }
    let n = input.columns.len().saturating_sub(2);
    Schema::from_columns(input.columns[..n].to_vec()).map(Some)
}

/// Fills the two size columns pack adds (the last two) of each good row from its image's
/// header: the shown size, its EXIF orientation applied.
fn fill_dims(ic: usize, rows: &mut [Result<(Vec<Value>, u64)>]) {
    for (vals, size) in rows.iter_mut().flatten() {
        let Value::Bytes(b) = &vals[ic] else { continue };
        let Ok(info) = probe(b) else { continue };
        let (w, h) = ramjet_engine::image::exif::orientation(b).displayed(info.width, info.height);
        let n = vals.len();
        (vals[n - 2], vals[n - 1]) = (Value::Int64(w as i64), Value::Int64(h as i64));
        *size = ramjet_engine::format::encoded_len(vals);
    }
}

/// `schema` with the types `--column NAME:TYPE` gives: each name must be a column of the
/// first line (`what` names the input).
fn with_column_types(schema: Schema, given: &[String], what: &str) -> Result<Schema> {
    let mut cols = schema.columns.clone();
    for g in given {
        let (name, ty) = g
            .split_once(':')
            .ok_or_else(|| Error::invalid("--column", format!("{g:?} is not NAME:TYPE (e.g. tokens:int32[?])")))?;
        // `int64?`: nullable (an array's `[?]` is a free axis, not this).
        let (ty, nullable) = match ty.strip_suffix('?') {
            Some(t) if !ty.ends_with("]") => (t, true),
            _ => (ty, false),
        };
        let ty = ColumnType::parse(ty).map_err(|r| Error::invalid("--column", format!("{g:?}: {r}")))?;
        if let ColumnType::Array(a) = ty {
            if a.dtype.is_none() {
                return Err(Error::invalid(
                    "--column",
                    format!("{g:?}: a packed array column needs a dtype"),
                ));
            }
        }
        match cols.iter_mut().find(|c| c.name == name) {
            Some(c) => (c.ty, c.nullable) = (ty, nullable),
            None => {
                return Err(Error::invalid(
                    "--column",
                    format!("no column {name:?} in {what} ({})", schema.describe()),
                ))
            }
        }
    }
    Schema::from_columns(cols).map_err(|e| Error::invalid("--column", e.to_string()))
}

/// A JSON value (a number, or nested lists of numbers) as an array of `spec`'s dtype, checked
/// against its shape.
fn json_array(
    v: &Json,
    spec: &ramjet_engine::format::array::ArraySpec,
) -> std::result::Result<Array, ramjet_engine::Invalid> {
    use ramjet_engine::format::array::{Dims, Num};
    let dtype = spec.dtype.expect("a packed array column has a dtype");
    // The shape from the first element at each depth; every list must agree.
    let mut shape = Vec::new();
    let mut at = v;
    while let Json::Array(items) = at {
        shape.push(items.len() as u64);
        match items.first() {
            Some(first) => at = first,
            None => break,
        }
    }
    if let Dims::Rank { rank, dims } = spec.dims {
        // An empty list of a deeper column: the missing axes are as declared (zero when free).
        while shape.len() < rank as usize && shape.last() == Some(&0) {
            shape.push(Dims::axis(&dims, shape.len()).unwrap_or(0));
        }
    }
    let mut data =
        Vec::with_capacity(ramjet_engine::format::array::elements(&shape).unwrap_or(0) as usize * dtype.size());
    fn walk(
        v: &Json,
        depth: usize,
        shape: &[u64],
        dtype: ramjet_engine::format::array::Dtype,
        out: &mut Vec<u8>,
    ) -> std::result::Result<(), ramjet_engine::Invalid> {
        if depth == shape.len() {
            let n = match v {
                Json::Number(n) => {
                    if let Some(i) = n.as_i64() {
                        Num::I(i)
                    } else if let Some(u) = n.as_u64() {
                        Num::U(u)
                    } else {
                        Num::F(n.as_f64().ok_or("a number out of range")?)
                    }
                }
                other => return Err(format!("{other} is not a number").into()),
            };
            return dtype.push(n, out);
        }
        match v {
            Json::Array(items) if items.len() as u64 == shape[depth] => {
                items.iter().try_for_each(|x| walk(x, depth + 1, shape, dtype, out))
            }
            Json::Array(items) => Err(format!(
                "a ragged list: axis {depth} is {} long here, {} in the first",
                items.len(),
                shape[depth]
            )
            .into()),
            other => Err(format!("{other} where axis {depth} expects a list").into()),
        }
    }
    walk(v, 0, &shape, dtype, &mut data)?;
    spec.check(dtype, &shape).map_err(|e| e.to_string())?;
    Array::new(dtype, shape, data)
}

/// JSONL input read and parsed together (in parallel) before it is packed in line order.
const JSONL_CHUNK_BYTES: usize = 8 << 20;

/// Rows whose images are fetched together with `--image-column`.
const IMAGE_ROWS_AT_ONCE: usize = 2 * source::FETCH_IN_FLIGHT;

/// A JSONL input packed as a stream, from `reader`, whose first line is input number
/// `first_pos` (0-based), at most `limit` lines: chunks of lines are parsed and converted in
/// parallel, rows go into the current shard in line order, and each full shard is finished and
/// uploaded by a worker while the next one fills. A shard never spans two groups. Memory holds
/// one chunk and at most `threads + 2` shards (the one filling, one queued, one per worker),
/// whatever the input's size. Bad lines fail the pack, or with `--skip-bad` are listed in line
/// order. Returns each group met, packed.
pub(crate) fn pack_jsonl(
    ctx: &Ctx,
    mut reader: Box<dyn std::io::BufRead + Send>,
    first_pos: u64,
    limit: Option<u64>,
) -> Result<BTreeMap<u64, GroupOut>> {
    let gi = ctx.opts.group_items;
    let schema = &ctx.layout.schema;
    // With --tokenizer, lines are parsed with the text column they hold, then tokenized.
    let tokenize = tokens::Tokenize::of(ctx)?;
    let input_schema = tokenize.as_ref().map_or(schema, |t| &t.input);
    let image_col = ctx.opts.image_column.as_ref().and_then(|c| schema.index_of(c));
    let line_schema = line_schema(ctx, input_schema)?;
    let display = &ctx.src.display;
    let io = |e: std::io::Error| Error::io(display, e);
    let mut stats: BTreeMap<u64, GroupStat> = BTreeMap::new();
    let mut skips: Vec<(u64, String, String)> = Vec::new();
    let mut read_bytes: BTreeMap<u64, u64> = BTreeMap::new();
    let mut dedupe_keys: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let done = with_workers(
        |(g, j, b): (u64, u64, ShardBuilder)| put_built(ctx, g, j, b, "rows"),
        |send| {
            let (mut line_no, mut remaining) = (first_pos, limit.unwrap_or(u64::MAX));
            let mut filling = Filling::new(first_pos / gi);
            loop {
                let (lines, chunk) = read_chunk(&mut reader, &mut line_no, &mut remaining).map_err(io)?;
                ctx.progress.inc(chunk as u64);
                if lines.is_empty() {
                    break;
                }
                for (n, l) in &lines {
                    let p = *n as u64 - 1;
                    stats
                        .entry(p / gi)
                        .or_default()
                        .add(l.as_bytes(), p, || format!("line {n}"));
                }
                let lines: Vec<(usize, String)> = lines.into_iter().filter(|(_, l)| !l.trim().is_empty()).collect();
                let what = |n: usize| format!("{display}:{n}");
                let mut rows = parse_rows(&lines, line_schema.as_ref().unwrap_or(input_schema), image_col, &what);
                if line_schema.is_some() {
                    for (vals, _) in rows.iter_mut().flatten() {
                        vals.extend([Value::Int64(0), Value::Int64(0)]);
                    }
                }
                if let Some(t) = &tokenize {
                    t.apply(&lines, &mut rows, &what);
                }
                if let Some(ic) = image_col {
                    fetch_images(ctx, ic, &lines, &mut rows, &what);
                    if line_schema.is_some() {
                        fill_dims(ic, &mut rows);
                    }
                }
                for (ac, col) in schema.columns.iter().enumerate() {
                    if let ColumnType::Array(spec) = col.ty {
                        fetch_arrays(ctx, ac, &col.name, &spec, &lines, &mut rows, &what);
                    }
                }
                for ((n, line), r) in lines.iter().zip(rows) {
                    let g = (*n as u64 - 1) / gi;
                    let (vals, size) = match r {
                        Ok(v) => v,
                        Err(e) if ctx.opts.skip_bad => {
                            skips.push((g, what(*n), reason_of(&e)));
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    if !filling.push(ctx, g, &vals, size, &what(*n), send)? {
                        return Ok(());
                    }
                    if let Some(d) = &ctx.dedupe {
                        dedupe_keys
                            .entry(g)
                            .or_default()
                            .push(d.key(schema, &vals, *n as u64 - 1));
                    }
                    // Tokenized, a row is smaller than its text: the input is the line.
                    *read_bytes.entry(g).or_default() += if tokenize.is_some() { line.len() as u64 } else { size };
                }
            }
            filling.finish(send);
            Ok(())
        },
    );
    Ok(rows_out(stats, skips, read_bytes, dedupe_keys, done?))
}

/// The shard a pack of rows is filling, in order: cut before a row that would take it past
/// `--shard-size` or `--shard-samples`, and at the end of each group (a shard never spans two).
pub(crate) struct Filling {
    builder: Option<ShardBuilder>,
    /// Estimated bytes in it.
    acc: u64,
    /// Its group, and its index in the group.
    group: u64,
    index: u64,
}

impl Filling {
    /// Nothing filled yet; the first row is in group `group`.
    pub(crate) fn new(group: u64) -> Filling {
        Filling {
            builder: None,
            acc: 0,
            group,
            index: 0,
        }
    }

    /// Adds a row of group `g` (`size` estimated bytes, `what` naming it), first sending the
    /// shard it does not fit in. False when `send` says the pack stops.
    pub(crate) fn push(
        &mut self,
        ctx: &Ctx,
        g: u64,
        vals: &[Value],
        size: u64,
        what: &str,
        send: &mut dyn FnMut((u64, u64, ShardBuilder)) -> bool,
    ) -> Result<bool> {
        if g != self.group {
            if let Some(full) = self.builder.take() {
                if !send((self.group, self.index, full)) {
                    return Ok(false);
                }
            }
            (self.group, self.index, self.acc) = (g, 0, 0);
        }
        let filled = self.builder.as_ref().map_or(0, |b| b.samples() as usize);
        if self.acc > 0 && (self.acc + size > ctx.opts.shard_bytes_target || ctx.opts.shard_full(filled)) {
            let full = self.builder.take().expect("a shard is filling");
            if !send((self.group, self.index, full)) {
                return Ok(false);
            }
            self.index += 1;
            self.acc = 0;
        }
        self.builder
            .get_or_insert_with(|| ShardBuilder::new(ctx.layout.schema.clone()))
            .push(vals, what)?;
        self.acc += size;
        Ok(true)
    }

    /// Sends the last shard, if any.
    pub(crate) fn finish(mut self, send: &mut dyn FnMut((u64, u64, ShardBuilder)) -> bool) {
        if let Some(last) = self.builder.take() {
            send((self.group, self.index, last));
        }
    }
}

/// Finishes and uploads a shard of rows built in order: shard `j` of group `g` (`what` names
/// the rows in progress lines).
pub(crate) fn put_built(ctx: &Ctx, g: u64, j: u64, b: ShardBuilder, what: &str) -> Result<(u64, u64, ShardInfo)> {
    let shard = b.finish();
    let key = shard_key((g * ctx.opts.group_items + j) as usize, shard.checksum);
    let info = ShardInfo {
        key: key.clone(),
        bytes: shard.bytes.len() as u64,
        samples: shard.samples,
        checksum: shard.checksum.into(),
        columns: None,
        foreign: None,
    };
    ctx.rt.block_on(ctx.dst.put(&key, Bytes::from(shard.bytes)))?;
    let n = info.samples;
    let objects = ctx.objects.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
    ctx.progress.set_message(format!("{}, {objects} {what}", ctx.label));
    Ok((g, j, info))
}

/// The groups a pack of rows met: their statistics, skips (group, what, why), input bytes,
/// dedupe keys and shards (group, index in group, shard), put together.
pub(crate) fn rows_out(
    stats: BTreeMap<u64, GroupStat>,
    skips: Vec<(u64, String, String)>,
    read_bytes: BTreeMap<u64, u64>,
    dedupe_keys: BTreeMap<u64, Vec<u64>>,
    mut done: Vec<(u64, u64, ShardInfo)>,
) -> BTreeMap<u64, GroupOut> {
    let mut out: BTreeMap<u64, GroupOut> = stats.into_iter().map(|(g, s)| (g, s.into_out())).collect();
    for (g, what, why) in skips {
        out.entry(g).or_default().skipped.push((what, why));
    }
    for (g, n) in read_bytes {
        out.entry(g).or_default().input_bytes = n;
    }
    for (g, keys) in dedupe_keys {
        out.entry(g).or_default().keys = keys;
    }
    done.sort_by_key(|(g, j, _)| (*g, *j));
    for (g, _, info) in done {
        out.entry(g).or_default().shards.push(info);
    }
    out
}

/// For array column `ac`: reads the `.npy` file (or `FILE.npz#NAME` member) each good row's
/// string names into its array, which must have the column's dtype and fit its shape; a file
/// that cannot be read or does not fit makes the row an error naming the line, the column and
/// the file.
fn fetch_arrays(
    ctx: &Ctx,
    ac: usize,
    column: &str,
    spec: &ramjet_engine::format::array::ArraySpec,
    lines: &[(usize, String)],
    rows: &mut [Result<(Vec<Value>, u64)>],
    what: &(dyn Fn(usize) -> String + Sync),
) {
    use ramjet_engine::format::npy::{npz_member, parse_npy};
    let file = |name: &str| name.split('#').next().unwrap_or(name).to_owned();
    fetch_named(ctx, ac, lines, rows, file, |n, name, bytes| {
        let at = || format!("{}: column {column:?} ({}): file {name}", what(n), spec.text());
        let array = bytes.map_err(|e| reason_of(&e)).and_then(|b| {
            let npy = match name.split_once('#') {
                Some((_, member)) => npz_member(&b, member).map_err(|e| e.to_string())?,
                None => b,
            };
            let a = parse_npy(&npy).map_err(|e| e.to_string())?;
            spec.check(a.dtype, &a.shape).map_err(|e| e.to_string())?;
            Ok(a)
        });
        array.map(Value::Array).map_err(|why| Error::invalid(at(), why))
    });
}

/// For column `c`: fetches what each good row's string names ([`IMAGE_ROWS_AT_ONCE`] rows at a
/// time, in order; `file` maps a name to the object fetched), and puts `make(line, name,
/// bytes)` in its place, or makes the row that error.
fn fetch_named(
    ctx: &Ctx,
    c: usize,
    lines: &[(usize, String)],
    rows: &mut [Result<(Vec<Value>, u64)>],
    file: impl Fn(&str) -> String,
    make: impl Fn(usize, &str, Result<Vec<u8>>) -> Result<Value>,
) {
    for (ls, rs) in lines
        .chunks(IMAGE_ROWS_AT_ONCE)
        .zip(rows.chunks_mut(IMAGE_ROWS_AT_ONCE))
    {
        let named: Vec<Option<String>> = rs
            .iter()
            .map(|r| match r {
                Ok((v, _)) => match &v[c] {
                    Value::Str(s) => Some(s.clone()),
                    _ => None,
                },
                Err(_) => None,
            })
            .collect();
        if named.iter().all(Option::is_none) {
            continue;
        }
        let files: Vec<String> = named.iter().flatten().map(|n| file(n)).collect();
        let mut got = ctx.src.fetch_refs(ctx.rt, &files).into_iter();
        for (((n, _), r), name) in ls.iter().zip(rs.iter_mut()).zip(&named) {
            let Some(name) = name else { continue };
            let bytes = got.next().expect("one fetch per name");
            let Ok((vals, size)) = r else { continue };
            match make(*n, name, bytes) {
                Ok(v) => {
                    vals[c] = v;
                    *size = ramjet_engine::format::encoded_len(vals);
                }
                Err(e) => *r = Err(e),
            }
        }
    }
}

/// With `--image-column`: fetches the image each good row names ([`IMAGE_ROWS_AT_ONCE`] rows
/// at a time, in order) and puts its bytes in the row; a name that cannot be fetched, or bytes
/// that are not an image, make the row an error naming the line and the image.
fn fetch_images(
    ctx: &Ctx,
    ic: usize,
    lines: &[(usize, String)],
    rows: &mut [Result<(Vec<Value>, u64)>],
    what: &(dyn Fn(usize) -> String + Sync),
) {
    fetch_named(ctx, ic, lines, rows, str::to_owned, |n, name, bytes| {
        let checked = bytes.and_then(|b| match probe(&b) {
            Ok(_) => Ok(b),
            Err(why) => Err(Error::invalid(format!("{}: image {name}", what(n)), why.to_string())),
        });
        checked.map(Value::Bytes).map_err(|e| match e {
            Error::InvalidInput { .. } => e,
            other => Error::invalid(format!("{}: image {name}", what(n)), reason_of(&other)),
        })
    });
}

/// The next lines of a JSONL input, about [`JSONL_CHUNK_BYTES`] of them and at most
/// `remaining`, each with its line number (blank ones included), and the bytes read.
fn read_chunk(
    reader: &mut dyn std::io::BufRead,
    line_no: &mut u64,
    remaining: &mut u64,
) -> std::io::Result<(Vec<(usize, String)>, usize)> {
    let mut lines: Vec<(usize, String)> = Vec::new();
    let mut chunk = 0usize;
    while chunk < JSONL_CHUNK_BYTES && *remaining > 0 {
        let mut l = String::new();
        let n = reader.read_line(&mut l)?;
        if n == 0 {
            break;
        }
        *line_no += 1;
        *remaining -= 1;
        chunk += n;
        lines.push((*line_no as usize, l));
    }
    Ok((lines, chunk))
}

/// The schema the first non-empty JSON object among `lines` defines, if there is one.
fn first_schema(lines: &[(usize, String)]) -> Result<Option<Schema>> {
    lines
        .iter()
        .find_map(|(_, l)| match serde_json::from_str::<Json>(l) {
            Ok(Json::Object(m)) if !m.is_empty() => Some(Schema::new(m.iter().map(|(k, v)| (k.clone(), json_type(v))))),
            _ => None,
        })
        .transpose()
}

/// Each line as the schema's values and their size, in parallel; a line that is not a
/// non-empty JSON object, or does not fit the schema, is an error naming it (`what`).
fn parse_rows(
    lines: &[(usize, String)],
    schema: &Schema,
    image_col: Option<usize>,
    what: &(dyn Fn(usize) -> String + Sync),
) -> Vec<Result<(Vec<Value>, u64)>> {
    lines
        .par_iter()
        .map(|(n, l)| {
            let w = what(*n);
            let m = match serde_json::from_str::<Json>(l) {
                Ok(Json::Object(m)) if !m.is_empty() => m,
                Ok(_) => return Err(Error::invalid(w, "line is not a non-empty JSON object")),
                Err(e) => return Err(Error::invalid(w, format!("invalid JSON: {e}"))),
            };
            jsonl_row(schema, image_col, &m, &w)
        })
        .collect()
}

/// One JSONL object as the schema's values, and their encoded size. The image column's value
/// is the string naming the image, until it is fetched.
fn jsonl_row(
    schema: &Schema,
    image_col: Option<usize>,
    m: &Map<String, Json>,
    what: &str,
) -> Result<(Vec<Value>, u64)> {
    if m.len() != schema.columns.len() || schema.columns.iter().any(|c| !m.contains_key(&c.name)) {
        let keys: Vec<&String> = m.keys().collect();
        return Err(Error::invalid(
            what,
            format!("keys {keys:?} differ from the first line's ({})", schema.describe()),
        ));
    }
    let mut vals = Vec::with_capacity(m.len());
    let mut size = 0u64;
    for (i, c) in schema.columns.iter().enumerate() {
        let v = &m[&c.name];
        let val = match (c.ty, v) {
            (_, Json::String(s)) if image_col == Some(i) => Value::Str(s.clone()),
            (ColumnType::Int64, Json::Null) if c.nullable => Value::Int64(NULL_INT64),
            (ColumnType::Float64, Json::Null) if c.nullable => Value::Float64(f64::NAN),
            (ColumnType::Int64, Json::Number(n)) if c.nullable && n.as_i64() == Some(NULL_INT64) => {
                return Err(Error::invalid(
                    what,
                    format!(
                        "column {:?} ({}): {n} is the value a null is stored as",
                        c.name,
                        c.type_name()
                    ),
                ))
            }
            (ColumnType::Int64, Json::Number(n)) if n.is_i64() => Value::Int64(n.as_i64().expect("i64")),
            (ColumnType::Float64, Json::Number(n)) => Value::Float64(n.as_f64().expect("f64")),
            (ColumnType::Str, Json::String(s)) => Value::Str(s.clone()),
            (ColumnType::Json, v) if json_type(v) == ColumnType::Json => Value::Json(v.to_string()),
            // A string names a .npy file (or `FILE.npz#NAME`), read after the line is parsed.
            (ColumnType::Array(_), Json::String(s)) => Value::Str(s.clone()),
            (ColumnType::Array(spec), v) => Value::Array(
                json_array(v, &spec)
                    .map_err(|r| Error::invalid(what, format!("column {:?} ({}): {r}", c.name, c.ty.name())))?,
            ),
            _ => {
                let ty = if image_col == Some(i) {
                    "a string naming an image".to_owned()
                } else {
                    c.type_name()
                };
                let hint = match (v, c.ty) {
                    (Json::Null, ColumnType::Int64 | ColumnType::Float64) => {
                        format!(" (declare it nullable: --column {}:{}?)", c.name, c.ty.name())
                    }
                    _ => String::new(),
                };
                return Err(Error::invalid(
                    what,
                    format!(
                        "column {:?} is {ty} in the first line, but this value is {v}{hint}",
                        c.name
                    ),
                ));
            }
        };
        size += ramjet_engine::format::encoded_len(std::slice::from_ref(&val));
        vals.push(val);
    }
    Ok((vals, size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_yolo_label_is_named_after_its_image() {
        assert_eq!(label_key("images/a/b.jpg"), "labels/a/b.txt");
        assert_eq!(label_key("images/x"), "labels/x.txt");
        assert_eq!(label_key("images/v1.2/x"), "labels/v1.2/x.txt");
        assert_eq!(label_key("images/x.tar.gz"), "labels/x.tar.txt");
    }
}
