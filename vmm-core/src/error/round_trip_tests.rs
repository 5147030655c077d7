//! Every [`Error`] variant crosses serde (postcard, as between processes) as itself: the same
//! variant, the same fields (compared by `Debug`) and the same text.

use std::time::Duration;

use super::*;

/// The variant's index: a new variant does not compile until it is numbered here (and
/// [`VARIANTS`] counts it), so [`samples`] cannot silently miss one.
fn variant(error: &Error) -> usize {
    match error {
        Error::Os { .. } => 0,
        Error::FdLimit { .. } => 1,
        Error::Protocol { .. } => 2,
        Error::TooManyFds { .. } => 3,
        Error::Serde { .. } => 4,
        Error::Disconnected(_) => 5,
        Error::Timeout { .. } => 6,
        Error::PeerRefused { .. } => 7,
        Error::LimitExceeded { .. } => 8,
        Error::InvalidDescriptor { .. } => 9,
        Error::InvalidOption { .. } => 10,
        Error::InvalidEnv { .. } => 11,
        Error::NoSuchDevice { .. } => 12,
        Error::OutOfBounds { .. } => 13,
        Error::NotExportable { .. } => 14,
        Error::GrowRefused { .. } => 15,
        Error::SpawnRefused { .. } => 16,
        Error::TooLarge { .. } => 17,
        Error::InvalidEndpoint { .. } => 18,
        Error::FdsCannotTravel { .. } => 19,
        Error::FabricKeeperStopped => 20,
        Error::Child(_) => 21,
        Error::Forkserver { .. } => 22,
        Error::Cuda { .. } => 23,
        Error::CudaContract { .. } => 24,
        Error::CudaUnavailable(_) => 25,
        Error::FabricUnsupported { .. } => 26,
        Error::NoImexChannel { .. } => 27,
        Error::FabricUnreachable { .. } => 28,
        Error::Tls { .. } => 29,
        Error::Ipc { .. } => 30,
    }
}

/// How many variants [`variant`] numbers.
const VARIANTS: usize = 31;

fn cuda(code: CudaCode, name: &str) -> Error {
    Error::Cuda {
        call: "cuMemCreate".into(),
        name: name.to_owned(),
        code,
    }
}

fn refusal(code: CudaCode, name: &str) -> DriverRefusal {
    DriverRefusal {
        call: "cuMemCreate".into(),
        name: name.to_owned(),
        code,
    }
}

fn listener() -> Credentials {
    Credentials {
        pid: 42,
        uid: 1000,
        gid: 1000,
    }
}

