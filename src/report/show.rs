//! The text of `ddpjob show NAME` (one job, in full) and `ddpjob list` (one line per job).

use std::fmt::Write;

use super::history::sparkline;
use super::view::JobView;
use crate::jobdir::Status;

const ERROR_LINES: usize = 12;

/// `ddpjob show`: status, config digest, progress, metrics, checkpoints, expectations.
pub fn show(v: &JobView, now: u64) -> String {
    let s = &v.state;
    let job = crate::jobdir::JobDir {
        root: v.dir.clone(),
    };
    // Without a checkpoint a plain `resume` is refused: starting over is what is left.
    let resume = match job.has_checkpoint() {
        true => format!("`{}` continues it", job.cli("resume")),
        false => format!(
            "no checkpoint yet: `{} --from-scratch` starts it over",
            job.cli("resume")
        ),
    };
    let status = match (v.launcher, s.status) {
        (Some((pid, true)), _) => format!("running (launcher pid {pid})"),
        (Some((pid, false)), _) => format!(
            "stale: state.json says running, but its launcher (pid {pid}) is gone; {resume}"
        ),
        (None, Status::Interrupted | Status::Failed) => format!("{} ({resume})", s.status),
        (None, status) => status.to_string(),
    };
    let mut out = format!(
        "job {}: {status}, updated {}",
        v.name,
        ago(now, s.updated_unix)
    );
    if v.history.resumed_by_user > 0 {
        let _ = write!(out, ", resumed {} time(s)", v.history.resumed_by_user);
    }
    if s.restarts > 0 {
        let _ = write!(out, ", {} automatic restart(s)", s.restarts);
    }
    out.push('\n');
    let mut line = |label: &str, text: String| {
        let _ = writeln!(out, "  {label:<12}{text}");
    };
    line("directory", v.dir.display().to_string());
    line("model", model_line(v));
    line("data", v.data());
    if let (Some(spec), Some(global)) = (&v.spec, v.global_batch()) {
        let t = &spec.train;
        line(
            "batch",
            format!(
                "global {global} = {} per worker x {} accumulation x {} worker(s)",
                t.batch_size,
                t.accumulation,
                s.world_size.max(1)
            ),
        );
        line(
            "optimizer",
            format!(
                "{}, lr {}, {} epoch(s)",
                spec.train.optimizer.name(),
                t.lr,
                t.epochs
            ),
        );
    }
    line("progress", progress(v));
    if let Some((uri, run)) = ddpjob_track::run_of(&v.dir) {
        line("mlflow", format!("run {run} at {uri}"));
    }
    if let Some(summary) = &v.summary
        && let Some(early) = summary.stopped_early
    {
        line("early stop", early.describe(&summary.metrics()));
    }
    let metrics = v.metrics();
    if let Some(e) = v.history.last_epoch() {
        line(
            "last epoch",
            format!(
                "{}: train loss {:.4}, {}",
                e.epoch + 1,
                e.train_loss,
                e.metrics.describe(&metrics)
            ),
        );
    }
    if let Some(b) = v.best() {
        let at = match b.epoch {
            Some(epoch) => format!("epoch {} (step {})", epoch + 1, b.step),
            None => format!("step {}", b.step),
        };
        line(
            "best",
            format!("{} at {at}", b.headline.describe(b.value())),
        );
    }
    // A best judged by another metric than the loss: the lowest loss too, when periodic
    // evaluations may have had it between epochs.
    if metrics.first().is_some_and(|m| m.name != "loss")
        && !v.history.evals.is_empty()
        && let Some((step, loss)) = v.history.lowest_test_loss()
    {
        line("lowest loss", format!("{loss:.4} at step {step}"));
    }
    if let Some(sum) = &v.summary {
        line(
            "final",
            format!(
                "{}, train loss {:.4}; {:.0} samples/s, {:.1} s",
                sum.describe_eval(),
                sum.final_train_loss,
                sum.train_samples_per_s,
                sum.wall_s
            ),
        );
    }
    let losses = v.loss_series();
    let spark = sparkline(&losses, 48);
    if !spark.is_empty() {
        let finite: Vec<f64> = losses.iter().copied().filter(|x| x.is_finite()).collect();
        let (first, last) = (finite[0], finite[finite.len() - 1]);
        line("train loss", format!("{spark}  {first:.4} -> {last:.4}"));
    }
    let total: u64 = v.checkpoints.iter().map(|c| c.bytes).sum();
    line(
        "checkpoints",
        match v.checkpoints.len() {
            0 => "none".into(),
            n => format!("{n}, {} in all", bytes(total)),
        },
    );
    for c in &v.checkpoints {
        let at = c
            .position
            .as_ref()
            .map_or("position unreadable".into(), |p| {
                if p.step_in_epoch == 0 {
                    format!("step {}, after epoch {}", p.step, p.epoch)
                } else {
                    format!("step {}, in epoch {}", p.step, p.epoch + 1)
                }
            });
        let latest = if v.latest.as_deref() == Some(c.name.as_str()) {
            "  (latest)"
        } else {
            ""
        };
        line(
            "",
            format!("{:<13}  {at:<26} {:>10}{latest}", c.name, bytes(c.bytes)),
        );
    }
    match (&v.summary, &v.spec) {
        (Some(sum), _) if !sum.expectations.is_empty() => {
            let met = sum.expectations.iter().filter(|r| r.met).count();
            line("expect", format!("{met} of {} met", sum.expectations.len()));
            for r in &sum.expectations {
                let mark = if r.met { "met  " } else { "UNMET" };
                line("", format!("{mark} {}", r.describe()));
            }
        }
        (_, Some(spec)) if !spec.expect.is_empty() => {
            let keys: Vec<&str> = spec.expect.iter().map(|e| e.check.key()).collect();
            line("expect", format!("not checked yet: {}", keys.join(", ")));
        }
        _ => {}
    }
    if let Some(error) = &s.error {
        let mut lines = error.lines();
        line("error", lines.next().unwrap_or_default().to_string());
        for l in lines.by_ref().take(ERROR_LINES) {
            line("", l.to_string());
        }
        if lines.next().is_some() {
            line("", format!("... (full logs in {}/logs/)", v.dir.display()));
        }
    }
    if v.dir.join("curves.svg").exists() {
        line("curves", v.dir.join("curves.svg").display().to_string());
    }
    if v.history.skipped > 0 {
        line(
            "note",
            format!(
                "{} unreadable line(s) in metrics.jsonl were skipped",
                v.history.skipped
            ),
        );
    }
    out
}

