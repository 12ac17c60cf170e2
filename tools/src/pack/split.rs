//! A pack split into tasks (a Slurm job array), resumable, merged in one atomic step.
//!
//! 1. **Plan** (`parts/plan.json`, made by the first task that finds none, or by
//!    `ramjet pack --plan`): one listing of the input cut into groups of
//!    [`PackOptions::group_items`] inputs. For each group it records where its listing resumes
//!    (the key before it, or a JSONL byte offset), its first input, its size and a hash of its
//!    input names. It does not depend on the number of tasks.
//! 2. **Tasks** (`--tasks N --task I`): task `I` packs groups `[I x G / N, (I + 1) x G / N)`
//!    of the `G` groups, each exactly as a one-machine pack would (`mod.rs`), and after a
//!    group's shards are up writes its part, `parts/<group>.json` (its shards and what it
//!    skipped, checksummed). A rerun skips the groups whose part is there and sound, so a killed
//!    task rerun alone redoes only what it had not finished, and a group whose input changed
//!    since the plan is refused, naming it.
//! 3. **Merge** (`--merge`): reads every part, checks it (checksum, plan, group, key indices,
//!    and by default that each shard is stored at its size), then writes the shard table (if
//!    any), `manifests/<version>.json` and `manifest.json`, last. A missing or damaged part
//!    refuses the merge, naming the part, its group and the task that packs it.
//!
//! The same input packed with 1, 4 or 64 tasks gives byte-identical shards under the same
//! keys, and the same manifest version as `ramjet pack` without tasks.

use std::ops::Range;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use ramjet_engine::format::{Manifest, Schema, ShardInfo, ShardTableBuilder, MANIFEST_NAME};
use ramjet_engine::{Error, Invalid, Result, Store};

use super::{
    layout, open_dst, pack_files, pack_jsonl, put_manifest, put_table_and, runtime, Ctx, GroupOut, GroupStat, Layout,
    PackOptions, PackReport, ShardTableMode, Skipped, Source, SourceKind,
};

/// Where the plan is, under the destination.
pub const PLAN_KEY: &str = "parts/plan.json";

/// Format of `parts/plan.json`.
pub const PLAN_FORMAT: u32 = 1;

/// Format of a part.
pub const PART_FORMAT: u32 = 1;

/// Key of group `g`'s part.
pub fn part_key(g: u64) -> String {
    format!("parts/{g:08}.json")
}

/// The options that change a pack's bytes: every task of a plan uses the plan's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanOptions {
    /// `--shard-size`.
    pub shard_bytes: u64,
    /// `--group-size`.
    pub group_items: u64,
    /// `--shard-samples` (absent from plans written before it: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_samples: Option<u64>,
    /// `--jpeg-restarts`.
    pub jpeg_restarts: bool,
    /// `--skip-bad`.
    pub skip_bad: bool,
    /// `--check-decode` (absent from plans written before it: false).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub check_decode: bool,
    /// `--image-column`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_column: Option<String>,
    /// `--column`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub column_types: Vec<String>,
    /// `--text-column`, with `--tokenizer` (whose file the plan's layout names by checksum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_column: Option<String>,
    /// `--dedupe`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedupe: Option<String>,
}

impl PlanOptions {
    fn of(o: &PackOptions) -> PlanOptions {
        PlanOptions {
            shard_bytes: o.shard_bytes_target,
            group_items: o.group_items,
            shard_samples: o.shard_samples_max,
            jpeg_restarts: o.jpeg_restarts,
            skip_bad: o.skip_bad,
            check_decode: o.check_decode,
            image_column: o.image_column.clone(),
            column_types: o.column_types.clone(),
            text_column: o.tokenizer.as_ref().map(|_| o.text_column.clone()),
            dedupe: o.dedupe.clone(),
        }
    }
}

/// One group of the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupPlan {
    /// A listed input: the key its listing resumes after (none for the first group).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    /// A JSONL input: the byte offset of the group's first line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// Its first input's name (or `line <n>`).
    pub first: String,
    /// Inputs in it.
    pub items: u64,
    /// xxh3-64 of its input names (JSONL: its lines), each followed by a newline, 16 hex digits.
    pub hash: String,
}

/// `parts/plan.json`: the input cut into groups.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// [`PLAN_FORMAT`].
    pub plan_format: u32,
    /// xxh3-128 of this JSON with `id` empty, 32 hex digits: parts name the plan they follow.
    pub id: String,
    /// The input, as given to `ramjet pack`.
    pub source: String,
    /// `imagefolder`, `yolo` or `jsonl`.
    pub layout: String,
    /// The options every task packs with.
    pub options: PlanOptions,
    /// The schema of its shards.
    pub schema: Schema,
    /// The manifest's metadata (classes, source file, ...).
    pub meta: Map<String, Json>,
    /// Inputs in all.
    pub items: u64,
    /// The groups, in input order.
    pub groups: Vec<GroupPlan>,
}

