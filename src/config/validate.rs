//! Turns the raw config into a [`JobSpec`]: every key's own check (declared with the key in
//! `keys.rs`), then what relates keys to each other (a gpt and its data, an image size and the
//! cnn, the normalisation and the channels, a registered model or dataset). All problems are
//! reported at once, each with its key and where it was written (file:line:col or `--set`).

use std::path::PathBuf;

use super::checks::Checker;
use super::custom::CustomParts;
use super::declare::Section;
use super::error::ConfigError;
use super::keys::{DataKeys, ExpectKeys, GPT_DEFAULTS, ModelKeys, RawConfig};
use super::source::Source;
use super::spec::{
    Check, DataSpec, DatasetKind, Expectation, GptSpec, JobSpec, ModelSpec, ScheduleKind, TextSpec,
    TokenDtype, TokenizerKind, TokensSpec,
};
use crate::registry::Registry;

impl JobSpec {
    /// Validates `raw`; `default_name` (the config file's stem) is used when `name` is absent.
    /// `custom` holds the options of a registered model or dataset, already read.
    pub fn from_raw(
        raw: &RawConfig,
        source: &Source,
        default_name: &str,
        custom: CustomParts,
        registry: &Registry,
    ) -> Result<Self, ConfigError> {
        let mut c = Checker {
            source,
            errors: Vec::new(),
        };
        let keys = raw.check(&mut c);
        let name = keys.name.unwrap_or_else(|| default_name.to_string());
        if name.is_empty()
            || name.starts_with('.')
            || !name
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch))
        {
            c.fail("name", format!("\"{name}\" is not a usable directory name; use letters, digits, '-', '_' or '.'"));
        }
        let model = check_model(&mut c, &keys.model, custom.model, registry);
        let data = check_data(&mut c, &keys.data, &model, custom.data, registry);
        let train = keys.train;
        if let ScheduleKind::Cosine { min_lr } = train.schedule.kind
            && min_lr > train.lr
        {
            c.fail(
                "train.scheduler.min_lr",
                format!("must be in [0, train.lr = {}], got {min_lr}", train.lr),
            );
        }
        ConfigError::collect(c.errors)?;
        Ok(JobSpec {
            name,
            seed: keys.seed as u64,
            model,
            data,
            train,
            checkpoint: keys.checkpoint,
            distributed: keys.distributed,
            logging: keys.logging,
            expect: expectations(&keys.expect),
        })
    }
}

/// The model: a registered one (its options already read), or a built-in arch.
fn check_model(
    c: &mut Checker,
    m: &ModelKeys,
    custom: Option<(String, toml::Table)>,
    registry: &Registry,
) -> ModelSpec {
    c.one_of("model.arch", &m.arch, &registry.model_names());
    let model = match (custom, m.arch.as_str()) {
        (Some((arch, options)), _) => {
            let language = match registry.language(&arch, &options) {
                Some(Ok(language)) => Some(language),
                Some(Err(problem)) => {
                    c.fail("model", problem);
                    None
                }
                None => None,
            };
            ModelSpec::Custom {
                arch,
                options,
                language,
            }
        }
        (None, "cnn") => ModelSpec::Cnn,
        (None, "gpt") => ModelSpec::Gpt(check_gpt(c, m)),
        (None, _) => ModelSpec::Mlp {
            hidden: m.hidden.clone(),
        },
    };
    if !matches!(model, ModelSpec::Gpt(_)) {
        let given = [
            ("n_layer", m.n_layer.is_some()),
            ("n_head", m.n_head.is_some()),
            ("n_embd", m.n_embd.is_some()),
            ("block_size", m.block_size.is_some()),
            ("dropout", m.dropout.is_some()),
            ("bias", m.bias.is_some()),
            ("vocab_size", m.vocab_size.is_some()),
            ("activation", m.activation.is_some()),
            ("init_from", m.init_from.is_some()),
        ];
        for (key, _) in given.iter().filter(|(_, set)| *set) {
            c.fail(
                &format!("model.{key}"),
                format!(
                    "applies to model.arch = \"gpt\" only, but the arch is \"{}\"; remove it",
                    m.arch
                ),
            );
        }
    }
    model
}

