"""A sequence as the engine sees it: its tokens, how many have KV in the cache, and its block table (the
block manager owns the block size: a sequence does not need it). A request of `n` completions has `n`
sequences; beside the scheduler's state each carries its request, its index among the request's sequences and,
when seeded, its own random generator. Its text is the front end's (frontend/output_processor.py)."""

from copy import copy
from enum import Enum, auto
from itertools import count

from minivllm.sampling_params import SamplingParams

PENDING = -1  # placeholder for a token still being sampled on the GPU (filled in one step later)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    counter = count()  # ids are unique in the process (any engine)

    def __init__(
        self,
        token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        index: int = 0,
    ) -> None:
        self.seq_id = next(Sequence.counter)
        self.request_id, self.index = request_id, index
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_scheduled_tokens = 0  # tokens this step computes
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.sample_row = -1  # row of this sequence in the last launched step (its pending token)
        self.block_table: list[int] = []
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.generator = None  # torch.Generator of a seeded request, made on the engine's device at first use

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_known_tokens(self) -> int:
        """Tokens known on the host: all but the placeholders of tokens still being sampled (at the end)."""
        end = self.num_tokens
        while end > self.num_prompt_tokens and self.token_ids[end - 1] == PENDING:
            end -= 1
        return end

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens known on the host."""
        return self.token_ids[self.num_prompt_tokens : self.num_known_tokens]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1
