"""The CPU a vmm-memd spends holding N idle connections, as a share of one core (three 5 s
samples of its utime + stime from /proc): what its connection threads cost while nothing
happens.

    python3 vmm-bench/memd_idle_cpu.py target/debug/vmm-memd 256

Runs from the repository root (the Python client comes from python/); the service is started
on an abstract socket of its own without a keeper, with room for N connections of one uid."""
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import vmm_memd as m  # noqa: E402
exe, n = sys.argv[1], int(sys.argv[2])
sock = f"@idle-cpu-{os.getpid()}"
svc = subprocess.Popen([exe, "--socket", sock, "--quota-bytes", "1000000", "--no-keeper",
                        "--max-connections", str(n + 8), "--max-connections-per-uid", str(n + 8)],
                       stderr=subprocess.DEVNULL)
time.sleep(0.5)
clients = [m.Client.connect(sock) for _ in range(n)]
time.sleep(1)


def cpu():
    f = open(f"/proc/{svc.pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


samples = []
for _ in range(3):
    c0, t0 = cpu(), time.monotonic()
    time.sleep(5)
    samples.append((cpu() - c0) / (time.monotonic() - t0))
print(f"{n} idle connections: {', '.join(f'{s*100:.1f}%' for s in samples)} of a core")
for c in clients:
    c.close()
svc.terminate()
svc.wait()
