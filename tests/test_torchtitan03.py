"""dtcp.integrations.torchtitan against torchtitan 0.3.0 (torch >= 2.14), real trainer runs on CPU.

Runs in the torchtitan 0.3 venv that .ci/run builds (README, Test); skipped in the main suite,
whose torchtitan is 0.2.2 (tests/test_torchtitan.py covers that one).

torchtitan's own trainer (`torchtitan.train.main`, through tests/torchtitan03_cpu_train.py,
which only points its device at the CPU) under torchrun with gloo, on tiny assets made by
examples/torchtitan/make_assets.py: a seed checkpoint, then CP=1 and CP=2/4 runs from it on the
same batches. At CP=1 the attention is dtcp's on one rank (whole sequences: the packed documents
and windows that torchtitan's CPU backends cannot train, flex having no CPU backward and varlen
being CUDA-only), so every CP>1 run is compared with the same model without context parallelism.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
from typing import Optional

import pytest


def _torchtitan_release():
    if importlib.util.find_spec("torchtitan") is None:
        return None
    from importlib.metadata import version

    return tuple(int(x) for x in version("torchtitan").split(".")[:2])


# Only absence of torchtitan 0.3 skips; a 0.3 that fails to import fails the tests.
if _torchtitan_release() != (0, 3):
    pytest.skip("torchtitan 0.3 is not installed here (the main suite has torchtitan 0.2.2; "
                "this file runs in the torchtitan 0.3 venv, see README, Test)", allow_module_level=True)

import torch  # noqa: E402

import dtcp  # noqa: E402
import dtcp.integrations.torchtitan as dt  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "torchtitan")
CONFIGS = "dtcp.integrations.torchtitan.configs"


def parse(*args: str):
    return ConfigManager().parse_args(list(args))


# ---- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, model", [("llama3_debug_dtcp", "llama3"), ("qwen3_debug_dtcp", "qwen3")])
def test_config_functions(name, model):
    cfg = parse("--module", CONFIGS, "--config", name)
    assert type(cfg) is dt.DtcpTrainer.Config
    assert cfg.model_spec.name == model and cfg.parallelism.context_parallel_degree == 2
    assert cfg.dtcp == dt.DtcpSection()
    opts = dt.dtcp_options(cfg.dtcp)
    assert opts == dt.DtcpOptions(layout=dtcp.Zigzag(), strategy="auto", backend="auto", window_size=None,
                                  documents=True)
    # the model spec the trainer builds from it: dtcp's attention in every layer
    spec = dt.dtcp_model_spec(cfg.model_spec, opts)
    inner = [c for _, c, _, _ in spec.model.traverse(dt.DtcpAttention.Config)]
    assert len(inner) == len(cfg.model_spec.model.layers) > 0
    assert spec.parallelize_fn.dtcp_base is cfg.model_spec.parallelize_fn
    assert dt.dtcp_model_spec(spec, opts).parallelize_fn.dtcp_base is cfg.model_spec.parallelize_fn  # idempotent


def test_cli_sets_the_dtcp_section():
    cfg = parse("--module", CONFIGS, "--config", "llama3_debug_dtcp", "--dtcp.layout", "striped:4",
                "--dtcp.strategy", "ulysses", "--dtcp.window_size", "64", "--dtcp.backend", "math",
                "--dtcp.no-documents")
    assert dt.dtcp_options(cfg.dtcp) == dt.DtcpOptions(dtcp.Striped(4), "ulysses", "math", (64, 0), False)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("layout", "diagonal", r"--dtcp.layout 'diagonal'"),
        ("strategy", "hybrid", r"--dtcp.strategy 'hybrid': use one of \['auto', 'ring', 'allgather', 'ulysses'\]"),
        ("backend", "fast", r"--dtcp.backend 'fast': use one of \['auto', "),
        ("window_size", -2, r"--dtcp.window_size -2: use -1 \(no window\)"),
    ],
)
def test_bad_options_name_the_flag(field, value, match):
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    with pytest.raises(ValueError, match=match):
        dt.dtcp_config(llama3_debugmodel(), **{field: value})


def test_any_layout_spec_passes_through():
    """The layout option is dtcp's layout spec string, whatever layouts dtcp has."""
    for spec in ("zigzag", "contiguous", "striped", "striped:8", "auto", "auto@64"):
        assert dt.dtcp_options(dt.DtcpSection(layout=spec)).layout == dtcp.layout_from_spec(spec)
    for spec in ("balanced:8,8", "doczigzag:8,8"):  # fixed documents: every batch brings its own
        with pytest.raises(ValueError, match="use 'auto'"):
            dt.dtcp_options(dt.DtcpSection(layout=spec))


