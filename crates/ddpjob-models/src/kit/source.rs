//! Where a job's model takes its first weights from, decided in one place for every family:
//! drawn from the job's seed, left blank for a checkpoint of this job to replace (a resume or
//! a restart), or read from what `init_from` names (another ddpjob job, or a Hugging Face
//! model directory). The family says only how its parameters are found in a file
//! ([`Reading`]); the source gives its [`ParamBuilder`] (drawing or blank) and then fills the
//! parameters built. candle's `VarBuilder` is the idea: the layers ask, the source answers.

use std::path::Path;

use ddpjob_seam::{BuildError, ModelContext, Params};
use ddpjob_storage::checkpoint::Trained;
use ddpjob_storage::hf::{FileLayout, HfDir};

use super::ParamBuilder;

/// Where the weights come from.
pub enum WeightSource {
    /// Drawn from this seed, as the family's reference initialises them.
    Drawn(u64),
    /// Left blank: a checkpoint of this job replaces them.
    Restored,
    /// Another ddpjob job's trained weights (its directory or one of its checkpoints).
    Trained(Trained),
    /// A Hugging Face model directory.
    Hf(HfDir),
}

/// How a family's parameters are found in what a source reads.
pub struct Reading<'a> {
    /// Where each parameter is in a Hugging Face directory's files, and how it is laid out.
    pub hf: &'a dyn FileLayout,
    /// A parameter another job may hold larger than this job's model (GPT's position table,
    /// cut to this job's window).
    pub crop: Option<&'a str>,
}

impl WeightSource {
    /// The source of a job's model: blank when `cx` says a checkpoint will be restored, else
    /// `init_from`'s weights when it names a directory, else drawn from the job's seed.
    pub fn for_job(cx: &ModelContext, init_from: Option<&str>) -> Result<Self, BuildError> {
        if cx.restoring {
            return Ok(WeightSource::Restored);
        }
        let Some(dir) = init_from else {
            return Ok(WeightSource::Drawn(cx.seed));
        };
        let dir = Path::new(dir);
        Ok(match Trained::find(dir) {
            Some(trained) => WeightSource::Trained(trained?),
            None => WeightSource::Hf(HfDir::open(dir)?),
        })
    }

    /// The builder of the family's parameters: drawing from the seed, or blank (shapes and
    /// names only) for weights to be read. LoRA's adapters are drawn either way from the
    /// job's seed (a zero `A` would never learn), beside the layers `lora_targets` names
    /// when the job's `[model.lora]` names none.
    pub fn builder<'a>(
        &self,
        cx: &'a ModelContext,
        lora_targets: &'static [&'static str],
    ) -> ParamBuilder<'a> {
        let builder = match self {
            WeightSource::Drawn(seed) => ParamBuilder::new(*seed, &cx.device),
            _ => ParamBuilder::blank(&cx.device),
        };
        builder
            .with_lora(cx.lora.as_ref(), lora_targets, cx.seed)
            .with_quantize(cx.quantize)
    }

    /// Fills `params` (built by [`WeightSource::builder`]) from the source: nothing to do
    /// when they were drawn or a checkpoint will replace them.
    pub fn fill(
        &self,
        params: &Params,
        reading: Reading,
        cx: &ModelContext,
    ) -> Result<(), BuildError> {
        match self {
            WeightSource::Drawn(_) | WeightSource::Restored => Ok(()),
            WeightSource::Trained(trained) => {
                Ok(trained.load_into(params, reading.crop, cx.lora.as_ref())?)
            }
            WeightSource::Hf(dir) => Ok(dir.load_with(params, reading.hf)?),
        }
    }
}
