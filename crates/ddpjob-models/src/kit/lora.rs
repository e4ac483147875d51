//! LoRA (`[model.lora]`, PEFT's `LoraConfig` names): a low-rank adapter beside each targeted
//! linear layer of `gpt` and `llama`, `y = x·Wᵀ + b + (alpha / r)·(x·Aᵀ)·Bᵀ`, with `A` [r, in]
//! drawn as PEFT draws it (Kaiming uniform, bound 1/sqrt(in)) and `B` [out, r] zeros, so a
//! fresh adapter leaves the model's outputs exactly as they were. Every other parameter is
//! frozen (PEFT's default, `bias = "none"`): only the adapters train, are all-reduced and
//! keep optimizer state. The adapters are named as PEFT names them inside the model
//! (`model.layers.0.self_attn.q_proj.lora_A.weight`).

use candle_core::{Result, Tensor, Var};

use crate::FrozenSet;
use ddpjob_kernels as kernels;

pub use ddpjob_spec::{LoraSpec, is_adapter};

/// One linear layer's adapter.
pub struct Adapter {
    /// [r, in].
    pub a: Var,
    /// [out, r].
    pub b: Var,
    pub scale: f64,
    /// Dropout on the adapter's input, in training.
    pub dropout: f64,
    /// Zero biases [r] and [out] for the fused linear op, made once.
    pub zeros: (Tensor, Tensor),
}

impl Adapter {
    /// `scale · (x·Aᵀ)·Bᵀ` for the rows `x` [m, in], in f32 or `compute`.
    pub fn forward(
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
    use ddpjob_spec::TargetModules;

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
}
