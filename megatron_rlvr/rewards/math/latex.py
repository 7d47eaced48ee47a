"""String cleanup before parsing: unicode math to LaTeX, LaTeX sugar and spacing away,
thousands separators joined, `\\text{}` sorted into units (kept as words for math.units), connectives ("or",
"and"), answer words (kept as `\\TXT{…}`) and formatting (unwrapped). Regex passes only,
each linear in the answer's length."""

from __future__ import annotations

import re

from megatron_rlvr.rewards.math.forms import rewrite_forms
from megatron_rlvr.rewards.math.text import MAX_ANSWER_CHARS, AnswerError, matching_brace
from megatron_rlvr.rewards.math.units import is_unit_text

_UNICODE = {
    "\u2212": "-",
    "\u2013": "-",
    "\u2014": "-",
    "\u00d7": r"\times ",
    "\u00f7": r"\div ",
    "\u00b7": r"\cdot ",
    "\u22c5": r"\cdot ",
    "\u2219": r"\cdot ",
    "\u2264": r"\le ",
    "\u2265": r"\ge ",
    "\u2260": r"\ne ",
    "\u03c0": r"\pi ",
    "\u221e": r"\infty ",
    "\u00b0": r"^\circ ",
    "\u222a": r"\cup ",
    "\u2229": r"\cap ",
    "\u2208": r"\in ",
    "\u2205": r"\emptyset ",
    "\u211d": r"\mathbb{R}",
    "\u00b1": r"\pm ",
    "\u2213": r"\mp ",
    "\u27e8": r"\langle ",
    "\u27e9": r"\rangle ",
    "\u2223": "|",
    "\u03b8": r"\theta ",
    "\u03b1": r"\alpha ",
    "\u03b2": r"\beta ",
    "\u03c6": r"\phi ",
    "\u2026": r"\ldots ",
    "\u00a0": " ",
    "\u2009": " ",
    "\u202f": " ",
    "\u2032": "'",
    "\u2248": r"\approx ",
    "\u00bd": r"\frac{1}{2}",
    "\u2153": r"\frac{1}{3}",
    "\u2154": r"\frac{2}{3}",
    "\u00bc": r"\frac{1}{4}",
    "\u00be": r"\frac{3}{4}",
    "\u2155": r"\frac{1}{5}",
    "\u2159": r"\frac{1}{6}",
    "\u215b": r"\frac{1}{8}",
    "\u2156": r"\frac{2}{5}",
    "\u2157": r"\frac{3}{5}",
    "\u2158": r"\frac{4}{5}",
    "\u215a": r"\frac{5}{6}",
    "\u215c": r"\frac{3}{8}",
    "\u215d": r"\frac{5}{8}",
    "\u215e": r"\frac{7}{8}",
    "\u2150": r"\frac{1}{7}",
    "\u2151": r"\frac{1}{9}",
    "\u2152": r"\frac{1}{10}",
    "\u2044": "/",
    "\u2033": "''",
    "\u066b": ".",  # Arabic decimal separator: ٣٫٥ is 3.5
    "\u066c": ",",  # Arabic thousands separator
}
_SUPERSCRIPT = dict(zip("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207b", "0123456789-"))
_SUPERSCRIPTS = re.compile("[" + "".join(_SUPERSCRIPT) + "]+")
_UNICODE_CHARS = re.compile("[" + "".join(_UNICODE) + "]")
_UNICODE_ROOT = re.compile(r"([\u221a\u221b\u221c])\s*(\d+(?:\.\d+)?|[a-zA-Z]|\\[a-zA-Z]+)?")
_ROOT_COMMANDS = {"\u221a": r"\sqrt", "\u221b": r"\sqrt[3]", "\u221c": r"\sqrt[4]"}


