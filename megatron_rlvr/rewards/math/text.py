"""Where the final answer of a response is: the last \\boxed{} (several boxes joined only by
"and", "or", commas or "x =" labels form one answer; two boxes around "alternatively" are a
hedge and stay together, so a hedged response is never right), else a closing "the answer is"
sentence or a GSM8K "####" line, else the last math span or number. Everything here is linear
in the response length: a megabyte of text costs milliseconds, never a hang."""

from __future__ import annotations

import re

MAX_ANSWER_CHARS = 3000  # a 100-digit integer or a long written-out sum fits; a megabyte does not
MAX_GROUP = 12  # boxes that together form one answer
MAX_GAP = 300  # characters between two boxes that can still belong to one answer


class AnswerError(Exception):
    """A verdict reached before comparison; `reason` is the counted category."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def matching_brace(text: str, open_at: int, limit: int = MAX_ANSWER_CHARS) -> int:
    """Index of the brace closing text[open_at] == '{' (escaped \\{ \\} \\\\ count as text);
    looks at most `limit` characters ahead."""
    depth = 0
    end = min(len(text), open_at + limit + 2)
    i = open_at
    while i < end:
        ch = text[i]
        if ch == "\\":  # \{ \} \\ are text, never a group's braces
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise AnswerError("too_long" if end < len(text) else "unbalanced_braces")


_BOX = re.compile(r"\\(?:boxed|fbox)\b")


def box_at(text: str, start: int) -> tuple[str, int]:
    """(content, end) of the box command starting at text[start] ('\\boxed{…}' or '\\boxed 5')."""
    box = _BOX.match(text, start)
    assert box is not None, "start comes from box_starts()"
    i = start + len(box.group(0))
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        close = matching_brace(text, i)
        content = text[i + 1 : close]
        inner = last_boxed(content)  # \boxed{\boxed{5}}
        return (inner if inner is not None else content), close + 1
    match = re.match(r"[^\s$]+", text[i : i + MAX_ANSWER_CHARS])
    return (match.group(0) if match else ""), i + (match.end() if match else 0)


def box_starts(text: str) -> list[int]:
    """Start indices of the last MAX_GROUP * 2 box commands, last first."""
    starts: list[int] = []
    end = len(text)
    while len(starts) < MAX_GROUP * 2:
        at = max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))
        if at < 0:
            break
        if _BOX.match(text, at):
            starts.append(at)
        end = at
    return starts


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{…} or \\fbox{…}, or None."""
    starts = box_starts(text)
    return box_at(text, starts[0])[0] if starts else None


# text between two boxes that makes them one answer: "$ and $x = ", "\), \(", "\quad \text{or} \quad"
_GAP_NOISE = re.compile(r"\\text\s*\{\s*(and|or)\s*\}|\\[()\[\]]|\\q?quad|\\[,;:! ]|[$~,;]|\\\\")
# possessive runs: a gap that is not one answer's join fails in one pass, not by retrying splits
_JOINING_GAP = re.compile(  # "and", "or", "x =", and one word before "and" ("\boxed{1} papers and \boxed{2}")
    r"(?:\s*+(?:and|or|[a-zA-Z](?:_\{?[A-Za-z0-9]++\}?)?\s*+=|(?<![a-zA-Z])[a-zA-Z]++\s++(?=and\b)))*\s*", re.IGNORECASE
)
_HEDGE = re.compile(r"\b(?:alternatively|or|maybe|perhaps|possibly|could also be|might also be|otherwise)\b", re.I)
_PARTS = re.compile(r"\bpart\s*\(?[a-z0-9]\b", re.I)  # answers to parts (a) and (b) are one answer
_CORRECTION = re.compile(r"\b(?:wait|actually|mistake|re-?check|correct|error|instead|oops|however|rather|no)\b", re.I)


def _final_boxes(text: str) -> list[str]:
    """The contents of the boxes that form the final answer (one, or several joined)."""
    starts = box_starts(text)
    try:
        last_content, last_end = box_at(text, starts[0])
    except AnswerError as err:  # \boxed{\frac{120}{ and then the token limit
        raise AnswerError("no_final_answer" if err.reason == "unbalanced_braces" else err.reason) from None
    group = [last_content]
    group_start = starts[0]
    group_starts = [starts[0]]
    for at in starts[1:]:
        try:
            content, end = box_at(text, at)
        except AnswerError:  # a broken earlier box does not spoil the last one
            break
        if end > group_start:  # \boxed{\boxed{5}}: the same answer
            group_start = at
            continue
        gap = text[end:group_start]
        if len(gap) > MAX_GAP or len(group) >= MAX_GROUP:
            break
        joined = _JOINING_GAP.fullmatch(_GAP_NOISE.sub(" ", gap))
        hedged = _HEDGE.search(gap) and not _CORRECTION.search(gap)
        if not (joined or hedged or _PARTS.search(gap)):
            break
        group.append(content)
        group_start = at
        group_starts.append(at)
    return _as_point(text, group[::-1], group_starts[::-1], last_end)


