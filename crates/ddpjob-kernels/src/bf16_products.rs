//! f32 matrix products computed from bfloat16 inputs with f32 sums, for
//! `train.precision = "bf16-matmul"` (torch's `set_float32_matmul_precision("medium")`). On a
//! CPU with AVX512_BF16 (AMD Zen 4 and later, Intel Cooper Lake and Sapphire Rapids and later)
//! one `vdpbf16ps` does 32 products where an f32 FMA does 16, and the f32 kernels already run at
//! the FMA units' peak: this is the only way left to make their products faster. The operands
//! are rounded to bf16 (to nearest even) while they are packed, the sums stay f32 (rounded as
//! the hardware adds), and the result is written as f32: weights, activations and gradients
//! never leave f32 storage.
//!
//! The switch is per process, as candle's TF32 switch and torch's setting are; it is off unless
//! a job asks for it, and cannot be turned on where the CPU lacks the instructions
//! ([`set_bf16_products`] says whether it is on).

// Elsewhere only the switch is used: it never turns on.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::sync::atomic::{AtomicBool, Ordering};

static ON: AtomicBool = AtomicBool::new(false);

/// Whether this CPU has the bf16 dot-product instructions.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Makes the process's CPU kernels compute their f32 products from bf16 inputs, when `wanted`
/// and the CPU can; returns whether they now do.
pub fn set_bf16_products(wanted: bool) -> bool {
    let on = wanted && available();
    ON.store(on, Ordering::Relaxed);
    on
}

/// Whether [`set_bf16_products`] turned the bf16 products on.
pub fn bf16_products() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Whether a product of depth `k` goes through the bf16 kernel: every one with a depth, when
/// the switch is on, whatever its size. A product's value then never depends on how it was
/// cut into blocks, whether between threads (`kernels::gemm`) or into chunks of rows or
/// vocabulary (the GPT's head), since every cut multiplies alike and no cut splits `k`. (A
/// product of depth 0 is all zeros: left to the f32 path, which writes them.)
pub(super) fn wanted_for(k: usize) -> bool {
    bf16_products() && k > 0
}

/// A matrix operand: element (i, j) at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy)]
pub(super) struct Operand {
    pub ptr: *const f32,
    pub rs: usize,
    pub cs: usize,
}

/// The destination: element (i, j) at `ptr + i·rs + j`.
#[derive(Clone, Copy)]
pub(super) struct Dst {
    pub ptr: *mut f32,
    pub rs: usize,
}

/// `dst` = a·b (or += a·b when `accumulate`) for `a` m × k and `b` k × n, single-threaded.
///
/// # Safety
/// [`set_bf16_products`] must have returned true in this process (the CPU has the
/// instructions); every element of `a` (m × k), `b` (k × n) and `dst` (m × n) must be inside
/// its allocation, and nothing else may access `dst` meanwhile.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn gemm(
    (m, n, k): (usize, usize, usize),
    dst: Dst,
    accumulate: bool,
    a: Operand,
    b: Operand,
) {
    let (mut a_pack, mut b_pack, mut scratch) = PACKS.with(|p| p.take());
    let kc_pairs = KC / 2;
    a_pack.resize(MC.div_ceil(MR) * MR * kc_pairs, 0);
    b_pack.resize(NC.div_ceil(NR) * NR * kc_pairs, 0);
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            let pairs = kc.div_ceil(2);
            // SAFETY (of every pack and product below): the blocks stay inside the m × n × k
            // bounds the caller vouches for; the packs were sized for the largest block.
            unsafe { pack_b(&mut b_pack, &mut scratch, b, (pc, kc), (jc, nc)) };
            // The first block of k writes (or adds to) the destination; the others add to it.
            let add = accumulate || pc > 0;
            for ic in (0..m).step_by(MC) {
                let mc = MC.min(m - ic);
                let layout = unsafe { pack_a(&mut a_pack, &mut scratch, a, (ic, mc), (pc, kc)) };
                for jr in (0..nc).step_by(NR) {
                    let b_panel = &b_pack[jr * pairs..];
                    for ir in (0..mc).step_by(MR) {
                        let a_panel = &a_pack[ir * pairs..];
                        let tile = Dst {
                            ptr: dst.ptr.wrapping_add((ic + ir) * dst.rs + jc + jr),
                            rs: dst.rs,
                        };
                        let shape = (MR.min(mc - ir), NR.min(nc - jr));
                        let a_panel = (a_panel, layout);
                        unsafe { tile_product(pairs, a_panel, b_panel, tile, shape, add) };
                    }
                }
            }
        }
    }
    PACKS.with(|p| p.set((a_pack, b_pack, scratch)));
}

