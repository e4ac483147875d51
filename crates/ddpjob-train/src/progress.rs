//! What the user sees while a job trains: an indicatif bar per epoch on a terminal, plain lines
//! (no control characters) otherwise; every line also goes to the rank's log file.

use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};

/// The display seam: the trainer reports, the implementation decides how it looks.
pub trait Reporter {
    fn epoch_start(&mut self, epoch: usize, epochs: usize, steps: usize);
    /// After every optimizer step; `status` is set at log intervals (loss, samples/s).
    fn step(&mut self, done_in_epoch: usize, status: Option<&str>);
    /// A line worth keeping: epoch summary, notices.
    fn line(&mut self, text: &str);
    /// A log-interval line: printed where there is no bar (the bar shows the same numbers).
    fn interval(&mut self, text: &str) {
        self.line(text);
    }
    fn epoch_end(&mut self);
}

/// Bars on a terminal (stderr), plain lines on stdout otherwise.
pub fn for_stdout() -> Box<dyn Reporter> {
    if std::io::stderr().is_terminal() && std::env::var_os("DDPJOB_PLAIN").is_none() {
        Box::new(Bars { bar: None })
    } else {
        Box::new(Plain)
    }
}

struct Bars {
    bar: Option<ProgressBar>,
}

impl Reporter for Bars {
    fn epoch_start(&mut self, epoch: usize, epochs: usize, steps: usize) {
        let bar = ProgressBar::new(steps as u64);
        let style = ProgressStyle::with_template(
            "epoch {prefix} [{bar:30.cyan/blue}] {pos}/{len} steps  {msg}  ETA {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        bar.set_style(style);
        bar.set_prefix(format!("{}/{epochs}", epoch + 1));
        self.bar = Some(bar);
    }

    fn step(&mut self, done_in_epoch: usize, status: Option<&str>) {
        if let Some(bar) = &self.bar {
            bar.set_position(done_in_epoch as u64);
            if let Some(s) = status {
                bar.set_message(s.to_string());
            }
        }
    }

    fn line(&mut self, text: &str) {
        match &self.bar {
            Some(bar) if !bar.is_finished() => bar.println(text),
            _ => errln!("{text}"),
        }
    }

    fn interval(&mut self, _text: &str) {}

    fn epoch_end(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// One plain line per message on stdout: no bars, no control characters.
pub struct Plain;

impl Reporter for Plain {
    fn epoch_start(&mut self, _epoch: usize, _epochs: usize, _steps: usize) {}

    fn step(&mut self, _done_in_epoch: usize, _status: Option<&str>) {}

    fn line(&mut self, text: &str) {
        outln!("{text}");
    }

    fn epoch_end(&mut self) {}
}

/// Sends every line both to a display and to a rank's log file.
pub struct Logged {
    display: Box<dyn Reporter>,
    file: Option<File>,
}

impl Logged {
    pub fn new(display: Box<dyn Reporter>, log_path: Option<&Path>) -> std::io::Result<Self> {
        let file = log_path
            .map(|p| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
            })
            .transpose()?;
        Ok(Logged { display, file })
    }

    fn write_file(&mut self, text: &str) {
        if let Some(f) = &mut self.file {
            // A full disk must not stop training; the display still shows the line.
            let _ = writeln!(f, "{text}");
        }
    }
}

impl Reporter for Logged {
    fn epoch_start(&mut self, epoch: usize, epochs: usize, steps: usize) {
        self.display.epoch_start(epoch, epochs, steps);
    }

    fn step(&mut self, done_in_epoch: usize, status: Option<&str>) {
        self.display.step(done_in_epoch, status);
    }

    fn line(&mut self, text: &str) {
        self.write_file(text);
        self.display.line(text);
    }

    fn interval(&mut self, text: &str) {
        self.write_file(text);
        self.display.interval(text);
    }

    fn epoch_end(&mut self) {
        self.display.epoch_end();
    }
}

/// Discards everything (tests).
/// Reports nothing: tests, and callers that want the numbers only.
pub struct Silent;

impl Reporter for Silent {
    fn epoch_start(&mut self, _: usize, _: usize, _: usize) {}
    fn step(&mut self, _: usize, _: Option<&str>) {}
    fn line(&mut self, _: &str) {}
    fn epoch_end(&mut self) {}
}
