"""pytest configuration shared by the unit tests and `pytest --nbval notebooks`."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch


def pytest_collectstart(collector):
    # stderr (torch.compile / Triton / transformers warnings) differs run to run: never compare it
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("stderr",)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
