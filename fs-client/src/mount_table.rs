//! Which mount is on top of a directory, from `/proc/self/mountinfo`: a daemon unmounts its
//! mount point by path only while the mount there is still its own, never one made on the same
//! directory after its own went (a remount, a file system under it, one made after `umount -l`).

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The id of the mount on top of `dir` (the kernel's mount id: never the same for two mounts
/// that exist at once), if anything is mounted there.
pub fn top_mount_id(dir: &Path) -> Option<u64> {
    top_mount(dir).map(|(id, _)| id)
}

/// The file system type of the mount on top of `dir` (`fuse.rfs` for ours), if any.
pub fn top_mount_type(dir: &Path) -> Option<String> {
    top_mount(dir).map(|(_, fs_type)| fs_type)
}

fn top_mount(dir: &Path) -> Option<(u64, String)> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    top_in(&table, dir.as_os_str().as_bytes())
}

/// [`top_mount_id`] in a mountinfo `table`: of the mounts on `dir`, the one no other is
/// mounted on (stacked mounts name the one below as their parent; the table's order is that
/// of the mount ids, which a mount moved onto the directory does not follow).
fn top_in(table: &str, dir: &[u8]) -> Option<(u64, String)> {
    let on_dir: Vec<(u64, u64, &str)> = table
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let id = fields.next()?.parse().ok()?;
            let parent = fields.next()?.parse().ok()?;
            let point = fields.nth(2)?;
            // Optional fields end at "-", which the type follows.
            let fs_type = fields.skip_while(|f| *f != "-").nth(1)?;
            (unescape(point) == dir).then_some((id, parent, fs_type))
        })
        .collect();
    on_dir
        .iter()
        .find(|(id, _, _)| !on_dir.iter().any(|(_, parent, _)| parent == id))
        .map(|&(id, _, fs_type)| (id, fs_type.to_string()))
}

/// A mountinfo path: the kernel writes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .map(|d| d.iter().fold(0u32, |n, c| n * 8 + u32::from(c - b'0')));
        match octal {
            Some(n) if n <= 0xff => {
                out.push(n as u8);
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 22 0:35 / /mnt/a\\040b rw,relatime shared:2 - fuse.rfs 127.0.0.1:7470 rw,user_id=0
41 22 0:36 / /mnt/c rw shared:3 - tmpfs tmpfs rw
57 41 0:52 / /mnt/c rw,nosuid shared:4 - fuse.rfs 127.0.0.1:7470 rw,user_id=0
";

    #[test]
    fn the_last_mount_listed_on_a_directory_is_its_top() {
        let top = |dir: &[u8]| top_in(TABLE, dir);
        assert_eq!(top(b"/mnt/c"), Some((57, "fuse.rfs".into())));
        assert_eq!(
            top(b"/mnt/a b"),
            Some((40, "fuse.rfs".into())),
            "escaped space"
        );
        assert_eq!(top(b"/mnt/a\\040b"), None);
        assert_eq!(top(b"/mnt"), None);
        assert_eq!(top(b"/"), Some((22, "ext4".into())));
    }

    #[test]
    fn a_mount_moved_onto_a_directory_is_on_top_whatever_its_id() {
        let table = "\
22 1 0:21 / / rw shared:1 - ext4 /dev/vda rw
30 22 0:40 / /mnt/m rw shared:5 - fuse.rfs 127.0.0.1:7470 rw
61 22 0:52 / /mnt/m rw shared:6 - tmpfs tmpfs rw
";
        // The tmpfs (61) was there first; the rfs mount (30, older) was moved onto it.
        let moved = table.replace("30 22 0:40", "30 61 0:40");
        assert_eq!(top_in(&moved, b"/mnt/m").map(|t| t.0), Some(30));
        // Stacked the other way round.
        let stacked = table.replace("61 22 0:52", "61 30 0:52");
        assert_eq!(top_in(&stacked, b"/mnt/m"), Some((61, "tmpfs".into())));
    }

    #[test]
    fn escapes_are_undone_and_stray_backslashes_kept() {
        assert_eq!(unescape("a\\011b\\134c\\012"), b"a\tb\\c\n");
        assert_eq!(unescape("x\\9y\\"), b"x\\9y\\");
        assert_eq!(unescape("\\777"), b"\\777", "not a byte");
    }

    #[test]
    fn this_process_sees_the_root_mounted() {
        assert!(top_mount_id(Path::new("/")).is_some());
    }
}
