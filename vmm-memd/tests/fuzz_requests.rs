//! Structured fuzzing of the service's request decoder (`protocol::decode_request`, the
//! function every connection thread runs on a client's `DATA` bytes), and the same hostile
//! bytes sent to a running service.
//!
//! - Offline: random bytes, valid requests (every variant, with lengths at and past every cap:
//!   region names, chunk lists, ACL lists, metadata keys, whole requests of exactly
//!   `MAX_REQUEST` and one byte more) and mutated encodings of valid requests (flipped,
//!   inserted, removed and overwritten bytes, truncation, huge varint counts, padding to the
//!   cap). For every input: no panic; over `MAX_REQUEST` a `TooLarge` refusal with no heap
//!   allocation at all; otherwise a request or an `InvalidRequest { rule: Decode }`, with the
//!   decoder's peak heap bounded by [`HEAP_PER_BYTE`] per input byte (at most 192 KiB for a
//!   request at the cap); a valid request decodes to itself; a decoded one re-encodes to bytes
//!   that decode to it again.
//! - Live: the same generator's bytes sent to a `vmm-memd` process over its socket get the
//!   refusal the decoder gives (same variant and rule) on a connection that keeps working, a
//!   descriptor sent as a request is refused and its fd closed, malformed packets (with fds)
//!   end only their own connection, a bystander reader is served throughout, and the
//!   service's fd count is back where it was.
//!
//! Bounded and reproducible, as `tests/tests/fuzz_wire.rs`: `VMM_FUZZ_CASES` generated
//! inputs (default 10 000 offline, about 15 s in a debug build; a twentieth of that
//! live), a fixed seed unless
//! `VMM_FUZZ_SEED` is set; the corpus below runs first.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use common::{ServiceProc, publish, until};
use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, sendmsg};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use vmm_core::shm::HostBuffer;
use vmm_memd::protocol::{
    Acl, Dtype, MAX_ACL_ENTRIES, MAX_CHUNKS, MAX_KEY_LEN, MAX_REGION_NAME, MAX_REQUEST, Principal,
    Request, Response, TensorMeta, decode_request,
};
use vmm_memd::{Refusal, RequestRule};

// ---- heap accounting: per thread, so parallel tests do not disturb each other ----

/// The system allocator, counting the bytes live on each thread and their peak.
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn account(delta: isize) {
    // `try_with`: never panics in the allocator, even while the thread's locals go away.
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is forwarded to `System` unchanged; the counters are plain thread-local
// cells with const initialisers (no allocation, no destructor).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) };
        account(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            account(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Run `f`; the most heap it had live at once on this thread (what it returns included).
fn peak_heap<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let result = f();
    let peak = PEAK.with(Cell::get);
    (result, (peak - base).max(0) as usize)
}

/// The decoder's heap bound, in bytes per input byte. postcard hands serde a sequence's
/// announced count only when it is at most the bytes left (`SeqAccess::size_hint`), and
/// serde's `Vec` reserves that many elements; the largest element of a request is a metadata
/// entry, `(String, TensorMeta)` (72 bytes, at least 6 on the wire), which the service's
/// capped list reader (`src/capped.rs`) no longer reserves by the announced count (that let a
/// `PutMeta` of 8 KiB reserve 590 KB, 72 bytes per input byte): it reserves 16 and grows as
/// entries decode, so at most twice the decoded entries' 72 bytes per 6 input bytes, 24 per
/// byte (a shape's or a chunk list's `u64`s, reserved by count, are 8 per byte). Measured:
/// 18 (a list that just doubled). With serde's own `Vec` reader this bound fails (`PutMeta`
/// announcing as many entries as bytes follow, in the corpus).
const HEAP_PER_BYTE: usize = 24;

/// Room for the refusal's words (`InvalidRequest::detail`).
const HEAP_SLACK: usize = 4096;

// ---- inputs ----

const NAME_CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._/-";

/// Region names and keys: valid ones (up to `max` + 1 bytes: one past the cap, which only the
/// service's checks refuse), and any characters at all.
fn name(max: usize) -> impl Strategy<Value = String> {
    let chars = |n: std::ops::RangeInclusive<usize>| {
        proptest::collection::vec(proptest::sample::select(NAME_CHARS), n)
            .prop_map(|b| String::from_utf8(b).expect("ASCII"))
    };
    // Mostly short (cheap to make), sometimes any length up to one past the cap.
    let valid = prop_oneof![4 => chars(0..=16), 1 => chars(0..=max + 1)];
    let any = proptest::collection::vec(any::<char>(), 0..24).prop_map(String::from_iter);
    let edges = prop_oneof![
        Just(String::new()),
        Just("x".repeat(max)),
        Just("x".repeat(max + 1)),
    ];
    prop_oneof![4 => valid, 1 => any, 1 => edges]
}

/// Sizes, offsets, leases, waits: the edges and anything.
fn number() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(4096),
        Just(1 << 40),
        Just(u64::MAX),
        0u64..100_000,
        any::<u64>(),
    ]
}

