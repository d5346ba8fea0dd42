//! `model-residency simulate`: replay a trace or a list of model names.

use super::Failure;
use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use model_residency::engine::copies::CopyPolicy;
use model_residency::quantity::parse_bytes;
use model_residency::registry;
use model_residency::simulate::fleet::{
    FleetOptions, Outage, parse_failure, parse_maintenance, replay_fleet,
};
use model_residency::simulate::foresight::Foresight;
use model_residency::simulate::trace::TraceReader;
use model_residency::simulate::{ReplayOptions, Report, replay_names, replay_trace};
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// VRAM budget: a Kubernetes quantity (16000Mi, 80Gi) or plain bytes.
    #[arg(long)]
    budget: String,
    /// YAML list of models: `- {name: zimage, size: 10900Mi, pinned: false}`.
    #[arg(long)]
    registry: Option<PathBuf>,
    /// CSV trace `time,model[,size]` (optional header; gzip or zstd allowed).
    #[arg(long, conflicts_with = "models")]
    trace: Option<PathBuf>,
    /// Models to request, one request each, in order.
    #[arg(value_name = "MODEL")]
    models: Vec<String>,
    /// Unload a model not requested for this long, in the trace's time
    /// unit (the operator's spec.keepAlive); needs --trace.
    #[arg(long, requires = "trace", value_name = "TIME")]
    keep_alive: Option<f64>,
    /// Write requests as the router does with this --recency-resolution
    /// (in the trace's time unit): hits are written at most once per
    /// resolution per model, so the LRU order is approximate. `hits` then
    /// counts requests that found their model resident; `demand writes`
    /// counts what reached the residency. Needs --trace.
    #[arg(long, requires = "trace", value_name = "TIME")]
    recency_resolution: Option<f64>,
    /// The node's disk for model artifacts: a load whose artifact is not
    /// on it waits for its fetch first (--fetch-seconds-per-gib); it then
    /// stays, and the disk drops others' (least recently used; by rate
    /// under --eviction rate). Needs --trace.
    #[arg(long, requires = "trace", value_name = "QUANTITY")]
    disk_budget: Option<String>,
    /// Seconds a fetch takes per GiB of artifact (default 1.5: the node
    /// agent's own download on loopback, `cargo bench --bench artifacts`).
    #[arg(long, requires = "disk_budget", value_name = "SECONDS")]
    fetch_seconds_per_gib: Option<f64>,
    /// Host memory the sleeping models may hold (the operator's
    /// spec.warm.hostBudget): models whose registry entry has `sleep` are
    /// put to sleep instead of evicted while it has room.
    #[arg(long, value_name = "QUANTITY")]
    warm_budget: Option<String>,
    /// Which resident makes room: lru (the seed's), cost
    /// (GreedyDual-Size-Frequency over load and wake seconds) or rate
    /// (each model's decayed request rate times what bringing it back
    /// costs, with host admission).
    #[arg(long, value_enum, default_value_t = EvictionArg::Lru)]
    eviction: EvictionArg,
    /// A ceiling for `--eviction rate` (#39): its keys take each model's
    /// share of the requests from this CSV file (`row,model,share`: from
    /// trace row `row`, from 0, on), the rates the trace was drawn with
    /// (`scripts/traces.py` writes `rates.csv`), instead of estimating
    /// them. A measurement, not a policy. Needs --trace.
    #[arg(
        long,
        requires = "trace",
        value_name = "FILE",
        conflicts_with = "clairvoyant"
    )]
    known_rates: Option<PathBuf>,
    /// A ceiling for `--eviction rate` (#39): its keys take each model's
    /// next request from the trace itself (read once first), as if it
    /// knew the future: farthest next use, weighed by cost per GiB. A
    /// measurement, not a policy. Needs --trace.
    #[arg(long, requires = "trace")]
    clairvoyant: bool,
    /// Load seconds of models whose registry entry has no loadTime.
    #[arg(long, value_name = "SECONDS")]
    load_seconds: Option<f64>,
    /// Wake seconds of sleeping models whose entry has no sleep.wakeTime
    /// (default: a twentieth of the load).
    #[arg(long, value_name = "SECONDS")]
    wake_seconds: Option<f64>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(flatten)]
    fleet: FleetArgs,
}

