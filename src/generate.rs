//! Text generation from a trained language-model job (`ddpjob sample`): loads the job's weights
//! and vocabulary, then samples token by token. A `gpt` keeps a KV cache, so a token costs the
//! same however long the prompt; any other language model (`llama`, a registered one) runs its
//! forward pass over the last `block_size` tokens for each token. Sampling is deterministic for
//! a seed (our own Mersenne Twister).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use thiserror::Error;

use crate::checkpoint::Checkpoints;
use crate::config;
use crate::config::Precision;
use crate::data::DataError;
use crate::data::chat::ChatTemplate;
use crate::data::vocab::Vocab;
use crate::jobdir::JobDir;
use crate::models::{KvCache, Mode, Model, Params};
use crate::task::ModelInput;
use ddpjob_rng::Mt19937;

#[derive(Debug, Error)]
pub enum SampleError {
    /// Something the user asked for that cannot be done (exit 2).
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error("cannot use the weights in `{}`: {cause}", path.display())]
    Weights {
        path: PathBuf,
        cause: candle_core::Error,
    },
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

/// How to sample.
#[derive(Debug, Clone, Copy)]
pub struct Sampling {
    /// Softmax temperature; 0 picks the most likely token every time.
    pub temperature: f64,
    /// Keep only the k most likely tokens (None: all).
    pub top_k: Option<usize>,
    pub seed: u64,
}

/// A trained language model and its vocabulary, ready to generate.
pub struct Generator {
    engine: Engine,
    vocab: Vocab,
    /// For a job trained on examples (`data.dataset = "jsonl"`): the end-of-sequence token each
    /// example ended with, where generation stops (as transformers' `generate` stops at
    /// `eos_token_id`); prompts are then encoded as the examples' were.
    end_of_example: Option<u32>,
    /// The chat template its conversations were rendered with, when it has one (`--chat`).
    chat_template: Option<ChatTemplate>,
    /// Where the weights came from, for messages.
    pub weights: PathBuf,
}

impl Generator {
    /// Loads job `job`'s weights: `checkpoint` is `best`, `latest` (the newest checkpoint),
    /// `step-N`, or `None` for the final weights (the newest checkpoint if the job is not
    /// finished).
    pub fn load(job: &JobDir, checkpoint: Option<&str>) -> Result<Generator, SampleError> {
        let spec = config::load(&job.job_toml(), &[])?.spec;
        let Some(language) = spec.model.language() else {
            return Err(SampleError::Usage(format!(
                "job `{}` trains a {} classifier; `sample` generates text from language-model \
                 jobs (model.arch = \"gpt\", \"llama\", or a registered language model)",
                job.name(),
                spec.model.arch()
            )));
        };
        let vocab_path = Vocab::path_in(&job.root);
        // Pre-tokenised ids of a pretrained model: its tokenizer, kept when the job began (the
        // one `export` ships), made them.
        let kept = crate::hf::job_tokenizer::of_job(
            &spec,
            crate::registry::Registry::current().data_tokenizer(&spec.data),
            &job.root,
        );
        let vocab = match (vocab_path.is_file(), kept.files.first()) {
            (true, _) => Vocab::load(&vocab_path)?,
            (false, Some(kept)) => {
                Vocab::build(&config::TokenizerKind::HuggingFace(kept.clone()), "")?
            }
            (false, None) => {
                return Err(SampleError::Usage(format!(
                    "job `{}` has no vocabulary (`{}`): it trained on pre-tokenised ids, which \
                     `sample` cannot turn into text",
                    job.name(),
                    vocab_path.display()
                )));
            }
        };
        let weights = weights_path(job, checkpoint)?;
        let vocab_size = language.vocab_size.unwrap_or(vocab.size());
        let input = ModelInput::Tokens {
            vocab_size,
            block_size: language.block_size,
        };
        let blank = restoring(&weights);
        let model = crate::models::build(
            &spec.model.without_adapter(),
            input,
            spec.seed,
            &Device::Cpu,
            Precision::F32,
            blank,
        )?;
        load_weights(model.params(), &weights)?;
        let engine = Engine {
            model,
            block_size: language.block_size,
        };
        let end_of_example = crate::registry::Registry::current()
            .data_end_of_example(&spec.data)
            .and_then(|token| vocab.token_id(&token));
        // The template as the job rendered its data: data.chat_template, else the one kept
        // beside the job's copy of the tokenizer.
        let chosen = (spec.data.options().get("chat_template"))
            .and_then(|v| v.as_str())
            .map(PathBuf::from);
        let chat_template = match kept.files.first() {
            Some(tokenizer) => ChatTemplate::for_tokenizer(tokenizer, chosen.as_deref())
                .map_err(SampleError::Usage)?,
            None => None,
        };
        Ok(Generator {
            engine,
            vocab,
            end_of_example,
            chat_template,
            weights,
        })
    }

