//! The networks, with parameters named as a PyTorch user names them (`fc1.weight`) and
//! initialised like torch's defaults from our own seeded RNG.

pub(crate) mod builtin;
mod chain;
mod cnn;
mod freeze;
pub mod gate;
mod gpt;
mod layered;
mod llama;
mod lora;
mod mlp;
pub(crate) mod packed;
mod store;

use candle_core::{DType, Device, Result, Tensor, Var};

use crate::config::{ModelSpec, Precision};
use crate::registry::{ModelContext, Registry};
use crate::task::ModelInput;
use ddpjob_kernels::{self as kernels, ConvGeometry, Pooling};
use ddpjob_rng::Mt19937;

pub(crate) use builtin::register_builtin;

pub use cnn::Cnn;
pub(crate) use freeze::FrozenSet;
pub use gpt::KvCache;
#[cfg(test)]
pub use gpt::{Activation as GptActivation, Gpt, GptConfig};
pub use lora::{LoraSpec, TargetModules, is_adapter};
pub use mlp::Mlp;
pub use store::ParamStore;

/// The thread `compile_gpu_kernels_ahead` started, until `finish_compiling_gpu_kernels`.
#[cfg(feature = "cuda")]
static COMPILING: std::sync::Mutex<Option<std::thread::JoinHandle<()>>> =
    std::sync::Mutex::new(None);

/// Compiles (NVRTC) every GPU kernel of ddpjob's models and layers on a thread of its own (0.37
/// s for all of them on a 2-core CPU), so that a GPU worker's first step finds them compiled
/// instead of compiling each as it first runs: the compiling overlaps the worker's loading of
/// its data and model. A kernel asked for before it is ready waits for it; an error is
/// reported by its first use. Called when a GPU device is opened.
#[cfg(feature = "cuda")]
pub(crate) fn compile_gpu_kernels_ahead() {
    let mut compiling = COMPILING.lock().unwrap_or_else(|e| e.into_inner());
    if compiling.is_some() {
        return;
    }
    // Without the thread, each kernel compiles at its first use, as before.
    *compiling = std::thread::Builder::new()
        .name("ddpjob-nvrtc".into())
        .spawn(|| {
            kernels::compile_gpu_kernels();
            gpt::compile_gpu_kernels();
            llama::compile_gpu_kernels();
        })
        .ok();
}

/// Waits for `compile_gpu_kernels_ahead`'s thread, if one was started: a process that ends
/// while NVRTC compiles on another thread could fail in the library's teardown instead of
/// exiting with its own status. The command line calls it before returning.
pub(crate) fn finish_compiling_gpu_kernels() {
    #[cfg(feature = "cuda")]
    if let Some(thread) = COMPILING.lock().unwrap_or_else(|e| e.into_inner()).take() {
        // A panic there left its kernels to be compiled (or their error reported) at first use.
        let _ = thread.join();
    }
}

/// A network mapping a batch of inputs to logits whose last dimension is the classes (or the
/// vocabulary): images [n, c, h, w] → [n, classes], token windows [n, t] → [n, t, vocab].
pub trait Model: Send + Sync {
    /// The logits for the batch `xs`; `mode` says whether this is training (and with which
    /// seeds for dropout) or evaluation (BatchNorm then uses its running statistics).
    fn forward(&self, xs: &Tensor, mode: &Mode) -> Result<Tensor>;
    /// The trainable parameters (and buffers), in a fixed order.
    fn params(&self) -> &Params;

    /// Mean cross-entropy of the logits for `xs` against integer `targets`, differentiable.
    /// A model may override it to compute the loss without holding all the logits at once.
    fn loss(&self, xs: &Tensor, targets: &Tensor, mode: &Mode) -> Result<Tensor> {
        crate::task::cross_entropy(&self.forward(xs, mode)?, targets)
    }

    /// Σ cross-entropy and the number of targets predicted exactly, for evaluation.
    fn score(&self, xs: &Tensor, targets: &Tensor) -> Result<(f64, usize)> {
        crate::task::loss_sum_and_correct(&self.forward(xs, &Mode::Eval)?, targets)
    }

    /// Floating-point operations of one sample's training forward and backward passes, by
    /// the usual convention: 2 per multiply-add of the matrix products and convolutions
    /// (forward, weight gradient, input gradient where one is needed), element-wise work
    /// not counted. `bench step` divides the rate it reaches by the machine's measured GEMM
    /// peak. `None`: not known for this model.
    fn train_flops_per_sample(&self) -> Option<f64> {
        None
    }

