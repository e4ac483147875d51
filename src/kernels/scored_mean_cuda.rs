//! The GPU scored mean's kernels (see `scored_mean`): one block of 256 threads, each summing
//! its strided share of the losses and counting its scored targets, then the halves of the
//! block's shares added in shared memory, the order the host's reference sums in.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{Error, Layout, Result};

use super::nvrtc;
use super::scored_mean::THREADS;

const SOURCE: &str = r#"
#define IGNORED 0xffffffffu
#define THREADS 256
// Σ of every thread's `v` and of its `n`, in every thread: halves added onto halves.
__device__ void block_sums(float& v, unsigned int& n) {
    __shared__ float sums[THREADS];
    __shared__ unsigned int counts[THREADS];
    sums[threadIdx.x] = v;
    counts[threadIdx.x] = n;
    __syncthreads();
    for (unsigned int half = THREADS / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            sums[threadIdx.x] += sums[threadIdx.x + half];
            counts[threadIdx.x] += counts[threadIdx.x + half];
        }
        __syncthreads();
    }
    v = sums[0];
    n = counts[0];
}
// mean[0] = Σ losses / max(scored targets, 1).
extern "C" __global__ void ddpjob_scored_mean(const float* losses, const unsigned int* targets,
        float* mean, unsigned int rows) {
    float s = 0.0f;
    unsigned int n = 0;
    for (unsigned int j = threadIdx.x; j < rows; j += THREADS) {
        s += losses[j];
        n += targets[j] != IGNORED;
    }
    block_sums(s, n);
    if (threadIdx.x == 0) mean[0] = s / fmaxf((float)n, 1.0f);
}
// Every row's gradient: g[0] / max(scored targets, 1).
extern "C" __global__ void ddpjob_scored_mean_grad(const float* g, const unsigned int* targets,
        float* rows_grad, unsigned int rows) {
    float unused = 0.0f;
    unsigned int n = 0;
    for (unsigned int j = threadIdx.x; j < rows; j += THREADS) n += targets[j] != IGNORED;
    block_sums(unused, n);
    float each = g[0] / fmaxf((float)n, 1.0f);
    for (unsigned int j = threadIdx.x; j < rows; j += THREADS) rows_grad[j] = each;
}
"#;

const MODULE: &str = "ddpjob_scored_mean";

pub(super) fn ptx() -> Result<&'static str> {
    static PTX: nvrtc::Compiled = nvrtc::Compiled::rounding_as_the_host();
    PTX.get(&[SOURCE], "the scored mean's kernels")
}

/// The mean [1] from the rows' losses (`grad` false), or the rows' gradient [rows] from the
/// mean's (`grad` true): f32 `values` and u32 `targets` [rows].
pub(super) fn run(
    (values, lv): (&CudaStorage, &Layout),
    (targets, lt): (&CudaStorage, &Layout),
    rows: usize,
    grad: bool,
) -> Result<CudaStorage> {
    let device = &values.device;
    let name = match grad {
        false => "ddpjob_scored_mean",
        true => "ddpjob_scored_mean_grad",
    };
    let func = device.get_or_load_custom_func(name, MODULE, ptx()?)?;
    let values = nvrtc::f32_view(values, lv, "scored mean")?;
    let targets = nvrtc::view::<u32>(targets, lt)?;
    let rows_u32 = u32::try_from(rows)
        .map_err(|_| Error::Msg(format!("scored mean on a GPU: {rows} rows")))?;
    let outputs = if grad { rows } else { 1 };
    // SAFETY: the kernel writes every output (thread 0 the mean; the threads every row).
    let mut out = unsafe { device.alloc::<f32>(outputs)? };
    let mut builder = func.builder();
    builder.arg(&values);
    builder.arg(&targets);
    builder.arg(&mut out);
    builder.arg(&rows_u32);
    let one_block = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's parameters in order and type; `values` holds
    // `rows` losses (or the one gradient), `targets` `rows` values, `out` `outputs`.
    unsafe { builder.launch(one_block) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, device.clone()))
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles the kernels (it needs no GPU, only its library).
    #[test]
    fn the_kernels_compile() {
        assert!(super::ptx().is_ok(), "{:?}", super::ptx().err());
    }

    /// The kernels' block is the one the host's reference sums for.
    #[test]
    fn the_kernels_block_is_the_hosts() {
        let define = format!("#define THREADS {}\n", super::THREADS);
        assert!(super::SOURCE.contains(&define));
    }
}
