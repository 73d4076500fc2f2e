"""Checks for exercise 9, a ranked waiting queue: shortest-first with ageing (``ShortestFirstQueue``).

Each queue case replays a short script of what the scheduler does to its waiting queue (requests arrive,
are admitted, preempted, finish) on the learner's queue and on labkit's, and compares what the queue holds,
in order, wherever the script looks; a property case draws such scripts at random. The last case serves a
long request under a stream of short ones on the simulated model, with each queue plugged into labkit's
scheduler, step by step: ageing must let the long request in.
"""

from __future__ import annotations

from typing import Any

from labkit.core.config import EngineConfig
from labkit.core.engine import Engine
from labkit.core.queues import AGEING, ShortestFirstQueue
from labkit.core.request import Request, SamplingParams
from labkit.core.scheduler import Scheduler
from labkit.core.sim import SimulatedModel
from labkit.exercises.engine_runs import history, step_text
from labkit.exercises.framework import Case, Exercise, Mismatch, property_case, showing

# ("add", id, prompt tokens, max_new_tokens, step), ("remove", id), ("requeue", id), ("forget", id),
# ("list",), ("len",), ("keys",) (the ids with a key in self._keys), ("key", id) (its key) or ("rank", id, step)
Op = tuple[Any, ...]


def scheduler_for(queue_cls: type[Any]) -> type[Scheduler]:
    """A Scheduler whose waiting queue is a ``queue_cls()``: what ``Engine(scheduler_cls=...)`` takes. Run it with
    ``EngineConfig(scheduling="shortest-first")``, so that everything else is as in labkit's own run."""

    def __init__(self: Scheduler, config: EngineConfig, allocator: Any) -> None:
        Scheduler.__init__(self, config, allocator)
        self.waiting = queue_cls()

    return type(f"{queue_cls.__name__}Scheduler", (Scheduler,), {"__init__": __init__})


# ------------------------------------------------------------------ scripts on a queue
def _ids(requests: Any) -> str:
    """Requests by id ("[r1, r0]"); anything else, such as a (key, request) entry, as itself."""
    shown = (f"r{r.request_id}" if isinstance(r, Request) else r if isinstance(r, str) else repr(r) for r in requests)
    return "[" + ", ".join(shown) + "]"


def _replay(cls: Any, ageing: float | None, ops: list[Op], name: str) -> tuple[list[Any], list[str]]:
    """Run ``ops`` on a fresh queue; return what each look at it answered (a rank as it came, the rest as text) and
    the script as text, one line an op."""
    queue = cls() if ageing is None else cls(ageing=ageing)
    text = [f"queue = {name}()" if ageing is None else f"queue = {name}(ageing={ageing})"]
    if ageing is None:
        text[0] += f"  # ageing={AGEING}"
    requests: dict[int, Request] = {}
    answers = []
    for op in ops:
        kind, *args = op
        if kind == "add":
            request_id, prompt, new, step = args
            requests[request_id] = Request(request_id, [2] * prompt, SamplingParams(max_new_tokens=new))
            text.append(f"queue.add(r{request_id}, step={step})  # {prompt} prompt + {new} new = {prompt + new} tokens")
        elif kind in ("remove", "requeue", "forget"):
            (request_id,) = args
            requests.setdefault(request_id, Request(request_id, [2], SamplingParams(max_new_tokens=1)))
            why = {"remove": "admitted", "requeue": "preempted: it waits again", "forget": "finished"}[kind]
            text.append(f"queue.{kind}(r{request_id})  # {why}")
        elif kind == "rank":
            request_id, step = args
            text.append(f"queue.rank(r{request_id}, step={step})")
        elif kind == "key":
            text.append(f"queue._keys[{args[0]}]  # r{args[0]}'s key")
        else:
            text.append({"list": "list(queue)", "len": "len(queue)", "keys": "the ids in queue._keys"}[kind])
        showing("\n".join(text))
        if kind == "add":
            queue.add(requests[args[0]], args[3])
        elif kind in ("remove", "requeue", "forget"):
            getattr(queue, kind)(requests[args[0]])
        elif kind == "rank":
            answers.append(queue.rank(requests[args[0]], args[1]))
        elif kind == "key":
            keys = getattr(queue, "_keys", None)
            answers.append(keys.get(args[0], "no key") if isinstance(keys, dict) else "no dict self._keys")
        elif kind == "list":
            answers.append(_ids(list(queue)))
            again = _ids(list(queue))
            if again != answers[-1]:  # the first look took requests out: every later look would say so otherwise
                raise Mismatch("\n".join([*text, "list(queue)"]), f"{answers[-1]} again", again, _ITER_HINT)
        elif kind == "len":
            try:
                answers.append(repr(len(queue)))
            except TypeError as error:  # __len__ returned something else than an int
                raise Mismatch("\n".join(text), "an int", f"len(queue) raised TypeError: {error}", _LEN_HINT) from None
        elif kind == "keys":
            keys = getattr(queue, "_keys", None)
            answers.append(_ids([f"r{k}" for k in sorted(keys)]) if isinstance(keys, dict) else "no dict self._keys")
        else:
            raise ValueError(f"no such op {kind!r}")
    return answers, text


