//! Instruction examples as the job keeps them: all tokens flat, where each example ends, and
//! which of its tokens are trained (ranges of token indices: a prompt/completion's completion,
//! a conversation's assistant turns, a text example whole). Stored once in the job directory
//! (`jsonl-train.bin`, `jsonl-val.bin`) and memory-mapped back, so every worker, `resume` and
//! `eval` read the examples exactly as the job first made them. It knows nothing of files,
//! tokenizers or templates (see `jsonl_index` and `chat`).

use std::ops::Range;
use std::path::Path;

use super::DataError;

/// What indexing met besides the examples, for the log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub bad_lines: usize,
    pub truncated: usize,
    /// Examples with nothing to predict (fewer than two tokens, or no trained token after the
    /// first: a prompt that fills `max_tokens`, a conversation whose template marks no
    /// assistant token), left out.
    pub empty: usize,
}

/// One split's examples.
#[derive(Debug, Default)]
pub struct Examples {
    tokens: TokenStore,
    ends: Vec<usize>,
    /// Trained token ranges, [start, end) within their example, in order.
    spans: Vec<[u32; 2]>,
    /// Where each example's spans end in `spans`.
    span_ends: Vec<usize>,
    /// Tokens taken out already (written to a file as they were made, see
    /// [`Examples::take_tokens`]): `ends` count from the first example's start all the same.
    base: usize,
    pub counts: Counts,
}

