//! The head for large vocabularies (GPT-2's 50,304 tokens) where a loss is one of several
//! (DPO's per row; a whole step's loss in training, and evaluation, are `fused_grads`'s): logits made for a thread's rows a
//! block of vocabulary columns at a time, with the log-sum-exp carried across blocks (online
//! softmax). Each block's logits stay in the core's cache from the product to the softmax, and
//! each block of the weight is copied into gemm's layout once per pass instead of the whole
//! weight once per chunk of rows. The backward reuses the forward's log-sum-exp per row and,
//! up to `KEEP_BYTES` (256 MB), its logits; beyond that it makes each block's logits again
//! rather than holding gigabytes (SmolLM2's 49,152 tokens over 2 × 256 positions: the kept
//! logits took about 0.7 s off a 5 s backward of the 135M model on 2 cores). GPT-2's 50,304 tokens on a model of
//! 4 layers of 128 channels, 12 windows of 64, 2 threads (AMD EPYC, AVX2): a step took 625,
//! 536, 483, 524 ms with chunks of 128 rows × the whole vocabulary and 459, 384, 344, 338 ms
//! here (alternating pairs); without the kept log-sum-exp, about 7% less was gained.

use std::borrow::Cow;
use std::ops::Range;

use rayon::prelude::*;

use super::IGNORED;
use crate::kit::attention::{View, gemm_into};
use ddpjob_kernels::rows::{exp, max, sum_map};

/// Vocabulary columns per block: 512 columns of 384 rows are 768 KB of logits.
pub(crate) const BLOCK: usize = 512;

/// Rows per chunk at most (a thread's share of the rows otherwise).
const MAX_ROWS: usize = 512;

/// Logits a loss keeps for its backward, at most (beyond, the backward makes them again):
/// SmolLM2's 49,152 tokens over 2 × 256 positions are 100 MB, and keeping them saves the
/// backward a product as large as the forward's.
const KEEP_BYTES: usize = 256 << 20;

/// What a loss's forward keeps for its backward: each row's log-sum-exp, and every logit
/// [rows, vocab] when they fit in [`KEEP_BYTES`] (else empty).
#[derive(Debug, Clone, Default)]
pub(crate) struct Kept {
    pub lse: Vec<f32>,
    pub logits: Vec<f32>,
}

/// Whether a vocabulary of `vocab` symbols is made block by block here.
pub(crate) fn applies(vocab: usize) -> bool {
    vocab > 4 * BLOCK
}

/// One row's softmax statistics so far: the largest logit, Σ exp(logit - max), the target's
/// logit, and the first largest logit's column.
#[derive(Clone, Copy)]
struct Row {
    max: f32,
    sum: f32,
    target: f32,
    best: usize,
}

impl Row {
    fn lse(&self) -> f32 {
        self.max + self.sum.ln()
    }
}

/// The shapes of one call: x [rows, channels], w [vocab, channels].
#[derive(Clone, Copy)]
pub(crate) struct Shape {
    pub rows: usize,
    pub channels: usize,
    pub vocab: usize,
}

impl Shape {
    /// Rows per chunk: a thread's share, at most [`MAX_ROWS`].
    fn chunk(&self) -> usize {
        let per_thread = self.rows.div_ceil(rayon::current_num_threads().max(1));
        per_thread.clamp(1, MAX_ROWS)
    }

    fn chunks(&self) -> Vec<Range<usize>> {
        let chunk = self.chunk();
        (0..self.rows.div_ceil(chunk))
            .map(|c| c * chunk..((c + 1) * chunk).min(self.rows))
            .collect()
    }

    /// The columns of every block.
    pub(crate) fn blocks(&self) -> impl Iterator<Item = Range<usize>> {
        let vocab = self.vocab;
        (0..vocab.div_ceil(BLOCK)).map(move |b| b * BLOCK..((b + 1) * BLOCK).min(vocab))
    }

    /// Logits of `rows` against the vocabulary `cols` into `out` [rows, cols].
    fn logits(
        &self,
        x: &[f32],
        w: &[f32],
        rows: &Range<usize>,
        cols: &Range<usize>,
        out: &mut [f32],
    ) {
        let c = self.channels;
        let xs = View::rows(x, rows.start * c, rows.len(), c, c);
        let wt = View::rows(w, cols.start * c, cols.len(), c, c).t();
        gemm_into(out, cols.len(), xs, wt, false);
    }

    /// Every row's statistics over the whole vocabulary; the logits copied into `keep`
    /// ([rows, vocab]) when given.
    fn stats(
        &self,
        x: &[f32],
        w: &[f32],
        ids: &[usize],
        rows: &Range<usize>,
        mut keep: Option<&mut [f32]>,
    ) -> Vec<Row> {
        let start = Row {
            max: f32::NEG_INFINITY,
            sum: 0.0,
            target: 0.0,
            best: 0,
        };
        let mut stats = vec![start; rows.len()];
        let mut logits = vec![0f32; rows.len() * BLOCK];
        for cols in self.blocks() {
            let width = cols.len();
            let logits = &mut logits[..rows.len() * width];
            self.logits(x, w, rows, &cols, logits);
            if let Some(keep) = keep.as_deref_mut() {
                for (row, kept) in logits
                    .chunks_exact(width)
                    .zip(keep.chunks_exact_mut(self.vocab))
                {
                    kept[cols.clone()].copy_from_slice(row);
                }
            }
            let targets = &ids[rows.clone()];
            for ((row, s), &t) in logits.chunks_exact(width).zip(&mut stats).zip(targets) {
                let m = max(row);
                if m > s.max {
                    s.best = cols.start + row.iter().position(|&v| v == m).unwrap_or(0);
                    s.sum *= exp(s.max - m);
                    s.max = m;
                }
                let top = s.max;
                s.sum += sum_map(row, |v| exp(v - top));
                if cols.contains(&t) {
                    s.target = row[t - cols.start];
                }
            }
        }
        stats
    }
}

