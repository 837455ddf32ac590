//! `ferrotune plot`: draw a run's loss and learning rate against step into a PNG.
//!
//! Reads the JSONL a `DiskLogger` writes (`{"step": 3, "loss": 1.23, "lr": 0.0003, ...}` per
//! line). Text is rendered with plotters' `ab_glyph` backend and the DejaVu Sans font embedded
//! from the `dejavu` crate, so no system fontconfig/freetype is needed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use serde_json::Value;

#[derive(Args)]
pub struct PlotArgs {
    /// A training output folder (its logs/metrics.jsonl is read), a logs folder holding
    /// metrics.jsonl, or a metrics .jsonl file.
    #[arg(value_name = "OUTPUT_DIR")]
    input: PathBuf,
    /// The PNG to write [default: metrics.png in OUTPUT_DIR, or beside the metrics file].
    #[arg(long)]
    output: Option<PathBuf>,
    /// Image width in pixels.
    #[arg(long, default_value_t = 1200)]
    width: u32,
    /// Image height in pixels.
    #[arg(long, default_value_t = 800)]
    height: u32,
}

/// The metric curves of one run: `(step, value)` sorted by step.
struct Curves {
    loss: Vec<(f64, f64)>,
    lr: Vec<(f64, f64)>,
}

pub fn run(args: PlotArgs) -> Result<()> {
    if !(64..=16384).contains(&args.width) || !(64..=16384).contains(&args.height) {
        bail!(
            "--width/--height: {}x{} is outside 64..=16384 pixels",
            args.width,
            args.height
        );
    }
    let (metrics, default_png) = locate(&args.input)?;
    let curves = read_metrics(&metrics)?;
    let png = args.output.unwrap_or(default_png);
    let title = format!("Training metrics: {}", metrics.display());
    let rgb = draw(&curves, &title, args.width, args.height)
        .map_err(|e| anyhow!("{}: cannot draw the plot: {e}", png.display()))?;
    write_png(&png, &rgb, args.width, args.height)?;
    println!("{}", png.display());
    Ok(())
}

/// The metrics file named by `input`, and the default PNG path for it.
fn locate(input: &Path) -> Result<(PathBuf, PathBuf)> {
    if input.is_file() {
        let dir = input.parent().unwrap_or(Path::new("."));
        return Ok((input.to_path_buf(), dir.join("metrics.png")));
    }
    if !input.is_dir() {
        bail!("{}: no such file or folder", input.display());
    }
    for candidate in [
        input.join("logs/metrics.jsonl"),
        input.join("metrics.jsonl"),
    ] {
        if candidate.is_file() {
            return Ok((candidate, input.join("metrics.png")));
        }
    }
    bail!(
        "{}: no metrics file (looked for logs/metrics.jsonl and metrics.jsonl; a DiskLogger \
         metric_logger writes it)",
        input.display()
    )
}

/// Reads `step`, `loss` and `lr` from every line. A later line for the same step replaces an
/// earlier one (a resumed run that was not truncated); non-numeric values (`"NaN"`) are gaps.
fn read_metrics(path: &Path) -> Result<Curves> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let mut loss = BTreeMap::new();
    let mut lr = BTreeMap::new();
    let mut steps = 0usize;
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    for (i, raw) in lines.iter().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let obj: Value = match serde_json::from_str(line) {
            Ok(v) => v,
            // The last line of a run that is still being written (or was killed) may be torn.
            Err(_) if i + 1 == lines.len() && !raw.ends_with('\n') => break,
            Err(e) => bail!("{}: not a JSON line: {e}", at()),
        };
        let obj = obj
            .as_object()
            .ok_or_else(|| anyhow!("{}: expected a JSON object, got {line}", at()))?;
        let step = obj
            .get("step")
            .and_then(Value::as_u64)
            .ok_or_else(|| anyhow!("{}: missing a non-negative integer \"step\"", at()))?;
        steps += 1;
        for (key, map) in [("loss", &mut loss), ("lr", &mut lr)] {
            match obj.get(key) {
                Some(v) if v.is_number() => {
                    map.insert(step, v.as_f64().unwrap_or(f64::NAN));
                }
                Some(Value::String(_)) | Some(Value::Null) => {
                    map.remove(&step);
                }
                Some(other) => bail!("{}: \"{key}\" is not a number: {other}", at()),
                None => {}
            }
        }
    }
    if steps == 0 {
        bail!("{}: empty, no steps logged", path.display());
    }
    let to_vec = |m: BTreeMap<u64, f64>| -> Vec<(f64, f64)> {
        m.into_iter()
            .map(|(s, v)| (s as f64, v))
            .filter(|(_, v)| v.is_finite())
            .collect()
    };
    let curves = Curves {
        loss: to_vec(loss),
        lr: to_vec(lr),
    };
    if curves.loss.is_empty() && curves.lr.is_empty() {
        bail!(
            "{}: no numeric \"loss\" or \"lr\" values in {steps} lines",
            path.display()
        );
    }
    Ok(curves)
}

