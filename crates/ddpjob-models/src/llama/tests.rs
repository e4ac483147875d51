use std::path::PathBuf;

use candle_core::{DType, Device, Tensor, Var};

use super::options::{LlamaOptions, build_llama};
use super::{repeat_kv, rms_norm};
use crate::LanguageModelOptions;
use crate::testing::max_difference as max_abs_diff;
use crate::{Mode, Model};
use ddpjob_seam::ModelContext;
use ddpjob_seam::task::ModelInput;

pub(super) fn fixture(name: &str) -> PathBuf {
    let built_in = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf");
    // A test binary carried to another machine (the GPU check) runs from the repository root.
    let root = match built_in.exists() {
        true => built_in,
        false => PathBuf::from("tests/fixtures/hf"),
    };
    root.join(name)
}

pub(super) fn options_from(name: &str) -> LlamaOptions {
    let dir = fixture(name).display().to_string();
    LlamaOptions {
        init_from: Some(dir),
        ..LlamaOptions::default()
    }
    .complete()
    .unwrap()
}

pub(super) fn context(vocab_size: usize, block_size: usize, dtype: DType) -> ModelContext {
    ModelContext {
        input: ModelInput::Tokens {
            vocab_size,
            block_size,
        },
        seed: 1,
        device: Device::Cpu,
        compute_dtype: dtype,
        restoring: false,
        lora: None,
        quantize: None,
    }
}

pub(super) fn pretrained(name: &str) -> Box<dyn Model> {
    let o = options_from(name);
    build_llama(&o, &context(320, o.block_size(), DType::F32)).unwrap()
}

/// `transformers`' inputs, targets, logits and loss for a fixture (see make_fixtures.py).
pub(super) fn reference(name: &str) -> (Tensor, Tensor, Tensor, f32) {
    let path = fixture(name).join("reference.safetensors");
    let r = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let ids = |k: &str| r[k].to_dtype(DType::U32).unwrap();
    let loss = r["loss"].to_vec1::<f32>().unwrap()[0];
    (ids("input_ids"), ids("targets"), r["logits"].clone(), loss)
}

#[test]
fn logits_and_loss_equal_transformers_for_every_model_type() {
    // llama: rope_scaling llama3, untied head; llama-v4: the same in transformers 4.x's
    // config layout; qwen2: q/k/v biases, tied head, rope_theta 1e6; mistral; qwen3: each
    // head's q and k RMS-normed (weights drawn away from 1), head_dim 16 of hidden 32 / 4 heads;
    // smollm3: layers 2 and 4 of 4 without positions, attention biases, untied head;
    // mistral-sw: a sliding window of 4 over the reference's 12 positions; qwen3-moe, mixtral,
    // olmoe: mixtures of experts (see make_fixtures_2026.py).
    for name in [
        "llama",
        "llama-v4",
        "qwen2",
        "mistral",
        "qwen3",
        "smollm3",
        "mistral-sw",
        "qwen3-moe",
        "mixtral",
        "olmoe",
        "gemma3",
        "gemma3-v4",
    ] {
        let reference_name = match name {
            "llama-v4" => "llama",
            "gemma3-v4" => "gemma3",
            _ => name,
        };
        let (x, y, logits, loss) = reference(reference_name);
        let model = pretrained(name);
        let ours = model.forward(&x, &Mode::Eval).unwrap();
        let diff = max_abs_diff(&ours, &logits);
        assert!(diff < 1e-4, "{name}: logits differ by {diff}");
        let mean = model.loss(&x, &y, &Mode::Eval).unwrap();
        let mean = mean.to_scalar::<f32>().unwrap();
        assert!((mean - loss).abs() < 1e-4, "{name}: loss {mean} vs {loss}");
        let (sum, _) = model.score(&x, &y).unwrap();
        let per_token = sum / y.elem_count() as f64;
        assert!(
            (per_token - loss as f64).abs() < 1e-4,
            "{name}: score {per_token}"
        );
    }
}

