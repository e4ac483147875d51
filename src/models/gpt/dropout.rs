//! Dropout masks drawn on the host from a counter-based generator, so a mask element depends
//! only on (row seed, dropout site, element position in the row): never on the batch a row
//! landed in, the rank that ran it, or the device. This is what makes 2 workers × B/2 train
//! exactly as 1 worker × B does, and a resumed run redraw its masks bit for bit.

use candle_core::{Device, Result, Tensor};

/// The inverted-dropout masks of one forward pass: rows `n` of `row_len` elements each.
pub(super) struct Dropout<'a> {
    row_seeds: &'a [u64],
    p: f64,
    row_len: usize,
    device: &'a Device,
}

impl<'a> Dropout<'a> {
    /// `None` when nothing is dropped (evaluation, or p = 0).
    pub(super) fn new(
        row_seeds: &'a [u64],
        p: f64,
        row_len: usize,
        device: &'a Device,
    ) -> Option<Self> {
        (p > 0.0).then_some(Dropout {
            row_seeds,
            p,
            row_len,
            device,
        })
    }

    /// `x` (any shape holding the rows one after another) with the mask of `site` applied.
    pub(super) fn apply(&self, x: &Tensor, site: usize) -> Result<Tensor> {
        let values = mask(self.row_seeds, site, self.row_len, self.p);
        let mask = Tensor::from_vec(values, x.shape(), self.device)?.to_dtype(x.dtype())?;
        x.mul(&mask)
    }
}

/// The masks of `site` for every row, concatenated: 0 with probability `p`, else `1/(1-p)`.
/// Each 64-bit output of the generator gives four 16-bit draws (p is resolved to 1/65536).
pub(super) fn mask(row_seeds: &[u64], site: usize, row_len: usize, p: f64) -> Vec<f32> {
    let threshold = (p * 65536.0).round() as u64;
    let keep = (1.0 / (1.0 - p)) as f32;
    let mut out = Vec::with_capacity(row_seeds.len() * row_len);
    for &seed in row_seeds {
        let key = splitmix64(seed ^ (site as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
        let start = out.len();
        for word in 0..row_len.div_ceil(4) as u64 {
            let bits = splitmix64(key.wrapping_add(word));
            for lane in 0..4 {
                let draw = (bits >> (16 * lane)) & 0xffff;
                out.push(if draw < threshold { 0.0 } else { keep });
            }
        }
        out.truncate(start + row_len);
    }
    out
}

/// SplitMix64 (Steele, Lea, Flood 2014): a bijective mix of a 64-bit counter, good enough
/// to be used as a random stream indexed by position.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_keep_the_expected_fraction_and_depend_on_row_and_site_only() {
        let m = mask(&[7, 8], 3, 10_001, 0.2);
        assert_eq!(m.len(), 20_002);
        let kept = m.iter().filter(|&&v| v > 0.0).count() as f64 / m.len() as f64;
        assert!((kept - 0.8).abs() < 0.01, "kept {kept}");
        assert!(m.iter().all(|&v| v == 0.0 || v == 1.25));
        // Row 8's mask is the same whether or not row 7 comes before it.
        assert_eq!(mask(&[8], 3, 10_001, 0.2)[..], m[10_001..]);
        assert_ne!(mask(&[8], 4, 10_001, 0.2)[..], m[10_001..]);
    }
}
