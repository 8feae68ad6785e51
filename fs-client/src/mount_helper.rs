//! `mount.rfs`: the client answering to the name mount(8) looks for, so that `mount -t rfs
//! HOST:PORT /mnt/rfs -o ...` and an /etc/fstab line work. mount(8) calls
//! `mount.rfs SPEC DIR [-sfnv] [-N NAMESPACE] [-o OPTIONS]`; this turns that into the
//! client's own command line, mounting in the background once the mount is ready.

use crate::options::MountConfig;

/// The name mount(8) runs for `-t rfs`.
pub const HELPER_NAME: &str = "mount.rfs";

/// What mount(8) asked for.
#[derive(Debug, PartialEq, Eq)]
pub enum HelperCall {
    /// Mount: the client's arguments (after the program name).
    Mount(Vec<String>),
    /// `-f`: check the arguments, mount nothing.
    Fake(Vec<String>),
}

/// Turns a helper's arguments (after the program name) into the client's.
pub fn client_args(args: &[String]) -> Result<HelperCall, String> {
    let mut positional = Vec::new();
    let mut options = Vec::new();
    let (mut sloppy, mut fake) = (false, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-o" => options.push(it.next().ok_or("-o needs a list of options")?.clone()),
            "-N" | "--namespace" => {
                return Err("mounting in another namespace (-N) is not supported".into())
            }
            flags if flags.starts_with('-') && flags.len() > 1 => {
                if let Some(list) = flags.strip_prefix("-o") {
                    options.push(list.to_string());
                    continue;
                }
                for f in flags[1..].chars() {
                    match f {
                        's' => sloppy = true,
                        'f' => fake = true,
                        // No mtab to skip writing; verbose: the client says what it did anyway.
                        'n' | 'v' => {}
                        other => return Err(format!("unknown mount helper flag -{other}")),
                    }
                }
            }
            _ => positional.push(a.clone()),
        }
    }
    let [spec, dir] = <[String; 2]>::try_from(positional)
        .map_err(|_| format!("usage: {HELPER_NAME} HOST:PORT DIR [-sfnv] [-o OPTIONS]"))?;
    let mut out = vec![spec, dir, "--daemon".to_string()];
    for list in options {
        // Sloppy (-s): options this client does not know are dropped instead of refused.
        let list = if sloppy {
            list.split(',')
                .filter(|o| MountConfig::knows(o))
                .collect::<Vec<_>>()
                .join(",")
        } else {
            list
        };
        if !list.is_empty() {
            out.extend(["-o".to_string(), list]);
        }
    }
    Ok(if fake {
        HelperCall::Fake(out)
    } else {
        HelperCall::Mount(out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(args: &[&str]) -> Result<HelperCall, String> {
        client_args(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn mount_8_calls_become_a_background_mount() {
        assert_eq!(
            call(&["meta:7470", "/mnt/rfs", "-o", "rw,_netdev,allow_other"]),
            Ok(HelperCall::Mount(strings(&[
                "meta:7470",
                "/mnt/rfs",
                "--daemon",
                "-o",
                "rw,_netdev,allow_other"
            ])))
        );
        assert_eq!(
            call(&["-n", "-v", "meta:7470", "/mnt/rfs", "-orw"]),
            Ok(HelperCall::Mount(strings(&[
                "meta:7470",
                "/mnt/rfs",
                "--daemon",
                "-o",
                "rw"
            ])))
        );
        assert_eq!(
            call(&["meta:7470", "/mnt/rfs", "-fv"]),
            Ok(HelperCall::Fake(strings(&[
                "meta:7470",
                "/mnt/rfs",
                "--daemon"
            ])))
        );
    }

    #[test]
    fn sloppy_drops_unknown_options_only_and_strict_keeps_them_to_be_refused() {
        assert_eq!(
            call(&["m:1", "/d", "-s", "-o", "allow_other,vers=4,qps=x"]),
            Ok(HelperCall::Mount(strings(&[
                "m:1",
                "/d",
                "--daemon",
                "-o",
                "allow_other,qps=x"
            ])))
        );
        let Ok(HelperCall::Mount(strict)) = call(&["m:1", "/d", "-o", "vers=4"]) else {
            panic!("a strict call passes its options on");
        };
        assert!(strict.contains(&"vers=4".to_string()));
    }

    #[test]
    fn bad_calls_say_why() {
        assert!(call(&["m:1"]).unwrap_err().contains("usage"));
        assert!(call(&["m:1", "/d", "extra"]).unwrap_err().contains("usage"));
        assert!(call(&["m:1", "/d", "-o"]).unwrap_err().contains("-o needs"));
        assert!(call(&["m:1", "/d", "-N", "/proc/1/ns/mnt"])
            .unwrap_err()
            .contains("namespace"));
        assert!(call(&["m:1", "/d", "-x"]).unwrap_err().contains("-x"));
        // Sloppy or not, a remount reaches the client, which refuses it.
        let Ok(HelperCall::Mount(args)) = call(&["m:1", "/d", "-s", "-o", "remount,ro"]) else {
            panic!("passed on");
        };
        assert!(args.contains(&"remount,ro".to_string()));
        assert!(MountConfig::default().apply("remount").is_err());
    }
}