    /// A training forward pass that computes its own gradients: for a model with a
    /// hand-written backward where that beats autograd (the `gpt` on the CPU in f32).
    /// `None` (the default): the trainer differentiates [`Model::loss`] with autograd.
    /// The pass's gradients must be those autograd would give for the same loss.
    fn train_pass(
        &self,
        _xs: &Tensor,
        _targets: &Tensor,
        _mode: &Mode,
    ) -> Result<Option<Box<dyn TrainPass + '_>>> {
        Ok(None)
    }

    /// Bytes a training pass keeps per sample for its backward (activations, and the
    /// backward's own buffers), with or without activation checkpointing: the memory
    /// estimate's share of the batch. `None` (the default): not known for this model.
    fn activation_bytes_per_sample(&self, _checkpointing: bool) -> Option<f64> {
        None
    }

    /// `train.activation_checkpointing`: from now on a training pass keeps only each block's
    /// input and recomputes the rest of the block in its backward, with the same results bit
    /// for bit (memory for time). `Err`: why this model cannot (the default: it has no
    /// blocks to recompute).
    fn checkpoint_activations(&self) -> std::result::Result<(), String> {
        Err("this model does not recompute its activations".into())
    }

    /// `distributed.sharding = "gradients"`: from now on a training pass hands each block's
    /// gradients to [`TrainPass::backward_to`]'s sink as soon as its backward has formed them,
    /// so the trainer can reduce-scatter them while the blocks below are differentiated and
    /// the whole gradient never exists at once. Returns the most gradient values such a pass
    /// holds at a time (the memory estimate's), or `None` (the default) when the model's
    /// gradients all come together at the end of its backward.
    fn stream_gradients(&self) -> Option<usize> {
        None
    }

    /// `distributed.sharding = "full"`: from now on a training pass goes block by block,
    /// calls [`gate::gather`] before each block's forward and again before its backward and
    /// [`gate::release`] after each (for [`gate::Unit::Rest`], around the whole pass), and
    /// hands its gradients over as [`Model::stream_gradients`] says; [`Model::score`] asks
    /// the same way (evaluation runs with the parameters sharded). Returns each block's
    /// parameters, as positions in [`Model::params`]; any other is the rest's. `Err`: why this
    /// model cannot (the default: it has no blocks to gather one at a time).
    fn shard_parameters(&self) -> std::result::Result<Vec<Vec<usize>>, String> {
        Err("it names no blocks (Model::shard_parameters)".into())
    }

    /// Whether each row of a batch is computed independently of the others, so a CPU worker
    /// may cut a micro-batch into row shards that run side by side. Not so for BatchNorm
    /// (batch statistics); the default says no for any model with buffers.
    fn rows_independent(&self) -> bool {
        self.params().buffers().next().is_none()
    }

    /// Next-token logits that reuse the keys and values of the positions fed before, for
    /// `sample`. `None` (the default): `sample` runs [`Model::forward`] over the window for
    /// each new token.
    #[doc(hidden)]
    fn kv_decoder(&self) -> Option<&dyn KvDecoder> {
        None
    }
}

/// A language model that generates with a KV cache (see [`Model::kv_decoder`]).
#[doc(hidden)]
pub trait KvDecoder {
    /// Feeds `tokens` after the positions in `cache` and returns the f32 logits [vocab] of the
    /// last one, without dropout; an error past the window (the caller starts a new cache).
    fn forward_cached(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor>;
}

/// The forward half of a training step whose backward the model computes itself (see
/// [`Model::train_pass`]).
pub trait TrainPass {
    /// The mean loss of the pass (a scalar, as [`Model::loss`] returns it).
    fn loss(&self) -> &Tensor;
    /// The gradient of `scale` · loss for each parameter, in [`Model::params`] order (`None`
    /// for one the loss does not depend on).
    fn backward(self: Box<Self>, scale: f64) -> Result<Vec<Option<Tensor>>>;

