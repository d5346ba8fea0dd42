//! The Prometheus text format, shared by every process's `/metrics` (the
//! operator's, the router's and the node agent's): writing a registry, and
//! reading samples back the way a scraper would (the copy scaler reads the
//! routers' in-flight counts so; tests and benchmarks read every count so).

use prometheus_client::registry::Registry;
use std::collections::HashMap;

/// `registry`'s OpenMetrics text exposition (the operator's, the router's
/// and the node agent's `/metrics`).
pub fn exposition(registry: &Registry) -> String {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)
        .expect("writing to a String cannot fail");
    out
}

/// `metric`'s samples in an OpenMetrics exposition: each one's label text
/// (what stands between the braces, empty without) and value.
fn samples<'e>(exposition: &'e str, metric: &'e str) -> impl Iterator<Item = (&'e str, f64)> {
    exposition.lines().filter_map(move |line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        (name == metric).then(|| Some((labels, value.parse::<f64>().ok()?)))?
    })
}

/// `metric`'s samples in an OpenMetrics exposition summed by the values of
/// its `labels` (a sample lacking one has it empty).
pub fn by_labels<const N: usize>(
    exposition: &str,
    metric: &str,
    labels: [&str; N],
) -> HashMap<[String; N], f64> {
    let mut sums = HashMap::new();
    for (set, value) in samples(exposition, metric) {
        if !value.is_finite() {
            continue;
        }
        let values = labels.map(|l| label_value(set, l).unwrap_or_default().to_owned());
        *sums.entry(values).or_default() += value;
    }
    sums
}

/// The value of `label` in a sample's label set (`a="x",b="y"`).
fn label_value<'a>(set: &'a str, label: &str) -> Option<&'a str> {
    let mut rest = set;
    while let Some(eq) = rest.find("=\"") {
        let name = rest[..eq].trim_start_matches([',', ' ']);
        let tail = &rest[eq + 2..];
        let end = tail.find('"')?;
        if name == label {
            return Some(&tail[..end]);
        }
        rest = &tail[end + 1..];
    }
    None
}

/// The sum of `metric`'s samples in an OpenMetrics exposition whose labels
/// contain `labels` (for tests and benchmarks, which read metrics as a
/// scraper would).
pub fn sum_where(exposition: &str, metric: &str, labels: &str) -> u64 {
    samples(exposition, metric)
        .filter(|(l, _)| l.contains(labels))
        .map(|(_, v)| v)
        .sum::<f64>() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_summed_by_label_and_filtered_by_labels() {
        let text = "# HELP m x\nm{model=\"a\",code=\"200\"} 2\nm{model=\"b\"} 1.5\nm{model=\"a\"} 3\nmm{model=\"a\"} 9\nm 4\n";
        let sums = by_labels(text, "m", ["model"]);
        assert_eq!(sums.len(), 3);
        let of = |m: &str| sums[&[m.to_owned()]];
        assert_eq!((of("a"), of("b"), of("")), (5.0, 1.5, 4.0));
        assert_eq!(sum_where(text, "m", r#"model="a""#), 5);
        assert_eq!(sum_where(text, "m", ""), 10);
        let two = "m{namespace=\"a\",model=\"x\"} 2\nm{model=\"x\",namespace=\"b\"} 3\nm{xmodel=\"y\",model=\"x\"} 1\n";
        let sums = by_labels(two, "m", ["namespace", "model"]);
        assert_eq!(sums[&["a".to_owned(), "x".to_owned()]], 2.0);
        assert_eq!(sums[&["b".to_owned(), "x".to_owned()]], 3.0);
        // No namespace label: empty; a label whose name ends in `model` is
        // not `model`.
        assert_eq!(sums[&[String::new(), "x".to_owned()]], 1.0);
    }
}
