"""The base every recipe section derives from.

Sections are frozen pydantic models that forbid unknown keys: a typo in a recipe must be an
error that names the key, never a silently ignored setting.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError


class Section(BaseModel):
    # `.inf` and `.nan` are YAML floats: NaN passes every range check (an alpha of NaN read as
    # "must be <= 1"), and an infinite gate limit silently turns the gate off
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False
    )


def field_error(
    model: type[BaseModel], loc: tuple[str, ...], value: Any, message: str
) -> ValidationError:
    """An error of a check across fields, placed at the field to fix.

    A model validator's ValueError points at the whole section, so the recipe error would name
    the section's line; this one names `loc` (relative to `model`) and that field's line.
    """
    detail = InitErrorDetails(
        type=PydanticCustomError("value_error", message), loc=loc, input=value
    )
    return ValidationError.from_exception_data(model.__name__, [detail])
