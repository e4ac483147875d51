//! The task seam: what a job learns from. A task knows its two splits, makes batches of inputs
//! and targets on a device, and says what its model takes. The trainer, evaluation, `bench step`
//! and the reports see only this, so image classification (a label per image) and language
//! modelling (a next token per position of a window) run through one loop.
//!
//! Both tasks share one loss: logits whose last dimension is the classes (or the vocabulary)
//! against integer targets of the same leading shape, mean cross-entropy per target. What an
//! evaluation reports is the task's to declare ([`Task::metrics`], the seam in `metric`): a
//! classifier its accuracy and loss, a language model its loss, perplexity and next-token
//! accuracy. The log, the records, `summary.json`, `eval`, `show`, TensorBoard and the curves
//! report what it declares.

use std::path::PathBuf;

use candle_core::{Device, Tensor};
use thiserror::Error;

pub use crate::metric::{
    Accuracy, EvalSums, MeanLoss, Metric, MetricInfo, MetricValues, Perplexity, classifier_metrics,
    language_metrics, preference_metrics,
};

/// What a model is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelInput {
    /// Images [c, h, w] → one of `classes` labels.
    Image {
        /// [channels, height, width] of one sample.
        shape: [usize; 3],
        /// The number of labels.
        classes: usize,
    },
    /// Token windows of `block_size` → a distribution over `vocab_size` for every position.
    Tokens {
        /// Distinct tokens.
        vocab_size: usize,
        /// Positions per window.
        block_size: usize,
    },
}

/// A training example as the trainer sees it before packing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    pub ids: Vec<u32>,
    /// Per token: whether the loss is on it (its prediction from the tokens before it
    /// scores); never the first token.
    pub trained: Vec<bool>,
}

impl Example {
    /// Hugging Face's labels: the id where trained, -100 elsewhere (unshifted).
    pub fn labels(&self) -> Vec<i64> {
        (self.ids.iter().zip(&self.trained))
            .map(|(&id, &t)| if t { id as i64 } else { -100 })
            .collect()
    }
}

/// What a task's training examples hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExampleCounts {
    pub examples: usize,
    pub tokens: usize,
    /// Tokens the loss is on.
    pub trained: usize,
    /// Examples cut to the model's context.
    pub truncated: usize,
    /// Examples left out with nothing to train (e.g. a template that marks no token).
    pub left_out: usize,
    /// Records skipped as bad (`data.skip_bad_lines`).
    pub bad_records: usize,
    /// The examples are preference pairs, two a sample (chosen, then rejected).
    pub pairs: bool,
}

/// A data set a job trains on, whatever it predicts.
pub trait Task: Send + Sync {
    /// Samples per epoch of the training split (images, or token windows).
    fn train_len(&self) -> usize;
    /// Samples of the evaluation split.
    fn eval_len(&self) -> usize;
    /// Targets per sample: 1 for a classifier, the window length for a language model.
    fn targets_per_sample(&self) -> usize;
    /// What a model of this task takes and predicts.
    fn input(&self) -> ModelInput;
    /// Where batches come from on `device`.
    fn batches<'a>(&'a self, device: &Device) -> Result<Box<dyn BatchSource + 'a>, DataError>;
    /// Whether some targets are [`IGNORE_TARGET`] (instruction data's prompts, padding): a
    /// step's loss is then the mean over the targets that score in the whole global batch,
    /// whose count every step all-reduces. Tasks whose every target scores say no (the
    /// default) and weigh samples by rows, with no extra collective.
    fn masks_targets(&self) -> bool {
        false
    }
    /// The first `n` training examples as the trainer sees them before packing
    /// (`ddpjob preview`). Empty (the default): the task is not made of examples (windows of
    /// a corpus, images).
    fn examples(&self, _n: usize) -> Vec<Example> {
        Vec::new()
    }
    /// What the training examples hold, for `validate` and `preview`; `None` (the default):
    /// not a task of examples.
    fn example_counts(&self) -> Option<ExampleCounts> {
        None
    }
    /// What its evaluations report, the headline one first (`show`'s best, `list`'s column,
    /// the best checkpoint). The default: a language model's for token windows, a
    /// classifier's for images (see [`metrics_for`]).
    fn metrics(&self) -> Vec<Box<dyn Metric>> {
        metrics_for(self.input())
    }
}

