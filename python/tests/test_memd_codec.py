"""vmm_memd's postcard codec on its own: the requests' bytes as postcard writes them, and
strict decoding of replies, hostile bytes included. No service needed."""

import random
import unittest

from vmm_memd import errors as e
from vmm_memd import protocol as p
from vmm_memd.postcard import Reader, Writer


def reply(index, body=b""):
    w = Writer()
    w.variant(index)
    return w.bytes() + body


def varint(n):
    w = Writer()
    w.u64(n)
    return w.bytes()


def string(s):
    data = s.encode() if isinstance(s, str) else s
    return varint(len(data)) + data


class Requests(unittest.TestCase):
    def test_requests_encode_as_postcard_does(self):
        # The bytes Rust's postcard::to_allocvec gives for the same values.
        self.assertEqual(p.encode_list(), b"\x00")
        self.assertEqual(p.encode_metrics(), b"\x0a")
        self.assertEqual(p.encode_attach("ab"), b"\x06\x02ab\x00")
        self.assertEqual(p.encode_attach("ab", 300), b"\x06\x02ab\x01\xac\x02")
        self.assertEqual(p.encode_detach(2**64 - 1),
                         b"\x07\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")
        self.assertEqual(
            p.encode_begin("r", [4096, 1], p.Acl(read=(p.Uid(7),), delete=(p.Gid(128),)), 5),
            b"\x02\x01r\x02\x80\x20\x01" + b"\x01\x00\x07" + b"\x00" + b"\x01\x01\x80\x01"
            + b"\x05")
        self.assertEqual(p.encode_sleep("kv"), b"\x0f\x02kv")
        self.assertEqual(p.encode_wake("kv"), b"\x10\x02kv")
        meta = p.TensorMeta(1, 256, 8, p.Dtype.BF16, (2, 2))
        self.assertEqual(p.encode_put_meta([("k", meta)]),
                         b"\x03\x01\x01k\x01\x80\x02\x08\x09\x02\x02\x02")
        # BeginOn, Backend::Gpu: the UUID's 16 bytes as they are (vmm-memd's python_client
        # test checks these bytes against postcard).
        self.assertEqual(p.encode_begin_gpu("r", [4096], bytes(range(16)), p.Acl(), 5),
                         b"\x0b\x01r\x01\x80\x20\x00\x00\x00\x05\x01" + bytes(range(16)))
        with self.assertRaises(ValueError):
            p.encode_begin_gpu("r", [4096], bytes(15))
        # A commit token's 16 bytes as they are (the same test checks them against postcard).
        self.assertEqual(p.encode_token(bytes(range(16))), b"\x11" + bytes(range(16)))
        self.assertEqual(p.encode_commit_state("r", bytes(range(16))),
                         b"\x12\x01r" + bytes(range(16)))
        with self.assertRaises(ValueError):
            p.encode_token(bytes(17))
        # An operator's release of everything; its reply and its refusal (the same test
        # checks these bytes against postcard).
        self.assertEqual(p.encode_release_all(), b"\x13")
        self.assertEqual(p.decode_response(b"\x10\x03\x01"), p.Released(3, 1))
        refused = p.decode_response(b"\x00\x0e\x07")
        self.assertIsInstance(refused, e.NotAdmin)
        self.assertEqual(refused.uid, 7)

    def test_values_outside_their_types_are_not_encoded(self):
        for bad in (-1, 2**64):
            with self.assertRaises(ValueError):
                p.encode_detach(bad)
        with self.assertRaises(ValueError):
            p.encode_begin("r", [1], p.Acl(read=(p.Uid(2**32),)))

    def test_metadata_pages_fit_a_request(self):
        entries = [(f"layer.{i}.{'k' * 200}", p.TensorMeta(0, i, 1, p.Dtype.U8, (1,) * 8))
                   for i in range(500)]
        pages = p.meta_pages(entries)
        self.assertGreater(len(pages), 1)
        decoded = []
        for page in pages:
            self.assertLessEqual(len(page), p.MAX_REQUEST)
            r = Reader(page)
            self.assertEqual(r.u32(), 3)
            decoded += p._meta_entries(r)
            r.finish("a page")
        self.assertEqual(decoded, entries)


