//! `distributed.sharding = "optimizer"` (ZeRO-1) and `"gradients"` (ZeRO-2) end to end: the
//! same weights and optimizer state as an unsharded job (bit for bit without clipping, 1e-6
//! with), on 2 and 3 workers, with accumulation and bf16, models that hand their gradients
//! over block by block (a gpt, a llama) on workers of one and two threads; SIGTERM and resume,
//! resume in another mode and on another world size, a killed worker restarted; `"full"` on a
//! model without blocks refused (`"full"` itself: `full_sharding.rs`).

use std::path::Path;

use crate::common::{TestJob, assert_same_bits, corpus, load_weights, max_abs_diff};

const MLP: &str = r#"
seed = 3
[model]
arch = "mlp"
hidden = [32]
[data]
dataset = "synthetic"
[data.synthetic]
train_samples = 512
test_samples = 128
shape = [1, 8, 8]
classes = 4
noise = 0.8
[train]
epochs = 2
batch_size = 16
accumulation = 2
lr = 0.01
optimizer = "adamw"
log_every = 4
[checkpoint]
every_steps = 4
keep_last = 0
[distributed]
bucket_mb = 0.001
"#;

pub(crate) fn gpt(text: &Path) -> String {
    format!(
        r#"
seed = 11
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
max_steps = 12
batch_size = 6
lr = 0.01
optimizer = "adamw"
weight_decay = 0.1
grad_clip_norm = 0.5
log_every = 4
[distributed]
bucket_mb = 0.002
"#,
        text.display()
    )
}

fn sharded(n: &str) -> Vec<&str> {
    sharded_as("optimizer", n)
}

fn sharded_as<'a>(mode: &str, n: &'a str) -> Vec<&'a str> {
    let set = match mode {
        "optimizer" => "distributed.sharding=\"optimizer\"",
        "gradients" => "distributed.sharding=\"gradients\"",
        other => panic!("no sharding mode {other} in these tests"),
    };
    vec!["--nproc-per-node", n, "--set", set]
}

/// Every checkpoint's weights and optimizer state have the same bits in jobs `a` and `b`.
pub(crate) fn same_checkpoints(t: &TestJob, a: &str, b: &str) {
    let dirs = std::fs::read_dir(t.job(a).join("checkpoints")).unwrap();
    let mut compared = 0;
    for dir in dirs {
        let dir = dir.unwrap().file_name();
        if !dir.to_string_lossy().starts_with("step-") {
            continue; // `latest`: a pointer to one of them
        }
        for file in ["model.safetensors", "optimizer.safetensors"] {
            let path = |job: &str| t.job(job).join("checkpoints").join(&dir).join(file);
            assert_same_bits(&path(a), &path(b));
            compared += 1;
        }
    }
    assert!(compared >= 4, "only {compared} files compared");
}

#[test]
fn sharded_optimizer_state_trains_the_unsharded_weights_bit_for_bit() {
    let t = TestJob::new();
    let cfg = t.config("mlp", MLP);
    for n in ["2", "3"] {
        let plain = format!("plain{n}");
        t.run(&cfg, &["--nproc-per-node", n, "--name", &plain])
            .success();
        for (mode, stage) in [("optimizer", "ZeRO-1"), ("gradients", "ZeRO-2")] {
            let shard = format!("{mode}{n}");
            let run = t.run(
                &cfg,
                &[&sharded_as(mode, n)[..], &["--name", &shard]].concat(),
            );
            run.success();
            assert!(
                run.stdout.contains(&format!(
                    "optimizer state sharded over {n} workers ({stage})"
                )),
                "{}",
                run.stdout
            );
            // The mlp's gradients come from autograd all at once: said, and no harm done.
            assert_eq!(
                run.stdout.contains("forms its gradients all at once"),
                mode == "gradients",
                "{}",
                run.stdout
            );
            assert_same_bits(
                &t.job(&plain).join("model.safetensors"),
                &t.job(&shard).join("model.safetensors"),
            );
            // Gathered for checkpoints: the unsharded job's optimizer state, in its layout.
            same_checkpoints(&t, &plain, &shard);
        }
    }
    // bf16 computes the passes; averaging and the update stay f32, sharded or not.
    let bf16 = ["--set", "train.precision=\"bf16\""];
    t.run(
        &cfg,
        &[&bf16[..], &["--nproc-per-node", "2", "--name", "bf16"]].concat(),
    )
    .success();
    t.run(
        &cfg,
        &[&bf16[..], &sharded("2")[..], &["--name", "bf16s"]].concat(),
    )
    .success();
    assert_same_bits(
        &t.job("bf16").join("model.safetensors"),
        &t.job("bf16s").join("model.safetensors"),
    );
}

