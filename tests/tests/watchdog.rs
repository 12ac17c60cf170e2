//! The planted hang that proves the Rust tests' watchdog (tools/test-watchdog.sh): a test that
//! never ends. It is ignored in normal runs; tools/test.sh runs it alone under a short limit and
//! checks that it fails, naming itself, with the stacks of its threads, while the test beside it
//! passes.

use std::time::Duration;

#[inline(never)]
fn planted_hang_waits_forever() {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

#[test]
#[ignore = "a planted hang: tools/test.sh runs it alone to prove the watchdog stops it"]
fn a_planted_hang_fails_alone_naming_itself() {
    let helper = std::thread::Builder::new()
        .name("planted-helper".into())
        .spawn(planted_hang_waits_forever)
        .unwrap();
    planted_hang_waits_forever();
    helper.join().unwrap();
}

#[test]
#[ignore = "runs beside the planted hang: it must pass while the hang fails"]
fn the_test_beside_the_planted_hang_still_passes() {
    assert_eq!(2 + 2, 4);
}
