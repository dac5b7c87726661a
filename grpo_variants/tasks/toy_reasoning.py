"""A chain-of-thought toy task: multi-operand addition with every partial sum written out.

The arithmetic toy task (``"37+45="`` -> ``"82"``) answers in 3-6 tokens, so nothing that GRPO's
variants were designed for happens on it: no long or truncated answers, no length bias, no draft to
refine. This task keeps the toy kit's tiny model and offline tokenizer but makes the policy *reason*::

    from grpo_variants.tasks import toy
    kit = toy.prepare(task="chain")          # cached warm start (a few CPU minutes the first time)
    kit.reward                               # "toy_chain_accuracy" (registered)
    kit.max_completion_length                # 56: the completion budget the task is sized for
    kit.evaluate(kit.model_path)             # held-out greedy accuracy on 500 problems
    kit.evaluate_details(kit.model_path)     # + mean length of right / wrong answers, truncation rate

A problem adds ``2 x difficulty + 1`` one-digit numbers (difficulty 1-5: 3-11 operands). The prompt is
``"7+5+9="``; a completion writes the running sums and ends with ``>`` and the answer. The warm start
is taught four verbosities of the same reasoning, so the policy has lengths to choose from:

=========  ==========================================  ==================================
form       completion of ``7+5+9=``                     tokens (3 / 5 / 7 / 11 operands)
=========  ==========================================  ==================================
terse      ``>21``                                      3
short      ``12,21>21``                                 ~7 / ~13 / ~19 / ~31
full       ``7+5=12,12+9=21>21``                        ~16 / ~32 / ~48 / ~80
verbose    ``7+5=7+3+2=12,12+9=12+8+1=21>21``           ~25 / ~50 / ~76 / ~128
=========  ==========================================  ==================================

(the verbose form "makes ten" whenever a sum crosses a ten). Length grows with difficulty, and the
default budget of 56 completion tokens truncates the verbose form of 7-operand problems: a visible
share of completions is cut at the start of RL and gets no answer (reward 0).

The reward (``toy_chain_accuracy``) reads the integer after the *last* ``>`` and compares it with
the gold sum: 1 or 0 (``toy_chain_accuracy_pm1``: +1 / -1). The trace itself is not graded, so the
policy may learn to shorten it; whether it gets more accurate by doing so is what RL finds out.

The warm start (:func:`warm_start`) is a short supervised run on traces of mixed verbosity in which a
share of traces carry an injected mistake (one partial sum off by 1 or 10, carried consistently to a
wrong final answer). It stops as soon as held-out greedy accuracy (on a probe set disjoint from the
RL evaluation) enters the target band (default 20-50%). Harder problems are longer and more often
wrong, so wrong answers are longer than right ones on average. A share of the warm-start rows are
*refinement* rows in iGRPO's toy template ``"{prompt}({draft}){prompt}"``: the prompt holds a draft
(right, wrong or cut short) and the target is the correct trace in the draft's form, which shares
the draft's steps up to its first mistake; so an iGRPO policy can read a draft.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from grpo_variants.tasks import toy
from grpo_variants.tasks.cache import build_lock
from grpo_variants.errors import ConfigError
from grpo_variants.rewards.registry import reward
from grpo_variants.rewards.steps import step_reward

__all__ = [
    "TASKS",
    "LEVELS",
    "DEFAULT_LEVELS",
    "FORMS",
    "CHARS",
    "DRAFT_TEMPLATE",
    "MAX_COMPLETION_LENGTH",
    "ReasoningKit",
    "ReasoningWarmStartConfig",
    "build_tokenizer",
    "make_trace",
    "parse_answer",
    "make_chain_accuracy",
    "audit_trace",
    "operands_of",
    "score_trace",
    "toy_chain_steps",
    "trace_steps",
    "chain_accuracy",
    "make_dataset",
    "make_refinement_row",
    "evaluate",
    "evaluate_details",
    "warm_start",
    "prepare",
]

TASKS = ("chain",)
LEVELS = (1, 2, 3, 4, 5)  # difficulty d: 2d + 1 one-digit operands
DEFAULT_LEVELS = (1, 2, 3)  # the RL task: 3, 5 or 7 operands
FORMS = ("terse", "short", "full", "verbose")
CHARS = "".join(toy.CHARS) + ",>"
MAX_COMPLETION_LENGTH = 56
MAX_POSITIONS = 256  # refinement prompts (question, draft, question) plus the completion fit
# iGRPO's toy template (the vocabulary has no letters): q' = "7+5+9=(<draft>)7+5+9=".
DRAFT_TEMPLATE = "{prompt}({draft}){prompt}"


# --------------------------------------------------------------------------------------------
# Traces and the reward
# --------------------------------------------------------------------------------------------
def _operands(rng: random.Random, difficulty: int) -> list[int]:
    if difficulty not in LEVELS:
        raise ConfigError(f"chain difficulty must be one of {LEVELS} (2 x difficulty + 1 operands), "
                          f"got {difficulty!r}.")
    return [rng.randint(1, 9) for _ in range(2 * difficulty + 1)]


def _prompt(operands: list[int]) -> str:
    return "+".join(str(x) for x in operands) + "="


def make_trace(operands: list[int], form: str = "full", mistake_at: int | None = None,
               delta: int = 0) -> tuple[str, int]:
    """The completion for ``operands`` in ``form`` and the final answer it states.

    ``mistake_at=i`` adds ``delta`` to the i-th partial sum (0-based step); later steps continue
    from the wrong value, so the final answer is off by ``delta``.
    """
    if form not in FORMS:
        raise ConfigError(f"unknown trace form {form!r}; choose one of {FORMS}.")
    running = operands[0]
    steps, sums = [], []
    for i, b in enumerate(operands[1:]):
        a = running
        running = a + b + (delta if mistake_at == i else 0)
        sums.append(running)
        if form == "full":
            steps.append(f"{a}+{b}={running}")
        elif form == "verbose":  # "make ten" when the sum crosses a ten: 17+5=17+3+2=22
            fill = 10 - a % 10
            steps.append(f"{a}+{b}={a}+{fill}+{b - fill}={running}" if 0 < fill < b else f"{a}+{b}={running}")
    if form == "terse":
        body = ""
    elif form == "short":
        body = ",".join(str(s) for s in sums)
    else:
        body = ",".join(steps)
    return f"{body}>{running}", running


_ANSWER = re.compile(r">\s*(-?\d+)\s*$")


def parse_answer(text: str) -> int | None:
    """The integer after the last ``>`` when the completion ends there; else None (no answer, e.g. truncated)."""
    match = _ANSWER.search(text.strip())
    return int(match.group(1)) if match else None


def make_chain_accuracy(correct: float = 1.0, wrong: float = 0.0):
    """The chain task's verifiable reward: ``correct`` when the stated final answer equals the gold sum."""

    def toy_chain_accuracy(prompts, completions, answer, **kwargs):
        scores = []
        for completion, gold in zip(completions, answer, strict=True):
            stated = parse_answer(toy._completion_text(completion))
            scores.append(correct if stated is not None and str(stated) == str(gold).strip() else wrong)
        return scores

    return toy_chain_accuracy