    /// [`TrainPass::backward`], each gradient handed to `sink` as soon as it is final (see
    /// [`Model::stream_gradients`]). The default hands them all over at the end, in order.
    fn backward_to(self: Box<Self>, scale: f64, sink: &mut dyn GradientSink) -> Result<()> {
        hand_over_all(self.backward(scale)?, sink)
    }
}

/// Hands every gradient of `grads` (one per parameter, in order) to `sink`.
pub(crate) fn hand_over_all(
    grads: impl IntoIterator<Item = Option<Tensor>>,
    sink: &mut dyn GradientSink,
) -> Result<()> {
    for (index, grad) in grads.into_iter().enumerate() {
        sink.put(index, grad)?;
    }
    Ok(())
}

/// Where [`TrainPass::backward_to`] hands each parameter's gradient once nothing more will be
/// added to it.
pub trait GradientSink {
    /// The gradient of `scale` · loss for the parameter at `index` ([`Model::params`] order),
    /// `None` when the loss does not depend on it. Each index at most once; one never handed
    /// over has none.
    fn put(&mut self, index: usize, grad: Option<Tensor>) -> Result<()>;
}

/// The gradients a pass hands over, by parameter: how a streaming pass's
/// [`TrainPass::backward`] is its [`TrainPass::backward_to`] collected.
pub(crate) struct CollectedGradients(Vec<Option<Tensor>>);

impl CollectedGradients {
    /// The gradients of `params` parameters that `backward_to` hands to its sink.
    pub(crate) fn of(
        params: usize,
        backward_to: impl FnOnce(&mut dyn GradientSink) -> Result<()>,
    ) -> Result<Vec<Option<Tensor>>> {
        let mut all = CollectedGradients(vec![None; params]);
        backward_to(&mut all)?;
        Ok(all.0)
    }
}

impl GradientSink for CollectedGradients {
    fn put(&mut self, index: usize, grad: Option<Tensor>) -> Result<()> {
        let slot = self.0.get_mut(index).ok_or_else(|| {
            candle_core::Error::Msg(format!("a gradient for parameter {index} of fewer"))
        })?;
        *slot = grad;
        Ok(())
    }
}

/// [`Model::train_flops_per_sample`] of a chain of products whose forward passes cost
/// `forward[i]` operations per sample: each costs as much again for its weight gradient and
/// for its input gradient, except the first, whose input is data.
pub fn chain_train_flops(forward: &[f64]) -> f64 {
    3.0 * forward.iter().sum::<f64>() - forward.first().copied().unwrap_or(0.0)
}

/// How a forward pass runs: evaluation, or training with the seeds of its random choices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Evaluation: no dropout, running statistics.
    Eval,
    /// One seed per batch row, derived from (job seed, epoch, sample index): a row's dropout
    /// masks depend on which sample it is, never on the rank or the batch it landed in, so
    /// 2 workers × B/2 draw exactly the masks 1 worker × B draws, and a resumed run redraws
    /// them bit for bit.
    Train {
        /// The seed of each row of the batch, in order.
        row_seeds: Vec<u64>,
    },
}

impl Mode {
    /// Whether this is a training pass.
    pub fn is_train(&self) -> bool {
        matches!(self, Mode::Train { .. })
    }
}

/// Named trainable parameters in a fixed order (the order gradients are bucketed in).
#[derive(Debug, Clone, Default)]
pub struct Params {
    entries: Vec<(String, Var)>,
    /// Parameters exempt from weight decay, by position (biases and LayerNorm gains of a GPT).
    no_decay: Vec<bool>,
    /// Extra names of a tied parameter (e.g. `lm_head.weight` for `transformer.wte.weight`):
    /// written into `model.safetensors` as a PyTorch `state_dict()` holds them, never trained
    /// twice.
    aliases: Vec<(String, usize)>,
    /// State that is not trained but checkpointed, restored and broadcast from rank 0 with the
    /// parameters (BatchNorm's running statistics), as a PyTorch module's buffers.
    buffers: Vec<(String, Var)>,
    /// Parameters that do not train (`model.freeze`; see `freeze.rs`), shared with the
    /// layers that hold them.
    frozen: FrozenSet,
}

