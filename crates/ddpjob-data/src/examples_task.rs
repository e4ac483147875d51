//! Instruction examples ready to batch, whatever file they came from (`jsonl`, `parquet`): a
//! sample is one example, or with packing several in a row; a batch pads its rows on the
//! right to the longest of them (causal attention never looks right, so the padding changes
//! no real position) and its targets are [`IGNORE_TARGET`] where they do not score: padding,
//! and tokens outside the trained spans unless `train_on_prompt`. The loss is then the mean
//! over the scored targets of the whole global batch (see `train::step`), so 2 × B/2 is 1 × B.

use std::ops::Range;

use candle_core::{Device, Tensor};

use super::DataError;
use super::jsonl::Format;
use super::jsonl_index::Examples;
use ddpjob_seam::task::{BatchSource, Example, ExampleCounts, IGNORE_TARGET, ModelInput, Task};

/// `examples` packed in order into rows of at most `block` positions (an example of L tokens
/// takes L - 1): the next example starts a new row when it does not fit the current one's rest.
pub(crate) fn pack(examples: &Examples, block: usize) -> Vec<Range<usize>> {
    let mut packs = Vec::new();
    let (mut start, mut used) = (0, 0);
    for i in 0..examples.len() {
        let positions = examples.get(i).0.len() - 1;
        if used + positions > block && i > start {
            packs.push(start..i);
            (start, used) = (i, 0);
        }
        used += positions;
    }
    if start < examples.len() {
        packs.push(start..examples.len());
    }
    packs
}

/// Instruction examples of both splits, ready to batch.
pub struct JsonlTask {
    pub(crate) train: Examples,
    pub(crate) val: Examples,
    /// With `data.pack`: the examples of each training and validation row.
    pub(crate) packs: Option<[Vec<Range<usize>>; 2]>,
    /// Appended to every text and prompt/completion example; also the padding's input (its
    /// target is ignored).
    pub(crate) eos: u32,
    pub(crate) block: usize,
    pub(crate) vocab_size: usize,
    pub(crate) train_on_prompt: bool,
    /// What the examples were read from, for the log.
    pub(crate) format: Format,
}

impl JsonlTask {
    /// The examples of each row of `indices` (samples of `split`, 0 training, 1 validation):
    /// one each, or a packed row's.
    fn rows(&self, split: usize, indices: &[usize]) -> Vec<Range<usize>> {
        match &self.packs {
            Some(packs) => indices.iter().map(|&i| packs[split][i].clone()).collect(),
            None => indices.iter().map(|&i| i..i + 1).collect(),
        }
    }

    /// Inputs and targets [n, t] of rows of `examples`, t the longest row's positions: each
    /// example's tokens but its last as inputs, all but its first as targets (ignored on its
    /// prompt unless `train_on_prompt`), the row padded on the right with `eos`, whose targets
    /// are ignored. Packed rows' inputs are [n, t, 2]: each token and its position within its
    /// example (the padding counted as one more), see `models::packed`.
    pub(crate) fn batch(
        &self,
        examples: &Examples,
        rows: &[Range<usize>],
        device: &Device,
    ) -> Result<(Tensor, Tensor), DataError> {
        let positions =
            |r: &Range<usize>| -> usize { r.clone().map(|i| examples.get(i).0.len() - 1).sum() };
        let longest = rows.iter().map(positions).max().unwrap_or(1);
        let n = rows.len();
        let mut xs = vec![self.eos; n * longest];
        let mut at = vec![0u32; n * longest];
        let mut ys = vec![IGNORE_TARGET; n * longest];
        let count_from_zero = |a: &mut [u32]| {
            a.iter_mut().enumerate().for_each(|(p, a)| *a = p as u32);
        };
        for (row, examples_of_row) in rows.iter().enumerate() {
            let mut start = row * longest;
            for i in examples_of_row.clone() {
                let (tokens, spans) = examples.get(i);
                let len = tokens.len() - 1;
                xs[start..start + len].copy_from_slice(&tokens[..len]);
                count_from_zero(&mut at[start..start + len]);
                // Target j is token j + 1: scored when that token is trained.
                let targets = &mut ys[start..start + len];
                match self.train_on_prompt {
                    true => targets.copy_from_slice(&tokens[1..]),
                    false => {
                        for &[from, to] in spans {
                            let from = (from as usize).max(1);
                            let to = to as usize;
                            if from < to {
                                targets[from - 1..to - 1].copy_from_slice(&tokens[from..to]);
                            }
                        }
                    }
                }
                start += len;
            }
            count_from_zero(&mut at[start..(row + 1) * longest]);
        }
        let ys = Tensor::from_vec(ys, (n, longest), device)?;
        if self.packs.is_none() {
            return Ok((Tensor::from_vec(xs, (n, longest), device)?, ys));
        }
        let pairs: Vec<u32> = xs.iter().zip(&at).flat_map(|(&x, &p)| [x, p]).collect();
        Ok((Tensor::from_vec(pairs, (n, longest, 2), device)?, ys))
    }

