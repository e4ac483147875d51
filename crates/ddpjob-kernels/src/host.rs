//! What every CPU kernel shares: views of a storage's values (f32, or bf16 widened), the GEMM
//! every layer's products go through (f32, or bf16 products where the CPU has them), the split
//! of samples over threads, and the small helpers the tests of every op use. Ops import these
//! from here, never from the crate's root, so an op's folder depends on this file only.

use std::ops::Range;

use candle_core::{CpuStorage, DType, Layout, Result, Storage, Tensor, bail};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::bf16_products;

/// Keeps freed memory in the process. A training step frees and allocates the same large
/// buffers every time; glibc's defaults hand blocks over 128 KiB back to the kernel (mmap
/// threshold) and trim the heap, so every step would pay for zeroing fresh pages (measured:
/// 3–5% of a CNN step). Raising the mmap threshold is not enough for a large model: it stops at
/// 32 MiB, and a 135M-parameter llama's embedding gradients (113 MB) and a step's freed
/// activations (gigabytes, over any trim threshold) came back as fresh pages every step, the
/// kernel zeroing them for 23% of the step's time. So: no mmap'd blocks, the heap never
/// trimmed (-1: "disables trimming completely", mallopt(3)), and one arena: a thread's own
/// arena lives in 64 MiB heaps that glibc unmaps as soon as they empty and that cannot hold a
/// block larger than that at all (it is mmap'd whatever M_MMAP_MAX says), so Qwen3-0.6B's
/// step (0.6 G parameters, context 512) still spent 20% of its time in the kernel's
/// page zeroing with a trim threshold of 2 GiB: 16.9 → 13.3 s a step (Intel Xeon, 2 threads),
/// peak RSS 12.2 GB; a 363 M Qwen3-MoE's 7.1 → 5.3 s (without one arena: 14.7 s and 7.3 s).
/// One arena's single lock costs tiny models that allocate a lot per millisecond (the 2-layer
/// MoE fixture's step 7.3 → 12–13 ms, a 2-layer llama's 28 → 31 ms), so `one_arena` is asked
/// for where blocks over 64 MiB are expected (a large vocabulary's embedding and logits; see
/// the caller's rule). A top pad that keeps thread heaps alive instead fixes the small ones
/// but not the large (16.2 s): a thread arena mmaps every block over 64 MiB. Must run before any thread starts (glibc fixes its number of arenas at
/// the first thread's first allocation): a worker calls it once it knows its job and before
/// its first thread. Not in the launcher: one arena's lock halved the rate at which it
/// tokenises a job's data on every core (allocation-heavy work on many threads).
pub fn keep_freed_memory(one_arena: bool) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before the worker's threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, -1);
        if one_arena {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = one_arena;
}

/// The bits of `t`'s values as f32 (from any float dtype, on any device): what the tests that
/// hold a GPU's result to the host's bit for bit compare.
#[doc(hidden)]
pub fn f32_bits(t: &Tensor) -> Vec<u32> {
    let v: Vec<f32> = t
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .expect("f32 values");
    v.iter().map(|x| x.to_bits()).collect()
}

/// The largest difference of `a` and `b` relative to `a`'s magnitude, at least `floor` (the
/// tests that hold a GPU's or a fused op's values to a reference's within a tolerance).
#[doc(hidden)]
pub fn worst_relative(a: &[f32], b: &[f32], floor: f32) -> f32 {
    assert_eq!(a.len(), b.len(), "compared values differ in number");
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs() / a.abs().max(floor))
        .fold(0f32, f32::max)
}

/// Σ y·sin(i) over the elements of `y`: a fixed, uneven weighting of the outputs, so every
/// output's gradient differs (the tests of the fused ops' backward).
#[doc(hidden)]
pub fn uneven_sum(y: &Tensor) -> Tensor {
    let weights = Tensor::arange(0u32, y.elem_count() as u32, y.device())
        .and_then(|i| i.to_dtype(DType::F32))
        .and_then(|i| i.sin())
        .and_then(|w| w.reshape(y.shape()))
        .expect("weights of the outputs");
    (y * weights)
        .and_then(|p| p.sum_all())
        .expect("the weighted sum")
}

