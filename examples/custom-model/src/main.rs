//! `custom-model`: a trainer of its own, built on ddpjob. It registers a network
//! (`tiny-resnet`) and a data set (`csv`) next to ddpjob's built-in ones and gets the whole
//! runner as its command line: `custom-model run job.toml --nproc-per-node 2`, `resume`,
//! `validate`, `show`, `list`.

mod csv;
mod resnet;

use ddpjob::{ExitCode, Registry};

fn main() -> ExitCode {
    ddpjob::cli::main_with(
        Registry::builtin()
            .model("tiny-resnet", resnet::TinyResNet::build)
            .dataset_with("csv", csv::CsvDataset::open),
    )
}
