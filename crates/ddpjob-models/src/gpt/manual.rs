//! The GPT's training pass written out by hand for f32 on the CPU, as llm.c's `train_gpt2.c`
//! does it: the forward keeps the activations the backward needs, the backward writes each
//! parameter's gradient once and adds the residual stream's gradient in place. Candle's
//! autograd, which this replaces there, allocates a zeroed gradient for every intermediate
//! tensor and adds each contribution into a new one (measured: 7% of this model's step, and as
//! much again in allocation). The layers are the fused kernels the autograd path runs, so both
//! paths compute the same values up to the order of a few sums (tests compare them).

use candle_core::{DType, Result, Tensor, bail};
use rayon::prelude::*;

use super::Gpt;
use crate::kit::{attention, head};
use crate::{CollectedGradients, GradientSink, Mode, TrainPass};
use ddpjob_kernels::dropout;
use ddpjob_kernels::{self as kernels, linear_backward, linear_forward, scratch, with_all_values};

const EPS: f32 = 1e-5;

/// The forward of one training pass and what its backward needs.
pub(super) struct Pass<'a> {
    gpt: &'a Gpt,
    /// Sequences and their length.
    n: usize,
    t: usize,
    ids: Vec<usize>,
    targets: Vec<usize>,
    /// Dropout masks by site (embeddings, then each block's two residual branches); empty
    /// when nothing is dropped.
    masks: Vec<Vec<f32>>,
    blocks: Vec<Activations>,
    /// The last block's output (ln_f's input) and ln_f's output.
    last: Vec<f32>,
    normed: Vec<f32>,
    /// What the head kept for its backward (see `head::mean_loss`).
    kept: crate::kit::head::vocab_blocks::Kept,
    loss: Tensor,
}

/// One block's activations, each [n·t, width] row-major.
struct Activations {
    /// The residual stream entering the block, and after the attention branch is added.
    input: Vec<f32>,
    mid: Vec<f32>,
    ln_1: Vec<f32>,
    qkv: Vec<f32>,
    /// Every head's attention probabilities, [n, heads, t, t]; empty where the backward
    /// recomputes them instead (see [`keeps_probabilities`]); in tiles (from
    /// `attention::TILED_FROM` positions), every head's log-sum-exps, [n, heads, t].
    probabilities: Vec<f32>,
    attended: Vec<f32>,
    ln_2: Vec<f32>,
    /// GELU's slope at c_fc's output (all the backward needs of that output), and GELU's
    /// output.
    gelu_slope: Vec<f32>,
    activated: Vec<f32>,
}

/// Whether the hand-written pass runs for `gpt`: f32 on the CPU (else autograd does).
pub(super) fn applies(gpt: &Gpt) -> bool {
    // LoRA's adapters are differentiated by autograd (their own ops), the whole model with
    // them.
    let adapters = gpt.params.iter().any(|(n, _)| crate::is_adapter(n));
    gpt.compute == DType::F32 && kernels::applies(gpt.wte.as_tensor()) && !adapters
}

/// The forward pass of token windows `xs` [n, t] against `targets` [n, t].
pub(super) fn forward<'a>(
    gpt: &'a Gpt,
    xs: &Tensor,
    targets: &Tensor,
    mode: &Mode,
) -> Result<Pass<'a>> {
    let (n, t) = xs.dims2()?;
    let (ids, target_ids) = checked_ids(gpt, xs, targets)?;
    let cfg = &gpt.config;
    let c = cfg.n_embd;
    let masks = match mode {
        Mode::Train { row_seeds } if cfg.dropout > 0.0 => {
            if row_seeds.len() != n {
                bail!("gpt: {} row seeds for {n} rows", row_seeds.len());
            }
            (0..1 + 2 * gpt.blocks.len())
                .map(|site| dropout::mask(row_seeds, site, t * c, cfg.dropout))
                .collect()
        }
        _ => Vec::new(),
    };
    let (blocks, x, normed, (loss, kept)) = with_all_values(&weight_tensors(gpt), |all| {
        let weights = Weights(all);
        let keep = match gpt.checkpoints() {
            true => Keep::Inputs,
            false => Keep::Everything,
        };
        let (blocks, x, normed) = trunk(gpt, &weights, &ids, t, &masks, keep);
        let (loss, kept) = head::mean_loss(&normed, weights.get(0), &target_ids, true)?;
        Ok((blocks, x, normed, (loss, kept)))
    })?;
    Ok(Pass {
        gpt,
        n,
        t,
        ids,
        targets: target_ids,
        masks,
        blocks,
        last: x,
        normed,
        kept,
        loss: Tensor::new(loss, xs.device())?,
    })
}