impl Params {
    /// The trainable parameters by name, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.entries.iter().map(|(n, v)| (n.as_str(), v))
    }

    /// The buffers (non-trained state) by name.
    pub fn buffers(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.buffers.iter().map(|(n, v)| (n.as_str(), v))
    }

    /// The trainable parameters, in order.
    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.entries.iter().map(|(_, v)| v)
    }

    /// The position of `var` among the trainable parameters, if it is one of them.
    pub(crate) fn position(&self, var: &Var) -> Option<usize> {
        let id = var.as_tensor().id();
        self.vars().position(|v| v.as_tensor().id() == id)
    }

    /// Whether weight decay applies to the parameter at `index`.
    pub fn decays(&self, index: usize) -> bool {
        !self.no_decay.get(index).copied().unwrap_or(false)
    }

    /// Marks the parameter at `index` as exempt from weight decay.
    pub fn exempt_from_decay(&mut self, index: usize) {
        if self.no_decay.len() < self.entries.len() {
            self.no_decay.resize(self.entries.len(), false);
        }
        self.no_decay[index] = true;
    }

    /// Records `alias` as a second name of the parameter called `name`.
    pub fn tie(&mut self, alias: &str, name: &str) {
        if let Some(i) = self.entries.iter().position(|(n, _)| n == name) {
            self.aliases.push((alias.to_string(), i));
        }
    }

    /// Names that are aliases of a trained parameter, with that parameter's name.
    pub fn aliases(&self) -> impl Iterator<Item = (&str, &str)> {
        self.aliases
            .iter()
            .map(|(a, i)| (a.as_str(), self.entries[*i].0.as_str()))
    }

    /// The number of trainable parameters (tensors).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no trainable parameters.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The current values by name, aliases of tied parameters and buffers included: what
    /// `model.safetensors` and checkpoints hold.
    pub fn named_tensors(&self) -> std::collections::HashMap<String, Tensor> {
        let aliased = self
            .aliases
            .iter()
            .map(|(a, i)| (a.clone(), self.entries[*i].1.as_tensor().clone()));
        self.iter()
            .chain(self.buffers())
            .map(|(n, v)| (n.to_string(), v.as_tensor().clone()))
            .chain(aliased)
            .collect()
    }

    /// A name given to more than one parameter, buffer or alias, if any.
    pub fn repeated_name(&self) -> Option<&str> {
        let mut seen = std::collections::HashSet::new();
        let aliases = self.aliases.iter().map(|(a, _)| a.as_str());
        let mut names = self
            .iter()
            .chain(self.buffers())
            .map(|(n, _)| n)
            .chain(aliases);
        names.find(|n| !seen.insert(*n))
    }

    /// Entries of `named_tensors`: parameters, buffers and aliases.
    pub fn named_len(&self) -> usize {
        self.entries.len() + self.buffers.len() + self.aliases.len()
    }

    /// The number of trainable values (elements of every parameter).
    pub fn element_count(&self) -> usize {
        self.entries.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// Parameters from explicit (name, var) pairs, in that order.
    pub fn from_vars(entries: Vec<(String, Var)>) -> Self {
        Params {
            entries,
            ..Params::default()
        }
    }

    fn push(&mut self, name: String, var: Var) -> Var {
        self.entries.push((name, var.clone()));
        var
    }

    fn push_buffer(&mut self, name: String, var: Var) {
        self.buffers.push((name, var));
    }
}

/// A new parameter's values, `shape`'s count of them drawn by `draw`; where this machine
/// cannot give them memory (a mistyped width, say) an error naming the parameter and its size,
/// so that the model is refused instead of the process aborted.
pub(crate) fn parameter_values(
    name: &str,
    shape: &[usize],
    mut draw: impl FnMut() -> f32,
) -> Result<Vec<f32>> {
    let mut values = Vec::new();
    match shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) {
        Some(n) if values.try_reserve_exact(n).is_ok() => {
            values.extend((0..n).map(|_| draw()));
            Ok(values)
        }
        _ => Err(too_large(name, shape)),
    }
}

/// [`parameter_values`] all zero, from zeroed pages (as `vec![0.0; n]`, which the kernel
/// maps on first touch: a blank model's weights are replaced by loaded ones).
pub(crate) fn zeroed_parameter_values(name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let count = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    let Some((n, layout)) =
        count.and_then(|n| Some((n, std::alloc::Layout::array::<f32>(n).ok()?)))
    else {
        return Err(too_large(name, shape));
    };
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: a non-zero-sized layout; a non-null result is `n` zeroed f32s from the global
    // allocator with the layout a `Vec<f32>` of capacity `n` frees with.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<f32>();
    if ptr.is_null() {
        return Err(too_large(name, shape));
    }
    // SAFETY: as above; all `n` values are initialised (zero).
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

fn too_large(name: &str, shape: &[usize]) -> candle_core::Error {
    let bytes = shape.iter().fold(4.0, |b, &d| b * d as f64);
    candle_core::Error::Msg(format!(
        "parameter `{name}` of shape {shape:?} needs {:.1} GB, more memory than this machine \
         can give; check the model's sizes",
        bytes / 1e9
    ))
}

/// Creates parameters in order, each drawn from `U(-1/sqrt(fan_in), 1/sqrt(fan_in))`: what
/// torch's `kaiming_uniform_(a=sqrt(5))` gives for weights and its default bias init.
pub struct Init<'a> {
    rng: Mt19937,
    device: &'a Device,
    params: Params,
}