class Replies(unittest.TestCase):
    def test_each_reply_decodes(self):
        self.assertEqual(p.decode_response(reply(4)), p.Done())
        self.assertEqual(p.decode_response(reply(5, varint(7))), p.Committed(7))
        self.assertEqual(p.decode_response(reply(3, b"\x02\x02\x80\x20\x01")),
                         p.Began(2, (4096, 1)))
        self.assertEqual(p.decode_response(reply(8, b"\x03")), p.Renewed(3))
        self.assertEqual(p.decode_response(reply(9, string("a 1\n"))), p.Metrics("a 1\n"))
        self.assertEqual(p.decode_response(reply(1, b"\x01" + string("r") + b"\x02\x03\x00")),
                         p.RegionList((p.RegionSummary("r", 2, 3),)))
        self.assertEqual(p.decode_response(reply(1, b"\x01" + string("r") + b"\x02\x03\x02")),
                         p.RegionList((p.RegionSummary("r", 2, 3, "Asleep"),)))
        self.assertEqual(p.decode_response(reply(6, b"\x09\x02\x01\x80\x20\x01\xe8\x07")),
                         p.AttachedReply(9, 2, (4096,), 1, 1000))
        page = reply(7, b"\x01" + string("k") + b"\x00\x10\x04\x0a\x01\x01")
        self.assertEqual(p.decode_response(page),
                         p.MetaPage((("k", p.TensorMeta(0, 16, 4, p.Dtype.F32, (1,))),)))
        # Status: uid 0, used 1, quota 2, one region with one generation (readers pid 5 and
        # -1 zigzagged, falling asleep), pending (3, 4, pid 6), 1 waiting writer; counters;
        # truncated.
        status = reply(2, b"\x00\x01\x02\x01" + string("r") + b"\x00"
                       + b"\x01" + b"\x01\x08\x01" + b"\x02\x0a\x01" + b"\x01"
                       + b"\x01\x03\x04\x0c" + b"\x01" + b"\x05\x06\x01")
        self.assertEqual(p.decode_response(status), p.Status(
            0, 1, 2, (p.RegionStatus("r", 0, (p.GenerationStatus(1, 8, True, (5, -1),
                                                                 "Falling"),),
                                     (3, 4, 6), 1),), 5, 6, True))
        self.assertEqual(p.decode_response(reply(13, b"\x03\x02")), p.Slept(3, 2))
        self.assertEqual(p.decode_response(reply(14, b"\x03\x01")), p.Woke(3, True))
        self.assertEqual(p.decode_response(reply(15, b"\x00\x07")), p.CommitState("Landed", 7))
        self.assertEqual(p.decode_response(reply(15, b"\x01")), p.CommitState("Pending"))
        self.assertEqual(p.decode_response(reply(15, b"\x02")), p.CommitState("Unknown"))
        self.assertRefused(reply(15, b"\x03"), "unknown variant 3")

    def test_the_gpu_replies_decode(self):
        uuid = bytes(range(16))
        self.assertEqual(p.decode_response(reply(10, b"\x03\x01\x80\x01" + uuid + b"\x01")),
                         p.BeganGpu(3, (128,), uuid, True))
        self.assertEqual(
            p.decode_response(reply(11, b"\x05\x03\x01\x80\x01\x02\x10" + uuid + b"\x00")),
            p.AttachedGpuReply(5, 3, (128,), 2, 16, uuid, False))
        self.assertEqual(p.decode_response(reply(12, b"\x03\x01" + b"\xcc" * 32)),
                         p.Verified(3, (b"\xcc" * 32,)))
        self.assertEqual(p.decode_response(reply(12, b"\x03\x00")), p.Verified(3, ()))

    def test_every_refusal_decodes_to_its_exception(self):
        cases = [
            (b"\x00\x07\x01\x02\x03", e.QuotaExceeded(7, 1, 2, 3)),
            (b"\x01" + string("r") + b"\x01\x07", e.AccessDenied("r", "write", 7)),
            (b"\x02" + string("r"), e.NoSuchRegion("r")),
            (b"\x03" + string("r") + b"\x02", e.NoSuchGeneration("r", 2)),
            (b"\x04" + string("r") + b"\x05", e.WriterBusy("r", 5)),
            (b"\x05\x01\x02", e.TooLarge(1, 2)),
            (b"\x06\x07" + string("why"), e.InvalidRequest("NoSuchLease", "why")),
            (b"\x07" + string("r") + b"\x02", e.StillMapped("r", 2)),
            (b"\x08\x01\x02\x03", e.FdsInFlight("Uid", 2, 3)),
            (b"\x09" + string("memfd_create") + b"\x17", e.ServiceFailed("memfd_create", -12)),
            (b"\x0a" + bytes(range(16)), e.NoSuchDevice(bytes(range(16)))),
            (b"\x0b" + b"\x01" * 16 + b"\x02" + string("oom"),
             e.DeviceFailed(b"\x01" * 16, "Read", "oom")),
            (b"\x0b" + b"\x01" * 16 + b"\x03" + string("no copy"),
             e.DeviceFailed(b"\x01" * 16, "Copy", "no copy")),
            (b"\x0c" + string("r") + b"\x02\x03" + b"\xaa" * 32 + b"\xbb" * 32,
             e.DigestMismatch("r", 2, 3, b"\xaa" * 32, b"\xbb" * 32)),
            (b"\x0d" + string("r") + b"\x02", e.FabricUnavailable("r", 2)),
        ]
        for body, expected in cases:
            got = p.decode_response(reply(0, body))
            self.assertIs(type(got), type(expected))
            self.assertEqual(got, expected)
            self.assertIsInstance(got, e.Refused)

    def assertRefused(self, data, fragment):
        with self.assertRaises(e.DecodeError) as caught:
            p.decode_response(data)
        self.assertIsInstance(caught.exception, e.BadReply)
        self.assertIn(fragment, str(caught.exception))

    def test_hostile_replies_are_refused(self):
        # Oversized lengths: past the protocol's cap, and past the bytes there are.
        self.assertRefused(reply(7, varint(p.MAX_META_ENTRIES + 1)), "the cap is")
        self.assertRefused(reply(3, b"\x01" + varint(p.MAX_CHUNKS + 1)), "the cap is")
        self.assertRefused(reply(1, varint(1000) + b"\x00"), "bytes left")
        self.assertRefused(reply(9, varint(2**63) + b"x"), "the cap is")
        self.assertRefused(reply(2, b"\x00\x01\x02" + varint(2**64 - 1)), "the cap is")
        self.assertRefused(reply(0, b"\x02" + varint(p.MAX_REGION_NAME + 1)
                                 + b"r" * (p.MAX_REGION_NAME + 1)), "the cap is")
        # Truncated: inside a varint, a string, a struct; and nothing at all.
        self.assertRefused(b"", "end inside")
        self.assertRefused(reply(5), "end inside")
        self.assertRefused(reply(5, b"\x80"), "end inside")
        self.assertRefused(reply(1, b"\x01" + string("r") + b"\x02"), "end inside")
        self.assertRefused(reply(9, b"\x05abc"), "bytes left")
        # Trailing bytes after a whole reply.
        self.assertRefused(reply(4, b"\x00"), "trailing")
        self.assertRefused(reply(5, b"\x07\x07"), "trailing")
        # Unknown variants: of the reply, of a refusal, of a dtype, of a rule.
        self.assertRefused(reply(17), "unknown variant 17")
        self.assertRefused(reply(1, b"\x01" + string("r") + b"\x02\x03\x03"),
                           "unknown variant 3")
        self.assertRefused(reply(2**32 - 1), "unknown variant")
        self.assertRefused(reply(0, b"\x0f"), "unknown variant 15")
        self.assertRefused(reply(0, b"\x0b" + b"\x01" * 16 + b"\x04" + string("x")),
                           "unknown variant 4")
        # A fixed-size byte array cut short.
        self.assertRefused(reply(0, b"\x0a" + bytes(15)), "end inside")
        self.assertRefused(reply(7, b"\x01" + string("k") + b"\x00\x00\x01\x0d\x00"),
                           "unknown variant 13")
        self.assertRefused(reply(0, b"\x06\x0b" + string("x")), "unknown variant 11")
        # Varints: overlong (not shortest), longer than the type, past the type's range.
        self.assertRefused(reply(5, b"\x80\x00"), "overlong")
        self.assertRefused(b"\x84\x00", "overlong")
        self.assertRefused(reply(5, b"\xff" * 10 + b"\x01"), "longer than")
        self.assertRefused(reply(5, b"\xff" * 9 + b"\x02"), "does not fit 64 bits")
        self.assertRefused(reply(8, b"\xff\xff\xff\xff\x10"), "does not fit 32 bits")
        # Tags and text.
        self.assertRefused(reply(2, b"\x00\x01\x02\x00\x05\x06\x02"), "not a bool")
        self.assertRefused(reply(2, b"\x00\x01\x02\x01" + string("r") + b"\x00\x00\x02"),
                           "neither None")
        self.assertRefused(reply(9, string(b"\xff\xfe")), "not UTF-8")
        self.assertRefused(b"\x04" * (p.MAX_DATA + 1), "cap")

    def test_any_bytes_decode_to_a_reply_or_a_decode_error(self):
        rng = random.Random(26)
        valid = [reply(4), reply(5, varint(7)), reply(6, b"\x09\x02\x01\x80\x20\x01\xe8\x07")]
        decoded = 0
        for i in range(20000):
            if i % 2:
                data = bytearray(rng.choice(valid))
                for _ in range(rng.randint(1, 3)):
                    op = rng.randrange(3)
                    if op == 0 and data:
                        data[rng.randrange(len(data))] = rng.randrange(256)
                    elif op == 1:
                        data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
                    elif data:
                        del data[rng.randrange(len(data))]
            else:
                data = bytes(rng.randrange(256) for _ in range(rng.randrange(24)))
            try:
                p.decode_response(bytes(data))
                decoded += 1
            except e.DecodeError:
                pass
        self.assertGreater(decoded, 0)


if __name__ == "__main__":
    unittest.main()