/// Windows evaluated at once by [`score`]: about 512 positions, so a block's activations stay
/// in the core's caches instead of streaming a whole evaluation batch through memory.
pub(super) const SCORE_POSITIONS: usize = 512;

/// Σ cross-entropy and the number of targets predicted exactly (evaluation, no dropout): the
/// forward of [`forward`] a few windows at a time, each block's activations handed back as
/// soon as the next block has read them.
pub(super) fn score(gpt: &Gpt, xs: &Tensor, targets: &Tensor) -> Result<(f64, usize)> {
    let (_, t) = xs.dims2()?;
    let (ids, target_ids) = checked_ids(gpt, xs, targets)?;
    with_all_values(&weight_tensors(gpt), |all| {
        let weights = Weights(all);
        let window_rows = t * (SCORE_POSITIONS / t).max(1);
        let mut sums = (0.0, 0);
        for (ids, targets) in ids.chunks(window_rows).zip(target_ids.chunks(window_rows)) {
            let (_, x, normed) = trunk(gpt, &weights, ids, t, &[], Keep::Nothing);
            let (loss, correct) = head::score_values(&normed, weights.get(0), targets)?;
            scratch::give([x, normed]);
            sums = (sums.0 + loss, sums.1 + correct);
        }
        Ok(sums)
    })
}

/// The token ids of `xs` [n, t] and of `targets`, checked against the model.
fn checked_ids(gpt: &Gpt, xs: &Tensor, targets: &Tensor) -> Result<(Vec<usize>, Vec<usize>)> {
    let (_, t) = xs.dims2()?;
    let cfg = &gpt.config;
    if t == 0 || t > cfg.block_size {
        bail!("gpt: {t} positions, block_size is {}", cfg.block_size);
    }
    let (ids, target_ids) = (kernels::indices(xs)?, kernels::indices(targets)?);
    if let Some(&bad) = ids.iter().find(|&&i| i >= cfg.vocab_size) {
        bail!(
            "gpt: token {bad} is outside the vocabulary of {}",
            cfg.vocab_size
        );
    }
    if target_ids.len() != ids.len() {
        bail!("gpt: {} targets for {} tokens", target_ids.len(), ids.len());
    }
    Ok((ids, target_ids))
}

/// What a forward keeps of each block for the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// Nothing (evaluation): each block's buffers go back to [`scratch`] at once.
    Nothing,
    /// Every activation the backward reads.
    Everything,
    /// The block's input only; the backward runs the block's forward again from it
    /// (`train.activation_checkpointing`).
    Inputs,
}

/// The embeddings and blocks of windows of `t` tokens `ids` (dropout `masks` by site, or
/// none): each block's activations as `keep` says, the last block's output and ln_f's output.
fn trunk(
    gpt: &Gpt,
    weights: &Weights,
    ids: &[usize],
    t: usize,
    masks: &[Vec<f32>],
    keep: Keep,
) -> (Vec<Activations>, Vec<f32>, Vec<f32>) {
    let (c, rows) = (gpt.config.n_embd, ids.len());
    let (wte, wpe) = (weights.get(0), weights.get(1));
    let mut x = scratch::take(rows * c);
    for ((row, &id), out) in (0..rows).zip(ids).zip(x.chunks_exact_mut(c)) {
        let (token, position) = (&wte[id * c..][..c], &wpe[(row % t) * c..][..c]);
        for ((o, a), b) in out.iter_mut().zip(token).zip(position) {
            *o = a + b;
        }
    }
    drop_in_place(&mut x, masks.first());
    let mut blocks = Vec::with_capacity(gpt.blocks.len());
    for i in 0..gpt.blocks.len() {
        // A block computes alike whatever is kept of it, so a recomputed block has the bits
        // of the first forward.
        let (a, next) = block_forward(
            gpt,
            &weights.block(i),
            i,
            x,
            t,
            masks,
            keep != Keep::Nothing,
        );
        x = next;
        match keep {
            Keep::Everything => blocks.push(a),
            Keep::Inputs => {
                let mut buffers = a.buffers();
                let input = std::mem::take(&mut buffers[0]);
                scratch::give(buffers);
                blocks.push(Activations::input_only(input));
            }
            Keep::Nothing => scratch::give(a.buffers()),
        }
    }
    let (ln_f, ln_f_bias) = weights.ln_f();
    let normed = layer_norm(&x, ln_f, ln_f_bias);
    (blocks, x, normed)
}

