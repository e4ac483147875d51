//! LayerNorm, GELU and causal softmax with gradients. candle-nn 0.11's fused `layer_norm` and
//! `softmax_last_dim` have no backward (they are applied with `apply_op*_no_bwd`), and candle's
//! GELU backward is a dozen tensor ops. For f32 on the CPU, LayerNorm and GELU here are one op
//! each (forward and backward one pass over the values); on a GPU LayerNorm, GELU and the
//! causal softmax are one op each too (`layer_norm_gpu`, `gelu_cuda`, `causal_softmax`);
//! elsewhere (bf16 on the CPU) they are composed from candle's differentiable ops, which the
//! tests check the fused ones against.

use candle_core::{
    CpuStorage, CustomOp1, CustomOp3, D, DType, Layout, Result, Shape, Tensor, bail,
};
use rayon::prelude::*;

use ddpjob_kernels as kernels;

/// LayerNorm over the last dimension: `(x - mean) / sqrt(var + eps) · gain + bias`, computed
/// in f32 whatever the dtype of `x` (as torch's autocast does); the result is f32. One op on
/// the CPU in f32 (here) and on a GPU (`layer_norm_gpu`), candle's ops otherwise.
pub fn layer_norm(x: &Tensor, gain: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if kernels::applies(x) {
        return x
            .contiguous()?
            .apply_op3(gain, bias, LayerNormOp { eps: eps as f32 });
    }
    if x.device().is_cuda() {
        return super::layer_norm_gpu::layer_norm(x, gain, bias, eps);
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

/// `softmax(scale · att + causal mask)` over the last dimension of `att` [b, tq, tk], where
/// query row i sits at position `offset + i` and sees keys 0..=offset + i, from candle's ops
/// (the fused CPU attention has its own; on a GPU one op, `causal_softmax`). Computed in f32,
/// returned in the dtype of `att`.
/// `mask` is the [block, block] additive mask: 0 on and below the diagonal, -inf above.
pub fn causal_softmax_with_ops(
    att: &Tensor,
    scale: f64,
    offset: usize,
    mask: &Tensor,
) -> Result<Tensor> {
    if att.device().is_cuda() {
        return super::causal_softmax::causal_softmax(att, scale, offset);
    }
    let (_, tq, tk) = att.dims3()?;
    let mask = mask.narrow(0, offset, tq)?.narrow(1, 0, tk)?;
    let scores = (att.to_dtype(DType::F32)? * scale)?.broadcast_add(&mask)?;
    candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(att.dtype())
}

/// The MLP's GELU: nanoGPT's exact one (`transformers`' `"gelu"`) or GPT-2's tanh
/// approximation (`"gelu_new"`, what OpenAI's weights were trained with).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Activation {
    #[default]
    #[serde(rename = "gelu")]
    Gelu,
    #[serde(rename = "gelu_new")]
    GeluNew,
}

impl Activation {
    /// Its name in job files and `config.json`.
    pub fn name(self) -> &'static str {
        match self {
            Activation::Gelu => "gelu",
            Activation::GeluNew => "gelu_new",
        }
    }

    /// y = GELU(x) over rows of f32 values.
    pub(super) fn apply(self, x: &[f32], y: &mut [f32]) {
        match self {
            Activation::Gelu => simd::gelu(x, y),
            Activation::GeluNew => simd::gelu_tanh(x, y),
        }
    }

    /// y = GELU(x), and x replaced by GELU's slope there.
    pub(super) fn apply_keeping_slope(self, x: &mut [f32], y: &mut [f32]) {
        match self {
            Activation::Gelu => simd::gelu_and_slope(x, y),
            Activation::GeluNew => simd::gelu_tanh_and_slope(x, y),
        }
    }

    /// dx = g · GELU'(x).
    fn grad(self, x: &[f32], g: &[f32], dx: &mut [f32]) {
        match self {
            Activation::Gelu => simd::gelu_grad(x, g, dx),
            Activation::GeluNew => simd::gelu_tanh_grad(x, g, dx),
        }
    }
}

