//! The mixtures of experts against transformers' numbers (the `qwen3-moe`, `mixtral` and
//! `olmoe` fixtures of make_fixtures_2026.py) and the trainer's guarantees for them.

use candle_core::{DType, Device, Tensor};

use super::options::build_llama;
use super::tests::{built, context, fixture, options_from, reference, training_bits};
use crate::{LanguageModelOptions, Mode, Model};

const MOE: [&str; 3] = ["qwen3-moe", "mixtral", "olmoe"];

/// Each fixture row's load-balancing loss as transformers' `load_balancing_loss_func` gives it
/// for that row alone (the reference's `aux_loss`).
fn reference_aux(name: &str) -> Vec<f32> {
    let path = fixture(name).join("reference.safetensors");
    let r = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    r["aux_loss"].to_vec1::<f32>().unwrap()
}

/// The logged [loss, aux_loss] of `model` over rows `x`, `y`.
fn logged(model: &dyn Model, x: &Tensor, y: &Tensor) -> Vec<f32> {
    let (_, logged) = model.loss_with_terms(x, y, &Mode::Eval).unwrap();
    logged.to_vec1::<f32>().unwrap()
}

#[test]
fn the_load_balancing_loss_of_each_sequence_is_transformers() {
    for name in MOE {
        let model = built(name, DType::F32);
        assert_eq!(model.loss_terms(), vec!["aux_loss".to_string()]);
        let (x, y, _, loss) = reference(name);
        let expected = reference_aux(name);
        for (row, want) in expected.iter().enumerate() {
            let (xr, yr) = (x.narrow(0, row, 1).unwrap(), y.narrow(0, row, 1).unwrap());
            let [_, aux] = logged(model.as_ref(), &xr, &yr)[..] else {
                panic!("{name}: two logged values")
            };
            assert!(
                (aux - want).abs() < 1e-5,
                "{name} row {row}: {aux} vs {want}"
            );
        }
        // The batch's: the sequences' mean (each scores as many targets), and the logged
        // language-model loss is transformers' loss, the aux loss not in it (not trained on:
        // output_router_logits is false in the fixtures, as in transformers' defaults).
        let both = logged(model.as_ref(), &x, &y);
        let mean = expected.iter().sum::<f32>() / expected.len() as f32;
        assert!(
            (both[1] - mean).abs() < 1e-5,
            "{name}: {} vs {mean}",
            both[1]
        );
        assert!((both[0] - loss).abs() < 1e-4, "{name}: loss {}", both[0]);
        let objective = model.loss(&x, &y, &Mode::Eval).unwrap();
        assert_eq!(objective.to_scalar::<f32>().unwrap(), both[0]);
    }
}

/// With `output_router_logits`, the objective is loss + coef · aux_loss, as transformers'
/// `Qwen3MoeForCausalLM` adds it; going layer by layer (activation checkpointing, streamed
/// gradients) each layer differentiates its own share and the gradients are those of
/// autograd over the whole model.
#[test]
fn the_aux_loss_trained_on_is_differentiated_layer_by_layer_as_a_whole() {
    let (x, y, _, _) = reference("qwen3-moe");
    let build = || {
        let mut o = options_from("qwen3-moe");
        o.output_router_logits = Some(true);
        build_llama(&o, &context(320, o.block_size(), DType::F32)).unwrap()
    };
    let model = build();
    let both = logged(model.as_ref(), &x, &y);
    let objective = model.loss(&x, &y, &Mode::Eval).unwrap();
    let objective = objective.to_scalar::<f32>().unwrap();
    // make_fixtures_2026.py: router_aux_loss_coef = 0.01 for qwen3-moe.
    let want = both[0] + 0.01 * both[1];
    assert!((objective - want).abs() < 1e-6, "{objective} vs {want}");
    let close = |a: &(u32, Vec<Option<Vec<u32>>>), b: &(u32, Vec<Option<Vec<u32>>>), what| {
        let f = f32::from_bits;
        assert!((f(a.0) - f(b.0)).abs() < 1e-6, "{what}: losses");
        for (i, (ga, gb)) in a.1.iter().zip(&b.1).enumerate() {
            let (Some(ga), Some(gb)) = (ga, gb) else {
                assert_eq!(ga.is_some(), gb.is_some(), "{what}: gradient {i}");
                continue;
            };
            let worst = ga.iter().zip(gb).map(|(&p, &q)| (f(p) - f(q)).abs());
            let scale = ga.iter().map(|&p| f(p).abs()).fold(1e-3, f32::max);
            let worst = worst.fold(0.0, f32::max) / scale;
            assert!(
                worst < 1e-4,
                "{what}: gradient {i} differs by {worst} of its largest"
            );
        }
    };
    let whole = training_bits(model.as_ref(), &x, &y);
    let streamed = build();
    streamed.stream_gradients().unwrap();
    close(
        &whole,
        &training_bits(streamed.as_ref(), &x, &y),
        "streamed",
    );
    let recomputed = build();
    recomputed.checkpoint_activations().unwrap();
    close(
        &whole,
        &training_bits(recomputed.as_ref(), &x, &y),
        "recomputed",
    );
    // And it moves the router: its gradient differs from the one without the aux loss.
    let plain = training_bits(built("qwen3-moe", DType::F32).as_ref(), &x, &y);
    let router = model
        .params()
        .iter()
        .position(|(n, _)| n == "model.layers.0.mlp.gate.weight")
        .unwrap();
    assert_ne!(whole.1[router], plain.1[router]);
}

