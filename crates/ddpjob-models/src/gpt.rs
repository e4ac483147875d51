//! `gpt`: a GPT-2-style decoder as nanoGPT's `model.py` builds it (pre-LayerNorm blocks,
//! causal self-attention, exact-GELU MLP, learned positions, output tied to the token
//! embedding), with nanoGPT's parameter names so a `model.safetensors` loads into nanoGPT's
//! `GPT` as is. The language-model jobs train it; `forward_cached` generates from it.
//!
//! Dropout follows nanoGPT at the embedding sum and after both residual projections, but
//! attention-probability dropout (nanoGPT's `attn_dropout`) is not applied: masks depend only
//! on each row's seed (see `ddpjob_kernels::dropout`), and an [n, heads, t, t] mask per layer would cost more
//! to draw than the attention itself.

pub mod hf;
mod manual;
pub mod options;
mod stack;
#[cfg(test)]
mod tests;

use candle_core::{DType, Device, Error, Result, Tensor, Var};

use crate::kit::{LayerNorm, Linear, ParamBuilder, attention, head};

use super::gate::{self, Unit};
use super::{KvCache, Mode, Model, Params, TrainPass};
use ddpjob_kernels as kernels;
pub use ddpjob_kernels::Activation;
use ddpjob_kernels::dropout::{self, Dropout};

/// nanoGPT's `GPTConfig`.
#[derive(Debug, Clone, PartialEq)]
pub struct GptConfig {
    pub vocab_size: usize,
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub dropout: f64,
    pub bias: bool,
    /// The MLP's GELU: exact (nanoGPT) or GPT-2's tanh form (`gelu_new`).
    pub activation: Activation,
}

impl GptConfig {
    fn validate(&self) -> Result<()> {
        let fail = |why: String| Err(Error::Msg(format!("gpt config: {why}")));
        if self.vocab_size == 0 || self.block_size == 0 || self.n_embd == 0 {
            return fail("vocab_size, block_size and n_embd must be positive".into());
        }
        if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            let (c, h) = (self.n_embd, self.n_head);
            return fail(format!("n_embd {c} is not a multiple of n_head {h}"));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return fail(format!("dropout {} is not in [0, 1)", self.dropout));
        }
        Ok(())
    }
}

pub struct Gpt {
    config: GptConfig,
    wte: Var,
    wpe: Var,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// Zeros standing in for the bias the tied output layer does not have.
    head_bias: Tensor,
    /// [block, block]: 0 on and below the diagonal, -inf above (off the fused CPU path).
    causal_mask: Tensor,
    /// Matrices compute in this dtype (autocast-like); LayerNorm, softmax, the residual
    /// stream and the logits stay f32.
    compute: DType,
    params: Params,
    /// `train.activation_checkpointing`: training passes keep each block's input only.
    checkpoint: std::sync::atomic::AtomicBool,
    /// `distributed.sharding = "gradients"`: training passes hand each block's gradients over
    /// as they are formed.
    stream: std::sync::atomic::AtomicBool,
    /// `distributed.sharding = "full"`: training passes go block by block through autograd,
    /// asking for each block's parameters (the hand-written pass reads them all at once).
    gated: std::sync::atomic::AtomicBool,
}

