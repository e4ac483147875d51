//! `[expect]` checked against a finished run's summary: the verdict a CI smoke job needs beyond
//! "it did not crash". Results are recorded in `summary.json` and decide the exit status.

use crate::config::{Check, Expectation};
use crate::train::{ExpectationResult, Summary};

/// Checks every expectation; a value that is not finite never meets one.
pub fn check(expect: &[Expectation], summary: &Summary) -> Vec<ExpectationResult> {
    expect
        .iter()
        .map(|e| {
            let value = match e.check {
                Check::MinTestAccuracy => summary.test_accuracy,
                Check::MaxTestLoss => summary.test_loss,
                Check::MaxTestPerplexity => summary.more_metrics.value("perplexity"),
                Check::MaxFinalLoss => summary.final_train_loss,
                Check::MaxWallS => summary.wall_s,
                Check::MinTrainSamplesPerS => summary.train_samples_per_s,
                Check::MinRewardsAccuracies => summary.more_metrics.value("rewards/accuracies"),
                Check::MinRewardsMargins => summary.more_metrics.value("rewards/margins"),
            };
            let met = value.is_finite()
                && if e.check.is_minimum() {
                    value >= e.threshold
                } else {
                    value <= e.threshold
                };
            ExpectationResult {
                name: e.check.key().to_string(),
                metric: e.check.metric().to_string(),
                threshold: e.threshold,
                value: value.is_finite().then_some(value),
                met,
            }
        })
        .collect()
}

/// The unmet ones, one line each, for an error message; `None` if all were met.
pub fn unmet_report(results: &[ExpectationResult]) -> Option<String> {
    let unmet: Vec<String> = results
        .iter()
        .filter(|r| !r.met)
        .map(|r| format!("  expect.{}", r.describe()))
        .collect();
    (!unmet.is_empty()).then(|| {
        format!(
            "{} of {} expectation(s) unmet:\n{}",
            unmet.len(),
            results.len(),
            unmet.join("\n")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary() -> Summary {
        Summary {
            test_accuracy: 0.85,
            test_loss: 0.4,
            more_metrics: Default::default(),
            final_train_loss: f64::NAN,
            epochs: 1,
            steps: 10,
            train_samples_per_s: 5000.0,
            wall_s: 12.5,
            train_s: 10.0,
            samples: 640,
            world_size: 1,
            parameters: 100,
            trainable_parameters: None,
            train_tokens_per_s: None,
            best_test_loss: None,
            best_step: None,
            peak_rss_bytes: Vec::new(),
            estimated_peak_bytes: None,
            stopped_early: None,
            expectations: Vec::new(),
            metrics: Vec::new(),
        }
    }

    fn expect(check: Check, threshold: f64) -> Expectation {
        Expectation { check, threshold }
    }

    #[test]
    fn each_bound_compares_in_its_direction_and_nan_never_passes() {
        let results = check(
            &[
                expect(Check::MinTestAccuracy, 0.9),
                expect(Check::MaxTestLoss, 0.5),
                expect(Check::MaxFinalLoss, 10.0),
                expect(Check::MaxWallS, 12.5),
                expect(Check::MinTrainSamplesPerS, 5000.0),
            ],
            &summary(),
        );
        let met: Vec<bool> = results.iter().map(|r| r.met).collect();
        assert_eq!(met, [false, true, false, true, true]);
        assert_eq!(results[0].value, Some(0.85));
        assert_eq!(results[2].value, None);
        assert_eq!(
            results[0].describe(),
            "min_test_accuracy: test_accuracy 0.85 is below the minimum 0.9"
        );
        assert_eq!(
            results[2].describe(),
            "max_final_loss: final_train_loss NaN is not a number (threshold 10)"
        );
        let report = unmet_report(&results).unwrap();
        assert!(
            report.starts_with("2 of 5 expectation(s) unmet:"),
            "{report}"
        );
        assert!(report.contains("expect.min_test_accuracy"), "{report}");
        assert!(unmet_report(&results[1..2]).is_none());

        // Thresholds as written; a value rounded only where that keeps the verdict readable.
        let close = Summary {
            test_accuracy: 0.84996,
            test_loss: 0.00004,
            ..summary()
        };
        let results = check(
            &[
                expect(Check::MinTestAccuracy, 0.85),
                expect(Check::MinTestAccuracy, 0.99995),
                expect(Check::MaxTestLoss, 1e-9),
            ],
            &close,
        );
        let described: Vec<String> = results.iter().map(|r| r.describe()).collect();
        assert_eq!(
            described,
            [
                "min_test_accuracy: test_accuracy 0.84996 is below the minimum 0.85",
                "min_test_accuracy: test_accuracy 0.85 is below the minimum 0.99995",
                "max_test_loss: test_loss 0.00004 is above the maximum 0.000000001",
            ]
        );
    }

    #[test]
    fn perplexity_is_checked_when_the_task_reports_it() {
        let limit = [expect(Check::MaxTestPerplexity, 1.5)];
        // A classifier's summary has none: never met.
        assert_eq!(check(&limit, &summary())[0].value, None);
        let mut language = summary();
        language.more_metrics.set("perplexity", 0.4f64.exp());
        let result = &check(&limit, &language)[0];
        assert!(result.met, "{}", result.describe());
        assert_eq!(
            result.describe(),
            "max_test_perplexity: test_perplexity 1.4918 is at most the maximum 1.5"
        );
    }
}
