//! The hand-written training pass of the built-in image models (`mlp`, `cnn`) for f32 on the
//! CPU: a chain of the fused convolution and linear layers, then cross-entropy, differentiated
//! layer by layer. Candle's autograd, which this replaces there, allocates a zeroed gradient
//! for every layer's output and adds each contribution into a new tensor (measured: 5% of a
//! cnn step). The layers are the kernels the autograd path runs, so both paths compute the
//! same values up to the order of a few sums (tests compare them).

use candle_core::{DType, Result, Tensor, bail};

use super::{Conv2d, Linear, Params, TrainPass};
use ddpjob_kernels::{
    self as kernels, ConvGeometry, ConvLayer, ConvOutput, Pooling, Wanted, linear_backward,
    linear_forward, relu_grad, relu_in_place, scratch, with_all_values, with_values,
};

/// One layer of a chain.
pub(super) enum Layer<'a> {
    /// `pooling(relu(conv2d(x)))`, stride 1, no padding, on [n, c, h, w].
    Conv(&'a Conv2d, Pooling),
    /// `x·Wᵀ + b` on the input flattened to [n, features], then ReLU when `true`.
    Linear(&'a Linear, bool),
}

/// The forward of a chain and what its backward needs.
pub(super) struct ChainPass<'a> {
    layers: Vec<Layer<'a>>,
    params: &'a Params,
    /// The input images and, per layer, its output.
    xs: Tensor,
    outputs: Vec<Output>,
    targets: Vec<usize>,
    /// softmax(logits) per row, for the cross-entropy's gradient.
    probabilities: Vec<f32>,
    loss: Tensor,
}

enum Output {
    Conv(ConvOutput),
    Linear(Vec<f32>),
}

impl Output {
    fn values(&self) -> &[f32] {
        match self {
            Output::Conv(out) => &out.values,
            Output::Linear(values) => values,
        }
    }
}

const STRIDE_1: ConvGeometry = ConvGeometry {
    stride: 1,
    padding: 0,
};

/// The forward pass of `layers` on images `xs` [n, c, h, w] against class `targets`; `None`
/// off the CPU, in another dtype than f32, or for targets other than u32 or i64 (autograd runs
/// there).
pub(super) fn forward<'a>(
    layers: Vec<Layer<'a>>,
    params: &'a Params,
    xs: &Tensor,
    targets: &Tensor,
) -> Result<Option<Box<dyn TrainPass + 'a>>> {
    let f32_cpu = |t: &Tensor| kernels::applies(t);
    let integer_targets = matches!(targets.dtype(), DType::U32 | DType::I64);
    if !f32_cpu(xs) || !integer_targets || !params.vars().all(|v| f32_cpu(v.as_tensor())) {
        return Ok(None);
    }
    let n = xs.dim(0)?;
    let targets = class_ids(targets, n)?;
    let mut outputs: Vec<Output> = Vec::with_capacity(layers.len());
    with_values(xs, |images| {
        let mut dims = image_dims(xs);
        for layer in &layers {
            let input = outputs.last().map_or(images, Output::values);
            let output = match layer {
                Layer::Conv(conv, pooling) => {
                    let out =
                        with_all_values(&[conv.weight.as_tensor(), conv.bias.as_tensor()], |wb| {
                            let weight = (wb[0], conv.weight.dims4().map(into_array)?);
                            conv_layer(*pooling).forward(input, dims, weight, wb[1])
                        })?;
                    dims = out.dims;
                    Output::Conv(out)
                }
                Layer::Linear(linear, relu) => {
                    let mut y = with_all_values(
                        &[linear.weight.as_tensor(), linear.bias.as_tensor()],
                        |wb| Ok(linear_forward(input, wb[0], wb[1], n)),
                    )?;
                    if *relu {
                        relu_in_place(&mut y);
                    }
                    dims = [n, 1, 1, linear.bias.dim(0)?];
                    Output::Linear(y)
                }
            };
            outputs.push(output);
        }
        Ok(())
    })?;
    let logits = outputs.last().map_or(&[][..], Output::values);
    let (loss, probabilities) = cross_entropy(logits, &targets)?;
    Ok(Some(Box::new(ChainPass {
        layers,
        params,
        xs: xs.clone(),
        outputs,
        targets,
        probabilities,
        loss: Tensor::new(loss, xs.device())?,
    })))
}