_LABEL = re.compile(r"(?<![\\a-zA-Z])([a-zA-Z])\s*=(?:\$|\\\(|\s)*$")  # "y = $" before a box
_MATH_CLOSERS = re.compile(r"^(?:\\\)|\\\]|\$|\s)+")


def _strip_openers(text: str) -> str:
    """text less the blanks, `$`, `\\(` and `\\[` it ends with (a loop: a pattern anchored at the
    end would retry every position of a long blank run)."""
    while True:
        stripped = text.rstrip()
        for opener in ("\\(", "\\[", "$"):
            stripped = stripped.removesuffix(opener)
        if stripped == text:
            return text
        text = stripped


def _as_point(text: str, contents: list[str], starts: list[int], end: int) -> list[str]:
    """Several boxes that spell one point: `(\\boxed{3}, \\boxed{-2})` is "(3, -2)"; boxes labelled
    with distinct names (`a = \\boxed{1}`, `b = \\boxed{4}`) keep their labels."""
    if len(contents) < 2:
        return contents
    before = _strip_openers(text[max(0, starts[0] - 20) : starts[0]])
    after = _MATH_CLOSERS.sub("", text[end : end + 20])
    if before.endswith(("(", "\\left(")) and after.startswith((")", "\\right)")):
        return ["(" + ", ".join(contents) + ")"]
    found = [_LABEL.search(text[max(0, at - 20) : at]) for at in starts]
    labels = [label.group(1) for label in found if label is not None]
    if len(labels) == len(contents) and len(set(labels)) == len(labels):
        return [f"{label} = {content}" for label, content in zip(labels, contents)]
    return contents


_ANSWER_IS = re.compile(  # no two adjacent unbounded repeats: linear on any text
    r"(?:final answer|the answer|answers?|(?:solutions?|roots?|zeros?) (?:of [^.\n$]{1,60} )?)[ \t]*"
    r"(?:\*\*[ \t]*)?(?:is|are|:|=)",
    re.IGNORECASE,
)
_FINAL_ANSWER_LINE = re.compile(r"Final Answer:[ \t]*The final answer is")  # Minerva's closing line
_CORRECTED = re.compile(  # "The answer is 7. Wait, actually it should be 8.": the stated answer, corrected
    r"\b(?:wait|actually|oops|sorry|no)\b[^.\n$]{0,40}?\b(?:should be|should have been|is actually|must be)\b",
    re.IGNORECASE,
)
_MATH_SPAN = re.compile(  # an escaped \$ inside is a dollar sign, never the span's end: $\\$18$
    r"(?<!\\)\$\$((?:\\.|[^\\]){1,3000}?)\$\$|(?<!\\)\$((?:\\.|[^\\$]){1,3000}?)\$"
    r"|\\\(((?:(?!\\[()]).){1,3000}?)\\\)|\\\[((?:(?!\\[\[\]]).){1,3000}?)\\\]",  # never across an opener
    re.DOTALL,
)
_SENTENCE_END = re.compile(
    r"\.(?:\s|$)|\n|;\s|(?<![ \t]),?[ \t]+(?:since|because|which|as|so|where|when|for|but)\b"
    r"|(?<![ \t])[ \t]+(?:[\u2014\u2013]|--)[ \t]"  # "15 — the smallest such integer"
    r"|(?<![ \t])[ \t]*\((?=(?:i\.e\.|e\.g\.|[A-Za-z]{2,}[ \t,])(?!(?:pi|sin|cos|tan|ln|log|exp|sqrt)\b))"  # 12 (since 3 x 4 = 12)
)
_FILLER = re.compile(  # "the answer is therefore the number 42"
    r"(?:(?:therefore|thus|hence|so|then|simply|just|exactly|indeed|clearly|now|the|number|value|equal to|"
    r"given by)\s+)+",
    re.IGNORECASE,
)
# "7 (seven) apples": words and separators alternate, so no two repeats can split one run of
# letters between them (that nesting was exponential), and a try starts only where blanks start
_WORDS_IN_PARENS = re.compile(r"(?<![ \t])[ \t]*\([A-Za-z]{2,}(?:[ ,]+[A-Za-z]{2,})*[ ,]*\)")
_PLAIN_UNITS = {
    "m",
    "s",
    "km",
    "h",
    "hr",
    "hrs",
    "kg",
    "g",
    "mg",
    "cm",
    "mm",
    "N",
    "J",
    "W",
    "kW",
    "V",
    "Pa",
    "kPa",
    "Hz",
    "min",
    "sec",
    "ft",
    "in",
    "yd",
    "mi",
    "mph",
    "kph",
    "L",
    "mL",
    "ml",
    "lb",
    "lbs",
    "oz",
}
_NUMBER_AND_UNITS = re.compile(
    r"(?<![-+\d,.])([-+]?\d[\d,]*(?:\.\d+)?)[ \t]*([a-zA-Z]+(?:[ \t]*[/*^][ \t]*[a-zA-Z\d]+)*)"
)
_NUMBER = re.compile(  # never a digit inside a word (AZYUK2A); 1 000 000 is one number
    r"(?<![A-Za-z])(?:\d+'\s?\d+(?:''|\")|[-\u2212]?\d{1,3}(?: \d{3})++(?![\d.,])"
    r"|[-\u2212]?\d[\d,]*(?:\.\d+)?(?:/\d+)?|[-\u2212]?\.\d+)(?:\s?\\?%)?"
)
_LATEX_FRACTION = re.compile(r"-?\\[dt]?frac\{[^{}$\n]{1,40}\}\{[^{}$\n]{1,40}\}")  # \\frac{10}{9} outside $…$
_BOLD = re.compile(r"\*\*([^*\n]{1,200})\*\*")
_NO_SOLUTION = re.compile(r"no (?:real )?solutions?", re.IGNORECASE)
_STATED = re.compile(r"\s(?:is|are|equals|was)\s")  # "the largest n is 34": the value after the verb
_SPLIT = re.compile(r"(?<![ \t])[ \t]*\n")
_JOINED_SPANS = re.compile(r"(?:\s|,|;|\band\b|\bor\b|\bboth\b)*", re.IGNORECASE)


