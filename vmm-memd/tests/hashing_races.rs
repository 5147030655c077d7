//! Attacks on the service's background hashing of GPU generations (issue 32), from outside:
//! the real `vmm-memd` process and the real Rust client, on the fake driver
//! (`common/fake_driver.rs`: allocations are memfds, so what the service holds and maps, and
//! how far a pass has read, show in `/proc/<pid>/fd`, `maps` and `smaps`). A commit answers
//! at once and the service hashes the generation afterwards, on one background thread, 16 MiB
//! at a time (`src/registry/hashing.rs`); a `Verify` of a generation without digests yet takes
//! a pass of its own, and whichever pass ends first records its digests. Each attack comes
//! while a pass runs over a generation of 1 GiB (about a second here):
//!
//! - [`a_region_deleted_mid_hash_is_let_go_at_once`]: the region is deleted. The service
//!   keeps answering; the hashing thread gives the chunks up within a piece or so (its
//!   `moot` check), so no process holds the memory any more (the service's fds back to what
//!   they were, none in its keeper); a new region under the same name (generation 1 again)
//!   verifies with the digests of its own bytes. Otherwise a deleted 16 GiB region stays in
//!   memory for the 15 s of a pass nobody needs.
//! - [`a_discard_sleep_and_wake_mid_hash_give_zeros_and_their_digests`]: a reader's discard
//!   sleep frees the generation, and its wake makes the chunks again, zeroed. The old memory
//!   goes at once; the woken reader and a fresh one read zeros; `Verify` answers the digests
//!   of zeros, never those of the old bytes (which would make every later `Verify` a false
//!   alarm).
//! - [`a_verify_racing_the_background_pass_agrees_with_it`]: two `Verify`s race the
//!   background pass: all three passes finish, and both answers (and a later `Verify`'s) are
//!   the SHA-256 of the bytes written, computed here. A `Verify` that lost the race must
//!   answer the winner's digests, not none.
//! - [`a_write_between_the_background_pass_and_a_verify_is_caught`]: a hostile reader writes
//!   bytes the background pass has read and a racing `Verify` has not: the `Verify` must
//!   answer `DigestMismatch`, not record what it read over what the first pass recorded
//!   (which would hide the write for good).
//! - [`a_verify_outliving_its_generation_leaves_no_digests_on_a_new_one`]: a `Verify` still
//!   hashing a generation that is deleted and replaced by a new generation 1 under the same
//!   name must not record its digests on the new one (the same-chunks check of
//!   `record_digests`), or the new generation fails every `Verify` after.
//! - [`a_generation_a_verify_hashed_is_not_hashed_again`]: a generation a `Verify` hashed
//!   while it waited in the queue is skipped by the background thread (one pass, not two).
//! - [`a_sigterm_mid_hash_stops_the_service_promptly`]: SIGTERM mid-pass: the service stops
//!   well within the time a whole pass takes, and starts again on the same name. (A graceful
//!   stop lets the keeper go, by design: see `cli.rs`. After a crash, a restarted service
//!   takes a GPU generation back only on a real driver: `registry/kept.rs` refuses a memfd as
//!   a GPU chunk, and the fake's chunks are memfds. So no restart here finds the generation.)
//!
//! Two tests failed before `registry/verify.rs`: a `Verify` across a discard sleep and wake
//! reported tampering nobody did, and a stop waited for a `Verify`'s whole pass.
//!
//! Each test checks that the race it wants did happen (the pass was seen running, or reading
//! the chunk, when the attack came), and times a whole pass on the same machine in the same
//! test, so that its bounds scale with the machine. The tests take a lock file, so that two
//! of them (threads of one run, or nextest's processes) do not share the two cores and the
//! memory of a CI machine.

mod common;
#[path = "common/fake_driver.rs"]
mod fake_driver;
#[path = "common/gpu.rs"]
mod gpu_common;

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use common::{ServiceProc, until};
use fake_driver::{in_fake_exec, on_fake_driver};
use vmm_core::cuda::{Device, HandleType, IpcDescriptor, ResourceOptions, VirtualMemoryResource};
use vmm_fake_driver::DEVICE_UUID;
use vmm_memd::protocol::ChunkDigest;
use vmm_memd::{Client, GpuChunks, MemdError, Refusal};

