//! GPU helpers for the GPU tests: device UUIDs as role arguments, a pattern that differs per
//! generation, chunk and byte, publishing a GPU region and checking one attached.
#![allow(dead_code)]

use vmm_core::cuda::Device;
use vmm_memd::protocol::{Backend, Dtype, TensorMeta};
use vmm_memd::{Attached, BeginOptions, Client, GpuChunks};

/// The UUID of device `ordinal`, as hex.
pub fn uuid_hex(ordinal: usize) -> String {
    let device = Device::new(ordinal).expect("the device");
    device.uuid().iter().map(|b| format!("{b:02x}")).collect()
}

/// A UUID from hex.
pub fn parse_uuid(hex: &str) -> [u8; 16] {
    let mut uuid = [0u8; 16];
    for (i, byte) in uuid.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("a hex UUID");
    }
    uuid
}

/// The GPU backend of device `uuid`.
pub fn on(uuid: [u8; 16]) -> BeginOptions {
    BeginOptions {
        backend: Backend::Gpu { uuid },
        ..Default::default()
    }
}

/// The bytes of chunk `chunk` of generation `generation`, `len` of them.
pub fn pattern(generation: u64, chunk: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(31) ^ (generation * 7 + chunk as u64 * 13)) as u8)
        .collect()
}

/// Publish one generation of GPU region `region` on device `uuid`: `chunks` chunks of (at
/// least) `size` bytes, each filled with [`pattern`], one tensor `t{i}` per chunk. Returns
/// the generation.
pub fn publish_gpu(client: &Client, region: &str, uuid: [u8; 16], chunks: usize, size: u64) -> u64 {
    let mut writer = client
        .begin(region, &vec![size; chunks], on(uuid))
        .expect("begin on the GPU");
    let generation = writer.generation();
    let gpu = writer.gpu().expect("a GPU writer");
    assert!(!gpu.is_read_only());
    assert_eq!(gpu.device_uuid(), uuid);
    let sizes = gpu.chunk_sizes().to_vec();
    for (i, &len) in sizes.iter().enumerate() {
        let offset = gpu.chunk_offset(i).unwrap() as usize;
        gpu.buffer()
            .write_at(offset, &pattern(generation, i, len as usize))
            .expect("fill a chunk");
    }
    for (i, &len) in sizes.iter().enumerate() {
        writer.put(
            &format!("t{i}"),
            TensorMeta {
                chunk: i as u32,
                offset: 0,
                len,
                dtype: Dtype::U8,
                shape: vec![len],
            },
        );
    }
    writer.commit().expect("commit")
}

/// Whether every chunk of `gpu` holds [`pattern`] of `generation`.
pub fn holds_pattern(gpu: &GpuChunks, generation: u64) -> bool {
    gpu.chunk_sizes().iter().enumerate().all(|(i, &len)| {
        let mut bytes = vec![0u8; len as usize];
        let offset = gpu.chunk_offset(i).unwrap() as usize;
        gpu.buffer()
            .read_at(offset, &mut bytes)
            .expect("read a chunk");
        bytes == pattern(generation, i, len as usize)
    })
}

/// Whether every byte of `gpu`'s mapping is zero (a generation made again after a discard).
pub fn zeroed(gpu: &GpuChunks) -> bool {
    let mut bytes = vec![1u8; gpu.buffer().size()];
    gpu.buffer()
        .read_at(0, &mut bytes)
        .expect("read the chunks");
    bytes.iter().all(|&b| b == 0)
}

/// Whether `attached` is a GPU generation mapped read-only holding its [`pattern`].
pub fn attached_intact(attached: &Attached) -> bool {
    let gpu = attached.gpu.as_ref().expect("a GPU region");
    gpu.is_read_only() && holds_pattern(gpu, attached.generation)
}
