"""Expecting fxdp's refusals, which Dynamo may wrap."""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

import fxdp


def unwrap(err: BaseException) -> BaseException:
    """The backend's own exception (Dynamo wraps it in ``BackendCompilerFailed``)."""
    while isinstance(err, torch._dynamo.exc.BackendCompilerFailed):
        err = err.inner_exception
    return err


@contextlib.contextmanager
def refused(match: str):
    """Expect an ``fxdp.UnsupportedError`` (possibly wrapped by Dynamo) matching ``match``."""
    with pytest.raises(Exception) as info:
        yield info
    err = unwrap(info.value)
    assert isinstance(err, fxdp.UnsupportedError), f"expected fxdp.UnsupportedError, got {type(err)!r}: {err}"
    assert re.search(match, str(err)), f"{match!r} not in:\n{err}"
    info.unsupported = err
