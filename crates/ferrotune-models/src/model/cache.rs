//! The KV cache ([`KvCache`]): exact entries the forward appends to, or fixed-capacity buffers
//! the decode step writes in place; and the fixed-size states of linear-attention layers
//! ([`LinearState`]).

use candle_core::{DType, Device, Result as CResult, Tensor};

use super::decode_step;

/// Keys and values of earlier positions, per layer: `[batch, kv_heads, positions, head_dim]`.
///
/// The forward pass appends to it by concatenation, so each entry holds exactly the cached
/// positions. The decode step ([`CausalLm::decode_step`]) instead keeps fixed-capacity buffers and
/// writes each new position in place (no copy of the whole cache per token); the forward turns
/// those back into exact entries when it runs next.
///
/// [`CausalLm::decode_step`]: super::CausalLm::decode_step
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    pub(super) layers: Vec<Option<(Tensor, Tensor)>>,
    /// Per layer, a linear-attention (Gated DeltaNet) layer's states; `None` for the others
    /// (whose keys and values are in `layers`).
    pub(super) linear: Vec<Option<LinearState>>,
    /// While the entries are fixed-capacity buffers: how many positions are filled.
    pub(super) filled: Option<usize>,
    /// The decode step recorded as a graph for these buffers (see `CausalLm::decode_step`).
    pub(super) graph: decode_step::Recorded,
    /// The buffers, rows and first keys the last eager decode step ran on: the next step on the
    /// same ones is recorded.
    pub(super) warm: Option<decode_step::GraphKey>,
    /// How recorded steps replay.
    pub(super) replay: decode_step::Replay,
}

/// A Gated DeltaNet layer's cache: what it needs to go on from the cached positions, of a size
/// that does not grow with them.
#[derive(Debug, Clone)]
pub(super) struct LinearState {
    /// The convolution's last `kernel - 1` inputs (`in_proj_qkv`'s outputs before the
    /// convolution), zeros before the first position: `[b, kernel - 1, conv_dim]`, f32.
    pub(super) conv: Tensor,
    /// The delta rule's state `[b, value_heads, key_head_dim, value_head_dim]`, f32.
    pub(super) recurrent: Tensor,
    /// Positions seen (what [`KvCache::len`] reports when no layer has keys and values).
    pub(super) positions: usize,
}

/// One layer's part of a [`KvCache`], as the layer forward takes it.
pub(super) struct LayerCache<'a> {
    /// An attention layer's keys and values.
    pub(super) kv: &'a mut Option<(Tensor, Tensor)>,
    /// A linear-attention layer's states.
    pub(super) linear: &'a mut Option<LinearState>,
}

/// Fixed-capacity buffers grow in steps of this many positions (and at least double).
const KV_CAPACITY_STEP: usize = 256;

