"""Checkpoint tools against the live runs: inspect, consolidate (every layout and form), export to
Hugging Face (logits compared with `transformers`), import from it (dense, sparse, low-rank) and
continued training from an import; bad input gets one error line and writes nothing."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import final_weights, megasparse, megasparse_here, one_error_line, tiny_config, train_losses, write_config

from megasparse.checkpoint.files import open_checkpoint, reference_model
from megasparse.checkpoint.state import local_shard, read_training_state
from megasparse.checkpoint.weights import portable_tensors, read_model_directory, training_tensors
from megasparse.config import config_from_dict
from megasparse.data.loader import PretrainingBatches
from megasparse.data.shards import open_prepared
from megasparse.data.tokenizer import load_tokenizer
from megasparse.sparse.mask import pack
from megasparse.model.factory import layer_factory
from megasparse.model.llama import Llama
from megasparse.parallel.mappings import TensorParallel

transformers = pytest.importorskip("transformers")

# (method, ZeRO stage, processes, tensor-parallel degree, precision): runs the other tests train too
LAYOUTS = [("dense", 0, 1, 1, "fp32"), ("dense", 2, 2, 1, "fp32"), ("dense", 0, 2, 2, "fp32"),
           ("dense", 2, 4, 2, "fp32"), ("dense", 1, 2, 1, "bf16"), ("smet", 0, 1, 1, "fp32"),
           ("smet", 1, 2, 1, "fp32"), ("smet", 2, 2, 1, "fp32"), ("spectron", 0, 1, 1, "fp32"),
           ("spectron", 1, 2, 1, "fp32"), ("spectron", 2, 2, 2, "fp32"), ("spectron", 0, 2, 2, "fp32"),
           ("smet-tp", 2, 4, 2, "fp32")]


def trained(runs, method, zero, nproc, tp, precision="fp32") -> Path:
    return runs(zero, nproc, 1, precision, method=method, tp=tp) / "checkpoints" / "step_00000008"


def whole_from_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Tensor-parallel shards joined the Megatron way (the test's own reckoning, not the converter's):
    embedding, head, q/k/v/gate/up weights and A factors by rows; o/down weights and B factors by columns;
    a sparse layer's slots in rank order; everything else replicated."""
    layer, kind = name.split(".")[-2:]
    if len(shards) == 1 or "norm" in layer:
        return shards[0]
    if kind == "values":
        return torch.cat(shards)
    if layer in ("o_proj", "down_proj"):
        return torch.cat(shards, dim=1) if kind in ("weight", "B") else shards[0]
    return torch.cat(shards, dim=0) if kind in ("weight", "A") else shards[0]


def model_from(directory: Path) -> Llama:
    """A single-process megasparse model holding a model directory's weights."""
    tensors, metadata = read_model_directory(directory)
    cfg = config_from_dict(json.loads(metadata["config"]))
    return holding(training_tensors(tensors, reference_model(cfg, int(metadata["vocab_size"])), "test"), cfg,
                   int(metadata["vocab_size"]))


@torch.no_grad()
def holding(weights: dict[str, torch.Tensor], cfg, vocab_size: int) -> Llama:
    """A single-process megasparse model holding whole ``weights`` (each padded as the model stores it)."""
    model = Llama(cfg.model, vocab_size, layer_factory(cfg))
    for name, tensor in model.state_dict(keep_vars=True).items():
        tensor.copy_(local_shard(weights[name], tensor, TensorParallel()))
    return model.eval()