/// Rows of a register tile, and its columns (two vectors of 16 f32 sums per row).
const MR: usize = 8;
const NR: usize = 32;
/// The block of `k` packed at a time (its B panel, NR × KC bf16, stays in L1), and the rows
/// and columns packed at a time (A's block in L2, B's in L2 or L3).
const KC: usize = 256;
const MC: usize = 128;
const NC: usize = 1024;

thread_local! {
    /// Each thread's packed A and B blocks and the packers' scratch, kept between products.
    static PACKS: std::cell::Cell<(Vec<u32>, Vec<u32>, Vec<u32>)> = const {
        std::cell::Cell::new((Vec::new(), Vec::new(), Vec::new()))
    };
}

/// `x` rounded to the nearest bf16 (ties to even), as its 16 bits, as the instructions that
/// pack whole chunks round (see `simd`): a NaN stays a NaN, and a subnormal f32 becomes a zero
/// of its sign (the instructions read subnormal inputs as zero). Without branches, so that the
/// packing loops vectorise.
fn bf16_bits(x: f32) -> u32 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let subnormal = bits & 0x7f80_0000 == 0;
    let rounded = if subnormal {
        (bits >> 16) & 0x8000
    } else {
        rounded
    };
    if x.is_nan() {
        (bits >> 16) | 0x40
    } else {
        rounded
    }
}

/// Two values as one pair of bf16, the first in the low half (the instruction's even element).
fn pair(first: f32, second: f32) -> u32 {
    bf16_bits(first) | (bf16_bits(second) << 16)
}

/// Pair `p` of a run of `kc` values, `value(i)` the i-th: values 2p and 2p + 1, the second
/// zero past the end (an odd `kc`).
fn pair_of(kc: usize, p: usize, value: impl Fn(usize) -> f32) -> u32 {
    let second = if 2 * p + 1 < kc {
        value(2 * p + 1)
    } else {
        0.0
    };
    pair(value(2 * p), second)
}

/// Where a packed A panel keeps row r's pair p: at `r · row + p · step`.
#[derive(Clone, Copy)]
struct PanelLayout {
    row: usize,
    step: usize,
}

/// Packs rows `ic..ic+mc`, columns (of k) `pc..pc+kc` of `a` as panels of MR rows (the rows
/// past `mc` zeros) of `pairs` pairs: pair p of row r holds a(r, 2p) and a(r, 2p+1), the last
/// one's second value zero when kc is odd. Row-major `a`: each panel row by row (its values
/// are read in order); otherwise pair by pair, MR rows at a time.
///
/// # Safety
/// The block must lie inside `a`'s allocation, and the CPU must have AVX512_BF16.
unsafe fn pack_a(
    pack: &mut [u32],
    scratch: &mut Vec<u32>,
    a: Operand,
    (ic, mc): (usize, usize),
    (pc, kc): (usize, usize),
) -> PanelLayout {
    let pairs = kc.div_ceil(2);
    let at = |i: usize, p: usize| unsafe { *a.ptr.add((ic + i) * a.rs + (pc + p) * a.cs) };
    let panels = mc.div_ceil(MR);
    if a.cs == 1 {
        for (panel, dst) in pack.chunks_mut(MR * pairs).take(panels).enumerate() {
            for (r, row) in dst.chunks_mut(pairs).enumerate() {
                let i = panel * MR + r;
                if i >= mc {
                    row.fill(0);
                    continue;
                }
                // SAFETY: row i's kc values from column pc, inside `a` (the caller).
                let src =
                    unsafe { std::slice::from_raw_parts(a.ptr.add((ic + i) * a.rs + pc), kc) };
                // SAFETY: the caller vouches for the instructions.
                unsafe { pack_pairs(row, src) };
            }
        }
        return PanelLayout {
            row: pairs,
            step: 1,
        };
    }
    if a.rs == 1 {
        // Column-major: pair p of every row from two columns read in order, into a line (the
        // rows past mc zeros) that is then cut into the panels.
        scratch.clear();
        scratch.resize(mc.next_multiple_of(MR), 0);
        // SAFETY (of `column`): column pc + c's mc values from row ic, inside `a` (the caller).
        let column =
            |c: usize| unsafe { std::slice::from_raw_parts(a.ptr.add(ic + (pc + c) * a.cs), mc) };
        for p in 0..pairs {
            let odd = (2 * p + 1 < kc).then(|| column(2 * p + 1));
            // SAFETY: the caller vouches for the instructions.
            unsafe { pack_interleaved(scratch, column(2 * p), odd) };
            for (panel, rows) in scratch.chunks(MR).enumerate() {
                let at = panel * MR * pairs + p * MR;
                pack[at..at + MR].copy_from_slice(rows);
            }
        }
        return PanelLayout { row: 1, step: MR };
    }
    for (panel, dst) in pack.chunks_mut(MR * pairs).take(panels).enumerate() {
        let rows = MR.min(mc - panel * MR);
        let first = panel * MR;
        for (p, out) in dst.chunks_mut(MR).enumerate() {
            for (r, o) in out.iter_mut().enumerate() {
                *o = if r < rows {
                    pair_of(kc, p, |i| at(first + r, i))
                } else {
                    0
                };
            }
        }
    }
    PanelLayout { row: 1, step: MR }
}