const MIB: u64 = 1 << 20;

/// The attacked generations: 2 chunks of 512 MiB (a pass over them takes about a second).
const CHUNKS: [u64; 2] = [512 * MIB; 2];

/// A quota for a few such generations at once.
const QUOTA: [&str; 2] = ["--quota-bytes", "8589934592"];

/// How long the service must hold no mapping of a fake allocation before its passes are
/// taken to be over (it maps one chunk at a time; the gap between two is microseconds).
const SETTLE: Duration = Duration::from_millis(30);

/// The longest any wait here lasts (a pass takes about a second).
const LIMIT: Duration = Duration::from_secs(20);

/// What `/proc/<pid>/fd` links a fake allocation's memfd as.
const FAKE_MEMFD: &str = "/memfd:fake-cuda (deleted)";

/// Run `body` on the fake driver (see the module docs), one such test at a time on this
/// machine.
fn attack(test: &str, body: impl FnOnce()) {
    if in_fake_exec() {
        return on_fake_driver(test, body);
    }
    let path = std::env::temp_dir().join("vmm-memd-hashing-races.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .ok()
        .and_then(|file| nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).ok());
    on_fake_driver(test, body);
    drop(lock);
}

/// How many fds of process `pid` are a fake allocation's memfd (a GPU chunk it holds).
fn fake_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.flatten()
                .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.as_os_str() == FAKE_MEMFD))
                .count()
        })
        .unwrap_or(0)
}

/// How many mappings of process `pid` are of a fake allocation (a GPU chunk it has imported:
/// the service maps one only while it hashes it, or zeroes a fresh one).
fn fake_maps(pid: i32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("/memfd:fake-cuda"))
        .count()
}

/// The inodes of the fake allocations process `pid` maps, one per mapping.
fn mapped_inodes(pid: i32) -> Vec<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("/memfd:fake-cuda"))
        .filter_map(|l| l.split_whitespace().nth(4)?.parse().ok())
        .collect()
}

/// The bytes of its mappings of fake allocations that process `pid` has touched (their
/// `Rss` in `/proc/<pid>/smaps`): how far a pass over a chunk has read it.
fn mapped_rss(pid: i32) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut fake = false;
    let mut rss = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            fake = line.contains("/memfd:fake-cuda");
        } else if fake && first == "Rss:" {
            let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
            rss += kib << 10;
        }
    }
    rss
}

/// The inode of the file `fd` is open on.
fn inode_of(fd: &OwnedFd) -> u64 {
    std::fs::File::from(fd.try_clone().unwrap())
        .metadata()
        .unwrap()
        .ino()
}

/// The service's pid.
fn pid_of(service: &ServiceProc) -> i32 {
    service.child.id() as i32
}

/// Wait until the service maps a generation's chunk: a pass over it runs. When it was seen.
fn pass_runs(service: &ServiceProc) -> Instant {
    let pid = pid_of(service);
    until(LIMIT, || fake_maps(pid) > 0).expect("the service starts hashing the generation");
    Instant::now()
}

/// That an attack made `attacked` after a pass was seen running at `running` came while the
/// pass ran, a whole pass taking `pass`.
fn assert_raced(running: Instant, attacked: Instant, pass: Duration) {
    let into = attacked.duration_since(running);
    assert!(
        into < pass / 2,
        "the attack came {into:?} into a pass of {pass:?}: maybe after it (no race)"
    );
}

/// Wait until the service has mapped no chunk for [`SETTLE`]: its passes are over. How long
/// that took (less the settling).
fn passes_end(service: &ServiceProc) -> Duration {
    let pid = pid_of(service);
    let mut clear_since: Option<Instant> = None;
    let started = Instant::now();
    let took = until(LIMIT, || match (fake_maps(pid), clear_since) {
        (0, Some(since)) => since.elapsed() >= SETTLE,
        (0, None) => {
            clear_since = Some(Instant::now());
            false
        }
        _ => {
            clear_since = None;
            false
        }
    });
    took.expect("the service's passes end");
    started.elapsed().saturating_sub(SETTLE)
}

