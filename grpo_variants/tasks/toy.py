"""The offline toy kit: a tokenizer, a tiny Qwen2 model and verifiable arithmetic tasks.

Nothing here touches the network. Everything is saved to disk and loaded back by path with
``from_pretrained``, exactly as a user loads a hub model, so the demo, the notebooks, the tests
and the benchmarks exercise the real loading code::

    from grpo_variants.tasks import toy
    kit = toy.prepare()                      # cached after the first call (about 30-60 s on CPU)
    kit.model_path                           # a folder: AutoModelForCausalLM.from_pretrained(kit.model_path)
    kit.train_dataset, kit.eval_dataset      # datasets.Dataset with "prompt", "answer", "difficulty"
    toy.evaluate(kit.model_path, kit.eval_dataset)   # held-out greedy accuracy

The task: ``"37+45="`` -> ``"82"`` + EOS (and ``"91-45="`` -> ``"46"`` for subtraction). The
reward ``toy_accuracy`` gives +1 when the leading digits of the completion equal the gold
answer, else 0 (or -1 with ``make_toy_accuracy(wrong=-1.0)``).

The warm start is a short supervised run (plain PyTorch, loss on the answer tokens only) that
stops as soon as greedy accuracy on 200 held-back probe problems enters a target band (default
20-45%), so that GRPO starts with a real but unsaturated signal: at 0% or 100% every group has zero
reward variance and nothing can be learned or compared. Accuracy moves fast around the band (a
few points per step), and how fast differs between CPUs and thread counts, so when a check finds it
already past the band the run replays from the last check below it, checking every step (then at
half the learning rate). It stops at the first check inside the band, or after ``max_steps``
optimizer steps in all (1,600 by default, replays included), and then warns with the accuracy it
reached and what to do.

``GRPO_VARIANTS_TOY_SEED`` (an integer, default 0) seeds the warm start: the model's initialisation
and the order of its supervised batches. Another value gives another warm-started policy (cached
under its own key) on the same problem splits, which is how to check that a result does not hang
on one float trajectory::

    GRPO_VARIANTS_TOY_SEED=1 OMP_NUM_THREADS=1 python -m pytest -m "not slow"   # make test-portable
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
import warnings
from copy import deepcopy
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from grpo_variants.errors import ConfigError
from grpo_variants.tasks.cache import build_lock
from grpo_variants.rewards.registry import reward

__all__ = [
    "ToyKit",
    "ToyModelConfig",
    "build_tokenizer",
    "build_model",
    "make_dataset",
    "make_toy_accuracy",
    "toy_accuracy",
    "warm_start",
    "prepare",
    "evaluate",
    "cache_dir",
    "toy_seed",
    "TOY_SEED_ENV",
    "SPECIAL_TOKENS",
]

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
USER, ASSISTANT = "<user>", "<assistant>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, USER, ASSISTANT]
CHARS = list("0123456789+-=*() ")

# A minimal chat template using the special role tokens. A conversational prompt
# [{"role": "user", "content": "37+45="}] renders as "<user>37+45=<assistant>".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<user>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<assistant>' + message['content'] + '</s>' }}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where the toy kit caches its artefacts: ``$GRPO_VARIANTS_CACHE`` or ``~/.cache/grpo_variants``."""
    root = os.environ.get("GRPO_VARIANTS_CACHE") or os.path.join(Path.home(), ".cache", "grpo_variants")
    return Path(root)


TOY_SEED_ENV = "GRPO_VARIANTS_TOY_SEED"