@pytest.mark.parametrize("method,zero,nproc,tp,precision", LAYOUTS)
def test_consolidate_equals_the_live_weights(runs, tmp_path, method, zero, nproc, tp, precision):
    """The consolidated tensors (in process: the command itself is run by the tests below) equal each rank's."""
    tag = trained(runs, method, zero, nproc, tp, precision)
    checkpoint = open_checkpoint(tag)
    tensors = portable_tensors(read_training_state(checkpoint).weights, reference_model(checkpoint.config, 400))
    live = [final_weights(tag, t) for t in range(tp)]
    for name, tensor in live[0].items():
        shards = [rank[name] for rank in live]
        if name.endswith(".values"):  # sparse: the dense matrix with zeros, and the mask
            prefix = name.removesuffix(".values")
            mask = tensors[f"{prefix}.mask"]
            assert torch.equal(pack(mask, int(mask.sum())), live[0][f"{prefix}.mask"])
            assert torch.equal(tensors[f"{prefix}.weight"][mask], whole_from_shards(name, shards).float())
            assert tensors[f"{prefix}.weight"].count_nonzero() <= int(mask.sum())
        elif not name.endswith(".mask"):
            whole = whole_from_shards(name, shards)
            if precision == "bf16":  # the file holds the fp32 master weights; the module their bf16 copy
                assert torch.equal(tensors[name].to(torch.bfloat16), whole), name
            else:
                assert torch.equal(tensors[name], whole), name


@pytest.mark.parametrize("method", ["dense", "smet", "spectron"])
def test_zero3_consolidation_equals_deepspeeds_zero_to_fp32(runs, tmp_path, method):
    """ZeRO-3's module files hold no weights, so the reckoning to check against is DeepSpeed's own recovery
    script, which each checkpoint directory carries: the whole training state and the consolidated model
    equal its fp32 state dict exactly (masters, and for SMET the index buffers)."""
    tag = trained(runs, method, 3, 2, 1)
    subprocess.run([sys.executable, str(tag.parent / "zero_to_fp32.py"), str(tag.parent), str(tmp_path / "fp32"),
                    "--tag", tag.name], check=True, capture_output=True)
    theirs = torch.load(tmp_path / "fp32" / "pytorch_model.bin")
    ours = read_training_state(open_checkpoint(tag)).weights
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    megasparse_here("convert", "consolidate", str(tag), "--out", str(tmp_path / "model")).check()
    consolidated, _ = read_model_directory(tmp_path / "model")
    expected = portable_tensors(theirs, reference_model(open_checkpoint(tag).config, 400))
    assert consolidated.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(consolidated[name], tensor), name


def test_consolidated_forms(runs, tmp_path):
    """Compact sparse (values + bitmask) and dense low-rank (W = A B) hold the same model, in less space."""
    smet, spectron = trained(runs, "smet", 2, 2, 1), trained(runs, "spectron", 2, 2, 2)
    for source, name, flags in [(smet, "masked", []), (smet, "compact", ["--sparse", "compact"]),
                                (spectron, "factors", []), (spectron, "dense", ["--lowrank", "dense"])]:
        megasparse_here("convert", "consolidate", str(source), "--out", str(tmp_path / name), *flags).check()
    assert {"config.yaml", "tokenizer.model", "model.safetensors"} == {p.name for p in (tmp_path / "masked").iterdir()}
    assert read_model_directory(tmp_path / "masked")[1]["step"] == "8"
    tokens = torch.randint(0, 400, (2, 16))
    with torch.no_grad():
        assert torch.equal(model_from(tmp_path / "masked")(tokens), model_from(tmp_path / "compact")(tokens))
    masked, _ = read_model_directory(tmp_path / "masked")
    compact, _ = read_model_directory(tmp_path / "compact")
    size = {name: (tmp_path / name / "model.safetensors").stat().st_size for name in ("masked", "compact")}
    assert size["compact"] < 0.6 * size["masked"]
    prefix = "layers.0.mlp.up_proj"
    assert torch.equal(compact[f"{prefix}.values"], masked[f"{prefix}.weight"][masked[f"{prefix}.mask"]])
    factors, _ = read_model_directory(tmp_path / "factors")
    dense, _ = read_model_directory(tmp_path / "dense")
    product = factors[f"{prefix}.A"].double() @ factors[f"{prefix}.B"].double()
    assert torch.allclose(dense[f"{prefix}.weight"].double(), product, rtol=0, atol=1e-6)
    assert f"{prefix}.A" not in dense


