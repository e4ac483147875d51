//! The job file's `[model]` built through the registry: LoRA on the built-in families, and a
//! PEFT adapter named by `init_from` (the families' own tests are in `ddpjob-models`).

use std::path::PathBuf;

use candle_core::{DType, Device, Result, Tensor};

use crate::config::Precision;
use crate::models::testing::max_difference as max_abs_diff;
use crate::models::{Mode, Model, is_adapter};
use crate::task::ModelInput;

fn build(arch: &str, lora: &str) -> Result<Box<dyn crate::models::Model>> {
    let sizes = match arch {
        "llama" => {
            "hidden_size = 16\nintermediate_size = 24\nnum_hidden_layers = 2\n\
                    num_attention_heads = 2\nnum_key_value_heads = 1\nblock_size = 8\n"
        }
        _ => "n_embd = 16\nn_layer = 2\nn_head = 2\nblock_size = 8\n",
    };
    let text = format!(
        "seed = 4\n[model]\narch = \"{arch}\"\n{sizes}{lora}\n[data]\ndataset = \"text\"\npath = \"x.txt\"\n"
    );
    let spec = crate::config::load_str(std::path::Path::new("t.toml"), text, &[])
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?
        .spec;
    let input = ModelInput::Tokens {
        vocab_size: 11,
        block_size: 8,
    };
    let device = candle_core::Device::Cpu;
    crate::models::build(&spec.model, input, 4, &device, spec.train.precision, false)
}

