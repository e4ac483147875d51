//! A parameter's values let go of and given back in place: `distributed.sharding = "full"`
//! frees a parameter's storage between the passes that read it (see `train::full`). The
//! tensor keeps its identity and shape, so every holder of it (the model's fields, the
//! autograd graph a block kept, views of it) sees the values again once they are back.

use std::cell::Cell;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp1, InplaceOp2, Layout, Result, Tensor, bail};

/// Frees `param`'s values (an f32 tensor of its own storage, as a variable is); reading it
/// before [`restore`] is a bug, which candle's ops report as an error or a panic (its CPU
/// matmul, which reads through raw pointers, checks its operands' storage: vendored patch 2).
pub fn release(param: &Tensor) -> Result<()> {
    param.inplace_op1(&Release)
}

/// Gives `param` (released or not) the values `values`, an f32 tensor of its element count,
/// on its device: copied into a storage of the parameter's own.
pub fn restore(param: &Tensor, values: Tensor) -> Result<()> {
    if values.elem_count() != param.elem_count() {
        bail!(
            "restoring {} values into a parameter of {}",
            values.elem_count(),
            param.elem_count()
        );
    }
    if values.device().is_cpu() {
        let host = values.flatten_all()?.to_vec1::<f32>()?;
        return param.inplace_op1(&Restore(Cell::new(host)));
    }
    param.inplace_op2(&values.force_contiguous()?, &RestoreFrom)
}

struct Release;

impl InplaceOp1 for Release {
    fn name(&self) -> &'static str {
        "ddpjob-release"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        check(storage.dtype(), layout)?;
        *storage = CpuStorage::F32(Vec::new());
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::cuda_backend::CudaStorage,
        layout: &Layout,
    ) -> Result<()> {
        check(storage.dtype(), layout)?;
        // One element: the driver refuses empty allocations.
        let one = storage.device.alloc_zeros::<f32>(1)?;
        storage.slice = candle_core::cuda_backend::CudaStorageSlice::F32(one);
        Ok(())
    }
}

/// Host values moved in (taken once).
struct Restore(Cell<Vec<f32>>);

impl InplaceOp1 for Restore {
    fn name(&self) -> &'static str {
        "ddpjob-restore"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        check(storage.dtype(), layout)?;
        *storage = CpuStorage::F32(self.0.take());
        Ok(())
    }
}

/// Device values copied in from a tensor of their own.
struct RestoreFrom;

impl InplaceOp2 for RestoreFrom {
    fn name(&self) -> &'static str {
        "ddpjob-restore-from"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        bail!("restore: host values are moved in, not copied")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::cuda_backend::CudaStorage,
        layout: &Layout,
        source: &candle_core::cuda_backend::CudaStorage,
        _: &Layout,
    ) -> Result<()> {
        use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
        check(storage.dtype(), layout)?;
        let CudaStorageSlice::F32(values) = &source.slice else {
            bail!("restore: f32 values expected, got {:?}", source.dtype());
        };
        storage.slice = CudaStorageSlice::F32(values.try_clone().w()?);
        Ok(())
    }
}

/// Parameters are f32 variables of their own contiguous storage (master weights).
fn check(dtype: candle_core::DType, layout: &Layout) -> Result<()> {
    if dtype != candle_core::DType::F32 || layout.start_offset() != 0 || !layout.is_contiguous() {
        bail!("only a whole f32 parameter is released or restored, not a {dtype:?} view");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    #[test]
    fn a_released_parameter_gets_its_values_back_in_every_holder() {
        let var = Var::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap();
        let held = var.as_tensor().clone();
        let view = held.t().unwrap();
        release(&var).unwrap();
        assert_eq!(var.dims(), [2, 2]);
        let values = Tensor::new(&[5f32, 6., 7., 8.], &Device::Cpu).unwrap();
        restore(&var, values).unwrap();
        assert_eq!(held.to_vec2::<f32>().unwrap(), [[5., 6.], [7., 8.]]);
        assert_eq!(view.to_vec2::<f32>().unwrap(), [[5., 7.], [6., 8.]]);
        let wrong = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        assert!(restore(&var, wrong).is_err());
        let half = held.narrow(0, 1, 1).unwrap();
        assert!(release(&half).is_err(), "a view is not a parameter");
        // Read while let go of: an error (the vendored candle's matmul checks its operands'
        // storage), never a read out of bounds.
        release(&var).unwrap();
        let x = Tensor::ones((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let read = var.as_tensor().matmul(&x).unwrap_err().to_string();
        assert!(read.contains("storage shorter than its layout"), "{read}");
    }
}
