//! The `ddpjob` binary: everything lives in the library; see `ddpjob --help`.

fn main() -> std::process::ExitCode {
    ddpjob::cli::main()
}
