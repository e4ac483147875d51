//! Attention without the [t, t] scores: FlashAttention-2's algorithm on the CPU (f32, and
//! `train.precision = "bf16-matmul"`'s products). The forward walks each query head's rows
//! in tiles against the keys they see with an online softmax and keeps only the output and
//! one log-sum-exp per row and head; the backward recomputes each tile's probabilities from
//! those and adds the tile's share to dQ, dK and dV. A pass holds a few tiles per thread
//! whatever the context, so memory grows linearly with it. Causal, grouped-query heads (a
//! key-value head serves its group where it lies: no repeated copies), packed rows (each
//! position sees its own example only) and sliding windows are one rule: the keys a position
//! sees are `first_key(i)..=i`.
//!
//! The forward's tasks are (sequence, query head); the backward's (sequence, key-value head),
//! each adding its group's gradients in a fixed order, so the results are the same bits for
//! any thread count (world-size invariance relies on it). It depends on candle and this
//! crate's host helpers only.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use crate::host::{Out, values, with_values};

mod cpu;
#[cfg(test)]
mod tests;
mod tile;

/// The shape of an attention: heads, their size, the sequence length and which keys each
/// position sees.
#[derive(Clone, Debug)]
pub struct Attention {
    /// Query heads.
    pub heads: usize,
    /// Key-value heads (a divisor of `heads`; each serves `heads / kv_heads` query heads).
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Positions per sequence.
    pub t: usize,
    /// Sliding window: position i sees keys i − window + 1 ..= i only.
    pub window: Option<usize>,
    /// Packed rows: for each position of every sequence ([n·t]), the first position of its
    /// example, the first key it may see.
    pub starts: Option<Arc<Vec<u32>>>,
}

impl Attention {
    /// Plain causal attention of `heads` heads of `head_dim` channels over sequences of `t`,
    /// each head its own key-value head (GPT-2's).
    pub fn multi_head(heads: usize, head_dim: usize, t: usize) -> Attention {
        Attention {
            heads,
            kv_heads: heads,
            head_dim,
            t,
            window: None,
            starts: None,
        }
    }