impl PartialEq for Examples {
    fn eq(&self, other: &Self) -> bool {
        self.tokens() == other.tokens()
            && (&self.ends, &self.spans, &self.span_ends, self.counts)
                == (&other.ends, &other.spans, &other.span_ends, other.counts)
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

/// The stored form's first bytes, and its version (1: one prompt length per example; 2:
/// trained spans).
const MAGIC: &[u8; 8] = b"DDPJSONL";
const VERSION: u32 = 2;
const HEADER_WORDS: usize = 8;

impl Examples {
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Example `i`'s tokens and its trained spans.
    pub fn get(&self, i: usize) -> (&[u32], &[[u32; 2]]) {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        let first = if i == 0 { 0 } else { self.span_ends[i - 1] };
        (
            &self.tokens()[start..self.ends[i]],
            &self.spans[first..self.span_ends[i]],
        )
    }

    /// Whether any example has tokens it does not train on (else all are plain text, scored
    /// whole).
    pub fn has_prompts(&self) -> bool {
        (0..self.len()).any(|i| {
            let (tokens, spans) = self.get(i);
            spans != [[0, tokens.len() as u32]]
        })
    }

    /// All tokens (for range checks against the model).
    pub fn tokens(&self) -> &[u32] {
        self.tokens.as_slice()
    }

    /// The tokens made so far, taken (to be written as they are made); the examples' layout
    /// stays (their lengths and trained spans), so the stored form can be written around the
    /// tokens afterwards ([`Examples::write_layout`]).
    pub fn take_tokens(&mut self) -> Vec<u32> {
        let tokens = std::mem::take(self.tokens.owned());
        self.base += tokens.len();
        tokens
    }

    /// The tokens of all its examples, those taken out included.
    pub fn token_count(&self) -> usize {
        self.ends.last().copied().unwrap_or(0)
    }

    /// [`Examples::split_off_last`] of examples whose tokens were all taken out: the last `n`
    /// examples' layout, and the token where they start (to cut the tokens' file there).
    pub fn split_off_last_layout(&mut self, n: usize) -> (Examples, usize) {
        assert!(self.tokens().is_empty(), "the tokens were taken out");
        let keep = self.len() - n;
        let cut = if keep == 0 { 0 } else { self.ends[keep - 1] };
        let spans_cut = if keep == 0 {
            0
        } else {
            self.span_ends[keep - 1]
        };
        let val = Examples {
            ends: self.ends.split_off(keep).iter().map(|e| e - cut).collect(),
            spans: self.spans.split_off(spans_cut),
            span_ends: (self.span_ends.split_off(keep).iter())
                .map(|e| e - spans_cut)
                .collect(),
            ..Examples::default()
        };
        (val, cut)
    }

    /// All tokens, end to end, taken, with the examples they made: only the counts stay.
    pub fn drain_tokens(&mut self) -> Vec<u32> {
        self.ends.clear();
        self.spans.clear();
        self.span_ends.clear();
        std::mem::take(self.tokens.owned())
    }

    /// Adds an example: `tokens` and its trained `spans` (in order, within it).
    pub fn push(&mut self, tokens: &[u32], spans: &[Range<usize>]) {
        let all = self.tokens.owned();
        all.extend_from_slice(tokens);
        self.ends.push(self.base + all.len());
        let clipped = spans.iter().map(|s| s.start..s.end.min(tokens.len()));
        let kept = clipped.filter(|s| s.start < s.end);
        self.spans
            .extend(kept.map(|s| [s.start as u32, s.end as u32]));
        self.span_ends.push(self.spans.len());
    }

    /// Its last `n` examples, taken off (a validation split made from the training file).
    pub fn split_off_last(&mut self, n: usize) -> Examples {
        let keep = self.len() - n;
        let cut = if keep == 0 { 0 } else { self.ends[keep - 1] };
        let spans_cut = if keep == 0 {
            0
        } else {
            self.span_ends[keep - 1]
        };
        Examples {
            tokens: TokenStore::Owned(self.tokens.owned().split_off(cut)),
            ends: self.ends.split_off(keep).iter().map(|e| e - cut).collect(),
            spans: self.spans.split_off(spans_cut),
            span_ends: (self.span_ends.split_off(keep).iter())
                .map(|e| e - spans_cut)
                .collect(),
            base: 0,
            counts: Counts::default(),
        }
    }

    /// The stored form up to its tokens, which follow it (written elsewhere as they were made,
    /// then appended): magic, version, the end-of-sequence id, counts, then per example its
    /// length and number of spans, then the spans' [start, end), then the tokens; little-endian
    /// u32 throughout.
    pub fn write_layout(&self, out: &mut impl std::io::Write, eos: u32) -> std::io::Result<()> {
        let c = self.counts;
        out.write_all(MAGIC)?;
        let header = [
            VERSION,
            eos,
            self.len() as u32,
            self.token_count() as u32,
            c.bad_lines as u32,
            c.truncated as u32,
            c.empty as u32,
            self.spans.len() as u32,
        ];
        let lens = (0..self.len()).flat_map(|i| {
            let start = if i == 0 { 0 } else { self.ends[i - 1] };
            let first = if i == 0 { 0 } else { self.span_ends[i - 1] };
            [
                (self.ends[i] - start) as u32,
                (self.span_ends[i] - first) as u32,
            ]
        });
        let spans = self.spans.iter().flatten().copied();
        for v in header.into_iter().chain(lens).chain(spans) {
            out.write_all(&v.to_le_bytes())?;
        }
        Ok(())
    }

    /// Maps what [`Examples::write_layout`] wrote to `path` (or the version before it, one prompt
    /// length per example): the examples (their tokens read in place) and the
    /// end-of-sequence id.
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
        let version = words[0];
        let header = match version {
            1 => 7,
            VERSION => HEADER_WORDS,
            _ => {
                return Err(corrupt(&format!(
                    "format {version}, this ddpjob reads 1 and {VERSION}"
                )));
            }
        };
        let Some(h) = words.get(..header) else {
            return Err(corrupt("it is cut short"));
        };
        let (eos, n, total) = (h[1], h[2] as usize, h[3] as usize);
        let span_words = if version == 1 { 0 } else { 2 * h[7] as usize };
        if words.len() != header + 2 * n + span_words + total {
            return Err(corrupt("its length does not match its header"));
        }
        let mut examples = Examples {
            counts: Counts {
                bad_lines: h[4] as usize,
                truncated: h[5] as usize,
                empty: h[6] as usize,
            },
            ..Examples::default()
        };
        let stored_spans = &words[header + 2 * n..header + 2 * n + span_words];
        let (mut end, mut next_span) = (0, 0);
        for (i, pair) in words[header..header + 2 * n].chunks_exact(2).enumerate() {
            let len = pair[0];
            let spans: Vec<[u32; 2]> = match version {
                // Version 1: the prompt's length; the rest trained.
                1 => vec![[pair[1], len]],
                _ => {
                    let count = pair[1] as usize;
                    let Some(these) = stored_spans.get(2 * next_span..2 * (next_span + count))
                    else {
                        return Err(corrupt(&format!(
                            "example {i} has {count} trained spans, more than the file holds"
                        )));
                    };
                    next_span += count;
                    these.chunks_exact(2).map(|s| [s[0], s[1]]).collect()
                }
            };
            // As written: at least two tokens, spans in order within the example.
            let ordered = spans.iter().all(|s| s[0] <= s[1] && s[1] <= len)
                && spans.windows(2).all(|w| w[0][1] <= w[1][0]);
            if len < 2 || !ordered {
                return Err(corrupt(&format!(
                    "example {i} has {len} tokens and trained spans {spans:?}"
                )));
            }
            end += len as usize;
            examples.ends.push(end);
            examples.spans.extend(spans);
            examples.span_ends.push(examples.spans.len());
        }
        if end != total {
            return Err(corrupt("its examples' lengths do not add up to its tokens"));
        }
        let start = MAGIC.len() + 4 * (header + 2 * n + span_words);
        examples.tokens = TokenStore::Mapped {
            map,
            start,
            len: total,
        };
        Ok((examples, eos))
    }
}
