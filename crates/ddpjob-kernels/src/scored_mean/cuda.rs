//! Launches the GPU scored mean's kernels (their source is in `scored_mean`).

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{Error, Layout, Result};

use super::{SOURCE, THREADS};
use crate::nvrtc;

const MODULE: &str = "ddpjob_scored_mean";

pub(crate) fn ptx() -> Result<&'static str> {
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
}
