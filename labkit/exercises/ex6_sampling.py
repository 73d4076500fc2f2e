"""Checks for exercise 6, sampling (Sampler.sample_rows): temperature, top-k, top-p, driven by one uniform per row.

A row's token is a function of its logits, its parameters and its uniform number, so a case sweeps the
uniform over a fine grid: the tokens drawn, and how often, are the row's sampling distribution, which
must equal labkit's. A token the filters should have removed is named outright, unless it is what a walk against
the uniform alone (not scaled by the kept mass) falls through to, which is named as that. One case hands the rows
over on a GPU, or on torch's data-less meta device without one, as the engine does on a GPU: a tensor the sampler
makes without ``device=logits.device`` is then on another device than the rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from labkit.exercises.framework import Case, Exercise, Mismatch, property_case, showing, shown

GRID = [(i + 0.5) / 400 for i in range(400)]  # uniforms, away from every boundary that matters here
PROBS = [0.5, 0.3, 0.15, 0.05]  # the default row: token 0 is the most likely


def _rows(
    logits: list[list[float]], params: list[tuple[float, int, float]], uniforms: list[float], device: str = "cpu"
) -> dict[str, Any]:
    """sample_rows' arguments for a batch, as the engine hands them over: tensors on ``device``."""
    import torch

    return dict(
        logits=torch.tensor(logits, dtype=torch.float32, device=device),
        temperature=torch.tensor([p[0] for p in params], dtype=torch.float32, device=device),
        top_k=torch.tensor([p[1] for p in params], device=device),
        top_p=torch.tensor([p[2] for p in params], dtype=torch.float32, device=device),
        uniform=torch.tensor(uniforms, dtype=torch.float64, device=device),
    )


def _draw(
    sampler: Any,
    logits: list[list[float]],
    params: list[tuple[float, int, float]],
    uniforms: list[float],
    device: str = "cpu",
) -> list[int]:
    import torch

    result = sampler.sample_rows(**_rows(logits, params, uniforms, device))
    if not isinstance(result, torch.Tensor) or tuple(result.shape) != (len(logits),):
        kind = f"a tensor of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else _kind(result)
        want = f"a ({len(logits)},) tensor of token ids, one per row"
        raise Mismatch(shown(), want, f"{kind}: {result!r}", _return_hint(kind))
    return [int(t) for t in result.tolist()]


