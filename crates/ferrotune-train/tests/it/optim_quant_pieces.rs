//! The quantized AdamW over flat shards (`QuantAdamW::with_pieces`, what the sharded recipes
//! run): the reference fixture's three parameters laid out as FSDP lays them out for it (each on
//! a block boundary, two chunks of whole blocks), each chunk stepped by its own optimizer, equal
//! the whole parameters stepped on one device bit for bit — parameters, codes, scales and f32
//! moments — and a chunk's packed state saved and loaded continues the same.

use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};
use ferrotune_train::optim_quant::{Piece, QuantAdamW, QuantAdamWConfig};
use ferrotune_train::Optimizer;

use crate::optim_quant::{cases, fixture, grad_store, grads, hp, params, vec, STEPS};

/// Each parameter's offset in the flat buffer, and the chunk of each of 2 ranks.
fn layout(sizes: &[usize], bs: usize) -> (Vec<usize>, usize) {
    let (mut offsets, mut len) = (Vec::new(), 0usize);
    for &n in sizes {
        let o = len.next_multiple_of(bs);
        offsets.push(o);
        len = o + n;
    }
    (offsets, len.div_ceil(2).next_multiple_of(bs))
}

/// The pieces of each parameter in rank `r`'s chunk: (parameter index, piece).
fn pieces(sizes: &[usize], offsets: &[usize], chunk: usize, r: usize) -> Vec<(usize, Piece)> {
    let (lo, hi) = (r * chunk, (r + 1) * chunk);
    let mut out = Vec::new();
    for (i, (&n, &o)) in sizes.iter().zip(offsets).enumerate() {
        let (a, b) = (o.max(lo), (o + n).min(hi));
        if a < b {
            let piece = Piece {
                numel: n,
                start: a - o,
                at: a - lo,
                len: b - a,
            };
            out.push((i, piece));
        }
    }
    out
}

/// The tensors' values laid out flat at `offsets`, zero-padded to two chunks; rank `r`'s chunk.
fn chunk_of(ts: &[Tensor], offsets: &[usize], chunk: usize, r: usize) -> Tensor {
    let mut flat = vec![0f32; 2 * chunk];
    for (t, &o) in ts.iter().zip(offsets) {
        let v = vec(t);
        flat[o..o + v.len()].copy_from_slice(&v);
    }
    Tensor::new(&flat[r * chunk..(r + 1) * chunk], &Device::Cpu).unwrap()
}

