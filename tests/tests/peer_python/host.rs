//! The host path, which runs everywhere: memfd buffers between Rust and the Python peer, both
//! ways and with either side listening, and the Python modules' own unit tests.

use std::io::{BufRead, BufReader};
use std::time::Duration;

use vmm_core::peer::Session;
use vmm_core::shm::HostBuffer;
use vmm_core::testing::{settled_open_fds, skip_unless};
use vmm_core::wire::endpoint::{Listener, Name};
use vmm_tests::turns::exclusive;
use vmm_tests::{own_uid, pattern, text};

use super::{finish_ok, finish_ok_after, python, python_dir, python3, role, unique};

#[test]
fn python_unit_tests() {
    // Every test counts fds or starts processes: one at a time.
    let _turn = exclusive();
    if !skip_unless(python3()) {
        return;
    }
    // The protocol peer's tests (codec and endpoints, attacks, availability), and vmm_ipc_cuda's
    // logic against a fake cuda.bindings.
    let py = python_dir();
    let output = python(
        &py,
        &[
            "-m",
            "unittest",
            "-v",
            "test_vmm_ipc_peer",
            "test_vmm_ipc_attacks",
            "test_vmm_ipc_availability",
            "test_vmm_ipc_cuda",
            "test_vmm_ipc_fabric",
        ],
    )
    .output()
    .unwrap();
    let out = text(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.contains("\nOK"), "{out}");
    assert!(
        out.contains("test_a_two_chunk_export_is_imported_over_an_endpoint")
            && out.contains("test_a_memfd_travels_both_ways_and_nothing_leaks")
            && out.contains("test_a_hostile_fd_whose_close_blocks_does_not_hold_up_a_receive")
            && out.contains("test_a_drain_tells_an_empty_packet_from_the_end")
            && out.contains("test_every_receipt_check_of_cuda_fabric")
            && out.contains("test_a_fabric_export_is_imported_over_tcp"),
        "{out}"
    );
    // The availability attacks (another uid, prlimit, raw sockets) must really run where they
    // can: as root (CI and the GPU runs are), a skip of one is a failure.
    if vmm_tests::own_uid() == "0" {
        for test in [
            "test_refused_lingering_sockets_do_not_jam_the_listener",
            "test_a_listener_at_its_fd_limit_admits_its_own_uid_and_waits_out_emfile",
            "test_one_uids_idle_connections_do_not_starve_another",
            "test_idle_connections_are_shut_down_and_admission_is_fair",
        ] {
            let line = out.lines().find(|l| l.starts_with(test));
            assert!(
                line.is_some_and(|l| l.ends_with("ok")),
                "{test} did not run and pass: {line:?}\n{out}"
            );
        }
    }
}

#[test]
fn a_rust_listener_serves_a_host_buffer_to_the_python_peer() {
    // Every test counts fds or starts processes: one at a time.
    let _turn = exclusive();
    if !skip_unless(python3()) {
        return;
    }
    let py = python_dir();
    let dir = std::env::temp_dir().join(format!("vmm-peer-owner-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for name in [unique("host"), Name::path(dir.join("owner.sock"))] {
        let before = settled_open_fds().unwrap();
        let listener = Listener::bind(&name).unwrap();
        let buf = HostBuffer::new(3 << 20).unwrap();
        buf.write_at(0, &pattern(20, buf.size())).unwrap();
        let child = role(
            &py,
            "host-client",
            &[&name.to_string(), &own_uid(), "20", "21"],
        );
        let pid = child.id() as i32;
        let conn = Session::accept(&listener, Some(Duration::from_secs(30))).unwrap();
        assert_eq!(conn.peer().pid, pid, "the kernel names the Python process");
        let descriptor = buf.export().unwrap();
        conn.send_descriptor(&descriptor).unwrap();
        drop(descriptor);
        assert_eq!(conn.recv_data().unwrap(), b"done");
        let out = finish_ok(child, Duration::from_secs(30));
        assert!(out.contains("OK mapped 3145728 bytes"), "{out}");
        assert_eq!(buf.to_vec(), pattern(21, buf.size()), "Python's writes");
        drop((conn, listener, buf));
        assert_eq!(settled_open_fds().unwrap(), before, "fds after {name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_python_memfd_exporter_sends_to_a_rust_importer() {
    // Every test counts fds or starts processes: one at a time.
    let _turn = exclusive();
    if !skip_unless(python3()) {
        return;
    }
    let py = python_dir();
    let name = unique("exporter");
    let before = settled_open_fds().unwrap();
    let listener = Listener::bind(&name).unwrap();
    let size = 1_000_003; // not a page multiple: the import maps exactly the size
    let child = role(
        &py,
        "host-exporter",
        &[&name.to_string(), &own_uid(), &size.to_string(), "30"],
    );
    let conn = Session::accept(&listener, Some(Duration::from_secs(30))).unwrap();
    let descriptor = conn.recv_descriptor().unwrap().into_host().unwrap();
    assert_eq!(descriptor.size(), size);
    let buf = HostBuffer::import(&descriptor).unwrap();
    drop(descriptor);
    assert_eq!(buf.to_vec(), pattern(30, size), "the exporter's pattern");
    buf.write_at(0, &pattern(31, size)).unwrap();
    conn.send_data(b"written").unwrap();
    let out = finish_ok(child, Duration::from_secs(30));
    assert!(out.contains("the importer wrote them"), "{out}");
    drop((buf, conn, listener));
    assert_eq!(settled_open_fds().unwrap(), before);
}

#[test]
fn a_python_listener_serves_a_rust_client() {
    // Every test counts fds or starts processes: one at a time.
    let _turn = exclusive();
    if !skip_unless(python3()) {
        return;
    }
    let py = python_dir();
    let name = unique("py-listener");
    let before = settled_open_fds().unwrap();
    let mut child = role(&py, "host-listener", &[&name.to_string(), "65536", "40"]);
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while line.trim() != "READY" {
        line.clear();
        assert_ne!(stdout.read_line(&mut line).unwrap(), 0, "the listener died");
    }
    // The Rust client checks the Python listener's credentials (our uid) and is admitted.
    let conn = Session::connect(&name).unwrap();
    assert_eq!(conn.peer().pid, child.id() as i32);
    let buf = HostBuffer::import(&conn.recv_descriptor().unwrap().into_host().unwrap()).unwrap();
    assert_eq!(buf.to_vec(), pattern(40, 65536));
    buf.write_at(0, &pattern(41, 65536)).unwrap();
    conn.send_data(b"done").unwrap();
    let out = finish_ok_after(child, Duration::from_secs(30), Some(stdout));
    assert!(out.contains("OK served"), "{out}");
    drop((buf, conn));
    assert_eq!(settled_open_fds().unwrap(), before);
}
