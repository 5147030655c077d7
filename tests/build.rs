//! Embeds vmm-core's sources and the README in the `architecture` test, so that the test checks
//! the module graph without opening a file at run time (the test executables also run on a
//! machine that has no source tree).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::{env, fs};

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest
        .parent()
        .expect("the crate sits in the workspace root");
    let src = root.join("vmm-core/src");
    let readme = root.join("README.md");
    println!("cargo:rerun-if-changed={}", src.display());
    println!("cargo:rerun-if-changed={}", readme.display());

    let mut files = Vec::new();
    collect(&src, &mut files);
    files.sort();
    let mut out = String::from("/// vmm-core's source files: (path under src/, contents).\n");
    out.push_str("pub static SOURCES: &[(&str, &str)] = &[\n");
    for file in &files {
        let relative = file.strip_prefix(&src).expect("collected under src");
        let relative = relative.to_str().expect("source paths are UTF-8");
        writeln!(
            out,
            "    ({relative:?}, include_str!({:?})),",
            file.display().to_string()
        )
        .expect("writing to a String");
    }
    out.push_str("];\n/// The workspace README.\n");
    writeln!(
        out,
        "pub static README: &str = include_str!({:?});",
        readme.display().to_string()
    )
    .expect("writing to a String");
    let dest = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo")).join("sources.rs");
    fs::write(dest, out).expect("OUT_DIR is writable");
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("vmm-core/src is readable") {
        let path = entry.expect("a readable directory entry").path();
        if path.is_dir() {
            collect(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}