#[test]
fn two_shards_step_as_the_whole_parameters() {
    let fx = fixture();
    for (prefix, kind) in cases() {
        let cfg = QuantAdamWConfig::new(kind, hp());
        let (bs, bits) = (cfg.block_size, kind.bits());
        let whole = params(&fx);
        let sizes: Vec<usize> = whole.iter().map(|(_, v)| v.elem_count()).collect();
        let (offsets, chunk) = layout(&sizes, bs);
        let values: Vec<Tensor> = whole.iter().map(|(_, v)| v.as_tensor().clone()).collect();
        let mut one = QuantAdamW::new(whole.clone(), cfg).unwrap();
        let mut ranks: Vec<(Vec<(String, Var)>, QuantAdamW)> = (0..2)
            .map(|r| {
                let var = Var::from_tensor(&chunk_of(&values, &offsets, chunk, r)).unwrap();
                let p = vec![("unit".to_string(), var)];
                let pcs = pieces(&sizes, &offsets, chunk, r);
                let pcs = vec![pcs.into_iter().map(|(_, p)| p).collect()];
                let opt = QuantAdamW::with_pieces(p.clone(), pcs, cfg).unwrap();
                (p, opt)
            })
            .collect();
        assert!(
            pieces(&sizes, &offsets, chunk, 0).len() + pieces(&sizes, &offsets, chunk, 1).len()
                > sizes.len(),
            "{prefix}: a parameter should be split between the ranks"
        );
        for k in 1..=STEPS {
            let g = grads(&fx, k);
            one.step(&grad_store(&whole, &g)).unwrap();
            let gs: Vec<Tensor> = whole.iter().map(|(n, _)| g[n].clone()).collect();
            for (r, (p, opt)) in ranks.iter_mut().enumerate() {
                let g = HashMap::from([("unit".to_string(), chunk_of(&gs, &offsets, chunk, r))]);
                opt.step(&grad_store(p, &g)).unwrap();
            }
            if k == 2 {
                // Rank 1's packed state saved and loaded into a fresh optimizer.
                let (p, opt) = &ranks[1];
                let saved: HashMap<String, Tensor> =
                    opt.state_dict().unwrap().into_iter().collect();
                let var = Var::from_tensor(p[0].1.as_tensor()).unwrap();
                let p = vec![("unit".to_string(), var)];
                let pcs = pieces(&sizes, &offsets, chunk, 1);
                let pcs = vec![pcs.into_iter().map(|(_, p)| p).collect()];
                let mut fresh = QuantAdamW::with_pieces(p.clone(), pcs, cfg).unwrap();
                fresh.load_state_dict(&saved).unwrap();
                ranks[1] = (p, fresh);
            }
        }
        let want: HashMap<String, Tensor> = one.state_dict().unwrap().into_iter().collect();
        for (r, (p, opt)) in ranks.iter().enumerate() {
            let got = vec(p[0].1.as_tensor());
            let state: HashMap<String, Tensor> = opt.state_dict().unwrap().into_iter().collect();
            let mut f32_at = HashMap::from([("exp_avg", 0), ("exp_avg_sq", 0)]);
            for (i, pc) in pieces(&sizes, &offsets, chunk, r) {
                let name = &whole[i].0;
                let what = format!("{prefix} rank {r} {name}");
                let full = vec(whole[i].1.as_tensor());
                assert_eq!(
                    &got[pc.at..pc.at + pc.len],
                    &full[pc.start..pc.start + pc.len],
                    "{what}: values"
                );
                for m in ["exp_avg", "exp_avg_sq"] {
                    if cfg.quantizes(pc.numel) {
                        let codes = vec(&state[&format!("unit.{m}_codes")]);
                        let want_codes = vec(&want[&format!("{name}.{m}_codes")]);
                        let (a, b, n) = (pc.at * bits / 8, pc.start * bits / 8, pc.len * bits / 8);
                        assert_eq!(&codes[a..a + n], &want_codes[b..b + n], "{what}: {m} codes");
                        let scales = vec(&state[&format!("unit.{m}_absmax")]);
                        let want_scales = vec(&want[&format!("{name}.{m}_absmax")]);
                        let (a, b, n) = (pc.at / bs, pc.start / bs, pc.len.div_ceil(bs));
                        assert_eq!(
                            &scales[a..a + n],
                            &want_scales[b..b + n],
                            "{what}: {m} scales"
                        );
                    } else {
                        let v = vec(&state[&format!("unit.{m}")]);
                        let want_v = vec(&want[&format!("{name}.{m}")]);
                        let at = f32_at.get_mut(m).unwrap();
                        assert_eq!(
                            &v[*at..*at + pc.len],
                            &want_v[pc.start..pc.start + pc.len],
                            "{what}: {m}"
                        );
                        *at += pc.len;
                    }
                }
            }
        }
    }
}

/// Pieces that do not start on a block boundary are refused.
#[test]
fn pieces_off_block_boundaries_are_refused() {
    let (_, kind) = cases()[0];
    let cfg = QuantAdamWConfig::new(kind, hp());
    let var =
        Var::from_tensor(&Tensor::zeros(1024, candle_core::DType::F32, &Device::Cpu).unwrap())
            .unwrap();
    let piece = Piece {
        numel: 8192,
        start: 100,
        at: 0,
        len: 512,
    };
    let p = vec![("unit".to_string(), var)];
    assert!(QuantAdamW::with_pieces(p, vec![vec![piece]], cfg).is_err());
}
