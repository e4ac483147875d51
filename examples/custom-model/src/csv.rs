//! `data.dataset = "csv"`: labelled samples from CSV files, one sample per line, the label
//! first, then the sample's values (`label,v1,v2,...`); a header line is skipped.

use std::path::{Path, PathBuf};

use ddpjob::{BuildError, DataContext, DatasetOptions, TensorDataset};
use serde::{Deserialize, Serialize};

/// `[data]` keys besides `dataset = "csv"` and `drop_last`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Options {
    pub train_path: PathBuf,
    pub test_path: PathBuf,
    /// [channels, height, width] of a sample (their product is the values per line);
    /// default [1, 1, values].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<[usize; 3]>,
    /// Classes (default: the largest label + 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub classes: Option<usize>,
}

/// `train_path` and `test_path` are frozen absolute into `job.toml`, so `custom-model resume`
/// works from any directory.
impl DatasetOptions for Options {
    const PATHS: &'static [&'static str] = &["train_path", "test_path"];
}

pub struct CsvDataset;

impl CsvDataset {
    /// The opener registered as `csv`.
    pub fn open(options: &Options, _: &DataContext) -> Result<TensorDataset, BuildError> {
        let (train_x, train_y, width) = read(&options.train_path)?;
        let (test_x, test_y, test_width) = read(&options.test_path)?;
        if width != test_width {
            return Err(format!(
                "`{}` has {width} values per line but `{}` has {test_width}",
                options.train_path.display(),
                options.test_path.display()
            )
            .into());
        }
        let shape = options.shape.unwrap_or([1, 1, width]);
        let classes = options.classes.unwrap_or_else(|| {
            train_y
                .iter()
                .chain(&test_y)
                .max()
                .map_or(1, |&m| m as usize + 1)
        });
        Ok(TensorDataset::classification(
            shape, classes, train_x, train_y, test_x, test_y,
        )?)
    }
}

/// Values, labels and values per line of one file.
fn read(path: &Path) -> Result<(Vec<f32>, Vec<u32>, usize), BuildError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    let (mut values, mut labels, mut width) = (Vec::new(), Vec::new(), None);
    for (i, line) in text.lines().enumerate() {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let Ok(label) = fields[0].parse::<u32>() else {
            if i == 0 {
                continue; // a header
            }
            return Err(format!(
                "`{}` line {}: the label `{}` is not a class number",
                path.display(),
                i + 1,
                fields[0]
            )
            .into());
        };
        let row = fields[1..]
            .iter()
            .map(|v| v.parse::<f32>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("`{}` line {}: {e}", path.display(), i + 1))?;
        if *width.get_or_insert(row.len()) != row.len() {
            return Err(format!(
                "`{}` line {} has {} values, the lines before {}",
                path.display(),
                i + 1,
                row.len(),
                width.unwrap_or(0)
            )
            .into());
        }
        values.extend(row);
        labels.push(label);
    }
    Ok((values, labels, width.unwrap_or(0)))
}
