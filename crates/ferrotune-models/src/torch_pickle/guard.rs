//! A dry run of a pickle before candle's unpickler sees it, refusing what would make that
//! unpickler abort instead of erroring: it allocates a string's declared length before reading it
//! (4 GiB from a 5-byte opcode), deep-copies an object at every memo reference (doubling at each
//! step of a few bytes: a pickle bomb), and drops and prints objects recursively (a stack overflow
//! for lists nested a million deep). The walk follows candle's opcodes (the ones it supports;
//! anything else it rejects itself) and tracks only each object's size and depth.

use std::collections::HashMap;

/// Bytes of objects memo references may copy in all, beyond the pickle's own size: far above
/// what a state dict's pickle copies (a class or a device name per tensor), far below the 2 GiB
/// a malicious one could otherwise make.
const COPY_BUDGET: u64 = 256 << 20;

/// How deeply objects may nest; a state dict nests under ten levels.
const MAX_DEPTH: u32 = 100;

/// What candle's `Object` costs in memory, about, per node.
const NODE: u64 = 64;

#[derive(Clone, Copy)]
enum Item {
    Mark,
    /// An object's approximate size in bytes and its nesting depth.
    Obj(u64, u32),
}

impl Item {
    fn size_depth(self) -> (u64, u32) {
        match self {
            // Ops that pop an object take a mark like any other (as candle does).
            Item::Mark => (NODE, 1),
            Item::Obj(s, d) => (s, d),
        }
    }
}