impl Plan {
    fn compute_id(&self) -> String {
        let mut c = self.clone();
        c.id = String::new();
        let bytes = serde_json::to_vec(&c).expect("a plan serialises");
        format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&bytes))
    }

    fn to_bytes(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).expect("a plan serialises"))
    }

    fn parse(b: &[u8], url: &str) -> Result<Plan> {
        let p: Plan = serde_json::from_slice(b).map_err(|e| Error::invalid(url, format!("not a pack plan: {e}")))?;
        if p.plan_format != PLAN_FORMAT {
            return Err(Error::invalid(
                url,
                format!("plan format {} (this ramjet reads {PLAN_FORMAT})", p.plan_format),
            ));
        }
        if p.compute_id() != p.id {
            return Err(Error::invalid(
                url,
                "its id does not match its content: the plan was edited or damaged",
            ));
        }
        if p.groups.iter().map(|g| g.items).sum::<u64>() != p.items {
            return Err(Error::invalid(url, "its groups do not add up to its inputs"));
        }
        Ok(p)
    }

    /// The layout the plan packs.
    pub fn layout(&self) -> Result<Layout> {
        let kind = SourceKind::from_name(&self.layout)
            .ok_or_else(|| Error::invalid(PLAN_KEY, format!("unknown layout {:?}", self.layout)))?;
        Ok(Layout {
            kind,
            schema: self.schema.clone(),
            meta: self.meta.clone(),
        })
    }

    /// Refuses a run whose input or options differ from the plan's, naming the difference.
    fn check_run(&self, url: &str, source: &str, kind: Option<SourceKind>, o: &PlanOptions) -> Result<()> {
        let differ = |what: &str, plan: String, run: String| {
            Err(Error::invalid(
                url,
                format!(
                    "the plan was made for {what} {plan}, this run asks for {run}: run every task with the \
                     plan's input and options, or pack into a new destination"
                ),
            ))
        };
        if self.source != source {
            return differ("input", format!("{:?}", self.source), format!("{source:?}"));
        }
        if let Some(k) = kind.filter(|k| k.name() != self.layout) {
            return differ("--format", self.layout.clone(), k.name().into());
        }
        let p = &self.options;
        if p.shard_bytes != o.shard_bytes {
            return differ("--shard-size", p.shard_bytes.to_string(), o.shard_bytes.to_string());
        }
        if p.group_items != o.group_items {
            return differ("--group-size", p.group_items.to_string(), o.group_items.to_string());
        }
        if p.shard_samples != o.shard_samples {
            let show = |n: Option<u64>| n.map_or("none".into(), |n| n.to_string());
            return differ("--shard-samples", show(p.shard_samples), show(o.shard_samples));
        }
        if p.jpeg_restarts != o.jpeg_restarts {
            return differ(
                "--jpeg-restarts",
                p.jpeg_restarts.to_string(),
                o.jpeg_restarts.to_string(),
            );
        }
        if p.skip_bad != o.skip_bad {
            return differ("--skip-bad", p.skip_bad.to_string(), o.skip_bad.to_string());
        }
        if p.check_decode != o.check_decode {
            return differ("--check-decode", p.check_decode.to_string(), o.check_decode.to_string());
        }
        if p.image_column != o.image_column {
            return differ(
                "--image-column",
                format!("{:?}", p.image_column),
                format!("{:?}", o.image_column),
            );
        }
        if p.text_column != o.text_column {
            let say = |t: &Option<String>| match t {
                Some(c) => format!("--tokenizer of text column {c:?}"),
                None => "no --tokenizer".to_owned(),
            };
            return differ("tokenizing", say(&p.text_column), say(&o.text_column));
        }
        if p.dedupe != o.dedupe {
            return differ("--dedupe", format!("{:?}", p.dedupe), format!("{:?}", o.dedupe));
        }
        if p.column_types != o.column_types {
            return differ(
                "--column",
                format!("{:?}", p.column_types),
                format!("{:?}", o.column_types),
            );
        }
        Ok(())
    }

    /// The groups task `task` of `tasks` packs.
    pub fn slice(&self, tasks: u64, task: u64) -> Range<u64> {
        let n = self.groups.len() as u128;
        let at = |i: u64| (i as u128 * n / tasks as u128) as u64;
        at(task)..at(task + 1)
    }
}

