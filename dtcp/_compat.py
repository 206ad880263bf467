"""Every private or version-dependent torch API dtcp touches lives here.

Each entry names the torch versions it was checked on (2.11+cu130 on the GPU machines, 2.13.0+cpu
and 2.15.0 on CPU). When a new torch release breaks one, this is the only module to change. This
module imports nothing from dtcp.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


# ---- process groups -------------------------------------------------------------------------------
def group_from_name(name: str) -> "dist.ProcessGroup":
    """c10d._resolve_process_group: checked on 2.11, 2.13, 2.15."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def name_of_group(pg: "dist.ProcessGroup") -> str:
    """ProcessGroup.group_name: checked on 2.11, 2.13, 2.15."""
    return pg.group_name


def store_of_group(pg: "dist.ProcessGroup") -> "dist.Store":
    """The store the group was made with (a PrefixStore over the default store for subgroups).
    c10d._get_process_group_store: checked on 2.11, 2.13, 2.15; the store has set/get/wait/check/
    compare_set/add/multi_get/delete_key on TCPStore, HashStore and FileStore."""
    from torch.distributed.distributed_c10d import _get_process_group_store

    return _get_process_group_store(pg)


def new_group_like(pg: "dist.ProcessGroup", name: str, timeout_s: float, high_priority: bool) -> "dist.ProcessGroup":
    """A new group over pg's ranks named `name`, with its own timeout, made by the members only.

    dist.new_group(use_local_synchronization=True) names a group by a hash of its ranks, and torch
    2.13 refuses a second group of that name, so a caller's group made that way over the same
    ranks would collide. This builds the group as that function does, under a name of its own:
    c10d._new_process_group_helper(group_size, group_rank, global_ranks, backend, store, group_name,
    backend_options, timeout, ...) and _world.pg_group_ranks, checked on 2.13 and 2.15 (gloo) and
    2.11+cu130 (NCCL, with ProcessGroupNCCL.Options.is_high_priority_stream). Where that helper has
    another signature, new_group(use_local_synchronization=True) is used instead."""
    from torch.distributed import distributed_c10d as c10d

    backend = dist.get_backend(pg)
    ranks = dist.get_process_group_ranks(pg)
    opts = None
    if backend == "nccl" and high_priority:
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
    timeout = timedelta(seconds=timeout_s)
    try:
        new_pg, _ = c10d._new_process_group_helper(
            len(ranks), ranks.index(dist.get_rank()), ranks, backend, c10d._get_default_store(), name,
            backend_options=opts, timeout=timeout, group_desc="dtcp")
    except TypeError:  # another torch's helper signature
        return dist.new_group(ranks, timeout=timeout, backend=backend, pg_options=opts,
                              use_local_synchronization=True)
    c10d._world.pg_group_ranks[new_pg] = {g: i for i, g in enumerate(ranks)}
    return new_pg


def destroy_group(pg: "dist.ProcessGroup") -> None:
    """dist.destroy_process_group(pg) for a group that is no longer used. Never raises."""
    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 - best effort: it may be gone with a destroyed default group
        pass


def abort_group(pg: "dist.ProcessGroup") -> None:
    """Abort a group's pending operations (NCCL: ncclCommAbort), so that ranks blocked in it
    return with an error. ProcessGroup.abort: checked on 2.11 (NCCL) and 2.13 (gloo: no-op
    there). Never raises."""
    try:
        pg.abort()
    except Exception:  # noqa: BLE001 - best effort on an already failing group
        pass


# Whole-tensor all-gather / reduce-scatter (output and input single tensors, dim 0 split).
# torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
# reduce_scatter_single and deprecates the old names (FutureWarning); 2.11 has only the old ones.
# Checked on 2.11+cu130 (NCCL), 2.13.0+cpu and 2.15.0 (gloo, both names).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(output: torch.Tensor, input: torch.Tensor, pg: "dist.ProcessGroup") -> None:
    """output (N * input.shape[0], ...) <- every rank's input, rank-major."""
    _ALL_GATHER(output, input, group=pg)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, pg: "dist.ProcessGroup") -> None:
    """output <- the sum over ranks of their input's rank-th slice along dim 0."""
    _REDUCE_SCATTER(output, input, group=pg)


