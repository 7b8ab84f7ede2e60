"""`ddtree-deploy bench HOST` over real SSH: the host's health URL is only reachable inside the
test bed's network namespace (host gpu-b, reached through the bastion with ProxyJump), so the
numbers can only come back through the command's SSH port forward.

The server behind that URL is the SGLang-speaking TEST DOUBLE of tests/bench_fake_sglang.py (a
real SGLang server needs a GPU); sshd, the namespace, the ProxyJump and the forward are real.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import deploy_testbed as tb
import pytest
from deploy_cli import host_toml, run_cli

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(300)]

FAKE = Path(__file__).resolve().parents[1] / "bench_fake_sglang.py"
N_NEW, ACCEPT = 7, 3


@pytest.fixture
def netns_server(bed):
    ns = bed["ssh"].ns
    port = tb.free_port()
    proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(FAKE), "--port", str(port),
                             "--algo", "DFLASH", "--accept", str(ACCEPT), "--round-ms", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    probe = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=2)"
    deadline = time.monotonic() + 30
    while subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe], capture_output=True).returncode:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail("the test server in the namespace did not come up")
        time.sleep(0.3)
    yield port
    proc.terminate()
    proc.wait(10)


def test_bench_reaches_a_host_through_its_ssh_connection(bed, cli_env, netns_server, tmp_path):
    port = netns_server
    with pytest.raises(OSError):  # not reachable from here: only inside the namespace
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    h = dataclasses.replace(bed["hosts"]["gpu-b"], port=port)
    inv = tmp_path / "hosts.toml"
    inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "def main():"}\n{"input_ids": [3, 4, 5]}\n')
    r = run_cli(["bench", "gpu-b", "-i", str(inv), "--prompts", str(prompts), "--concurrency", "1,2",
                 "--requests", "4", "--max-new-tokens", str(N_NEW), "--json"], cli_env, timeout=240)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    s = doc["servers"][0]
    assert s["target"] == "gpu-b" and s["server"]["speculative_algorithm"] == "DFLASH"
    assert s["url"].startswith("http://127.0.0.1:") and not s["url"].endswith(f":{port}")  # the local end of the forward
    rounds = -(-(N_NEW - 1) // ACCEPT)
    for lv in s["levels"]:
        assert lv["ok_requests"] == lv["requests"] == 4
        assert lv["output_tokens"] == 4 * N_NEW
        assert lv["accept_length"] == pytest.approx(N_NEW / rounds, abs=1e-4)


def test_bench_host_whose_server_is_down_exits_5(bed, cli_env, tmp_path):
    h = dataclasses.replace(bed["hosts"]["gpu-b"], port=tb.free_port())  # nothing listens there
    inv = tmp_path / "hosts.toml"
    inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"]))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "x"}\n')
    r = run_cli(["bench", "gpu-b", "-i", str(inv), "--prompts", str(prompts), "--json"], cli_env, timeout=120)
    assert r.returncode == 5, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 5 and "unreachable" in doc["error"]
