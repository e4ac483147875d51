fn main() -> std::process::ExitCode {
    // The processes that train or evaluate keep the memory they free (one arena, never
    // trimmed: see keep_freed_memory), set before any thread starts: glibc fixes its number of
    // arenas at the first thread's allocation. The others keep glibc's arena per thread: the
    // launcher tokenises a job's data on every core, and one arena's lock halved its rate.
    let command = std::env::args().nth(1);
    if matches!(
        command.as_deref(),
        Some("worker" | "bench-worker" | "bench" | "eval" | "sample")
    ) {
        ddpjob_kernels::keep_freed_memory();
    }
    ddpjob::cli::main()
}