/// The first and last 4 KiB of chunk `chunk` of a generation written with `seed`.
fn ends(seed: u64, chunk: usize) -> (Vec<u8>, Vec<u8>) {
    (
        gpu_common::pattern(seed, chunk, 4096),
        gpu_common::pattern(seed + 1000, chunk, 4096),
    )
}

/// The byte everything but the ends of a generation written with `seed` holds.
fn fill_of(seed: u64) -> u8 {
    (seed % 200) as u8 + 17
}

/// Write every chunk of `gpu`: [`fill_of`] `seed`, its [`ends`] a pattern of the seed and
/// the chunk (so the digests differ per chunk and per seed, and a pass that skipped or
/// repeated a piece would not match).
fn write_generation(gpu: &GpuChunks, seed: u64) {
    gpu.buffer().fill(fill_of(seed)).expect("fill the chunks");
    for (i, &len) in gpu.chunk_sizes().iter().enumerate() {
        let at = gpu.chunk_offset(i).unwrap() as usize;
        let (head, tail) = ends(seed, i);
        gpu.buffer().write_at(at, &head).unwrap();
        gpu.buffer()
            .write_at(at + len as usize - tail.len(), &tail)
            .unwrap();
    }
}

/// The SHA-256 of `len` bytes: `head`, then `fill` bytes, then `tail`.
fn digest_of(len: u64, head: &[u8], fill: u8, tail: &[u8]) -> ChunkDigest {
    let block = vec![fill; 16 << 20];
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    context.update(head);
    let mut left = len as usize - head.len() - tail.len();
    while left > 0 {
        let n = left.min(block.len());
        context.update(&block[..n]);
        left -= n;
    }
    context.update(tail);
    context.finish().as_ref().try_into().unwrap()
}

/// The digests of a generation of `sizes` written with `seed` ([`write_generation`]),
/// computed here.
fn digests_of(sizes: &[u64], seed: u64) -> Vec<ChunkDigest> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let (head, tail) = ends(seed, i);
            digest_of(len, &head, fill_of(seed), &tail)
        })
        .collect()
}

/// The digests of chunks of `sizes` that hold zeros.
fn zero_digests(sizes: &[u64]) -> Vec<ChunkDigest> {
    sizes
        .iter()
        .map(|&len| digest_of(len, &[], 0, &[]))
        .collect()
}

/// Publish a generation of GPU region `region` with chunks of `sizes` written with `seed`:
/// its number. The service starts hashing it as the commit returns.
fn publish(client: &Client, region: &str, sizes: &[u64], seed: u64) -> u64 {
    let writer = client
        .begin(region, sizes, gpu_common::on(DEVICE_UUID))
        .expect("begin on the fake device");
    let gpu = writer.gpu().expect("a GPU writer");
    assert_eq!(gpu.chunk_sizes(), sizes, "sizes are multiples of 2 MiB");
    write_generation(gpu, seed);
    writer.commit().expect("commit")
}

/// Whether every byte `gpu` maps is zero (read 16 MiB at a time).
fn all_zero(gpu: &GpuChunks) -> bool {
    let zeros = vec![0u8; 16 << 20];
    let mut piece = vec![1u8; zeros.len()];
    let size = gpu.buffer().size();
    (0..size).step_by(zeros.len()).all(|at| {
        let n = zeros.len().min(size - at);
        gpu.buffer().read_at(at, &mut piece[..n]).unwrap();
        piece[..n] == zeros[..n]
    })
}

/// A request answered within a second while the service hashes: it keeps serving.
fn answers_at_once(client: &Client) {
    let asked = Instant::now();
    client.status().expect("status while the service hashes");
    client.list().expect("list while the service hashes");
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "the service took {:?} to answer while it hashed",
        asked.elapsed()
    );
}