def toy_seed() -> int:
    """The toy warm-start seed: ``$GRPO_VARIANTS_TOY_SEED`` as an integer, 0 when unset or empty."""
    raw = os.environ.get(TOY_SEED_ENV, "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"{TOY_SEED_ENV}={raw!r} is not an integer. Set it to the warm-start seed to use (e.g. 1), or unset it "
            "for the default 0."
        ) from None


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------
def build_tokenizer(save_to: str | os.PathLike | None = None, chars: str | None = None, model_max_length: int = 64):
    """Build a character-level tokenizer with the ``tokenizers`` library.

    It is a byte-level BPE with no merges over a vocabulary of single characters, pre-tokenized
    exactly like Qwen2's tokenizer (Qwen's split regex, then byte-level mapping: a space is ``Ġ``).
    That matters because ``AutoTokenizer.from_pretrained`` on a folder whose ``config.json`` says
    ``model_type: qwen2`` always builds a ``Qwen2Tokenizer``, which imposes that pre-tokenizer: the
    tokenizer built here and the one reloaded from the model folder encode every string the same way.

    ``chars`` replaces the character vocabulary (default :data:`CHARS`; the reasoning tasks of
    :mod:`grpo_variants.tasks.toy_reasoning` add ``,`` and ``>``).

    Returns a ``PreTrainedTokenizerFast`` with pad/bos/eos/unk tokens and a chat template. When
    ``save_to`` is given it is saved there and can be reloaded with
    ``AutoTokenizer.from_pretrained(save_to)``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = [_byte_level(c) for c in (CHARS if chars is None else list(chars))]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + byte_chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT],
        padding_side="left",
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if save_to is not None:
        tokenizer.save_pretrained(str(save_to))
    return tokenizer


def _byte_level(char: str) -> str:
    """The byte-level (GPT-2 / Qwen) alphabet symbol of a one-byte character (a space is 'Ġ')."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(char)[0][0]


# Qwen2's pre-tokenization pattern: the reloaded Qwen2Tokenizer applies it, so we apply it too.
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as _QWEN2_PRETOKENIZE_REGEX  # noqa: E402


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
@dataclass
class ToyModelConfig:
    """Shape of the tiny Qwen2 policy (about 1M parameters by default)."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 64


def build_model(tokenizer=None, config: ToyModelConfig | None = None, seed: int = 0):
    """A randomly initialised tiny ``Qwen2ForCausalLM`` built from a config (no download)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = tokenizer or build_tokenizer()
    config = config or ToyModelConfig()
    hf_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(hf_config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------
TASKS = ("addition", "subtraction", "mixed")
# difficulty d -> operands with d digits
_DIGIT_RANGES = {1: (1, 9), 2: (10, 99), 3: (100, 999)}


def _problems(task: str, difficulty: int) -> list[tuple[str, str, int]]:
    if task not in TASKS:
        raise ValueError(f"Unknown toy task {task!r}; choose one of {TASKS}.")
    if difficulty not in _DIGIT_RANGES:
        raise ValueError(f"Toy difficulty must be one of {sorted(_DIGIT_RANGES)}, got {difficulty}.")
    lo, hi = _DIGIT_RANGES[difficulty]
    out = []
    for a in range(lo, hi + 1):
        for b in range(lo, hi + 1):
            if task in ("addition", "mixed"):
                out.append((f"{a}+{b}=", str(a + b), difficulty))
            if task in ("subtraction", "mixed") and a >= b:
                out.append((f"{a}-{b}=", str(a - b), difficulty))
    if difficulty == 3:  # 810k pairs is more than anyone needs: subsample deterministically
        random.Random(1234).shuffle(out)
        out = out[:20000]
    return out


def make_dataset(
    task: str = "addition",
    split: str = "train",
    difficulty: int = 2,
    n: int | None = None,
    num_eval: int = 500,
    num_warmstart: int = 2000,
    conversational: bool = False,
    seed: int = 0,
):
    """A synthetic verifiable task as a ``datasets.Dataset``.

    Columns: ``prompt`` (a string like ``"37+45="``, or a one-message conversation when
    ``conversational``), ``answer`` (the gold string), ``difficulty`` (operand digits).

    The problem set is split deterministically (``seed``) into ``"eval"`` (held out,
    ``num_eval`` problems), ``"warmstart"`` (``num_warmstart``, used only by the supervised warm
    start) and ``"train"`` (the rest, for RL). ``n`` truncates the split.
    """
    from datasets import Dataset

    problems = _problems(task, difficulty)
    random.Random(seed).shuffle(problems)
    splits = {
        "eval": problems[:num_eval],
        "warmstart": problems[num_eval : num_eval + num_warmstart],
        "train": problems[num_eval + num_warmstart :],
    }
    if split not in splits:
        raise ValueError(f"Unknown split {split!r}; choose one of {sorted(splits)}.")
    rows = splits[split][:n] if n is not None else splits[split]
    prompts = [[{"role": "user", "content": p}] if conversational else p for p, _, _ in rows]
    return Dataset.from_dict(
        {"prompt": prompts, "answer": [a for _, a, _ in rows], "difficulty": [d for _, _, d in rows]}
    )


_LEADING_INT = re.compile(r"\s*(-?\d+)")


def _completion_text(completion) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return str(completion)


def make_toy_accuracy(correct: float = 1.0, wrong: float = 0.0):
    """Build the toy task's verifiable reward: ``correct`` when the leading integer equals the gold."""

    def toy_accuracy(prompts, completions, answer, **kwargs):
        scores = []
        for completion, gold in zip(completions, answer, strict=True):
            match = _LEADING_INT.match(_completion_text(completion))
            scores.append(correct if match is not None and match.group(1) == str(gold).strip() else wrong)
        return scores

    return toy_accuracy


toy_accuracy = reward("toy_accuracy", "Toy arithmetic: +1 if the leading integer equals the gold answer, else 0")(
    make_toy_accuracy()
)
toy_accuracy_pm1 = reward("toy_accuracy_pm1", "Toy arithmetic: +1 correct / -1 wrong (DAPO's rule reward)")(
    make_toy_accuracy(correct=1.0, wrong=-1.0)
)
toy_accuracy_pm1.__name__ = "toy_accuracy_pm1"


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------
def _load(model_or_path, tokenizer=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_variants.runtime.distributed import gathered_copy, is_zero3_partitioned, zero3_init_disabled

    if isinstance(model_or_path, (str, os.PathLike)):
        with zero3_init_disabled():  # whole, even after a ZeRO-3 config was built (e.g. the CLI's "before" row)
            model = AutoModelForCausalLM.from_pretrained(str(model_or_path))
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_or_path))
    elif is_zero3_partitioned(model_or_path):  # a ZeRO-3 trainer's model: generate on a gathered copy
        model = gathered_copy(model_or_path)
    else:
        model = model_or_path
    if tokenizer is None:
        raise ValueError("Pass a tokenizer when evaluating an in-memory model.")
    return model, tokenizer


