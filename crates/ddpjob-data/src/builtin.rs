//! ddpjob's own data sets, registered through the same [`Registry::dataset_with`] a user's
//! binary calls: each owns its `[data]` keys (its options struct's fields) and says, through
//! [`DatasetOptions`], how it is checked against the model, prepared in the launcher, counted
//! and described. The image sets are here; `text` and `tokens` in `text_options.rs`, `jsonl`
//! (instruction data) in `jsonl.rs`.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::catalog::{self, Catalog, Locate};
use super::{DataError, Dataset, idx, synthetic};
use ddpjob_seam::task::ModelInput;
use ddpjob_seam::{BuildError, DatasetOptions, JobFile};
use ddpjob_spec::{DataContext, KeyDoc};

/// An MNIST-format set of IDX files: which one.
pub trait IdxSet: 'static {
    const CATALOG: &'static Catalog;
}

/// `data.dataset = "mnist"`.
pub struct Mnist;
impl IdxSet for Mnist {
    const CATALOG: &'static Catalog = &catalog::MNIST;
}

/// `data.dataset = "fashion-mnist"`.
pub struct FashionMnist;
impl IdxSet for FashionMnist {
    const CATALOG: &'static Catalog = &catalog::FASHION_MNIST;
}

fn default_root<S: IdxSet>() -> String {
    format!("data/{}", S::CATALOG.name)
}

/// `data.dataset = "mnist"` or `"fashion-mnist"`: the four IDX files, found in `root` or
/// Debian's `/usr/share/datasets/<name>`, or downloaded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound = "")]
pub struct IdxOptions<S: IdxSet> {
    #[serde(default = "default_root::<S>")]
    pub root: String,
    #[serde(default)]
    pub download: bool,
    #[serde(default)]
    pub mirrors: Vec<String>,
    #[serde(default)]
    pub checksums: BTreeMap<String, String>,
    #[serde(default)]
    pub mean: Vec<f64>,
    #[serde(default)]
    pub std: Vec<f64>,
    #[serde(skip)]
    set: PhantomData<S>,
}

/// The image sets' per-channel normalisation, `mean` and `std`.
const MEAN: KeyDoc = KeyDoc {
    key: "mean",
    default: "none",
    doc: "per-channel normalisation after scaling to [0, 1]",
};
const STD: KeyDoc = KeyDoc { key: "std", ..MEAN };

pub const IDX_KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "root",
        default: "`\"data/<dataset>\"`",
        doc: "directory with the IDX files (.gz or raw); searched first, downloads go here",
    },
    KeyDoc {
        key: "download",
        default: "`false`",
        doc: "download missing files",
    },
    KeyDoc {
        key: "mirrors",
        default: "known mirrors",
        doc: "base URLs tried in order",
    },
    KeyDoc {
        key: "checksums",
        default: "built in",
        doc: "table: SHA-256 per file name (for private mirrors), checked when a file is \
              downloaded",
    },
    MEAN,
    STD,
];

impl<S: IdxSet> IdxOptions<S> {
    /// The set, from its files (found or downloaded by `prepare`).
    pub fn open(&self, _: &DataContext) -> Result<Dataset, DataError> {
        let paths = self.locate(self.download)?;
        let classes = match self.input() {
            Some(ModelInput::Image { classes, .. }) => classes,
            _ => 10,
        };
        Dataset::from_idx_files(
            &paths,
            classes,
            normalization(&self.mean, &self.std).as_ref(),
        )
    }

    fn locate(&self, download: bool) -> Result<[PathBuf; 4], DataError> {
        S::CATALOG.locate(&Locate {
            root: Path::new(&self.root),
            system_dir: Path::new("/usr/share/datasets").join(S::CATALOG.name),
            download,
            mirrors: &self.mirrors,
            checksums: &self.checksums,
        })
    }
}

