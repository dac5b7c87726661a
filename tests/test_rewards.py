"""Built-in rewards, the math answer judge, and robust reward calling."""

from __future__ import annotations

import math
import pickle
import threading
import time

import pytest

from grpo_variants.errors import ConfigError, DatasetError, RewardFunctionError
from grpo_variants.rewards import (
    RobustReward,
    build_reward,
    code_pass,
    code_pass_fraction,
    dapo_overlong,
    extract_boxed,
    extract_code,
    extract_final_answer,
    format_think_answer,
    get_reward,
    list_rewards,
    make_code_reward,
    make_format_reward,
    make_length_cosine,
    make_math_accuracy,
    make_overlong_penalty,
    math_accuracy,
    math_accuracy_pm1,
    wrap_reward_funcs,
)
from grpo_variants.rewards.math_verify_utils import answers_match, math_verify_available
from grpo_variants.rewards.sandbox import sandbox_capabilities


def _call(fn, completions, **cols):
    n = len(completions)
    return fn(prompts=["q"] * n, completions=completions, completion_ids=[[1]] * n, **cols)


# ---------------------------------------------------------------------------------------------
# math
# ---------------------------------------------------------------------------------------------
EQUAL_HALVES = ["1/2", "0.5", "\\frac{1}{2}", "\\dfrac12", "\\tfrac{1}{2}", "$\\frac{1}{2}$", "\\left(\\frac{1}{2}\\right)"]


@pytest.mark.parametrize("use_mv", [False, pytest.param(None, id="auto")])
@pytest.mark.parametrize("pred", EQUAL_HALVES)
@pytest.mark.parametrize("gold", ["1/2", "0.5", "\\frac{1}{2}", "\\dfrac12"])
def test_halves_are_equal(pred, gold, use_mv):
    assert answers_match(pred, gold, use_math_verify=use_mv)


@pytest.mark.parametrize(
    "pred, gold, equal",
    [
        ("0.49", "1/2", False),
        ("2", "1/2", False),
        ("50\\%", "50", True),
        ("1,000", "1000", True),
        ("x = 5", "5", True),
        ("5\\text{ cm}", "5", True),
        ("\\text{Monday}", "monday", True),
        ("x^2+1", "1+x^2", True),
        ("x^2+2", "1+x^2", False),
        ("2\\sqrt{2}", "\\sqrt{8}", True),
        ("(1, 2)", "(1,2)", True),
        ("(2, 1)", "(1,2)", False),
        ("-\\frac{3}{4}", "-0.75", True),
        ("9^{9^{9^{9}}}", "1", False),  # bounded power: no hang
    ],
)
def test_fallback_judge(pred, gold, equal):
    assert answers_match(pred, gold, use_math_verify=False) is equal


def test_math_verify_is_bounded_in_the_main_thread():
    """Rewards run in the main thread by default, where math_verify keeps its own time limit: an adversarial
    power tower is judged (not equal) instead of spinning in sympy."""
    assert math_verify_available()  # a core dependency
    t0 = time.monotonic()
    assert answers_match("9^{9^{9^{9}}}", "1") is False
    assert time.monotonic() - t0 < 60


def test_extraction():
    assert extract_boxed("a \\boxed{1} then \\boxed{\\frac{\\sqrt{2}}{\\{3\\}}} end") == "\\frac{\\sqrt{2}}{\\{3\\}}"
    assert extract_boxed("\\boxed{\\frac{a}{b}") is None  # unbalanced
    assert extract_final_answer("so the answer is $\\frac12$. Done") == "\\frac12"
    assert extract_final_answer("work\n#### 1,234") == "1,234"
    assert extract_final_answer("Answer: 42") == "42"
    assert extract_final_answer("I got 3 then 5.5") == "5.5"
    assert extract_final_answer("no digits here") is None


@pytest.fixture(params=["fallback", "auto"])
def judge(request, monkeypatch):
    """Run a test with the built-in judge only, and with math_verify when it is installed."""
    from grpo_variants.rewards import math_verify_utils

    if request.param == "fallback":
        monkeypatch.setattr(math_verify_utils, "_MV", False)
    return request.param


