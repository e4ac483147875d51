//! `ddpjob completions` and `ddpjob man`: generated from the CLI definition, so they list the
//! real subcommands and flags.

use crate::common::TestJob;

#[test]
fn completions_name_every_subcommand_for_each_shell() {
    let t = TestJob::new();
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let run = t.ddpjob(&["completions", shell]);
        run.success();
        for word in ["run", "resume", "show", "list", "junit", "jobs-dir"] {
            assert!(run.stdout.contains(word), "{shell} completion lacks {word}");
        }
        assert!(
            !run.stdout.contains("bench-worker"),
            "hidden commands stay hidden"
        );
    }
    t.ddpjob(&["completions", "tcsh"])
        .fails_with(2, "invalid value 'tcsh'");
}

#[test]
fn man_prints_the_page_or_writes_one_per_subcommand() {
    let t = TestJob::new();
    let run = t.ddpjob(&["man"]);
    run.success();
    assert!(run.stdout.contains(".TH ddpjob 1"), "{}", run.stdout);
    assert!(run.stdout.contains(".SH SUBCOMMANDS") && run.stdout.contains("show"));

    let dir = t.path("man");
    t.ddpjob(&["man", "--dir", dir.to_str().unwrap()]).success();
    let run_page = std::fs::read_to_string(dir.join("ddpjob-run.1")).expect("ddpjob-run.1");
    assert!(run_page.contains(".TH ddpjob-run 1"));
    assert!(run_page.contains("\\-\\-junit"), "{run_page}");
    for page in ["ddpjob.1", "ddpjob-show.1", "ddpjob-bench-step.1"] {
        assert!(dir.join(page).exists(), "{page} missing");
    }
    assert!(!dir.join("ddpjob-worker.1").exists());
}
