mod allocator;

/// Chosen by the command, once (see `allocator`).
#[global_allocator]
static ALLOCATOR: allocator::ByCommand = allocator::ByCommand;

fn main() -> std::process::ExitCode {
    // `eval` and `sample` keep the memory they free (see keep_freed_memory), set before any
    // thread starts: glibc fixes its number of arenas at the first thread's allocation. A
    // worker and `bench step` decide once they know their job's model; the launcher keeps
    // glibc's arena per thread (it tokenises a job's data on every core).
    if matches!(std::env::args().nth(1).as_deref(), Some("eval" | "sample")) {
        ddpjob_kernels::keep_freed_memory(true);
    }
    ddpjob::cli::main()
}