/// Block `i` over the residual stream `x` ([rows, C], windows of `t`): its activations (its
/// input `x` among them) and its output. `for_backward`: GELU's slope and (where
/// [`keeps_probabilities`] says) the attention probabilities are kept too.
fn block_forward(
    gpt: &Gpt,
    w: &BlockWeights,
    i: usize,
    x: Vec<f32>,
    t: usize,
    masks: &[Vec<f32>],
    for_backward: bool,
) -> (Activations, Vec<f32>) {
    let (c, rows) = (gpt.config.n_embd, x.len() / gpt.config.n_embd);
    let (n_head, activation) = (gpt.config.n_head, gpt.config.activation);
    let ln_1 = layer_norm(&x, w.ln_1, w.ln_1_bias);
    let qkv = linear_forward(&ln_1, w.c_attn, w.c_attn_bias, rows);
    let mut attended = scratch::take(rows * c);
    let probabilities = attend(&qkv, &mut attended, (n_head, t, c), for_backward);
    let mut branch = linear_forward(&attended, w.attn_proj, w.attn_proj_bias, rows);
    drop_in_place(&mut branch, masks.get(1 + 2 * i));
    let mid = add_to(branch, &x);
    let ln_2 = layer_norm(&mid, w.ln_2, w.ln_2_bias);
    // c_fc's output, replaced by GELU's slope there when a backward will follow.
    let mut gelu_slope = linear_forward(&ln_2, w.c_fc, w.c_fc_bias, rows);
    let mut activated = scratch::take(gelu_slope.len());
    let elementwise = activated
        .par_chunks_mut(ELEMENTS_PER_TASK)
        .zip(gelu_slope.par_chunks_mut(ELEMENTS_PER_TASK));
    match for_backward {
        true => elementwise.for_each(|(y, x)| activation.apply_keeping_slope(x, y)),
        false => elementwise.for_each(|(y, x)| activation.apply(x, y)),
    }
    let mut branch = linear_forward(&activated, w.mlp_proj, w.mlp_proj_bias, rows);
    drop_in_place(&mut branch, masks.get(2 + 2 * i));
    let next = add_to(branch, &mid);
    let a = Activations {
        input: x,
        mid,
        ln_1,
        qkv,
        probabilities,
        attended,
        ln_2,
        gelu_slope,
        activated,
    };
    (a, next)
}

/// Causal attention of `qkv` ([rows, 3C], windows of `t`, `heads` heads) into `attended`
/// ([rows, C]): what the backward reads beside it, when `for_backward`. In tiles from
/// [`attention::TILED_FROM`] positions (every head's log-sum-exps, rows · heads values),
/// else per head's [t, t] probabilities: kept where [`keeps_probabilities`] says (every
/// head's), or none (the backward recomputes them).
fn attend(
    qkv: &[f32],
    attended: &mut [f32],
    (heads, t, c): (usize, usize, usize),
    for_backward: bool,
) -> Vec<f32> {
    let rows = attended.len() / c;
    if attention::tiled(t) {
        let mut lse = scratch::take(rows * heads);
        let tiles = kernels::Attention::multi_head(heads, c / heads, t);
        kernels::flash_attention_forward(&tiles, qkv, attended, &mut lse)
            .expect("the GPT's rows are whole windows of its heads");
        if for_backward {
            return lse;
        }
        scratch::give([lse]);
        return Vec::new();
    }
    let per_sequence = heads * t * t;
    let mut probabilities = match for_backward && keeps_probabilities(heads, t, c) {
        true => scratch::take(rows / t * per_sequence),
        false => Vec::new(),
    };
    let sequences = attended
        .par_chunks_mut(t * c)
        .zip(qkv.par_chunks(t * 3 * c));
    match probabilities.is_empty() {
        true => sequences.for_each(|(y, x)| {
            let mut p = scratch::take(t * t);
            attention::sequence(x, y, t, heads, &mut p);
            scratch::give([p]);
        }),
        false => sequences
            .zip(probabilities.par_chunks_mut(per_sequence))
            .for_each(|((y, x), p)| attention::sequence(x, y, t, heads, p)),
    }
    probabilities
}

