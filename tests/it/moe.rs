//! Mixtures of experts end to end: the `qwen3-moe`, `mixtral` and `olmoe` fixtures (made by
//! `transformers`, tests/fixtures/hf/make_fixtures_2026.py) fine-tuned by the real binary,
//! their load-balancing loss logged apart, scored by `eval`, exported back; and every guarantee
//! of a dense job held by a job that trains on its aux loss: bit-exact resume, 2 × B/2 = 1 × B,
//! world-size invariance, activation checkpointing and sharded parameters.

use crate::common::{
    TestJob, assert_same_bits, load_weights, max_abs_diff, preempt_resume_and_compare,
};
use crate::open_models::{fine_tune_evaluate_and_export_in, fixture, job, text};

/// Every train record carries `metrics.aux_loss`, a load-balancing loss (≥ its balanced value
/// of k = 2 experts per token, Switch Transformer's E·Σ f·P with Σ f = k), beside the loss.
fn aux_losses(t: &TestJob, name: &str) -> Vec<f64> {
    let train: Vec<serde_json::Value> = t
        .metrics(name)
        .into_iter()
        .filter(|m| m["kind"] == "train")
        .collect();
    assert!(!train.is_empty());
    train
        .iter()
        .map(|m| {
            let aux = m["metrics"]["aux_loss"].as_f64().expect("metrics.aux_loss");
            assert!(m["loss"].as_f64().is_some());
            assert!((1.99..8.0).contains(&aux), "aux_loss {aux}");
            aux
        })
        .collect()
}

#[test]
fn a_qwen3_moe_checkpoint_fine_tunes_evaluates_and_exports_back() {
    let (t, config, weights, frozen) =
        fine_tune_evaluate_and_export_in("qwen3-moe", "qwen3_moe", "");
    assert!(frozen.contains("num_experts = 8") && frozen.contains("mlp_only_layers = [1]"));
    aux_losses(&t, "ft");
    assert_eq!(config["architectures"][0], "Qwen3MoeForCausalLM");
    assert_eq!(config["num_experts"], 8);
    assert_eq!(config["moe_intermediate_size"], 16);
    assert_eq!(config["norm_topk_prob"], true);
    assert_eq!(config["mlp_only_layers"], serde_json::json!([1]));
    assert!(weights.contains_key("model.layers.0.mlp.experts.7.down_proj.weight"));
    assert!(weights.contains_key("model.layers.0.mlp.gate.weight"));
    assert!(weights.contains_key("model.layers.1.mlp.gate_proj.weight"));
}

#[test]
fn mixtral_and_olmoe_checkpoints_fine_tune_evaluate_and_export_back() {
    let (t, config, weights, _) = fine_tune_evaluate_and_export_in("mixtral", "mixtral", "");
    aux_losses(&t, "ft");
    assert_eq!(config["architectures"][0], "MixtralForCausalLM");
    assert_eq!(config["num_local_experts"], 4);
    assert!(weights.contains_key("model.layers.1.block_sparse_moe.experts.3.w3.weight"));
    let (t, config, weights, _) = fine_tune_evaluate_and_export_in("olmoe", "olmoe", "");
    aux_losses(&t, "ft");
    assert_eq!(config["architectures"][0], "OlmoeForCausalLM");
    assert_eq!(config["norm_topk_prob"], false);
    // OLMoE's norms over the whole q and k projections: q's width (4 heads × 8), k's (2 × 8).
    assert_eq!(weights["model.layers.0.self_attn.q_norm.weight"].len(), 32);
    assert_eq!(weights["model.layers.0.self_attn.k_norm.weight"].len(), 16);
}

/// A qwen3_moe job that trains on its load-balancing loss (`output_router_logits`, coef 0.5 so
/// it moves the routers): resumed after a preemption it ends with the same bits; 2 workers of
/// 4 rows end as 1 of 8; world-size-invariant on 1 and 2 workers the same bits; activation
/// checkpointing and `sharding = "full"` the same weights.
#[test]
fn a_moe_job_keeps_every_guarantee_of_a_dense_one() {
    let t = TestJob::new();
    let text = text(&t);
    let model = format!(
        "init_from = \"{}\"\nblock_size = 16\noutput_router_logits = true\n\
         router_aux_loss_coef = 0.5",
        fixture("qwen3-moe").display()
    );
    let base = job(&text, &model, "").replace("log_every = 1", "log_every = 5");
    let cfg = t.config("job", &base);
    t.run(&cfg, &["--name", "whole"]).success();
    let aux = aux_losses(&t, "whole");
    // Trained on, the aux loss falls towards its balanced value.
    assert!(aux.last().unwrap() < &aux[0], "aux_loss {aux:?}");
    preempt_resume_and_compare(&t, &cfg, &[], "rank=0,step=17,kind=preempt");

    let short = base.replace("max_steps = 30", "max_steps = 10");
    let half = short.replace("batch_size = 8", "batch_size = 4");
    t.run(&t.config("one", &short), &["--nproc-per-node", "1"])
        .success();
    t.run(&t.config("two", &half), &["--nproc-per-node", "2"])
        .success();
    let one = load_weights(&t.job("one").join("model.safetensors"));
    let diff = max_abs_diff(&one, &load_weights(&t.job("two").join("model.safetensors")));
    assert!(diff < 1e-5, "1 x 8 and 2 x 4 differ by {diff}");

    let invariant = format!(
        "{}[distributed]\ndeterministic = \"world-size-invariant\"\nvirtual_shards = 4\n",
        short.replace("batch_size = 8", "global_batch_size = 8")
    );
    let inv = t.config("inv", &invariant);
    t.run(&inv, &["--nproc-per-node", "1", "--name", "inv1"])
        .success();
    t.run(&inv, &["--nproc-per-node", "2", "--name", "inv2"])
        .success();
    assert_same_bits(
        &t.job("inv1").join("model.safetensors"),
        &t.job("inv2").join("model.safetensors"),
    );

    let sharded = half.replace("lr = 3e-3", "lr = 3e-3\nactivation_checkpointing = true")
        + "[distributed]\nsharding = \"full\"\n";
    t.run(&t.config("full", &sharded), &["--nproc-per-node", "2"])
        .success();
    let diff = max_abs_diff(
        &one,
        &load_weights(&t.job("full").join("model.safetensors")),
    );
    assert!(
        diff < 1e-5,
        "sharded and checkpointed differ from 1 x 8 by {diff}"
    );
}
