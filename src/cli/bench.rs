//! `ddpjob bench`: the measurements of this machine, printed as a table or JSON.

use std::path::Path;

use super::CliResult;
use crate::bench;
use crate::config;

pub(super) fn bench_allreduce(
    nproc: usize,
    device: &str,
    sizes: &str,
    algorithm: &str,
    json: bool,
) -> CliResult {
    let sizes = bench::parse_sizes(sizes).map_err(bench_failure)?;
    let tree = algorithm == "tree";
    let on_gpus = match tree {
        true => bench::tree_on_cpus(device, nproc).map_err(bench_failure)?,
        false => bench::allreduce_on_gpus(device, nproc).map_err(bench_failure)?,
    };
    let rows = bench::allreduce(nproc, on_gpus, tree, &sizes).map_err(bench_failure)?;
    if json {
        outln!("{}", serde_json::to_string(&rows).unwrap_or_default());
    } else {
        out!("{}", bench::table(nproc, on_gpus, tree, &rows));
    }
    Ok(())
}

/// A benchmark's error with its exit status: 2 for usage, 1 for a failed measurement.
pub(super) fn bench_failure(e: bench::BenchError) -> (u8, anyhow::Error) {
    let code = if matches!(e, bench::BenchError::Usage(_)) {
        2
    } else {
        1
    };
    (code, anyhow::Error::new(e))
}

pub(super) fn bench_step(
    config: &Path,
    set: &[String],
    (steps, warmup, threads, peak): (usize, usize, Option<usize>, bool),
    json: bool,
) -> CliResult {
    let loaded = config::load(config, set).map_err(|e| (2, e.into()))?;
    loaded.print_notes();
    let threads =
        threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let options = bench::StepOptions {
        steps,
        warmup,
        threads,
        peak,
    };
    // One process: a train.global_batch_size is all this worker's.
    let spec = loaded
        .spec
        .for_world_size(1)
        .map_err(|e| (2, anyhow::anyhow!(e)))?;
    let result = bench::step(&spec, options).map_err(bench_failure)?;
    if json {
        outln!("{}", serde_json::to_string(&result).unwrap_or_default());
    } else {
        out!("{}", bench::step_table(&result));
    }
    Ok(())
}
