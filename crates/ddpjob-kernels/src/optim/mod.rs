//! One-pass optimizer updates: torch.optim's Adam, AdamW and SGD formulas applied per element,
//! the parameter updated in place and the new moment buffers written once, where candle's
//! tensor ops would make a dozen passes with a fresh tensor each.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use std::cell::RefCell;

use candle_core::{CpuStorage, InplaceOp2, Layout, Result, Tensor};
use rayon::prelude::*;

use crate::host::{threads, values};

/// Elements per parallel task: large enough that splitting pays.
const CHUNK: usize = 1 << 15;

/// Hyper-parameters of one Adam or AdamW step.
#[derive(Debug, Clone, Copy)]
pub struct AdamStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW (`p *= 1 - lr·wd` first) rather than Adam's L2 term (`g += wd·p`).
    pub decoupled: bool,
    /// The step number, from 1 (bias correction).
    pub t: i32,
}

/// Hyper-parameters of one SGD step (dampening 0, as torch's default).
#[derive(Debug, Clone, Copy)]
pub struct SgdStep {
    pub lr: f64,
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
}

/// Updates `param` in place from `grad`, and the first and second moments (`exp_avg`,
/// `exp_avg_sq`) with it; empty moments are zeros (the first step).
pub fn adam_step(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &mut Vec<f32>,
    exp_avg_sq: &mut Vec<f32>,
    h: AdamStep,
) -> Result<()> {
    let n = param.elem_count();
    for moment in [&mut *exp_avg, &mut *exp_avg_sq] {
        if moment.is_empty() {
            moment.resize(n, 0.0);
        }
    }
    let op = AdamOp {
        h,
        moments: RefCell::new((exp_avg, exp_avg_sq)),
    };
    param.inplace_op2(&grad.contiguous()?, &op)
}

/// Updates `param` in place from `grad`, and the momentum buffer with it (left empty without
/// momentum; an empty buffer starts at the first gradient, as torch's).
pub fn sgd_step(param: &Tensor, grad: &Tensor, buffer: &mut Vec<f32>, h: SgdStep) -> Result<()> {
    let op = SgdOp {
        h,
        buffer: RefCell::new(buffer),
    };
    param.inplace_op2(&grad.contiguous()?, &op)
}

/// Σ g² over a CPU f32 tensor, each square and every sum in f64 (four interleaved partial
/// sums, so the loop vectorises). Squares of f32 are exact in f64, so however the gradient is
/// cut (a sharded optimizer sums its pieces, then the ranks' sums) the total differs only in
/// the last digits of an f64, and the clipping coefficient, rounded to f32, almost never.
pub fn sum_of_squares(g: &Tensor) -> Result<f64> {
    crate::host::with_values(g, |g| {
        let mut lanes = [0f64; 4];
        let chunks = g.chunks_exact(4);
        let square = |v: f32| (v as f64) * (v as f64);
        let tail: f64 = chunks.remainder().iter().map(|&v| square(v)).sum();
        for chunk in chunks {
            for (lane, &v) in lanes.iter_mut().zip(chunk) {
                *lane += square(v);
            }
        }
        Ok(lanes.iter().sum::<f64>() + tail)
    })
}

/// `g` · `factor` as a new CPU f32 tensor, one parallel pass.
pub fn scaled(g: &Tensor, factor: f32) -> Result<Tensor> {
    let values = crate::host::with_values(g, |g| {
        Ok(g.par_chunks(CHUNK)
            .flat_map_iter(|chunk| chunk.iter().map(move |v| v * factor))
            .collect::<Vec<f32>>())
    })?;
    Tensor::from_vec(values, g.shape(), g.device())
}

