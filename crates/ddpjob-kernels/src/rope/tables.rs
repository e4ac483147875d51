//! Rotary position embeddings in Hugging Face's convention: a head's channels are two halves
//! that share frequencies (`rotate_half`), not the interleaved pairs of the RoFormer paper, so
//! `q·cos + rotate_half(q)·sin` with `rotate_half(x) = cat(-x[d/2:], x[:d/2])` and inverse
//! frequencies `theta^(-2i/d)`, rescaled as Llama 3.1/3.2's `rope_type = "llama3"` says.

use candle_core::{D, DType, Device, Result, Tensor};

/// `rope_scaling` of `rope_type = "llama3"` (Llama 3.1 and 3.2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// The `head_dim / 2` inverse frequencies, as `transformers`' `_compute_default_rope_parameters`
/// and `_compute_llama3_parameters` compute them.
pub fn inverse_frequencies(
    head_dim: usize,
    theta: f64,
    scaling: Option<Llama3Scaling>,
) -> Vec<f64> {
    let half = head_dim / 2;
    let base: Vec<f64> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect();
    let Some(s) = scaling else {
        return base;
    };
    let old = s.original_max_position_embeddings as f64;
    let low_wavelen = old / s.low_freq_factor;
    let high_wavelen = old / s.high_freq_factor;
    base.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

/// The cos and sin of every position's angles, [positions, head_dim] each (both halves of a
/// head repeat the frequencies), f32.
pub struct RopeTables {
    pub cos: Tensor,
    pub sin: Tensor,
}

impl RopeTables {
    pub fn new(inv_freq: &[f64], positions: usize, device: &Device) -> Result<Self> {
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(positions * 2 * half);
        let mut sin = Vec::with_capacity(positions * 2 * half);
        for p in 0..positions {
            for _ in 0..2 {
                for f in inv_freq {
                    // transformers takes the angle as an f32 product: do the same, then cos/sin.
                    let angle = (p as f32 * *f as f32) as f64;
                    cos.push(angle.cos() as f32);
                    sin.push(angle.sin() as f32);
                }
            }
        }
        Ok(RopeTables {
            cos: Tensor::from_vec(cos, (positions, 2 * half), device)?,
            sin: Tensor::from_vec(sin, (positions, 2 * half), device)?,
        })
    }

    /// Rotates `x` [n, t, heads, head_dim] whose positions start at `offset`, in f32 (the
    /// result has the dtype of `x`). Differentiable: composed from candle's ops.
    pub fn apply(&self, x: &Tensor, offset: usize) -> Result<Tensor> {
        if let Some(fused) = super::rope(x, &self.cos, &self.sin, offset) {
            return fused;
        }
        self.apply_with_ops(x, offset)
    }

    /// Rotates `x` [n, t, heads, head_dim] whose positions are `positions` ([n·t] u32, each
    /// row's own: packed examples restart at 0), in f32 (the result has the dtype of `x`).
    pub fn apply_at(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
        if crate::host::applies(x) {
            let rows = |m: &Tensor| {
                m.index_select(positions, 0)?
                    .flatten_all()?
                    .to_vec1::<f32>()
            };
            if let Some(fused) = super::rope_per_token(x, rows(&self.cos)?, rows(&self.sin)?) {
                return fused;
            }
        }
        self.apply_at_with_ops(x, positions)
    }

    /// [`RopeTables::apply_at`] composed from candle's ops (GPU, bf16; the fused op's
    /// reference).
    pub fn apply_at_with_ops(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
        let (n, t, _, hd) = x.dims4()?;
        let cos = self.cos.index_select(positions, 0)?;
        let sin = self.sin.index_select(positions, 0)?;
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?;
        let cos = cos.reshape((n, t, 1, hd))?;
        let sin = sin.reshape((n, t, 1, hd))?;
        let rotated = rotate_half(&x)?;
        (x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?.to_dtype(dtype)
    }

    /// [`RopeTables::apply`] composed from candle's ops (GPU, bf16; the fused op's reference).
    pub fn apply_with_ops(&self, x: &Tensor, offset: usize) -> Result<Tensor> {
        let (_, t, _, hd) = x.dims4()?;
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?;
        let cos = self.cos.narrow(0, offset, t)?.reshape((1, t, 1, hd))?;
        let sin = self.sin.narrow(0, offset, t)?.reshape((1, t, 1, hd))?;
        let rotated = rotate_half(&x)?;
        (x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?.to_dtype(dtype)
    }
}

/// `cat(-x[..., d/2:], x[..., :d/2])`.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let first = x.narrow(D::Minus1, 0, d / 2)?;
    let second = x.narrow(D::Minus1, d / 2, d - d / 2)?;
    Tensor::cat(&[&second.neg()?, &first], D::Minus1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies_are_theta_to_the_minus_2i_over_d() {
        let f = inverse_frequencies(8, 10_000.0, None);
        // torch: 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        //      = [1.0, 0.1, 0.01, 0.001]
        let expected = [1.0, 0.1, 0.01, 0.001];
        for (a, b) in f.iter().zip(expected) {
            assert!((a - b).abs() < 1e-12, "{f:?}");
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let s = Llama3Scaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let base = inverse_frequencies(64, 500_000.0, None);
        let scaled = inverse_frequencies(64, 500_000.0, Some(s));
        // Wavelength 2π/f: under 8192/4 = 2048 kept, over 8192 divided by 32, smooth between.
        for (b, x) in base.iter().zip(&scaled) {
            let wavelen = 2.0 * std::f64::consts::PI / b;
            if wavelen < 2048.0 {
                assert_eq!(b, x);
            } else if wavelen > 8192.0 {
                assert!((x - b / 32.0).abs() < 1e-15);
            } else {
                assert!(*x < *b && *x > b / 32.0, "{b} → {x}");
            }
        }
        // transformers 5.24's `ROPE_INIT_FUNCTIONS["llama3"]` for this config (Llama 3.2's
        // values, head_dim 64): index 16 is in the smooth band, 1.414213e-03 → 4.295567e-04;
        // index 20 is divided, 2.742482e-04 → 8.570256e-06; index 14 is kept, 3.211446e-03.
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6 * b;
        assert!(
            close(base[16], 1.414213e-3) && close(scaled[16], 4.295567e-4),
            "{scaled:?}"
        );
        assert!(close(scaled[20], 8.570256e-6), "{}", scaled[20]);
        assert!(close(scaled[14], 3.211446e-3), "{}", scaled[14]);
    }

    #[test]
    fn rotation_matches_rotate_half_by_hand() {
        // One head of 4 channels at position 1, frequencies [1, 0.01]: angles 1 and 0.01.
        // q·cos + rotate_half(q)·sin with q = [1, 2, 3, 4]:
        //   [1·cos1 - 3·sin1, 2·cos.01 - 4·sin.01, 3·cos1 + 1·sin1, 4·cos.01 + 2·sin.01]
        let tables = RopeTables::new(&[1.0, 0.01], 2, &Device::Cpu).unwrap();
        let q = Tensor::new(&[1f32, 2., 3., 4.], &Device::Cpu)
            .unwrap()
            .reshape((1, 1, 1, 4))
            .unwrap();
        let got: Vec<f32> = tables
            .apply(&q, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let (c1, s1, c2, s2) = (1f32.cos(), 1f32.sin(), 0.01f32.cos(), 0.01f32.sin());
        let want = [
            c1 - 3. * s1,
            2. * c2 - 4. * s2,
            3. * c1 + s1,
            4. * c2 + 2. * s2,
        ];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
        // Position 0 is the identity.
        let same: Vec<f32> = tables
            .apply(&q, 0)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(same, vec![1., 2., 3., 4.]);
    }
}

#[cfg(test)]
mod fused {
    use candle_core::{Device, Tensor, Var};

    use super::{RopeTables, inverse_frequencies};
    use crate::testing::random;
    use crate::testing::same_with_gradients;

    #[test]
    fn rope_at_each_tokens_own_position_matches_candle_ops_with_gradients() {
        let dev = &Device::Cpu;
        let tables = RopeTables::new(&inverse_frequencies(8, 10_000.0, None), 16, dev).unwrap();
        // 2 rows of 5 positions, 3 heads of 8: packed examples restart their positions.
        let positions = Tensor::new(&[0u32, 1, 2, 0, 1, 0, 1, 2, 3, 4], dev).unwrap();
        let values: Vec<f32> = (0..2 * 5 * 3 * 8).map(|i| (i as f32 * 0.3).cos()).collect();
        let x = Var::from_tensor(&Tensor::from_vec(values, (2, 5, 3, 8), dev).unwrap()).unwrap();
        same_with_gradients(
            &[x],
            |v| tables.apply_at(v[0], &positions).unwrap(),
            |v| tables.apply_at_with_ops(v[0], &positions).unwrap(),
            1e-6,
        );
    }

    #[test]
    fn the_fused_rotation_matches_candle_ops_with_gradients() {
        let rope =
            RopeTables::new(&inverse_frequencies(8, 10_000.0, None), 12, &Device::Cpu).unwrap();
        for offset in [0, 3] {
            let x = random(&[2, 9, 3, 8], 0.0, 5 + offset as u64);
            same_with_gradients(
                &[x],
                |t| rope.apply(t[0], offset).unwrap(),
                |t| rope.apply_with_ops(t[0], offset).unwrap(),
                1e-5,
            );
        }
    }
}
