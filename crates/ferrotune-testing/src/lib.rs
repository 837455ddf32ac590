//! What the ferrotune crates' tests share: tensor comparisons (one definition of "how close", so
//! a tolerance means the same thing in every crate's tests), the fixtures' folder, fresh temp
//! folders, and the name a test gives its own binary to run one of its tests as a child process.

mod files;

pub use files::{fixtures, fresh_dir};

use candle_core::{DType, Tensor};

/// For a test that needs a process of its own (it sets environment variables, or measures the
/// whole process) while its crate's other tests run in parallel threads of one binary: true in a
/// copy of the test binary started with `marker` set and filtered to test `name` of the module at
/// `module_path` (`module_path!()`), where the caller then runs the test's body. In the parent it
/// starts that copy, asserts that it ran the one test and passed, and returns false.
pub fn in_own_process(marker: &str, module_path: &str, name: &str) -> bool {
    if std::env::var_os(marker).is_some() {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            test_path(module_path, name).as_str(),
            "--test-threads=1",
        ])
        .env(marker, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    false
}

/// The full name of test `name` in the module whose `module_path!()` is `module_path`, as the
/// test binary knows it (`dist_comm::worker`: the path without the binary's own name), for
/// `--exact` when a test starts its own binary again to run just that test.
pub fn test_path(module_path: &str, name: &str) -> String {
    match module_path.split_once("::") {
        Some((_, module)) => format!("{module}::{name}"),
        None => name.to_string(),
    }
}

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

    #[test]
    fn test_paths_leave_out_the_binary() {
        assert_eq!(test_path("it::dist_comm", "worker"), "dist_comm::worker");
        assert_eq!(test_path("it", "worker"), "worker");
    }
}