fn principals() -> impl Strategy<Value = Vec<Principal>> {
    let one = prop_oneof![
        any::<u32>().prop_map(Principal::Uid),
        any::<u32>().prop_map(Principal::Gid)
    ];
    prop_oneof![
        3 => proptest::collection::vec(one.clone(), 0..4),
        1 => proptest::collection::vec(one, MAX_ACL_ENTRIES..=MAX_ACL_ENTRIES + 1),
    ]
}

fn dtype() -> impl Strategy<Value = Dtype> {
    proptest::sample::select(vec![
        Dtype::U8,
        Dtype::I8,
        Dtype::U16,
        Dtype::I16,
        Dtype::U32,
        Dtype::I32,
        Dtype::U64,
        Dtype::I64,
        Dtype::F16,
        Dtype::BF16,
        Dtype::F32,
        Dtype::F64,
        Dtype::Bool,
    ])
}

fn tensor() -> impl Strategy<Value = (String, TensorMeta)> {
    (
        name(MAX_KEY_LEN),
        any::<u32>(),
        number(),
        number(),
        dtype(),
        proptest::collection::vec(number(), 0..6),
    )
        .prop_map(|(key, chunk, offset, len, dtype, shape)| {
            let meta = TensorMeta {
                chunk,
                offset,
                len,
                dtype,
                shape,
            };
            (key, meta)
        })
}

/// Any request, every field the client's choice; some encode past `MAX_REQUEST`.
fn request() -> impl Strategy<Value = Request> {
    let chunks = prop_oneof![
        3 => proptest::collection::vec(number(), 0..5),
        1 => proptest::collection::vec(number(), MAX_CHUNKS..=MAX_CHUNKS + 1),
    ];
    let begin = (
        name(MAX_REGION_NAME),
        chunks,
        principals(),
        principals(),
        principals(),
        number(),
    )
        .prop_map(|(region, chunks, read, write, delete, wait_ms)| {
            let acl = Acl {
                read,
                write,
                delete,
            };
            Request::Begin {
                region,
                chunks,
                acl,
                wait_ms,
            }
        });
    let put = prop_oneof![
        3 => proptest::collection::vec(tensor(), 0..8),
        // Enough entries with long keys to pass the cap now and then.
        1 => proptest::collection::vec(tensor(), 20..60),
    ]
    .prop_map(Request::PutMeta);
    let attach = (name(MAX_REGION_NAME), proptest::option::of(number()))
        .prop_map(|(region, generation)| Request::Attach { region, generation });
    prop_oneof![
        1 => Just(Request::List),
        1 => Just(Request::Status),
        1 => Just(Request::Commit),
        1 => Just(Request::Abort),
        1 => Just(Request::Renew),
        1 => Just(Request::Metrics),
        3 => begin,
        3 => put,
        2 => attach,
        1 => number().prop_map(|lease| Request::Detach { lease }),
        1 => name(MAX_REGION_NAME).prop_map(|region| Request::Delete { region }),
        1 => name(MAX_REGION_NAME).prop_map(|region| Request::Sleep { region }),
        1 => name(MAX_REGION_NAME).prop_map(|region| Request::Wake { region }),
    ]
}

