"""vmm-memd's Python client (the host, memfd, path): regions published by name in generations,
attached read-only and zero-copy.

    import numpy, vmm_memd

    with vmm_memd.Client.connect() as client:    # $VMM_MEMD_SOCKET or @vmm-memd; its uid checked
        generation = vmm_memd.publish(client, "weights", {"embed": numpy.ones((4, 8), "f4")})
        attached = client.attach("weights")                      # a lease, read-only mappings
        embed = numpy.from_dlpack(attached["embed"])              # zero-copy, read-only
        client.detach(attached)                                  # the mapping stays valid

Everything travels on the peer protocol of docs/protocol.md (``vmm_ipc_peer``): each request
and reply is a postcard-encoded enum in a DATA message (``vmm_memd.protocol``), chunks arrive as
HOST_MEMFD descriptors. A committed chunk is checked to be a tmpfs memfd sealed against writes
before it is mapped, and mapped ``PROT_READ``. Refusals arrive as typed exceptions
(``QuotaExceeded``, ``NoSuchRegion``, ...), a dead service as ``ServiceGone``, a reply that
breaks the protocol as ``BadReply``.

``python -m vmm_memd`` starts the service that ``pip install`` put beside this interpreter
(``vmm-memd``), on the socket ``Client.connect()`` uses by default (``vmm_memd.service``).

``vmm_memd.torch`` publishes a torch state dict and binds a model built on the meta device to
an attached one, zero-copy (torch is imported only when it is used).
"""

from .errors import (  # noqa: F401
    AccessDenied, BadDescriptor, BadReply, DecodeError, FdsInFlight, InvalidRequest, MemdError,
    NoSuchGeneration, NoSuchRegion, Os, QuotaExceeded, Refused, ServiceFailed, ServiceGone,
    StillMapped, TooLarge, Transport, WriterBusy, NoSuchDevice, DeviceFailed, DigestMismatch,
    FabricUnavailable, GpuImportFailed, GpuRegion, GpuSleepFailed, NotAdmin, NotAsleep, NotMapped,
    StaleLayout, StateDictError, ExecutableNotFound,
    StateDictMismatch, TooManyChunks, UnsupportedDevice, UnsupportedDtype,
)
from .sleep import Sleeping, layout_hash, layout_hash_on  # noqa: F401
from .protocol import Acl, CommitState, Dtype, Gid, TensorMeta, Uid  # noqa: F401
from .tensor import Tensor  # noqa: F401
from .client import Client, commit_token  # noqa: F401
from .attached import Attached  # noqa: F401
from .writer import Writer  # noqa: F401
from .publishing import ALIGNMENT, publish, publish_gpu  # noqa: F401
from . import torch  # noqa: F401  (vmm_memd.torch: imports torch only when used)
from . import service  # noqa: F401  (python -m vmm_memd)

__all__ = [
    "Client", "Attached", "Writer", "Tensor", "publish", "publish_gpu", "ALIGNMENT", "Acl", "Dtype", "Gid",
    "TensorMeta", "Uid", "MemdError", "Refused", "ServiceGone", "BadReply", "DecodeError", "BadDescriptor",
    "Transport", "Os", "QuotaExceeded", "AccessDenied", "NoSuchRegion", "NoSuchGeneration",
    "WriterBusy", "TooLarge", "InvalidRequest", "StillMapped", "FdsInFlight", "ServiceFailed",
    "NoSuchDevice", "DeviceFailed", "DigestMismatch", "FabricUnavailable", "NotAdmin", "GpuRegion",
    "GpuImportFailed", "GpuSleepFailed", "NotAsleep", "NotMapped", "StaleLayout", "Sleeping",
    "layout_hash", "layout_hash_on", "StateDictError",
    "StateDictMismatch", "TooManyChunks", "UnsupportedDevice", "UnsupportedDtype",
    "ExecutableNotFound", "service", "CommitState", "commit_token",
]
