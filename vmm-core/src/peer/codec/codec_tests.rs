use super::*;
use std::os::fd::AsFd;

use crate::shm::HostBuffer;

fn received(fds: &[BorrowedFd<'_>]) -> Vec<OwnedFd> {
    fds.iter()
        .map(|fd| fd.try_clone_to_owned().unwrap())
        .collect()
}

/// The private serde form above must be `IpcDescriptor`'s own: a descriptor encoded by
/// vmm_core::wire decodes through the same bytes the form makes, with every field.
#[test]
fn the_descriptor_form_is_ipc_descriptors() {
    let g = 2u64 << 20;
    let file = std::fs::File::open("/proc/self/stat").unwrap();
    let frame = Frame {
        handle_type: 1,
        size: 3 * g - 1,
        device: Some((2, [0x5a; 16])),
        location: FrameLocation::HostNuma(1),
        chunk_sizes: vec![g, 2 * g],
        ..Frame::empty(Kind::Cuda)
    };
    let fds = received(&[file.as_fd(), file.as_fd()]);
    let d = cuda_descriptor(&frame, fds).unwrap();
    assert_eq!(d.chunk_sizes(), &[g as usize, 2 * g as usize]);
    assert_eq!(d.size(), 3 * g as usize - 1);
    assert_eq!(d.handle_type(), HandleType::PosixFd);
    assert_eq!(
        d.device(),
        Some(DeviceIdentity {
            ordinal: 2,
            uuid: [0x5a; 16]
        })
    );
    assert_eq!(d.location(), Location::HostNuma(1));
    assert_eq!(d.fds().count(), 2);
    // And the wire form vmm-core itself writes is byte for byte the form's.
    let encoded = crate::wire::encode(&d).unwrap();
    let form = IpcDescriptorForm {
        handle_type: 1,
        size: 3 * g - 1,
        chunk_sizes: &[g, 2 * g],
        device: d.device(),
        location: Location::HostNuma(1),
        fds: vec![0, 1],
    };
    assert_eq!(encoded.bytes(), postcard::to_stdvec(&form).unwrap());
    // Back through the protocol: the same fields.
    let (bytes, out_fds) = encode_descriptor(&d).unwrap();
    let back = decode_message(&bytes, received(&out_fds)).unwrap();
    let PeerMessage::Descriptor(Descriptor::Cuda(back)) = back else {
        panic!("not a CUDA descriptor");
    };
    assert_eq!(
        (
            back.chunk_sizes(),
            back.size(),
            back.device(),
            back.location()
        ),
        (d.chunk_sizes(), d.size(), d.device(), d.location())
    );
}

#[test]
fn host_descriptors_round_trip_and_import() {
    let buf = HostBuffer::new(5000).unwrap();
    buf.fill(3).unwrap();
    let d = buf.export().unwrap();
    let (bytes, fds) = encode_descriptor(&d).unwrap();
    assert_eq!(fds.len(), 1);
    let PeerMessage::Descriptor(back) = decode_message(&bytes, received(&fds)).unwrap() else {
        panic!("not a descriptor")
    };
    let alias = HostBuffer::import(&back.into_host().unwrap()).unwrap();
    assert_eq!(alias.to_vec(), vec![3; 5000]);
    let empty = HostBuffer::new(0).unwrap().export().unwrap();
    let (bytes, fds) = encode_descriptor(&empty).unwrap();
    assert!(fds.is_empty());
    let PeerMessage::Descriptor(Descriptor::Host(back)) =
        decode_message(&bytes, Vec::new()).unwrap()
    else {
        panic!("not a host descriptor")
    };
    assert_eq!((back.size(), back.fd().is_none()), (0, true));
}

#[test]
fn the_wrong_kind_is_refused_by_name() {
    let buf = HostBuffer::new(64).unwrap();
    let d = Descriptor::from(buf.export().unwrap());
    let unexpected = |result: Result<()>| match result {
        Err(Error::Protocol {
            rule: ProtocolRule::UnexpectedKind,
            message,
        }) => message,
        other => panic!("expected Protocol(UnexpectedKind), got {other:?}"),
    };
    // The kinds, by name.
    let m = unexpected(d.into_cuda().map(drop));
    assert!(m.contains("expected a CUDA_VMM descriptor"), "{m}");
    let hello = Frame::empty(Kind::Hello).encode().unwrap();
    let m = unexpected(decode_message(&hello, Vec::new()).map(drop));
    assert!(m.contains("HELLO belongs to the handshake"), "{m}");
}

#[test]
fn a_handle_type_none_descriptor_is_not_sent() {
    let file = std::fs::File::open("/proc/self/stat").unwrap();
    // Only through the serde form can a None descriptor exist without a GPU.
    let form = IpcDescriptorForm {
        handle_type: 0,
        size: 4096,
        chunk_sizes: &[4096],
        device: None,
        location: Location::Device,
        fds: vec![0],
    };
    let bytes = postcard::to_stdvec(&form).unwrap();
    let none: IpcDescriptor = crate::wire::decode(&bytes, received(&[file.as_fd()])).unwrap();
    let err = encode_descriptor(&none).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidOption { option, rule: OptionRule::Conflict, .. }
            if option == "handle_type"),
        "{err:?}"
    );
}
