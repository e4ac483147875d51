//! Evaluation on the evaluation split: each rank takes an unpadded shard, sums of loss and
//! correct predictions per target are all-reduced, so every target counts exactly once. In
//! world-size-invariant training every batch is scored alone on one thread and the batches'
//! sums are added in batch order on every rank: the same metrics, bit for bit, on any number
//! of workers.

use candle_core::Tensor;

use crate::models::Model;
use crate::task::{BatchSource, EvalSums, MetricInfo, MetricValues, Task};
use ddpjob_comm::Communicator;

use super::TrainError;
use super::shards::ShardPool;

#[derive(Debug, Clone, PartialEq)]
pub struct EvalResult {
    /// Mean cross-entropy per target: what the best checkpoint and early stopping watch.
    pub loss: f64,
    /// The fraction of targets predicted exactly.
    pub accuracy: f64,
    /// Targets scored (samples for a classifier, tokens for a language model).
    pub samples: usize,
    /// What the task reports of it (see [`Task::metrics`]), by name in its order.
    pub values: MetricValues,
    /// How each of them reads.
    pub metrics: Vec<MetricInfo>,
}

impl EvalResult {
    /// The value of metric `name` when the task declares it.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.values.get(name)
    }

    pub fn perplexity(&self) -> Option<f64> {
        self.get("perplexity")
    }

    /// `val loss 1.6527, perplexity 5.221, next-token accuracy 45.12%`.
    pub fn describe(&self) -> String {
        self.values.describe(&self.metrics)
    }
}

/// How `task`'s evaluations read: what it declares, in order.
pub fn declared_metrics(task: &dyn Task) -> Vec<MetricInfo> {
    task.metrics().iter().map(|m| m.info()).collect()
}

/// How a rank's evaluation batches use its threads.
#[derive(Debug, Clone, Copy)]
pub enum EvalThreads<'a> {
    /// Each batch's rows cut over the pool's threads (whole without one).
    Rows(Option<&'a ShardPool>),
    /// World-size-invariant: every batch of the split (the same batches whatever the world
    /// size) scored alone on one thread, a rank's batches side by side on its threads when
    /// `cpu`, each batch's sums kept apart until every rank has them all.
    Pieces { cpu: bool },
    /// Sharded parameters (`sharding = "full"`): on this thread, which gathers them as the
    /// model asks, every rank scoring as many samples in batches of the same rows, cut into
    /// parts by the widest rank's windows, so every rank asks as often (a rank with fewer
    /// samples pads its shard with the split's first, whose targets are ignored: scored,
    /// never counted).
    Lockstep,
}

/// Positions a language model scores at once, on the CPU and on an accelerator: an
/// evaluation batch of more windows is scored a part at a time (its sums added in order), so
/// `eval_batch_size` does not size the activations (attention's [windows, heads, t, t] above
/// all). A llama of 256 × 4 heads at context 256, `eval_batch_size` 1000, 2 threads: peak
/// 3.18 GB scored whole, 1.40 GB in parts of 16,384 positions, 0.58 GB (the training step's
/// peak) in parts of 4,096, and 1.5× faster.
const SCORED_POSITIONS: [usize; 2] = [4_096, 16_384];

/// What `model` adds up over `xs`, `ys` (see [`Model::eval_sums`]): token windows [n, t, ...]
/// in parts of at most [`SCORED_POSITIONS`] positions (a window whole), anything else at once.
/// `width`: the positions per window to size the parts by, when not `xs`'s own (in lockstep,
/// the widest any rank's batch has, so every rank cuts its batch into as many parts).
fn score(
    model: &dyn Model,
    xs: &Tensor,
    ys: &Tensor,
    width: Option<usize>,
) -> candle_core::Result<EvalSums> {
    let dims = xs.dims();
    let most = SCORED_POSITIONS[usize::from(!xs.device().is_cpu())];
    let windows = match (xs.dtype().is_int(), dims) {
        (true, &[n, _, ..]) if n * width.unwrap_or(positions(dims)) > most => {
            (most / width.unwrap_or(positions(dims))).max(1)
        }
        _ => return model.eval_sums(xs, ys),
    };
    let mut sums = EvalSums::default();
    for start in (0..dims[0]).step_by(windows) {
        let len = windows.min(dims[0] - start);
        let part = model.eval_sums(&xs.narrow(0, start, len)?, &ys.narrow(0, start, len)?)?;
        sums.add(&part);
    }
    Ok(sums)
}

/// Positions a sample of token inputs `dims` [n, ...] holds: a window's t ([n, t], packed
/// [n, t, 2]), or both rows of a preference pair ([n, 2, t]: 2t).
fn positions(dims: &[usize]) -> usize {
    match *dims {
        [_, 2, t] if t != 2 => 2 * t,
        [_, t, ..] => t,
        _ => 1,
    }
}

