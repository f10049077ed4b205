"""Config reading, presets, overrides, validation messages, and the derived DeepSpeed config."""
import pytest

from megasparse.config import Config, config_from_dict, load_config, number, section, shipped_configs
from megasparse.errors import ConfigError
from megasparse.model.presets import MODEL_PRESETS
from megasparse.train.deepspeed_config import deepspeed_config


def test_defaults_are_valid_and_use_the_default_preset():
    cfg = load_config()
    assert (cfg.model.preset, cfg.model.dim, cfg.model.ffn_dim) == ("llama-9m", 128, 352)


@pytest.mark.parametrize("name", ["llama-60m", "llama-130m", "llama-240m", "llama-350m", "llama-1b"])
def test_presets_fill_the_shape(name):
    cfg = config_from_dict({"model": {"preset": name}}).validate()
    shape = MODEL_PRESETS[name]
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.ffn_dim) == (
        shape["dim"], shape["n_layers"], shape["n_heads"], shape["ffn_dim"])


def test_keys_next_to_a_preset_override_it():
    cfg = config_from_dict({"model": {"preset": "llama-60m", "n_layers": 2}})
    assert (cfg.model.dim, cfg.model.n_layers) == (512, 2)


def test_yaml_file_and_set_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: llama-tiny}\ntraining: {steps: 500, micro_batch_size: 4, global_batch_size: 16}\n")
    cfg = load_config(str(path), ["training.steps=200", "optimizer.lr=1e-3", "optimizer.betas=[0.9, 0.99]",
                                  "data.files=[a.txt, b.txt]", "deepspeed.zero_optimization.overlap_comm=true"])
    assert cfg.training.steps == 200 and cfg.training.global_batch_size == 16
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.betas == (0.9, 0.99)
    assert cfg.data.files == ["a.txt", "b.txt"]
    assert cfg.deepspeed == {"zero_optimization": {"overlap_comm": True}}


def test_shipped_configs_load_by_name():
    assert "quickstart" in shipped_configs()
    for name in shipped_configs():
        assert isinstance(load_config(name), Config)


@pytest.mark.parametrize("raw,message", [
    ({"trainig": {}}, "trainig: unknown key"),
    ({"training": {"stepz": 3}}, "training.stepz: unknown key"),
    ({"training": {"steps": "many"}}, "training.steps: expected int, got str 'many'"),
    ({"training": {"steps": 2.5}}, "training.steps: expected int"),
    ({"training": {"precision": "fp8"}}, "training.precision: 'fp8' is not one of 'fp32', 'bf16'"),
    ({"training": {"progress": True}}, "training.progress: unknown key"),
    ({"logging": {"progress_bar": "yes"}}, "logging.progress_bar: expected bool"),
    ({"parallel": {"zero_stage": 4}}, "parallel.zero_stage: 4 is not one of 0, 1, 2, 3"),
    ({"parallel": {"zero_stage": True}}, "parallel.zero_stage: True is not one of"),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas: expected 2 values"),
    ({"optimizer": {"lr": -1.0}}, "optimizer.lr: must be > 0"),
    ({"optimizer": {"lr": 1e-3, "min_lr": 1e-2}}, "optimizer.min_lr: must be in [0, optimizer.lr=0.001]"),
    ({"optimizer": {"warmup_steps": 5000}}, "optimizer.warmup_steps: must be in [0, training.steps=1000]"),
    ({"model": {"preset": "llama-7t"}}, "model.preset: unknown preset 'llama-7t'"),
    ({"model": {"preset": "", "dim": 64}}, "model.n_layers: must be > 0"),
    ({"model": {"dim": 130}}, "model.dim: 130 is not divisible by model.n_heads=4"),
    ({"model": {"n_kv_heads": 3}}, "model.n_kv_heads: 3 must divide model.n_heads=4"),
    ({"data": {"seq_len": 1}}, "data.seq_len: must be >= 2"),
    ({"data": {"files": "a.txt"}}, "data.files: expected a list"),
    ({"data": {"val_fraction": 1.0}}, "data.val_fraction: must be in [0, 1)"),
    ({"data": {"files": ["a.txt"], "hf_dataset": "c4"}}, "data.hf_dataset: and data.files both give the training text"),
    ({"data": {"sources": [{"name": "web", "files": ["a.txt"]}], "files": ["b.txt"]}},
     "data.files: is set next to data.sources"),
    ({"data": {"sources": [{"name": "web"}]}}, "data.sources[0]: give exactly one of path, files, hf_dataset (got none)"),
    ({"data": {"sources": [{"name": "web", "files": ["a"], "path": "p"}]}}, "(got path, files)"),
    ({"data": {"sources": [{"name": "a/b", "files": ["a"]}]}}, "data.sources[0].name: 'a/b' is not a name"),
    ({"data": {"sources": [{"name": "2", "files": ["a"]}]}}, "data.sources[0].name: '2' is not a name"),
    ({"data": {"sources": [{"name": "x", "files": ["a"]}, {"name": "x", "files": ["b"]}]}},
     "data.sources[1].name: 'x' names two sources"),
    ({"data": {"sources": [{"name": "x", "files": ["a"], "weight": -1}]}}, "data.sources[0].weight: must be >= 0"),
    ({"data": {"sources": [{"name": "x", "files": ["a"], "max_epochs": -2}]}}, "data.sources[0].max_epochs: must be >= 0"),
    ({"data": {"sources": [{"name": "x", "files": ["a"], "schedule": [[5, 1], [3, 1]]}]}},
     "data.sources[0].schedule: steps [5, 3] must be increasing"),
    ({"data": {"sources": [{"name": "x", "files": ["a"], "schedule": [[5, -1]]}]}},
     "data.sources[0].schedule: weights must be finite and >= 0"),
    ({"data": {"sources": [{"name": "x", "files": ["a"], "schedule": [[5, 0]]}]}},
     "data.sources: every weight is 0 at step 5"),
    ({"data": {"sources": [{"name": "x", "files": ["a"], "colour": 1}]}}, "data.sources[0].colour: unknown key"),
    ({"model": [1, 2]}, "model: expected a mapping"),
    ({"training": {"precision": "bf16"}}, "training.precision: bf16 needs parallel.zero_stage 1, 2 or 3"),
])
def test_bad_values_name_the_key(raw, message):
    with pytest.raises(ConfigError) as error:
        config_from_dict(raw).validate()
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_batch_split_is_checked_against_the_process_count():
    cfg = config_from_dict({"training": {"micro_batch_size": 4, "global_batch_size": 8}})
    cfg.validate(data_parallel_size=2)
    with pytest.raises(ConfigError, match=r"training.global_batch_size: 8 is not divisible by micro_batch_size x "
                                          r"data-parallel size = 4 x 3"):
        cfg.validate(data_parallel_size=3)