/// One change to an encoding (positions are taken modulo its length).
#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, u8),
    Remove(usize),
    Truncate(usize),
    /// The byte at a position replaced by a varint of `u32::MAX` or `u64::MAX` (a count or
    /// length far past the bytes).
    HugeVarint(usize, bool),
    /// Padded with a byte to `MAX_REQUEST - 1`, `MAX_REQUEST` or `MAX_REQUEST + 1` bytes.
    PadToCap(u8, i8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<usize>(), 1u8..=255).prop_map(|(at, x)| Mutation::Flip(at, x)),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Set(at, b)),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Insert(at, b)),
        2 => any::<usize>().prop_map(Mutation::Remove),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(at, wide)| Mutation::HugeVarint(at, wide)),
        1 => (any::<u8>(), -1i8..=1).prop_map(|(b, d)| Mutation::PadToCap(b, d)),
    ]
}

impl Mutation {
    fn apply(&self, bytes: &mut Vec<u8>) {
        let at = |i: usize, n: usize| if n == 0 { 0 } else { i % n };
        let n = bytes.len();
        match *self {
            Mutation::Flip(i, x) if n > 0 => bytes[at(i, n)] ^= x,
            Mutation::Set(i, b) if n > 0 => bytes[at(i, n)] = b,
            Mutation::Insert(i, b) => bytes.insert(at(i, n + 1), b),
            Mutation::Remove(i) if n > 0 => {
                bytes.remove(at(i, n));
            }
            Mutation::Truncate(i) => bytes.truncate(at(i, n + 1)),
            Mutation::HugeVarint(i, wide) => {
                let huge: &[u8] = if wide {
                    &[0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01]
                } else {
                    &[0xFF, 0xFF, 0xFF, 0xFF, 0x0F]
                };
                let i = at(i, n + 1);
                let end = (i + 1).min(n);
                bytes.splice(i..end, huge.iter().copied());
            }
            Mutation::PadToCap(b, d) => {
                bytes.resize((MAX_REQUEST as isize + d as isize) as usize, b);
            }
            _ => {}
        }
    }
}

/// What the fuzzer feeds the decoder.
#[derive(Debug, Clone)]
enum Input {
    /// A valid request: it must decode to itself (or be `TooLarge` past the cap).
    Valid(Request),
    /// A valid request's encoding, changed.
    Mutated(Request, Vec<Mutation>),
    /// Anything.
    Random(Vec<u8>),
}

fn input() -> impl Strategy<Value = Input> {
    prop_oneof![
        3 => request().prop_map(Input::Valid),
        5 => (request(), proptest::collection::vec(mutation(), 1..4))
            .prop_map(|(r, m)| Input::Mutated(r, m)),
        2 => proptest::collection::vec(any::<u8>(), 0..128).prop_map(Input::Random),
    ]
}

fn encode(request: &Request) -> Vec<u8> {
    postcard::to_allocvec(request).expect("a request encodes")
}

impl Input {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Input::Valid(r) => encode(r),
            Input::Mutated(r, mutations) => {
                let mut bytes = encode(r);
                for m in mutations {
                    m.apply(&mut bytes);
                }
                bytes
            }
            Input::Random(b) => b.clone(),
        }
    }
}

/// A varint as postcard writes it.
fn varint(mut n: u64) -> Vec<u8> {
    let mut out = Vec::new();
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
    out
}

/// `PutMeta` with one entry whose key makes the encoding exactly `len` bytes.
fn put_meta_of_len(len: usize) -> Request {
    let meta = TensorMeta {
        chunk: 0,
        offset: 0,
        len: 1,
        dtype: Dtype::U8,
        shape: vec![1],
    };
    let mut key_len = len;
    loop {
        let request = Request::PutMeta(vec![("k".repeat(key_len), meta.clone())]);
        let n = encode(&request).len();
        if n == len {
            return request;
        }
        key_len -= n - len;
    }
}

