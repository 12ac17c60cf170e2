//! `ramjet plan-sim`: measure the cost of starting an epoch over a simulated dataset of any size: a real.

use std::path::PathBuf;
use std::process::ExitCode;

use ramjet_engine::order::{OrderSpec, Shares, Shuffle, Tail};

#[derive(clap::Args)]
pub struct Args {
    /// Folder for the simulated manifests (kept and reused per size).
    #[arg(long)]
    pub dir: PathBuf,
    /// Samples in the dataset.
    #[arg(long)]
    pub samples: u64,
    /// Samples per shard.
    #[arg(long, default_value_t = 1000)]
    pub shard_samples: u64,
    /// Shuffle: none or block (the stub serves whole shards, so not global).
    #[arg(long, default_value = "block")]
    pub shuffle: String,
    /// Shards per window of the block shuffle.
    #[arg(long, default_value_t = 4)]
    pub window: usize,
    /// Nodes of the simulated job.
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// Ranks on each node (`LOCAL_WORLD_SIZE`).
    #[arg(long, default_value_t = 1)]
    pub ranks_per_node: usize,
    /// The order's canonical partitions (a multiple of the nodes deals node by node).
    #[arg(long, default_value_t = 1)]
    pub partitions: usize,
    /// Sticky shares (`docs/order.md`, "Later epochs").
    #[arg(long)]
    pub sticky: bool,
    /// The rank whose first sample is measured.
    #[arg(long, default_value_t = 0)]
    pub rank: usize,
    /// Also walk this node's whole epoch and count the shards it reads (after the first
    /// sample's measure, in the same child).
    #[arg(long)]
    pub node_shards: Option<usize>,
    /// Measure in this process (the parent prepares, then runs this in a child).
    #[arg(long, hide = true)]
    pub measure: bool,
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let shuffle = match a.shuffle.as_str() {
        "none" => Shuffle::None,
        "block" => Shuffle::ShardBlock {
            window_shards: a.window.max(1),
            block_samples: 1,
        },
        other => anyhow::bail!("plan-sim --shuffle: {other:?} is not none or block"),
    };
    if a.nodes == 0 || a.ranks_per_node == 0 || a.rank >= a.nodes * a.ranks_per_node {
        anyhow::bail!(
            "plan-sim: rank {} of {} nodes x {} ranks does not exist",
            a.rank,
            a.nodes,
            a.ranks_per_node
        );
    }
    if a.node_shards.is_some_and(|n| n >= a.nodes) {
        anyhow::bail!("plan-sim --node-shards: node {:?} of {} nodes", a.node_shards, a.nodes);
    }
    let job = crate::plansim::SimJob {
        nodes: a.nodes,
        ranks_per_node: a.ranks_per_node,
        rank: a.rank,
        order: OrderSpec {
            shuffle,
            partitions: a.partitions.max(1),
            tail: Tail::PadRepeat,
            shares: if a.sticky { Shares::Sticky } else { Shares::Rotate },
            ..OrderSpec::default()
        },
    };
    let (url, shard) = crate::plansim::prepare(&a.dir, a.samples, a.shard_samples)?;
    if a.measure {
        let r = crate::plansim::first_sample(&url, shard, &job)?;
        println!("{}", serde_json::to_string(&r)?);
        if let Some(n) = a.node_shards {
            println!(
                "{}",
                serde_json::to_string(&crate::plansim::node_shards(&url, &job, n)?)?
            );
        }
    } else {
        let out = std::process::Command::new(std::env::current_exe()?)
            .args(std::env::args_os().skip(1))
            .arg("--measure")
            .output()?;
        if !out.status.success() {
            anyhow::bail!("plan-sim: {}", String::from_utf8_lossy(&out.stderr));
        }
        print!("{}", String::from_utf8_lossy(&out.stdout));
    }
    Ok(ExitCode::SUCCESS)
}
