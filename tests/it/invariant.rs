//! `distributed.deterministic = "world-size-invariant"`: the same weights, bit for bit, on 1, 2
//! and 4 workers, and across a preemption and a resume on another world size (real runs of the
//! binary, real worker processes).

use crate::common::{TINY, TestJob};

/// A GPT with dropout, AdamW and clipping, on text the test writes.
fn gpt_job(t: &TestJob) -> String {
    let text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to \
                suffer the slings and arrows of outrageous fortune.\n"
        .repeat(40);
    let data = t.path("text.txt");
    std::fs::write(&data, text).unwrap();
    format!(
        r#"seed = 5
[model]
arch = "gpt"
n_layer = 2
n_head = 2
n_embd = 32
block_size = 32
dropout = 0.1
[data]
dataset = "text"
path = "{}"
[train]
epochs = 1
global_batch_size = 16
lr = 0.002
optimizer = "adamw"
grad_clip_norm = 0.5
log_every = 2
eval_batches = 1
[distributed]
deterministic = "world-size-invariant"
virtual_shards = 8
"#,
        data.display()
    )
}

#[test]
fn a_gpt_trains_to_the_same_weights_on_one_two_and_four_workers() {
    let t = TestJob::new();
    let cfg = t.config("gpt", &gpt_job(&t));
    let cfg = cfg.to_str().unwrap();
    let same = t.ddpjob(&["verify", cfg, "--world-sizes", "1,2,4", "--steps", "6"]);
    same.success();
    assert!(
        same.stdout
            .contains("bit-identical weights at every one of 6 steps on 1, 2, 4 worker(s)"),
        "{}",
        same.stdout
    );
    // The same job in the default mode parts at once: the check can fail. (A failed check
    // keeps its runs for a look: in the test's directory, not the system's temporary one.)
    let (parted_runs, scrambled_runs) = (t.path("parted"), t.path("scrambled"));
    let parted = t.ddpjob(&[
        "verify",
        cfg,
        "--world-sizes",
        "1,2",
        "--steps",
        "2",
        "--set",
        "distributed.deterministic=run",
        "--jobs-dir",
        parted_runs.to_str().unwrap(),
    ]);
    parted.fails_with(1, "differs between 1 and 2 worker(s)");
    // A rank that sums its pieces out of order at step 3 (a deliberate bug) is caught there.
    let scrambled: crate::common::Run = t
        .command(
            &[
                "verify",
                cfg,
                "--world-sizes",
                "1,2",
                "--steps",
                "4",
                "--jobs-dir",
                scrambled_runs.to_str().unwrap(),
            ],
            &[("DDPJOB_FAULT", "rank=0,step=3,kind=piece-order")],
        )
        .output()
        .unwrap()
        .into();
    scrambled.fails_with(1, "step 3: `");
}

/// Preempted on 4 workers, resumed on 2: the final weights are the uninterrupted 1-worker run's,
/// bit for bit, and so is the final evaluation (batches of 10 dealt over the ranks; scored by
/// rows and summed over ranks as the default mode does, its loss differs in the last digits:
/// 1.29714802862145 on 1 worker, 1.2971480316482484 on 2, for this job at 6 steps). A world
/// size that does not divide the pieces is refused.
#[test]
fn a_resume_on_another_world_size_ends_with_the_uninterrupted_weights() {
    let t = TestJob::new();
    let text = TINY.replace(
        "batch_size = 32",
        "global_batch_size = 16\ngrad_clip_norm = 1.0\neval_batch_size = 10",
    ) + "[distributed]\ndeterministic = \"world-size-invariant\"\nvirtual_shards = 4\n";
    let cfg = t.config("job", &text);
    t.run_env(&cfg, &["--nproc-per-node", "1", "--name", "whole"], &[])
        .success();
    t.run_env(
        &cfg,
        &["--nproc-per-node", "4", "--name", "cut"],
        &[("DDPJOB_FAULT", "rank=0,step=7,kind=preempt")],
    )
    .fails_with(143, "after checkpoint `step-00000007`");
    let jobs = t.jobs_dir().to_string_lossy().into_owned();
    let resume = |nproc: &str| {
        t.ddpjob(&[
            "resume",
            "cut",
            "--jobs-dir",
            &jobs,
            "--nproc-per-node",
            nproc,
        ])
    };
    resume("3").fails_with(
        2,
        "virtual_shards = 4 pieces, which 3 workers cannot share evenly",
    );
    let resumed = resume("2");
    resumed.success();
    // The log says what happens: the same batch, the same weights.
    let said = "world size changed from 4 to 2: global batch 16 kept";
    let stdout = &resumed.stdout;
    assert!(stdout.contains(said), "{stdout}");
    assert!(
        stdout.contains("the weights stay bit-identical"),
        "{stdout}"
    );
    let weights = |job: &str| std::fs::read(t.job(job).join("model.safetensors")).unwrap();
    assert!(
        weights("whole") == weights("cut"),
        "the resumed run's weights differ from the uninterrupted run's"
    );
    let metrics = |job: &str| {
        let summary = t.json(&t.job(job).join("summary.json"));
        let loss = summary["test_loss"].as_f64().expect("a test loss");
        (loss.to_bits(), summary["test_accuracy"].to_string())
    };
    assert_eq!(metrics("whole"), metrics("cut"));
    let state = t.json(&t.job("cut").join("state.json"));
    assert_eq!(
        state["step"],
        t.json(&t.job("whole").join("state.json"))["step"]
    );

    // `job.toml` edited to cut the batch into other pieces: every sum changes, so nothing
    // is promised, and the log says why (it promised the same weights).
    t.run_env(
        &cfg,
        &["--nproc-per-node", "2", "--name", "edited"],
        &[("DDPJOB_FAULT", "rank=0,step=7,kind=preempt")],
    )
    .fails_with(143, "after checkpoint `step-00000007`");
    let frozen = t.job("edited").join("job.toml");
    let text = std::fs::read_to_string(&frozen).unwrap();
    std::fs::write(
        &frozen,
        text.replace("virtual_shards = 4", "virtual_shards = 2"),
    )
    .unwrap();
    let args = [
        "resume",
        "edited",
        "--jobs-dir",
        &jobs,
        "--nproc-per-node",
        "1",
    ];
    let resumed = t.ddpjob(&args);
    resumed.success();
    let stdout = &resumed.stdout;
    assert!(
        !stdout.contains("the weights stay bit-identical"),
        "{stdout}"
    );
    // Said once, with its reason (the world size changed too).
    assert_eq!(
        stdout.matches("will not be bit-identical").count(),
        1,
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "distributed.virtual_shards changed from 4 to 2: the result will not be \
             bit-identical to an uninterrupted run"
        ),
        "{stdout}"
    );
}

