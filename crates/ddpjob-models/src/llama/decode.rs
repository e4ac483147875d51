//! `sample` with a KV cache for the llama family: each new token's q, k and v are computed
//! once, its keys and values kept per layer, and its query attends to the cached keys within
//! its layer's window (a sliding window's keys older than the window are not seen, as in
//! training). Every family of the llama kit goes through the same layers (qk-norms, NoPE,
//! Gemma's sliding and full layers, mixtures of experts), so what it samples is what
//! `forward` over the whole context gives.

use candle_core::{D, DType, Error, Result, Tensor};

use super::{Llama, Position, repeat_kv};
use crate::kit::add_residual;
use crate::{KvCache, KvDecoder, Mode};
use ddpjob_kernels::rms_norm;

impl KvDecoder for Llama {
    fn forward_cached(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let c = &self.config;
        let (past, new) = (cache.len(), tokens.len());
        if new == 0 || past + new > c.block_size {
            return Err(Error::Msg(format!(
                "llama: {past} cached and {new} new positions, block_size is {}",
                c.block_size
            )));
        }
        let device = self.embed.as_tensor().device();
        let ids = Tensor::new(tokens, device)?.unsqueeze(0)?;
        let mut x = self.embed_tokens(&ids)?;
        let eps = c.rms_norm_eps;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &self.norm_weight(&layer.input_norm)?, eps)?;
            let at = Position::From(past);
            let (q, k, v) = self.rotated_qkv(layer, &h, (1, new), at, &Mode::Eval)?;
            // [1, kv_heads, t, hd], the cache's layout.
            let (k, v) = (
                k.transpose(1, 2)?.contiguous()?,
                v.transpose(1, 2)?.contiguous()?,
            );
            let (k, v) = match cache.layers.get(i) {
                Some((ck, cv)) => (Tensor::cat(&[ck, &k], 2)?, Tensor::cat(&[cv, &v], 2)?),
                None => (k, v),
            };
            match cache.layers.get_mut(i) {
                Some(slot) => *slot = (k.clone(), v.clone()),
                None => cache.layers.push((k.clone(), v.clone())),
            }
            let y = self.cached_attention(&q, &k, &v, past, layer.window)?;
            let mut y = layer.o.forward(&y, self.compute)?;
            if let Some((attn, _)) = &layer.output_norms {
                y = rms_norm(&y, &self.norm_weight(attn)?, eps)?;
            }
            x = add_residual(&x, &y)?;
            let h = rms_norm(&x, &self.norm_weight(&layer.post_norm)?, eps)?;
            let (mut y, _) = self.mlp(layer, &h, &Mode::Eval)?;
            if let Some((_, mlp)) = &layer.output_norms {
                y = rms_norm(&y, &self.norm_weight(mlp)?, eps)?;
            }
            x = add_residual(&x, &y)?;
        }
        let last = self.final_norm(&x.narrow(0, new - 1, 1)?)?;
        self.project(&last)?.squeeze(0)
    }
}

impl Llama {
    /// Queries `q` [1, t, heads, hd] at positions `past..` over the keys and values [1,
    /// kv_heads, past + t, hd]: query i sees key j when j ≤ i and i − j < `window`. [t, width].
    fn cached_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        past: usize,
        window: Option<usize>,
    ) -> Result<Tensor> {
        let c = &self.config;
        let (heads, hd) = (c.num_attention_heads, c.head_dim);
        let groups = heads / c.num_key_value_heads;
        let t = q.dim(1)?;
        let total = k.dim(2)?;
        let f32 = |x: &Tensor| x.to_dtype(DType::F32);
        // [1, total, kv_heads, hd] → repeated per query head → [heads, total, hd].
        let spread = |x: &Tensor| -> Result<Tensor> {
            let x = repeat_kv(&x.transpose(1, 2)?, groups)?;
            f32(&x.squeeze(0)?.transpose(0, 1)?.contiguous()?)
        };
        let (k, v) = (spread(k)?, spread(v)?);
        let q = f32(&q.squeeze(0)?.transpose(0, 1)?.contiguous()?)?;
        let scores = (q.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?;
        let mask: Vec<f32> = (0..t * total)
            .map(|at| {
                let (i, j) = (past + at / total, at % total);
                let seen = j <= i && window.is_none_or(|w| i - j < w);
                if seen { 0.0 } else { f32::NEG_INFINITY }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, total), q.device())?;
        let scores = scores.broadcast_add(&mask)?;
        let max = scores.max_keepdim(D::Minus1)?;
        let e = scores.broadcast_sub(&max)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        // [heads, t, hd] → [t, heads·hd].
        p.matmul(&v)?
            .transpose(0, 1)?
            .reshape((t, heads * hd))?
            .to_dtype(self.compute)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{built, reference};
    use crate::{KvCache, Mode, Model};
    use candle_core::DType;

    /// Feeding the context at once, then token by token, gives the logits `forward` gives for
    /// each position, for every family (sliding windows of 4 shorter than the 12 positions:
    /// mistral-sw, gemma3; NoPE layers; mixtures of experts).
    #[test]
    fn cached_decoding_gives_the_whole_windows_logits() {
        for name in [
            "llama",
            "qwen3",
            "smollm3",
            "mistral-sw",
            "gemma3",
            "qwen3-moe",
            "olmoe",
        ] {
            let model = built(name, DType::F32);
            let decoder = model.kv_decoder().expect("a llama decodes with a cache");
            let (x, _, _, _) = reference(name);
            let row: Vec<u32> = x.get(0).unwrap().to_vec1().unwrap();
            let whole = model
                .forward(&x.narrow(0, 0, 1).unwrap(), &Mode::Eval)
                .unwrap();
            let mut cache = KvCache::default();
            let first = decoder.forward_cached(&row[..5], &mut cache).unwrap();
            let mut outs = vec![(4, first)];
            for (p, &token) in row.iter().enumerate().skip(5) {
                outs.push((p, decoder.forward_cached(&[token], &mut cache).unwrap()));
            }
            assert_eq!(cache.len(), row.len());
            for (p, logits) in outs {
                let want = whole.get(0).unwrap().get(p).unwrap();
                let diff = crate::testing::max_difference(&logits, &want);
                assert!(diff < 1e-4, "{name} position {p}: {diff}");
            }
            // Past the window: refused (`sample` starts a new cache there).
            let block = super::super::tests::options_from(name).block_size.unwrap();
            let beyond = vec![row[0]; block - cache.len() + 1];
            let past = decoder.forward_cached(&beyond, &mut cache).unwrap_err();
            assert!(past.to_string().contains("block_size"), "{past}");
        }
    }
}
