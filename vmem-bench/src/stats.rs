//! The statistics every benchmark reports, computed one way: each sorts its samples and
//! takes an order statistic (no interpolation).

/// Sorts `v` in place (total order: NaNs last) and returns it.
pub fn sorted(v: &mut [f64]) -> &[f64] {
    v.sort_by(f64::total_cmp);
    v
}

/// The median of `v` (the upper one for an even count), sorting it in place.
///
/// # Panics
/// If `v` is empty.
pub fn median(v: &mut [f64]) -> f64 {
    let v = sorted(v);
    v[v.len() / 2]
}

/// The 99th percentile of `v`, element `n * 99 / 100` once sorted (in place).
///
/// # Panics
/// If `v` is empty.
pub fn p99(v: &mut [f64]) -> f64 {
    let v = sorted(v);
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

/// Element `floor(n * p)` (at most the last) of `v` once sorted (in place), for `p` in
/// `[0, 1]`.
///
/// # Panics
/// If `v` is empty.
pub fn quantile(v: &mut [f64], p: f64) -> f64 {
    let v = sorted(v);
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_statistics_of_a_shuffled_range() {
        let mut v: Vec<f64> = (0..200).map(|i| ((i * 73) % 200) as f64).collect();
        assert_eq!(median(&mut v), 100.0);
        assert_eq!(p99(&mut v), 198.0);
        assert_eq!(quantile(&mut v, 0.25), 50.0);
        assert_eq!(quantile(&mut v, 1.0), 199.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(p99(&mut [5.0]), 5.0);
    }
}
