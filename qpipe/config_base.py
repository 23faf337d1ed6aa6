"""The base every recipe section derives from.

Sections are frozen pydantic models that forbid unknown keys: a typo in a recipe must be an
error that names the key, never a silently ignored setting.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
