//! RMSNorm, rotary position embeddings and SwiGLU's gate as one op each on the CPU in f32
//! (forward and backward a pass over the values), as the GPT's LayerNorm and GELU are. Composed
//! from candle's ops they cost a dozen tensors each in the backward, which on a 30-layer model
//! takes longer than the matrix products; elsewhere (bf16; RoPE and SwiGLU on a GPU, whose
//! RMSNorm is `rms_norm_gpu`'s) the composed forms run, and the tests check the fused ones
//! against them.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use crate::gpt::rows::exp;
use ddpjob_kernels::{self as kernels, values, with_values};

/// Rows handed to one rayon task.
const ROWS_PER_TASK: usize = 32;

/// `x · rsqrt(mean(x²) + eps) · weight` over the last dimension of f32 `x` on the CPU
/// (`LlamaRMSNorm`); `None` elsewhere, for the composed form.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Option<Result<Tensor>> {
    kernels::applies(x).then(|| {
        x.contiguous()?
            .apply_op2(&weight.contiguous()?, RmsNormOp { eps: eps as f32 })
    })
}

/// `silu(gate) · up` for f32 tensors of one shape on the CPU; `None` elsewhere.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Option<Result<Tensor>> {
    (kernels::applies(gate) && kernels::applies(up))
        .then(|| gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGluOp))
}

/// `x · cos + rotate_half(x) · sin` for f32 `x` [n, t, heads, head_dim] on the CPU, with the
/// tables' rows `offset..offset + t`; `None` elsewhere.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, offset: usize) -> Option<Result<Tensor>> {
    kernels::applies(x).then(|| {
        let (_, t, _, hd) = x.dims4()?;
        let table =
            |m: &Tensor| -> Result<Vec<f32>> { m.narrow(0, offset, t)?.flatten_all()?.to_vec1() };
        let op = RopeOp {
            cos: table(cos)?,
            sin: table(sin)?,
            t,
            hd,
        };
        x.contiguous()?.apply_op1(op)
    })
}

struct RmsNormOp {
    eps: f32,
}

/// 1 / √(mean(x²) + eps) of one row.
fn inverse_rms(row: &[f32], eps: f32) -> f32 {
    let mean = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
    1.0 / (mean + eps).sqrt()
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "ddpjob-llama-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let c = x_layout.shape().dims().last().copied().unwrap_or(0);
        if w_layout.shape().dims1()? != c || c == 0 {
            bail!(
                "rms_norm: input {:?}, weight {:?}",
                x_layout.shape(),
                w_layout.shape()
            );
        }
        let (x, w) = (values(x, x_layout)?, values(w, w_layout)?);
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(c * ROWS_PER_TASK)
            .zip(x.par_chunks(c * ROWS_PER_TASK))
            .for_each(|(y, x)| {
                for (y, x) in y.chunks_exact_mut(c).zip(x.chunks_exact(c)) {
                    let r = inverse_rms(x, self.eps);
                    for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                        *y = x * r * w;
                    }
                }
            });
        Ok((CpuStorage::F32(y), x_layout.shape().clone()))
    }

    /// With r = 1/rms and gw = g·w: dx = r·gw − x·r³·Σ(gw·x)/C; dw = Σ over rows of g·x·r.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let c = w.elem_count();
        let mut dx = vec![0f32; x.elem_count()];
        let dw = with_values(x, |x| {
            with_values(w, |w| {
                with_values(grad, |g| {
                    let parts: Vec<Vec<f32>> = dx
                        .par_chunks_mut(c * ROWS_PER_TASK)
                        .zip(x.par_chunks(c * ROWS_PER_TASK))
                        .zip(g.par_chunks(c * ROWS_PER_TASK))
                        .map(|((dx, x), g)| {
                            let mut dw = vec![0f32; c];
                            for ((dx, x), g) in dx
                                .chunks_exact_mut(c)
                                .zip(x.chunks_exact(c))
                                .zip(g.chunks_exact(c))
                            {
                                let r = inverse_rms(x, self.eps);
                                let dot: f32 =
                                    g.iter().zip(w).zip(x).map(|((g, w), x)| g * w * x).sum();
                                let k = r * r * r * dot / c as f32;
                                for i in 0..c {
                                    dx[i] = r * g[i] * w[i] - x[i] * k;
                                    dw[i] += g[i] * x[i] * r;
                                }
                            }
                            dw
                        })
                        .collect();
                    let mut dw = vec![0f32; c];
                    for part in parts {
                        dw.iter_mut().zip(part).for_each(|(d, p)| *d += p);
                    }
                    Ok(dw)
                })
            })
        })?;
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), x.device())?),
            Some(Tensor::from_vec(dw, c, x.device())?),
        ))
    }
}

struct SwiGluOp;

/// σ(x).
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

