"""verl's rollout-rejection options and thresholds, parsed without torch (the config checks them)."""

from __future__ import annotations

from dataclasses import dataclass

RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


@dataclass(frozen=True)
class RejectionRule:
    """One rejection criterion: `option` in RS_OPTIONS; k1 options keep lower ≤ w-bound ≤ upper
    (compared as verl does, on −log w against log lower and log upper), k2/k3 keep stat ≤ upper."""

    option: str
    upper: float
    lower: float | None = None


def parse_rejection(options: str | None, thresholds: str | float | None) -> tuple[RejectionRule, ...]:
    """verl's `rollout_rs` / `rollout_rs_threshold` strings → rules: options comma-separated;
    one threshold for all or one per option; a k1 threshold is "lower_upper" or an upper u
    (lower 1/u), the others a single upper bound. Raises ValueError naming what is wrong."""
    if options is None:
        return ()
    names = list(dict.fromkeys(part.strip() for part in options.split(",") if part.strip()))
    if not names:
        raise ValueError("rollout_rs names no option")
    for name in names:
        if name not in RS_OPTIONS:
            raise ValueError(f"rollout_rs option {name!r}: expected one of {', '.join(RS_OPTIONS)}")
    if thresholds is None:
        raise ValueError("rollout_rs is set but rollout_rs_threshold is not")
    specs = [str(thresholds)] if isinstance(thresholds, int | float) else [p.strip() for p in thresholds.split(",")]
    specs = [s for s in specs if s]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold has {len(specs)} entries: give one, or one per option ({len(names)})")
    specs = specs * len(names) if len(specs) == 1 else specs
    rules = []
    for name, spec in zip(names, specs, strict=True):
        try:
            if name.endswith("k1"):
                low_text, _, up_text = spec.partition("_") if "_" in spec else ("", "", spec)
                upper = float(up_text)
                lower = float(low_text) if low_text else 1.0 / upper
            elif "_" in spec:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: a single upper bound (no '_')")
            else:
                upper, lower = float(spec), None
        except ZeroDivisionError:
            raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: must be positive") from None
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: need 0 < lower <= upper")
        rules.append(RejectionRule(name, upper, lower))
    return tuple(rules)
