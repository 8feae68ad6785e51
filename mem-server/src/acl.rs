//! POSIX access control lists (acl(5)) as Linux keeps them, in the `system.posix_acl_access`
//! and `system.posix_acl_default` extended attributes: read and checked as the kernel reads
//! them (a version-2 header, then sorted 8-byte entries), evaluated as its permission check
//! evaluates them, kept in step with the mode bits (the owner, mask and other entries are the
//! mode's three classes), and inherited by what is made in a directory with a default ACL.

use rfs_proto::types::{Caller, FileAccess};
use rfs_proto::Errno;

const VERSION: u32 = 2;
const HEADER: usize = 4;
const ENTRY: usize = 8;
/// The largest ACL a FUSE kernel reads or hands over (a page: 511 entries); a larger one, set
/// by a client that went around its kernel, would fail every honest mount's checks.
pub const MAX_BYTES: usize = 4096;
/// The id the kernel writes in entries that name no one.
const NO_ID: u32 = u32::MAX;

/// Whose permissions an entry gives. The order is the kernel's: entries are sorted by tag, then
/// by id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tag {
    UserObj,
    User(u32),
    GroupObj,
    Group(u32),
    Mask,
    Other,
}

impl Tag {
    fn code(self) -> (u16, u32) {
        match self {
            Tag::UserObj => (0x01, NO_ID),
            Tag::User(id) => (0x02, id),
            Tag::GroupObj => (0x04, NO_ID),
            Tag::Group(id) => (0x08, id),
            Tag::Mask => (0x10, NO_ID),
            Tag::Other => (0x20, NO_ID),
        }
    }

    fn from_code(tag: u16, id: u32) -> Option<Tag> {
        Some(match tag {
            0x01 => Tag::UserObj,
            0x02 => Tag::User(id),
            0x04 => Tag::GroupObj,
            0x08 => Tag::Group(id),
            0x10 => Tag::Mask,
            0x20 => Tag::Other,
            _ => return None,
        })
    }
}

/// One entry: a tag and its read (4), write (2) and execute (1) bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub tag: Tag,
    pub perm: u16,
}

/// A valid ACL: sorted, one owner, owning-group and other entry, a mask if it names anyone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acl(Vec<Entry>);

impl Acl {
    /// The ACL in `bytes`, as setxattr(2) hands it over; None for one without entries (which
    /// removes the ACL, as on Linux). EINVAL for anything the kernel would refuse, E2BIG past
    /// [`MAX_BYTES`].
    pub fn parse(bytes: &[u8]) -> Result<Option<Acl>, Errno> {
        if bytes.len() > MAX_BYTES {
            return Err(Errno::E2BIG);
        }
        let header = bytes.get(..HEADER).ok_or(Errno::EINVAL)?;
        let version = u32::from_le_bytes(header.try_into().expect("four bytes"));
        let body = &bytes[HEADER..];
        if version != VERSION || !body.len().is_multiple_of(ENTRY) {
            return Err(Errno::EINVAL);
        }
        if body.is_empty() {
            return Ok(None);
        }
        let mut entries = Vec::with_capacity(body.len() / ENTRY);
        for e in body.chunks_exact(ENTRY) {
            let tag = u16::from_le_bytes([e[0], e[1]]);
            let perm = u16::from_le_bytes([e[2], e[3]]);
            let id = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
            let tag = Tag::from_code(tag, id).ok_or(Errno::EINVAL)?;
            // The kernel takes the id that names no one for an invalid user or group.
            let named_no_one = matches!(tag, Tag::User(NO_ID) | Tag::Group(NO_ID));
            if perm & !0o7 != 0 || named_no_one {
                return Err(Errno::EINVAL);
            }
            entries.push(Entry { tag, perm });
        }
        Acl::valid(entries).map(Some)
    }

    /// The ACL of `entries`, if they make a valid one (EINVAL otherwise): strictly sorted (so
    /// no one is named twice), with exactly one owner, owning-group and other entry, and a mask
    /// if any user or group is named.
    fn valid(entries: Vec<Entry>) -> Result<Acl, Errno> {
        let sorted = entries.windows(2).all(|w| w[0].tag < w[1].tag);
        let count = |t: fn(&Tag) -> bool| entries.iter().filter(|e| t(&e.tag)).count();
        let named = count(|t| matches!(t, Tag::User(_) | Tag::Group(_)));
        let ok = sorted
            && count(|t| *t == Tag::UserObj) == 1
            && count(|t| *t == Tag::GroupObj) == 1
            && count(|t| *t == Tag::Other) == 1
            && (named == 0 || count(|t| *t == Tag::Mask) == 1);
        if ok {
            Ok(Acl(entries))
        } else {
            Err(Errno::EINVAL)
        }
    }

