//! `ramjet inspect`: print a dataset's schema, shard count, sample count and bytes.

use std::process::ExitCode;

use ramjet_engine::Dataset;

use super::runtime;
use crate::ui::human_bytes;

#[derive(clap::Args)]
pub struct Args {
    /// Dataset URL (a prefix, or a manifest .json).
    pub url: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let Args { url, json } = a;
    let ds = runtime()?.block_on(Dataset::open(&url))?;
    let m = ds.manifest();
    let restart_px = m.jpeg_restart_px();
    if json {
        let v = serde_json::json!({
            "url": ds.manifest_url(),
            "version": m.version,
            "source": m.packed_from,
            "schema": m.schema,
            "shards": m.shard_count(),
            "samples": m.samples,
            "bytes": m.bytes,
            "meta": m.meta,
            "learned_index": ds.learned_index_url(),
            "jpeg_restart_px": restart_px,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("dataset  {}", ds.manifest_url());
        if let Some(l) = ds.learned_index_url() {
            println!("index    learned on this host, kept in {l} (no `ramjet index` beside the data)");
        }
        println!("version  {}", m.version);
        println!("source   {}", m.packed_from);
        println!("schema   {}", m.schema.describe());
        println!("shards   {}", m.shard_count());
        println!("samples  {}", m.samples);
        println!(
            "bytes    {} ({} per sample on average)",
            human_bytes(m.bytes),
            human_bytes(m.bytes / m.samples.max(1))
        );
        if let Some(px) = restart_px {
            println!("jpegs    stored with a restart marker every {px} px (transcoded losslessly: the same pixels)");
        }
        if let Some(c) = m.meta.get("classes").and_then(|c| c.as_array()) {
            let names: Vec<&str> = c.iter().filter_map(|x| x.as_str()).collect();
            println!("classes  {} ({})", names.len(), names.join(", "));
        }
    }
    Ok(ExitCode::SUCCESS)
}