/// A row's output is the same whatever else is in the batch (the grouping by expert mixes
/// the rows of a batch into each expert's product).
#[test]
fn each_sequence_is_computed_as_if_alone() {
    for name in MOE {
        let model = built(name, DType::F32);
        let (x, _, _, _) = reference(name);
        let both = model.forward(&x, &Mode::Eval).unwrap();
        let second = model
            .forward(&x.narrow(0, 1, 1).unwrap(), &Mode::Eval)
            .unwrap();
        let diff = crate::testing::max_difference(&both.narrow(0, 1, 1).unwrap(), &second);
        assert!(diff < 1e-5, "{name}: {diff}");
    }
}

/// LoRA adapters on the router and the experts carry PEFT's names; adapter dropout on
/// experts is refused by key, with the fix.
#[test]
fn lora_on_experts_and_router_is_named_as_peft_names_it() {
    let lora = |targets: &[&str], dropout: f64| ddpjob_spec::LoraSpec {
        r: 2,
        alpha: 4.0,
        dropout,
        target_modules: ddpjob_spec::TargetModules::Names(
            targets.iter().map(|t| t.to_string()).collect(),
        ),
        adapter: None,
    };
    let o = options_from("qwen3-moe");
    let mut cx = context(320, o.block_size(), DType::F32);
    cx.lora = Some(lora(&["gate", "gate_proj", "down_proj"], 0.0));
    let model = build_llama(&o, &cx).unwrap();
    let names: Vec<&str> = model.params().iter().map(|(n, _)| n).collect();
    for want in [
        "model.layers.0.mlp.gate.lora_A.weight",
        "model.layers.0.mlp.experts.7.gate_proj.lora_B.weight",
        "model.layers.0.mlp.experts.0.down_proj.lora_A.weight",
        // Layer 1 is dense (mlp_only_layers): its own MLP's.
        "model.layers.1.mlp.gate_proj.lora_A.weight",
    ] {
        assert!(names.contains(&want), "{want} not in {names:?}");
    }
    // Adapters start at B = 0: the model is still transformers'.
    let (x, _, logits, _) = reference("qwen3-moe");
    let diff = crate::testing::max_difference(&model.forward(&x, &Mode::Eval).unwrap(), &logits);
    assert!(diff < 1e-4, "{diff}");
    cx.lora = Some(lora(&["gate_proj"], 0.1));
    let err = build_llama(&o, &cx).err().unwrap().to_string();
    assert!(
        err.contains("model.lora.dropout") && err.contains("experts.0.gate_proj"),
        "{err}"
    );
}