def _unicode_to_latex(s: str) -> str:
    s = _SUPERSCRIPTS.sub(lambda m: "^{" + "".join(_SUPERSCRIPT[c] for c in m.group(0)) + "}", s)
    s = _UNICODE_ROOT.sub(lambda m: _ROOT_COMMANDS[m.group(1)] + ("{" + m.group(2) + "}" if m.group(2) else ""), s)
    return _UNICODE_CHARS.sub(lambda m: _UNICODE[m.group(0)], s)


_WRAPPERS = re.compile(
    r"\\(?:displaystyle|textstyle|scriptstyle|limits|nolimits|big|Big|bigg|Bigg)[lr]?(?![a-zA-Z])"
    r"|\\(?:left|right)\s*(?:\.|(?=[^a-zA-Z]))|\\(?:left|right)(?=\\)|\$|\\[()\[\]]"
)
_SPACES = re.compile(r"\\[,;:> ]|\\q?quad|\\enspace|~|\\hspace\*?\{[^{}]*\}|\\!|\\mkern\d*mu")
_THOUSANDS_BRACE = re.compile(r"(?<=\d)(?:\{,\}|,\\!\s*)(?=\d{3})")  # 1{,}000 and MATH's 1,\!000, 1,\! 000
_THOUSANDS_THIN = re.compile(r"(?<=\d)(?:\\[,;: !]|~)(?=\d{3}(?!\d))")
_THOUSANDS_SPACE = re.compile(r"(?<![\d.,])\d{1,3}(?: \d{3})+(?!\d|\.\d)")
_THOUSANDS_COMMA = re.compile(r"(?<![\d.,])-?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?(?![\d,])")  # never 0,111
_FRAC_ALIASES = re.compile(r"\\[dtc]frac(?![a-zA-Z])")
_BINOM_ALIASES = re.compile(r"\\[dt]binom(?![a-zA-Z])")
_DEGREES = re.compile(  # braces only in pairs: {90^\circ} keeps its group's closing brace
    r"(?:\{\s*\})?\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])"
    r"|\^\s*(?:\{\s*\\text\{\s*o\s*\}\s*\}|\\text\{\s*o\s*\})"
)
_TEMPERATURE = re.compile(  # 25^\circ C, 25^\circ\mathrm{C}, 77^\circ\text{F}: a unit, not an angle
    r"\\deg\s*(?:\\(?:text|mathrm|textrm|rm)\s*\{\s*~?\s*([CF])\s*\}|\{\s*\\rm\s*([CF])\s*\}|([CF])(?![A-Za-z]))"
)
_MICRO_UNIT = re.compile(r"\\mu\s*\\TXT\{\s*(m|g|s|A|L|J|W|V|F|C|mol|eV)\s*\}")  # 250\,\mu\text{m}
_PERCENT = re.compile(r"\\?%")
_CURRENCY = re.compile(r"\\\$|\\euro|[\u20ac\u00a3]|\\pounds")
_TEXT_COMMAND = re.compile(
    r"\\(text|textbf|textit|textrm|textsf|texttt|textnormal|textup|mathrm|mathbf|mathit|mathsf|mathtt|mathnormal|"
    r"mbox|boldsymbol|bm|operatorname|mathbb|mathcal|emph|hbox)\s*\{([^{}]*)\}"
)
_FONT_GROUP = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mathsf|mbox|boldsymbol|bm)\s*(?=\{)"
)
_SCIENTIFIC_X = re.compile(r"(?<=\d)\s*[xX]\s*(?=10\s*\^)")  # 3 x 10^8
_REPEATING_PARENS = re.compile(r"(\d\.\d*)\((\d+)\)")  # 0.(3), 0.1(6)
_REPEATING_DOTS = re.compile(r"(\d\.)(\d++)\s*+(?:\.\.\.|\\[lc]?dots)")  # 0.333..., 0.1666\ldots


def _repeating(match: re.Match) -> str:
    """0.1666... → 0.16\\overline{6}: the run of one digit (three or more) that the dots extend."""
    digits = match.group(2)
    run = len(digits) - len(digits.rstrip(digits[-1]))
    if run < 3:
        return match.group(0)
    return match.group(1) + digits[: len(digits) - run + 1] + "\\overline{" + digits[-1] + "}"


