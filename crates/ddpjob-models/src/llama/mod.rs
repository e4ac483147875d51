//! `llama`: the decoder of the Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2,
//! Qwen3, SmolLM3) as `transformers`' `LlamaForCausalLM` computes it: RMSNorm → grouped-query
//! causal attention with rotary positions (Qwen3: each head's q and k RMS-normed first;
//! SmolLM3: some layers without positions; Mistral: within a sliding window) → residual →
//! RMSNorm → SwiGLU MLP → residual; final RMSNorm; output
//! projection tied to the embedding or not. Parameter names are `transformers`' own
//! (`model.layers.0.self_attn.q_proj.weight`), so a `model.safetensors` is a Hugging Face
//! checkpoint as is.
//!
//! On the CPU in f32 the attention runs in tiles (`kernels::flash_attention`: linear in the
//! context, windows and packed rows included) and the output projection with its
//! cross-entropy as the model kit's fused head (`kit::head`); RMSNorm, RoPE and SwiGLU are the
//! kernels crate's ops (one fused op on the CPU in f32 and on a GPU, each way), as are the
//! residual additions and the causal softmax; on a GPU the attention takes q, k and v apart
//! as the GPT's does there; elsewhere candle's ops compute it.

mod decode;
mod gemma;
mod moe;
mod moe_options;
#[cfg(test)]
mod moe_tests;
mod options;
mod refusals;
mod routed;
mod stack;
#[cfg(test)]
mod tests;

use crate::gate::{self, Unit};
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Device, Error, Result, Tensor, Var};

use super::{Mode, Model, Params, TrainPass};
use crate::kit::packed::{self, Packing};
use crate::kit::{Linear, ParamBuilder, add_residual, attention, head};
use ddpjob_kernels as kernels;
use ddpjob_kernels::rms_norm;
use ddpjob_kernels::rope;
pub use gemma::GemmaConfig;
pub use moe::{ExpertNames, MoeConfig};
pub use options::{KEYS, MODEL_TYPES, build_llama, hf_parts};
pub use refusals::refusal as unsupported_features;
use rope::{Llama3Scaling, RopeTables};

/// The shape of a Llama-family model, in `transformers`' `config.json` names.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    /// The longest window trained or generated (the rotary tables' length).
    pub block_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3Scaling>,
    /// A linear RoPE scaling: every frequency divided by this (Gemma 3's full layers).
    pub rope_linear: Option<f64>,
    pub tie_word_embeddings: bool,
    /// Biases on q, k and v (Qwen2), on o too (Llama's `attention_bias`).
    pub qkv_bias: bool,
    pub o_bias: bool,
    /// An RMSNorm of q and of k after the projection, before the rotation: over each head
    /// (Qwen3's `q_norm` and `k_norm` of `head_dim`) or over the whole projection (OLMoE's).
    pub qk_norm: QkNorm,
    /// Per layer, whether it rotates q and k; `None`: every layer does (SmolLM3's
    /// `no_rope_layers` leaves some without positions, NoPE).
    pub rotary: Option<Vec<bool>>,
    /// Mistral's window: query i sees key j when 0 ≤ i − j < window.
    pub sliding_window: Option<usize>,
    /// Std of the normal initial weights (`initializer_range`).
    pub initializer_range: f64,
    /// A mixture of experts in place of the MLP of some layers (Qwen3-MoE, Mixtral, OLMoE).
    pub moe: Option<MoeConfig>,
    /// Gemma 3: (1 + w) RMSNorms, four a layer; the embedding scaled by √hidden; GeGLU;
    /// scores scaled by `query_pre_attn_scalar`^-½; `sliding_window` and a RoPE base of their
    /// own on the sliding layers only.
    pub gemma: Option<GemmaConfig>,
}

/// Where q and k are RMS-normed ([`LlamaConfig::qk_norm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Each head's q and k over its `head_dim` channels (Qwen3).
    PerHead,
    /// The whole q and k projections (OLMoE: weights of q's and k's widths).
    Whole,
}

impl LlamaConfig {
    fn validate(&self) -> Result<()> {
        let fail = |why: String| Err(Error::Msg(format!("llama config: {why}")));
        let sizes = [
            self.vocab_size,
            self.block_size,
            self.hidden_size,
            self.intermediate_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        ];
        if sizes.contains(&0) {
            return fail(format!("every size must be positive: {self:?}"));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            let (h, kv) = (self.num_attention_heads, self.num_key_value_heads);
            return fail(format!(
                "num_attention_heads {h} is not a multiple of num_key_value_heads {kv}"
            ));
        }
        if let Some(rotary) = &self.rotary
            && rotary.len() != self.num_hidden_layers
        {
            return fail(format!(
                "{} layers say whether they rotate, for {} layers",
                rotary.len(),
                self.num_hidden_layers
            ));
        }
        if let Some(m) = &self.moe {
            if m.num_experts == 0 || m.top_k == 0 || m.top_k > m.num_experts || m.expert_size == 0 {
                return fail(format!(
                    "a mixture of {} experts, {} per token, each {} wide: experts and their width \
                     must be positive and at most every expert chosen",
                    m.num_experts, m.top_k, m.expert_size
                ));
            }
            if m.sparse.len() != self.num_hidden_layers {
                return fail(format!(
                    "{} layers say whether they are sparse, for {} layers",
                    m.sparse.len(),
                    self.num_hidden_layers
                ));
            }
        }
        if !self.head_dim.is_multiple_of(2) {
            return fail(format!(
                "head_dim {} is odd; rotary embeddings need pairs",
                self.head_dim
            ));
        }
        Ok(())
    }
}

