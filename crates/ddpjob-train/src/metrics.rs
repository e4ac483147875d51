//! What the training loop measures: loss sums over log intervals (reduced over ranks), the
//! run's `summary.json`, and the test-only trace of the samples each step took.

use std::time::{Duration, Instant};

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::TrainError;
use crate::config::Monitor;
use crate::jobdir::JobDirError;
use crate::task::{MetricInfo, MetricValues};
use ddpjob_comm::Communicator;

/// `summary.json` (**contract**: the first seven fields).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    // A figure that is not a number (no epoch's train loss) is written as JSON `null`, so
    // `null` reads back as NaN: a summary must always read back.
    #[serde(deserialize_with = "null_as_nan")]
    pub test_accuracy: f64,
    #[serde(deserialize_with = "null_as_nan")]
    pub test_loss: f64,
    /// The final evaluation's other metrics, as its task declared them (`test_perplexity` for
    /// a language model, `test_<name>` for whatever a task declares).
    #[serde(flatten)]
    pub more_metrics: MetricValues,
    /// Mean training loss over the last epoch (sample-weighted, all ranks).
    #[serde(deserialize_with = "null_as_nan")]
    pub final_train_loss: f64,
    pub epochs: usize,
    pub steps: usize,
    /// Samples of all ranks / time in the training loop (data loading, evaluation and
    /// checkpoints excluded), as `torch_ref.py` measures it.
    pub train_samples_per_s: f64,
    pub wall_s: f64,
    pub train_s: f64,
    pub samples: u64,
    pub world_size: usize,
    pub parameters: usize,
    /// The values that train, when some are frozen (`[model.lora]`, `model.freeze`), as peft's
    /// `print_trainable_parameters` gives them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainable_parameters: Option<usize>,
    /// Language models: training tokens of all ranks per second (samples × block_size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_tokens_per_s: Option<f64>,
    /// The lowest evaluation loss of the run and the optimizer step after which it was taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_test_loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_step: Option<usize>,
    /// Each rank's peak resident memory in bytes (the kernel's `ru_maxrss`), in rank order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peak_rss_bytes: Vec<u64>,
    /// What `validate` and the launch log estimated a worker's peak to be (bytes), when the
    /// model says what its activations take.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_peak_bytes: Option<u64>,
    /// Set when `train.early_stopping` ended the run before its planned steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_early: Option<EarlyStop>,
    /// `[expect]` results, filled in by the launcher when the run ends.
    #[serde(default)]
    pub expectations: Vec<ExpectationResult>,
    /// What the task's evaluations report, the headline first (absent in older summaries:
    /// inferred from the metrics they hold).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub metrics: Vec<MetricInfo>,
}

fn null_as_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Why and where `train.early_stopping` ended a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EarlyStop {
    /// The optimizer step after whose evaluation training ended, and the steps planned.
    pub step: usize,
    pub planned_steps: usize,
    /// Evaluations in a row that did not improve on `best` by more than
    /// `train.early_stopping.min_delta` (`patience` of them).
    pub evaluations: usize,
    /// The figure watched (`train.early_stopping.monitor`).
    #[serde(default)]
    pub monitor: Monitor,
    /// The best value of it that counted as an improvement (none when no evaluation's was
    /// finite).
    #[serde(alias = "loss_to_beat")]
    pub best: Option<f64>,
}

impl EarlyStop {
    /// `stopped early after step 700 of 1000: 3 evaluations in a row did not improve on test
    /// loss 0.4123 (train.early_stopping)`, worded as `metrics` (the task's) word the figure.
    pub fn describe(&self, metrics: &[MetricInfo]) -> String {
        let name = self.monitor.metric();
        let info = metrics
            .iter()
            .find(|m| m.name == name)
            .cloned()
            .unwrap_or_else(|| MetricInfo::new(name, name));
        let beat = match self.best {
            Some(best) => format!("improve on {}", info.describe(best)),
            None => format!("give a finite {}", info.label),
        };
        format!(
            "stopped early after step {} of {}: {} evaluation{} in a row did not {beat} \
             (train.early_stopping)",
            self.step,
            self.planned_steps,
            self.evaluations,
            if self.evaluations == 1 { "" } else { "s" },
        )
    }
}

/// One checked `[expect]` entry, as `summary.json` records it (`report::check` makes them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpectationResult {
    /// The `[expect]` key, e.g. `min_test_accuracy`.
    pub name: String,
    /// The `summary.json` field compared, e.g. `test_accuracy`.
    pub metric: String,
    pub threshold: f64,
    /// The run's value; `null` when it was not a number (a diverged loss).
    pub value: Option<f64>,
    pub met: bool,
}