/// A fresh adapter (B = 0) leaves the logits exactly the base model's; only the adapters
/// train; a target that names no layer lists the model's.
#[test]
fn adapters_start_as_the_identity_and_alone_train() {
    let xs = Tensor::new(
        &[[1u32, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6, 5, 4, 3, 2, 1]],
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let mode = Mode::Eval;
    for (arch, expected) in [("llama", 4 * 2), ("gpt", 2 * 2)] {
        let base = build(arch, "").unwrap();
        let lora = build(arch, "[model.lora]\nr = 4\nalpha = 8").unwrap();
        let logits = |m: &dyn crate::models::Model| {
            m.forward(&xs, &mode)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(logits(base.as_ref()), logits(lora.as_ref()), "{arch}");
        let params = lora.params();
        let adapters: Vec<&str> = params
            .iter()
            .map(|(n, _)| n)
            .filter(|n| is_adapter(n))
            .collect();
        // llama: q_proj and v_proj of 2 layers; gpt: c_attn of 2 layers; A and B each.
        assert_eq!(adapters.len(), expected, "{arch}: {adapters:?}");
        let trainable: Vec<&str> = params
            .trainable()
            .map(|(i, _)| params.iter().nth(i).unwrap().0)
            .collect();
        assert_eq!(trainable, adapters, "{arch}: only the adapters train");
        // Gradients reach A and B; a frozen linear layer's weight gets none (a gpt's
        // embeddings and norms still get one through autograd, dropped by the step).
        let ys = xs.clone();
        let loss = lora.loss(&xs, &ys, &mode).unwrap();
        let grads = loss.backward().unwrap();
        for (name, var) in params.iter() {
            let got = grads.get(var.as_tensor()).is_some();
            let linear = ["proj.weight", "c_attn.weight", "c_fc.weight"];
            if is_adapter(name) {
                assert!(got, "{arch}: no gradient for {name}");
            } else if arch == "llama" || linear.iter().any(|l| name.ends_with(l)) {
                // llama's embedding, norms and head come detached too.
                assert!(!got, "{arch}: a gradient for the frozen {name}");
            }
        }
    }
    let err = build(
        "llama",
        "[model.lora]\nr = 4\ntarget_modules = [\"c_attn\"]",
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("names \"c_attn\", which matches none of the model's linear layers")
            && err.contains("down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"),
        "{err}"
    );
    // One name of several matching nothing is refused too (PEFT would adapt fewer layers).
    let err = build(
        "llama",
        "[model.lora]\nr = 4\ntarget_modules = [\"q_proj\", \"v_prj\"]",
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("names \"v_prj\" (did you mean \"v_proj\"?), which matches none"),
        "{err}"
    );
}

/// Adapter dropout is a training-only mask drawn from each row's seed and the layer: the
/// same seeds give the same output, a row's output does not depend on the rows beside it,
/// and evaluation drops nothing.
#[test]
fn adapter_dropout_follows_the_row_seeds() {
    let model = build("llama", "[model.lora]\nr = 4\ndropout = 0.5").unwrap();
    // B away from zero, so the adapters (and their dropout) change the output.
    for (name, var) in model.params().iter() {
        if name.contains(".lora_B.") {
            let ones = var.ones_like().unwrap().affine(0.3, 0.0).unwrap();
            var.set(&ones).unwrap();
        }
    }
    let device = candle_core::Device::Cpu;
    let xs = Tensor::new(
        &[[1u32, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6, 5, 4, 3, 2, 1]],
        &device,
    )
    .unwrap();
    let run = |xs: &Tensor, mode: &Mode| -> Vec<Vec<f32>> {
        let y = model.forward(xs, mode).unwrap();
        (0..y.dim(0).unwrap())
            .map(|r| y.get(r).unwrap().flatten_all().unwrap().to_vec1().unwrap())
            .collect()
    };
    let train = |seeds: &[u64]| Mode::Train {
        row_seeds: seeds.to_vec(),
    };
    let a = run(&xs, &train(&[10, 11]));
    assert_eq!(
        a,
        run(&xs, &train(&[10, 11])),
        "the same seeds, the same masks"
    );
    let b = run(&xs, &train(&[10, 12]));
    assert_eq!(a[0], b[0], "row 0 keeps its seed");
    assert_ne!(a[1], b[1], "row 1's seed changed");
    let alone = run(&xs.narrow(0, 0, 1).unwrap(), &train(&[10]));
    // (The products of one row and of two round apart by an ulp; a mask would not.)
    let apart = alone[0]
        .iter()
        .zip(&a[0])
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(apart < 1e-6, "a row's mask depends on its batch: {apart}");
    assert_ne!(run(&xs, &Mode::Eval)[0], a[0], "evaluation drops nothing");
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// The pretrained fixture `name`, as a job whose `init_from` names it builds it.
fn pretrained(name: &str) -> Box<dyn Model> {
    let text = format!(
        "[model]\ninit_from = \"{}\"\n[data]\ndataset = \"tokens\"\ntrain_path = \"t.bin\"\nval_path = \"v.bin\"\n",
        fixture(name).display()
    );
    let loaded = crate::config::load_str(std::path::Path::new("j.toml"), text, &[]).unwrap();
    let input = ModelInput::Tokens {
        vocab_size: 320,
        block_size: 64,
    };
    crate::models::build(
        &loaded.spec.model,
        input,
        1,
        &Device::Cpu,
        Precision::F32,
        false,
    )
    .unwrap()
}

/// `tests/fixtures/hf/qwen2-lora`: an adapter `peft` saved (make_peft_fixture.py), with
/// `B` drawn at random so it changes the outputs.
#[test]
fn a_peft_adapter_named_by_init_from_gives_peft_logits() {
    let dir = fixture("qwen2-lora");
    let text = format!(
        "[model]\ninit_from = \"{}\"\n[data]\ndataset = \"tokens\"\ntrain_path = \"t.bin\"\nval_path = \"v.bin\"\n",
        dir.display()
    );
    let loaded = crate::config::load_str(std::path::Path::new("j.toml"), text, &[]).unwrap();
    let spec = &loaded.spec.model;
    let lora = spec.lora().unwrap();
    assert_eq!(
        (lora.r, lora.alpha, lora.adapter.as_ref()),
        (4, 8.0, Some(&dir))
    );
    assert_eq!(
        spec.init_from(),
        Some(
            fixture("qwen2")
                .canonicalize()
                .unwrap()
                .display()
                .to_string()
                .as_str()
        )
    );
    let input = ModelInput::Tokens {
        vocab_size: 320,
        block_size: 64,
    };
    let model = crate::models::build(spec, input, 1, &Device::Cpu, Precision::F32, false).unwrap();
    let r =
        candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
    let logits = model.forward(&ids, &Mode::Eval).unwrap();
    let diff = max_abs_diff(&logits, &r["logits"]);
    assert!(diff < 1e-4, "logits differ from peft's by {diff}");
    // The adapter matters: the base alone is far from them.
    let base = pretrained("qwen2").forward(&ids, &Mode::Eval).unwrap();
    assert!(max_abs_diff(&base, &r["logits"]) > 1e-2);
}

#[test]
fn an_adapter_that_does_not_fit_its_job_is_refused() {
    let dir = fixture("qwen2-lora");
    let load = |extra: &str| {
        let text = format!(
            "[model]\ninit_from = \"{}\"\n{extra}\n[data]\ndataset = \"tokens\"\ntrain_path = \"t.bin\"\nval_path = \"v.bin\"\n",
            dir.display()
        );
        crate::config::load_str(std::path::Path::new("j.toml"), text, &[])
    };
    let err = load("[model.lora]\nr = 8").unwrap_err().to_string();
    assert!(
        err.contains("model.lora.r") && err.contains("has 4"),
        "{err}"
    );
    // Dropout may change; other targets than the adapter's may not.
    assert!(load("[model.lora]\ndropout = 0.1").is_ok());
    let err = load("[model.lora]\ntarget_modules = [\"q_proj\"]")
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.lora.target_modules"), "{err}");

    // The adapter over another base (a llama of another width): refused when the model is
    // built, naming the tensor.
    let text = format!(
        "[model]\narch = \"llama\"\nhidden_size = 16\nintermediate_size = 24\n\
         num_hidden_layers = 2\nnum_attention_heads = 2\nnum_key_value_heads = 1\n\
         block_size = 8\nvocab_size = 320\n[model.lora]\nr = 4\nalpha = 8.0\n\
         adapter = \"{}\"\ntarget_modules = [\"q_proj\", \"v_proj\", \"down_proj\"]\n\
         [data]\ndataset = \"tokens\"\ntrain_path = \"t.bin\"\nval_path = \"v.bin\"\n",
        dir.display()
    );
    let spec = crate::config::load_str(std::path::Path::new("j.toml"), text, &[])
        .unwrap()
        .spec
        .model;
    let input = ModelInput::Tokens {
        vocab_size: 320,
        block_size: 64,
    };
    let err = crate::models::build(&spec, input, 1, &Device::Cpu, Precision::F32, false)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("model.lora.adapter"), "{err}");
}
