//! `distributed.sharding = "full"` (ZeRO-3 / FSDP FULL_SHARD): the parameters are sharded
//! too. Each rank keeps only its pieces of them (the optimizer's, see
//! [`Optimizer::hold_parameters`]); a parameter's storage is let go of and given back in
//! place (`kernels::storage`). A training pass asks for each block's parameters before the
//! block's forward and again before its backward, and lets them go after each
//! (`ddpjob_seam::gate`); the rest (embeddings, final norm, head) is gathered for the whole pass.
//! Gradients are reduce-scattered bucket by bucket as the backward forms them (as with
//! `"gradients"`), and the update touches only this rank's pieces: nothing is all-gathered
//! after it. Evaluation goes block by block alike (every rank asking as often, see
//! `eval`); checkpoints and the final weights are gathered bucket by bucket and streamed to
//! disk by rank 0 ([`Sharded::write_weights`]), so no rank holds every weight at once.
//!
//! Gathering uses the buckets of the gradients' reduce-scatter (a rank owns the same segment
//! of each): a block's parameters come with the whole buckets that hold them, and a bucket
//! shared by two blocks is gathered for each. Every rank asks for the same units in the same
//! order, so the all-gathers match across ranks. The values a rank gathers are the ones every
//! rank updated with the same element-wise formula from the same averaged gradients: the
//! weights are those of `"gradients"` bit for bit, where the model's pass is the same.

use std::path::Path;

use candle_core::{Tensor, Var};

use super::step::{StepContext, StepError};
use crate::checkpoint::StreamedSafetensors;
use crate::models::gate::{BlockGate, Unit};
use crate::models::{Model, Params};
use crate::optim::{GatherError, Optimizer};
use ddpjob_comm::buckets::ShardPlan;
use ddpjob_comm::{Communicator, StopVote};
use ddpjob_kernels::storage;

/// The model's blocks as trainable positions (the plan's numbering), and the rest.
#[derive(Debug, Clone)]
pub struct Units {
    blocks: Vec<Vec<usize>>,
    rest: Vec<usize>,
}

impl Units {
    /// The units of `model`, which from now on asks for them (see
    /// [`Model::shard_parameters`]); `Err`: why it cannot.
    pub fn of(model: &dyn Model) -> Result<Units, String> {
        let blocks = model.shard_parameters()?;
        let params = model.params();
        let mut trainable = vec![None; params.len()];
        for (t, (i, _)) in params.trainable().enumerate() {
            trainable[i] = Some(t);
        }
        let mut claimed = vec![false; params.len()];
        let mut units = Vec::with_capacity(blocks.len());
        for block in blocks {
            let mut unit = Vec::new();
            for i in block {
                match claimed.get_mut(i) {
                    Some(c) if !*c => *c = true,
                    Some(_) => return Err(format!("parameter {i} is in two blocks")),
                    None => {
                        let n = params.len();
                        return Err(format!("block parameter {i} is not one of its {n}"));
                    }
                }
                unit.extend(trainable[i]);
            }
            units.push(unit);
        }
        let rest = (0..params.len())
            .filter(|&i| !claimed[i])
            .filter_map(|i| trainable[i])
            .collect();
        Ok(Units {
            blocks: units,
            rest,
        })
    }

    fn of_unit(&self, unit: Unit) -> Option<&[usize]> {
        match unit {
            Unit::Block(i) => self.blocks.get(i).map(Vec::as_slice),
            Unit::Rest => Some(&self.rest),
        }
    }

    /// Trainable values in the largest block: what a pass gathers beside the rest.
    pub fn largest_block(&self, params: &Params) -> usize {
        let sizes: Vec<usize> = params.trainable().map(|(_, v)| v.elem_count()).collect();
        let size = |unit: &Vec<usize>| unit.iter().map(|&t| sizes[t]).sum::<usize>();
        self.blocks.iter().map(size).max().unwrap_or(0)
    }
}

