//! `jobs/<name>/curves.svg`: training and test loss, test accuracy and learning rate against the
//! optimizer step, drawn with plotters' SVG backend from `metrics.jsonl`. Redrawn by rank 0 at
//! every epoch end and by the launcher when the run ends, so it is current while a job trains.

use std::ops::Range;
use std::path::Path;

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::history::History;
use crate::jobdir::JobDir;
use crate::task::MetricInfo;

const SIZE: (u32, u32) = (960, 900);
/// A long job logs many intervals; more points than this add bytes, not information.
const MAX_POINTS: usize = 1500;
const FONT: &str = "sans-serif";
/// The train loss line's colour (matplotlib's tab:blue).
pub const TRAIN_COLOR: RGBColor = RGBColor(31, 119, 180);
/// The test loss line's colour (tab:red).
pub const TEST_COLOR: RGBColor = RGBColor(214, 39, 40);
/// The test accuracy line's colour (tab:green).
pub const ACCURACY_COLOR: RGBColor = RGBColor(44, 160, 44);
/// The learning-rate line's colour (tab:purple).
pub const LR_COLOR: RGBColor = RGBColor(148, 103, 189);
const RESUME_COLOR: RGBColor = RGBColor(150, 150, 150);

/// Redraws `curves.svg` of `job` from its `metrics.jsonl`, its metrics as its task declared
/// them in `state.json`; the error is a warning's text.
pub fn draw(job: &JobDir) -> Result<(), String> {
    let title = format!("ddpjob: {}", job.name());
    let declared = job.read_state().map(|s| s.metrics).unwrap_or_default();
    write(&job.metrics_path(), &job.curves_path(), &declared, &title)
}

/// Reads `metrics` and writes the chart to `out` (atomically: a viewer never sees half a file).
/// `declared`: the task's metrics (empty: inferred from the records).
pub fn write(
    metrics: &Path,
    out: &Path,
    declared: &[MetricInfo],
    title: &str,
) -> Result<(), String> {
    let history =
        History::read(metrics).map_err(|e| format!("cannot read `{}`: {e}", metrics.display()))?;
    let declared = match declared {
        [] => MetricInfo::inferred(history.metric_names.iter().map(|n| n.as_str())),
        given => given.to_vec(),
    };
    let svg = render(&history, &declared, title)?;
    crate::jobdir::write_atomic(out, svg.as_bytes())
        .map_err(|e| format!("cannot write `{}`: {e}", out.display()))
}

/// The chart as an SVG document: three panels sharing the step axis: the losses, the task's
/// second metric (see [`second_metric`]), the learning rate.
pub fn render(history: &History, metrics: &[MetricInfo], title: &str) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(draw_error)?;
        let root = root.titled(title, (FONT, 22)).map_err(draw_error)?;
        let panels = root.split_evenly((3, 1));
        let steps = step_range(history);
        loss_panel(&panels[0], history, steps.clone()).map_err(draw_error)?;
        if let Some(metric) = second_metric(metrics) {
            metric_panel(&panels[1], history, metric, steps.clone()).map_err(draw_error)?;
        }
        lr_panel(&panels[2], history, steps).map_err(draw_error)?;
        root.present().map_err(draw_error)?;
    }
    Ok(svg)
}

