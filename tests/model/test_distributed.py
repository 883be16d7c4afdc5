"""Training across ranks on ordinary networks (model/training/comm.py): 1-bit compressed gradients with
error feedback, local SGD (DiLoCo) and its straggler policy, bytes sent, exact resume and the
refusals. Oracles: plain DDP and single-process arithmetic. Each torchrun runs 2 gloo processes."""

import json
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from teragram.model.training import comm

from tests.conftest import torchrun
from tests.model.helpers import REPO, logged_losses, small_config


def _rows(root, name) -> list[dict]:
    return [json.loads(x) for x in (root / name / "log.jsonl").read_text().splitlines()]


def test_bits_pack_and_unpack():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 64, generator=g) > 0.5
    p = comm.pack(x)
    assert p.dtype == torch.uint8 and p.shape == (3, 8)
    assert torch.equal(comm.unpack(p), x)
    assert comm.pack(torch.tensor([True] + [False] * 7)).item() == 1


def test_matrices_are_cut_by_rows_and_every_element_sits_once():
    L = comm._Layout(["a", "b", "c"], [(5,), (8, 8), (17,)], world=3, rank=1, device="cpu")
    assert L.C % 8 == 0 and len(set(L.idx.tolist())) == 5 + 64 + 17 == int(L.valid.sum())
    # row i of the matrix goes to rank i // 3 (3 rows per rank), a vector to rank 0
    assert L.idx[5 : 5 + 64].div(L.C, rounding_mode="floor").tolist() == [(j // 8) // 3 for j in range(64)]
    assert L.idx[:5].max() < L.C and L.idx[69:].max() < L.C
    # one scale per row of a chunk: the matrix's rank-2 chunk has 2 rows, its third segment is empty
    assert L.count.shape == (3, 1 + 3 + 1)


def _script(tmp_path, body: str) -> object:
    s = tmp_path / "run.py"
    s.write_text(
        "import json, shutil, time, torch, torch.distributed as dist\n"
        "from dataclasses import replace\nfrom pathlib import Path\n"
        "from teragram.model.training.train import TrainConfig, train\n"
        "dist.init_process_group('gloo')\n" + body + "\ndist.barrier()\ndist.destroy_process_group()\n"
    )
    return s


def _configs(runs: dict) -> str:
    return f"cfg = {{n: TrainConfig(**{{**c, 'index_inputs': tuple(c['index_inputs'])}}) for n, c in json.loads({json.dumps(json.dumps({n: asdict(c) for n, c in runs.items()}))}).items()}}\n"


def _resume_copy(name_from: str, name_to: str, step: int) -> str:
    return (
        f"if dist.get_rank() == 0:\n"
        f"    ck = 'checkpoints/step-{step:07d}'\n"
        f"    shutil.copytree(Path(cfg[{name_from!r}].out) / ck, Path(cfg[{name_to!r}].out) / ck)\n"
        f"    (Path(cfg[{name_to!r}].out) / 'latest.json').write_text(json.dumps({{'checkpoint': ck, 'step': {step}}}))\n"
        "dist.barrier()\n"
    )


def test_1bit_and_local_sgd_on_two_gloo_processes(data_root, tmp_path):
    """One torchrun: plain DDP vs 1-bit over 200 steps, the 1-bit run resumed at step 100; local
    SGD with H = 1 and SGD vs DDP with SGD; local SGD with H = 4 resumed at step 8."""
    runs = {
        "ddp": small_config(data_root, "d-ddp", max_steps=200, features=None),
        "1bit": small_config(data_root, "d-1bit", max_steps=200, features=None, compress="1bit", ckpt_every=100),
        "1bit-resumed": small_config(data_root, "d-1bit-r", max_steps=200, features=None, compress="1bit"),
        "sgd": small_config(data_root, "d-sgd", max_steps=10, optimizer="sgd", lr=0.3, min_lr=0.3, grad_clip=0.0),
        "local1": small_config(
            data_root,
            "d-local1",
            max_steps=10,
            optimizer="sgd",
            lr=0.3,
            min_lr=0.3,
            grad_clip=0.0,
            sync="local",
            outer_every=1,
            outer_lr=1.0,
            outer_momentum=0.0,
            straggler="wait",
        ),
        "local4": small_config(data_root, "d-local4", max_steps=16, sync="local", outer_every=4, ckpt_every=8, straggler="wait"),
        "local4-resumed": small_config(data_root, "d-local4-r", max_steps=16, sync="local", outer_every=4, straggler="wait"),
        "local4-bf16": small_config(
            data_root, "d-local4-b", max_steps=16, sync="local", outer_every=4, straggler="wait", outer_dtype="bf16"
        ),
        "local4-ramp": small_config(
            data_root, "d-local4-ramp", max_steps=16, sync="local", outer_every=4, straggler="wait", outer_lr=0.5, outer_lr_end=1.5
        ),
    }
    body = _configs(runs) + "\n".join(
        [
            "train(cfg['ddp'])",
            "train(cfg['1bit'])",
            _resume_copy("1bit", "1bit-resumed", 100),
            "train(cfg['1bit-resumed'])",
            "train(cfg['sgd'])",
            "train(cfg['local1'])",
            "train(cfg['local4'])",
            _resume_copy("local4", "local4-resumed", 8),
            "train(cfg['local4-resumed'])",
            "train(cfg['local4-bf16'])",
            "train(cfg['local4-ramp'])",
        ]
    )
    torchrun(_script(tmp_path, body))
    ddp, onebit, resumed = logged_losses(data_root, "d-ddp"), logged_losses(data_root, "d-1bit"), logged_losses(data_root, "d-1bit-r")
    tail = lambda d: sum(d[s] for s in range(191, 201)) / 10  # noqa: E731
    assert tail(onebit) == pytest.approx(tail(ddp), rel=0.05), (tail(onebit), tail(ddp))
    assert tail(onebit) < 0.8 * onebit[1]  # it learned
    assert [resumed[s] for s in range(101, 201)] == [onebit[s] for s in range(101, 201)]  # residuals resume exactly
    # bytes: a compressed step sends a 32nd of the fp32 all-reduce, plus one 4-byte scale per
    # 128-wide row (1/25.6) and padding; the first 50 steps half DDP's (bf16); every 100 steps
    # the second moments' bf16 all-reduce
    sent = lambda n: {r["step"]: r["comm_bytes"] for r in _rows(data_root, n) if "comm_bytes" in r}  # noqa: E731
    b_ddp, b_1bit = sent("d-ddp"), sent("d-1bit")
    assert b_1bit[50] == b_ddp[50] / 2
    ratio = (b_1bit[102] - b_1bit[101]) / (b_ddp[102] - b_ddp[101])
    assert 1 / 32 < ratio < 1.3 / 32, ratio
    assert b_1bit[100] - b_1bit[99] == pytest.approx((b_ddp[100] - b_ddp[99]) * (ratio + 1 / 2), rel=1e-6)
    # local SGD with H = 1, outer lr 1 and no momentum averages SGD steps: DDP's SGD step
    sgd, local1 = logged_losses(data_root, "d-sgd"), logged_losses(data_root, "d-local1")
    assert [local1[s] for s in range(1, 11)] == pytest.approx([sgd[s] for s in range(1, 11)], rel=1e-4)
    # local SGD resumes exactly (outer momentum, shared weights and each worker's AdamW)
    l4, l4r = logged_losses(data_root, "d-local4"), logged_losses(data_root, "d-local4-r")
    assert [l4r[s] for s in range(9, 17)] == [l4[s] for s in range(9, 17)]
    rounds = [r for r in _rows(data_root, "d-local4") if "round_steps" in r]
    assert [r["round_steps"] for r in rounds] == [[4, 4]] * 4
    # an exchange sends the fp32 weights once per round: (W-1)/W * 2 * 4 bytes per parameter
    n = sum(
        p.numel()
        for p in torch.load(data_root / "d-local4" / "checkpoints" / "step-0000016" / "state.pt", weights_only=False)["local"]["shared"]
    )
    assert rounds[0]["comm_bytes"] == pytest.approx(4 * n, rel=0.01)
    # outer_dtype = bf16: half the bytes a round, the same run to bf16's rounding
    rounds_b = [r for r in _rows(data_root, "d-local4-b") if "round_steps" in r]
    assert rounds_b[0]["comm_bytes"] == pytest.approx(2 * n, rel=0.01)
    l4b = logged_losses(data_root, "d-local4-b")
    assert l4b[4] == l4[4] and [l4b[s] for s in range(5, 17)] == pytest.approx([l4[s] for s in range(5, 17)], rel=0.02)
    assert l4b[16] != l4[16]  # the deltas were rounded
    # outer_lr_end: the outer lr ramps linearly over the 4 rounds, 0.5 -> 1.5, and ends there
    st = torch.load(data_root / "d-local4-ramp" / "checkpoints" / "step-0000016" / "state.pt", weights_only=False)
    assert [g["lr"] for g in st["local"]["outer"]["param_groups"]] == [pytest.approx(1.5)]
    ramp = logged_losses(data_root, "d-local4-ramp")
    assert ramp[4] == l4[4] and ramp[8] != l4[8]


def test_a_slow_worker_does_not_hold_back_the_fast_one(data_root, tmp_path):
    """Rank 1 sleeps 0.5 s in every forward: under straggler = deadline rank 0 keeps taking H
    steps per round, rank 1 as many as fit, and a round takes rank 0 at most half the 4 s that
    waiting for rank 1's 8 steps would (the policy: (1 + slack) x rank 0's 8 steps plus one of
    rank 1's). The slack is 1, not the default 0.25, so that rank 0's own pace may vary by 2x
    from round to round on a machine busy with other tests (make test runs two at once)."""
    cfg = small_config(data_root, "d-slow", max_steps=40, sync="local", outer_every=8, straggler="deadline", straggler_slack=1.0)
    runs = {"slow": cfg}
    body = (
        "from teragram.model.gpt import GPT\n"
        "if dist.get_rank() == 1:\n"
        "    fwd = GPT.forward\n"
        "    GPT.forward = lambda self, *a, **k: (time.sleep(0.5), fwd(self, *a, **k))[1]\n" + _configs(runs) + "train(cfg['slow'])"
    )
    torchrun(_script(tmp_path, body))
    rounds = [r for r in _rows(data_root, "d-slow") if "round_steps" in r]
    assert len(rounds) == 5 and all(r["round_steps"][0] == 8 for r in rounds)
    assert rounds[0]["round_steps"][1] == 8  # the first round has no measurement: all wait
    assert all(r["round_steps"][1] < 8 for r in rounds[1:]), [r["round_steps"] for r in rounds]
    per_round = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rounds[1:], rounds[2:])]
    assert max(per_round) < 2.0, per_round