impl KvCache {
    /// An empty cache for `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            linear: vec![None; num_layers],
            ..Self::default()
        }
    }

    /// Layer `index`'s part of the cache.
    pub(super) fn layer(&mut self, index: usize) -> LayerCache<'_> {
        if self.linear.len() < self.layers.len() {
            self.linear.resize(self.layers.len(), None);
        }
        LayerCache {
            kv: &mut self.layers[index],
            linear: &mut self.linear[index],
        }
    }

    /// Tests: decode steps go through the graph bookkeeping on any device, each replay emulated
    /// by running the step's ops again on the recorded buffers with the position they were
    /// recorded at, so that everything a replayed CUDA graph depends on (inputs copied into its
    /// buffers, the position read from device counters) is checked without a GPU.
    #[doc(hidden)]
    pub fn emulate_graph_replay(&mut self) {
        self.replay = decode_step::Replay::Emulated;
    }

    /// Tests: decode steps on this cache are never recorded as CUDA graphs.
    #[doc(hidden)]
    pub fn never_record_steps(&mut self) {
        self.replay = decode_step::Replay::Off;
    }

    /// Whether a decode step is recorded for the current buffers (tests).
    #[doc(hidden)]
    pub fn has_recorded_step(&self) -> bool {
        self.graph.0.is_some()
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.filled.unwrap_or_else(|| self.capacity())
    }

    /// True when nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A cache of `rows` rows, each a copy of this cache's first row (entries exact): one shared
    /// prefix continued `rows` ways in one batch (the evaluation harness's answer choices).
    pub fn repeat_first_row(&self, rows: usize) -> CResult<KvCache> {
        let filled = self.len();
        let take = |t: &Tensor| -> CResult<Tensor> {
            t.narrow(0, 0, 1)?
                .narrow(2, 0, filled)?
                .repeat((rows, 1, 1, 1))?
                .contiguous()
        };
        let mut layers = Vec::with_capacity(self.layers.len());
        for entry in &self.layers {
            layers.push(match entry {
                Some((k, v)) => Some((take(k)?, take(v)?)),
                None => None,
            });
        }
        let first_row = |t: &Tensor| -> CResult<Tensor> {
            let mut reps = vec![1; t.rank()];
            reps[0] = rows;
            t.narrow(0, 0, 1)?.repeat(reps)?.contiguous()
        };
        let mut linear = Vec::with_capacity(self.linear.len());
        for state in &self.linear {
            linear.push(match state {
                Some(s) => Some(LinearState {
                    conv: first_row(&s.conv)?,
                    recurrent: first_row(&s.recurrent)?,
                    positions: s.positions,
                }),
                None => None,
            });
        }
        Ok(KvCache {
            layers,
            linear,
            ..KvCache::default()
        })
    }

    /// Each layer's two entries' shapes (`[batch, heads, positions, size]`; a latent-attention
    /// layer's latent and rotary key), `None` where a layer has none yet.
    pub fn layer_shapes(&self) -> Vec<Option<([usize; 4], [usize; 4])>> {
        let shape = |t: &Tensor| t.dims4().map(|(a, b, c, d)| [a, b, c, d]).ok();
        self.layers
            .iter()
            .map(|l| l.as_ref().and_then(|(k, v)| Some((shape(k)?, shape(v)?))))
            .collect()
    }

    /// Each linear-attention layer's state shapes (its convolution inputs `[batch, kernel - 1,
    /// conv_dim]` and delta-rule state `[batch, value_heads, key_head_dim, value_head_dim]`),
    /// `None` for the other layers and before the first forward.
    pub fn linear_state_shapes(&self) -> Vec<Option<(Vec<usize>, Vec<usize>)>> {
        self.linear
            .iter()
            .map(|s| {
                s.as_ref()
                    .map(|s| (s.conv.dims().to_vec(), s.recurrent.dims().to_vec()))
            })
            .collect()
    }

    /// Positions the entries can hold without growing (their length when they are exact); with
    /// no attention entry (a model of linear-attention layers only), the positions seen.
    fn capacity(&self) -> usize {
        match self.layers.iter().flatten().next() {
            Some((k, _)) => k.dim(2).unwrap_or(0),
            None => self
                .linear
                .iter()
                .flatten()
                .next()
                .map_or(0, |s| s.positions),
        }
    }

    /// Makes every entry hold exactly the filled positions again (what concatenation expects).
    pub(super) fn make_exact(&mut self) -> CResult<()> {
        // A recorded step wrote into the buffers being replaced.
        self.graph = Default::default();
        self.warm = None;
        if let Some(filled) = self.filled.take() {
            for (k, v) in self.layers.iter_mut().flatten() {
                *k = k.narrow(2, 0, filled)?.contiguous()?;
                *v = v.narrow(2, 0, filled)?.contiguous()?;
            }
        }
        Ok(())
    }

    /// Turns the entries into fixed-capacity buffers with room for at least `needed` positions
    /// (contents kept); `shape` is `(batch, kv_heads, head_dim)` for entries not created yet.
    pub(super) fn reserve(
        &mut self,
        needed: usize,
        shape: (usize, usize, usize),
        dtype: DType,
        device: &Device,
    ) -> CResult<()> {
        let filled = self.len();
        let capacity = self.capacity();
        if self.filled.is_some() && capacity >= needed {
            return Ok(());
        }
        let grown = if self.filled.is_some() {
            2 * capacity
        } else {
            0
        };
        let new_capacity = needed.max(grown).next_multiple_of(KV_CAPACITY_STEP);
        // New buffers: a recorded step wrote into the old ones.
        self.graph = Default::default();
        self.warm = None;
        let (batch, kv_heads, head_dim) = shape;
        let widen = |t: Option<&Tensor>| -> CResult<Tensor> {
            let buffer = Tensor::zeros((batch, kv_heads, new_capacity, head_dim), dtype, device)?;
            if let Some(t) = t {
                buffer.slice_set(&t.narrow(2, 0, filled)?.contiguous()?, 2, 0)?;
            }
            Ok(buffer)
        };
        for entry in self.layers.iter_mut() {
            let (k, v) = match entry.as_ref() {
                Some((k, v)) => (widen(Some(k))?, widen(Some(v))?),
                None => (widen(None)?, widen(None)?),
            };
            *entry = Some((k, v));
        }
        self.filled = Some(filled);
        Ok(())
    }
}