/// A task picked when the data is opened (rows as examples or as windows, say), boxed:
/// everything forwarded, the defaults included.
impl<T: Task + ?Sized> Task for Box<T> {
    fn train_len(&self) -> usize {
        (**self).train_len()
    }
    fn eval_len(&self) -> usize {
        (**self).eval_len()
    }
    fn targets_per_sample(&self) -> usize {
        (**self).targets_per_sample()
    }
    fn input(&self) -> ModelInput {
        (**self).input()
    }
    fn batches<'a>(&'a self, device: &Device) -> Result<Box<dyn BatchSource + 'a>, DataError> {
        (**self).batches(device)
    }
    fn masks_targets(&self) -> bool {
        (**self).masks_targets()
    }
    fn examples(&self, n: usize) -> Vec<Example> {
        (**self).examples(n)
    }
    fn example_counts(&self) -> Option<ExampleCounts> {
        (**self).example_counts()
    }
    fn metrics(&self) -> Vec<Box<dyn Metric>> {
        (**self).metrics()
    }
}

/// The built-in metrics of a task whose model takes `input`: a classifier's accuracy and loss,
/// a language model's loss, perplexity and next-token accuracy.
pub fn metrics_for(input: ModelInput) -> Vec<Box<dyn Metric>> {
    match input {
        ModelInput::Image { .. } => classifier_metrics(),
        ModelInput::Tokens { .. } => language_metrics(),
    }
}

/// Why data could not be found, read or batched; each names the file and the fix.
#[allow(missing_docs)] // fields: the file, and what went wrong with it
#[derive(Debug, Error)]
pub enum DataError {
    /// A file could not be read.
    #[error("cannot read `{}`: {cause}", path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    /// A file's contents are not what its format says.
    #[error("`{}` is damaged: {problem}", path.display())]
    Corrupt { path: PathBuf, problem: String },
    /// A built-in dataset's files are not on disk and may not be downloaded.
    #[error(
        "{dataset}: missing {} (looked in {}); put the IDX files (.gz or raw) in data.root, \
         install Debian's dataset-{dataset} package if there is one, or set data.download = true",
        missing.join(", "),
        searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" and ")
    )]
    NotFound {
        dataset: String,
        missing: Vec<String>,
        searched: Vec<PathBuf>,
    },
    /// Every mirror failed for a file.
    #[error("could not download {file} to `{}`; every mirror failed:\n  {}\n\
             check the network, set data.mirrors, or copy the file there by hand",
            dest.display(), failures.join("\n  "))]
    Download {
        file: String,
        dest: PathBuf,
        failures: Vec<String>,
    },
    /// Data that does not fit the job (shapes, vocabularies, labels), or a dataset opener's
    /// error.
    #[error("{0}")]
    Mismatch(String),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

/// Makes batches of (inputs, targets) on a device.
pub trait BatchSource {
    /// Training samples `indices` of `epoch` (a language model's windows move every epoch).
    fn train(&self, epoch: usize, indices: &[usize]) -> Result<(Tensor, Tensor), DataError>;
    /// Evaluation samples `indices`.
    fn eval(&self, indices: &[usize]) -> Result<(Tensor, Tensor), DataError>;
    /// A line for the log about how batches are made, if worth saying.
    fn note(&self) -> Option<String> {
        None
    }
}

pub use ddpjob_kernels::loss::{
    IGNORE_TARGET, cross_entropy, loss_sum_and_correct, scored_targets,
};

