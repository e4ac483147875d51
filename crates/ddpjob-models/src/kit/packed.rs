//! Packed token windows: several examples in one row of a batch (instruction data with
//! `data.pack = true`), as Hugging Face's `position_ids` packing does. A packed batch's inputs
//! are [n, t, 2]: each position's token id and its position within its example (0 where an
//! example starts). A language model of ddpjob restarts its positions there and lets no
//! position attend across the boundary, so each example is computed as if it were alone; an
//! unpacked batch's inputs stay [n, t] token ids.

use candle_core::{D, DType, Device, Result, Tensor, bail};

/// What a packed batch adds to its token ids.
pub struct Packing {
    /// Each position's position within its example, [n·t] u32.
    pub positions: Tensor,
    /// [n, 1, t, t]: 0 where a query may see a key (the key is in its example and not after
    /// it), -inf elsewhere; made when first asked for (the fused CPU attention needs only
    /// `starts`), once a forward pass.
    mask: std::sync::OnceLock<Tensor>,
    rows: (usize, usize),
    device: Device,
    /// Each position's first visible key (its example's first position in the row), [n·t]:
    /// the fused CPU attention's form of the mask.
    pub starts: std::sync::Arc<Vec<u32>>,
}

/// (rows, positions per row) of token inputs, packed or not.
pub fn rows(xs: &Tensor) -> Result<(usize, usize)> {
    match xs.dims() {
        &[n, t] => Ok((n, t)),
        &[n, t, 2] => Ok((n, t)),
        other => bail!("token inputs: expected [n, t] ids or [n, t, 2] packed, got {other:?}"),
    }
}

/// The token ids [n, t] of `xs`, and its [`Packing`] when packed.
pub fn split(xs: &Tensor) -> Result<(Tensor, Option<Packing>)> {
    if xs.rank() == 2 {
        return Ok((xs.clone(), None));
    }
    let (n, t) = rows(xs)?;
    let tokens = xs.narrow(2, 0, 1)?.squeeze(2)?.contiguous()?;
    let positions = xs.narrow(2, 1, 1)?.flatten_all()?.contiguous()?;
    // Read on the host (the loader made them there): where each row's examples start.
    let host = positions.to_dtype(DType::U32)?.to_vec1::<u32>()?;
    let mut starts = Vec::with_capacity(n * t);
    for row in host.chunks_exact(t) {
        for (i, &p) in row.iter().enumerate() {
            if p as usize > i {
                bail!("packed inputs: position {p} at index {i} of a row: before the row starts");
            }
            starts.push(i as u32 - p);
        }
    }
    Ok((
        tokens,
        Some(Packing {
            positions,
            mask: std::sync::OnceLock::new(),
            rows: (n, t),
            device: xs.device().clone(),
            starts: std::sync::Arc::new(starts),
        }),
    ))
}

impl Packing {
    /// The additive attention mask (see the field), made on first use.
    pub fn mask(&self) -> Result<&Tensor> {
        if let Some(mask) = self.mask.get() {
            return Ok(mask);
        }
        // Query i sees key j when j ≤ i and j is in i's example (j ≥ its first position).
        let (n, t) = self.rows;
        let mut mask = vec![f32::NEG_INFINITY; n * t * t];
        for (row, starts) in self.starts.chunks_exact(t).enumerate() {
            for (i, &start) in starts.iter().enumerate() {
                mask[(row * t + i) * t..][start as usize..=i].fill(0.0);
            }
        }
        let made = Tensor::from_vec(mask, (n, 1, t, t), &self.device)?;
        Ok(self.mask.get_or_init(|| made))
    }
}

/// Self-attention of `qkv` [n, t, 3C] (q, k, v side by side, `heads` heads each) within each
/// example of `packing`: the attended values [n, t, C]. The fused CPU op for f32 on the CPU,
/// else composed from candle's ops under [`Packing::mask`] (scores and softmax in f32).
pub fn attention(qkv: &Tensor, heads: usize, packing: &Packing) -> Result<Tensor> {
    let (n, t, c3) = qkv.dims3()?;
    if ddpjob_kernels::applies(qkv) {
        let rows = qkv.reshape((n * t, c3))?;
        let y = super::attention::packed_attention(&rows, heads, t, packing.starts.clone())?;
        return y.reshape((n, t, c3 / 3));
    }
    attention_with_ops(qkv, heads, packing.mask()?)
}

/// [`attention`] composed from candle's ops under `mask` (GPU, bf16; the fused op's reference).
pub fn attention_with_ops(qkv: &Tensor, heads: usize, mask: &Tensor) -> Result<Tensor> {
    let (n, t, c3) = qkv.dims3()?;
    let hd = c3 / 3 / heads;
    let (q, k, v) = super::attention::split_heads(qkv, heads)?;
    let dtype = q.dtype();
    let scale = 1.0 / (hd as f64).sqrt();
    let scores = (q.matmul(&k.t()?)?.to_dtype(DType::F32)? * scale)?.broadcast_add(mask)?;
    let att = candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(dtype)?;
    att.matmul(&v)?.transpose(1, 2)?.reshape((n, t, c3 / 3))
}

