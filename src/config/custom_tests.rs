//! The `[model]` and `[data]` keys of registered models and datasets (`ddpjob-spec`'s
//! `custom.rs`), checked through a registry with a user's model and datasets beside the
//! built-in ones: tests of the spec and the registry together, so they live above both.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::{DataSpec, LoadedConfig, ModelSpec, load_str_with};
use crate::data::TensorDataset;
use crate::models::{Mlp, Model};
use crate::registry::{BuildError, DataContext, DatasetOptions, ModelContext, Registry};

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Tiny {
    width: usize,
    #[serde(default = "three")]
    depth: usize,
}

fn three() -> usize {
    3
}

#[derive(Serialize, Deserialize)]
struct Csv {
    path: String,
}

fn tiny(o: &Tiny, cx: &ModelContext) -> Result<Box<dyn Model>, BuildError> {
    Ok(Box::new(Mlp::new(
        [1, 1, 2],
        &[o.width; 1],
        2,
        cx.seed,
        &cx.device,
    )?))
}

fn csv(_: &Csv, _: &DataContext) -> Result<TensorDataset, BuildError> {
    Ok(TensorDataset::classification(
        [1, 1, 1],
        2,
        vec![0.0],
        vec![0],
        vec![1.0],
        vec![1],
    )?)
}

/// A dataset with hooks: its `rows` default to the model's width, it refuses a language
/// model, and it says what it is without being opened.
#[derive(Serialize, Deserialize)]
struct Rows {
    #[serde(default)]
    rows: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    file: Option<String>,
}

impl DatasetOptions for Rows {
    const PATHS: &'static [&'static str] = &["file"];

    fn complete(self, cx: &DataContext) -> Result<Self, String> {
        if cx.language.is_some() {
            return Err(format!("data.rows: \"{}\" is a language model", cx.arch));
        }
        Ok(Rows {
            rows: Some(self.rows.unwrap_or(if cx.arch == "tiny" { 8 } else { 4 })),
            ..self
        })
    }

    fn describe(&self) -> Option<String> {
        Some(format!("{} rows", self.rows.unwrap_or(0)))
    }
}

fn rows(_: &Rows, _: &DataContext) -> Result<TensorDataset, BuildError> {
    Err("never opened here".into())
}

fn registry() -> Registry {
    Registry::builtin()
        .model("tiny", tiny)
        .dataset("my-csv", csv)
        .dataset_with("rows", rows)
}

fn load(text: &str, overrides: &[&str]) -> Result<LoadedConfig, String> {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    load_str_with(Path::new("job.toml"), text.into(), &overrides, &registry())
        .map_err(|e| e.to_string())
}

/// `job.toml` holds a registered dataset's declared path keys made absolute, so a job
/// resumed from another directory reads the same file; an opener registered without
/// [`DatasetOptions`] declares none, and its keys are written as given.
#[test]
fn a_registered_datasets_declared_paths_are_frozen_absolute() {
    let base = Path::new("/base");
    let hooked = load(
        "[model]\narch = \"tiny\"\nwidth = 8\n[data]\ndataset = \"rows\"\nfile = \"d/rows.txt\"\n",
        &[],
    )
    .unwrap();
    let frozen = hooked.frozen_toml(base);
    assert!(frozen.contains("file = \"/base/d/rows.txt\""), "{frozen}");
    assert!(hooked.resolved_toml().contains("file = \"d/rows.txt\""));
    let plain = load(
        "[model]\narch = \"tiny\"\nwidth = 8\n[data]\ndataset = \"my-csv\"\npath = \"x.csv\"\n",
        &[],
    )
    .unwrap();
    let frozen = plain.frozen_toml(base);
    assert!(frozen.contains("path = \"x.csv\""), "{frozen}");
}

#[test]
fn a_registered_models_options_are_read_with_their_defaults() {
    let loaded = load(
        "[model]\narch = \"tiny\"\nwidth = 8\n[data]\ndataset = \"my-csv\"\npath = \"x.csv\"\ndrop_last = true\n",
        &[],
    )
    .unwrap();
    let ModelSpec { arch, options, .. } = &loaded.spec.model;
    assert_eq!(arch, "tiny");
    assert_eq!(options.get("width").and_then(|v| v.as_integer()), Some(8));
    assert_eq!(options.get("depth").and_then(|v| v.as_integer()), Some(3));
    let DataSpec {
        dataset, options, ..
    } = &loaded.spec.data;
    assert_eq!(dataset, "my-csv");
    assert_eq!(options.get("path").and_then(|v| v.as_str()), Some("x.csv"));
    assert!(loaded.spec.data.drop_last);

    // What `validate` prints and job.toml freezes: the options and nothing of mlp's or
    // of the image sets', and it reads back to the same spec.
    let text = loaded.resolved_toml();
    assert!(
        text.contains("width = 8") && text.contains("depth = 3"),
        "{text}"
    );
    assert!(
        !text.contains("hidden") && !text.contains("mirrors"),
        "{text}"
    );
    assert_eq!(load(&text, &[]).unwrap().spec, loaded.spec);
}

