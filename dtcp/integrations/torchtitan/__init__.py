"""dtcp as the context parallelism of torchtitan: 0.3.0 or 0.2.2, whichever is installed.

* torchtitan 0.3.0 (torch >= 2.14, Python >= 3.11; ``pip install "dtcp[torchtitan03]"``): Python
  config functions. ``dtcp.integrations.torchtitan.configs`` has ready ones
  (``--module dtcp.integrations.torchtitan.configs --config llama3_debug_dtcp``); any other
  config becomes dtcp's with `dtcp_config` (``DtcpTrainer.Config`` with a ``dtcp`` section:
  layout, strategy, backend, window_size, documents). See ``_v030`` for what it changes.
* torchtitan 0.2.2 (``pip install "dtcp[torchtitan]"``): TOML job configs with a ``[dtcp]``
  section and the ``llama3_dtcp`` train spec. See ``_v022``.

docs/integrations/torchtitan.md has both recipes.
"""

from ._patches import torchtitan_release

if torchtitan_release() >= (0, 3):
    from ._v030 import *  # noqa: F401,F403
    from ._v030 import __all__  # noqa: F401
else:
    from ._v022 import *  # noqa: F401,F403
    from ._v022 import __all__  # noqa: F401
    # the tests of the 0.2.2 integration reach these
    from ._v022 import _LAYOUTS, _dtcp_cp_shard, _dtcp_parallelize, _own_cp_mesh  # noqa: F401
