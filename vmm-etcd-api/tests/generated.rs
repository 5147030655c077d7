//! The committed code in `src/generated` is what prost and tonic make of `proto/` today:
//! regenerate it with `protoc` and fail on any difference.
//!
//! - Where `protoc` cannot be run (none on `PATH`, or `PROTOC` names one that fails, as CI's
//!   `PROTOC=/bin/false` does), or the checkout is not there (the binary was copied to another
//!   machine), it prints one `SKIP` line and passes; `VMM_REQUIRE_PROTOC=1` turns that into a
//!   failure.
//! - `VMM_REGENERATE=1` writes the new code into `src/generated` instead of comparing (after
//!   a change to `proto/` or to the generator's version or settings); review the diff, then
//!   run the test again without it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The generated files, as prost names them after the proto packages.
const FILES: [&str; 3] = ["authpb.rs", "etcdserverpb.rs", "mvccpb.rs"];

/// The .proto files compiled (their imports come along), relative to `proto/`.
const PROTOS: [&str; 1] = ["etcd/api/etcdserverpb/rpc.proto"];

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// Why protoc cannot be used here, or `None` when it runs (prost-build takes `PROTOC`, else
/// `protoc` on `PATH`, and so does this check).
fn protoc_missing() -> Option<String> {
    let protoc = std::env::var_os("PROTOC").unwrap_or_else(|| "protoc".into());
    match Command::new(&protoc).arg("--version").output() {
        Ok(out) if out.status.success() => None,
        Ok(out) => Some(format!(
            "{} --version failed ({})",
            protoc.to_string_lossy(),
            out.status
        )),
        Err(e) => Some(format!(
            "{} cannot be run ({e}); apt-get install protobuf-compiler",
            protoc.to_string_lossy()
        )),
    }
}

/// Generate the code for `PROTOS` into `out`, with the settings the committed code was made
/// with: clients only, no transport (the caller brings a channel), no server.
fn generate(out: &Path) {
    let proto_dir = crate_dir().join("proto");
    let protos: Vec<PathBuf> = PROTOS.iter().map(|p| proto_dir.join(p)).collect();
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .build_transport(false)
        .emit_rerun_if_changed(false)
        .out_dir(out)
        .compile_protos(&protos, &[proto_dir])
        .expect("generate etcd's API with protoc");
}

/// Why the checkout this test compares is not here: a test binary copied to another machine
/// (the GPU runs stage executables alone) has no `proto/` to compile.
fn checkout_missing() -> Option<String> {
    let proto_dir = crate_dir().join("proto");
    (!proto_dir.is_dir()).then(|| format!("no checkout at {}", proto_dir.display()))
}

#[test]
fn committed_code_matches_the_protos() {
    if let Some(why) = protoc_missing().or_else(checkout_missing) {
        if flag("VMM_REQUIRE_PROTOC") {
            panic!("VMM_REQUIRE_PROTOC=1 and the comparison cannot run: {why}");
        }
        eprintln!("SKIP committed_code_matches_the_protos: {why}");
        return;
    }
    let committed = crate_dir().join("src").join("generated");
    if flag("VMM_REGENERATE") {
        generate(&committed);
        eprintln!("regenerated {}", committed.display());
        return;
    }
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vmm-etcd-api-generated");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).expect("a directory for the fresh code");
    generate(&out);
    let mut made: Vec<String> = std::fs::read_dir(&out)
        .expect("list the fresh code")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    made.sort();
    assert_eq!(made, FILES, "the generator now makes other files");
    let mut drifted = Vec::new();
    for file in FILES {
        let fresh = std::fs::read(out.join(file)).expect("read the fresh file");
        let old = std::fs::read(committed.join(file)).unwrap_or_default();
        if fresh != old {
            drifted.push(file);
        }
    }
    assert!(
        drifted.is_empty(),
        "{} in src/generated differ from what proto/ generates now (fresh copies in {}); \
         regenerate with VMM_REGENERATE=1 cargo test -p vmm-etcd-api --test generated, \
         and review the diff",
        drifted.join(", "),
        out.display()
    );
}