def _span_content(match: re.Match) -> str:
    return next(g for g in match.groups() if g is not None)


def _after_answer_is(tail: str) -> list[str]:
    """The answer that a closing 'the answer is' / '####' starts, up to the end of its sentence
    (a full stop inside $…$ does not end it): the math spans there when only "and", "or" and
    commas join them ("$x=1$ and $x=5$"), else the first span, else the plain text."""
    tail = tail[: MAX_ANSWER_CHARS + 200].lstrip(" \t*:\n")
    tail = re.sub(r"^either\s+", "", tail, flags=re.IGNORECASE)
    filler = _FILLER.match(tail)
    tail = tail[filler.end() :] if filler else tail
    spans = list(_MATH_SPAN.finditer(tail))
    masked = list(tail)
    for span in spans:
        masked[span.start() : span.end()] = "$" * (span.end() - span.start())
    end = _SENTENCE_END.search("".join(masked))
    sentence = tail[: end.start()] if end else tail
    spans = [span for span in spans if span.end() <= len(sentence)]
    if spans and spans[0].start() == 0:
        between = [sentence[a.end() : b.start()] for a, b in zip(spans, spans[1:])]
        if spans[-1].end() == len(sentence.rstrip()) and all(_JOINED_SPANS.fullmatch(g) for g in between):
            return [_span_content(span) for span in spans]
        return [_span_content(spans[0])]
    answer = _WORDS_IN_PARENS.sub("", sentence).strip().strip("*").strip()
    stated = None
    for stated in _STATED.finditer(answer):  # noqa: B007 (the loop keeps the last match)
        pass
    if stated is not None and stated.end() < len(answer):
        answer = answer[stated.end() :].strip()  # "Final Answer: The largest $n$ is 34."
    return [_plain_units(answer)] if answer else []


def _plain_units(answer: str) -> str:
    """A number with units typed as plain text ("4.5 m/s", "36 cm^2") → the units in
    \\text{}, so that they are read as units and never as variables."""
    match = _NUMBER_AND_UNITS.fullmatch(answer)
    if match and all(w in _PLAIN_UNITS for w in re.findall(r"[a-zA-Z]+", match.group(2))):
        units = re.sub(r"[a-zA-Z]+", lambda w: "\\text{" + w.group(0) + "}", match.group(2))
        return f"{match.group(1)} {units}"
    return answer


_END_OF_TURN = re.compile(r"<\|(?:im_end|im_start|endoftext|eot_id|end_of_text)\|>")


def _own_turn(text: str) -> str:
    """The response up to the first end-of-turn token that follows some text: what a model
    writes after `<|im_start|>user` is the next turn, not its answer."""
    for part in _END_OF_TURN.split(text, maxsplit=8):
        if part.strip():
            return part
    return text


def _strip_thinking(text: str) -> str:
    """Drafts inside <think>…</think> are not answers: what follows the last </think> is. A
    response that opens <think> and never closes it was cut off while reasoning."""
    at = text.rfind("</think>")
    if at >= 0:
        if not text[at + 8 :].strip():
            raise AnswerError("no_final_answer")  # thought, then stopped before answering
        return text[at + 8 :]
    if "<think>" in text:
        raise AnswerError("no_final_answer")
    return text


