//! The control messages on a ring's Unix socket (SOCK_SEQPACKET: one message per packet), and
//! the descriptors they carry. Little-endian, fixed sizes; anything else is refused.
//!
//! The application says hello with its ring and buffer memory; fs-client answers with the two
//! eventfds (it makes them, so that no application can hand it one that blocks). Files are
//! registered by passing a descriptor opened through the mount.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

use crate::layout::Layout;

/// "RFSR", then the protocol's version.
pub const MAGIC: u32 = u32::from_le_bytes(*b"RFSR");
pub const VERSION: u32 = 1;
/// The longest message.
pub const MAX_MESSAGE: usize = 32;
/// The most descriptors one message carries.
pub const MAX_FDS: usize = 2;

/// What the application asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// With two descriptors: the ring memory, then the buffer (memfds sealed against
    /// shrinking).
    Hello {
        layout: Layout,
        buffer_len: u64,
    },
    /// With one descriptor: a file opened through the mount; `write` asks for writing too.
    Register {
        write: bool,
    },
    Unregister {
        file: u32,
    },
}

/// What fs-client answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// With two descriptors: the submission eventfd (the application writes it after
    /// submitting), then the completion eventfd (fs-client writes it after completing); both
    /// non-blocking. Requests move at most `max_io` bytes each.
    Welcome {
        max_io: u32,
    },
    Registered {
        file: u32,
    },
    Unregistered,
    /// The request failed with this errno.
    Refused {
        errno: i32,
    },
}

const HELLO: u32 = 1;
const REGISTER: u32 = 2;
const UNREGISTER: u32 = 3;
const WELCOME: u32 = 101;
const REGISTERED: u32 = 102;
const UNREGISTERED: u32 = 103;
const REFUSED: u32 = 104;

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAX_MESSAGE);
        match *self {
            Request::Hello { layout, buffer_len } => {
                for word in [HELLO, MAGIC, VERSION, layout.sq_entries, layout.cq_entries] {
                    out.extend_from_slice(&word.to_le_bytes());
                }
                out.extend_from_slice(&buffer_len.to_le_bytes());
            }
            Request::Register { write } => {
                out.extend_from_slice(&REGISTER.to_le_bytes());
                out.extend_from_slice(&u32::from(write).to_le_bytes());
            }
            Request::Unregister { file } => {
                out.extend_from_slice(&UNREGISTER.to_le_bytes());
                out.extend_from_slice(&file.to_le_bytes());
            }
        }
        out
    }

    /// The request in `b`, all of it; an error says what is wrong.
    pub fn decode(b: &[u8]) -> Result<Request, String> {
        let mut r = Words(b);
        let request = match r.u32()? {
            HELLO => {
                let (magic, version) = (r.u32()?, r.u32()?);
                if magic != MAGIC || version != VERSION {
                    return Err(format!("ring protocol {magic:#x} version {version}"));
                }
                let layout = Layout::new(r.u32()?, r.u32()?)?;
                Request::Hello {
                    layout,
                    buffer_len: r.u64()?,
                }
            }
            REGISTER => Request::Register {
                write: match r.u32()? {
                    0 => false,
                    1 => true,
                    w => return Err(format!("registration for access {w}")),
                },
            },
            UNREGISTER => Request::Unregister { file: r.u32()? },
            t => return Err(format!("unknown request {t}")),
        };
        r.end()?;
        Ok(request)
    }
}

impl Reply {
    pub fn encode(&self) -> Vec<u8> {
        let words = match *self {
            Reply::Welcome { max_io } => [WELCOME, max_io],
            Reply::Registered { file } => [REGISTERED, file],
            Reply::Unregistered => [UNREGISTERED, 0],
            Reply::Refused { errno } => [REFUSED, errno as u32],
        };
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    pub fn decode(b: &[u8]) -> Result<Reply, String> {
        let mut r = Words(b);
        let (tag, value) = (r.u32()?, r.u32()?);
        r.end()?;
        Ok(match tag {
            WELCOME => Reply::Welcome { max_io: value },
            REGISTERED => Reply::Registered { file: value },
            UNREGISTERED => Reply::Unregistered,
            REFUSED => Reply::Refused {
                errno: value as i32,
            },
            t => return Err(format!("unknown reply {t}")),
        })
    }
}

/// Little-endian words off the front of a message.
struct Words<'a>(&'a [u8]);