/// [n, c, h, w] of the input batch (other shapes: one channel of one row of features).
fn image_dims(xs: &Tensor) -> [usize; 4] {
    match xs.dims() {
        &[n, c, h, w] => [n, c, h, w],
        other => [other[0], 1, 1, other[1..].iter().product()],
    }
}

fn into_array((a, b, c, d): (usize, usize, usize, usize)) -> [usize; 4] {
    [a, b, c, d]
}

fn conv_layer(pooling: Pooling) -> ConvLayer {
    ConvLayer {
        geometry: STRIDE_1,
        relu: true,
        pooling,
    }
}

/// Mean cross-entropy of `logits` [n, classes] against `targets`, and the softmax of each row.
fn cross_entropy(logits: &[f32], targets: &[usize]) -> Result<(f32, Vec<f32>)> {
    let n = targets.len();
    let classes = logits.len().checked_div(n).unwrap_or(0);
    if n == 0 || classes == 0 || logits.len() != n * classes {
        bail!("cross-entropy: {} logits for {n} targets", logits.len());
    }
    let mut probabilities = vec![0f32; logits.len()];
    let mut total = 0f32;
    let rows = logits
        .chunks_exact(classes)
        .zip(probabilities.chunks_exact_mut(classes));
    for ((row, p), &target) in rows.zip(targets) {
        if target >= classes {
            bail!("cross-entropy: target {target} is not one of the {classes} classes");
        }
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let sum: f32 = row.iter().map(|&v| (v - max).exp()).sum();
        let log_sum = max + sum.ln();
        total += log_sum - row[target];
        for (p, &v) in p.iter_mut().zip(row) {
            *p = (v - log_sum).exp();
        }
    }
    Ok((total / n as f32, probabilities))
}

/// The class of each sample, checked against the batch size.
fn class_ids(targets: &Tensor, n: usize) -> Result<Vec<usize>> {
    let ids = kernels::indices(targets)?;
    if ids.len() != n {
        bail!("cross-entropy: {} targets for {n} samples", ids.len());
    }
    Ok(ids)
}

