//! The sweep chart: hit rate and TTFT p99 against the swept value, on two y axes.

use std::path::Path;

use plotters::prelude::*;

use crate::row::Row;

pub(crate) fn draw(path: &Path, name: &str, rows: &[Row]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let n = rows.len().max(1);
    let ttft_max = rows.iter().map(|r| r.ttft_p99_ms).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("kvsim sweep of {name}"), ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .right_y_label_area_size(70)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..100f64)
        .map_err(|e| err(&e))?
        .set_secondary_coord(-0.5f64..(n as f64 - 0.5), 0f64..ttft_max);
    let label = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 {
            rows.get(i as usize)
                .map(|r| r.value.clone())
                .unwrap_or_default()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .x_desc(name)
        .y_desc("request hit rate (%)")
        .x_labels(n.min(24) * 2 + 1)
        .x_label_formatter(&label)
        .disable_x_mesh()
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .configure_secondary_axes()
        .y_desc("TTFT p99 (ms)")
        .draw()
        .map_err(|e| err(&e))?;
    let hits: Vec<(f64, f64)> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| (i as f64, r.request_hit_rate * 100.0))
        .collect();
    let ttft: Vec<(f64, f64)> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| (i as f64, r.ttft_p99_ms))
        .collect();
    chart
        .draw_series(LineSeries::new(hits.clone(), BLUE.stroke_width(2)))
        .map_err(|e| err(&e))?
        .label("request hit rate (left)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    chart
        .draw_series(hits.iter().map(|&p| Circle::new(p, 4, BLUE.filled())))
        .map_err(|e| err(&e))?;
    chart
        .draw_secondary_series(LineSeries::new(ttft.clone(), RED.stroke_width(2)))
        .map_err(|e| err(&e))?
        .label("TTFT p99 (right)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    chart
        .draw_secondary_series(
            ttft.iter()
                .map(|&p| TriangleMarker::new(p, 5, RED.filled())),
        )
        .map_err(|e| err(&e))?;
    finish(&mut chart, &root, SeriesLabelPosition::MiddleRight)
}

/// The capacity chart: attainment (%) of each run against its rate or instance count, with the
/// target as a dashed line.
pub(crate) fn draw_attainment(
    path: &Path,
    x_label: &str,
    points: &[(f64, f64)],
    target: f64,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let mut pts: Vec<(f64, f64)> = points.iter().map(|&(x, a)| (x, a * 100.0)).collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let x_max = pts.iter().map(|p| p.0).fold(1.0, f64::max) * 1.05;
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("kvsim capacity: SLO attainment", ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, 0f64..101f64)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc("requests within every target (%)")
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(pts.clone(), BLUE.stroke_width(2)))
        .map_err(|e| err(&e))?
        .label("attainment")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    chart
        .draw_series(pts.iter().map(|&p| Circle::new(p, 4, BLUE.filled())))
        .map_err(|e| err(&e))?;
    let t = target * 100.0;
    chart
        .draw_series(DashedLineSeries::new(
            vec![(0.0, t), (x_max, t)],
            6,
            4,
            RED.stroke_width(1),
        ))
        .map_err(|e| err(&e))?
        .label(format!("target {t:.1}%"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(1)));
    finish(&mut chart, &root, SeriesLabelPosition::LowerLeft)
}

/// Draws the legend at `at` and writes the file.
fn finish<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    root: &DrawingArea<DB, plotters::coord::Shift>,
    at: SeriesLabelPosition,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(at)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