/// A GPT with dropout and clipping by the global norm (summed per rank, then across ranks),
/// on 3 workers whose shards cut tensors apart: within 1e-6 of the unsharded weights (the
/// norms are f64 sums of exact squares, so the f32 coefficient is in practice the same: this
/// job ends bit-identical, where f32 partial sums left it 4e-5 apart after 12 steps).
#[test]
fn a_clipped_gpt_sharded_three_ways_stays_within_a_millionth() {
    let t = TestJob::new();
    let text = t.path("corpus.txt");
    std::fs::write(&text, corpus()).unwrap();
    let cfg = t.config("gpt", &gpt(&text));
    t.run(&cfg, &["--nproc-per-node", "3", "--name", "plain"])
        .success();
    t.run(&cfg, &[&sharded("3")[..], &["--name", "shard"]].concat())
        .success();
    let weights = |job: &str| load_weights(&t.job(job).join("model.safetensors"));
    let diff = max_abs_diff(&weights("plain"), &weights("shard"));
    assert!(diff < 1e-6, "sharded and unsharded differ by {diff}");
    // Each rank's measured peak, and the estimate that `validate` prints, beside it.
    let summary = t.json(&t.job("shard").join("summary.json"));
    let peaks = summary["peak_rss_bytes"].as_array().unwrap();
    assert_eq!(peaks.len(), 3);
    assert!(
        peaks.iter().all(|p| p.as_u64().unwrap() > 1 << 20),
        "{peaks:?}"
    );
    assert!(summary["estimated_peak_bytes"].as_u64().unwrap() > 1 << 20);
    let validate = t.ddpjob(&[
        "validate",
        cfg.to_str().unwrap(),
        "--set",
        "distributed.nproc_per_node=3",
    ]);
    validate.success();
    // The gpt hands its gradients over block by block: "gradients" saves more again.
    assert!(
        validate.stdout.contains("memory_per_worker = ")
            && validate
                .stdout
                .contains("with distributed.sharding = \"optimizer\" over 3 workers")
            && validate
                .stdout
                .contains("with distributed.sharding = \"gradients\" over 3 workers"),
        "{}",
        validate.stdout
    );
}

/// A gpt (its hand-written pass; in bf16 block by block through autograd) and a llama (layer
/// by layer, its layers recomputed too) hand each block's gradients over while their backward
/// runs; the buckets reduced then give the `"optimizer"` job's bits (the same sums, clipped
/// alike) and the unsharded job's within a millionth, with accumulation, on workers of one
/// thread and of two (row shards handing over side by side).
#[test]
fn gradients_handed_over_block_by_block_keep_the_sharded_and_unsharded_weights() {
    let t = TestJob::new();
    let text = t.path("corpus.txt");
    std::fs::write(&text, corpus()).unwrap();
    let gpt = t.config("gpt", &gpt(&text));
    let llama = t.config("llama", &llama(&text));
    // The gpt in bf16 goes block by block through autograd (its hand-written pass is f32).
    let bf16 = [
        "--set",
        "train.accumulation=2",
        "--set",
        "train.precision=\"bf16\"",
    ];
    let f32 = &bf16[..2];
    let recompute = [f32, &["--set", "train.activation_checkpointing=true"]].concat();
    for (model, cfg, extra) in [
        ("gpt", &gpt, f32),
        ("llama", &llama, f32),
        ("llama-recomputed", &llama, &recompute[..]),
        ("gpt-bf16", &gpt, &bf16[..]),
    ] {
        for threads in ["1", "2"] {
            let env = [("RAYON_NUM_THREADS", threads)];
            let name = |mode: &str| format!("{model}-{mode}-{threads}");
            let plain = ["--nproc-per-node", "3"];
            t.run_env(
                cfg,
                &[&plain, extra, &["--name", &name("none")]].concat(),
                &env,
            )
            .success();
            for mode in ["optimizer", "gradients"] {
                let args = [&sharded_as(mode, "3")[..], extra, &["--name", &name(mode)]];
                let run = t.run_env(cfg, &args.concat(), &env);
                run.success();
                assert!(!run.stdout.contains("all at once"), "{}", run.stdout);
            }
            let weights = |mode: &str| t.job(&name(mode)).join("model.safetensors");
            assert_same_bits(&weights("optimizer"), &weights("gradients"));
            let diff = max_abs_diff(
                &load_weights(&weights("none")),
                &load_weights(&weights("gradients")),
            );
            assert!(diff < 1e-6, "{model}, {threads} thread(s): {diff}");
        }
    }
}

pub(crate) fn llama(text: &Path) -> String {
    format!(
        r#"
seed = 11
[model]
arch = "llama"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
block_size = 16
tie_word_embeddings = true
[data]
dataset = "text"
path = "{}"
tokenizer = "char"
[train]
max_steps = 6
batch_size = 6
lr = 0.01
optimizer = "adamw"
grad_clip_norm = 0.5
log_every = 3
[distributed]
bucket_mb = 0.002
"#,
        text.display()
    )
}