/// A checkpoint whose expert tensor is missing or mis-shaped is refused, naming the tensor.
#[test]
fn missing_or_misshapen_experts_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("mixtral");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let mut tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let name = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
    tensors.remove(name);
    let path = dir.path().join("model.safetensors");
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let build = || {
        let o = super::options::LlamaOptions {
            init_from: Some(dir.path().display().to_string()),
            ..Default::default()
        }
        .complete()
        .unwrap();
        build_llama(&o, &context(320, o.block_size(), DType::F32))
            .err()
            .map(|e| e.to_string())
    };
    let err = build().expect("a missing expert is refused");
    assert!(err.contains(name), "{err}");
    tensors.insert(
        name.into(),
        Tensor::zeros((32, 24), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let err = build().expect("a mis-shaped expert is refused");
    assert!(err.contains(name) && err.contains("48"), "{err}");
}

/// The keys of a mixture are read from 4.x and 5.x configs and refused where they do not fit.
#[test]
fn moe_keys_are_read_and_checked() {
    let o = options_from("qwen3-moe");
    assert_eq!(
        (
            o.num_experts,
            o.num_experts_per_tok,
            o.moe_intermediate_size
        ),
        (Some(8), Some(2), Some(16))
    );
    assert_eq!(o.mlp_only_layers, Some(vec![1]));
    assert_eq!(o.norm_topk_prob, Some(true));
    let mixtral = options_from("mixtral");
    assert_eq!(
        (mixtral.num_experts, mixtral.norm_topk_prob),
        (Some(4), Some(true))
    );
    // A restated key must agree with the checkpoint's; a model from scratch is checked alone.
    let mut bad = o.clone();
    bad.num_experts_per_tok = Some(9);
    let err = bad.clone().complete().unwrap_err();
    assert!(err.contains("model.num_experts_per_tok = 9, but"), "{err}");
    bad.init_from = None;
    let err = bad.complete().unwrap_err();
    assert!(err.contains("between 1 and model.num_experts = 8"), "{err}");
    let mut bad = o.clone();
    (bad.init_from, bad.mlp_only_layers) = (None, Some(vec![5]));
    assert!(bad.complete().unwrap_err().contains("names layer 5"));
    let dense = super::options::LlamaOptions {
        num_experts: Some(4),
        ..Default::default()
    };
    let err = dense.complete().unwrap_err();
    assert!(
        err.contains("model.num_experts is a mixture of experts' key"),
        "{err}"
    );
}

/// The memory estimate counts a mixture's router and its k experts per token, not a dense
/// MLP's, and once per pass the experts stacked for the grouped products (every sparse
/// layer's; one at a time with checkpointing). The `qwen3-moe` fixture: layer 0 sparse (8
/// experts of 16, top 2), layer 1 dense (64), hidden 32, q 4 × 16, key/value 2 × 16.
#[test]
fn the_memory_estimate_counts_the_router_the_chosen_experts_and_their_stacked_weights() {
    let o = options_from("qwen3-moe");
    let t = o.block_size();
    let model = build_llama(&o, &context(320, t, DType::F32)).unwrap();
    let (h, q, kv, e, k, s, inner) = (32, 64, 32, 8, 2, 16, 64);
    let attention = 6 * h + 4 * q + 5 * kv + 4 + (q + kv);
    let sparse = attention + 4 * e + 2 * k + k * (3 * h + 3 * s) + 2 * h;
    let dense = attention + 3 * inner;
    let bytes = |per_position: usize| ((per_position + 2 * h) * t * 4) as f64;
    assert_eq!(
        model.activation_bytes_per_sample(false),
        Some(bytes(sparse + dense + sparse.max(dense)))
    );
    assert_eq!(
        model.activation_bytes_per_sample(true),
        Some(bytes(2 * h + sparse.max(dense)))
    );
    let stacked = (3 * e * s * h * 4) as f64;
    assert_eq!(model.activation_bytes_per_pass(false), stacked);
    assert_eq!(model.activation_bytes_per_pass(true), stacked);
    // bf16: not known.
    let bf16 = build_llama(&o, &context(320, t, DType::BF16)).unwrap();
    assert_eq!(bf16.activation_bytes_per_pass(false), 0.0);
}
