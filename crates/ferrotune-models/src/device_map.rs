//! Pipeline placement of one model over several devices, with the meanings of HF Accelerate's
//! `device_map` strings ("auto", "balanced", "balanced_low_0", "sequential").
//!
//! The model is cut into parts in forward order: the embedding, each decoder layer, then the final
//! norm with the output head. [`plan`] gives every part a device index so that each device holds
//! one contiguous run of parts; [`crate::CausalLm::dispatch`] then moves the parts there, and the
//! forward pass carries the hidden states from device to device between layers.
//!
//! Differences from Accelerate, on purpose: nothing is offloaded to the CPU or to disk (a model that
//! does not fit is an error naming the shortfall), and parts are never split below a decoder layer.

/// Share of each device's capacity, in percent, that planning leaves free. The parts' sizes count
/// weights only; activations, attention masks, the KV cache and the logits need room beside them.
pub const ACTIVATION_MARGIN_PERCENT: u64 = 10;

/// How [`plan`] spreads the model over the devices (Accelerate's `device_map` strings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceMapMode {
    /// As [`DeviceMapMode::Balanced`]: with only GPUs to place on, Accelerate's "auto" is balanced.
    Auto,
    /// An even split over all devices.
    Balanced,
    /// An even split over every device but the first; device 0 only gets what does not fit on the
    /// others, so that it stays free for the outputs (logits, sampling).
    BalancedLow0,
    /// Device 0 filled first, then device 1, and so on; later devices may stay unused.
    Sequential,
}

impl DeviceMapMode {
    /// The names [`DeviceMapMode::parse`] accepts, in the order of the variants.
    pub const NAMES: [&'static str; 4] = ["auto", "balanced", "balanced_low_0", "sequential"];

    /// Parses a mode as users write it (`auto`, `balanced`, `balanced_low_0`, `sequential`).
    pub fn parse(name: &str) -> Result<Self, String> {
        match name.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "balanced" => Ok(Self::Balanced),
            "balanced_low_0" => Ok(Self::BalancedLow0),
            "sequential" => Ok(Self::Sequential),
            other => Err(format!(
                "unknown device map '{other}': expected one of {}",
                Self::NAMES.join(", ")
            )),
        }
    }

    /// The mode's name as [`DeviceMapMode::parse`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => Self::NAMES[0],
            Self::Balanced => Self::NAMES[1],
            Self::BalancedLow0 => Self::NAMES[2],
            Self::Sequential => Self::NAMES[3],
        }
    }
}

/// Which device (an index into the device list given to [`crate::CausalLm::dispatch`]) holds each
/// part of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Device of the token embedding.
    pub embed: usize,
    /// Device of each decoder layer, in layer order.
    pub layers: Vec<usize>,
    /// Device of the final norm and the output head (where logits come out).
    pub head: usize,
}

impl Placement {
    /// Everything on device 0.
    pub fn single(num_layers: usize) -> Self {
        Self {
            embed: 0,
            layers: vec![0; num_layers],
            head: 0,
        }
    }

    /// The highest device index used, plus one: how many devices the placement needs.
    pub fn devices_needed(&self) -> usize {
        self.layers
            .iter()
            .chain([&self.embed, &self.head])
            .max()
            .map_or(1, |&d| d + 1)
    }

    /// Whether `device` holds any part.
    pub fn uses(&self, device: usize) -> bool {
        self.embed == device || self.head == device || self.layers.contains(&device)
    }

    /// Weight bytes each of `num_devices` devices holds under this placement, given the parts'
    /// sizes as [`plan`] takes them.
    pub fn bytes_per_device(
        &self,
        layer_bytes: &[u64],
        root_bytes: (u64, u64),
        num_devices: usize,
    ) -> Vec<u64> {
        let mut out = vec![0u64; num_devices.max(self.devices_needed())];
        out[self.embed] += root_bytes.0;
        for (&d, &b) in self.layers.iter().zip(layer_bytes) {
            out[d] += b;
        }
        out[self.head] += root_bytes.1;
        out
    }

