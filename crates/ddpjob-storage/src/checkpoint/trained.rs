//! Weights another ddpjob job trained, named by a path as `model.init_from` names them:
//! `jobs/NAME` (its final weights, else its newest checkpoint) or one of its checkpoint
//! directories (`jobs/NAME/checkpoints/best`, `.../step-00000200`). The new job takes the
//! source's model (its `job.toml`'s `[model]`) and its vocabulary (`vocab.json`), so the
//! weights mean what they meant.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::jobdir::JobDir;

/// A job's trained weights, and the job they come from.
#[derive(Debug, Clone)]
pub struct Trained {
    pub job: JobDir,
    /// The `model.safetensors` to load.
    pub weights: PathBuf,
}

impl Trained {
    /// The weights `path` names, when it is a job directory or a checkpoint directory of one
    /// (an error when such a job has none yet); `None` for any other path.
    pub fn find(path: &Path) -> Option<Result<Trained, String>> {
        Some(Self::locate(path)?.and_then(Self::whole))
    }

    /// A checkpoint that holds only what trains (see `super::base`) needs its base, which a
    /// new job does not build: refused, naming what to start from instead.
    fn whole(self) -> Result<Trained, String> {
        match super::base::of_weights(&self.weights) {
            None => Ok(self),
            Some(_) => Err(format!(
                "model.init_from: `{}` holds only the trainable parameters of a job with frozen \
                 ones (LoRA, model.freeze); start from the job once it has finished (its \
                 model.safetensors is whole), or from `{} --hf DIR --merge-lora`",
                self.weights.display(),
                self.job.cli("export")
            )),
        }
    }

    fn locate(path: &Path) -> Option<Result<Trained, String>> {
        if path.join("job.toml").is_file() {
            let job = JobDir {
                root: path.to_path_buf(),
            };
            return Some(
                super::Checkpoints::of(&job)
                    .weights(None)
                    .map(|weights| Trained { job, weights })
                    .map_err(|e| format!("model.init_from: {e}")),
            );
        }
        let weights = path.join("model.safetensors");
        let checkpoints = path.parent()?;
        let root = checkpoints.parent()?;
        let is_checkpoint = checkpoints.file_name()? == "checkpoints"
            && root.join("job.toml").is_file()
            && weights.is_file();
        is_checkpoint.then(|| {
            Ok(Trained {
                job: JobDir {
                    root: root.to_path_buf(),
                },
                weights,
            })
        })
    }

    /// Sets `params` from the weights (names, shapes and layouts as trained), the rows of
    /// `crop` cut to the parameter's (a shorter window's position table). LoRA adapters the
    /// new job does not go on training as they are (`lora`: its own, if any; none, or another
    /// rank, scale or set of layers) are folded into their layers first, as PEFT's
    /// `merge_and_unload`, and the new job's adapters start afresh.
    pub fn load_into(
        &self,
        params: &ddpjob_seam::Params,
        crop: Option<&str>,
        lora: Option<&ddpjob_spec::LoraSpec>,
    ) -> Result<(), crate::hf::HfError> {
        let file = crate::hf::HfDir {
            root: self.job.root.clone(),
            config: Default::default(),
            weight_files: vec![self.weights.clone()],
        };
        let Some(scale) = self.adapters_to_fold(params, lora)? else {
            return file.load_with(params, &Cropped { crop, fold: false });
        };
        if crate::hf::is_checking() {
            // Folded, the adapters leave their layers' shapes as they are: the rest is checked.
            return file.load_with(params, &Cropped { crop, fold: true });
        }
        let unreadable = |cause| crate::hf::HfError::Weights {
            path: self.weights.clone(),
            cause,
        };
        let tensors = candle_core::safetensors::load(&self.weights, &candle_core::Device::Cpu)
            .map_err(unreadable)?;
        // A 4-bit base (a QLoRA job's) takes its adapters in f32, quantised again as it loads.
        let tensors = ddpjob_seam::packed::dequantize_saved(tensors).map_err(|e| {
            crate::hf::HfError::Invalid(format!("`{}`: {e}", self.weights.display()))
        })?;
        let folded = crate::hf::peft::merge_lora(tensors, scale).map_err(|e| {
            crate::hf::HfError::Invalid(format!("`{}`: {e}", self.weights.display()))
        })?;
        let present = folded.keys().cloned().collect();
        let load = |name: &str| Ok(folded[name].clone());
        file.load_from(&present, load, params, &Cropped { crop, fold: false })
    }

    /// The scale (`alpha / r`) to fold the weights' adapters into their layers with, when
    /// they have adapters that `params` (whose LoRA is `lora`) do not take as they are.
    fn adapters_to_fold(
        &self,
        params: &ddpjob_seam::Params,
        lora: Option<&ddpjob_spec::LoraSpec>,
    ) -> Result<Option<f64>, crate::hf::HfError> {
        // SAFETY: read-only mapping, read while it lives (as in `HfDir::load_with`).
        let file = unsafe { candle_core::safetensors::MmapedSafetensors::new(&self.weights) }
            .map_err(|cause| crate::hf::HfError::Weights {
                path: self.weights.clone(),
                cause,
            })?;
        let adapters: Vec<(String, Vec<usize>)> = file
            .tensors()
            .into_iter()
            .filter(|(name, _)| ddpjob_spec::is_adapter(name))
            .map(|(name, view)| (name, view.shape().to_vec()))
            .collect();
        if adapters.is_empty() {
            return Ok(None);
        }
        let scale = self.lora_scale().map_err(crate::hf::HfError::Invalid)?;
        let wanted: std::collections::HashMap<&str, Vec<usize>> = params
            .iter()
            .filter(|(name, _)| ddpjob_spec::is_adapter(name))
            .map(|(name, var)| (name, var.dims().to_vec()))
            .collect();
        let same_adapters = wanted.len() == adapters.len()
            && adapters
                .iter()
                .all(|(name, shape)| wanted.get(name.as_str()) == Some(shape));
        let same_scale = lora.is_some_and(|l| l.scale() == scale);
        Ok((!(same_adapters && same_scale)).then_some(scale))
    }

