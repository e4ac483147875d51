//! Launches of the convolution layer's kernels (see `unfolded`, which holds their source and
//! host references): one thread per output value, f32 or bf16 values.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaStorage, WrapErr};
use candle_core::{Error, Layout, Result};
use half::bf16;

use super::Dims;
use super::unfolded::{Finish, SOURCE, geometry_scalars};
use crate::nvrtc;

const MODULE: &str = "ddpjob_conv";

pub(crate) fn ptx() -> Result<&'static str> {
    static PTX: nvrtc::Compiled = nvrtc::Compiled::rounding_as_the_host();
    PTX.get(&[nvrtc::ELEMENTS, SOURCE], "the convolution kernels")
}

/// A thread per value (one block for none: a launch needs one), at most 2³² of them, which the
/// kernels' 32-bit index arithmetic relies on.
fn config(n: usize, what: &str) -> Result<LaunchConfig> {
    let n = u32::try_from(n).map_err(|_| {
        Error::Msg(format!(
            "{what} on a GPU: {n} values, more than a launch holds; use smaller batches"
        ))
    })?;
    Ok(LaunchConfig::for_num_elems(n.max(1)))
}

/// Runs kernel `name` (its f32 or bf16 instance, by `first`'s dtype) over `inputs` into a new
/// buffer of `n` values, with the count and `scalars` after the buffers.
fn launch(
    name: &str,
    first: &CudaStorage,
    inputs: &[(&CudaStorage, &Layout)],
    n: usize,
    scalars: &[u32],
) -> Result<CudaStorage> {
    nvrtc::f32_or_bf16(
        first,
        name,
        || launch_typed::<f32>(&format!("{name}_f32"), inputs, n, scalars),
        || launch_typed::<bf16>(&format!("{name}_bf16"), inputs, n, scalars),
    )
}

fn launch_typed<T: CudaDType + DeviceRepr>(
    kernel: &str,
    inputs: &[(&CudaStorage, &Layout)],
    n: usize,
    scalars: &[u32],
) -> Result<CudaSlice<T>> {
    let device = &inputs[0].0.device;
    let func = device.get_or_load_custom_func(kernel, MODULE, ptx()?)?;
    let views = inputs
        .iter()
        .map(|(s, l)| nvrtc::view::<T>(s, l))
        .collect::<Result<Vec<_>>>()?;
    // SAFETY: the kernel writes each of the `n` values.
    let mut out = unsafe { device.alloc::<T>(n.max(1))? };
    let count = n as u64;
    let mut builder = func.builder();
    for v in &views {
        builder.arg(v);
    }
    builder.arg(&mut out);
    builder.arg(&count);
    for s in scalars {
        builder.arg(s);
    }
    // SAFETY: the ops pass the buffers, count and scalars each kernel declares, in its order;
    // they checked every input's shape against the geometry the indices are computed from.
    unsafe { builder.launch(config(n, kernel)?) }.w()?;
    Ok(out)
}

/// x [n, c, h, w] → cols [n·oh·ow, c·k·k].
pub(super) fn unfold(x: &CudaStorage, lx: &Layout, d: &Dims) -> Result<CudaStorage> {
    let n = d.n * d.l * d.ckk;
    launch("ddpjob_unfold", x, &[(x, lx)], n, &geometry_scalars(d))
}

/// cols [n·oh·ow, c·k·k] → x [n, c, h, w], each place the sum of the entries that read it.
pub(super) fn fold(cols: &CudaStorage, lc: &Layout, d: &Dims) -> Result<CudaStorage> {
    let n = d.n * d.input();
    launch("ddpjob_fold", cols, &[(cols, lc)], n, &geometry_scalars(d))
}

/// `pool(relu(z + b))`, `n` values.
pub(super) fn finish(
    f: &Finish,
    z: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    n: usize,
) -> Result<CudaStorage> {
    launch("ddpjob_conv_finish", z.0, &[z, b], n, &f.scalars())
}

/// The gradient at z of [`finish`] from the output's gradient `g`.
pub(super) fn finish_grad(
    f: &Finish,
    z: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let n = z.1.shape().elem_count();
    launch("ddpjob_conv_finish_grad", z.0, &[z, b, g], n, &f.scalars())
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles the kernels (it needs no GPU, only its library).
    #[test]
    fn the_kernels_compile() {
        assert!(super::ptx().is_ok(), "{:?}", super::ptx().err());
    }
}
