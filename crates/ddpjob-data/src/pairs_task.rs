//! Preference pairs ready to batch (`train.objective = "dpo"`): a sample is a pair, its two
//! examples (examples 2i and 2i + 1 of the stored split: the prompt and the chosen
//! completion, the prompt and the rejected one) batched as TRL's collator batches them, each
//! a row padded on the right to the longest row of the batch, targets ignored outside the
//! completions ([`ddpjob_seam::task::IGNORE_TARGET`]). Inputs and targets are
//! `[pairs, 2, t]`: a pair never parts, so a batch cut into row shards or among ranks keeps
//! each pair whole, and the DPO objective (see `ddpjob-objective`) reads chosen at `[:, 0]`
//! and rejected at `[:, 1]`.

use std::ops::Range;

use candle_core::{Device, Tensor};

use super::DataError;
use super::examples_task::JsonlTask;
use super::jsonl_index::Examples;
use ddpjob_seam::task::{
    BatchSource, Example, ExampleCounts, Metric, ModelInput, Task, preference_metrics,
};

/// Pairs of both splits.
pub struct PairsTask {
    examples: JsonlTask,
}

impl PairsTask {
    /// The pairs of `examples` (read with `DataContext::pairs`: two examples a pair).
    pub(crate) fn new(examples: JsonlTask) -> Self {
        PairsTask { examples }
    }

    /// `[pairs, 2, t]` inputs and targets of pairs `indices` of `examples`.
    fn batch(
        &self,
        examples: &Examples,
        indices: &[usize],
        device: &Device,
    ) -> Result<(Tensor, Tensor), DataError> {
        let rows: Vec<Range<usize>> = (indices.iter())
            .flat_map(|&p| [2 * p..2 * p + 1, 2 * p + 1..2 * p + 2])
            .collect();
        let (xs, ys) = self.examples.batch(examples, &rows, device)?;
        let t = xs.dim(1)?;
        let n = indices.len();
        Ok((xs.reshape((n, 2, t))?, ys.reshape((n, 2, t))?))
    }
}

impl Task for PairsTask {
    fn train_len(&self) -> usize {
        self.examples.train.len() / 2
    }

    fn eval_len(&self) -> usize {
        self.examples.val.len() / 2
    }

    /// Both completions' positions of the mean pair (its two rows but the padding).
    fn targets_per_sample(&self) -> usize {
        let train = &self.examples.train;
        let positions = train.tokens().len() - train.len();
        (positions / self.train_len().max(1)).max(1)
    }

    fn input(&self) -> ModelInput {
        self.examples.input()
    }

    fn examples(&self, n: usize) -> Vec<Example> {
        let all = self.examples.train.len();
        (0..(2 * n).min(all))
            .map(|i| self.examples.example(i))
            .collect()
    }

    fn example_counts(&self) -> Option<ExampleCounts> {
        let counts = self.examples.example_counts()?;
        Some(ExampleCounts {
            pairs: true,
            ..counts
        })
    }

    fn metrics(&self) -> Vec<Box<dyn Metric>> {
        preference_metrics()
    }

    fn batches<'a>(&'a self, device: &Device) -> Result<Box<dyn BatchSource + 'a>, DataError> {
        Ok(Box::new(PairBatches {
            task: self,
            device: device.clone(),
        }))
    }
}

struct PairBatches<'a> {
    task: &'a PairsTask,
    device: Device,
}

impl BatchSource for PairBatches<'_> {
    fn train(&self, _epoch: usize, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        let t = self.task;
        t.batch(&t.examples.train, indices, &self.device)
    }

    fn eval(&self, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        let t = self.task;
        t.batch(&t.examples.val, indices, &self.device)
    }

    fn note(&self) -> Option<String> {
        let e = &self.task.examples;
        let c = e.train.counts;
        let mut parts = vec![format!(
            "{} preference pairs: {} training and {} validation, the loss on the completions",
            e.format.name(),
            e.train.len() / 2,
            e.val.len() / 2,
        )];
        for (n, what) in [
            (c.truncated, "truncated to model.block_size + 1 tokens"),
            (c.bad_lines, "bad lines skipped"),
            (
                c.empty,
                "pairs with nothing to learn left out (a completion empty after truncation, or \
                 chosen the same as rejected)",
            ),
        ] {
            if n > 0 {
                parts.push(format!("{n} {what}"));
            }
        }
        Some(parts.join(", "))
    }
}

#[cfg(test)]
#[path = "pairs_tests.rs"]
mod tests;
