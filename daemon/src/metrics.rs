//! The counters of a node or client in the Prometheus text format, served over HTTP
//! (`--metrics ADDR`: `GET /metrics`). A scraper is one trusted peer on an operator's network,
//! but whoever connects gets a bounded wait and a bounded read, never a thread of their own.

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

/// One figure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Metric {
    /// Its name, without the program's prefix (and without `_total`).
    pub name: &'static str,
    pub help: &'static str,
    /// An event count that only grows (a Prometheus counter), else a level (a gauge).
    pub cumulative: bool,
    pub value: u64,
}

impl Metric {
    /// An event count.
    pub fn counter(name: &'static str, help: &'static str, value: u64) -> Metric {
        Metric {
            name,
            help,
            cumulative: true,
            value,
        }
    }

    /// A level.
    pub fn gauge(name: &'static str, help: &'static str, value: u64) -> Metric {
        Metric {
            name,
            help,
            cumulative: false,
            value,
        }
    }
}

impl From<rdmabox::counters::Field> for Metric {
    fn from(f: rdmabox::counters::Field) -> Metric {
        Metric {
            name: f.name,
            help: f.help,
            cumulative: f.cumulative,
            value: f.value,
        }
    }
}

/// `metrics` in the text exposition format, each name prefixed with `prefix_` (and counters
/// suffixed with `_total`).
pub fn render(prefix: &str, metrics: &[Metric]) -> String {
    let mut out = String::new();
    for m in metrics {
        let (name, kind) = match m.cumulative {
            true => (format!("{prefix}_{}_total", m.name), "counter"),
            false => (format!("{prefix}_{}", m.name), "gauge"),
        };
        // Help text escapes backslashes and newlines.
        let help = m.help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
            m.value
        );
    }
    out
}

/// How long a scraper may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// The most of a request that is read.
const MAX_REQUEST: u64 = 8 << 10;

/// Serves `GET /metrics` on `addr` from a thread of its own, with what `collect` gives at each
/// request. Returns the address it listens on.
pub fn serve(
    addr: SocketAddr,
    collect: impl Fn() -> String + Send + 'static,
) -> io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)
        .map_err(|e| io::Error::new(e.kind(), format!("metrics on {addr}: {e}")))?;
    let local = listener.local_addr()?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                match conn {
                    Ok(s) => {
                        if let Err(e) = answer(s, &collect) {
                            log::debug!("metrics request: {e}");
                        }
                    }
                    // Out of descriptors: let whatever holds them finish first.
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            }
        })?;
    Ok(local)
}

/// Answers one HTTP request on `s`.
fn answer(mut s: TcpStream, collect: &impl Fn() -> String) -> io::Result<()> {
    s.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    s.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    let mut request = Vec::new();
    let mut limited = (&mut s).take(MAX_REQUEST);
    let mut buf = [0u8; 1024];
    // Up to the end of the headers (or the limit).
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && !request.ends_with(b"\n\n") {
        let n = limited.read(&mut buf)?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
    }
    let line = request.split(|&b| b == b'\n').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, path) = (
        words.next().unwrap_or_default(),
        words.next().unwrap_or_default(),
    );
    let (status, body) = match (method, path) {
        (b"GET", b"/metrics") => ("200 OK", collect()),
        (b"GET", _) => ("404 Not Found", "try /metrics\n".to_string()),
        _ => ("405 Method Not Allowed", String::new()),
    };
    write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr, request: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(request).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn counters_and_gauges_render_in_the_text_format() {
        let text = render(
            "rfs_client",
            &[
                Metric::counter("reads", "Reads done", 7),
                Metric::gauge("open_files", "Files open\nnow", 2),
            ],
        );
        assert_eq!(
            text,
            "# HELP rfs_client_reads_total Reads done\n# TYPE rfs_client_reads_total counter\n\
             rfs_client_reads_total 7\n# HELP rfs_client_open_files Files open\\nnow\n\
             # TYPE rfs_client_open_files gauge\nrfs_client_open_files 2\n"
        );
    }

    #[test]
    fn serves_metrics_and_nothing_else_and_outlasts_silent_peers() {
        let addr = serve("127.0.0.1:0".parse().unwrap(), || "x_total 1\n".into()).unwrap();
        let ok = get(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.ends_with("\r\n\r\nx_total 1\n"), "{ok}");
        assert!(get(addr, b"GET / HTTP/1.0\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get(addr, b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        // A peer that connects and says nothing holds the server for at most the timeout.
        let _silent = TcpStream::connect(addr).unwrap();
        let start = std::time::Instant::now();
        assert!(get(addr, b"GET /metrics HTTP/1.1\r\n\r\n").contains("x_total 1"));
        assert!(start.elapsed() < REQUEST_TIMEOUT * 2);
        // So does one that sends a flood without an end of headers.
        let mut flood = TcpStream::connect(addr).unwrap();
        let _ = flood.write_all(&vec![b'a'; 64 << 10]);
        assert!(get(addr, b"GET /metrics HTTP/1.1\r\n\r\n").contains("x_total 1"));
    }
}
