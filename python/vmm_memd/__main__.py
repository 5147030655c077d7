"""``python -m vmm_memd [ARGS]``: start the vmm-memd service installed with this package, with
defaults for one user (``--socket``: ``$VMM_MEMD_SOCKET`` or ``@vmm-memd``, the socket
``Client.connect()`` uses by default; ``--quota-bytes``: physical memory); see
:mod:`vmm_memd.service`."""

import sys

from .service import main

if __name__ == "__main__":
    sys.exit(main())
