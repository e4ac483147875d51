//! `mlp`: flatten, then Linear-ReLU layers of the configured widths, then a Linear classifier;
//! named fc1, fc2, ... as in `../shared/bench/torch_ref.py`.

use candle_core::{Device, Result, Tensor};

use super::chain::{self, Layer};
use super::{Init, Linear, Mode, Model, Params, TrainPass};

pub struct Mlp {
    layers: Vec<Linear>,
    params: Params,
}

impl Mlp {
    pub fn new(
        shape: [usize; 3],
        hidden: &[usize],
        classes: usize,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        let mut init = Init::new(seed, device);
        let widths: Vec<usize> = std::iter::once(shape.iter().product())
            .chain(hidden.iter().copied())
            .chain([classes])
            .collect();
        let layers = widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| init.linear(&format!("fc{}", i + 1), w[0], w[1]))
            .collect::<Result<Vec<_>>>()?;
        Ok(Mlp {
            layers,
            params: init.finish(),
        })
    }
}

impl Model for Mlp {
    fn forward(&self, xs: &Tensor, _mode: &Mode) -> Result<Tensor> {
        let mut h = xs.flatten_from(1)?;
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h, i < last)?;
        }
        Ok(h)
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
        let last = self.layers.len() - 1;
        let layers = (self.layers.iter().enumerate())
            .map(|(i, layer)| Layer::Linear(layer, i < last))
            .collect();
        chain::forward(layers, &self.params, xs, targets)
    }

    fn train_flops_per_sample(&self) -> Option<f64> {
        let forward: Vec<f64> = (self.params.iter())
            .filter(|(name, _)| name.ends_with(".weight"))
            .map(|(_, w)| 2.0 * w.elem_count() as f64)
            .collect();
        Some(super::chain_train_flops(&forward))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A width no machine has memory for (a typo) is an error naming the parameter and its
    /// size, not an aborted process: sizes past any address space, so no overcommit setting
    /// lets the allocation through, and one past `usize`.
    #[test]
    fn a_model_too_large_for_memory_is_refused_by_name() {
        let refused = |hidden: usize| match Mlp::new([1, 32, 32], &[hidden], 10, 0, &Device::Cpu) {
            Ok(_) => panic!("a hidden width of {hidden} was built"),
            Err(e) => e.to_string(),
        };
        let why = refused(1 << 44);
        assert!(
            why.contains(
                "parameter `fc1.weight` of shape [17592186044416, 1024] needs 72057594.0 GB"
            ),
            "{why}"
        );
        assert!(
            why.contains("more memory than this machine can give"),
            "{why}"
        );
        assert!(refused(usize::MAX).contains("`fc1.weight` of shape [18446744073709551615, 1024]"));
        assert!(super::super::zeroed_parameter_values("w", &[1 << 44, 1024]).is_err());
        assert_eq!(
            super::super::zeroed_parameter_values("w", &[3, 2]).unwrap(),
            vec![0.0; 6]
        );
        assert!(
            super::super::zeroed_parameter_values("w", &[0, 2])
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn names_and_shapes_follow_torch() {
        let mlp = Mlp::new([1, 28, 28], &[256, 256], 10, 0, &Device::Cpu).unwrap();
        let names: Vec<_> = mlp
            .params()
            .iter()
            .map(|(n, v)| (n.to_string(), v.dims().to_vec()))
            .collect();
        assert_eq!(names[0], ("fc1.weight".to_string(), vec![256, 784]));
        assert_eq!(names[5], ("fc3.bias".to_string(), vec![10]));
        assert_eq!(
            mlp.params().element_count(),
            784 * 256 + 256 + 256 * 256 + 256 + 2570
        );
        let out = mlp.forward(
            &Tensor::zeros((3, 1, 28, 28), candle_core::DType::F32, &Device::Cpu).unwrap(),
            &Mode::Eval,
        );
        assert_eq!(out.unwrap().dims(), &[3, 10]);
        // 3 × 2·(784·256 + 256·256 + 256·10), less fc1's input gradient 2·784·256.
        assert_eq!(mlp.train_flops_per_sample(), Some(1_211_392.0));
        // Bound 1/sqrt(784): every fc1 weight lies inside it.
        let w = mlp
            .params()
            .vars()
            .next()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(w.iter().all(|x| x.abs() <= 1.0 / 28.0));
    }
}
