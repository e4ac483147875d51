//! LayerNorm as one op with its own backward, for the GPU. From candle's ops it is ten kernels
//! forward (six of them passes over the whole [rows, C] input) and about fifteen in backward,
//! 13 LayerNorms a step of the shakespeare-char recipe (ncu on an H200, 2026-11-26: 35 to
//! 60 µs a pass). Here a warp per row normalises in one pass; the backward is one pass for the
//! input's gradient plus two column sums (the gain's and bias's). The host version is the
//! reference the GPU's kernels are held to; on the CPU the model keeps its own fused op.

use crate::host::{self as kernels, rows_and_channels, values};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, bail};

/// LayerNorm over the last dimension of `x` (f32 on a GPU): `(x - mean) / sqrt(var + eps) ·
/// gain + bias`, f32; differentiable in all three.
pub fn layer_norm(x: &Tensor, gain: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    x.to_dtype(DType::F32)?.contiguous()?.apply_op3(
        &gain.to_dtype(DType::F32)?.contiguous()?,
        &bias.to_dtype(DType::F32)?.contiguous()?,
        LayerNorm { eps: eps as f32 },
    )
}

#[derive(Debug, Clone, Copy)]
pub(super) struct LayerNorm {
    pub(super) eps: f32,
}

/// The backward's kernel: from x, the gain and the output's gradient, a [2, rows, C] tensor
/// holding the input's gradient and then the output's gradient times x̂ (whose column sums
/// are the gain's gradient).
#[derive(Debug, Clone, Copy)]
pub(super) struct LayerNormGrad {
    pub(super) eps: f32,
}