#[test]
fn what_the_mode_cannot_do_is_refused_naming_the_key() {
    let t = TestJob::new();
    let base = "[distributed]\ndeterministic = \"world-size-invariant\"\n";
    let no_global = t.config("a", &(TINY.to_string() + base));
    t.ddpjob(&["validate", no_global.to_str().unwrap()])
        .fails_with(2, "give train.global_batch_size");
    let text = TINY.replace(
        "batch_size = 32",
        "global_batch_size = 12\naccumulation = 2",
    ) + base
        + "virtual_shards = 6\nsharding = \"optimizer\"\n";
    let bad = t.config("b", &text);
    let run = t.ddpjob(&["validate", bad.to_str().unwrap()]);
    run.fails_with(2, "distributed.virtual_shards");
    for expected in [
        "must be a power of two",
        "set it to 1",
        "a sharded optimizer reduce-scatters gradients",
    ] {
        assert!(run.stderr.contains(expected), "{expected}: {}", run.stderr);
    }
    // Fewer samples than one global batch: no whole batch to train on, said before the job
    // exists.
    let text = TINY
        .replace("train_samples = 512", "train_samples = 40")
        .replace("batch_size = 32", "global_batch_size = 64")
        + base;
    let small = t.config("c", &text);
    t.run_env(&small, &["--name", "small"], &[]).fails_with(
        2,
        "the 40 training samples are fewer than train.global_batch_size = 64",
    );
    assert!(!t.job("small").exists());
}

/// `validate`'s memory lines offer only what the mode allows: no sharding (which it refuses),
/// as they do for the same job without it.
#[test]
fn memory_advice_offers_no_sharding_the_mode_refuses() {
    let t = TestJob::new();
    let text = TINY.replace("batch_size = 32", "global_batch_size = 32");
    let validate = |name: &str, text: String| {
        let cfg = t.config(name, &text);
        let run = t.ddpjob(&["validate", cfg.to_str().unwrap(), "--nproc-per-node", "2"]);
        run.success();
        run.stdout
    };
    let plain = validate("plain", text.clone());
    assert!(plain.contains("with distributed.sharding = "), "{plain}");
    let invariant = validate(
        "invariant",
        text + "[distributed]\ndeterministic = \"world-size-invariant\"\n",
    );
    assert!(invariant.contains("memory_per_worker"), "{invariant}");
    assert!(
        !invariant.contains("with distributed.sharding"),
        "{invariant}"
    );
}

/// Instruction data: examples of different lengths, each rank's batch padded to its own
/// longest. A piece is cut to its own longest row, so 1 and 2 workers train the same bits
/// (before, a piece carried the padding of the rank's batch, and its bits changed with it).
#[test]
fn instruction_examples_train_the_same_bits_on_one_and_two_workers() {
    let t = TestJob::new();
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let config = format!(
        r#"seed = 2
[model]
init_from = "{}"
[data]
dataset = "jsonl"
train_path = "{}"
val_path = "{}"
completion_field = "chosen"
[train]
epochs = 2
global_batch_size = 8
lr = 0.003
optimizer = "adamw"
log_every = 3
[distributed]
deterministic = "world-size-invariant"
virtual_shards = 4
"#,
        fixtures.join("chat/model").display(),
        fixtures.join("dpo/prefs.jsonl").display(),
        fixtures.join("dpo/prefs-val.jsonl").display()
    );
    for (name, workers) in [("one", "1"), ("two", "2")] {
        let cfg = t.config(name, &config);
        t.run(&cfg, &["--nproc-per-node", workers]).success();
    }
    crate::common::assert_same_bits(
        &t.job("one").join("model.safetensors"),
        &t.job("two").join("model.safetensors"),
    );
}
