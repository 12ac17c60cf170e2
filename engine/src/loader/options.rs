//! The options of a data loader as a caller gives them (the keyword arguments of Python's
//! `StreamingDataset`), each checked here, once, with an error naming the option, and turned
//! into the [`super::LoaderConfig`] the loader runs with.
//!
//! A language binding converts each argument into an [`Arg`] (without judging it) and calls
//! [`Options::parse`]; what it gets back is the configuration as JSON (the form every binding
//! already sends down) plus the few options that stay on the caller's side (the topology
//! overrides, the thread count). The names and defaults are [`OPTIONS`]: the Python
//! package's test checks its signature against them.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::{BATCH_BYTES_MAX, BATCH_SIZE_MAX, IMAGE_SIDE_MAX, PREFETCH_BATCHES_MAX, THREADS_MAX};
use crate::error::{Error, Result};
use crate::image::{AugmentName, ImageConfig};
use crate::order::{OrderSpec, Shares, Shuffle, Tail, Weight};

/// One argument as the caller gave it, before any check: Python's `None`, `bool`, `int`,
/// `float`, `str`, a sequence, or a mapping (a `ramjet.Source`).
#[derive(Debug, Clone, PartialEq)]
pub enum Arg {
    /// No value (`None`).
    None,
    /// A boolean.
    Bool(bool),
    /// An integer of any size the caller's language has (`i128` holds every `u64` and `i64`).
    Int(i128),
    /// A float, including NaN and the infinities (refused here, with the option's name).
    Float(f64),
    /// Text.
    Str(String),
    /// A sequence.
    List(Vec<Arg>),
    /// Named fields.
    Map(BTreeMap<String, Arg>),
}

impl std::fmt::Display for Arg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Arg::None => f.write_str("None"),
            Arg::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            Arg::Int(i) => write!(f, "{i}"),
            Arg::Float(x) => write!(f, "{x}"),
            Arg::Str(s) => write!(f, "{s:?}"),
            Arg::List(v) => {
                f.write_str("(")?;
                for (i, a) in v.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{a}")?;
                }
                f.write_str(")")
            }
            Arg::Map(m) => write!(f, "{{{} fields}}", m.len()),
        }
    }
}

/// Every option [`Options::parse`] takes, with its default (`remote` has none: it is
/// required). The Python signature of `StreamingDataset` must name exactly these.
pub const OPTIONS: &[(&str, OptionDefault)] = &[
    ("remote", OptionDefault::Required),
    ("local", OptionDefault::None),
    ("batch_size", OptionDefault::Int(32)),
    ("shuffle", OptionDefault::Bool(true)),
    ("shuffle_algo", OptionDefault::Str("shard_block")),
    ("seed", OptionDefault::Int(0)),
    ("shuffle_window", OptionDefault::Int(4)),
    ("shuffle_block", OptionDefault::Int(1)),
    ("partitions", OptionDefault::None),
    ("tail", OptionDefault::Str("uneven")),
    ("shares", OptionDefault::Str("rotate")),
    ("drop_last", OptionDefault::Bool(false)),
    ("cache_limit", OptionDefault::Str("64GiB")),
    ("image_size", OptionDefault::Int(224)),
    ("augment", OptionDefault::Str("train")),
    ("normalize", OptionDefault::Bool(false)),
    ("mean", OptionDefault::Floats(&[0.485, 0.456, 0.406])),
    ("std", OptionDefault::Floats(&[0.229, 0.224, 0.225])),
    ("scale", OptionDefault::Floats(&[0.08, 1.0])),
    ("ratio", OptionDefault::Floats(&[3.0 / 4.0, 4.0 / 3.0])),
    ("flip", OptionDefault::Float(0.5)),
    ("crop_fraction", OptionDefault::Float(0.875)),
    ("dct_scaling", OptionDefault::Bool(true)),
    ("exif_orientation", OptionDefault::Bool(true)),
    ("image_column", OptionDefault::Str("image")),
    ("boxes_column", OptionDefault::Str("boxes")),
    ("num_threads", OptionDefault::None),
    ("prefetch_batches", OptionDefault::None),
    ("on_corrupt", OptionDefault::Str("error")),
    ("filter", OptionDefault::None),
    ("buckets", OptionDefault::None),
    ("decode", OptionDefault::None),
    ("rank", OptionDefault::None),
    ("world_size", OptionDefault::None),
];

