//! Dropout masks from a counter-based generator, so a mask element depends only on (row seed,
//! dropout site, element position in the row): never on the batch a row landed in, the rank
//! that ran it, or the device. This is what makes 2 workers × B/2 train exactly as 1 worker ×
//! B does, and a resumed run redraw its masks bit for bit. The mask is an op drawn where the
//! tensor it scales is: on a GPU by a kernel (`cuda`) from the rows' keys, bit for bit
//! the host's, so a step uploads a key per row instead of the whole mask; there the mask is
//! applied as it is drawn, never stored.

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "cuda")]
pub(crate) mod residual;

#[cfg(feature = "cuda")]
use candle_core::DType;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// The inverted-dropout masks of one forward pass: rows `n` of `row_len` elements each.
pub struct Dropout<'a> {
    row_seeds: &'a [u64],
    p: f64,
    row_len: usize,
}

impl<'a> Dropout<'a> {
    /// `None` when nothing is dropped (evaluation, or p = 0).
    pub fn new(row_seeds: &'a [u64], p: f64, row_len: usize) -> Option<Self> {
        (p > 0.0).then_some(Dropout {
            row_seeds,
            p,
            row_len,
        })
    }

    /// `x` (any shape holding the rows one after another) with the mask of `site` applied; the
    /// mask is drawn where `x` is, from its shape (the values are not read).
    pub fn apply(&self, x: &Tensor, site: usize) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() && matches!(x.dtype(), DType::F32 | DType::BF16) {
            let op = cuda::ApplyOp::new(self.masks(site), x.dtype());
            return x.contiguous()?.apply_op1(op);
        }
        let mask = x.apply_op1_no_bwd(&MaskOp::new(self.row_seeds, site, self.row_len, self.p))?;
        x.mul(&mask.to_dtype(x.dtype())?)
    }

    /// The masks of `site`, for the GPU's kernels.
    #[cfg(feature = "cuda")]
    fn masks(&self, site: usize) -> cuda::Masks {
        cuda::Masks {
            keys: row_keys(self.row_seeds, site),
            row_len: self.row_len,
            threshold: threshold(self.p),
            keep: keep(self.p),
        }
    }
}

/// `x + dropout(y as f32)` at `site` (no dropout: `None`): the trunk's residual addition. On a
/// GPU one op each way (`residual`), bit for bit these separate ops.
pub fn add_dropped(
    x: &Tensor,
    y: &Tensor,
    dropout: Option<&Dropout>,
    site: usize,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if residual::applies(x, y) {
        let masks = match dropout {
            Some(d) => d.masks(site),
            None => cuda::Masks::keep_all(x.elem_count()),
        };
        let op = residual::ResidualOp(masks);
        return x.contiguous()?.apply_op2(&y.contiguous()?, op);
    }
    let y = y.to_dtype(candle_core::DType::F32)?;
    x + match dropout {
        Some(d) => d.apply(&y, site)?,
        None => y,
    }
}

/// The masks of `site` for every row, concatenated: 0 with probability `p`, else `1/(1-p)`.
/// Each 64-bit output of the generator gives four 16-bit draws (p is resolved to 1/65536).
pub fn mask(row_seeds: &[u64], site: usize, row_len: usize, p: f64) -> Vec<f32> {
    draw(&row_keys(row_seeds, site), row_len, p)
}

/// The masks of rows with these [`row_key`]s, as [`mask`] describes them.
fn draw(keys: &[u64], row_len: usize, p: f64) -> Vec<f32> {
    let (threshold, keep) = (threshold(p), keep(p));
    let mut out = Vec::with_capacity(keys.len() * row_len);
    for &key in keys {
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

/// The generator's keys of these rows at one dropout site.
fn row_keys(row_seeds: &[u64], site: usize) -> Vec<u64> {
    row_seeds.iter().map(|&s| row_key(s, site)).collect()
}

/// The generator's key of one row at one dropout site.
fn row_key(seed: u64, site: usize) -> u64 {
    splitmix64(seed ^ (site as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03))
}

/// Draws (of 65536) below which an element is dropped.
fn threshold(p: f64) -> u64 {
    (p * 65536.0).round() as u64
}

/// The scale of a kept element.
fn keep(p: f64) -> f32 {
    (1.0 / (1.0 - p)) as f32
}

/// The mask of `site` as an op on the tensor it will scale: its output is the f32 mask of the
/// input's shape, computed on the input's device (the input's values are not read).
pub struct MaskOp {
    /// [`row_key`] of each row.
    keys: Vec<u64>,
    row_len: usize,
    p: f64,
}

impl MaskOp {
    pub fn new(row_seeds: &[u64], site: usize, row_len: usize, p: f64) -> Self {
        let keys = row_keys(row_seeds, site);
        MaskOp { keys, row_len, p }
    }

    fn check(&self, shape: &Shape) -> Result<usize> {
        let n = shape.elem_count();
        if n != self.keys.len() * self.row_len {
            candle_core::bail!(
                "dropout mask: {} rows of {} for a tensor of {n} elements",
                self.keys.len(),
                self.row_len
            );
        }
        Ok(n)
    }
}

impl CustomOp1 for MaskOp {
    fn name(&self) -> &'static str {
        "dropout-mask"
    }

    /// The host mask, as [`mask`] draws it (what a GPU's must equal).
    fn cpu_fwd(&self, _: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        self.check(layout.shape())?;
        let out = draw(&self.keys, self.row_len, self.p);
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let n = self.check(layout.shape())?;
        let masks = cuda::Masks {
            keys: self.keys.clone(),
            row_len: self.row_len,
            threshold: threshold(self.p),
            keep: keep(self.p),
        };
        let mask = cuda::draw(&storage.device, &masks, n)?;
        Ok((mask, layout.shape().clone()))
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): a bijective mix of a 64-bit counter, good enough
/// to be used as a random stream indexed by position.
pub fn splitmix64(x: u64) -> u64 {
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

    /// The op (what every device runs) draws exactly the masks `mask` gives, and refuses a
    /// tensor of another size; `cuda`'s test holds the GPU's kernel to this same mask.
    #[test]
    fn the_mask_op_draws_the_host_mask_element_by_element() {
        let (seeds, row_len, p) = ([7u64, 8, 1 << 40], 1_001, 0.1);
        let x = Tensor::zeros(
            (3, 7, 143),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let op = x
            .apply_op1_no_bwd(&MaskOp::new(&seeds, 5, row_len, p))
            .unwrap();
        let drawn: Vec<f32> = op.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(drawn, mask(&seeds, 5, row_len, p));
        let wrong = Tensor::zeros(10, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let err = wrong
            .apply_op1_no_bwd(&MaskOp::new(&seeds, 5, row_len, p))
            .unwrap_err();
        assert!(err.to_string().contains("3 rows of 1001"), "{err}");
    }
}