/// Which task of `tasks` packs group `g` of a plan of `groups` groups.
fn owner(g: u64, groups: u64, tasks: u64) -> u64 {
    // The largest task whose slice starts at or before g.
    let (mut lo, mut hi) = (0u64, tasks);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if (mid as u128 * groups as u128 / tasks as u128) as u64 <= g {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// A group's part: its shards and what it skipped, written once they are all stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Part {
    /// [`PART_FORMAT`].
    pub part_format: u32,
    /// The plan's id.
    pub plan: String,
    /// Its group.
    pub group: u64,
    /// Inputs in the group.
    pub items: u64,
    /// The group's input hash, as the plan says.
    pub hash: String,
    /// Samples in its shards.
    pub samples: u64,
    /// Bytes of its shards.
    pub bytes: u64,
    /// Input bytes read.
    pub input_bytes: u64,
    /// Its shards, in order.
    pub shards: Vec<ShardInfo>,
    /// Inputs skipped with `--skip-bad`, in input order.
    pub skipped: Skipped,
    /// With `--dedupe`, each sample's key in order, 16 hex digits each ([`super::dedupe`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedupe_keys: Option<String>,
    /// xxh3-64 of this JSON with `checksum` empty, 16 hex digits.
    pub checksum: String,
}

impl Part {
    fn compute_checksum(&self) -> String {
        let mut c = self.clone();
        c.checksum = String::new();
        let bytes = serde_json::to_vec(&c).expect("a part serialises");
        format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes))
    }

    /// The part as written, from group `g`'s packing under `plan`.
    fn new(plan: &Plan, g: u64, out: GroupOut) -> Part {
        let mut p = Part {
            part_format: PART_FORMAT,
            plan: plan.id.clone(),
            group: g,
            items: out.items,
            hash: format!("{:016x}", out.hash),
            samples: out.shards.iter().map(|s| s.samples).sum(),
            bytes: out.shards.iter().map(|s| s.bytes).sum(),
            input_bytes: out.input_bytes,
            shards: out.shards,
            skipped: out.skipped,
            dedupe_keys: plan
                .options
                .dedupe
                .as_ref()
                .map(|_| super::dedupe::keys_to_hex(&out.keys)),
            checksum: String::new(),
        };
        p.checksum = p.compute_checksum();
        p
    }

    /// Reads and checks group `g`'s part of `plan`: why it is unsound, if it is.
    fn parse(b: &[u8], plan: &Plan, g: u64) -> std::result::Result<Part, Invalid> {
        let p: Part = serde_json::from_slice(b).map_err(|e| format!("not a part: {e}"))?;
        if p.part_format != PART_FORMAT {
            return Err(format!("part format {} (this ramjet reads {PART_FORMAT})", p.part_format).into());
        }
        if p.compute_checksum() != p.checksum {
            return Err("its checksum does not match its content: the part was edited or damaged".into());
        }
        if p.plan != plan.id {
            return Err(format!("it follows plan {}, not this destination's plan {}", p.plan, plan.id).into());
        }
        let gp = &plan.groups[g as usize];
        if p.group != g || p.items != gp.items || p.hash != gp.hash {
            return Err(format!(
                "it describes group {} ({} inputs), not group {g} ({} inputs)",
                p.group, p.items, gp.items
            )
            .into());
        }
        let gi = plan.options.group_items;
        let keys = g * gi..(g + 1) * gi;
        for s in &p.shards {
            let k = s
                .key
                .strip_prefix("shards/")
                .and_then(|r| r.split('-').next())
                .and_then(|k| k.parse::<u64>().ok());
            if !k.is_some_and(|k| keys.contains(&k)) {
                return Err(format!("shard {:?} is not one of group {g}'s keys", s.key).into());
            }
        }
        if p.shards.iter().map(|s| s.samples).sum::<u64>() != p.samples {
            return Err("its shards do not add up to its samples".into());
        }
        Ok(p)
    }
}

/// Units (an image folder's classes) a plan lists at once, unless `RAMJET_PACK_LISTS` says.
const LIST_IN_FLIGHT: usize = 64;

/// Units a plan lists at once: `RAMJET_PACK_LISTS`, else [`LIST_IN_FLIGHT`].
fn lists_in_flight() -> usize {
    std::env::var("RAMJET_PACK_LISTS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| (1..=4096).contains(n))
        .unwrap_or(LIST_IN_FLIGHT)
}

/// Runs `f` on each unit, [`lists_in_flight`] at a time (a thread each: a unit's listing waits
/// on the store), and returns the results in order.
fn each_unit<T: Send>(n: usize, f: impl Fn(usize) -> Result<T> + Sync) -> Result<Vec<T>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let next = AtomicUsize::new(0);
    let out: Vec<Mutex<Option<Result<T>>>> = (0..n).map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..lists_in_flight().min(n) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return;
                }
                let r = f(i);
                let failed = r.is_err();
                *out[i].lock().expect("not poisoned") = Some(r);
                if failed {
                    // The others stop at their next unit.
                    next.store(n, Ordering::Relaxed);
                    return;
                }
            });
        }
    });
    let mut v = Vec::with_capacity(n);
    for o in out {
        if let Some(r) = o.into_inner().expect("not poisoned") {
            v.push(r?);
        }
    }
    if v.len() < n {
        return Err(Error::invalid("plan", "a listing stopped before its end"));
    }
    Ok(v)
}

