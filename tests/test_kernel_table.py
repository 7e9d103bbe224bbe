"""The kernel table (minivllm/kernels/table.py): `KernelOptions` refuses a bad value naming the option, and `pick`
binds the GPU-only kernels (the fused attention prologue, the sampler's inverse-CDF draw) into a GPU engine's table
only, or a CPU one's with `triton_on_cpu` (notebook 18 shows the same tables)."""

import pytest
import torch

from minivllm.kernels import KernelOptions, pick
from minivllm.kernels.triton.attention_prologue import attention_prologue
from minivllm.kernels.triton.sampler import inverse_cdf_sample


@pytest.mark.parametrize("name", ["pdl", "fused_prologue", "cpu_packed_linear", "triton_on_cpu", "cpu_ops"])
def test_a_switch_that_is_not_a_bool_is_refused(name):
    with pytest.raises(ValueError, match=f"kernel option {name} must be True or False, got 'yes'"):
        KernelOptions(**{name: "yes"})
    with pytest.raises(ValueError, match=f"kernel option {name} must be True or False, got 1"):
        KernelOptions.of({name: 1})
    assert getattr(KernelOptions(**{name: False}), name) is False


def test_bad_choices_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="kernel option compile must be None, True or False, got 'max'"):
        KernelOptions(compile="max")
    with pytest.raises(ValueError, match="unknown decode kernel 'fa4'"):
        KernelOptions(decode_kernel="fa4")
    with pytest.raises(ValueError, match=r"unknown kernel option\(s\) \['fused'\]"):
        KernelOptions.of({"fused": True})


def binds(ops) -> tuple[bool, bool]:
    return getattr(ops.attention_prologue, "func", None) is attention_prologue, ops.draw is inverse_cdf_sample


def test_the_gpu_only_kernels_are_bound_into_a_gpu_table_only():
    assert binds(pick("cuda", torch.bfloat16, backend="fa4")) == (True, True)  # a table only: nothing runs
    assert binds(pick("cuda", torch.bfloat16, options=KernelOptions(fused_prologue=False))) == (False, True)
    assert binds(pick("cpu", torch.float32)) == (False, False)
    assert binds(pick("cpu", torch.float32, options=KernelOptions(triton_on_cpu=True))) == (True, True)
    assert pick("cuda", options=KernelOptions(pdl=False)).attention_prologue.keywords == {"use_pdl": False}