/// The region is deleted while the service hashes its only generation (1 GiB): the hashing
/// thread lets the chunks go within a piece or so, not at the end of its pass, so no process
/// holds them any more (the service's fds back to what they were before the publish, none in
/// the keeper); the service answers throughout; a new generation under the same name (a new
/// region: generation 1 again, what the abandoned pass was for) verifies with the digests of
/// its own bytes. Breaks if the hashing thread ignores that its generation went (`moot`).
#[test]
fn a_region_deleted_mid_hash_is_let_go_at_once() {
    attack("a_region_deleted_mid_hash_is_let_go_at_once", || {
        let service = ServiceProc::start(&QUOTA);
        let pid = pid_of(&service);
        let client = service.connect();
        // The device opened and a small generation hashed and deleted: what is left open
        // after that is the baseline.
        publish(&client, "warm-up", &[2 * MIB], 1);
        passes_end(&service);
        client.delete("warm-up").unwrap();
        let keeper = service.keeper_pid().expect("the service's keeper");
        until(LIMIT, || fake_fds(pid) + fake_fds(keeper) == 0).expect("the warm-up goes");
        let baseline = service.fd_count();

        let generation = publish(&client, "weights", &CHUNKS, 2);
        assert_eq!(generation, 1);
        let running = pass_runs(&service);
        answers_at_once(&client);
        client
            .delete("weights")
            .expect("delete while the service hashes");
        let deleted = Instant::now();
        until(LIMIT, || {
            fake_fds(pid) == 0
                && fake_maps(pid) == 0
                && fake_fds(keeper) == 0
                && service.fd_count() == baseline
        })
        .unwrap_or_else(|| {
            panic!(
                "the deleted generation is still held: service {} fds ({} of chunks) and {} \
                 mappings, keeper {} chunk fds; {baseline} fds before",
                service.fd_count(),
                fake_fds(pid),
                fake_maps(pid),
                fake_fds(keeper)
            )
        });
        let released = deleted.elapsed();
        answers_at_once(&client);
        assert!(client.list().unwrap().is_empty(), "{:?}", client.list());
        assert_eq!(client.status().unwrap().used, 0, "the quota is given back");
        // No process holds it: not the writer (its mapping went at commit), not this one.
        assert_eq!(fake_fds(std::process::id() as i32), 0);
        assert_eq!(fake_maps(std::process::id() as i32), 0);

        // The same name again, other bytes: generation 1 of a new region.
        let generation = publish(&client, "weights", &CHUNKS, 3);
        assert_eq!(generation, 1, "a new region starts at 1 again");
        pass_runs(&service);
        let pass = passes_end(&service);
        assert_eq!(
            client
                .verify("weights", None)
                .expect("the new generation verifies"),
            digests_of(&CHUNKS, 3)
        );
        println!("a pass over 1 GiB took {pass:?}; the deleted one was let go after {released:?}");
        assert_raced(running, deleted, pass);
        assert!(
            released < pass / 3,
            "the deleted generation was let go after {released:?}, a whole pass takes {pass:?}: \
             the hashing thread finished a pass nobody needed"
        );
    });
}

