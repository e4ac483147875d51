//! Parameters for a user's own network written with `candle_nn`: a [`ParamStore`] hands out a
//! `VarBuilder` whose tensors are initialised from the job's seed (candle's CPU RNG cannot be
//! seeded), keeps the names the layers give them (`stem.conv.weight`), and records which are
//! trained and which are buffers (BatchNorm's `running_mean` and `running_var`).

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use candle_nn::{Init, VarBuilder, init::NormalOrUniform, var_builder::SimpleBackend};

use crate::{ModelContext, Params};
use ddpjob_rng::Mt19937;

/// Last name components that are buffers, not parameters: candle_nn's BatchNorm statistics.
const BUFFER_NAMES: &[&str] = &["running_mean", "running_var"];

/// Creates a model's variables in the order its layers ask for them; see the module docs.
///
/// ```
/// use candle_core::{Device, DType};
/// use ddpjob_seam::{ModelContext, ModelInput, ParamStore};
///
/// let cx = ModelContext {
///     input: ModelInput::Image { shape: [1, 4, 4], classes: 3 },
///     seed: 7,
///     device: Device::Cpu,
///     compute_dtype: DType::F32,
///     restoring: false,
///     lora: None,
///     quantize: None,
/// };
/// let store = ParamStore::new(&cx);
/// let vb = store.var_builder();
/// let fc = candle_nn::linear(16, 3, vb.pp("fc"))?;
/// let bn = candle_nn::batch_norm(3, 1e-5, vb.pp("bn"))?;
/// let params = store.finish();
/// assert_eq!(params.iter().map(|(n, _)| n).collect::<Vec<_>>(),
///            ["fc.weight", "fc.bias", "bn.weight", "bn.bias"]);
/// assert_eq!(params.buffers().map(|(n, _)| n).collect::<Vec<_>>(),
///            ["bn.running_mean", "bn.running_var"]);
/// # drop((fc, bn));
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone)]
pub struct ParamStore {
    inner: Arc<Mutex<Inner>>,
    device: Device,
}

struct Inner {
    rng: Mt19937,
    created: Vec<(String, Var)>,
}

impl ParamStore {
    /// A store drawing from the job's seed, on the job's device.
    pub fn new(cx: &ModelContext) -> Self {
        ParamStore {
            inner: Arc::new(Mutex::new(Inner {
                rng: Mt19937::new(cx.seed),
                created: Vec::new(),
            })),
            device: cx.device.clone(),
        }
    }

    /// A `candle_nn` VarBuilder (f32) whose variables this store creates and records.
    pub fn var_builder(&self) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.clone()), DType::F32, self.device.clone())
    }

    /// The parameters and buffers created so far, in creation order.
    pub fn finish(&self) -> Params {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut params = Params::default();
        for (name, var) in &inner.created {
            let last = name.rsplit('.').next().unwrap_or(name);
            if BUFFER_NAMES.contains(&last) {
                params.push_buffer(name.clone(), var.clone());
            } else {
                params.push(name.clone(), var.clone());
            }
        }
        params
    }
}