/// Runs where a GPU is: every model type's loss on the GPU (its own attention path, RoPE,
/// SwiGLU, residual and cross-entropy kernels) is transformers' in f32 and close to it in
/// bf16, and every parameter's gradient is the CPU's.
#[test]
fn the_gpu_llama_gives_transformers_loss_and_the_cpus_gradients() {
    let Ok(gpu) = Device::new_cuda(0) else {
        eprintln!("skipping: no GPU");
        return;
    };
    for name in [
        "llama",
        "qwen2",
        "mistral",
        "qwen3",
        "smollm3",
        "mistral-sw",
    ] {
        let (x, y, _, loss) = reference(name);
        let o = options_from(name);
        let run = |device: &Device, dtype: DType| {
            let mut c = context(320, o.block_size(), dtype);
            c.device = device.clone();
            let model = build_llama(&o, &c).unwrap();
            let (x, y) = (x.to_device(device).unwrap(), y.to_device(device).unwrap());
            let mean = model.loss(&x, &y, &Mode::Eval).unwrap();
            let grads = mean.backward().unwrap();
            let grads: Vec<(String, Tensor)> = model
                .params()
                .iter()
                .map(|(n, v)| {
                    let g = grads
                        .get(v)
                        .unwrap_or_else(|| panic!("{name}: no gradient of {n}"));
                    let g = g
                        .to_dtype(DType::F32)
                        .unwrap()
                        .to_device(&Device::Cpu)
                        .unwrap();
                    (n.to_string(), g)
                })
                .collect();
            let mean = mean
                .to_dtype(DType::F32)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            (mean, grads)
        };
        let (cpu_loss, cpu_grads) = run(&Device::Cpu, DType::F32);
        let (gpu_loss, gpu_grads) = run(&gpu, DType::F32);
        assert!(
            (gpu_loss - loss).abs() < 1e-4,
            "{name}: GPU loss {gpu_loss} vs {loss}"
        );
        assert!(
            (cpu_loss - loss).abs() < 1e-4,
            "{name}: CPU loss {cpu_loss} vs {loss}"
        );
        for ((n, a), (_, b)) in cpu_grads.iter().zip(&gpu_grads) {
            let scale = a
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let diff = max_abs_diff(a, b);
            assert!(
                diff <= 1e-3 * scale.max(1e-3),
                "{name}: {n}'s gradient differs by {diff} (of {scale})"
            );
        }
        let (bf16_loss, _) = run(&gpu, DType::BF16);
        assert!(
            (bf16_loss - loss).abs() < 3e-2 * loss.abs(),
            "{name}: bf16 loss {bf16_loss} vs {loss}"
        );
    }
}

#[test]
fn sizes_come_from_config_json_and_a_restated_size_must_agree() {
    let o = options_from("qwen2");
    assert_eq!(o.model_type.as_deref(), Some("qwen2"));
    assert_eq!((o.hidden_size, o.num_key_value_heads), (Some(32), Some(2)));
    assert_eq!(
        o.block_size,
        Some(64),
        "the default window is max_position_embeddings"
    );
    assert_eq!(o.tie_word_embeddings, Some(true));
    let restated = LlamaOptions {
        init_from: Some(fixture("qwen2").display().to_string()),
        hidden_size: Some(64),
        ..LlamaOptions::default()
    };
    let err = restated.complete().unwrap_err();
    assert!(
        err.contains("model.hidden_size = 64") && err.contains("32"),
        "{err}"
    );
    let too_long = LlamaOptions {
        init_from: Some(fixture("llama").display().to_string()),
        block_size: Some(65),
        ..LlamaOptions::default()
    };
    let err = too_long.complete().unwrap_err();
    assert!(
        err.contains("model.block_size = 65") && err.contains("64"),
        "{err}"
    );
}

#[test]
fn a_shorter_window_gives_the_same_logits_for_its_positions() {
    // nanoGPT's crop_block_size: a pretrained model trained on shorter windows.
    let (x, _, logits, _) = reference("llama");
    let mut o = options_from("llama");
    o.block_size = Some(12);
    let model = build_llama(&o, &context(320, 12, DType::F32)).unwrap();
    let ours = model.forward(&x, &Mode::Eval).unwrap();
    assert!(max_abs_diff(&ours, &logits) < 1e-4);
}

#[test]
fn rms_norm_by_hand() {
    // x = [1, 2, 3, 4]: mean(x²) = 7.5; x / sqrt(7.5 + 1e-5) · [1, 1, 2, 0.5]
    let x = Tensor::new(&[[1f32, 2., 3., 4.]], &Device::Cpu).unwrap();
    let w = Var::new(&[1f32, 1., 2., 0.5], &Device::Cpu).unwrap();
    let got: Vec<f32> = rms_norm(&x, &w, 1e-5)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let r = 1.0 / (7.5f32 + 1e-5).sqrt();
    let want = [r, 2. * r, 6. * r, 2. * r];
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "{got:?}");
    }
}

#[test]
fn each_key_value_head_serves_its_group_of_query_heads() {
    // 2 key/value heads of 1 channel each, 3 query heads per group: query heads 0-2 read
    // head 0, 3-5 head 1 (transformers' repeat_kv).
    let kv = Tensor::new(&[10f32, 20.], &Device::Cpu)
        .unwrap()
        .reshape((1, 1, 2, 1))
        .unwrap();
    let got: Vec<f32> = repeat_kv(&kv, 3)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(got, vec![10., 10., 10., 20., 20., 20.]);
}

#[test]
fn packed_examples_are_computed_as_if_alone() {
    crate::kit::packed::check_examples_are_computed_alone(pretrained("qwen2").as_ref());
    crate::kit::packed::check_examples_are_computed_alone(pretrained("llama").as_ref());
    crate::kit::packed::check_examples_are_computed_alone(pretrained("qwen3").as_ref());
    crate::kit::packed::check_examples_are_computed_alone(pretrained("smollm3").as_ref());
    crate::kit::packed::check_examples_are_computed_alone(pretrained("mistral-sw").as_ref());
}

#[test]
fn a_position_never_sees_later_ones() {
    let model = pretrained("mistral");
    let a = Tensor::new(&[[5u32, 17, 42, 7, 99, 3]], &Device::Cpu).unwrap();
    let b = Tensor::new(&[[5u32, 17, 42, 8, 1, 250]], &Device::Cpu).unwrap();
    let la = model
        .forward(&a, &Mode::Eval)
        .unwrap()
        .narrow(1, 0, 3)
        .unwrap();
    let lb = model
        .forward(&b, &Mode::Eval)
        .unwrap()
        .narrow(1, 0, 3)
        .unwrap();
    assert_eq!(max_abs_diff(&la, &lb), 0.0);
}

