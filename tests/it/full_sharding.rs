//! `distributed.sharding = "full"` (ZeRO-3) end to end: a gpt (f32 and bf16) and a llama
//! (layers kept and recomputed) on 2 and 3 workers, with accumulation and clipping, train the
//! `"gradients"` job's weights and optimizer state bit for bit, with the collectives inline or
//! overlapping the passes (the next block gathered ahead) (checkpoints streamed bucket by
//! bucket into the ordinary layout, evaluation gathering block by block on every rank alike);
//! SIGTERM and resume in the same mode, in another, on another world size; LoRA on a Qwen2
//! checkpoint with instruction data (examples of every length, padded per batch) and packed
//! rows; a killed worker restarted; a hang named.

use crate::common::{TestJob, assert_same_bits, corpus, load_weights, max_abs_diff};
use crate::finetune::{examples, job};
use crate::sharding::{gpt, llama, regex_free_replace, resumed_on_two_alike, same_checkpoints};

fn mode(name: &str) -> String {
    format!("distributed.sharding=\"{name}\"")
}

#[test]
fn fully_sharded_parameters_train_the_gradients_jobs_bits() {
    let t = TestJob::new();
    let text = t.path("corpus.txt");
    std::fs::write(&text, corpus()).unwrap();
    let gpt = t.config("gpt", &gpt(&text));
    let llama = t.config("llama", &llama(&text));
    let every = [
        "--set",
        "train.accumulation=2",
        "--set",
        "checkpoint.every_steps=2",
    ];
    let bf16 = [&every[..], &["--set", "train.precision=\"bf16\""]].concat();
    let recompute = [
        &every[..],
        &["--set", "train.activation_checkpointing=true"],
    ]
    .concat();
    for (model, cfg, extra) in [
        ("gpt", &gpt, &every[..]),
        ("gpt-bf16", &gpt, &bf16[..]),
        ("llama", &llama, &every[..]),
        ("llama-recomputed", &llama, &recompute[..]),
    ] {
        for n in ["2", "3"] {
            let name = |m: &str| format!("{model}-{n}-{m}");
            // "overlap": "full" with its collectives on a thread of their own.
            for m in ["gradients", "full", "overlap"] {
                let (sharding, overlap) = match m {
                    "overlap" => ("full", "distributed.overlap_comm=true"),
                    _ => (m, "distributed.overlap_comm=false"),
                };
                let args = [
                    "--nproc-per-node",
                    n,
                    "--set",
                    &mode(sharding),
                    "--set",
                    overlap,
                    "--name",
                    &name(m),
                ];
                let run = t.run(cfg, &[&args[..], extra].concat());
                run.success();
                let full = sharding == "full";
                assert_eq!(run.stdout.contains("(ZeRO-3)"), full, "{}", run.stdout);
                assert_eq!(
                    run.stdout.contains("parameters sharded too"),
                    full,
                    "{}",
                    run.stdout
                );
            }
            let weights = |m: &str| t.job(&name(m)).join("model.safetensors");
            assert_same_bits(&weights("gradients"), &weights("full"));
            assert_same_bits(&weights("full"), &weights("gradients"));
            assert_same_bits(&weights("overlap"), &weights("full"));
            same_checkpoints(&t, &name("gradients"), &name("full"));
            same_checkpoints(&t, &name("gradients"), &name("overlap"));
        }
    }
    // Within a millionth of the unsharded job (clipping's norm summed per rank).
    t.run(&llama, &["--nproc-per-node", "3", "--name", "plain"])
        .success();
    t.run(
        &llama,
        &[
            "--nproc-per-node",
            "3",
            "--set",
            &mode("full"),
            "--name",
            "one",
        ],
    )
    .success();
    let weights = |job: &str| load_weights(&t.job(job).join("model.safetensors"));
    let diff = max_abs_diff(&weights("plain"), &weights("one"));
    assert!(diff < 1e-6, "full and unsharded differ by {diff}");
    // Its weights are ordinary ones: sampled from as any job's.
    let jobs = t.jobs_dir().display().to_string();
    let sample = t.ddpjob(&["sample", "one", "--jobs-dir", &jobs, "--tokens", "8"]);
    sample.success();
    // The estimate says what a worker holds of the weights: 1/W and a layer beside the rest.
    let summary = t.json(&t.job("one").join("summary.json"));
    assert!(summary["estimated_peak_bytes"].as_u64().unwrap() > 1 << 20);
    let validate = |overlap: &str| {
        let overlap = format!("distributed.overlap_comm={overlap}");
        let run = t.ddpjob(&[
            "validate",
            llama.to_str().unwrap(),
            "--set",
            "distributed.nproc_per_node=3",
            "--set",
            &overlap,
        ]);
        run.success();
        run.stdout
            .contains("with distributed.sharding = \"full\" over 3 workers")
    };
    assert!(
        validate("false"),
        "\"full\" saves here, one layer at a time"
    );
    // Overlapping, both of its two layers are gathered at once: no saving to advise.
    assert!(!validate("true"));
}