def _kind(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _return_hint(kind: str) -> str:
    """What to return, said against the wrong ``kind`` of value that came back."""
    hint = f"return a (rows,) tensor of token ids, not {kind}"
    if kind in ("a list", "a tuple"):
        return f"{hint} (torch.tensor(...) makes one)"
    if kind == "None":
        return f"{hint} (a function that ends without a return statement returns None)"
    if kind.startswith("a tensor"):
        return f"{hint}: one token id per row of logits, e.g. .squeeze(1) of a (rows, 1) one"
    return hint


def _shares(tokens: list[int]) -> dict[int, float]:
    return {t: round(tokens.count(t) / len(tokens), 3) for t in sorted(set(tokens))}


def _by_uniform(tokens: list[int]) -> str:
    """Which token each stretch of the uniform sweep draws: "[0, 0.4) -> 1, [0.4, 0.7) -> 3, ..."."""
    runs, start = [], 0
    for i in range(1, len(tokens) + 1):
        if i == len(tokens) or tokens[i] != tokens[start]:
            runs.append(f"[{start / len(tokens):g}, {i / len(tokens):g}) -> {tokens[start]}")
            start = i
    return "uniform " + ", ".join(runs)


def _sweep(cls: Any, probs: list[float], params: tuple[float, int, float]) -> tuple[str, list[int], list[int]]:
    """The case's text, and the tokens the learner's sampler and labkit's draw for every uniform of the grid."""
    from labkit.runtime.sampling import Sampler

    temperature, top_k, top_p = params
    text = (
        f"logits = log({probs}) (softmax = those probabilities)\n"
        f"temperature={temperature}, top_k={top_k}, top_p={top_p}; uniform swept over {len(GRID)} values in (0, 1)"
    )
    showing(text)
    batch = _grid([math.log(p) for p in probs], params)
    sampler = cls()
    got = _draw(sampler, *batch)
    _check_repeatable(text, sampler, batch, got)
    return text, got, _draw(Sampler(), *batch)


def _grid(logits: list[float], params: tuple[float, int, float]) -> tuple[list, list, list[float]]:
    """A batch of one row per uniform in GRID, each with the same logits and parameters: the row's distribution."""
    return [logits] * len(GRID), [params] * len(GRID), GRID


def _check_repeatable(text: str, sampler: Any, batch: tuple[Any, Any, Any], got: list[int]) -> None:
    """Mismatch if ``sampler`` draws other tokens for ``batch`` on a second call: then its tokens are not a function
    of the uniforms it is given, and every other hint would blame the wrong step."""
    if _draw(sampler, *batch) != got:
        raise Mismatch(text, "the same tokens on every call", "other tokens on a second call", RANDOM_HINT)


def _alone_fails(cls: Any, probs: list[float], prerequisites: Sequence[tuple[str, tuple[float, int, float]]]) -> str:
    """A note naming the first simpler setting (a case of its own) that the sampler already gets wrong; else ""."""
    from labkit.runtime.sampling import Sampler

    for case, params in prerequisites:
        batch = _grid([math.log(p) for p in probs], params)
        if _draw(cls(), *batch) != _draw(Sampler(), *batch):
            return (
                f"With (temperature, top_k, top_p)={params} alone your sampler already draws otherwise than"
                f' labkit\'s: fix that first (the case "{case}" checks that step alone), then check again; this'
                " case only checks the order of the steps. "
            )
    return ""


class FallThrough(NamedTuple):
    """A sweep explained by a walk against the uniform alone: every uniform above the kept ``mass`` drew ``token``.
    ``ambiguous``: a filter that keeps ``token`` too, with a walk against uniform times the kept mass, draws the
    same tokens (it is the next token in probability order, and the two masses add up to 1)."""

    token: int
    mass: float
    ambiguous: bool


def _kept(logits: list[float], params: tuple[float, int, float]) -> tuple[list[int], list[bool], list[list[float]]]:
    """The row's tokens in order of decreasing probability, which of them labkit keeps, and their probabilities
    before top-p: as labkit has them after top-k (renormalised by its softmax), and as the softmax of the tempered
    logits gives them (renormalised by nothing)."""
    import torch

    temperature, top_k, top_p = params
    sorted_logits, ids = torch.tensor(logits, dtype=torch.float32).sort(descending=True, stable=True)
    sorted_logits = (sorted_logits - sorted_logits[0]) / temperature
    tempered = sorted_logits.softmax(dim=-1)
    if top_k > 0:
        sorted_logits[top_k:] = float("-inf")
    probs = sorted_logits.softmax(dim=-1)
    keep = ((probs.cumsum(dim=-1) - probs < top_p) & (probs > 0)).tolist()
    return ids.tolist(), keep, [probs.double().tolist(), tempered.double().tolist()]


def _walk(ids: list[int], probs: list[float], scale: float) -> list[int | None]:
    """The token each uniform of GRID draws walking ``probs`` (in ``ids``' order) against uniform times ``scale``:
    None where the walk falls through, -1 where the target is too close to a cumulative probability to tell."""
    cdf, total = [], 0.0
    for p in probs:
        total += p
        cdf.append(total)
    drawn: list[int | None] = []
    for uniform in GRID:
        target = uniform * scale
        if any(abs(target - c) < 1e-5 for c in cdf):
            drawn.append(-1)
            continue
        index = next((i for i, c in enumerate(cdf) if c > target), None)
        drawn.append(None if index is None else ids[index])
    return drawn


def _agrees(got: list[int], drawn: list[int | None], by_share: bool) -> set[int] | None:
    """The tokens ``got`` has where ``drawn`` falls through, when it agrees with ``drawn`` everywhere else (by
    shares only, with ``by_share``: among equal probabilities the order is the sort's choice); else None."""
    fell = {t for t, d in zip(got, drawn, strict=True) if d is None}
    pairs = [(t, d) for t, d in zip(got, drawn, strict=True) if d is not None and d != -1]
    if by_share:
        same = sorted(_shares([t for t, _ in pairs]).values()) == sorted(_shares([d for _, d in pairs]).values())
    else:
        same = all(t == d for t, d in pairs)
    return fell if same else None


def _unscaled_fall_through(
    logits: list[float], params: tuple[float, int, float], got: list[int], by_share: bool = False
) -> FallThrough | None:
    """How the learner's tokens for the GRID's uniforms are what a walk against the uniform alone gives, not against
    uniform times the kept mass: below the kept mass the kept token whose cumulative probability first exceeds
    the uniform, above it one token for all (wherever the walk falls through to). None when they are not, or
    nothing is cut (the kept mass is 1)."""
    ids, keep, candidates = _kept(logits, params)
    num_kept = sum(keep)  # the first num_kept tokens in probability order
    for probs in candidates:
        kept = [p if k else 0.0 for p, k in zip(probs, keep, strict=True)]
        mass = sum(kept)
        fell = _agrees(got, _walk(ids, kept, 1.0), by_share)
        if mass > 1 - 1e-6 or fell is None or len(fell) != 1:
            continue
        token = fell.pop()
        ambiguous = False
        if num_kept < len(ids) and token == ids[num_kept]:  # one more token kept, and the walk scaled, draws alike?
            wider = [*kept[:num_kept], probs[num_kept], *kept[num_kept + 1 :]]
            ambiguous = _agrees(got, _walk(ids, wider, sum(wider)), by_share) == set()
        return FallThrough(token, mass, ambiguous)
    return None


def _rescale_hint(token: int, mass: float, expected: list[int]) -> str:
    """RESCALE_HINT, after what a walk against the uniform alone drew above the kept ``mass``."""
    drew = f"for every uniform above the kept mass, {mass:.3g}, your sampler drew token {token}"
    if token in expected:
        walk = "as a walk against the uniform alone does when it falls through to the last kept token"
        return f"{drew}, {walk}; {RESCALE_HINT}"
    return (
        f"{drew}, which the filters remove: that is what a walk against the uniform alone does, where no kept token's"
        f" cumulative probability exceeds such a uniform. {RESCALE_RULE[0].upper()}{RESCALE_RULE[1:]}"
    )


def distribution_case(
    name: str,
    hint: str,
    probs: list[float],
    temperature: float,
    top_k: int,
    top_p: float,
    prerequisites: Sequence[tuple[str, tuple[float, int, float]]] = (),
) -> Case:
    """``prerequisites``: (case name, params) of simpler settings on the same ``probs``, each checked by a case of
    its own; when the sampler gets one of those wrong alone, the failure says so before its own hint."""

    def run(cls: Any) -> None:
        params = (temperature, top_k, top_p)
        text, got, expected = _sweep(cls, probs, params)
        if got != expected and (first := _alone_fails(cls, probs, prerequisites)):
            want, have = f"tokens drawn with shares {_shares(expected)}", f"shares {_shares(got)}"
            raise Mismatch(text, want, have, first + hint)
        # Right alone on a simpler setting that cuts too, a walk against the uniform alone would have failed it.
        cut_alone = any(k > 0 or p < 1 for _, (_, k, p) in prerequisites)
        fell = None if cut_alone else _unscaled_fall_through([math.log(p) for p in probs], params, got)
        if got != expected and fell is not None and not fell.ambiguous:
            want, have = f"tokens drawn with shares {_shares(expected)}", f"shares {_shares(got)}"
            raise Mismatch(text, want, have, _rescale_hint(fell.token, fell.mass, expected))
        if got != expected:
            removed = sorted(set(got) - set(expected))
            note = f"your sampler drew token(s) {removed}, which the filters remove. " if removed else ""
            if removed and fell is not None:  # a filter that keeps it, or a walk that falls through to it
                note = (
                    f"your sampler drew token(s) {removed}, which the filters remove: either a filter keeps it, or"
                    f" your walk compares with the uniform alone, not uniform times the kept mass ({fell.mass:.3g}),"
                    " and falls through to it. "
                )
            missing = sorted(set(expected) - set(got))
            note += f"It never drew token(s) {missing}, which should stay. " if missing else ""
            if _shares(got) != _shares(expected):
                want, have = f"tokens drawn with shares {_shares(expected)}", f"shares {_shares(got)}"
                if set(got) == set(expected) and len(set(expected)) < len(probs):  # the filters kept the right ones
                    raise Mismatch(text, want, have, RESCALE_HINT)
            else:  # every token as often as it should, but for other uniforms: the walk's order is wrong
                want, have = _by_uniform(expected), _by_uniform(got)
                note += "Each token is drawn as often as it should be, but for other uniform values. "
            raise Mismatch(text, want, have, note + hint)

    return Case(name, run, hint)


def tie_case(name: str, hint: str, probs: list[float], top_k: int, top_p: float, fewer_hint: str = "") -> Case:
    """Equal probabilities at a filter's edge: how many tokens the filter keeps, and how often each is drawn.

    Which of the equal tokens stay is the sort's choice (labkit's keeps the lowest ids), so only the shares,
    sorted, are compared. Equal probabilities make equal logits, exactly, in any float precision.
    """

    def run(cls: Any) -> None:
        text, tokens, reference_tokens = _sweep(cls, probs, (1.0, top_k, top_p))
        got, expected = sorted(_shares(tokens).values()), sorted(_shares(reference_tokens).values())
        if got != expected:
            want = f"{len(expected)} of the {len(probs)} tokens drawn, shares {expected}"
            have = f"{len(got)} of the {len(probs)} tokens drawn, shares {got}"
            fell = _unscaled_fall_through([math.log(p) for p in probs], (1.0, top_k, top_p), tokens, by_share=True)
            if fell is not None and not fell.ambiguous:
                raise Mismatch(text, want, have, _rescale_hint(fell.token, fell.mass, reference_tokens))
            if len(got) == len(expected):
                raise Mismatch(text, want, have, RESCALE_HINT)
            raise Mismatch(text, want, have, fewer_hint if len(got) < len(expected) and fewer_hint else hint)

    return Case(name, run, hint)


BOUNDARIES = [i / 8 for i in range(8)]  # every other one equals a cumulative probability of four equal tokens


def _exact_boundaries(cls: Any) -> None:
    """Four equal logits (probabilities 0.25, exact in any float precision) and uniforms i / 8: half of them fall
    exactly on a cumulative probability. Which of the equal tokens comes first is the sort's choice, so only the
    shares, sorted, are compared: a strict walk draws each token for 2 of the 8 uniforms."""
    from labkit.runtime.sampling import Sampler

    text = (
        "logits = [0.0, 0.0, 0.0, 0.0] (softmax = [0.25, 0.25, 0.25, 0.25] exactly)\ntemperature=1.0, top_k=0,"
        f" top_p=1.0; uniform = each of {BOUNDARIES}"
    )
    showing(text)
    batch = [[0.0] * 4] * len(BOUNDARIES), [(1.0, 0, 1.0)] * len(BOUNDARIES), BOUNDARIES
    sampler = cls()
    got = _draw(sampler, *batch)
    _check_repeatable(text, sampler, batch, got)
    expected = _draw(Sampler(), *batch)
    if sorted(_shares(got).values()) != sorted(_shares(expected).values()):
        raise Mismatch(text, _by_uniform(expected), _by_uniform(got), BOUNDARY_HINT)


def _batch_invariance(cls: Any) -> None:
    rows = [
        ([0.0, 1.0, 2.0, 0.5, -1.0], (0.7, 0, 1.0), 0.3),
        ([3.0, 0.0, 0.0, 2.9, 1.0], (1.0, 2, 1.0), 0.9),
        ([1.0, 1.0, 1.0, 1.0, 1.0], (1.5, 0, 0.5), 0.55),
        ([-2.0, 4.0, 0.1, 0.2, 3.5], (0.5, 3, 0.8), 0.2),
        ([0.0] * 5, (1.0, 0, 1.0), 0.5),  # five equal tokens: a shared generator repeats this row's 1 time in 5
    ]
    calls = 10  # so a sampler on a shared generator draws the same tokens on every call less than once in 5**9
    text = (
        f"{len(rows)} rows with different logits, (temperature, top_k, top_p) and uniforms, drawn together"
        f" {calls} times and one by one"
    )
    showing(text)
    sampler = cls()
    batch = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    together = _draw(sampler, *batch)
    hint = (
        "use only the uniform you are given, one per row: no torch.multinomial or torch.rand (a shared random"
        " generator makes a row's token depend on the other rows and on earlier calls)"
    )
    for _ in range(calls - 1):
        if (again := _draw(sampler, *batch)) != together:
            raise Mismatch(text, f"the same tokens on every call: {together}", f"{together} then {again}", hint)
    alone = [_draw(sampler, [r[0]], [r[1]], [r[2]])[0] for r in rows]
    if together != alone:
        from labkit.runtime.sampling import Sampler

        # Right alone but not together: the rows' parameters are mixed up, not the random numbers.
        per_row = alone == _draw(Sampler(), *batch)
        raise Mismatch(
            text,
            f"the same tokens in a batch as alone: {alone}",
            f"{together} in the batch",
            PER_ROW_HINT if per_row else hint,
        )


# Logits far from 0, as a model's can be: at temperature 0.25 they are [100, 99.6, 0], and exp(100) is inf in float32.
LARGE_LOGITS = [25.0, 24.9, 0.0]
LARGE_PARAMS = (0.25, 0, 1.0)


def _large_logits(cls: Any) -> None:
    """LARGE_LOGITS swept over GRID must draw as labkit's sampler does (token 0 about 60% of the time, token 1 40%).

    A sampler that is wrong on the same logits shifted to a largest of 0 is told to fix that first: its mistake
    is not the overflow."""
    from labkit.runtime.sampling import Sampler

    temperature, top_k, top_p = LARGE_PARAMS
    scaled = [round(x / temperature, 3) for x in LARGE_LOGITS]
    text = (
        f"logits = {LARGE_LOGITS}\ntemperature={temperature} (logits / temperature = {scaled}), top_k={top_k},"
        f" top_p={top_p}; uniform swept over {len(GRID)} values in (0, 1)"
    )
    showing(text)
    sampler = cls()
    batch = _grid(LARGE_LOGITS, LARGE_PARAMS)
    got, expected = _draw(sampler, *batch), _draw(Sampler(), *batch)
    if got == expected:
        return
    _check_repeatable(text, sampler, batch, got)
    want, have = f"tokens drawn with shares {_shares(expected)}", f"shares {_shares(got)}"
    shifted = _grid([x - max(LARGE_LOGITS) for x in LARGE_LOGITS], LARGE_PARAMS)
    if _draw(cls(), *shifted) != _draw(Sampler(), *shifted):
        hint = (
            "your sampler draws otherwise than labkit's even with these logits shifted to a largest of 0"
            f" ({[round(x - max(LARGE_LOGITS), 3) for x in LARGE_LOGITS]}, the same probabilities), so its mistake is"
            " not the size of the logits: fix the cases above first"
        )
        raise Mismatch(text, want, have, hint)
    raise Mismatch(text, want, have, OVERFLOW_HINT)


SETTINGS = [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 2, 1.0), (1.0, 0, 0.75), (2.0, 3, 0.9)]