def test_document_boundaries_from_positions():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2],    # three documents
                              [5, 6, 7, 0, 1, 2, 3, 4],    # a row starting inside a document
                              [0, 1, 2, 3, 4, 5, 6, 7]])   # one document
    cu = dt.document_boundaries(positions)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 5, 8, 11, 16, 24]


def test_dtcp_config_keeps_the_stock_fields():
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    stock = llama3_debugmodel()
    ours = dt.dtcp_config(stock, layout="contiguous", window_size=5)
    assert ours.model_spec is stock.model_spec and ours.training is stock.training
    assert ours.dtcp == dt.DtcpSection(layout="contiguous", window_size=5)


# ---- torchtitan's trainer, end to end ----------------------------------------------------------
STEPS, SEQ, BATCH = 10, 128, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(out, name, nproc, *args, batch: int = BATCH, env_extra: Optional[dict] = None) -> dict[int, float]:
    """torchtitan's trainer under torchrun (`nproc` gloo ranks), with `env_extra` set; rank 0's
    loss per step."""
    try:
        from dist_harness import close_all

        close_all()  # spawned rank pools of earlier tests would compete for the 2 cores
    except ImportError:
        pass
    log = out / f"{name}.log"
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", HF_HOME=str(out / "hf"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--tee", "3",
           "--local-ranks-filter", "0", os.path.join(ROOT, "tests", "torchtitan03_cpu_train.py"),
           "--module", CONFIGS, "--config", "llama3_debug_dtcp", "--dump_folder", str(out / name),
           "--training.steps", str(STEPS), "--training.seq_len", str(SEQ), "--training.local_batch_size", str(batch),
           "--training.mixed_precision_param", "float32", "--hf_assets_path", str(out / "assets" / "tokenizer"),
           "--dataloader.dataset_path", str(out / "assets" / "c4_tiny"), "--validator.freq", "1000000",
           "--debug.seed", "42", *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=420)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"{name}: no exit within 420 s\n" + log.read_text()[-4000:])
    text = log.read_text()
    assert rc == 0, text[-5000:]
    losses = {int(s): float(v) for s, v in re.findall(r"DTCP_LOSS (\d+) (\S+)", text)}
    assert sorted(losses) == list(range(1, STEPS + 1)), (name, losses, text[-3000:])
    return losses


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """Tiny assets and one seed checkpoint (1 rank) that every run loads."""
    out = tmp_path_factory.mktemp("tt03")
    subprocess.run([sys.executable, os.path.join(EXAMPLES, "make_assets.py"), "--out", str(out / "assets")],
                   check=True, capture_output=True)
    one = ["--parallelism.context_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "1"]
    _train_seed = [*one, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]
    log = out / "seed.log"
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", HF_HOME=str(out / "hf"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--nnodes=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{_free_port()}", os.path.join(ROOT, "tests", "torchtitan03_cpu_train.py"),
           "--module", CONFIGS, "--config", "llama3_debug_dtcp", "--dump_folder", str(out / "seed"),
           "--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH),
           "--hf_assets_path", str(out / "assets" / "tokenizer"), "--dataloader.dataset_path",
           str(out / "assets" / "c4_tiny"), "--debug.seed", "42", *_train_seed]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=300).returncode
    assert rc == 0, log.read_text()[-4000:]
    load = ["--checkpoint.enable", "--checkpoint.load_only",
            "--checkpoint.initial_load_path", str(out / "seed" / "checkpoint" / "step-0")]
    return out, load