/// At least one value of every variant, and of every typed reason's variants where they carry
/// data.
fn samples() -> Vec<Error> {
    let chunk = Chunk {
        index: 1,
        count: 3,
        size: 2 << 20,
    };
    vec![
        Error::errno("open(x)", nix::errno::Errno::ENOENT),
        Error::FdLimit {
            op: "dup".into(),
            soft_limit: 1024,
            open: Some(1024),
        },
        Error::protocol(ProtocolRule::Fds, "2 fds, want 1"),
        Error::TooManyFds {
            count: 300,
            max: 253,
        },
        Error::serde(
            SerdeStep::Decode,
            "Hit the end of buffer, expected more data",
        ),
        Error::Disconnected("channel".into()),
        Error::Timeout {
            what: "waiting for a reply".into(),
            after: Duration::from_millis(1500),
        },
        Error::PeerRefused {
            endpoint: "@x".into(),
            reason: PeerRefusal::UnexpectedListener {
                listener: listener(),
                expected: "uid 1001".into(),
                note: String::new(),
            },
        },
        Error::PeerRefused {
            endpoint: "@x".into(),
            reason: PeerRefusal::ListenerClosed {
                listener: listener(),
            },
        },
        Error::PeerRefused {
            endpoint: "@x".into(),
            reason: PeerRefusal::RefusedByListener {
                listener: listener(),
                said: "uid 1000 (gid 1000): not allowed".into(),
            },
        },
        Error::LimitExceeded {
            what: "importing a host buffer".into(),
            size: 1 << 40,
            cap: 1 << 30,
            raise: "raise it".into(),
        },
        Error::descriptor(DescriptorRule::Memfd, "not sealed"),
        Error::option(
            "workers",
            OptionRule::Missing,
            "a Pool needs at least one worker",
        ),
        Error::env(
            "VMM_CHILD_TIMEOUT",
            "300000",
            EnvRule::TooLarge { max: 86_400 },
            "too large",
            "seconds",
        ),
        Error::NoSuchDevice {
            wanted: DeviceWanted::Uuid([7; 16]),
            visible: 2,
            message: "no CUDA device has UUID GPU-07...".into(),
        },
        Error::NoSuchDevice {
            wanted: DeviceWanted::Ordinal(3),
            visible: 2,
            message: "device ordinal 3 does not exist".into(),
        },
        Error::OutOfBounds {
            op: "read_at".into(),
            offset: 10,
            len: 20,
            size: 16,
        },
        Error::NotExportable {
            op: "export".into(),
            rule: ExportRule::Imported,
            message: "it was imported".into(),
        },
        Error::GrowRefused {
            rule: GrowRule::Shrink,
            message: "new size 1 is smaller".into(),
        },
        Error::SpawnRefused {
            rule: SpawnRule::Environment,
            message: "a key with =".into(),
        },
        Error::TooLarge {
            size: 1 << 20,
            max: 1 << 16,
            message: "a DATA payload".into(),
        },
        Error::InvalidEndpoint {
            rule: EndpointRule::NameTooLong { len: 200, max: 107 },
            message: "endpoint name is 200 bytes".into(),
        },
        Error::InvalidEndpoint {
            rule: EndpointRule::DirectoryOwner {
                owner: 65534,
                uid: 0,
            },
            message: "is owned by uid 65534".into(),
        },
        Error::FdsCannotTravel {
            transport: FdlessTransport::EndpointValue,
            message: "a value with 1 fd(s)".into(),
        },
        Error::FabricKeeperStopped,
        Error::Child(Box::new(ChildError {
            method: StartMethod::Forkserver,
            pid: 7,
            status: Some(ExitStatus::Signaled(9)),
            started: true,
            panic_message: Some("boom".into()),
            panic_location: Some("src/x.rs:1:2".into()),
            not_run: Some(Box::new(Error::descriptor(DescriptorRule::Fds, "x"))),
            not_run_stage: Some(NotRunStage::Argument),
            timed_out: Some(Duration::from_secs(3)),
            protocol_violation: None,
            exec_program: None,
            observed_notes: vec!["a note".into()],
            reported: false,
            stdout: "out".into(),
            stderr: "err".into(),
        })),
        Error::forkserver(ForkserverFailure::Unresponsive, "pid 9 did not answer"),
        cuda(CudaCode::NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED"),
        Error::CudaContract {
            call: "cuMemExportToShareableHandle".into(),
            breach: ContractBreach::NegativeFd { fd: -1 },
        },
        Error::CudaUnavailable(Unavailable::Driver {
            call: "cuInit".into(),
            name: "CUDA_ERROR_NO_DEVICE".into(),
            code: CudaCode::NO_DEVICE,
        }),
        Error::CudaUnavailable(Unavailable::NoImexChannel {
            device: "device 0 (X)".into(),
            refused: refusal(CudaCode::NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED"),
            channel_dir_missing: true,
        }),
        Error::FabricUnsupported {
            device: "device 0 (X)".into(),
            evidence: FabricEvidence::AttributeUnknown {
                name: "CUDA_ERROR_INVALID_VALUE".into(),
                code: CudaCode::INVALID_VALUE,
            },
        },
        Error::FabricUnsupported {
            device: "device 0 (X)".into(),
            evidence: FabricEvidence::Refused(refusal(
                CudaCode::NOT_SUPPORTED,
                "CUDA_ERROR_NOT_SUPPORTED",
            )),
        },
        Error::NoImexChannel {
            device: "device 0 (X)".into(),
            refused: refusal(CudaCode::NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED"),
            channel_dir_missing: false,
        },
        Error::FabricUnreachable {
            owner: "GPU-abababab-abab-abab-abab-abababababab".into(),
            device: "device 0 (X)".into(),
            source: Box::new(cuda(CudaCode::INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE")),
        },
        Error::Tls {
            step: TlsStep::Handshake,
            peer: "127.0.0.1:1".into(),
            reason: TlsReason::RefusedByPeer { alert: 48 },
        },
        Error::ipc(
            IpcOp::Export,
            IpcStep::Map(chunk),
            Error::FabricKeeperStopped,
        ),
    ]
}

#[test]
fn every_variant_crosses_serde_as_itself() {
    let samples = samples();
    let mut seen = [false; VARIANTS];
    for error in &samples {
        seen[variant(error)] = true;
        let bytes = postcard::to_stdvec(error).unwrap();
        let back: Error = postcard::from_bytes(&bytes)
            .unwrap_or_else(|e| panic!("{error:?} did not come back: {e}"));
        assert_eq!(variant(&back), variant(error), "{back:?}");
        assert_eq!(format!("{back:?}"), format!("{error:?}"));
        assert_eq!(back.to_string(), error.to_string());
    }
    let missing: Vec<usize> = (0..VARIANTS).filter(|&i| !seen[i]).collect();
    assert!(missing.is_empty(), "no sample of variant(s) {missing:?}");
}

#[test]
fn typed_reasons_read_as_before() {
    // The texts people read did not change when their content became typed.
    let shown = |error: Error| error.to_string();
    assert_eq!(
        shown(Error::CudaContract {
            call: "cuMemExportToShareableHandle".into(),
            breach: ContractBreach::NegativeFd { fd: -1 },
        }),
        "cuMemExportToShareableHandle reported success but gave fd -1"
    );
    assert_eq!(
        shown(cuda(CudaCode::NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED")),
        "cuMemCreate failed: CUDA_ERROR_NOT_PERMITTED (800)"
    );
    assert_eq!(
        shown(Error::PeerRefused {
            endpoint: "@x".into(),
            reason: PeerRefusal::UnexpectedListener {
                listener: listener(),
                expected: "uid 1001".into(),
                note: String::new(),
            },
        }),
        "endpoint @x: its listener is pid 42 (uid 1000, gid 1000), not whom this client expects \
         (uid 1001): another process may have taken the name first; nothing was sent to it"
    );
    assert_eq!(
        shown(Error::PeerRefused {
            endpoint: "@x".into(),
            reason: PeerRefusal::RefusedByListener {
                listener: listener(),
                said: "uid 1 (gid 1)".into(),
            },
        }),
        "endpoint @x: its listener (pid 42 (uid 1000, gid 1000)) refused this process: uid 1 \
         (gid 1)"
    );
    let unsupported = shown(Error::FabricUnsupported {
        device: "device 0 (X)".into(),
        evidence: FabricEvidence::Refused(refusal(
            CudaCode::NOT_SUPPORTED,
            "CUDA_ERROR_NOT_SUPPORTED",
        )),
    });
    assert!(
        unsupported.starts_with(
            "device 0 (X) does not support fabric handles (cuMemCreate with \
             CU_MEM_HANDLE_TYPE_FABRIC returned CUDA_ERROR_NOT_SUPPORTED); share"
        ),
        "{unsupported}"
    );
    let no_channel = shown(Error::NoImexChannel {
        device: "device 0 (X)".into(),
        refused: refusal(CudaCode::NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED"),
        channel_dir_missing: false,
    });
    assert!(
        no_channel.contains(
            "(cuMemCreate with CU_MEM_HANDLE_TYPE_FABRIC returned CUDA_ERROR_NOT_PERMITTED). "
        ),
        "{no_channel}"
    );
    assert!(NO_CHANNEL_DIR.contains(IMEX_CHANNEL_DIR));
    assert_eq!(
        shown(Error::serde(SerdeStep::Encode, "x")),
        "serialisation: x"
    );
    assert_eq!(
        shown(Error::forkserver(ForkserverFailure::Died, "pid 1 died")),
        "forkserver: pid 1 died"
    );
}
