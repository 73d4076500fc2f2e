"""The README's examples run: every ```python block, in order, in one namespace, offline.

A block that cannot run here (it needs the network or a GPU) is marked by an ``<!-- not-run -->`` line
just before it; it must still compile.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)
NOT_RUN = "<!-- not-run -->"


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(line number, code, runs) for each ```python block of ``text``."""
    blocks = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip().splitlines()
        runs = not before or before[-1].strip() != NOT_RUN
        blocks.append((text.count("\n", 0, match.start()) + 2, match.group(1), runs))
    return blocks


def test_python_blocks_are_found_and_markers_are_honoured():
    text = "intro\n```python\nx = 1\n```\n<!-- not-run -->\n```python\nimport network\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n", True), (7, "import network\n", False)]


def test_every_python_block_of_the_readme_runs(tmp_path, monkeypatch):
    import torch

    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)  # examples may write files (a trace)
    blocks = python_blocks(README.read_text())
    assert sum(runs for _, _, runs in blocks) >= 5  # the engine, generate_batch, the simulator, widgets, models
    namespace: dict[str, object] = {"__name__": "readme"}
    for line, code, runs in blocks:
        # The file name in a traceback says which block failed; exec is the point of this test.
        compiled = compile(code, f"README.md, the block at line {line}", "exec")
        if runs:
            exec(compiled, namespace)


def test_the_sample_speech_is_what_the_engine_samples_with_the_call_shown():
    """The README's sample of the bundled model had drifted from what any seed gave: it is checked against the call
    the README names."""
    from labkit import Engine, SamplingParams
    from labkit.models import load

    text = README.read_text()
    call = re.search(
        r"`Engine\(model, tokenizer=tokenizer\)\.generate\((\[.*?\]),\s*SamplingParams\((.*?)\)\)`", text, re.S
    )
    assert call, "the README names the call that sampled its speech"
    prompts = [p.encode().decode("unicode_escape") for p in re.findall(r'"(.*?)"', call.group(1))]
    options = dict(re.findall(r"(\w+)=([\w.]+)", call.group(2)))
    params = SamplingParams(
        temperature=float(options["temperature"]),
        seed=int(options["seed"]),
        max_new_tokens=int(options["max_new_tokens"]),
    )
    sample = re.search(r"gives, after each prompt:\n\n```text\n(.*?)```", text, re.S)
    assert sample, "the sample follows the call"
    model, tokenizer = load("tiny-shakespeare")
    outputs = Engine(model, tokenizer=tokenizer).generate(prompts, params)
    assert "\n".join(p + o.text + "\n" for p, o in zip(prompts, outputs, strict=True)) == sample.group(1)
