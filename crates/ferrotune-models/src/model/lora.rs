//! LoRA and DoRA adapters on a [`Linear`](crate::model::Linear), with PEFT's arithmetic.
//!
//! The adapter is applied on top of the frozen base layer exactly as PEFT's `lora.Linear.forward`
//! does: `base(x) + lora_B(lora_A(dropout(x))) * scaling`, or for DoRA the `DoraLinearLayer`
//! correction. Only `a`, `b` (and the DoRA magnitude) become [`Var`]s for training; base weights
//! are plain tensors, so autograd gives them no gradient.
//!
//! Reading and writing PEFT adapter folders, merging and fresh initialisation by config live in
//! [`crate::peft`].

use std::sync::{Arc, Mutex};

use candle_core::{DType, Result as CResult, Tensor, Var};
use ferrotune_core::ops;

use crate::model::{to_device_opt, BaseWeight, CausalLm};

/// PEFT's scaling of the low-rank update: `alpha / r`, or `alpha / sqrt(r)` with rsLoRA.
pub fn lora_scaling(r: usize, alpha: f64, use_rslora: bool) -> f64 {
    if use_rslora {
        alpha / (r as f64).sqrt()
    } else {
        alpha / r as f64
    }
}

/// A small deterministic generator (SplitMix64) for adapter initialisation and dropout masks.
///
/// candle's CPU generator cannot be seeded, and reproducible runs need both the initial A and the
/// dropout masks to follow from one seed.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform sample in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A LoRA (optionally DoRA) adapter of one linear layer with weight `[out, in]`.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// `lora_A.weight`, `[r, in]`.
    pub a: Tensor,
    /// `lora_B.weight`, `[out, r]`.
    pub b: Tensor,
    /// PEFT's `scaling`: `alpha / r` (or `alpha / sqrt(r)` with rsLoRA).
    pub scale: f64,
    /// Dropout probability on the adapter's input (applied only while `training`).
    pub dropout: f64,
    /// DoRA's `lora_magnitude_vector`, `[out]`; `None` for plain LoRA.
    pub dora_magnitude: Option<Tensor>,
    /// PEFT's `lora_bias=True`: `lora_B.bias`, `[out]`, scaled with the adapter's product and
    /// merged into the base layer's bias; `None` without (PEFT's default).
    pub bias: Option<Tensor>,
    /// Training mode: enables dropout, as `nn.Dropout` in a module under `.train()`.
    pub training: bool,
    /// Dropout's generator; shared by clones so that cloned models do not repeat masks.
    rng: Arc<Mutex<SplitMix64>>,
}

impl LoraAdapter {
    /// A plain LoRA adapter (no dropout, inference mode).
    pub fn new(a: Tensor, b: Tensor, scale: f64) -> Self {
        Self {
            a,
            b,
            scale,
            dropout: 0.0,
            dora_magnitude: None,
            bias: None,
            training: false,
            rng: Arc::new(Mutex::new(SplitMix64::new(0))),
        }
    }

    /// Sets the dropout probability and the seed of its masks.
    pub fn with_dropout(mut self, p: f64, seed: u64) -> Self {
        self.dropout = p;
        self.rng = Arc::new(Mutex::new(SplitMix64::new(seed)));
        self
    }

    /// Makes this a DoRA adapter with the given magnitude vector `[out]`.
    pub fn with_dora_magnitude(mut self, magnitude: Tensor) -> Self {
        self.dora_magnitude = Some(magnitude);
        self
    }

    /// Gives this adapter PEFT's `lora_B.bias` (`[out]`).
    pub fn with_bias(mut self, bias: Tensor) -> Self {
        self.bias = Some(bias);
        self
    }