/// The fidelity chart: each phase's mean TTFT (log scale: a queueing phase dwarfs the rest),
/// ITL and mean E2E, measured and simulated, in three panels; the phases the fit saw are
/// marked `*` on the x axis.
pub(crate) fn draw_fidelity(
    path: &Path,
    title: &str,
    phases: &[kvsim::PhaseComparison],
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let root = SVGBackend::new(path, (1200, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 20))
        .map_err(|e| err(&e))?;
    let panels = root.split_evenly((1, 3));
    let pick_ttft: Pick = |f| f.ttft_mean;
    let pick_itl: Pick = |f| f.itl_mean;
    let pick_e2e: Pick = |f| f.e2e_mean;
    let (lo, hi) = bounds(phases, pick_ttft);
    let ttft = ChartBuilder::on(&panels[0])
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(x_range(phases), (lo / 1.5..hi * 1.5).log_scale())
        .map_err(|e| err(&e))?;
    panel(ttft, phases, "mean TTFT (ms, log)", pick_ttft)?;
    for (area, name, pick) in [
        (&panels[1], "ITL (ms)", pick_itl),
        (&panels[2], "mean E2E (ms)", pick_e2e),
    ] {
        let (_, hi) = bounds(phases, pick);
        let chart = ChartBuilder::on(area)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(x_range(phases), 0f64..hi * 1.15)
            .map_err(|e| err(&e))?;
        panel(chart, phases, name, pick)?;
    }
    root.present().map_err(|e| err(&e))
}

/// Which figure of a phase a panel shows.
type Pick = fn(&kvsim::PhaseFigures) -> f64;

fn x_range(phases: &[kvsim::PhaseComparison]) -> std::ops::Range<f64> {
    -0.5..(phases.len().max(1) as f64 - 0.5)
}

/// The smallest positive and the largest value of a figure, measured or simulated.
fn bounds(phases: &[kvsim::PhaseComparison], pick: Pick) -> (f64, f64) {
    let all = phases.iter().flat_map(|p| [pick(&p.real), pick(&p.sim)]);
    let lo = all
        .clone()
        .filter(|v| *v > 0.0)
        .fold(f64::INFINITY, f64::min);
    let hi = all.fold(1e-9, f64::max);
    (if lo.is_finite() { lo } else { 1e-3 }, hi)
}

/// One panel: measured (black, circles) and kvsim (red, triangles) by phase.
fn panel<'a, Y>(
    mut chart: ChartContext<
        'a,
        SVGBackend<'a>,
        Cartesian2d<plotters::coord::types::RangedCoordf64, Y>,
    >,
    phases: &[kvsim::PhaseComparison],
    name: &str,
    pick: Pick,
) -> Result<(), String>
where
    Y: Ranged<ValueType = f64> + plotters::coord::ranged1d::ValueFormatter<f64>,
{
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let label = |x: &f64| {
        let i = x.round();
        match phases.get(i as usize) {
            Some(p) if (x - i).abs() < 1e-6 && i >= 0.0 => {
                format!("{}{}", p.phase, if p.fitted { "*" } else { "" })
            }
            _ => String::new(),
        }
    };
    chart
        .configure_mesh()
        .x_desc("phase (* fitted)")
        .y_desc(name)
        .x_labels(phases.len().clamp(1, 24) * 2 + 1)
        .x_label_formatter(&label)
        .disable_x_mesh()
        .draw()
        .map_err(|e| err(&e))?;
    let pts = |sim: bool| -> Vec<(f64, f64)> {
        phases
            .iter()
            .enumerate()
            .map(|(i, p)| (i as f64, pick(if sim { &p.sim } else { &p.real })))
            .collect()
    };
    let real = pts(false);
    chart
        .draw_series(LineSeries::new(real.clone(), BLACK.stroke_width(2)))
        .map_err(|e| err(&e))?
        .label("measured")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    chart
        .draw_series(real.iter().map(|&p| Circle::new(p, 4, BLACK.filled())))
        .map_err(|e| err(&e))?;
    let sim = pts(true);
    chart
        .draw_series(LineSeries::new(sim.clone(), RED.stroke_width(2)))
        .map_err(|e| err(&e))?
        .label("kvsim")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    chart
        .draw_series(sim.iter().map(|&p| TriangleMarker::new(p, 5, RED.filled())))
        .map_err(|e| err(&e))?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    Ok(())
}