impl TrainPass for Pass<'_> {
    fn loss(&self) -> &Tensor {
        &self.loss
    }

    fn backward(self: Box<Self>, scale: f64) -> Result<Vec<Option<Tensor>>> {
        CollectedGradients::of(self.gpt.params.len(), |sink| self.backward_to(scale, sink))
    }

    /// ln_f's gradients once the head's backward has formed them, each block's after its
    /// backward, last block first, then the position table's and the (tied) token table's,
    /// to which the head and the lookup both add.
    fn backward_to(self: Box<Self>, scale: f64, sink: &mut dyn GradientSink) -> Result<()> {
        let Pass {
            gpt,
            n,
            t,
            ids,
            targets,
            masks,
            blocks,
            last,
            normed,
            kept,
            loss: _,
        } = *self;
        let cfg = &gpt.config;
        let (c, rows) = (cfg.n_embd, n * t);
        let mut grads = Handover::new(gpt, sink);
        // A frozen (tied) embedding gets no gradient from the head or the lookup.
        let want_wte = !gpt.params.frozen().contains(&gpt.wte);
        with_all_values(&weight_tensors(gpt), |all| {
            let weights = Weights(all);
            let wte = weights.get(0);
            let mut d_normed = scratch::take(rows * c);
            let mut d_wte = head::loss_bwd(
                &normed,
                wte,
                &targets,
                scale as f32,
                &mut d_normed,
                &kept,
                want_wte,
            )?;
            // The gradient of the residual stream, from the top down.
            let mut d_res = scratch::take(rows * c);
            let (ln_f, _) = weights.ln_f();
            let (d_gain, d_bias) = layer_norm_bwd(&last, &d_normed, ln_f, &mut d_res, false);
            scratch::give([d_normed, last, normed]);
            grads.push_ln(&gpt.ln_f, d_gain, d_bias)?;
            for (i, a) in blocks.into_iter().enumerate().rev() {
                let w = weights.block(i);
                let a = match a.is_input_only() {
                    true => {
                        let (a, output) = block_forward(gpt, &w, i, a.input, t, &masks, true);
                        scratch::give([output]);
                        a
                    }
                    false => a,
                };
                let g = &mut grads;
                let block = &gpt.blocks[i];
                let d_branch = masked(&d_res, masks.get(2 + 2 * i));
                let (d_act, d_w, d_b) = linear_backward(
                    &a.activated,
                    w.mlp_proj,
                    &d_branch,
                    c,
                    block.mlp_proj.wanted(),
                );
                g.push_linear(&block.mlp_proj, d_w, d_b)?;
                // GELU's input gradient, in place of its output's.
                let mut d_hidden = d_act.unwrap_or_default();
                d_hidden
                    .par_chunks_mut(ELEMENTS_PER_TASK)
                    .zip(a.gelu_slope.par_chunks(ELEMENTS_PER_TASK))
                    .for_each(|(d, slope)| d.iter_mut().zip(slope).for_each(|(d, s)| *d *= s));
                let (d_ln_2, d_w, d_b) =
                    linear_backward(&a.ln_2, w.c_fc, &d_hidden, 4 * c, block.c_fc.wanted());
                g.push_linear(&block.c_fc, d_w, d_b)?;
                let d_ln_2 = d_ln_2.unwrap_or_default();
                let (d_gain, d_bias) = layer_norm_bwd(&a.mid, &d_ln_2, w.ln_2, &mut d_res, true);
                g.push_ln(&block.ln_2, d_gain, d_bias)?;
                scratch::give([d_hidden, d_ln_2]);
                let d_branch = masked(&d_res, masks.get(1 + 2 * i));
                let (d_att, d_w, d_b) = linear_backward(
                    &a.attended,
                    w.attn_proj,
                    &d_branch,
                    c,
                    block.attn_proj.wanted(),
                );
                g.push_linear(&block.attn_proj, d_w, d_b)?;
                let d_att = d_att.unwrap_or_default();
                let mut d_qkv = scratch::take(a.qkv.len());
                if attention::tiled(t) {
                    let saved = (&a.attended[..], &a.probabilities[..]);
                    let tiles = kernels::Attention::multi_head(cfg.n_head, c / cfg.n_head, t);
                    kernels::flash_attention_backward(&tiles, &a.qkv, saved, &d_att, &mut d_qkv)?;
                } else {
                    let per_sequence = cfg.n_head * t * t;
                    d_qkv
                        .par_chunks_mut(t * 3 * c)
                        .zip(a.qkv.par_chunks(t * 3 * c))
                        .zip(d_att.par_chunks(t * c))
                        .enumerate()
                        .for_each(|(s, ((dx, x), dy))| {
                            let kept = (!a.probabilities.is_empty())
                                .then(|| &a.probabilities[s * per_sequence..][..per_sequence]);
                            let mut work = scratch::take(2 * t * t);
                            attention::sequence_bwd(x, dy, dx, t, cfg.n_head, kept, &mut work);
                            scratch::give([work]);
                        });
                }
                let (d_ln_1, d_w, d_b) =
                    linear_backward(&a.ln_1, w.c_attn, &d_qkv, 3 * c, block.c_attn.wanted());
                g.push_linear(&block.c_attn, d_w, d_b)?;
                let d_ln_1 = d_ln_1.unwrap_or_default();
                let (d_gain, d_bias) = layer_norm_bwd(&a.input, &d_ln_1, w.ln_1, &mut d_res, true);
                g.push_ln(&block.ln_1, d_gain, d_bias)?;
                scratch::give([d_att, d_qkv, d_ln_1]);
                scratch::give(a.buffers());
            }
            let d_embed = masked(&d_res, masks.first());
            let mut d_wpe = vec![0f32; cfg.block_size * c];
            for ((row, &id), d) in (0..rows).zip(&ids).zip(d_embed.chunks_exact(c)) {
                if want_wte {
                    let token = &mut d_wte[id * c..][..c];
                    token.iter_mut().zip(d).for_each(|(a, b)| *a += b);
                }
                let position = &mut d_wpe[(row % t) * c..][..c];
                position.iter_mut().zip(d).for_each(|(a, b)| *a += b);
            }
            drop(d_embed);
            scratch::give([d_res]);
            grads.push(gpt.wpe.as_tensor(), d_wpe)?;
            grads.push(gpt.wte.as_tensor(), d_wte)
        })
    }
}