impl Words<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let Some((head, rest)) = self.0.split_first_chunk::<N>() else {
            return Err("a message cut short".into());
        };
        self.0 = rest;
        Ok(*head)
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.take().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.take().map(u64::from_le_bytes)
    }

    fn end(&self) -> Result<(), String> {
        match self.0.is_empty() {
            true => Ok(()),
            false => Err(format!("{} bytes past the message", self.0.len())),
        }
    }
}

/// Sends one message with `fds`.
pub fn send(sock: &impl AsFd, message: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let iov = [IoSlice::new(message)];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    sendmsg::<()>(
        sock.as_fd().as_raw_fd(),
        &iov,
        cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    Ok(())
}

/// Receives one message into `buf` and the descriptors with it (closed on exec; at most
/// [`MAX_FDS`]). A message or descriptor list cut short is an error; so is the peer gone (an
/// empty message).
pub fn recv(sock: &impl AsFd, buf: &mut [u8; MAX_MESSAGE]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        sock.as_fd().as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = cmsg {
            // SAFETY: the kernel just installed these descriptors for us; nothing else owns
            // them.
            fds.extend(
                raw.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    let cut = msg
        .flags
        .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
    let len = msg.bytes;
    if cut {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a message or its descriptors cut short",
        ));
    }
    if len == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok((len, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_damage_is_refused() {
        let layout = Layout::new(64, 128).unwrap();
        for r in [
            Request::Hello {
                layout,
                buffer_len: 1 << 30,
            },
            Request::Register { write: true },
            Request::Unregister { file: 7 },
        ] {
            let b = r.encode();
            assert!(b.len() <= MAX_MESSAGE);
            assert_eq!(Request::decode(&b), Ok(r));
            for cut in 0..b.len() {
                assert!(Request::decode(&b[..cut]).is_err());
            }
            let mut long = b.clone();
            long.push(0);
            assert!(Request::decode(&long).is_err());
        }
        for r in [
            Reply::Welcome { max_io: 1 << 24 },
            Reply::Registered { file: 3 },
            Reply::Unregistered,
            Reply::Refused { errno: 13 },
        ] {
            assert_eq!(Reply::decode(&r.encode()), Ok(r));
        }
        let mut bad = Request::Hello {
            layout,
            buffer_len: 1,
        }
        .encode();
        bad[12] = 3; // sq_entries 3: not a power of two
        assert!(Request::decode(&bad).is_err());
        bad[4] ^= 1;
        assert!(Request::decode(&bad).unwrap_err().contains("protocol"));
        assert!(Request::decode(&[9, 0, 0, 0]).is_err());
        assert!(Request::decode(&Request::Register { write: true }.encode()[..4]).is_err());
        let mut two = Request::Register { write: true }.encode();
        two[4] = 2;
        assert!(Request::decode(&two).is_err());
    }

    #[test]
    fn descriptors_travel_with_their_message() {
        let (a, b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let file = std::fs::File::open("/proc/self/status").unwrap();
        send(&a, b"hi", &[file.as_raw_fd()]).unwrap();
        let mut buf = [0u8; MAX_MESSAGE];
        let (n, fds) = recv(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hi");
        assert_eq!(fds.len(), 1);
        // Too many descriptors: cut short, and what came is closed.
        let files: Vec<_> = (0..3)
            .map(|_| std::fs::File::open("/proc/self/status").unwrap())
            .collect();
        let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        send(&a, b"x", &raw).unwrap();
        assert!(recv(&b, &mut buf).is_err());
    }
}