def compare(cls: Any, ops: list[Op], hint: str, ageing: float | None = None) -> None:
    """Replay ``ops`` on ``cls`` and on labkit's ShortestFirstQueue; Mismatch at the first look that differs."""
    name = getattr(cls, "__name__", "queue")
    expected, text = _replay(ShortestFirstQueue, ageing, ops, name)
    got, _ = _replay(cls, ageing, ops, name)
    looks = [i for i, op in enumerate(ops, start=1) if op[0] in ("list", "len", "keys", "key", "rank")]
    for number, (want, have) in enumerate(zip(expected, got, strict=True)):
        if want != have:  # a rank of (30,) is the same as one of (30.0,)
            len_wrong = ops[looks[number] - 1][0] == "len"  # whatever the case checks, len() is what answered wrong
            shown = "\n".join(text[: looks[number] + 1])
            raise Mismatch(shown, _text(want), _text(have), _LEN_HINT if len_wrong else hint)


def _text(answer: Any) -> str:
    return answer if isinstance(answer, str) else repr(answer)


def script(text: str) -> list[Op]:
    """A case's script from its short form: "add 0 10+20 @3" (r0 arrives at step 3 with 10 prompt tokens and
    max_new_tokens=20), "remove 0", "requeue 0", "forget 0", "rank 0 @3", "key 0", "list", "len" or "keys", ";"
    between."""
    ops: list[Op] = []
    for line in text.split(";"):
        kind, *args = line.split()
        if kind == "add":
            prompt, new = args[1].split("+")
            ops.append((kind, int(args[0]), int(prompt), int(new), int(args[2].lstrip("@"))))
        elif kind == "rank":
            ops.append((kind, int(args[0]), int(args[1].lstrip("@"))))
        else:
            ops.append((kind, *map(int, args)))
    return ops


def _case(name: str, text: str, hint: str, ageing: float | None = None) -> Case:
    ops = script(text)
    return Case(name, lambda cls: compare(cls, ops, hint, ageing), hint)


