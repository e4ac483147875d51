//! The networks, with parameters named as a PyTorch user names them (`fc1.weight`) and
//! initialised like torch's defaults from our own seeded RNG.

mod cnn;
mod mlp;

use candle_core::{DType, Device, Result, Tensor, Var};

use crate::config::{ModelSpec, Precision};
use crate::kernels::{self, ConvGeometry, Pooling};
use crate::rng::Mt19937;

pub use cnn::Cnn;
pub use mlp::Mlp;

/// A classifier over images [n, c, h, w] producing logits [n, classes].
pub trait Model: Send {
    fn forward(&self, xs: &Tensor) -> Result<Tensor>;
    fn params(&self) -> &Params;
}

/// Named trainable parameters in a fixed order (the order gradients are bucketed in).
#[derive(Debug, Clone, Default)]
pub struct Params {
    entries: Vec<(String, Var)>,
}

impl Params {
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.entries.iter().map(|(n, v)| (n.as_str(), v))
    }

    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.entries.iter().map(|(_, v)| v)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The current values by name: what `model.safetensors` and checkpoints hold.
    pub fn named_tensors(&self) -> std::collections::HashMap<String, Tensor> {
        self.iter()
            .map(|(n, v)| (n.to_string(), v.as_tensor().clone()))
            .collect()
    }

    pub fn element_count(&self) -> usize {
        self.entries.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// Parameters from explicit (name, var) pairs, in that order.
    pub fn from_vars(entries: Vec<(String, Var)>) -> Self {
        Params { entries }
    }

    fn push(&mut self, name: String, var: Var) -> Var {
        self.entries.push((name, var.clone()));
        var
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
        let n = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| self.rng.uniform(-bound, bound)).collect();
        let var = Var::from_tensor(&Tensor::from_vec(values, shape, self.device)?)?;
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
        let y = xs.matmul(&weight.t()?)?.broadcast_add(&bias)?;
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
        if kernels::applies(xs) {
            let geometry = ConvGeometry {
                stride: 1,
                padding: 0,
            };
            return kernels::conv2d(xs, &self.weight, &self.bias, geometry, true, pooling);
        }
        let (weight, bias) = (in_dtype(&self.weight, xs)?, in_dtype(&self.bias, xs)?);
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
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.inner
            .forward(&xs.to_dtype(self.dtype)?)?
            .to_dtype(DType::F32)
    }

    fn params(&self) -> &Params {
        self.inner.params()
    }
}

/// `model` computing in `precision` (f32: unchanged).
pub fn with_precision(model: Box<dyn Model>, precision: Precision) -> Box<dyn Model> {
    match precision {
        Precision::F32 => model,
        Precision::Bf16 => Box::new(Autocast {
            inner: model,
            dtype: DType::BF16,
        }),
    }
}

/// Builds the model of `spec` for inputs of `shape` = [c, h, w] and `classes` outputs.
pub fn build(
    spec: &ModelSpec,
    shape: [usize; 3],
    classes: usize,
    seed: u64,
    device: &Device,
) -> Result<Box<dyn Model>> {
    Ok(match spec {
        ModelSpec::Mlp { hidden } => Box::new(Mlp::new(shape, hidden, classes, seed, device)?),
        ModelSpec::Cnn => Box::new(Cnn::new(shape, classes, seed, device)?),
    })
}

/// Mean cross-entropy of `logits` [n, classes] against `labels` [n] (u32).
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    candle_nn::loss::cross_entropy(logits, labels)
}

/// Sum of cross-entropy over the batch and the number of correct predictions (for evaluation).
pub fn loss_sum_and_correct(logits: &Tensor, labels: &Tensor) -> Result<(f64, usize)> {
    let n = labels.dim(0)? as f64;
    let loss = cross_entropy(logits, labels)?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?
        * n;
    let correct = logits
        .argmax(1)?
        .eq(labels)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok((loss, correct as usize))
}
