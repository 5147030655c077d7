//! Sleep and wake at stable addresses (issue 26 item 5, host backend): the memory is given up
//! while the addresses stay reserved, and a wake maps the region's current generation at the
//! same addresses; a wake onto another layout is refused with `StaleLayout`.

mod common;

use common::{ServiceProc, fill_byte, publish};
use vmm_memd::{Attached, MemdError};

/// The permissions of the mapping that holds `addr` in this process (`/proc/self/maps`;
/// adjacent reservations merge into one line).
fn perms_at(addr: *const u8) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let addr = addr as usize;
    maps.lines().find_map(|l| {
        let mut fields = l.split_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let (start, end) = (
            usize::from_str_radix(start, 16).ok()?,
            usize::from_str_radix(end, 16).ok()?,
        );
        (start <= addr && addr < end).then(|| fields.next().map(str::to_owned))?
    })
}

fn addresses(attached: &Attached) -> Vec<usize> {
    attached
        .chunks
        .iter()
        .map(|c| c.as_ptr() as usize)
        .collect()
}

fn all(attached: &Attached, byte: u8) -> bool {
    attached
        .chunks
        .iter()
        .all(|c| c.as_slice().iter().all(|&b| b == byte))
}

#[test]
fn sleep_gives_the_memory_up_and_wake_maps_the_next_generation_at_the_same_addresses() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "kv", 2, 1 << 20);
    let attached = client.attach("kv").unwrap();
    let before = addresses(&attached);
    assert_eq!(
        perms_at(attached.chunks[0].as_ptr()).as_deref(),
        Some("r--s")
    );
    let sleeping = client.sleep(attached).unwrap();
    // Reserved, no memory, no lease.
    for r in sleeping.reservations() {
        assert_eq!(perms_at(r.as_ptr()).as_deref(), Some("---p"));
    }
    let status = client.status().unwrap();
    assert!(
        status.regions[0]
            .generations
            .iter()
            .all(|g| g.readers.is_empty())
    );
    // A new generation, same layout: retired generation 1 is freed (no lease holds it).
    publish(&client, "kv", 2, 1 << 20);
    assert_eq!(client.status().unwrap().used, 2 << 20);
    let woken = client.wake(sleeping).unwrap();
    assert_eq!(woken.generation, 2);
    assert_eq!(addresses(&woken), before, "the same addresses");
    assert!(all(&woken, fill_byte(2)));
    assert_eq!(perms_at(woken.chunks[1].as_ptr()).as_deref(), Some("r--s"));
    assert_eq!(
        client.status().unwrap().regions[0].generations[0]
            .readers
            .len(),
        1
    );
}

#[test]
fn a_wake_onto_another_layout_is_refused_and_keeps_the_reservation() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "kv", 2, 1 << 20);
    let attached = client.attach("kv").unwrap();
    let before = addresses(&attached);
    let sleeping = client.sleep(attached).unwrap();
    let layout = sleeping.layout();
    publish(&client, "kv", 2, 1 << 19); // other chunk sizes
    let failed = client.wake(sleeping).unwrap_err();
    match &failed.error {
        MemdError::StaleLayout {
            region,
            generation,
            expected,
            found,
        } => {
            assert_eq!((region.as_str(), *generation), ("kv", 2));
            assert_eq!(*expected, layout);
            assert_ne!(found, expected);
        }
        other => panic!("{other:?}"),
    }
    let sleeping = failed.sleeping;
    for (r, &addr) in sleeping.reservations().iter().zip(&before) {
        assert_eq!(r.as_ptr() as usize, addr);
        assert_eq!(perms_at(r.as_ptr()).as_deref(), Some("---p"));
    }
    // The refused wake kept no lease.
    let status = client.status().unwrap();
    assert!(
        status.regions[0]
            .generations
            .iter()
            .all(|g| g.readers.is_empty())
    );
    // The old layout again: the wake goes through, at the same addresses.
    publish(&client, "kv", 2, 1 << 20);
    let woken = client.wake(sleeping).unwrap();
    assert_eq!((woken.generation, addresses(&woken)), (3, before));
    assert!(all(&woken, fill_byte(3)));
}
