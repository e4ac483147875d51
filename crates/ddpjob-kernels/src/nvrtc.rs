//! Kernels compiled by NVRTC at first use: the PTX of each source once per process, or the
//! reason it could not be, kept for every later launch; and the CUDA helpers sources share.
//! Launching is `launch`'s.

use std::sync::OnceLock;

use candle_core::{Error, Result};

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
