//! Leader election on a `coordination.k8s.io/v1` Lease, so that with more
//! than one replica only one writes.
//!
//! The holder renews every `renew_every`; a replica takes the lease over only
//! when it has not been renewed for `duration`. The leader gives up (stops
//! its controller) as soon as a renewal fails and `renew_deadline` has passed
//! since its last successful one. Since `renew_deadline < duration`, the old
//! leader has stopped before any standby can see the lease as expired: two
//! replicas never write at once (up to clock skew between them, which is
//! zero on one machine and must stay well below `duration - renew_deadline`
//! across nodes). Every write is a compare-and-swap on the lease's
//! resourceVersion, so two standbys cannot both take it.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// How long a lease stays valid without renewal.
    pub duration: Duration,
    /// How long the leader keeps leading without a successful renewal.
    pub renew_deadline: Duration,
    /// How often the leader renews, and standbys retry.
    pub renew_every: Duration,
}

impl LeaseConfig {
    /// Kubernetes' usual timings for a lease of `duration`: renew deadline
    /// two thirds of it, renewals every fifth.
    pub fn new(namespace: &str, name: &str, identity: &str, duration: Duration) -> Self {
        LeaseConfig {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            duration,
            renew_deadline: duration * 2 / 3,
            renew_every: duration / 5,
        }
    }
}

pub struct LeaderElector {
    api: Api<Lease>,
    config: LeaseConfig,
}

impl LeaderElector {
    pub fn new(client: kube::Client, config: LeaseConfig) -> Self {
        LeaderElector {
            api: Api::namespaced(client, &config.namespace),
            config,
        }
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// One attempt to take or renew the lease. `Ok(true)`: we hold it now.
    pub async fn try_acquire_or_renew(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let c = &self.config;
        let Some(current) = self.api.get_opt(&c.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(c.name.clone()),
                    namespace: Some(c.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec(now, now, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = current.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.as_deref().unwrap_or("");
        let transitions = spec.lease_transitions.unwrap_or(0);
        let new_spec = if holder == c.identity {
            let acquired = spec.acquire_time.map(|t| t.0).unwrap_or(now);
            self.spec(acquired, now, transitions)
        } else {
            let renewed = spec.renew_time.map(|t| t.0);
            let valid_for = spec
                .lease_duration_seconds
                .map(|s| Duration::from_secs(s.max(0) as u64))
                .unwrap_or(c.duration);
            let expired = holder.is_empty() || renewed.is_none_or(|r| r + valid_for < now);
            if !expired {
                return Ok(false);
            }
            self.spec(now, now, transitions + 1)
        };
        let mut next = current;
        next.spec = Some(new_spec);
        // replace carries the resourceVersion we read: a compare-and-swap.
        match self
            .api
            .replace(&c.name, &PostParams::default(), &next)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Hands the lease back (on shutdown), so a standby need not wait.
    pub async fn release(&self) -> Result<(), kube::Error> {
        let Some(mut current) = self.api.get_opt(&self.config.name).await? else {
            return Ok(());
        };
        let Some(spec) = current.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(&self.config.identity) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.renew_time = None;
        match self
            .api
            .replace(&self.config.name, &PostParams::default(), &current)
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn spec(&self, acquired: Timestamp, renewed: Timestamp, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: Some(self.config.duration.as_secs().max(1) as i32),
            acquire_time: Some(MicroTime(acquired)),
            renew_time: Some(MicroTime(renewed)),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }

    /// Waits until this replica holds the lease.
    pub async fn acquire(&self) {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election: cannot reach the lease"),
            }
            tokio::time::sleep(self.config.renew_every).await;
        }
    }

    /// Renews until leadership is lost; returns when it is.
    pub async fn hold(&self) {
        let mut last_ok = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(self.config.renew_every).await;
            // A hanging API call must not stretch leadership past the deadline.
            let attempt =
                tokio::time::timeout(self.config.renew_every, self.try_acquire_or_renew()).await;
            tracing::debug!(identity = %self.config.identity, ?attempt, "lease renewal");
            match attempt {
                Ok(Ok(true)) => last_ok = tokio::time::Instant::now(),
                Ok(Ok(false)) => {
                    tracing::warn!("leader election: another replica holds the lease");
                    return;
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "leader election: renewal failed"),
                Err(_) => tracing::warn!("leader election: renewal timed out"),
            }
            if last_ok.elapsed() > self.config.renew_deadline {
                tracing::warn!("leader election: renew deadline passed; stepping down");
                return;
            }
        }
    }
}