#[cfg(test)]
impl Pass<'_> {
    /// Values the forward kept of its blocks for the backward.
    pub(super) fn kept_block_values(&self) -> usize {
        let lens = |a: &Activations| {
            [&a.input, &a.mid, &a.ln_1, &a.qkv, &a.probabilities]
                .into_iter()
                .chain([&a.attended, &a.ln_2, &a.gelu_slope, &a.activated])
                .map(Vec::len)
                .sum::<usize>()
        };
        self.blocks.iter().map(lens).sum()
    }
}

impl Activations {
    /// A checkpointed block: its input, the rest to be recomputed.
    fn input_only(input: Vec<f32>) -> Self {
        Activations {
            input,
            mid: Vec::new(),
            ln_1: Vec::new(),
            qkv: Vec::new(),
            probabilities: Vec::new(),
            attended: Vec::new(),
            ln_2: Vec::new(),
            gelu_slope: Vec::new(),
            activated: Vec::new(),
        }
    }

    fn is_input_only(&self) -> bool {
        self.mid.is_empty() && !self.input.is_empty()
    }

    fn buffers(self) -> [Vec<f32>; 9] {
        [
            self.input,
            self.mid,
            self.ln_1,
            self.qkv,
            self.probabilities,
            self.attended,
            self.ln_2,
            self.gelu_slope,
            self.activated,
        ]
    }
}

