//! The metric seam: what an evaluation reports is the task's to declare, not the trainer's or
//! the reports'. A task declares its [`Metric`]s (burn-train's model: each metric knows its name
//! and how it reads, and computes its value from what the evaluation added up); an evaluation
//! carries their values as [`MetricValues`], a map by name in the order declared, headline
//! first. The records (`metrics.jsonl`'s `test_<name>` fields), `summary.json`, TensorBoard's
//! `test/<name>` tags, `eval`, `show`, `list` and `curves.svg` read what is declared through
//! [`MetricInfo`], the part of a metric that is data and travels in the job directory, so a
//! metric a new task declares is logged, plotted and shown with no change to any of them.
//!
//! It depends on serde only: never on a model, a dataset or a report.

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// What a report needs of a metric to show it: its name, how it is worded, whether it is a
/// fraction shown in percent, and which way is better. Recorded in the job directory
/// (`state.json`, `summary.json`) so `show` and `list` read it without building the task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricInfo {
    /// `loss`, `accuracy`, `rewards/margins`: the record's field is `test_<name>`, the
    /// TensorBoard tag `test/<name>`.
    pub name: String,
    /// How the log and `show` word it: `test loss`, `next-token accuracy`.
    pub label: String,
    /// A fraction, shown in percent (`87.50%`).
    #[serde(default)]
    pub percent: bool,
    /// Whether a higher value is the better one (the best checkpoint, `show`'s best).
    #[serde(default)]
    pub higher_is_better: bool,
    /// Decimals shown (of the percentage, for a fraction).
    #[serde(default = "four")]
    pub decimals: usize,
}

fn four() -> usize {
    4
}

impl MetricInfo {
    /// A number shown with four decimals, lower being better.
    pub fn new(name: &str, label: &str) -> Self {
        MetricInfo {
            name: name.into(),
            label: label.into(),
            percent: false,
            higher_is_better: false,
            decimals: 4,
        }
    }

    /// The same, a fraction shown in percent with two decimals.
    pub fn in_percent(mut self) -> Self {
        self.percent = true;
        self.decimals = 2;
        self
    }

    /// The same, shown with `decimals`.
    pub fn with_decimals(mut self, decimals: usize) -> Self {
        self.decimals = decimals;
        self
    }

    /// The same, a higher value being better.
    pub fn higher_better(mut self) -> Self {
        self.higher_is_better = true;
        self
    }

    /// Its field in `metrics.jsonl` and `summary.json`: `test_loss`.
    pub fn field(&self) -> String {
        field_of(&self.name)
    }

    /// Its TensorBoard tag: `test/loss`.
    pub fn tag(&self) -> String {
        format!("test/{}", self.name)
    }

    /// `0.4099`, `87.50%`.
    pub fn show(&self, value: f64) -> String {
        let places = self.decimals;
        match self.percent {
            true => format!("{:.places$}%", value * 100.0),
            false => format!("{value:.places$}"),
        }
    }

    /// `test loss 0.4099`, `next-token accuracy 45.12%`.
    pub fn describe(&self, value: f64) -> String {
        format!("{} {}", self.label, self.show(value))
    }

    /// Whether `a` is better than `b` (finite values only; the earlier of equals stays).
    pub fn better(&self, a: f64, b: f64) -> bool {
        a.is_finite() && (!b.is_finite() || if self.higher_is_better { a > b } else { a < b })
    }

    /// The metrics a job of older files declared, known by the names its records carry: a
    /// language model's when they include `perplexity`, a classifier's otherwise; a name
    /// neither declares is shown as a plain number under its own name.
    pub fn inferred<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<MetricInfo> {
        let names: Vec<&str> = names.into_iter().collect();
        let known = match names.contains(&"perplexity") {
            true => language_metrics(),
            false => classifier_metrics(),
        };
        let mut infos: Vec<MetricInfo> = known.iter().map(|m| m.info()).collect();
        if !names.is_empty() {
            infos.retain(|i| names.contains(&i.name.as_str()));
        }
        for name in names {
            if !infos.iter().any(|i| i.name == name) {
                infos.push(MetricInfo::new(name, name));
            }
        }
        infos
    }
}

fn field_of(name: &str) -> String {
    format!("test_{name}")
}

/// Sums an objective adds up beside the loss, the correct predictions and the targets (a
/// preference objective's: see [`preference_metrics`]); zero for the others.
pub const EXTRA_SUMS: usize = 4;

