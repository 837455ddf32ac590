//! Input mutations: byte-level ones for binary formats (flips, inserts, deletes, splices,
//! interesting integers at offsets favouring the header) and token-level ones for text formats
//! (dictionary tokens, swapped and repeated lines, interesting numbers in place of numbers).

/// A small deterministic generator (SplitMix64): a run is reproducible from its seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// True with probability `1/n`.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Integers that sit on the edges parsers get wrong: zero, one, sign bits, widths' maxima.
const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0x8000,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
    u64::MAX - 1,
];

/// The same edges spelled as text, with the floats YAML and JSON readers see.
const INTERESTING_TEXT: &[&str] = &[
    "0",
    "-1",
    "1",
    "2147483648",
    "4294967296",
    "9223372036854775808",
    "18446744073709551615",
    "-9223372036854775809",
    "100000000000",
    "1e400",
    "-1e-400",
    "1e11",
    ".nan",
    "NaN",
    "-.inf",
    "3.5",
    "-0",
    "0x10",
];

/// An offset into an input of `len` bytes, favouring the start where headers and metadata are:
/// half the time in the first KiB, a fifth in the first 16 KiB.
fn offset(rng: &mut Rng, len: usize) -> usize {
    let span = match rng.below(10) {
        0..=4 => len.min(1024),
        5..=6 => len.min(16 * 1024),
        _ => len,
    };
    rng.below(span + 1)
}

/// Byte ranges of the "tokens" of a text: runs of letters and digits, and single other bytes.
fn tokens(data: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < data.len() {
        let start = i;
        if data[i].is_ascii_alphanumeric() || data[i] == b'_' {
            while i < data.len() && (data[i].is_ascii_alphanumeric() || data[i] == b'_') {
                i += 1;
            }
        } else {
            i += 1;
        }
        out.push((start, i));
    }
    out
}

fn lines(data: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, &b) in data.iter().enumerate() {
        if b == b'\n' {
            out.push((start, i + 1));
            start = i + 1;
        }
    }
    if start < data.len() {
        out.push((start, data.len()));
    }
    out
}

/// One to eight stacked mutations of `input`; `other` is another corpus input to splice with,
/// `dictionary` the format's tokens, `text` whether token-level mutations should dominate. The
/// result is at most `max_len` bytes.
pub fn mutate(
    rng: &mut Rng,
    input: &[u8],
    other: &[u8],
    dictionary: &[&[u8]],
    text: bool,
    max_len: usize,
) -> Vec<u8> {
    let mut data = input.to_vec();
    let most = if rng.one_in(4) { 8 } else { 3 };
    let rounds = 1 + rng.below(most);
    for _ in 0..rounds {
        let op = if text && !rng.one_in(3) {
            10 + rng.below(6)
        } else {
            rng.below(10)
        };
        apply(rng, op, &mut data, other, dictionary);
        data.truncate(max_len);
    }
    data
}