def _own_parameters(cls: Any) -> None:
    """One batch holding a uniform sweep for each of several (temperature, top_k, top_p): each must draw as alone."""
    from labkit.runtime.sampling import Sampler

    logits = [math.log(p) for p in PROBS]
    text = (
        f"logits = log({PROBS}) in every row; one batch of {len(SETTINGS)} x {len(GRID)} rows: for each"
        f" (temperature, top_k, top_p) in {SETTINGS}, the uniform swept over {len(GRID)} values"
    )
    showing(text)
    params = [setting for setting in SETTINGS for _ in GRID]
    batch = [logits] * len(params), params, GRID * len(SETTINGS)
    sampler = cls()
    got, expected = _draw(sampler, *batch), _draw(Sampler(), *batch)
    if got != expected:
        _check_repeatable(text, sampler, batch, got)
    for i, setting in enumerate(SETTINGS):
        rows = slice(i * len(GRID), (i + 1) * len(GRID))
        if got[rows] != expected[rows]:
            want = f"rows with {setting}: tokens drawn with shares {_shares(expected[rows])}"
            alone = _grid(logits, setting)
            if _draw(cls(), *alone) != _draw(Sampler(), *alone):  # not a mix-up of rows: the setting itself
                hint = (
                    f"rows with {setting} draw otherwise than labkit's even in a batch of their own, so this is not"
                    " about mixing up rows: fix the case above with the same temperature, top_k and top_p first"
                )
                raise Mismatch(text, want, f"shares {_shares(got[rows])}", hint)
            raise Mismatch(text, want, f"shares {_shares(got[rows])}", PER_ROW_HINT)


