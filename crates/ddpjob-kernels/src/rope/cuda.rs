//! The GPU rotary embedding's kernel (see `device`): one thread per value, f32 arithmetic
//! over f32 or bf16 values, compiled without fused multiply-add so that it rounds as the host
//! reference (and candle's separate ops) do.

use candle_core::cuda_backend::CudaStorage;
use candle_core::{Layout, Result};

use super::device::Geometry;
use crate::launch::Module;
use crate::nvrtc;

const SOURCE: &str = r#"
// y = x·cos + sign·rotate_half(x)·sin at each value of x [.., t, heads, hd], position
// offset + its t index; sign −1 is the backward (the tables' halves are equal).
#define ROPE(NAME, T) \
extern "C" __global__ void ddpjob_rope_##NAME(const T* x, const float* cos, const float* sin, \
        T* y, unsigned long long n, unsigned int t, unsigned int heads, unsigned int hd, \
        unsigned int offset, float sign) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i >= n) return; \
    unsigned int j = (unsigned int)(i % hd), half = hd / 2; \
    unsigned long long at = (unsigned long long)((i / hd / heads) % t + offset) * hd + j; \
    float r = j < half ? -load(x, i + half) : load(x, i - half); \
    store(y, i, load(x, i) * cos[at] + (sign * r) * sin[at]); \
}
ROPE(f32, float)
ROPE(bf16, unsigned short)
"#;

static MODULE: Module = Module::rounding_as_the_host(
    "ddpjob_rope",
    "the rotary embedding kernels",
    &[nvrtc::ELEMENTS, SOURCE],
);

pub(crate) fn ptx() -> Result<&'static str> {
    MODULE.ptx()
}

/// The rotation of `x` (contiguous, f32 or bf16) by the tables' angles, or by their negatives
/// (`sign` −1: the backward), in x's dtype.
pub(super) fn run(
    x: (&CudaStorage, &Layout),
    cos: (&CudaStorage, &Layout),
    sin: (&CudaStorage, &Layout),
    g: &Geometry,
    sign: f32,
) -> Result<CudaStorage> {
    let n = x.1.shape().elem_count();
    let call = MODULE
        .call("ddpjob_rope", "rope")
        .values(x)
        .f32s(cos)
        .f32s(sin)
        .output(n)
        .u64(n as u64)
        .u32_of(g.t, "positions")?
        .u32_of(g.heads, "heads")?
        .u32_of(g.head_dim, "head_dim")?
        .u32_of(g.offset, "offset")?
        .f32(sign)
        .per_value(n);
    // SAFETY: the arguments match the kernel's parameters in order and type; `x` and the
    // output hold `n` values, the tables (checked by `Geometry::of`) every row
    // offset..offset + t.
    unsafe { call.run(x.0) }
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles the kernels (it needs no GPU, only its library).
    #[test]
    fn the_kernels_compile() {
        assert!(super::ptx().is_ok(), "{:?}", super::ptx().err());
    }
}