def _render(prompt, tokenizer) -> str:
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt


@torch.no_grad()
def evaluate(
    model_or_path,
    dataset,
    tokenizer=None,
    *,
    greedy: bool = True,
    num_samples: int = 1,
    temperature: float = 1.0,
    batch_size: int = 256,
    max_new_tokens: int = 6,
    seed: int = 0,
) -> float:
    """Accuracy of a model on a toy dataset: greedy (default) or mean over ``num_samples`` samples.

    Single-shot from the original prompt (this is also how iGRPO is evaluated). ``model_or_path`` is a
    model, a folder (``str`` or ``os.PathLike``), or the model of a DeepSpeed ZeRO-3 trainer: its partitions
    are gathered into a whole copy first, a collective call, so under ZeRO-3 call it on every rank.
    """
    model, tokenizer = _load(model_or_path, tokenizer)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    scorer = make_toy_accuracy()
    prompts = [_render(p, tokenizer) for p in dataset["prompt"]]
    answers = list(dataset["answer"])
    correct, total = 0.0, 0
    try:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            gold = answers[start : start + batch_size]
            enc = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left").to(device)
            for _ in range(1 if greedy else num_samples):
                out = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=not greedy,
                    temperature=temperature if not greedy else None,
                    top_k=None,
                    top_p=None,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    synced_gpus=False,  # a whole model on this rank: no lock-step with others (even under ZeRO-3)
                )
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                correct += sum(scorer(batch, texts, gold))
                total += len(batch)
    finally:
        torch.random.set_rng_state(generator_state)
        model.train(was_training)
    return correct / max(total, 1)