impl<S: IdxSet> DatasetOptions for IdxOptions<S> {
    const PATHS: &'static [&'static str] = &["root"];

    fn complete(self, cx: &DataContext) -> Result<Self, String> {
        images_for(S::CATALOG.name, cx)?;
        if self.root.trim().is_empty() {
            return Err(format!(
                "data.root is empty: name the directory of the IDX files (by default \
                 \"{}\")",
                default_root::<S>()
            ));
        }
        let files: Vec<String> = catalog::FILES.iter().map(|f| format!("{f}.gz")).collect();
        sha256_digests(&self.checksums, &files)?;
        check_normalization(&self.mean, &self.std, 1)?;
        Ok(self)
    }

    fn prepare(&self, _: &DataContext) -> Result<Vec<JobFile>, BuildError> {
        self.locate(self.download)?;
        Ok(Vec::new())
    }

    fn input(&self) -> Option<ModelInput> {
        Some(ModelInput::Image {
            shape: [1, 28, 28],
            classes: 10,
        })
    }

    /// Read from the labels file when the files are on disk (never downloading).
    fn train_samples(&self) -> Option<(usize, String)> {
        let counted = self
            .locate(false)
            .ok()
            .and_then(|paths| idx::read_idx(&paths[1]).ok()?.dims.first().copied());
        Some(match counted {
            Some(n) => (n, "counted in the files".into()),
            None if self.download => (
                60_000,
                "the standard split; its files are not on disk yet (`run` downloads them)".into(),
            ),
            None => (
                60_000,
                "the standard split; its files are not on disk, and data.download = false: \
                 `run` will not find them"
                    .into(),
            ),
        })
    }
}

/// `data.dataset = "synthetic"`: class patterns plus noise, made from the seed (the
/// `[data.synthetic]` table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyntheticSpec {
    #[serde(default = "synthetic_train")]
    pub train_samples: usize,
    #[serde(default = "synthetic_test")]
    pub test_samples: usize,
    /// [channels, height, width].
    #[serde(default = "synthetic_shape")]
    pub shape: [usize; 3],
    #[serde(default = "synthetic_classes")]
    pub classes: usize,
    /// The std of the noise on each class pattern.
    #[serde(default = "synthetic_noise")]
    pub noise: f32,
}

fn synthetic_train() -> usize {
    4096
}
fn synthetic_test() -> usize {
    1024
}
fn synthetic_shape() -> [usize; 3] {
    [1, 28, 28]
}
fn synthetic_classes() -> usize {
    10
}
fn synthetic_noise() -> f32 {
    0.5
}

impl Default for SyntheticSpec {
    fn default() -> Self {
        SyntheticSpec {
            train_samples: synthetic_train(),
            test_samples: synthetic_test(),
            shape: synthetic_shape(),
            classes: synthetic_classes(),
            noise: synthetic_noise(),
        }
    }
}

/// `data.dataset = "synthetic"`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SyntheticOptions {
    #[serde(default)]
    pub synthetic: SyntheticSpec,
    #[serde(default)]
    pub mean: Vec<f64>,
    #[serde(default)]
    pub std: Vec<f64>,
}

pub const SYNTHETIC_KEYS: &[KeyDoc] = &[
    KeyDoc {
        key: "synthetic.train_samples",
        default: "`4096`",
        doc: "synthetic training samples",
    },
    KeyDoc {
        key: "synthetic.test_samples",
        default: "`1024`",
        doc: "synthetic test samples",
    },
    KeyDoc {
        key: "synthetic.shape",
        default: "`[1, 28, 28]`",
        doc: "[channels, height, width]",
    },
    KeyDoc {
        key: "synthetic.classes",
        default: "`10`",
        doc: "number of classes (2 to 256)",
    },
    KeyDoc {
        key: "synthetic.noise",
        default: "`0.5`",
        doc: "noise std on each class pattern",
    },
    MEAN,
    STD,
];

impl SyntheticOptions {
    /// The set, drawn from the job's seed.
    pub fn open(&self, cx: &DataContext) -> Result<Dataset, DataError> {
        let s = &self.synthetic;
        let (train, test) = synthetic::generate(s, cx.seed);
        let normalize = normalization(&self.mean, &self.std);
        Ok(Dataset::new(train, test, s.classes, normalize.as_ref()))
    }
}

/// Why the synthetic set cannot be held in this machine's memory (it is drawn there, a byte
/// per pixel, and read as f32), if it cannot.
fn synthetic_too_large(s: &SyntheticSpec) -> Option<String> {
    let pixels = s.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    let bytes = pixels.and_then(|p| s.train_samples.checked_add(s.test_samples)?.checked_mul(p));
    let available = crate::host::available_host_memory();
    match (bytes, available) {
        (Some(bytes), Some(available)) if bytes as u64 <= available => None,
        (Some(_), None) => None,
        _ => Some(format!(
            "data.synthetic: {} + {} samples of shape {:?} take {:.1} GB (a byte a pixel), more \
             than this machine has available ({}); lower train_samples or test_samples",
            s.train_samples,
            s.test_samples,
            s.shape,
            (s.train_samples as f64 + s.test_samples as f64)
                * s.shape.iter().map(|&d| d as f64).product::<f64>()
                / 1e9,
            available.map_or("unknown".into(), crate::host::gb),
        )),
    }
}

