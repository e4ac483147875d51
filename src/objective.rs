//! The job's objective around the model it builds (`train.objective`): `"lm"` trains the model
//! on its task's own loss; `"dpo"` wraps it as the policy of `ddpjob-objective`'s [`Dpo`], with
//! the reference TRL would use: the base with the adapters off for a LoRA job, else a frozen
//! copy built as the job first built the policy, or the table `precompute_reference` keeps in
//! the job directory (computed here once, by every rank together, then read by `resume`,
//! restarts and `eval`). What the worker, `eval` and `bench step` share.

use std::path::Path;

use candle_core::Device;
use ddpjob_comm::Communicator;
use ddpjob_objective::{Dpo, DpoSettings, Reference, ReferenceTable, precompute};

use crate::config::{JobSpec, Objective};
use crate::models::Model;
use crate::task::Task;

/// `model` as `spec`'s objective trains and scores it; `job`: the job directory, where a
/// precomputed reference is kept (`None`: computed and kept in memory only). A line for the
/// log with it, saying what the reference is.
pub fn around(
    model: Box<dyn Model>,
    spec: &JobSpec,
    data: &dyn Task,
    device: &Device,
    job: Option<&Path>,
    comm: &dyn Communicator,
) -> candle_core::Result<(Box<dyn Model>, Option<String>)> {
    if spec.train.objective == Objective::Lm {
        return Ok((model, None));
    }
    let d = spec.train.dpo;
    let settings = DpoSettings {
        beta: d.beta,
        loss: d.loss,
        label_smoothing: d.label_smoothing,
    };
    let stored = job.map(|j| j.join(ReferenceTable::FILE));
    let (reference, what) = match &stored {
        Some(path) if d.precompute_reference && path.is_file() => {
            let table = ReferenceTable::load(path).map_err(candle_core::Error::Msg)?;
            let what = format!(
                "precomputed ({} completions, {})",
                table.len(),
                path.display()
            );
            (Reference::Table(table), what)
        }
        _ => live(spec, data, device)?,
    };
    let (reference, what) = match (d.precompute_reference, reference) {
        (true, live @ (Reference::AdaptersOff | Reference::Frozen(_))) => {
            let path = stored.unwrap_or_else(|| std::env::temp_dir().join(ReferenceTable::FILE));
            let ranks = (comm.rank(), comm.world_size());
            let mut all_reduce =
                |v: &mut [f64]| comm.all_reduce_sum_f64(v).map_err(|e| e.to_string());
            let table = precompute::precompute(
                &live,
                model.as_ref(),
                data,
                device,
                ranks,
                &mut all_reduce,
                path.clone(),
            )
            .map_err(|e| candle_core::Error::Msg(format!("precomputing the reference: {e}")))?;
            if comm.rank() == 0 && job.is_some() {
                table.save().map_err(|e| {
                    candle_core::Error::Msg(format!("cannot write `{}`: {e}", path.display()))
                })?;
            }
            let what = format!(
                "precomputed now from {what} ({} completions, {})",
                table.len(),
                path.display()
            );
            (Reference::Table(table), what)
        }
        (_, other) => (other, what),
    };
    let line = format!(
        "objective: DPO ({} loss, beta {}{}), reference: {what}",
        d.loss.name(),
        d.beta,
        match d.label_smoothing {
            0.0 => String::new(),
            e => format!(", label smoothing {e}"),
        }
    );
    let dpo = Dpo {
        policy: model,
        reference,
        settings,
    };
    Ok((Box::new(dpo), Some(line)))
}

/// The reference computed as training goes: the base with the adapters off for LoRA, else a
/// frozen copy of the model as the job first built it (its `init_from`, or its seed's draw).
fn live(
    spec: &JobSpec,
    data: &dyn Task,
    device: &Device,
) -> candle_core::Result<(Reference, String)> {
    if spec.model.lora().is_some() {
        return Ok((
            Reference::AdaptersOff,
            "the base with the LoRA adapters off".into(),
        ));
    }
    let frozen = crate::models::build(
        &spec.model,
        data.input(),
        spec.seed,
        device,
        spec.train.precision,
        false,
    )?;
    let what = match spec.model.init_from() {
        Some(from) => format!("a frozen copy of `{from}`"),
        None => "a frozen copy of the model as drawn from the seed".into(),
    };
    Ok((Reference::Frozen(frozen), what))
}
