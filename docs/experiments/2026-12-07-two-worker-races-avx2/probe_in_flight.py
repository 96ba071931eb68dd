"""Probe: against `mtbert serve --workers 2`, a /health answered, then at once a /metrics scrape: how often
does the scrape see another request still in flight (the gauge above 1, its own)?

    python docs/experiments/2026-12-07-two-worker-races-avx2/probe_in_flight.py MODEL_FOLDER PAIRS
"""
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
from bench.common import start_server, stop_server
from prometheus_client.parser import text_string_to_metric_families

model, pairs = sys.argv[1], int(sys.argv[2])
process, url = start_server(Path("/tmp/probe-serve.log"), "--model", model, "--engine", "onnx", "--threads", "1",
                            "--workers", "2", timeout=300)
http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
above = 0
try:
    for _ in range(pairs):
        http.get(f"{url}/health")
        families = {f.name: f for f in text_string_to_metric_families(http.get(f"{url}/metrics").text)}
        above += families["mtbert_requests_in_flight"].samples[0].value != 1
finally:
    stop_server(process)
print(f"{pairs} pairs: the scrape saw another request in flight {above} times")
