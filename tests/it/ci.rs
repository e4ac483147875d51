//! CI smoke-job features of `run`: `[expect]` verdicts, `--json`, `--junit` and `curves.svg`.

use crate::common::{TINY, TestJob};

/// TINY with every expectation, thresholds loose enough for any machine.
fn with_loose_expectations() -> String {
    format!(
        "{TINY}\n[expect]\nmin_test_accuracy = 0.3\nmax_test_loss = 5.0\nmax_final_loss = 5.0\n\
         max_wall_s = 600\nmin_train_samples_per_s = 1\n"
    )
}

fn number(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn met_expectations_pass_and_are_recorded_with_their_values() {
    let t = TestJob::new();
    let cfg = t.config("smoke", &with_loose_expectations());
    let run = t.run(&cfg, &[]);
    run.success();
    let summary = t.json(&t.job("smoke").join("summary.json"));
    let results = summary["expectations"].as_array().unwrap();
    let names: Vec<&str> = results
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "min_test_accuracy",
            "max_test_loss",
            "max_final_loss",
            "max_wall_s",
            "min_train_samples_per_s"
        ]
    );
    for r in results {
        assert_eq!(r["met"], true, "{r}");
        let metric = r["metric"].as_str().unwrap();
        assert_eq!(number(&r["value"]), number(&summary[metric]), "{r}");
    }
    assert_eq!(number(&results[0]["threshold"]), 0.3);
    assert!(
        run.stdout
            .contains("expect met   min_test_accuracy: test_accuracy"),
        "{}",
        run.stdout
    );
}

#[test]
fn an_unmet_expectation_fails_the_run_naming_threshold_and_value() {
    let t = TestJob::new();
    let cfg = t.config("smoke", &with_loose_expectations());
    // The run's own `--set` reaches [expect] like any other key.
    let run = t.run(
        &cfg,
        &[
            "--set",
            "expect.min_test_accuracy=0.999",
            "--set",
            "expect.max_final_loss=0.0001",
        ],
    );
    run.fails_with(1, "job `smoke` finished, but 2 of 5 expectation(s) unmet")
        .fails_with(1, "expect.min_test_accuracy: test_accuracy")
        .fails_with(1, "is below the minimum 0.999")
        .fails_with(1, "is above the maximum 0.0001");
    let summary = t.json(&t.job("smoke").join("summary.json"));
    let accuracy = number(&summary["test_accuracy"]);
    assert!(
        run.stderr
            .contains(&format!("test_accuracy {}", trimmed(accuracy))),
        "{}",
        run.stderr
    );
    let results = summary["expectations"].as_array().unwrap();
    let met: Vec<bool> = results.iter().map(|r| r["met"] == true).collect();
    assert_eq!(met, [false, true, false, true, true]);
    assert_eq!(number(&results[0]["threshold"]), 0.999);
    assert_eq!(number(&results[0]["value"]), accuracy);
    // The job itself trained to the end: finished, not resumable.
    let state = t.json(&t.job("smoke").join("state.json"));
    assert_eq!(state["status"], "finished");
}

