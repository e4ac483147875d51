//! `distributed.sharding = "full"` (ZeRO-3 / FSDP): a training pass that goes block by block
//! asks for each block's parameters just before the block's forward and again before its
//! backward, and says when it is done with them, so the trainer can keep only this rank's
//! share of them the rest of the time (see `train::full`). The pass calls [`gather`] and
//! [`release`]; the trainer answers through the [`BlockGate`] it installs with [`run_with`],
//! on the thread that runs the pass, for as long as the pass runs (a training step's, an
//! evaluation's). With none installed (every other mode, `sample`, `eval`) both do nothing.
//!
//! A thread-local rather than an argument: the gate holds the communicator (the collectives
//! that gather), which lives with the trainer, while [`crate::Model::train_pass`] and
//! [`crate::TrainPass::backward_to`] are the model's seam for any user's model, unchanged.

use std::cell::Cell;
use std::ptr::NonNull;

use candle_core::Result;

/// A unit of parameters that a pass gathers and releases as one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Block `i`'s (what [`crate::Model::shard_parameters`] lists as its i-th block).
    Block(usize),
    /// Every parameter of no block (embeddings, the final norm, the head): gathered from the
    /// start of a pass's forward to the end of its backward, as FSDP keeps its root unit's.
    Rest,
}

/// What answers a pass's [`gather`] and [`release`] (the trainer's sharded parameters).
pub trait BlockGate {
    /// The unit's parameters are about to be read: give them their values.
    fn gather(&mut self, unit: Unit) -> Result<()>;
    /// The pass is done with the unit's parameters until it asks again.
    fn release(&mut self, unit: Unit) -> Result<()>;
}

thread_local! {
    static INSTALLED: Cell<Option<NonNull<dyn BlockGate>>> = const { Cell::new(None) };
}

/// Runs `f` with `gate` answering this thread's [`gather`] and [`release`] calls.
pub fn run_with<R>(gate: &mut dyn BlockGate, f: impl FnOnce() -> R) -> R {
    /// Puts back whatever was installed before, however `f` ends (a panic included).
    struct Restore(Option<NonNull<dyn BlockGate>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            INSTALLED.set(self.0);
        }
    }
    let pointer = NonNull::from(gate);
    // SAFETY: only the lifetime is erased. The pointer is reachable only through this
    // thread's INSTALLED, and only until `Restore` drops at the end of this call, within
    // which `gate` is mutably borrowed by us and used by nothing else.
    let pointer: NonNull<dyn BlockGate + 'static> = unsafe { std::mem::transmute(pointer) };
    let _restore = Restore(INSTALLED.replace(Some(pointer)));
    f()
}

/// Asks the installed gate for `unit`'s parameters (nothing when none is installed).
pub fn gather(unit: Unit) -> Result<()> {
    with_installed(|gate| gate.gather(unit))
}

/// Tells the installed gate that the pass is done with `unit`'s parameters.
pub fn release(unit: Unit) -> Result<()> {
    with_installed(|gate| gate.release(unit))
}

fn with_installed(f: impl FnOnce(&mut dyn BlockGate) -> Result<()>) -> Result<()> {
    /// Puts the gate back however its call ends (a panic caught further up included).
    struct PutBack(NonNull<dyn BlockGate>);
    impl Drop for PutBack {
        fn drop(&mut self) {
            INSTALLED.set(Some(self.0));
        }
    }
    // Taken out while in use, so a gate that called back in would find none rather than a
    // second mutable reference to itself.
    let Some(mut pointer) = INSTALLED.take() else {
        return Ok(());
    };
    let _put_back = PutBack(pointer);
    // SAFETY: installed by `run_with`, whose borrow of the gate outlives this call (the
    // pointer is removed before `run_with` returns), on this thread; nothing else holds it
    // now that it is taken out.
    f(unsafe { pointer.as_mut() })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Log(Vec<String>);

    impl BlockGate for Log {
        fn gather(&mut self, unit: Unit) -> Result<()> {
            self.0.push(format!("gather {unit:?}"));
            Ok(())
        }
        fn release(&mut self, unit: Unit) -> Result<()> {
            // A call from inside a gate finds none installed.
            gather(Unit::Rest)?;
            self.0.push(format!("release {unit:?}"));
            Ok(())
        }
    }

    #[test]
    fn a_gate_answers_only_within_its_run_and_on_its_thread() {
        gather(Unit::Block(0)).unwrap(); // none installed: nothing happens
        let mut log = Log(Vec::new());
        run_with(&mut log, || {
            gather(Unit::Block(1)).unwrap();
            std::thread::scope(|s| s.spawn(|| gather(Unit::Block(9)).unwrap()).join().unwrap());
            release(Unit::Block(1)).unwrap();
        });
        gather(Unit::Block(2)).unwrap();
        assert_eq!(log.0, ["gather Block(1)", "release Block(1)"]);
        // Uninstalled after a panic too.
        let mut log = Log(Vec::new());
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_with(&mut log, || panic!("a failing pass"))
        }));
        assert!(panicked.is_err());
        gather(Unit::Rest).unwrap();
        assert!(log.0.is_empty());
    }
}
