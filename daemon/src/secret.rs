//! The shared secret every peer proves it knows: where it lives by default, how the first node
//! creates it, and how everyone reads it. Authentication is on unless a node is started with
//! `--insecure`; a secret file that anyone but its owner can read is refused, since whoever
//! reads it has every peer's reach.

use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::unistd::geteuid;

/// Random bytes in a created secret (written as hex).
const CREATED_BYTES: usize = 32;

/// Where nodes and clients look for the secret when not told: `/etc/rfs/secret` for root,
/// `$XDG_CONFIG_HOME/rfs/secret` (or `~/.config/rfs/secret`) for anyone else.
pub fn default_path() -> PathBuf {
    if geteuid().is_root() {
        return PathBuf::from("/etc/rfs/secret");
    }
    let config = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")));
    match config {
        Some(c) => c.join("rfs/secret"),
        // Never a path relative to wherever the process happens to run.
        None => PathBuf::from("/etc/rfs/secret"),
    }
}

fn with_path(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("secret file {}: {e}", path.display()))
}

/// Reads a secret file: its bytes, trailing whitespace trimmed. Refuses an empty one, one that
/// group or others may read, and one that another user owns (who could read or replace it).
pub fn read(path: &Path) -> io::Result<Vec<u8>> {
    let mut f = std::fs::File::open(path).map_err(|e| with_path(path, e))?;
    let meta = f.metadata().map_err(|e| with_path(path, e))?;
    let mode = meta.mode();
    let me = geteuid().as_raw();
    if meta.uid() != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "secret file {} belongs to uid {}, not to this user (uid {me})",
                path.display(),
                meta.uid()
            ),
        ));
    }
    if mode & 0o077 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "secret file {} may be read by others (mode {:o}): run `chmod 600 {}`",
                path.display(),
                mode & 0o777,
                path.display()
            ),
        ));
    }
    let mut raw = Vec::new();
    io::Read::read_to_end(&mut f, &mut raw).map_err(|e| with_path(path, e))?;
    let end = raw
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(0, |i| i + 1);
    if end == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("secret file {} is empty", path.display()),
        ));
    }
    raw.truncate(end);
    Ok(raw)
}

/// Reads the secret at `path`, creating a random one (mode 0600, its directory 0700) when there
/// is none. Safe against another node creating it at the same moment: the file appears whole
/// or not at all, and the loser reads the winner's. The flag says whether this call created it.
pub fn read_or_create(path: &Path) -> io::Result<(Vec<u8>, bool)> {
    match read(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        other => return other.map(|s| (s, false)),
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| with_path(path, e))?;
    }
    let mut bytes = [0u8; CREATED_BYTES];
    rdmabox::random::fill(&mut bytes);
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let staging = path.with_extension(format!(
        "new.{}.{:x}",
        std::process::id(),
        rdmabox::random::u64()
    ));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&staging)
        .and_then(|mut f| {
            f.write_all(format!("{hex}\n").as_bytes())?;
            f.sync_all()
        });
    // link() fails if the name exists: whoever links first wins.
    let linked = written.and_then(|()| std::fs::hard_link(&staging, path));
    let _ = std::fs::remove_file(&staging);
    match linked {
        // Created 0600: the umask can only have narrowed that.
        Ok(()) => Ok((hex.into_bytes(), true)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => read(path).map(|s| (s, false)),
        Err(e) => Err(with_path(path, e)),
    }
}

/// How a peer (a client or a joining node) finds its secret: the file it was given, which must
/// exist; else the default path if a secret is there; else none (the node says whether it needs
/// one).
pub fn for_peer(given: Option<&Path>) -> io::Result<Option<Vec<u8>>> {
    match given {
        Some(p) => read(p).map(Some),
        None => match read(&default_path()) {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "rfs-secret-test-{}-{name}-{}",
            std::process::id(),
            rdmabox::random::u64()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_created_secret_is_private_and_read_back() {
        let d = scratch("create");
        let p = d.join("sub/secret");
        let (made, created) = read_or_create(&p).unwrap();
        assert!(created);
        assert_eq!(made.len(), 2 * CREATED_BYTES);
        let mode = std::fs::metadata(&p).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dir_mode = std::fs::metadata(d.join("sub")).unwrap().mode() & 0o777;
        assert_eq!(dir_mode, 0o700);
        assert_eq!(read_or_create(&p).unwrap(), (made.clone(), false));
        assert_eq!(for_peer(Some(&p)).unwrap(), Some(made));
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn racing_creators_agree_on_one_secret() {
        let d = scratch("race");
        let p = d.join("secret");
        let got: Vec<Vec<u8>> = (0..8)
            .map(|_| {
                let p = p.clone();
                std::thread::spawn(move || read_or_create(&p).unwrap().0)
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert!(got.windows(2).all(|w| w[0] == w[1]));
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1, "no staging left");
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn a_readable_or_empty_secret_is_refused_with_the_fix() {
        let d = scratch("perm");
        let p = d.join("secret");
        std::fs::write(&p, "k\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read(&p).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        assert!(read_or_create(&p).is_err(), "not replaced either");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read(&p).unwrap(), b"k");
        std::fs::write(&p, " \n").unwrap();
        assert!(read(&p).unwrap_err().to_string().contains("empty"));
        assert!(for_peer(Some(&d.join("missing"))).is_err());
        std::fs::remove_dir_all(d).unwrap();
    }
}