    /// Generates `tokens` tokens after `prompt` (fewer when an instruction-tuned job's model
    /// ends its answer), calling `emit` with each one's text as it comes; returns the
    /// generated ids.
    pub fn generate(
        &self,
        prompt: &str,
        tokens: usize,
        how: Sampling,
        emit: impl FnMut(&str),
    ) -> Result<Vec<u32>, SampleError> {
        let context = match self.end_of_example {
            Some(_) => self.vocab.encode_prompt(prompt, "the prompt")?,
            None => self.vocab.encode(prompt, "the prompt")?,
        };
        self.continue_ids(context, tokens, how, emit)
    }

    /// A user's `message` as a prompt: the conversation `[{"role": "user", "content":
    /// message}]` rendered through the job's chat template with its generation prompt, and
    /// its ids (encoded without adding special tokens, as `apply_chat_template` does), for
    /// [`Generator::continue_ids`], which stops at the end-of-turn token (the data's end of
    /// example).
    pub fn chat_prompt(&self, message: &str) -> Result<(String, Vec<u32>), SampleError> {
        let Some(template) = &self.chat_template else {
            return Err(SampleError::Usage(
                "--chat renders the message through the job's chat template, and this job has \
                 none (no chat_template.jinja or tokenizer_config.json chat_template with its \
                 tokenizer, no data.chat_template): use --prompt"
                    .into(),
            ));
        };
        let messages = [serde_json::json!({"role": "user", "content": message})];
        let text = template
            .render(&messages, true)
            .map_err(SampleError::Usage)?
            .text;
        let ids = self.vocab.encode(&text, "the chat prompt")?;
        Ok((text, ids))
    }

    /// [`Generator::generate`] after the ids of `context`.
    pub fn continue_ids(
        &self,
        mut context: Vec<u32>,
        tokens: usize,
        how: Sampling,
        mut emit: impl FnMut(&str),
    ) -> Result<Vec<u32>, SampleError> {
        if context.is_empty() {
            // nanoGPT's sample.py starts from a newline; else the first symbol.
            context = self.vocab.encode("\n", "").unwrap_or_else(|_| vec![0]);
        }
        let block = self.engine.block_size();
        if context.len() > block {
            context.drain(..context.len() - block);
        }
        let mut rng = Mt19937::new(how.seed);
        let mut cache = KvCache::default();
        let mut logits = self.engine.start(&context, &mut cache)?;
        let mut out = Vec::with_capacity(tokens);
        let mut text = self.vocab.stream();
        // Rows past the vocabulary (a model padded to a round size, as nanoGPT pads GPT-2's
        // 50257 to 50304) stand for no symbol: never drawn.
        let symbols = self.vocab.size();
        for _ in 0..tokens {
            let next = match symbols < logits.dim(0)? {
                true => pick(&logits.narrow(0, 0, symbols)?, how, &mut rng)?,
                false => pick(&logits, how, &mut rng)?,
            };
            if Some(next) == self.end_of_example {
                break;
            }
            out.push(next);
            context.push(next);
            if let Some(piece) = text.push(next) {
                emit(&piece);
            }
            logits = self.engine.advance(&context, &mut cache)?;
        }
        if let Some(rest) = text.finish() {
            emit(&rest);
        }
        Ok(out)
    }
}

/// How next-token logits are computed: with the model's KV cache when it has one, else by its
/// forward pass over the last `block_size` tokens.
struct Engine {
    model: Box<dyn Model>,
    block_size: usize,
}

impl Engine {
    fn block_size(&self) -> usize {
        self.block_size
    }

    /// The logits [vocab] after `context` (at most a window long), the cache filled with it.
    fn start(&self, context: &[u32], cache: &mut KvCache) -> Result<Tensor, SampleError> {
        match self.model.kv_decoder() {
            Some(decoder) => Ok(decoder.forward_cached(context, cache)?),
            None => self.advance(context, cache),
        }
    }

    /// The logits after `context`, whose last token is new since the last call.
    fn advance(&self, context: &[u32], cache: &mut KvCache) -> Result<Tensor, SampleError> {
        let block = self.block_size;
        match self.model.kv_decoder() {
            // The window is full: the last block_size tokens again, from a fresh cache, as
            // nanoGPT's sample.py crops its context (learnt positions cannot slide, so each
            // token past the window costs the window's forward pass, as there).
            Some(decoder) if cache.len() >= block => {
                cache.clear();
                let keep = block.min(context.len());
                Ok(decoder.forward_cached(&context[context.len() - keep..], cache)?)
            }
            Some(decoder) => Ok(decoder.forward_cached(&context[context.len() - 1..], cache)?),
            None => {
                let window = &context[context.len().saturating_sub(block)..];
                let ids = Tensor::new(window, &Device::Cpu)?.unsqueeze(0)?;
                let logits = self.model.forward(&ids, &Mode::Eval)?;
                Ok(logits.squeeze(0)?.get(window.len() - 1)?)
            }
        }
    }
}

/// How a weights error that is a mismatch with the model (not a damaged file) ends.
pub(crate) const DOES_NOT_FIT: &str = "; the file does not fit this job's model";

