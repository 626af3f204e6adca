"""FeatureSpec: what the fields of a dataset are. Models and the DES field plan read it.

    >>> spec = criteo_spec(dim=8)
    >>> spec.names()[:3], spec["C1"].kind
    (['I1', 'I2', 'I3'], 'categorical')
"""
from __future__ import annotations

import dataclasses
import json
from typing import Iterator

KINDS = ("categorical", "multi", "numeric")
ID_BITS = 55                       # feature ids lie in [0, 2**ID_BITS) (des.data.hashing makes them so)
ID_MASK = (1 << ID_BITS) - 1


@dataclasses.dataclass(frozen=True)
class Field:
    """One input field.

    kind: ``categorical`` (one id per sample), ``multi`` (up to ``max_len`` ids per
    sample, padded with ``PAD_ID``, sum-pooled) or ``numeric`` (one float).
    cardinality: expected number of distinct ids, if known (used by the DES plan).
    weighted: a multi field also has a float weight per id (libsvm/libffm ``idx:val``),
    fed as the input ``weight_name`` and pooled as sum_l w_l * e(id_l).
    """
    name: str
    kind: str = "categorical"
    dim: int = 8
    cardinality: int | None = None
    max_len: int = 1
    weighted: bool = False

    @property
    def weight_name(self) -> str:
        """Name of the weights input of a weighted field."""
        return f"{self.name}_weight"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"field {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "multi" and self.max_len < 1:
            raise ValueError(f"field {self.name!r}: a multi-valued field needs max_len >= 1")
        if self.weighted and self.kind != "multi":
            raise ValueError(f"field {self.name!r}: only a multi-valued field can be weighted")


PAD_ID = -1  # padding id of multi-valued fields; it is masked out and never trained


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """An ordered list of fields plus the label name."""
    fields: tuple[Field, ...]
    label: str = "label"

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate field names in spec: {names}")

    def __iter__(self) -> Iterator[Field]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __getitem__(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def sparse(self) -> list[Field]:
        """Fields that are looked up in embedding tables."""
        return [f for f in self.fields if f.kind != "numeric"]

    def input_names(self) -> list[str]:
        """Every model input: field names, plus the weights input of each weighted field."""
        return [n for f in self.fields for n in ([f.name, f.weight_name] if f.weighted else [f.name])]

    def with_dim(self, dim: int) -> "FeatureSpec":
        return FeatureSpec(tuple(dataclasses.replace(f, dim=dim) for f in self.fields), self.label)

    def with_cardinalities(self, cardinalities: dict[str, int]) -> "FeatureSpec":
        """The fields whose cardinality is unknown take it from ``cardinalities`` (by name).

        >>> spec = FeatureSpec((Field("F0", "multi", 8), Field("F1", "multi", 8, cardinality=7)))
        >>> [f.cardinality for f in spec.with_cardinalities({"F0": 5, "F1": 9})]
        [5, 7]
        """
        return FeatureSpec(tuple(f if f.cardinality or f.name not in cardinalities else
                                 dataclasses.replace(f, cardinality=int(cardinalities[f.name]))
                                 for f in self.fields), self.label)

    def to_json(self) -> str:
        return json.dumps({"label": self.label, "fields": [dataclasses.asdict(f) for f in self.fields]})

    @staticmethod
    def from_json(text: str) -> "FeatureSpec":
        d = json.loads(text)
        return FeatureSpec(tuple(Field(**f) for f in d["fields"]), d["label"])


CRITEO_INT = [f"I{i}" for i in range(1, 14)]
CRITEO_CAT = [f"C{i}" for i in range(1, 27)]


def criteo_spec(dim: int = 8, numeric: bool = False,
                cardinalities: dict[str, int] | None = None) -> FeatureSpec:
    """Criteo: I1..I13 log-bucketed to categorical ids, C1..C26 hashed.

    numeric=True adds I1..I13 also as numeric fields ``I1_num``.. (log1p of max(v, 0)).
    """
    card = cardinalities or {}
    fields = [Field(n, "categorical", dim, card.get(n)) for n in CRITEO_INT + CRITEO_CAT]
    if numeric:
        fields += [Field(f"{n}_num", "numeric", 1) for n in CRITEO_INT]
    return FeatureSpec(tuple(fields))


AVAZU_COLUMNS = ["id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain",
                 "site_category", "app_id", "app_domain", "app_category", "device_id",
                 "device_ip", "device_model", "device_type", "device_conn_type",
                 "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21"]
AVAZU_FIELDS = ["hour_of_day", "weekday"] + AVAZU_COLUMNS[3:]


def avazu_spec(dim: int = 8) -> FeatureSpec:
    """Avazu: hour (YYMMDDHH) becomes hour_of_day and weekday; the id column is dropped."""
    return FeatureSpec(tuple(Field(n, "categorical", dim) for n in AVAZU_FIELDS))