#[test]
fn bf16_computes_close_to_transformers_f32() {
    for name in ["qwen2", "qwen3"] {
        let (x, y, logits, loss) = reference(name);
        let o = options_from(name);
        let bf16 = build_llama(&o, &context(320, 64, DType::BF16)).unwrap();
        let l = bf16
            .loss(&x, &y, &Mode::Eval)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!((l - loss).abs() < 0.05, "{name}: bf16 loss {l} vs {loss}");
        let diff = max_abs_diff(&bf16.forward(&x, &Mode::Eval).unwrap(), &logits);
        assert!(diff < 0.1, "{name}: bf16 logits differ by {diff}");
    }
}

/// Qwen3's q/k norms are read and used: its checkpoint has them, a qwen3 of `head_dim` 16
/// projects q to 4 × 16 channels, and the same weights without the norms give other logits.
#[test]
fn qwen3_norms_each_head_of_q_and_k() {
    let o = options_from("qwen3");
    assert_eq!(o.model_type.as_deref(), Some("qwen3"));
    assert_eq!((o.hidden_size, o.head_dim), (Some(32), Some(16)));
    let model = pretrained("qwen3");
    let names: Vec<&str> = model.params().iter().map(|(n, _)| n).collect();
    for n in [
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
    ] {
        assert!(names.contains(&n), "{n} missing from {names:?}");
    }
    assert!(!names.iter().any(|n| n.ends_with("q_proj.bias")));
    // Read as a llama, the checkpoint's norms are tensors that model lacks: refused by name.
    let as_llama = LlamaOptions {
        model_type: Some("llama".into()),
        ..o.clone()
    };
    let cx = context(320, o.block_size(), DType::F32);
    let err = build_llama(&as_llama, &cx).err().unwrap().to_string();
    assert!(err.contains("self_attn.k_norm.weight"), "{err}");
    // The fixture's norms are not the identity: set to 1, the logits leave transformers'.
    let (x, _, logits, _) = reference("qwen3");
    for (n, v) in model.params().iter() {
        if n.ends_with("_norm.weight") && n.contains("self_attn") {
            v.set(&v.ones_like().unwrap()).unwrap();
        }
    }
    let diff = max_abs_diff(&model.forward(&x, &Mode::Eval).unwrap(), &logits);
    assert!(diff > 1e-2, "the norms changed nothing: {diff}");
}

#[test]
fn scratch_models_start_from_the_seed_and_train() {
    let o = LlamaOptions::default().complete().unwrap();
    assert_eq!(o.num_key_value_heads, Some(2));
    let cx = context(65, 16, DType::F32);
    let a = build_llama(&o, &cx).unwrap();
    let b = build_llama(&o, &cx).unwrap();
    let names: Vec<&str> = a.params().iter().map(|(n, _)| n).collect();
    assert!(
        names.contains(&"model.layers.3.mlp.gate_proj.weight"),
        "{names:?}"
    );
    assert_eq!(
        a.params().aliases().next(),
        Some(("lm_head.weight", "model.embed_tokens.weight"))
    );
    for ((_, va), (_, vb)) in a.params().iter().zip(b.params().iter()) {
        assert_eq!(max_abs_diff(va.as_tensor(), vb.as_tensor()), 0.0);
    }
    // A few steps of plain gradient descent on one window lower its loss.
    let x = Tensor::new(&[[1u32, 2, 3, 4, 5, 6, 7, 8]], &Device::Cpu).unwrap();
    let y = Tensor::new(&[[2u32, 3, 4, 5, 6, 7, 8, 9]], &Device::Cpu).unwrap();
    let first = a
        .loss(&x, &y, &Mode::Eval)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    for _ in 0..20 {
        let loss = a.loss(&x, &y, &Mode::Eval).unwrap();
        let grads = loss.backward().unwrap();
        for (_, v) in a.params().iter() {
            let g = grads
                .get(v.as_tensor())
                .expect("every parameter gets a gradient");
            v.set(&(v.as_tensor() - (g * 0.5).unwrap()).unwrap())
                .unwrap();
        }
    }
    let last = a
        .loss(&x, &y, &Mode::Eval)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(last < first - 1.0, "{first} → {last}");
}

