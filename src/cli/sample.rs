//! `ddpjob sample NAME`: text from a trained language-model job, streamed to stdout as it is generated.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::anyhow;
use clap::Args;

use super::CliResult;
use crate::generate::{Generator, SampleError, Sampling};

#[derive(Debug, Args)]
pub(super) struct SampleArgs {
    /// The job's name (its directory under --jobs-dir).
    name: String,
    /// Which weights: best, latest, step-N (default: the final weights, else the newest
    /// checkpoint).
    #[arg(long, value_name = "WHICH")]
    checkpoint: Option<String>,
    /// Text to continue (default: a newline, as nanoGPT's sample.py).
    #[arg(long, default_value = "")]
    prompt: String,
    /// A user's message: rendered through the job's chat template with its generation prompt
    /// (as `apply_chat_template(..., add_generation_prompt=True)`), the answer generated until
    /// the end-of-turn token.
    #[arg(long, value_name = "MESSAGE", conflicts_with = "prompt")]
    chat: Option<String>,
    /// Tokens to generate (at most: a job trained on prompt/completion examples stops at
    /// the end-of-sequence token, as transformers' generate does).
    #[arg(long, default_value_t = 500)]
    tokens: usize,
    /// Softmax temperature; 0 always takes the most likely token.
    // A negative value reaches the check below, which says what is allowed (clap's own
    // message took `-1` for an option).
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f64,
    /// Sample among the K most likely tokens only (0: all).
    #[arg(long, default_value_t = 200, value_name = "K")]
    top_k: usize,
    /// Seed of the sampling; the same seed gives the same text.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Print one JSON object (prompt, text, tokens, tokens_per_s, weights) instead of
    /// streaming the text.
    #[arg(long)]
    json: bool,
    /// Where jobs live.
    #[arg(long, default_value = "jobs")]
    jobs_dir: PathBuf,
}

pub(super) fn sample(args: &SampleArgs) -> CliResult {
    // As `eval`: freed memory stays in the process rather than coming back as fresh pages.
    ddpjob_kernels::keep_freed_memory(true);
    let job = super::existing_job(&args.jobs_dir, &args.name)?;
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err((
            2,
            anyhow!(
                "--temperature must be a finite number, 0 or more, got {}",
                args.temperature
            ),
        ));
    }
    let exit = |e: SampleError| {
        let code = match e {
            SampleError::Usage(_) | SampleError::Config(_) => 2,
            SampleError::Data(crate::data::DataError::Mismatch(_)) => 2,
            _ => 1,
        };
        (code, anyhow!(e))
    };
    let generator = Generator::load(&job, args.checkpoint.as_deref()).map_err(exit)?;
    let how = Sampling {
        temperature: args.temperature,
        top_k: (args.top_k > 0).then_some(args.top_k),
        seed: args.seed,
    };
    let started = Instant::now();
    let mut stdout = std::io::stdout().lock();
    let mut text = String::new();
    // The prompt is echoed once it is known to encode: a usage error leaves stdout empty.
    let mut echoed = args.json;
    let mut prompt = args.prompt.clone();
    let mut on_piece = |piece: &str, prompt: &str| {
        if args.json {
            text.push_str(piece);
        } else {
            if !echoed {
                let _ = write!(stdout, "{prompt}");
                echoed = true;
            }
            let _ = write!(stdout, "{piece}");
            let _ = stdout.flush();
        }
    };
    let ids = match &args.chat {
        Some(message) => {
            let (shown, context) = generator.chat_prompt(message).map_err(exit)?;
            prompt = shown;
            generator
                .continue_ids(context, args.tokens, how, |piece| on_piece(piece, &prompt))
                .map_err(exit)?
        }
        None => generator
            .generate(&args.prompt, args.tokens, how, |piece| {
                on_piece(piece, &args.prompt)
            })
            .map_err(exit)?,
    };
    if !echoed && !args.json {
        let _ = write!(stdout, "{prompt}");
    }
    let secs = started.elapsed().as_secs_f64();
    if args.json {
        let line = serde_json::json!({
            "prompt": prompt, "text": text, "tokens": ids.len(),
            "ended": ids.len() < args.tokens,
            "tokens_per_s": (ids.len() as f64 / secs.max(1e-9)).round(),
            "weights": generator.weights.display().to_string(), "seed": args.seed,
        });
        let _ = writeln!(stdout, "{line}");
    } else {
        let _ = writeln!(stdout);
        errln!(
            "{} tokens in {secs:.2} s ({:.0} tokens/s) from {}{}",
            ids.len(),
            ids.len() as f64 / secs.max(1e-9),
            generator.weights.display(),
            match ids.len() < args.tokens {
                true => "; the model ended its answer (end-of-sequence token)",
                false => "",
            }
        );
    }
    Ok(())
}
