//! RMSNorm as one op with its own backward, for the GPU, as the GPT's LayerNorm is
//! (`layer_norm::device`): from candle's ops it is six kernels forward and about a dozen in
//! backward, two RMSNorms a layer. A warp per row normalises in one pass; the backward is one
//! pass for the input's gradient plus a column sum for the weight's. The host version is the
//! reference the GPU's kernels are held to; on the CPU the model keeps its own fused op.

use crate::host::{self as kernels, rows_and_channels, values};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, bail};

/// `x / sqrt(mean(x²) + eps) · weight` over the last dimension of `x`, in f32; differentiable
/// in both.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    x.to_dtype(DType::F32)?.contiguous()?.apply_op2(
        &weight.to_dtype(DType::F32)?.contiguous()?,
        RmsNorm { eps: eps as f32 },
    )
}

#[derive(Debug, Clone, Copy)]
pub(super) struct RmsNorm {
    pub(super) eps: f32,
}

/// The backward's kernel: from x, the weight and the output's gradient, a [2, rows, C] tensor
/// holding the input's gradient and then gy · x / r (whose column sums are the weight's).
#[derive(Debug, Clone, Copy)]
pub(super) struct RmsNormGrad {
    pub(super) eps: f32,
}

/// A row's root mean square with `eps`, in the GPU kernel's order.
fn root_mean_square(x: &[f32], eps: f32) -> f32 {
    (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + eps).sqrt()
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "ddpjob-gpu-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, c) = rows_and_channels(lx, lw, "rms_norm")?;
        let (x, w) = (values(x, lx)?, values(w, lw)?);
        let mut y = vec![0f32; x.len()];
        for (x, y) in x.chunks_exact(c).zip(y.chunks_exact_mut(c)) {
            let r = root_mean_square(x, self.eps);
            for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                *y = x / r * w;
            }
        }
        Ok((CpuStorage::F32(y), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = super::cuda::run((x, lx), (w, lw), None, self.eps)?;
        Ok((y, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let both = x.apply_op3_no_bwd(weight, &grad, &RmsNormGrad { eps: self.eps })?;
        let c = weight.dim(0)?;
        let weight_grad = kernels::column_sums(&both.get(1)?, c)?;
        Ok((Some(both.get(0)?), Some(weight_grad)))
    }
}

impl CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "ddpjob-gpu-rms-norm-grad"
    }

    /// dx = (gy·w − x·mean(gy·w·x) / r²) / r, and gy·x / r.
    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        gy: &CpuStorage,
        lgy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, c) = rows_and_channels(lx, lw, "rms_norm")?;
        let (x, w, gy) = (values(x, lx)?, values(w, lw)?, values(gy, lgy)?);
        if gy.len() != x.len() {
            bail!("rms_norm gradient: {:?} for {:?}", lgy.shape(), lx.shape());
        }
        let mut out = vec![0f32; 2 * x.len()];
        let (dx, gx) = out.split_at_mut(x.len());
        for r in 0..rows {
            let span = r * c..(r + 1) * c;
            let (xr, gr) = (&x[span.clone()], &gy[span.clone()]);
            let rms = root_mean_square(xr, self.eps);
            let d = xr
                .iter()
                .zip(gr)
                .zip(w)
                .map(|((x, g), w)| g * w * x)
                .sum::<f32>()
                / c as f32;
            for j in 0..c {
                dx[span.start + j] = (gr[j] * w[j] - xr[j] / rms * d / rms) / rms;
                gx[span.start + j] = gr[j] * xr[j] / rms;
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((2, rows, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        gy: &candle_core::CudaStorage,
        lgy: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, c) = rows_and_channels(lx, lw, "rms_norm")?;
        if lgy.shape() != lx.shape() || !lgy.is_contiguous() {
            bail!("rms_norm gradient: {:?} for {:?}", lgy.shape(), lx.shape());
        }
        let out = super::cuda::run((x, lx), (w, lw), Some((gy, lgy)), self.eps)?;
        Ok((out, Shape::from((2, rows, c))))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::rms_norm;
    use crate::rms_norm::rms_norm_with_ops;

    /// Output and both gradients of `norm` on `device`, for fixed inputs.
    fn run(
        device: &Device,
        norm: fn(&Tensor, &Tensor, f64) -> candle_core::Result<Tensor>,
    ) -> Vec<Vec<f32>> {
        let (rows, c) = (37, 96);
        let on = |t: Tensor| t.to_device(device).unwrap();
        // Fixed values (candle's randn draws anew on every call).
        let values = |n: usize, seed: f32, mean: f32, spread: f32| {
            let v: Vec<f32> = (0..n)
                .map(|i| mean + spread * ((i as f32 * 0.7137 + seed).sin() * 43.758).fract())
                .collect();
            Tensor::new(v, &Device::Cpu).unwrap()
        };
        let x = Var::from_tensor(&on(values(rows * c, 1.0, 0.5, 3.0)
            .reshape((rows, c))
            .unwrap()))
        .unwrap();
        let w = Var::from_tensor(&on(values(c, 2.0, 1.0, 0.4))).unwrap();
        let gy = on(values(rows * c, 4.0, 0.0, 2.0).reshape((rows, c)).unwrap());
        let y = norm(&x, &w, 1e-6).unwrap();
        let grads = (&y * &gy).unwrap().sum_all().unwrap().backward().unwrap();
        let host = |t: &Tensor| -> Vec<f32> {
            let t = t
                .to_dtype(DType::F32)
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap();
            t.flatten_all().unwrap().to_vec1().unwrap()
        };
        vec![
            host(&y),
            host(grads.get(&x).unwrap()),
            host(grads.get(&w).unwrap()),
        ]
    }

    fn worst(a: &[f32], b: &[f32]) -> f32 {
        crate::host::worst_relative(a, b, 1.0)
    }

    /// The op and its gradients equal candle's ops' (the composed RMSNorm).
    #[test]
    fn matches_candles_ops_forward_and_backward() {
        let (fused, composed) = (
            run(&Device::Cpu, rms_norm),
            run(&Device::Cpu, rms_norm_with_ops),
        );
        for (what, (a, b)) in ["y", "dx", "dweight"]
            .iter()
            .zip(fused.iter().zip(&composed))
        {
            assert!(worst(a, b) < 2e-5, "{what}: {}", worst(a, b));
        }
    }

    /// Runs where a GPU is: the kernels give the host's values to f32 rounding.
    #[test]
    fn the_gpu_kernels_give_the_host_values() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        let (host, device) = (run(&Device::Cpu, rms_norm), run(&gpu, rms_norm));
        for (what, (a, b)) in ["y", "dx", "dweight"].iter().zip(host.iter().zip(&device)) {
            assert!(worst(a, b) < 2e-5, "{what}: {}", worst(a, b));
        }
    }
}
