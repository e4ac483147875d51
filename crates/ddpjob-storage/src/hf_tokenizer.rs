//! Hugging Face tokenizers for `text` data (`data.tokenizer = "path/to/tokenizer.json"`):
//! GPT-2's byte-level BPE, WordPiece, Unigram..., through the `tokenizers` crate. The whole
//! definition is kept in the job's `vocab.json`, so `sample` and `resume` encode and decode as
//! training did even when the original file has moved or changed.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use ddpjob_seam::DataError;

/// A text is encoded in pieces of at least this many bytes, each ending at a line end, side
/// by side (a corpus of many MB would otherwise be one long sequential pass).
const PIECE_BYTES: usize = 1 << 20;

/// Each token's byte range in the text it was encoded from.
pub type Offsets = Vec<(usize, usize)>;

/// A loaded tokenizer and the JSON it was loaded from.
#[derive(Clone, Serialize, Deserialize)]
#[serde(try_from = "Stored", into = "Stored")]
pub struct HfTokenizer {
    definition: serde_json::Value,
    tokenizer: Tokenizer,
}

/// How `vocab.json` holds one: `{"tokenizer": "huggingface", "definition": {...}}`.
#[derive(Serialize, Deserialize)]
struct Stored {
    definition: serde_json::Value,
}

impl TryFrom<Stored> for HfTokenizer {
    type Error = String;

    fn try_from(stored: Stored) -> Result<Self, String> {
        HfTokenizer::from_definition(stored.definition)
    }
}

impl From<HfTokenizer> for Stored {
    fn from(t: HfTokenizer) -> Stored {
        Stored {
            definition: t.definition,
        }
    }
}

impl PartialEq for HfTokenizer {
    fn eq(&self, other: &Self) -> bool {
        self.definition == other.definition
    }
}

impl Eq for HfTokenizer {}

impl fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HfTokenizer({} tokens)", self.size())
    }
}

impl HfTokenizer {
    /// Reads a `tokenizer.json` as the `tokenizers` library saves it.
    pub fn load(path: &Path) -> Result<HfTokenizer, DataError> {
        let text = std::fs::read_to_string(path).map_err(|cause| DataError::Io {
            path: path.into(),
            cause,
        })?;
        let corrupt = |problem: String| DataError::Corrupt {
            path: path.into(),
            problem,
        };
        let definition = serde_json::from_str(&text).map_err(|e| {
            corrupt(format!(
                "it is not JSON ({e}); data.tokenizer needs a file \
                                          saved by the tokenizers library (tokenizer.json)"
            ))
        })?;
        HfTokenizer::from_definition(definition).map_err(corrupt)
    }

    fn from_definition(definition: serde_json::Value) -> Result<HfTokenizer, String> {
        let tokenizer = serde_json::from_value(definition.clone()).map_err(|e| {
            format!(
                "it is not a Hugging Face tokenizer ({e}); use a tokenizer.json saved by the \
                 tokenizers library (`Tokenizer.save`, or a model repository's tokenizer.json)"
            )
        })?;
        Ok(HfTokenizer {
            definition,
            tokenizer,
        })
    }

    /// Token ids in use, added tokens included.
    pub fn size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The ids of `text` (no special tokens added); `what` names the text in errors.
    pub fn encode(&self, text: &str, what: &str) -> Result<Vec<u32>, DataError> {
        let encodings = self
            .tokenizer
            .encode_batch_fast(pieces(text, PIECE_BYTES), false)
            .map_err(|e| {
                DataError::Mismatch(format!("{what}: the tokenizer cannot encode it: {e}"))
            })?;
        Ok(encodings
            .iter()
            .flat_map(|e| e.get_ids().iter().copied())
            .collect())
    }

