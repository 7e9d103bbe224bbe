"""One step of a tensor-parallel engine, rank by rank (notebook 14): spawned by run_tp, so it lives in the
package. Every rank runs what the engine runs, with its collectives and sampler calls counted."""

from helpers.tp_checks import count_collectives


def engine_steps(rank: int, world_size: int, model: str, port: int, prompts: list[list[int]]) -> dict:
    """One prefill step and one decode step of a tensor-parallel engine on this rank (notebook 14), each
    rank running what the engine runs: rank 0 `ModelRunner.launch` (the model in the engine's group, then the
    sampler), the other ranks what their worker loop does with rank 0's message ("run_model", inputs).
    Returns, per step, the collectives this rank made, how often it sampled, and whether it got logits."""
    from minivllm.config import Config
    from minivllm.engine.model_runner import ModelRunner
    from minivllm.engine.sequence import Sequence
    from minivllm.sampling_params import SamplingParams

    block = 16
    config = Config(
        model,
        tensor_parallel_size=world_size,
        device="cpu",
        kvcache_block_size=block,
        num_kvcache_blocks=2 * len(prompts),
        max_model_len=2 * block,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=2 * block * len(prompts),
    )
    runner = ModelRunner(config, rank=rank, port=port)  # joins the engine's group on port, as a worker does
    samples = {"n": 0}
    sample = runner.sampler.forward

    def counted_sample(*args, **kwargs):
        samples["n"] += 1
        return sample(*args, **kwargs)

    runner.sampler.forward = counted_sample
    seqs = [Sequence(p, SamplingParams(temperature=0, max_tokens=2)) for p in prompts]  # the same on every rank
    for i, s in enumerate(seqs):  # what the block manager would hand out: two blocks each
        assert len(s) < block, "each prompt must fit one block"
        s.block_table, s.num_scheduled_tokens = [2 * i, 2 * i + 1], len(s)
    steps = {}
    try:
        for phase in ("prefill", "decode"):
            is_prefill, samples["n"] = phase == "prefill", 0
            with count_collectives() as n:
                if rank == 0:
                    tokens, got_logits = runner.launch(seqs, is_prefill).result()[0], None
                else:
                    inputs = runner.prepare_prefill(seqs) if is_prefill else runner.prepare_decode(seqs)
                    tokens, got_logits = None, runner.run_model(inputs) is not None
            steps[phase] = dict(n, samples=samples["n"], tokens=tokens, got_logits=got_logits)
            # the next step decodes one token per sequence: rank 0 sends the sampled ids to the workers in the
            # engine; here every rank appends the same id (only rank 0 knows what it sampled)
            for s in seqs:
                s.num_computed_tokens = s.num_tokens
                s.append_token(1)
                s.num_scheduled_tokens = 1
    finally:
        runner.exit()
    return dict(rank=rank, steps=steps, num_layers=config.hf_config.num_hidden_layers)
