//! Which rank of which job this process is: from the caller's arguments, torch.distributed
//! (when initialised), and the launcher's environment (torchrun's `RANK` / `WORLD_SIZE` /
//! `LOCAL_RANK` / `LOCAL_WORLD_SIZE`, Slurm's `SLURM_PROCID` / `SLURM_NTASKS` /
//! `SLURM_LOCALID` / `SLURM_NTASKS_PER_NODE`). Every source is checked alike: a value that is
//! not a count, a rank past its world, a variable set without its partner, or two sources that
//! disagree is an [`Error::InvalidInput`] naming both, never clamped into some other rank's
//! samples (`docs/order.md`, "Rank and world").

use crate::error::{Error, Result};

/// One source's rank and world, with the names they were read under (for the errors).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankWorld {
    /// Rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world: usize,
    /// Where the rank came from (`RANK=3`, `rank=3 (argument)`).
    pub rank_from: String,
    /// Where the world came from.
    pub world_from: String,
}

/// The resolved place of this process in its job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// Rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world: usize,
    /// Rank among the processes of this host.
    pub local_rank: usize,
    /// Processes on this host.
    pub local_world: usize,
}

/// What the caller was given: its own arguments and torch.distributed's view, if any.
#[derive(Debug, Clone, Default)]
pub struct Given {
    /// `rank=` as an argument.
    pub rank: Option<usize>,
    /// `world_size=` as an argument.
    pub world: Option<usize>,
    /// `torch.distributed.get_rank()` / `get_world_size()` when initialised.
    pub dist: Option<(usize, usize)>,
}

fn bad(what: &str, why: String) -> Error {
    Error::invalid(what, why)
}

/// Variable `k` of `env` as a count: `None` when unset or empty; a value that is not an integer
/// of at least 0 is an error naming the variable.
fn count(env: &dyn Fn(&str) -> Option<String>, k: &str) -> Result<Option<usize>> {
    let Some(v) = env(k) else { return Ok(None) };
    let t = v.trim();
    if t.is_empty() {
        return Ok(None);
    }
    t.parse::<usize>()
        .map(Some)
        .map_err(|_| bad(k, format!("{v:?} in the environment is not an integer of at least 0")))
}

/// Slurm's tasks per node (`4`, `2(x3)`, `4,2(x2)`): the most on any node.
fn tasks_per_node(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    let Some(v) = env("SLURM_NTASKS_PER_NODE").filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    let mut most = 0;
    for part in v.trim().split(',') {
        let n = part.split('(').next().unwrap_or("").trim();
        let n = n.parse::<usize>().map_err(|_| {
            bad(
                "SLURM_NTASKS_PER_NODE",
                format!("{v:?} is not Slurm's form (4, 2(x3), 4,2(x2))"),
            )
        })?;
        most = most.max(n);
    }
    Ok(Some(most))
}

/// A pair read from variables `rk` and `wk`: both or neither must be set, and the rank must be
/// below a world of at least 1.
fn pair(env: &dyn Fn(&str) -> Option<String>, rk: &str, wk: &str) -> Result<Option<RankWorld>> {
    match (count(env, rk)?, count(env, wk)?) {
        (None, None) => Ok(None),
        (Some(r), None) => Err(bad(
            wk,
            format!("is not set while {rk}={r} is: a rank needs its world size (both, or neither)"),
        )),
        (None, Some(w)) => Err(bad(
            rk,
            format!("is not set while {wk}={w} is: every process would be rank 0 (both, or neither)"),
        )),
        (Some(rank), Some(world)) => checked(RankWorld {
            rank,
            world,
            rank_from: format!("{rk}={rank}"),
            world_from: format!("{wk}={world}"),
        })
        .map(Some),
    }
}

/// `rw` when its world is at least 1 and its rank below it.
fn checked(rw: RankWorld) -> Result<RankWorld> {
    if rw.world == 0 {
        return Err(bad(&rw.world_from, "a job has at least one rank, not 0".into()));
    }
    if rw.rank >= rw.world {
        return Err(bad(
            &rw.rank_from,
            format!("is not below {}: ranks are 0..world_size", rw.world_from),
        ));
    }
    Ok(rw)
}

/// Whether two sources name the same place; an error naming both when they do not.
fn agree(a: &RankWorld, b: &RankWorld) -> Result<()> {
    if a.rank != b.rank || a.world != b.world {
        return Err(bad(
            "rank and world_size",
            format!(
                "{} with {} contradicts {} with {}: two sources of this process's rank disagree \
                 (ranks reading each other's samples); make them agree or leave one out",
                a.rank_from, a.world_from, b.rank_from, b.world_from
            ),
        ));
    }
    Ok(())
}

