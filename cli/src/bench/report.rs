//! The benchmark's outputs: a table with ratios to the floor and to row-lock, JSON, CSV,
//! and an SVG chart (throughput and fan-in latency against width, a line per strategy).

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

use super::scenario::{Mode, Result};

pub struct Report {
    results: Vec<Result>,
    round_trips: Vec<RoundTrips>,
}

/// Round trips per completion of one mode, measured through the counting proxy.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RoundTrips {
    pub mode: Mode,
    pub width: usize,
    pub finishers: usize,
    pub batch: usize,
    pub per_completion: f64,
    /// Of those, the pool's connection tests (the same for every mode).
    pub pings_per_completion: f64,
}

impl Report {
    pub fn new(results: Vec<Result>, round_trips: Vec<RoundTrips>) -> Self {
        Report {
            results,
            round_trips,
        }
    }

    fn rate_of(&self, r: &Result, mode: &str) -> Option<f64> {
        self.results
            .iter()
            .find(|o| {
                o.width == r.width && o.finishers == r.finishers && o.mode.to_string() == mode
            })
            .map(|o| o.rate)
    }

    /// Stalls and double fires of every strategy that must have none (all but naive).
    pub fn violations(&self) -> usize {
        self.results
            .iter()
            .filter(|r| r.mode.to_string() != "naive")
            .map(|r| r.stalls + r.double_fires)
            .sum()
    }