def test_masks_in_blocks_consolidate_in_both_forms_and_load_back(runs, tmp_path):
    """A checkpoint whose masks are split in blocks over 2 tensor-parallel ranks consolidates (masked and compact)
    into one model, which loads back into a model of the same blocks (each block's share checked) and computes the
    trained model's logits."""
    tag = trained(runs, "smet-blocks", 1, 4, 2)
    for name, flags in [("masked", []), ("compact", ["--sparse", "compact"])]:
        megasparse_here("convert", "consolidate", str(tag), "--out", str(tmp_path / name), *flags).check()
    checkpoint = open_checkpoint(tag)
    ours = holding(read_training_state(checkpoint).weights, checkpoint.config, 400)
    tokens = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name in ("masked", "compact"):
            assert torch.equal(model_from(tmp_path / name)(tokens), ours(tokens)), name


@pytest.mark.parametrize("method,zero,nproc,tp", [("dense", 2, 2, 1), ("smet", 2, 2, 1), ("spectron", 2, 2, 2),
                                                  ("spectron-ffn180", 1, 4, 2), ("hybrid", 2, 4, 2),
                                                  ("smet-blocks", 1, 4, 2)])
def test_export_hf_logits_and_tokenizer(runs, tmp_path, method, zero, nproc, tp):
    """`transformers` loads the export; its logits equal the megasparse model's within 1e-4 (fp32) and its
    tokenizer encodes like the SentencePiece model the data was made with. A padded MLP (ffn_dim 180, stored as
    2 x 96) exports its real width; a hybrid projection its dense W = A B + S; masks in blocks, split over the
    tensor-parallel ranks, their matrix."""
    tag = trained(runs, method, zero, nproc, tp)
    megasparse_here("convert", "export-hf", str(tag), "--out", str(tmp_path / "hf")).check()
    checkpoint = open_checkpoint(tag)
    ours = holding(read_training_state(checkpoint).weights, checkpoint.config, 400)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max() <= 1e-4
    text = "def main(argv):\n    return {'x': 12.5}  # naïve\n"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer(text)["input_ids"] == load_tokenizer(tmp_path / "hf" / "tokenizer.model").encode(text)


def test_factored_export_loads_matches_the_dense_export_and_generates(runs, tmp_path):
    """``--lowrank factored`` from a Spectron checkpoint of 2 tensor-parallel ranks: transformers builds the
    folder's own model (trust_remote_code), which holds the factors (A column-major) and no W; its logits equal the
    dense export's within 1e-4 (fp32), greedy generation with the KV cache gives the dense export's tokens, and
    ``save_pretrained`` writes a folder that loads back to the same model."""
    tag = trained(runs, "spectron", 2, 2, 2)
    megasparse_here("convert", "export-hf", str(tag), "--out", str(tmp_path / "dense")).check()
    megasparse_here("convert", "export-hf", str(tag), "--out", str(tmp_path / "factored"), "--lowrank", "factored").check()
    dense = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "dense").eval()
    factored = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "factored", trust_remote_code=True).eval()
    assert type(factored).__name__ == "FactoredLlamaForCausalLM"
    names = {name for name, _ in factored.named_parameters()}
    assert "model.layers.0.self_attn.q_proj.A" in names and "model.layers.0.self_attn.q_proj.weight" not in names
    assert sum(p.numel() for p in factored.parameters()) < 0.8 * sum(p.numel() for p in dense.parameters())
    q = factored.model.layers[0].self_attn.q_proj
    assert q.A.shape == (q.out_features, q.rank) and q.A.t().is_contiguous() and q.B.is_contiguous()
    assert all(tensor.is_contiguous() for tensor in factored.state_dict().values())  # as safetensors needs them
    tokens = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (factored(tokens).logits - dense(tokens).logits).abs().max() <= 1e-4
        prompt = tokens[:1, :8]
        greedy = dict(max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
        assert torch.equal(factored.generate(prompt, **greedy), dense.generate(prompt, **greedy))
        factored.save_pretrained(tmp_path / "saved")
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", trust_remote_code=True).eval()
        assert torch.equal(again(tokens).logits, factored(tokens).logits)
    one_error_line(megasparse_here("convert", "import-hf", str(tmp_path / "factored"), "--out", str(tmp_path / "back")),
                   "this is a factored export (export-hf --lowrank factored), which import-hf does not read")


def test_factored_export_needs_a_lowrank_checkpoint(runs, tmp_path):
    one_error_line(megasparse_here("convert", "export-hf", str(trained(runs, "smet", 2, 2, 1)), "--out",
                                   str(tmp_path / "hf"), "--lowrank", "factored"),
                   "--lowrank factored: this checkpoint's projections are sparse, not low-rank")
    assert not (tmp_path / "hf").exists()


def first_batch_loss(model: torch.nn.Module, dataset: Path, seed: int) -> float:
    """The loss of ``model`` on the first global batch of tiny_config's run (8 sequences of 32 tokens)."""
    windows = open_prepared(dataset).split("train", 32)
    (inputs, targets), = PretrainingBatches(windows, 8, 8, 0, 1, seed).next_step()
    with torch.no_grad():
        logits = model(inputs).logits if hasattr(model, "config") else model(inputs)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).item()


