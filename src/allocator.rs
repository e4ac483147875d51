//! The process's allocator, chosen once, before its first allocation, by the command it runs:
//! Microsoft's mimalloc for the commands that tokenise a job's data in this process (`run`,
//! `resume`, `validate`, `preview`: the launcher, whose rows the `tokenizers` crate encodes on
//! every core with a few small strings and vectors per token, so that 45% of its time was
//! glibc's malloc and free; with mimalloc 100 MB of text took 8.56 s instead of 11.65 s), and
//! glibc's for everything else: the workers, `bench step`, `eval` and `sample`, whose steps are
//! tuned to it (`ddpjob_kernels::keep_freed_memory`). `DDPJOB_ALLOCATOR=glibc|mimalloc`
//! overrides the choice. It is made from `getenv` and `/proc/self/cmdline`, neither of which
//! allocates, and never changes, so every block is freed by the allocator that made it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU8, Ordering};

/// The allocator the command chose.
pub struct ByCommand;

const UNDECIDED: u8 = 0;
const GLIBC: u8 = 1;
const MIMALLOC: u8 = 2;

static CHOICE: AtomicU8 = AtomicU8::new(UNDECIDED);

/// Whether this process allocates with mimalloc. The first allocation (on the main thread,
/// before any other thread exists) decides.
fn mimalloc_chosen() -> bool {
    let choice = CHOICE.load(Ordering::Relaxed);
    if choice != UNDECIDED {
        return choice == MIMALLOC;
    }
    let decided = decide();
    CHOICE.store(decided, Ordering::Relaxed);
    decided == MIMALLOC
}

/// The choice, from `DDPJOB_ALLOCATOR`, else the subcommand (the first argument).
fn decide() -> u8 {
    // SAFETY: a NUL-terminated name; the value is read at once, before any thread could change
    // the environment.
    let forced = unsafe { libc::getenv(c"DDPJOB_ALLOCATOR".as_ptr()) };
    if !forced.is_null() {
        // SAFETY: getenv returned a NUL-terminated string.
        match unsafe { std::ffi::CStr::from_ptr(forced) }.to_bytes() {
            b"mimalloc" => return MIMALLOC,
            b"glibc" | b"system" => return GLIBC,
            _ => {}
        }
    }
    let mut args = [0u8; 4096];
    // SAFETY: open, read into a buffer of its length, close: plain system calls.
    let read = unsafe {
        let fd = libc::open(
            c"/proc/self/cmdline".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        );
        if fd < 0 {
            return GLIBC;
        }
        let n = libc::read(fd, args.as_mut_ptr().cast(), args.len());
        libc::close(fd);
        n
    };
    if read <= 0 {
        return GLIBC;
    }
    let command = args[..read as usize].split(|&b| b == 0).nth(1);
    match command {
        Some(b"run" | b"resume" | b"validate" | b"preview") => MIMALLOC,
        _ => GLIBC,
    }
}

// SAFETY: every call goes to one allocator, the same for the life of the process.
unsafe impl GlobalAlloc for ByCommand {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match mimalloc_chosen() {
                true => mimalloc::MiMalloc.alloc(layout),
                false => System.alloc(layout),
            }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match mimalloc_chosen() {
                true => mimalloc::MiMalloc.alloc_zeroed(layout),
                false => System.alloc_zeroed(layout),
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from the same allocator (the choice never changes).
        unsafe {
            match mimalloc_chosen() {
                true => mimalloc::MiMalloc.dealloc(ptr, layout),
                false => System.dealloc(ptr, layout),
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from the same allocator (the choice never changes).
        unsafe {
            match mimalloc_chosen() {
                true => mimalloc::MiMalloc.realloc(ptr, layout, new_size),
                false => System.realloc(ptr, layout, new_size),
            }
        }
    }
}
