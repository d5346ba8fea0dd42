//! Reading a request: its body, whole up to `--max-body` and within the
//! router's buffered total, and the model it names (a header, the path or
//! the body).

use super::*;

/// A name a client sent, as an error message repeats it: whole unless it
/// is longer than any model name can be (a DNS label, 63 bytes), so a
/// 30 MiB `model` is not sent back.
pub(super) fn echo(name: &str) -> std::borrow::Cow<'_, str> {
    const SHOWN: usize = 63;
    if name.len() <= SHOWN {
        return name.into();
    }
    let cut = (0..=SHOWN)
        .rev()
        .find(|&i| name.is_char_boundary(i))
        .unwrap_or(0);
    format!("{}... ({} bytes)", &name[..cut], name.len()).into()
}

/// A request body's bytes counted against `--max-buffered-bytes` while the
/// request is answered (its body is held for a retry on another pod).
pub(super) struct Buffered {
    pub(super) total: Arc<AtomicUsize>,
    pub(super) max: usize,
    pub(super) held: usize,
}

impl Buffered {
    pub(super) fn new(total: Arc<AtomicUsize>, max: usize) -> Self {
        Buffered {
            total,
            max,
            held: 0,
        }
    }

    /// Holds `n` bytes in all for this body (never less than it holds).
    pub(super) fn grow(&mut self, n: usize) -> Result<(), Refusal> {
        if n <= self.held {
            return Ok(());
        }
        let more = n - self.held;
        let before = self.total.fetch_add(more, Ordering::Relaxed);
        if before.saturating_add(more) > self.max {
            self.total.fetch_sub(more, Ordering::Relaxed);
            return Err(Refusal::TooMuchBuffered(format!(
                "the router holds {before} bytes of request bodies and this one would pass --max-buffered-bytes ({}); retry shortly",
                self.max
            )));
        }
        self.held = n;
        Ok(())
    }
}

impl Drop for Buffered {
    fn drop(&mut self) {
        self.total.fetch_sub(self.held, Ordering::Relaxed);
    }
}

impl super::Router {
    /// The model's name as a metric label: only names the router serves,
    /// so a client cannot grow the label set at will.
    pub(super) fn known(&self, model: &str) -> String {
        let known = {
            let snap = self.snapshot.borrow();
            snap.models.contains_key(model) || snap.adapters.contains_key(model)
        };
        if known {
            model.to_owned()
        } else {
            String::new()
        }
    }

    /// Reads the request: its model, its head, and its body (whole, up to
    /// `--max-body`: the model may be named inside it, and a body must be
    /// replayable to be sent to another pod when the first is gone).
    pub(super) async fn model_of(
        &self,
        req: Request<Incoming>,
    ) -> Result<(String, http::request::Parts, Bytes, Buffered), Refusal> {
        let bad = |e: target::BadRequest| Refusal::BadRequest(e.to_string());
        if req.method() == http::Method::CONNECT {
            let tunnel = target::BadRequest::Connect {
                target: req.uri().to_string(),
            };
            return Err(Refusal::Tunnel(tunnel.to_string()));
        }
        let (method, path) = (req.method(), req.uri().path());
        match target::forwarded(method, path, &self.config.forward_paths) {
            Ok(()) => {}
            Err(target::NotForwarded::Path) => {
                return Err(Refusal::PathNotForwarded(format!(
                    "{method} {} is not an inference API this router forwards (OpenAI's POST /v1/chat/completions, /v1/completions, /v1/embeddings, ...; KServe v2's /v2/models/<name>/infer; or a --forward-path)",
                    echo(path)
                )));
            }
            Err(target::NotForwarded::Method(allow)) => {
                return Err(Refusal::MethodNotAllowed {
                    message: format!("{method} is not allowed on {path}: {allow}"),
                    allow,
                });
            }
        }
        let named = target::locate(req.method(), req.uri().path(), req.headers()).map_err(bad)?;
        let limit = self.config.max_body;
        let too_large = || bad(target::BadRequest::TooLarge { limit });
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
        if declared.is_some_and(|n| n > limit) {
            return Err(too_large());
        }
        let mut held = Buffered::new(self.buffered.clone(), self.config.max_buffered);
        // A declared length is held before a byte is read: twenty clients
        // announcing 30 MiB each are refused at their heads.
        if let Some(n) = declared {
            held.grow(n)?;
        }
        let (parts, body) = req.into_parts();
        let mut body = http_body_util::Limited::new(body, limit);
        let mut chunks: Vec<Bytes> = Vec::new();
        // A declared length is read into one buffer of that size: the
        // frames and their concatenation would be held twice at its end.
        let mut whole = declared.map(bytes::BytesMut::with_capacity);
        let mut read = 0usize;
        let deadline = tokio::time::Instant::now() + self.config.body_deadline;
        loop {
            let pause = tokio::time::Instant::now() + self.config.body_timeout;
            let frame = tokio::time::timeout_at(pause.min(deadline), body.frame())
                .await
                .map_err(|_| Refusal::BodyTimeout {
                    after: if pause < deadline {
                        self.config.body_timeout
                    } else {
                        self.config.body_deadline
                    },
                    whole: pause >= deadline,
                })?;
            match frame {
                None => break,
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        read += data.len();
                        held.grow(read)?;
                        match whole.as_mut() {
                            // A first frame that is the whole body is kept
                            // as it is (no copy).
                            Some(buf) if !(buf.is_empty() && Some(data.len()) == declared) => {
                                buf.extend_from_slice(&data)
                            }
                            _ => chunks.push(data),
                        }
                    }
                }
                Some(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                    return Err(too_large());
                }
                Some(Err(e)) => {
                    return Err(Refusal::BadRequest(format!(
                        "the request body could not be read: {e}"
                    )));
                }
            }
        }
        // Most bodies come in one piece: no copy then.
        let body = match (whole, chunks.len()) {
            (_, 1) => chunks.pop().expect("one chunk"),
            (Some(buf), 0) => buf.freeze(),
            _ => Bytes::from(chunks.concat()),
        };
        let model = match named {
            target::Named::Known(m) => m,
            target::Named::InBody => target::from_body(&body, &parts.headers).map_err(bad)?,
        };
        Ok((model, parts, body, held))
    }
}