/// A reader's discard sleep frees the generation while the service hashes it, and its wake
/// (as soon as the old chunks went, long before the pass would have ended) makes the chunks
/// again, zeroed, with the digests of zeros. The old chunks go within a piece or so of the sleep: no process
/// holds or maps them (not the service, its keeper, or this reader); the woken reader (at
/// its slept address) and a fresh one read zeros; `Verify` answers the digests of zeros,
/// never those of the old bytes, and the generation keeps its number. Breaks if the hashing
/// thread keeps the old chunks for its whole pass once they were let go (`moot`).
#[test]
fn a_discard_sleep_and_wake_mid_hash_give_zeros_and_their_digests() {
    attack(
        "a_discard_sleep_and_wake_mid_hash_give_zeros_and_their_digests",
        || {
            let service = ServiceProc::start(&QUOTA);
            let pid = pid_of(&service);
            let me = std::process::id() as i32;
            let keeper = service.keeper_pid().expect("the service's keeper");
            let client = service.connect();
            let generation = publish(&client, "kv", &CHUNKS, 4);
            let attached = client
                .attach("kv")
                .expect("attach while the service hashes");
            let address = attached.gpu.as_ref().unwrap().device_ptr();
            let running = pass_runs(&service);
            let slept = Instant::now();
            let sleeping = client
                .sleep_discard(attached)
                .expect("a discard sleep while the service hashes");
            until(LIMIT, || {
                fake_fds(pid) + fake_fds(keeper) + fake_fds(me) == 0
                    && fake_maps(pid) + fake_maps(me) == 0
            })
            .unwrap_or_else(|| {
                panic!(
                    "the discarded chunks are still held: the service holds {} chunk fds and \
                     {} mappings, its keeper {} chunk fds, this reader {} and {}",
                    fake_fds(pid),
                    fake_maps(pid),
                    fake_fds(keeper),
                    fake_fds(me),
                    fake_maps(me)
                )
            });
            let released = slept.elapsed();

            let woken = client.wake(sleeping).expect("the wake");
            assert_eq!(woken.generation, generation);
            let gpu = woken.gpu.as_ref().unwrap();
            assert_eq!(gpu.device_ptr(), address, "woken at the slept address");
            assert!(all_zero(gpu), "the woken reader reads zeros");
            // The service and its keeper hold the two new chunks, and nothing else.
            until(LIMIT, || {
                fake_fds(pid) == CHUNKS.len()
                    && fake_maps(pid) == 0
                    && fake_fds(keeper) == CHUNKS.len()
            })
            .expect("the service and its keeper hold the new chunks only");
            let verified = Instant::now();
            let digests = client
                .verify("kv", None)
                .expect("the woken generation verifies");
            let pass = verified.elapsed();
            assert!(
                digests != digests_of(&CHUNKS, 4),
                "Verify answers the digests of the discarded bytes"
            );
            assert_eq!(digests, zero_digests(&CHUNKS), "the digests of zeros");
            let fresh = service.connect();
            let reader = fresh.attach("kv").expect("a fresh reader");
            assert_eq!(reader.generation, generation);
            assert!(
                all_zero(reader.gpu.as_ref().unwrap()),
                "a fresh reader reads zeros"
            );
            println!("a pass over 1 GiB took {pass:?}; the old chunks went after {released:?}");
            assert_raced(running, slept, pass);
            assert!(
                released < pass / 3,
                "the discarded chunks went after {released:?}, a whole pass takes {pass:?}: \
                 the hashing thread finished a pass nobody needed"
            );
        },
    );
}

/// Two `Verify`s of a generation sent while the background pass hashes it (each takes a
/// pass of its own: the generation has no digests yet), from two connections: all three
/// passes run at once, all finish, and both answers are the SHA-256 of the bytes written
/// (computed here), as is a `Verify` after the service settled. Breaks if a `Verify` that
/// finds no digests answers none, or answers none when another pass recorded first.
#[test]
fn a_verify_racing_the_background_pass_agrees_with_it() {
    attack("a_verify_racing_the_background_pass_agrees_with_it", || {
        let service = ServiceProc::start(&QUOTA);
        let pid = pid_of(&service);
        let expected = digests_of(&CHUNKS, 5);
        let client = service.connect();
        publish(&client, "w", &CHUNKS, 5);
        pass_runs(&service);
        let (first, second, most) = std::thread::scope(|scope| {
            let verify = || {
                let client = service.connect();
                scope.spawn(move || client.verify("w", None))
            };
            let (first, second) = (verify(), verify());
            // How many passes the service runs at once, at most, while they run.
            let mut most = 0;
            while !(first.is_finished() && second.is_finished()) {
                most = most.max(fake_maps(pid));
                std::thread::sleep(Duration::from_millis(1));
            }
            (first.join().unwrap(), second.join().unwrap(), most)
        });
        assert!(
            most >= 2,
            "the Verifys' passes and the background pass did not overlap (at most {most} at once)"
        );
        for (which, answer) in [("first", first), ("second", second)] {
            assert_eq!(
                answer.unwrap_or_else(|e| panic!("the {which} Verify: {e:?}")),
                expected,
                "the {which} Verify's digests are not those of the bytes written"
            );
        }
        passes_end(&service);
        assert_eq!(
            client.verify("w", None).unwrap(),
            expected,
            "the digests recorded are not those of the bytes written"
        );
    });
}