pub struct Llama {
    config: LlamaConfig,
    embed: Var,
    layers: Vec<Layer>,
    norm: Var,
    /// `lm_head.weight` when not tied to the embedding.
    lm_head: Option<Var>,
    rope: RopeTables,
    /// Gemma 3's sliding layers' RoPE.
    local_rope: Option<RopeTables>,
    compute: DType,
    params: Params,
    /// `train.activation_checkpointing`: training passes keep each layer's input only.
    checkpoint: AtomicBool,
    /// `distributed.sharding = "gradients"`: training passes go layer by layer, handing each
    /// layer's gradients over as they are formed.
    stream: AtomicBool,
}

struct Layer {
    input_norm: Var,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// The RMSNorm weights of q and k ([`LlamaConfig::qk_norm`]).
    qk_norm: Option<(Var, Var)>,
    /// Whether q and k are rotated ([`LlamaConfig::rotary`]).
    rotary: bool,
    /// The window its queries see, when shorter than the whole past can be (Mistral's every
    /// layer, Gemma 3's sliding layers).
    window: Option<usize>,
    /// Gemma 3's sliding layers rotate with a base of their own.
    local_rope: bool,
    /// Before the MLP (Gemma's `pre_feedforward_layernorm`).
    post_norm: Var,
    /// Gemma's norms of the attention's and the MLP's outputs (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`).
    output_norms: Option<(Var, Var)>,
    mlp: Mlp,
}

/// A layer's feed-forward part.
// One per layer, read on every pass: boxing the larger variant would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Mlp {
    /// `down(silu(gate(h)) · up(h))`.
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// A mixture of such MLPs, each token routed to a few (see `moe`).
    Sparse(moe::Moe),
}

