"""torchtune's source tree made importable for the fixture scripts that run its code."""

import os
import sys
import types


def install_nf4_stub():
    """Stubs torchao's NF4 tensor module: torchtune imports it at package import (and later
    torchao releases moved it), and code that quantizes nothing does not use it."""
    nf4 = types.ModuleType("torchao.dtypes.nf4tensor")
    nf4.NF4Tensor = type("NF4Tensor", (), {})
    nf4.linear_nf4 = lambda *a, **k: None
    nf4.to_nf4 = lambda *a, **k: None
    nf4.implements = lambda *a, **k: (lambda f: f)
    sys.modules["torchao.dtypes.nf4tensor"] = nf4


def use_torchtune_source():
    """Puts torchtune's source (`TORCHTUNE_SRC`, default /tmp/tt/src) first on `sys.path`, with
    torchao's NF4 tensor stubbed (the functions the fixture scripts run do not use it)."""
    install_nf4_stub()
    sys.path.insert(0, os.environ.get("TORCHTUNE_SRC", "/tmp/tt/src"))