/// A `Verify` of a generation not hashed yet (the background thread is busy with another
/// region's) is still hashing it when the region is deleted and a new generation 1 is
/// committed under the same name (other chunks, the same count): the `Verify`'s digests must
/// not land on the new generation, which verifies with the digests of its own bytes. Breaks
/// if `record_digests` does not check that the generation still has the chunks hashed.
///
/// The race needs the background thread still busy when the `Verify` ends; where it was not
/// (a machine much slower at one than the other), it runs again, up to three times.
#[test]
fn a_verify_outliving_its_generation_leaves_no_digests_on_a_new_one() {
    attack(
        "a_verify_outliving_its_generation_leaves_no_digests_on_a_new_one",
        || {
            let service = ServiceProc::start(&QUOTA);
            let pid = pid_of(&service);
            let client = service.connect();
            let old = [128 * MIB; 2];
            let new = [2 * MIB; 2];
            for attempt in 1..=3 {
                // The background thread busy for about a second with "busy", then "r"
                // (written first, committed once that pass runs) queued behind it.
                let r_writer = service.connect();
                let writer = r_writer
                    .begin("r", &old, gpu_common::on(DEVICE_UUID))
                    .expect("begin r");
                write_generation(writer.gpu().unwrap(), 20 + attempt);
                publish(&client, "busy", &CHUNKS, 10 + attempt);
                pass_runs(&service);
                assert_eq!(writer.commit().expect("commit r"), 1);
                let (verified, raced) = std::thread::scope(|scope| {
                    let verifier = service.connect();
                    let verify = scope.spawn(move || verifier.verify("r", None));
                    // Its pass runs next to the background one.
                    until(LIMIT, || fake_maps(pid) >= 2 || verify.is_finished())
                        .expect("the Verify starts its pass");
                    client.delete("r").expect("delete while the Verify hashes");
                    let generation = publish(&client, "r", &new, 30 + attempt);
                    assert_eq!(generation, 1);
                    let replaced_in_time = !verify.is_finished();
                    let verified = verify.join().unwrap();
                    // The background thread still on "busy": the new "r" has no digests.
                    let busy_after = fake_maps(pid) > 0;
                    (verified, replaced_in_time && busy_after)
                });
                println!("attempt {attempt}: the Verify answered {verified:?}; raced: {raced}");
                passes_end(&service);
                assert_eq!(
                    client
                        .verify("r", None)
                        .expect("the new generation verifies"),
                    digests_of(&new, 30 + attempt),
                    "the new generation 1 of \"r\" carries another generation's digests"
                );
                client.delete("r").unwrap();
                client.delete("busy").unwrap();
                if raced {
                    return;
                }
            }
            panic!("three attempts, and the race never happened");
        },
    );
}

/// A hostile reader (this process: an attach without mapping, the fd imported read-write
/// on its own) writes the start of chunk 0 after the background pass read it, and a `Verify`
/// is sent then, while that pass is still on its way: the `Verify`'s pass reads the written
/// bytes, the background pass records the bytes it read first, and the `Verify` answers
/// `DigestMismatch` for chunk 0, as does a later one. Breaks if the `Verify` records its
/// digests over the background pass's (which would hide the write for good), or answers
/// without comparing.
#[test]
fn a_write_between_the_background_pass_and_a_verify_is_caught() {
    attack(
        "a_write_between_the_background_pass_and_a_verify_is_caught",
        || {
            let service = ServiceProc::start(&QUOTA);
            let pid = pid_of(&service);
            let client = service.connect();
            let generation = publish(&client, "victim", &CHUNKS, 12);
            let hostile = service.connect();
            let unmapped = hostile.attach_unmapped("victim", None).unwrap();
            let (fd, len) = &unmapped.chunks[0];
            let len = *len as usize;
            let descriptor =
                IpcDescriptor::from_fds(&[fd.as_fd()], &[len], HandleType::PosixFd, len).unwrap();
            let writable =
                VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default())
                    .unwrap()
                    .import(&descriptor)
                    .expect("the hostile reader's writable import");
            let chunk0 = inode_of(fd);
            // The background pass half way through chunk 0: a head start of 256 MiB on the
            // Verify's pass, which it keeps (the two run side by side, 16 MiB at a time).
            until(LIMIT, || {
                mapped_inodes(pid) == [chunk0] && mapped_rss(pid) >= CHUNKS[0] / 2
            })
            .expect("the background pass reads chunk 0");
            writable.write_at(0, b"tampered").unwrap();
            let verified = std::thread::scope(|scope| {
                let verifier = service.connect();
                let verify = scope.spawn(move || verifier.verify("victim", None));
                // Where the background pass was done first, the race is lost: say so.
                until(LIMIT, || {
                    mapped_inodes(pid).len() >= 2 || verify.is_finished()
                })
                .expect("the Verify starts its pass");
                assert!(
                    !verify.is_finished(),
                    "the Verify was over before the background pass: no race"
                );
                verify.join().unwrap()
            });
            let mismatch = |answer: vmm_memd::Result<Vec<ChunkDigest>>| match answer {
                Err(MemdError::Refused(Refusal::DigestMismatch {
                    generation: g,
                    chunk,
                    expected,
                    ..
                })) => (g, chunk, expected),
                other => panic!("a write after the background pass was not caught: {other:?}"),
            };
            let committed = digests_of(&CHUNKS, 12);
            assert_eq!(mismatch(verified), (generation, 0, committed[0]));
            passes_end(&service);
            assert_eq!(
                mismatch(client.verify("victim", None)),
                (generation, 0, committed[0])
            );
        },
    );
}

