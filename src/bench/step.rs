//! `ddpjob bench step`: samples/s of the configured model's training step (forward, backward,
//! optimizer; accumulation and clipping as configured) on this machine, in this process, with
//! batches prepared beforehand so that data loading is not counted. It calls the very step
//! function training uses, on the device one worker of `run` would get (the first GPU in a
//! `--features cuda` build that sees one, else the CPU), and compares it with that device's
//! measured matrix-product rate.

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::BenchError;
use crate::config::{JobSpec, Precision};
use crate::models::{self, Mode};
use crate::optim::Optimizer;
use crate::task::ModelInput;
use crate::train::step::{MicroBatch, Phases, StepContext, optimizer_step};
use ddpjob_comm::LocalCommunicator;
use ddpjob_rng::Mt19937;

/// How long to measure.
#[derive(Debug, Clone, Copy)]
pub struct StepOptions {
    pub steps: usize,
    pub warmup: usize,
    /// Threads for the step's kernels (rayon's pool), as one worker of `run` would get.
    pub threads: usize,
    /// Whether to measure the matrix-product peak after the steps.
    pub peak: bool,
}

/// The result, per optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepBench {
    pub model: String,
    pub parameters: usize,
    pub batch_size: usize,
    pub accumulation: usize,
    pub optimizer: String,
    pub threads: usize,
    /// Whether subnormal floats were flushed to zero (`train.flush_denormals`).
    pub flush_denormals: bool,
    /// Whether the CPU's matrix products took bf16 inputs (`train.precision = "bf16-matmul"`
    /// on a CPU with AVX512_BF16); the peak below is then theirs.
    #[serde(default)]
    pub bf16_products: bool,
    pub device: String,
    pub steps: usize,
    pub warmup: usize,
    pub step_ms_median: f64,
    pub step_ms_mean: f64,
    /// The host's time to queue a step's work (the median): on a GPU, when it is near
    /// `step_ms_median` the step waits on the host (its calls and launches), not the device; on
    /// the CPU, which works as it is called, the step itself.
    #[serde(default)]
    pub queue_ms_median: f64,
    /// Samples per second over all timed steps.
    pub samples_per_s: f64,
    pub forward_ms: f64,
    pub backward_ms: f64,
    pub update_ms: f64,
    /// Whose clock gave the three phases: "device" (CUDA events: the device's time from one
    /// phase's end to the next, idle waits for the host's launches included; no wait between
    /// phases), "host", or "none" (a world-size-invariant step's phases are not timed).
    #[serde(default)]
    pub phase_clock: String,
    /// Training operations per sample (matrix products and convolutions, see
    /// `Model::train_flops_per_sample`), when the model knows them.
    pub train_flops_per_sample: Option<f64>,
    /// GFLOP/s the steps reached: `train_flops_per_sample` × `samples_per_s`.
    pub achieved_gflops: Option<f64>,
    /// This machine's matrix-product rate with the same threads and precision, measured after
    /// the steps (`None` with `--no-peak`).
    pub gemm_peak_gflops: Option<f64>,
    /// `achieved_gflops` / `gemm_peak_gflops`: how close the step is to the arithmetic limit.
    pub fraction_of_peak: Option<f64>,
}

