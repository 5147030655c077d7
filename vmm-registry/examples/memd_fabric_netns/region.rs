//! The region node A's writer commits and node B's importer checks: its name, its chunks, the
//! bytes of each chunk and its tensors; and how a commit is reported between the processes
//! (`G SEED SIZES DEVICE`, e.g. `1 1 4194304,4194304 GPU-8e1a...`, `-` for host memory).

use std::collections::BTreeMap;

use vmm_memd::protocol::{Dtype, TensorMeta};

use crate::child::Failure;

/// The region's name.
pub const REGION: &str = "weights";

/// The size asked for each chunk (a multiple of the H200's 2 MiB granularity, so the service
/// keeps it as it is), and how many.
pub const CHUNK: u64 = 4 << 20;
pub const CHUNKS: usize = 2;

/// Where the region lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Device 0, handed to node B as the service's fabric handles.
    Gpu,
    /// Host memory (memfds), handed to node B as the host stand-in (same machine only).
    Host,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Gpu => "gpu",
            Mode::Host => "host",
        }
    }

    pub fn parse(word: &str) -> Result<Mode, Failure> {
        match word {
            "gpu" => Ok(Mode::Gpu),
            "host" => Ok(Mode::Host),
            other => Err(format!("not a mode: {other:?} (gpu or host)").into()),
        }
    }
}

/// The bytes of chunk `chunk` of a generation written with `seed`.
pub fn chunk_bytes(seed: u8, chunk: usize, len: usize) -> Vec<u8> {
    let shift = u8::try_from(chunk % 256).unwrap_or(0).wrapping_mul(101);
    vmm_tests::pattern(seed.wrapping_add(shift), len)
}

/// The tensors of every generation, in key order: one in each chunk, at offsets that are not
/// multiples of the pattern's period (a tensor read at the wrong place reads other bytes).
pub fn tensors() -> Vec<(&'static str, TensorMeta)> {
    vec![
        (
            "layer0.weight",
            TensorMeta {
                chunk: 0,
                offset: 4096,
                len: 8192,
                dtype: Dtype::BF16,
                shape: vec![64, 64],
            },
        ),
        (
            "layer1.bias",
            TensorMeta {
                chunk: 1,
                offset: 1000,
                len: 256,
                dtype: Dtype::F32,
                shape: vec![64],
            },
        ),
    ]
}

/// [`tensors`] as `region_metadata` returns them.
pub fn expected_tensors() -> BTreeMap<String, TensorMeta> {
    tensors()
        .into_iter()
        .map(|(key, meta)| (key.to_owned(), meta))
        .collect()
}

/// One committed generation, as the writer reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    pub generation: u64,
    pub seed: u8,
    /// The chunks' sizes (the GPU rounds them up to its granularity).
    pub sizes: Vec<u64>,
    /// The device's UUID as locators carry it (`GPU-...`); `None` for host memory.
    pub device: Option<String>,
}

impl Committed {
    /// `G SEED SIZES DEVICE`.
    pub fn words(&self) -> String {
        let sizes: Vec<String> = self.sizes.iter().map(u64::to_string).collect();
        format!(
            "{} {} {} {}",
            self.generation,
            self.seed,
            sizes.join(","),
            self.device.as_deref().unwrap_or("-")
        )
    }

    /// The inverse of [`words`](Self::words), from its four words.
    pub fn parse(words: &[&str]) -> Result<Committed, Failure> {
        let [generation, seed, sizes, device] = words[..] else {
            return Err(format!("not `G SEED SIZES DEVICE`: {words:?}").into());
        };
        Ok(Committed {
            generation: generation.parse()?,
            seed: seed.parse()?,
            sizes: sizes.split(',').map(str::parse).collect::<Result<_, _>>()?,
            device: (device != "-").then(|| device.to_owned()),
        })
    }

    /// The region's size: its chunks back to back.
    pub fn size(&self) -> u64 {
        self.sizes.iter().sum()
    }

    /// Where chunk `chunk` starts when the chunks are mapped back to back.
    pub fn chunk_start(&self, chunk: usize) -> usize {
        self.sizes[..chunk].iter().map(|&s| s as usize).sum()
    }

    /// Every byte of the region, chunks back to back.
    pub fn bytes(&self) -> Vec<u8> {
        self.sizes
            .iter()
            .enumerate()
            .flat_map(|(i, &len)| chunk_bytes(self.seed, i, len as usize))
            .collect()
    }
}