/// What every evaluation adds up over its batches and ranks, and every built-in metric is
/// computed from: the summed loss per target (nats), the targets predicted exactly, the
/// targets scored (for a preference objective: its loss, the pairs ranked right, the pairs),
/// and an objective's own sums ([`EXTRA_SUMS`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EvalSums {
    pub loss: f64,
    pub correct: f64,
    pub targets: f64,
    pub extra: [f64; EXTRA_SUMS],
}

impl EvalSums {
    /// Values an evaluation adds up per part (and all-reduces): [`EvalSums::slots`]'s length.
    pub const SLOTS: usize = 3 + EXTRA_SUMS;

    /// The sums as one flat array (an all-reduce's buffer), in field order.
    pub fn slots(&self) -> [f64; Self::SLOTS] {
        let mut out = [0.0; Self::SLOTS];
        out[..3].copy_from_slice(&[self.loss, self.correct, self.targets]);
        out[3..].copy_from_slice(&self.extra);
        out
    }

    /// The sums from [`EvalSums::slots`]' array.
    pub fn from_slots(slots: &[f64]) -> Self {
        let mut extra = [0.0; EXTRA_SUMS];
        extra.copy_from_slice(&slots[3..Self::SLOTS]);
        EvalSums {
            loss: slots[0],
            correct: slots[1],
            targets: slots[2],
            extra,
        }
    }

    /// Each sum plus `other`'s.
    pub fn add(&mut self, other: &EvalSums) {
        let (mut a, b) = (self.slots(), other.slots());
        a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        *self = EvalSums::from_slots(&a);
    }

    /// Mean cross-entropy per target.
    pub fn mean_loss(&self) -> f64 {
        self.loss / self.targets.max(1.0)
    }

    /// The fraction of targets predicted exactly.
    pub fn accuracy(&self) -> f64 {
        self.correct / self.targets.max(1.0)
    }
}

/// A number an evaluation reports, declared by its task ([`crate::Task::metrics`]).
pub trait Metric: Send + Sync {
    /// Its name, wording, unit and direction.
    fn info(&self) -> MetricInfo;
    /// Its value, from what the whole evaluation added up.
    fn value(&self, sums: &EvalSums) -> f64;
}

/// Mean cross-entropy per target: `test_loss` (a language model's "val loss").
pub struct MeanLoss {
    pub label: &'static str,
}

impl Metric for MeanLoss {
    fn info(&self) -> MetricInfo {
        MetricInfo::new("loss", self.label)
    }
    fn value(&self, sums: &EvalSums) -> f64 {
        sums.mean_loss()
    }
}

/// e^loss: `test_perplexity`.
pub struct Perplexity;

impl Metric for Perplexity {
    fn info(&self) -> MetricInfo {
        MetricInfo::new("perplexity", "perplexity").with_decimals(3)
    }
    fn value(&self, sums: &EvalSums) -> f64 {
        sums.mean_loss().exp()
    }
}

/// The fraction of targets predicted exactly: `test_accuracy` (a language model's next-token
/// accuracy).
pub struct Accuracy {
    pub label: &'static str,
}

impl Metric for Accuracy {
    fn info(&self) -> MetricInfo {
        MetricInfo::new("accuracy", self.label)
            .in_percent()
            .higher_better()
    }
    fn value(&self, sums: &EvalSums) -> f64 {
        sums.accuracy()
    }
}

/// A classifier's metrics: accuracy is the headline, then the loss.
pub fn classifier_metrics() -> Vec<Box<dyn Metric>> {
    vec![
        Box::new(Accuracy {
            label: "test accuracy",
        }),
        Box::new(MeanLoss { label: "test loss" }),
    ]
}

/// A language model's: its loss is the headline, then perplexity and next-token accuracy.
pub fn language_metrics() -> Vec<Box<dyn Metric>> {
    vec![
        Box::new(MeanLoss { label: "val loss" }),
        Box::new(Perplexity),
        Box::new(Accuracy {
            label: "next-token accuracy",
        }),
    ]
}

/// Which of [`EvalSums::extra`] a preference objective fills: Σ over pairs of the chosen
/// completion's reward β(logp_θ − logp_ref), the rejected one's, and the policy's summed
/// log-probabilities of each.
pub mod pair_sums {
    pub const REWARD_CHOSEN: usize = 0;
    pub const REWARD_REJECTED: usize = 1;
    pub const LOGPS_CHOSEN: usize = 2;
    pub const LOGPS_REJECTED: usize = 3;
}

/// A mean per pair of a preference evaluation (TRL's names: `rewards/margins`, ...).
struct PairMean {
    name: &'static str,
    label: &'static str,
    higher_better: bool,
    of: fn(&EvalSums) -> f64,
}

