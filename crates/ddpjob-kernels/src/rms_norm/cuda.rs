//! The GPU RMSNorm's kernels (see `device`): a warp per row, f32, the row's mean square
//! summed as the host reference sums it, per lane then across the warp.

use candle_core::cuda_backend::CudaStorage;
use candle_core::{Layout, Result};

use crate::host::rows_and_channels;
use crate::launch::Module;
use crate::nvrtc;

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

static MODULE: Module = Module::new(
    "ddpjob_rms_norm",
    "the RMSNorm kernels",
    &[nvrtc::ROW_HELPERS, SOURCE],
);

pub(crate) fn ptx() -> Result<&'static str> {
    MODULE.ptx()
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
    let (name, out_len) = match grad {
        None => ("ddpjob_rms_norm", rows * c),
        Some(_) => ("ddpjob_rms_norm_grad", 2 * rows * c),
    };
    let mut call = MODULE.call(name, "rms_norm").f32s(x).f32s(weight);
    if let Some(g) = grad {
        call = call.f32s(g);
    }
    let call = call
        .output_f32(out_len)
        .u64(rows as u64)
        .u32_of(c, "channels")?
        .f32(eps);
    // SAFETY: the arguments match the kernel's parameters in order and type; x (and the
    // gradient) hold rows · c values, the weight c, the output `out_len`.
    unsafe { call.warp_per_row(rows).run_f32(&x.0.device) }
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles the kernels (it needs no GPU, only its library).
    #[test]
    fn the_kernels_compile() {
        assert!(super::ptx().is_ok(), "{:?}", super::ptx().err());
    }
}
