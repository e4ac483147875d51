//! `ddpjob bench allreduce`: the all-reduce of the backend `run` uses (the tcp ring between CPU
//! workers, NCCL between GPUs), or with `--algorithm tree` the tree-ordered one of
//! world-size-invariant training, timed between real worker processes, reported as nccl-tests
//! does (time, algorithm and bus bandwidth per size). The workers join the collectives through
//! `ddpjob_comm::connect`, by the name the trainer's worker would choose, and time the
//! `Communicator` calls the trainer makes: no backend is built here.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::BenchError;
use crate::launch::supervise::{self, Outcome};
use crate::launch::watch::Watchdog;
use crate::worker::WorkerEnv;
use ddpjob_comm::Communicator;
use ddpjob_store::{self as store, StoreClient, StoreServer};

/// Where rank 0 writes its results for the parent.
const OUT_ENV: &str = "DDPJOB_BENCH_OUT";
/// The algorithm each row was timed with.
const RING: &str = "ring";
const TREE: &str = "tree";
const TIMEOUT: Duration = Duration::from_secs(300);

/// One size's result (averages over the timed iterations; the slowest rank counts).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllReduceRow {
    /// `ring` (the tcp ring, or NCCL's own), or `tree` (recursive halving between partners).
    #[serde(default)]
    pub algorithm: String,
    pub floats: usize,
    pub bytes: usize,
    pub iters: usize,
    pub time_ms: f64,
    /// bytes / time, GB/s.
    pub algbw_gbs: f64,
    /// algbw × 2(world-1)/world, as nccl-tests defines it for all-reduce.
    pub busbw_gbs: f64,
}

/// "1M,10M,100M" → element counts (K = 10³, M = 10⁶, G = 10⁹).
pub fn parse_sizes(text: &str) -> Result<Vec<usize>, BenchError> {
    text.split(',')
        .map(|part| {
            let p = part.trim();
            let (digits, scale) = match p.chars().last() {
                Some('K' | 'k') => (&p[..p.len() - 1], 1e3),
                Some('M' | 'm') => (&p[..p.len() - 1], 1e6),
                Some('G' | 'g') => (&p[..p.len() - 1], 1e9),
                _ => (p, 1.0),
            };
            digits
                .parse::<f64>()
                .ok()
                .map(|v| (v * scale).round())
                // At most what an address space could hold in f32s.
                .filter(|v| v.is_finite() && *v >= 1.0 && *v <= (usize::MAX / 4) as f64)
                .map(|v| v as usize)
                .ok_or_else(|| {
                    BenchError::Usage(format!(
                        "--sizes: cannot read {p:?}; write float counts (at least 1) like \
                         1M,10M,100M or 4096"
                    ))
                })
        })
        .collect()
}

/// Iterations for a size: enough to last a while, bounded both ways.
fn iterations(floats: usize) -> usize {
    (200_000_000 / floats.max(1)).clamp(5, 200)
}

/// Whether `--device` (`auto`, `cpu`, `cuda`) means GPUs for `nproc` workers.
pub fn allreduce_on_gpus(device: &str, nproc: usize) -> Result<bool, BenchError> {
    let gpus = crate::device::visible_gpus();
    match (device, gpus) {
        ("cpu", _) => Ok(false),
        ("auto", Ok(n)) => Ok(n >= nproc),
        ("auto", Err(_)) => Ok(false),
        (_, Ok(n)) if n >= nproc => Ok(true),
        (_, Ok(n)) => Err(BenchError::Usage(format!(
            "--device cuda needs one GPU per worker: {nproc} workers, {n} GPU(s) visible; \
             use --nproc-per-node {n}"
        ))),
        (_, Err(why)) => Err(BenchError::Usage(format!("--device cuda: {why}"))),
    }
}

/// Whether `--algorithm tree` can run as asked: CPU workers (the tcp backend's collective;
/// NCCL's tree sum is an all-gather), a power-of-two count. Always `false` (not on GPUs).
pub fn tree_on_cpus(device: &str, nproc: usize) -> Result<bool, BenchError> {
    if device == "cuda" {
        return Err(BenchError::Usage(
            "--algorithm tree times the tcp backend's tree-ordered all-reduce between CPU \
             workers (on GPUs the tree sum is NCCL's all-gather); use --device cpu"
                .into(),
        ));
    }
    if !nproc.is_power_of_two() {
        return Err(BenchError::Usage(format!(
            "--algorithm tree pairs processes by halves: --nproc-per-node must be a power of \
             two (2, 4, 8, ...), not {nproc}"
        )));
    }
    Ok(false)
}