def test_bad_distributed_settings_are_refused_on_every_rank(data_root, tmp_path):
    cli = [sys.executable, "-m", "teragram.serve.main", "train"]
    base = [f"--index={data_root / 'idx'}", f"--out={tmp_path / 'bad'}", "--preset=tiny", "--max_steps=2"]
    for extra, msg in [
        (["--sync=local", "--compress=1bit"], "compress = 1bit"),
        (["--sync=local", "--outer_every=0"], "outer_every must be >= 1"),
        (["--sync=local", "--zero1=true"], "sync = local keeps a whole optimizer"),
        (["--outer_dtype=bf16"], "they need sync = local"),
        (["--outer_lr_end=1.5"], "they need sync = local"),
    ]:
        r = subprocess.run(cli + base + extra, cwd=REPO, capture_output=True, text=True)
        assert r.returncode != 0 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    # ranks started with different learning rates: both refuse, with one line each
    logs = tmp_path / "logs"
    cmd = " ".join(cli + base) + " --lr=0.00${RANK}1"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "--monitor-interval=2",
            f"--log-dir={logs}",
            "--redirects=3",
            "--no-python",
            "bash",
            "-c",
            cmd,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0
    errs = [p.read_text() for p in sorted(logs.rglob("stderr.log"))]
    assert len(errs) == 2 and all("ranks disagree on the training config (lr)" in e and "Traceback" not in e for e in errs), errs


def test_two_launchers_meet_through_torchruns_rendezvous(data_root, tmp_path):
    """The README's two-host command, with both "hosts" on this machine: two torchrun launchers
    (one process each) find each other through the c10d rendezvous and train with 1-bit."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d"]
    run += [f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=two-hosts", "-m", "teragram.serve.main", "train"]
    run += [f"--index={data_root / 'idx'}", f"--out={tmp_path / 'run'}", "--preset=tiny", "--max_steps=6", "--block_size=32"]
    run += ["--batch_size=4", "--compress=1bit", "--compress_after=2", "--progress=false", "--log_every=1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    hosts = [subprocess.Popen(run, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [h.communicate(timeout=300)[0] for h in hosts]
    assert [h.returncode for h in hosts] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 6 and rows[-1]["comm_bytes"] > 0
