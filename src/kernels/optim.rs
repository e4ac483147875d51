//! One-pass optimizer updates: torch.optim's Adam, AdamW and SGD formulas applied per element,
//! the parameter updated in place and the new moment buffers written once, where candle's
//! tensor ops would make a dozen passes with a fresh tensor each.

use std::cell::RefCell;

use candle_core::{CpuStorage, InplaceOp2, Layout, Result, Tensor};
use rayon::prelude::*;

use super::{threads, values};

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
        let h = self.h;
        let (b1, b2) = (h.beta1 as f32, h.beta2 as f32);
        let step_size = (h.lr / (1.0 - h.beta1.powi(h.t))) as f32;
        let correction2 = (1.0 - h.beta2.powi(h.t)).sqrt() as f32;
        let (eps, wd) = (h.eps as f32, h.weight_decay as f32);
        let shrink = (1.0 - h.lr * h.weight_decay) as f32;
        for_chunks(p, g, vec![&mut m[..], &mut v[..]], |p, g, states| {
            let [m, v] = states else { return };
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let g = if h.decoupled {
                    *p *= shrink;
                    g
                } else {
                    g + wd * *p
                };
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                *p -= step_size * (*m / (v.sqrt() / correction2 + eps));
            }
        });
        Ok(())
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
