//! The tied output projection and the cross-entropy over the vocabulary as one op (CPU, f32):
//! logits are made and consumed a chunk of rows at a time (for a large vocabulary, a block of
//! columns at a time too: `vocab_blocks`), never held as a whole [n, vocab] tensor, and the
//! backward recomputes each chunk's logits instead of keeping them. With GPT-2's
//! 50,304 tokens, 1,024 positions would otherwise hold 206 MB of logits, and as much again for
//! each intermediate of the softmax and its gradient (Liger-Kernel's "fused linear
//! cross-entropy").

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use crate::kit::attention::{View, gemm_into};
use ddpjob_kernels::rows::{exp, max, sum_map};
use ddpjob_kernels::{values, with_values};
pub(crate) mod fused_grads;
pub(crate) mod vocab_blocks;

use ddpjob_kernels::{indices, indices_of};
use vocab_blocks::Kept;

/// A target that scores nothing (a prompt's tokens, padding): `task::IGNORE_TARGET` as the
/// kernels read targets. Its row has no loss, no gradient, and is not counted in the mean.
pub const IGNORED: usize = ddpjob_seam::task::IGNORE_TARGET as usize;

/// The targets that score, the denominator of the mean (1 when none do: their loss is 0).
fn scored(ids: &[usize]) -> usize {
    ids.iter().filter(|&&t| t != IGNORED).count().max(1)
}

/// Logits made at once, about: 128 KB, so a chunk's logits stay in the core's L2 cache from
/// the product that makes them to the softmax that reads them.
const LOGITS_PER_CHUNK: usize = 32 * 1024;

/// The fewest rows made at once (128 × 2,048 floats is 1 MB; larger vocabularies are made in
/// blocks of columns, see `vocab_blocks`). Every chunk's product copies (packs) the whole
/// weight again, which costs more than the logits leaving the cache: with GPT-2's 50,304
/// tokens (4 layers of 128 channels, 12 windows of 64, 2 threads), before `vocab_blocks`, 128
/// rows instead of 32 took a step from 789, 756, 784, 702 ms to 624, 563, 601, 490 ms
/// (alternating pairs); 192 and 384 rows were slower again.
const MIN_CHUNK: usize = 128;

/// Mean cross-entropy of logits `x`·`w`ᵀ (x [n, C], w [vocab, C]) against `targets` [n] (u32),
/// over the targets that are not [`ddpjob_seam::task::IGNORE_TARGET`]; differentiable in `x` and
/// `w`. CPU f32 only (see [`applies`]). The loss of a whole step: for a large vocabulary in
/// training its gradients are made in its forward (`fused_grads`), which holds a weight's
/// gradient from then on; a loss per row (DPO's: `ddpjob_seam::row_passes`) makes them in its
/// backward.
pub fn loss(x: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
    loss_keeping(x, w, targets, true)
}

/// Whether [`loss`] makes its gradients in its forward: a large vocabulary, gradients wanted,
/// and not one of several passes kept to one backward (DPO's rows: each would hold a weight
/// gradient until then).
pub(crate) fn grads_in_forward(x: &Tensor, w: &Tensor) -> bool {
    let vocab = w.dims().first().copied().unwrap_or(0);
    (x.track_op() || w.track_op())
        && vocab_blocks::applies(vocab)
        && !ddpjob_seam::row_passes::active()
}

/// [`loss`] with its gradients made `chunk` rows at a time (tests: several chunks).
#[cfg(test)]
pub(crate) fn loss_in_chunks(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    chunk: usize,
) -> Result<Tensor> {
    let op = GradsOp {
        made: Default::default(),
        want_dw: w.track_op(),
        chunk: Some(chunk),
    };
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &targets.contiguous()?, op)
}