    /// The ids of one short `text` (an example's prompt or completion), with the special
    /// tokens the tokenizer's template adds (a Llama's `<s>`) when `special`.
    pub fn encode_one(&self, text: &str, special: bool) -> Result<Vec<u32>, String> {
        let encoding = self
            .tokenizer
            .encode_fast(text, special)
            .map_err(|e| format!("the tokenizer cannot encode it: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The ids of `text` (no special tokens added: a rendered chat template writes its own)
    /// and each token's byte range in it.
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Offsets), String> {
        let encoding = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| format!("the tokenizer cannot encode it: {e}"))?;
        Ok((encoding.get_ids().to_vec(), encoding.get_offsets().to_vec()))
    }

    /// The id of the token written `token` (`</s>`, `<|endoftext|>`), added tokens included.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// The token written for `id`, if the tokenizer has it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }

    /// The text of `ids`, special tokens included; ids the tokenizer does not have are left
    /// out (a model whose `vocab_size` is padded past the tokenizer's can draw them).
    pub fn decode(&self, ids: &[u32]) -> String {
        let size = self.size() as u32;
        let known: Vec<u32> = ids.iter().copied().filter(|&i| i < size).collect();
        self.tokenizer
            .decode(&known, false)
            .unwrap_or_else(|_| "\u{FFFD}".into())
    }
}

/// `text` cut into pieces of at least `size` bytes, each but the last ending after a `\n`.
fn pieces(text: &str, size: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while rest.len() > size {
        let Some(at) = rest.as_bytes()[size..].iter().position(|&b| b == b'\n') else {
            break;
        };
        let (piece, tail) = rest.split_at(size + at + 1);
        out.push(piece);
        rest = tail;
    }
    out.push(rest);
    out
}

/// What the tests of this crate and of `ddpjob` train a tokenizer with; not part of the API.
#[doc(hidden)]
pub mod testing {
    use super::*;
    use tokenizers::AddedToken;
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    /// A byte-level BPE (GPT-2's kind) of about `size` tokens learned from `text`, saved as
    /// `path`.
    pub fn train_bpe(text: &str, size: usize, path: &Path) {
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(size)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
            .build()
            .into();
        let mut tokenizer = Tokenizer::new(BPE::default());
        tokenizer
            .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
            .with_decoder(Some(ByteLevelDecoder::default()));
        let file = path.with_extension("txt");
        std::fs::write(&file, text).unwrap();
        tokenizer
            .train_from_files(&mut trainer, vec![file.display().to_string()])
            .unwrap();
        tokenizer.save(path, false).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::testing::train_bpe;
    use super::*;

    #[test]
    fn pieces_end_at_line_ends_and_cover_the_text() {
        let text = "ab\ncdef\ngh\n\nij";
        let p = pieces(text, 3);
        assert_eq!(p, vec!["ab\ncdef\n", "gh\n\n", "ij"]);
        assert_eq!(p.concat(), text);
        assert_eq!(pieces("no line end at all", 3), vec!["no line end at all"]);
        assert_eq!(pieces("", 3), vec![""]);
    }

    #[test]
    fn a_trained_bpe_round_trips_and_survives_its_json() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let text = "the cat sat on the mat. the dog sat on the log.\n".repeat(20);
        train_bpe(&text, 300, &path);
        let t = HfTokenizer::load(&path).unwrap();
        let ids = t.encode("the cat sat on the log.", "test").unwrap();
        assert!(ids.len() < 10, "BPE merges words: {ids:?}");
        assert_eq!(t.decode(&ids), "the cat sat on the log.");
        // Unicode outside the training text still encodes (byte fallback) and decodes.
        assert_eq!(t.decode(&t.encode("é✓", "x").unwrap()), "é✓");
        // Ids past the tokenizer's (a padded model's) are left out.
        assert_eq!(t.decode(&[ids[0], 60_000]), t.decode(&ids[..1]));
        let json = serde_json::to_string(&t).unwrap();
        let back: HfTokenizer = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
        assert_eq!(
            back.encode("the cat", "x").unwrap(),
            t.encode("the cat", "x").unwrap()
        );
        // Pieces change nothing for a text cut at line ends.
        let whole = t.encode(&text, "x").unwrap();
        let cut: Vec<u32> = pieces(&text, 100)
            .iter()
            .flat_map(|p| t.encode(p, "x").unwrap())
            .collect();
        assert_eq!(whole, cut);
    }

    #[test]
    fn files_that_are_not_tokenizers_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, "{\"model\": 3}").unwrap();
        let err = HfTokenizer::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer.json") && err.contains("not a Hugging Face"),
            "{err}"
        );
        std::fs::write(&path, "merges: oops").unwrap();
        let err = HfTokenizer::load(&path).unwrap_err().to_string();
        assert!(err.contains("not JSON"), "{err}");
        let err = HfTokenizer::load(&dir.path().join("none.json")).unwrap_err();
        assert!(err.to_string().contains("none.json"), "{err}");
    }
}