/// The trainable parameters of one rank, sharded: which are present, and how to gather or
/// release them. Answers a training pass's [`BlockGate`] calls.
pub(super) struct Sharded<'a> {
    comm: &'a dyn Communicator,
    plan: &'a ShardPlan,
    /// This rank's pieces of the parameters, by position in the plan.
    held: &'a [Tensor],
    units: &'a Units,
    vars: Vec<&'a Var>,
    present: Vec<bool>,
    /// A collective that failed inside a pass, kept whole for the step to return (the pass
    /// itself sees only its message).
    pub(super) error: Option<StepError>,
}

impl<'a> Sharded<'a> {
    /// `params`' trainable parameters, every one released (`present`: false) or all still
    /// holding their values (true).
    pub(super) fn new(
        comm: &'a dyn Communicator,
        optimizer: &'a Optimizer,
        params: &'a Params,
        units: &'a Units,
        present: bool,
    ) -> Result<Self, StepError> {
        let (Some(plan), Some(held)) = (optimizer.plan(), optimizer.held_parameters()) else {
            return Err(candle_core::Error::Msg(
                "sharding = \"full\" without this rank's pieces of the parameters".into(),
            )
            .into());
        };
        let vars: Vec<&Var> = params.trainable().map(|(_, v)| v).collect();
        Ok(Sharded {
            comm,
            plan,
            held,
            units,
            present: vec![present; vars.len()],
            vars,
            error: None,
        })
    }

    /// Gives every trainable parameter its values (`verify`'s weight trace).
    pub(super) fn gather_all(&mut self) -> Result<(), StepError> {
        let all: Vec<usize> = (0..self.vars.len()).collect();
        self.gather(&all)
    }

    /// Lets every trainable parameter's values go (all are in this rank's pieces).
    pub(super) fn release_all(&mut self) -> Result<(), StepError> {
        let all: Vec<usize> = (0..self.vars.len()).collect();
        self.release(&all)
    }

    /// Gathers the buckets holding any of `tensors` that is released, and gives those their
    /// values.
    fn gather(&mut self, tensors: &[usize]) -> Result<(), StepError> {
        let mut wanted = vec![false; self.vars.len()];
        for &t in tensors.iter().filter(|&&t| !self.present[t]) {
            wanted[t] = true;
        }
        for (b, bucket) in self.plan.buckets.iter().enumerate() {
            if !bucket.tensors.clone().any(|t| wanted[t]) {
                continue;
            }
            let mut flat = self.bucket(b)?;
            self.comm.all_gather(&mut flat)?;
            let mut offset = 0;
            for t in bucket.tensors.clone() {
                let n = self.vars[t].elem_count();
                if wanted[t] {
                    storage::restore(self.vars[t], flat.narrow(0, offset, n)?)?;
                    self.present[t] = true;
                }
                offset += n;
            }
        }
        Ok(())
    }

    fn release(&mut self, tensors: &[usize]) -> Result<(), StepError> {
        for &t in tensors {
            if std::mem::take(&mut self.present[t]) {
                storage::release(self.vars[t])?;
            }
        }
        Ok(())
    }

    /// Bucket `b` for the all-gather: this rank's pieces where they go, zeros elsewhere (the
    /// other ranks' segments, which the all-gather fills, and the stop vote's place).
    fn bucket(&self, b: usize) -> candle_core::Result<Tensor> {
        let len = self.plan.buckets[b].len;
        let device = self.vars[0].device();
        let mut parts = Vec::new();
        let mut at = 0;
        for (k, piece) in self.plan.pieces.iter().enumerate() {
            if piece.bucket != b {
                continue;
            }
            if piece.at > at {
                parts.push(Tensor::zeros(
                    piece.at - at,
                    candle_core::DType::F32,
                    device,
                )?);
            }
            parts.push(self.held[k].clone());
            at = piece.at + piece.within.len();
        }
        if len > at {
            parts.push(Tensor::zeros(len - at, candle_core::DType::F32, device)?);
        }
        Tensor::cat(&parts, 0)
    }

