//! `ramjet pack`: pack an image folder, a YOLO layout, a JSONL file, or data in another format
//! (Parquet, a Hugging Face `save_to_disk` folder, LitData, MDS), local or in an object store,
//! into shards plus a manifest, on one machine or split into tasks and merged.

use std::process::ExitCode;

use anyhow::Context;

use crate::pack::split::{merge, pack_task, plan};
use crate::pack::{pack, PackOptions, PackReport, SourceKind, GROUP_ITEMS_DEFAULT};
use crate::ui::{bytes_bar, count_bar, human_bytes, parse_size};

#[derive(clap::Args)]
pub struct Args {
    /// Input: a folder (YOLO or one subfolder per class) or a .jsonl file, local or in an object
    /// store (s3://bucket/raw/ for a folder, s3://bucket/raw/rows.jsonl for a JSONL object); or
    /// a folder of Parquet files, a Hugging Face save_to_disk folder, LitData's chunks or an
    /// MDS folder, packed from its samples in its order (docs/format.md, "Source layouts").
    pub src: String,
    /// Output: a local folder, file://, or s3://bucket/prefix (also gs://, az://).
    pub dst: String,
    /// Target shard size, e.g. 64MiB.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    pub shard_size: u64,
    /// Also cut a shard at this many samples. With a --group-size that is a multiple of it
    /// (and nothing skipped), every shard but the last holds exactly as many, and the shard
    /// table says so: the order then reads no table block for counts.
    #[arg(long)]
    pub shard_samples: Option<u64>,
    /// Input layout (detected when omitted).
    #[arg(long, value_enum)]
    pub format: Option<SourceKind>,
    /// Skip unreadable or unsupported inputs, then list them, instead of aborting.
    #[arg(long)]
    pub skip_bad: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// List the shards in a binary shard table beside the manifest (48 bytes a shard)
    /// rather than in its JSON: `auto` does so above 4,096 shards.
    #[arg(long, value_enum, default_value = "auto")]
    pub shard_table: crate::pack::ShardTableMode,
    /// Store JPEGs transcoded losslessly (the same pixels, not the same bytes) with a
    /// restart marker every 32 pixels of each MCU row and optimal Huffman tables: a random
    /// crop then decodes only the part of the image it needs, about 1.3x faster.
    #[arg(long)]
    pub jpeg_restarts: bool,
    /// Decode every image in full at pack time (in parallel), not only its header: an image
    /// that does not decode aborts the pack naming it, or with --skip-bad is skipped and
    /// listed
    #[arg(long)]
    pub check_decode: bool,
    /// Drop each sample whose column KEY (e.g. sample_id), or with `content` whose image
    /// bytes, an earlier sample had; the manifest lists them and every reader leaves them out
    /// (the same result for one machine and for a split pack; docs/format.md, "Dedupe").
    #[arg(long, value_name = "KEY|content")]
    pub dedupe: Option<String>,
    /// A JSONL column whose strings name images (a key relative to the JSONL's folder, a path,
    /// or a URL such as s3://bucket/key): each is fetched and stored as the image's bytes. For
    /// Parquet, save_to_disk, LitData or MDS input: the bytes column that holds the images
    /// (else the one named `image`, or the first of image files).
    #[arg(long)]
    pub image_column: Option<String>,
    /// A JSONL column's type, NAME:TYPE, instead of the first line's (repeatable): an array
    /// type reads JSON lists of numbers, or strings naming .npy files (FILE.npz#NAME for an
    /// .npz member), e.g. tokens:int32[?], emb:float32[768], boxes:float32[?,4]
    /// (docs/format.md, "Array columns").
    #[arg(long = "column", value_name = "NAME:TYPE")]
    pub column_types: Vec<String>,
    /// A Hugging Face tokenizer.json (a local file): the JSONL's --text-column is tokenized
    /// in parallel and stored as a `tokens` array column in its place (uint16 ids when its
    /// largest id is at most 65,535, else uint32); the manifest's meta.tokenizer records the
    /// file's checksum and its end-of-document token (docs/python.md, "Token streams").
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<String>,
    /// The JSONL column --tokenizer reads.
    #[arg(long, default_value = "text", requires = "tokenizer")]
    pub text_column: String,
    /// Inputs in a group, the unit a split pack divides (the same value gives the same shards
    /// whatever the number of tasks).
    #[arg(long, default_value_t = GROUP_ITEMS_DEFAULT)]
    pub group_size: u64,
    /// Split the pack into N tasks: with --task I, pack task I's part; with --merge, write the
    /// manifest of all parts.
    #[arg(long)]
    pub tasks: Option<u64>,
    /// Which task (0 to N - 1) to pack; $SLURM_ARRAY_TASK_ID in a job array.
    #[arg(long, requires = "tasks", conflicts_with = "merge")]
    pub task: Option<u64>,
    /// Check every task's part and write the dataset's manifest (and shard table) in one step.
    #[arg(long)]
    pub merge: bool,
    /// Only list the input and store the plan the tasks follow (else the first task makes it).
    #[arg(long, conflicts_with_all = ["merge", "task"])]
    pub plan: bool,
    /// With --merge: trust the parts' shard sizes instead of checking each stored shard (one
    /// HEAD each).
    #[arg(long, requires = "merge")]
    pub no_check_shards: bool,
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let opts = PackOptions {
        shard_bytes_target: a.shard_size,
        shard_samples_max: a.shard_samples,
        skip_bad: a.skip_bad,
        kind: a.format,
        shard_table: a.shard_table,
        jpeg_restarts: a.jpeg_restarts,
        check_decode: a.check_decode,
        group_items: a.group_size,
        image_column: a.image_column.clone(),
        column_types: a.column_types.clone(),
        tokenizer: a.tokenizer.clone(),
        text_column: a.text_column.clone(),
        dedupe: a.dedupe.clone(),
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(a.threads.unwrap_or(0))
        .build()
        .context("thread pool")?;
    if a.plan {
        let (p, made) = pool.install(|| plan(&a.src, &a.dst, &opts, &count_bar("plan")))?;
        println!(
            "pack: plan {} {}: {} inputs in {} groups of {}",
            p.id,
            if made { "stored" } else { "already there" },
            p.items,
            p.groups.len(),
            p.options.group_items
        );
        return Ok(ExitCode::SUCCESS);
    }
    if a.merge {
        let r = pool.install(|| {
            merge(
                &a.src,
                &a.dst,
                a.shard_table,
                a.tasks,
                !a.no_check_shards,
                &count_bar("merge"),
            )
        })?;
        println!(
            "pack: merged {} parts{} in {:.2} s",
            r.parts,
            if r.checked > 0 {
                format!(" ({} stored objects checked)", r.checked)
            } else {
                String::new()
            },
            r.pack.elapsed.as_secs_f64()
        );
        report(&r.pack);
        return Ok(ExitCode::SUCCESS);
    }
    match (a.tasks, a.task) {
        (Some(n), Some(i)) => {
            let r = pool.install(|| pack_task(&a.src, &a.dst, &opts, n, i, &bytes_bar("pack")))?;
            let secs = r.elapsed.as_secs_f64();
            println!(
                "pack task {i}/{n}: groups {}..{} of {} ({} resumed{}): {} samples in {} shards from {} of input in \
                 {secs:.2} s ({}/s)",
                r.groups.start,
                r.groups.end,
                r.plan.groups.len(),
                r.resumed,
                if r.planned { ", plan made by this task" } else { "" },
                r.samples,
                r.shards,
                human_bytes(r.input_bytes),
                human_bytes((r.input_bytes as f64 / secs.max(1e-9)) as u64),
            );
            skipped(&r.skipped);
            peak_rss();
            Ok(ExitCode::SUCCESS)
        }
        (Some(_), None) => anyhow::bail!("--tasks N needs --task I (pack one task's part), --merge or --plan"),
        _ => {
            let r = pool.install(|| pack(&a.src, &a.dst, &opts, &bytes_bar("pack")))?;
            report(&r);
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn report(r: &PackReport) {
    let secs = r.elapsed.as_secs_f64();
    println!(
        "pack: {} samples in {} shards ({}) from {} of input in {:.2} s ({}/s) -> {}",
        r.manifest.samples,
        r.manifest.shard_count(),
        human_bytes(r.manifest.bytes),
        human_bytes(r.input_bytes),
        secs,
        human_bytes((r.input_bytes as f64 / secs.max(1e-9)) as u64),
        r.manifest_url
    );
    println!("pack: manifest version {}", r.manifest.version);
    if let Some(d) = r.manifest.meta.get("dedupe") {
        let n = d.get("dropped").and_then(|n| n.as_u64()).unwrap_or(0);
        let by = d.get("by").and_then(|b| b.as_str()).unwrap_or("?");
        println!(
            "pack: dedupe by {by}: {n} duplicates dropped ({} samples kept)",
            r.manifest.samples - n
        );
    }
    peak_rss();
    skipped(&r.skipped);
}

/// The peak memory of the whole run (a pack is a stream: it stays about (threads + 2) x
/// --shard-size, whatever the input's size).
fn peak_rss() {
    if let Some(kb) = std::fs::read_to_string("/proc/self/status").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
    }) {
        println!("pack: peak RSS {} MiB", kb / 1024);
    }
}

fn skipped(s: &[(String, String)]) {
    if !s.is_empty() {
        println!("pack: skipped {} bad input(s):", s.len());
        for (what, why) in s {
            println!("  {what}: {why}");
        }
    }
}