DEVICE_UNIFORMS = GRID[::40]  # a few uniforms per setting: every step runs, in a batch small enough to loop over


def _on_device(cls: Any) -> None:
    """The rows of SETTINGS, a few uniforms each, handed over on another device than the CPU, as the engine does on
    a GPU: on CUDA where there is one, whose tokens must be labkit's there too.

    Without a GPU they go on the ``meta`` device: tensors with a shape and a device but no data, so a tensor the
    sampler makes without ``device=`` lands on the CPU, and mixing it with the rows raises in every op, as on a GPU
    (:func:`labkit.exercises.meta_device.run_on_meta`). Meta has no values to give: a sampler that reads one on the
    host (.item(), .tolist(), a Python ``if`` on a tensor) is checked up to that read, and passes there."""
    import torch

    from labkit.exercises.meta_device import META_NOTE, run_on_meta
    from labkit.runtime.sampling import Sampler

    params = [setting for setting in SETTINGS for _ in DEVICE_UNIFORMS]
    batch = [[math.log(p) for p in PROBS]] * len(params), params, DEVICE_UNIFORMS * len(SETTINGS)
    device = "cuda" if torch.cuda.is_available() else "meta"
    text = (
        f"logits = log({PROBS}) in every row; for each (temperature, top_k, top_p) in {SETTINGS},"
        f" {len(DEVICE_UNIFORMS)} uniforms in (0, 1); every tensor on {device}"
    )
    if device == "cuda":
        showing(text)
        got, expected = _draw(cls(), *batch, device=device), _draw(Sampler(), *batch, device=device)
        if got != expected:
            raise Mismatch(text, f"labkit's tokens on cuda, {expected}", f"{got}", CUDA_HINT)
        return
    showing(text.replace("every tensor on meta", "on the CPU, before the same on meta"))
    _draw(cls(), *batch)  # on the CPU first: a stub, or the sampler's own error, is reported as itself
    showing(f"{text}, {META_NOTE}")
    run_on_meta(lambda: cls().sample_rows(**_rows(*batch, device=device)))


