//! Streaming reader for request traces: CSV rows `time,model[,size]`.
//!
//! - An optional header row whose first field is `time` is skipped.
//! - `time` is a non-negative number in the trace's own unit; rows must be in
//!   non-decreasing time order, since the replay is the LRU of that order.
//! - `size`, when present, is the model's footprint (a quantity or bytes);
//!   it registers an unknown model or resizes a known one.
//! - Blank lines are skipped; `\r\n` line ends are accepted.
//! - gzip and zstd input is detected by its magic bytes and decompressed on
//!   the fly. Memory stays constant whatever the trace's length: one line
//!   buffer is reused.

use crate::engine::Bytes;
use crate::quantity::parse_bytes;
use std::cell::Cell;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;
use std::rc::Rc;

const BUFFER: usize = 256 * 1024;

/// A trace that cannot be read, naming the source, line and problem.
#[derive(Debug, thiserror::Error)]
pub struct TraceError {
    pub origin: String,
    /// 1-based line number (0 when the file could not be opened).
    pub line: u64,
    pub problem: String,
}

impl std::fmt::Display for TraceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            0 => write!(f, "{}: {}", self.origin, self.problem),
            line => write!(f, "{}:{line}: {}", self.origin, self.problem),
        }
    }
}

/// One request read from a trace; borrows the reader's line buffer.
#[derive(Debug, PartialEq)]
pub struct TraceRow<'a> {
    pub line: u64,
    /// The request's time, in the trace's own unit.
    pub time: f64,
    pub model: &'a str,
    pub size: Option<Bytes>,
}

/// Counts the bytes pulled from the underlying file, so progress can be
/// shown against the file's length even for compressed input.
struct CountingReader<R> {
    inner: R,
    count: Rc<Cell<u64>>,
}

impl<R: Read> Read for CountingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.set(self.count.get() + n as u64);
        Ok(n)
    }
}

pub struct TraceReader {
    reader: Box<dyn BufRead>,
    origin: String,
    buf: Vec<u8>,
    line: u64,
    last_time: f64,
    consumed: Rc<Cell<u64>>,
    total: Option<u64>,
}

