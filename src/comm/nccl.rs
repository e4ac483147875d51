//! The GPU backend (`--features cuda`): NCCL through cudarc, on the CUDA stream candle computes
//! on, so gradient buckets are averaged in place where they live and never cross to the host.
//! Rank 0 creates the NCCL unique id and shares its 128 bytes through the store.

use std::ffi::{CStr, c_char};
use std::time::Duration;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, DType, Device, InplaceOp1, Layout, Tensor};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::safe::{Comm, Id, ReduceOp};
use cudarc::nccl::sys;

use super::{CommError, Communicator};
use crate::store::StoreClient;

pub struct NcclCommunicator {
    comm: Comm,
    rank: usize,
    world_size: usize,
}

impl NcclCommunicator {
    /// Joins the job's NCCL communicator on `device` (a GPU); every rank calls this together.
    pub fn connect(
        store: &StoreClient,
        rank: usize,
        world_size: usize,
        restart: usize,
        device: &Device,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let setup = |problem: String| CommError::Setup { rank, problem };
        let stream = device
            .as_cuda_device()
            .map_err(|e| setup(format!("NCCL needs a GPU device: {e}")))?
            .cuda_stream();
        let key = crate::store::Key::NcclId { attempt: restart }.to_string();
        let id = if rank == 0 {
            let id = Id::new()
                .map_err(|e| setup(format!("cannot create the NCCL id: {}", explain(e))))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            store.set(&key, &bytes)?;
            id
        } else {
            let bytes = store.wait_get(&key, timeout)?;
            let mut internal: [c_char; 128] = [0; 128];
            if bytes.len() != internal.len() {
                return Err(setup(format!(
                    "the NCCL id in the store has {} bytes, not 128",
                    bytes.len()
                )));
            }
            for (dst, &src) in internal.iter_mut().zip(&bytes) {
                *dst = src as c_char;
            }
            Id::uninit(internal)
        };
        let comm = Comm::from_rank(stream, rank, world_size, id).map_err(|e| {
            setup(format!(
                "cannot join the NCCL communicator of {world_size} rank(s): {}",
                explain(e)
            ))
        })?;
        Ok(NcclCommunicator {
            comm,
            rank,
            world_size,
        })
    }

    fn failed(&self, op: &'static str, problem: String) -> CommError {
        CommError::Failed {
            op,
            rank: self.rank,
            problem,
        }
    }

    /// Runs `what` in place on `t`'s GPU memory.
    fn in_place(&self, t: &Tensor, what: Collective, op: &'static str) -> Result<(), CommError> {
        let t_op = InPlace {
            comm: &self.comm,
            what,
        };
        t.inplace_op1(&t_op)
            .map_err(|e| self.failed(op, e.to_string()))
    }
}

#[derive(Clone, Copy)]
enum Collective {
    Mean,
    Broadcast(usize),
}

struct InPlace<'a> {
    comm: &'a Comm,
    what: Collective,
}

impl InplaceOp1 for InPlace<'_> {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("NCCL collectives need the tensor on a GPU, not the CPU")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("NCCL collectives need a contiguous tensor");
        };
        if storage.dtype() != DType::F32 {
            candle_core::bail!("NCCL collectives here take f32, got {:?}", storage.dtype());
        }
        let slice = storage.as_cuda_slice_mut::<f32>()?;
        let mut view = slice.slice_mut(start..end);
        let done = match self.what {
            Collective::Mean => self.comm.all_reduce_in_place(&mut view, &ReduceOp::Avg),
            Collective::Broadcast(root) => self.comm.broadcast_in_place(&mut view, root as i32),
        };
        done.map(|_| ())
            .map_err(|e| candle_core::Error::Msg(explain(e)))
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_mean(&self, flat: &mut Tensor) -> Result<(), CommError> {
        if !flat.is_contiguous() {
            *flat = flat.contiguous()?;
        }
        self.in_place(flat, Collective::Mean, "all_reduce")
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError> {
        // A few host numbers (loss sums, counts): a round trip through the GPU is the way NCCL
        // reduces them.
        let stream = self.comm.stream();
        let mut buf = stream
            .clone_htod(&values[..])
            .map_err(|e| self.failed("all_reduce_sum", format!("{e:?}")))?;
        self.comm
            .all_reduce_in_place(&mut buf, &ReduceOp::Sum)
            .map_err(|e| self.failed("all_reduce_sum", explain(e)))?;
        let out = stream
            .clone_dtoh(&buf)
            .map_err(|e| self.failed("all_reduce_sum", format!("{e:?}")))?;
        values.copy_from_slice(&out);
        Ok(())
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), CommError> {
        // A copy: `t` may share storage with a Var, which cannot then be set from it.
        let copy = t.copy()?;
        self.in_place(&copy, Collective::Broadcast(root), "broadcast")?;
        *t = copy;
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        // NCCL has no barrier: a one-number all-reduce that the host waits for is one.
        self.all_reduce_sum_f64(&mut [0.0])
    }
}

/// cudarc's `NcclError` prints as "NcclError"; this says what the code means and what to do.
fn explain(e: NcclError) -> String {
    use sys::ncclResult_t as R;
    let hint = match e.0 {
        R::ncclUnhandledCudaError => "a CUDA call inside NCCL failed (GPU fault or out of memory)",
        R::ncclSystemError => {
            "a system call failed: network, /dev/shm too small, or a peer process died"
        }
        R::ncclInternalError => "NCCL internal error, often because a peer process died",
        R::ncclInvalidArgument => "an invalid argument reached NCCL",
        R::ncclInvalidUsage => "invalid use of NCCL, e.g. ranks calling different collectives",
        R::ncclRemoteError => "a remote rank failed or disconnected",
        R::ncclInProgress => "the operation is still in progress",
        _ => "unknown NCCL result",
    };
    // SAFETY: ncclGetErrorString returns a static, NUL-terminated string for any result code.
    let name = unsafe {
        let p = sys::ncclGetErrorString(e.0);
        if p.is_null() {
            format!("{:?}", e.0)
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    format!("{hint} (NCCL: {name}); run with NCCL_DEBUG=WARN for NCCL's own account")
}
