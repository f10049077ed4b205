"""A weighted mixture end to end: preparation (one tokenizer sampled across the sources, per-source budgets,
parts prepared separately then indexed, sources added later), training through ``megasparse train`` on 2 ranks
against one process, resume with changed weights on another data-parallel size, the realised mix in the metrics
and in ``megasparse inspect``, and a validation loss per source."""
import pytest
import yaml

from helpers import megasparse, megasparse_here, one_error_line, tiny_config, train_losses, write_config
from megasparse.data.shards import open_prepared
from megasparse.train.metrics import read_metrics


def mixture(corpus, weights=(0.7, 0.3), **data):
    """Two sources of the test corpus: 'prose' (argparse, textwrap) and 'code' (json, collections)."""
    return {"sources": [
        {"name": "prose", "files": [str(corpus / "argparse.py.txt"), str(corpus / "textwrap.py.txt")],
         "weight": weights[0]},
        {"name": "code", "files": [str(corpus / "json_decoder.py.txt"), str(corpus / "collections___init__.py.txt")],
         "weight": weights[1]},
    ], "vocab_size": 400, "val_fraction": 0.1, "workers": 1, **data}


def config(tmp_path, corpus, dataset, run, weights=(0.7, 0.3), **sections):
    cfg = tiny_config(dataset, tmp_path / run, **sections)
    cfg["data"].update(mixture(corpus, weights))
    return write_config(tmp_path / f"{run}.yaml", cfg)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, corpus):
    """The mixture prepared by `megasparse train` itself on 2 ranks, then trained 8 steps there."""
    tmp = tmp_path_factory.mktemp("mixture")
    path = config(tmp, corpus, tmp / "tokens", "two")
    result = megasparse("train", str(path), nproc=2).check()
    return tmp, result


def test_a_mixture_trains_on_two_ranks_as_on_one(two_rank_run, corpus):
    tmp, result = two_rank_run
    assert "no dataset at" in result.stdout and "prose=" in result.stdout
    one = megasparse("train", str(config(tmp, corpus, tmp / "tokens", "one")), nproc=1).check()
    assert "preparing" not in one.stdout
    assert train_losses(tmp / "one") == pytest.approx(train_losses(tmp / "two"), rel=1e-5, abs=1e-6)
    train = read_metrics(tmp / "two")
    assert train[-1]["mix/prose"] == pytest.approx(0.7, abs=1 / 64) and train[-1]["mix/code"] == 1 - train[-1]["mix/prose"]
    assert 0 < train[-1]["epochs/code"] < 1
    evaluation = read_metrics(tmp / "two", "eval")[-1]
    mixed = 0.7 * evaluation["val_loss/prose"] + 0.3 * evaluation["val_loss/code"]
    assert evaluation["val_loss"] == pytest.approx(mixed) and evaluation["val_loss/prose"] != evaluation["val_loss/code"]


def test_the_tokenizer_is_trained_across_all_sources(two_rank_run):
    tmp, _ = two_rank_run
    data = open_prepared(tmp / "tokens")
    assert set(data.sources) == {"prose", "code"}
    documents = sum(source.index["splits"][split]["documents"] for source in data.sources.values()
                    for split in ("train", "val"))
    assert data.index["tokenizer"]["trained_on"]["of_documents"] == documents
    assert all(source.tokenizer_sha256 == data.tokenizer_sha256 for source in data.sources.values())


def test_resume_with_new_weights_on_another_layout(two_rank_run, corpus):
    """Resumed at step 4 on one rank with the weights swapped: the change is announced, the new segment follows
    the new weights, and inspect shows the realised mix against the weights."""
    tmp, _ = two_rank_run
    resumed = config(tmp, corpus, tmp / "tokens", "two", weights=(0.2, 0.8))
    (tmp / "two" / "checkpoints" / "step_00000008" / "megasparse.json").unlink()  # incomplete: resume from step 4
    result = megasparse("train", str(resumed), "--resume", "auto", nproc=1).check()
    assert "the mixture's weights differ from the checkpoint's (prose 0.7 -> 0.2, code 0.3 -> 0.8)" in result.stdout
    last = read_metrics(tmp / "two")[-1]
    # steps 1-4 read 0.7 / 0.3 of 32 sequences, steps 5-8 0.2 / 0.8 of 32: (22 + 6) of 64 are prose
    assert last["mix/prose"] == pytest.approx(28 / 64, abs=1 / 64)
    report = megasparse_here("inspect", str(tmp / "two" / "checkpoints" / "step_00000008")).check().stdout
    assert "data mix     prose:" in report and "weight 20.0%" in report


