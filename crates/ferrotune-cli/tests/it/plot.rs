//! `ferrotune plot` end to end: a PNG of the requested size with the curves drawn, found from an
//! output folder, a logs folder or the file itself; bad metrics files are one clear error line.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn ferrotune(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap()
}

fn temp_dir(name: &str) -> PathBuf {
    ferrotune_testing::fresh_dir(&format!("ferrotune-plot-{}-{name}", std::process::id()))
}

/// A run folder with `logs/metrics.jsonl`: a decaying loss, a warmup-then-cosine lr, a NaN loss.
fn write_run(dir: &Path) -> PathBuf {
    let mut text = String::new();
    for step in 1..=50u32 {
        let loss = if step == 30 {
            "\"NaN\"".to_string()
        } else {
            format!("{}", 3.0 * (-(step as f64) / 15.0).exp() + 0.5)
        };
        let lr = if step <= 10 {
            3e-4 * step as f64 / 10.0
        } else {
            3e-4 * 0.5 * (1.0 + (std::f64::consts::PI * (step - 10) as f64 / 40.0).cos())
        };
        text.push_str(&format!(
            "{{\"step\": {step}, \"epoch\": 0, \"loss\": {loss}, \"lr\": {lr}, \"tokens_per_second\": 1234.5}}\n"
        ));
    }
    let logs = dir.join("logs");
    fs::create_dir_all(&logs).unwrap();
    let path = logs.join("metrics.jsonl");
    fs::write(&path, text).unwrap();
    path
}

/// Decodes a PNG into (width, height, RGB bytes).
fn read_png(path: &Path) -> (u32, u32, Vec<u8>) {
    let decoder = png::Decoder::new(std::io::BufReader::new(fs::File::open(path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    assert_eq!(info.bit_depth, png::BitDepth::Eight);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

fn assert_success(out: &Output) {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Counts pixels of roughly the given colour (anti-aliasing blends the line's edges).
fn count_near(rgb: &[u8], color: [u8; 3]) -> usize {
    rgb.chunks_exact(3)
        .filter(|p| (0..3).all(|c| (p[c] as i32 - color[c] as i32).abs() < 40))
        .count()
}

#[test]
fn plots_loss_and_lr_into_a_png_of_the_requested_size() {
    let dir = temp_dir("run");
    write_run(&dir);
    let png_path = dir.join("out/curves.png");
    let out = ferrotune(&[
        "plot",
        dir.to_str().unwrap(),
        "--output",
        png_path.to_str().unwrap(),
        "--width",
        "640",
        "--height",
        "480",
    ]);
    assert_success(&out);
    let (w, h, rgb) = read_png(&png_path);
    assert_eq!((w, h), (640, 480));
    // The background is white; the loss line is blue in the top half, the lr line red in the
    // bottom half; axis text and frames are dark.
    let (top, bottom) = rgb.split_at(rgb.len() / 2);
    let white = count_near(&rgb, [255, 255, 255]);
    assert!(white > rgb.len() / 3 / 2, "mostly background: {white}");
    let blue = [0x1f, 0x77, 0xb4];
    let red = [0xd6, 0x27, 0x28];
    assert!(
        count_near(top, blue) > 300,
        "loss line: {}",
        count_near(top, blue)
    );
    assert_eq!(count_near(bottom, blue), 0, "loss line in the lr panel");
    assert!(
        count_near(bottom, red) > 300,
        "lr line: {}",
        count_near(bottom, red)
    );
    assert_eq!(count_near(top, red), 0, "lr line in the loss panel");
    assert!(count_near(&rgb, [0, 0, 0]) > 500, "text and axes");
}

#[test]
fn default_output_and_other_inputs() {
    let dir = temp_dir("default");
    let metrics = write_run(&dir);
    assert_success(&ferrotune(&["plot", dir.to_str().unwrap()]));
    let (w, h, _) = read_png(&dir.join("metrics.png"));
    assert_eq!((w, h), (1200, 800));
    // The metrics file itself: the PNG goes beside it.
    assert_success(&ferrotune(&["plot", metrics.to_str().unwrap()]));
    assert!(dir.join("logs/metrics.png").is_file());
    // The logs folder.
    fs::remove_file(dir.join("logs/metrics.png")).unwrap();
    assert_success(&ferrotune(&["plot", dir.join("logs").to_str().unwrap()]));
    assert!(dir.join("logs/metrics.png").is_file());
}

/// Fails with exit code 1 and exactly one stderr line, which contains every `needles`.
fn assert_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "one line expected: {stderr}"
    );
    for n in needles {
        assert!(stderr.contains(n), "'{n}' missing from: {stderr}");
    }
}

#[test]
fn bad_metrics_files_are_one_clear_error() {
    let dir = temp_dir("bad");
    let d = dir.to_str().unwrap();
    assert_error(&ferrotune(&["plot", d]), &[d, "logs/metrics.jsonl"]);
    let missing = dir.join("nope");
    assert_error(
        &ferrotune(&["plot", missing.to_str().unwrap()]),
        &["nope", "no such file"],
    );

    let file = dir.join("metrics.jsonl");
    let f = file.to_str().unwrap();
    fs::write(&file, "").unwrap();
    assert_error(&ferrotune(&["plot", f]), &["metrics.jsonl", "empty"]);
    fs::write(
        &file,
        "{\"step\": 1, \"loss\": 2.0}\n{\"step\": 2, loss: 1}\n{\"step\": 3}\n",
    )
    .unwrap();
    assert_error(
        &ferrotune(&["plot", f]),
        &["metrics.jsonl:2", "not a JSON line"],
    );
    fs::write(&file, "{\"step\": 1, \"loss\": 2.0}\n{\"loss\": 1.5}\n").unwrap();
    assert_error(&ferrotune(&["plot", f]), &["metrics.jsonl:2", "\"step\""]);
    fs::write(&file, "{\"step\": 1, \"loss\": [2.0]}\n").unwrap();
    assert_error(&ferrotune(&["plot", f]), &["metrics.jsonl:1", "\"loss\""]);
    fs::write(&file, "{\"step\": 1, \"epoch\": 0}\n").unwrap();
    assert_error(&ferrotune(&["plot", f]), &["metrics.jsonl", "no numeric"]);
    // A torn last line (a run killed mid-write) is not an error: the lines before it plot.
    fs::write(&file, "{\"step\": 1, \"loss\": 2.0}\n{\"step\": 2, \"lo").unwrap();
    assert_success(&ferrotune(&["plot", f]));
}