fn apply(rng: &mut Rng, op: usize, data: &mut Vec<u8>, other: &[u8], dictionary: &[&[u8]]) {
    let len = data.len();
    match op {
        // Flip one bit.
        0 if len > 0 => {
            let i = offset(rng, len - 1);
            data[i] ^= 1 << rng.below(8);
        }
        // Set a random byte.
        1 if len > 0 => {
            let i = offset(rng, len - 1);
            data[i] = rng.next_u64() as u8;
        }
        // Write an interesting integer, 1 to 8 bytes wide, either byte order.
        2 | 3 => {
            let width = *rng.pick(&[1usize, 2, 4, 8]);
            let value = *rng.pick(INTERESTING);
            let value = if rng.one_in(3) {
                value.wrapping_neg()
            } else {
                value
            };
            let bytes = if rng.one_in(4) {
                value.to_be_bytes()[8 - width..].to_vec()
            } else {
                value.to_le_bytes()[..width].to_vec()
            };
            if len >= width {
                let i = offset(rng, len - width);
                data[i..i + width].copy_from_slice(&bytes);
            }
        }
        // Add or subtract a little from a byte.
        4 if len > 0 => {
            let i = offset(rng, len - 1);
            let delta = 1 + rng.below(16) as u8;
            data[i] = if rng.one_in(2) {
                data[i].wrapping_add(delta)
            } else {
                data[i].wrapping_sub(delta)
            };
        }
        // Delete a range.
        5 if len > 0 => {
            let i = offset(rng, len - 1);
            let most = if rng.one_in(4) { len } else { 16 };
            let n = 1 + rng.below((len - i).min(most));
            data.drain(i..i + n);
        }
        // Insert random bytes.
        6 => {
            let i = offset(rng, len);
            let n = 1 + rng.below(16);
            let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            data.splice(i..i, bytes);
        }
        // Copy a chunk of the input elsewhere in it.
        7 if len > 0 => {
            let from = rng.below(len);
            let n = 1 + rng.below((len - from).min(256));
            let chunk = data[from..from + n].to_vec();
            let i = offset(rng, len);
            data.splice(i..i, chunk);
        }
        // Splice: this input's start with another's end.
        8 if !other.is_empty() => {
            let cut = offset(rng, len);
            let from = rng.below(other.len());
            data.truncate(cut);
            data.extend_from_slice(&other[from..]);
        }
        // Insert a dictionary token as bytes (binary formats hold their keys as strings).
        9..=11 if !dictionary.is_empty() => {
            let token = *rng.pick(dictionary);
            let i = match tokens(data) {
                t if !t.is_empty() && op != 9 => t[rng.below(t.len())].0,
                _ => offset(rng, len),
            };
            if op == 11 && len > 0 {
                // Replace the token there rather than insert before it.
                let t = tokens(data);
                let (s, e) = t[rng.below(t.len())];
                data.splice(s..e, token.iter().copied());
            } else {
                data.splice(i..i, token.iter().copied());
            }
        }
        // Replace a number with an interesting one.
        12 => {
            let numbers: Vec<_> = tokens(data)
                .into_iter()
                .filter(|&(s, _)| data[s].is_ascii_digit())
                .collect();
            if !numbers.is_empty() {
                let (s, e) = numbers[rng.below(numbers.len())];
                let n = rng.pick(INTERESTING_TEXT).as_bytes().to_vec();
                data.splice(s..e, n);
            }
        }
        // Swap two lines, repeat one, or drop one.
        13 | 14 => {
            let l = lines(data);
            if !l.is_empty() {
                let (a, b) = (l[rng.below(l.len())], l[rng.below(l.len())]);
                let la = data[a.0..a.1].to_vec();
                let lb = data[b.0..b.1].to_vec();
                match rng.below(3) {
                    0 if a.0 < b.0 && a.1 <= b.0 => {
                        data.splice(b.0..b.1, la);
                        data.splice(a.0..a.1, lb);
                    }
                    1 => {
                        let times = if rng.one_in(8) { 64 } else { 1 };
                        let repeated: Vec<u8> = la.repeat(times);
                        data.splice(b.0..b.0, repeated);
                    }
                    _ => {
                        data.drain(a.0..a.1);
                    }
                }
            }
        }
        // Swap two tokens.
        15 => {
            let t = tokens(data);
            if t.len() > 1 {
                let (mut a, mut b) = (t[rng.below(t.len())], t[rng.below(t.len())]);
                if a.0 > b.0 {
                    std::mem::swap(&mut a, &mut b);
                }
                if a.1 <= b.0 {
                    let ta = data[a.0..a.1].to_vec();
                    let tb = data[b.0..b.1].to_vec();
                    data.splice(b.0..b.1, ta);
                    data.splice(a.0..a.1, tb);
                }
            }
        }
        _ => {
            // An operation that does not apply to this input (empty, no dictionary): flip a
            // byte when there is one, so that the round still changes something.
            if len > 0 {
                let i = rng.below(len);
                data[i] ^= 0x20;
            } else {
                data.push(rng.next_u64() as u8);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_are_deterministic_and_bounded() {
        let dict: &[&[u8]] = &[b"${", b"}"];
        let run = |seed| {
            let mut rng = Rng::new(seed);
            (0..500)
                .map(|_| mutate(&mut rng, b"a: 1\nb: ${a}\n", b"c: [2]\n", dict, true, 64))
                .collect::<Vec<_>>()
        };
        let (a, b) = (run(7), run(7));
        assert_eq!(a, b);
        assert!(a.iter().all(|m| m.len() <= 64));
        assert!(a.iter().any(|m| m != b"a: 1\nb: ${a}\n"));
    }
}
