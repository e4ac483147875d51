//! Checkpoints of jobs with frozen parameters (LoRA, `model.freeze`) hold only what trains:
//! the frozen parameters are the base the model is built from (`model.init_from`, or the
//! seed's draw), hundreds of MB a checkpoint would otherwise copy each time. What the
//! checkpoint keeps of them instead is a SHA-256 fingerprint of their values, so a resume (or
//! `sample`/`eval`/`export` of that checkpoint) over a base that changed is refused instead of
//! silently training adapters over other weights.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Tensor};
use sha2::{Digest, Sha256};

use crate::jobdir::hex;
use ddpjob_seam::Params;

/// SHA-256 over the frozen parameters, in order: each one's name, then its values as f32
/// little-endian; then each 4-bit weight's name, codes and block scales. `None` when nothing
/// is frozen.
pub fn fingerprint(params: &Params) -> candle_core::Result<Option<String>> {
    let mut hasher = Sha256::new();
    let mut any = false;
    for (i, (name, var)) in params.iter().enumerate() {
        if !params.is_frozen(i) {
            continue;
        }
        any = true;
        hasher.update(name.as_bytes());
        let values = var.as_tensor().to_dtype(DType::F32)?.flatten_all()?;
        // Little-endian in memory: ddpjob's wire formats build only there (see `comm::ring`).
        hasher.update(bytemuck::cast_slice::<f32, u8>(&values.to_vec1::<f32>()?));
    }
    // The 4-bit base (`[model.quantize]`): its codes and block scales.
    for (name, packed) in params.packed() {
        let Some(weight) = packed.get() else {
            candle_core::bail!("the 4-bit weight `{name}` was never loaded");
        };
        any = true;
        hasher.update(name.as_bytes());
        hasher.update(&weight.stored().codes);
        hasher.update(bytemuck::cast_slice::<f32, u8>(weight.scales()));
    }
    Ok(any.then(|| hex(&hasher.finalize())))
}

/// What a checkpoint of `params` holds: their named tensors (buffers and aliases included)
/// but the frozen parameters, their aliases and the 4-bit base.
pub fn checkpointed(params: &Params) -> HashMap<String, Tensor> {
    let mut tensors = params.parameter_tensors();
    for (i, (name, _)) in params.iter().enumerate() {
        if params.is_frozen(i) {
            tensors.remove(name);
        }
    }
    for (alias, name) in params.aliases() {
        if !tensors.contains_key(name) {
            tensors.remove(alias);
        }
    }
    tensors
}

/// The base fingerprint of the checkpoint whose weights are `weights` (its
/// `model.safetensors`), when it holds only what trains; `None` for a whole model (a job's
/// final weights, a checkpoint without frozen parameters or from before this format).
pub fn of_weights(weights: &Path) -> Option<String> {
    let dir = weights.parent()?;
    super::read_position(dir).ok()?.base_sha256
}

/// Puts `saved` (a checkpoint's tensors) into `params`: every parameter and buffer, or when
/// the checkpoint holds only what trains (`base` is its fingerprint), every one but the frozen
/// ones, which must then be the base it was written over. `Err` says what does not fit.
pub fn set_from(
    params: &Params,
    saved: &HashMap<String, Tensor>,
    base: Option<&str>,
) -> Result<(), String> {
    let mut expected = 0;
    for (i, (name, var)) in params.iter().enumerate() {
        if base.is_some() && params.is_frozen(i) {
            continue;
        }
        expected += 1;
        set_one(name, var, saved)?;
    }
    for (name, var) in params.buffers() {
        expected += 1;
        set_one(name, var, saved)?;
    }
    if base.is_none() {
        // A whole model's file holds its 4-bit base as bitsandbytes saves it.
        for (name, packed) in params.packed() {
            let state = ddpjob_seam::packed::state_name(name, saved.keys())
                .ok_or_else(|| format!("it has no 4-bit weight `{name}` (bitsandbytes' state)"))?;
            let get = |n: &str| {
                saved
                    .get(n)
                    .cloned()
                    .ok_or_else(|| format!("no tensor `{n}`"))
            };
            packed
                .fill_saved(name, state, &get)
                .map_err(|e| format!("`{name}`: {e}"))?;
            expected += saved
                .keys()
                .filter(|n| ddpjob_seam::packed::is_part_of(n, name))
                .count();
        }
    }
    let aliases = params.aliases().filter(|(_, n)| saved.contains_key(*n));
    expected += aliases.count();
    if saved.len() != expected {
        return Err(format!(
            "it has {} tensors, this model {expected}",
            saved.len()
        ));
    }
    let Some(then) = base else { return Ok(()) };
    let now = fingerprint(params).map_err(|e| e.to_string())?;
    match now.as_deref() {
        Some(now) if now == then => Ok(()),
        now => Err(format!(
            "it holds only the trainable parameters, trained over frozen (base) weights of \
             SHA-256 {then}, but this model's frozen weights are {}: the base changed since \
             (model.init_from's files, or model.freeze / [model.lora]); put the original \
             base back, or start a new job",
            now.unwrap_or("none")
        )),
    }
}

fn set_one(
    name: &str,
    var: &candle_core::Var,
    saved: &HashMap<String, Tensor>,
) -> Result<(), String> {
    let tensor = saved
        .get(name)
        .ok_or_else(|| format!("it has no parameter or buffer `{name}`"))?;
    ddpjob_seam::set_parameter(name, var, tensor)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    fn params(values: [f32; 2]) -> Params {
        let var = |v: f32| Var::from_tensor(&Tensor::new(&[v, v], &Device::Cpu).unwrap()).unwrap();
        let mut p = Params::from_vars(vec![
            ("base.weight".into(), var(values[0])),
            ("adapter.weight".into(), var(values[1])),
        ]);
        p.tie("alias.weight", "base.weight");
        p
    }

    #[test]
    fn a_checkpoint_of_what_trains_goes_back_over_the_same_base_only() {
        let trained = params([1.0, 2.0]);
        assert_eq!(fingerprint(&trained).unwrap(), None, "nothing frozen");
        assert_eq!(checkpointed(&trained).len(), 3);
        trained.freeze(&["base".into()]).unwrap();
        let sha = fingerprint(&trained).unwrap().unwrap();
        let saved = checkpointed(&trained);
        let names: std::collections::BTreeSet<&str> = saved.keys().map(String::as_str).collect();
        assert_eq!(names, ["adapter.weight"].into());

        // The same base: the adapter comes back.
        let fresh = params([1.0, 0.0]);
        fresh.freeze(&["base".into()]).unwrap();
        set_from(&fresh, &saved, Some(&sha)).unwrap();
        let adapter = fresh.iter().nth(1).unwrap().1.as_tensor().to_vec1::<f32>();
        assert_eq!(adapter.unwrap(), [2.0, 2.0]);

        // Another base: refused, saying so.
        let other = params([1.5, 0.0]);
        other.freeze(&["base".into()]).unwrap();
        let err = set_from(&other, &saved, Some(&sha)).unwrap_err();
        assert!(err.contains("the base changed"), "{err}");
        // A whole model needs every tensor.
        let err = set_from(&fresh, &saved, None).unwrap_err();
        assert!(
            err.contains("no parameter or buffer `base.weight`"),
            "{err}"
        );
    }
}
