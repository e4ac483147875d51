//! The causal softmax's GPU kernels (see `causal_softmax`): one warp per row of scores, the
//! row's max, sum and outputs in f32 whether the scores are f32 or bf16; compiled by NVRTC the
//! first time a worker needs them, then kept.

use candle_core::cuda_backend::CudaStorage;
use candle_core::{Layout, Result};

use super::{CausalSoftmax, CausalSoftmaxGrad, Rows};
use crate::launch::{Call, Module};
use crate::nvrtc;

const SOURCE: &str = r#"
// The row a warp owns, and the keys it sees; false past the last row (the whole warp).
__device__ __forceinline__ bool row_of(unsigned long long rows, unsigned int tq, unsigned int tk,
        unsigned int offset, unsigned long long* row, unsigned int* visible) {
    *row = warp_row();
    if (*row >= rows) return false;
    *visible = min(offset + (unsigned int)(*row % tq) + 1u, tk);
    return true;
}

template <typename T>
__device__ void forward(const T* x, T* y, unsigned long long rows, unsigned int tq,
        unsigned int tk, unsigned int offset, float scale) {
    unsigned long long row; unsigned int visible;
    if (!row_of(rows, tq, tk, offset, &row, &visible)) return;
    unsigned int lane = threadIdx.x % 32;
    unsigned long long base = row * tk;
    float m = __int_as_float(0xff800000);  // -inf (NVRTC has no math.h)
    for (unsigned int j = lane; j < visible; j += 32) m = fmaxf(m, load(x, base + j) * scale);
    m = warp_max(m);
    float s = 0.0f;
    for (unsigned int j = lane; j < visible; j += 32) s += expf(load(x, base + j) * scale - m);
    s = warp_sum(s);
    for (unsigned int j = lane; j < tk; j += 32)
        store(y, base + j, j < visible ? expf(load(x, base + j) * scale - m) / s : 0.0f);
}

template <typename T>
__device__ void backward(const T* p, const T* g, T* dx, unsigned long long rows, unsigned int tq,
        unsigned int tk, unsigned int offset, float scale) {
    unsigned long long row; unsigned int visible;
    if (!row_of(rows, tq, tk, offset, &row, &visible)) return;
    unsigned int lane = threadIdx.x % 32;
    unsigned long long base = row * tk;
    float dot = 0.0f;
    for (unsigned int j = lane; j < visible; j += 32) dot += load(p, base + j) * load(g, base + j);
    dot = warp_sum(dot);
    for (unsigned int j = lane; j < tk; j += 32)
        store(dx, base + j,
              j < visible ? scale * load(p, base + j) * (load(g, base + j) - dot) : 0.0f);
}

#define KERNELS(NAME, T) \
extern "C" __global__ void ddpjob_causal_softmax_##NAME(const T* x, T* y, \
        unsigned long long rows, unsigned int tq, unsigned int tk, unsigned int offset, \
        float scale) { forward(x, y, rows, tq, tk, offset, scale); } \
extern "C" __global__ void ddpjob_causal_softmax_grad_##NAME(const T* p, const T* g, T* dx, \
        unsigned long long rows, unsigned int tq, unsigned int tk, unsigned int offset, \
        float scale) { backward(p, g, dx, rows, tq, tk, offset, scale); }
KERNELS(f32, float)
KERNELS(bf16, unsigned short)
"#;

static MODULE: Module = Module::new(
    "ddpjob_causal_softmax",
    "the causal softmax kernels",
    &[nvrtc::ELEMENTS, nvrtc::ROW_HELPERS, SOURCE],
);

pub(crate) fn ptx() -> Result<&'static str> {
    MODULE.ptx()
}

/// The output, the row arguments every kernel takes after its pointers, and the launch: a
/// warp per row.
fn rows_and_launch<'a>(call: Call<'a>, rows: Rows, offset: usize, scale: f32) -> Result<Call<'a>> {
    Ok(call
        .output(rows.rows * rows.tk)
        .u64(rows.rows as u64)
        .u32_of(rows.tq, "queries")?
        .u32_of(rows.tk, "keys")?
        .u32_of(offset, "offset")?
        .f32(scale)
        .warp_per_row(rows.rows))
}

/// The probabilities of `scores` (contiguous [b, tq, tk]).
pub(super) fn forward(
    scores: &CudaStorage,
    layout: &Layout,
    rows: Rows,
    op: CausalSoftmax,
) -> Result<CudaStorage> {
    let call = MODULE.call("ddpjob_causal_softmax", "causal softmax");
    let call = rows_and_launch(call.values((scores, layout)), rows, op.offset, op.scale)?;
    // SAFETY: the arguments match the kernel's parameters in order and type; the scores hold
    // rows · tk values from their first element, as the output does.
    unsafe { call.run(scores) }
}

/// The scores' gradient from the probabilities `p` and their gradient `g` (contiguous, of one
/// shape, as the op checked; of one dtype).
pub(super) fn backward(
    p: &CudaStorage,
    lp: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    rows: Rows,
    op: CausalSoftmaxGrad,
) -> Result<CudaStorage> {
    let call = MODULE.call("ddpjob_causal_softmax_grad", "causal softmax gradient");
    let call = rows_and_launch(
        call.values((p, lp)).values((g, lg)),
        rows,
        op.offset,
        op.scale,
    )?;
    // SAFETY: as in `forward`; `p` and `g` hold rows · tk values each (a dtype of the two
    // that differs is an error of the views).
    unsafe { call.run(p) }
}
