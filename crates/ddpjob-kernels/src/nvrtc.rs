//! Kernels compiled by NVRTC at first use: the PTX of each source once per process, or the
//! reason it could not be, kept for every later launch.

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
use candle_core::{Error, Layout, Result};

/// A storage's values of type `T` from its layout's first element, as many as the layout holds
/// (an error if the storage holds another type).
pub fn view<'a, T: candle_core::cuda_backend::CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, T>> {
    let (start, n) = (l.start_offset(), l.shape().elem_count());
    Ok(s.as_cuda_slice::<T>()?.slice(start..start + n))
}

/// An f32 storage's values from its layout's first element (`what` names the op in an error).
pub fn f32_view<'a>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<CudaView<'a, f32>> {
    match &s.slice {
        CudaStorageSlice::F32(v) => {
            let (start, n) = (l.start_offset(), l.shape().elem_count());
            Ok(v.slice(start..start + n))
        }
        _ => Err(Error::Msg(format!("{what} on a GPU: f32 values expected"))),
    }
}

/// What the f32 or the bf16 instance of a kernel made over `values`' dtype, as a storage
/// (`what` names the op in an error).
pub fn f32_or_bf16(
    values: &CudaStorage,
    what: &str,
    f32: impl FnOnce() -> Result<CudaSlice<f32>>,
    bf16: impl FnOnce() -> Result<CudaSlice<half::bf16>>,
) -> Result<CudaStorage> {
    let device = values.device.clone();
    match &values.slice {
        CudaStorageSlice::F32(_) => Ok(CudaStorage::wrap_cuda_slice(f32()?, device)),
        CudaStorageSlice::BF16(_) => Ok(CudaStorage::wrap_cuda_slice(bf16()?, device)),
        _ => Err(Error::Msg(format!(
            "{what} on a GPU: f32 or bf16 values, not {:?}",
            candle_core::backend::BackendStorage::dtype(values)
        ))),
    }
}

/// Rows per block of 256 threads in the kernels that give each row a warp.
const ROWS_PER_BLOCK: usize = 8;

/// The launch of a kernel that gives each of `rows` rows a warp (`what` names it in an error).
pub fn warp_per_row(rows: usize, what: &str) -> Result<LaunchConfig> {
    let blocks = u32::try_from(rows.div_ceil(ROWS_PER_BLOCK))
        .map_err(|_| Error::Msg(format!("{what}: {rows} rows, more than a launch holds")))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (32 * ROWS_PER_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

pub use super::device_code::ELEMENTS;

/// The CUDA helpers every row kernel's source starts with: a warp's row, and its sums and
/// maxima.
pub const ROW_HELPERS: &str = r#"
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ unsigned long long warp_row() {
    return (unsigned long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
}
"#;

/// One kernel source's PTX (or NVRTC's error), compiled on first use.
pub struct Compiled {
    ptx: OnceLock<std::result::Result<String, String>>,
    /// Whether a·b + c may become one fused multiply-add (NVRTC's default): off where a
    /// kernel must round as its host reference does, step by step.
    fmad: bool,
}

impl Default for Compiled {
    fn default() -> Self {
        Compiled::new()
    }
}

impl Compiled {
    /// Compiled with NVRTC's defaults (fused multiply-adds allowed); `const`, for a `static`.
    pub const fn new() -> Self {
        Compiled {
            ptx: OnceLock::new(),
            fmad: true,
        }
    }

    /// Compiled with no fused multiply-add: each product and sum rounded as the host's.
    pub const fn rounding_as_the_host() -> Self {
        Compiled {
            ptx: OnceLock::new(),
            fmad: false,
        }
    }

    /// The PTX of `parts` joined (`what` names it in an error).
    pub fn get(&'static self, parts: &[&str], what: &str) -> Result<&'static str> {
        let compiled = self.ptx.get_or_init(|| {
            let options = candle_core::cuda_backend::cudarc::nvrtc::CompileOptions {
                fmad: Some(self.fmad),
                ..Default::default()
            };
            candle_core::cuda_backend::cudarc::nvrtc::compile_ptx_with_opts(parts.concat(), options)
                .map(|ptx| ptx.to_src())
                .map_err(|e| format!("NVRTC could not compile {what}: {e:?}"))
        });
        compiled.as_deref().map_err(|e| Error::Msg(e.clone()))
    }
}
