//! The mixture of experts that takes the MLP's place in the sparse layers of `qwen3_moe`,
//! `mixtral` and `olmoe`, as transformers computes it: router logits `x·Gᵀ`, their softmax in
//! f32, each token's top k experts (renormalised to sum 1 where the family does), and the
//! output Σ wₑ·expertₑ(x), each expert a SwiGLU MLP of its own.
//!
//! The tokens are grouped by expert: one gather puts the rows each expert reads together, each
//! expert runs one product over its rows (the kernels' grouped linear on the CPU in f32: one GEMM
//! per expert, the experts side by side), and one scatter adds the weighted outputs back to
//! their tokens, each token's in ascending expert order as transformers' `index_add_` loop adds
//! them. The top-k choice is made on the host (it is not differentiated, as in torch).
//!
//! Also here: the load-balancing loss of transformers' `load_balancing_loss_func` (Switch
//! Transformer's), per sequence, see [`AuxWeights`].

use candle_core::{D, DType, Device, Result, Tensor};

use crate::Mode;
use crate::kit::{Linear, ParamBuilder};
use ddpjob_kernels as kernels;

/// How a family names its router and experts in `transformers`' files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertNames {
    /// `mlp.gate`, `mlp.experts.E.{gate,up,down}_proj` (Qwen3-MoE, OLMoE).
    Qwen,
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.E.{w1,w3,w2}` (Mixtral).
    Mixtral,
}

/// The mixture's shape and routing, in `config.json`'s terms.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// `num_experts_per_tok`.
    pub top_k: usize,
    /// The chosen experts' weights renormalised to sum 1 (Mixtral always; Qwen3-MoE and OLMoE
    /// as `norm_topk_prob` says).
    pub norm_topk_prob: bool,
    /// Each expert's SwiGLU width (`moe_intermediate_size`; Mixtral's `intermediate_size`).
    pub expert_size: usize,
    /// Per layer, whether its MLP is the mixture (`mlp_only_layers`, `decoder_sparse_step`).
    pub sparse: Vec<bool>,
    /// `router_aux_loss_coef`.
    pub aux_coef: f64,
    /// `output_router_logits`: the load-balancing loss is added to the training objective
    /// (times `aux_coef`), as transformers adds it; otherwise it is only logged.
    pub aux_in_loss: bool,
    pub names: ExpertNames,
}

struct Expert {
    gate: Linear,
    up: Linear,
    down: Linear,
}

pub(super) struct Moe {
    router: Linear,
    experts: Vec<Expert>,
    top_k: usize,
    norm_topk_prob: bool,
}

/// What a layer's router decided for its tokens: the softmax of its logits [tokens, experts]
/// (f32, differentiable: the load-balancing loss reads it) and each token's k experts.
pub struct Routing {
    pub(super) probs: Tensor,
    pub(super) chosen: Vec<usize>,
}

impl Moe {
    /// The router and experts of layer `p` (`model.layers.i`), drawn as `transformers` draws
    /// them (normal, std `std`).
    pub(super) fn build(
        init: &mut ParamBuilder,
        p: &str,
        hidden: usize,
        c: &MoeConfig,
        std: f32,
    ) -> Result<Self> {
        let (block, [g, u, d]) = match c.names {
            ExpertNames::Qwen => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
            ExpertNames::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
        };
        let router = init.linear(
            &format!("{p}.{block}.gate"),
            hidden,
            c.num_experts,
            std,
            false,
        )?;
        let mut experts = Vec::with_capacity(c.num_experts);
        for e in 0..c.num_experts {
            let name = |n: &str| format!("{p}.{block}.experts.{e}.{n}");
            let width = c.expert_size;
            experts.push(Expert {
                gate: init.linear(&name(g), hidden, width, std, false)?,
                up: init.linear(&name(u), hidden, width, std, false)?,
                down: init.linear(&name(d), width, hidden, std, false)?,
            });
        }
        let dropped = experts
            .iter()
            .flat_map(|e| [&e.gate, &e.up, &e.down])
            .find(|l| l.adapter.as_ref().is_some_and(|a| a.dropout > 0.0))
            .map(|l| l.weight.as_tensor().id());
        if let Some(id) = dropped {
            let name = init
                .entries
                .iter()
                .find(|(_, v)| v.as_tensor().id() == id)
                .map_or("an expert", |(n, _)| n.as_str());
            return Err(candle_core::Error::Msg(format!(
                "model.lora.dropout > 0 with adapters on the experts (`{name}`): an expert's \
                 rows are routed tokens, not the batch's rows the dropout masks are drawn for; \
                 set model.lora.dropout = 0.0, or leave the experts out of \
                 model.lora.target_modules (e.g. [\"q_proj\", \"v_proj\"])"
            )));
        }
        Ok(Moe {
            router,
            experts,
            top_k: c.top_k,
            norm_topk_prob: c.norm_topk_prob,
        })
    }

    /// The elements of the experts a token does not reach (E − k of E), trained and frozen:
    /// what a token's FLOPs leave out.
    pub(super) fn inactive_elements(&self, frozen: &crate::FrozenSet) -> (f64, f64) {
        let (e, k) = (self.experts.len() as f64, self.top_k as f64);
        let mut out = (0.0, 0.0);
        for l in self.experts.iter().flat_map(|x| [&x.gate, &x.up, &x.down]) {
            let n = l.weight.elem_count() as f64 * (e - k) / e;
            match frozen.contains(&l.weight) {
                true => out.1 += n,
                false => out.0 += n,
            }
        }
        out
    }

    /// Values autograd keeps per token of a training pass on the CPU in f32: the router's
    /// logits, shifted, exponentiated and normalised ([E] each), the k weights picked and
    /// renormalised, and per chosen expert its gathered input, gate, up, SwiGLU, output and
    /// weighted output; the sum the outputs are added into.
    pub(super) fn kept_per_token(&self, hidden: usize) -> usize {
        let (e, k) = (self.experts.len(), self.top_k);
        let width = self.experts[0].gate.weight.dims()[0];
        4 * e + 2 * k + k * (3 * hidden + 3 * width) + 2 * hidden
    }

    /// Values a training pass on the CPU in f32 keeps whatever its tokens: the experts' gate, up
    /// and down weights stacked [E, out, in] for the grouped products (read again by their
    /// backward). None without adapters on the experts (they run one expert at a time).
    pub(super) fn stacked_elements(&self) -> usize {
        match self.experts_have_adapters() {
            true => 0,
            false => self
                .experts
                .iter()
                .flat_map(|x| [&x.gate, &x.up, &x.down])
                .map(|l| l.weight.elem_count())
                .sum(),
        }
    }

    /// Whether any expert has a LoRA adapter (adapter dropout is not applied to them).
    pub(super) fn experts_have_adapters(&self) -> bool {
        self.experts.iter().any(|e| {
            [&e.gate, &e.up, &e.down]
                .iter()
                .any(|l| l.adapter.is_some())
        })
    }

    /// The mixture over `h` [tokens, hidden]: its output [tokens, hidden] in the compute dtype
    /// and the routing.
    pub(super) fn forward(
        &self,
        h: &Tensor,
        compute: DType,
        mode: &Mode,
        input: impl Fn(&candle_core::Var) -> Tensor,
    ) -> Result<(Tensor, Routing)> {
        let (tokens, hidden) = h.dims2()?;
        let experts = self.experts.len();
        let logits = self.router.forward_mode(h, compute, mode)?;
        let probs = softmax_rows(&logits.to_dtype(DType::F32)?)?;
        let chosen = top_k(&probs.detach().to_vec2::<f32>()?, self.top_k);
        let k = self.top_k;
        let device = h.device();
        let picked = Tensor::from_vec(
            chosen.iter().map(|&e| e as u32).collect::<Vec<_>>(),
            (tokens, k),
            device,
        )?;
        let mut weights = probs.gather(&picked, 1)?;
        if self.norm_topk_prob {
            weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
        }
        // Grouped by expert, ascending; within an expert, token order.
        let mut counts = vec![0usize; experts];
        for &e in &chosen {
            counts[e] += 1;
        }
        let mut starts = vec![0usize; experts];
        for e in 1..experts {
            starts[e] = starts[e - 1] + counts[e - 1];
        }
        let (mut rows, mut slots) = (vec![0u32; tokens * k], vec![0u32; tokens * k]);
        let mut next = starts.clone();
        for (slot, &e) in chosen.iter().enumerate() {
            rows[next[e]] = (slot / k) as u32;
            slots[next[e]] = slot as u32;
            next[e] += 1;
        }
        let rows = Tensor::from_vec(rows, tokens * k, device)?;
        let slots = Tensor::from_vec(slots, tokens * k, device)?;
        let x = h.to_dtype(compute)?.index_select(&rows, 0)?;
        let y = self.experts_over(&x, &counts, compute, &input)?;
        let w = weights
            .flatten_all()?
            .index_select(&slots, 0)?
            .to_dtype(y.dtype())?;
        let y = y.broadcast_mul(&w.unsqueeze(1)?)?;
        let out = Tensor::zeros((tokens, hidden), y.dtype(), device)?.index_add(&rows, &y, 0)?;
        Ok((out, Routing { probs, chosen }))
    }

    /// Each expert's SwiGLU over its rows of `x` (sorted by expert, `counts` of each).
    fn experts_over(
        &self,
        x: &Tensor,
        counts: &[usize],
        compute: DType,
        input: &impl Fn(&candle_core::Var) -> Tensor,
    ) -> Result<Tensor> {
        let stacked = |pick: fn(&Expert) -> &Linear| {
            let ws: Vec<Tensor> = self
                .experts
                .iter()
                .map(|e| input(&pick(e).weight))
                .collect();
            Tensor::stack(&ws, 0)
        };
        if compute == DType::F32
            && !self.experts_have_adapters()
            && kernels::grouped_linear_applies(x, self.experts[0].gate.weight.as_tensor())
        {
            let gate = kernels::grouped_linear(x, &stacked(|e| &e.gate)?, counts)?;
            let up = kernels::grouped_linear(x, &stacked(|e| &e.up)?, counts)?;
            let hidden = kernels::swiglu(&gate, &up)?;
            return kernels::grouped_linear(&hidden, &stacked(|e| &e.down)?, counts);
        }
        // Elsewhere (bf16, a GPU, adapters on the experts): each expert's layers over its
        // rows, in candle's ops.
        let mut parts = Vec::new();
        let mut first = 0;
        for (expert, &m) in self.experts.iter().zip(counts) {
            if m > 0 {
                let rows = x.narrow(0, first, m)?;
                let gate = expert.gate.forward_mode(&rows, compute, &Mode::Eval)?;
                let up = expert.up.forward_mode(&rows, compute, &Mode::Eval)?;
                let hidden = kernels::swiglu(&gate, &up)?;
                parts.push(expert.down.forward_mode(&hidden, compute, &Mode::Eval)?);
            }
            first += m;
        }
        Tensor::cat(&parts, 0)
    }
}

/// softmax over each row, from differentiable ops (the row max subtracted, not differentiated).
fn softmax_rows(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Each row's `k` largest entries' indices, largest first (ties: the lower index, as torch's
/// CPU `topk` keeps them).
fn top_k(probs: &[Vec<f32>], k: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(probs.len() * k);
    for row in probs {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        out.extend_from_slice(&order[..k]);
    }
    out
}

/// The load-balancing loss's constant factor for each token and expert, made once every sparse
/// layer has routed a batch: the loss is then Σ over layers of Σ probs ⊙ K, each layer's term
/// apart (so a pass that goes layer by layer differentiates it with its own layer).
///
/// transformers computes one loss over the forward's whole batch: E·Σₑ fₑ·Pₑ, fₑ the share of
/// the (token, layer) choices that went to expert e and Pₑ its mean probability, over every
/// layer's tokens but padding. A batch-wide product of means is not a sum over sequences, so
/// the result would change with how the global batch is cut over workers, micro-batches and
/// row shards. Here each sequence has its own fₑ and Pₑ (over its own tokens, across the
/// layers), and the loss is the mean of the sequences' losses weighted by their scored targets,
/// as the language-model loss weighs them: transformers' number for a batch of one sequence,
/// and every DDP guarantee holds. Padding (the trailing positions of a row whose targets are
/// all ignored) is left out, as transformers' attention mask leaves it out.
pub(super) struct AuxWeights {
    /// [tokens, experts], constant.
    k: Tensor,
}

impl AuxWeights {
    /// For the routings of every sparse layer over a batch of `rows` sequences of `t` tokens,
    /// `targets` [rows, t]: whether each position's target scores.
    pub(super) fn of(
        routings: &[&Routing],
        experts: usize,
        top_k: usize,
        targets: &[Vec<bool>],
        device: &Device,
    ) -> Result<Option<AuxWeights>> {
        let layers = routings.len();
        let (rows, t) = (targets.len(), targets.first().map_or(0, Vec::len));
        if layers == 0 || rows == 0 || t == 0 {
            return Ok(None);
        }
        let scored = |row: &[bool]| row.iter().filter(|&&y| y).count();
        let total_scored: usize = targets.iter().map(|r| scored(r)).sum();
        let mut k = vec![0f32; rows * t * experts];
        if total_scored == 0 {
            return Ok(Some(AuxWeights {
                k: Tensor::from_vec(k, (rows * t, experts), device)?,
            }));
        }
        for (r, row) in targets.iter().enumerate() {
            // Real positions: up to the last scored target (what follows is padding).
            let valid = row.iter().rposition(|&y| y).map_or(0, |i| i + 1);
            if valid == 0 {
                continue;
            }
            let mut counts = vec![0f64; experts];
            for routing in routings {
                for pos in 0..valid {
                    let at = (r * t + pos) * top_k;
                    for &e in &routing.chosen[at..at + top_k] {
                        counts[e] += 1.0;
                    }
                }
            }
            let n = (layers * valid) as f64;
            let weight = scored(row) as f64 / total_scored as f64;
            for pos in 0..valid {
                for (e, &count) in counts.iter().enumerate() {
                    // E · fₑ / n, fₑ = count / n: the factor of each Σ p in Pₑ.
                    let f = count / n;
                    k[((r * t) + pos) * experts + e] = (experts as f64 * f / n * weight) as f32;
                }
            }
        }
        Ok(Some(AuxWeights {
            k: Tensor::from_vec(k, (rows * t, experts), device)?,
        }))
    }

    /// One layer's share of the loss: Σ probs ⊙ K (a scalar, differentiable).
    pub(super) fn term(&self, routing: &Routing) -> Result<Tensor> {
        (&routing.probs * &self.k)?.sum_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_takes_the_largest_first_and_the_lower_index_on_ties() {
        let rows = vec![vec![0.1, 0.4, 0.2, 0.4], vec![0.7, 0.1, 0.15, 0.05]];
        assert_eq!(top_k(&rows, 2), vec![1, 3, 0, 2]);
    }

    /// One sequence, no padding: E·Σₑ fₑ·Pₑ over both layers' tokens, by hand.
    #[test]
    fn the_loss_of_one_sequence_is_switch_transformers() {
        let device = Device::Cpu;
        let probs = |v: Vec<f32>| Tensor::from_vec(v, (2, 2), &device).unwrap();
        let a = Routing {
            probs: probs(vec![0.9, 0.1, 0.3, 0.7]),
            chosen: vec![0, 1],
        };
        let b = Routing {
            probs: probs(vec![0.6, 0.4, 0.8, 0.2]),
            chosen: vec![0, 0],
        };
        let w = AuxWeights::of(&[&a, &b], 2, 1, &[vec![true, true]], &device)
            .unwrap()
            .unwrap();
        let loss: f32 = (w.term(&a).unwrap() + w.term(&b).unwrap())
            .unwrap()
            .to_scalar()
            .unwrap();
        // f = (3/4, 1/4); P = ((0.9+0.3+0.6+0.8)/4, (0.1+0.7+0.4+0.2)/4) = (0.65, 0.35).
        let expected = 2.0 * (0.75 * 0.65 + 0.25 * 0.35);
        assert!((loss - expected).abs() < 1e-6, "{loss} vs {expected}");
    }

    /// Trailing ignored targets are padding and count nowhere; a row without scored targets
    /// weighs nothing.
    #[test]
    fn padding_and_unscored_rows_are_left_out() {
        let device = Device::Cpu;
        let routing = Routing {
            probs: Tensor::from_vec(
                vec![0.5f32, 0.5, 0.9, 0.1, 0.2, 0.8, 0.3, 0.7],
                (4, 2),
                &device,
            )
            .unwrap(),
            chosen: vec![0, 1, 1, 0],
        };
        let targets = vec![vec![true, false], vec![false, false]];
        let w = AuxWeights::of(&[&routing], 2, 1, &targets, &device)
            .unwrap()
            .unwrap();
        let k = w.k.to_vec2::<f32>().unwrap();
        // Row 0: its first position only (f = (1, 0)): K = E·f/n = (2, 0).
        assert_eq!(k[0], vec![2.0, 0.0]);
        assert!(k[1..].iter().flatten().all(|&v| v == 0.0), "{k:?}");
    }
}