impl Gpt {
    /// Whether training passes keep each block's input only (`train.activation_checkpointing`).
    fn checkpoints(&self) -> bool {
        self.checkpoint.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `compute`: DType::F32 or DType::BF16 (f32 master weights cast per use, f32 logits).
    #[doc(hidden)]
    pub fn new(config: &GptConfig, seed: u64, device: &Device, compute: DType) -> Result<Self> {
        Self::build(config, ParamBuilder::new(seed, device), compute)
    }

    /// A gpt whose weights are about to be loaded (a checkpoint, a pretrained model): zeros,
    /// nothing drawn, so a 124M-parameter model costs no random draws.
    #[cfg(test)]
    pub fn for_loading(config: &GptConfig, device: &Device, compute: DType) -> Result<Self> {
        Self::build(config, ParamBuilder::blank(device), compute)
    }

    pub(super) fn build(
        config: &GptConfig,
        mut init: ParamBuilder,
        compute: DType,
    ) -> Result<Self> {
        let device = init.device;
        config.validate()?;
        if !matches!(compute, DType::F32 | DType::BF16) {
            return Err(Error::Msg(format!(
                "gpt computes in f32 or bf16, not {compute:?}"
            )));
        }
        let (c, bias) = (config.n_embd, config.bias);
        let std = 0.02;
        let proj_std = 0.02 / (2.0 * config.n_layer.max(1) as f32).sqrt();
        let wte = init.normal("transformer.wte.weight", &[config.vocab_size, c], std)?;
        let wpe = init.normal("transformer.wpe.weight", &[config.block_size, c], std)?;
        let mut blocks = Vec::with_capacity(config.n_layer);
        for i in 0..config.n_layer {
            let p = format!("transformer.h.{i}");
            blocks.push(Block {
                ln_1: init.layer_norm(&format!("{p}.ln_1"), c, bias)?,
                c_attn: init.linear(&format!("{p}.attn.c_attn"), c, 3 * c, std, bias)?,
                attn_proj: init.linear(&format!("{p}.attn.c_proj"), c, c, proj_std, bias)?,
                ln_2: init.layer_norm(&format!("{p}.ln_2"), c, bias)?,
                c_fc: init.linear(&format!("{p}.mlp.c_fc"), c, 4 * c, std, bias)?,
                mlp_proj: init.linear(&format!("{p}.mlp.c_proj"), 4 * c, c, proj_std, bias)?,
            });
        }
        let ln_f = init.layer_norm("transformer.ln_f", c, bias)?;
        init.check_lora()?;
        let mut params = Params::from_vars(init.entries);
        params.share_frozen(init.frozen);
        for i in init.no_decay {
            params.exempt_from_decay(i);
        }
        params.tie("lm_head.weight", "transformer.wte.weight");
        let t = config.block_size;
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        Ok(Gpt {
            config: config.clone(),
            wte,
            wpe,
            blocks,
            ln_f,
            head_bias: Tensor::zeros(config.vocab_size, DType::F32, device)?,
            causal_mask: Tensor::from_vec(mask, (t, t), device)?,
            compute,
            params,
            checkpoint: Default::default(),
            stream: Default::default(),
            gated: Default::default(),
        })
    }

    #[cfg(test)]
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// Feeds `tokens` (the prompt, then one token at a time) after the positions in `cache`
    /// and returns the f32 logits `[vocab]` of the last one. No dropout. Errors when the total
    /// would exceed `block_size`: the caller crops the context and starts a new cache.
    pub fn forward_cached(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let past = cache.len();
        let t = tokens.len();
        if t == 0 || past + t > self.config.block_size {
            return Err(Error::Msg(format!(
                "gpt: {past} cached + {t} new positions: need 1..={} in all (block_size)",
                self.config.block_size
            )));
        }
        let (c, h) = (self.config.n_embd, self.config.n_head);
        let ids = Tensor::new(tokens, self.wte.device())?;
        let mut x = self.embed(&ids, 1, t, past)?;
        if !cache.layers.is_empty() && cache.layers.len() != self.blocks.len() {
            return Err(Error::Msg("gpt: the KV cache is another model's".into()));
        }
        for (i, block) in self.blocks.iter().enumerate() {
            let entry = cache.layers.get_mut(i);
            let qkv = block
                .c_attn
                .forward(&block.ln_1.forward(&x)?, self.compute)?;
            let qkv = qkv.reshape((1, t, 3 * c))?;
            let (y, k, v) = attention::with_ops(&qkv, h, entry.as_deref(), &self.causal_mask)?;
            match entry {
                Some(slot) => *slot = (k.detach(), v.detach()),
                None => cache.layers.push((k.detach(), v.detach())),
            }
            let y = block.attn_proj.forward(&y.reshape((t, c))?, self.compute)?;
            x = (x + y.to_dtype(DType::F32)?)?;
            x = (&x + block.mlp(&x, self, &Mode::Eval)?.to_dtype(DType::F32)?)?;
        }
        let last = x.narrow(0, t - 1, 1)?;
        Ok(self.head(&last)?.squeeze(0)?.detach())
    }

    /// Token plus position embeddings of `ids` ([n·t], positions from `offset`): [n·t, C].
    fn embed(&self, ids: &Tensor, n: usize, t: usize, offset: usize) -> Result<Tensor> {
        let tokens = lookup(&self.params.frozen().as_input(&self.wte), ids)?;
        self.with_positions(&tokens, (n, t), offset, None)
    }

    /// Token embeddings `tokens` [n·t, C] plus their positions' (from `offset`, or those of
    /// packed rows).
    fn with_positions(
        &self,
        tokens: &Tensor,
        (n, t): (usize, usize),
        offset: usize,
        packing: Option<&crate::kit::packed::Packing>,
    ) -> Result<Tensor> {
        let (c, frozen) = (self.config.n_embd, self.params.frozen());
        if let Some(p) = packing {
            return tokens + lookup(&frozen.as_input(&self.wpe), &p.positions)?;
        }
        let positions = frozen.as_input(&self.wpe).narrow(0, offset, t)?;
        tokens
            .reshape((n, t, c))?
            .broadcast_add(&positions)?
            .reshape((n * t, c))
    }

    /// Final LayerNorm, then logits x·wteᵀ in f32.
    fn head(&self, x: &Tensor) -> Result<Tensor> {
        self.project(&self.ln_f.forward(x)?)
    }

    /// Logits x·wteᵀ in f32 of the final LayerNorm's output `x`.
    fn project(&self, x: &Tensor) -> Result<Tensor> {
        let wte = &self.params.frozen().as_input(&self.wte);
        if self.compute == DType::F32 && kernels::applies(x) {
            return kernels::linear(x, wte, &self.head_bias, false);
        }
        let dt = self.compute;
        x.to_dtype(dt)?
            .matmul(&wte.to_dtype(dt)?.t()?)?
            .to_dtype(DType::F32)
    }
}

impl Model for Gpt {
    /// Token ids [n, t] (t ≤ block_size; [n, t, 2] packed, see `models::packed`) → f32
    /// logits [n, t, vocab].
    fn forward(&self, xs: &Tensor, mode: &Mode) -> Result<Tensor> {
        let (n, t) = crate::kit::packed::rows(xs)?;
        self.head(&self.trunk(xs, mode)?)?
            .reshape((n, t, self.config.vocab_size))
    }