def _strategy() -> Any:
    """A row's logits, its (temperature, top_k, top_p) and its uniform.

    The logits are distinct: among equal probabilities the walk's order is the sort's choice (any order draws
    each token as often), so ties have a case of their own that compares shares. top_k stays within the
    vocabulary, as in the engine, whose Sampler.sample clamps it before calling sample_rows.
    """
    from hypothesis import strategies as st

    logits = st.lists(st.integers(-30, 30).map(lambda v: v / 10), min_size=2, max_size=8, unique=True)
    temperature, top_p = st.sampled_from([0.25, 0.5, 1.0, 2.0]), st.sampled_from([0.1, 0.45, 0.7, 0.95, 1.0])
    row = logits.flatmap(lambda row: st.tuples(st.just(row), st.tuples(temperature, st.integers(0, len(row)), top_p)))
    return st.tuples(row, st.integers(1, 99).map(lambda v: v / 100)).map(lambda drawn: (*drawn[0], drawn[1]))


def _property(cls: Any, example: Any) -> None:
    from labkit.runtime.sampling import Sampler

    logits, params, uniform = example
    text = f"logits={logits}, (temperature, top_k, top_p)={params}, uniform={uniform}"
    showing(text)
    # The row 16 times over: one right sampler draws one token for all, while one that ignores the uniform and
    # draws at random would match labkit's token by chance on a single row.
    batch = [logits] * 16, [params] * 16, [uniform] * 16
    expected = _draw(Sampler(), *batch)
    sampler = cls()
    got = _draw(sampler, *batch)
    if got != expected:
        sweep = _grid(logits, params)
        swept = _draw(sampler, *sweep)
        _check_repeatable(text, sampler, sweep, swept)
        wrong = next(token for token in got if token != expected[0])
        fell = _unscaled_fall_through(logits, params, swept)
        unscaled = fell is not None and not fell.ambiguous
        hint = _rescale_hint(fell.token, fell.mass, _draw(Sampler(), *sweep)) if unscaled else STEPS_HINT
        raise Mismatch(text, f"token {expected[0]}", f"token {wrong}", hint)