/// Checks `pkl` (a torch.save file's `data.pkl`); the error says what is wrong, at which byte.
/// A pickle that is malformed in ways candle reports itself (an unknown opcode, an empty stack, a
/// missing memo entry) passes: candle's error names the problem.
pub(super) fn check(pkl: &[u8]) -> Result<(), String> {
    let mut stack: Vec<Item> = Vec::new();
    let mut memo: HashMap<u32, Item> = HashMap::new();
    let mut copied: u64 = 0;
    let budget = COPY_BUDGET.saturating_add(pkl.len() as u64 * NODE);
    let mut pos = 0usize;
    // The argument bytes of the opcode at `pos`, if the pickle holds them.
    let arg = |pos: usize, n: usize| pkl.get(pos..pos.checked_add(n)?);
    let le = |b: &[u8]| b.iter().rev().fold(0u64, |v, &x| (v << 8) | x as u64);
    while pos < pkl.len() {
        let at = pos;
        let op = pkl[pos];
        pos += 1;
        let fixed = match op {
            0x80 | b'K' | b'q' | b'h' => 1,
            b'M' => 2,
            b'J' | b'r' | b'j' => 4,
            b'G' => 8,
            _ => 0,
        };
        let Some(a) = arg(pos, fixed) else {
            return Ok(()); // truncated: candle says so
        };
        let a = le(a);
        pos += fixed;
        let pop = |stack: &mut Vec<Item>| stack.pop().map(Item::size_depth);
        let pop_to_mark = |stack: &mut Vec<Item>| -> Option<(u64, u32)> {
            let mark = stack.iter().rposition(|i| matches!(i, Item::Mark))?;
            let (s, d) = stack[mark + 1..]
                .iter()
                .map(|i| i.size_depth())
                .fold((0u64, 0u32), |(s, d), (s2, d2)| {
                    (s.saturating_add(s2), d.max(d2))
                });
            stack.truncate(mark);
            Some((s, d))
        };
        let combined = match op {
            b'.' => return Ok(()),
            0x80 => None,
            b'J' | b'K' | b'M' | b'G' | b'N' | 0x88 | 0x89 | b')' | b']' | b'}' | b'd' => {
                Some((NODE, 1))
            }
            b'(' => {
                stack.push(Item::Mark);
                None
            }
            0x8a => {
                let Some(&n) = pkl.get(pos) else {
                    return Ok(());
                };
                pos = pos.saturating_add(1 + n as usize);
                Some((NODE, 1))
            }
            b'c' => {
                // Two lines: module and class.
                for _ in 0..2 {
                    match pkl[pos.min(pkl.len())..].iter().position(|&b| b == b'\n') {
                        Some(n) => pos += n + 1,
                        None => return Ok(()),
                    }
                }
                Some((NODE + (pos - at) as u64, 1))
            }
            b'X' => {
                let Some(len) = arg(pos, 4).map(le) else {
                    return Ok(());
                };
                pos += 4;
                if len > (pkl.len() - pos) as u64 {
                    return Err(format!(
                        "a string at byte {at} declares {len} bytes, past the pickle's end ({} \
                         bytes)",
                        pkl.len()
                    ));
                }
                pos += len as usize;
                Some((NODE + len, 1))
            }
            b'q' | b'r' => {
                // memo_put copies the top object.
                let Some(&top) = stack.last() else {
                    return Ok(());
                };
                copied = copied.saturating_add(top.size_depth().0);
                memo.insert(a as u32, top);
                None
            }
            b'h' | b'j' => {
                // memo_get copies the memoized object.
                let Some(&item) = memo.get(&(a as u32)) else {
                    return Ok(());
                };
                copied = copied.saturating_add(item.size_depth().0);
                Some(item.size_depth())
            }
            b't' => match pop_to_mark(&mut stack) {
                Some((s, d)) => Some((s.saturating_add(NODE), d + 1)),
                None => return Ok(()),
            },
            0x85..=0x87 | b'Q' | b'R' | b'b' | 0x81 => {
                let n = match op {
                    0x85 | b'Q' => 1,
                    0x87 => 3,
                    _ => 2,
                };
                let mut s = NODE;
                let mut d = 0;
                for _ in 0..n {
                    let Some((s2, d2)) = pop(&mut stack) else {
                        return Ok(());
                    };
                    s = s.saturating_add(s2);
                    d = d.max(d2);
                }
                Some((s, d + 1))
            }
            b'a' | b's' | b'e' | b'u' => {
                // Items added to the list or dict below them.
                let added = match op {
                    b'a' => pop(&mut stack),
                    b's' => pop(&mut stack)
                        .zip(pop(&mut stack))
                        .map(|((s1, d1), (s2, d2))| (s1.saturating_add(s2), d1.max(d2))),
                    _ => pop_to_mark(&mut stack),
                };
                let (Some((s, d)), Some(top)) = (added, stack.last_mut()) else {
                    return Ok(());
                };
                let (s0, d0) = top.size_depth();
                *top = Item::Obj(s0.saturating_add(s), d0.max(d + 1));
                None
            }
            _ => return Ok(()), // an opcode candle does not know: it says so
        };
        if let Some((s, d)) = combined {
            stack.push(Item::Obj(s, d));
        }
        if let Some(Item::Obj(_, d)) = stack.last() {
            if *d > MAX_DEPTH {
                return Err(format!(
                    "objects nest more than {MAX_DEPTH} levels deep (at byte {at})"
                ));
            }
        }
        if copied > budget {
            return Err(format!(
                "its memo references would copy over {} MiB of objects (at byte {at}): a pickle \
                 bomb, not a state dict",
                budget >> 20
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check;

    #[test]
    fn a_string_longer_than_the_pickle_is_refused() {
        let err = check(b"\x80\x02X\xff\xff\xff\xfeab.").unwrap_err();
        assert!(err.contains("declares 4278190079 bytes"), "{err}");
        assert!(check(b"\x80\x02X\x02\x00\x00\x00ab.").is_ok());
    }

    #[test]
    fn memo_doubling_is_refused() {
        // A list, then forty times: a list of two copies of the last one, memoized.
        let mut p = b"\x80\x02]q\x00".to_vec();
        for i in 0..40u8 {
            p.extend_from_slice(&[b'(', b'h', i, b'h', i, b't', b'q', i + 1]);
        }
        p.push(b'.');
        let err = check(&p).unwrap_err();
        assert!(err.contains("pickle bomb"), "{err}");
    }

    #[test]
    fn deep_nesting_is_refused() {
        let mut p = b"\x80\x02".to_vec();
        p.extend(std::iter::repeat_n(b']', 200));
        p.extend(std::iter::repeat_n(b'a', 199));
        p.push(b'.');
        let err = check(&p).unwrap_err();
        assert!(err.contains("nest more than 100 levels"), "{err}");
    }
}