_MIXED_PLAIN = re.compile(r"(?<![\d.\\])(\d+) +(\d+)/(\d+)(?![\d.])")
_CONNECTIVES = {"or": r" \TXT{or} ", "and": r" \TXT{and} "}
KNOWN_FUNCTIONS = {
    "sin",
    "cos",
    "tan",
    "cot",
    "sec",
    "csc",
    "arcsin",
    "arccos",
    "arctan",
    "sinh",
    "cosh",
    "tanh",
    "log",
    "ln",
    "exp",
    "sqrt",
    "pi",
    "cis",
    "lg",
}
_TWO_LETTER_WORDS = {
    "cm",
    "km",
    "mm",
    "ft",
    "kg",
    "mg",
    "hr",
    "lb",
    "oz",
    "mi",
    "yd",
    "ml",
    "no",
    "in",
    "of",
    "is",
    "to",
    "on",
}  # never "by" or "at": ax + by, v + at
_WORD = re.compile(r"(?<![\\a-zA-Z])([a-zA-Z]{2,})(?![a-zA-Z{])")
_PROTECTED = re.compile(r"(\\(?:TXT|begin|end)\{[^{}]*\})")
_MATH_FONTS = {"mathrm", "mathbf", "mathit", "mathsf", "mathtt", "boldsymbol", "bm"}


def _text_command(match: re.Match) -> str:
    """One innermost \\text-like command → its content inline, a connective, or a \\TXT word."""
    command, raw = match.group(1), match.group(2)
    content = raw.replace("~", " ").strip()
    before = match.string[max(0, match.start() - 8) : match.start()].rstrip()
    if (
        command in _MATH_FONTS
        and re.fullmatch(r"[A-Za-z]", content)
        and content not in "ei"
        and (
            raw.lstrip().startswith("~")
            or before[-1:].isdigit()
            or before[-1:] in ("}", "/")
            or before.endswith("\\cdot")
        )
    ):
        return r" \TXT{" + content + "} "  # 8 \mathrm{~m}, 5\mathrm{g}, \mathrm{m}/\mathrm{s}: a unit
    if command == "mathbb":
        return r"\reals " if content == "R" else r"\TXT{" + content + "}"
    if content in KNOWN_FUNCTIONS:  # \operatorname{cis}, \text{cis}, \mathrm{sin}
        return " \\" + content + " "
    lowered = content.lower().strip(" ,.")
    if not content:
        return " "
    if lowered in _CONNECTIVES:
        return _CONNECTIVES[lowered]
    single_letter = re.fullmatch(r"[A-Za-z]", content)
    if single_letter and command not in _MATH_FONTS and content not in "ABCDE":
        return r" \TXT{" + content + "} "  # \text{ m}: a unit
    if re.search(r"[/^]|\\cdot", content) and is_unit_text(content):
        return r" \TXT{" + content + "} "  # \mathrm{~m/s^2}, \mathrm{kg \cdot m^2}: units, not variables
    if re.fullmatch(
        r"[\d\s.,+\-*/^=<>()\[\]|\\{}]*|\(?[A-Za-z]\)?|\(?[A-Za-z]\)\s*\S.*|.*\d.*", content.replace(" ", "")
    ):
        return " " + content + " "  # formatting around math: \mathbf{12}, \textbf{(C) }, \text{5 meters}
    return r" \TXT{" + content + "} "


def _word(match: re.Match) -> str:
    word = match.group(1)
    lowered = word.lower()
    if lowered in KNOWN_FUNCTIONS:
        return word
    if lowered in _CONNECTIVES:
        return _CONNECTIVES[lowered]
    before = match.string[max(0, match.start() - 1) : match.start()]
    if len(word) == 2 and lowered not in _TWO_LETTER_WORDS:
        return word  # xy, ab: a product of two variables
    if before and (before.isdigit() or before in ")}") and lowered not in _TWO_LETTER_WORDS:
        return word  # 2xyz: a product
    return r"\TXT{" + word + "}"