    /// Stalls and double fires of the naive strategy (expected).
    pub fn naive_violations(&self) -> usize {
        self.results
            .iter()
            .filter(|r| r.mode.to_string() == "naive")
            .map(|r| r.stalls + r.double_fires)
            .sum()
    }

    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ =
            writeln!(
            out,
            "{:>7} {:>4} {:>3} {:<10} {:>10} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>6} {:>6} {:>4}",
            "width", "fin", "ack", "strategy", "compl/s", "x floor", "x rowlk", "lat p50", "lat p99",
            "fanin p50", "fanin p99", "block s", "stalls", "double", "cut"
        );
        let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}ms"));
        let ratio = |a: f64, b: Option<f64>| b.map_or("-".to_owned(), |b| format!("{:.2}", a / b));
        for r in &self.results {
            let _ = writeln!(
                out,
                "{:>7} {:>4} {:>3} {:<10} {:>10.0} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8.2} {:>6} {:>6} {:>4}",
                r.width,
                r.finishers,
                r.batch,
                r.mode.to_string(),
                r.rate,
                ratio(r.rate, self.rate_of(r, "floor")),
                ratio(r.rate, self.rate_of(r, "row_lock")),
                ms(Some(r.latency_p50_ms)),
                ms(Some(r.latency_p99_ms)),
                ms(r.fan_in_p50_ms),
                ms(r.fan_in_p99_ms),
                r.block_seconds,
                r.stalls,
                r.double_fires,
                if r.cut { "cut" } else { "" },
            );
        }
        if let Some(first) = self.round_trips.first() {
            let _ = writeln!(
                out,
                "\nround trips per completion, counted by a proxy (width {}, {} finishers, {} per ack);\n\
                 the pool's own connection tests in brackets:",
                first.width, first.finishers, first.batch
            );
            for r in &self.round_trips {
                let _ = writeln!(
                    out,
                    "  {:<10} {:>6.2}  ({:.2})",
                    r.mode.to_string(),
                    r.per_completion,
                    r.pings_per_completion
                );
            }
        }
        out
    }

    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        std::fs::write(
            dir.join("results.json"),
            serde_json::to_string_pretty(&serde_json::json!({
                "scenarios": self.results,
                "round_trips": self.round_trips,
            }))?,
        )?;
        let mut csv = String::from(
            "width,finishers,batch,strategy,blocks,completions,rate,ratio_floor,ratio_row_lock,latency_p50_ms,\
             latency_p99_ms,firing_p50_ms,fan_in_p50_ms,fan_in_p99_ms,fan_in_samples,block_seconds,stalls,double_fires,cut\n",
        );
        let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.4}"));
        for r in &self.results {
            let _ = writeln!(
                csv,
                "{},{},{},{},{},{},{:.1},{},{},{:.4},{:.4},{},{},{},{},{:.4},{},{},{}",
                r.width,
                r.finishers,
                r.batch,
                r.mode,
                r.blocks,
                r.completions,
                r.rate,
                opt(self.rate_of(r, "floor").map(|f| r.rate / f)),
                opt(self.rate_of(r, "row_lock").map(|f| r.rate / f)),
                r.latency_p50_ms,
                r.latency_p99_ms,
                opt(r.firing_p50_ms),
                opt(r.fan_in_p50_ms),
                opt(r.fan_in_p99_ms),
                r.fan_in_samples,
                r.block_seconds,
                r.stalls,
                r.double_fires,
                r.cut
            );
        }
        std::fs::write(dir.join("results.csv"), csv)?;
        self.chart(&dir.join("chart.svg"))
    }

    /// Throughput and fan-in p99 against width, at one finisher count (32 if measured,
    /// else the largest).
    fn chart(&self, path: &Path) -> anyhow::Result<()> {
        let mut counts: Vec<usize> = self.results.iter().map(|r| r.finishers).collect();
        counts.sort_unstable();
        counts.dedup();
        let finishers = if counts.contains(&32) {
            32
        } else {
            *counts.last().unwrap_or(&1)
        };
        let mut modes: Vec<Mode> = Vec::new();
        for r in &self.results {
            if !modes.contains(&r.mode) {
                modes.push(r.mode);
            }
        }
        let at = |mode: Mode| {
            self.results
                .iter()
                .filter(move |r| r.mode == mode && r.finishers == finishers)
        };
        let (wmin, wmax) = self.results.iter().fold((f64::MAX, 0f64), |(a, b), r| {
            (a.min(r.width as f64), b.max(r.width as f64))
        });
        let widths = (wmin / 2.0)..(wmax * 2.0);
        let rmax = self.results.iter().map(|r| r.rate).fold(1.0, f64::max) * 2.0;
        let lmax = self
            .results
            .iter()
            .filter_map(|r| r.fan_in_p99_ms)
            .fold(1.0, f64::max)
            * 2.0;

        let root = SVGBackend::new(path, (1100, 450)).into_drawing_area();
        root.fill(&WHITE)?;
        let (left, right) = root.split_horizontally(550);
        let series = |value: fn(&Result) -> Option<f64>| -> Vec<(String, Vec<(f64, f64)>)> {
            modes
                .iter()
                .map(|&mode| {
                    let points = at(mode)
                        .filter_map(|r| value(r).map(|v| (r.width as f64, v)))
                        .collect();
                    (mode.to_string(), points)
                })
                .collect()
        };
        panel(
            &left,
            &format!("completions/s ({finishers} finishers)"),
            "completions/s",
            (widths.clone(), 1.0..rmax),
            series(|r| Some(r.rate.max(1.0))),
        )?;
        panel(
            &right,
            &format!("fan-in latency p99, ms ({finishers} finishers)"),
            "ms",
            (widths, 0.1..lmax),
            series(|r| r.fan_in_p99_ms.map(|l| l.max(0.1))),
        )?;
        root.present()?;
        Ok(())
    }
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// One log-log panel: a line (with points) and a legend entry per named series.
fn panel(
    area: &Area<'_>,
    caption: &str,
    y_desc: &str,
    (x, y): (std::ops::Range<f64>, std::ops::Range<f64>),
    series: Vec<(String, Vec<(f64, f64)>)>,
) -> anyhow::Result<()> {
    const COLORS: [RGBColor; 5] = [BLACK, BLUE, RED, MAGENTA, GREEN];
    let mut c = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(60)
        .build_cartesian_2d(x.log_scale(), y.log_scale())?;
    c.configure_mesh()
        .x_desc("block width")
        .y_desc(y_desc)
        .draw()?;
    for (i, (name, points)) in series.into_iter().enumerate() {
        if points.is_empty() {
            continue;
        }
        let color = COLORS[i % COLORS.len()];
        c.draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        c.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 3, color.filled())),
        )?;
    }
    c.configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    Ok(())
}
