//! Character and byte vocabularies for `text` data: how text becomes token ids and back. The
//! vocabulary a job trained with is stored in its directory (`vocab.json`), so `sample` and
//! `resume` encode and decode exactly as training did.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::DataError;
use crate::config::TokenizerKind;

/// A vocabulary: token id ↔ symbol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "tokenizer", rename_all = "lowercase")]
pub enum Vocab {
    /// The distinct characters of the training text, sorted by code point (nanoGPT's
    /// `sorted(set(text))`): id i is the i-th.
    Char { chars: String },
    /// The 256 byte values: id = byte. Decoding is lossy where a multi-byte character is split.
    Byte,
}

impl Vocab {
    /// The vocabulary `kind` builds from `text`.
    pub fn build(kind: TokenizerKind, text: &str) -> Vocab {
        match kind {
            TokenizerKind::Byte => Vocab::Byte,
            TokenizerKind::Char => {
                let mut chars: Vec<char> = text.chars().collect();
                chars.sort_unstable();
                chars.dedup();
                Vocab::Char {
                    chars: chars.into_iter().collect(),
                }
            }
        }
    }

    pub fn size(&self) -> usize {
        match self {
            Vocab::Char { chars } => chars.chars().count(),
            Vocab::Byte => 256,
        }
    }

    /// The ids of `text`; a character outside the vocabulary is an error naming it, its position
    /// and `what` the text is (a file, the prompt).
    pub fn encode(&self, text: &str, what: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Vocab::Byte => Ok(text.bytes().map(u32::from).collect()),
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

    /// The text of `ids` (ids outside the vocabulary become U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Vocab::Byte => {
                let bytes: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Vocab::Char { chars } => {
                let table: Vec<char> = chars.chars().collect();
                ids.iter()
                    .map(|&i| table.get(i as usize).copied().unwrap_or('\u{FFFD}'))
                    .collect()
            }
        }
    }

    /// Where a job keeps its vocabulary.
    pub fn path_in(job_root: &Path) -> PathBuf {
        job_root.join("vocab.json")
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
        let v = Vocab::build(TokenizerKind::Char, "hello, wörld\n");
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
        let v = Vocab::build(TokenizerKind::Byte, "");
        assert_eq!(v.size(), 256);
        assert_eq!(v.decode(&v.encode("é!", "x").unwrap()), "é!");
        let json = Vocab::build(TokenizerKind::Char, "ba").to_json();
        assert!(json.contains("\"tokenizer\": \"char\""), "{json}");
        let back: Vocab = serde_json::from_str(&json).unwrap();
        assert_eq!(back.size(), 2);
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