/// An option's default in [`OPTIONS`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptionDefault {
    /// The option must be given.
    Required,
    /// `None`.
    None,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// Floats (a tuple).
    Floats(&'static [f64]),
    /// Text.
    Str(&'static str),
}

impl OptionDefault {
    fn arg(self) -> Arg {
        match self {
            OptionDefault::Required | OptionDefault::None => Arg::None,
            OptionDefault::Bool(b) => Arg::Bool(b),
            OptionDefault::Int(i) => Arg::Int(i.into()),
            OptionDefault::Float(x) => Arg::Float(x),
            OptionDefault::Floats(v) => Arg::List(v.iter().map(|x| Arg::Float(*x)).collect()),
            OptionDefault::Str(s) => Arg::Str(s.into()),
        }
    }

    /// The default as JSON (`null` for a required option).
    pub fn to_json(self) -> Value {
        match self {
            OptionDefault::Required | OptionDefault::None => Value::Null,
            OptionDefault::Bool(b) => json!(b),
            OptionDefault::Int(i) => json!(i),
            OptionDefault::Float(x) => json!(x),
            OptionDefault::Floats(v) => json!(v),
            OptionDefault::Str(s) => json!(s),
        }
    }
}

/// The options after their checks: the loader's configuration and what stays with the caller.
#[derive(Debug, Clone)]
pub struct Options {
    /// The [`super::LoaderConfig`] as JSON, without the parts only the running process knows
    /// (topology, decode threads, the daemon's socket).
    pub config: Value,
    /// `rank`, when given: overrides the one the caller finds.
    pub rank: Option<usize>,
    /// `world_size`, when given.
    pub world_size: Option<usize>,
    /// `num_threads`, when given.
    pub num_threads: Option<usize>,
    /// Samples per batch (the caller computes batch counts with it).
    pub batch_size: usize,
    /// `drop_last`.
    pub drop_last: bool,
}

impl Options {
    /// Checks `given` (any option left out takes its default) and builds the configuration.
    /// An unknown option, a value of the wrong type or outside its range is an
    /// [`Error::InvalidInput`] naming the option and the value.
    pub fn parse(given: BTreeMap<String, Arg>) -> Result<Options> {
        let known: Vec<&str> = OPTIONS.iter().map(|(k, _)| *k).collect();
        if let Some(k) = given.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(Error::invalid(
                k.as_str(),
                format!("is not an option; the options are {}", known.join(", ")),
            ));
        }
        let mut all = given;
        for (k, d) in OPTIONS {
            if !all.contains_key(*k) {
                if *d == OptionDefault::Required {
                    return Err(Error::invalid(*k, "must be given"));
                }
                all.insert((*k).to_owned(), d.arg());
            }
        }
        let a = |k: &str| &all[k];

        let sources = sources(a("remote"))?;
        let batch_size = int("batch_size", a("batch_size"), 1, BATCH_SIZE_MAX as i128)? as usize;
        // None: the tuner sizes it ([`crate::tune::prefetch_batches`]); a value pins it.
        let prefetch_batches = optional(a("prefetch_batches"), |v| {
            int("prefetch_batches", v, 0, PREFETCH_BATCHES_MAX as i128)
        })?;
        let num_threads = optional(a("num_threads"), |v| int("num_threads", v, 1, THREADS_MAX as i128))?;
        let world_size = optional(a("world_size"), |v| int("world_size", v, 1, 1 << 31))?;
        let rank_max = world_size.unwrap_or(1 << 31) - 1;
        let rank = optional(a("rank"), |v| int("rank", v, 0, rank_max))?;
        let cache_limit = optional(a("cache_limit"), |v| size("cache_limit", v))?.unwrap_or(64 << 30);
        let image = image_config(&all, batch_size)?;
        let on_corrupt = choice("on_corrupt", a("on_corrupt"), &[("error", "error"), ("skip", "skip")])?;
        let drop_last = boolean("drop_last", a("drop_last"))?;
        let filter = optional(a("filter"), |v| text("filter", v))?;
        if let Some(f) = &filter {
            crate::stream::parse_filter(f)?;
        }
        let buckets = optional(a("buckets"), buckets)?;
        if buckets.is_some() && image.is_none() {
            return bad(
                "buckets",
                "needs images decoded: give image_size too (a bucket is an image size)".into(),
            );
        }
        if let (Some(b), Some(img)) = (&buckets, &image) {
            let px = 3 * if img.float { 4 } else { 1 };
            for &(h, w) in b {
                let bytes = batch_size as u64 * h as u64 * w as u64 * px;
                if bytes > BATCH_BYTES_MAX {
                    return bad(
                        "buckets",
                        format!("({h}, {w}) with batch_size {batch_size} makes batches of {bytes} bytes, over {BATCH_BYTES_MAX}"),
                    );
                }
            }
        }
        let decode = optional(a("decode"), |v| {
            choice("decode", v, &[("auto", "auto"), ("gpu", "gpu"), ("cpu", "cpu")])
        })?;
        let cache =
            optional(a("local"), |v| text("local", v))?.map(|dir| json!({"dir": dir, "limit_bytes": cache_limit}));
        let mut config = json!({
            "sources": sources,
            "order": order_spec(&all)?,
            "cache": cache,
            "batch_size": batch_size,
            "drop_last": drop_last,
            "image": image,
            "image_column": text("image_column", a("image_column"))?,
            "boxes_column": optional(a("boxes_column"), |v| text("boxes_column", v))?,
            "on_corrupt": on_corrupt,
            "filter": filter,
            "buckets": buckets,
        });
        if let Some(n) = prefetch_batches {
            config["prefetch_batches"] = json!(n as usize);
            config["prefetch_pinned"] = json!(true);
        }
        if matches!(a("partitions"), Arg::None) {
            // No partitions given: the run's first start, or the state it loads, sets them.
            config["partitions_from_job"] = json!(true);
        }
        if let Some(d) = decode {
            // The GPU decode (a binding with a GPU turns it on): which decoders.
            config["decode"] = json!(d);
        }
        Ok(Options {
            config,
            rank: rank.map(|r| r as usize),
            world_size: world_size.map(|w| w as usize),
            num_threads: num_threads.map(|n| n as usize),
            batch_size,
            drop_last,
        })
    }
}