/// Times `options.steps` steps of `spec`'s model after `options.warmup` untimed ones.
pub fn step(spec: &JobSpec, options: StepOptions) -> Result<StepBench, BenchError> {
    if options.steps == 0 {
        return Err(BenchError::Usage("--steps must be at least 1".into()));
    }
    // As a worker does, before any thread starts (threads inherit the mode; glibc fixes its
    // arenas at the first thread's allocation).
    ddpjob_kernels::keep_freed_memory(crate::memory::one_allocator_arena(spec));
    crate::numerics::set_for_this_thread(spec.train.flush_denormals);
    use_threads(options.threads)?;
    let crate::device::OneProcess {
        device,
        name: device_name,
        notice,
    } = crate::device::for_one_process(&spec.distributed)
        .map_err(|e| BenchError::Usage(e.to_string()))?;
    if let Some(notice) = notice {
        errln!("note: {notice}");
    }
    crate::device::set_matmul_precision(&device, spec.train.precision);
    let input = match crate::registry::Registry::current().data_input(&spec.data) {
        Some(input) => input,
        // A language model's vocabulary comes from its data: read (or map) it.
        None => crate::task::load(spec, None)
            .map_err(crate::train::TrainError::from)?
            .input(),
    };
    let model = models::build(
        &spec.model,
        input,
        spec.seed,
        &device,
        spec.train.precision,
        false,
    )
    .map_err(crate::train::TrainError::from)?;
    let pairs = spec.train.objective == crate::config::Objective::Dpo;
    let model = match pairs {
        false => model,
        true => {
            // A bench keeps no job to hold a precomputed reference in: the live one.
            let mut live = spec.clone();
            live.train.dpo.precompute_reference = false;
            let task = crate::task::load(spec, None).map_err(crate::train::TrainError::from)?;
            let comm = LocalCommunicator;
            let wrapping = crate::objective::Wrapping {
                job: None,
                keep: false,
                restoring: false,
            };
            crate::objective::around(model, &live, task.as_ref(), &device, wrapping, &comm)
                .map_err(crate::train::TrainError::from)?
                .0
        }
    };
    if spec.train.activation_checkpointing {
        model.checkpoint_activations().map_err(|why| {
            crate::train::TrainError::from(candle_core::Error::Msg(format!(
                "train.activation_checkpointing: {why}"
            )))
        })?;
    }
    let mut optimizer = Optimizer::new(spec.train.optimizer, model.params().len());
    let t = &spec.train;
    let mut rng = Mt19937::new(spec.seed);
    let batches = (0..t.accumulation)
        .map(|_| random_batch(&mut rng, t.batch_size, input, &device, pairs))
        .collect::<Result<Vec<_>, _>>()
        .map_err(crate::train::TrainError::from)?;
    let comm = LocalCommunicator;
    let cx = StepContext {
        model: model.as_ref(),
        comm: &comm,
        device: &device,
        grad_clip_norm: t.grad_clip_norm,
        bucket_bytes: spec.distributed.bucket_bytes,
        shards: crate::train::shards::ShardPool::for_device(&device)
            .filter(|_| model.rows_independent()),
        masked_targets: false,
        virtual_shards: spec.virtual_shards(),
        scrambled_pieces: false,
        stream_gradients: false,
        sharded_parameters: None,
        overlap_comm: false,
    };
    let run = |optimizer: &mut Optimizer, phases: Option<&mut Phases>| {
        optimizer_step(&cx, optimizer, &batches, t.lr, false, phases)
            .map_err(crate::train::TrainError::from)
    };
    for _ in 0..options.warmup {
        run(&mut optimizer, None)?;
    }
    let sync = || {
        device
            .synchronize()
            .map_err(|e| BenchError::Train(crate::train::TrainError::from(e)))
    };
    sync()?;
    let mut times = Vec::with_capacity(options.steps);
    let mut queued = Vec::with_capacity(options.steps);
    for _ in 0..options.steps {
        let started = Instant::now();
        run(&mut optimizer, None)?;
        queued.push(started.elapsed());
        // A GPU queues the step: it has taken its time once the queue is done.
        sync()?;
        times.push(started.elapsed());
    }
    // The phase split is a separate, shorter pass: timing phases costs a little itself.
    let mut phases = Phases::default();
    let phase_steps = options.steps.div_ceil(4);
    for _ in 0..phase_steps {
        run(&mut optimizer, Some(&mut phases))?;
    }
    let total: Duration = times.iter().sum();
    let median_ms = |mut times: Vec<Duration>| {
        times.sort();
        times[times.len() / 2].as_secs_f64() * 1e3
    };
    let queue_ms_median = median_ms(queued);
    let samples = t.batch_size * t.accumulation;
    let samples_per_s = (samples * options.steps) as f64 / total.as_secs_f64().max(1e-12);
    let flops = model.train_flops_per_sample();
    let achieved_gflops = flops.map(|f| f * samples_per_s / 1e9);
    let gemm_peak_gflops = match (&device, options.peak) {
        (_, false) => None,
        (Device::Cpu, true) => Some(ddpjob_kernels::gemm_rate(PEAK_SIZE, PEAK_REPS) / 1e9),
        (gpu, true) => Some(device_gemm_rate(gpu, spec.train.precision)? / 1e9),
    };
    let per_step = |d: Duration| d.as_secs_f64() * 1e3 / phase_steps as f64;
    Ok(StepBench {
        model: spec.model.describe(),
        parameters: model.params().element_count(),
        batch_size: t.batch_size,
        accumulation: t.accumulation,
        optimizer: t.optimizer.name().to_string(),
        threads: options.threads,
        bf16_products: device.is_cpu() && ddpjob_kernels::bf16_products(),
        flush_denormals: device.is_cpu()
            && spec.train.flush_denormals
            && crate::numerics::flushing(),
        device: device_name,
        steps: options.steps,
        warmup: options.warmup,
        step_ms_median: median_ms(times),
        step_ms_mean: total.as_secs_f64() * 1e3 / options.steps as f64,
        queue_ms_median,
        samples_per_s,
        forward_ms: per_step(phases.forward),
        backward_ms: per_step(phases.backward),
        update_ms: per_step(phases.sync + phases.update),
        phase_clock: match (phases.timed, phases.device_clock) {
            (false, _) => "none",
            (true, true) => "device",
            (true, false) => "host",
        }
        .to_string(),
        train_flops_per_sample: flops,
        achieved_gflops,
        gemm_peak_gflops,
        fraction_of_peak: achieved_gflops.zip(gemm_peak_gflops).map(|(a, p)| a / p),
    })
}

