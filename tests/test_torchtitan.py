"""dtcp.integrations.torchtitan against torchtitan 0.2.2 (installed by `pip install -e ".[dev,torchtitan]"`).

torchtitan's Trainer itself does not run on a CPU-only machine: torchtitan.tools.utils picks
device_type "cuda" when no accelerator exists, Trainer.__init__ calls torch.cuda.set_device and
init_distributed picks NCCL. So these tests drive the trainer's own pieces on gloo ranks: the
config manager, the registered train spec (its parallelize_fn: dtcp attention + FSDP over the cp
mesh, optionally torch.compile), Trainer.post_dataloading_process (torchtitan's input sharding,
routed to dtcp's layout), the loss function, and compare loss and gradients with the same model
on one process without CP.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import types

import pytest
import torch
import torch.distributed as dist

import dtcp
from dist_harness import run_ranks
from reference import rel_err

# torchtitan is an optional extra (`pip install -e ".[torchtitan]"`, which CI installs); where it is
# not installed this module is skipped as a whole, not an error at collection. Only absence skips:
# an installed torchtitan that fails to import fails the tests.
if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed (pip install -e '.[torchtitan]')", allow_module_level=True)
from importlib.metadata import version as _version  # noqa: E402

if not _version("torchtitan").startswith("0.2."):
    pytest.skip(f"torchtitan {_version('torchtitan')} is installed; these tests are for 0.2.2 "
                "(tests/test_torchtitan03.py covers 0.3)", allow_module_level=True)

import dtcp.integrations.torchtitan as dt  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.protocols.train_spec import get_train_spec  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "torchtitan")
CONFIGS = ["llama3_debug_cp2.toml", "llama3_debug_cp2_compile.toml", "llama3_debug_cp2_docmask.toml"]


def parse(*args: str):
    return ConfigManager().parse_args(list(args))


# ---- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONFIGS)
def test_example_configs_parse(name):
    cfg = parse("--job.config_file", os.path.join(EXAMPLES, name))
    assert cfg.model.name == "llama3_dtcp"
    assert cfg.parallelism.context_parallel_degree == 2
    assert cfg.experimental.custom_import == "dtcp.integrations.torchtitan"
    assert (cfg.dtcp.layout, cfg.dtcp.backend, cfg.dtcp.window_size, cfg.dtcp.strategy) == ("zigzag", "auto", -1, "auto")
    assert cfg.compile.enable == ("compile" in name)
    assert cfg.model.flavor == ("debugmodel_varlen_attn" if "docmask" in name else "debugmodel")
    opts = dt.dtcp_options(cfg)
    assert opts == dt.DtcpOptions(layout=dtcp.Zigzag(), backend="auto", window_size=None)


def test_cli_overrides_and_defaults():
    cfg = parse(
        "--job.config_file", os.path.join(EXAMPLES, CONFIGS[0]),
        "--dtcp.layout", "striped:4", "--dtcp.backend", "math", "--dtcp.strategy", "ulysses",
    )
    assert dt.dtcp_options(cfg) == dt.DtcpOptions(dtcp.Striped(4), "math", None, "ulysses")
    # kv_exchange, the deprecated alias, still works (with a warning)
    cfg = parse("--job.custom_config_module", "dtcp.integrations.torchtitan", "--dtcp.kv_exchange", "ring")
    with pytest.warns(DeprecationWarning, match="use \\[dtcp\\] strategy"):
        assert dt.dtcp_options(cfg).strategy == "ring"
    # The section exists with its defaults whenever the custom config module is named.
    cfg = parse("--job.custom_config_module", "dtcp.integrations.torchtitan")
    assert cfg.dtcp == dt.Dtcp()
    assert dt.dtcp_options(cfg) == dt.DtcpOptions(dtcp.Zigzag(), "auto", None)
    # Without it, torchtitan knows no [dtcp] section and dtcp uses the defaults.
    assert dt.dtcp_options(parse()) == dt.DtcpOptions(dtcp.Zigzag(), "auto", None)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("layout", "diagonal", r"\[dtcp\] layout = 'diagonal'"),
        ("backend", "fast", r"\[dtcp\] backend = 'fast': use one of \['auto', "),
        ("window_size", -2, r"\[dtcp\] window_size = -2"),
        ("kv_exchange", "p2p", r"\[dtcp\] kv_exchange = 'p2p': use one of \['auto', 'ring', 'allgather'\]"),
        ("strategy", "hybrid", r"\[dtcp\] strategy = 'hybrid': use one of \['auto', 'ring', 'allgather', 'ulysses'\]"),
    ],
)
def test_bad_options_name_the_key(field, value, match):
    cfg = parse("--job.custom_config_module", "dtcp.integrations.torchtitan")
    setattr(cfg.dtcp, field, value)
    with pytest.raises(ValueError, match=match):
        dt.dtcp_options(cfg)


def test_window_size_option():
    cfg = parse("--job.custom_config_module", "dtcp.integrations.torchtitan", "--dtcp.window_size", "128")
    assert dt.dtcp_options(cfg).window_size == (128, 0)
    cfg.dtcp.window_size = 0  # each token sees itself only
    assert dt.dtcp_options(cfg).window_size == (0, 0)


# ---- the train spec ----------------------------------------------------------------------------
def test_train_spec_is_llama3_with_dtcp_parallelize():
    spec, base = get_train_spec("llama3_dtcp"), get_train_spec("llama3")
    for f in ("model_cls", "pipelining_fn", "build_optimizers_fn", "build_dataloader_fn", "build_tokenizer_fn",
              "build_loss_fn", "build_validator_fn", "state_dict_adapter"):
        assert getattr(spec, f) is getattr(base, f), f
    assert spec.parallelize_fn.__name__ == "dtcp_parallelize_llama"
    assert set(spec.model_args) == set(base.model_args)
    for flavor, args in base.model_args.items():
        ours = spec.model_args[flavor]
        assert isinstance(ours, type(args)) and ours is not args
        assert dataclasses.asdict(ours) == dataclasses.asdict(args), flavor


def test_document_masked_flavor_under_cp():
    cfg = parse("--job.config_file", os.path.join(EXAMPLES, "llama3_debug_cp2_docmask.toml"))
    with pytest.raises(NotImplementedError, match="Varlen attention is not supported with CP"):
        get_train_spec("llama3").model_args["debugmodel_varlen_attn"].update_from_config(cfg)  # torchtitan's own
    ours = get_train_spec("llama3_dtcp").model_args["debugmodel_varlen_attn"]
    ours.update_from_config(cfg)
    assert ours.attn_type == "varlen" and ours.attn_mask_type == "block_causal"
    assert ours.max_seq_len == cfg.training.seq_len


def test_torchtitan_boundaries_are_each_rows_documents():
    """torchtitan's boundaries over the flattened B*S batch, as dtcp's cu_seqlens reads them:
    each row's own documents (0, ..., S)."""
    from torchtitan.models.attention import create_varlen_metadata_for_document

    from dtcp.plan import row_cu_seqlens, segments_from_cu_seqlens

    S, eos = 16, 0
    batch = torch.ones(4, S, dtype=torch.long)
    eos_at = [[3, 9], [], [0, 15], [7]]  # an EOS as first and as last token; a row of one document
    for b, positions in enumerate(eos_at):
        batch[b, positions] = eos
    cu = create_varlen_metadata_for_document(batch, eos).cu_seq_q
    assert cu.dtype == torch.int32 and int(cu[-1]) == 4 * S
    rows = row_cu_seqlens(tuple(cu.tolist()), 4, S)
    for b, positions in enumerate(eos_at):
        starts = sorted({0, *(p + 1 for p in positions if p + 1 < S)})
        expected = tuple(zip(starts, starts[1:] + [S]))
        assert segments_from_cu_seqlens(rows[b], S) == expected, (b, rows[b])
    one = create_varlen_metadata_for_document(batch[2:3], eos).cu_seq_q  # B == 1: the row's own
    assert row_cu_seqlens(tuple(one.tolist()), 1, S) == (tuple(one.tolist()),)