/// GELU of `activation`'s form: one op on the CPU for f32 and on a GPU (`gelu_cuda`),
/// candle's `gelu_erf` / `gelu` (its tanh form) elsewhere.
pub fn gelu(x: &Tensor, activation: Activation) -> Result<Tensor> {
    if kernels::applies(x) || x.device().is_cuda() {
        return x.contiguous()?.apply_op1(GeluOp(activation));
    }
    match activation {
        Activation::Gelu => x.gelu_erf(),
        Activation::GeluNew => x.gelu(),
    }
}

/// The row loops, where the GPT's ops and layers reach them.
pub(super) use super::rows::{exp, max, simd, sum_map};
/// The kernels' accessors of f32 CPU values, shared by the GPT's ops.
pub(super) use ddpjob_kernels::{values, with_values};

/// Rows handed to one rayon task: below this a fork costs more than it saves.
const ROWS_PER_TASK: usize = 64;

/// LayerNorm of the rows of `x` (`gain.len()` values each) into `y`, [`ROWS_PER_TASK`] rows
/// to a rayon task.
pub(super) fn layer_norm_into(x: &[f32], gain: &[f32], bias: &[f32], eps: f32, y: &mut [f32]) {
    let chunk = gain.len() * ROWS_PER_TASK;
    y.par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk))
        .for_each(|(y, x)| simd::layer_norm(x, gain, bias, eps, y));
}

/// The backward of [`layer_norm_into`] (output gradient `gy`) into `dx`, added to it when
/// `accumulate`; returns the gain's and the bias's gradients, summed per block of rows and
/// then in block order (the same values whatever the number of threads).
pub(super) fn layer_norm_bwd_into(
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

struct GeluOp(Activation);

/// Elements handed to one rayon task by the elementwise ops.
const ELEMENTS_PER_TASK: usize = 1 << 14;

impl CustomOp1 for GeluOp {
    fn name(&self) -> &'static str {
        match self.0 {
            Activation::Gelu => "ddpjob-gpt-gelu",
            Activation::GeluNew => "ddpjob-gpt-gelu-new",
        }
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = values(storage, layout)?;
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(ELEMENTS_PER_TASK)
            .zip(x.par_chunks(ELEMENTS_PER_TASK))
            .for_each(|(y, x)| self.0.apply(x, y));
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = super::gelu_cuda::apply(self.0, (storage, layout), None)?;
        Ok((y, layout.shape().clone()))
    }

    /// dx = g · GELU'(x).
    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if !x.device().is_cpu() {
            let grad = grad.to_dtype(x.dtype())?.contiguous()?;
            return Ok(Some(x.apply_op2_no_bwd(&grad, &GeluGrad(self.0))?));
        }
        let mut dx = vec![0f32; x.elem_count()];
        with_values(x, |x| {
            with_values(grad, |g| {
                dx.par_chunks_mut(ELEMENTS_PER_TASK)
                    .zip(x.par_chunks(ELEMENTS_PER_TASK))
                    .zip(g.par_chunks(ELEMENTS_PER_TASK))
                    .for_each(|((dx, x), g)| self.0.grad(x, g, dx));
                Ok(())
            })
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

/// GELU's backward as an op of its own (x, g) → g · GELU'(x), for the GPU (`gelu_cuda`); the
/// host version is the reference its kernel is held to.
struct GeluGrad(Activation);

impl candle_core::CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "ddpjob-gpt-gelu-grad"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, g) = (values(x, lx)?, values(g, lg)?);
        if x.len() != g.len() {
            bail!("gelu gradient: {:?} for {:?}", lg.shape(), lx.shape());
        }
        let mut dx = vec![0f32; x.len()];
        self.0.grad(x, g, &mut dx);
        Ok((CpuStorage::F32(dx), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dx = super::gelu_cuda::apply(self.0, (x, lx), Some((g, lg)))?;
        Ok((dx, lx.shape().clone()))
    }
}