_SHORTEST_HINT = (
    "rank(request, step) is the 1-tuple (request.num_prompt_tokens + request.params.max_new_tokens + self.ageing"
    " * step,): the tokens the request is expected to need, prompt and output both. add's key is (*rank,"
    " next(self._arrivals)), and self._entries stays sorted by key, smallest first: bisect.insort(self._entries,"
    " (key, request), key=itemgetter(0)); __iter__ yields the requests in that order"
)
_AGEING_HINT = (
    "a step of waiting is a head start: a request arriving k steps after another ranks as if it needed"
    " self.ageing * k more tokens, so rank adds + self.ageing * step (plus, not minus: later arrivals rank later)."
    " Use self.ageing, the value the queue was made with, not the module's AGEING"
)
_TIE_HINT = (
    "two requests of the same rank go in arrival order, the earlier first: the key ends with next(self._arrivals),"
    " which counts up (0, 1, 2, ...) as requests are added, and the smallest key comes first"
)
_ARRIVAL_HINT = (
    "add's key is (*self.rank(request, step), next(self._arrivals)): the arrival number comes from the counter,"
    " which only counts up (0, 1, 2, ...), so no two requests ever share one (len(self._entries) would: it goes"
    " down as requests leave); and self._keys keeps each request's whole key, arrival number included, while the"
    " request lives (remove keeps it too: only forget drops it)"
)
_REQUEUE_HINT = (
    "a preempted request goes back where its key ranks it, among the waiting requests, not to the front as first"
    " come first served does: a ranked queue has no front of its own. Insert (key, request) in order with its"
    " stored key, self._keys[request.request_id] (remove leaves the key there, since an admitted request may come"
    " back; only forget drops it)"
)
_KEY_FIXED_HINT = (
    "a request keeps the key it arrived with while it lives, its arrival number included: requeue inserts it under"
    " self._keys[request.request_id], the whole key add stored. A key made again at requeue (with another step,"
    " or a new arrival number) would rank a request that has waited since it arrived as if it came later (or"
    " earlier) than it did. And self._entries is sorted by the whole key, arrival number too:"
    " bisect.insort(self._entries, (key, request), key=itemgetter(0)), so that a requeued request goes before the"
    " requests of its rank that arrived after it"
)
_LEN_HINT = "len(queue) is how many requests wait: the number of entries, len(self._entries), an int"
_REMOVE_HINT = (
    "remove takes out exactly this request's entry, (self._keys[request.request_id], request), wherever it is in"
    " the queue: not the head, and not another request of the same rank (self._entries.remove((key, request)))"
)
_ITER_HINT = (
    "the scheduler walks the queue to plan every step, and takes out only the requests it admits (remove):"
    " __iter__ must not take anything out. Return an iterator over the entries' requests, (request for _, request"
    " in self._entries), and let __len__ count the entries"
)
_FORGET_HINT = (
    "forget drops a finished request's key: self._keys.pop(request.request_id, None). A server runs for weeks,"
    " so keys must not pile up; and a request that never got a key here is no error"
)