#[test]
fn numbers_out_of_range_are_refused_by_key_before_they_train_on_nan() {
    use super::options::{RopeScalingOptions, RopeType};
    let scaling = |factor: f64, low: f64, high: f64| RopeScalingOptions {
        rope_type: RopeType::Llama3,
        factor,
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position_embeddings: 16,
    };
    let with = |change: &dyn Fn(&mut LlamaOptions)| {
        let mut o = LlamaOptions::default();
        change(&mut o);
        o.complete().map(|_| ()).unwrap_err()
    };
    for (err, key) in [
        (with(&|o| o.rope_theta = Some(0.0)), "model.rope_theta"),
        (with(&|o| o.rope_theta = Some(-1.0)), "model.rope_theta"),
        (with(&|o| o.rms_norm_eps = Some(-1.0)), "model.rms_norm_eps"),
        (with(&|o| o.head_dim = Some(0)), "model.head_dim"),
        (
            with(&|o| o.initializer_range = Some(f64::NAN)),
            "model.initializer_range",
        ),
        (
            with(&|o| o.rope_scaling = Some(scaling(0.0, 1.0, 4.0))),
            "model.rope_scaling.factor",
        ),
        (
            with(&|o| o.rope_scaling = Some(scaling(8.0, 1.0, 1.0))),
            "model.rope_scaling.high_freq_factor",
        ),
    ] {
        assert!(err.starts_with(key), "{key}: {err}");
    }
    let fine = LlamaOptions {
        rope_scaling: Some(scaling(8.0, 1.0, 4.0)),
        rms_norm_eps: Some(0.0),
        ..LlamaOptions::default()
    };
    assert!(fine.complete().is_ok());
}

#[test]
fn bad_checkpoints_are_named_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    std::fs::create_dir(&dir).unwrap();
    let complete = |dir: &std::path::Path| {
        LlamaOptions {
            init_from: Some(dir.display().to_string()),
            ..LlamaOptions::default()
        }
        .complete()
        .unwrap_err()
    };
    assert!(complete(&dir).contains("has no config.json"));
    assert!(complete(&tmp.path().join("absent")).contains("does not exist"));
    std::fs::write(tmp.path().join("file"), "x").unwrap();
    assert!(complete(&tmp.path().join("file")).contains("is a file"));
    let config = std::fs::read_to_string(fixture("llama").join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), &config).unwrap();
    assert!(complete(&dir).contains("neither model.safetensors"));
    std::fs::copy(
        fixture("qwen2").join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let edit = |from: &str, to: &str| {
        std::fs::write(dir.join("config.json"), config.replace(from, to)).unwrap();
        complete(&dir)
    };
    let err = edit("\"model_type\": \"llama\"", "\"model_type\": \"falcon\"");
    assert!(
        err.contains("\"falcon\"") && err.contains("\"qwen2\""),
        "{err}"
    );
    let err = edit("\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\"");
    assert!(err.contains("\"yarn\" is not supported"), "{err}");
    let err = edit("\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"");
    assert!(err.contains("hidden_act \"gelu\""), "{err}");
    // A llama config over qwen2's weights: the biases are left over, lm_head is missing.
    std::fs::write(dir.join("config.json"), &config).unwrap();
    let o = complete_ok(&dir);
    let err = build_llama(&o, &context(320, 64, DType::F32))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("lm_head.weight") || err.contains("bias"),
        "{err}"
    );
    // The right names with a wrong shape.
    let wide = config.replace("\"intermediate_size\": 64", "\"intermediate_size\": 96");
    std::fs::write(dir.join("config.json"), wide).unwrap();
    std::fs::copy(
        fixture("llama").join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let o = complete_ok(&dir);
    let err = build_llama(&o, &context(320, 64, DType::F32))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("gate_proj.weight` has shape [64, 32], the model expects [96, 32]"),
        "{err}"
    );
}

fn complete_ok(dir: &std::path::Path) -> LlamaOptions {
    LlamaOptions {
        init_from: Some(dir.display().to_string()),
        ..LlamaOptions::default()
    }
    .complete()
    .unwrap()
}

#[test]
fn a_qwen_sliding_window_shorter_than_the_context_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("qwen2").join(file), tmp.path().join(file)).unwrap();
    }
    let config = std::fs::read_to_string(tmp.path().join("config.json")).unwrap();
    let windowed = config
        .replace("\"sliding_window\": null", "\"sliding_window\": 16")
        .replace(
            "\"use_sliding_window\": false",
            "\"use_sliding_window\": true",
        );
    assert_ne!(config, windowed, "the fixture has the sliding_window keys");
    std::fs::write(tmp.path().join("config.json"), windowed).unwrap();
    let err = LlamaOptions {
        init_from: Some(tmp.path().display().to_string()),
        ..LlamaOptions::default()
    }
    .complete()
    .unwrap_err();
    assert!(err.contains("sliding attention window of 16"), "{err}");
    let ok = LlamaOptions {
        init_from: Some(tmp.path().display().to_string()),
        block_size: Some(16),
        ..LlamaOptions::default()
    };
    assert!(ok.complete().is_ok());
}

