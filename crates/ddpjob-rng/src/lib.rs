//! Seeded randomness. Candle's CPU RNG cannot be seeded, so ddpjob has its own: the Mersenne
//! Twister that `torch.Generator` uses, so `randperm(n)` for a seed matches torch's CPU one.
//!
//! A leaf of the workspace: it depends on nothing, so the sampler, the models' initialisers
//! and the kernels' tests share one generator.

/// MT19937, initialised as `torch.Generator().manual_seed(seed)` does (seed truncated to 32 bits).
#[derive(Clone)]
pub struct Mt19937 {
    state: [u32; 624],
    index: usize,
}

impl Mt19937 {
    pub fn new(seed: u64) -> Self {
        let mut state = [0u32; 624];
        state[0] = seed as u32;
        for i in 1..624 {
            let prev = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 { state, index: 624 }
    }

    fn twist(&mut self) {
        for i in 0..624 {
            let y = (self.state[i] & 0x8000_0000) | (self.state[(i + 1) % 624] & 0x7fff_ffff);
            let mut next = self.state[(i + 397) % 624] ^ (y >> 1);
            if y & 1 != 0 {
                next ^= 0x9908_b0df;
            }
            self.state[i] = next;
        }
        self.index = 0;
    }

    pub fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// Uniform in [0, 1) with 24 bits of precision.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 * (1.0 / 16_777_216.0)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.next_f32()
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = (self.next_f32() as f64).max(1e-12);
        let u2 = self.next_f32() as f64;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    /// A random permutation of `0..n`, the same as torch's CPU `randperm(n, generator=g)` for
    /// n < 2^32 / 20 (Fisher–Yates with `random() % (n - i)`, as in ATen's `randperm_cpu`).
    pub fn randperm(&mut self, n: usize) -> Vec<usize> {
        let mut perm: Vec<usize> = (0..n).collect();
        for i in 0..n.saturating_sub(1) {
            let z = self.next_u32() as usize % (n - i);
            perm.swap(i, z + i);
        }
        perm
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_mt19937_sequence() {
        // Reference: C++ std::mt19937 default seed 5489; its 10000th output is 4123659995
        // (required by the C++ standard, [rand.predef]).
        let mut mt = Mt19937::new(5489);
        let first = mt.next_u32();
        assert_eq!(first, 3_499_211_612);
        for _ in 1..9999 {
            mt.next_u32();
        }
        assert_eq!(mt.next_u32(), 4_123_659_995);
    }

    #[test]
    fn randperm_matches_torch() {
        // torch 2.x: g = torch.Generator(); g.manual_seed(s); torch.randperm(n, generator=g).tolist()
        assert_eq!(
            Mt19937::new(0).randperm(10),
            vec![4, 1, 7, 5, 3, 9, 0, 8, 6, 2]
        );
        assert_eq!(
            Mt19937::new(5).randperm(10),
            vec![1, 4, 9, 6, 3, 5, 0, 2, 8, 7]
        );
        assert_eq!(
            Mt19937::new(7).randperm(10),
            vec![5, 0, 3, 4, 1, 7, 9, 6, 8, 2]
        );
        let p = Mt19937::new(1).randperm(60_000);
        assert_eq!(p[..5], [35845, 27522, 33254, 23645, 11299]);
        assert_eq!(p[59_995..], [6467, 3437, 21675, 36444, 12053]);
    }

    #[test]
    fn randperm_is_a_permutation_and_depends_on_the_seed() {
        let a = Mt19937::new(0).randperm(1000);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_eq!(a, Mt19937::new(0).randperm(1000));
        assert_ne!(a, Mt19937::new(1).randperm(1000));
    }
}