def _over_to_frac(s: str) -> str:
    r"""{a \over b} → \frac{a}{b}, {n \choose k} → \binom{n}{k} (innermost group first)."""
    for _ in range(50):
        match = re.search(r"\\(over|choose)(?![a-zA-Z])", s)
        if not match:
            return s
        start = s.rfind("{", 0, match.start())
        depth, i = 0, match.start()
        while i > 0:  # the '{' that encloses the command
            i -= 1
            if s[i] == "}":
                depth += 1
            elif s[i] == "{":
                if depth == 0:
                    break
                depth -= 1
        start = i if s[i : i + 1] == "{" else -1
        if start < 0:  # no enclosing group: the whole answer is the fraction
            head, tail = s[: match.start()], s[match.end() :]
            s = "{" + head + match.group(0) + tail + "}"
            continue
        end = matching_brace(s, start)
        head, tail = s[start + 1 : match.start()], s[match.end() : end]
        command = r"\frac" if match.group(1) == "over" else r"\binom"
        s = s[:start] + command + "{" + head + "}{" + tail + "}" + s[end + 1 :]
    raise AnswerError("too_deep")


def clean(answer: str) -> str:
    """An extracted answer as plain parseable LaTeX (see the module docstring)."""
    s = answer
    if len(s) > MAX_ANSWER_CHARS:
        raise AnswerError("too_long")
    s = s.replace("\\\\", r" \cr " if r"\begin" in s else " ")  # matrix rows; elsewhere a stray line break
    s = _CURRENCY.sub(" ", s)
    s = _WRAPPERS.sub(" ", s)  # before unicode: √\left(x+1\right) is √(x+1)
    s = _unicode_to_latex(s).replace("**", "^")
    s = rewrite_forms(s)
    s = _SCIENTIFIC_X.sub(r" \\times ", s)
    s = _REPEATING_PARENS.sub(r"\1\\overline{\2}", s)
    s = _REPEATING_DOTS.sub(_repeating, s)
    s = _FRAC_ALIASES.sub(r"\\frac", s)
    s = _BINOM_ALIASES.sub(r"\\binom", s)
    s = _THOUSANDS_BRACE.sub("", s)
    s = _THOUSANDS_THIN.sub("", s)
    s = _DEGREES.sub(r" \\deg ", s)
    s = _TEMPERATURE.sub(lambda m: r" \TXT{deg" + (m.group(1) or m.group(2) or m.group(3)) + "} ", s)
    s = _PERCENT.sub(r" \\pct ", s)
    s = _SPACES.sub(" ", s)
    for _ in range(20):
        s, n = _TEXT_COMMAND.subn(_text_command, s)
        if not n:
            break
    s = _MICRO_UNIT.sub(r"\\TXT{\\mu \1}", s)
    s = _FONT_GROUP.sub("", s)  # \mathbf{\frac{1}{2}}: the font of a group that holds math
    s = _over_to_frac(s)
    s = _MIXED_PLAIN.sub(
        lambda m: m.group(0)
        if int(m.group(2)) >= int(m.group(3))
        else rf"{m.group(1)}\frac{{{m.group(2)}}}{{{m.group(3)}}}",
        s,
    )
    s = _THOUSANDS_SPACE.sub(lambda m: m.group(0).replace(" ", ""), s)
    if not re.search(r",(?!\d{3})", s) and not re.search(r"[(\[]|\\\{|\\langle", s):
        s = _THOUSANDS_COMMA.sub(lambda m: m.group(0).replace(",", ""), s)
    s = "".join(part if k % 2 else _WORD.sub(_word, part) for k, part in enumerate(_PROTECTED.split(s)))
    s = " ".join(s.split())
    return s.rstrip(" .,;:").lstrip(" ,;:=").strip()