    /// On the CPU in f32, the output projection and the cross-entropy run as one op that
    /// never holds all the logits (see `head`).
    fn loss(&self, xs: &Tensor, targets: &Tensor, mode: &Mode) -> Result<Tensor> {
        self.loss_of(&self.trunk(xs, mode)?, targets)
    }

    /// On the CPU in f32, the hand-written forward (see `manual`), a few windows at a time.
    /// With sharded parameters, block by block (asking for each, see `ddpjob_seam::gate`).
    fn score(&self, xs: &Tensor, targets: &Tensor) -> Result<(f64, usize)> {
        let gated = self.gated.load(std::sync::atomic::Ordering::Relaxed);
        if manual::applies(self) && xs.rank() == 2 && !gated {
            return manual::score(self, xs, targets);
        }
        gate::gather(Unit::Rest)?;
        let x = self
            .ln_f
            .forward(&self.trunk_with(xs, &Mode::Eval, true)?)?
            .detach();
        let wte = self.wte.as_tensor();
        let scored = match self.compute == DType::F32 && head::applies(&x, wte) {
            true => head::score(&x, wte, &targets.flatten_all()?),
            false => ddpjob_seam::task::loss_sum_and_correct(&self.project(&x)?, targets),
        };
        gate::release(Unit::Rest)?;
        scored
    }

    fn params(&self) -> &Params {
        &self.params
    }

