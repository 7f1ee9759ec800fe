"""Files from outside the checkout that some tests read, each named by an environment variable.

Whether such a test runs is decided by the variable, never by a fixed path that happens to hold
something: a partial unpack left at a fixed temp-folder path once made a test run, and fail, on a
machine that had never been asked to run it. Unset, the test skips and says which variable to set
and how to fill the folder it names.

``BISTAT_VLLM_WHEELS``
    a folder holding vLLM's wheels as PyPI names them
    (``pip download vllm==0.34.0 --no-deps -d DIR``).
``BISTAT_VLLM_SDISTS``
    a folder holding vLLM's source archives (``pip download vllm==0.34.0 --no-deps --no-binary
    :all: -d DIR``).
``SGLANG_SITE``
    a site folder SGLang 0.5.23 is installed into (``pip install --target DIR sglang==0.5.23``).
``BISTAT_SGLANG_SITE``
    the SGLang payload's whole site: every wheel ``build_payload.sh`` downloads with
    ``PAYLOAD=sglang``, unpacked into one folder (as ``scripts/device/site_install.sh`` installs it).
``BISTAT_SGLANG_WHEELS``
    that payload's downloaded wheels (``build_payload.sh``'s ``$W/payload/whl``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

WHEELS_VAR = "BISTAT_VLLM_WHEELS"
SDISTS_VAR = "BISTAT_VLLM_SDISTS"
SGLANG_SITE_VAR = "SGLANG_SITE"
SGLANG_PAYLOAD_SITE_VAR = "BISTAT_SGLANG_SITE"
SGLANG_WHEELS_VAR = "BISTAT_SGLANG_WHEELS"


def named_folder(var: str, how: str) -> Path:
    """The folder the environment variable ``var`` names; the test skips where it is unset."""
    value = os.environ.get(var, "")
    if not value:
        pytest.skip(f"{var} is not set: set it to a folder that holds the file ({how})")
    return Path(value)


def named_file(var: str, name: str, how: str) -> Path:
    """``name`` in the folder ``var`` names; the test skips where the variable is unset or the
    folder lacks the file."""
    path = named_folder(var, how) / name
    if not path.is_file():
        pytest.skip(f"{path} is missing ({var} names {path.parent}; {how})")
    return path


def vllm_wheel_name(version: str) -> str:
    return f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"


def vllm_wheel(version: str) -> Path:
    """vLLM ``version``'s wheel from the folder ``BISTAT_VLLM_WHEELS`` names."""
    return named_file(WHEELS_VAR, vllm_wheel_name(version),
                      f"pip download vllm=={version} --no-deps -d ${WHEELS_VAR}")


def vllm_sdist(version: str) -> Path:
    """vLLM ``version``'s source archive from the folder ``BISTAT_VLLM_SDISTS`` names."""
    return named_file(SDISTS_VAR, f"vllm-{version}.tar.gz",
                      f"pip download vllm=={version} --no-deps --no-binary :all: -d ${SDISTS_VAR}")
