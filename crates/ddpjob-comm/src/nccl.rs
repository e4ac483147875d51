//! The GPU backend (`--features cuda`): NCCL through cudarc, on the CUDA stream candle computes
//! on, so gradient buckets are averaged in place where they live and never cross to the host.
//! Rank 0 creates the NCCL unique id and shares its 128 bytes through the store. Every
//! collective is numbered (heartbeats say who arrived) and watched (`watchdog.rs`): one that
//! does not complete within `distributed.timeout_s` aborts the communicator and fails the rank.

use std::ffi::{CStr, c_char};
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, DType, Device, InplaceOp1, Layout, Tensor};
use cudarc::driver::{CudaStream, DevicePtrMut};
use cudarc::nccl::result::{self, NcclError, NcclStatus};
use cudarc::nccl::sys;

use super::watchdog::{CollectiveWatch, DeviceComm, Verdict, Watchdog};
use super::{CommError, Communicator};
use crate::heartbeat::Beacon;
use ddpjob_store::StoreClient;

/// The NCCL communicator itself, shared with the watchdog thread: NCCL allows
/// `ncclCommGetAsyncError` and `ncclCommAbort` from another thread than the one that queues.
struct RawComm {
    comm: sys::ncclComm_t,
    aborted: AtomicBool,
}

// SAFETY: an NCCL communicator is a handle NCCL synchronises itself for the calls made from
// the watchdog (async error query, abort); collectives are queued from one thread only.
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

impl DeviceComm for RawComm {
    fn async_error(&self) -> Option<String> {
        if self.aborted.load(Ordering::SeqCst) {
            return None;
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator and a valid out-pointer.
        let asked = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        match (asked, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess)
            | (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => None,
            (sys::ncclResult_t::ncclSuccess, error) | (error, _) => Some(explain(NcclError(error))),
        }
    }

    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: aborted once; nothing uses the communicator afterwards but this flag.
            let _ = unsafe { result::comm_abort(self.comm) };
        }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        // As cudarc does: abort rather than destroy, which would wait for a peer that is gone.
        self.abort();
    }
}

pub struct NcclCommunicator {
    raw: Arc<RawComm>,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    /// Collectives queued so far (their sequence numbers, as the tcp ring's).
    seq: AtomicU64,
    beacon: Arc<Beacon>,
    watch: Arc<CollectiveWatch>,
    _watchdog: Watchdog,
}

impl NcclCommunicator {
    /// Joins the job's NCCL communicator on `device` (a GPU); every rank calls this together.
    /// A collective still queued after `timeout` (or an NCCL or CUDA error) goes to `report`
    /// (the failure record), then aborts the communicator, then `end` ends the worker.
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        store: &StoreClient,
        rank: usize,
        world_size: usize,
        restart: usize,
        device: &Device,
        timeout: Duration,
        beacon: Arc<Beacon>,
        report: impl FnOnce(&Verdict) + Send + 'static,
        end: impl FnOnce() + Send + 'static,
    ) -> Result<Self, CommError> {
        let setup = |problem: String| CommError::Setup { rank, problem };
        let stream = device
            .as_cuda_device()
            .map_err(|e| setup(format!("NCCL needs a GPU device: {e}")))?
            .cuda_stream();
        let key = ddpjob_store::Key::NcclId { attempt: restart }.to_string();
        let id = if rank == 0 {
            let id = result::get_uniqueid()
                .map_err(|e| setup(format!("cannot create the NCCL id: {}", explain(e))))?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
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
            sys::ncclUniqueId { internal }
        };
        let mut comm = MaybeUninit::uninit();
        // SAFETY: a valid out-pointer; every rank passes the same id and world size.
        let comm = unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), world_size as i32, id, rank as i32).map_err(
                |e| {
                    setup(format!(
                        "cannot join the NCCL communicator of {world_size} rank(s): {}",
                        explain(e)
                    ))
                },
            )?;
            comm.assume_init()
        };
        let raw = Arc::new(RawComm {
            comm,
            aborted: AtomicBool::new(false),
        });
        let watch = Arc::new(CollectiveWatch::default());
        let interval = crate::heartbeat::interval_for(timeout);
        let watchdog = Watchdog::spawn(watch.clone(), raw.clone(), timeout, interval, report, end)
            .map_err(|e| setup(format!("cannot start the NCCL watchdog thread: {e}")))?;
        Ok(NcclCommunicator {
            raw,
            stream,
            rank,
            world_size,
            seq: AtomicU64::new(0),
            beacon,
            watch,
            _watchdog: watchdog,
        })
    }

    fn failed(&self, op: &'static str, problem: String) -> CommError {
        CommError::Failed {
            op,
            rank: self.rank,
            problem,
        }
    }

    /// Queues one collective with `call(comm, stream)`, numbered for the heartbeats, and hands
    /// its completion to the watchdog.
    fn queue(
        &self,
        op: &'static str,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<NcclStatus, NcclError>,
    ) -> Result<(), CommError> {
        if self.raw.aborted.load(Ordering::SeqCst) {
            // The watchdog gave up on this communicator; queueing on it would be undefined.
            return Err(self.failed(
                op,
                "the communicator was aborted (a collective hung or failed; see this rank's \
                 error); this worker is ending"
                    .into(),
            ));
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        self.beacon.enter(seq, op);
        let queued = call(self.raw.comm, self.stream.cu_stream() as _);
        self.beacon.leave();
        queued.map_err(|e| self.failed(op, explain(e)))?;
        let done = self
            .stream
            .record_event(Some(
                cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
            ))
            .map_err(|e| self.failed(op, format!("cannot record its completion event: {e:?}")))?;
        // A CUDA error is the device's verdict, not "still running": named at once.
        self.watch.queued(seq, op, move || {
            done.try_is_complete().map_err(|e| match e.error_name() {
                Ok(name) => name.to_string_lossy().into_owned(),
                Err(_) => format!("{e:?}"),
            })
        });
        Ok(())
    }

    /// Runs a reduce-scatter or all-gather on `flat`, padded with zeros to W equal chunks
    /// (NCCL's requirement) and cut back after.
    fn chunked(
        &self,
        flat: &mut Tensor,
        what: Collective,
        op: &'static str,
    ) -> Result<(), CommError> {
        let n = flat.elem_count();
        if n == 0 {
            return Ok(());
        }
        let padded_len = n.div_ceil(self.world_size) * self.world_size;
        let padded = if padded_len > n {
            let zeros = Tensor::zeros(padded_len - n, flat.dtype(), flat.device())?;
            Tensor::cat(&[&flat.flatten_all()?, &zeros], 0)?
        } else {
            flat.flatten_all()?.contiguous()?
        };
        self.in_place(&padded, what, op)?;
        *flat = padded.narrow(0, 0, n)?.reshape(flat.shape())?;
        Ok(())
    }

    /// Runs `what` in place on `t`'s GPU memory.
    fn in_place(&self, t: &Tensor, what: Collective, op: &'static str) -> Result<(), CommError> {
        let t_op = InPlace {
            comm: self,
            what,
            op,
        };
        t.inplace_op1(&t_op)
            .map_err(|e| self.failed(op, e.to_string()))
    }
}

