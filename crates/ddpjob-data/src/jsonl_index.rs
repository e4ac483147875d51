//! Reading instruction data: a JSONL file streamed once, line by line (never held whole), each
//! example tokenised with its prompt and completion apart, so the boundary between them is
//! exact, and kept as token ids with the length of its prompt. The result is stored in the job
//! directory (`jsonl-train.bin`, `jsonl-val.bin`): every worker, `resume` and `eval` read the
//! examples exactly as the job first made them, without the tokenizer, whatever happened to
//! the file since.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::DataError;
use super::hf_tokenizer::HfTokenizer;

/// How lines become examples.
pub struct Indexing<'a> {
    pub tokenizer: &'a HfTokenizer,
    /// Appended to every example (the model learns where a completion ends).
    pub eos: u32,
    pub text_field: &'a str,
    pub prompt_field: &'a str,
    pub completion_field: &'a str,
    /// The most tokens an example may have: `block_size + 1` (its inputs and targets).
    pub max_tokens: usize,
    /// Cut longer examples to `max_tokens` (counted) instead of refusing them.
    pub truncate: bool,
    /// Count and skip lines that are not JSON or lack the fields, instead of refusing them.
    pub skip_bad_lines: bool,
    /// The loss is on prompts too (else an example whose completion truncation cut away has
    /// nothing to predict).
    pub train_on_prompt: bool,
}

/// What indexing met besides the examples, for the log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub bad_lines: usize,
    pub truncated: usize,
    /// Examples with nothing to predict (fewer than two tokens, or, with the loss on
    /// completions only, a prompt that fills `max_tokens`), left out.
    pub empty: usize,
}

/// One split's examples: all tokens flat, where each ends, and how many of its leading tokens
/// are its prompt's.
#[derive(Debug, Default)]
pub struct Examples {
    tokens: TokenStore,
    ends: Vec<usize>,
    prompts: Vec<u32>,
    pub counts: Counts,
}

impl PartialEq for Examples {
    fn eq(&self, other: &Self) -> bool {
        self.tokens() == other.tokens()
            && (&self.ends, &self.prompts, self.counts)
                == (&other.ends, &other.prompts, other.counts)
    }
}

/// The flat tokens: made here while indexing, or mapped from the job's stored file (a large
/// corpus is then never copied into each worker's memory; the workers share the page cache).
#[derive(Debug)]
enum TokenStore {
    Owned(Vec<u32>),
    Mapped {
        map: memmap2::Mmap,
        start: usize,
        len: usize,
    },
}

impl Default for TokenStore {
    fn default() -> Self {
        TokenStore::Owned(Vec::new())
    }
}

impl TokenStore {
    fn as_slice(&self) -> &[u32] {
        match self {
            TokenStore::Owned(v) => v,
            TokenStore::Mapped { map, start, len } => {
                bytemuck::cast_slice(&map[*start..*start + 4 * *len])
            }
        }
    }

    /// The tokens to add to, while indexing.
    fn owned(&mut self) -> &mut Vec<u32> {
        if let TokenStore::Mapped { .. } = self {
            *self = TokenStore::Owned(self.as_slice().to_vec());
        }
        match self {
            TokenStore::Owned(v) => v,
            TokenStore::Mapped { .. } => unreachable!("made owned above"),
        }
    }
}

/// The stored form's first bytes, and its version.
const MAGIC: &[u8; 8] = b"DDPJSONL";
const VERSION: u32 = 1;

impl Examples {
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Example `i`'s tokens and its prompt's length.
    pub fn get(&self, i: usize) -> (&[u32], usize) {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        (
            &self.tokens()[start..self.ends[i]],
            self.prompts[i] as usize,
        )
    }

    /// Whether any example has a prompt (else all are plain text, scored whole).
    pub fn has_prompts(&self) -> bool {
        self.prompts.iter().any(|&p| p > 0)
    }

    /// All tokens (for range checks against the model).
    pub fn tokens(&self) -> &[u32] {
        self.tokens.as_slice()
    }

    fn push(&mut self, tokens: &[u32], prompt: usize) {
        let all = self.tokens.owned();
        all.extend_from_slice(tokens);
        self.ends.push(all.len());
        self.prompts.push(prompt as u32);
    }