    /// The ACL as the attribute holds it.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + ENTRY * self.0.len());
        out.extend_from_slice(&VERSION.to_le_bytes());
        for e in &self.0 {
            let (tag, id) = e.tag.code();
            out.extend_from_slice(&tag.to_le_bytes());
            out.extend_from_slice(&e.perm.to_le_bytes());
            out.extend_from_slice(&id.to_le_bytes());
        }
        out
    }

    pub fn entries(&self) -> &[Entry] {
        &self.0
    }

    fn perm_of(&self, tag: Tag) -> Option<u16> {
        self.0.iter().find(|e| e.tag == tag).map(|e| e.perm)
    }

    /// Whether the ACL says no more than mode bits can: no one named, no mask. Such an ACL is
    /// not kept; the mode bits say it all.
    pub fn is_minimal(&self) -> bool {
        self.0.len() == 3
    }

    /// The permission bits (the low nine of a mode) the ACL gives its three classes: the
    /// owner's entry, the mask (or the owning group's entry without one), the others' entry.
    pub fn mode_bits(&self) -> u16 {
        let of = |t| self.perm_of(t).unwrap_or(0);
        let group = self.perm_of(Tag::Mask).unwrap_or_else(|| of(Tag::GroupObj));
        of(Tag::UserObj) << 6 | group << 3 | of(Tag::Other)
    }

    /// Whether `c` may have `want` on a file owned by `uid`:`gid` with this ACL, as the kernel
    /// decides (posix_acl_permission): the owner's entry for the owner; a named user's entry
    /// under the mask; else every group entry the caller is in, one of which must grant all of
    /// `want` (under the mask); the others' entry only for someone in none of them.
    pub fn permits(&self, (uid, gid): (u32, u32), c: &Caller, want: FileAccess) -> bool {
        let want = want.bits() as u16;
        let grants = |perm: u16| perm & want == want;
        let masked = |perm: u16| grants(perm & self.perm_of(Tag::Mask).unwrap_or(0o7));
        let in_group = |g: u32| c.gid == g || c.groups.contains(&g);
        let mut in_some_group = false;
        for e in &self.0 {
            match e.tag {
                Tag::UserObj if c.uid == uid => return grants(e.perm),
                Tag::User(id) if c.uid == id => return masked(e.perm),
                Tag::GroupObj | Tag::Group(_) => {
                    let g = match e.tag {
                        Tag::Group(id) => id,
                        _ => gid,
                    };
                    if in_group(g) {
                        if grants(e.perm) {
                            return masked(e.perm);
                        }
                        in_some_group = true;
                    }
                }
                Tag::Other => return !in_some_group && grants(e.perm),
                _ => {}
            }
        }
        false
    }

    /// The ACL after a chmod to `mode` (posix_acl_chmod): the owner's and others' entries take
    /// their classes' bits, and the mask (or the owning group's entry without one) the group's.
    pub fn chmod(&mut self, mode: u16) {
        let has_mask = self.perm_of(Tag::Mask).is_some();
        for e in &mut self.0 {
            match e.tag {
                Tag::UserObj => e.perm = (mode >> 6) & 7,
                Tag::Mask => e.perm = (mode >> 3) & 7,
                Tag::GroupObj if !has_mask => e.perm = (mode >> 3) & 7,
                Tag::Other => e.perm = mode & 7,
                _ => {}
            }
        }
    }

    /// What a node made with `mode` in a directory with this default ACL gets
    /// (posix_acl_create): its mode, the bits the ACL does not grant taken out, and its access
    /// ACL, the default one with the bits `mode` does not grant taken out (None if the mode
    /// bits then say it all).
    pub fn inherit(&self, mode: u16) -> (u16, Option<Acl>) {
        let mut acl = self.clone();
        let mut bits = mode & 0o777;
        let has_mask = acl.perm_of(Tag::Mask).is_some();
        for e in &mut acl.0 {
            let shift = match e.tag {
                Tag::UserObj => 6,
                Tag::Mask => 3,
                Tag::GroupObj if !has_mask => 3,
                Tag::Other => 0,
                _ => continue,
            };
            e.perm &= (bits >> shift) & 7;
            bits &= !(0o7 << shift) | (e.perm << shift);
        }
        let mode = (mode & !0o777) | bits;
        (mode, (!acl.is_minimal()).then_some(acl))
    }
}