#[test]
fn a_fully_sharded_job_resumes_exactly_in_any_mode_and_on_another_world_size() {
    let t = TestJob::new();
    let text = t.path("corpus.txt");
    std::fs::write(&text, corpus()).unwrap();
    let cfg = t.config("llama", &llama(&text));
    let jobs = t.jobs_dir().display().to_string();
    let full = [
        "--nproc-per-node",
        "3",
        "--set",
        "distributed.sharding=\"full\"",
    ];
    let plain = ["--nproc-per-node", "3"];
    let preempt = [("DDPJOB_FAULT", "rank=1,step=3,kind=preempt")];
    let cut = |name: &str, args: &[&str]| {
        t.run_env(&cfg, &[args, &["--name", name]].concat(), &preempt)
            .fails_with(143, "interrupted by SIGTERM");
    };
    t.run(&cfg, &[&full[..], &["--name", "whole"]].concat())
        .success();
    cut("again", &full);
    t.ddpjob(&["resume", "again", "--jobs-dir", &jobs])
        .success();
    assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &t.job("again").join("model.safetensors"),
    );
    // Into and out of "full" (job.toml edited), and from "gradients": the same bits, a
    // llama's layers giving whole-model autograd's gradients in every mode.
    for (name, first, then) in [
        ("off", &full[..], "none"),
        ("on", &plain[..], "full"),
        (
            "from-gradients",
            &[
                "--nproc-per-node",
                "3",
                "--set",
                "distributed.sharding=\"gradients\"",
            ][..],
            "full",
        ),
    ] {
        cut(name, first);
        let frozen = t.job(name).join("job.toml");
        let text = std::fs::read_to_string(&frozen).unwrap();
        let edited = regex_free_replace(&text, "sharding = ", &format!("\"{then}\""));
        std::fs::write(&frozen, edited).unwrap();
        t.ddpjob(&["resume", name, "--jobs-dir", &jobs]).success();
        assert_same_bits(
            &t.job("whole").join("model.safetensors"),
            &t.job(name).join("model.safetensors"),
        );
    }
    // On 2 workers after 3: the unsharded job's bits.
    resumed_on_two_alike(&t, cut, &full, &plain);
}