@pytest.fixture(scope="module")
def hf_model(runs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "model"
    megasparse_here("convert", "export-hf", str(trained(runs, "dense", 0, 1, 1)), "--out", str(out)).check()
    return out


def imported(hf_model: Path, out: Path, *flags: str) -> dict[str, torch.Tensor]:
    """``import-hf`` the folder into ``out``; the model directory's tensors."""
    megasparse_here("convert", "import-hf", str(hf_model), "--out", str(out), *flags).check()
    return read_model_directory(out)[0]


def first_loss_from(directory: Path, dataset: Path, tmp_path: Path, method: str, nproc: int, **sections) -> float:
    """Train 2 steps from the model directory (``checkpoint.init_from``); the first step's loss."""
    cfg = tiny_config(dataset, tmp_path / "out", method, checkpoint={"init_from": str(directory)},
                      training={"steps": 2}, **sections)
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), nproc=nproc).check()
    assert "initialised the model from" in result.stdout
    return train_losses(tmp_path / "out")[0]


def test_import_hf_of_a_width_that_pads(runs, dataset, tmp_path):
    """A Hugging Face model whose intermediate_size (180) the model stores padded imports dense and low-rank, and
    continues training from it on 2 tensor-parallel ranks (2 x 96) with the Hugging Face model's first loss."""
    hf = tmp_path / "hf"
    megasparse_here("convert", "export-hf", str(trained(runs, "dense-ffn180", 0, 2, 2)), "--out", str(hf)).check()
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf).eval()
    tensors = imported(hf, tmp_path / "dense")
    assert tuple(tensors["layers.0.mlp.down_proj.weight"].shape) == (64, 180)
    assert imported(hf, tmp_path / "lowrank", "--layer", "lowrank")["layers.0.mlp.gate_proj.A"].shape[0] == 180
    first = first_loss_from(tmp_path / "dense", dataset, tmp_path, "dense-ffn180", 2, parallel={"tensor_parallel": 2})
    assert first == pytest.approx(first_batch_loss(theirs, dataset, 1234), rel=1e-5)


def test_import_hf_dense_reproduces_the_logits_and_continues_training(hf_model, dataset, tmp_path):
    imported(hf_model, tmp_path / "imported")
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_model).eval()
    tokens = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model_from(tmp_path / "imported")(tokens) - theirs(tokens).logits).abs().max() <= 1e-4
    # continued pretraining from the import, split over 2 tensor-parallel ranks: the first step's loss is
    # the Hugging Face model's loss on that batch
    first = first_loss_from(tmp_path / "imported", dataset, tmp_path, "dense", 2, parallel={"tensor_parallel": 2})
    assert first == pytest.approx(first_batch_loss(theirs, dataset, 1234), rel=1e-5)