/// The ACL written as setfacl(1) takes it, short form ("u::rw-,u:2000:r--,g::r--,m::r--,o::---"),
/// for tests.
#[cfg(test)]
pub(crate) fn from_text(text: &str) -> Acl {
    let entries = text.split(',').map(|e| {
        let mut parts = e.split(':');
        let (kind, id, rwx) = (parts.next(), parts.next(), parts.next());
        let id = id.filter(|i| !i.is_empty()).map(|i| i.parse().unwrap());
        let tag = match (kind, id) {
            (Some("u"), None) => Tag::UserObj,
            (Some("u"), Some(id)) => Tag::User(id),
            (Some("g"), None) => Tag::GroupObj,
            (Some("g"), Some(id)) => Tag::Group(id),
            (Some("m"), None) => Tag::Mask,
            (Some("o"), None) => Tag::Other,
            _ => panic!("not an entry: {e}"),
        };
        let rwx = rwx.unwrap().as_bytes();
        let perm =
            (rwx[0] == b'r') as u16 * 4 + (rwx[1] == b'w') as u16 * 2 + (rwx[2] == b'x') as u16;
        Entry { tag, perm }
    });
    Acl::valid(entries.collect()).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(entries: &[(Tag, u16)]) -> Acl {
        let entries = entries.iter().map(|&(tag, perm)| Entry { tag, perm });
        Acl::valid(entries.collect()).unwrap()
    }

    fn who(uid: u32, gid: u32, groups: &[u32]) -> Caller {
        Caller {
            uid,
            gid,
            groups: groups.to_vec(),
        }
    }

    const R: FileAccess = FileAccess::READ;
    const W: FileAccess = FileAccess::WRITE;

    /// user::rw-, user:2000:rw-, group::r--, group:300:rwx, mask::r-x... as getfacl shows it.
    fn shared() -> Acl {
        acl(&[
            (Tag::UserObj, 6),
            (Tag::User(2000), 6),
            (Tag::GroupObj, 4),
            (Tag::Group(300), 7),
            (Tag::Mask, 5),
            (Tag::Other, 0),
        ])
    }

    #[test]
    fn bytes_round_trip_in_the_kernels_layout() {
        let a = shared();
        let bytes = a.to_bytes();
        assert_eq!(bytes.len(), 4 + 6 * 8);
        assert_eq!(&bytes[..4], &[2, 0, 0, 0]);
        // The named user's entry: tag 2, perm 6, id 2000.
        assert_eq!(&bytes[12..20], &[2, 0, 6, 0, 0xd0, 0x07, 0, 0]);
        assert_eq!(Acl::parse(&bytes), Ok(Some(a)));
        assert_eq!(Acl::parse(&[2, 0, 0, 0]), Ok(None), "no entries: no ACL");
    }

    #[test]
    fn what_the_kernel_refuses_is_refused() {
        let good = shared().to_bytes();
        let mut bad = vec![
            Vec::new(),
            good[..3].to_vec(),
            good[..good.len() - 1].to_vec(),
        ];
        let mut version = good.clone();
        version[0] = 1;
        bad.push(version);
        let mut tag = good.clone();
        tag[4] = 0x40;
        bad.push(tag);
        let mut perm = good.clone();
        perm[6] = 8;
        bad.push(perm);
        // The named user's id: the one that names no one.
        let mut no_one = good.clone();
        no_one[16..20].copy_from_slice(&NO_ID.to_le_bytes());
        bad.push(no_one);
        // Out of order: the other entry first.
        let mut order = good[..4].to_vec();
        order.extend_from_slice(&good[good.len() - 8..]);
        order.extend_from_slice(&good[4..good.len() - 8]);
        bad.push(order);
        for b in &bad {
            assert_eq!(Acl::parse(b), Err(Errno::EINVAL), "{b:?}");
        }
        let many = |n: u32| {
            let mut entries = vec![Entry {
                tag: Tag::UserObj,
                perm: 6,
            }];
            entries.extend((0..n).map(|id| Entry {
                tag: Tag::User(id),
                perm: 4,
            }));
            for tag in [Tag::GroupObj, Tag::Mask, Tag::Other] {
                entries.push(Entry { tag, perm: 4 });
            }
            Acl(entries).to_bytes()
        };
        assert!(many(507).len() <= MAX_BYTES && many(508).len() > MAX_BYTES);
        assert!(
            Acl::parse(&many(507)).unwrap().is_some(),
            "511 entries: a page"
        );
        assert_eq!(Acl::parse(&many(508)), Err(Errno::E2BIG));
        let entries = |e: &[(Tag, u16)]| e.iter().map(|&(tag, perm)| Entry { tag, perm }).collect();
        let twice = entries(&[
            (Tag::UserObj, 6),
            (Tag::User(5), 6),
            (Tag::User(5), 4),
            (Tag::GroupObj, 4),
            (Tag::Mask, 6),
            (Tag::Other, 0),
        ]);
        assert!(Acl::valid(twice).is_err(), "a user named twice");
        let maskless = entries(&[
            (Tag::UserObj, 6),
            (Tag::User(5), 6),
            (Tag::GroupObj, 4),
            (Tag::Other, 0),
        ]);
        assert!(Acl::valid(maskless).is_err(), "a named user needs a mask");
        let no_other = entries(&[(Tag::UserObj, 6), (Tag::GroupObj, 4)]);
        assert!(Acl::valid(no_other).is_err());
    }

    #[test]
    fn entries_decide_as_the_kernel_decides() {
        let a = shared();
        let owner = (1000, 100);
        assert!(a.permits(owner, &who(1000, 1, &[]), R | W), "the owner");
        assert!(a.permits(owner, &who(2000, 1, &[]), R), "a named user");
        assert!(!a.permits(owner, &who(2000, 1, &[]), W), "under the mask");
        assert!(
            a.permits(owner, &who(3000, 100, &[]), R),
            "the owning group"
        );
        assert!(!a.permits(owner, &who(3000, 100, &[]), W));
        assert!(
            a.permits(owner, &who(3000, 1, &[300]), FileAccess::EXEC),
            "a named group, through the mask"
        );
        assert!(!a.permits(owner, &who(3000, 1, &[300]), W), "masked");
        assert!(!a.permits(owner, &who(3000, 1, &[]), R), "others: nothing");
        // In a group whose entry does not grant it: not the others' entry either.
        let open_other = acl(&[
            (Tag::UserObj, 6),
            (Tag::GroupObj, 0),
            (Tag::Group(300), 0),
            (Tag::Mask, 7),
            (Tag::Other, 4),
        ]);
        assert!(!open_other.permits(owner, &who(3000, 100, &[]), R));
        assert!(!open_other.permits(owner, &who(3000, 1, &[300]), R));
        assert!(open_other.permits(owner, &who(3000, 1, &[]), R));
        // Any one group entry that grants all of it is enough.
        let split = acl(&[
            (Tag::UserObj, 6),
            (Tag::GroupObj, 4),
            (Tag::Group(300), 2),
            (Tag::Mask, 7),
            (Tag::Other, 0),
        ]);
        assert!(split.permits(owner, &who(3000, 100, &[300]), W));
        assert!(!split.permits(owner, &who(3000, 100, &[300]), R | W));
    }

    #[test]
    fn chmod_moves_the_mask_and_the_mode_bits_follow_the_acl() {
        let mut a = shared();
        assert_eq!(a.mode_bits(), 0o650);
        a.chmod(0o741);
        assert_eq!(a.mode_bits(), 0o741);
        assert_eq!(
            a.perm_of(Tag::GroupObj),
            Some(4),
            "the mask moved, not this"
        );
        assert_eq!(a.perm_of(Tag::User(2000)), Some(6));
        let mut minimal = acl(&[(Tag::UserObj, 6), (Tag::GroupObj, 4), (Tag::Other, 4)]);
        assert!(minimal.is_minimal());
        minimal.chmod(0o700);
        assert_eq!(minimal.mode_bits(), 0o700);
    }

    #[test]
    fn what_is_made_under_a_default_acl_gets_it_masked_by_its_mode() {
        let d = shared();
        // A file made 0666: the owner keeps rw, the mask r-x loses x to the mode's group bits.
        let (mode, access) = d.inherit(0o100666);
        assert_eq!(mode, 0o100640);
        let access = access.expect("names a user: kept");
        assert_eq!(access.perm_of(Tag::Mask), Some(4));
        assert_eq!(
            access.perm_of(Tag::User(2000)),
            Some(6),
            "named entries stay"
        );
        assert_eq!(access.mode_bits(), 0o640);
        // A directory made 0777 keeps all the ACL gives.
        let (mode, _) = d.inherit(0o40777);
        assert_eq!(mode, 0o40650);
        let minimal = acl(&[(Tag::UserObj, 7), (Tag::GroupObj, 5), (Tag::Other, 0)]);
        assert_eq!(
            minimal.inherit(0o100666),
            (0o100640, None),
            "the mode says it all"
        );
    }
}