    /// What `device` holds, for people: `embed, layers 0-7`, `layers 8-15, norm + head`, or
    /// `nothing`.
    pub fn describe(&self, device: usize) -> String {
        let mut parts = Vec::new();
        if self.embed == device {
            parts.push("embed".to_string());
        }
        // Runs of consecutive layer indices, so that a hand-made interleaved placement still reads.
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, _) in self.layers.iter().enumerate().filter(|(_, &d)| d == device) {
            match runs.last_mut() {
                Some((_, end)) if *end + 1 == i => *end = i,
                _ => runs.push((i, i)),
            }
        }
        if !runs.is_empty() {
            let single = runs.len() == 1 && runs[0].0 == runs[0].1;
            let text: Vec<String> = runs
                .iter()
                .map(|&(a, b)| {
                    if a == b {
                        a.to_string()
                    } else {
                        format!("{a}-{b}")
                    }
                })
                .collect();
            let word = if single { "layer" } else { "layers" };
            parts.push(format!("{word} {}", text.join(", ")));
        }
        if self.head == device {
            parts.push("norm + head".to_string());
        }
        if parts.is_empty() {
            "nothing".to_string()
        } else {
            parts.join(", ")
        }
    }
}

/// What planning may fill of a device with `capacity` bytes: all but the activation margin.
pub fn usable_bytes(capacity: u64) -> u64 {
    // In u128: capacity × percent may overflow u64.
    capacity - (capacity as u128 * ACTIVATION_MARGIN_PERCENT as u128 / 100) as u64
}

/// A byte count for people: `1.50 GiB`, `12.0 MiB`, `512 B`.
pub fn format_bytes(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if b >= KIB * KIB * KIB {
        format!("{:.2} GiB", b / (KIB * KIB * KIB))
    } else if b >= KIB * KIB {
        format!("{:.1} MiB", b / (KIB * KIB))
    } else if b >= KIB {
        format!("{:.1} KiB", b / KIB)
    } else {
        format!("{bytes} B")
    }
}

/// Assigns the embedding, every decoder layer (in order) and the final norm + head to devices
/// `0..capacities.len()`.
///
/// `layer_bytes` are the decoder layers' sizes, `root_bytes` the embedding's and the final norm +
/// head's ([`CausalLm::part_bytes`](crate::CausalLm::part_bytes) measures a model), `capacities` what each device may hold.
/// Each device gets one contiguous run of parts and device indices never decrease along the model,
/// so the hidden states move forward only. Planning fills at most
/// `100 - ACTIVATION_MARGIN_PERCENT` percent of each capacity.
///
/// - `Auto` / `Balanced`: the largest share any device gets is made as small as the capacities
///   allow, and the cuts then bring each device as close to an even share of what is left as they
///   can.
/// - `BalancedLow0`: balanced over devices 1.., with device 0 kept entirely free (the embedding
///   too) when the others hold the whole model; otherwise device 0 takes the shortest start of the
///   model that lets the rest fit. With a single device it is the same as `Balanced`.
/// - `Sequential`: every part goes to the first device that still has room after its
///   predecessors.
///
/// Fails, naming the shortfall, when the parts cannot fit.
pub fn plan(
    mode: DeviceMapMode,
    layer_bytes: &[u64],
    root_bytes: (u64, u64),
    capacities: &[u64],
) -> Result<Placement, String> {
    if capacities.is_empty() {
        return Err("no device to place the model on".to_string());
    }
    let items: Vec<u64> = std::iter::once(root_bytes.0)
        .chain(layer_bytes.iter().copied())
        .chain(std::iter::once(root_bytes.1))
        .collect();
    let limits: Vec<u64> = capacities.iter().map(|&c| usable_bytes(c)).collect();
    // Greedy filling places the longest possible start of the model, so if it fails nothing fits.
    if let Err(first_left) = fill(&items, &limits) {
        return Err(shortfall(&items, &limits, first_left));
    }
    let owners = match mode {
        DeviceMapMode::Sequential => fill(&items, &limits).expect("checked above"),
        DeviceMapMode::Auto | DeviceMapMode::Balanced => balanced(&items, &limits),
        DeviceMapMode::BalancedLow0 if limits.len() == 1 => balanced(&items, &limits),
        DeviceMapMode::BalancedLow0 => balanced_low_0(&items, &limits),
    };
    let last = owners.len() - 1;
    Ok(Placement {
        embed: owners[0],
        layers: owners[1..last].to_vec(),
        head: owners[last],
    })
}

