//! `train.activation_checkpointing` end to end: a GPT with dropout and clipping (f32 and
//! bf16), and a llama in bf16, trained on 2 workers with and without it end with the same weights bit for bit,
//! and resume exactly after SIGTERM; a model that cannot recompute is refused
//! before anything is created.

use crate::common::{TestJob, assert_same_bits, corpus, preempt_resume_and_compare};

fn gpt(t: &TestJob) -> std::path::PathBuf {
    let text = t.path("corpus.txt");
    std::fs::write(&text, corpus()).unwrap();
    let job = format!(
        r#"
seed = 5
[model]
arch = "gpt"
n_layer = 2
n_head = 2
n_embd = 16
block_size = 16
dropout = 0.1
[data]
dataset = "text"
path = "{}"
[train]
max_steps = 16
batch_size = 4
lr = 0.01
optimizer = "adamw"
grad_clip_norm = 0.5
log_every = 4
[checkpoint]
every_steps = 5
"#,
        text.display()
    );
    t.config("gpt", &job)
}

#[test]
fn recomputed_blocks_train_the_same_weights_and_resume_exactly() {
    let t = TestJob::new();
    let cfg = gpt(&t);
    same_weights_with_and_without(&t, &cfg, "rank=1,step=8,kind=preempt");
}

/// In bf16 the gpt recomputes its blocks through autograd, one at a time (as on a GPU).
#[test]
fn a_bf16_gpt_recomputes_its_blocks_through_autograd_to_the_same_weights() {
    let t = TestJob::new();
    let cfg = gpt(&t);
    let text = std::fs::read_to_string(&cfg).unwrap();
    let bf16 = text.replace("[train]\n", "[train]\nprecision = \"bf16\"\n");
    let cfg = t.config("gpt-bf16", &bf16);
    same_weights_with_and_without(&t, &cfg, "rank=0,step=6,kind=preempt");
}

/// Trains `cfg` on 2 workers with and without checkpointing (the same weights, bit for bit),
/// then with it, preempted by `fault` and resumed (the uninterrupted run's weights).
fn same_weights_with_and_without(t: &TestJob, cfg: &std::path::Path, fault: &str) {
    let on = ["--set", "train.activation_checkpointing=true"];
    let two = ["--nproc-per-node", "2"];
    t.run(cfg, &[&two[..], &["--name", "plain"]].concat())
        .success();
    t.run(cfg, &[&two[..], &on[..], &["--name", "whole"]].concat())
        .success();
    assert_same_bits(
        &t.job("plain").join("model.safetensors"),
        &t.job("whole").join("model.safetensors"),
    );
    preempt_resume_and_compare(t, cfg, &[&two[..], &on[..]].concat(), fault);
}

/// The llama recomputes its layers through autograd, one at a time: any precision.
#[test]
fn a_llama_recomputes_its_layers_to_the_same_weights() {
    let t = TestJob::new();
    let text = t.path("corpus.txt");
    std::fs::write(&text, corpus()).unwrap();
    let job = format!(
        r#"
seed = 2
[model]
arch = "llama"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 3
num_attention_heads = 4
num_key_value_heads = 2
block_size = 16
[data]
dataset = "text"
path = "{}"
[train]
max_steps = 12
batch_size = 4
lr = 0.01
optimizer = "adamw"
grad_clip_norm = 0.5
precision = "bf16"
log_every = 4
[checkpoint]
every_steps = 5
"#,
        text.display()
    );
    let cfg = t.config("llama", &job);
    same_weights_with_and_without(&t, &cfg, "rank=0,step=7,kind=preempt");
}

#[test]
fn a_model_that_cannot_recompute_is_refused() {
    let t = TestJob::new();
    let on = "train.activation_checkpointing=true";
    let mlp = t.config("mlp", crate::common::TINY);
    t.run(&mlp, &["--set", on])
        .fails_with(2, "model.arch = \"mlp\" does not recompute its activations");
    assert!(
        !t.jobs_dir().exists(),
        "a refused job created its directory"
    );
}
