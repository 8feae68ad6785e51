//! The lender: a second process (this program, `serve`) that registers memory and does
//! nothing else, and the CPU and thread figures read of it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use rdmabox::transport::{Access, Context, ProviderKind, QpCaps, QpRoute, TransportConfig};
use rdmabox::{connect_queue_pairs, SessionConfig};

use crate::cli::Cli;

/// A thousand queue pairs take a thousand descriptors on each side: lift the soft limit to the
/// hard one (the lender, our child, inherits it).
pub(crate) fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
}

pub(crate) fn transport(kind: ProviderKind) -> TransportConfig {
    TransportConfig::with_provider(kind)
}

/// Set in a session's queue-pair count: the lender's side of its queue pairs is responder-only.
pub(crate) const RESPONDER_FLAG: u32 = 1 << 31;

/// The lender: one region, any number of sessions; each connection says how many QPs it wants,
/// and whether the lender's side of them is responder-only.
pub(crate) fn serve(kind: ProviderKind, listen: SocketAddr, memory: u64) -> std::io::Result<()> {
    let ctx = Arc::new(Context::open(&transport(kind))?);
    let pd = Arc::new(ctx.alloc_pd()?);
    let mem = Arc::new(pd.alloc_region(memory as usize, Access::ALL)?);
    let l = TcpListener::bind(listen)?;
    println!("{}", l.local_addr()?);
    std::io::stdout().flush()?;
    for conn in l.incoming() {
        let mut s = conn?;
        let (ctx, pd, mem) = (ctx.clone(), pd.clone(), mem.clone());
        std::thread::spawn(move || -> std::io::Result<()> {
            let mut n = [0u8; 4];
            s.read_exact(&mut n)?;
            let asked = u32::from_le_bytes(n);
            let qps = (asked & !RESPONDER_FLAG).clamp(1, 64) as usize;
            let caps = if asked & RESPONDER_FLAG != 0 {
                QpCaps::RESPONDER
            } else {
                SessionConfig::default().caps
            };
            let connected = connect_queue_pairs(&ctx, &pd, &mut s, qps, caps, &QpRoute::OwnPort)?;
            let r = mem.remote();
            let mut msg = r.addr.to_le_bytes().to_vec();
            msg.extend_from_slice(&r.len.to_le_bytes());
            msg.extend_from_slice(&r.rkey.to_le_bytes());
            s.write_all(&msg)?;
            let _ = s.read(&mut n); // until the client goes
            drop(connected);
            Ok(())
        });
    }
    Ok(())
}

pub(crate) struct Lender {
    pub(crate) addr: SocketAddr,
    pub(crate) child: Option<Child>,
}

impl Lender {
    pub(crate) fn start(cli: &Cli) -> Lender {
        if let Some(addr) = cli.connect {
            return Lender { addr, child: None };
        }
        let mut child = Command::new(std::env::current_exe().expect("own path"))
            .args([
                "--transport",
                &cli.transport.to_string(),
                "serve",
                "--memory",
            ])
            .arg(cli.memory.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the lender");
        let mut out = child.stdout.take().expect("piped");
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while out.read(&mut b).unwrap_or(0) == 1 && b[0] != b'\n' {
            line.push(b[0]);
        }
        let addr = String::from_utf8_lossy(&line)
            .trim()
            .parse()
            .expect("lender address");
        Lender {
            addr,
            child: Some(child),
        }
    }

    /// The lender's CPU seconds so far (0 when it is not our child).
    pub(crate) fn cpu(&self) -> f64 {
        self.child.as_ref().map_or(0.0, |c| proc_cpu(c.id()))
    }
}

impl Drop for Lender {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub(crate) fn proc_cpu(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15; `after` starts at field 3.
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| f.get(i)?.parse::<f64>().ok())
        .sum();
    let per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100);
    ticks / per_second as f64
}

pub(crate) fn self_cpu() -> f64 {
    proc_cpu(std::process::id())
}
