use std::path::Path;

use candle_core::Device;

use super::*;

fn gpt_job(extra: &[&str]) -> (JobSpec, Box<dyn Model>) {
    gpt_job_with("batch_size = 8", extra)
}

/// The small GPT job with `batch` as its batch line (`batch_size` or `global_batch_size`).
fn gpt_job_with(batch: &str, extra: &[&str]) -> (JobSpec, Box<dyn Model>) {
    // A file of its own: tests run side by side, and one would read another's while it is
    // being written.
    static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("ddpjob-memory-{}-{n}.txt", std::process::id());
    let text = std::env::temp_dir().join(name);
    std::fs::write(
        &text,
        "to be or not to be, that is the question. ".repeat(40),
    )
    .unwrap();
    let config = format!(
        "[model]\narch = \"gpt\"\nn_layer = 4\nn_head = 2\nn_embd = 32\nblock_size = 16\n\
         [data]\ndataset = \"text\"\npath = \"{}\"\n[train]\n{batch}\noptimizer = \"adamw\"\n",
        text.display()
    );
    let overrides: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let spec = crate::config::load_str(Path::new("m.toml"), config, &overrides)
        .unwrap()
        .spec;
    let data = crate::task::load(&spec, None).unwrap();
    // The text is read in by now; the file is not left behind in the temporary directory.
    std::fs::remove_file(&text).unwrap();
    let model = crate::models::build(
        &spec.model,
        data.input(),
        0,
        &Device::Cpu,
        spec.train.precision,
        false,
    )
    .unwrap();
    (spec, model)
}

/// What each setting changes: sharding divides the optimizer state and the averaged gradient
/// by the workers, each row shard holds a gradient, checkpointing keeps a fraction of the
/// activations, a model that does not say leaves them out of the total.
#[test]
fn the_estimate_follows_sharding_threads_and_checkpointing() {
    let (spec, model) = gpt_job(&[]);
    let p = model.params().element_count() as u64;
    let plain = estimate(&spec, model.as_ref(), Layout::of(&spec, 4, 1));
    assert_eq!(plain.weights, 4 * p);
    assert_eq!(plain.optimizer, 8 * p);
    assert_eq!(plain.gradients, 8 * p, "one shard's and the averaged one");
    let (sharded_spec, _) = gpt_job(&["distributed.sharding=\"optimizer\""]);
    let sharded = estimate(
        &sharded_spec,
        model.as_ref(),
        Layout::of(&sharded_spec, 4, 1),
    );
    assert_eq!(sharded.optimizer, 2 * p);
    assert_eq!(sharded.gradients, 4 * p + p);
    let threads = estimate(&spec, model.as_ref(), Layout::of(&spec, 1, 3));
    assert_eq!(threads.gradients, 3 * 4 * p + 4 * p);
    // Streamed gradients: a shard holds what the pass keeps in flight and a bucket, not the
    // whole gradient (with accumulation, the earlier micro-batches' sum too).
    let (streamed_spec, _) = gpt_job(&[
        "distributed.sharding=\"gradients\"",
        "distributed.bucket_mb=0.004",
    ]);
    let held = model.stream_gradients().unwrap() as u64;
    let streamed = estimate(
        &streamed_spec,
        model.as_ref(),
        Layout::of(&streamed_spec, 4, 2),
    );
    assert!(held + 1000 < p, "{held} of {p}");
    assert_eq!(streamed.optimizer, 2 * p);
    assert_eq!(streamed.gradients, 2 * 4 * (held + 1000) + p);
    let (accumulating, _) = gpt_job(&[
        "distributed.sharding=\"gradients\"",
        "distributed.bucket_mb=0.004",
        "train.accumulation=2",
    ]);
    let layout = Layout::of(&accumulating, 4, 2);
    let summed = estimate(&accumulating, model.as_ref(), layout).gradients;
    assert_eq!(summed, streamed.gradients + 4 * p);
    // On one worker nothing is shared, so nothing streams.
    let alone = estimate(
        &streamed_spec,
        model.as_ref(),
        Layout::of(&streamed_spec, 1, 1),
    );
    assert_eq!(alone.gradients, 8 * p);
    let full = plain.activations.unwrap();
    let layout = Layout {
        checkpointing: true,
        ..Layout::of(&spec, 4, 1)
    };
    let kept = estimate(&spec, model.as_ref(), layout).activations.unwrap();
    assert!(kept < full, "{kept} vs {full}");
    assert!(
        plain.describe().contains("(batch 8 x 16 positions)"),
        "{}",
        plain.describe()
    );
    assert_eq!(
        plain.total().unwrap(),
        plain.weights + plain.gradients + plain.optimizer + full + plain.runtime
    );
    let (_, bf16) = gpt_job(&["train.precision=\"bf16\""]);
    let unknown = estimate(&spec, bf16.as_ref(), Layout::of(&spec, 1, 1));
    assert_eq!(unknown.total(), None);
    assert!(unknown.describe().contains("activations not estimated"));
}

