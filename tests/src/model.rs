//! Mounts taking turns at random operations on three names, checked against a model of inodes
//! and contents: whatever any mount reads or stats must be what the model says.

use crate::rng::Rng;
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;

use crate::Mount;

/// A small deterministic generator (xorshift), so a failing run can be replayed by its seed.
const NAMES: [&str; 3] = ["a", "b", "c"];
/// Files stay below this size (several chunks of small ones).
const MAX: u64 = 200 << 10;

/// `steps` random operations (writes, cuts, removals, renames, writes through descriptors kept
/// open, reads, stats and fstats) by `mounts` in turn, from `seed`; `before(step)` runs before
/// each (a fault to inject). Panics at the first divergence from the model, saying where.
pub fn agree_with_a_model(mounts: &[Mount], seed: u64, steps: u64, mut before: impl FnMut(u64)) {
    // The model: inodes' contents, which inode each name leads to.
    let mut files: Vec<Vec<u8>> = Vec::new();
    let mut at: HashMap<&str, usize> = HashMap::new();
    // Descriptors kept open across steps: (mount, inode, file).
    let mut held: Vec<(usize, usize, File)> = Vec::new();
    let mut rng = Rng(seed);
    for step in 0..steps {
        before(step);
        let m = rng.below(mounts.len() as u64) as usize;
        let name = NAMES[rng.below(3) as usize];
        let path = mounts[m].path(name);
        let ctx = format!("seed {seed:#x} step {step} mount {m} {name}");
        match rng.below(11) {
            0 | 1 => {
                let (off, len) = (rng.below(MAX), 1 + rng.below(70_000) as usize);
                let data = vec![(step % 251) as u8 + 1; len];
                let f = OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&path);
                f.unwrap().write_all_at(&data, off).unwrap();
                let ino = *at.entry(name).or_insert_with(|| {
                    files.push(Vec::new());
                    files.len() - 1
                });
                let c = &mut files[ino];
                c.resize(c.len().max(off as usize + len), 0);
                c[off as usize..off as usize + len].copy_from_slice(&data);
            }
            2 => {
                let Some(&ino) = at.get(name) else { continue };
                let size = rng.below(MAX);
                let f = OpenOptions::new().write(true).open(&path).unwrap();
                f.set_len(size).unwrap();
                files[ino].resize(size as usize, 0);
            }
            3 => {
                let got = fs::read(&path).ok();
                let want = at.get(name).map(|&i| &files[i]);
                assert!(got.as_ref() == want, "{ctx}: contents differ");
            }
            4 => {
                if at.remove(name).is_some() {
                    fs::remove_file(&path).unwrap();
                }
            }
            5 => {
                let to = NAMES[rng.below(3) as usize];
                if let Some(ino) = at.remove(name) {
                    fs::rename(&path, mounts[m].path(to)).unwrap();
                    at.insert(to, ino);
                }
            }
            6 => {
                if let (Some(&ino), true) = (at.get(name), held.len() < 4) {
                    let f = OpenOptions::new().write(true).open(&path).unwrap();
                    held.push((m, ino, f));
                } else if !held.is_empty() {
                    held.remove(rng.below(held.len() as u64) as usize);
                }
            }
            7 => {
                let got = fs::metadata(&path).ok().map(|md| md.len());
                let want = at.get(name).map(|&i| files[i].len() as u64);
                assert_eq!(got, want, "{ctx}: stat");
            }
            8 => {
                if held.is_empty() {
                    continue;
                }
                let (hm, ino, f) = &held[rng.below(held.len() as u64) as usize];
                let len = f.metadata().unwrap().len();
                assert_eq!(len, files[*ino].len() as u64, "{ctx}: fstat on mount {hm}");
            }
            _ => {
                // A write through a descriptor opened steps ago, maybe on another mount,
                // maybe of a file since truncated, renamed or unlinked; committed at once.
                if held.is_empty() {
                    continue;
                }
                let (hm, ino, f) = &held[rng.below(held.len() as u64) as usize];
                let (off, len) = (rng.below(MAX), 1 + rng.below(70_000) as usize);
                let data = vec![(step % 251) as u8 + 1; len];
                f.write_all_at(&data, off)
                    .unwrap_or_else(|e| panic!("{ctx}: held write on mount {hm}: {e}"));
                f.sync_all().unwrap();
                let c = &mut files[*ino];
                c.resize(c.len().max(off as usize + len), 0);
                c[off as usize..off as usize + len].copy_from_slice(&data);
            }
        }
    }
    drop(held);
    for name in NAMES {
        for (m, mount) in mounts.iter().enumerate() {
            let got = fs::read(mount.path(name)).ok();
            let want = at.get(name).map(|&i| &files[i]);
            assert!(got.as_ref() == want, "end: mount {m} {name}");
        }
    }
}
