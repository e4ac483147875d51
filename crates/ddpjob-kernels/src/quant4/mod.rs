//! 4-bit weights as bitsandbytes stores them (QLoRA's NF4, and FP4): a tensor flattened in
//! blocks of `blocksize` values, each block scaled by its largest magnitude (its absmax) and
//! every value rounded to the nearest of 16 levels, two codes a byte, the first in the high
//! nibble. With double quantisation (`compress_statistics`) the absmaxes, less their mean,
//! are themselves stored as 8-bit codes of bitsandbytes' dynamic map in blocks of 256, each
//! with an f32 absmax of its own. The codes and scales are bitsandbytes' own for the same
//! weights (`bitsandbytes.functional.quantize_4bit` on the CPU; tests against fixtures it
//! made), so a base quantised here is the base bitsandbytes would load, and a checkpoint it
//! saved reads back here.
//!
//! `linear` multiplies by such a weight a panel at a time (QLoRA's frozen layers, made by
//! `[model.quantize]`; `lora_linear_4bit` fuses their adapters beside it). Depends on candle
//! and this crate's host helpers only.

mod linear;
#[cfg(test)]
mod tests;

pub use linear::{Quantized4Weight, quantized_linear};

/// The 16 levels of a 4-bit type, as bitsandbytes' `get_4bit_type` gives them (divided by
/// their largest magnitude).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FourBit {
    /// NormalFloat4 (QLoRA): quantiles of N(0, 1), an exact 0, from -1 to 1.
    Nf4,
    /// A 4-bit float: sign, 2 exponent bits, 1 mantissa bit, as bitsandbytes orders them.
    Fp4,
}

/// `get_4bit_type("nf4")`.
const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// `get_4bit_type("fp4")` before its division by 12 (see [`FourBit::levels`]); its code 8 is
/// -0 there, read back as +0 by bitsandbytes' CPU library, as here.
const FP4: [f32; 16] = [
    0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0,
];

impl FourBit {
    /// The type's levels, indexed by code.
    pub fn levels(self) -> [f32; 16] {
        match self {
            FourBit::Nf4 => NF4,
            FourBit::Fp4 => FP4.map(|v| v / 12.0),
        }
    }

    /// The codes in the order of their levels (torch's argsort, which leaves FP4's code 0
    /// before its code 8, both zero, as a stable sort does), and the midpoints between
    /// neighbours that bitsandbytes rounds at.
    fn bounds(self) -> ([usize; 16], [f32; 15]) {
        let levels = self.levels();
        let mut order: [usize; 16] = std::array::from_fn(|i| i);
        order.sort_by(|&a, &b| levels[a].partial_cmp(&levels[b]).expect("no NaN level"));
        let mids = std::array::from_fn(|i| (levels[order[i]] + levels[order[i + 1]]) / 2.0);
        (order, mids)
    }
}

/// How the block absmaxes are kept.
#[derive(Clone, Debug, PartialEq)]
pub enum Scales {
    /// One f32 per block.
    Plain(Vec<f32>),
    /// Double quantisation: `codes` (one byte per block) of `map` (256 levels) in blocks of
    /// `blocksize`, each scaled by its `absmax`, plus `offset` (the absmaxes' mean).
    Nested {
        codes: Vec<u8>,
        absmax: Vec<f32>,
        map: Vec<f32>,
        blocksize: usize,
        offset: f32,
    },
}

/// A tensor of `len` values in 4 bits: `codes` (two a byte, high nibble first), a scale per
/// block of `blocksize`.
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized4 {
    pub kind: FourBit,
    pub blocksize: usize,
    pub len: usize,
    pub codes: Vec<u8>,
    pub scales: Scales,
}

/// The absmaxes' block size with double quantisation (bitsandbytes' `quantize_4bit`).
pub const NESTED_BLOCK: usize = 256;

/// The largest magnitude of each block of `values`.
fn absmaxes(values: &[f32], blocksize: usize) -> Vec<f32> {
    values
        .chunks(blocksize)
        .map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs())))
        .collect()
}

