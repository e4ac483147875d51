//! LoRA adapters switched off for a pass: what a preference objective's reference is when the
//! policy is adapters over a frozen base (TRL's `disable_adapter()`): the same model, its
//! linear layers computing the base alone, with no second copy of the weights. The objective
//! calls [`without`] around the reference's forward; a model's linear layers ask [`are_off`].
//!
//! A thread-local, as `gate` is: the switch must hold for one forward pass and never for a
//! pass another thread runs at the same time (row shards of a step run side by side, the
//! policy's beside the reference's). A model's layers run on the thread that calls its
//! forward; the kernels they launch split arithmetic over threads, never the choice of layers.

use std::cell::Cell;

thread_local! {
    static OFF: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with this thread's LoRA adapters switched off (restored however `f` ends).
pub fn without<R>(f: impl FnOnce() -> R) -> R {
    crate::thread_switch::on_within(&OFF, f)
}

/// Whether the adapters are off on this thread (a layer then computes its base alone).
pub fn are_off() -> bool {
    OFF.get()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_switch_holds_inside_only_and_on_this_thread_only() {
        assert!(!super::are_off());
        super::without(|| {
            assert!(super::are_off());
            let elsewhere = std::thread::spawn(super::are_off).join().unwrap();
            assert!(!elsewhere);
        });
        assert!(!super::are_off());
        let caught = std::panic::catch_unwind(|| super::without(|| panic!("inside")));
        assert!(caught.is_err());
        assert!(!super::are_off(), "restored after a panic");
    }
}