#[derive(Clone, Copy)]
enum Collective {
    Mean,
    Broadcast(usize),
    /// In place on a buffer of W equal chunks: chunk `rank` gets the mean.
    ReduceScatterMean,
    /// In place on a buffer of W equal chunks: chunk `rank` goes to every rank.
    AllGather,
}

struct InPlace<'a> {
    comm: &'a NcclCommunicator,
    what: Collective,
    op: &'static str,
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
        let stream = self.comm.stream.clone();
        let slice = storage.as_cuda_slice_mut::<f32>()?;
        let mut view = slice.slice_mut(start..end);
        let count = end - start;
        let (ptr, _in_use) = view.device_ptr_mut(&stream);
        let f32_type = sys::ncclDataType_t::ncclFloat32;
        let queued = self.comm.queue(self.op, |comm, s| match self.what {
            // SAFETY: `ptr` is `count` f32 on this communicator's GPU, alive while queued
            // (`_in_use` orders later use of the buffer after the collective).
            Collective::Mean => unsafe {
                result::all_reduce(
                    ptr as _,
                    ptr as _,
                    count,
                    f32_type,
                    sys::ncclRedOp_t::ncclAvg,
                    comm,
                    s,
                )
            },
            Collective::Broadcast(root) => unsafe {
                result::broadcast(ptr as _, ptr as _, count, f32_type, root as i32, comm, s)
            },
            // NCCL's in-place forms: this rank's chunk is where the result lands (reduce-
            // scatter) or what it contributes (all-gather), inside the whole buffer.
            Collective::ReduceScatterMean => unsafe {
                let chunk = count / self.comm.world_size;
                let mine = ptr + (self.comm.rank * chunk * 4) as u64;
                result::reduce_scatter(
                    ptr as _,
                    mine as _,
                    chunk,
                    f32_type,
                    sys::ncclRedOp_t::ncclAvg,
                    comm,
                    s,
                )
            },
            Collective::AllGather => unsafe {
                let chunk = count / self.comm.world_size;
                let mine = ptr + (self.comm.rank * chunk * 4) as u64;
                result::all_gather(mine as _, ptr as _, chunk, f32_type, comm, s)
            },
        });
        queued.map_err(|e| candle_core::Error::Msg(e.to_string()))
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

    /// NCCL's own split: W equal chunks of the length rounded up, chunk `rank` rank's.
    fn segment_of(&self, n: usize, rank: usize) -> std::ops::Range<usize> {
        super::buckets::equal_chunk(n, self.world_size, rank)
    }

    fn reduce_scatter_mean(&self, flat: &mut Tensor) -> Result<(), CommError> {
        self.chunked(flat, Collective::ReduceScatterMean, "reduce_scatter")
    }

    fn all_gather(&self, flat: &mut Tensor) -> Result<(), CommError> {
        self.chunked(flat, Collective::AllGather, "all_gather")
    }

    fn all_reduce_sum_f64(&self, values: &mut [f64]) -> Result<(), CommError> {
        // A few host numbers (loss sums, counts): a round trip through the GPU is the way NCCL
        // reduces them.
        let op = "all_reduce_sum";
        let stream = self.stream.clone();
        let mut buf = stream
            .clone_htod(&values[..])
            .map_err(|e| self.failed(op, format!("{e:?}")))?;
        {
            let (ptr, _in_use) = buf.device_ptr_mut(&stream);
            let count = values.len();
            // SAFETY: `ptr` is `count` f64 on this communicator's GPU.
            self.queue(op, |comm, s| unsafe {
                result::all_reduce(
                    ptr as _,
                    ptr as _,
                    count,
                    sys::ncclDataType_t::ncclFloat64,
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    s,
                )
            })?;
        }
        let out = stream
            .clone_dtoh(&buf)
            .map_err(|e| self.failed(op, format!("{e:?}")))?;
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
