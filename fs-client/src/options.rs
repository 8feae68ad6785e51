//! Mount options: every tunable is a flag and also an `-o name[=value]` option, so that a mount
//! helper or /etc/fstab can pass them. `-o` values override flags.

use std::path::PathBuf;
use std::time::Duration;

use rdmabox::size::parse_size;
use rdmabox::transport::ProviderKind;
use rdmabox::{PollMode, WindowConfig};

/// Everything the client is configured with.
#[derive(Clone, Debug, PartialEq)]
pub struct MountConfig {
    pub allow_other: bool,
    /// Largest FUSE write, in bytes (the kernel allows up to 1 MiB).
    pub max_write: u32,
    pub max_readahead: u32,
    pub writeback_cache: bool,
    pub attr_timeout: Duration,
    pub entry_timeout: Duration,
    pub threads: usize,
    pub transport: ProviderKind,
    pub secret_file: Option<PathBuf>,
    /// How long a storage node may stay silent before its I/O fails with EIO.
    pub io_timeout: Duration,
    pub qps: usize,
    pub window: WindowConfig,
    pub dyn_threshold: usize,
    pub polling: PollMode,
    pub merge: bool,
    pub chain: bool,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            allow_other: false,
            max_write: 1 << 20,
            max_readahead: 1 << 20,
            writeback_cache: false,
            attr_timeout: Duration::from_secs(1),
            entry_timeout: Duration::from_secs(1),
            threads: 4,
            transport: ProviderKind::Auto,
            secret_file: None,
            io_timeout: Duration::from_secs(5),
            qps: 4,
            window: WindowConfig::default(),
            dyn_threshold: 928 << 10,
            polling: PollMode::default(),
            merge: true,
            chain: true,
        }
    }
}

fn flag(v: Option<&str>) -> Result<bool, String> {
    match v.map(str::to_ascii_lowercase).as_deref() {
        None | Some("1" | "on" | "yes" | "true") => Ok(true),
        Some("0" | "off" | "no" | "false") => Ok(false),
        Some(other) => Err(format!("expected on or off, got {other:?}")),
    }
}

fn secs(v: &str) -> Result<Duration, String> {
    let f: f64 = v
        .trim_end_matches('s')
        .parse()
        .map_err(|_| format!("expected seconds, got {v:?}"))?;
    if !(0.0..=86400.0).contains(&f) {
        return Err(format!("{v} seconds is out of range"));
    }
    Ok(Duration::from_secs_f64(f))
}

/// Options that FUSE mount helpers pass and that mean nothing to us.
const IGNORED: &[&str] = &[
    "rw", "defaults", "auto", "noauto", "user", "nouser", "_netdev", "dev", "suid", "exec",
];

impl MountConfig {
    /// Applies one `-o` option.
    pub fn apply(&mut self, opt: &str) -> Result<(), String> {
        let (name, value) = match opt.split_once('=') {
            Some((n, v)) => (n.trim(), Some(v.trim())),
            None => (opt.trim(), None),
        };
        let need = || value.ok_or_else(|| format!("-o {name} needs a value"));
        let wrap = |e: String| format!("-o {name}: {e}");
        match name {
            "allow_other" => self.allow_other = flag(value).map_err(wrap)?,
            "max_write" => {
                let v = parse_size(need()?).map_err(wrap)?;
                if !(4096..=(1 << 20)).contains(&v) {
                    return Err(format!("-o max_write must be between 4K and 1M, got {v}"));
                }
                self.max_write = v as u32;
            }
            "max_readahead" => {
                self.max_readahead = parse_size(need()?).map_err(wrap)?.min(u32::MAX as u64) as u32
            }
            "writeback_cache" => self.writeback_cache = flag(value).map_err(wrap)?,
            "attr_timeout" => self.attr_timeout = secs(need()?).map_err(wrap)?,
            "entry_timeout" => self.entry_timeout = secs(need()?).map_err(wrap)?,
            "threads" => {
                self.threads = need()?
                    .parse()
                    .map_err(|_| wrap("expected a number".into()))?;
                if !(1..=256).contains(&self.threads) {
                    return Err("-o threads must be 1..=256".into());
                }
            }
            "transport" => self.transport = need()?.parse().map_err(wrap)?,
            "secret_file" => self.secret_file = Some(PathBuf::from(need()?)),
            "io_timeout" => {
                self.io_timeout = secs(need()?).map_err(wrap)?;
                if self.io_timeout < Duration::from_secs(1) {
                    return Err("-o io_timeout must be at least 1 second".into());
                }
            }
            "qps" => {
                self.qps = need()?
                    .parse()
                    .map_err(|_| wrap("expected a number".into()))?;
                if !(1..=64).contains(&self.qps) {
                    return Err("-o qps must be 1..=64".into());
                }
            }
            "window" => self.window = need()?.parse().map_err(wrap)?,
            "dyn_threshold" => {
                let v = need()?;
                self.dyn_threshold = if v == "never" {
                    usize::MAX
                } else {
                    parse_size(v).map_err(wrap)? as usize
                };
            }
            "polling" => self.polling = need()?.parse().map_err(wrap)?,
            "merge" => self.merge = flag(value).map_err(wrap)?,
            "chain" => self.chain = flag(value).map_err(wrap)?,
            _ if IGNORED.contains(&name) => {}
            _ => return Err(format!("unknown mount option -o {name}")),
        }
        Ok(())
    }

    /// Applies a comma-separated `-o` list.
    pub fn apply_list(&mut self, list: &str) -> Result<(), String> {
        list.split(',')
            .filter(|o| !o.trim().is_empty())
            .try_for_each(|o| self.apply(o))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse() {
        let mut c = MountConfig::default();
        c.apply_list("allow_other,max_write=128K,writeback_cache=off,attr_timeout=2.5,threads=8,transport=tcp,qps=2,window=off,dyn_threshold=never,polling=busy,merge=0,chain=no,rw,_netdev")
            .unwrap();
        assert!(c.allow_other);
        assert_eq!(c.max_write, 128 << 10);
        assert_eq!(c.attr_timeout, Duration::from_millis(2500));
        assert_eq!(c.threads, 8);
        assert_eq!(c.transport, ProviderKind::Tcp);
        assert_eq!(c.window, WindowConfig::Off);
        assert_eq!(c.dyn_threshold, usize::MAX);
        assert_eq!(c.polling, PollMode::Busy);
        assert!(!c.merge && !c.chain);
    }

    #[test]
    fn bad_options_say_what_is_wrong() {
        for bad in [
            "max_write=2M",
            "max_write",
            "threads=0",
            "bogus",
            "transport=smoke",
            "merge=maybe",
            "io_timeout=0.1",
            "attr_timeout=-1",
        ] {
            let e = MountConfig::default().apply_list(bad).unwrap_err();
            assert!(!e.is_empty(), "{bad}");
        }
    }
}
