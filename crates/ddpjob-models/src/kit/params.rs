//! Where a family's parameters come from: [`ParamBuilder`] creates them in registration order
//! under their PyTorch names, drawn from the job's seed as the family's reference initialises
//! them (nanoGPT's N(0, std), biases 0, gains 1), or blank to be read from a checkpoint or a
//! Hugging Face directory; it makes the kit's layers (linear with its LoRA adapter,
//! LayerNorm) and records which parameters are exempt from weight decay. With
//! `[model.quantize]` its linear layers' weights are made in 4 bits instead ([`PackedWeight`]:
//! drawn values quantised at once, one layer's f32 copy at a time; blank ones filled by the
//! source), never parameters.

use candle_core::{DType, Device, Error, Result, Tensor, Var};

use super::lora::Adapter;
use super::{LayerNorm, Linear};
use crate::{FrozenSet, LoraSpec, is_adapter};
use ddpjob_rng::Mt19937;
use ddpjob_seam::PackedWeight;
use ddpjob_spec::QuantizeSpec;

/// Creates parameters in registration order, weights drawn N(0, std) from `Mt19937(seed)` as
/// nanoGPT's `_init_weights` (biases 0, gains 1, which draw nothing), and records which ones
/// are exempt from weight decay (fewer than 2 dimensions).
pub(crate) struct ParamBuilder<'a> {
    /// `None`: weights are zeros, to be loaded (see [`ParamBuilder::blank`]).
    rng: Option<Mt19937>,
    pub(crate) device: &'a Device,
    pub(crate) entries: Vec<(String, Var)>,
    pub(crate) no_decay: Vec<usize>,
    /// Shared with the layers made and the [`Params`] they end in (see `ddpjob_seam::freeze`).
    pub(crate) frozen: FrozenSet,
    /// `[model.lora]`, the arch's default targets, and the generator of the adapters' `A`
    /// (drawn even when the weights are loaded: a zero `A` would never learn).
    lora: Option<(LoraSpec, &'static [&'static str], Mt19937)>,
    /// Every linear layer made, for the message when no adapter target names one.
    linear_names: Vec<String>,
    /// `[model.quantize]`: linear layers' weights made in 4 bits, and those made so far.
    quantize: Option<QuantizeSpec>,
    pub(crate) packed: Vec<(String, PackedWeight)>,
}

impl<'a> ParamBuilder<'a> {
    pub(crate) fn new(seed: u64, device: &'a Device) -> Self {
        ParamBuilder {
            rng: Some(Mt19937::new(seed)),
            device,
            entries: Vec::new(),
            no_decay: Vec::new(),
            frozen: FrozenSet::default(),
            lora: None,
            linear_names: Vec::new(),
            quantize: None,
            packed: Vec::new(),
        }
    }

    /// Linear layers' weights made in 4 bits as `quantize` says (frozen: the base of QLoRA).
    pub fn with_quantize(mut self, quantize: Option<QuantizeSpec>) -> Self {
        self.quantize = quantize;
        self
    }

    /// Whether linear layers are made in 4 bits.
    pub(crate) fn quantizes(&self) -> bool {
        self.quantize.is_some()
    }

