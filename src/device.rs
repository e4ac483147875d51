//! Where workers train. The launcher decides once per node, from `distributed.device`,
//! `distributed.devices`, `nproc_per_node` and the GPUs the driver shows (which honours
//! `CUDA_VISIBLE_DEVICES`); each worker is told its device (`DDPJOB_DEVICE`), so local rank r
//! always gets the r-th chosen GPU, as `torch.cuda.set_device(LOCAL_RANK)` would.

use candle_core::Device;
use thiserror::Error;

use crate::config::{DeviceChoice, DistributedSpec, Precision};

/// The worker's device, `cpu` or `cuda:<ordinal>` (set by the launcher).
pub const ENV: &str = "DDPJOB_DEVICE";

#[derive(Debug, Error, PartialEq)]
pub enum DeviceError {
    #[error(
        "distributed.device = \"cuda\", but no GPU can be used: {why}; set distributed.device = \"auto\" to fall back to the CPU"
    )]
    NoGpu { why: String },
    #[error(
        "{wanted} workers need {wanted} GPUs, but this node has {have} usable ({visible}); one worker per GPU: set nproc_per_node to at most {have}, or \"auto\""
    )]
    TooFewGpus {
        wanted: usize,
        have: usize,
        visible: String,
    },
    #[error(
        "distributed.devices names GPU {ordinal}, but this node shows {count} ({visible}); ordinals count from 0 among the visible GPUs"
    )]
    NoSuchGpu {
        ordinal: usize,
        count: usize,
        visible: String,
    },
    #[error("{ENV}={0:?} is not `cpu` or `cuda:<ordinal>`")]
    BadEnv(String),
    #[error("cannot open GPU {ordinal}: {problem}")]
    Open { ordinal: usize, problem: String },
}

/// The launcher's decision for one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// GPU ordinal of each local rank; empty for CPU workers.
    pub gpus: Vec<usize>,
    /// Workers on this node.
    pub nproc: usize,
    /// Said once by the launcher (a cuda build that found no GPU and fell back to the CPU).
    pub notice: Option<String>,
}

impl Placement {
    pub fn on_gpus(&self) -> bool {
        !self.gpus.is_empty()
    }

    /// The `DDPJOB_DEVICE` value of `local_rank`.
    pub fn device_of(&self, local_rank: usize) -> String {
        match self.gpus.get(local_rank) {
            Some(ordinal) => format!("cuda:{ordinal}"),
            None => "cpu".into(),
        }
    }
}

/// GPUs the driver shows this process, or why there are none to use.
pub fn visible_gpus() -> Result<usize, String> {
    #[cfg(feature = "cuda")]
    {
        match cudarc::driver::CudaContext::device_count() {
            Ok(n) if n > 0 => Ok(n as usize),
            Ok(_) => Err("the CUDA driver shows no GPU".into()),
            Err(e) => Err(format!("the CUDA driver is not usable ({e:?})")),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this build has no GPU support (`--features cuda`)".into())
    }
}

/// [`place_with`] on this machine's GPUs.
pub fn place(spec: &DistributedSpec) -> Result<Placement, DeviceError> {
    let gpus = match spec.device {
        DeviceChoice::Cpu => Err("distributed.device = \"cpu\"".into()),
        _ => visible_gpus(),
    };
    place_with(spec, gpus, cfg!(feature = "cuda"))
}

/// Decides the node's workers and devices given `gpus` (the count the driver shows, or why
/// there are none). `gpu_build` says whether a CPU fallback deserves a notice.
pub fn place_with(
    spec: &DistributedSpec,
    gpus: Result<usize, String>,
    gpu_build: bool,
) -> Result<Placement, DeviceError> {
    let cpu = |notice| Placement {
        gpus: Vec::new(),
        nproc: spec.nproc_per_node.unwrap_or(1),
        notice,
    };
    let count = match (spec.device, gpus) {
        (DeviceChoice::Cpu, _) => return Ok(cpu(None)),
        (DeviceChoice::Cuda, Err(why)) => return Err(DeviceError::NoGpu { why }),
        (DeviceChoice::Auto, Err(why)) => {
            let notice = gpu_build.then(|| {
                format!(
                    "no GPU to train on ({why}); training on the CPU. Set distributed.device = \
                     \"cpu\" to say so, or \"cuda\" to fail instead"
                )
            });
            return Ok(cpu(notice));
        }
        (_, Ok(n)) => n,
    };
    let visible = describe_visible(count);
    let chosen: Vec<usize> = match &spec.devices {
        Some(list) => {
            if let Some(&ordinal) = list.iter().find(|&&o| o >= count) {
                return Err(DeviceError::NoSuchGpu {
                    ordinal,
                    count,
                    visible,
                });
            }
            list.clone()
        }
        None => (0..count).collect(),
    };
    let nproc = spec.nproc_per_node.unwrap_or(chosen.len());
    if nproc > chosen.len() {
        return Err(DeviceError::TooFewGpus {
            wanted: nproc,
            have: chosen.len(),
            visible,
        });
    }
    Ok(Placement {
        gpus: chosen[..nproc].to_vec(),
        nproc,
        notice: None,
    })
}

/// `2 visible, CUDA_VISIBLE_DEVICES=0,3`, for messages.
fn describe_visible(count: usize) -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) => format!("{count} visible, CUDA_VISIBLE_DEVICES={v}"),
        Err(_) => format!("{count} visible"),
    }
}

