//! Bounds on `num_hidden_layers` (a GGUF's `{arch}.block_count`): a count read from a file is
//! checked against the machine before the per-layer settings are allocated, and against the
//! layers a checkpoint holds before the model is built, so that a wrong or hostile count is an
//! error naming the key rather than an allocation that aborts the process.

/// A generous upper bound on the bytes of per-layer settings a config holds per layer (the
/// rope, window and chunk tables, the sparse-layer flags).
const PER_LAYER_SETTINGS_BYTES: u64 = 64;

/// Refuses a layer count whose per-layer settings alone cannot fit in the machine's memory:
/// reading a config allocates those before any tensor is looked at. `key` names the count.
pub fn check_layer_count(layers: usize, key: &str) -> Result<(), String> {
    ferrotune_core::memory::check_fits(
        ferrotune_core::memory::bytes_of(layers as u64, PER_LAYER_SETTINGS_BYTES),
        &format!("{key} = {layers}: the per-layer settings alone"),
        &candle_core::Device::Cpu,
    )
}

/// How many layers the tensor `names` hold: the layers 0, 1, … up to the first missing one, each
/// with some tensor `{prefix}N.…` (0 without any). Counted this way, a single stray name with a
/// huge `N` cannot vouch for a huge layer count: the answer is at most the number of names.
pub fn layers_held<'a>(names: impl IntoIterator<Item = &'a str>, prefix: &str) -> usize {
    let present: std::collections::BTreeSet<usize> = names
        .into_iter()
        .filter_map(|n| {
            n.strip_prefix(prefix)?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .collect();
    (0..).take_while(|l| present.contains(l)).count()
}

/// The most layers a count may give without the checkpoint's tensors holding them: far more than
/// any model has (the deepest have a few hundred), so that only a count no tensor vouches for
/// meets it, and small enough that the per-layer settings it sizes stay a few hundred KB.
pub const MAX_UNHELD_LAYERS: usize = 4096;

/// Refuses a layer count (`declared`, named by `key`) above [`MAX_UNHELD_LAYERS`] that the
/// checkpoint's tensors do not hold (`held`, from [`layers_held`]): read from a file holding
/// no or few layers (metadata alone), it would size per-layer settings by an unchecked number.
pub fn check_unheld_layers(declared: usize, held: usize, key: &str) -> Result<(), String> {
    if declared <= MAX_UNHELD_LAYERS || held >= declared {
        return Ok(());
    }
    check_layers_held(declared, held, key)
}

/// Refuses a checkpoint that holds fewer layers (`held`, from [`layers_held`]) than its config's
/// `key` says (`declared`): the model would be built layer after layer for nothing (and for a
/// billion layers, abort allocating them). More layers than declared are left to the unused
/// tensors' warning, as transformers loads a model cut short on purpose.
pub fn check_layers_held(declared: usize, held: usize, key: &str) -> Result<(), String> {
    if held >= declared {
        return Ok(());
    }
    let holds = match held {
        0 => "no layer's tensors".to_string(),
        1 => "the tensors of 1 layer (layer 0)".to_string(),
        n => format!("the tensors of {n} layers (0 to {})", n - 1),
    };
    Err(format!(
        "{key} says {declared} layers but the checkpoint holds {holds}: the config does not \
         describe these weights"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_layers_and_refuses_too_few() {
        let mut names: Vec<String> = (0..12)
            .map(|l| format!("model.layers.{l}.mlp.up_proj.weight"))
            .collect();
        names.push("model.embed_tokens.weight".into());
        names.push("model.layers.x.bad".into());
        assert_eq!(
            layers_held(names.iter().map(String::as_str), "model.layers."),
            12
        );
        // Layers 0 and 11 only: one layer is there from the start.
        let gappy = [
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.11.mlp.up_proj.weight",
        ];
        assert_eq!(layers_held(gappy, "model.layers."), 1);
        assert_eq!(layers_held(["blk.3.attn_q.weight"], "blk."), 0);
        assert_eq!(layers_held(["output.weight"], "blk."), 0);
        // A stray huge index vouches for nothing past the layers really there.
        assert_eq!(
            layers_held(["blk.0.a", "blk.1.a", "blk.999999999.a"], "blk."),
            2
        );
        // A count no tensor holds passes up to MAX_UNHELD_LAYERS (metadata-only reads).
        check_unheld_layers(2, 0, "block_count").unwrap();
        check_unheld_layers(MAX_UNHELD_LAYERS + 1, MAX_UNHELD_LAYERS + 1, "block_count").unwrap();
        let err = check_unheld_layers(67_108_865, 0, "block_count").unwrap_err();
        assert!(err.contains("says 67108865 layers"), "{err}");
        check_layers_held(12, 12, "num_hidden_layers").unwrap();
        check_layers_held(2, 12, "num_hidden_layers").unwrap();
        let err = check_layers_held(1_000_000_000, 2, "num_hidden_layers").unwrap_err();
        assert!(
            err.contains("num_hidden_layers says 1000000000 layers")
                && err.contains("2 layers (0 to 1)"),
            "{err}"
        );
    }

    #[test]
    fn an_absurd_layer_count_is_refused_before_allocating() {
        let err = check_layer_count(usize::MAX / 2, "num_hidden_layers").unwrap_err();
        assert!(err.contains("num_hidden_layers"), "{err}");
        check_layer_count(126, "num_hidden_layers").unwrap();
    }
}