#[test]
fn a_checkpoint_sharded_by_an_index_loads_as_the_single_file_does() {
    // The llama fixture split into two shards with the index `save_pretrained` writes for
    // large models (`model.safetensors.index.json`'s `weight_map`), in f32 and then in bf16.
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("llama");
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(file), tmp.path().join(file)).unwrap();
    }
    let all = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = all.keys().collect();
    names.sort();
    let (first, second) = names.split_at(names.len() / 2);
    let shards = [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ];
    let write_shards = |dtype: DType| {
        let mut weight_map = serde_json::Map::new();
        for (file, part) in shards {
            let tensors: std::collections::HashMap<String, Tensor> = part
                .iter()
                .map(|n| ((*n).clone(), all[*n].to_dtype(dtype).unwrap()))
                .collect();
            candle_core::safetensors::save(&tensors, tmp.path().join(file)).unwrap();
            for n in part {
                weight_map.insert((*n).clone(), file.into());
            }
        }
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(
            tmp.path().join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
    };
    let options = || {
        LlamaOptions {
            init_from: Some(tmp.path().display().to_string()),
            ..LlamaOptions::default()
        }
        .complete()
    };
    let (x, _, logits, _) = reference("llama");
    let logits_diff = || {
        let o = options().unwrap();
        let model = build_llama(&o, &context(320, o.block_size(), DType::F32)).unwrap();
        max_abs_diff(&model.forward(&x, &Mode::Eval).unwrap(), &logits)
    };
    write_shards(DType::F32);
    let diff = logits_diff();
    assert!(diff < 1e-4, "sharded f32 logits differ by {diff}");
    // bf16 on disk, f32 master weights: close to transformers' f32 logits, not equal.
    write_shards(DType::BF16);
    let diff = logits_diff();
    assert!(
        diff < 0.05 && diff > 1e-6,
        "sharded bf16 logits differ by {diff}"
    );
    // A shard the index names but the directory lacks is named.
    std::fs::remove_file(tmp.path().join(shards[1].0)).unwrap();
    let err = options().unwrap_err();
    assert!(err.contains(shards[1].0), "{err}");
}