/// The device of a command that runs a job's model in this one process (`eval`, `bench
/// step`): the one the job's first worker would train on (a GPU wherever the job would train
/// on GPUs, whatever its `nproc_per_node`).
pub struct OneProcess {
    pub device: Device,
    /// `cpu` or `cuda:<ordinal>`.
    pub name: String,
    /// The launcher's notice of a fall-back to the CPU, if any.
    pub notice: Option<String>,
}

/// [`OneProcess`] for `spec`'s job.
pub fn for_one_process(spec: &DistributedSpec) -> Result<OneProcess, DeviceError> {
    let one = DistributedSpec {
        nproc_per_node: Some(1),
        ..spec.clone()
    };
    let placement = place(&one)?;
    let name = placement.device_of(0);
    Ok(OneProcess {
        device: open(Some(&name))?,
        name,
        notice: placement.notice,
    })
}

/// A worker's device from its `DDPJOB_DEVICE` value (`None`: the CPU).
pub fn open(value: Option<&str>) -> Result<Device, DeviceError> {
    match value.unwrap_or("cpu") {
        "cpu" => Ok(Device::Cpu),
        other => {
            let ordinal = other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<usize>().ok())
                .ok_or_else(|| DeviceError::BadEnv(other.to_string()))?;
            open_gpu(ordinal)
        }
    }
}

pub use ddpjob_seam::compute_dtype;

/// Sets how the process's f32 matrix products round (the switches are per process, as torch's
/// `allow_tf32`): on a GPU, TF32 tensor cores for `"tf32"` and `"bf16-matmul"`; on the CPU,
/// bf16 products for `"bf16-matmul"` where the CPU has them.
pub fn set_matmul_precision(device: &Device, precision: Precision) {
    let reduced = matches!(precision, Precision::Tf32 | Precision::Bf16Matmul);
    if device.is_cuda() {
        #[cfg(feature = "cuda")]
        candle_core::cuda_backend::set_gemm_reduced_precision_f32(reduced);
        #[cfg(not(feature = "cuda"))]
        let _ = reduced;
    } else {
        ddpjob_kernels::set_bf16_products(precision == Precision::Bf16Matmul);
    }
}

/// How a worker computes in `precision` on `device`, once [`set_matmul_precision`] has set
/// it, for its first line ("" for plain f32).
pub fn describe_precision(device: &Device, precision: Precision) -> &'static str {
    match precision {
        Precision::F32 => "",
        Precision::Bf16 => " in bf16 autocast",
        Precision::Tf32 | Precision::Bf16Matmul if device.is_cuda() => " with TF32 matrix products",
        Precision::Tf32 => " in f32 (the CPU has no TF32)",
        Precision::Bf16Matmul if ddpjob_kernels::bf16_products() => {
            " with bf16 matrix products (AVX512_BF16)"
        }
        Precision::Bf16Matmul => " in f32 (this CPU has no AVX512_BF16 for bf16 products)",
    }
}

#[cfg(feature = "cuda")]
fn open_gpu(ordinal: usize) -> Result<Device, DeviceError> {
    let fail = |problem: String| DeviceError::Open { ordinal, problem };
    let device = Device::new_cuda(ordinal).map_err(|e| fail(e.to_string()))?;
    let cuda = device.as_cuda_device().map_err(|e| fail(e.to_string()))?;
    let context = cuda.cuda_stream().context().clone();
    // SAFETY: a worker queues everything on this device's one stream (candle's ops, the
    // uploads, NCCL's collectives and the watchdog's events), so no buffer is used by two
    // streams and cudarc's per-allocation events (two created and destroyed for every op's
    // output) guard nothing.
    unsafe { context.disable_event_tracking() };
    // Best effort: a device without memory pools (cudarc then allocates synchronously) or a
    // driver that refuses the setting trains as before.
    if let Err(e) = keep_freed_memory(&context) {
        errln!("note: cuda:{ordinal}: freed memory goes back to the driver ({e})");
    }
    // ddpjob's own kernels compile while the worker loads its data and model, not in its
    // first step.
    crate::models::compile_gpu_kernels_ahead();
    Ok(device)
}

