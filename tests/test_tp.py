"""Tensor parallelism over gloo (seed 000 sections 5 and 6): every parallel layer sharded over 2 processes
equals plain torch on the full weights, with the collectives the design promises (Row and the embedding
all_reduce once, the LM head gathers to rank 0, Column/QKV/Merged never talk); a whole Qwen3 decoder layer
at TP=2 equals TP=1 with exactly 2 all_reduces; TP degrees that do not divide the head counts fail with a
clear ValueError. One spawn of 2 processes runs every check (tests/helpers/tp_checks.py)."""

import pytest

from conftest import assert_close
from helpers.spawn import run_tp
from helpers.tp_checks import run_decoder_layer, tp_worker
from minivllm.layers.linear import divide

LINEAR = ["column", "row", "qkv", "merged"]
# layer -> (all_reduce calls, gather calls) of one forward at TP=2
COLLECTIVES = {
    "column": (0, 0),
    "row": (1, 0),
    "qkv": (0, 0),
    "merged": (0, 0),
    "embedding": (1, 0),
    "lm_head_prefill": (0, 1),
    "lm_head_decode": (0, 1),
}


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_tp(tp_worker, 2, (0,))


def _check(results: list[dict], name: str) -> list[dict]:
    part = "linear" if name in LINEAR else "vocab"
    return [r[part][name] for r in results]


@pytest.mark.slow
def test_ranks_and_world_size(tp2):
    assert [(r["rank"], r["world_size"]) for r in tp2] == [(0, 2), (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("name", LINEAR + ["embedding"])
def test_sharded_layer_equals_unsharded(tp2, name):
    for check in _check(tp2, name):  # every rank ends with the full result
        assert_close(check["out"], check["ref"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lm_head_prefill", "lm_head_decode"])
def test_lm_head_gathers_full_logits_to_rank0(tp2, name):
    rank0, rank1 = _check(tp2, name)
    assert rank0["out"].shape == (3, 256)  # prefill: only the last token of each of 3 sequences
    assert_close(rank0["out"], rank0["ref"])
    assert rank1["out"] is None


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_collectives_per_layer(tp2, name):
    for check in _check(tp2, name):
        assert (check["all_reduce"], check["gather"]) == COLLECTIVES[name]


@pytest.mark.slow
def test_shard_shapes_and_vocab_ranges(tp2):
    shapes = {name: _check(tp2, name)[0]["shard_shape"] for name in LINEAR + ["embedding"]}
    assert shapes == {
        "column": (48, 64),
        "row": (64, 48),
        "qkv": ((4 + 2 * 2) * 16 // 2, 64),
        "merged": (128, 64),
        "embedding": (128, 64),
    }
    assert [c["vocab_range"] for c in _check(tp2, "embedding")] == [(0, 128), (128, 256)]


@pytest.mark.slow
def test_decoder_layer_tp2_equals_tp1_with_two_all_reduces(tp2):
    ref = run_decoder_layer(0)  # this process: no process group, TP=1
    assert ref["all_reduce"] == 0 and (ref["q_heads_per_rank"], ref["kv_heads_per_rank"]) == (4, 2)
    for r in tp2:
        d = r["decoder"]
        assert (d["q_heads_per_rank"], d["kv_heads_per_rank"]) == (2, 1)
        assert d["all_reduce"] == 2 and d["all_reduce_first"] == 2 and d["gather"] == 0  # o_proj + down_proj
        for key in ("first", "later"):  # first layer (residual None) and a later one
            for actual, expected in zip(d[key], ref[key]):
                assert_close(actual, expected)


@pytest.mark.slow
def test_indivisible_sizes_raise_clear_errors(tp2):
    for r in tp2:
        assert r["errors"] == {
            "kv_heads": "tensor parallel size 2 does not divide number of KV heads 3",
            "vocab": "tensor parallel size 2 does not divide vocabulary size 257",
            "column": "tensor parallel size 2 does not divide output size 97",
            "row": "tensor parallel size 2 does not divide input size 97",
        }


@pytest.mark.slow
def test_ranks_agree_on_the_smallest_kv_block_count(tp2):
    """ModelRunner.agree_min: rank 0 has room for 40 blocks, rank 1 for 25; both allocate 25."""
    assert [r["agree_min"] for r in tp2] == [25, 25]


# --- TP degrees without processes: a stand-in group of the size the layers read --------------------------


class SizedGroup:
    """What the layers read from their process group at construction: this rank and the world size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self._size


def _qwen3_0_6b_attention(size: int):
    from minivllm.models.qwen3 import Qwen3Attention

    return Qwen3Attention(
        hidden_size=1024,
        num_heads=16,
        num_kv_heads=8,
        max_position=64,
        head_dim=128,
        rms_norm_eps=1e-6,
        qkv_bias=False,
        qk_norm=True,
        rope_theta=1e6,
        rope_scaling=None,
        group=SizedGroup(size),
    )


def test_tp3_with_16_heads_raises():
    with pytest.raises(ValueError, match=r"^tensor parallel size 3 does not divide number of attention heads 16$"):
        _qwen3_0_6b_attention(3)


def test_qwen3_0_6b_admits_tp_1_2_4_8():
    admitted = []
    for size in range(1, 17):
        try:
            attn = _qwen3_0_6b_attention(size)
        except ValueError as e:
            assert "does not divide number of" in str(e)
            continue
        admitted.append(size)
        assert attn.qkv_proj.weight.shape == ((16 + 2 * 8) * 128 // size, 1024)
        assert attn.o_proj.weight.shape == (1024, 16 * 128 // size)
    assert admitted == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="number of KV heads 8"):  # 16 heads divide, 8 KV heads do not
        divide(8, 16, "number of KV heads")
    assert divide(16, 16) == 1