/// `src`'s values as pairs of bf16 into `dst` (`src.len()` halves, rounded up; an odd last
/// value paired with zero).
///
/// # Safety
/// The CPU must have AVX512_BF16 (on x86-64).
unsafe fn pack_pairs(dst: &mut [u32], src: &[f32]) {
    // SAFETY: the caller vouches for the instructions.
    #[cfg(target_arch = "x86_64")]
    let done = unsafe { simd::pairs(dst, src) };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    let rest = &src[2 * done..];
    let dst = &mut dst[done..];
    for (d, s) in dst.iter_mut().zip(rest.chunks(2)) {
        *d = pair(s[0], s.get(1).copied().unwrap_or(0.0));
    }
}

/// `dst[j]` = the pair (`even[j]`, `odd[j]`), for every j of `even` (`odd` as long; `None`:
/// zeros).
///
/// # Safety
/// The CPU must have AVX512_BF16 (on x86-64).
unsafe fn pack_interleaved(dst: &mut [u32], even: &[f32], odd: Option<&[f32]>) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if let Some(odd) = odd {
        // SAFETY: the caller vouches for the instructions.
        done = unsafe { simd::interleaved(dst, even, odd) };
    }
    for (j, d) in dst.iter_mut().enumerate().take(even.len()).skip(done) {
        *d = pair(even[j], odd.map_or(0.0, |o| o[j]));
    }
}

/// The packing's conversions, 16 values at a time. The instructions round as [`bf16_bits`]
/// does, except that they read f32 subnormals as zero: the products read bf16 subnormals as
/// zero anyway, so the results are the same.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// As many whole 32-value chunks of `src` as fit, as pairs into `dst`; returns the pairs
    /// written.
    ///
    /// # Safety
    /// The CPU must have AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn pairs(dst: &mut [u32], src: &[f32]) -> usize {
        let chunks = (src.len() / 32).min(dst.len() / 16);
        for c in 0..chunks {
            // SAFETY: chunk c's 32 values and 16 pairs are inside the slices (`chunks`).
            unsafe {
                let lo = _mm512_loadu_ps(src.as_ptr().add(32 * c));
                let hi = _mm512_loadu_ps(src.as_ptr().add(32 * c + 16));
                let bf = _mm512_cvtne2ps_pbh(hi, lo);
                _mm512_storeu_si512(
                    dst.as_mut_ptr().add(16 * c).cast(),
                    std::mem::transmute::<__m512bh, __m512i>(bf),
                );
            }
        }
        16 * chunks
    }

    /// `dst[j]` = (even[j], odd[j]) for the whole 16-value chunks; returns how many.
    ///
    /// # Safety
    /// The CPU must have AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn interleaved(dst: &mut [u32], even: &[f32], odd: &[f32]) -> usize {
        let chunks = even.len().min(odd.len()).min(dst.len()) / 16;
        for c in 0..chunks {
            // SAFETY: chunk c is inside all three slices (`chunks`).
            unsafe {
                let e = _mm512_cvtneps_pbh(_mm512_loadu_ps(even.as_ptr().add(16 * c)));
                let o = _mm512_cvtneps_pbh(_mm512_loadu_ps(odd.as_ptr().add(16 * c)));
                let e = _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(e));
                let o = _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(o));
                let both = _mm512_or_si512(e, _mm512_slli_epi32::<16>(o));
                _mm512_storeu_si512(dst.as_mut_ptr().add(16 * c).cast(), both);
            }
        }
        16 * chunks
    }
}

