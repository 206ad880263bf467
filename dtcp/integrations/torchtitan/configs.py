"""Config functions for torchtitan 0.3.0 with dtcp as the context parallelism.

    torchrun --nproc-per-node 2 -m torchtitan.train \\
        --module dtcp.integrations.torchtitan.configs --config llama3_debug_dtcp \\
        --parallelism.context_parallel_degree 2 [--dtcp.layout zigzag --dtcp.strategy ring ...]

Each is torchtitan's own config function of the same model, through `dtcp_config`: the same
model, data, optimizer and schedule, dtcp's attention and input sharding. The ``dtcp`` section
(layout, strategy, backend, window_size, documents) is set here or on the command line.
"""

from ._patches import torchtitan_release

if torchtitan_release() < (0, 3):
    raise ImportError("dtcp.integrations.torchtitan.configs is for torchtitan 0.3.0 (Python config functions); "
                      "torchtitan 0.2.2 is installed, which takes TOML job configs (docs/integrations/torchtitan.md). "
                      "pip install torchtitan==0.3.0 (needs torch >= 2.14, Python >= 3.11)")

from torchtitan.trainer import Trainer  # noqa: E402

from ._v030 import DtcpTrainer, dtcp_config  # noqa: E402

__all__ = ["llama3_debug_dtcp", "llama3_8b_dtcp", "qwen3_debug_dtcp"]


def _with_cp(config: Trainer.Config, cp: int) -> Trainer.Config:
    config.parallelism.context_parallel_degree = cp
    return config


def llama3_debug_dtcp() -> DtcpTrainer.Config:
    """torchtitan's llama3_debugmodel (6 layers, dim 256, seq_len 2048, packed c4_test documents),
    CP=2 with dtcp: zigzag layout, auto strategy, documents on."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return dtcp_config(_with_cp(llama3_debugmodel(), 2), layout="zigzag", strategy="auto")


def llama3_8b_dtcp() -> DtcpTrainer.Config:
    """torchtitan's llama3_8b with dtcp, CP=2 (set the degree for your machine)."""
    from torchtitan.models.llama3.config_registry import llama3_8b

    return dtcp_config(_with_cp(llama3_8b(), 2), layout="zigzag", strategy="auto")


def qwen3_debug_dtcp() -> DtcpTrainer.Config:
    """torchtitan's qwen3_debugmodel (QK norm, GQA) with dtcp, CP=2."""
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

    return dtcp_config(_with_cp(qwen3_debugmodel(), 2), layout="zigzag", strategy="auto")