/// Whether a training forward keeps the attention probabilities for the backward: when they
/// add at most a quarter to a block's activations (`heads` · t ≤ 4·C values per position, as in
/// nanoGPT's shakespeare recipes). Longer contexts recompute them (their t² would dominate
/// memory), as flash attention does.
fn keeps_probabilities(heads: usize, t: usize, c: usize) -> bool {
    heads * t <= 4 * c
}

/// Attention values a block keeps per position for its backward: `heads` · t probabilities
/// where [`keeps_probabilities`], a log-sum-exp per head in tiles, else none.
pub(super) fn kept_probabilities(heads: usize, t: usize, c: usize) -> usize {
    if attention::tiled(t) {
        return heads; // the log-sum-exps
    }
    match keeps_probabilities(heads, t, c) {
        true => heads * t,
        false => 0,
    }
}

/// Elements handed to one rayon task by the element-wise loops.
const ELEMENTS_PER_TASK: usize = 1 << 14;

/// LayerNorm of the rows of `x` (as many as fit `gain`'s width), into a reused buffer.
fn layer_norm(x: &[f32], gain: &[f32], bias: &[f32]) -> Vec<f32> {
    let mut y = scratch::take(x.len());
    kernels::layer_norm_into(x, gain, bias, EPS, &mut y);
    y
}

/// The backward of [`layer_norm`] into `dx` (added to it when `accumulate`): the gain's and
/// the bias's gradients.
fn layer_norm_bwd(
    x: &[f32],
    gy: &[f32],
    gain: &[f32],
    dx: &mut [f32],
    accumulate: bool,
) -> (Vec<f32>, Vec<f32>) {
    kernels::layer_norm_bwd_into(x, gy, gain, EPS, dx, accumulate)
}

/// `sum` + `x`, in `sum`'s buffer.
fn add_to(mut sum: Vec<f32>, x: &[f32]) -> Vec<f32> {
    sum.iter_mut().zip(x).for_each(|(s, x)| *s += x);
    sum
}

/// `x` times the dropout mask, if there is one.
fn drop_in_place(x: &mut [f32], mask: Option<&Vec<f32>>) {
    if let Some(mask) = mask {
        x.iter_mut().zip(mask).for_each(|(v, m)| *v *= m);
    }
}

/// The gradient through a dropout mask (the mask again); borrowed as is without one.
fn masked<'g>(grad: &'g [f32], mask: Option<&Vec<f32>>) -> std::borrow::Cow<'g, [f32]> {
    match mask {
        Some(mask) => grad.iter().zip(mask).map(|(g, m)| g * m).collect(),
        None => std::borrow::Cow::Borrowed(grad),
    }
}

/// The f32 values of the model's tensors, in the order of [`weight_tensors`].
struct Weights<'w>(&'w [&'w [f32]]);

/// One block's weights, named as in [`super::Block`].
struct BlockWeights<'w> {
    ln_1: &'w [f32],
    ln_1_bias: &'w [f32],
    c_attn: &'w [f32],
    c_attn_bias: &'w [f32],
    attn_proj: &'w [f32],
    attn_proj_bias: &'w [f32],
    ln_2: &'w [f32],
    ln_2_bias: &'w [f32],
    c_fc: &'w [f32],
    c_fc_bias: &'w [f32],
    mlp_proj: &'w [f32],
    mlp_proj_bias: &'w [f32],
}

const PER_BLOCK: usize = 12;

