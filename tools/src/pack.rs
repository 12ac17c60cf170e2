//! `ramjet pack`: converts an image-classification folder, a YOLO layout or a JSONL file into
//! shards plus a manifest.
//!
//! Three phases, each deterministic whatever the thread count:
//! 1. scan: list inputs in sorted order, stat them, parse YOLO labels or JSONL lines (parallel);
//! 2. plan: cut the list into shards greedily by estimated size, in input order;
//! 3. build: read, check and encode each shard's samples, then upload it (parallel over shards,
//!    so memory stays near `threads x shard size`).
//!
//! The manifest is written last, first as `manifests/<version>.json` and then as
//! `manifest.json`: if any step fails, no new `manifest.json` appears.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rayon::prelude::*;
use serde_json::{Map, Value as Json};

use ramjet_engine::format::{
    columns_key, shard_key, ColumnType, ColumnsInfo, Manifest, Schema, ShardBuilder, ShardInfo, ShardTable, Value,
    MANIFEST_NAME, SHARD_TABLE_AUTO_MIN,
};
use ramjet_engine::image::probe::{probe, ImageFormat};
use ramjet_engine::image::turbo::with_restarts_or_given;
use ramjet_engine::{Error, Result, Store};

/// Input layouts `pack` understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SourceKind {
    /// `images/` and `labels/` (YOLO txt), with an optional `data.yaml` of class names.
    Yolo,
    /// One subfolder per class, images inside.
    Imagefolder,
    /// One JSON object per line.
    Jsonl,
}

impl SourceKind {
    /// Name stored in the manifest's `source` field.
    pub fn name(self) -> &'static str {
        match self {
            SourceKind::Yolo => "yolo",
            SourceKind::Imagefolder => "imagefolder",
            SourceKind::Jsonl => "jsonl",
        }
    }

    /// Guesses the layout of `src`.
    pub fn detect(src: &Path) -> Result<SourceKind> {
        if src.is_file() {
            return Ok(SourceKind::Jsonl);
        }
        if src.join("images").is_dir() && src.join("labels").is_dir() {
            return Ok(SourceKind::Yolo);
        }
        if src.is_dir() {
            return Ok(SourceKind::Imagefolder);
        }
        Err(Error::invalid(src.display().to_string(), "no such file or folder"))
    }
}

