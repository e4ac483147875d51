//! Where a run starts: from scratch, or from a checkpoint. On the checkpoint's world size the
//! run repeats exactly what the uninterrupted one would have done; on another, it continues
//! from the epoch's global sample position and says what changed.

use crate::checkpoint::{MetricState, Restored, TrainPosition};
use crate::config::TrainPlan;
use crate::models::Params;
use crate::optim::Optimizer;

use super::TrainError;

/// The training loop's starting point.
#[derive(Debug, Clone, Default)]
pub struct Start {
    pub epoch: usize,
    /// Optimizer steps already done.
    pub step: usize,
    /// Same world size: steps of `epoch` to skip. Otherwise 0, and `reshard` is set.
    pub skip_in_epoch: usize,
    /// Samples of `epoch` consumed by all ranks before the start.
    pub consumed: usize,
    pub reshard: bool,
    pub metrics: MetricState,
    /// Optimizer steps of the whole run, as this world size will take them.
    pub total_steps: usize,
}

impl Start {
    /// Where to start on `world` ranks, given the checkpoint position (if resuming) and the
    /// total steps an uninterrupted run on `world` ranks takes.
    pub fn new(
        plan: TrainPlan<'_>,
        train_len: usize,
        world: usize,
        planned_total: usize,
        at: Option<&TrainPosition>,
    ) -> Start {
        let Some(p) = at else {
            return Start {
                total_steps: planned_total,
                ..Start::default()
            };
        };
        let reshard = p.world_size != world;
        let total_steps = if reshard {
            let rest_of_epoch =
                plan.steps_for(train_len.saturating_sub(p.consumed_in_epoch), world);
            let later_epochs = plan.train.epochs.saturating_sub(p.epoch + 1);
            let uncapped = p.step + rest_of_epoch + later_epochs * plan.steps_for(train_len, world);
            plan.train.max_steps.map_or(uncapped, |m| m.min(uncapped))
        } else {
            planned_total
        };
        Start {
            epoch: p.epoch,
            step: p.step,
            skip_in_epoch: if reshard { 0 } else { p.step_in_epoch },
            consumed: p.consumed_in_epoch,
            reshard,
            metrics: p.metrics.clone(),
            total_steps,
        }
    }

    /// What a user should know about a resumed run, for the log.
    pub fn describe(&self, plan: TrainPlan<'_>, from: &TrainPosition, world: usize) -> String {
        let mut text = format!(
            "resuming at epoch {}, step {} ({} samples of the epoch done)",
            self.epoch + 1,
            self.step,
            self.consumed
        );
        // An edited tree is said last, with its reason, for any world size.
        let changed = changed_tree(plan, from);
        if self.reshard {
            let t = &plan.train;
            let batch = |w: usize| match t.global_batch_size {
                Some(global) => global,
                None => t.batch_size * t.accumulation * w,
            };
            let (before, now) = (batch(from.world_size), batch(world));
            let batch = match before == now {
                true => format!("global batch {now} kept"),
                false => format!("global batch {before} -> {now}"),
            };
            // World-size-invariant training computes the same weights on any world size that
            // divides its virtual shards (`verify` checks it), when the checkpoint was trained
            // on the same ones; the rest cannot promise that.
            let outcome = match (plan.distributed.world_size_invariant, from.virtual_shards) {
                (true, Some(v)) if v == plan.distributed.virtual_shards => {
                    "the weights stay bit-identical to an uninterrupted run \
                     (distributed.deterministic = \"world-size-invariant\")"
                }
                (true, None) => {
                    "the weights stay bit-identical to an uninterrupted run if the checkpoint \
                     was trained in this mode with the same distributed.virtual_shards (it \
                     does not record them)"
                }
                _ => "the result will not be bit-identical to an uninterrupted run",
            };
            text += &format!(
                "; world size changed from {} to {world}: {batch}, the rest of the epoch is \
                 re-sharded over {world} ranks, {} steps in all (was planned on {})",
                from.world_size, self.total_steps, from.world_size
            );
            if changed.is_none() {
                text += &format!("; {outcome}");
            }
        }
        if let Some(changed) = changed {
            text += &format!(
                "; {changed}: the result will not be bit-identical to an uninterrupted run"
            );
        }
        text
    }
}

/// How the sums of world-size-invariant training changed since the checkpoint (`job.toml`
/// edited): each step's gradients are then summed in another order, whatever the world size.
fn changed_tree(plan: TrainPlan<'_>, from: &TrainPosition) -> Option<String> {
    match (from.virtual_shards, plan.distributed.invariant_shards()) {
        (Some(before), Some(now)) if before != now => Some(format!(
            "distributed.virtual_shards changed from {before} to {now}"
        )),
        (Some(_), None) => {
            Some("distributed.deterministic is no longer \"world-size-invariant\"".into())
        }
        _ => None,
    }
}

/// Puts a checkpoint's weights into `params` (all of them, or what trains over the base the
/// model was built from: see `checkpoint::base`) and its state into `optimizer`, after
/// checking that every parameter is there with its shape.
pub fn restore(
    params: &Params,
    optimizer: &mut Optimizer,
    restored: &Restored,
) -> Result<(), TrainError> {
    let base = restored.position.base_sha256.as_deref();
    crate::checkpoint::base::set_from(params, &restored.model, base).map_err(|problem| {
        TrainError::Restore {
            dir: restored.dir.clone(),
            problem,
        }
    })?;
    let steps = restored.position.optimizer_steps;
    if let Some(problem) = optimizer.state_mismatch(&restored.optimizer, steps) {
        return Err(TrainError::Restore {
            dir: restored.dir.clone(),
            problem,
        });
    }
    optimizer.load_state(params, restored.optimizer.clone(), steps)?;
    Ok(())
}