/// World-size-invariant training keeps the tree's partial sums of a worker's pieces (log2 of
/// them) beside the pieces in flight (one per thread) and the sum being formed, the
/// activations of the pieces in flight only, and flattens its sum for the tree over ranks (in
/// place between tcp's partners).
#[test]
fn invariant_training_counts_the_partial_sums_and_the_exchange() {
    let (spec, model) = gpt_job_with(
        "global_batch_size = 16",
        &[
            "distributed.deterministic=world-size-invariant",
            // CPU workers (tcp's in-place sums), also in a build with GPU support.
            "distributed.device=cpu",
            "distributed.virtual_shards=16",
        ],
    );
    let p = model.params().element_count() as u64;
    let spec = spec.for_world_size(2).unwrap();
    let at = |threads| estimate(&spec, model.as_ref(), Layout::of(&spec, 2, threads));
    // 8 pieces of 1 row a worker: 3 partial sums, 1 or 2 pieces in flight, 1 being formed;
    // and the summed gradient.
    assert_eq!(at(1).gradients, 4 * p * 5 + 4 * p);
    assert_eq!(at(2).gradients, 4 * p * 6 + 4 * p);
    let per_sample = model.activation_bytes_per_sample(false).unwrap();
    assert_eq!(at(2).activations, Some((2.0 * per_sample) as u64));
    assert_eq!(at(1).runtime, RUNTIME_BYTES + 2 * 4 * p);
}

/// `sharding = "full"`: a worker's pieces of every parameter, the largest block gathered (three
/// when the collectives overlap the passes, on CPU workers) and the rest (tables, final norm) whole;
/// activations and gradients counted as the larger of the
/// two, the backward freeing each block's graph as the pieces grow.
#[test]
fn fully_sharded_weights_are_a_share_a_block_and_the_rest() {
    // CPU workers, also in a build with GPU support (overlapping is theirs only).
    let cpu = "distributed.device=cpu";
    let (spec, model) = gpt_job(&["distributed.sharding=\"full\"", cpu]);
    let p = model.params().element_count() as u64;
    let blocks = model.shard_parameters().unwrap();
    let params: Vec<u64> = model
        .params()
        .vars()
        .map(|v| v.elem_count() as u64)
        .collect();
    let block: u64 = blocks[0].iter().map(|&i| params[i]).sum();
    let in_blocks = block * blocks.len() as u64;
    let full = estimate(&spec, model.as_ref(), Layout::of(&spec, 4, 1));
    assert_eq!(full.weights, 4 * (p - in_blocks + block + p / 4));
    // Overlapping the passes (CPU workers only): the block ahead and the one let go late too,
    // and two buckets of gradients waiting.
    let overlap = "distributed.overlap_comm=true";
    let (overlapped, _) = gpt_job(&["distributed.sharding=\"full\"", overlap, cpu]);
    let three = estimate(&overlapped, model.as_ref(), Layout::of(&overlapped, 4, 1));
    assert_eq!(three.weights, 4 * (p - in_blocks + 3 * block + p / 4));
    let bucket = (overlapped.distributed.bucket_bytes as u64).min(4 * p);
    assert_eq!(three.runtime, full.runtime + 2 * bucket);
    assert_eq!(full.optimizer, 2 * p);
    let (a, g) = (full.activations.unwrap(), full.gradients);
    let known = full.weights + full.optimizer + full.runtime;
    assert_eq!(full.total().unwrap(), known + a.max(g));
    assert!(full.describe().contains("the larger counted"));
    // On one worker nothing is shared.
    let alone = estimate(&spec, model.as_ref(), Layout::of(&spec, 1, 1));
    assert_eq!(alone.weights, 4 * p);
    assert!(!alone.activations_or_gradients);
}

