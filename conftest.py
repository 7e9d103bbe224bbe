"""pytest configuration shared by the unit tests and `pytest --nbval notebooks`."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch


def pytest_collectstart(collector):
    # stderr (torch.compile / Triton / transformers warnings) differs run to run: never compare it
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("stderr",)


def pytest_sessionstart(session):
    # MINIVLLM_REQUIRE_FA4=1 (the GPU check and the GPU CI job): with a GPU present, a FlashAttention-4 that
    # cannot run fails the whole session at once, so no FA4 test or notebook cell passes by skipping
    if os.environ.get("MINIVLLM_REQUIRE_FA4", "0") != "0" and torch.cuda.is_available():
        from helpers.gpu import flash_backends

        try:
            flash_backends()
        except (RuntimeError, ValueError) as e:
            pytest.exit(str(e), returncode=1)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
