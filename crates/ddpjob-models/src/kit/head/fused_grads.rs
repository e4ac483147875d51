//! The head's gradients made in its forward, for a large vocabulary in training (Liger-Kernel's
//! "fused linear cross-entropy"): the loss is the last op of a step and a scalar, so its
//! gradients are those of the unit loss times the one number the backward brings. Each chunk
//! of rows has its logits made once, block of vocabulary columns by block, turned into d logits
//! in place, and consumed at once by dx and dw: three products of the head's size, never a
//! fourth to make the logits again, and never more than [`CHUNK_BYTES`] of logits held.
//! [`super::vocab_blocks`]' loss kept the logits for its backward only within 256 MB (else
//! made them again) and summed one vocabulary-wide dw per thread: at Qwen3's 151,936 tokens
//! over 512 positions that was a fourth product, 1.2 GB of partial dw to zero and add, and
//! 311 MB of logits when kept. Its weight gradient is made a little earlier than the
//! backward would make it, at the same peak: the end of the forward, when every activation is
//! still held, is also where the backward starts. Evaluation's score comes from here too.
//!
//! Logits are made transposed, [block width, rows] (the block of the weight times the
//! chunk's rows transposed once): every product then reads its operands as they lie, where
//! x·Wᵀ made gemm copy each block of the weight one element at a time (see
//! `kernels::strided_product`).
//!
//! Must not depend on anything but the head's shapes: the op and its choice are in `head`.

use std::ops::Range;

use rayon::prelude::*;

use super::IGNORED;
use super::vocab_blocks::{BLOCK, Shape};
use crate::kit::attention::{View, gemm_into};
use ddpjob_kernels::rows::exp;

/// Logits made and held at once, at most: one chunk of rows over the whole vocabulary (192
/// rows at Qwen3's 151,936 tokens, 640 at SmolLM2's 49,152: see [`chunk_rows`]).
pub(crate) const CHUNK_BYTES: usize = 128 << 20;

/// Rows evaluation scores at once, at most (its transposed rows and a thread's block of logits
/// are 16 and 8 MB at 1,024 channels).
const SCORED_ROWS: usize = 4096;

/// Rows per chunk at least, whatever the vocabulary: each chunk adds its rows' share to every
/// block of dw, whose depth (the rows) then stays worth a product.
const MIN_CHUNK_ROWS: usize = 64;

/// The unit loss's sum and gradients: Σ cross-entropy over the scored rows, dx [rows,
/// channels] and dw [vocab, channels] (empty when not wanted) of that sum times `scale`.
pub(crate) struct Grads {
    pub loss_sum: f32,
    pub dx: Vec<f32>,
    pub dw: Vec<f32>,
}

/// One block's statistics of one row: its largest logit and Σ exp(logit − that).
#[derive(Clone, Copy)]
struct BlockRow {
    max: f32,
    sum: f32,
}

/// What evaluation takes of one block's row: its statistics, the column of its first largest
/// logit, and the target's logit (0 when the target is in another block).
struct Pick {
    stats: BlockRow,
    best: usize,
    target: f32,
}

/// Rows per chunk for `rows` rows of a `vocab`-token vocabulary: as many as [`CHUNK_BYTES`]
/// holds (at least [`MIN_CHUNK_ROWS`]), a multiple of 64.
pub(crate) fn chunk_rows(rows: usize, vocab: usize) -> usize {
    let most = (CHUNK_BYTES / (vocab * std::mem::size_of::<f32>())).max(MIN_CHUNK_ROWS);
    // A multiple of gemm's 64-row tile (the rows are its tiles' side: 171 rows left a tile of
    // 43 to a slower kernel); the last chunk takes what is left.
    (most / MIN_CHUNK_ROWS * MIN_CHUNK_ROWS).min(rows).max(1)
}

/// Bytes of logits [`loss_and_grads`] holds at once over `rows` rows.
pub(crate) fn held_bytes(rows: usize, vocab: usize) -> usize {
    chunk_rows(rows, vocab) * vocab * std::mem::size_of::<f32>()
}

