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

/// Where the model [`around`] wraps stands.
#[derive(Debug, Clone, Copy)]
pub struct Wrapping<'a> {
    /// The job directory, where a precomputed reference is read from (`None`: none is).
    pub job: Option<&'a Path>,
    /// A precomputed reference made now is kept there (a worker's; `eval` computes one for
    /// itself, in memory).
    pub keep: bool,
    /// The model's weights are a checkpoint's, put in later: not the model as the job
    /// started, so no reference may be computed from them.
    pub restoring: bool,
}

/// `model` as `spec`'s objective trains and scores it, and a line for the log saying what the
/// reference is.
pub fn around(
    model: Box<dyn Model>,
    spec: &JobSpec,
    data: &dyn Task,
    device: &Device,
    at: Wrapping,
    comm: &dyn Communicator,
) -> candle_core::Result<(Box<dyn Model>, Option<String>)> {
    let job = at.job;
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
            if at.restoring && matches!(live, Reference::AdaptersOff) {
                return Err(candle_core::Error::Msg(format!(
                    "train.dpo.precompute_reference: the job has no `{}` and its weights come \
                     from a checkpoint, not as the job started, so the reference cannot be made \
                     again; set precompute_reference = false to score against the base with \
                     the adapters off",
                    ReferenceTable::FILE
                )));
            }
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
            // Rank 0 keeps it; every rank hears whether that worked, so none goes on alone.
            let saved = match (comm.rank(), at.keep && job.is_some()) {
                (0, true) => table.save().map_err(|e| e.to_string()),
                _ => Ok(()),
            };
            let mut failed = [f64::from(u8::from(saved.is_err()))];
            if comm.world_size() > 1 {
                comm.all_reduce_sum_f64(&mut failed)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            }
            if failed[0] > 0.0 {
                let why = saved.err().unwrap_or_else(|| "on rank 0".into());
                return Err(candle_core::Error::Msg(format!(
                    "cannot write `{}`: {why}",
                    path.display()
                )));
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
