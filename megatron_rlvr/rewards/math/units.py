"""The units an answer names, so that a different unit makes a different answer: `12 kJ` is not
`12 J`, `250 μm` is not `250 nm`, `4 cm^2` is not `4 cm`, `km/s` is not `m/s`, `25 K` is not
`25 °C`. A unit is read by name: its SI prefix, base unit and power (`kJ`, `cm^2`, `m s^-1`;
"square feet" is ft^2, "miles per hour" is mph is mi h^-1). Values in another unit are not
converted (`40 mm` for `4 cm` scores 0: graders disagree on it). A unit on one side only is
ignored: `12` and `12 \\text{ J}` both answer a gold of `12 \\mathrm{~J}`, as graders of Minerva
and GSM8K answers accept, and words that are not units ("48 cookies") are never units.

Units are read from math.latex's `\\TXT{…}` words (with the `^2`, `/` and `\\cdot` between them),
so a bare letter in math (`5m`) stays a variable. Everything here is one linear pass."""

from __future__ import annotations

import re

Signature = frozenset  # of sorted ((unit, power), ...) tuples, one per run of unit words

# symbols that take an SI prefix, and the prefixes (μ spelled u, \mu, µ or μ)
_PREFIXABLE = {"m", "g", "s", "J", "N", "W", "V", "A", "Pa", "Hz", "L", "eV", "mol", "K", "C", "F", "Wh", "cal", "Ω"}
_PREFIXES = {"k", "M", "G", "T", "m", "c", "d", "u", "n", "p"}
_MICRO = ("\\mu", "µ", "μ")
_SYMBOLS = {  # units without a prefix, and spellings of compound ones
    "min": (("min", 1),),
    "h": (("h", 1),),
    "hr": (("h", 1),),
    "hrs": (("h", 1),),
    "l": (("L", 1),),
    "ml": (("mL", 1),),
    "in": (("in", 1),),
    "ft": (("ft", 1),),
    "yd": (("yd", 1),),
    "mi": (("mi", 1),),
    "lb": (("lb", 1),),
    "lbs": (("lb", 1),),
    "oz": (("oz", 1),),
    "gal": (("gal", 1),),
    "atm": (("atm", 1),),
    "rpm": (("rpm", 1),),
    "mph": (("h", -1), ("mi", 1)),
    "kph": (("h", -1), ("km", 1)),
    "kmh": (("h", -1), ("km", 1)),
    "cc": (("cm", 3),),
    "degC": (("degC", 1),),
    "degF": (("degF", 1),),
}
_NAMES = {  # written-out names (singular, lower case) → symbol
    "meter": "m",
    "metre": "m",
    "gram": "g",
    "second": "s",
    "sec": "s",
    "joule": "J",
    "newton": "N",
    "watt": "W",
    "volt": "V",
    "ampere": "A",
    "amp": "A",
    "pascal": "Pa",
    "hertz": "Hz",
    "liter": "L",
    "litre": "L",
    "electronvolt": "eV",
    "mole": "mol",
    "kelvin": "K",
    "coulomb": "C",
    "farad": "F",
    "calorie": "cal",
    "minute": "min",
    "hour": "h",
    "day": "day",
    "week": "week",
    "month": "month",
    "year": "year",
    "inch": "in",
    "foot": "ft",
    "feet": "ft",
    "yard": "yd",
    "mile": "mi",
    "pound": "lb",
    "ounce": "oz",
    "gallon": "gal",
    "acre": "acre",
    "ton": "ton",
    "tonne": "t",
    "dollar": "dollar",
    "cent": "cent",
    "euro": "euro",
    "buck": "dollar",
    "ohm": "Ω",
    "celsius": "degC",
    "fahrenheit": "degF",
}
_NAME_PREFIXES = {"kilo": "k", "mega": "M", "giga": "G", "milli": "m", "centi": "c", "micro": "u", "nano": "n"}
_POWER_WORDS = {"square": 2, "sq": 2, "cubic": 3, "cu": 3}
_AFTER_POWER_WORDS = {"squared": 2, "cubed": 3}
_PER = {"per", "/"}


def _symbol(word: str) -> tuple | None:
    """A unit symbol, case as written (mJ is not MJ), → ((unit, power), ...)."""
    if word in _SYMBOLS:
        return _SYMBOLS[word]
    for micro in _MICRO:
        if word.startswith(micro) and word[len(micro) :].strip() in _PREFIXABLE:
            return (("u" + word[len(micro) :].strip(), 1),)
    if word in _PREFIXABLE:
        return ((word, 1),)
    if len(word) > 1 and word[0] in _PREFIXES and word[1:] in _PREFIXABLE:
        return ((word, 1),)
    return None