/// A generation queued behind another's pass is verified (its digests taken by the
/// `Verify`, which answers those of the bytes written) before the background thread gets
/// to it: that thread then skips it (it never maps its chunks), so a `Verify` costs the one
/// pass only. Breaks if the background thread hashes a generation that has its digests.
#[test]
fn a_generation_a_verify_hashed_is_not_hashed_again() {
    attack("a_generation_a_verify_hashed_is_not_hashed_again", || {
        let service = ServiceProc::start(&QUOTA);
        let pid = pid_of(&service);
        let client = service.connect();
        let small = [64 * MIB; 2];
        // "r" written first and committed once the pass over "busy" runs: queued behind it.
        let r_writer = service.connect();
        let writer = r_writer
            .begin("r", &small, gpu_common::on(DEVICE_UUID))
            .expect("begin r");
        write_generation(writer.gpu().unwrap(), 13);
        publish(&client, "busy", &CHUNKS, 14);
        pass_runs(&service);
        writer.commit().expect("commit r");
        let unmapped = client.attach_unmapped("r", None).unwrap();
        let inodes: Vec<u64> = unmapped.chunks.iter().map(|(fd, _)| inode_of(fd)).collect();
        client.detach_lease(unmapped.lease).unwrap();
        assert_eq!(
            client.verify("r", None).expect("verify r"),
            digests_of(&small, 13)
        );
        assert!(
            fake_maps(pid) > 0,
            "the pass over \"busy\" was over before the Verify of \"r\": no race"
        );
        let mut hashed_again = false;
        let mut clear_since: Option<Instant> = None;
        until(LIMIT, || {
            let mapped = mapped_inodes(pid);
            hashed_again |= mapped.iter().any(|i| inodes.contains(i));
            match (mapped.is_empty(), clear_since) {
                (true, Some(since)) => since.elapsed() >= SETTLE,
                (true, None) => {
                    clear_since = Some(Instant::now());
                    false
                }
                (false, _) => {
                    clear_since = None;
                    false
                }
            }
        })
        .expect("the service's passes end");
        assert!(
            !hashed_again,
            "the background thread hashed \"r\" again after a Verify had taken its digests"
        );
        assert_eq!(client.verify("r", None).unwrap(), digests_of(&small, 13));
    });
}