    /// A fresh adapter for training with PEFT's default init (`init_lora_weights=True`): A as
    /// `nn.Linear`'s init (kaiming-uniform with `a = sqrt(5)`, i.e. `U(-1/sqrt(in), 1/sqrt(in))`),
    /// B zeros, so the adapted layer starts equal to the base layer. For DoRA the magnitude starts
    /// as the row norms of `weight` (`B = 0`), as PEFT's `DoraLinearLayer.update_layer`.
    pub fn init(
        weight: &BaseWeight,
        r: usize,
        scale: f64,
        use_dora: bool,
        rng: &mut SplitMix64,
    ) -> CResult<Self> {
        let (out, inp) = weight.dims2()?;
        let bound = 1.0 / (inp as f64).sqrt();
        let a: Vec<f32> = (0..r * inp)
            .map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32)
            .collect();
        let a = Tensor::from_vec(a, (r, inp), weight.device())?.to_dtype(weight.dtype())?;
        let b = Tensor::zeros((out, r), weight.dtype(), weight.device())?;
        let mut adapter = Self::new(a, b, scale);
        if use_dora {
            let lora_weight = adapter.b.matmul(&adapter.a)?;
            adapter.dora_magnitude = Some(weight_norm(&*weight.dense()?, &lora_weight, scale)?);
        }
        Ok(adapter)
    }

    /// A fresh adapter for the token embedding `table` (`[vocab, hidden]`) with PEFT's default
    /// init for `lora.Embedding`: `lora_embedding_A` (`a`, `[r, vocab]`) zeros and
    /// `lora_embedding_B` (`b`, `[hidden, r]`) standard normal, so the adapted embedding starts
    /// equal to the base. For DoRA the magnitude starts as the norm of each hidden unit's column.
    ///
    /// An embedding adapter is the linear adapter of the embedding seen as a linear map from the
    /// one-hot vocabulary (weight `table.T`, `[hidden, vocab]`): PEFT's `lora_embedding_A/B`,
    /// delta `(B @ A).T * scaling` and DoRA's per-hidden-unit magnitude are exactly that.
    pub fn init_embedding(
        table: &Tensor,
        r: usize,
        scale: f64,
        use_dora: bool,
        rng: &mut SplitMix64,
    ) -> CResult<Self> {
        let (vocab, hidden) = table.dims2()?;
        // Box-Muller from the seeded generator: torch.randn's distribution, reproducibly.
        let b: Vec<f32> = (0..hidden * r)
            .map(|_| {
                let u1 = rng.next_f64().max(f64::MIN_POSITIVE);
                let u2 = rng.next_f64();
                ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
            })
            .collect();
        let b = Tensor::from_vec(b, (hidden, r), table.device())?.to_dtype(table.dtype())?;
        let a = Tensor::zeros((r, vocab), table.dtype(), table.device())?;
        let mut adapter = Self::new(a, b, scale);
        if use_dora {
            let zeros = Tensor::zeros((hidden, vocab), table.dtype(), table.device())?;
            adapter.dora_magnitude = Some(weight_norm(&table.t()?, &zeros, 0.0)?);
        }
        Ok(adapter)
    }

    /// The embedding rows of `ids` (flat, u32) adapted as PEFT's `lora.Embedding.forward`, given
    /// the base rows `base = table[ids]` (`[n, hidden]`).
    ///
    /// LoRA adds `A.T[ids] @ B.T * scaling`; DoRA scales base and update by `m / ||W.T + delta||`
    /// per hidden unit. No dropout, as PEFT applies none to embeddings. PEFT looks up `A.T` with
    /// the base's `padding_idx`, so the pad token's column of A gets no gradient: `pad` names it.
    pub fn embedding_forward(
        &self,
        ids: &Tensor,
        base: &Tensor,
        table: &Tensor,
        pad: Option<u32>,
    ) -> CResult<Tensor> {
        let out_dtype = base.dtype();
        let dtype = self.a.dtype();
        let mut after_a = self.a.index_select(ids, 1)?.t()?;
        if let Some(pad) = pad.filter(|_| self.a.track_op()) {
            let is_pad = ids.eq(pad)?.unsqueeze(1)?.broadcast_as(after_a.shape())?;
            after_a = is_pad.where_cond(&after_a.detach(), &after_a)?;
        }
        let lora = after_a.matmul(&self.b.t()?)?;
        let base = base.to_dtype(dtype)?;
        let result = match &self.dora_magnitude {
            None => (base + (lora * self.scale)?)?,
            Some(m) => {
                // As for linear layers, the norm sees B @ A detached and is itself detached.
                let lora_weight = self.b.matmul(&self.a)?.detach();
                let weight = table.to_dtype(dtype)?.t()?;
                let norm = weight_norm(&weight, &lora_weight, self.scale)?.detach();
                let mag_norm_scale = m.to_dtype(dtype)?.broadcast_div(&norm)?;
                (mag_norm_scale.broadcast_mul(&base)?
                    + (mag_norm_scale.broadcast_mul(&lora)? * self.scale)?)?
            }
        };
        result.to_dtype(out_dtype)
    }

    /// The embedding `table` (`[vocab, hidden]`) with this adapter merged in, as PEFT's
    /// `lora.Embedding.merge` (LoRA: `W + (B @ A).T * scaling`; DoRA: each hidden unit's column
    /// scaled by `m / ||W.T + delta||`).
    pub fn merged_embedding(&self, table: &Tensor) -> CResult<Tensor> {
        self.merged_weight(&table.t()?)?.t()?.contiguous()
    }

    /// This adapter with its tensors on `device`.
    pub fn to_device(&self, device: &candle_core::Device) -> CResult<Self> {
        let mut out = self.clone();
        out.a = self.a.to_device(device)?;
        out.b = self.b.to_device(device)?;
        out.dora_magnitude = to_device_opt(&self.dora_magnitude, device)?;
        out.bias = to_device_opt(&self.bias, device)?;
        Ok(out)
    }

    /// This adapter with its tensors detached from autograd (same storage).
    pub fn detached(&self) -> Self {
        let mut out = self.clone();
        out.a = self.a.detach();
        out.b = self.b.detach();
        out.dora_magnitude = self.dora_magnitude.as_ref().map(Tensor::detach);
        out.bias = self.bias.as_ref().map(Tensor::detach);
        out
    }

    /// The rank `r`.
    pub fn rank(&self) -> usize {
        self.a.dims().first().copied().unwrap_or(0)
    }

    /// PEFT's `get_delta_weight`: `(B @ A) * scaling`, `[out, in]`.
    pub fn delta_weight(&self) -> CResult<Tensor> {
        self.b.matmul(&self.a)? * self.scale
    }

    /// The base weight with this adapter merged in, as PEFT's `merge`.
    ///
    /// LoRA: `W + delta`. DoRA (`DoraLinearVariant.merge_unsafe`): `m / ||W + delta||_row *
    /// (W + delta)`, the norm taken of the unmerged weight with the delta already scaled.
    pub fn merged_weight(&self, weight: &Tensor) -> CResult<Tensor> {
        let delta = self.delta_weight()?;
        match &self.dora_magnitude {
            None => weight + delta,
            Some(m) => {
                let norm = weight_norm(weight, &delta, 1.0)?;
                let factor = m.broadcast_div(&norm)?.unsqueeze(1)?;
                factor.broadcast_mul(&(weight + delta)?)
            }
        }
    }

    /// The bias the adapted layer adds to every output: the base layer's `bias` plus
    /// `lora_B.bias * scaling` (`lora_bias`), either alone where the other is absent.
    pub fn output_bias(&self, base_bias: Option<&Tensor>) -> CResult<Option<Tensor>> {
        match (&self.bias, base_bias) {
            (None, base) => Ok(base.cloned()),
            (Some(b), Some(base)) => Ok(Some((base + (b.to_dtype(base.dtype())? * self.scale)?)?)),
            (Some(b), None) => Ok(Some((b * self.scale)?)),
        }
    }

    /// The base layer's bias with this adapter's merged in, as PEFT's `merge` with `lora_bias`:
    /// [`LoraAdapter::output_bias`]. `None` when neither has a bias; an error when only the
    /// adapter has one (PEFT refuses that merge too: the merged layer would need a bias the
    /// checkpoint's config does not give it).
    pub fn merged_bias(&self, base_bias: Option<&Tensor>) -> CResult<Option<Tensor>> {
        if self.bias.is_some() && base_bias.is_none() {
            return Err(candle_core::Error::Msg(
                "the adapter has a bias (lora_bias) but the base layer has none, so it cannot \
                 be merged (PEFT cannot either)"
                    .into(),
            ));
        }
        self.output_bias(base_bias)
    }

    /// The adapted layer's output given the base layer's `base = x @ weight.T + bias`.
    pub fn forward(
        &self,
        x: &Tensor,
        base: &Tensor,
        weight: &BaseWeight,
        bias: Option<&Tensor>,
    ) -> CResult<Tensor> {
        let out_dtype = base.dtype();
        // PEFT casts the input to the adapter's dtype and the result back to the base result's.
        let x = x.to_dtype(self.a.dtype())?;
        let use_dropout = self.training && self.dropout > 0.0;
        let result = match &self.dora_magnitude {
            None => {
                let xd = if use_dropout {
                    self.apply_dropout(&x)?
                } else {
                    x
                };
                let lora = ops::linear(
                    &ops::linear(&xd, &self.a, None)?,
                    &self.b,
                    self.bias.as_ref(),
                )?;
                (base.to_dtype(self.a.dtype())? + (lora * self.scale)?)?
            }
            Some(m) => {
                let weight = weight.dense()?;
                self.dora_forward(&x, base, &weight, bias, m, use_dropout)?
            }
        };
        result.to_dtype(out_dtype)
    }

    /// PEFT's `DoraLinearVariant.forward` + `DoraLinearLayer.forward`.
    fn dora_forward(
        &self,
        x: &Tensor,
        base: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        magnitude: &Tensor,
        use_dropout: bool,
    ) -> CResult<Tensor> {
        let dtype = x.dtype();
        let weight = weight.to_dtype(dtype)?;
        let base = base.to_dtype(dtype)?;
        // The weight norm sees B @ A detached, and is itself detached (DoRA paper, section 4.3):
        // gradient reaches the magnitude and the LoRA factors only through the terms below.
        let lora_weight = self.b.matmul(&self.a)?.detach();
        let norm = weight_norm(&weight, &lora_weight, self.scale)?.detach();
        let mag_norm_scale = magnitude.to_dtype(dtype)?.broadcast_div(&norm)?;
        let (xd, base_result) = if use_dropout {
            // With active dropout PEFT recomputes the base output from the dropped-out input,
            // without bias, while the outer result keeps the undropped base output.
            let xd = self.apply_dropout(x)?;
            let br = ops::linear(&xd, &weight, None)?;
            (xd, br)
        } else {
            let br = match bias {
                Some(b) => base.broadcast_sub(&b.to_dtype(dtype)?)?,
                None => base.clone(),
            };
            (x.clone(), br)
        };
        let lora_result = ops::linear(&ops::linear(&xd, &self.a, None)?, &self.b, None)?;
        let result_dora = ((&mag_norm_scale - 1.0)?.broadcast_mul(&base_result)?
            + (mag_norm_scale.broadcast_mul(&lora_result)? * self.scale)?)?;
        base + result_dora
    }

    /// Inverted dropout: zero each element with probability `p`, scale survivors by `1/(1-p)`.
    fn apply_dropout(&self, x: &Tensor) -> CResult<Tensor> {
        let p = self.dropout;
        if p >= 1.0 {
            return x.zeros_like();
        }
        let keep = (1.0 / (1.0 - p)) as f32;
        let n = x.elem_count();
        let mask: Vec<f32> = {
            let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
            (0..n)
                .map(|_| if rng.next_f64() >= p { keep } else { 0.0 })
                .collect()
        };
        let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
        x * mask
    }

    /// The state of the dropout generator (to replay the same masks when a layer is recomputed).
    pub fn dropout_state(&self) -> u64 {
        self.rng.lock().unwrap_or_else(|e| e.into_inner()).state
    }

    /// Restores a state from [`LoraAdapter::dropout_state`].
    pub fn set_dropout_state(&self, state: u64) {
        self.rng.lock().unwrap_or_else(|e| e.into_inner()).state = state;
    }

    /// Turns A, B (and the DoRA magnitude, the LoRA bias) into [`Var`]s so that `loss.backward()` yields their
    /// gradients, and returns them with their PEFT parameter suffixes (`lora_A.weight`,
    /// `lora_B.weight`, `lora_magnitude_vector.weight`). Calling it again returns the same Vars.
    pub fn make_trainable(&mut self) -> CResult<Vec<(&'static str, Var)>> {
        let a = Var::from_tensor(&self.a)?;
        let b = Var::from_tensor(&self.b)?;
        self.a = a.as_tensor().clone();
        self.b = b.as_tensor().clone();
        let mut out = vec![("lora_A.weight", a), ("lora_B.weight", b)];
        if let Some(m) = &self.dora_magnitude {
            let m = Var::from_tensor(m)?;
            self.dora_magnitude = Some(m.as_tensor().clone());
            out.push(("lora_magnitude_vector.weight", m));
        }
        if let Some(bias) = &self.bias {
            let bias = Var::from_tensor(bias)?;
            self.bias = Some(bias.as_tensor().clone());
            out.push(("lora_B.bias", bias));
        }
        Ok(out)
    }
}

