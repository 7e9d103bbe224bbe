"""The prompt forms a request may take (vLLM's): text, a list of token ids (Python or numpy integers), or a dict
`{"prompt": text}` / `{"prompt_token_ids": ids}`; and chat conversations rendered through the tokenizer's
chat template. Anything else is refused with an error that says what was given."""

import numbers

import numpy as np

Prompt = str | list[int] | dict


def is_token_ids(x) -> bool:
    return token_id_list(x) is not None


def token_id_list(x) -> list[int] | None:
    """`x` as a list of Python ints if it is token ids (a non-empty list or tuple of integers, or a 1-D integer
    array), else None. The ids' types are tested once each, not each id: a prompt may hold thousands of ids, and a
    test per id cost the server ~20 us a request of 512."""
    if isinstance(x, np.ndarray):
        return x.tolist() if x.ndim == 1 and np.issubdtype(x.dtype, np.integer) else None
    if not isinstance(x, (list, tuple)) or len(x) == 0:
        return None
    types = set(map(type, x))
    if types == {int}:
        return list(x)
    return [int(t) for t in x] if all(map(is_integer_type, types)) else None


def is_integer_type(t: type) -> bool:
    """Values of type `t` are integers (not bools)."""
    return t is int or (issubclass(t, (numbers.Integral, np.integer)) and not issubclass(t, bool))


def is_single_prompt(prompts) -> bool:
    """True for one prompt (text, token ids, a dict), False for a batch (a list of prompts)."""
    return isinstance(prompts, (str, dict)) or is_token_ids(prompts)


def parse_prompt(prompt) -> tuple[str | None, list[int] | None]:
    """(text, token ids): one of the two is None. Raises TypeError for what is not a prompt."""
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unknown or len(prompt) != 1:
            raise TypeError(
                f"a dict prompt must have exactly one key, 'prompt' or 'prompt_token_ids'; got keys {sorted(prompt)}"
            )
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"'prompt' must be a string, got {type(prompt['prompt']).__name__}")
            return prompt["prompt"], None
        ids = prompt["prompt_token_ids"]
        if (token_ids := token_ids_or_empty(ids)) is None:
            raise TypeError(f"'prompt_token_ids' must be a list of integers, got {_describe(ids)}")
        return None, token_ids
    if isinstance(prompt, str):
        return prompt, None
    if (token_ids := token_ids_or_empty(prompt)) is not None:
        return None, token_ids
    raise TypeError(
        "a prompt must be a string, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'; "
        f"got {_describe(prompt)}"
    )


def token_ids_or_empty(x) -> list[int] | None:
    """token_id_list, with an empty list or tuple as no ids (the engine then refuses the empty prompt by name)."""
    return [] if isinstance(x, (list, tuple)) and len(x) == 0 else token_id_list(x)


def _describe(x) -> str:
    if isinstance(x, (list, tuple)):
        kinds = sorted({type(t).__name__ for t in x})
        return f"a {type(x).__name__} of {'/'.join(kinds)}"
    return type(x).__name__


def render_chat(tokenizer, conversation: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    """The conversation as prompt text through the tokenizer's chat template (the assistant's turn opened, or
    with continue_final_message=True its last message left open)."""
    if kwargs.get("continue_final_message") and add_generation_prompt:
        raise ValueError("cannot set both continue_final_message and add_generation_prompt to True")
    if kwargs.get("continue_final_message") and not conversation:
        raise ValueError("continue_final_message needs a final message to continue")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model's tokenizer has no chat template: use generate() with plain prompts")
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        raise TypeError(f"a conversation must be a list of {{'role': ..., 'content': ...}} dicts, got {conversation!r}")
    for i, m in enumerate(conversation):
        if "role" not in m or "content" not in m:
            raise ValueError(f"message {i} of the conversation needs 'role' and 'content', got keys {sorted(m)}")
    return tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def is_conversation(messages) -> bool:
    """True for one conversation (a list of message dicts), False for a list of conversations."""
    return isinstance(messages, list) and (not messages or isinstance(messages[0], dict))
