"""A tensor-parallel target (two gloo processes on the CPU): decoding equals one process, token for token,
and a dead or missing rank ends the job with one line."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("parallel_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def test_sharded_decoding_equals_one_process(tiny_dirs, tmp_path):
    """AR, chains and trees under sd, fsd and fsd-hybrid, greedy and sampled, batched: the same tokens on both
    ranks as without sharding; a row whose seed is left to chance draws alike on both ranks."""
    done = subprocess.run([*TORCHRUN, free_port(), str(WORKER), tiny_dirs["target"], str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["shards"] == 2
        assert rank["sharded"][:-1] == rank["alone"][:-1]
    assert ranks[0]["sharded"] == ranks[1]["sharded"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fuzzyspec", *args]


def test_generate_under_torchrun_prints_once_and_equals_one_process(tiny_dirs):
    args = ["generate", "Hello there", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
            "--method", "fsd-hybrid", "--threshold", "0.3", "--max-new-tokens", "12", "--json"]
    alone = subprocess.run(cli(*args), capture_output=True, text=True, timeout=300, env=ENV)
    sharded = subprocess.run([*TORCHRUN, free_port(), "-m", "fuzzyspec", *args], capture_output=True, text=True,
                             timeout=300, env=ENV)
    assert alone.returncode == 0 and sharded.returncode == 0, sharded.stderr[-3000:]
    lines = sharded.stdout.strip().splitlines()
    assert len(lines) == 1  # rank 0 alone prints
    assert json.loads(lines[0])["text"] == json.loads(alone.stdout)["text"]


def test_a_two_node_launch_equals_one_process(tiny_dirs):
    """Two torchrun launches of one process each, meeting at a rendezvous endpoint as two machines would
    (`--nnodes 2 --node-rank i --rdzv-endpoint HOST:PORT`): rank 0's node prints one process's text."""
    args = ["generate", "Hello there", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
            "--method", "sd", "--max-new-tokens", "12", "--json"]
    alone = subprocess.run(cli(*args), capture_output=True, text=True, timeout=300, env=ENV)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                               "-m", "fuzzyspec", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=ENV) for node in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    printed = [out.strip() for out, _ in outputs if out.strip()]
    assert len(printed) == 1 and json.loads(printed[0])["text"] == json.loads(alone.stdout)["text"]


def ranks(port: str, world: int, args: list[str], die_at_step: int | None = None) -> list[subprocess.Popen]:
    """``world`` ranks started by hand (as on separate machines); rank 1 may exit abruptly at a step."""
    launched = []
    for rank in range(world if die_at_step is not None else 1):
        env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "FUZZYSPEC_TP_TIMEOUT_S": "4"}
        code = "import sys, fuzzyspec.cli as cli\n"
        if rank == 1:
            code += ("import os\nfrom fuzzyspec.core.engine import Engine\nstep, n = Engine.step, [0]\n"
                     "def dying(self):\n    n[0] += 1\n    if n[0] == %d: os._exit(3)\n    return step(self)\n"
                     "Engine.step = dying\n" % die_at_step)
        code += f"sys.exit(cli.main({args!r}))"
        launched.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, env=env))
    return launched


@pytest.mark.parametrize("case", ["a rank dies", "a rank never comes"])
def test_a_lost_rank_ends_the_job_with_one_line(tiny_dirs, case):
    args = ["generate", "Hello there", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
            "--method", "sd", "--max-new-tokens", "200"]
    started = time.monotonic()
    processes = ranks(free_port(), 2, args, die_at_step=3 if case == "a rank dies" else None)
    rank0 = processes[0]
    try:
        _, stderr = rank0.communicate(timeout=120)
    finally:
        for process in processes:
            process.kill()
    assert time.monotonic() - started < 120
    assert rank0.returncode == 1, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("fuzzyspec: error")]
    assert len(errors) == 1 and ("rank" in errors[0]) and "Traceback" not in stderr, stderr[-2000:]


def test_a_sharded_server_answers_as_one_process_decodes(tiny_dirs):
    """`fuzzyspec serve` under torchrun: rank 0 answers, rank 1 steps along; the answer is one process's text."""
    import urllib.error
    import urllib.request

    common = ["--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"]]
    alone = subprocess.run(cli("generate", "Hello there", *common, "--no-chat", "--method", "sd", "--temperature", "0",
                               "--max-new-tokens", "12", "--json"), capture_output=True, text=True, timeout=300, env=ENV)
    assert alone.returncode == 0, alone.stderr[-2000:]
    port = free_port()
    server = subprocess.Popen([*TORCHRUN, free_port(), "-m", "fuzzyspec", "serve", *common, "--port", port],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                              start_new_session=True)
    try:
        body = json.dumps({"model": tiny_dirs["target"], "prompt": "Hello there", "max_tokens": 12, "temperature": 0,
                           "method": "sd"}).encode()
        deadline = time.monotonic() + 180
        while True:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=60) as reply:
                    answer = json.loads(reply.read())
                break
            except urllib.error.URLError as error:  # not listening yet (an HTTP error is a failure)
                assert not isinstance(error, urllib.error.HTTPError), error.read()
                assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()[-3000:]
                time.sleep(1)
        assert answer["choices"][0]["text"] == json.loads(alone.stdout)["text"]
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)