/// Several GPUs and copies of a model (the operator's copy policy); the
/// trace's times are then seconds.
#[derive(clap::Args, Debug)]
struct FleetArgs {
    /// GPUs, each with --budget and the whole registry; above 1 the trace
    /// is replayed over all of them with copies (needs --trace).
    #[arg(long, default_value_t = 1, requires = "trace")]
    gpus: usize,
    /// Seconds a request is in flight once served (with --gpus).
    #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
    service_seconds: f64,
    /// Requests in flight one copy should carry (copies.targetInFlight).
    #[arg(long, default_value_t = 100.0)]
    copies_target: f64,
    /// The most copies of a model (default: every GPU).
    #[arg(long)]
    copies_max: Option<u32>,
    /// Seconds the in-flight counts are averaged over.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    copies_window: f64,
    /// Seconds between two removals (copies.scaleDownDelay).
    #[arg(long, default_value_t = 120.0, value_name = "SECONDS")]
    copies_delay: f64,
    /// Seconds between two decisions of the copy policy.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    copies_tick: f64,
    /// A model of the registry that spans N GPUs at once (tensor parallel
    /// N, its size held on each), placed and evicted all or nothing
    /// (repeatable; with --gpus).
    #[arg(long = "gang", value_name = "NAME=N", value_parser = parse_gang)]
    gangs: Vec<(String, usize)>,
    /// Each gang gets GPUs of its own that nothing else uses (the first N,
    /// then the next), the single models the rest: the same trace without
    /// shared budgets, to compare against.
    #[arg(long, requires = "gangs")]
    dedicated: bool,
    /// GPU G fails at T seconds (its device tainted NoExecute): its models
    /// are unloaded and what is in flight there fails (repeatable; with
    /// --gpus).
    #[arg(long = "gpu-failure", value_name = "G@T", value_parser = parse_failure)]
    failures: Vec<Outage>,
    /// GPU G is announced for maintenance at T seconds (NoSchedule: nothing
    /// new there) and goes NOTICE seconds later (repeatable; with --gpus).
    #[arg(long = "gpu-maintenance", value_name = "G@T+NOTICE", value_parser = parse_maintenance)]
    maintenances: Vec<Outage>,
    /// Leave out the operator's pre-move (hot models of a GPU in
    /// maintenance loaded elsewhere before it goes): to compare.
    #[arg(long)]
    no_pre_move: bool,
}

/// `NAME=N`, N from 2 to 64.
fn parse_gang(s: &str) -> Result<(String, usize), String> {
    let (name, n) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: give NAME=N, N the GPUs it spans"))?;
    match n.parse::<usize>() {
        Ok(n) if (2..=64).contains(&n) && !name.is_empty() => Ok((name.to_owned(), n)),
        _ => Err(format!(
            "{s:?}: N is 2 to 64 GPUs (one GPU is a plain model)"
        )),
    }
}

