"""The test fork server's children end as a fresh interpreter ends (``tests/forkserver.py``): the same exit code and
the same output, the non-daemon threads joined and the atexit handlers run in their order, for every way a script
ends; only the interpreter's finalization is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
import runner

SCRIPT = """
import atexit, logging, sys, threading, time, weakref

mode = sys.argv[1]
logging.basicConfig(stream=sys.stderr, format="log %(message)s")
print("main", mode)  # buffered: stdout is a file


class Held:
    pass


held = Held()
# before the handlers below, as an import would: weakref registers its atexit hook with the first finalize, which
# the fork server's imports made before it forked (the one difference in order a preloaded import can make)
weakref.finalize(held, print, "finalizer of an object still alive at exit")
atexit.register(print, "atexit registered first, runs last")
atexit.register(lambda: logging.getLogger("t").warning("from an atexit handler"))

threading.Thread(target=lambda: (time.sleep(0.2), print("non-daemon thread ends before atexit"))).start()
sys.stderr.write("stderr line without a newline")
if mode == "exit-int":
    sys.exit(4)
if mode == "exit-none":
    sys.exit()
if mode == "exit-message":
    sys.exit("a message for stderr")
if mode == "raise":
    raise ValueError("boom")
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "os-exit":
    sys.stdout.flush()
    import os
    os._exit(3)
"""

FRESH = {"PYTHONREPRO_FRESH_INTERPRETER": "1"}
"""A variable of the ``PYTHON`` prefix the fork server was not started with: the run gets a fresh interpreter."""


@pytest.mark.parametrize("mode", ["return", "exit-int", "exit-none", "exit-message", "raise", "interrupt", "os-exit"])
def test_a_forked_run_ends_as_a_fresh_interpreter(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    runner.start_fork_server()
    forked = runner.execute([str(script), mode])
    fresh = runner.execute([str(script), mode], env=FRESH)
    assert forked == fresh
    code, out, err = forked
    assert code == {"exit-int": 4, "exit-message": 1, "raise": 1, "interrupt": -2, "os-exit": 3}.get(mode, 0)
    if mode == "os-exit":
        assert out == f"main {mode}\n"
        return
    assert out == (
        f"main {mode}\nnon-daemon thread ends before atexit\natexit registered first, runs last\n"
        "finalizer of an object still alive at exit\n"
    )
    assert err.endswith("log from an atexit handler\n")
    if mode in ("raise", "interrupt"):
        assert f'File "{script}", line' in err
        assert "runpy" not in err
        assert "forkserver" not in err


def test_the_runs_above_were_forked() -> None:
    """The comparison means something only if the first run of each pair came from the fork server."""
    runner.start_fork_server()
    assert runner._SERVER is not None
    assert runner._SERVER.can_run(runner.run_env())
    assert not runner._SERVER.can_run(runner.run_env(FRESH))
