//! The GPU rotary embedding's kernel (see `rope_gpu`): one thread per value, f32 arithmetic
//! over f32 or bf16 values, compiled without fused multiply-add so that it rounds as the host
//! reference (and candle's separate ops) do.

use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaStorage, WrapErr};
use candle_core::{Error, Layout, Result};
use half::bf16;

use super::rope_gpu::Geometry;
use ddpjob_kernels::nvrtc;

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

const MODULE: &str = "ddpjob_rope";

pub(super) fn ptx() -> Result<&'static str> {
    static PTX: nvrtc::Compiled = nvrtc::Compiled::rounding_as_the_host();
    PTX.get(&[nvrtc::ELEMENTS, SOURCE], "the rotary embedding kernels")
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
    nvrtc::f32_or_bf16(
        x.0,
        "rope",
        || launch::<f32>("ddpjob_rope_f32", x, cos, sin, g, sign),
        || launch::<bf16>("ddpjob_rope_bf16", x, cos, sin, g, sign),
    )
}

fn launch<T: DeviceRepr + CudaDType>(
    kernel: &str,
    (x, lx): (&CudaStorage, &Layout),
    (cos, lcos): (&CudaStorage, &Layout),
    (sin, lsin): (&CudaStorage, &Layout),
    g: &Geometry,
    sign: f32,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<T>> {
    let device = &x.device;
    let n = lx.shape().elem_count();
    let func = device.get_or_load_custom_func(kernel, MODULE, ptx()?)?;
    let start = lx.start_offset();
    let x = x.as_cuda_slice::<T>()?.slice(start..start + n);
    let cos = nvrtc::f32_view(cos, lcos, "rope")?;
    let sin = nvrtc::f32_view(sin, lsin, "rope")?;
    // SAFETY: the kernel writes each of the `n` elements.
    let mut out = unsafe { device.alloc::<T>(n)? };
    let (count, t, heads, hd, offset) = (
        n as u64,
        g.t as u32,
        g.heads as u32,
        g.head_dim as u32,
        g.offset as u32,
    );
    let mut builder = func.builder();
    builder.arg(&x);
    builder.arg(&cos);
    builder.arg(&sin);
    builder.arg(&mut out);
    builder.arg(&count);
    builder.arg(&t);
    builder.arg(&heads);
    builder.arg(&hd);
    builder.arg(&offset);
    builder.arg(&sign);
    let config = LaunchConfig::for_num_elems(
        u32::try_from(n).map_err(|_| Error::Msg("rope on a GPU: too many values".into()))?,
    );
    // SAFETY: the arguments match the kernel's parameters in order and type; `x` and `out`
    // hold `n` values, the tables (checked by `Geometry::of`) every row offset..offset + t.
    unsafe { builder.launch(config) }.w()?;
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