/// The seed of a training sample's random choices (dropout): a function of the job's seed, the
/// epoch and the sample's index only, so it is the same whichever rank or batch the sample
/// lands in.
pub fn sample_seed(seed: u64, epoch: usize, index: usize) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((epoch as u64) << 40)
        .wrapping_add(index as u64);
    // splitmix64's finaliser.
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_and_accuracy_flatten_any_leading_shape() {
        // Two windows of two positions over 3 classes. By hand (= torch's
        // F.cross_entropy(x.view(-1, 3), y.view(-1))): -ln softmax per target is 0.2395, 1.5514,
        // 0.0949 and ln 3 = 1.0986, mean 0.7461.
        let logits = Tensor::new(
            &[
                [[2.0f32, 0.0, 0.0], [0.0, 1.0, 0.0]],
                [[0.0, 0.0, 3.0], [1.0, 1.0, 1.0]],
            ],
            &Device::Cpu,
        )
        .unwrap();
        let targets = Tensor::new(&[[0u32, 2], [2, 1]], &Device::Cpu).unwrap();
        let mean = cross_entropy(&logits, &targets)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!((mean - 0.7461).abs() < 1e-3, "{mean}");
        let (sum, correct) = loss_sum_and_correct(&logits, &targets).unwrap();
        assert!((sum - 4.0 * mean as f64).abs() < 1e-4);
        // argmax: 0, 1, 2, 0 against 0, 2, 2, 1.
        assert_eq!(correct, 2);
    }

    #[test]
    fn ignored_targets_score_nothing_and_change_nothing() {
        // Four rows over 3 classes; rows 1 and 3 ignored: the loss, its gradient and the
        // evaluation sums are those of rows 0 and 2 alone.
        let logits = Tensor::new(
            &[
                [2.0f32, 0.0, 0.0],
                [0.0, 1.0, 0.0],
                [0.0, 0.0, 3.0],
                [1.0, 1.0, 1.0],
            ],
            &Device::Cpu,
        )
        .unwrap();
        let logits = candle_core::Var::from_tensor(&logits).unwrap();
        let masked = Tensor::new(&[0u32, IGNORE_TARGET, 2, IGNORE_TARGET], &Device::Cpu).unwrap();
        let kept_rows = Tensor::new(&[0u32, 2], &Device::Cpu).unwrap();
        let kept = logits.index_select(&kept_rows, 0).unwrap();
        let subset = Tensor::new(&[0u32, 2], &Device::Cpu).unwrap();
        let a = cross_entropy(&logits, &masked).unwrap();
        let b = cross_entropy(&kept, &subset).unwrap();
        let (av, bv) = (a.to_scalar::<f32>().unwrap(), b.to_scalar::<f32>().unwrap());
        assert!((av - bv).abs() < 1e-6, "{av} vs {bv}");
        let (ga, gb) = (a.backward().unwrap(), b.backward().unwrap());
        let (ga, gb) = (ga.get(&logits).unwrap(), gb.get(&logits).unwrap());
        let diff = (ga - gb).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-7);
        assert_eq!(scored_targets(&masked).unwrap(), 2);
        let (sum, correct) = loss_sum_and_correct(&logits, &masked).unwrap();
        assert!((sum - 2.0 * bv as f64).abs() < 1e-5, "{sum}");
        assert_eq!(correct, 2);
        // Nothing scored: a zero loss, not a NaN.
        let none = Tensor::new(&[IGNORE_TARGET; 4], &Device::Cpu).unwrap();
        assert_eq!(
            cross_entropy(&logits, &none)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
    }

    #[test]
    fn sample_seeds_differ_by_epoch_and_index_only() {
        assert_eq!(sample_seed(1, 2, 3), sample_seed(1, 2, 3));
        assert_ne!(sample_seed(1, 2, 3), sample_seed(1, 2, 4));
        assert_ne!(sample_seed(1, 2, 3), sample_seed(1, 3, 3));
        assert_ne!(sample_seed(1, 2, 3), sample_seed(2, 2, 3));
    }
}
