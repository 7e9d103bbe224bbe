"""A request the engine fails on purpose: its seed (POISON) makes its sampling preparation raise, as a request
whose own inputs cannot be built would (the tests of issue 42: such a request ends alone)."""

from minivllm.frontend import sampling_inputs

POISON = 666


def poison_generator_of(monkeypatch) -> None:
    """Patch the sampler's per-request generator so that a sequence seeded POISON raises when its step is built."""
    real = sampling_inputs.generator_of

    def generator_of(seq, device):
        if seq.sampling_params.seed == POISON:
            raise RuntimeError("cannot seed this one")
        return real(seq, device)

    monkeypatch.setattr(sampling_inputs, "generator_of", generator_of)