@pytest.mark.parametrize("micro,global_batch,ranks,fitted", [
    (64, 512, 16, 32),  # 32 sequences per rank: one micro-batch of 32
    (16, 512, 128, 4),
    (48, 512, 8, 32),   # 64 per rank: two of 32, the largest under 48 that divides 64
    (8, 512, 8, 8),     # fits as configured: unchanged
    (3, 8, 1, 2),
])
def test_the_micro_batch_is_fitted_to_the_data_parallel_ranks(micro, global_batch, ranks, fitted):
    """The configured micro-batch is the most a rank takes at once: where it does not divide a rank's share of the
    step, the largest one below it that does is used, and the note says so."""
    cfg = config_from_dict({"training": {"micro_batch_size": micro, "global_batch_size": global_batch}})
    note = cfg.fit_micro_batch(ranks)
    assert cfg.training.micro_batch_size == fitted and (note is None) == (fitted == micro)
    assert note is None or note.startswith(f"training.micro_batch_size: {micro} -> {fitted}")
    cfg.validate(ranks)


def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused_with_a_hint():
    cfg = config_from_dict({"training": {"micro_batch_size": 8, "global_batch_size": 512}})
    with pytest.raises(ConfigError, match=r"training.global_batch_size: 512 sequences do not split over 24 "
                                          r"data-parallel ranks; use a multiple of 24 \(e.g. 504 or 528\)"):
        cfg.fit_micro_batch(24)


GPU_SIZES = (8, 16, 32, 64, 128)


def _header_world_sizes(path) -> set[int]:
    """The process counts a config's header comment names: ``--nodes N --procs-per-node G`` and ``--nproc N``."""
    import re

    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    sizes = {int(n) * int(g) for n, g in re.findall(r"--nodes (\d+) --procs-per-node (\d+)", header)}
    return sizes | {int(n) for n in re.findall(r"--nproc(?:_per_node)? (\d+)", header)}


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_every_shipped_config_runs_at_its_world_sizes(name):
    """Each shipped config passes every check a run makes before training (preflight) at the process counts its
    header names (one model replica where it names none), and a config for GPU clusters also at 8, 16, 32, 64 and
    128 GPUs."""
    from megasparse.train.trainer import preflight

    path = shipped_configs()[name]
    cluster = "GPU cluster" in "".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    named = _header_world_sizes(path) or {load_config(name).parallel.tensor_parallel}
    for world in sorted(named | (set(GPU_SIZES) if cluster else set())):
        preflight(load_config(name), world)


@pytest.mark.parametrize("text,message", [
    ("model: {preset: llama-tiny\n", "malformed YAML at line 2"),
    ("- a\n- b\n", "a config must be a mapping of sections, got list"),
])
def test_unreadable_files(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path))


def test_missing_config_names_the_shipped_ones():
    with pytest.raises(ConfigError, match="'nope.yaml' is neither a file nor a shipped config .*quickstart"):
        load_config("nope.yaml")


@pytest.mark.parametrize("item,message", [("training.steps", "expected section.key=value"),
                                          ("training.steps.x=3", "'training.steps' is not a section")])
def test_bad_overrides(item, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["training.steps=5", item])


