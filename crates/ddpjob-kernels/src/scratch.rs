//! Reused f32 buffers for values that are written in full before they are read (activations,
//! input gradients). A training step allocates the same few dozen buffers every time; taking
//! them from here skips the allocator's zero-filling of each (measured: 4% of a GPT step on
//! the CPU). Buffers are per thread, so shards never share one.
//!
//! A thread keeps, of each length, at most as many buffers as it has had out at once: what
//! its next step takes again. Buffers handed back beyond that count, or of a length this
//! thread never takes (taken on another thread), are freed, so the pool holds no more than a
//! step's working set.

use std::cell::RefCell;

/// Buffers kept per thread, whatever their lengths (a step of the largest built-in model uses
/// fewer).
const KEPT: usize = 96;

/// The buffers of one length, and how many of that length this thread has had out.
struct Slot {
    len: usize,
    free: Vec<Vec<f32>>,
    /// Taken and not yet handed back.
    out: usize,
    /// The most ever out at once: how many the pool keeps.
    most: usize,
}

#[derive(Default)]
struct Pool {
    slots: Vec<Slot>,
    kept: usize,
}

thread_local! {
    static POOL: RefCell<Pool> = RefCell::new(Pool::default());
}

/// A buffer of `len` values whose contents are unspecified (left from an earlier use, or
/// zeros): only for outputs the caller writes in full before reading any of them.
pub fn take(len: usize) -> Vec<f32> {
    if len == 0 {
        return Vec::new();
    }
    let reused = POOL.with(|pool| {
        let pool = &mut *pool.borrow_mut();
        let slot = match pool.slots.iter().position(|s| s.len == len) {
            Some(i) => &mut pool.slots[i],
            None => {
                pool.slots.push(Slot {
                    len,
                    free: Vec::new(),
                    out: 0,
                    most: 0,
                });
                pool.slots.last_mut().expect("just pushed")
            }
        };
        slot.out += 1;
        slot.most = slot.most.max(slot.out);
        let reused = slot.free.pop();
        pool.kept -= usize::from(reused.is_some());
        reused
    });
    reused.unwrap_or_else(|| vec![0f32; len])
}

/// Hands buffers back for [`take`] on this thread; those it would not take again are freed.
pub fn give(buffers: impl IntoIterator<Item = Vec<f32>>) {
    POOL.with(|pool| {
        let pool = &mut *pool.borrow_mut();
        for buffer in buffers {
            let Some(slot) = pool.slots.iter_mut().find(|s| s.len == buffer.len()) else {
                continue;
            };
            slot.out = slot.out.saturating_sub(1);
            if slot.free.len() < slot.most && pool.kept < KEPT {
                slot.free.push(buffer);
                pool.kept += 1;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept() -> usize {
        POOL.with(|pool| pool.borrow().kept)
    }

    #[test]
    fn a_buffer_given_back_is_taken_again_by_its_length() {
        let mut a = take(5);
        a[0] = 7.0;
        let b = take(3);
        give([a, b.into_iter().map(|_| 1.0).collect()]);
        assert_eq!(
            take(5)[0],
            7.0,
            "the same buffer, contents left as they were"
        );
        assert_eq!(take(3), vec![1.0; 3]);
        assert_eq!(take(4), vec![0.0; 4], "nothing of that length: a fresh one");
    }

    #[test]
    fn buffers_beyond_what_was_out_at_once_are_freed() {
        // A step takes two buffers of one length and hands back three (the third made by
        // other code): the pool keeps two, step after step.
        for _ in 0..10 {
            let (a, b) = (take(11), take(11));
            give([a, b, vec![0.0; 11]]);
        }
        assert_eq!(kept(), 2);
        // A length never taken on this thread (a buffer from another thread) is not kept.
        give([vec![0.0; 13]]);
        assert_eq!(kept(), 2);
    }
}