/// Options of `ramjet pack`.
#[derive(Debug, Clone)]
pub struct PackOptions {
    /// Shards are cut when the next sample would take them past this size.
    pub shard_bytes_target: u64,
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

impl Default for PackOptions {
    fn default() -> Self {
        Self {
            shard_bytes_target: 64 << 20,
            skip_bad: false,
            kind: None,
            shard_table: ShardTableMode::Auto,
            jpeg_restarts: false,
        }
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

/// What building one planned shard gave: the shard (none if every input was skipped), the
/// inputs skipped, and the input bytes read.
type ShardOutcome = (Option<ShardInfo>, Skipped, u64);

/// What packing the input gave: the schema, the manifest's metadata, the shards in order, and
/// the input bytes read.
type Packed = (Schema, Map<String, Json>, Vec<ShardInfo>, u64);

/// One input sample, as found by the scan.
struct Item {
    /// Name used in messages and stored in the `path` column.
    rel: String,
    path: PathBuf,
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

/// Packs `src` into `dst` (a local folder or an object-store URL).
pub fn pack(src: &Path, dst: &str, opts: &PackOptions, progress: &indicatif::ProgressBar) -> Result<PackReport> {
    let t0 = Instant::now();
    let kind = match opts.kind {
        Some(k) => k,
        None => SourceKind::detect(src)?,
    };
    if opts.shard_bytes_target < 4096 {
        return Err(Error::invalid("--shard-size", "must be at least 4096 bytes"));
    }
    let store = open_dst(dst)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io("tokio runtime", e))?;

    let mut skipped = Vec::new();
    let (schema, meta, shards, input_bytes) = if kind == SourceKind::Jsonl {
        pack_jsonl(src, &store, &rt, opts, progress, &mut skipped)?
    } else {
        pack_files(src, kind, &store, &rt, opts, progress, &mut skipped)?
    };
    if shards.is_empty() {
        return Err(Error::invalid(src.display().to_string(), "every input was skipped"));
    }
    let mut meta = meta;
    if opts.jpeg_restarts && kind != SourceKind::Jsonl {
        meta.insert("jpeg_restart_px".into(), Json::from(JPEG_RESTART_PX));
    }
    // The shard table (if any), then the manifest, last.
    let table = match opts.shard_table {
        ShardTableMode::Always => true,
        ShardTableMode::Never => false,
        ShardTableMode::Auto => shards.len() > SHARD_TABLE_AUTO_MIN,
    };
    let manifest = if table {
        let t = ShardTable::build(&shards).map_err(|why| Error::invalid("shard table", why))?;
        let key = format!("tables/{:016x}.rjt", t.checksum());
        // The table goes up before any manifest that names it.
        rt.block_on(store.put(&key, t.as_bytes().expect("built in memory").clone()))?;
        Manifest::with_table(kind.name(), schema, meta, t, key)
    } else {
        Manifest::new(kind.name(), schema, meta, shards)
    };
    let bytes = Bytes::from(manifest.to_bytes());
    rt.block_on(async {
        store
            .put(&format!("manifests/{}.json", manifest.version), bytes.clone())
            .await?;
        store.put(MANIFEST_NAME, bytes).await
    })?;
    Ok(PackReport {
        manifest_url: store.url(MANIFEST_NAME),
        manifest,
        skipped,
        input_bytes,
        elapsed: t0.elapsed(),
    })
}

/// Inputs scanned at a time (file sizes, YOLO labels), in parallel.
const SCAN_CHUNK: usize = 4096;

/// One input found by the walk of a folder: a file (with its class for an image folder), or
/// one that is refused as found (a loose file in an image folder).
enum Found {
    File(PathBuf, i64),
    Bad(String, Error),
}

/// The files of an image folder or a YOLO layout, as a stream: walked in path order, scanned
/// a chunk at a time, planned into shards as they come, and each shard built and uploaded by
/// a worker while the walk goes on. Memory holds the directories on the walk's current path,
/// one chunk of scanned inputs, and the shards being built (one per worker, one queued), not
/// the listing. Returns the schema, metadata, shards and input bytes read.
fn pack_files(
    src: &Path,
    kind: SourceKind,
    store: &Store,
    rt: &tokio::runtime::Runtime,
    opts: &PackOptions,
    progress: &indicatif::ProgressBar,
    skipped: &mut Skipped,
) -> Result<Packed> {
    let (schema, meta, found): Layout = match kind {
        SourceKind::Yolo => yolo_layout(src)?,
        SourceKind::Imagefolder => imagefolder_layout(src)?,
        SourceKind::Jsonl => unreachable!("JSONL is packed as a stream (pack_jsonl)"),
    };
    let (images, labels) = (src.join("images"), src.join("labels"));
    let scan = |f: &Found| -> (String, Result<Item>) {
        match f {
            Found::Bad(rel, e) => (rel.clone(), Err(e.clone())),
            Found::File(p, class) => {
                let rel = rel_of(src, p);
                let item = match kind {
                    SourceKind::Yolo => scan_yolo_file(p, &rel, &images, &labels),
                    _ => file_size(p).map(|size| Item {
                        size: size + rel.len() as u64 + 64,
                        rel: rel.clone(),
                        path: p.clone(),
                        extra: Extra::Label(*class),
                    }),
                };
                (rel, item)
            }
        }
    };
    let side_schema = schema.without_bytes();
    let mut found_any = false;
    let done = with_workers(
        |(idx, items): (usize, Vec<Item>)| {
            let outcome = build_shard(
                idx,
                &items,
                kind,
                &schema,
                side_schema.as_ref(),
                store,
                rt,
                opts,
                progress,
            )?;
            Ok((idx, outcome))
        },
        |send| {
            let mut found = found;
            let (mut plan, mut acc, mut idx): (Vec<Item>, u64, usize) = (Vec::new(), 0, 0);
            loop {
                let chunk: Vec<Found> = found.by_ref().take(SCAN_CHUNK).collect::<Result<_>>()?;
                if chunk.is_empty() {
                    break;
                }
                found_any = true;
                let scanned: Vec<(String, Result<Item>)> = chunk.par_iter().map(&scan).collect();
                for it in gather(scanned, opts.skip_bad, skipped)? {
                    progress.inc_length(it.size);
                    if acc > 0 && acc + it.size > opts.shard_bytes_target {
                        if !send((idx, std::mem::take(&mut plan))) {
                            return Ok(());
                        }
                        idx += 1;
                        acc = 0;
                    }
                    acc += it.size;
                    plan.push(it);
                }
            }
            if !plan.is_empty() {
                send((idx, plan));
            }
            Ok(())
        },
    );
    progress.finish_and_clear();
    let mut done = done?;
    if !found_any {
        return Err(Error::invalid(src.display().to_string(), "no samples found"));
    }
    done.sort_by_key(|(i, _)| *i);
    let mut shards = Vec::new();
    let mut input_bytes = 0;
    for (_, (info, sk, read)) in done {
        shards.extend(info);
        skipped.extend(sk);
        input_bytes += read;
    }
    Ok((schema, meta, shards, input_bytes))
}

/// Runs `produce` on this thread while as many workers as the rayon pool has threads take the
/// jobs it sends (a queue of one, so memory holds the jobs being worked on and one more) and
/// run `work` on each. `send` returns false once a job has failed (then `produce` should stop;
/// the workers still take and drop what it sends, so it never blocks). Returns every job's
/// result, in no order, or the first failed job's error, else `produce`'s.
fn with_workers<J: Send, T: Send>(
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

/// Builds and uploads shard `idx` of `items` (and its columns sidecar, first): an input that
/// cannot be read or decoded is skipped with `--skip-bad`, else fails the pack.
#[allow(clippy::too_many_arguments)]
fn build_shard(
    idx: usize,
    items: &[Item],
    kind: SourceKind,
    schema: &Schema,
    side_schema: Option<&Schema>,
    store: &Store,
    rt: &tokio::runtime::Runtime,
    opts: &PackOptions,
    progress: &indicatif::ProgressBar,
) -> Result<ShardOutcome> {
    let mut b = ShardBuilder::new(schema.clone());
    let mut side = side_schema.cloned().map(ShardBuilder::new);
    b.reserve(items.iter().map(|i| i.size).sum::<u64>() as usize);
    let mut skipped = Vec::new();
    let mut read = 0u64;
    for it in items {
        match load(it, kind, opts.jpeg_restarts) {
            Ok((vals, n)) => {
                read += n;
                b.push(&vals, &it.rel)?;
                if let Some(side) = side.as_mut() {
                    let small: Vec<Value> = vals
                        .iter()
                        .filter(|v| v.column_type() != ColumnType::Bytes)
                        .cloned()
                        .collect();
                    side.push(&small, &it.rel)?;
                }
            }
            Err(e) if opts.skip_bad => skipped.push((it.rel.clone(), reason_of(&e))),
            Err(e) => return Err(e),
        }
        progress.inc(it.size);
    }
    if b.samples() == 0 {
        return Ok((None, skipped, read));
    }
    let shard = b.finish();
    let key = shard_key(idx, shard.checksum);
    // The sidecar goes up first: a shard listed with a sidecar always has it.
    let columns = match side {
        Some(side) => {
            let built = side.finish();
            let c = ColumnsInfo {
                key: columns_key(idx, built.checksum),
                bytes: built.bytes.len() as u64,
                checksum: built.checksum.into(),
            };
            rt.block_on(store.put(&c.key, Bytes::from(built.bytes)))?;
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
    rt.block_on(store.put(&key, Bytes::from(shard.bytes)))?;
    Ok((Some(info), skipped, read))
}

/// Opens the destination, creating a local folder if needed.
pub fn open_dst(dst: &str) -> Result<Store> {
    let local = !dst.contains("://") || dst.starts_with("file://");
    if local {
        let p = dst.strip_prefix("file://").unwrap_or(dst);
        fs::create_dir_all(p).map_err(|e| Error::io(p, e))?;
    }
    Store::open(dst)
}

fn reason_of(e: &Error) -> String {
    match e {
        Error::InvalidInput { reason, .. } => reason.clone(),
        Error::Io { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}

/// Reads one item's file (if any) and builds its values. Returns the values and bytes read.
/// With `jpeg_restarts`, a JPEG is stored transcoded ([`with_restarts_or_given`]).
fn load(it: &Item, kind: SourceKind, jpeg_restarts: bool) -> Result<(Vec<Value>, u64)> {
    let bytes = fs::read(&it.path).map_err(|e| Error::io(it.path.display(), e))?;
    let info = probe(&bytes).map_err(|r| Error::invalid(it.path.display().to_string(), r.to_string()))?;
    let n = bytes.len() as u64;
    let bytes = if jpeg_restarts && info.format == ImageFormat::Jpeg {
        with_restarts_or_given(bytes, JPEG_RESTART_PX)
    } else {
        bytes
    };
    let (w, h) = (info.width as i64, info.height as i64);
    let vals = match (&it.extra, kind) {
        (Extra::Label(l), _) => vec![
            Value::Bytes(bytes),
            Value::Int64(*l),
            Value::Str(it.rel.clone()),
            Value::Int64(w),
            Value::Int64(h),
        ],
        (Extra::Boxes(b), _) => vec![
            Value::Bytes(bytes),
            Value::Str(it.rel.clone()),
            Value::Int64(w),
            Value::Int64(h),
            Value::Json(b.clone()),
        ],
    };
    Ok((vals, n))
}

/// Deepest folder nesting a pack walks.
const WALK_DEPTH_MAX: usize = 64;

/// The entries of `d` that are not hidden, sorted by name, each with whether it is a folder.
fn list_sorted(d: &Path) -> Result<Vec<(PathBuf, bool)>> {
    let mut out = Vec::new();
    let rd = fs::read_dir(d).map_err(|e| Error::io(d.display(), e))?;
    for e in rd {
        let e = e.map_err(|e| Error::io(d.display(), e))?;
        if e.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let p = e.path();
        let ft = e.file_type().map_err(|err| Error::io(p.display(), err))?;
        // A link to a folder is walked as the folder.
        let is_dir = ft.is_dir() || (ft.is_symlink() && p.is_dir());
        out.push((p, is_dir));
    }
    out.sort_by(|a, b| a.0.file_name().cmp(&b.0.file_name()));
    Ok(out)
}

/// Files under a folder, recursively, in path order, found as they are walked: each folder's
/// entries are listed and sorted when the walk enters it (the same order as sorting the whole
/// listing, as paths compare component by component), so memory holds the folders on the
/// current path, not the tree. Hidden entries are ignored; a folder that cannot be listed, or
/// folders nested deeper than [`WALK_DEPTH_MAX`] (a link loop), are an error.
struct SortedWalk {
    stack: Vec<std::vec::IntoIter<(PathBuf, bool)>>,
}

impl SortedWalk {
    fn new(dir: &Path) -> Result<SortedWalk> {
        Ok(SortedWalk {
            stack: vec![list_sorted(dir)?.into_iter()],
        })
    }
}

impl Iterator for SortedWalk {
    type Item = Result<PathBuf>;
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.stack.last_mut()?.next() {
                None => {
                    self.stack.pop();
                }
                Some((p, true)) if self.stack.len() >= WALK_DEPTH_MAX => {
                    self.stack.clear();
                    return Some(Err(Error::invalid(
                        p.display().to_string(),
                        format!("folders nested over {WALK_DEPTH_MAX} deep (a link loop?)"),
                    )));
                }
                Some((p, true)) => match list_sorted(&p) {
                    Ok(v) => self.stack.push(v.into_iter()),
                    Err(e) => {
                        self.stack.clear();
                        return Some(Err(e));
                    }
                },
                Some((p, false)) => return Some(Ok(p)),
            }
        }
    }
}

fn rel_of(base: &Path, p: &Path) -> String {
    p.strip_prefix(base).unwrap_or(p).to_string_lossy().into_owned()
}

fn file_size(p: &Path) -> Result<u64> {
    Ok(fs::metadata(p).map_err(|e| Error::io(p.display(), e))?.len())
}

/// Collects per-item scan results, skipping or failing on errors in input order.
fn gather<T>(results: Vec<(String, Result<T>)>, skip_bad: bool, skipped: &mut Skipped) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(results.len());
    for (what, r) in results {
        match r {
            Ok(v) => out.push(v),
            Err(e) if skip_bad => skipped.push((what, reason_of(&e))),
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// A YOLO layout's schema and metadata, and its images as they are walked.
type Layout = (Schema, Map<String, Json>, Box<dyn Iterator<Item = Result<Found>>>);

fn yolo_layout(src: &Path) -> Result<Layout> {
    let walk = SortedWalk::new(&src.join("images"))?.map(|p| Ok(Found::File(p?, -1)));
    let schema = Schema::new([
        ("image", ColumnType::Bytes),
        ("path", ColumnType::Str),
        ("width", ColumnType::Int64),
        ("height", ColumnType::Int64),
        ("boxes", ColumnType::Json),
    ])?;
    let mut meta = Map::new();
    if let Some(names) = read_yolo_names(&src.join("data.yaml")) {
        meta.insert("classes".into(), Json::from(names));
    }
    meta.insert(
        "boxes_format".into(),
        Json::from("[[class, cx, cy, w, h], ...] normalised to [0, 1]"),
    );
    Ok((schema, meta, Box::new(walk)))
}

/// One YOLO image: its size and its label file's boxes (none when it has no label file).
fn scan_yolo_file(p: &Path, rel: &str, images: &Path, labels: &Path) -> Result<Item> {
    let size = file_size(p)?;
    let label = labels.join(p.strip_prefix(images).unwrap_or(p)).with_extension("txt");
    let boxes = match fs::read_to_string(&label) {
        Ok(t) => parse_yolo_labels(&t, &label)?,
        // No label file is YOLO's way of saying "no objects".
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "[]".to_owned(),
        Err(e) => return Err(Error::io(label.display(), e)),
    };
    Ok(Item {
        size: size + boxes.len() as u64 + rel.len() as u64 + 64,
        rel: rel.to_owned(),
        path: p.to_path_buf(),
        extra: Extra::Boxes(boxes),
    })
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
fn read_yolo_names(path: &Path) -> Option<Vec<String>> {
    let text = fs::read_to_string(path).ok()?;
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

/// An image folder's schema and metadata (its classes: the top-level folders, sorted), and its
/// inputs as they are walked: files loose at the top level first (each refused), then each
/// class's files.
fn imagefolder_layout(src: &Path) -> Result<Layout> {
    let mut classes: Vec<String> = Vec::new();
    let mut loose = Vec::new();
    for (p, is_dir) in list_sorted(src)? {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if is_dir {
            classes.push(name);
        } else {
            loose.push(p);
        }
    }
    let src_owned = src.to_path_buf();
    let refused = loose.into_iter().map(move |p| {
        Ok(Found::Bad(
            rel_of(&src_owned, &p),
            Error::invalid(p.display().to_string(), "file is not inside a class folder"),
        ))
    });
    let dirs: Vec<(i64, PathBuf)> = classes
        .iter()
        .enumerate()
        .map(|(ci, c)| (ci as i64, src.join(c)))
        .collect();
    let files = dirs.into_iter().flat_map(|(ci, d)| {
        let walk: Box<dyn Iterator<Item = Result<PathBuf>>> = match SortedWalk::new(&d) {
            Ok(w) => Box::new(w),
            Err(e) => Box::new(std::iter::once(Err(e))),
        };
        walk.map(move |p| Ok(Found::File(p?, ci)))
    });
    let schema = Schema::new([
        ("image", ColumnType::Bytes),
        ("label", ColumnType::Int64),
        ("path", ColumnType::Str),
        ("width", ColumnType::Int64),
        ("height", ColumnType::Int64),
    ])?;
    let mut meta = Map::new();
    meta.insert("classes".into(), Json::from(classes));
    Ok((schema, meta, Box::new(refused.chain(files))))
}

fn json_type(v: &Json) -> ColumnType {
    match v {
        Json::Number(n) if n.is_i64() => ColumnType::Int64,
        Json::Number(n) if n.is_f64() => ColumnType::Float64,
        Json::String(_) => ColumnType::Str,
        _ => ColumnType::Json,
    }
}

/// JSONL input read and parsed together (in parallel) before it is packed in line order.
const JSONL_CHUNK_BYTES: usize = 8 << 20;

/// A JSONL file packed as a stream: chunks of lines are parsed and converted in parallel,
/// rows go into the current shard in line order, and each full shard is finished and uploaded
/// by a worker while the next one fills. Memory holds one chunk and at most `threads + 2`
/// shards (the one filling, one queued, one per worker), whatever the input's size; the output
/// is the same as packing it whole (same cuts, same shard numbers). Bad lines fail the pack, or
/// with `--skip-bad` are listed in line order.
fn pack_jsonl(
    src: &Path,
    store: &Store,
    rt: &tokio::runtime::Runtime,
    opts: &PackOptions,
    progress: &indicatif::ProgressBar,
    skipped: &mut Skipped,
) -> Result<Packed> {
    let io = |e: std::io::Error| Error::io(src.display(), e);
    let file = fs::File::open(src).map_err(io)?;
    progress.set_length(file.metadata().map(|m| m.len()).unwrap_or(0));
    let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
    let mut schema: Option<Schema> = None;
    let mut input_bytes = 0u64;
    let done = with_workers(
        |(idx, b): (usize, ShardBuilder)| {
            let shard = b.finish();
            let key = shard_key(idx, shard.checksum);
            let info = ShardInfo {
                key: key.clone(),
                bytes: shard.bytes.len() as u64,
                samples: shard.samples,
                checksum: shard.checksum.into(),
                columns: None,
                foreign: None,
            };
            rt.block_on(store.put(&key, Bytes::from(shard.bytes)))?;
            Ok((idx, info))
        },
        |send| {
            let mut line_no = 0usize;
            let (mut builder, mut acc, mut idx): (Option<ShardBuilder>, u64, usize) = (None, 0, 0);
            loop {
                let (lines, chunk) = read_chunk(&mut reader, &mut line_no).map_err(io)?;
                progress.inc(chunk as u64);
                if lines.is_empty() && chunk == 0 {
                    break;
                }
                let what = |n: usize| format!("{}:{}", src.display(), n);
                if schema.is_none() {
                    schema = first_schema(&lines)?;
                }
                let rows = parse_rows(&lines, schema.as_ref(), &what);
                for ((n, _), r) in lines.iter().zip(rows) {
                    let (vals, size) = match r {
                        Ok(v) => v,
                        Err(e) if opts.skip_bad => {
                            skipped.push((what(*n), reason_of(&e)));
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    if acc > 0 && acc + size > opts.shard_bytes_target {
                        let full = builder.take().expect("a shard is filling");
                        if !send((idx, full)) {
                            return Ok(());
                        }
                        idx += 1;
                        acc = 0;
                    }
                    let schema = schema.as_ref().expect("rows have a schema");
                    builder
                        .get_or_insert_with(|| ShardBuilder::new(schema.clone()))
                        .push(&vals, &what(*n))?;
                    acc += size;
                    input_bytes += size;
                }
            }
            if let Some(last) = builder.take() {
                send((idx, last));
            }
            Ok(())
        },
    );
    let mut done = done?;
    let Some(schema) = schema else {
        return Err(Error::invalid(src.display().to_string(), "no JSON objects found"));
    };
    done.sort_by_key(|(i, _)| *i);
    let mut meta = Map::new();
    meta.insert(
        "source_file".into(),
        Json::from(
            src.file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
        ),
    );
    Ok((schema, meta, done.into_iter().map(|(_, i)| i).collect(), input_bytes))
}

/// The next lines of a JSONL file, about [`JSONL_CHUNK_BYTES`] of them, each with its line
/// number (blank lines are left out but counted), and the bytes read.
fn read_chunk(
    reader: &mut impl std::io::BufRead,
    line_no: &mut usize,
) -> std::io::Result<(Vec<(usize, String)>, usize)> {
    let mut lines: Vec<(usize, String)> = Vec::new();
    let mut chunk = 0usize;
    while chunk < JSONL_CHUNK_BYTES {
        let mut l = String::new();
        let n = reader.read_line(&mut l)?;
        if n == 0 {
            break;
        }
        *line_no += 1;
        chunk += n;
        if !l.trim().is_empty() {
            lines.push((*line_no, l));
        }
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
    schema: Option<&Schema>,
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
            jsonl_row(schema.expect("an object was found above"), &m, &w)
        })
        .collect()
}

/// One JSONL object as the schema's values, and their encoded size.
fn jsonl_row(schema: &Schema, m: &Map<String, Json>, what: &str) -> Result<(Vec<Value>, u64)> {
    if m.len() != schema.columns.len() || schema.columns.iter().any(|c| !m.contains_key(&c.name)) {
        let keys: Vec<&String> = m.keys().collect();
        return Err(Error::invalid(
            what,
            format!("keys {keys:?} differ from the first line's ({})", schema.describe()),
        ));
    }
    let mut vals = Vec::with_capacity(m.len());
    let mut size = 0u64;
    for c in &schema.columns {
        let v = &m[&c.name];
        let val = match (c.ty, v) {
            (ColumnType::Int64, Json::Number(n)) if n.is_i64() => Value::Int64(n.as_i64().expect("i64")),
            (ColumnType::Float64, Json::Number(n)) => Value::Float64(n.as_f64().expect("f64")),
            (ColumnType::Str, Json::String(s)) => Value::Str(s.clone()),
            (ColumnType::Json, v) if json_type(v) == ColumnType::Json => Value::Json(v.to_string()),
            _ => {
                return Err(Error::invalid(
                    what,
                    format!(
                        "column {:?} is {} in the first line, but this value is {v}",
                        c.name,
                        c.ty.name()
                    ),
                ))
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

    /// The walk yields what sorting the whole listing gives (paths compare component by
    /// component, so "a/z" comes before "a.jpg" and "a-b"), skips hidden entries, follows a
    /// link to a folder, and names a link loop instead of walking it forever.
    #[test]
    fn the_walk_is_in_path_order_without_listing_the_tree() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        for f in [
            "a/z",
            "a/b/c",
            "a.jpg",
            "a-b",
            "B",
            "b/x",
            "\u{e9}",
            "a/.hidden",
            ".h/x",
            "c/d/e/f",
        ] {
            let p = r.join(f);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(&p, b"x").unwrap();
        }
        let walked: Vec<PathBuf> = SortedWalk::new(r).unwrap().map(|p| p.unwrap()).collect();
        let mut want: Vec<PathBuf> = ["a/b/c", "a/z", "a-b", "a.jpg", "B", "b/x", "c/d/e/f", "\u{e9}"]
            .iter()
            .map(|f| r.join(f))
            .collect();
        want.sort();
        assert_eq!(walked, want);
        std::os::unix::fs::symlink(r.join("c"), r.join("c/d/loop")).unwrap();
        let e = SortedWalk::new(r)
            .unwrap()
            .find_map(|p| p.err())
            .expect("the loop is named");
        assert!(e.to_string().contains("loop"), "{e}");
    }
}