def test_deepspeed_config_is_derived_from_one_source():
    cfg = config_from_dict({
        "training": {"micro_batch_size": 2, "global_batch_size": 16, "precision": "bf16", "grad_clip": 0.5},
        "parallel": {"zero_stage": 2},
        "deepspeed": {"zero_optimization": {"reduce_bucket_size": 1000}, "communication_data_type": "fp32"},
    })
    ds = deepspeed_config(cfg, data_parallel_size=2)
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True}
    assert ds["zero_optimization"] == {"reduce_bucket_size": 1000, "stage": 2}
    assert ds["communication_data_type"] == "fp32" and ds["zero_allow_untested_optimizer"] is True


@pytest.mark.parametrize("block,key", [({"train_batch_size": 4}, "deepspeed.train_batch_size"),
                                       ({"zero_optimization": {"stage": 3}}, "deepspeed.zero_optimization.stage"),
                                       ({"gradient_clipping": 0.0}, "deepspeed.gradient_clipping"),
                                       ({"optimizer": {"type": "Adam"}}, "deepspeed.optimizer"),
                                       ({"data_types": {"grad_accum_dtype": "fp32"}}, "deepspeed.data_types")])
def test_deepspeed_block_cannot_set_derived_keys(block, key):
    with pytest.raises(ConfigError, match=f"{key}: derived by megasparse"):
        deepspeed_config(config_from_dict({"deepspeed": block}), data_parallel_size=1)


def test_a_number_without_bounds_cannot_be_declared():
    with pytest.raises(TypeError, match="Broken.steps: a numeric config key needs bounds"):
        @section
        class Broken:
            steps: int = 3


def test_a_number_needs_at_least_one_bound():
    with pytest.raises(TypeError, match="needs at least one bound"):
        number(5)


def test_every_path_key_declares_its_kind():
    """Every key that names a place on disk (by its name) declares what it must be (a section refuses an
    unbounded number by itself, at import)."""
    places = [key for key, _ in Config().keys() if key.split(".")[1] in ("path", "dir", "output_dir", "tokenizer",
                                                                          "init_from")]
    assert len(places) == 5
    for key, declared in Config().keys():
        assert (key in places) == ("path" in declared.metadata), key


def test_a_config_builds_on_its_base(tmp_path):
    """``base:`` names another config (shipped, or a path from the including file): its sections merge
    under this one key by key, lists are replaced, and bases chain."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "middle.yaml").write_text("base: smet-quickstart\ntraining:\n  steps: 70\n"
                                                  "sparse:\n  targets: [q_proj]\n")
    (tmp_path / "top.yaml").write_text("base: sub/middle.yaml\ntraining:\n  micro_batch_size: 2\n")
    cfg = load_config(str(tmp_path / "top.yaml"))
    shipped = load_config("smet-quickstart")
    assert (cfg.training.steps, cfg.training.micro_batch_size) == (70, 2)
    assert cfg.training.global_batch_size == shipped.training.global_batch_size
    assert cfg.sparse.targets == ["q_proj"] and cfg.sparse.density == shipped.sparse.density
    assert cfg.optimizer == shipped.optimizer


@pytest.mark.parametrize("files, message", [
    ({"a.yaml": "base: a.yaml\n"}, r"configs include each other \(.*a.yaml -> .*a.yaml\)"),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, r"configs include each other"),
    ({"a.yaml": "base: nowhere\n"}, r"a.yaml: base: config 'nowhere' is neither a file nor a shipped config"),
    ({"a.yaml": "base: [quickstart]\n"}, r"a.yaml: base: expected the name or path of a config"),
])
def test_bad_bases(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(str(tmp_path / "a.yaml"))


@pytest.mark.parametrize("tiny, paper, resized", [
    ("smet-paper-tiny", "smet-paper-llama-130m", {"optimizer.warmup_steps", "sparse.update_interval",
                                                   "smet.slot_warmup_steps"}),
    ("spectron-paper-tiny", "spectron-paper-60m", {"optimizer.warmup_steps"}),
    ("hybrid-tiny", "hybrid-llama-130m", {"optimizer.warmup_steps", "sparse.update_interval", "smet.slot_warmup_steps",
                                          "lowrank.rank"}),
])
def test_the_cpu_variants_keep_the_paper_recipe(tiny, paper, resized):
    """Only sizes, lengths and places differ between a paper config and its CPU variant: every key of the
    method's recipe (optimizer, sparse, smet, lowrank, spectron, the initialisation, clipping) is the same,
    apart from the step counts scaled with the run."""
    small, large = load_config(tiny).to_dict(), load_config(paper).to_dict()
    for name in ("optimizer", "sparse", "smet", "lowrank", "spectron"):
        for key, value in large[name].items():
            if f"{name}.{key}" not in resized:
                assert small[name][key] == value, f"{name}.{key}"
    for key in ("layer", "init", "init_std"):
        assert small["model"][key] == large["model"][key]
    assert small["training"]["grad_clip"] == large["training"]["grad_clip"]
