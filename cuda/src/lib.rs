//! GPU support for ramjet, loaded at run time so that nothing links against CUDA.
//!
//! The foundation release only detects whether a CUDA driver is present; the CUDA issue adds
//! pinned host memory, async copies and nvJPEG. The engine reaches the GPU through a small
//! trait, so it builds and tests without this crate's features.
#![deny(missing_docs)]

/// Whether the CUDA driver library can be loaded in this process.
pub fn driver_present() -> bool {
    ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
        // SAFETY: loading libcuda runs its initialisers, which have no preconditions; the
        // handle is dropped at once and no symbol from it is called.
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn detection_does_not_panic_without_a_gpu() {
        // CI has no GPU; the call must simply answer.
        let present = super::driver_present();
        println!("cuda driver present: {present}");
    }
}
