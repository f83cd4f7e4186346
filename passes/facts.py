"""The two ways a fact rides on the IR, each a typed object with its accessor beside the pass that adds it.

- `ModelFact`: a dataclass saved as JSON in the model's `metadata_props[KEY]` (it survives `--dump-ir` and
  reaches the artifact writer). `attach(model)` writes it, `of(model)` reads it back typed; `to_json` /
  `from_json` say how where `asdict` / `cls(**data)` do not fit. Nothing else reads its JSON by keys
  (tests/test_facts.py checks it).
- `write_entry` / `read_entry`: the same for a fact whose type is not a ModelFact (the manifest's sections, defined
  in the runtime, which cannot import this module).
- `MemoryFact`: an object too large to serialise (profiled activations, calibration sequences), held on the
  in-memory IR's `meta[META_KEY]`, never saved.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any, ClassVar

import onnx_ir as ir


def write_entry(model: ir.Model, key: str, fact: Any, sort_keys: bool = False) -> None:
    """Save `fact` (anything with `to_json`) as the JSON of `model.metadata_props[key]`."""
    model.metadata_props[key] = json.dumps(fact.to_json(), sort_keys=sort_keys)


def read_entry(model: ir.Model, key: str, kind: Any) -> Any:
    """`model.metadata_props[key]` read back as `kind` (its `from_json`); None where no pass wrote it."""
    text = model.metadata_props.get(key)
    return None if text is None else kind.from_json(json.loads(text))


class ModelFact:
    """Base of a dataclass saved as JSON in `model.metadata_props[KEY]`."""

    KEY: ClassVar[str]
    SORT_KEYS: ClassVar[bool] = False  # json.dumps(sort_keys=...): as the entry has always been written

    def to_json(self) -> Any:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any):
        return cls(**data)

    def attach(self, model: ir.Model) -> None:
        write_entry(model, self.KEY, self, self.SORT_KEYS)

    @classmethod
    def of(cls, model: ir.Model):
        """The model's fact; where no pass attached one, `missing()` (None unless the fact says otherwise)."""
        found = read_entry(model, cls.KEY, cls)
        return cls.missing() if found is None else found

    @classmethod
    def missing(cls):
        return None


class ValueFact(ModelFact):
    """A `ModelFact` of one field whose JSON is that field's value itself (a number, a mapping), as the entry has
    always been written, not an object of fields."""

    def to_json(self) -> Any:
        return getattr(self, fields(self)[0].name)

    @classmethod
    def from_json(cls, data: Any):
        return cls(data)


class MemoryFact:
    """Base of an object held on the in-memory IR's `meta[META_KEY]` (never saved); `of` raises `MISSING`
    where the pass that adds it has not run."""

    META_KEY: ClassVar[str]
    MISSING: ClassVar[str]

    def attach(self, model: ir.Model) -> None:
        model.meta[self.META_KEY] = self

    @classmethod
    def of(cls, model: ir.Model):
        found = model.meta.get(cls.META_KEY)
        if found is None:
            raise ValueError(cls.MISSING)
        return found