/// The order's options: `shuffle`, `shuffle_algo`, `seed`, `shuffle_window`, `shuffle_block`,
/// `partitions`, `tail`, `shares`.
fn order_spec(all: &BTreeMap<String, Arg>) -> Result<OrderSpec> {
    let a = |k: &str| &all[k];
    let seed = int("seed", a("seed"), 0, u64::MAX as i128)? as u64;
    let shuffle_window = int("shuffle_window", a("shuffle_window"), 1, usize::MAX as i128)? as usize;
    let shuffle_block = int("shuffle_block", a("shuffle_block"), 1, u64::MAX as i128)? as u64;
    // None: the job's, settled when the run starts ([`super::Epochs::settle_partitions`]).
    let partitions = optional(a("partitions"), |v| int("partitions", v, 1, 1 << 32))?.map_or(1, |p| p as usize);
    let tails = [
        ("uneven", Tail::Uneven),
        ("drop", Tail::DropLast),
        ("pad", Tail::PadRepeat),
    ];
    let tail = choice("tail", a("tail"), &tails)?;
    let shares = choice(
        "shares",
        a("shares"),
        &[("rotate", Shares::Rotate), ("sticky", Shares::Sticky)],
    )?;
    let algo = choice(
        "shuffle_algo",
        a("shuffle_algo"),
        &[("shard_block", "shard_block"), ("global", "global")],
    )?;
    let shuffle = if !boolean("shuffle", a("shuffle"))? {
        Shuffle::None
    } else if algo == "global" {
        Shuffle::Global
    } else {
        Shuffle::ShardBlock {
            window_shards: shuffle_window,
            block_samples: shuffle_block,
        }
    };
    Ok(OrderSpec {
        seed,
        shuffle,
        partitions,
        tail,
        shares,
    })
}