impl SimpleBackend for ParamStore {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, var)) = inner.created.iter().find(|(n, _)| n == name) {
            if var.shape() != &shape {
                candle_core::bail!(
                    "`{name}` was created with shape {:?} and asked for again as {:?}",
                    var.dims(),
                    shape.dims()
                );
            }
            return var.as_tensor().to_dtype(dtype);
        }
        let rng = &mut inner.rng;
        let dims = shape.dims();
        let values = match init {
            Init::Const(v) if v.to_bits() == 0 => crate::zeroed_parameter_values(name, dims)?,
            Init::Const(v) => crate::parameter_values(name, dims, || v as f32)?,
            Init::Randn { mean, stdev } => {
                crate::parameter_values(name, dims, || mean as f32 + stdev as f32 * rng.normal())?
            }
            Init::Uniform { lo, up } => {
                crate::parameter_values(name, dims, || rng.uniform(lo as f32, up as f32))?
            }
            Init::Kaiming {
                dist,
                fan,
                non_linearity,
            } => {
                let std = non_linearity.gain() / (fan.for_shape(&shape) as f64).sqrt();
                match dist {
                    NormalOrUniform::Normal => {
                        crate::parameter_values(name, dims, || std as f32 * rng.normal())?
                    }
                    NormalOrUniform::Uniform => {
                        let bound = (3f64.sqrt() * std) as f32;
                        crate::parameter_values(name, dims, || rng.uniform(-bound, bound))?
                    }
                }
            }
        };
        let var = Var::from_vec(values, shape, dev)?;
        inner.created.push((name.to_string(), var.clone()));
        // The same storage, so a layer's updates (BatchNorm's statistics) land in the var.
        var.as_tensor().to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _dev: &Device) -> Result<Tensor> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match inner.created.iter().find(|(n, _)| n == name) {
            Some((_, var)) => var.as_tensor().to_dtype(dtype),
            None => candle_core::bail!("`{name}` has not been created; give it a shape"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.created.iter().any(|(n, _)| n == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::ModelInput;
    use candle_nn::Module;

    fn cx(seed: u64) -> ModelContext {
        ModelContext {
            input: ModelInput::Image {
                shape: [1, 2, 2],
                classes: 2,
            },
            seed,
            device: Device::Cpu,
            compute_dtype: DType::F32,
            restoring: false,
            lora: None,
            quantize: None,
        }
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn the_same_seed_gives_the_same_weights_and_layers_share_the_vars() {
        let (a, b) = (ParamStore::new(&cx(3)), ParamStore::new(&cx(3)));
        let la = candle_nn::linear(4, 2, a.var_builder().pp("fc")).unwrap();
        let _ = candle_nn::linear(4, 2, b.var_builder().pp("fc")).unwrap();
        let (pa, pb) = (a.finish(), b.finish());
        for ((na, va), (nb, vb)) in pa.iter().zip(pb.iter()) {
            assert_eq!(na, nb);
            assert_eq!(values(va.as_tensor()), values(vb.as_tensor()));
        }
        let other = ParamStore::new(&cx(4));
        let _ = candle_nn::linear(4, 2, other.var_builder().pp("fc")).unwrap();
        let first = |p: &Params| values(p.iter().next().unwrap().1.as_tensor());
        assert_ne!(first(&pa), first(&other.finish()));

        // Setting the recorded var changes what the layer computes: the optimizer's updates
        // reach the network.
        let (_, w) = pa.iter().next().unwrap();
        w.set(&w.zeros_like().unwrap()).unwrap();
        let x = Tensor::ones((1, 4), DType::F32, &Device::Cpu).unwrap();
        let y = la.forward(&x).unwrap();
        let bias = values(pa.iter().nth(1).unwrap().1.as_tensor());
        assert_eq!(values(&y), bias);
    }

    #[test]
    fn batch_norm_statistics_are_buffers_that_training_updates() {
        let store = ParamStore::new(&cx(1));
        let bn = candle_nn::batch_norm(2, 1e-5, store.var_builder().pp("bn")).unwrap();
        let params = store.finish();
        assert_eq!(params.len(), 2);
        let (name, mean) = params.buffers().next().unwrap();
        assert_eq!(name, "bn.running_mean");
        let x = Tensor::new(&[[1f32, 10.0], [3.0, 30.0]], &Device::Cpu).unwrap();
        let _ =
            candle_nn::ModuleT::forward_t(&bn, &x.reshape((2, 2, 1, 1)).unwrap(), true).unwrap();
        // momentum 0.1: 0.9·0 + 0.1·mean(batch).
        let got = values(mean.as_tensor());
        assert!(
            (got[0] - 0.2).abs() < 1e-6 && (got[1] - 2.0).abs() < 1e-5,
            "{got:?}"
        );
    }
}

#[cfg(test)]
mod name_tests {
    use candle_core::{DType, Device, Tensor, Var};

    use crate::Params;

    #[test]
    fn a_repeated_parameter_name_is_found() {
        let var =
            || Var::from_tensor(&Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap()).unwrap();
        let unique =
            Params::from_vars(vec![("a.weight".into(), var()), ("b.weight".into(), var())]);
        assert_eq!(unique.repeated_name(), None);
        let twice = Params::from_vars(vec![("a.weight".into(), var()), ("a.weight".into(), var())]);
        assert_eq!(twice.repeated_name(), Some("a.weight"));
    }
}
