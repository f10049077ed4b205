"""Weighted mixtures (data.sources): the apportionment's bound, determinism, the same batches in every layout,
exact resume (on another data-parallel size too), weight changes and schedules that neither repeat nor skip,
and repetition caps."""
import numpy as np
import pytest

from megasparse.config import SourceConfig
from megasparse.data.loader import PretrainingBatches
from megasparse.data.mixture import Mixture
from megasparse.data.shards import ShardWriter, TokenWindows
from megasparse.errors import UserError

SEQ = 4
BASE = 10_000  # source i's tokens are i * BASE + t: a row names its source and window


def source_windows(tmp_path, sizes):
    """One TokenWindows per source, of sizes[i] windows."""
    out = []
    for i, n in enumerate(sizes):
        directory = tmp_path / f"s{i}"
        directory.mkdir()
        writer = ShardWriter(directory, "train", np.dtype(np.uint16), shard_tokens=n * SEQ + 1)
        writer.write(i * BASE + np.arange(n * SEQ + 1))
        entry = writer.close()
        out.append(TokenWindows([directory / s["file"] for s in entry["shards"]], [s["tokens"] for s in entry["shards"]],
                                np.dtype(np.uint16), SEQ))
    return out


def sources(*weights, schedules=None, caps=None):
    return [SourceConfig(name=f"src{i}", weight=w, schedule=(schedules or {}).get(i, []),
                         max_epochs=(caps or {}).get(i, 0.0), files=["x"]) for i, w in enumerate(weights)]


def loaders(windows, configs, dp_size, micro, global_batch=12, seed=5):
    return [PretrainingBatches(windows, global_batch, micro, r, dp_size, seed, mixture=Mixture(configs))
            for r in range(dp_size)]