/// The image options (`image_size` and the augmentation's), with the bound on a batch's bytes;
/// `None` when `image_size` is `None` (images stay encoded).
fn image_config(all: &BTreeMap<String, Arg>, batch_size: usize) -> Result<Option<ImageConfig>> {
    let a = |k: &str| &all[k];
    let scale = pair("scale", a("scale"), 0.0, 1.0)?;
    let ratio = pair("ratio", a("ratio"), 0.0, f64::INFINITY)?;
    let flip = real("flip", a("flip"), 0.0, 1.0, false)?;
    let crop_fraction = real("crop_fraction", a("crop_fraction"), 0.0, 1.0, true)?;
    let mean = triple("mean", a("mean"), f64::NEG_INFINITY, false)?;
    let std = triple("std", a("std"), 0.0, true)?;
    let normalize = boolean("normalize", a("normalize"))?;
    let dct_scaling = boolean("dct_scaling", a("dct_scaling"))?;
    let exif_orientation = boolean("exif_orientation", a("exif_orientation"))?;
    let augments = [
        ("train", AugmentName::Train),
        ("eval", AugmentName::Eval),
        ("resize", AugmentName::Resize),
    ];
    let augment = choice("augment", a("augment"), &augments)?;
    let Some((height, width)) = optional(a("image_size"), image_size)? else {
        return Ok(None);
    };
    let px = 3 * if normalize { 4 } else { 1 };
    let bytes = batch_size as u64 * height as u64 * width as u64 * px;
    if bytes > BATCH_BYTES_MAX {
        return Err(Error::invalid(
            "batch_size",
            format!("{batch_size} of {height}x{width} images makes batches of {bytes} bytes, over {BATCH_BYTES_MAX}"),
        ));
    }
    Ok(Some(ImageConfig {
        width,
        height,
        augment,
        scale: (scale.0 as f32, scale.1 as f32),
        ratio: (ratio.0 as f32, ratio.1 as f32),
        flip: flip as f32,
        crop_fraction: crop_fraction as f32,
        float: normalize,
        mean: mean.map(|x| x as f32),
        std: std.map(|x| x as f32),
        dct_scaling,
        exif_orientation,
    }))
}

fn bad<T>(name: &str, why: String) -> Result<T> {
    Err(Error::invalid(name, why))
}

fn optional<T>(v: &Arg, f: impl FnOnce(&Arg) -> Result<T>) -> Result<Option<T>> {
    match v {
        Arg::None => Ok(None),
        v => f(v).map(Some),
    }
}

/// An integer in `lo..=hi`.
pub fn int(name: &str, v: &Arg, lo: i128, hi: i128) -> Result<i128> {
    match v {
        Arg::Int(i) if (lo..=hi).contains(i) => Ok(*i),
        Arg::Int(i) => bad(name, format!("must be in {lo}..={hi}, not {i}")),
        other => bad(name, format!("must be an int, not {other}")),
    }
}

/// A finite number in `[lo, hi]`, or `(lo, hi]` with `lo_open` (an int is a number too).
pub fn real(name: &str, v: &Arg, lo: f64, hi: f64, lo_open: bool) -> Result<f64> {
    let f = match v {
        Arg::Float(f) => *f,
        Arg::Int(i) => *i as f64,
        other => return bad(name, format!("must be a number, not {other}")),
    };
    let above = if lo_open { lo < f } else { lo <= f };
    if !f.is_finite() || !above || f > hi {
        // An open end prints as one (f64::MAX is 309 digits).
        let end = |x: f64| match x {
            x if x >= f64::MAX => "inf".to_owned(),
            x if x <= -f64::MAX => "-inf".to_owned(),
            x => x.to_string(),
        };
        let close = if hi >= f64::MAX { ")" } else { "]" };
        let interval = if lo_open {
            format!("({}, {}{close}", end(lo), end(hi))
        } else {
            format!("[{}, {}{close}", end(lo), end(hi))
        };
        return bad(name, format!("must be a finite number in {interval}, not {v}"));
    }
    Ok(f)
}

/// `(a, b)` with `lo < a <= b <= hi`, both finite.
fn pair(name: &str, v: &Arg, lo: f64, hi: f64) -> Result<(f64, f64)> {
    let Arg::List(items) = v else {
        return bad(name, format!("must be a pair (lo, hi), not {v}"));
    };
    let [a, b] = items.as_slice() else {
        return bad(name, format!("must be a pair (lo, hi), not {v}"));
    };
    let a = real(&format!("{name}[0]"), a, lo, hi, true)?;
    let b = real(&format!("{name}[1]"), b, lo, hi, true)?;
    if a > b {
        return bad(name, format!("must be (lo, hi) with lo <= hi, not {v}"));
    }
    Ok((a, b))
}