impl<'a> Init<'a> {
    pub fn new(seed: u64, device: &'a Device) -> Self {
        Init {
            rng: Mt19937::new(seed),
            device,
            params: Params::default(),
        }
    }

    fn uniform(&mut self, name: String, shape: &[usize], fan_in: usize) -> Result<Var> {
        let bound = 1.0 / (fan_in as f32).sqrt();
        let rng = &mut self.rng;
        let values = parameter_values(&name, shape, || rng.uniform(-bound, bound))?;
        let var = Var::from_vec(values, shape, self.device)?;
        Ok(self.params.push(name, var))
    }

    /// `name.weight` [out, in] and `name.bias` [out], as `nn.Linear`.
    pub fn linear(&mut self, name: &str, inputs: usize, outputs: usize) -> Result<Linear> {
        let weight = self.uniform(format!("{name}.weight"), &[outputs, inputs], inputs)?;
        let bias = self.uniform(format!("{name}.bias"), &[outputs], inputs)?;
        Ok(Linear { weight, bias })
    }

    /// `name.weight` [out, in, k, k] and `name.bias` [out], as `nn.Conv2d` (stride 1, no padding).
    pub fn conv2d(
        &mut self,
        name: &str,
        inputs: usize,
        outputs: usize,
        kernel: usize,
    ) -> Result<Conv2d> {
        let fan_in = inputs * kernel * kernel;
        let weight = self.uniform(
            format!("{name}.weight"),
            &[outputs, inputs, kernel, kernel],
            fan_in,
        )?;
        let bias = self.uniform(format!("{name}.bias"), &[outputs], fan_in)?;
        Ok(Conv2d { weight, bias })
    }

    pub fn finish(self) -> Params {
        self.params
    }
}

pub struct Linear {
    weight: Var,
    bias: Var,
}

impl Linear {
    /// `x·Wᵀ + b`, then ReLU when `relu`.
    pub fn forward(&self, xs: &Tensor, relu: bool) -> Result<Tensor> {
        if kernels::applies(xs) {
            return kernels::linear(xs, &self.weight, &self.bias, relu);
        }
        let (weight, bias) = (in_dtype(&self.weight, xs)?, in_dtype(&self.bias, xs)?);
        let z = xs.matmul(&weight.t()?)?;
        if kernels::conv2d_unfolded_applies(xs) && xs.rank() == 2 {
            return kernels::bias_relu(&z, &bias, relu);
        }
        let y = z.broadcast_add(&bias)?;
        if relu { y.relu() } else { Ok(y) }
    }
}

pub struct Conv2d {
    weight: Var,
    bias: Var,
}

impl Conv2d {
    /// `pooling(relu(conv2d(x) + b))`, stride 1, no padding.
    pub fn forward_relu(&self, xs: &Tensor, pooling: Pooling) -> Result<Tensor> {
        let geometry = ConvGeometry {
            stride: 1,
            padding: 0,
        };
        if kernels::applies(xs) {
            return kernels::conv2d(xs, &self.weight, &self.bias, geometry, true, pooling);
        }
        let (weight, bias) = (in_dtype(&self.weight, xs)?, in_dtype(&self.bias, xs)?);
        if kernels::conv2d_unfolded_applies(xs) {
            return kernels::conv2d_unfolded(xs, &weight, &bias, geometry, true, pooling);
        }
        if xs.dtype() == DType::BF16 && xs.device().is_cpu() {
            // candle's CPU convolution has no bf16 kernel. As its bf16 matmul does, widen the
            // bf16 operands to f32 (exactly), compute, and round the result back to bf16.
            let wide = |t: &Tensor| t.to_dtype(DType::F32);
            let y = conv_relu(&wide(xs)?, &wide(&weight)?, &wide(&bias)?)?;
            return pool(&y.to_dtype(DType::BF16)?, pooling);
        }
        pool(&conv_relu(xs, &weight, &bias)?, pooling)
    }
}

