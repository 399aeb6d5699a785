"""Answer extraction and equivalence of math cloze answers (AGIEval `math`, `gaokao-mathcloze`).

Behaves as lm-evaluation-harness's `agieval/utils.py` (itself AGIEval's `post_process.py` and
Hendrycks et al.'s `math_equivalence.py`) so that `acc` equals the harness's per sample:

1. `extract_answer` takes the content of the last `\\boxed{..}`; else the last `$..$` span; else
   the text after the last "="; else the last number. Both the response and the gold answer
   go through it (lm-eval parses both sides; a bare-LaTeX gold such as `\\frac{1}{2}` is thus
   reduced to its last number, "2").
2. `normalize` strips LaTeX spacing, `\\left`/`\\right`, degrees, dollars, percent, right-hand
   units and spaces, and canonicalises fractions (`\\frac12`, `a/b`, `0.5`) and `\\sqrt3`.
3. `math_equivalent` compares the normalised strings; where normalising fails (nothing
   extracted, malformed `\\frac`/`\\sqrt`, two unit groups) it compares the extracted strings,
   as the harness does when its normaliser raises.
"""

from __future__ import annotations

import re

_DOLLAR_SPAN = re.compile(r"\$(.*)\$")
_NUMBER = re.compile(r"(?:\$)?\d+(?:\.\d+)?(?![\w\d])")


class NotNormalizable(ValueError):
    """An extracted answer the normaliser cannot canonicalise."""


def _last_boxed(text: str) -> str | None:
    """`\\boxed{...}` (balanced braces) starting at the last "\\boxed", or None."""
    start = text.rfind("\\boxed")
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def _boxed_content(boxed: str | None) -> str | None:
    """What a `\\boxed{...}` holds (the right-hand side of an equation in it), or None."""
    prefix = "\\boxed{"
    if boxed is None or not boxed.startswith(prefix) or not boxed.endswith("}"):
        return None
    answer = boxed[len(prefix) : -1]
    return answer.split("=")[-1].lstrip(" ") if "=" in answer else answer


def extract_answer(text: str) -> str | None:
    """The final answer written in `text` (None when there is none)."""
    if "\\boxed" in text:
        return _boxed_content(_last_boxed(text))
    spans = _DOLLAR_SPAN.findall(text)
    if spans:
        last = spans[-1]
        answer = last.split("=")[-1].lstrip(" ") if "=" in last else last
        if answer:
            return answer
    if "=" in text:
        answer = text.split("=")[-1].lstrip(" ").rstrip(".")
        # A literal backslash-n (as escaped in some model outputs) ends the answer.
        return answer.split("\\n")[0] if "\\n" in answer else answer
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _fix_fracs(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{2}` -> `\\frac{1}{2}`."""
    head, *pieces = text.split("\\frac")
    out = head
    for piece in pieces:
        out += "\\frac"
        if not piece:
            raise NotNormalizable("\\frac with nothing after it")
        if piece[0] == "{":
            out += piece
            continue
        if len(piece) < 2:
            return text
        numerator, denominator, rest = piece[0], piece[1], piece[2:]
        if denominator != "{":
            out += "{" + numerator + "}{" + denominator + "}" + rest
        else:
            out += "{" + numerator + "}" + denominator + rest
    return out


def _fix_a_slash_b(text: str) -> str:
    """`3/4` -> `\\frac{3}{4}` for plain integers."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def _remove_right_units(text: str) -> str:
    """Drops a trailing `\\text{ unit}`."""
    if "\\text{ " not in text:
        return text
    parts = text.split("\\text{ ")
    if len(parts) != 2:
        raise NotNormalizable("more than one \\text{ ...} unit group")
    return parts[0]


def _fix_sqrt(text: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`."""
    if "\\sqrt" not in text:
        return text
    head, *pieces = text.split("\\sqrt")
    out = head
    for piece in pieces:
        if not piece:
            raise NotNormalizable("\\sqrt with nothing after it")
        out += "\\sqrt" + piece if piece[0] == "{" else "\\sqrt{" + piece[0] + "}" + piece[1:]
    return out


def normalize(answer: str | None) -> str:
    """The canonical form of an extracted answer (NotNormalizable when there is none)."""
    if answer is None:
        raise NotNormalizable("no answer extracted")
    text = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "")
    text = text.replace("\\$", "")
    text = _remove_right_units(text)
    text = text.replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]  # "x = 3" -> "3"
    text = _fix_sqrt(text)
    text = text.replace(" ", "")
    text = _fix_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _fix_a_slash_b(text)


def math_equivalent(response: str, gold: str) -> bool:
    """Whether a generated answer equals the gold answer (lm-eval's agieval `is_equiv`)."""
    extracted, reference = extract_answer(response), extract_answer(gold)
    try:
        return normalize(extracted) == normalize(reference)
    except NotNormalizable:
        return extracted == reference