/// Lists the input and cuts it into groups (`ramjet pack --plan`, or the first task). An
/// image folder's classes are listed in parallel, twice: once to count each (so every class's
/// place in the input is known), once to find the group boundaries in it and hash its names.
/// Memory holds the groups, not the listing. A JSONL input is read once, in order.
pub fn make_plan(
    src: &Source,
    rt: &tokio::runtime::Runtime,
    layout: &Layout,
    opts: &PackOptions,
    progress: &indicatif::ProgressBar,
) -> Result<Plan> {
    let gi = opts.group_items;
    let mut groups: Vec<GroupPlan> = Vec::new();
    let items = if layout.kind.is_foreign() {
        let input = super::foreign::ForeignInput::open(src, rt, layout.kind)?;
        plan_foreign(&input, gi, progress, &mut groups)?
    } else if layout.kind == SourceKind::Jsonl {
        let mut reader = src.file_reader(rt, 0)?;
        let (mut offset, mut pos) = (0u64, 0u64);
        let mut stat = GroupStat::default();
        let mut start = 0u64;
        let close = |stat: &mut GroupStat, start: u64, groups: &mut Vec<GroupPlan>| {
            let out = std::mem::take(stat).into_out();
            groups.push(GroupPlan {
                after: None,
                offset: Some(start),
                first: out.first,
                items: out.items,
                hash: format!("{:016x}", out.hash),
            });
        };
        loop {
            let mut l = String::new();
            let n = reader.read_line(&mut l).map_err(|e| Error::io(&src.display, e))?;
            if n == 0 {
                break;
            }
            if pos > 0 && pos % gi == 0 {
                close(&mut stat, start, &mut groups);
                start = offset;
            }
            let line = pos + 1;
            stat.add(l.as_bytes(), pos, || format!("line {line}"));
            (pos, offset) = (pos + 1, offset + n as u64);
            progress.inc(1);
        }
        if pos > 0 {
            close(&mut stat, start, &mut groups);
        }
        pos
    } else {
        plan_listed(src, rt, layout.kind, gi, progress, &mut groups)?
    };
    if items == 0 {
        return Err(Error::invalid(&src.display, "no inputs found"));
    }
    let mut plan = Plan {
        plan_format: PLAN_FORMAT,
        id: String::new(),
        source: src.display.clone(),
        layout: layout.kind.name().into(),
        options: PlanOptions::of(opts),
        schema: layout.schema.clone(),
        meta: layout.meta.clone(),
        items,
        groups,
    };
    plan.id = plan.compute_id();
    Ok(plan)
}

/// The groups of a foreign input: each `gi` samples in its order, named and hashed as
/// [`super::foreign::pack_rows`] names them. Returns the inputs in all.
fn plan_foreign(
    input: &super::foreign::ForeignInput,
    gi: u64,
    progress: &indicatif::ProgressBar,
    groups: &mut Vec<GroupPlan>,
) -> Result<u64> {
    let items = input.items();
    for g in 0..items.div_ceil(gi) {
        let mut stat = GroupStat::default();
        for p in g * gi..((g + 1) * gi).min(items) {
            let (name, label) = input.name_of(p);
            stat.add(name.as_bytes(), p, || label);
        }
        let out = stat.into_out();
        progress.inc(out.items);
        groups.push(GroupPlan {
            after: None,
            offset: Some(g * gi),
            first: out.first,
            items: out.items,
            hash: format!("{:016x}", out.hash),
        });
    }
    Ok(items)
}

/// The groups of a listed input ([`super::Units`]): the loose names first, then each unit,
/// counted in parallel and then walked again in parallel. Returns the inputs in all.
fn plan_listed(
    src: &Source,
    rt: &tokio::runtime::Runtime,
    kind: SourceKind,
    gi: u64,
    progress: &indicatif::ProgressBar,
    groups: &mut Vec<GroupPlan>,
) -> Result<u64> {
    let (loose, units) = super::units(src, rt, kind)?;
    let h = rt.handle();
    // Pass 1: each unit's size and last key.
    let counted = each_unit(units.len(), |u| {
        let (mut n, mut last) = (0u64, None);
        for r in src.walk(h, &units[u].0, None) {
            last = Some(r?.0);
            n += 1;
            progress.inc(1);
        }
        Ok((n, last))
    })?;
    let mut offsets = Vec::with_capacity(units.len());
    let mut before = Vec::with_capacity(units.len());
    let (mut at, mut last) = (loose.len() as u64, loose.last().cloned());
    for (n, l) in &counted {
        offsets.push(at);
        before.push(last.clone());
        at += n;
        if l.is_some() {
            last = l.clone();
        }
    }
    let total = at;
    let ng = total.div_ceil(gi);
    *groups = (0..ng)
        .map(|g| GroupPlan {
            after: None,
            offset: None,
            first: String::new(),
            items: gi.min(total - g * gi),
            hash: String::new(),
        })
        .collect();
    let mut hashes = vec![0u64; ng as usize];
    // Where each group starts: (the key before it, its first key).
    type Starts = Vec<(u64, Option<String>, String)>;
    let mut starts: Starts = Vec::new();
    let mut prev: Option<String> = None;
    for (i, name) in loose.iter().enumerate() {
        let p = i as u64;
        hashes[(p / gi) as usize] = hashes[(p / gi) as usize].wrapping_add(super::item_hash(name.as_bytes(), p));
        if p % gi == 0 {
            starts.push((p / gi, prev.clone(), name.clone()));
        }
        prev = Some(name.clone());
    }
    // Pass 2: the boundaries and hashes in each unit.
    let walked = each_unit(units.len(), |u| {
        let (mut shares, mut st): (Vec<(u64, u64)>, Starts) = (Vec::new(), Vec::new());
        let mut prev = before[u].clone();
        let mut p = offsets[u];
        for r in src.walk(h, &units[u].0, None) {
            let key = r?.0;
            let g = p / gi;
            match shares.last_mut() {
                Some((lg, s)) if *lg == g => *s = s.wrapping_add(super::item_hash(key.as_bytes(), p)),
                _ => shares.push((g, super::item_hash(key.as_bytes(), p))),
            }
            if p % gi == 0 {
                st.push((g, prev.take(), key.clone()));
            }
            prev = Some(key);
            p += 1;
        }
        if p - offsets[u] != counted[u].0 {
            return Err(Error::invalid(
                src.name(&units[u].0),
                format!(
                    "the input changed while it was listed: {} inputs, then {}",
                    counted[u].0,
                    p - offsets[u]
                ),
            ));
        }
        Ok((shares, st))
    })?;
    for (shares, st) in walked {
        for (g, s) in shares {
            hashes[g as usize] = hashes[g as usize].wrapping_add(s);
        }
        starts.extend(st);
    }
    for (g, after, first) in starts {
        let gp = &mut groups[g as usize];
        (gp.after, gp.first) = (after, first);
    }
    for (gp, h) in groups.iter_mut().zip(hashes) {
        gp.hash = format!("{h:016x}");
    }
    Ok(total)
}