_REFERENCES: dict = {}


def _cp1(seeded, *dtcp_args, batch: int = BATCH) -> dict[int, float]:
    """CP=1 on one rank (dtcp attention, whole sequences), cached per dtcp options and batch size."""
    out, load = seeded
    key = (tuple(dtcp_args), batch)
    if key not in _REFERENCES:
        _REFERENCES[key] = _train(out, f"cp1_{len(_REFERENCES)}", 1, "--parallelism.context_parallel_degree", "1",
                                  *load, *dtcp_args, batch=batch)
    return _REFERENCES[key]


def _assert_close(ref, got, what):
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref)
    print(f"{what}: worst relative loss difference over {len(ref)} steps = {worst:.2e}")
    assert worst <= 1e-5, (what, ref, got)
    # the runs trained: the losses moved
    assert ref[1] - ref[STEPS] > 1e-3, ref


# (nproc = cp degree, dtcp options, compile). Documents are on throughout (0.3's language-model
# default; torchtitan's own CP refuses them with varlen). Windows are what 0.3 has no option for.
RUNS = [
    pytest.param(2, ["--dtcp.layout", "zigzag", "--dtcp.strategy", "ring"], False, id="cp2-zigzag-ring-eager"),
    pytest.param(2, ["--dtcp.layout", "zigzag", "--dtcp.strategy", "allgather"], True, id="cp2-zigzag-allgather-compiled"),
    pytest.param(2, ["--dtcp.layout", "contiguous", "--dtcp.strategy", "ring", "--dtcp.window_size", "16"], True,
                 id="cp2-contiguous-ring-window16-compiled"),
    # 4 ranks on 2 cores are slow: one run covers them (Ulysses, a window, a striped layout)
    pytest.param(4, ["--dtcp.layout", "striped:2", "--dtcp.strategy", "ulysses", "--dtcp.window_size", "16"], False,
                 id="cp4-striped-ulysses-window16-eager"),
]


@pytest.mark.parametrize("cp, dtcp_args, compiled", RUNS)
def test_trainer_cp_matches_cp1(seeded, cp, dtcp_args, compiled):
    out, load = seeded
    window = dtcp_args[dtcp_args.index("--dtcp.window_size"):][:2] if "--dtcp.window_size" in dtcp_args else []
    ref = _cp1(seeded, *window)
    comp = ["--compile.enable", "--compile.backend", "aot_eager"] if compiled else []
    name = f"cp{cp}_" + "_".join(a.strip("-").replace(".", "").replace(":", "") for a in dtcp_args) + ("_c" if compiled else "")
    got = _train(out, name, cp, "--parallelism.context_parallel_degree", str(cp), *load, *dtcp_args, *comp)
    text = (out / f"{name}.log").read_text()
    assert f"dtcp: 6 attention modules over cp={cp}" in text, text[-3000:]
    _assert_close(ref, got, name)


def test_auto_layout_balances_one_packed_row(seeded):
    """--dtcp.layout auto with one packed row per batch (local_batch_size 1): each batch sharded
    with Balanced for its own documents, compiled; the losses equal CP=1's."""
    out, load = seeded
    ref = _cp1(seeded, batch=1)
    name = "cp2_auto_b1_c"
    got = _train(out, name, 2, "--parallelism.context_parallel_degree", "2", *load, "--dtcp.layout", "auto@8",
                 "--compile.enable", "--compile.backend", "aot_eager", "--dtcp.strategy", "ring", batch=1)
    text = (out / f"{name}.log").read_text()
    _assert_close(ref, got, name)
    # Balanced where a row packs several documents (a row of one document gets zigzag)
    assert "layout=auto@8" in text and "dtcp: layout auto -> balanced" in text, text[-3000:]
    # each step tells dtcp its transformer block's work (6 x 851,968 matmul weights), for "auto"'s step objective
    assert "dtcp: layer_flops_per_token 5.112e+06 (the model's transformer block)" in text, text[-3000:]


