//! `ramjet audit`: the exactly-once audit of saved job or consumer states.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use ramjet_engine::order::{Topology, Weight};
use ramjet_engine::{SourceConfig, StreamConfig, StreamState};

use super::runtime;

use super::stream::parse_weight;

#[derive(clap::Args)]
pub struct Args {
    /// The job's sources (dataset URLs), in the order the job lists them.
    #[arg(required = true)]
    pub urls: Vec<String>,
    /// Saved states: a job's (Python `state_dict()`, or its `resume` JSON) or every
    /// consumer's (`ramjet stream --state` files, a DataLoader worker's `state_dict()`,
    /// or raw consumer states), taken at the same step.
    #[arg(long = "state", required = true)]
    pub states: Vec<PathBuf>,
    /// Sampling weight per source (natural, p:X, r:X, n:N), as the job used.
    #[arg(long = "weight")]
    pub weights: Vec<String>,
    /// Consumers (ranks x workers) of the job, for a job state whose tail was dropped or
    /// padded (a consumer's state records its epoch's length itself).
    #[arg(long, default_value_t = 1)]
    pub consumers: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    audit_cmd(&a.urls, &a.states, &a.weights, a.consumers, a.json)
}

/// One saved state for `ramjet audit`: a job's position, or one consumer's.
enum Saved {
    Job(ramjet_engine::stream::ResumePoint),
    Consumer(StreamState),
}

/// Reads any state ramjet saves: `ramjet stream --state` (`{"state": ..., "out_len"}`), a
/// Python `state_dict()` (`{"resume": "<json>"}` or a worker's `{"consumer": "<json>"}`), a
/// job's resume JSON, or a consumer's state.
fn read_saved(p: &std::path::Path) -> anyhow::Result<Saved> {
    let text = ramjet_engine::io::read_file_bounded(p, 1 << 30)?;
    let v: serde_json::Value = serde_json::from_slice(&text).with_context(|| format!("{}: not JSON", p.display()))?;
    let inner = |field: &str| -> anyhow::Result<Option<serde_json::Value>> {
        match v.get(field) {
            Some(serde_json::Value::String(s)) => Ok(Some(serde_json::from_str(s)?)),
            Some(serde_json::Value::Null) | None => Ok(None),
            Some(other) => Ok(Some(other.clone())),
        }
    };
    let what = |e: serde_json::Error| anyhow::anyhow!("{}: not a ramjet state ({e})", p.display());
    if let Some(c) = inner("consumer")? {
        return Ok(Saved::Consumer(serde_json::from_value(c).map_err(what)?));
    }
    if let Some(r) = inner("resume")? {
        return Ok(Saved::Job(serde_json::from_value(r).map_err(what)?));
    }
    if let Some(s) = v.get("state") {
        return Ok(Saved::Consumer(serde_json::from_value(s.clone()).map_err(what)?));
    }
    if v.get("progress").is_some() {
        return Ok(Saved::Job(serde_json::from_value(v).map_err(what)?));
    }
    Ok(Saved::Consumer(serde_json::from_value(v).map_err(what)?))
}

fn audit_cmd(
    urls: &[String],
    paths: &[PathBuf],
    weights: &[String],
    consumers: usize,
    json: bool,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(consumers >= 1, "--consumers must be at least 1");
    let mut jobs = Vec::new();
    let mut each = Vec::new();
    for p in paths {
        match read_saved(p)? {
            Saved::Job(j) => jobs.push(j),
            Saved::Consumer(c) => each.push(c),
        }
    }
    let (point, len) = match (jobs.len(), each.is_empty()) {
        (0, false) => {
            let (p, len) = StreamState::combine(&each)?;
            (p, Some(len))
        }
        (1, true) => (jobs.pop().expect("one"), None),
        _ => anyhow::bail!(
            "give one job state, or the states of every consumer of the job (got {} job and {} consumer states)",
            jobs.len(),
            each.len()
        ),
    };
    let mut cfg = StreamConfig::new(urls[0].clone());
    cfg.sources = urls
        .iter()
        .enumerate()
        .map(|(i, u)| {
            Ok(SourceConfig {
                url: u.clone(),
                weight: match weights.get(i) {
                    Some(w) => parse_weight(w)?,
                    None => Weight::Natural,
                },
            })
        })
        .collect::<anyhow::Result<_>>()?;
    cfg.order = point.order;
    cfg.topology = Topology {
        rank: 0,
        world: consumers,
        ..Topology::default()
    };
    let report = runtime()?.block_on(ramjet_engine::stream::audit(&cfg, &point, len))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "audit: {} ({} of {} positions delivered)",
            report.message, report.expected, report.len
        );
    }
    Ok(if report.exactly_once {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
