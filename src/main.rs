fn main() -> std::process::ExitCode {
    // Before any thread starts: glibc fixes its number of arenas at the first thread's
    // allocation (see keep_freed_memory).
    ddpjob_kernels::keep_freed_memory();
    ddpjob::cli::main()
}
