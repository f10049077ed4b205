"""Sampling; ``megasparse generate`` from real checkpoints of several layouts (the KV-cached Hugging Face model
against megasparse's own model run without a cache, seeds, bad input); and the samples a run logs."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import megasparse, megasparse_here, one_error_line, tiny_config, write_config

from megasparse.checkpoint.files import open_checkpoint, reference_model
from megasparse.checkpoint.state import read_training_state
from megasparse.convert.generate import generate, load_causal_lm
from megasparse.data.tokenizer import continuation, load_tokenizer
from megasparse.model.sampling import Sampling, continue_tokens

PROMPT = "def parse(self, text):"


def frequencies(sampling: Sampling, logits: torch.Tensor, draws: int = 4000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    tokens = sampling.next_tokens(logits.expand(draws, -1), generator)
    return torch.bincount(tokens, minlength=logits.shape[-1]) / draws


def test_a_continuation_keeps_the_space_before_its_first_word(dataset):
    """SentencePiece drops a text's leading space, so the new tokens are decoded after the prompt, not alone."""
    pieces = load_tokenizer(dataset / "tokenizer.model")
    prompt, new = pieces.encode("return"), pieces.encode("return value")[len(pieces.encode("return")):]
    assert continuation(pieces, prompt, new + [pieces.eos_id()] + new) == " value"


