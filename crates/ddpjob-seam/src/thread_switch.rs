//! A switch that holds on one thread for the length of a call: how `adapters` and `row_passes`
//! tell a model's layers about the pass they are in (a model's layers run on the thread that
//! calls its forward; row shards of a step run side by side on others).

use std::cell::Cell;
use std::thread::LocalKey;

/// Runs `f` with this thread's `switch` on, restored however `f` ends.
pub(crate) fn on_within<R>(switch: &'static LocalKey<Cell<bool>>, f: impl FnOnce() -> R) -> R {
    struct Restore(&'static LocalKey<Cell<bool>>, bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            self.0.set(self.1);
        }
    }
    let _restore = Restore(switch, switch.replace(true));
    f()
}