fn model_line(v: &JobView) -> String {
    match &v.summary {
        Some(s) => match s.trainable_parameters {
            // peft's print_trainable_parameters, in a line.
            Some(trainable) => format!(
                "{}, {} parameters, {trainable} of them trained ({:.2}%)",
                v.model(),
                s.parameters,
                100.0 * trainable as f64 / s.parameters.max(1) as f64
            ),
            None => format!("{}, {} parameters", v.model(), s.parameters),
        },
        None => v.model(),
    }
}

fn progress(v: &JobView) -> String {
    let s = &v.state;
    let epochs = v.spec.as_ref().map(|spec| spec.train.epochs);
    let epoch = match epochs {
        Some(n) => format!("epoch {}/{n}", s.epoch.min(n)),
        None => format!("epoch {}", s.epoch),
    };
    let step = v.step();
    if s.total_steps == 0 {
        return format!("{epoch}, step {step}");
    }
    let pct = 100.0 * step as f64 / s.total_steps as f64;
    format!("{epoch} done, step {step}/{} ({pct:.0}%)", s.total_steps)
}

/// `ddpjob list` columns: header and width (negative: left-aligned).
const COLUMNS: [(&str, i32); 12] = [
    ("NAME", -20),
    ("STATUS", -11),
    ("MODEL", -5),
    ("DATA", -18),
    ("WORLD", 5),
    ("EPOCH", 7),
    ("STEP", 13),
    ("LOSS", 8),
    // The best evaluation by the task's headline metric: a classifier's accuracy, a language
    // model's loss.
    ("BEST", 8),
    ("EXPECT", -7),
    ("LOSS CURVE", -12),
    ("UPDATED", 0),
];