/// Sequential filling: each item on the first device (from the previous item's) with room for it.
/// `Err(i)` when item `i` finds none.
fn fill(items: &[u64], limits: &[u64]) -> Result<Vec<usize>, usize> {
    let mut owners = Vec::with_capacity(items.len());
    let (mut d, mut load) = (0usize, 0u64);
    for (i, &size) in items.iter().enumerate() {
        while d < limits.len() && load + size > limits[d] {
            d += 1;
            load = 0;
        }
        if d == limits.len() {
            return Err(i);
        }
        owners.push(d);
        load += size;
    }
    Ok(owners)
}

/// An even split of `items` (which must fit) over devices with `limits`.
fn balanced(items: &[u64], limits: &[u64]) -> Vec<usize> {
    let total: u64 = items.iter().sum();
    // The smallest per-device ceiling that still places everything.
    let capped = |t: u64| -> Vec<u64> { limits.iter().map(|&l| l.min(t)).collect() };
    let (mut lo, mut hi) = (0u64, total);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fill(items, &capped(mid)).is_ok() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let caps = capped(hi);
    // Greedy filling under that ceiling would leave the last devices light (10 layers on 4 devices:
    // 3, 3, 3, 1); cut each device instead as close as allowed to an even share of what is left.
    let n = caps.len();
    let mut owners = Vec::with_capacity(items.len());
    let mut start = 0usize;
    for d in 0..n {
        let rest = &items[start..];
        if d + 1 == n {
            owners.extend(std::iter::repeat_n(d, rest.len()));
            break;
        }
        let ideal = rest.iter().sum::<u64>() as f64 / (n - d) as f64;
        let mut best: Option<(usize, f64)> = None;
        let mut load = 0u64;
        for take in 0..=rest.len() {
            if take > 0 {
                load += rest[take - 1];
            }
            if load > caps[d] {
                break;
            }
            if fill(&rest[take..], &caps[d + 1..]).is_err() {
                continue;
            }
            let miss = (load as f64 - ideal).abs();
            // On a tie the earlier device takes more, as Accelerate fills in device order.
            if best.is_none_or(|(_, m)| miss <= m) {
                best = Some((take, miss));
            }
        }
        let take = best.map_or(0, |(t, _)| t);
        owners.extend(std::iter::repeat_n(d, take));
        start += take;
    }
    owners
}

/// Balanced over devices 1.., device 0 taking only the shortest start of the model without which
/// the rest would not fit (`items` must fit, `limits` has at least two devices).
fn balanced_low_0(items: &[u64], limits: &[u64]) -> Vec<usize> {
    let mut on_zero = 0u64;
    for k in 0..=items.len() {
        if k > 0 {
            on_zero += items[k - 1];
        }
        if on_zero > limits[0] {
            break;
        }
        if fill(&items[k..], &limits[1..]).is_ok() {
            let mut owners = vec![0usize; k];
            owners.extend(balanced(&items[k..], &limits[1..]).iter().map(|d| d + 1));
            return owners;
        }
    }
    // Unreachable when everything fits sequentially; keep a valid answer anyway.
    fill(items, limits).unwrap_or_else(|_| vec![0; items.len()])
}

/// The error for parts that do not fit: what is needed, what the devices offer, what is left over.
fn shortfall(items: &[u64], limits: &[u64], first_left: usize) -> String {
    let total: u64 = items.iter().sum();
    let offered: u64 = limits.iter().sum();
    let left: u64 = items[first_left..].iter().sum();
    let name = match first_left {
        0 => "the embedding".to_string(),
        i if i == items.len() - 1 => "the final norm + head".to_string(),
        i => format!("layer {}", i - 1),
    };
    let short = if total > offered {
        format!("short by {}", format_bytes(total - offered))
    } else {
        "the parts do not pack into the space left on each device".to_string()
    };
    format!(
        "the model does not fit on {} device(s): it needs {} of weights, they hold {} after keeping \
         {ACTIVATION_MARGIN_PERCENT}% of each free for activations and the KV cache; {} from {name} \
         on is left over ({short})",
        limits.len(),
        format_bytes(total),
        format_bytes(offered),
        format_bytes(left),
    )
}
