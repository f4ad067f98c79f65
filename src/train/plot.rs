//! The loss-curve plot: a PNG drawn by `plotters` with its pure-Rust bitmap backend. The
//! text uses an embedded ASCII subset of DejaVu Sans (`DejaVuSans-ascii.ttf`, Bitstream
//! Vera licence beside it), so no system font is needed.

use super::trainer::Progress;
use crate::error::{Error, Result};
use plotters::prelude::*;
use std::path::Path;

static FONT: &[u8] = include_bytes!("DejaVuSans-ascii.ttf");

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

fn err(e: impl std::fmt::Display) -> Error {
    Error::Other(format!("loss plot: {e}"))
}

/// Training loss (raw and a 50-step moving average), validation loss and the unigram
/// baseline, in bits per byte against the optimiser step (the training loss through the
/// training split's bytes per token).
pub fn loss_png(p: &Progress, path: &Path) -> Result<()> {
    register_font();
    let per_byte = std::f64::consts::LN_2 * p.train_bytes_per_token;
    let train: Vec<(f64, f64)> = p
        .train_loss
        .iter()
        .map(|&(s, l)| (s as f64 + 1.0, l / per_byte))
        .collect();
    if train.is_empty() {
        return Ok(());
    }
    let win = 50usize;
    let smooth: Vec<(f64, f64)> = (0..train.len())
        .map(|i| {
            let lo = i.saturating_sub(win - 1);
            let m = train[lo..=i].iter().map(|v| v.1).sum::<f64>() / (i + 1 - lo) as f64;
            (train[i].0, m)
        })
        .collect();
    let val: Vec<(f64, f64)> = p
        .val_bpb
        .iter()
        .map(|&(s, b)| (s as f64 + 1.0, b))
        .collect();
    let xmax = train.last().unwrap().0.max(2.0);
    let lows = smooth.iter().chain(&val).map(|v| v.1);
    let u = p.unigram_bpb;
    let ymin = lows.fold(f64::INFINITY, f64::min).min(u) * 0.9;
    let top = if u.is_finite() { u * 1.25 } else { train[0].1 };
    let ymax = top.max(ymin + 0.5);
    // Drawn under a temporary name (ending in .png, which picks the encoder) and renamed,
    // so an interrupted run never leaves half an image.
    let tmp = path.with_file_name(format!(".loss.png.tmp-{}.png", std::process::id()));
    let root = BitMapBackend::new(&tmp, (960, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Mamba-3 training loss", ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(1f64..xmax, ymin..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("optimiser step")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .light_line_style(WHITE.mix(0.0))
        .y_desc("bits per byte")
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(err)?;
    let clamp = |v: &(f64, f64)| (v.0, v.1.min(ymax));
    chart
        .draw_series(LineSeries::new(
            train.iter().map(clamp),
            RGBColor(170, 190, 230),
        ))
        .map_err(err)?
        .label("train (per step)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RGBColor(170, 190, 230)));
    chart
        .draw_series(LineSeries::new(
            smooth.iter().map(clamp),
            BLUE.stroke_width(2),
        ))
        .map_err(err)?
        .label("train (50-step mean)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    if !val.is_empty() {
        chart
            .draw_series(LineSeries::new(val.iter().map(clamp), RED.stroke_width(2)))
            .map_err(err)?
            .label("validation")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
        chart
            .draw_series(val.iter().map(|&v| Circle::new(clamp(&v), 3, RED.filled())))
            .map_err(err)?;
    }
    if u.is_finite() {
        chart
            .draw_series(LineSeries::new([(1.0, u), (xmax, u)], BLACK.mix(0.6)))
            .map_err(err)?
            .label(format!("unigram baseline ({u:.2})"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.6)));
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    drop(chart);
    drop(root);
    std::fs::rename(&tmp, path).map_err(|e| crate::error::Error::io(path, e))
}
