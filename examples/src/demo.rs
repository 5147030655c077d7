//! Publish the demo's weights, attach and check them, and the `memd-demo` command line.

use vmm_core::wire::endpoint::{Allow, ConnectOptions, Name};
use vmm_memd::{BeginOptions, Client, MemdError};

use crate::model::{DEFAULT_REGION, TENSORS, contents, dtype_name, layout};

/// The program's usage.
pub const USAGE: &str = "usage: memd-demo [--socket NAME|PATH] [--service-uid UID] \
[--region NAME] [--seed N] publish|attach
  --socket       the service (default: $VMM_MEMD_SOCKET, else @vmm-memd, as vmm-memctl)
  --service-uid  the uid the service must run as (default: this process's)
  --region       the region (default: demo-weights)
  --seed         the contents' seed, 0 to 255 (default: 7); attach checks every byte against it
  publish        load the weights into the next generation of the region, and exit
  attach         attach the current generation, print and check what came";

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// The command line is not one [`USAGE`] allows; `arg` is the first word that is not.
    #[error("memd-demo: unexpected {arg:?}\n{USAGE}")]
    Usage { arg: String },
    /// The service refused, or is gone, or the transport failed.
    #[error("memd-demo: {0}")]
    Memd(#[from] MemdError),
    /// The attached generation lacks a tensor, or has it elsewhere than the demo lays it out.
    #[error("memd-demo: generation {generation} has no tensor {tensor} as the demo lays it out")]
    Layout { generation: u64, tensor: String },
    /// A tensor's bytes are not what the demo publishes with the seed.
    #[error("memd-demo: tensor {tensor} of generation {generation} is not seed {seed}'s")]
    Contents {
        generation: u64,
        tensor: String,
        seed: u8,
    },
}

/// Load the weights made from `seed` into the next generation of `region`: begin, fill the
/// chunk through this process's mapping, describe the tensors, commit (atomic: a reader sees
/// the previous generation or this one, whole). The generation's number.
pub fn publish(client: &Client, region: &str, seed: u8) -> Result<u64, DemoError> {
    let (metas, size) = layout();
    let mut writer = client.begin(region, &[size], BeginOptions::default())?;
    for (index, (name, meta)) in metas.into_iter().enumerate() {
        let bytes = contents(seed, index, meta.len as usize);
        writer
            .chunk(0)
            .write_at(meta.offset as usize, &bytes)
            .map_err(MemdError::Core)?;
        writer.put(name, meta);
    }
    Ok(writer.commit()?)
}

/// Attach the current generation of `region`, check every tensor against `seed`, detach (the
/// mapping would stay valid); the report, one line per tensor, the last starting with `OK`.
pub fn attach(client: &Client, region: &str, seed: u8) -> Result<String, DemoError> {
    let attached = client.attach(region)?;
    let generation = attached.generation;
    let base = attached.chunks.first().map_or(0, |c| c.as_ptr() as usize);
    let mut report = format!(
        "attached {region} generation {generation} (lease {}), mapped read-only at {base:#x}\n",
        attached.lease
    );
    let (metas, _) = layout();
    for (index, (name, meta)) in metas.iter().enumerate() {
        let layout_error = || DemoError::Layout {
            generation,
            tensor: name.to_string(),
        };
        if attached.meta.get(*name) != Some(meta) {
            return Err(layout_error());
        }
        let bytes = attached.tensor(name).ok_or_else(layout_error)?;
        if bytes != contents(seed, index, bytes.len()) {
            return Err(DemoError::Contents {
                generation,
                tensor: name.to_string(),
                seed,
            });
        }
        report += &format!(
            "  {name} {} {:?}: {} bytes at {:#x}\n",
            dtype_name(meta.dtype),
            meta.shape,
            meta.len,
            bytes.as_ptr() as usize
        );
    }
    client.detach(&attached)?;
    report += &format!(
        "OK {region} generation {generation}: {} tensors, every byte as published with seed \
         {seed}",
        TENSORS.len()
    );
    Ok(report)
}

/// The `memd-demo` program (see [`USAGE`]): its report.
pub fn run(args: &[String]) -> Result<String, DemoError> {
    let mut socket = std::env::var("VMM_MEMD_SOCKET").unwrap_or_else(|_| "@vmm-memd".into());
    let (mut service_uid, mut region, mut seed, mut mode) =
        (None, DEFAULT_REGION.to_owned(), 7u8, None);
    let mut words = args.iter();
    while let Some(word) = words.next() {
        let usage = || DemoError::Usage { arg: word.clone() };
        let mut value = || words.next().cloned().ok_or_else(usage);
        match word.as_str() {
            "--socket" => socket = value()?,
            "--service-uid" => service_uid = Some(value()?.parse().map_err(|_| usage())?),
            "--region" => region = value()?,
            "--seed" => seed = value()?.parse().map_err(|_| usage())?,
            "publish" | "attach" if mode.is_none() => mode = Some(word.clone()),
            _ => return Err(usage()),
        }
    }
    let Some(mode) = mode else {
        return Err(DemoError::Usage { arg: String::new() });
    };
    let mut options = ConnectOptions::default();
    if let Some(uid) = service_uid {
        options = options.expect(Allow::none().uid(uid));
    }
    let client = Client::connect_with(&Name::from(socket.as_str()), &options)?;
    if mode == "publish" {
        let generation = publish(&client, &region, seed)?;
        Ok(format!(
            "published {region} generation {generation}: {} tensors (seed {seed})",
            TENSORS.len()
        ))
    } else {
        attach(&client, &region, seed)
    }
}
