use crate::common::TestJob;

#[test]
fn every_shipped_config_validates() {
    let t = TestJob::new();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            let mut args = vec!["validate".to_string(), path.display().to_string()];
            // A fine-tuning recipe names a checkpoint the tests never download: validate it
            // against the tiny fixture of the same architecture instead
            // (a Hub id, which would download it).
            let table: toml::Table = toml::from_str(&text).unwrap();
            let init_from = table
                .get("model")
                .and_then(|m| m.get("init_from"))
                .and_then(toml::Value::as_str);
            if let Some(id) = init_from {
                let arch = if text.contains("[model.quantize]") {
                    // A 4-bit base's blocks of 64 want layers 64 wide.
                    "qwen2-h64"
                } else if id.contains("gpt2") {
                    "gpt2"
                } else if id.contains("Qwen3") {
                    "qwen3"
                } else {
                    "llama"
                };
                let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/fixtures/hf")
                    .join(arch);
                args.push(format!("--set=model.init_from=\"{}\"", fixture.display()));
                args.push("--set=model.block_size=64".into());
            }
            // Data shipped in the repository, named from its root.
            if text.contains("train_path = \"examples/") {
                let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
                let path = root.join("examples/sft/shakespeare.jsonl");
                args.push(format!("--set=data.train_path=\"{}\"", path.display()));
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let run = t.ddpjob(&args);
            // A large recipe may not fit a small test machine's memory: refused for that
            // alone, after every derived line.
            if run.stdout.contains("  does not fit: ") {
                run.fails_with(2, "its workers do not fit this machine's memory");
            } else {
                run.success();
            }
            assert!(
                run.stdout.contains("global_batch") && run.stdout.contains("total_steps"),
                "{}",
                run.stdout
            );
            // A LoRA recipe's adapted layers are spelt out (the fixture's 2 layers x 7).
            if text.contains("[model.lora]") {
                assert!(
                    run.stdout.contains(
                        "lora_layers       = 14: model.layers.0.self_attn.q_proj, ..., \
                         model.layers.1.mlp.down_proj  (model.lora.target_modules)"
                    ),
                    "{}",
                    run.stdout
                );
            }
            seen += 1;
        }
    }
    assert!(
        seen >= 3,
        "expected mnist, fashion-mnist and smoke configs, saw {seen}"
    );
}