/// [`loss`]; where its gradients are made in its backward (see [`grads_in_forward`]), that
/// makes a large vocabulary's logits again instead of keeping them from the forward when
/// `keep_logits` is false (a job that asked for activation checkpointing asked for memory
/// over time: at SmolLM2's 49,152 tokens over 2 × 512 positions the kept logits are 201 MB).
pub fn loss_keeping(x: &Tensor, w: &Tensor, targets: &Tensor, keep_logits: bool) -> Result<Tensor> {
    if !grads_in_forward(x, w) {
        return loss_in_backward(x, w, targets, keep_logits);
    }
    let op = GradsOp {
        made: Default::default(),
        want_dw: w.track_op(),
        chunk: None,
    };
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &targets.contiguous()?, op)
}

/// [`loss_keeping`] with its gradients made in its backward whatever the vocabulary.
pub(crate) fn loss_in_backward(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    keep_logits: bool,
) -> Result<Tensor> {
    let op = HeadLossOp {
        kept: Default::default(),
        keep_logits,
    };
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &targets.contiguous()?, op)
}

/// Σ cross-entropy and the number of targets that are the logits' argmax (evaluation).
pub fn score(x: &Tensor, w: &Tensor, targets: &Tensor) -> Result<(f64, usize)> {
    let ids = indices(targets)?;
    with_values(x, |x| with_values(w, |w| score_values(x, w, &ids)))
}

/// [`score`] of the values `x` [n, C] and `w` [vocab, C] against `ids`.
pub(crate) fn score_values(x: &[f32], w: &[f32], ids: &[usize]) -> Result<(f64, usize)> {
    let dims = Dims::of(x.len(), w.len(), ids.len())?;
    check_targets(ids, dims.vocab)?;
    if vocab_blocks::applies(dims.vocab) {
        return Ok(fused_grads::loss_sum_and_correct(x, w, ids, dims.shape()));
    }
    let parts: Vec<(f64, usize)> = (0..dims.chunks())
        .into_par_iter()
        .map(|c| {
            let (rows, logits) = dims.logits(x, w, c);
            let mut sums = (0.0, 0);
            for (row, &target) in logits.chunks_exact(dims.vocab).zip(&ids[rows]) {
                if target == IGNORED {
                    continue;
                }
                sums.0 += (log_sum_exp(row) - row[target]) as f64;
                let best = row
                    .iter()
                    .enumerate()
                    .fold(0, |b, (i, &v)| if v > row[b] { i } else { b });
                sums.1 += usize::from(best == target);
            }
            sums
        })
        .collect();
    Ok(parts.iter().fold((0.0, 0), |a, p| (a.0 + p.0, a.1 + p.1)))
}

/// Bytes of logits [`loss`] holds at once in training over `rows` rows of a `vocab`-symbol
/// vocabulary: a large vocabulary's chunk of rows (at most `fused_grads::CHUNK_BYTES`), else
/// none worth counting.
pub fn kept_logit_bytes(rows: usize, vocab: usize) -> usize {
    match vocab_blocks::applies(vocab) {
        true => fused_grads::held_bytes(rows, vocab),
        false => 0,
    }
}

/// Whether the fused op can run: f32 values on the CPU.
pub fn applies(x: &Tensor, w: &Tensor) -> bool {
    ddpjob_kernels::applies(x) && ddpjob_kernels::applies(w)
}

/// The op of one loss: its forward keeps each row's log-sum-exp (for a vocabulary made in
/// blocks), so its backward does not make every logit once more to find it (at SmolLM2's
/// 49,152 tokens that pass is a fifth matrix product of the head's size, 5% of a step).
struct HeadLossOp {
    kept: std::sync::Mutex<Kept>,
    /// Whether a large vocabulary's logits are kept for the backward (see [`Kept`]).
    keep_logits: bool,
}

#[derive(Clone, Copy)]
struct Dims {
    rows: usize,
    channels: usize,
    vocab: usize,
    /// Rows whose logits are made at once (see [`Dims::chunk_rows`]).
    chunk: usize,
}

