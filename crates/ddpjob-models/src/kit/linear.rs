//! The linear layer every family builds from: `y = x·Wᵀ + b` as torch's `nn.Linear`, with an
//! optional LoRA adapter beside it (PEFT's, its input dropped out by row seeds as the model's
//! own dropout is), one fused op for f32 on the CPU (frozen base and adapter together), the
//! compute dtype's products elsewhere. Its weight may be a frozen 4-bit one instead
//! (`[model.quantize]`, QLoRA: [`PackedWeight`]), multiplied a panel at a time on the CPU in
//! f32, the adapter fused beside it. Made by [`super::ParamBuilder::linear`].

use candle_core::{DType, Result, Tensor, Var};

use super::lora::Adapter;
use crate::{FrozenSet, Mode};
use ddpjob_kernels as kernels;
use ddpjob_kernels::dropout::{self, Dropout};
use ddpjob_seam::{PackedWeight, adapters};

/// `y = x·Wᵀ + b` for x [m, in], W [out, in] as torch's `nn.Linear`; without bias, `b` is a
/// constant zero vector (so the fused CPU kernel applies either way).
pub(crate) struct Linear {
    /// Empty when the weight is `packed`.
    pub(crate) weight: Var,
    /// The weight in 4 bits (frozen), instead of `weight`.
    pub(crate) packed: Option<PackedWeight>,
    pub(crate) bias: Option<Var>,
    pub(crate) zeros: Tensor,
    pub(crate) frozen: FrozenSet,
    /// A LoRA adapter beside it (`[model.lora]`).
    pub(crate) adapter: Option<Adapter>,
    /// Its position among the model's linear layers: its adapter's dropout site.
    pub(crate) index: usize,
}

/// The first dropout site of LoRA adapters' inputs, past the model's own sites.
const LORA_DROPOUT_SITES: usize = 1 << 20;

impl Linear {
    pub(crate) fn bias_or_zeros(&self) -> &Tensor {
        self.bias.as_ref().map_or(&self.zeros, |b| b.as_tensor())
    }

    /// The layer in evaluation (no adapter dropout).
    pub(crate) fn forward(&self, x: &Tensor, compute: DType) -> Result<Tensor> {
        self.forward_mode(x, compute, &Mode::Eval)
    }

    /// The layer, its LoRA adapter's input dropped out in training (masks keyed by each
    /// row's seed and this layer's own site, as the model's dropout is); the base alone while
    /// this thread's adapters are off (a preference objective's reference, see
    /// `ddpjob_seam::adapters`).
    pub(crate) fn forward_mode(&self, x: &Tensor, compute: DType, mode: &Mode) -> Result<Tensor> {
        let adapter = self.adapter.as_ref().filter(|_| !adapters::are_off());
        let bias = self
            .bias
            .as_ref()
            .map_or_else(|| self.zeros.clone(), |b| self.frozen.as_input(b));
        if let Some(packed) = &self.packed {
            return self.forward_packed(packed, adapter, x, &bias, compute, mode);
        }
        let weight = self.frozen.as_input(&self.weight);
        if let Some(adapter) = adapter
            && compute == DType::F32
            && kernels::applies(x)
            && self.frozen.contains(&self.weight)
        {
            // The frozen base and its adapter as one op (see `kernels::lora_linear`).
            let dropout = self.adapter_dropout(adapter, mode);
            let (a, b) = self.factors(adapter);
            return kernels::lora_linear(x, &weight, &bias, (&a, &b), adapter.scale, dropout);
        }
        let y = if compute == DType::F32 && kernels::applies(x) {
            kernels::linear(x, &weight, &bias, false)?
        } else {
            let y = x
                .to_dtype(compute)?
                .matmul(&weight.to_dtype(compute)?.t()?)?;
            match &self.bias {
                Some(_) => y.broadcast_add(&bias.to_dtype(compute)?)?,
                None => y,
            }
        };
        let Some(adapter) = adapter else {
            return Ok(y);
        };
        let dropout = match mode {
            Mode::Train { row_seeds } if adapter.dropout > 0.0 && !row_seeds.is_empty() => {
                let row_len = x.elem_count() / row_seeds.len();
                Dropout::new(row_seeds, adapter.dropout, row_len)
            }
            _ => None,
        };
        let dropped = match dropout {
            Some(d) => d.apply(x, LORA_DROPOUT_SITES + self.index)?,
            None => x.clone(),
        };
        y + adapter.forward(&dropped, compute, &self.frozen)?
    }

