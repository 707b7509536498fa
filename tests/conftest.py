import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# The grouped matmul of tests/models.py's experts (every dtype but bfloat16) has torch._grouped_mm's meaning
# (Hugging Face's fallback op has its rule by name).
import fxdp  # noqa: E402
import models  # noqa: E402, F401  (defines the loop op registered below)
from fxdp.rules.grouped import grouped_mm_rule  # noqa: E402

fxdp.register_rule(grouped_mm_rule(torch.ops.fxdp_tests.loop_grouped_mm.default))

# Hypothesis draws many shapes: a recompile-limit hit must fail loudly, never run eager.
torch._dynamo.config.fail_on_recompile_limit_hit = True

# Under pytest-xdist (the README's `-n auto`) the workers share the cores.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
