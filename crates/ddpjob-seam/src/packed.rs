//! Frozen weights kept in 4 bits ([`PackedWeight`], `[model.quantize]`, QLoRA): not parameters
//! (nothing trains them, the optimizer and the collectives never see them) but part of the
//! model all the same: the base a checkpoint's fingerprint covers, what a Hugging Face
//! directory fills and an export de-quantises. A model makes one per quantised layer with its
//! shape, blank; whoever loads the base fills it once from f32 values (quantised here, as
//! bitsandbytes would) or from codes bitsandbytes saved; the layer multiplies by it.
//!
//! Depends on the kernels crate's 4-bit format and the spec's `[model.quantize]` only.

use std::sync::{Arc, OnceLock};

use candle_core::{Device, Result, Tensor};
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

    /// The weight in f32 [out, inputs] (an export, a merge); `Err` when never filled.
    pub fn dequantized(&self, device: &Device) -> Result<Tensor> {
        let w = self.get().ok_or_else(|| {
            candle_core::Error::Msg("a 4-bit weight was never loaded".to_string())
        })?;
        Tensor::from_vec(w.dequantized(), (self.out, self.inputs), device)
    }
}

/// The suffix of bitsandbytes' JSON state of a 4-bit weight `<name>`.
const STATE: &str = ".quant_state.bitsandbytes__";

/// Whether `tensor` (a file's name) is part of bitsandbytes' state of a 4-bit weight `name`.
pub fn is_part_of(tensor: &str, name: &str) -> bool {
    tensor == name
        || tensor.strip_prefix(name).is_some_and(|rest| {
            [
                ".absmax",
                ".quant_map",
                ".nested_absmax",
                ".nested_quant_map",
            ]
            .contains(&rest)
                || rest.starts_with(STATE)
        })
}

/// The name of the JSON state of a 4-bit weight saved as `name`, if `names` holds one.
pub fn state_name<'a>(
    name: &str,
    mut names: impl Iterator<Item = &'a String>,
) -> Option<&'a String> {
    let prefix = format!("{name}{STATE}");
    names.find(|n| n.starts_with(&prefix))
}

/// A 4-bit weight as bitsandbytes saved it, read back.
pub struct Stored {
    pub weight: Quantized4,
    /// Its shape [out, in].
    pub shape: Vec<usize>,
    /// Whether its scales are nested (double quantisation).
    pub nested: bool,
}

/// Reads the 4-bit weight saved as `name` (`<name>` uint8, `.absmax`, `.quant_map`, nested
/// `.nested_absmax` and `.nested_quant_map`, and the JSON `.quant_state.bitsandbytes__<type>`,
/// as transformers' `save_pretrained` writes them) through `get`; `codes`: read the codes too
/// (else left empty: a check of the state only).
pub fn read_stored(
    name: &str,
    state: &str,
    get: &dyn Fn(&str) -> std::result::Result<Tensor, String>,
    codes: bool,
) -> std::result::Result<Stored, String> {
    let floats = |suffix: &str| -> std::result::Result<Vec<f32>, String> {
        get(&format!("{name}{suffix}"))?
            .to_dtype(candle_core::DType::F32)
            .and_then(|t| t.flatten_all()?.to_vec1())
            .map_err(|e| e.to_string())
    };
    let bytes = |suffix: &str| -> std::result::Result<Vec<u8>, String> {
        get(&format!("{name}{suffix}"))?
            .flatten_all()
            .and_then(|t| t.to_vec1())
            .map_err(|e| format!("`{name}{suffix}`: {e} (bitsandbytes saves it as uint8)"))
    };
    let json = bytes(&state[name.len()..])?;
    let fields: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&json)
        .map_err(|e| format!("`{state}` is not bitsandbytes' JSON state: {e}"))?;
    let field = |k: &str| {
        fields
            .get(k)
            .ok_or_else(|| format!("`{state}` has no \"{k}\""))
    };
    let kind = match field("quant_type")?.as_str() {
        Some("nf4") => FourBit::Nf4,
        Some("fp4") => FourBit::Fp4,
        other => return Err(format!("`{state}`: quant_type {other:?} is not nf4 or fp4")),
    };
    let blocksize = field("blocksize")?.as_u64().unwrap_or(0) as usize;
    let shape: Vec<usize> = (field("shape")?.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|d| d.as_u64())
                .map(|d| d as usize)
                .collect()
        })
        .unwrap_or_default();
    let levels = floats(".quant_map")?;
    if levels != kind.levels() {
        return Err(format!(
            "`{name}.quant_map` is not bitsandbytes' {kind:?} levels: {levels:?}"
        ));
    }
    let nested = fields.contains_key("nested_blocksize");
    let scales = match nested {
        false => Scales::Plain(floats(".absmax")?),
        true => Scales::Nested {
            codes: bytes(".absmax")?,
            absmax: floats(".nested_absmax")?,
            map: floats(".nested_quant_map")?,
            blocksize: field("nested_blocksize")?.as_u64().unwrap_or(0) as usize,
            offset: field("nested_offset")?.as_f64().unwrap_or(0.0) as f32,
        },
    };
    let len = shape.iter().product();
    let codes = match codes {
        true => bytes("")?,
        false => Vec::new(),
    };
    if !codes.is_empty() && codes.len() * 2 != len {
        return Err(format!(
            "`{name}`: {} bytes of codes for {len} values",
            codes.len()
        ));
    }
    Ok(Stored {
        weight: Quantized4 {
            kind,
            blocksize,
            len,
            codes,
            scales,
        },
        shape,
        nested,
    })
}

