//! The tests' one generator of pseudo-random numbers: deterministic from its seed (a failing
//! run says its seed, and runs again the same), any seed will do, and no crate is needed.

/// A linear congruential generator (Knuth's MMIX constants); its high bits are what it gives.
pub struct Rng(pub u64);

impl Rng {
    /// The next number, of 31 bits.
    pub fn draw(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.draw() % n.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_one_sequence_and_every_value_stays_below() {
        let (mut a, mut b) = (Rng(7), Rng(7));
        let seq: Vec<u64> = (0..100).map(|_| a.below(10)).collect();
        assert_eq!(seq, (0..100).map(|_| b.below(10)).collect::<Vec<_>>());
        assert!(seq.iter().all(|&v| v < 10));
        assert!(
            (0..10).all(|v| seq.contains(&v)),
            "every value comes: {seq:?}"
        );
        assert_eq!(Rng(0).below(0), 0);
    }
}
