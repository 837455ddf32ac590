//! Tensor comparisons the ferrotune crates' tests share: one definition of "how close", so a
//! tolerance means the same thing in every crate's tests.

use candle_core::{DType, Tensor};

/// A tensor's elements as f32, flattened (any dtype, any shape).
pub fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `‖got − want‖ / ‖want‖` over all elements (f32 tensors of one shape).
pub fn rel_l2(got: &Tensor, want: &Tensor) -> f32 {
    let norm = |t: &Tensor| {
        t.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .sqrt()
    };
    norm(&(got - want).unwrap()) / norm(want).max(1e-30)
}

/// The largest absolute difference of two tensors of one shape (compared in f32); NaN if any
/// difference is NaN, so that a `<= tolerance` assertion fails on it.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    f32s(a)
        .iter()
        .zip(&f32s(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, |m: f32, d| {
            if m.is_nan() || d.is_nan() {
                f32::NAN
            } else {
                m.max(d)
            }
        })
}

/// Elementwise `|a - e| <= atol + rtol * |e|`, reporting the worst offender.
pub fn assert_close(what: &str, actual: &Tensor, expected: &Tensor, rtol: f32, atol: f32) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    let (a, e) = (f32s(actual), f32s(expected));
    let mut worst = (0usize, 0f32);
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        let excess = (x - y).abs() - (atol + rtol * y.abs());
        // NaN counts as the worst possible mismatch.
        if excess.is_nan() || excess > worst.1 {
            worst = (
                i,
                if excess.is_nan() {
                    f32::INFINITY
                } else {
                    excess
                },
            );
        }
    }
    assert!(
        worst.1 <= 0.0,
        "{what}: element {} is {} vs expected {} (rtol {rtol}, atol {atol})",
        worst.0,
        a[worst.0],
        e[worst.0]
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn t(v: &[f32]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    #[test]
    fn comparisons_measure_what_they_say() {
        assert!((rel_l2(&t(&[3.0, 4.0]), &t(&[0.0, 0.0])) - 5e30).abs() < 1e25);
        assert!((rel_l2(&t(&[1.0, 1.0]), &t(&[1.0, 2.0])) - 1.0 / 5f32.sqrt()).abs() < 1e-6);
        assert_eq!(max_abs_diff(&t(&[1.0, 5.0]), &t(&[2.0, 3.0])), 2.0);
        assert!(max_abs_diff(&t(&[f32::NAN, 0.0]), &t(&[0.0, 9.0])).is_nan());
        assert_close("within", &t(&[1.0, 2.0]), &t(&[1.0, 2.1]), 0.05, 0.0);
        let missed = std::panic::catch_unwind(|| {
            assert_close("outside", &t(&[1.0, 2.0]), &t(&[1.0, 2.2]), 0.05, 0.0)
        });
        assert!(missed.is_err());
        let nan =
            std::panic::catch_unwind(|| assert_close("nan", &t(&[f32::NAN]), &t(&[1.0]), 1.0, 1.0));
        assert!(nan.is_err());
    }
}