# --------------------------------------------------------------------------------------------
# Warm start
# --------------------------------------------------------------------------------------------
@dataclass
class WarmStartConfig:
    """Supervised warm start of the toy policy (plain PyTorch, loss on answer + EOS only)."""

    task: str = "addition"
    difficulty: int = 2
    target_low: float = 0.20  # stop at the first check whose probe greedy accuracy is inside [target_low, target_high]
    target_high: float = 0.45
    min_steps: int = 160
    max_steps: int = 1600  # the cap: optimizer steps in all, replays after an overshoot included
    check_every: int = 20  # probe checks every so many steps (every step while replaying past an overshoot)
    max_replays: int = 4  # overshoots handled by replaying from the last check below the band
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0  # the problem split: the same as the RL datasets', so the warm start never sees an eval problem
    init_seed: int = field(default_factory=toy_seed)  # model init and batch order: $GRPO_VARIANTS_TOY_SEED
    probe_size: int = 200  # warm-start problems held back to decide when to stop (not the RL eval split)
    conversational: bool = False  # train (and probe) on prompts rendered with the chat template
    model: ToyModelConfig = field(default_factory=ToyModelConfig)
    version: int = 3  # bump to invalidate caches when the recipe changes (3: replay past an overshoot, init_seed)

    def key(self) -> str:
        fields_ = asdict(self)
        if not fields_["conversational"]:
            del fields_["conversational"]  # plain-format caches keep the key they had before the field existed
        blob = json.dumps(fields_, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _sft_batch(tokenizer, rows, device):
    input_ids, labels = [], []
    for prompt, answer in rows:
        p = tokenizer(prompt)["input_ids"]
        a = tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id]
        input_ids.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(x) for x in input_ids)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(zip(input_ids, labels, strict=True)):  # left padding, as at generation time
        ids[i, width - len(x) :] = torch.tensor(x)
        lab[i, width - len(y) :] = torch.tensor(y)
        att[i, width - len(x) :] = 1
    return ids.to(device), att.to(device), lab.to(device)


def _band_distance(accuracy: float, config: WarmStartConfig) -> float:
    return max(config.target_low - accuracy, accuracy - config.target_high, 0.0)


@dataclass
class _BandSearch:
    """What the warm-start loop ended with (see :func:`_train_to_band`)."""

    status: str  # "in_band", "below" (the cap came first) or "above" (past the band even checking every step)
    step: int  # the returned model's position in the batch stream
    accuracy: float  # its probe accuracy
    steps_taken: int  # optimizer steps in all, replays included (at most config.max_steps)
    replays: int
    history: list


def _train_to_band(config: WarmStartConfig, *, train_step, probe, get_state, set_state, log=None) -> _BandSearch:
    """Train until the probe accuracy is inside the band, or until ``config.max_steps`` optimizer steps.

    ``train_step(lr) -> loss`` takes one optimizer step, ``probe() -> accuracy`` measures, ``get_state()``
    returns an independent snapshot of everything that decides the continuation (weights, optimizer, batch
    stream) and ``set_state(snapshot)`` restores one. When a check finds the accuracy above the band, the run
    goes back to the last check below it and replays the same batches checking every step; an overshoot
    between two consecutive steps halves the learning rate of the next replay. If the band is never hit
    the model closest to it is restored and returned.
    """
    log = log or (lambda message: None)
    lr, every = config.lr, config.check_every
    step = taken = replays = 0
    below = None  # (step, snapshot) of the last check under the band
    best = None  # (distance, step, accuracy, snapshot) closest to the band so far
    history: list[dict] = []
    while taken < config.max_steps:
        step += 1
        taken += 1
        loss = train_step(lr)
        if step < config.min_steps or step % every:
            continue
        accuracy = probe()
        history.append({"step": step, "steps_taken": taken, "loss": round(float(loss), 4),
                        "probe_accuracy": accuracy, "lr": lr})
        log(f"step {step}: loss {float(loss):.3f}, probe greedy accuracy {accuracy:.1%} of {config.probe_size}")
        distance = _band_distance(accuracy, config)
        if distance == 0.0:
            return _BandSearch("in_band", step, accuracy, taken, replays, history)
        snapshot = get_state()
        if best is None or distance <= best[0]:  # on ties the later (more trained) model
            best = (distance, step, accuracy, snapshot)
        if accuracy < config.target_low:
            below = (step, snapshot)
            continue
        if below is None or replays >= config.max_replays:
            break
        replays += 1
        if every == 1:  # it jumped over the whole band in one step: smaller steps
            lr /= 2
        every = 1
        step, snapshot = below
        set_state(snapshot)
        log(f"{accuracy:.1%} is past the band: replaying from step {step}, checking every step at lr {lr:g}")
    if best is None:  # max_steps < min_steps: no check ran
        accuracy = probe()
        return _BandSearch("in_band" if _band_distance(accuracy, config) == 0.0 else
                           ("below" if accuracy < config.target_low else "above"), step, accuracy, taken, replays,
                           history)
    _, step, accuracy, snapshot = best
    set_state(snapshot)
    status = "below" if accuracy < config.target_low else "above"
    return _BandSearch(status, step, accuracy, taken, replays, history)