impl TraceReader {
    /// Opens a trace file, decompressing gzip or zstd when detected.
    pub fn open(path: &Path) -> Result<Self, TraceError> {
        let origin = path.display().to_string();
        let fail = |problem: String| TraceError {
            origin: origin.clone(),
            line: 0,
            problem,
        };
        let file = File::open(path).map_err(|e| fail(format!("cannot open: {e}")))?;
        let total = file.metadata().ok().map(|m| m.len());
        let consumed = Rc::new(Cell::new(0));
        let counted = CountingReader {
            inner: file,
            count: consumed.clone(),
        };
        let mut raw = BufReader::with_capacity(BUFFER, counted);
        let magic = raw
            .fill_buf()
            .map_err(|e| fail(format!("cannot read: {e}")))?;
        let reader: Box<dyn BufRead> = if magic.starts_with(&[0x1f, 0x8b]) {
            Box::new(BufReader::with_capacity(
                BUFFER,
                flate2::bufread::MultiGzDecoder::new(raw),
            ))
        } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            let zstd = ruzstd::decoding::StreamingDecoder::new(raw)
                .map_err(|e| fail(format!("not a valid zstd stream: {e}")))?;
            Box::new(BufReader::with_capacity(BUFFER, zstd))
        } else {
            Box::new(raw)
        };
        let mut trace = Self::from_reader(reader, &origin);
        trace.consumed = consumed;
        trace.total = total;
        Ok(trace)
    }

    /// Reads an uncompressed trace from any buffered reader.
    pub fn from_reader(reader: Box<dyn BufRead>, origin: &str) -> Self {
        TraceReader {
            reader,
            origin: origin.to_owned(),
            buf: Vec::with_capacity(256),
            line: 0,
            last_time: 0.0,
            consumed: Rc::new(Cell::new(0)),
            total: None,
        }
    }

    /// Bytes of the underlying file read so far, and its length if known.
    pub fn progress(&self) -> (u64, Option<u64>) {
        (self.consumed.get(), self.total)
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// An error at the current line.
    pub fn error(&self, problem: impl Into<String>) -> TraceError {
        TraceError {
            origin: self.origin.clone(),
            line: self.line,
            problem: problem.into(),
        }
    }

    /// Reads the next line that is neither blank nor the header into
    /// `buf`; returns its length without the line end, `None` at the end.
    fn next_line(&mut self) -> Result<Option<usize>, TraceError> {
        loop {
            self.buf.clear();
            let n = self
                .reader
                .read_until(b'\n', &mut self.buf)
                .map_err(|e| self.error(format!("read failed: {e}")))?;
            if n == 0 {
                return Ok(None);
            }
            self.line += 1;
            let mut end = self.buf.len();
            while end > 0 && matches!(self.buf[end - 1], b'\n' | b'\r') {
                end -= 1;
            }
            let line = &self.buf[..end];
            let blank = line.iter().all(u8::is_ascii_whitespace);
            let header = self.line == 1
                && line.len() >= 4
                && line[..4].eq_ignore_ascii_case(b"time")
                && line[4..].first().is_none_or(|&b| b == b',' || b == b' ');
            if !blank && !header {
                return Ok(Some(end));
            }
        }
    }

    /// The next request, or `None` at the end of the trace.
    pub fn next_row(&mut self) -> Result<Option<TraceRow<'_>>, TraceError> {
        let Some(end) = self.next_line()? else {
            return Ok(None);
        };
        let line = self.line;
        let err = |problem: String| TraceError {
            origin: self.origin.clone(),
            line,
            problem,
        };
        let text =
            std::str::from_utf8(&self.buf[..end]).map_err(|_| err("not valid UTF-8".into()))?;
        let mut fields = text.split(',');
        let time = fields.next().unwrap_or("").trim();
        let model = fields.next().map(str::trim);
        let size = fields.next().map(str::trim);
        if fields.next().is_some() {
            return Err(err(format!(
                "malformed row {text:?}: expected `time,model[,size]`"
            )));
        }
        let Some(model) = model.filter(|m| !m.is_empty()) else {
            return Err(err(format!(
                "malformed row {text:?}: missing model (expected `time,model[,size]`)"
            )));
        };
        let t: f64 = time
            .parse()
            .ok()
            .filter(|t: &f64| t.is_finite() && *t >= 0.0)
            .ok_or_else(|| {
                err(format!(
                    "time {time:?} is not a non-negative number (row {text:?})"
                ))
            })?;
        if t < self.last_time {
            return Err(err(format!(
                "time {time} is earlier than the previous row's {}: traces must be sorted by time",
                self.last_time
            )));
        }
        let size = match size.filter(|s| !s.is_empty()) {
            None => None,
            Some(s) => match parse_bytes(s) {
                Ok(0) => {
                    return Err(err(format!(
                        "model {model:?}: size 0; sizes must be positive"
                    )));
                }
                Ok(b) => Some(b),
                Err(e) => return Err(err(format!("model {model:?}: size: {e}"))),
            },
        };
        self.last_time = t;
        Ok(Some(TraceRow {
            line,
            time: t,
            model,
            size,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(text: &'static str) -> Result<Vec<(String, Option<Bytes>)>, TraceError> {
        let mut r = TraceReader::from_reader(Box::new(text.as_bytes()), "t.csv");
        let mut out = Vec::new();
        while let Some(row) = r.next_row()? {
            out.push((row.model.to_owned(), row.size));
        }
        Ok(out)
    }

    #[test]
    fn reads_rows_with_and_without_header_and_sizes() {
        let want = vec![
            ("a".to_owned(), Some(1 << 20)),
            ("b".to_owned(), None),
            ("a".to_owned(), Some(5)),
        ];
        assert_eq!(
            rows("time,model,size\n0,a,1Mi\n1,b\n\n2.5,a,5\r\n").unwrap(),
            want
        );
        assert_eq!(rows("0,a,1Mi\n1,b,\n2.5,a,5").unwrap(), want);
    }

    #[test]
    fn bad_rows_name_the_line_and_problem() {
        let cases = [
            ("0,a,1\n1,b,-3\n", 2, "negative"),
            ("0,a,1\n1\n", 2, "missing model"),
            ("0,a,1,extra\n", 1, "expected `time,model[,size]`"),
            ("x,a,1\n", 1, "not a non-negative number"),
            ("5,a,1\n4,a\n", 2, "sorted by time"),
            ("0,a,12XB\n", 1, "unknown unit"),
            ("0,a,0\n", 1, "size 0"),
        ];
        for (text, line, want) in cases {
            let err = rows(text).unwrap_err();
            assert_eq!(err.line, line, "{text:?}: {err}");
            let msg = err.to_string();
            assert!(msg.starts_with(&format!("t.csv:{line}: ")), "{msg}");
            assert!(msg.contains(want), "{text:?}: {msg} lacks {want:?}");
        }
    }
}
