"""Reward functions: built-ins (toy, math, exact, f1) and custom `module:function`, all batched.

Every reward function has one signature, so built-ins and user code are interchangeable:

    fn(prompts: list[str], responses: list[str], labels: list, metadata: list[dict]) -> list[float]

They run on the CPU of each rank, after generation and before training. `load_reward_fn` resolves
a name at start-up (an import error, or a signature that cannot take those four arguments, surfaces
before any GPU work); `compute_rewards` calls the function on a batch and turns a failure into
reward 0.0 for the failing samples, counted and logged once, or fatal in strict mode. Breaking the
contract itself (a call that cannot bind, a result that is not one number per sample) is a
`RewardContractError`, always fatal: it would fail every sample the same way.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
import string
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from colocate.toy import toy_score
from colocate.user_code import FORMS, is_function_spec, load_function

logger = logging.getLogger(__name__)

RewardFn = Callable[[list[str], list[str], list[Any], list[dict]], list[float]]
_warned: set[str] = set()


@dataclass
class RewardInput:
    """What a reward function sees of one sample."""

    prompt: str
    response: str
    label: Any
    metadata: dict = field(default_factory=dict)


def toy_reward(prompts: list[str], responses: list[str], labels: list, metadata: list[dict]):
    """The toy task's reward (see colocate/toy.py): position-wise matches, length-normalised."""
    return [toy_score(r, str(label)) for r, label in zip(responses, labels)]


def math_reward(prompts: list[str], responses: list[str], labels: list, metadata: list[dict]):
    """1.0 when math-verify finds that the final (boxed, else last) answer equals the label."""
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    rewards = []
    for response, label in zip(responses, labels):
        gold = parse(_math_label(label), parsing_timeout=timeout)
        pred = parse(response, parsing_timeout=timeout)
        ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout)
        rewards.append(1.0 if ok else 0.0)
    return rewards


def exact_reward(prompts: list[str], responses: list[str], labels: list, metadata: list[dict]):
    """1.0 when the normalised final answer equals a normalised label (a list means any of them)."""
    rewards = []
    for response, label in zip(responses, labels):
        answer = normalize_answer(extract_final_answer(response))
        rewards.append(float(any(answer == normalize_answer(g) for g in _alternatives(label))))
    return rewards


def f1_reward(prompts: list[str], responses: list[str], labels: list, metadata: list[dict]):
    """Token-level F1 between the final answer and the label (best over a list of labels)."""
    return [
        max(token_f1(extract_final_answer(response), g) for g in _alternatives(label))
        for response, label in zip(responses, labels)
    ]


BUILTIN_REWARD_FNS: dict[str, RewardFn] = {
    "toy": toy_reward,
    "math": math_reward,
    "exact": exact_reward,
    "f1": f1_reward,
}


class RewardContractError(ValueError):
    """A reward function broke its contract (e.g. wrong number of rewards): a bug, always fatal."""


def load_reward_fn(name: str, what: str = "rollout.reward") -> RewardFn:
    """A built-in by name, or `module:function` / `file.py:function` imported now so that a typo or
    a wrong signature fails at start-up; errors name `what` (the config field)."""
    if name in BUILTIN_REWARD_FNS:
        return BUILTIN_REWARD_FNS[name]
    if not is_function_spec(name):
        raise ValueError(f"{what}: {name!r} is not a built-in reward (one of {sorted(BUILTIN_REWARD_FNS)}) nor {FORMS}")
    fn = load_function(name, what)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no inspectable signature: its first call is checked instead
        return fn
    try:
        signature.bind([], [], [], [])
    except TypeError as e:
        raise RewardContractError(f"{what}: {_signature_error(name, e)}") from None
    return fn


def _signature_error(name: str, error: TypeError) -> str:
    return f"reward function {name} cannot be called as fn(prompts, responses, labels, metadata) ({error})"