/// The peak's product: large enough for the gemm crate's full speed, short enough (about 2
/// GFLOP) to take a few tenths of a second in all.
const PEAK_SIZE: usize = 1024;
const PEAK_REPS: usize = 8;

/// A GPU's matrix-product rate in the step's precision (f32, or bf16 under autocast): the best
/// of a few 4096³ products, each timed to the end of the GPU's queue.
fn device_gemm_rate(device: &Device, precision: Precision) -> Result<f64, BenchError> {
    let fail = |e: candle_core::Error| BenchError::Train(crate::train::TrainError::from(e));
    let dtype = crate::device::compute_dtype(precision);
    let n = GPU_PEAK_SIZE;
    let a = Tensor::ones((n, n), dtype, device).map_err(fail)?;
    let b = Tensor::ones((n, n), dtype, device).map_err(fail)?;
    a.matmul(&b).map_err(fail)?;
    device.synchronize().map_err(fail)?;
    let mut best = f64::INFINITY;
    for _ in 0..PEAK_REPS {
        let started = Instant::now();
        let c = a.matmul(&b).map_err(fail)?;
        device.synchronize().map_err(fail)?;
        best = best.min(started.elapsed().as_secs_f64());
        drop(c);
    }
    Ok(2.0 * (n as f64).powi(3) / best.max(1e-9))
}

/// A GPU's product: about 137 GFLOP, a few milliseconds on a large GPU.
const GPU_PEAK_SIZE: usize = 4096;

/// Sizes rayon's pool (which the kernels and candle's matrix products share) and tells candle.
fn use_threads(threads: usize) -> Result<(), BenchError> {
    if threads == 0 {
        return Err(BenchError::Usage("--threads must be at least 1".into()));
    }
    // SAFETY: called before this process starts any thread of its own (the CLI is
    // single-threaded until here); candle reads the variable to size its matrix products.
    unsafe { std::env::set_var("RAYON_NUM_THREADS", threads.to_string()) };
    // As a worker has it (see launch::group): shards call candle's ops single-threaded.
    // SAFETY: as above.
    unsafe { std::env::set_var("CANDLE_NUM_THREADS", "1") };
    crate::train::shards::start_global_pool(Some(threads))
        .map_err(|e| BenchError::Usage(format!("cannot start {threads} threads: {e}")))
}

