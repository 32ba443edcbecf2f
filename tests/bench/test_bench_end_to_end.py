"""bench.end_to_end's arithmetic, on the timings of one of its runs (the whole bench takes
minutes: two jobs and two bare forwards; it has no smoke test)."""

from __future__ import annotations

import pytest


def test_end_to_end_numbers_from_two_runs():
    """bench.end_to_end's arithmetic (its whole run takes minutes: two jobs, two bare forwards),
    on the timings of its run in docs/benchmarks.md (AVX-512 VM): the sampled stage took 46.8 s with N tokens and 61.1 s
    with 4N, so the whole-job marginal rate (3N / (T_4N − T_N)) is well below the extraction
    stage's own (3N / (E_4N − E_N))."""
    from bench.end_to_end import summarise

    def manifest(tokens: int, extract: float, forward: float) -> dict:
        timings = {"plan": 1.5, "ray_start": 5.7, "extract_wall": extract, "extract_forward_sum": forward,
                   "extract_fold_sum": forward / 4, "reduce": 0.9, "metrics": 46.8, "write": 2.1,
                   "total": 86.0, "report": 6.6}  # fmt: skip
        return {"counts": {"tokens": tokens, "padding_ratio": 1.014}, "timings_s": timings}

    before = {"seconds": 47.0, "tokens": 321_012, "padding": 1.011}
    after = {"seconds": 51.0, "tokens": 321_012, "padding": 1.011}
    small, large = (98.8, manifest(80_253, 34.3, 14.4)), (166.7, manifest(321_012, 84.2, 56.1))
    res = summarise(before, after, small, large)
    bare = 321_012 / 49.0
    assert res["bare_tokens_per_s"] == pytest.approx(bare)
    assert res["marginal_tokens_per_s"] == pytest.approx(240_759 / 67.9)
    assert res["marginal_ratio"] == pytest.approx(240_759 / 67.9 / bare)
    assert res["marginal_extraction_tokens_per_s"] == pytest.approx(240_759 / 49.9)
    assert res["fixed_cost_s"] == pytest.approx(98.8 - 80_253 * 67.9 / 240_759)
    split = res["fixed_cost_split_s"]
    assert split["process_start_and_exit"] == pytest.approx(98.8 - 86.0 - 6.6)
    assert split["ray_start"] == 5.7
    assert split["extraction_beyond_marginal"] == pytest.approx(34.3 - 80_253 * 67.9 / 240_759)
    assert res["end_to_end_ratio_FN"] == pytest.approx(49.0 / 166.7)
    assert res["forward_share_of_job_FN"] == pytest.approx(56.1 / 166.7)
    assert res["job_forward_tokens_per_s_FN"] == pytest.approx(321_012 / 56.1)
    assert res["job_forward_ratio_FN"] == pytest.approx(49.0 / 56.1)  # same tokens both sides
    assert res["job_fold_per_forward_FN"] == pytest.approx(0.25)
    # two lanes: the forwards' sum counts both lanes' seconds, the fold's share is per sum
    two = summarise(before, after, small, large, lanes=2)
    assert two["job_forward_tokens_per_s_FN"] == pytest.approx(321_012 / 28.05)
    assert two["forward_share_of_job_FN"] == pytest.approx(28.05 / 166.7)
    assert two["job_fold_per_forward_FN"] == pytest.approx(0.25) and two["lanes"] == 2
    with pytest.raises(ValueError, match="counted 321012 tokens, the bare forward 1000"):
        summarise({**before, "tokens": 1000}, after, small, large)
