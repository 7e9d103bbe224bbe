"""The server's own processes serve with their start-up heap frozen (serve/gc_heap.py): the engine core around its
step loop, each API server around uvicorn's run, and both unfreeze when they stop. On CPU the core also keeps the
memory its steps free (serve/host_memory.py)."""

import gc
import os
import weakref
from types import SimpleNamespace

import pytest
import torch
import zmq

from minivllm.serve import core, openai_server
from minivllm.serve import messages as m
from minivllm.serve.gc_heap import YOUNG_THRESHOLD, startup_heap_frozen


def test_the_heap_is_frozen_inside_the_block_and_unfrozen_after_it_even_on_an_error():
    assert gc.get_freeze_count() == 0
    before = gc.get_threshold()
    keep = [object() for _ in range(100)]  # alive now: frozen with the rest
    with startup_heap_frozen():
        assert gc.get_freeze_count() >= len(keep)
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])  # the youngest generation collected less often
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
    with pytest.raises(RuntimeError), startup_heap_frozen():
        raise RuntimeError("the server failed")
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_a_cycle_made_while_serving_is_still_collected():
    class Node:
        pass

    with startup_heap_frozen():
        node = Node()
        node.me = node  # a cycle: only the collector frees it
        gone = weakref.ref(node)
        del node
        assert gone() is not None
        junk = [[] for _ in range(YOUNG_THRESHOLD + 100)]  # containers alive: enough to start a young collection
        assert gone() is None
        del junk


def test_an_api_server_runs_uvicorn_with_its_heap_frozen(monkeypatch):
    seen = []

    class FakeServer:
        engine_died = False

        def __init__(self, config, llm, parent_pid) -> None:
            pass

        def run(self, sockets=None) -> None:
            seen.append(("run", gc.get_freeze_count()))

    monkeypatch.setattr(openai_server, "Server", FakeServer)
    monkeypatch.setattr(openai_server, "build_app", lambda *args, **kwargs: object())
    llm = SimpleNamespace(shutdown=lambda: seen.append(("shutdown", gc.get_freeze_count())))
    openai_server.run_server("model", llm=llm)
    assert seen[0][0] == "run" and seen[0][1] > 0 and seen[1] == ("shutdown", 0)


def test_the_engine_core_steps_with_its_heap_frozen(tmp_path, monkeypatch):
    """run_engine_core in this process on a stand-in engine: it says Ready, then runs its loop frozen; the engine
    exits unfrozen."""
    seen = {}
    config = SimpleNamespace(
        model="m", max_model_len=16, kvcache_block_size=16, num_kvcache_blocks=4, seed=0, tensor_parallel_size=1,
        tokenizer=None,
    )  # fmt: skip
    engine = SimpleNamespace(config=config, vocab_size=8, eos=[0], exit=lambda: seen.update(exit=gc.get_freeze_count()))
    monkeypatch.setattr(core, "LLMEngine", lambda *args, **kwargs: engine)
    monkeypatch.setattr(core, "loop", lambda *args: seen.update(loop=gc.get_freeze_count()))
    monkeypatch.setattr(core, "set_process_name", lambda name: None)  # (this is pytest's process)
    monkeypatch.setattr(core.signal, "signal", lambda *args: None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (leaves this process's torch threads alone)
    monkeypatch.setattr(core, "keep_freed_memory", lambda: seen.update(kept=True))  # (and its allocator)
    ctx = zmq.Context()
    to_core, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    addresses = (f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    to_core.bind(addresses[0])
    from_core.bind(addresses[1])
    try:
        core.run_engine_core("m", {}, [addresses], os.getppid())
        ready = m.decoder(m.Ready).decode(from_core.recv(zmq.NOBLOCK))
    finally:
        to_core.close(linger=0)
        from_core.close(linger=0)
        ctx.term()
    assert ready.error is None and ready.vocab_size == 8
    assert seen["loop"] > 0 and seen["exit"] == 0
    assert seen.get("kept", False) == (not torch.cuda.is_available())  # on CPU the core keeps its freed memory
