//! GPT-2 in the Hugging Face layout (`model_type = "gpt2"`), in and out: `config.json` read
//! into a `gpt`'s shape, the weights loaded into one (`Conv1D` weights are stored `[in, out]`,
//! the transpose of a `Linear`'s; the position table is cropped to `block_size`, as nanoGPT's
//! `crop_block_size`; files saved from `GPT2Model` name tensors without `transformer.`), and a
//! `gpt` job written back as a `GPT2LMHeadModel` checkpoint.

use std::collections::{HashMap, HashSet};

use candle_core::{DType, Tensor};
use serde_json::{Map, Value, json};

use super::Activation;
use ddpjob_storage::hf::{FileLayout, HfDir, HfError, HfParts};

/// A GPT-2 checkpoint's shape, from its `config.json`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpt2Shape {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// `n_positions`: the longest context it was trained for.
    pub n_positions: usize,
    pub vocab_size: usize,
    pub activation: Activation,
    /// Biases in the linear and norm layers (GPT-2 always has them).
    pub bias: bool,
}

/// The `Conv1D` layers, whose weights GPT-2 stores transposed.
const CONV1D: [&str; 4] = [
    ".attn.c_attn.weight",
    ".attn.c_proj.weight",
    ".mlp.c_fc.weight",
    ".mlp.c_proj.weight",
];

/// The shape `dir`'s `config.json` describes; a field ddpjob's `gpt` does not implement
/// (another `model_type`, an unknown activation, a LayerNorm epsilon other than 1e-5, scaled
/// or unscaled attention variants) is an error naming it.
pub fn read_shape(dir: &HfDir) -> Result<Gpt2Shape, HfError> {
    let model_type = dir.model_type()?;
    let file = dir.root.join("config.json");
    let unsupported = |what: String| {
        HfError::Invalid(format!(
            "`{}`: {what}, which model.arch = \"gpt\" does not implement",
            file.display()
        ))
    };
    if model_type != "gpt2" {
        return Err(HfError::Invalid(format!(
            "`{}` holds a \"{model_type}\" model; model.arch = \"gpt\" reads \"gpt2\" \
             checkpoints (and model.arch = \"llama\" reads \"llama\", \"mistral\", \"qwen2\")",
            dir.root.display()
        )));
    }
    let activation = match dir.str_or("activation_function", "gelu_new")? {
        "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluNew,
        "gelu" => Activation::Gelu,
        other => return Err(unsupported(format!("activation_function \"{other}\""))),
    };
    let eps = dir.f64_or("layer_norm_epsilon", 1e-5)?;
    if (eps - 1e-5).abs() > 1e-12 {
        return Err(unsupported(format!(
            "layer_norm_epsilon {eps} (ddpjob uses 1e-5)"
        )));
    }
    let n_embd = dir.usize_or("n_embd", None)?;
    let inner = dir.usize_or("n_inner", Some(4 * n_embd))?;
    if inner != 4 * n_embd {
        return Err(unsupported(format!("n_inner {inner} (not 4 × n_embd)")));
    }
    for (key, expected) in [
        ("scale_attn_weights", true),
        ("scale_attn_by_inverse_layer_idx", false),
        ("add_cross_attention", false),
    ] {
        if dir.bool_or(key, expected)? != expected {
            return Err(unsupported(format!("{key} = {}", !expected)));
        }
    }
    let n_positions = dir.usize_or("n_positions", None).or_else(|e| {
        // Older configs name the context `n_ctx` only.
        dir.usize_or("n_ctx", None).map_err(|_| e)
    })?;
    Ok(Gpt2Shape {
        n_layer: dir.usize_or("n_layer", None)?,
        n_head: dir.usize_or("n_head", None)?,
        n_embd,
        n_positions,
        vocab_size: dir.usize_or("vocab_size", None)?,
        activation,
        bias: true,
    })
}