CASES = [
    _case(
        "the fewest expected tokens (prompt + max_new_tokens) go first",
        "add 0 10+20 @0; add 1 4+6 @0; add 2 20+2 @0; add 3 2+30 @0; add 4 8+8 @0; rank 0 @0; rank 3 @0; list; len",
        _SHORTEST_HINT,
    ),
    _case(
        "each step a request has waited is worth ageing tokens of head start",
        "add 0 30+10 @0; add 1 10+10 @3; add 2 10+10 @2; add 3 4+4 @5; list",
        _AGEING_HINT,
    ),
    _case(
        "ageing is the value the queue was made with",
        "add 0 30+10 @0; add 1 10+10 @3; add 2 10+10 @12; rank 2 @12; list",
        _AGEING_HINT,
        ageing=2.5,  # not a whole number: ageing is a float
    ),
    _case(  # arrival order, not request id order
        "requests of the same rank go in arrival order",
        "add 3 10+10 @0; add 1 10+10 @0; add 2 8+12 @0; add 0 4+4 @0; add 4 2+6 @0; list",
        _TIE_HINT,
    ),
    _case(  # from the middle, the end, the front
        "remove takes out exactly that request",
        "add 0 10+10 @0; add 1 8+8 @0; add 2 12+12 @0; add 3 2+2 @0; remove 1; list; remove 2; list; len; remove 3;"
        " list",
        _REMOVE_HINT,
    ),
    _case(  # r1 and r2 rank alike; r2 arrives after r0 has left
        "the key ends with an arrival number that only counts up",
        "add 0 10+10 @0; add 1 10+10 @0; remove 0; add 2 10+10 @0; key 0; key 1; key 2",
        _ARRIVAL_HINT,
    ),
    _case(  # r0 and r1 are admitted, then preempted after two more arrive
        "a preempted request goes back where its key ranks it, not to the front",
        "add 0 20+10 @0; add 1 4+4 @0; list; remove 1; remove 0; add 2 6+6 @1; add 3 30+20 @1; requeue 0; list;"
        " requeue 1; list",
        _REQUEUE_HINT,
    ),
    _case(  # r0, which arrived at step 0, is preempted after step 3
        "a request keeps the key it arrived with: requeued later, it ranks as before",
        "add 0 12+8 @0; remove 0; add 1 2+2 @3; add 2 20+10 @3; requeue 0; list",
        _KEY_FIXED_HINT,
    ),
    _case(  # r4, r0 and r2 all rank 60: r0, requeued, still goes after r4 and before r2, by when each arrived
        "a requeued request keeps its arrival number, and the step it arrived at",
        "add 1 15+15 @0; add 4 36+24 @0; add 0 10+10 @5; remove 0; add 2 2+2 @7; add 3 20+10 @7; requeue 0; list",
        _KEY_FIXED_HINT,
    ),
    _case(
        "iterating over the queue takes nothing out",
        "add 0 10+10 @0; add 1 4+4 @0; add 2 7+7 @0; list; list; len",
        _ITER_HINT,
    ),
    _case(  # r1 admitted, then finished; r7 never added here; r0 admitted, then finished
        "forget drops the key of a finished request",
        "add 0 10+10 @0; add 1 4+4 @0; keys; remove 1; forget 1; keys; forget 7; remove 0; forget 0; keys; len",
        _FORGET_HINT,
    ),
]


# ------------------------------------------------------------------ random scripts
def _random_ops(example: Any) -> tuple[float, list[Op]]:
    """A script the scheduler could run: requests arrive (steps never go back), waiting ones are admitted or
    aborted, running ones are preempted or finish; the queue is looked at after each op."""
    ageing, moves = example
    waiting: list[int] = []
    running: list[int] = []
    ops: list[Op] = []
    step = next_id = 0
    for kind, choice, prompt, new, later in moves:
        if kind == 0 or not (waiting or running):
            step += later
            ops.append(("add", next_id, prompt, new, step))
            waiting.append(next_id)
            next_id += 1
        elif kind == 1 and waiting:  # admitted
            running.append(waiting.pop(choice % len(waiting)))
            ops.append(("remove", running[-1]))
        elif kind == 2 and running:  # preempted
            waiting.append(running.pop(choice % len(running)))
            ops.append(("requeue", waiting[-1]))
        elif kind == 3 and running:  # finished
            ops.append(("forget", running.pop(choice % len(running))))
        elif kind == 4 and waiting:  # aborted while waiting
            request_id = waiting.pop(choice % len(waiting))
            ops += [("remove", request_id), ("forget", request_id)]
        else:
            continue
        ops.append(("list",))
    return ageing, [*ops, ("len",), ("keys",)]


def _strategy() -> Any:
    from hypothesis import strategies as st

    move = st.tuples(st.integers(0, 4), st.integers(0, 9), st.integers(1, 24), st.integers(1, 24), st.integers(0, 3))
    return st.tuples(st.sampled_from([0, 1, AGEING]), st.lists(move, max_size=24))


def _property(cls: Any, example: Any) -> None:
    ageing, ops = _random_ops(example)
    hint = (
        "your queue and labkit's disagree at the last look shown: compare the two answers, then find the op above"
        " it (add, remove, requeue or forget) that put your queue out of step; the cases above check each op alone"
    )
    compare(cls, ops, hint, ageing)


CASES.append(
    property_case(
        "random arrivals, admissions, preemptions and finishes keep labkit's order",
        _strategy,
        _property,
        max_examples=60,
    )
)