    /// The adapter's `A` and `B` as the ops take them.
    fn factors(&self, adapter: &Adapter) -> (Tensor, Tensor) {
        (
            self.frozen.as_input(&adapter.a),
            self.frozen.as_input(&adapter.b),
        )
    }

    /// The adapter's input dropout in training, keyed by the rows' seeds and this layer's site.
    fn adapter_dropout(&self, adapter: &Adapter, mode: &Mode) -> Option<kernels::AdapterDropout> {
        match mode {
            Mode::Train { row_seeds } if adapter.dropout > 0.0 && !row_seeds.is_empty() => {
                Some(kernels::AdapterDropout {
                    row_seeds: row_seeds.clone(),
                    site: LORA_DROPOUT_SITES + self.index,
                    p: adapter.dropout,
                    mask: dropout::mask,
                })
            }
            _ => None,
        }
    }

    /// The layer over its 4-bit weight: the product a panel at a time in f32 (inputs of another
    /// compute dtype cast to f32 and the output back), the adapter fused beside it.
    fn forward_packed(
        &self,
        packed: &PackedWeight,
        adapter: Option<&Adapter>,
        x: &Tensor,
        bias: &Tensor,
        compute: DType,
        mode: &Mode,
    ) -> Result<Tensor> {
        let weight = packed.get().ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "linear layer {}: its 4-bit weight was never loaded",
                self.index
            ))
        })?;
        let x = x.to_dtype(DType::F32)?;
        if !kernels::applies(&x) {
            return Err(candle_core::Error::Msg(
                "model.quantize: 4-bit layers run on CPU workers in this version (their CUDA \
                 kernels are not built yet); set distributed.device = \"cpu\" or leave \
                 [model.quantize] out"
                    .into(),
            ));
        }
        let y = match adapter {
            Some(adapter) => {
                let dropout = self.adapter_dropout(adapter, mode);
                let (a, b) = self.factors(adapter);
                kernels::lora_linear_4bit(&x, weight, bias, (&a, &b), adapter.scale, dropout)?
            }
            None => match &self.bias {
                Some(_) => kernels::quant4::quantized_linear(&x, weight)?.broadcast_add(bias)?,
                None => kernels::quant4::quantized_linear(&x, weight)?,
            },
        };
        y.to_dtype(compute)
    }

    /// The fused q, k, v projection (no adapter) as three products by the thirds of its
    /// weight and bias, in the compute dtype: each [m, out / 3] (see `attention::of_parts`).
    pub(crate) fn forward_thirds(&self, x: &Tensor, compute: DType) -> Result<[Tensor; 3]> {
        let weight = self.frozen.as_input(&self.weight).to_dtype(compute)?;
        let bias = match &self.bias {
            Some(b) => Some(self.frozen.as_input(b).to_dtype(compute)?),
            None => None,
        };
        let (x, third) = (x.to_dtype(compute)?, weight.dim(0)? / 3);
        let product = |i: usize| -> Result<Tensor> {
            let y = x.matmul(&weight.narrow(0, i * third, third)?.t()?)?;
            match &bias {
                Some(b) => y.broadcast_add(&b.narrow(0, i * third, third)?),
                None => Ok(y),
            }
        };
        Ok([product(0)?, product(1)?, product(2)?])
    }

    /// Which gradients its backward forms: none for what is frozen.
    pub(crate) fn wanted(&self) -> kernels::Wanted {
        kernels::Wanted {
            input: true,
            weight: self.packed.is_none() && !self.frozen.contains(&self.weight),
            bias: self.bias.as_ref().is_some_and(|b| !self.frozen.contains(b)),
        }
    }
}