chain_accuracy = reward(
    "toy_chain_accuracy", "Toy chain addition: +1 if the answer after the last '>' equals the gold sum, else 0"
)(make_chain_accuracy())
chain_accuracy_pm1 = make_chain_accuracy(correct=1.0, wrong=-1.0)
chain_accuracy_pm1.__name__ = "toy_chain_accuracy_pm1"
chain_accuracy_pm1 = reward("toy_chain_accuracy_pm1", "Toy chain addition: +1 correct / -1 wrong")(chain_accuracy_pm1)


# --------------------------------------------------------------------------------------------
# Process supervision: every partial sum of a trace is checkable (the step verifier)
# --------------------------------------------------------------------------------------------
_LAST_INT = re.compile(r"(-?\d+)\D*$")


def operands_of(prompt) -> list[int]:
    """The operands of a chain prompt (``"7+5+9="`` -> [7, 5, 9]); conversational prompts read their last message."""
    text = toy._completion_text(prompt[-1:] if isinstance(prompt, list) else prompt)
    body = text.split("(")[0] if "(" not in text.rstrip("=").split("=")[-1] else text
    body = text.rsplit(")", 1)[-1] if ")" in text else body  # a refinement prompt: the question after the draft
    return [int(x) for x in re.findall(r"\d+", body.split("=")[0])]


