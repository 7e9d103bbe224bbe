"""Helpers for the tests, notebooks and benchmarks, kept apart from the engine (which never imports this
package): tiny random checkpoints, the spawn harness for tensor-parallel checks and the checks it runs, and
the teaching version of the store kernel. Functions run by spawned processes and Triton kernels must live
in an importable module, not in a notebook cell, so they are here."""