def all_to_all_into(output: torch.Tensor, input: torch.Tensor, pg: "dist.ProcessGroup") -> None:
    """output[j] <- rank j's input[this rank], along dim 0 (equal splits). Public API, here beside
    its siblings: dist.all_to_all_single, checked on 2.13.0+cpu and 2.15.0 (gloo, uint8)."""
    dist.all_to_all_single(output, input, group=pg)


def all_gather_autograd(x: torch.Tensor, pg: "dist.ProcessGroup") -> torch.Tensor:
    """Differentiable, traceable all-gather along dim 0 (backward: a reduce-scatter).
    torch.distributed._functional_collectives.all_gather_tensor_autograd(self, gather_dim, group):
    checked on 2.11+cu130 (NCCL) and 2.13.0+cpu (gloo, eager and compiled)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_gather_tensor_autograd(x, 0, pg)


# ---- symmetric memory (the copy-engine transport) ----------------------------------------------
def symm_mem_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.distributed._symmetric_memory.empty: checked on 2.11+cu130."""
    from torch.distributed import _symmetric_memory as symm_mem

    return symm_mem.empty(numel, dtype=dtype, device=device)


def symm_mem_rendezvous(tensor: torch.Tensor, group_name: str):
    """Exchange handles of `tensor` with the group's members (collective). enable_symm_mem_for_group
    must precede rendezvous on 2.11 (checked on 2.11+cu130); later releases deprecate it as a no-op.
    The handle's get_buffer(rank, shape, dtype) maps a peer's tensor."""
    import warnings

    from torch.distributed import _symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(group_name)
    return symm_mem.rendezvous(tensor, group_name)


# ---- recording a kernel wrapper's ops (dtcp/kernels/replay.py) ----------------------------------
def dispatch_mode_base() -> type:
    """torch.utils._python_dispatch.TorchDispatchMode, the base of a mode whose __torch_dispatch__
    sees every aten op of its thread (func: an OpOverload with _schema.is_mutable): checked on
    2.11+cu130 and 2.13.0+cpu."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def op_writes(func) -> bool:
    """Does aten op `func` (an OpOverload) write into an argument (in place, or out=)?
    OpOverload._schema.is_mutable: checked on 2.11+cu130 and 2.13.0+cpu."""
    return func._schema.is_mutable


def op_returns_views(func) -> bool:
    """Can an output of aten op `func` alias an argument (a view: detach, slice, transpose)?
    OpOverload._schema.returns[i].alias_info: checked on 2.13.0+cpu."""
    return any(r.alias_info is not None for r in func._schema.returns)


def allocation_bindings() -> dict:
    """aten allocation ops (the OpOverloads a dispatch mode sees) -> torch's Python bindings that
    take the arguments the dispatcher records for them (size or tensor, then dtype, layout, device,
    pin_memory, memory_format keywords): checked on 2.13.0+cpu, every entry
    (tests/test_kernel_replay.py calls each with recorded arguments), and on 2.11+cu130 the three
    FA4's wrapper makes (empty, empty_like, zeros)."""
    aten = torch.ops.aten
    return {aten.empty.memory_format: torch.empty, aten.empty_like.default: torch.empty_like,
            aten.zeros.default: torch.zeros, aten.zeros_like.default: torch.zeros_like,
            aten.empty_strided.default: torch.empty_strided, aten.full.default: torch.full}


from torch.utils import _pytree  # noqa: E402  (imported once: tree_unflatten runs on every replayed call)


def tree_flatten(obj) -> tuple[list, object]:
    """torch.utils._pytree.tree_flatten (tuples, lists, dicts and namedtuples are nodes): checked on
    2.11+cu130 and 2.13.0+cpu."""
    return _pytree.tree_flatten(obj)


def tree_unflatten(leaves: list, spec):
    """torch.utils._pytree.tree_unflatten, tree_flatten's inverse: checked on 2.11+cu130 and 2.13.0+cpu."""
    return _pytree.tree_unflatten(leaves, spec)


