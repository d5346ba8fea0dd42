//! Requests in flight: per pod (what balancing reads) and per model (the
//! metric the copy scaler sums), each counted while its guard lives.

use super::*;

/// A request in flight on a pod, from just before it is sent until its
/// answer's body has ended (or the client went away).
pub(super) struct InFlight {
    pub(super) router: Arc<Router>,
    pub(super) count: Arc<AtomicUsize>,
    pub(super) start: Instant,
    /// The model's count, released with the last of its holders.
    pub(super) _model: Option<Arc<ModelInFlight>>,
    /// The adapter it is served by: no victim until the answer ends.
    pub(super) _adapter: Option<super::adapters::InUse>,
}

impl InFlight {
    pub(super) fn enter(
        router: Arc<Router>,
        endpoint: &Endpoint,
        start: Instant,
        model: Option<Arc<ModelInFlight>>,
        adapter: Option<super::adapters::InUse>,
    ) -> Self {
        endpoint.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight {
            router,
            count: endpoint.in_flight.clone(),
            start,
            _model: model,
            _adapter: adapter,
        }
    }
}

/// A request counted in its model's `in_flight_requests`, from its
/// arrival (held or not) until the end of its answer.
pub(super) struct ModelInFlight(prometheus_client::metrics::gauge::Gauge);

impl ModelInFlight {
    pub(super) fn enter(metrics: &RouterMetrics, namespace: &str, model: &str) -> Self {
        let gauge = metrics
            .in_flight
            .get_or_create(&NamespacedLabels {
                namespace: namespace.to_owned(),
                model: model.to_owned(),
            })
            .clone();
        gauge.inc();
        ModelInFlight(gauge)
    }
}

impl Drop for ModelInFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
        self.router
            .metrics
            .duration
            .observe(self.start.elapsed().as_secs_f64());
    }
}