/// The expectations that are set, in the order of [`Check::ALL`].
fn expectations(e: &ExpectKeys) -> Vec<Expectation> {
    let values = [
        e.min_test_accuracy,
        e.max_test_loss,
        e.max_final_loss,
        e.max_wall_s,
        e.min_train_samples_per_s,
    ];
    Check::ALL
        .into_iter()
        .zip(values)
        .filter_map(|(check, threshold)| {
            Some(Expectation {
                check,
                threshold: threshold?,
            })
        })
        .collect()
}

/// `model.*` of a gpt (the keys left out take [`GPT_DEFAULTS`], or with `init_from` the
/// checkpoint's shape, which a key the job restates must agree with), and how the shape fits.
fn check_gpt(c: &mut Checker, m: &ModelKeys) -> GptSpec {
    let d = match &m.init_from {
        Some(dir) => match pretrained_gpt(c, m, dir) {
            Some(pretrained) => pretrained,
            None => GPT_DEFAULTS,
        },
        None => GPT_DEFAULTS,
    };
    let n_head = m.n_head.unwrap_or(d.n_head);
    let n_embd = m.n_embd.unwrap_or(d.n_embd);
    if n_head > 0 && n_embd % n_head != 0 {
        c.fail(
            "model.n_embd",
            format!(
                "must be divisible by model.n_head = {n_head} (each head takes n_embd / n_head \
                 channels), got {n_embd}; e.g. {}",
                (n_embd / n_head).max(1) * n_head
            ),
        );
    }
    GptSpec {
        n_layer: m.n_layer.unwrap_or(d.n_layer),
        n_head,
        n_embd,
        block_size: m.block_size.unwrap_or(d.block_size),
        dropout: m.dropout.unwrap_or(d.dropout),
        bias: m.bias.unwrap_or(d.bias),
        vocab_size: m.vocab_size.or(d.vocab_size),
        activation: m.activation.unwrap_or(d.activation),
        init_from: m.init_from.clone(),
    }
}

/// The shape of the GPT-2 checkpoint in `dir` as a gpt's defaults (its weights need biases;
/// `dropout` stays the job's), each key the job restates checked against it. `None` after
/// an error, or when `dir` is gone but the keys say everything (a resumed job's `job.toml`:
/// its checkpoint replaces the weights).
fn pretrained_gpt(c: &mut Checker, m: &ModelKeys, dir: &str) -> Option<GptSpec> {
    let complete = m.n_layer.is_some()
        && m.n_head.is_some()
        && m.n_embd.is_some()
        && m.block_size.is_some()
        && m.vocab_size.is_some()
        && m.activation.is_some();
    let path = std::path::Path::new(dir);
    if complete && !path.join("config.json").is_file() {
        return None;
    }
    let (shape, source) = match crate::checkpoint::Trained::find(path) {
        Some(trained) => (trained.and_then(|t| trained_gpt_shape(&t)), "job.toml"),
        None => (
            crate::hf::HfDir::open(path)
                .and_then(|hf| crate::models::read_gpt2_shape(&hf))
                .map_err(|e| e.to_string()),
            "config.json",
        ),
    };
    let shape = shape.map_err(|e| c.fail("model.init_from", e)).ok()?;
    let source = format!("{dir}/{source}");
    let mut agree = |key: &str, given: Option<String>, theirs: String| {
        if let Some(given) = given.filter(|g| *g != theirs) {
            c.fail(
                &format!("model.{key}"),
                format!(
                    "is {given}, but {source} says {theirs}; leave the key out to take the \
                     checkpoint's"
                ),
            );
        }
    };
    let text = |v: Option<usize>| v.map(|v| v.to_string());
    agree("n_layer", text(m.n_layer), shape.n_layer.to_string());
    agree("n_head", text(m.n_head), shape.n_head.to_string());
    agree("n_embd", text(m.n_embd), shape.n_embd.to_string());
    agree(
        "vocab_size",
        text(m.vocab_size),
        shape.vocab_size.to_string(),
    );
    agree(
        "activation",
        m.activation.map(|a| format!("\"{}\"", a.name())),
        format!("\"{}\"", shape.activation.name()),
    );
    if let Some(bias) = m.bias.filter(|&b| b != shape.bias) {
        c.fail(
            "model.bias",
            format!("is {bias}, but the weights in {dir} were trained with bias = {}; leave the key out", shape.bias),
        );
    }
    if let Some(block) = m.block_size.filter(|&b| b > shape.n_positions) {
        c.fail(
            "model.block_size",
            format!(
                "is {block}, but {source} has position embeddings for {} tokens; use at most {}",
                shape.n_positions, shape.n_positions
            ),
        );
    }
    Some(GptSpec {
        n_layer: shape.n_layer,
        n_head: shape.n_head,
        n_embd: shape.n_embd,
        block_size: shape.n_positions,
        dropout: GPT_DEFAULTS.dropout,
        bias: shape.bias,
        vocab_size: Some(shape.vocab_size),
        activation: shape.activation,
        init_from: None,
    })
}

