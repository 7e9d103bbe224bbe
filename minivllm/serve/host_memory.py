"""The engine core on CPU keeps the memory its steps free (glibc's `mallopt`), so that the next step reuses it.

On CPU a prefill's activations are host memory: for the CPU preset's 128 prompts of 64 tokens, tensors of 8-32 MB
each, layer after layer. glibc hands blocks that large out as fresh mappings and unmaps them when freed (and trims
the heap's free top above a threshold), so every prefill faults its activations in again, page by page: ~50,000
page faults for one such prefill. In the serving engine core those faults cost several times what they cost in an
offline `LLM` process: on the development machine a 128-prompt prefill spent 0.41 of its 0.51 s in the kernel
(`benchmarks/HISTORY.md`, change 50). With no mappings for blocks and no trimming, freed activations stay in the
heap and the next prefill reuses them: no faults after the first.

The core process runs one engine and nothing else, so the allocator's settings are its own; vLLM's CPU backend
asks for the same effect by preloading tcmalloc. The price is that the core keeps the memory of its largest step
(the activations of `max_num_batched_tokens` tokens) until it exits. A user's own process running `LLM` is left
as it is."""

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1  # free memory at the heap's top returned to the system beyond this many bytes
M_TOP_PAD = -2  # extra bytes asked for each time the heap grows
M_MMAP_MAX = -4  # at most this many blocks served as mappings of their own
NEVER_TRIM = 2**31 - 1  # (mallopt takes an int)
TOP_PAD = 64 << 20


def keep_freed_memory() -> bool:
    """Serve every block from the heap and never give the heap back. False where the C library has no mallopt
    (not glibc) or refuses a setting: then nothing is changed that matters."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM), (M_TOP_PAD, TOP_PAD))
    return all(mallopt(param, value) == 1 for param, value in settings)