impl DatasetOptions for SyntheticOptions {
    fn complete(self, cx: &DataContext) -> Result<Self, String> {
        images_for("synthetic", cx)?;
        let s = &self.synthetic;
        let problem = if s.train_samples == 0 {
            Some("data.synthetic.train_samples must be at least 1".to_string())
        } else if s.test_samples == 0 {
            Some("data.synthetic.test_samples must be at least 1".to_string())
        } else if s.shape.contains(&0) {
            Some(format!(
                "data.synthetic.shape = {:?}: every dimension must be at least 1",
                s.shape
            ))
        } else if !(2..=256).contains(&s.classes) {
            Some(format!(
                "data.synthetic.classes = {}: must be 2 to 256",
                s.classes
            ))
        } else if s.noise.is_nan() || s.noise < 0.0 {
            Some(format!(
                "data.synthetic.noise = {}: must be at least 0",
                s.noise
            ))
        } else {
            synthetic_too_large(s)
        };
        if let Some(problem) = problem {
            return Err(problem);
        }
        check_normalization(&self.mean, &self.std, s.shape[0])?;
        Ok(self)
    }

    fn train_samples(&self) -> Option<(usize, String)> {
        Some((self.synthetic.train_samples, "synthetic".into()))
    }

    fn input(&self) -> Option<ModelInput> {
        Some(ModelInput::Image {
            shape: self.synthetic.shape,
            classes: self.synthetic.classes,
        })
    }

    fn describe(&self) -> Option<String> {
        let s = &self.synthetic;
        Some(format!("synthetic {}/{}", s.train_samples, s.test_samples))
    }
}

/// Image data for a language model is refused, naming what it takes.
fn images_for(dataset: &str, cx: &DataContext) -> Result<(), String> {
    match cx.language {
        Some(_) => Err(format!(
            "data.dataset = \"{dataset}\" is images, but model.arch = \"{}\" learns from token \
             sequences: use data.dataset = \"text\", \"tokens\" or \"jsonl\"",
            cx.arch
        )),
        None => Ok(()),
    }
}

/// `data.checksums`: each a SHA-256 digest, of one of the files `names` the dataset downloads
/// (a digest under another name would never be checked).
pub fn sha256_digests(sums: &BTreeMap<String, String>, names: &[String]) -> Result<(), String> {
    for (file, digest) in sums {
        if !names.contains(file) {
            return Err(format!(
                "data.checksums.{file}: not a file this dataset downloads, so it would never be \
                 checked; its files: {}",
                names.join(", ")
            ));
        }
        if digest.len() != 64 || !digest.chars().all(|ch| ch.is_ascii_hexdigit()) {
            return Err(format!(
                "data.checksums.{file} = \"{digest}\": must be a SHA-256 digest, 64 hex digits"
            ));
        }
    }
    Ok(())
}

fn check_normalization(mean: &[f64], std: &[f64], channels: usize) -> Result<(), String> {
    if mean.is_empty() && std.is_empty() {
        return Ok(());
    }
    if mean.len() != channels {
        return Err(format!(
            "data.mean needs one value per channel ({channels}), got {}",
            mean.len()
        ));
    }
    if std.len() != mean.len() {
        return Err(format!(
            "data.std needs as many values as data.mean ({}), got {}",
            mean.len(),
            std.len()
        ));
    }
    if let Some(m) = mean.iter().find(|m| !m.is_finite()) {
        return Err(format!(
            "data.mean: every value must be a finite number, got {m}"
        ));
    }
    // Pixels are divided by it in f32: it must be a finite f32 of normal size.
    let usable = |s: f64| s.is_finite() && s as f32 >= f32::MIN_POSITIVE && (s as f32).is_finite();
    match std.iter().find(|&&s| !usable(s)) {
        Some(s) => Err(format!(
            "data.std: every value must be a finite number above 0 (at least {:e}), got {s}",
            f32::MIN_POSITIVE
        )),
        None => Ok(()),
    }
}

/// Per-channel (mean, std) applied after scaling to [0, 1], when set.
fn normalization(mean: &[f64], std: &[f64]) -> Option<(Vec<f32>, Vec<f32>)> {
    if mean.is_empty() {
        return None;
    }
    let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect();
    Some((f32s(mean), f32s(std)))
}