#[test]
fn a_killed_fully_sharded_worker_is_restarted_verify_traces_it_and_a_hang_names_the_all_gather() {
    let t = TestJob::new();
    let text = t.path("corpus.txt");
    std::fs::write(&text, corpus()).unwrap();
    let cfg = t.config("gpt", &gpt(&text));
    let full = [
        "--nproc-per-node",
        "2",
        "--set",
        "distributed.sharding=\"full\"",
    ];
    let every = ["--set", "checkpoint.every_steps=4"];
    t.run(
        &cfg,
        &[&full[..], &every[..], &["--name", "whole"]].concat(),
    )
    .success();
    // Restarted and hung with the collectives overlapping the passes: on their own thread.
    let overlap = ["--set", "distributed.overlap_comm=true"];
    let restarts = ["--set", "distributed.max_restarts=1", "--name", "restarted"];
    let run = t.run_env(
        &cfg,
        &[&full[..], &every[..], &overlap[..], &restarts[..]].concat(),
        &[("DDPJOB_FAULT", "rank=1,step=6,kind=kill")],
    );
    run.success();
    assert!(run.stderr.contains("restart 1/1"), "{}", run.stderr);
    assert_same_bits(
        &t.job("whole").join("model.safetensors"),
        &t.job("restarted").join("model.safetensors"),
    );
    // `verify` traces every step's weights, gathered on every rank for rank 0 to digest.
    let verified = t.ddpjob(&[
        "verify",
        cfg.to_str().unwrap(),
        "--world-sizes",
        "2,2",
        "--steps",
        "3",
        "--set",
        "distributed.sharding=\"full\"",
    ]);
    verified.success();
    // A rank that hangs leaves the others gathering the next step's parameters.
    let hung = ["--name", "hung", "--set", "distributed.timeout_s=3"];
    let run = t.run_env(
        &cfg,
        &[&full[..], &overlap[..], &hung[..]].concat(),
        &[("DDPJOB_FAULT", "rank=1,step=5,kind=hang")],
    );
    run.fails_with(1, "did not complete within 3 s (distributed.timeout_s)")
        .fails_with(1, "collective `all_gather` #")
        .fails_with(1, "did not arrive: rank 1 (pid");
}

/// LoRA adapters on a Qwen2 checkpoint, instruction data whose batches each rank pads to its
/// own longest example (so the ranks' evaluation batches differ in width), unpacked and packed:
/// the `"gradients"` job's adapters, checkpoints of what trains only, evaluation in lockstep.
#[test]
fn fully_sharded_lora_on_instruction_data_trains_the_gradients_jobs_adapters() {
    let t = TestJob::new();
    let data = examples(&t);
    let train = "max_steps = 6\neval_every = 3";
    for (name, extra) in [("plain", ""), ("packed", "pack = true")] {
        let cfg = t.config(name, &job(&data, extra, train));
        for m in ["gradients", "full"] {
            let (sharding, job_name) = (mode(m), format!("{name}-{m}"));
            let args = [
                "--nproc-per-node",
                "2",
                "--set",
                &sharding,
                "--set",
                "checkpoint.every_steps=3",
                "--name",
                &job_name,
            ];
            let run = t.run(&cfg, &args);
            run.success();
            // The base is frozen, so not in the sharded buckets: the log says it is kept whole.
            let whole = "frozen values (model.freeze, LoRA's base) are not sharded";
            assert_eq!(run.stdout.contains(whole), m == "full", "{}", run.stdout);
        }
        let weights = |m: &str| t.job(&format!("{name}-{m}")).join("model.safetensors");
        assert_same_bits(&weights("gradients"), &weights("full"));
        same_checkpoints(&t, &format!("{name}-gradients"), &format!("{name}-full"));
        // The same evaluations (each rank's padding scored, never counted).
        let evals = |m: &str| -> Vec<f64> {
            let path = t.job(&format!("{name}-{m}")).join("metrics.jsonl");
            let text = std::fs::read_to_string(path).unwrap();
            let records = text.lines().map(|l| serde_json::from_str(l).unwrap());
            records
                .filter_map(|r: serde_json::Value| r["test_loss"].as_f64())
                .collect()
        };
        let (sharded, streamed) = (evals("full"), evals("gradients"));
        assert!(sharded.len() >= 2, "{name}: {sharded:?}");
        assert_eq!(sharded.len(), streamed.len());
        for (a, b) in sharded.iter().zip(&streamed) {
            assert!(
                (a - b).abs() <= 1e-9 * b.abs(),
                "{name}: {sharded:?} {streamed:?}"
            );
        }
    }
}
