//! Adam and AdamW on a GPU as one kernel per parameter, in place: candle's tensor ops make a
//! dozen passes and allocations per parameter (4.5 ms of the shakespeare-char recipe's 33.5 ms
//! step on an H200). Compiled without fused multiply-add, so every element rounds as the host
//! kernel's (`optim::Adam`): a GPU's step gives the CPU's values bit for bit.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{CpuStorage, InplaceOp2, Layout, Result, Storage, Tensor, bail};

use super::{Adam, AdamStep};
use crate::launch::Module;

const SOURCE: &str = r#"
extern "C" __global__ void ddpjob_adam(float* p, const float* g, float* m, float* v,
        unsigned long long n, float b1, float b2, float one_minus_b1, float one_minus_b2,
        float step_size, float inv_correction2, float eps, float l2, float shrink) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float pi = p[i];
    if (shrink != 1.0f) pi *= shrink;
    float gi = g[i];
    if (l2 != 0.0f) gi = gi + l2 * pi;
    float mi = b1 * m[i] + one_minus_b1 * gi;
    float vi = b2 * v[i] + one_minus_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - step_size * (mi / (sqrtf(vi) * inv_correction2 + eps));
}
"#;

static MODULE: Module = Module::rounding_as_the_host("ddpjob_adam", "the Adam kernel", &[SOURCE]);

pub fn ptx() -> Result<&'static str> {
    MODULE.ptx()
}

/// Updates `param` (f32 on a GPU, contiguous) in place from `grad`, and its moments
/// `exp_avg` and `exp_avg_sq` (f32, contiguous, on the same GPU, as many values; owned by the
/// optimizer alone: they are written in place) with it.
pub fn adam_step_on_gpu(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    h: AdamStep,
) -> Result<()> {
    let n = param.elem_count();
    for (what, t) in [
        ("gradient", grad),
        ("exp_avg", exp_avg),
        ("exp_avg_sq", exp_avg_sq),
    ] {
        if t.elem_count() != n || !t.is_contiguous() || !t.device().same_device(param.device()) {
            bail!("adam on a GPU: the {what} does not match the parameter");
        }
    }
    let op = AdamOnGpu {
        adam: Adam::new(h),
        moments: (exp_avg.clone(), exp_avg_sq.clone()),
    };
    param.inplace_op2(grad, &op)
}

struct AdamOnGpu {
    adam: Adam,
    moments: (Tensor, Tensor),
}

/// The device values of `t`'s storage from its first element (f32 on a GPU).
fn device_values<'a>(
    storage: &'a Storage,
    layout: &Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>> {
    let Storage::Cuda(s) = storage else {
        bail!("adam on a GPU: a moment is not on the GPU");
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("adam on a GPU: a moment is not contiguous");
    };
    Ok(s.as_cuda_slice::<f32>()?.slice(start..end))
}

impl InplaceOp2 for AdamOnGpu {
    fn name(&self) -> &'static str {
        "ddpjob-adam-gpu"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        bail!("adam on a GPU: the parameter is on the CPU (the host kernel updates those)")
    }

    fn cuda_fwd(
        &self,
        p: &mut CudaStorage,
        lp: &Layout,
        g: &CudaStorage,
        lg: &Layout,
    ) -> Result<()> {
        let (Some((p_start, p_end)), Some((g_start, g_end))) =
            (lp.contiguous_offsets(), lg.contiguous_offsets())
        else {
            bail!("adam on a GPU: the parameter and its gradient must be contiguous")
        };
        let n = p_end - p_start;
        let device = p.device.clone();
        // In place: not a `Call` (which writes one new buffer), so its own arguments.
        let func = device.get_or_load_custom_func("ddpjob_adam", MODULE.name(), ptx()?)?;
        let (m_storage, m_layout) = self.moments.0.storage_and_layout();
        let (v_storage, v_layout) = self.moments.1.storage_and_layout();
        let (m, v) = (
            device_values(&m_storage, m_layout)?,
            device_values(&v_storage, v_layout)?,
        );
        if g_end - g_start != n || m.len() != n || v.len() != n {
            bail!("adam on a GPU: gradient or state does not match the parameter's size");
        }
        let g = g.as_cuda_slice::<f32>()?.slice(g_start..g_end);
        let mut p = p.as_cuda_slice_mut::<f32>()?.slice_mut(p_start..p_end);
        let a = &self.adam;
        let count = n as u64;
        let mut builder = func.builder();
        builder.arg(&mut p);
        builder.arg(&g);
        // The moments are written through their device pointers: the optimizer's own buffers,
        // which no other tensor shares (see `optim::Buffer::Device`), on the one stream.
        builder.arg(&m);
        builder.arg(&v);
        builder.arg(&count);
        for value in [
            &a.b1,
            &a.b2,
            &a.one_minus_b1,
            &a.one_minus_b2,
            &a.step_size,
            &a.inv_correction2,
            &a.eps,
            &a.l2,
            &a.shrink,
        ] {
            builder.arg(value);
        }
        let config = LaunchConfig::for_num_elems(
            u32::try_from(n)
                .map_err(|_| candle_core::Error::Msg("adam: too many values".into()))?,
        );
        // SAFETY: the arguments match the kernel's parameters in order and type; p, g, m and v
        // hold `n` f32 values each.
        unsafe { builder.launch(config) }.w()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::super::{AdamStep, adam_step};
    use super::adam_step_on_gpu;

    /// NVRTC compiles the kernel (it needs no GPU, only its library).
    #[test]
    fn the_kernel_compiles() {
        assert!(super::ptx().is_ok(), "{:?}", super::ptx().err());
    }

    /// Runs where a GPU is: three Adam and three AdamW steps on the GPU give the host kernel's
    /// parameter and moments bit for bit.
    #[test]
    fn the_gpu_step_is_the_host_step_bit_for_bit() {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        let n = 5_000;
        let start: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin()).collect();
        let grads: Vec<Vec<f32>> = (0..3)
            .map(|s| {
                (0..n)
                    .map(|i| ((i * (s + 3)) as f32 * 0.11).cos() * 0.1)
                    .collect()
            })
            .collect();
        for decoupled in [false, true] {
            let step = |t| AdamStep {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.1,
                decoupled,
                t,
            };
            let host_p = Tensor::new(start.as_slice(), &Device::Cpu).unwrap();
            let (mut m, mut v) = (Vec::new(), Vec::new());
            let gpu_p = Tensor::new(start.as_slice(), &gpu).unwrap();
            let (gm, gv) = (gpu_p.zeros_like().unwrap(), gpu_p.zeros_like().unwrap());
            for (t, g) in grads.iter().enumerate() {
                let t = t as i32 + 1;
                adam_step(
                    &host_p,
                    &Tensor::new(g.as_slice(), &Device::Cpu).unwrap(),
                    &mut m,
                    &mut v,
                    step(t),
                )
                .unwrap();
                adam_step_on_gpu(
                    &gpu_p,
                    &Tensor::new(g.as_slice(), &gpu).unwrap(),
                    &gm,
                    &gv,
                    step(t),
                )
                .unwrap();
            }
            let bits = |t: &Tensor| -> Vec<u32> {
                t.to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            };
            let host_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&gpu_p),
                bits(&host_p),
                "parameter, decoupled {decoupled}"
            );
            assert_eq!(bits(&gm), host_bits(&m), "exp_avg");
            assert_eq!(bits(&gv), host_bits(&v), "exp_avg_sq");
        }
    }
}
