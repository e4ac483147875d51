//! The one way a kernel of ddpjob's is launched: a [`Module`] is a source compiled once by
//! NVRTC, a [`Call`] lists one launch's arguments in the kernel's parameter order (values read
//! from storages, host values uploaded, the one buffer it writes, scalars) and its shape, and
//! [`Call::run`] picks the f32 or bf16 instance, makes the views, allocates the output, pushes
//! everything and launches. Before it every op repeated those twenty lines in its own
//! `*_cuda.rs`; now an op's launch file says only what its kernel takes.
//!
//! It must not know any op: the ops' sources and shapes stay in their folders.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::{DType, Error, Layout, Result};
use half::bf16;

use crate::nvrtc::Compiled;

/// A kernel source: the module its kernels load from, what it is called in an error, and its
/// parts (shared helpers first), compiled the first time a kernel of it is launched.
pub struct Module {
    name: &'static str,
    what: &'static str,
    parts: &'static [&'static str],
    compiled: Compiled,
}

impl Module {
    /// Compiled with NVRTC's defaults (fused multiply-adds allowed); `const`, for a `static`.
    pub const fn new(
        name: &'static str,
        what: &'static str,
        parts: &'static [&'static str],
    ) -> Self {
        Module {
            name,
            what,
            parts,
            compiled: Compiled::new(),
        }
    }

    /// Compiled with no fused multiply-add: each product and sum rounds as the host's does.
    pub const fn rounding_as_the_host(
        name: &'static str,
        what: &'static str,
        parts: &'static [&'static str],
    ) -> Self {
        Module {
            name,
            what,
            parts,
            compiled: Compiled::rounding_as_the_host(),
        }
    }

    /// The PTX (or NVRTC's error, kept for every later use).
    pub fn ptx(&'static self) -> Result<&'static str> {
        self.compiled.get(self.parts, self.what)
    }

    /// The module's name, for a launch a [`Call`] does not describe (one that updates buffers
    /// in place, or moves words of any type), which loads its kernel itself:
    /// `device.get_or_load_custom_func(kernel, module.name(), module.ptx()?)`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// A launch of kernel `kernel` (for [`Call::run`], the name before its `_f32` / `_bf16`),
    /// `what` naming the op in an error.
    pub fn call<'a>(&'static self, kernel: &str, what: &'a str) -> Call<'a> {
        Call {
            module: self,
            kernel: kernel.to_string(),
            what,
            args: Vec::new(),
            config: Err(format!("{what}: no launch shape given")),
        }
    }
}

/// A scalar argument, passed by value.
#[derive(Debug, Clone, Copy)]
enum Scalar {
    U64(u64),
    U32(u32),
    F32(f32),
}

/// What a buffer argument holds.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Element {
    /// The instance's dtype (f32 or bf16, see [`Call::run`]).
    Values,
    F32,
    U32,
}

enum Arg<'a> {
    Read(Element, &'a CudaStorage, &'a Layout),
    Upload(&'a [u64]),
    Write(Element, usize),
    Scalar(Scalar),
}

/// One launch's arguments, in the kernel's parameter order, and its shape.
pub struct Call<'a> {
    module: &'static Module,
    kernel: String,
    what: &'a str,
    args: Vec<Arg<'a>>,
    config: std::result::Result<LaunchConfig, String>,
}