def step_reads(ranks):
    """(source, window) of each sample of one optimizer step over all ranks, sorted."""
    rows = [row for loader in ranks for row in loader.next_tokens().reshape(-1, SEQ + 1).tolist()]
    return sorted((row[0] // BASE, (row[0] % BASE) // SEQ) for row in rows)


def test_tijdemans_bound_holds_for_random_weights():
    rng = np.random.default_rng(0)
    for _ in range(40):
        k = int(rng.integers(2, 9))
        weights = rng.random(k) ** rng.choice([1, 4])
        mixture = Mixture(sources(*weights))
        share = weights / weights.sum()
        counts = np.zeros(k)
        for n in range(1, 2001):
            source, _ = mixture.take(n - 1, 1, step=1)
            counts[source[0]] += 1
            assert np.abs(counts - share * n).max() <= 1 - 1 / (2 * k - 2) + 1e-9, (weights, n)


def test_one_source_takes_every_position():
    mixture = Mixture(sources(3.0))
    source, cursor = mixture.take(0, 50, step=1)
    assert (source == 0).all() and (cursor == np.arange(50)).all()


def test_a_zero_weight_reads_nothing():
    mixture = Mixture(sources(1.0, 0.0, 2.0))
    source, _ = mixture.take(0, 300, step=1)
    assert np.bincount(source, minlength=3).tolist() == [100, 0, 200]


@pytest.mark.parametrize("dp_size,micro", [(2, 6), (3, 2), (4, 1), (2, 3)])
def test_the_global_batch_is_the_same_in_every_layout(tmp_path, dp_size, micro):
    windows = source_windows(tmp_path, [23, 40, 9])
    configs = sources(0.5, 0.3, 0.2)
    reference, other = loaders(windows, configs, 1, 12), loaders(windows, configs, dp_size, micro)
    for _ in range(12):  # 144 samples: every source wraps at least once
        assert step_reads(other) == step_reads(reference)


def test_each_source_reads_its_own_order_without_repeats_within_an_epoch(tmp_path):
    windows = source_windows(tmp_path, [50, 40])
    ranks = loaders(windows, sources(0.6, 0.4), 2, 3)
    reads = [r for _ in range(6) for r in step_reads(ranks)]  # 72 samples: 43 and 29, within both epochs
    for source in (0, 1):
        mine = [w for s, w in reads if s == source]
        assert len(mine) == len(set(mine))
    assert sum(s == 0 for s, _ in reads) == round(0.6 * 72)


def test_the_stream_is_deterministic_and_seeded(tmp_path):
    windows = source_windows(tmp_path, [30, 30])
    a, b, c = (loaders(windows, sources(1, 1), 1, 12, seed=s)[0] for s in (5, 5, 6))
    ta, tb, tc = (x.next_tokens() for x in (a, b, c))
    assert (ta == tb).all() and not (ta == tc).all()


@pytest.mark.parametrize("dp_before,dp_after", [(2, 2), (2, 4), (4, 1)])
def test_resume_continues_exactly_on_any_data_parallel_size(tmp_path, dp_before, dp_after):
    windows = source_windows(tmp_path, [23, 40, 9])
    configs = sources(0.5, 0.3, 0.2)
    uninterrupted = loaders(windows, configs, 1, 12)
    expected = [step_reads(uninterrupted) for _ in range(10)]
    first = loaders(windows, configs, dp_before, 12 // (dp_before * 2) or 1)
    for _ in range(4):
        step_reads(first)
    resumed = loaders(windows, configs, dp_after, 12 // dp_after)
    for loader in resumed:
        loader.load_state_dict(first[0].state_dict())
    assert [step_reads(resumed) for _ in range(4, 10)] == expected[4:]


def test_changed_weights_on_resume_neither_repeat_nor_skip(tmp_path):
    """What 'changing weights without repeating or skipping' means: every source's reads, before and after the
    change together, are the first reads of that source's own order (the prefix an uninterrupted run of the new
    weights' source would read), and the positions after the change follow the new weights within the bound."""
    windows = source_windows(tmp_path, [300, 300])
    before = loaders(windows, sources(0.8, 0.2), 2, 3)
    reads = [r for _ in range(5) for r in step_reads(before)]  # 60 samples: 48 + 12
    after = loaders(windows, sources(0.2, 0.8), 2, 3)
    for loader in after:
        loader.load_state_dict(before[0].state_dict())
    later = [r for _ in range(5) for r in step_reads(after)]
    assert [s for s, _ in later].count(1) == 48  # the new segment's 60 positions: 0.8 of them
    alone = [loaders(windows, sources(*([1, 0] if s == 0 else [0, 1])), 1, 12)[0] for s in (0, 1)]
    for s in (0, 1):  # the whole run's reads of source s are the first of its order, in some order
        mine = sorted(w for t, w in reads + later if t == s)
        own_order = [w for _ in range(10) for t, w in step_reads([alone[s]]) if t == s][:len(mine)]
        assert mine == sorted(own_order)


def test_a_schedule_starts_a_segment_at_its_step(tmp_path):
    windows = source_windows(tmp_path, [500, 500])
    configs = sources(0.75, 0.25, schedules={0: [(4, 0.25)], 1: [(4, 0.75)]})  # from step 4: 0.25 / 0.75
    ranks = loaders(windows, configs, 2, 6)
    steps = [step_reads(ranks) for _ in range(8)]
    assert sum(s == 0 for step in steps[:3] for s, _ in step) == 27  # 0.75 of 36
    assert sum(s == 0 for step in steps[3:] for s, _ in step) == 15  # 0.25 of 60
    for taken in (2, 5):  # resumed before the change (crossing it) and after it: the same stream
        fresh = loaders(windows, configs, 2, 6)
        for _ in range(taken):
            step_reads(fresh)
        resumed = loaders(windows, configs, 1, 12)
        resumed[0].load_state_dict(fresh[0].state_dict())
        assert [step_reads(resumed) for _ in range(taken, 8)] == steps[taken:]


def test_planned_reads_bound_what_the_run_reads():
    """From any step, with or without a schedule ahead or behind, the planned reads are at least the reads."""
    rng = np.random.default_rng(1)
    for _ in range(30):
        k, steps = int(rng.integers(2, 6)), 12
        change = int(rng.integers(2, steps))
        configs = sources(*rng.random(k), schedules={i: [(change, float(rng.random()))] for i in range(k)})
        mixture = Mixture(configs)
        start = int(rng.integers(0, steps))
        for step in range(1, start + 1):
            mixture.take((step - 1) * 7, 7, step)
        planned = mixture.planned_reads(start, steps, 7)
        for step in range(start + 1, steps + 1):
            mixture.take((step - 1) * 7, 7, step)
        assert all(drawn <= bound + 1e-9 for drawn, bound in zip(mixture.drawn, planned)), (planned, mixture.drawn)


def test_repetition_caps_are_checked_before_training():
    mixture = Mixture(sources(0.5, 0.5, caps={1: 2.0}))
    mixture.check_caps([1000, 100], step=0, steps=16, global_batch_size=12)  # 97 of 100 windows: fine
    with pytest.raises(UserError, match=r"data.sources\[src1\].*above its max_epochs=2"):
        mixture.check_caps([1000, 100], step=0, steps=40, global_batch_size=12)


def test_sources_it_no_longer_has_are_named_on_resume(tmp_path):
    windows = source_windows(tmp_path, [30, 30])
    old = loaders(windows, sources(1, 1), 1, 12)[0]
    old.next_tokens()
    new = PretrainingBatches(windows[:1], 12, 12, 0, 1, 5, mixture=Mixture(sources(1)))
    assert new.load_state_dict(old.state_dict()) == ["src1"]


def test_budgets_follow_the_largest_weight_and_are_never_unlimited():
    from megasparse.config import DataConfig
    from megasparse.data.corpus import source_config

    later = SourceConfig(name="later", weight=0.0, schedule=[(100, 1.0)], files=["x"])
    own = SourceConfig(name="own", weight=5.0, max_tokens=7, files=["x"])
    cfg = DataConfig(path="p", max_tokens=1000, sources=[*sources(3.0, 0.0), later, own])
    budgets = {s.name: source_config(cfg, s).max_tokens for s in cfg.sources}
    assert budgets == {"src0": 750, "src1": 1, "later": 250, "own": 7}