/// Packs rows (of k) `pc..pc+kc`, columns `jc..jc+nc` of `b` as panels of NR columns, each
/// `[pair][column]`. Missing columns and a missing last element are zeros. Row-major `b`: a
/// panel's pair rows from two rows of `b` at a time; column-major: each column's pairs in
/// order into `scratch`, then moved into place.
///
/// # Safety
/// The block must lie inside `b`'s allocation, and the CPU must have AVX512_BF16.
unsafe fn pack_b(
    pack: &mut [u32],
    scratch: &mut Vec<u32>,
    b: Operand,
    (pc, kc): (usize, usize),
    (jc, nc): (usize, usize),
) {
    let pairs = kc.div_ceil(2);
    // SAFETY (of `row` and `column`): inside `b` (the caller).
    let row = |p: usize, j: usize, n: usize| unsafe {
        std::slice::from_raw_parts(b.ptr.add((pc + p) * b.rs + jc + j), n)
    };
    let column =
        |j: usize| unsafe { std::slice::from_raw_parts(b.ptr.add((jc + j) * b.cs + pc), kc) };
    let at = |p: usize, j: usize| unsafe { *b.ptr.add((pc + p) * b.rs + (jc + j) * b.cs) };
    for (panel, dst) in pack
        .chunks_mut(NR * pairs)
        .take(nc.div_ceil(NR))
        .enumerate()
    {
        let cols = NR.min(nc - panel * NR);
        let first = panel * NR;
        if b.cs == 1 {
            for (p, out) in dst.chunks_mut(NR).enumerate() {
                let odd = (2 * p + 1 < kc).then(|| row(2 * p + 1, first, cols));
                // SAFETY: the caller vouches for the instructions.
                unsafe { pack_interleaved(out, row(2 * p, first, cols), odd) };
                out[cols..].fill(0);
            }
        } else if b.rs == 1 {
            scratch.resize(NR * pairs, 0);
            for (j, pairs_of_j) in scratch.chunks_mut(pairs).take(cols).enumerate() {
                // SAFETY: the caller vouches for the instructions.
                unsafe { pack_pairs(pairs_of_j, column(first + j)) };
            }
            for (p, out) in dst.chunks_mut(NR).enumerate() {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = if j < cols { scratch[j * pairs + p] } else { 0 };
                }
            }
        } else {
            for (p, out) in dst.chunks_mut(NR).enumerate() {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = if j < cols {
                        pair_of(kc, p, |i| at(i, first + j))
                    } else {
                        0
                    };
                }
            }
        }
    }
}

/// One register tile: `rows × cols` (at most MR × NR) of `dst` = (or +=, when `add`) the
/// product of an A panel and a B panel of `pairs` pairs.
///
/// # Safety
/// The CPU must have AVX512_BF16; the panels must hold `pairs` pairs; `dst`'s `rows` rows of
/// `cols` values must be writable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_product(
    pairs: usize,
    (a, layout): (&[u32], PanelLayout),
    b: &[u32],
    dst: Dst,
    (rows, cols): (usize, usize),
    add: bool,
) {
    use std::arch::x86_64::*;
    assert!(a.len() >= pairs * MR && b.len() >= pairs * NR);
    assert!((MR - 1) * layout.row + (pairs - 1) * layout.step < pairs * MR);
    let mut sums = [[_mm512_setzero_ps(); 2]; MR];
    for p in 0..pairs {
        // SAFETY: p < pairs, within the panels (asserted above); unaligned loads.
        let (b0, b1): (__m512bh, __m512bh) = unsafe {
            let at = b.as_ptr().add(p * NR);
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at.cast())),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at.add(16).cast())),
            )
        };
        for (r, sum) in sums.iter_mut().enumerate() {
            // SAFETY: inside the panel (asserted above); the same 512 bits read as 32 bf16.
            let a_pair = unsafe { *a.get_unchecked(r * layout.row + p * layout.step) };
            let a_pair: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi32(a_pair as i32)) };
            sum[0] = _mm512_dpbf16_ps(sum[0], a_pair, b0);
            sum[1] = _mm512_dpbf16_ps(sum[1], a_pair, b1);
        }
    }
    let mask = |from: usize| -> __mmask16 {
        let n = cols.saturating_sub(from).min(16);
        ((1u32 << n) - 1) as __mmask16
    };
    let masks = [mask(0), mask(16)];
    for (r, row_sums) in sums.iter().enumerate().take(rows) {
        for (half, (&sum, &m)) in row_sums.iter().zip(&masks).enumerate() {
            let at = dst.ptr.wrapping_add(r * dst.rs + 16 * half);
            // SAFETY: the mask covers only the tile's `cols` columns, which the caller vouches
            // for; masked-off lanes are neither read nor written.
            unsafe {
                let value = if add {
                    _mm512_add_ps(_mm512_maskz_loadu_ps(m, at), sum)
                } else {
                    sum
                };
                _mm512_mask_storeu_ps(at, m, value);
            }
        }
    }
}

#[cfg(test)]
mod tests;
