"""serve/host_memory.py: with the engine core's allocator settings, tensors the size of a prefill's activations are
reused after they are freed instead of being faulted in again. Each case runs in a process of its own (the
settings are process-wide)."""

import subprocess
import sys

import pytest

ROUNDS = """
import resource, sys, torch
from minivllm.serve.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for _ in range(6):  # each round: a 32 MB activation and its 32 MB product, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        a = torch.ones(8192, 1024)
        b = a * 2
        del a, b
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, *faults)
"""


def rounds(mode: str) -> tuple[str, list[int]]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, timeout=120, check=True)
    kept, *faults = out.stdout.split()
    return kept, [int(f) for f in faults]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_activations_are_reused_without_page_faults():
    _, plain = rounds("plain")
    kept, keeping = rounds("keep")
    page = 4096
    assert kept == "True"
    assert min(plain[1:]) > 5 * 64 * 2**20 / page / 2  # glibc's default: every round faults its 320 MB in again
    # kept: once the heap has grown to the rounds' peak (in a round or two), it is reused without faults
    assert max(keeping[-3:]) < min(plain[1:]) / 20