def compute_rewards(fn: RewardFn, samples: Sequence[RewardInput], strict: bool = False) -> tuple[list[float], int]:
    """Rewards of a batch and the number of samples whose reward failed (they get 0.0).

    The batch is scored in one call; if that call raises, each sample is scored alone so that
    one bad sample costs only its own reward. A non-finite reward counts as a failure.
    """
    if not samples:
        return [], 0
    name = _fn_name(fn)
    try:
        results: list[float | Exception] = list(_call(fn, samples, name))
    except RewardContractError:
        raise
    except Exception:
        results = [_score_one(fn, sample, name) for sample in samples]
    rewards, num_errors = [], 0
    for i, r in enumerate(results):
        if isinstance(r, Exception) or not math.isfinite(r):
            error = r if isinstance(r, Exception) else ValueError(f"non-finite reward {r}")
            _fail(name, i, error, strict)
            r, num_errors = 0.0, num_errors + 1
        rewards.append(r)
    return rewards, num_errors


def _score_one(fn: RewardFn, sample: RewardInput, name: str) -> float | Exception:
    try:
        return _call(fn, [sample], name)[0]
    except RewardContractError:
        raise
    except Exception as e:
        return e


def _call(fn: RewardFn, samples: Sequence[RewardInput], name: str) -> list[float]:
    try:
        out = fn(
            [s.prompt for s in samples],
            [s.response for s in samples],
            [s.label for s in samples],
            [s.metadata if s.metadata is not None else {} for s in samples],
        )
    except TypeError as e:
        # Raised by the call itself, not from inside fn: the arguments could not bind.
        if e.__traceback__ is not None and e.__traceback__.tb_next is None:
            raise RewardContractError(_signature_error(name, e)) from None
        raise
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
        raise RewardContractError(f"reward function {name} returned a {type(out).__name__}, not a list of {len(samples)} rewards")
    out = list(out)
    if len(out) != len(samples):
        raise RewardContractError(f"reward function {name} returned {len(out)} rewards for {len(samples)} samples")
    return [float(r) for r in out]


class RewardError(ValueError):
    """A reward function raised, or returned a non-finite reward, under train.strict: the user's code
    failed, reported in one line."""


def _fail(name: str, index: int, error: Exception, strict: bool) -> None:
    if strict:
        what = " ".join(f"{type(error).__name__}: {error}".split())  # one line, whatever the message holds
        raise RewardError(f"reward function {name} failed on sample {index} (train.strict is on): {what}") from error
    if name not in _warned:
        _warned.add(name)
        logger.warning(
            "reward function %s failed on sample %d (reward 0.0; further failures are only counted): %r", name, index, error
        )


def _fn_name(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _math_label(label: Any) -> str:
    text = str(label).strip()
    # A bare label ("42", "\frac{1}{2}") parses most reliably as inline LaTeX.
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def _alternatives(label: Any) -> list[str]:
    return [str(g) for g in label] if isinstance(label, (list, tuple)) else [str(label)]


def extract_final_answer(text: str) -> str:
    """The final answer of a response.

    The last \\boxed{...}; else what follows the last ####, "answer is" or "answer:"; else the
    whole stripped text.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    lower = text.lower()
    for marker in ("####", "answer is", "answer:"):
        pos = lower.rfind(marker)
        if pos >= 0:
            return text[pos + len(marker) :].strip()
    return text.strip()


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


_ARTICLES = frozenset(("a", "an", "the"))
_EDGE_PUNCT = string.punctuation.replace("-", "")
_NUMBER = re.compile(r"-?\d[\d,]*(\.\d+)?")


def normalize_answer(text: str) -> str:
    """Lower-case; drop $, \\text{}, articles and punctuation around words; 1,000 -> 1000.

    Punctuation inside a word is kept so that 3.5 and -3 stay distinct from 35 and 3.
    """
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", text.lower()).replace("$", "")
    words = []
    for word in text.split():
        word = word.strip(_EDGE_PUNCT)
        word = word.replace(",", "") if _NUMBER.fullmatch(word) else word.strip("-")
        if word and word not in _ARTICLES:
            words.append(word)
    return " ".join(words)


def token_f1(prediction: str, reference: str) -> float:
    """F1 of the normalised word bags of prediction and reference (both empty: 1.0)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)