impl Llama {
    /// A llama of `config` whose parameters `init` makes (random weights as `transformers`'
    /// `_init_weights` draws them: normal with std `initializer_range`, biases 0, norms 1; or
    /// blank, to be loaded). `compute`: F32 or BF16.
    pub(super) fn build(
        config: &LlamaConfig,
        mut init: ParamBuilder,
        compute: DType,
    ) -> Result<Self> {
        let device = init.device;
        config.validate()?;
        if !matches!(compute, DType::F32 | DType::BF16) {
            return Err(Error::Msg(format!(
                "llama computes in f32 or bf16, not {compute:?}"
            )));
        }
        let c = config;
        if init.quantizes() && c.moe.is_some() {
            return Err(Error::Msg(
                "model.quantize: a mixture of experts' layers are not kept in 4 bits in this \
                 version (its experts' grouped products read f32 weights); leave \
                 [model.quantize] out, or quantise a dense model"
                    .into(),
            ));
        }
        let (hidden, hd) = (c.hidden_size, c.head_dim);
        let std = c.initializer_range as f32;
        let embed = init.normal("model.embed_tokens.weight", &[c.vocab_size, hidden], std)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let (q_out, kv_out) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
            let attn = |init: &mut ParamBuilder, name: &str, i: usize, o: usize, bias: bool| {
                init.linear(&format!("{p}.self_attn.{name}"), i, o, std, bias)
            };
            let q = attn(&mut init, "q_proj", hidden, q_out, c.qkv_bias)?;
            let k = attn(&mut init, "k_proj", hidden, kv_out, c.qkv_bias)?;
            let v = attn(&mut init, "v_proj", hidden, kv_out, c.qkv_bias)?;
            let o = attn(&mut init, "o_proj", q_out, hidden, c.o_bias)?;
            let one = if c.gemma.is_some() { 0.0 } else { 1.0 };
            let norms = |init: &mut ParamBuilder, q: usize, k: usize| -> Result<_> {
                Ok(Some((
                    init.constant(format!("{p}.self_attn.q_norm.weight"), q, one)?,
                    init.constant(format!("{p}.self_attn.k_norm.weight"), k, one)?,
                )))
            };
            let qk_norm = match c.qk_norm {
                QkNorm::PerHead => norms(&mut init, hd, hd)?,
                QkNorm::Whole => norms(&mut init, q_out, kv_out)?,
                QkNorm::None => None,
            };
            let mlp = match &c.moe {
                Some(m) if m.sparse[i] => {
                    Mlp::Sparse(moe::Moe::build(&mut init, &p, hidden, m, std)?)
                }
                _ => {
                    let mlp = |init: &mut ParamBuilder, name: &str, i: usize, o: usize| {
                        init.linear(&format!("{p}.mlp.{name}"), i, o, std, false)
                    };
                    Mlp::Dense {
                        gate: mlp(&mut init, "gate_proj", hidden, c.intermediate_size)?,
                        up: mlp(&mut init, "up_proj", hidden, c.intermediate_size)?,
                        down: mlp(&mut init, "down_proj", c.intermediate_size, hidden)?,
                    }
                }
            };
            // Gemma stores its norms' weights as offsets from 1: 0 is the identity.
            let one = if c.gemma.is_some() { 0.0 } else { 1.0 };
            let input_norm = init.constant(format!("{p}.input_layernorm.weight"), hidden, one)?;
            let (post_norm, output_norms) = match c.gemma {
                Some(_) => {
                    let attn =
                        init.constant(format!("{p}.post_attention_layernorm.weight"), hidden, 0.0)?;
                    let pre = init.constant(
                        format!("{p}.pre_feedforward_layernorm.weight"),
                        hidden,
                        0.0,
                    )?;
                    let mlp = init.constant(
                        format!("{p}.post_feedforward_layernorm.weight"),
                        hidden,
                        0.0,
                    )?;
                    (pre, Some((attn, mlp)))
                }
                None => (
                    init.constant(format!("{p}.post_attention_layernorm.weight"), hidden, 1.0)?,
                    None,
                ),
            };
            layers.push(Layer {
                input_norm,
                q,
                k,
                v,
                o,
                qk_norm,
                rotary: c.rotary.as_ref().is_none_or(|r| r[i]),
                window: match &c.gemma {
                    Some(g) => c.sliding_window.filter(|_| g.sliding[i]),
                    None => c.sliding_window,
                },
                local_rope: c.gemma.as_ref().is_some_and(|g| g.sliding[i]),
                post_norm,
                output_norms,
                mlp,
            });
        }
        let one = if c.gemma.is_some() { 0.0 } else { 1.0 };
        let norm = init.constant("model.norm.weight".into(), hidden, one)?;
        let lm_head = match c.tie_word_embeddings {
            true => None,
            false => Some(init.normal("lm_head.weight", &[c.vocab_size, hidden], std)?),
        };
        init.check_lora()?;
        let mut params = Params::from_vars(std::mem::take(&mut init.entries));
        for (name, packed) in std::mem::take(&mut init.packed) {
            params.push_packed(name, packed);
        }
        params.share_frozen(init.frozen.clone());
        for &i in &init.no_decay {
            params.exempt_from_decay(i);
        }
        if c.tie_word_embeddings {
            params.tie("lm_head.weight", "model.embed_tokens.weight");
        }
        let mut inv_freq = rope::inverse_frequencies(hd, c.rope_theta, c.rope_scaling);
        if let Some(factor) = c.rope_linear {
            inv_freq.iter_mut().for_each(|f| *f /= factor);
        }
        let local_rope = match &c.gemma {
            Some(g) => {
                let inv = rope::inverse_frequencies(hd, g.local_rope_theta, None);
                Some(RopeTables::new(&inv, c.block_size, device)?)
            }
            None => None,
        };
        Ok(Llama {
            config: config.clone(),
            embed,
            layers,
            norm,
            lm_head,
            rope: RopeTables::new(&inv_freq, c.block_size, device)?,
            local_rope,
            compute,
            params,
            checkpoint: AtomicBool::new(false),
            stream: AtomicBool::new(false),
        })
    }

    /// The output projection's weight [vocab, hidden] (the embedding's when tied), detached
    /// when frozen (no gradient is formed for it).
    fn head_weight(&self) -> Tensor {
        self.input(self.lm_head.as_ref().unwrap_or(&self.embed))
    }

    /// A parameter as the ops take it: detached when frozen (see `ddpjob_seam::freeze`).
    fn input(&self, var: &Var) -> Tensor {
        self.params.frozen().as_input(var)
    }

    /// Token ids [n, t] → the final RMSNorm's output [n·t, hidden], f32.
    fn trunk(&self, xs: &Tensor, mode: &Mode) -> Result<Tensor> {
        Ok(self.trunk_routed(xs, mode)?.0)
    }

    /// [`Llama::trunk`] and what each sparse layer's router chose, first layer first.
    fn trunk_routed(&self, xs: &Tensor, mode: &Mode) -> Result<(Tensor, Vec<moe::Routing>)> {
        let (ids, packing) = packed::split(xs)?;
        let shape = self.check_window(&ids)?;
        let mut x = self.embed_tokens(&ids)?;
        let mut routings = Vec::new();
        for layer in &self.layers {
            let (y, routing) = self.block_routed(layer, &x, shape, packing.as_ref(), mode)?;
            x = y;
            routings.extend(routing);
        }
        Ok((self.final_norm(&x)?, routings))
    }

    /// (n, t) of token ids [n, t], when t fits the model's window.
    fn check_window(&self, ids: &Tensor) -> Result<(usize, usize)> {
        let (n, t) = ids.dims2()?;
        if t == 0 || t > self.config.block_size {
            let block = self.config.block_size;
            return Err(Error::Msg(format!(
                "llama: {t} positions, block_size is {block}"
            )));
        }
        Ok((n, t))
    }

    /// The last layer's output for token ids [n, t], each layer's output detached as it is
    /// made, so only one layer's graph exists at a time (evaluation).
    fn detached_layers(
        &self,
        ids: &Tensor,
        shape: (usize, usize),
        packing: Option<&Packing>,
        mode: &Mode,
    ) -> Result<Tensor> {
        let mut x = self.embed_tokens(ids)?.detach();
        for (i, layer) in self.layers.iter().enumerate() {
            // With sharded parameters, each layer's gathered for its turn (see `ddpjob_seam::gate`).
            gate::gather(Unit::Block(i))?;
            x = self.block(layer, &x, shape, packing, mode)?.detach();
            gate::release(Unit::Block(i))?;
        }
        Ok(x)
    }

    /// Token ids [n, t] → their embeddings [n·t, hidden] (Gemma's times √hidden).
    fn embed_tokens(&self, ids: &Tensor) -> Result<Tensor> {
        let x = self.input(&self.embed).embedding(&ids.flatten_all()?)?;
        match self.embed_scale() {
            Some(scale) => x.affine(scale, 0.0),
            None => Ok(x),
        }
    }

    /// Gemma's embedding scale, √hidden as an f32 (transformers casts it to the weights' dtype).
    fn embed_scale(&self) -> Option<f64> {
        let hidden = self.config.hidden_size as f32;
        self.config.gemma.as_ref().map(|_| hidden.sqrt() as f64)
    }

    /// An RMSNorm's weight as the norm multiplies by it: Gemma's `1 + w`.
    fn norm_weight(&self, w: &Var) -> Result<Tensor> {
        match self.config.gemma {
            Some(_) => self.input(w).affine(1.0, 1.0),
            None => Ok(self.input(w)),
        }
    }

    /// One decoder layer over the residual stream `x` [n·t, hidden].
    fn block(
        &self,
        layer: &Layer,
        x: &Tensor,
        shape: (usize, usize),
        packing: Option<&Packing>,
        mode: &Mode,
    ) -> Result<Tensor> {
        Ok(self.block_routed(layer, x, shape, packing, mode)?.0)
    }

    /// [`Llama::block`] and, for a sparse layer, what its router chose.
    fn block_routed(
        &self,
        layer: &Layer,
        x: &Tensor,
        shape: (usize, usize),
        packing: Option<&Packing>,
        mode: &Mode,
    ) -> Result<(Tensor, Option<moe::Routing>)> {
        let eps = self.config.rms_norm_eps;
        let h = rms_norm(x, &self.norm_weight(&layer.input_norm)?, eps)?;
        let mut y = self.attention(layer, &h, shape, packing, mode)?;
        if let Some((attn, _)) = &layer.output_norms {
            y = rms_norm(&y, &self.norm_weight(attn)?, eps)?;
        }
        let x = add_residual(x, &y)?;
        let h = rms_norm(&x, &self.norm_weight(&layer.post_norm)?, eps)?;
        let (mut y, routing) = self.mlp(layer, &h, mode)?;
        if let Some((_, mlp)) = &layer.output_norms {
            y = rms_norm(&y, &self.norm_weight(mlp)?, eps)?;
        }
        Ok((add_residual(&x, &y)?, routing))
    }

    fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm(x, &self.norm_weight(&self.norm)?, self.config.rms_norm_eps)
    }

    /// q [n, t, heads, hd], k and v [n, t, kv_heads, hd] of `h` [n·t, hidden]: projected,
    /// normed (Qwen3, OLMoE, Gemma), q and k rotated at their positions, q scaled for Gemma.
    fn rotated_qkv(
        &self,
        layer: &Layer,
        h: &Tensor,
        (n, t): (usize, usize),
        at: Position,
        mode: &Mode,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let c = &self.config;
        let (heads, kv_heads, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let q = layer
            .q
            .forward_mode(h, self.compute, mode)?
            .reshape((n, t, heads, hd))?;
        let k = layer
            .k
            .forward_mode(h, self.compute, mode)?
            .reshape((n, t, kv_heads, hd))?;
        let v = layer
            .v
            .forward_mode(h, self.compute, mode)?
            .reshape((n, t, kv_heads, hd))?;
        // Qwen3: each head's q and k RMS-normed over its channels; OLMoE: the whole
        // projections (in f32, back in the projection's dtype, as transformers' RMSNorm
        // returns them).
        let (q, k) = match &layer.qk_norm {
            Some((qw, kw)) => {
                let eps = c.rms_norm_eps;
                let norm = |x: &Tensor, w: &Var| -> Result<Tensor> {
                    let w = self.norm_weight(w)?;
                    let normed = match c.qk_norm {
                        QkNorm::Whole => {
                            let (n, t, h, d) = x.dims4()?;
                            let whole = x.reshape((n * t, h * d))?;
                            rms_norm(&whole, &w, eps)?.reshape((n, t, h, d))?
                        }
                        _ => rms_norm(x, &w, eps)?,
                    };
                    normed.to_dtype(x.dtype())
                };
                (norm(&q, qw)?, norm(&k, kw)?)
            }
            None => (q, k),
        };
        let tables = match (&self.local_rope, layer.local_rope) {
            (Some(local), true) => local,
            _ => &self.rope,
        };
        let rope = |x: &Tensor| match at {
            _ if !layer.rotary => Ok(x.clone()),
            Position::Packed(p) => tables.apply_at(x, &p.positions),
            Position::From(offset) => tables.apply(x, offset),
        };
        let mut q = rope(&q)?;
        if let Some(g) = &c.gemma {
            // Gemma scores by query_pre_attn_scalar^-½; the attention ops by head_dim^-½.
            q = q.affine((hd as f64 / g.query_pre_attn_scalar).sqrt(), 0.0)?;
        }
        let k = rope(&k)?;
        Ok((q, k, v))
    }

    /// Grouped-query causal self-attention of `h` [n·t, hidden], projected: [n·t, hidden];
    /// within each example, at its own positions, when `packing` says the rows are packed.
    fn attention(
        &self,
        layer: &Layer,
        h: &Tensor,
        (n, t): (usize, usize),
        packing: Option<&Packing>,
        mode: &Mode,
    ) -> Result<Tensor> {
        let c = &self.config;
        let (heads, kv_heads, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (q, k, v) = self.rotated_qkv(layer, h, (n, t), Position::from(packing), mode)?;
        let window = layer.window.filter(|&w| w < t);
        if kernels::applies(&q) {
            // On the CPU in f32, in tiles (FlashAttention-2): no [t, t] scores, each key-value
            // head read where it lies by the query heads of its group, windows and packed rows
            // one rule. As fast as the [t, t] op of `kit::attention` below 1,024 positions,
            // 1.5x at 1,024, 3.6x at 4,096 (docs/src/performance-llama.md).
            let flat = |x: &Tensor, heads: usize| x.reshape((n * t, heads * hd));
            let qkv = Tensor::cat(
                &[flat(&q, heads)?, flat(&k, kv_heads)?, flat(&v, kv_heads)?],
                1,
            )?;
            let shape = kernels::Attention {
                heads,
                kv_heads,
                head_dim: hd,
                t,
                window,
                starts: packing.map(|p| p.starts.clone()),
            };
            let y = kernels::flash_attention(&qkv, &shape)?;
            return layer.o.forward_mode(&y, self.compute, mode);
        }
        let k = repeat_kv(&k, heads / kv_heads)?;
        let v = repeat_kv(&v, heads / kv_heads)?;
        let width = heads * hd;
        // A window shorter than the rows on a GPU or the CPU in bf16: scores under a mask that
        // also hides the keys it leaves behind, composed from candle's ops.
        if let Some(window) = window {
            let mut mask = windowed_causal_mask(t, window, h.device())?;
            if let Some(p) = packing {
                mask = p.mask()?.broadcast_add(&mask)?;
            }
            let qkv = Tensor::cat(&[&q, &k, &v], 2)?.reshape((n, t, 3 * width))?;
            let y = packed::attention_with_ops(&qkv, heads, &mask)?.reshape((n * t, width))?;
            return layer.o.forward_mode(&y, self.compute, mode);
        }
        if h.device().is_cuda() && packing.is_none() {
            // As the GPT's on a GPU: q, k and v apart (no [n·t, 3C] concatenation, whose
            // backward is three zero-padded gradients and their sums), the heads moved by one
            // kernel each way, the causal mask applied inside the softmax kernel (the mask
            // tensor is not read there: a host placeholder).
            let flat = |x: Tensor| x.reshape((n * t, width));
            let unused = Tensor::zeros((1, 1), DType::F32, &Device::Cpu)?;
            let y = attention::of_parts((&flat(q)?, &flat(k)?, &flat(v)?), n, heads, &unused)?;
            return layer.o.forward_mode(&y, self.compute, mode);
        }
        // Packed rows on a GPU, and the CPU in bf16: candle's ops under the mask.
        let qkv = Tensor::cat(&[&q, &k, &v], 2)?.reshape((n, t, 3 * width))?;
        let y = match packing {
            Some(p) => packed::attention_with_ops(&qkv, heads, p.mask()?)?,
            None => {
                let mask = windowed_causal_mask(t, t, qkv.device())?;
                attention::with_ops(&qkv, heads, None, &mask)?.0
            }
        };
        layer
            .o
            .forward_mode(&y.reshape((n * t, width))?, self.compute, mode)
    }

    /// `down(silu(gate(h)) · up(h))`, or the mixture of such MLPs with its routing.
    fn mlp(
        &self,
        layer: &Layer,
        h: &Tensor,
        mode: &Mode,
    ) -> Result<(Tensor, Option<moe::Routing>)> {
        match &layer.mlp {
            Mlp::Dense { gate, up, down } => {
                let gate = gate.forward_mode(h, self.compute, mode)?;
                let up = up.forward_mode(h, self.compute, mode)?;
                let hidden = match self.config.gemma {
                    // GeGLU: gelu_pytorch_tanh(gate) · up (candle's `gelu` is the tanh form).
                    Some(_) => (gate.gelu()? * up)?,
                    None => kernels::swiglu(&gate, &up)?,
                };
                Ok((down.forward_mode(&hidden, self.compute, mode)?, None))
            }
            Mlp::Sparse(moe) => {
                let (y, routing) = moe.forward(h, self.compute, mode, |v| self.input(v))?;
                Ok((y, Some(routing)))
            }
        }
    }

    /// The mean cross-entropy of the final norm's output `x` [n·t, hidden] against `targets`.
    fn loss_of(&self, x: &Tensor, targets: &Tensor) -> Result<Tensor> {
        self.loss_with(x, &self.head_weight(), targets)
    }

    /// [`Llama::loss_of`] with the head's weight `w` (the model's, or a detached copy).
    fn loss_with(&self, x: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
        if self.compute == DType::F32 && head::applies(x, w) {
            // Checkpointing trades time for memory: the head's logits are made again too.
            let keep = !self.checkpoint.load(Ordering::Relaxed);
            return head::loss_keeping(x, w, &targets.flatten_all()?, keep);
        }
        let dt = self.compute;
        let logits = x.to_dtype(dt)?.matmul(&w.to_dtype(dt)?.t()?)?;
        if kernels::row_cross_entropy_applies(&logits) {
            // The GPU's cross-entropy reads bf16 logits as they are: no f32 copy of them.
            return ddpjob_seam::task::cross_entropy(&logits, targets);
        }
        ddpjob_seam::task::cross_entropy(&logits.to_dtype(DType::F32)?, targets)
    }

    /// Logits [rows, vocab] in f32 of the final norm's output `x`.
    fn project(&self, x: &Tensor) -> Result<Tensor> {
        self.logits(x)?.to_dtype(DType::F32)
    }

    /// Logits [rows, vocab] of `x` in the compute dtype.
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let dt = self.compute;
        x.to_dtype(dt)?
            .matmul(&self.head_weight().to_dtype(dt)?.t()?)
    }
}

