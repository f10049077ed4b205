"""The CPU variants of the paper recipes (and of the hybrid's), trained as shipped (about a minute each; not in CI: run them with
``pytest -m paper`` before changing a method's defaults)."""
import pytest
from helpers import megasparse, train_losses

from megasparse.train.metrics import read_metrics

pytestmark = pytest.mark.paper


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("paper")  # the embedded corpus, prepared by the first run for both


@pytest.mark.parametrize("name, kind", [("smet-paper-tiny", "smet"), ("spectron-paper-tiny", "spectron"),
                                        ("hybrid-tiny", "hybrid")])
def test_paper_recipe_on_a_cpu(workdir, name, kind):
    """The CPU variant of each paper config trains as shipped and learns (its recipe: test_config): from
    ln(8000) = 9.0 at the start, the validation loss falls below 6.5 by step 100 and on by step 200."""
    megasparse("train", name, cwd=workdir).check()
    out = workdir / "runs" / name
    evals = [r["val_loss"] for r in read_metrics(out, "eval")]
    assert len(train_losses(out)) == 20 and evals[0] < 6.5 and evals[-1] < evals[0] - 0.2, evals
    if kind in ("smet", "hybrid"):
        assert len(read_metrics(out, "topology")) == 7  # every 25 steps before the last
    if kind in ("spectron", "hybrid"):
        assert all(r["spectral_norm_max"] > 0 for r in read_metrics(out))