    /// On the CPU in f32, a hand-written forward and backward (see `manual`). Elsewhere (a
    /// GPU, bf16, LoRA, packed rows), autograd over the whole model, or block by block (see
    /// `models::layered`) with activation checkpointing or streamed gradients.
    fn train_pass(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
    ) -> Result<Option<Box<dyn TrainPass + '_>>> {
        // Packed rows (see `models::packed`) go through autograd.
        let gated = self.gated.load(std::sync::atomic::Ordering::Relaxed);
        if manual::applies(self) && xs.rank() == 2 && !gated {
            return Ok(Some(Box::new(manual::forward(self, xs, targets, mode)?)));
        }
        let recompute = self.checkpoints();
        if !recompute && !self.stream.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(None);
        }
        let pass = crate::kit::layered::Layered::forward(self, xs, targets, mode, recompute)?;
        Ok(Some(Box::new(pass)))
    }

    fn checkpoint_activations(&self) -> std::result::Result<(), String> {
        self.checkpoint
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// The hand-written pass, or the blocks one at a time, hand each block's gradients over as
    /// they are formed; the token and position tables' come last, added to until then.
    fn stream_gradients(&self) -> Option<usize> {
        self.stream
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let tables = self.wte.elem_count() + self.wpe.elem_count();
        let blocks = self.params.element_count() - tables;
        Some(tables + blocks.div_ceil(self.config.n_layer.max(1)))
    }

    /// Block by block through autograd (see `models::layered`), on every device: the
    /// hand-written CPU pass reads every weight at once.
    fn shard_parameters(&self) -> std::result::Result<Vec<Vec<usize>>, String> {
        self.stream_gradients();
        self.gated.store(true, std::sync::atomic::Ordering::Relaxed);
        let depth = self.config.n_layer;
        Ok(crate::kit::layered::blocks_by_name(
            &self.params,
            depth,
            |i| format!("transformer.h.{i}."),
        ))
    }

    /// nanoGPT's `estimate_mfu` count (the PaLM paper's): 6 operations per parameter per
    /// token (4 per frozen one, which forms no weight gradient), position embeddings excepted, plus 12·n_layer·n_embd·block_size per token for
    /// attention's two products (the masked half counted, as there); times block_size tokens.
    fn train_flops_per_sample(&self) -> Option<f64> {
        let c = &self.config;
        // A frozen parameter forms no weight gradient: its forward and input gradient only.
        let frozen = self.params.frozen();
        let (wpe, wpe_frozen) = (self.wpe.elem_count() as f64, frozen.contains(&self.wpe));
        let mut trainable = self.params.trainable_element_count() as f64;
        let mut held = self.params.element_count() as f64 - trainable;
        match wpe_frozen {
            true => held -= wpe,
            false => trainable -= wpe,
        }
        let t = c.block_size as f64;
        let per_token = 6.0 * trainable + 4.0 * held + 12.0 * (c.n_layer * c.n_embd) as f64 * t;
        Some(per_token * t)
    }

    fn kv_decoder(&self) -> Option<&dyn super::KvDecoder> {
        Some(self)
    }

    /// The hand-written pass's buffers (see `manual`): per position, each block's 16·C values
    /// (and its attention probabilities where kept), the dropout masks, ln_f's input and
    /// output; with checkpointing, each block's input and one block recomputed beside the
    /// backward's buffers; the head's logits where it keeps them (a large vocabulary, within
    /// 256 MB). The same count for the block-by-block autograd pass `sharding = "full"` runs
    /// in f32 on the CPU (its peaks, 2026-11-26: within 5% with the full mode's estimate);
    /// autograd's elsewhere (a GPU, bf16, LoRA) are not known.
    fn activation_bytes_per_sample(&self, checkpointing: bool) -> Option<f64> {
        if !manual::applies(self) {
            return None;
        }
        let cfg = &self.config;
        let (t, c, layers) = (cfg.block_size, cfg.n_embd, cfg.n_layer);
        let block = 16 * c + manual::kept_probabilities(cfg.n_head, t, c);
        let masks = if cfg.dropout > 0.0 {
            (1 + 2 * layers) * c
        } else {
            0
        };
        let per_position = match checkpointing {
            false => layers * block,
            true => layers * c + 2 * block,
        } + masks
            + 2 * c;
        // The head's logits, where it keeps them for its backward (a large vocabulary).
        let logits = head::kept_logit_bytes(t, cfg.vocab_size);
        Some((per_position * t * 4 + logits) as f64)
    }
}

impl super::KvDecoder for Gpt {
    fn forward_cached(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        Gpt::forward_cached(self, tokens, cache)
    }
}

