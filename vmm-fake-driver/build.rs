//! Compiles `src/libcuda.rs` on its own into `$OUT_DIR/libcuda.so` (a cdylib: std only, no
//! crates), with the rustc cargo runs this build with, for the target being built. `lib.rs`
//! embeds the result, so a test executable carries its fake driver and opens no path of the
//! build machine.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    const SOURCE: &str = "src/libcuda.rs";
    println!("cargo::rerun-if-changed={SOURCE}");
    println!("cargo::rerun-if-changed=build.rs");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let rustc = std::env::var_os("RUSTC").expect("cargo sets RUSTC for build scripts");
    let target = std::env::var("TARGET").expect("cargo sets TARGET for build scripts");
    let library = out.join("libcuda.so");
    let status = Command::new(rustc)
        .args([
            "--crate-type",
            "cdylib",
            "--crate-name",
            "cuda",
            "--edition",
            "2024",
        ])
        .args([
            "-C",
            "opt-level=1",
            "-C",
            "panic=abort",
            "-C",
            "debuginfo=0",
        ])
        .args(["-C", "strip=debuginfo", "--target", &target, "-o"])
        .arg(&library)
        .arg(SOURCE)
        .status()
        .expect("run rustc for the fake libcuda.so");
    assert!(
        status.success(),
        "rustc failed to build {SOURCE} ({status})"
    );
}