try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # (then every call takes the plain path)
    _get_current_dispatch_mode = None


def dispatch_mode_active() -> bool:
    """Is a TorchDispatchMode active on this thread (FakeTensorMode, a FLOP counter, a recorder)?
    torch.utils._python_dispatch._get_current_dispatch_mode: checked on 2.13.0+cpu and on
    2.11+cu130 (tests/gpu with FA4's calls replayed, 2026-11-29). Where it is missing: True (the
    caller then takes its plain path)."""
    return _get_current_dispatch_mode is None or _get_current_dispatch_mode() is not None


# ---- local attention kernels (aten ops, not public API) ----------------------------------
# aten._scaled_dot_product_flash_attention_for_cpu / _backward: checked on 2.13 and 2.15 (CPU):
# returns (out, logsumexp (B, H, L)); causal is top-left aligned; GQA accepted.
cpu_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def cuda_flash_ops():
    """aten._flash_attention_forward / _backward (BSHD or packed THD layout, cum_seq_q/k,
    window_size_left/right kwargs): checked on 2.11+cu130 (H200), present in the 2.13 schema."""
    return torch.ops.aten._flash_attention_forward.default, torch.ops.aten._flash_attention_backward.default


def flash_varlen_lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The logsumexp of aten._flash_attention_forward on packed (varlen) inputs: (Hq, total_q)
    float32 (FlashAttention-2 >= 2.6's unpadded layout; torch's meta function gives this shape
    on 2.13 and torch.nn.attention.varlen relies on it). Older builds padded it to
    (num_seqs, Hq, max_q); refuse that rather than misread it."""
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(
            f"dtcp: this torch's flash varlen kernel returned logsumexp of shape {tuple(lse.shape)}, not "
            f"(heads, total_q) = {(q.shape[1], q.shape[0])}; use strategy='ring' or backend='math'"
        )
    return lse


def flash_attention_differentiable(q, k, v, is_causal: bool, scale: float):
    """(out, lse) of aten._scaled_dot_product_flash_attention (autograd registered in
    derivatives.yaml; lse not differentiable). Called directly it skips SDPA's dispatcher checks,
    and `is_causal` with fewer queries than keys is FlashAttention-2's bottom-right causal mask
    (the dispatcher refuses that case; the kernel does it). Output fields [0], [1] (output,
    logsumexp (B, H, L) float32): checked in the schema of 2.11+cu130 and 2.13."""
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    return res[0], res[1]


def flash_varlen_forward_differentiable(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """(out (Tq, Hq, D), lse (Hq, Tq)) of aten._flash_attention_forward on packed sequences, with
    its registered autograd (derivatives.yaml), traceable by torch.compile; causal is bottom-right
    per sequence. Checked on 2.11+cu130 (H200) and in the 2.13 schema."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                          scale=scale)
    return out, flash_varlen_lse(lse, q)


def assert_async(flag: torch.Tensor, message: str) -> None:
    """Enqueue a check that `flag` (a one-element device tensor) is nonzero; a zero stops the
    device with `message` (a device-side assertion) without synchronising the host.
    torch._assert_async(tensor, msg): a CUDA kernel on 2.11+cu130; checked on 2.13 (CPU)."""
    torch._assert_async(flag, message)


def symm_mem_available() -> None:
    """Raise where torch has no symmetric memory (CPU builds, old releases)."""
    importlib.import_module("torch.distributed._symmetric_memory")


def cudnn_ops():
    """aten._scaled_dot_product_cudnn_attention / _backward: logsumexp comes back (B, H, L, 1);
    causal is top-left aligned. Checked on 2.11+cu130, cuDNN 9.19 (H200)."""
    return (
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default,
    )