/// Whether the fused kernels run for `t`: f32 on the CPU.
pub fn applies(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// 2×2 max-pool (stride 2, an odd last row or column dropped) from candle's reshape and max,
/// for devices the fused kernels do not cover. Candle's own `max_pool2d` backward scales the
/// gradient of a window's unique maximum by 1/4 (it multiplies by the window's mean of the
/// argmax mask); the backward of `max` passes it whole, as torch does.
pub fn max_pool2_with_ops(x: &Tensor) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    let (ph, pw) = (h / 2, w / 2);
    x.narrow(2, 0, 2 * ph)?
        .narrow(3, 0, 2 * pw)?
        .reshape((n, c, ph, 2, pw, 2))?
        .max(5)?
        .max(3)
}

/// A contiguous f32 or bf16 CPU storage's values for `layout` as f32 (exact), and its dtype:
/// the host references of the GPU kernels compute in f32 over either (`what` names the op in
/// an error).
pub fn widened(s: &CpuStorage, l: &Layout, what: &str) -> Result<(Vec<f32>, DType)> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{what}: contiguous values expected");
    };
    match s {
        CpuStorage::F32(v) => Ok((v[start..end].to_vec(), DType::F32)),
        CpuStorage::BF16(v) => Ok((
            v[start..end].iter().map(|x| x.to_f32()).collect(),
            DType::BF16,
        )),
        other => bail!(
            "{what}: f32 or bf16 values, not {:?}",
            candle_core::backend::BackendStorage::dtype(other)
        ),
    }
}

/// f32 values stored in `dtype`: bf16 rounded to nearest even (as the kernels' stores), any
/// other dtype f32.
pub fn narrowed(values: Vec<f32>, dtype: DType) -> CpuStorage {
    match dtype {
        DType::BF16 => CpuStorage::BF16(values.into_iter().map(half::bf16::from_f32).collect()),
        _ => CpuStorage::F32(values),
    }
}

/// The f32 values a contiguous CPU storage holds for `layout`.
pub fn values<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    let all = storage.as_slice::<f32>()?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&all[start..end]),
        None => bail!("ddpjob kernels need contiguous inputs"),
    }
}

/// Σ over the rows of `t` viewed as [rows, c]: `[c]` (a gain's or bias's gradient). On a GPU, in
/// f32 without TF32, as the product ones[1, rows] · t, a GEMM: candle's sum over the first
/// dimension gives each column one block reading down it, ~49 µs for a [16384, 384] f32
/// gradient on an H200 where the product takes a few (ncu, 2026-11-26).
pub fn column_sums(t: &Tensor, c: usize) -> Result<Tensor> {
    let t = t.reshape(((), c))?;
    #[cfg(feature = "cuda")]
    if t.device().is_cuda()
        && t.dtype() == DType::F32
        && !candle_core::cuda_backend::gemm_reduced_precision_f32()
    {
        let ones = ones_row(t.dim(0)?, t.device())?;
        return ones.matmul(&t.contiguous()?)?.reshape(c);
    }
    t.sum(0)
}

/// A [1, n] f32 row of ones on `device`: a view of one row kept per device (grown when a
/// longer one is asked for), since a fresh one is a fill kernel and an allocation every time
/// a gradient's column sums are taken (a few per layer per step).
#[cfg(any(feature = "cuda", test))]
pub(crate) fn ones_row(n: usize, device: &candle_core::Device) -> Result<Tensor> {
    static KEPT: std::sync::Mutex<Vec<Tensor>> = std::sync::Mutex::new(Vec::new());
    let mut kept = KEPT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let mine = kept.iter().position(|t| t.device().same_device(device));
    let row = match mine {
        Some(i) if kept[i].dim(0)? >= n => kept[i].clone(),
        _ => {
            let longer = Tensor::ones(n, DType::F32, device)?;
            if let Some(i) = mine {
                kept[i] = longer.clone();
            } else {
                kept.push(longer.clone());
            }
            longer
        }
    };
    row.narrow(0, 0, n)?.reshape((1, n))
}

/// Rows and channels of a contiguous input normalised over its last dimension, checked against
/// the per-channel parameter (a gain, a weight) beside it; `what` names the op in an error.
pub fn rows_and_channels(x: &Layout, per_channel: &Layout, what: &str) -> Result<(usize, usize)> {
    let c = x.shape().dims().last().copied().unwrap_or(0);
    if per_channel.shape().dims1()? != c
        || c == 0
        || !x.is_contiguous()
        || !per_channel.is_contiguous()
    {
        bail!(
            "{what}: input {:?}, per-channel weight {:?}",
            x.shape(),
            per_channel.shape()
        );
    }
    Ok((x.shape().elem_count() / c, c))
}

