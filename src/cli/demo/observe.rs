//! The chart's dashboard and alerts checked against a real Prometheus:
//! Debian's `prometheus` (or `MODEL_RESIDENCY_PROMETHEUS`) scrapes the
//! demo's operator, router and node agent every second, and at the end
//! every query of every panel must answer with series, and every alert's
//! expression must evaluate with every metric it reads present. A query
//! that names a metric the processes do not export, or a label they do
//! not set, fails the demo (and so its test).

use super::processes::http_get;
use super::{Failure, say};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const DASHBOARD: &str = include_str!("../../../charts/model-residency/files/dashboard.json");
const ALERTS: &str = include_str!("../../../charts/model-residency/files/alerts.yaml");

/// The Prometheus binary: `MODEL_RESIDENCY_PROMETHEUS`, else Debian's.
fn binary() -> Option<PathBuf> {
    let path = std::env::var_os("MODEL_RESIDENCY_PROMETHEUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/usr/bin/prometheus".into());
    path.is_file().then_some(path)
}

/// A Prometheus scraping the demo's processes; stopped when dropped.
pub(super) struct Prometheus {
    child: Child,
    addr: String,
    started: Instant,
    targets: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts Prometheus over `targets` (host:port of each `/metrics`; more
/// join with [`Prometheus::add`]), or
/// says why it cannot (then the check is skipped, or under `CI=true`
/// fails the demo).
pub(super) fn start(targets: &[&str]) -> Result<Option<Prometheus>, Failure> {
    let Some(bin) = binary() else {
        let why = "no Prometheus here (bash scripts/demo.sh installs Debian's; or set MODEL_RESIDENCY_PROMETHEUS)";
        if std::env::var("CI").as_deref() == Ok("true") {
            return Err(Failure::other(format!("the dashboard check needs {why}")));
        }
        say(&format!("Skipping the dashboard check: {why}"));
        return Ok(None);
    };
    let dir = tempfile::tempdir().map_err(Failure::other)?;
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(Failure::other)?
        .port();
    // Targets from a file Prometheus watches: the router and the node
    // agent join as the demo starts them.
    let config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
         scrape_configs:\n- job_name: model-residency\n  file_sd_configs:\n  - files: [{}]\n    refresh_interval: 1s\n",
        dir.path().join("targets.json").display()
    );
    std::fs::write(dir.path().join("prometheus.yml"), config).map_err(Failure::other)?;
    write_targets(
        dir.path(),
        &targets.iter().map(|t| t.to_string()).collect::<Vec<_>>(),
    )?;
    let addr = format!("127.0.0.1:{port}");
    let child = Command::new(&bin)
        .arg(format!(
            "--config.file={}",
            dir.path().join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("tsdb").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .arg("--log.level=warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| Failure::other(format!("cannot start {}: {e}", bin.display())))?;
    say(&format!(
        "Starting Prometheus ({}) on {addr}, scraping the operator, the router and the node agent every second, to check the chart's dashboard and alerts against them",
        bin.display()
    ));
    Ok(Some(Prometheus {
        child,
        addr,
        started: Instant::now(),
        targets: targets.iter().map(|t| t.to_string()).collect(),
        _dir: dir,
    }))
}

/// The scrape targets' file, replaced whole (Prometheus never reads half
/// of it).
fn write_targets(dir: &std::path::Path, targets: &[String]) -> Result<(), Failure> {
    let body = serde_json::json!([{"targets": targets}]).to_string();
    let tmp = dir.join("targets.json.tmp");
    std::fs::write(&tmp, body).map_err(Failure::other)?;
    std::fs::rename(&tmp, dir.join("targets.json")).map_err(Failure::other)
}

impl Prometheus {
    /// Scrapes `target` too from now on.
    pub(super) fn add(&mut self, target: &str) -> Result<(), Failure> {
        self.targets.push(target.to_owned());
        write_targets(self._dir.path(), &self.targets)
    }

    /// Writes the main panel's data over the whole run (the VRAM each model
    /// held per GPU, and each GPU's budget), as Prometheus answers range
    /// queries, into `dir` (`vram.json`, `budget.json`) for
    /// `scripts/dashboard-picture.py`.
    pub(super) async fn save_main_panel(&self, dir: &std::path::Path) -> Result<(), Failure> {
        let dashboard: serde_json::Value =
            serde_json::from_str(DASHBOARD).map_err(Failure::other)?;
        let vram = dashboard["panels"][0]["targets"][0]["expr"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let seconds = self.started.elapsed().as_secs() + 1;
        let end = k8s_openapi::jiff::Timestamp::now().as_second();
        let start = end - seconds as i64;
        std::fs::create_dir_all(dir).map_err(Failure::other)?;
        for (file, query) in [
            ("vram.json", vram.as_str()),
            ("budget.json", "model_residency_budget_bytes"),
        ] {
            let path = format!(
                "/api/v1/query_range?query={}&start={start}&end={end}&step=1",
                model_residency::http::percent_encode(query)
            );
            let (_, body) = http_get(&self.addr, &path)
                .await
                .ok_or_else(|| Failure::other("Prometheus did not answer"))?;
            std::fs::write(dir.join(file), body).map_err(Failure::other)?;
        }
        say(&format!(
            "The main panel's data saved in {} (python3 scripts/dashboard-picture.py {} docs/dashboard.svg draws it)",
            dir.display(),
            dir.display()
        ));
        Ok(())
    }

    /// An instant query's answer: the number of series, or why it failed.
    async fn series(&self, promql: &str) -> Result<usize, String> {
        let path = format!(
            "/api/v1/query?query={}",
            model_residency::http::percent_encode(promql)
        );
        let (code, body) = http_get(&self.addr, &path)
            .await
            .ok_or_else(|| "Prometheus did not answer".to_owned())?;
        let v: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| format!("{code}: {e}: {body}"))?;
        if v["status"] != "success" {
            return Err(format!("{code}: {}", v["error"]));
        }
        Ok(v["data"]["result"].as_array().map_or(0, Vec::len))
    }

    /// Waits until every target has been scraped (and a few seconds more,
    /// for the rates' second samples).
    async fn until_scraped(&self, targets: usize) -> Result<(), Failure> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if self.series("up == 1").await.unwrap_or(0) == targets {
                break;
            }
            if Instant::now() > deadline {
                return Err(Failure::other(
                    "Prometheus did not scrape every demo process within 60 s",
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let settled = self.started + Duration::from_secs(5);
        tokio::time::sleep(settled.saturating_duration_since(Instant::now())).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        Ok(())
    }

    /// `promtool check rules` on the alerts (promtool beside Prometheus).
    fn promtool(&self) -> Result<(), Failure> {
        let bin = binary().and_then(|p| Some(p.parent()?.join("promtool")));
        let Some(promtool) = bin.filter(|p| p.is_file()) else {
            return Err(Failure::other("no promtool beside Prometheus"));
        };
        let file = self._dir.path().join("alerts.yaml");
        std::fs::write(&file, ALERTS).map_err(Failure::other)?;
        let out = Command::new(&promtool)
            .args(["check", "rules"])
            .arg(&file)
            .output()
            .map_err(Failure::other)?;
        let said = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            return Err(Failure::other(format!("promtool check rules: {said}")));
        }
        let found = said.lines().find(|l| l.contains("SUCCESS")).unwrap_or("");
        println!("$ promtool check rules alerts.yaml\n   {}", found.trim());
        Ok(())
    }

    /// Every panel's queries answer with series; every alert's expression
    /// evaluates and every metric it reads has series.
    pub(super) async fn check(&self, targets: usize) -> Result<(), Failure> {
        self.promtool()?;
        self.until_scraped(targets).await?;
        let dashboard: serde_json::Value =
            serde_json::from_str(DASHBOARD).map_err(Failure::other)?;
        let mut problems = Vec::new();
        let (mut panels, mut queries) = (0, 0);
        for panel in dashboard["panels"].as_array().into_iter().flatten() {
            panels += 1;
            let title = panel["title"].as_str().unwrap_or_default();
            let mut counts = Vec::new();
            for target in panel["targets"].as_array().into_iter().flatten() {
                let expr = target["expr"].as_str().unwrap_or_default();
                queries += 1;
                match self.series(expr).await {
                    Ok(0) => problems.push(format!("panel {title:?}: no series for {expr}")),
                    Ok(n) => counts.push(n.to_string()),
                    Err(e) => problems.push(format!("panel {title:?}: {expr}: {e}")),
                }
            }
            println!("   {title:<58} {} series", counts.join(" + "));
        }
        let alerts: serde_json::Value =
            serde_saphyr::from_str(ALERTS).map_err(|e| Failure::other(e.to_string()))?;
        let mut rules = 0;
        for rule in alerts["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        {
            rules += 1;
            let name = rule["alert"].as_str().unwrap_or_default();
            let expr = rule["expr"].as_str().unwrap_or_default();
            let firing = match self.series(expr).await {
                Ok(n) => n,
                Err(e) => {
                    problems.push(format!("alert {name}: {expr}: {e}"));
                    continue;
                }
            };
            let mut read = Vec::new();
            for metric in metric_names(expr) {
                match self.series(&format!("count({metric})")).await {
                    Ok(n) if n > 0 => read.push(metric),
                    _ => problems.push(format!("alert {name}: no series of {metric}")),
                }
            }
            println!(
                "   alert {name:<34} evaluates ({}), reads {}",
                if firing == 0 { "not firing" } else { "firing" },
                read.join(", ")
            );
        }
        if !problems.is_empty() {
            return Err(Failure::other(format!(
                "the dashboard or alerts do not match what the processes export:\n{}",
                problems.join("\n")
            )));
        }
        println!(
            "   {panels} panels, {queries} queries: each answered with series; {rules} alerts: each evaluated, each metric it reads present"
        );
        Ok(())
    }
}

/// The `model_residency_*` metric names an expression reads.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("model_residency_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = tail[..end].to_owned();
        if !names.contains(&name) {
            names.push(name);
        }
        rest = &tail[end..];
    }
    names
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_expression_reads_the_metrics_it_names() {
        assert_eq!(
            super::metric_names(
                "max by (instance) (model_residency_node_agent_disk_used_bytes / model_residency_node_agent_disk_budget_bytes) > 0.95"
            ),
            [
                "model_residency_node_agent_disk_used_bytes",
                "model_residency_node_agent_disk_budget_bytes"
            ]
        );
    }
}