impl CustomOp2 for SwiGluOp {
    fn name(&self) -> &'static str {
        "ddpjob-llama-swiglu"
    }

    fn cpu_fwd(
        &self,
        gate: &CpuStorage,
        gate_layout: &Layout,
        up: &CpuStorage,
        up_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if gate_layout.shape() != up_layout.shape() {
            bail!(
                "swiglu: gate {:?}, up {:?}",
                gate_layout.shape(),
                up_layout.shape()
            );
        }
        let (gate, up) = (values(gate, gate_layout)?, values(up, up_layout)?);
        let mut y = vec![0f32; gate.len()];
        y.par_chunks_mut(1 << 14)
            .zip(gate.par_chunks(1 << 14))
            .zip(up.par_chunks(1 << 14))
            .for_each(|((y, gate), up)| {
                for ((y, &a), &b) in y.iter_mut().zip(gate).zip(up) {
                    *y = a * sigmoid(a) * b;
                }
            });
        Ok((CpuStorage::F32(y), gate_layout.shape().clone()))
    }

    /// d gate = g·up·σ(a)(1 + a(1 − σ(a))), d up = g·silu(a).
    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = gate.elem_count();
        let (mut d_gate, mut d_up) = (vec![0f32; n], vec![0f32; n]);
        with_values(gate, |a| {
            with_values(up, |b| {
                with_values(grad, |g| {
                    d_gate
                        .par_chunks_mut(1 << 14)
                        .zip(d_up.par_chunks_mut(1 << 14))
                        .zip(a.par_chunks(1 << 14))
                        .zip(b.par_chunks(1 << 14).zip(g.par_chunks(1 << 14)))
                        .for_each(|(((dg, du), a), (b, g))| {
                            for i in 0..a.len() {
                                let s = sigmoid(a[i]);
                                dg[i] = g[i] * b[i] * s * (1.0 + a[i] * (1.0 - s));
                                du[i] = g[i] * a[i] * s;
                            }
                        });
                    Ok(())
                })
            })
        })?;
        Ok((
            Some(Tensor::from_vec(d_gate, gate.shape(), gate.device())?),
            Some(Tensor::from_vec(d_up, up.shape(), up.device())?),
        ))
    }
}

struct RopeOp {
    /// [t, head_dim] each: the positions' cos and sin (or one row per token of the input,
    /// `t` = n·t, for packed rows whose positions restart).
    cos: Vec<f32>,
    sin: Vec<f32>,
    t: usize,
    hd: usize,
}

/// [`rope`] of `x` [n, t, heads, head_dim] with a table row per token (`cos`, `sin`:
/// [n·t, head_dim], the rows of each token's own position): packed rows (see
/// `models::packed`). f32 on the CPU; `None` elsewhere.
pub fn rope_per_token(x: &Tensor, cos: Vec<f32>, sin: Vec<f32>) -> Option<Result<Tensor>> {
    kernels::applies(x).then(|| {
        let (n, t, _, hd) = x.dims4()?;
        let op = RopeOp {
            cos,
            sin,
            t: n * t,
            hd,
        };
        x.contiguous()?.apply_op1(op)
    })
}

impl RopeOp {
    /// Rotates (`sign` 1) or rotates back (`sign` −1, the backward: the transpose of the
    /// rotation) every head of `x` [n, t, heads, hd] into `y`.
    fn rotate(&self, x: &[f32], y: &mut [f32], heads: usize, sign: f32) {
        let (hd, half) = (self.hd, self.hd / 2);
        y.par_chunks_mut(heads * hd)
            .zip(x.par_chunks(heads * hd))
            .enumerate()
            .for_each(|(row, (y, x))| {
                let p = row % self.t;
                let (cos, sin) = (&self.cos[p * hd..][..hd], &self.sin[p * hd..][..hd]);
                for (y, x) in y.chunks_exact_mut(hd).zip(x.chunks_exact(hd)) {
                    for i in 0..half {
                        let (a, b) = (x[i], x[i + half]);
                        // Forward: y1 = a·c1 − b·s1, y2 = b·c2 + a·s2. Backward (transpose):
                        // dx1 = g1·c1 + g2·s2, dx2 = g2·c2 − g1·s1.
                        if sign > 0.0 {
                            y[i] = a * cos[i] - b * sin[i];
                            y[i + half] = b * cos[i + half] + a * sin[i + half];
                        } else {
                            y[i] = a * cos[i] + b * sin[i + half];
                            y[i + half] = b * cos[i + half] - a * sin[i];
                        }
                    }
                }
            });
    }
}

