"""The reward of a demo response: 1.0 when it solves the demo task its prompt names, else 0.0.

The demo prompts come from the task generators of scripts/train_demo_models.py. Six tasks have one exact
answer (add, mul, count, reverse, sort, spell); `walk` and `pick` have many right answers, which are
checked by their rule; the free-text tasks (`the COLOR NOUN`, `story of ...`) have no right answer, so
they give 0.0 and no learning signal. Text-level, one sequence at a time: a reward, not a metric.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# The demo tokenizer's special tokens; a response ends at the first (generation stops at either).
END_MARKERS = ("<|endoftext|>", "<|im_end|>")
CHAT_USER = "<|im_start|>user\n"
WALK_LENGTHS = range(10, 17)  # _walk draws 10 to 16 numbers
NUMBER = re.compile(r"-?[0-9]+")


def reward(prompt: str, response: str) -> float:
    """1.0 for a right answer to the demo task `prompt` names (plain or chat-templated), else 0.0."""
    task = _task_text(prompt)
    answer = _answer_text(response)
    for pattern, check in TASKS:
        match = pattern.fullmatch(task)
        if match:
            return float(check(match, answer))
    return 0.0


def _task_text(prompt: str) -> str:
    """The task line: the last user message of a chat-templated prompt, or the plain prompt."""
    if CHAT_USER in prompt:
        prompt = prompt.rsplit(CHAT_USER, 1)[1]
    return _cut_at_end(prompt).strip()


def _answer_text(response: str) -> str:
    # The demo trains answers after a space (plain prompts) or without it (chat), so whitespace is not judged.
    return _cut_at_end(response).strip()


def _cut_at_end(text: str) -> str:
    cut = min((i for i in (text.find(m) for m in END_MARKERS) if i >= 0), default=len(text))
    return text[:cut]


def _numbers(text: str) -> list[int] | None:
    """Space-separated integers written canonically ("7", not "07" or "+7"), or None."""
    words = text.split(" ")
    if not all(NUMBER.fullmatch(w) and str(int(w)) == w for w in words):
        return None
    return [int(w) for w in words]


def _exact(expected: Callable[[re.Match], str]) -> Callable[[re.Match, str], bool]:
    return lambda match, answer: answer == expected(match)


def _walk(match: re.Match, answer: str) -> bool:
    steps = _numbers(answer)
    return (
        steps is not None
        and len(steps) in WALK_LENGTHS
        and steps[0] == int(match["start"])
        and all(abs(b - a) == 1 for a, b in zip(steps, steps[1:]))
    )


def _pick(match: re.Match, answer: str) -> bool:
    words = answer.split(" ")
    return len(words) == int(match["n"]) and set(words) <= set(match["choices"].split(" "))


def _joined(values) -> str:
    return " ".join(map(str, values))


# (prompt pattern, check of the answer), one per task generator; the free-text tasks have none.
TASKS: tuple[tuple[re.Pattern, Callable[[re.Match, str], bool]], ...] = (
    (re.compile(r"(?P<a>[0-9]+)\+(?P<b>[0-9]+)="), _exact(lambda m: str(int(m["a"]) + int(m["b"])))),
    (re.compile(r"(?P<a>[0-9]+)\*(?P<b>[0-9]+)="), _exact(lambda m: str(int(m["a"]) * int(m["b"])))),
    (
        re.compile(r"count from (?P<a>[0-9]+) to (?P<b>[0-9]+):"),
        _exact(lambda m: _joined(range(int(m["a"]), int(m["b"]) + 1))),
    ),
    (re.compile(r"reverse: (?P<words>\S+(?: \S+)*) ->"), _exact(lambda m: _joined(m["words"].split(" ")[::-1]))),
    (re.compile(r"sort (?P<digits>[0-9](?: [0-9])*):"), _exact(lambda m: _joined(sorted(m["digits"].split(" "))))),
    (re.compile(r"say (?P<word>\S+) (?P<n>[0-9]+) times:"), _exact(lambda m: _joined([m["word"]] * int(m["n"])))),
    (re.compile(r"walk from (?P<start>-?[0-9]+):"), _walk),
    (re.compile(r"pick (?P<n>[0-9]+) of (?P<choices>\S+ \S+ \S+):"), _pick),
)