/// Registers the embedded font once; plotters looks fonts up by family name.
fn register_embedded_font() -> Result<()> {
    static ONCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *ONCE.get_or_init(|| {
        register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular()).is_ok()
    });
    if ok {
        Ok(())
    } else {
        bail!("the embedded DejaVu Sans font could not be loaded")
    }
}

/// One chart: its metric name, its points and the line colour.
type Panel<'a> = (&'a str, &'a [(f64, f64)], RGBColor);

type DrawResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Renders the curves into an RGB buffer: a title, then one panel per metric that has values.
fn draw(curves: &Curves, title: &str, width: u32, height: u32) -> DrawResult<Vec<u8>> {
    register_embedded_font()?;
    let mut buf = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (width, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let title_size = (height / 30).clamp(12, 28);
        let root = root.titled(title, ("sans-serif", title_size))?;
        let panels: Vec<Panel> = [
            ("loss", curves.loss.as_slice(), RGBColor(0x1f, 0x77, 0xb4)),
            (
                "learning rate",
                curves.lr.as_slice(),
                RGBColor(0xd6, 0x27, 0x28),
            ),
        ]
        .into_iter()
        .filter(|(_, pts, _)| !pts.is_empty())
        .collect();
        let areas = root.split_evenly((panels.len(), 1));
        for ((name, points, color), area) in panels.into_iter().zip(areas.iter()) {
            draw_panel(area, name, points, color, height)?;
        }
        root.present()?;
    }
    Ok(buf)
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    name: &str,
    points: &[(f64, f64)],
    color: RGBColor,
    height: u32,
) -> DrawResult<()>
where
    DB::ErrorType: 'static,
{
    let (x0, x1) = padded_range(points.iter().map(|p| p.0), false);
    let (y0, y1) = padded_range(points.iter().map(|p| p.1), true);
    let label_size = (height / 45).clamp(10, 18);
    let mut chart = ChartBuilder::on(area)
        .margin(10)
        // Room for the last x label, which is centred on the right edge.
        .margin_right(30)
        .caption(format!("{name} vs step"), ("sans-serif", label_size + 2))
        .x_label_area_size(label_size * 3)
        .y_label_area_size(label_size * 6)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    // Learning rates are small: scientific notation keeps their labels short and exact.
    let small = y1.abs().max(y0.abs()) < 1e-2;
    let y_fmt = move |v: &f64| {
        if small {
            format!("{v:.1e}")
        } else {
            format!("{v:.3}")
        }
    };
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(name)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&y_fmt)
        .label_style(("sans-serif", label_size))
        .axis_desc_style(("sans-serif", label_size))
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .draw()?;
    chart.draw_series(LineSeries::new(
        points.iter().copied(),
        color.stroke_width(2),
    ))?;
    if points.len() == 1 {
        // A single point is no line: mark it.
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    Ok(())
}

/// The data range widened by 5% (and made non-empty), so curves do not touch the frame.
fn padded_range(values: impl Iterator<Item = f64>, pad: bool) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let span = hi - lo;
    if span <= 0.0 {
        let d = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        return (lo - d, hi + d);
    }
    let p = if pad { span * 0.05 } else { 0.0 };
    (lo - p, hi + p)
}

fn write_png(path: &Path, rgb: &[u8], width: u32, height: u32) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("{}: cannot create folder", dir.display()))?;
    }
    let file = std::fs::File::create(path)
        .with_context(|| format!("{}: cannot create", path.display()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), width, height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc
        .write_header()
        .with_context(|| format!("{}: cannot write PNG", path.display()))?;
    w.write_image_data(rgb)
        .and_then(|_| w.finish())
        .with_context(|| format!("{}: cannot write PNG", path.display()))
}