def out_of_band_message(meta: dict) -> str | None:
    """The warning for a warm start that ended outside its accuracy band (None when it is inside)."""
    if meta.get("in_band", True):
        return None
    config = meta.get("config", {})
    low, high = config.get("target_low", 0.2), config.get("target_high", 0.45)
    where = "below" if meta["probe_accuracy"] < low else "above"
    effect = ("GRPO starts with a weak signal (most groups all wrong)" if where == "below" else
              "GRPO starts near saturation (most groups all right)")
    return (
        f"The toy warm start ended {where} its accuracy band: probe greedy accuracy {meta['probe_accuracy']:.1%} of "
        f"{config.get('probe_size', 200)} problems after {meta.get('steps_taken', meta.get('steps'))} optimizer steps "
        f"(band {low:.0%}-{high:.0%}, cap {config.get('max_steps')} steps, {TOY_SEED_ENV}="
        f"{config.get('init_seed', 0)}). {effect}, so its results will differ from the documented ones. Try another "
        f"seed ({TOY_SEED_ENV}=1), or warm_start(config=WarmStartConfig(max_steps=...)) for a higher cap."
    )


def warm_start(
    output_dir: str | os.PathLike | None = None,
    config: WarmStartConfig | None = None,
    *,
    force: bool = False,
    verbose: bool = True,
) -> Path:
    """Train (or reuse from cache) the warm-started toy policy and return its folder.

    The folder holds the model (``save_pretrained``), the tokenizer and ``warmstart.json`` with
    the steps taken and the accuracy reached. It is written to a temporary folder and renamed
    into place, so a killed warm start never leaves a half-written cache entry. A warm start that
    ended outside its band warns (``UserWarning``) here, on every call, cached or not.
    """
    config = config or WarmStartConfig()
    out = Path(output_dir) if output_dir is not None else cache_dir() / "toy" / f"warm-{config.key()}"
    if not force and (out / "warmstart.json").exists():
        _warn_if_out_of_band(json.loads((out / "warmstart.json").read_text()))
        return out
    with build_lock(out):  # another process may be building this entry: wait, then reuse what it built
        if not force and (out / "warmstart.json").exists():
            _warn_if_out_of_band(json.loads((out / "warmstart.json").read_text()))
            return out
        return _train_warm_start(out, config, verbose)


