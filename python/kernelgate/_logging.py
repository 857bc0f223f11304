"""Routes the engine's log-once messages (fallback reasons, bad environment values) to `logging`."""

import atexit
import logging

from . import _C

logger = logging.getLogger("kernelgate")


def _hook(level: str, op: str, message: str) -> None:
    text = f"{op}: {message}" if op else message
    if level == "warning":
        logger.warning(text)
    else:
        logger.info(text)


def install_log_hook() -> None:
    _C.set_log_hook(_hook)
    # The hook must not outlive the interpreter.
    atexit.register(_C.set_log_hook, None)
