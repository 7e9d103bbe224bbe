"""Drive a Scheduler without a model (tests/test_scheduler.py, notebooks 12 and 13)."""

from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence


def postprocess(scheduler: Scheduler, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
    """nano-vllm's Scheduler.postprocess: account a step that has already run, append its tokens (one per
    sequence of `seqs`), finish sequences. The engine does the same in two halves (on_launch when a step is
    launched, on_result when its tokens arrive) so that it can run one step ahead."""
    return scheduler.on_result(seqs, scheduler.on_launch(seqs), token_ids)
