"""A launcher for ``chatcli serve`` that dies at one point: the first append to a ``state.kv`` after a flag file
appears (``CHATCLI_TEST_KILL_FLAG``). There it writes ``reached`` into the flag file, waits until the test
writes ``go`` (so the test knows what the client had received by then), and SIGKILLs itself before a byte
of the record is written. Only the standard library's view of chatcli is wrapped; no hook lives in chatcli.

    python tests/kill_point.py serve --port ...
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def install(flag: Path) -> None:
    from chatcli.core.kv import records

    real = records.append_durably

    def append(path: Path, data: Any, **kw: Any) -> None:
        if Path(path).name == "state.kv" and flag.exists():
            flag.write_text("reached")
            deadline = time.monotonic() + 600  # a hang guard only
            while flag.read_text() != "go" and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, data, **kw)

    records.append_durably = append


if __name__ == "__main__":
    install(Path(os.environ["CHATCLI_TEST_KILL_FLAG"]))
    from chatcli.cli.entry import main

    sys.argv = ["chatcli", *sys.argv[1:]]
    main()
