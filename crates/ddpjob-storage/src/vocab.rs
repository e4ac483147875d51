//! Vocabularies for `text` data: how text becomes token ids and back (characters, bytes, or a
//! Hugging Face tokenizer). The vocabulary a job trained with is stored in its directory
//! (`vocab.json`), so `sample` and `resume` encode and decode exactly as training did.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::hf_tokenizer::HfTokenizer;
use ddpjob_seam::DataError;
use ddpjob_spec::TokenizerKind;

/// A vocabulary: token id ↔ symbol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "tokenizer", rename_all = "lowercase")]
pub enum Vocab {
    /// The distinct characters of the training text, sorted by code point (nanoGPT's
    /// `sorted(set(text))`): id i is the i-th.
    Char { chars: String },
    /// The 256 byte values: id = byte. Decoding is lossy where a multi-byte character is split.
    Byte,
    /// A Hugging Face tokenizer, its whole `tokenizer.json` kept.
    #[serde(rename = "huggingface")]
    HuggingFace(Box<HfTokenizer>),
}

impl Vocab {
    /// The vocabulary `kind` builds from `text` (a Hugging Face tokenizer is read from its
    /// file instead).
    pub fn build(kind: &TokenizerKind, text: &str) -> Result<Vocab, DataError> {
        Ok(match kind {
            TokenizerKind::Byte => Vocab::Byte,
            TokenizerKind::Char => {
                let mut chars: Vec<char> = text.chars().collect();
                chars.sort_unstable();
                chars.dedup();
                Vocab::Char {
                    chars: chars.into_iter().collect(),
                }
            }
            TokenizerKind::HuggingFace(path) => {
                Vocab::HuggingFace(Box::new(HfTokenizer::load(path)?))
            }
        })
    }

    /// Whether this vocabulary is of the kind `data.tokenizer` names (a Hugging Face one
    /// matches any path: the stored definition is the one that counts).
    pub fn is_kind(&self, kind: &TokenizerKind) -> bool {
        matches!(
            (self, kind),
            (Vocab::Char { .. }, TokenizerKind::Char)
                | (Vocab::Byte, TokenizerKind::Byte)
                | (Vocab::HuggingFace(_), TokenizerKind::HuggingFace(_))
        )
    }

    /// How `data.tokenizer` names this kind of vocabulary.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Vocab::Char { .. } => "\"char\"",
            Vocab::Byte => "\"byte\"",
            Vocab::HuggingFace(_) => "a Hugging Face tokenizer.json",
        }
    }

    pub fn size(&self) -> usize {
        match self {
            Vocab::Char { chars } => chars.chars().count(),
            Vocab::Byte => 256,
            Vocab::HuggingFace(t) => t.size(),
        }
    }

    /// The ids of `text`; a character outside the vocabulary is an error naming it, its position
    /// and `what` the text is (a file, the prompt).
    pub fn encode(&self, text: &str, what: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Vocab::Byte => Ok(text.bytes().map(u32::from).collect()),
            Vocab::HuggingFace(t) => t.encode(text, what),
            Vocab::Char { chars } => {
                let table: Vec<char> = chars.chars().collect();
                let mut ids = Vec::with_capacity(text.len());
                for (at, ch) in text.chars().enumerate() {
                    match table.binary_search(&ch) {
                        Ok(id) => ids.push(id as u32),
                        Err(_) => {
                            return Err(DataError::Mismatch(format!(
                                "{what}: character {ch:?} (U+{:04X}, character {at}) is not in the \
                                 job's vocabulary of {} characters; use only characters of the \
                                 training text",
                                ch as u32,
                                table.len()
                            )));
                        }
                    }
                }
                Ok(ids)
            }
        }
    }

    /// The ids of an example's prompt as an instruction-tuned job encoded its prompts: with the
    /// special tokens a tokenizer's template adds (a Llama's `<s>`); `encode` for the others.
    pub fn encode_prompt(&self, text: &str, what: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Vocab::HuggingFace(t) => t
                .encode_one(text, true)
                .map_err(|e| DataError::Mismatch(format!("{what}: {e}"))),
            _ => self.encode(text, what),
        }
    }

    /// The id of the token written `token` in a tokenizer's vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match self {
            Vocab::HuggingFace(t) => t.token_id(token),
            _ => None,
        }
    }

    /// The text of `ids` (ids outside a character vocabulary become U+FFFD; a tokenizer's
    /// unknown ids are left out).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Vocab::Byte => {
                let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Vocab::HuggingFace(t) => t.decode(ids),
            Vocab::Char { chars } => {
                let table: Vec<char> = chars.chars().collect();
                ids.iter()
                    .map(|&i| table.get(i as usize).copied().unwrap_or('\u{FFFD}'))
                    .collect()
            }
        }
    }

    /// Text of ids as they come, for printing generated tokens one by one.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            vocab: self,
            ids: Vec::new(),
            shown: 0,
        }
    }

    /// The name of a job's vocabulary in its directory.
    pub const FILE: &'static str = "vocab.json";

    /// Where a job keeps its vocabulary.
    pub fn path_in(job_root: &Path) -> PathBuf {
        job_root.join(Self::FILE)
    }

    pub fn load(path: &Path) -> Result<Vocab, DataError> {
        let text = std::fs::read_to_string(path).map_err(|cause| DataError::Io {
            path: path.into(),
            cause,
        })?;
        serde_json::from_str(&text).map_err(|e| DataError::Corrupt {
            path: path.into(),
            problem: format!("not a ddpjob vocabulary: {e}"),
        })
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// Decodes ids one at a time into the text they add. A token's text can depend on the one
/// before it (a tokenizer that drops a word's leading space at the start of a text) and a
/// character can span tokens (bytes), so each step decodes the tokens since the last shown
/// one together with that one, and shows what it adds once it no longer ends in a partial
/// character (or after 4 tokens that never complete one).
pub struct TextStream<'v> {
    vocab: &'v Vocab,
    ids: Vec<u32>,
    /// Ids before this index have been shown.
    shown: usize,
}

