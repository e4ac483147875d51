//! GELU and its gradient, of the two forms GPT models use (exact, and GPT-2's tanh
//! approximation): one op each way for f32 on the CPU (a pass over the values, the SIMD row
//! loops of [`crate::rows`]) and on a GPU (`cuda`: an elementwise kernel each, f32 or bf16
//! values); candle's `gelu_erf` / `gelu` elsewhere, which the tests hold the fused forms to.
//! candle's GELU backward is a dozen tensor ops.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use crate::host::{self as kernels, values, with_values};
use crate::rows::simd;

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
    pub fn apply(self, x: &[f32], y: &mut [f32]) {
        match self {
            Activation::Gelu => simd::gelu(x, y),
            Activation::GeluNew => simd::gelu_tanh(x, y),
        }
    }

    /// y = GELU(x), and x replaced by GELU's slope there.
    pub fn apply_keeping_slope(self, x: &mut [f32], y: &mut [f32]) {
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

/// GELU of `activation`'s form: one op on the CPU for f32 and on a GPU (`cuda`),
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
        let y = cuda::apply(self.0, (storage, layout), None)?;
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

/// GELU's backward as an op of its own (x, g) → g · GELU'(x), for the GPU (`cuda`); the
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
        let dx = cuda::apply(self.0, (x, lx), Some((g, lg)))?;
        Ok((dx, lx.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::{Activation, gelu};
    use crate::testing::random;
    use crate::testing::same_with_gradients;

    #[test]
    fn matches_torch() {
        let dev = Device::Cpu;
        // torch.nn.functional.gelu(torch.tensor([1., -1.])) (exact erf form), torch 2.x.
        let x = Tensor::new(&[1f32, -1.], &dev).unwrap();
        let want = Tensor::new(&[0.841_344_7f32, -0.158_655_3], &dev).unwrap();
        for y in [x.gelu_erf().unwrap(), gelu(&x, Activation::Gelu).unwrap()] {
            assert!(crate::testing::max_difference(&y, &want) < 1e-6);
        }
        // torch.nn.functional.gelu(x, approximate="tanh") (transformers' gelu_new), torch 2.15:
        // both far tails, the middle, and the fused op against it.
        let x = Tensor::new(&[1f32, -1., 3., -0.1, -12., 12.], &dev).unwrap();
        let want = [
            0.841_192f32,
            -0.158_808,
            2.996_363_7,
            -0.046_017_2,
            0.0,
            12.0,
        ];
        let fused = gelu(&x, Activation::GeluNew).unwrap();
        let want = Tensor::new(&want, &dev).unwrap();
        assert!(
            crate::testing::max_difference(&fused, &want) < 1e-6,
            "{fused}"
        );
    }

    #[test]
    fn the_fused_ops_match_candles_with_gradients() {
        same_with_gradients(
            &[random(&[3, 700], 0.0, 11)],
            |t| gelu(t[0], Activation::Gelu).unwrap(),
            |t| t[0].gelu_erf().unwrap(),
            1e-4,
        );
        same_with_gradients(
            &[random(&[3, 700], 0.0, 12)],
            |t| gelu(t[0], Activation::GeluNew).unwrap(),
            |t| t[0].gelu().unwrap(),
            1e-4,
        );
    }
}
