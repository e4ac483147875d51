//! The causal softmax's GPU kernels (see `causal_softmax`): one warp per row of scores, the
//! row's max, sum and outputs in f32 whether the scores are f32 or bf16; compiled by NVRTC the
//! first time a worker needs them, then kept.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice, WrapErr};
use candle_core::{Error, Layout, Result};
use half::bf16;

use super::causal_softmax::{CausalSoftmax, CausalSoftmaxGrad, Rows};
use ddpjob_kernels::nvrtc;

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

const MODULE: &str = "ddpjob_causal_softmax";

pub(super) fn ptx() -> Result<&'static str> {
    static PTX: nvrtc::Compiled = nvrtc::Compiled::new();
    PTX.get(
        &[nvrtc::ELEMENTS, nvrtc::ROW_HELPERS, SOURCE],
        "the causal softmax kernels",
    )
}

/// The launch shape and the row arguments every kernel takes after its pointers.
struct Launch {
    config: LaunchConfig,
    rows: u64,
    tq: u32,
    tk: u32,
    offset: u32,
}

impl Launch {
    fn new(rows: Rows, offset: usize) -> Result<Self> {
        let too_large = |what: &str| Error::Msg(format!("causal softmax: {what} too large"));
        Ok(Launch {
            config: nvrtc::warp_per_row(rows.rows, "causal softmax")?,
            rows: rows.rows as u64,
            tq: u32::try_from(rows.tq).map_err(|_| too_large("queries"))?,
            tk: u32::try_from(rows.tk).map_err(|_| too_large("keys"))?,
            offset: u32::try_from(offset).map_err(|_| too_large("offset"))?,
        })
    }
}

/// The probabilities of `scores` (contiguous [b, tq, tk]).
pub(super) fn forward(
    scores: &CudaStorage,
    layout: &Layout,
    rows: Rows,
    op: CausalSoftmax,
) -> Result<CudaStorage> {
    let launch = Launch::new(rows, op.offset)?;
    let device = &scores.device;
    let n = rows.rows * rows.tk;
    let start = layout.start_offset();
    match &scores.slice {
        CudaStorageSlice::F32(x) => {
            let y = run::<f32>(device, "f32", &[x], start, n, &launch, op.scale, false)?;
            Ok(CudaStorage::wrap_cuda_slice(y, device.clone()))
        }
        CudaStorageSlice::BF16(x) => {
            let y = run::<bf16>(device, "bf16", &[x], start, n, &launch, op.scale, false)?;
            Ok(CudaStorage::wrap_cuda_slice(y, device.clone()))
        }
        _ => Err(Error::Msg(format!(
            "causal softmax: f32 or bf16 scores, not {:?}",
            scores.dtype()
        ))),
    }
}

/// The scores' gradient from the probabilities `p` and their gradient `g` (both contiguous).
pub(super) fn backward(
    p: &CudaStorage,
    lp: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    rows: Rows,
    op: CausalSoftmaxGrad,
) -> Result<CudaStorage> {
    let launch = Launch::new(rows, op.offset)?;
    let device = &p.device;
    let n = rows.rows * rows.tk;
    if lp.start_offset() != 0 || lg.start_offset() != 0 {
        return Err(Error::Msg(
            "causal softmax gradient: probabilities and gradient from their first element".into(),
        ));
    }
    match (&p.slice, &g.slice) {
        (CudaStorageSlice::F32(p), CudaStorageSlice::F32(g)) => {
            let dx = run::<f32>(device, "f32", &[p, g], 0, n, &launch, op.scale, true)?;
            Ok(CudaStorage::wrap_cuda_slice(dx, device.clone()))
        }
        (CudaStorageSlice::BF16(p), CudaStorageSlice::BF16(g)) => {
            let dx = run::<bf16>(device, "bf16", &[p, g], 0, n, &launch, op.scale, true)?;
            Ok(CudaStorage::wrap_cuda_slice(dx, device.clone()))
        }
        _ => Err(Error::Msg(
            "causal softmax gradient: f32 or bf16, the probabilities' dtype".into(),
        )),
    }
}

/// Launches the forward (one input) or the backward (two) kernel for dtype `T` over `n`
/// elements of the inputs from element `start`; returns the output.
#[allow(clippy::too_many_arguments)]
fn run<T: DeviceRepr + candle_core::cuda_backend::CudaDType>(
    device: &CudaDevice,
    dtype: &str,
    inputs: &[&CudaSlice<T>],
    start: usize,
    n: usize,
    launch: &Launch,
    scale: f32,
    gradient: bool,
) -> Result<CudaSlice<T>> {
    let name = match gradient {
        false => format!("ddpjob_causal_softmax_{dtype}"),
        true => format!("ddpjob_causal_softmax_grad_{dtype}"),
    };
    let func = device.get_or_load_custom_func(&name, MODULE, ptx()?)?;
    // SAFETY: the kernel writes every one of the `n` elements (masked ones as 0).
    let mut out = unsafe { device.alloc::<T>(n)? };
    let views: Vec<_> = inputs.iter().map(|s| s.slice(start..start + n)).collect();
    let mut builder = func.builder();
    for view in &views {
        builder.arg(view);
    }
    builder.arg(&mut out);
    builder.arg(&launch.rows);
    builder.arg(&launch.tq);
    builder.arg(&launch.tk);
    builder.arg(&launch.offset);
    builder.arg(&scale);
    // SAFETY: the arguments match the kernel's parameters in order and type; each input holds
    // `n` = rows · tk elements from `start`, as `out` does.
    unsafe { builder.launch(launch.config) }.w()?;
    Ok(out)
}