def test_a_sharded_server_that_loses_a_rank_stops_with_one_line(tiny_dirs):
    import urllib.error
    import urllib.request

    port = free_port()
    args = ["serve", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--port", port]
    processes = ranks(free_port(), 2, args, die_at_step=3)
    rank0 = processes[0]
    try:
        body = json.dumps({"model": tiny_dirs["target"], "prompt": "Hello", "max_tokens": 100}).encode()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and rank0.poll() is None:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                urllib.request.urlopen(request, timeout=60).read()
            except urllib.error.HTTPError:
                break  # the request failed with the step: the server stops next
            except urllib.error.URLError:
                time.sleep(1)  # not listening yet
        _, stderr = rank0.communicate(timeout=60)
    finally:
        for process in processes:
            process.kill()
    assert rank0.returncode == 1, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("fuzzyspec: error")]
    assert len(errors) == 1 and "rank 0" in errors[0] and "Traceback" not in stderr, stderr[-2000:]


def test_a_sweep_over_a_sharded_target_equals_one_process(tiny_dirs, tmp_path):
    """`bench --tp` under torchrun: the ranks decode as one worker (rank 0 alone writes the folder and prints),
    with the same completions, calibrated thresholds and agreement as one process."""
    prompts = Path(__file__).parents[1] / "fixtures" / "prompts.jsonl"
    args = ["bench", "--task", "freeform", "--data", str(prompts), "--target", tiny_dirs["target"], "--drafts",
            f"ar,{tiny_dirs['draft']}", "--rules", "sd,fsd", "--target-acceptance", "0.5", "--calibration-prompts",
            "2", "--max-new-tokens", "6", "--dtype", "float32", "--quiet", "--out"]
    alone = subprocess.run(cli(*args, str(tmp_path / "alone")), capture_output=True, text=True, timeout=300, env=ENV)
    assert alone.returncode == 0, alone.stderr[-3000:]
    sharded = subprocess.run([*TORCHRUN, free_port(), "-m", "fuzzyspec", *args, str(tmp_path / "sharded"), "--tp"],
                             capture_output=True, text=True, timeout=300, env=ENV)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    table = sharded.stdout.strip().splitlines()
    assert len(table) == 1 + 3  # rank 0 alone prints: the header and the three rows

    def outcome(folder: str) -> tuple[list, list]:
        rows = json.loads((tmp_path / folder / "results.json").read_text())["rows"]
        generations = sorted((tmp_path / folder / "generations").iterdir())
        texts = [[(r["id"], r["completion"], r["threshold"]) for r in map(json.loads, path.read_text().splitlines())]
                 for path in generations]
        return [(r["key"], r["threshold"], r["exact_match"], r["first_diff"], r["nll"]) for r in rows], \
            [(path.name, text) for path, text in zip(generations, texts)]

    (rows, generations), (rows_alone, generations_alone) = outcome("sharded"), outcome("alone")
    assert [row[:1] + row[2:4] for row in rows] == [row[:1] + row[2:4] for row in rows_alone]  # the tokens agree
    # T and the NLL are sums that a sharded target adds in another order: equal up to float32 rounding
    numbers = [value for row in rows for value in (row[1] or 0.0, row[4])]
    assert numbers == pytest.approx([value for row in rows_alone for value in (row[1] or 0.0, row[4])], rel=1e-5)
    assert [(name, [r[:2] for r in text]) for name, text in generations] == \
        [(name, [r[:2] for r in text]) for name, text in generations_alone]
    assert "target sharded over 2 ranks" in json.loads((tmp_path / "sharded" / "results.json").read_text()
                                                       )["rows"][0]["hardware"]