impl Dims {
    fn of(x_len: usize, w_len: usize, rows: usize) -> Result<Dims> {
        let channels = x_len.checked_div(rows).unwrap_or(0);
        if rows == 0 || channels == 0 || x_len != rows * channels || !w_len.is_multiple_of(channels)
        {
            bail!("head loss: {x_len} inputs for {rows} targets and {w_len} weights do not fit");
        }
        let vocab = w_len / channels;
        Ok(Dims {
            rows,
            channels,
            vocab,
            chunk: Self::chunk_rows(rows, vocab),
        })
    }

    /// Rows per chunk: [`LOGITS_PER_CHUNK`] logits' worth, at least [`MIN_CHUNK`], and at most
    /// a thread's share of the rows, so the chunks still spread over the pool. Every chunk
    /// multiplies by the whole weight (gemm copies it each time): with 65 characters, one chunk
    /// per shard instead of twelve of 32 rows took the head's forward from 200 to 160 µs and
    /// its backward from 420 to 367 µs (384 rows, one core).
    fn chunk_rows(rows: usize, vocab: usize) -> usize {
        let per_thread = rows.div_ceil(rayon::current_num_threads().max(1));
        (LOGITS_PER_CHUNK / vocab)
            .max(MIN_CHUNK)
            .min(per_thread)
            .max(1)
    }

    fn shape(&self) -> vocab_blocks::Shape {
        vocab_blocks::Shape {
            rows: self.rows,
            channels: self.channels,
            vocab: self.vocab,
        }
    }

    /// How many chunks the rows make.
    fn chunks(&self) -> usize {
        self.rows.div_ceil(self.chunk)
    }

    /// The rows of chunk `c` and their logits [rows, vocab].
    fn logits(&self, x: &[f32], w: &[f32], c: usize) -> (std::ops::Range<usize>, Vec<f32>) {
        let (start, end) = (c * self.chunk, ((c + 1) * self.chunk).min(self.rows));
        let mut logits = vec![0f32; (end - start) * self.vocab];
        let xs = View::rows(
            x,
            start * self.channels,
            end - start,
            self.channels,
            self.channels,
        );
        let wt = View::rows(w, 0, self.vocab, self.channels, self.channels).t();
        gemm_into(&mut logits, self.vocab, xs, wt, false);
        (start..end, logits)
    }
}

/// ln Σ exp(v), stable.
fn log_sum_exp(row: &[f32]) -> f32 {
    let m = max(row);
    m + sum_map(row, |v| exp(v - m)).ln()
}

impl CustomOp3 for HeadLossOp {
    fn name(&self) -> &'static str {
        "ddpjob-gpt-head-loss"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
        t: &CpuStorage,
        t_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, ids) = (
            values(x, x_layout)?,
            values(w, w_layout)?,
            indices_of(t, t_layout)?,
        );
        let (mean, kept) = mean_loss(x, w, &ids, self.keep_logits)?;
        if let Ok(mut slot) = self.kept.lock() {
            *slot = kept;
        }
        Ok((CpuStorage::F32(vec![mean]), Shape::from(())))
    }

    /// d logits = (softmax - one-hot(target)) · g / n; dx = d logits · w, dw = d logitsᵀ · x.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> Result<HeadGrads> {
        let ids = indices(targets)?;
        let g = grad.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        // The forward's, when it kept one per row of these targets (taken: used once).
        let kept = self
            .kept
            .lock()
            .map(|mut k| std::mem::take(&mut *k))
            .unwrap_or_default();
        let kept = if kept.lse.len() == ids.len() {
            kept
        } else {
            Kept::default()
        };
        // A frozen head (LoRA's, `model.freeze`) comes detached: no weight gradient.
        let (dx, dw) = grads_made((x, w, &ids), g, &kept, w.track_op())?;
        as_tensors((dx, dw), x, w)
    }
}