/// Inputs that stress the caps and the preallocation rules: they run first, every time.
fn corpus() -> Vec<Vec<u8>> {
    let mut corpus = vec![
        vec![],
        // Variant tags past the last one, and an overlong tag.
        vec![11],
        vec![0xFF],
        vec![0x80, 0x00],
        vec![0xFF; 16],
        // A valid request exactly at the cap, and one byte past it.
        encode(&put_meta_of_len(MAX_REQUEST)),
        encode(&put_meta_of_len(MAX_REQUEST + 1)),
        // A valid request padded with trailing bytes to the cap (the tail is ignored).
        {
            let mut b = encode(&Request::Status);
            b.resize(MAX_REQUEST, 0);
            b
        },
    ];
    // Every tag alone, and every tag with a u32::MAX and a u64::MAX count after it.
    for tag in 0u8..=11 {
        corpus.push(vec![tag]);
        for count in [u32::MAX as u64, u64::MAX] {
            let mut b = vec![tag];
            b.extend(varint(count));
            corpus.push(b);
        }
    }
    // The largest preallocation a request can ask for: `PutMeta` announcing as many entries
    // as bytes follow, at the cap (each entry needs at least 6 bytes, so decoding fails late).
    for fill in [0u8, 1, 0x7F] {
        let mut b = vec![3u8];
        b.extend(varint(MAX_REQUEST as u64 - 3));
        b.resize(MAX_REQUEST, fill);
        corpus.push(b);
    }
    // `Begin` announcing as many chunks as bytes follow (u64s: 8 bytes each, preallocated).
    let mut b = vec![2u8, 1, b'r'];
    b.extend(varint(MAX_REQUEST as u64 - 6));
    b.resize(MAX_REQUEST, 0);
    corpus.push(b);
    // A metadata entry whose shape announces as many u64s as bytes follow.
    let mut b = vec![3u8, 1, 1, b'k', 0, 0, 0, 0];
    b.extend(varint(MAX_REQUEST as u64 - 10));
    b.resize(MAX_REQUEST, 1);
    corpus.push(b);
    corpus
}

// ---- the offline check ----

/// What one run found, for its summary line.
#[derive(Debug, Default)]
struct Tally {
    decoded: u64,
    refused: u64,
    too_large: u64,
    /// The highest peak heap per input byte seen (inputs of at least 64 bytes).
    worst_ratio: f64,
    worst_peak: usize,
}

fn check_bytes(
    bytes: &[u8],
    expect: Option<&Request>,
    tally: &mut Tally,
) -> Result<(), TestCaseError> {
    let (decoded, peak) = peak_heap(|| decode_request(bytes));
    if bytes.len() > MAX_REQUEST {
        let too_large = Refusal::TooLarge {
            size: bytes.len() as u64,
            cap: MAX_REQUEST as u64,
        };
        prop_assert_eq!(decoded, Err(too_large));
        prop_assert_eq!(
            peak,
            0,
            "a request over the cap allocated before its refusal"
        );
        tally.too_large += 1;
        return Ok(());
    }
    let bound = HEAP_PER_BYTE * bytes.len() + HEAP_SLACK;
    prop_assert!(
        peak <= bound,
        "decoding {} bytes took {peak} bytes of heap (bound {bound})",
        bytes.len()
    );
    tally.worst_peak = tally.worst_peak.max(peak);
    if bytes.len() >= 64 {
        tally.worst_ratio = tally.worst_ratio.max(peak as f64 / bytes.len() as f64);
    }
    match decoded {
        Ok(request) => {
            if let Some(expected) = expect {
                prop_assert_eq!(&request, expected, "a valid request did not round-trip");
            }
            let again = encode(&request);
            prop_assert!(
                again.len() <= bytes.len(),
                "re-encoding grew: {} bytes from {}",
                again.len(),
                bytes.len()
            );
            prop_assert_eq!(decode_request(&again), Ok(request));
            tally.decoded += 1;
        }
        Err(Refusal::InvalidRequest {
            rule: RequestRule::Decode,
            ..
        }) => {
            prop_assert!(expect.is_none(), "a valid request was refused");
            tally.refused += 1;
        }
        Err(other) => prop_assert!(false, "unexpected refusal {other:?}"),
    }
    Ok(())
}