/// The parent: a store, `nproc` bench workers (one per GPU when `on_gpus`), their results,
/// timing the tree-ordered all-reduce when `tree`.
pub fn allreduce(
    nproc: usize,
    on_gpus: bool,
    tree: bool,
    sizes: &[usize],
) -> Result<Vec<AllReduceRow>, BenchError> {
    if nproc < 2 {
        return Err(BenchError::Usage(
            "--nproc-per-node must be at least 2 for an all-reduce benchmark".into(),
        ));
    }
    // Each CPU worker holds the buffer it reduces: refused here rather than by the allocator
    // in a worker.
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let need = largest as f64 * 4.0 * nproc as f64;
    if !on_gpus
        && let Some(available) = crate::memory::fit::available_host_memory()
        && need > available as f64
    {
        return Err(BenchError::Usage(format!(
            "--sizes: {largest} floats is {} per worker, {} for {nproc} workers, more than the \
             {} this machine has available; use smaller sizes",
            crate::memory::gb(largest as u64 * 4),
            crate::memory::gb(need as u64),
            crate::memory::gb(available)
        )));
    }
    let token = store::random_token();
    let server = StoreServer::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), &token)?;
    let out = std::env::temp_dir().join(format!("ddpjob-bench-{}.json", std::process::id()));
    let exe = std::env::current_exe().map_err(|cause| BenchError::Io {
        what: "cannot find the ddpjob binary".into(),
        cause,
    })?;
    let sizes_arg = sizes
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut workers = Vec::new();
    for rank in 0..nproc {
        let mut cmd = Command::new(&exe);
        let algorithm = if tree { TREE } else { RING };
        cmd.args([
            "bench-worker",
            "--sizes",
            &sizes_arg,
            "--algorithm",
            algorithm,
        ])
        .env(OUT_ENV, &out);
        WorkerEnv {
            rank,
            local_rank: rank,
            world_size: nproc,
            local_world_size: nproc,
            node_rank: 0,
            master_addr: Ipv4Addr::LOCALHOST.to_string(),
            master_port: server.addr().port(),
            job_dir: std::env::temp_dir(),
            restart_count: 0,
            token: token.clone(),
            started_unix_ms: None,
            resume_from: None,
            device: if on_gpus {
                format!("cuda:{rank}")
            } else {
                "cpu".into()
            },
        }
        .apply(&mut cmd);
        let log = PathBuf::from("/dev/null");
        let w = supervise::spawn(cmd, rank, &log, true).map_err(|cause| BenchError::Io {
            what: format!("cannot start bench worker {rank}"),
            cause,
        })?;
        workers.push(w);
    }
    crate::signals::install();
    // Benchmark workers publish no heartbeats and have nothing to checkpoint.
    let mut watch = Watchdog::none();
    // One node: no other node's failure to hear of.
    match supervise::supervise(&mut workers, &mut watch, Duration::ZERO, &|| None) {
        Outcome::Finished => {}
        Outcome::Failed { report, .. } => return Err(BenchError::Worker(report)),
        Outcome::PeerFailed { summary } => return Err(BenchError::Worker(summary)),
        Outcome::Interrupted { .. } => return Err(BenchError::Worker("interrupted".into())),
    }
    let text = std::fs::read(&out).map_err(|cause| BenchError::Io {
        what: format!("rank 0 left no results in {}", out.display()),
        cause,
    })?;
    let _ = std::fs::remove_file(&out);
    serde_json::from_slice(&text).map_err(|e| BenchError::Worker(format!("bad results: {e}")))
}

/// The hidden `bench-worker` subcommand: open the worker's device, join the collectives `run`
/// would join there (built by name, as the trainer's are: the tcp ring between CPU workers, with
/// its tree partners when `tree`; NCCL between GPUs), time each size through the trainer's own
/// calls (`all_reduce_mean`, or `tree_sum`), rank 0 reports.
pub fn worker(sizes: &[usize], tree: bool) -> Result<(), BenchError> {
    let env = WorkerEnv::from_env().map_err(|e| BenchError::Usage(e.to_string()))?;
    let store = StoreClient::connect(&env.master(), &env.token, TIMEOUT)?;
    let device =
        crate::device::open(Some(&env.device)).map_err(|e| BenchError::Usage(e.to_string()))?;
    let rank = env.rank;
    let placement = ddpjob_comm::Placement {
        gpu: device.is_cuda(),
        world_size: env.world_size,
        always: false,
    };
    let options = ddpjob_comm::Options {
        device: &device,
        always: false,
        tree,
        on_nccl_failure: Box::new(move |verdict: &ddpjob_comm::watchdog::Verdict| {
            errln!("error: {}", verdict.describe(rank, TIMEOUT))
        }),
    };
    let name = ddpjob_comm::choose("auto", placement);
    let comm = ddpjob_comm::connect(name, &rendezvous(&env, &store), options)?;
    let tensor = |e: candle_core::Error| BenchError::Comm(e.into());
    let world = env.world_size;
    let mut rows = Vec::new();
    for &floats in sizes {
        let iters = iterations(floats);
        let mut elapsed = Duration::ZERO;
        let mut buf = Tensor::zeros(floats, DType::F32, &device).map_err(tensor)?;
        // One untimed warm-up, then the timed iterations, each from fresh inputs (a new
        // contiguous buffer, as the trainer's buckets are) and timed to the end of the device's
        // queue.
        for i in 0..=iters {
            buf = Tensor::full((rank + 1) as f32, floats, &device).map_err(tensor)?;
            device.synchronize().map_err(tensor)?;
            comm.barrier()?;
            let started = Instant::now();
            match tree {
                true => comm.tree_sum(&mut buf)?,
                false => comm.all_reduce_mean(&mut buf)?,
            }
            device.synchronize().map_err(tensor)?;
            if i > 0 {
                elapsed += started.elapsed();
            }
        }
        // The tree sums; the all-reduce averages (as training does: ncclAvg on GPUs).
        let want = match tree {
            true => (world * (world + 1) / 2) as f32,
            false => (world + 1) as f32 / 2.0,
        };
        check_result(&buf.to_vec1::<f32>().map_err(tensor)?, want)?;
        let algorithm = if tree { TREE } else { RING };
        rows.push(row(
            comm.as_ref(),
            algorithm,
            (rank, world),
            (floats, iters),
            elapsed,
        )?);
    }
    report(&env, &rows)?;
    comm.barrier()?;
    Ok(())
}