/// dx and dw of `g` · the mean loss of `x`, `w` against `ids`, made from what the forward
/// kept (dw empty unless `want_dw`).
fn grads_made(
    (x, w, ids): (&Tensor, &Tensor, &[usize]),
    g: f32,
    kept: &Kept,
    want_dw: bool,
) -> Result<(Vec<f32>, Vec<f32>)> {
    with_values(x, |xv| {
        with_values(w, |wv| {
            let mut dx = vec![0f32; xv.len()];
            let dw = loss_bwd(xv, wv, ids, g, &mut dx, kept, want_dw)?;
            Ok((dx, dw))
        })
    })
}

/// A head op's gradients for x, w (none when `dw` is empty) and the targets (none).
type HeadGrads = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// `dx` and `dw` as tensors of `x`'s and `w`'s shapes.
fn as_tensors((dx, dw): (Vec<f32>, Vec<f32>), x: &Tensor, w: &Tensor) -> Result<HeadGrads> {
    let dw = match dw.is_empty() {
        true => None,
        false => Some(Tensor::from_vec(dw, w.shape(), w.device())?),
    };
    Ok((Some(Tensor::from_vec(dx, x.shape(), x.device())?), dw, None))
}

/// Mean cross-entropy of logits `x`·`w`ᵀ (x [n, C], w [vocab, C] values) against `ids`, and
/// for a vocabulary made in blocks each row's log-sum-exp, which [`loss_bwd`] then need not
/// make again (empty otherwise), and its logits when they fit and `keep_logits`.
pub(crate) fn mean_loss(
    x: &[f32],
    w: &[f32],
    ids: &[usize],
    keep_logits: bool,
) -> Result<(f32, Kept)> {
    let dims = Dims::of(x.len(), w.len(), ids.len())?;
    check_targets(ids, dims.vocab)?;
    if vocab_blocks::applies(dims.vocab) {
        let (sum, kept) = vocab_blocks::loss_sum(x, w, ids, dims.shape(), keep_logits);
        return Ok((sum / scored(ids) as f32, kept));
    }
    let parts: Vec<f32> = (0..dims.chunks())
        .into_par_iter()
        .map(|c| {
            let (rows, logits) = dims.logits(x, w, c);
            let rows = logits.chunks_exact(dims.vocab).zip(&ids[rows]);
            rows.filter(|(_, t)| **t != IGNORED)
                .map(|(row, &t)| log_sum_exp(row) - row[t])
                .sum::<f32>()
        })
        .collect();
    // Chunk sums added in order: the same loss whatever the number of threads.
    Ok((
        parts.iter().sum::<f32>() / scored(ids) as f32,
        Kept::default(),
    ))
}

/// The backward of `g` · [`mean_loss`]: d logits = (softmax - one-hot(target)) · g / n;
/// dx = d logits · w written into `dx`; returns dw = d logitsᵀ · x. `lse`: what
/// [`mean_loss`] returned besides the loss, or nothing.
pub(crate) fn loss_bwd(
    xv: &[f32],
    wv: &[f32],
    ids: &[usize],
    g: f32,
    dx: &mut [f32],
    kept: &Kept,
    want_dw: bool,
) -> Result<Vec<f32>> {
    let dims = Dims::of(xv.len(), wv.len(), ids.len())?;
    check_targets(ids, dims.vocab)?;
    let scale = g / scored(ids) as f32;
    if vocab_blocks::applies(dims.vocab) {
        return Ok(vocab_blocks::loss_bwd(
            xv,
            wv,
            ids,
            scale,
            dx,
            dims.shape(),
            kept,
            want_dw,
        ));
    }
    // One dw per contiguous group of chunks (one per thread), added in order.
    let (chunk, chunks) = (dims.chunk, dims.chunks());
    let groups = rayon::current_num_threads().min(chunks).max(1);
    let per_group = chunks.div_ceil(groups);
    let partial_dw: Vec<Vec<f32>> = dx
        .par_chunks_mut(per_group * chunk * dims.channels)
        .enumerate()
        .map(|(gi, dx)| {
            let mut dw = vec![0f32; if want_dw { wv.len() } else { 0 }];
            let first = gi * per_group;
            for c in first..(first + per_group).min(chunks) {
                let (rows, mut dl) = dims.logits(xv, wv, c);
                for (row, &t) in dl.chunks_exact_mut(dims.vocab).zip(&ids[rows.clone()]) {
                    if t == IGNORED {
                        row.fill(0.0);
                        continue;
                    }
                    let lse = log_sum_exp(row);
                    row.iter_mut().for_each(|v| *v = exp(*v - lse) * scale);
                    row[t] -= scale;
                }
                let n = rows.len();
                let dl_view = View::rows(&dl, 0, n, dims.vocab, dims.vocab);
                let local = (rows.start - first * chunk) * dims.channels;
                let w_view = View::rows(wv, 0, dims.vocab, dims.channels, dims.channels);
                gemm_into(&mut dx[local..], dims.channels, dl_view, w_view, false);
                let x_view = View::rows(
                    xv,
                    rows.start * dims.channels,
                    n,
                    dims.channels,
                    dims.channels,
                );
                if want_dw {
                    gemm_into(&mut dw, dims.channels, dl_view.t(), x_view, true);
                }
            }
            dw
        })
        .collect();
    if !want_dw {
        return Ok(Vec::new());
    }
    let mut parts = partial_dw.into_iter();
    let mut dw = parts.next().unwrap_or_else(|| vec![0f32; wv.len()]);
    for part in parts {
        dw.iter_mut().zip(part).for_each(|(d, p)| *d += p);
    }
    Ok(dw)
}

