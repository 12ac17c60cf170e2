//! Library behind the `ramjet` command line, shared with the benchmarks and tests.
#![deny(missing_docs)]

pub mod cli;
pub mod index;
pub mod pack;
pub mod plansim;
pub mod synth;
pub mod synth_imagenet;
pub mod ui;