impl Model for Llama {
    /// Token ids [n, t] (t ≤ block_size; [n, t, 2] packed, see `models::packed`) → f32
    /// logits [n, t, vocab].
    fn forward(&self, xs: &Tensor, mode: &Mode) -> Result<Tensor> {
        let (n, t) = packed::rows(xs)?;
        self.project(&self.trunk(xs, mode)?)?
            .reshape((n, t, self.config.vocab_size))
    }

    /// The trunk runs once over the batch (in evaluation every layer detached, as
    /// [`Model::score`] runs them, so no graph is kept), then each row's log-likelihood is the
    /// loss of that row alone, cut to its last scored target, times −its scored targets: on the
    /// CPU in f32 the fused head (no [rows, t, vocab] logits held, nor padding projected), on a
    /// GPU the cross-entropy that reads bf16 logits as they are.
    fn row_log_likelihoods(&self, xs: &Tensor, targets: &Tensor, mode: &Mode) -> Result<Tensor> {
        let (n, t) = packed::rows(xs)?;
        let (x, w) = match mode {
            Mode::Eval => {
                let (ids, packing) = packed::split(xs)?;
                let shape = self.check_window(&ids)?;
                let x = self.detached_layers(&ids, shape, packing.as_ref(), mode)?;
                (self.final_norm(&x)?.detach(), self.head_weight().detach())
            }
            Mode::Train { .. } => (self.trunk(xs, mode)?, self.head_weight()),
        };
        let ignore = ddpjob_seam::task::IGNORE_TARGET;
        let ys = targets.to_dtype(DType::U32)?.reshape((n, t))?;
        let host = ys.to_vec2::<u32>()?;
        let mut rows = Vec::with_capacity(n);
        for (r, row) in host.iter().enumerate() {
            let scored = row.iter().filter(|&&y| y != ignore).count();
            let Some(last) = row.iter().rposition(|&y| y != ignore) else {
                rows.push(Tensor::zeros(1, DType::F32, x.device())?);
                continue;
            };
            let xr = x.narrow(0, r * t, last + 1)?;
            let yr = ys.narrow(0, r, 1)?.narrow(1, 0, last + 1)?.flatten_all()?;
            // One of the rows' losses kept to one backward (see `ddpjob_seam::row_passes`).
            let loss = ddpjob_seam::row_passes::within(|| self.loss_with(&xr, &w, &yr))?;
            let loss = loss.to_dtype(DType::F32)?;
            rows.push((loss * -(scored as f64))?.reshape(1)?);
        }
        Tensor::cat(&rows, 0)
    }

