//! Admission control: a window of in-flight bytes, counted in whole pages, enforced where
//! requests leave the merge queue, so that requests held back can still merge with later ones.
//!
//! The window size comes from an [`AdmissionPolicy`]: [`Unlimited`], a [`StaticWindow`] (the
//! paper's ~7 MB), or an [`AdaptiveWindow`] that grows while completion latency holds and shrinks
//! when it rises.

use std::sync::Mutex;
use std::time::Duration;

/// The unit requests are charged in: a request costs at least one page.
pub const PAGE: u64 = 4096;

/// What a request of `len` bytes costs against the window: whole pages, at least one.
pub fn charge(len: usize) -> u64 {
    (len as u64).div_ceil(PAGE).max(1) * PAGE
}

/// Whether a request charged `cost` may start with `inflight` bytes already in flight. One
/// request is always admitted into an empty window, however large, so nothing waits forever.
pub fn admits(inflight: u64, cost: u64, limit: Option<u64>) -> bool {
    match limit {
        None => true,
        Some(limit) => inflight == 0 || inflight + cost <= limit,
    }
}

/// Decides how many bytes may be in flight.
pub trait AdmissionPolicy: Send + Sync {
    /// The window now; None for unlimited.
    fn limit(&self) -> Option<u64>;
    /// Feedback: a work request of `bytes` completed `latency` after it was posted.
    fn on_completion(&self, _bytes: u64, _latency: Duration) {}
    /// The policy and its current window, in words (for logs and the bench's report).
    fn describe(&self) -> String;
}

/// No window: everything queued is admitted.
pub struct Unlimited;

impl AdmissionPolicy for Unlimited {
    fn limit(&self) -> Option<u64> {
        None
    }
    fn describe(&self) -> String {
        "off".into()
    }
}

/// A fixed window of this many bytes (at least a page).
pub struct StaticWindow(pub u64);

impl AdmissionPolicy for StaticWindow {
    fn limit(&self) -> Option<u64> {
        Some(self.0.max(PAGE))
    }
    fn describe(&self) -> String {
        format!("static {} KiB", self.0 / 1024)
    }
}

/// Additive increase while per-page latency stays near the best seen, multiplicative decrease
/// when it rises: the window settles where the peer (or the wire) starts to queue.
pub struct AdaptiveWindow {
    min: u64,
    max: u64,
    state: Mutex<AdaptiveState>,
}

struct AdaptiveState {
    limit: u64,
    /// Lowest per-page latency of a round seen so far, in ns; slowly forgotten.
    base_ns: f64,
    round_ns: f64,
    round_pages: f64,
    round_len: u32,
}

/// Completions per adjustment.
const ROUND: u32 = 32;
/// Latency above this multiple of the base means queueing.
const TOLERANCE: f64 = 1.5;

impl AdaptiveWindow {
    /// A window that moves between `min` (at least a page) and `max`, starting at a quarter of
    /// `max`.
    pub fn new(min: u64, max: u64) -> AdaptiveWindow {
        let min = min.max(PAGE);
        let max = max.max(min);
        AdaptiveWindow {
            min,
            max,
            state: Mutex::new(AdaptiveState {
                limit: min.max(max / 4),
                base_ns: f64::INFINITY,
                round_ns: 0.0,
                round_pages: 0.0,
                round_len: 0,
            }),
        }
    }
}

impl AdmissionPolicy for AdaptiveWindow {
    fn limit(&self) -> Option<u64> {
        Some(self.state.lock().unwrap().limit)
    }

    fn on_completion(&self, bytes: u64, latency: Duration) {
        let mut s = self.state.lock().unwrap();
        s.round_ns += latency.as_nanos() as f64;
        s.round_pages += (charge(bytes as usize) / PAGE) as f64;
        s.round_len += 1;
        if s.round_len < ROUND {
            return;
        }
        let per_page = s.round_ns / s.round_pages.max(1.0);
        (s.round_ns, s.round_pages, s.round_len) = (0.0, 0.0, 0);
        // Forget the base slowly so that a permanently slower path is accepted as the new normal.
        s.base_ns = (s.base_ns * 1.02).min(per_page);
        if per_page <= s.base_ns * TOLERANCE {
            s.limit = (s.limit + (s.limit / 16).max(16 * PAGE)).min(self.max);
        } else {
            s.limit = (s.limit - s.limit / 4).max(self.min);
        }
    }

    fn describe(&self) -> String {
        format!(
            "adaptive {}..{} KiB (now {} KiB)",
            self.min / 1024,
            self.max / 1024,
            self.limit().unwrap_or(0) / 1024
        )
    }
}