    /// Streams every weight of `params` into the safetensors file at `path` (rank 0's; the
    /// others pass `None`) as `model.safetensors` holds them (aliases included; frozen
    /// parameters only when `frozen_too`): the trainable ones all-gathered bucket by bucket,
    /// each bucket appended as it arrives, so no rank ever holds every weight. Every rank
    /// runs every collective; a failed write is reported once they are done. Every tensor is
    /// written as f32 (what parameters are; a buffer or frozen tensor of another dtype is
    /// converted).
    pub(super) fn write_weights(
        &self,
        params: &Params,
        frozen_too: bool,
        path: Option<&Path>,
    ) -> Result<(), GatherError> {
        let vars: Vec<&Var> = params.vars().collect();
        // Each parameter's name, then its aliases: each written with its values.
        let mut named: Vec<Vec<&str>> = params.iter().map(|(name, _)| vec![name]).collect();
        for (alias, of) in params.aliases() {
            if let Some(names) = named.iter_mut().find(|names| names[0] == of) {
                names.push(alias);
            }
        }
        let trainable: Vec<usize> = params.trainable().map(|(i, _)| i).collect();
        let frozen: Vec<usize> = (0..vars.len())
            .filter(|i| frozen_too && !trainable.contains(i))
            .collect();
        let mut layout: Vec<(String, Vec<usize>)> = Vec::new();
        let in_buckets = self.plan.buckets.iter().flat_map(|b| b.tensors.clone());
        for i in in_buckets
            .map(|t| trainable[t])
            .chain(frozen.iter().copied())
        {
            layout.extend(
                named[i]
                    .iter()
                    .map(|n| (n.to_string(), vars[i].dims().to_vec())),
            );
        }
        for (name, buffer) in params.buffers() {
            layout.push((name.to_string(), buffer.dims().to_vec()));
        }
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |cause| GatherError::Io { path, cause }
        };
        // A failure to write is kept until every collective has run (the others wait in them).
        let mut failed = None;
        let mut writer = match path.map(|p| StreamedSafetensors::create(p, &layout)) {
            Some(Ok(writer)) => Some(writer),
            Some(Err(e)) => {
                failed = Some(e);
                None
            }
            None => None,
        };
        for (b, bucket) in self.plan.buckets.iter().enumerate() {
            let mut flat = self.bucket(b)?;
            self.comm.all_gather(&mut flat)?;
            let Some(w) = writer.as_mut().filter(|_| failed.is_none()) else {
                continue;
            };
            let values = match flat.to_vec1::<f32>() {
                Ok(values) => values,
                Err(e) => {
                    failed = Some(std::io::Error::other(e.to_string()));
                    continue;
                }
            };
            let mut offset = 0;
            for t in bucket.tensors.clone() {
                let n = self.vars[t].elem_count();
                for _ in &named[trainable[t]] {
                    if let Err(e) = w.append(&values[offset..offset + n]) {
                        failed.get_or_insert(e);
                    }
                }
                offset += n;
            }
        }
        let Some(path) = path else {
            return Ok(());
        };
        let Some(mut w) = writer.filter(|_| failed.is_none()) else {
            return Err(io(path)(
                failed.unwrap_or_else(|| std::io::Error::other("not written")),
            ));
        };
        let values_of = |t: &Tensor| {
            t.flatten_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1()
        };
        let whole = frozen.iter().flat_map(|&i| vec![vars[i]; named[i].len()]);
        for var in whole.chain(params.buffers().map(|(_, b)| b)) {
            let values: Vec<f32> = values_of(var)?;
            if failed.is_none() {
                failed = w.append(&values).err();
            }
        }
        match failed {
            Some(cause) => Err(io(path)(cause)),
            None => w.finish().map_err(io(path)),
        }
    }

    /// Whether every parameter of `unit` has its values.
    pub(super) fn holds(&self, unit: Unit) -> bool {
        let tensors = self.units.of_unit(unit).unwrap_or_default();
        tensors.iter().all(|&t| self.present[t])
    }

    /// The model's number of blocks.
    pub(super) fn blocks(&self) -> usize {
        self.units.blocks.len()
    }

    /// Gathers (or releases) `unit`'s parameters; a collective's failure is kept whole in
    /// `error`, the pass given its message.
    pub(super) fn answer(&mut self, unit: Unit, release: bool) -> candle_core::Result<()> {
        let units = self.units;
        let Some(tensors) = units.of_unit(unit) else {
            candle_core::bail!(
                "sharding = \"full\": the model asked for {unit:?}, which it does not have"
            );
        };
        let result = match release {
            false => self.gather(tensors),
            true => self.release(tensors),
        };
        result.map_err(|e| {
            let said = e.to_string();
            self.error.get_or_insert(e);
            candle_core::Error::Msg(said)
        })
    }
}