/// Evaluates on the samples of `task`'s evaluation split that `batches` serves, or on
/// `batches_limit` batches of them spread evenly over it (the same ones every time).
pub fn evaluate(
    model: &dyn Model,
    task: &dyn Task,
    batches: &dyn BatchSource,
    comm: &dyn Communicator,
    (batch_size, batches_limit): (usize, Option<usize>),
    threads: EvalThreads<'_>,
) -> Result<EvalResult, TrainError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let eval_len = task.eval_len();
    let picked = batches_limit.map_or(eval_len, |b| (b * batch_size).min(eval_len));
    let index = |j: usize| j * eval_len / picked.max(1);
    let shards = match threads {
        EvalThreads::Rows(shards) => shards,
        EvalThreads::Lockstep => None,
        EvalThreads::Pieces { cpu } => {
            let all: Vec<usize> = (0..picked).map(index).collect();
            let pieces: Vec<&[usize]> = all.chunks(batch_size.max(1)).collect();
            let sums = in_pieces(model, batches, comm, &pieces, cpu)?;
            return Ok(result(task, sums));
        }
    };
    let mut shard: Vec<usize> = (rank..picked).step_by(world).map(index).collect();
    // In lockstep, samples past `real` are padding.
    let real = shard.len();
    if let EvalThreads::Lockstep = threads {
        shard.resize(picked.div_ceil(world), index(0));
    }
    let mut sums = EvalSums::default();
    for (k, chunk) in shard.chunks(batch_size).enumerate() {
        let (xs, ys) = batches.eval(chunk)?;
        let ys = ignore_rows_from(&ys, real.saturating_sub(k * batch_size))?;
        let width = match threads {
            EvalThreads::Lockstep => Some(widest(comm, &xs)?),
            _ => None,
        };
        let ranges = super::shards::ranges(shards, chunk.len());
        let part = |i: usize| -> candle_core::Result<EvalSums> {
            let r = &ranges[i];
            let (xs, ys) = (
                xs.narrow(0, r.start, r.len())?,
                ys.narrow(0, r.start, r.len())?,
            );
            score(model, &xs, &ys, width)
        };
        let parts = match shards {
            Some(pool) if ranges.len() > 1 => pool.run(ranges.len(), part),
            _ => vec![part(0)],
        };
        for part in parts {
            sums.add(&part?);
        }
    }
    let mut slots = sums.slots();
    comm.all_reduce_sum_f64(&mut slots)?;
    Ok(result(task, EvalSums::from_slots(&slots)))
}

/// The most positions per window of any rank's batch (`xs` [n, t, ...] here): a
/// collective, every rank's width in its own slot, the others zero, so the sum is exact.
fn widest(comm: &dyn Communicator, xs: &Tensor) -> Result<usize, TrainError> {
    let mut widths = vec![0.0; comm.world_size()];
    widths[comm.rank()] = positions(xs.dims()) as f64;
    comm.all_reduce_sum_f64(&mut widths)?;
    Ok(widths.into_iter().fold(0.0, f64::max) as usize)
}

/// `targets` with every row from `from` on ignored ([`crate::task::IGNORE_TARGET`]).
fn ignore_rows_from(targets: &Tensor, from: usize) -> candle_core::Result<Tensor> {
    let rows = targets.dim(0)?;
    if from >= rows {
        return Ok(targets.clone());
    }
    let mut shape = targets.dims().to_vec();
    shape[0] = rows - from;
    let ignored = Tensor::full(crate::task::IGNORE_TARGET, shape, targets.device())?;
    Tensor::cat(
        &[
            &targets.narrow(0, 0, from)?,
            &ignored.to_dtype(targets.dtype())?,
        ],
        0,
    )
}