#[test]
fn unknown_and_mistyped_options_name_the_key_and_line() {
    let err = load("[model]\narch = \"tiny\"\nwidht = 8\n", &[]).unwrap_err();
    assert!(
        err.contains("unknown key `widht` in [model] (arch = \"tiny\") (job.toml:3:1)")
            && err.contains("did you mean `width`?"),
        "{err}"
    );
    let err = load("[model]\narch = \"tiny\"\nwidth = \"wide\"\n", &[]).unwrap_err();
    assert!(err.contains("`model.width` (job.toml:3:9)"), "{err}");
    let err = load("[model]\narch = \"tiny\"\n", &[]).unwrap_err();
    assert!(err.contains("missing field `width`"), "{err}");
    // Without deny_unknown_fields on the struct too: its fields are all it takes.
    let err = load(
        "[data]\ndataset = \"my-csv\"\npath = \"a\"\nroot = \"b\"\n",
        &[],
    );
    let err = err.unwrap_err();
    assert!(
        err.contains("unknown key `root` in [data] (dataset = \"my-csv\") (job.toml:4:1)"),
        "{err}"
    );
}

#[test]
fn set_overrides_options_and_unknown_names_list_the_registered_ones() {
    let loaded = load("[model]\narch = \"tiny\"\nwidth = 8\n", &["model.width=16"]).unwrap();
    assert_eq!(
        loaded
            .spec
            .model
            .options()
            .get("width")
            .and_then(|v| v.as_integer()),
        Some(16)
    );
    let err = load("[model]\narch = \"tiny\"\nwidth = 8\n", &["model.depht=2"]).unwrap_err();
    assert!(
        err.contains("--set model.depht=2") && err.contains("did you mean `depth`?"),
        "{err}"
    );
    let err = load("[model]\narch = \"tinny\"\n", &[]).unwrap_err();
    assert!(
        err.contains("expected one of \"cnn\", \"gpt\", \"llama\", \"mlp\", \"tiny\""),
        "{err}"
    );
    // The built-in text data is cut into windows of a language model's block_size: a
    // model registered with `model` (not `language_model`) has none.
    let err = load(
        "[model]\narch = \"tiny\"\nwidth = 8\n[data]\ndataset = \"text\"\npath = \"a.txt\"\n",
        &[],
    )
    .unwrap_err();
    assert!(
        err.contains("it needs a language model (model.arch = \"gpt\" or \"llama\"), not \"tiny\""),
        "{err}"
    );
    // A built-in arch still refuses keys that are not its own.
    let err = load("[model]\narch = \"mlp\"\nwidth = 8\n", &[]).unwrap_err();
    assert!(err.contains("unknown key `width` in [model]"), "{err}");
}

#[test]
fn a_dataset_with_hooks_is_completed_for_its_model_and_described() {
    let loaded = load(
        "[model]\narch = \"tiny\"\nwidth = 2\n[data]\ndataset = \"rows\"\n",
        &[],
    );
    let loaded = loaded.unwrap();
    assert_eq!(loaded.spec.data.options()["rows"].as_integer(), Some(8));
    assert!(loaded.resolved_toml().contains("rows = 8"));
    let described = registry().describe_data(&loaded.spec.data);
    assert_eq!(described, "8 rows");
    let given = load("[data]\ndataset = \"rows\"\nrows = 5\n", &[]).unwrap();
    assert_eq!(given.spec.data.options()["rows"].as_integer(), Some(5));
    let err = load(
        "[model]\narch = \"gpt\"\n[data]\ndataset = \"rows\"\nrows = 5\n",
        &[],
    )
    .unwrap_err();
    assert!(
        err.contains("`data.rows` (job.toml:5:8)") && err.contains("\"gpt\" is a language model"),
        "{err}"
    );
}
