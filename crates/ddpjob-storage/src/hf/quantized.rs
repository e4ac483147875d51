//! A 4-bit base from a Hugging Face directory (`[model.quantize]`, QLoRA): each quantised layer
//! filled from the f32 (or bf16) weight the directory holds, quantised as bitsandbytes would,
//! or from the codes bitsandbytes itself saved (`transformers` + `BitsAndBytesConfig`'s
//! `save_pretrained`: `<name>` as uint8, `.absmax`, `.quant_map`, `.nested_absmax`,
//! `.nested_quant_map` and `.quant_state.bitsandbytes__<type>`, a JSON of the rest). Models
//! quantised by other methods (GPTQ, AWQ, ...) are refused by name.

use std::collections::HashSet;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde_json::{Map, Value};

use super::{FileLayout, HfDir, HfError, is_checking};
use ddpjob_seam::Params;
use ddpjob_seam::packed;

/// An error unless `config`'s `quantization_config` (if any) is bitsandbytes' 4-bit.
pub(super) fn refuse_foreign(
    root: &std::path::Path,
    config: &Map<String, Value>,
) -> Result<(), HfError> {
    let Some(q) = config.get("quantization_config") else {
        return Ok(());
    };
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("unknown");
    let eight = q.get("load_in_8bit").and_then(Value::as_bool) == Some(true);
    if method == "bitsandbytes" && !eight {
        return Ok(());
    }
    let what = match eight {
        true => "bitsandbytes' 8-bit (LLM.int8)".to_string(),
        false => format!("\"{method}\""),
    };
    Err(HfError::Invalid(format!(
        "`{}` holds a model quantised by {what} (its config.json's quantization_config): ddpjob \
         reads f32/bf16 weights and bitsandbytes' 4-bit ones only; use the model's \
         unquantised checkpoint (and [model.quantize] bits = 4 for a 4-bit base)",
        root.join("config.json").display()
    )))
}

/// The name of bitsandbytes' 4-bit state beside `file_name`, if the file holds it that way.
fn stored_state(file_name: &str, present: &HashSet<String>) -> Option<String> {
    packed::state_name(file_name, present.iter()).cloned()
}

/// The fix for a directory saved in 4 bits read by a job without `[model.quantize]`.
pub(super) fn saved_in_four_bits(
    dir: &HfDir,
    file_name: &str,
    present: &HashSet<String>,
) -> Option<HfError> {
    let state = stored_state(file_name, present)?;
    let kind = state.rsplit("__").next().unwrap_or("nf4");
    Some(HfError::Invalid(format!(
        "`{}` is saved in 4 bits by bitsandbytes (`{state}`): add [model.quantize] bits = 4, \
         type = \"{kind}\" (as its config.json's quantization_config says) to train LoRA \
         over it, or load its unquantised checkpoint",
        dir.root.display()
    )))
}

impl HfDir {
    /// Fills every 4-bit weight of `params`, marking the file's tensors it used.
    pub(super) fn fill_packed(
        &self,
        present: &HashSet<String>,
        load: &dyn Fn(&str) -> candle_core::Result<Tensor>,
        params: &Params,
        layout: &dyn FileLayout,
        used: &mut HashSet<String>,
    ) -> Result<(), HfError> {
        let weights = |cause| HfError::Weights {
            path: self.root.clone(),
            cause,
        };
        // bitsandbytes' saved state, read for real even while checking (it is small and says
        // whether it fits `[model.quantize]`): the files mapped once, when first needed.
        let files = std::cell::OnceCell::new();
        let saved = |name: &str| -> Result<Tensor, String> {
            let files = match files.get() {
                Some(files) => files,
                None => {
                    // SAFETY: read-only mapping, read while it lives (as in `HfDir::load_with`).
                    let mapped = unsafe { MmapedSafetensors::multi(&self.weight_files) }
                        .map_err(|e| format!("cannot read `{}`: {e}", self.root.display()))?;
                    files.get_or_init(|| mapped)
                }
            };
            files
                .load(name, &Device::Cpu)
                .map_err(|e| format!("cannot read `{name}`: {e}"))
        };
        for (name, packed) in params.packed() {
            let Some(file_name) = layout.file_name(name, present) else {
                return Err(self.missing(name));
            };
            if let Some(state) = stored_state(&file_name, present) {
                let bad = |what: String| self.packed_error(&file_name, what);
                let codes = !is_checking();
                let stored = packed::read_stored(&file_name, &state, &saved, codes).map_err(bad)?;
                packed.check_saved(&stored).map_err(bad)?;
                used.extend(
                    present
                        .iter()
                        .filter(|n| packed::is_part_of(n, &file_name))
                        .cloned(),
                );
                if codes {
                    packed.fill_stored(stored.weight).map_err(bad)?;
                }
                continue;
            }
            let dims = [packed.out, packed.inputs];
            let tensor = self.read_as(name, &file_name, &dims, load, layout)?;
            if !is_checking() {
                let values = tensor.to_dtype(DType::F32).and_then(|t| t.flatten_all());
                let values = values.and_then(|t| t.to_vec1::<f32>()).map_err(weights)?;
                packed
                    .fill(&values)
                    .map_err(|e| self.packed_error(name, e))?;
            }
            used.insert(file_name);
        }
        Ok(())
    }

    fn packed_error(&self, name: &str, problem: String) -> HfError {
        HfError::Invalid(format!("`{}`: `{name}`: {problem}", self.root.display()))
    }
}