/// The loss's bits and every parameter's gradient's bits from `model`'s training pass for
/// `scale` · loss: autograd over the whole model unless the model recomputes its layers.
pub(super) fn training_bits(
    model: &dyn Model,
    x: &Tensor,
    y: &Tensor,
) -> (u32, Vec<Option<Vec<u32>>>) {
    let mode = Mode::Train {
        row_seeds: vec![7; x.dims()[0]],
    };
    let scale = 0.375;
    let (loss, grads) = match model.train_pass(x, y, &mode).unwrap() {
        Some(pass) => {
            let loss = pass.loss().clone();
            (loss, pass.backward(scale).unwrap())
        }
        None => {
            let loss = model.loss(x, y, &mode).unwrap();
            let store = (&loss * scale).unwrap().backward().unwrap();
            let grads = model.params().vars().map(|v| store.get(v).cloned());
            (loss, grads.collect())
        }
    };
    let bits = |t: &Tensor| ddpjob_kernels::f32_bits(&t.to_dtype(DType::F32).unwrap());
    let loss = loss
        .to_dtype(DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    (
        loss.to_bits(),
        grads.iter().map(|g| g.as_ref().map(bits)).collect(),
    )
}

/// Activation checkpointing recomputes each layer in the backward, streamed gradients keep
/// each layer's graph apart, and both give the same loss and gradients, bit for bit, as
/// autograd over the whole model: untied (llama) and tied with
/// biases (qwen2), f32 and bf16, plain and packed rows, and with LoRA adapters (whose frozen
/// base gets no gradient either way).
#[test]
fn recomputed_layers_give_the_whole_models_gradients_bit_for_bit() {
    let (x, y, _, _) = reference("llama");
    let pairs: Vec<u32> = x.flatten_all().unwrap().to_vec1::<u32>().unwrap();
    let t = pairs.len() / x.dims()[0];
    // The same tokens as two packed examples a row.
    let packed: Vec<u32> = pairs
        .iter()
        .enumerate()
        .flat_map(|(i, &id)| [id, ((i % t) % (t / 2 + 1)) as u32])
        .collect();
    let packed = Tensor::from_vec(packed, (x.dims()[0], t, 2), &Device::Cpu).unwrap();
    for name in [
        "llama f32",
        "qwen2 f32",
        "qwen2 bf16",
        "qwen2 + LoRA",
        "qwen3 f32",
        "qwen3 bf16",
        "smollm3 f32",
        "mistral-sw f32",
        "qwen3-moe f32",
        "mixtral bf16",
        "olmoe f32",
        "gemma3 f32",
        "gemma3 bf16",
    ] {
        let build = || match name {
            "qwen2 + LoRA" => with_adapter(),
            _ => {
                let (arch, dtype) = name.split_once(' ').unwrap();
                let dtype = if dtype == "bf16" {
                    DType::BF16
                } else {
                    DType::F32
                };
                built(arch, dtype)
            }
        };
        for xs in [&x, &packed] {
            let model = build();
            let whole = training_bits(model.as_ref(), xs, &y);
            // Streamed gradients: each layer's graph kept apart, differentiated alone.
            let streamed = build();
            streamed.stream_gradients().unwrap();
            assert!(streamed.train_pass(xs, &y, &Mode::Eval).unwrap().is_some());
            let kept = training_bits(streamed.as_ref(), xs, &y);
            assert!(whole == kept, "{name}: the streamed gradients differ");
            model.checkpoint_activations().unwrap();
            assert!(model.train_pass(xs, &y, &Mode::Eval).unwrap().is_some());
            let recomputed = training_bits(model.as_ref(), xs, &y);
            assert!(whole == recomputed, "{name}: the gradients differ");
        }
    }
    // LoRA: only the adapters train.
    let model = with_adapter();
    let (_, grads) = training_bits(model.as_ref(), &x, &y);
    let trained = grads.iter().filter(|g| g.is_some()).count();
    assert!(
        trained > 0 && trained < grads.len(),
        "{trained} of {}",
        grads.len()
    );
}

pub(super) fn built(name: &str, dtype: DType) -> Box<dyn Model> {
    let o = options_from(name);
    build_llama(&o, &context(320, o.block_size(), dtype)).unwrap()
}

/// qwen2 with the `qwen2-lora` fixture's adapters (its base frozen), as a job whose
/// `init_from` names the adapter builds it (`adapter_config.json`: r 4, alpha 8, no dropout).
fn with_adapter() -> Box<dyn Model> {
    let lora = ddpjob_spec::LoraSpec {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: ddpjob_spec::TargetModules::Names(vec![
            "down_proj".into(),
            "q_proj".into(),
            "v_proj".into(),
        ]),
        adapter: Some(fixture("qwen2-lora")),
    };
    let o = options_from("qwen2");
    let mut cx = context(320, 64, DType::F32);
    cx.lora = Some(lora.clone());
    let model = Box::new(build_llama(&o, &cx).unwrap());
    crate::adapt(model, "llama", Some(&lora), None, &[], false).unwrap()
}

/// The memory estimate's share of a sample: per position, every layer's tensors and one
/// layer's more for the backward, or with checkpointing the layers' inputs and one layer's;
/// not known in bf16.
#[test]
fn activations_per_sample_count_the_layers_kept() {
    let o = LlamaOptions::default().complete().unwrap();
    let t = o.block_size();
    let model = build_llama(&o, &context(65, t, DType::F32)).unwrap();
    let (off, on) = (
        model.activation_bytes_per_sample(false).unwrap(),
        model.activation_bytes_per_sample(true).unwrap(),
    );
    // The scratch llama: 4 layers of 128 channels, 4 query heads of 32, 2 key/value heads,
    // SwiGLU of 384; 65 tokens.
    let (h, q, kv, i, layers, heads) = (128.0, 128.0, 64.0, 384.0, 4.0, 4.0);
    // The attention in tiles: q, k and v once side by side, a log-sum-exp per head.
    let layer = 6.0 * h + 4.0 * q + 5.0 * kv + heads + 3.0 * i;
    // 65 symbols: the head keeps no logits.
    let bytes = |per_position: f64| (per_position + 2.0 * h) * t as f64 * 4.0;
    assert_eq!(off, bytes((layers + 1.0) * layer));
    assert_eq!(on, bytes(layers * h + layer));
    // SmolLM2's vocabulary: the head holds a chunk of a sample's logits (all 64 × 49,152 × 4
    // bytes here) while it makes its gradients, with checkpointing or without.
    let large = build_llama(&o, &context(49_152, t, DType::F32)).unwrap();
    let held = (t * 49_152 * 4) as f64;
    assert_eq!(
        large.activation_bytes_per_sample(false).unwrap() - off,
        held
    );
    assert_eq!(large.activation_bytes_per_sample(true).unwrap() - on, held);
    // Qwen3's 151,936 over 4,096 positions (2.5 GB of logits): never more than the head's
    // chunk budget.
    let mut long = LlamaOptions {
        block_size: Some(4096),
        max_position_embeddings: Some(4096),
        ..LlamaOptions::default()
    };
    long = long.complete().unwrap();
    let per_sample = |vocab: usize| {
        let model = build_llama(&long, &context(vocab, 4096, DType::F32)).unwrap();
        model.activation_bytes_per_sample(true).unwrap()
    };
    let extra = per_sample(151_936) - per_sample(65);
    let held = crate::kit::head::fused_grads::held_bytes(4096, 151_936);
    assert_eq!(extra, held as f64);
    // A chunk of 192 rows: 117 MB.
    assert!(held == 192 * 151_936 * 4 && held <= crate::kit::head::fused_grads::CHUNK_BYTES);
    let bf16 = build_llama(&o, &context(65, t, DType::BF16)).unwrap();
    assert_eq!(bf16.activation_bytes_per_sample(false), None);
}

/// LoRA on a qwen3 with PEFT's `all-linear`: an adapter pair beside each of the seven
/// projections of every layer, none on the per-head norms (not linear layers) or the head.
#[test]
fn qwen3_lora_adapts_every_projection_and_no_norm() {
    let o = options_from("qwen3");
    let mut cx = context(320, o.block_size(), DType::F32);
    cx.lora = Some(ddpjob_spec::LoraSpec {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: ddpjob_spec::TargetModules::Regex("all-linear".into()),
        adapter: None,
    });
    let model = build_llama(&o, &cx).unwrap();
    let adapted: Vec<&str> = model
        .params()
        .iter()
        .map(|(n, _)| n)
        .filter(|n| n.contains(".lora_A."))
        .collect();
    assert_eq!(adapted.len(), 2 * 7, "{adapted:?}");
    assert!(adapted.iter().all(|n| n.contains("_proj.")), "{adapted:?}");
    // The adapters start at zero (B = 0): the model is still transformers' qwen3.
    let (x, _, logits, _) = reference("qwen3");
    let diff = max_abs_diff(&model.forward(&x, &Mode::Eval).unwrap(), &logits);
    assert!(diff < 1e-4, "{diff}");
}

/// SmolLM3's NoPE layers: read from `no_rope_layers`, and they matter (rotating every layer
/// gives other logits); the list must fit the layers and belongs to smollm3 alone.
#[test]
fn smollm3_layers_without_positions_are_read_and_checked() {
    let o = options_from("smollm3");
    assert_eq!(o.no_rope_layers, Some(vec![1, 0, 1, 0]));
    let (x, _, logits, _) = reference("smollm3");
    let cx = context(320, o.block_size(), DType::F32);
    let everywhere = LlamaOptions {
        no_rope_layers: Some(vec![1; 4]),
        ..o.clone()
    };
    let rotated = build_llama(&everywhere, &cx).unwrap();
    let diff = max_abs_diff(&rotated.forward(&x, &Mode::Eval).unwrap(), &logits);
    assert!(diff > 1e-3, "NoPE changed nothing: {diff}");
    let refused = |o: LlamaOptions| {
        LlamaOptions {
            init_from: None,
            ..o
        }
        .complete()
        .unwrap_err()
    };
    let short = refused(LlamaOptions {
        no_rope_layers: Some(vec![1, 0]),
        ..o.clone()
    });
    assert!(
        short.contains("one 0 or 1 per layer: num_hidden_layers = 4"),
        "{short}"
    );
    let llama = refused(LlamaOptions {
        model_type: Some("llama".into()),
        ..o.clone()
    });
    assert!(
        llama.contains("model.no_rope_layers is SmolLM3's"),
        "{llama}"
    );
}

/// A smollm3 `config.json` without `no_rope_layers` gets transformers' default: every 4th layer
/// (`no_rope_layer_interval`) without positions.
#[test]
fn smollm3_without_a_list_takes_transformers_interval() {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("smollm3")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
    }
    let config_path = tmp.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("no_rope_layers");
    config["no_rope_layer_interval"] = 2.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let o = complete_ok(tmp.path());
    assert_eq!(o.no_rope_layers, Some(vec![1, 0, 1, 0]));
}

