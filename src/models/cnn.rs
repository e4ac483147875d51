//! `cnn`: the pytorch/examples MNIST net without dropout — Conv(c,32,3)-ReLU-Conv(32,64,3)-ReLU-
//! MaxPool(2)-Flatten-Linear(·,128)-ReLU-Linear(128,classes) — as in `torch_ref.py`.

use candle_core::{Device, Result, Tensor};

use super::chain::{self, Layer};
use super::{Conv2d, Init, Linear, Mode, Model, Params, TrainPass};
use crate::kernels::Pooling;

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
    pub fn new(shape: [usize; 3], classes: usize, seed: u64, device: &Device) -> Result<Self> {
        let [c, h, w] = shape;
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
    use super::*;

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
}