/// `a + b` for every pair of equally long CPU f32 tensors (one gradient of two shards or
/// micro-batches each), as new tensors shaped like `a`, in one parallel pass over all pairs:
/// candle's `+` per gradient ran on one thread while the shards' threads waited (measured:
/// about 1% of a GPT step).
pub fn add_pairs(pairs: &[(&Tensor, &Tensor)]) -> Result<Vec<Tensor>> {
    let operands: Vec<&Tensor> = pairs.iter().flat_map(|&(a, b)| [a, b]).collect();
    let sums = crate::host::with_all_values(&operands, |values| {
        let mut sums: Vec<Vec<f32>> = Vec::with_capacity(pairs.len());
        let mut tasks = Vec::new();
        for pair in values.chunks_exact(2) {
            let (a, b) = (pair[0], pair[1]);
            if a.len() != b.len() {
                candle_core::bail!("add_pairs: {} and {} values", a.len(), b.len());
            }
            sums.push(Vec::with_capacity(a.len()));
        }
        for (sum, pair) in sums.iter_mut().zip(values.chunks_exact(2)) {
            let out = &mut sum.spare_capacity_mut()[..pair[0].len()];
            for ((out, a), b) in out
                .chunks_mut(CHUNK)
                .zip(pair[0].chunks(CHUNK))
                .zip(pair[1].chunks(CHUNK))
            {
                tasks.push((out, a, b));
            }
        }
        tasks.into_par_iter().for_each(|(out, a, b)| {
            for ((o, a), b) in out.iter_mut().zip(a).zip(b) {
                o.write(a + b);
            }
        });
        for (sum, pair) in sums.iter_mut().zip(values.chunks_exact(2)) {
            // SAFETY: the tasks above wrote each of the first `len` values of every sum (its
            // chunks cover them), and the capacity is `len`.
            unsafe { sum.set_len(pair[0].len()) };
        }
        Ok(sums)
    })?;
    sums.into_iter()
        .zip(pairs)
        .map(|(sum, (a, _))| Tensor::from_vec(sum, a.shape(), a.device()))
        .collect()
}

/// Writes `src` into the CPU f32 tensor `param` in place, all but the elements `keep` (of
/// the flattened tensor): a sharded optimizer's all-gathered parameters, around the piece
/// this rank updated itself.
pub fn overwrite_except(param: &Tensor, src: &[f32], keep: std::ops::Range<usize>) -> Result<()> {
    param.inplace_op1(&Overwrite { src, keep })
}

struct Overwrite<'a> {
    src: &'a [f32],
    keep: std::ops::Range<usize>,
}

impl candle_core::InplaceOp1 for Overwrite<'_> {
    fn name(&self) -> &'static str {
        "ddpjob-overwrite"
    }

    fn cpu_fwd(&self, p: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let p = param_values(p, layout)?;
        if p.len() != self.src.len() || self.keep.end > p.len() {
            candle_core::bail!(
                "overwrite: {} values for a tensor of {}",
                self.src.len(),
                p.len()
            );
        }
        let (start, end) = (self.keep.start.min(self.keep.end), self.keep.end);
        p[..start].copy_from_slice(&self.src[..start]);
        p[end..].copy_from_slice(&self.src[end..]);
        Ok(())
    }
}

/// The parameter's values, mutable, for an in-place op (which candle hands over contiguous).
fn param_values<'a>(storage: &'a mut CpuStorage, layout: &Layout) -> Result<&'a mut [f32]> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("optimizer kernels need a contiguous parameter");
    };
    match storage {
        CpuStorage::F32(all) => Ok(&mut all[start..end]),
        _ => candle_core::bail!("optimizer kernels need f32 parameters"),
    }
}

/// Runs `f` over matching chunks of the parameter, its gradient and its state buffers, in
/// parallel when there are threads to spare.
fn for_chunks(
    p: &mut [f32],
    g: &[f32],
    states: Vec<&mut [f32]>,
    f: impl Fn(&mut [f32], &[f32], &mut [&mut [f32]]) + Sync,
) {
    let (mut p, mut g, mut states) = (p, g, states);
    if threads() == 1 || p.len() <= CHUNK {
        return f(p, g, &mut states);
    }
    let mut tasks = Vec::with_capacity(p.len().div_ceil(CHUNK));
    while !p.is_empty() {
        let take = CHUNK.min(p.len());
        let (p_head, p_tail) = std::mem::take(&mut p).split_at_mut(take);
        let (g_head, g_tail) = g.split_at(take);
        let mut heads = Vec::with_capacity(states.len());
        for state in states.iter_mut() {
            let (head, tail) = std::mem::take(state).split_at_mut(take);
            heads.push(head);
            *state = tail;
        }
        tasks.push((p_head, g_head, heads));
        (p, g) = (p_tail, g_tail);
    }
    tasks
        .into_par_iter()
        .for_each(|(p, g, mut states)| f(p, g, &mut states));
}

struct AdamOp<'a> {
    h: AdamStep,
    moments: RefCell<(&'a mut Vec<f32>, &'a mut Vec<f32>)>,
}

