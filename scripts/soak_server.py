#!/usr/bin/env python3
"""Soak test of `metrale-serve` under hostile traffic (run by hand, not in CI).

Starts the server on 127.0.0.1 (loopback only) over a model directory and
runs mixed traffic for a fixed time, in two phases:

1. baseline: only the well-behaved requests;
2. hostile: the same well-behaved requests (the same open-loop arrivals),
   plus the hostile share: 20% stalled readers (a streamed request whose
   response is never read, held until the server closes it), 10% clients
   that disconnect mid-stream, and 10% oversized bodies (413), malformed
   JSON (400) and requests whose cost is over the limits (400).

It reports, per phase, the well-behaved requests answered and failed, the
p50/p99 time to first token and inter-token gap of their streams, the
hostile share, the server's RSS over time (after the first minute, and its
greatest), and at the end the descriptors and gauges against their idle
values. Every loop is bounded in count and time; nothing leaves loopback.

    cargo build -p metrale-server    # the dev profile is optimised
    python3 scripts/soak_server.py --minutes 10 --json soak.json

Only the Python standard library is used.
"""

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time

HOST = "127.0.0.1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, int(round(q / 100 * (len(values) - 1)))))
    return values[k]


class Server:
    """A metrale-serve child process on a free loopback port."""

    def __init__(self, binary, model, extra):
        args = [binary, "--model", model, "--host", HOST, "--port", "0", "-q"] + extra
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
        deadline = time.time() + 120
        self.port = None
        while time.time() < deadline:
            line = self.proc.stderr.readline().decode(errors="replace")
            if not line:
                break
            m = re.search(r"http://[\d.]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        if self.port is None:
            self.proc.kill()
            raise SystemExit("the server did not start")

    def rss_mib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return None

    def descriptors(self):
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "killed"


async def http(port, method, path, body=None, timeout=120, raw=None):
    """One request on its own connection; returns (status, body bytes)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 10)
    try:
        if raw is None:
            data = b"" if body is None else json.dumps(body).encode()
        else:
            data = raw
        head = (f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
        writer.write(head.encode() + data)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()
    status = int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/") else 0
    return status, response.partition(b"\r\n\r\n")[2]


async def stream(port, body, timeout=120, stop_after=None):
    """A streamed completion; returns (ok: it ended with [DONE], time to
    its first text, gaps between texts)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 10)
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    start = time.perf_counter()
    writer.write(head.encode() + data)
    await writer.drain()
    times, done, buf, events = [], False, b"", 0
    try:
        deadline = start + timeout
        while not done and time.perf_counter() < deadline:
            chunk = await asyncio.wait_for(reader.read(65536), deadline - time.perf_counter())
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                event, _, buf = buf.partition(b"\n\n")
                if b"data: [DONE]" in event:
                    done = True
                elif b"\"text\":\"" in event and b"\"text\":\"\"" not in event:
                    times.append(time.perf_counter())
                events += event.count(b"data: ")
                if stop_after is not None and events >= stop_after:
                    return True, None, []
    except (asyncio.TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()
    if not done:
        return False, None, []
    if not times:
        return True, None, []
    gaps = [b - a for a, b in zip(times, times[1:])]
    return True, times[0] - start, gaps


class Stats:
    def __init__(self):
        self.ok = 0
        self.failed = 0
        self.ttft = []
        self.gaps = []
        self.hostile = {}
        self.skipped = 0

    def summary(self):
        def ms(v):
            return None if v is None else round(v * 1000, 2)
        return {
            "well_behaved_ok": self.ok,
            "well_behaved_failed": self.failed,
            "ttft_p50_ms": ms(percentile(self.ttft, 50)),
            "ttft_p99_ms": ms(percentile(self.ttft, 99)),
            "gap_p50_ms": ms(percentile(self.gaps, 50)),
            "gap_p99_ms": ms(percentile(self.gaps, 99)),
            "hostile": self.hostile,
            "skipped_at_cap": self.skipped,
        }


KINDS = [("good", 60), ("stalled", 20), ("disconnect", 10), ("oversized", 4),
         ("malformed", 3), ("too_costly", 3)]
PROMPTS = ["The meaning of life is", "A fool and his money", "Never trust a man who",
           "The early bird", "Time flies like an arrow"]


async def good(port, stats, rng):
    """A well-behaved request: mostly streamed completions (timed), some
    non-streamed chats."""
    if rng.random() < 0.8:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(16, 48),
                "temperature": 0.8, "stream": True}
        ok, ttft, gaps = await stream(port, body)
        if ok:
            stats.ok += 1
            if ttft is not None:
                stats.ttft.append(ttft)
                stats.gaps.extend(gaps)
        else:
            stats.failed += 1
    else:
        body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": rng.randint(8, 32)}
        status, _ = await http(port, "POST", "/v1/chat/completions", body)
        if status == 200:
            stats.ok += 1
        else:
            stats.failed += 1


