//! Growing a buffer in one process: in place and by relocation (each forced), and the
//! refusals (another device, another location), which take no fd.

use vmm_core::cuda::{
    Device, Granularity, HandleType, Location, ResourceOptions, VirtualMemoryResource,
};
use vmm_core::testing::{cuda_devices, cuda_vmm_ipc};

use super::local::{free_range, open_fds, pattern};
use super::{alone, grow_refused, not_exportable, option_refused, read, resource};
use vmm_core::error::{ExportRule, GrowRule, OptionRule};

#[test]
fn grow_in_place_and_by_relocation_are_each_forced() {
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
        return;
    };
    let device = Device::new(0).unwrap();
    let r = resource();
    let g = r.granularity();
    // Host memory first: between finding a free range and the grows below, nothing else of
    // this process should be placed (large host allocations are mappings too).
    let (first, second, third) = (pattern(g, 1), pattern(g, 2), pattern(g, 3));

    // In place: the buffer starts a free range, so the range right after it is free too.
    let here = VirtualMemoryResource::new(
        &device,
        ResourceOptions::default().address_hint(free_range(&r, 8)),
    )
    .unwrap();
    let a = here.allocate(g).unwrap();
    let b = here.grow(&a, 2 * g).unwrap();
    // By relocation: another allocation takes the range right after `b` (asked for there; if
    // the driver put it elsewhere, the assert below says where).
    let after_b = b.device_ptr() + b.capacity() as u64;
    let blocker = VirtualMemoryResource::new(
        &device,
        ResourceOptions::default()
            .granularity(Granularity::Minimum)
            .address_hint(after_b),
    )
    .unwrap()
    .allocate(g)
    .unwrap();
    let c = here.grow(&b, 3 * g).unwrap();

    // `a` still holds its range, so a relocated `b` could not start where `a` does.
    assert_eq!(
        b.device_ptr(),
        a.device_ptr(),
        "with the range after the buffer free, grow is in place (same address)"
    );
    assert_eq!(b.chunk_sizes(), vec![g, g], "in place adds one chunk");
    assert_eq!(b.capacity(), 2 * g);
    a.write_at(0, &first).unwrap();
    b.write_at(g, &second).unwrap();
    assert_eq!(read(&b, 0, g), first);
    assert_eq!(read(&b, g, g), second);
    // The input stays valid and shares the first chunk (the same mapping, in place).
    a.write_at(0, &[9; 16]).unwrap();
    assert_eq!(read(&b, 0, 16), [9; 16]);
    b.write_at(g - 8, &[7; 16]).unwrap(); // across the chunk boundary
    assert_eq!(read(&a, g - 8, 8), [7; 8]);
    assert_eq!(read(&b, g - 8, 16), [7; 16]);

    // `b` still holds its range too: only an in-place grow could keep its address.
    assert_ne!(
        c.device_ptr(),
        b.device_ptr(),
        "with the range after the buffer taken (wanted at {after_b:#x}, the blocker is at {:#x}), \
         grow relocates",
        blocker.device_ptr()
    );
    assert_eq!(
        c.chunk_sizes(),
        vec![g, g, g],
        "relocation maps every chunk"
    );
    let (c_start, c_end) = (c.device_ptr(), c.device_ptr() + 3 * g as u64);
    let (b_start, b_end) = (b.device_ptr(), b.device_ptr() + 2 * g as u64);
    assert!(
        c_end <= b_start || b_end <= c_start,
        "the relocated range [{c_start:#x}, {c_end:#x}) is new, apart from [{b_start:#x}, \
         {b_end:#x})"
    );
    c.write_at(2 * g, &third).unwrap();
    let mut whole = read(&b, 0, 2 * g);
    whole.extend(&third);
    assert_eq!(
        read(&c, 0, 3 * g),
        whole,
        "the old chunks read the same at the new address"
    );
    // Both old chunks are remapped, not copied: writes through the new range reach the old one.
    c.write_at(0, &[5; 4]).unwrap();
    c.write_at(2 * g - 4, &[6; 4]).unwrap();
    assert_eq!(read(&a, 0, 4), [5; 4]);
    assert_eq!(read(&b, 2 * g - 4, 4), [6; 4]);

    // A grown buffer exports as its chunks and imports as one contiguous range.
    let d = c.export().unwrap();
    assert_eq!(d.chunk_sizes(), &[g, g, g]);
    let imported = r.import(&d).unwrap();
    assert_eq!(read(&imported, 0, 3 * g), read(&c, 0, 3 * g));

    // Grow keeps rules: no shrinking, same handle type, no growing an import.
    let m = grow_refused(r.grow(&c, g), GrowRule::Shrink);
    assert_eq!(
        m,
        format!(
            "grow: new size {g} is smaller than the buffer's size {}; grow never shrinks",
            3 * g
        )
    );
    let none = VirtualMemoryResource::new(
        &device,
        ResourceOptions::default().handle_type(HandleType::None),
    )
    .unwrap();
    let m = grow_refused(none.grow(&c, 4 * g), GrowRule::HandleType);
    assert_eq!(
        m,
        "grow: the buffer's handle type is PosixFd, this resource's option `handle_type` is None; \
         the handle type cannot change across a grow"
    );
    let m = grow_refused(r.grow(&imported, 4 * g), GrowRule::Imported);
    assert_eq!(
        m,
        "grow: an imported buffer cannot be grown: its chunks belong to the exporter; grow it \
         there and send the new buffer"
    );
    let m = not_exportable(none.allocate(1).unwrap().export(), ExportRule::HandleType);
    assert_eq!(
        m,
        "export: the buffer was allocated with handle type None; create its \
         VirtualMemoryResource with HandleType::PosixFd to share it"
    );
    // Within capacity: the same mapping, a larger size.
    let small = r.allocate(1).unwrap();
    let same = r.grow(&small, g).unwrap();
    assert_eq!(same.device_ptr(), small.device_ptr());
    assert_eq!((same.size(), same.chunk_sizes()), (g, vec![g]));
    drop((a, b, blocker));
    assert_eq!(
        read(&c, 0, 4),
        [5; 4],
        "chunks outlive the buffers they came from"
    );
}

