//! The backend choice, on any machine: the protocol's existing requests and replies keep
//! their postcard tags (the new ones are appended, so the Python client's encoding stands);
//! `BeginOn` with the host backend is `Begin`; a GPU request for a device the service does not
//! have is refused before anything is allocated or charged; a region keeps its backend;
//! `Verify` of a host region.

mod common;

use common::{ServiceProc, fill_byte, publish};
use vmm_memd::protocol::{Acl, Backend, Request, Response, SleepState};
use vmm_memd::{BeginOptions, MemdError, Refusal, RequestRule};

/// The postcard tag (first byte) of a value.
fn tag<T: serde::Serialize>(value: &T) -> u8 {
    postcard::to_allocvec(value).unwrap()[0]
}

#[test]
fn existing_variants_keep_their_tags_and_new_ones_are_appended() {
    let region = || "r".to_owned();
    let requests = [
        Request::List,
        Request::Status,
        Request::Begin {
            region: region(),
            chunks: vec![],
            acl: Acl::default(),
            wait_ms: 0,
        },
        Request::PutMeta(vec![]),
        Request::Commit,
        Request::Abort,
        Request::Attach {
            region: region(),
            generation: None,
        },
        Request::Detach { lease: 0 },
        Request::Renew,
        Request::Delete { region: region() },
        Request::Metrics,
        Request::BeginOn {
            region: region(),
            chunks: vec![],
            acl: Acl::default(),
            wait_ms: 0,
            backend: Backend::Host,
        },
        Request::Verify {
            region: region(),
            generation: None,
        },
        Request::Discard { lease: 0 },
        Request::AttachFabric {
            region: region(),
            generation: None,
        },
        Request::Sleep { region: region() },
        Request::Wake { region: region() },
    ];
    for (i, request) in requests.iter().enumerate() {
        assert_eq!(tag(request) as usize, i, "{request:?}");
    }
    let appended = [
        Response::BeganGpu {
            generation: 0,
            chunks: vec![],
            device: [0; 16],
            fabric: false,
        },
        Response::AttachedGpu {
            lease: 0,
            generation: 0,
            chunks: vec![],
            meta_pages: 0,
            ttl_ms: 0,
            device: [0; 16],
            fabric: false,
        },
        Response::Verified {
            generation: 0,
            digests: vec![],
        },
        Response::Slept {
            generation: 0,
            leases: 0,
        },
        Response::Woke {
            generation: 0,
            zeroed: false,
        },
    ];
    assert_eq!(tag(&Response::Metrics(String::new())), 9);
    for (i, response) in appended.iter().enumerate() {
        assert_eq!(tag(response) as usize, 10 + i, "{response:?}");
    }
    assert_eq!(tag(&Backend::Host), 0);
    assert_eq!(tag(&Backend::Gpu { uuid: [0; 16] }), 1);
    let service_failed = Refusal::ServiceFailed {
        op: String::new(),
        errno: 0,
    };
    assert_eq!(tag(&service_failed), 9);
    assert_eq!(tag(&Refusal::NoSuchDevice { uuid: [0; 16] }), 10);
    let fabric = Refusal::FabricUnavailable {
        region: region(),
        generation: 0,
    };
    assert_eq!(tag(&fabric), 13);
    assert_eq!(tag(&RequestRule::NoSuchLease), 7);
    assert_eq!(tag(&RequestRule::Backend), 8);
    assert_eq!(tag(&RequestRule::NotAsleep), 9);
    for (i, sleep) in [SleepState::Awake, SleepState::Falling, SleepState::Asleep]
        .iter()
        .enumerate()
    {
        assert_eq!(tag(sleep) as usize, i);
    }
}