    /// Its last `n` examples, taken off (a validation split made from the training file).
    pub fn split_off_last(&mut self, n: usize) -> Examples {
        let keep = self.len() - n;
        let cut = if keep == 0 { 0 } else { self.ends[keep - 1] };
        Examples {
            tokens: TokenStore::Owned(self.tokens.owned().split_off(cut)),
            ends: self.ends.split_off(keep).iter().map(|e| e - cut).collect(),
            prompts: self.prompts.split_off(keep),
            counts: Counts::default(),
        }
    }

    /// The stored form: magic, version, the end-of-sequence id, counts, then per example its
    /// length and prompt length, then the tokens; little-endian u32 throughout.
    pub fn to_bytes(&self, eos: u32) -> Vec<u8> {
        let c = self.counts;
        let mut out = MAGIC.to_vec();
        let header = [
            VERSION,
            eos,
            self.len() as u32,
            self.tokens().len() as u32,
            c.bad_lines as u32,
            c.truncated as u32,
            c.empty as u32,
        ];
        let lens = (0..self.len()).flat_map(|i| {
            let (tokens, prompt) = self.get(i);
            [tokens.len() as u32, prompt as u32]
        });
        for v in header
            .into_iter()
            .chain(lens)
            .chain(self.tokens().iter().copied())
        {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// Maps what [`Examples::to_bytes`] wrote to `path`: the examples (their tokens read in
    /// place) and the end-of-sequence id.
    pub fn open(path: &Path) -> Result<(Examples, u32), DataError> {
        let io = |cause| DataError::Io {
            path: path.into(),
            cause,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the job's own file, written once when the job began and never again; like
        // every reader of memory-mapped data, a run assumes nobody truncates it meanwhile.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let corrupt = |problem: &str| DataError::Corrupt {
            path: path.into(),
            problem: format!("{problem}; delete the job and run it again"),
        };
        if !map.starts_with(MAGIC) {
            return Err(corrupt("it is not ddpjob's stored instruction data"));
        }
        if map.len() % 4 != 0 || map.len() < MAGIC.len() + 7 * 4 {
            return Err(corrupt(
                "it is cut short, or its length does not match its header",
            ));
        }
        // The map starts on a page, so its words past the 8-byte magic are aligned.
        let words: &[u32] = bytemuck::cast_slice(&map[MAGIC.len()..]);
        let [version, eos, n, total, bad_lines, truncated, empty] = match words.get(..7) {
            Some(&[a, b, c, d, e, f, g]) => [a, b, c, d, e, f, g],
            _ => return Err(corrupt("it is cut short")),
        };
        if version != VERSION {
            return Err(corrupt(&format!(
                "format {version}, this ddpjob reads {VERSION}"
            )));
        }
        let (n, total) = (n as usize, total as usize);
        if words.len() != 7 + 2 * n + total {
            return Err(corrupt("its length does not match its header"));
        }
        let mut examples = Examples {
            counts: Counts {
                bad_lines: bad_lines as usize,
                truncated: truncated as usize,
                empty: empty as usize,
            },
            ..Examples::default()
        };
        let mut end = 0;
        for pair in words[7..7 + 2 * n].chunks_exact(2) {
            // As written: at least two tokens, a prompt no longer than its example.
            if pair[0] < 2 || pair[1] > pair[0] {
                return Err(corrupt(&format!(
                    "example {} has {} tokens and a prompt of {}",
                    examples.ends.len(),
                    pair[0],
                    pair[1]
                )));
            }
            end += pair[0] as usize;
            examples.ends.push(end);
            examples.prompts.push(pair[1]);
        }
        if end != total {
            return Err(corrupt("its examples' lengths do not add up to its tokens"));
        }
        let start = MAGIC.len() + 4 * (7 + 2 * n);
        examples.tokens = TokenStore::Mapped {
            map,
            start,
            len: total,
        };
        Ok((examples, eos))
    }
}

/// Streams `path` once, one example a line (blank lines skipped): `{"text": ...}` is trained
/// on whole, `{"prompt": ..., "completion": ...}` keeps its prompt's length for the loss mask.
/// Each example is the tokenizer's encoding of the text or prompt (with the special tokens its
/// template adds, e.g. a Llama's `<s>`), then of the completion, then `eos`.
pub fn index_file(path: &Path, how: &Indexing) -> Result<Examples, DataError> {
    let io = |cause| DataError::Io {
        path: path.into(),
        cause,
    };
    let mut reader = BufReader::new(std::fs::File::open(path).map_err(io)?);
    let mut examples = Examples::default();
    let (mut bytes, mut number) = (Vec::new(), 0);
    loop {
        bytes.clear();
        if reader.read_until(b'\n', &mut bytes).map_err(io)? == 0 {
            break;
        }
        number += 1;
        // A byte-order mark (Windows editors write one) is not part of the first line.
        let text = match bytes.strip_prefix(b"\xEF\xBB\xBF") {
            Some(rest) if number == 1 => rest,
            _ => &bytes[..],
        };
        // Line by line, so bad bytes are a bad line: named, or skipped with skip_bad_lines.
        let line = match std::str::from_utf8(text) {
            Ok(line) => line,
            Err(e) => {
                let problem = format!(
                    "it is not UTF-8 text (a byte that UTF-8 does not allow at byte {} of the \
                     line)",
                    e.valid_up_to() + 1
                );
                if how.skip_bad_lines {
                    examples.counts.bad_lines += 1;
                    continue;
                }
                return Err(bad_line(
                    path,
                    number,
                    &problem,
                    "; save the file as UTF-8, or set data.skip_bad_lines = true to count and \
                     skip such lines",
                ));
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        match example(line, how) {
            Ok((mut tokens, prompt)) => {
                if tokens.len() > how.max_tokens {
                    if !how.truncate {
                        return Err(bad_line(
                            path,
                            number,
                            &format!(
                                "the example has {} tokens, more than model.block_size + 1 = {}; \
                                 set data.truncate = true to cut such examples, or raise \
                                 model.block_size",
                                tokens.len(),
                                how.max_tokens
                            ),
                            "",
                        ));
                    }
                    tokens.truncate(how.max_tokens);
                    examples.counts.truncated += 1;
                }
                // A target is a token after the first; with the loss on completions only, a
                // token past the prompt. An example without one would score nothing.
                let first_target = if how.train_on_prompt {
                    1
                } else {
                    prompt.max(1)
                };
                if tokens.len() < 2 || first_target >= tokens.len() {
                    examples.counts.empty += 1;
                    continue;
                }
                examples.push(&tokens, prompt.min(tokens.len()));
            }
            Err(_) if how.skip_bad_lines => examples.counts.bad_lines += 1,
            Err(problem) => {
                return Err(bad_line(
                    path,
                    number,
                    &problem,
                    "; fix the line, or set data.skip_bad_lines = true to count and skip such lines",
                ));
            }
        }
    }
    Ok(examples)
}

fn bad_line(path: &Path, number: usize, problem: &str, fix: &str) -> DataError {
    DataError::Mismatch(format!(
        "`{}` line {number}: {problem}{fix}",
        PathBuf::from(path).display()
    ))
}

/// One line's tokens and its prompt's length, or what is wrong with it.
fn example(line: &str, how: &Indexing) -> Result<(Vec<u32>, usize), String> {
    let value: Value =
        serde_json::from_str(line).map_err(|e| format!("it is not a JSON object ({e})"))?;
    let Value::Object(object) = &value else {
        return Err("it is not a JSON object".into());
    };
    let field = |name: &str| -> Result<Option<&str>, String> {
        match object.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(format!("field \"{name}\" is not a string but {other}")),
        }
    };
    let encode = |text: &str, special: bool| how.tokenizer.encode_one(text, special);
    let (mut tokens, prompt) = match field(how.completion_field)? {
        Some(completion) => {
            let Some(prompt) = field(how.prompt_field)? else {
                return Err(format!(
                    "it has \"{}\" but no \"{}\" (data.prompt_field)",
                    how.completion_field, how.prompt_field
                ));
            };
            let mut tokens = encode(prompt, true)?;
            let prompt = tokens.len();
            tokens.extend(encode(completion, false)?);
            (tokens, prompt)
        }
        None => match field(how.text_field)? {
            Some(text) => (encode(text, true)?, 0),
            None => {
                let keys: Vec<&str> = object.keys().map(String::as_str).collect();
                return Err(format!(
                    "it has neither \"{}\" (data.text_field) nor \"{}\" and \"{}\" \
                     (data.prompt_field, data.completion_field); its fields: {}",
                    how.text_field,
                    how.prompt_field,
                    how.completion_field,
                    keys.join(", ")
                ));
            }
        },
    };
    tokens.push(how.eos);
    Ok((tokens, prompt))
}