def test_math_accuracy_scores_and_formats(judge):
    comps = [
        "reasoning... \\boxed{\\frac{1}{2}}",
        "The answer is 0.5",
        [{"role": "assistant", "content": "so \\boxed{\\dfrac12}"}],  # conversational
        "\\boxed{0.49}",
        "I don't know",
    ]
    assert _call(math_accuracy, comps, answer=["1/2"] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert _call(math_accuracy_pm1, comps, answer=["\\boxed{0.5}"] * 5) == [1.0, 1.0, 1.0, -1.0, -1.0]
    pm = make_math_accuracy(correct=2.0, wrong=-0.5, name="m")
    assert pm.__name__ == "m" and _call(pm, ["\\boxed{3}", "\\boxed{4}"], answer=["3", "3"]) == [2.0, -0.5]
    # GSM8K-style gold, numeric gold.
    assert _call(math_accuracy, ["\\boxed{72}", "72"], answer=["blah\n#### 72", 72]) == [1.0, 1.0]


def test_math_unparsable_gold_is_missing(caplog, judge):
    from grpo_variants.rewards import builtin

    builtin._warned_golds.discard(repr("x+"))
    with caplog.at_level("WARNING"):
        out = _call(math_accuracy, ["\\boxed{1}", "\\boxed{x}"], answer=["x+", "x+"])
    assert out == [None, None]
    assert "'x+'" in caplog.text  # the warning names the gold
    n_warnings = caplog.text.count("cannot parse the gold answer")
    assert n_warnings == 1  # once, not per sample


def test_math_missing_column_is_clear():
    with pytest.raises(DatasetError, match="'answer'"):
        _call(math_accuracy, ["\\boxed{1}"], gold=["1"])
    acc = make_math_accuracy(answer_column="gold")
    assert _call(acc, ["\\boxed{1}"], gold=["1"]) == [1.0]


def test_math_accepts_trl_solution_column():
    # TRL's accuracy_reward reads `solution`; the default math_accuracy reads `answer`, else `solution`
    assert _call(math_accuracy, ["\\boxed{1}", "\\boxed{2}"], solution=["1", "1"]) == [1.0, 0.0]
    assert _call(math_accuracy, ["\\boxed{1}"], answer=["1"], solution=["2"]) == [1.0]  # `answer` first
    with pytest.raises(DatasetError, match="'gold'"):  # an explicit column is the only one read
        _call(make_math_accuracy(answer_column="gold"), ["\\boxed{1}"], solution=["1"])


@pytest.mark.skipif(not math_verify_available(), reason="math-verify (optional extra 'math') is not installed")
def test_math_verify_path_in_worker_thread():
    # math_verify's own timeouts use signal.alarm, which fails outside the main thread (verl PR #5635);
    # we call it with its timeouts disabled, so it must work in a worker thread and agree with us.
    from grpo_variants.rewards.math_verify_utils import _math_verify_equal

    results = []
    t = threading.Thread(target=lambda: results.append((_math_verify_equal("\\dfrac12", "0.5"),
                                                        _math_verify_equal("0.49", "1/2"))))
    t.start()
    t.join(30)
    assert results == [(True, False)]
    wrapped = RobustReward(math_accuracy, timeout=30)
    assert _call(wrapped, ["\\boxed{\\frac{1}{2}}", "\\boxed{0.49}"], answer=["0.5", "0.5"]) == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------
# format
# ---------------------------------------------------------------------------------------------
def test_format_reward():
    good = ["<think>a b</think> The answer is 3", "<think>\n\n</think>\n42", "  <think>x</think>y"]
    bad = ["<think>a</think>", "<think>a</think>   ", "no tags 3", "<think>a<think>b</think>c", "x<think>a</think>b",
           "<think>a</think>b</think>c"]
    assert _call(format_think_answer, good + bad) == [1.0] * len(good) + [0.0] * len(bad)
    tagged = make_format_reward(answer_tag="answer")
    assert _call(tagged, ["<think>r</think><answer> 5 </answer>", "<think>r</think><answer> </answer>",
                          "<think>r</think>5", "<think>r</think><answer>5</answer> trailing"]) == [1.0, 0.0, 0.0, 0.0]
    loose = make_format_reward(require_open_tag=False, think_tag="reasoning")
    assert _call(loose, ["started</reasoning>ans", "<reasoning>r</reasoning>ans"]) == [1.0, 1.0]
    assert _call(format_think_answer, [[{"role": "assistant", "content": "<think>r</think>ok"}]]) == [1.0]
    with pytest.raises(ConfigError):
        make_format_reward(think_tag="<think>")


# ---------------------------------------------------------------------------------------------
# overlong (DAPO eq. 13)
# ---------------------------------------------------------------------------------------------
def _lengths(fn, lengths):
    return fn(prompts=["p"] * len(lengths), completions=["c"] * len(lengths), completion_ids=[[0] * L for L in lengths])


def test_overlong_regions_and_boundaries():
    f = make_overlong_penalty(max_completion_len=100, soft_cache_len=20)
    got = _lengths(f, [0, 50, 80, 81, 90, 99, 100, 101, 500])
    want = [0.0, 0.0, 0.0, -1 / 20, -10 / 20, -19 / 20, -1.0, -1.0, -1.0]
    assert got == pytest.approx(want)
    # L = L_max - L_cache exactly -> 0; L = L_max -> ((L_max-L_cache)-L_max)/L_cache = -1; L_max + 1 -> -1.
    assert got[2] == 0.0 and got[6] == -1.0 and got[7] == -1.0
    assert f.__name__ == "overlong_penalty"


def test_dapo_overlong_default_and_configs():
    assert (dapo_overlong.max_completion_len, dapo_overlong.soft_cache_len) == (20480, 4096)
    assert _lengths(dapo_overlong, [16384, 16385, 18432, 20480, 20481]) == pytest.approx(
        [0.0, -1 / 4096, -0.5, -1.0, -1.0]
    )
    f = build_reward("overlong_penalty", max_completion_len=64, soft_cache_len=16)
    g = build_reward({"name": "overlong_penalty", "max_completion_len": 64, "soft_cache_len": 16})
    assert _lengths(f, [56]) == _lengths(g, [56]) == [-0.5]
    assert get_reward("dapo_overlong") is dapo_overlong
    with pytest.raises(ConfigError, match="soft_cache_len"):
        make_overlong_penalty(10, 20)
    with pytest.raises(ConfigError):
        make_overlong_penalty(0, 0)
    with pytest.raises(RewardFunctionError, match="completion_ids"):
        dapo_overlong(prompts=["p"], completions=["c"])
    with pytest.raises(ConfigError, match="takes no parameters"):
        build_reward("format_thinkk", x=1)


# ---------------------------------------------------------------------------------------------
# cosine length scaling
# ---------------------------------------------------------------------------------------------
def test_length_cosine():
    f = make_length_cosine(100, r0_correct=2.0, rL_correct=1.0, r0_wrong=-10.0, rL_wrong=0.0, exceed_penalty=-10.0)
    comps = ["\\boxed{1}", "\\boxed{1}", "\\boxed{1}", "\\boxed{2}", "\\boxed{2}", "\\boxed{1}", "\\boxed{1}"]
    lengths = [0, 50, 99, 0, 50, 100, 7]
    out = f(prompts=["p"] * 7, completions=comps, completion_ids=[[0] * L for L in lengths], answer=["1"] * 6 + ["x+"])
    assert out[0] == pytest.approx(2.0)  # correct, length 0 -> r0
    assert out[1] == pytest.approx(1.5)  # halfway: mean of r0 and rL
    assert out[2] == pytest.approx(1.0 + 0.5 * (1 + math.cos(math.pi * 0.99)))
    assert out[3] == pytest.approx(-10.0) and out[4] == pytest.approx(-5.0)
    assert out[5] == -10.0  # reached max_len: exceed penalty
    assert out[6] is None  # unparsable gold: missing
    assert out[0] > out[1] > out[2]  # shorter correct is better
    assert out[3] < out[4]  # wrong: longer is penalised less


# ---------------------------------------------------------------------------------------------
# code
# ---------------------------------------------------------------------------------------------
def test_extract_code():
    assert extract_code("text\n```python\na=1\n```\nmore\n```python\nb=2\n```") == "b=2\n"
    assert extract_code("```\nc=3\n```") == "c=3\n"
    assert extract_code("```js\nx\n```\n```py\nd=4\n```") == "d=4\n"
    assert extract_code("def f(): pass") == "def f(): pass"
    assert extract_code("```python\ntruncated = 1") == "truncated = 1"


needs_sandbox = pytest.mark.skipif(sandbox_capabilities()["python"] is None, reason="no sandbox interpreter")


@needs_sandbox
def test_code_rewards():
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    half = "```python\ndef add(a, b):\n    return a + b if a else 0\n```"
    crash = "```python\nraise SystemExit(3)\n```"
    cheat = "```python\nimport sys\nprint('\\nPASS 2 2')\nsys.exit(0)\n```"  # exits early: must not pass
    tests = ["assert add(1, 2) == 3", "assert add(0, 5) == 5"]
    out = _call(code_pass, [good, half, crash, cheat], tests=[tests] * 4)
    assert out == [1.0, 0.0, 0.0, 0.0]
    frac = _call(code_pass_fraction, [good, half, crash, cheat], tests=[tests] * 4)
    assert frac == [1.0, 0.5, 0.0, 0.0]
    # A string of test code with setup lines; a sample without tests is missing.
    src = "import math\nassert add(2, 2) == 4\nx = add(1, 1)\nassert x == 2\nassert add(1, 1) == 3\n"
    assert _call(code_pass_fraction, [good, good], tests=[src, []]) == [pytest.approx(2 / 3), None]
    # Conversational completion, and a test that loops forever is cut by the per-test timeout.
    slow = make_code_reward("fraction", test_timeout=0.3, timeout=5)
    out = _call(slow, [[{"role": "assistant", "content": good}]],
                tests=[["assert add(1, 1) == 2", "assert next(x for x in iter(int, 1) if x) == 0", "assert add(2, 2) == 4"]])
    assert out == [pytest.approx(2 / 3)]
    assert pickle.loads(pickle.dumps(code_pass)).__name__ == "code_pass"
    # Under process isolation (a fork after the pool's threads exist) it must still work.
    forked = RobustReward(code_pass, isolation="process", timeout=20)
    assert _call(forked, [good, half], tests=[tests] * 2) == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------
# registry and wrapping
# ---------------------------------------------------------------------------------------------
def test_registry_lists_builtins():
    names = {s.name for s in list_rewards()}
    assert {"math_accuracy", "math_accuracy_pm1", "format_think_answer", "dapo_overlong", "length_cosine",
            "code_pass", "code_pass_fraction"} <= names
    for s in list_rewards():
        assert s.description


def test_wrap_reward_funcs_leaves_models_alone():
    import torch

    def my_reward(prompts, completions, **kw):
        return [1.0] * len(completions)

    module = torch.nn.Linear(1, 1)
    wrapped = wrap_reward_funcs(["math_accuracy", "Qwen/some-reward-model", module, my_reward], timeout=5)
    assert isinstance(wrapped[0], RobustReward) and wrapped[0].__name__ == "math_accuracy"
    assert wrapped[1] == "Qwen/some-reward-model" and wrapped[2] is module
    assert isinstance(wrapped[3], RobustReward) and wrapped[3].__name__ == "my_reward"
    assert wrap_reward_funcs(wrapped[3]) == [wrapped[3]]  # not wrapped twice
    assert wrapped[3].timeout == 5.0


# ---------------------------------------------------------------------------------------------
# RobustReward
# ---------------------------------------------------------------------------------------------
def sleepy_reward(prompts, completions, **kw):
    time.sleep(10)
    return [1.0] * len(completions)


def crashy_reward(prompts, completions, **kw):
    out = []
    for c in completions:
        if c == "boom":
            raise ValueError("cannot score 'boom'")
        out.append(float(len(c)))
    return out


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_timeout_raise_and_none(isolation):
    r = RobustReward(sleepy_reward, timeout=0.5, isolation=isolation)
    t0 = time.monotonic()
    with pytest.raises(RewardFunctionError, match=r"sleepy_reward.*timed out after 0.5 s.*reward_timeout"):
        _call(r, ["a", "b"])
    assert time.monotonic() - t0 < 1.5
    r2 = RobustReward(sleepy_reward, timeout=0.5, isolation=isolation, on_error="none")
    t0 = time.monotonic()
    assert _call(r2, ["a", "b"]) == [None, None]
    assert time.monotonic() - t0 < 1.5
    m = r2.pop_metrics()
    assert m["timeout_rate"] == 1.0 and m["error_rate"] == 0.0 and math.isnan(m["mean"])


@pytest.mark.parametrize("isolation", ["thread", "process", "none"])
def test_crash_is_raised_after_one_call_naming_function_exception_and_line(isolation):
    """on_error='raise' (the default): the reward is called once, as TRL does, never re-called per sample unasked
    (a paid or side-effecting reward would pay once per sample); the error names the function, the batch, the
    exception and the line that raised it, in a few lines (no traceback dump)."""
    calls = []

    def paid_judge(prompts, completions, **kw):
        calls.append(len(completions))
        return crashy_reward(prompts, completions)

    r = RobustReward(paid_judge, timeout=5, isolation=isolation)
    with pytest.raises(RewardFunctionError) as ei:
        _call(r, ["ok", "fine", "boom", "x"])
    msg = str(ei.value)
    assert "'paid_judge'" in msg and "ValueError: cannot score 'boom'" in msg and "batch of 4" in msg
    assert "reward_on_error='none'" in msg and "in crashy_reward" in msg and len(msg.splitlines()) == 2
    if isolation != "process":  # the child's calls are not seen here; its one call is the batch's
        assert calls == [4]


def test_crash_with_on_error_none_re_scores_one_sample_at_a_time():
    calls = []

    def judge(prompts, completions, **kw):
        calls.append(len(completions))
        return crashy_reward(prompts, completions)

    r = RobustReward(judge, on_error="none")
    assert _call(r, ["ok", "fine", "boom", "x"]) == [2.0, 4.0, None, 1.0]
    assert calls == [4, 1, 1, 1, 1]


@pytest.mark.parametrize("isolation", ["thread", "process", "none"])
def test_on_error_none_keeps_other_samples(isolation):
    r = RobustReward(crashy_reward, timeout=5, isolation=isolation, on_error="none")
    assert _call(r, ["ok", "boom", "abc"]) == [2.0, None, 3.0]
    m = r.pop_metrics()
    assert m["error_rate"] == pytest.approx(1 / 3) and m["mean"] == pytest.approx(2.5)
    assert r.pop_metrics()["error_rate"] == 0.0  # popped


def test_nan_detection():
    def nan_reward(prompts, completions, **kw):
        return [1.0, float("nan"), float("inf")]

    with pytest.raises(RewardFunctionError, match=r"nan_reward.*non-finite.*sample 1"):
        _call(RobustReward(nan_reward), ["a", "b", "c"])
    r = RobustReward(nan_reward, on_error="none", cache_duplicates=False)
    assert _call(r, ["a", "b", "c"]) == [1.0, None, None]
    assert r.pop_metrics()["nan_rate"] == pytest.approx(2 / 3)


def test_wrong_length_and_type():
    def short_reward(prompts, completions, **kw):
        return [1.0]

    def str_reward(prompts, completions, **kw):
        return ["high"] * len(completions)

    for on_error in ("raise", "none"):
        with pytest.raises(RewardFunctionError, match=r"short_reward.*returned 1 rewards for 3 completions"):
            _call(RobustReward(short_reward, on_error=on_error), ["a", "b", "c"])
    with pytest.raises(RewardFunctionError, match=r"str_reward.*sample 0.*non-numeric"):
        _call(RobustReward(str_reward), ["a", "b"])


def test_caching_duplicates():
    calls = []

    def counting_reward(prompts, completions, completion_ids=None, answer=None, **kw):
        calls.append(list(completions))
        assert kw["trainer_state"] == "state" and callable(kw["log_metric"])
        return [float(len(c)) + (10.0 if a == "x" else 0.0) for c, a in zip(completions, answer)]

    r = RobustReward(counting_reward, cache_duplicates=True)  # opt-in
    comps = ["aa", "aa", "b", "aa", "b", "aa"]
    answers = ["y", "y", "y", "y", "y", "x"]  # the last differs in its column: not a duplicate
    out = r(prompts=["p"] * 6, completions=comps, completion_ids=[[1]] * 6, answer=answers,
            trainer_state="state", log_metric=lambda *a: None, log_extra=lambda *a: None)
    assert out == [2.0, 2.0, 1.0, 2.0, 1.0, 12.0]
    assert calls == [["aa", "b", "aa"]]
    m = r.pop_metrics()
    assert m["cache_hit_rate"] == pytest.approx(3 / 6) and m["mean"] == pytest.approx(20 / 6)
    calls.clear()
    r_nc = RobustReward(counting_reward, cache_duplicates=False)
    r_nc(prompts=["p"] * 6, completions=comps, completion_ids=[[1]] * 6, answer=answers, trainer_state="state",
         log_metric=print)
    assert calls == [comps]


def test_keeps_name_is_picklable_and_validates_options():
    r = RobustReward(math_accuracy, timeout=3)
    assert r.__name__ == "math_accuracy"
    r2 = pickle.loads(pickle.dumps(r))
    assert r2.__name__ == "math_accuracy" and _call(r2, ["\\boxed{2}"], answer=["2"]) == [1.0]
    assert RobustReward(math_accuracy, name="acc").__name__ == "acc"
    with pytest.raises(ConfigError):
        RobustReward(math_accuracy, isolation="fork")
    with pytest.raises(ConfigError):
        RobustReward(math_accuracy, on_error="ignore")
    with pytest.raises(ConfigError):
        RobustReward(math_accuracy, timeout=0)


def test_async_reward():
    import asyncio

    async def async_reward(prompts, completions, **kw):
        await asyncio.sleep(0)
        return [0.5] * len(completions)

    assert _call(RobustReward(async_reward), ["a", "b"]) == [0.5, 0.5]
