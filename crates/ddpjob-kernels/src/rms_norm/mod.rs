//! RMSNorm (`LlamaRMSNorm`) over the last dimension, in f32: one op on the CPU in f32 (forward
//! and backward a pass over the values, `RmsNormOp`), one op with its own kernels on a GPU
//! (`device`, `cuda`), candle's composed ops elsewhere (bf16 on the CPU), which the tests hold
//! the fused forms to. Composed from candle's ops it costs a dozen tensors in the backward,
//! which on a 30-layer model takes longer than the matrix products.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod device;

use candle_core::{CpuStorage, CustomOp2, D, DType, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use crate::host::{self as kernels, values, with_values};

/// Rows handed to one rayon task.
const ROWS_PER_TASK: usize = 32;

/// `x * rsqrt(mean(x²) + eps) * weight` over the last dimension, in f32 (`LlamaRMSNorm`).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if kernels::applies(x) {
        return x
            .contiguous()?
            .apply_op2(&weight.contiguous()?, RmsNormOp { eps: eps as f32 });
    }
    if x.device().is_cuda() {
        return device::rms_norm(x, weight, eps);
    }
    rms_norm_with_ops(x, weight, eps)
}

/// [`rms_norm`] composed from candle's ops (bf16 on the CPU; the fused ops' reference).
pub fn rms_norm_with_ops(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(mean_square + eps)?.sqrt()?)?
        .broadcast_mul(weight)
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

#[cfg(test)]
mod tests {
    use crate::testing::random;
    use crate::testing::same_with_gradients;

    use super::{rms_norm, rms_norm_with_ops};

    #[test]
    fn the_fused_op_matches_candles_ops_with_gradients() {
        let (x, w) = (random(&[70, 24], 0.0, 1), random(&[24], 1.0, 2));
        same_with_gradients(
            &[x, w],
            |t| rms_norm(t[0], t[1], 1e-5).unwrap(),
            |t| rms_norm_with_ops(t[0], t[1], 1e-5).unwrap(),
            1e-4,
        );
    }
}
