"""Probe: does CPython run a signal's Python handler again inside itself, when the same signal arrives while
the handler runs? A child process sends SIGTERM twice, 50 ms apart, to a parent whose handler takes 200 ms
(a handler the OS preempted for that long). Prints the depth of each call: [1, 2] means nested."""
import os
import signal
import time

depth, calls = 0, []


def handler(sig, frame):
    global depth
    depth += 1
    calls.append(depth)
    started = time.monotonic()
    while time.monotonic() - started < 0.2:
        pass
    depth -= 1


signal.signal(signal.SIGTERM, handler)
if os.fork() == 0:
    time.sleep(0.1)
    os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(0.05)
    os.kill(os.getppid(), signal.SIGTERM)
    os._exit(0)
time.sleep(1)
print("handler depths seen:", calls)
