//! The JUnit XML report of `run --junit FILE`: one test case for "the job ran to completion" and
//! one per expectation, so CI systems (GitHub, GitLab, Jenkins) show a smoke job's verdict natively.

use std::fmt::Write;

use crate::config::Expectation;
use crate::train::Summary;

/// How the run ended, as far as the report is concerned.
pub enum Completion<'a> {
    Finished(&'a Summary),
    /// The job failed, was interrupted, or never started (a config error); the message says why.
    Failed(&'a str),
    /// This command's part ended well but it holds no summary to check (a node other than 0);
    /// the message says where the results are.
    Unchecked(&'a str),
}

/// The whole report. `expect` is the job's `[expect]` (expectations of a job that did not
/// finish are reported as skipped); `wall_s` is the command's time.
pub fn render(job: &str, expect: &[Expectation], completion: &Completion, wall_s: f64) -> String {
    let mut cases = String::new();
    let (mut tests, mut failures, mut skipped) = (1, 0, 0);
    let completed = match completion {
        Completion::Failed(why) => {
            failures += 1;
            Some(("failure", "the job did not finish", *why))
        }
        Completion::Finished(_) | Completion::Unchecked(_) => None,
    };
    case(
        &mut cases,
        job,
        "the job ran to completion",
        wall_s,
        completed,
    );
    match completion {
        Completion::Finished(summary) => {
            for r in &summary.expectations {
                let describe = r.describe();
                let outcome = (!r.met).then_some(("failure", describe.as_str(), describe.as_str()));
                tests += 1;
                failures += usize::from(!r.met);
                case(&mut cases, job, &format!("expect.{}", r.name), 0.0, outcome);
            }
        }
        Completion::Failed(_) | Completion::Unchecked(_) => {
            let why = match completion {
                Completion::Unchecked(note) => format!("not checked here: {note}"),
                _ => "not checked: the job did not finish".to_string(),
            };
            for e in expect {
                tests += 1;
                skipped += 1;
                let name = format!("expect.{}", e.check.key());
                case(&mut cases, job, &name, 0.0, Some(("skipped", &why, "")));
            }
        }
    }
    let mut xml = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let suite_attrs = format!(
        "name=\"ddpjob.{}\" tests=\"{tests}\" failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\" time=\"{wall_s:.3}\"",
        escape(job)
    );
    let _ = writeln!(xml, "<testsuites {suite_attrs}>");
    let _ = writeln!(xml, "  <testsuite {suite_attrs}>");
    if let Completion::Finished(s) = completion {
        xml.push_str("    <properties>\n");
        // `test_accuracy` and `test_loss` always; the task's other metrics when they are
        // numbers.
        let contract = [("accuracy", s.test_accuracy), ("loss", s.test_loss)];
        let more = s.more_metrics.iter().filter(|(_, v)| v.is_finite());
        let metrics = contract
            .into_iter()
            .chain(more)
            .map(|(name, value)| (format!("test_{name}"), value));
        let run = [
            ("final_train_loss", s.final_train_loss),
            ("train_samples_per_s", s.train_samples_per_s),
            ("wall_s", s.wall_s),
        ];
        for (name, value) in metrics.chain(run.map(|(n, v)| (n.to_string(), v))) {
            let _ = writeln!(xml, "      <property name=\"{name}\" value=\"{value}\"/>");
        }
        xml.push_str("    </properties>\n");
    }
    xml.push_str(&cases);
    xml.push_str("  </testsuite>\n</testsuites>\n");
    xml
}

/// One `<testcase>`; `outcome` is (element, message attribute, body) for a failure or a skip.
fn case(out: &mut String, job: &str, name: &str, time: f64, outcome: Option<(&str, &str, &str)>) {
    let head = format!(
        "    <testcase classname=\"ddpjob.{}\" name=\"{}\" time=\"{time:.3}\"",
        escape(job),
        escape(name)
    );
    match outcome {
        None => {
            let _ = writeln!(out, "{head}/>");
        }
        Some((element, message, body)) => {
            let _ = writeln!(out, "{head}>");
            if body.is_empty() {
                let _ = writeln!(out, "      <{element} message=\"{}\"/>", escape(message));
            } else {
                let _ = writeln!(
                    out,
                    "      <{element} message=\"{}\">{}</{element}>",
                    escape(message),
                    escape_text(body)
                );
            }
            out.push_str("    </testcase>\n");
        }
    }
}

/// Escapes text for an XML attribute, dropping characters XML 1.0 cannot hold (control
/// characters from a worker's log tail, say).
fn escape(text: &str) -> String {
    escape_as(text, true)
}

/// As [`escape`], for element text, where line breaks stay line breaks.
fn escape_text(text: &str) -> String {
    escape_as(text, false)
}

fn escape_as(text: &str, attribute: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\n' if attribute => out.push_str("&#10;"),
            '\n' => out.push('\n'),
            '\t' | '\r' => out.push(' '),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_that_did_not_finish_fails_completion_and_skips_its_expectations() {
        let expect = [
            Expectation {
                check: crate::config::Check::MinTestAccuracy,
                threshold: 0.9,
            },
            Expectation {
                check: crate::config::Check::MaxWallS,
                threshold: 60.0,
            },
        ];
        let why = "rank 1 exited with status 1:\n  <log tail> & more";
        let xml = render("smoke", &expect, &Completion::Failed(why), 1.5);
        let doc = roxmltree::Document::parse(&xml).unwrap();
        let suite = doc
            .descendants()
            .find(|n| n.has_tag_name("testsuite"))
            .unwrap();
        let attr = |name| suite.attribute(name).unwrap();
        assert_eq!(
            (attr("tests"), attr("failures"), attr("skipped")),
            ("3", "1", "2")
        );
        let failure = doc
            .descendants()
            .find(|n| n.has_tag_name("failure"))
            .unwrap();
        assert_eq!(failure.text(), Some(why));
        let skipped: Vec<_> = doc
            .descendants()
            .filter(|n| n.has_tag_name("testcase"))
            .filter(|n| n.children().any(|c| c.has_tag_name("skipped")))
            .map(|n| n.attribute("name").unwrap().to_string())
            .collect();
        assert_eq!(skipped, ["expect.min_test_accuracy", "expect.max_wall_s"]);
    }

    #[test]
    fn escapes_markup_and_drops_what_xml_cannot_hold() {
        assert_eq!(
            escape("a<b & \"c\"\u{1b}[31m\nd"),
            "a&lt;b &amp; &quot;c&quot;[31m&#10;d"
        );
    }
}