/// `0.953125` as the message prints it (4 decimals, no trailing zeros).
fn trimmed(x: f64) -> String {
    let s = format!("{x:.4}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[test]
fn a_mistyped_or_out_of_range_expectation_is_a_config_error() {
    let t = TestJob::new();
    let cfg = t.config(
        "bad",
        &format!("{TINY}\n[expect]\nmin_test_acuracy = 0.9\n"),
    );
    t.run(&cfg, &[])
        .fails_with(2, "unknown key `min_test_acuracy` in [expect]")
        .fails_with(2, "did you mean `min_test_accuracy`?");
    let cfg = t.config(
        "pct",
        &format!("{TINY}\n[expect]\nmin_test_accuracy = 90\n"),
    );
    t.run(&cfg, &[])
        .fails_with(2, "invalid `expect.min_test_accuracy`")
        .fails_with(2, "write 0.9 for 90%");
    assert!(!t.jobs_dir().exists(), "a config error must create nothing");
}

#[test]
fn json_prints_the_summary_as_the_only_stdout_line() {
    let t = TestJob::new();
    let cfg = t.config("smoke", &with_loose_expectations());
    let run = t.run(&cfg, &["--json"]);
    run.success();
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines.len(), 1, "stdout:\n{}", run.stdout);
    let printed: serde_json::Value = serde_json::from_str(lines[0]).expect("JSON line");
    assert_eq!(printed, t.json(&t.job("smoke").join("summary.json")));
    // Progress went to stderr, workers' lines included.
    assert!(run.stderr.contains("epoch 2/2 done"), "{}", run.stderr);
    assert!(run.stderr.contains("finished: test accuracy"));

    // A failure still ends stdout with one JSON object that says what happened.
    let run = t.run(&cfg, &["--json"]);
    assert_eq!(run.code, 2);
    let last: serde_json::Value =
        serde_json::from_str(run.stdout.lines().last().unwrap()).expect("JSON line");
    assert_eq!(last["status"], "usage_error");
    assert_eq!(last["exit_code"], 2);
    assert_eq!(last["job"], "smoke");
    assert!(
        last["error"].as_str().unwrap().contains("already finished"),
        "{last}"
    );
}

/// (attribute, value) of the `<testsuite>`.
type Attributes = Vec<(String, String)>;
/// (name, its child element: `failure`, `skipped` or none) of each `<testcase>`.
type Cases = Vec<(String, Option<String>)>;

fn junit(path: &std::path::Path) -> (Attributes, Cases) {
    let text = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("valid XML");
    assert_eq!(doc.root_element().tag_name().name(), "testsuites");
    let suite = doc
        .descendants()
        .find(|n| n.has_tag_name("testsuite"))
        .expect("a testsuite");
    let attrs = suite
        .attributes()
        .map(|a| (a.name().to_string(), a.value().to_string()))
        .collect();
    let cases = suite
        .children()
        .filter(|n| n.has_tag_name("testcase"))
        .map(|c| {
            let outcome = c
                .children()
                .find(|n| n.is_element())
                .map(|n| n.tag_name().name().to_string());
            (c.attribute("name").unwrap().to_string(), outcome)
        })
        .collect();
    (attrs, cases)
}

fn attr<'a>(attrs: &'a [(String, String)], name: &str) -> &'a str {
    &attrs.iter().find(|(k, _)| k == name).unwrap().1
}

#[test]
fn junit_reports_completion_and_each_expectation() {
    let t = TestJob::new();
    let cfg = t.config("smoke", &with_loose_expectations());
    let report = t.path("reports/nested/smoke.xml");
    let run = t.run(
        &cfg,
        &[
            "--junit",
            report.to_str().unwrap(),
            "--set",
            "expect.max_test_loss=0.00001",
        ],
    );
    assert_eq!(run.code, 1, "{}", run.stderr);
    let (attrs, cases) = junit(&report);
    assert_eq!(attr(&attrs, "tests"), "6");
    assert_eq!(attr(&attrs, "failures"), "1");
    assert_eq!(attr(&attrs, "skipped"), "0");
    assert_eq!(cases[0], ("the job ran to completion".into(), None));
    let failed: Vec<&str> = cases
        .iter()
        .filter(|(_, o)| o.as_deref() == Some("failure"))
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(failed, ["expect.max_test_loss"]);

    // A job that dies: completion fails with the reason, expectations are skipped.
    let report = t.path("crash.xml");
    let run = t.run_env(
        &cfg,
        &[
            "--name",
            "crash",
            "--junit",
            report.to_str().unwrap(),
            "--json",
        ],
        &[("DDPJOB_FAULT", "rank=0,step=3,kind=exit")],
    );
    assert_eq!(run.code, 1);
    let last: serde_json::Value = serde_json::from_str(run.stdout.trim()).expect("one JSON line");
    assert_eq!(
        (&last["status"], &last["exit_code"]),
        (&"failed".into(), &1.into())
    );
    let (attrs, cases) = junit(&report);
    assert_eq!(
        (
            attr(&attrs, "tests"),
            attr(&attrs, "failures"),
            attr(&attrs, "skipped")
        ),
        ("6", "1", "5")
    );
    assert_eq!(cases[0].1.as_deref(), Some("failure"));
    assert!(
        cases[1..]
            .iter()
            .all(|(_, o)| o.as_deref() == Some("skipped"))
    );
    let text = std::fs::read_to_string(&report).unwrap();
    assert!(text.contains("rank 0"), "{text}");
}

