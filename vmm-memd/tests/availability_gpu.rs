//! The example daemon's two-GPU case, ported to `vmm-memd` (the daemon is retired): weights
//! published on GPU 0 are attached by an engine that sees only GPU 1 (`CUDA_VISIBLE_DEVICES=1`,
//! so the owner's device is one it cannot name): through fabric handles (`AttachFabric`),
//! imported read-only onto its own GPU, with every byte as published.
//!
//! Needs two GPUs with fabric support (an IMEX channel): otherwise one `SKIP` line, and a
//! failure under `VMM_REQUIRE_GPU=1`, as every `two_gpus` test (skip them on a one-GPU machine
//! with `--skip two_gpus`).

mod common;
#[path = "common/gpu.rs"]
mod gpu_common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use common::{ServiceProc, euid, role_args, role_client, say, test_exe};
use gpu_common::{pattern, publish_gpu, uuid_hex};
use vmm_core::cuda::{Device, ResourceOptions, VirtualMemoryResource};
use vmm_core::testing::{cuda_devices, cuda_fabric, skip_unless};

/// Chunk size asked for (the service rounds it up to the granularity).
const SIZE: u64 = 3 << 20;

/// The entry of role processes (does nothing in a plain test run).
#[test]
fn role_entry() {
    let Ok(role) = std::env::var("MEMD_ROLE") else {
        return;
    };
    let args = role_args();
    match role.as_str() {
        // Attach ARGS[0] as fabric handles, import them read-only on this process's device 0,
        // check every byte of generation 1; say whether, and which device it mapped on.
        "fabric-reader" => {
            let client = role_client();
            let attached = client.attach_fabric(&args[0], None).unwrap();
            let device = Device::new(0).unwrap();
            let options = ResourceOptions::default().read_only(true);
            let mapped = VirtualMemoryResource::new(&device, options)
                .unwrap()
                .import_fabric(&attached.descriptor)
                .unwrap();
            let mut offset = 0;
            let mut intact = true;
            for (i, &len) in attached.descriptor.chunk_sizes().iter().enumerate() {
                let mut bytes = vec![0u8; len];
                mapped.read_at(offset, &mut bytes).unwrap();
                intact &= bytes == pattern(attached.generation, i, len);
                offset += len;
            }
            say(&format!(
                "READ {} intact={intact} on={}",
                attached.generation,
                uuid_hex(0)
            ));
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn two_gpus_weights_on_one_gpu_are_attached_by_an_engine_that_sees_only_the_other() {
    let service = ServiceProc::start(&[]);
    if !skip_unless(cuda_devices(2).and_then(|()| cuda_fabric())) {
        return;
    }
    let (owner, other) = (uuid_hex(0), uuid_hex(1));
    let client = service.connect();
    let uuid = *Device::new(0).unwrap().uuid();
    assert_eq!(publish_gpu(&client, "weights", uuid, 2, SIZE), 1);
    // The reader, a fresh exec of this test binary that sees GPU 1 only.
    let mut reader = Command::new(test_exe())
        .args(["--exact", "role_entry", "--nocapture", "--test-threads=1"])
        .arg("-q")
        .env("MEMD_ROLE", "fabric-reader")
        .env("MEMD_SOCKET", &service.socket)
        .env("MEMD_SERVICE_UID", euid().to_string())
        .env("MEMD_ARGS", "weights")
        .env("CUDA_VISIBLE_DEVICES", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let said: Vec<String> = BufReader::new(reader.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| line.strip_prefix("MEMD ").map(str::to_owned))
        .collect();
    assert!(reader.wait().unwrap().success(), "{said:?}");
    assert_eq!(said, [format!("READ 1 intact=true on={other}")]);
    assert_ne!(owner, other);
}
