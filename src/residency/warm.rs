//! The warm tier's figures from the spec: what a sleeping model keeps
//! (bytes) and what bringing a model back costs (seconds, measured once
//! known, declared until then).

use crate::api::{ModelSpec, PodRequest, SleepPreset, SleepSpec};
use crate::engine::{Bytes, Costs, Sleep};
use crate::quantity::{parse_bytes, parse_duration};
use std::time::Duration;

/// A load's cost when neither loadTime nor a measurement says it.
pub const DEFAULT_LOAD_SECONDS: f64 = 60.0;
/// A wake's cost, as a share of the load's, when nothing says it.
pub const DEFAULT_WAKE_SHARE: f64 = 1.0 / 20.0;

/// Seconds in a duration like 45s, 2m or 500ms.
pub fn seconds(s: &str) -> Option<f64> {
    parse_duration(s).map(|d| d.as_secs_f64())
}

/// How `model` (of `size` bytes) sleeps, checked: a sleepingSize smaller
/// than its size, level 1 or 2, and at level 1 its host memory (its size
/// unless hostMemory says).
pub fn sleep_figures(model: &str, spec: &SleepSpec, size: Bytes) -> Result<Sleep, String> {
    let field = format!("spec.models[{model}].sleep");
    let sleeping_size =
        parse_bytes(&spec.sleeping_size.0).map_err(|e| format!("{field}.sleepingSize: {e}"))?;
    if sleeping_size >= size {
        return Err(format!(
            "{field}.sleepingSize: {} is not smaller than the model's size {}",
            spec.sleeping_size.0,
            crate::quantity::format_bytes(size)
        ));
    }
    let host_memory = match spec.level.unwrap_or(1) {
        1 => match &spec.host_memory {
            Some(q) => parse_bytes(&q.0).map_err(|e| format!("{field}.hostMemory: {e}"))?,
            None => size,
        },
        2 => 0,
        other => return Err(format!("{field}.level: {other} is not 1 or 2")),
    };
    if let Some(t) = &spec.wake_time
        && seconds(t).is_none()
    {
        return Err(format!(
            "{field}.wakeTime: {t:?} is not a duration like 2s or 500ms"
        ));
    }
    Ok(Sleep {
        sleeping_size,
        host_memory,
    })
}

/// What bringing `m` back costs: the measured load and wake times when
/// there are, else the declared ones, else the defaults.
pub fn costs(m: &ModelSpec, measured_load: Option<f64>, measured_wake: Option<f64>) -> Costs {
    declared_costs(
        m.load_time.as_deref(),
        m.sleep.as_deref(),
        measured_load,
        measured_wake,
    )
}

/// [`costs`] from the two fields that declare them.
pub fn declared_costs(
    load_time: Option<&str>,
    sleep: Option<&SleepSpec>,
    measured_load: Option<f64>,
    measured_wake: Option<f64>,
) -> Costs {
    let valid = |s: f64| s.is_finite() && s >= 0.0;
    let declared_load = load_time.and_then(seconds);
    let load = measured_load
        .filter(|&s| valid(s))
        .or(declared_load)
        .unwrap_or(DEFAULT_LOAD_SECONDS);
    let declared_wake = sleep.and_then(|s| s.wake_time.as_deref()).and_then(seconds);
    let wake = measured_wake
        .filter(|&s| valid(s))
        .or(declared_wake)
        .unwrap_or(load * DEFAULT_WAKE_SHARE);
    Costs { load, wake }
}

/// A measured time folded into its moving average (the newest weighs 0.3).
pub fn moving_average(previous: Option<f64>, measured: f64) -> f64 {
    match previous.filter(|p| p.is_finite()) {
        Some(p) => 0.7 * p + 0.3 * measured,
        None => measured,
    }
}

/// One request to a model's pod, resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    pub method: String,
    pub path: String,
    /// The status code that means it worked (`None`: any 2xx).
    pub expect_status: Option<u16>,
    /// Sent as is (`""`: no body).
    pub body: String,
    pub timeout: Duration,
    /// Whether an answer that did not work is tried again (every half
    /// second, within the timeout): a server that refuses while it still
    /// runs requests (SGLang's release asserts the server is idle).
    pub until_idle: bool,
}

impl Call {
    /// Whether an answer with `status` means it worked.
    pub fn worked(&self, status: u16) -> bool {
        match self.expect_status {
            Some(s) => s == status,
            None => (200..300).contains(&status),
        }
    }
}