def trace_steps(text: str) -> list[tuple[int, int | None]]:
    """``(end, stated value)`` of every completed step of a trace: each segment closed by ``,`` or ``>`` (its end is
    just after that delimiter; value: the last integer in it, None if it has none), then the final answer after the
    last ``>`` when the completion ends with it (end = ``len(text)``). An empty segment (the terse form's ``">21"``)
    is no step; a segment still open (cut by the length limit) is no step."""
    steps, start = [], 0
    answer_at = text.rfind(">")
    for i, ch in enumerate(text):
        if ch in ",>" and (answer_at < 0 or i <= answer_at):
            segment = text[start:i]
            if segment.strip():
                match = _LAST_INT.search(segment)
                steps.append((i + 1, int(match.group(1)) if match else None))
            start = i + 1
    final = parse_answer(text)
    if final is not None and answer_at >= 0:
        steps.append((len(text), final))
    return steps


def score_trace(operands: list[int], text: str, gold=None, *, correct: float = 1.0,
                wrong: float = 0.0) -> list[tuple[int, float]]:
    """``(end_char, score)`` per step: the j-th partial-sum step is ``correct`` when it states the sum of the first
    j + 2 operands (a step beyond the last partial sum is ``wrong``); the final answer step is ``correct`` when it
    equals ``gold`` (default: the sum of the operands)."""
    partial = [sum(operands[: j + 2]) for j in range(len(operands) - 1)]
    gold = sum(operands) if gold is None else int(str(gold).strip())
    steps = trace_steps(text)
    has_answer = parse_answer(text) is not None and text.rfind(">") >= 0
    out = []
    for j, (end, value) in enumerate(steps):
        if has_answer and j == len(steps) - 1:
            out.append((end, correct if value == gold else wrong))
        else:
            out.append((end, correct if j < len(partial) and value == partial[j] else wrong))
    return out


def audit_trace(operands: list[int], text: str, gold=None) -> dict:
    """``{"final_right", "partial_wrong", "right_for_wrong_reason"}`` of one completion: the final answer equals the
    gold sum; some stated partial sum is wrong; both at once."""
    scored = score_trace(operands, text, gold)
    has_answer = parse_answer(text) is not None
    partial = scored[:-1] if has_answer else scored
    final_right = bool(has_answer and scored and scored[-1][1] > 0)
    partial_wrong = any(s <= 0 for _, s in partial)
    return {"final_right": final_right, "partial_wrong": partial_wrong,
            "right_for_wrong_reason": final_right and partial_wrong}


@step_reward
def toy_chain_steps(prompts, completions, answer=None, **kwargs):
    """Toy chain addition, per step: 1 for every right partial sum (0 if wrong), then 1/0 for the final answer."""
    golds = answer if answer is not None else [None] * len(completions)
    return [score_trace(operands_of(p), toy._completion_text(c), g)
            for p, c, g in zip(prompts, completions, golds, strict=True)]


toy_chain_steps = reward("toy_chain_steps", "Toy chain addition, step reward: 1/0 per partial sum, then 1/0 for the "
                                            "final answer (process supervision)")(toy_chain_steps)


# --------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------
def _problem_sets(levels, num_eval: int, num_warmstart: int, num_train: int, seed: int):
    """Disjoint eval / warmstart / train problem lists (levels cycled, so each split mixes them evenly).

    No prompt of a split appears in an earlier split; eval and warmstart (the warm start's probe) hold
    distinct prompts, train may repeat one (3 one-digit operands make only 729 problems).
    """
    rng = random.Random(f"chain-{seed}")
    earlier: set[str] = set()
    out = {}
    for split, count in (("eval", num_eval), ("warmstart", num_warmstart), ("train", num_train)):
        rows, mine, attempts = [], set(), 0
        while len(rows) < count:
            attempts += 1
            if attempts > 200 * count + 1000:
                raise ConfigError(f"the chain task cannot draw {count} {split} problems at levels {levels}: too few "
                                  "distinct problems left; use fewer held-out problems or higher levels.")
            d = levels[len(rows) % len(levels)]
            ops = _operands(rng, d)
            p = _prompt(ops)
            if p in earlier or (split != "train" and p in mine):
                continue
            mine.add(p)
            rows.append((ops, d))
        earlier |= mine
        out[split] = rows
    return out