impl CustomOp1 for RopeOp {
    fn name(&self) -> &'static str {
        "ddpjob-llama-rope"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = layout.shape().dims();
        let fits = dims.len() == 4 && (dims[1] == self.t || dims[0] * dims[1] == self.t);
        if !fits
            || dims[3] != self.hd
            || !self.hd.is_multiple_of(2)
            || self.cos.len() != self.t * self.hd
        {
            bail!(
                "rope: input {:?}, tables of {} positions x {}",
                layout.shape(),
                self.t,
                self.hd
            );
        }
        let x = values(storage, layout)?;
        let mut y = vec![0f32; x.len()];
        self.rotate(x, &mut y, dims[2], 1.0);
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut dx = vec![0f32; x.elem_count()];
        let heads = x.dims4()?.2;
        with_values(grad, |g| {
            self.rotate(g, &mut dx, heads, -1.0);
            Ok(())
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::super::rms_norm_with_ops;
    use super::super::rope::{RopeTables, inverse_frequencies};

    /// The values and the gradients of every input of `fused` and `composed` (of the same
    /// inputs), under an uneven weighting of the outputs, differ by less than `tol`.
    fn same_with_gradients(
        inputs: &[Var],
        fused: impl Fn(&[&Tensor]) -> Tensor,
        composed: impl Fn(&[&Tensor]) -> Tensor,
        tol: f32,
    ) {
        let run = |f: &dyn Fn(&[&Tensor]) -> Tensor| {
            let xs: Vec<&Tensor> = inputs.iter().map(|v| v.as_tensor()).collect();
            let y = f(&xs);
            let grads = ddpjob_kernels::uneven_sum(&y).backward().unwrap();
            let mut all = vec![y.flatten_all().unwrap().to_vec1::<f32>().unwrap()];
            for v in inputs {
                let g = grads
                    .get(v.as_tensor())
                    .expect("a gradient for every input");
                all.push(g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            }
            all
        };
        for (i, (a, b)) in run(&fused).iter().zip(run(&composed)).enumerate() {
            let diff = a
                .iter()
                .zip(&b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                diff < tol,
                "output {i} (0: values, then each input's gradient) differs by {diff}"
            );
        }
    }

    fn random(shape: &[usize], mean: f32, seed: u64) -> Var {
        let mut rng = ddpjob_rng::Mt19937::new(seed);
        let n = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| mean + rng.normal()).collect();
        Var::from_tensor(&Tensor::from_vec(values, shape, &Device::Cpu).unwrap()).unwrap()
    }

    #[test]
    fn rope_at_each_tokens_own_position_matches_candle_ops_with_gradients() {
        let dev = &Device::Cpu;
        let tables = RopeTables::new(&inverse_frequencies(8, 10_000.0, None), 16, dev).unwrap();
        // 2 rows of 5 positions, 3 heads of 8: packed examples restart their positions.
        let positions = Tensor::new(&[0u32, 1, 2, 0, 1, 0, 1, 2, 3, 4], dev).unwrap();
        let values: Vec<f32> = (0..2 * 5 * 3 * 8).map(|i| (i as f32 * 0.3).cos()).collect();
        let x = Var::from_tensor(&Tensor::from_vec(values, (2, 5, 3, 8), dev).unwrap()).unwrap();
        same_with_gradients(
            &[x],
            |v| tables.apply_at(v[0], &positions).unwrap(),
            |v| tables.apply_at_with_ops(v[0], &positions).unwrap(),
            1e-6,
        );
    }

    #[test]
    fn fused_rms_norm_swiglu_and_rope_match_candle_ops_with_gradients() {
        let (x, w) = (random(&[70, 24], 0.0, 1), random(&[24], 1.0, 2));
        same_with_gradients(
            &[x, w],
            |t| super::rms_norm(t[0], t[1], 1e-5).unwrap().unwrap(),
            |t| rms_norm_with_ops(t[0], t[1], 1e-5).unwrap(),
            1e-4,
        );
        let (gate, up) = (random(&[9, 700], 0.0, 3), random(&[9, 700], 0.0, 4));
        same_with_gradients(
            &[gate, up],
            |t| super::swiglu(t[0], t[1]).unwrap().unwrap(),
            |t| (t[0].silu().unwrap() * t[1]).unwrap(),
            1e-5,
        );
        let rope =
            RopeTables::new(&inverse_frequencies(8, 10_000.0, None), 12, &Device::Cpu).unwrap();
        for offset in [0, 3] {
            let x = random(&[2, 9, 3, 8], 0.0, 5 + offset as u64);
            same_with_gradients(
                &[x],
                |t| rope.apply(t[0], offset).unwrap(),
                |t| rope.apply_with_ops(t[0], offset).unwrap(),
                1e-5,
            );
        }
        // Off the CPU's f32 the fused forms step aside.
        let half = Tensor::zeros((2, 4), DType::BF16, &Device::Cpu).unwrap();
        assert!(super::swiglu(&half, &half).is_none());
    }
}