/// The benchmark's place in the collectives: the worker's rank, no restarts, [`TIMEOUT`].
fn rendezvous<'a>(env: &'a WorkerEnv, store: &'a StoreClient) -> ddpjob_comm::Rendezvous<'a> {
    ddpjob_comm::Rendezvous {
        store,
        token: &env.token,
        rank: env.rank,
        world_size: env.world_size,
        local_world_size: env.local_world_size,
        attempt: 0,
        timeout: TIMEOUT,
        beacon: Default::default(),
    }
}

/// Every element of an all-reduced buffer is `want`.
fn check_result(values: &[f32], want: f32) -> Result<(), BenchError> {
    match values.iter().position(|&x| x != want) {
        Some(bad) => Err(BenchError::Worker(format!(
            "wrong result at element {bad}: {} instead of {want}",
            values[bad]
        ))),
        None => Ok(()),
    }
}

/// One size's row: the slowest rank's time (agreed with an all-reduce), nccl-tests' bandwidths.
fn row(
    comm: &dyn Communicator,
    algorithm: &str,
    (rank, world): (usize, usize),
    (floats, iters): (usize, usize),
    elapsed: Duration,
) -> Result<AllReduceRow, BenchError> {
    let mut slowest = vec![0f64; world];
    slowest[rank] = elapsed.as_secs_f64();
    comm.all_reduce_sum_f64(&mut slowest)?;
    let secs = slowest.iter().copied().fold(0.0, f64::max) / iters as f64;
    let bytes = floats * 4;
    let algbw = bytes as f64 / secs.max(1e-12) / 1e9;
    Ok(AllReduceRow {
        algorithm: algorithm.into(),
        floats,
        bytes,
        iters,
        time_ms: secs * 1e3,
        algbw_gbs: algbw,
        busbw_gbs: algbw * 2.0 * (world - 1) as f64 / world as f64,
    })
}

/// Rank 0 leaves the rows for the parent.
fn report(env: &WorkerEnv, rows: &[AllReduceRow]) -> Result<(), BenchError> {
    if env.rank != 0 {
        return Ok(());
    }
    let out = std::env::var(OUT_ENV).map_err(|_| BenchError::Usage(format!("{OUT_ENV} unset")))?;
    let text = serde_json::to_vec(rows).unwrap_or_default();
    std::fs::write(&out, text).map_err(|cause| BenchError::Io {
        what: format!("cannot write {out}"),
        cause,
    })
}

/// A table like nccl-tests' for a terminal.
pub fn table(world: usize, on_gpus: bool, tree: bool, rows: &[AllReduceRow]) -> String {
    let backend = match (on_gpus, tree) {
        (true, _) => "(average, f32), NCCL between GPUs",
        (false, true) => "(sum, f32), tcp backend's tree order (recursive halving, partners)",
        (false, false) => "(average, f32), tcp ring backend",
    };
    let mut s = format!(
        "# all-reduce {backend}, {world} worker processes on this node\n\
         {:>12} {:>12} {:>6} {:>10} {:>12} {:>12}\n",
        "floats", "bytes", "iters", "time ms", "algbw GB/s", "busbw GB/s"
    );
    for r in rows {
        s += &format!(
            "{:>12} {:>12} {:>6} {:>10.3} {:>12.3} {:>12.3}\n",
            r.floats, r.bytes, r.iters, r.time_ms, r.algbw_gbs, r.busbw_gbs
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_like_nccl_tests() {
        assert_eq!(
            parse_sizes("1M,10M, 2.5K,7").unwrap(),
            vec![1_000_000, 10_000_000, 2500, 7]
        );
        assert!(parse_sizes("ten").is_err());
        assert!(parse_sizes("99999999999999999999").is_err());
        assert!(parse_sizes("1M,,2").is_err());
        // A size that rounds to no float at all measures nothing.
        assert!(parse_sizes("0").is_err() && parse_sizes("0.4").is_err());
    }
}