/// Sets every parameter of `params` from the `model.safetensors` at `path` (a job's final
/// weights or a checkpoint's), converted to the parameter's dtype and device.
pub(crate) fn load_weights(params: &Params, path: &Path) -> Result<(), SampleError> {
    let fail = |cause| SampleError::Weights {
        path: path.to_path_buf(),
        cause,
    };
    let saved = candle_core::safetensors::load(path, &Device::Cpu).map_err(fail)?;
    let base = crate::checkpoint::base::of_weights(path);
    crate::checkpoint::base::set_from(params, &saved, base.as_deref())
        .map_err(|problem| fail(candle_core::Error::Msg(format!("{problem}{DOES_NOT_FIT}"))))
}

/// Whether a model for the weights at `path` is built blank (they replace every weight) or
/// over its base (a checkpoint of what trains only: see `checkpoint::base`).
pub(crate) fn restoring(path: &Path) -> bool {
    crate::checkpoint::base::of_weights(path).is_none()
}

/// The file holding the weights `checkpoint` names (see [`Checkpoints::weights`]).
pub(crate) fn weights_path(job: &JobDir, checkpoint: Option<&str>) -> Result<PathBuf, SampleError> {
    Checkpoints::of(job)
        .weights(checkpoint)
        .map_err(SampleError::Usage)
}

/// Draws the next token from `logits` [vocab].
fn pick(logits: &Tensor, how: Sampling, rng: &mut Mt19937) -> Result<u32, SampleError> {
    let logits: Vec<f32> = logits.to_dtype(DType::F32)?.to_vec1()?;
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 { (i, v) } else { best }
            })
            .0 as u32
    };
    if how.temperature <= 0.0 {
        return Ok(argmax());
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    order.truncate(how.top_k.unwrap_or(order.len()).max(1));
    let top = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - top) / how.temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut r = rng.next_f32() as f64 * total;
    for (&i, w) in order.iter().zip(&weights) {
        if r < *w {
            return Ok(i as u32);
        }
        r -= w;
    }
    Ok(order[order.len() - 1] as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{Gpt, GptConfig};

    /// A gpt that does not offer its KV cache.
    struct Uncached(Gpt);

    impl Model for Uncached {
        fn forward(&self, xs: &Tensor, mode: &Mode) -> candle_core::Result<Tensor> {
            self.0.forward(xs, mode)
        }

        fn params(&self) -> &Params {
            self.0.params()
        }
    }

    #[test]
    fn the_cached_engine_gives_the_windowed_engines_logits_within_and_past_the_window() {
        let config = GptConfig {
            vocab_size: 13,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            dropout: 0.0,
            bias: true,
            activation: crate::models::GptActivation::GeluNew,
        };
        let gpt = |seed| Gpt::new(&config, seed, &Device::Cpu, DType::F32).unwrap();
        let cached = Engine {
            model: Box::new(gpt(4)),
            block_size: 8,
        };
        let windowed = Engine {
            model: Box::new(Uncached(gpt(4))),
            block_size: 8,
        };
        let other = Engine {
            model: Box::new(Uncached(gpt(5))),
            block_size: 8,
        };
        let (mut a, mut b, mut c) = Default::default();
        let mut context = vec![3u32, 1, 4];
        let diff = |x: &Tensor, y: &Tensor| {
            let d = (x - y).unwrap().abs().unwrap().max(0).unwrap();
            d.to_scalar::<f32>().unwrap()
        };
        let (x, y) = (
            cached.start(&context, &mut a).unwrap(),
            windowed.start(&context, &mut b).unwrap(),
        );
        assert_eq!(x.dims(), [13]);
        assert!(diff(&x, &y) < 1e-5);
        assert!(diff(&x, &other.start(&context, &mut c).unwrap()) > 1e-4);
        // Past block_size 8 too: both see the last 8 tokens, however long the text.
        for next in [1u32, 5, 9, 2, 6, 7, 0, 12, 3, 8, 4, 11] {
            context.push(next);
            let (x, y) = (
                cached.advance(&context, &mut a).unwrap(),
                windowed.advance(&context, &mut b).unwrap(),
            );
            assert!(diff(&x, &y) < 1e-5, "after {} tokens", context.len());
        }
    }

    #[test]
    fn picking_follows_temperature_and_top_k() {
        let logits = Tensor::new(&[0.0f32, 3.0, 1.0, 2.9], &Device::Cpu).unwrap();
        let mut rng = Mt19937::new(1);
        let greedy = Sampling {
            temperature: 0.0,
            top_k: None,
            seed: 1,
        };
        assert_eq!(pick(&logits, greedy, &mut rng).unwrap(), 1);
        let top2 = Sampling {
            temperature: 1.0,
            top_k: Some(2),
            seed: 1,
        };
        let draws: Vec<u32> = (0..200)
            .map(|_| pick(&logits, top2, &mut rng).unwrap())
            .collect();
        assert!(draws.iter().all(|&d| d == 1 || d == 3));
        assert!(draws.contains(&1) && draws.contains(&3));
        let mut a = Mt19937::new(7);
        let mut b = Mt19937::new(7);
        for _ in 0..20 {
            assert_eq!(
                pick(&logits, top2, &mut a).unwrap(),
                pick(&logits, top2, &mut b).unwrap()
            );
        }
    }
}
