//! CPython's `random.Random(seed).sample`: how the harness draws few-shot examples (its default
//! sampler, seeded with 1234 as lm-eval's `fewshot_random_seed`). The generator is MT19937
//! (`rand_mt`, seeded as CPython's `init_by_array`); `getrandbits`, `_randbelow` and `sample`'s
//! two algorithms are CPython's, written here so the same seed picks the same documents.

use rand_mt::Mt;

/// A `random.Random(seed)` for an integer seed.
pub struct PyRandom {
    mt: Mt,
}

impl PyRandom {
    /// `random.Random(seed)`: the seed's 32-bit words, least significant first (`[0]` for 0).
    pub fn new(seed: u64) -> Self {
        let mut key = Vec::new();
        let mut s = seed;
        while s > 0 {
            key.push(s as u32);
            s >>= 32;
        }
        if key.is_empty() {
            key.push(0);
        }
        Self {
            mt: Mt::new_with_key(key),
        }
    }

    /// `getrandbits(k)` for `1 <= k <= 64`.
    fn getrandbits(&mut self, k: u32) -> u64 {
        if k <= 32 {
            return u64::from(self.mt.next_u32() >> (32 - k));
        }
        let low = u64::from(self.mt.next_u32());
        let high = u64::from(self.mt.next_u32() >> (64 - k));
        low | (high << 32)
    }

    /// `_randbelow(n)`: a uniform integer below `n` by rejection over `n.bit_length()` bits.
    fn randbelow(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let k = usize::BITS - n.leading_zeros();
        loop {
            let r = self.getrandbits(k) as usize;
            if r < n {
                return r;
            }
        }
    }

    /// `sample(range(n), k)`: `k` distinct indices below `n`, in draw order.
    pub fn sample(&mut self, n: usize, k: usize) -> Vec<usize> {
        assert!(k <= n, "sample larger than population");
        let mut setsize = 21usize;
        if k > 5 {
            let exp = ((k * 3) as f64).ln() / 4f64.ln();
            setsize += 4usize.pow(exp.ceil() as u32);
        }
        let mut result = Vec::with_capacity(k);
        if n <= setsize {
            let mut pool: Vec<usize> = (0..n).collect();
            for i in 0..k {
                let j = self.randbelow(n - i);
                result.push(pool[j]);
                pool[j] = pool[n - i - 1];
            }
        } else {
            let mut selected = std::collections::HashSet::new();
            for _ in 0..k {
                let mut j = self.randbelow(n);
                while selected.contains(&j) {
                    j = self.randbelow(n);
                }
                selected.insert(j);
                result.push(j);
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python 3.11: `r = random.Random(1234); [r.sample(range(20), 5) for _ in range(3)]` and
    /// the others below.
    #[test]
    fn draws_what_cpython_draws() {
        let mut r = PyRandom::new(1234);
        assert_eq!(r.sample(20, 5), [14, 3, 0, 2, 1]);
        assert_eq!(r.sample(20, 5), [2, 3, 11, 7, 0]);
        assert_eq!(r.sample(20, 5), [0, 19, 11, 15, 14]);
        let mut r = PyRandom::new(1234);
        assert_eq!(r.sample(7473, 5), [6374, 3610, 957, 61, 742]);
        assert_eq!(r.sample(7473, 5), [7462, 6610, 4769, 286, 5501]);
        let mut r = PyRandom::new(1234);
        assert_eq!(r.sample(10, 6), [7, 1, 0, 9, 4, 6]);
        assert_eq!(r.sample(3, 3), [2, 0, 1]);
        assert_eq!(
            &r.sample(100, 50)[..10],
            [98, 45, 30, 2, 3, 96, 44, 82, 79, 61]
        );
    }
}
