//! A 4-bit weight as bitsandbytes saves it (transformers' `save_pretrained` of a model loaded
//! with `BitsAndBytesConfig(load_in_4bit = True)`): `<name>` uint8 [n/2, 1] (two codes a byte,
//! the first in the high nibble), `.absmax` (f32, or with double quantisation the 8-bit codes
//! of the absmaxes), `.quant_map` (the 16 levels), `.nested_absmax` and `.nested_quant_map`
//! (double quantisation), and `.quant_state.bitsandbytes__<type>`, a JSON of the rest (type,
//! block size, shape, the nested block size and offset). Written for a job's final weights,
//! read back from them and from a checkpoint bitsandbytes saved.

use candle_core::{Device, Result, Tensor};

use super::{FourBit, PackedWeight, Quantized4, Quantized4Weight, Scales, four_bit};

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
            || q.is_nested() != spec.double_quant
        {
            let kind = if q.kind == FourBit::Nf4 { "nf4" } else { "fp4" };
            return Err(format!(
                "saved by bitsandbytes as type = \"{kind}\", block_size = {}, double_quant = {}, \
                 but [model.quantize] says type = \"{}\", block_size = {}, double_quant = {}: \
                 set [model.quantize] as it was saved",
                q.blocksize,
                q.is_nested(),
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