/// The loss's sum over the rows of `x` [rows, channels] against `ids`, and the gradients of
/// that sum times `scale` (dw only when `want_dw`), `chunk` rows at a time.
pub(crate) fn loss_and_grads(
    x: &[f32],
    w: &[f32],
    ids: &[usize],
    shape: Shape,
    scale: f32,
    want_dw: bool,
    chunk: usize,
) -> Grads {
    let (c, v) = (shape.channels, shape.vocab);
    let blocks: Vec<Range<usize>> = shape.blocks().collect();
    let chunk = chunk.clamp(1, shape.rows.max(1));
    let mut logits = vec![0f32; chunk * v];
    let mut dx = vec![0f32; shape.rows * c];
    let mut dw = vec![0f32; if want_dw { v * c } else { 0 }];
    let mut loss_sum = 0f32;
    for (k, start) in (0..shape.rows).step_by(chunk).enumerate() {
        let rows = start..(start + chunk).min(shape.rows);
        let targets = &ids[rows.clone()];
        let held = &mut logits[..rows.len() * v];
        let xt = transposed(x, &rows, c);
        let stats = block_logits(w, &xt, c, &blocks, held);
        let lse = merged(&stats, rows.len());
        loss_sum += chunk_loss(held, targets, &lse);
        to_dlogits((&blocks, held), (targets, &lse, scale));
        let xs = View::rows(x, rows.start * c, rows.len(), c, c);
        let dx_rows = &mut dx[rows.start * c..rows.end * c];
        products(
            w,
            xs,
            (&blocks, held),
            dx_rows,
            want_dw.then_some(&mut dw[..]),
            k == 0,
        );
    }
    Grads { loss_sum, dx, dw }
}

/// Σ cross-entropy over the scored rows and how many of their targets are the first largest
/// logit (evaluation: nothing held beyond a thread's block of logits).
pub(crate) fn loss_sum_and_correct(
    x: &[f32],
    w: &[f32],
    ids: &[usize],
    shape: Shape,
) -> (f64, usize) {
    let c = shape.channels;
    let blocks: Vec<Range<usize>> = shape.blocks().collect();
    // Nothing is held beyond a block's logits per thread, so a chunk can be long: the weight
    // is read once per chunk (622 MB at Qwen3's head).
    let chunk = shape.rows.clamp(1, SCORED_ROWS);
    let (mut sum, mut correct) = (0f64, 0);
    for start in (0..shape.rows).step_by(chunk.max(1)) {
        let rows = start..(start + chunk).min(shape.rows);
        let (n, targets) = (rows.len(), &ids[rows.clone()]);
        let xt = transposed(x, &rows, c);
        // Each block's logits in a buffer of its thread's, each row's statistics, first
        // largest logit and target's logit taken from it.
        let picks: Vec<Vec<Pick>> = blocks
            .par_iter()
            .map_init(Vec::new, |out: &mut Vec<f32>, cols| {
                out.resize(cols.len() * n, 0.0);
                logits_of_block(w, &xt, c, cols, out);
                let stats = block_stats(out, n);
                stats
                    .into_iter()
                    .zip(targets)
                    .enumerate()
                    .map(|(r, (stats, &t))| Pick {
                        stats,
                        best: cols.start
                            + (0..cols.len())
                                .find(|&j| out[j * n + r] == stats.max)
                                .unwrap_or(0),
                        target: match cols.contains(&t) {
                            true => out[(t - cols.start) * n + r],
                            false => 0.0,
                        },
                    })
                    .collect()
            })
            .collect();
        let stats: Vec<Vec<BlockRow>> = picks
            .iter()
            .map(|b| b.iter().map(|p| p.stats).collect())
            .collect();
        let lse = merged(&stats, n);
        for (r, &t) in targets.iter().enumerate() {
            if t == IGNORED {
                continue;
            }
            sum += (lse[r] - picks[t / BLOCK][r].target) as f64;
            // The first block holding the row's largest logit, and its first column there.
            let top = picks
                .iter()
                .fold(f32::NEG_INFINITY, |m, b| m.max(b[r].stats.max));
            let best = picks.iter().find(|b| b[r].stats.max == top);
            correct += usize::from(best.is_some_and(|b| b[r].best == t));
        }
    }
    (sum, correct)
}