/// `relu(conv2d(x, w) + b)` with candle's ops, stride 1, no padding.
fn conv_relu(xs: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let out_channels = bias.dim(0)?;
    xs.conv2d(weight, 0, 1, 1, 1)?
        .broadcast_add(&bias.reshape((1, out_channels, 1, 1))?)?
        .relu()
}

fn pool(y: &Tensor, pooling: Pooling) -> Result<Tensor> {
    match pooling {
        Pooling::None => Ok(y.clone()),
        Pooling::Max2 => kernels::max_pool2_with_ops(y),
    }
}

/// A parameter in the dtype of the activations `xs`: under bf16 autocast the f32 master
/// weight is cast for the computation, and its gradient flows back to it as f32.
fn in_dtype(param: &Var, xs: &Tensor) -> Result<Tensor> {
    param.as_tensor().to_dtype(xs.dtype())
}

/// Mixed precision, as torch's autocast: inputs cast to `dtype`, every layer computes in it
/// (weights cast on the fly, see [`in_dtype`]), logits returned as f32 so the loss, the
/// gradients reaching the f32 weights, the optimizer and the all-reduce stay f32.
pub struct Autocast {
    inner: Box<dyn Model>,
    dtype: DType,
}

impl Model for Autocast {
    fn forward(&self, xs: &Tensor, mode: &Mode) -> Result<Tensor> {
        self.inner
            .forward(&xs.to_dtype(self.dtype)?, mode)?
            .to_dtype(DType::F32)
    }

    fn params(&self) -> &Params {
        self.inner.params()
    }

    fn train_flops_per_sample(&self) -> Option<f64> {
        self.inner.train_flops_per_sample()
    }

    fn rows_independent(&self) -> bool {
        self.inner.rows_independent()
    }
}

/// `model` computing in `precision` (f32: unchanged).
fn with_precision(model: Box<dyn Model>, precision: Precision) -> Box<dyn Model> {
    match precision {
        Precision::F32 | Precision::Tf32 | Precision::Bf16Matmul => model,
        Precision::Bf16 => Box::new(Autocast {
            inner: model,
            dtype: DType::BF16,
        }),
    }
}

/// The model blank (nothing drawn; zero pages never touched), its `init_from` weights checked
/// against it from their files' headers (names, shapes, types), not loaded: what the launcher
/// and `validate` build to refuse weights that do not fit, and to estimate memory, before
/// anything exists.
pub(crate) fn checked_blank(
    spec: &ModelSpec,
    input: ModelInput,
    seed: u64,
    device: &Device,
    precision: Precision,
) -> Result<Box<dyn Model>> {
    // A model with a Hugging Face family reads its weights through `hf`, which honours
    // `checking`; a registered model's own loading would read them all: left blank.
    let through_hf = Registry::current().reads_hf_weights(spec.arch());
    match spec.init_from() {
        Some(_) if through_hf => {
            crate::hf::checking(|| build(spec, input, seed, device, precision, false))
        }
        _ => build(spec, input, seed, device, precision, true),
    }
}

/// Builds the model of `spec` for `input` through the installed [`Registry`], computing in
/// `precision` (f32 master weights either way). `restoring`: a checkpoint will replace the
/// weights, so pretrained ones need not be loaded. A mismatch of model and data (a gpt on
/// images) is an error; validation refuses such configs first.
pub fn build(
    spec: &ModelSpec,
    input: ModelInput,
    seed: u64,
    device: &Device,
    precision: Precision,
    restoring: bool,
) -> Result<Box<dyn Model>> {
    let mut cx = ModelContext::new(input, seed, device, precision, restoring);
    cx.lora = spec.lora().cloned();
    let fail =
        |e: String| candle_core::Error::Msg(format!("model.arch = \"{}\": {e}", spec.arch()));
    let model = Registry::current()
        .build_model(spec.arch(), spec.options(), &cx)
        .map_err(|e| fail(e.to_string()))?;
    if let Some(name) = model.params().repeated_name() {
        return Err(fail(format!(
            "two parameters or buffers are both named `{name}`; checkpoints and \
             model.safetensors hold them by name, so give each layer its own prefix \
             (VarBuilder::pp)"
        )));
    }
    let lora = spec.lora().is_some();
    if lora && !model.params().iter().any(|(n, _)| is_adapter(n)) {
        return Err(fail(
            "model.lora: this model has no linear layers that take adapters (LoRA applies to \
             gpt and llama)"
                .into(),
        ));
    }
    if lora || !spec.freeze().is_empty() {
        // LoRA trains the adapters only (PEFT's default): every other parameter is frozen.
        model
            .params()
            .freeze_also(spec.freeze(), |name| lora && !is_adapter(name))
            .map_err(candle_core::Error::Msg)?;
    }
    if let Some(dir) = spec.lora().and_then(|l| l.adapter.as_ref())
        && !restoring
    {
        crate::hf::peft::load_adapter(dir, model.params())
            .map_err(|e| fail(format!("model.lora.adapter: {e}")))?;
    }
    Ok(model)
}

