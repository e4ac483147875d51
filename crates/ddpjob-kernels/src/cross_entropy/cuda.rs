//! The GPU cross-entropy's kernels (see `cross_entropy`): a block of 256 threads per row, each
//! thread an online maximum and sum of exponentials over its strided share of the row, merged
//! across the warp and then the block.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaStorage, CudaStorageSlice, WrapErr};
use candle_core::{Error, Layout, Result};
use half::bf16;

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

const MODULE: &str = "ddpjob_cross_entropy";

pub(crate) fn ptx() -> Result<&'static str> {
    static PTX: nvrtc::Compiled = nvrtc::Compiled::new();
    PTX.get(&[nvrtc::ELEMENTS, SOURCE], "the cross-entropy kernels")
}

/// The rows' losses [rows] f32 (no gradient), or the logits' gradient [rows, classes] in their
/// dtype given the rows' gradients (f32 [rows]).
pub(super) fn run(
    logits: (&CudaStorage, &Layout),
    targets: (&CudaStorage, &Layout),
    grad: Option<(&CudaStorage, &Layout)>,
    rows: usize,
    classes: usize,
) -> Result<CudaStorage> {
    let what = "cross_entropy";
    match grad {
        // The losses are f32 whatever the logits' dtype.
        None => {
            let f32_logits = matches!(logits.0.slice, CudaStorageSlice::F32(_));
            let out = match f32_logits {
                true => losses::<f32>("f32", logits, targets, rows, classes)?,
                false => losses::<bf16>("bf16", logits, targets, rows, classes)?,
            };
            Ok(CudaStorage::wrap_cuda_slice(out, logits.0.device.clone()))
        }
        Some(g) => nvrtc::f32_or_bf16(
            logits.0,
            what,
            || gradient::<f32>("f32", logits, targets, g, rows, classes),
            || gradient::<bf16>("bf16", logits, targets, g, rows, classes),
        ),
    }
}

/// A block of 256 threads per row.
fn per_row(rows: usize, classes: usize) -> Result<LaunchConfig> {
    let rows = u32::try_from(rows)
        .map_err(|_| Error::Msg(format!("cross_entropy on a GPU: {rows} rows")))?;
    u32::try_from(classes)
        .map_err(|_| Error::Msg(format!("cross_entropy on a GPU: {classes} classes")))?;
    Ok(LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn losses<T: DeviceRepr + CudaDType>(
    dtype: &str,
    (x, lx): (&CudaStorage, &Layout),
    (t, lt): (&CudaStorage, &Layout),
    rows: usize,
    classes: usize,
) -> Result<CudaSlice<f32>> {
    let device = &x.device;
    let func =
        device.get_or_load_custom_func(&format!("ddpjob_cross_entropy_{dtype}"), MODULE, ptx()?)?;
    let x = x
        .as_cuda_slice::<T>()?
        .slice(lx.start_offset()..lx.start_offset() + rows * classes);
    let t = t
        .as_cuda_slice::<u32>()?
        .slice(lt.start_offset()..lt.start_offset() + rows);
    // SAFETY: the kernel writes each row's loss.
    let mut out = unsafe { device.alloc::<f32>(rows)? };
    let c = classes as u32;
    let mut builder = func.builder();
    builder.arg(&x);
    builder.arg(&t);
    builder.arg(&mut out);
    builder.arg(&c);
    // SAFETY: the arguments match the kernel's parameters in order and type; a block per row
    // of `classes` values.
    unsafe { builder.launch(per_row(rows, classes)?) }.w()?;
    Ok(out)
}

fn gradient<T: DeviceRepr + CudaDType>(
    dtype: &str,
    (x, lx): (&CudaStorage, &Layout),
    (t, lt): (&CudaStorage, &Layout),
    (g, lg): (&CudaStorage, &Layout),
    rows: usize,
    classes: usize,
) -> Result<CudaSlice<T>> {
    let device = &x.device;
    let name = format!("ddpjob_cross_entropy_grad_{dtype}");
    let func = device.get_or_load_custom_func(&name, MODULE, ptx()?)?;
    let n = rows * classes;
    let x = x
        .as_cuda_slice::<T>()?
        .slice(lx.start_offset()..lx.start_offset() + n);
    let t = t
        .as_cuda_slice::<u32>()?
        .slice(lt.start_offset()..lt.start_offset() + rows);
    let g = nvrtc::f32_view(g, lg, "cross_entropy")?;
    // SAFETY: the kernel writes every value of every row.
    let mut out = unsafe { device.alloc::<T>(n)? };
    let c = classes as u32;
    let mut builder = func.builder();
    builder.arg(&x);
    builder.arg(&t);
    builder.arg(&g);
    builder.arg(&mut out);
    builder.arg(&c);
    // SAFETY: as in `losses`; `g` holds a value per row, `out` rows · classes.
    unsafe { builder.launch(per_row(rows, classes)?) }.w()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles the kernels (it needs no GPU, only its library).
    #[test]
    fn the_kernels_compile() {
        assert!(super::ptx().is_ok(), "{:?}", super::ptx().err());
    }
}
