//! ServeGen's production rate series (`../shared/data/servegen/`: one
//! client per file, 10-minute windows of rate, CV and a fitted
//! inter-arrival distribution) drawn as multi-model request arrivals, with
//! a stated seed, for [`super::timeline`].
//!
//! A `simulate` input rather than a converter script: the traces hold
//! about 2.2 billion requests over 14 days (one client alone 1.1 billion),
//! which no CSV of rows could carry, and a replay needs them drawn the
//! same way each time from a seed. The draw:
//!
//! - client `i` (files in the order of their chunk number) is model
//!   `i mod models`;
//! - in each window with a rate, arrivals are a renewal process from the
//!   window's start to its end whose gaps follow the window's family at
//!   the window's mean: Gamma with shape `1/CV^2` (the measured CV), or
//!   Weibull with the fitted shape (its scale set so the mean gap is the
//!   window's); a window with no family is Poisson;
//! - a client's rate above `cap` requests a second is drawn at `cap`, each
//!   arrival standing for `rate/cap` requests (its `weight`): a model that
//!   busy is resident whatever the policy, and the requests that wait for
//!   one of its loads are counted at their real number. Below the cap,
//!   every request is drawn.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Exp, Gamma, Weibull};
use std::io::Read;
use std::path::Path;

/// The fitted distribution of a window's gaps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Family {
    Weibull {
        shape: f64,
    },
    Gamma,
    /// No fit (too few requests): Poisson.
    Unfitted,
}

/// One 10-minute window of one client.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Window {
    pub start: f64,
    /// Requests per second.
    pub rate: f64,
    /// Coefficient of variation of the gaps.
    pub cv: f64,
    pub family: Family,
}

/// The windows' length in the traces.
pub const WINDOW_SECONDS: f64 = 600.0;

/// One client's series.
#[derive(Clone, Debug, PartialEq)]
pub struct Client {
    pub name: String,
    pub windows: Vec<Window>,
}

/// Reads one client's CSV: `start,rate,cv,family,shape,scale` rows.
pub fn parse_client(name: &str, text: &str) -> Result<Client, String> {
    let mut windows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = |what: &str| format!("{name}:{}: {what}: {line:?}", i + 1);
        let f: Vec<&str> = line.split(',').collect();
        if f.len() != 6 {
            return Err(bad("expected 6 fields"));
        }
        let num = |s: &str, what: &str| -> Result<f64, String> {
            let v: f64 = s.parse().map_err(|_| bad(what))?;
            (v.is_finite() && v >= 0.0)
                .then_some(v)
                .ok_or_else(|| bad(what))
        };
        let (start, rate, cv) = (num(f[0], "start")?, num(f[1], "rate")?, num(f[2], "cv")?);
        let family = match f[3] {
            "Weibull" => match num(f[4], "shape")? {
                s if s > 0.0 => Family::Weibull { shape: s },
                _ => Family::Unfitted,
            },
            "Gamma" => Family::Gamma,
            "" => Family::Unfitted,
            other => return Err(bad(&format!("unknown family {other:?}"))),
        };
        if windows.last().is_some_and(|w: &Window| w.start >= start) {
            return Err(bad("windows out of order"));
        }
        windows.push(Window {
            start,
            rate,
            cv,
            family,
        });
    }
    Ok(Client {
        name: name.to_owned(),
        windows,
    })
}

/// The chunk number in `chunk-N-trace.csv`, the clients' order.
fn chunk_number(name: &str) -> Option<u64> {
    let base = name.rsplit('/').next()?;
    base.strip_prefix("chunk-")?
        .strip_suffix("-trace.csv")?
        .parse()
        .ok()
}

/// Reads every `chunk-N-trace.csv` of a `.tgz` archive (as shipped) or of a
/// directory, in the order of N.
pub fn read(path: &Path) -> Result<Vec<Client>, String> {
    let mut files: Vec<(u64, String, String)> = Vec::new();
    let origin = path.display();
    if path.is_dir() {
        for entry in std::fs::read_dir(path).map_err(|e| format!("{origin}: {e}"))? {
            let entry = entry.map_err(|e| format!("{origin}: {e}"))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(n) = chunk_number(&name) {
                let text = std::fs::read_to_string(entry.path())
                    .map_err(|e| format!("{origin}/{name}: {e}"))?;
                files.push((n, name, text));
            }
        }
    } else {
        let file = std::fs::File::open(path).map_err(|e| format!("{origin}: {e}"))?;
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(file));
        let entries = archive.entries().map_err(|e| format!("{origin}: {e}"))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| format!("{origin}: {e}"))?;
            let name = entry.path().map_err(|e| format!("{origin}: {e}"))?;
            let name = name.to_string_lossy().into_owned();
            if let Some(n) = chunk_number(&name) {
                let mut text = String::new();
                entry
                    .read_to_string(&mut text)
                    .map_err(|e| format!("{origin}: {name}: {e}"))?;
                files.push((n, name, text));
            }
        }
    }
    if files.is_empty() {
        return Err(format!("{origin}: no chunk-N-trace.csv in it"));
    }
    files.sort_by_key(|f| f.0);
    files
        .iter()
        .map(|(_, name, text)| parse_client(name, text))
        .collect()
}

/// One drawn request (or `weight` requests at one instant).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Arrival {
    pub time: f64,
    pub model: u32,
    pub weight: f32,
}

