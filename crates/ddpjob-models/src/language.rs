//! What a language model's options declare so the text data can feed it: its window, its
//! vocabulary, and the tokenizer and vocabulary its pretrained weights came with.

use ddpjob_seam::{BuildError, ModelContext, ModelInput};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// The options of a model that learns from token windows: registered with
/// `Registry::language_model` (in `ddpjob`), it trains on the built-in `text`, `tokens` and
/// `jsonl` data, which cut windows of its `block_size` and tokenise with its tokenizer unless
/// the job names another.
pub trait LanguageModelOptions: DeserializeOwned + Serialize + 'static {
    /// The options with what they leave to be derived filled in (sizes read from a pretrained
    /// checkpoint's config, defaults), or why that fails: `job.toml` holds the result, so a
    /// resumed job builds the same model.
    fn complete(self) -> Result<Self, String> {
        Ok(self)
    }
    /// Tokens per window.
    fn block_size(&self) -> usize;
    /// The vocabulary size, when the model fixes it (`None`: the data's).
    fn vocab_size(&self) -> Option<usize>;
    /// The checkpoint the weights start from: a Hugging Face directory, another job, or a
    /// checkpoint of one (`model.init_from`). Its tokenizer and vocabulary are the defaults of
    /// [`Self::tokenizer`] and [`Self::vocabulary`].
    fn init_from(&self) -> Option<&str> {
        None
    }
    /// A `tokenizer.json` that comes with the model (a pretrained checkpoint's).
    fn tokenizer(&self) -> Option<std::path::PathBuf> {
        pretrained_tokenizer(self.init_from()?)
    }
    /// A ddpjob `vocab.json` the weights were trained with (another job's, when the model
    /// starts from it): text is encoded with it rather than with a vocabulary of its own.
    fn vocabulary(&self) -> Option<std::path::PathBuf> {
        pretrained_vocabulary(self.init_from()?)
    }
    /// Whether the model reads packed rows (`data.pack = true`): inputs [n, t, 2] of each
    /// position's token id and its position within its example, positions restarting and
    /// attention stopping where an example starts (see `ddpjob_models::packed`). `false`
    /// (the default): `data.pack` is refused for it.
    fn reads_packed_rows(&self) -> bool {
        false
    }
}

/// The tokenizer that comes with the weights `init_from` names: another job's (the one it
/// trained with), or a Hugging Face directory's `tokenizer.json`, named even when the
/// directory lacks one (its token ids are that tokenizer's all the same; the data says so).
pub fn pretrained_tokenizer(init_from: &str) -> Option<std::path::PathBuf> {
    let dir = std::path::Path::new(init_from);
    match ddpjob_storage::checkpoint::Trained::find(dir) {
        Some(trained) => trained.ok()?.tokenizer(),
        None => Some(dir.join("tokenizer.json")).filter(|_| dir.join("config.json").is_file()),
    }
}

/// The ddpjob `vocab.json` of the job whose weights `init_from` names, if it has one.
pub fn pretrained_vocabulary(init_from: &str) -> Option<std::path::PathBuf> {
    ddpjob_storage::checkpoint::Trained::find(std::path::Path::new(init_from))?
        .ok()?
        .vocabulary()
}

/// (vocab_size, block_size) of a language model's input.
pub fn token_windows(arch: &str, cx: &ModelContext) -> Result<(usize, usize), BuildError> {
    match cx.input {
        ModelInput::Tokens {
            vocab_size,
            block_size,
        } => Ok((vocab_size, block_size)),
        other => {
            Err(format!("model.arch = \"{arch}\" learns from token windows, not {other:?}").into())
        }
    }
}