/// How a session's window is configured (the `--window` flag's values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowConfig {
    /// No admission control ([`Unlimited`]).
    Off,
    /// A fixed window of this many bytes ([`StaticWindow`]).
    Static(u64),
    /// A window that follows completion latency ([`AdaptiveWindow`]).
    Adaptive {
        /// Smallest window, in bytes.
        min: u64,
        /// Largest window, in bytes.
        max: u64,
    },
}

impl Default for WindowConfig {
    /// The paper's best static window (~7 MB on ConnectX-3).
    fn default() -> Self {
        WindowConfig::Static(7 << 20)
    }
}

impl WindowConfig {
    /// The policy this configuration describes, ready for a session.
    pub fn build(self) -> Box<dyn AdmissionPolicy> {
        match self {
            WindowConfig::Off => Box::new(Unlimited),
            WindowConfig::Static(b) => Box::new(StaticWindow(b)),
            WindowConfig::Adaptive { min, max } => Box::new(AdaptiveWindow::new(min, max)),
        }
    }
}

/// Parses "off", a size ("7M", "512K", "1048576") or "adaptive" / "adaptive:MIN-MAX".
impl std::str::FromStr for WindowConfig {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("off") || s == "0" {
            return Ok(WindowConfig::Off);
        }
        if let Some(rest) = s.strip_prefix("adaptive") {
            if rest.is_empty() {
                return Ok(WindowConfig::Adaptive {
                    min: 256 << 10,
                    max: 64 << 20,
                });
            }
            let range = rest
                .strip_prefix(':')
                .ok_or_else(|| format!("bad window {s:?}: expected adaptive:MIN-MAX"))?;
            let (a, b) = range
                .split_once('-')
                .ok_or_else(|| format!("bad window {s:?}: expected adaptive:MIN-MAX"))?;
            return Ok(WindowConfig::Adaptive {
                min: crate::size::parse_size(a)?,
                max: crate::size::parse_size(b)?,
            });
        }
        Ok(WindowConfig::Static(crate::size::parse_size(s)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_whole_pages() {
        assert_eq!(charge(0), PAGE);
        assert_eq!(charge(1), PAGE);
        assert_eq!(charge(4096), PAGE);
        assert_eq!(charge(4097), 2 * PAGE);
    }

    #[test]
    fn admission_respects_the_limit_but_never_starves() {
        assert!(
            admits(0, 100 * PAGE, Some(PAGE)),
            "empty window takes anything"
        );
        assert!(admits(PAGE, PAGE, Some(2 * PAGE)));
        assert!(!admits(2 * PAGE, PAGE, Some(2 * PAGE)));
        assert!(admits(u64::MAX / 2, PAGE, None));
    }

    #[test]
    fn adaptive_grows_while_latency_holds_and_shrinks_when_it_rises() {
        let w = AdaptiveWindow::new(64 * PAGE, 4096 * PAGE);
        let start = w.limit().unwrap();
        for _ in 0..10 * ROUND {
            w.on_completion(PAGE, Duration::from_micros(10));
        }
        let grown = w.limit().unwrap();
        assert!(grown > start, "{grown} > {start}");
        for _ in 0..4 * ROUND {
            w.on_completion(PAGE, Duration::from_micros(100));
        }
        let shrunk = w.limit().unwrap();
        assert!(shrunk < grown, "{shrunk} < {grown}");
        for _ in 0..100 * ROUND {
            w.on_completion(PAGE, Duration::from_millis(10));
        }
        assert_eq!(w.limit().unwrap(), 64 * PAGE, "bounded below");
    }

    #[test]
    fn adaptive_is_bounded_above() {
        let w = AdaptiveWindow::new(PAGE, 128 * PAGE);
        for _ in 0..1000 * ROUND {
            w.on_completion(PAGE, Duration::from_micros(5));
        }
        assert_eq!(w.limit().unwrap(), 128 * PAGE);
    }

    #[test]
    fn window_flag_parses() {
        assert_eq!("off".parse::<WindowConfig>().unwrap(), WindowConfig::Off);
        assert_eq!(
            "7M".parse::<WindowConfig>().unwrap(),
            WindowConfig::Static(7 << 20)
        );
        assert_eq!(
            "adaptive:1M-8M".parse::<WindowConfig>().unwrap(),
            WindowConfig::Adaptive {
                min: 1 << 20,
                max: 8 << 20
            }
        );
        assert!("seven".parse::<WindowConfig>().is_err());
        assert!("adaptive:1M".parse::<WindowConfig>().is_err());
    }
}