impl Metric for PairMean {
    fn info(&self) -> MetricInfo {
        let info = MetricInfo::new(self.name, self.label);
        match (self.higher_better, self.name == "rewards/accuracies") {
            (_, true) => info.in_percent().higher_better(),
            (true, false) => info.higher_better(),
            (false, false) => info,
        }
    }
    fn value(&self, sums: &EvalSums) -> f64 {
        (self.of)(sums) / sums.targets.max(1.0)
    }
}

/// A preference objective's (DPO's), named as TRL logs them: its loss is the headline (a mean
/// per pair), then the pairs ranked right (`rewards/accuracies`), the mean reward margin, each
/// completion's mean reward and the policy's mean summed log-probabilities of each.
pub fn preference_metrics() -> Vec<Box<dyn Metric>> {
    use pair_sums::*;
    let mean = |name, label, higher_better, of| -> Box<dyn Metric> {
        Box::new(PairMean {
            name,
            label,
            higher_better,
            of,
        })
    };
    vec![
        Box::new(MeanLoss { label: "val loss" }),
        mean("rewards/accuracies", "rewards/accuracies", true, |s| {
            s.correct
        }),
        mean("rewards/margins", "rewards/margins", true, |s| {
            s.extra[REWARD_CHOSEN] - s.extra[REWARD_REJECTED]
        }),
        mean("rewards/chosen", "rewards/chosen", true, |s| {
            s.extra[REWARD_CHOSEN]
        }),
        mean("rewards/rejected", "rewards/rejected", false, |s| {
            s.extra[REWARD_REJECTED]
        }),
        mean("logps/chosen", "logps/chosen", true, |s| {
            s.extra[LOGPS_CHOSEN]
        }),
        mean("logps/rejected", "logps/rejected", false, |s| {
            s.extra[LOGPS_REJECTED]
        }),
    ]
}

/// An evaluation's metrics by name, in the order its task declared them (the headline first).
/// In a record or `summary.json` each is a field `test_<name>`; a value that is not finite is
/// written as `null` and read back as NaN.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricValues(Vec<(String, f64)>);

impl MetricValues {
    /// `metrics`' values from `sums`.
    pub fn of(metrics: &[Box<dyn Metric>], sums: &EvalSums) -> Self {
        MetricValues(
            metrics
                .iter()
                .map(|m| (m.info().name, m.value(sums)))
                .collect(),
        )
    }

    /// Sets `name` (in place when there, last otherwise).
    pub fn set(&mut self, name: &str, value: f64) {
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some(entry) => entry.1 = value,
            None => self.0.push((name.into(), value)),
        }
    }

    /// The value of `name`, when recorded.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.0.iter().find(|(n, _)| n == name).map(|e| e.1)
    }

    /// The value of `name`, NaN when not recorded.
    pub fn value(&self, name: &str) -> f64 {
        self.get(name).unwrap_or(f64::NAN)
    }

    /// (name, value) in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, f64)> {
        self.0.iter().map(|(n, v)| (n.as_str(), *v))
    }

    /// The names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(n, _)| n.as_str())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The same with `names` first (those it has, in that order), the rest as they were.
    pub fn with_first(&self, names: &[&str]) -> Self {
        let first = names
            .iter()
            .filter_map(|n| self.get(n).map(|v| (n.to_string(), v)));
        let rest = self
            .0
            .iter()
            .filter(|(n, _)| !names.contains(&n.as_str()))
            .cloned();
        MetricValues(first.chain(rest).collect())
    }

    /// The same without `names` (the fields a type records by name of its own).
    pub fn without(&self, names: &[&str]) -> Self {
        MetricValues(
            self.0
                .iter()
                .filter(|(n, _)| !names.contains(&n.as_str()))
                .cloned()
                .collect(),
        )
    }

    /// `val loss 1.6527, perplexity 5.221, next-token accuracy 45.12%`: each declared metric
    /// that has a value, in the declared order; values of undeclared names after them.
    pub fn describe(&self, infos: &[MetricInfo]) -> String {
        let declared = infos
            .iter()
            .filter_map(|i| self.get(&i.name).map(|v| i.describe(v)));
        let others = self
            .iter()
            .filter(|(n, _)| !infos.iter().any(|i| i.name == *n))
            .map(|(n, v)| MetricInfo::new(n, n).describe(v));
        declared.chain(others).collect::<Vec<_>>().join(", ")
    }
}