DEVICE_HINT = (
    "make every tensor you create on logits.device: torch.arange(vocab, device=logits.device), likewise"
    " torch.full/zeros/tensor(..., device=logits.device), or torch.zeros_like(logits) and logits.new_full(...),"
    " which take it from logits. On a GPU the engine hands you CUDA tensors, and one made without device= is on the"
    ' CPU: mixing the two raises "Expected all tensors to be on the same device"'
)
CUDA_HINT = (
    "on the GPU your sampler draws other tokens than labkit's for rows it draws right on the CPU (the cases"
    " above): look for a step whose result depends on where it runs, e.g. a sort without stable=True, or the walk's"
    " cumulative sum kept in float32 (labkit's sums in float64)"
)
PER_ROW_HINT = (
    "each row has its own temperature, top_k and top_p: use row i's values for row i (e.g. logits /"
    " temperature[:, None], and a cut-off per row for top_k and top_p), never the first row's for all"
)
RANDOM_HINT = (
    "your sampler drew other tokens for the same logits, parameters and uniforms on a second call: use only the"
    " uniform you are given, one per row, no torch.multinomial or torch.rand (a shared random generator makes a"
    " row's token depend on the other rows and on earlier calls)"
)
TEMPERATURE_HINT = "divide the logits by the temperature before the softmax: below 1 sharpens, above 1 flattens"
TOP_K_HINT = "keep the top_k most likely tokens (all of them when top_k == 0), renormalise, then draw"
TOP_K_TIE_HINT = (
    "keep exactly top_k tokens, by rank in the sorted order (e.g. mask positions >= top_k after sorting), not"
    " every token at least as likely as the k-th: here the second, third and fourth tokens tie at 0.2, and"
    " top_k=2 keeps one of them (which one does not matter here)"
)
TOP_K_FEWER_HINT = (
    "your sampler keeps fewer than top_k tokens: keep the first top_k of the sorted order (positions 0 to"
    " top_k - 1, e.g. mask positions >= top_k), not top_k - 1"
)
TOP_P_HINT = (
    "sort by probability and keep the smallest prefix whose mass reaches top_p: a token is dropped when the"
    " mass before it is already >= top_p (the most likely token always stays)"
)
TOP_P_FEWER_HINT = (
    "your sampler keeps fewer tokens than labkit's: a token stays while the mass before it is below top_p, so"
    " the token whose own probability carries the mass to top_p or beyond stays (here the second 0.25, which"
    " brings the mass to exactly 0.5)"
)
TOP_P_TIE_HINT = (
    "the mass before the third token is exactly 0.5 == top_p: the first two already reach top_p, so the third is"
    " dropped. Drop a token when the mass before it is >= top_p, not > (which of the equally likely tokens"
    " stay does not matter here)"
)
RESCALE_RULE = (
    "the kept tokens' probabilities add up to less than 1 once top-k or top-p has cut some, so take the first token"
    " whose cumulative probability exceeds uniform times the kept mass (or renormalise the kept probabilities"
    " first); against the uniform alone, every uniform above the kept mass falls through the walk"
)
RESCALE_HINT = f"the filters keep the right tokens, but they are drawn in other proportions: {RESCALE_RULE}"
OVERFLOW_HINT = (
    "with these logits shifted to a largest of 0 your sampler draws as labkit's, so the size of the logits breaks"
    " it: exp(100) overflows float32 to inf, and inf / inf is NaN. Subtract each row's largest logit before exp"
    " (logits - logits.amax(dim=-1, keepdim=True)), which leaves the probabilities as they are, or use"
    " torch.softmax, which does"
)
STRICT_CDF = (
    "take the first token whose cumulative probability exceeds uniform times the kept mass, strictly"
    " (torch.searchsorted needs right=True)"
)
CDF_HINT = (
    "walk the kept tokens in order of decreasing probability, not in vocabulary order: sort the probabilities"
    f" descending (keeping the token ids, e.g. torch.sort's indices), cumsum them and {STRICT_CDF}."
    " Each token's share is the same in either"
    " order, but not the token a given uniform draws, and a seeded request must draw labkit's tokens"
)
BOUNDARY_HINT = (
    f"{STRICT_CDF}: a cumulative probability equal to it picks the next token (cdf > target, not cdf >= target;"
    " searchsorted's default, right=False, finds the first cdf >= target). Here the cumulative probabilities are"
    " exactly 0.25, 0.5, 0.75 and 1, so uniform 0.25 draws the second token, and each token is drawn for 2 of"
    " the 8 uniforms"
)
TOP_P_ORDER_HINT = (
    "take top_p's cumulative mass in decreasing probability, not in vocabulary order: sort first (keeping the"
    " token ids, e.g. torch.sort's indices), then drop a token when the mass of the more likely tokens before it"
    " is already >= top_p. Cut in vocabulary order, the nucleus is whichever tokens come first, not the most likely"
)
STEPS_HINT = (
    "labkit's steps, in order: divide the logits by the temperature; keep the top_k most likely; softmax; keep"
    " the top_p nucleus of what is left; walk the kept tokens in decreasing probability until the cumulative"
    " probability exceeds uniform times the kept mass"
)
CASES = [
    distribution_case(
        "temperature 1 draws each token with its softmax probability",
        "softmax the logits, sort descending, and pick the first token whose cumulative probability exceeds"
        " uniform (inverse CDF)",
        PROBS,
        1.0,
        0,
        1.0,
    ),
    distribution_case(
        "the inverse CDF walks the tokens in decreasing probability",
        CDF_HINT,
        [0.1, 0.4, 0.2, 0.3],
        1.0,
        0,
        1.0,
    ),
    Case("a cumulative probability equal to the target draws the next token", _exact_boundaries, BOUNDARY_HINT),
    distribution_case("temperature below 1 sharpens the distribution", TEMPERATURE_HINT, PROBS, 0.5, 0, 1.0),
    distribution_case("temperature above 1 flattens the distribution", TEMPERATURE_HINT, PROBS, 2.0, 0, 1.0),
    distribution_case("top_k keeps the k most likely tokens", TOP_K_HINT, [0.1, 0.4, 0.2, 0.3], 1.0, 2, 1.0),
    distribution_case("top_p keeps the smallest nucleus that reaches top_p", TOP_P_HINT, PROBS, 1.0, 0, 0.75),
    distribution_case("top_p always keeps the most likely token", TOP_P_HINT, PROBS, 1.0, 0, 0.01),
    distribution_case(
        "top_p keeps the most likely tokens, wherever they sit in the vocabulary",
        TOP_P_ORDER_HINT,
        [0.1, 0.4, 0.2, 0.3],
        1.0,
        0,
        0.75,
        prerequisites=[("the inverse CDF walks the tokens in decreasing probability", (1.0, 0, 1.0))],
    ),
    tie_case(
        "top_k keeps exactly k tokens, even among equal ones",
        TOP_K_TIE_HINT,
        [0.4, 0.2, 0.2, 0.2],
        top_k=2,
        top_p=1.0,
        fewer_hint=TOP_K_FEWER_HINT,
    ),
    tie_case(
        "a nucleus whose mass equals top_p exactly keeps no further token",
        TOP_P_TIE_HINT,
        [0.25] * 4,
        top_k=0,
        top_p=0.5,
        fewer_hint=TOP_P_FEWER_HINT,
    ),
    distribution_case(
        "temperature comes first: the nucleus is taken from the tempered probabilities",
        "divide the logits by the temperature before everything else: at temperature 2 the probabilities"
        " [0.5, 0.3, 0.15, 0.05] flatten to about [0.38, 0.29, 0.21, 0.12], whose nucleus for top_p=0.75 is"
        " three tokens (the untempered one is two); the order in labkit is temperature, top_k, top_p",
        PROBS,
        2.0,
        0,
        0.75,
        prerequisites=[
            ("temperature above 1 flattens the distribution", (2.0, 0, 1.0)),
            ("top_p keeps the smallest nucleus that reaches top_p", (1.0, 0, 0.75)),
        ],
    ),
    distribution_case(
        "top_k, then top_p on the renormalised rest",
        "apply top_k first, renormalise what is left, then top_p on that: here top_k=2 leaves 0.4 and 0.3,"
        " renormalised 0.57 and 0.43, so top_p=0.5 keeps token 0 alone (top_p first, or on the probabilities"
        " before renormalising, keeps tokens 0 and 1); the order in labkit is temperature, top_k, top_p",
        [0.4, 0.3, 0.2, 0.1],
        1.0,
        2,
        0.5,
        prerequisites=[
            ("top_k keeps the k most likely tokens", (1.0, 2, 1.0)),
            ("top_p keeps the smallest nucleus that reaches top_p", (1.0, 0, 0.5)),
        ],
    ),
    Case("large logits: the softmax stays finite", _large_logits, OVERFLOW_HINT),
    Case("each row of a batch uses its own temperature, top_k and top_p", _own_parameters, PER_ROW_HINT),
    Case(
        "a row draws the same token alone and in a batch",
        _batch_invariance,
        "rows are independent: row i's token depends only on row i's logits, parameters and uniform",
    ),
    Case("rows on a GPU (or, without one, on meta) mix no devices", _on_device, DEVICE_HINT),
    property_case("random rows draw like labkit's sampler", _strategy, _property, hint=STEPS_HINT),
]


def _reference() -> Any:
    from labkit.runtime.sampling import Sampler

    return Sampler


EXERCISE = Exercise(
    number=6,
    after=("01",),
    slug="sampling",
    title="Sampling",
    export="MySampler",
    reference=_reference,
    cases=CASES,
    seams=("sample_rows",),
)
