//! `ddpjob export NAME --hf DIR`: a job's weights as a Hugging Face model directory that
//! `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads, with the job's tokenizer
//! (a LoRA job's with `--merge-lora`); `--peft DIR`: a LoRA job's adapters as
//! `PeftModel.from_pretrained(base, DIR)` loads them.

use std::path::{Path, PathBuf};

use anyhow::anyhow;
use clap::{Args, ValueEnum};

use super::CliResult;
use crate::config;
use crate::data::vocab::Vocab;
use crate::generate::{SampleError, weights_path};
use crate::hf::job_tokenizer::{self, TokenizerFiles};
use crate::hf::{self, ExportDtype};
use crate::registry::Registry;

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("format").required(true).args(["hf", "peft"])))]
pub(super) struct ExportArgs {
    /// The job's name (its directory under --jobs-dir).
    name: String,
    /// Write a Hugging Face model directory here (config.json, model.safetensors, tokenizer).
    #[arg(long, value_name = "DIR")]
    hf: Option<PathBuf>,
    /// With --hf, for a LoRA job: fold the adapters into the weights (W + alpha/r · B·A).
    #[arg(long, requires = "hf")]
    merge_lora: bool,
    /// Write a LoRA job's adapters here in PEFT's format (adapter_config.json,
    /// adapter_model.safetensors).
    #[arg(long, value_name = "DIR")]
    peft: Option<PathBuf>,
    /// Which weights: best, latest, step-N (default: the final weights, else the newest
    /// checkpoint).
    #[arg(long, value_name = "WHICH")]
    checkpoint: Option<String>,
    /// The dtype of the written weights.
    #[arg(long, value_enum, default_value_t = Dtype::F32)]
    dtype: Dtype,
    /// Write into DIR even if it is not empty: the model files already there (config,
    /// weights and shards, tokenizer, adapter) are replaced, other files left.
    #[arg(long)]
    force: bool,
    /// Where jobs live.
    #[arg(long, default_value = "jobs")]
    jobs_dir: PathBuf,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Dtype {
    F32,
    Bf16,
}

pub(super) fn export(args: &ExportArgs) -> CliResult {
    if args.peft.is_some() && args.merge_lora {
        return Err((
            2,
            anyhow!(
                "--merge-lora goes with --hf (a whole model with the adapters folded in); --peft \
                 writes the adapters alone, unmerged: leave out one of them"
            ),
        ));
    }
    let job = super::existing_job(&args.jobs_dir, &args.name)?;
    let spec = config::load(&job.job_toml(), &[])
        .map_err(|e| (2, anyhow!(e)))?
        .spec;
    let weights = weights_path(&job, args.checkpoint.as_deref()).map_err(|e| match e {
        SampleError::Usage(_) => (2, anyhow!(e)),
        other => (1, anyhow!(other)),
    })?;
    let tensors = match crate::generate::restoring(&weights) {
        true => candle_core::safetensors::load(&weights, &candle_core::Device::Cpu)
            .map_err(|e| (1, anyhow!("cannot read `{}`: {e}", weights.display())))?,
        false => over_base(&spec, &job, &weights)?,
    };
    let dtype = match args.dtype {
        Dtype::F32 => ExportDtype::F32,
        Dtype::Bf16 => ExportDtype::Bf16,
    };
    let lora = spec.model.lora();
    if let Some(dir) = &args.peft {
        let lora = lora.ok_or_else(|| {
            (
                2,
                anyhow!(
                    "job `{}` has no LoRA adapters ([model.lora] is off); export --hf writes \
                     its whole model",
                    args.name
                ),
            )
        })?;
        let fan_in_fan_out = Registry::current().fan_in_fan_out(spec.model.arch());
        let base = adapters_base(&spec);
        let layers = hf::peft::write_adapter(
            dir,
            tensors,
            lora,
            fan_in_fan_out,
            base.as_ref().ok().map(String::as_str),
            dtype,
            args.force,
        )
        .map_err(export_error)?;
        let loads = format!(
            "PeftModel.from_pretrained(base, \"{}\") loads them",
            dir.display()
        );
        let loads = match base {
            Ok(_) => loads,
            Err(why) => format!("{why}; then {loads}"),
        };
        outln!(
            "exported the LoRA adapters of {layers} layers of `{}` to `{}`: {loads}",
            weights.display(),
            dir.display(),
        );
        return Ok(());
    }
    let hf_dir = args.hf.as_deref().unwrap_or(Path::new("."));
    // A 4-bit base (`[model.quantize]`) goes out de-quantised, in f32 or bf16 as asked.
    let tensors = ddpjob_seam::packed::dequantize_saved(tensors).map_err(|e| {
        let at = weights.display();
        (1, anyhow!("`{at}`: {e}"))
    })?;
    let tensors = match (lora, args.merge_lora) {
        (Some(lora), true) => {
            hf::peft::merge_lora(tensors, lora.scale()).map_err(|e| (1, anyhow!(e)))?
        }
        (Some(_), false) => {
            return Err((
                2,
                anyhow!(
                    "job `{}` trained LoRA adapters: pass --merge-lora to fold them into the \
                     weights, or export them alone with --peft DIR",
                    args.name
                ),
            ));
        }
        (None, merge) => {
            if merge {
                errln!(
                    "note: job `{}` has no LoRA adapters: --merge-lora has nothing to fold",
                    args.name
                );
            }
            tensors
        }
    };
    let (mut hf_config, tensors) =
        crate::models::hf_export_parts(&spec.model, tensors).map_err(|e| (2, anyhow!(e)))?;
    let tokenizer = job_tokenizer::of_job(
        &spec,
        Registry::current().data_tokenizer(&spec.data),
        &job.root,
    );
    keep_special_token_ids(&mut hf_config, &tokenizer);
    let end = end_of_examples(&spec, &tokenizer);
    if let Some((_, id)) = &end {
        let ids = match hf_config.get("eos_token_id") {
            list @ Some(serde_json::Value::Array(_)) => hf::led_by(*id, list),
            _ => (*id).into(),
        };
        hf_config.insert("eos_token_id".into(), ids);
    }
    hf::export(
        hf_dir,
        hf_config,
        tensors,
        &tokenizer.files,
        dtype,
        args.force,
    )
    .map_err(export_error)?;
    if let Some((token, id)) = &end {
        hf::mark_end_token(hf_dir, token, *id).map_err(export_error)?;
    }
    outln!(
        "exported `{}` to `{}`{}",
        weights.display(),
        hf_dir.display(),
        match (tokenizer.is_empty(), vocabulary(&job.root)) {
            (false, _) => "",
            // A job of an older version, whose tokenizer was not kept, moved since.
            (true, Some(Ok(Vocab::HuggingFace(_)))) => {
                " (no tokenizer: the tokenizer.json the job trained with is no longer where its \
                 job.toml says; copy it beside the model)"
            }
            // Its data came as token ids (`tokens`, or a dataset of the user's own).
            (true, None) => {
                " (no tokenizer: the job trained on token ids it was given and kept no \
                 vocabulary; put the tokenizer that made them beside the model)"
            }
            (true, Some(_)) => {
                " (no tokenizer: the job's vocabulary is ddpjob's own char/byte one, which \
                 transformers cannot load)"
            }
        }
    );
    Ok(())
}

/// The vocabulary the job at `root` encoded its text with, if it kept one.
fn vocabulary(root: &Path) -> Option<Result<Vocab, crate::data::DataError>> {
    let path = Vocab::path_in(root);
    path.is_file().then(|| Vocab::load(&path))
}

/// The model directory the job's adapters go over, for `base_model_name_or_path`: its
/// `init_from`, or when that is another job's weights, the base that job's adapters went over
/// (the adapters continued as they were). `Err` saying what to do when no directory holds the
/// base: a job whose adapters were folded into its layers, or a full fine-tune.
fn adapters_base(spec: &config::JobSpec) -> Result<String, String> {
    let ours = spec.model.lora().map(|l| {
        let targets = serde_json::to_value(&l.target_modules).unwrap_or_default();
        (l.r as f64, l.alpha, targets_key(&targets))
    });
    let mut init_from = spec.model.init_from().map(str::to_string);
    // A chain of jobs, each continuing the last one's adapters.
    for _ in 0..64 {
        let Some(from) = init_from.clone() else {
            return Err("the job started from random weights, so no base holds them".into());
        };
        let Some(Ok(trained)) = crate::checkpoint::Trained::find(Path::new(&from)) else {
            return Ok(from);
        };
        // As the job froze it (read whole: its own base may have moved since).
        let model = trained.model_table()?;
        let lora = model.get("lora").and_then(toml::Value::as_table);
        let number = |key: &str| match lora.and_then(|l| l.get(key)) {
            Some(toml::Value::Integer(i)) => Some(*i as f64),
            Some(toml::Value::Float(f)) => Some(*f),
            _ => None,
        };
        let theirs = match (number("r"), number("alpha")) {
            (Some(r), Some(alpha)) if r > 0.0 => {
                let targets = lora.and_then(|l| l.get("target_modules"));
                let targets = serde_json::to_value(targets).unwrap_or_default();
                Some((r, alpha, targets_key(&targets)))
            }
            _ => None,
        };
        if theirs.is_none() || theirs != ours {
            let (folded, merge) = match theirs {
                Some(_) => (" with its adapters folded in", " --merge-lora"),
                None => ("", ""),
            };
            let checkpoint = match trained.weights.parent() {
                Some(dir) if dir != trained.job.root => {
                    dir.file_name().map_or(String::new(), |n| {
                        format!(" --checkpoint {}", n.to_string_lossy())
                    })
                }
                _ => String::new(),
            };
            return Err(format!(
                "their base is the weights of job `{}`{folded}, which no model directory \
                 holds: write it with `{} --hf BASE{merge}{checkpoint}` and set \
                 base_model_name_or_path in adapter_config.json to BASE",
                trained.job.name(),
                trained.job.cli("export"),
            ));
        }
        init_from = model
            .get("init_from")
            .and_then(toml::Value::as_str)
            .map(str::to_string);
    }
    Err("its model.init_from chain of jobs does not end".into())
}

/// `target_modules` as a list of names in order (or a pattern): the same layers however the
/// list was ordered.
fn targets_key(targets: &serde_json::Value) -> String {
    match targets {
        serde_json::Value::Array(names) => {
            let mut names: Vec<String> = names.iter().map(ToString::to_string).collect();
            names.sort();
            names.join(",")
        }
        other => other.to_string(),
    }
}

/// The base model's `bos_token_id`, `eos_token_id` and `pad_token_id` (which the model's own
/// options do not hold) in `config`, when the export carries the base's tokenizer: what
/// `model.config.eos_token_id` means is that tokenizer's.
fn keep_special_token_ids(
    config: &mut serde_json::Map<String, serde_json::Value>,
    tokenizer: &TokenizerFiles,
) {
    for (key, id) in &tokenizer.base_ids {
        if config.get(key).is_none_or(serde_json::Value::is_null) {
            config.insert(key.clone(), id.clone());
        }
    }
}

/// The token (and its id) an instruction-tuned job (`data.dataset = "jsonl"`) ended every
/// example with, when the export carries the tokenizer that has it: what the exported model
/// learnt to end an answer with, which may not be the base's end of sequence (`<|im_end|>`
/// after a base's `<|endoftext|>`).
fn end_of_examples(spec: &config::JobSpec, tokenizer: &TokenizerFiles) -> Option<(String, u32)> {
    let token = Registry::current().data_end_of_example(&spec.data)?;
    let id = crate::data::hf_tokenizer::HfTokenizer::load(tokenizer.files.first()?)
        .ok()?
        .token_id(&token)?;
    Some((token, id))
}

/// An export's error with its exit code: 2 for what the user can fix (a directory, a flag).
fn export_error(e: hf::HfError) -> (u8, anyhow::Error) {
    let code = match e {
        hf::HfError::Invalid(_) => 2,
        _ => 1,
    };
    (code, anyhow!(e))
}

/// The whole model of a checkpoint that holds only what trains (see `checkpoint::base`): the
/// job's model built over its base, the checkpoint's tensors put in.
fn over_base(
    spec: &config::JobSpec,
    job: &crate::jobdir::JobDir,
    weights: &Path,
) -> Result<std::collections::HashMap<String, candle_core::Tensor>, (u8, anyhow::Error)> {
    let input = crate::task::load(spec, Some(job))
        .map_err(|e| (1, anyhow!(e)))?
        .input();
    let device = candle_core::Device::Cpu;
    let precision = crate::config::Precision::F32;
    let model = crate::models::build(
        &spec.model.without_adapter(),
        input,
        spec.seed,
        &device,
        precision,
        false,
    )
    .map_err(|e| (1, anyhow!(e)))?;
    crate::generate::load_weights(model.params(), weights).map_err(|e| (1, anyhow!(e)))?;
    Ok(model.params().named_tensors())
}
