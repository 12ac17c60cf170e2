//! Terminal output: progress bars and human-readable sizes.
//!
//! On a terminal a bar is redrawn in place. Written into a log file (stderr not a terminal) it
//! is a plain line every `RAMJET_PROGRESS_S` seconds (default 5) instead: redraws joined by
//! carriage returns are unreadable in a log.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// One progress line for a log: `pack: 12.0 MiB/48.0 MiB (25%), 6.0 MiB/s, 2 s`.
pub fn progress_line(msg: &str, pos: u64, len: Option<u64>, elapsed: Duration, bytes: bool) -> String {
    let secs = elapsed.as_secs_f64().max(1e-9);
    let show = |n: u64| if bytes { human_bytes(n) } else { n.to_string() };
    let of = match len {
        Some(l) if l > 0 => format!("/{} ({:.0}%)", show(l), 100.0 * pos as f64 / l as f64),
        _ => String::new(),
    };
    let rate = (pos as f64 / secs) as u64;
    format!(
        "{msg}: {}{of}, {}/s, {:.0} s",
        show(pos),
        show(rate),
        elapsed.as_secs_f64()
    )
}

/// Where stderr is no terminal, hides `pb` and prints [`progress_line`]s on a thread of its own
/// until the bar is finished or dropped.
fn logged(pb: ProgressBar, msg: &'static str, bytes: bool) -> ProgressBar {
    if std::io::stderr().is_terminal() {
        return pb;
    }
    pb.set_draw_target(ProgressDrawTarget::hidden());
    let every = std::env::var("RAMJET_PROGRESS_S")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(Duration::from_secs(5));
    let weak = pb.downgrade();
    let t0 = Instant::now();
    let _ = std::thread::Builder::new()
        .name("ramjet-progress".into())
        .spawn(move || {
            let mut next = t0 + every;
            loop {
                std::thread::sleep(Duration::from_millis(50).min(every));
                let Some(pb) = weak.upgrade() else { return };
                if pb.is_finished() {
                    return;
                }
                if Instant::now() >= next {
                    next += every;
                    // The bar's message as it is now (pack's names the task and counts objects).
                    let m = pb.message();
                    let m = if m.is_empty() { msg.to_owned() } else { m };
                    eprintln!("{}", progress_line(&m, pb.position(), pb.length(), t0.elapsed(), bytes));
                }
            }
        });
    pb
}

/// A byte-counting progress bar with rate and ETA, drawn on stderr when it is a terminal, a
/// line every few seconds otherwise.
pub fn bytes_bar(msg: &'static str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template("{msg:>8} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(msg);
    logged(pb, msg, true)
}

/// A counting progress bar with rate and ETA (a line every few seconds where stderr is no
/// terminal).
pub fn count_bar(msg: &'static str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template("{msg:>8} [{bar:30}] {pos}/{len} {per_sec} ETA {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(msg);
    logged(pb, msg, false)
}

/// `1536` → `1.5 KiB`.
pub fn human_bytes(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// Parses `64MiB`, `64M`, `1.5GB`, `4096` (the engine's one parser of byte counts).
pub use ramjet_engine::size::parse as parse_size;

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn a_log_line_says_how_far_how_fast_and_how_long() {
        let l = progress_line("pack", 12 << 20, Some(48 << 20), Duration::from_secs(2), true);
        assert_eq!(l, "pack: 12.0 MiB/48.0 MiB (25%), 6.0 MiB/s, 2 s");
        let l = progress_line("synth", 30, None, Duration::from_millis(1500), false);
        assert_eq!(l, "synth: 30, 20/s, 2 s");
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1.5k").unwrap(), 1536);
        assert!(parse_size("12 parsecs").is_err());
        let e = parse_size("99999999999999999999GiB").unwrap_err();
        assert!(e.contains("more bytes than a 64-bit count holds"), "{e}");
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }
}