/// Checks that `model` computes each example of a packed row as if it were alone, and that
/// changing one example leaves the others' logits bit for bit (for each language model's
/// tests).
#[cfg(test)]
pub fn check_examples_are_computed_alone(model: &dyn crate::Model) {
    use crate::Mode;
    let dev = &Device::Cpu;
    let packed = |a: &[u32], b: &[u32]| {
        let pairs: Vec<u32> = a
            .iter()
            .enumerate()
            .chain(b.iter().enumerate())
            .flat_map(|(p, &id)| [id, p as u32])
            .collect();
        let xs = Tensor::from_vec(pairs, (1, a.len() + b.len(), 2), dev).unwrap();
        model.forward(&xs, &Mode::Eval).unwrap()
    };
    let alone = |a: &[u32]| {
        let xs = Tensor::new(a, dev).unwrap().unsqueeze(0).unwrap();
        model.forward(&xs, &Mode::Eval).unwrap()
    };
    let diff = |x: &Tensor, y: &Tensor| -> f32 {
        let d = (x - y).unwrap().abs().unwrap().flatten_all().unwrap();
        d.max(0).unwrap().to_scalar().unwrap()
    };
    let (a, b, other) = ([5u32, 17, 42, 7], [9u32, 3, 250, 11, 2], [1u32, 2, 3, 4]);
    let both = packed(&a, &b);
    assert!(diff(&both.narrow(1, 0, 4).unwrap(), &alone(&a)) < 1e-5);
    assert!(diff(&both.narrow(1, 4, 5).unwrap(), &alone(&b)) < 1e-5);
    let changed = packed(&other, &b);
    assert_eq!(
        diff(
            &both.narrow(1, 4, 5).unwrap(),
            &changed.narrow(1, 4, 5).unwrap()
        ),
        0.0,
        "the second example's logits moved with the first's tokens"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_sees_its_own_example_up_to_itself() {
        // One row: an example of 2 positions, then one of 3.
        let (_, packing) = split(
            &Tensor::new(&[[[7u32, 0], [8, 1], [9, 0], [4, 1], [5, 2]]], &Device::Cpu).unwrap(),
        )
        .unwrap();
        let mask = packing.unwrap().mask().unwrap().flatten_all().unwrap();
        let seen: Vec<u8> = mask
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|&v| u8::from(v == 0.0))
            .collect();
        #[rustfmt::skip]
        let expected = [
            1, 0, 0, 0, 0,
            1, 1, 0, 0, 0,
            0, 0, 1, 0, 0,
            0, 0, 1, 1, 0,
            0, 0, 1, 1, 1,
        ];
        assert_eq!(seen, expected);
        let bad = Tensor::new(&[[[7u32, 1], [8, 2]]], &Device::Cpu).unwrap();
        assert!(split(&bad).is_err());
    }

    #[test]
    fn the_fused_packed_attention_matches_the_masked_ops_with_gradients() {
        use candle_core::Var;
        // 2 rows of 6 positions: examples of 2 + 4, and 3 + 1 + 2; 2 heads of 4 channels.
        let positions: [u32; 12] = [0, 1, 0, 1, 2, 3, 0, 1, 2, 0, 0, 1];
        let tokens: Vec<u32> = positions.iter().flat_map(|&p| [1, p]).collect();
        let xs = Tensor::from_vec(tokens, (2, 6, 2), &Device::Cpu).unwrap();
        let (_, packing) = split(&xs).unwrap();
        let packing = packing.unwrap();
        let values: Vec<f32> = (0..2 * 6 * 24).map(|i| (i as f32 * 0.61).sin()).collect();
        let qkv =
            Var::from_tensor(&Tensor::from_vec(values, (2, 6, 24), &Device::Cpu).unwrap()).unwrap();
        let fused = attention(qkv.as_tensor(), 2, &packing).unwrap();
        let composed = attention_with_ops(qkv.as_tensor(), 2, packing.mask().unwrap()).unwrap();
        let diff = |a: &Tensor, b: &Tensor| -> f32 {
            let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
            d.max(0).unwrap().to_scalar().unwrap()
        };
        assert!(diff(&fused, &composed) < 1e-5);
        let gf = ddpjob_kernels::uneven_sum(&fused).backward().unwrap();
        let gc = ddpjob_kernels::uneven_sum(&composed).backward().unwrap();
        assert!(diff(gf.get(&qkv).unwrap(), gc.get(&qkv).unwrap()) < 1e-5);
    }
}