/// How a model's server is put to sleep, woken, and asked which it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Protocol {
    pub sleep: Call,
    /// In order; each must work before the next is sent.
    pub wake: Vec<Call>,
    /// The status request and the JSON field that is true while it
    /// sleeps; `None` (sglang) when the calls' answers are the confirmation.
    pub status: Option<(Call, String)>,
}

/// How long a sleep, wake or status request may take by default.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a preset's sleep may take: it waits for the requests the
/// server is running to finish (a long generation takes minutes), and past
/// it the sleep fails, counted and evented, and the pod is deleted. The
/// operator's --pod-call-timeout-max (default 2m) caps it.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(120);

/// The requests a model's sleep spec means: its preset's (vllm when none
/// is named), each replaced by one given explicitly.
pub fn protocol(spec: &SleepSpec) -> Protocol {
    let level = spec.level.unwrap_or(1);
    let call = |method: &str, path: &str, body: &str| Call {
        method: method.into(),
        path: path.into(),
        expect_status: None,
        body: body.into(),
        timeout: DEFAULT_CALL_TIMEOUT,
        until_idle: false,
    };
    let (sleep, wake, status) = match spec.preset.unwrap_or(SleepPreset::Vllm) {
        SleepPreset::Vllm => {
            // mode=wait (vLLM 0.17+): the running requests finish before
            // it sleeps; the default, abort, ends them at once with a 200
            // and finish_reason "abort", cut short.
            let sleep = Call {
                timeout: DRAIN_TIMEOUT,
                ..call("POST", &format!("/sleep?level={level}&mode=wait"), "")
            };
            // At level 2 the weights were discarded: /wake_up restores the
            // buffers only, and the server answers garbage until its
            // weights are loaded again.
            let wake = if level == 2 {
                vec![
                    call("POST", "/wake_up?tags=weights", ""),
                    call("POST", "/collective_rpc", r#"{"method":"reload_weights"}"#),
                    call("POST", "/wake_up?tags=kv_cache", ""),
                ]
            } else {
                vec![call("POST", "/wake_up", "")]
            };
            let status = (call("GET", "/is_sleeping", ""), "is_sleeping".to_owned());
            (sleep, wake, Some(status))
        }
        SleepPreset::Sglang => {
            // Both need a JSON body (an empty one is 400 "Field required").
            let sleep = Call {
                timeout: DRAIN_TIMEOUT,
                until_idle: true,
                ..call("POST", "/release_memory_occupation", "{}")
            };
            let wake = vec![call("POST", "/resume_memory_occupation", "{}")];
            (sleep, wake, None)
        }
    };
    let given = |r: &PodRequest, default_method: &str| Call {
        // Admission allows only these three; an object stored before it
        // did (a method with CR/LF in it) gets the default.
        method: r
            .method
            .as_deref()
            .filter(|m| ["GET", "POST", "PUT"].contains(m))
            .unwrap_or(default_method)
            .into(),
        path: r.path.clone(),
        expect_status: r.expect_status,
        body: r.body.clone().unwrap_or_default(),
        timeout: r
            .timeout
            .as_deref()
            .and_then(parse_duration)
            .unwrap_or(DEFAULT_CALL_TIMEOUT),
        until_idle: false,
    };
    Protocol {
        sleep: spec.sleep.as_ref().map_or(sleep, |r| given(r, "POST")),
        wake: spec.wake.as_ref().map_or(wake, |r| vec![given(r, "POST")]),
        status: match &spec.status {
            Some(r) => Some((
                given(r, "GET"),
                r.field.clone().unwrap_or_else(|| "is_sleeping".into()),
            )),
            None => status,
        },
    }
}

/// Whether a status answer's body says the server sleeps (`None`: it says
/// nothing readable).
pub fn says_asleep(body: &str, field: &str) -> Option<bool> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    v.get(field)?.as_bool()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ByteQuantity;

    fn spec(sleeping: &str, level: Option<u8>, host: Option<&str>) -> SleepSpec {
        SleepSpec {
            preset: None,
            level,
            sleeping_size: ByteQuantity(sleeping.into()),
            host_memory: host.map(|h| ByteQuantity(h.into())),
            wake_time: None,
            sleep: None,
            wake: None,
            status: None,
        }
    }

    #[test]
    fn sleep_figures_check_the_sizes_and_the_level() {
        let s = sleep_figures("a", &spec("1Gi", None, None), 10 << 30).unwrap();
        assert_eq!((s.sleeping_size, s.host_memory), (1 << 30, 10 << 30));
        let s = sleep_figures("a", &spec("1Gi", Some(2), Some("5Gi")), 10 << 30).unwrap();
        assert_eq!(s.host_memory, 0, "level 2 keeps nothing in host memory");
        let err = sleep_figures("a", &spec("10Gi", None, None), 10 << 30).unwrap_err();
        assert!(
            err.contains("spec.models[a].sleep.sleepingSize: 10Gi is not smaller"),
            "{err}"
        );
        let err = sleep_figures("a", &spec("1Gi", Some(3), None), 10 << 30).unwrap_err();
        assert!(err.contains("level: 3"), "{err}");
    }

    #[test]
    fn presets_give_the_servers_endpoints_and_given_requests_replace_them() {
        let paths = |calls: &[Call]| -> Vec<String> {
            calls
                .iter()
                .map(|c| format!("{} {} {}", c.method, c.path, c.body))
                .collect()
        };
        // vLLM: the sleep waits for the running requests; level 1 wakes
        // with one call, level 2 loads its weights again in between.
        let mut s = spec("1Gi", None, None);
        let p = protocol(&s);
        assert_eq!(p.sleep.path, "/sleep?level=1&mode=wait");
        assert_eq!(p.sleep.timeout, DRAIN_TIMEOUT);
        assert_eq!(paths(&p.wake), ["POST /wake_up "]);
        s.level = Some(2);
        let p = protocol(&s);
        assert_eq!(p.sleep.path, "/sleep?level=2&mode=wait");
        assert_eq!(
            paths(&p.wake),
            [
                "POST /wake_up?tags=weights ",
                r#"POST /collective_rpc {"method":"reload_weights"}"#,
                "POST /wake_up?tags=kv_cache ",
            ]
        );
        assert_eq!(p.status.as_ref().unwrap().0.path, "/is_sleeping");
        // SGLang: a JSON body on both (an empty one is 400), the release
        // tried again until the server is idle.
        s.preset = Some(SleepPreset::Sglang);
        let p = protocol(&s);
        assert_eq!(
            paths(std::slice::from_ref(&p.sleep)),
            ["POST /release_memory_occupation {}"]
        );
        assert!(p.sleep.until_idle);
        assert_eq!(paths(&p.wake), ["POST /resume_memory_occupation {}"]);
        assert!(p.status.is_none());
        s.wake = Some(PodRequest {
            method: None,
            path: "/up".into(),
            expect_status: Some(204),
            field: None,
            body: Some(r#"{"all":true}"#.into()),
            timeout: Some("2s".into()),
        });
        let p = protocol(&s);
        assert_eq!(p.sleep.path, "/release_memory_occupation");
        assert_eq!(paths(&p.wake), [r#"POST /up {"all":true}"#]);
        assert_eq!(p.wake[0].timeout, Duration::from_secs(2));
        assert!(p.wake[0].worked(204) && !p.wake[0].worked(200));
        assert!(p.sleep.worked(200));
        assert_eq!(
            says_asleep(r#"{"is_sleeping": true}"#, "is_sleeping"),
            Some(true)
        );
        assert_eq!(says_asleep("nope", "is_sleeping"), None);
    }

    #[test]
    fn costs_prefer_the_measured_then_the_declared_then_the_defaults() {
        let mut m: ModelSpec = serde_json::from_value(serde_json::json!({
            "name": "a", "size": "1Gi", "loadTime": "45s",
            "sleep": {"sleepingSize": "100Mi", "wakeTime": "2s"}
        }))
        .unwrap();
        assert_eq!(
            costs(&m, None, None),
            Costs {
                load: 45.0,
                wake: 2.0
            }
        );
        assert_eq!(
            costs(&m, Some(30.0), Some(f64::NAN)),
            Costs {
                load: 30.0,
                wake: 2.0
            }
        );
        m.load_time = None;
        m.sleep = None;
        assert_eq!(
            costs(&m, None, None),
            Costs {
                load: 60.0,
                wake: 3.0
            }
        );
        assert_eq!(moving_average(Some(10.0), 20.0), 13.0);
        assert_eq!(moving_average(None, 20.0), 20.0);
    }
}