#[test]
fn begin_on_the_host_backend_is_begin() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    let options = BeginOptions {
        backend: Backend::Host,
        ..Default::default()
    };
    // The client sends `Begin` for the host; `BeginOn { backend: Host }` by hand is the same.
    let bytes = postcard::to_allocvec(&Request::BeginOn {
        region: "by-hand".into(),
        chunks: vec![4096],
        acl: Acl::default(),
        wait_ms: 0,
        backend: Backend::Host,
    })
    .unwrap();
    let raw = service.connect();
    assert!(matches!(
        raw.request_raw(&bytes).unwrap(),
        Response::Began { generation: 1, ref chunks } if chunks == &[4096]
    ));
    drop(raw);
    let writer = client.begin("host", &[4096, 8192], options).unwrap();
    assert!(writer.gpu().is_none());
    writer.chunk(1).fill(fill_byte(1)).unwrap();
    assert_eq!(writer.commit().unwrap(), 1);
    let attached = client.attach("host").unwrap();
    assert!(attached.gpu.is_none());
    assert!(common::holds(&attached.chunks[1], 1));
    assert!(attached.tensor_device_ptr("t0").is_none());
    // A host region is sealed: nothing to verify, no digests.
    assert_eq!(client.verify("host", None).unwrap(), Vec::<[u8; 32]>::new());
    assert!(matches!(
        client.verify("host", Some(7)),
        Err(MemdError::Refused(Refusal::NoSuchGeneration {
            generation: 7,
            ..
        }))
    ));
}

/// A device UUID the service has not got (or a service without a GPU): `NoSuchDevice`,
/// nothing allocated, nothing charged, no fd more in the service, no region made.
#[test]
fn an_unknown_device_is_refused_before_anything_is_allocated() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "warm", 1, 4096);
    let bogus = [0xab; 16];
    let options = || BeginOptions {
        backend: Backend::Gpu { uuid: bogus },
        ..Default::default()
    };
    let refused = |region: &str| match client.begin(region, &[u64::MAX], options()) {
        Err(MemdError::Refused(Refusal::NoSuchDevice { uuid })) => assert_eq!(uuid, bogus),
        other => panic!("{:?}", other.map(|w| w.generation())),
    };
    // The first GPU request loads the driver where there is one (cuInit opens the device
    // nodes: a dozen fds on an H200); the baseline is taken after it.
    refused("nowhere");
    let fds = service.fd_count();
    refused("nowhere-either");
    let status = client.status().unwrap();
    assert_eq!(status.used, 4096);
    assert_eq!(client.list().unwrap().len(), 1);
    assert_eq!(service.fd_count(), fds);
}

/// A region lives where it was created: a GPU `BeginOn` for a host region is refused with
/// rule `Backend` (before any device is opened), and the region's generation stands.
#[test]
fn a_region_keeps_its_backend() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "host-only", 1, 4096);
    let options = BeginOptions {
        backend: Backend::Gpu { uuid: [1; 16] },
        ..Default::default()
    };
    match client.begin("host-only", &[4096], options) {
        Err(MemdError::Refused(Refusal::InvalidRequest {
            rule: RequestRule::Backend,
            ..
        })) => {}
        other => panic!("{:?}", other.map(|w| w.generation())),
    }
    let attached = client.attach("host-only").unwrap();
    assert_eq!(attached.generation, 1);
    assert!(common::holds(&attached.chunks[0], 1));
}

/// A GPU `Begin` with a malformed chunk list is refused by the same rules as a host one,
/// before any device is looked up (so `Chunks`, not `NoSuchDevice`, even for a device that
/// does not exist).
#[test]
fn gpu_chunk_lists_are_checked_before_any_device_is_opened() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    let options = || BeginOptions {
        backend: Backend::Gpu { uuid: [0xcd; 16] },
        ..Default::default()
    };
    for chunks in [vec![], vec![0], vec![1 << 20; 65]] {
        match client.begin("bad", &chunks, options()) {
            Err(MemdError::Refused(Refusal::InvalidRequest {
                rule: RequestRule::Chunks,
                ..
            })) => {}
            other => panic!("{chunks:?}: {:?}", other.map(|w| w.generation())),
        }
    }
    assert!(client.list().unwrap().is_empty());
}