def flex_attention_with_lse(flex_fn, q, k, v, block_mask, scale, enable_gqa, score_mod=None):
    """(out, lse) from flex_attention (or a torch.compile of it). torch.nn.attention.flex_attention
    takes return_aux=AuxRequest(lse=True) from 2.9 on (return_lse is deprecated there) and only
    return_lse before: checked on 2.11+cu130 and 2.13.0+cpu. lse is natural-log, float32."""
    from torch.nn.attention import flex_attention as fa

    if hasattr(fa, "AuxRequest"):
        out, aux = flex_fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                           return_aux=fa.AuxRequest(lse=True))
        return out, aux.lse
    return flex_fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                   return_lse=True)


def flash_attn_package_ops():
    """(forward, backward) of the flash-attn package (FA2), or None when it is not installed.
    flash_attn.flash_attn_interface._flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal,
    window_size_left, window_size_right, softcap, alibi_slopes, return_softmax) -> (out, lse,
    S_dmask, rng_state) and _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p,
    softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
    deterministic, rng_state) writing dq/dk/dv: checked on flash-attn 2.8.3 (BSHD layout, windows
    bottom-right aligned, GQA native)."""
    try:
        from flash_attn import flash_attn_interface as fai
    except ImportError:
        return None
    fwd, bwd = getattr(fai, "_flash_attn_forward", None), getattr(fai, "_flash_attn_backward", None)
    return None if fwd is None or bwd is None else (fwd, bwd)


# ---- autograd inside a custom op's implementation ----------------------------------------
class autograd_inside_custom_op:
    """A torch.library custom op's implementation runs with the Autograd dispatch keys excluded
    (thread-local), so nothing it computes records a graph. The flex backend's backward recomputes
    its block under autograd; this re-admits the Autograd and ADInplaceOrView keys for that block.
    torch._C._dispatch_tls_{is,set}_dispatch_key_excluded: checked on 2.11+cu130 and 2.13.0+cpu."""

    _KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)

    def __enter__(self):
        self.saved = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in self._KEYS]
        for k in self._KEYS:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
        self.grad_mode = torch.enable_grad()
        self.grad_mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.grad_mode.__exit__(*exc)
        for k, was in zip(self._KEYS, self.saved):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, was)
        return False


# ---- custom ops and tracing ----------------------------------------------------------------------
def plain_eager_call(*tensors) -> bool:
    """True when a call can bypass the custom op: not tracing, exact torch.Tensor inputs (no
    DTensor/fake/functional subclasses), no TorchDispatchMode and no functorch transform active.
    torch.utils._python_dispatch.is_in_torch_dispatch_mode (user and infra modes) and
    torch._C._functorch.peek_interpreter_stack: checked on 2.11+cu130, 2.13.0+cpu, 2.15.0."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


def all_concrete(*shapes) -> bool:
    """True when every size in `shapes` is a plain int (not a SymInt of a dynamic-shape trace)."""
    return all(type(s) is int for shape in shapes for s in shape)


def cudagraph_unsafe_tags() -> tuple:
    """Tags for ops that must not be captured in a CUDA graph (they talk to other ranks and read
    host-side state each call). torch.Tag.cudagraph_unsafe: present on 2.11+cu130, 2.13, 2.15;
    inductor's CUDA graph trees run such ops outside the graph."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    return () if tag is None else (tag,)


# ---- the SDPA builtin ---------------------------------------------------------------------------
def sdpa_functions() -> frozenset:
    """F.scaled_dot_product_attention is the builtin torch._C._nn.scaled_dot_product_attention, and a
    name imported from torch.nn.functional is that same object. Checked on 2.11, 2.13, 2.15.
    dtcp.context_parallel matches both in its TorchFunctionMode in case a release wraps one."""
    import torch.nn.functional as F

    return frozenset({F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention})


def optional_int(value) -> Optional[int]:
    return None if value is None else int(value)


# ---- torch.compile ---------------------------------------------------------------------------------
def mark_length_dynamic(t: torch.Tensor) -> torch.Tensor:
    """torch._dynamo.maybe_mark_dynamic(t, 0): a hint (never an error) that dim 0's size changes
    between calls, so torch.compile traces it symbolic from the first call instead of recompiling
    when it first changes. For tensors whose length is data (document boundaries). Checked on
    2.11, 2.13, 2.15."""
    torch._dynamo.maybe_mark_dynamic(t, 0)
    return t
