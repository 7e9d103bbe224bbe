"""Log-probabilities in OpenAI's shapes, as vLLM's server writes them: for completions, parallel lists
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), the prompt's first with `echo` (null for its
first token, which has none); for chat, one entry per token with its bytes and top-k."""

from minivllm.frontend.outputs import CompletionOutput, RequestOutput


def token_text(lp, token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else lp.decoded_token


def completion_logprobs(c: CompletionOutput, k: int, offset: int, as_ids: bool) -> dict:
    """OpenAI's completions logprobs of the tokens of `c`; text offsets start at `offset`."""
    out = dict(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    for token, step in zip(c.token_ids, c.logprobs):
        text = token_text(step[token], token, as_ids)
        out["text_offset"].append(offset)
        out["token_logprobs"].append(step[token].logprob)
        out["tokens"].append(text)
        out["top_logprobs"].append(
            {token_text(lp, t, as_ids): lp.logprob for t, lp in step.items() if t == token or lp.rank <= k}
        )
        offset += len(text)
    return out


def prompt_logprobs_part(output: RequestOutput, k: int, as_ids: bool, tokenizer) -> dict:
    """OpenAI's completions logprobs of the prompt's tokens (echo): the first has none (null), as vLLM."""
    out = dict(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    offset = 0
    for token, step in zip(output.prompt_token_ids, output.prompt_logprobs):
        if as_ids or (step is None and tokenizer is None):
            text = f"token_id:{token}"
        else:
            text = tokenizer.decode([token]) if step is None else step[token].decoded_token
        out["text_offset"].append(offset)
        out["token_logprobs"].append(None if step is None else step[token].logprob)
        out["tokens"].append(text)
        top = (
            None
            if step is None
            else {token_text(lp, t, as_ids): lp.logprob for t, lp in step.items() if t == token or lp.rank <= k}
        )
        out["top_logprobs"].append(top)
        offset += len(text)
    return out


def chat_logprobs(c: CompletionOutput, k: int, as_ids: bool) -> dict:
    """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and the top k."""
    entry = lambda text, lp: dict(token=text, logprob=lp, bytes=list(text.encode()))
    content = []
    for token, step in zip(c.token_ids, c.logprobs):
        top = sorted(((lp.rank, t, lp) for t, lp in step.items() if lp.rank <= k), key=lambda x: x[0])
        item = entry(token_text(step[token], token, as_ids), step[token].logprob)
        item["top_logprobs"] = [entry(token_text(lp, t, as_ids), lp.logprob) for _, t, lp in top[:k]]
        content.append(item)
    return dict(content=content)