fn check(input: &Input, tally: &mut Tally) -> Result<(), TestCaseError> {
    let bytes = input.bytes();
    let expect = match input {
        Input::Valid(r) => Some(r),
        _ => None,
    };
    check_bytes(&bytes, expect, tally)
}

fn cases() -> u32 {
    std::env::var("VMM_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

fn seed() -> u64 {
    std::env::var("VMM_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_3e3d)
}

/// A runner of `cases` inputs from a fixed seed, persisting nothing (as `vmm_tests::fuzz`'s).
fn seeded_runner(cases: u32, seed: u64) -> TestRunner {
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes),
    )
}

#[test]
fn the_request_decoder_never_panics_or_allocates_past_its_bound() {
    let (cases, seed) = (cases(), seed());
    let started = Instant::now();
    let mut tally = Tally::default();
    for (i, bytes) in corpus().iter().enumerate() {
        check_bytes(bytes, None, &mut tally)
            .unwrap_or_else(|e| panic!("corpus input {i} ({} bytes): {e}", bytes.len()));
    }
    // The two edge requests round-trip / are refused as the cap says.
    let at_cap = put_meta_of_len(MAX_REQUEST);
    check_bytes(&encode(&at_cap), Some(&at_cap), &mut tally).unwrap();
    let tally = std::cell::RefCell::new(tally);
    let mut runner = seeded_runner(cases, seed);
    let result = runner.run(&input(), |input| check(&input, &mut tally.borrow_mut()));
    let tally = tally.into_inner();
    eprintln!(
        "fuzz_requests: {} corpus inputs and {cases} generated (seed {seed:#x}) in {:.1?}: \
         {} decoded, {} refused, {} too large; worst heap {} bytes, {:.1} bytes per input \
         byte (bound {HEAP_PER_BYTE}): {}",
        corpus().len(),
        started.elapsed(),
        tally.decoded,
        tally.refused,
        tally.too_large,
        tally.worst_peak,
        tally.worst_ratio,
        match &result {
            Ok(()) => "0 findings".to_owned(),
            Err(e) => format!("finding: {e}"),
        }
    );
    result.unwrap();
}

// ---- the live check ----

/// Whether the service may be sent `request` on a connection that reads one reply per
/// request: nothing that makes it send descriptors (`Begin`, an `Attach` of a region that
/// exists) and nothing that changes the bystander's region.
fn harmless(request: &Request, region: &str) -> bool {
    match request {
        Request::Begin { .. } => false,
        Request::Attach { region: r, .. }
        | Request::Delete { region: r }
        | Request::Sleep { region: r }
        | Request::Wake { region: r } => r != region,
        _ => true,
    }
}

/// One packet with `fds` in `SCM_RIGHTS`, bypassing the peer protocol's framing.
fn send_raw(socket: BorrowedFd<'_>, bytes: &[u8], fds: &[OwnedFd]) {
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let iov = [std::io::IoSlice::new(bytes)];
    let rights = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &rights };
    sendmsg::<UnixAddr>(socket.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None).expect("sendmsg");
}

