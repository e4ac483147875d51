//! Whether a job fits its GPUs, or its CPU workers their machine: the estimate beside the
//! free memory before launch, and the settings that would make a job fit (also what
//! `validate` advises).

use crate::config::{JobSpec, Sharding};
use crate::models::Model;
pub use ddpjob_data::host::available_host_memory;

use super::{Estimate, Layout, estimate, gb};

/// What each setting the job does not use yet would make of its estimate, where it saves:
/// more sharding over the job's workers (`"gradients"` only where the model hands its
/// gradients over block by block, `"full"` where it gathers its blocks one at a time), then
/// activation checkpointing.
pub fn alternatives(spec: &JobSpec, model: &dyn Model, layout: Layout) -> Vec<(String, Estimate)> {
    let mine = estimate(spec, model, layout);
    // Asked before any other mode is: a model asked for its blocks goes block by block from
    // then on, whose activations it may not know.
    let mut checkpointing = None;
    if !layout.checkpointing && model.checkpoint_activations().is_ok() {
        let other = estimate(
            spec,
            model,
            Layout {
                checkpointing: true,
                ..layout
            },
        );
        // Worth saying only where it saves (a few thin blocks keep more than they save).
        if other.total() < mine.total() {
            checkpointing = Some(("train.activation_checkpointing".into(), other));
        }
    }
    let modes = [
        (Sharding::None, "none"),
        (Sharding::Optimizer, "optimizer"),
        (Sharding::Gradients, "gradients"),
        (Sharding::Full, "full"),
    ];
    let current = modes
        .iter()
        .position(|(m, _)| *m == layout.sharding)
        .unwrap_or(0);
    // Sharding leaves the activations as they are.
    let sharded_parts = |e: &Estimate| e.weights + e.gradients + e.optimizer + e.runtime;
    let mut best = sharded_parts(&mine);
    let mut out = Vec::new();
    let world = layout.world;
    // World-size-invariant training sums in its fixed tree, which no sharding keeps.
    let shards = world > 1 && !spec.distributed.world_size_invariant;
    for &(sharding, name) in modes.iter().skip(current + 1).filter(|_| shards) {
        let other = estimate(spec, model, Layout { sharding, ..layout });
        if sharded_parts(&other) < best {
            best = sharded_parts(&other);
            let setting = format!("distributed.sharding = \"{name}\" over {world} workers");
            out.push((setting, other));
        }
    }
    out.extend(checkpointing);
    out
}

/// The advice when no one setting of [`alternatives`] makes `spec`'s workers fit.
fn last_resort(spec: &JobSpec) -> &'static str {
    match spec.distributed.world_size_invariant {
        true => {
            "no single setting makes it fit: use more workers, or more \
                 distributed.virtual_shards (smaller pieces of the batch, computed one at a \
                 time)"
        }
        false => {
            "no single setting makes it fit: lower train.batch_size (with \
                  train.accumulation to keep the step's batch), or use more workers with \
                  distributed.sharding"
        }
    }
}

/// What must fit: the whole estimate, or its known parts when the model does not say what
/// its activations take.
fn needed(e: &Estimate) -> u64 {
    e.total()
        .unwrap_or(e.weights + e.gradients + e.optimizer + e.reference + e.runtime)
}

/// `Err` (the message) when a worker's estimate `mine` is more than `free` bytes, the free
/// memory of GPU `gpu`, naming the `alternatives` that would fit.
pub fn verdict(
    mine: &Estimate,
    alternatives: &[(String, Estimate)],
    otherwise: &str,
    gpu: usize,
    free: u64,
) -> Result<(), String> {
    let place = format!("GPU {gpu} has {} free", gb(free));
    verdict_for(mine, alternatives, otherwise, free, &place)
}

