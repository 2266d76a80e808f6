"""Kills at every fault point of the save path, on a 2-rank gloo job: nothing committed is torn or
lost, nothing is reported committed that is not, and the resumed run ends where the uninterrupted
run ends. ``benchmarks/bench_faults.py`` runs many more cases (``--cases``, ``--seed``)."""

from __future__ import annotations

import os

import pytest

from tests.faults import harness
from tests.faults.job import JobConfig, reference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

CFG = JobConfig()
SEEDS = [10, 11, 12, 13, 14, 17]
"""One case per seed; a seed's point is ``CAMPAIGN_POINTS[seed % 5]``: every point once, ``saver.write`` twice."""


@pytest.fixture(scope="module")
def ref():
    return reference(CFG)


def test_uninterrupted_job_equals_the_reference(tmp_path, ref, run_base):
    ckpt = str(tmp_path / "ckpt")
    try:
        codes = harness.launch(CFG, ckpt, str(tmp_path / "out"), harness.job_env(run_base))
        assert codes == [0, 0], open(tmp_path / "out" / "rank-0.log").read()[-3000:]
        assert harness.wait_for_savers(run_base, ckpt), "the saver did not exit after the job had closed"
        assert harness.check(ckpt, CFG, ref, str(tmp_path / "out")) == []
    finally:
        harness.stop_savers(run_base, ckpt)


def test_random_kills_at_every_fault_point(tmp_path, ref):
    cases = [harness.draw(seed, CFG) for seed in SEEDS]
    assert {c.point for c in cases} == set(harness.CAMPAIGN_POINTS)
    outcomes = []
    for case in cases:
        workdir = tmp_path / f"seed-{case.seed}"
        os.makedirs(workdir)
        outcomes.append(harness.run_case(case, CFG, ref, str(workdir)))
    report = "\n".join(harness.describe(o) for o in outcomes)
    print(report)
    failed = [o.case.seed for o in outcomes if not o.passed]
    assert not failed, f"failed seeds {failed} (rerun: python benchmarks/bench_faults.py --seeds " \
                       f"{','.join(map(str, failed))})\n{report}"


def test_fault_spec_parsing():
    from flashckpt_integrations._utils.faults import parse

    assert parse(None) == {} and parse("") == {}
    assert parse("saver.write@3, trainer.copy") == {"saver.write": 3, "trainer.copy": 1}
    for bad in ("saver.write@0", "saver.write@x", "nowhere@2"):
        with pytest.raises(ValueError, match="FLASHCKPT_FAULT"):
            parse(bad)
