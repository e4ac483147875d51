//! Records (a file's lines, a parquet file's rows) made examples a chunk at a time on every
//! core (rayon's pool: tokenising and rendering templates are independent per record), then
//! added in file order, so the examples, the counts and the first error named are those of a
//! sequential pass; with a progress bar on a terminal (records, records/s, ETA).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use serde_json::{Map, Value};

use super::DataError;
use super::jsonl_index::{Examples, Indexing, example};
use super::pairs::{Pair, pair};

/// What a record made: an example, or a preference pair's two.
enum Made {
    One(Result<(Vec<u32>, Vec<std::ops::Range<usize>>), String>),
    Pair(Result<Pair, String>),
}

/// Records made side by side at a time: enough that a chunk keeps every core busy, few enough
/// that its objects stay small beside the examples.
const CHUNK: usize = 4096;

/// A record read but not yet made: its number in its file (from 1) and its fields, or what
/// is wrong with it.
type Pending = (usize, Result<Map<String, Value>, String>);

pub struct Records<'a> {
    how: &'a Indexing<'a>,
    /// "line" or "row", for errors.
    kind: &'static str,
    file: PathBuf,
    pending: Vec<Pending>,
    examples: Examples,
    bar: Option<ProgressBar>,
    made: usize,
    started: Instant,
}

impl<'a> Records<'a> {
    /// For records of `kind`, with a bar of `total` units (`bytes`: of input, else records)
    /// on a terminal.
    pub fn new(how: &'a Indexing<'a>, kind: &'static str, total: u64, bytes: bool) -> Self {
        let shown = std::io::stderr().is_terminal() && std::env::var_os("DDPJOB_PLAIN").is_none();
        let bar = shown.then(|| {
            let bar = ProgressBar::new(total);
            let unit = match bytes {
                true => "{binary_bytes}/{binary_total_bytes}",
                false => "{pos}/{len} rows",
            };
            let template =
                format!("tokenising [{{bar:30.cyan/blue}}] {unit}  {{msg}}  ETA {{eta}}");
            let style = ProgressStyle::with_template(&template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
            bar.set_style(style);
            bar
        });
        Records {
            how,
            kind,
            file: PathBuf::new(),
            pending: Vec::with_capacity(CHUNK),
            examples: Examples::default(),
            bar,
            made: 0,
            started: Instant::now(),
        }
    }

    /// The records from here on are `file`'s.
    pub fn file(&mut self, file: &Path) -> Result<(), DataError> {
        self.flush()?;
        self.file = file.to_path_buf();
        Ok(())
    }

    /// Record `number` of the current file, and `units` more of the bar done.
    pub fn push(
        &mut self,
        number: usize,
        record: Result<Map<String, Value>, String>,
        units: u64,
    ) -> Result<(), DataError> {
        self.pending.push((number, record));
        if let Some(bar) = &self.bar {
            bar.inc(units);
        }
        match self.pending.len() >= CHUNK {
            true => self.flush(),
            false => Ok(()),
        }
    }

    /// The examples of every record pushed.
    pub fn finish(mut self) -> Result<Examples, DataError> {
        self.flush()?;
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        Ok(self.examples)
    }

    fn flush(&mut self) -> Result<(), DataError> {
        let how = self.how;
        let made: Vec<_> = (self.pending.par_iter())
            .map(|(_, record)| match (record, how.pairs) {
                (Ok(fields), None) => Made::One(example(fields, how)),
                (Ok(fields), Some(names)) => Made::Pair(pair(fields, how, names)),
                (Err(problem), None) => Made::One(Err(problem.clone())),
                (Err(problem), Some(_)) => Made::Pair(Err(problem.clone())),
            })
            .collect();
        let (file, kind) = (&self.file, self.kind);
        for ((number, _), made) in self.pending.drain(..).zip(made) {
            let bad = |problem: &str, fix: &str| {
                DataError::Mismatch(format!(
                    "`{}` {kind} {number}: {problem}{fix}",
                    file.display()
                ))
            };
            match made {
                Made::One(made) => self.examples.add(made, how, kind, bad)?,
                Made::Pair(made) => self.examples.add_pair(made, how, kind, bad)?,
            }
            self.made += 1;
        }
        if let Some(sink) = how.sink {
            sink(match how.keep_layout {
                true => self.examples.take_tokens(),
                false => self.examples.drain_tokens(),
            })?;
        }
        if let Some(bar) = &self.bar {
            let rate = self.made as f64 / self.started.elapsed().as_secs_f64().max(1e-9);
            bar.set_message(format!("{} {kind}s, {rate:.0} {kind}s/s", self.made));
        }
        Ok(())
    }
}