/// How the series are drawn.
#[derive(Clone, Copy, Debug)]
pub struct Drawing {
    pub models: usize,
    /// Requests a second a client is drawn at, at most.
    pub cap: f64,
    pub seed: u64,
    /// Only windows starting before this (seconds): a shorter replay.
    pub until: Option<f64>,
}

/// A gap sampler at mean `mean` for a window's family.
enum Gaps {
    Gamma(Gamma<f64>),
    Weibull(Weibull<f64>),
    Exp(Exp<f64>),
}

impl Gaps {
    fn new(w: &Window, mean: f64) -> Gaps {
        let exp = || Gaps::Exp(Exp::new(1.0 / mean).expect("positive rate"));
        match w.family {
            Family::Gamma if w.cv > 0.0 => {
                let shape = 1.0 / (w.cv * w.cv);
                Gamma::new(shape, mean / shape).map_or_else(|_| exp(), Gaps::Gamma)
            }
            Family::Weibull { shape } => {
                let scale = mean / libm::tgamma(1.0 + 1.0 / shape);
                if scale.is_finite() && scale > 0.0 {
                    Weibull::new(scale, shape).map_or_else(|_| exp(), Gaps::Weibull)
                } else {
                    exp()
                }
            }
            _ => exp(),
        }
    }

    fn sample(&self, rng: &mut StdRng) -> f64 {
        match self {
            Gaps::Gamma(d) => d.sample(rng),
            Gaps::Weibull(d) => d.sample(rng),
            Gaps::Exp(d) => d.sample(rng),
        }
    }
}

/// Every client's arrivals in time order (ties by model), drawn as the
/// module says. The same clients and drawing give the same arrivals.
pub fn arrivals(clients: &[Client], drawing: &Drawing) -> Vec<Arrival> {
    let models = drawing.models.max(1);
    let mut out = Vec::new();
    for (i, client) in clients.iter().enumerate() {
        // A stream per client: its arrivals do not depend on the others.
        let mut rng =
            StdRng::seed_from_u64(drawing.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64);
        let model = (i % models) as u32;
        for w in &client.windows {
            if drawing.until.is_some_and(|u| w.start >= u) || w.rate <= 0.0 {
                continue;
            }
            let drawn = w.rate.min(drawing.cap);
            let weight = (w.rate / drawn) as f32;
            let gaps = Gaps::new(w, 1.0 / drawn);
            let end = w.start + WINDOW_SECONDS;
            let mut t = w.start + gaps.sample(&mut rng);
            while t < end {
                out.push(Arrival {
                    time: t,
                    model,
                    weight,
                });
                t += gaps.sample(&mut rng);
            }
        }
    }
    out.sort_by(|a, b| a.time.total_cmp(&b.time).then(a.model.cmp(&b.model)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = "0,0,0,,0,0\n600,0.5,1.2,Gamma,0.7,2.8\n1200,2.0,3.0,Weibull,0.4,0.1\n";

    #[test]
    fn a_client_is_read_with_its_families_and_bad_rows_are_named() {
        let c = parse_client("chunk-3-trace.csv", TWO).unwrap();
        assert_eq!(c.windows.len(), 3);
        assert_eq!(c.windows[1].family, Family::Gamma);
        assert_eq!(c.windows[2].family, Family::Weibull { shape: 0.4 });
        let e = parse_client("c", "0,1,1,Pareto,1,1\n").unwrap_err();
        assert!(e.contains("c:1: unknown family"), "{e}");
        let e = parse_client("c", "600,1,1,,0,0\n0,1,1,,0,0\n").unwrap_err();
        assert!(e.contains("c:2: windows out of order"), "{e}");
        assert!(parse_client("c", "0,-1,1,,0,0\n").is_err());
        assert!(parse_client("c", "0,1,1\n").is_err());
        assert_eq!(chunk_number("data/x/chunk-12-trace.csv"), Some(12));
    }

    #[test]
    fn the_draw_keeps_each_windows_rate_and_its_seed() {
        // One client at 0.5/s (Gamma, CV 1.2) and 2/s (Weibull) for a day's
        // worth of windows each.
        let mut text = String::new();
        for w in 0..144 {
            text.push_str(&format!("{},0.5,1.2,Gamma,0,0\n", w * 600));
        }
        for w in 144..288 {
            text.push_str(&format!("{},2.0,3.0,Weibull,0.4,0.1\n", w * 600));
        }
        let clients = [parse_client("c", &text).unwrap()];
        let drawing = Drawing {
            models: 4,
            cap: 1.0,
            seed: 7,
            until: None,
        };
        let a = arrivals(&clients, &drawing);
        let day = 86_400.0;
        let first: Vec<_> = a.iter().filter(|x| x.time < day).collect();
        let second: Vec<_> = a.iter().filter(|x| x.time >= day).collect();
        // 43,200 expected in the first day; within 3%.
        let n = first.len() as f64;
        assert!((n / 43_200.0 - 1.0).abs() < 0.03, "{n}");
        assert!(first.iter().all(|x| x.weight == 1.0));
        // The second is drawn at the cap, each arrival two requests.
        let weighted: f64 = second.iter().map(|x| x.weight as f64).sum();
        assert!((weighted / 172_800.0 - 1.0).abs() < 0.1, "{weighted}");
        assert!(second.iter().all(|x| x.weight == 2.0));
        assert!(a.windows(2).all(|p| p[0].time <= p[1].time));
        assert_eq!(arrivals(&clients, &drawing), a);
        let other = arrivals(&clients, &Drawing { seed: 8, ..drawing });
        assert_ne!(other, a);
    }
}