/// Lets the device's memory pool keep what is freed instead of handing it back to the driver
/// at every synchronisation (its release threshold is 0 by default), so a training step's
/// buffers are reused step after step rather than allocated from the driver again.
#[cfg(feature = "cuda")]
fn keep_freed_memory(context: &cudarc::driver::CudaContext) -> Result<(), String> {
    use cudarc::driver::sys;
    context.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    let mut pool = std::mem::MaybeUninit::<sys::CUmemoryPool>::uninit();
    // SAFETY: a valid out-pointer and the context's own device.
    unsafe { sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), context.cu_device()) }
        .result()
        .map_err(|e| format!("cuDeviceGetDefaultMemPool: {e:?}"))?;
    // SAFETY: initialised by the successful call above.
    let pool = unsafe { pool.assume_init() };
    let mut threshold = u64::MAX;
    // SAFETY: the release threshold is a cuuint64_t, passed by pointer.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
    .map_err(|e| format!("cuMemPoolSetAttribute(RELEASE_THRESHOLD): {e:?}"))
}

#[cfg(not(feature = "cuda"))]
fn open_gpu(ordinal: usize) -> Result<Device, DeviceError> {
    Err(DeviceError::Open {
        ordinal,
        problem: "this build has no GPU support (`--features cuda`)".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(
        device: DeviceChoice,
        nproc: Option<usize>,
        devices: Option<Vec<usize>>,
    ) -> DistributedSpec {
        DistributedSpec {
            nproc_per_node: nproc,
            timeout_s: 300,
            max_restarts: 0,
            bucket_bytes: 25_000_000,
            device,
            devices,
            backend: crate::config::Backend::Auto,
            always_collectives: false,
            sharding: crate::config::Sharding::None,
            overlap_comm: false,
            world_size_invariant: false,
            virtual_shards: 8,
        }
    }

    #[test]
    fn auto_takes_every_visible_gpu_or_falls_back_to_the_cpu_with_a_notice() {
        let p = place_with(&spec(DeviceChoice::Auto, None, None), Ok(4), true).unwrap();
        assert_eq!((p.gpus.clone(), p.nproc), (vec![0, 1, 2, 3], 4));
        assert_eq!(p.device_of(2), "cuda:2");
        let p = place_with(
            &spec(DeviceChoice::Auto, None, None),
            Err("none".into()),
            true,
        )
        .unwrap();
        assert_eq!((p.nproc, p.on_gpus()), (1, false));
        assert!(p.notice.unwrap().contains("training on the CPU"));
        // A CPU build has nothing to apologise for.
        let p = place_with(
            &spec(DeviceChoice::Auto, Some(3), None),
            Err("n/a".into()),
            false,
        )
        .unwrap();
        assert_eq!((p.nproc, p.device_of(0)), (3, "cpu".to_string()));
        assert_eq!(p.notice, None);
    }

    #[test]
    fn chosen_devices_map_to_local_ranks_and_too_few_gpus_is_an_error() {
        let p = place_with(
            &spec(DeviceChoice::Cuda, None, Some(vec![0, 2])),
            Ok(4),
            true,
        )
        .unwrap();
        assert_eq!(
            (p.device_of(0), p.device_of(1)),
            ("cuda:0".into(), "cuda:2".into())
        );
        let err = place_with(&spec(DeviceChoice::Auto, Some(3), None), Ok(2), true).unwrap_err();
        assert_eq!(
            err,
            DeviceError::TooFewGpus {
                wanted: 3,
                have: 2,
                visible: describe_visible(2)
            }
        );
        assert!(
            err.to_string()
                .contains("3 workers need 3 GPUs, but this node has 2")
        );
        let err = place_with(
            &spec(DeviceChoice::Cuda, None, Some(vec![1, 5])),
            Ok(2),
            true,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("names GPU 5, but this node shows 2"),
            "{err}"
        );
        let err = place_with(
            &spec(DeviceChoice::Cuda, None, None),
            Err("no driver".into()),
            true,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("no GPU can be used: no driver"),
            "{err}"
        );
        // Fewer workers than GPUs: the first ones.
        let p = place_with(
            &spec(DeviceChoice::Cuda, Some(1), Some(vec![3, 1])),
            Ok(4),
            true,
        )
        .unwrap();
        assert_eq!(p.gpus, vec![3]);
    }

    #[test]
    fn the_worker_side_reads_its_device() {
        assert!(open(None).unwrap().is_cpu());
        assert!(open(Some("cpu")).unwrap().is_cpu());
        assert_eq!(
            open(Some("gpu0")).unwrap_err(),
            DeviceError::BadEnv("gpu0".into())
        );
    }
}