    /// Columns of the input rows: q's heads, then k's, then v's.
    fn cols(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Columns of the output rows: every query head's values.
    fn out_cols(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Query heads per key-value head.
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// The sequences of `shape` [n·t, cols].
    fn sequences(&self, shape: &Shape) -> Result<usize> {
        let (rows, cols) = shape.dims2()?;
        let (h, kv, t) = (self.heads, self.kv_heads, self.t);
        if h == 0 || kv == 0 || h % kv != 0 || t == 0 || self.head_dim == 0 {
            bail!("flash attention: {h} heads over {kv} key-value heads, t {t}: not a grouping");
        }
        if cols != self.cols() || rows % t != 0 {
            bail!(
                "flash attention: rows {shape:?} are not sequences of {t} with {h} query and \
                 {kv} key-value heads of {}",
                self.head_dim
            );
        }
        if self.window == Some(0) {
            bail!("flash attention: a window of 0 keys");
        }
        let n = rows / t;
        if let Some(starts) = &self.starts
            && starts.len() != n * t
        {
            bail!(
                "flash attention: {} starts for {} positions",
                starts.len(),
                n * t
            );
        }
        Ok(n)
    }

    /// The first visible key of each position of sequence `s`, when packed.
    fn starts_of(&self, s: usize) -> Option<&[u32]> {
        let t = self.t;
        self.starts.as_deref().map(|all| &all[s * t..(s + 1) * t])
    }

    /// (t, input columns, output columns, query heads).
    fn widths(&self) -> (usize, usize, usize, usize) {
        (self.t, self.cols(), self.out_cols(), self.heads)
    }

    /// Rows of `out_cols` after the output's n·t that hold the log-sum-exps.
    fn lse_rows(&self, n: usize) -> usize {
        (n * self.heads * self.t).div_ceil(self.out_cols())
    }
}

/// Attention of `qkv` [n·t, (H + 2·KV)·hd] (each row: its position's query heads, then key
/// heads, then value heads; f32 on the CPU): the attended values [n·t, H·hd], heads side by
/// side, before the output projection.
pub fn flash_attention(qkv: &Tensor, attention: &Attention) -> Result<Tensor> {
    let rows = qkv.dim(0)?;
    // The op's result holds the log-sum-exps in rows after the output, where its backward
    // finds them; the view of the output alone is contiguous.
    qkv.contiguous()?
        .apply_op1(attention.clone())?
        .narrow(0, 0, rows)
}

/// Sequence `s`'s rows of `width` values, of sequences of `t` rows.
fn sequence(v: &[f32], s: usize, t: usize, width: usize) -> &[f32] {
    &v[s * t * width..][..t * width]
}

/// [`flash_attention`]'s forward on raw rows: `x` [n·t, cols] (f32, as in `flash_attention`)
/// into `o` [n·t, H·hd] (every value written) and `lse` [n, H, t], each row's log-sum-exp per
/// head, which [`flash_attention_backward`] reads. For passes that keep their own buffers (the
/// GPT's hand-written one).
pub fn flash_attention_forward(
    attention: &Attention,
    x: &[f32],
    o: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let (t, cols, co, h) = attention.widths();
    let n = attention.sequences(&Shape::from((x.len() / cols.max(1), cols)))?;
    if x.len() != n * t * cols || o.len() != n * t * co || lse.len() < n * h * t {
        bail!("flash attention: buffers do not fit {n} sequences of {t}");
    }
    let o = Out {
        ptr: o.as_mut_ptr(),
        row_stride: co,
    };
    lse[..n * h * t]
        .par_chunks_mut(t)
        .enumerate()
        .for_each(|(task, lse)| {
            let (s, head) = (task / h, task % h);
            let x = sequence(x, s, t, cols);
            let o = o.offset(s * t * co);
            // SAFETY: sequence s's rows of the output lie at s·t·co in `o`; this task alone
            // writes head `head`'s columns of them.
            unsafe { cpu::forward_head(attention, x, o, lse, head, attention.starts_of(s)) }
        });
    Ok(())
}

/// The backward of [`flash_attention_forward`]: with its inputs `x`, its results `o` and `lse`
/// and the output's gradient `dy` [n·t, H·hd], writes the gradient of `x` into `dx` (every
/// value).
pub fn flash_attention_backward(
    attention: &Attention,
    x: &[f32],
    (o, lse): (&[f32], &[f32]),
    dy: &[f32],
    dx: &mut [f32],
) -> Result<()> {
    let (t, cols, co, h) = attention.widths();
    let n = attention.sequences(&Shape::from((x.len() / cols.max(1), cols)))?;
    let fits = x.len() == n * t * cols && dx.len() == x.len();
    if !fits || o.len() < n * t * co || dy.len() < n * t * co || lse.len() < n * h * t {
        bail!("flash attention: buffers do not fit {n} sequences of {t}");
    }
    let kv = attention.kv_heads;
    let dx = Out {
        ptr: dx.as_mut_ptr(),
        row_stride: cols,
    };
    (0..n * kv).into_par_iter().for_each(|task| {
        let (s, g) = (task / kv, task % kv);
        let saved = cpu::Saved {
            o: sequence(o, s, t, co),
            lse: &lse[s * h * t..(s + 1) * h * t],
        };
        let dx = dx.offset(s * t * cols);
        let inputs = (sequence(x, s, t, cols), sequence(dy, s, t, co));
        // SAFETY: sequence s's gradient rows lie at s·t·cols in `dx`; this task alone writes
        // its group's q, k and v columns of them.
        unsafe { cpu::backward_group(attention, inputs, saved, dx, g, attention.starts_of(s)) }
    });
    Ok(())
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "ddpjob-flash-attention"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = self.sequences(layout.shape())?;
        let (t, _, co, _) = self.widths();
        let extra = self.lse_rows(n);
        let mut all = vec![0f32; (n * t + extra) * co];
        let (o, lse) = all.split_at_mut(n * t * co);
        flash_attention_forward(self, values(storage, layout)?, o, lse)?;
        Ok((CpuStorage::F32(all), Shape::from((n * t + extra, co))))
    }

    fn bwd(&self, qkv: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let n = self.sequences(qkv.shape())?;
        let (t, _, co, _) = self.widths();
        let mut dqkv = vec![0f32; qkv.elem_count()];
        with_values(qkv, |x| {
            with_values(res, |res| {
                with_values(grad, |dy| {
                    let (o, lse) = res.split_at(n * t * co);
                    flash_attention_backward(self, x, (o, lse), &dy[..n * t * co], &mut dqkv)
                })
            })
        })?;
        Ok(Some(Tensor::from_vec(dqkv, qkv.shape(), qkv.device())?))
    }
}
