"""examples/step_reward.py, a step reward written as a user would, runs as documented and trains (issue #38).

What holds by construction: the digit steps of hand-written completions; the script, run as
``python examples/step_reward.py --max_steps 1``, trains one step with the step reward's steps mapped to
tokens (``process/steps_per_completion`` > 0: the toy policy's completions are never all empty) and prints
its per-step line.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "step_reward.py"


def _module():
    return runpy.run_path(str(EXAMPLE), run_name="step_reward_example")


def test_digit_steps_by_hand():
    digit_steps = _module()["digit_steps"]
    from grpo_variants.rewards.steps import is_step_reward

    assert is_step_reward(digit_steps)
    got = digit_steps(prompts=["37+45="] * 4, completions=["82", "85", "8", ""], answer=["82"] * 4)
    assert got == [[(1, 1.0), (2, 1.0)], [(1, 1.0), (2, 0.0)], [(1, 1.0)], []]
    chat = digit_steps(prompts=[[{"role": "user", "content": "9+9="}]],
                       completions=[[{"role": "assistant", "content": "18"}]], answer=["18"])
    assert chat == [[(1, 1.0), (2, 1.0)]]


def test_the_example_runs_as_documented(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--output_dir", str(tmp_path / "out"), "--max_steps", "1"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("step 1: steps per completion"))
    assert "digit_steps mean" in line
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    history = [r for r in state["log_history"] if "process/steps_per_completion" in r]
    assert state["global_step"] == 1 and len(history) == 1 and history[0]["process/steps_per_completion"] > 0