impl Serialize for MetricValues {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, value) in &self.0 {
            map.serialize_entry(&field_of(name), &value.is_finite().then_some(*value))?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for MetricValues {
    /// Every `test_<name>` field holding a number or `null`; other fields are not metrics
    /// (a newer version's, when flattened into a record) and are left alone.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = MetricValues;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map of test_<metric> fields")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<MetricValues, A::Error> {
                let mut values = MetricValues::default();
                while let Some(key) = map.next_key::<String>()? {
                    let value: MaybeNumber = map.next_value()?;
                    if let (Some(name), MaybeNumber::Number(v)) = (key.strip_prefix("test_"), value)
                    {
                        values.set(name, v.unwrap_or(f64::NAN));
                    }
                }
                Ok(values)
            }
        }
        d.deserialize_map(Fields)
    }
}

/// A field's value: a number or `null` (read as NaN), or anything else, which is not a metric.
#[derive(Deserialize)]
#[serde(untagged)]
enum MaybeNumber {
    Number(Option<f64>),
    Other(serde::de::IgnoredAny),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_come_from_the_sums_in_the_declared_order() {
        // 4 targets, loss sum 4 ln 2 (mean ln 2: perplexity 2), 3 correct.
        let sums = EvalSums {
            loss: 4.0 * 2f64.ln(),
            correct: 3.0,
            targets: 4.0,
            ..EvalSums::default()
        };
        let lm = MetricValues::of(&language_metrics(), &sums);
        let names: Vec<&str> = lm.names().collect();
        assert_eq!(names, ["loss", "perplexity", "accuracy"]);
        assert!((lm.value("perplexity") - 2.0).abs() < 1e-12);
        assert_eq!(lm.value("accuracy"), 0.75);
        let infos: Vec<MetricInfo> = language_metrics().iter().map(|m| m.info()).collect();
        assert_eq!(
            lm.describe(&infos),
            "val loss 0.6931, perplexity 2.000, next-token accuracy 75.00%"
        );
        let classes = MetricValues::of(&classifier_metrics(), &sums);
        assert_eq!(classes.names().next(), Some("accuracy"));
    }

    #[test]
    fn preference_metrics_are_means_per_pair() {
        // 4 pairs, 3 ranked right; rewards Σ 2.0 chosen, -1.0 rejected; logps Σ -8, -12.
        let mut sums = EvalSums::from_slots(&[2.0, 3.0, 4.0, 2.0, -1.0, -8.0, -12.0]);
        let v = MetricValues::of(&preference_metrics(), &sums);
        let names: Vec<&str> = v.names().collect();
        assert_eq!(
            names,
            [
                "loss",
                "rewards/accuracies",
                "rewards/margins",
                "rewards/chosen",
                "rewards/rejected",
                "logps/chosen",
                "logps/rejected"
            ]
        );
        let got: Vec<f64> = v.iter().map(|(_, x)| x).collect();
        assert_eq!(got, [0.5, 0.75, 0.75, 0.5, -0.25, -2.0, -3.0]);
        sums.add(&EvalSums::from_slots(&[1.0; 7]));
        assert_eq!(sums.slots(), [3.0, 4.0, 5.0, 3.0, 0.0, -7.0, -11.0]);
    }

    #[test]
    fn values_read_back_as_test_fields_with_null_for_not_finite() {
        let mut v = MetricValues::default();
        v.set("loss", f64::INFINITY);
        v.set("rewards/margins", 0.25);
        let json = serde_json::to_string(&v).unwrap();
        assert_eq!(json, r#"{"test_loss":null,"test_rewards/margins":0.25}"#);
        let back: MetricValues = serde_json::from_str(&json).unwrap();
        assert!(back.value("loss").is_nan());
        assert_eq!(back.get("rewards/margins"), Some(0.25));
        // Fields that are not metrics, or not numbers, are left out.
        let other: MetricValues =
            serde_json::from_str(r#"{"test_note":"x","lr":1,"test_accuracy":1}"#).unwrap();
        assert_eq!(other.iter().collect::<Vec<_>>(), [("accuracy", 1.0)]);
    }

    #[test]
    fn older_jobs_metrics_are_inferred_from_their_names() {
        let lm = MetricInfo::inferred(["loss", "accuracy", "perplexity"]);
        assert_eq!(lm[0].label, "val loss");
        let classes = MetricInfo::inferred(["loss", "accuracy"]);
        assert_eq!(classes[0].name, "accuracy");
        assert!(classes[0].higher_is_better && classes[0].percent);
        let custom = MetricInfo::inferred(["loss", "bleu"]);
        assert_eq!(
            custom.iter().map(|i| i.name.as_str()).collect::<Vec<_>>(),
            ["loss", "bleu"]
        );
        assert!(custom[0].better(0.1, 0.2) && !custom[0].better(f64::NAN, 0.2));
        assert!(classes[0].better(0.9, f64::NAN));
    }
}
