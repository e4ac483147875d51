//! The GPU LayerNorm's kernels (see `device`): a warp per row, f32, the row's mean
//! and variance in two passes over it (it stays in L1) as the host reference computes them.

use candle_core::cuda_backend::CudaStorage;
use candle_core::{Error, Layout, Result};

use crate::host::rows_and_channels;
use crate::launch::Module;
use crate::nvrtc;

const SOURCE: &str = r#"
// The row's mean and standard deviation (with eps), every lane of the warp.
__device__ __forceinline__ void moments(const float* x, unsigned int c, unsigned int lane,
        float eps, float* mean, float* sd) {
    float s = 0.0f;
    for (unsigned int j = lane; j < c; j += 32) s += x[j];
    *mean = warp_sum(s) / c;
    float v = 0.0f;
    for (unsigned int j = lane; j < c; j += 32) { float d = x[j] - *mean; v += d * d; }
    *sd = sqrtf(warp_sum(v) / c + eps);
}

extern "C" __global__ void ddpjob_layer_norm(const float* x, const float* g, const float* b,
        float* y, unsigned long long rows, unsigned int c, float eps) {
    unsigned long long row = warp_row();
    if (row >= rows) return;
    unsigned int lane = threadIdx.x % 32;
    const float* xr = x + row * c;
    float mean, sd;
    moments(xr, c, lane, eps, &mean, &sd);
    for (unsigned int j = lane; j < c; j += 32) y[row * c + j] = (xr[j] - mean) / sd * g[j] + b[j];
}

// out[0..rows·c]: the input's gradient; out[rows·c..]: gy · x̂.
extern "C" __global__ void ddpjob_layer_norm_grad(const float* x, const float* g,
        const float* gy, float* out, unsigned long long rows, unsigned int c, float eps) {
    unsigned long long row = warp_row();
    if (row >= rows) return;
    unsigned int lane = threadIdx.x % 32;
    const float* xr = x + row * c;
    const float* gr = gy + row * c;
    float mean, sd;
    moments(xr, c, lane, eps, &mean, &sd);
    float a = 0.0f, b = 0.0f;
    for (unsigned int j = lane; j < c; j += 32) {
        float xhat = (xr[j] - mean) / sd, gg = gr[j] * g[j];
        a += gg;
        b += gg * xhat;
    }
    a = warp_sum(a) / c;
    b = warp_sum(b) / c;
    for (unsigned int j = lane; j < c; j += 32) {
        float xhat = (xr[j] - mean) / sd;
        out[row * c + j] = (gr[j] * g[j] - a - xhat * b) / sd;
        out[rows * c + row * c + j] = gr[j] * xhat;
    }
}
"#;

static MODULE: Module = Module::new(
    "ddpjob_layer_norm",
    "the LayerNorm kernels",
    &[nvrtc::ROW_HELPERS, SOURCE],
);

pub(crate) fn ptx() -> Result<&'static str> {
    MODULE.ptx()
}

/// Runs kernel `name` over the rows of `x` with the three inputs, into `out_len` f32s.
fn run(
    name: &str,
    inputs: [(&CudaStorage, &Layout); 3],
    out_len: usize,
    eps: f32,
) -> Result<CudaStorage> {
    let [x, (_, lg), _] = inputs;
    let (rows, c) = rows_and_channels(x.1, lg, "layer_norm")?;
    let mut call = MODULE.call(name, "layer_norm");
    for input in inputs {
        call = call.f32s(input);
    }
    let call = call
        .output_f32(out_len)
        .u64(rows as u64)
        .u32_of(c, "channels")?
        .f32(eps);
    // SAFETY: the arguments match the kernel's parameters in order and type; x (and the
    // gradient) hold rows · c values, the gain (and bias) c, the output `out_len`.
    unsafe { call.warp_per_row(rows).run_f32(&x.0.device) }
}

/// The normalised rows of `x`, times the gain, plus the bias.
pub(super) fn forward(
    x: (&CudaStorage, &Layout),
    gain: (&CudaStorage, &Layout),
    bias: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<CudaStorage> {
    let n = x.1.shape().elem_count();
    if bias.1.shape().elem_count() != gain.1.shape().elem_count() {
        return Err(Error::Msg(
            "layer_norm: bias and gain of different sizes".into(),
        ));
    }
    run("ddpjob_layer_norm", [x, gain, bias], n, eps)
}

/// The input's gradient and gy · x̂, one after the other (see `LayerNormGrad`).
pub(super) fn backward(
    x: (&CudaStorage, &Layout),
    gain: (&CudaStorage, &Layout),
    grad: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<CudaStorage> {
    let n = x.1.shape().elem_count();
    run("ddpjob_layer_norm_grad", [x, gain, grad], 2 * n, eps)
}
