use std::path::Path;

use super::*;

fn load_text(text: &str, overrides: &[&str]) -> Result<LoadedConfig, ConfigError> {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    load_str(Path::new("configs/x.toml"), text.to_string(), &overrides)
}

/// The spec of `arch = "mlp"` with these hidden widths.
fn mlp(hidden: &[i64]) -> ModelSpec {
    let widths = hidden.iter().map(|&w| toml::Value::Integer(w)).collect();
    let mut options = toml::Table::new();
    options.insert("hidden".into(), toml::Value::Array(widths));
    ModelSpec {
        arch: "mlp".into(),
        options,
        freeze: Vec::new(),
        lora: None,
        quantize: None,
        language: None,
    }
}

fn error(text: &str) -> String {
    load_text(text, &[]).unwrap_err().to_string()
}

#[test]
fn an_empty_file_gives_documented_defaults() {
    let spec = load_text("", &[]).unwrap().spec;
    assert_eq!(spec.name, "x");
    assert_eq!(spec.model, mlp(&[256, 256]));
    assert_eq!(spec.train.batch_size, 64);
    assert_eq!(
        spec.train.optimizer,
        OptimizerSpec::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0
        }
    );
    assert_eq!(spec.data.options()["root"].as_str(), Some("data/mnist"));
    assert_eq!(spec.distributed.nproc_per_node, None);
    assert_eq!(spec.distributed.bucket_bytes, 25_000_000);
}

#[test]
fn unknown_key_names_table_position_and_closest_key() {
    let msg = error("name = \"a\"\n\n[train]\nepochs = 2\n\n\nbatchsize = 3\n");
    assert_eq!(
        msg,
        "unknown key `batchsize` in [train] (configs/x.toml:7:1); did you mean `batch_size`?"
    );
    let msg = error("sed = 1\n");
    assert!(
        msg.contains(
            "unknown key `sed` in the top level (configs/x.toml:1:1); did you mean `seed`?"
        ),
        "{msg}"
    );
    let msg = error("[trian]\nepochs = 1\n");
    assert!(msg.contains("did you mean `train`?"), "{msg}");
}

#[test]
fn wrong_types_name_key_and_position() {
    let msg = error("[train]\nepochs = \"ten\"\n");
    assert_eq!(
        msg,
        "`train.epochs` (configs/x.toml:2:10) must be an integer, found the string \"ten\""
    );
    // A dataset's own keys are typed by its options struct.
    let msg = error("[data]\ndownload = 1\n");
    assert!(
        msg.contains("`data.download` (configs/x.toml:2:12)") && msg.contains("expected a boolean"),
        "{msg}"
    );
    assert!(error("[distributed]\nnproc_per_node = \"many\"\n").contains("\"auto\" or an integer"));
}

#[test]
fn bad_values_are_each_named() {
    let cases = [
        (
            "[train]\nepochs = 0\n",
            "invalid `train.epochs` (configs/x.toml:2:10): must be at least 1, got 0",
        ),
        (
            "[train]\nepochs = -3\n",
            "`train.epochs` (configs/x.toml:2:10): must be at least 1, got -3",
        ),
        (
            "[train]\nbatch_size = 0\n",
            "`train.batch_size` (configs/x.toml:2:14): must be at least 1, got 0",
        ),
        (
            "[train]\nlr = 0.0\n",
            "`train.lr` (configs/x.toml:2:6): must be a number greater than 0, got 0",
        ),
        (
            "[train]\nlr = -0.1\n",
            "`train.lr` (configs/x.toml:2:6): must be a number greater than 0, got -0.1",
        ),
        (
            "[train]\naccumulation = 0\n",
            "`train.accumulation` (configs/x.toml:2:16): must be at least 1, got 0",
        ),
        (
            "[model]\narch = \"resnet\"\n",
            "`model.arch` (configs/x.toml:2:8): unknown value \"resnet\"; expected one of \"cnn\", \"gpt\", \"llama\", \"mlp\"",
        ),
        (
            "[data]\ndataset = \"cifar\"\n",
            "`data.dataset` (configs/x.toml:2:11): unknown value \"cifar\"",
        ),
        (
            "[train]\noptimizer = \"lion\"\n",
            "`train.optimizer` (configs/x.toml:2:13): unknown value \"lion\"; expected one of \"sgd\", \"adam\", \"adamw\"",
        ),
        (
            "[train.scheduler]\nkind = \"poly\"\n",
            "`train.scheduler.kind` (configs/x.toml:2:8): unknown value \"poly\"",
        ),
        ("[train]\nnesterov = true\n", "`train.nesterov`"),
        (
            "[train]\nbetas = [0.9]\n",
            "`train.betas` (configs/x.toml:2:9): must be two numbers",
        ),
        ("[data]\nmean = [0.1]\n", "`data.std`"),
        (
            "[data.checksums]\n\"t10k-labels-idx1-ubyte.gz\" = \"xyz\"\n",
            "`data.checksums.t10k-labels-idx1-ubyte.gz` (configs/x.toml:2:31): [data] (dataset = \"mnist\"): data.checksums.t10k-labels-idx1-ubyte.gz = \"xyz\": must be a SHA-256 digest",
        ),
        (
            "[data.checksums]\n\"trian-labels-idx1-ubyte.gz\" = \"xyz\"\n",
            "`data.checksums.trian-labels-idx1-ubyte.gz` (configs/x.toml:2:32): [data] (dataset = \"mnist\"): data.checksums.trian-labels-idx1-ubyte.gz: not a file this dataset downloads",
        ),
    ];
    for (text, expected) in cases {
        let msg = error(text);
        assert!(
            msg.contains(expected),
            "for {text:?}:\n  got      {msg}\n  expected {expected}"
        );
    }
}

