//! Where the binaries log, with the usual `RUST_LOG` filters: stderr (the default, which
//! systemd's journal takes from a service), a file (`--log-file PATH`, appended to), or
//! syslog (`--log-file syslog`: the local `/dev/log` socket, which journald also serves), for a
//! daemon whose stderr went away with the shell that started it. A log file is opened again
//! by [`reopen`] (on SIGHUP, after logrotate moved it away).

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use env_logger::fmt::Formatter;
use log::{Level, Record};

/// Where log records go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogTarget {
    Stderr,
    File(std::path::PathBuf),
    Syslog,
}

impl std::str::FromStr for LogTarget {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" => Err("an empty log file name".into()),
            "-" | "stderr" => Ok(LogTarget::Stderr),
            "syslog" => Ok(LogTarget::Syslog),
            path => Ok(LogTarget::File(path.into())),
        }
    }
}

/// The syslog socket of the local machine.
const SYSLOG_SOCKET: &str = "/dev/log";

/// Sets up the global logger for the program `ident`, filtered by `RUST_LOG` or else
/// `default_filter`. Fails (and sets nothing up) when the file cannot be opened or there is no
/// syslog socket.
pub fn init(ident: &'static str, default_filter: &str, target: &LogTarget) -> io::Result<()> {
    let mut b =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(default_filter));
    match target {
        LogTarget::Stderr => {}
        LogTarget::File(path) => {
            let file = LogFile {
                // Opened again by this name on SIGHUP, from whatever directory then.
                path: std::path::absolute(path).unwrap_or_else(|_| path.clone()),
                file: Arc::new(Mutex::new(open_append(path)?)),
            };
            b.target(env_logger::Target::Pipe(Box::new(file.clone())));
            let _ = LOG_FILE.set(file);
        }
        LogTarget::Syslog => {
            let sock = UnixDatagram::unbound()?;
            sock.connect(SYSLOG_SOCKET)
                .map_err(|e| io::Error::new(e.kind(), format!("syslog at {SYSLOG_SOCKET}: {e}")))?;
            b.target(env_logger::Target::Pipe(Box::new(Syslog {
                sock,
                record: Vec::new(),
            })));
            b.format(move |buf, r| syslog_line(buf, ident, r));
        }
    }
    b.try_init().map_err(io::Error::other)
}

/// The log file, shared between the logger and [`reopen`].
#[derive(Clone)]
struct LogFile {
    path: PathBuf,
    file: Arc<Mutex<std::fs::File>>,
}

impl Write for LogFile {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.file.lock().unwrap().write(b)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.lock().unwrap().flush()
    }
}

static LOG_FILE: OnceLock<LogFile> = OnceLock::new();

/// Opens the log file again by its name (one logrotate moved away is left to it) and logs to
/// it from now on, saying so; on failure the old file is kept, and that is logged. Nothing to
/// do when logging goes to no file.
pub fn reopen() {
    let Some(log) = LOG_FILE.get() else {
        return;
    };
    match open_append(&log.path) {
        Ok(fresh) => {
            *log.file.lock().unwrap() = fresh;
            log::info!("log file {} opened again", log.path.display());
        }
        Err(e) => log::error!("{e}: still logging to the file opened before"),
    }
}

fn open_append(path: &Path) -> io::Result<std::fs::File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("log file {}: {e}", path.display())))
}

/// An RFC 3164 line as the local syslog daemon takes it: `<PRI>ident[pid]: message`, from
/// facility "daemon".
fn syslog_line(buf: &mut Formatter, ident: &str, r: &Record) -> io::Result<()> {
    const DAEMON: u8 = 3;
    let severity = match r.level() {
        Level::Error => 3,
        Level::Warn => 4,
        Level::Info => 6,
        Level::Debug | Level::Trace => 7,
    };
    write!(
        buf,
        "<{}>{ident}[{}]: {}: {}",
        DAEMON * 8 + severity,
        std::process::id(),
        r.target(),
        r.args()
    )
}

/// Sends each record as one datagram: env_logger writes a record, then flushes.
struct Syslog {
    sock: UnixDatagram,
    record: Vec<u8>,
}

impl Write for Syslog {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.record.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.record.is_empty() {
            return Ok(());
        }
        // A syslog daemon that restarted has a new socket: connect again, once per record.
        // One that is gone or full loses the line, never the program.
        if self.sock.send(&self.record).is_err() && self.sock.connect(SYSLOG_SOCKET).is_ok() {
            let _ = self.sock.send(&self.record);
        }
        self.record.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        assert_eq!("syslog".parse(), Ok(LogTarget::Syslog));
        assert_eq!("-".parse(), Ok(LogTarget::Stderr));
        assert_eq!(
            "/var/log/rfs.log".parse(),
            Ok(LogTarget::File("/var/log/rfs.log".into()))
        );
        assert!("".parse::<LogTarget>().is_err());
    }

    #[test]
    fn a_record_is_one_datagram() {
        let (a, b) = UnixDatagram::pair().unwrap();
        let mut w = Syslog {
            sock: a,
            record: Vec::new(),
        };
        w.write_all(b"<30>fs-client[1]: x: hello").unwrap();
        w.write_all(b" world").unwrap();
        w.flush().unwrap();
        w.flush().unwrap();
        let mut got = [0u8; 64];
        let n = b.recv(&mut got).unwrap();
        assert_eq!(&got[..n], b"<30>fs-client[1]: x: hello world");
        b.set_nonblocking(true).unwrap();
        assert!(b.recv(&mut got).is_err(), "an empty flush sends nothing");
    }
}
