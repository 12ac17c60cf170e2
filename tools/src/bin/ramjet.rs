//! `ramjet`: pack, index, inspect and verify datasets, stream them, run the host daemon;
//! generate the synthetic demo set. The commands live in `ramjet_tools::cli`.

use std::process::ExitCode;

// mimalloc keeps freed memory mapped for reuse: with the system allocator every decoded image's
// buffers were fresh pages, faulted in again image after image (docs/dependencies.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    ramjet_tools::cli::main()
}
