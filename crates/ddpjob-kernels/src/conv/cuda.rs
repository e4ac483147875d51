//! Launches of the convolution layer's kernels (see `unfolded`, which holds their source and
//! host references): one thread per output value, f32 or bf16 values.

use candle_core::cuda_backend::CudaStorage;
use candle_core::{Layout, Result};

use super::Dims;
use super::unfolded::{Finish, SOURCE, geometry_scalars};
use crate::launch::Module;
use crate::nvrtc;

static MODULE: Module = Module::rounding_as_the_host(
    "ddpjob_conv",
    "the convolution kernels",
    &[nvrtc::ELEMENTS, SOURCE],
);

pub(crate) fn ptx() -> Result<&'static str> {
    MODULE.ptx()
}

/// Runs kernel `name` (its f32 or bf16 instance, by `first`'s dtype) over `inputs` into a new
/// buffer of `n` values, a thread per value, with the count and `scalars` after the buffers.
fn launch(
    name: &str,
    first: &CudaStorage,
    inputs: &[(&CudaStorage, &Layout)],
    n: usize,
    scalars: &[u32],
) -> Result<CudaStorage> {
    let mut call = MODULE.call(name, name);
    for &input in inputs {
        call = call.values(input);
    }
    call = call.output(n).u64(n as u64);
    for &s in scalars {
        call = call.u32(s);
    }
    // SAFETY: the ops pass the buffers, count and scalars each kernel declares, in its order;
    // they checked every input's shape against the geometry the indices are computed from.
    unsafe { call.per_value(n).run(first) }
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
