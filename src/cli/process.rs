//! What every long-running process (`run`, `route`, `node-agent`) shares:
//! how it logs, how many runtime threads it has, how it reads durations,
//! gets its client, checks at start that it can do its job, fails and
//! hears that it should stop.

use super::Failure;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use model_residency::api::ModelResidency;

/// The async runtime's worker threads (`run`, `node-agent`; the router
/// has `--workers`).
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct Threads {
    /// Worker threads of the process's async runtime.
    #[arg(long, env = "WORKER_THREADS", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..))]
    pub worker_threads: u16,
}

/// A duration as `90s`, `1m`, `1m30s` or `0s`, at most 100 years (longer
/// ones overflow the clocks they are added to: a deadline of
/// `now + 2^63 s` panics).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    const CENTURY: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 24 * 3600);
    let d: k8s_openapi::jiff::SignedDuration = s
        .parse()
        .map_err(|e| format!("{s:?} is not a duration like 90s or 1m: {e}"))?;
    let d = std::time::Duration::try_from(d).map_err(|_| format!("{s:?} is negative"))?;
    if d > CENTURY {
        return Err(format!("{s:?} is longer than 100 years"));
    }
    Ok(d)
}

/// How a long-running subcommand (`run`, `route`, `node-agent`) logs.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct Logging {
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

impl Logging {
    pub fn init(self) {
        use tracing_subscriber::EnvFilter;
        let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
        match self.log_format {
            LogFormat::Text => builder.init(),
            LogFormat::Json => builder.json().init(),
        }
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

pub fn fatal(message: String) -> Failure {
    // Every subcommand fails through here: logged as the program's, not
    // as this module's (a node agent's error said `cli::operator`).
    tracing::error!(target: "model_residency", "{message}");
    Failure { message, code: 1 }
}

/// Fails fast, with the fix, when the CRD is missing or RBAC forbids what
/// a process must watch (`needs` says what it needs, for the message).
pub async fn preflight(
    client: &kube::Client,
    namespace: Option<&str>,
    needs: &str,
) -> Result<(), Failure> {
    let residencies: Api<ModelResidency> = model_residency::cluster::api_in(client, namespace);
    let pods: Api<Pod> = model_residency::cluster::api_in(client, namespace);
    let lp = ListParams::default().limit(1);
    let forbidden = |what: &str, message: &str| {
        fatal(format!("RBAC forbids listing {what}: {message}. {needs}"))
    };
    match residencies.list_metadata(&lp).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {
            return Err(fatal(
                "the ModelResidency CRD is not installed: run `model-residency crd | kubectl apply -f -` \
                 (or install the Helm chart, which carries it)"
                    .into(),
            ));
        }
        Err(kube::Error::Api(s)) if s.code == 403 => {
            return Err(forbidden("modelresidencies.residency.dev", &s.message));
        }
        Err(e) => return Err(fatal(format!("cannot reach the cluster: {e}"))),
    }
    match pods.list_metadata(&lp).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 403 => Err(forbidden("pods", &s.message)),
        Err(e) => Err(fatal(format!("cannot list pods: {e}"))),
    }
}

/// The in-cluster or kubeconfig client of a long-running process, or a
/// logged, fatal failure.
pub async fn cluster_client() -> Result<kube::Client, Failure> {
    kube::Client::try_default().await.map_err(|e| {
        fatal(format!(
            "cannot load a kubeconfig or in-cluster config: {e}"
        ))
    })
}

/// Completes on SIGTERM or Ctrl-C.
pub async fn termination() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async {
            match term.as_mut() {
                Some(t) => { t.recv().await; }
                None => std::future::pending::<()>().await,
            }
        } => {}
    }
}

#[cfg(test)]
mod tests {
    use super::parse_duration;
    use std::time::Duration;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("-5s").is_err());
        assert_eq!(
            parse_duration("9223372036854775807s"),
            Err("\"9223372036854775807s\" is longer than 100 years".into())
        );
        assert!(parse_duration("876000h").is_ok());
    }
}
