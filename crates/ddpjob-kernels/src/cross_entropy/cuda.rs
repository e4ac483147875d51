//! The GPU cross-entropy's kernels (see `cross_entropy`): a block of 256 threads per row, each
//! thread an online maximum and sum of exponentials over its strided share of the row, merged
//! across the warp and then the block.

use candle_core::cuda_backend::CudaStorage;
use candle_core::{Layout, Result};

use crate::launch::Module;
use crate::nvrtc;

const SOURCE: &str = r#"
#define IGNORED 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)
// (m, s) ← the maximum and Σ exp(v − maximum) of both shares.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
    if (m2 == NEG_INF) return;
    if (m == NEG_INF) { m = m2; s = s2; return; }
    if (m2 > m) { s = s * expf(m - m2) + s2; m = m2; } else { s += s2 * expf(m2 - m); }
}
// log Σ exp over the row x[0..c], the same value in every thread of the block.
template <typename T>
__device__ float row_log_sum_exp(const T* x, unsigned int c) {
    __shared__ float shared_m[32], shared_s[32];
    float m = NEG_INF, s = 0.0f;
    for (unsigned int j = threadIdx.x; j < c; j += blockDim.x) {
        float v = load(x, j);
        if (v > m) { s = (m == NEG_INF ? 0.0f : s * expf(m - v)) + 1.0f; m = v; }
        else if (!(v == NEG_INF)) s += expf(v - m);
    }
    for (int o = 16; o > 0; o /= 2) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        merge(m, s, m2, s2);
    }
    unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    if (lane == 0) { shared_m[warp] = m; shared_s[warp] = s; }
    __syncthreads();
    if (warp == 0) {
        m = lane < warps ? shared_m[lane] : NEG_INF;
        s = lane < warps ? shared_s[lane] : 0.0f;
        for (int o = 16; o > 0; o /= 2) {
            float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
            merge(m, s, m2, s2);
        }
        if (lane == 0) { shared_m[0] = m; shared_s[0] = s; }
    }
    __syncthreads();
    return shared_m[0] + logf(shared_s[0]);
}
#define CROSS_ENTROPY(NAME, T) \
extern "C" __global__ void ddpjob_cross_entropy_##NAME(const T* x, const unsigned int* targets, \
        float* loss, unsigned int c) { \
    const T* row = x + (unsigned long long)blockIdx.x * c; \
    float lse = row_log_sum_exp(row, c); \
    if (threadIdx.x == 0) { \
        unsigned int t = targets[blockIdx.x]; \
        loss[blockIdx.x] = t == IGNORED ? 0.0f : t < c ? lse - load(row, t) : __int_as_float(0x7fc00000); \
    } \
} \
extern "C" __global__ void ddpjob_cross_entropy_grad_##NAME(const T* x, \
        const unsigned int* targets, const float* g, T* dx, unsigned int c) { \
    const T* row = x + (unsigned long long)blockIdx.x * c; \
    T* d = dx + (unsigned long long)blockIdx.x * c; \
    unsigned int t = targets[blockIdx.x]; \
    if (t == IGNORED) { \
        for (unsigned int j = threadIdx.x; j < c; j += blockDim.x) store(d, j, 0.0f); \
        return; \
    } \
    float lse = row_log_sum_exp(row, c), gr = g[blockIdx.x]; \
    for (unsigned int j = threadIdx.x; j < c; j += blockDim.x) \
        store(d, j, (expf(load(row, j) - lse) - (j == t ? 1.0f : 0.0f)) * gr); \
}
CROSS_ENTROPY(f32, float)
CROSS_ENTROPY(bf16, unsigned short)
"#;

static MODULE: Module = Module::new(
    "ddpjob_cross_entropy",
    "the cross-entropy kernels",
    &[nvrtc::ELEMENTS, SOURCE],
);

pub(crate) fn ptx() -> Result<&'static str> {
    MODULE.ptx()
}

/// The rows' losses [rows] f32 (no gradient), or the logits' gradient [rows, classes] in their
/// dtype given the rows' gradients (f32 [rows]); a block of 256 threads per row.
pub(super) fn run(
    logits: (&CudaStorage, &Layout),
    targets: (&CudaStorage, &Layout),
    grad: Option<(&CudaStorage, &Layout)>,
    rows: usize,
    classes: usize,
) -> Result<CudaStorage> {
    let what = "cross_entropy";
    let call = match grad {
        // The losses are f32 whatever the logits' dtype.
        None => MODULE
            .call("ddpjob_cross_entropy", what)
            .values(logits)
            .u32s(targets)
            .output_f32(rows),
        Some(g) => MODULE
            .call("ddpjob_cross_entropy_grad", what)
            .values(logits)
            .u32s(targets)
            .f32s(g)
            .output(rows * classes),
    };
    let call = call.u32_of(classes, "classes")?.blocks(rows, 256);
    // SAFETY: the arguments match the kernels' parameters in order and type: the logits hold
    // rows · classes values, the targets and the rows' gradients one per row, the output a
    // loss per row or a value per logit; a block per row.
    unsafe { call.run(logits.0) }
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles the kernels (it needs no GPU, only its library).
    #[test]
    fn the_kernels_compile() {
        assert!(super::ptx().is_ok(), "{:?}", super::ptx().err());
    }
}
