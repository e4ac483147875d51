//! One `metrics.jsonl` line as a type: what rank 0's writer emits and what every reader
//! (`show`, `list`, the curves, resume's rewind, the TensorBoard replay) parses, so a field can
//! no longer be renamed on one side only.

use std::path::Path;

use ddpjob_seam::MetricValues;
use serde::{Deserialize, Deserializer, Serialize};

/// A training record's other loss terms by name, in the order the model names them
/// (`{"aux_loss": 0.0123}`); a value that is not finite is `null`, read back as NaN.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainTerms(pub Vec<(String, f64)>);

impl TrainTerms {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// (name, value) in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, f64)> {
        self.0.iter().map(|(n, v)| (n.as_str(), *v))
    }
}

impl Serialize for TrainTerms {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, value) in &self.0 {
            map.serialize_entry(name, &value.is_finite().then_some(*value))?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for TrainTerms {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let map: serde_json::Map<String, serde_json::Value> = Deserialize::deserialize(d)?;
        let values = map
            .into_iter()
            .map(|(name, v)| (name, v.as_f64().unwrap_or(f64::NAN)))
            .collect();
        Ok(TrainTerms(values))
    }
}

/// A line of `metrics.jsonl` (**contract**: `kind`, `epoch`, `step` and the named metrics; an
/// evaluation's are those its task declares, see the task seam's `Metric`).
/// Metrics that were not finite are written as `null` and read back as NaN, as are metrics a
/// line lacks (files of older versions).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Record {
    /// The mean training loss over a log interval (`train.log_every` steps), over all ranks.
    Train {
        epoch: usize,
        step: usize,
        #[serde(default = "nan", deserialize_with = "nan_if_null")]
        loss: f64,
        #[serde(default = "nan", deserialize_with = "nan_if_null")]
        lr: f64,
        #[serde(default = "nan", deserialize_with = "nan_if_null")]
        samples_per_s: f64,
        /// The global gradient norm before clipping at the interval's last step, with
        /// `train.grad_clip_norm` (as transformers' Trainer logs `grad_norm`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        grad_norm: Option<f64>,
        /// The interval's means of the model's other loss terms, by name (a mixture of
        /// experts' `aux_loss`); absent for a model without any.
        #[serde(default, skip_serializing_if = "TrainTerms::is_empty")]
        metrics: TrainTerms,
        #[serde(default)]
        time: u64,
    },
    /// The end of an epoch: its training loss and the evaluation after it.
    Epoch {
        epoch: usize,
        step: usize,
        #[serde(default = "nan", deserialize_with = "nan_if_null")]
        loss: f64,
        #[serde(default = "nan", deserialize_with = "nan_if_null")]
        lr: f64,
        #[serde(default = "nan", deserialize_with = "nan_if_null")]
        samples_per_s: f64,
        /// The evaluation's metrics, those its task declared: `test_loss` and
        /// `test_accuracy` first, then `test_perplexity`, … (see the seam's `MetricValues`).
        #[serde(flatten)]
        metrics: MetricValues,
        #[serde(default = "nan", deserialize_with = "nan_if_null")]
        train_s: f64,
        #[serde(default)]
        time: u64,
    },
    /// An evaluation every `train.eval_every` steps.
    Eval {
        epoch: usize,
        step: usize,
        /// The evaluation's metrics, those its task declared: `test_loss` and
        /// `test_accuracy` first, then `test_perplexity`, … (see the seam's `MetricValues`).
        #[serde(flatten)]
        metrics: MetricValues,
        #[serde(default)]
        time: u64,
    },
    /// A resumed start, from the checkpoint of (`epoch`, `step`).
    Resume {
        epoch: usize,
        step: usize,
        #[serde(default)]
        checkpoint: Option<String>,
        #[serde(default)]
        world_size: usize,
        #[serde(default)]
        previous_world_size: usize,
        #[serde(default)]
        restart: usize,
        #[serde(default)]
        time: u64,
    },
}

fn nan() -> f64 {
    f64::NAN
}

fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl Record {
    /// (epoch, step, time): what every record has.
    fn header(&self) -> (usize, usize, u64) {
        match self {
            Record::Train {
                epoch, step, time, ..
            }
            | Record::Epoch {
                epoch, step, time, ..
            }
            | Record::Eval {
                epoch, step, time, ..
            }
            | Record::Resume {
                epoch, step, time, ..
            } => (*epoch, *step, *time),
        }
    }

    /// The optimizer step the record was taken after.
    pub fn step(&self) -> usize {
        self.header().1
    }

    /// The (0-based) epoch it belongs to.
    pub fn epoch(&self) -> usize {
        self.header().0
    }

    /// When it was written (Unix seconds).
    pub fn time(&self) -> u64 {
        self.header().2
    }

    /// The record as one JSON line (no newline).
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// The record of a line; `None` for a line that is not one (a torn last line after a crash).
    pub fn parse(line: &str) -> Option<Record> {
        serde_json::from_str(line).ok()
    }
}