def _train_warm_start(out: Path, config: WarmStartConfig, verbose: bool) -> Path:
    """Train the toy policy of ``config`` and write it to ``out`` (the caller holds the entry's build lock)."""

    def log(message: str) -> None:
        if verbose:
            print(f"[toy warm start] {message}")

    torch.manual_seed(config.init_seed)
    rng = random.Random(config.init_seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, config.model, seed=config.init_seed)
    model.train()
    device = torch.device("cpu")
    rows_ds = make_dataset(config.task, "warmstart", difficulty=config.difficulty, seed=config.seed,
                           conversational=config.conversational)
    rows = list(zip([_render(p, tokenizer) for p in rows_ds["prompt"]], rows_ds["answer"], strict=True))
    rows = rows[config.probe_size :]  # the first probe_size problems only decide when to stop
    probe_ds = rows_ds.select(range(config.probe_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    started = time.perf_counter()

    def train_step(lr: float) -> float:
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = rng.sample(rows, config.batch_size)
        ids, att, lab = _sft_batch(tokenizer, batch, device)
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()

    def get_state():
        return deepcopy((model.state_dict(), optimizer.state_dict(), rng.getstate()))

    def set_state(state) -> None:
        weights, optimizer_state, rng_state = deepcopy(state)
        model.load_state_dict(weights)
        optimizer.load_state_dict(optimizer_state)
        rng.setstate(rng_state)

    log(f"training the toy policy until its greedy accuracy on {config.probe_size} held-back problems is in "
        f"{config.target_low:.0%}-{config.target_high:.0%} (at most {config.max_steps} steps, {TOY_SEED_ENV}="
        f"{config.init_seed})")
    result = _train_to_band(config, train_step=train_step, probe=lambda: evaluate(model, probe_ds, tokenizer),
                            get_state=get_state, set_state=set_state, log=log)
    model.eval()
    meta = {
        "steps": result.step,
        "steps_taken": result.steps_taken,
        "replays": result.replays,
        "probe_accuracy": result.accuracy,
        "probe_size": config.probe_size,
        "in_band": result.status == "in_band",
        "status": result.status,
        "seconds": round(time.perf_counter() - started, 1),
        "history": result.history,
        "config": asdict(config),
    }
    log(f"{'done' if meta['in_band'] else 'stopped'} after {result.steps_taken} steps ({meta['seconds']} s): probe "
        f"greedy accuracy {result.accuracy:.1%} of {config.probe_size} held-back problems")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "warmstart.json").write_text(json.dumps(meta, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _warn_if_out_of_band(meta)
    return out


def _warn_if_out_of_band(meta: dict) -> None:
    message = out_of_band_message(meta)
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=3)


def _save_random_model(path: Path, seed: int) -> None:
    """Save a randomly initialised toy model and its tokenizer at ``path`` unless it is there already."""
    if (path / "config.json").exists():
        return
    tokenizer = build_tokenizer()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    try:
        build_model(tokenizer, seed=seed).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass
class ToyKit:
    """Everything a toy run needs: a model folder, the tokenizer, and train/eval datasets."""

    model_path: str
    train_dataset: object
    eval_dataset: object
    warmstart: dict

    @property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)


# Task name -> builder with prepare()'s signature, for tasks defined in other modules. Such a module
# imports this one and registers itself (grpo_variants/__init__.py imports it), so the toy kit never
# imports its extensions: no import cycle.
TASK_BUILDERS: dict = {}


def register_task(name: str, builder) -> None:
    """Let ``prepare(task=name)`` build a task defined in another module (``builder`` takes prepare's arguments)."""
    TASK_BUILDERS[name] = builder


def prepare(
    task: str = "addition",
    difficulty: int | None = None,
    *,
    num_eval: int = 500,
    conversational: bool = False,
    warm: bool = True,
    seed: int = 0,
    verbose: bool = True,
) -> ToyKit:
    """Build (or reuse) the warm-started toy policy and the datasets for ``task``.

    With ``conversational=True`` the prompts are one-message conversations and the warm start is
    trained on them rendered with the toy chat template (``<user>37+45=<assistant>``), as TRL renders
    them for generation; it is cached separately from the plain-format policy.

    With ``warm=False`` the model is randomly initialised (still saved and loaded by path).
    ``task="chain"`` (multi-operand addition with written-out partial sums) is built by
    :func:`grpo_variants.tasks.toy_reasoning.prepare`.
    """
    if task in TASK_BUILDERS:  # tasks of other modules (the chain task of grpo_variants.tasks.toy_reasoning)
        return TASK_BUILDERS[task](task, difficulty=difficulty, num_eval=num_eval, conversational=conversational,
                                   warm=warm, seed=seed, verbose=verbose)
    difficulty = 2 if difficulty is None else difficulty
    if warm:
        path = warm_start(config=WarmStartConfig(task=task, difficulty=difficulty, seed=seed,
                                                 conversational=conversational), verbose=verbose)
        meta = json.loads((path / "warmstart.json").read_text())
    else:
        path = cache_dir() / "toy" / f"random-seed{seed}"
        with build_lock(path):
            _save_random_model(path, seed)
        meta = {"steps": 0, "probe_accuracy": None}
    kwargs = dict(task=task, difficulty=difficulty, num_eval=num_eval, conversational=conversational, seed=seed)
    return ToyKit(
        model_path=str(path),
        train_dataset=make_dataset(split="train", **kwargs),
        eval_dataset=make_dataset(split="eval", **kwargs),
        warmstart=meta,
    )
