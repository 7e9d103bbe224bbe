"""vLLM's names for the engine's arguments (config.py's `Config`): `LLM(model, **engine_args)` and the server take
vLLM's spelling (`block_size`) and accept the arguments that do nothing here with a warning that says why, as vLLM
does for options that do not apply; any other unknown name is a TypeError listing the valid ones."""

import logging
from dataclasses import fields

from minivllm.config import Config

logger = logging.getLogger("minivllm")

RENAMED = {"block_size": "kvcache_block_size"}  # vLLM's name -> ours
IGNORED = {  # vLLM's arguments that have no effect here -> why
    "swap_space": "preempted sequences are recomputed, never swapped to CPU memory",
    "disable_log_stats": "the offline engine logs no statistics",
    "trust_remote_code": "only minivllm's built-in architectures load; no checkpoint code is run",
}


def config_args(kwargs: dict) -> dict:
    """The keyword arguments of `Config(model, ...)` from engine arguments: vLLM's names renamed, those that do
    nothing dropped (with a warning), an unknown one a TypeError naming it."""
    args = {}
    for name, value in kwargs.items():
        if name in IGNORED:
            logger.warning("%s=%r has no effect in minivllm: %s", name, value, IGNORED[name])
        elif name in RENAMED:
            if RENAMED[name] in kwargs:
                raise TypeError(f"give {name} or {RENAMED[name]}, not both")
            args[RENAMED[name]] = value
        else:
            args[name] = value
    names = {f.name for f in fields(Config)} - {"model", "hf_config"}
    unknown = sorted(set(args) - names)
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; valid ones are {sorted(names)}")
    return args
