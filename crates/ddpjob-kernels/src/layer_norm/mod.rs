//! LayerNorm over the last dimension with its gradients, in f32: one op on the CPU in f32
//! (forward and backward one pass over the values; the rows also reached by the GPT's
//! hand-written pass, [`layer_norm_into`]), one op with its own kernels on a GPU (`device`,
//! `cuda`), candle's differentiable ops elsewhere (bf16 on the CPU), which the tests hold the
//! fused forms to. candle-nn 0.11's fused `layer_norm` has no backward.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod device;

use candle_core::{CpuStorage, CustomOp3, D, DType, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use crate::host::{self as kernels, values, with_values};
use crate::rows::simd;

/// LayerNorm over the last dimension: `(x - mean) / sqrt(var + eps) · gain + bias`, computed
/// in f32 whatever the dtype of `x` (as torch's autocast does); the result is f32. One op on
/// the CPU in f32 (here) and on a GPU (`device`), candle's ops otherwise.
pub fn layer_norm(x: &Tensor, gain: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if kernels::applies(x) {
        return x
            .contiguous()?
            .apply_op3(gain, bias, LayerNormOp { eps: eps as f32 });
    }
    if x.device().is_cuda() {
        return device::layer_norm(x, gain, bias, eps);
    }
    layer_norm_with_ops(x, gain, bias, eps)
}

/// [`layer_norm`] from candle's differentiable ops, for any device and dtype.
pub fn layer_norm_with_ops(x: &Tensor, gain: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    centred
        .broadcast_div(&(var + eps)?.sqrt()?)?
        .broadcast_mul(gain)?
        .broadcast_add(bias)
}

/// Rows handed to one rayon task: below this a fork costs more than it saves.
const ROWS_PER_TASK: usize = 64;

/// LayerNorm of the rows of `x` (`gain.len()` values each) into `y`, `ROWS_PER_TASK` rows
/// to a rayon task.
pub fn layer_norm_into(x: &[f32], gain: &[f32], bias: &[f32], eps: f32, y: &mut [f32]) {
    let chunk = gain.len() * ROWS_PER_TASK;
    y.par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk))
        .for_each(|(y, x)| simd::layer_norm(x, gain, bias, eps, y));
}

/// The backward of [`layer_norm_into`] (output gradient `gy`) into `dx`, added to it when
/// `accumulate`; returns the gain's and the bias's gradients, summed per block of rows and
/// then in block order (the same values whatever the number of threads).
pub fn layer_norm_bwd_into(
    x: &[f32],
    gy: &[f32],
    gain: &[f32],
    eps: f32,
    dx: &mut [f32],
    accumulate: bool,
) -> (Vec<f32>, Vec<f32>) {
    let c = gain.len();
    let chunk = c * ROWS_PER_TASK;
    let parts: Vec<(Vec<f32>, Vec<f32>)> = dx
        .par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk))
        .zip(gy.par_chunks(chunk))
        .map(|((dx, x), gy)| {
            let (mut dg, mut db) = (vec![0f32; c], vec![0f32; c]);
            simd::layer_norm_bwd(x, gy, gain, eps, dx, accumulate, (&mut dg, &mut db));
            (dg, db)
        })
        .collect();
    let (mut dg, mut db) = (vec![0f32; c], vec![0f32; c]);
    for (pg, pb) in parts {
        dg.iter_mut().zip(pg).for_each(|(d, p)| *d += p);
        db.iter_mut().zip(pb).for_each(|(d, p)| *d += p);
    }
    (dg, db)
}

struct LayerNormOp {
    eps: f32,
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "ddpjob-gpt-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        g: &CpuStorage,
        g_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let c = x_layout.shape().dims().last().copied().unwrap_or(0);
        if g_layout.shape().dims1()? != c || b_layout.shape().dims1()? != c || c == 0 {
            bail!(
                "layer_norm: input {:?}, gain {:?}",
                x_layout.shape(),
                g_layout.shape()
            );
        }
        let (x, g, b) = (
            values(x, x_layout)?,
            values(g, g_layout)?,
            values(b, b_layout)?,
        );
        let mut y = vec![0f32; x.len()];
        layer_norm_into(x, g, b, self.eps, &mut y);
        Ok((CpuStorage::F32(y), x_layout.shape().clone()))
    }

    /// See [`layer_norm_bwd_into`].
    fn bwd(
        &self,
        x: &Tensor,
        gain: &Tensor,
        _bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let c = gain.dim(0)?;
        let mut dx = vec![0f32; x.elem_count()];
        let (dg, db) = with_values(x, |x| {
            with_values(gain, |gain| {
                with_values(grad, |gy| {
                    Ok(layer_norm_bwd_into(x, gy, gain, self.eps, &mut dx, false))
                })
            })
        })?;
        let device = x.device();
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), device)?),
            Some(Tensor::from_vec(dg, c, device)?),
            Some(Tensor::from_vec(db, c, device)?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::{layer_norm, layer_norm_with_ops};
    use crate::testing::random;
    use crate::testing::same_with_gradients;

    #[test]
    fn matches_torch() {
        // torch.nn.functional.layer_norm(torch.tensor([1., 2., 3., 4.]), (4,)), torch 2.x.
        let dev = Device::Cpu;
        let x = Tensor::new(&[[1f32, 2., 3., 4.]], &dev).unwrap();
        let (g, b) = (
            Tensor::ones(4, DType::F32, &dev).unwrap(),
            Tensor::zeros(4, DType::F32, &dev).unwrap(),
        );
        let want = Tensor::new(&[[-1.3416f32, -0.4472, 0.4472, 1.3416]], &dev).unwrap();
        for y in [
            layer_norm(&x, &g, &b, 1e-5).unwrap(),
            layer_norm_with_ops(&x, &g, &b, 1e-5).unwrap(),
        ] {
            assert!(crate::testing::max_difference(&y, &want) < 1e-4);
        }
    }

    #[test]
    fn the_fused_op_matches_candles_ops_with_gradients() {
        let gain = Var::from_tensor(&(random(&[16], 1.0, 7).as_tensor() * 0.5).unwrap()).unwrap();
        let bias = Var::from_tensor(&(random(&[16], 0.0, 8).as_tensor() * 0.5).unwrap()).unwrap();
        same_with_gradients(
            &[random(&[70, 16], 0.0, 9), gain, bias],
            |t| layer_norm(t[0], t[1], t[2], 1e-5).unwrap(),
            |t| layer_norm_with_ops(t[0], t[1], t[2], 1e-5).unwrap(),
            1e-4,
        );
    }
}