/// Mistral's window at its edges: query i sees key j exactly when 0 ≤ i − j < window, checked
/// against the definition position by position; the fixture's window is read, and it matters
/// (attending to the whole past gives other logits).
#[test]
fn mistral_attends_within_its_sliding_window() {
    for (t, window) in [(6, 1), (6, 3), (6, 6), (9, 4)] {
        let mask: Vec<Vec<f32>> = super::windowed_causal_mask(t, window, &Device::Cpu)
            .unwrap()
            .to_vec2()
            .unwrap();
        for (i, row) in mask.iter().enumerate() {
            for (j, &m) in row.iter().enumerate() {
                let sees = j <= i && i - j < window;
                assert_eq!(m == 0.0, sees, "t {t} window {window}: ({i}, {j})");
            }
        }
    }
    let o = options_from("mistral-sw");
    assert_eq!(o.sliding_window, Some(4));
    let (x, _, logits, _) = reference("mistral-sw");
    let whole = LlamaOptions {
        sliding_window: None,
        ..o.clone()
    };
    let model = build_llama(&whole, &context(320, o.block_size(), DType::F32)).unwrap();
    let diff = max_abs_diff(&model.forward(&x, &Mode::Eval).unwrap(), &logits);
    assert!(diff > 1e-3, "the window changed nothing: {diff}");
    // Only Mistral's files carry a window.
    let err = LlamaOptions {
        init_from: None,
        model_type: Some("llama".into()),
        ..o
    }
    .complete()
    .unwrap_err();
    assert!(err.contains("model.sliding_window is Mistral's"), "{err}");
}

