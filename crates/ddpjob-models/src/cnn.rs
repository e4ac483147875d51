//! `cnn`: the pytorch/examples MNIST net without dropout — Conv(c,32,3)-ReLU-Conv(32,64,3)-ReLU-
//! MaxPool(2)-Flatten-Linear(·,128)-ReLU-Linear(128,classes) — as in `torch_ref.py`.

use candle_core::{Device, Result, Tensor};

use super::chain::{self, Layer};
use super::{Conv2d, Init, Linear, Mode, Model, Params, TrainPass};
use ddpjob_kernels::Pooling;

pub struct Cnn {
    conv1: Conv2d,
    conv2: Conv2d,
    fc1: Linear,
    fc2: Linear,
    params: Params,
    /// Forward operations per sample of conv1, conv2, fc1, fc2.
    forward_flops: [f64; 4],
}

impl Cnn {
    /// The smallest image side it takes: two 3×3 convolutions take 4 off each side, and the
    /// 2×2 pooling after them needs 2 left.
    pub const SMALLEST_SIDE: usize = 6;

    pub fn new(shape: [usize; 3], classes: usize, seed: u64, device: &Device) -> Result<Self> {
        let [c, h, w] = shape;
        let least = Self::SMALLEST_SIDE;
        if h < least || w < least {
            return Err(candle_core::Error::Msg(format!(
                "the cnn needs images of at least {least}x{least} (two 3x3 convolutions, then a \
                 2x2 pooling), got {h}x{w}: use larger images, or model.arch = \"mlp\""
            )));
        }
        let flat = 64 * ((h - 4) / 2) * ((w - 4) / 2);
        let mut init = Init::new(seed, device);
        let conv1 = init.conv2d("conv1", c, 32, 3)?;
        let conv2 = init.conv2d("conv2", 32, 64, 3)?;
        let fc1 = init.linear("fc1", flat, 128)?;
        let fc2 = init.linear("fc2", 128, classes)?;
        // A k×k convolution costs 2·c·k·k operations per output value.
        let conv =
            |c: usize, o: usize, side: usize| (2 * c * 9 * o * (h - side) * (w - side)) as f64;
        let forward_flops = [
            conv(c, 32, 2),
            conv(32, 64, 4),
            (2 * flat * 128) as f64,
            (2 * 128 * classes) as f64,
        ];
        Ok(Cnn {
            conv1,
            conv2,
            fc1,
            fc2,
            params: init.finish(),
            forward_flops,
        })
    }
}

impl Model for Cnn {
    fn forward(&self, xs: &Tensor, _mode: &Mode) -> Result<Tensor> {
        let h = self.conv1.forward_relu(xs, Pooling::None)?;
        let h = self.conv2.forward_relu(&h, Pooling::Max2)?;
        let h = self.fc1.forward(&h.flatten_from(1)?, true)?;
        self.fc2.forward(&h, false)
    }

    fn params(&self) -> &Params {
        &self.params
    }

