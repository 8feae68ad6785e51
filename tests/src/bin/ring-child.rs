//! A process of the ring tests (tests/tests/ring.rs): does what its first argument says with
//! the file on its stdin and the mount named by its second, and says how it went on stdout.
//!
//!   ring-child register MOUNT   connects a ring and registers the file
//!   ring-child die MOUNT        ...then reads into its buffer and exits with them in flight
//!   ring-child write MOUNT      ...writes 4 KiB at its start through the ring (FILE open to write)

use std::os::fd::AsFd;

use rfs_io::Ring;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, what, mount] = &args[..] else {
        eprintln!("usage: ring-child register|die|write MOUNT < FILE");
        std::process::exit(2);
    };
    let file = std::fs::File::from(std::io::stdin().as_fd().try_clone_to_owned().unwrap());
    match what.as_str() {
        "register" => {
            let outcome = Ring::connect(mount, 1 << 20, 8).and_then(|mut r| r.register(&file));
            println!("{:?}", outcome.map(drop).map_err(|e| e.raw_os_error()));
        }
        "die" => {
            let mut r = Ring::connect(mount, 16 << 20, 16).unwrap();
            let f = r.register(&file).unwrap();
            for i in 0..16u64 {
                r.prep_read(&f, i << 20, 1 << 20, i << 20, i).unwrap();
            }
            r.submit().unwrap();
            println!("submitted");
            // Gone with its requests in flight, its ring and buffer never given back.
            std::process::exit(0);
        }
        "write" => {
            let written = Ring::connect(mount, 1 << 20, 8).and_then(|mut r| {
                let f = r.register(&file)?;
                r.write_at(&f, 0, &[b'r'; 4096])?;
                r.fsync(&f)
            });
            println!("{:?}", written.map_err(|e| e.raw_os_error()));
        }
        other => {
            eprintln!("ring-child: {other}?");
            std::process::exit(2);
        }
    }
}
