"""The CPU-portable parts of the GPU check script: its accuracy comparison with the flex backend (eager on
CPU, forward only) and with the ancestor backend, on the quick settings, in float32 against float32."""

import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import gpu_tree_check  # noqa: E402

SMALL = replace(
    gpu_tree_check.QUICK, grpo_prompt=64, grpo_group=4, mt_turns=4, mt_rollouts=1, lh_turns=12, vocab_size=256
)


def test_accuracy_report_on_cpu_matches_reference_in_float32():
    for backend in ("flex", "ancestor"):
        report = gpu_tree_check.accuracy(SMALL, "cpu", torch.float32, backend=backend)
        assert set(report) == {"grpo", "multi_turn", "long_horizon"}
        for diffs in report.values():
            assert diffs["tree_vs_fp32"] < 1e-5
            assert diffs["sdpa_vs_fp32"] < 1e-5


def test_speed_rows_have_the_reported_fields_on_cpu():
    rows = gpu_tree_check.speed(replace(SMALL, lh_turns=4), "cpu", torch.float32, repeats=1)
    assert [r["name"] for r in rows] == ["grpo", "multi_turn", "long_horizon"]
    for row in rows:
        assert row["T"] >= row["U"] > 0
        assert row["speedup"] > 0 and math.isnan(row["tree_peak_mb"])