    /// Adapters beside the linear layers `lora` targets (`defaults`: the arch's targets when
    /// it names none), their `A` drawn from `seed`.
    pub fn with_lora(
        mut self,
        lora: Option<&LoraSpec>,
        defaults: &'static [&'static str],
        seed: u64,
    ) -> Self {
        self.lora = lora.map(|l| (l.clone(), defaults, Mt19937::new(seed ^ 0x4c6f_5241)));
        self
    }

    /// An error when LoRA is on and no linear layer took an adapter, listing them.
    pub(crate) fn check_lora(&self) -> Result<()> {
        let Some((lora, defaults, _)) = &self.lora else {
            return Ok(());
        };
        if self.entries.iter().any(|(n, _)| is_adapter(n)) {
            return Ok(());
        }
        let mut kinds: Vec<&str> = self
            .linear_names
            .iter()
            .map(|n| n.rsplit('.').next().unwrap_or(n))
            .collect();
        kinds.sort();
        kinds.dedup();
        let targets = match lora.target_modules.is_default() {
            true => format!("{defaults:?} (the default)"),
            false => lora.target_modules.to_string(),
        };
        Err(Error::Msg(format!(
            "model.lora.target_modules = {targets} names none of the model's linear layers: \
             {} (e.g. {}), or \"all-linear\"",
            kinds.join(", "),
            self.linear_names.first().map_or("", String::as_str)
        )))
    }

    /// Parameters of the right names and shapes whose values will be loaded: nothing drawn.
    pub(crate) fn blank(device: &'a Device) -> Self {
        ParamBuilder {
            rng: None,
            ..ParamBuilder::new(0, device)
        }
    }

    pub(crate) fn push(&mut self, name: String, shape: &[usize], values: Vec<f32>) -> Result<Var> {
        let var = Var::from_vec(values, shape, self.device)?;
        if shape.len() < 2 {
            self.no_decay.push(self.entries.len());
        }
        self.entries.push((name, var.clone()));
        Ok(var)
    }

    pub(crate) fn normal(&mut self, name: &str, shape: &[usize], std: f32) -> Result<Var> {
        let values = match &mut self.rng {
            Some(rng) => crate::parameter_values(name, shape, || rng.normal() * std)?,
            None => crate::zeroed_parameter_values(name, shape)?,
        };
        self.push(name.to_string(), shape, values)
    }

    pub(crate) fn constant(&mut self, name: String, size: usize, value: f32) -> Result<Var> {
        let values = crate::parameter_values(&name, &[size], || value)?;
        self.push(name, &[size], values)
    }

    pub(crate) fn linear(
        &mut self,
        name: &str,
        inputs: usize,
        outputs: usize,
        std: f32,
        bias: bool,
    ) -> Result<Linear> {
        let (weight, packed) = match self.quantize {
            Some(spec) => self.packed(name, inputs, outputs, std, spec)?,
            None => (
                self.normal(&format!("{name}.weight"), &[outputs, inputs], std)?,
                None,
            ),
        };
        let bias = match bias {
            true => Some(self.constant(format!("{name}.bias"), outputs, 0.0)?),
            false => None,
        };
        let zeros = Tensor::zeros(outputs, DType::F32, self.device)?;
        let adapter = match &mut self.lora {
            Some((lora, defaults, rng)) if lora.targets(name, defaults) => {
                // PEFT's init: A as torch's kaiming_uniform_(a=sqrt(5)), B zeros.
                let (r, bound) = (lora.r, 1.0 / (inputs as f32).sqrt());
                let a: Vec<f32> = (0..r * inputs)
                    .map(|_| (2.0 * rng.next_f32() - 1.0) * bound)
                    .collect();
                let (scale, dropout) = (lora.scale(), lora.dropout);
                let a = self.push(format!("{name}.lora_A.weight"), &[r, inputs], a)?;
                let zeros_b = vec![0.0; outputs * r];
                let b = self.push(format!("{name}.lora_B.weight"), &[outputs, r], zeros_b)?;
                let zeros = (
                    Tensor::zeros(r, DType::F32, self.device)?,
                    Tensor::zeros(outputs, DType::F32, self.device)?,
                );
                Some(Adapter {
                    a,
                    b,
                    scale,
                    dropout,
                    zeros,
                })
            }
            _ => None,
        };
        self.linear_names.push(name.to_string());
        Ok(Linear {
            weight,
            packed,
            bias,
            zeros,
            frozen: self.frozen.clone(),
            adapter,
            index: self.linear_names.len() - 1,
        })
    }

    /// A 4-bit weight [outputs, inputs] named `{name}.weight`: drawn values quantised at once
    /// (the same draws as an f32 weight's, so the seed's stream goes on the same), or blank
    /// for the source to fill; and the empty stand-in the layer keeps as its f32 weight.
    fn packed(
        &mut self,
        name: &str,
        inputs: usize,
        outputs: usize,
        std: f32,
        spec: QuantizeSpec,
    ) -> Result<(Var, Option<PackedWeight>)> {
        let full = format!("{name}.weight");
        let packed = PackedWeight::blank(&full, outputs, inputs, spec).map_err(Error::Msg)?;
        if let Some(rng) = &mut self.rng {
            let values = crate::parameter_values(&full, &[outputs, inputs], || rng.normal() * std)?;
            packed.fill(&values).map_err(Error::Msg)?;
        }
        self.packed.push((full, packed.clone()));
        let stand_in = Var::from_vec(Vec::<f32>::new(), 0, self.device)?;
        Ok((stand_in, Some(packed)))
    }

    pub(crate) fn layer_norm(&mut self, name: &str, size: usize, bias: bool) -> Result<LayerNorm> {
        let weight = self.constant(format!("{name}.weight"), size, 1.0)?;
        let bias = match bias {
            true => Some(self.constant(format!("{name}.bias"), size, 0.0)?),
            false => None,
        };
        let zeros = Tensor::zeros(size, DType::F32, self.device)?;
        Ok(LayerNorm {
            weight,
            bias,
            zeros,
            frozen: self.frozen.clone(),
        })
    }
}