/// The token and position embeddings, each block's twelve (LayerNorm gains, weights, and
/// their biases or the zeros standing in for them), then ln_f's two.
fn weight_tensors(gpt: &Gpt) -> Vec<&Tensor> {
    let mut tensors = vec![gpt.wte.as_tensor(), gpt.wpe.as_tensor()];
    for b in &gpt.blocks {
        tensors.extend([b.ln_1.weight.as_tensor(), b.ln_1.bias_or_zeros()]);
        tensors.extend([b.c_attn.weight.as_tensor(), b.c_attn.bias_or_zeros()]);
        tensors.extend([b.attn_proj.weight.as_tensor(), b.attn_proj.bias_or_zeros()]);
        tensors.extend([b.ln_2.weight.as_tensor(), b.ln_2.bias_or_zeros()]);
        tensors.extend([b.c_fc.weight.as_tensor(), b.c_fc.bias_or_zeros()]);
        tensors.extend([b.mlp_proj.weight.as_tensor(), b.mlp_proj.bias_or_zeros()]);
    }
    tensors.extend([gpt.ln_f.weight.as_tensor(), gpt.ln_f.bias_or_zeros()]);
    tensors
}

impl<'w> Weights<'w> {
    fn get(&self, i: usize) -> &'w [f32] {
        self.0[i]
    }

    fn block(&self, i: usize) -> BlockWeights<'w> {
        let at = |k: usize| self.get(2 + PER_BLOCK * i + k);
        BlockWeights {
            ln_1: at(0),
            ln_1_bias: at(1),
            c_attn: at(2),
            c_attn_bias: at(3),
            attn_proj: at(4),
            attn_proj_bias: at(5),
            ln_2: at(6),
            ln_2_bias: at(7),
            c_fc: at(8),
            c_fc_bias: at(9),
            mlp_proj: at(10),
            mlp_proj_bias: at(11),
        }
    }

    /// ln_f's gain and bias.
    fn ln_f(&self) -> (&'w [f32], &'w [f32]) {
        let first = self.0.len() - 2;
        (self.get(first), self.get(first + 1))
    }
}

/// Hands each gradient to the sink as it is formed, by the parameter's position; none for a
/// frozen parameter (a LayerNorm's or the position table's, cheap to form, is dropped here).
struct Handover<'s> {
    /// Position of each parameter, by tensor; `None` for a frozen one.
    positions: std::collections::HashMap<candle_core::TensorId, Option<usize>>,
    sink: &'s mut dyn GradientSink,
}

impl<'s> Handover<'s> {
    fn new(gpt: &Gpt, sink: &'s mut dyn GradientSink) -> Self {
        let positions = gpt
            .params
            .vars()
            .enumerate()
            .map(|(i, var)| {
                let wanted = !gpt.params.frozen().contains(var);
                (var.as_tensor().id(), wanted.then_some(i))
            })
            .collect();
        Handover { positions, sink }
    }

    /// Hands over `grad` of `param`; an empty one (a frozen weight's, never formed) is none.
    fn push(&mut self, param: &Tensor, grad: Vec<f32>) -> Result<()> {
        match self.positions.get(&param.id()) {
            Some(&Some(i)) if !grad.is_empty() => {
                let grad = Tensor::from_vec(grad, param.shape(), param.device())?;
                self.sink.put(i, Some(grad))
            }
            _ => Ok(()),
        }
    }

    fn push_linear(
        &mut self,
        layer: &super::Linear,
        d_weight: Vec<f32>,
        d_bias: Vec<f32>,
    ) -> Result<()> {
        self.push_pair(&layer.weight, layer.bias.as_ref(), d_weight, d_bias)
    }

    fn push_ln(
        &mut self,
        layer: &super::LayerNorm,
        d_gain: Vec<f32>,
        d_bias: Vec<f32>,
    ) -> Result<()> {
        self.push_pair(&layer.weight, layer.bias.as_ref(), d_gain, d_bias)
    }

    /// A layer's weight and, when it has one, its bias.
    fn push_pair(
        &mut self,
        weight: &candle_core::Var,
        bias: Option<&candle_core::Var>,
        d_weight: Vec<f32>,
        d_bias: Vec<f32>,
    ) -> Result<()> {
        self.push(weight.as_tensor(), d_weight)?;
        match bias {
            Some(bias) => self.push(bias.as_tensor(), d_bias),
            None => Ok(()),
        }
    }
}
