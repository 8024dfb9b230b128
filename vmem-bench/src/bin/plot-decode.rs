//! Plots per-iteration decode latency from the CSV `vmem-gpu` writes (docs/gpu.md):
//! `cargo run -p vmem-bench --bin plot-decode -- IN.csv OUT.svg`

use plotters::prelude::*;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (input, output) = match args.as_slice() {
        [_, i, o] => (i, o),
        _ => return Err("usage: plot-decode IN.csv OUT.svg".into()),
    };
    let text = std::fs::read_to_string(input)?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().ok_or("empty CSV")?.split(',').collect();
    let rows: Vec<Vec<f64>> = lines
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.split(',').map(str::parse).collect::<Result<_, _>>())
        .collect::<Result<_, _>>()?;
    let ymax = rows
        .iter()
        .flat_map(|r| r[1..].iter().copied())
        .fold(0.0, f64::max)
        * 1.05;
    let ymin = rows
        .iter()
        .flat_map(|r| r[1..].iter().copied())
        .fold(f64::MAX, f64::min)
        * 0.95;
    let root = SVGBackend::new(output, (900, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Decode iteration latency, Llama-3-8B shapes, B=32, 2 MB pages (H100)",
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..rows.len() as f64, ymin..ymax)?;
    chart
        .configure_mesh()
        .x_desc("iteration")
        .y_desc("ms")
        .draw()?;
    for (j, name) in header.iter().enumerate().skip(1) {
        let color = Palette99::pick(j - 1).to_rgba();
        chart
            .draw_series(LineSeries::new(
                rows.iter().map(|r| (r[0], r[j])),
                color.stroke_width(1),
            ))?
            .label(name.to_string())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 15, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    println!("wrote {output}");
    Ok(())
}
