"""Robust calling of reward functions: clear errors, NaN checks, optional timeouts and caching, metrics.

``RobustReward(func, ...)`` is a drop-in replacement for ``func`` with TRL's signature
(``f(prompts=..., completions=..., completion_ids=..., **kwargs) -> list``) and the same
``__name__`` (TRL logs each reward under it). **By default it behaves like TRL**: the function is
called once per batch, in the caller's thread, with exactly the batch TRL passes (same length,
same order, duplicates included) and no time limit. What it adds (verl PR #6673: one slow reward
call without a timeout froze training; PR #5635: math_verify failed in worker threads and every
score silently became 0):

* **Slow-call warning** (``warn_after`` seconds, default 60): a call still running after that
  long logs one warning naming the reward and the batch size, while it runs, and training
  continues. Nothing is interrupted.
* **Timeout per call** (``timeout`` seconds, default None = none, as in TRL). With a timeout,
  ``isolation="thread"`` runs the batch in a daemon worker thread and *abandons* it on timeout:
  the call returns, but the thread keeps running until the function returns by itself (CPU it
  burns is not reclaimed; a warning is logged when abandoned calls pile up).
  ``isolation="process"`` runs the call in a child forked with multiprocessing's ``fork`` context
  and SIGKILLs it (and its process group) on timeout: a hard bound, at the cost of a fork per
  call; the return value must be picklable, side effects in the child (caches,
  ``log_metric``/``log_extra`` calls, counters) are lost, and the child must not use CUDA.
  ``isolation="none"``, or ``"thread"`` without a timeout, calls in the caller's thread.
* **Errors**: an exception becomes :class:`RewardFunctionError` naming the reward, the batch size,
  the original exception's type and message and the line that raised it. The function is called once,
  as TRL calls it: it is never re-called unasked (a paid or side-effecting reward would pay once per
  sample). With ``on_error="none"`` (the opt-in) the batch is scored again one sample at a time, within
  another ``timeout`` (announced by one warning per reward, since it costs extra calls and a
  group-level reward scores differently alone): failing samples become None (missing: TRL turns it
  into NaN and ignores it), the other samples keep their scores, and the errors are counted.
* **Timeouts**: ``on_error="raise"`` raises RewardFunctionError naming the timeout and how to
  change it; ``"none"`` returns Nones (counted as timeouts).
* **Non-finite values** (NaN, inf) and non-numeric values: RewardFunctionError naming the index,
  or None with ``on_error="none"`` (counted in ``nan_rate`` / ``error_rate``).
* **Wrong length**: always RewardFunctionError naming the function and both counts (a bug in
  the function, not a property of one sample).
* **Caching** (opt-in, ``cache_duplicates=True``; off by default): identical (prompt,
  completion, completion_ids, per-sample columns) within one call are scored once, so the
  function then sees the deduplicated batch, *not* TRL's. Only valid for deterministic rewards
  that score each sample independently of the rest of the batch (not for group-level rewards
  such as diversity, nor for rewards that call ``log_extra`` with one value per sample). With no
  duplicates the function gets the original arguments untouched.
* **Metrics** since the last :meth:`RobustReward.pop_metrics`: mean, error_rate, timeout_rate,
  nan_rate, time_s, cache_hit_rate.
* **Step rewards** (a function declared with :func:`~grpo_variants.rewards.steps.step_reward`): each
  completion's value is parsed into a :class:`~grpo_variants.rewards.steps.StepReward` (a bad shape is
  an error for that sample, handled as above; a non-finite step score is a non-finite value); the call
  returns to TRL the mean step score per completion and keeps the steps in ``last_steps`` (one entry
  per sample of the call, None when missing) for the trainer.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from grpo_variants.errors import ConfigError, RewardFunctionError
from grpo_variants.rewards.steps import StepReward, coerce_step_reward, is_step_reward, step_delimiter

logger = logging.getLogger(__name__)

__all__ = ["RobustReward", "wrap_reward_funcs", "NON_SAMPLE_KWARGS"]

# Keyword arguments TRL passes that are not per-sample dataset columns.
NON_SAMPLE_KWARGS = frozenset({"trainer_state", "log_extra", "log_metric", "environments"})
_ISOLATIONS = ("thread", "process", "none")
_ON_ERROR = ("raise", "none")
_ABANDONED_WARN_AT = 4
# A reward call still running after this many seconds logs a warning (it is not interrupted).
DEFAULT_WARN_AFTER = 60.0


def _callable_name(func: Callable) -> str:
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def _is_async(func: Callable) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


def _freeze(x: Any) -> Any:
    """A hashable stand-in for ``x`` (lists/dicts/sets recursively), or its repr."""
    if isinstance(x, (str, bytes, int, float, bool, type(None))):
        return (type(x).__name__, x)
    if isinstance(x, (list, tuple)):
        return ("seq", tuple(_freeze(v) for v in x))
    if isinstance(x, dict):
        return ("map", tuple(sorted(((str(k), _freeze(v)) for k, v in x.items()), key=lambda kv: kv[0])))
    if isinstance(x, (set, frozenset)):
        return ("set", tuple(sorted(repr(v) for v in x)))
    tolist = getattr(x, "tolist", None)  # tensors, numpy arrays
    if callable(tolist):
        try:
            return ("arr", _freeze(tolist()))
        except Exception:
            pass
    return ("repr", type(x).__name__, repr(x))


class _Failure:
    """An exception captured in a worker (thread or process), transportable by pickle."""

    def __init__(self, exc: BaseException):
        self.type_name = type(exc).__name__
        self.message = str(exc)
        self.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
        frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
        last = frames[-1] if frames else None  # where it was raised (the reward's own code, or what it called)
        self.where = f'File "{last.filename}", line {last.lineno}, in {last.name}' if last is not None else ""

    def describe(self) -> str:
        return f"{self.type_name}: {self.message}" if self.message else self.type_name


class _Timeout:
    pass


_TIMEOUT = _Timeout()


def _run_process_child(conn, fn: Callable[[], Any]) -> None:  # pragma: no cover - runs in the child
    try:
        os.setpgid(0, 0)  # our own group, so that a timeout kills what the reward started too
    except OSError:
        pass
    try:
        result = ("ok", fn())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = ("err", _Failure(exc))
    try:
        conn.send(result)
    except Exception as exc:  # unpicklable return value
        conn.send(("err", _Failure(TypeError(
            f"the reward's return value could not be sent back from the isolation process ({exc}); "
            "isolation='process' needs picklable values (floats or None)"
        ))))
    finally:
        conn.close()
        os._exit(0)


class RobustReward:
    """Wrap a reward function with a timeout, isolation, error handling, NaN checks and caching.

    See the module docstring for the behaviour of each option. ``name`` defaults to the wrapped
    function's ``__name__``.
    """

    def __init__(
        self,
        func: Callable[..., Sequence],
        *,
        name: str | None = None,
        timeout: float | None = None,
        isolation: str = "thread",
        on_error: str = "raise",
        cache_duplicates: bool = False,
        warn_after: float | None = DEFAULT_WARN_AFTER,
    ):
        if not callable(func):
            raise ConfigError(f"RobustReward needs a callable reward function, got {func!r}.")
        if isolation not in _ISOLATIONS:
            raise ConfigError(f"reward isolation must be one of {_ISOLATIONS}, got {isolation!r}.")
        if on_error not in _ON_ERROR:
            raise ConfigError(f"reward on_error must be one of {_ON_ERROR}, got {on_error!r}.")
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ConfigError(f"reward timeout must be a positive number of seconds or None, got {timeout!r}.")
        if warn_after is not None and (isinstance(warn_after, bool) or not warn_after > 0):
            raise ConfigError(f"reward warn_after must be a positive number of seconds or None, got {warn_after!r}.")
        self.func = func
        self.__name__ = name or _callable_name(func)
        self.__qualname__ = self.__name__
        self.__doc__ = getattr(func, "__doc__", None)
        self.__wrapped__ = func
        self.timeout = None if timeout is None else float(timeout)
        self.isolation = isolation
        self.on_error = on_error
        self.cache_duplicates = bool(cache_duplicates)
        self.warn_after = None if warn_after is None else float(warn_after)
        self.returns_steps = is_step_reward(func)  # a step reward (grpo_variants.rewards.steps)
        self.step_delimiter = step_delimiter(func) if self.returns_steps else None
        self.last_steps: list | None = None  # the steps of the last call's samples (step rewards only)
        self._init_runtime()

    # ---- state -------------------------------------------------------------------------------
    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._abandoned: list[threading.Thread] = []
        self._announced_per_sample = False
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._n = 0
        self._n_err = 0
        self._n_timeout = 0
        self._n_nan = 0
        self._n_cache_hits = 0
        self._sum = 0.0
        self._n_values = 0
        self._time = 0.0

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_abandoned")}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        return (
            f"RobustReward({self.__name__}, timeout={self.timeout}, isolation={self.isolation!r}, "
            f"on_error={self.on_error!r}, cache_duplicates={self.cache_duplicates}, warn_after={self.warn_after})"
        )

    def pop_metrics(self) -> dict[str, float]:
        """Metrics since the last pop, as rates over the samples scored (mean over non-missing values)."""
        with self._lock:
            n = self._n
            out = {
                "mean": self._sum / self._n_values if self._n_values else float("nan"),
                "error_rate": self._n_err / n if n else 0.0,
                "timeout_rate": self._n_timeout / n if n else 0.0,
                "nan_rate": self._n_nan / n if n else 0.0,
                "time_s": self._time,
                "cache_hit_rate": self._n_cache_hits / n if n else 0.0,
            }
            self._reset_counters()
        return out

    # ---- running -----------------------------------------------------------------------------
    def _call_func(self, **kwargs):
        result = self.func(**kwargs)
        if inspect.isawaitable(result):
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop in this thread: run the coroutine here
                return asyncio.run(_await(result))
            box: list = []  # a loop already runs here (a notebook): run it in a helper thread
            t = threading.Thread(target=lambda: box.append(_capture(lambda: asyncio.run(_await(result)))))
            t.start()
            t.join()
            if isinstance(box[0], BaseException):
                raise box[0]
            result = box[0]
        return result

    def _invoke(self, fn: Callable[[], Any], n: int = 0) -> Any:
        """Run ``fn()`` under the isolation and timeout: its value, a _Failure, or _TIMEOUT.

        Without a timeout (the default) or with ``isolation="none"`` it runs in the caller's thread,
        as TRL calls it. A call still running after ``warn_after`` seconds logs one warning.
        """
        timer = None
        if self.warn_after is not None and (self.timeout is None or self.warn_after < self.timeout):
            timer = threading.Timer(self.warn_after, self._warn_slow, args=(n,))
            timer.daemon = True
            timer.start()
        try:
            if self.isolation == "none" or (self.isolation == "thread" and self.timeout is None):
                try:
                    return fn()
                except Exception as exc:  # noqa: BLE001
                    return _Failure(exc)
            if self.isolation == "process":
                return self._invoke_process(fn)
            return self._invoke_thread(fn)
        finally:
            if timer is not None:
                timer.cancel()

    def _warn_slow(self, n: int) -> None:
        limit = (f"it is stopped at reward_timeout={self.timeout:g} s" if self.timeout is not None
                 else "there is no time limit (set reward_timeout=<seconds> to bound it)")
        logger.warning(
            "Reward '%s' has been running for %g s on a batch of %d samples and is still running; %s.",
            self.__name__, self.warn_after, n, limit,
        )

    def _invoke_thread(self, fn: Callable[[], Any]) -> Any:
        box: list = []

        def target():
            try:
                box.append(fn())
            except BaseException as exc:  # noqa: BLE001
                box.append(_Failure(exc))

        t = threading.Thread(target=target, name=f"reward-{self.__name__}", daemon=True)
        t.start()
        t.join(self.timeout)
        if t.is_alive():
            with self._lock:
                self._abandoned = [a for a in self._abandoned if a.is_alive()] + [t]
                n_alive = len(self._abandoned)
            if n_alive >= _ABANDONED_WARN_AT:
                logger.warning(
                    "Reward '%s': %d timed-out calls are still running in abandoned threads (they keep using CPU). "
                    "Use isolation='process' to kill timed-out calls.",
                    self.__name__,
                    n_alive,
                )
            return _TIMEOUT
        return box[0] if box else _Failure(RuntimeError("the reward thread ended without a result"))

    def _invoke_process(self, fn: Callable[[], Any]) -> Any:
        ctx = multiprocessing.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_run_process_child, args=(send, fn), daemon=True, name=f"reward-{self.__name__}")
        proc.start()
        send.close()
        status, value = "timeout", None
        try:
            if recv.poll(self.timeout):
                try:
                    status, value = recv.recv()
                except (EOFError, OSError):
                    status, value = "err", _Failure(RuntimeError(
                        f"the isolation process died without a result (exit code {proc.exitcode})"))
            else:
                status, value = "timeout", None
        finally:
            recv.close()
            if status == "timeout" or proc.is_alive():
                for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: os.kill(proc.pid, signal.SIGKILL)):
                    try:
                        kill()
                    except (ProcessLookupError, PermissionError):
                        pass
            proc.join(5)
        if status == "timeout":
            return _TIMEOUT
        return value

    def _timeout_error(self, n: int, what: str = "") -> RewardFunctionError:
        return RewardFunctionError(
            f"Reward function '{self.__name__}' timed out after {self.timeout:g} s on a batch of {n} samples{what}. "
            "Raise the limit with reward_timeout=<seconds> (RobustReward(timeout=...)), set reward_timeout=None "
            "to disable it, or set reward_on_error='none' to score timed-out batches as missing."
        )

    # ---- validation --------------------------------------------------------------------------
    def _validate(self, out: Any, n: int, batch: int | None = None, texts: list | None = None) -> list:
        """Convert to a list of float/None/_Failure (StepReward for a step reward); wrong length raises."""
        if out is None or isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
            raise RewardFunctionError(
                f"Reward function '{self.__name__}' returned {type(out).__name__}, expected a list of {n} floats "
                "(or None for missing values)."
            )
        tolist = getattr(out, "tolist", None)
        if callable(tolist) and not isinstance(out, (list, tuple)):
            out = tolist()
        out = list(out)
        if len(out) != n:
            raise RewardFunctionError(
                f"Reward function '{self.__name__}' returned {len(out)} rewards for {n} completions"
                + (f" (the {n} distinct samples of a batch of {batch}: reward_cache=True)" if batch and batch != n else "")
                + ("; a step reward (@step_reward) must return exactly one entry per completion: its steps (a "
                   "StepReward, a list of (end_char, score) pairs or, with a declared delimiter, a list of step "
                   "scores), or None when the completion has no score." if self.returns_steps else
                   "; it must return exactly one value (float or None) per completion.")
            )
        values: list = []
        for i, v in enumerate(out):
            if v is None:
                values.append(None)
                continue
            if self.returns_steps:
                try:
                    text = _completion_text(texts[i]) if texts is not None and i < len(texts) else None
                    values.append(coerce_step_reward(v, text, self.step_delimiter))
                except (TypeError, ValueError) as exc:
                    values.append(_Failure(TypeError(f"returned a malformed step reward: {exc}")))
                continue
            if isinstance(v, (StepReward, list, tuple)):
                values.append(_Failure(TypeError(
                    f"returned {type(v).__name__} {v!r} for one completion: a function that scores steps must be "
                    "declared with @grpo_variants.step_reward (see grpo_variants.rewards.steps)")))
                continue
            try:
                if isinstance(v, (str, bytes)):
                    raise TypeError
                f = float(v)
            except (TypeError, ValueError):
                values.append(_Failure(TypeError(f"returned a non-numeric value {v!r} ({type(v).__name__})")))
                continue
            values.append(f)
        return values

    # ---- the call ----------------------------------------------------------------------------
    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float | None]:
        t0 = time.perf_counter()
        completions = list(completions) if completions is not None else []
        n = len(completions)
        prompts_l = list(prompts) if prompts is not None else None
        ids_l = list(completion_ids) if completion_ids is not None else None
        per_sample = {
            k: list(v)
            for k, v in kwargs.items()
            if k not in NON_SAMPLE_KWARGS and isinstance(v, (list, tuple)) and len(v) == n
        }
        shared = {k: v for k, v in kwargs.items() if k not in per_sample}

        # Deduplicate identical samples.
        unique = list(range(n))
        inverse = list(range(n))
        if self.cache_duplicates and n > 1:
            seen: dict = {}
            unique, inverse = [], []
            for i in range(n):
                try:
                    key = (
                        _freeze(prompts_l[i]) if prompts_l is not None and len(prompts_l) == n else None,
                        _freeze(completions[i]),
                        _freeze(ids_l[i]) if ids_l is not None and len(ids_l) == n else None,
                        tuple((k, _freeze(v[i])) for k, v in sorted(per_sample.items())),
                    )
                    hash(key)
                except Exception:  # noqa: BLE001 - unhashable oddity: score it on its own
                    key = ("unique", i)
                if key not in seen:
                    seen[key] = len(unique)
                    unique.append(i)
                inverse.append(seen[key])
        m = len(unique)

        def args_for(idx: list[int]) -> dict:
            if len(idx) == n and idx == list(range(n)):
                sub = dict(prompts=prompts, completions=completions, completion_ids=completion_ids)
                sub.update(kwargs)
                return sub

            def pick(seq):
                return None if seq is None else ([seq[j] for j in idx] if len(seq) == n else seq)

            sub = dict(prompts=pick(prompts_l), completions=[completions[j] for j in idx], completion_ids=pick(ids_l))
            sub.update(shared)
            sub.update({k: [v[j] for j in idx] for k, v in per_sample.items()})
            return sub

        batch_args = args_for(unique)
        res = self._invoke(lambda: self._call_func(**batch_args), m)

        n_err = n_timeout = n_nan = 0
        values: list  # per unique sample: float | None | _Failure | _TIMEOUT
        if res is _TIMEOUT:
            if self.on_error == "raise":
                self._account(n, 0, n, 0, n - m, [], time.perf_counter() - t0)
                raise self._timeout_error(m)
            values = [_TIMEOUT] * m
        elif isinstance(res, _Failure) and self.on_error == "raise":
            # Called once, as TRL calls it: a raising reward is not re-called per sample unasked (a paid or
            # side-effecting reward would pay once per sample). reward_on_error='none' opts into that.
            self._account(n, n, 0, 0, n - m, [], time.perf_counter() - t0)
            raise self._batch_error(res, n)
        elif isinstance(res, _Failure):
            values = self._per_sample(unique, args_for, res, n, completions)
        else:
            values = self._validate(res, m, n, texts=[completions[i] for i in unique])  # wrong length raises here
            if any(isinstance(v, _Failure) for v in values) and self.on_error == "raise":
                j = next(k for k, v in enumerate(values) if isinstance(v, _Failure))
                self._account(n, n, 0, 0, n - m, [], time.perf_counter() - t0)
                raise self._sample_error(unique[j], n, values[j], completions)

        # Non-finite values.
        for j, v in enumerate(values):
            if isinstance(v, float) and not math.isfinite(v) or isinstance(v, StepReward) and not v.finite():
                if self.on_error == "raise":
                    self._account(n, 0, 0, 1, n - m, [], time.perf_counter() - t0)
                    raise RewardFunctionError(
                        f"Reward function '{self.__name__}' returned a non-finite value ({v}) for sample {unique[j]} "
                        f"(of {n}){_preview(completions, unique[j])}. Return None for a missing score instead, or "
                        "set reward_on_error='none' to turn non-finite values into missing ones."
                    )
                values[j] = _NonFinite()

        # Expand to all samples and count.
        out: list[float | None] = []
        for i in range(n):
            v = values[inverse[i]]
            if v is _TIMEOUT:
                n_timeout += 1
                out.append(None)
            elif isinstance(v, _Failure):
                n_err += 1
                out.append(None)
            elif isinstance(v, _NonFinite):
                n_nan += 1
                out.append(None)
            else:
                out.append(v)
        if n_err or n_timeout or n_nan:
            self._log_missing(n, n_err, n_timeout, n_nan, values)
        if self.returns_steps:  # TRL gets the mean step score; the steps stay here for the trainer
            self.last_steps = out
            out = [None if v is None else v.summary for v in out]
        self._account(n, n_err, n_timeout, n_nan, n - m, [v for v in out if v is not None], time.perf_counter() - t0)
        return out

    def _batch_error(self, failure: _Failure, n: int) -> RewardFunctionError:
        where = f"\n  {failure.where}" if failure.where else ""
        return RewardFunctionError(
            f"Reward function '{self.__name__}' raised {failure.describe()} on a batch of {n} samples (called once, "
            "as TRL does). Fix the function, or set reward_on_error='none' to score the batch again one sample at a "
            f"time, failing samples as missing.{where}"
        )

    def _per_sample(self, unique: list[int], args_for, batch_failure: _Failure, n: int, completions) -> list:
        """After a failed batch call, with reward_on_error='none' (the user's opt-in): score samples one at a time.

        Announced once per reward (a warning): the function is called again, once per sample, which costs more
        calls (a paid judge) and, for a reward that scores a sample against the rest of its batch (group-level),
        gives other values than a batch call would.
        """
        if not self._announced_per_sample:
            self._announced_per_sample = True
            logger.warning(
                "Reward '%s' raised %s on a batch of %d; calling it again one sample at a time (up to %d more calls) "
                "and the samples that succeed keep those single-sample scores (reward_on_error='none'). This is said "
                "once per reward; a group-level or paid reward should not raise.",
                self.__name__, batch_failure.describe(), n, len(unique))

        def one_by_one():
            vals = []
            for i in unique:
                try:
                    r = self._call_func(**args_for([i]))
                    r = list(r) if not isinstance(r, (str, bytes)) and hasattr(r, "__len__") else r
                    if not isinstance(r, list) or len(r) != 1:
                        vals.append(_Failure(TypeError(f"returned {r!r} for a single sample")))
                    else:
                        vals.append(self._validate(r, 1, texts=[completions[i]])[0])
                except Exception as exc:  # noqa: BLE001
                    vals.append(_Failure(exc))
            return vals

        vals = self._invoke(one_by_one, len(unique))
        if not isinstance(vals, list) or len(vals) != len(unique):
            return [batch_failure] * len(unique)  # the per-sample pass timed out or failed as a whole
        return vals

    def _sample_error(self, index: int, n: int | None, failure: _Failure, completions):
        of = f" (of {n})" if n else ""
        prev = _preview(completions, index) if completions is not None else ""
        return RewardFunctionError(
            f"Reward function '{self.__name__}' failed on sample {index}{of}{prev}: {failure.describe()}. "
            "Fix the function, or set reward_on_error='none' to score failing samples as missing.\n"
            f"{failure.traceback if failure.traceback.strip() != 'NoneType: None' else ''}"
        )

    def _log_missing(self, n, n_err, n_timeout, n_nan, values) -> None:
        first = next((v for v in values if isinstance(v, _Failure)), None)
        detail = f"; first error: {first.describe()}" if first is not None else ""
        logger.warning(
            "Reward '%s': %d of %d samples scored None (errors %d, timeouts %d, non-finite %d)%s",
            self.__name__, n_err + n_timeout + n_nan, n, n_err, n_timeout, n_nan, detail,
        )

    def _account(self, n, n_err, n_timeout, n_nan, hits, vals, dt) -> None:
        with self._lock:
            self._n += n
            self._n_err += n_err
            self._n_timeout += n_timeout
            self._n_nan += n_nan
            self._n_cache_hits += hits
            self._sum += float(sum(vals))
            self._n_values += len(vals)
            self._time += dt


class _NonFinite:
    pass


async def _await(aw):
    return await aw


def _capture(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
        return exc


def _completion_text(completion) -> str:
    """The text of one completion (conversational: its messages' contents joined)."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    return str(completion)


def _preview(completions, index: int) -> str:
    try:
        c = completions[index]
    except Exception:  # noqa: BLE001
        return ""
    text = c if isinstance(c, str) else repr(c)
    text = text.replace("\n", "\\n")
    return f" (completion starts {text[:80]!r})" if text else ""


def _is_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.nn.Module):
        return True
    return False


def wrap_reward_funcs(funcs: Any, **options) -> list:
    """Wrap every plain callable in ``funcs`` (one or a list) in :class:`RobustReward`.

    Registered reward names are resolved with :func:`get_reward` and wrapped; other strings
    (model ids / paths for TRL's reward models), ``nn.Module`` reward models and callables that
    are already RobustReward are left untouched. ``options`` go to RobustReward.
    """
    from grpo_variants.rewards.registry import get_reward

    items = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
    out = []
    for f in items:
        if isinstance(f, str):
            try:
                f = get_reward(f)
            except KeyError:
                out.append(f)  # a model id or path: TRL loads a reward model
                continue
        if isinstance(f, RobustReward) or _is_module(f) or not callable(f):
            out.append(f)
            continue
        out.append(RobustReward(f, **options))
    return out