impl Gpt {
    /// Token ids [n, t] (t ≤ block_size) → the last block's output [n·t, C], before ln_f.
    fn trunk(&self, xs: &Tensor, mode: &Mode) -> Result<Tensor> {
        self.trunk_with(xs, mode, false)
    }

    /// [`Gpt::trunk`]; `scoring`: each block's output detached, so an evaluation holds one
    /// block's tensors at a time, not every block's until the loss is read (the parameters are
    /// variables: autograd would keep them all, as for training).
    fn trunk_with(&self, xs: &Tensor, mode: &Mode, scoring: bool) -> Result<Tensor> {
        let (ids, packing, shape) = self.window(xs)?;
        let dropout = self.dropout(mode, shape)?;
        let (packing, dropout) = (packing.as_ref(), dropout.as_ref());
        let detached = |x: Tensor| if scoring { x.detach() } else { x };
        let tokens = lookup(&self.params.frozen().as_input(&self.wte), &ids)?;
        let mut x = detached(self.embedded(&tokens, shape, packing, dropout)?);
        for i in 0..self.blocks.len() {
            // Scoring asks for each block's parameters (a training graph would need them kept).
            if scoring {
                gate::gather(Unit::Block(i))?;
            }
            x = detached(self.block_forward(i, &x, shape, packing, mode, dropout)?);
            if scoring {
                gate::release(Unit::Block(i))?;
            }
        }
        Ok(x)
    }

    /// Token windows [n, t] (packed: [n, t, 2]) → their ids [n·t], the packing, (n, t); t
    /// within the window.
    fn window(
        &self,
        xs: &Tensor,
    ) -> Result<(Tensor, Option<crate::kit::packed::Packing>, (usize, usize))> {
        let (xs, packing) = crate::kit::packed::split(xs)?;
        let (n, t) = xs.dims2()?;
        if t == 0 || t > self.config.block_size {
            let block = self.config.block_size;
            return Err(Error::Msg(format!(
                "gpt: {t} positions, block_size is {block}"
            )));
        }
        Ok((xs.flatten_all()?, packing, (n, t)))
    }

    /// The dropout masks of a training pass over n rows of t positions (`None`: evaluation,
    /// or no dropout).
    fn dropout<'m>(&self, mode: &'m Mode, (n, t): (usize, usize)) -> Result<Option<Dropout<'m>>> {
        match mode {
            Mode::Train { row_seeds } if self.config.dropout > 0.0 => {
                if row_seeds.len() != n {
                    let seeds = row_seeds.len();
                    return Err(Error::Msg(format!("gpt: {seeds} row seeds for {n} rows")));
                }
                Ok(Dropout::new(
                    row_seeds,
                    self.config.dropout,
                    t * self.config.n_embd,
                ))
            }
            _ => Ok(None),
        }
    }

    /// The residual stream entering the first block: looked-up `tokens` [n·t, C] plus their
    /// positions, dropped out (site 0).
    fn embedded(
        &self,
        tokens: &Tensor,
        shape: (usize, usize),
        packing: Option<&crate::kit::packed::Packing>,
        dropout: Option<&Dropout>,
    ) -> Result<Tensor> {
        let x = self.with_positions(tokens, shape, 0, packing)?;
        match dropout {
            Some(d) => d.apply(&x, 0),
            None => Ok(x),
        }
    }

    /// Block `i` over the residual stream `x` [n·t, C].
    fn block_forward(
        &self,
        i: usize,
        x: &Tensor,
        shape: (usize, usize),
        packing: Option<&crate::kit::packed::Packing>,
        mode: &Mode,
        dropout: Option<&Dropout>,
    ) -> Result<Tensor> {
        let block = &self.blocks[i];
        let y = block.attention(x, shape, packing, self, mode)?;
        let x = dropout::add_dropped(x, &y, dropout, 1 + 2 * i)?;
        let y = block.mlp(&x, self, mode)?;
        dropout::add_dropped(&x, &y, dropout, 2 + 2 * i)
    }

    /// The mean loss from the last block's output `last` [n·t, C]: ln_f, then on the CPU in
    /// f32 the output projection and the cross-entropy as one op that never holds all the
    /// logits (see `head`).
    fn loss_of(&self, last: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let x = self.ln_f.forward(last)?;
        let wte = &self.params.frozen().as_input(&self.wte);
        if self.compute == DType::F32 && head::applies(&x, wte) {
            return head::loss(&x, wte, &targets.flatten_all()?);
        }
        ddpjob_seam::task::cross_entropy(&self.project(&x)?, targets)
    }
}