/// The llama's row log-likelihoods (the fused head row by row, each row cut to its last scored
/// target) are the default's, from all the logits: the same values and gradients (training);
/// evaluation gives the same values and keeps no graph.
#[test]
fn row_log_likelihoods_are_the_logits_and_never_hold_them() {
    let model = pretrained("llama");
    let ignore = ddpjob_seam::task::IGNORE_TARGET;
    let xs = Tensor::new(
        &[
            [5u32, 9, 17, 40, 3, 8],
            [7, 7, 60, 2, 0, 0],
            [1, 2, 3, 4, 5, 6],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let ys = Tensor::new(
        &[
            [ignore, ignore, 40, 3, 8, 11],
            [ignore, 60, 2, ignore, ignore, ignore],
            [ignore; 6],
        ],
        &Device::Cpu,
    )
    .unwrap();
    // Evaluation detaches the fused rows (no graph kept); the values are training's.
    let detached = model
        .row_log_likelihoods(&xs, &ys, &Mode::Eval)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(model.params().vars().all(|v| detached.get(v).is_none()));
    let mode = Mode::Train {
        row_seeds: vec![1, 2, 3],
    };
    let fused = model.row_log_likelihoods(&xs, &ys, &mode).unwrap();
    let eval = model.row_log_likelihoods(&xs, &ys, &Mode::Eval).unwrap();
    assert_eq!(
        fused.to_vec1::<f32>().unwrap(),
        eval.to_vec1::<f32>().unwrap()
    );
    let plain = ddpjob_seam::log_likelihoods(&model.forward(&xs, &mode).unwrap(), &ys).unwrap();
    let (a, b) = (
        fused.to_vec1::<f32>().unwrap(),
        plain.to_vec1::<f32>().unwrap(),
    );
    assert_eq!(a[2], 0.0);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < 1e-4, "{a:?} vs {b:?}");
    }
    let weights = |t: Tensor| {
        let grads = (t * Tensor::new(&[1.0f32, -2.0, 3.0], &Device::Cpu).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        model
            .params()
            .vars()
            .map(|v| {
                grads
                    .get(v)
                    .map(|g| g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            })
            .collect::<Vec<_>>()
    };
    let (ga, gb) = (weights(fused), weights(plain));
    for (i, (x, y)) in ga.iter().zip(&gb).enumerate() {
        let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
        let worst = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "parameter {i}: {worst}");
    }
}

/// QLoRA's base: the Qwen2 that `transformers` + bitsandbytes 0.50 quantised to NF4 (double
/// quantisation, blocks of 64) and saved (`qwen2-h64-nf4`, see make_nf4_fixture.py), read
/// from its saved codes, scores the loss of the f32 model of bitsandbytes' own
/// `dequantize_4bit` weights (within 1e-5; bitsandbytes' CPU 4-bit product itself is 1e-4
/// off that), and the same model's f32 weights (`qwen2-h64`) quantised here give the same
/// codes and scales, bit for bit.
#[test]
fn a_bitsandbytes_4bit_checkpoint_scores_its_loss_and_its_f32_base_quantises_to_it() {
    let r = candle_core::safetensors::load(
        fixture("qwen2-h64-nf4").join("reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
    let (x, y) = (ids.narrow(1, 0, 16).unwrap(), ids.narrow(1, 1, 16).unwrap());
    let reference = r["dequantized_loss"].to_vec1::<f32>().unwrap()[0];
    let bitsandbytes = r["loss"].to_vec1::<f32>().unwrap()[0];
    let quantize = ddpjob_spec::QuantizeSpec {
        kind: ddpjob_spec::QuantType::Nf4,
        block_size: 64,
        double_quant: true,
    };
    let build = |name: &str| {
        let o = options_from(name);
        let mut cx = context(320, o.block_size(), DType::F32);
        cx.quantize = Some(quantize);
        build_llama(&o, &cx).unwrap()
    };
    let (saved, here) = (build("qwen2-h64-nf4"), build("qwen2-h64"));
    for model in [&saved, &here] {
        assert_eq!(
            model.params().packed().count(),
            2 * 7,
            "every decoder linear"
        );
        let loss = model.loss(&x, &y, &Mode::Eval).unwrap();
        let loss = loss.to_scalar::<f32>().unwrap();
        assert!(
            (loss - reference).abs() < 1e-5,
            "loss {loss} vs {reference}"
        );
        assert!(
            (loss - bitsandbytes).abs() < 1e-3,
            "{loss} vs {bitsandbytes}"
        );
    }
    for ((name, a), (_, b)) in saved.params().packed().zip(here.params().packed()) {
        let (a, b) = (a.get().unwrap().stored(), b.get().unwrap().stored());
        assert!(a == b, "{name}: codes or scales differ from bitsandbytes'");
    }
}

/// The adapter `peft` made and saved over that 4-bit base (`qwen2-h64-nf4-lora`, see
/// make_nf4_fixture.py), loaded over ddpjob's 4-bit base, scores what `peft` scores over the
/// f32 model of bitsandbytes' de-quantised weights (within 1e-5), and what it scores over
/// bitsandbytes' own 4-bit product within 1e-3.
#[test]
fn a_peft_adapter_over_a_bitsandbytes_base_scores_peft_s_loss() {
    let dir = fixture("qwen2-h64-nf4-lora");
    let r =
        candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
    let (x, y) = (ids.narrow(1, 0, 16).unwrap(), ids.narrow(1, 1, 16).unwrap());
    let scalar = |k: &str| r[k].to_vec1::<f32>().unwrap()[0];
    let lora = ddpjob_spec::LoraSpec {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: ddpjob_spec::TargetModules::Regex("all-linear".into()),
        adapter: Some(dir),
    };
    let quantize = ddpjob_spec::QuantizeSpec {
        kind: ddpjob_spec::QuantType::Nf4,
        block_size: 64,
        double_quant: true,
    };
    let o = options_from("qwen2-h64-nf4");
    let mut cx = context(320, o.block_size(), DType::F32);
    (cx.lora, cx.quantize) = (Some(lora.clone()), Some(quantize));
    let model = Box::new(build_llama(&o, &cx).unwrap());
    let model = crate::adapt(model, "llama", Some(&lora), Some(&quantize), &[], false).unwrap();
    let loss = model.loss(&x, &y, &Mode::Eval).unwrap();
    let loss = loss.to_scalar::<f32>().unwrap();
    let (exact, peft) = (scalar("exact_loss"), scalar("loss"));
    assert!((loss - exact).abs() < 1e-5, "loss {loss} vs peft's {exact}");
    assert!(
        (loss - peft).abs() < 1e-3,
        "loss {loss} vs peft over bitsandbytes' {peft}"
    );
}