impl TrainPass for ChainPass<'_> {
    fn loss(&self) -> &Tensor {
        &self.loss
    }

    fn backward(self: Box<Self>, scale: f64) -> Result<Vec<Option<Tensor>>> {
        let n = self.targets.len();
        let classes = self.probabilities.len() / n;
        // d logits = (softmax - one-hot) · scale / n.
        let per_row = scale as f32 / n as f32;
        let mut grad: Vec<f32> = self.probabilities.iter().map(|p| p * per_row).collect();
        for (row, &t) in grad.chunks_exact_mut(classes).zip(&self.targets) {
            row[t] -= per_row;
        }
        let mut grads: Vec<(&Tensor, Vec<f32>)> = Vec::new();
        with_values(&self.xs, |images| {
            let dims_of = |i: usize| -> Result<[usize; 4]> {
                if i == 0 {
                    return Ok(image_dims(&self.xs));
                }
                Ok(match &self.outputs[i - 1] {
                    Output::Conv(out) => out.dims,
                    Output::Linear(v) => [n, 1, 1, v.len() / n],
                })
            };
            for (i, layer) in self.layers.iter().enumerate().rev() {
                let input = match i {
                    0 => images,
                    _ => self.outputs[i - 1].values(),
                };
                let need_gx = i > 0;
                let (gx, gw, gb) = match (layer, &self.outputs[i]) {
                    (Layer::Conv(conv, pooling), Output::Conv(out)) => {
                        with_all_values(&[conv.weight.as_tensor()], |w| {
                            let weight = (w[0], conv.weight.dims4().map(into_array)?);
                            conv_layer(*pooling).backward(
                                input,
                                dims_of(i)?,
                                weight,
                                out,
                                &grad,
                                need_gx,
                            )
                        })?
                    }
                    (Layer::Linear(linear, relu), Output::Linear(y)) => {
                        let gz = match relu {
                            true => relu_grad(&grad, y),
                            false => std::mem::take(&mut grad),
                        };
                        let outputs = linear.bias.dim(0)?;
                        with_all_values(&[linear.weight.as_tensor()], |w| {
                            let wanted = Wanted {
                                input: need_gx,
                                weight: true,
                                bias: true,
                            };
                            Ok(linear_backward(input, w[0], &gz, outputs, wanted))
                        })?
                    }
                    _ => bail!("chain: layer {i}'s output is of another kind"),
                };
                let (weight, bias) = match layer {
                    Layer::Conv(conv, _) => (&conv.weight, &conv.bias),
                    Layer::Linear(linear, _) => (&linear.weight, &linear.bias),
                };
                grads.push((weight.as_tensor(), gw));
                grads.push((bias.as_tensor(), gb));
                let used = std::mem::replace(&mut grad, gx.unwrap_or_default());
                scratch::give([used]);
            }
            Ok(())
        })?;
        let mut by_id: std::collections::HashMap<_, _> =
            grads.into_iter().map(|(t, g)| (t.id(), (t, g))).collect();
        let grads = self
            .params
            .vars()
            .map(|var| {
                by_id
                    .remove(&var.as_tensor().id())
                    .map(|(t, g)| Tensor::from_vec(g, t.shape(), t.device()))
                    .transpose()
            })
            .collect();
        // The next step's forward writes its outputs in full: it takes these again.
        scratch::give(self.outputs.into_iter().map(|output| match output {
            Output::Conv(out) => out.values,
            Output::Linear(values) => values,
        }));
        grads
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::super::{Cnn, Mlp, Mode, Model};
    use super::*;

    /// The hand-written pass's loss and gradients against autograd's for the same batch.
    fn matches_autograd(model: &dyn Model, shape: &[usize]) {
        let dev = Device::Cpu;
        let xs = Tensor::randn(0f32, 1., shape, &dev).unwrap();
        let targets = Tensor::new(&[3u32, 0, 4, 1, 2, 4][..shape[0]], &dev).unwrap();
        let loss = model.loss(&xs, &targets, &Mode::Eval).unwrap();
        let store = (&loss * 0.6).unwrap().backward().unwrap();
        let pass = model.train_pass(&xs, &targets, &Mode::Eval).unwrap();
        let pass = pass.expect("f32 on the CPU");
        let hand_loss = pass.loss().to_scalar::<f32>().unwrap();
        let hand = pass.backward(0.6).unwrap();
        let auto_loss = loss.to_scalar::<f32>().unwrap();
        assert!(
            (hand_loss - auto_loss).abs() < 1e-5,
            "loss {hand_loss} vs {auto_loss}"
        );
        for ((name, var), grad) in model.params().iter().zip(&hand) {
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let auto = flat(store.get(var.as_tensor()).unwrap());
            let hand = flat(
                grad.as_ref()
                    .unwrap_or_else(|| panic!("no gradient for {name}")),
            );
            let scale = auto.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            let diff = auto
                .iter()
                .zip(&hand)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(diff < 1e-5 * scale, "{name} differs by {diff}");
        }
    }

    #[test]
    fn the_hand_written_chain_matches_autograd() {
        let cnn = Cnn::new([2, 12, 11], 5, 4, &Device::Cpu).unwrap();
        matches_autograd(&cnn, &[6, 2, 12, 11]);
        let mlp = Mlp::new([1, 6, 6], &[16, 8], 5, 4, &Device::Cpu).unwrap();
        matches_autograd(&mlp, &[5, 1, 6, 6]);
        let bf16 = Tensor::zeros((1, 1, 6, 6), DType::BF16, &Device::Cpu).unwrap();
        let one = Tensor::new(&[1u32], &Device::Cpu).unwrap();
        assert!(mlp.train_pass(&bf16, &one, &Mode::Eval).unwrap().is_none());
        let outside = Tensor::new(&[7u32], &Device::Cpu).unwrap();
        let xs = Tensor::zeros((1, 1, 6, 6), DType::F32, &Device::Cpu).unwrap();
        let err = mlp.train_pass(&xs, &outside, &Mode::Eval).err().unwrap();
        assert!(err.to_string().contains("target 7"), "{err}");
    }
}