impl TextStream<'_> {
    /// The text `id` completes, if any yet.
    pub fn push(&mut self, id: u32) -> Option<String> {
        self.ids.push(id);
        let text = self.added();
        let waiting = self.ids.len() - self.shown;
        if text.ends_with('\u{FFFD}') && waiting < 4 {
            return None;
        }
        self.shown = self.ids.len();
        Some(text)
    }

    /// The text of ids still waiting for the rest of a character.
    pub fn finish(self) -> Option<String> {
        (self.shown < self.ids.len()).then(|| self.added())
    }

    /// The text the ids after `shown` add to the last shown one (their decoding context).
    fn added(&self) -> String {
        let context = self.shown.saturating_sub(1);
        let before = self.vocab.decode(&self.ids[context..self.shown]);
        let now = self.vocab.decode(&self.ids[context..]);
        match now.strip_prefix(before.as_str()) {
            Some(rest) => rest.to_string(),
            // A decoder that rewrites earlier text: show the new tokens on their own.
            None => self.vocab.decode(&self.ids[self.shown..]),
        }
    }
}

/// Reads a text file as UTF-8; anything else is a clear error with the byte offset.
pub fn read_text(path: &Path) -> Result<String, DataError> {
    let bytes = std::fs::read(path).map_err(|cause| DataError::Io {
        path: path.into(),
        cause,
    })?;
    String::from_utf8(bytes).map_err(|e| DataError::Corrupt {
        path: path.into(),
        problem: format!(
            "it is not UTF-8 text (invalid byte at offset {}); convert it to UTF-8, or use \
             data.tokenizer = \"byte\" to train on its raw bytes",
            e.utf8_error().valid_up_to()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_vocabulary_is_sorted_distinct_characters_as_nanogpt() {
        let v = Vocab::build(&TokenizerKind::Char, "hello, wörld\n").unwrap();
        // Python: ''.join(sorted(set("hello, wörld\n"))) == '\n ,dehlorwö'
        assert_eq!(
            v,
            Vocab::Char {
                chars: "\n ,dehlorwö".into()
            }
        );
        let ids = v.encode("wöd", "test").unwrap();
        assert_eq!(ids, vec![9, 10, 3]);
        assert_eq!(v.decode(&ids), "wöd");
        let err = v.encode("hex", "the prompt").unwrap_err().to_string();
        assert!(err.contains("the prompt") && err.contains("'x'"), "{err}");
    }

    #[test]
    fn byte_vocabulary_round_trips_and_saves() {
        let v = Vocab::build(&TokenizerKind::Byte, "").unwrap();
        assert_eq!(v.size(), 256);
        assert_eq!(v.decode(&v.encode("é!", "x").unwrap()), "é!");
        let json = Vocab::build(&TokenizerKind::Char, "ba").unwrap().to_json();
        assert!(json.contains("\"tokenizer\": \"char\""), "{json}");
        let back: Vocab = serde_json::from_str(&json).unwrap();
        assert_eq!(back.size(), 2);
    }

    #[test]
    fn a_stream_shows_whole_characters_as_they_complete() {
        let v = Vocab::Byte;
        let mut s = v.stream();
        let shown: Vec<Option<String>> = "aé!".bytes().map(|b| s.push(b.into())).collect();
        let expect = [Some("a"), None, Some("é"), Some("!")];
        assert_eq!(shown, expect.map(|e| e.map(String::from)));
        assert_eq!(s.finish(), None);
        // Bytes that never make a character are shown after 4 tokens, replaced.
        let mut s = v.stream();
        assert!((0..3).all(|_| s.push(0xC3).is_none()));
        assert_eq!(
            s.push(0xC3).as_deref(),
            Some("\u{FFFD}\u{FFFD}\u{FFFD}\u{FFFD}")
        );
        let mut s = v.stream();
        assert_eq!(s.push(0xE2), None);
        assert_eq!(s.finish().as_deref(), Some("\u{FFFD}"));
    }

    #[test]
    fn a_hugging_face_vocabulary_streams_what_it_decodes_and_is_stored_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let text = "the cat sat on the mat. the dog sat on the log.\n".repeat(20);
        crate::hf_tokenizer::testing::train_bpe(&text, 280, &path);
        let v = Vocab::build(&TokenizerKind::HuggingFace(path.clone()), "").unwrap();
        assert!(v.is_kind(&TokenizerKind::HuggingFace("elsewhere.json".into())));
        assert!(!v.is_kind(&TokenizerKind::Char));
        let ids = v.encode("the dog sat on the mat, é\n", "x").unwrap();
        let mut s = v.stream();
        let mut streamed: String = ids.iter().filter_map(|&i| s.push(i)).collect();
        streamed.extend(s.finish());
        assert_eq!(streamed, "the dog sat on the mat, é\n");
        std::fs::remove_file(&path).unwrap();
        let stored = dir.path().join("vocab.json");
        std::fs::write(&stored, v.to_json()).unwrap();
        let back = Vocab::load(&stored).unwrap();
        assert_eq!(back, v);
        assert_eq!(back.size(), v.size());
        assert!(v.to_json().contains("\"tokenizer\": \"huggingface\""));
    }

    #[test]
    fn non_utf8_text_names_the_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("latin1.txt");
        std::fs::write(&path, b"caf\xe9").unwrap();
        let err = read_text(&path).unwrap_err().to_string();
        assert!(
            err.contains("offset 3") && err.contains("latin1.txt"),
            "{err}"
        );
    }
}