/// The rows `rows` of `x` [rows, channels] transposed, [channels, rows]: what each block's
/// product reads as it is. (gemm copies an operand stored by columns one element at a time,
/// as `kernels::strided_product` explains; made once here, the weight's blocks are read as
/// they lie.)
fn transposed(x: &[f32], rows: &Range<usize>, c: usize) -> Vec<f32> {
    let n = rows.len();
    let mut xt = vec![0f32; c * n];
    for (r, row) in x[rows.start * c..rows.end * c].chunks_exact(c).enumerate() {
        for (j, &v) in row.iter().enumerate() {
            xt[j * n + r] = v;
        }
    }
    xt
}

/// The transposed logits [block width, rows] of one block: w's rows `cols` times `xt`.
fn logits_of_block(w: &[f32], xt: &[f32], c: usize, cols: &Range<usize>, out: &mut [f32]) {
    let n = xt.len() / c;
    let w_block = View::rows(w, cols.start * c, cols.len(), c, c);
    gemm_into(out, n, w_block, View::rows(xt, 0, c, n, n), false);
}

/// Each row's statistics within one block of transposed logits [width, rows].
fn block_stats(out: &[f32], n: usize) -> Vec<BlockRow> {
    let mut top = vec![f32::NEG_INFINITY; n];
    for col in out.chunks_exact(n) {
        top.iter_mut().zip(col).for_each(|(m, &v)| *m = m.max(v));
    }
    let mut sum = vec![0f32; n];
    for col in out.chunks_exact(n) {
        for ((s, &v), &m) in sum.iter_mut().zip(col).zip(&top) {
            *s += exp(v - m);
        }
    }
    top.into_iter()
        .zip(sum)
        .map(|(max, sum)| BlockRow { max, sum })
        .collect()
}

/// Every block's transposed logits of the chunk into `held` (block after block, each [block
/// width, rows]) and their statistics.
fn block_logits(
    w: &[f32],
    xt: &[f32],
    c: usize,
    blocks: &[Range<usize>],
    held: &mut [f32],
) -> Vec<Vec<BlockRow>> {
    let n = xt.len() / c;
    held.par_chunks_mut(n * BLOCK)
        .zip(blocks.par_iter())
        .map(|(out, cols)| {
            logits_of_block(w, xt, c, cols, out);
            block_stats(out, n)
        })
        .collect()
}

/// Each row's log-sum-exp, its blocks' statistics merged in block order (the same whatever
/// the number of threads).
fn merged(stats: &[Vec<BlockRow>], n: usize) -> Vec<f32> {
    (0..n)
        .map(|r| {
            let top = stats.iter().fold(f32::NEG_INFINITY, |m, b| m.max(b[r].max));
            let sum: f32 = stats.iter().map(|b| b[r].sum * exp(b[r].max - top)).sum();
            top + sum.ln()
        })
        .collect()
}

/// The logit of column `t` in row `r` of `held` (laid out as [`block_logits`] makes it).
fn logit_at(held: &[f32], rows: usize, r: usize, t: usize) -> f32 {
    let b = t / BLOCK;
    held[b * rows * BLOCK + (t - b * BLOCK) * rows + r]
}

/// Σ (log-sum-exp − target's logit) over the scored rows, in row order.
fn chunk_loss(held: &[f32], targets: &[usize], lse: &[f32]) -> f32 {
    let n = targets.len();
    targets
        .iter()
        .zip(lse)
        .enumerate()
        .filter(|(_, (t, _))| **t != IGNORED)
        .map(|(r, (&t, &l))| l - logit_at(held, n, r, t))
        .sum()
}

/// `held`'s logits made d logits in place: (softmax − one-hot(target)) · `scale`, zero for an
/// ignored target.
fn to_dlogits(
    (blocks, held): (&[Range<usize>], &mut [f32]),
    (targets, lse, scale): (&[usize], &[f32], f32),
) {
    let n = targets.len();
    let factor: Vec<f32> = targets
        .iter()
        .map(|&t| if t == IGNORED { 0.0 } else { scale })
        .collect();
    held.par_chunks_mut(n * BLOCK)
        .zip(blocks.par_iter())
        .for_each(|(block, cols)| {
            for col in block.chunks_exact_mut(n) {
                for ((v, &l), &f) in col.iter_mut().zip(lse).zip(&factor) {
                    // An ignored row's gradient is 0 whatever its logits (inf · 0 is not).
                    *v = if f == 0.0 { 0.0 } else { exp(*v - l) * f };
                }
            }
            for (r, &t) in targets.iter().enumerate() {
                if t != IGNORED && cols.contains(&t) {
                    block[(t - cols.start) * n + r] -= scale;
                }
            }
        });
}