    /// `alpha / r` of the source job's `[model.lora]`.
    fn lora_scale(&self) -> Result<f64, String> {
        let file = self.job.job_toml();
        let model = self.model_table()?;
        let lora = model.get("lora").and_then(toml::Value::as_table);
        let number = |key: &str| {
            lora.and_then(|l| l.get(key)).and_then(|v| match v {
                toml::Value::Integer(i) => Some(*i as f64),
                toml::Value::Float(f) => Some(*f),
                _ => None,
            })
        };
        match (number("alpha"), number("r")) {
            (Some(alpha), Some(r)) if r > 0.0 => Ok(alpha / r),
            _ => Err(format!(
                "`{}` has LoRA adapters but `{}` has no [model.lora] r and alpha to fold them \
                 in with",
                self.weights.display(),
                file.display()
            )),
        }
    }

    /// The source job's `[model]`, as its `job.toml` froze it (every key written out).
    pub fn model_table(&self) -> Result<toml::Table, String> {
        let path = self.job.job_toml();
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
        let doc: toml::Table = text
            .parse()
            .map_err(|e| format!("`{}` is not valid TOML: {e}", path.display()))?;
        match doc.get("model") {
            Some(toml::Value::Table(model)) => Ok(model.clone()),
            _ => Err(format!("`{}` has no [model]", path.display())),
        }
    }

    /// The Hugging Face `tokenizer.json` the source job's text data named, if any: the new
    /// job's default `data.tokenizer`.
    pub fn tokenizer(&self) -> Option<PathBuf> {
        // The copy the job kept when it began (its base may have moved since).
        if let Some(kept) = crate::hf::job_tokenizer::kept(&self.job.root) {
            return Some(kept.join("tokenizer.json"));
        }
        let text = std::fs::read_to_string(self.job.job_toml()).ok()?;
        let doc: toml::Table = text.parse().ok()?;
        let named = doc.get("data")?.get("tokenizer")?.as_str()?;
        named.ends_with(".json").then(|| PathBuf::from(named))
    }

    /// The number of symbols of the source job's vocabulary, if it has one.
    pub fn vocabulary_size(&self) -> Option<usize> {
        let vocab = crate::vocab::Vocab::load(&self.vocabulary()?).ok()?;
        Some(vocab.size())
    }

    /// The source job's vocabulary (`vocab.json`), which the new job's text is encoded with.
    pub fn vocabulary(&self) -> Option<PathBuf> {
        Some(crate::vocab::Vocab::path_in(&self.job.root)).filter(|p| p.is_file())
    }
}

/// A job's own layout, the rows of tensor `crop` cut to the model's; with `fold`, its LoRA
/// adapters are not the model's (they are folded into their layers).
struct Cropped<'a> {
    crop: Option<&'a str>,
    fold: bool,
}

impl crate::hf::FileLayout for Cropped<'_> {
    fn file_name(&self, name: &str, present: &HashSet<String>) -> Option<String> {
        let own = !(self.fold && ddpjob_spec::is_adapter(name));
        (own && present.contains(name)).then(|| name.to_string())
    }

    fn to_model(
        &self,
        name: &str,
        stored: candle_core::Tensor,
        dims: &[usize],
    ) -> candle_core::Result<candle_core::Tensor> {
        match dims.first() {
            Some(&rows) if Some(name) == self.crop && stored.dims().first() > Some(&rows) => {
                stored.narrow(0, 0, rows)
            }
            _ => Ok(stored),
        }
    }

    fn ignored(&self, file_name: &str) -> bool {
        self.fold && ddpjob_spec::is_adapter(file_name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_and_their_checkpoints_are_found_other_paths_are_not() {
        let tmp = tempfile::tempdir().unwrap();
        let job = tmp.path().join("jobs/pre");
        let step = job.join("checkpoints/step-00000010");
        std::fs::create_dir_all(&step).unwrap();
        std::fs::write(job.join("job.toml"), "[model]\narch = \"gpt\"\n").unwrap();
        // A job without weights yet is named as such.
        let err = Trained::find(&job).unwrap().unwrap_err();
        assert!(err.contains("has no weights"), "{err}");
        std::fs::write(step.join("model.safetensors"), b"x").unwrap();
        std::fs::write(job.join("checkpoints/latest"), "step-00000010").unwrap();
        let found = Trained::find(&job).unwrap().unwrap();
        assert_eq!(found.weights, step.join("model.safetensors"));
        assert_eq!(found.model_table().unwrap()["arch"].as_str(), Some("gpt"));
        std::fs::write(job.join("model.safetensors"), b"x").unwrap();
        let found = Trained::find(&job).unwrap().unwrap();
        assert_eq!(found.weights, job.join("model.safetensors"));
        let found = Trained::find(&step).unwrap().unwrap();
        assert_eq!(
            (found.job.root, found.weights),
            (job.clone(), step.join("model.safetensors"))
        );
        assert!(Trained::find(tmp.path()).is_none());
        assert!(Trained::find(&tmp.path().join("models/gpt2")).is_none());
    }
}
