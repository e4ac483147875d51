//! Where a launcher sits among the nodes when a scheduler started it: Slurm's `srun`
//! (`SLURM_*`), or a torchrun-style agent environment as Kubernetes' PyTorchJob sets it
//! (`PET_*`, `MASTER_ADDR`/`MASTER_PORT`, and the pod-level `WORLD_SIZE`/`RANK`).
//!
//! Precedence, per value: an explicit flag; torchrun's own variables for its flags (`PET_*`);
//! Slurm's allocation; the plain `MASTER_ADDR`/`MASTER_PORT` (which also override what is
//! derived from Slurm, as a script that exports them means them); the pod-level
//! `WORLD_SIZE`/`RANK` (nodes, not processes) only outside Slurm and with `MASTER_ADDR` set;
//! else the single-node defaults.

use std::collections::BTreeMap;

use super::NodeOptions;

/// The scheduler variables of this process (a snapshot, so tests can pass their own).
#[derive(Debug, Clone, Default)]
pub struct SchedulerEnv(BTreeMap<String, String>);

impl SchedulerEnv {
    pub fn from_process() -> Self {
        let wanted = |k: &str| {
            k.starts_with("SLURM_")
                || k.starts_with("PET_")
                || ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"].contains(&k)
        };
        SchedulerEnv(std::env::vars().filter(|(k, _)| wanted(k)).collect())
    }

