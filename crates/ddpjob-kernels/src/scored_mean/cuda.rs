//! Launches the GPU scored mean's kernels (their source is in `scored_mean`).

use candle_core::cuda_backend::CudaStorage;
use candle_core::{Layout, Result};

use super::{SOURCE, THREADS};
use crate::launch::Module;

static MODULE: Module =
    Module::rounding_as_the_host("ddpjob_scored_mean", "the scored mean's kernels", &[SOURCE]);

pub(crate) fn ptx() -> Result<&'static str> {
    MODULE.ptx()
}

/// The mean [1] from the rows' losses (`grad` false), or the rows' gradient [rows] from the
/// mean's (`grad` true): f32 `values` and u32 `targets` [rows]; one block for all.
pub(super) fn run(
    values: (&CudaStorage, &Layout),
    targets: (&CudaStorage, &Layout),
    rows: usize,
    grad: bool,
) -> Result<CudaStorage> {
    let (name, outputs) = match grad {
        false => ("ddpjob_scored_mean", 1),
        true => ("ddpjob_scored_mean_grad", rows),
    };
    let call = MODULE
        .call(name, "scored mean")
        .f32s(values)
        .u32s(targets)
        .output_f32(outputs)
        .u32_of(rows, "rows")?
        .blocks(1, THREADS as u32);
    // SAFETY: the arguments match the kernel's parameters in order and type; `values` holds
    // `rows` losses (or the one gradient), `targets` `rows` values, the output `outputs`.
    unsafe { call.run_f32(&values.0.device) }
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles the kernels (it needs no GPU, only its library).
    #[test]
    fn the_kernels_compile() {
        assert!(super::ptx().is_ok(), "{:?}", super::ptx().err());
    }
}
