import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Hypothesis draws many shapes: a recompile-limit hit must fail loudly, never run eager.
torch._dynamo.config.fail_on_recompile_limit_hit = True


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