/// A row's mean and its standard deviation with `eps`, in the GPU kernel's order.
fn moments(x: &[f32], eps: f32) -> (f32, f32) {
    let c = x.len() as f32;
    let mean = x.iter().sum::<f32>() / c;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / c;
    (mean, (var + eps).sqrt())
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "ddpjob-gpu-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        g: &CpuStorage,
        lg: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, c) = rows_and_channels(lx, lg, "layer_norm")?;
        let (x, g, b) = (values(x, lx)?, values(g, lg)?, values(b, lb)?);
        if b.len() != c {
            bail!("layer_norm: bias of {} for {c} channels", b.len());
        }
        let mut y = vec![0f32; x.len()];
        for (x, y) in x.chunks_exact(c).zip(y.chunks_exact_mut(c)) {
            let (mean, sd) = moments(x, self.eps);
            for (((y, x), g), b) in y.iter_mut().zip(x).zip(g).zip(b) {
                *y = (x - mean) / sd * g + b;
            }
        }
        Ok((CpuStorage::F32(y), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = super::cuda::forward((x, lx), (g, lg), (b, lb), self.eps)?;
        Ok((y, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gain: &Tensor,
        bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let both = x.apply_op3_no_bwd(gain, &grad, &LayerNormGrad { eps: self.eps })?;
        let c = gain.dim(0)?;
        // No sum for a bias nothing trains (the constant zeros of `bias = false`).
        let bias_grad = match bias.track_op() {
            true => Some(kernels::column_sums(&grad, c)?),
            false => None,
        };
        Ok((
            Some(both.get(0)?),
            Some(kernels::column_sums(&both.get(1)?, c)?),
            bias_grad,
        ))
    }
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "ddpjob-gpu-layer-norm-grad"
    }

    /// dx = (g·gy − mean(g·gy) − x̂·mean(g·gy·x̂)) / sd, and gy·x̂.
    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        g: &CpuStorage,
        lg: &Layout,
        gy: &CpuStorage,
        lgy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, c) = rows_and_channels(lx, lg, "layer_norm")?;
        let (x, g, gy) = (values(x, lx)?, values(g, lg)?, values(gy, lgy)?);
        if gy.len() != x.len() {
            bail!(
                "layer_norm gradient: {:?} for {:?}",
                lgy.shape(),
                lx.shape()
            );
        }
        let mut out = vec![0f32; 2 * x.len()];
        let (dx, gx) = out.split_at_mut(x.len());
        let xr: Vec<&[f32]> = x.chunks_exact(c).collect();
        let gyr: Vec<&[f32]> = gy.chunks_exact(c).collect();
        for (r, (dx, gx)) in dx
            .chunks_exact_mut(c)
            .zip(gx.chunks_exact_mut(c))
            .enumerate()
        {
            let (mean, sd) = moments(xr[r], self.eps);
            let (mut a, mut b) = (0f32, 0f32);
            for ((x, g), gy) in xr[r].iter().zip(g).zip(gyr[r]) {
                let (xhat, gg) = ((x - mean) / sd, gy * g);
                a += gg;
                b += gg * xhat;
            }
            let (a, b) = (a / c as f32, b / c as f32);
            for (j, (dx, gx)) in dx.iter_mut().zip(gx.iter_mut()).enumerate() {
                let xhat = (xr[r][j] - mean) / sd;
                *dx = (gyr[r][j] * g[j] - a - xhat * b) / sd;
                *gx = gyr[r][j] * xhat;
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((2, rows, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        gy: &candle_core::CudaStorage,
        lgy: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, c) = rows_and_channels(lx, lg, "layer_norm")?;
        if lgy.shape() != lx.shape() || !lgy.is_contiguous() {
            bail!(
                "layer_norm gradient: {:?} for {:?}",
                lgy.shape(),
                lx.shape()
            );
        }
        let out = super::cuda::backward((x, lx), (g, lg), (gy, lgy), self.eps)?;
        Ok((out, Shape::from((2, rows, c))))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use crate::testing::max_difference;

    use super::layer_norm;
    use crate::layer_norm::layer_norm_with_ops;

    /// Output and the three gradients of `ln` on `device`, for fixed random inputs.
    fn run(
        device: &Device,
        ln: fn(&Tensor, &Tensor, &Tensor, f64) -> candle_core::Result<Tensor>,
    ) -> Vec<Tensor> {
        let (rows, c) = (37, 96);
        let on = |t: Tensor| t.to_device(device).unwrap();
        // Fixed values (candle's randn draws anew on every call).
        let values = |n: usize, seed: f32, mean: f32, spread: f32| {
            let v: Vec<f32> = (0..n)
                .map(|i| mean + spread * ((i as f32 * 0.7137 + seed).sin() * 43.758).fract())
                .collect();
            Tensor::new(v, &Device::Cpu).unwrap()
        };
        let x = on(values(rows * c, 1.0, 1.5, 6.0).reshape((rows, c)).unwrap());
        let x = Var::from_tensor(&x).unwrap();
        let g = Var::from_tensor(&on(values(c, 2.0, 1.0, 0.4))).unwrap();
        let b = Var::from_tensor(&on(values(c, 3.0, 0.0, 0.4))).unwrap();
        let gy = on(values(rows * c, 4.0, 0.0, 2.0).reshape((rows, c)).unwrap());
        let y = ln(&x, &g, &b, 1e-5).unwrap();
        let grads = (&y * &gy).unwrap().sum_all().unwrap().backward().unwrap();
        let host = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
        let mut out = vec![host(&y)];
        out.extend([&x, &g, &b].map(|v| host(grads.get(v).unwrap())));
        out
    }

    /// The op and its gradients equal candle's ops' (the composed LayerNorm).
    #[test]
    fn matches_candles_ops_forward_and_backward() {
        let fused = run(&Device::Cpu, layer_norm);
        let composed = run(&Device::Cpu, layer_norm_with_ops);
        for (what, (a, b)) in ["y", "dx", "dgain", "dbias"]
            .iter()
            .zip(fused.iter().zip(&composed))
        {
            assert!(
                max_difference(a, b) < 2e-5,
                "{what}: {}",
                max_difference(a, b)
            );
        }
    }

    /// Runs where a GPU is: the kernels give the host's values to f32 rounding.
    #[test]
    fn the_gpu_kernels_give_the_host_values() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        let (host, device) = (run(&Device::Cpu, layer_norm), run(&gpu, layer_norm));
        for (what, (a, b)) in ["y", "dx", "dgain", "dbias"]
            .iter()
            .zip(host.iter().zip(&device))
        {
            assert!(
                max_difference(a, b) < 2e-5,
                "{what}: {}",
                max_difference(a, b)
            );
        }
    }
}