/// The op of a whole step's loss over a large vocabulary: its forward makes the gradients of
/// the mean loss (`fused_grads`), its backward scales them by the loss's gradient.
struct GradsOp {
    /// dx and dw (empty when `want_dw` is false), made by the forward, taken by the backward.
    made: std::sync::Mutex<Option<(Vec<f32>, Vec<f32>)>>,
    want_dw: bool,
    /// Rows per chunk, when not `fused_grads::chunk_rows`'s.
    chunk: Option<usize>,
}

impl CustomOp3 for GradsOp {
    fn name(&self) -> &'static str {
        "ddpjob-head-loss-grads"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
        t: &CpuStorage,
        t_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, ids) = (
            values(x, x_layout)?,
            values(w, w_layout)?,
            indices_of(t, t_layout)?,
        );
        let dims = Dims::of(x.len(), w.len(), ids.len())?;
        check_targets(&ids, dims.vocab)?;
        let n = scored(&ids) as f32;
        let chunk = self
            .chunk
            .unwrap_or_else(|| fused_grads::chunk_rows(dims.rows, dims.vocab));
        let grads =
            fused_grads::loss_and_grads(x, w, &ids, dims.shape(), 1.0 / n, self.want_dw, chunk);
        if let Ok(mut slot) = self.made.lock() {
            *slot = Some((grads.dx, grads.dw));
        }
        Ok((CpuStorage::F32(vec![grads.loss_sum / n]), Shape::from(())))
    }

    /// The forward's gradients times the loss's gradient `g` (made again, as [`HeadLossOp`]
    /// makes them, if a second backward finds them taken).
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> Result<HeadGrads> {
        let g = grad.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        let made = self.made.lock().ok().and_then(|mut m| m.take());
        let grads = match made {
            Some((mut dx, mut dw)) => {
                if g != 1.0 {
                    for part in [&mut dx, &mut dw] {
                        part.par_chunks_mut(1 << 16)
                            .for_each(|c| c.iter_mut().for_each(|v| *v *= g));
                    }
                }
                (dx, dw)
            }
            None => {
                let ids = indices(targets)?;
                grads_made((x, w, &ids), g, &Kept::default(), self.want_dw)?
            }
        };
        as_tensors(grads, x, w)
    }
}

fn check_targets(ids: &[usize], vocab: usize) -> Result<()> {
    match ids.iter().find(|&&t| t >= vocab && t != IGNORED) {
        Some(t) => bail!("head loss: target {t} is outside the vocabulary of {vocab}"),
        None => Ok(()),
    }
}