impl PackedWeight {
    /// Fills it from the state bitsandbytes saved as `name` (see [`read_stored`]), which must
    /// be of its own format and shape.
    pub fn fill_saved(
        &self,
        name: &str,
        state: &str,
        get: &dyn Fn(&str) -> std::result::Result<Tensor, String>,
    ) -> std::result::Result<(), String> {
        let stored = read_stored(name, state, get, true)?;
        self.check_saved(&stored)?;
        self.fill_stored(stored.weight)
    }

    /// An error unless `stored` has this weight's format and shape (what to set if not).
    pub fn check_saved(&self, stored: &Stored) -> std::result::Result<(), String> {
        let q = &stored.weight;
        let spec = self.spec;
        if q.kind != four_bit(spec.kind)
            || q.blocksize != spec.block_size
            || stored.nested != spec.double_quant
        {
            let kind = if q.kind == FourBit::Nf4 { "nf4" } else { "fp4" };
            return Err(format!(
                "saved by bitsandbytes as type = \"{kind}\", block_size = {}, double_quant = {}, \
                 but [model.quantize] says type = \"{}\", block_size = {}, double_quant = {}: \
                 set [model.quantize] as it was saved",
                q.blocksize,
                stored.nested,
                spec.kind.name(),
                spec.block_size,
                spec.double_quant
            ));
        }
        if stored.shape != [self.out, self.inputs] {
            return Err(format!(
                "saved for a weight of shape {:?}, the model expects [{}, {}]",
                stored.shape, self.out, self.inputs
            ));
        }
        Ok(())
    }

    /// The tensors bitsandbytes would save for it as `name` (transformers' `save_pretrained`
    /// of a 4-bit model): what a job's final weights hold of a 4-bit base.
    pub fn saved(&self, name: &str, device: &Device) -> Result<Vec<(String, Tensor)>> {
        let w = self.get().ok_or_else(|| {
            candle_core::Error::Msg(format!("the 4-bit weight `{name}` was never loaded"))
        })?;
        let q = w.stored();
        let kind = self.spec.kind.name();
        let mut state = serde_json::json!({
            "quant_type": kind,
            "blocksize": q.blocksize,
            "dtype": "float32",
            "shape": [self.out, self.inputs],
        });
        let bytes = |v: &[u8]| Tensor::from_vec(v.to_vec(), v.len(), device);
        let floats = |v: &[f32]| Tensor::from_vec(v.to_vec(), v.len(), device);
        let mut out = vec![
            (
                name.to_string(),
                bytes(&q.codes)?.reshape((q.codes.len(), 1))?,
            ),
            (format!("{name}.quant_map"), floats(&q.kind.levels())?),
        ];
        match &q.scales {
            Scales::Plain(absmax) => out.push((format!("{name}.absmax"), floats(absmax)?)),
            Scales::Nested {
                codes,
                absmax,
                map,
                blocksize,
                offset,
            } => {
                state["nested_blocksize"] = (*blocksize).into();
                state["nested_offset"] = (*offset as f64).into();
                state["nested_dtype"] = "float32".into();
                out.push((format!("{name}.absmax"), bytes(codes)?));
                out.push((format!("{name}.nested_absmax"), floats(absmax)?));
                out.push((format!("{name}.nested_quant_map"), floats(map)?));
            }
        }
        let json =
            serde_json::to_vec(&state).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        out.push((format!("{name}{STATE}{kind}"), bytes(&json)?));
        Ok(out)
    }
}