def test_prepared_in_parts_then_indexed(tmp_path, corpus):
    """One part per source (as a Slurm array runs them), then the final step: the same dataset as at once; a
    budget splits by weight; a source added to the config later is prepared into the existing mixture."""
    at_once = tmp_path / "once.yaml"
    write_config(at_once, {"data": {**mixture(corpus), "path": str(tmp_path / "once"), "max_tokens": 3000}})
    in_parts = tmp_path / "parts.yaml"
    write_config(in_parts, {"data": {**mixture(corpus), "path": str(tmp_path / "parts"), "max_tokens": 3000}})
    megasparse_here("prepare-data", str(at_once)).check()
    for name in ("code", "0"):  # by name, or by position (a Slurm array task's id): 0 is prose
        assert "prepared source" in megasparse_here("prepare-data", str(in_parts), "--source", name).check().stdout
    one_error_line(megasparse_here("prepare-data", str(in_parts), "--source", "2"), "--source 2: no such source")
    megasparse_here("prepare-data", str(in_parts)).check()
    once, parts = open_prepared(tmp_path / "once"), open_prepared(tmp_path / "parts")
    assert once.tokenizer_sha256 == parts.tokenizer_sha256
    for name in ("prose", "code"):
        for shard in once.sources[name].index["splits"]["train"]["shards"]:
            assert (once.sources[name].directory / shard["file"]).read_bytes() == \
                (parts.sources[name].directory / shard["file"]).read_bytes()
    train_tokens = {name: source.index["splits"]["train"]["tokens"] for name, source in once.sources.items()}
    assert 2100 <= train_tokens["prose"] < 2100 + 2000 and 900 <= train_tokens["code"] < 900 + 2000
    again = megasparse_here("prepare-data", str(in_parts))
    one_error_line(again, "already holds a prepared dataset of these sources")

    grown = {"data": {**mixture(corpus), "path": str(tmp_path / "parts")}}
    grown["data"]["sources"].append({"name": "more", "files": [str(corpus / "textwrap.py.txt")], "weight": 0.1})
    megasparse_here("prepare-data", str(write_config(tmp_path / "grown.yaml", grown))).check()
    assert set(open_prepared(tmp_path / "parts").sources) == {"prose", "code", "more"}


def test_a_prepared_source_of_another_tokenizer_is_refused(tmp_path, corpus, dataset):
    cfg = {"data": {**mixture(corpus), "path": str(tmp_path / "mix")}}
    cfg["data"]["sources"][1] = {"name": "code", "path": str(dataset), "weight": 0.3}
    cfg["data"]["tokenizer"] = str(tmp_path / "other.model")
    other = {"data": {"files": [str(corpus / "textwrap.py.txt")], "vocab_size": 360, "path": str(tmp_path / "o")}}
    megasparse_here("prepare-data", str(write_config(tmp_path / "o.yaml", other))).check()
    (tmp_path / "other.model").write_bytes((tmp_path / "o" / "tokenizer.model").read_bytes())
    result = megasparse_here("prepare-data", str(write_config(tmp_path / "mix.yaml", cfg)))
    one_error_line(result, "data.sources[code].path")


def test_a_mixture_never_overwrites_a_dataset(tmp_path, corpus, dataset):
    """Onto a dataset of one source, or onto a mixture whose tokenizer other settings would make: refused, nothing
    changed. A source whose directory was removed is prepared again."""
    import shutil

    single = tmp_path / "single"
    shutil.copytree(dataset, single)
    before = (single / "index.json").read_bytes()
    cfg = {"data": {**mixture(corpus), "path": str(single)}}
    one_error_line(megasparse_here("prepare-data", str(write_config(tmp_path / "a.yaml", cfg))), "not a mixture")
    assert (single / "index.json").read_bytes() == before

    cfg["data"]["path"] = str(tmp_path / "mix")
    megasparse_here("prepare-data", str(write_config(tmp_path / "b.yaml", cfg))).check()
    cfg["data"]["vocab_size"] = 420
    cfg["data"]["sources"][1]["weight"] = 0.5  # (a change of weight alone needs no preparation)
    cfg["data"]["sources"].append({"name": "more", "files": [str(corpus / "textwrap.py.txt")]})
    one_error_line(megasparse_here("prepare-data", str(write_config(tmp_path / "c.yaml", cfg))),
                   "has 400 pieces, not data.vocab_size=420")
    cfg["data"]["vocab_size"] = 400
    shutil.rmtree(tmp_path / "mix" / "sources" / "code")
    megasparse_here("prepare-data", str(write_config(tmp_path / "d.yaml", cfg))).check()
    assert set(open_prepared(tmp_path / "mix").sources) == {"prose", "code", "more"}


def test_a_run_past_a_repetition_cap_is_refused_before_it_starts(two_rank_run, corpus):
    """One line naming the source, before any process group (preflight), on every launcher's path."""
    tmp, _ = two_rank_run
    path = config(tmp, corpus, tmp / "tokens", "capped", training={"steps": 40})
    raw = yaml.safe_load(path.read_text())
    raw["data"]["sources"][1]["max_epochs"] = 0.01  # 40 steps of 8 read about 96 of its windows: far more than 1 %
    result = megasparse("train", str(write_config(path, raw)), nproc=1)
    one_error_line(result, "data.sources[code]: the run reads up to")
    assert not (tmp / "capped").exists()
