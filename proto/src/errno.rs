//! One error number type for both sides of the protocol: what the metadata service answers, what
//! the namespace returns and what the client finally hands to FUSE.

use std::fmt;
use std::io;

/// A POSIX error number (`ENOENT`, `EIO`...), as the kernel understands it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Errno(i32);

macro_rules! errnos {
    ($($name:ident),* $(,)?) => {
        impl Errno {
            $(
                #[doc = concat!("`", stringify!($name), "`")]
                pub const $name: Errno = Errno(libc::$name);
            )*
        }
    };
}

errnos!(
    E2BIG,
    EACCES,
    EAGAIN,
    EBADF,
    EBUSY,
    EEXIST,
    EFBIG,
    EINTR,
    EINVAL,
    EIO,
    EISDIR,
    ENAMETOOLONG,
    ENODATA,
    ENOENT,
    ENOLCK,
    ENOSPC,
    ENOTDIR,
    ENOTEMPTY,
    ENOTSUP,
    ENXIO,
    EPERM,
    EPROTO,
    ERANGE,
    ESTALE,
);

impl Errno {
    /// The error number `raw`, as libc spells it.
    pub const fn from_raw(raw: i32) -> Errno {
        Errno(raw)
    }

    /// The number itself, for the kernel.
    pub const fn raw(self) -> i32 {
        self.0
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Errno({}: {self})", self.0)
    }
}

impl fmt::Display for Errno {
    /// The C library's message ("No such file or directory").
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = io::Error::from_raw_os_error(self.0).to_string();
        // io::Error appends " (os error N)"; the number is in Debug already.
        f.write_str(text.split(" (os error").next().unwrap_or(&text))
    }
}

impl std::error::Error for Errno {}

impl From<Errno> for io::Error {
    fn from(e: Errno) -> io::Error {
        io::Error::from_raw_os_error(e.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_names_its_meaning() {
        assert_eq!(Errno::ENOENT.raw(), libc::ENOENT);
        assert_eq!(Errno::from_raw(libc::EIO), Errno::EIO);
        assert_eq!(Errno::ENOENT.to_string(), "No such file or directory");
        assert!(format!("{:?}", Errno::EIO).contains(&libc::EIO.to_string()));
        assert_eq!(
            io::Error::from(Errno::EACCES).raw_os_error(),
            Some(libc::EACCES)
        );
    }
}
