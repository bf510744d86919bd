"""Old keywords of a function whose options moved into a config object, for one release.

A function that took its options as keywords and now takes ``config=`` keeps accepting
the old keywords: :func:`config_from_keywords` builds the config from them and warns
(``DeprecationWarning``, naming each keyword and the config call that replaces it), and
refuses a call that gives both forms, so no option is silently dropped.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, TypeVar

import attrs

__all__ = ["config_from_keywords"]

C = TypeVar("C")


def config_from_keywords(
    where: str, cls: type[C], config: C | None, keywords: Mapping[str, Any], *, stacklevel: int = 3
) -> C:
    """The config that ``config=`` or the old ``keywords`` of ``where`` describe.

    Args:
      where: the function's name as its errors say it (``"scan_layers"``).
      cls: the attrs config class; its fields are the old keywords' names.
      config: the ``config=`` argument, or None.
      keywords: the old keywords given (non-empty).
      stacklevel: of the warning, counted from this function (3: the caller of ``where``).

    Returns:
      ``cls(**keywords)`` (its validators run).

    Raises:
      TypeError: a keyword that is no field of ``cls`` (as Python says it for an unknown
        keyword, with the fields listed), or both ``config`` and an old keyword.
    """
    fields = attrs.fields_dict(cls)  # type: ignore[arg-type]
    unknown = [k for k in keywords if k not in fields]
    if unknown:
        raise TypeError(
            f"{where}() got an unexpected keyword argument {unknown[0]!r}; its options are "
            f"{cls.__name__}'s fields: {', '.join(fields)}."
        )
    given = ", ".join(f"{k}=..." for k in keywords)
    if config is not None:
        raise TypeError(
            f"{where}: both config= and the old keyword(s) {given} were given; put them in the config: "
            f"config=attrs.evolve(config, {given})."
        )
    warnings.warn(
        f"{where}: the keyword(s) {', '.join(keywords)} are deprecated and will be removed in the next "
        f"release; pass config={cls.__name__}({given}).",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return cls(**keywords)