/// The sums over `pieces` (the split's batches), rank r scoring pieces r, r + W, ...: each
/// piece alone on one thread, its sums in its
/// own slots of a buffer that is zero elsewhere on every other rank (so the all-reduce adds
/// only zeros to them: exact), then added in piece order, the same on every rank.
fn in_pieces(
    model: &dyn Model,
    batches: &dyn BatchSource,
    comm: &dyn Communicator,
    pieces: &[&[usize]],
    cpu: bool,
) -> Result<EvalSums, TrainError> {
    const N: usize = EvalSums::SLOTS;
    let (rank, world) = (comm.rank(), comm.world_size());
    let mine: Vec<usize> = (rank..pieces.len()).step_by(world).collect();
    let side_by_side = if cpu { rayon::current_num_threads() } else { 1 };
    let mut slots = vec![0.0f64; N * pieces.len()];
    for group in mine.chunks(side_by_side.max(1)) {
        let loaded = group
            .iter()
            .map(|&p| batches.eval(pieces[p]))
            .collect::<Result<Vec<(Tensor, Tensor)>, _>>()?;
        let score = |i: usize| -> candle_core::Result<EvalSums> {
            let (xs, ys) = &loaded[i];
            score(model, xs, ys, None)
        };
        for (&p, sums) in
            group
                .iter()
                .zip(super::invariant::one_thread_each(group.len(), cpu, score))
        {
            slots[N * p..N * (p + 1)].copy_from_slice(&sums?.slots());
        }
    }
    if world > 1 {
        comm.all_reduce_sum_f64(&mut slots)?;
    }
    let mut sums = EvalSums::default();
    for piece in slots.chunks_exact(N) {
        sums.add(&EvalSums::from_slots(piece));
    }
    Ok(sums)
}

fn result(task: &dyn Task, sums: EvalSums) -> EvalResult {
    let targets = sums.targets;
    let metrics = task.metrics();
    EvalResult {
        loss: sums.mean_loss(),
        accuracy: sums.accuracy(),
        samples: targets as usize,
        values: MetricValues::of(&metrics, &sums),
        metrics: metrics.iter().map(|m| m.info()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use candle_core::{DType, Device, Tensor};

    use super::*;

    /// Scores 1 per row and counts its targets, remembering the most rows it was given.
    #[derive(Default)]
    struct Rows {
        most: AtomicUsize,
        params: crate::models::Params,
    }

    impl Model for Rows {
        fn forward(&self, _: &Tensor, _: &crate::models::Mode) -> candle_core::Result<Tensor> {
            candle_core::bail!("scored only")
        }
        fn params(&self) -> &crate::models::Params {
            &self.params
        }
        fn score(&self, xs: &Tensor, ys: &Tensor) -> candle_core::Result<(f64, usize)> {
            let rows = xs.dims()[0];
            self.most.fetch_max(rows, Ordering::Relaxed);
            Ok((rows as f64, ys.elem_count()))
        }
    }

    #[test]
    fn a_samples_positions_count_both_rows_of_a_pair() {
        assert_eq!(positions(&[8, 256]), 256);
        assert_eq!(positions(&[8, 256, 2]), 256, "packed: token and position");
        assert_eq!(positions(&[8, 2, 256]), 512, "a preference pair's two rows");
        assert_eq!(positions(&[8, 2, 2]), 2, "a window of 2, packed");
        // A pair's batch is cut into parts by its rows' positions, not by 2.
        let model = Rows::default();
        let pairs = Tensor::zeros((100, 2, 64), DType::U32, &Device::Cpu).unwrap();
        score(&model, &pairs, &pairs, None).unwrap();
        assert_eq!(model.most.load(Ordering::Relaxed), 4096 / 128);
    }

    #[test]
    fn token_windows_are_scored_a_few_thousand_positions_at_a_time() {
        let cpu = Device::Cpu;
        let windows = Tensor::zeros((1000, 64), DType::U32, &cpu).unwrap();
        let model = Rows::default();
        let sums = |s: EvalSums| (s.loss, s.correct as usize);
        assert_eq!(
            sums(score(&model, &windows, &windows, None).unwrap()),
            (1000.0, 64_000)
        );
        assert_eq!(model.most.load(Ordering::Relaxed), 4096 / 64);
        // A window longer than a part is scored whole, alone.
        let long = Tensor::zeros((3, 5000), DType::U32, &cpu).unwrap();
        let model = Rows::default();
        assert_eq!(
            sums(score(&model, &long, &long, None).unwrap()),
            (3.0, 15_000)
        );
        assert_eq!(model.most.load(Ordering::Relaxed), 1);
        // Images (floats) at once, whatever their size.
        let images = Tensor::zeros((1000, 784), DType::F32, &cpu).unwrap();
        let labels = Tensor::zeros(1000, DType::U32, &cpu).unwrap();
        let model = Rows::default();
        assert_eq!(
            sums(score(&model, &images, &labels, None).unwrap()),
            (1000.0, 1000)
        );
        assert_eq!(model.most.load(Ordering::Relaxed), 1000);
        // In lockstep, cut by the widest rank's windows: as many parts as that rank's.
        let model = Rows::default();
        assert_eq!(
            sums(score(&model, &windows, &windows, Some(256)).unwrap()),
            (1000.0, 64_000)
        );
        assert_eq!(model.most.load(Ordering::Relaxed), 4096 / 256);
    }
}