async def hostile(kind, port, held):
    if kind == "stalled":
        # Never read: the response (8 choices of 480 tokens) outgrows the
        # sockets' buffers, and the server must cut the client off.
        body = json.dumps({"prompt": "Stall", "max_tokens": 480, "ignore_eos": True,
                           "stream": True, "n": 8}).encode()
        r, w = await asyncio.open_connection(HOST, port)
        w.write((f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        await w.drain()
        held.append(w)
    elif kind == "disconnect":
        await stream(port, {"prompt": "Leave", "max_tokens": 200, "stream": True},
                     stop_after=3)
    elif kind == "oversized":
        await http(port, "POST", "/v1/completions",
                   raw=b"{\"prompt\": \"" + b"a" * (5 << 20) + b"\"}")
    elif kind == "malformed":
        await http(port, "POST", "/v1/chat/completions", raw=b"{\"messages\": [")
    else:
        await http(port, "POST", "/v1/completions",
                   {"prompt": "x", "n": 128, "logprobs": 20, "max_tokens": 500})


async def arrivals(port, stats, until, rng, rate, with_hostile, held, cap):
    """Open-loop traffic: requests arrive at `rate` a second, each of a kind
    drawn from KINDS; without the hostile share, its draws send nothing (the
    well-behaved arrivals are the same in both phases)."""
    names = [k for k, _ in KINDS]
    weights = [w for _, w in KINDS]
    tasks = set()
    next_at = time.time()

    async def run(kind):
        try:
            if kind == "good":
                await good(port, stats, rng)
            else:
                await hostile(kind, port, held)
        except (ConnectionError, asyncio.TimeoutError, OSError):
            key = "failed" if kind == "good" else "connection_errors"
            if kind == "good":
                stats.failed += 1
            else:
                stats.hostile[key] = stats.hostile.get(key, 0) + 1

    while time.time() < until:
        next_at += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, next_at - time.time()))
        kind = rng.choices(names, weights)[0]
        if kind != "good":
            if not with_hostile:
                continue
            stats.hostile[kind] = stats.hostile.get(kind, 0) + 1
        if len(tasks) >= cap:
            stats.skipped += 1
            continue
        task = asyncio.ensure_future(run(kind))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=180)


async def phase(server, seconds, rate, with_hostile, seed, cap):
    stats = Stats()
    rng = random.Random(seed)
    until = time.time() + seconds
    held = []
    rss = []

    async def sample():
        start = time.time()
        while time.time() < until:
            rss.append((round(time.time() - start), server.rss_mib()))
            await asyncio.sleep(10)

    await asyncio.gather(arrivals(server.port, stats, until, rng, rate, with_hostile, held, cap),
                         sample())
    for w in held:
        w.close()
    result = stats.summary()
    after_first_minute = [m for t, m in rss if t >= 60] or [m for _, m in rss]
    result["rss_mib_after_first_minute"] = after_first_minute[0] if after_first_minute else None
    result["rss_mib_max_after_first_minute"] = max(after_first_minute) if after_first_minute else None
    result["rss_mib_samples"] = rss
    return result


async def gauges(port):
    _, body = await http(port, "GET", "/metrics")
    text = body.decode()
    names = ["metrale_requests_running", "metrale_requests_waiting", "metrale_sequences_running",
             "metrale_sequences_waiting", "metrale_kv_blocks_in_use", "metrale_ssm_slots_in_use"]
    out = {}
    for name in names:
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else None
    return out


async def main_async(args, server):
    await asyncio.sleep(1)
    idle = {"descriptors": server.descriptors(), "gauges": await gauges(server.port),
            "rss_mib": server.rss_mib()}
    seconds = args.minutes * 60
    report = {"idle": idle, "args": vars(args)}
    if not args.skip_baseline:
        report["baseline"] = await phase(server, seconds, args.rate, False, args.seed, args.cap)
        await asyncio.sleep(args.settle)
    report["hostile"] = await phase(server, seconds, args.rate, True, args.seed, args.cap)
    await asyncio.sleep(args.settle)
    report["end"] = {"descriptors": server.descriptors(), "gauges": await gauges(server.port),
                     "rss_mib": server.rss_mib()}
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", default=os.path.join(ROOT, "target/debug/metrale-serve"))
    p.add_argument("--model", default=os.path.join(ROOT, "models/default"))
    p.add_argument("--minutes", type=float, default=10.0, help="each phase's length")
    p.add_argument("--rate", type=float, default=40.0,
                   help="requests a second (60%% well-behaved, 40%% hostile)")
    p.add_argument("--cap", type=int, default=800, help="most requests in flight")
    p.add_argument("--settle", type=float, default=40.0,
                   help="seconds after a phase for the server to close what is left")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the report here too")
    p.add_argument("server_args", nargs="*", help="more arguments for metrale-serve")
    args = p.parse_args()
    server = Server(args.binary, args.model, args.server_args)
    try:
        report = asyncio.run(main_async(args, server))
    finally:
        status = server.stop()
    report["exit_status"] = status
    b, h = report.get("baseline"), report["hostile"]
    if b and b["ttft_p99_ms"] and h["ttft_p99_ms"]:
        report["ttft_p99_ratio"] = round(h["ttft_p99_ms"] / b["ttft_p99_ms"], 3)
        report["gap_p99_ratio"] = round(h["gap_p99_ms"] / b["gap_p99_ms"], 3)
    if h["rss_mib_after_first_minute"]:
        report["rss_growth"] = round(
            h["rss_mib_max_after_first_minute"] / h["rss_mib_after_first_minute"] - 1, 4)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    failed = h["well_behaved_failed"] > 0 or (b and b["well_behaved_failed"] > 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