    #[cfg(test)]
    pub fn from_pairs(pairs: &[(&str, &str)]) -> Self {
        SchedulerEnv(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    /// The first of `names` that is set and not empty, with its name.
    fn first(&self, names: &[&'static str]) -> Option<(&'static str, &str)> {
        names.iter().find_map(|&n| {
            self.0
                .get(n)
                .map(|v| v.trim())
                .filter(|v| !v.is_empty())
                .map(|v| (n, v))
        })
    }

    fn number(&self, names: &[&'static str]) -> Result<Option<(&'static str, usize)>, String> {
        match self.first(names) {
            None => Ok(None),
            Some((name, v)) => v
                .parse()
                .map(|n| Some((name, n)))
                .map_err(|_| format!("{name}={v:?} is not a number")),
        }
    }

    /// How many times Slurm has requeued this job (`SLURM_RESTART_COUNT`), when it has.
    pub fn slurm_requeued(&self) -> Option<usize> {
        self.number(&["SLURM_RESTART_COUNT"])
            .ok()
            .flatten()
            .map(|(_, n)| n)
            .filter(|&n| n > 0)
    }

    fn under_slurm(&self) -> bool {
        self.first(&["SLURM_JOB_ID", "SLURM_JOBID"]).is_some()
    }
}

/// The node flags as given on the command line (`None`: not given).
#[derive(Debug, Clone, Default)]
pub struct NodeFlags {
    pub nnodes: Option<usize>,
    pub node_rank: Option<usize>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
}

/// The node options to use, and a line for each value that came from the environment or
/// that a flag overrode.
#[derive(Debug, Clone)]
pub struct Resolution {
    pub node: NodeOptions,
    pub notes: Vec<String>,
}

/// One value: the flag's when given (noting a different scheduler value), else the first
/// scheduler value found, else `None`.
fn pick<T: PartialEq + std::fmt::Display + Clone>(
    flag: Option<T>,
    flag_name: &str,
    found: Option<(String, T)>,
    notes: &mut Vec<String>,
) -> Option<T> {
    match (flag, found) {
        (Some(f), Some((source, v))) => {
            if f != v {
                notes.push(format!(
                    "{flag_name} {f} given; {source} says {v}: using {f}"
                ));
            }
            Some(f)
        }
        (Some(f), None) => Some(f),
        (None, Some((source, v))) => {
            notes.push(format!("{flag_name} {v} from {source}"));
            Some(v)
        }
        (None, None) => None,
    }
}

/// Resolves this launcher's node options from `flags` and the scheduler's `env`.
pub fn resolve(flags: &NodeFlags, env: &SchedulerEnv) -> Result<Resolution, String> {
    let mut notes = Vec::new();
    let slurm = slurm(env)?;
    let pod_level = !env.under_slurm() && env.first(&["MASTER_ADDR"]).is_some();
    let pet_nnodes = pet_nnodes(env)?;
    let (world, rank) = match pod_level {
        true => (env.number(&["WORLD_SIZE"])?, env.number(&["RANK"])?),
        false => (None, None),
    };
    let described = |found: Option<(&'static str, usize)>| found.map(|(n, v)| (n.to_string(), v));

    let nnodes_found = described(pet_nnodes)
        .or(slurm
            .as_ref()
            .map(|s| (s.nnodes_source.to_string(), s.nnodes)))
        .or(described(world).map(|(n, v)| (format!("{n} (pods)"), v)));
    let nnodes = pick(flags.nnodes, "--nnodes", nnodes_found, &mut notes).unwrap_or(1);

    let rank_found = described(env.number(&["PET_NODE_RANK"])?)
        .or(slurm
            .as_ref()
            .map(|s| ("SLURM_NODEID".to_string(), s.node_rank)))
        .or(described(rank).map(|(n, v)| (format!("{n} (pod index)"), v)));
    let node_rank = pick(flags.node_rank, "--node-rank", rank_found, &mut notes).unwrap_or(0);
    if node_rank >= nnodes {
        return Err(format!(
            "node rank {node_rank} is outside {nnodes} node(s); node ranks are 0..{}{}",
            nnodes.saturating_sub(1),
            if notes.is_empty() {
                String::new()
            } else {
                format!(" ({})", notes.join("; "))
            }
        ));
    }

    let addr_found = env
        .first(&["PET_MASTER_ADDR", "MASTER_ADDR"])
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .or(slurm.as_ref().map(|s| {
            (
                format!("the first node of {}", s.nodes_source),
                s.first_node.clone(),
            )
        }));
    let master_addr = pick(
        flags.master_addr.clone(),
        "--master-addr",
        addr_found,
        &mut notes,
    );

    let port_found = match env.number(&["PET_MASTER_PORT", "MASTER_PORT"])? {
        Some((n, p)) => Some((n.to_string(), port(n, p)?)),
        // A one-node step's store listens on loopback on a free port, as torchrun's
        // --standalone: steps of one allocation run side by side (a sweep of `srun -N1 ... &`).
        None => slurm.as_ref().filter(|s| s.nnodes > 1).map(|s| {
            (
                format!("{} (15000 + job id mod 20000)", s.job_id_source),
                s.port,
            )
        }),
    };
    let master_port = pick(flags.master_port, "--master-port", port_found, &mut notes);

    Ok(Resolution {
        node: NodeOptions {
            nnodes,
            node_rank,
            master_addr,
            master_port,
        },
        notes,
    })
}

/// `PET_NNODES`: a count, or torchrun's `min:max`, which must be fixed (min = max).
fn pet_nnodes(env: &SchedulerEnv) -> Result<Option<(&'static str, usize)>, String> {
    let Some((name, v)) = env.first(&["PET_NNODES"]) else {
        return Ok(None);
    };
    let (min, max) = v.split_once(':').unwrap_or((v, v));
    if min != max {
        return Err(format!(
            "{name}={v:?} asks for an elastic node count; ddpjob runs a fixed number of nodes: \
             set the PyTorchJob's minReplicas and maxReplicas equal"
        ));
    }
    let n = max
        .parse()
        .map_err(|_| format!("{name}={v:?} is not a number"))?;
    Ok(Some((name, n)))
}

fn port(name: &str, p: usize) -> Result<u16, String> {
    u16::try_from(p)
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| format!("{name}={p} is not a TCP port (1..65535)"))
}

/// Under Slurm, whether `nproc_per_node` GPU workers (a number in the job file or flags; `None`
/// is "auto": one per GPU) fit the GPUs Slurm gave this node (`SLURM_GPUS_ON_NODE`), for a job
/// that trains on GPUs. A difference is refused: fewer workers would leave GPUs idle, more
/// would not start.
pub fn check_gpus(
    env: &SchedulerEnv,
    nproc_per_node: Option<usize>,
    on_gpus: bool,
) -> Result<(), String> {
    let (Some(n), true) = (nproc_per_node, on_gpus) else {
        return Ok(());
    };
    match env.number(&["SLURM_GPUS_ON_NODE"])? {
        Some((name, gpus)) if gpus != n => Err(format!(
            "Slurm gave this node {gpus} GPU(s) ({name}), but the job asks for {n} worker(s) \
             per node (distributed.nproc_per_node / --nproc-per-node): request \
             `--gpus-per-node={n}`, or set nproc_per_node = \"auto\" (one worker per GPU)"
        )),
        _ => Ok(()),
    }
}

/// Under Slurm, asks it to requeue this job (`scontrol requeue`), as PyTorch Lightning's SLURM
/// plugin does on the time-limit warning (SIGUSR1): the next allocation runs the same script,
/// and `run` continues the job (`--resume auto` is the default in a requeued job). Returns
/// what happened, for the log; `None` outside Slurm.
pub fn requeue(env: &SchedulerEnv) -> Option<String> {
    let (_, id) = env.first(&["SLURM_JOB_ID", "SLURM_JOBID"])?;
    let out = std::process::Command::new("scontrol")
        .args(["requeue", id])
        .output();
    Some(match out {
        Ok(o) if o.status.success() => format!(
            "Slurm job {id} requeued: its next allocation continues the job (run --resume auto)"
        ),
        Ok(o) => format!(
            "Slurm job {id} could not be requeued ({}); submit it with `sbatch --requeue`, or \
             continue it with `ddpjob resume`",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => {
            format!("`scontrol requeue {id}` could not run ({e}); continue with `ddpjob resume`")
        }
    })
}

/// What a Slurm step says about this node.
#[derive(Debug, Clone)]
struct SlurmStep {
    nnodes: usize,
    nnodes_source: &'static str,
    node_rank: usize,
    first_node: String,
    nodes_source: &'static str,
    port: u16,
    job_id_source: &'static str,
}

/// The Slurm step this process is a task of; `None` outside Slurm, or in a one-node batch
/// script (which needs no rendezvous).
fn slurm(env: &SchedulerEnv) -> Result<Option<SlurmStep>, String> {
    let Some((job_id_source, job_id)) = env.first(&["SLURM_JOB_ID", "SLURM_JOBID"]) else {
        return Ok(None);
    };
    let job_id: u64 = job_id
        .parse()
        .map_err(|_| format!("{job_id_source}={job_id:?} is not a job id"))?;
    let job_nodes = env.number(&["SLURM_JOB_NUM_NODES", "SLURM_NNODES"])?;
    let in_step = env.first(&["SLURM_STEP_ID", "SLURM_STEPID"]).is_some();
    if !in_step {
        return match job_nodes {
            Some((_, n)) if n > 1 => Err(format!(
                "this Slurm job has {n} nodes, but ddpjob was not started by srun, so it runs \
                 on the first node only: start it with `srun --ntasks-per-node=1 ddpjob run ...`"
            )),
            _ => Ok(None),
        };
    }
    let (nnodes_source, nnodes) = env
        .number(&[
            "SLURM_STEP_NUM_NODES",
            "SLURM_JOB_NUM_NODES",
            "SLURM_NNODES",
        ])?
        .ok_or("srun set no SLURM_STEP_NUM_NODES, SLURM_JOB_NUM_NODES or SLURM_NNODES")?;
    if let Some((tasks_source, tasks)) = env.number(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"])?
        && tasks > nnodes
    {
        return Err(format!(
            "srun started {tasks} tasks on {nnodes} node(s) ({tasks_source}): every task \
                 would launch a whole node's workers. ddpjob starts one worker per GPU itself: \
                 run one task per node (`srun --ntasks-per-node=1`, or `#SBATCH \
                 --ntasks-per-node=1`)"
        ));
    }
    let (_, node_rank) = env
        .number(&["SLURM_NODEID"])?
        .ok_or("srun set no SLURM_NODEID")?;
    let (nodes_source, list) = env
        .first(&[
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
        ])
        .ok_or("srun set no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST")?;
    let nodes = expand_hostlist(list).map_err(|e| format!("{nodes_source}={list:?}: {e}"))?;
    if nodes.len() != nnodes {
        return Err(format!(
            "{nodes_source}={list:?} names {} node(s), but {nnodes_source} says {nnodes}",
            nodes.len()
        ));
    }
    Ok(Some(SlurmStep {
        nnodes,
        nnodes_source,
        node_rank,
        first_node: nodes[0].clone(),
        nodes_source,
        port: 15000 + (job_id % 20000) as u16,
        job_id_source,
    }))
}

/// Expands Slurm's hostlist syntax (`gpu[01-03,07],login1`) into host names, in order, as
/// `scontrol show hostnames` does: ranges keep the zero padding of their first bound, and
/// several bracket groups in one name multiply out (`r[1-2]n[1-2]`: r1n1 r1n2 r2n1 r2n2).
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        if item.is_empty() {
            return Err("an empty host name".into());
        }
        hosts.extend(expand_one(&item)?);
    }
    if hosts.is_empty() {
        return Err("no host names".into());
    }
    Ok(hosts)
}

/// Splits at the commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<String>, String> {
    let (mut items, mut current, mut depth) = (Vec::new(), String::new(), 0);
    for ch in list.trim().chars() {
        match ch {
            '[' if depth == 0 => depth = 1,
            '[' => return Err("nested brackets".into()),
            ']' if depth == 1 => depth = 0,
            ']' => return Err("a ']' without its '['".into()),
            ',' if depth == 0 => {
                items.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(ch);
    }
    if depth != 0 {
        return Err("a '[' without its ']'".into());
    }
    items.push(current);
    Ok(items)
}

/// One host pattern: a prefix, then an optional bracket group and the rest (expanded too).
fn expand_one(pattern: &str) -> Result<Vec<String>, String> {
    let Some(open) = pattern.find('[') else {
        return Ok(vec![pattern.to_string()]);
    };
    let close = open + pattern[open..].find(']').ok_or("a '[' without its ']'")?;
    let (prefix, group, rest) = (
        &pattern[..open],
        &pattern[open + 1..close],
        &pattern[close + 1..],
    );
    let tails = expand_one(rest)?;
    let mut out = Vec::new();
    for part in group.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let bad = || format!("[{group}]: {part:?} is not a number or a range a-b");
        if lo.is_empty()
            || !lo.bytes().all(|b| b.is_ascii_digit())
            || !hi.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(bad());
        }
        let (a, b): (u64, u64) = (
            lo.parse().map_err(|_| bad())?,
            hi.parse().map_err(|_| bad())?,
        );
        if b < a {
            return Err(format!("[{group}]: the range {part} runs backwards"));
        }
        if b - a > 100_000 {
            return Err(format!("[{group}]: the range {part} is too large"));
        }
        for n in a..=b {
            for tail in &tails {
                out.push(format!("{prefix}{n:0width$}{tail}", width = lo.len()));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
#[path = "cluster_tests.rs"]
mod tests;