def _lower_symbols() -> dict[str, tuple]:
    """Lower-case spellings of symbols that name one unit only (KM, Kg, khz; never mj: mJ or MJ)."""
    spellings: dict[str, set] = {}
    for base in _PREFIXABLE:
        for prefix in ("", *_PREFIXES):
            spellings.setdefault((prefix + base).lower(), set()).add(prefix + base)
    found: dict[str, tuple] = {
        low: ((next(iter(names)), 1),) for low, names in spellings.items() if len(names) == 1 and len(low) > 1
    }
    found.update({low.lower(): units for low, units in _SYMBOLS.items()})
    return found


_LOWER = _lower_symbols()


def _named(word: str) -> tuple | None:
    """A written-out unit ("kilojoules", "Hours", "feet") → ((unit, power),)."""
    low = word.lower()
    for singular in (low, low[:-1] if low.endswith("s") else "", low[:-2] if low.endswith("es") else ""):
        if singular in _NAMES:
            return ((_NAMES[singular], 1),)
        for prefix, short in _NAME_PREFIXES.items():
            if singular.startswith(prefix) and singular[len(prefix) :] in _NAMES:
                base = _NAMES[singular[len(prefix) :]]
                if base in _PREFIXABLE:
                    return ((short + base, 1),)
    return None


def read_unit(word: str) -> tuple | None:
    """One unit word → ((unit, power), ...), or None when it names no unit."""
    return _symbol(word) or _named(word) or (_LOWER.get(word.lower()) if len(word) > 1 else None)


_RUN = re.compile(  # \TXT{...} words with the powers, quotients and products between them
    r"\\TXT\{[^{}]*\}(?:\s*(?:\\TXT\{[^{}]*\}|\^\s*(?:\{\s*-?\d+\s*\}|-?\d)|/|\\cdot|\*))*"
)
_PIECE = re.compile(r"\^\s*\{?\s*(-?\d+)\s*\}?|/|(?:\\mu\s*|[µμ])?[A-Za-zΩ]+|[().,*]|\\cdot")


def _run_units(run: str) -> tuple:
    """The unit of one run of words ("kg m^2 / s^2" → kg m^2 s^-2): read up to its first word
    that is not a unit ("cm of ribbon" is cm; "cookies" is nothing)."""
    text = re.sub(r"\\TXT\{([^{}]*)\}", r" \1 ", run)
    powers: dict[str, int] = {}
    sign, pending, last, first = 1, 1, None, True
    pieces = list(_PIECE.finditer(text))
    for at, piece in enumerate(pieces):
        exponent, token = piece.group(1), piece.group(0)
        if exponent is not None:
            if last is not None:
                for unit, power in last:
                    powers[unit] += sign * power * (int(exponent) - 1)
            continue
        if token.lower() in _PER:
            sign = -1
            continue
        if token in ("(", ")", ".", ",", "*", "\\cdot") or token.lower() in ("degree", "degrees"):
            continue
        if token.lower() in _POWER_WORDS:
            pending = _POWER_WORDS[token.lower()]
            continue
        if token.lower() in _AFTER_POWER_WORDS and last is not None:
            for unit, power in last:
                powers[unit] += sign * power * (_AFTER_POWER_WORDS[token.lower()] - 1)
            continue
        unit_of = read_unit(token)
        following = pieces[at + 1].group(0) if at + 1 < len(pieces) else ""
        if unit_of is None or (token == "in" and (not first or following.isalpha() and following != "per")):
            break  # "cm of ribbon", "hours in total", "in total": the unit ends here
        last = tuple((unit, power * pending) for unit, power in unit_of)
        for unit, power in last:
            powers[unit] = powers.get(unit, 0) + sign * power
        pending, first = 1, False
    return tuple(sorted((unit, power) for unit, power in powers.items() if power))


_CURRENCIES = (
    ("dollar", re.compile(r"\\\$")),
    ("euro", re.compile(r"\\euro|\u20ac")),
    ("GBP", re.compile(r"\\pounds|\u00a3")),
)


def signature(cleaned: str, raw: str) -> Signature:
    """The units a cleaned answer names, one entry per run of unit words; a currency sign in
    the raw answer (\\$, €, £) is a unit of its own when no other unit is named."""
    found = {units for units in (_run_units(run.group(0)) for run in _RUN.finditer(cleaned)) if units}
    if not found:
        found = {((name, 1),) for name, sign in _CURRENCIES if sign.search(raw)}
    return frozenset(found)


def is_unit_text(content: str) -> bool:
    """Whether a \\text{}/\\mathrm{} content is a unit expression and nothing else ("m/s^2",
    "kg \\cdot m^2", "J/(mol K)"), to be kept as words and never read as variables."""
    content = content.replace("\\cdot", " ")
    words = re.findall(r"(?:\\mu\s*|[µμ])?[A-Za-zΩ]+", content)
    rest = re.sub(r"(?:\\mu\s*|[µμ])?[A-Za-zΩ]+|\^\s*\{?\s*-?\d+\s*\}?|[\s/()*.]", "", content)
    return bool(words) and not rest and all(read_unit(w) or w.lower() in _PER for w in words)