#[test]
fn several_problems_are_reported_together() {
    let msg = error("[train]\nepochs = 0\nlr = -1.0\n");
    assert!(msg.starts_with("2 problems in the config:"), "{msg}");
    assert!(msg.contains("train.epochs") && msg.contains("train.lr"));
}

#[test]
fn overrides_are_typed_by_the_schema() {
    let loaded = load_text(
        "[train]\nlr = 0.1\n",
        &[
            "train.lr=0.02",
            "data.root=/tmp/d",
            "model.hidden=[8, 4]",
            "distributed.nproc_per_node=1",
            "name=other",
        ],
    )
    .unwrap();
    assert_eq!(loaded.spec.train.lr, 0.02);
    assert_eq!(loaded.spec.data.options()["root"].as_str(), Some("/tmp/d"));
    assert_eq!(loaded.spec.model, mlp(&[8, 4]));
    assert_eq!(loaded.spec.name, "other");
    // A double-quoted string reads as in the file (escapes); unquoted or single-quoted, as is.
    let root = |value: &str| {
        let set = format!("data.root={value}");
        let loaded = load_text("", &[set.as_str()]).unwrap();
        loaded.spec.data.options()["root"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(root(r#""a\\.b""#), r"a\.b");
    assert_eq!(root(r"a\.b"), r"a\.b");
    assert_eq!(root(r"'a\.b'"), r"a\.b");
    assert_eq!(root(r#""plain""#), "plain");
    let msg = load_text("", &[r#"data.root="a\d""#])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("is not a TOML string"), "{msg}");
    let msg = load_text("", &["train.epochs=zero"])
        .unwrap_err()
        .to_string();
    assert_eq!(
        msg,
        "bad override `--set train.epochs=zero`: `train.epochs` must be an integer: `zero` is not one"
    );
    let msg = load_text("", &["train.batch_size=99999999999999999999"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.ends_with("`99999999999999999999` is out of range (at most 9223372036854775807)"),
        "{msg}"
    );
    let msg = load_text("", &["train.batchsize=2"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("unknown key `train.batchsize`; did you mean `train.batch_size`?"),
        "{msg}"
    );
    let msg = load_text("", &["train.epochs=0"]).unwrap_err().to_string();
    assert!(
        msg.contains("invalid `train.epochs` (--set train.epochs=0): must be at least 1"),
        "{msg}"
    );
    assert!(
        load_text("", &["train"])
            .unwrap_err()
            .to_string()
            .contains("expected key.path=value")
    );
}

#[test]
fn the_resolved_config_loads_back_to_the_same_spec() {
    let original = load_text(
        "[model]\narch = \"cnn\"\n[train]\nlr = 0.5\n[train.scheduler]\nkind = \"cosine\"\n",
        &[],
    )
    .unwrap();
    let again = load_str(Path::new("jobs/x/job.toml"), original.resolved_toml(), &[]).unwrap();
    assert_eq!(again.spec, original.spec);
}

#[test]
fn worker_counts_are_auto_or_at_least_one() {
    let spec = load_text("", &["distributed.nproc_per_node=4"])
        .unwrap()
        .spec;
    assert_eq!(spec.distributed.nproc_per_node, Some(4));
    let spec = load_text("", &[]).unwrap().spec;
    assert_eq!(spec.distributed.nproc_per_node, None);
    let msg = load_text("", &["distributed.nproc_per_node=0"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("distributed.nproc_per_node") && msg.contains("at least 1"),
        "{msg}"
    );
}

#[test]
fn restarts_and_write_policy_are_checked_and_timeouts_are_bounded() {
    let spec = load_text(
        "",
        &[
            "distributed.max_restarts=2",
            "checkpoint.on_write_error=\"warn\"",
        ],
    )
    .unwrap()
    .spec;
    assert_eq!(spec.distributed.max_restarts, 2);
    assert_eq!(spec.checkpoint.on_write_error, OnWriteError::Warn);
    let msg = load_text("", &["checkpoint.on_write_error=\"ignore\""])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("checkpoint.on_write_error") && msg.contains("\"fail\", \"warn\""),
        "{msg}"
    );
    let msg = load_text("", &["distributed.timeout_s=9223372036854775807"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("distributed.timeout_s") && msg.contains("between 1 and 604800"),
        "{msg}"
    );
}

#[test]
fn drop_last_shrinks_each_ranks_share_as_torch_does() {
    let padded = load_text("", &[]).unwrap().spec;
    let dropped = load_text("[data]\ndrop_last = true\n", &[]).unwrap().spec;
    // torch: num_samples = ceil(len / world), or ceil((len - world) / world) with drop_last.
    assert_eq!(padded.plan(100, 3).samples_per_rank, 34);
    assert_eq!(dropped.plan(100, 3).samples_per_rank, 33);
    assert_eq!(dropped.plan(99, 3).samples_per_rank, 33);
}

#[test]
fn plan_derives_global_batch_and_steps() {
    let spec = load_text(
        "[train]\nbatch_size = 64\naccumulation = 4\nepochs = 20\n",
        &[],
    )
    .unwrap()
    .spec;
    let plan = spec.plan(60_000, 1);
    assert_eq!(plan.global_batch, 256);
    assert_eq!(plan.micro_batches_per_epoch, 938);
    assert_eq!(plan.steps_per_epoch, 235);
    assert_eq!(plan.total_steps, 4700);
    let two = spec.plan(60_001, 2);
    assert_eq!((two.samples_per_rank, two.global_batch), (30_001, 512));
    let capped = load_text("[train]\nmax_steps = 7\n", &[]).unwrap().spec;
    assert_eq!(capped.plan(1000, 1).total_steps, 7);
}

#[test]
fn a_global_batch_is_shared_by_any_world_size_that_divides_it() {
    let loaded = load_text("[train]\nglobal_batch_size = 96\naccumulation = 2\n", &[]).unwrap();
    let spec = &loaded.spec;
    for (world, per_worker) in [(1, 48), (2, 24), (4, 12), (6, 8)] {
        let derived = spec.for_world_size(world).unwrap();
        assert_eq!(derived.train.batch_size, per_worker, "{world} workers");
        // The same global batch, hence the same steps per epoch, on every world size.
        assert_eq!(derived.plan(960, world).global_batch, 96);
        assert_eq!(derived.plan(960, world).steps_per_epoch, 10);
    }
    let err = spec.for_world_size(5).unwrap_err();
    assert!(
        err.contains("48 samples each, which 5 workers cannot share evenly"),
        "{err}"
    );
    assert!(
        err.contains("1, 2, 3, 4, 6, 8, 12, 16, 24, 48 worker(s)"),
        "{err}"
    );
    // Without it, batch_size stays per worker.
    let plain = load_text("", &[]).unwrap().spec;
    assert_eq!(plain.for_world_size(3).unwrap().train.batch_size, 64);
    // The frozen job.toml keeps the global batch, not one world size's share, and loads back.
    let frozen = loaded.resolved_toml();
    assert!(!frozen.contains("batch_size = 64") && frozen.contains("global_batch_size = 96"));
    let again = load_text(&frozen, &[]).unwrap().spec;
    assert_eq!(again.for_world_size(4).unwrap().train.batch_size, 12);
}

#[test]
fn a_global_batch_refuses_a_batch_size_beside_it_and_an_uneven_accumulation() {
    let both = error("[train]\nbatch_size = 32\nglobal_batch_size = 64\n");
    assert!(
        both.contains("`train.batch_size` (configs/x.toml:2:14)")
            && both.contains("remove train.batch_size"),
        "{both}"
    );
    let uneven = error("[train]\nglobal_batch_size = 10\naccumulation = 4\n");
    assert!(
        uneven.contains("do not divide into train.accumulation = 4 micro-batches"),
        "{uneven}"
    );
    let by_override = load_text("[train]\nglobal_batch_size = 64\n", &["train.batch_size=8"]);
    assert!(by_override.is_err());
}

/// The book's config reference is generated from the schema: it can never drift. After
/// changing a key, `DDPJOB_BLESS=1 cargo test config_reference` rewrites it.
#[test]
fn config_reference_is_the_schemas() {
    const START: &str = "<!-- config table: generated from crates/ddpjob-spec/src/keys.rs -->\n";
    const END: &str = "<!-- end of config table -->";
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/src/reference/config.md");
    let readme = std::fs::read_to_string(path).unwrap();
    let start = readme
        .find(START)
        .expect("docs/src/reference/config.md lacks the config table's start marker")
        + START.len();
    let end = readme[start..]
        .find(END)
        .expect("docs/src/reference/config.md lacks the config table's end marker")
        + start;
    let table = schema::markdown_table(&crate::registry::Registry::builtin());
    if readme[start..end] != table {
        if std::env::var_os("DDPJOB_BLESS").is_some() {
            std::fs::write(
                path,
                format!("{}{table}{}", &readme[..start], &readme[end..]),
            )
            .unwrap();
        } else {
            panic!(
                "docs/src/reference/config.md's table differs from the key declarations in \
                 crates/ddpjob-spec/src/keys.rs; run `DDPJOB_BLESS=1 cargo test \
                 config_reference` to regenerate it"
            );
        }
    }
}

/// A default a declaration words itself (`shown`) is the key's serde default.
#[test]
fn shown_defaults_are_the_real_ones() {
    let raw = RawConfig::default();
    let defaults = toml::Value::try_from(raw).unwrap();
    let mut checked = 0;
    for k in schema::KEYS
        .iter()
        .filter(|k| k.kind != schema::Kind::Table)
    {
        let Some(literal) = k
            .default
            .strip_prefix('`')
            .and_then(|d| d.split('`').next())
        else {
            continue;
        };
        let Ok(mut doc) = toml::from_str::<toml::Table>(&format!("v = {literal}")) else {
            continue;
        };
        let shown = doc.remove("v").unwrap();
        let actual = k.path.split('.').try_fold(&defaults, |v, part| v.get(part));
        let Some(actual) = actual else {
            continue; // an optional key, absent by default
        };
        let same = match (&shown, actual) {
            (toml::Value::Integer(a), toml::Value::Float(b)) => *a as f64 == *b,
            (a, b) => a == b,
        };
        assert!(
            same,
            "`{}`: the schema shows {literal}, the raw default is {actual}",
            k.path
        );
        checked += 1;
    }
    assert!(checked >= 40, "only {checked} defaults were comparable");
}

/// Every model owns its keys: another arch's key is refused with the arch named, but the
/// default arch's `hidden` is dropped beside `cnn` and `gpt` as it always was (older
/// `job.toml` files of those archs write it, so their jobs still resume).
#[test]
fn a_models_keys_are_its_own_and_mlps_hidden_is_tolerated_beside_cnn_and_gpt() {
    let cnn = load_text("[model]\narch = \"cnn\"\nhidden = [256, 256]\n", &[])
        .unwrap()
        .spec;
    assert_eq!((cnn.model.arch(), cnn.model.options().len()), ("cnn", 0));
    let msg = error("[model]\narch = \"cnn\"\nn_layer = 2\n");
    assert!(
        msg.contains("unknown key `n_layer` in [model] (arch = \"cnn\")"),
        "{msg}"
    );
    // Only the archs that always took it tolerate it.
    let msg = error(
        "[model]\narch = \"llama\"\nhidden = [2]\n[data]\ndataset = \"text\"\npath = \"x.txt\"\n",
    );
    assert!(
        msg.contains("unknown key `hidden` in [model] (arch = \"llama\")"),
        "{msg}"
    );
    let msg = error("[model]\narch = \"mlp\"\nhidden = [0]\n");
    assert!(
        msg.contains("`model.hidden`") && msg.contains("every width must be at least 1"),
        "{msg}"
    );
    let msg = error(
        "[model]\narch = \"gpt\"\nn_embd = 48\nn_head = 5\n[data]\ndataset = \"text\"\npath = \"x.txt\"\n",
    );
    assert!(
        msg.contains("`model.n_embd` (configs/x.toml:3:10)")
            && msg.contains("divisible by model.n_head = 5"),
        "{msg}"
    );
}

/// The `[data]` of a `job.toml` as versions before datasets owned their keys wrote it: every
/// dataset's keys, whichever the job used.
fn older_data(dataset: &str, own: &str) -> String {
    format!(
        "[data]\ndataset = \"{dataset}\"\n{own}root = \"data/x\"\ndownload = false\n\
         drop_last = true\nmirrors = []\nmean = []\nstd = []\n\n[data.checksums]\n\n\
         [data.synthetic]\ntrain_samples = 4096\ntest_samples = 1024\nshape = [1, 28, 28]\n\
         classes = 10\nnoise = 0.5\n"
    )
}

/// `text` loaded as the `job.toml` of a stored job (a `state.json` beside it).
fn load_stored(text: &str) -> Result<LoadedConfig, ConfigError> {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("state.json"), "{}").unwrap();
    let path = tmp.path().join("job.toml");
    std::fs::write(&path, text).unwrap();
    load(&path, &[])
}

/// Jobs started by older versions still resume: the keys their `job.toml` wrote for every
/// dataset are dropped beside the ones that do not read them, and the rest read as before.
#[test]
fn job_toml_of_older_versions_still_loads() {
    let gpt = "[model]\narch = \"gpt\"\nvocab_size = 100\n";
    let text = older_data(
        "text",
        "path = \"x.txt\"\ntokenizer = \"byte\"\nval_fraction = 0.2\n",
    );
    let spec = load_stored(&format!("{gpt}{text}")).unwrap().spec;
    let options = spec.data.options();
    assert_eq!(spec.data.name(), "text");
    assert!(spec.data.drop_last);
    assert_eq!(options["tokenizer"].as_str(), Some("byte"));
    assert_eq!(options["val_fraction"].as_float(), Some(0.2));
    assert!(!options.contains_key("root") && !options.contains_key("synthetic"));
    let tokens = older_data(
        "tokens",
        "train_path = \"t.bin\"\nval_path = \"v.bin\"\ntoken_dtype = \"u32\"\n",
    );
    let spec = load_stored(&format!("{gpt}{tokens}")).unwrap().spec;
    assert_eq!(spec.data.options()["token_dtype"].as_str(), Some("u32"));
    // Its state.json lost (or a node's copy without one): the header says what it is.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("job.toml");
    let headed = format!("{STORED_JOB_HEADER}x`, frozen by `ddpjob run x.toml`\n{gpt}{tokens}");
    std::fs::write(&path, headed).unwrap();
    assert_eq!(load(&path, &[]).unwrap().spec, spec);
    assert_eq!(spec.data.options().len(), 3, "{:?}", spec.data.options());
    let spec = load_stored(&older_data("mnist", "")).unwrap().spec;
    assert_eq!(spec.data.options()["root"].as_str(), Some("data/x"));
    assert!(!spec.data.options().contains_key("synthetic"));
    let spec = load_stored(&older_data("synthetic", "")).unwrap().spec;
    let keys: Vec<&String> = spec.data.options().keys().collect();
    assert_eq!(keys, ["mean", "std", "synthetic"]);
    // A user's job file is told of what its dataset does not read (a tokens job's
    // `download = true` would otherwise download nothing, silently).
    let msg = error(&format!("{gpt}{tokens}"));
    assert!(
        msg.contains("unknown key `download` in [data] (dataset = \"tokens\")"),
        "{msg}"
    );
    // What the dataset does not read and older versions never wrote is still refused.
    let msg = load_stored(&format!(
        "{gpt}{}",
        older_data("text", "path = \"x.txt\"\ntoken_dtype = \"u16\"\n")
    ))
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("unknown key `token_dtype` in [data] (dataset = \"text\")")
            && msg.contains("it is a key of data.dataset = \"tokens\""),
        "{msg}"
    );
}

/// A config put together from several files (`eval JOB --data FILE`) names them in messages
/// and otherwise reads as a file does: a switched optimizer leaves the other's keys out.
#[test]
fn a_composed_config_names_its_files_and_reads_as_a_file() {
    let text = "[train]\noptimizer = \"adam\"\neps = 1e-6\nlr = -1.0\n".to_string();
    let label = "jobs/a/job.toml with [data] from d.toml".to_string();
    let path = Path::new("d.toml");
    let err = load_composed(path, label.clone(), text.clone(), &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("invalid `train.lr` (jobs/a/job.toml with [data] from d.toml)"),
        "{err}"
    );
    let fixed = text.replace("lr = -1.0", "lr = 0.1");
    let sgd = ["train.optimizer=sgd".to_string()];
    let loaded = load_composed(path, label, fixed, &sgd).unwrap();
    assert!(
        loaded.notes.iter().any(|n| n.contains("train.eps")),
        "{:?}",
        loaded.notes
    );
}

/// A key of another dataset is to be removed when the file chose its dataset, and the choice
/// to be made when it left it at its default (`eval DIR --set data.path=...`).
#[test]
fn a_key_of_a_dataset_not_chosen_says_to_choose_it() {
    let chosen = error("[data]\ndataset = \"mnist\"\npath = \"x.txt\"\n");
    assert!(
        chosen.contains("it is a key of data.dataset = \"text\" or \"jsonl\": remove it")
            || chosen.contains("it is a key of data.dataset = \"text\": remove it"),
        "{chosen}"
    );
    let defaulted = error("[data]\npath = \"x.txt\"\n");
    assert!(
        defaulted.contains("and data.dataset is not set (its default is \"mnist\"): set it"),
        "{defaulted}"
    );
}

/// A dataset's nested keys are set as its flat ones are, and its checks name the nested key.
#[test]
fn nested_dataset_keys_are_set_and_named() {
    let loaded = load_text(
        "[data]\ndataset = \"synthetic\"\n",
        &[
            "data.synthetic.train_samples=100",
            "data.synthetic.shape=[3, 8, 8]",
        ],
    )
    .unwrap();
    let synthetic = loaded.spec.data.options()["synthetic"].as_table().unwrap();
    assert_eq!(synthetic["train_samples"].as_integer(), Some(100));
    assert_eq!(synthetic["test_samples"].as_integer(), Some(1024));
    // A misspelt key is refused, not left for its default.
    let msg = error("[data]\ndataset = \"synthetic\"\n[data.synthetic]\nclases = 5\n");
    assert!(
        msg.contains("`data.synthetic` (configs/x.toml:3:1)")
            && msg.contains("unknown field `clases`, expected one of")
            && !msg.contains("in `synthetic`"),
        "{msg}"
    );
    let msg = error("[model]\narch = \"gpt\"\n[data]\ndataset = \"synthetic\"\n");
    assert!(
        msg.contains("is images, but model.arch = \"gpt\" learns from token sequences"),
        "{msg}"
    );
    // More samples than any machine holds (past `usize`, and past 2^62 bytes) are refused
    // before anything is drawn, not aborted mid-way.
    for samples in ["9223372036854775807", "4611686018427387904"] {
        let set = format!("data.synthetic.train_samples={samples}");
        let msg = load_text("[data]\ndataset = \"synthetic\"\n", &[&set])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains(&format!(
                "data.synthetic: {samples} + 1024 samples of shape"
            )) && msg.contains("more than this machine has available"),
            "{msg}"
        );
    }
}

#[test]
fn lora_target_modules_take_names_or_one_regular_expression() {
    let load = |targets: &str, set: &[String]| {
        let text = format!(
            "[model]\narch = \"gpt\"\nvocab_size = 11\n[model.lora]\nr = 4\n{targets}\n\
             [data]\ndataset = \"tokens\"\ntrain_path = \"t.bin\"\nval_path = \"v.bin\"\n"
        );
        load_str(Path::new("j.toml"), text, set)
    };
    let regex = load(r#"target_modules = '.*\.h\.1\..*'"#, &[]).unwrap();
    let lora = regex.spec.model.lora().unwrap();
    assert_eq!(
        lora.target_modules,
        crate::config::TargetModules::Regex(r".*\.h\.1\..*".into())
    );
    let err = load("target_modules = '(unclosed'", &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.lora.target_modules"), "{err}");
    assert!(err.contains("is not a regular expression"), "{err}");
    // --set takes either form.
    let set = |v: &str| load("", &[format!("model.lora.target_modules={v}")]).unwrap();
    let names = set("[\"c_attn\"]");
    assert_eq!(
        names.spec.model.lora().unwrap().target_modules,
        crate::config::TargetModules::Names(vec!["c_attn".into()])
    );
    let one = set(".*c_fc");
    assert_eq!(
        one.spec.model.lora().unwrap().target_modules,
        crate::config::TargetModules::Regex(".*c_fc".into())
    );
}

/// NCCL cannot hold two ranks on one GPU, the tcp ring can: a GPU named twice is refused
/// unless the backend is tcp (in a CPU build `devices` is refused for its own reason too).
#[test]
fn a_gpu_named_twice_is_refused_unless_the_backend_is_tcp() {
    let shared = "[distributed]\ndevices = [0, 0]\n";
    let msg = error(shared);
    assert!(
        msg.contains("names a GPU twice: [0, 0]; NCCL needs one worker per GPU"),
        "{msg}"
    );
    assert!(
        msg.contains("backend = \"tcp\" workers may share one"),
        "{msg}"
    );
    let over_tcp = format!("{shared}backend = \"tcp\"\n");
    match load_text(&over_tcp, &[]) {
        Ok(loaded) => assert_eq!(loaded.spec.distributed.devices, Some(vec![0, 0])),
        Err(e) => assert!(!e.to_string().contains("twice"), "{e}"),
    }
}

#[test]
fn early_stopping_is_off_by_default_and_left_out_of_job_toml_until_set() {
    let off = load_text("", &[]).unwrap();
    assert_eq!(off.spec.train.early_stopping.patience, None);
    assert!(!off.resolved_toml().contains("early_stopping"));
    let on = load_text(
        "[train.early_stopping]\npatience = 3\nmin_delta = 0.01\n",
        &[],
    )
    .unwrap();
    let e = on.spec.train.early_stopping;
    assert_eq!((e.patience, e.min_delta), (Some(3), 0.01));
    let again = load_str(Path::new("jobs/x/job.toml"), on.resolved_toml(), &[]).unwrap();
    assert_eq!(again.spec.train.early_stopping, e);
    let err = error("[train.early_stopping]\nmin_delta = 0.5\n");
    assert!(
        err.contains("has no effect without train.early_stopping.patience"),
        "{err}"
    );
    let err = error("[train.early_stopping]\npatience = 2\nmin_delta = -1.0\n");
    assert!(err.contains("train.early_stopping.min_delta"), "{err}");
}

#[test]
fn a_job_name_longer_than_a_directory_name_can_be_is_refused() {
    let long = "x".repeat(201);
    let err = load_text("", &[&format!("name={long}")])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("is 201 characters long; a job name may have at most 200"),
        "{err}"
    );
    assert!(load_text("", &[&format!("name={}", &long[..200])]).is_ok());
}

#[test]
fn a_key_of_another_optimizer_or_schedule_is_refused_not_ignored() {
    let cases = [
        (
            "[train]\nmomentum = 0.9\n",
            "train.momentum",
            "train.optimizer = \"sgd\", and this job's is \"adam\"",
        ),
        (
            "[train]\noptimizer = \"sgd\"\nbetas = [0.8, 0.9]\n",
            "train.betas",
            "train.optimizer = \"adam\" or \"adamw\", and this job's is \"sgd\"",
        ),
        (
            "[train]\noptimizer = \"sgd\"\neps = 1e-6\n",
            "train.eps",
            "this job's is \"sgd\"",
        ),
        (
            "[train.scheduler]\nkind = \"cosine\"\ngamma = 0.5\n",
            "train.scheduler.gamma",
            "train.scheduler.kind = \"step\"",
        ),
        (
            "[train.scheduler]\nstep_size = 2\n",
            "train.scheduler.step_size",
            "this job's is \"constant\"",
        ),
        (
            "[train.scheduler]\nkind = \"step\"\nmin_lr = 0.1\n",
            "train.scheduler.min_lr",
            "train.scheduler.kind = \"cosine\"",
        ),
    ];
    for (text, key, problem) in cases {
        let msg = error(text);
        assert!(
            msg.contains(&format!("`{key}`")) && msg.contains(problem),
            "for {text:?}: {msg}"
        );
    }
    // Defaults written out (as configs/mnist.toml and every job.toml do) are not settings.
    let written = "[train]\noptimizer = \"adamw\"\nmomentum = 0.0\nbetas = [0.9, 0.95]\n\
                   [train.scheduler]\nkind = \"cosine\"\nstep_size = 1\ngamma = 0.1\nmin_lr = 0.001\n";
    let spec = load_text(written, &[]).unwrap().spec;
    assert!(matches!(spec.train.optimizer, OptimizerSpec::AdamW { beta2, .. } if beta2 == 0.95));
    load_text(
        "[train]\noptimizer = \"sgd\"\nmomentum = 0.9\nnesterov = true\n",
        &[],
    )
    .unwrap();
}

#[test]
fn a_flag_that_sets_a_key_is_named_as_typed() {
    let err = load_text("", &[&super::flag_override("--name", "../x")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("invalid `name` (--name ../x)"), "{err}");
    let err = load_text("", &[&super::flag_override("--nproc-per-node", "many")])
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("bad override `--nproc-per-node many`"),
        "{err}"
    );
    // `--set` is named as `--set`.
    let err = load_text("", &["name=../x"]).unwrap_err().to_string();
    assert!(err.contains("(--set name=../x)"), "{err}");
    let named = load_text("", &[&super::flag_override("--name", "exp-1")]).unwrap();
    assert_eq!(named.spec.name, "exp-1");
    // A name the CLI would read as a flag (`show -x`) is refused.
    let err = load_text("", &["name=\"-x\""]).unwrap_err().to_string();
    assert!(
        err.contains("beginning with a letter, digit or '_'"),
        "{err}"
    );
}

#[test]
fn a_bad_value_inside_an_options_table_names_its_key_and_where_it_was_set() {
    let llama = "[model]\narch = \"llama\"\nhidden_size = 32\nintermediate_size = 64\n\
                 num_hidden_layers = 1\nnum_attention_heads = 2\nvocab_size = 64\n";
    let err = load_text(
        llama,
        &["model.rope_scaling={rope_type=\"yarn\", factor=2.0}"],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains(
            "invalid `model.rope_scaling.rope_type` (--set model.rope_scaling={rope_type=\"yarn\""
        ) && err.contains("unknown variant `yarn`"),
        "{err}"
    );
    let err = load_text(
        "[data]\ndataset = \"synthetic\"\n",
        &["data.synthetic.shape=[1,8]"],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("invalid `data.synthetic.shape` (--set data.synthetic.shape=[1,8])"),
        "{err}"
    );
    let err = load_text(
        "[data]\ndataset = \"synthetic\"\n",
        &["data.synthetic.test_samples=0"],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("invalid `data.synthetic.test_samples` (--set data.synthetic.test_samples=0)"),
        "{err}"
    );
}

#[test]
fn an_empty_data_root_is_refused() {
    let err = error("[data]\nroot = \"\"\n");
    assert!(
        err.contains(
            "data.root is empty: name the directory of the IDX files (by default \"data/mnist\")"
        ),
        "{err}"
    );
}

#[test]
fn normalisation_must_be_finite_and_its_std_of_normal_size() {
    for (mean, std, key) in [
        ("nan", "1.0", "data.mean"),
        ("0.0", "1e-45", "data.std"),
        ("0.0", "inf", "data.std"),
    ] {
        let err = error(&format!("[data]\nmean = [{mean}]\nstd = [{std}]\n"));
        assert!(
            err.contains(&format!("invalid `{key}`")),
            "{mean}/{std}: {err}"
        );
    }
    load_text("[data]\nmean = [0.1307]\nstd = [0.3081]\n", &[]).unwrap();
}

#[test]
fn a_stored_job_with_a_key_earlier_versions_ignored_still_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let job = tmp.path().join("job.toml");
    std::fs::write(&job, "[train]\nmomentum = 0.9\n").unwrap();
    // A config file of that name alone is the user's: refused.
    let err = crate::config::load(&job, &[]).unwrap_err().to_string();
    assert!(err.contains("train.momentum"), "{err}");
    // Beside a job's state.json it is what an earlier version wrote: it resumes.
    std::fs::write(tmp.path().join("state.json"), "{}").unwrap();
    crate::config::load(&job, &[]).unwrap();
}

/// Text settings that cannot work are refused at `validate`: a pretrained model fed
/// characters numbered afresh, a download with nowhere to download from.
#[test]
fn text_data_a_pretrained_model_cannot_learn_or_cannot_fetch_is_refused() {
    let llama = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama");
    let text = format!(
        "[model]\ninit_from = \"{}\"\nblock_size = 16\n[data]\ndataset = \"text\"\n\
         path = \"x.txt\"\n",
        llama.display()
    );
    assert!(load_text(&text, &[]).is_ok());
    for kind in ["char", "byte"] {
        let msg = load_text(&text, &[&format!("data.tokenizer=\"{kind}\"")])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains(&format!(
                "data.tokenizer = \"{kind}\" numbers the text afresh"
            )) && msg.contains("leave data.tokenizer out"),
            "{msg}"
        );
    }
    let msg = load_text(&text, &["data.download=true"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("data.download = true needs data.mirrors"),
        "{msg}"
    );
    assert!(
        load_text(
            &text,
            &["data.download=true", "data.mirrors=[\"http://m\"]"]
        )
        .is_ok()
    );
    // A file already there needs no mirror; a job that trained so is kept (it resumes).
    let tmp = tempfile::tempdir().unwrap();
    let present = tmp.path().join("x.txt");
    std::fs::write(&present, "text").unwrap();
    let here = format!("data.path=\"{}\"", present.display());
    assert!(load_text(&text, &[&here, "data.download=true"]).is_ok());
    let stored = format!("{text}tokenizer = \"char\"\n");
    assert!(load_stored(&stored).is_ok());
}

/// `--set` may switch the optimizer or schedule of a file tuned for another (a CLI sweep): the
/// file's keys of the other choice are then left out (said in a note); set on the command line
/// or chosen in the file, they are still refused.
#[test]
fn a_choice_switched_by_set_leaves_the_files_keys_of_the_other_behind() {
    let file = "[train]\noptimizer = \"adamw\"\nbetas = [0.9, 0.95]\n[train.scheduler]\n\
                kind = \"step\"\ngamma = 0.5\n";
    let loaded = load_text(
        file,
        &["train.optimizer=\"sgd\"", "train.scheduler.kind=\"cosine\""],
    )
    .unwrap();
    assert_eq!(loaded.notes.len(), 2, "{:?}", loaded.notes);
    assert!(
        loaded.notes[0].contains("train.betas (configs/x.toml:3:9) is left out"),
        "{:?}",
        loaded.notes
    );
    // Left out of the resolved config too: what `job.toml` freezes loads anywhere, as is.
    load_str(Path::new("elsewhere.toml"), loaded.resolved_toml(), &[]).unwrap();
    let spec = loaded.spec;
    assert!(matches!(spec.train.optimizer, OptimizerSpec::Sgd { .. }));
    assert!(matches!(
        spec.train.schedule.kind,
        ScheduleKind::Cosine { .. }
    ));
    let msg = load_text(file, &["train.optimizer=\"sgd\"", "train.betas=[0.8, 0.9]"])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("applies only with train.optimizer"), "{msg}");
    let msg = error(&file.replace("adamw", "sgd"));
    assert!(msg.contains("applies only with train.optimizer"), "{msg}");
}

/// `--set data.dataset=tokens` on a file written for text data: the file's keys only other
/// datasets read are left out in one note; the same keys set on the command line, or a
/// dataset chosen in the file, are still refused.
#[test]
fn a_dataset_switched_by_set_leaves_the_files_keys_of_the_other_behind() {
    let file = "[model]\narch = \"gpt\"\nvocab_size = 64\n[data]\ndataset = \"text\"\n\
                path = \"input.txt\"\ndownload = true\ntokenizer = \"char\"\n";
    let tokens = [
        "data.dataset=\"tokens\"",
        "data.train_path=\"t.bin\"",
        "data.val_path=\"v.bin\"",
    ];
    let loaded = load_text(file, &tokens).unwrap();
    assert_eq!(loaded.notes.len(), 1, "{:?}", loaded.notes);
    assert!(
        loaded.notes[0].starts_with(
            "data.download, data.path, data.tokenizer (configs/x.toml) left out: --set \
             data.dataset=\"tokens\" chose \"tokens\""
        ),
        "{:?}",
        loaded.notes
    );
    assert!(!loaded.resolved_toml().contains("download"));
    let keys: Vec<&String> = loaded.spec.data.options().keys().collect();
    assert!(!keys.iter().any(|k| *k == "path"), "{keys:?}");
    let with = |extra: &str| {
        let mut o = tokens.to_vec();
        o.push(extra);
        load_text(file, &o).unwrap_err().to_string()
    };
    let msg = with("data.mirrors=[\"https://example.com\"]");
    assert!(msg.contains("unknown key `mirrors`"), "{msg}");
    let msg = with("data.tokenzier=\"char\"");
    assert!(msg.contains("unknown key `tokenzier`"), "{msg}");
    let in_file = file.replace("\"text\"", "\"tokens\"");
    let msg = load_text(&in_file, &tokens[1..]).unwrap_err().to_string();
    assert!(msg.contains("unknown key `download`"), "{msg}");
}

/// `--set data.path=mine.txt` on a file checking its own text's download: that digest is left
/// out (it would never be checked), one for the new file kept and checked.
#[test]
fn a_path_set_on_the_command_line_leaves_the_files_other_digests_behind() {
    let digest = "a".repeat(64);
    let file = format!(
        "[model]\narch = \"gpt\"\n[data]\ndataset = \"text\"\npath = \"data/input.txt\"\n\
         download = false\n[data.checksums]\n\"input.txt\" = \"{digest}\"\n\"mine.txt\" = \"{digest}\"\n"
    );
    let loaded = load_text(&file, &["data.path=\"other/mine.txt\""]).unwrap();
    assert_eq!(loaded.notes.len(), 1, "{:?}", loaded.notes);
    assert!(
        loaded.notes[0].starts_with(
            "data.checksums.\"input.txt\" (configs/x.toml:8:1) is left out: --set \
             data.path=\"other/mine.txt\" names another file"
        ),
        "{:?}",
        loaded.notes
    );
    let sums = loaded.spec.data.options()["checksums"].as_table().unwrap();
    assert_eq!(sums.keys().collect::<Vec<_>>(), ["mine.txt"]);
    // A digest set on the command line under its quoted name is the command line's: named
    // so in messages (it was taken for the file's, and named at its line).
    let pinned = format!("data.checksums.\"input.txt\"=\"{}\"", "b".repeat(64));
    let err = load_text(&file, &["data.path=\"other/mine.txt\"", &pinned])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("(--set {pinned})")) && err.contains("not a file this dataset"),
        "{err}"
    );
    // In the file, the path and its digests must still agree.
    let msg = error(&file);
    assert!(
        msg.contains("data.checksums.mine.txt: not a file this dataset downloads"),
        "{msg}"
    );
}

/// `--set` takes a quoted key as TOML does: its dots are the name's, not tables.
#[test]
fn a_quoted_key_in_set_is_one_key() {
    let digest = "a".repeat(64);
    let loaded = load_text(
        "[data]\ndataset = \"text\"\npath = \"shake.txt\"\n[model]\narch = \"gpt\"\n",
        &[&format!("data.checksums.\"shake.txt\"=\"{digest}\"")],
    )
    .unwrap();
    let checksums = loaded.spec.data.options()["checksums"].as_table().unwrap();
    assert_eq!(checksums["shake.txt"].as_str(), Some(digest.as_str()));
}

/// `--set expect={}` names the section as one and shows how its keys are set.
#[test]
fn a_section_given_a_value_by_set_is_told_to_set_its_keys() {
    let msg = load_text("", &["expect={}"]).unwrap_err().to_string();
    assert!(
        msg.contains(
            "`expect` is a section, not a value: set its keys one by one, e.g. --set expect."
        ),
        "{msg}"
    );
    assert!(!msg.contains("must be"), "{msg}");
}

/// `[model.lora]` written with PEFT's `LoraConfig` names reads as ddpjob's; both at once are
/// refused, naming where each was set.
#[test]
fn lora_keys_take_pefts_names_too() {
    let gpt = "[data]\ndataset = \"text\"\npath = \"shake.txt\"\n[model]\narch = \"gpt\"\n\
               [model.lora]\nr = 4\n";
    let spec = load_text(&format!("{gpt}lora_alpha = 16\nlora_dropout = 0.05\n"), &[])
        .unwrap()
        .spec;
    let lora = spec.model.lora().unwrap();
    assert_eq!((lora.alpha, lora.dropout), (16.0, 0.05));
    let msg = load_text(&format!("{gpt}lora_alpha = 16\n"), &["model.lora.alpha=4"])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("`model.lora.lora_alpha` (configs/x.toml:8:1): PEFT's name for model.lora.alpha, which is set too (--set model.lora.alpha=4)"),
        "{msg}"
    );
    // A bad value is still named where the file set it.
    let msg = error(&format!("{gpt}lora_dropout = 2.0\n"));
    assert!(
        msg.contains("`model.lora.dropout` (configs/x.toml:8:16)"),
        "{msg}"
    );
}