/// Where GPT-2's files hold each parameter, and how (see the module docs): what
/// `build_gpt`'s [`crate::kit::Reading`] reads a Hugging Face directory with.
pub(crate) struct Gpt2Layout;

impl FileLayout for Gpt2Layout {
    fn file_name(&self, name: &str, present: &HashSet<String>) -> Option<String> {
        if present.contains(name) {
            return Some(name.to_string());
        }
        let bare = name.strip_prefix("transformer.")?;
        present.contains(bare).then(|| bare.to_string())
    }

    fn to_model(&self, name: &str, stored: Tensor, dims: &[usize]) -> candle_core::Result<Tensor> {
        if CONV1D.iter().any(|suffix| name.ends_with(suffix)) {
            // Checked, not loaded: the transposed shape alone, no copy of a header's zeros.
            return match ddpjob_storage::hf::is_checking() {
                true => stored.t(),
                false => stored.t()?.contiguous(),
            };
        }
        if name.ends_with("wpe.weight") && stored.dims().first() > dims.first() {
            return stored.narrow(0, 0, dims[0]);
        }
        Ok(stored)
    }

    /// The causal-mask buffers older files carry.
    fn ignored(&self, file_name: &str) -> bool {
        file_name.ends_with(".attn.bias") || file_name.ends_with(".attn.masked_bias")
    }
}

/// What a `gpt` job's export needs of its model, besides the weights.
pub struct Gpt2Export {
    pub n_head: usize,
    pub block_size: usize,
    pub dropout: f64,
    pub activation: Activation,
}

