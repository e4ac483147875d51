//! SwiGLU's gate, `silu(gate) · up`: one op on the CPU in f32 (`SwiGluOp`), one op with its
//! own kernels on a GPU (`device`, `cuda`), candle's `silu` and product elsewhere, which the
//! tests hold the fused forms to.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod device;

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use crate::host::{self as kernels, values, with_values};
use crate::rows::exp;

/// `silu(gate) · up` for tensors of one shape.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if kernels::applies(gate) && kernels::applies(up) {
        return gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGluOp);
    }
    if device::applies(gate, up) {
        return device::swiglu(gate, up);
    }
    gate.silu()? * up
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

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use crate::testing::random;
    use crate::testing::same_with_gradients;

    #[test]
    fn the_fused_op_matches_candles_ops_with_gradients() {
        let (gate, up) = (random(&[9, 700], 0.0, 3), random(&[9, 700], 0.0, 4));
        same_with_gradients(
            &[gate, up],
            |t| super::swiglu(t[0], t[1]).unwrap(),
            |t| (t[0].silu().unwrap() * t[1]).unwrap(),
            1e-5,
        );
        // Off the CPU's f32 candle's ops compute it.
        let half = Tensor::ones((2, 4), DType::BF16, &Device::Cpu).unwrap();
        let y = super::swiglu(&half, &half).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
    }
}