/// `values` in 4 bits as `quantize_4bit(values, blocksize, compress_statistics = nested,
/// quant_type)` stores them. `blocksize` must be one bitsandbytes takes (32, 64, ..., 4096: the
/// spec checks `model.quantize.block_size`).
pub fn quantize_4bit(values: &[f32], blocksize: usize, kind: FourBit, nested: bool) -> Quantized4 {
    let (order, mids) = kind.bounds();
    let absmax = absmaxes(values, blocksize);
    let whole = values.len() / blocksize;
    let code = |x: f32| order[mids.partition_point(|&m| m < x)] as u8;
    let mut codes = vec![0u8; values.len().div_ceil(2)];
    for (b, (block, &am)) in values.chunks(blocksize).zip(&absmax).enumerate() {
        // torch: whole blocks multiply by the reciprocal, the partial last one divides.
        let inv = 1.0 / am.max(1e-38);
        let scaled = |x: f32| match b < whole {
            true => (x * inv).clamp(-1.0, 1.0),
            false => (x / am.max(1e-38)).clamp(-1.0, 1.0),
        };
        for (i, &x) in block.iter().enumerate() {
            let at = b * blocksize + i;
            let q = code(scaled(x));
            codes[at / 2] |= if at.is_multiple_of(2) { q << 4 } else { q };
        }
    }
    // An odd length pads the last byte's low nibble with the code of 0.
    if !values.len().is_multiple_of(2) {
        *codes.last_mut().expect("an odd length has a last byte") |= code(0.0);
    }
    let scales = match nested {
        false => Scales::Plain(absmax),
        true => {
            let offset = mean(&absmax);
            let shifted: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
            let map = dynamic_map();
            let (codes, absmax) = quantize_blockwise(&shifted, &map, NESTED_BLOCK);
            Scales::Nested {
                codes,
                absmax,
                map: map.to_vec(),
                blocksize: NESTED_BLOCK,
                offset,
            }
        }
    };
    Quantized4 {
        kind,
        blocksize,
        len: values.len(),
        codes,
        scales,
    }
}

/// The mean of `values` as torch computes `absmax.mean()` on the CPU (the sum, then a
/// division), so the offset, and every nested code after it, is bitsandbytes' to the bit.
fn mean(values: &[f32]) -> f32 {
    torch_sum(values, 8) / values.len().max(1) as f32
}

/// torch's f32 sum of a contiguous row on the CPU (`cascade_sum`, `vectorized_inner_sum`;
/// its sum runs on vectors of 8 even where its other kernels take AVX-512's 16: torch 2.15's
/// sums equal this one with 8 lanes, not 16, on an AVX-512 machine): the row as vectors of
/// `lanes`, summed in 4 interleaved rows of vectors through a 4-level
/// cascade of 16 vectors a level, the leftover vectors added to the first row, the rows
/// added together; then the elements after the last whole vector, one by one, and the
/// vector's lanes in order.
// Indexed loops, as torch's, so the order of every addition can be read against its source.
#[allow(clippy::needless_range_loop)]
fn torch_sum(values: &[f32], lanes: usize) -> f32 {
    const ILP: usize = 4;
    const LEVELS: usize = 4;
    let vectors = values.len() / lanes;
    let vector = |i: usize| &values[i * lanes..(i + 1) * lanes];
    let add = |acc: &mut [f32], v: &[f32]| acc.iter_mut().zip(v).for_each(|(a, b)| *a += b);
    let groups = vectors / ILP;
    let power = 4.max(ceil_log2(groups) / LEVELS as u32);
    let (step, mask) = (1usize << power, (1usize << power) - 1);
    let mut acc = vec![vec![vec![0f32; lanes]; ILP]; LEVELS];
    let mut i = 0;
    while i + step <= groups {
        for _ in 0..step {
            for k in 0..ILP {
                add(&mut acc[0][k], vector(i * ILP + k));
            }
            i += 1;
        }
        for j in 1..LEVELS {
            for k in 0..ILP {
                let lower = std::mem::replace(&mut acc[j - 1][k], vec![0f32; lanes]);
                add(&mut acc[j][k], &lower);
            }
            if i & (mask << (j as u32 * power)) != 0 {
                break;
            }
        }
    }
    for g in i..groups {
        for k in 0..ILP {
            add(&mut acc[0][k], vector(g * ILP + k));
        }
    }
    for j in 1..LEVELS {
        for k in 0..ILP {
            let upper = acc[j][k].clone();
            add(&mut acc[0][k], &upper);
        }
    }
    let mut rows = acc.swap_remove(0);
    for v in groups * ILP..vectors {
        add(&mut rows[0], vector(v));
    }
    for k in 1..ILP {
        let row = rows[k].clone();
        add(&mut rows[0], &row);
    }
    let mut total = 0f32;
    for &x in &values[vectors * lanes..] {
        total += x;
    }
    rows[0].iter().fold(total, |t, &lane| t + lane)
}