/// The shape of the gpt another job trained, from its `job.toml` (its vocabulary's size when
/// the data fixed it).
fn trained_gpt_shape(t: &crate::checkpoint::Trained) -> Result<crate::models::Gpt2Shape, String> {
    let model = t.model_table()?;
    let file = t.job.job_toml();
    if model.get("arch").and_then(toml::Value::as_str) != Some("gpt") {
        return Err(format!("`{}` is not a gpt job's", file.display()));
    }
    let int = |key: &str| {
        model
            .get(key)
            .and_then(toml::Value::as_integer)
            .map(|v| v as usize)
            .ok_or_else(|| format!("`{}` has no model.{key}", file.display()))
    };
    let activation = match model.get("activation").and_then(toml::Value::as_str) {
        Some("gelu_new") => crate::models::GptActivation::GeluNew,
        _ => crate::models::GptActivation::Gelu,
    };
    let vocab_size = match int("vocab_size") {
        Ok(v) => v,
        Err(e) => t.vocabulary_size().ok_or(e)?,
    };
    Ok(crate::models::Gpt2Shape {
        n_layer: int("n_layer")?,
        n_head: int("n_head")?,
        n_embd: int("n_embd")?,
        n_positions: int("block_size")?,
        vocab_size,
        activation,
        bias: model
            .get("bias")
            .and_then(toml::Value::as_bool)
            .unwrap_or(true),
    })
}

/// `data.*` of `text` and `tokens` data, and how they fit the model.
fn check_text_data(c: &mut Checker, d: &DataKeys, model: &ModelSpec) -> Option<DatasetKind> {
    let is_text = matches!(d.dataset.as_str(), "text" | "tokens");
    let language = model.language();
    if language.is_some() && !is_text {
        c.fail(
            "data.dataset",
            format!(
                "model.arch = \"{}\" learns from token sequences: use \"text\" or \"tokens\", \
                 not \"{}\"",
                model.arch(),
                d.dataset
            ),
        );
    } else if is_text && language.is_none() {
        c.fail(
            "model.arch",
            format!(
                "data.dataset = \"{}\" is token sequences: it needs a language model \
                 (model.arch = \"gpt\" or \"llama\"), not \"{}\"",
                d.dataset,
                model.arch()
            ),
        );
    }
    let text_keys = [
        ("path", d.path.is_some(), "text"),
        ("tokenizer", d.tokenizer.is_some(), "text"),
        ("val_fraction", d.val_fraction.is_some(), "text"),
        ("train_path", d.train_path.is_some(), "tokens"),
        ("val_path", d.val_path.is_some(), "tokens"),
        ("token_dtype", d.token_dtype.is_some(), "tokens"),
    ];
    for (key, _, kind) in text_keys
        .iter()
        .filter(|(_, set, kind)| *set && *kind != d.dataset)
    {
        c.fail(
            &format!("data.{key}"),
            format!(
                "applies to data.dataset = \"{kind}\" only, but the dataset is \"{}\"; remove it",
                d.dataset
            ),
        );
    }
    let required = |c: &mut Checker, key: &str, value: &Option<String>, example: &str| match value
        .as_deref()
    {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => {
            c.fail(
                key,
                format!(
                    "is required for data.dataset = \"{}\", e.g. {key} = \"{example}\"",
                    d.dataset
                ),
            );
            PathBuf::new()
        }
    };
    match d.dataset.as_str() {
        "text" => {
            let path = required(c, "data.path", &d.path, "data/shakespeare/input.txt");
            Some(DatasetKind::Text(TextSpec {
                path,
                // A pretrained model's own tokenizer unless the job names another.
                tokenizer: d.tokenizer.clone().unwrap_or_else(|| {
                    match language.as_ref().and_then(|l| l.tokenizer.clone()) {
                        Some(path) => TokenizerKind::HuggingFace(path),
                        None => TokenizerKind::Char,
                    }
                }),
                val_fraction: d.val_fraction.unwrap_or(0.1),
            }))
        }
        "tokens" => {
            let train_path = required(c, "data.train_path", &d.train_path, "data/owt/train.bin");
            let val_path = required(c, "data.val_path", &d.val_path, "data/owt/val.bin");
            let dtype = d.token_dtype.unwrap_or(TokenDtype::U16);
            if let Some(language) = &language {
                match language.vocab_size {
                    None => c.fail(
                        "model.vocab_size",
                        "is required for data.dataset = \"tokens\": the files do not say their \
                         vocabulary; e.g. 50304 for GPT-2's tokenizer padded as nanoGPT pads it",
                    ),
                    Some(v) if dtype == TokenDtype::U16 && v > 65536 => c.fail(
                        "model.vocab_size",
                        format!("{v} tokens do not fit data.token_dtype = \"u16\"; use \"u32\""),
                    ),
                    _ => {}
                }
            }
            Some(DatasetKind::Tokens(TokensSpec {
                train_path,
                val_path,
                dtype,
            }))
        }
        _ => None,
    }
}