    /// On the CPU in f32 the output projection and the cross-entropy are one op that never
    /// holds all the logits (see `kit::head`).
    fn loss(&self, xs: &Tensor, targets: &Tensor, mode: &Mode) -> Result<Tensor> {
        Ok(self.loss_with_terms(xs, targets, mode)?.0)
    }

    /// A mixture of experts' load-balancing loss beside the language model's (see `moe`).
    fn loss_terms(&self) -> Vec<String> {
        match self.config.moe {
            Some(_) => vec!["aux_loss".into()],
            None => Vec::new(),
        }
    }

    fn loss_with_terms(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
    ) -> Result<(Tensor, Tensor)> {
        let (x, routings) = self.trunk_routed(xs, mode)?;
        let loss = self.loss_of(&x, targets)?;
        self.with_aux(loss, &routings, targets)
    }

    /// With `train.activation_checkpointing`, a pass that keeps each layer's input only; with
    /// streamed gradients, one that keeps each layer's graph apart. Otherwise autograd over
    /// the whole model.
    fn train_pass(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
    ) -> Result<Option<Box<dyn TrainPass + '_>>> {
        let recompute = self.checkpoint.load(Ordering::Relaxed);
        if !recompute && !self.stream.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let pass = crate::kit::layered::Layered::forward(self, xs, targets, mode, recompute)?;
        Ok(Some(Box::new(pass)))
    }

    /// Layer by layer (see `models::layered`): the embedding's gradient (added to until the end)
    /// and the output projection's (formed first) are held with one layer's.
    fn stream_gradients(&self) -> Option<usize> {
        self.stream.store(true, Ordering::Relaxed);
        let head = self.lm_head.as_ref().map_or(0, |v| v.elem_count());
        let outside = self.embed.elem_count() + head + self.norm.elem_count();
        let layers = self.params.element_count().saturating_sub(outside);
        let layer = layers.div_ceil(self.layers.len().max(1));
        Some(self.embed.elem_count() + head + layer)
    }

    fn checkpoint_activations(&self) -> std::result::Result<(), String> {
        self.checkpoint.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Layer by layer (see `models::layered`).
    fn shard_parameters(&self) -> std::result::Result<Vec<Vec<usize>>, String> {
        self.stream_gradients();
        let depth = self.layers.len();
        Ok(crate::kit::layered::blocks_by_name(
            &self.params,
            depth,
            |i| format!("model.layers.{i}."),
        ))
    }

    /// Layer by layer, each layer's output detached: the parameters are variables, so autograd
    /// would keep every layer's tensors until the loss is read, as much memory as training for
    /// an evaluation batch (1000 windows by default); this keeps one layer's.
    fn score(&self, xs: &Tensor, targets: &Tensor) -> Result<(f64, usize)> {
        let (ids, packing) = packed::split(xs)?;
        let shape = self.check_window(&ids)?;
        gate::gather(Unit::Rest)?;
        let x = self.detached_layers(&ids, shape, packing.as_ref(), &Mode::Eval)?;
        let x = self.final_norm(&x)?.detach();
        let w = self.head_weight().detach();
        let scored = match self.compute == DType::F32 && head::applies(&x, &w) {
            true => head::score(&x, &w, &targets.flatten_all()?),
            false => ddpjob_seam::task::loss_sum_and_correct(&self.project(&x)?, targets),
        };
        gate::release(Unit::Rest)?;
        scored
    }

    fn params(&self) -> &Params {
        &self.params
    }

    /// Keys and values kept per layer, each query within its layer's window (see `decode`).
    fn kv_decoder(&self) -> Option<&dyn crate::KvDecoder> {
        Some(self)
    }

    /// What autograd keeps per position of a training pass on the CPU in f32 (bf16 and GPUs:
    /// not known): in each layer the two norms' outputs, q, k, v and their rotations, the key
    /// and value heads repeated for their groups, the concatenation the attention reads, its
    /// output and projection, the MLP's gate, up, SwiGLU and down (a mixture's router and its
    /// k experts', `Moe::kept_per_token`), and the two residual sums; the backward's
    /// gradients of the largest layer's; the embedding and the final norm; the head's logits
    /// where it keeps them for its backward (a large vocabulary, within 256 MB). With
    /// checkpointing: each layer's input and one layer's tensors (recomputed, then
    /// differentiated). Within 10% of the measured peaks of two llamas (35 M and 6 M
    /// parameters, with and without checkpointing) and of a mixture (see docs/src/memory.md).
    fn activation_bytes_per_sample(&self, checkpointing: bool) -> Option<f64> {
        if self.compute != DType::F32 || !self.embed.as_tensor().device().is_cpu() {
            return None;
        }
        let c = &self.config;
        let (hidden, inner) = (c.hidden_size, c.intermediate_size);
        let (q, kv) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        // Qwen3's normed q and k, kept beside the projections.
        let normed = if c.qk_norm == QkNorm::None { 0 } else { q + kv };
        // Gemma's two output norms, and GeGLU's activation beside its product.
        let normed = normed
            + if c.gemma.is_some() {
                2 * hidden + inner
            } else {
                0
            };
        // The attention in tiles: q, k and v side by side once ([q + 2·kv]), its output and a
        // log-sum-exp per head, beside the projections and the rotated q and k.
        let attention = 6 * hidden + 4 * q + 5 * kv + c.num_attention_heads + normed;
        let kept: Vec<usize> = (self.layers.iter())
            .map(|layer| match &layer.mlp {
                Mlp::Dense { .. } => attention + 3 * inner,
                Mlp::Sparse(moe) => attention + moe.kept_per_token(hidden),
            })
            .collect();
        let largest = kept.iter().copied().max().unwrap_or(0);
        let per_position = match checkpointing {
            false => kept.iter().sum::<usize>() + largest,
            true => kept.len() * hidden + largest,
        } + 2 * hidden;
        // The head's chunk of logits (counted per sample: a pass of several holds no more
        // than one sample's, within the same budget).
        let logits = head::kept_logit_bytes(c.block_size, c.vocab_size);
        Some((per_position * c.block_size * 4 + logits) as f64)
    }

    /// The mixtures' experts stacked for their grouped products, every sparse layer's (kept
    /// to the backward), or one layer's at a time with checkpointing (recomputed).
    fn activation_bytes_per_pass(&self, checkpointing: bool) -> f64 {
        if self.compute != DType::F32 || !self.embed.as_tensor().device().is_cpu() {
            return 0.0;
        }
        let stacked = self.layers.iter().map(|layer| match &layer.mlp {
            Mlp::Dense { .. } => 0,
            Mlp::Sparse(moe) => moe.stacked_elements(),
        });
        let elements = match checkpointing {
            false => stacked.sum::<usize>(),
            true => stacked.max().unwrap_or(0),
        };
        (elements * 4) as f64
    }

    /// 6 operations per trained parameter per token, 4 per frozen one (no weight gradient),
    /// the untied embedding's lookup excepted (as nanoGPT counts), plus attention's two
    /// products: 12·layers·heads·head_dim·t per token.
    fn train_flops_per_sample(&self) -> Option<f64> {
        let c = &self.config;
        let mut trainable = self.params.trainable_element_count() as f64;
        let mut frozen = self.params.element_count() as f64 - trainable;
        // The 4-bit base's layers are frozen layers all the same.
        frozen += self.params.packed_element_count() as f64;
        if !c.tie_word_embeddings {
            // The untied embedding is a lookup, whether it trains or not.
            let embed = (c.vocab_size * c.hidden_size) as f64;
            match self.params.frozen().contains(&self.embed) {
                true => frozen -= embed,
                false => trainable -= embed,
            }
        }
        // A token reaches k of a sparse layer's E experts: the others' products are not its.
        for layer in &self.layers {
            if let Mlp::Sparse(moe) = &layer.mlp {
                let (t, f) = moe.inactive_elements(self.params.frozen());
                trainable -= t;
                frozen -= f;
            }
        }
        // A frozen parameter forms no weight gradient: its forward and input gradient only.
        let t = c.block_size as f64;
        let width = (c.num_attention_heads * c.head_dim) as f64;
        let attention = 12.0 * c.num_hidden_layers as f64 * width * t;
        Some((6.0 * trainable + 4.0 * frozen + attention) * t)
    }
}

