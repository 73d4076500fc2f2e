"""The lab's main command: ``labkit demo`` serves the same requests under both policies and says what happened."""

import re

import pytest

from labkit.cli import main


def _summary_rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0] in ("continuous", "static") and len(cells) == 9:
            rows[cells[0]] = cells
    return rows


def test_simulated_demo_prints_steps_and_a_summary(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # a plain terminal: every table fits, nothing is cut short ("contin…")
    assert main(["demo", "--model", "sim", "--steps", "3", "--requests", "8"]) == 0
    out = capsys.readouterr().out
    assert "continuous batching, step by step" in out and "static batching, step by step" in out
    assert "…" not in out and max(map(len, out.splitlines())) <= 80
    header = next(line for line in out.splitlines() if line.lstrip().startswith("step"))
    assert header.split()[-4:] == ["blocks", "admitted", "finished", "preempted"]  # no header wraps or is cut
    rows = _summary_rows(out)
    assert set(rows) == {"continuous", "static"}
    # Same requests, same tokens; continuous computes more requests per step; static wastes slots, continuous
    # none, and continuous is faster.
    assert rows["continuous"][3] == rows["static"][3]
    assert float(rows["continuous"][5]) > float(rows["static"][5]) >= 1
    assert rows["continuous"][6] == "0" and int(rows["static"][6]) > 0
    assert float(rows["continuous"][8].rstrip("x")) > 1.0
    assert "batch: requests computed per step, on average" in out


def test_demo_on_the_bundled_model_gives_identical_tokens_under_both_policies(capsys):
    assert main(["demo", "--requests", "4", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "produced the same tokens for every request: yes" in out
    assert re.search(r"ROMEO: \(\d+ tokens, (stop|length)\)", out)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--requests", "0"], "must be >= 1"),
        (["demo", "--model", "no-such-model"], "no-such-model"),
        (["demo", "--model", "sim", "--device", "cuda"], "the simulated model has none"),
    ],
)
def test_demo_rejects_bad_options_without_a_traceback(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err and "Traceback" not in err


def test_unknown_command_is_named_and_help_goes_to_stdout(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err and "usage: labkit" in err
    assert main([]) == 2 and "unknown command" not in capsys.readouterr().err
    assert main(["--help"]) == 0
    out = capsys.readouterr()
    assert "usage: labkit" in out.out and not out.err


@pytest.mark.parametrize("command", ["demo", "bench", "check"])
def test_a_ctrl_c_ends_a_command_with_a_line_and_status_130(command, capsys, monkeypatch):
    """In a terminal a Ctrl-C ends labkit with one line, not a traceback, and the status shells give SIGINT."""
    import labkit.cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(labkit.cli, f"{command}_main", interrupted)
    assert main([command]) == 130
    assert capsys.readouterr().err == f"labkit {command}: interrupted\n"
