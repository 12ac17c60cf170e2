//! Ports for the daemons a test starts, free of the bind-then-release race.
//!
//! A port found by binding port 0 and closing the socket can be taken before the daemon binds
//! it: by another test's daemon, or by any outgoing connection, which the kernel gives a local
//! port from the same ephemeral range. Under `tools/test.sh` a run owns a band of ports below
//! that range (`RAMJET_TEST_PORTS=LO-HI`, set by `tools/env.sh` from the run's S3 port, so two
//! runs on one machine have disjoint bands), and each port handed out is claimed by a file in
//! the run's temporary root that names the claiming process: no other test process of the run
//! is given it while that process lives, and no connection ever takes it. The Python tests
//! (`bindings/tests/ports.py`) claim from the same band the same way.

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};

/// The run's band of ports, from `RAMJET_TEST_PORTS` (`LO-HI`, inclusive), when set and sane.
fn band() -> Option<(u16, u16)> {
    let v = std::env::var("RAMJET_TEST_PORTS").ok()?;
    let (lo, hi) = v.split_once('-')?;
    let (lo, hi) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
    (lo > 1024 && lo <= hi).then_some((lo, hi))
}

/// The folder of the run's port claims.
fn claims() -> PathBuf {
    std::env::temp_dir().join("ramjet-ports")
}

/// Whether the process that wrote the claim at `path` is still alive (an unreadable or
/// malformed claim counts as alive: it is never taken over).
fn claimer_alive(path: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(path) else {
        return true;
    };
    match text.trim().parse::<u32>() {
        Ok(pid) => Path::new(&format!("/proc/{pid}")).exists(),
        Err(_) => true,
    }
}

/// Claims `port` for this process: a new claim file, or one whose process has ended.
fn claim(dir: &Path, port: u16) -> bool {
    let path = dir.join(port.to_string());
    let me = std::process::id().to_string();
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
        Ok(mut f) => f.write_all(me.as_bytes()).is_ok(),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && !claimer_alive(&path) => {
            // Taken over by rename, so two processes reclaiming the same stale port cannot
            // both win: the one whose file is there afterwards holds it.
            let mine = dir.join(format!(".{port}.{me}"));
            std::fs::write(&mine, &me).is_ok()
                && std::fs::rename(&mine, &path).is_ok()
                && std::fs::read_to_string(&path).is_ok_and(|t| t == me)
        }
        Err(_) => false,
    }
}

/// A TCP port free on `ip` for a daemon to bind: from the run's band, claimed for this process
/// (see the module's text); outside `tools/test.sh` (no band), one the kernel finds free now.
pub fn free_port(ip: &str) -> u16 {
    let Some((lo, hi)) = band() else {
        return TcpListener::bind((ip, 0))
            .expect("bind")
            .local_addr()
            .expect("local addr")
            .port();
    };
    let dir = claims();
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("port claims folder {}: {e}", dir.display()));
    let span = u32::from(hi - lo) + 1;
    // Start where this process's id points, so parallel test processes rarely meet.
    let start = std::process::id() % span;
    for i in 0..span {
        let port = lo + ((start + i) % span) as u16;
        if TcpListener::bind((ip, port)).is_ok() && claim(&dir, port) {
            return port;
        }
    }
    panic!("every port of the run's band {lo}-{hi} (RAMJET_TEST_PORTS) is claimed or bound on {ip}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claimed_port_is_not_claimed_again_until_its_process_ends() {
        let dir = tempfile::tempdir().unwrap();
        assert!(claim(dir.path(), 40001));
        assert!(!claim(dir.path(), 40001), "a live claim was taken over");
        // A claim whose process has ended (no such pid) is taken over.
        std::fs::write(dir.path().join("40002"), "4194999").unwrap();
        assert!(claim(dir.path(), 40002));
        assert_eq!(
            std::fs::read_to_string(dir.path().join("40002")).unwrap(),
            std::process::id().to_string()
        );
    }
}