def _levels(difficulty) -> tuple[int, ...]:
    if difficulty is None:
        return DEFAULT_LEVELS
    levels = (difficulty,) if isinstance(difficulty, int) else tuple(difficulty)
    for d in levels:
        if d not in LEVELS:
            raise ConfigError(f"chain difficulty must be in {LEVELS} (2 x difficulty + 1 operands), "
                              f"got {difficulty!r}.")
    return levels


def make_dataset(
    split: str = "train",
    difficulty=None,
    n: int | None = None,
    num_eval: int = 500,
    num_warmstart: int = 300,
    num_train: int = 20000,
    conversational: bool = False,
    seed: int = 0,
):
    """The chain task as a ``datasets.Dataset`` with ``prompt``, ``answer`` (gold sum) and ``difficulty``.

    ``difficulty``: one level (1-5) or several (default 1, 2, 3, mixed evenly). The three splits are
    disjoint; ``"eval"`` is held out for RL evaluation, ``"warmstart"`` only feeds the supervised warm start.
    """
    from datasets import Dataset

    sets = _problem_sets(_levels(difficulty), num_eval, num_warmstart, num_train, seed)
    if split not in sets:
        raise ConfigError(f"Unknown split {split!r}; choose one of {sorted(sets)}.")
    rows = sets[split][:n] if n is not None else sets[split]
    prompts = [_prompt(ops) for ops, _ in rows]
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": p}] for p in prompts] if conversational else prompts,
        "answer": [str(sum(ops)) for ops, _ in rows],
        "difficulty": [d for _, d in rows],
    })


def _sample_trace(rng: random.Random, ops: list[int], form_weights, mistake_rate: float):
    form = rng.choices(FORMS, weights=form_weights)[0]
    if rng.random() < mistake_rate:
        step = rng.randrange(len(ops) - 1)
        delta = rng.choice([-10, -1, 1, 10])
        return form, make_trace(ops, form, step, delta)[0]
    return form, make_trace(ops, form)[0]


def make_refinement_row(rng: random.Random, ops: list[int], form_weights=(1, 1, 2, 1), mistake_rate: float = 0.5,
                        template: str = DRAFT_TEMPLATE) -> tuple[str, str]:
    """A (prompt, target) refinement pair: the question with a draft (right, wrong or cut short) in
    ``template``, and the correct trace in the draft's form (full form for a terse draft)."""
    form, draft = _sample_trace(rng, ops, form_weights, mistake_rate)
    if rng.random() < 0.15:  # a draft the budget cut short: no answer
        draft = draft[: rng.randint(1, max(1, draft.rfind(">")))]
    target = make_trace(ops, "full" if form == "terse" else form)[0]
    return template.format(prompt=_prompt(ops), draft=draft), target


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_details(model_or_path, dataset, tokenizer=None, *, max_new_tokens: int = MAX_COMPLETION_LENGTH,
                     batch_size: int = 256) -> dict:
    """Held-out greedy decoding: accuracy, mean completion length of right and of wrong answers (tokens,
    EOS included when produced), truncation rate (no EOS within ``max_new_tokens``), accuracy per level."""
    model, tokenizer = toy._load(model_or_path, tokenizer)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prompts = [toy._render(p, tokenizer) for p in dataset["prompt"]]
    answers = list(dataset["answer"])
    levels = list(dataset["difficulty"]) if "difficulty" in dataset.column_names else [0] * len(prompts)
    scorer = make_chain_accuracy()
    correct, lengths, truncated = [], [], []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            enc = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left").to(device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_k=None,
                                 top_p=None, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                 synced_gpus=False)  # a whole model on this rank (toy._load)
            completion = out[:, enc["input_ids"].shape[1] :]
            is_eos = completion == tokenizer.eos_token_id
            has_eos = is_eos.any(dim=1)
            first = torch.where(has_eos, is_eos.int().argmax(dim=1) + 1, torch.full_like(has_eos, completion.size(1),
                                                                                         dtype=torch.long))
            texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
            correct += scorer(batch, texts, answers[start : start + batch_size])
            lengths += first.tolist()
            truncated += (~has_eos).tolist()
    finally:
        model.train(was_training)

    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    right = [n for n, c in zip(lengths, correct, strict=True) if c > 0]
    wrong = [n for n, c in zip(lengths, correct, strict=True) if c <= 0]
    by_level = {}
    for d in sorted(set(levels)):
        mine = [c for c, lv in zip(correct, levels, strict=True) if lv == d]
        by_level[str(d)] = mean(mine)
    return {
        "accuracy": mean(correct) or 0.0,
        "problems": len(correct),
        "mean_length": mean(lengths),
        "mean_length_right": mean(right),
        "mean_length_wrong": mean(wrong),
        "truncation_rate": mean([float(t) for t in truncated]),
        "accuracy_by_level": by_level,
    }


