//! Frozen weights kept in 4 bits ([`PackedWeight`], `[model.quantize]`, QLoRA): not parameters
//! (nothing trains them, the optimizer and the collectives never see them) but part of the
//! model all the same: the base a checkpoint's fingerprint covers, what a Hugging Face
//! directory fills and an export de-quantises. A model makes one per quantised layer with its
//! shape, blank; whoever loads the base fills it once from f32 values (quantised here, as
//! bitsandbytes would) or from codes bitsandbytes saved; the layer multiplies by it.
//!
//! The form bitsandbytes saves such a weight in (what a job's final weights and a
//! transformers + bitsandbytes checkpoint hold) is `saved.rs`'s.
//!
//! Depends on the kernels crate's 4-bit format and the spec's `[model.quantize]` only.

mod saved;
#[cfg(test)]
mod tests;

pub use saved::{Stored, dequantize_saved, is_part_of, read_stored, state_name};

use std::sync::{Arc, OnceLock};

use ddpjob_kernels::quant4::quantize_4bit;
pub use ddpjob_kernels::quant4::{FourBit, Quantized4, Quantized4Weight, Scales};
use ddpjob_spec::{QuantType, QuantizeSpec};

/// One frozen weight [out, in] in 4 bits, filled once.
#[derive(Clone, Debug)]
pub struct PackedWeight {
    pub out: usize,
    pub inputs: usize,
    pub spec: QuantizeSpec,
    slot: Arc<OnceLock<Quantized4Weight>>,
}

/// The kernels' type of a spec's.
pub fn four_bit(kind: QuantType) -> FourBit {
    match kind {
        QuantType::Nf4 => FourBit::Nf4,
        QuantType::Fp4 => FourBit::Fp4,
    }
}

impl PackedWeight {
    /// A blank weight of [out, inputs] in `spec`'s format; `Err` (what to change) when its
    /// rows are not whole blocks.
    pub fn blank(
        name: &str,
        out: usize,
        inputs: usize,
        spec: QuantizeSpec,
    ) -> std::result::Result<Self, String> {
        if !inputs.is_multiple_of(spec.block_size) {
            let fits = ddpjob_spec::QUANTIZE_BLOCK_SIZES
                .iter()
                .rev()
                .find(|&&b| inputs.is_multiple_of(b));
            let fix = match fits {
                Some(b) => format!("choose a block size that divides {inputs}, e.g. {b}"),
                None => format!("no block size bitsandbytes takes divides {inputs}"),
            };
            return Err(format!(
                "model.quantize.block_size = {}: `{name}` has {inputs} input features, not a \
                 multiple of it, so its blocks would straddle rows; {fix}",
                spec.block_size
            ));
        }
        Ok(PackedWeight {
            out,
            inputs,
            spec,
            slot: Arc::new(OnceLock::new()),
        })
    }

    /// Its values: `[out, inputs]`.
    pub fn len(&self) -> usize {
        self.out * self.inputs
    }

    /// Whether it has no values (a layer of width 0 is refused before; for clippy).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes it takes in memory once filled.
    pub fn bytes(&self) -> usize {
        self.spec.bytes(self.len())
    }

    /// Fills it from f32 values `[out, inputs]` row-major, quantised as bitsandbytes'
    /// `quantize_4bit` does. A second fill is an error (the base is loaded once).
    pub fn fill(&self, values: &[f32]) -> std::result::Result<(), String> {
        if values.len() != self.len() {
            return Err(format!(
                "{} values for a 4-bit weight of [{}, {}]",
                values.len(),
                self.out,
                self.inputs
            ));
        }
        let q = quantize_4bit(
            values,
            self.spec.block_size,
            four_bit(self.spec.kind),
            self.spec.double_quant,
        );
        self.fill_stored(q)
    }

    /// Fills it with codes and scales as stored (a checkpoint bitsandbytes saved).
    pub fn fill_stored(&self, q: Quantized4) -> std::result::Result<(), String> {
        let weight = Quantized4Weight::new(q, self.out, self.inputs)?;
        self.slot
            .set(weight)
            .map_err(|_| "a 4-bit weight was loaded twice".to_string())
    }

    /// The weight, once filled.
    pub fn get(&self) -> Option<&Quantized4Weight> {
        self.slot.get()
    }
}