#[test]
fn curves_svg_holds_the_three_series_point_for_point() {
    use ddpjob::testing::{ACCURACY_COLOR, LR_COLOR, TEST_COLOR, TRAIN_COLOR};
    let t = TestJob::new();
    let cfg = t.config("smoke", TINY);
    t.run(&cfg, &[]).success();
    let text = std::fs::read_to_string(t.job("smoke").join("curves.svg")).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("valid XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts: Vec<&str> = doc
        .descendants()
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect();
    for label in [
        "optimizer step",
        "loss",
        "accuracy (%)",
        "learning rate",
        "train loss (per log interval)",
        "test loss (per epoch)",
        "test accuracy (per epoch)",
    ] {
        assert!(texts.contains(&label), "no text {label:?} in {texts:?}");
    }
    // Each series is a polyline in its colour with one point per metrics line (the legend's
    // sample line has two).
    let points = |color: plotters::style::RGBColor| -> usize {
        let hex = format!("#{:02X}{:02X}{:02X}", color.0, color.1, color.2);
        doc.descendants()
            .filter(|n| n.has_tag_name("polyline") && n.attribute("stroke") == Some(&hex))
            .map(|n| n.attribute("points").unwrap().split_whitespace().count())
            .max()
            .unwrap_or(0)
    };
    let metrics = t.metrics("smoke");
    let count = |kind: &str| metrics.iter().filter(|m| m["kind"] == kind).count();
    assert_eq!(points(TRAIN_COLOR), count("train"));
    assert_eq!(points(TEST_COLOR), count("epoch"));
    assert_eq!(points(ACCURACY_COLOR), count("epoch"));
    assert!(points(LR_COLOR) >= count("train"));
}

#[test]
fn resume_reports_like_run_and_checks_the_expectations() {
    let t = TestJob::new();
    let cfg = t.config("smoke", &with_loose_expectations());
    t.run_env(&cfg, &[], &[("DDPJOB_FAULT", "rank=0,step=20,kind=exit")])
        .fails_with(1, "rank 0");
    let jobs = t.jobs_dir();
    let report = t.path("resume.xml");
    let run = t.ddpjob(&[
        "resume",
        "smoke",
        "--jobs-dir",
        jobs.to_str().unwrap(),
        "--json",
        "--junit",
        report.to_str().unwrap(),
    ]);
    run.success();
    let printed: serde_json::Value =
        serde_json::from_str(run.stdout.trim()).expect("exactly one JSON line on stdout");
    assert_eq!(printed, t.json(&t.job("smoke").join("summary.json")));
    assert_eq!(printed["expectations"].as_array().unwrap().len(), 5);
    let (attrs, _) = junit(&report);
    assert_eq!(
        (attr(&attrs, "tests"), attr(&attrs, "failures")),
        ("6", "0")
    );

    // Resuming a finished job does nothing, and still reports its recorded verdict.
    let run = t.ddpjob(&[
        "resume",
        "smoke",
        "--jobs-dir",
        jobs.to_str().unwrap(),
        "--json",
    ]);
    run.success();
    assert!(run.stderr.contains("already finished"), "{}", run.stderr);
    let again: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert_eq!(again, printed);
}
