//! The GPU RMSNorm's kernels (see `rms_norm_gpu`): a warp per row, f32, the row's mean square
//! summed as the host reference sums it, per lane then across the warp.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{Layout, Result};

use ddpjob_kernels::nvrtc;
use ddpjob_kernels::rows_and_channels;

const SOURCE: &str = r#"
__device__ __forceinline__ float root_mean_square(const float* x, unsigned int c,
        unsigned int lane, float eps) {
    float s = 0.0f;
    for (unsigned int j = lane; j < c; j += 32) s += x[j] * x[j];
    return sqrtf(warp_sum(s) / c + eps);
}

extern "C" __global__ void ddpjob_rms_norm(const float* x, const float* w, float* y,
        unsigned long long rows, unsigned int c, float eps) {
    unsigned long long row = warp_row();
    if (row >= rows) return;
    unsigned int lane = threadIdx.x % 32;
    const float* xr = x + row * c;
    float r = root_mean_square(xr, c, lane, eps);
    for (unsigned int j = lane; j < c; j += 32) y[row * c + j] = xr[j] / r * w[j];
}

// out[0..rows·c]: the input's gradient; out[rows·c..]: gy · x / r.
extern "C" __global__ void ddpjob_rms_norm_grad(const float* x, const float* w,
        const float* gy, float* out, unsigned long long rows, unsigned int c, float eps) {
    unsigned long long row = warp_row();
    if (row >= rows) return;
    unsigned int lane = threadIdx.x % 32;
    const float* xr = x + row * c;
    const float* gr = gy + row * c;
    float r = root_mean_square(xr, c, lane, eps);
    float d = 0.0f;
    for (unsigned int j = lane; j < c; j += 32) d += gr[j] * w[j] * xr[j];
    d = warp_sum(d) / c;
    for (unsigned int j = lane; j < c; j += 32) {
        out[row * c + j] = (gr[j] * w[j] - xr[j] / r * d / r) / r;
        out[rows * c + row * c + j] = gr[j] * xr[j] / r;
    }
}
"#;

const MODULE: &str = "ddpjob_rms_norm";

pub(super) fn ptx() -> Result<&'static str> {
    static PTX: nvrtc::Compiled = nvrtc::Compiled::new();
    PTX.get(&[nvrtc::ROW_HELPERS, SOURCE], "the RMSNorm kernels")
}

/// The forward over the rows of `x` (no gradient), or the backward's [2, rows, C] (with the
/// output's gradient).
pub(super) fn run(
    x: (&CudaStorage, &Layout),
    weight: (&CudaStorage, &Layout),
    grad: Option<(&CudaStorage, &Layout)>,
    eps: f32,
) -> Result<CudaStorage> {
    let (rows, c) = rows_and_channels(x.1, weight.1, "rms_norm")?;
    let device = &x.0.device;
    let name = match grad {
        None => "ddpjob_rms_norm",
        Some(_) => "ddpjob_rms_norm_grad",
    };
    let func = device.get_or_load_custom_func(name, MODULE, ptx()?)?;
    let mut views = vec![
        nvrtc::f32_view(x.0, x.1, "rms_norm")?,
        nvrtc::f32_view(weight.0, weight.1, "rms_norm")?,
    ];
    if let Some((g, lg)) = grad {
        views.push(nvrtc::f32_view(g, lg, "rms_norm")?);
    }
    let out_len = rows * c * if grad.is_some() { 2 } else { 1 };
    // SAFETY: the kernel writes all `out_len` elements.
    let mut out = unsafe { device.alloc::<f32>(out_len)? };
    let (rows_arg, c_arg) = (rows as u64, c as u32);
    let mut builder = func.builder();
    for v in &views {
        builder.arg(v);
    }
    builder.arg(&mut out);
    builder.arg(&rows_arg);
    builder.arg(&c_arg);
    builder.arg(&eps);
    // SAFETY: the arguments match the kernel's parameters in order and type; x (and the
    // gradient) hold rows · c values, the weight c.
    unsafe { builder.launch(nvrtc::warp_per_row(rows, "rms_norm")?) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, device.clone()))
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles the kernels (it needs no GPU, only its library).
    #[test]
    fn the_kernels_compile() {
        assert!(super::ptx().is_ok(), "{:?}", super::ptx().err());
    }
}