/// SIGTERM while the background pass runs over a generation of 1 GiB: the service exits (0)
/// well within the time a whole pass takes, measured afterwards on the service started
/// again on the same name (which answers and hashes as before). Breaks if the pass does not
/// ask the stop flag between its pieces.
#[test]
fn a_sigterm_mid_hash_stops_the_service_promptly() {
    attack("a_sigterm_mid_hash_stops_the_service_promptly", || {
        let mut service = ServiceProc::start(&QUOTA);
        let client = service.connect();
        publish(&client, "w", &CHUNKS, 6);
        let running = pass_runs(&service);
        service.signal(libc::SIGTERM);
        let signalled = Instant::now();
        until(LIMIT, || service.child.try_wait().unwrap().is_some()).expect("the service stops");
        let exited = signalled.elapsed();
        let status = service.child.wait().unwrap();
        assert!(status.success(), "{status:?}");
        assert!(matches!(client.list(), Err(MemdError::ServiceGone(_))));

        service.restart();
        let client = service.connect();
        publish(&client, "w", &CHUNKS, 7);
        pass_runs(&service);
        let pass = passes_end(&service);
        assert_eq!(client.verify("w", None).unwrap(), digests_of(&CHUNKS, 7));
        println!("a pass over 1 GiB took {pass:?}; the service stopped after {exited:?}");
        assert_raced(running, signalled, pass);
        // Without the stop flag, the stop waits for the rest of the pass: all of it, nearly.
        assert!(
            exited < pass * 3 / 4,
            "the service took {exited:?} to stop, a whole pass takes {pass:?}: it finished \
             its pass first"
        );
    });
}

/// A `Verify` of a generation not hashed yet takes its own pass over the chunks it was
/// handed; a discard sleep and a wake replace those chunks meanwhile (zeroed, with the
/// digests of zeros). The `Verify` must not compare what it read (the old bytes) with the new
/// chunks' digests: that answered `DigestMismatch` for chunk 0 (someone wrote the generation
/// through a writable mapping; nobody did), because the digests it fetched again after
/// `record_digests` refused were those of other chunks. It gives that pass up and verifies
/// the generation's chunks now (`registry/verify.rs`).
#[test]
fn a_verify_across_a_discard_sleep_and_wake_reports_no_tampering() {
    attack(
        "a_verify_across_a_discard_sleep_and_wake_reports_no_tampering",
        || {
            let service = ServiceProc::start(&QUOTA);
            let pid = pid_of(&service);
            let client = service.connect();
            publish(&client, "kv", &CHUNKS, 8);
            pass_runs(&service);
            let verified = std::thread::scope(|scope| {
                let verifier = service.connect();
                let verify = scope.spawn(move || verifier.verify("kv", None));
                until(LIMIT, || fake_maps(pid) >= 2 || verify.is_finished())
                    .expect("the Verify starts its pass");
                client
                    .sleep_region("kv")
                    .expect("sleep while the Verify hashes");
                client
                    .wake_region("kv")
                    .expect("wake while the Verify hashes");
                assert!(!verify.is_finished(), "no race: the Verify was over");
                verify.join().unwrap()
            });
            assert!(
                !matches!(
                    verified,
                    Err(MemdError::Refused(Refusal::DigestMismatch { .. }))
                ),
                "a Verify that raced a discard sleep and wake reports tampering: {verified:?}"
            );
        },
    );
}

/// SIGTERM while a client's `Verify` hashes a generation of 1 GiB: the service must exit
/// promptly, not once that pass is over (a `Verify`'s pass asked no stop flag, so a stop
/// during a `Verify` of 16 GiB waited about 15 s; it asks per 16 MiB piece now).
#[test]
fn a_sigterm_mid_verify_stops_the_service_promptly() {
    attack("a_sigterm_mid_verify_stops_the_service_promptly", || {
        let service = ServiceProc::start(&QUOTA);
        let pid = pid_of(&service);
        let client = service.connect();
        publish(&client, "w", &CHUNKS, 9);
        pass_runs(&service);
        let pass = passes_end(&service);
        let mut service = service;
        let exited = std::thread::scope(|scope| {
            let verifier = service.connect();
            let verify = scope.spawn(move || verifier.verify("w", None));
            until(LIMIT, || fake_maps(pid) > 0 || verify.is_finished())
                .expect("the Verify starts its pass");
            service.signal(libc::SIGTERM);
            let exited = until(LIMIT, || service.child.try_wait().unwrap().is_some())
                .expect("the service stops");
            let _ = verify.join().unwrap();
            exited
        });
        println!("a pass over 1 GiB took {pass:?}; the service stopped after {exited:?}");
        assert!(
            exited < pass * 3 / 4,
            "the service took {exited:?} to stop, a whole pass takes {pass:?}: it waited for \
             the Verify's pass"
        );
    });
}
