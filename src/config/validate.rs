//! Turns the raw config into a [`JobSpec`]: every key's own check (declared with the key in
//! `keys.rs`), then what relates keys to each other (a gpt and its data, an image size and the
//! cnn, the normalisation and the channels, a registered model or dataset). All problems are
//! reported at once, each with its key and where it was written (file:line:col or `--set`).

use std::path::PathBuf;

use super::checks::Checker;
use super::custom::CustomParts;
use super::declare::Section;
use super::error::ConfigError;
use super::keys::{DataKeys, ExpectKeys, ModelKeys, RawConfig};
use super::source::Source;
use super::spec::{
    Check, DataSpec, DatasetKind, Expectation, JobSpec, ModelSpec, ScheduleKind, TextSpec,
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
        if keys.expect.max_test_perplexity.is_some() && data.dataset.image_shape().is_some() {
            c.fail(
                "expect.max_test_perplexity",
                format!(
                    "applies to language models, whose evaluations report perplexity; \
                     data.dataset = \"{}\" is classified (use min_test_accuracy or \
                     max_test_loss)",
                    data.dataset.name()
                ),
            );
        }
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

/// The model: its registered options, already read, and for a language model its window and
/// tokenizer.
fn check_model(
    c: &mut Checker,
    m: &ModelKeys,
    custom: Option<(String, toml::Table)>,
    registry: &Registry,
) -> ModelSpec {
    c.one_of("model.arch", &m.arch, &registry.model_names());
    let (arch, options) = custom.unwrap_or_else(|| (m.arch.clone(), toml::Table::new()));
    let language = match registry.language(&arch, &options) {
        Some(Ok(language)) => Some(language),
        Some(Err(problem)) => {
            c.fail("model", problem);
            None
        }
        None => None,
    };
    ModelSpec {
        arch,
        options,
        language,
    }
}

/// The expectations that are set, in the order of [`Check::ALL`].
fn expectations(e: &ExpectKeys) -> Vec<Expectation> {
    let values = [
        e.min_test_accuracy,
        e.max_test_loss,
        e.max_test_perplexity,
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
    if model.arch() == "cnn" && (height < 6 || width < 6) {
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