def evaluate(model_or_path, dataset, tokenizer=None, **kwargs) -> float:
    """Held-out greedy accuracy on the chain task (single-shot from the question)."""
    return evaluate_details(model_or_path, dataset, tokenizer, **kwargs)["accuracy"]


# --------------------------------------------------------------------------------------------
# Warm start
# --------------------------------------------------------------------------------------------
@dataclass
class ReasoningWarmStartConfig:
    """Supervised warm start on traces of mixed verbosity with injected mistakes, plus refinement rows."""

    levels: tuple = (1, 2, 3)  # trained on; the probe uses the RL levels
    probe_levels: tuple = DEFAULT_LEVELS
    form_weights: tuple = (0.15, 0.2, 0.4, 0.25)  # terse, short, full, verbose
    mistake_rate: float = 0.25
    refinement_fraction: float = 0.3
    target_low: float = 0.20
    target_high: float = 0.50
    min_steps: int = 100
    max_steps: int = 4000
    check_every: int = 20
    batch_size: int = 32
    lr: float = 1e-3
    seed: int = 0
    probe_size: int = 200
    max_new_tokens: int = MAX_COMPLETION_LENGTH
    model: toy.ToyModelConfig = field(default_factory=lambda: toy.ToyModelConfig(max_position_embeddings=MAX_POSITIONS))
    version: int = 1

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True, default=list)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_tokenizer(save_to=None):
    """The toy character tokenizer with ``,`` and ``>`` added (same specials and chat template)."""
    return toy.build_tokenizer(save_to=save_to, chars=CHARS, model_max_length=MAX_POSITIONS)


def _seed() -> int:
    value = os.environ.get("GRPO_VARIANTS_TOY_SEED")
    return int(value) if value not in (None, "") else 0


def warm_start(output_dir=None, config: ReasoningWarmStartConfig | None = None, *, force: bool = False,
               verbose: bool = True) -> Path:
    """Train (or reuse from cache) the warm-started chain policy; return its folder (model, tokenizer,
    ``warmstart.json`` with steps, probe accuracy, lengths of right / wrong answers and the history)."""
    config = config or ReasoningWarmStartConfig()
    out = Path(output_dir) if output_dir is not None else toy.cache_dir() / "toy" / f"chain-warm-{config.key()}"
    if not force and (out / "warmstart.json").exists():
        return out
    with build_lock(out):  # another process may be building this entry: wait, then reuse what it built
        if not force and (out / "warmstart.json").exists():
            return out
        return _train_warm_start(out, config, verbose)