/// [`verdict`] for a worker that may use `free` bytes, which `place` describes ("GPU 0 has
/// 3.00 GB free").
fn verdict_for(
    mine: &Estimate,
    alternatives: &[(String, Estimate)],
    otherwise: &str,
    free: u64,
    place: &str,
) -> Result<(), String> {
    if needed(mine) <= free {
        return Ok(());
    }
    let activations = match mine.activations {
        Some(a) => format!(", activations {}", gb(a)),
        None => ", activations not counted".into(),
    };
    let fitting: Vec<String> = alternatives
        .iter()
        .filter(|(_, e)| needed(e) <= free)
        .map(|(setting, e)| format!("{setting} ({})", gb(needed(e))))
        .collect();
    let advice = match fitting.is_empty() {
        // A worker's runtime alone (its process, its libraries) is over its share: too many
        // workers for the memory, which neither batch nor sharding changes.
        true if mine.runtime > free => "even an idle worker's runtime does not fit in its \
                                        share: use fewer workers (--nproc-per-node)"
            .to_string(),
        true => otherwise.to_string(),
        false => format!("it would fit with {}", fitting.join(", or ")),
    };
    Err(format!(
        "each worker needs about {} (weights {}, gradients {}, optimizer {}, runtime \
         {}{activations}), but {place}; {}; {advice}",
        gb(needed(mine)),
        gb(mine.weights),
        gb(mine.gradients),
        gb(mine.optimizer),
        gb(mine.runtime),
        largest(mine),
    ))
}

/// The estimate's largest part and the settings that shrink it.
fn largest(e: &Estimate) -> String {
    let positions = match e.positions {
        Some(t) => format!("batch {} x {t} positions", e.batch),
        None => format!("batch {}", e.batch),
    };
    let parts = [
        (
            e.activations.unwrap_or(0),
            format!("activations ({positions})"),
            "train.activation_checkpointing, a smaller train.batch_size or, for a language \
             model, a shorter model.block_size shrink them",
        ),
        (
            e.weights,
            "weights".to_string(),
            "distributed.sharding = \"full\" divides them over the workers; with [model.lora], \
             [model.quantize] keeps the base in 4 bits",
        ),
        (
            e.optimizer,
            "optimizer state".to_string(),
            "distributed.sharding = \"optimizer\" divides it over the workers; [model.lora] \
             trains (and keeps state for) adapters only",
        ),
        (
            e.gradients,
            "gradients".to_string(),
            "distributed.sharding = \"gradients\" divides them over the workers",
        ),
        (
            e.reference,
            "the DPO reference".to_string(),
            "train.dpo.precompute_reference = true leaves it out",
        ),
    ];
    let (bytes, what, fix) = parts
        .iter()
        .max_by_key(|(bytes, ..)| *bytes)
        .expect("parts");
    format!("the largest part is {what} at {}: {fix}", gb(*bytes))
}

/// Before a job of `workers` CPU workers on this machine starts: `Err` (exit 2) when their
/// estimates together are more than `available` bytes of host memory. Only what is known is
/// counted (the activations where the model says), so a job is refused only when it cannot
/// fit, never on a guess.
pub fn check_host(
    spec: &JobSpec,
    model: &dyn Model,
    layout: Layout,
    workers: usize,
    available: u64,
) -> Result<(), String> {
    let mine = estimate(spec, model, layout);
    let share = available / workers.max(1) as u64;
    let alternatives: Vec<(String, Estimate)> = alternatives(spec, model, layout)
        .into_iter()
        .filter(|(_, e)| needed(e) < needed(&mine))
        .collect();
    let place = match workers {
        1 => format!("this machine has {} available", gb(available)),
        n => format!(
            "this machine has {} available, {} for each of its {n} workers (fewer with \
             --nproc-per-node)",
            gb(available),
            gb(share)
        ),
    };
    verdict_for(&mine, &alternatives, last_resort(spec), share, &place)
}

/// Free memory of each of `ordinals` (among the visible GPUs), in bytes, from the driver.
#[cfg(feature = "cuda")]
pub fn free_gpu_memory(ordinals: &[usize]) -> Result<Vec<u64>, String> {
    ordinals
        .iter()
        .map(|&ordinal| {
            let context = cudarc::driver::CudaContext::new(ordinal)
                .map_err(|e| format!("GPU {ordinal}: {e:?}"))?;
            let (free, _) = context
                .mem_get_info()
                .map_err(|e| format!("GPU {ordinal}: {e:?}"))?;
            Ok(free as u64)
        })
        .collect()
}

/// Free memory of GPUs: none to ask in a build without GPU support.
#[cfg(not(feature = "cuda"))]
pub fn free_gpu_memory(_: &[usize]) -> Result<Vec<u64>, String> {
    Err("this build has no GPU support".into())
}