/// ⌈log₂ n⌉ (0 for n ≤ 1), as c10's `CeilLog2`.
fn ceil_log2(n: usize) -> u32 {
    match n {
        0 | 1 => 0,
        n => usize::BITS - (n - 1).leading_zeros(),
    }
}

/// Bins of [-1, 1] in bitsandbytes' 8-bit quantisation table.
const LUT_SIZE: usize = 65_536;

/// 8-bit blockwise quantisation as bitsandbytes' CPU library does it (`quantize_cpu`): each
/// value times the reciprocal of its block's absmax, that in [-1, 1] cut into 65,536 bins
/// (`(v + 1) · 0.5 · 65535 + 0.5`, truncated), and each bin's code the first level whose
/// midpoint with the next is not below the bin's value. Near a midpoint the bin decides, so a
/// code is not always the nearest level; bitsandbytes' codes are these. A block of zeros has
/// codes 0.
pub fn quantize_blockwise(
    values: &[f32],
    map: &[f32; 256],
    blocksize: usize,
) -> (Vec<u8>, Vec<f32>) {
    let mids: Vec<f32> = map.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
    let mut lut = vec![0u8; LUT_SIZE];
    let mut code = 0;
    for (i, entry) in lut.iter_mut().enumerate() {
        let value = -1.0 + (2.0 * i as f32) / (LUT_SIZE - 1) as f32;
        while code < 255 && mids[code] < value {
            code += 1;
        }
        *entry = code as u8;
    }
    let absmax = absmaxes(values, blocksize);
    let mut codes = Vec::with_capacity(values.len());
    for (block, &am) in values.chunks(blocksize).zip(&absmax) {
        if am == 0.0 {
            codes.extend(std::iter::repeat_n(0, block.len()));
            continue;
        }
        let inv = 1.0 / am;
        for &x in block {
            let v = (x * inv).clamp(-1.0, 1.0);
            let bin = ((v + 1.0) * 0.5 * (LUT_SIZE - 1) as f32 + 0.5) as u16;
            codes.push(lut[bin as usize]);
        }
    }
    (codes, absmax)
}

impl Quantized4 {
    /// Whether its scales are nested (double quantisation).
    pub fn is_nested(&self) -> bool {
        matches!(self.scales, Scales::Nested { .. })
    }

    /// The scale of each block: its absmax, de-quantised first where nested.
    pub fn absmaxes(&self) -> Vec<f32> {
        match &self.scales {
            Scales::Plain(a) => a.clone(),
            Scales::Nested {
                codes,
                absmax,
                map,
                blocksize,
                offset,
            } => codes
                .iter()
                .enumerate()
                .map(|(i, &c)| map[c as usize] * absmax[i / blocksize] + offset)
                .collect(),
        }
    }

    /// Values `range` (whole blocks, or the tensor's end) de-quantised into `out`: level ×
    /// block scale, as `dequantize_4bit` computes them in f32. `scales`: [`Self::absmaxes`].
    pub fn dequantize_into(&self, scales: &[f32], range: std::ops::Range<usize>, out: &mut [f32]) {
        let levels = self.kind.levels();
        for (o, at) in out.iter_mut().zip(range) {
            let byte = self.codes[at / 2];
            let q = if at.is_multiple_of(2) {
                byte >> 4
            } else {
                byte & 0xF
            };
            *o = levels[q as usize] * scales[at / self.blocksize];
        }
    }

    /// Every value de-quantised.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len];
        self.dequantize_into(&self.absmaxes(), 0..self.len, &mut out);
        out
    }
}

/// bitsandbytes' signed dynamic 8-bit map (`create_dynamic_map()`), which double
/// quantisation stores the absmaxes in.
pub fn dynamic_map() -> [f32; 256] {
    DYNAMIC_MAP
}

include!("dynamic_map.rs");