struct Block {
    ln_1: LayerNorm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
}

impl Block {
    /// Causal self-attention of `ln_1(x)` (x: [n·t, C]), projected: [n·t, C]; within each
    /// example of a packed batch (see `models::packed`) when given.
    fn attention(
        &self,
        x: &Tensor,
        (n, t): (usize, usize),
        packing: Option<&crate::kit::packed::Packing>,
        gpt: &Gpt,
        mode: &Mode,
    ) -> Result<Tensor> {
        let (c, h) = (gpt.config.n_embd, gpt.config.n_head);
        let input = self.ln_1.forward(x)?;
        if x.device().is_cuda() && packing.is_none() && self.c_attn.adapter.is_none() {
            let [q, k, v] = self.c_attn.forward_thirds(&input, gpt.compute)?;
            let y = attention::of_parts((&q, &k, &v), n, h, &gpt.causal_mask)?;
            return self.attn_proj.forward_mode(&y, gpt.compute, mode);
        }
        let qkv = self.c_attn.forward_mode(&input, gpt.compute, mode)?;
        let y = if let Some(packing) = packing {
            let qkv = qkv.reshape((n, t, 3 * c))?;
            crate::kit::packed::attention(&qkv, h, packing)?.reshape((n * t, c))?
        } else if kernels::applies(&qkv) {
            attention::causal_attention(&qkv, h, t)?
        } else {
            let qkv = qkv.reshape((n, t, 3 * c))?;
            attention::with_ops(&qkv, h, None, &gpt.causal_mask)?
                .0
                .reshape((n * t, c))?
        };
        self.attn_proj.forward_mode(&y, gpt.compute, mode)
    }

    /// c_proj(gelu(c_fc(ln_2(x)))), in the compute dtype.
    fn mlp(&self, x: &Tensor, gpt: &Gpt, mode: &Mode) -> Result<Tensor> {
        let (compute, activation) = (gpt.compute, gpt.config.activation);
        let hidden = self
            .c_fc
            .forward_mode(&self.ln_2.forward(x)?, compute, mode)?;
        self.mlp_proj
            .forward_mode(&kernels::gelu(&hidden, activation)?, compute, mode)
    }
}

/// The largest table [`lookup`] reads as a one-hot product on a GPU: its one-hot matrix is
/// 4 bytes per token per row (16,384 tokens: 64 MB).
#[cfg(feature = "cuda")]
const ONE_HOT_ROWS: usize = 1024;

/// Rows `ids` ([k], u32) of `table` [rows, C]: [k, C]. On a GPU, a small table (a character
/// vocabulary, positions) is read as a one-hot product, whose backward is a GEMM: candle's
/// backward of a row lookup (`index_add`) runs one thread per channel through every token,
/// 8 ms a step of the shakespeare-char recipe on an H200, ~7% of it (ncu, 2026-11-26). Exact
/// in f32 (each output is one product by 1), so not when f32 products may round to TF32.
fn lookup(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let rows = table.dim(0)?;
    if !one_hot_applies(table, rows) {
        return table.embedding(ids);
    }
    let classes = Tensor::arange(0u32, rows as u32, ids.device())?.unsqueeze(0)?;
    ids.to_dtype(DType::U32)?
        .flatten_all()?
        .unsqueeze(1)?
        .broadcast_eq(&classes)?
        .to_dtype(table.dtype())?
        .matmul(table)
}

/// Whether [`lookup`] reads `table` as a one-hot product (see there).
fn one_hot_applies(table: &Tensor, rows: usize) -> bool {
    #[cfg(feature = "cuda")]
    if table.device().is_cuda() && rows <= ONE_HOT_ROWS {
        return table.dtype() != DType::F32
            || !candle_core::cuda_backend::gemm_reduced_precision_f32();
    }
    let _ = (table, rows);
    false
}