/// `tensors` with every 4-bit weight bitsandbytes' way (see [`PackedWeight::saved`]) replaced
/// by its f32 values [out, in] under its own name: what an export or a merge of adapters
/// into the base needs.
pub fn dequantize_saved(
    mut tensors: std::collections::HashMap<String, Tensor>,
) -> std::result::Result<std::collections::HashMap<String, Tensor>, String> {
    let states: Vec<String> = tensors
        .keys()
        .filter(|n| n.contains(STATE))
        .cloned()
        .collect();
    for state in states {
        let name = state[..state.find(STATE).unwrap_or(0)].to_string();
        let get = |n: &str| {
            tensors
                .get(n)
                .cloned()
                .ok_or_else(|| format!("no tensor `{n}`"))
        };
        let stored = read_stored(&name, &state, &get, true)?;
        let (out, inputs) = match stored.shape[..] {
            [out, inputs] => (out, inputs),
            _ => {
                return Err(format!(
                    "`{state}`: a 4-bit weight of shape {:?}",
                    stored.shape
                ));
            }
        };
        let w = Quantized4Weight::new(stored.weight, out, inputs)?;
        let device = tensors[&name].device().clone();
        let dense =
            Tensor::from_vec(w.dequantized(), (out, inputs), &device).map_err(|e| e.to_string())?;
        tensors.retain(|n, _| !is_part_of(n, &name));
        tensors.insert(name, dense);
    }
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weight(double_quant: bool) -> (PackedWeight, Vec<f32>) {
        let spec = QuantizeSpec {
            kind: QuantType::Nf4,
            block_size: 64,
            double_quant,
        };
        let values: Vec<f32> = (0..24 * 128).map(|i| ((i as f32) * 0.37).sin()).collect();
        let w = PackedWeight::blank("w", 24, 128, spec).unwrap();
        w.fill(&values).unwrap();
        (w, values)
    }

    /// What a job's final weights hold of a 4-bit weight (bitsandbytes' tensors) reads back
    /// as the same codes and scales, and de-quantises to its values within the type's step.
    #[test]
    fn saved_weights_read_back_the_same_and_dequantize() {
        for nested in [false, true] {
            let (w, values) = weight(nested);
            let saved: std::collections::HashMap<String, Tensor> =
                w.saved("w", &Device::Cpu).unwrap().into_iter().collect();
            let state = state_name("w", saved.keys()).unwrap().clone();
            assert_eq!(state, "w.quant_state.bitsandbytes__nf4");
            assert!(
                saved.keys().all(|n| is_part_of(n, "w")),
                "{:?}",
                saved.keys()
            );
            let again = PackedWeight::blank("w", 24, 128, w.spec).unwrap();
            let get = |n: &str| saved.get(n).cloned().ok_or(n.to_string());
            again.fill_saved("w", &state, &get).unwrap();
            assert!(again.get().unwrap().stored() == w.get().unwrap().stored());
            let dense = dequantize_saved(saved).unwrap();
            let dense: Vec<f32> = dense["w"].flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(dense, w.get().unwrap().dequantized());
            let worst = dense.iter().zip(&values).map(|(a, b)| (a - b).abs());
            assert!(worst.fold(0f32, f32::max) < 0.2, "nested {nested}");
        }
    }

    /// A saved weight of another format or shape is refused with what to set.
    #[test]
    fn saved_weights_of_another_format_are_refused() {
        let (w, _) = weight(true);
        let saved: std::collections::HashMap<String, Tensor> =
            w.saved("w", &Device::Cpu).unwrap().into_iter().collect();
        let get = |n: &str| saved.get(n).cloned().ok_or(n.to_string());
        let state = "w.quant_state.bitsandbytes__nf4";
        let plain = QuantizeSpec {
            double_quant: false,
            ..w.spec
        };
        let err = PackedWeight::blank("w", 24, 128, plain)
            .unwrap()
            .fill_saved("w", state, &get)
            .unwrap_err();
        assert!(
            err.contains("set [model.quantize] as it was saved"),
            "{err}"
        );
        let err = PackedWeight::blank("w", 12, 256, w.spec)
            .unwrap()
            .fill_saved("w", state, &get)
            .unwrap_err();
        assert!(err.contains("the model expects [12, 256]"), "{err}");
        let err = PackedWeight::blank("w", 24, 100, w.spec).unwrap_err();
        assert!(err.contains("not a multiple of it"), "{err}");
    }
}