def _train_warm_start(out: Path, config: ReasoningWarmStartConfig, verbose: bool) -> Path:
    """Train the chain policy of ``config`` and write it to ``out`` (the caller holds the entry's build lock)."""
    if verbose:  # the one wait of a first run: say so before it starts
        print(f"[chain warm start] training the chain-task policy once (a supervised warm start: about 2 minutes "
              f"on a quiet 2-core CPU, longer under load); it is cached in {out} and every later run reuses it.",
              flush=True)
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    tokenizer = build_tokenizer()
    model = toy.build_model(tokenizer, config.model, seed=config.seed)
    model.train()
    # The warm start draws its own problems and drops every held-out prompt
    # (held out: the RL eval split and the probe; the RL train split may overlap, it is not held out)
    pool = [ops for ops, _ in _problem_sets(tuple(config.levels), 0, 0, 20000, seed=1000 + config.seed)["train"]]
    rl = _problem_sets(DEFAULT_LEVELS, 500, 300, 0, seed=0)
    rl_prompts = {_prompt(ops) for rows in rl.values() for ops, _ in rows}
    pool = [ops for ops in pool if _prompt(ops) not in rl_prompts]
    probe_rows = [(ops, d) for ops, d in rl["warmstart"] if d in config.probe_levels][: config.probe_size]
    from datasets import Dataset

    probe = Dataset.from_dict({"prompt": [_prompt(o) for o, _ in probe_rows],
                               "answer": [str(sum(o)) for o, _ in probe_rows],
                               "difficulty": [d for _, d in probe_rows]})
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    started = time.perf_counter()
    history, details, step = [], {}, 0
    for step in range(1, config.max_steps + 1):
        # a batch is all refinement rows or all plain rows (refinement rows are about twice as long: padding)
        refine = rng.random() < config.refinement_fraction
        rows = [make_refinement_row(rng, ops) if refine
                else (_prompt(ops), _sample_trace(rng, ops, config.form_weights, config.mistake_rate)[1])
                for ops in rng.sample(pool, config.batch_size)]
        ids, att, lab = toy._sft_batch(tokenizer, rows, torch.device("cpu"))
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step >= config.min_steps and step % config.check_every == 0:
            details = evaluate_details(model, probe, tokenizer, max_new_tokens=config.max_new_tokens)
            history.append({"step": step, "loss": round(loss.item(), 4), **{k: details[k] for k in (
                "accuracy", "mean_length_right", "mean_length_wrong", "truncation_rate")}})
            if verbose:
                print(f"[chain warm start] step {step}: loss {loss.item():.3f}, probe greedy accuracy "
                      f"{details['accuracy']:.1%}, truncated {details['truncation_rate']:.1%}", flush=True)
            if details["accuracy"] >= config.target_low:
                break
    model.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = {"steps": step, "probe_accuracy": details.get("accuracy"), "probe": details,
                "in_band": config.target_low <= details.get("accuracy", 0.0) <= config.target_high,
                "seconds": round(time.perf_counter() - started, 1), "history": history,
                "config": asdict(config)}
        (tmp / "warmstart.json").write_text(json.dumps(meta, indent=2, default=list))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _save_random_model(path: Path, seed: int) -> None:
    """Save a randomly initialised chain-task model and its tokenizer at ``path`` unless it is there already."""
    if (path / "config.json").exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    try:
        tokenizer = build_tokenizer()
        toy.build_model(tokenizer, toy.ToyModelConfig(max_position_embeddings=MAX_POSITIONS), seed=seed
                        ).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass
class ReasoningKit(toy.ToyKit):
    """A :class:`~grpo_variants.tasks.toy.ToyKit` for the chain task, with its reward, budget and evaluator."""

    reward: str = "toy_chain_accuracy"
    max_completion_length: int = MAX_COMPLETION_LENGTH
    draft_template: str = DRAFT_TEMPLATE

    def evaluate(self, model_or_path=None, tokenizer=None, dataset=None) -> float:
        return evaluate(model_or_path or self.model_path, self.eval_dataset if dataset is None else dataset, tokenizer,
                        max_new_tokens=self.max_completion_length)

    def evaluate_details(self, model_or_path=None, tokenizer=None, dataset=None) -> dict:
        return evaluate_details(model_or_path or self.model_path, self.eval_dataset if dataset is None else dataset,
                                tokenizer, max_new_tokens=self.max_completion_length)


def prepare(task: str = "chain", difficulty=None, *, num_eval: int = 500, conversational: bool = False,
            warm: bool = True, seed: int | None = None, verbose: bool = True) -> ReasoningKit:
    """The warm-started chain policy (cached) and its datasets; ``difficulty`` picks the RL levels."""
    if task not in TASKS:
        raise ConfigError(f"Unknown reasoning task {task!r}; choose one of {TASKS}.")
    seed = _seed() if seed is None else seed
    if warm:
        path = warm_start(config=ReasoningWarmStartConfig(seed=seed), verbose=verbose)
        meta = json.loads((path / "warmstart.json").read_text())
    else:
        path = toy.cache_dir() / "toy" / f"chain-random-seed{seed}"
        with build_lock(path):
            _save_random_model(path, seed)
        meta = {"steps": 0, "probe_accuracy": None}
    kwargs = dict(difficulty=difficulty, num_eval=num_eval, conversational=conversational)
    return ReasoningKit(model_path=str(path), train_dataset=make_dataset("train", **kwargs),
                        eval_dataset=make_dataset("eval", **kwargs), warmstart=meta)


for _name in TASKS:  # toy.prepare(task=...) builds these (the toy kit never imports this module)
    toy.register_task(_name, prepare)