/// dw's blocks (+)= d logitsᵀ · x of the chunk's rows `xs` (written by the first chunk, added
/// to by the others), and dx of those rows = d logits · w: one contiguous group of blocks per
/// thread, each group's dx a partial added in group order.
fn products(
    w: &[f32],
    xs: View,
    (blocks, held): (&[Range<usize>], &[f32]),
    dx: &mut [f32],
    dw: Option<&mut [f32]>,
    first: bool,
) {
    let c = w.len() / blocks.last().map_or(1, |b| b.end).max(1);
    let n = dx.len() / c.max(1);
    let groups = rayon::current_num_threads().clamp(1, blocks.len());
    let per_group = blocks.len().div_ceil(groups);
    let mut dw_groups: Vec<Option<&mut [f32]>> = match dw {
        Some(dw) => dw.chunks_mut(per_group * BLOCK * c).map(Some).collect(),
        None => (0..blocks.len().div_ceil(per_group))
            .map(|_| None)
            .collect(),
    };
    let partials: Vec<Vec<f32>> = dw_groups
        .par_iter_mut()
        .zip(blocks.par_chunks(per_group))
        .zip(held.par_chunks(per_group * n * BLOCK))
        .map(|((dw, group), dl)| {
            let mut dx = vec![0f32; n * c];
            let mut at = 0;
            for (i, cols) in group.iter().enumerate() {
                let width = cols.len();
                // d logitsᵀ [width, rows] of this block.
                let dlt = View::rows(dl, at, width, n, n);
                at += n * width;
                let w_block = View::rows(w, cols.start * c, width, c, c);
                gemm_into(&mut dx, c, dlt.t(), w_block, i > 0);
                if let Some(dw) = dw.as_deref_mut() {
                    let local = (cols.start - group[0].start) * c;
                    gemm_into(&mut dw[local..], c, dlt, xs, !first);
                }
            }
            dx
        })
        .collect();
    let mut parts = partials.into_iter();
    if let Some(part) = parts.next() {
        dx.copy_from_slice(&part);
    }
    for part in parts {
        dx.iter_mut().zip(part).for_each(|(d, p)| *d += p);
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use crate::kit::head;
    use crate::testing::{max_diff, values};

    /// The loss, dx and dw (none for a frozen head) of `loss` · 3 (the backward's gradient is
    /// not 1).
    fn run(loss: Tensor, x: &Var, w: &Tensor) -> Vec<Vec<f32>> {
        let grads = (&loss * 3.0).unwrap().backward().unwrap();
        let mut out = vec![values(&loss), values(grads.get(x.as_tensor()).unwrap())];
        out.extend(grads.get(w).map(values));
        out
    }

    #[test]
    fn gradients_made_in_the_forward_are_the_backwards_in_any_chunks() {
        // 2,100 symbols: five blocks of columns, the last partial; 150 rows, every third
        // target ignored. In one chunk, in chunks of 40 rows (the last of 30), of 1: against
        // the op that makes them in its backward (`vocab_blocks`).
        let dev = Device::Cpu;
        let (rows, channels, vocab) = (150, 16, 2100);
        let x =
            Var::from_tensor(&Tensor::randn(0f32, 1., (rows, channels), &dev).unwrap()).unwrap();
        let w =
            Var::from_tensor(&Tensor::randn(0f32, 0.5, (vocab, channels), &dev).unwrap()).unwrap();
        let ids: Vec<u32> = (0..rows as u32)
            .map(|i| match i % 3 == 1 {
                true => ddpjob_seam::task::IGNORE_TARGET,
                false => (i * 7 + 3) % vocab as u32,
            })
            .collect();
        let targets = Tensor::new(ids.as_slice(), &dev).unwrap();
        for frozen in [false, true] {
            let w = match frozen {
                true => w.as_tensor().detach(),
                false => w.as_tensor().clone(),
            };
            let reference = run(
                head::loss_in_backward(x.as_tensor(), &w, &targets, false).unwrap(),
                &x,
                &w,
            );
            assert_eq!(reference.len(), if frozen { 2 } else { 3 });
            for chunk in [None, Some(40), Some(1)] {
                let loss = match chunk {
                    None => head::loss(x.as_tensor(), &w, &targets).unwrap(),
                    Some(c) => head::loss_in_chunks(x.as_tensor(), &w, &targets, c).unwrap(),
                };
                let fused = run(loss, &x, &w);
                assert_eq!(
                    fused.len(),
                    reference.len(),
                    "frozen {frozen}: a dw for a frozen head"
                );
                for (i, (a, b)) in fused.iter().zip(&reference).enumerate() {
                    let diff = max_diff(a, b);
                    assert!(
                        diff < 1e-5,
                        "chunk {chunk:?}, frozen {frozen}: output {i} (0: loss, 1: dx, 2: dw) \
                         differs by {diff}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_loss_among_several_kept_passes_makes_its_gradients_in_its_backward() {
        // DPO's per-row passes (`ddpjob_seam::row_passes`) must not each hold a weight
        // gradient from their forward: they take the op that makes it in its backward.
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1., (8, 4), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::randn(0f32, 1., (2100, 4), &dev).unwrap()).unwrap();
        let targets = Tensor::new(&[1u32, 2, 3, 4, 5, 6, 7, 2099], &dev).unwrap();
        let (xs, ws) = (x.as_tensor(), w.as_tensor());
        assert!(head::grads_in_forward(xs, ws));
        let whole = head::loss(xs, ws, &targets).unwrap();
        let row = ddpjob_seam::row_passes::within(|| {
            assert!(!head::grads_in_forward(xs, ws));
            head::loss(xs, ws, &targets)
        })
        .unwrap();
        // Nor a pass that wants no gradient (evaluation's detached rows), nor a small
        // vocabulary.
        assert!(!head::grads_in_forward(&xs.detach(), &ws.detach()));
        assert!(!head::grads_in_forward(xs, &ws.narrow(0, 0, 2048).unwrap()));
        let (a, b) = (run(whole, &x, w.as_tensor()), run(row, &x, w.as_tensor()));
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            assert!(max_diff(a, b) < 1e-5, "output {i}");
        }
    }

    #[test]
    fn scores_over_more_rows_than_one_chunk_are_the_composed_ones() {
        // 4,100 rows: a chunk of 4,096 and one of 4; every fifth target ignored.
        let dev = Device::Cpu;
        let (rows, channels, vocab) = (super::SCORED_ROWS + 4, 8, 2100);
        let x = Tensor::randn(0f32, 1., (rows, channels), &dev).unwrap();
        let w = Tensor::randn(0f32, 0.5, (vocab, channels), &dev).unwrap();
        let ids: Vec<u32> = (0..rows as u32)
            .map(|i| match i % 5 == 2 {
                true => ddpjob_seam::task::IGNORE_TARGET,
                false => (i * 13 + 1) % vocab as u32,
            })
            .collect();
        let targets = Tensor::new(ids.as_slice(), &dev).unwrap();
        let (sum, correct) = head::score(&x, &w, &targets).unwrap();
        let logits = x.matmul(&w.t().unwrap()).unwrap();
        let (sum2, correct2) = ddpjob_seam::task::loss_sum_and_correct(&logits, &targets).unwrap();
        assert!((sum - sum2).abs() < 1e-6 * sum2.abs(), "{sum} vs {sum2}");
        assert_eq!(correct, correct2);
    }

    #[test]
    fn a_chunk_holds_at_most_its_budget_of_logits_and_at_least_a_products_depth() {
        // Qwen3's 151,936 tokens over 512 rows: chunks of 192 rows (192, 192, 128).
        assert_eq!(super::chunk_rows(512, 151_936), 192);
        assert!(super::held_bytes(512, 151_936) <= super::CHUNK_BYTES);
        // SmolLM2's 49,152 over 512: one chunk; a vocabulary too large for 64 rows: 64.
        assert_eq!(super::chunk_rows(512, 49_152), 512);
        assert_eq!(super::chunk_rows(512, 1 << 20), 64);
        assert_eq!(super::chunk_rows(3, 151_936), 3);
    }
}