/// DoRA's `get_weight_norm`: the L2 norm of each output row of `weight + scale * lora_weight`,
/// `[out]`.
pub fn weight_norm(weight: &Tensor, lora_weight: &Tensor, scale: f64) -> CResult<Tensor> {
    let w = (weight + (lora_weight * scale)?)?;
    let dtype = w.dtype();
    // Accumulate in f32 at least, as torch.linalg.norm does for half types.
    let wf = if dtype == DType::F64 {
        w
    } else {
        w.to_dtype(DType::F32)?
    };
    wf.sqr()?.sum(1)?.sqrt()?.to_dtype(dtype)
}

/// Switches every adapter of `model` between training (dropout active) and inference.
pub fn set_training(model: &mut CausalLm, training: bool) {
    for (_, linear) in model.linears_mut() {
        if let Some(adapter) = &mut linear.adapter {
            adapter.training = training;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn scaling_follows_peft() {
        assert_eq!(lora_scaling(4, 8.0, false), 2.0);
        assert_eq!(lora_scaling(4, 8.0, true), 4.0);
    }

    #[test]
    fn fresh_adapter_is_a_no_op_and_dropout_keeps_the_mean() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (6, 5), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (3, 5), &dev).unwrap();
        let base = x.matmul(&w.t().unwrap()).unwrap();
        let mut rng = SplitMix64::new(7);
        for dora in [false, true] {
            let weight = BaseWeight::Dense(w.clone());
            let ad = LoraAdapter::init(&weight, 2, 2.0, dora, &mut rng).unwrap();
            let bound = 1.0 / 5f32.sqrt();
            let amax =
                ad.a.abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
            assert!(amax <= bound && amax > 0.0);
            let y = ad.forward(&x, &base, &weight, None).unwrap();
            let d = (y - &base).unwrap().abs().unwrap().max_all().unwrap();
            assert!(d.to_scalar::<f32>().unwrap() < 1e-5);
        }
        let ad = LoraAdapter::new(
            Tensor::zeros((1, 4), DType::F32, &dev).unwrap(),
            Tensor::zeros((1, 1), DType::F32, &dev).unwrap(),
            1.0,
        )
        .with_dropout(0.25, 3);
        let ones = Tensor::ones(20_000, DType::F32, &dev).unwrap();
        let dropped = ad.apply_dropout(&ones).unwrap();
        let mean = dropped.mean_all().unwrap().to_scalar::<f32>().unwrap();
        assert!((mean - 1.0).abs() < 0.03, "mean {mean}");
    }
}
