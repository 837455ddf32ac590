//! What the kernel tests share: deterministic random inputs (candle's own RNG is unseeded).

use candle_core::{Device, Tensor};

/// An xorshift generator; each test seeds its own.
pub struct Rng(pub u64);

impl Rng {
    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }

    /// A CPU f32 tensor of values in `[-amp, amp)`.
    pub fn tensor(&mut self, shape: &[usize], amp: f32) -> Tensor {
        let n = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| (self.uniform() * 2.0 - 1.0) * amp).collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }
}