    /// On the CPU in f32, the layers differentiated by hand (see `chain`).
    fn train_pass(
        &self,
        xs: &Tensor,
        targets: &Tensor,
        _mode: &Mode,
    ) -> Result<Option<Box<dyn TrainPass + '_>>> {
        let layers = vec![
            Layer::Conv(&self.conv1, Pooling::None),
            Layer::Conv(&self.conv2, Pooling::Max2),
            Layer::Linear(&self.fc1, true),
            Layer::Linear(&self.fc2, false),
        ];
        chain::forward(layers, &self.params, xs, targets)
    }

    fn train_flops_per_sample(&self) -> Option<f64> {
        Some(super::chain_train_flops(&self.forward_flops))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;
    use ddpjob_rng::Mt19937;

    #[test]
    fn matches_the_torch_reference_shapes() {
        let cnn = Cnn::new([1, 28, 28], 10, 0, &Device::Cpu).unwrap();
        let dims: Vec<_> = cnn
            .params()
            .iter()
            .map(|(n, v)| (n.to_string(), v.dims().to_vec()))
            .collect();
        assert_eq!(dims[0], ("conv1.weight".to_string(), vec![32, 1, 3, 3]));
        assert_eq!(dims[4], ("fc1.weight".to_string(), vec![128, 9216]));
        let out = cnn.forward(
            &Tensor::ones((2, 1, 28, 28), candle_core::DType::F32, &Device::Cpu).unwrap(),
            &Mode::Eval,
        );
        assert_eq!(out.unwrap().dims(), &[2, 10]);
        // Forward: conv1 2·9·32·26², conv2 2·288·64·24², fc1 2·9216·128, fc2 2·128·10; backward
        // twice that, less conv1's input gradient: the ≈ 71.6 MFLOP of the estimate.
        let forward = [389_376.0, 21_233_664.0, 2_359_296.0, 2_560.0];
        let expected = 3.0 * forward.iter().sum::<f64>() - forward[0];
        assert_eq!(cnn.train_flops_per_sample(), Some(expected));
        assert_eq!(expected, 71_565_312.0);
    }

    /// The loss and every parameter's gradient of the cnn on `device`, inputs in `dtype`.
    fn loss_and_grads(device: &Device, dtype: DType) -> (f32, Vec<(String, Vec<f32>)>) {
        let model = Cnn::new([1, 12, 12], 10, 4, device).unwrap();
        let mut rng = Mt19937::new(9);
        let pixels: Vec<f32> = (0..8 * 144).map(|_| rng.uniform(0.0, 1.0)).collect();
        let labels: Vec<u32> = (0..8).map(|i| (i * 7 % 10) as u32).collect();
        let xs = Tensor::from_vec(pixels, (8, 1, 12, 12), device)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let targets = Tensor::from_vec(labels, 8, device).unwrap();
        let loss = model.loss(&xs, &targets, &Mode::Eval).unwrap();
        let grads = loss.backward().unwrap();
        let host = |t: &Tensor| {
            t.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let per_param = model
            .params()
            .iter()
            .map(|(name, var)| (name.to_string(), host(grads.get(var).unwrap())))
            .collect();
        let loss = loss
            .to_dtype(DType::F32)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        (loss, per_param)
    }

    /// The largest difference between two parameters' gradients, and the reference's scale.
    fn worst_difference(ours: &[f32], theirs: &[f32]) -> (f32, f32) {
        let scale = theirs.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        let worst = ours
            .iter()
            .zip(theirs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        (worst, scale)
    }

    /// Runs where a GPU is: the cnn through autograd on the GPU (its unfolded convolutions and
    /// its linear layers' finishing kernel) gives the CPU's loss and gradients in f32; in bf16
    /// it strays from them at most twice as far as the CPU's own bf16 does, plus 1% of a
    /// gradient's largest value (on this small net, with pre-activations near zero, the CPU's
    /// bf16 is up to about 30% of that value away: rounding flips ReLU masks).
    #[test]
    fn the_gpu_cnn_gives_the_cpus_loss_and_gradients() {
        let (cpu_loss, cpu_grads) = loss_and_grads(&Device::Cpu, DType::F32);
        // Ten classes, small random weights: about ln 10.
        assert!((cpu_loss - 10f32.ln()).abs() < 0.5, "{cpu_loss}");
        assert_eq!(cpu_grads.len(), 8);
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("skipping: no GPU");
            return;
        };
        let (loss, grads) = loss_and_grads(&gpu, DType::F32);
        assert!(
            (loss - cpu_loss).abs() <= 1e-4 * cpu_loss.abs(),
            "F32: loss {loss} on the GPU, {cpu_loss} on the CPU"
        );
        for ((name, ours), (_, theirs)) in grads.iter().zip(&cpu_grads) {
            let (worst, scale) = worst_difference(ours, theirs);
            assert!(
                worst <= 1e-4 * scale,
                "F32 {name}: gradients differ by {worst} (scale {scale})"
            );
        }
        let (cpu_bf16_loss, cpu_bf16_grads) = loss_and_grads(&Device::Cpu, DType::BF16);
        let (loss, grads) = loss_and_grads(&gpu, DType::BF16);
        let cpu_bf16_loss_error = (cpu_bf16_loss - cpu_loss).abs();
        assert!(
            (loss - cpu_loss).abs() <= 2.0 * cpu_bf16_loss_error + 1e-2 * cpu_loss.abs(),
            "BF16: loss {loss} on the GPU, {cpu_bf16_loss} on the CPU, {cpu_loss} in f32"
        );
        for (((name, ours), (_, cpu_bf16)), (_, f32s)) in
            grads.iter().zip(&cpu_bf16_grads).zip(&cpu_grads)
        {
            let (worst, scale) = worst_difference(ours, f32s);
            let (cpu_worst, _) = worst_difference(cpu_bf16, f32s);
            assert!(
                worst <= 2.0 * cpu_worst + 1e-2 * scale,
                "BF16 {name}: the GPU's gradients differ from f32's by {worst}, the CPU's bf16 \
                 by {cpu_worst} (scale {scale})"
            );
        }
    }
}