/// A fresh memfd, to be sent where the service expects none.
fn memfd() -> OwnedFd {
    // SAFETY: a static C string; the result is checked before it is owned.
    let fd = unsafe { libc::memfd_create(c"fuzz".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd that nothing else owns.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// The bystander attaches and checks its region, and detaches: the service still serves.
fn bystander_served(bystander: &vmm_memd::Client, generation: u64) {
    let attached = bystander.attach("weights").expect("the bystander attaches");
    assert_eq!(attached.generation, generation);
    let byte = common::fill_byte(generation);
    assert!(attached.chunks[0].as_slice().iter().all(|&b| b == byte));
    bystander.detach(&attached).unwrap();
}

#[test]
fn hostile_bytes_over_the_socket_get_typed_refusals_and_others_are_served() {
    let service = ServiceProc::start(&[]);
    let owner = service.connect();
    let generation = publish(&owner, "weights", 2, 4096);
    let bystander = service.connect();
    bystander_served(&bystander, generation);
    let fds_before = service.fd_count();

    // Request-level: the decoder's refusal, on a connection that keeps working.
    let hostile = service.connect();
    let live_cases = (cases() / 20).max(50);
    let mut runner = seeded_runner(live_cases, seed() ^ 0x11fe);
    let (mut refused, mut answered, mut sent) = (0u64, 0u64, 0u32);
    let mut inputs: Vec<Vec<u8>> = corpus();
    for _ in 0..live_cases {
        let tree = input().new_tree(&mut runner).expect("an input");
        inputs.push(tree.current().bytes());
    }
    for bytes in &inputs {
        if bytes.len() > vmm_core::peer::MAX_DATA {
            continue; // the transport refuses to send it: see the raw packets below
        }
        let local = decode_request(bytes);
        if let Ok(request) = &local
            && !harmless(request, "weights")
        {
            continue;
        }
        let reply = hostile.request_raw(bytes).expect("a reply");
        match local {
            Err(Refusal::TooLarge { size, cap }) => {
                assert_eq!(reply, Response::Refused(Refusal::TooLarge { size, cap }));
                refused += 1;
            }
            Err(Refusal::InvalidRequest { rule, .. }) => {
                assert!(
                    matches!(&reply, Response::Refused(Refusal::InvalidRequest { rule: r, .. }) if *r == rule),
                    "{reply:?}"
                );
                refused += 1;
            }
            Err(other) => panic!("the decoder gave {other:?}"),
            Ok(_) => answered += 1,
        }
        sent += 1;
        if sent.is_multiple_of(64) {
            bystander_served(&bystander, generation);
        }
    }
    assert!(
        refused > 0 && answered > 0,
        "{refused} refused, {answered} answered"
    );
    // A descriptor instead of a request: refused, its fd closed by the service.
    let descriptor = HostBuffer::new(4096).unwrap().export().unwrap();
    hostile.session().send_descriptor(&descriptor).unwrap();
    let reply = hostile.request_raw(&encode(&Request::List));
    assert!(
        matches!(
            reply,
            Ok(Response::Refused(Refusal::InvalidRequest {
                rule: RequestRule::Decode,
                ..
            }))
        ),
        "{reply:?}"
    );
    drop(hostile);
    bystander_served(&bystander, generation);

    // Packet-level: bytes that are no protocol message at all, some carrying fds, each on a
    // fresh connection: the service ends that connection (closing the fds) and nothing else.
    let packets: Vec<(Vec<u8>, usize)> = vec![
        (vec![], 0),
        (vec![0xFF; 32], 0),
        (vec![0u8; 3], 2),
        (vec![0xAB; vmm_core::peer::MAX_DATA + 4096], 0),
        (vec![1u8; 64], 3),
    ];
    for (bytes, nfds) in &packets {
        let conn = service.connect();
        let fds: Vec<OwnedFd> = (0..*nfds).map(|_| memfd()).collect();
        send_raw(conn.session().as_fd(), bytes, &fds);
        drop(fds);
        // The service either refuses it or drops the connection; either way a typed outcome.
        let after = conn.request_raw(&encode(&Request::List));
        assert!(
            matches!(
                after,
                Ok(Response::Refused(_) | Response::List(_))
                    | Err(vmm_memd::MemdError::ServiceGone(_)
                        | vmm_memd::MemdError::Core(_)
                        | vmm_memd::MemdError::BadReply(_))
            ),
            "{after:?}"
        );
        drop(conn);
        bystander_served(&bystander, generation);
    }

    // Every hostile connection's fds (its socket, its pidfd, what it sent) are gone.
    let settled = until(Duration::from_secs(3), || service.fd_count() == fds_before);
    assert!(
        settled.is_some(),
        "the service holds {} fds, {fds_before} before the hostile connections",
        service.fd_count()
    );
    let status = bystander.status().unwrap();
    assert!(
        status.refusals >= refused,
        "{} < {refused}",
        status.refusals
    );
    eprintln!(
        "fuzz_requests live: {sent} requests ({refused} refused, {answered} answered), {} raw \
         packets; service fds {fds_before} before and after",
        packets.len()
    );
}