fn row(cells: &[String]) -> String {
    let mut line = String::new();
    for (cell, (_, width)) in cells.iter().zip(COLUMNS) {
        let w = width.unsigned_abs() as usize;
        let _ = if width < 0 {
            write!(line, "{cell:<w$} ")
        } else {
            write!(line, "{cell:>w$} ")
        };
    }
    line.trim_end().to_string() + "\n"
}

/// The header and one line per job for `ddpjob list`.
pub fn list(views: &[JobView], now: u64) -> String {
    let header: Vec<String> = COLUMNS.iter().map(|(h, _)| h.to_string()).collect();
    let mut out = row(&header);
    for v in views {
        let s = &v.state;
        let model = v.spec.as_ref().map_or("?", |spec| spec.model.arch());
        let epoch = match &v.spec {
            Some(spec) => format!("{}/{}", s.epoch.min(spec.train.epochs), spec.train.epochs),
            None => s.epoch.to_string(),
        };
        let loss = v
            .history
            .last_train_loss()
            .or(s.last_loss)
            .map_or("-".into(), |l| format!("{l:.4}"));
        let best = v.best().map_or("-".into(), |b| b.headline.show(b.value()));
        let expect = match v.expectations_met() {
            Some((met, total)) if met == total => format!("{met} met"),
            Some((met, total)) => format!("{} unmet", total - met),
            None => "-".into(),
        };
        out += &row(&[
            v.name.clone(),
            v.status(),
            model.to_string(),
            fit_data(&v.data(), COLUMNS[3].1.unsigned_abs() as usize),
            s.world_size.to_string(),
            epoch,
            step_of_total(v.step(), s.total_steps),
            loss,
            best,
            expect,
            sparkline(&v.loss_series(), 12),
            ago(now, s.updated_unix),
        ]);
    }
    out
}

/// A DATA cell of at most `width` characters: `job.toml` holds absolute paths, so `text
/// /home/me/data/input.txt` becomes `text …/input.txt` (and its end, when that is still too
/// long), keeping `list`'s columns aligned. `show` has the whole path.
fn fit_data(data: &str, width: usize) -> String {
    if data.chars().count() <= width {
        return data.to_string();
    }
    let (kind, path) = data.split_once(' ').unwrap_or(("", data));
    let name = std::path::Path::new(path)
        .file_name()
        .map_or(path.into(), |n| n.to_string_lossy());
    let short = format!("{kind} …/{name}");
    let chars: Vec<char> = short.chars().collect();
    match chars.len() <= width {
        true => short,
        false => std::iter::once('…')
            .chain(chars[chars.len() - (width - 1)..].iter().copied())
            .collect(),
    }
}

/// `760/4700`; `760/?` while the total is not known (a run that has not read its data yet,
/// or a state rebuilt from a checkpoint).
fn step_of_total(step: usize, total: usize) -> String {
    match total {
        0 => format!("{step}/?"),
        _ => format!("{step}/{total}"),
    }
}

fn ago(now: u64, then: u64) -> String {
    let secs = now.saturating_sub(then);
    match secs {
        0..60 => format!("{secs}s ago"),
        60..3600 => format!("{}m ago", secs / 60),
        3600..86400 => format!("{}h ago", secs / 3600),
        _ => format!("{}d ago", secs / 86400),
    }
}

fn bytes(n: u64) -> String {
    match n {
        0..1024 => format!("{n} B"),
        1024..1_048_576 => format!("{:.1} KiB", n as f64 / 1024.0),
        1_048_576..1_073_741_824 => format!("{:.1} MiB", n as f64 / 1_048_576.0),
        _ => format!("{:.2} GiB", n as f64 / 1_073_741_824.0),
    }
}

#[cfg(test)]
mod tests {
    use super::fit_data;

    #[test]
    fn a_long_data_cell_keeps_its_kind_and_file_name_within_the_column() {
        assert_eq!(fit_data("synthetic 2048/512", 18), "synthetic 2048/512");
        assert_eq!(
            fit_data("text /home/me/data/shakespeare/input.txt", 18),
            "text …/input.txt"
        );
        let long = fit_data("tokens /data/owt/openwebtext-train-2024.bin", 18);
        assert_eq!(long, "…xt-train-2024.bin");
        assert_eq!(long.chars().count(), 18);
    }
}