/// `config.json` and tensors of a `GPT2LMHeadModel` holding `tensors` (a `gpt`'s, named as
/// trained): `Conv1D` weights transposed, the tied head left out, and the zero biases a
/// `bias = false` model does without written out (GPT-2 always has them).
pub fn hf_parts(
    export: &Gpt2Export,
    mut tensors: HashMap<String, Tensor>,
) -> Result<HfParts, String> {
    let missing = |name: &str| format!("the weights have no `{name}`: not a gpt job's");
    let wte = tensors
        .get("transformer.wte.weight")
        .ok_or_else(|| missing("transformer.wte.weight"))?;
    let (vocab_size, n_embd) = wte.dims2().map_err(|e| e.to_string())?;
    let device = wte.device().clone();
    let n_layer = (0..)
        .take_while(|i| tensors.contains_key(&format!("transformer.h.{i}.ln_1.weight")))
        .count();
    tensors.remove("lm_head.weight");
    let zeros = |size: usize| Tensor::zeros(size, DType::F32, &device).map_err(|e| e.to_string());
    let mut biases = vec![("transformer.ln_f.bias".to_string(), n_embd)];
    for i in 0..n_layer {
        let p = format!("transformer.h.{i}");
        biases.extend([
            (format!("{p}.ln_1.bias"), n_embd),
            (format!("{p}.attn.c_attn.bias"), 3 * n_embd),
            (format!("{p}.attn.c_proj.bias"), n_embd),
            (format!("{p}.ln_2.bias"), n_embd),
            (format!("{p}.mlp.c_fc.bias"), 4 * n_embd),
            (format!("{p}.mlp.c_proj.bias"), n_embd),
        ]);
    }
    for (name, size) in biases {
        if let std::collections::hash_map::Entry::Vacant(slot) = tensors.entry(name) {
            slot.insert(zeros(size)?);
        }
    }
    for (name, t) in tensors.iter_mut() {
        if CONV1D.iter().any(|suffix| name.ends_with(suffix)) {
            *t = t
                .t()
                .and_then(|t| t.contiguous())
                .map_err(|e| e.to_string())?;
        }
    }
    // GPT-2's end-of-text id, where the vocabulary is GPT-2's.
    let eos = if vocab_size > 50_256 {
        json!(50_256)
    } else {
        Value::Null
    };
    let mut config = Map::new();
    for (key, value) in [
        ("architectures", json!(["GPT2LMHeadModel"])),
        ("model_type", json!("gpt2")),
        ("vocab_size", json!(vocab_size)),
        ("n_positions", json!(export.block_size)),
        ("n_embd", json!(n_embd)),
        ("n_layer", json!(n_layer)),
        ("n_head", json!(export.n_head)),
        ("n_inner", Value::Null),
        ("activation_function", json!(export.activation.name())),
        ("resid_pdrop", json!(export.dropout)),
        ("embd_pdrop", json!(export.dropout)),
        // ddpjob's gpt does not drop attention probabilities.
        ("attn_pdrop", json!(0.0)),
        ("layer_norm_epsilon", json!(1e-5)),
        ("initializer_range", json!(0.02)),
        ("scale_attn_weights", json!(true)),
        ("tie_word_embeddings", json!(true)),
        ("use_cache", json!(true)),
        ("bos_token_id", eos.clone()),
        ("eos_token_id", eos),
    ] {
        config.insert(key.into(), value);
    }
    Ok((config, tensors))
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::{Gpt, GptConfig, Mode, Model};
    use ddpjob_storage::hf::ExportDtype;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/hf")
            .join(name)
    }

    /// A gpt of the shape `dir`'s config.json describes, its window `block_size`.
    fn shaped_as(hf: &HfDir, block_size: usize) -> Gpt {
        let s = read_shape(hf).unwrap();
        let config = GptConfig {
            vocab_size: s.vocab_size,
            block_size,
            n_layer: s.n_layer,
            n_head: s.n_head,
            n_embd: s.n_embd,
            dropout: 0.0,
            bias: true,
            activation: s.activation,
        };
        Gpt::for_loading(&config, &Device::Cpu, DType::F32).unwrap()
    }

    /// The gpt `dir` describes, its window cut to `block_size`, with the weights loaded.
    fn pretrained(dir: &Path, block_size: usize) -> Gpt {
        let hf = HfDir::open(dir).unwrap();
        let gpt = shaped_as(&hf, block_size);
        hf.load_with(gpt.params(), &Gpt2Layout).unwrap();
        gpt
    }

    use crate::testing::max_difference as max_abs_diff;

    #[test]
    fn logits_and_loss_equal_transformers_whichever_way_the_file_names_tensors() {
        let r = candle_core::safetensors::load(
            fixture("gpt2").join("reference.safetensors"),
            &Device::Cpu,
        )
        .unwrap();
        let ids = |k: &str| r[k].to_dtype(DType::U32).unwrap();
        let (x, y, loss) = (
            ids("input_ids"),
            ids("targets"),
            r["loss"].to_vec1::<f32>().unwrap()[0],
        );
        for name in ["gpt2", "gpt2-hub"] {
            let gpt = pretrained(&fixture(name), 64);
            assert_eq!(gpt.config().activation, Activation::GeluNew);
            let logits = gpt.forward(&x, &Mode::Eval).unwrap();
            let diff = max_abs_diff(&logits, &r["logits"]);
            assert!(diff < 1e-4, "{name}: logits differ by {diff}");
            let mean = gpt
                .loss(&x, &y, &Mode::Eval)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!((mean - loss).abs() < 1e-4, "{name}: loss {mean} vs {loss}");
            let (sum, _) = gpt.score(&x, &y).unwrap();
            let per_token = sum / y.elem_count() as f64;
            assert!(
                (per_token - loss as f64).abs() < 1e-4,
                "{name}: score {per_token}"
            );
        }
        // A 12-token window: the position table is cropped, the logits are the same.
        let short = pretrained(&fixture("gpt2"), 12);
        let diff = max_abs_diff(&short.forward(&x, &Mode::Eval).unwrap(), &r["logits"]);
        assert!(diff < 1e-4, "cropped window: logits differ by {diff}");
    }

    #[test]
    fn export_then_load_is_lossless_with_and_without_biases() {
        let tmp = tempfile::tempdir().unwrap();
        for bias in [true, false] {
            let config = GptConfig {
                vocab_size: 40,
                block_size: 16,
                n_layer: 2,
                n_head: 2,
                n_embd: 8,
                dropout: 0.1,
                bias,
                activation: Activation::Gelu,
            };
            let gpt = Gpt::new(&config, 3, &Device::Cpu, DType::F32).unwrap();
            let tensors = gpt
                .params()
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_tensor().clone()))
                .chain(std::iter::once((
                    "lm_head.weight".to_string(),
                    gpt.wte.as_tensor().clone(),
                )))
                .collect();
            let export = Gpt2Export {
                n_head: 2,
                block_size: 16,
                dropout: 0.1,
                activation: Activation::Gelu,
            };
            let (json, tensors) = hf_parts(&export, tensors).unwrap();
            assert!(!tensors.contains_key("lm_head.weight"));
            assert_eq!(
                tensors["transformer.h.1.attn.c_attn.weight"].dims(),
                [8, 24]
            );
            let dir = tmp.path().join(format!("bias-{bias}"));
            ddpjob_storage::hf::export(&dir, json, tensors, &[], ExportDtype::F32, false).unwrap();
            let back = pretrained(&dir, 16);
            let shape = read_shape(&HfDir::open(&dir).unwrap()).unwrap();
            assert_eq!(
                (shape.n_positions, shape.activation),
                (16, Activation::Gelu)
            );
            let x = Tensor::new(&[[1u32, 5, 9, 39, 0, 2]], &Device::Cpu).unwrap();
            let (a, b) = (
                gpt.forward(&x, &Mode::Eval).unwrap(),
                back.forward(&x, &Mode::Eval).unwrap(),
            );
            assert_eq!(max_abs_diff(&a, &b), 0.0, "bias {bias}");
            if bias {
                for ((name, v), (_, w)) in gpt.params().iter().zip(back.params().iter()) {
                    assert_eq!(max_abs_diff(v.as_tensor(), w.as_tensor()), 0.0, "{name}");
                }
            }
        }
    }

    #[test]
    fn unsupported_gpt2_variants_are_named() {
        let tmp = tempfile::tempdir().unwrap();
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture("gpt2").join(file), tmp.path().join(file)).unwrap();
        }
        let config = std::fs::read_to_string(fixture("gpt2").join("config.json")).unwrap();
        let edit = |from: &str, to: &str| {
            assert!(config.contains(from), "{from}");
            std::fs::write(tmp.path().join("config.json"), config.replace(from, to)).unwrap();
            read_shape(&HfDir::open(tmp.path()).unwrap())
                .unwrap_err()
                .to_string()
        };
        let err = edit("\"gelu_new\"", "\"relu\"");
        assert!(err.contains("activation_function \"relu\""), "{err}");
        let err = edit("\"n_inner\": null", "\"n_inner\": 100");
        assert!(err.contains("n_inner 100"), "{err}");
        let err = edit(
            "\"scale_attn_by_inverse_layer_idx\": false",
            "\"scale_attn_by_inverse_layer_idx\": true",
        );
        assert!(
            err.contains("scale_attn_by_inverse_layer_idx = true"),
            "{err}"
        );
        let err = edit("\"model_type\": \"gpt2\"", "\"model_type\": \"gpt_neox\"");
        assert!(
            err.contains("\"gpt_neox\"") && err.contains("\"gpt2\""),
            "{err}"
        );
        // Weights of another size.
        let err = {
            std::fs::write(
                tmp.path().join("config.json"),
                config.replace("\"n_embd\": 32", "\"n_embd\": 16"),
            )
            .unwrap();
            let hf = HfDir::open(tmp.path()).unwrap();
            let gpt = shaped_as(&hf, 64);
            hf.load_with(gpt.params(), &Gpt2Layout)
                .unwrap_err()
                .to_string()
        };
        assert!(
            err.contains(
                "`transformer.wte.weight` has shape [320, 32], the model expects [320, 16]"
            ),
            "{err}"
        );
    }
}