fn draw_error(e: impl std::fmt::Display) -> String {
    format!("cannot draw the curves: {e}")
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type DrawResult = Result<(), DrawingAreaErrorKind<std::io::Error>>;

fn step_range(h: &History) -> Range<f64> {
    let last = h
        .train
        .iter()
        .map(|p| p.step)
        .chain(h.epochs.iter().map(|e| e.step))
        .chain(h.evals.iter().map(|e| e.step))
        .max()
        .unwrap_or(0);
    0.0..(last.max(1) as f64)
}

/// Every `k`-th point so at most [`MAX_POINTS`] remain, always keeping the last.
fn thin(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    let k = points.len().div_ceil(MAX_POINTS).max(1);
    let last = points.last().copied();
    let mut kept: Vec<(f64, f64)> = points.into_iter().step_by(k).collect();
    if let (Some(l), Some(k)) = (last, kept.last())
        && *k != l
    {
        kept.push(l);
    }
    kept
}

fn finite(points: impl Iterator<Item = (f64, f64)>) -> Vec<(f64, f64)> {
    points.filter(|(_, y)| y.is_finite()).collect()
}

/// A y range holding every value, padded by 5%; `floor` pins the bottom (losses start at 0).
fn y_range<'a>(series: impl Iterator<Item = &'a (f64, f64)>, floor: Option<f64>) -> Range<f64> {
    let (lo, hi) = series.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (_, y)| {
        (lo.min(*y), hi.max(*y))
    });
    if !lo.is_finite() {
        return floor.unwrap_or(0.0)..1.0;
    }
    // A flat series (a constant learning rate) gets room around it instead of hugging an edge.
    let pad = if hi - lo > hi.abs() * 1e-6 {
        (hi - lo) * 0.05
    } else {
        (hi.abs() * 0.1).max(1e-12)
    };
    floor.unwrap_or(lo - pad)..hi + pad
}

fn legend(color: RGBColor) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
}

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// A panel's frame: caption, labelled axes and ticks over `steps` × `ys`.
fn axes<'a, 'b>(
    area: &'a Area<'b>,
    caption: &str,
    y_desc: &str,
    y_label: &dyn Fn(&f64) -> String,
    steps: Range<f64>,
    ys: Range<f64>,
) -> Result<Chart<'a, 'b>, DrawingAreaErrorKind<std::io::Error>> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(steps, ys)?;
    chart
        .configure_mesh()
        .x_desc("optimizer step")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(y_label)
        .label_style((FONT, 13))
        .draw()?;
    Ok(chart)
}