impl BlockGate for Sharded<'_> {
    fn gather(&mut self, unit: Unit) -> candle_core::Result<()> {
        self.answer(unit, false)
    }

    fn release(&mut self, unit: Unit) -> candle_core::Result<()> {
        self.answer(unit, true)
    }
}

/// Updates this rank's pieces (the parameters stay released) and shares the stop vote: the
/// mean of every rank's, in a one-value all-reduce (no all-gather follows to carry it).
pub(super) fn update(
    cx: &StepContext,
    optimizer: &mut Optimizer,
    pieces: &[Tensor],
    lr: f64,
    stop: bool,
) -> Result<StopVote, StepError> {
    optimizer.step_pieces(cx.model.params(), pieces, lr)?;
    let mut vote = Tensor::new(&[u8::from(stop) as f32], cx.device)?;
    cx.comm.all_reduce_mean(&mut vote)?;
    Ok(StopVote::Reduced(vote))
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Result, Tensor, Var};

    use super::Units;
    use crate::models::{Mode, Model, Params};

    /// Parameters a, b, c, d (d frozen), in blocks as given.
    struct Blocky {
        params: Params,
        blocks: Vec<Vec<usize>>,
    }

    impl Model for Blocky {
        fn forward(&self, _: &Tensor, _: &Mode) -> Result<Tensor> {
            candle_core::bail!("not run")
        }
        fn params(&self) -> &Params {
            &self.params
        }
        fn shard_parameters(&self) -> std::result::Result<Vec<Vec<usize>>, String> {
            Ok(self.blocks.clone())
        }
    }

    fn blocky(blocks: Vec<Vec<usize>>) -> Blocky {
        let var = |n: usize| Var::zeros(n, candle_core::DType::F32, &Device::Cpu).unwrap();
        let names = ["a", "b", "c", "d"];
        let entries = names.iter().zip(1..).map(|(n, k)| (n.to_string(), var(k)));
        let params = Params::from_vars(entries.collect());
        params.freeze(&["d".to_string()]).unwrap();
        Blocky { params, blocks }
    }

    #[test]
    fn units_are_the_blocks_trainable_parameters_and_the_rest() {
        let model = blocky(vec![vec![1], vec![2, 3]]);
        let units = Units::of(&model).unwrap();
        // Trainable positions: a 0, b 1, c 2 (d is frozen, in no unit).
        assert_eq!(units.blocks, [vec![1], vec![2]]);
        assert_eq!(units.rest, [0]);
        assert_eq!(units.largest_block(&model.params), 3);
        let twice = Units::of(&blocky(vec![vec![1], vec![1]])).unwrap_err();
        assert!(twice.contains("parameter 1 is in two blocks"), "{twice}");
        let outside = Units::of(&blocky(vec![vec![7]])).unwrap_err();
        assert!(outside.contains("not one of its 4"), "{outside}");
    }
}
