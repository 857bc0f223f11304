"""The Python worker of the sweeps: serves the same protocol as kernelgate-worker (one request per
line on stdin, one answer per line on stdout) and can also host backends and ops defined in
Python.

    python -m kernelgate.worker [--load module_or_file.py | --load plugin.so] ...

Each --load is imported (a module name or a .py file) or, for a shared library, loaded as a
plugin, before the first request.
"""

import os
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Until the loop takes over, whatever imports print goes to stderr: stdout is the protocol's.
    responses = os.dup(1)
    os.dup2(2, 1)
    from . import _C, plugins

    _C.die_with_parent()  # the kernel ends this worker when the sweep's process ends
    # A timing the harness captures in a CUDA graph must run the backend it times: without the
    # capture rules, a backend that cannot be captured fails the capture (recorded as such)
    # instead of another backend serving it unseen.
    _C.set_capture_rules(False)

    loads = []
    i = 0
    while i < len(argv):
        if argv[i] == "--load" and i + 1 < len(argv):
            loads.append(argv[i + 1])
            i += 2
        else:
            print(f"kernelgate worker: unknown argument {argv[i]}", file=sys.stderr)
            return 2
    try:
        for item in loads:
            plugins.load(item)
    except Exception as exc:  # the sweep reports the worker's last stderr line
        print(f"kernelgate worker: cannot load {item}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.dup2(responses, 1)
    os.close(responses)
    return _C.serve_worker()


if __name__ == "__main__":
    sys.exit(main())