fn legend_box<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>, position: SeriesLabelPosition) -> DrawResult {
    chart
        .configure_series_labels()
        .position(position)
        .label_font((FONT, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
}

fn loss_panel(area: &Area, h: &History, steps: Range<f64>) -> DrawResult {
    let train = thin(finite(h.train.iter().map(|p| (p.step as f64, p.loss))));
    let test = finite(h.epochs.iter().map(|e| (e.step as f64, e.test_loss())));
    let periodic = finite(h.evals.iter().map(|e| (e.step as f64, e.test_loss())));
    let ys = y_range(train.iter().chain(&test).chain(&periodic), Some(0.0));
    let plain = |y: &f64| format!("{y:.2}");
    let mut chart = axes(area, "Loss", "loss", &plain, steps, ys.clone())?;
    chart
        .draw_series(LineSeries::new(train, TRAIN_COLOR.stroke_width(2)))?
        .label("train loss (per log interval)")
        .legend(legend(TRAIN_COLOR));
    chart
        .draw_series(LineSeries::new(test.clone(), TEST_COLOR.stroke_width(2)))?
        .label("test loss (per epoch)")
        .legend(legend(TEST_COLOR));
    chart.draw_series(test.iter().map(|&p| Circle::new(p, 4, TEST_COLOR.filled())))?;
    if !periodic.is_empty() {
        let color = TEST_COLOR.mix(0.55);
        chart
            .draw_series(LineSeries::new(periodic.clone(), color.stroke_width(1)))?
            .label("test loss (every eval_every steps)")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart.draw_series(periodic.iter().map(|&p| Circle::new(p, 3, color)))?;
    }
    if !h.resumes.is_empty() {
        let lines = h.resumes.iter().map(|&s| {
            let x = s as f64;
            PathElement::new(vec![(x, ys.start), (x, ys.end)], RESUME_COLOR)
        });
        chart
            .draw_series(lines)?
            .label("resumed here")
            .legend(legend(RESUME_COLOR));
    }
    legend_box(&mut chart, SeriesLabelPosition::UpperRight)
}

/// The metric the middle panel plots: the task's first after the loss that is a fraction
/// (accuracy, for the built-in tasks), else its first after the loss.
pub fn second_metric(metrics: &[MetricInfo]) -> Option<&MetricInfo> {
    let others = || metrics.iter().filter(|m| m.name != "loss");
    others().find(|m| m.percent).or_else(|| others().next())
}

fn metric_panel(area: &Area, h: &History, metric: &MetricInfo, steps: Range<f64>) -> DrawResult {
    let scale = if metric.percent { 100.0 } else { 1.0 };
    let acc = finite(
        h.epochs
            .iter()
            .map(|e| (e.step as f64, e.metrics.value(&metric.name) * scale)),
    );
    let ys = y_range(acc.iter(), None);
    let ys = match metric.percent {
        true => ys.start.max(0.0)..ys.end.min(100.0).max(ys.start.max(0.0) + 1.0),
        false => ys,
    };
    let plain = |y: &f64| format!("{y:.1}");
    let mut title = metric.label.clone();
    if let Some(first) = title.get_mut(0..1) {
        first.make_ascii_uppercase();
    }
    let label = format!("{} (per epoch)", metric.label);
    let unit = match metric.percent {
        true => format!("{} (%)", metric.name),
        false => metric.name.clone(),
    };
    let mut chart = axes(area, &title, &unit, &plain, steps, ys)?;
    chart
        .draw_series(LineSeries::new(acc.clone(), ACCURACY_COLOR.stroke_width(2)))?
        .label(label)
        .legend(legend(ACCURACY_COLOR));
    chart.draw_series(
        acc.iter()
            .map(|&p| Circle::new(p, 4, ACCURACY_COLOR.filled())),
    )?;
    legend_box(&mut chart, SeriesLabelPosition::LowerRight)
}

fn lr_panel(area: &Area, h: &History, steps: Range<f64>) -> DrawResult {
    let mut points = finite(
        h.train
            .iter()
            .map(|p| (p.step as f64, p.lr))
            .chain(h.epochs.iter().map(|e| (e.step as f64, e.lr))),
    );
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    points.dedup_by(|a, b| a.0 == b.0);
    let points = thin(points);
    let ys = y_range(points.iter(), Some(0.0));
    // Headroom for the legend above a flat (constant) learning rate.
    let ys = ys.start..ys.end * 1.3;
    let scientific = |y: &f64| {
        if *y == 0.0 {
            "0".into()
        } else {
            format!("{y:.1e}")
        }
    };
    let mut chart = axes(
        area,
        "Learning rate",
        "learning rate",
        &scientific,
        steps,
        ys,
    )?;
    chart
        .draw_series(LineSeries::new(points, LR_COLOR.stroke_width(2)))?
        .label("learning rate")
        .legend(legend(LR_COLOR));
    legend_box(&mut chart, SeriesLabelPosition::UpperRight)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinning_keeps_the_last_point_and_bounds_the_count() {
        let points: Vec<(f64, f64)> = (0..4000).map(|i| (i as f64, 1.0)).collect();
        let kept = thin(points);
        assert!(kept.len() <= MAX_POINTS + 1, "{}", kept.len());
        assert_eq!(kept.last(), Some(&(3999.0, 1.0)));
        assert_eq!(thin(vec![(0.0, 1.0)]), vec![(0.0, 1.0)]);
    }

    #[test]
    fn an_empty_history_still_draws_a_valid_chart() {
        let classes = MetricInfo::inferred(["accuracy", "loss"]);
        let svg = render(&History::default(), &classes, "job `x`").unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("Learning rate") && svg.contains("Test accuracy"));
    }

    #[test]
    fn the_middle_panel_plots_what_the_task_declared() {
        // A language model's: next-token accuracy, not perplexity (a fraction goes first).
        let lm = MetricInfo::inferred(["loss", "perplexity", "accuracy"]);
        assert_eq!(second_metric(&lm).unwrap().label, "next-token accuracy");
        // A task's own metric, drawn under its own label from the records.
        let margins = MetricInfo::new("rewards/margins", "reward margin");
        let declared = [MetricInfo::new("loss", "loss"), margins];
        assert_eq!(second_metric(&declared).unwrap().name, "rewards/margins");
        let text = r#"{"kind":"epoch","epoch":0,"step":4,"loss":0.7,"lr":0.1,"test_loss":0.6,"test_rewards/margins":0.25}"#;
        let svg = render(&History::parse(text), &declared, "job").unwrap();
        assert!(svg.contains("Reward margin"), "no panel title");
        assert!(second_metric(&declared[..1]).is_none());
    }
}