/// Images uniform in [0, 1) (as scaled pixels) with uniform labels, or uniform token windows;
/// training mode, so a model with dropout pays for it as training does. `pairs` (DPO): `n`
/// preference pairs [n, 2, t], two windows each, the first half of each a prompt whose
/// targets do not score.
fn random_batch(
    rng: &mut Mt19937,
    n: usize,
    input: ModelInput,
    device: &Device,
    pairs: bool,
) -> candle_core::Result<MicroBatch> {
    if pairs {
        let rows = random_batch(rng, 2 * n, input, device, false)?;
        let (m, t) = rows.targets.dims2()?;
        let prompt = Tensor::full(crate::task::IGNORE_TARGET, (m, t / 2), device)?;
        let completion = rows.targets.narrow(1, t / 2, t - t / 2)?;
        let targets = Tensor::cat(&[&prompt, &completion], 1)?;
        return Ok(MicroBatch {
            inputs: rows.inputs.reshape((n, 2, t))?,
            targets: targets.reshape((n, 2, t))?,
            mode: Mode::Train {
                row_seeds: (0..n as u64).collect(),
            },
        });
    }
    let pick = |rng: &mut Mt19937, k: usize| (rng.uniform(0.0, k as f32) as u32).min(k as u32 - 1);
    let (inputs, targets) = match input {
        ModelInput::Image {
            shape: [c, h, w],
            classes,
        } => {
            let xs: Vec<f32> = (0..n * c * h * w).map(|_| rng.uniform(0.0, 1.0)).collect();
            let ys: Vec<u32> = (0..n).map(|_| pick(rng, classes)).collect();
            (
                Tensor::from_vec(xs, (n, c, h, w), device)?,
                Tensor::from_vec(ys, n, device)?,
            )
        }
        ModelInput::Tokens {
            vocab_size,
            block_size,
        } => {
            let ids: Vec<u32> = (0..n * (block_size + 1))
                .map(|_| pick(rng, vocab_size))
                .collect();
            let rows: Vec<&[u32]> = ids.chunks(block_size + 1).collect();
            let xs: Vec<u32> = rows
                .iter()
                .flat_map(|r| &r[..block_size])
                .copied()
                .collect();
            let ys: Vec<u32> = rows.iter().flat_map(|r| &r[1..]).copied().collect();
            (
                Tensor::from_vec(xs, (n, block_size), device)?,
                Tensor::from_vec(ys, (n, block_size), device)?,
            )
        }
    };
    Ok(MicroBatch {
        inputs,
        targets,
        mode: Mode::Train {
            row_seeds: (0..n as u64).collect(),
        },
    })
}

/// Where the peak was measured: "cuda:0" (the step's precision), or the CPU's threads.
fn peak_on(r: &StepBench) -> String {
    if r.device == "cpu" {
        let products = if r.bf16_products {
            "bf16 products"
        } else {
            "f32"
        };
        format!("the CPU with {} thread(s), {products}", r.threads)
    } else {
        r.device.clone()
    }
}

/// A table for a terminal.
pub fn step_table(r: &StepBench) -> String {
    let arithmetic = match (
        r.train_flops_per_sample,
        r.achieved_gflops,
        r.gemm_peak_gflops,
    ) {
        (Some(flops), Some(achieved), Some(peak)) => format!(
            "# arithmetic: {:.1} MFLOP per sample -> {achieved:.1} GFLOP/s of this machine's \
             measured GEMM peak, {peak:.1} GFLOP/s on {}: {:.1}% (limit {:.0} samples/s)\n",
            flops / 1e6,
            peak_on(r),
            100.0 * achieved / peak,
            peak * 1e9 / flops,
        ),
        (Some(flops), Some(achieved), None) => format!(
            "# arithmetic: {:.1} MFLOP per sample -> {achieved:.1} GFLOP/s; GEMM peak not \
             measured (--no-peak)\n",
            flops / 1e6
        ),
        (_, _, Some(peak)) => format!(
            "# arithmetic: this model's FLOPs are not known; measured GEMM peak {peak:.1} \
             GFLOP/s on {}\n",
            peak_on(r)
        ),
        (_, _, None) => "# arithmetic: this model's FLOPs are not known; GEMM peak not \
                         measured (--no-peak)\n"
            .to_string(),
    };
    let table = format!(
        "# training step: {} ({} parameters), {}, batch {} x accumulation {}, 1 process x {} \
         thread(s), {}, {}; {} steps after {} warm-up; {}\n\
         {:>14} {:>14} {:>10} {:>12} {:>11} {:>12} {:>10}\n\
         {:>14.2} {:>14.2} {:>10.2} {:>12} {:>11.2} {:>12.2} {:>10.2}\n",
        r.model,
        r.parameters,
        r.optimizer,
        r.batch_size,
        r.accumulation,
        r.threads,
        r.device,
        if r.flush_denormals {
            "subnormals flushed to zero"
        } else {
            "IEEE subnormals"
        },
        r.steps,
        r.warmup,
        match r.phase_clock.as_str() {
            "device" => "phases by the device's clock (CUDA events)",
            "none" => "phases not timed",
            _ => "phases by the host's clock",
        },
        "step ms median",
        "step ms mean",
        "queued ms",
        "samples/s",
        "forward ms",
        "backward ms",
        "update ms",
        r.step_ms_median,
        r.step_ms_mean,
        r.queue_ms_median,
        // Whole samples/s for small models, three decimals for a large one's few.
        if r.samples_per_s >= 100.0 {
            format!("{:.0}", r.samples_per_s)
        } else {
            format!("{:.3}", r.samples_per_s)
        },
        r.forward_ms,
        r.backward_ms,
        r.update_ms,
    );
    table + &arithmetic
}