#[test]
fn validate_prints_the_derived_numbers() {
    let t = TestJob::new();
    let cfg = t.config("d", "[data]\ndataset = \"synthetic\"\n[data.synthetic]\ntrain_samples = 1000\n[train]\nbatch_size = 10\naccumulation = 3\nepochs = 2\n");
    let run = t.ddpjob(&["validate", cfg.to_str().unwrap()]);
    run.success();
    for line in [
        "global_batch      = 30",
        "steps_per_epoch   = 34",
        "total_steps       = 68",
        "world_size        = 1",
    ] {
        assert!(
            run.stdout.contains(line),
            "missing {line:?} in\n{}",
            run.stdout
        );
    }
    assert!(
        run.stdout.contains("batch_size = 10"),
        "resolved config not printed:\n{}",
        run.stdout
    );
    // Many workers on one machine: one entry for the run of the same device, and a note when
    // they outnumber the cores (a line per worker made this unreadable).
    let many = t.ddpjob(&[
        "validate",
        cfg.to_str().unwrap(),
        "--nproc-per-node",
        "4096",
    ]);
    // 4096 workers' runtimes (0.04 GB each) seldom fit a machine's memory: then that is said,
    // and the config refused as `run` would refuse it.
    if many.stdout.contains("does not fit") {
        many.fails_with(2, "its workers do not fit this machine's memory");
        assert!(
            many.stdout.contains("use fewer workers (--nproc-per-node)"),
            "{}",
            many.stdout
        );
    } else {
        many.success();
    }
    let stdout = &many.stdout;
    assert!(
        stdout.contains("world_size        = 4096  (1 node(s) x devices: cpu x 4096)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("note: 4096 CPU workers share this machine's"),
        "{stdout}"
    );
}

#[test]
fn bad_configs_exit_2_with_their_specific_error() {
    let t = TestJob::new();
    let cases: &[(&str, &str)] = &[
        (
            "[train]\nbatchsize = 3\n",
            "unknown key `batchsize` in [train] (bad.toml:2:1); did you mean `batch_size`?",
        ),
        (
            "[train]\nepochs = 0\n",
            "invalid `train.epochs` (bad.toml:2:10): must be at least 1, got 0",
        ),
        ("[train]\nepochs = -2\n", "must be at least 1, got -2"),
        (
            "[train]\nbatch_size = 0\n",
            "invalid `train.batch_size` (bad.toml:2:14)",
        ),
        (
            "[train]\nlr = 0\n",
            "invalid `train.lr` (bad.toml:2:6): must be a number greater than 0",
        ),
        (
            "[train]\naccumulation = 0\n",
            "invalid `train.accumulation` (bad.toml:2:16)",
        ),
        (
            "[model]\narch = \"vit\"\n",
            "invalid `model.arch` (bad.toml:2:8): unknown value \"vit\"",
        ),
        (
            "[data]\ndataset = \"imagenet\"\n",
            "invalid `data.dataset` (bad.toml:2:11)",
        ),
        (
            "[train]\noptimizer = \"rmsprop\"\n",
            "invalid `train.optimizer` (bad.toml:2:13)",
        ),
        (
            "[train.scheduler]\nkind = \"onecycle\"\n",
            "invalid `train.scheduler.kind` (bad.toml:2:8)",
        ),
        (
            "[train]\nlr = \"high\"\n",
            "`train.lr` (bad.toml:2:6) must be a number, found the string \"high\"",
        ),
        ("[train\n", "TOML syntax error in bad.toml:1:7"),
        // What a model requires of its data is the model's to say, whatever the dataset.
        (
            "[model]\narch = \"cnn\"\n[data]\ndataset = \"synthetic\"\n[data.synthetic]\nshape = [1, 4, 4]\n",
            "model.arch = \"cnn\": the cnn needs images of at least 6x6 (two 3x3 convolutions, then a 2x2 pooling), got 4x4",
        ),
    ];
    for (text, message) in cases {
        t.config("bad", text);
        t.ddpjob(&["validate", "bad.toml"]).fails_with(2, message);
        t.run(std::path::Path::new("bad.toml"), &[])
            .fails_with(2, message);
    }
    assert!(
        !t.jobs_dir().exists(),
        "a rejected config must not create a job"
    );
    t.ddpjob(&["validate", "missing.toml"])
        .fails_with(2, "cannot read config file `missing.toml`");
    t.ddpjob(&[
        "validate",
        t.config("ok", "").to_str().unwrap(),
        "--set",
        "train.lr=abc",
    ])
    .fails_with(2, "bad override `--set train.lr=abc`");
    t.ddpjob(&["frobnicate"])
        .fails_with(2, "unrecognized subcommand");
}

#[test]
fn keys_prints_the_reference_of_a_section_and_refuses_an_unknown_one() {
    let t = TestJob::new();
    let out = t.ddpjob(&["keys", "train.scheduler"]);
    out.success();
    assert!(
        out.stdout
            .contains("train.scheduler.kind  (a string, default \"constant\")"),
        "{}",
        out.stdout
    );
    assert!(!out.stdout.contains("model.arch"), "{}", out.stdout);
    // A model's own keys: every arch's under `model`, one arch's under `model.<arch>`.
    let model = t.ddpjob(&["keys", "model"]);
    model.success();
    for line in [
        "model.n_layer  (gpt, default 4; a checkpoint's own)",
        "model.hidden  (mlp, default [256, 256])",
        "model.num_key_value_heads  (llama, default 2)",
    ] {
        assert!(model.stdout.contains(line), "{line}\n{}", model.stdout);
    }
    let gpt = t.ddpjob(&["keys", "model.gpt"]);
    gpt.success();
    assert!(gpt.stdout.contains("model.n_embd  (gpt"), "{}", gpt.stdout);
    assert!(!gpt.stdout.contains("llama"), "{}", gpt.stdout);
    t.ddpjob(&["keys", "trian"])
        .fails_with(2, "no config key is `trian` or under it");
}

/// LoRA's default targets (PEFT's for the arch) are spelt out by `validate`.
#[test]
fn validate_names_the_layers_lora_adapts_by_default() {
    let t = TestJob::new();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama");
    let cfg = t.config(
        "lora",
        &format!(
            "[model]\ninit_from = \"{}\"\nblock_size = 32\n[model.lora]\nr = 2\n[data]\n\
             dataset = \"text\"\npath = \"{}\"\n",
            fixture.display(),
            t.path("t.txt").display()
        ),
    );
    std::fs::write(t.path("t.txt"), "to be or not to be ".repeat(50)).unwrap();
    let run = t.ddpjob(&["validate", cfg.to_str().unwrap()]);
    run.success();
    assert!(
        run.stdout.contains(
            "lora_layers       = 4: model.layers.0.self_attn.q_proj, ..., \
             model.layers.1.self_attn.v_proj  (model.lora.target_modules)"
        ),
        "{}",
        run.stdout
    );
}