/// Runs `f` on the f32 values of a CPU tensor (made contiguous first).
pub fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => f(values(cpu, layout)?),
        _ => bail!("ddpjob kernels run on the CPU only"),
    }
}

/// Integer ids (u32 or i64 values: tokens, targets) as indices.
pub fn indices(t: &Tensor) -> Result<Vec<usize>> {
    let t = t.flatten_all()?.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("ddpjob kernels run on the CPU only")
    };
    indices_of(cpu, layout)
}

/// [`indices`] of a contiguous CPU storage.
pub fn indices_of(storage: &CpuStorage, layout: &Layout) -> Result<Vec<usize>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("ddpjob kernels need contiguous ids")
    };
    Ok(match storage {
        CpuStorage::U32(v) => v[start..end].iter().map(|&i| i as usize).collect(),
        CpuStorage::I64(v) => v[start..end].iter().map(|&i| i.max(0) as usize).collect(),
        _ => bail!("ids (tokens, targets) must be u32 or i64"),
    })
}

/// Σ f(v) in eight interleaved partial sums: the compiler may not reorder a sequential f32
/// sum, so without the lanes these reductions would run one element at a time. Inlined, so
/// that inside loops compiled for AVX2 (the GPT's row loops) they run as 8-wide vectors.
#[inline(always)]
pub fn sum_map(v: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = v.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|&x| f(x)).sum();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += f(x);
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// A layer's gradients: of its input (`None` when not wanted), its weight and its bias.
pub type LayerGrads = (Option<Vec<f32>>, Vec<f32>, Vec<f32>);

/// Runs `f` on the f32 values of CPU tensors (each contiguous, as parameters are), holding
/// their storage read-locked meanwhile: the hand-written training passes read every parameter
/// this way without copying any.
pub fn with_all_values<R>(
    tensors: &[&Tensor],
    f: impl FnOnce(&[&[f32]]) -> Result<R>,
) -> Result<R> {
    let locked: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let slices = locked
        .iter()
        .map(|(storage, layout)| match &**storage {
            Storage::Cpu(cpu) => values(cpu, layout),
            _ => bail!("ddpjob kernels run on the CPU only"),
        })
        .collect::<Result<Vec<_>>>()?;
    f(&slices)
}

/// A matrix operand for [`gemm`]: `rows × cols` elements at the given row and column strides.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_stride: usize,
    pub(crate) col_stride: usize,
}