impl FleetArgs {
    fn options(&self) -> Result<FleetOptions, Failure> {
        let positive = [
            ("--service-seconds", self.service_seconds),
            ("--copies-target", self.copies_target),
            ("--copies-window", self.copies_window),
            ("--copies-delay", self.copies_delay),
            ("--copies-tick", self.copies_tick),
        ];
        for o in self.failures.iter().chain(&self.maintenances) {
            if o.gpu >= self.gpus {
                return Err(Failure::bad_input(format!(
                    "GPU {} is not one of --gpus {} (0 to {})",
                    o.gpu,
                    self.gpus,
                    self.gpus.saturating_sub(1)
                )));
            }
        }
        for (flag, value) in positive {
            if !(value.is_finite() && value > 0.0) {
                return Err(Failure::bad_input(format!(
                    "{flag} must be a positive number"
                )));
            }
        }
        Ok(FleetOptions {
            gpus: self.gpus,
            service: self.service_seconds,
            tick: self.copies_tick,
            policy: CopyPolicy {
                max: self.copies_max.unwrap_or(u32::MAX),
                target_in_flight: self.copies_target,
                window: self.copies_window,
                scale_down_delay: self.copies_delay,
                ..CopyPolicy::default()
            },
            dedicated: self.dedicated,
            outages: self
                .failures
                .iter()
                .chain(&self.maintenances)
                .cloned()
                .collect(),
            pre_move: !self.no_pre_move,
        })
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum EvictionArg {
    Lru,
    Cost,
    Rate,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Output {
    Text,
    Json,
}

pub fn run(args: Args) -> Result<(), Failure> {
    let budget =
        parse_bytes(&args.budget).map_err(|e| Failure::bad_input(format!("--budget: {e}")))?;
    let models = match &args.registry {
        Some(path) => registry::load(path).map_err(Failure::bad_input)?,
        None => Vec::new(),
    };
    for (flag, value) in [
        ("--load-seconds", args.load_seconds),
        ("--wake-seconds", args.wake_seconds),
    ] {
        if value.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
            return Err(Failure::bad_input(format!(
                "{flag} must be zero or a positive number"
            )));
        }
    }
    let defaults = registry::DefaultCosts {
        load: args.load_seconds,
        wake: args.wake_seconds,
    };
    let mut engine = registry::build_engine(budget, &models, defaults).map_err(|e| {
        Failure::bad_input(match &args.registry {
            Some(path) => format!("{}: {e}", path.display()),
            None => e.to_string(),
        })
    })?;
    engine.set_eviction(match args.eviction {
        EvictionArg::Lru => model_residency::engine::Eviction::Lru,
        EvictionArg::Cost => model_residency::engine::Eviction::Cost,
        EvictionArg::Rate => model_residency::engine::Eviction::Rate,
    });
    if let Some(q) = &args.warm_budget {
        let host = parse_bytes(q).map_err(|e| Failure::bad_input(format!("--warm-budget: {e}")))?;
        engine.set_host_budget(host);
    }
    if args.fleet.gpus == 0 {
        return Err(Failure::bad_input("--gpus must be at least 1"));
    }
    let outages = args.fleet.failures.len() + args.fleet.maintenances.len();
    if (outages > 0 || args.fleet.no_pre_move) && args.fleet.gpus < 2 {
        return Err(Failure::bad_input(
            "--gpu-failure, --gpu-maintenance and --no-pre-move replay several GPUs: give --gpus 2 or more and --trace",
        ));
    }
    for (gang, width) in &args.fleet.gangs {
        if engine.id(gang).is_none() {
            return Err(Failure::bad_input(format!(
                "--gang {gang}={width}: {gang:?} is not in the registry"
            )));
        }
        if *width > args.fleet.gpus {
            return Err(Failure::bad_input(format!(
                "--gang {gang}={width}: wider than --gpus {}",
                args.fleet.gpus
            )));
        }
    }
    let widths: usize = args.fleet.gangs.iter().map(|(_, w)| w).sum();
    if args.fleet.dedicated && widths >= args.fleet.gpus {
        return Err(Failure::bad_input(format!(
            "--dedicated: the gangs take {widths} of {} GPUs and leave none for the other models",
            args.fleet.gpus
        )));
    }
    let ceiling = args.known_rates.is_some() || args.clairvoyant;
    if ceiling && !matches!(args.eviction, EvictionArg::Rate) {
        return Err(Failure::bad_input(
            "--known-rates and --clairvoyant are ceilings of --eviction rate's keys: add --eviction rate",
        ));
    }
    if let (Some(path), true) = (&args.trace, args.fleet.gpus > 1) {
        if ceiling {
            return Err(Failure::bad_input(
                "--known-rates and --clairvoyant replay one GPU: not with --gpus",
            ));
        }
        if args.keep_alive.is_some()
            || args.recency_resolution.is_some()
            || args.disk_budget.is_some()
        {
            return Err(Failure::bad_input(
                "--keep-alive, --recency-resolution and --disk-budget replay one GPU: not with --gpus",
            ));
        }
        let options = args.fleet.options()?;
        let mut trace = TraceReader::open(path).map_err(Failure::bad_input)?;
        let report = replay_fleet(&engine, &args.fleet.gangs, &mut trace, options)
            .map_err(Failure::bad_input)?;
        match args.output {
            Output::Text => print!("{}", report.to_text()),
            Output::Json => println!(
                "{}",
                serde_json::to_string(&report).expect("report serializes")
            ),
        }
        return Ok(());
    }
    let report = match &args.trace {
        Some(path) => {
            let mut trace = TraceReader::open(path).map_err(Failure::bad_input)?;
            let bar = progress_bar(&trace);
            if args.keep_alive.is_some_and(|k| !(k.is_finite() && k > 0.0)) {
                return Err(Failure::bad_input("--keep-alive must be a positive number"));
            }
            if args
                .recency_resolution
                .is_some_and(|r| !(r.is_finite() && r >= 0.0))
            {
                return Err(Failure::bad_input(
                    "--recency-resolution must be zero or a positive number",
                ));
            }
            let disk = match &args.disk_budget {
                None => None,
                Some(q) => {
                    let budget = parse_bytes(q)
                        .map_err(|e| Failure::bad_input(format!("--disk-budget: {e}")))?;
                    let fetch_seconds_per_gib = args
                        .fetch_seconds_per_gib
                        .unwrap_or(model_residency::simulate::disk::FETCH_SECONDS_PER_GIB);
                    if !(fetch_seconds_per_gib.is_finite() && fetch_seconds_per_gib >= 0.0) {
                        return Err(Failure::bad_input(
                            "--fetch-seconds-per-gib must be zero or a positive number",
                        ));
                    }
                    Some(model_residency::simulate::disk::DiskOptions {
                        budget,
                        fetch_seconds_per_gib,
                    })
                }
            };
            let foresight = match (&args.known_rates, args.clairvoyant) {
                (Some(rates), _) => Some(Foresight::rates(rates).map_err(Failure::bad_input)?),
                (None, true) => Some(Foresight::clairvoyant(path).map_err(Failure::bad_input)?),
                (None, false) => None,
            };
            let options = ReplayOptions {
                keep_alive: args.keep_alive,
                recency_resolution: args.recency_resolution,
                disk,
                foresight,
            };
            let report = replay_trace(&mut engine, &mut trace, options, |t| {
                if let Some(bar) = &bar {
                    bar.set_position(t.progress().0);
                }
            })
            .map_err(Failure::bad_input)?;
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            report
        }
        None if args.models.is_empty() => {
            return Err(Failure::bad_input(
                "nothing to simulate: give --trace FILE or model names",
            ));
        }
        None => replay_names(&mut engine, &args.models).map_err(Failure::bad_input)?,
    };
    print_report(&report, args.output);
    Ok(())
}

/// A byte-based progress bar on stderr, only when a person is watching.
fn progress_bar(trace: &TraceReader) -> Option<ProgressBar> {
    let total = trace.progress().1?;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .expect("static template"),
    );
    Some(bar)
}

fn print_report(report: &Report, output: Output) {
    match output {
        Output::Text => print!("{}", report.to_text()),
        Output::Json => println!(
            "{}",
            serde_json::to_string(report).expect("report serializes")
        ),
    }
}
