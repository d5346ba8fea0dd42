//! `model-residency run`: the controller process.

use super::Failure;
use model_residency::controller::{self, Context};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "WATCH_NAMESPACE")]
    namespace: Option<String>,
}

pub async fn run(args: Args) -> Result<(), Failure> {
    let client = kube::Client::try_default().await.map_err(|e| Failure {
        message: format!("cannot reach the cluster: {e}"),
        code: 1,
    })?;
    let ctx = Context::new(client);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    tracing::info!("model-residency controller starting");
    controller::run(ctx, args.namespace.as_deref(), shutdown).await;
    Ok(())
}