/// The records of `metrics.jsonl` text and how many lines were not records.
pub fn parse_all(text: &str) -> (Vec<Record>, usize) {
    let mut skipped = 0;
    let records = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter_map(|line| {
            let record = Record::parse(line);
            skipped += usize::from(record.is_none());
            record
        })
        .collect();
    (records, skipped)
}

/// The records of the file at `path`; a missing file has none.
pub fn read_all(path: &Path) -> std::io::Result<(Vec<Record>, usize)> {
    Ok(read_text(path)?.map_or_else(|| (Vec::new(), 0), |text| parse_all(&text)))
}

/// The text of a metrics file, `None` when there is none. Bytes that are not UTF-8 (a disk
/// fault, a stray write) become U+FFFD, so their line is skipped as unreadable rather than
/// hiding every other line.
pub fn read_text(path: &Path) -> std::io::Result<Option<String>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(String::from_utf8_lossy(&bytes).into_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip_and_null_metrics_read_as_nan() {
        let train = Record::Train {
            epoch: 0,
            step: 4,
            loss: 2.5,
            lr: 0.01,
            samples_per_s: 1000.0,
            grad_norm: None,
            metrics: TrainTerms::default(),
            time: 7,
        };
        let line = train.to_line();
        assert!(
            line.starts_with(r#"{"kind":"train","epoch":0,"step":4,"loss":2.5"#)
                && !line.contains("grad_norm"),
            "{line}"
        );
        assert_eq!(Record::parse(&line), Some(train.clone()));
        let clipped = Record::Train {
            epoch: 0,
            step: 4,
            loss: 2.5,
            lr: 0.01,
            samples_per_s: 1000.0,
            grad_norm: Some(1.5),
            metrics: TrainTerms(vec![("aux_loss".into(), 1.25), ("z".into(), f64::NAN)]),
            time: 7,
        };
        let clipped_line = clipped.to_line();
        assert!(
            clipped_line.contains(r#""grad_norm":1.5"#)
                && clipped_line.contains(r#""metrics":{"aux_loss":1.25,"z":null}"#),
            "{clipped_line}"
        );
        let Some(Record::Train { metrics, .. }) = Record::parse(&clipped_line) else {
            panic!("not a train record")
        };
        assert_eq!(metrics.0[0], ("aux_loss".into(), 1.25));
        assert!(metrics.0[1].1.is_nan());

        let eval =
            r#"{"kind":"eval","epoch":1,"step":9,"test_loss":null,"test_accuracy":0.5,"time":3}"#;
        let Some(Record::Eval { metrics, .. }) = Record::parse(eval) else {
            panic!("not an eval record")
        };
        assert!(metrics.value("loss").is_nan());
        assert_eq!(metrics.get("accuracy"), Some(0.5));
        let (records, skipped) = parse_all(&format!("{line}\n{eval}\n{{\"kind\":\"tra"));
        assert_eq!((records.len(), skipped), (2, 1));
        assert_eq!(records[1].step(), 9);
    }

    #[test]
    fn an_evaluation_carries_the_metrics_its_task_declared() {
        // Whatever a task declares is a `test_<name>` field beside the record's own, and reads
        // back in its order; a record of an older version's three fields reads the same way.
        let mut metrics = MetricValues::default();
        metrics.set("loss", 0.5);
        metrics.set("rewards/accuracies", 0.75);
        let epoch = Record::Epoch {
            epoch: 0,
            step: 4,
            loss: 0.6,
            lr: 0.1,
            samples_per_s: 10.0,
            metrics,
            train_s: 1.0,
            time: 2,
        };
        let line = epoch.to_line();
        assert!(
            line.contains(r#""test_loss":0.5,"test_rewards/accuracies":0.75"#),
            "{line}"
        );
        assert_eq!(Record::parse(&line), Some(epoch));
        let old = r#"{"kind":"epoch","epoch":0,"step":8,"loss":1.5,"lr":0.01,"samples_per_s":3,"test_loss":1.2,"test_accuracy":0.6,"test_perplexity":3.32,"train_s":1,"time":1}"#;
        let Some(Record::Epoch {
            metrics, train_s, ..
        }) = Record::parse(old)
        else {
            panic!("not an epoch record")
        };
        let names: Vec<&str> = metrics.names().collect();
        assert_eq!(
            (names, train_s),
            (vec!["loss", "accuracy", "perplexity"], 1.0)
        );
    }
}