/// Three finite numbers above `lo` (at or above, without `lo_open`), one per channel.
fn triple(name: &str, v: &Arg, lo: f64, lo_open: bool) -> Result<[f64; 3]> {
    let Arg::List(items) = v else {
        return bad(name, format!("must be 3 numbers, one per channel, not {v}"));
    };
    let [a, b, c] = items.as_slice() else {
        return bad(name, format!("must be 3 numbers, one per channel, not {v}"));
    };
    let mut out = [0.0; 3];
    for (i, x) in [a, b, c].into_iter().enumerate() {
        out[i] = real(&format!("{name}[{i}]"), x, lo, f64::MAX, lo_open)?;
    }
    Ok(out)
}

/// `True`/`False`, or an int read as one (`0` is false), as Python's truth test reads them.
fn boolean(name: &str, v: &Arg) -> Result<bool> {
    match v {
        Arg::Bool(b) => Ok(*b),
        Arg::Int(i) => Ok(*i != 0),
        other => bad(name, format!("must be True or False, not {other}")),
    }
}

fn text(name: &str, v: &Arg) -> Result<String> {
    match v {
        Arg::Str(s) => Ok(s.clone()),
        other => bad(name, format!("must be a string, not {other}")),
    }
}

/// One of `choices` (the name given, the name meant).
fn choice<T: Copy>(name: &str, v: &Arg, choices: &[(&str, T)]) -> Result<T> {
    if let Arg::Str(s) = v {
        if let Some((_, meant)) = choices.iter().find(|(given, _)| given == s) {
            return Ok(*meant);
        }
    }
    let names: Vec<String> = choices.iter().map(|(g, _)| format!("{g:?}")).collect();
    bad(name, format!("must be one of {}, not {v}", names.join(", ")))
}

/// A byte count: an int, or text such as `64GiB`, `512MiB`, `1.5GB`, `1000000`; above 0.
pub fn size(name: &str, v: &Arg) -> Result<u64> {
    let n = match v {
        Arg::Int(i) => *i,
        Arg::Str(s) => crate::size::parse(s).map_err(|why| {
            Error::invalid(
                name,
                format!("must be a byte count like 64GiB, 512MiB or 1000000: {why}"),
            )
        })? as i128,
        other => {
            return bad(
                name,
                format!("must be a byte count (an int, or text like '64GiB'), not {other}"),
            )
        }
    };
    if n < 1 || n > u64::MAX as i128 {
        return bad(name, format!("must be a positive byte count, not {v}"));
    }
    Ok(n as u64)
}

/// `buckets`: a sequence of `(height, width)` sizes ([`super::buckets::BucketSizes`]).
fn buckets(v: &Arg) -> Result<Vec<(u32, u32)>> {
    let Arg::List(items) = v else {
        return bad("buckets", format!("must be a list of (height, width) pairs, not {v}"));
    };
    let side = |name: &str, v: &Arg| int(name, v, 1, IMAGE_SIDE_MAX as i128).map(|x| x as u32);
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("buckets[{i}]");
        match item {
            Arg::List(p) if p.len() == 2 => out.push((side(&at, &p[0])?, side(&at, &p[1])?)),
            other => return bad(&at, format!("must be a (height, width) pair, not {other}")),
        }
    }
    super::buckets::BucketSizes::new(&out)?;
    Ok(out)
}

/// `image_size`: one side for both, or `(height, width)`.
fn image_size(v: &Arg) -> Result<(u32, u32)> {
    let side = |name: &str, v: &Arg| int(name, v, 1, IMAGE_SIDE_MAX as i128).map(|x| x as u32);
    match v {
        Arg::List(items) => match items.as_slice() {
            [h, w] => Ok((side("image_size[0]", h)?, side("image_size[1]", w)?)),
            _ => bad("image_size", format!("must be an int or (height, width), not {v}")),
        },
        v => side("image_size", v).map(|s| (s, s)),
    }
}

/// `remote`: a URL, a source (`{remote, proportion | repeat | count}`), or a sequence of them.
fn sources(v: &Arg) -> Result<Vec<Value>> {
    let items = match v {
        Arg::List(items) => items.as_slice(),
        one => std::slice::from_ref(one),
    };
    if items.is_empty() {
        return bad("remote", "no dataset given".into());
    }
    items.iter().map(source).collect()
}

