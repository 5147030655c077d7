//! The demo's "model": four named tensors in one chunk, each at a 256-byte aligned offset (as
//! `vmm_memd.publish` lays them out in Python), with contents made from a seed so that a
//! reader can check every byte without the writer. `examples/python/memd_demo.py` has the same
//! table and the same [`contents`].

use vmm_memd::protocol::{Dtype, TensorMeta};

/// Where each tensor starts in the chunk: a multiple of this.
pub const ALIGNMENT: u64 = 256;

/// The region the demo publishes unless told otherwise.
pub const DEFAULT_REGION: &str = "demo-weights";

/// The tensors: name, element type, shape.
pub const TENSORS: [(&str, Dtype, &[u64]); 4] = [
    ("embed", Dtype::F32, &[64, 32]),
    ("layers.0.attn.wq", Dtype::BF16, &[32, 32]),
    ("layers.0.attn.wk", Dtype::BF16, &[32, 32]),
    ("norm", Dtype::F32, &[32]),
];

/// The size of one element of `dtype`.
pub fn item_size(dtype: Dtype) -> u64 {
    match dtype {
        Dtype::U8 | Dtype::I8 | Dtype::Bool => 1,
        Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::BF16 => 2,
        Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
        Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
    }
}

/// Every tensor's metadata (all in chunk 0), and the chunk's size (a whole number of pages).
pub fn layout() -> (Vec<(&'static str, TensorMeta)>, u64) {
    let mut offset: u64 = 0;
    let metas = TENSORS
        .iter()
        .map(|&(name, dtype, shape)| {
            offset = offset.div_ceil(ALIGNMENT) * ALIGNMENT;
            let len = shape.iter().product::<u64>() * item_size(dtype);
            let meta = TensorMeta {
                chunk: 0,
                offset,
                len,
                dtype,
                shape: shape.to_vec(),
            };
            offset += len;
            (name, meta)
        })
        .collect();
    (metas, offset.div_ceil(4096) * 4096)
}

/// The bytes of tensor number `index` published with `seed`: byte `j` is
/// `seed + 16 * index + j % 251` (mod 256).
pub fn contents(seed: u8, index: usize, len: usize) -> Vec<u8> {
    let base = seed.wrapping_add((index as u8).wrapping_mul(16));
    (0..len)
        .map(|j| base.wrapping_add((j % 251) as u8))
        .collect()
}

/// The name of `dtype` as the demo prints it (numpy's names, and `bf16`).
pub fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::U8 => "u8",
        Dtype::I8 => "i8",
        Dtype::U16 => "u16",
        Dtype::I16 => "i16",
        Dtype::U32 => "u32",
        Dtype::I32 => "i32",
        Dtype::U64 => "u64",
        Dtype::I64 => "i64",
        Dtype::F16 => "f16",
        Dtype::BF16 => "bf16",
        Dtype::F32 => "f32",
        Dtype::F64 => "f64",
        Dtype::Bool => "bool",
    }
}