/// CPU workers on one machine: refused only when their estimates together exceed what the
/// machine has available, each given its share; the message names the workers and the way out.
#[test]
fn cpu_workers_that_cannot_share_the_machine_are_refused() {
    let (spec, model) = gpt_job(&[]);
    let layout = Layout::of(&spec, 2, 1);
    let need = estimate(&spec, model.as_ref(), layout).total().unwrap();
    assert!(fit::check_host(&spec, model.as_ref(), layout, 2, 2 * need).is_ok());
    let why = fit::check_host(&spec, model.as_ref(), layout, 2, 2 * need - 2).unwrap_err();
    assert!(why.starts_with("each worker needs about "), "{why}");
    assert!(
        why.contains(&format!(
            "but this machine has {} available, {} for each of its 2 workers (fewer with \
             --nproc-per-node)",
            gb(2 * need - 2),
            gb(need - 1)
        )),
        "{why}"
    );
    let alone = Layout::of(&spec, 1, 1);
    let need = estimate(&spec, model.as_ref(), alone).total().unwrap();
    let why = fit::check_host(&spec, model.as_ref(), alone, 1, need / 2).unwrap_err();
    assert!(
        why.contains(&format!("but this machine has {} available;", gb(need / 2))),
        "{why}"
    );
}

/// `MemAvailable` and `SwapFree`, read from this Linux machine: something, and less than its
/// address space.
#[test]
fn the_hosts_available_memory_is_read() {
    let available = fit::available_host_memory().expect("/proc/meminfo says");
    assert!(available > 1 << 20 && available < 1 << 56, "{available}");
}

/// DPO counts two rows a pair, and a full fine-tune's frozen reference as a second copy of the
/// weights; LoRA's reference (the base) and a precomputed one hold none.
#[test]
fn a_dpo_job_counts_its_pairs_rows_and_its_reference() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let spec_of = |extra: &str| {
        let config = format!(
            "[model]\narch = \"llama\"\ninit_from = \"{}\"\n{extra}\n[data]\ndataset = \"jsonl\"\n\
             train_path = \"{}\"\n[train]\nbatch_size = 4\noptimizer = \"adamw\"\n\
             objective = \"dpo\"\n",
            root.join("chat/model").display(),
            root.join("dpo/prefs.jsonl").display()
        );
        crate::config::load_str(Path::new("m.toml"), config, &[])
            .unwrap()
            .spec
    };
    let full = spec_of("");
    let data = crate::task::load(&full, None).unwrap();
    let model = crate::models::build(
        &full.model,
        data.input(),
        0,
        &Device::Cpu,
        full.train.precision,
        false,
    )
    .unwrap();
    let p = model.params().element_count() as u64;
    let dpo = estimate(&full, model.as_ref(), Layout::of(&full, 1, 1));
    assert_eq!(dpo.reference, 4 * p);
    assert!(dpo.describe().contains("reference"), "{}", dpo.describe());
    let mut lm = full.clone();
    lm.train.objective = Objective::Lm;
    let plain = estimate(&lm, model.as_ref(), Layout::of(&lm, 1, 1));
    assert_eq!(plain.reference, 0);
    assert_eq!(dpo.activations.unwrap(), 2 * plain.activations.unwrap());
    let mut precomputed = full.clone();
    precomputed.train.dpo.precompute_reference = true;
    assert_eq!(
        estimate(&precomputed, model.as_ref(), Layout::of(&full, 1, 1)).reference,
        0
    );
    let lora = spec_of("[model.lora]\nr = 4");
    assert_eq!(
        estimate(&lora, model.as_ref(), Layout::of(&lora, 1, 1)).reference,
        0
    );
}