def test_a_zero3_run_starts_from_the_model_directory(hf_model, dataset, tmp_path):
    """``checkpoint.init_from`` at ZeRO-3 on 2 ranks, where the model is partitioned as it is built: each tensor
    is gathered to be set, so the first step's loss is the Hugging Face model's on that batch."""
    imported(hf_model, tmp_path / "imported")
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_model).eval()
    first = first_loss_from(tmp_path / "imported", dataset, tmp_path, "dense", 2, parallel={"zero_stage": 3})
    assert first == pytest.approx(first_batch_loss(theirs, dataset, 1234), rel=1e-5)


def test_import_hf_sparse_keeps_the_largest_weights(hf_model, dataset, tmp_path):
    tensors, dense = imported(hf_model, tmp_path / "sparse", "--layer", "sparse", "--density", "0.4"), hf_weights(hf_model)
    for prefix in ("layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"):
        mask, weight = tensors[f"{prefix}.mask"], dense[f"model.{prefix}.weight"]
        assert mask.sum().item() == round(0.4 * mask.numel())
        assert weight[mask].abs().min() >= weight[~mask].abs().max()
        assert torch.equal(tensors[f"{prefix}.weight"][mask], weight[mask])
    first = first_loss_from(tmp_path / "sparse", dataset, tmp_path, "smet", 1, sparse={"density": 0.4})
    assert first == pytest.approx(first_batch_loss(model_from(tmp_path / "sparse"), dataset, 1234), rel=1e-5)


def test_import_hf_lowrank_is_the_truncated_svd(hf_model, dataset, tmp_path):
    tensors, dense = imported(hf_model, tmp_path / "lowrank", "--layer", "lowrank", "--rank", "8"), hf_weights(hf_model)
    for prefix in ("layers.0.self_attn.k_proj", "layers.1.mlp.gate_proj"):
        weight = dense[f"model.{prefix}.weight"].double()
        a, b = tensors[f"{prefix}.A"].double(), tensors[f"{prefix}.B"].double()
        singular = torch.linalg.svdvals(weight)
        assert (weight - a @ b).norm() == pytest.approx(singular[8:].norm().item(), rel=1e-5)  # Eckart-Young
        assert a.norm() == pytest.approx(b.norm().item(), rel=1e-5)  # balanced
    first = first_loss_from(tmp_path / "lowrank", dataset, tmp_path, "spectron", 2, lowrank={"rank": 8},
                            parallel={"tensor_parallel": 2})
    assert first == pytest.approx(first_batch_loss(model_from(tmp_path / "lowrank"), dataset, 1234), rel=1e-5)


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_inspect(runs):
    result = megasparse_here("inspect", str(trained(runs, "spectron", 2, 2, 2).parent)).check()
    for expected in ["step 8, 2,048 tokens", "2 tensor-parallel x 1 data-parallel (2 processes), ZeRO-2, fp32",
                     "optimizer    spectron", "layers.1.mlp.down_proj", "rank 44", "all present and readable",
                     "zero_pp_rank_0_mp_rank_01_optim_states.pt"]:
        assert expected in result.stdout
    result = megasparse_here("inspect", str(trained(runs, "smet", 2, 2, 1))).check()
    assert "density 0.3000 (1,229 active)" in result.stdout


def broken_copy(tag: Path, tmp_path: Path, damage) -> Path:
    copy = tmp_path / "checkpoints" / tag.name
    shutil.copytree(tag, copy)
    damage(copy)
    return copy


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def without_manifest(damage):
    def apply(tag: Path) -> None:
        (tag / "manifest.json").unlink()
        damage(tag)
    return apply


