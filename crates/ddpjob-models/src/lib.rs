//! ddpjob's model families and the kit they are built from: the image models (`mlp`, `cnn`)
//! with their fused hand-written passes, and the GPT-2 and Llama families exchanged exactly
//! with `transformers` (`gpt`, `llama`: Qwen2, SmolLM2, Mistral and the rest of the Llama
//! line), each its own wiring of the [`kit`]'s layers (parameters from a `ParamBuilder`,
//! linear layers with LoRA, LayerNorm, attention, the head, packed rows, block-by-block
//! passes) over the ops of `ddpjob-kernels`. Parameters are named as a PyTorch user names them
//! (`fc1.weight`) and initialised like torch's defaults from our own seeded RNG.
//!
//! It depends on the seams (`ddpjob-seam`), the spec, the kernels and the storage (a family
//! reads its Hugging Face directory through `ddpjob-storage`): never on the registry, the data
//! sets or the trainer. A family is a module here plus a line of registration in `ddpjob`.

mod chain;
mod cnn;
pub mod gpt;
pub mod image;
pub mod kit;
mod language;
pub mod llama;
mod mlp;
#[doc(hidden)]
pub mod testing;

use candle_core::{DType, Device, Result, Tensor, Var};

use ddpjob_kernels::{self as kernels, ConvGeometry, Pooling};
use ddpjob_rng::Mt19937;
use ddpjob_spec::Precision;

pub use cnn::Cnn;
pub use ddpjob_seam::gate;
pub use ddpjob_seam::{
    CollectedGradients, FrozenSet, GradientSink, KvCache, KvDecoder, Mode, Model, ParamStore,
    Params, TrainPass, chain_train_flops, hand_over_all, parameter_values, zeroed_parameter_values,
};
#[doc(hidden)]
pub use gpt::{Activation as GptActivation, Gpt, GptConfig};
pub use kit::lora::{LoraSpec, is_adapter};
pub use kit::packed;
pub use language::{
    LanguageModelOptions, pretrained_tokenizer, pretrained_vocabulary, token_windows,
};
pub use mlp::Mlp;

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
pub fn compile_gpu_kernels_ahead() {
    let mut compiling = COMPILING.lock().unwrap_or_else(|e| e.into_inner());
    if compiling.is_some() {
        return;
    }
    // Without the thread, each kernel compiles at its first use, as before.
    *compiling = std::thread::Builder::new()
        .name("ddpjob-nvrtc".into())
        .spawn(|| {
            kernels::compile_gpu_kernels();
        })
        .ok();
}

/// Waits for `compile_gpu_kernels_ahead`'s thread, if one was started: a process that ends
/// while NVRTC compiles on another thread could fail in the library's teardown instead of
/// exiting with its own status. The command line calls it before returning.
pub fn finish_compiling_gpu_kernels() {
    #[cfg(feature = "cuda")]
    if let Some(thread) = COMPILING.lock().unwrap_or_else(|e| e.into_inner()).take() {
        // A panic there left its kernels to be compiled (or their error reported) at first use.
        let _ = thread.join();
    }
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

    /// `name.weight` `[out, in]` and `name.bias` `[out]`, as `nn.Linear`.
    pub fn linear(&mut self, name: &str, inputs: usize, outputs: usize) -> Result<Linear> {
        let weight = self.uniform(format!("{name}.weight"), &[outputs, inputs], inputs)?;
        let bias = self.uniform(format!("{name}.bias"), &[outputs], inputs)?;
        Ok(Linear { weight, bias })
    }

    /// `name.weight` `[out, in, k, k]` and `name.bias` `[out]`, as `nn.Conv2d` (stride 1, no padding).
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
/// (weights cast on the fly to the activations' dtype), logits returned as f32 so the loss, the
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

/// `model` computing in `precision` (f32: unchanged): what the built-in image models are
/// wrapped in.
pub fn with_precision(model: Box<dyn Model>, precision: Precision) -> Box<dyn Model> {
    match precision {
        Precision::F32 | Precision::Tf32 | Precision::Bf16Matmul => model,
        Precision::Bf16 => Box::new(Autocast {
            inner: model,
            dtype: DType::BF16,
        }),
    }
}

/// A model just built, made ready to train as a job's `[model]` says, whatever its family:
/// no two tensors share a name, `lora`'s adapters exist and alone train (PEFT's default:
/// every other parameter frozen), the `freeze` patterns are frozen, and a PEFT adapter the
/// LoRA starts from is loaded (unless `restoring`: a checkpoint will replace it). `arch`
/// names the model in the errors.
pub fn adapt(
    model: Box<dyn Model>,
    arch: &str,
    lora: Option<&LoraSpec>,
    quantize: Option<&ddpjob_spec::QuantizeSpec>,
    freeze: &[String],
    restoring: bool,
) -> Result<Box<dyn Model>> {
    let fail = |e: String| candle_core::Error::Msg(format!("model.arch = \"{arch}\": {e}"));
    if let Some(name) = model.params().repeated_name() {
        return Err(fail(format!(
            "two parameters or buffers are both named `{name}`; checkpoints and \
             model.safetensors hold them by name, so give each layer its own prefix \
             (VarBuilder::pp)"
        )));
    }
    if quantize.is_some() && model.params().packed().next().is_none() {
        return Err(fail(
            "model.quantize: this model keeps none of its layers in 4 bits (a 4-bit base is \
             built for `llama` and its kin); leave [model.quantize] out"
                .into(),
        ));
    }
    let lora_on = lora.is_some();
    if lora_on && !model.params().iter().any(|(n, _)| is_adapter(n)) {
        return Err(fail(
            "model.lora: this model has no linear layers that take adapters (LoRA applies to \
             gpt and llama)"
                .into(),
        ));
    }
    if lora_on || !freeze.is_empty() {
        // LoRA trains the adapters only (PEFT's default): every other parameter is frozen.
        model
            .params()
            .freeze_also(freeze, |name| lora_on && !is_adapter(name))
            .map_err(candle_core::Error::Msg)?;
    }
    if let Some(dir) = lora.and_then(|l| l.adapter.as_ref())
        && !restoring
    {
        ddpjob_storage::hf::peft::load_adapter(dir, model.params())
            .map_err(|e| fail(format!("model.lora.adapter: {e}")))?;
    }
    Ok(model)
}

/// Refuses the first of a model's `[model]` sizes (key, value) that is 0.
pub fn no_zero_size(sizes: &[(&str, Option<usize>)]) -> std::result::Result<(), String> {
    match sizes.iter().find(|(_, v)| *v == Some(0)) {
        Some((key, _)) => Err(format!("model.{key} = 0: it must be at least 1")),
        None => Ok(()),
    }
}