/// Σ over rows of the cross-entropy (chunk sums added in order), and what [`loss_bwd`] can
/// use of the forward ([`Kept`]).
pub(crate) fn loss_sum(
    x: &[f32],
    w: &[f32],
    ids: &[usize],
    shape: Shape,
    keep_logits: bool,
) -> (f32, Kept) {
    let keep = keep_logits && shape.rows * shape.vocab * std::mem::size_of::<f32>() <= KEEP_BYTES;
    let mut logits = vec![0f32; if keep { shape.rows * shape.vocab } else { 0 }];
    let chunks = shape.chunks();
    let slots: Vec<Option<&mut [f32]>> = match keep {
        true => logits
            .chunks_mut(shape.chunk() * shape.vocab)
            .map(Some)
            .collect(),
        false => chunks.iter().map(|_| None).collect(),
    };
    let parts: Vec<(f32, Vec<f32>)> = slots
        .into_par_iter()
        .zip(chunks)
        .map(|(slot, rows)| {
            let stats = shape.stats(x, w, ids, &rows, slot);
            let loss = stats
                .iter()
                .zip(&ids[rows.clone()])
                .filter(|(_, t)| **t != IGNORED)
                .map(|(s, _)| s.lse() - s.target)
                .sum::<f32>();
            (loss, stats.iter().map(Row::lse).collect())
        })
        .collect();
    let loss = parts.iter().map(|p| p.0).sum();
    let lse = parts.into_iter().flat_map(|p| p.1).collect();
    (loss, Kept { lse, logits })
}

/// d logits = (softmax - one-hot(target)) · `scale`; dx = d logits · w into `dx`; returns
/// dw = d logitsᵀ · x (one partial per thread, added in order). What [`loss_sum`] kept saves
/// making the logits once (its log-sum-exp) or twice (its logits) more; what it did not keep
/// is made here.
// The head's operands, its shape and what to form: one call site, in `head.rs`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn loss_bwd(
    x: &[f32],
    w: &[f32],
    ids: &[usize],
    scale: f32,
    dx: &mut [f32],
    shape: Shape,
    kept: &Kept,
    want_dw: bool,
) -> Vec<f32> {
    let c = shape.channels;
    let (chunk, chunks) = (shape.chunk(), shape.chunks());
    let groups = rayon::current_num_threads().min(chunks.len()).max(1);
    let per_group = chunks.len().div_ceil(groups);
    let partial_dw: Vec<Vec<f32>> = dx
        .par_chunks_mut(per_group * chunk * c)
        .zip(chunks.par_chunks(per_group))
        .map(|(dx, group)| {
            let mut dw = vec![0f32; if want_dw { w.len() } else { 0 }];
            let mut dl = vec![0f32; chunk * BLOCK];
            for (k, rows) in group.iter().enumerate() {
                let lse: Cow<[f32]> = match kept.lse.get(rows.clone()) {
                    Some(known) => Cow::Borrowed(known),
                    None => shape
                        .stats(x, w, ids, rows, None)
                        .iter()
                        .map(Row::lse)
                        .collect(),
                };
                let logits = kept
                    .logits
                    .get(rows.start * shape.vocab..rows.end * shape.vocab);
                let local = (rows.start - group[0].start) * c;
                let xs = View::rows(x, rows.start * c, rows.len(), c, c);
                for (b, cols) in shape.blocks().enumerate() {
                    let width = cols.len();
                    let dl = &mut dl[..rows.len() * width];
                    match logits {
                        Some(kept) => {
                            for (out, row) in dl
                                .chunks_exact_mut(width)
                                .zip(kept.chunks_exact(shape.vocab))
                            {
                                out.copy_from_slice(&row[cols.clone()]);
                            }
                        }
                        None => shape.logits(x, w, rows, &cols, dl),
                    }
                    let targets = &ids[rows.clone()];
                    for ((row, &lse), &t) in dl.chunks_exact_mut(width).zip(lse.iter()).zip(targets)
                    {
                        if t == IGNORED {
                            row.fill(0.0);
                            continue;
                        }
                        row.iter_mut().for_each(|v| *v = exp(*v - lse) * scale);
                        if cols.contains(&t) {
                            row[t - cols.start] -= scale;
                        }
                    }
                    let dl = View::rows(dl, 0, rows.len(), width, width);
                    let w_block = View::rows(w, cols.start * c, width, c, c);
                    gemm_into(&mut dx[local..], c, dl, w_block, b > 0);
                    if want_dw {
                        gemm_into(&mut dw[cols.start * c..], c, dl.t(), xs, k > 0);
                    }
                }
            }
            dw
        })
        .collect();
    if !want_dw {
        return Vec::new();
    }
    let mut parts = partial_dw.into_iter();
    let mut dw = parts.next().unwrap_or_else(|| vec![0f32; w.len()]);
    for part in parts {
        dw.iter_mut().zip(part).for_each(|(d, p)| *d += p);
    }
    dw
}