BAD_CHECKPOINTS = {
    "missing shard": (lambda c: (c / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
                      "is incomplete: 'zero_pp_rank_1_mp_rank_00_optim_states.pt' is missing"),
    "truncated shard": (lambda c: truncate(c / "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                        "is damaged: 'zero_pp_rank_0_mp_rank_00_optim_states.pt' has"),
    "flipped byte": (lambda c: flip_byte(c / "mp_rank_00_model_states.pt"),
                     "is damaged: 'mp_rank_00_model_states.pt' does not match its checksum"),
    "truncated shard, no manifest": (without_manifest(lambda c: truncate(c / "mp_rank_00_model_states.pt")),
                                     "is unreadable (truncated or corrupt"),
    "empty shard": (lambda c: (c / "mp_rank_00_model_states.pt").write_bytes(b""), "'mp_rank_00_model_states.pt' is empty"),
    "no completion file": (lambda c: (c / "megasparse.json").unlink(), "its completion file megasparse.json is missing"),
}


@pytest.mark.parametrize("case,command", [("missing shard", ["convert", "consolidate"]), ("truncated shard", ["inspect"]),
                                          ("flipped byte", ["convert", "consolidate"]),
                                          ("truncated shard, no manifest", ["convert", "export-hf"]),
                                          ("empty shard", ["convert", "export-hf"]),
                                          ("no completion file", ["convert", "reshard"])])
def test_damaged_checkpoint(runs, tmp_path, case, command):
    damage, message = BAD_CHECKPOINTS[case]
    copy = broken_copy(trained(runs, "smet", 2, 2, 1), tmp_path, damage)
    out = ["--out", str(tmp_path / "out")] if command[0] == "convert" else []
    one_error_line(megasparse_here(*command, str(copy), *out), message)
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["checkpoints"]


@pytest.mark.parametrize("source,target,message", [
    (("dense", 2, 2, 1), ("smet", 2, 2, 1), "it has a parameter"),  # names the model has not
    # the same names with other shapes: a tensor-parallel rank's file in a checkpoint of one rank per model
    (("dense", 2, 4, 2), ("dense", 2, 2, 1), "its optimizer partitions give"),
])
def test_a_model_file_of_another_model(runs, tmp_path, source, target, message):
    """Without the manifest (which would catch the swap first), the files are checked against the model: one line
    naming what does not fit, not a failed reshape, and nothing written."""
    swapped = trained(runs, *source)
    swap = without_manifest(lambda c: shutil.copyfile(swapped / "mp_rank_00_model_states.pt", c / "mp_rank_00_model_states.pt"))
    copy = broken_copy(trained(runs, *target), tmp_path, swap)
    result = megasparse_here("convert", "consolidate", str(copy), "--out", str(tmp_path / "out"))
    one_error_line(result, f"does not hold the model of its megasparse.json ({message}")
    assert not (tmp_path / "out").exists()


def test_bad_paths_and_outputs(runs, tmp_path, hf_model):
    tag = trained(runs, "dense", 0, 1, 1)
    one_error_line(megasparse_here("convert", "consolidate", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")),
                   "does not exist")
    one_error_line(megasparse_here("inspect", str(tmp_path)), "is not a megasparse checkpoint")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    one_error_line(megasparse_here("convert", "export-hf", str(tag), "--out", str(tmp_path / "taken")), "already exists")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    one_error_line(megasparse_here("convert", "import-hf", str(tmp_path / "taken"), "--out", str(tmp_path / "o")),
                   "is not a Hugging Face model folder (no config.json)")
    one_error_line(megasparse_here("convert", "import-hf", str(hf_model), "--out", str(tmp_path / "o"), "--layer", "lowrank",
                              "--rank", "64"), "lowrank.rank: rank 64 for q_proj (64 x 64) must be in (0, 64)")
    assert not (tmp_path / "o").exists()


def test_init_from_another_model(runs, dataset, tmp_path):
    megasparse_here("convert", "consolidate", str(trained(runs, "dense", 0, 1, 1)), "--out", str(tmp_path / "model")).check()
    cfg = tiny_config(dataset, tmp_path / "out", model={"n_layers": 3}, checkpoint={"init_from": str(tmp_path / "model")})
    one_error_line(megasparse("train", str(write_config(tmp_path / "run.yaml", cfg))),
                   "is for another model: model.n_layers=2, this config has 3")
