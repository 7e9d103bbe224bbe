"""The engine's side of structured outputs: it compiles each request's grammar when the request is made (an
invalid one is refused before it is queued), gives each of the request's sequences its own matcher, and after
each step advances the matchers by the tokens just sampled, finishing a sequence whose matcher has terminated.

The compiler is built at the first request with a grammar (reading the vocabulary into xgrammar takes ~0.25 s
for SmolLM2's 49,152 tokens), under a lock: requests are made on the server's thread while the engine steps on
its own (async_llm.py)."""

import logging
import threading

from minivllm.engine.sequence import Sequence
from minivllm.frontend.structured_outputs.bitmask import matcher_of

logger = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    @property
    def compiler(self):
        """This engine's GrammarCompiler (grammar.py), made at first use."""
        with self._lock:
            if self._compiler is None:
                from minivllm.frontend.structured_outputs.grammar import GrammarCompiler  # loads xgrammar

                self._compiler = GrammarCompiler.from_tokenizer(self.tokenizer, self.vocab_size, self.stop_token_ids)
            return self._compiler

    def attach(self, seqs: list[Sequence]) -> None:
        """Give each sequence with a grammar its matcher (the request's grammar compiled once). Raises
        ValueError naming an invalid schema, regex or grammar."""
        compiled = {}
        for seq in seqs:
            params = seq.sampling_params.structured_outputs
            if params is None:
                continue
            if id(params) not in compiled:
                compiled[id(params)] = self.compiler.compile(params)
            seq.grammar = self.compiler.matcher(compiled[id(params)])

    def advance(self, sampled: list[tuple[Sequence, int]], finish) -> list[Sequence]:
        """A step's tokens are in (scheduler.on_result): each grammar sequence still running accepts its new
        token; one whose matcher has terminated (it accepted end-of-sequence, e.g. with ignore_eos) is ended by
        `finish(seq, "stop")` (the scheduler's). Returns the sequences it finished."""
        finished = []
        for seq, pos in sampled:
            matcher = matcher_of(seq)
            if matcher is None or seq.is_finished:
                continue
            token = seq.token_ids[pos]
            accepted = matcher.accept_token(token)
            if not accepted:  # the mask allowed only what the grammar accepts: not expected
                logger.error("request %s: its grammar rejected token %d; the sequence stops", seq.request_id, token)
            if not accepted or matcher.is_terminated():
                finish(seq, "stop")
                finished.append(seq)
        return finished