impl<'a> Mat<'a> {
    /// `data` read as a row-major `rows × cols` matrix.
    pub(crate) fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        assert!(data.len() >= rows * cols, "matrix data too short");
        Mat {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The matrix as [`strided_product`] takes it.
    fn strided(&self) -> Strided {
        (self.data.as_ptr(), self.row_stride, self.col_stride)
    }

    /// The transpose, without moving any data.
    pub(crate) fn t(self) -> Self {
        Mat {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }
}

/// `dst` (row-major `a.rows × b.cols`) = a·b, or += a·b when `accumulate`. With `threads` > 1
/// the product is split into one block per thread, each a single-threaded GEMM: along the
/// rows of `a` when `a` is the larger operand, else along the columns of `b`, so each thread
/// packs only its share of the big matrix. For the shapes here (a batch of 64 rows against
/// thousands of features) this keeps both cores busy where the gemm crate's own split does not.
pub(crate) fn gemm(dst: &mut [f32], a: Mat, b: Mat, accumulate: bool, threads: usize) {
    assert_eq!(dst.len(), a.rows * b.cols, "gemm: destination size");
    let out = Out {
        ptr: dst.as_mut_ptr(),
        row_stride: b.cols,
    };
    // SAFETY: `out` is `dst`, exactly a.rows × b.cols (asserted above), borrowed mutably here
    // until every block is done.
    unsafe { gemm_to(out, a, b, accumulate, threads) }
}

/// a·b as a new row-major `a.rows × b.cols` vector. Not zero-filled first: without
/// accumulation gemm writes every element of its destination and reads none (measured: the
/// zero-filling of weight gradients was 0.7% of a GPT step).
pub(crate) fn product(a: Mat, b: Mat, threads: usize) -> Vec<f32> {
    let len = a.rows * b.cols;
    let mut dst = Vec::with_capacity(len);
    let out = Out {
        ptr: dst.as_mut_ptr(),
        row_stride: b.cols,
    };
    // SAFETY: `out` is the vector's buffer of `len` values, which nothing else can reach; with
    // `accumulate` false gemm only writes it, every element (see the function's doc), so all
    // `len` values are initialised when `set_len` makes them readable.
    unsafe {
        gemm_to(out, a, b, false, threads);
        dst.set_len(len);
    }
    dst
}

/// [`gemm`] into `out`.
///
/// # Safety
/// `out` must point at `a.rows` rows of `b.cols` writable values, `out.row_stride` apart, that
/// nothing else accesses until this returns.
pub(crate) unsafe fn gemm_to(out: Out, a: Mat, b: Mat, accumulate: bool, threads: usize) {
    let products = Products::for_depth(a.cols);
    // SAFETY: the caller vouches for `out`.
    unsafe { split_gemm(out, a, b, accumulate, threads, products) }
}

/// [`gemm_to`], multiplying as `products` says.
///
/// # Safety
/// As [`gemm_to`]'s; `Products::Bf16` only where `set_bf16_products` returned true.
pub(crate) unsafe fn split_gemm(
    out: Out,
    a: Mat,
    b: Mat,
    accumulate: bool,
    threads: usize,
    products: Products,
) {
    assert_eq!(a.cols, b.rows, "gemm: inner dimensions differ");
    let (m, n) = (a.rows, b.cols);
    let split_rows = m >= n;
    // A fork-join costs tens of microseconds; below this much work per thread it does not pay.
    let flops = 2 * m * n * a.cols;
    let parts = threads
        .min(if split_rows { m } else { n } / 16)
        .min(flops / MIN_FLOPS_PER_THREAD)
        .max(1);
    if parts == 1 {
        // SAFETY: the caller vouches for `out`.
        return unsafe { gemm_block(out, a, b, accumulate, products) };
    }
    // Split by rows, every block multiplies by the whole b: copied into rows once here, not by
    // each block (see `wants_rows`).
    let mut held = Vec::new();
    let b = match split_rows && products == Products::F32 && wants_rows(m, n, a.cols, b.strided()) {
        true => {
            held = ROWS_OF_B.take();
            // SAFETY: `Mat`'s data covers every element of b (checked where it was made).
            let (_, ld, _) = unsafe { rows_of(b.strided(), b.rows, n, &mut held) };
            Mat {
                data: &held[..],
                rows: b.rows,
                cols: n,
                row_stride: ld,
                col_stride: 1,
            }
        }
        false => b,
    };
    let len = if split_rows { m } else { n };
    let per_part = len.div_ceil(parts);
    // Rounding the share up can leave fewer non-empty parts than asked (305 rows in 19 parts
    // of 17 fill 18): only those run.
    let parts = len.div_ceil(per_part);
    (0..parts).into_par_iter().for_each(|part| {
        let first = part * per_part;
        let (a, b, out) = if split_rows {
            let rows = per_part.min(m - first);
            let a = Mat {
                data: &a.data[first * a.row_stride..],
                rows,
                ..a
            };
            (a, b, out.offset(first * out.row_stride))
        } else {
            let cols = per_part.min(n - first);
            let b = Mat {
                data: &b.data[first * b.col_stride..],
                cols,
                ..b
            };
            (a, b, out.offset(first))
        };
        // SAFETY: the blocks are disjoint (distinct rows, or distinct columns, of `out`), each
        // inside it, and the caller keeps it to us until every block is done.
        unsafe { gemm_block(out, a, b, accumulate, products) }
    });
    if !held.is_empty() {
        ROWS_OF_B.set(held);
    }
}

/// This machine's f32 matrix-product rate in operations per second, as the kernels reach it
/// with rayon's pool: the best of `reps` timed `size`×`size`×`size` products (after one
/// untimed), each thread packing and multiplying its own block, as training's shards do.
pub fn gemm_rate(size: usize, reps: usize) -> f64 {
    let a: Vec<f32> = (0..size * size).map(|i| (i % 7) as f32 * 0.25).collect();
    let b: Vec<f32> = (0..size * size).map(|i| (i % 5) as f32 * 0.5).collect();
    let mut c = vec![0f32; size * size];
    let (a, b) = (Mat::new(&a, size, size), Mat::new(&b, size, size));
    gemm(&mut c, a, b, false, threads());
    let best = (0..reps.max(1))
        .map(|_| {
            let started = std::time::Instant::now();
            gemm(&mut c, a, b, false, threads());
            started.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    std::hint::black_box(&c);
    2.0 * (size as f64).powi(3) / best.max(1e-9)
}

/// The least work (floating-point operations) worth a thread of its own in [`gemm`].
pub(crate) const MIN_FLOPS_PER_THREAD: usize = 16_000_000;

/// Where a block of the product goes: a pointer into the destination and its row stride.
#[derive(Clone, Copy)]
pub(crate) struct Out {
    pub(crate) ptr: *mut f32,
    pub(crate) row_stride: usize,
}

// SAFETY: an `Out` is only handed to blocks that write disjoint parts of one destination.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    pub(crate) fn offset(self, by: usize) -> Out {
        Out {
            // SAFETY (of the arithmetic): `by` is a row or column start inside the destination.
            ptr: self.ptr.wrapping_add(by),
            ..self
        }
    }
}

/// One single-threaded GEMM into `out` (see [`gemm`]).
///
/// # Safety
/// `out` must point at `a.rows` rows of `b.cols` writable values, `out.row_stride` apart, that
/// nothing else accesses meanwhile.
pub(crate) unsafe fn gemm_block(out: Out, a: Mat, b: Mat, accumulate: bool, products: Products) {
    // SAFETY: `Mat::new` checked that each operand's data covers rows × cols; a transpose only
    // swaps the strides within those bounds, and a block (in `gemm`) starts its data at its
    // first row or column, keeping every access at or below the original's last element; the
    // caller vouches for `out`.
    unsafe {
        strided_product(
            (a.rows, b.cols, a.cols),
            (out.ptr, out.row_stride),
            accumulate,
            (a.data.as_ptr(), a.row_stride, a.col_stride),
            (b.data.as_ptr(), b.row_stride, b.col_stride),
            products,
        )
    }
}

/// How a product multiplies: in f32, or from bf16 inputs (`train.precision = "bf16-matmul"`,
/// see `bf16_products`): decided by the process's switch and the product's depth alone, so
/// every block of a product cut between threads or into chunks multiplies alike.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Products {
    F32,
    Bf16,
}

impl Products {
    /// For a product of depth `k` in this process.
    pub fn for_depth(k: usize) -> Products {
        match bf16_products::wanted_for(k) {
            true => Products::Bf16,
            false => Products::F32,
        }
    }
}

/// A matrix in memory for [`strided_product`]: element (i, j) at `ptr + i·rs + j·cs`.
pub type Strided = (*const f32, usize, usize);

/// `dst` = a·b, or += a·b when `accumulate`, single-threaded, for `a` m × k and `b` k × n and
/// `dst` m × n with rows `dst.1` apart, multiplied as `products` says: the one way every CPU
/// kernel multiplies matrices, so `train.precision = "bf16-matmul"` reaches them all.
///
/// # Safety
/// Every element of `a`, `b` and `dst` must be inside its allocation, and nothing else may
/// access `dst` meanwhile; `products` must come from [`Products::for_depth`] (its `Bf16` needs
/// the instructions that `set_bf16_products` checked).
pub unsafe fn strided_product(
    (m, n, k): (usize, usize, usize),
    dst: (*mut f32, usize),
    accumulate: bool,
    a: Strided,
    b: Strided,
    products: Products,
) {
    #[cfg(target_arch = "x86_64")]
    if products == Products::Bf16 {
        let operand = |(ptr, rs, cs): Strided| bf16_products::Operand { ptr, rs, cs };
        let dst = bf16_products::Dst {
            ptr: dst.0,
            rs: dst.1,
        };
        // SAFETY: `Products::Bf16` is only chosen where `set_bf16_products` found the
        // instructions; the caller vouches for the memory.
        return unsafe { bf16_products::gemm((m, n, k), dst, accumulate, operand(a), operand(b)) };
    }
    let mut b = b;
    let mut held = Vec::new();
    if wants_rows(m, n, k, b) {
        held = ROWS_OF_B.take();
        // SAFETY: the caller vouches that every element of `b` is inside its allocation.
        b = unsafe { rows_of(b, k, n, &mut held) };
    }
    // SAFETY: the caller vouches for the memory; `b` is the caller's or `held`'s, alive here.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.0,
            1,
            dst.1 as isize,
            accumulate,
            a.0,
            a.2 as isize,
            a.1 as isize,
            b.0,
            b.2 as isize,
            b.1 as isize,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
    if !held.is_empty() {
        ROWS_OF_B.set(held);
    }
}

thread_local! {
    /// This thread's copy of the last `b` given by columns (see [`wants_rows`]), kept to be
    /// written over by the next.
    static ROWS_OF_B: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether `b` (k × n) is copied into rows before gemm multiplies by it. A `b` stored by
/// columns (the weight of x·Wᵀ, a key block of q·kᵀ) is what gemm, which works on the
/// transposed product for a row-major destination, copies into its panels one element at a
/// time, the panel's 64 elements from 64 rows `b`'s column stride apart: at Qwen3's 1,024
/// channels (4 KB) all 64 fall into one set of the L1 cache, which holds 8. Copied into rows
/// here first, gemm's copy is then a straight one.
fn wants_rows(m: usize, n: usize, k: usize, (_, _, cs): Strided) -> bool {
    cs != 1 && m >= 32 && n >= 16 && k >= 16
}

/// Floats added to a copied row, so that rows 4 KB apart do not share cache sets.
const ROW_PAD: usize = 16;

/// `b` (k × n) copied into `held` as rows (k rows of n values, `n + ROW_PAD` apart).
///
/// # Safety
/// Every element of `b` must be inside its allocation.
unsafe fn rows_of(b: Strided, k: usize, n: usize, held: &mut Vec<f32>) -> Strided {
    let ld = n + ROW_PAD;
    if held.len() < k * ld {
        held.resize(k * ld, 0.0);
    }
    // SAFETY: the caller vouches for b; `held` holds k rows of `ld` ≥ n values.
    unsafe { gather_rows(b, (k, n), (held.as_mut_ptr(), ld)) };
    (held.as_ptr(), ld, 1)
}

/// dst[p·ld + j] = src(p, j) for the k × n matrix `src`: a transpose when `src` is stored by
/// columns, eight of its columns at a time, each read in order (the prefetcher's streams),
/// written a tile of 16 rows at a time.
///
/// # Safety
/// Every element of `src` must be inside its allocation, and `dst` must hold k rows of n
/// writable values `ld` apart that nothing else accesses meanwhile.
pub(crate) unsafe fn gather_rows(
    (src, rs, cs): Strided,
    (k, n): (usize, usize),
    (dst, ld): (*mut f32, usize),
) {
    for j0 in (0..n).step_by(8) {
        for p0 in (0..k).step_by(16) {
            let depth = 16.min(k - p0);
            for j in j0..(j0 + 8).min(n) {
                for p in p0..p0 + depth {
                    // SAFETY: (p, j) is inside src and inside dst, as the caller vouches.
                    unsafe { *dst.add(p * ld + j) = *src.add(p * rs + j * cs) };
                }
            }
        }
    }
}

/// Threads the kernels may use: rayon's pool (`RAYON_NUM_THREADS`, which the launcher sets).
pub(crate) fn threads() -> usize {
    rayon::current_num_threads().max(1)
}

/// An output split by sample: the values and how many belong to each sample (0: not wanted).
pub(crate) type PerSample<'a, T> = (&'a mut [T], usize);

/// Splits `n` samples into one contiguous range per thread and runs `f(range, a, b)` on each in
/// parallel, where `a` and `b` are the range's parts of `outs.0` and `outs.1`. Returns each
/// range's result.
pub(crate) fn per_sample<A: Send, B: Send, R: Send>(
    n: usize,
    outs: (PerSample<A>, PerSample<B>),
    f: impl Fn(Range<usize>, &mut [A], &mut [B]) -> R + Sync,
) -> Vec<R> {
    let ((mut a, per_a), (mut b, per_b)) = outs;
    let parts = threads().min(n).max(1);
    let mut work = Vec::with_capacity(parts);
    let mut start = 0;
    for part in 0..parts {
        let end = start + (n - start) / (parts - part);
        let (a_here, a_rest) = std::mem::take(&mut a).split_at_mut((end - start) * per_a);
        let (b_here, b_rest) = std::mem::take(&mut b).split_at_mut((end - start) * per_b);
        work.push((start..end, a_here, b_here));
        (a, b) = (a_rest, b_rest);
        start = end;
    }
    if parts == 1 {
        return work.into_iter().map(|(r, a, b)| f(r, a, b)).collect();
    }
    work.into_par_iter().map(|(r, a, b)| f(r, a, b)).collect()
}

/// Element-wise sum of equally long vectors (per-thread partial gradients).
pub(crate) fn sum_parts(parts: Vec<Vec<f32>>) -> Vec<f32> {
    let mut parts = parts.into_iter();
    let mut total = parts.next().unwrap_or_default();
    for part in parts {
        for (t, p) in total.iter_mut().zip(&part) {
            *t += p;
        }
    }
    total
}