fn check_data(
    c: &mut Checker,
    d: &DataKeys,
    model: &ModelSpec,
    custom: Option<(String, toml::Table)>,
    registry: &Registry,
) -> DataSpec {
    if let Some((name, options)) = custom {
        // A registered dataset's own keys were read by its options struct; a gpt on it is
        // checked when the model is built (the dataset says what it yields).
        return DataSpec {
            dataset: DatasetKind::Custom { name, options },
            root: PathBuf::from("."),
            download: false,
            drop_last: d.drop_last,
            mirrors: Vec::new(),
            checksums: Default::default(),
            normalize: None,
        };
    }
    c.one_of("data.dataset", &d.dataset, &registry.dataset_names());
    let text = check_text_data(c, d, model);
    let shape = d.synthetic.shape;
    let dataset = match (text, d.dataset.as_str()) {
        (Some(text), _) => text,
        (None, "fashion-mnist") => DatasetKind::FashionMnist,
        (None, "synthetic") => DatasetKind::Synthetic(d.synthetic.clone()),
        (None, _) => DatasetKind::Mnist,
    };
    let channels = if matches!(dataset, DatasetKind::Synthetic(_)) {
        shape[0]
    } else {
        1
    };
    let (height, width) = if matches!(dataset, DatasetKind::Synthetic(_)) {
        (shape[1], shape[2])
    } else {
        (28, 28)
    };
    if *model == ModelSpec::Cnn && (height < 6 || width < 6) {
        c.fail(
            "data.synthetic.shape",
            format!("the cnn needs images of at least 6x6, got {height}x{width}"),
        );
    }
    let normalize = if d.mean.is_empty() && d.std.is_empty() {
        None
    } else {
        if d.mean.len() != channels {
            c.fail(
                "data.mean",
                format!(
                    "needs one value per channel ({channels}), got {}",
                    d.mean.len()
                ),
            );
        }
        if d.std.len() != d.mean.len() {
            c.fail(
                "data.std",
                format!(
                    "needs as many values as data.mean ({}), got {}",
                    d.mean.len(),
                    d.std.len()
                ),
            );
        }
        Some((
            d.mean.iter().map(|&v| v as f32).collect(),
            d.std.iter().map(|&v| v as f32).collect(),
        ))
    };
    let root = d.root.clone().unwrap_or_else(|| match &dataset {
        DatasetKind::Text(t) => t
            .path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or(".".into(), |p| p.display().to_string()),
        _ => format!("data/{}", d.dataset),
    });
    DataSpec {
        dataset,
        root: PathBuf::from(root),
        download: d.download,
        drop_last: d.drop_last,
        mirrors: d.mirrors.clone(),
        checksums: d.checksums.clone(),
        normalize,
    }
}