#[test]
fn two_gpus_grow_onto_another_device_is_refused() {
    let Some(_gpu) = alone(cuda_devices(2)) else {
        return;
    };
    let r = resource();
    let g = r.granularity();
    let other =
        VirtualMemoryResource::new(&Device::new(1).unwrap(), ResourceOptions::default()).unwrap();
    let buf = r.allocate(g).unwrap();
    buf.fill(0x3c).unwrap();
    let before = open_fds();
    let m = grow_refused(other.grow(&buf, 2 * g), GrowRule::Device);
    assert_eq!(
        m,
        "grow: the buffer is on device 0, this resource allocates on device 1"
    );
    assert_eq!(open_fds(), before, "a refused grow takes no fd");
    // The buffer is untouched and grows on its own device.
    let grown = r.grow(&buf, 2 * g).unwrap();
    assert_eq!(read(&grown, g - 1, 1), [0x3c]);
}

#[test]
fn grow_with_another_location_is_refused() {
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
        return;
    };
    let device = Device::new(0).unwrap();
    let r = resource();
    let g = r.granularity();
    let host_options = ResourceOptions::default()
        .location(Location::HostNuma(0))
        // The location rule is checked first; no host chunk is ever made here, so the
        // handle type that host memory supports does not matter.
        .handle_type(HandleType::None);
    if !device.supports_host_numa_vmm().unwrap() {
        // No resource can have another location on this device: that is refused up front.
        let m = option_refused(
            VirtualMemoryResource::new(&device, host_options),
            "location",
            OptionRule::Unsupported,
        );
        assert_eq!(
            m,
            format!(
                "option `location`: host NUMA node 0 is not offered by the driver on device 0 \
                 ({})",
                device.name()
            )
        );
        eprintln!(
            "note: device 0 has no host NUMA VMM; only the up-front refusal of the location ran"
        );
        return;
    }
    let host = VirtualMemoryResource::new(&device, host_options).unwrap();
    let buf = r.allocate(g).unwrap();
    let before = open_fds();
    let m = grow_refused(host.grow(&buf, 2 * g), GrowRule::Location);
    assert_eq!(
        m,
        "grow: the buffer's location is Device, this resource's option `location` is HostNuma(0)"
    );
    assert_eq!(open_fds(), before, "a refused grow takes no fd");
}