impl ExpectationResult {
    /// `min_test_accuracy: test_accuracy 0.8531 is below the minimum 0.9`.
    pub fn describe(&self) -> String {
        // The threshold as written; the value rounded unless rounding would blur the verdict
        // (0.84996 shown as 0.85 "below the minimum 0.85").
        let threshold = format!("{}", self.threshold);
        let value = self.value.map_or("NaN".into(), |v| {
            let short = fmt_number(v);
            let rounded: f64 = short.parse().unwrap_or(v);
            let same_side = rounded.partial_cmp(&self.threshold) == v.partial_cmp(&self.threshold);
            if same_side { short } else { format!("{v}") }
        });
        let minimum = self.name.starts_with("min_");
        let relation = match (self.value, self.met, minimum) {
            (None, _, _) => format!("is not a number (threshold {threshold})"),
            (_, true, true) => format!("is at least the minimum {threshold}"),
            (_, true, false) => format!("is at most the maximum {threshold}"),
            (_, false, true) => format!("is below the minimum {threshold}"),
            (_, false, false) => format!("is above the maximum {threshold}"),
        };
        format!("{}: {} {value} {relation}", self.name, self.metric)
    }
}

/// Numbers as people read them: up to 4 decimals for small ones, no trailing zeros.
fn fmt_number(x: f64) -> String {
    if x.abs() >= 1000.0 {
        format!("{x:.0}")
    } else {
        let s = format!("{x:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// The metrics `summary.json` names a field of its own (**contract**).
const SUMMARY_FIELDS: [&str; 2] = ["accuracy", "loss"];

impl Summary {
    /// What of `values` is not in a field of its own.
    pub fn more(values: &MetricValues) -> MetricValues {
        values.without(&SUMMARY_FIELDS)
    }

    /// The final evaluation's metrics, in the order its task declared them.
    pub fn values(&self) -> MetricValues {
        let mut all = MetricValues::default();
        for info in self.metrics() {
            let value = match info.name.as_str() {
                "accuracy" => Some(self.test_accuracy),
                "loss" => Some(self.test_loss),
                name => self.more_metrics.get(name),
            };
            if let Some(v) = value {
                all.set(&info.name, v);
            }
        }
        all
    }

    /// The metrics its run's task declared (inferred from the values of an older summary).
    pub fn metrics(&self) -> Vec<MetricInfo> {
        if !self.metrics.is_empty() {
            return self.metrics.clone();
        }
        MetricInfo::inferred(self.metric_names())
    }

    /// The names of the metrics it holds: its own fields' and the others beside them.
    pub fn metric_names(&self) -> impl Iterator<Item = &str> {
        SUMMARY_FIELDS.into_iter().chain(self.more_metrics.names())
    }

    /// `test accuracy 87.50%, test loss 0.4099` or `val loss 1.6527, perplexity 5.221,
    /// next-token accuracy 45.12%`.
    pub fn describe_eval(&self) -> String {
        self.values().describe(&self.metrics())
    }
}

/// Each step's sum of loss × samples (with the model's other terms beside it) and the sample
/// count, over some steps.
#[derive(Default)]
pub(super) struct LossTally {
    step_sums: Vec<Tensor>,
    samples: usize,
    time: Duration,
    /// The gradient norm of the interval's last step, when clipping computed it.
    grad_norm: Option<Tensor>,
}

/// A log interval's loss over all ranks.
pub(super) struct IntervalLoss {
    /// Each step's sum of loss × samples over all ranks, in step order.
    pub step_sums: Vec<f64>,
    /// The interval's mean of each of the model's other logged terms (`aux_loss`), in the
    /// order [`crate::models::Model::loss_terms`] names them.
    pub terms: Vec<f64>,
    pub samples: f64,
    pub secs: f64,
    /// The global gradient norm before clipping at the interval's last step (every rank's).
    pub grad_norm: Option<f64>,
}

impl IntervalLoss {
    pub fn mean(&self) -> f64 {
        self.step_sums.iter().sum::<f64>() / self.samples.max(1.0)
    }
}

impl LossTally {
    pub(super) fn add(
        &mut self,
        loss_sum: Tensor,
        samples: usize,
        time: Duration,
        grad_norm: Option<Tensor>,
    ) {
        self.step_sums.push(loss_sum);
        self.samples += samples;
        self.time += time;
        self.grad_norm = grad_norm;
    }

    /// The interval over all ranks — a collective. Each step's sum is kept apart, added over
    /// ranks in rank order, so an epoch's loss adds the same numbers in the same order however
    /// its steps were grouped into intervals (a resumed run's are grouped differently). The
    /// seconds are the steps' own plus the wait for the loss: on a GPU the steps return once
    /// their work is queued, and reading the loss waits until the device has done it, so the
    /// interval's rate is the device's, not the queueing's (on the CPU the wait is nil).
    pub(super) fn reduce(&mut self, comm: &dyn Communicator) -> Result<IntervalLoss, TrainError> {
        let waited = Instant::now();
        let local = match self.step_sums.as_slice() {
            [] => Vec::new(),
            sums => Tensor::stack(sums, 0)?
                .flatten_all()?
                .to_dtype(candle_core::DType::F64)?
                .to_vec1::<f64>()?,
        };
        // Each step's sums: its loss, then the model's other terms.
        let per_step = local.len() / self.step_sums.len().max(1);
        let secs = (self.time + waited.elapsed()).as_secs_f64();
        // Each rank's numbers in a slot of its own, zeros elsewhere: the sum over ranks is then
        // exact whatever order a backend adds in, and the ranks are added here, in order.
        let (world, rank, width) = (comm.world_size(), comm.rank(), local.len() + 1);
        let mut slots = vec![0.0; world * width];
        slots[rank * width..][..local.len()].copy_from_slice(&local);
        slots[rank * width + local.len()] = self.samples as f64;
        comm.all_reduce_sum_f64(&mut slots)?;
        let ranks: Vec<&[f64]> = slots.chunks(width).collect();
        let sums: Vec<f64> = (0..local.len())
            .map(|i| ranks.iter().map(|r| r[i]).fold(0.0, |sum, x| sum + x))
            .collect();
        let samples: f64 = ranks.iter().map(|r| r[local.len()]).sum();
        let step_sums = sums.iter().step_by(per_step.max(1)).copied().collect();
        let terms = (1..per_step)
            .map(|j| {
                let sum: f64 = sums.iter().skip(j).step_by(per_step).sum();
                sum / samples.max(1.0)
            })
            .collect();
        let grad_norm = match self.grad_norm.take() {
            Some(norm) => Some(norm.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?),
            None => None,
        };
        *self = LossTally::default();
        Ok(IntervalLoss {
            step_sums,
            terms,
            samples,
            secs,
            grad_norm,
        })
    }
}

pub(super) fn trace_samples(
    path: &std::path::Path,
    epoch: usize,
    step: usize,
    group: &[&[usize]],
) -> Result<(), TrainError> {
    use std::io::Write;
    let indices: Vec<String> = group
        .iter()
        .flat_map(|m| m.iter())
        .map(|i| i.to_string())
        .collect();
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| writeln!(f, "{epoch} {step} {}", indices.join(" ")))
        .map_err(|cause| {
            TrainError::JobDir(JobDirError::Io {
                path: path.to_path_buf(),
                cause,
            })
        })
}

/// One line of `logs/weights.jsonl` (`ddpjob verify`): after optimizer step `step`, a digest
/// of each parameter's values (the first 16 hex digits of the SHA-256 of its little-endian
/// bytes, in f32), in the model's parameter order.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WeightDigests {
    pub step: usize,
    pub tensors: Vec<(String, String)>,
}

/// Appends the digests of `params` after `step` to `path` (rank 0 alone: the ranks' weights
/// are equal after every step).
pub(super) fn trace_weights(
    path: &std::path::Path,
    step: usize,
    params: &crate::models::Params,
) -> Result<(), TrainError> {
    use sha2::{Digest, Sha256};
    use std::io::Write;
    let mut tensors = Vec::new();
    for (name, var) in params.iter() {
        let values = var
            .as_tensor()
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let digest = Sha256::digest(bytemuck::cast_slice::<f32, u8>(&values));
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        tensors.push((name.to_string(), hex));
    }
    let line = serde_json::to_string(&WeightDigests { step, tensors }).expect("digests serialise");
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| writeln!(f, "{line}"))
        .map_err(|cause| {
            TrainError::JobDir(JobDirError::Io {
                path: path.to_path_buf(),
                cause,
            })
        })
}

#[cfg(test)]
mod tests {
    use super::Summary;

    /// A NaN figure is written as `null` (JSON has no NaN) and must read back: the launcher
    /// reads every run's summary to finish the job.
    #[test]
    fn a_summary_with_figures_that_are_not_numbers_reads_back() {
        let json = serde_json::json!({
            "test_accuracy": 0.5, "test_loss": 1.5, "final_train_loss": 2.0,
            "epochs": 1, "steps": 40, "train_samples_per_s": 10.0, "wall_s": 1.0,
            "train_s": 1.0, "samples": 320, "world_size": 2, "parameters": 100,
        });
        let mut summary: Summary = serde_json::from_value(json).unwrap();
        (summary.final_train_loss, summary.test_accuracy) = (f64::NAN, f64::NAN);
        let text = serde_json::to_string(&summary).unwrap();
        assert!(text.contains("\"final_train_loss\":null"), "{text}");
        let summary: Summary = serde_json::from_str(&text).unwrap();
        assert!(summary.final_train_loss.is_nan() && summary.test_accuracy.is_nan());
        assert_eq!((summary.test_loss, summary.steps), (1.5, 40));
    }
}