    /// Training example `i` and the tokens its loss is on.
    pub(crate) fn example(&self, i: usize) -> Example {
        let (tokens, spans) = self.train.get(i);
        let mut trained = vec![self.train_on_prompt; tokens.len()];
        if !self.train_on_prompt {
            for &[from, to] in spans {
                trained[from as usize..to as usize].fill(true);
            }
        }
        // The first token is no target.
        trained[0] = false;
        Example {
            ids: tokens.to_vec(),
            trained,
        }
    }

    /// Training (0) or validation (1) samples: examples, or packed rows.
    fn samples(&self, split: usize) -> usize {
        match &self.packs {
            Some(packs) => packs[split].len(),
            None if split == 0 => self.train.len(),
            None => self.val.len(),
        }
    }
}

impl Task for JsonlTask {
    fn train_len(&self) -> usize {
        self.samples(0)
    }

    fn eval_len(&self) -> usize {
        self.samples(1)
    }

    /// The mean sample's positions (an example's tokens but one, or a packed row's), padding
    /// not counted.
    fn targets_per_sample(&self) -> usize {
        let positions = self.train.tokens().len() - self.train.len();
        (positions / self.train_len().max(1)).max(1)
    }

    fn input(&self) -> ModelInput {
        ModelInput::Tokens {
            vocab_size: self.vocab_size,
            block_size: self.block,
        }
    }

    fn masks_targets(&self) -> bool {
        true
    }

    fn examples(&self, n: usize) -> Vec<Example> {
        (0..n.min(self.train.len()))
            .map(|i| self.example(i))
            .collect()
    }

    fn example_counts(&self) -> Option<ExampleCounts> {
        let c = self.train.counts;
        let mut counts = ExampleCounts {
            examples: self.train.len(),
            tokens: self.train.tokens().len(),
            truncated: c.truncated,
            left_out: c.empty,
            bad_records: c.bad_lines,
            ..ExampleCounts::default()
        };
        counts.trained = match self.train_on_prompt {
            true => counts.tokens - counts.examples,
            false => (0..self.train.len())
                .flat_map(|i| self.train.get(i).1.iter())
                .map(|&[from, to]| (to as usize).saturating_sub((from as usize).max(1)))
                .sum(),
        };
        Some(counts)
    }

    fn batches<'a>(&'a self, device: &Device) -> Result<Box<dyn BatchSource + 'a>, DataError> {
        Ok(Box::new(JsonlBatches {
            task: self,
            device: device.clone(),
        }))
    }
}

struct JsonlBatches<'a> {
    task: &'a JsonlTask,
    device: Device,
}

impl BatchSource for JsonlBatches<'_> {
    fn train(&self, _epoch: usize, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        let t = self.task;
        t.batch(&t.train, &t.rows(0, indices), &self.device)
    }

    fn eval(&self, indices: &[usize]) -> Result<(Tensor, Tensor), DataError> {
        let t = self.task;
        t.batch(&t.val, &t.rows(1, indices), &self.device)
    }

    fn note(&self) -> Option<String> {
        let t = self.task;
        let c = t.train.counts;
        let mut parts = vec![format!(
            "{}: {} training and {} validation examples, loss on {}",
            t.format.name(),
            t.train.len(),
            t.val.len(),
            match (t.train_on_prompt, t.train.has_prompts()) {
                (true, _) => "prompts and completions",
                // {"text": ...} examples only: nothing is a prompt.
                (false, false) => "every token (text examples)",
                (false, true) => "completions only (a conversation's: the assistant's turns)",
            }
        )];
        if let Some(packs) = &t.packs {
            parts.push(format!(
                "packed into {} training and {} validation rows",
                packs[0].len(),
                packs[1].len()
            ));
        }
        for (n, what) in [
            (c.truncated, "truncated to model.block_size + 1 tokens"),
            (c.bad_lines, "bad lines skipped"),
            (
                c.empty,
                "examples with nothing to predict left out (empty, or a prompt that fills \
                 model.block_size)",
            ),
        ] {
            if n > 0 {
                parts.push(format!("{n} {what}"));
            }
        }
        Some(parts.join(", "))
    }
}