/// Whether this process runs in an `srun` step (`SLURM_STEP_ID` set): only then do Slurm's
/// task variables describe this process rather than the allocation.
fn in_srun_step(env: &dyn Fn(&str) -> Option<String>) -> bool {
    env("SLURM_STEP_ID").is_some_and(|v| !v.trim().is_empty())
}

/// The job as the launcher's environment states it: torchrun's variables, else Slurm's inside
/// an `srun` step (`SLURM_STEP_ID` set: a batch script's own environment names the allocation,
/// not this process). When both are set with the same world size (one task per rank, as
/// `tools/slurm/ramjet-slurm` launches), their ranks must agree; torchrun under `srun` (one task
/// per node, torchrun's world larger) is not a contradiction.
pub fn env_job(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<RankWorld>> {
    let torchrun = pair(env, "RANK", "WORLD_SIZE")?;
    let slurm = if in_srun_step(env) {
        pair(env, "SLURM_PROCID", "SLURM_NTASKS")?
    } else {
        None
    };
    match (torchrun, slurm) {
        (Some(t), Some(s)) if t.world == s.world => agree(&t, &s).map(|_| Some(t)),
        (Some(t), _) => Ok(Some(t)),
        (None, s) => Ok(s),
    }
}

/// The host-local rank and size: `LOCAL_RANK` / `LOCAL_WORLD_SIZE`, else Slurm's
/// `SLURM_LOCALID` / `SLURM_NTASKS_PER_NODE`, else 0 of 1; checked like the job's.
fn local(env: &dyn Fn(&str) -> Option<String>, world: usize) -> Result<(usize, usize)> {
    let lw = count(env, "LOCAL_WORLD_SIZE")?;
    let lr = count(env, "LOCAL_RANK")?;
    let (rank, size, names) = match (lr, lw) {
        (Some(r), Some(w)) => (r, w, ("LOCAL_RANK", "LOCAL_WORLD_SIZE")),
        (Some(r), None) => (
            r,
            tasks_per_node(env)?.unwrap_or(r + 1),
            ("LOCAL_RANK", "SLURM_NTASKS_PER_NODE"),
        ),
        (None, Some(w)) => (0, w, ("LOCAL_RANK", "LOCAL_WORLD_SIZE")),
        (None, None) => match (count(env, "SLURM_LOCALID")?, tasks_per_node(env)?) {
            (Some(r), Some(w)) if in_srun_step(env) => (r, w, ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")),
            _ => (0, 1, ("LOCAL_RANK", "LOCAL_WORLD_SIZE")),
        },
    };
    if size == 0 || rank >= size {
        return Err(bad(
            names.0,
            format!(
                "{rank} is not below {}={size}: local ranks are 0..local world size",
                names.1
            ),
        ));
    }
    if size > world {
        return Err(bad(
            names.1,
            format!("{size} processes on this host exceed the job's world size {world}"),
        ));
    }
    Ok((rank, size))
}

/// Resolves this process's place from `given` and the environment `env`. Both arguments
/// together override the job (a validation set read whole on one rank is `rank=0,
/// world_size=1` inside a larger job); one argument alone takes the other from the job and must
/// fit it; torch.distributed, when initialised, must agree with the environment; absent all,
/// rank 0 of 1.
pub fn resolve(given: &Given, env: &dyn Fn(&str) -> Option<String>) -> Result<Launch> {
    let from_env = env_job(env)?;
    let dist = match given.dist {
        Some((rank, world)) => Some(checked(RankWorld {
            rank,
            world,
            rank_from: format!("torch.distributed rank {rank}"),
            world_from: format!("torch.distributed world size {world}"),
        })?),
        None => None,
    };
    if let (Some(d), Some(e)) = (&dist, &from_env) {
        agree(d, e)?;
    }
    let job = dist.or(from_env).unwrap_or(RankWorld {
        rank: 0,
        world: 1,
        rank_from: "rank 0 (the default)".into(),
        world_from: "world_size 1 (the default)".into(),
    });
    let rank = given
        .rank
        .map_or((job.rank, job.rank_from), |r| (r, format!("rank={r} (argument)")));
    let world = given.world.map_or((job.world, job.world_from), |w| {
        (w, format!("world_size={w} (argument)"))
    });
    let mine = checked(RankWorld {
        rank: rank.0,
        world: world.0,
        rank_from: rank.1,
        world_from: world.1,
    })?;
    let (local_rank, local_world) = if given.rank.is_some() && given.world.is_some() {
        (0, 1)
    } else {
        local(env, mine.world)?
    };
    Ok(Launch {
        rank: mine.rank,
        world: mine.world,
        local_rank,
        local_world,
    })
}

/// [`resolve`] over this process's environment.
pub fn resolve_env(given: &Given) -> Result<Launch> {
    resolve(given, &|k| std::env::var(k).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    fn err(given: &Given, pairs: &[(&str, &str)]) -> String {
        resolve(given, &env(pairs)).unwrap_err().to_string()
    }

    #[test]
    fn torchrun_s_variables_give_the_place_and_a_bad_one_is_named() {
        let l = resolve(
            &Given::default(),
            &env(&[
                ("RANK", "2"),
                ("WORLD_SIZE", "4"),
                ("LOCAL_RANK", "0"),
                ("LOCAL_WORLD_SIZE", "2"),
            ]),
        )
        .unwrap();
        assert_eq!((l.rank, l.world, l.local_rank, l.local_world), (2, 4, 0, 2));
        let g = Given::default();
        assert!(err(&g, &[("RANK", "3"), ("WORLD_SIZE", "2")]).contains("RANK=3"));
        assert!(err(&g, &[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("WORLD_SIZE=2"));
        assert!(err(&g, &[("RANK", "0"), ("WORLD_SIZE", "0")]).contains("WORLD_SIZE=0"));
        assert!(err(&g, &[("RANK", "-1"), ("WORLD_SIZE", "2")]).contains("RANK"));
        assert!(err(&g, &[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("\"x\""));
        assert!(err(&g, &[("WORLD_SIZE", "2")]).contains("RANK"));
        assert!(err(&g, &[("RANK", "1")]).contains("WORLD_SIZE"));
        let e = err(
            &g,
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "2"),
                ("LOCAL_WORLD_SIZE", "2"),
            ],
        );
        assert!(e.contains("LOCAL_RANK") && e.contains("LOCAL_WORLD_SIZE"), "{e}");
        let e = err(&g, &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "4")]);
        assert!(e.contains("exceed"), "{e}");
    }

    #[test]
    fn a_contradiction_between_sources_names_both() {
        let args = Given {
            rank: Some(3),
            ..Default::default()
        };
        let e = err(&args, &[("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert!(e.contains("rank=3 (argument)") && e.contains("WORLD_SIZE=2"), "{e}");
        let dist = Given {
            dist: Some((1, 2)),
            ..Default::default()
        };
        let e = err(&dist, &[("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert!(e.contains("torch.distributed rank 1") && e.contains("RANK=0"), "{e}");
        let step = [("SLURM_STEP_ID", "0"), ("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")];
        let e = err(
            &Given::default(),
            &[step[0], step[1], step[2], ("RANK", "0"), ("WORLD_SIZE", "2")],
        );
        assert!(e.contains("RANK=0") && e.contains("SLURM_PROCID=1"), "{e}");
        // torchrun under srun (one task per node): torchrun's world is larger, no contradiction.
        let l = resolve(
            &Given::default(),
            &env(&[step[0], step[1], step[2], ("RANK", "5"), ("WORLD_SIZE", "8")]),
        )
        .unwrap();
        assert_eq!((l.rank, l.world), (5, 8));
        // Both arguments override the job (a set read whole on one rank); alone they are checked.
        let both = Given {
            rank: Some(0),
            world: Some(1),
            dist: Some((1, 2)),
        };
        let l = resolve(&both, &env(&[("RANK", "1"), ("WORLD_SIZE", "2")])).unwrap();
        assert_eq!((l.rank, l.world), (0, 1));
        let bad = Given {
            rank: Some(2),
            world: Some(2),
            dist: None,
        };
        assert!(err(&bad, &[]).contains("rank=2 (argument)"));
    }

    #[test]
    fn slurm_s_variables_count_inside_an_srun_step_only() {
        let vars = [
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2(x2)"),
        ];
        let batch_script = resolve(&Given::default(), &env(&vars)).unwrap();
        assert_eq!((batch_script.rank, batch_script.world), (0, 1));
        let mut in_step = vars.to_vec();
        in_step.push(("SLURM_STEP_ID", "0"));
        let l = resolve(&Given::default(), &env(&in_step)).unwrap();
        assert_eq!((l.rank, l.world, l.local_rank, l.local_world), (3, 4, 1, 2));
        let bad = [("SLURM_STEP_ID", "0"), ("SLURM_PROCID", "3"), ("SLURM_NTASKS", "3")];
        assert!(err(&Given::default(), &bad).contains("SLURM_PROCID=3"));
    }
}
