"""Structured outputs (vLLM's, notebook 17): a request constrains its output to a grammar, a JSON schema, any JSON
object, a regular expression, or one of a list of strings, and every output it gets is in that language.

How: a grammar over characters is compiled (by xgrammar, as vLLM and SGLang do) against the tokenizer's
vocabulary, and a per-sequence matcher follows the tokens the sequence has produced. Before each draw the matcher
writes which tokens may come next as a bitmask (one bit per token id, 32 to an int32 word); the sampler sets the
logits of the others to -inf, so the draw (greedy or sampled, with any filter) can only pick an allowed token.
The matcher then accepts the sampled token. End-of-sequence is allowed only where the grammar may end, and the
sequence finishes when the matcher has terminated.

The pieces, one per file:
- `params.py`: `StructuredOutputsParams`, vLLM's request field (exactly one constraint);
- `grammar.py`: the engine's compiler (xgrammar's `GrammarCompiler`, its cache this engine's own) and the errors
  of an invalid schema, regex or grammar as ValueErrors that name the problem;
- `bitmask.py`: a step's bitmask filled from the matchers, and applied to the logits;
- `manager.py`: the engine's side: each request's grammar compiled in a thread while the request waits (the steps
  of the others go on), then a matcher per sequence, advanced on each of its tokens.

Where it runs, and why outside the decode graph. The mask of step N+1 depends on the token drawn at step N,
which the matcher (host code, a pushdown automaton over the grammar) must accept before it can say what comes
next. So a batch holding a grammar row (1) waits for step N's tokens before launching step N+1, as it does for
penalties (llm_engine.py), losing the one-step-ahead overlap, and (2) samples on the eager path
(sampling_inputs.py: the row needs more than temperature), where the mask is one `apply_token_bitmask_inplace`
on the logits before the draw. With one GPU the decode graph still replays whole (its LM head and draw included),
then the eager path computes the LM head again for the logits it masks. Capturing the mask inside the graph would
spare that second LM head and draw, not the wait: the host must fill the mask between two steps either way.
`bench.py --structured json` measures what it costs (the same workload with a JSON schema on every request,
beside the unconstrained one): 0.18x the unconstrained throughput (benchmarks/RESULTS.md), the steps
then waiting on the host's matchers for all 256 rows. Rows without a grammar in the same batch are not masked."""

from minivllm.frontend.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