# ------------------------------------------------------------------ inside the engine
# Two seats, and blocks for a long request and one short one but not two more: a short one is preempted once.
ENGINE_CONFIG = EngineConfig(
    block_size=4, num_blocks=9, max_batch_tokens=32, max_num_seqs=2, scheduling="shortest-first"
)
LONG = (24, 8)  # r0: prompt tokens, max_new_tokens
SHORT = (3, 3)  # r1 and r2 arrive with r0, then one more before each step: more than two seats serve
STREAM = 40  # steps with an arrival


def _prompt(request_id: int, length: int) -> list[int]:
    return [2 + (7 * request_id + 3 * j) % 60 for j in range(length)]


def engine_lockstep(cls: Any, hint: str) -> None:
    """Serve a long request under a stream of short ones with ``cls`` and with labkit's queue; Mismatch at the first
    step that differs, or if the long request never finishes."""
    queues = (ShortestFirstQueue, cls)
    engines = [Engine(SimulatedModel(), ENGINE_CONFIG, scheduler_cls=scheduler_for(queue)) for queue in queues]
    reference, mine = engines
    short = SamplingParams(max_new_tokens=SHORT[1], ignore_eos=True)
    for engine in engines:
        engine.add_request(_prompt(0, LONG[0]), SamplingParams(max_new_tokens=LONG[1], ignore_eos=True))
        for request_id in (1, 2):
            engine.add_request(_prompt(request_id, SHORT[0]), short)
    setup = (
        "EngineConfig(block_size=4, num_blocks=9, max_batch_tokens=32, max_num_seqs=2, scheduling='shortest-first'),"
        f" your queue plugged in with scheduler_for(...)\nrequests: r0 ({LONG[0]} prompt + {LONG[1]} new), r1 and r2"
        f" ({SHORT[0]} prompt + {SHORT[1]} new) first, then one more of those before each of the first {STREAM} steps"
    )
    done: list[str] = []
    for step in range(1, 200):
        if step <= STREAM:
            for engine in engines:
                engine.add_request(_prompt(step + 2, SHORT[0]), short)
        if not reference.has_unfinished() and not mine.has_unfinished():
            return
        so_far = "\n".join([setup, *history(done)])
        showing(f"{so_far}\n(in step {step})")
        waiting = _ids(mine.scheduler.waiting)
        if _ids(mine.scheduler.waiting) != waiting:  # the scheduler walks the queue to plan, then walks it again
            raise Mismatch(so_far, f"the waiting queue {waiting} again", _ids(mine.scheduler.waiting), _ITER_HINT)
        expected = reference.step()
        want = f"step {expected.step}: {step_text(expected)}"
        got = mine.step()
        have = f"step {got.step}: {step_text(got)}"
        if want != have:
            waits = 0 in expected.admitted and 0 not in got.admitted
            raise Mismatch(so_far, want, have, _STARVED_HINT if waits else hint)
        done.append(want)
    raise Mismatch(setup, "every request finishes", "requests still unfinished after 200 steps", _STARVED_HINT)


_STARVED_HINT = (
    "labkit's queue admits r0, the long request, here and yours does not: the short ones that keep arriving"
    " must not pass it forever. Each step of waiting is worth self.ageing tokens, so a short request that"
    " arrives late enough ranks after r0 (rank adds + self.ageing * step, and the key is fixed when r0 arrives)"
)

CASES.append(
    Case(
        "inside the engine, a long request is admitted while short ones keep arriving",
        lambda cls: engine_lockstep(
            cls, "compare the first step where your queue admits other requests, then the queue cases above"
        ),
        "plugged in with scheduler_cls=scheduler_for(MyShortestFirstQueue), your queue decides whom each step admits",
    )
)

EXERCISE = Exercise(
    number=9,
    after=("09",),
    slug="shortest_first",
    title="Who goes first: a ranked waiting queue, shortest-first with ageing",
    export="MyShortestFirstQueue",
    reference=lambda: ShortestFirstQueue,
    cases=CASES,
    seams=("__init__", "rank", "add", "requeue", "remove", "__iter__", "__len__", "forget"),
)