/// A buffer argument made ready: a view of a storage, an upload, or the output.
enum Held<'v, T> {
    Values(CudaView<'v, T>),
    F32(CudaView<'v, f32>),
    U32(CudaView<'v, u32>),
    Uploaded(CudaSlice<u64>),
    Output,
    Scalar(Scalar),
}

impl<'a> Call<'a> {
    /// The values of `s` as laid out by `l` (from its first element, as many as it holds), in
    /// the instance's dtype.
    pub fn values(mut self, (s, l): (&'a CudaStorage, &'a Layout)) -> Self {
        self.args.push(Arg::Read(Element::Values, s, l));
        self
    }

    /// As [`Call::values`], f32 whatever the instance.
    pub fn f32s(mut self, (s, l): (&'a CudaStorage, &'a Layout)) -> Self {
        self.args.push(Arg::Read(Element::F32, s, l));
        self
    }

    /// As [`Call::values`], u32 (class ids, targets).
    pub fn u32s(mut self, (s, l): (&'a CudaStorage, &'a Layout)) -> Self {
        self.args.push(Arg::Read(Element::U32, s, l));
        self
    }

    /// Host values, copied to the device for this launch.
    pub fn upload(mut self, values: &'a [u64]) -> Self {
        self.args.push(Arg::Upload(values));
        self
    }

    /// The buffer the kernel writes: `len` values of the instance's dtype, which
    /// [`Call::run`] returns.
    pub fn output(mut self, len: usize) -> Self {
        self.args.push(Arg::Write(Element::Values, len));
        self
    }

    /// As [`Call::output`], f32 whatever the instance.
    pub fn output_f32(mut self, len: usize) -> Self {
        self.args.push(Arg::Write(Element::F32, len));
        self
    }

    pub fn u64(mut self, v: u64) -> Self {
        self.args.push(Arg::Scalar(Scalar::U64(v)));
        self
    }

    pub fn u32(mut self, v: u32) -> Self {
        self.args.push(Arg::Scalar(Scalar::U32(v)));
        self
    }

    pub fn f32(mut self, v: f32) -> Self {
        self.args.push(Arg::Scalar(Scalar::F32(v)));
        self
    }

    /// `v` as a u32 scalar, or an error naming `key` when it does not fit.
    pub fn u32_of(self, v: usize, key: &str) -> Result<Self> {
        let what = self.what;
        let v = u32::try_from(v)
            .map_err(|_| Error::Msg(format!("{what} on a GPU: {key} = {v}, more than 2³²")))?;
        Ok(self.u32(v))
    }

    /// A thread per value, in blocks of 256 (one block for none: a launch needs one); at most
    /// 2³² values, which the kernels' index arithmetic relies on.
    pub fn per_value(mut self, n: usize) -> Self {
        self.config = u32::try_from(n)
            .map(|n| LaunchConfig::for_num_elems(n.max(1)))
            .map_err(|_| {
                format!(
                    "{} on a GPU: {n} values, more than a launch holds; use smaller batches",
                    self.what
                )
            });
        self
    }

    /// A warp per row, eight rows to a block of 256 threads (one block for none: the kernels
    /// return for a row past the last).
    pub fn warp_per_row(mut self, rows: usize) -> Self {
        let blocks = rows.div_ceil(ROWS_PER_BLOCK).max(1);
        self.config = self::blocks(blocks, 32 * ROWS_PER_BLOCK as u32, self.what);
        self
    }

    /// `blocks` blocks of `threads` threads (a block per row, or one block for all); none is an
    /// error of the launch, as a kernel that takes a block per row need not check its row.
    pub fn blocks(mut self, blocks: usize, threads: u32) -> Self {
        self.config = self::blocks(blocks, threads, self.what);
        self
    }

    /// Launches the instance of the values' dtype, `like`'s: kernel `<kernel>_f32` or
    /// `<kernel>_bf16`, [`Call::values`] read and [`Call::output`] written in that type, on
    /// `like`'s device. Returns the output.
    ///
    /// # Safety
    ///
    /// The arguments, in the order given, are the kernel's parameters in number, order and
    /// type, and every buffer holds what the kernel's index arithmetic reaches for this shape.
    pub unsafe fn run(self, like: &CudaStorage) -> Result<CudaStorage> {
        // SAFETY: the caller's.
        unsafe { self.run_in(like.dtype(), &like.device) }
    }

    /// [`Call::run`]'s instance for `dtype` (f32 or bf16) on `device`: for a kernel whose
    /// values' dtype is none of its inputs' (a gradient in the branch's dtype from an f32 one).
    ///
    /// # Safety
    ///
    /// As for [`Call::run`].
    pub unsafe fn run_in(self, dtype: DType, device: &CudaDevice) -> Result<CudaStorage> {
        match dtype {
            DType::F32 => {
                let kernel = format!("{}_f32", self.kernel);
                // SAFETY: the caller's.
                unsafe { self.launch::<f32>(device, &kernel) }
            }
            DType::BF16 => {
                let kernel = format!("{}_bf16", self.kernel);
                // SAFETY: the caller's.
                unsafe { self.launch::<bf16>(device, &kernel) }
            }
            other => Err(Error::Msg(format!(
                "{} on a GPU: f32 or bf16 values, not {other:?}",
                self.what
            ))),
        }
    }

    /// Launches the kernel named as given, its [`Call::values`] f32, on `device`; returns the
    /// output.
    ///
    /// # Safety
    ///
    /// As for [`Call::run`].
    pub unsafe fn run_f32(self, device: &CudaDevice) -> Result<CudaStorage> {
        let kernel = self.kernel.clone();
        // SAFETY: the caller's.
        unsafe { self.launch::<f32>(device, &kernel) }
    }

    unsafe fn launch<T: CudaDType + DeviceRepr>(
        self,
        device: &CudaDevice,
        kernel: &str,
    ) -> Result<CudaStorage> {
        let what = self.what;
        let config = self.config.map_err(Error::Msg)?;
        let func = device.get_or_load_custom_func(kernel, self.module.name, self.module.ptx()?)?;
        let mut output = None;
        let mut held = Vec::with_capacity(self.args.len());
        for arg in &self.args {
            held.push(match arg {
                Arg::Read(Element::Values, s, l) => Held::Values(view::<T>(s, l, what)?),
                Arg::Read(Element::F32, s, l) => Held::F32(view::<f32>(s, l, what)?),
                Arg::Read(Element::U32, s, l) => Held::U32(view::<u32>(s, l, what)?),
                Arg::Upload(values) => Held::Uploaded(device.clone_htod(*values)?),
                Arg::Write(element, len) => {
                    let len = *len;
                    if output.is_some() {
                        return Err(Error::Msg(format!("{what}: a launch writes one buffer")));
                    }
                    // SAFETY: the kernel writes every value before anything reads it (the
                    // caller's promise); one more for none, as a buffer must hold one.
                    output = Some(match element {
                        Element::F32 => Output::F32(unsafe { device.alloc::<f32>(len.max(1))? }),
                        _ => Output::Values(unsafe { device.alloc::<T>(len.max(1))? }),
                    });
                    Held::Output
                }
                Arg::Scalar(s) => Held::Scalar(*s),
            });
        }
        let Some(mut output) = output else {
            return Err(Error::Msg(format!(
                "{what}: a launch writes one buffer; none given"
            )));
        };
        {
            let mut out = Some(&mut output);
            let mut builder = func.builder();
            for h in &held {
                match h {
                    Held::Values(v) => builder.arg(v),
                    Held::F32(v) => builder.arg(v),
                    Held::U32(v) => builder.arg(v),
                    Held::Uploaded(v) => builder.arg(v),
                    Held::Scalar(Scalar::U64(v)) => builder.arg(v),
                    Held::Scalar(Scalar::U32(v)) => builder.arg(v),
                    Held::Scalar(Scalar::F32(v)) => builder.arg(v),
                    Held::Output => match out.take() {
                        Some(Output::F32(o)) => builder.arg(o),
                        Some(Output::Values(o)) => builder.arg(o),
                        None => unreachable!("one output, checked above"),
                    },
                };
            }
            // SAFETY: the caller's: the arguments are the kernel's parameters, and each buffer
            // holds what the kernel reaches for this shape.
            unsafe { builder.launch(config) }.w()?;
        }
        let device = device.clone();
        Ok(match output {
            Output::F32(o) => CudaStorage::wrap_cuda_slice(o, device),
            Output::Values(o) => CudaStorage::wrap_cuda_slice(o, device),
        })
    }
}

enum Output<T> {
    Values(CudaSlice<T>),
    F32(CudaSlice<f32>),
}

/// Rows per block of 256 threads in the kernels that give each row a warp.
const ROWS_PER_BLOCK: usize = 8;

fn blocks(blocks: usize, threads: u32, what: &str) -> std::result::Result<LaunchConfig, String> {
    let grid = u32::try_from(blocks)
        .map_err(|_| format!("{what} on a GPU: {blocks} blocks, more than a launch holds"))?;
    Ok(LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A storage's values of type `T` from its layout's first element, as many as the layout
/// holds; an error naming the op when the storage holds another type.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<CudaView<'a, T>> {
    let (start, n) = (l.start_offset(), l.shape().elem_count());
    let slice = s.as_cuda_slice::<T>().map_err(|_| {
        Error::Msg(format!(
            "{what} on a GPU: {:?} values where {} were expected",
            s.dtype(),
            std::any::type_name::<T>()
        ))
    })?;
    Ok(slice.slice(start..start + n))
}