/// For each of `gpus` whose free memory the driver reports: that memory, and whether a
/// worker's estimate fits it (`Err`: the message). Activations are left out: the model was
/// built on the CPU to count its parameters, and what autograd keeps on a GPU is not what the
/// CPU's passes keep.
pub fn gpu_verdicts(
    spec: &JobSpec,
    model: &dyn Model,
    layout: Layout,
    gpus: &[usize],
) -> Vec<(usize, u64, Result<(), String>)> {
    let Ok(free) = free_gpu_memory(gpus) else {
        return Vec::new();
    };
    let unknown = |e: Estimate| Estimate {
        activations: None,
        ..e
    };
    let mine = unknown(estimate(spec, model, layout));
    let alternatives: Vec<(String, Estimate)> = alternatives(spec, model, layout)
        .into_iter()
        .map(|(setting, e)| (setting, unknown(e)))
        .filter(|(_, e)| needed(e) < needed(&mine))
        .collect();
    gpus.iter()
        .zip(free)
        .map(|(&gpu, free)| {
            let verdict = verdict(&mine, &alternatives, last_resort(spec), gpu, free);
            (gpu, free, verdict)
        })
        .collect()
}

/// Before a job on `gpus` starts: `Err` (exit 2) when a worker's estimate is more than the
/// free memory of a GPU it would use. A GPU whose memory cannot be read is not checked.
pub fn check_gpus(
    spec: &JobSpec,
    model: &dyn Model,
    layout: Layout,
    gpus: &[usize],
) -> Result<(), String> {
    gpu_verdicts(spec, model, layout, gpus)
        .into_iter()
        .try_for_each(|(_, _, verdict)| verdict)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OTHERWISE: &str = "no single setting makes it fit: lower train.batch_size";

    fn estimate(weights: u64, activations: Option<u64>) -> Estimate {
        Estimate {
            weights,
            gradients: weights,
            optimizer: 2 * weights,
            reference: 0,
            activations,
            runtime: 0,
            batch: 12,
            positions: Some(1024),
            activations_or_gradients: false,
        }
    }

    #[test]
    fn a_worker_that_does_not_fit_is_told_which_setting_would_make_it() {
        let mine = estimate(1_000_000_000, Some(30_000_000_000));
        assert!(verdict(&mine, &[], OTHERWISE, 0, 40_000_000_000).is_ok());
        let options = [
            (
                "sharding".to_string(),
                estimate(1_000_000_000, Some(2e10 as u64)),
            ),
            (
                "checkpointing".to_string(),
                estimate(1_000_000_000, Some(2e9 as u64)),
            ),
        ];
        let why = verdict(&mine, &options, OTHERWISE, 3, 10_000_000_000).unwrap_err();
        assert!(why.contains("34.00 GB"), "{why}");
        assert!(why.contains("GPU 3 has 10.00 GB free"), "{why}");
        assert!(
            why.contains("it would fit with checkpointing (6.00 GB)"),
            "{why}"
        );
        assert!(!why.contains("sharding ("), "{why}");
        assert!(
            why.contains(
                "the largest part is activations (batch 12 x 1024 positions) at 30.00 GB: \
                 train.activation_checkpointing, a smaller train.batch_size or, for a language \
                 model, a shorter model.block_size shrink them"
            ),
            "{why}"
        );
        let why = verdict(&mine, &options, OTHERWISE, 0, 1_000_000_000).unwrap_err();
        assert!(why.contains("no single setting makes it fit"), "{why}");
        // Workers so many that the runtime alone is over a worker's share: fewer of them.
        let idle = Estimate {
            runtime: 40_000_000,
            ..estimate(1_000, Some(1_000))
        };
        let why = verdict(&idle, &[], OTHERWISE, 0, 245_000).unwrap_err();
        assert!(
            why.contains("use fewer workers (--nproc-per-node)"),
            "{why}"
        );
    }

    #[test]
    fn unknown_activations_leave_the_known_parts_to_fit() {
        let mine = estimate(1_000_000_000, None);
        assert!(verdict(&mine, &[], OTHERWISE, 0, 4_000_000_000).is_ok());
        let why = verdict(&mine, &[], OTHERWISE, 0, 3_000_000_000).unwrap_err();
        assert!(why.contains("activations not counted"), "{why}");
        assert!(why.contains("but GPU 0 has 3.00 GB free"), "{why}");
        assert!(
            why.contains("the largest part is optimizer state at 2.00 GB"),
            "{why}"
        );
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_build_without_gpus_checks_nothing() {
        assert!(free_gpu_memory(&[0]).is_err());
    }
}