use std::io::BufRead as _;

/// The destination's plan, if it has one (checked).
fn read_plan(dst: &Store, rt: &tokio::runtime::Runtime) -> Result<Option<Plan>> {
    match rt.block_on(dst.get(PLAN_KEY)) {
        Ok(b) => Plan::parse(&b, &dst.url(PLAN_KEY)).map(Some),
        Err(Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The destination's plan, made (and stored) when there is none. Tasks started together may
/// each make it; they make the same bytes, and each goes on with what is stored.
fn plan_for(
    src: &Source,
    dst: &Store,
    rt: &tokio::runtime::Runtime,
    opts: &PackOptions,
    progress: &indicatif::ProgressBar,
) -> Result<(Plan, bool)> {
    let url = dst.url(PLAN_KEY);
    if let Some(p) = read_plan(dst, rt)? {
        progress.finish_and_clear();
        p.check_run(&url, &src.display, opts.kind, &PlanOptions::of(opts))?;
        return Ok((p, false));
    }
    let layout = layout(src, rt, opts)?;
    let made = make_plan(src, rt, &layout, opts, progress);
    progress.finish_and_clear();
    let made = made?;
    rt.block_on(dst.put(PLAN_KEY, made.to_bytes()))?;
    let stored = read_plan(dst, rt)?.ok_or_else(|| Error::NotFound { key: url.clone() })?;
    if stored.id != made.id {
        return Err(Error::invalid(
            url,
            "another task stored a different plan at the same time: the input changed while it was listed",
        ));
    }
    Ok((stored, true))
}

/// `ramjet pack SRC DST --plan`: lists the input once and stores the plan (what each task
/// would otherwise list for itself).
pub fn plan(src: &str, dst: &str, opts: &PackOptions, progress: &indicatif::ProgressBar) -> Result<(Plan, bool)> {
    opts.check()?;
    let source = Source::open(src)?;
    let store = open_dst(dst)?;
    let rt = runtime()?;
    plan_for(&source, &store, &rt, opts, progress)
}

/// What one task did.
#[derive(Debug, Clone)]
pub struct TaskReport {
    /// The plan it followed.
    pub plan: Plan,
    /// Whether this task made the plan.
    pub planned: bool,
    /// The groups it owns.
    pub groups: Range<u64>,
    /// Groups whose part was already there (an earlier run of the task).
    pub resumed: u64,
    /// Samples in its shards.
    pub samples: u64,
    /// Shards in its groups.
    pub shards: u64,
    /// Input bytes read.
    pub input_bytes: u64,
    /// Inputs skipped with `--skip-bad`, in input order.
    pub skipped: Skipped,
    /// Wall time.
    pub elapsed: Duration,
}

/// `ramjet pack SRC DST --tasks N --task I`: packs task `I`'s groups of the plan (making the
/// plan first if the destination has none), writing one part per group. Groups whose part is
/// already there and sound are kept.
pub fn pack_task(
    src: &str,
    dst: &str,
    opts: &PackOptions,
    tasks: u64,
    task: u64,
    progress: &indicatif::ProgressBar,
) -> Result<TaskReport> {
    let t0 = Instant::now();
    opts.check()?;
    if tasks == 0 || task >= tasks {
        return Err(Error::invalid(
            "--task",
            format!("task {task} of {tasks}: tasks are numbered 0 to N - 1"),
        ));
    }
    let source = Source::open(src)?;
    let store = open_dst(dst)?;
    let rt = runtime()?;
    let (plan, planned) = plan_for(&source, &store, &rt, opts, &crate::ui::count_bar("plan"))?;
    let layout = plan.layout()?;
    let groups = plan.slice(tasks, task);
    let label = format!("pack task {task}/{tasks}");
    let input = match layout.kind.is_foreign() {
        true => Some(super::foreign::ForeignInput::open(&source, &rt, layout.kind)?),
        false => None,
    };
    let ctx = Ctx {
        src: &source,
        dst: &store,
        rt: &rt,
        opts,
        layout: &layout,
        progress,
        label: label.clone(),
        objects: Default::default(),
        dedupe: super::dedupe_by(opts, &layout)?,
    };
    progress.set_message(label.clone());
    let mut r = TaskReport {
        plan: plan.clone(),
        planned,
        groups: groups.clone(),
        resumed: 0,
        samples: 0,
        shards: 0,
        input_bytes: 0,
        skipped: Vec::new(),
        elapsed: Duration::ZERO,
    };
    let gi = plan.options.group_items;
    for g in groups.clone() {
        let key = super::split::part_key(g);
        let existing = match rt.block_on(store.get(&key)) {
            Ok(b) => Part::parse(&b, &plan, g).ok(),
            Err(Error::NotFound { .. }) => None,
            Err(e) => return Err(e),
        };
        let part = match existing {
            Some(p) => {
                r.resumed += 1;
                p
            }
            None => {
                let gp = &plan.groups[g as usize];
                let mut out = if let Some(input) = &input {
                    super::foreign::pack_rows(&ctx, input, g * gi, Some(gp.items))?
                } else if layout.kind == SourceKind::Jsonl {
                    let offset = gp.offset.unwrap_or(0);
                    pack_jsonl(&ctx, source.file_reader(&rt, offset)?, g * gi, Some(gp.items))?
                } else {
                    pack_files(&ctx, gp.after.as_deref(), g * gi, Some(gp.items))?
                };
                let got = out.remove(&g).unwrap_or_default();
                if !out.is_empty() || got.items != gp.items || format!("{:016x}", got.hash) != gp.hash {
                    return Err(Error::invalid(
                        source.display.clone(),
                        format!(
                            "the input changed since it was planned: group {g} now starts at {:?} with {} inputs, \
                             the plan says {:?} with {} (and a different list): restore the input, or delete {} \
                             and every part to plan again",
                            got.first,
                            got.items,
                            gp.first,
                            gp.items,
                            store.url(PLAN_KEY)
                        ),
                    ));
                }
                let part = Part::new(&plan, g, got);
                let bytes = serde_json::to_vec(&part).expect("a part serialises");
                rt.block_on(store.put(&key, Bytes::from(bytes)))?;
                part
            }
        };
        r.samples += part.samples;
        r.shards += part.shards.len() as u64;
        r.input_bytes += part.input_bytes;
        r.skipped.extend(part.skipped);
        let done = g + 1 - groups.start;
        let secs = t0.elapsed().as_secs_f64();
        eprintln!(
            "{label}: group {g} done ({done}/{} groups{}): {} samples in {} shards, {} of input, {}/s, {secs:.1} s",
            groups.end - groups.start,
            if r.resumed > 0 {
                format!(", {} resumed", r.resumed)
            } else {
                String::new()
            },
            r.samples,
            r.shards,
            crate::ui::human_bytes(r.input_bytes),
            crate::ui::human_bytes((r.input_bytes as f64 / secs.max(1e-9)) as u64),
        );
    }
    progress.finish_and_clear();
    r.elapsed = t0.elapsed();
    Ok(r)
}

/// A part read and checked, or why it is unsound.
type Checked = std::result::Result<Part, Invalid>;

/// Parts fetched and checked together by a merge.
const MERGE_WINDOW: usize = 1024;

/// Part reads a merge has in flight.
const MERGE_IN_FLIGHT: usize = 64;

/// Shard checks (HEADs) a merge has in flight: at 10^5 parts, 2 x 10^7 shards.
const HEAD_IN_FLIGHT: usize = 256;

/// What a merge did, beside the pack's report.
#[derive(Debug, Clone)]
pub struct MergeReport {
    /// The manifest written, as a one-machine pack reports it.
    pub pack: PackReport,
    /// Parts merged.
    pub parts: u64,
    /// Shards whose stored size was checked.
    pub checked: u64,
}

/// `ramjet pack SRC DST --merge`: checks every part of the destination's plan, then writes the
/// shard table (if any), `manifests/<version>.json` and `manifest.json`, last. With
/// `check_shards`, each shard and sidecar must be stored at its listed size (one HEAD each).
/// `tasks` (when given) names the task to rerun for a part that is missing or damaged.
pub fn merge(
    src: &str,
    dst: &str,
    mode: ShardTableMode,
    tasks: Option<u64>,
    check_shards: bool,
    progress: &indicatif::ProgressBar,
) -> Result<MergeReport> {
    let t0 = Instant::now();
    let store = open_dst(dst)?;
    let rt = runtime()?;
    let url = store.url(PLAN_KEY);
    let plan = read_plan(&store, &rt)?.ok_or_else(|| {
        Error::invalid(
            &url,
            "no plan: run the pack's tasks (--tasks N --task I) before the merge",
        )
    })?;
    if plan.source != src {
        return Err(Error::invalid(
            &url,
            format!(
                "the plan packs {:?}, not {src:?}: merge with the tasks' input",
                plan.source
            ),
        ));
    }
    let layout = plan.layout()?;
    let ng = plan.groups.len() as u64;
    progress.set_length(ng);
    let mut table = ShardTableBuilder::default();
    // The shards, while the JSON may still list them.
    let mut listed: Option<Vec<ShardInfo>> = (mode != ShardTableMode::Always).then(Vec::new);
    let (mut skipped, mut input_bytes, mut checked) = (Vec::new(), 0u64, 0u64);
    let mut pass = super::dedupe::Pass::default();
    let mut missing: Vec<u64> = Vec::new();
    let mut damaged: Vec<(u64, String)> = Vec::new();
    let who = |g: u64| match tasks {
        Some(n) if n > 0 => format!(" (task {} of {n})", owner(g, ng, n)),
        _ => String::new(),
    };
    for lo in (0..ng).step_by(MERGE_WINDOW) {
        let window: Vec<u64> = (lo..(lo + MERGE_WINDOW as u64).min(ng)).collect();
        let got: Vec<Result<Option<Bytes>>> = rt.block_on(
            futures::stream::iter(window.iter())
                .map(|&g| {
                    let store = &store;
                    async move {
                        match store.get(&part_key(g)).await {
                            Ok(b) => Ok(Some(b)),
                            Err(Error::NotFound { .. }) => Ok(None),
                            Err(e) => Err(e),
                        }
                    }
                })
                .buffered(MERGE_IN_FLIGHT)
                .collect(),
        );
        let parsed: Vec<(u64, Result<Option<Checked>>)> = window
            .par_iter()
            .zip(got.into_par_iter())
            .map(|(&g, b)| (g, b.map(|b| b.map(|b| Part::parse(&b, &plan, g)))))
            .collect();
        let mut parts = Vec::with_capacity(parsed.len());
        for (g, p) in parsed {
            match p? {
                None => missing.push(g),
                Some(Err(why)) => damaged.push((g, why.to_string())),
                Some(Ok(p)) => parts.push(p),
            }
        }
        if check_shards && missing.is_empty() && damaged.is_empty() {
            checked += check_stored(&store, &rt, &parts, &who)?;
        }
        for p in parts {
            for s in &p.shards {
                table
                    .push(s)
                    .map_err(|why| Error::invalid(store.url(&part_key(p.group)), why.to_string()))?;
            }
            if let Some(l) = listed.as_mut() {
                l.extend(p.shards.iter().cloned());
                if mode == ShardTableMode::Auto && mode.table_for(l.len() as u64) {
                    listed = None;
                }
            }
            if plan.options.dedupe.is_some() {
                let what = store.url(&part_key(p.group));
                let keys = super::dedupe::keys_from_hex(p.dedupe_keys.as_deref().unwrap_or_default())
                    .map_err(|why| Error::invalid(&what, why))?;
                pass.group(&keys, p.samples, &what)?;
            }
            skipped.extend(p.skipped);
            input_bytes += p.input_bytes;
        }
        progress.inc(window.len() as u64);
    }
    progress.finish_and_clear();
    if !missing.is_empty() || !damaged.is_empty() {
        let mut lines = Vec::new();
        for g in missing.iter().take(10) {
            lines.push(format!("{} missing{}", store.url(&part_key(*g)), who(*g)));
        }
        for (g, why) in damaged.iter().take(10) {
            lines.push(format!("{} damaged{}: {why}", store.url(&part_key(*g)), who(*g)));
        }
        let more = (missing.len() + damaged.len()).saturating_sub(lines.len());
        return Err(Error::invalid(
            store.url(MANIFEST_NAME),
            format!(
                "merge refused: {} of {ng} parts missing and {} damaged (rerun their tasks, then merge again):\n  {}{}",
                missing.len(),
                damaged.len(),
                lines.join("\n  "),
                if more > 0 {
                    format!("\n  ... and {more} more")
                } else {
                    String::new()
                }
            ),
        ));
    }
    if table.is_empty() {
        return Err(Error::invalid(src, "every input was skipped"));
    }
    let (kind, schema, mut meta) = (layout.kind.name(), layout.schema.clone(), layout.meta.clone());
    if let Some(by) = &plan.options.dedupe {
        let by = super::dedupe::DedupeBy::resolve(
            by,
            &layout.schema,
            match layout.kind {
                k if k.is_foreign() => layout.meta.get("image_column").and_then(Json::as_str),
                SourceKind::Jsonl => plan.options.image_column.as_deref(),
                _ => Some("image"),
            },
        )?;
        pass.finish(by.name(), &store, &rt, &mut meta)?;
    }
    let manifest = match listed {
        Some(l) if !mode.table_for(l.len() as u64) => Manifest::new(kind, schema, meta, l),
        _ => {
            let t = table.finish().map_err(|why| Error::invalid("shard table", why))?;
            put_table_and(&store, &rt, t, |t, key| {
                Manifest::with_table(kind, schema, meta, t, key)
            })?
        }
    };
    put_manifest(&store, &rt, &manifest)?;
    Ok(MergeReport {
        pack: PackReport {
            manifest_url: store.url(MANIFEST_NAME),
            manifest,
            skipped,
            input_bytes,
            elapsed: t0.elapsed(),
        },
        parts: ng,
        checked,
    })
}

/// Checks that each shard (and sidecar) of `parts` is stored at its listed size; returns how
/// many objects were checked.
fn check_stored(
    store: &Store,
    rt: &tokio::runtime::Runtime,
    parts: &[Part],
    who: &(dyn Fn(u64) -> String + Sync),
) -> Result<u64> {
    let objects: Vec<(u64, &str, u64)> = parts
        .iter()
        .flat_map(|p| {
            p.shards.iter().flat_map(move |s| {
                std::iter::once((p.group, s.key.as_str(), s.bytes))
                    .chain(s.columns.as_ref().map(|c| (p.group, c.key.as_str(), c.bytes)))
            })
        })
        .collect();
    let sizes: Vec<Result<u64>> = rt.block_on(
        futures::stream::iter(objects.iter())
            .map(|(_, k, _)| store.size(k))
            .buffered(HEAD_IN_FLIGHT)
            .collect(),
    );
    for ((g, k, want), got) in objects.iter().zip(sizes) {
        let why = match got {
            Ok(n) if n == *want => continue,
            Ok(n) => format!("is {n} bytes, its part lists {want}"),
            Err(Error::NotFound { .. }) => "is missing".into(),
            Err(e) => return Err(e),
        };
        return Err(Error::invalid(
            store.url(k),
            format!(
                "merge refused: {why} ({} of group {g}{}): rerun that task, then merge again",
                part_key(*g),
                who(*g)
            ),
        ));
    }
    Ok(objects.len() as u64)
}

/// Writes the plan and the parts of a simulated split pack of `samples` samples in `parts`
/// groups into folder `dir` (`ramjet merge-sim`), for measuring the merge at any scale: shards
/// of `shard_samples` samples of 150 KB images, whose objects do not exist (merge them with
/// `--no-check-shards`). Returns the source name the merge must be given.
pub fn simulate(dir: &std::path::Path, parts: u64, samples: u64, shard_samples: u64) -> Result<String> {
    use ramjet_engine::format::shard_key;
    const SOURCE: &str = "merge-sim";
    if parts == 0 || samples < parts || shard_samples == 0 {
        return Err(Error::invalid(
            "merge-sim",
            "needs 1 <= parts <= samples and shard samples >= 1",
        ));
    }
    let gi = samples.div_ceil(parts);
    let groups: Vec<GroupPlan> = (0..parts)
        .map(|g| {
            let items = gi.min(samples.saturating_sub(g * gi));
            GroupPlan {
                after: (g > 0).then(|| format!("class/{:012}.jpg", g * gi - 1)),
                offset: None,
                first: format!("class/{:012}.jpg", g * gi),
                items,
                hash: format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&g.to_le_bytes())),
            }
        })
        .collect();
    let schema = super::imagefolder_schema()?;
    let mut meta = Map::new();
    meta.insert("classes".into(), Json::from(vec!["class"]));
    let mut plan = Plan {
        plan_format: PLAN_FORMAT,
        id: String::new(),
        source: SOURCE.into(),
        layout: SourceKind::Imagefolder.name().into(),
        options: PlanOptions::of(&PackOptions {
            group_items: gi,
            ..PackOptions::default()
        }),
        schema,
        meta,
        items: samples,
        groups,
    };
    if plan.groups.iter().any(|g| g.items == 0) {
        return Err(Error::invalid("merge-sim", "more parts than groups of samples"));
    }
    plan.id = plan.compute_id();
    let pdir = dir.join("parts");
    std::fs::create_dir_all(&pdir).map_err(|e| Error::io(pdir.display(), e))?;
    let io = |p: &std::path::Path, e| Error::io(p.display(), e);
    let plan_path = dir.join(PLAN_KEY);
    std::fs::write(&plan_path, plan.to_bytes()).map_err(|e| io(&plan_path, e))?;
    (0..parts).into_par_iter().try_for_each(|g| {
        let gp = &plan.groups[g as usize];
        let (mut shards, mut left, mut j) = (Vec::new(), gp.items, 0u64);
        while left > 0 {
            let n = left.min(shard_samples);
            let checksum = xxhash_rust::xxh3::xxh3_64(&(g * gi + j).to_le_bytes());
            shards.push(ShardInfo {
                key: shard_key((g * gi + j) as usize, checksum),
                bytes: n * 150_000,
                samples: n,
                checksum: checksum.into(),
                columns: None,
                foreign: None,
            });
            (left, j) = (left - n, j + 1);
        }
        let out = GroupOut {
            items: gp.items,
            hash: u64::from_str_radix(&gp.hash, 16).expect("hex"),
            first: gp.first.clone(),
            input_bytes: gp.items * 150_000,
            shards,
            skipped: Vec::new(),
            keys: Vec::new(),
        };
        let p = dir.join(part_key(g));
        let part = Part::new(&plan, g, out);
        std::fs::write(&p, serde_json::to_vec(&part).expect("a part serialises")).map_err(|e| io(&p, e))
    })?;
    Ok(SOURCE.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_every_group_once_and_name_their_owner() {
        let plan_of = |n: usize| Plan {
            plan_format: PLAN_FORMAT,
            id: String::new(),
            source: String::new(),
            layout: "jsonl".into(),
            options: PlanOptions::of(&PackOptions::default()),
            schema: Schema::new([("a", ramjet_engine::format::ColumnType::Int64)]).unwrap(),
            meta: Map::new(),
            items: 0,
            groups: vec![
                GroupPlan {
                    after: None,
                    offset: None,
                    first: String::new(),
                    items: 0,
                    hash: String::new()
                };
                n
            ],
        };
        for groups in [1usize, 2, 5, 64, 1000] {
            let p = plan_of(groups);
            for tasks in [1u64, 2, 3, 7, 64, 1000, 5000] {
                let mut next = 0;
                for t in 0..tasks {
                    let s = p.slice(tasks, t);
                    assert_eq!(s.start, next, "{groups} groups, {tasks} tasks");
                    for g in s.clone() {
                        assert_eq!(
                            owner(g, groups as u64, tasks),
                            t,
                            "group {g} of {groups}, {tasks} tasks"
                        );
                    }
                    next = s.end;
                }
                assert_eq!(next, groups as u64);
            }
        }
    }
}