/// [t, t]: 0 where query i may see key j (0 ≤ i − j < window; a window of t is the plain
/// causal mask), -inf elsewhere. Made per call: a checkpoint's context (8k to 128k positions)
/// would make a [block, block] mask of gigabytes.
fn windowed_causal_mask(t: usize, window: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..t * t)
        .map(|at| {
            let (i, j) = (at / t, at % t);
            match j <= i && i - j < window {
                true => 0.0,
                false => f32::NEG_INFINITY,
            }
        })
        .collect();
    Tensor::from_vec(mask, (t, t), device)
}

/// Each of `kv` [n, t, kv_heads, hd]'s heads repeated `groups` times in place: [n, t,
/// kv_heads·groups, hd], query head h reading key head h / groups (`repeat_kv`).
fn repeat_kv(kv: &Tensor, groups: usize) -> Result<Tensor> {
    if groups == 1 {
        return Ok(kv.clone());
    }
    let (n, t, kv_heads, hd) = kv.dims4()?;
    kv.unsqueeze(3)?
        .broadcast_as((n, t, kv_heads, groups, hd))?
        .reshape((n, t, kv_heads * groups, hd))
}

/// Where a pass's positions are: each row's own (packed examples restart at 0), or every row's
/// from an offset (0, or the positions a KV cache already holds).
#[derive(Clone, Copy)]
enum Position<'a> {
    Packed(&'a Packing),
    From(usize),
}

impl<'a> From<Option<&'a Packing>> for Position<'a> {
    fn from(packing: Option<&'a Packing>) -> Self {
        packing.map_or(Position::From(0), Position::Packed)
    }
}