impl InplaceOp2 for AdamOp<'_> {
    fn name(&self) -> &'static str {
        "ddpjob-adam"
    }

    fn cpu_fwd(
        &self,
        p: &mut CpuStorage,
        p_layout: &Layout,
        g: &CpuStorage,
        g_layout: &Layout,
    ) -> Result<()> {
        let p = param_values(p, p_layout)?;
        let g = values(g, g_layout)?;
        let mut moments = self.moments.borrow_mut();
        let (m, v) = &mut *moments;
        if g.len() != p.len() || m.len() != p.len() || v.len() != p.len() {
            candle_core::bail!("adam: gradient or state does not match the parameter's size");
        }
        let adam = Adam::new(self.h);
        let update = move |p: &mut [f32], g: &[f32], states: &mut [&mut [f32]]| {
            if let [m, v] = states {
                adam.apply(p, g, m, v);
            }
        };
        for_chunks(p, g, vec![&mut m[..], &mut v[..]], update);
        Ok(())
    }
}

/// Adam's per-element constants, as plain copies so the loop reads no captured memory (the
/// GPU kernel takes the same ones: `optim::cuda`).
#[derive(Clone, Copy)]
pub(super) struct Adam {
    pub(super) b1: f32,
    pub(super) b2: f32,
    pub(super) one_minus_b1: f32,
    pub(super) one_minus_b2: f32,
    pub(super) step_size: f32,
    pub(super) inv_correction2: f32,
    pub(super) eps: f32,
    pub(super) l2: f32,
    pub(super) shrink: f32,
}

impl Adam {
    pub(super) fn new(h: AdamStep) -> Self {
        let correction2 = (1.0 - h.beta2.powi(h.t)).sqrt() as f32;
        // Adam adds wd·p to the gradient; AdamW shrinks p first and adds nothing.
        let (l2, shrink) = match (h.decoupled, h.weight_decay > 0.0) {
            (false, _) => (h.weight_decay as f32, 1.0),
            (true, true) => (0.0, (1.0 - h.lr * h.weight_decay) as f32),
            (true, false) => (0.0, 1.0),
        };
        Adam {
            b1: h.beta1 as f32,
            b2: h.beta2 as f32,
            one_minus_b1: (1.0 - h.beta1) as f32,
            one_minus_b2: (1.0 - h.beta2) as f32,
            step_size: (h.lr / (1.0 - h.beta1.powi(h.t))) as f32,
            inv_correction2: 1.0 / correction2,
            eps: h.eps as f32,
            l2,
            shrink,
        }
    }

    /// The update over one chunk, with 256-bit vectors where the CPU has them (the build
    /// targets baseline x86-64; the square root and division dominate this loop).
    fn apply(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { self.apply_avx2(p, g, m, v) };
        }
        self.apply_plain(p, g, m, v)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn apply_avx2(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        self.apply_plain(p, g, m, v)
    }

    #[inline(always)]
    fn apply_plain(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let a = *self;
        if a.shrink != 1.0 {
            p.iter_mut().for_each(|p| *p *= a.shrink);
        }
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let g = if a.l2 != 0.0 { g + a.l2 * *p } else { g };
            *m = a.b1 * *m + a.one_minus_b1 * g;
            *v = a.b2 * *v + a.one_minus_b2 * g * g;
            *p -= a.step_size * (*m / (v.sqrt() * a.inv_correction2 + a.eps));
        }
    }
}

struct SgdOp<'a> {
    h: SgdStep,
    buffer: RefCell<&'a mut Vec<f32>>,
}

impl InplaceOp2 for SgdOp<'_> {
    fn name(&self) -> &'static str {
        "ddpjob-sgd"
    }

    fn cpu_fwd(
        &self,
        p: &mut CpuStorage,
        p_layout: &Layout,
        g: &CpuStorage,
        g_layout: &Layout,
    ) -> Result<()> {
        let p = param_values(p, p_layout)?;
        let g = values(g, g_layout)?;
        let h = self.h;
        let (lr, mu, wd) = (h.lr as f32, h.momentum as f32, h.weight_decay as f32);
        let mut buf = self.buffer.borrow_mut();
        let first = buf.is_empty();
        let states = if mu > 0.0 {
            if first {
                buf.resize(p.len(), 0.0);
            }
            if buf.len() != p.len() {
                candle_core::bail!("sgd: the momentum buffer does not match the parameter's size");
            }
            vec![&mut buf[..]]
        } else {
            Vec::new()
        };
        if g.len() != p.len() {
            candle_core::bail!("sgd: the gradient does not match the parameter's size");
        }
        for_chunks(p, g, states, |p, g, states| match states {
            [buf] => {
                for ((p, &g), buf) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
                    let g = g + wd * *p;
                    *buf = if first { g } else { mu * *buf + g };
                    *p -= lr * if h.nesterov { g + mu * *buf } else { *buf };
                }
            }
            _ => {
                for (p, &g) in p.iter_mut().zip(g) {
                    *p -= lr * (g + wd * *p);
                }
            }
        });
        Ok(())
    }
}
