//! A job's training history read back from `metrics.jsonl`: the numbers behind the curves, the
//! sparkline and the best/last metrics of `ddpjob show`.

use std::path::Path;

use super::record::{self, Record};
use crate::task::{MetricInfo, MetricValues};

/// One log-interval line (`"kind": "train"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainPoint {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
}

/// One end-of-epoch line (`"kind": "epoch"`).
#[derive(Debug, Clone, PartialEq)]
pub struct EpochPoint {
    pub epoch: usize,
    pub step: usize,
    pub train_loss: f64,
    /// The evaluation after it, as its task declared it.
    pub metrics: MetricValues,
    pub lr: f64,
}

/// One evaluation every `train.eval_every` steps (`"kind": "eval"`), often on part of the split.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalPoint {
    pub step: usize,
    pub metrics: MetricValues,
}

/// One evaluation of either kind: `epoch` is the 0-based epoch of an end-of-epoch one.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluated {
    pub step: usize,
    pub epoch: Option<usize>,
    pub metrics: MetricValues,
}

impl EpochPoint {
    pub fn test_loss(&self) -> f64 {
        self.metrics.value("loss")
    }
}

impl EvalPoint {
    pub fn test_loss(&self) -> f64 {
        self.metrics.value("loss")
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct History {
    pub train: Vec<TrainPoint>,
    pub epochs: Vec<EpochPoint>,
    pub evals: Vec<EvalPoint>,
    /// Steps at which training went on from a checkpoint (`"kind": "resume"`): `ddpjob resume`
    /// and automatic restarts alike.
    pub resumes: Vec<usize>,
    /// How many of those were `ddpjob resume` (or `run --resume auto`), not a restart.
    pub resumed_by_user: usize,
    /// Lines that were not JSON objects of a known kind (a torn last line after a crash).
    pub skipped: usize,
    /// The names of the metrics its evaluations carry, in the order first seen.
    pub metric_names: Vec<String>,
}

impl History {
    /// Reads `metrics.jsonl`; a missing file is an empty history.
    pub fn read(path: &Path) -> std::io::Result<History> {
        Ok(record::read_text(path)?.map_or_else(History::default, |text| History::parse(&text)))
    }

    pub fn parse(text: &str) -> History {
        let (records, skipped) = record::parse_all(text);
        let mut h = History {
            skipped,
            ..History::default()
        };
        for r in records {
            match r {
                Record::Train { step, loss, lr, .. } => h.train.push(TrainPoint { step, loss, lr }),
                Record::Epoch {
                    epoch,
                    step,
                    loss,
                    lr,
                    metrics,
                    ..
                } => {
                    h.note_names(&metrics);
                    h.epochs.push(EpochPoint {
                        epoch,
                        step,
                        train_loss: loss,
                        metrics,
                        lr,
                    })
                }
                Record::Eval { step, metrics, .. } => {
                    h.note_names(&metrics);
                    h.evals.push(EvalPoint { step, metrics })
                }
                Record::Resume { step, restart, .. } => {
                    h.resumes.push(step);
                    h.resumed_by_user += usize::from(restart == 0);
                }
            }
        }
        h
    }

    fn note_names(&mut self, metrics: &MetricValues) {
        for name in metrics.names() {
            if !self.metric_names.iter().any(|n| n == name) {
                self.metric_names.push(name.into());
            }
        }
    }

    pub fn last_epoch(&self) -> Option<&EpochPoint> {
        self.epochs.last()
    }

    /// Every evaluation, periodic or end of epoch, by step; the step-0 evaluation (of the
    /// starting weights) is none, as for the `best` checkpoint.
    fn evaluations(&self) -> Vec<Evaluated> {
        let periodic = self.evals.iter().filter(|e| e.step > 0).map(|e| Evaluated {
            step: e.step,
            epoch: None,
            metrics: e.metrics.clone(),
        });
        let epoch_ends = self.epochs.iter().map(|e| Evaluated {
            step: e.step,
            epoch: Some(e.epoch),
            metrics: e.metrics.clone(),
        });
        let mut all: Vec<Evaluated> = periodic.chain(epoch_ends).collect();
        all.sort_by_key(|e| e.step);
        all
    }

    /// The best evaluation by `metric` (see [`Self::evaluations`]), the earliest of equals.
    pub fn best_by(&self, metric: &MetricInfo) -> Option<Evaluated> {
        self.evaluations()
            .into_iter()
            .filter(|e| e.metrics.value(&metric.name).is_finite())
            .fold(None, |best, e| match best {
                Some(b)
                    if !metric
                        .better(e.metrics.value(&metric.name), b.metrics.value(&metric.name)) =>
                {
                    Some(b)
                }
                _ => Some(e),
            })
    }

    /// The lowest test loss of any evaluation (see [`Self::evaluations`]): (step, loss), the
    /// earliest of equals.
    pub fn lowest_test_loss(&self) -> Option<(usize, f64)> {
        let loss = MetricInfo::new("loss", "loss");
        self.best_by(&loss)
            .map(|e| (e.step, e.metrics.value("loss")))
    }

    /// The newest training loss, from a log-interval or an epoch line.
    pub fn last_train_loss(&self) -> Option<f64> {
        let from_train = self.train.last().map(|p| (p.step, p.loss));
        let from_epoch = self.epochs.last().map(|e| (e.step, e.train_loss));
        match (from_train, from_epoch) {
            (Some(a), Some(b)) => Some(if a.0 > b.0 { a.1 } else { b.1 }),
            (a, b) => a.or(b).map(|p| p.1),
        }
    }
}

const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// `values` as at most `width` block characters, low to high; each character is the mean of
/// the values it covers. Non-finite values are left out; empty if nothing is left.
pub fn sparkline(values: &[f64], width: usize) -> String {
    let finite: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if finite.is_empty() || width == 0 {
        return String::new();
    }
    let cells = finite.len().min(width);
    let means: Vec<f64> = (0..cells)
        .map(|c| {
            let (lo, hi) = (c * finite.len() / cells, (c + 1) * finite.len() / cells);
            finite[lo..hi].iter().sum::<f64>() / (hi - lo) as f64
        })
        .collect();
    let (min, max) = means
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    means
        .iter()
        .map(|&v| {
            let level = if max > min {
                ((v - min) / (max - min) * 7.0).round() as usize
            } else {
                3
            };
            BARS[level.min(7)]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_kind_and_counts_what_it_cannot_read() {
        let text = r#"{"kind":"train","epoch":0,"step":4,"loss":2.0,"lr":0.01}
{"kind":"epoch","epoch":0,"step":8,"loss":1.5,"lr":0.01,"test_loss":1.2,"test_accuracy":0.6}
{"kind":"resume","epoch":1,"step":8}
{"kind":"eval","epoch":1,"step":10,"test_loss":1.1,"test_accuracy":0.5}
{"kind":"resume","epoch":1,"step":10,"restart":1}
{"kind":"train","epoch":1,"step":12,"loss":1.0,"lr":0.005}
{"kind":"epoch","epoch":1,"step":16,"loss":0.9,"lr":0.005,"test_loss":1.3,"test_accuracy":0.55}
{"kind":"train","epo"#;
        let h = History::parse(text);
        assert_eq!(h.train.len(), 2);
        assert_eq!(h.epochs.len(), 2);
        // The second is an automatic restart's, not a resume of the user's.
        assert_eq!((h.resumes.clone(), h.resumed_by_user), (vec![8, 10], 1));
        assert_eq!(h.evals.len(), 1);
        assert_eq!(h.lowest_test_loss(), Some((10, 1.1)));
        assert_eq!(h.skipped, 1);
        let accuracy = MetricInfo::inferred(["accuracy"]).remove(0);
        assert_eq!(h.best_by(&accuracy).unwrap().epoch, Some(0));
        // A periodic evaluation more accurate than every epoch's is the best.
        let more = format!(
            "{text}\n{}",
            r#"{"kind":"eval","epoch":1,"step":14,"test_loss":1.4,"test_accuracy":0.7}"#
        );
        let best = History::parse(&more).best_by(&accuracy).unwrap();
        let best_accuracy = best.metrics.value("accuracy");
        assert_eq!((best.step, best.epoch, best_accuracy), (14, None, 0.7));
        assert_eq!(h.last_epoch().unwrap().metrics.get("accuracy"), Some(0.55));
        assert_eq!(h.metric_names, ["loss", "accuracy"]);
        assert_eq!(h.last_train_loss(), Some(0.9));
        assert_eq!(h.train[1].lr, 0.005);
    }

    /// A language model's records carry perplexity; the step-0 evaluation of the starting
    /// weights is never the lowest loss, however low.
    #[test]
    fn records_name_their_metrics_and_step_0_is_no_candidate() {
        let text = r#"{"kind":"eval","epoch":0,"step":0,"test_loss":0.5,"test_accuracy":0.1,"test_perplexity":1.6487}
{"kind":"eval","epoch":0,"step":10,"test_loss":0.9,"test_accuracy":0.1,"test_perplexity":2.4596}"#;
        let h = History::parse(text);
        assert_eq!(h.metric_names, ["loss", "accuracy", "perplexity"]);
        assert_eq!(h.lowest_test_loss(), Some((10, 0.9)));
        // Whatever a task declared is read the same way, and judged by its direction.
        let rewards = r#"{"kind":"eval","epoch":0,"step":5,"test_loss":0.7,"test_rewards/margins":0.2}
{"kind":"eval","epoch":0,"step":9,"test_loss":0.6,"test_rewards/margins":0.5}"#;
        let h = History::parse(rewards);
        let margins = MetricInfo::new("rewards/margins", "margins").higher_better();
        assert_eq!(h.best_by(&margins).map(|e| e.step), Some(9));
        assert_eq!(h.metric_names, ["loss", "rewards/margins"]);
    }

    #[test]
    fn sparkline_scales_low_to_high_and_averages_into_its_width() {
        assert_eq!(sparkline(&[3.0, 2.0, 1.0, 0.0], 10), "█▆▃▁");
        // 8 values into 4 cells: pairs are averaged.
        assert_eq!(
            sparkline(&[4.0, 4.0, 3.0, 3.0, 2.0, 2.0, 1.0, 1.0], 4),
            "█▆▃▁"
        );
        assert_eq!(sparkline(&[1.0, f64::NAN, 1.0], 5), "▄▄");
        assert_eq!(sparkline(&[], 5), "");
    }
}