fn source(v: &Arg) -> Result<Value> {
    let m = match v {
        Arg::Str(url) => return Ok(json!({"url": url, "weight": Weight::Natural})),
        Arg::Map(m) => m,
        other => return bad("remote", format!("must be a URL or a ramjet.Source, not {other}")),
    };
    let url = match m.get("remote") {
        Some(Arg::Str(u)) => u.clone(),
        _ => return bad("remote", format!("a source needs its remote URL, not {v}")),
    };
    let given: Vec<&str> = ["proportion", "repeat", "count"]
        .into_iter()
        .filter(|k| m.get(*k).is_some_and(|a| *a != Arg::None))
        .collect();
    if given.len() > 1 {
        return bad(&format!("source {url}"), format!("give at most one of {given:?}"));
    }
    let what = format!("source {url}");
    let weight = match given.first().copied() {
        None => Weight::Natural,
        Some("proportion") => Weight::Proportion(real(
            &format!("{what} proportion"),
            &m["proportion"],
            0.0,
            f64::MAX,
            false,
        )?),
        Some("repeat") => Weight::Repeat(real(&format!("{what} repeat"), &m["repeat"], 0.0, f64::MAX, false)?),
        Some(_) => Weight::Count(int(&format!("{what} count"), &m["count"], 0, u64::MAX as i128)? as u64),
    };
    Ok(json!({"url": url, "weight": weight}))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LoaderConfig;

    fn opts(kv: &[(&str, Arg)]) -> Result<Options> {
        let mut m: BTreeMap<String, Arg> = kv.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect();
        m.entry("remote".into()).or_insert(Arg::Str("s3://b/d".into()));
        Options::parse(m)
    }

    fn f(v: &[f64]) -> Arg {
        Arg::List(v.iter().map(|x| Arg::Float(*x)).collect())
    }

    #[test]
    fn the_defaults_make_the_engines_default_configuration() {
        let o = opts(&[]).unwrap();
        let cfg: LoaderConfig = serde_json::from_value(o.config.clone()).unwrap();
        let d = LoaderConfig::default();
        assert_eq!(cfg.batch_size, d.batch_size);
        assert_eq!(cfg.drop_last, d.drop_last);
        assert_eq!(cfg.prefetch_batches, d.prefetch_batches);
        // Left out, the depth is the tuner's; given, it is pinned.
        assert!(!cfg.prefetch_pinned);
        let given: LoaderConfig =
            serde_json::from_value(opts(&[("prefetch_batches", Arg::Int(7))]).unwrap().config).unwrap();
        assert!(given.prefetch_pinned && given.prefetch_batches == 7);
        assert_eq!(cfg.on_corrupt, d.on_corrupt);
        assert_eq!(cfg.image_column, d.image_column);
        assert_eq!(cfg.boxes_column, d.boxes_column);
        assert_eq!(cfg.stream.order, d.stream.order);
        assert_eq!(cfg.image, Some(ImageConfig::default().into()));
        assert!(cfg.stream.cache.is_none());
        assert_eq!((o.rank, o.world_size, o.num_threads), (None, None, None));
        cfg.check().unwrap();
    }

    #[test]
    fn every_bad_value_is_refused_naming_its_option() {
        let cases: Vec<(&str, Arg, &str)> = vec![
            ("world_size", Arg::Int(0), "world_size"),
            ("crop_fraction", Arg::Int(0), "crop_fraction"),
            ("image_size", Arg::Int(100_000), "image_size"),
            (
                "image_size",
                Arg::List(vec![Arg::Int(0), Arg::Int(32)]),
                "image_size[0]",
            ),
            ("batch_size", Arg::Int(1 << 40), "batch_size"),
            ("batch_size", Arg::Str("8".into()), "batch_size"),
            ("batch_size", Arg::Float(8.0), "batch_size"),
            ("std", f(&[0.2, 0.0, 0.2]), "std[1]"),
            ("std", f(&[0.2, f64::NAN, 0.2]), "std[1]"),
            ("mean", f(&[0.5, 0.5]), "mean"),
            ("cache_limit", Arg::Str("abc".into()), "cache_limit"),
            ("cache_limit", Arg::Int(0), "cache_limit"),
            ("cache_limit", Arg::Int(-5), "cache_limit"),
            ("scale", f(&[0.5, 0.1]), "scale"),
            ("scale", f(&[0.0, 1.0]), "scale[0]"),
            ("ratio", f(&[1.0, f64::INFINITY]), "ratio[1]"),
            ("flip", Arg::Int(2), "flip"),
            ("shuffle_window", Arg::Int(0), "shuffle_window"),
            ("seed", Arg::Int(-1), "seed"),
            ("seed", Arg::Int(u64::MAX as i128 + 1), "seed"),
            ("num_threads", Arg::Int(0), "num_threads"),
            ("prefetch_batches", Arg::Int(-1), "prefetch_batches"),
            ("augment", Arg::Str("flip".into()), "augment"),
            ("tail", Arg::Str("drop_last".into()), "tail"),
            ("shuffle_algo", Arg::Str("random".into()), "shuffle_algo"),
            ("on_corrupt", Arg::Str("ignore".into()), "on_corrupt"),
            ("shuffle", Arg::Str("yes".into()), "shuffle"),
            ("remote", Arg::List(vec![]), "remote"),
            ("batch_sise", Arg::Int(8), "batch_sise"),
        ];
        for (k, v, named) in cases {
            let e = opts(&[(k, v.clone())]).unwrap_err();
            match &e {
                Error::InvalidInput { what, .. } => assert_eq!(what, named, "{k}={v}: {e}"),
                other => panic!("{k}={v}: {other}"),
            }
        }
        let e = opts(&[("rank", Arg::Int(2)), ("world_size", Arg::Int(2))]).unwrap_err();
        assert!(e.to_string().contains("rank"), "{e}");
        let e = opts(&[("batch_size", Arg::Int(4096)), ("image_size", Arg::Int(4096))]).unwrap_err();
        assert!(e.to_string().contains("over"), "{e}");
    }

    #[test]
    fn sources_sizes_and_choices_are_read_as_python_gives_them() {
        let mut src = BTreeMap::new();
        src.insert("remote".to_owned(), Arg::Str("s3://b/a".into()));
        src.insert("repeat".to_owned(), Arg::Float(2.0));
        src.insert("count".to_owned(), Arg::None);
        let o = opts(&[
            (
                "remote",
                Arg::List(vec![Arg::Map(src.clone()), Arg::Str("s3://b/c".into())]),
            ),
            ("local", Arg::Str("/nvme/c".into())),
            ("cache_limit", Arg::Str("512MiB".into())),
            ("tail", Arg::Str("pad".into())),
            ("shuffle_algo", Arg::Str("global".into())),
            ("image_size", Arg::List(vec![Arg::Int(32), Arg::Int(48)])),
            ("augment", Arg::Str("eval".into())),
            ("rank", Arg::Int(1)),
            ("world_size", Arg::Int(2)),
            ("drop_last", Arg::Int(1)),
            ("boxes_column", Arg::None),
        ])
        .unwrap();
        let cfg: LoaderConfig = serde_json::from_value(o.config.clone()).unwrap();
        assert_eq!(cfg.stream.sources[0].weight, Weight::Repeat(2.0));
        assert_eq!(cfg.stream.sources[1].weight, Weight::Natural);
        assert_eq!(cfg.stream.cache.as_ref().unwrap().limit_bytes, 512 << 20);
        assert_eq!(cfg.stream.order.tail, Tail::PadRepeat);
        assert_eq!(cfg.stream.order.shuffle, Shuffle::Global);
        let img = cfg.image.as_ref().unwrap();
        assert_eq!((img.height, img.width), (32, 48));
        assert!(cfg.drop_last && o.drop_last && cfg.boxes_column.is_none());
        assert_eq!((o.rank, o.world_size), (Some(1), Some(2)));
        src.insert("count".to_owned(), Arg::Int(3));
        let e = opts(&[("remote", Arg::Map(src))]).unwrap_err();
        assert!(e.to_string().contains("at most one of"), "{e}");
        let o = opts(&[("shuffle", Arg::Bool(false)), ("image_size", Arg::None)]).unwrap();
        assert_eq!(o.config["order"]["shuffle"], json!({"kind": "none"}));
        assert_eq!(o.config["image"], Value::Null);
    }
}
