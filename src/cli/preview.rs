//! `ddpjob preview JOB.toml`: the first training examples exactly as the trainer sees them,
//! before packing, so a user sees what a job trains on before it runs: on a terminal the
//! decoded text with the trained tokens highlighted; `--json` one object per example with
//! Hugging Face's `input_ids` and `labels` (-100 where not trained, unshifted).

use std::io::{IsTerminal, Write};

use anyhow::anyhow;
use clap::Args;

use super::{CliResult, ConfigArgs};
use crate::config;
use crate::data::hf_tokenizer::HfTokenizer;
use ddpjob_seam::task::{Example, ExampleCounts};

#[derive(Debug, Args)]
pub(super) struct PreviewArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// How many of the first training examples to show.
    #[arg(long, default_value_t = 3, value_name = "N")]
    examples: usize,
    /// One JSON object per example, `{"input_ids": [...], "labels": [...]}`, then one with
    /// the counts of the whole training set.
    #[arg(long)]
    json: bool,
}

pub(super) fn preview(args: &PreviewArgs) -> CliResult {
    let loaded =
        config::load(&args.config.config, &args.config.overrides()).map_err(|e| (2, anyhow!(e)))?;
    let spec = &loaded.spec;
    let task = crate::task::load(spec, None).map_err(|e| (2, anyhow!(e)))?;
    let Some(counts) = task.example_counts() else {
        return Err((
            2,
            anyhow!(
                "{}: data.dataset = \"{}\" is not made of examples here but of token windows \
                 (images, text), every target trained; preview shows instruction and \
                 conversation data, one example a row: dataset = \"jsonl\" or \"parquet\" \
                 (with data.text_rows = \"examples\" for rows of text)",
                args.config.config.display(),
                spec.data.name()
            ),
        ));
    };
    let examples = task.examples(args.examples);
    let mut stdout = std::io::stdout().lock();
    if args.json {
        for e in &examples {
            let line = serde_json::json!({"input_ids": e.ids, "labels": e.labels()});
            let _ = writeln!(stdout, "{line}");
        }
        let _ = writeln!(stdout, "{}", counts_json(&counts));
        return Ok(());
    }
    let tokenizer = crate::registry::Registry::current()
        .data_tokenizer(&spec.data)
        .map(|path| HfTokenizer::load(&path))
        .transpose()
        .map_err(|e| (2, anyhow!(e)))?;
    let colour = std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    for (i, e) in examples.iter().enumerate() {
        let trained = e.trained.iter().filter(|&&t| t).count();
        let which = match counts.pairs {
            true => format!("pair {}, {}", i / 2, ["chosen", "rejected"][i % 2]),
            false => format!("example {i}"),
        };
        let _ = writeln!(
            stdout,
            "── {which}: {} tokens, {trained} trained {}",
            e.ids.len(),
            "─".repeat(20)
        );
        let _ = writeln!(stdout, "{}", render(e, tokenizer.as_ref(), colour));
    }
    let _ = writeln!(stdout, "── {}", describe(&counts));
    if !colour {
        let _ = writeln!(stdout, "(trained text between ⟦ and ⟧)");
    }
    Ok(())
}

/// The example's text, each run of trained tokens highlighted (bold green on a terminal,
/// between ⟦ ⟧ elsewhere); ids when there is no tokenizer to decode them.
fn render(e: &Example, tokenizer: Option<&HfTokenizer>, colour: bool) -> String {
    let mut out = String::new();
    let mut at = 0;
    while at < e.ids.len() {
        let trained = e.trained[at];
        let end = (at..e.ids.len())
            .find(|&j| e.trained[j] != trained)
            .unwrap_or(e.ids.len());
        let ids = &e.ids[at..end];
        let text = match tokenizer {
            Some(t) => t.decode(ids),
            None => format!("{ids:?}"),
        };
        match (trained, colour) {
            (true, true) => out.push_str(&format!("\x1b[1;32m{text}\x1b[0m")),
            (true, false) => out.push_str(&format!("⟦{text}⟧")),
            (false, true) => out.push_str(&format!("\x1b[2m{text}\x1b[0m")),
            (false, false) => out.push_str(&text),
        }
        at = end;
    }
    out
}

/// The training set's counts in words.
fn describe(c: &ExampleCounts) -> String {
    let examples = match c.pairs {
        true => format!("{} pairs ({} examples)", c.examples / 2, c.examples),
        false => format!("{} examples", c.examples),
    };
    let mut text = format!(
        "training set: {examples}, {} tokens, {} trained ({:.1}%)",
        c.tokens,
        c.trained,
        100.0 * c.trained as f64 / c.tokens.max(1) as f64
    );
    for (n, what) in [
        (c.truncated, "truncated to model.block_size + 1 tokens"),
        (
            c.left_out,
            match c.pairs {
                true => "pairs left out with nothing to learn",
                false => "left out with nothing to train",
            },
        ),
        (c.bad_records, "bad records skipped"),
    ] {
        if n > 0 {
            text.push_str(&format!(", {n} {what}"));
        }
    }
    text
}

fn counts_json(c: &ExampleCounts) -> serde_json::Value {
    serde_json::json!({
        "examples": c.examples, "tokens": c.tokens, "trained_tokens": c.trained,
        "truncated": c.truncated, "left_out": c.left_out, "bad_records": c.bad_records,
        "pairs": c.pairs,
    })
}