#[test]
fn a_sharded_job_resumes_exactly_in_either_mode_and_on_another_world_size() {
    let t = TestJob::new();
    let cfg = t.config("mlp", MLP);
    let jobs = t.jobs_dir().display().to_string();
    let preempt = [("DDPJOB_FAULT", "rank=1,step=6,kind=preempt")];
    let cut = |name: &str, args: &[&str]| {
        t.run_env(&cfg, &[args, &["--name", name]].concat(), &preempt)
            .fails_with(143, "interrupted by SIGTERM");
    };
    t.run(&cfg, &["--nproc-per-node", "3", "--name", "whole"])
        .success();
    // Preempted sharded, resumed sharded: the uninterrupted job's bits.
    cut("again", &sharded("3"));
    t.ddpjob(&["resume", "again", "--jobs-dir", &jobs])
        .success();
    assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &t.job("again").join("model.safetensors"),
    );
    // Preempted with gradients streamed, resumed so: the same.
    cut("streamed", &sharded_as("gradients", "3"));
    t.ddpjob(&["resume", "streamed", "--jobs-dir", &jobs])
        .success();
    assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &t.job("streamed").join("model.safetensors"),
    );
    // Preempted sharded, resumed unsharded (job.toml edited), and the other way round; from
    // one sharded mode to the other.
    for (name, first, then) in [
        ("off", sharded("3"), "none"),
        ("on", vec!["--nproc-per-node", "3"], "optimizer"),
        ("switched", sharded("3"), "gradients"),
    ] {
        cut(name, &first);
        let frozen = t.job(name).join("job.toml");
        let text = std::fs::read_to_string(&frozen).unwrap();
        let mode = regex_free_replace(&text, "sharding = ", &format!("\"{then}\""));
        std::fs::write(&frozen, mode).unwrap();
        t.ddpjob(&["resume", name, "--jobs-dir", &jobs]).success();
        assert_same_bits(
            &t.job("whole").join("model.safetensors"),
            &t.job(name).join("model.safetensors"),
        );
    }
    // On 2 workers after 3: the same bits whether the state was sharded or not.
    resumed_on_two_alike(&t, cut, &sharded("3"), &["--nproc-per-node", "3"]);
}

/// Jobs `cut` (preempted) on 3 workers with `sharded` and with `plain` arguments, both
/// resumed on 2: the same bits.
pub(crate) fn resumed_on_two_alike(
    t: &TestJob,
    cut: impl Fn(&str, &[&str]),
    sharded: &[&str],
    plain: &[&str],
) {
    let jobs = t.jobs_dir().display().to_string();
    cut("shrunk", sharded);
    cut("shrunk-plain", plain);
    for name in ["shrunk", "shrunk-plain"] {
        t.ddpjob(&["resume", name, "--jobs-dir", &jobs, "--nproc-per-node", "2"])
            .success();
    }
    assert_same_bits(
        &t.job("shrunk-plain").join("model.safetensors"),
        &t.job("shrunk").join("model.safetensors"),
    );
}

/// `key = <anything>` replaced by `key = value` on its line.
pub(crate) fn regex_free_replace(text: &str, key: &str, value: &str) -> String {
    text.lines()
        .map(|l| match l.starts_with(key) {
            true => format!("{key}{value}"),
            false => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_killed_sharded_worker_is_restarted_from_the_gathered_checkpoint() {
    let t = TestJob::new();
    let cfg = t.config("mlp", MLP);
    t.run(&cfg, &["--nproc-per-node", "2", "--name", "whole"])
        .success();
    for mode in ["optimizer", "gradients"] {
        let name = format!("restarted-{mode}");
        let restarts = ["--set", "distributed.max_restarts=1", "--name", &name];
        let run = t.run_env(
            &cfg,
            &[&sharded_as(mode, "2")[..], &restarts[..]].concat(),
            &[("DDPJOB_FAULT", "rank=1,step=10,kind=kill")],
        );
        run.success();
        assert!(run.stderr.contains("restart 1/1"), "{}", run.stderr);
        assert_same_bits(
            &t.job("whole").join("model.safetensors"),
            &t.job(&name).join("model.safetensors"),
        );
    }
}

#[test]
fn a_sharding_mode_that_cannot_apply_is_refused_before_anything_is_created() {
    let t = TestJob::new();
    let cfg = t.config("mlp", MLP);
    for (mode, says) in [
        ("full", "model.arch = \"mlp\" has none: use \"gradients\""),
        ("zero1", "distributed.sharding"),
    ] {
        let set = format!("distributed.sharding=\"{mode}\"");
        t.run(&cfg, &["--set", &set]).fails_with(2, says);
    }
    assert!(
        !t.jobs_dir().exists(),
        "a refused job created its directory"
    );
}

/// A rank that hangs mid-step leaves the others in the new collective (here run from the
/// backward's hand-over), which the launcher names with its number, as it names an all-reduce.
#[test]
fn a_hang_in_a_sharded_step_names_the_reduce_scatter() {
    let t = TestJob::new();
    let cfg = t.config("mlp", MLP);
    let run = t.run_env(
        &cfg,
        &[
            &sharded_as("gradients", "3")[..],
            &["--name", "hung", "--set", "distributed.timeout_s=3"],
        ]
        .concat(),
        &[("DDPJOB_FAULT", "rank=1,step=5,kind=hang")],
    );
    run.fails_with(1, "did not complete within 3 s (distributed.timeout_s)")
        .fails_with(1, "collective `reduce_scatter_mean` #")
        .fails_with(1, "did not arrive: rank 1 (pid");
}
