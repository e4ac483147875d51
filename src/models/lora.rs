//! LoRA (`[model.lora]`, PEFT's `LoraConfig` names): a low-rank adapter beside each targeted
//! linear layer of `gpt` and `llama`, `y = x·Wᵀ + b + (alpha / r)·(x·Aᵀ)·Bᵀ`, with `A` [r, in]
//! drawn as PEFT draws it (Kaiming uniform, bound 1/sqrt(in)) and `B` [out, r] zeros, so a
//! fresh adapter leaves the model's outputs exactly as they were. Every other parameter is
//! frozen (PEFT's default, `bias = "none"`): only the adapters train, are all-reduced and
//! keep optimizer state. The adapters are named as PEFT names them inside the model
//! (`model.layers.0.self_attn.q_proj.lora_A.weight`).

use candle_core::{Result, Tensor, Var};

use super::FrozenSet;
use ddpjob_kernels as kernels;

pub use crate::config::{LoraSpec, is_adapter};

/// One linear layer's adapter.
pub(crate) struct Adapter {
    /// [r, in].
    pub(crate) a: Var,
    /// [out, r].
    pub(crate) b: Var,
    pub(crate) scale: f64,
    /// Dropout on the adapter's input, in training.
    pub(crate) dropout: f64,
    /// Zero biases [r] and [out] for the fused linear op, made once.
    pub(crate) zeros: (Tensor, Tensor),
}

impl Adapter {
    /// `scale · (x·Aᵀ)·Bᵀ` for the rows `x` [m, in], in f32 or `compute`.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        compute: candle_core::DType,
        frozen: &FrozenSet,
    ) -> Result<Tensor> {
        let (a, b) = (frozen.as_input(&self.a), frozen.as_input(&self.b));
        let low = if compute == candle_core::DType::F32 && kernels::applies(x) {
            let h = kernels::linear(x, &a, &self.zeros.0, false)?;
            kernels::linear(&h, &b, &self.zeros.1, false)?
        } else {
            let h = x.to_dtype(compute)?.matmul(&a.to_dtype(compute)?.t()?)?;
            h.matmul(&b.to_dtype(compute)?.t()?)?
        };
        low.affine(self.scale, 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TargetModules;

    #[test]
    fn targets_follow_peft_suffix_matching() {
        let spec = |targets: &[&str]| LoraSpec {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            target_modules: TargetModules::Names(targets.iter().map(|t| t.to_string()).collect()),
            adapter: None,
        };
        let q = "model.layers.0.self_attn.q_proj";
        assert!(spec(&["q_proj"]).targets(q, &[]));
        assert!(spec(&["self_attn.q_proj"]).targets(q, &[]));
        assert!(
            !spec(&["proj"]).targets(q, &[]),
            "a suffix is whole components"
        );
        assert!(spec(&[]).targets(q, &["q_proj", "v_proj"]));
        assert!(!spec(&[]).targets("model.layers.0.mlp.up_proj", &["q_proj", "v_proj"]));
        assert!(spec(&["all-linear"]).targets("model.layers.0.mlp.up_proj", &[]));
        // One string: a regular expression of the whole name, as PEFT's re.fullmatch.
        let regex = |p: &str| LoraSpec {
            target_modules: TargetModules::Regex(p.into()),
            ..spec(&[])
        };
        let layer1 = r".*\.1\.self_attn\.(q|v)_proj";
        assert!(regex(layer1).targets("model.layers.1.self_attn.v_proj", &[]));
        assert!(!regex(layer1).targets(q, &[]));
        assert!(
            !regex("q_proj").targets(q, &[]),
            "the whole name must match"
        );
        assert!(regex("all-linear").targets(q, &[]));
        assert!(regex("(").target_modules.check().is_err());
        assert_eq!(spec(&[]).scale(), 2.0);
        assert!(is_adapter(&format!("{q}.lora_A.weight")));
        assert!(!is_adapter(&format!("{q}.weight")));
    }

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
        let input = crate::task::ModelInput::Tokens {
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
        let mode = crate::models::Mode::Eval;
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
        use crate::models::Mode;
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
}
