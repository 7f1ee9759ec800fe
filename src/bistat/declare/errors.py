"""The declaration stage's errors, in a module of their own so that a command can catch them
without loading the declaration's models (pydantic) or the design analysis first."""

from __future__ import annotations

__all__ = ["DeclarationError", "DesignError"]


class DeclarationError(ValueError):
    """A declaration that cannot be used; ``messages`` holds one line per problem."""

    def __init__(self, messages: list[str]):
        self.messages = list(messages)
        super().__init__("\n".join(self.messages))


class DesignError(ValueError):
    """The design analysis cannot be made (e.g. ``design.cv_from`` names no usable run)."""