MIN_CUT_CHARS = 100  # a short reply without a full stop is terse, not cut off
_OPEN_END = re.compile(r"(?:[=+\-*/^(\[{,:]|\\(?:times|cdot|frac|sqrt))\s*+(?:\$\s*+)?$")


def _cut_off(text: str) -> bool:
    """Whether a response with no stated answer stops mid-sentence or mid-formula, as one cut
    by a token limit does: on a word, an operator, an open bracket, a comma or a colon."""
    tail = text[-200:].rstrip()
    if len(text.strip()) < MIN_CUT_CHARS:
        return False
    return tail[-1:].isalpha() or _OPEN_END.search(tail) is not None


def extract_answers(response: str) -> list[str]:
    """The final answer of a response, as one string or several that form it together.
    Raises AnswerError("no_answer") when there is none."""
    text = _strip_thinking(_own_turn(response))
    starts = box_starts(text)
    closing = None
    for closing in _FINAL_ANSWER_LINE.finditer(text):  # noqa: B007 (the loop keeps the last match)
        pass
    tail = text[closing.end() : closing.end() + MAX_ANSWER_CHARS].lstrip() if closing is not None else ""
    if closing is not None and (not starts or closing.start() > starts[0]) and tail[:1] in ("$", "-", *"0123456789"):
        stated = _after_answer_is(tail)
        if stated:  # "Final Answer: The final answer is $X$." after the last box states the answer anew
            return stated
    if starts:
        return _final_boxes(text)
    answer_at = None
    for answer_at in _ANSWER_IS.finditer(text):  # noqa: B007 (the loop keeps the last match)
        pass
    if answer_at is not None:
        for correction in _CORRECTED.finditer(text, answer_at.end()):
            answer_at = correction
    hashes = text.rfind("####")
    if hashes >= 0 and (answer_at is None or hashes > answer_at.start()):
        found = _after_answer_is(text[hashes + 4 :])
    elif answer_at is not None:
        found = _after_answer_is(text[answer_at.end() :])
        if not found and not text[answer_at.end() :].strip():
            raise AnswerError("no_final_answer")  # "Therefore, the final answer is" and nothing
    else:
        found = []
    if not found and _cut_off(text):
        raise AnswerError("no_final_answer")
    return found or [_last_math_or_number(text)]


def _last_math_or_number(text: str) -> str:
    """The last number, or the last $…$ span when that holds the last number or comes after it
    (searched in the response's tail only, so unclosed spans cannot make this quadratic)."""
    text = text[-4 * MAX_ANSWER_CHARS :]
    number = span = bold = None
    for number in _NUMBER.finditer(text):  # noqa: B007 (the loop keeps the last match)
        pass
    for span in _MATH_SPAN.finditer(text):  # noqa: B007 (the loop keeps the last match)
        pass
    for bold in _BOLD.finditer(text):  # noqa: B007 (the loop keeps the last match)
        pass
    fraction = None
    for fraction in _LATEX_FRACTION.finditer(text):  # noqa: B007 (the loop keeps the last match)
        pass
    if (
        bold is not None
        and bold.group(1).rstrip()[-1:] != ":"
        and not text.startswith(":", bold.end())
        and all(other is None or bold.end() >= other.end() for other in (number, span))
    ):
        return bold.group(1)  # "The winner is **Devon**." (a heading ends with a colon)
    if span is not None and (number is None or span.end() >= number.end()):
        if (span.group(2) is not None or span.group(3) is not None) and _SPLIT.match(_span_content(span)):
            raise AnswerError("split_inline_math")  # "$\n 9 \n$": an inline formula is one line
        return _span_content(span)
    if fraction is not None and number is not None and fraction.end() >= number.end():
        return fraction.group(0)
    if number is None:
        nothing = _NO_SOLUTION.search(text[-300:])
        if nothing:  # "There are no real solutions."
            return r"\text{" + nothing.group(0) + "}"
        raise AnswerError("no_answer")
    return number.group(0)


def gold_answer(gold: str) -> str:
    """The gold answer as a dataset stores it: the last box, the tail of a GSM8K '####'
    solution, or the whole string."""
    if box_starts(gold):  # boxes that form one answer, as in a response: $\\boxed{1}, \\boxed{2}$
        return ", ".join(_final_boxes(gold))
    hashes = gold.rfind("####")
    if hashes >= 0:
        return gold[hashes + 4 :].strip()
    if len(gold) > MIN_CUT_CHARS and _ANSWER_IS.search(gold):  # a worked solution: its stated answer
        return ", ".join(extract_answers(gold))
    return gold