def test_sampling_keeps_the_top_k_and_the_nucleus_and_renormalises():
    probabilities = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probabilities.log()[None]
    plain = dict(temperature=1.0, top_k=0, top_p=1.0)
    assert frequencies(Sampling(temperature=0), logits).tolist() == [1, 0, 0, 0]
    assert torch.allclose(frequencies(Sampling(**plain), logits), probabilities, atol=0.03)
    top_k = frequencies(Sampling(**{**plain, "top_k": 3}), logits)
    assert top_k[3] == 0 and torch.allclose(top_k[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.03)
    nucleus = frequencies(Sampling(**{**plain, "top_p": 0.8}), logits)  # 0.5 + 0.3 reach 0.8: token 2 and 3 are out
    assert nucleus[2:].sum() == 0 and torch.allclose(nucleus[:2], torch.tensor([0.625, 0.375]), atol=0.03)
    assert frequencies(Sampling(**{**plain, "top_p": 0.1}), logits).tolist() == [1, 0, 0, 0]  # the top one stays
    hot = frequencies(Sampling(**{**plain, "temperature": 2.0}), logits)  # softmax(log p / 2) ~ sqrt(p)
    assert torch.allclose(hot, probabilities.sqrt() / probabilities.sqrt().sum(), atol=0.03)


@pytest.mark.parametrize("raw", [{"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_settings(raw):
    with pytest.raises(ValueError):
        Sampling(**raw)


def own_model(tag_dir):
    """megasparse's own model with the checkpoint's whole weights, and the checkpoint's tokenizer."""
    checkpoint = open_checkpoint(tag_dir)
    state = read_training_state(checkpoint)
    model = reference_model(checkpoint.config, state.meta.vocab_size)
    model.load_state_dict(state.weights, assign=True)  # (the reference model is on the meta device)
    return model.eval(), load_tokenizer(checkpoint.tokenizer())


def without_cache(tag_dir, prompt: str, tokens: int, sampling: Sampling, seed: int) -> str:
    """The continuation of ``prompt`` by megasparse's own model, every step recomputed from the whole sequence."""
    model, pieces = own_model(tag_dir)
    prompt_ids = [pieces.eos_id(), *pieces.encode(prompt)]
    new = continue_tokens(model, prompt_ids, tokens, sampling, torch.Generator().manual_seed(seed), pieces.eos_id())
    return continuation(pieces, prompt_ids, new)


@pytest.mark.parametrize("layout", [dict(zero=0, nproc=1, method="dense"), dict(zero=2, nproc=2, method="smet"),
                                    dict(zero=2, nproc=2, method="spectron", tp=2)])
def test_greedy_generation_equals_the_model_run_without_a_cache(runs, layout):
    run = runs(layout["zero"], layout["nproc"], 1, method=layout["method"], tp=layout.get("tp", 1))
    tag_dir = run / "checkpoints" / "step_00000008"
    model, tokenizer, step = load_causal_lm(tag_dir, "cpu", torch.float32)
    assert step == 8
    text = generate(model, tokenizer, PROMPT, 12, Sampling(temperature=0), seed=0)
    assert text and text == without_cache(tag_dir, PROMPT, 12, Sampling(temperature=0), seed=0)


def test_generating_past_the_trained_positions_warns(runs):
    model, tokenizer, _ = load_causal_lm(runs(0, 1, 1, method="dense") / "checkpoints" / "step_00000008", "cpu",
                                         torch.float32)
    with pytest.warns(UserWarning, match="run past the 32 positions the model was trained on"):
        generate(model, tokenizer, PROMPT, 40, Sampling(), seed=0)


def test_the_command_repeats_a_sample_for_a_seed(runs):
    run = runs(0, 1, 1, method="spectron")

    def sample(seed: int) -> str:
        result = megasparse_here("generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "16",
                                 "--temperature", "1.0", "--top-k", "0", "--top-p", "1.0", "--seed", str(seed))
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("# step 8 of ") and PROMPT in result.stdout
        return result.stdout

    first = sample(1)
    assert sample(1) == first
    assert any(sample(seed) != first for seed in (2, 3, 4))


@pytest.mark.parametrize("args,message", [
    (["--top-p", "0"], "--top-p: must be in (0, 1], got 0.0"),
    (["--temperature", "-1"], "--temperature: must be >= 0, got -1.0"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    (["--device", "nonsense"], "--device nonsense:"),
])
def test_bad_generate_input_gets_one_line(runs, args, message):
    one_error_line(megasparse_here("generate", str(runs(0, 1, 1, method="dense")), "--prompt", "x", *args), message)


def test_generate_from_a_missing_checkpoint(tmp_path):
    result = megasparse_here("generate", str(tmp_path / "nothing"), "--prompt", "x")
    assert result.returncode == 2 and "nothing" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("parallel,training", [({"tensor_parallel": 2}, {}),
                                               ({"zero_stage": 3}, {"micro_batch_size": 4})])
def test_a_run_logs_samples_that_its_checkpoint_repeats(dataset, tmp_path, parallel, training):
    """``logging.sample_interval`` on 2 ranks (tensor-parallel, and ZeRO-3 data-parallel, whose forward passes
    gather the weights): samples at steps 4 and 8 in metrics.jsonl, and the one at step 8 equals what the step-8
    checkpoint gives in one process with the run's seed (1234 + 8)."""
    cfg = tiny_config(dataset, tmp_path / "run", "dense", parallel=parallel, training=training,
                      logging={"sample_interval": 4, "sample_prompt": "def ", "sample_tokens": 8})
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), nproc=2).check()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    samples = {r["step"]: r["text"] for r in records if r["event"] == "sample"}
    assert sorted(samples) == [4, 8] and all(text.startswith("def ") for text in samples.values())
    step8 = tmp_path / "run" / "checkpoints" / "step_00000008"
    assert samples[8] == "def " + without_cache(step8, "def ", 8, Sampling(), seed=1234 + 8)


def test_samples_need_room_in_the_sequence():
    from megasparse.config import config_from_dict
    from megasparse.errors import ConfigError

    with pytest.raises(ConfigError, match="logging.sample_tokens: 256 leaves no room for a prompt"):
        config_from_dict({"logging": {"sample_interval": 10, "sample_tokens": 256},
                          "data": {"seq_len": 256}}).validate()
    config_from_dict({"logging": {"sample_tokens": 256}, "data": {"seq_len": 256}}).validate()  # no samples: fine


def test_sampling_runs_in_deterministic_mode_without_a_floating_point_cumsum():
    """``training.deterministic`` with samples in the log: torch refuses a kernel without a deterministic version
    where it flags one. On this CPU it flags none that sampling uses; on CUDA it flags a floating-point cumsum
    (which the nucleus used to take), so the ops are recorded and none may be one; and the draw repeats."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.cumsums = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket == torch.ops.aten.cumsum:
                self.cumsums.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        with Ops() as ops:
            tokens = [Sampling(top_p=0.9).next_tokens(logits, torch.Generator().manual_seed(1)) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(previous)
    assert ops.cumsums and not any(dtype.is_floating_point for dtype in ops.cumsums)
    assert torch.equal(*tokens)