/// Refuses the first of a model's `[model]` sizes (key, value) that is 0.
pub(crate) fn no_zero_size(sizes: &[(&str, Option<usize>)]) -> std::result::Result<(), String> {
    match sizes.iter().find(|(_, v)| *v == Some(0)) {
        Some((key, _)) => Err(format!("model.{key} = 0: it must be at least 1")),
        None => Ok(()),
    }
}

/// The tokenizer that comes with the weights `init_from` names: another job's (the one it
/// trained with), or a Hugging Face directory's `tokenizer.json`, named even when the
/// directory lacks one (its token ids are that tokenizer's all the same; the data says so).
pub(crate) fn pretrained_tokenizer(init_from: &str) -> Option<std::path::PathBuf> {
    let dir = std::path::Path::new(init_from);
    match crate::checkpoint::Trained::find(dir) {
        Some(trained) => trained.ok()?.tokenizer(),
        None => Some(dir.join("tokenizer.json")).filter(|_| dir.join("config.json").is_file()),
    }
}

/// The ddpjob `vocab.json` of the job whose weights `init_from` names, if it has one.
pub(crate) fn pretrained_vocabulary(init_from: &str) -> Option<std::path::PathBuf> {
    crate::checkpoint::Trained::find(std::path::Path::new(init_from))?
        .ok()?
        .vocabulary()
}

/// `config.json` and tensors of a Hugging Face export of a job's model: `spec`'s options and
/// its trained `tensors` (as `model.safetensors` holds them), as the model's family writes
/// them; a model without a Hugging Face format is refused with the reason.
pub(crate) fn hf_export_parts(
    spec: &ModelSpec,
    tensors: std::collections::HashMap<String, Tensor>,
) -> std::result::Result<crate::hf::HfParts, String> {
    Registry::current().export_hf(spec.arch(), spec.options(), tensors)
}

/// A boxed model is a model (what a builder returns when it picks among several).
impl Model for Box<dyn Model> {
    fn forward(&self, xs: &Tensor, mode: &Mode) -> Result<Tensor> {
        self.as_ref().forward(xs, mode)
    }

    fn params(&self) -> &Params {
        self.as_ref().params()
    }

    fn loss(&self, xs: &Tensor, targets: &Tensor, mode: &Mode) -> Result<Tensor> {
        self.as_ref().loss(xs, targets, mode)
    }

    fn score(&self, xs: &Tensor, targets: &Tensor) -> Result<(f64, usize)> {
        self.as_ref().score(xs, targets)
    }

    fn train_flops_per_sample(&self) -> Option<f64> {
        self.as_ref().train_flops_per_sample()
    }

    fn rows_independent(&self) -> bool {
        self.as_ref().rows_independent()
    }

    fn checkpoint_activations(&self) -> std::result::Result<(), String> {
        self.as_ref().checkpoint_activations()
    }

    fn activation_bytes_per_sample(&self, checkpointing: bool) -> Option<f64> {
        self.as_ref().activation_bytes_per_sample(checkpointing)
    }

    fn stream_gradients(&self) -> Option<usize> {
        self.as_ref().stream_gradients()
    }

    fn shard_parameters(&self) -> std::result::Result<Vec<Vec<usize>>, String> {
        self.as_ref().shard_parameters()
    }

    fn train_pass(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        mode: &Mode,
    ) -> Result<Option<Box<dyn TrainPass + '_>>> {
        self.as_ref().train_pass(xs, targets, mode)
    }

    fn kv_decoder(&self) -> Option<&dyn KvDecoder> {
        self.as_ref().kv_decoder()
    }
}