def test_auto_layout_places_for_the_device_objective(seeded):
    """The same under DTCP_COST_OBJECTIVE=device (eager, to spare the 2 cores a compile): each batch
    placed with both ring steps' host time hidden (Balanced(hidden_steps=2): "balanced@8+2"); the
    losses equal CP=1's."""
    out, load = seeded
    ref = _cp1(seeded, batch=1)
    name = "cp2_auto_b1_device"
    got = _train(out, name, 2, "--parallelism.context_parallel_degree", "2", *load, "--dtcp.layout", "auto@8",
                 "--dtcp.strategy", "ring", batch=1, env_extra={"DTCP_COST_OBJECTIVE": "device"})
    text = (out / f"{name}.log").read_text()
    _assert_close(ref, got, name)
    assert "dtcp: layout auto -> balanced@8+2 (" in text, text[-3000:]


def test_layer_flops_per_token_of_a_transformer_block():
    """6 x the matmul weights a token passes through in the first block (llama3's debug model:
    wqkv 768x256, wo 256x256, w1 and w3 768x256, w2 256x768; norms left out), built on meta."""
    from dtcp.integrations.torchtitan._v030 import layer_flops_per_token

    cfg = parse("--module", CONFIGS, "--config", "llama3_debug_dtcp")
    with torch.device("meta"):
        model = cfg.model_spec.model.build()
    assert layer_flops_per_token(model) == 6 * (768 * 256 + 256 * 256 + 3 * 768 * 256)
    assert layer_flops_per_token(torch.nn.Linear(2, 2)) is None  # (no `layers`)
    # a mixture of experts: weights stacked over 4 experts, 2 of which a token goes through (top_k)
    block = torch.nn.Module()
    block.proj = torch.nn.Linear(4, 8, bias=False)
    block.experts = torch.nn.Module()
    block.experts.w = torch.nn.Parameter(torch.zeros(4, 8, 4))
    block.router = torch.nn.Module()
    block.router.top_k = 2
    moe = torch.nn.Module()
    moe.layers = torch.nn.ModuleList([block, torch.nn.Linear(100, 100)])  # (the first block only)
    assert layer_flops_per_token(moe) == 6 * (4 * 8 + 2 * 8 * 4)


def test_attention_heads_of_the_model():
    """What the trainer gives layout="auto" (dtcp.config.attention_heads): the first attention
    module's heads (llama3's debug model: 16 of 16 dims, n_kv_heads None = n_heads)."""
    from dtcp.integrations.torchtitan._v030 import attention_heads

    cfg = parse("--module", CONFIGS, "--config", "llama3_debug_dtcp")
    with torch.device("meta"):
        model = cfg.model_spec.model.build()
    assert attention_heads(model) == (16, 16, 16)
    assert attention_heads(torch.nn.Linear(2, 2)) is None
    gqa = torch.nn.Module()
    gqa.attn = torch.nn.Module()
    gqa.attn.n_heads, gqa.attn.n_kv_heads, gqa.attn.head_dim = 32, 8, 128
    assert attention_heads(gqa) == (32, 8, 128)


def test_window_changes_the_losses(seeded):
    """The window runs would pass vacuously if the window changed nothing."""
    a, b = _cp1(seeded), _cp1(seeded, "--dtcp.window_size", "16")
    assert max(abs(a[s] - b[s]) for s in a) > 1e-3, (a, b)
