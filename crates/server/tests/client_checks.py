"""The checks the official-client scripts share (`openai_client.py`,
`structured_client.py`, `agent_client.py`): every check runs, a failure
is recorded and printed rather than stopping the others, and `report()`
prints the tally and exits 1 if anything failed.

Python puts a script's own directory on `sys.path`, so the scripts import
this module by name.
"""

import sys
import threading
import traceback

FAILURES = []
PASSED = 0
_LOCK = threading.Lock()


def check(cond, what):
    """Counts a passed check, or records and prints a failed one."""
    global PASSED
    with _LOCK:
        if cond:
            PASSED += 1
        else:
            FAILURES.append(what)
            print(f"FAIL: {what}", flush=True)


def section(fn):
    """Runs one group of checks; an exception is a failure of the group."""

    def run(*args):
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            with _LOCK:
                FAILURES.append(f"{fn.__name__}: {type(e).__name__}: {e}")
            print(f"FAIL: {fn.__name__} raised", flush=True)
            traceback.print_exc()

    run.__name__ = fn.__name__
    return run


def expect_error(kind, call, what, status=None, code=None):
    """`call()` must raise the client's `kind` (with `status` and error `code`)."""
    try:
        call()
    except kind as e:
        check(status is None or e.status_code == status,
              f"{what}: status {e.status_code}, expected {status}")
        check(code is None or e.code == code,
              f"{what}: error code {e.code!r}, expected {code!r}")
        body = e.body if isinstance(e.body, dict) else {}
        check(isinstance(body.get("message"), str) and body["message"],
              f"{what}: the error has no message: {e.body!r}")
        return
    except Exception as e:  # noqa: BLE001
        check(False, f"{what}: raised {type(e).__name__} ({e}), expected {kind.__name__}")
        return
    check(False, f"{what}: no error, expected {kind.__name__}")


def report():
    """Prints `N checks passed, M failed` and the failures; exits 1 on any."""
    print(f"{PASSED} checks passed, {len(FAILURES)} failed", flush=True)
    if FAILURES:
        print("FAILED CHECKS:", flush=True)
        for f in FAILURES:
            print(f"  - {f}", flush=True)
        sys.exit(1)