# ---- on 2 gloo ranks: the model --------------------------------------------------------------
SEQ, BATCH, VOCAB = 64, 2, 128


def tiny_args(**kw):
    from torchtitan.models.llama3 import TransformerModelArgs

    kw = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, rope_theta=500000, max_seq_len=SEQ) | kw
    return TransformerModelArgs(**kw)


def tiny_model(dtype, seed=0, **args):
    from torchtitan.models.llama3 import Transformer

    torch.manual_seed(seed)
    model = Transformer(tiny_args(**args))
    with torch.no_grad():  # as torchtitan's Trainer does
        model.init_weights()
    freqs_cis = model.freqs_cis  # complex64: Module.to(float64) would keep only its real part
    model = model.to(dtype)
    model.freqs_cis = freqs_cis
    return model


def tokens_and_labels(seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def single_process_reference(dtype):
    """Loss sum / tokens and parameter gradients of the model without CP, whole sequences."""
    from torchtitan.components.loss import cross_entropy_loss

    model = tiny_model(dtype)
    inputs, labels = tokens_and_labels()
    loss = cross_entropy_loss(model(inputs), labels) / labels.numel()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def worker_attention_swap(layout_spec, dtype_name):
    """float64: replace the attention of the stock llama3 model, shard the batch with torchtitan's
    prepare_context_parallel_input (routed to dtcp), compare loss and gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    dtype = getattr(torch, dtype_name)
    cp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    options = dt.DtcpOptions(dtcp.layout_from_spec(layout_spec), "auto", None)

    model = tiny_model(dtype)
    n = dt.apply_dtcp_to_attention(model, cp_mesh.get_group(), options)
    kinds = {type(layer.attention.inner_attention) for layer in model.layers.values()}
    dt._own_cp_mesh(cp_mesh, options.layout)

    inputs, labels = tokens_and_labels()
    inputs_l, labels_l, extra = prepare_context_parallel_input(inputs, labels, {}, cp_mesh, torch.device("cpu"))
    expected_pos = options.layout.positions(SEQ, cp_mesh.get_group())
    assert torch.equal(extra["positions"], expected_pos.to(torch.int32).expand(BATCH, -1)), extra["positions"]
    assert torch.equal(inputs_l, options.layout.shard(inputs, cp_mesh.get_group(), dim=1))

    loss = cross_entropy_loss(model(inputs_l, **extra), labels_l) / labels.numel()
    loss.backward()
    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum)
    ref_loss, ref_grads = single_process_reference(dtype)
    errs = {"loss": rel_err(loss_sum, ref_loss)}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        errs[name] = rel_err(g, ref_grads[name])
    return {"replaced": n, "kinds": sorted(k.__name__ for k in kinds), "errs": errs}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped:1", "striped:2"])
def test_llama3_attention_swap_equals_no_cp_float64(layout):
    for r in run_ranks(2, worker_attention_swap, layout, "float64", timeout=300):
        assert r["replaced"] == 2 and r["kinds"] == ["DtcpRingAttention"], r
        grads = {k: v for k, v in r["errs"].items() if k != "loss"}
        worst = max(grads.items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-12, (worst, grads)
        # torchtitan's cross_entropy_loss computes in float32 (pred.float()) and sums in another
        # order over two shards: float32 rounding, not float64.
        assert r["errs"]["loss"] < 1e-6, r["errs"]["loss"]


# ---- document masking and sliding windows, against a dense reference --------------------------
EOS, DOC_BATCH = 0, 3
# Per row: where the EOS tokens are (a new document starts after each). Documents cross the
# shard boundaries of every layout; one row ends on an EOS, one has a single document.
DOC_EOS = [[5, 20, 41], [], [0, 30, 33, 63]]


def doc_tokens_and_labels(seed=2):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (DOC_BATCH, SEQ + 1), generator=g)
    for b, positions in enumerate(DOC_EOS):
        tokens[b, positions] = EOS
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class DenseReferenceAttention(torch.nn.Module):
    """Single-process reference for the attention wrappers: dense SDPA with an explicit mask,
    causal, within a window of `window` tokens back (None: none) and, with `documents`, within
    one document, documents read off the tokens (each EOS ends one), not off torchtitan's
    boundaries."""

    def __init__(self, window=None, documents=None):
        super().__init__()
        self.window = window
        self.documents = documents  # (B, S) document index of each token, or None

    def forward(self, q, k, v, attention_masks=None, *, scale=None, enable_gqa=False):
        B, S = q.shape[0], q.shape[2]
        i = torch.arange(S)
        mask = i[None, :] <= i[:, None]  # (query, key)
        if self.window is not None:
            mask = mask & (i[:, None] - i[None, :] <= self.window)
        mask = mask.expand(B, 1, S, S)
        if self.documents is not None:
            d = self.documents
            mask = mask & (d[:, None, :, None] == d[:, None, None, :])
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        # torchtitan's varlen branch takes the output as (B, S, H, D); the sdpa one transposes.
        return out.transpose(1, 2).contiguous() if attention_masks is not None else out


def masked_reference(dtype, inputs, labels, window, documents):
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.attention import create_varlen_metadata_for_document

    model = tiny_model(dtype, **({"attn_type": "varlen", "attn_mask_type": "block_causal"} if documents else {}))
    docs = None
    if documents:
        eos_before = torch.cumsum((inputs == EOS).long(), dim=1) - (inputs == EOS).long()
        docs = eos_before  # tokens after the k-th EOS are document k; an EOS ends its document
    for layer in model.layers.values():
        layer.attention.inner_attention = DenseReferenceAttention(window, docs)
    masks = {"attention_masks": create_varlen_metadata_for_document(inputs, EOS)} if documents else {}
    loss = cross_entropy_loss(model(inputs, **masks), labels) / labels.numel()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _errs(model, loss, labels, ref, reduce=True):
    ref_loss, ref_grads = ref
    loss_sum = loss.detach().clone()
    if reduce:
        dist.all_reduce(loss_sum)
    errs = {"loss": rel_err(loss_sum, ref_loss)}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if reduce:
            dist.all_reduce(g)
        errs[name] = rel_err(g, ref_grads[name])
    return errs


def worker_masked_cases(cases, dtype_name):
    """float64, CP = all ranks: for each (documents, layout, window) the tiny llama3 (varlen flavor
    with documents) with dtcp attention, its batch through Trainer.post_dataloading_process (masks
    from EOS tokens on the whole batch, then dtcp's sharding), against the same model without CP
    and with dense masked attention."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.train import Trainer

    dtype = getattr(torch, dtype_name)
    cp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    results = []
    for documents, layout_spec, window, *kv_exchange in cases:
        options = dt.DtcpOptions(dtcp.layout_from_spec(layout_spec), "auto", None if window is None else (window, 0),
                                 *kv_exchange)
        varlen = {"attn_type": "varlen", "attn_mask_type": "block_causal"} if documents else {}
        model = tiny_model(dtype, **varlen)
        n = dt.apply_dtcp_to_attention(model, cp_mesh.get_group(), options)
        dt._own_cp_mesh(cp_mesh, options.layout)
        modes = {layer.attention.inner_attention.document_masking for layer in model.layers.values()}
        inputs, labels = doc_tokens_and_labels() if documents else tokens_and_labels()
        trainer = types.SimpleNamespace(
            model_args=model.model_args, tokenizer=types.SimpleNamespace(eos_id=EOS), model_parts=[model],
            parallel_dims=types.SimpleNamespace(cp_enabled=True, get_mesh=lambda name: cp_mesh),
            job_config=types.SimpleNamespace(parallelism=types.SimpleNamespace(context_parallel_load_balancer="headtail")),
            device=torch.device("cpu"),
        )
        inputs_l, labels_l, extra_inputs, extra_kwargs = Trainer.post_dataloading_process(
            trainer, {"input": inputs}, labels
        )
        loss = cross_entropy_loss(model(inputs_l, **extra_inputs, **extra_kwargs), labels_l) / labels.numel()
        loss.backward()
        errs = _errs(model, loss, labels, masked_reference(dtype, inputs, labels, window, documents))
        results.append({"case": (documents, layout_spec, window, *kv_exchange), "replaced": n, "modes": sorted(modes),
                        "local_len": inputs_l.shape[1], "errs": errs})
    return results


MASKED_CASES = [
    (True, "zigzag", None), (True, "contiguous", None), (True, "striped:1", None), (True, "striped:4", None),
    (True, "zigzag", 9), (True, "contiguous", 20),   # documents and a window together
    (False, "zigzag", 5), (False, "contiguous", 40), (False, "striped:2", 1),  # window only
    # the all-gather schedule: each batch row's documents in one varlen call for the batch
    (True, "zigzag", None, "allgather"), (True, "contiguous", 20, "allgather"),
]


def test_llama3_document_mask_and_window_equal_dense_reference_float64():
    for rank_results in run_ranks(2, worker_masked_cases, MASKED_CASES, "float64", timeout=300):
        for r in rank_results:
            documents = r["case"][0]
            assert r["replaced"] == 2 and r["modes"] == [documents] and r["local_len"] == SEQ // 2, r
            grads = {k: v for k, v in r["errs"].items() if k != "loss"}
            worst = max(grads.items(), key=lambda kv: kv[1])
            assert worst[1] < 1e-12, (r["case"], worst, grads)
            assert r["errs"]["loss"] < 1e-6, (r["case"], r["errs"]["loss"])  # float32 cross entropy


def test_masked_reference_is_not_plain_causal():
    """The cases above would pass vacuously if masks changed nothing: they change the gradients."""
    inputs, labels = doc_tokens_and_labels()
    _, plain = masked_reference(torch.float64, inputs, labels, None, False)
    for window, documents in ((None, True), (5, False)):
        _, masked = masked_reference(torch.float64, inputs, labels, window, documents)
        assert max(rel_err(masked[n], plain[n]) for n in plain) > 1e-2, (window, documents)


def worker_window_without_cp(window):
    """context_parallel_degree = 1 with a [dtcp] window: the train spec's parallelize puts dtcp
    attention on a one-rank group of each process; whole sequences, no sharding."""
    from torchtitan.components.loss import cross_entropy_loss

    cfg = parse("--job.custom_config_module", "dtcp.integrations.torchtitan", "--dtcp.window_size", str(window))
    model = tiny_model(torch.float64)
    model = dt._dtcp_parallelize(lambda m, parallel_dims, job_config: m)(
        model, types.SimpleNamespace(cp_enabled=False), cfg
    )
    inner = [layer.attention.inner_attention for layer in model.layers.values()]
    inputs, labels = tokens_and_labels()
    loss = cross_entropy_loss(model(inputs), labels) / labels.numel()
    loss.backward()
    errs = _errs(model, loss, labels, masked_reference(torch.float64, inputs, labels, window, False), reduce=False)
    return {"kinds": sorted({type(m).__name__ for m in inner}), "cp": [m.cp_size for m in inner],
            "window": [m.window_size for m in inner], "errs": errs}


def test_window_with_cp1_runs_through_dtcp():
    for r in run_ranks(2, worker_window_without_cp, 7, timeout=120):
        assert r["kinds"] == ["DtcpRingAttention"] and r["cp"] == [1, 1] and r["window"] == [(7, 0)] * 2, r
        worst = max(r["errs"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-12, (worst, r["errs"])  # one process: same sums as the reference


def worker_torchtitan_pieces(compile_backend, layout, documents=False, kv_exchange="auto"):
    """float32 through torchtitan's pieces: ParallelDims meshes, the llama3_dtcp train spec's
    parallelize_fn (dtcp attention, FSDP over the cp mesh, optionally torch.compile per block),
    Trainer.post_dataloading_process and the spec's loss function. `documents`: the varlen
    (document-masked) llama3, masks from EOS tokens."""
    import torchtitan.distributed.parallel_dims as pd
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import ParallelDims
    from torchtitan.train import Trainer

    pd.device_type = "cpu"  # torchtitan falls back to "cuda" when no accelerator exists
    args = ["--job.custom_config_module", "dtcp.integrations.torchtitan",
            "--model.name", "llama3_dtcp", "--parallelism.context_parallel_degree", "2",
            "--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH),
            "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none",
            "--dtcp.layout", layout, "--dtcp.strategy", kv_exchange]
    if compile_backend:
        args += ["--compile.enable", "--compile.backend", compile_backend]
    cfg = parse(*args)
    parallel_dims = ParallelDims(dp_shard=-1, dp_replicate=1, cp=2, tp=1, pp=1, ep=1, etp=1,
                                 world_size=dist.get_world_size())
    parallel_dims.build_mesh()
    spec = get_train_spec(cfg.model.name)

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(torch.float32, **({"attn_type": "varlen", "attn_mask_type": "block_causal"} if documents else {}))
    model = spec.parallelize_fn(model, parallel_dims, cfg)
    for m in model.modules():
        # torchtitan sets gradient_divide_factor=1.0, which FSDP reduces with PREMUL_SUM;
        # gloo lacks PREMUL_SUM. A plain SUM (times 1.0) is the same reduction.
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    kinds = sorted({type(layer.attention.inner_attention).__name__ for layer in model.layers.values()})
    loss_fn = spec.build_loss_fn(cfg, parallel_dims=parallel_dims)

    trainer = types.SimpleNamespace(
        model_args=model.model_args, parallel_dims=parallel_dims, job_config=cfg,
        tokenizer=types.SimpleNamespace(eos_id=EOS) if documents else None,
        model_parts=[model], device=torch.device("cpu"),
    )
    inputs, labels = doc_tokens_and_labels() if documents else tokens_and_labels()
    inputs_l, labels_l, extra_inputs, extra_kwargs = Trainer.post_dataloading_process(
        trainer, {"input": inputs}, labels
    )
    loss = loss_fn(model(inputs_l, **extra_inputs, **extra_kwargs), labels_l) / labels.numel()
    loss.backward()
    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum)

    if documents:
        ref_loss, ref_grads = masked_reference(torch.float32, inputs, labels, None, True)
    else:
        ref_loss, ref_grads = single_process_reference(torch.float32)
    errs = {"loss": rel_err(loss_sum, ref_loss)}
    for name, p in model.named_parameters():
        errs[name] = rel_err(p.grad.full_tensor(), ref_grads[name.replace("._orig_mod", "")])
    return {
        "kinds": kinds, "local_len": inputs_l.shape[1], "errs": errs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "compiled_frames": counters["stats"]["unique_graphs"],
    }


# striped:2 differs from torchtitan's own (head-tail) sharding, so the batch must go through dtcp's.
# The document-masked case: one ring call per batch row, inside compiled blocks too. On CPU `auto`
# is the ring; the all-gather schedule is asked for explicitly (eager: kept K/V; compiled: the
# traced route of the all-gather, inside torchtitan's compiled blocks).
@pytest.mark.parametrize(
    "compile_backend, layout, documents, kv_exchange",
    [(None, "striped:2", False, "auto"), ("aot_eager", "zigzag", False, "auto"), ("aot_eager", "zigzag", True, "auto"),
     (None, "contiguous", False, "allgather"), ("aot_eager", "zigzag", False, "allgather")],
)
def test_llama3_dtcp_train_spec_fsdp_equals_no_cp(compile_backend, layout, documents, kv_exchange):
    for r in run_ranks(2, worker_torchtitan_pieces, compile_backend, layout, documents, kv_exchange, timeout=600):
        assert r["kinds"] == ["DtcpRingAttention"] and r["local_len"] == SEQ // 2, r
        worst = max(r["errs"].items(), key=lambda kv: kv[1])
        assert worst[1] < 2e-6, (worst, r["errs"])  # float32 (FSDP params and grads in float32)
        assert r["graph_breaks"] == 0, r
        if compile_backend:
            assert r["compiled_frames"] >= 2, r  # the blocks (and the loss) were compiled


# ---- torchtitan's own trainer, end to end, from the example TOML ------------------------------
def _train(tmp_path, name, nproc, *args):
    """Run torchtitan's trainer under torchrun; return the path of rank 0's log.

    torchrun's own start-up (its rendezvous store, then each worker's connection to it) once hung
    for the whole time limit on a 2-core CI machine, before any trainer code ran. A start-up that
    does not finish process-group initialisation within `startup_s` is retried once on a fresh port;
    anything that goes wrong after initialisation (dtcp's code included) fails the test at once.
    """
    import subprocess
    import sys

    from dist_harness import close_all

    close_all()  # the spawned rank pools of earlier tests would compete with the trainer for 2 cores
    log = tmp_path / f"{name}.log"
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    initialised = "[GC] Initial GC collection"  # torchtitan logs it right after init_process_group
    startup_s, limit_s = 120, 300
    for attempt in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
               "--role", "rank", "--tee", "3", "--local-ranks-filter", "0",
               os.path.join(ROOT, "tests", "torchtitan_cpu_train.py"),
               "--job.config_file", os.path.join(EXAMPLES, "llama3_debug_cp2.toml"),
               "--job.dump_folder", str(tmp_path / name), "--training.steps", "3", "--training.seq_len", "128",
               "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
               "--model.hf_assets_path", str(tmp_path / "assets" / "tokenizer"),
               "--training.dataset_path", str(tmp_path / "assets" / "c4_tiny"), *args]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=startup_s)
            except subprocess.TimeoutExpired:
                if initialised not in log.read_text():
                    _kill_session(proc)
                    continue  # stuck in torchrun's start-up: try once more
                try:
                    rc = proc.wait(timeout=limit_s - startup_s)
                except subprocess.TimeoutExpired:
                    _kill_session(proc)
                    raise AssertionError(f"{name}: no exit within {limit_s} s\n" + log.read_text()[-4000:])
        assert rc == 0, log.read_text()[-4000:]
        return str(log)
    raise AssertionError(f"{name}: torchrun did not initialise its process group in {startup_s} s, twice\n"
                         + log.read_text()[-4000:])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_session(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
    except ProcessLookupError:
        pass
    proc.wait()


def test_torchtitan_trainer_cp2_dtcp_matches_cp1(tmp_path):
    """The example TOML through torchtitan's trainer (on CPU, see torchtitan_cpu_train.py): a seed
    checkpoint, then CP=1 on one rank and CP=2 with dtcp (striped:1) on two; float32 losses agree."""
    import subprocess
    import sys

    subprocess.run([sys.executable, os.path.join(EXAMPLES, "make_assets.py"), "--out", str(tmp_path / "assets")],
                   check=True, capture_output=True)
    _train(tmp_path, "seed", 1, "--parallelism.context_parallel_degree", "1",
           "--parallelism.data_parallel_shard_degree", "1", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    load = ["--checkpoint.enable", "--checkpoint.load_only",
            "--checkpoint.initial_load_path", str(tmp_path / "seed" / "checkpoint" / "step-0")]
    cp1 = _train(tmp_path, "cp1", 1, "--parallelism.context_parallel_degree", "1", *load)
    cp2 = _train(tmp_path, "cp2", 2, "--dtcp.layout", "striped:1", *load)

    sys.path.insert(0, EXAMPLES)
    from compare_losses import read_log

    a, b = read_log(cp1), read_log(cp2)
    assert sorted(a) == sorted(b) == [1, 2, 3], (a, b)
    for step in a:  # the logs print 5 decimals: 1e-5 of a loss near 8 is the print resolution
        assert abs(a[step][0] - b[step][0]) <= 1e-5 * abs(a[step][0]) + 1e-5, (step, a, b)
    assert "Applied dtcp ring attention to 6 attention modules" in open(cp2).read()


def test_bad_dtcp_section_fails_before_the_model_is_built():
    # The trainer calls model_args.update_from_config first: bad keys fail there, at any cp degree.
    cfg = parse("--job.custom_config_module", "dtcp.integrations.torchtitan", "--dtcp.layout", "spiral")
    with pytest.raises(ValueError, match=r"\[dtcp\] layout = 'spiral'"):
        get_train_spec("llama3_dtcp").model_args["debugmodel"].update_from_config(cfg)
