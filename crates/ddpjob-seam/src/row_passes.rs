//! Passes kept side by side until one backward: a preference objective's per-row passes
//! (DPO's, each row's loss its own pass, all backpropagated after the pairs are scored). A
//! loss that is one of several such must hold nothing large from its forward to its
//! backward: the CPU head of a large vocabulary, which otherwise makes its weight's gradient in
//! its forward (a vocabulary × channels tensor, 622 MB at Qwen3's head), asks [`active`] and
//! then makes it in its backward. The objective calls [`within`] around each row's pass.
//!
//! A thread-local, as `adapters` is: a model's layers and head run on the thread that calls its
//! forward, and row shards of a step run side by side on other threads.

use std::cell::Cell;

thread_local! {
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` as one of several passes kept to one backward (restored however `f` ends).
pub fn within<R>(f: impl FnOnce() -> R) -> R {
    crate::thread_switch::on_within(&ACTIVE, f)
}

/// Whether this thread's pass is one of several kept to one backward.
pub fn active() -> bool {
    ACTIVE.get()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_switch_holds_inside_only_and_on_this_thread_only() {
        assert!(!super::active());
        super::within(|| {
            assert!(super::active());
            assert!(!std::thread::spawn(super::active).join().unwrap());
        });
        assert!(!super::active());
        let caught = std::panic::catch_unwind(|| super::within(|| panic!("inside")));
        assert!(
            caught.is_err() && !super::active(),
            "restored after a panic"
        );
    }
}
